"""CUDA graphs of the scale loop: the one place that decides what is captured and replayed.

The decision is read off data — the merged :class:`~.contract.ScalePlan` of a scale and the
:class:`~.contract.ScaleHooks` that say which policy hooks act there — never asked of a policy:

- no policy acts in the model or after the head: the whole scale (compute, guidance, sampling,
  latent update) replays from one graph;
- no policy acts in the model, some after the head: the scale's compute replays, the rest is eager;
- the plan is static (its subset size and every acting hook fixed by the settings): the whole
  scale replays with the hooks inside it (``after_scale`` runs after the replay);
- the plan is static, runs every token and hands no tensors to its hooks, and only in-layer hooks
  act in the model (no ``observe``, no ``post_hidden``): the scale's compute (layers and head)
  replays with the hooks inside it, where the adapter cannot capture the whole scale;
- the plan runs every token (or a static subset) and no in-layer hook acts, or the acting ones are
  static: the layer stack (stage input → gather → layers → scatter) replays; ``observe`` gets its
  taps after the replay, ``post_hidden`` and the head run eagerly;
- otherwise the scale runs eagerly.

Before the first scale, the adapter's ``prepare`` (the generation's set-up from its conditioning)
replays from one graph per ``prepare_key``.

A captured graph reads only buffers whose address stays fixed: the adapter's workspace, copies of
the plan's subset and tensors (``static_inputs``), and the policy state its plan ``reads``, which
must come from an earlier captured scale (its ``writes``, put back after each replay).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from .layers import compute_scale
from .state import RunState


def persistent_copy(store: dict, key, t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into ``store[key]`` (made like ``t`` at first use): a buffer whose address stays
    the same across generations, as a captured CUDA graph that reads it needs. Keys hold whatever
    fixes the shape."""
    buf = store.get(key)
    if buf is None:
        buf = store[key] = torch.empty_like(t)
    return buf.copy_(t)


def capture_mode(plan, hooks, whole_scales: bool) -> Optional[str]:
    """How a scale with this merged plan and these acting hooks may run from graphs: ``"whole"``,
    ``"whole with hooks"``, ``"compute"`` (the scale's compute; guidance onwards eager), ``"compute
    with hooks"`` (the same with static in-layer hooks inside it), ``"layers"`` (the layer stack;
    observe, post_hidden and the head eager) or None (eager). ``whole_scales``: the adapter can
    capture guidance, sampling and the latent update with its compute. A whole scale falls back to
    its compute (or layer stack) where it cannot be used."""
    if plan.dense and not hooks.acts_in_model():
        return "whole" if whole_scales and not hooks.acts_after_head() else "compute"
    if (plan.dense or plan.static) and plan.token_valid is None and (plan.static or not hooks.acts_in_layers()):
        if whole_scales and plan.static:
            return "whole with hooks"
        if plan.static and plan.token_index is None and not plan.tensors and not hooks["observe"] \
                and not hooks["post_hidden"]:
            return "compute with hooks"
        return "layers"
    return None


class GraphStreams:
    """An adapter's side streams for graph warm-up and capture, and for the sampler's pre-drawn noise:
    made once per adapter (every new stream would get its own cuBLAS workspace)."""

    def __init__(self):
        self.capture: Optional[torch.cuda.Stream] = None
        self.noise: Optional[torch.cuda.Stream] = None

    def ready(self) -> "GraphStreams":
        if self.capture is None:
            self.capture, self.noise = torch.cuda.Stream(), torch.cuda.Stream()
        return self


@dataclasses.dataclass
class _Captured:
    graph: Any
    out: Any
    kv_before: Any                # the KV cache's host-side bookkeeping at capture, and after the work
    kv_after: Any
    wrote: dict                   # (policy, entry) → what the captured run set (put back after a replay)
    read: dict                    # (policy, entry) → what it read (a replay needs the same objects)


class GraphRunner:
    """Captures and replays the graphs of one workspace (``ws.graphs``, one memory pool).

    A scale's compute (engine/layers.py) reads only static workspace buffers, so a capture taken at the
    first generation stays valid for every later one of the same shape. The KV cache's host-side
    bookkeeping (fill lengths, tail owner) is not advanced by a replay, so it is recorded at capture
    and set after each replay."""

    def __init__(self, workspace, streams: GraphStreams):
        if workspace.graph_pool is None:
            workspace.graph_pool = torch.cuda.graph_pool_handle()
        streams.ready()
        self.ws, self.stream, self.noise_stream = workspace, streams.capture, streams.noise
        self.noise_fence: Optional[torch.cuda.Event] = None    # see draw_noise

    # ---- the decision -------------------------------------------------------------------------
    def scale(self, si: int, plan, run: RunState, adapter, whole_scales: bool) -> Optional[tuple]:
        """Run scale ``si`` from graphs where its plan allows: ``(guided, codes)`` when it replayed
        whole, ``(logits,)`` when its compute replayed (the caller runs the rest), None when it must
        run eagerly. ``whole_scales``: the adapter can capture guidance, sampling and the latent update
        with its compute (``supports_scale_graphs``)."""
        mode = capture_mode(plan, run.hooks, whole_scales)
        if mode in ("whole", "whole with hooks"):
            whole = self.whole_scale(si, plan, run, adapter, hooked=mode == "whole with hooks")
            if whole is not None:
                return whole
        if mode in ("whole", "compute"):
            logits = self.run(("dense", si), lambda: compute_scale(adapter, si, plan, run), run)
        elif mode == "compute with hooks":
            logits = self.run(("compute", si, run.hooks.key), lambda: compute_scale(adapter, si, plan, run), run)
        elif mode is not None:
            logits = compute_scale(adapter, si, plan, run, graphs=self)
        else:
            return None
        return None if logits is None else (logits,)

    def prepare(self, adapter, run: RunState) -> None:
        """The adapter's :meth:`~.adapter.ModelAdapter.prepare`, replayed from a graph keyed by its
        ``prepare_key`` (captured at the first call of a key; eager where the key is None). It reads no
        policy state and leaves the KV cache alone; it runs before every scale graph of the generation,
        as it did when they were captured, so they may share the workspace's memory pool."""
        key = adapter.prepare_key(run)
        if key is None:
            adapter.prepare(run)
            return
        key = ("prepare", *key)
        entry = self.ws.graphs.get(key)
        if entry is None:
            entry = self.ws.graphs[key] = self._capture(lambda: adapter.prepare(run), run.workspace.kv,
                                                        run.policy_state, (), {}, ())
        entry.graph.replay()

    def decode(self, adapter, run: RunState) -> torch.Tensor:
        """The adapter's :meth:`~.adapter.ModelAdapter.decode`, replayed from a graph keyed by its
        ``decode_key`` (captured at the first call of a key; one decode graph per workspace, a new key
        replaces it; eager where the key is None). The images are a copy: the graph's output buffer is
        written again by the next replay."""
        key = adapter.decode_key(run)
        if key is None:
            return adapter.decode(run)
        key = ("decode", *key)
        entry = self.ws.graphs.get(key)
        if entry is None:
            for old in [k for k in self.ws.graphs if k[0] == "decode"]:
                del self.ws.graphs[old]                # another key (e.g. a size past the limit): back to the pool
            entry = self.ws.graphs[key] = self._capture(lambda: adapter.decode(run), run.workspace.kv,
                                                        run.policy_state, (), {}, ())
        entry.graph.replay()
        return entry.out.clone()

    # ---- capture and replay -------------------------------------------------------------------
    def usable(self, key, kv) -> bool:
        """Whether :meth:`run` replays (or captures) ``key`` now: the KV cache is unmasked and, for a
        captured graph, in the state it was captured in (no policy changed it earlier this generation)."""
        entry = self.ws.graphs.get(key)
        return not kv.masked and (entry is None or kv.host_state() == entry.kv_before)

    def static_input(self, key, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into the buffer the graph of ``key`` reads as ``name`` (same address every time)."""
        return persistent_copy(self.ws.static_inputs, (key, name), t)

    def run(self, key, fn: Callable[[], Any], run: RunState, preserve: Sequence[torch.Tensor] = ()) -> Any:
        """Replay (capturing at the first call) the graph of ``key``; None when it cannot be used now
        (the KV cache is not in the captured state, or policy state the graph reads did not come from
        captured scales), so the caller runs eagerly. ``preserve``: tensors ``fn`` updates in place
        (a latent), restored after the warm-up run that precedes a capture."""
        kv, state, hooks = run.workspace.kv, run.policy_state, run.hooks
        if not self.usable(key, kv):
            return None
        entry = self.ws.graphs.get(key)
        if entry is None:
            written = {id(v) for e in self.ws.graphs.values() for v in e.wrote.values()}
            read = {(p, k): state[p].get(k) for p, k in hooks.reads}
            if any(id(v) not in written for v in read.values()):
                return None                            # it would read tensors an eager scale made
            entry = self._capture(fn, kv, state, hooks.writes, read, preserve)
            self.ws.graphs[key] = entry
        elif any(state[p].get(k) is not v for (p, k), v in entry.read.items()):
            return None                                # an earlier scale ran eagerly this time
        entry.graph.replay()
        kv.set_host_state(entry.kv_after)
        for (p, k), v in entry.wrote.items():
            state[p][k] = v                            # what the replay refreshed, for later scales
        return entry.out

    def _capture(self, fn, kv, state: dict, writes, read: dict, preserve) -> _Captured:
        before = kv.host_state()
        saved = [t.clone() for t in preserve]
        prior = {(p, k): state[p].get(k) for p, k in writes}
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kv.keep_undo()                             # a compressing policy rewrites the cache it reads
            try:
                fn()                                   # warm-up (allocations, cuBLAS handles, compiles)
            finally:
                kv.undo()
        torch.cuda.current_stream().wait_stream(stream)
        for t, old in zip(preserve, saved):            # the warm-up's effects are undone: its latent
            t.copy_(old)
        kv.set_host_state(before)                      # update, its KV bookkeeping, the state it set
        for (p, k), v in prior.items():                # (freed now, before the capture allocates its own)
            state[p][k] = v
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.ws.graph_pool, stream=stream):
            out = fn()
        wrote = {(p, k): state[p].get(k) for p, k in writes if state[p].get(k) is not prior[(p, k)]}
        entry = _Captured(graph, out, before, kv.host_state(), wrote, read)
        kv.set_host_state(before)                      # capture recorded work but ran none of it
        return entry

    def draw_noise(self, draws: Sequence[tuple[str, torch.Tensor]], generator, fresh: bool) -> None:
        """Each ``(kind, buffer)`` of ``draws`` filled in order from ``generator`` (``kind`` "exponential":
        ``exponential_``; "normal": ``normal_``, which is what ``torch.randn`` draws), on a side stream,
        ordered before the work the caller issues next. The draws wait only for the main stream's work
        up to the start of the previous whole-scale replay (the last reader of a scale's buffers is an
        earlier generation's replay of that scale), so on the GPU they run beside the previous scale
        instead of between two graphs.

        The first draw of a generation, and draws into ``fresh`` buffers (just allocated: the
        allocator may have handed over memory that work still queued on the main stream uses),
        stay on the main stream: there is nothing earlier to overlap, and the wait across streams
        made the first scale slower. The generator is called in the same order as the eager scale
        calls it, so the values are the same."""
        def fill():
            for kind, buf in draws:
                buf.exponential_(generator=generator) if kind == "exponential" else buf.normal_(generator=generator)

        main = torch.cuda.current_stream()
        if fresh or self.noise_fence is None:
            fill()
        else:
            side = self.noise_stream
            side.wait_event(self.noise_fence)
            with torch.cuda.stream(side):
                fill()
            main.wait_stream(side)
        self.noise_fence = main.record_event()          # the next draw may run beside what follows

    def whole_scale(self, si: int, plan, run: RunState, adapter, hooked: bool) -> Optional[tuple]:
        """Replay scale ``si`` whole — compute, guidance, sampling, residual and latent update — from
        one graph, with the scale's random draws (the adapter's ``scale_noise``) made just before into
        buffers kept per scale, by the calls the eager scale would make (so the same codes as the
        eager path; on a side stream, :meth:`draw_noise`), and handed over in ``run.drawn_noise``.
        Returns (guided logits, codes), or None (nothing drawn, nothing run) when the adapter cannot
        take its draws made beforehand or the KV cache is not in the graph's state; where the graph
        reads policy state that an eager scale made this time, the scale runs eagerly on the draws.
        The graph is keyed by the draws too (an adapter's sampling variant draws differently).

        ``hooked``: the acting policies' hooks run inside the graph; the subset and the plan's tensors
        are read from static copies, and the graph is keyed by the subset size and the policies'
        settings too; the caller runs ``after_scale``.

        The graph bakes in the sampling settings (guidance, top-k, top-p) and the adapter's
        ``scale_graph_constants``: graphs captured under other ones are dropped, so a sweep over
        settings keeps one set of graphs in memory."""
        spec = adapter.scale_noise(si, run)
        if spec is None:
            return None
        spec = tuple((kind, tuple(shape)) for kind, shape in spec)
        n = plan.token_index.shape[1] if plan.token_index is not None else None
        key = ("scale", si, spec) if not hooked else ("scale", si, spec, n, run.hooks.key)
        if not self.usable(key, run.workspace.kv):
            return None
        ws = self.ws
        baked = (run.settings, adapter.scale_graph_constants(run))
        if ws.scale_graph_settings != baked:
            for k in [k for k in ws.graphs if k[0] == "scale"]:
                del ws.graphs[k]
            for k in [k for k in ws.static_inputs if k[0][0] == "scale"]:
                del ws.static_inputs[k]
            ws.scale_graph_settings = baked
            ws.scale_noise = {}
        draws = ws.scale_noise.get((si, spec))
        fresh = draws is None
        if fresh:
            draws = ws.scale_noise[(si, spec)] = [(kind, torch.empty(shape, dtype=torch.float32, device=run.device))
                                                  for kind, shape in spec]
        self.draw_noise(draws, run.generator, fresh)
        if hooked:                                     # what the hooks read, from buffers the graph reads
            plan = dataclasses.replace(
                plan, token_index=None if n is None else self.static_input(key, "token_index", plan.token_index),
                tensors={name: self.static_input(key, name, t) for name, t in plan.tensors.items()})
            run.plan = plan
        stack = run.policies

        def scale():
            logits = compute_scale(adapter, si, plan, run)
            guided = adapter.guide(si, logits, run)
            codes = adapter.sample(si, guided, run)
            residual = stack.post_residual(si, adapter.residual(si, codes, run), run)
            adapter.accumulate(si, residual, run)
            return guided, codes

        run.drawn_noise = [buf for _, buf in draws]
        try:
            out = self.run(key, scale, run, preserve=(adapter.latent(run),))
            # a graph that reads policy state an eager scale made this time cannot replay: the scale
            # runs eagerly here, on the draws already made (drawing again would change the codes)
            return out if out is not None else scale()
        finally:
            run.drawn_noise = None

    def layer_stack(self, si: int, plan, run: RunState, layers_fn: Callable) -> Any:
        """Replay the layer stack of scale ``si`` (stage input → gather → layers → scatter) from a
        graph keyed by scale, subset size, the tapped layers and the acting policies' settings; the
        taps are handed to the policies' ``observe`` after the replay. ``layers_fn(idx_Bn or None,
        collect)`` runs the stack and returns (x, [(layer, x_in, x_out), …]) with the taps collected
        instead of delivered. None: run eagerly."""
        hooks = run.hooks
        n = plan.token_index.shape[1] if plan.token_index is not None else None
        key = ("layers", si, n, hooks.taps if hooks["observe"] else frozenset(), hooks.key)
        idx = None if n is None else self.static_input(key, "token_index", plan.token_index.to(run.device, torch.long))
        out = self.run(key, lambda: layers_fn(idx, True), run)
        if out is None:
            return None
        x, collected = out
        for i, x_in, x_out in collected:
            run.policies.observe(si, ("layer", i), x_in, x_out, run)
        return x
