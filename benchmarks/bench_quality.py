"""Quality benchmark (issues #7, #34): how far each acceleration setting moves the picture, and what it buys.

    sparsevar bench quality --settings sparsevar-keep0.5 fastvar-preset skip-last-1 --seeds 16
    python -m sparsevar.benchmarks.bench_quality --device cuda

For every seed (class ``seed % num_classes`` unless given) the model generates once dense and once
per setting with the same generator seed, so every difference comes from the setting. Per setting
it reports, against dense:

- ``psnr_db`` / ``ssim``: mean over seeds (:mod:`.metrics`: PSNR over RGB with data range 1, ``inf``
  for identical pictures; SSIM with an 11×11 Gaussian window, σ = 1.5, per RGB channel and averaged);
  ``psnr_ci95``: the half-width of the mean's 95 % Student-t interval over seeds
  (:func:`.metrics.mean_ci95`; nan when a seed is inf or there is one seed);
- ``teacher_psnr_db`` / ``teacher_psnr_ci95``: the teacher-forced PSNR, where each scale the
  setting accelerates is computed on dense's history and only its own error counts. PSNR against
  dense charges a setting for everything its changes at one scale do to the later ones (other
  tokens drawn, so other sampling noise), which favours settings that touch only the last scale.
  For every scale k from the first one the setting changes in its own run (skips, runs without the
  unconditional half, or runs on fewer tokens) to the last (:func:`teacher_scales`), one more
  generation with the same seed in which the setting acts at scale k only (:class:`_AtOneScale`:
  before k its policies only observe and store, e.g. SparseVAR's change map and logits, FastVAR's
  cache; the run stops after k) gives the latent after k; its latents before k are checked to equal
  dense's bit for bit. The teacher-forced latent f_dense + Σ_k (f_k − f_dense,k) (f_dense,k:
  dense's latent after k; a skipped scale adds nothing, so its term is minus its dense residual) is
  decoded and compared with the dense picture; inf where the setting changes no scale. Mean and
  interval as for ``psnr_db``; ``teacher_scales`` lists the scales measured (from the end, -1 = last);
- ``classifier_acc``: the share of the setting's pictures a classifier (the demo model's
  ``classifier.safetensors``; :func:`load_classifier`) names as their class; ``dense_classifier_acc``
  the same for the dense pictures (the same in every row); nan without a classifier;
- ``speedup``: the scale loop's measured time (sum of the per-scale ms in the generation's stats,
  CUDA events on a GPU), dense / accelerated per seed, median over seeds, after ``warmup``
  untimed generations of every setting; ``speedup_e2e`` the same for the whole call with decode;
- ``flop_speedup``: what the token counts allow in FLOPs (``pipe.flop_speedup``), mean over seeds;
- ``kept_ratio``: tokens computed / dense tokens, mean over seeds (a scale run without the
  unconditional half still counts all its tokens, so cond-only settings show 1.0 here).

It writes into the output folder ``quality.csv`` (one row per setting), ``quality_seeds.csv`` (one
row per setting and seed: its PSNR, teacher-forced PSNR, SSIM, FLOP speed-up, kept ratio and the
classes the classifier named for it and for dense, empty without a classifier; for paired
comparisons of settings), ``quality.png`` (PSNR against measured speed-up, one marker per method
family, 95 % intervals as bars; drawn with PIL), ``quality_teacher.png`` (teacher-forced PSNR
against FLOP speed-up) and ``grid_<setting>.png`` (rows: the first seeds; columns: dense |
accelerated | amplified absolute difference). Every file is written to a temporary name and
renamed, so an interrupted run leaves no half-written file.

Settings are named; several join with "+" (``sparsevar-keep0.5+skip-last-1``). The names:
:func:`describe_settings` / ``--list-settings``. SparseVAR's keep and tau forms start at the VAR
preset's start scale unless ``-from-<N>`` names another (``sparsevar-keep0.5-from-3``), so their rows
are comparable.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont
import torch

from ..engine.contract import HOOKS, Policy, PolicyStack, ScalePlan
from ..engine.state import SamplingSettings
from ..pipelines.defaults import VAR_DEFAULTS
from ..policies.fastvar import FASTVAR_PRESETS, FastVARConfig, FastVARPolicy
from ..policies.scale_skip import ScaleSkipConfig, ScaleSkipPolicy
from ..policies.sparsevar import SPARSEVAR_PRESETS, SparseVARConfig, SparseVARPolicy
from ..policies.sparvar import SPARVAR_PRESETS, SparVARConfig, SparVARPolicy
from ..policies.scalekv import SCALEKV_PRESETS, ScaleKVConfig, ScaleKVPolicy
from ._results import atomic_write, write_csv
from .metrics import mean_ci95, psnr, ssim

FAMILY = "var"                          # preset family of the models this harness loads (VARPipeline)

# ---- settings -----------------------------------------------------------------------------------------
_NUM = r"(\d+(?:\.\d+)?)"


@dataclass(frozen=True)
class QualitySetting:
    """One point of the sweep: the policy configs a named setting enables (None = that method off).

    name: the setting as written ("sparsevar-keep0.5+skip-last-1"); family: "sparsevar", "fastvar",
    "sparvar", "scalekv", "skip" (scale skipping and cond-only scales) or "combo" (parts from several
    families).
    """

    name: str
    family: str
    sparsevar: Optional[SparseVARConfig] = None
    fastvar: Optional[FastVARConfig] = None
    scale_skip: Optional[ScaleSkipConfig] = None
    sparvar: Optional[SparVARConfig] = None
    scalekv: Optional[ScaleKVConfig] = None
    sparsevar_fields: tuple = ()             # the SparseVAR fields the name sets; the rest are the preset's
    scalekv_fields: tuple = ()               # likewise for ScaleKV

    def on_model(self, pipe) -> "QualitySetting":
        """This setting over ``pipe``'s own SparseVAR and ScaleKV presets (``pipe.sparsevar_preset``,
        ``pipe.scalekv_preset``: the family's, with what the checkpoint's calibration chose — the
        observed layer, the drafter layers), keeping the fields the name sets."""
        out = self
        if self.sparsevar is not None:
            chosen = {f: getattr(self.sparsevar, f) for f in self.sparsevar_fields}
            out = replace(out, sparsevar=replace(pipe.sparsevar_preset, **chosen))
        if self.scalekv is not None:
            chosen = {f: getattr(self.scalekv, f) for f in self.scalekv_fields}
            out = replace(out, scalekv=replace(pipe.scalekv_preset, **chosen))
        return out

    def policies(self) -> list[Policy]:
        """Fresh policy objects for the pipeline's per-call ``policies=`` argument."""
        out: list[Policy] = []
        if self.sparsevar is not None:
            out.append(SparseVARPolicy(self.sparsevar))
        if self.fastvar is not None:
            out.append(FastVARPolicy(self.fastvar))
        if self.sparvar is not None:
            out.append(SparVARPolicy(self.sparvar))
        if self.scalekv is not None:
            out.append(ScaleKVPolicy(self.scalekv))
        if self.scale_skip is not None:
            out.append(ScaleSkipPolicy(self.scale_skip))
        return out

    def describe(self) -> str:
        parts = []
        for label, cfg in (("sparsevar", self.sparsevar), ("fastvar", self.fastvar), ("sparvar", self.sparvar),
                           ("scalekv", self.scalekv), ("scale_skip", self.scale_skip)):
            if cfg is not None:
                fields = ", ".join(f"{k}={v}" for k, v in vars(cfg).items() if k != "backend")
                parts.append(f"{label}({fields})")
        return " + ".join(parts)


def _start(m) -> dict:
    """The start scale a ``-from-<N>`` suffix names (N-th scale from the end); none: the preset's."""
    if m[2] is None:
        return {}
    n = int(m[2])
    if n < 1:
        raise ValueError(f"-from-{n}: N counts scales from the end, 1 = the last scale; give N >= 1")
    return {"start_scale": -n}


def _block(m) -> dict:
    """The observed layer a ``-block<L>`` suffix names (what ``bench observe`` measures); none: the preset's."""
    return {} if m[3] is None else {"block": int(m[3])}


def _sparsevar(**chosen) -> dict:
    """A SparseVAR part: the family preset with ``chosen`` fields, and their names (``on_model`` puts
    them over the loaded model's own preset)."""
    return {"sparsevar": replace(SPARSEVAR_PRESETS[FAMILY], **chosen), "sparsevar_fields": tuple(chosen)}


def _scalekv(**chosen) -> dict:
    """A ScaleKV part: the family preset with ``chosen`` fields, and their names (``on_model`` puts them
    over the loaded model's own preset, whose drafter layers its calibration chose)."""
    return {"scalekv": replace(SCALEKV_PRESETS[FAMILY], **chosen), "scalekv_fields": tuple(chosen)}


def _alpha(m) -> dict:
    """The anchor stride an ``-alpha<A>`` suffix names; none: the preset's."""
    if m[4] is None:
        return {}
    a = int(m[4])
    if a < 1:
        raise ValueError(f"-alpha{a}: the anchor stride is a number of tokens, at least 1")
    return {"alpha": a}


def _sparsevar_keep(m) -> dict:
    return _sparsevar(keep_ratio=float(m[1]), **_start(m), **_block(m), **_alpha(m))


def _sparsevar_tau(m) -> dict:
    return _sparsevar(tau=float(m[1]), **_start(m), **_block(m), **_alpha(m))


def _fastvar_ratios(m) -> dict:
    return {"fastvar": FastVARConfig(ratios=tuple(float(r) for r in m[1].split("-")))}


def _skip_last(m) -> dict:
    return {"skip_last": int(m[1])}


def _cond_only_last(m) -> dict:
    n = int(m[1])
    if n < 1:
        raise ValueError("cond-only-last-N needs N >= 1 (the number of final scales run without the "
                         "unconditional half)")
    return {"cond_only_from": -n}


# One registry: (pattern, form shown to users, what it means, builder of its configs).
SETTING_FORMS: tuple = (
    (re.compile(r"sparsevar-preset"), "sparsevar-preset",
     "SparseVAR, the model's preset (pipe.sparsevar_preset: the VAR family's, tau 0.6 from the second-to-last "
     "scale, with the layer and tau `sparsevar calibrate` measured for the checkpoint)",
     lambda m: _sparsevar()),
    (re.compile(rf"sparsevar-keep{_NUM}(?:-from-(\d+))?(?:-block(\d+))?(?:-alpha(\d+))?"),
     "sparsevar-keep<R>[-from-<N>][-block<L>][-alpha<A>]",
     "SparseVAR preset keeping a fixed share R in (0, 1] of each pruned scale (1.0 = neutral); from the "
     "preset's start scale, or with -from-N from the N-th scale from the end; observing the model's preset layer, or "
     "with -block<L> layer L (the one `bench observe` ranks first); anchors every 4 tokens (the preset's), or with "
     "-alpha<A> every A", _sparsevar_keep),
    (re.compile(rf"sparsevar-tau{_NUM}(?:-from-(\d+))?(?:-block(\d+))?(?:-alpha(\d+))?"),
     "sparsevar-tau<T>[-from-<N>][-block<L>][-alpha<A>]",
     "SparseVAR preset with change threshold T in [0, 1) (0 keeps every changing token); start scale, "
     "observed layer and anchor stride as for keep", _sparsevar_tau),
    (re.compile(r"fastvar-preset"), "fastvar-preset",
     "FastVAR, the VAR family preset (FASTVAR_PRESETS['var']: prune 50 % / 75 % of the last two scales)",
     lambda m: {"fastvar": FASTVAR_PRESETS[FAMILY]}),
    (re.compile(rf"fastvar-r({_NUM[1:-1]}(?:-{_NUM[1:-1]})*)"), "fastvar-r<R1>-<R2>…",
     "FastVAR with prune ratios of the last scales, earliest first (fastvar-r0.5-0.75 = the preset)",
     _fastvar_ratios),
    (re.compile(r"sparvar(?:-preset)?"), "sparvar-preset | sparvar",
     "SparVAR, the VAR family preset (SPARVAR_PRESETS['var']: decision scale third-last, top_keys 0.2); "
     "'sparvar' alone names it too, as in `bench speed`'s sparvar+skip-last-2",
     lambda m: {"sparvar": SPARVAR_PRESETS[FAMILY]}),
    (re.compile(rf"sparvar-top{_NUM}"), "sparvar-top<K>",
     "SparVAR preset keeping the share K in (0, 1] of the keys at the decision scale (CS4A's top_keys)",
     lambda m: {"sparvar": replace(SPARVAR_PRESETS[FAMILY], top_keys=float(m[1]))}),
    (re.compile(r"sparvar-neutral"), "sparvar-neutral",
     "SparVAR reading every key (SparVARConfig.dense(): all keys, full windows): dense attention through "
     "SparVAR's path", lambda m: {"sparvar": SparVARConfig.dense()}),
    (re.compile(r"scalekv(?:-preset)?"), "scalekv-preset | scalekv",
     "ScaleKV, the model's preset (pipe.scalekv_preset: the VAR family's, Infinity-2B's released budgets on the "
     "last five scale boundaries, with the drafter layers `sparsevar calibrate --scalekv` chose for the checkpoint, "
     "else the first layer)",
     lambda m: _scalekv()),
    (re.compile(rf"scalekv-b?{_NUM}"), "scalekv-b<B> | scalekv-<B>",
     "ScaleKV keeping the share B in (0, 1] of the cached tokens after every scale past 650 cached tokens "
     "(1.0 = neutral)", lambda m: _scalekv(budget=float(m[1]))),
    (re.compile(r"skip-last-(\d+)"), "skip-last-<N>", "skip the last N scales", _skip_last),
    (re.compile(r"cond-only-last-(\d+)"), "cond-only-last-<N>",
     "run the last N scales without the unconditional CFG half", _cond_only_last),
)

# Examples of every form, and what `--settings all` runs.
SETTINGS: tuple[str, ...] = (
    "sparsevar-preset", "sparsevar-keep1.0", "sparsevar-keep0.7", "sparsevar-keep0.5", "sparsevar-keep0.3",
    "sparsevar-keep0.5-from-1", "sparsevar-keep0.5-from-3",
    "sparsevar-tau0.0", "sparsevar-tau0.1", "sparsevar-tau0.3", "sparsevar-tau0.8", "sparsevar-tau0.8-from-3",
    "fastvar-preset", "fastvar-r0.25-0.5", "fastvar-r0.75-0.9",
    "skip-last-1", "skip-last-2", "cond-only-last-1", "cond-only-last-2",
    "sparsevar-keep0.5+skip-last-1", "sparsevar-preset+cond-only-last-2", "fastvar-preset+cond-only-last-2",
    "sparvar-preset", "sparvar-top0.05", "sparvar-preset+skip-last-1", "sparvar-preset+skip-last-2",
)

# The sweep behind the README's quality / speed curves: every method near 1.3x, 1.8x and 2.3x FLOP
# speed-up, and SparseVAR's keep and tau forms from the same start scale (the preset's), plus both
# from the third scale from the end and keep on the last scale only.
DEFAULT_SETTINGS: tuple[str, ...] = (
    "sparsevar-keep0.7", "sparsevar-keep0.5", "sparsevar-keep0.3",
    "sparsevar-keep0.5-from-1", "sparsevar-keep0.5-from-3",
    "sparsevar-tau0.3", "sparsevar-preset", "sparsevar-tau0.8", "sparsevar-tau0.8-from-3",
    "fastvar-preset",
    "skip-last-1", "skip-last-2", "cond-only-last-1",
    "sparsevar-keep0.5+skip-last-1", "sparsevar-preset+cond-only-last-2", "fastvar-preset+cond-only-last-2",
)

FAMILIES = ("sparsevar", "fastvar", "sparvar", "skip", "combo")


def describe_settings() -> str:
    """The setting forms and examples, one per line (what an unknown name's error lists)."""
    forms = "\n".join(f"  {form:<29} {text}" for _, form, text, _ in SETTING_FORMS)
    return (f"setting forms (join several with '+'):\n{forms}\n"
            f"registered settings: {', '.join(SETTINGS)}\n"
            f"default sweep: {', '.join(DEFAULT_SETTINGS)}")


def _parse_part(part: str, name: str) -> tuple[str, dict]:
    for pattern, _form, _text, build in SETTING_FORMS:
        m = pattern.fullmatch(part)
        if m is None:
            continue
        try:
            fields = build(m)
        except ValueError as e:
            raise ValueError(f"setting {name!r}: {part!r} is out of range: {e}") from None
        family = "skip" if "skip_last" in fields or "cond_only_from" in fields else next(iter(fields))
        return family, fields
    hint = " ('dense' is the reference every setting is compared with; it always runs)" if part == "dense" else ""
    where = f" (in {name!r})" if part != name else ""
    raise ValueError(f"unknown setting {part!r}{where} in settings{hint}. Valid settings:\n"
                     f"{describe_settings()}")


def parse_setting(name: str) -> QualitySetting:
    """A :class:`QualitySetting` from its name; parts join with "+". Raises ValueError naming the
    unknown or out-of-range part and listing the valid forms."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a setting must be a non-empty name like 'sparsevar-keep0.5', got {name!r}. "
                         f"Valid settings:\n{describe_settings()}")
    name = name.strip()
    families, configs, skip = set(), {}, {}
    for part in name.split("+"):
        family, fields = _parse_part(part.strip(), name)
        families.add(family)
        if family == "skip":
            for k, v in fields.items():
                if k in skip:
                    raise ValueError(f"setting {name!r} sets {k} twice; give each scale-skip form once")
                skip[k] = v
            continue
        if family in configs:
            raise ValueError(f"setting {name!r} has two {family} parts; combine a method with others, not itself")
        configs.update(fields)
    if "sparsevar" in configs and "fastvar" in configs:
        raise ValueError(f"setting {name!r} combines SparseVAR with FastVAR, which prune the same tokens and cannot "
                         f"be stacked; combine either with skip-last-N or cond-only-last-N")
    if "scalekv" in configs and len({k for k in configs if not k.endswith("_fields")}) > 1:
        raise ValueError(f"setting {name!r} combines ScaleKV with another method; ScaleKV combines with skip-last-N "
                         f"and cond-only-last-N only")
    if "sparvar" in configs and ("sparsevar" in configs or "fastvar" in configs):
        raise ValueError(f"setting {name!r} combines SparVAR with a method that computes a token subset, which "
                         f"leaves holes in the cache SparVAR selects keys from; combine it with skip-last-N or "
                         f"cond-only-last-N")
    scale_skip = ScaleSkipConfig(**skip) if skip else None
    family = next(iter(families)) if len(families) == 1 else "combo"
    return QualitySetting(name=name, family=family, sparsevar=configs.get("sparsevar"),
                          fastvar=configs.get("fastvar"), scale_skip=scale_skip, sparvar=configs.get("sparvar"),
                          scalekv=configs.get("scalekv"),
                          sparsevar_fields=configs.get("sparsevar_fields", ()),
                          scalekv_fields=configs.get("scalekv_fields", ()))


def parse_settings(settings: Optional[Sequence[str]]) -> list[QualitySetting]:
    """Parse a list of names (None → :data:`DEFAULT_SETTINGS`; ``["all"]`` → :data:`SETTINGS`)."""
    if settings is None:
        settings = DEFAULT_SETTINGS
    if isinstance(settings, str):
        settings = [settings]
    settings = list(settings)
    if settings == ["all"]:
        settings = list(SETTINGS)
    if not settings:
        raise ValueError(f"settings is empty: give at least one setting name. Valid settings:\n{describe_settings()}")
    parsed = [parse_setting(s) for s in settings]
    seen = set()
    for s in parsed:
        if s.name in seen:
            raise ValueError(f"settings lists {s.name!r} twice; give each setting once")
        seen.add(s.name)
    return parsed


# ---- model, seeds, classes ---------------------------------------------------------------------------------
def resolve_device(device) -> torch.device:
    """The harnesses' device rule: "auto" is CUDA when available, else the CPU; anything else must name
    a device this machine has (ValueError naming the value otherwise)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; use 'auto', 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device is available on this machine; use device='cpu'")
    return dev


def load_model(model=None, device="auto", dtype: Optional[torch.dtype] = None):
    """(pipeline, model name, loaded_here) for ``run_quality``'s ``model`` argument: None = the demo
    model, a folder path, or a ``VARPipeline`` used as is (moved only when ``device`` names one)."""
    from ..pipelines.var_pipeline import VARPipeline

    if isinstance(model, VARPipeline):
        if dtype is not None:
            raise ValueError(f"dtype={dtype} applies when the harness loads the model; convert a VARPipeline you "
                             f"pass yourself (pipe.transformer.to(dtype)) and leave dtype=None")
        if device != "auto":
            model.to(resolve_device(device))
        cfg = model.transformer.config
        return model, f"var-d{cfg.depth}-w{cfg.embed_dim}-{16 * cfg.patch_nums[-1]}px", False
    dev = resolve_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if model is None:
        from ..demo import DEMO_MODEL_DIR
        if not (Path(DEMO_MODEL_DIR) / "model_index.json").is_file():
            raise FileNotFoundError(f"the demo model is missing from {DEMO_MODEL_DIR} (a partial install?): "
                                    f"reinstall the package, or pass model=FOLDER (--model FOLDER)")
        path, name = Path(DEMO_MODEL_DIR), "demo"
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_dir():
            raise FileNotFoundError(f"model={str(model)!r} is not a folder; pass a VARPipeline folder written by "
                                    f"save_pretrained / `sparsevar convert`, or None for the demo model")
        name = path.resolve().name
    else:
        raise TypeError(f"model must be None (the demo model), a folder path or a VARPipeline, got "
                        f"{type(model).__name__}")
    pipe = VARPipeline.from_pretrained(path, dtype=dtype).to(dev)
    return pipe, name, True


def _seed_list(seeds) -> list[int]:
    if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, bool):
        raise ValueError(f"seeds={seeds!r}: pass a sequence of seeds, e.g. range({seeds}) for {seeds} seeds")
    out = list(seeds)
    if not out:
        raise ValueError("seeds is empty: pass at least one seed, e.g. range(16)")
    for s in out:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"seeds must be ints >= 0, got {s!r} in seeds")
    if len(set(out)) != len(out):
        raise ValueError(f"seeds has repeats ({out}); each seed is one sample, give each once")
    return [int(s) for s in out]


def _class_list(pipe, classes, seeds: list[int]) -> list[int]:
    if classes is None:
        return [s % pipe.num_classes for s in seeds]
    if isinstance(classes, (int, str, np.integer)):
        return pipe.get_label_ids([classes] * len(seeds))
    classes = list(classes)
    if len(classes) != len(seeds):
        raise ValueError(f"classes has {len(classes)} entries for {len(seeds)} seeds; give one class per seed, "
                         f"one class for all, or None (class = seed % {pipe.num_classes})")
    return pipe.get_label_ids(classes)


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine() or "cpu"


# ---- the run -------------------------------------------------------------------------------------------------
@dataclass
class _Sample:
    image_13HW: torch.Tensor       # float32 in [0, 1], on the CPU
    loop_ms: float
    e2e_ms: float
    flop_speedup: float
    kept_ratio: float
    scales: list                   # the generation's ScaleStats, one per scale
    latents: dict                  # si → latent after scale si (dense runs; else empty), on the model's device


def _generate(pipe, label, seed: int, policies: list, sampling: SamplingSettings,
              latents: bool = False, **call_kwargs) -> _Sample:
    """One picture of ``label`` (a class id, or a prompt for a text-to-image pipeline) with ``seed``;
    ``call_kwargs`` go to the call (e.g. Infinity's ``height``/``width``)."""
    dev = pipe.transformer.device
    gen = torch.Generator(dev).manual_seed(seed)
    kept: dict = {}

    def keep_latent(_pipe, si, _t, tensors):             # the pipeline hands a copy
        kept[si] = tensors["latent"]
        return tensors

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = pipe([label], guidance_scale=sampling.guidance_scale, top_k=sampling.top_k, top_p=sampling.top_p,
               generator=gen, output_type="pt", policies=policies,
               callback_on_step_end=keep_latent if latents else None,
               callback_on_step_end_tensor_inputs=("latent",) if latents else ("codes",), **call_kwargs)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    e2e_ms = (time.perf_counter() - t0) * 1e3
    st = out.stats[0]
    return _Sample(image_13HW=out.images.detach().float().clamp(0, 1).cpu(), loop_ms=st.transformer_ms,
                   e2e_ms=e2e_ms, flop_speedup=pipe.flop_speedup(st), kept_ratio=st.tokens_computed / st.tokens,
                   scales=list(st.scales), latents=kept)


def against_dense(pipe, seeds: Sequence[int], runs: Sequence[tuple],
                  log: Optional[Callable[[str], None]] = None, prompts: Optional[Sequence[str]] = None,
                  **call_kwargs) -> dict:
    """For every seed (class ``seed % num_classes``, or for a text-to-image pipeline ``prompts[j]``
    for the j-th seed; the pipeline's sampling defaults; ``call_kwargs`` to every call) the dense
    picture, then one picture per ``(key, policies)`` of ``runs``: ``{key: [(FLOP speed-up, PSNR
    against dense in dB), one per seed]}`` (PSNR inf where the picture equals dense). The policy
    objects are reused across seeds, as every call starts a fresh run. ``log`` hears of each seed."""
    seeds = list(seeds)
    conds = check_conditions(pipe, seeds, prompts)
    d = pipe.DEFAULTS
    sampling = SamplingSettings(guidance_scale=d.guidance_scale, top_k=d.top_k, top_p=d.top_p)
    out: dict = {key: [] for key, _ in runs}
    for seed, cond in zip(seeds, conds):
        dense = _generate(pipe, cond, seed, [], sampling, **call_kwargs).image_13HW
        for key, policies in runs:
            got = _generate(pipe, cond, seed, policies, sampling, **call_kwargs)
            out[key].append((got.flop_speedup, float(psnr(got.image_13HW, dense)[0])))
        if log is not None:
            log(f"  seed {seed} done")
    return out


def check_conditions(pipe, seeds: Sequence[int], prompts: Optional[Sequence[str]]) -> list:
    """What each seed draws: class ``seed % num_classes`` for a class-conditional pipeline (which
    takes no prompts), ``prompts[j]`` for the j-th seed of a text-to-image one (one prompt per seed
    needed). ValueError naming ``prompts`` otherwise."""
    if hasattr(pipe, "num_classes"):
        if prompts is not None:
            raise ValueError(f"prompts={prompts!r}: a class-conditional pipeline takes no prompts; seed s draws "
                             f"class s % num_classes")
        return [seed % pipe.num_classes for seed in seeds]
    if prompts is None or isinstance(prompts, str) or len(prompts) != len(seeds) \
            or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(f"prompts={prompts!r}: a text-to-image pipeline needs a list of one non-empty prompt per "
                         f"seed ({len(seeds)})")
    return list(prompts)


# ---- the teacher-forced measure -------------------------------------------------------------------------------
_OUTPUT_HOOKS = frozenset({"attention", "post_hidden", "post_residual"})      # change their scale's output only


class _AtOneScale(Policy):
    """``inner`` acting at scale ``k`` only, every other scale dense, and the generation stopped
    after ``k`` (every later scale planned as skipped).

    Before ``k`` the inner policy still plans (its state follows the scales it saw) and keeps the
    hooks that only read and store — ``observe``, ``after_scale``, and ``wrap_sublayer`` or
    ``attention`` where its plan declares state ``writes`` (FastVAR's cache scale stores every
    branch output while running the scale whole; SparVAR's decision scale attends densely while it
    picks its keys) — but its subset, skip and cond-only requests and its output hooks are
    dropped. Whether that left the scale dense is not assumed: :func:`_teacher_latent` checks the
    latents bit for bit. At ``k`` its plan passes unchanged. It takes the inner policy's name (its
    state lives under that name) and conflicts.
    """

    def __init__(self, inner: Policy, k: int):
        self.inner, self.k = inner, k
        self.name, self.incompatible = inner.name, inner.incompatible
        inner_key = getattr(inner, "config", None)
        self.config = ("teacher-forced", k, inner_key if inner_key is not None else id(inner))
        self.own = frozenset(h for h in HOOKS if h != "plan_scale"
                             and getattr(type(inner), h) is not getattr(Policy, h))

    def validate(self, info) -> None:
        self.inner.validate(info)

    def begin(self, run) -> None:
        self.inner.begin(run)

    def plan_scale(self, si: int, run) -> Optional[ScalePlan]:
        if si > self.k:
            return ScalePlan(skip=True)
        q = self.inner.plan_scale(si, run)
        hooks = self.own if q is None or q.hooks is None else q.hooks & self.own
        if si == self.k:
            return ScalePlan(hooks=hooks) if q is None else replace(q, hooks=hooks)
        stores = hooks - _OUTPUT_HOOKS
        if q is None or not q.writes:
            stores -= {"wrap_sublayer"}
        else:                                        # in-layer hooks that store state as the scale runs
            stores |= hooks & {"attention"}
        if q is None:
            return ScalePlan(hooks=stores)
        return ScalePlan(hooks=stores, layers=q.layers, writes=q.writes, reads=q.reads)

    def wrap_sublayer(self, sub, x_RlC, run):
        return self.inner.wrap_sublayer(sub, x_RlC, run)

    def observe(self, si, unit, x_in, x_out, run) -> None:
        self.inner.observe(si, unit, x_in, x_out, run)

    def attention(self, ctx, q_RHld, k_RHLd, v_RHLd, run):
        return self.inner.attention(ctx, q_RHld, k_RHLd, v_RHLd, run)

    def post_hidden(self, si, h_RLC, run):
        return self.inner.post_hidden(si, h_RLC, run)

    def post_residual(self, si, residual_BLc, run):
        return self.inner.post_residual(si, residual_BLc, run)

    def after_scale(self, si, guided_logits_BLV, run) -> None:
        self.inner.after_scale(si, guided_logits_BLV, run)


def _changed_scales(acc: _Sample, dense: _Sample) -> list[int]:
    """The scales a setting changed in its own run: skipped, run with fewer rows than dense (no
    unconditional half) or with fewer tokens than the map holds."""
    return [a.si for a, d in zip(acc.scales, dense.scales)
            if a.skipped or a.rows < d.rows or a.tokens_computed < a.tokens or a.keys_read is not None]


def teacher_scales(acc: _Sample, dense: _Sample) -> list[int]:
    """The scales the teacher-forced measure runs: every one from the first the setting changed in
    its own run to the last. Before that scale its own run had dense's history, so its decisions
    there are the teacher-forced ones and changed nothing; after it, a decision taken on dense's
    history may differ from its own, so every later scale is measured."""
    changed = _changed_scales(acc, dense)
    return list(range(changed[0], len(dense.scales))) if changed else []


def _teacher_latent(pipe, label: int, seed: int, make_policies: Callable[[], list], sampling: SamplingSettings,
                    dense: _Sample, scales: Sequence[int], setting: str = "") -> torch.Tensor:
    """f_dense + Σ_k (f_k − f_dense,k): f_k is the latent after scale k of a generation (same seed)
    in which the setting's policies act at scale k only (:class:`_AtOneScale`), f_dense,k dense's.
    A scale the setting skips adds nothing (f_k is then the latent before k). Raises RuntimeError
    when such a generation's latent before k is not dense's bit for bit."""
    last = max(dense.latents)
    f_tf = dense.latents[last].clone()
    dev = pipe.transformer.device
    for k in scales:
        got: dict = {}

        def keep_latent(_pipe, si, _t, tensors):
            got[si] = tensors["latent"]
            return tensors

        out = pipe([label], guidance_scale=sampling.guidance_scale, top_k=sampling.top_k, top_p=sampling.top_p,
                   generator=torch.Generator(dev).manual_seed(seed), output_type="latent",
                   policies=[_AtOneScale(p, k) for p in make_policies()],
                   callback_on_step_end=keep_latent, callback_on_step_end_tensor_inputs=("latent",))
        for si in range(k):
            if si not in got or not torch.equal(got[si], dense.latents[si]):
                raise RuntimeError(
                    f"teacher-forced run of setting {setting!r} at scale {k}, seed {seed}: the latent after scale "
                    f"{si} differs from dense's, so a policy changed the picture before scale {k} through a hook "
                    f"that must only observe or store; the teacher-forced measure cannot use this setting "
                    f"(run with teacher=False / --no-teacher)")
        f_tf += out.images - dense.latents[k]
    return f_tf


@torch.no_grad()
def _decode(pipe, f_hat_BChw: torch.Tensor) -> torch.Tensor:
    """The picture of a VAR latent, (B, 3, H, W) float32 in [0, 1] on the CPU: what the adapter's decode
    does with its accumulated latent."""
    vq = pipe.vqvae
    img_B3HW = vq.fhat_to_img(f_hat_BChw.to(vq.quantize.embedding.weight.dtype)).float()
    return ((img_B3HW + 1) * 0.5).clamp(0, 1).cpu()


# ---- the classifier -------------------------------------------------------------------------------------------
CLASSIFIER_FILE = "classifier.safetensors"


def load_classifier(classifier, model, pipe) -> Optional[torch.nn.Module]:
    """The judge of ``classifier_acc``: None = ``classifier.safetensors`` beside the model when the
    harness loads it from a folder (the demo model ships one; no classifier otherwise), False = none,
    a path to a :class:`~sparsevar.demo.classifier.SceneClassifier` file, or a module mapping images
    (B, 3, H, W) in [0, 1] to class logits (B, K)."""
    from ..demo.classifier import SceneClassifier

    if classifier is False:
        return None
    if isinstance(classifier, torch.nn.Module):
        return classifier.eval()
    if classifier is None:
        if model is None:
            from ..demo import DEMO_MODEL_DIR
            folder = Path(DEMO_MODEL_DIR)
        elif isinstance(model, (str, os.PathLike)):
            folder = Path(model)
        else:
            return None
        classifier = folder / CLASSIFIER_FILE
        if not classifier.is_file():
            return None
    if isinstance(classifier, (str, os.PathLike)):
        if not Path(classifier).is_file():
            raise FileNotFoundError(f"classifier={str(classifier)!r} is not a file; pass a SceneClassifier "
                                    f".safetensors file (the demo's is {CLASSIFIER_FILE} in its folder), or None")
        from safetensors import safe_open
        with safe_open(str(classifier), framework="pt") as f:
            k = f.get_slice("head.weight").get_shape()[0] if "head.weight" in f.keys() else None
        if k != pipe.num_classes:
            raise ValueError(f"classifier={str(classifier)!r} names {k} classes but the model has {pipe.num_classes}; "
                             f"pass the classifier trained for this model, or classifier=False")
        return SceneClassifier.from_file(classifier, pipe.num_classes)
    raise TypeError(f"classifier must be None (the model folder's {CLASSIFIER_FILE}), False (none), a file path or "
                    f"a torch module, got {type(classifier).__name__}")


@torch.no_grad()
def _predict(classifier: Optional[torch.nn.Module], image_13HW: torch.Tensor) -> Optional[int]:
    if classifier is None:
        return None
    dev = next(classifier.parameters(), torch.empty(0)).device
    return int(classifier(image_13HW.to(dev)).argmax(-1)[0])


def _accuracy(predicted: Sequence[Optional[int]], labels: Sequence[int]) -> float:
    if not predicted or predicted[0] is None:
        return math.nan
    return round(sum(p == y for p, y in zip(predicted, labels)) / len(labels), 4)


def _mean_ci(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    m, half = mean_ci95(values)
    return round(m, 3), round(half, 3)


def run_quality(model=None, settings: Optional[Sequence[str]] = None, seeds: Sequence[int] = range(16),
                classes=None, out_dir: Union[str, Path] = Path("benchmarks/results/quality"),
                device: str = "auto", dtype: Optional[torch.dtype] = None,
                guidance_scale: float = VAR_DEFAULTS.guidance_scale, top_k: int = VAR_DEFAULTS.top_k,
                top_p: float = VAR_DEFAULTS.top_p, log: Callable[[str], None] = print, warmup: int = 1,
                grid_seeds: int = 4, diff_gain: float = 4.0, model_name: Optional[str] = None,
                teacher: bool = True, classifier=None) -> list[dict]:
    """Generate dense and accelerated images at the same seeds; measure quality and speed per setting.

    Args:
        model: None (the demo model that ships with the package), a VARPipeline folder, or a
            ``VARPipeline`` used as is (its enabled policies are ignored: every call passes its own).
        settings: setting names (module docstring; None = :data:`DEFAULT_SETTINGS`, ["all"] =
            :data:`SETTINGS`). Checked before anything is generated.
        seeds: generator seeds, one image each. classes: None (seed % num_classes), one class id or
            name for all seeds, or one per seed.
        out_dir: folder for quality.csv, quality_seeds.csv, quality.png, quality_teacher.png and
            grid_<setting>.png (created).
        device: "auto" (CUDA when available; for a passed pipeline: where it is), "cpu", "cuda", …
        dtype: transformer weight dtype when loading (None: bfloat16 on CUDA, float32 on CPU).
        guidance_scale, top_k, top_p: sampling, the pipeline's defaults.
        warmup: untimed generations of dense and of every setting before timing (first seed).
        grid_seeds: rows of each grid (the first seeds). diff_gain: factor on |dense − accelerated|.
        model_name: written into the CSV (default: "demo", the folder name, or the size of a pipeline).
        teacher: measure ``teacher_psnr_db`` (module docstring; one more generation per seed and
            measured scale, up to that scale); False leaves its columns nan. SparVAR settings leave
            them nan too: at its decision scale it both changes the output (CSLA layers) and stores
            what later scales read (CS4A layers), so no run has dense's history and its state.
        classifier: the judge of ``classifier_acc`` (:func:`load_classifier`: None = the model
            folder's ``classifier.safetensors``, False = none, a file, or a module); without one
            the accuracy columns are nan.
    Returns:
        The CSV rows, one dict per setting.
    """
    parsed = parse_settings(settings)
    seed_list = _seed_list(seeds)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0 (untimed generations per setting), got {warmup!r}")
    if isinstance(grid_seeds, bool) or not isinstance(grid_seeds, int) or grid_seeds < 1:
        raise ValueError(f"grid_seeds must be an int >= 1 (rows of each image grid), got {grid_seeds!r}")
    if not isinstance(teacher, bool):
        raise TypeError(f"teacher must be True or False (measure teacher_psnr_db), got {teacher!r}")
    sampling = SamplingSettings(guidance_scale=guidance_scale, top_k=top_k, top_p=top_p)
    pipe, default_name, loaded = load_model(model, device=device, dtype=dtype)
    name = model_name or default_name
    if loaded:
        pipe.set_progress_bar_config(disable=True)
    labels = _class_list(pipe, classes, seed_list)
    judge = load_classifier(classifier, model, pipe)

    info = pipe.adapter().model_info()
    parsed = [s.on_model(pipe) for s in parsed]        # over the model's presets (what its calibration chose)
    policies: dict[str, list] = {}
    for s in parsed:                                   # every setting checked against the model first
        ps = s.policies()
        try:
            PolicyStack(ps)
            for p in ps:
                p.validate(info)
        except ValueError as e:
            raise ValueError(f"setting {s.name!r} does not fit this model: {e}") from None
        policies[s.name] = ps

    untaught = [s.name for s in parsed if s.sparvar is not None or s.scalekv is not None] if teacher else []
    dev = pipe.transformer.device
    if untaught:
        log(f"quality: no teacher-forced measure for {', '.join(untaught)} (SparVAR's decision scale both changes "
            f"the output and stores what later scales read; ScaleKV changes a scale only through the cache earlier "
            f"scales compressed)")
    log(f"quality: {name} on {_device_name(dev)} ({dev.type}), {len(seed_list)} seeds, {len(parsed)} settings, "
        f"cfg {sampling.guidance_scale} top_k {sampling.top_k} top_p {sampling.top_p}"
        f"{', teacher-forced' if teacher else ''}{', classifier' if judge is not None else ''}")
    t_start = time.perf_counter()
    for _ in range(warmup):
        _generate(pipe, labels[0], seed_list[0], [], sampling)
        for s in parsed:
            _generate(pipe, labels[0], seed_list[0], policies[s.name], sampling)

    keys = ("psnr", "tpsnr", "ssim", "ratio", "ratio_e2e", "ms", "flops", "kept", "pred", "grid", "tscales")
    per: dict[str, dict[str, list]] = {s.name: {k: [] for k in keys} for s in parsed}
    dense_ms, dense_grid, dense_pred = [], [], []
    S = info.schedule.num_scales
    for i, (seed, label) in enumerate(zip(seed_list, labels)):
        # [] = dense, whatever the pipe has enabled; its latents after every scale feed the teacher-forced measure
        dense = _generate(pipe, label, seed, [], sampling, latents=teacher)
        dense_ms.append(dense.loop_ms)
        dense_pred.append(_predict(judge, dense.image_13HW))
        if i < grid_seeds:
            dense_grid.append((seed, label, dense.image_13HW))
        for s in parsed:
            acc = _generate(pipe, label, seed, policies[s.name], sampling)
            r = per[s.name]
            r["psnr"].append(float(psnr(acc.image_13HW, dense.image_13HW)[0]))
            r["ssim"].append(float(ssim(acc.image_13HW, dense.image_13HW)[0]))
            r["ratio"].append(dense.loop_ms / acc.loop_ms if acc.loop_ms > 0 else math.nan)
            r["ratio_e2e"].append(dense.e2e_ms / acc.e2e_ms)
            r["ms"].append(acc.loop_ms)
            r["flops"].append(acc.flop_speedup)
            r["kept"].append(acc.kept_ratio)
            r["pred"].append(_predict(judge, acc.image_13HW))
            if teacher and s.name not in untaught:
                scales = teacher_scales(acc, dense)
                r["tscales"] += scales
                if scales:
                    f_tf = _teacher_latent(pipe, label, seed, s.policies, sampling, dense, scales, s.name)
                    r["tpsnr"].append(float(psnr(_decode(pipe, f_tf), dense.image_13HW)[0]))
                else:
                    r["tpsnr"].append(math.inf)
            if i < grid_seeds:
                r["grid"].append(acc.image_13HW)
        log(f"  seed {seed} (class {label}) done ({time.perf_counter() - t_start:.0f} s)")

    dev_name = _device_name(dev)
    wdtype = str(pipe.transformer.dtype).replace("torch.", "")
    dense_acc = _accuracy(dense_pred, labels)
    rows = []
    for s in parsed:
        r = per[s.name]
        psnr_db, psnr_ci = _mean_ci(r["psnr"])
        t_db, t_ci = _mean_ci(r["tpsnr"])
        row = dict(setting=s.name, family=s.family,
                   psnr_db=psnr_db, psnr_ci95=psnr_ci, psnr_db_min=round(min(r["psnr"]), 3),
                   teacher_psnr_db=t_db, teacher_psnr_ci95=t_ci,
                   teacher_psnr_db_min=round(min(r["tpsnr"]), 3) if r["tpsnr"] else math.nan,
                   ssim=round(statistics.fmean(r["ssim"]), 5), ssim_min=round(min(r["ssim"]), 5),
                   classifier_acc=_accuracy(r["pred"], labels), dense_classifier_acc=dense_acc,
                   speedup=round(statistics.median(r["ratio"]), 3),
                   speedup_e2e=round(statistics.median(r["ratio_e2e"]), 3),
                   flop_speedup=round(statistics.fmean(r["flops"]), 3),
                   kept_ratio=round(statistics.fmean(r["kept"]), 4),
                   loop_ms=round(statistics.median(r["ms"]), 3), dense_loop_ms=round(statistics.median(dense_ms), 3),
                   seeds=len(seed_list), device=dev_name, torch=torch.__version__, model=name, dtype=wdtype,
                   guidance_scale=sampling.guidance_scale, top_k=sampling.top_k, top_p=sampling.top_p,
                   teacher_scales=" ".join(str(si - S) for si in sorted(set(r["tscales"]))),
                   config=s.describe())
        rows.append(row)
        log(f"{s.name:<36} PSNR {row['psnr_db']:6.2f} ± {row['psnr_ci95']:4.2f} dB  teacher "
            f"{row['teacher_psnr_db']:6.2f} ± {row['teacher_psnr_ci95']:4.2f} dB  SSIM {row['ssim']:.4f}  "
            f"classifier {row['classifier_acc']:.0%}  speed-up {row['speedup']:5.2f}x "
            f"(FLOPs {row['flop_speedup']:4.2f}x)  kept {row['kept_ratio']:.0%}")
    log(f"dense: classifier {dense_acc:.0%}; the sweep took {time.perf_counter() - t_start:.0f} s")

    seed_rows = [dict(setting=s.name, seed=seed, label=label, psnr_db=round(per[s.name]["psnr"][i], 4),
                      teacher_psnr_db=round(per[s.name]["tpsnr"][i], 4) if per[s.name]["tpsnr"] else math.nan,
                      ssim=round(per[s.name]["ssim"][i], 6), flop_speedup=round(per[s.name]["flops"][i], 4),
                      kept_ratio=round(per[s.name]["kept"][i], 4), predicted=per[s.name]["pred"][i],
                      dense_predicted=dense_pred[i])
                 for s in parsed for i, (seed, label) in enumerate(zip(seed_list, labels))]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "quality.csv")
    write_csv(seed_rows, out_dir / "quality_seeds.csv")
    title = f"{name} on {dev_name}, {len(seed_list)} seeds"
    plot = plot_quality(rows, title=title, ci="psnr_ci95")
    atomic_write(out_dir / "quality.png", lambda p: plot.save(p, format="PNG"))
    if teacher:
        plot_t = plot_quality(rows, title=f"{title}: teacher-forced", x="flop_speedup", y="teacher_psnr_db",
                              ci="teacher_psnr_ci95", x_label="FLOP speed-up (dense / accelerated)",
                              y_label="teacher-forced PSNR against dense (dB)")
        atomic_write(out_dir / "quality_teacher.png", lambda p: plot_t.save(p, format="PNG"))
    for s in parsed:
        grid = image_grid([(sd, lb, d, a) for (sd, lb, d), a in zip(dense_grid, per[s.name]["grid"])],
                          s.name, diff_gain=diff_gain)
        atomic_write(out_dir / f"grid_{s.name}.png", lambda p, g=grid: g.save(p, format="PNG"))
    log(f"wrote {out_dir / 'quality.csv'}, quality_seeds.csv, quality.png"
        f"{', quality_teacher.png' if teacher else ''} and {len(parsed)} grids")
    return rows


# ---- pictures (PIL only) --------------------------------------------------------------------------------------
FAMILY_STYLE = {            # family → (legend label, RGB, marker)
    "sparsevar": ("SparseVAR", (31, 119, 180), "circle"),
    "fastvar": ("FastVAR", (255, 127, 14), "square"),
    "sparvar": ("SparVAR", (148, 103, 189), "circle"),
    "scalekv": ("ScaleKV", (140, 86, 75), "square"),
    "skip": ("scale skip / cond-only", (44, 160, 44), "triangle"),
    "combo": ("combinations", (214, 39, 40), "diamond"),
}


def _font(size: int):
    try:
        return PIL.ImageFont.load_default(size=size)
    except TypeError:                     # Pillow < 10.1: one bitmap size
        return PIL.ImageFont.load_default()


def _marker(draw, x: float, y: float, kind: str, colour, r: int = 6) -> None:
    if kind == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour, outline=(0, 0, 0))
    elif kind == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=colour, outline=(0, 0, 0))
    elif kind == "triangle":
        draw.polygon([(x, y - r - 1), (x - r - 1, y + r), (x + r + 1, y + r)], fill=colour, outline=(0, 0, 0))
    else:
        draw.polygon([(x, y - r - 2), (x + r + 1, y), (x, y + r + 2), (x - r - 1, y)], fill=colour, outline=(0, 0, 0))


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Round tick values (steps 1, 2, 2.5, 5 × 10^k) covering [lo, hi] with about n ticks."""
    if not hi > lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + k * step, 10) for k in range(int((hi - first) / step + 1e-9) + 1)]


Box = tuple[float, float, float, float]      # (left, top, right, bottom) in pixels


def _overlaps(a: Box, b: Box, gap: float = 2.0) -> bool:
    """Whether boxes ``a`` and ``b`` come closer than ``gap`` pixels."""
    return a[0] < b[2] + gap and b[0] < a[2] + gap and a[1] < b[3] + gap and b[1] < a[3] + gap


def place_labels(anchors: Sequence[tuple[float, float]], sizes: Sequence[tuple[float, float]],
                 obstacles: Sequence[Box], area: Box, offset: float = 10.0) -> list[tuple[Box, bool]]:
    """Boxes for point labels that overlap neither each other nor ``obstacles`` (markers, legend,
    fixed texts) and stay inside ``area``: per label, in order, the first free spot of right, left,
    above, below and the four diagonals of its point, then spots further up and down the plot
    (``True`` in the result: far from the point, draw a leader line). A label with no free spot
    anywhere goes right of its point (only when the plot is full)."""
    placed: list[Box] = []
    out: list[tuple[Box, bool]] = []
    ax0, ay0, ax1, ay1 = area
    for (cx, cy), (w, h) in zip(anchors, sizes):
        near = [(cx + offset, cy - h / 2), (cx - offset - w, cy - h / 2), (cx - w / 2, cy - offset - h),
                (cx - w / 2, cy + offset), (cx + offset * 0.7, cy - offset * 0.7 - h), (cx + offset * 0.7, cy + offset * 0.7),
                (cx - offset * 0.7 - w, cy - offset * 0.7 - h), (cx - offset * 0.7 - w, cy + offset * 0.7)]
        far = []
        step = h + 3
        for k in range(1, int((ay1 - ay0) / step) + 2):
            for dy in (-k * step, k * step):
                far += [(cx + offset, cy - h / 2 + dy), (cx - offset - w, cy - h / 2 + dy)]
        choice = None
        for is_far, spots in ((False, near), (True, far)):
            for x, y in spots:
                box = (x, y, x + w, y + h)
                if box[0] < ax0 or box[1] < ay0 or box[2] > ax1 or box[3] > ay1:
                    continue
                if any(_overlaps(box, o) for o in obstacles) or any(_overlaps(box, q) for q in placed):
                    continue
                choice = (box, is_far)
                break
            if choice is not None:
                break
        if choice is None:
            choice = ((cx + offset, cy - h / 2, cx + offset + w, cy + h / 2), False)
        placed.append(choice[0])
        out.append(choice)
    return out


X_LABEL = "measured speed-up of the scale loop (dense / accelerated)"
Y_LABEL = "PSNR against dense (dB)"


def plot_quality(rows: Sequence[dict], title: str = "", width: int = 1000, height: int = 640, *,
                 x: str = "speedup", y: str = "psnr_db", ci: Optional[str] = None, x_label: str = X_LABEL,
                 y_label: str = Y_LABEL) -> PIL.Image.Image:
    """Column ``y`` (default PSNR) against column ``x`` (default measured speed-up), one marker and
    colour per family, labelled points, and with ``ci`` (a column of half-widths) an error bar
    ``y ± ci`` per point. Identical-to-dense points (inf) sit on a band at the top marked "inf";
    points whose ``x`` or ``y`` is nan are left out. Labels never overlap each other, a marker, a bar
    or the legend (:func:`place_labels`; :func:`plot_quality_layout` returns their boxes)."""
    return plot_quality_layout(rows, title, width, height, x=x, y=y, ci=ci, x_label=x_label, y_label=y_label)[0]


def plot_quality_layout(rows: Sequence[dict], title: str = "", width: int = 1000, height: int = 640, *,
                        x: str = "speedup", y: str = "psnr_db", ci: Optional[str] = None, x_label: str = X_LABEL,
                        y_label: str = Y_LABEL) -> tuple[PIL.Image.Image, dict[str, Box], list[Box]]:
    """:func:`plot_quality`'s picture, each setting's label box and the boxes labels must keep clear
    of (the markers, the error bars, the legend and the plot's own texts), all in pixels."""
    img = PIL.Image.new("RGB", (width, height), "white")
    d = PIL.ImageDraw.Draw(img)
    f_small, f_mid, f_big = _font(12), _font(14), _font(17)
    left, right, top, bottom = 78, 24, 48, 64
    x0, x1, y0, y1 = left, width - right, top, height - bottom          # plot area in pixels

    def number(v) -> float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

    pts = [(number(r[x]), number(r[y]), r["setting"], r.get("family", "combo")) for r in rows]
    pts = [p for p in pts if math.isfinite(p[0]) and not math.isnan(p[1])]
    half = {r["setting"]: number(r.get(ci)) if ci else math.nan for r in rows}
    bars = {p[2]: half[p[2]] for p in pts if math.isfinite(p[1]) and math.isfinite(half[p[2]])}
    finite = [p for p in pts if math.isfinite(p[1])]
    xs = [p[0] for p in pts] + [1.0]
    xlo, xhi = min(xs), max(xs)
    pad = max(0.08 * (xhi - xlo), 0.05)
    xlo, xhi = xlo - pad, xhi + pad
    if finite:
        ylo = min(p[1] - bars.get(p[2], 0.0) for p in finite)
        yhi = max(p[1] + bars.get(p[2], 0.0) for p in finite)
        ypad = max(0.1 * (yhi - ylo), 1.0)
        ylo, yhi = ylo - ypad, yhi + ypad
    else:
        ylo, yhi = 0.0, 50.0
    inf_band = any(not math.isfinite(p[1]) for p in pts)
    y_plot_top = y0 + (28 if inf_band else 0)

    def px(v):
        return x0 + (v - xlo) / (xhi - xlo) * (x1 - x0)

    def py(v):
        if not math.isfinite(v):
            return y0 + 13
        return y1 - (v - ylo) / (yhi - ylo) * (y1 - y_plot_top)

    obstacles: list[Box] = []
    r_marker = 6
    centres = [(px(sx), py(sy)) for sx, sy, _, _ in pts]
    markers = [(cx - r_marker - 2, cy - r_marker - 2, cx + r_marker + 2, cy + r_marker + 2) for cx, cy in centres]
    bar_boxes = [(px(sx) - 4, py(sy + bars[label]), px(sx) + 4, py(sy - bars[label]))
                 for sx, sy, label, _ in pts if label in bars]

    def fixed_text(spots, text, font, fill):
        """Draw ``text`` at the first of ``spots`` ((xy, anchor) pairs) clear of every marker."""
        for xy, anchor in spots:
            box = d.textbbox(xy, text, font=font, anchor=anchor)
            if not any(_overlaps(box, m) for m in markers):
                break
        d.text(xy, text, fill=fill, font=font, anchor=anchor)
        obstacles.append(box)

    for t in nice_ticks(xlo, xhi, n=8):                                       # grid and ticks
        if xlo <= t <= xhi:
            d.line((px(t), y0, px(t), y1), fill=(232, 232, 232))
            d.line((px(t), y1, px(t), y1 + 5), fill=(0, 0, 0))
            d.text((px(t), y1 + 8), f"{t:g}x", fill=(0, 0, 0), font=f_small, anchor="ma")
    for t in nice_ticks(ylo, yhi):
        if ylo <= t <= yhi:
            d.line((x0, py(t), x1, py(t)), fill=(232, 232, 232))
            d.line((x0 - 5, py(t), x0, py(t)), fill=(0, 0, 0))
            d.text((x0 - 8, py(t)), f"{t:g}", fill=(0, 0, 0), font=f_small, anchor="rm")
    if inf_band:                                                          # the band above the finite values
        d.line((x0, y_plot_top - 1, x1, y_plot_top - 1), fill=(180, 180, 180))
        obstacles.append((x0, y_plot_top - 1, x1, y_plot_top - 1))
        d.text((x0 - 8, py(math.inf)), "inf", fill=(0, 0, 0), font=f_small, anchor="rm")
        fixed_text((((x0 + 6, y_plot_top - 6), "lb"), ((x1 - 6, y_plot_top - 6), "rb")), "identical to dense",
                   f_small, (120, 120, 120))
    if xlo <= 1.0 <= xhi:                                                # dense = speed-up 1
        for yy in range(int(y0), int(y1), 8):
            d.line((px(1.0), yy, px(1.0), min(yy + 4, y1)), fill=(150, 150, 150))
        fixed_text((((px(1.0) + 4, y1 - 4), "lb"), ((px(1.0) - 4, y1 - 4), "rb")), "dense", f_small, (120, 120, 120))
    d.rectangle((x0, y0, x1, y1), outline=(0, 0, 0))

    present = [f for f in FAMILY_STYLE if any(p[3] == f for p in pts)] or list(FAMILY_STYLE)
    lw = max(int(d.textlength(FAMILY_STYLE[f][0], font=f_small)) for f in present) + 40
    lx, ly = x1 - lw - 10, y_plot_top + 10
    legend: Box = (lx, ly, lx + lw, ly + 8 + 20 * len(present))
    obstacles.append(legend)
    obstacles += markers + bar_boxes
    sizes = []
    for _, _, label, _ in pts:
        bl, bt, br, bb = d.textbbox((0, 0), label, font=f_small, anchor="lt")
        sizes.append((br - bl, bb - bt))
    spots = place_labels(centres, sizes, obstacles, (x0 + 2, y0 + 2, x1 - 2, y1 - 2))

    boxes: dict[str, Box] = {}
    for (sx, sy, label, fam), (cx, cy), (box, far) in zip(pts, centres, spots):
        if far:                                                          # a leader line to a label moved away
            ex = box[0] if box[0] > cx else box[2]
            d.line((cx, cy, ex, (box[1] + box[3]) / 2), fill=(150, 150, 150))
    for bl, bt, br, bb in bar_boxes:                                     # error bars under the markers
        cx = (bl + br) / 2
        d.line((cx, bt, cx, bb), fill=(110, 110, 110))
        d.line((bl + 1, bt, br - 1, bt), fill=(110, 110, 110))
        d.line((bl + 1, bb, br - 1, bb), fill=(110, 110, 110))
    for (sx, sy, label, fam), (cx, cy), (box, far) in zip(pts, centres, spots):
        _, colour, kind = FAMILY_STYLE.get(fam, FAMILY_STYLE["combo"])
        _marker(d, cx, cy, kind, colour, r=r_marker)
        bl, bt, _, _ = d.textbbox((0, 0), label, font=f_small, anchor="lt")
        d.text((box[0] - bl, box[1] - bt), label, fill=(40, 40, 40), font=f_small, anchor="lt")
        boxes[label] = d.textbbox((box[0] - bl, box[1] - bt), label, font=f_small, anchor="lt")

    d.text((width / 2, 12), title or "PSNR against measured speed-up", fill=(0, 0, 0), font=f_big, anchor="ma")
    d.text(((x0 + x1) / 2, height - 22), x_label, fill=(0, 0, 0), font=f_mid, anchor="ma")
    ylabel = y_label
    tw = int(d.textlength(ylabel, font=f_mid)) + 4
    lab = PIL.Image.new("RGB", (tw, 20), "white")
    PIL.ImageDraw.Draw(lab).text((2, 2), ylabel, fill=(0, 0, 0), font=f_mid)
    lab = lab.rotate(90, expand=True)
    img.paste(lab, (6, int((y0 + y1) / 2 - lab.height / 2)))
    d.rectangle(legend, fill=(255, 255, 255), outline=(120, 120, 120))
    for k, f in enumerate(present):
        label, colour, kind = FAMILY_STYLE[f]
        _marker(d, lx + 14, ly + 14 + 20 * k, kind, colour, r=5)
        d.text((lx + 28, ly + 14 + 20 * k), label, fill=(0, 0, 0), font=f_small, anchor="lm")
    return img, boxes, obstacles


def _to_pil(x_13HW: torch.Tensor) -> PIL.Image.Image:
    arr_HW3 = (x_13HW[0].clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)   # (3,H,W)→(H,W,3)
    return PIL.Image.fromarray(arr_HW3)


def image_grid(samples: Sequence[tuple], setting: str, diff_gain: float = 4.0) -> PIL.Image.Image:
    """Rows (seed, class, dense (1, 3, H, W), accelerated (1, 3, H, W)) → one picture:
    dense | accelerated | ``diff_gain`` × |dense − accelerated| (clipped to 1), with a header."""
    if not samples:
        raise ValueError(f"image_grid({setting!r}) got no samples; generate at least one seed")
    H, W = samples[0][2].shape[-2:]
    head, side, gap = 24, 84, 2
    img = PIL.Image.new("RGB", (side + 3 * W + 2 * gap, head + (H + gap) * len(samples) - gap), "white")
    d = PIL.ImageDraw.Draw(img)
    font = _font(13)
    for c, text in enumerate(("dense", setting, f"|difference| x {diff_gain:g}")):
        d.text((side + c * (W + gap) + W / 2, head / 2), text, fill=(0, 0, 0), font=font, anchor="mm")
    for r, (seed, label, dense_13HW, acc_13HW) in enumerate(samples):
        y = head + r * (H + gap)
        diff_13HW = ((dense_13HW - acc_13HW).abs() * diff_gain).clamp(0, 1)
        for c, t in enumerate((dense_13HW, acc_13HW, diff_13HW)):
            img.paste(_to_pil(t), (side + c * (W + gap), y))
        d.text((side / 2, y + H / 2 - 9), f"seed {seed}", fill=(0, 0, 0), font=font, anchor="mm")
        d.text((side / 2, y + H / 2 + 9), f"class {label}", fill=(90, 90, 90), font=font, anchor="mm")
    return img


# ---- command line -----------------------------------------------------------------------------------------------
DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of ``sparsevar bench quality`` (also this module's own ``main``)."""
    p.add_argument("--model", help="VARPipeline folder (default: the demo model that ships with the package)")
    p.add_argument("--settings", nargs="+", default=None, metavar="NAME",
                   help="settings to compare with dense, parts joined with '+' (e.g. sparsevar-keep0.5+skip-last-1); "
                        "default: the README sweep; 'all': every registered one; see --list-settings")
    p.add_argument("--seeds", type=int, default=16, metavar="N", help="seeds 0..N-1, one image each (default 16)")
    p.add_argument("--classes", nargs="+", default=None, metavar="CLASS",
                   help="one class for all seeds or one per seed (ids or names; default seed %% num_classes)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/quality"), metavar="DIR",
                   help="folder for quality.csv, quality.png and grid_<setting>.png")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, …")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="transformer dtype (auto: bfloat16 on CUDA)")
    p.add_argument("--cfg", type=float, default=VAR_DEFAULTS.guidance_scale, help="guidance scale")
    p.add_argument("--top-k", type=int, default=VAR_DEFAULTS.top_k)
    p.add_argument("--top-p", type=float, default=VAR_DEFAULTS.top_p)
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per setting before timing")
    p.add_argument("--grid-seeds", type=int, default=4, help="rows of each image grid")
    p.add_argument("--classifier", default=None, metavar="FILE",
                   help="classifier for classifier_acc (default: classifier.safetensors in the model folder; the "
                        "demo model ships one)")
    p.add_argument("--no-teacher", action="store_true",
                   help="skip the teacher-forced measure (teacher_psnr_db: one more generation per seed and "
                        "accelerated scale)")
    p.add_argument("--list-settings", action="store_true", help="print the setting names and exit")
    return p


def run_from_args(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[dict]:
    """``run_quality`` for parsed :func:`add_arguments` arguments (what the CLI calls)."""
    if args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds}: give the number of seeds, at least 1")
    classes = args.classes
    if classes is not None:
        classes = [int(c) if c.isdigit() else c for c in classes]
        if len(classes) == 1:
            classes = classes[0]
    return run_quality(model=args.model, settings=args.settings, seeds=range(args.seeds), classes=classes,
                       out_dir=args.out, device=args.device,
                       dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
                       guidance_scale=args.cfg, top_k=args.top_k, top_p=args.top_p, log=log,
                       warmup=args.warmup, grid_seeds=args.grid_seeds, teacher=not args.no_teacher,
                       classifier=args.classifier)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="python -m sparsevar.benchmarks.bench_quality",
                                              description="Quality of acceleration settings against dense."))
    args = p.parse_args(argv)
    if args.list_settings:
        print(describe_settings())
        return 0
    try:
        run_from_args(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"bench quality: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["DEFAULT_SETTINGS", "SETTINGS", "SETTING_FORMS", "QualitySetting", "add_arguments", "describe_settings",
           "image_grid", "load_classifier", "load_model", "main", "nice_ticks", "parse_setting", "parse_settings",
           "place_labels", "plot_quality", "plot_quality_layout", "run_from_args", "run_quality", "teacher_scales"]

if __name__ == "__main__":
    sys.exit(main())
