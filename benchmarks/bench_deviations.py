"""What four of SparseVAR's deviations from the paper cost or gain (issue #34, item 4).

    python -m sparsevar.benchmarks.bench_deviations [--seeds 16] [--model FOLDER] [--variants NAME …] [--out CSV]

Our SparseVAR differs from the paper in small ways (``policies/sparsevar.py``, research/accel.md §2).
Four of them can be switched off without touching the library, by a variant of the policy defined
here:

- ``no-edge-anchors``: the anchor grid is rows and columns 0, α, 2α, … only; ours also always
  computes the last row and column (``anchor_mask``).
- ``guided-change``: the change map is measured on the conditional rows only; ours averages the
  conditional and unconditional rows (``sparse_ops.ref.change_map``).
- ``quiet-anchors``: an anchor with no kept token among its 8 neighbours has change 0 in the map the
  next scale selects from; ours keeps its measured change, so anchors inside excluded areas can
  re-admit their neighbourhood.
- ``no-phi-bias-on-zeroed``: after a pruned scale's latent update, φ's bias is taken back from the
  latent positions of zeroed tokens; ours lets it reach them (VAR's tokenizers).

For every seed (class ``seed % num_classes``, one picture, the family's sampling defaults) it
generates dense, then each setting (``keep`` ratios and ``tau`` thresholds over the model's own
SparseVAR preset, i.e. its calibrated layer) with ours and with each variant, and reports the PSNR
against the dense picture: the mean over seeds and the paired difference variant − ours with its
95 % interval. The other listed deviation (zeroed tokens' logits feeding the next similarity test)
does not change the VAR preset's pictures (beta 1 turns the anchor copy off); it is described in
``benchmarks/results/README.md`` without a measurement.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..policies.sparsevar import TOKEN_ANCHOR, TOKEN_KEPT, SparseVARPolicy
from .metrics import mean_ci95


class NoEdgeAnchors(SparseVARPolicy):
    """SparseVAR whose anchor grid leaves out the last row and column (unless they fall on the stride)."""

    def _geometry(self, run, hw, prev_hw, device):
        anchors_L, cand_L4, src_L = super()._geometry(run, hw, prev_hw, device)
        h, w = hw
        a = self.config.alpha
        r, c = torch.arange(h, device=device), torch.arange(w, device=device)
        strided_L = ((r % a == 0)[:, None] & (c % a == 0)[None, :]).reshape(h * w)     # (h, w) → (L,)
        return strided_L, cand_L4, src_L


class GuidedChange(SparseVARPolicy):
    """SparseVAR whose change map is measured on the conditional rows alone."""

    def observe(self, si, unit, x_in, x_out, run) -> None:
        B = run.batch_size
        super().observe(si, unit, x_in[:B], x_out[:B], run)


class QuietAnchors(SparseVARPolicy):
    """SparseVAR whose anchors in excluded areas — no kept token among their 8 neighbours — leave
    the change map at 0, so that they do not re-admit their neighbourhood at the next scale (ours
    keeps the change measured there, which is not 0 since anchors are computed)."""

    def observe(self, si, unit, x_in, x_out, run) -> None:
        super().observe(si, unit, x_in, x_out, run)
        st = run.policy_state[self.name]
        roles_Bhw = st["roles"]
        if unit[0] != "layer" or unit[1] != st["last"] or roles_Bhw is None:
            return
        kept_B1hw = (roles_Bhw == TOKEN_KEPT).float()[:, None]                        # (B, h, w) → (B, 1, h, w)
        near_Bhw = F.max_pool2d(kept_B1hw, 3, stride=1, padding=1)[:, 0] > 0
        st["change"] = st["change"].masked_fill((roles_Bhw == TOKEN_ANCHOR) & ~near_Bhw, 0.0)


class NoPhiBiasOnZeroed(SparseVARPolicy):
    """SparseVAR after whose latent update φ's bias is taken back where the residual was zeroed: the
    latent positions whose nearest token of the scale was zeroed lose r·bias (φ(h) = (1 − r)·h +
    r·(conv(h) + bias)); ours leaves it, so zeroed tokens still move the latent by r·bias (and by the
    convolution of their neighbours, which the variant keeps). VAR's tokenizer (the pipeline's)."""

    def __init__(self, config, vqvae):
        super().__init__(config)
        self.vqvae = vqvae

    def after_scale(self, si, guided_logits_BLV, run) -> None:
        super().after_scale(si, guided_logits_BLV, run)
        zero_BL = run.plan.tensors.get("sparsevar.zero") if run.plan is not None else None
        if zero_BL is None:
            return
        f_hat_BChw = run.workspace.f_hat_BChw
        h, w = run.schedule.hw[si]
        _, bias_C, ratio = self.vqvae.phi_parameters(si, run.schedule.num_scales)
        zero_B1HW = F.interpolate(zero_BL.view(-1, 1, h, w).float(), size=f_hat_BChw.shape[-2:], mode="nearest")
        f_hat_BChw.sub_(ratio * bias_C.float().view(1, -1, 1, 1) * zero_B1HW)          # (B, 1, H, W) → (B, C, H, W)


VARIANTS = {"no-edge-anchors": NoEdgeAnchors, "guided-change": GuidedChange, "quiet-anchors": QuietAnchors,
            "no-phi-bias-on-zeroed": NoPhiBiasOnZeroed}


def _policy(cls, cfg, pipe) -> SparseVARPolicy:
    return cls(cfg, pipe.vqvae) if cls is NoPhiBiasOnZeroed else cls(cfg)


def measure(pipe, seeds: Sequence[int], keeps: Sequence[float] = (0.5,), taus: Sequence[float] = (0.3,),
            log: Callable[[str], None] = print, variants: Optional[Sequence[str]] = None) -> list[dict]:
    """Rows ``{setting, variant, psnr_db, ci95, diff_db, diff_ci95, better}`` (variant "ours" first
    for each setting; ``diff_*``: the variant minus ours, paired over seeds; ``better``: seeds where
    the variant is closer to dense). ``variants``: names from :data:`VARIANTS` (default: all)."""
    from .bench_quality import against_dense
    base = pipe.sparsevar_preset
    settings = [(f"keep{k:g}", replace(base, keep_ratio=k)) for k in keeps] + \
        [(f"tau{t:g}", replace(base, tau=t, keep_ratio=None)) for t in taus]
    kinds = {"ours": SparseVARPolicy, **{v: VARIANTS[v] for v in (VARIANTS if variants is None else variants)}}
    drawn = against_dense(pipe, seeds, [((name, v), [_policy(cls, cfg, pipe)])
                                        for name, cfg in settings for v, cls in kinds.items()], log)
    values = {key: [p for _, p in per_seed] for key, per_seed in drawn.items()}
    rows = []
    for name, _ in settings:
        ours = values[(name, "ours")]
        for v in kinds:
            mean, ci = mean_ci95(values[(name, v)])
            row = {"setting": name, "variant": v, "psnr_db": round(mean, 3), "ci95": round(ci, 3),
                   "diff_db": "", "diff_ci95": "", "better": ""}
            if v != "ours":
                diffs = [0.0 if a == b else a - b for a, b in zip(values[(name, v)], ours)]   # inf − inf: equal
                dm, dc = mean_ci95(diffs)
                row.update(diff_db=round(dm, 3), diff_ci95=round(dc, 3), better=sum(x > 0 for x in diffs))
            rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsevar.benchmarks.bench_deviations",
                                description="PSNR cost of four SparseVAR deviations from the paper, paired over seeds.")
    p.add_argument("--model", help="VARPipeline folder (default: the demo model)")
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--keep", type=float, nargs="+", default=[0.5])
    p.add_argument("--tau", type=float, nargs="+", default=[0.3])
    p.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                   help=f"the variants to measure (default: all of {', '.join(VARIANTS)})")
    p.add_argument("--out", default=None, help="CSV path")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    from ._results import write_csv
    from .bench_quality import load_model
    try:
        if args.seeds < 1:
            raise ValueError(f"--seeds {args.seeds}: give the number of seeds, at least 1 (e.g. 16)")
        for k in args.keep:                         # the ranges, before the model loads
            if not 0.0 < k <= 1.0:
                raise ValueError(f"--keep {k}: give fractions of tokens kept in (0, 1], e.g. --keep 0.5")
        for t in args.tau:
            if not 0.0 <= t < 1.0:
                raise ValueError(f"--tau {t}: give change thresholds in [0, 1), e.g. --tau 0.3")
        for v in args.variants or ():
            if v not in VARIANTS:
                raise ValueError(f"--variants {v}: unknown variant; choose from {', '.join(VARIANTS)}")
        pipe, name, loaded = load_model(args.model, device=args.device)
        pipe.set_progress_bar_config(disable=True)
        rows = measure(pipe, range(args.seeds), keeps=args.keep, taus=args.tau, variants=args.variants)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"bench deviations: error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        extra = f"  variant − ours {r['diff_db']:+.2f} ± {r['diff_ci95']:.2f} dB ({r['better']}/{args.seeds} better)" \
            if r["variant"] != "ours" else ""
        print(f"{name} {r['setting']:<8} {r['variant']:<22} PSNR {r['psnr_db']:.2f} ± {r['ci95']:.2f} dB{extra}")
    if args.out:
        write_csv(rows, args.out, print)
    return 0


__all__ = ["GuidedChange", "NoEdgeAnchors", "NoPhiBiasOnZeroed", "QuietAnchors", "VARIANTS", "main", "measure"]

if __name__ == "__main__":
    sys.exit(main())
