"""Bad input on the command line, one test per class (issue #27 §3, §4): each mistake gets one line
``sparsevar <command>: error: …`` naming the flag, the value and the fix, exit status 2, before any
work — and leaves no file behind."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsevar.cli import main

REPO = Path(__file__).resolve().parents[1]


def _files(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _fails(argv, capsys, command: str, *messages: str, rc: int = 2) -> str:
    """Run ``sparsevar argv``; check the status and that stderr ends in one error line holding every message."""
    assert main(argv) == rc
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert "Traceback" not in err and last.startswith(f"sparsevar {command}: error: "), err
    for m in messages:
        assert m in last, (m, last)
    return last


# ---- 1. output paths: checked before anything is loaded or generated -------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["generate", "--out", "{tmp}/folder.png"], "--out {tmp}/folder.png: that is a folder; give a file name"),
    (["generate", "--out", "{tmp}/a_file/x.png"], "{tmp}/a_file is a file, so nothing can be written under it"),
    (["generate", "--out", "{tmp}/a_file/"], "--out {tmp}/a_file: that is a file; give a folder name"),
    (["generate", "--out", "{tmp}/x.gif"], "--out {tmp}/x.gif: use a .png, .jpg or .webp file name"),
    # /proc takes no new files, not even from root, whom no permission bit stops: the real probe does
    (["generate", "--out", "/proc/sparsevar-test.png"], "cannot write in /proc (no permission, or a read-only"),
    (["generate", "--class", "1", "2", "--out", "{tmp}/img.png"], "and {tmp}/img_1.png is a folder"),
    (["generate", "--sparsevar", "--save-token-maps", "{tmp}/a_file"], "--save-token-maps {tmp}/a_file: that is a "
                                                                       "file; give a folder name"),
    (["generate", "--sparsevar", "--save-token-maps", "{tmp}/a_file/maps"], "is a file, so nothing can be written"),
    (["convert", "--ckpt", "x.pth", "--vae-ckpt", "y.pth", "--out", "{tmp}/a_file/model"],
     "--out {tmp}/a_file/model: {tmp}/a_file is a file"),
    (["convert", "--ckpt", "x.pth", "--vae-ckpt", "y.pth", "--out", "/proc/sparsevar-model"], "cannot write in /proc"),
    (["train-demo", "--quick", "--out", "{tmp}/a_file/demo"], "{tmp}/a_file is a file"),
    (["bench", "speed", "--device", "cpu", "--models", "var-tiny", "--out", "{tmp}/folder.png"], "that is a folder"),
    (["bench", "quality", "--device", "cpu", "--out", "{tmp}/a_file"], "--out {tmp}/a_file: that is a file"),
    # the second campaign: names the file system cannot hold (the temporary name is 5 bytes longer), no name
    (["generate", "--out", "{tmp}/" + "a" * 252 + ".png"], "File name too long; choose another path"),
    (["generate", "--out", "{tmp}/" + "a" * 250 + ".png"], "a name in it is too long for this file system (259 "
                                                           "bytes, at most 255, temporary name included)"),
    (["convert", "--ckpt", "x.pth", "--vae-ckpt", "y.pth", "--out", ".", "--overwrite"],
     "--out .: give the new folder a name (e.g. model)"),
    (["train-demo", "--out", "{tmp}/..", "--quick"], "'.', '..' and '/' cannot be replaced"),
    # a --model path that does not exist, for prompts: not "an Infinity transformer checkpoint"
    (["generate", "--model", "{tmp}/missing", "--prompt", "a fox", "--out", "{tmp}/x.png"],
     "model='{tmp}/missing': no such file or folder; give a converted folder"),
])
def test_output_paths_are_checked_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "img_1.png").mkdir()
    (tmp_path / "a_file").write_text("x")
    before = _files(tmp_path)
    fill = {"tmp": str(tmp_path)}
    _fails([a.format(**fill) for a in argv], capsys, argv[0] if argv[0] != "bench" else "bench",
           message.format(**fill))
    assert _files(tmp_path) == before                         # nothing written, no .tmp / .partial left


def test_images_are_written_whole_with_no_temporary_file_left(tmp_path, var_official_files, capsys):
    out = tmp_path / "sub" / "dir" / "img.jpg"                   # folders made on the way
    assert main(["generate", "--var-ckpt", str(var_official_files["var"]), "--vae-ckpt",
                 str(var_official_files["vae"]), "--class", "3", "--num", "2", "--out", str(out), "--quiet"]) == 0
    assert _files(tmp_path) == {"sub", "sub/dir", "sub/dir/img_0.jpg", "sub/dir/img_1.jpg"}
    import PIL.Image
    assert PIL.Image.open(out.with_name("img_1.jpg")).format == "JPEG"


# ---- 2. impossible values: device, seed, sizes, counts, ranges -------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["generate", "--device", "bogus"], "--device bogus: not a device; use auto, cpu, cuda or cuda:N"),
    (["generate", "--seed", "-1"], "--seed -1: seeds are 0 … 18446744073709551615"),
    (["generate", "--seed", str(2 ** 64)], f"--seed {2 ** 64}: seeds are 0 … 18446744073709551615"),
    (["generate", "--prompt", "a fox", "--height", "0", "--width", "0"],
     "--height 0: give a positive number of pixels, an Infinity size (height x width): 256x256, 512x512, 768x768, "
     "1024x1024 for 1:1"),
    (["generate", "--prompt", "a fox", "--width", "-512"], "--width -512: give a positive number of pixels"),
    (["generate", "--prompt", "a fox", "--height", "300"], "--height 300 --width 1024: height=300, width=1024 is not "
                                                           "an Infinity size"),
    (["generate", "--num", "0"], "--num 0: give the number of images per class, 1 or more"),
    (["generate", "--cfg", "-1"], "--cfg -1.0: give a guidance scale in [0, 100] (0 disables guidance)"),
    (["generate", "--cfg", "nan"], "--cfg nan: give a guidance scale in [0, 100]"),
    (["generate", "--cfg", "1e308"], "--cfg 1e+308: give a guidance scale in [0, 100]"),   # was: garbage, exit 0
    (["generate", "--prompt", "a fox", "--cfg", "101"], "--cfg 101.0: give a guidance scale in [0, 100] (1 disables "
                                                        "guidance)"),
    (["generate", "--top-k", "-1"], "--top-k -1: give 0 (no limit) or more"),
    (["generate", "--top-p", "1.5"], "--top-p 1.5: give a probability in [0, 1]"),
    (["generate", "--top-p", "-0.1"], "--top-p -0.1: give a probability in [0, 1]"),
    (["generate", "--prompt", "a fox", "--temperature", "0"], "--temperature 0.0: give a temperature > 0"),
    (["generate", "--temperature", "0.5"], "--temperature is for text-to-image: add --prompt"),
    (["generate", "--skip-last", "-1"], "--skip-last -1: give the number of final scales to skip, 0 or more"),
    (["generate", "--sparsevar", "--keep-ratio", "2"], "--sparsevar --keep-ratio 2.0: keep_ratio must be in (0, 1]"),
    (["generate", "--sparsevar", "--tau", "1"], "--sparsevar --tau 1.0: tau must be in [0, 1)"),
    (["generate", "--sparsevar", "--alpha", "0"], "--sparsevar --alpha 0: alpha must be an int >= 1"),
    (["generate", "--fastvar", "2"], "--fastvar 2: every prune ratio must be in [0, 1]"),
    (["generate", "--sparvar", "0"], "--sparvar 0: top_keys must be in (0, 1]"),
    (["generate", "--sparvar", "-0.5"], "--sparvar -0.5: top_keys must be in (0, 1]"),
    (["generate", "--sparvar", "--fastvar"], "--sparvar and --fastvar cannot be combined (SparVAR selects keys among "
                                             "every token of the cache"),
    (["generate", "--fastvar", "1", "0.5"], "--fastvar 1 0.5: ratios=(1.0, 0.5): 1.0 (skip the scale) is allowed only"),
    (["generate", "--compile", "--device", "cpu"], "--compile fuses CUDA kernels; the model runs on cpu"),
    (["generate", "--compile", "--kernels", "torch"], "--compile --kernels torch: --compile means --kernels triton; "
                                                      "give one of them"),
    (["generate", "--kernels", "triton", "--device", "cpu"],
     "--kernels triton fuses CUDA kernels; the model runs on cpu: drop --kernels or use --device cuda"),
    (["bench", "speed", "--device", "cpu", "--batch", "0"], "--batch 0: give batch sizes of 1 or more"),
    (["bench", "speed", "--device", "cpu", "--runs", "0"], "--runs 0: time each setting at least once"),
    (["bench", "speed", "--device", "cpu", "--warmup", "-1"], "--warmup -1: give the number of untimed runs"),
    (["bench", "speed", "--device", "cpu", "--resolution", "0"], "--resolution 0: give a positive image side"),
    (["bench", "speed", "--device", "cpu", "--models", "var-d99"], "--models var-d99: unknown; choose from"),
    (["bench", "speed", "--device", "cpu", "--methods", "fast"], "--methods fast: unknown; choose from"),
    (["bench", "speed", "--device", "bogus"], "--device bogus: not a device"),
    (["bench", "quality", "--device", "cpu", "--top-p", "2"], "--top-p 2.0: give a probability in [0, 1]"),
    (["bench", "quality", "--device", "cpu", "--warmup", "-1"], "--warmup -1: give the number of untimed"),
    (["bench", "ops", "--runs", "0"], "--runs 0: time each op at least once"),
    (["train-demo", "--seed", "-5"], "--seed -5: seeds are 0 …"),
    (["train-demo", "--device", "bogus"], "--device bogus: not a device"),
    # the second campaign
    (["generate", "--device", "meta"], "--device meta: sparsevar runs on cpu or cuda (cuda:N); 'meta' is not "
                                       "available here"),
    (["generate", "--fastvar-layers", "3", "27"], "--fastvar-layers sets FastVAR's pruning layers: add --fastvar"),
    (["generate", "--fastvar", "--fastvar-layers", "3", "1"], "--fastvar --fastvar-layers 3 1: layer_range must be "
                                                              "(first, last) ints with first <= last"),
    (["bench", "speed", "--device", "cpu", "--models", "infinity-tiny", "--resolution", "300"],
     "--resolution 300: height=300, width=300 is not an Infinity size"),
])
def test_impossible_values_are_refused_naming_the_flag(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)                               # where every default output would go
    _fails(argv, capsys, argv[0], message)
    assert _files(tmp_path) == set()


@pytest.mark.parametrize("argv, message", [
    (["--num", str(10 ** 8)], f"--num {10 ** 8} × 1 class(es) = {10 ** 8} images in one run needs at least"),
    (["--skip-last", "10"], "--skip-last 10: skip_last=10 would skip every scale: this model has 10 scales, so use "
                            "0..9"),
    (["--sparsevar", "--block", "99"], "--sparsevar --block 99: block=99 is not a layer of this model: use 0..1"),
    (["--sparsevar", "--start-scale", "0"], "--sparsevar --start-scale 0: start_scale=0 is the first scale"),
    (["--cond-only-from", "12"], "--cond-only-from 12: cond_only_from=12 is past the schedule"),
])
def test_values_the_model_cannot_take_are_refused_before_generating(tmp_path, var_official_files, capsys, argv,
                                                                    message):
    f = var_official_files
    line = _fails(["generate", "--var-ckpt", str(f["var"]), "--vae-ckpt", str(f["vae"]), *argv,
                   "--out", str(tmp_path / "x.png"), "--quiet"], capsys, "generate", message)
    if "--num" in argv:                                        # the estimate, and what this machine has
        assert re.search(r"needs at least [\d.]+ TB \(KV cache [\d.]+ TB, .*\) on cpu, and [\d.]+ [GT]B is "
                         r"available: at most \d+ image\(s\) fit in one run; lower --num", line), line
    assert _files(tmp_path) == set()


def test_nothing_is_written_when_nothing_could_be_made(tmp_path, var_official_files, capsys, monkeypatch):
    """Found by the second campaign: token maps asked of a SparseVAR that pruned nothing (the image
    used to be written, then exit 2 with Python advice), and a benchmark whose every setting
    failed (exit 0 with nothing measured)."""
    f = var_official_files
    line = _fails(["generate", "--var-ckpt", str(f["var"]), "--vae-ckpt", str(f["vae"]), "--sparsevar", "--tau", "0",
                   "--save-token-maps", str(tmp_path / "maps"), "--out", str(tmp_path / "x.png"), "--quiet"],
                  capsys, "generate", "--save-token-maps: SparseVAR left every token in", "nothing was written")
    assert "pipe." not in line
    monkeypatch.chdir(tmp_path)
    _fails(["bench", "speed", "--device", "cpu", "--models", "var-tiny", "--batch", str(10 ** 8), "--runs", "1",
            "--warmup", "0", "--methods", "dense", "--out", "speed.csv"], capsys, "bench",
           "no setting could run (the lines above say why); nothing was written")
    assert _files(tmp_path) == set()


def test_python_calls_refuse_the_same_values(var_official_files):
    """The checks live in the pipelines' check_inputs, so Python users get them too, in Python's terms."""
    import torch

    from sparsevar import InfinityPipeline, VARPipeline
    from sparsevar.engine.kv_cache import KVCache
    pipe = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    cfg = pipe.transformer.config
    one_image = KVCache(cfg.depth, 2, cfg.num_heads, cfg.embed_dim // cfg.num_heads, 680, torch.float32, "cpu")
    assert pipe.memory_needed(10 ** 8)["KV cache"] == 10 ** 8 * one_image.nbytes()    # what the engine allocates
    with pytest.raises(ValueError, match=r"num_images_per_prompt=100000000 × 1 class label\(s\) = 100000000 images "
                                         r"needs at least .* is available: at most \d+ image\(s\) fit"):
        pipe([3], num_images_per_prompt=10 ** 8)
    inf = InfinityPipeline.from_random("infinity-tiny")
    for h, w in ((0, 0), (1024, -8)):
        with pytest.raises(ValueError, match=r"(height=0|width=-8): give a positive number of pixels, an official "
                                             r"size .*1024x1024 for 1:1; InfinityPipeline.valid_sizes\(\)"):
            inf("a fox", height=h, width=w, generator=torch.Generator().manual_seed(0))


# ---- 3. SIGTERM during convert cleans up like Ctrl-C -------------------------------------------------------
def test_sigterm_during_convert_leaves_no_partial_folder(tmp_path, tiny_infinity_files):
    f = tiny_infinity_files()
    out, partial = tmp_path / "inf", tmp_path / ".inf.partial"
    proc = subprocess.Popen([sys.executable, "-m", "sparsevar", "convert", "--ckpt", str(f["transformer"]),
                             "--vae-ckpt", str(f["vae"]), "--text-encoder", str(f["t5"]), "--out", str(out)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    caught = False
    try:
        while proc.poll() is None:
            if partial.exists():
                proc.send_signal(signal.SIGSTOP)               # hold it mid-write, see where it is, signal it there
                caught = partial.exists() and not out.exists()
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)
                break
            time.sleep(0.001)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert caught, "the conversion finished before its .partial folder was seen"
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "sparsevar convert: stopped by SIGTERM" and "Traceback" not in err
    assert _files(tmp_path) == set()                         # neither the folder nor its hidden .partial


# ---- 4. the command line gives command-line advice ---------------------------------------------------------
def test_errors_name_the_flags_not_the_python_api(tmp_path, var_official_files, tiny_infinity_files, capsys):
    from sparsevar.demo import CLASS_NAMES
    f = var_official_files
    out = ["--out", str(tmp_path / "x.png"), "--quiet"]
    line = _fails(["generate", "--sparsevar", "--fastvar", *out], capsys, "generate",
                  "--sparsevar and --fastvar cannot be combined")
    assert "disable_" not in line
    # the demo model has names: a typo gets suggestions and the command that lists them
    line = _fails(["generate", "--class", "tre", *out], capsys, "generate",
                  "--class tre: unknown class name 'tre'. Did you mean 'tree'? `sparsevar info --labels` lists all "
                  f"{len(CLASS_NAMES)} names; or give a class id 0..{len(CLASS_NAMES) - 1}")
    assert "pipe." not in line
    line = _fails(["generate", "--var-ckpt", str(f["var"]), "--vae-ckpt", str(f["vae"]), "--class", "dog", *out],
                  capsys, "generate", "--class dog: class name 'dog' given, but this model has no class names. "
                                      "Give a class id 0..9")
    assert "id2label" not in line
    # and the command it names exists
    assert main(["info", "--labels"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{i}: {n}" for i, n in enumerate(CLASS_NAMES)]
    assert main(["info", "--labels", str(f["var"])]) == 0
    assert capsys.readouterr().out.strip() == f"{f['var']} has 10 classes and no class names: pass ids 0..9 to --class"
    _fails(["info", "--labels", str(tiny_infinity_files()["transformer"])], capsys, "info",
           "is an infinity model, not a class-conditional VAR one")
    _fails(["bench", "quality", "--device", "cpu", "--classes", "tre", "--seeds", "1", "--out", str(tmp_path / "q")],
           capsys, "bench", "--classes tre: unknown class name 'tre'. Did you mean 'tree'? `sparsevar info --labels` "
                            "lists the names")
    # a preset the flags cannot reach is named with the flag that can: Infinity-2B's FastVAR layers on a 4-layer model
    _fails(["generate", "--prompt", "a fox", "--height", "256", "--width", "256", "--fastvar", *out], capsys,
           "generate", "--fastvar: layer_range=(3, 27) is outside this model's layers: use indices 0..3 "
                       "(--fastvar-layers FIRST LAST)")
    assert _files(tmp_path) == set()


# ---- 5. what a new user reads: the progress bar, the counts, the help -------------------------------------
def test_progress_bar_counts_and_help_say_what_happened(tmp_path, var_official_files, capsys, monkeypatch):
    f = var_official_files
    out = tmp_path / "s.png"
    assert main(["generate", "--var-ckpt", str(f["var"]), "--vae-ckpt", str(f["vae"]), "--class", "3",
                 "--fastvar", "0.5", "0.5", "--skip-last", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    bar = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert "10/10" in bar and "1 skipped" in bar              # the bar ends at the total, saying what was skipped
    summary = re.search(r"(\d+)/(\d+) scales, (\S+)/(\d+) tokens computed", captured.out)
    assert summary.group(1, 2, 4) == ("9", "10", "680")
    assert re.fullmatch(r"\d+", summary.group(3)), captured.out   # a count of tokens, not "404.0"
    # train-demo writes to ./sparsevar-demo unless told otherwise, never into the installed package
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sparsevar-demo").write_text("x")
    _fails(["train-demo", "--quick"], capsys, "train-demo", "--out sparsevar-demo: that is a file")
    readme_minutes = re.search(r"`sparsevar train-demo` trains .*? in (\d+) minutes", (REPO / "README.md").read_text())
    for argv in (["--help"], ["train-demo", "--help"]):             # the command list and the command's own help
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert f"about {readme_minutes.group(1)} min on one H100" in text, text
    assert "into ./sparsevar-demo unless --out says otherwise" in text and "the package is left as it is" in text


# ---- 6. third campaign: empty paths, odd class ids, clashing outputs, repeated flags ------------------------
@pytest.mark.parametrize("argv, message", [
    # an unset shell variable: was read as "not given" (the demo model drew, or maps went into ./)
    (["generate", "--model", ""], "--model is empty (an unset shell variable?): give a path, or leave --model out"),
    (["generate", "--var-ckpt", "", "--vae-ckpt", ""], "--var-ckpt is empty"),
    (["generate", "--prompt", "a fox", "--text-encoder", " "], "--text-encoder is empty"),
    (["generate", "--sparsevar", "--save-token-maps", ""], "--save-token-maps is empty"),
    # the token maps' folder where an image goes: the image was written, then exit 1 "[Errno 17] File exists"
    (["generate", "--sparsevar", "--save-token-maps", "img.png", "--out", "img.png"],
     "--save-token-maps img.png: that is where --out writes an image; give the token maps a folder of their own "
     "(e.g. img_maps)"),
    (["generate", "--sparsevar", "--num", "2", "--save-token-maps", "./img_1.png", "--out", "img.png"],
     "that is where --out writes an image"),
    # a digit that is not a number: was int()'s own message
    (["generate", "--class", "²"], "--class ²: unknown class name '²'."),
])
def test_empty_paths_odd_ids_and_clashing_outputs_are_refused(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    _fails(argv + ([] if "--out" in argv else ["--out", "x.png"]) + ["--quiet"], capsys, "generate", message)
    assert _files(tmp_path) == set()


def test_repeated_class_and_prompt_flags_add_up(tmp_path, capsys):
    """`--class 1 --class tree` drew class 'tree' alone (argparse kept the last): both are drawn, as
    `--class 1 tree` draws them."""
    import numpy as np
    import PIL.Image
    assert main(["generate", "--class", "1", "--class", "tree", "--out", str(tmp_path / "x.png"), "--quiet"]) == 0
    assert main(["generate", "--class", "1", "tree", "--out", str(tmp_path / "y.png"), "--quiet"]) == 0
    assert _files(tmp_path) == {"x_0.png", "x_1.png", "y_0.png", "y_1.png"}
    for i in (0, 1):
        a, b = (np.asarray(PIL.Image.open(tmp_path / f"{n}_{i}.png")) for n in "xy")
        assert a.shape == (256, 256, 3) and np.array_equal(a, b)
    assert main(["generate", "--prompt", "a", "--prompt", "b", "--height", "256", "--width", "256",
                 "--out", str(tmp_path / "p.png"), "--quiet"]) == 0
    assert {"p_0.png", "p_1.png"} <= _files(tmp_path) and "p.png" not in _files(tmp_path)


@pytest.mark.parametrize("argv, command, message", [
    (["generate", "--class", "1", "--cfg", "500", "--out", "x.png"], "generate",
     "--cfg 500.0: give a guidance scale in [0, 100]"),
    (["generate", "--class", "1", "--out", "x.txt"], "generate", "--out x.txt: use a .png, .jpg or .webp file name"),
    (["info", "missing.pth"], "info", "missing.pth not found"),
    (["convert", "--ckpt", "missing.pth", "--out", "model"], "convert", "--ckpt missing.pth not found"),
])
def test_a_wrong_flag_is_refused_before_torch_and_diffusers_are_imported(argv, command, message, tmp_path):
    """In a fresh interpreter, `python -m sparsevar` refuses a flag it can check alone with its error
    line, and neither torch nor diffusers has been imported by then (the package's public names,
    the engine's and the pipelines' load at first use)."""
    probe = ("import runpy, sys\n"
             f"sys.argv = ['sparsevar', *{argv!r}]\n"
             "try:\n    runpy.run_module('sparsevar', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('EXIT', code, 'torch' in sys.modules, 'diffusers' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert f"sparsevar {command}: error: {message}" in done.stderr, done.stderr
    assert done.stdout.split()[-4:] == ["EXIT", "2", "False", "False"], (done.stdout, done.stderr)
    assert _files(tmp_path) == set()
