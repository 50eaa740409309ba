"""HART's text input: a Qwen2 decoder (base model, no LM head) from a local ``transformers`` folder,
and the reference's prompt encoding (research/hart.md §3).

Each prompt is tokenized on its own, padded to ``HART_MAX_LENGTH`` (300) tokens and truncated there;
the mask marks the non-pad ids and HART's position ids are cumsum(mask) − 1 (pads repeat the last
real position). The fixed system prompt is tokenized without padding and put in front; Qwen2 runs
on [system ‖ prompt] with the mask, and HART keeps the last layer's hidden states (after the final
norm) of the 300 prompt slots, pads included, as float32.

Nothing is downloaded: the folder must hold ``config.json``, the weights and the tokenizer files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch

HART_MAX_LENGTH = 300
QWEN2_HINT = ("the Qwen2 text encoder HART was trained with (Hugging Face mit-han-lab/Qwen2-VL-1.5B-Instruct: "
              "config.json, model*.safetensors, tokenizer.json / vocab.json + merges.txt, tokenizer_config.json)")
# The reference's system prompt (hart/utils/constants.py): the text the released model saw before
# every prompt during training, so it is part of the model's input format.
HART_SYSTEM_PROMPT = (
    'Given a user prompt, generate an "Enhanced prompt" that provides detailed visual descriptions suitable for '
    'image generation.\n\nExamples:\n- User Prompt: A cat sleeping -> A small, fluffy white cat curled up in a '
    'round shape, sleeping peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.\n- '
    'User Prompt: A busy city street -> A bustling city street scene at dusk, featuring glowing street lamps, a '
    'diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass '
    'skyscrapers.\n\nPlease generate only the enhanced description for the prompt below and DO NOT include any '
    'additional sentences. Start your response with "Enhanced Prompt:".\n\nUser Prompt:\n')


def load_qwen2(path, dtype: torch.dtype = torch.float32, tokenizer_path=None, variant=None):
    """(tokenizer, Qwen2 base model) from a local folder (the tokenizer from ``tokenizer_path`` when
    given: a pipeline folder keeps it apart), frozen and in eval mode; ``variant``: the weights'
    variant files. A missing or unreadable folder raises an error naming it and what to put there."""
    from transformers import AutoModel, AutoTokenizer

    from .loading import check_finite

    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        raise FileNotFoundError(f"text encoder folder {p} not found or without config.json: put {QWEN2_HINT} there "
                                f"and pass that folder as text_encoder=...; nothing is downloaded")
    loaded = []
    for cls, what, folder, kw in ((AutoTokenizer, "tokenizer", tokenizer_path or p, {}),
                                  (AutoModel, "Qwen2 model", p, {"variant": variant} if variant else {})):
        try:
            loaded.append(cls.from_pretrained(str(folder), local_files_only=True, **kw))
        except Exception as e:  # transformers raises OSError / ValueError / ImportError variants
            raise ValueError(f"{p}: the {what} could not be loaded ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}); put {QWEN2_HINT} there") from None
    tokenizer, model = loaded
    if tokenizer.pad_token_id is None:
        raise ValueError(f"{p}: the tokenizer has no pad token; HART pads prompts to {HART_MAX_LENGTH} tokens with it "
                         f"(Qwen2's is <|endoftext|>): put {QWEN2_HINT} there")
    check_finite(model, p, "Qwen2 model")
    return tokenizer, model.to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def encode_hart_prompts(tokenizer, model, prompts: Union[str, Sequence[str]], max_length: int = HART_MAX_LENGTH,
                        system_prompt: str = HART_SYSTEM_PROMPT):
    """(context (B, T, D) float32, mask (B, T) bool, position ids (B, T) int64) of the prompts."""
    if isinstance(prompts, str):
        prompts = [prompts]
    dev = next(model.parameters()).device
    ids = torch.stack([tokenizer(p, return_tensors="pt", padding="max_length", max_length=max_length,
                                 truncation=True).input_ids[0] for p in prompts]).to(dev)
    mask = ids != tokenizer.pad_token_id
    pos = torch.cumsum(mask, dim=1) - 1
    sys_ids = tokenizer(system_prompt, return_tensors="pt", padding="longest", max_length=max_length,
                        truncation=True).input_ids.to(dev).repeat(len(prompts), 1)
    full_mask = torch.cat((torch.ones_like(sys_ids, dtype=torch.bool), mask), dim=1)
    hidden = model(torch.cat((sys_ids, ids), dim=1), attention_mask=full_mask.long(),
                   output_hidden_states=True).hidden_states[-1]
    return hidden[:, sys_ids.shape[1]:].float(), mask, pos


def random_qwen2(hidden: int, seed: int = 0, vocab_words: Sequence[str] = ()):
    """A small random (tokenizer, Qwen2 base model) of width ``hidden`` for models built from random
    weights (benchmarks, tests): a word-level tokenizer (``w3`` … ``w255`` and ``vocab_words``;
    unknown words map to <unk>, pad id 0) and one decoder layer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2Model

    vocab = {"<pad>": 0, "<unk>": 1}
    for w in [f"w{i}" for i in range(3, 256)] + list(vocab_words):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                        model_max_length=4096)
    heads = max(1, hidden // 64)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                      pad_token_id=0, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2Model(cfg)
    return tokenizer, model.eval().requires_grad_(False)


def random_qwen2_1_5b(device, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """(tokenizer, Qwen2Model) of Qwen2-1.5B's size (28 layers, width 1536, 12 query and 2 key/value
    heads, SwiGLU of 8960, 151 936-token vocabulary; 1.54 B parameters) with random weights, built
    on ``device``: for memory and speed benchmarks, which must hold and run the encoder HART uses.
    The tokenizer is :func:`random_qwen2`'s word-level one."""
    from transformers import Qwen2Config, Qwen2Model
    tokenizer, _ = random_qwen2(1536, seed=seed)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, pad_token_id=0, tie_word_embeddings=True)
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), dev:
        torch.manual_seed(seed)
        model = Qwen2Model(cfg).to(dtype)
    return tokenizer, model.eval().requires_grad_(False)


__all__ = ["HART_MAX_LENGTH", "HART_SYSTEM_PROMPT", "load_qwen2", "encode_hart_prompts", "random_qwen2",
           "random_qwen2_1_5b"]
