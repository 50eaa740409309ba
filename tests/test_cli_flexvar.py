"""FlexVAR on the command line (issue #31): generate from the official files at a size and number of
steps, convert → info → generate from the folder (the same picture), bench speed, and the refusals."""
from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest

from sparsevar.cli import main


@pytest.fixture(scope="module")
def files(flexvar_official_files):
    return {"var": str(flexvar_official_files / "FlexVARd2.pth"), "vae": str(flexvar_official_files / "FlexVAE.pth"),
            "trainer": str(flexvar_official_files / "FlexVARd2-trainer.pth")}


def test_size_and_steps_from_the_official_files_then_the_converted_folder(tmp_path, files, capsys):
    a = tmp_path / "a.png"
    assert main(["generate", "--var-ckpt", files["var"], "--vae-ckpt", files["vae"], "--class", "3", "--height", "128",
                 "--width", "128", "--steps", "4", "--out", str(a), "--quiet", "--stats"]) == 0
    out = capsys.readouterr().out
    assert PIL.Image.open(a).size == (128, 128)
    assert "4/4 scales" in out and "8x8" in out
    folder = tmp_path / "flexvar-fixture"
    assert main(["convert", "--ckpt", files["trainer"], "--vae-ckpt", files["vae"], "--out", str(folder)]) == 0
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == ["sparsevar_pipeline", "FlexVARPipeline"]
    capsys.readouterr()
    assert main(["info", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "flexvar" and info["parameters"] > 0
    b = tmp_path / "b.png"
    assert main(["generate", "--model", str(folder), "--class", "3", "--height", "128", "--steps", "4",
                 "--out", str(b), "--quiet"]) == 0
    assert np.array_equal(np.asarray(PIL.Image.open(a)), np.asarray(PIL.Image.open(b)))
    c = tmp_path / "c.png"                                 # the default: 256 px in the reference's 10 steps
    assert main(["generate", "--model", str(folder), "--class", "1", "--out", str(c), "--quiet", "--stats"]) == 0
    assert PIL.Image.open(c).size == (256, 256) and "10/10 scales" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--var-ckpt", "{var}", "--vae-ckpt", "{vae}", "--height", "250"],
     "--height 250: FlexVAR draws pictures whose sides are multiples of 16 px"),
    (["--var-ckpt", "{var}", "--vae-ckpt", "{vae}", "--height", "256", "--width", "512"],
     "--height 256, --width 512: the released FlexVAR models draw square pictures"),
    (["--var-ckpt", "{var}", "--vae-ckpt", "{vae}", "--height", "128", "--steps", "9"],
     "--steps 9: a schedule ending at side 8 (128 px) takes 2 to 8 steps"),
    (["--var-ckpt", "{var}"], "also pass --vae-ckpt FlexVAE.pth"),
    (["--var-ckpt", "{var}", "--vae-ckpt", "{vae}", "--prompt", "a cat"], ""),
    (["--steps", "5"], "--steps 5: only FlexVAR takes a number of scales"),
])
def test_bad_sizes_and_steps_are_one_line_and_leave_nothing(tmp_path, files, capsys, args, message):
    out = tmp_path / "never.png"
    rc = main(["generate", *[a.format(**files) for a in args], "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("*.png"))


def test_bench_speed_runs_flexvar_on_cpu(tmp_path):
    out = tmp_path / "speed.csv"
    assert main(["bench", "speed", "--models", "flexvar-tiny", "--resolution", "128", "--device", "cpu", "--runs", "1",
                 "--warmup", "0", "--methods", "dense", "sparsevar-keep0.5", "--dtype", "float32",
                 "--out", str(out)]) == 0
    import csv
    rows = list(csv.DictReader(out.open()))
    assert [(r["model"], r["resolution"], r["method"]) for r in rows] == [
        ("flexvar-tiny", "128", "dense"), ("flexvar-tiny", "128", "sparsevar-keep0.5")]
    assert float(rows[1]["ideal_speedup"]) > 1.0
    for r in rows:                                   # per image: the end-to-end time over the batch, and its inverse
        assert float(r["e2e_ms_per_image"]) == pytest.approx(float(r["e2e_ms_median"]), rel=1e-3)
        assert float(r["images_per_s"]) == pytest.approx(1e3 / float(r["e2e_ms_median"]), rel=1e-3)


def test_convert_without_its_vae_names_flexvars_own_file(tmp_path, files, capsys):
    """convert reads the transformer's family first, so a missing --vae-ckpt names FlexVAR's VAE
    file only (not VAR's and Infinity's too), and nothing is written."""
    assert main(["convert", "--ckpt", files["var"], "--out", str(tmp_path / "folder")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("also pass --vae-ckpt, its VAE file (FlexVAR's FlexVAE.pth)"), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "folder").exists()
