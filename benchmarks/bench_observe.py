"""Which layer should SparseVAR observe? The capture rate of every layer's change map (issue #34).

    sparsevar bench observe --seeds 8 --keep 0.5 --scales 3 --out observe.csv
    python -m sparsevar.benchmarks.bench_observe --model PATH

SparseVAR keeps the tokens of scale k that one observed layer (or block group) changed most at scale
k − 1: the change map ``m(i) = mean_c (x_out − x_in)²`` of that layer, averaged over the CFG rows
(``sparse_ops.ref.change_map``, as the policy computes it), upsampled to scale k by nearest
neighbour (``policies.sparsevar.nearest_source``). A good layer is one whose map points at the
tokens that matter at scale k. This harness measures that for every layer of a checkpoint.

For every seed (class ``seed % num_classes``, or a prompt per seed) the model generates once, dense,
with a recording policy (:class:`LayerTaps`) that keeps every layer's change map at the scales before
the pruned ones and the per-token residual ``Δr_k`` (what the adapter's ``residual`` returns: for VAR the codebook
embedding of the sampled code) at the pruned scales: the last ``scales`` scales. At each pruned
scale k with L tokens it keeps ``n = ceil(keep · L)`` tokens by the upsampled map (ties: the earlier
position, as ``select_kept`` breaks them) and reports the share of the scale's residual energy
``e_k(i) = ‖Δr_k(i)‖²`` they hold (the **capture rate**). References at the same n: ``random`` (the
mean over 64 uniformly random subsets, drawn from one generator seeded 0; its expectation is n / L)
and ``oracle`` (the top n by ``e_k`` itself: the most any selection of n tokens captures).

Per layer (and per block group for models that have groups): the mean over seeds of the capture
averaged over the pruned scales, with a 95 % confidence interval over seeds (Student t), and the
mean per scale. The layer of the family preset is marked, and the best layer is compared with it
seed by seed (the paired difference and its 95 % interval).

The command line loads VARPipeline folders; :func:`measure_capture` also takes a text-to-image
pipeline with one prompt per seed. A family whose residuals all have the same norm (Infinity's
±1/√d bits) gives every selection the same capture, n / L: the measure cannot rank its layers, and
the harness says so.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from ..engine.contract import Policy, ScalePlan
from ..policies.sparsevar import SPARSEVAR_PRESETS, SparseVARPolicy, nearest_source
from ..sparse_ops.ref import change_map
from ._results import atomic_write, write_csv
from .bench_quality import check_conditions, resolve_device
from .metrics import mean_ci95


# ---- the measure -----------------------------------------------------------------------------------------------
def kept_count(keep: float, L: int) -> int:
    """Tokens kept at a scale of ``L`` tokens: ``ceil(keep · L)``, as SparseVAR's keep_ratio budget
    (which adds the anchors on top; here no anchors)."""
    return math.ceil(keep * L)


def top_share(score_BL: torch.Tensor, energy_BL: torch.Tensor, n: int) -> torch.Tensor:
    """(B,) share of each image's total ``energy_BL`` held by its ``n`` highest-scoring tokens (equal
    scores: the earlier position first)."""
    order_Bn = torch.sort(score_BL.float(), dim=1, descending=True, stable=True).indices[:, :n]
    energy_BL = energy_BL.double()
    return (energy_BL.gather(1, order_Bn).sum(1) / energy_BL.sum(1)).float()


def capture_rate(prev_map_Bhw: torch.Tensor, energy_BL: torch.Tensor, hw: tuple[int, int], keep: float) -> torch.Tensor:
    """(B,) capture rate of a change map measured at the previous scale, ``prev_map_Bhw`` (B, h', w'):
    upsampled to ``hw`` by nearest neighbour, its top ``ceil(keep · h·w)`` tokens' share of the
    energy ``energy_BL`` (B, h·w) of scale ``hw``."""
    B, hp, wp = prev_map_Bhw.shape
    src_L = nearest_source((hp, wp), hw, prev_map_Bhw.device)
    score_BL = prev_map_Bhw.reshape(B, hp * wp).index_select(1, src_L)                 # (B, h', w') → (B, L)
    return top_share(score_BL, energy_BL, kept_count(keep, hw[0] * hw[1]))


class LayerTaps(Policy):
    """Records, without changing the generation, at each of the last ``last`` scales k: every layer's
    change map at scale k − 1 (and every block group's, from its first layer's input to its last
    layer's output) and the per-token residual energy ``‖Δr_k(i)‖²`` at scale k. After a generation,
    ``record`` holds ``{"maps": {(k − 1, ("layer" | "group", i)): (B, L)}, "energy": {k: (B, L)}}``
    (float32, on the CPU), ``info`` the run's ``ModelInfo`` (its schedule: the call's) and ``pruned``
    the scales k."""

    name = "observe_taps"

    def __init__(self, last: int):
        self.last = last
        self.record: dict = {"maps": {}, "energy": {}}
        self.info, self.pruned = None, ()

    def validate(self, info) -> None:
        S = info.schedule.num_scales
        if not 1 <= self.last < S:
            raise ValueError(f"scales={self.last}: this model has {S} scales and the first has no previous one; "
                             f"give 1..{S - 1}")

    def begin(self, run) -> None:
        S = run.schedule.num_scales
        # the dict outlives the run's policy state, which the engine clears before decoding
        self.record, self.info, self.pruned = {"maps": {}, "energy": {}}, run.info, tuple(range(S - self.last, S))
        run.policy_state[self.name] = {"record": self.record, "group_in": None}

    def plan_scale(self, si: int, run) -> Optional[ScalePlan]:
        hooks = ({"observe"} if si + 1 in self.pruned else set()) | ({"post_residual"} if si in self.pruned else set())
        return ScalePlan(hooks=frozenset(hooks), static=not hooks)

    def observe(self, si, unit, x_in, x_out, run) -> None:
        if unit[0] != "layer":
            return
        st, B, L, i = run.policy_state[self.name], run.batch_size, run.schedule.tokens(si), unit[1]
        idx_Bn = run.plan.token_index
        idx_Bn = idx_Bn.to(x_out.device) if idx_Bn is not None else None
        maps = st["record"]["maps"]
        maps[(si, ("layer", i))] = change_map(x_in, x_out, B, idx_Bn, L).cpu()
        per = run.info.layers_per_group
        if run.info.layer_groups:
            if i % per == 0:
                st["group_in"] = x_in
            if i % per == per - 1:
                maps[(si, ("group", i // per))] = change_map(st["group_in"], x_out, B, idx_Bn, L).cpu()
                st["group_in"] = None

    def post_residual(self, si, residual_BLc, run):
        run.policy_state[self.name]["record"]["energy"][si] = residual_BLc.float().square().sum(-1).cpu()
        return residual_BLc


def unit_label(unit: tuple[str, int]) -> str:
    """``("layer", 5)`` → "5"; ``("group", 2)`` → "group2"."""
    return str(unit[1]) if unit[0] == "layer" else f"{unit[0]}{unit[1]}"


def preset_unit(info, family: str, cfg=None) -> Optional[tuple[str, int]]:
    """The layer (or block group) a SparseVAR config observes on this model (``cfg`` None: the
    family's preset), or None (no preset, or one that does not fit this model)."""
    cfg = SPARSEVAR_PRESETS.get(family) if cfg is None else cfg
    if cfg is None:
        return None
    try:
        _, first, last = SparseVARPolicy(cfg).resolved(info)
    except ValueError:
        return None
    if cfg.granularity == "group":
        return ("group", first // info.layers_per_group)
    return ("layer", first)


def check_taus(taus, starts=()) -> None:
    """The thresholds and start scales ``calibrate`` may try: each tau in [0, 1), each start a
    negative int (ValueError naming the value)."""
    for t in taus or ():
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t < 1.0:
            raise ValueError(f"taus={t!r}: give change thresholds in [0, 1), e.g. 0.3")
    for s in starts or ():
        if isinstance(s, bool) or not isinstance(s, int) or s >= 0:
            raise ValueError(f"starts={s!r}: give first pruned scales counted from the end, e.g. -2")


def check_settings(keep, scales, seeds) -> None:
    """The settings that need no model: one-line ValueError / TypeError naming the bad one."""
    for v, name, what in ((keep, "keep", "a fraction"), (scales, "scales", "an int"), (seeds, "seeds", "an int")):
        if isinstance(v, bool) or not isinstance(v, (int, float) if name == "keep" else int):
            raise TypeError(f"{name}={v!r}: give {what}")
    if not (math.isfinite(keep) and 0.0 < keep < 1.0):
        raise ValueError(f"keep={keep}: give the fraction of tokens kept, strictly between 0 and 1 (e.g. 0.5)")
    if scales < 1:
        raise ValueError(f"scales={scales}: give the number of pruned final scales, at least 1 (e.g. 3)")
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: give the number of seeds, at least 1 (e.g. 8)")


def measure_capture(pipe, seeds: Sequence[int], keep: float = 0.5, scales: int = 3,
                    guidance_scale: Optional[float] = None, top_k: Optional[int] = None,
                    top_p: Optional[float] = None, prompts: Optional[Sequence[str]] = None,
                    random_seed: int = 0, random_draws: int = 64, **call_kwargs) -> dict:
    """Per-seed capture rates of every layer (and block group) of a pipeline's model.

    ``pipe``: a ``VARPipeline`` (seed s draws class ``s % num_classes``) or a text-to-image pipeline
    of the same base (``InfinityPipeline``), which needs ``prompts``, one per seed;
    ``call_kwargs`` go to every call (e.g. ``height``/``width``). Sampling: the family's defaults
    (``pipe.DEFAULTS``) unless given.

    Returns ``{"units": [("layer", i), …, ("group", g), …], "scales": [(si, (h, w)), …] (the pruned
    ones), "kept": [n per scale], "capture": (seeds, units, scales), "random": (seeds, scales),
    "oracle": (seeds, scales)}`` (float32 tensors), ``"info"`` (the model's ``ModelInfo``) and
    ``"constant_energy"`` (every residual had the same norm: the measure cannot rank layers).
    ``random`` is the mean share of ``random_draws`` uniformly random subsets of the same size."""
    seeds = list(seeds)
    check_settings(keep, scales, len(seeds))
    if isinstance(random_draws, bool) or not isinstance(random_draws, int) or random_draws < 1:
        raise ValueError(f"random_draws={random_draws!r}: give the number of random subsets, an int >= 1 (e.g. 64)")
    conds = check_conditions(pipe, seeds, prompts)
    key = "class_labels" if hasattr(pipe, "num_classes") else "prompt"
    d = pipe.DEFAULTS
    sampling = dict(guidance_scale=d.guidance_scale if guidance_scale is None else guidance_scale,
                    top_k=d.top_k if top_k is None else top_k, top_p=d.top_p if top_p is None else top_p)
    taps = LayerTaps(last=scales)
    dev = pipe.adapter().device
    rand_gen = torch.Generator().manual_seed(random_seed)
    capture, random_, oracle, constant = [], [], [], True
    for seed, cond in zip(seeds, conds):
        pipe(**{key: [cond]}, **sampling, generator=torch.Generator(dev).manual_seed(seed), output_type="latent",
             policies=[taps], **call_kwargs)
        rec, info = taps.record, taps.info
        units = [("layer", i) for i in range(info.num_layers)] + [("group", g) for g in range(info.layer_groups)]
        cap_US, rnd_S, orc_S = [], [], []
        for k in taps.pruned:
            hw, prev_hw = info.schedule.hw[k], info.schedule.hw[k - 1]
            energy_1L = rec["energy"][k]
            n = kept_count(keep, hw[0] * hw[1])
            constant = constant and bool(torch.allclose(energy_1L, energy_1L[:, :1].expand_as(energy_1L)))
            cap_US.append([float(capture_rate(rec["maps"][(k - 1, u)].view(1, *prev_hw), energy_1L, hw, keep)[0])
                           for u in units])
            draws_DL = torch.rand(random_draws, energy_1L.shape[1], generator=rand_gen)
            rnd_S.append(float(top_share(draws_DL, energy_1L.expand(random_draws, -1), n).mean()))
            orc_S.append(float(top_share(energy_1L, energy_1L, n)[0]))
        capture.append(torch.tensor(cap_US).T)                                           # (scales, U) → (U, scales)
        random_.append(torch.tensor(rnd_S))
        oracle.append(torch.tensor(orc_S))
    info = taps.info
    return {"units": units, "scales": [(k, info.schedule.hw[k]) for k in taps.pruned],
            "kept": [kept_count(keep, info.schedule.tokens(k)) for k in taps.pruned],
            "capture": torch.stack(capture), "random": torch.stack(random_), "oracle": torch.stack(oracle),
            "info": info, "constant_energy": constant}


def summarize(m: dict) -> list[dict]:
    """CSV rows, one per unit: layer, capture, ci95, random, oracle (means over seeds of the mean over
    scales), then per pruned scale ``capture_HxW``, ``random_HxW``, ``oracle_HxW`` (means over seeds)."""
    cap_NUS, rnd_NS, orc_NS = m["capture"], m["random"], m["oracle"]
    rnd, orc = statistics.fmean(rnd_NS.mean(1).tolist()), statistics.fmean(orc_NS.mean(1).tolist())
    rows = []
    for u_i, unit in enumerate(m["units"]):
        mean, ci = mean_ci95(cap_NUS[:, u_i].mean(1).tolist())
        row = {"layer": unit_label(unit), "capture": round(mean, 4), "ci95": round(ci, 4),
               "random": round(rnd, 4), "oracle": round(orc, 4)}
        for s_i, (_, (h, w)) in enumerate(m["scales"]):
            row[f"capture_{h}x{w}"] = round(float(cap_NUS[:, u_i, s_i].mean()), 4)
            row[f"random_{h}x{w}"] = round(float(rnd_NS[:, s_i].mean()), 4)
            row[f"oracle_{h}x{w}"] = round(float(orc_NS[:, s_i].mean()), 4)
        rows.append(row)
    return rows


def best_unit(m: dict, kind: str = "layer") -> Optional[int]:
    """Index into ``m["units"]`` of the ``kind`` unit with the highest mean capture (None: none of that kind)."""
    idx = [i for i, u in enumerate(m["units"]) if u[0] == kind]
    if not idx:
        return None
    means = m["capture"].mean(2).mean(0)                                                # (N, U, S) → (U,)
    return max(idx, key=lambda i: float(means[i]))


def format_report(m: dict, rows: list[dict], preset: Optional[tuple[str, int]], title: str,
                  label: str = "preset") -> str:
    """The table and the verdict: best layer (and group) against ``preset`` (the unit marked
    ``label``: the model's preset in ``bench observe``, the family's formula in ``calibrate``),
    paired over seeds."""
    scale_names = [f"{h}x{w}" for _, (h, w) in m["scales"]]
    head = f"{'layer':>8}  {'capture ± 95% CI':>17}  {'- random':>8}  {'of oracle gain':>14}  " + \
        "  ".join(f"{s:>7}" for s in scale_names)
    lines = [title, head]
    for unit, r in zip(m["units"], rows):
        gain = (r["capture"] - r["random"]) / (r["oracle"] - r["random"]) if r["oracle"] > r["random"] else math.nan
        mark = f" {label}" if unit == preset else ""
        lines.append(f"{r['layer']:>8}  {r['capture']:>8.3f} ± {r['ci95']:<6.3f}  "
                     f"{r['capture'] - r['random']:>+8.3f}  {gain:>14.0%}  "
                     + "  ".join(f"{r['capture_' + s]:>7.3f}" for s in scale_names) + mark)
    r0 = rows[0]
    for ref in ("random", "oracle"):                       # blank under ± CI, − random and of oracle gain
        per_scale = "  ".join(f"{r0[ref + '_' + s]:>7.3f}" for s in scale_names)
        lines.append(f"{ref:>8}  {r0[ref]:>8.3f}{'':>37}{per_scale}")
    if m["constant_energy"]:
        lines.append("every token's residual has the same norm: any selection captures n / L, so this measure "
                     "cannot rank the layers of this model")
        return "\n".join(lines)
    per_seed = m["capture"].mean(2)                                                     # (N, U, S) → (N, U)
    for kind in ("layer", "group"):
        b = best_unit(m, kind)
        if b is None:
            continue
        r = rows[b]
        text = f"best {kind}: {r['layer']} ({r['capture']:.3f} ± {r['ci95']:.3f})"
        if preset is not None and preset[0] == kind:
            p = m["units"].index(preset)
            diff, ci = mean_ci95((per_seed[:, b] - per_seed[:, p]).tolist())
            text += f"; {label} {kind} {rows[p]['layer']}: {rows[p]['capture']:.3f} ± {rows[p]['ci95']:.3f}; " \
                    f"best − {label} {diff:+.3f} ± {ci:.3f} (paired over seeds)"
        lines.append(text)
    return "\n".join(lines)


def run_observe(model=None, seeds: int = 8, keep: float = 0.5, scales: int = 3, out=None, device: str = "auto",
                log: Callable[[str], None] = print) -> list[dict]:
    """Load ``model`` (None: the demo model; a VARPipeline folder; or a ``VARPipeline``), measure the
    capture rate of every layer over seeds 0..``seeds``−1, print the table, write ``out`` (a CSV
    path) when given. Returns the CSV rows."""
    check_settings(keep, scales, seeds)
    from .bench_quality import load_model
    pipe, name, loaded = load_model(model, device=device)
    if loaded:
        pipe.set_progress_bar_config(disable=True)
    m = measure_capture(pipe, range(seeds), keep=keep, scales=scales)
    rows = summarize(m)
    preset = preset_unit(m["info"], pipe.PRESET_FAMILY, pipe.sparsevar_preset)     # the calibrated one if stored
    scale_names = " ".join(f"{h}x{w}" for _, (h, w) in m["scales"])
    title = (f"observe: {name}, {seeds} seeds, keep {keep:g} (n = {', '.join(map(str, m['kept']))} tokens), "
             f"pruned scales {scale_names}; capture = share of the scale's residual energy in the kept tokens")
    log(format_report(m, rows, preset, title))
    if out is not None:
        write_csv(rows, out, log)
    return rows


# ---- calibration: the measured layer and threshold, stored with the model ---------------------------------------
# The thresholds `calibrate` tries, and the settings it compares them with (`bench quality` names): the
# static methods and their combinations that cost no calibration of their own.
TAU_CANDIDATES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
START_CANDIDATES = (-1, -2, -3)          # first pruned scale, counted from the end
TAU_BASELINES = ("cond-only-last-1", "cond-only-last-2", "fastvar-preset", "skip-last-1",
                 "fastvar-preset+cond-only-last-2", "skip-last-2")
# the PSNR a picture identical to dense counts as (instead of inf), so that means stay finite JSON numbers
IDENTICAL_PSNR_DB = 99.0


def calibrate(pipe, seeds: int = 8, keep: float = 0.5, scales: int = 3, prompts: Optional[Sequence[str]] = None,
              log: Callable[[str], None] = print, taus: Optional[Sequence[float]] = TAU_CANDIDATES,
              starts: Sequence[int] = START_CANDIDATES, **call_kwargs) -> dict:
    """Measure the capture rate of every layer (or block group, for a family whose preset observes
    groups) of ``pipe``'s model over seeds 0..``seeds``−1 (:func:`measure_capture`), choose the best
    one and set it as the pipeline's SparseVAR calibration (``pipe.sparsevar_preset`` applies it;
    ``save_pretrained`` keeps it; :func:`write_calibration` stores it in a folder). Text-to-image
    pipelines need ``prompts``, one per seed; ``call_kwargs`` go to every call. A model whose
    residuals all have the same norm (Infinity's bits) cannot be ranked by the capture rate: its
    units are ranked by the pictures instead (:func:`rank_by_psnr`). Then, unless ``taus`` is empty,
    choose the threshold and first pruned scale over the same seeds and conditions
    (:func:`calibrate_tau`): the fastest of ``taus`` × ``starts`` at which SparseVAR observing that
    unit reaches the baselines' front. Returns the calibration: ``{"block", "granularity"[, "tau",
    "start_scale"], "measured": {...}}``. Every step samples with the family's defaults; a sampling or
    run argument in ``call_kwargs`` is refused (ValueError)."""
    fixed = sorted(set(call_kwargs) & {"guidance_scale", "top_k", "top_p", "temperature", "generator", "output_type",
                                       "policies", "random_seed", "random_draws", "num_images_per_prompt"})
    if fixed:
        raise ValueError(f"calibrate: {', '.join(fixed)} cannot be set: every measurement samples with the family's "
                         f"defaults (pipe.DEFAULTS); pass only size arguments such as height=, width=")
    m = measure_capture(pipe, range(seeds), keep=keep, scales=scales, prompts=prompts, **call_kwargs)
    family = pipe.PRESET_FAMILY
    kind = SPARSEVAR_PRESETS[family].granularity if family in SPARSEVAR_PRESETS else "layer"
    formula = preset_unit(m["info"], family)
    scale_names = " ".join(f"{h}x{w}" for _, (h, w) in m["scales"])
    rows = summarize(m)
    log(format_report(m, rows, formula,
                      f"calibrate: {seeds} seeds, keep {keep:g}, pruned scales {scale_names}; "
                      f"capture = share of the scale's residual energy in the kept tokens", label="formula"))
    if m["constant_energy"]:
        unit, measured = rank_by_psnr(pipe, seeds, keep, scales, kind, formula, prompts=prompts, log=log,
                                      **call_kwargs)
    else:
        unit, measured = _capture_choice(m, rows, kind, formula, seeds, keep, log)
    calibration = {"block": unit[1], "granularity": unit[0], "measured": measured}
    pipe.set_sparsevar_calibration(calibration)
    if taus:
        found = calibrate_tau(pipe, seeds=seeds, taus=taus, log=log, starts=starts, prompts=prompts, **call_kwargs)
        measured["tau"] = {k: v for k, v in found.items() if k not in ("tau", "start_scale")}
        if found["tau"] is not None:
            calibration.update(tau=found["tau"], start_scale=found["start_scale"])
        pipe.set_sparsevar_calibration(calibration)
    return calibration


def _capture_choice(m: dict, rows: list[dict], kind: str, formula, seeds: int, keep: float,
                    log: Callable[[str], None]) -> tuple[tuple[str, int], dict]:
    """The unit of ``kind`` with the highest capture rate, and what was measured."""
    b = best_unit(m, kind)
    unit = m["units"][b]
    per_seed = m["capture"].mean(2)                                                     # (N, U, S) → (N, U)
    measured = {
        "what": "capture rate: share of a pruned scale's residual energy held by the kept tokens chosen by the "
                "unit's change map at the previous scale (sparsevar bench observe)",
        "seeds": seeds, "keep": keep, "scales": [f"{h}x{w}" for _, (h, w) in m["scales"]],
        "capture": rows[b]["capture"], "ci95": rows[b]["ci95"], "random": rows[b]["random"],
        "oracle": rows[b]["oracle"],
        "per_unit": {unit_label(u): r["capture"] for u, r in zip(m["units"], rows) if u[0] == kind},
    }
    if formula is not None and formula[0] == kind:
        p = m["units"].index(formula)
        diff, ci = mean_ci95((per_seed[:, b] - per_seed[:, p]).tolist())
        measured.update(formula_unit=unit_label(formula), formula_capture=rows[p]["capture"],
                        gain_over_formula=round(diff, 4), gain_ci95=round(ci, 4))
    text = (f"calibrate: observe {kind} {unit[1]} (captures {rows[b]['capture']:.3f} ± {rows[b]['ci95']:.3f} of "
            f"the residual energy at keep {keep:g}; random {rows[b]['random']:.3f}, oracle {rows[b]['oracle']:.3f})")
    if "formula_unit" in measured:
        text += (f"; the family's formula {kind} {measured['formula_unit']} captures {measured['formula_capture']:.3f}"
                 f" (best − formula {measured['gain_over_formula']:+.3f} ± {measured['gain_ci95']:.3f}, paired)")
    log(text)
    return unit, measured


def rank_by_psnr(pipe, seeds: int, keep: float, scales: int, kind: str, formula=None,
                 prompts: Optional[Sequence[str]] = None, log: Callable[[str], None] = print,
                 **call_kwargs) -> tuple[tuple[str, int], dict]:
    """The unit (layer or block group, ``kind``) to observe, ranked by the pictures: for seeds
    0..``seeds``−1 (classes, or ``prompts``, one per seed) SparseVAR keeping ``keep`` of the tokens on
    the last ``scales`` scales (over ``pipe.sparsevar_preset``) observes each unit in turn, and the
    unit whose pictures have the highest mean PSNR against dense wins (a picture equal to dense counts
    as :data:`IDENTICAL_PSNR_DB`). The measure for a model whose residuals all have one norm, where
    the capture rate says nothing; it costs seeds × (units + 1) generations. Returns (unit, what was
    measured), with the formula unit (``formula``) compared seed by seed."""
    from .bench_quality import against_dense
    info = pipe.adapter().model_info()
    count = info.layer_groups if kind == "group" else info.num_layers
    base = replace(pipe.sparsevar_preset, keep_ratio=float(keep), start_scale=-int(scales), granularity=kind)
    units = [(kind, i) for i in range(count)]
    runs = [(u, [SparseVARPolicy(replace(base, block=u[1]))]) for u in units]
    log(f"calibrate: ranking the {count} {kind}s by PSNR against dense instead: SparseVAR keep {keep:g} on the last "
        f"{scales} scales observing each in turn, {seeds} seeds")
    drawn = against_dense(pipe, range(seeds), runs, log=log, prompts=prompts, **call_kwargs)
    per_seed = {u: [min(ps, IDENTICAL_PSNR_DB) for _, ps in drawn[u]] for u in units}
    stats = {u: mean_ci95(v) for u, v in per_seed.items()}
    unit = max(units, key=lambda u: stats[u][0])
    for u in units:
        mark = "   <- observed" if u == unit else ("   formula" if u == formula else "")
        log(f"  {kind} {u[1]:3d}  {stats[u][0]:6.2f} ± {stats[u][1]:.2f} dB{mark}")
    measured = {
        "what": f"PSNR against dense of SparseVAR keep {keep:g} on the last {scales} scales observing the unit, same "
                f"seeds (every residual of this model has one norm, so the capture rate cannot rank units)",
        "seeds": seeds, "keep": keep, "scales": scales, "psnr_db": round(stats[unit][0], 3),
        "ci95_db": round(stats[unit][1], 3),
        "per_unit_psnr_db": {str(u[1]): round(stats[u][0], 3) for u in units},
    }
    text = f"calibrate: observe {kind} {unit[1]} ({stats[unit][0]:.2f} ± {stats[unit][1]:.2f} dB against dense)"
    if formula is not None and formula[0] == kind:
        diff, ci = mean_ci95([a - b for a, b in zip(per_seed[unit], per_seed[formula])])
        measured.update(formula_unit=str(formula[1]), formula_psnr_db=round(stats[formula][0], 3),
                        gain_over_formula_db=round(diff, 3), gain_ci95_db=round(ci, 3))
        text += (f"; the family's formula {kind} {formula[1]}: {stats[formula][0]:.2f} dB (best − formula "
                 f"{diff:+.2f} ± {ci:.2f} dB, paired)")
    log(text)
    return unit, measured


def baseline_front(points: Sequence[tuple[float, float]]):
    """(front, psnr_at): the Pareto front of the baselines' (FLOP speed-up, PSNR) ``points``,
    ascending in speed-up (each point faster and lower in PSNR than the one before), and the PSNR
    that mixing the two front points around a speed-up x reaches (linear between them; the first
    point's PSNR below it; None beyond the fastest point: nothing there to compare with)."""
    front: list[tuple[float, float]] = []
    for sp, ps in sorted(points, key=lambda t: (-t[0], -t[1])):                    # fastest first
        if not front or ps > front[-1][1]:
            front.append((sp, ps))
    front.reverse()

    def psnr_at(x: float) -> Optional[float]:
        if not front or x > front[-1][0]:
            return None
        if x <= front[0][0]:
            return front[0][1]
        for (s0, p0), (s1, p1) in zip(front, front[1:]):
            if s0 <= x <= s1:
                return p0 + (p1 - p0) * (x - s0) / (s1 - s0)
        return None
    return front, psnr_at


def calibrate_tau(pipe, seeds: int = 8, taus: Sequence[float] = TAU_CANDIDATES,
                  baselines: Sequence[str] = TAU_BASELINES, log: Callable[[str], None] = print,
                  starts: Sequence[int] = START_CANDIDATES, prompts: Optional[Sequence[str]] = None,
                  **call_kwargs) -> dict:
    """SparseVAR's threshold and first pruned scale for ``pipe``, by measurement: for seeds
    0..``seeds``−1 (class seed % num_classes, or for a text-to-image pipeline ``prompts``, one per
    seed; the pipeline's sampling defaults; ``call_kwargs`` to every call) the dense
    picture, then SparseVAR at each of ``taus`` from each of ``starts`` (over ``pipe.sparsevar_preset``:
    its observed layer; starts the model cannot take are left out) and each of ``baselines``; per
    setting the mean PSNR against dense (a picture identical to dense counts as
    :data:`IDENTICAL_PSNR_DB`) and the mean FLOP speed-up. The chosen setting is the fastest that
    leaves tokens out (FLOP speed-up above 1) and whose PSNR is at least the baselines' front at its
    speed-up (:func:`baseline_front`): no mix of the
    baselines is both as fast and closer to dense. Returns ``{"tau", "start_scale"`` (None when no
    setting reaches the front)``, "what", "seeds", "settings": {name: [flop speed-up, psnr]},
    "front"}``; SparseVAR settings are named as ``bench quality`` names them (``tau0.5-from-2``)."""
    from dataclasses import replace

    from .bench_quality import against_dense, parse_setting
    base = pipe.sparsevar_preset
    info = pipe.adapter().model_info()
    candidates, runs = {}, []
    for start in starts:
        for t in taus:
            policy = SparseVARPolicy(replace(base, tau=float(t), keep_ratio=None, start_scale=int(start)))
            try:
                policy.validate(info)
            except ValueError:
                continue                                   # a start scale this schedule cannot take
            name = f"tau{t:g}-from-{-int(start)}"
            candidates[name] = (float(t), int(start))
            runs.append((name, [policy]))
    if not candidates:
        raise ValueError(f"calibrate: none of the start scales {list(starts)} fits this model's "
                         f"{info.schedule.num_scales} scales")
    runs += [(name, parse_setting(name).on_model(pipe).policies()) for name in baselines]
    drawn = against_dense(pipe, range(seeds), runs, log=log, prompts=prompts, **call_kwargs)
    values = {name: ([sp for sp, _ in per_seed], [min(ps, IDENTICAL_PSNR_DB) for _, ps in per_seed])
              for name, per_seed in drawn.items()}
    settings = {name: [round(statistics.fmean(sp), 3), round(statistics.fmean(ps), 3)]
                for name, (sp, ps) in values.items()}
    front, psnr_at = baseline_front([tuple(settings[name]) for name in baselines])
    chosen = None
    for name in sorted(candidates, key=lambda n: -settings[n][0]):                    # fastest first
        sp, ps = settings[name]
        bar = None if sp <= 1.0 else psnr_at(sp)
        verdict = "computes every token: not a candidate" if sp <= 1.0 else \
            "faster than every baseline: not compared" if bar is None else \
            f"the baselines' front there {bar:.2f} dB: {'reached' if ps >= bar else 'not reached'}"
        t, start = candidates[name]
        log(f"calibrate: tau {t:g} from scale {start}: FLOP speed-up {sp:.2f}x, PSNR {ps:.2f} dB; {verdict}")
        if chosen is None and bar is not None and ps >= bar:
            chosen = name
    log("calibrate: baselines " + ", ".join(f"{name} {settings[name][0]:.2f}x {settings[name][1]:.2f} dB"
                                             for name in baselines))
    if chosen is not None:
        log(f"calibrate: tau {candidates[chosen][0]:g} from scale {candidates[chosen][1]} (the fastest setting that "
            f"reaches the baselines' front)")
    else:
        log("calibrate: no setting reaches the baselines' front; the family's tau and start scale stay")
    tau, start = candidates[chosen] if chosen is not None else (None, None)
    return {"tau": tau, "start_scale": start,
            "what": "mean PSNR against dense and FLOP speed-up per setting; the chosen one is the fastest at least "
                    "as close to dense as the baselines' Pareto front (linear between its points) at its speed-up",
            "seeds": seeds, "settings": settings, "front": [list(p) for p in front]}


def calibrate_drafters(pipe, seeds: int = 8, count: Optional[int] = None, prompts: Optional[Sequence[str]] = None,
                       config=None, log: Callable[[str], None] = print, **call_kwargs) -> dict:
    """ScaleKV's drafter layers (the layers that keep their whole cache) measured on ``pipe``'s
    checkpoint, and set as its ScaleKV calibration (``pipe.scalekv_preset`` uses them;
    ``save_pretrained`` keeps them; :func:`write_calibration` stores them in a folder).

    For every seed 0..``seeds``−1 (class ``seed % num_classes``, or ``prompts``, one per seed): the
    dense picture, ScaleKV (``config``, default the pipeline's preset) with no drafter, and ScaleKV
    with each layer alone as drafter. A layer's gain is its picture's PSNR against dense minus the
    no-drafter picture's, paired by seed; the ``count`` layers with the largest mean gain (default
    ceil(layers / 16): the release's 2 of Infinity-2B's 32 layers and 3 of 8B's 40) become the
    drafters. (The paper found its drafters by how widely a layer's attention spreads; on the demo
    model that measure ranks first a layer whose full cache gains nothing, so this measures the
    pictures instead.) Costs seeds × (layers + 2) generations. Returns the calibration."""
    from ..policies.scalekv import ScaleKVPolicy
    from .bench_quality import against_dense
    info = pipe.adapter().model_info()
    N = info.num_layers
    count = math.ceil(N / 16) if count is None else count
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count < N:
        raise ValueError(f"count={count!r}: give the number of drafter layers, an int from 1 to {N - 1}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 2:
        raise ValueError(f"seeds={seeds!r}: give the number of seeds, an int >= 2 (the gains are paired by seed)")
    check_conditions(pipe, range(seeds), prompts)
    config = pipe.scalekv_preset if config is None else config
    if all(k is None for k in ScaleKVPolicy(config)._keep(info.schedule, info.schedule.num_scales)):
        raise ValueError(f"ScaleKV's settings ({config}) compress no scale of this model's schedule (it never holds "
                         f"more than min_tokens={config.min_tokens}): there is nothing to calibrate")
    variants = [()] + [(i,) for i in range(N)]
    drawn = against_dense(pipe, range(seeds), [(v, [ScaleKVPolicy(replace(config, drafters=v))]) for v in variants],
                          log=log, prompts=prompts, **call_kwargs)
    scores = {v: [min(ps, IDENTICAL_PSNR_DB) for _, ps in drawn[v]] for v in variants}
    base = scores[()]
    gains = {i: mean_ci95([a - b for a, b in zip(scores[(i,)], base)]) for i in range(N)}
    order = sorted(range(N), key=lambda i: -gains[i][0])
    chosen = sorted(order[:count])
    log(f"calibrate --scalekv: {seeds} seeds; PSNR against dense with no drafter {statistics.fmean(base):.2f} dB; "
        f"gain of each layer as the only drafter (paired, 95 % interval):")
    for i in range(N):
        log(f"  layer {i:3d}  {gains[i][0]:+.2f} ± {gains[i][1]:.2f} dB{'   <- drafter' if i in chosen else ''}")
    calibration = {"drafters": chosen, "measured": {
        "what": "PSNR against dense of ScaleKV with one layer as the only drafter, minus that with none, paired "
                "by seed (sparsevar calibrate --scalekv)",
        "seeds": seeds, "budget": list(config.budget) if isinstance(config.budget, tuple) else config.budget,
        "no_drafter_psnr_db": round(statistics.fmean(base), 3),
        "gain_db": {str(i): round(gains[i][0], 3) for i in range(N)},
        "ci95_db": {str(i): round(gains[i][1], 3) for i in range(N)}}}
    pipe.set_scalekv_calibration(calibration)
    return calibration


def write_calibration(folder, calibration: dict, key: str = "sparsevar_calibration") -> Path:
    """Store ``calibration`` (from :func:`calibrate`, or :func:`calibrate_drafters` with ``key``
    ``"scalekv_calibration"``) in a pipeline folder's ``model_index.json`` (replaced atomically; the
    weights are not touched). Returns the file."""
    from ..models.loading import read_json_file
    from ..policies.scalekv import check_scalekv_calibration
    from ..policies.sparsevar import check_calibration
    check = {"sparsevar_calibration": check_calibration, "scalekv_calibration": check_scalekv_calibration}[key]
    path = Path(folder) / "model_index.json"
    index = read_json_file(path, "pipeline folder")
    index[key] = check(calibration)
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


def run_calibrate(model, seeds: int = 8, keep: float = 0.5, scales: int = 3, prompts: Optional[Sequence[str]] = None,
                  device: str = "auto", write: bool = True, log: Callable[[str], None] = print,
                  taus: Optional[Sequence[float]] = TAU_CANDIDATES, starts: Sequence[int] = START_CANDIDATES,
                  drafters: Optional[int] = None, height: Optional[int] = None, width: Optional[int] = None) -> dict:
    """``sparsevar calibrate``: load the pipeline folder ``model`` (any family this package loads; in
    bfloat16 on CUDA, float32 on the CPU), :func:`calibrate` it and, when ``write``, store the
    result in the folder. The table of every layer is printed first (as ``bench observe`` prints
    it). With ``drafters`` (the number of ScaleKV drafter layers; 0: the default count) it measures
    ScaleKV's drafters instead (:func:`calibrate_drafters`). ``height``/``width``: the size an
    Infinity model draws while measured (default 1024²; recorded in ``measured``). Returns the
    calibration."""
    check_settings(keep, scales, seeds)
    check_taus(taus, starts)
    cls, path = folder_pipeline(model)
    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
    if size and cls.__name__ != "InfinityPipeline":
        raise ValueError(f"height={height}, width={width}: only Infinity models draw at a chosen size; {path} holds "
                         f"a {cls.__name__}, which draws at its own")
    if size:
        from ..models.infinity import resolve_resolution
        resolve_resolution(height or 1024, width or 1024)          # a size with no template: ValueError listing them
    text = cls.__name__ in ("InfinityPipeline", "HARTPipeline")
    if text:
        if not prompts:
            raise ValueError(f"{path} holds a text-to-image model ({cls.__name__}): give the prompts to measure with "
                             f"(--prompts FILE, one per line; {seeds} are used, repeated if fewer)")
        prompts = [prompts[i % len(prompts)] for i in range(seeds)]
    elif prompts:
        raise ValueError(f"{path} holds a class-conditional model ({cls.__name__}): it takes no prompts; seed s "
                         f"draws class s % num_classes")
    dev = resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pipe = cls.from_pretrained(path, dtype=dtype).to(dev)
    pipe.set_progress_bar_config(disable=True)
    if drafters is not None:
        calibration = calibrate_drafters(pipe, seeds=seeds, count=drafters or None, prompts=prompts, log=log, **size)
        if size:
            calibration["measured"]["size"] = [height or 1024, width or 1024]
        if write:
            log(f"calibrate: written to {write_calibration(model, calibration, 'scalekv_calibration')} "
                f"(scalekv_calibration); enable_scalekv() on this folder now keeps the whole cache of layers "
                f"{', '.join(map(str, calibration['drafters']))}")
        return calibration
    calibration = calibrate(pipe, seeds=seeds, keep=keep, scales=scales, prompts=prompts, log=log, taus=taus,
                            starts=starts, **size)
    if size:
        calibration["measured"]["size"] = [height or 1024, width or 1024]
    if write:
        tau = f" with tau {calibration['tau']:g} from scale {calibration['start_scale']}" if "tau" in calibration else ""
        log(f"calibrate: written to {write_calibration(model, calibration)} (sparsevar_calibration); "
            f"enable_sparsevar() on this folder now observes {calibration['granularity']} {calibration['block']}{tau}")
    return calibration


def folder_pipeline(model):
    """(pipeline class, folder) of a pipeline folder of any family this package loads, read from
    its ``model_index.json``; nothing is loaded. A missing folder or an unknown class: one line."""
    from .. import pipelines
    from ..models.loading import pipeline_class_name, read_json_file
    if model is None or not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model={model!r}: give a pipeline folder (written by save_pretrained / `sparsevar "
                         f"convert`); the calibration is stored in it")
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model={str(model)!r} is not a folder; give a pipeline folder written by "
                                f"save_pretrained / `sparsevar convert`")
    named = pipeline_class_name(read_json_file(path / "model_index.json", "pipeline folder"))
    if named not in pipelines.__all__ or not named.endswith("Pipeline"):
        raise ValueError(f"{path / 'model_index.json'} names the pipeline {named!r}; calibrate loads VARPipeline, "
                         f"FlexVARPipeline, InfinityPipeline and HARTPipeline folders")
    return getattr(pipelines, named), path


# ---- command line ------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of ``sparsevar bench observe`` (also this module's own ``main``)."""
    p.add_argument("--model", help="VARPipeline folder (default: the demo model that ships with the package)")
    p.add_argument("--seeds", type=int, default=8, metavar="N", help="seeds 0..N-1, one image each (default 8)")
    p.add_argument("--keep", type=float, default=0.5, help="fraction of each pruned scale's tokens kept (default 0.5)")
    p.add_argument("--scales", type=int, default=3, metavar="N", help="pruned scales: the last N (default 3)")
    p.add_argument("--out", type=Path, default=None, metavar="CSV", help="write the table as a CSV here")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, …")
    return p


def run_from_args(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[dict]:
    """``run_observe`` for parsed :func:`add_arguments` arguments (what the CLI calls)."""
    for v, flag, what in ((args.keep, "--keep", "give the fraction of tokens kept, strictly between 0 and 1 "
                                               "(e.g. 0.5)"),
                          (args.scales, "--scales", "give the number of pruned final scales, at least 1 (e.g. 3)"),
                          (args.seeds, "--seeds", "give the number of seeds, at least 1 (e.g. 8)")):
        bad = not (0.0 < v < 1.0) if flag == "--keep" else v < 1
        if bad:
            raise ValueError(f"{flag} {v}: {what}")
    try:
        return run_observe(model=args.model, seeds=args.seeds, keep=args.keep, scales=args.scales, out=args.out,
                           device=args.device, log=log)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("scales="):                  # the model's own bound, found once it is loaded
            msg = "--scales " + msg[len("scales="):]
        raise ValueError(msg) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="python -m sparsevar.benchmarks.bench_observe",
                                              description="Capture rate of every layer's change map: which "
                                                          "layer SparseVAR should observe."))
    args = p.parse_args(argv)
    try:
        run_from_args(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"bench observe: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["LayerTaps", "add_arguments", "best_unit", "capture_rate", "check_settings", "format_report",
           "kept_count", "main", "measure_capture", "preset_unit", "run_from_args", "run_observe",
           "summarize", "top_share", "unit_label"]

if __name__ == "__main__":
    sys.exit(main())
