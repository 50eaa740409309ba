"""The command line: every command end to end on the fixture checkpoints, and its error handling
(one line, exit status 2, no file left behind)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import torch

from sparsevar.cli import main


def test_generate_from_official_files_writes_one_file_per_image(tmp_path, var_official_files, capsys):
    out = tmp_path / "img.png"
    rc = main(["generate", "--var-ckpt", str(var_official_files["var"]), "--vae-ckpt", str(var_official_files["vae"]),
               "--class", "3", "7", "--num", "2", "--out", str(out), "--quiet", "--top-k", "5"])
    assert rc == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["img_0.png", "img_1.png", "img_2.png", "img_3.png"]
    assert "4 image(s)" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--var-ckpt", "{var}"], "also pass --vae-ckpt"),
    (["--var-ckpt", "{vae}", "--vae-ckpt", "{vae}"], "pass it as the VAE"),
    (["--var-ckpt", "{var}", "--vae-ckpt", "{vae}", "--class", "10"], "out of range"),
    (["--var-ckpt", "{var}", "--vae-ckpt", "{vae}", "--class", "dog"], "no class names"),
    (["--var-ckpt", "{var}", "--vae-ckpt", "{vae}", "--class", "3", "--cfg", "-1"], "--cfg -1.0: give a guidance scale in [0, 100]"),
    (["--var-ckpt", "missing.pth", "--vae-ckpt", "{vae}"], "not found"),
    (["--model", "{tmp}"], "model_index.json"),
])
def test_generate_errors_are_one_line_and_leave_nothing(tmp_path, var_official_files, capsys, args, message):
    fill = {"var": str(var_official_files["var"]), "vae": str(var_official_files["vae"]), "tmp": str(tmp_path)}
    out = tmp_path / "never.png"
    rc = main(["generate", *[a.format(**fill) for a in args], "--out", str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*tmp"))


def test_convert_info_and_generate_from_the_folder(tmp_path, var_official_files, capsys):
    folder = tmp_path / "var-tiny-fixture"
    assert main(["convert", "--var-ckpt", str(var_official_files["var"]), "--vae-ckpt",
                 str(var_official_files["vae"]), "--out", str(folder)]) == 0
    assert (folder / "model_index.json").is_file()
    assert not list(tmp_path.glob(".*partial"))
    capsys.readouterr()
    assert main(["info", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "var" and info["transformer"]["depth"] == 2 and info["parameters"] > 0
    # the same seed gives the same image from the folder as from the official files
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    assert main(["generate", "--model", str(folder), "--class", "3", "--out", str(a), "--quiet"]) == 0
    assert main(["generate", "--var-ckpt", str(var_official_files["var"]), "--vae-ckpt",
                 str(var_official_files["vae"]), "--class", "3", "--out", str(b), "--quiet"]) == 0
    assert np.array_equal(np.asarray(PIL.Image.open(a)), np.asarray(PIL.Image.open(b)))
    # converting onto a non-empty folder is refused unless asked
    assert main(["convert", "--var-ckpt", str(var_official_files["var"]), "--vae-ckpt",
                 str(var_official_files["vae"]), "--out", str(folder)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_convert_infinity_files_into_a_folder_that_loads_and_generates(tmp_path, tiny_infinity_files, capsys):
    import torch

    from sparsevar import InfinityPipeline

    f = tiny_infinity_files()
    folder = tmp_path / "infinity-tiny"
    assert main(["convert", "--ckpt", str(f["transformer"]), "--vae-ckpt", str(f["vae"]), "--text-encoder",
                 str(f["t5"]), "--out", str(folder)]) == 0
    assert "Infinity 4 layers" in capsys.readouterr().out
    assert {p.name for p in folder.iterdir()} >= {"model_index.json", "transformer", "vae", "text_encoder",
                                                   "tokenizer"}
    assert not list(tmp_path.glob(".*partial")) and not list(tmp_path.glob(".*old"))
    # the folder holds the same model as the official files: same seed, same image
    official = InfinityPipeline.from_single_file(f["transformer"], f["vae"], text_encoder=f["t5"])
    loaded = InfinityPipeline.from_pretrained(folder)
    for p in (official, loaded):
        p.set_progress_bar_config(disable=True)
    a, b = (p("w3 w4", height=256, width=256, generator=torch.Generator().manual_seed(0), output_type="pt").images
            for p in (official, loaded))
    assert a.shape == (1, 3, 256, 256) and torch.equal(a, b)
    assert main(["info", str(folder), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "infinity" and info["transformer"]["depth"] == 4 and info["parameters"] > 0
    # `generate --model FOLDER --prompt` reads it (T5 included: no --text-encoder needed)
    out = tmp_path / "fox.png"
    assert main(["generate", "--model", str(folder), "--prompt", "w3", "w4", "--height", "256", "--width", "256",
                 "--out", str(out), "--quiet"]) == 0
    assert PIL.Image.open(out.with_name("fox_0.png")).size == (256, 256)
    # --overwrite replaces the whole folder
    (folder / "stray.txt").write_text("x")
    assert main(["convert", "--ckpt", str(f["transformer"]), "--vae-ckpt", str(f["vae"]), "--text-encoder",
                 str(f["t5"]), "--out", str(folder), "--overwrite"]) == 0
    assert not (folder / "stray.txt").exists() and (folder / "model_index.json").is_file()
    assert not list(tmp_path.glob(".*partial")) and not list(tmp_path.glob(".*old"))


def test_convert_reads_the_8b_shard_layout_and_safetensors(tmp_path, tiny_infinity_files, capsys):
    import torch
    from safetensors.torch import save_file

    from sparsevar import InfinityPipeline
    from sparsevar.models.loading import checkpoint_family

    f = tiny_infinity_files()
    sd = torch.load(f["transformer"], weights_only=True)
    keys = sorted(sd)
    shards = tmp_path / "infinity_8b_weights"               # index json + shards, like the 8B release
    shards.mkdir()
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, str(shards / name))
        weight_map.update(dict.fromkeys(part, name))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "t.safetensors"))
    assert checkpoint_family(shards) == checkpoint_family(tmp_path / "t.safetensors") == "infinity"
    assert checkpoint_family(f["vae"]) == "infinity-vae"
    out = tmp_path / "from-shards"
    assert main(["convert", "--ckpt", str(shards), "--vae-ckpt", str(f["vae"]), "--text-encoder", str(f["t5"]),
                 "--out", str(out)]) == 0
    got = InfinityPipeline.from_pretrained(out).transformer.state_dict()
    assert len(sd) > 0 and set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)


@pytest.mark.parametrize("args, message", [
    (["--ckpt", "{transformer}", "--vae-ckpt", "{vae}"], "also pass --text-encoder"),
    (["--ckpt", "{vae}", "--vae-ckpt", "{vae}"], "the Infinity VAE: pass it as --vae-ckpt"),
    (["--ckpt", "{transformer}", "--vae-ckpt", "{transformer}", "--text-encoder", "{t5}"], "passed as the VAE"),
    (["--ckpt", "{transformer}", "--vae-ckpt", "{vae}", "--text-encoder", "{tmp}/no-t5"], "flan-t5-xl"),
    (["--ckpt", "{tmp}/missing.pth", "--vae-ckpt", "{vae}"], "not found"),
])
def test_convert_errors_are_one_line_and_leave_nothing(tmp_path, tiny_infinity_files, capsys, args, message):
    f = tiny_infinity_files()
    fill = {k: str(v) for k, v in f.items()} | {"tmp": str(tmp_path)}
    out = tmp_path / "never"
    capsys.readouterr()                          # the fixture's own output (transformers' save progress bar)
    assert main(["convert", *[a.format(**fill) for a in args], "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_a_failed_save_leaves_nothing_behind(tmp_path, tiny_infinity_files, monkeypatch, capsys):
    from sparsevar import InfinityPipeline

    f = tiny_infinity_files()

    def fail_half_way(self, save_directory, **kw):
        (save_directory / "transformer").mkdir(parents=True)
        raise OSError("disk full")

    monkeypatch.setattr(InfinityPipeline, "save_pretrained", fail_half_way)
    out = tmp_path / "inf"
    assert main(["convert", "--ckpt", str(f["transformer"]), "--vae-ckpt", str(f["vae"]), "--text-encoder",
                 str(f["t5"]), "--out", str(out)]) == 1            # an error of the system: status 1, one line
    assert capsys.readouterr().err.strip().splitlines()[-1] == "sparsevar convert: error: disk full"
    assert not out.exists() and not list(tmp_path.glob(".inf*"))


def test_info_on_official_files(var_official_files, var_fixture_config, capsys):
    assert main(["info", str(var_official_files["var_saln"])]) == 0
    text = capsys.readouterr().out
    kw = var_fixture_config["var_kwargs"]["var_saln"]
    assert f"depth: {kw['depth']}" in text and "shared_aln: True" in text and "resolution: 256" in text
    assert main(["info", str(var_official_files["vae"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "var-vqvae" and info["vocab_size"] == var_fixture_config["vae_kwargs"]["vocab_size"]


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "sparsevar", "info", "--backends"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "torch" in res.stdout


def test_generate_from_a_prompt_uses_infinity_and_checks_the_size(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["generate", "--prompt", "w3 w4 w5", "--height", "256", "--width", "256", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "infinity-tiny" in captured.err and "RANDOMLY INITIALISED" in captured.err
    assert PIL.Image.open(out).size == (256, 256)
    bad = tmp_path / "bad.png"
    assert main(["generate", "--prompt", "w3", "--height", "300", "--width", "256", "--out", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "height" in err and len(err.splitlines()) == 1 and not bad.exists()


@pytest.mark.parametrize("args, message", [
    (["--prompt", "w3", "--class", "3"], "give one of them"),
    (["--class", "3", "--negative-prompt", "blur"], "add --prompt"),
    (["--prompt", "w3", "--vae-ckpt", "x.pth"], "add --model"),
])
def test_generate_text_and_class_arguments_do_not_mix(tmp_path, capsys, args, message):
    assert main(["generate", *args, "--out", str(tmp_path / "x.png"), "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_bench_speed_runs_every_family_on_cpu(tmp_path, capsys):
    """A functional run (CPU numbers mean nothing): every row written, a setting the model cannot
    take is reported and skipped."""
    out = tmp_path / "speed.csv"
    assert main(["bench", "speed", "--models", "var-tiny", "infinity-tiny", "hart-tiny", "--resolution", "256", "--device", "cpu",
                 "--runs", "1", "--warmup", "0", "--methods", "dense", "sparsevar-preset", "skip-last-1",
                 "--dtype", "float32", "--out", str(out)]) == 0
    import csv
    rows = list(csv.DictReader(out.open()))
    got = {(r["model"], r["method"]) for r in rows}
    assert {("var-tiny", "dense"), ("var-tiny", "skip-last-1"), ("infinity-tiny", "dense"),
            ("infinity-tiny", "skip-last-1"), ("hart-tiny", "dense"), ("hart-tiny", "skip-last-1")} <= got
    assert "infinity-tiny b1 sparsevar-preset: skipped: block=3" in capsys.readouterr().out
    skip = next(r for r in rows if r["model"] == "var-tiny" and r["method"] == "skip-last-1")
    assert float(skip["ideal_speedup"]) > 1.0


def test_bench_speed_reports_the_rest_of_a_call_for_pil_output_and_a_prompt_encoded_once(tmp_path):
    """`--output-type pil --encode-once --profile` (functional on the CPU): the rows say so, a text
    model's prompt is encoded before the timed calls and its encoder timed apart, the rest of a call
    (end to end − loop − decode) is reported per row, and one profiled call per setting lists the
    call's phases."""
    out = tmp_path / "speed.csv"
    assert main(["bench", "speed", "--models", "var-tiny", "hart-tiny", "--device", "cpu", "--runs", "1",
                 "--warmup", "0", "--methods", "dense", "--dtype", "float32", "--output-type", "pil",
                 "--encode-once", "--profile", "--out", str(out)]) == 0
    import csv
    rows = {r["model"]: r for r in csv.DictReader(out.open())}
    for r in rows.values():
        assert r["output_type"] == "pil"
        e2e, loop, decode, rest = (float(r[k]) for k in ("e2e_ms_median", "ms_median", "decode_ms_median",
                                                          "rest_ms_median"))
        assert rest == pytest.approx(e2e - loop - decode, abs=1e-2) and rest > 0
    assert rows["hart-tiny"]["prompt"] == "encoded once" and float(rows["hart-tiny"]["text_encoder_ms"]) > 0
    assert rows["var-tiny"]["prompt"] == "" and rows["var-tiny"]["text_encoder_ms"] == ""
    # --profile: one more call per setting, its phases in order with their host times
    profiles = (tmp_path / "speed_profile.txt").read_text().split("== ")[1:]
    assert [p.split()[0] for p in profiles] == ["var-tiny", "hart-tiny"]
    for p in profiles:
        phases = [line.split()[0] for line in p.splitlines() if line.startswith("  sparsevar.")]
        assert phases == ["sparsevar.check_inputs", "sparsevar.begin", "sparsevar.prepare", "sparsevar.scales",
                          "sparsevar.decode", "sparsevar.postprocess"], p       # the prompt encoded beforehand
        call_ms = float(p.splitlines()[1].split()[1])
        host = [float(line.split("host")[1].split()[0]) for line in p.splitlines() if line.startswith("  sparsevar.")]
        assert all(h >= 0 for h in host) and 0 < sum(host) <= call_ms
        # under each phase its host time split: the outermost torch operators / CUDA calls, and the rest
        lines = p.splitlines()
        splits = [lines[i + 1] for i, line in enumerate(lines) if line.startswith("  sparsevar.")]
        assert len(splits) == len(host) and all(x.startswith("      torch and CUDA calls ") for x in splits)
        for h, x in zip(host, splits):
            named, python = float(x.split()[4]), float(x.split("the rest ")[1].split()[0])
            assert named >= 0 and python >= -0.02 and named + python == pytest.approx(h, abs=0.02), x
        scales = splits[phases.index("sparsevar.scales")]
        assert "aten::linear" in scales or "aten::addmm" in scales or "aten::mm" in scales, scales   # the layers' products


def test_roofline_floor_counts_the_tokens_a_method_computed():
    """The roofline ideal of `bench speed`: the dense generation's own stats give the dense floor;
    pruning compute-bound scales lowers it, pruning a weight-bound scale only by the K/V its
    excluded tokens no longer add; a skipped scale costs nothing. VAR-d30 at batch 8 on an H100."""
    from types import SimpleNamespace as NS
    from sparsevar.benchmarks.bench_speed import var_floor_ms
    from sparsevar.models.var import VAR_PRESETS
    # VAR-d30 as research/kernels.md §6 describes it: depth 30, C = 1920, 10 scales (680 tokens), vocab 4096
    C, depth, V, patch_nums = 1920, 30, 4096, (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
    d = VAR_PRESETS["var-d30"]
    assert (d["embed_dim"], d["depth"], tuple(d["patch_nums"])) == (C, depth, patch_nums)
    cfg = NS(embed_dim=C, vocab_size=V, depth=depth, mlp_ratio=4.0, patch_nums=patch_nums)
    gpu = "NVIDIA H100 80GB HBM3"
    toks = [p * p for p in cfg.patch_nums]

    def floor(counts, batch=8):
        return var_floor_ms(cfg, batch, 2, gpu, NS(scales=[NS(tokens_computed=n, rows=2) for n in counts]))

    # the floor written out from §6's model: per scale, max(FLOPs / 790 TFLOP/s, bytes / 3.0 TB/s) on an H100.
    # FLOPs, for 16 rows (batch 8 × the CFG pair): per layer 2 × 12C² per token (qkv 3C², proj C², fc1 and
    # fc2 4C² each) plus attention 4 · tokens · cached tokens · C, and the head 2 · C · V per token.
    # Bytes: the blocks' and the head's bf16 weights once per scale, plus the bf16 K and V of every cached token.
    rows, ms, cached = 16, 0.0, 0
    for p in patch_nums:
        n = p * p
        cached += n
        flops = rows * (depth * (2 * 12 * C * C * n + 4 * n * cached * C) + 2 * n * C * V)
        nbytes = 2 * (depth * 12 * C * C + C * V) + 2 * depth * 2 * rows * cached * C
        ms += 1e3 * max(flops / 790e12, nbytes / 3.0e12)
    dense = var_floor_ms(cfg, 8, 2, gpu)
    assert dense == pytest.approx(ms, rel=1e-12) and floor(toks) == dense
    # batch 1: §6's table gives 10.2 ms ("VAR-d30, AdaLN hoisted", computed there by hand)
    assert round(var_floor_ms(cfg, 1, 2, gpu), 1) == 10.2
    assert dense - floor(toks[:-3] + [round(n / 2) for n in toks[-3:]]) > 10               # compute-bound at batch 8
    # 4×4 is weight-bound: halving it saves only the K/V reads of the later scales
    assert 0 < dense - floor(toks[:3] + [n // 2 for n in toks[3:4]] + toks[4:]) < 0.05
    assert floor(toks[:-1] + [0]) < floor(toks[:-1] + [1])                                  # a skipped scale is free
    assert var_floor_ms(cfg, 8, 2, "cpu") != var_floor_ms(cfg, 8, 2, "cpu")                # nan off the known GPUs


def test_bench_gemm_rows_checks_its_options_before_needing_a_gpu(capsys, monkeypatch):
    """`sparsevar bench gemm-rows` names a bad preset or gain, and on a machine without CUDA says
    that the sweep needs the GPU whose table it writes — without writing anything."""
    monkeypatch.setenv("SPARSEVAR_GEMM_ROWS_DIR", "/nonexistent/should-not-be-created")
    assert main(["bench", "gemm-rows", "--models", "var-d99"]) == 2
    assert "'var-d99' is neither a VAR nor an Infinity preset" in capsys.readouterr().err
    assert main(["bench", "gemm-rows", "--min-gain", "1.5"]) == 2
    assert "--min-gain 1.5: give a fraction in [0, 1)" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "gemm-rows"]) == 2
        err = capsys.readouterr().err
        assert "on a CUDA GPU, and none is available here" in err and "Traceback" not in err
    assert not os.path.exists("/nonexistent/should-not-be-created")


def test_generate_without_sampling_flags_draws_with_the_familys_defaults(tmp_path, var_official_files):
    """No --cfg / --top-k / --top-p / --temperature: a class draws what the pipeline draws at guidance 4,
    top-k 900, top-p 0.95, and a prompt what it draws at guidance 3, top-k 900, top-p 0.97, temperature
    0.5; each differs from the image at the other family's numbers."""
    from sparsevar import InfinityPipeline, VARPipeline

    def draw(pipe, *args, **kw):
        pipe.set_progress_bar_config(disable=True)
        return np.asarray(pipe(*args, generator=torch.Generator().manual_seed(0), **kw).images[0])

    var, vae = str(var_official_files["var"]), str(var_official_files["vae"])
    a, b = tmp_path / "class.png", tmp_path / "prompt.png"
    assert main(["generate", "--var-ckpt", var, "--vae-ckpt", vae, "--class", "3", "--device", "cpu", "--out", str(a),
                 "--quiet"]) == 0
    assert main(["generate", "--prompt", "w3 w4", "--height", "256", "--width", "256", "--device", "cpu",
                 "--out", str(b), "--quiet"]) == 0
    pipe = VARPipeline.from_single_file(var, vae)
    assert np.array_equal(np.asarray(PIL.Image.open(a)), draw(pipe, [3], guidance_scale=4.0, top_k=900, top_p=0.95))
    assert not np.array_equal(np.asarray(PIL.Image.open(a)), draw(pipe, [3], guidance_scale=3.0, top_p=0.97))
    pipe = InfinityPipeline.from_random("infinity-tiny")
    kw = dict(height=256, width=256, top_k=900)
    assert np.array_equal(np.asarray(PIL.Image.open(b)),
                          draw(pipe, "w3 w4", guidance_scale=3.0, top_p=0.97, temperature=0.5, **kw))
    assert not np.array_equal(np.asarray(PIL.Image.open(b)), draw(pipe, "w3 w4", guidance_scale=4.0, top_p=0.95, **kw))


def test_generate_with_sparvar_reports_the_keys_it_read(tmp_path, capsys):
    """`--sparvar 0.3 --skip-last 1` on the demo model writes its image; the same settings through
    the Python API read fewer keys at the last scale that runs than the tokens before it."""
    from sparsevar import VARPipeline
    out = tmp_path / "s.png"
    assert main(["generate", "--class", "fish", "--sparvar", "0.3", "--skip-last", "1", "--out", str(out),
                 "--seed", "2", "--quiet"]) == 0
    assert out.is_file()
    pipe = VARPipeline.from_demo().enable_sparvar(top_keys=0.3).enable_scale_skip(skip_last=1)
    pipe.set_progress_bar_config(disable=True)
    stats = pipe(["fish"], generator=torch.Generator().manual_seed(2)).stats[0]
    run = [s for s in stats.scales if not s.skipped]
    assert run[-1].keys_read is not None and run[-1].keys_read < sum(s.tokens for s in run)
