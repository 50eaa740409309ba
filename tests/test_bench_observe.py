"""Observed-layer harness (issue #34): the capture rate on hand-made maps and energies, the recording
policy on the random ``var-tiny`` model (neutral, its energies and maps equal what the codes and the
SparseVAR policy itself give), the summary's invariants, and the command line with its error lines."""
from __future__ import annotations

import csv

import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.benchmarks import bench_observe as bo
from sparsevar.cli import main as cli_main
from sparsevar.engine.contract import Policy
from sparsevar.policies.sparsevar import SparseVARConfig, SparseVARPolicy


# ---- the measure on hand-made inputs ------------------------------------------------------------------------------
ENERGY_1L = torch.arange(1.0, 17.0)[None]                    # a 4×4 scale, token i holds energy i + 1; total 136


def test_capture_of_a_hand_made_map():
    # a 2×2 map upsampled to 4×4: each entry covers a 2×2 block; the largest, (0, 1), covers tokens 2, 3, 6, 7
    map_122 = torch.tensor([[[0.1, 3.0], [2.0, 0.5]]])
    got = bo.capture_rate(map_122, ENERGY_1L, (4, 4), keep=0.25)               # 4 tokens
    assert got.item() == pytest.approx((3 + 4 + 7 + 8) / 136)
    got = bo.capture_rate(map_122, ENERGY_1L, (4, 4), keep=0.5)                # + block (1, 0): tokens 8, 9, 12, 13
    assert got.item() == pytest.approx((3 + 4 + 7 + 8 + 9 + 10 + 13 + 14) / 136)
    # ceil(0.4 · 16) = 7: the top block and the first 3 positions of the tied second block (8, 9, 12)
    got = bo.capture_rate(map_122, ENERGY_1L, (4, 4), keep=0.4)
    assert got.item() == pytest.approx((3 + 4 + 7 + 8 + 9 + 10 + 13) / 136)


def test_capture_through_a_non_integer_upsampling():
    # 3×3 → 4×4 nearest: row / column j of the 4×4 map reads floor(0.75 · j) = 0, 0, 1, 2, so the
    # centre (1, 1) of the 3×3 map covers only token (2, 2) = 10, and (2, 2) covers token 15
    map_133 = torch.zeros(1, 3, 3)
    map_133[0, 1, 1], map_133[0, 2, 2] = 5.0, 4.0
    assert bo.capture_rate(map_133, ENERGY_1L, (4, 4), keep=1 / 16).item() == pytest.approx(11 / 136)
    assert bo.capture_rate(map_133, ENERGY_1L, (4, 4), keep=2 / 16).item() == pytest.approx((11 + 16) / 136)


def test_oracle_and_random_references():
    g = torch.Generator().manual_seed(1)
    energy_BL = torch.rand(4, 100, generator=g) ** 4                            # uneven energies
    n = 30
    oracle_B = bo.top_share(energy_BL, energy_BL, n)
    by_hand = torch.stack([e.sort(descending=True).values[:n].sum() / e.sum() for e in energy_BL])
    assert torch.allclose(oracle_B, by_hand)
    for _ in range(20):                                                         # no selection of n beats it
        assert (bo.top_share(torch.rand(4, 100, generator=g), energy_BL, n) <= oracle_B + 1e-6).all()
    # a random subset of n holds n / L of the energy on average
    draws = torch.stack([bo.top_share(torch.rand(4, 100, generator=g), energy_BL, n) for _ in range(500)])
    assert draws.mean().item() == pytest.approx(n / 100, abs=0.01)
    assert bo.kept_count(0.5, 169) == 85 and bo.kept_count(0.3, 100) == 30


@pytest.mark.parametrize("kw, message", [
    (dict(keep=1.0), "keep=1.0: give the fraction of tokens kept, strictly between 0 and 1"),
    (dict(keep=0.0), "keep=0.0: give the fraction"),
    (dict(keep=float("nan")), "keep=nan: give the fraction"),
    (dict(scales=0), "scales=0: give the number of pruned final scales, at least 1"),
    (dict(seeds=0), "seeds=0: give the number of seeds, at least 1"),
])
def test_bad_settings_are_named_before_loading(kw, message):
    args = dict(keep=0.5, scales=3, seeds=8) | kw
    with pytest.raises(ValueError) as e:
        bo.run_observe(model="/nonexistent/folder", **args)      # checked before the model is looked for
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(TypeError, match=r"^scales='3': give an int$"):
        bo.check_settings(0.5, "3", 8)


# ---- the recording policy on a tiny model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> VARPipeline:
    p = VARPipeline.from_random("var-tiny", seed=0)            # depth 4, 10 scales (1 … 16×16)
    p.set_progress_bar_config(disable=True)
    return p


def _generate(pipe, policies, seed=3):
    codes = []
    out = pipe([seed % pipe.num_classes], generator=torch.Generator().manual_seed(seed), output_type="pt",
               policies=policies, callback_on_step_end=lambda p, si, t, k: codes.append(k["codes"]))
    return out.images, codes


class _ReadChange(Policy):
    """Stacked after SparseVAR: keeps the change map SparseVAR stored at each scale."""
    name = "read_change"

    def __init__(self):
        self.seen = {}

    def after_scale(self, si, guided, run):
        ch = run.policy_state["sparsevar"]["change"]
        if ch is not None:
            self.seen[si] = ch.clone()


def test_taps_leave_the_generation_alone_and_record_what_the_codes_and_sparsevar_give(tiny):
    dense_images, dense_codes = _generate(tiny, [])
    S = tiny.adapter().schedule.num_scales
    taps = bo.LayerTaps(last=2)
    images, codes = _generate(tiny, [taps])
    assert torch.equal(images, dense_images) and len(codes) == S
    assert all(torch.equal(a, b) for a, b in zip(codes, dense_codes))
    rec = taps.record
    assert set(rec["energy"]) == {S - 2, S - 1}
    assert set(rec["maps"]) == {(si, ("layer", i)) for si in (S - 3, S - 2) for i in range(4)}   # no groups in VAR
    # energy = squared norm of the sampled code's codebook vector, from the callback's codes
    book_Vc = tiny.vqvae.quantize.embedding.weight.float()
    for si in (S - 2, S - 1):
        want = book_Vc[codes[si][0]].square().sum(-1)
        assert torch.allclose(rec["energy"][si][0], want)
    # every layer changed every token; the maps have the scale's token count
    for (si, _), m in rec["maps"].items():
        assert m.shape == (1, tiny.adapter().schedule.tokens(si)) and (m > 0).all()
    # the map of a layer is the one SparseVAR reads for it (block 1, observed from scale S − 3 on)
    sv, reader = SparseVARPolicy(SparseVARConfig(keep_ratio=0.5, start_scale=-2, block=1)), _ReadChange()
    taps2 = bo.LayerTaps(last=2)
    _generate(tiny, [taps2, sv, reader])
    h, w = tiny.adapter().schedule.hw[S - 3]
    assert torch.equal(taps2.record["maps"][(S - 3, ("layer", 1))].view(1, h, w), reader.seen[S - 3].cpu())
    assert not torch.equal(taps2.record["maps"][(S - 3, ("layer", 0))], taps2.record["maps"][(S - 3, ("layer", 1))])


def test_measure_summary_invariants(tiny):
    m = bo.measure_capture(tiny, seeds=range(2), keep=0.5, scales=2)
    S = tiny.adapter().schedule.num_scales
    assert [si for si, _ in m["scales"]] == [S - 2, S - 1] and m["kept"] == [85, 128]
    assert m["units"] == [("layer", i) for i in range(4)] and m["capture"].shape == (2, 4, 2)
    cap, rnd, orc = m["capture"], m["random"], m["oracle"]
    assert (cap >= 0).all() and (cap <= orc[:, None, :] + 1e-6).all() and (orc <= 1 + 1e-6).all()
    assert (rnd - torch.tensor([85 / 169, 0.5])).abs().max() < 0.03 and not m["constant_energy"]   # 64 draws each
    rows = bo.summarize(m)
    assert [r["layer"] for r in rows] == ["0", "1", "2", "3"]
    assert list(rows[0])[:5] == ["layer", "capture", "ci95", "random", "oracle"]
    assert {"capture_13x13", "capture_16x16", "random_16x16", "oracle_13x13"} <= set(rows[0])
    for u, r in enumerate(rows):                                 # capture = mean over seeds of the mean over scales
        assert r["capture"] == pytest.approx(cap[:, u].mean().item(), abs=1e-4)
        assert r["capture_16x16"] == pytest.approx(cap[:, u, 1].mean().item(), abs=1e-4)
        assert r["capture"] <= r["oracle"]
    assert bo.preset_unit(m["info"], "var") == ("layer", 2)      # 2 · 4 // 3
    report = bo.format_report(m, rows, ("layer", 2), "title")
    best = bo.best_unit(m)
    assert f"best layer: {rows[best]['layer']} " in report and "preset layer 2: " in report
    marked = [line.split()[0] for line in report.splitlines() if line.endswith(" preset")]
    assert marked == ["2"]                                       # the preset's row, and only it, is marked
    with pytest.raises(ValueError, match=r"^scales=10: this model has 10 scales .*; give 1\.\.9$"):
        bo.measure_capture(tiny, seeds=[0], scales=10)


def test_block_groups_and_equal_norm_residuals_on_a_tiny_infinity():
    from sparsevar import InfinityPipeline
    pipe = InfinityPipeline.from_random("infinity-tiny", seed=1)  # depth 4 in 2 groups; 256² → 7 scales, last 16×16
    pipe.set_progress_bar_config(disable=True)
    kw = dict(height=256, width=256, guidance_scale=3.0, top_k=1)
    m = bo.measure_capture(pipe, seeds=[0], keep=0.5, scales=2, prompts=["w3 w4 w5"], **kw)
    assert m["units"] == [("layer", i) for i in range(4)] + [("group", 0), ("group", 1)]
    assert [hw for _, hw in m["scales"]] == [(12, 12), (16, 16)] and m["kept"] == [72, 128]
    # every token's residual is ±1/√d bits, norm 1: any 72 of 144 tokens hold exactly half the energy
    assert m["constant_energy"]
    for t in (m["capture"], m["random"], m["oracle"]):
        assert torch.allclose(t, torch.full_like(t, 0.5), atol=1e-6)
    assert "cannot rank the layers" in bo.format_report(m, bo.summarize(m), None, "title")
    # a group's map runs from its first layer's input to its last layer's output: SparseVAR's map of group 1
    taps, reader = bo.LayerTaps(last=1), _ReadChange()
    sv = SparseVARPolicy(SparseVARConfig(keep_ratio=0.5, start_scale=-1, granularity="group", block=1))
    pipe(["w3 w4 w5"], generator=torch.Generator().manual_seed(0), output_type="latent", policies=[taps, sv, reader],
         **kw)
    maps = taps.record["maps"]
    assert torch.equal(maps[(5, ("group", 1))].view(1, 12, 12), reader.seen[5].cpu())
    assert not torch.equal(maps[(5, ("group", 1))], maps[(5, ("layer", 3))])
    with pytest.raises(ValueError, match=r"^prompts=None: a text-to-image pipeline needs a list of one non-empty "
                                         r"prompt per seed \(1\)$"):
        bo.measure_capture(pipe, seeds=[0], scales=2)


# ---- command line ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_model")
    tiny.save_pretrained(out)
    return out


@pytest.mark.parametrize("entry", ["cli", "module"])
def test_command_line_writes_the_table(entry, tiny_folder, tmp_path, capsys):
    out = tmp_path / "observe.csv"
    flags = ["--model", str(tiny_folder), "--seeds", "2", "--keep", "0.3", "--scales", "1", "--out", str(out),
             "--device", "cpu"]
    rc = cli_main(["bench", "observe", *flags]) if entry == "cli" else bo.main(flags)
    assert rc == 0
    printed = capsys.readouterr().out
    assert "2 seeds, keep 0.3 (n = 77 tokens), pruned scales 16x16" in printed and "best layer: " in printed
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["layer"] for r in rows] == ["0", "1", "2", "3"]
    assert list(rows[0]) == ["layer", "capture", "ci95", "random", "oracle", "capture_16x16", "random_16x16",
                             "oracle_16x16"]
    assert all(0 <= float(r["capture"]) <= float(r["oracle"]) <= 1 for r in rows)


@pytest.mark.parametrize("flags, message", [
    (["--keep", "1"], "--keep 1.0: give the fraction of tokens kept, strictly between 0 and 1"),
    (["--keep", "-0.5"], "--keep -0.5: give the fraction"),
    (["--scales", "0"], "--scales 0: give the number of pruned final scales, at least 1"),
    (["--seeds", "0"], "--seeds 0: give the number of seeds, at least 1"),
])
def test_command_line_names_a_bad_flag_before_loading(flags, message, capsys):
    assert cli_main(["bench", "observe", "--model", "/nonexistent/folder", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"sparsevar bench: error: {message}"), err
    assert bo.main(["--model", "/nonexistent/folder", *flags]) == 2
    assert capsys.readouterr().err.strip().startswith(f"bench observe: error: {message}")


def test_command_line_names_too_many_scales_for_the_model(tiny_folder, capsys):
    assert cli_main(["bench", "observe", "--model", str(tiny_folder), "--scales", "10", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "sparsevar bench: error: --scales 10: this model has 10 scales and the first has no previous " \
                  "one; give 1..9", err
