"""The engine's contract with acceleration methods: the hook points a policy may use, the plan it
returns for each scale, and how policies stack.

The engine and the model adapters call these hooks at fixed points of every generation
(DESIGN.md §2). A policy overrides only the hooks it needs; the others are the neutral defaults
below. ``PolicyStack`` knows which hooks any of its policies override, so a stack with no policy
(the dense path) costs one attribute test per hook point.

Every hook receives the scale index ``si``; a policy that needs a resolution-independent key uses
``run.schedule.from_end(si)`` (0 = last scale) and absolute token positions, never map widths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from ..sparse_ops import ops as sparse_ops

if TYPE_CHECKING:  # pragma: no cover
    from .state import ModelInfo, RunState

SUBLAYER_KINDS = ("self_attn", "cross_attn", "ffn")


@dataclass(frozen=True)
class ScalePlan:
    """What to do at one scale.

    skip:        do not run this scale nor any later one; decode the latent accumulated so far.
    token_index: (B, n) int64 positions (row-major, inside this scale) of the tokens to run through
                 the transformer, shared by the conditional and unconditional rows of an image;
                 None runs every token. Tokens not listed keep their stage input as hidden state.
    token_valid: (B, n) bool, False for padding entries when images keep different counts (pad
                 entries repeat one of the image's kept tokens; their keys are masked out).
    cond_only:   from this scale on, drop the unconditional CFG half (guidance off).
    static:      the subset's size follows from the settings alone (e.g. a fixed keep ratio), so
                 the same shape recurs every generation and its layer stack may be replayed from a
                 CUDA graph.
    """

    skip: bool = False
    token_index: Optional[torch.Tensor] = None
    token_valid: Optional[torch.Tensor] = None
    cond_only: bool = False
    static: bool = False

    @property
    def dense(self) -> bool:
        return not self.skip and self.token_index is None


DENSE = ScalePlan()


@dataclass(frozen=True)
class SubLayerContext:
    """Where a sub-layer runs: scale ``si``, transformer layer ``layer``, and its kind."""

    si: int
    layer: int
    kind: str


class SubLayer:
    """One residual branch ``x + gate · branch(LN(x) · mul + shift)`` (``mul`` = 1 + AdaLN scale).

    Exposed piece by piece so a policy can run it on a token subset (gather → ``modulate`` →
    ``branch`` → gated residual add → restore), e.g. FastVAR's pivotal tokens.
    ``mul``/``shift``/``gate`` are (R, 1, C) float32 tensors.

    ``norm_eps`` and ``out_dtype`` describe ``modulate`` (LayerNorm without affine, eps, output
    dtype of the branch input). A model that passes them lets :meth:`gather_modulate` run as one
    fused gather + LayerNorm + AdaLN kernel (``sparse_ops.gather_norm_modulate``); without them it
    gathers the rows and calls ``modulate``.
    """

    __slots__ = ("ctx", "mul", "shift", "gate", "branch", "_modulate", "_add", "norm_eps", "out_dtype")

    def __init__(self, ctx: SubLayerContext, mul, shift, gate, branch: Callable, modulate: Callable,
                 add: Callable, norm_eps: Optional[float] = None, out_dtype: Optional[torch.dtype] = None):
        self.ctx, self.mul, self.shift, self.gate, self.branch = ctx, mul, shift, gate, branch
        self._modulate, self._add = modulate, add
        self.norm_eps, self.out_dtype = norm_eps, out_dtype

    def modulate(self, x_RlC: torch.Tensor) -> torch.Tensor:
        """The branch input for tokens ``x_RlC`` (rows must match ``mul``/``shift``)."""
        return self._modulate(x_RlC, self.mul, self.shift)

    def gather_modulate(self, x_RLC: torch.Tensor, idx_Rn: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """The branch input (R, n, C) for the tokens ``idx_Rn`` of ``x_RLC``: ``modulate(x[idx])``."""
        if self.norm_eps is None or self.out_dtype is None:
            return self.modulate(sparse_ops.gather_rows(x_RLC, idx_Rn, backend=backend))
        return sparse_ops.gather_norm_modulate(x_RLC, idx_Rn, self.mul, self.shift, self.norm_eps, self.out_dtype,
                                               backend=backend)

    def residual(self, x_RlC: torch.Tensor, idx_Rn: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The gated branch output (float32, without the skip connection). For a token subset pass
        its indices ``idx_Rn`` into the layer's current tokens (attention records their positions)."""
        out = self.branch(self.modulate(x_RlC), idx_Rn)
        return out * self.gate.float()          # bf16 · float32 → float32 in one pass: out.float() · gate, same bits

    def __call__(self, x_RlC: torch.Tensor) -> torch.Tensor:
        return self._add(x_RlC, self.branch(self.modulate(x_RlC), None), self.gate)


class Policy:
    """Base class: every hook is neutral. Subclasses override what they need.

    ``name`` identifies the policy in a stack (one policy per name). ``incompatible`` lists the
    names of policies this one cannot be stacked with (checked both ways).
    """

    name: str = "policy"
    incompatible: tuple[str, ...] = ()
    # True when this policy's in-layer hooks (wrap_sublayer, attention) are plain tensor work of
    # fixed shapes, keeping state only in tensors produced inside the same generation, so a layer
    # stack with them may be captured into a CUDA graph (keyed by the policy's settings).
    graph_capturable: bool = False

    def graph_ready(self, si: int, run: "RunState") -> bool:
        """For a capturable policy: whether replaying a captured layer stack at ``si`` is valid in
        this generation (e.g. its cached tensors came from graph replays too)."""
        return True

    def graph_replayed(self, si: int, exports: dict, run: "RunState") -> None:
        """A captured layer stack of scale ``si`` was replayed instead of run: ``exports`` holds the
        tensors policies registered in ``run.graph_exports`` while it was captured (their contents
        now refreshed), so a policy can point its per-run state at them."""

    def graph_key(self) -> object:
        """What a captured layer stack depends on besides shapes: the settings by default."""
        return (self.name, getattr(self, "config", None))

    def validate(self, info: "ModelInfo") -> None:
        """Check the settings against the model (family, schedule, layers); raise ValueError naming
        the setting, its value and the valid range for this model. Called when the policy is
        enabled on a pipeline and again at every generation."""

    def begin(self, run: "RunState") -> None:
        """A generation starts; per-run state goes into ``run.policy_state[self.name]``."""

    def plan_scale(self, si: int, run: "RunState") -> Optional[ScalePlan]:
        return None

    def uses_model_hooks(self, si: int, run: "RunState") -> bool:
        """Whether this policy needs the in-model hooks (wrap_sublayer, observe, attention,
        post_hidden) at scale ``si``. Scales where no policy does may be replayed from a CUDA
        graph. Default: at every scale, if the policy overrides any of them."""
        return any(_overrides(self, h) for h in _MODEL_HOOKS)

    def wrap_sublayer(self, sub: SubLayer, x_RlC: torch.Tensor, run: "RunState") -> torch.Tensor:
        return sub(x_RlC)

    def wraps_layer(self, si: int, layer: int, run: "RunState") -> bool:
        """For a policy overriding ``wrap_sublayer`` and working inside the layers at ``si``: False
        when its wrapper leaves ``layer``'s sub-layers as they are (e.g. outside FastVAR's layer
        range), so the adapter may run that layer on its chained dense path. Default True."""
        return True

    def observe(self, si: int, unit: tuple[str, int], x_in: torch.Tensor, x_out: torch.Tensor,
                run: "RunState") -> None:
        """Read-only tap after a layer (``("layer", i)``): its input and output for the tokens it ran.
        Taps are delivered in layer order, after the layer (eager) or after the replay of a graph
        of the layer stack; they must not be modified."""

    def observed_layers(self, si: int, run: "RunState") -> Optional[set]:
        """The layers whose taps ``observe`` needs at scale ``si`` (None = every layer). Declaring
        them lets the layer stack run from a CUDA graph that keeps just those taps."""
        return None

    def attention(self, ctx: SubLayerContext, q_RHld: torch.Tensor, k_RHLd: torch.Tensor,
                  v_RHLd: torch.Tensor, run: "RunState") -> Optional[torch.Tensor]:
        """Return the attention output (R, H, l, d), or None to let the dense backend run."""
        return None

    def post_hidden(self, si: int, h_RLC: torch.Tensor, run: "RunState") -> torch.Tensor:
        """Rewrite final hidden states of the full map (after scatter, before the head)."""
        return h_RLC

    def post_residual(self, si: int, residual_BLc: torch.Tensor, run: "RunState") -> torch.Tensor:
        """Rewrite this scale's per-token residual (e.g. zero it for excluded tokens)."""
        return residual_BLc

    def after_scale(self, si: int, guided_logits_BLV: torch.Tensor, run: "RunState") -> None:
        """Store what the next scale needs (maps, logits)."""

    def tail_idle(self, si: int, run: "RunState") -> bool:
        """For a policy overriding ``post_residual`` or ``after_scale``: True when both do nothing
        at ``si`` (return the residual as it is, store nothing), so the engine may skip them and
        run the scale's guidance, sampling and latent update inside its CUDA graph. Default False."""
        return False

    def scale_capturable(self, si: int, run: "RunState") -> bool:
        """True when everything this policy does at ``si`` after its plan — the model hooks,
        ``post_residual`` — may be captured into one CUDA graph with the whole scale (compute,
        guidance, sampling, latent update), replayed in later generations of the same settings:
        the tensors those hooks read are in buffers whose addresses do not change between
        generations (e.g. the plan's outputs copied into workspace buffers), and what they store
        for later scales is registered in ``run.graph_exports`` during the capture and taken back
        in :meth:`graph_replayed`. ``after_scale`` still runs after the replay. Default False."""
        return False


def persistent_copy(store: dict, key, t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into ``store[key]`` (made like ``t`` at first use): a buffer whose address stays
    the same across generations, as a captured CUDA graph that reads it needs. Keys should include
    whatever fixes the shape (the engine's graph keys hold the subset size)."""
    buf = store.get(key)
    if buf is None:
        buf = store[key] = torch.empty_like(t)
    return buf.copy_(t)


_MODEL_HOOKS = ("wrap_sublayer", "observe", "attention", "post_hidden")
_HOOKS = ("plan_scale", "wrap_sublayer", "observe", "attention", "post_hidden", "post_residual", "after_scale")


def _overrides(policy: Policy, hook: str) -> bool:
    return getattr(type(policy), hook) is not getattr(Policy, hook)


class PolicyStack:
    """An ordered set of policies, called in order at every hook point."""

    def __init__(self, policies: Sequence[Policy] = ()):
        self.policies: tuple[Policy, ...] = ()
        self._refresh()
        for p in policies:
            self._add(p)

    def _add(self, policy: Policy) -> None:
        for other in self.policies:
            if other.name == policy.name:
                raise ValueError(f"{policy.name} is already enabled; disable it first or enable it once")
            if policy.name in other.incompatible or other.name in policy.incompatible:
                raise ValueError(f"{policy.name} cannot be combined with {other.name}: "
                                 f"call disable_{other.name}() first")
        self.policies = self.policies + (policy,)
        self._refresh()

    def _refresh(self) -> None:
        self.active = {h: tuple(p for p in self.policies if _overrides(p, h)) for h in _HOOKS}

    def with_policy(self, policy: Policy) -> "PolicyStack":
        new = PolicyStack(self.policies)
        new._add(policy)
        return new

    def without(self, name: str) -> "PolicyStack":
        return PolicyStack([p for p in self.policies if p.name != name])

    def get(self, name: str) -> Optional[Policy]:
        return next((p for p in self.policies if p.name == name), None)

    def __len__(self) -> int:
        return len(self.policies)

    def __iter__(self):
        return iter(self.policies)

    # ---- hook dispatch -------------------------------------------------------------------------
    def validate(self, info) -> None:
        for p in self.policies:
            p.validate(info)

    def begin(self, run) -> None:
        for p in self.policies:
            p.begin(run)

    def plan_scale(self, si: int, run) -> ScalePlan:
        plan = DENSE
        for p in self.active["plan_scale"]:
            q = p.plan_scale(si, run)
            if q is None:
                continue
            if q.token_index is not None and plan.token_index is not None:
                raise ValueError(f"two policies chose a token subset at scale {si}; "
                                 f"disable one of {[x.name for x in self.active['plan_scale']]}")
            subset = q if q.token_index is not None else plan
            plan = ScalePlan(skip=plan.skip or q.skip, token_index=subset.token_index,
                             token_valid=subset.token_valid, cond_only=plan.cond_only or q.cond_only,
                             static=subset.static)
        return plan

    def uses_model_hooks(self, si: int, run) -> bool:
        return any(p.uses_model_hooks(si, run) for p in self.policies)

    def wraps_sublayers(self, si: int, run, layer: Optional[int] = None) -> bool:
        """True when a policy wraps the sub-layers at ``si`` (one that overrides ``wrap_sublayer``
        and works inside the layers there) — of layer ``layer`` only, when given
        (:meth:`Policy.wraps_layer`). Elsewhere the adapters run their chained dense path, whose
        fused steps span the sub-layer borders."""
        return any(p.uses_model_hooks(si, run) and (layer is None or p.wraps_layer(si, layer, run))
                   for p in self.active["wrap_sublayer"])

    def unwrapped_layers(self, si: int, run, num_layers: int) -> list[bool]:
        """Per layer at ``si``: True where no policy's sub-layer wrapper changes anything, so the
        adapter may run that layer on its chained dense path (fused across sub-layer borders)."""
        if not self.wraps_sublayers(si, run):
            return [True] * num_layers
        return [not self.wraps_sublayers(si, run, i) for i in range(num_layers)]

    def graph_safe_at(self, si: int, run) -> bool:
        """True when the policies need no hook inside the layers at ``si`` other than ``observe``
        (which a graphed layer stack delivers after replay)."""
        for p in self.policies:
            if not p.uses_model_hooks(si, run):
                continue
            in_layer = _overrides(p, "wrap_sublayer") or _overrides(p, "attention")
            if in_layer and not (p.graph_capturable and p.graph_ready(si, run)):
                return False
        return True

    def tail_idle(self, si: int, run) -> bool:
        """True when no policy acts after the head at ``si`` (see :meth:`Policy.tail_idle`)."""
        return all(p.tail_idle(si, run) for p in self.policies
                   if _overrides(p, "post_residual") or _overrides(p, "after_scale"))

    def scale_capturable(self, si: int, run) -> bool:
        """True when every policy acting at ``si`` (inside the model or after the head) can be
        captured with the whole scale (see :meth:`Policy.scale_capturable`)."""
        for p in self.policies:
            acts_after = (_overrides(p, "post_residual") or _overrides(p, "after_scale")) and not p.tail_idle(si, run)
            if (p.uses_model_hooks(si, run) or acts_after) and not p.scale_capturable(si, run):
                return False
        return True

    def graph_key(self, si: int, run) -> tuple:
        """The settings a captured layer stack at ``si`` depends on: those of the policies working
        inside the layers there (observe-only policies change nothing that is captured)."""
        return tuple(p.graph_key() for p in self.policies if p.uses_model_hooks(si, run)
                     and (_overrides(p, "wrap_sublayer") or _overrides(p, "attention")))

    def graph_replayed(self, si: int, exports: dict, run) -> None:
        for p in self.policies:
            p.graph_replayed(si, exports, run)

    def observed_layers(self, si: int, run) -> Optional[set]:
        layers: set = set()
        for p in self.active["observe"]:
            if not p.uses_model_hooks(si, run):
                continue
            got = p.observed_layers(si, run)
            if got is None:
                return None
            layers |= set(got)
        return layers

    def wrap_sublayer(self, sub: SubLayer, x_RlC: torch.Tensor, run) -> torch.Tensor:
        wrappers = self.active["wrap_sublayer"]
        if not wrappers:
            return sub(x_RlC)
        if len(wrappers) == 1:
            return wrappers[0].wrap_sublayer(sub, x_RlC, run)
        raise ValueError(f"two policies wrap the same sub-layers: {[p.name for p in wrappers]}; disable one")

    def observe(self, si, unit, x_in, x_out, run) -> None:
        for p in self.active["observe"]:
            p.observe(si, unit, x_in, x_out, run)

    def attention(self, ctx, q, k, v, run):
        for p in self.active["attention"]:
            out = p.attention(ctx, q, k, v, run)
            if out is not None:
                return out
        return None

    def post_hidden(self, si, h_RLC, run):
        for p in self.active["post_hidden"]:
            h_RLC = p.post_hidden(si, h_RLC, run)
        return h_RLC

    def post_residual(self, si, residual, run):
        for p in self.active["post_residual"]:
            residual = p.post_residual(si, residual, run)
        return residual

    def after_scale(self, si, guided_logits, run) -> None:
        for p in self.active["after_scale"]:
            p.after_scale(si, guided_logits, run)
