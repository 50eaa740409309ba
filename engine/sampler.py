"""The model-agnostic staged sampler: one scale at a time, policies consulted at every hook point.

``generate`` is the only entry point. It owns the scale loop, the per-scale timing, the policy
plan, the CUDA-graph replay (engine/graphs.py) and the callback; everything family-specific
(conditioning, stage inputs, layers, head, guidance, sampling, latent) lives in the adapter.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.autograd.profiler import record_function

from .adapter import ModelAdapter
from .contract import PolicyStack
from .graphs import GraphRunner
from .layers import compute_scale
from .memory import trim_host_heap
from .schedule import ScaleSchedule
from .state import GenerationStats, GeneratorArg, RunState, SamplingSettings, ScaleStats

# callback(si, tensors) with tensors = {"codes": (B, l), "logits": guided (B, l, V), "latent": ...}: the
# engine's own buffers (graph outputs, the workspace latent), valid during the call; clone to keep
# called after each computed scale with (si, {"codes", "logits", "latent"}); it may return {"latent": edited}:
# the adapter's replace_latent writes it and remakes the next scale's input from it
ScaleCallback = Callable[[int, dict], Optional[dict]]


def phase(name: str) -> Callable:
    """Decorator: every call of the function is a ``name`` range in a ``torch.profiler`` trace (a
    fresh ``record_function`` per call; a few microseconds). A call's phases: ``sparsevar.check_inputs``,
    ``sparsevar.encode_prompt``, ``sparsevar.begin``, ``sparsevar.prepare``, ``sparsevar.scales``,
    ``sparsevar.decode``, ``sparsevar.postprocess``."""
    def wrap(fn):
        @functools.wraps(fn)
        def marked(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return marked
    return wrap


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


def _timed(timer: _ScaleTimer, key, on: bool, fn: Callable, *args):
    """``fn(*args)``, timed under ``key`` when ``on``."""
    if not on:
        return fn(*args)
    timer.start(key)
    out = fn(*args)
    timer.stop(key)
    return out


def generate(adapter: ModelAdapter, conditioning: Any, batch_size: int, *,
             settings: SamplingSettings,
             generator: GeneratorArg = None,
             policies: Optional[PolicyStack] = None,
             callback: Optional[ScaleCallback] = None,
             cuda_graphs: bool = False,
             decode: bool = True,
             keep_workspace: bool = True,
             stop: Optional[Callable[[], bool]] = None,
             schedule: Optional[ScaleSchedule] = None,
             graph_max_tokens: Optional[int] = None,
             before_decode: Optional[Callable[[], None]] = None) -> GenerationResult:
    """Run every scale of one generation and decode the result.

    cuda_graphs: replay scales from CUDA graphs (CUDA only; captured in the workspace at the first
        call of a shape, again after a call of another shape replaced it); what replays at each scale
        is decided from its plan (engine/graphs.py). Replayed scales draw the sampler's noise just
        before the replay by the same call, so the codes equal the eager path's.
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
    before_decode: called after the scale loop, before the decode (a pipeline's model offload puts
        the decoder on the GPU there).
    schedule: the scales of this generation, for families whose output size is chosen per call
        (Infinity); default ``adapter.schedule``. Policies see it in ``run.schedule`` / ``run.info``.
    """
    policies = policies if policies is not None else PolicyStack()
    info = adapter.model_info()
    if schedule is not None and schedule != info.schedule:
        info = dataclasses.replace(info, schedule=schedule)
    run = RunState(schedule=info.schedule, batch_size=batch_size, settings=settings, info=info,
                   generator=generator, policies=policies, device=adapter.device, dtype=adapter.dtype)
    stream = adapter.layer_stream
    # a layer stream copies weights between the layers on the host's schedule: eager scales
    use_graphs = cuda_graphs and run.device.type == "cuda" and adapter.supports_cuda_graphs and stream is None
    whole_scales = use_graphs and adapter.supports_scale_graphs
    run.cuda_graphs = use_graphs
    ok = False
    try:
        policies.validate(run.info)
        run.kv_slots = policies.kv_slots(run.info)
        if stream is not None:
            stream.forget()                            # the weights' CPU copies may have changed since
        with record_function("sparsevar.begin"):
            adapter.begin(run, conditioning)
            policies.begin(run)
        timer = _ScaleTimer(run.device)
        graphs = GraphRunner(run.workspace, adapter.graph_streams) if use_graphs else None
        with record_function("sparsevar.prepare"):
            if graphs is not None:
                graphs.prepare(adapter, run)
            else:
                adapter.prepare(run)
        with record_function("sparsevar.scales"):          # the scale loop, until its last scale is done
            schedule = run.schedule
            skipping = False
            hook_timer = _ScaleTimer(run.device)            # the policies' own work, for the stats
            timing = len(policies) > 0
            for si in range(schedule.num_scales):
                h, w = schedule.hw[si]
                run.si = si
                if not skipping:
                    timer.start(si)                        # the scale's time includes the policies' plan
                    plan = _timed(hook_timer, ("plan", si), timing, policies.plan_scale, si, run)
                    if plan.skip:
                        timer.cancel(si)
                        hook_timer.cancel(("plan", si))
                        skipping = True
                if skipping:
                    run.stats.scales.append(ScaleStats(si, h, w, h * w, 0, skipped=True,
                                                       rows=2 if run.cfg_active else 1))
                    continue
                run.plan = plan
                run.tokens_computed = run.keys_read = None
                if plan.cond_only and run.cfg_active:
                    adapter.drop_uncond(run)
                    run.cfg_active = False
                graphed = use_graphs and run.cfg_active and (graph_max_tokens is None or h * w <= graph_max_tokens)
                out = graphs.scale(si, plan, run, adapter, whole_scales) if graphed else None
                if out is not None and len(out) == 2:      # replayed whole: only after_scale is left
                    guided, codes = out
                else:
                    logits = compute_scale(adapter, si, plan, run) if out is None else out[0]
                    guided = adapter.guide(si, logits, run)
                    codes = adapter.sample(si, guided, run)
                    residual = _timed(hook_timer, ("post", si), timing, policies.post_residual, si,
                                      adapter.residual(si, codes, run), run)
                    adapter.accumulate(si, residual, run)
                _timed(hook_timer, ("after", si), timing, policies.after_scale, si, guided, run)
                timer.stop(si)
                if run.tokens_computed is not None:          # a policy counted (e.g. per-layer pruning)
                    n = run.tokens_computed
                elif plan.token_index is None:
                    n = h * w
                elif plan.token_valid is not None:            # padded batch: count each image's own tokens
                    n = float(plan.token_valid.sum()) / batch_size
                else:
                    n = int(plan.token_index.shape[-1])
                run.stats.scales.append(ScaleStats(si, h, w, h * w, n, rows=2 if run.cfg_active else 1,
                                                   keys_read=run.keys_read))
                if callback is not None:
                    latent = adapter.latent(run)
                    ret = callback(si, {"codes": codes, "logits": guided, "latent": latent})
                    if isinstance(ret, dict) and ret.get("latent") is not None:     # an edit: later scales build on it
                        new = ret["latent"]
                        if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(latent.shape):
                            raise ValueError(f"the callback returned a latent of shape "
                                             f"{tuple(getattr(new, 'shape', ()))}; it must keep the latent's shape "
                                             f"{tuple(latent.shape)}")
                        adapter.replace_latent(si, new.to(latent.device, latent.dtype), run)
                if stop is not None and stop():
                    skipping = True
            scale_ms = timer.ms()                          # one host sync for every scale's time
            hook_ms = hook_timer.ms() if hook_timer.marks else {}
        for s in run.stats.scales:
            if not s.skipped:
                s.ms = scale_ms[s.si]
                s.policy_ms = sum(v for (kind, k), v in hook_ms.items() if k == s.si)
        images = None
        run.policy_state.clear()                       # the policies' maps and caches: free before decoding
        if decode:
            with record_function("sparsevar.decode"):
                if before_decode is not None:
                    before_decode()
                t = _ScaleTimer(run.device)
                t.start(0)
                images = graphs.decode(adapter, run) if graphs is not None else adapter.decode(run)
                t.stop(0)
                run.stats.decode_ms = t.ms()[0]
        ok = True
        return GenerationResult(images=images, latent=adapter.latent(run).clone(), stats=run.stats)
    finally:
        if stream is not None and not ok:
            stream.release()                           # every block back on its CPU copy
        adapter.end(run, keep_workspace=keep_workspace and ok)
        trim_host_heap(run.device)      # CPU: this call's freed activations back to the OS (engine/memory.py)
