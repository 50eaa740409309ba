"""The deviation variants of ``benchmarks/bench_deviations`` (issue #34, item 4) change only what they
name, and the harness pairs them with our SparseVAR seed by seed."""
from __future__ import annotations

import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.benchmarks import bench_deviations as bd
from sparsevar.benchmarks.metrics import psnr
from sparsevar.policies.sparsevar import TOKEN_ANCHOR, SparseVARConfig, SparseVARPolicy

CFG = SparseVARConfig(keep_ratio=0.5, start_scale=-2, block=2, beta=1.0)


@pytest.fixture(scope="module")
def tiny() -> VARPipeline:
    p = VARPipeline.from_random("var-tiny", seed=0)            # 16×16 last scale: row and column 15 are not on the stride
    p.set_progress_bar_config(disable=True)
    return p


def _run(pipe, policy, **kw):
    return pipe([3], generator=torch.Generator().manual_seed(1), output_type="pt", policies=[policy], **kw)


def test_no_edge_anchors_drops_only_the_last_row_and_column(tiny):
    ours, variant = _run(tiny, SparseVARPolicy(CFG)), _run(tiny, bd.NoEdgeAnchors(CFG))
    for si, roles in variant.stats[0].token_maps.items():
        h, w = roles.shape[-2:]
        anchors = roles[0] == TOKEN_ANCHOR
        want = torch.zeros(h, w, dtype=torch.bool)
        want[::4, ::4] = True
        assert torch.equal(anchors, want), si
        ours_anchors = ours.stats[0].token_maps[si][0] == TOKEN_ANCHOR
        assert ours_anchors[h - 1, ::4].all() and ours_anchors[::4, w - 1].all()   # ours adds them
        assert torch.equal(ours_anchors & want, want)


def test_guided_change_reads_each_images_conditional_rows(tiny):
    maps = [_run(tiny, cls(CFG)).stats[0].token_maps for cls in (SparseVARPolicy, bd.GuidedChange)]
    assert any(not torch.equal(maps[0][si], maps[1][si]) for si in maps[0])   # the unconditional half counted
    # rows are [cond images; uncond images]: in a batch each image's map is its own (one generator per image)
    gens = lambda seeds: [torch.Generator().manual_seed(k) for k in seeds]
    both = tiny([3, 5], generator=gens([1, 2]), output_type="pt", policies=[bd.GuidedChange(CFG)]).stats[0].token_maps
    alone = tiny([5], generator=gens([2]), output_type="pt", policies=[bd.GuidedChange(CFG)]).stats[0].token_maps
    assert all(torch.equal(both[si][1], alone[si][0]) for si in alone)


def test_measure_pairs_each_variant_with_ours(tiny):
    rows = bd.measure(tiny, seeds=[0, 1], keeps=(0.5, 0.3), taus=(), log=lambda s: None)
    assert [(r["setting"], r["variant"]) for r in rows] == [
        (s, v) for s in ("keep0.5", "keep0.3") for v in ("ours", "no-edge-anchors", "guided-change")]
    # the first row's PSNR, by hand: seed 0 and 1 against their dense pictures
    from sparsevar.benchmarks.bench_quality import _generate
    from sparsevar.engine.state import SamplingSettings
    d = tiny.DEFAULTS
    s = SamplingSettings(guidance_scale=d.guidance_scale, top_k=d.top_k, top_p=d.top_p)
    cfg = SparseVARConfig(**{**vars(tiny.sparsevar_preset), "keep_ratio": 0.5})
    by_hand = [float(psnr(_generate(tiny, k % tiny.num_classes, k, [SparseVARPolicy(cfg)], s).image_13HW,
                          _generate(tiny, k % tiny.num_classes, k, [], s).image_13HW)[0]) for k in (0, 1)]
    assert rows[0]["psnr_db"] == pytest.approx(sum(by_hand) / 2, abs=1e-3)
    for r in rows:
        if r["variant"] != "ours":
            ours = next(o for o in rows if o["setting"] == r["setting"] and o["variant"] == "ours")
            assert r["diff_db"] == pytest.approx(r["psnr_db"] - ours["psnr_db"], abs=2e-3)
            assert 0 <= r["better"] <= 2


@pytest.mark.parametrize("flags, message", [
    (["--keep", "1.5"], "--keep 1.5: give fractions of tokens kept in (0, 1]"),
    (["--tau", "1"], "--tau 1.0: give change thresholds in [0, 1)"),
    (["--seeds", "0"], "--seeds 0: give the number of seeds, at least 1"),
])
def test_command_line_names_a_bad_flag_before_loading(flags, message, capsys):
    assert bd.main(["--model", "/nonexistent/folder", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"bench deviations: error: {message}"), err
