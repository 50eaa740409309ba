"""The model adapter: what the engine needs from a model family, and nothing else.

Every family (VAR, Infinity, HART) subclasses :class:`ModelAdapter` in its own model file and
implements the methods below that raise NotImplementedError; the rest (the workspace kept between
calls, the kernel choice, the cond-only switch, the default block calls) is shared here. The
engine never looks inside a model; policies reach the model only through the hook points the
adapter calls.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..sparse_ops.kernels import TORCH_KERNELS, Kernels
from .graphs import GraphStreams
from .layers import LayerCall
from .memory import trim_host_heap
from .schedule import ScaleSchedule
from .state import ModelInfo, RunState
from .workspace import Workspace


class ModelAdapter:
    """A family's transformer and tokenizer behind the engine's interface.

    ``family``; ``supports_cuda_graphs``; ``supports_scale_graphs``: guide, sample (with its noise
    drawn beforehand), residual and accumulate may be captured with the scale's compute into one
    CUDA graph (see :meth:`sample`); ``layer_groups`` / ``sublayers``: the layer topology policies
    validate against (:class:`~.state.ModelInfo`). ``ops``: the :class:`~..sparse_ops.kernels.Kernels`
    the family's layers run (:meth:`set_kernels`); ``blocks``: its transformer blocks in order."""

    family: str = "model"
    supports_cuda_graphs = True
    supports_scale_graphs = False
    layer_groups = 0
    sublayers: tuple = ("self_attn", "ffn")
    choices = 0                                        # see ModelInfo.choices

    def __init__(self, transformer, schedule: ScaleSchedule, blocks: Sequence):
        self.transformer, self.schedule = transformer, schedule
        self.blocks = list(blocks)
        self.num_layers = len(self.blocks)
        self.graph_streams = GraphStreams()            # the side streams of the engine's graphs
        self.ops: Kernels = TORCH_KERNELS
        self._workspace: Optional[Workspace] = None    # one at a time: the last call's shape's
        self._workspace_key = None
        # the blocks' matrices streamed from CPU memory layer by layer (pipelines/offload.py's
        # LayerStream: ``enter(i)`` / ``leave(i)`` / ``forget()`` / ``release()``), or None
        self.layer_stream = None

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def model_info(self) -> ModelInfo:
        """Family, schedule and layer topology (what policies validate their settings against)."""
        return ModelInfo(family=self.family, schedule=self.schedule, num_layers=self.num_layers,
                         layer_groups=self.layer_groups, sublayers=self.sublayers, choices=self.choices)

    def streamed_blocks(self):
        """The transformer blocks in order, each with all its weights on the device while the caller
        works on it: what a ``begin`` that reads every block's matrices (per-generation projections)
        walks, so that it also runs under a layer stream."""
        stream = self.layer_stream
        for i, blk in enumerate(self.blocks):
            if stream is not None:
                stream.enter(i)
            try:
                yield blk
            finally:
                if stream is not None:
                    stream.leave(i)

    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, heads, head_dim) of the self-attention KV cache (memory estimates)."""
        cfg = self.transformer.config
        return cfg.depth, cfg.num_heads, cfg.embed_dim // cfg.num_heads

    # where a family's workspace can give the last scale's K/V one buffer shared by the layers
    # (engine/kv_cache.py), whether it does: "auto" (when the whole cache would be large,
    # ``kv_tail_needed``), True or False; None where the family's workspace has no tail
    kv_tail = None

    def kv_tail_used(self, schedule: ScaleSchedule, rows: int, slots) -> bool:
        """Whether a generation of ``rows`` rows over ``schedule`` (with a compressing policy's
        ``slots``) gives the last scale's K/V a tail shared by the layers: ``kv_tail`` as set, or on
        "auto" when the whole cache would be large. A compressed cache (``slots``) passes its last
        scale through the tail whatever this says."""
        if self.kv_tail is None:
            return False
        if self.kv_tail not in ("auto", True, False):
            raise ValueError(f"kv_tail={self.kv_tail!r}: choose 'auto', True (a last-scale tail shared by the "
                             f"layers) or False (the whole cache per layer)")
        if self.kv_tail != "auto":
            return self.kv_tail
        from .kv_cache import kv_tail_needed
        layers, heads, head_dim = self.kv_layout()
        full = 2 * layers * rows * schedule.total_tokens * heads * head_dim * self.dtype.itemsize
        return kv_tail_needed(full, self.device)

    def kv_cache_bytes(self, batch_size: int, schedule: ScaleSchedule, slots=None) -> int:
        """The bytes of the KV cache a generation allocates ([cond; uncond] rows), computed by
        building it on the meta device."""
        from .kv_cache import KVCache
        layers, heads, head_dim = self.kv_layout()
        counts = [schedule.tokens(si) for si in range(schedule.num_scales)]
        rows = 2 * batch_size
        kv = KVCache.for_schedule(layers, rows, heads, head_dim, counts, self.dtype, "meta", slots,
                                  self.kv_tail_used(schedule, rows, slots))
        return kv.nbytes()

    def set_kernels(self, kind: str) -> None:
        """Run the layers on the ``"torch"``, ``"triton"`` or ``"compile"`` kernels
        (:class:`~..sparse_ops.kernels.Kernels`); a change frees the workspace (its graphs captured
        the old kernels)."""
        if kind != self.ops.kind:
            self.ops = TORCH_KERNELS if kind == "torch" else Kernels(kind)
            self.release()

    def workspace(self, key, make: Callable[[], Workspace]) -> Workspace:
        """The workspace of ``key`` (what fixes its buffers: batch size, schedule, device, dtype …):
        the last call's when the key matches, else a new one, made after the old one is freed (so
        memory is bounded by the largest shape in flight, not by every shape seen; a workspace's
        CUDA graphs serve its shape only, so alternating shapes re-allocate and re-capture)."""
        if self._workspace_key != key:
            self.release()                             # the old one goes first: its memory can serve the new one
            self._workspace, self._workspace_key = make(), key
        return self._workspace

    def release(self) -> None:
        """Free the workspace (KV cache, CUDA graphs); on the CPU, hand the freed memory back to the
        operating system (engine/memory.py)."""
        ws, self._workspace, self._workspace_key = self._workspace, None, None
        if ws is not None:
            device = ws.device
            del ws
            trim_host_heap(device)

    def begin(self, run: RunState, conditioning: Any) -> None:
        """Set up a generation: conditioning rows ([cond; uncond]), hoisted per-image projections,
        the (reused) workspace (an :class:`~.workspace.Workspace`) with its KV cache and latent,
        the first stage input; sets ``run.workspace``."""
        raise NotImplementedError

    def prepare(self, run: RunState) -> None:
        """The generation's set-up that is tensor work alone, after :meth:`begin`: what it computes from
        the conditioning :meth:`begin` copied into the workspace (per-row modulations, text memory,
        start tokens, the latent cleared). It reads and writes workspace buffers only, with no host
        read, so the engine may replay it from a CUDA graph keyed by :meth:`prepare_key` (one launch
        where it would be hundreds). Default: nothing (a family whose ``begin`` does it all)."""

    def prepare_key(self, run: RunState) -> Optional[tuple]:
        """What fixes the shapes and the work of :meth:`prepare` in this workspace (a graph per key),
        or None where it must run eagerly. Default: None."""
        return None

    def stage_input(self, si: int, run: RunState) -> torch.Tensor:
        """The full token map entering the blocks at scale ``si``: (R, h·w, C) float32, read from the
        workspace only (a scale's compute may be captured as a CUDA graph and replayed later)."""
        raise NotImplementedError

    # the layer loop's family part (engine/layers.py runs the loop; see there)
    def chains_layers(self) -> bool:
        """Whether layers no sub-layer wrapper acts on run the chained dense path."""
        raise NotImplementedError

    def chains_into_head(self) -> bool:
        """Whether the last chained block may also compute the head's modulated input."""
        raise NotImplementedError

    def scale_constants(self, si: int, run: RunState, pos: torch.Tensor) -> Any:
        """Whatever the scale's layers share (e.g. RoPE of its positions), passed to layer_call."""
        raise NotImplementedError

    def layer_call(self, si: int, i: int, run: RunState, pos: torch.Tensor, valid_Rn: Optional[torch.Tensor],
                   record: bool, shared: Any) -> LayerCall:
        """Where layer ``i`` runs: a :class:`LayerCall` with the family's per-layer constants."""
        raise NotImplementedError

    def layer(self, i: int, x_RlC: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """Block ``i`` with its sub-layer hooks (``run.hooks.wraps(i)``), unchained: the block called
        with its AdaLN rows (``workspace.ada_NR6C``)."""
        return self.blocks[i](x_RlC, call.run.workspace.ada_NR6C[i, :call.run.rows], call)

    def chain_input(self, i: int, x_RlC: torch.Tensor, run: RunState) -> torch.Tensor:
        """Block ``i``'s modulated first sub-layer input, where a chain starts: LN(x)·(1 + s1) + b1."""
        blk, ada_R6C = self.blocks[i], run.workspace.ada_NR6C[i, :run.rows]
        return self.ops.modulate(x_RlC, ada_R6C[:, 2:3], ada_R6C[:, 4:5], blk.norm_eps, blk.ffn.fc1.weight.dtype)

    def chained_layer(self, i: int, x_RlC: torch.Tensor, y_RlC: torch.Tensor, chain_next: bool,
                      call: LayerCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Block ``i`` on the chained path from its modulated input ``y_RlC``: (x, the next block's
        modulated input — or the head's after the last block — when ``chain_next``, else None)."""
        raise NotImplementedError

    def head(self, x_RLC: torch.Tensor, run: RunState, modulated: bool = False) -> torch.Tensor:
        """The logits of every row, (R, h·w, V), in float32 or in a dtype :meth:`guide` takes;
        ``modulated``: ``x_RLC`` already is the head's LayerNorm + AdaLN output."""
        raise NotImplementedError

    def guide(self, si: int, logits: torch.Tensor, run: RunState) -> torch.Tensor:
        """Classifier-free guidance (the family's formula) → guided float32 logits (B, h·w, V)."""
        raise NotImplementedError

    def sample(self, si: int, guided_logits: torch.Tensor, run: RunState) -> torch.Tensor:
        """Draw this scale's codes from the guided logits with ``run.generator``.

        With whole-scale CUDA graphs (``supports_scale_graphs = True``) the scale's random draws come
        from ``run.drawn_noise`` (see :meth:`scale_noise`) instead of the generator."""
        raise NotImplementedError

    def scale_noise(self, si: int, run: RunState) -> Optional[tuple]:
        """For whole-scale CUDA graphs (``supports_scale_graphs = True``): every random draw that
        :meth:`sample`, :meth:`residual` and :meth:`accumulate` make at ``si``, in the order they make
        them, as ``(kind, shape)`` pairs with ``kind`` "exponential" or "normal" (float32, from
        ``run.generator`` on the model's device, as ``torch.empty(shape).exponential_(generator=…)``
        or ``torch.randn(shape, generator=…)``); None when they cannot be drawn beforehand (e.g. a
        list of generators). The engine draws them just before the scale into buffers it keeps and
        hands them over in ``run.drawn_noise`` (a list in the same order; None on eager scales), so the
        draws are the ones an eager scale makes and the scale — compute → guide → sample → residual →
        accumulate — can replay from one graph. ``accumulate`` must then change nothing but
        workspace buffers."""
        return None

    def scale_graph_constants(self, run: RunState) -> tuple:
        """What a whole-scale graph bakes in besides ``run.settings``: the call's values that change
        the scale's work after the compute (e.g. a temperature, a sampling variant). Graphs captured
        under other values are dropped."""
        return ()

    def residual(self, si: int, codes: torch.Tensor, run: RunState) -> torch.Tensor:
        """Per-token residual of the sampled codes, (B, h·w, c) (what ``post_residual`` may edit)."""
        raise NotImplementedError

    def accumulate(self, si: int, residual: torch.Tensor, run: RunState) -> None:
        """Add the residual into the latent and prepare the next scale's input."""
        raise NotImplementedError

    def drop_uncond(self, run: RunState) -> None:
        """Switch to conditional rows only (cond-only mode): slice every per-row state (here the KV
        cache's rows; the other per-row buffers are read through ``run.rows``)."""
        run.workspace.kv.keep_rows(run.batch_size)

    def latent(self, run: RunState) -> torch.Tensor:
        """The latent accumulated so far (what decode would turn into images)."""
        raise NotImplementedError

    @torch.no_grad()
    def replace_latent(self, si: int, latent: torch.Tensor, run: RunState) -> None:
        """Set the latent after scale ``si`` to ``latent`` (the shape of :meth:`latent`), in place, and
        remake what the next scale reads from it (a callback's edit). Here: the latent alone, for a
        family whose next input is made from it when that scale starts."""
        self.latent(run).copy_(latent)

    def decode(self, run: RunState) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from the accumulated latent."""
        raise NotImplementedError

    def decode_key(self, run: RunState) -> Optional[tuple]:
        """What a captured :meth:`decode` depends on besides this workspace (whose key must hold the
        decoder's weights: a graph reads their addresses), so that the engine may replay it from a
        CUDA graph — one launch
        where an eager decoder makes hundreds, which leaves the GPU waiting on the host at the small
        maps; or None where it must run eagerly (its shapes or buffers change between calls, or it
        frees and takes back memory as it goes). Default: None."""
        return None

    def end(self, run: RunState, keep_workspace: bool) -> None:
        """Release per-run state; drop the workspace too unless asked to keep it."""
        run.workspace = None
        if not keep_workspace:
            self.release()
