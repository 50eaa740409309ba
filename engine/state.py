"""Per-generation state. The engine creates a fresh ``RunState`` for every call; nothing outlives it
except the adapter's reusable workspace (static buffers and CUDA graphs): one, that of the last call's
batch shape, replaced when a call of another shape comes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from .contract import NO_HOOKS, PolicyStack, ScaleHooks, ScalePlan
from .schedule import ScaleSchedule

GeneratorArg = Union[torch.Generator, list, None]


@dataclass(frozen=True)
class ModelInfo:
    """What policies may know about a model to validate their settings against it.

    layer_groups: number of block groups (Infinity's chunks); 0 when the family has none.
    sublayers: the residual branches of one layer, in order (Infinity adds "cross_attn").
    choices: the size of each categorical distribution a token's logits hold, consecutive along the
        last dim (Infinity's bits: 2); 0 = one distribution over the whole vocabulary (VAR).
    """

    family: str
    schedule: ScaleSchedule
    num_layers: int
    layer_groups: int = 0
    sublayers: tuple = ("self_attn", "ffn")
    choices: int = 0

    @property
    def layers_per_group(self) -> int:
        return self.num_layers // self.layer_groups if self.layer_groups else 1


@dataclass(frozen=True)
class SamplingSettings:
    """How codes are drawn at every scale (each family's defaults: pipelines/defaults.py).

    guidance_scale: classifier-free guidance strength, 0 … ``GUIDANCE_SCALE_MAX``, in the family's
        formula (VAR ramps it linearly with the scale index, from 0 at the first scale to this value
        at the last).
    top_k: keep the k most likely codes per token (0 = no limit).
    top_p: nucleus mass kept per token, in [0, 1] (0 = off).
    """

    guidance_scale: float
    top_k: int
    top_p: float


def _format_count(n: float) -> str:
    """A token count as printed in the stats: an integer when whole ("404"), else one decimal
    ("85.1"; a mean over images or layers)."""
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


@dataclass
class ScaleStats:
    """What one scale cost. ``tokens_computed`` counts token rows that ran through the transformer
    per image (the CFG half is not counted twice): the mean over the batch's images where they
    keep different counts, and over the layers where layers keep different counts (FastVAR), so
    it may be fractional. ``rows`` says how many rows per image ran: 2 with guidance, 1 in
    cond-only mode or without guidance."""

    si: int
    h: int
    w: int
    tokens: int
    tokens_computed: float
    ms: float = float("nan")        # the whole scale: the policies' plan, compute, head, sampling, latent update
    skipped: bool = False
    policy_ms: float = 0.0          # the part of ``ms`` in the policies' own scale-level work (plan, post hooks)
    rows: int = 2
    keys_read: Optional[float] = None  # cached keys a query read, per layer (mean); None: every one so far

    @property
    def kept_ratio(self) -> float:
        return self.tokens_computed / self.tokens if self.tokens else 0.0


@dataclass
class GenerationStats:
    scales: list[ScaleStats] = field(default_factory=list)
    decode_ms: float = float("nan")
    # per pruned scale, (B, h, w) uint8 token roles (policies/sparsevar.py TOKEN_* codes), for sparsevar.viz
    token_maps: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.scales)

    def kv_per_scale(self) -> list[float]:
        """Per scale, the cached keys a query read (``keys_read``), or where no policy narrowed
        attention the running sum of tokens computed (what the FLOP models assume by default)."""
        out, prefix = [], 0.0
        for s in self.scales:
            prefix += s.tokens_computed
            out.append(s.keys_read if s.keys_read is not None else prefix)
        return out

    @property
    def tokens_computed(self) -> float:
        """Token rows computed per image over every scale (see :class:`ScaleStats`)."""
        return sum(s.tokens_computed for s in self.scales)

    @property
    def transformer_ms(self) -> float:
        return sum(s.ms for s in self.scales if not s.skipped)

    def summary(self) -> str:
        kept = self.tokens_computed / max(self.tokens, 1)
        decode = "" if self.decode_ms != self.decode_ms else f", decode {self.decode_ms:.1f} ms"   # NaN: not decoded
        return (f"{len([s for s in self.scales if not s.skipped])}/{len(self.scales)} scales, "
                f"{_format_count(self.tokens_computed)}/{self.tokens} tokens computed per image ({kept:.0%}), "
                f"scale loop {self.transformer_ms:.1f} ms{decode}")

    def table(self) -> str:
        lines = ["scale   size     tokens  computed  kept    ms"]
        for s in self.scales:
            ms = "skipped" if s.skipped else f"{s.ms:7.2f}"
            lines.append(f"{s.si:>5}  {s.h:>3}x{s.w:<3}  {s.tokens:>6}  {_format_count(s.tokens_computed):>8}  "
                         f"{s.kept_ratio:4.0%}  {ms}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"scales": [vars(s).copy() for s in self.scales], "decode_ms": self.decode_ms,
                "tokens": self.tokens, "tokens_computed": self.tokens_computed,
                "transformer_ms": self.transformer_ms}


@dataclass
class RunState:
    """Everything one generation owns. Adapters keep family-specific tensors in ``model_state``;
    policies keep theirs in ``policy_state[policy.name]``."""

    schedule: ScaleSchedule
    batch_size: int
    settings: SamplingSettings
    info: ModelInfo
    generator: GeneratorArg
    policies: PolicyStack
    device: torch.device
    dtype: torch.dtype
    cfg_active: bool = True
    si: int = -1
    plan: ScalePlan = field(default_factory=ScalePlan)
    hooks: ScaleHooks = NO_HOOKS                    # who acts where at this scale (PolicyStack.plan_scale)
    model_state: dict[str, Any] = field(default_factory=dict)
    policy_state: dict[str, Any] = field(default_factory=dict)
    workspace: Optional[Any] = None
    kv_slots: Optional[tuple] = None               # per layer, its cache's slots after each scale (PolicyStack.kv_slots)
    tokens_computed: Optional[float] = None        # set by a policy that counts its own work this scale
    keys_read: Optional[float] = None              # set by a policy that narrows attention (ScaleStats.keys_read)
    cuda_graphs: bool = False                       # the engine replays scales from CUDA graphs this run
    # a whole-scale graph's random draws, made beforehand (ModelAdapter.scale_noise); None: draw them
    drawn_noise: Optional[list] = None
    stats: GenerationStats = field(default_factory=GenerationStats)

    def drawn(self, k: int) -> Optional[torch.Tensor]:
        """Draw ``k`` of this scale's random draws when the engine made them beforehand
        (``drawn_noise``), else None: the adapter draws it itself."""
        return self.drawn_noise[k] if self.drawn_noise else None

    @property
    def shape_cache(self) -> dict:
        """Constants a policy derives from shapes alone (e.g. an anchor grid), kept with the workspace
        for later generations of the same shape and freed with it."""
        return self.workspace.policy_cache

    @property
    def rows(self) -> int:
        """Rows through the transformer: [cond; uncond] while guidance is on, else cond only."""
        return 2 * self.batch_size if self.cfg_active else self.batch_size
