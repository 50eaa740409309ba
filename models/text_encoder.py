"""Infinity's text input: a Flan-T5 encoder from a local ``transformers`` folder, and the packed
("varlen") prompt features the transformer reads (research/infinity.md §1.1).

Official length handling: the tokenizer appends EOS and truncates at 512 tokens; only the valid
tokens (attention mask 1) of each prompt are kept, stacked over the batch. The encoder output is
``last_hidden_state`` (after T5's final RMS norm) in float32. Padding to the longest prompt instead
of to 512 gives the same valid outputs (the padding is masked out).

Nothing is downloaded: the folder must hold ``config.json``, the weights and the tokenizer files
(``tokenizer.json``, or ``spiece.model`` with the ``sentencepiece`` package).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

T5_MAX_LENGTH = 512          # the official tokenizer's max_length (truncation)
FLAN_T5_HINT = ("the Flan-T5-XL encoder Infinity was trained with (Hugging Face google/flan-t5-xl: config.json, "
                "model*.safetensors or pytorch_model*.bin, tokenizer.json / spiece.model, tokenizer_config.json)")


@dataclass(frozen=True)
class TextFeatures:
    """Packed prompt features: the valid T5 tokens of every prompt stacked along one axis.

    kv_compact_NC: (sum(lens), Ct5) float32 — prompt b owns rows [cu[b], cu[b+1]).
    lens: tokens per prompt (EOS included), each >= 1.
    """

    kv_compact_NC: torch.Tensor
    lens: tuple[int, ...]

    def __post_init__(self):
        if self.kv_compact_NC.ndim != 2:
            raise ValueError(f"kv_compact must be (tokens, channels), got shape {tuple(self.kv_compact_NC.shape)}")
        if any(int(n) < 1 for n in self.lens):
            raise ValueError(f"every prompt needs at least one token (its EOS), got lens {list(self.lens)}")
        if sum(self.lens) != self.kv_compact_NC.shape[0]:
            raise ValueError(f"lens {list(self.lens)} add up to {sum(self.lens)} tokens, kv_compact has "
                             f"{self.kv_compact_NC.shape[0]}")

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def channels(self) -> int:
        return self.kv_compact_NC.shape[1]

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.lens:
            out.append(out[-1] + int(n))
        return out

    def per_prompt(self) -> list[torch.Tensor]:
        cu = self.cu_seqlens
        return [self.kv_compact_NC[cu[b]:cu[b + 1]] for b in range(self.batch)]

    @classmethod
    def cat(cls, parts: Sequence["TextFeatures"]) -> "TextFeatures":
        return cls(torch.cat([p.kv_compact_NC for p in parts], dim=0), tuple(n for p in parts for n in p.lens))

    def repeat_each(self, n: int) -> "TextFeatures":
        """Every prompt repeated ``n`` times in place (num_images_per_prompt)."""
        if n == 1:
            return self
        rows = [t for t in self.per_prompt() for _ in range(n)]
        return TextFeatures(torch.cat(rows, dim=0), tuple(m for m in self.lens for _ in range(n)))

    def select(self, index: Sequence[int]) -> "TextFeatures":
        rows = self.per_prompt()
        return TextFeatures(torch.cat([rows[i] for i in index], dim=0), tuple(self.lens[i] for i in index))

    def to(self, device=None, dtype=None) -> "TextFeatures":
        return TextFeatures(self.kv_compact_NC.to(device=device, dtype=dtype), self.lens)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, Ct5) features zero-padded to the longest prompt and the (B, T) bool key mask."""
        B, T = self.batch, max(self.lens)
        x = self.kv_compact_NC
        out_BTC = x.new_zeros(B, T, x.shape[1])
        mask_BT = torch.zeros(B, T, dtype=torch.bool, device=x.device)
        for b, t in enumerate(self.per_prompt()):
            out_BTC[b, :t.shape[0]] = t
            mask_BT[b, :t.shape[0]] = True
        return out_BTC, mask_BT


def pack_hidden_states(hidden_BTC: torch.Tensor, mask_BT: torch.Tensor) -> TextFeatures:
    """The official packing: keep each prompt's valid tokens (mask 1), stacked in batch order."""
    lens = [int(n) for n in mask_BT.sum(dim=-1).tolist()]
    rows = [hidden_BTC[b, :n] for b, n in enumerate(lens)]
    return TextFeatures(torch.cat(rows, dim=0).float(), tuple(lens))


def check_text_encoder_folder(path) -> Path:
    """A local T5 folder, or a FileNotFoundError saying what to put where (nothing is downloaded)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"text encoder folder not found: {p}. Put {FLAN_T5_HINT} there and pass that folder "
                                f"as text_encoder=...; nothing is downloaded")
    if not p.is_dir():
        raise ValueError(f"text_encoder={str(p)!r} is a file; pass the folder that holds {FLAN_T5_HINT}")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json: it is not a transformers model folder. Put {FLAN_T5_HINT} "
                                f"there")
    check_tokenizer_files(p, f"Put {FLAN_T5_HINT} there")
    return p


TOKENIZER_FILES = ("tokenizer.json", "spiece.model")


def check_tokenizer_files(folder, fix: str) -> None:
    """That ``folder`` holds a T5 vocabulary (``tokenizer.json`` or ``spiece.model``): without one,
    transformers builds a tokenizer with no vocabulary, which turns every prompt into the same unknown
    tokens. A FileNotFoundError naming the folder and ``fix`` otherwise."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder} holds no tokenizer vocabulary (neither {' nor '.join(TOKENIZER_FILES)}), "
                                f"so every prompt would become the same unknown tokens. {fix}")


def load_t5(path, dtype: torch.dtype = torch.float32, tokenizer_path=None, fix: Optional[str] = None,
            variant: Optional[str] = None):
    """(tokenizer, T5EncoderModel) from a local folder, frozen and in eval mode: a Flan-T5 folder, or a
    pipeline folder's ``text_encoder/`` with its ``tokenizer/`` apart (``tokenizer_path``; ``fix``:
    what its errors advise). ``variant``: the weights' variant files (``model.<variant>.safetensors``).
    A folder transformers cannot read raises a ValueError naming it.

    A full T5 (encoder + decoder, as google/flan-t5-xl ships) loads too: the decoder weights are
    left out, like the official loader does.
    """
    from transformers import AutoTokenizer, T5EncoderModel

    from .loading import check_finite, check_saved_text_encoder

    if tokenizer_path is None:
        path = tokenizer_path = check_text_encoder_folder(path)
        fix = f"put {FLAN_T5_HINT} there"
        check_saved_text_encoder(path, fix=fix, variant=variant)
    else:
        check_tokenizer_files(tokenizer_path, fix[0].upper() + fix[1:])
    loaded = []
    for cls, folder, what, kw in ((AutoTokenizer, tokenizer_path, "tokenizer", {}),
                                  (T5EncoderModel, path, "T5 encoder", {"variant": variant} if variant else {})):
        try:
            loaded.append(cls.from_pretrained(str(folder), local_files_only=True, **kw))
        except Exception as e:  # transformers raises OSError / ValueError / ImportError variants
            raise ValueError(f"{folder}: the {what} could not be loaded ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''}); {fix}") from None
    tokenizer, model = loaded
    check_finite(model, path, "T5 encoder")
    return tokenizer, model.to(dtype).eval().requires_grad_(False)


def tokenize(tokenizer, prompts: Sequence[str], max_length: int = T5_MAX_LENGTH):
    """(input_ids, attention_mask) (B, T) int64: EOS appended, truncated at ``max_length``, padded to the
    longest prompt."""
    tok = tokenizer(list(prompts), max_length=max_length, padding="longest", truncation=True, return_tensors="pt")
    return tok.input_ids, tok.attention_mask


@torch.no_grad()
def encode_token_ids(text_encoder, input_ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> TextFeatures:
    """Packed float32 T5 features of tokenised prompts (what Infinity's transformer reads)."""
    device = next(text_encoder.parameters()).device
    ids, mask = input_ids_BT.to(device), mask_BT.to(device)
    if bool((mask.sum(dim=-1) == 0).any()):
        raise ValueError("a prompt tokenised to zero tokens; every prompt needs at least its EOS token")
    hidden = text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return pack_hidden_states(hidden.float(), mask.bool())


def encode_prompts(tokenizer, text_encoder, prompts: Union[str, Sequence[str]],
                   max_length: int = T5_MAX_LENGTH) -> TextFeatures:
    """Prompts → packed T5 features (official tokenisation and packing)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    ids, mask = tokenize(tokenizer, prompts, max_length)
    return encode_token_ids(text_encoder, ids, mask)


def random_t5(d_model: int, seed: int = 0, vocab_words: Optional[Sequence[str]] = None, num_layers: int = 1):
    """A small random (tokenizer, T5EncoderModel) of width ``d_model`` and ``num_layers`` blocks — for
    models built from random weights (benchmarks, smoke tests), whose text encoder only has to
    produce features of the right width. The tokenizer is a word-level one over a few hundred words (unknown words map to <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = list(vocab_words) if vocab_words is not None else [f"w{i}" for i in range(3, 256)]
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                        model_max_length=T5_MAX_LENGTH)
    heads = max(1, d_model // 64)
    cfg = T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=d_model // heads, d_ff=2 * d_model, num_layers=num_layers,
                   num_decoder_layers=1, num_heads=heads, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                   is_encoder_decoder=False, use_cache=False, pad_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = T5EncoderModel(cfg)
    return tokenizer, model.eval().requires_grad_(False)


def random_t5_xl(device, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """(tokenizer, T5EncoderModel) of Flan-T5-XL's encoder size (24 layers, width 2048, 32 heads,
    gated-GELU FFN of 5120, 32128-token vocabulary; 1.2 B parameters) with random weights, built on
    ``device``: for memory and speed benchmarks, which must hold and run the encoder the released
    Infinity models use. The tokenizer is :func:`random_t5`'s word-level one."""
    from transformers import T5Config, T5EncoderModel
    tokenizer, _ = random_t5(2048, seed=seed)
    cfg = T5Config(vocab_size=32128, d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_decoder_layers=24,
                   num_heads=32, feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False,
                   use_cache=False, pad_token_id=0, eos_token_id=1)
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), dev:
        torch.manual_seed(seed)
        model = T5EncoderModel(cfg).to(dtype)
    return tokenizer, model.eval().requires_grad_(False)


__all__ = ["TextFeatures", "pack_hidden_states", "load_t5", "tokenize", "encode_token_ids", "encode_prompts",
           "random_t5", "random_t5_xl", "check_text_encoder_folder", "check_tokenizer_files", "T5_MAX_LENGTH"]
