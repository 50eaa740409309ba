"""The engine's contract with acceleration methods: the hook points a policy may use, the plan it
returns for each scale, and how policies stack.

The engine and the model adapters call these hooks at fixed points of every generation
(DESIGN.md §2). A policy overrides only the hooks of its algorithm; the others are the neutral
defaults below. At every scale its plan may say which hooks act, on which layers, and whether
their work is fixed by the settings (:class:`ScalePlan`): the engine decides CUDA-graph capture
and replay from that data alone (engine/graphs.py). A stack with no policy (the dense path) costs
one empty-tuple test per hook point.

Every hook receives the scale index ``si``; a policy that needs a resolution-independent key uses
``run.schedule.from_end(si)`` (0 = last scale) and absolute token positions, never map widths.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import torch

from ..sparse_ops import ops as sparse_ops

if TYPE_CHECKING:  # pragma: no cover
    from .state import ModelInfo, RunState


HOOKS = ("plan_scale", "wrap_sublayer", "observe", "attention", "post_hidden", "post_residual", "after_scale")
IN_LAYER_HOOKS = ("wrap_sublayer", "attention")          # run inside the layers, on every token row
IN_MODEL_HOOKS = ("wrap_sublayer", "observe", "attention", "post_hidden")
TAIL_HOOKS = ("post_residual", "after_scale")            # after the head


@dataclass(frozen=True)
class ScalePlan:
    """What to do at one scale, and what the policy's hooks do there (the engine decides from it how
    to run the scale, CUDA graphs included; a policy never asks whether it is being captured).

    skip:        do not run this scale nor any later one; decode the latent accumulated so far.
    token_index: (B, n) int64 positions (row-major, inside this scale) of the tokens to run through
                 the transformer, shared by the conditional and unconditional rows of an image;
                 None runs every token. Tokens not listed keep their stage input as hidden state.
    token_valid: (B, n) bool, False for padding entries when images keep different counts (pad
                 entries repeat one of the image's kept tokens; their keys are masked out).
    cond_only:   from this scale on, drop the unconditional CFG half (guidance off).
    hooks:       the hooks (names of :class:`Policy` methods) the policy acts through at this scale;
                 the engine calls no other. None: every hook the policy overrides.
    layers:      the layers its ``wrap_sublayer``, ``attention`` and ``observe`` act on at this scale
                 (None: all). Other layers run the dense path, and only these layers' taps are kept.
    static:      everything the policy does at this scale follows from its settings: the subset's
                 size, and its hooks' work (tensor work of fixed shapes, no host reads, reading only
                 ``tensors``, the hook arguments and ``reads``), so the scale may be captured into a
                 CUDA graph and replayed by later generations of the same settings.
    tensors:     per-scale tensors the hooks read (by a name the policy chooses, e.g.
                 ``"sparsevar.zero"``), through ``run.plan.tensors``; a captured scale reads copies
                 that keep their address.
    writes:      entries of the policy's state dict (``run.policy_state[name]``) that its hooks at
                 this scale set for later scales — by assignment, never in place: after a replay the
                 engine puts back what the captured run set.
    reads:       entries its hooks at this scale read that earlier scales set: the scale is captured
                 only when they came from a captured scale, and replays only while they still do.
    """

    skip: bool = False
    token_index: Optional[torch.Tensor] = None
    token_valid: Optional[torch.Tensor] = None
    cond_only: bool = False
    hooks: Optional[frozenset] = None
    layers: Optional[frozenset] = None
    static: bool = False
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    writes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()

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
    """Base class: every hook is neutral. A subclass overrides the hooks of its algorithm; what it
    does at each scale it may describe in the plan :meth:`plan_scale` returns (:class:`ScalePlan`),
    which is all the engine needs to run the scale fast (CUDA graphs) — by default a policy acts
    through every hook it overrides, at every layer, and its in-layer hooks run eagerly.

    ``name`` identifies the policy in a stack (one policy per name); its per-run state lives in a
    dict at ``run.policy_state[name]``. ``incompatible`` lists the names of policies this one cannot
    be stacked with (checked both ways), ``incompatible_why`` says why, for the refusal. A policy's captured graphs are keyed by its ``config`` (a
    frozen settings object) when it has one, else by the instance.
    """

    name: str = "policy"
    incompatible: tuple[str, ...] = ()
    incompatible_why: str = ""

    def validate(self, info: "ModelInfo") -> None:
        """Check the settings against the model (family, schedule, layers); raise ValueError naming
        the setting, its value and the valid range for this model. Called when the policy is
        enabled on a pipeline and again at every generation."""

    def begin(self, run: "RunState") -> None:
        """A generation starts; per-run state goes into ``run.policy_state[self.name]`` (a dict)."""

    def scales_run(self, num_scales: int) -> int:
        """How many of the schedule's ``num_scales`` scales run at most with this policy (scale
        skipping stops early); a policy that places work relative to the last *computed* scale
        reads the stack's minimum (``PolicyStack.scales_run``) in ``begin``."""
        return num_scales

    def kv_slots(self, info: "ModelInfo", scales_run: int) -> Optional[tuple[tuple[int, ...], ...]]:
        """For a policy that compresses the KV cache: per layer, the slots it holds after each of
        the first ``scales_run`` scales of ``info.schedule`` (the stack's, see :meth:`scales_run`;
        the dense count is the schedule's cumulative tokens), so that the adapters allocate no more
        (``engine.kv_cache.layer_capacities``). The policy's hooks must leave exactly these
        lengths. None: it does not change them."""
        return None

    def plan_scale(self, si: int, run: "RunState") -> Optional[ScalePlan]:
        """What to do at scale ``si`` and what this policy's hooks do there; None: nothing to plan
        (every token runs; the policy acts through every hook it overrides)."""
        return None

    def wrap_sublayer(self, sub: SubLayer, x_RlC: torch.Tensor, run: "RunState") -> torch.Tensor:
        """Run one residual sub-layer (``sub(x)`` is the dense way), e.g. on a token subset."""
        return sub(x_RlC)

    def observe(self, si: int, unit: tuple[str, int], x_in: torch.Tensor, x_out: torch.Tensor,
                run: "RunState") -> None:
        """Read-only tap after a layer (``("layer", i)``): its input and output for the tokens it ran.
        Taps are delivered in layer order, after the layer (eager) or after the replay of a graph
        of the layer stack; they must not be modified."""

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


def _overrides(policy: Policy, hook: str) -> bool:
    return getattr(type(policy), hook) is not getattr(Policy, hook)


def graph_key(policy: Policy) -> object:
    """What a captured graph depends on of a policy besides shapes: its settings (``config``), or the
    instance when it has none."""
    config = getattr(policy, "config", None)
    return (policy.name, config if config is not None else id(policy))


class ScaleHooks:
    """Which policies act through which hook at one scale, on which layers, and what that means for
    capture: built by :meth:`PolicyStack.plan_scale` from the policies' plans, kept in ``run.hooks``
    for the hook dispatch, the adapters' layer loops and the engine's graphs (engine/graphs.py).

    ``hooks[name]``: the acting policies, in stack order. ``wrapped`` / ``attended`` / ``taps``: the
    layers a sub-layer wrapper / an attention hook acts on / whose taps ``observe`` reads (None:
    all). ``static``: every acting policy's plan is static. ``key``: the acting policies'
    :func:`graph_key`. ``writes`` / ``reads``: the (policy name, state entry) pairs of their plans'
    ``writes`` / ``reads``."""

    __slots__ = ("by_hook", "wrapped", "attended", "taps", "static", "key", "writes", "reads")

    def __init__(self, acting: Sequence[tuple[Policy, Optional[ScalePlan]]] = ()):
        by_hook: dict[str, list] = {h: [] for h in HOOKS}
        layer_sets: dict[str, Optional[set]] = {"wrap_sublayer": set(), "attention": set(), "observe": set()}
        static, key, writes, reads = True, [], [], []
        for policy, plan in acting:
            declared = plan.hooks if plan is not None and plan.hooks is not None else HOOKS
            hooks = [h for h in HOOKS if h in declared and h != "plan_scale" and _overrides(policy, h)]
            layers = plan.layers if plan is not None else None
            for h in hooks:
                by_hook[h].append(policy)
            for h, got in layer_sets.items():
                if h in hooks and got is not None:
                    layer_sets[h] = None if layers is None else got | set(layers)
            if hooks or (plan is not None and plan.token_index is not None):
                static = static and plan is not None and plan.static
                key.append(graph_key(policy))
                if plan is not None:
                    writes += [(policy.name, entry) for entry in plan.writes]
                    reads += [(policy.name, entry) for entry in plan.reads]
        self.by_hook = {h: tuple(v) for h, v in by_hook.items()}
        self.wrapped, self.attended, self.taps = (None if v is None else frozenset(v) for v in layer_sets.values())
        self.static, self.key, self.writes, self.reads = static, tuple(key), tuple(writes), tuple(reads)

    def __getitem__(self, hook: str) -> tuple[Policy, ...]:
        return self.by_hook[hook]

    def acts_in_model(self) -> bool:
        return any(self.by_hook[h] for h in IN_MODEL_HOOKS)

    def acts_in_layers(self) -> bool:
        return any(self.by_hook[h] for h in IN_LAYER_HOOKS)

    def acts_after_head(self) -> bool:
        return any(self.by_hook[h] for h in TAIL_HOOKS)

    def wraps(self, layer: int) -> bool:
        """Whether a sub-layer wrapper acts on ``layer`` (elsewhere the adapters run their chained
        dense path, whose fused steps span the sub-layer borders)."""
        return bool(self.by_hook["wrap_sublayer"]) and (self.wrapped is None or layer in self.wrapped)

    def attends(self, layer: int) -> bool:
        """Whether an attention hook acts on ``layer``."""
        return bool(self.by_hook["attention"]) and (self.attended is None or layer in self.attended)

    def tapped(self, layer: int) -> bool:
        return bool(self.by_hook["observe"]) and (self.taps is None or layer in self.taps)


NO_HOOKS = ScaleHooks()


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
                # the reason of the policy that declares the conflict
                why = policy.incompatible_why if other.name in policy.incompatible else other.incompatible_why
                raise ValueError(f"{policy.name} cannot be combined with {other.name}"
                                 f"{f' ({why})' if why else ''}: call disable_{other.name}() first")
        self.policies = self.policies + (policy,)
        self._refresh()

    def _refresh(self) -> None:
        # the hooks each policy overrides; at a scale, run.hooks says which of them act there
        self.active = {h: tuple(p for p in self.policies if _overrides(p, h)) for h in HOOKS}

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

    def scales_run(self, num_scales: int) -> int:
        """The number of scales that run: the fewest any policy allows."""
        return min([num_scales] + [p.scales_run(num_scales) for p in self.policies])

    def kv_slots(self, info) -> Optional[tuple[tuple[int, ...], ...]]:
        """The one compressing policy's :meth:`Policy.kv_slots`, or None."""
        n = self.scales_run(info.schedule.num_scales)
        declared = [(p, s) for p in self.policies for s in [p.kv_slots(info, n)] if s is not None]
        if len(declared) > 1:
            raise ValueError(f"two policies compress the KV cache: {[p.name for p, _ in declared]}; disable one")
        return declared[0][1] if declared else None

    def begin(self, run) -> None:
        run.hooks = ScaleHooks([(p, None) for p in self.policies])
        for p in self.policies:
            p.begin(run)

    def plan_scale(self, si: int, run) -> ScalePlan:
        """The policies' plans for scale ``si`` merged into one; ``run.hooks`` is set to who acts
        where at this scale."""
        if not self.policies:
            run.hooks = NO_HOOKS
            return DENSE
        skip = cond_only = False
        subset, planned, tensors = None, [], {}
        for p in self.policies:
            q = p.plan_scale(si, run) if p in self.active["plan_scale"] else None
            planned.append((p, q))
            if q is None:
                continue
            skip, cond_only = skip or q.skip, cond_only or q.cond_only
            if q.token_index is not None:
                if subset is not None:
                    raise ValueError(f"two policies chose a token subset at scale {si}; "
                                     f"disable one of {[x.name for x in self.active['plan_scale']]}")
                subset = q
            for name, t in q.tensors.items():
                if name in tensors:
                    raise ValueError(f"two policies name a plan tensor {name!r} at scale {si}")
                tensors[name] = t
        run.hooks = hooks = ScaleHooks(planned)
        return ScalePlan(skip=skip, cond_only=cond_only, token_index=subset.token_index if subset else None,
                         token_valid=subset.token_valid if subset else None, static=hooks.static, tensors=tensors)

    def wrap_sublayer(self, sub: SubLayer, x_RlC: torch.Tensor, run) -> torch.Tensor:
        wrappers = run.hooks["wrap_sublayer"]
        if not wrappers:
            return sub(x_RlC)
        if len(wrappers) == 1:
            return wrappers[0].wrap_sublayer(sub, x_RlC, run)
        raise ValueError(f"two policies wrap the same sub-layers: {[p.name for p in wrappers]}; disable one")

    def observe(self, si, unit, x_in, x_out, run) -> None:
        for p in run.hooks["observe"]:
            p.observe(si, unit, x_in, x_out, run)

    def attention(self, ctx, q, k, v, run):
        """The first acting policy's attention output at ``ctx``'s layer, or None (the dense backend)."""
        for p in run.hooks["attention"]:
            out = p.attention(ctx, q, k, v, run)
            if out is not None:
                return out
        return None

    def post_hidden(self, si, h_RLC, run):
        for p in run.hooks["post_hidden"]:
            h_RLC = p.post_hidden(si, h_RLC, run)
        return h_RLC

    def post_residual(self, si, residual, run):
        for p in run.hooks["post_residual"]:
            residual = p.post_residual(si, residual, run)
        return residual

    def after_scale(self, si, guided_logits, run) -> None:
        for p in run.hooks["after_scale"]:
            p.after_scale(si, guided_logits, run)
