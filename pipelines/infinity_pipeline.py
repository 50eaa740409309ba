"""InfinityPipeline: bitwise text-to-image generation (Infinity 2B / 8B), diffusers style.

    pipe = InfinityPipeline.from_single_file("infinity_2b_reg.pth", "infinity_vae_d32reg.pth",
                                             text_encoder="flan-t5-xl/", dtype=torch.bfloat16).to("cuda")
    out = pipe("a red fox in the snow", height=1024, width=1024, generator=torch.Generator("cuda").manual_seed(0))
    out.images[0].save("fox.png"); print(out.stats[0].summary())

Sizes are those of the official aspect-ratio templates (``InfinityPipeline.valid_sizes()``); the
defaults follow the official 2B notebook (guidance 3, temperature 0.5, top-k 900, top-p 0.97).
"""
from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from ..engine.contract import Policy
from ..engine.sampler import phase
from ..engine.state import GenerationStats
from ..models.bsq_vae import BSQVAE
from ..models.infinity import (DEFAULT_RESOLUTION, INFINITY_PRESETS, PN_SCALES, InfinityAdapter, InfinityConditioning,
                               InfinityResolution, InfinityTransformer, infinity_loop_flops, infinity_resolution,
                               infinity_resolutions, resolve_resolution, TRAINED_SCALES, ZERO_SHOT_PN)
from ..models.loading import load_infinity_transformer, load_infinity_vae
from ..models.text_encoder import TextFeatures, encode_prompts, load_t5, random_t5
from ._accelerated import AcceleratedPipelineMixin, _dtype_of
from ._accelerated import OUTPUT_TYPES  # noqa: F401 (importable from here too)
from .defaults import INFINITY_DEFAULTS

logger = logging.getLogger(__name__)

PRESET_FAMILY = "infinity-2b"      # key of the policy presets (SPARSEVAR_PRESETS / FASTVAR_PRESETS)


@dataclass
class InfinityPipelineOutput(BaseOutput):
    """images: list of PIL images, (B, H, W, 3) float array in [0, 1], (B, 3, H, W) tensor in [0, 1], or
    the summed codes (B, d, h, w); stats: per-scale statistics of the generation (one entry per call)."""

    images: Union[list, np.ndarray, torch.Tensor]
    stats: list


class InfinityPipeline(AcceleratedPipelineMixin, DiffusionPipeline):
    """Text-to-image next-scale prediction with bitwise tokens (Infinity) and pluggable acceleration.

    Components: ``transformer`` (:class:`InfinityTransformer`), ``vae`` (:class:`BSQVAE`),
    ``text_encoder`` (a ``transformers`` ``T5EncoderModel``, Flan-T5-XL for the released models) and
    ``tokenizer`` (its tokenizer).
    """

    PRESET_FAMILY = PRESET_FAMILY
    DEFAULTS = INFINITY_DEFAULTS
    DECODER = "vae"
    LOOP_COMPONENTS = ("transformer",)
    _output_class = InfinityPipelineOutput
    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _callback_tensor_inputs = ["codes", "logits", "latents", "latent"]

    def __init__(self, transformer: InfinityTransformer, vae: BSQVAE, text_encoder, tokenizer,
                 sparsevar_calibration: Optional[dict] = None,
                 scalekv_calibration: Optional[dict] = None):
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        t5_width = getattr(getattr(text_encoder, "config", None), "d_model", None)
        if t5_width is not None and t5_width != transformer.config.text_channels:
            raise ValueError(f"text encoder and transformer do not match: the T5 produces {t5_width}-channel features, "
                             f"the transformer reads {transformer.config.text_channels}; pass the T5 the model was "
                             f"trained with (Flan-T5-XL for the released Infinity models)")
        self.set_sparsevar_calibration(sparsevar_calibration)
        self.set_scalekv_calibration(scalekv_calibration)

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_single_file(cls, transformer_ckpt, vae_ckpt, text_encoder, dtype: Union[torch.dtype, str] = torch.float32,
                         vae_dtype: Union[torch.dtype, str] = torch.float32,
                         text_encoder_dtype: Union[torch.dtype, str] = torch.float32) -> "InfinityPipeline":
        """Load the official files: the transformer (``infinity_2b_reg.pth`` or the 8B shard folder), its
        VAE (``infinity_vae_d32reg.pth`` = ``infinity_vae_d32_reg.pth``; 8B: ``infinity_vae_d56_f8_14_patchify.pth``)
        and ``text_encoder``, a local folder holding google/flan-t5-xl (weights + tokenizer).

        dtype: the transformer blocks' dtype (bfloat16 as in the official runs; the rest stays float32);
        vae_dtype: the VAE's; text_encoder_dtype: the T5's (the reference runs it in float16). Each takes
        a torch dtype or diffusers' strings ("float16" / "fp16" / "half", "bfloat16" / "bf16", "float32" / "fp32").
        """
        from ..models.loading import local_path, resolve_dtype
        transformer_ckpt, vae_ckpt = local_path(transformer_ckpt, "transformer_ckpt"), local_path(vae_ckpt, "vae_ckpt")
        text_encoder = local_path(text_encoder, "text_encoder")
        dtype, vae_dtype = resolve_dtype(dtype, "dtype"), resolve_dtype(vae_dtype, "vae_dtype")
        text_encoder_dtype = resolve_dtype(text_encoder_dtype, "text_encoder_dtype")
        transformer = load_infinity_transformer(transformer_ckpt, dtype=dtype)
        vae = load_infinity_vae(vae_ckpt, dtype=vae_dtype)
        tokenizer, t5 = load_t5(text_encoder, dtype=text_encoder_dtype)
        return cls(transformer=transformer, vae=vae, text_encoder=t5, tokenizer=tokenizer)

    @classmethod
    def from_path(cls, model, vae=None, text_encoder=None, dtype: torch.dtype = torch.float32,
                  vae_dtype: torch.dtype = torch.float32,
                  text_encoder_dtype: torch.dtype = torch.float32) -> "InfinityPipeline":
        """A converted folder (``model``), or the official transformer file + its VAE + a T5 folder."""
        from ..models.loading import local_path
        p = local_path(model, "model")
        if not p.exists():
            raise FileNotFoundError(f"model={str(model)!r}: no such file or folder; give a converted folder "
                                    f"(`sparsevar convert`, save_pretrained) or the official Infinity checkpoint "
                                    f"(infinity_2b_reg.pth, or the 8B shard folder)")
        if p.is_dir() and (p / "model_index.json").is_file():
            return cls.from_pretrained(p, dtype=dtype, vae_dtype=vae_dtype, text_encoder_dtype=text_encoder_dtype)
        if vae is None or text_encoder is None:
            missing = [(n, what) for n, v, what in (
                ("vae", vae, "its VAE file, e.g. infinity_vae_d32reg.pth (CLI: --vae-ckpt)"),
                ("text_encoder", text_encoder, "a local google/flan-t5-xl folder (CLI: --text-encoder)"))
                if v is None]
            what = "; ".join(f"{n}: {w}" for n, w in missing) if len(missing) > 1 else missing[0][1]
            raise ValueError(f"{p.name} is not a converted folder (no model_index.json), so it is read as an official "
                             f"Infinity transformer checkpoint, which needs "
                             f"{' and '.join(n for n, _ in missing)} ({what}), or give a converted folder instead")
        return cls.from_single_file(p, vae, text_encoder, dtype=dtype, vae_dtype=vae_dtype,
                                    text_encoder_dtype=text_encoder_dtype)

    @classmethod
    def from_random(cls, preset: str = "infinity-tiny", seed: int = 0, device: Union[str, torch.device] = "cpu",
                    dtype: Union[torch.dtype, str] = torch.float32, text_encoder=None,
                    vae_dtype: Union[torch.dtype, str] = torch.float32) -> "InfinityPipeline":
        """A model of a known size with random weights (benchmarks, smoke tests). It draws noise.

        preset: one of ``INFINITY_PRESETS`` (infinity-tiny, infinity-2b, infinity-8b); dtype: the
        blocks' dtype; vae_dtype: the VAE's (bf16 decodes channels-last with fused norms on CUDA,
        as the reference decodes under bf16 autocast). text_encoder: a local T5 folder of the preset's width; by default a 1-layer
        random T5 of that width with a word-level tokenizer (text only has to have the right shape).
        dtype and vae_dtype take a torch dtype or diffusers' strings, as in :meth:`from_single_file`.
        """
        from ..models.loading import resolve_dtype
        if preset not in INFINITY_PRESETS:
            raise ValueError(f"preset={preset!r} is unknown; choose one of {sorted(INFINITY_PRESETS)}")
        dtype, vae_dtype = resolve_dtype(dtype, "dtype"), resolve_dtype(vae_dtype, "vae_dtype")
        from accelerate import init_empty_weights

        spec = INFINITY_PRESETS[preset]
        with init_empty_weights():
            transformer = InfinityTransformer(**spec["transformer"])
            vae = BSQVAE(**spec["vae"])
        dev = torch.device(device)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            transformer = transformer.to_empty(device=dev).init_random_weights()
            vae = vae.to_empty(device=dev).init_random_weights()
        if text_encoder is not None:
            tokenizer, t5 = load_t5(text_encoder)
        else:
            tokenizer, t5 = random_t5(spec["transformer"]["text_channels"], seed=seed)
        return cls(transformer=transformer.set_block_dtype(dtype).eval().requires_grad_(False),
                   vae=torch.nn.Module.to(vae, vae_dtype).eval().requires_grad_(False), text_encoder=t5.to(dev),
                   tokenizer=tokenizer)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, dtype: Union[torch.dtype, str, None] = None,
                        vae_dtype: Union[torch.dtype, str] = torch.float32,
                        text_encoder_dtype: Union[torch.dtype, str] = torch.float32,
                        torch_dtype: Union[torch.dtype, str, None] = None, **kwargs) -> "InfinityPipeline":
        """Load a folder written by :meth:`save_pretrained` (``transformer/``, ``vae/``, ``text_encoder/``,
        ``tokenizer/``). Nothing is downloaded: the path must be a local folder. Before any weight is read
        the folder is checked (``models.loading.check_pipeline_folder``): each ``config.json`` must build
        exactly the tensors its weights hold, and every file must be whole.

        dtype (or diffusers' name ``torch_dtype``): the transformer blocks' (default: as saved); vae_dtype,
        text_encoder_dtype: the VAE's and the T5's. Each takes a torch dtype or a string such as
        "float16" / "fp16", "bfloat16" / "bf16", "float32" / "fp32"."""
        from ..models.loading import RECONVERT, load_pretrained_component
        path, _, dtype, vae_dtype, text_encoder_dtype, opts = cls._pretrained_arguments(
            pretrained_model_name_or_path, "load the official files with InfinityPipeline.from_single_file("
            "transformer_ckpt, vae_ckpt, text_encoder=<flan-t5-xl folder>) (CLI: --model FILE --vae-ckpt FILE "
            "--text-encoder FOLDER)", kwargs, dtype, torch_dtype, vae_dtype=vae_dtype,
            text_encoder_dtype=text_encoder_dtype)

        def load_transformer():
            transformer = load_pretrained_component(InfinityTransformer, path, "transformer", variant=opts.variant)
            return transformer.set_block_dtype(dtype if dtype is not None else transformer.block_dtype())

        transformer = opts.component("transformer", load_transformer)
        vae = opts.component("vae", lambda: load_pretrained_component(BSQVAE, path, "vae", vae_dtype, opts.variant))
        text = {} if {"text_encoder", "tokenizer"} <= set(opts.components) else \
            dict(zip(("tokenizer", "text_encoder"), load_t5(path / "text_encoder", text_encoder_dtype,
                                                            path / "tokenizer", RECONVERT, opts.variant)))
        return opts.place(cls(transformer=transformer, vae=vae,
                              text_encoder=opts.component("text_encoder", lambda: text["text_encoder"]),
                              tokenizer=opts.component("tokenizer", lambda: text["tokenizer"]),
                              sparsevar_calibration=opts.sparsevar_calibration,
                              scalekv_calibration=opts.scalekv_calibration))

    # ---- sizes ------------------------------------------------------------------------------------
    @staticmethod
    def valid_sizes(aspect_ratio: Optional[float] = None) -> list[tuple[int, int]]:
        """(height, width) of every official size, or of the template nearest to ``aspect_ratio`` (h/w)."""
        if aspect_ratio is None:
            return [(r.height, r.width) for r in infinity_resolutions()]
        t = infinity_resolution(aspect_ratio).h_div_w
        return [(r.height, r.width) for r in (infinity_resolution(t, pn) for pn in PN_SCALES)]

    @staticmethod
    def resolution(height: int, width: int) -> InfinityResolution:
        """The schedule of an output size (ValueError listing the valid sizes for its aspect ratio)."""
        return resolve_resolution(height, width)

    # ---- text -------------------------------------------------------------------------------------
    @property
    def is_patchify(self) -> bool:
        return self.transformer.config.token_dim == 4 * self.vae.config.codebook_dim

    @torch.no_grad()
    @phase("sparsevar.encode_prompt")
    def encode_prompt(self, prompt: Union[str, Sequence[str]]) -> TextFeatures:
        """Packed T5 features of the prompts (official tokenisation: EOS, truncation at 512 tokens)."""
        self._load_component("text_encoder")
        return encode_prompts(self.tokenizer, self.text_encoder, prompt)

    # ---- diffusers-style properties ------------------------------------------------------------------
    def adapter(self) -> InfinityAdapter:
        """The engine adapter over the current modules (rebuilt when a component was replaced)."""
        a = self._adapter
        if a is None or a.transformer is not self.transformer or a.vae is not self.vae:
            a = self._adapter = InfinityAdapter(self.transformer, self.vae, DEFAULT_RESOLUTION)
        a.set_kernels(self._kernel_kind(a))
        return a

    def flop_speedup(self, stats: GenerationStats, height: Optional[int] = None, width: Optional[int] = None,
                     text_tokens: int = 64) -> float:
        """The speed-up a generation's token counts allow in FLOPs, versus computing every token, on
        the generation's own schedule (read from ``stats``), or on that of ``height`` × ``width``
        where either is given (the other 1024)."""
        if height is None and width is None:
            hw = [(s.h, s.w) for s in stats.scales]
        else:
            hw = resolve_resolution(height or DEFAULT_RESOLUTION, width or DEFAULT_RESOLUTION).hw
        cfg = self.transformer.config
        rows = [s.rows for s in stats.scales]
        dense = infinity_loop_flops(cfg, hw, text_tokens, rows_per_scale=[max(rows)] * len(rows))
        return dense / infinity_loop_flops(cfg, hw, text_tokens, tokens_per_scale=[s.tokens_computed for s in stats.scales],
                                           kv_per_scale=stats.kv_per_scale(), rows_per_scale=rows)

    def memory_needed(self, batch_size: int, height: int = 1024, width: int = 1024) -> dict[str, int]:
        """A lower bound of the bytes one call of ``batch_size`` images at ``height`` × ``width``
        allocates, by part: the KV cache ([cond; uncond] rows; the smaller of its two layouts, with
        and without the last scale's shared tail, see ``kv_tail_needed``), the last scale's
        float32 bit logits, and the VAE decoder's full-resolution activation with the output images.
        Compared with what the device has before a call (check_inputs)."""
        return self._memory_needed(batch_size, resolve_resolution(height, width))

    KV_FREED_FOR_DECODE = True

    def _memory_layout(self, batch_size: int, height, width) -> tuple:
        res = resolve_resolution(height or 1024, width or 1024)
        return res.schedule, self._memory_needed(batch_size, res)

    def _memory_needed(self, batch_size: int, res: InfinityResolution) -> dict[str, int]:
        cfg = self.transformer.config
        R, el = 2 * batch_size, self.adapter().dtype.itemsize
        L = sum(h * w for h, w in res.hw)
        last = res.hw[-1][0] * res.hw[-1][1]
        full = cfg.depth * R * L * (2 * cfg.embed_dim * el + 8)
        tail = cfg.depth * R * (L - last) * (2 * cfg.embed_dim * el + 8) + R * L * (2 * cfg.embed_dim * el + 8)
        vae = self.vae.config
        return {"KV cache": min(full, tail),
                "logits": R * last * 2 * cfg.token_dim * 4,
                "decoder": batch_size * res.height * res.width * (vae.base_ch * vae.ch_mult[0] *
                                                                  _dtype_of(self.vae).itemsize + 3 * 4)}

    # ---- call -------------------------------------------------------------------------------------
    @staticmethod
    def _prompt_list(prompt, name: str) -> list[str]:
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        raise ValueError(f"{name} must be a string or a non-empty list of strings, got {prompt!r}")

    def check_inputs(self, prompt, negative_prompt, height, width, guidance_scale, temperature, top_k, top_p,
                     num_images_per_prompt, output_type, generator, callback_on_step_end_tensor_inputs,
                     prompt_features=None, negative_prompt_features=None, callback_on_step_end=None, policies=None):
        if prompt is None and prompt_features is None:
            raise ValueError("prompt is required: pass a string or a list of strings")
        if prompt is not None and prompt_features is not None:
            raise ValueError("pass either prompt or prompt_features, not both")
        n = prompt_features.batch if prompt_features is not None else len(self._prompt_list(prompt, "prompt"))
        if negative_prompt is not None:
            neg = self._prompt_list(negative_prompt, "negative_prompt")
            if len(neg) not in (1, n):
                raise ValueError(f"got {len(neg)} negative prompts for {n} prompts; pass one, or one per prompt")
            if negative_prompt_features is not None:
                raise ValueError("pass either negative_prompt or negative_prompt_features, not both")
        if negative_prompt_features is not None and negative_prompt_features.batch not in (1, n):
            raise ValueError(f"negative_prompt_features holds {negative_prompt_features.batch} prompts for {n} prompts")
        for v, name in ((height, "height"), (width, "width")):
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v <= 0:
                square = ", ".join(f"{h}x{w}" for h, w in self.valid_sizes(1.0))
                raise ValueError(f"{name}={v}: give a positive number of pixels, an official size (height x width): "
                                 f"{square} for 1:1; InfinityPipeline.valid_sizes() lists those of every aspect ratio")
        resolution = resolve_resolution(height, width)
        if resolution.pn in ZERO_SHOT_PN:
            logger.warning("%dx%d is a zero-shot size: %d scales past the %d the model was trained on (FastVAR's "
                           "2K extension; pruning those scales with SparseVAR or FastVAR makes it much faster)",
                           height, width, len(resolution.hw) - TRAINED_SCALES, TRAINED_SCALES)
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
                or not math.isfinite(temperature) or temperature <= 0:
            raise ValueError(f"temperature must be a number > 0 (official: 0.5 for 2B, 1.0 for 8B), got {temperature!r}")
        self._check_call(n, "prompt", lambda B: self._memory_needed(B, resolution), guidance_scale, top_k, top_p,
                         num_images_per_prompt, output_type, generator, callback_on_step_end,
                         callback_on_step_end_tensor_inputs, policies, f" at {resolution.height}x{resolution.width}",
                         (resolution.height, resolution.width))
        return resolution, n

    @torch.no_grad()
    def __call__(self, prompt: Union[str, Sequence[str], None] = None,
                 negative_prompt: Union[str, Sequence[str], None] = None,
                 height: int = 1024, width: int = 1024, guidance_scale: float = INFINITY_DEFAULTS.guidance_scale,
                 temperature: Optional[float] = None, top_k: int = INFINITY_DEFAULTS.top_k,
                 top_p: float = INFINITY_DEFAULTS.top_p,
                 num_images_per_prompt: int = 1, generator=None, output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Optional[Callable] = None,
                 callback_on_step_end_tensor_inputs: Sequence[str] = ("codes",),
                 policies: Optional[Sequence[Policy]] = None,
                 prompt_features: Optional[TextFeatures] = None,
                 negative_prompt_features: Optional[TextFeatures] = None,
                 use_cuda_graphs: Optional[bool] = None):
        """Generate images from text.

        Args:
            prompt: a string or a list of strings.
            negative_prompt: replaces the unconditional branch of guidance (one, or one per prompt);
                None uses the model's learned unconditional text cut to each prompt's token count.
            height, width: an official size (``valid_sizes()``): 1024×1024 and the 256–1024 px sizes of
                the 15 aspect-ratio templates, or a zero-shot size past them (``ZERO_SHOT_PN``: 2048×2048
                for 1:1, with a warning); anything else raises a ValueError listing the sizes.
            guidance_scale: CFG on the bit logits, cfg·cond + (1 − cfg)·uncond; 1 disables guidance
                (official: 3 for the 2B notebook, 4 in infer.sh).
            temperature: τ, the logits are divided by it before guidance (default: 0.5, or 1.0 for a
                patchify model such as the 8B, as the official scripts use).
            top_k, top_p: per-bit filters (official 900, 0.97): with two values per bit only top_k = 1
                (greedy) changes anything; top_p drops the minority value when it is <= 1 − top_p likely.
            num_images_per_prompt: images per prompt.
            generator: a ``torch.Generator`` or one per image; every random draw comes from it.
            output_type: "pil", "np" ((B, H, W, 3) in [0, 1]), "pt" ((B, 3, H, W) in [0, 1]) or
                "latent" (summed codes).
            callback_on_step_end: ``fn(pipe, scale_index, scale_index, callback_kwargs) -> dict`` after every
                scale, with copies of "codes" (bits, (B, h·w, d)), "logits" (guided, (B, h·w, 2d)),
                "latents" (the summed codes; "latent" is its older name). A returned "latents" (same
                shape) replaces the sum: the next scale's input is made from it and it is decoded, as
                in VARPipeline. Set ``pipe._interrupt = True`` to stop early: the codes so far are decoded.
            policies: acceleration policies for this call only, instead of the enabled ones.
            prompt_features, negative_prompt_features: precomputed packed T5 features instead of
                strings (:meth:`encode_prompt`).
            use_cuda_graphs: replay each scale's layer stack from a CUDA graph (default: on for CUDA
                models; at zero-shot sizes for the trained scales only). Graphs are captured at the first call of a size and
                text-length bucket (32 tokens) and replayed by later calls of the same shape.
        Returns:
            :class:`InfinityPipelineOutput` (images, stats) or the tuple ``(images, stats)``.
        """
        if temperature is None:
            temperature = INFINITY_DEFAULTS.patchify_temperature if self.is_patchify else INFINITY_DEFAULTS.temperature
        resolution, n = self.check_inputs(prompt, negative_prompt, height, width, guidance_scale, temperature, top_k,
                                          top_p, num_images_per_prompt, output_type, generator,
                                          callback_on_step_end_tensor_inputs, prompt_features, negative_prompt_features,
                                          callback_on_step_end, policies)
        stack = self._call_policies(policies)
        text = prompt_features if prompt_features is not None else self.encode_prompt(self._prompt_list(prompt, "prompt"))
        negative = negative_prompt_features
        if negative_prompt is not None:
            negative = self.encode_prompt(self._prompt_list(negative_prompt, "negative_prompt"))
        if negative is not None and negative.batch == 1 and n > 1:
            negative = negative.select([0] * n)
        k = int(num_images_per_prompt)
        text = text.repeat_each(k)
        negative = negative.repeat_each(k) if negative is not None else None
        B = text.batch
        cond = InfinityConditioning(prompt=text, negative=negative, temperature=float(temperature), resolution=resolution)
        # at zero-shot sizes the scales past the trained schedule run eagerly: their kernels do not wait on the
        # host, and a graph pool holding the activations of 128×128-token maps would cost gigabytes; the
        # trained scales before them replay from graphs (eagerly they would wait on kernel launches)
        sched = resolution.schedule
        graph_max_tokens = max(h * w for h, w in sched.hw[:TRAINED_SCALES]) if resolution.pn in ZERO_SHOT_PN else None
        return self._generate(cond, B, stack, guidance_scale, top_k, top_p, generator, output_type, return_dict,
                              callback_on_step_end, callback_on_step_end_tensor_inputs, use_cuda_graphs,
                              schedule=sched, graph_max_tokens=graph_max_tokens)


__all__ = ["InfinityPipeline", "InfinityPipelineOutput"]
