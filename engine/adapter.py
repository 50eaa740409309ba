"""The model-adapter interface: what the engine needs from a model family, and nothing else.

Every family (VAR, Infinity, HART) implements it in its own model file. The engine never looks
inside a model; policies reach the model only through the hook points the adapter calls.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from .graphs import GraphStreams
from .layers import LayerCall
from .schedule import ScaleSchedule
from .state import ModelInfo, RunState


class ModelAdapter(Protocol):
    family: str
    schedule: ScaleSchedule
    num_layers: int
    supports_cuda_graphs: bool
    # guide, sample (with its noise drawn beforehand), residual and accumulate may be captured with
    # the scale's compute into one CUDA graph (see sample)
    supports_scale_graphs: bool
    graph_streams: GraphStreams    # the side streams the engine's graphs of this adapter use

    def model_info(self) -> ModelInfo:
        """Family, schedule and layer topology (what policies validate their settings against)."""

    def begin(self, run: RunState, conditioning: Any) -> None:
        """Set up a generation: conditioning rows ([cond; uncond]), hoisted per-image projections,
        the (reused) workspace (an :class:`~.workspace.Workspace`) with its KV cache and latent,
        the first stage input; sets ``run.workspace``."""

    def stage_input(self, si: int, run: RunState) -> torch.Tensor:
        """The full token map entering the blocks at scale ``si``: (R, h·w, C) float32, read from the
        workspace only (a scale's compute may be captured as a CUDA graph and replayed later)."""

    # the layer loop's family part (engine/layers.py runs the loop; see there)
    def chains_layers(self) -> bool:
        """Whether layers no sub-layer wrapper acts on run the chained dense path."""

    def chains_into_head(self) -> bool:
        """Whether the last chained block may also compute the head's modulated input."""

    def scale_constants(self, si: int, run: RunState, pos: torch.Tensor) -> Any:
        """Whatever the scale's layers share (e.g. RoPE of its positions), passed to layer_call."""

    def layer_call(self, si: int, i: int, run: RunState, pos: torch.Tensor, valid_Rn: Optional[torch.Tensor],
                   record: bool, shared: Any) -> LayerCall:
        """Where layer ``i`` runs: a :class:`LayerCall` with the family's per-layer constants."""

    def layer(self, i: int, x_RlC: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """Block ``i`` with its sub-layer hooks (``run.hooks.wraps(i)``), unchained."""

    def chain_input(self, i: int, x_RlC: torch.Tensor, run: RunState) -> torch.Tensor:
        """Block ``i``'s modulated first sub-layer input, where a chain starts."""

    def chained_layer(self, i: int, x_RlC: torch.Tensor, y_RlC: torch.Tensor, chain_next: bool,
                      call: LayerCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Block ``i`` on the chained path from its modulated input ``y_RlC``: (x, the next block's
        modulated input — or the head's after the last block — when ``chain_next``, else None)."""

    def head(self, x_RLC: torch.Tensor, run: RunState, modulated: bool = False) -> torch.Tensor:
        """The logits of every row, (R, h·w, V), in float32 or in a dtype :meth:`guide` takes;
        ``modulated``: ``x_RLC`` already is the head's LayerNorm + AdaLN output."""

    def guide(self, si: int, logits: torch.Tensor, run: RunState) -> torch.Tensor:
        """Classifier-free guidance (the family's formula) → guided float32 logits (B, h·w, V)."""

    def sample(self, si: int, guided_logits: torch.Tensor, run: RunState) -> torch.Tensor:
        """Draw this scale's codes from the guided logits with ``run.generator``.

        Optional, for whole-scale CUDA graphs (``supports_scale_graphs = True``):
        ``sample_noise_shape(si, run)`` gives the shape of the one float32 ``exponential_`` tensor
        sample draws (None when it cannot take it pre-drawn), and ``sample(si, guided, run,
        noise_NV=…)`` uses that noise instead of drawing; ``accumulate`` must then change nothing
        but :meth:`latent`, so that the engine can capture compute → guide → sample → residual →
        accumulate as one graph."""

    def residual(self, si: int, codes: torch.Tensor, run: RunState) -> torch.Tensor:
        """Per-token residual of the sampled codes, (B, h·w, c) (what ``post_residual`` may edit)."""

    def accumulate(self, si: int, residual: torch.Tensor, run: RunState) -> None:
        """Add the residual into the latent and prepare the next scale's input."""

    def drop_uncond(self, run: RunState) -> None:
        """Switch to conditional rows only (cond-only mode): slice every per-row state."""

    def latent(self, run: RunState) -> torch.Tensor:
        """The latent accumulated so far (what decode would turn into images)."""

    def decode(self, run: RunState) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1] from the accumulated latent."""

    def end(self, run: RunState, keep_workspace: bool) -> None:
        """Release per-run state; drop the workspace too unless asked to keep it."""
