"""SparseVAR calibration (issue #34): ``sparsevar calibrate`` measures which layer a checkpoint's
SparseVAR should observe (the capture rate of ``bench observe``), stores it in the pipeline's config
(``model_index.json`` "sparsevar_calibration"), and every entry point that starts from the preset —
``enable_sparsevar()``, the CLI's ``--sparsevar``, the ComfyUI settings node, ``bench quality`` —
then observes that layer. The shipped demo model carries its measured layer."""
from __future__ import annotations

import json

import pytest

from sparsevar import VARPipeline
from sparsevar.benchmarks import bench_observe as bo
from sparsevar.benchmarks import bench_quality as bq
from sparsevar.cli import main as cli_main
from sparsevar.policies.sparsevar import SPARSEVAR_PRESETS, SparseVARPolicy


@pytest.fixture(scope="module")
def tiny() -> VARPipeline:
    p = VARPipeline.from_random("var-tiny", seed=0)            # depth 4, 10 scales (1 … 16×16); formula layer 2
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def calibrated(tiny):
    """(calibration, the capture summary measured independently of calibrate with the same settings)."""
    rows = bo.summarize(bo.measure_capture(tiny, seeds=range(2), keep=0.5, scales=2))
    logged = []
    cal = bo.calibrate(tiny, seeds=2, keep=0.5, scales=2, log=logged.append, taus=())
    yield cal, rows, "\n".join(logged)
    tiny.set_sparsevar_calibration(None)


def test_calibrate_chooses_the_layer_that_captures_most_and_the_preset_applies_it(tiny, calibrated):
    cal, rows, logged = calibrated
    best = max(range(len(rows)), key=lambda i: rows[i]["capture"])
    assert (cal["granularity"], cal["block"]) == ("layer", best)
    m = cal["measured"]
    assert m["per_unit"] == {r["layer"]: r["capture"] for r in rows}
    assert (m["capture"], m["random"], m["oracle"]) == (rows[best]["capture"], rows[best]["random"],
                                                        rows[best]["oracle"])
    assert m["formula_unit"] == "2" and m["formula_capture"] == rows[2]["capture"]
    assert (m["seeds"], m["keep"], m["scales"]) == (2, 0.5, ["13x13", "16x16"])
    assert f"calibrate: observe layer {best} (captures {rows[best]['capture']:.3f}" in logged
    assert "best layer: " in logged and "; formula layer 2: " in logged       # the whole table is printed first

    preset = tiny.sparsevar_preset                                      # the family preset, layer replaced
    assert preset == SPARSEVAR_PRESETS["var"].__class__(**{**vars(SPARSEVAR_PRESETS["var"]), "block": best})
    tiny.enable_sparsevar(keep_ratio=0.5)
    try:
        (policy,) = [p for p in tiny.policies if isinstance(p, SparseVARPolicy)]
        assert policy.config.block == best and policy.config.keep_ratio == 0.5
        tiny.enable_sparsevar(block=1)                                  # an explicit layer wins
        (policy,) = [p for p in tiny.policies if isinstance(p, SparseVARPolicy)]
        assert policy.config.block == 1
    finally:
        tiny.disable_sparsevar()


def test_a_calibration_travels_with_the_folder(tiny, calibrated, tmp_path):
    from diffusers import DiffusionPipeline
    cal = calibrated[0]
    plain = tmp_path / "plain"
    tiny.set_sparsevar_calibration(None)
    tiny.save_pretrained(plain)
    tiny.set_sparsevar_calibration(cal)
    assert json.loads((plain / "model_index.json").read_text())["sparsevar_calibration"] is None
    assert VARPipeline.from_pretrained(plain).sparsevar_preset == SPARSEVAR_PRESETS["var"]

    weights = sorted(p.name for p in plain.rglob("*.safetensors"))
    stamp = {p: p.stat().st_mtime_ns for p in plain.rglob("*.safetensors")}
    bo.write_calibration(plain, cal)                                    # only model_index.json changes
    assert {p: p.stat().st_mtime_ns for p in plain.rglob("*.safetensors")} == stamp
    assert not [p for p in plain.iterdir() if p.name.startswith(".")]  # no temporary file left
    loaded = VARPipeline.from_pretrained(plain)
    assert loaded.config.sparsevar_calibration == cal and loaded.sparsevar_preset.block == cal["block"]

    again = tmp_path / "again"                                          # save_pretrained keeps it
    loaded.save_pretrained(again)
    assert json.loads((again / "model_index.json").read_text())["sparsevar_calibration"] == cal
    assert sorted(p.name for p in again.rglob("*.safetensors")) == weights
    generic = DiffusionPipeline.from_pretrained(again, trust_remote_code=True)
    assert type(generic).__name__ == "VARPipeline" and generic.sparsevar_preset.block == cal["block"]


@pytest.mark.parametrize("value, message", [
    ({"block": 3}, r"has the keys \['block'\]; it holds \['block', 'granularity'\] \(both\)"),
    ({"block": 3, "granularity": "layer", "keep_ratio": 0.3}, r"has the keys \['block', 'granularity', 'keep_ratio'\]"),
    ({"block": 3, "granularity": "layer", "tau": 1.5}, r"tau"),
    ({"block": "3", "granularity": "layer"}, r"block must be an int index or None"),
    ({"block": 3, "granularity": "chunk"}, r"granularity must be 'layer' or 'group'"),
    ({"block": 3, "granularity": "layer", "measured": 0.9}, r"\[\"measured\"\] must be a dict"),
    ([3, "layer"], r"must be a dict such as"),
])
def test_a_bad_calibration_in_a_folder_is_named_in_one_line(tiny, tmp_path, value, message):
    folder = tmp_path / "m"
    tiny.save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["sparsevar_calibration"] = value
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message) as e:
        VARPipeline.from_pretrained(folder)
    text = str(e.value)
    assert text.startswith(f"{folder / 'model_index.json'}: \"sparsevar_calibration\"") and "\n" not in text
    assert text.endswith("run `sparsevar calibrate --model FOLDER` again, or remove the key")


def test_a_calibration_that_does_not_fit_the_model_is_refused(tiny):
    with pytest.raises(ValueError, match=r"^sparsevar_calibration does not fit this model: block=4 is not a layer "
                                         r"of this model: use 0\.\.3; run `sparsevar calibrate"):
        VARPipeline(transformer=tiny.transformer, vqvae=tiny.vqvae,
                    sparsevar_calibration={"block": 4, "granularity": "layer"})
    with pytest.raises(ValueError, match=r"granularity='group': var has no block groups"):
        VARPipeline(transformer=tiny.transformer, vqvae=tiny.vqvae,
                    sparsevar_calibration={"block": 0, "granularity": "group"})


def test_a_model_whose_residuals_all_have_one_norm_is_ranked_by_its_pictures_and_prompts_drive_every_step():
    """Infinity's bits all have one norm, so the capture rate cannot rank its block groups: calibrate
    ranks them by the PSNR against dense of SparseVAR keep 0.5 observing each (recomputed here by
    plain pipeline calls with the prompts), observes the best, and calibrates tau over the same
    prompts (one baseline recomputed by hand)."""
    import torch
    from dataclasses import replace
    from sparsevar import InfinityPipeline
    from sparsevar.benchmarks.metrics import psnr
    from sparsevar.policies import ScaleSkipConfig, ScaleSkipPolicy
    pipe = InfinityPipeline.from_random("infinity-tiny", seed=1)          # 4 layers in 2 groups, 256 px: 13 scales
    pipe.set_progress_bar_config(disable=True)
    prompts, size = ["w3 w4 w5", "w6 w7"], dict(height=256, width=256)
    logged = []
    cal = bo.calibrate(pipe, seeds=2, scales=2, prompts=prompts, log=logged.append, taus=(0.9,), starts=(-2,), **size)
    text = "\n".join(logged)
    assert "cannot rank the layers of this model" in text and "ranking the 2 groups by PSNR against dense" in text
    d = pipe.DEFAULTS

    def picture(seed, policies):
        out = pipe([prompts[seed]], guidance_scale=d.guidance_scale, top_k=d.top_k, top_p=d.top_p, output_type="pt",
                   generator=torch.Generator().manual_seed(seed), policies=policies, **size)
        return out.images.float().clamp(0, 1), out.stats[0]

    dense = [picture(seed, [])[0] for seed in (0, 1)]
    base = replace(SPARSEVAR_PRESETS["infinity-2b"], keep_ratio=0.5, start_scale=-2, granularity="group")
    by_hand = {g: sum(min(float(psnr(picture(seed, [SparseVARPolicy(replace(base, block=g))])[0], dense[seed])[0]),
                          bo.IDENTICAL_PSNR_DB) for seed in (0, 1)) / 2 for g in (0, 1)}
    m = cal["measured"]
    assert m["per_unit_psnr_db"] == {str(g): pytest.approx(v, abs=2e-3) for g, v in by_hand.items()}
    assert by_hand[0] != by_hand[1]                                      # the ranking has something to rank
    best = max(by_hand, key=by_hand.get)
    assert (cal["granularity"], cal["block"]) == ("group", best) and pipe.sparsevar_preset.block == best
    assert f"calibrate: observe group {best} (" in text

    skip = [picture(seed, [ScaleSkipPolicy(ScaleSkipConfig(skip_last=1))]) for seed in (0, 1)]
    want = [sum(pipe.flop_speedup(st) for _, st in skip) / 2,
            sum(float(psnr(img, dense[seed])[0]) for seed, (img, _) in enumerate(skip)) / 2]
    assert m["tau"]["settings"]["skip-last-1"] == pytest.approx(want, abs=2e-3)
    st = skip[0][1]                                      # the FLOP speed-up reads the call's own 256² schedule
    from sparsevar.models.infinity import resolve_resolution
    assert [(s.h, s.w) for s in st.scales] == list(resolve_resolution(256, 256).hw) != \
        list(resolve_resolution(1024, 1024).hw)
    assert pipe.flop_speedup(st) == pipe.flop_speedup(st, 256, 256) > 1
    assert set(m["tau"]["settings"]) == {"tau0.9-from-2", *bo.TAU_BASELINES}
    pipe.set_sparsevar_calibration(None)
    assert pipe.sparsevar_preset == SPARSEVAR_PRESETS["infinity-2b"]


def test_calibrate_refuses_sampling_arguments_and_sizes_for_a_model_that_has_its_own(tiny, tiny_folder):
    with pytest.raises(ValueError, match=r"^calibrate: guidance_scale, top_k cannot be set: every measurement "
                                         r"samples with the family's defaults"):
        bo.calibrate(tiny, seeds=1, top_k=1, guidance_scale=2.0, log=lambda s: None)
    with pytest.raises(ValueError, match=r"^height=256, width=None: only Infinity models draw at a chosen size"):
        bo.run_calibrate(tiny_folder, seeds=1, height=256, write=False, log=lambda s: None)


def test_a_setting_that_leaves_no_token_out_is_never_chosen(tiny):
    """tau 0 keeps every token that changed at all: FLOP speed-up 1, PSNR that of dense; it
    "reaches" any front but changes nothing, so calibrate does not store it."""
    logged = []
    found = bo.calibrate_tau(tiny, seeds=1, taus=(0.0,), baselines=("skip-last-1",), log=logged.append, starts=(-1,))
    assert found["settings"]["tau0-from-1"] == [1.0, bo.IDENTICAL_PSNR_DB]
    assert found["tau"] is None and found["start_scale"] is None
    assert "calibrate: tau 0 from scale -1: FLOP speed-up 1.00x, PSNR 99.00 dB; computes every token: not a " \
           "candidate" in logged


# ---- the settings that start from the preset -----------------------------------------------------------------------
def test_bench_quality_settings_start_from_the_models_calibrated_preset(tiny, calibrated):
    cal = calibrated[0]
    tiny.set_sparsevar_calibration(cal)
    preset = bq.parse_setting("sparsevar-preset").on_model(tiny)
    keep = bq.parse_setting("sparsevar-keep0.5-from-3").on_model(tiny)
    chosen = bq.parse_setting("sparsevar-keep0.5-block1").on_model(tiny)
    assert preset.sparsevar == tiny.sparsevar_preset and preset.sparsevar.block == cal["block"]
    assert (keep.sparsevar.block, keep.sparsevar.keep_ratio, keep.sparsevar.start_scale) == (cal["block"], 0.5, -3)
    assert chosen.sparsevar.block == 1                                  # the name's own layer wins
    assert bq.parse_setting("skip-last-1").on_model(tiny) == bq.parse_setting("skip-last-1")


def test_the_cli_sparsevar_flags_apply_over_the_calibrated_preset(tiny, calibrated):
    from sparsevar.cli import _apply_acceleration, _policy_configs, build_parser
    tiny.set_sparsevar_calibration(calibrated[0])
    for flags, block in ((["--sparsevar", "--keep-ratio", "0.4"], calibrated[0]["block"]),
                         (["--sparsevar", "--block", "0"], 0)):
        args = build_parser().parse_args(["generate", *flags])
        _apply_acceleration(tiny, args, _policy_configs(args, "var"))
        try:
            (policy,) = [p for p in tiny.policies if isinstance(p, SparseVARPolicy)]
            assert policy.config.block == block
        finally:
            tiny.disable_sparsevar()


NODE_SCRIPT = r"""
import json, sys
import comfy.cli_args
comfy.cli_args.args.cpu = True
from sparsevar import VARPipeline
from sparsevar.nodes import var_nodes as V
pipe = VARPipeline.from_random("var-tiny", seed=0)
pipe.set_sparsevar_calibration({"block": 1, "granularity": "layer", "tau": 0.35})
blocks = []
for block, tau in ((-1, -1.0), (3, 0.6)):
    sv = V.SparseVARSettingsNode.execute(tau=tau, start_scale=0, block=block, keep_ratio=0.0).result[0]
    anchors = V.AnchorSettingsNode.execute(alpha=2, beta=0.9).result[0]
    (policy,) = V._policies(pipe, sv, anchors, None, None)
    blocks.append([policy.config.block, policy.config.tau, policy.config.alpha])
print(json.dumps(blocks))
"""


def test_the_comfyui_settings_node_applies_over_the_calibrated_preset(run_with_comfyui, tmp_path):
    r = run_with_comfyui(NODE_SCRIPT, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    # block -1 / tau -1: the calibrated layer and tau; set values win
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[1, 0.35, 2], [3, 0.6, 2]]


# ---- the command ------------------------------------------------------------------------------------------------------
@pytest.fixture()
def tiny_folder(tiny, tmp_path):
    tiny.set_sparsevar_calibration(None)
    tiny.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_the_command_measures_and_stores_the_layer(tiny_folder, capsys):
    before = (tiny_folder / "model_index.json").read_bytes()
    flags = ["calibrate", "--model", str(tiny_folder), "--seeds", "2", "--scales", "2", "--device", "cpu"]
    assert cli_main([*flags, "--dry-run", "--layer-only"]) == 0
    dry = capsys.readouterr().out
    assert "calibrate: observe layer " in dry and "written to" not in dry and "calibrate: tau" not in dry
    assert (tiny_folder / "model_index.json").read_bytes() == before   # --dry-run leaves the folder alone
    assert cli_main([*flags, "--taus", "0.3", "--starts", "-1", "-2"]) == 0
    out = capsys.readouterr().out
    stored = json.loads((tiny_folder / "model_index.json").read_text())["sparsevar_calibration"]
    tau = f" with tau {stored['tau']:g} from scale {stored['start_scale']}" if "tau" in stored else ""
    assert f"enable_sparsevar() on this folder now observes layer {stored['block']}{tau}" in out
    assert set(stored["measured"]["tau"]["settings"]) >= {"tau0.3-from-1", "tau0.3-from-2"}
    assert "calibrate: tau 0.3 from scale -2: " in out
    verdict = [[line for line in text.splitlines() if line.startswith("calibrate: observe")] for text in (dry, out)]
    assert verdict[0] == verdict[1] and len(verdict[0]) == 1            # the same measurement both times
    assert VARPipeline.from_pretrained(tiny_folder).sparsevar_preset.block == stored["block"]


@pytest.mark.parametrize("flags, message", [
    (["--keep", "1"], "--keep 1.0: give the fraction of tokens kept, strictly between 0 and 1"),
    (["--seeds", "0"], "--seeds 0: give the number of seeds, at least 1"),
    (["--scales", "0"], "--scales 0: give the number of pruned final scales, at least 1"),
    (["--taus", "0.3", "1.5"], "--taus 1.5: give change thresholds in [0, 1)"),
    (["--starts", "-2", "1"], "--starts 1: give first pruned scales counted from the end"),
    (["--prompts", "/nonexistent/prompts.txt"], "--prompts /nonexistent/prompts.txt: no such file"),
])
def test_the_command_names_a_bad_flag_before_loading(tiny_folder, flags, message, capsys):
    before = (tiny_folder / "model_index.json").read_bytes()
    assert cli_main(["calibrate", "--model", str(tiny_folder), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"sparsevar calibrate: error: {message}"), err
    assert (tiny_folder / "model_index.json").read_bytes() == before


def test_the_command_names_a_wrong_folder_before_loading(tiny_folder, tmp_path, capsys):
    assert cli_main(["calibrate", "--model", str(tmp_path / "missing")]) == 2
    assert "is not a folder; give a pipeline folder" in capsys.readouterr().err
    text = tmp_path / "t2i"
    text.mkdir()
    (text / "model_index.json").write_text(json.dumps({"_class_name": "InfinityPipeline"}))
    assert cli_main(["calibrate", "--model", str(text), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a text-to-image model (InfinityPipeline): give the prompts to measure with (--prompts FILE" in err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n")
    assert cli_main(["calibrate", "--model", str(tiny_folder), "--prompts", str(prompts), "--device", "cpu"]) == 2
    assert "holds a class-conditional model (VARPipeline): it takes no prompts" in capsys.readouterr().err


# ---- the threshold ---------------------------------------------------------------------------------------------------
def test_the_baselines_front_is_their_pareto_front_linear_between_its_points():
    points = [(1.5, 20.0), (2.0, 22.0), (3.0, 18.0), (2.5, 17.0), (1.2, 19.0), (3.0, 17.5)]
    front, at = bo.baseline_front(points)
    assert front == [(2.0, 22.0), (3.0, 18.0)]            # the others are slower and farther, or equal and farther
    assert at(1.0) == 22.0 and at(2.0) == 22.0 and at(2.5) == pytest.approx(20.0) and at(3.0) == 18.0
    assert at(3.01) is None                                # faster than every baseline: nothing to compare with


def test_calibrate_tau_stores_the_fastest_setting_that_reaches_the_baselines_front(tiny):
    """Each setting's numbers are the mean PSNR against dense and FLOP speed-up over the seeds (one
    recomputed here by a plain pipeline call); the chosen (tau, start scale) is the fastest whose PSNR
    reaches the front of the two baselines at its speed-up (the rule worked here on the reported
    numbers); a start scale the schedule cannot take is left out."""
    import torch
    from sparsevar.benchmarks.metrics import psnr
    from sparsevar.policies import ScaleSkipConfig, ScaleSkipPolicy
    logged = []
    taus, baselines = (0.3, 0.6, 0.9), ("cond-only-last-1", "skip-last-1")
    S = len(tiny.transformer.config.patch_nums)
    found = bo.calibrate_tau(tiny, seeds=2, taus=taus, baselines=baselines, log=logged.append, starts=(-1, -2, -S))
    table = found["settings"]
    names = [f"tau{t:g}-from-{n}" for n in (1, 2) for t in taus]
    assert set(table) == {*names, *baselines} and found["seeds"] == 2            # from -S: no previous scale
    d = tiny.DEFAULTS

    def picture(seed, policies):
        return tiny([seed % tiny.num_classes], guidance_scale=d.guidance_scale, top_k=d.top_k, top_p=d.top_p,
                    generator=torch.Generator().manual_seed(seed), output_type="pt", policies=policies)

    by_hand = []
    for seed in (0, 1):
        dense = picture(seed, []).images.float().clamp(0, 1)
        skip = picture(seed, [ScaleSkipPolicy(ScaleSkipConfig(skip_last=1))])
        by_hand.append((tiny.flop_speedup(skip.stats[0]), float(psnr(skip.images.float().clamp(0, 1), dense)[0])))
    assert table["skip-last-1"] == pytest.approx([sum(x for x, _ in by_hand) / 2, sum(y for _, y in by_hand) / 2],
                                                 abs=2e-3)
    (s0, p0), (s1, p1) = sorted(table[b] for b in baselines)
    front = [(s0, p0), (s1, p1)] if p0 > p1 else [(s1, p1)]

    def reaches(sp, ps):
        if sp > front[-1][0]:
            return False
        if sp <= front[0][0]:
            return ps >= front[0][1]
        return ps >= p0 + (p1 - p0) * (sp - s0) / (s1 - s0)
    ok = [n for n in names if table[n][0] > 1 and reaches(*table[n])]
    want = max(ok, key=lambda n: table[n][0]) if ok else None
    got = None if found["tau"] is None else f"tau{found['tau']:g}-from-{-found['start_scale']}"
    assert got == want
    assert sum(line.startswith("calibrate: tau ") for line in logged) == len(names) + (want is not None)


def test_a_calibrated_tau_is_stored_checked_and_applied(tiny, tmp_path):
    from sparsevar.policies.sparsevar import check_calibration
    cal = {"block": 1, "granularity": "layer", "tau": 0.35, "start_scale": -1}
    assert check_calibration(cal) == cal
    with pytest.raises(ValueError, match=r"sparsevar_calibration: tau must be in \[0, 1\).*got 1.5"):
        check_calibration({**cal, "tau": 1.5})
    with pytest.raises(ValueError, match=r"it holds \['block', 'granularity'\] \(both\), optionally 'tau', 'start_scale'"):
        check_calibration({"block": 1, "granularity": "layer", "keep_ratio": 0.5})
    tiny.set_sparsevar_calibration(cal)
    try:
        assert (tiny.sparsevar_preset.block, tiny.sparsevar_preset.tau, tiny.sparsevar_preset.start_scale) == \
            (1, 0.35, -1)
        tiny.save_pretrained(tmp_path / "saved")
        assert VARPipeline.from_pretrained(tmp_path / "saved").sparsevar_preset.tau == 0.35
    finally:
        tiny.set_sparsevar_calibration(None)


# ---- the shipped demo model --------------------------------------------------------------------------------------------
def test_the_demo_model_ships_its_measured_layer_and_the_measurement_repeats():
    """The demo folder's calibration came from ``sparsevar calibrate --model demo/weights`` (8 seeds);
    two seeds of the same measurement choose the same layer, far above the family formula's."""
    demo = VARPipeline.from_demo()
    cal = demo.config.sparsevar_calibration
    assert cal is not None and demo.sparsevar_preset.block == cal["block"]
    assert cal["measured"]["capture"] > cal["measured"]["formula_capture"] + 0.3
    # the stored (tau, start scale) is the fastest measured setting that reached the baselines' front (8 seeds)
    found = cal["measured"]["tau"]
    _, at = bo.baseline_front([tuple(found["settings"][b]) for b in bo.TAU_BASELINES])
    reached = [(sp, k) for k, (sp, ps) in found["settings"].items()
               if k.startswith("tau") and at(sp) is not None and ps >= at(sp)]
    assert found["seeds"] == 8 and max(reached)[1] == f"tau{cal['tau']:g}-from-{-cal['start_scale']}"
    assert (demo.sparsevar_preset.tau, demo.sparsevar_preset.start_scale) == (cal["tau"], cal["start_scale"])
    demo.set_progress_bar_config(disable=True)
    again = bo.calibrate(demo, seeds=2, log=lambda s: None, taus=())
    assert (again["granularity"], again["block"]) == (cal["granularity"], cal["block"])
    assert abs(again["measured"]["capture"] - cal["measured"]["capture"]) < 0.1
    # ScaleKV's drafter: measured with `sparsevar calibrate --scalekv --seeds 16` (about 3 min on a CPU)
    kv = demo.config.scalekv_calibration
    gains = {int(k): v for k, v in kv["measured"]["gain_db"].items()}
    assert kv["measured"]["seeds"] == 16 and len(gains) == 8 and kv["drafters"] == [max(gains, key=gains.get)]
    assert demo.scalekv_preset.drafters == tuple(kv["drafters"]) and gains[kv["drafters"][0]] > gains[0]


# ---- ScaleKV's drafter layers (issue #32) -------------------------------------------------------------------------
def test_calibrate_drafters_keeps_the_cache_of_the_layers_whose_full_cache_helps_most(tiny, tmp_path):
    """Every layer alone as drafter against none, paired by seed; the largest mean gain is chosen, the
    gains are what the pictures give, and the choice travels with the folder into the preset."""
    import torch

    from sparsevar.benchmarks.metrics import psnr
    from sparsevar.policies.scalekv import ScaleKVConfig, ScaleKVPolicy
    config = ScaleKVConfig(budget=0.3, min_tokens=0)           # var-tiny's cache never reaches the preset's 650
    tiny.set_sparsevar_calibration(None)
    cal = bo.calibrate_drafters(tiny, seeds=2, config=config, log=lambda m: None)
    gains = {int(k): v for k, v in cal["measured"]["gain_db"].items()}
    assert len(gains) == 4 and cal["drafters"] == [max(gains, key=gains.get)]     # ceil(4 / 16) = 1 drafter

    def picture(seed, drafters):
        policies = [] if drafters is None else [ScaleKVPolicy(ScaleKVConfig(budget=0.3, min_tokens=0,
                                                                            drafters=drafters))]
        return tiny([seed % 10], generator=torch.Generator().manual_seed(seed), output_type="pt",
                    policies=policies).images

    layer = cal["drafters"][0]
    diffs = [float(psnr(picture(s, (layer,)), picture(s, None))[0]) - float(psnr(picture(s, ()), picture(s, None))[0])
             for s in range(2)]
    assert gains[layer] == pytest.approx(sum(diffs) / 2, abs=1e-3)
    assert tiny.scalekv_preset.drafters == (layer,)
    tiny.save_pretrained(tmp_path / "f")
    assert VARPipeline.from_pretrained(tmp_path / "f").scalekv_preset.drafters == (layer,)
    tiny.set_scalekv_calibration(None)
    assert tiny.scalekv_preset.drafters == (0,)
    with pytest.raises(ValueError, match=r"scalekv_calibration does not fit this model: drafters=\(9,\): layer 9 "
                                         r"does not exist; this model has 4 layers"):
        tiny.set_scalekv_calibration({"drafters": [9]})
    with pytest.raises(ValueError, match="count=4: give the number of drafter layers, an int from 1 to 3"):
        bo.calibrate_drafters(tiny, seeds=2, count=4, config=config)


def test_the_command_refuses_drafters_where_scalekv_compresses_nothing(tiny_folder, capsys):
    before = (tiny_folder / "model_index.json").read_bytes()
    assert cli_main(["calibrate", "--model", str(tiny_folder), "--scalekv", "--seeds", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "compress no scale of this model's schedule (it never holds more than min_tokens=650)" in err
    assert cli_main(["calibrate", "--model", str(tiny_folder), "--drafters", "2"]) == 2
    assert "--drafters 2: the number of ScaleKV drafter layers goes with --scalekv" in capsys.readouterr().err
    assert cli_main(["calibrate", "--model", str(tiny_folder), "--scalekv", "--seeds", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("sparsevar calibrate: error: --seeds 1: --scalekv pairs each layer's "
                                               "gain by seed: give 2 or more")
    assert (tiny_folder / "model_index.json").read_bytes() == before
