"""What every family's pipeline shares: the stack of acceleration policies, the checks of a call
that do not depend on the family, the memory check, the engine run with its progress bar and
callback, the image post-processing and the diffusers-style run properties."""
from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
import PIL.Image
import torch

from ..engine.contract import Policy, PolicyStack
from ..engine.limits import GUIDANCE_SCALE_MAX
from ..engine.sampler import generate, phase
from ..engine.state import SamplingSettings
from ..policies.fastvar import FASTVAR_PRESETS, FastVARConfig, FastVARPolicy
from ..policies.scale_skip import ScaleSkipConfig, ScaleSkipPolicy
from ..policies.scalekv import ScaleKVConfig, ScaleKVPolicy, check_scalekv_calibration, scalekv_preset
from ..policies.sparsevar import (SPARSEVAR_PRESETS, SparseVARConfig, SparseVARPolicy, _replace, check_calibration,
                                  sparsevar_config_for)
from ..policies.sparvar import SPARVAR_PRESETS, SparVARConfig, SparVARPolicy
from ..sparse_ops._backend import resolve_backend
from .memory import ACTIVATION_BYTES_PER_CHANNEL, MemoryEstimate
from .offload import BlockStream, LayerStream, ModelOffload, layer_stream_bytes, stream_bytes
from ..sparse_ops.kernels import KERNEL_KINDS
from .defaults import VAR_DEFAULTS, FamilyDefaults

logger = logging.getLogger(__name__)
LIBRARY_NAME = "sparsevar"   # written into model_index.json instead of a module path (see save_pretrained)
OUTPUT_TYPES = ("pil", "np", "pt", "latent")


# diffusers' from_pretrained arguments that fetch from the Hugging Face Hub (nothing is downloaded here)
_DOWNLOAD_ARGUMENTS = ("cache_dir", "revision", "token", "use_auth_token", "force_download", "proxies",
                       "resume_download", "mirror")
# device_map values that spread components over several devices
_SPREAD_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class LoadOptions:
    """diffusers' loading arguments as ``from_pretrained`` took them: the weight ``variant`` to read,
    the ``device`` to place the pipeline on (``device_map``), the ``components`` the caller passed
    (used as they are, not read from the folder), and the folder's checked ``sparsevar_calibration``
    and ``scalekv_calibration``."""

    variant: Optional[str] = None
    device: Optional[torch.device] = None
    components: Mapping[str, object] = field(default_factory=dict)
    sparsevar_calibration: Optional[dict] = None
    scalekv_calibration: Optional[dict] = None

    def component(self, name: str, load: Callable[[], object]):
        """The component the caller passed under ``name``, else ``load()``."""
        return self.components[name] if name in self.components else load()

    def place(self, pipe):
        """``pipe`` on ``device`` (as loaded when no device_map was given)."""
        return pipe if self.device is None else pipe.to(self.device)


def _device_from_map(device_map) -> Optional[torch.device]:
    """``device_map`` as one device: a device name, index or ``torch.device``; maps that spread
    components over several devices, and devices this machine lacks, are refused naming the value."""
    if device_map is None:
        return None
    if isinstance(device_map, dict) or (isinstance(device_map, str) and device_map in _SPREAD_MAPS):
        raise ValueError(f"device_map={device_map!r}: these pipelines run on one device and do not spread their "
                         f"components over several; pass device_map='cuda' (or 'cpu', 'cuda:N'), or call "
                         f".to(device) after loading")
    try:
        dev = torch.device(device_map) if not isinstance(device_map, bool) else None
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type == "meta":
        raise ValueError(f"device_map={device_map!r}: not a device; pass 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        raise ValueError(f"device_map={device_map!r}: this machine has {have}; pass device_map='cpu' or a device "
                         f"it has")
    return dev


def _component_type(expected):
    """The type a passed component must have, from ``pipeline_components``' entry."""
    if isinstance(expected, type):
        return expected
    import transformers
    return {"text_encoder": transformers.T5EncoderModel, "qwen2_text_encoder": transformers.PreTrainedModel,
            None: transformers.PreTrainedTokenizerBase}[expected]


# callback_on_step_end_tensor_inputs names → the engine's: diffusers' "latents"; "latent" is this
# package's older name, kept as an alias
_CALLBACK_NAMES = {"latents": "latent"}

def _gb(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def _dtype_of(module: torch.nn.Module) -> torch.dtype:
    """The dtype of a module's first parameter (diffusers' ``ModelMixin.dtype`` looks at them all)."""
    return next(module.parameters()).dtype


def _free_bytes(device: torch.device) -> int:
    """What the driver (GPU) or the system (CPU: memory and swap) has free now; on a GPU no more than
    this process may still take under its memory fraction (``torch.cuda.set_per_process_memory_fraction``,
    which also simulates a smaller card)."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(device)   # torch >= 2.6
        # memory_reserved() flattens the allocator's whole statistics tree; the nested form is read as it is
        reserved = torch.cuda.memory_stats_as_nested_dict(device).get("reserved_bytes", {}).get("all", {}).get("current", 0)
        cap = fraction * total - reserved
        return int(max(0, min(free, cap)))
    import psutil
    return psutil.virtual_memory().available + psutil.swap_memory().free


def _gpu(gpu_id: Optional[int], device, refusal: str) -> torch.device:
    """The CUDA device of diffusers' ``gpu_id`` / ``device`` arguments (default ``cuda:0``); a
    ValueError with ``refusal`` (its ``{}`` says why) where there is none, or naming the valid ids."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(refusal.format(f"device={device!r} is not a GPU" if dev.type != "cuda"
                                        else "this machine has no CUDA device"))
    index = gpu_id if gpu_id is not None else (dev.index if dev.index is not None else 0)
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"gpu_id={index}: this machine has {torch.cuda.device_count()} CUDA device(s); pass "
                         f"0..{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def _async_allocator() -> bool:
    """Whether PyTorch allocates GPU memory with cudaMallocAsync (ComfyUI's default), under which a
    Triton kernel launched inside a CUDA graph capture was refused its freshly allocated buffer."""
    return torch.cuda.get_allocator_backend() == "cudaMallocAsync"


def memory_available(device: torch.device, modules: Sequence[torch.nn.Module] = ()) -> int:
    """Bytes a generation on ``device`` can count on: on a GPU, what the driver has free plus what
    PyTorch's allocator holds beyond the weights of ``modules``; on the CPU, the memory and swap the
    system has available plus what this process holds beyond those weights (the workspaces of
    earlier calls, which a new call reuses or frees first). Generous on purpose: it bounds what
    cannot fit, not what surely fits."""
    device = torch.device(device)
    weights = sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers())
                  if t.device.type == device.type)
    if device.type == "cuda":
        return int(_free_bytes(device) + max(0, torch.cuda.memory_reserved(device) - weights))
    import psutil
    return int(_free_bytes(device) + max(0, psutil.Process().memory_info().rss - weights))


def check_memory(pipe, needed: dict, batch_size: int, subject: str, advice: str, hw: tuple = (None, None),
                 free: Optional[int] = None) -> None:
    """Raise a ValueError before anything is allocated when ``needed`` (bytes by part, a lower bound
    of what ``batch_size`` images allocate, from the pipeline's ``memory_needed``) exceeds
    :func:`memory_available` on the pipeline's device. ``subject`` names what asked for the batch
    and ``advice`` how to make it smaller, in the caller's terms (Python arguments or CLI flags);
    ``free``: :func:`_free_bytes` of the device where the caller just read it."""
    device = pipe._execution_device if pipe.model_cpu_offload else pipe.adapter().device
    total = sum(needed.values())
    if total <= (_free_bytes(device) if free is None else free):    # the usual case, without counting the weights
        return
    available = memory_available(device, [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]) \
        - pipe._buffer_bytes()
    if total <= available:
        return
    fit = int(available // (total / batch_size))
    parts = ", ".join(f"{k} {_gb(v)}" for k, v in needed.items() if v)
    try:                                               # what would fit instead, from the estimate (pipelines/memory.py)
        options = pipe.memory_options(batch_size, *hw, available=memory_available(device))   # weights included
    except (ValueError, NotImplementedError):
        options = []
    more = f"; estimated to fit: {'; '.join(options)}" if options else ""
    raise ValueError(f"{subject} needs at least {_gb(total)} ({parts}) on {device.type}, and "
                     f"{_gb(available)} is available: at most {fit} image(s) fit in one run; {advice}{more}")


class _DropCPUHalfWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "cannot run with `cpu` device" not in record.getMessage()


class AcceleratedPipelineMixin:
    """Policy management (``enable_sparsevar`` …), run state and the shared parts of a call, for
    VARPipeline and InfinityPipeline. A pipeline supplies ``adapter()`` (which passes
    ``self._kernel_kind(adapter)`` to the adapter's ``set_kernels``), ``PRESET_FAMILY`` (its key in ``SPARSEVAR_PRESETS``
    / ``FASTVAR_PRESETS``), ``DEFAULTS`` and ``_output_class``; its ``__call__`` checks its own inputs,
    then calls :meth:`_check_call`, :meth:`_call_policies` and :meth:`_generate`."""

    PRESET_FAMILY: str = "var"
    DEFAULTS: FamilyDefaults = VAR_DEFAULTS
    DECODER: str = "vqvae"                             # the component that turns the latent into pictures
    # the components the scale loop uses (a residual tokenizer's quantizer accumulates every scale's codes)
    LOOP_COMPONENTS: tuple = ("transformer", "vqvae")
    _output_class: type

    def __init__(self):
        super().__init__()
        self._policies, self._adapter, self._kernels = PolicyStack(), None, "auto"
        self._interrupt, self._current_scale = False, None
        self._model_offload: Optional[ModelOffload] = None
        self._text_stream: Optional[BlockStream] = None
        self._layer_stream: Optional[LayerStream] = None
        self._text_stream_of_offload = False           # sequential offload started the text encoder's stream

    # ---- offload (diffusers' semantics, pipelines/offload.py) ------------------------------------
    def enable_model_cpu_offload(self, gpu_id: Optional[int] = None, device: Union[torch.device, str] = "cuda"):
        """Keep every component in (pinned) CPU memory and put each on the GPU only while it runs:
        the text encoder for the prompt, the transformer for the scale loop (with the tokenizer where
        its quantizer accumulates each scale's codes: VAR, FlexVAR, HART; the text encoder leaves
        before the first scale), the tokenizer for the picture (the transformer leaves first); at
        the end of a call everything is back on the CPU. The components take turns in one GPU
        buffer the size of the largest of them (pipelines/offload.py says why), so the GPU holds
        that and the largest phase's working memory, not the sum of the weights; each call copies
        each component to the GPU once. The buffer and the workspace of the last call (KV cache,
        CUDA graphs) stay on the GPU between calls (:meth:`release_memory` frees both).

        gpu_id / device: the GPU to run on (diffusers' arguments; default ``cuda:0``). Needs CUDA."""
        gpu = _gpu(gpu_id, device, "enable_model_cpu_offload needs a CUDA GPU to offload from ({}); on the CPU "
                                   "every component already is in CPU memory: leave it out")
        if self._layer_stream is not None:
            raise ValueError("enable_model_cpu_offload() while sequential CPU offload is on: call "
                             "pipe.disable_sequential_cpu_offload() first")
        if self._text_stream is not None:
            raise ValueError("enable_model_cpu_offload() while the text encoder streams: call "
                             "pipe.disable_text_encoder_streaming() first (model offload moves the text encoder too)")
        self.disable_model_cpu_offload()
        self.release_memory()
        modules = {k: v for k, v in self.components.items() if isinstance(v, torch.nn.Module)}
        self._model_offload = ModelOffload(modules, gpu, self._offload_groups())
        torch.cuda.empty_cache()
        return self

    def disable_model_cpu_offload(self):
        """Stop offloading: the components stay in CPU memory (``pipe.to("cuda")`` moves them back)."""
        if self._model_offload is not None:
            self._model_offload.close()
            self._model_offload = None
        return self

    @property
    def model_cpu_offload(self) -> bool:
        return self._model_offload is not None

    def enable_text_encoder_streaming(self, gpu_id: Optional[int] = None, device: Union[torch.device, str] = "cuda"):
        """Keep the text encoder's blocks in (pinned) CPU memory and stream them to the GPU one at a
        time as it runs, the next block's copy overlapping the current block's work; its embeddings
        and the other components stay on the GPU. For a card that holds the transformer but not the
        text encoder beside it (Infinity-2B's Flan-T5-XL is 2.4 GB, HART's Qwen2-1.5B 3.1 GB): the
        GPU holds two of its blocks instead, the transformer keeps its place (and its CUDA graphs),
        and each prompt costs one copy of the encoder's blocks. The same pictures as without it.

        gpu_id / device: the GPU the pipeline runs on (default ``cuda:0``). Needs CUDA and a text
        encoder; not with model CPU offload (which moves the text encoder itself)."""
        if not isinstance(getattr(self, "text_encoder", None), torch.nn.Module):
            raise ValueError(f"enable_text_encoder_streaming(): {type(self).__name__} has no text encoder")
        if self._model_offload is not None:
            raise ValueError("enable_text_encoder_streaming() while model CPU offload is on: call "
                             "pipe.disable_model_cpu_offload() first (it moves the text encoder itself)")
        gpu = _gpu(gpu_id, device, "enable_text_encoder_streaming needs a CUDA GPU to stream to ({})")
        self.disable_text_encoder_streaming()
        self._text_stream = BlockStream(self.text_encoder, gpu)
        torch.cuda.empty_cache()
        return self

    def disable_text_encoder_streaming(self):
        """Stop streaming: the text encoder's blocks stay in CPU memory (``pipe.to("cuda")`` moves them)."""
        if self._text_stream is not None:
            self._text_stream.close()
            self._text_stream = None
        return self

    @property
    def text_encoder_streaming(self) -> bool:
        return self._text_stream is not None

    def enable_sequential_cpu_offload(self, gpu_id: Optional[int] = None, device: Union[torch.device, str] = "cuda"):
        """For the smallest cards: keep the transformer blocks' weight matrices (nearly all of its
        weights) in pinned CPU memory and stream them to the GPU layer by layer as the scale loop
        runs them — the next layer's copy overlapping the current layer's work — and stream the
        text encoder's blocks the same way (:meth:`enable_text_encoder_streaming`). The GPU holds
        two blocks' matrices of each, the rest of the transformer (embeddings, norms, head) and the
        tokenizer. Every scale copies every block once, so a call is bound by the host-to-device
        copies; the scales run eagerly (no CUDA graphs). The same pictures as without it.

        diffusers moves every leaf module to the GPU in its ``forward`` through accelerate hooks; the
        engine never calls the blocks' ``forward``, so the layer loop moves their weights itself.

        gpu_id / device: the GPU to run on (default ``cuda:0``). Needs CUDA; not with model CPU
        offload. :meth:`disable_sequential_cpu_offload` stops it."""
        gpu = _gpu(gpu_id, device, "enable_sequential_cpu_offload needs a CUDA GPU to stream to ({}); on the CPU "
                                   "every weight already is in CPU memory: leave it out")
        if self._model_offload is not None:
            raise ValueError("enable_sequential_cpu_offload() while model CPU offload is on: call "
                             "pipe.disable_model_cpu_offload() first")
        self.disable_sequential_cpu_offload()
        self.release_memory()
        adapter = self.adapter()
        self._layer_stream = stream = LayerStream(adapter.blocks, gpu)
        adapter.layer_stream = stream
        streamed = {id(t) for pairs in stream.host for t, _ in pairs}
        for name, module in self.components.items():
            if isinstance(module, torch.nn.Module) and name != "text_encoder":
                for t in (*module.parameters(), *module.buffers()):
                    if id(t) not in streamed:
                        t.data = t.data.to(gpu)
        self._text_stream_of_offload = False
        if isinstance(getattr(self, "text_encoder", None), torch.nn.Module) and self._text_stream is None:
            self.enable_text_encoder_streaming(device=gpu)
            self._text_stream_of_offload = True        # so disable_sequential_cpu_offload stops it too
        torch.cuda.empty_cache()
        return self

    def disable_sequential_cpu_offload(self):
        """Stop it: the streamed weights stay in CPU memory (``pipe.to("cuda")`` moves everything back)."""
        if self._layer_stream is not None:
            self._layer_stream.close()
            self._layer_stream = None
            if self._adapter is not None:
                self._adapter.layer_stream = None
            if self._text_stream_of_offload:
                self.disable_text_encoder_streaming()
        return self

    @property
    def sequential_cpu_offload(self) -> bool:
        return self._layer_stream is not None

    def _buffer_bytes(self) -> int:
        """GPU bytes held for weights outside the components' parameters: model offload's weight buffer
        and the streams' two slots (between calls the parameters point at CPU memory)."""
        held = [s.buffer if s is self._model_offload else s.slots
                for s in (self._model_offload, self._text_stream, self._layer_stream) if s is not None]
        return sum(t.numel() for t in held if t is not None)

    def _offload_groups(self) -> list[tuple[str, ...]]:
        """The sets of components model offload loads together: the loop's (the others load alone)."""
        return [tuple(self.LOOP_COMPONENTS)]

    # ---- memory estimate (pipelines/memory.py) -------------------------------------------------------
    KV_FREED_FOR_DECODE = False            # the family frees its KV cache before the decoder runs

    def _memory_layout(self, batch_size: int, height, width) -> tuple:
        """(the schedule of a call at this size, the other parts of ``memory_needed``: logits,
        decoder)."""
        raise NotImplementedError

    def _memory_tries(self, gpu: Optional[bool] = None) -> list:
        """(how to enable it, the policies, the placement: ``estimate_memory``'s offload arguments) of
        each memory setting this pipeline lacks, in the order :meth:`enable_low_vram` tries them:
        those that keep the pictures first (text encoder streaming, then model offload, which copies
        every weight at every call), then the ScaleKV preset (where the enabled policies can take it)
        alone and with each of them, and last sequential CPU offload (the same pictures, but every
        weight copied at every scale) alone and with ScaleKV. ``gpu``: whether the pipeline runs on
        a GPU (default: where it is now)."""
        stack = list(self._policies)
        names = {p.name for p in stack}
        if gpu is None:
            gpu = self.adapter().device.type == "cuda" or self.model_cpu_offload or self.text_encoder_streaming
        free = gpu and not self.model_cpu_offload and not self.sequential_cpu_offload
        stream = [("pipe.enable_text_encoder_streaming()", stack, dict(text_encoder_streaming=True))] if free and \
            isinstance(getattr(self, "text_encoder", None), torch.nn.Module) and not self.text_encoder_streaming else []
        offload = [("pipe.enable_model_cpu_offload()", stack, dict(model_cpu_offload=True, text_encoder_streaming=False))] \
            if free and not self.text_encoder_streaming else []
        sequential = [("pipe.enable_sequential_cpu_offload()", stack, dict(sequential_cpu_offload=True))] if free else []
        if "scalekv" in names or names & set(ScaleKVPolicy.incompatible):
            return stream + offload + sequential
        kept = stack + [ScaleKVPolicy(self.scalekv_preset)]
        return stream + offload + [("pipe.enable_scalekv() / --scalekv", kept, {})] + \
            [(f"{text} + pipe.enable_scalekv()", kept, how) for text, _, how in stream + offload] + \
            sequential + [(f"{text} + pipe.enable_scalekv()", kept, how) for text, _, how in sequential]

    def memory_options(self, batch_size: int, height: Optional[int] = None, width: Optional[int] = None,
                       available: int = 0) -> list[str]:
        """The memory settings this pipeline lacks whose :meth:`estimate_memory` of such a call fits in
        ``available`` bytes (see :meth:`_memory_tries`); each as "how to enable it (estimated peak)"."""
        out = []
        for text, policies, how in self._memory_tries():
            est = self.estimate_memory(batch_size, height, width, policies=policies, **how)
            if est.fits(available):
                out.append(f"{text} ({_gb(est.peak_bytes)})")
        return out

    def enable_low_vram(self, batch_size: int = 1, height: Optional[int] = None, width: Optional[int] = None,
                        available: Optional[int] = None, device: Union[torch.device, str, None] = None,
                        **layout) -> list[str]:
        """Make calls of ``batch_size`` images at ``height`` × ``width`` fit ``device`` (default: where
        the pipeline runs): nothing when :meth:`estimate_memory`'s ``reserved_bytes`` (the peak and the
        allocator's reserve) fits ``available`` bytes (default: all this process may hold there, the
        pipeline's own weights included); else the first of text encoder streaming and model CPU
        offload (the same pictures; each prompt copies the text encoder's blocks / each call every
        weight), the ScaleKV preset (its compressed cache changes the pictures), ScaleKV with
        either, and last sequential CPU offload (the same pictures, slowest: every weight copied at
        every scale) alone and with ScaleKV, whose estimate fits. A pipeline still in CPU memory (load
        it there for a card that cannot hold it whole) goes to ``device`` as the choice needs: whole,
        all but the streamed blocks, or under offload. Returns what it enabled; a ValueError with the estimate
        when nothing fits. The reserve is that of PyTorch's allocator with expandable segments
        (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), which small cards want."""
        here = self._execution_device if self.model_cpu_offload else self.adapter().device
        target = here
        if device is not None:
            try:
                target = torch.device(device)
            except (RuntimeError, TypeError, ValueError):
                raise ValueError(f"enable_low_vram(device={device!r}): not a device; pass 'cuda', 'cuda:N' or "
                                 f"'cpu'") from None
        if target.type == "cuda":
            target = _gpu(None, target, f"enable_low_vram(device={str(target)!r}) needs a CUDA GPU ({{}}); pass "
                                        f"device='cpu' or leave it out")
        if available is None:
            available = memory_available(target)
        elif isinstance(available, bool) or not isinstance(available, (int, np.integer)) or available < 0:
            raise ValueError(f"enable_low_vram(available={available!r}): give the bytes the device has for this "
                             f"pipeline, an int >= 0, or leave it out (what the device has)")
        est = self.estimate_memory(batch_size, height, width, **layout)
        tries = [(None, list(self._policies), {})] + self._memory_tries(gpu=target.type == "cuda")
        for text, policies, how in tries:
            if self.estimate_memory(batch_size, height, width, policies=policies, **how,
                                    **layout).reserved_bytes > available:
                continue
            done = []
            if how.get("sequential_cpu_offload"):
                self.enable_sequential_cpu_offload(device=target)
                done.append("sequential CPU offload")
            elif how.get("text_encoder_streaming"):
                for name, module in self.components.items():
                    if isinstance(module, torch.nn.Module) and name != "text_encoder":
                        module.to(target)
                self.enable_text_encoder_streaming(device=target)
                done.append("text encoder streaming")
            elif how.get("model_cpu_offload"):
                self.enable_model_cpu_offload(device=target)
                done.append("model CPU offload")
            elif target.type != "meta" and not self.model_cpu_offload and not self.text_encoder_streaming and \
                    not self.sequential_cpu_offload and any(
                    p.device != target for m in self.components.values() if isinstance(m, torch.nn.Module)
                    for p in m.parameters()):
                self.to(target)                # the components not there yet (meta: an estimate-only pipeline)
            if len(policies) > len(self._policies):
                self.enable_scalekv()
                done.append("ScaleKV")
            return done
        raise ValueError(f"{batch_size} image(s) at this size need {est} with this pipeline's settings, and "
                         f"{_gb(available)} is available on {target.type}; none of text encoder streaming, model CPU "
                         f"offload, ScaleKV, sequential CPU offload or ScaleKV with any of them would fit: lower batch_size or "
                         f"the size")

    def estimate_memory(self, batch_size: int = 1, height: Optional[int] = None, width: Optional[int] = None,
                        policies: Optional[Sequence[Policy]] = None,
                        model_cpu_offload: Optional[bool] = None, text_encoder_streaming: Optional[bool] = None,
                        sequential_cpu_offload: Optional[bool] = None, **layout) -> MemoryEstimate:
        """The GPU memory a call of ``batch_size`` images at ``height`` × ``width`` (the family's
        default size when left out) will need, before it starts: by phase (prompt, scale loop,
        decode), the weights on the device (all of them, or under model offload the phase's), the
        KV cache (exact, with the policies' compression: ``policies`` or the enabled ones), the
        loop's activations (estimated) and the decoder's. ``.peak_bytes`` grows with the batch;
        ``str()`` names the peak phase and its parts. ``model_cpu_offload``: estimate as if offload
        were on (True) or off (False); default as it is; ``text_encoder_streaming`` and
        ``sequential_cpu_offload`` likewise. ``layout``: the family's other size arguments (FlexVAR:
        ``patch_nums``)."""
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        schedule, parts = self._memory_layout(int(batch_size), height, width, **layout)
        adapter = self.adapter()
        stack = self._call_policies(policies)
        info = dataclasses.replace(adapter.model_info(), schedule=schedule)
        kv = adapter.kv_cache_bytes(int(batch_size), schedule, stack.kv_slots(info))
        rows = 2 * int(batch_size)
        width_c = self.transformer.config.embed_dim
        largest = max(schedule.tokens(si) for si in range(schedule.num_scales))
        activations = rows * largest * width_c * ACTIVATION_BYTES_PER_CHANNEL
        weights = {k: sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
                   for k, m in self.components.items() if isinstance(m, torch.nn.Module)}
        offload = self.model_cpu_offload if model_cpu_offload is None else bool(model_cpu_offload)
        sequential = self.sequential_cpu_offload if sequential_cpu_offload is None else bool(sequential_cpu_offload)
        streaming = sequential or (self.text_encoder_streaming if text_encoder_streaming is None
                                   else bool(text_encoder_streaming))
        if offload and sequential:
            raise ValueError("estimate_memory(model_cpu_offload=True, sequential_cpu_offload=True): the two cannot "
                             "be on together; estimate one of them")
        if streaming and not offload and "text_encoder" in weights:     # two blocks and the embeddings
            weights["text_encoder"] = stream_bytes(self.text_encoder)
        if sequential:                 # the blocks' matrices: two at a time
            away, slots = layer_stream_bytes(adapter.blocks)
            weights["transformer"] += slots - away

        if offload:                    # every phase: the weight buffer the components take turns in
            buffer = max([sum(weights.get(k, 0) for k in g) for g in self._offload_groups()] + list(weights.values()))

        def held(names):
            if offload:
                return {"offloaded weights": buffer}
            return {f"{k} weights": v for k, v in weights.items()}

        phases = {}
        if "text_encoder" in weights:
            phases["prompt"] = {**held(("text_encoder",)), "KV cache": kv}
        phases["scale loop"] = {**held(self.LOOP_COMPONENTS), "KV cache": kv, "activations": activations,
                                "logits": parts.get("logits", 0)}
        phases["decode"] = {**held((self.DECODER,)), "KV cache": 0 if self.KV_FREED_FOR_DECODE else kv,
                            "decoder": 4 * parts.get("decoder", 0)}
        device = self._execution_device if self.model_cpu_offload else adapter.device
        return MemoryEstimate(phases=phases, device=str(device))

    def _load_component(self, *names: str) -> None:
        """Under model offload, put components ``names`` on the GPU (the previous ones leave)."""
        if self._model_offload is not None:
            self._model_offload.load(*names)

    def maybe_free_model_hooks(self):
        """diffusers calls this at the end of a call: under model offload every component goes back
        to the CPU."""
        if self._model_offload is not None:
            self._model_offload.offload()

    @property
    def _execution_device(self) -> torch.device:
        if self._model_offload is not None:
            return self._model_offload.device
        return super()._execution_device

    def to(self, *args, **kwargs):
        """diffusers' ``to(device)`` / ``to(dtype)`` / ``to(device, dtype)``, with a device string
        that names no device (or a dtype given as a string), or the meta device (which holds no
        weights), refused in one line naming the value."""
        what = ", ".join([repr(str(a)) for a in args] + [f"{k}={str(v)!r}" for k, v in kwargs.items()])
        if getattr(self, "_model_offload", None) is not None:
            raise ValueError(f"to({what}) while model CPU offload is on (it keeps the components' weights in CPU "
                             f"memory and moves each to the GPU while it runs); call "
                             f"pipe.disable_model_cpu_offload() first")
        if getattr(self, "_layer_stream", None) is not None:
            raise ValueError(f"to({what}) while sequential CPU offload is on (it keeps the transformer blocks' "
                             f"weights in CPU memory); call pipe.disable_sequential_cpu_offload() first")
        if getattr(self, "_text_stream", None) is not None:
            raise ValueError(f"to({what}) while the text encoder streams (its blocks stay in CPU memory); call "
                             f"pipe.disable_text_encoder_streaming() first")
        for value in (*args, kwargs.get("device"), kwargs.get("torch_device")):
            if not isinstance(value, (str, torch.device)):
                continue
            try:
                device = torch.device(value)
            except (RuntimeError, ValueError):
                key = value.strip().lower().removeprefix("torch.")
                hint = f"; for a dtype pass torch.{key}" if key in ("float32", "float16", "bfloat16", "half",
                                                                     "float") else ""
                raise ValueError(f"to({value!r}): not a device; pass 'cpu', 'cuda' or 'cuda:N' (or a torch.device)"
                                 f"{hint}") from None
            if device.type == "meta":
                raise ValueError(f"to({str(value)!r}): the meta device holds no weights, so the pipeline could not "
                                 f"generate again; pass 'cpu', 'cuda' or 'cuda:N'")
        diffusers_log = logging.getLogger("diffusers.pipelines.pipeline_utils")
        quiet = _DropCPUHalfWarning()            # diffusers says float16 cannot run on the CPU; here it does
        diffusers_log.addFilter(quiet)
        try:
            return super().to(*args, **kwargs)
        finally:
            diffusers_log.removeFilter(quiet)

    @classmethod
    def _pretrained_arguments(cls, path, advice: str, kwargs: dict, dtype, torch_dtype, **dtypes):
        """``from_pretrained``'s shared checks, all before any weight is read: ``dtype`` and
        ``torch_dtype`` agree, the other ``dtypes`` resolve, diffusers' loading arguments in ``kwargs``
        are understood (:class:`LoadOptions`: ``variant``, ``device_map`` as one device,
        ``local_files_only`` (always local), ``use_safetensors`` / ``low_cpu_mem_usage`` at what this
        loader always does, components passed by name and type) and anything else is refused naming
        it; ``path`` holds this pipeline (``check_pipeline_folder``, with ``advice``, the components
        passed in left out); its ``sparsevar_calibration`` is well formed. Returns (folder, model_index,
        dtype, *dtypes in their order, LoadOptions)."""
        from ..models.loading import check_pipeline_folder, local_path, pipeline_components, resolve_dtype
        name = f"{cls.__name__}.from_pretrained"
        rest = dict(kwargs)
        variant = rest.pop("variant", None)
        if variant is not None and (not isinstance(variant, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", variant)):
            raise ValueError(f"variant={variant!r}: a weight variant is a name such as 'fp16' (files "
                             f"<name>.fp16.safetensors, written by save_pretrained(..., variant='fp16'))")
        local = rest.pop("local_files_only", None)
        if local not in (None, True, False):
            raise TypeError(f"local_files_only={local!r}: pass True or False (files are always local here)")
        device = _device_from_map(rest.pop("device_map", None))
        for flag, what in (("use_safetensors", "the safetensors weights are read when a folder has them, else its "
                                               ".bin (with the safe loader)"),
                           ("low_cpu_mem_usage", "models are always built empty and filled from the files")):
            value = rest.pop(flag, None)
            if value not in (None, True):
                raise ValueError(f"{flag}={value!r}: {what}; leave {flag} out")
        expected = pipeline_components(cls.__name__)
        given = {k: rest.pop(k) for k in list(rest) if k in expected}
        for k, module in given.items():
            want = _component_type(expected[k])
            if not isinstance(module, want):
                raise TypeError(f"{k}={type(module).__name__ if module is not None else None}: {cls.__name__} takes "
                                f"a {want.__name__} there; pass one, or leave {k} out to load it from the folder")
        if rest:
            bad = sorted(rest)[0]
            if bad in _DOWNLOAD_ARGUMENTS:
                raise TypeError(f"{name}: {bad}= fetches from the Hugging Face Hub, and nothing is downloaded here; "
                                f"pass a local folder and leave {bad} out")
            raise TypeError(f"{name} got an unexpected argument {bad}=; it takes the folder, dtype / torch_dtype, "
                            f"the per-component dtypes, variant, device_map, local_files_only and components by "
                            f"name ({', '.join(expected)})")
        dtype, torch_dtype = resolve_dtype(dtype, "dtype", True), resolve_dtype(torch_dtype, "torch_dtype", True)
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree; pass one of them")
        others = [resolve_dtype(v, n) for n, v in dtypes.items()]
        path = local_path(path, "pretrained_model_name_or_path")
        index = check_pipeline_folder(path, cls.__name__, expected, advice, variant=variant, given=given)
        calibration = check_calibration(index.get("sparsevar_calibration"),
                                        f"{path / 'model_index.json'}: \"sparsevar_calibration\"")
        kv_calibration = check_scalekv_calibration(index.get("scalekv_calibration"),
                                                   f"{path / 'model_index.json'}: \"scalekv_calibration\"")
        return (path, index, dtype if dtype is not None else torch_dtype, *others,
                LoadOptions(variant=variant, device=device, components=given, sparsevar_calibration=calibration,
                            scalekv_calibration=kv_calibration))

    def save_pretrained(self, save_directory, safe_serialization: bool = True, **kwargs) -> None:
        """diffusers' ``save_pretrained``: ``model_index.json`` and one subfolder per component
        (safetensors). Our components are recorded under the library name ``sparsevar`` rather than
        the defining module's, which inside ComfyUI is a file-system path no other process could import.
        The index names the class as [``sparsevar_pipeline``, class] and a two-line
        ``sparsevar_pipeline.py`` beside it imports that class from the installed package, so
        diffusers' generic ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)``
        loads the folder too (diffusers asks for ``trust_remote_code`` for any module in a folder).
        ``save_directory`` must be a folder (made if missing); an existing file there is refused."""
        from diffusers import ModelMixin

        from ..models.loading import GENERIC_LOADER_MODULE, generic_loader_source, local_path
        path = local_path(save_directory, "save_directory")
        if path.exists() and not path.is_dir():
            raise ValueError(f"save_directory={str(path)!r} is a file; pass a folder to write the pipeline into "
                             f"(it is made if missing)")
        super().save_pretrained(path, safe_serialization=safe_serialization, **kwargs)
        index_path = path / "model_index.json"
        index = json.loads(index_path.read_text())
        for name, module in self.components.items():
            if isinstance(module, ModelMixin):
                index[name] = [LIBRARY_NAME, type(module).__name__]
        index["_class_name"] = [GENERIC_LOADER_MODULE, type(self).__name__]
        (path / f"{GENERIC_LOADER_MODULE}.py").write_text(generic_loader_source(type(self).__name__))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    @property
    def kernels(self) -> str:
        """The kernels the layers run now: ``"torch"``, ``"triton"`` or ``"compile"``. Under the
        default setting ``"auto"`` (:meth:`set_kernels`) that is ``"triton"`` on a GPU where this
        package's Triton kernels run, else (and under PyTorch's cudaMallocAsync allocator) ``"torch"``."""
        return self._kernel_kind(self.adapter())

    def _kernel_kind(self, adapter) -> str:
        """The kind :meth:`set_kernels` chose, with ``"auto"`` resolved for the device the adapter
        runs on (model offload: the execution device): plain torch off the GPU, and under PyTorch's
        cudaMallocAsync allocator (ComfyUI's default), where a Triton kernel launched inside a CUDA
        graph capture was refused its freshly allocated buffer."""
        if self._kernels != "auto":
            return self._kernels
        device = self._execution_device if self.model_cpu_offload else adapter.device
        if device.type != "cuda" or _async_allocator():
            return "torch"
        return "triton" if resolve_backend("auto", device) == "triton" else "torch"

    def set_kernels(self, kernels: str = "triton") -> "AcceleratedPipelineMixin":
        """Choose the kernels of every step of the layers and of the scale loop
        (``sparse_ops.kernels.Kernels``). At batch 1 a block's small steps (LayerNorm + AdaLN, cosine
        q/k norm with the KV-cache write, gated residual), not its matrix products, dominate a VAR step;
        Infinity runs ~20 of them per layer at every scale.

        kernels: ``"auto"`` (the default of a new pipeline): ``"triton"`` wherever the model runs on
            a GPU that can run them, else ``"torch"``, decided at each call from where the model is
            (also ``"torch"`` under PyTorch's cudaMallocAsync allocator: see :meth:`_kernel_kind`).
            ``"triton"`` runs this package's hand-written Triton kernels (``sparse_ops.dense_fused``,
            one launch per step; ``sparse_ops.linear`` for matrix products of ≤ 64 rows, chained on
            sm_90+ by programmatic dependent launch; ``sparse_ops.sample`` for codebook sampling) —
            CUDA and Triton only; where they cannot run (a GPU older than sm_80, ROCm) it falls back to
            ``"compile"`` with a warning. Triton compiles each kernel at its first use on a machine and
            caches it on disk (``TRITON_CACHE_DIR``; torch.compile's parts in
            ``TORCHINDUCTOR_CACHE_DIR``), so the first call of a new machine takes longer.
            ``"compile"``: torch.compile fuses each plain-torch step (the first call compiles for tens
            of seconds). ``"torch"``: plain torch, the reference (CPU too).
        """
        if kernels not in ("auto", *KERNEL_KINDS):
            raise ValueError(f"kernels={kernels!r}: use 'auto' (Triton kernels on a GPU that runs them, else "
                             f"torch; the default), 'triton' (this package's Triton kernels), 'compile' "
                             f"(torch.compile) or 'torch' (plain torch)")
        if kernels not in ("torch", "auto"):
            device = self._execution_device if self.model_cpu_offload else self.transformer.device
            if device.type != "cuda":
                raise ValueError(f"set_kernels({kernels!r}) needs the model on a CUDA device; call pipe.to('cuda') "
                                 f"first (on CPU the torch kernels run)")
            try:
                import triton  # noqa: F401
            except ImportError:
                raise ValueError(f"set_kernels({kernels!r}) needs Triton: pip install 'sparsevar[triton]'") from None
            if kernels == "triton" and resolve_backend("auto", device) != "triton":
                logger.warning("set_kernels: this package's Triton kernels cannot run on this device (sparsevar info "
                               "--backends says why); using kernels='compile' (torch.compile)")
                kernels = "compile"
            if kernels == "triton" and _async_allocator():
                logger.warning("set_kernels('triton') under PyTorch's cudaMallocAsync allocator: a Triton kernel "
                               "inside a CUDA graph capture was refused its buffer there; pass use_cuda_graphs=False "
                               "to the calls, or keep kernels='auto' (plain torch under this allocator)")
        self._kernels = kernels
        return self

    def enable_compiled_elementwise(self, enabled: bool = True, kernels: str = "fused") -> "AcceleratedPipelineMixin":
        """Deprecated (removed in the next release): ``set_kernels("triton")`` for ``kernels="fused"``,
        ``set_kernels("compile")`` for ``"compile"``, ``set_kernels("torch")`` for ``enabled=False``."""
        warnings.warn("enable_compiled_elementwise() is deprecated and will be removed in the next release; use "
                      "pipe.set_kernels('triton') (or 'compile', 'torch')", DeprecationWarning, stacklevel=2)
        if kernels not in ("fused", "compile"):
            raise ValueError(f"kernels={kernels!r}: use 'fused' or 'compile' (better: pipe.set_kernels('triton'))")
        return self.set_kernels({"fused": "triton", "compile": "compile"}[kernels] if enabled else "torch")

    # ---- policies ---------------------------------------------------------------------------------
    @property
    def policies(self) -> PolicyStack:
        """The acceleration policies applied to every call (empty: dense generation)."""
        return self._policies

    def add_policy(self, policy: Policy):
        """Stack an acceleration policy. Its settings are checked against this model now; a policy
        of the same name is replaced; one that cannot be combined raises a ValueError naming what
        to disable."""
        policy.validate(self.adapter().model_info())
        self._policies = self._policies.without(policy.name).with_policy(policy)
        return self

    def remove_policy(self, name: str):
        self._policies = self._policies.without(name)
        return self

    def set_sparsevar_calibration(self, calibration: Optional[dict]) -> "AcceleratedPipelineMixin":
        """Record a checkpoint's SparseVAR calibration in the pipeline's config (``model_index.json``
        key ``sparsevar_calibration``; checked by ``policies.sparsevar.check_calibration``, its
        layer or group against this model), so that :attr:`sparsevar_preset` applies it and
        ``save_pretrained`` keeps it. None: the family preset as it is. ``sparsevar calibrate``
        (``benchmarks.bench_observe.calibrate``) measures one; a calibration is a dict
        ``{"block": 7, "granularity": "layer"}`` plus, optionally, ``"measured"``."""
        calibration = check_calibration(calibration)
        if calibration is not None:
            try:
                SparseVARPolicy(sparsevar_config_for(self.PRESET_FAMILY, calibration)).validate(
                    self.adapter().model_info())
            except ValueError as e:
                raise ValueError(f"sparsevar_calibration does not fit this model: {e}; run `sparsevar calibrate "
                                 f"--model FOLDER` on this checkpoint") from None
        self.register_to_config(sparsevar_calibration=calibration)
        return self

    @property
    def sparsevar_preset(self) -> SparseVARConfig:
        """What ``enable_sparsevar()`` uses: the family preset (``SPARSEVAR_PRESETS``) with this
        checkpoint's calibration (the observed layer ``sparsevar calibrate`` measured) applied."""
        return sparsevar_config_for(self.PRESET_FAMILY, getattr(self.config, "sparsevar_calibration", None))

    def _config(self, config, cls, presets: dict, overrides: dict, method: str):
        if config is None:
            config = self.sparsevar_preset if cls is SparseVARConfig else presets.get(self.PRESET_FAMILY, cls())
        elif not isinstance(config, cls):
            raise TypeError(f"{method}(config=...) takes a {cls.__name__}, got {type(config).__name__}")
        return _replace(config, overrides) if overrides else config

    def enable_sparsevar(self, config: Optional[SparseVARConfig] = None, **overrides):
        """Frequency-aware token exclusion with anchors. ``config`` defaults to
        :attr:`sparsevar_preset` (the family preset, ``SPARSEVAR_PRESETS``, with the checkpoint's
        calibrated layer where it has one); keyword overrides change single fields, e.g. ``tau=0.5`` or
        ``keep_ratio=0.3``. Cannot be combined with FastVAR."""
        cfg = self._config(config, SparseVARConfig, SPARSEVAR_PRESETS, overrides, "enable_sparsevar")
        return self.add_policy(SparseVARPolicy(cfg))

    def disable_sparsevar(self):
        return self.remove_policy(SparseVARPolicy.name)

    def enable_fastvar(self, config: Optional[FastVARConfig] = None, **overrides):
        """Cached token pruning at the last scales. ``config`` defaults to the family preset
        (``FASTVAR_PRESETS``); e.g. ``ratios=(0.5, 0.75)``. Cannot be combined with SparseVAR."""
        cfg = self._config(config, FastVARConfig, FASTVAR_PRESETS, overrides, "enable_fastvar")
        return self.add_policy(FastVARPolicy(cfg))

    def disable_fastvar(self):
        return self.remove_policy(FastVARPolicy.name)

    def enable_sparvar(self, config: Optional[SparVARConfig] = None, **overrides):
        """Sparse cross-scale attention (CS4A + CSLA) from the decision scale on: every token is
        computed, each query reads fewer keys. ``config`` defaults to the family preset
        (``SPARVAR_PRESETS``); e.g. ``top_keys=0.3``. Combines with scale skipping and cond-only;
        cannot be combined with SparseVAR or FastVAR."""
        cfg = self._config(config, SparVARConfig, SPARVAR_PRESETS, overrides, "enable_sparvar")
        return self.add_policy(SparVARPolicy(cfg))

    def disable_sparvar(self):
        return self.remove_policy(SparVARPolicy.name)

    @property
    def scalekv_preset(self) -> ScaleKVConfig:
        """What ``enable_scalekv()`` uses: the family's preset (``SCALEKV_PRESETS``; Infinity-2B and
        8B: the release's budgets and drafter layers), with this checkpoint's measured drafters
        (``sparsevar calibrate --scalekv``) where it has them."""
        return scalekv_preset(self.PRESET_FAMILY, self.adapter().num_layers,
                              getattr(self.config, "scalekv_calibration", None))

    def set_scalekv_calibration(self, calibration: Optional[dict]) -> "AcceleratedPipelineMixin":
        """Record a checkpoint's ScaleKV calibration — ``{"drafters": [layer, …]}`` and optionally
        ``"measured"`` — in the pipeline's config (``model_index.json`` key ``scalekv_calibration``),
        so that :attr:`scalekv_preset` uses its drafter layers and ``save_pretrained`` keeps it.
        None: the family preset as it is. ``sparsevar calibrate --scalekv``
        (``benchmarks.bench_observe.calibrate_drafters``) measures one."""
        calibration = check_scalekv_calibration(calibration)
        if calibration is not None:
            info = self.adapter().model_info()
            try:
                ScaleKVPolicy(scalekv_preset(self.PRESET_FAMILY, info.num_layers, calibration)).validate(info)
            except ValueError as e:
                raise ValueError(f"scalekv_calibration does not fit this model: {e}; run `sparsevar calibrate "
                                 f"--scalekv --model FOLDER` on this checkpoint") from None
        self.register_to_config(scalekv_calibration=calibration)
        return self

    def enable_scalekv(self, config: Optional[ScaleKVConfig] = None, **overrides):
        """Scale-aware KV-cache compression (memory, not speed): after each scale, refiner layers keep
        a budget of their cached keys, drafter layers everything, and the cache is allocated for
        what they keep. ``config`` defaults to :attr:`scalekv_preset`; e.g. ``budget=0.1``
        (1 keeps everything). Combines with scale skipping and cond-only; cannot be combined with
        SparVAR, SparseVAR or FastVAR."""
        if config is None:
            config = self.scalekv_preset
        cfg = self._config(config, ScaleKVConfig, {}, overrides, "enable_scalekv")
        return self.add_policy(ScaleKVPolicy(cfg))

    def disable_scalekv(self):
        return self.remove_policy(ScaleKVPolicy.name)

    def enable_scale_skip(self, config: Optional[ScaleSkipConfig] = None, *, skip_last: Optional[int] = None,
                          cond_only_from: Optional[int] = None):
        """Skip the last ``skip_last`` scales and/or run scales from ``cond_only_from`` (negative =
        from the end) without the unconditional half. Combines with SparseVAR or FastVAR."""
        overrides = {k: v for k, v in (("skip_last", skip_last), ("cond_only_from", cond_only_from)) if v is not None}
        cfg = self._config(config, ScaleSkipConfig, {}, overrides, "enable_scale_skip")
        return self.add_policy(ScaleSkipPolicy(cfg))

    def disable_scale_skip(self):
        return self.remove_policy(ScaleSkipPolicy.name)

    # ---- call -------------------------------------------------------------------------------------
    @phase("sparsevar.check_inputs")
    def _check_call(self, n: int, noun: str, needed: Callable[[int], dict], guidance_scale, top_k, top_p,
                    num_images_per_prompt, output_type, generator, callback_on_step_end,
                    callback_on_step_end_tensor_inputs, policies, size: str = "", hw: tuple = (None, None),
                    layout: Optional[dict] = None) -> int:
        """The checks of a call every family shares, before any work, for ``n`` inputs (``noun``) ×
        ``num_images_per_prompt`` = B images: sampling numbers, output type, generator(s), callback,
        policies (Policy objects), and :func:`check_memory` for ``needed(B)`` bytes, its KV cache the
        exact one of the call's policies (``size``: " at HxW" where the call chooses it; ``hw`` and
        ``layout``: the size arguments of :meth:`estimate_memory`). ValueError / TypeError naming
        the argument. Returns B."""
        if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, numbers.Real) \
                or not 0 <= guidance_scale <= GUIDANCE_SCALE_MAX:
            raise ValueError(f"guidance_scale must be a number in [0, {GUIDANCE_SCALE_MAX:g}] "
                             f"({self.DEFAULTS.guidance_off:g} disables guidance), got {guidance_scale!r}")
        if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no limit; 1 = greedy), got {top_k!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (0 disables nucleus sampling), got {top_p!r}")
        if not isinstance(num_images_per_prompt, (int, np.integer)) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be an int >= 1, got {num_images_per_prompt!r}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        B = n * int(num_images_per_prompt)
        if isinstance(num_images_per_prompt, (bool, np.bool_)):
            raise TypeError(f"num_images_per_prompt must be an int >= 1, got {num_images_per_prompt!r}")
        gens = generator if isinstance(generator, (list, tuple)) else [generator]
        if isinstance(generator, (list, tuple)) and len(generator) != B:
            raise ValueError(f"got {len(generator)} generators for {B} images; pass one generator, or one per "
                             f"image ({noun}s × num_images_per_prompt = {B})")
        wrong = [g for g in gens if g is not None and not isinstance(g, torch.Generator)]
        if wrong:
            raise TypeError(f"generator must be a torch.Generator (or a list of one per image), got "
                            f"{type(wrong[0]).__name__} {wrong[0]!r}; e.g. generator=torch.Generator().manual_seed(0)")
        if callback_on_step_end is not None and not callable(callback_on_step_end):
            raise TypeError(f"callback_on_step_end must be a function fn(pipe, step, timestep, callback_kwargs), got "
                            f"{type(callback_on_step_end).__name__} {callback_on_step_end!r}")
        if isinstance(callback_on_step_end_tensor_inputs, str):
            raise TypeError(f"callback_on_step_end_tensor_inputs must be a list of names, got the string "
                            f"{callback_on_step_end_tensor_inputs!r}; e.g. [{callback_on_step_end_tensor_inputs!r}]")
        allowed = self._callback_tensor_inputs
        bad = [k for k in (callback_on_step_end_tensor_inputs or []) if k not in allowed]
        if bad:
            raise ValueError(f"callback_on_step_end_tensor_inputs has {bad}; allowed: {list(allowed)}")
        if policies is not None:
            listed = isinstance(policies, (list, tuple))
            wrong = [q for q in (policies if listed else [policies]) if not isinstance(q, Policy)]
            if wrong or not listed:
                q = wrong[0] if wrong else policies
                wrap = {SparseVARConfig: "SparseVARPolicy", FastVARConfig: "FastVARPolicy",
                        ScaleSkipConfig: "ScaleSkipPolicy", ScaleKVConfig: "ScaleKVPolicy",
                        SparVARConfig: "SparVARPolicy"}.get(type(q), "SparseVARPolicy")
                got = f"a {type(q).__name__}" + ("" if listed else ", not a list")
                raise TypeError(f"policies must be a list of Policy objects, got {got}; e.g. policies=[{wrap}(config)]")
        parts = needed(B)
        device = self._execution_device if self.model_cpu_offload else self.adapter().device
        total, held, free = sum(parts.values()), self._buffer_bytes(), _free_bytes(device)
        # memory_available walks every weight: asked only where what the driver has free falls short
        if "KV cache" in parts and total > free - held and total > memory_available(
                device, [c for c in self.components.values() if isinstance(c, torch.nn.Module)]) - held:
            # the bound above counts the whole cache; the exact one (ScaleKV's compression) takes the
            # estimate's work, so only where the bound does not fit
            size_kw = {**({"height": hw[0], "width": hw[1]} if hw[0] is not None else {}), **(layout or {})}
            parts["KV cache"] = self.estimate_memory(B, policies=policies, **size_kw).phases["scale loop"]["KV cache"]
        check_memory(self, parts, B, f"num_images_per_prompt={num_images_per_prompt} × {n} {noun}(s) = {B} images"
                     f"{size}", f"lower num_images_per_prompt, or split the {noun}s over several calls", hw, free)
        return B

    def _call_policies(self, policies: Optional[Sequence[Policy]]) -> PolicyStack:
        """The policies of one call: those passed to it, each validated against the model and then
        stacked (a ValueError before any work for settings the model cannot run or policies that
        cannot be combined), or else the enabled ones."""
        if policies is None:
            return self._policies
        info, stack = self.adapter().model_info(), PolicyStack()
        for p in policies:
            p.validate(info)
            stack = stack.with_policy(p)
        return stack

    def _generate(self, conditioning, batch_size: int, policies: PolicyStack, guidance_scale, top_k, top_p,
                  generator, output_type: str, return_dict: bool, callback_on_step_end,
                  callback_on_step_end_tensor_inputs, use_cuda_graphs: Optional[bool], schedule=None, **engine):
        """Run ``engine.sampler.generate`` (``engine``: the family's further arguments) on checked inputs
        with the progress bar and ``callback_on_step_end``; post-process into the family's output."""
        self._load_component(*self.LOOP_COMPONENTS)
        adapter = self.adapter()
        if self._layer_stream is not None and adapter.layer_stream is not self._layer_stream:
            raise ValueError("the transformer was replaced after enable_sequential_cpu_offload(): call "
                             "pipe.disable_sequential_cpu_offload() and enable it again")
        graphs = adapter.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._interrupt = False
        settings = SamplingSettings(guidance_scale=float(guidance_scale), top_k=int(top_k), top_p=float(top_p))
        wanted = tuple(callback_on_step_end_tensor_inputs or ())
        with self.progress_bar(total=(schedule or adapter.schedule).num_scales) as pbar:
            def on_scale(si: int, tensors: dict) -> Optional[dict]:
                self._current_scale = si
                edit = None
                if callback_on_step_end is not None:
                    # copies: the tensors live in buffers that later scales and calls overwrite
                    given = {k: tensors[_CALLBACK_NAMES.get(k, k)].clone() for k in wanted}
                    back = callback_on_step_end(self, si, si, given)
                    if isinstance(back, dict):             # as diffusers: the returned latents are used from here on
                        new = back.get("latents", back.get("latent"))
                        if new is not None:
                            edit = {"latent": new}
                pbar.update()
                return edit

            result = generate(adapter, conditioning, batch_size, settings=settings, generator=generator,
                              policies=policies, callback=on_scale, cuda_graphs=graphs,
                              decode=output_type != "latent", stop=lambda: self._interrupt, schedule=schedule,
                              before_decode=lambda: self._load_component(self.DECODER), **engine)
            skipped = sum(s.skipped for s in result.stats.scales)
            if skipped and not self._interrupt:         # skipped scales are done too (not those after a stop)
                pbar.set_postfix_str(f"{skipped} skipped", refresh=False)
                pbar.update(skipped)
        self._current_scale = None
        images = self._postprocess(result.images if output_type != "latent" else result.latent, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return images, [result.stats]
        return self._output_class(images=images, stats=[result.stats])

    # ---- diffusers-style properties ---------------------------------------------------------------
    @property
    def current_timestep(self):
        return self._current_scale

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def release_memory(self) -> None:
        """Drop the KV caches (and CUDA graphs) kept for repeated calls, and model offload's weight
        buffer."""
        if self._adapter is not None:
            self._adapter.release()
        if self._model_offload is not None:
            self._model_offload.release()
        if self._text_stream is not None:
            self._text_stream.release()
        if self._layer_stream is not None:
            self._layer_stream.release()

    @staticmethod
    @phase("sparsevar.postprocess")
    def _postprocess(x: torch.Tensor, output_type: str):
        """Decoded images (B, 3, H, W) in [0, 1] as ``output_type``: "pt" (and "latent") as they are,
        "np" (B, H, W, 3) float32 through diffusers' ``VaeImageProcessor.pt_to_numpy``, "pil" with
        its arithmetic (× 255, round half to even, uint8) done on the images' device and one uint8
        copy to the host — the same pictures as ``VaeImageProcessor.numpy_to_pil`` of the "np"
        output, without moving float32 images and converting them on the CPU."""
        if output_type in ("pt", "latent"):
            return x
        if output_type == "np":
            from diffusers.image_processor import VaeImageProcessor
            return VaeImageProcessor.pt_to_numpy(x.detach().clamp(0, 1))                 # (B, 3, H, W) → (B, H, W, 3)
        # made contiguous on the device: a strided host array costs PIL a slow strided copy per picture
        u8_BHW3 = (x.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        return [PIL.Image.fromarray(a) for a in u8_BHW3.cpu().numpy()]                # (B, 3, H, W) → (B, H, W, 3)
