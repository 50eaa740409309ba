"""The model-agnostic staged sampler: one scale at a time, policies consulted at every hook point.

``generate`` is the only entry point. It owns the scale loop, the per-scale timing, the policy
plan, the optional CUDA-graph replay of dense scales and the callback; everything family-specific
(conditioning, stage inputs, layers, head, guidance, sampling, latent) lives in the adapter.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .adapter import ModelAdapter
from .contract import PolicyStack, persistent_copy
from .memory import trim_host_heap
from .schedule import ScaleSchedule
from .state import GenerationStats, GeneratorArg, RunState, SamplingSettings, ScaleStats

# callback(si, tensors) with tensors = {"codes": (B, l), "logits": guided (B, l, V), "latent": ...}: the
# engine's own buffers (graph outputs, the workspace latent), valid during the call; clone to keep
ScaleCallback = Callable[[int, dict], None]


@dataclass
class GenerationResult:
    images: Optional[torch.Tensor]          # (B, 3, H, W) float32 in [0, 1]; None when decode=False
    latent: torch.Tensor
    stats: GenerationStats


class _ScaleTimer:
    """Per-scale wall time without host syncs inside the loop (CUDA events, read once at the end)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[int, tuple[Any, Any]] = {}

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self, key: int):
        self.marks[key] = (self._now(), None)

    def cancel(self, key):
        """Forget a started mark (a scale that turned out skipped)."""
        self.marks.pop(key, None)

    def stop(self, key: int):
        self.marks[key] = (self.marks[key][0], self._now())

    def ms(self) -> dict[int, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: a.elapsed_time(b) for k, (a, b) in self.marks.items()}
        return {k: (b - a) * 1e3 for k, (a, b) in self.marks.items()}


class _GraphRunner:
    """CUDA graphs of dense scales (and of layer stacks, see the adapters), stored in the adapter's
    workspace and replayed later.

    The adapter's ``compute_scale`` reads only static workspace buffers, so a capture taken at the
    first generation stays valid for every later one of the same shape. The KV cache's host-side
    bookkeeping (fill lengths, tail owner) is not advanced by a replay, so it is recorded at capture
    and set after each replay.
    """

    def __init__(self, workspace, adapter):
        if not hasattr(workspace, "graphs"):
            workspace.graphs = {}
            workspace.graph_pool = torch.cuda.graph_pool_handle()
        # One side stream per adapter for warm-up and capture: every new stream would get its own
        # cuBLAS workspace from the caching allocator.
        if getattr(adapter, "capture_stream", None) is None:
            adapter.capture_stream = torch.cuda.Stream()
        if getattr(adapter, "noise_stream", None) is None:
            adapter.noise_stream = torch.cuda.Stream()
        self.ws, self.stream, self.noise_stream = workspace, adapter.capture_stream, adapter.noise_stream
        self.noise_fence: Optional[torch.cuda.Event] = None    # see draw_noise

    def usable(self, key, kv) -> bool:
        """Whether :meth:`run` replays (or captures) ``key`` now rather than return None: the KV cache
        is unmasked and, for a captured graph, in the state it was captured in (no policy changed it
        earlier in this generation)."""
        entry = self.ws.graphs.get(key)
        return not kv.masked and (entry is None or kv.host_state() == entry[2])

    def index_buffer(self, key, index: torch.Tensor) -> torch.Tensor:
        """``index`` copied into the buffer the graph of ``key`` reads (same address every generation)."""
        return persistent_copy(self.ws.static_index, key, index)

    def draw_noise(self, noise_NV: torch.Tensor, generator, fresh: bool) -> None:
        """``noise_NV.exponential_(generator=generator)`` on a side stream, ordered before the work the
        caller issues next. The draw waits only for the main stream's work up to the start of the
        previous whole-scale replay (the last reader of a scale's buffer is an earlier generation's
        replay of that scale), so on the GPU it runs beside the previous scale instead of between
        two graphs (that kernel and the idle GPU around it were ~13 µs per scale at VAR-d30 batch
        1; on an H100 that loop went from 21.04 / 21.06 to 21.00 / 21.02 ms).

        The first draw of a generation, and one into a ``fresh`` buffer (just allocated: the
        allocator may have handed over memory that work still queued on the main stream uses),
        stay on the main stream: there is nothing earlier to overlap, and the wait across streams
        made the first scale slower. The generator is called in the same order as before, so the
        values are the same."""
        main = torch.cuda.current_stream()
        if fresh or self.noise_fence is None:
            noise_NV.exponential_(generator=generator)  # on the main stream: a side stream gains nothing here
        else:
            side = self.noise_stream
            side.wait_event(self.noise_fence)
            with torch.cuda.stream(side):
                noise_NV.exponential_(generator=generator)
            main.wait_stream(side)
        self.noise_fence = main.record_event()          # the next draw may run beside what follows

    def run(self, key, fn: Callable[[], Any], kv, run: Optional[RunState] = None,
            preserve: Sequence[torch.Tensor] = ()) -> Any:
        """Replay (capturing at the first call) the graph of ``key``; None when the KV cache is not in
        the captured state, so the caller runs eagerly. ``preserve``: tensors ``fn`` updates in place
        (a latent), restored after the warm-up run that precedes a capture."""
        if not self.usable(key, kv):
            return None                                # run eagerly
        entry = self.ws.graphs.get(key)
        if entry is None:
            before = kv.host_state()
            saved = [t.clone() for t in preserve]
            stream = self.stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()                                   # warm-up (allocations, cuBLAS handles, compiles)
            torch.cuda.current_stream().wait_stream(stream)
            for t, old in zip(preserve, saved):
                t.copy_(old)
            kv.set_host_state(before)
            graph = torch.cuda.CUDAGraph()
            if run is not None:
                run.graph_exports = {}
            with torch.cuda.graph(graph, pool=self.ws.graph_pool, stream=stream):
                out = fn()
            exports = run.graph_exports if run is not None else {}
            entry = (graph, out, before, kv.host_state(), exports)
            self.ws.graphs[key] = entry
            kv.set_host_state(before)                  # capture recorded work but ran none of it
        graph, out, before, after, exports = entry
        graph.replay()
        kv.set_host_state(after)
        if run is not None and exports:
            run.policies.graph_replayed(key[1] if isinstance(key, tuple) else key, exports, run)
        return out

    def whole_scale(self, si: int, plan, run: RunState, adapter, hooks: bool = False) -> Optional[tuple]:
        """Replay scale ``si`` whole — compute, guidance, sampling, residual and latent update — from
        one graph, with the sampler's Exp(1) noise drawn just before into a static buffer by the same
        ``exponential_`` call the sampler would make (so the same codes as the eager path; on a side
        stream, :meth:`draw_noise`). Returns
        (guided logits, codes), or None (nothing drawn, nothing run) when the adapter cannot take
        pre-drawn noise or the KV cache is not in the captured state.

        ``hooks``: the policies act at this scale and can be captured with it
        (``PolicyStack.scale_capturable``): their model hooks and ``post_residual`` run inside the
        graph, a token subset is read from a static copy of the plan's index, and the graph is
        keyed by the subset size and the policies' settings too; the caller runs ``after_scale``.

        The graph bakes in the sampling settings (guidance, top-k, top-p): graphs captured under
        other settings are dropped, so a sweep over settings keeps one set of graphs in memory."""
        shape = adapter.sample_noise_shape(si, run)
        stack = run.policies
        n = plan.token_index.shape[1] if plan.token_index is not None else None
        # with hooks the graph bakes in what the policies do inside it (e.g. which layer SparseVAR
        # observes): keyed by every policy's settings as well as the subset size
        key = ("scale", si) if not hooks else ("scale", si, n, tuple(p.graph_key() for p in stack))
        if shape is None or not self.usable(key, run.workspace.kv):
            return None
        ws = self.ws
        if getattr(ws, "scale_graph_settings", None) != run.settings:
            for k in [k for k in ws.graphs if isinstance(k, tuple) and k[0] == "scale"]:
                del ws.graphs[k]
                ws.static_index.pop(k, None)           # its subset buffer, if it had one
            ws.scale_graph_settings = run.settings
            ws.scale_noise = {}
        noise_NV = ws.scale_noise.get(si)
        fresh = noise_NV is None or tuple(noise_NV.shape) != tuple(shape)
        if fresh:
            noise_NV = ws.scale_noise[si] = torch.empty(shape, dtype=torch.float32, device=run.device)
        self.draw_noise(noise_NV, run.generator, fresh)
        if n is not None:                              # the subset from a buffer the graph reads
            plan = dataclasses.replace(plan, token_index=self.index_buffer(key, plan.token_index))
            run.plan = plan                            # what the policies' hooks read

        def scale():
            logits = adapter.compute_scale(si, plan, run)
            guided = adapter.guide(si, logits, run)
            codes = adapter.sample(si, guided, run, noise_NV=noise_NV)
            residual = adapter.residual(si, codes, run)
            if hooks:
                residual = stack.post_residual(si, residual, run)
            adapter.accumulate(si, residual, run)
            return guided, codes

        return self.run(key, scale, run.workspace.kv, run, preserve=(adapter.latent(run),))

    def layer_stack(self, si: int, plan, run: RunState, num_layers: int, layers_fn: Callable) -> Any:
        """Replay the layer stack of scale ``si`` (stage input → gather → layers → scatter) from a
        graph keyed by scale, subset size, observed layers and the policies' graph key; the taps are
        handed to the policies' ``observe`` after the replay. ``layers_fn(idx_Bn or None, taps)``
        runs the stack eagerly and returns (x, [(layer, x_in, x_out), …]). None: run eagerly."""
        ws, stack = run.workspace, run.policies
        taps = stack.observed_layers(si, run) if stack.active["observe"] else set()
        taps = set(range(num_layers)) if taps is None else taps
        idx_buf = None
        n = plan.token_index.shape[1] if plan.token_index is not None else None
        key = ("layers", si, n, frozenset(taps), stack.graph_key(si, run))
        if n is not None:
            idx_buf = self.index_buffer(key, plan.token_index.to(run.device, torch.long))
        out = self.run(key, lambda: layers_fn(idx_buf, taps), ws.kv, run)
        if out is None:
            return None
        x, collected = out
        for i, x_in, x_out in collected:
            stack.observe(si, ("layer", i), x_in, x_out, run)
        return x


def generate(adapter: ModelAdapter, conditioning: Any, batch_size: int, *,
             settings: SamplingSettings = SamplingSettings(),
             generator: GeneratorArg = None,
             policies: Optional[PolicyStack] = None,
             callback: Optional[ScaleCallback] = None,
             cuda_graphs: bool = False,
             decode: bool = True,
             keep_workspace: bool = True,
             stop: Optional[Callable[[], bool]] = None,
             schedule: Optional[ScaleSchedule] = None,
             graph_max_tokens: Optional[int] = None) -> GenerationResult:
    """Run every scale of one generation and decode the result.

    cuda_graphs: replay dense scales from CUDA graphs (CUDA only; captured in the workspace at the
        first call of a batch size, again after a call of another size replaced it). A scale a
        policy changes replays its layer stack from a graph when the subset size is fixed by the
        settings and the policy's in-layer hooks are capturable, else runs eagerly. Where the
        adapter supports it (``supports_scale_graphs``), a scale at which no policy acts after the
        head — or whose policies can be captured with it
        (``PolicyStack.scale_capturable``; their plan runs before) — replays whole: compute,
        guidance, sampling and latent update, with the sampler's noise drawn just before the
        replay by the same call, so the codes equal the eager path's.
    graph_max_tokens: with graphs, scales whose map has more tokens run eagerly (their kernels are
        long enough not to wait on the host, and a graph pool holding their activations would be
        large); None: no limit.
    stop: polled after every scale; when it returns True the remaining scales are skipped and the
        latent accumulated so far is decoded (an interrupt that still returns an image).
    keep_workspace: keep the workspace (KV cache, graphs) for the next call of the same batch size;
        an adapter keeps one workspace at a time (a call of another batch size replaces it) and may
        still free its KV cache before decoding (Infinity does when it runs without graphs, to lend
        that memory to its VAE). On an exception (e.g. an interrupt raised by ``callback``) the
        workspace is always released. On the CPU, the memory the call freed is handed back to the
        operating system at its end (``trim_host_heap``).
    schedule: the scales of this generation, for families whose output size is chosen per call
        (Infinity); default ``adapter.schedule``. Policies see it in ``run.schedule`` / ``run.info``.
    """
    policies = policies if policies is not None else PolicyStack()
    info = adapter.model_info()
    if schedule is not None and schedule != info.schedule:
        info = dataclasses.replace(info, schedule=schedule)
    run = RunState(schedule=info.schedule, batch_size=batch_size, settings=settings, info=info,
                   generator=generator, policies=policies, device=adapter.device, dtype=adapter.dtype)
    use_graphs = cuda_graphs and run.device.type == "cuda" and adapter.supports_cuda_graphs
    scale_graphs = use_graphs and getattr(adapter, "supports_scale_graphs", False)
    run.cuda_graphs = use_graphs
    ok = False
    try:
        policies.validate(run.info)
        adapter.begin(run, conditioning)
        policies.begin(run)
        timer = _ScaleTimer(run.device)
        graphs = _GraphRunner(run.workspace, adapter) if use_graphs else None
        schedule = run.schedule
        skipping = False
        hook_timer = _ScaleTimer(run.device)            # the policies' own work, for the stats
        for si in range(schedule.num_scales):
            h, w = schedule.hw[si]
            run.si = si
            if not skipping:
                timer.start(si)                        # the scale's time includes the policies' plan
                if len(policies):
                    hook_timer.start(("plan", si))
            plan = policies.plan_scale(si, run) if not skipping else None
            if not skipping and len(policies):
                hook_timer.stop(("plan", si))
            if skipping or plan.skip:
                timer.cancel(si)
                hook_timer.cancel(("plan", si))
                skipping = True
                run.stats.scales.append(ScaleStats(si, h, w, h * w, 0, skipped=True, rows=2 if run.cfg_active else 1))
                continue
            run.plan = plan
            run.tokens_computed = None
            if plan.cond_only and run.cfg_active:
                adapter.drop_uncond(run)
                run.cfg_active = False
            logits = whole = None
            hooked = False                             # policies' hooks captured in the whole-scale graph
            if graphs is not None and run.cfg_active and (graph_max_tokens is None or h * w <= graph_max_tokens):
                if plan.dense and not policies.uses_model_hooks(si, run):
                    if scale_graphs and policies.tail_idle(si, run):
                        # no policy acts after the head here: guidance, sampling and the latent update
                        # replay with the scale's compute from one graph
                        whole = graphs.whole_scale(si, plan, run, adapter)
                    if whole is None:
                        logits = graphs.run(("dense", si), lambda: adapter.compute_scale(si, plan, run),
                                            run.workspace.kv, run)
                elif (plan.dense or plan.static) and plan.token_valid is None and policies.graph_safe_at(si, run):
                    if scale_graphs and policies.scale_capturable(si, run):
                        # the policies' hooks here can be captured too: the whole scale from one graph
                        whole = graphs.whole_scale(si, plan, run, adapter, hooks=True)
                        hooked = whole is not None
                    if whole is None:
                        # the layer stack replays from a graph; the policies' observe / post_hidden run around it
                        logits = adapter.compute_scale(si, plan, run, graphs=graphs)
            if whole is not None:
                guided, codes = whole
                if hooked:
                    if len(policies):
                        hook_timer.start(("after", si))
                    policies.after_scale(si, guided, run)
                    if len(policies):
                        hook_timer.stop(("after", si))
            else:
                if logits is None:
                    logits = adapter.compute_scale(si, plan, run)
                guided = adapter.guide(si, logits, run)
                codes = adapter.sample(si, guided, run)
                residual = adapter.residual(si, codes, run)
                if len(policies):
                    hook_timer.start(("post", si))
                residual = policies.post_residual(si, residual, run)
                if len(policies):
                    hook_timer.stop(("post", si))
                adapter.accumulate(si, residual, run)
                if len(policies):
                    hook_timer.start(("after", si))
                policies.after_scale(si, guided, run)
                if len(policies):
                    hook_timer.stop(("after", si))
            timer.stop(si)
            if run.tokens_computed is not None:          # a policy counted (e.g. per-layer pruning)
                n = run.tokens_computed
            elif plan.token_index is None:
                n = h * w
            elif plan.token_valid is not None:            # padded batch: count each image's own tokens
                n = float(plan.token_valid.sum()) / batch_size
            else:
                n = int(plan.token_index.shape[-1])
            run.stats.scales.append(ScaleStats(si, h, w, h * w, n, rows=2 if run.cfg_active else 1))
            if callback is not None:
                callback(si, {"codes": codes, "logits": guided, "latent": adapter.latent(run)})
            if stop is not None and stop():
                skipping = True
        scale_ms = timer.ms()                          # the loop's only host sync
        hook_ms = hook_timer.ms() if hook_timer.marks else {}
        for s in run.stats.scales:
            if not s.skipped:
                s.ms = scale_ms[s.si]
                s.policy_ms = sum(v for (kind, k), v in hook_ms.items() if k == s.si)
        images = None
        run.policy_state.clear()                       # the policies' maps and caches: free before decoding
        if decode:
            t = _ScaleTimer(run.device)
            t.start(0)
            images = adapter.decode(run)
            t.stop(0)
            run.stats.decode_ms = t.ms()[0]
        ok = True
        return GenerationResult(images=images, latent=adapter.latent(run).clone(), stats=run.stats)
    finally:
        adapter.end(run, keep_workspace=keep_workspace and ok)
        trim_host_heap(run.device)      # CPU: this call's freed activations back to the OS (engine/memory.py)
