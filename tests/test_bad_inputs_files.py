"""Bad model files and folders (issue #27 §3): each class of mistake gives one line that names the file,
the field or argument, the value and the fix — before any weight is loaded — never a traceback, never
a wrong result with exit status 0.

Converted folders are copies of the shipped demo model (``demo/weights``: depth 8, 12 classes) or of a
tiny random Infinity pipeline, damaged in ``tmp_path``; official files are the fixture models
(``var_official_files``) and the tiny Infinity files of conftest (``tiny_infinity_files``). Expected
values are read from the untouched files, never from the code under test.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsevar import InfinityPipeline, VARPipeline
from sparsevar.cli import main
from sparsevar.demo import DEMO_MODEL_DIR
from sparsevar.models.loading import describe_checkpoint, load_infinity_transformer, load_var_transformer

RECONVERT = "convert the model again"
DEMO_CONFIG = json.loads((DEMO_MODEL_DIR / "transformer" / "config.json").read_text())
DEMO_VQ_CONFIG = json.loads((DEMO_MODEL_DIR / "vqvae" / "config.json").read_text())
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _demo_copy(tmp_path: Path, name: str = "demo") -> Path:
    folder = tmp_path / name
    shutil.copytree(DEMO_MODEL_DIR, folder)
    return folder


def _edit_json(path: Path, **fields) -> None:
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config, indent=2))


def _cli(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()                          # what fixtures printed before (progress bars)
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def _one_clean_line(err: str) -> None:
    assert "Traceback" not in err and len(err.splitlines()) == 1, err


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def infinity_folder(tmp_path_factory) -> Path:
    """A tiny random InfinityPipeline folder, as save_pretrained writes it (read-only to the tests)."""
    folder = tmp_path_factory.mktemp("infinity") / "infinity-tiny"
    InfinityPipeline.from_random("infinity-tiny").save_pretrained(folder)
    return folder


# ---- 1. config.json disagrees with the weights ---------------------------------------------------------
def test_cli_refuses_a_depth_that_disagrees_with_the_weights_instead_of_drawing_garbage(tmp_path, capsys):
    """The issue's case: depth 6 over 8 layers of weights generated an image and exited 0."""
    folder = _demo_copy(tmp_path)
    config = folder / "transformer" / "config.json"
    _edit_json(config, depth=6)
    out = tmp_path / "img.png"
    rc, err = _cli(["generate", "--model", str(folder), "--class", "0", "--out", str(out), "--quiet"], capsys)
    assert rc == 2
    _one_clean_line(err)
    assert str(config) in err and "depth = 6" in err and f"depth = {DEMO_CONFIG['depth']}" in err
    assert f'"depth": {DEMO_CONFIG["depth"]}' in err                  # the fix
    assert not out.exists() and not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("sub, field, value", [
    ("transformer", "depth", 10),               # was "Cannot copy out of meta tensor"
    ("transformer", "depth", -8),               # was a traceback
    ("transformer", "num_classes", 10),         # was diffusers' advice: ignore_mismatched_sizes=True
    ("transformer", "embed_dim", 128),
    ("transformer", "num_heads", 8),
    ("transformer", "vocab_size", 4096),
    ("transformer", "mlp_ratio", 2.0),
    ("transformer", "shared_aln", True),
    ("transformer", "patch_nums", [1, 2, 3, 4]),
    ("vqvae", "ch", 64),
    ("vqvae", "vocab_size", 4096),
    ("vqvae", "ch_mult", [1, 2, 2, 4]),
])
def test_each_shape_field_that_disagrees_is_named_with_what_the_weights_say(tmp_path, sub, field, value):
    folder = _demo_copy(tmp_path)
    config = folder / sub / "config.json"
    _edit_json(config, **{field: value})
    truth = (DEMO_CONFIG if sub == "transformer" else DEMO_VQ_CONFIG)[field]
    for load in (VARPipeline.from_pretrained, VARPipeline.from_path):     # from_path: the ComfyUI loader's call
        with pytest.raises(ValueError) as exc:
            load(folder)
        msg = str(exc.value)
        assert str(config) in msg and str(folder / sub / WEIGHTS) in msg
        assert f"{field} = {json.dumps(value)}" in msg and f"{field} = {json.dumps(truth)}" in msg
        assert f'"{field}": {json.dumps(truth)}' in msg and "ignore_mismatched_sizes" not in msg
        assert "\n" not in msg


def test_a_field_of_the_wrong_type_is_named(tmp_path):
    folder = _demo_copy(tmp_path)
    config = folder / "transformer" / "config.json"
    _edit_json(config, depth="eight")
    with pytest.raises(ValueError) as exc:
        VARPipeline.from_pretrained(folder)
    msg = str(exc.value)
    assert str(config) in msg and '"depth": "eight" is not an integer' in msg
    assert f'set "depth": {DEMO_CONFIG["depth"]}' in msg


@pytest.mark.parametrize("sub, field, value", [
    ("transformer", "depth", 6),
    ("transformer", "num_block_chunks", 4),
    ("transformer", "text_channels", 128),
    ("transformer", "num_heads", 8),
    ("vae", "base_ch", 64),
    ("vae", "codebook_dim", 16),
    ("text_encoder", "num_layers", 3),
    ("text_encoder", "d_model", 128),
])
def test_infinity_folder_fields_that_disagree_are_named(infinity_folder, tmp_path, sub, field, value):
    folder = tmp_path / "inf"
    shutil.copytree(infinity_folder, folder)
    config = folder / sub / "config.json"
    truth = json.loads(config.read_text())[field]
    _edit_json(config, **{field: value})
    with pytest.raises(ValueError) as exc:
        InfinityPipeline.from_pretrained(folder)
    msg = str(exc.value)
    assert str(config) in msg and f"{field} = {value}" in msg and f"{field} = {truth}" in msg
    assert f'"{field}": {truth}' in msg and "\n" not in msg


def test_components_from_two_models_are_refused_before_loading(tmp_path):
    """transformer/ and vqvae/ each consistent, but from different models (codebook 1024 vs 4096)."""
    folder = _demo_copy(tmp_path)
    shutil.rmtree(folder / "vqvae")
    VARPipeline.from_random("var-tiny").vqvae.save_pretrained(folder / "vqvae")
    other = json.loads((folder / "vqvae" / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError) as exc:
        VARPipeline.from_pretrained(folder)
    msg = str(exc.value)
    assert f"vocab_size = {DEMO_CONFIG['vocab_size']}" in msg and f"vocab_size = {other}" in msg
    assert "transformer/config.json" in msg and "vqvae/config.json" in msg


# ---- 2. missing, truncated or corrupt files in a folder ------------------------------------------------
@pytest.mark.parametrize("damage, error, words", [
    ("missing", FileNotFoundError, "is missing"),
    ("truncated", ValueError, "is truncated"),
    ("random", ValueError, "not a readable safetensors file"),
    ("empty", ValueError, "is empty (0 bytes)"),
])
def test_damaged_weights_name_the_file(tmp_path, damage, error, words):
    folder = _demo_copy(tmp_path)
    weights = folder / "transformer" / WEIGHTS
    if damage == "missing":
        weights.unlink()
    elif damage == "truncated":
        _truncate(weights)
    elif damage == "random":
        weights.write_bytes(os.urandom(5000))
    else:
        weights.write_bytes(b"")
    with pytest.raises(error) as exc:
        VARPipeline.from_pretrained(folder)
    msg = str(exc.value)
    assert str(weights) in msg and words in msg and ".bin" not in msg    # never a .bin the user never had
    assert "again" in msg and "\n" not in msg


@pytest.mark.parametrize("name", ["model_index.json", "transformer/config.json", "vqvae/config.json"])
def test_json_that_does_not_parse_names_the_file(tmp_path, name):
    folder = _demo_copy(tmp_path)
    (folder / name).write_text('{"_class_name": "VARPipeline",')
    with pytest.raises(ValueError) as exc:
        VARPipeline.from_pretrained(folder)
    assert str(folder / name) in str(exc.value) and "not valid JSON" in str(exc.value)


def test_sharded_weights_with_a_broken_index_or_a_missing_shard(tmp_path):
    folder = _demo_copy(tmp_path)
    transformer = VARPipeline.from_pretrained(folder).transformer
    (folder / "transformer" / WEIGHTS).unlink()
    transformer.save_pretrained(folder / "transformer", max_shard_size="5MB")
    index = folder / "transformer" / f"{WEIGHTS}.index.json"
    shards = sorted((folder / "transformer").glob("diffusion_pytorch_model-*.safetensors"))
    assert index.is_file() and len(shards) > 1
    assert VARPipeline.from_pretrained(folder).transformer.config.depth == DEMO_CONFIG["depth"]   # loads whole
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=rf"shard {shards[1]} listed in {index.name} is missing"):
        VARPipeline.from_pretrained(folder)
    index.write_text("[")
    with pytest.raises(ValueError, match=rf"{index} is not valid JSON"):
        VARPipeline.from_pretrained(folder)


def test_cli_generate_on_a_truncated_folder_is_one_line(tmp_path, capsys):
    folder = _demo_copy(tmp_path)
    weights = folder / "vqvae" / WEIGHTS
    _truncate(weights)
    out = tmp_path / "img.png"
    rc, err = _cli(["generate", "--model", str(folder), "--out", str(out), "--quiet"], capsys)
    assert rc == 2
    _one_clean_line(err)
    assert str(weights) in err and "truncated" in err and not out.exists()


# ---- 3. files that are not checkpoints, or of another family --------------------------------------------
@pytest.mark.parametrize("head, words", [(b"", "is not a checkpoint"), (b"\x80\x04", "not a valid PyTorch checkpoint")],
                         ids=["random", "pickle-header"])
def test_random_bytes_in_a_pth_are_not_a_checkpoint_and_unsafe_loading_is_never_suggested(tmp_path, head, words):
    path = tmp_path / "var_d16.pth"
    path.write_bytes(head + random.Random(0).randbytes(4096))
    with pytest.raises(ValueError) as exc:
        load_var_transformer(path)
    msg = str(exc.value)
    assert str(path) in msg and words in msg and "truncated or corrupt" in msg
    assert "weights_only" not in msg and "Python objects" not in msg and "\n" not in msg


def test_a_pickled_module_names_the_object_without_suggesting_unsafe_loading(tmp_path):
    path = tmp_path / "model.pth"
    torch.save(torch.nn.Linear(2, 2), path)
    with pytest.raises(ValueError) as exc:
        load_var_transformer(path)
    msg = str(exc.value)
    assert "torch.nn.modules.linear.Linear" in msg and "state_dict()" in msg
    assert "weights_only" not in msg and "\n" not in msg


def test_cli_infinity_transformer_given_as_var_ckpt_names_the_flags_that_take_it(tmp_path, var_official_files,
                                                                                  tiny_infinity_files, capsys):
    inf = tiny_infinity_files()
    out = tmp_path / "img.png"
    rc, err = _cli(["generate", "--var-ckpt", str(inf["transformer"]), "--vae-ckpt", str(var_official_files["vae"]),
                    "--out", str(out), "--quiet"], capsys)
    assert rc == 2
    _one_clean_line(err)
    assert str(inf["transformer"]) in err and "Infinity transformer" in err
    assert "--text-encoder" in err and "--prompt" in err and "InfinityPipeline.from_single_file" in err
    assert not out.exists()


def test_var_files_given_to_the_infinity_loaders_say_what_they_are(var_official_files, tiny_infinity_files):
    inf = tiny_infinity_files()
    with pytest.raises(ValueError, match=r"VAR transformer.*VARPipeline\.from_single_file.*--var-ckpt"):
        InfinityPipeline.from_single_file(var_official_files["var"], inf["vae"], inf["t5"])
    with pytest.raises(ValueError, match=r"VAR VQVAE.*--vae-ckpt"):
        InfinityPipeline.from_single_file(inf["transformer"], var_official_files["vae"], inf["t5"])
    with pytest.raises(ValueError, match=r"Infinity VAE.*InfinityPipeline\.from_single_file's vae_ckpt"):
        VARPipeline.from_single_file(var_official_files["var"], inf["vae"])


# ---- 4. info ----------------------------------------------------------------------------------------------
def test_info_counts_bin_weights(tmp_path, capsys):
    pipe = VARPipeline.from_demo()
    n = sum(p.numel() for p in pipe.transformer.parameters()) + sum(p.numel() for p in pipe.vqvae.parameters())
    folder = tmp_path / "bin"
    pipe.save_pretrained(folder, safe_serialization=False)
    assert (folder / "transformer" / "diffusion_pytorch_model.bin").is_file()
    assert not list(folder.rglob("*.safetensors"))
    assert main(["info", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == n
    loaded = VARPipeline.from_pretrained(folder)                 # and the folder loads, with the safe loader
    assert sum(p.numel() for p in loaded.transformer.parameters()) + \
        sum(p.numel() for p in loaded.vqvae.parameters()) == n


def test_info_on_a_corrupt_folder_is_one_line(tmp_path, capsys):
    folder = _demo_copy(tmp_path)
    weights = folder / "transformer" / WEIGHTS
    _truncate(weights)
    rc, err = _cli(["info", str(folder)], capsys)
    assert rc == 2
    _one_clean_line(err)
    assert str(weights) in err and "truncated" in err


def test_info_on_an_infinity_shard_folder_and_vae(tiny_infinity_files, tmp_path):
    inf = tiny_infinity_files()
    from safetensors.torch import save_file
    sd = torch.load(inf["transformer"], map_location="cpu", weights_only=True)
    keys = sorted(sd)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, str(tmp_path / name))
        weight_map.update(dict.fromkeys(part, name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    info = describe_checkpoint(tmp_path)
    assert info["family"] == "infinity" and info["depth"] == load_infinity_transformer(tmp_path).config.depth
    assert describe_checkpoint(inf["vae"])["family"] == "infinity-vae"


# ---- 5. dtype spellings -----------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling, dtype", [
    ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16), ("torch.float16", torch.float16),
    ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16), ("float32", torch.float32), ("fp32", torch.float32),
    (torch.bfloat16, torch.bfloat16),
])
def test_from_pretrained_takes_diffusers_dtype_spellings(spelling, dtype):
    pipe = VARPipeline.from_pretrained(DEMO_MODEL_DIR, dtype=spelling, vae_dtype=spelling)
    assert {p.dtype for p in pipe.transformer.parameters()} == {dtype}
    assert {p.dtype for p in pipe.vqvae.parameters()} == {dtype}
    assert {p.dtype for p in VARPipeline.from_pretrained(DEMO_MODEL_DIR, torch_dtype=spelling)
            .transformer.parameters()} == {dtype}


def test_dtype_strings_at_every_entry_point(var_official_files, infinity_folder):
    pipe = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"], dtype="bf16",
                                        vae_dtype="half")
    assert pipe.transformer.dtype == torch.bfloat16 and pipe.vqvae.dtype == torch.float16
    assert VARPipeline.from_demo(dtype="fp16").transformer.dtype == torch.float16
    assert VARPipeline.from_random("var-tiny", dtype="bfloat16").transformer.dtype == torch.bfloat16
    inf = InfinityPipeline.from_pretrained(infinity_folder, dtype="bf16", vae_dtype="fp16", text_encoder_dtype="half")
    assert inf.transformer.block_dtype() == torch.bfloat16 and inf.vae.dtype == torch.float16
    assert inf.text_encoder.dtype == torch.float16
    assert InfinityPipeline.from_random("infinity-tiny", vae_dtype="bf16").vae.dtype == torch.bfloat16


@pytest.mark.parametrize("call, name", [
    (lambda: VARPipeline.from_pretrained(DEMO_MODEL_DIR, dtype="float61"), "dtype"),
    (lambda: VARPipeline.from_pretrained(DEMO_MODEL_DIR, torch_dtype=16), "torch_dtype"),
    (lambda: VARPipeline.from_pretrained(DEMO_MODEL_DIR, vae_dtype=torch.int8), "vae_dtype"),
    (lambda: VARPipeline.from_demo(dtype="int8"), "dtype"),
    (lambda: InfinityPipeline.from_random("infinity-tiny", vae_dtype="bf17"), "vae_dtype"),
    (lambda: InfinityPipeline.from_pretrained(DEMO_MODEL_DIR, text_encoder_dtype="f16"), "text_encoder_dtype"),
])
def test_unknown_dtypes_are_named_with_the_accepted_spellings(call, name):
    with pytest.raises(TypeError) as exc:
        call()
    msg = str(exc.value)
    assert msg.startswith(f"{name}=") and "'bfloat16'" in msg and "'fp16'" in msg and "torch.float32" in msg


# ---- second campaign: other bad inputs of the same classes -------------------------------------------------
def test_another_pipelines_folder_names_the_class_and_flag_that_load_it(infinity_folder, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"names the pipeline 'InfinityPipeline', not VARPipeline: load it with "
                                         r"InfinityPipeline\.from_pretrained.*--prompt"):
        VARPipeline.from_pretrained(infinity_folder)
    with pytest.raises(ValueError, match=r"names the pipeline 'VARPipeline'.*VARPipeline\.from_pretrained.*--class"):
        InfinityPipeline.from_pretrained(DEMO_MODEL_DIR)
    rc, err = _cli(["generate", "--model", str(infinity_folder), "--class", "0", "--out", str(tmp_path / "x.png"),
                    "--quiet"], capsys)
    assert rc == 2 and "--prompt" in err
    _one_clean_line(err)


def test_a_file_where_a_folder_is_expected_and_a_folder_where_a_file_is(var_official_files, tmp_path):
    with pytest.raises(ValueError, match=rf"{var_official_files['var']} is a file, not a VARPipeline folder.*"
                                         rf"from_single_file"):
        VARPipeline.from_pretrained(var_official_files["var"])
    with pytest.raises(ValueError, match=rf"{tmp_path} is a folder; pass the checkpoint file"):
        VARPipeline.from_single_file(tmp_path, var_official_files["vae"])


def test_a_git_lfs_pointer_says_to_fetch_the_large_files(tmp_path):
    folder = _demo_copy(tmp_path)
    weights = folder / "transformer" / WEIGHTS
    weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 20000000\n")
    with pytest.raises(ValueError, match=rf"{weights} is a Git LFS pointer.*git lfs pull"):
        VARPipeline.from_pretrained(folder)


def test_a_component_config_of_another_class(tmp_path):
    folder = _demo_copy(tmp_path)
    shutil.copy(folder / "vqvae" / "config.json", folder / "transformer" / "config.json")
    with pytest.raises(ValueError, match=r"transformer/config\.json describes a 'MultiScaleVQVAE', but transformer/ "
                                         r"must hold a VARTransformer"):
        VARPipeline.from_pretrained(folder)


def test_a_safetensors_file_named_pth_loads_by_its_content(var_official_files, tmp_path):
    from safetensors.torch import save_file
    sd = torch.load(var_official_files["var"], map_location="cpu", weights_only=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "var.pth"))
    a, b = load_var_transformer(tmp_path / "var.pth"), load_var_transformer(var_official_files["var"])
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and len(sa) > 0 and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_python_m_sparsevar_info_on_random_bytes_exits_2_without_a_traceback(tmp_path):
    path = tmp_path / "weights.pth"
    path.write_bytes(os.urandom(2048))
    r = subprocess.run([sys.executable, "-m", "sparsevar", "info", str(path)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "SPARSEVAR_DEBUG": ""})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert str(path) in r.stderr and "not a checkpoint" in r.stderr


# ---- third campaign: other bad folders of the same classes ---------------------------------------------------
def test_a_huge_depth_is_refused_from_the_weights_before_anything_is_built(tmp_path):
    """depth 10**12 built modules for ever (the check built the config's model first, on the meta device)."""
    folder = _demo_copy(tmp_path)
    config = folder / "transformer" / "config.json"
    _edit_json(config, depth=10 ** 12)
    with pytest.raises(ValueError) as exc:
        VARPipeline.from_pretrained(folder)
    msg = str(exc.value)
    assert str(config) in msg and f"depth = {10 ** 12}" in msg and f'set "depth": {DEMO_CONFIG["depth"]}' in msg


def test_integer_weights_are_refused_instead_of_cast_to_garbage(tmp_path):
    """An int32 tensor in a converted folder was cast to float and drew a wrong image with exit 0."""
    from safetensors.torch import load_file, save_file
    folder = _demo_copy(tmp_path)
    weights = folder / "vqvae" / WEIGHTS
    sd = load_file(str(weights))
    key = sorted(k for k in sd if sd[k].dim() == 4)[0]
    sd[key] = sd[key].to(torch.int32)
    save_file(sd, str(weights))
    with pytest.raises(ValueError) as exc:
        VARPipeline.from_pretrained(folder)
    msg = str(exc.value)
    assert str(weights) in msg and f"I32 integers in {key}" in msg and RECONVERT in msg and "\n" not in msg


def test_labels_that_are_not_ids_are_named_with_the_file(tmp_path, capsys):
    folder = _demo_copy(tmp_path)
    index = folder / "model_index.json"
    _edit_json(index, id2label={"x": "a"})
    with pytest.raises(ValueError, match=rf'{index}: "id2label" must map class ids to names, e.g. '
                                         r'\{"0": "tench"\}; the entry "x": "a" is not an id and a name'):
        VARPipeline.from_pretrained(folder)
    rc, err = _cli(["info", "--labels", str(folder)], capsys)        # was: int()'s own message
    assert rc == 2 and str(index) in err
    _one_clean_line(err)


def test_a_shard_index_that_points_out_of_its_folder(tmp_path, tiny_infinity_files):
    from safetensors.torch import save_file
    sd = torch.load(tiny_infinity_files()["transformer"], map_location="cpu", weights_only=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model-00001-of-00001.safetensors"))
    weight_map = dict.fromkeys(sd, "model-00001-of-00001.safetensors")
    weight_map[sorted(sd)[0]] = "../elsewhere.safetensors"
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=rf"{index} lists the shard '\.\./elsewhere\.safetensors', which is not a "
                                         rf"file name in {tmp_path}"):
        load_infinity_transformer(tmp_path)


@pytest.mark.parametrize("damage", ["no tokenizer", "wrong width"])
def test_a_t5_folder_that_is_no_flan_t5_is_refused_before_loading(tiny_infinity_files, tmp_path, damage):
    """Without tokenizer files transformers made a tokenizer with no vocabulary (every prompt the same
    unknown tokens: wrong pictures, exit 0); a config.json wider than the weights got transformers'
    advice to pass ignore_mismatched_sizes."""
    f = tiny_infinity_files()
    t5 = tmp_path / "flan-t5-xl"
    shutil.copytree(f["t5"], t5)
    if damage == "no tokenizer":
        for p in t5.iterdir():
            if p.name.startswith(("tokenizer", "special_tokens", "spiece")):
                p.unlink()
        words = [f"{t5} holds no tokenizer vocabulary (neither tokenizer.json nor spiece.model)", "google/flan-t5-xl"]
    else:
        width = json.loads((t5 / "config.json").read_text())["d_model"]
        _edit_json(t5 / "config.json", d_model=2 * width)
        words = [f"{t5 / 'config.json'} says d_model = {2 * width}, but the weights in {t5 / 'model.safetensors'} are "
                 f"for d_model = {width}; set \"d_model\": {width}", "google/flan-t5-xl"]
    with pytest.raises((ValueError, FileNotFoundError)) as exc:
        InfinityPipeline.from_single_file(f["transformer"], f["vae"], text_encoder=t5)
    msg = str(exc.value)
    assert all(w in msg for w in words) and "ignore_mismatched_sizes" not in msg and "\n" not in msg


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(tmp_path, capsys, value):
    """A converted folder with NaN weights drew a garbage image and exited 0."""
    from safetensors.torch import load_file, save_file
    folder = _demo_copy(tmp_path)
    weights = folder / "transformer" / WEIGHTS
    sd = load_file(str(weights))
    key = sorted(k for k in sd if sd[k].dim() == 2)[0]
    sd[key][0, :3] = value
    save_file(sd, str(weights))
    out = tmp_path / "x.png"
    rc, err = _cli(["generate", "--model", str(folder), "--class", "1", "--out", str(out)], capsys)
    assert rc == 2 and not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
    _one_clean_line(err)
    assert f"the weights in {folder / 'transformer'}: {key} holds 3 NaN or infinite values" in err and "re-" in err


def test_nan_in_an_official_checkpoint_is_refused(var_official_files, tmp_path):
    sd = torch.load(var_official_files["var"], weights_only=True)
    key = next(k for k, v in sd.items() if v.is_floating_point() and v.dim() == 2 and "weight" in k)
    sd[key] = sd[key].clone()
    sd[key].view(-1)[5] = float("nan")
    bad = tmp_path / "var_d16.pth"
    torch.save(sd, bad)
    with pytest.raises(ValueError) as exc:
        VARPipeline.from_single_file(bad, var_official_files["vae"])
    assert f"{bad}: {key} holds 1 NaN or infinite values" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("damage", ["missing vqvae", "dangling link"])
def test_info_refuses_a_folder_that_would_not_load(tmp_path, capsys, damage):
    """info printed a description with exit 0 for folders generate refuses."""
    folder = _demo_copy(tmp_path)
    shutil.rmtree(folder / "vqvae")
    if damage == "dangling link":
        (folder / "vqvae").symlink_to(tmp_path / "gone")
    rc, err = _cli(["info", str(folder)], capsys)
    assert rc == 2
    _one_clean_line(err)
    assert f"{folder / 'vqvae'} is missing or not a folder" in err and RECONVERT in err
    rc2, err2 = _cli(["generate", "--model", str(folder), "--class", "1", "--out", str(tmp_path / "y.png")], capsys)
    assert rc2 == 2 and err2.split(": error: ")[1] == err.split(": error: ")[1]
