"""HARTPipeline: HART text-to-image generation (hybrid tokens: codes + a diffusion residual), diffusers style.

    pipe = HARTPipeline.from_single_file("hart-0.7b-1024px/llm", "hart-0.7b-1024px/tokenizer",
                                         text_encoder="Qwen2-VL-1.5B-Instruct/", dtype=torch.bfloat16).to("cuda")
    out = pipe("a red fox in the snow", generator=torch.Generator("cuda").manual_seed(0))
    out.images[0].save("fox.png"); print(out.stats[0].summary())

1024 × 1024 only (the schedule is square and the text positions offset its grid). The defaults follow
the reference's sample.py: guidance 4.5 on its ramp, the hard-coded top-k rule (600 below scale 7,
then 300), no top-p, smooth sampling (``more_smooth``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from ..engine.contract import Policy
from ..engine.sampler import phase
from ..engine.state import GenerationStats
from ..models.hart import HART_PRESETS, HARTAdapter, HARTConditioning, HARTTransformer, hart_loop_flops
from ..models.hart_text import encode_hart_prompts, load_qwen2, random_qwen2
from ..models.vqvae import MultiScaleVQVAE
from ._accelerated import AcceleratedPipelineMixin, _dtype_of
from .defaults import HART_DEFAULTS

PRESET_FAMILY = "hart"             # key of the policy presets (SPARSEVAR_PRESETS / FASTVAR_PRESETS / SPARVAR_PRESETS)


@dataclass
class HARTPipelineOutput(BaseOutput):
    """images: list of PIL images, (B, H, W, 3) float array in [0, 1], (B, 3, H, W) tensor in [0, 1], or
    the latent (B, Cvae, 64, 64); stats: per-scale statistics of the generation (one entry per call)."""

    images: Union[list, np.ndarray, torch.Tensor]
    stats: list


class HARTPipeline(AcceleratedPipelineMixin, DiffusionPipeline):
    """Text-to-image next-scale prediction with HART's hybrid tokenizer and pluggable acceleration.

    Components: ``transformer`` (:class:`HARTTransformer`, with its diffusion head), ``vqvae`` (the
    hybrid tokenizer, a :class:`MultiScaleVQVAE` with ``phi_on_last=False``), ``text_encoder`` (a
    ``transformers`` Qwen2 base model) and ``tokenizer`` (its tokenizer).
    """

    PRESET_FAMILY = PRESET_FAMILY
    DEFAULTS = HART_DEFAULTS
    _output_class = HARTPipelineOutput
    model_cpu_offload_seq = "text_encoder->transformer->vqvae"
    _callback_tensor_inputs = ["codes", "logits", "latents", "latent"]

    def __init__(self, transformer: HARTTransformer, vqvae: MultiScaleVQVAE, text_encoder, tokenizer,
                 sparsevar_calibration: Optional[dict] = None,
                 scalekv_calibration: Optional[dict] = None):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae, text_encoder=text_encoder, tokenizer=tokenizer)
        width = getattr(getattr(text_encoder, "config", None), "hidden_size", None)
        if width is not None and width != transformer.config.context_dim:
            raise ValueError(f"text encoder and transformer do not match: the Qwen2 model produces {width}-channel "
                             f"states, the transformer reads {transformer.config.context_dim}; pass the text encoder "
                             f"the model was trained with (Qwen2-1.5B for the released HART)")
        self.set_sparsevar_calibration(sparsevar_calibration)
        self.set_scalekv_calibration(scalekv_calibration)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_single_file(cls, llm, tokenizer_folder, text_encoder, dtype: Union[torch.dtype, str] = torch.float32,
                         vae_dtype: Union[torch.dtype, str] = torch.float32,
                         text_encoder_dtype: Union[torch.dtype, str] = torch.float32) -> "HARTPipeline":
        """Load the official folders: ``llm`` (the transformer: config.json + ema_model.bin or
        model.safetensors), ``tokenizer_folder`` (the hybrid tokenizer: config.json + model.safetensors)
        and ``text_encoder`` (a local Qwen2 folder, weights + tokenizer). dtype: the transformer's;
        vae_dtype: the tokenizer's; text_encoder_dtype: Qwen2's (the reference runs it in float16). The
        transformer's blocks take ``dtype``; its embeddings, heads and diffusion head stay float32."""
        from ..models.loading import load_hart_tokenizer, load_hart_transformer, local_path, resolve_dtype
        dtype, vae_dtype = resolve_dtype(dtype, "dtype"), resolve_dtype(vae_dtype, "vae_dtype")
        text_encoder_dtype = resolve_dtype(text_encoder_dtype, "text_encoder_dtype")
        transformer = load_hart_transformer(local_path(llm, "llm"), dtype)
        vqvae = load_hart_tokenizer(local_path(tokenizer_folder, "tokenizer_folder"), vae_dtype)
        tokenizer, qwen = load_qwen2(local_path(text_encoder, "text_encoder"), text_encoder_dtype)
        return cls(transformer=transformer, vqvae=vqvae, text_encoder=qwen, tokenizer=tokenizer)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, dtype: Union[torch.dtype, str, None] = None,
                        vae_dtype: Union[torch.dtype, str] = torch.float32,
                        text_encoder_dtype: Union[torch.dtype, str] = torch.float32,
                        torch_dtype: Union[torch.dtype, str, None] = None, **kwargs) -> "HARTPipeline":
        """Load a folder written by :meth:`save_pretrained` / ``sparsevar convert`` (``transformer/``,
        ``vqvae/``, ``text_encoder/``, ``tokenizer/``), checked before any weight is read. Nothing is
        downloaded. dtype (or ``torch_dtype``): the transformer blocks' (default: as saved)."""
        from ..models.loading import load_pretrained_component
        path, _, dtype, vae_dtype, text_encoder_dtype, opts = cls._pretrained_arguments(
            pretrained_model_name_or_path, "load the official folders with HARTPipeline.from_single_file(llm, "
            "tokenizer_folder, text_encoder=<Qwen2 folder>) (CLI: --model <release folder> --text-encoder FOLDER)",
            kwargs, dtype, torch_dtype, vae_dtype=vae_dtype, text_encoder_dtype=text_encoder_dtype)

        def load_transformer():
            transformer = load_pretrained_component(HARTTransformer, path, "transformer", variant=opts.variant)
            saved = transformer.blocks[0].attn.qkv_proj.weight.dtype
            return transformer.set_block_dtype(dtype if dtype is not None else saved)

        transformer = opts.component("transformer", load_transformer)
        vqvae = opts.component("vqvae", lambda: load_pretrained_component(MultiScaleVQVAE, path, "vqvae", vae_dtype,
                                                                          opts.variant))
        text = {} if {"text_encoder", "tokenizer"} <= set(opts.components) else \
            dict(zip(("tokenizer", "text_encoder"), load_qwen2(path / "text_encoder", text_encoder_dtype,
                                                               path / "tokenizer", opts.variant)))
        return opts.place(cls(transformer=transformer, vqvae=vqvae,
                              text_encoder=opts.component("text_encoder", lambda: text["text_encoder"]),
                              tokenizer=opts.component("tokenizer", lambda: text["tokenizer"]),
                              sparsevar_calibration=opts.sparsevar_calibration,
                              scalekv_calibration=opts.scalekv_calibration))

    @classmethod
    def from_random(cls, preset: str = "hart-tiny", seed: int = 0, device: Union[str, torch.device] = "cpu",
                    dtype: Union[torch.dtype, str] = torch.float32,
                    vae_dtype: Union[torch.dtype, str] = torch.float32) -> "HARTPipeline":
        """A model of a known size with random weights (benchmarks, smoke tests; it draws noise):
        ``HART_PRESETS`` (hart-tiny, hart-0.7b, the release's best-estimate size), with a one-layer random
        Qwen2 of the preset's text width and a word-level tokenizer; ``vae_dtype``: the tokenizer's."""
        from accelerate import init_empty_weights

        from ..models.loading import resolve_dtype
        if preset not in HART_PRESETS:
            raise ValueError(f"preset={preset!r} is unknown; choose one of {sorted(HART_PRESETS)}")
        dtype, vae_dtype = resolve_dtype(dtype, "dtype"), resolve_dtype(vae_dtype, "vae_dtype")
        spec = HART_PRESETS[preset]
        with init_empty_weights():
            transformer = HARTTransformer(**spec["transformer"])
            vqvae = MultiScaleVQVAE(**spec["vqvae"], phi_on_last=False)
        dev = torch.device(device)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            transformer = transformer.to_empty(device=dev).init_random_weights()
            vqvae = vqvae.to_empty(device=dev).init_random_weights()
        tokenizer, qwen = random_qwen2(transformer.config.context_dim, seed=seed)
        return cls(transformer=transformer.set_block_dtype(dtype).eval().requires_grad_(False),
                   vqvae=torch.nn.Module.to(vqvae, vae_dtype).eval().requires_grad_(False), text_encoder=qwen.to(dev),
                   tokenizer=tokenizer)

    # ---- text ---------------------------------------------------------------------------------------
    @torch.no_grad()
    @phase("sparsevar.encode_prompt")
    def encode_prompt(self, prompt: Union[str, Sequence[str]]):
        """(context (B, T, D), mask (B, T), position ids (B, T)) of the prompts, as the reference
        encodes them (system prompt in front, padded to the transformer's text slots)."""
        self._load_component("text_encoder")
        return encode_hart_prompts(self.tokenizer, self.text_encoder, prompt,
                                   max_length=self.transformer.config.context_token)

    # ---- engine -------------------------------------------------------------------------------------
    def adapter(self) -> HARTAdapter:
        """The engine adapter over the current modules (rebuilt when a component was replaced)."""
        a = self._adapter
        if a is None or a.transformer is not self.transformer or a.vqvae is not self.vqvae:
            a = self._adapter = HARTAdapter(self.transformer, self.vqvae)
        a.set_kernels(self._kernel_kind(a))
        return a

    def flop_speedup(self, stats: GenerationStats) -> float:
        """The speed-up a generation's token counts allow in FLOPs, versus computing every token."""
        cfg = self.transformer.config
        rows = [s.rows for s in stats.scales]
        dense = hart_loop_flops(cfg, rows_per_scale=[max(rows)] * len(rows))
        return dense / hart_loop_flops(cfg, tokens_per_scale=[s.tokens_computed for s in stats.scales],
                                       kv_per_scale=stats.kv_per_scale(), rows_per_scale=rows)

    def _memory_layout(self, batch_size: int, height, width) -> tuple:
        side = self.transformer.config.patch_nums[-1] * self.vqvae.downsample_factor
        if (height, width) not in ((None, None), (side, side)):
            raise ValueError(f"height={height}, width={width}: HART draws {side}x{side} pictures only; leave "
                             f"height and width out")
        return self.adapter().schedule, self.memory_needed(batch_size)

    def memory_needed(self, batch_size: int) -> dict[str, int]:
        """A lower bound of the bytes one call of ``batch_size`` images allocates, by part: the KV
        cache ([cond; uncond] rows, text slots included, the last scale in the layers' shared tail
        when the adapter's ``kv_tail`` is on), the last scale's float32 logits and the diffusion
        head's rows, and the decoder's full-resolution activation with the output images."""
        cfg, vq = self.transformer.config, self.vqvae
        R = 2 * batch_size
        last = cfg.patch_nums[-1] ** 2
        side = cfg.patch_nums[-1] * vq.downsample_factor
        adapter = self.adapter()
        return {"KV cache": adapter.kv_cache_bytes(batch_size, adapter.schedule),
                "logits": R * last * cfg.vocab_size * 4 + R * last * cfg.diff_width * 4 * 4,
                "decoder": batch_size * side * side * (vq.config.ch * _dtype_of(vq).itemsize + 3 * 4)}

    # ---- call -------------------------------------------------------------------------------------
    def _check_features(self, features) -> int:
        """The number of prompts in ``prompt_features`` (what :meth:`encode_prompt` returns), or a
        ValueError naming what does not fit this model."""
        cfg = self.transformer.config
        ok = isinstance(features, (tuple, list)) and len(features) == 3 and \
            all(isinstance(t, torch.Tensor) for t in features)
        if ok:
            context, mask, pos = features
            T = cfg.context_token
            ok = (context.dim() == 3 and context.shape[1:] == (T, cfg.context_dim) and context.is_floating_point()
                  and mask.shape == pos.shape == context.shape[:2] and mask.dtype == torch.bool)
        if not ok:
            got = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in features] \
                if isinstance(features, (tuple, list)) else type(features).__name__
            raise ValueError(f"prompt_features must be what encode_prompt returns for this model: (context (B, "
                             f"{cfg.context_token}, {cfg.context_dim}), mask (B, {cfg.context_token}) bool, position "
                             f"ids (B, {cfg.context_token})), got {got}")
        if features[0].shape[0] < 1:
            raise ValueError("prompt_features holds no prompt")
        return int(features[0].shape[0])

    @staticmethod
    def _prompt_list(prompt, name: str) -> list[str]:
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        raise ValueError(f"{name} must be a string or a non-empty list of strings, got {prompt!r}")

    @torch.no_grad()
    def __call__(self, prompt: Union[str, Sequence[str], None] = None,
                 guidance_scale: float = HART_DEFAULTS.guidance_scale, top_k: int = HART_DEFAULTS.top_k,
                 top_p: float = HART_DEFAULTS.top_p, smooth: bool = True, num_images_per_prompt: int = 1,
                 generator=None, output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Optional[Callable] = None,
                 callback_on_step_end_tensor_inputs: Sequence[str] = ("codes",),
                 policies: Optional[Sequence[Policy]] = None, use_cuda_graphs: Optional[bool] = None,
                 prompt_features: Optional[tuple] = None):
        """Generate 1024 × 1024 images from text.

        Args:
            prompt: a string or a list of strings.
            guidance_scale: the reference's cfg: at scale k the logits are (1 + t)·cond − t·uncond with
                t = cfg·k/(S−1) (the last scale reuses the previous ratio; the diffusion head uses the
                same t); 0 disables guidance. Reference: 4.5.
            top_k: 0 = the reference's rule (600 below scale 7, then 300); k > 0 keeps k codes per token.
            top_p: nucleus mass kept per token (0 = off, the reference).
            smooth: the reference's ``more_smooth`` (its default): the latent takes a Gumbel-softmax
                mixture of the codebook; False adds the drawn codes' vectors.
            num_images_per_prompt, generator, output_type, return_dict, callback_on_step_end,
                callback_on_step_end_tensor_inputs, policies: as in the other pipelines. Every random
                draw, the diffusion head's noise included, comes from ``generator``.
            use_cuda_graphs: replay each scale's compute (text, layers, head) from a CUDA graph (default:
                on for CUDA models); guidance, sampling and the diffusion head run eagerly.
            prompt_features: what :meth:`encode_prompt` returned (context, mask, position ids), instead
                of ``prompt`` (encode once, generate many times).
        Returns:
            :class:`HARTPipelineOutput` (images, stats) or the tuple ``(images, stats)``.
        """
        if prompt is None and prompt_features is None:
            raise ValueError("prompt is required: pass a string or a list of strings")
        if prompt is not None and prompt_features is not None:
            raise ValueError("pass either prompt or prompt_features, not both")
        n = len(self._prompt_list(prompt, "prompt")) if prompt is not None else self._check_features(prompt_features)
        if not isinstance(smooth, bool):
            raise TypeError(f"smooth must be True or False, got {smooth!r}")
        B = self._check_call(n, "prompt", self.memory_needed, guidance_scale, top_k, top_p,
                             num_images_per_prompt, output_type, generator, callback_on_step_end,
                             callback_on_step_end_tensor_inputs, policies)
        stack = self._call_policies(policies)
        context, mask, pos = self.encode_prompt(self._prompt_list(prompt, "prompt")) if prompt is not None else \
            (t.to(self.text_encoder.device) for t in prompt_features)
        k = int(num_images_per_prompt)
        context, mask, pos = (t.repeat_interleave(k, dim=0) for t in (context, mask, pos))
        cond = HARTConditioning(context, pos, mask, smooth=smooth)
        return self._generate(cond, B, stack, guidance_scale, top_k, top_p, generator, output_type, return_dict,
                              callback_on_step_end, callback_on_step_end_tensor_inputs, use_cuda_graphs)


__all__ = ["HARTPipeline", "HARTPipelineOutput"]
