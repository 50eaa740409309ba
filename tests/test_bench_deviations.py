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


def test_quiet_anchors_zero_the_change_of_anchors_with_no_kept_neighbour_only(tiny):
    """At the first pruned scale (selected from the same unpruned map by both), the variant's change
    map equals ours except at anchors none of whose 8 neighbours was kept, found here by a loop."""
    from sparsevar.policies.sparsevar import TOKEN_KEPT

    def recording(cls):
        class Rec(cls):
            maps = {}

            def after_scale(self, si, guided, run):
                super().after_scale(si, guided, run)
                change = run.policy_state[self.name]["change"]
                if change is not None:
                    Rec.maps[si] = change.clone()
        return Rec

    ours_cls, quiet_cls = recording(SparseVARPolicy), recording(bd.QuietAnchors)
    out = _run(tiny, ours_cls(CFG))
    _run(tiny, quiet_cls(CFG))
    first = min(out.stats[0].token_maps)                              # the first pruned scale
    roles = out.stats[0].token_maps[first][0]
    h, w = roles.shape
    quiet = torch.zeros(h, w, dtype=torch.bool)
    for y in range(h):
        for x in range(w):
            if roles[y, x] == TOKEN_ANCHOR:
                quiet[y, x] = not any(roles[v, u] == TOKEN_KEPT for v in range(max(0, y - 1), min(h, y + 2))
                                      for u in range(max(0, x - 1), min(w, x + 2)))
    ours_map, quiet_map = ours_cls.maps[first][0], quiet_cls.maps[first][0]
    assert quiet.any() and (ours_map[quiet] > 0).all()               # there are such anchors, and they changed
    assert (quiet_map[quiet] == 0).all()
    torch.testing.assert_close(quiet_map[~quiet], ours_map[~quiet], rtol=0, atol=0)


def test_no_phi_bias_on_zeroed_takes_r_bias_back_where_the_residual_was_zeroed(tiny):
    """After the first pruned scale's latent update the variant's latent is ours minus r·bias at the
    latent positions whose nearest token was zeroed, and equal elsewhere."""
    def recording(cls, *extra):
        class Rec(cls):
            latents, zeros = {}, {}

            def after_scale(self, si, guided, run):
                super().after_scale(si, guided, run)
                z = run.plan.tensors.get("sparsevar.zero")
                if z is not None:
                    Rec.latents[si] = run.workspace.f_hat_BChw.clone()
                    Rec.zeros[si] = z.clone()
        return Rec

    ours_cls, var_cls = recording(SparseVARPolicy), recording(bd.NoPhiBiasOnZeroed)
    _run(tiny, ours_cls(CFG))
    _run(tiny, var_cls(CFG, tiny.vqvae))
    first = min(ours_cls.latents)
    zero = ours_cls.zeros[first][0]
    assert torch.equal(zero, var_cls.zeros[first][0]) and zero.any()
    S = len(tiny.transformer.config.patch_nums)
    h = w = tiny.transformer.config.patch_nums[first]
    _, bias, r = tiny.vqvae.phi_parameters(first, S)
    assert (r * bias).abs().amax() > 1e-4                  # something to take back
    H, W = ours_cls.latents[first].shape[-2:]
    rows = [(y * h) // H for y in range(H)]                 # nearest: latent position → token of the scale
    cols = [(x * w) // W for x in range(W)]
    mask = torch.tensor([[bool(zero.view(h, w)[rows[y], cols[x]]) for x in range(W)] for y in range(H)])
    want = ours_cls.latents[first][0] - r * bias.float().view(-1, 1, 1) * mask.float()
    torch.testing.assert_close(var_cls.latents[first][0], want, rtol=0, atol=1e-6)


def test_measure_pairs_each_variant_with_ours(tiny):
    rows = bd.measure(tiny, seeds=[0, 1], keeps=(0.5,), taus=(), log=lambda s: None)
    assert [(r["setting"], r["variant"]) for r in rows] == [
        ("keep0.5", v) for v in ("ours", "no-edge-anchors", "guided-change", "quiet-anchors", "no-phi-bias-on-zeroed")]
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
    (["--variants", "quiet"], "--variants quiet: unknown variant; choose from no-edge-anchors, guided-change"),
])
def test_command_line_names_a_bad_flag_before_loading(flags, message, capsys):
    assert bd.main(["--model", "/nonexistent/folder", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"bench deviations: error: {message}"), err
