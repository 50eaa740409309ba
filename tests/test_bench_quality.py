"""Quality harness (issues #7, #34): the metrics and confidence intervals on known inputs, setting
names, and one small run of ``run_quality`` on the random ``var-tiny`` model (2 seeds, 5 settings,
CPU) — neutral setting equals dense, the teacher-forced measure against the dense run's own latents,
the classifier's accuracy against the pictures classified here, files written atomically, no policy
state leaks into or out of the pipeline."""
from __future__ import annotations

import csv
import math
from dataclasses import replace

import PIL.Image
import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.benchmarks import bench_quality as bq
from sparsevar.benchmarks._results import atomic_write, write_csv
from sparsevar.policies import SparseVARConfig
from sparsevar.benchmarks.metrics import gaussian_window, mean_ci95, mse, psnr, ssim, t_quantile
from sparsevar.demo import DEMO_MODEL_DIR
from sparsevar.demo.classifier import SceneClassifier
from sparsevar.engine.contract import Policy

SETTINGS = ["sparsevar-keep1.0", "skip-last-1", "skip-last-2", "sparsevar-keep0.5-from-1",
            "sparsevar-keep0.5+cond-only-last-1"]


# ---- metrics ------------------------------------------------------------------------------------------------
def test_psnr_identical_is_inf_and_known_mse():
    a_B3HW = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert torch.isinf(psnr(a_B3HW, a_B3HW)).all() and (psnr(a_B3HW, a_B3HW) > 0).all()
    zeros_B3HW = torch.zeros(2, 3, 16, 16)
    b_B3HW = torch.full((2, 3, 16, 16), 0.1)                       # MSE 0.01 → 20 dB
    assert torch.allclose(mse(zeros_B3HW, b_B3HW), torch.full((2,), 0.01, dtype=torch.float64))
    assert torch.allclose(psnr(zeros_B3HW, b_B3HW), torch.full((2,), 20.0, dtype=torch.float64))
    # half the pixels off by 0.2: MSE 0.02 → 10·log10(50) dB; per image, in 8-bit units too
    c_B3HW = zeros_B3HW.clone()
    c_B3HW[1, :, :8] = 0.2
    got = psnr(zeros_B3HW, c_B3HW)
    assert math.isinf(got[0]) and got[1].item() == pytest.approx(10 * math.log10(50))
    assert psnr(zeros_B3HW * 255, c_B3HW * 255, data_range=255)[1].item() == pytest.approx(10 * math.log10(50))


def test_ssim_identical_is_one_and_falls_with_noise():
    g = torch.Generator().manual_seed(0)
    a_B3HW = torch.rand(1, 3, 48, 48, generator=g)
    a_B3HW = torch.nn.functional.avg_pool2d(a_B3HW, 3, 1, 1)      # some structure for the window to see
    assert ssim(a_B3HW, a_B3HW).item() == 1.0
    noise_B3HW = torch.randn(1, 3, 48, 48, generator=g)
    values = [ssim(a_B3HW, (a_B3HW + s * noise_B3HW).clamp(0, 1)).item() for s in (0.01, 0.05, 0.2)]
    assert 1.0 > values[0] > values[1] > values[2] > 0.0
    assert ssim(a_B3HW, a_B3HW + 0.01 * noise_B3HW).item() == pytest.approx(
        ssim(a_B3HW + 0.01 * noise_B3HW, a_B3HW).item())           # symmetric


def test_ssim_of_flat_images_matches_the_formula():
    # flat images: no variance, so SSIM reduces to the luminance term (2·μx·μy + C1) / (μx² + μy² + C1)
    x, y, c1 = 0.3, 0.6, 0.01 ** 2
    got = ssim(torch.full((1, 3, 20, 20), x), torch.full((1, 3, 20, 20), y)).item()
    assert got == pytest.approx((2 * x * y + c1) / (x * x + y * y + c1), rel=1e-9)
    g_K = gaussian_window()
    assert g_K.shape == (11,) and g_K.sum().item() == pytest.approx(1.0) and g_K.argmax().item() == 5


def test_psnr_and_ssim_equal_torchmetrics_on_the_same_images():
    """Our metrics against torchmetrics' (issue #35: library code where a library does it). PSNR
    per image is torchmetrics' with the mean over (C, H, W). SSIM: torchmetrics evaluates the map at
    every pixel with reflected borders and averages all of it; the reference implementation of Wang
    et al. and scikit-image average the positions whose window lies inside the image, which we do:
    torchmetrics' map with the 5-pixel border cropped must give our value."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure
    g = torch.Generator().manual_seed(0)
    for shape, noise in (((3, 3, 40, 33), 0.1), ((2, 1, 11, 64), 0.3), ((1, 3, 256, 256), 0.02)):
        a = torch.rand(shape, generator=g, dtype=torch.float64)
        b = (a + noise * torch.randn(shape, generator=g, dtype=torch.float64)).clamp(0, 1)
        want = peak_signal_noise_ratio(a, b, data_range=1.0, reduction="none", dim=(1, 2, 3))
        torch.testing.assert_close(psnr(a, b), want, rtol=0, atol=1e-5)   # dB; torchmetrics takes the log in float32
        _, map_BCHW = structural_similarity_index_measure(a, b, data_range=1.0, reduction="none", gaussian_kernel=True,
                                                          sigma=1.5, kernel_size=11, k1=0.01, k2=0.03,
                                                          return_full_image=True)
        torch.testing.assert_close(ssim(a, b), map_BCHW[..., 5:-5, 5:-5].mean(dim=(1, 2, 3)), rtol=0, atol=1e-10)
        u8_a, u8_b = (a * 255).round(), (b * 255).round()                # an 8-bit range too
        torch.testing.assert_close(psnr(u8_a, u8_b, data_range=255.0), peak_signal_noise_ratio(
            u8_a, u8_b, data_range=255.0, reduction="none", dim=(1, 2, 3)), rtol=0, atol=1e-5)


def test_metrics_reject_bad_inputs():
    a = torch.zeros(1, 3, 16, 16)
    with pytest.raises(ValueError, match=r"same shape.*\(1, 3, 16, 16\).*\(1, 3, 16, 8\)"):
        psnr(a, torch.zeros(1, 3, 16, 8))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\).*\(3, 16, 16\).*a\[None\]"):
        ssim(a[0], a[0])
    with pytest.raises(ValueError, match=r"at least 11×11.*8×8"):
        ssim(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"data_range=0"):
        psnr(a, a, data_range=0)


def test_t_quantile_matches_scipy_and_ci_by_hand():
    from scipy import stats
    for df in (1, 2, 3, 4, 5, 8, 15, 31, 200):
        for p in (0.6, 0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-10), (p, df)
    # [1, 2, 3, 4]: mean 2.5, sample variance 5/3, half-width t(0.975, 3) · √(5/3) / 2
    mean, half = mean_ci95([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(3.182446305284263 * math.sqrt(5 / 3) / 2, rel=1e-12)
    assert mean_ci95([7.0, 7.0])[1] == 0.0
    assert math.isnan(mean_ci95([3.0])[1]) and mean_ci95([3.0])[0] == 3.0
    assert mean_ci95([3.0, math.inf]) == (math.inf, pytest.approx(math.nan, nan_ok=True))
    with pytest.raises(ValueError, match=r"df=0"):
        t_quantile(0.975, 0)
    with pytest.raises(ValueError, match=r"p=0.2"):
        t_quantile(0.2, 3)
    with pytest.raises(ValueError, match=r"values=\[\]"):
        mean_ci95([])


# ---- settings -----------------------------------------------------------------------------------------------
def test_parse_settings_families_and_combinations():
    s = bq.parse_setting("sparsevar-keep0.5+skip-last-1")
    preset = bq.SPARSEVAR_PRESETS["var"]
    # keep and tau forms start where the preset starts, unless -from-N says otherwise (issue #34)
    assert s.family == "combo" and s.sparsevar.keep_ratio == 0.5 and s.sparsevar.start_scale == preset.start_scale
    assert bq.parse_setting("sparsevar-tau0.8").sparsevar.start_scale == preset.start_scale
    assert bq.parse_setting("sparsevar-keep0.5-from-3").sparsevar == \
        SparseVARConfig(**{**vars(preset), "keep_ratio": 0.5, "start_scale": -3})
    assert bq.parse_setting("sparsevar-tau0.8-from-1").sparsevar == \
        SparseVARConfig(**{**vars(preset), "tau": 0.8, "start_scale": -1})
    assert bq.parse_setting("sparsevar-keep0.5-from-3-block7").sparsevar == \
        SparseVARConfig(**{**vars(preset), "keep_ratio": 0.5, "start_scale": -3, "block": 7})
    assert bq.parse_setting("sparsevar-tau0.6-block2").sparsevar == SparseVARConfig(**{**vars(preset), "tau": 0.6,
                                                                                        "block": 2})
    assert bq.parse_setting("sparsevar-tau0.5-from-3-alpha2").sparsevar == \
        SparseVARConfig(**{**vars(preset), "tau": 0.5, "start_scale": -3, "alpha": 2})
    assert bq.parse_setting("sparsevar-keep0.5-alpha8").sparsevar_fields == ("keep_ratio", "alpha")
    assert s.scale_skip.skip_last == 1 and s.fastvar is None
    assert [type(p).__name__ for p in s.policies()] == ["SparseVARPolicy", "ScaleSkipPolicy"]
    both = bq.parse_setting("skip-last-1+cond-only-last-2")       # one ScaleSkipConfig with both fields
    assert both.family == "skip" and (both.scale_skip.skip_last, both.scale_skip.cond_only_from) == (1, -2)
    assert bq.parse_setting("fastvar-r0.25-0.5").fastvar.ratios == (0.25, 0.5)
    assert bq.parse_setting("sparsevar-tau0.1").sparsevar.tau == 0.1
    assert bq.parse_setting("sparsevar-preset").sparsevar == bq.SPARSEVAR_PRESETS["var"]
    every = bq.parse_settings(["all"])
    assert [x.name for x in every] == list(bq.SETTINGS)
    assert {x.family for x in every} == set(bq.FAMILIES)
    assert [x.name for x in bq.parse_settings(None)] == list(bq.DEFAULT_SETTINGS)


@pytest.mark.parametrize("settings, message", [
    (["sparsevar-keep0.5", "warp-speed"],
     r"(?s)unknown setting 'warp-speed' in settings.*sparsevar-keep<R>.*skip-last-<N>"),
    (["sparsevar-keep0.5+nope"], r"unknown setting 'nope' \(in 'sparsevar-keep0.5\+nope'\)"),
    (["dense"], r"'dense' is the reference"),
    (["sparsevar-keep1.5"], r"setting 'sparsevar-keep1.5'.*keep_ratio must be in \(0, 1\]"),
    (["sparsevar-keep0.5-from-0"], r"setting 'sparsevar-keep0.5-from-0'.*-from-0: .*give N >= 1"),
    (["sparsevar-tau0.5-alpha0"], r"setting 'sparsevar-tau0.5-alpha0'.*-alpha0: the anchor stride .* at least 1"),
    (["sparsevar-tau0.5-from-x"], r"unknown setting 'sparsevar-tau0.5-from-x'"),
    (["sparsevar-preset+fastvar-preset"], r"combines SparseVAR with FastVAR"),
    (["skip-last-1+skip-last-2"], r"sets skip_last twice"),
    (["skip-last-1", "skip-last-1"], r"lists 'skip-last-1' twice"),
    ([], r"settings is empty"),
])
def test_bad_settings_raise_naming_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        bq.parse_settings(settings)


# ---- one small run --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> VARPipeline:
    p = VARPipeline.from_random("var-tiny", seed=0)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def judge() -> SceneClassifier:
    """The demo's classifier (12 classes): var-tiny draws noise, but its labels 0 and 1 are classes."""
    return SceneClassifier.from_file(DEMO_MODEL_DIR / "classifier.safetensors", 12)


@pytest.fixture(scope="module")
def quality_run(tiny, judge, tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    tiny.enable_scale_skip(skip_last=1)            # enabled on the pipeline: must not reach dense or the settings
    logs: list[str] = []
    try:
        rows = bq.run_quality(tiny, settings=SETTINGS, seeds=range(2), out_dir=out, warmup=0, log=logs.append,
                              classifier=judge)
        names_after = [p.name for p in tiny.policies]
    finally:
        tiny.disable_scale_skip()
    return rows, out, logs, names_after


def _draw(pipe, seed, policies=()):
    """(image, latents after every scale) of one generation of class ``seed`` (run_quality's default)."""
    latents = []
    out = pipe([seed], generator=torch.Generator().manual_seed(seed), output_type="pt", policies=list(policies),
               callback_on_step_end=lambda p, si, t, kw: latents.append(kw["latent"]) or kw,
               callback_on_step_end_tensor_inputs=["latent"])
    return out.images, latents


@pytest.fixture(scope="module")
def dense_runs(tiny):
    """The quality run's dense pictures and latents, drawn again here (seeds 0 and 1)."""
    return [_draw(tiny, seed) for seed in range(2)]


def _psnr_by_hand(a, b) -> float:
    return 10 * math.log10(1.0 / (a.double() - b.double()).pow(2).mean().item())


def test_run_quality_rows(quality_run):
    rows, _, logs, names_after = quality_run
    assert names_after == ["scale_skip"]                             # the pipeline's own stack is untouched
    by = {r["setting"]: r for r in rows}
    assert list(by) == SETTINGS
    neutral = by["sparsevar-keep1.0"]                                 # neutral: the dense picture exactly
    assert math.isinf(neutral["psnr_db"]) and neutral["ssim"] == 1.0
    assert neutral["kept_ratio"] == 1.0 and neutral["flop_speedup"] == pytest.approx(1.0)
    skip = by["skip-last-2"]
    assert math.isfinite(skip["psnr_db"]) and skip["ssim"] < 1.0 and skip["psnr_db_min"] <= skip["psnr_db"]
    assert skip["kept_ratio"] == pytest.approx((680 - 169 - 256) / 680, abs=1e-4)   # var-tiny: 680 tokens
    assert skip["flop_speedup"] > 1.0 and skip["speedup"] > 0
    combo = by["sparsevar-keep0.5+cond-only-last-1"]
    assert combo["family"] == "combo" and combo["kept_ratio"] < 1.0 and combo["ssim"] < 1.0
    for r in rows:
        assert r["seeds"] == 2 and r["model"] == "var-d4-w256-256px" and r["torch"] == torch.__version__
    assert any("skip-last-2" in line and "PSNR" in line for line in logs)


def test_confidence_intervals_follow_the_seeds(quality_run, tiny, dense_runs):
    """psnr_ci95 is the t-interval of the two seeds' PSNR, here recomputed from the pictures."""
    rows, _, _, _ = quality_run
    row = next(r for r in rows if r["setting"] == "sparsevar-keep0.5-from-1")
    policies = bq.parse_setting("sparsevar-keep0.5-from-1").policies
    values = [_psnr_by_hand(_draw(tiny, seed, policies())[0], dense) for seed, (dense, _) in enumerate(dense_runs)]
    sd = abs(values[0] - values[1]) / math.sqrt(2)                    # sample standard deviation of two values
    assert row["psnr_db"] == pytest.approx(sum(values) / 2, abs=1e-3)
    assert row["psnr_ci95"] == pytest.approx(12.706204736174707 * sd / math.sqrt(2), abs=1e-3)   # t(0.975, 1)


def test_teacher_forced_measure(quality_run, tiny, dense_runs):
    """Issue #34. A setting that changes no scale: inf. skip-last-N: the teacher-forced latent is dense's
    minus the last N scales' contributions, i.e. dense's latent before them (taken here from the dense
    run's own callback), so its PSNR is that latent's picture against dense. A setting acting at the last
    scale only has dense's history already: teacher-forced = plain PSNR. SparseVAR from the preset's
    start scale is measured at every scale from there, on dense's history (checked bit for bit inside)."""
    rows, _, _, _ = quality_run
    by = {r["setting"]: r for r in rows}
    assert math.isinf(by["sparsevar-keep1.0"]["teacher_psnr_db"]) and by["sparsevar-keep1.0"]["teacher_scales"] == ""
    for n in (1, 2):
        values = []
        for dense, latents in dense_runs:
            with torch.no_grad():
                before = (tiny.vqvae.fhat_to_img(latents[-1 - n]).float() + 1) / 2      # latent before the last n
            values.append(_psnr_by_hand(before, dense))
        row = by[f"skip-last-{n}"]
        assert row["teacher_psnr_db"] == pytest.approx(sum(values) / 2, abs=1e-3)
        assert row["teacher_scales"] == " ".join(str(-k) for k in range(n, 0, -1))
    last = by["sparsevar-keep0.5-from-1"]
    assert last["teacher_scales"] == "-1" and last["teacher_psnr_db"] == last["psnr_db"]
    assert last["teacher_psnr_ci95"] == last["psnr_ci95"] and math.isfinite(last["psnr_db"])
    combo = by["sparsevar-keep0.5+cond-only-last-1"]
    start = bq.SPARSEVAR_PRESETS["var"].start_scale
    assert combo["teacher_scales"] == " ".join(str(k) for k in range(start, 0))
    assert math.isfinite(combo["teacher_psnr_db"]) and combo["teacher_psnr_ci95"] >= 0


class _Nudge(Policy):
    """Moves the latent from ``after_scale``, a hook the teacher-forced runs keep before the measured
    scale because it should only store what later scales read."""

    name = "nudge"

    def after_scale(self, si, guided_logits, run):
        run.workspace.f_hat_BChw.add_(1.0)


def test_teacher_forced_refuses_a_policy_that_changes_the_history(tiny):
    sampling = bq.SamplingSettings(guidance_scale=4.0, top_k=900, top_p=0.95)
    dense = bq._generate(tiny, 0, 0, [], sampling, latents=True)
    with pytest.raises(RuntimeError, match=r"setting 'nudge' at scale 9, seed 0: the latent after scale 0 differs"):
        bq._teacher_latent(tiny, 0, 0, lambda: [_Nudge()], sampling, dense, [9], "nudge")


def test_classifier_accuracy(quality_run, tiny, judge, dense_runs):
    """classifier_acc: the share of a setting's pictures the classifier names as their class; here the
    pictures are drawn again and classified by the test."""
    rows, _, _, _ = quality_run
    name = "sparsevar-keep0.5+cond-only-last-1"
    hits = dense_hits = 0
    for seed, (dense, _) in enumerate(dense_runs):
        acc, _ = _draw(tiny, seed, bq.parse_setting(name).policies())
        with torch.no_grad():
            hits += int(judge(acc).argmax(-1).item() == seed)
            dense_hits += int(judge(dense).argmax(-1).item() == seed)
    row = next(r for r in rows if r["setting"] == name)
    assert row["classifier_acc"] == hits / 2 and row["dense_classifier_acc"] == dense_hits / 2


def test_classifier_loading(tiny, tmp_path):
    demo = VARPipeline.from_demo()
    assert isinstance(bq.load_classifier(None, None, demo), SceneClassifier)          # the demo ships one
    assert bq.load_classifier(None, tiny, tiny) is None                               # a pipeline: none unless given
    assert bq.load_classifier(None, tmp_path, tiny) is None                           # a folder without one
    assert bq.load_classifier(False, None, demo) is None
    with pytest.raises(ValueError, match=r"names 12 classes but the model has 1000"):
        bq.load_classifier(DEMO_MODEL_DIR / "classifier.safetensors", tiny, tiny)
    with pytest.raises(FileNotFoundError, match=r"classifier='.*nope.safetensors' is not a file"):
        bq.load_classifier(tmp_path / "nope.safetensors", tiny, tiny)
    with pytest.raises(TypeError, match=r"classifier must be None.*got int"):
        bq.load_classifier(3, tiny, tiny)


def test_run_quality_files(quality_run):
    rows, out, _, _ = quality_run
    with open(out / "quality.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["setting"] for r in table] == SETTINGS
    for col in ("setting", "psnr_db", "psnr_ci95", "teacher_psnr_db", "teacher_psnr_ci95", "classifier_acc",
                "dense_classifier_acc", "ssim", "speedup", "flop_speedup", "kept_ratio", "seeds", "device", "torch",
                "model", "teacher_scales"):
        assert col in table[0]
    assert float(table[0]["psnr_db"]) == math.inf and float(table[1]["psnr_db"]) == rows[1]["psnr_db"]
    with open(out / "quality_seeds.csv", newline="") as f:
        per_seed = list(csv.DictReader(f))
    assert [(r["setting"], r["seed"]) for r in per_seed] == [(n, str(k)) for n in SETTINGS for k in range(2)]
    for row in rows:                                                   # the table's means are the seeds' means
        mine = [r for r in per_seed if r["setting"] == row["setting"]]
        if math.isfinite(row["psnr_db"]):
            assert row["psnr_db"] == pytest.approx(sum(float(r["psnr_db"]) for r in mine) / 2, abs=1e-3)
        assert row["classifier_acc"] == sum(r["predicted"] == r["label"] for r in mine) / 2
    for name in ("quality.png", "quality_teacher.png"):
        with PIL.Image.open(out / name) as im:
            assert im.size == (1000, 640)
    for name in SETTINGS:
        with PIL.Image.open(out / f"grid_{name}.png") as im:
            assert im.size == (84 + 3 * 256 + 2 * 2, 24 + 2 * 256 + 2)     # label column + 3 tiles, 2 seeds
    assert not list(out.glob(".*.tmp"))


def test_run_quality_checks_before_generating(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"setting 'skip-last-10' does not fit this model.*skip_last=10"):
        bq.run_quality(tiny, settings=["skip-last-10"], seeds=[0], out_dir=tmp_path, log=lambda m: None)
    with pytest.raises(ValueError, match=r"'sparsevar-keep0.5-from-11' does not fit this model.*start_scale=-11"):
        bq.run_quality(tiny, settings=["sparsevar-keep0.5-from-11"], seeds=[0], out_dir=tmp_path, log=lambda m: None)
    with pytest.raises(ValueError, match=r"'sparsevar-keep0.5-block99' does not fit this model.*block"):
        bq.run_quality(tiny, settings=["sparsevar-keep0.5-block99"], seeds=[0], out_dir=tmp_path, log=lambda m: None)
    with pytest.raises(TypeError, match=r"teacher must be True or False.*got 1"):
        bq.run_quality(tiny, settings=["skip-last-1"], seeds=[0], teacher=1, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"classes has 1 entries for 2 seeds"):
        bq.run_quality(tiny, settings=["skip-last-1"], seeds=[0, 1], classes=[3], out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"seeds=4: pass a sequence of seeds, e.g. range\(4\)"):
        bq.run_quality(tiny, settings=["skip-last-1"], seeds=4, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"dtype=torch.float16 applies when the harness loads"):
        bq.run_quality(tiny, settings=["skip-last-1"], seeds=[0], dtype=torch.float16, out_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_missing_demo_model_says_what_to_do(monkeypatch, tmp_path):
    import sparsevar.demo
    monkeypatch.setattr(sparsevar.demo, "DEMO_MODEL_DIR", tmp_path / "weights")
    with pytest.raises(FileNotFoundError, match=r"missing from .*reinstall the package, or pass model=FOLDER"):
        bq.run_quality(None, settings=["skip-last-1"], seeds=[0], out_dir=tmp_path / "out", device="cpu")
    with pytest.raises(FileNotFoundError, match=r"is not a folder"):
        bq.load_model(tmp_path / "missing", device="cpu")


def test_atomic_write_leaves_nothing_when_interrupted(tmp_path):
    target = tmp_path / "quality.csv"

    def broken(p):
        p.write_text("setting,psnr")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, broken)
    assert not any(tmp_path.iterdir())
    atomic_write(target, lambda p: p.write_text("ok"))
    assert target.read_text() == "ok" and [x.name for x in tmp_path.iterdir()] == ["quality.csv"]


def test_write_csv_writes_nothing_for_no_rows(tmp_path):
    assert write_csv([], tmp_path / "sub" / "x.csv") is None and not any(tmp_path.iterdir())
    out = write_csv([{"a": 1, "b": 2}], tmp_path / "sub" / "x.csv")
    assert out.read_text() == "a,b\n1,2\n"


def test_plot_and_ticks():
    rows = [dict(setting="a", family="sparsevar", psnr_db=31.0, speedup=1.4),
            dict(setting="b", family="skip", psnr_db=math.inf, speedup=0.9),
            dict(setting="c", family="combo", psnr_db=18.5, speedup=float("nan"))]     # nan: left out
    img = bq.plot_quality(rows, title="t", width=640, height=400)
    assert img.size == (640, 400) and img.getcolors(1 << 20) is not None and len(img.getcolors(1 << 20)) > 10
    assert bq.nice_ticks(0.0, 1.0, n=6) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert bq.nice_ticks(0.7, 5.3, n=6) == [1.0, 2.0, 3.0, 4.0, 5.0]


def _row(setting, family, psnr_db, speedup):
    return dict(setting=setting, family=family, psnr_db=psnr_db, speedup=speedup)


# The README's CPU sweep (benchmarks/results/quality_demo_cpu, 8 seeds), whose labels overlapped, and a
# crowd: ten settings within 0.02x and 0.2 dB of each other, one identical to dense.
README_ROWS = [_row("sparsevar-keep0.7", "sparsevar", 26.801, 1.172), _row("sparsevar-keep0.5", "sparsevar", 25.556, 1.304),
               _row("sparsevar-keep0.3", "sparsevar", 24.878, 1.535), _row("sparsevar-tau0.3", "sparsevar", math.inf, 1.125),
               _row("sparsevar-preset", "sparsevar", 26.702, 1.328), _row("sparsevar-tau0.8", "sparsevar", 25.598, 1.461),
               _row("fastvar-preset", "fastvar", 27.349, 1.147), _row("skip-last-1", "skip", 27.27, 1.466),
               _row("skip-last-2", "skip", 26.107, 2.046), _row("sparsevar-keep0.5+skip-last-1", "combo", 25.843, 1.688),
               _row("sparsevar-preset+cond-only-last-2", "combo", 26.588, 1.348)]
CROWD_ROWS = [_row(f"setting-{k}", ("sparsevar", "fastvar", "skip", "combo")[k % 4], 25.0 + 0.02 * k, 1.30 + 0.002 * k)
              for k in range(10)] + [_row("neutral", "sparsevar", math.inf, 1.0), _row("far", "skip", 20.0, 2.0)]


CI_ROWS = [{**r, "psnr_ci95": 0.4 + 0.1 * k} for k, r in enumerate(README_ROWS)]


@pytest.mark.parametrize("rows, ci", [(README_ROWS, None), (CROWD_ROWS, None), (CI_ROWS, "psnr_ci95")],
                         ids=["readme", "crowd", "intervals"])
def test_plot_labels_do_not_overlap(rows, ci):
    """Issue #27: labels overlapped in quality.png. Every label box is inside the picture, clear of the
    others, of every marker, of the error bars (issue #34), of the legend and of the plot's own texts,
    and holds its label's ink."""
    import numpy as np
    img, boxes, obstacles = bq.plot_quality_layout(rows, title="t", ci=ci)
    assert sorted(boxes) == sorted(r["setting"] for r in rows)
    items = list(boxes.items())
    for i, (name, (l, t, r, b)) in enumerate(items):
        assert 0 <= l < r <= img.width and 0 <= t < b <= img.height, name
        for other, (l2, t2, r2, b2) in items[i + 1:]:
            assert r <= l2 or r2 <= l or b <= t2 or b2 <= t, (name, other)   # no shared pixel
        for ol, ot, orr, ob in obstacles:
            assert r <= ol or orr <= l or b <= ot or ob <= t, (name, (ol, ot, orr, ob))
        ink = np.asarray(img.crop((int(l), int(t), int(math.ceil(r)), int(math.ceil(b)))).convert("L")) < 128
        assert ink.mean() > 0.05, name                                              # the text is drawn there
    bars = sum(math.isfinite(r["psnr_db"]) for r in rows) if ci else 0
    assert len(obstacles) >= len(rows) + 1 + bars                                     # markers, bars, legend


def test_main_lists_settings_and_reports_errors(capsys):
    assert bq.main(["--list-settings"]) == 0
    assert "sparsevar-keep<R>" in capsys.readouterr().out
    assert bq.main(["--settings", "bogus", "--seeds", "1"]) == 2
    assert "unknown setting 'bogus'" in capsys.readouterr().err


def test_sparvar_settings_parse_and_run_without_a_teacher_forced_measure(tiny, tmp_path):
    """SparVAR's forms build its preset (top_keys replaced), compose with skipping, refuse token-subset
    methods, and a sweep reports them with the teacher-forced columns nan (its decision scale both
    changes the output and stores state) while the other settings keep theirs."""
    import csv
    import math
    s = bq.parse_setting("sparvar-top0.1+skip-last-1")
    assert s.family == "combo" and s.sparvar.top_keys == 0.1 and s.scale_skip.skip_last == 1
    assert [type(p).__name__ for p in s.policies()] == ["SparVARPolicy", "ScaleSkipPolicy"]
    assert bq.parse_setting("sparvar-preset").sparvar == bq.SPARVAR_PRESETS["var"]
    with pytest.raises(ValueError, match="combines SparVAR with a method that computes a token subset"):
        bq.parse_setting("sparvar-preset+fastvar-preset")
    rows = bq.run_quality(tiny, settings=["sparvar-preset", "skip-last-1"], seeds=[0], out_dir=tmp_path,
                          log=lambda m: None, classifier=False)
    by = {r["setting"]: r for r in rows}
    assert math.isnan(by["sparvar-preset"]["teacher_psnr_db"]) and by["sparvar-preset"]["psnr_db"] > 0
    assert by["sparvar-preset"]["flop_speedup"] > 1.0
    assert not math.isnan(by["skip-last-1"]["teacher_psnr_db"])
    seeds = list(csv.DictReader(open(tmp_path / "quality_seeds.csv")))
    assert {r["setting"]: r["teacher_psnr_db"] for r in seeds}["sparvar-preset"] == "nan"


def test_sparvar_names_agree_with_bench_speed():
    """`bench speed`'s SparVAR methods parse as quality settings with the same meaning (issue #30):
    'sparvar' alone names the preset, as in speed's sparvar+skip-last-2, and means what
    sparvar-preset does; speed's sparvar-neutral is ``SparVARConfig.dense()`` here too."""
    from sparsevar.benchmarks import bench_speed
    preset = bq.SPARVAR_PRESETS["var"]
    assert "sparvar+skip-last-2" in bench_speed.METHODS and "sparvar-preset+skip-last-2" in bq.SETTINGS
    for name in ("sparvar+skip-last-2", "sparvar-preset+skip-last-2"):
        s = bq.parse_setting(name)
        assert s.name == name and s.family == "combo" and s.sparvar == preset and s.scale_skip.skip_last == 2
        assert [type(p).__name__ for p in s.policies()] == ["SparVARPolicy", "ScaleSkipPolicy"]
    alone = bq.parse_setting("sparvar")
    assert alone.family == "sparvar" and alone.sparvar == preset and alone.scale_skip is None
    for name in bench_speed.METHODS:
        if name.startswith("sparvar") and name != "sparvar-neutral":
            assert bq.parse_setting(name).sparvar == preset, name
    assert bq.parse_setting("sparvar-neutral").sparvar == bq.SparVARConfig.dense()
    with pytest.raises(ValueError, match=r"unknown setting 'sparvar-prest' \(in 'sparvar-prest\+skip-last-2'\)"):
        bq.parse_setting("sparvar-prest+skip-last-2")


def test_every_bench_speed_method_but_the_kernel_variants_parses_as_a_quality_setting():
    """A researcher names a setting once for both harnesses: every `bench speed` method but dense and
    its kernel backends (speed-only: quality always compares with dense) parses as a quality setting
    of the same methods. ScaleKV's 'scalekv' and 'scalekv-<B>' read as scalekv-preset and -b<B>.
    (Not the same configs everywhere: speed's sparsevar-keep<R> start at the third-last scale, as
    its README rows say; quality's at the preset's start scale unless -from-3 says so.)"""
    from sparsevar.benchmarks import bench_speed
    kinds = ("sparsevar", "fastvar", "sparvar", "scalekv", "skip", "cond-only")
    for name in bench_speed.METHODS:
        if name == "dense" or name.startswith("dense-"):
            continue
        s = bq.parse_setting(name)                               # raises for a name quality does not know
        made = {k for k in ("sparsevar", "fastvar", "sparvar", "scalekv") if getattr(s, k) is not None}
        named = {k for k in kinds[:4] if k in name}
        assert made == named, (name, made)
    kv = bq.SCALEKV_PRESETS["var"]
    assert bq.parse_setting("scalekv-0.1").scalekv == bq.parse_setting("scalekv-b0.1").scalekv
    assert bq.parse_setting("scalekv-0.1").scalekv.budget == 0.1 and kv.budget != 0.1
    combo = bq.parse_setting("scalekv+cond-only-last-3")
    assert combo.scalekv == kv and combo.scale_skip.cond_only_from == -3


def test_scalekv_settings_take_the_models_calibrated_drafters(tiny):
    """On a model whose calibration chose its ScaleKV drafter layers, quality's ScaleKV settings use
    them (as enable_scalekv() does), keeping the budget a name sets."""
    pipe = tiny
    before = pipe.scalekv_preset
    pipe.set_scalekv_calibration({"drafters": [1]})
    try:
        assert pipe.scalekv_preset != before                    # the calibration changes the preset
        for name, budget in (("scalekv-preset", pipe.scalekv_preset.budget), ("scalekv-b0.3", 0.3),
                             ("scalekv+cond-only-last-2", pipe.scalekv_preset.budget)):
            s = bq.parse_setting(name).on_model(pipe)
            assert s.scalekv == replace(pipe.scalekv_preset, budget=budget), name
    finally:
        pipe.set_scalekv_calibration(None)
