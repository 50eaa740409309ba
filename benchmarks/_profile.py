"""Where one pipeline call's time goes: its phases (the ``sparsevar.*`` ranges the pipelines and the
engine mark, ``engine.sampler.phase``), the host time of each, split into the torch operators and
CUDA runtime calls it made (the outermost ones, by name) and the rest (Python), the GPU's busy time
inside each, and the stretches in which the GPU waited for the host. Read from a ``torch.profiler``
trace of one call."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

_CALL = "sparsevar.bench_call"
_GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_CALLS = ("cpu_op", "cuda_runtime", "cuda_driver")       # torch operators, CUDA API calls


def _host_calls(spans: list, phase: dict, top: int) -> str:
    """The host time of ``phase`` (a trace event) in its outermost torch operators and CUDA calls on
    its thread, the ``top`` names by time, and the rest (Python and whatever the profiler does not
    name)."""
    a, b = phase["ts"], phase["ts"] + phase.get("dur", 0)
    calls = sorted((e for e in spans if e.get("cat") in _HOST_CALLS and e.get("tid") == phase.get("tid")
                    and e.get("pid") == phase.get("pid") and a <= e["ts"] and e["ts"] + e.get("dur", 0) <= b),
                   key=lambda e: (e["ts"], -e.get("dur", 0)))
    by_name, end = {}, a
    for e in calls:                                   # outermost only: a call inside another is its work
        if e["ts"] < end:
            continue
        end = e["ts"] + e.get("dur", 0)
        n, ms = by_name.get(e["name"], (0, 0.0))
        by_name[e["name"]] = (n + 1, ms + e.get("dur", 0) / 1e3)
    named = sum(ms for _, ms in by_name.values())
    most = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    listed = ", ".join(f"{name} {ms:.2f} ×{n}" for name, (n, ms) in most)
    count = sum(n for n, _ in by_name.values())
    return (f"torch and CUDA calls {named:.2f} ms in {count}" + (f" ({listed})" if listed else "")
            + f"; Python and the rest {(b - a) / 1e3 - named:.2f} ms")


def _busy(intervals: list, start: float, end: float) -> float:
    """Time in [start, end) covered by the sorted (start, end) ``intervals`` (overlaps counted once)."""
    total, cursor = 0.0, start
    for a, b in intervals:
        a, b = max(a, cursor), min(b, end)
        if b > a:
            total += b - a
            cursor = b
    return total


def profile_call(call: Callable[[], object], device: str, gaps: int = 6, top: int = 5) -> str:
    """Run ``call`` once under the profiler and describe it (times in ms, offsets from the call's start;
    ``top``: the host calls named per phase)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        with record_function(_CALL):
            call()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X"]
    marks = [e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith("sparsevar.")]
    ranges = [(e["name"], e["ts"] / 1e3, (e["ts"] + e.get("dur", 0)) / 1e3) for e in marks]
    call_ranges = [r for r in ranges if r[0] == _CALL]
    if not call_ranges:
        return "no trace of the call (the profiler recorded nothing)"
    _, t0, t1 = call_ranges[-1]
    work = sorted((e["ts"] / 1e3, (e["ts"] + e.get("dur", 0)) / 1e3) for e in spans if e.get("cat") in _GPU_WORK)
    gpu = device.startswith("cuda")
    busy = _busy(work, t0, t1)
    lines = [f"call {t1 - t0:.2f} ms, " + (f"GPU busy {busy:.2f} ms (waiting {t1 - t0 - busy:.2f} ms)" if gpu
                                          else "on the CPU (no GPU timeline)")]
    marked = sorted((m for m, r in zip(marks, ranges) if r[0] != _CALL and t0 <= r[1] and r[2] <= t1),
                    key=lambda m: m["ts"])
    phases = [(m["name"], m["ts"] / 1e3, (m["ts"] + m.get("dur", 0)) / 1e3) for m in marked]
    for m, (name, a, b) in zip(marked, phases):
        inside = f"  GPU busy inside {_busy(work, a, b):8.2f} ms" if gpu else ""
        lines.append(f"  {name:<24} at +{a - t0:8.2f}  host {b - a:8.2f} ms{inside}")
        lines.append(f"      {_host_calls(spans, m, top)}")
    if gpu and work:
        idle, cursor = [], t0
        for a, b in work:
            if a > cursor and a <= t1:
                idle.append((a - cursor, cursor))
            cursor = max(cursor, b)
        if t1 > cursor:
            idle.append((t1 - cursor, cursor))

        def phase_at(t):
            inside = [n for n, a, b in phases if a <= t < b]
            return inside[-1] if inside else "between phases"

        top = sorted(idle, reverse=True)[:gaps]
        lines.append("  GPU waiting (longest): " + ", ".join(f"{d:.2f} ms at +{t - t0:.2f} ({phase_at(t)})"
                                                           for d, t in top))
    return "\n".join(lines)
