"""Many images into a folder (issue #33): numbered files, run.json and manifest.jsonl, per-image seeds
that do not depend on the batch size, and resuming — a rerun finishes what is missing and writes
nothing else."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from sparsevar.cli import main
from sparsevar.pipelines.batch import image_seed


def _pixels(path):
    return np.asarray(PIL.Image.open(path)).astype(np.int16)


def _rows(folder):
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]


@pytest.fixture
def tiny(var_official_files):
    """The CLI arguments of the fixture's official-format VAR checkpoints (10 classes, 256 px): the
    folder mechanics at a fraction of the demo model's cost."""
    return ["--var-ckpt", str(var_official_files["var"]), "--vae-ckpt", str(var_official_files["vae"])]


def test_folder_run_writes_numbered_images_and_resumes(tmp_path, capsys, tiny):
    out = tmp_path / "run"
    assert main(["generate", *tiny, "--class", "8", "4", "--num", "2", "--out", f"{out}/", "--quiet",
                 "--batch-size", "3"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["00000.png", "00001.png", "00002.png", "00003.png", "manifest.jsonl", "run.json"]
    rows = _rows(out)
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [r["class"] for r in rows] == [8, 4, 8, 4]                       # copy-major
    assert [r["seed"] for r in rows] == [image_seed(0, i) for i in range(4)]
    assert [r["batch"]["batch_size"] for r in rows] == [3, 3, 3, 1] and {r["process_index"] for r in rows} == {0}
    for r in rows:                                       # each image's share of its call's time
        assert r["image_ms"] > 0 and r["image_ms"] == pytest.approx(r["batch"]["call_ms"] / r["batch"]["batch_size"],
                                                                    abs=1e-3)
        assert r["batch"]["call_ms"] >= r["batch"]["scale_loop_ms"] + r["batch"]["decode_ms"]
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(["generate", *tiny, "--class", "8", "4", "--num", "2", "--out", f"{out}/", "--quiet"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps        # nothing written
    # an interrupted run: image 1 lost, image 2's manifest row lost → both redone, the same pictures
    before = {i: _pixels(out / f"0000{i}.png") for i in (1, 2)}
    (out / "00001.png").unlink()
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["index"] != 2))
    assert main(["generate", *tiny, "--class", "8", "4", "--num", "3", "--out", str(out), "--quiet"]) == 0
    assert sorted(r["index"] for r in _rows(out)) == [0, 1, 2, 3, 4, 5]           # and --num 3 added 4, 5
    for i in (1, 2):
        assert np.abs(_pixels(out / f"0000{i}.png") - before[i]).max() <= 1
    assert (out / "00000.png").stat().st_mtime_ns == stamps["00000.png"]


class _Fails:
    """A picture whose encoding fails (a full disk, a bad image) once its turn comes."""

    def save(self, path, format=None):
        raise OSError(28, "No space left on device")


def test_background_writers_write_what_save_writes_and_leave_nothing_after_a_failure(tmp_path):
    from sparsevar.pipelines.batch import FolderRun
    rng = np.random.default_rng(0)
    pictures = [PIL.Image.fromarray(rng.integers(0, 256, (64, 48, 3), dtype=np.uint8)) for _ in range(7)]
    batches = [[0, 1, 2], [3, 4], [5, 6]]
    for folder, writers in ((tmp_path / "sync", 0), (tmp_path / "bg", 3)):
        run = FolderRun(folder, {"seed": 0}, writers=writers)
        run.start()
        for idx in batches:
            run.save(idx, [pictures[i] for i in idx], [{"class": i % 3} for i in idx], "PNG")
        run.flush()
        run.close()
    for i in range(7):
        assert (tmp_path / "bg" / f"0000{i}.png").read_bytes() == (tmp_path / "sync" / f"0000{i}.png").read_bytes()
    assert sorted(r["index"] for r in _rows(tmp_path / "bg")) == list(range(7))
    assert sorted(map(json.dumps, _rows(tmp_path / "bg"))) == sorted(map(json.dumps, _rows(tmp_path / "sync")))
    # a failing image: its batch and the ones after it leave no file, no temporary file and no row
    run = FolderRun(tmp_path / "f", {"seed": 0}, writers=2)
    run.start()
    run.save([0, 1], pictures[:2], [{}, {}], "PNG")
    run.flush()
    with pytest.raises(OSError, match="No space left"):
        run.save([2, 3], [pictures[2], _Fails()], [{}, {}], "PNG")
        run.save([4, 5], pictures[4:6], [{}, {}], "PNG")
        run.flush()
    run.close()
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["00000.png", "00001.png", "manifest.jsonl",
                                                                    "run.json"]
    assert [r["index"] for r in _rows(tmp_path / "f")] == [0, 1]


def test_images_do_not_depend_on_the_batch_size(tmp_path, tiny):
    """Each image draws from its own seed (base seed, index): batch 1 and batch 4 give the same
    pictures (to one level of 255: batched and single products round differently)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, bs in ((a, "4"), (b, "1")):
        assert main(["generate", *tiny, "--class", "1", "2", "--num", "2", "--seed", "7", "--out", f"{folder}/",
                     "--quiet", "--batch-size", bs]) == 0
    for i in range(4):
        assert np.abs(_pixels(a / f"0000{i}.png") - _pixels(b / f"0000{i}.png")).max() <= 1
    assert np.abs(_pixels(a / "00000.png") - _pixels(a / "00002.png")).mean() > 1      # two draws of one class differ


def test_prompts_file_into_a_folder(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w4\n\n  w5 w6 w7  \n")
    out = tmp_path / "t"
    assert main(["generate", "--prompts", str(prompts), "--height", "256", "--width", "256", "--out", f"{out}/",
                 "--quiet"]) == 0
    assert [r["prompt"] for r in _rows(out)] == ["w3 w4", "w5 w6 w7"]
    assert json.loads((out / "run.json").read_text())["prompts"] == ["w3 w4", "w5 w6 w7"]


def test_a_finished_run_of_prompts_loads_nothing(tmp_path, capsys):
    """Rerunning a finished run of prompts finds nothing to do before any model is loaded: here the
    model folder is gone by then, and the rerun still succeeds, writing nothing."""
    import shutil

    from sparsevar import InfinityPipeline
    model, out = tmp_path / "model", tmp_path / "run"
    InfinityPipeline.from_random("infinity-tiny").save_pretrained(model)
    flags = ["generate", "--model", str(model), "--prompt", "w3 w4", "--height", "256", "--width", "256",
             "--out", f"{out}/", "--quiet"]
    assert main(flags) == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    shutil.rmtree(model)
    capsys.readouterr()
    assert main(flags) == 0
    assert "nothing to do: the 1 image(s) are in" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    assert main([*flags[:-1], "--num", "2", "--quiet"]) == 2                 # one more image needs the model
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_a_finished_run_of_class_ids_loads_nothing(tmp_path, capsys, var_official_files):
    """The same for classes given as ids (names need the model to resolve): the checkpoints are gone
    by the rerun, which still succeeds and writes nothing; one more image needs them again."""
    import shutil
    ckpt = {k: tmp_path / Path(v).name for k, v in var_official_files.items() if k in ("var", "vae")}
    for k, dst in ckpt.items():
        shutil.copy(var_official_files[k], dst)
    out = tmp_path / "run"
    flags = ["generate", "--var-ckpt", str(ckpt["var"]), "--vae-ckpt", str(ckpt["vae"]), "--class", "3", " 5",
             "--out", f"{out}/", "--quiet"]
    assert main(flags) == 0
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    for dst in ckpt.values():
        dst.unlink()
    capsys.readouterr()
    assert main(flags) == 0
    assert "nothing to do: the 2 image(s) are in" in capsys.readouterr().out
    assert main([*flags, "--num", "2"]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_a_finished_run_of_class_names_loads_nothing(tmp_path, capsys, var_official_files):
    """Class names are read from the folder's model_index.json: a finished run of names finds
    nothing to do with the weights gone, and an unknown name is reported without loading them."""
    from sparsevar import VARPipeline
    plain = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    model, out = tmp_path / "model", tmp_path / "run"
    VARPipeline(transformer=plain.transformer, vqvae=plain.vqvae,
                id2label={i: f"shape {i}, form{i}" for i in range(plain.num_classes)}).save_pretrained(model)
    flags = ["generate", "--model", str(model), "--class", "shape 3", "form5", "--out", f"{out}/", "--quiet"]
    assert main(flags) == 0
    assert [r["class"] for r in _rows(out)] == [3, 5]
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    weights = sorted(model.rglob("*.safetensors"))
    assert weights
    for f in weights:
        f.unlink()
    capsys.readouterr()
    assert main(flags) == 0
    assert "nothing to do: the 2 image(s) are in" in capsys.readouterr().out
    assert main([*flags[:-1], "--class", "shape 3", "shape 33", "--quiet"]) == 2
    assert "--class shape 33: unknown class name 'shape 33'" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


@pytest.mark.parametrize("args, message", [
    (["--class", "tree", "--out", "{tmp}/x.png", "--batch-size", "2"], "--batch-size 2: only for a folder --out"),
    (["--class", "tree", "--out", "{tmp}/f/", "--batch-size", "0"], "--batch-size 0: give the number of images"),
    (["--prompts", "{tmp}/missing.txt", "--out", "{tmp}/f/"], "--prompts {tmp}/missing.txt: No such file"),
    (["--class", "tree", "--out", "{tmp}/f/", "--sparsevar", "--save-token-maps", "{tmp}/m"],
     "--save-token-maps writes one generation's maps"),
    (["--class", "tree", "--out", "{tmp}/x.png", "--num-processes", "2"], "--num-processes 2: only for a folder"),
])
def test_folder_mode_errors_are_one_line(tmp_path, capsys, args, message):
    assert main(["generate", *[a.format(tmp=tmp_path) for a in args], "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(tmp=tmp_path) in err and len(err.splitlines()) == 1
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("argv, message", [
    (["generate", "--num-per-prompts", "2"], "sparsevar generate: error: --num-per-prompts: unknown option; did you "
                                             "mean --num-per-prompt?"),
    (["generate", "--num-processes", "two"], "sparsevar generate: error: --num-processes two: give a whole number"),
    (["generate", "--cfg", "high"], "sparsevar generate: error: --cfg high: give a number"),
    (["generate", "--dtype", "fp8"], "sparsevar generate: error: --dtype fp8: not one of the choices; choose from"),
    (["generate", "--seed"], "sparsevar generate: error: --seed: expected one argument; `sparsevar generate --help`"),
    (["generate", "seven"], "sparsevar generate: error: seven: an argument no option takes"),
    (["bench", "speed", "--runz", "3"], "sparsevar bench speed: error: --runz: unknown option; did you mean --runs?"),
    (["generat"], "sparsevar: error: generat: not a command; choose from "),     # (quoted or not by Python version)
    (["generate", "--num-per-prompt", "two"], "sparsevar generate: error: --num/--num-per-prompt two: give a whole "
                                              "number"),
    (["generate", "--class", "1", "--", "x"], "sparsevar generate: error: x: an argument no option takes"),
])
def test_argument_errors_are_one_line_with_a_fix(capsys, argv, message):
    """Mistakes that argparse itself finds get the command line's one-line form (no usage block),
    with status 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1, err


def test_a_folder_of_another_run_is_refused_naming_the_setting(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["generate", "--class", "tree", "--out", f"{out}/", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["generate", "--class", "tree", "--cfg", "2", "--out", f"{out}/", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "holds a run with cfg=None, this one has cfg=2.0" in err
    # the precision changes the pictures too: recorded as resolved (auto is float32 on the CPU)
    assert json.loads((out / "run.json").read_text())["dtype"] == "float32"
    assert main(["generate", "--class", "tree", "--dtype", "bfloat16", "--out", f"{out}/", "--quiet"]) == 2
    assert "holds a run with dtype='float32', this one has dtype='bfloat16'" in capsys.readouterr().err
    assert main(["generate", "--class", "tree", "--dtype", "float32", "--out", f"{out}/", "--quiet"]) == 0
    assert len(list(out.glob("*.png"))) == 1
    # a run begun before run.json recorded the precision (no "format") still resumes
    saved = json.loads((out / "run.json").read_text())
    old = {k: v for k, v in saved.items() if k not in ("format", "dtype")}
    (out / "run.json").write_text(json.dumps(old))
    assert main(["generate", "--class", "tree", "--num", "2", "--out", f"{out}/", "--quiet"]) == 0
    assert len(list(out.glob("*.png"))) == 2 and json.loads((out / "run.json").read_text()) == old


def test_two_processes_share_the_folder_and_draw_the_same_images(tmp_path, tiny):
    """--num-processes 2 on the CPU really starts two processes through accelerate (both write rows)
    and, taking whole batches in turn, writes the very files a single process writes (with the same
    number of CPU threads: it changes how the CPU's sums round, and accelerate gives each of N
    processes 1/N of the cores unless OMP_NUM_THREADS says otherwise)."""
    import os
    import subprocess
    import sys
    two, one = tmp_path / "two", tmp_path / "one"
    base = [sys.executable, "-m", "sparsevar", "generate", *tiny, "--class", "8", "4", "--num-per-prompt", "2",
            "--batch-size", "2", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    said = []
    for cmd in (base + ["--out", f"{two}/", "--num-processes", "2"], base + ["--out", f"{one}/"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        said.append(res.stdout)
    assert "batch 2, 2 processes |" in said[0] and "batch 2 |" in said[1]
    rows = {r["index"]: r for r in _rows(two)}
    assert sorted(rows) == [0, 1, 2, 3] and [rows[i]["process_index"] for i in range(4)] == [0, 0, 1, 1]
    for i in range(4):
        assert (two / f"0000{i}.png").read_bytes() == (one / f"0000{i}.png").read_bytes(), i


def test_a_prompts_file_under_two_cpu_processes_is_read_once(tmp_path):
    """--prompts with --num-processes on the CPU: the processes are forked with the parsed arguments,
    and each draws the file's prompts once (it had appended the file to the prompts again)."""
    import os
    import subprocess
    import sys
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w4\nw5 w6\n")
    out = tmp_path / "t"
    res = subprocess.run([sys.executable, "-m", "sparsevar", "generate", "--prompts", str(prompts), "--height", "256",
                          "--width", "256", "--batch-size", "1", "--num-processes", "2", "--out", f"{out}/", "--quiet"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out / "run.json").read_text())["prompts"] == ["w3 w4", "w5 w6"]
    rows = sorted(_rows(out), key=lambda r: r["index"])
    assert [(r["index"], r["prompt"], r["process_index"]) for r in rows] == [(0, "w3 w4", 0), (1, "w5 w6", 1)]
