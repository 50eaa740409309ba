"""Shared test helpers: where the parity fixture sets live and how their weights are made.

Fixture sets are read from ``$SPARSEVAR_FIXTURES`` (default ``tests/fixtures``), one folder per
model family (``var/``, later ``infinity/`` and ``hart/``). An absent family folder skips that
family's parity tests; a present one must pass. The weights of every fixture model are re-created
from its ``*.weights_manifest.json`` with the recipe in ``tests/fixtures/recipe.py`` and saved in the
official container format, so the parity tests always go through the project's own loader.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parent


def fixtures_root() -> Path:
    return Path(os.environ.get("SPARSEVAR_FIXTURES", TESTS_DIR / "fixtures")).resolve()


def _load_recipe():
    spec = importlib.util.spec_from_file_location("sparsevar_fixture_recipe", TESTS_DIR / "fixtures" / "recipe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_RECIPE = _load_recipe()


def materialize(manifest_path: Path, include_derived: bool = True) -> dict[str, torch.Tensor]:
    """The official-layout state dict of a fixture model (bit-exact, see fixtures/README)."""
    return _RECIPE.materialize(str(manifest_path), include_derived=include_derived)


def family_dir(family: str) -> Path:
    d = fixtures_root() / family
    if not d.is_dir():
        pytest.skip(f"no {family!r} fixture set under {fixtures_root()} (set SPARSEVAR_FIXTURES)")
    return d


@pytest.fixture(scope="session")
def var_fixture_dir() -> Path:
    return family_dir("var")


@pytest.fixture(scope="session")
def var_fixture_config(var_fixture_dir) -> dict:
    return json.loads((var_fixture_dir / "config.json").read_text())


@pytest.fixture(scope="session")
def var_official_files(var_fixture_dir, var_fixture_config, tmp_path_factory) -> dict[str, Path]:
    """The fixture models written as official checkpoint files: {'vae', 'var', 'var_saln'} -> .pth path."""
    out = tmp_path_factory.mktemp("var_official")
    files = {}
    for name, info in var_fixture_config["weights"].items():
        sd = materialize(var_fixture_dir / info["manifest"])
        path = out / f"{name}.pth"
        torch.save(sd, path)          # flat state dict, like var_d16.pth / vae_ch160v4096z32.pth
        files[name] = path
    return files


@pytest.fixture
def var_pipe(var_official_files):
    """A fresh VARPipeline of the fixture model's official files, its progress bar off."""
    from sparsevar import VARPipeline
    p = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    p.set_progress_bar_config(disable=True)
    return p


# ---- FlexVAR -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def flexvar_fixture_dir() -> Path:
    return family_dir("flexvar")


def flexvar_ar_runs() -> list:
    """The names of the KV-cached runs the FlexVAR fixture set's ``config.json`` lists (``ar_runs``), or
    [] when there is no set (its tests then skip through ``flexvar_fixture_dir``)."""
    cfg = fixtures_root() / "flexvar" / "config.json"
    return [r["name"] for r in json.loads(cfg.read_text())["ar_runs"]] if cfg.is_file() else []


def pytest_generate_tests(metafunc):
    # ``flexvar_ar_run``: one test per run of the set in use, read from its config, not a fixed list;
    # None (one case) when the set lists none or is absent: the test names that or skips
    if "flexvar_ar_run" in metafunc.fixturenames:
        runs = flexvar_ar_runs()
        metafunc.parametrize("flexvar_ar_run", runs or [None], ids=runs or ["no-runs"])


@pytest.fixture(scope="session")
def flexvar_state_dicts(flexvar_fixture_dir) -> dict[str, dict[str, torch.Tensor]]:
    """The fixture's official state dicts: {'vae': FlexVAE.pth['model'], 'flexvar': the transformer's}."""
    return {name: materialize(flexvar_fixture_dir / f"{name}.weights_manifest.json") for name in ("vae", "flexvar")}


@pytest.fixture(scope="session")
def flexvar_official_files(flexvar_state_dicts, tmp_path_factory) -> Path:
    """A folder with the fixture in the release's containers: FlexVAE.pth ({'model': sd}), FlexVARd2.pth
    (flat) and FlexVARd2-trainer.pth (['trainer']['var_wo_ddp'])."""
    out = tmp_path_factory.mktemp("flexvar_official")
    torch.save({"model": flexvar_state_dicts["vae"]}, out / "FlexVAE.pth")
    torch.save(flexvar_state_dicts["flexvar"], out / "FlexVARd2.pth")
    torch.save({"trainer": {"var_wo_ddp": flexvar_state_dicts["flexvar"]}}, out / "FlexVARd2-trainer.pth")
    return out


# ---- HART ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def hart_fixture_dir() -> Path:
    return family_dir("hart")


@pytest.fixture(scope="session")
def hart_state_dicts(hart_fixture_dir) -> dict[str, dict[str, torch.Tensor]]:
    """The fixture's official state dicts: {'tokenizer': the ``vae.*`` tree, 'transformer': HARTForT2I's}."""
    return {name: materialize(hart_fixture_dir / f"{name}.weights_manifest.json")
            for name in ("tokenizer", "transformer")}


def write_hart_release(out: Path, state_dicts: dict, fixture_dir: Path, text_encoder: Path) -> dict[str, Path]:
    """The HART fixture model in the release's containers under ``out``: llm/ (config.json,
    ema_model.bin with the derived buffers), tokenizer/ (config.json, model.safetensors with vae.* and
    a disc.* tensor), and at ``text_encoder`` a transformers Qwen2 folder of the fixture's text width."""
    from safetensors.torch import save_file

    from sparsevar.models.hart_text import random_qwen2
    llm, tok = out / "llm", out / "tokenizer"
    llm.mkdir(parents=True)
    tok.mkdir()
    (llm / "config.json").write_text((fixture_dir / "transformer_config.json").read_text())
    torch.save(state_dicts["transformer"], llm / "ema_model.bin")
    (tok / "config.json").write_text((fixture_dir / "tokenizer_config.json").read_text())
    vae = dict(state_dicts["tokenizer"])
    vae["disc.conv.weight"] = torch.zeros(2, 3)
    save_file({k: v.contiguous() for k, v in vae.items()}, str(tok / "model.safetensors"))
    width = json.loads((fixture_dir / "transformer_config.json").read_text())["context_dim"]
    tokenizer, model = random_qwen2(width, seed=1)
    tokenizer.save_pretrained(str(text_encoder))
    model.save_pretrained(str(text_encoder))
    return {"llm": llm, "tokenizer": tok, "text_encoder": text_encoder}


def write_tiny_hart_release(out: Path, fixture_dir: Path, depth: int, seed: int = 0) -> Path:
    """The fixture's HART sizes with ``depth`` layers and random weights, in the release's folders under
    ``out``: deep enough for the HART presets (SparseVAR observes block 16)."""
    from safetensors.torch import save_file

    from sparsevar.models.hart import HARTTransformer
    from sparsevar.models.vqvae import MultiScaleVQVAE
    c = json.loads((fixture_dir / "transformer_config.json").read_text())
    t = json.loads((fixture_dir / "tokenizer_config.json").read_text())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = HARTTransformer(
            vocab_size=t["vocab_size"], z_channels=t["z_channels"], context_token=c["context_token"],
            context_dim=c["context_dim"], depth=depth, embed_dim=c["embed_dim"], num_heads=c["num_heads"],
            mlp_ratio=c["mlp_ratio"], use_timestep_embed=c["use_timestep_embed"], disable_aln=c["disable_aln"],
            diff_width=c["diff_width"], diff_depth=c["diff_depth"], patch_nums=c["patch_nums"]).init_random_weights()
        vqvae = MultiScaleVQVAE(vocab_size=t["vocab_size"], z_channels=t["z_channels"], ch=t["ch"], ch_mult=t["ch_mult"],
                                patch_nums=t["v_patch_nums"], phi_on_last=False).init_random_weights()
    llm, tok = out / "llm", out / "tokenizer"
    llm.mkdir(parents=True)
    tok.mkdir()
    (llm / "config.json").write_text(json.dumps({**c, "depth": depth}))
    torch.save(transformer.state_dict(), llm / "ema_model.bin")
    (tok / "config.json").write_text(json.dumps(t))
    save_file({f"vae.{k}": v.contiguous() for k, v in vqvae.state_dict().items()}, str(tok / "model.safetensors"))
    return out


@pytest.fixture(scope="session")
def tiny_hart_release(hart_fixture_dir):
    """``write(out, depth)``: :func:`write_tiny_hart_release` with the fixture's configs."""
    return lambda out, depth: write_tiny_hart_release(out, hart_fixture_dir, depth)


@pytest.fixture(scope="session")
def hart_official_files(hart_state_dicts, hart_fixture_dir, tmp_path_factory) -> dict[str, Path]:
    """{'llm', 'tokenizer', 'text_encoder'}: the HART fixture in the release's folders (write_hart_release)."""
    out = tmp_path_factory.mktemp("hart_official")
    return write_hart_release(out / "hart-0.7b-1024px", hart_state_dicts, hart_fixture_dir, out / "qwen2")


# ---- Infinity ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def infinity_fixture_dir() -> Path:
    return family_dir("infinity")


@pytest.fixture(scope="session")
def infinity_fixture_config(infinity_fixture_dir) -> dict:
    return json.loads((infinity_fixture_dir / "config.json").read_text())


def write_fixture_t5_folder(t5_dir: Path, out: Path) -> Path:
    """A real ``transformers`` T5 folder from a fixture's ``t5/config.json`` + weights manifest: the
    T5EncoderModel with the materialised weights, and a word-level tokenizer (id i = word ``w{i}``,
    pad and EOS from the config) standing in for the SentencePiece one (the fixtures give token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    cfg = T5Config.from_pretrained(str(t5_dir))
    model = T5EncoderModel(cfg)
    model.load_state_dict(materialize(t5_dir / "weights_manifest.json"), strict=True)
    model.save_pretrained(str(out))
    pad, eos = cfg.pad_token_id, cfg.eos_token_id
    vocab = {"<pad>": pad, "</s>": eos}
    vocab.update({f"w{i}": i for i in range(cfg.vocab_size) if i not in (pad, eos)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            model_max_length=512).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def infinity_official_files(infinity_fixture_dir, infinity_fixture_config, tmp_path_factory) -> dict[str, Path]:
    """The fixture models in their official containers: {'transformer': flat .pth, 'vae': {'vae': sd} .pth,
    't5': a transformers T5 folder (weights + tokenizer)}."""
    out = tmp_path_factory.mktemp("infinity_official")
    w = infinity_fixture_config["weights"]
    transformer = out / "infinity_transformer.pth"
    torch.save(materialize(infinity_fixture_dir / w["infinity_transformer"]["manifest"]), transformer)
    vae = out / "infinity_vae_d32reg.pth"
    torch.save({"vae": materialize(infinity_fixture_dir / w["infinity_vae"]["manifest"])}, vae)
    t5 = write_fixture_t5_folder(infinity_fixture_dir / "t5", out / "t5")
    return {"transformer": transformer, "vae": vae, "t5": t5}


# ---- tiny random Infinity models in the official file layout (CLI convert, ComfyUI) --------------------------
def write_random_t5_folder(out: Path, d_model: int, seed: int = 0) -> Path:
    """A ``transformers`` T5 folder (T5EncoderModel + tokenizer files), laid out like a local copy of
    google/flan-t5-xl: the pipeline's own small random stand-in (``random_t5``) of width ``d_model``."""
    from sparsevar.models.text_encoder import random_t5

    tokenizer, t5 = random_t5(d_model, seed=seed)
    t5.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def write_tiny_infinity_files(out: Path, layers: tuple | None = None, seed: int = 0) -> dict[str, Path]:
    """``infinity-tiny`` with random weights in the official containers, under the official names:
    {'transformer': flat state dict ``infinity_2b_reg.pth``, 'vae': ``{'vae': sd}`` ``infinity_vae_d32reg.pth``,
    't5': a T5 folder ``flan-t5-xl``}. ``layers=(depth, block groups)`` changes the layer layout only, e.g.
    (32, 8) for Infinity-2B's, on which the 2B presets (SparseVAR group 3, FastVAR layers 3..27) are valid."""
    from sparsevar import InfinityPipeline, InfinityTransformer
    from sparsevar.models.infinity import INFINITY_PRESETS

    out.mkdir(parents=True, exist_ok=True)
    pipe = InfinityPipeline.from_random("infinity-tiny", seed=seed)
    transformer = pipe.transformer
    if layers is not None:
        spec = dict(INFINITY_PRESETS["infinity-tiny"]["transformer"], depth=layers[0], num_block_chunks=layers[1])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer = InfinityTransformer(**spec).init_random_weights()
    files = {"transformer": out / "infinity_2b_reg.pth", "vae": out / "infinity_vae_d32reg.pth",
             "t5": out / "flan-t5-xl"}
    torch.save(transformer.state_dict(), files["transformer"])
    torch.save({"vae": pipe.vae.state_dict()}, files["vae"])
    write_random_t5_folder(files["t5"], transformer.config.text_channels, seed=seed)
    return files


@pytest.fixture(scope="session")
def tiny_infinity_files(tmp_path_factory):
    """A factory: ``tiny_infinity_files(layers=None)`` → write_tiny_infinity_files, once per layout and
    session (the files are read-only to the tests)."""
    made: dict = {}

    def files(layers: tuple | None = None) -> dict[str, Path]:
        if layers not in made:
            made[layers] = write_tiny_infinity_files(tmp_path_factory.mktemp("infinity_tiny"), layers=layers)
        return made[layers]
    return files


# ---- the Triton interpreter run, started as soon as the tests are collected ------------------------------------
# tests/test_sparse_ops.py runs its kernel cases through Triton's CPU interpreter in one subprocess (the
# interpreter must be switched on before triton is imported). It is single-threaded and takes about a
# minute, so it starts here, in the background, and overlaps the tests before it; its fixture waits for it.
INTERPRETER_TEST = "test_sparse_ops.py::test_triton_kernel_matches_reference_in_the_interpreter"
_INTERPRETER_RUN: dict = {}


def pytest_collection_finish(session):
    if importlib.util.find_spec("triton") is None or \
            not any(INTERPRETER_TEST in item.nodeid for item in session.items):
        return                                           # the fixture says what is missing, or nothing needs it
    import subprocess
    import sys
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="sparsevar-interp-"))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    with open(folder / "output.txt", "w") as log:       # a file, not a pipe: nothing blocks its writes
        proc = subprocess.Popen([sys.executable, str(TESTS_DIR / "test_sparse_ops.py"), "--interpret",
                                 str(folder / "results.json"), "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    _INTERPRETER_RUN.update(proc=proc, folder=folder)


@pytest.fixture(scope="session")
def interpreter_run():
    """(the running interpreter subprocess, its folder: results.json and output.txt once it ends), or
    None when it was not started."""
    return (_INTERPRETER_RUN["proc"], _INTERPRETER_RUN["folder"]) if _INTERPRETER_RUN else None


# ---- CI: no check may pass by skipping ---------------------------------------------------------------------
# With SPARSEVAR_NO_SKIP=1 (set by .ci/run) a skipped test fails the run: a check CI is meant to run that
# cannot run (no Triton, no Chromium, a fixture family missing, an unsupported version) is a red CI, not
# a quiet skip. Tests deselected by a marker expression (``-m "not gpu"``) are not skipped, so not counted.
def pytest_sessionfinish(session, exitstatus):
    if _INTERPRETER_RUN:
        proc = _INTERPRETER_RUN["proc"]
        if proc.poll() is None:                           # its tests did not run (stopped early): no orphan
            proc.kill()
            proc.wait()
        import shutil
        shutil.rmtree(_INTERPRETER_RUN["folder"], ignore_errors=True)
    if os.environ.get("SPARSEVAR_NO_SKIP") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        lines = [f"  {r.nodeid}: {r.longrepr[2] if isinstance(r.longrepr, tuple) else r.longrepr}" for r in skipped]
        print(f"\nSPARSEVAR_NO_SKIP=1: {len(skipped)} test(s) skipped; here every check must run:\n"
              + "\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def run_with_comfyui():
    """``run(script, cwd) -> CompletedProcess``: a Python script run in a fresh interpreter with the
    real ComfyUI of the tests on its path (nodes called directly, no server; set up on first use
    under ``$SPARSEVAR_COMFY_DIR``)."""
    import subprocess
    import sys
    sys.path.insert(0, str(TESTS_DIR / "comfyui"))
    try:
        from setup_comfyui import ensure
    finally:
        sys.path.pop(0)
    server = ensure(Path(os.environ.get("SPARSEVAR_COMFY_DIR", "/tmp/sparsevar-comfyui")))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*server["pythonpath"], str(server["main_dir"])]))

    def run(script: str, cwd) -> "subprocess.CompletedProcess":
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env,
                              cwd=cwd)
    return run
