"""Official-checkpoint loading (models/loading.py): safe reading, recognition, configuration
inference, key validation, and the errors a user sees when a file is wrong.

Every test starts from the fixture models written in the official container format
(``var_official_files``) and damages or re-wraps them in ``tmp_path``.
"""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from sparsevar import VARPipeline
from sparsevar.models.loading import (describe_checkpoint, load_var_transformer, load_var_vqvae,
                                      read_state_dict)


@pytest.fixture(scope="module")
def var_sd(var_official_files) -> dict[str, torch.Tensor]:
    return torch.load(var_official_files["var"], map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def vae_sd(var_official_files) -> dict[str, torch.Tensor]:
    return torch.load(var_official_files["vae"], map_location="cpu", weights_only=True)


def _save(obj, path):
    torch.save(obj, path)
    return path


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---- unreadable files ------------------------------------------------------------------------------
def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "var_d16.pth"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        load_var_transformer(path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        load_var_vqvae(path)


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(ValueError, match=r"is a folder.*from_pretrained"):
        read_state_dict(tmp_path)


@pytest.mark.parametrize("name", ["var", "vae"])
def test_truncated_file_is_reported_as_truncated(var_official_files, tmp_path, name):
    data = var_official_files[name].read_bytes()
    path = tmp_path / f"half_{name}.pth"
    path.write_bytes(data[: len(data) // 2])
    loader = load_var_transformer if name == "var" else load_var_vqvae
    with pytest.raises(ValueError, match=r"truncated or corrupt") as exc:
        loader(path)
    assert path.name in str(exc.value)


@pytest.mark.parametrize("content", [b"", b"hello world, this is not a checkpoint"], ids=["empty", "garbage"])
def test_empty_or_garbage_file_is_reported_as_corrupt(tmp_path, content):
    path = tmp_path / "var_d16.pth"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"truncated or corrupt") as exc:
        load_var_transformer(path)
    assert path.name in str(exc.value)


def test_pickled_module_is_refused_by_the_safe_loader(tmp_path):
    path = _save(torch.nn.Linear(3, 2), tmp_path / "module.pth")
    with pytest.raises(ValueError, match=r"not a plain state dict") as exc:
        read_state_dict(path)
    assert path.name in str(exc.value)
    assert "state_dict()" in str(exc.value)          # the message says how to re-save it


def test_dict_of_non_tensors(tmp_path):
    path = _save({"epoch": 3, "names": ["a", "b"]}, tmp_path / "meta.pth")
    with pytest.raises(ValueError, match=r"not a state dict of tensors") as exc:
        load_var_transformer(path)
    assert path.name in str(exc.value)


def test_safetensors_garbage(tmp_path):
    path = tmp_path / "var.safetensors"
    path.write_bytes(b"\x00" * 32)
    with pytest.raises(ValueError, match=r"not a readable safetensors file") as exc:
        load_var_transformer(path)
    assert path.name in str(exc.value)


# ---- wrong file for the role ---------------------------------------------------------------------------
def test_vae_file_passed_as_transformer(var_official_files):
    path = var_official_files["vae"]
    with pytest.raises(ValueError, match=r"pass it as the VAE file instead") as exc:
        load_var_transformer(path)
    assert path.name in str(exc.value)


def test_transformer_file_passed_as_vae(var_official_files):
    path = var_official_files["var"]
    with pytest.raises(ValueError, match=r"pass it as the transformer file instead") as exc:
        load_var_vqvae(path)
    assert path.name in str(exc.value)


def test_swapped_files_in_from_single_file(var_official_files):
    with pytest.raises(ValueError, match=r"VAE file instead"):
        VARPipeline.from_single_file(var_official_files["vae"], var_official_files["var"])


def test_unrelated_state_dict(tmp_path):
    path = _save(torch.nn.Linear(3, 2).state_dict(), tmp_path / "linear.pth")
    with pytest.raises(ValueError, match=r"is not a VAR transformer.*weight"):
        load_var_transformer(path)
    with pytest.raises(ValueError, match=r"is not the VAR VQVAE"):
        load_var_vqvae(path)


# ---- key set validation -------------------------------------------------------------------------------
def test_missing_key_is_named(var_sd, tmp_path):
    sd = dict(var_sd)
    del sd["blocks.1.ffn.fc2.bias"]
    with pytest.raises(ValueError, match=r"missing 1 keys \(blocks\.1\.ffn\.fc2\.bias\)"):
        load_var_transformer(_save(sd, tmp_path / "var.pth"))


def test_missing_key_needed_for_inference_is_named(var_sd, tmp_path):
    sd = dict(var_sd)
    del sd["head.weight"]
    with pytest.raises(ValueError, match=r"missing key 'head\.weight'"):
        load_var_transformer(_save(sd, tmp_path / "var.pth"))


def test_extra_key_is_named(var_sd, tmp_path):
    sd = dict(var_sd)
    sd["blocks.0.attn.extra_scale"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"unexpected 1 keys \(blocks\.0\.attn\.extra_scale\)"):
        load_var_transformer(_save(sd, tmp_path / "var.pth"))


def test_vae_missing_and_extra_keys_are_named(vae_sd, tmp_path):
    sd = dict(vae_sd)
    del sd["decoder.conv_out.bias"]
    sd["decoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing 1 keys \(decoder\.conv_out\.bias\).*"
                                         r"unexpected 1 keys \(decoder\.extra\.weight\)"):
        load_var_vqvae(_save(sd, tmp_path / "vae.pth"))


def test_wrong_tensor_shape(var_sd, tmp_path):
    sd = dict(var_sd)
    sd["blocks.0.attn.proj.bias"] = torch.zeros(sd["blocks.0.attn.proj.bias"].numel() + 1)
    with pytest.raises(ValueError, match=r"tensor shapes do not fit.*proj\.bias"):
        load_var_transformer(_save(sd, tmp_path / "var.pth"))


def test_nonzero_key_bias_is_refused(var_sd, tmp_path):
    key = next(k for k in var_sd if k.endswith(".attn.zero_k_bias"))
    sd = dict(var_sd)
    sd[key] = torch.full_like(sd[key], 0.5)
    with pytest.raises(ValueError, match=re.escape(key) + r" must be zero"):
        load_var_transformer(_save(sd, tmp_path / "var.pth"))


# ---- patch schedule inference ------------------------------------------------------------------------
def test_token_count_matching_no_schedule(var_sd, tmp_path):
    sd = dict(var_sd)
    sd["pos_1LC"] = sd["pos_1LC"][:, :-7].clone()
    L = sd["pos_1LC"].shape[1]
    with pytest.raises(ValueError, match=rf"{L} tokens .*matches no known VAR patch schedule.*patch_nums"):
        load_var_transformer(_save(sd, tmp_path / "var.pth"))


def test_explicit_patch_nums_that_disagree(var_official_files, var_fixture_config):
    pn = list(var_fixture_config["patch_nums"])
    wrong = pn[:-1] + [pn[-1] - 1]                     # same number of scales, fewer tokens
    with pytest.raises(ValueError, match=re.escape(f"patch_nums={wrong}")):
        load_var_transformer(var_official_files["var"], patch_nums=wrong)
    with pytest.raises(ValueError, match=r"patch_nums=\[1, 2, 3\] gives 14 tokens in 3 scales"):
        load_var_transformer(var_official_files["var"], patch_nums=[1, 2, 3])


def test_explicit_patch_nums_that_agree(var_official_files, var_fixture_config):
    pn = var_fixture_config["patch_nums"]
    t = load_var_transformer(var_official_files["var"], patch_nums=pn)
    assert list(t.config.patch_nums) == pn
    assert t.schedule.total_tokens == sum(p * p for p in pn)


# ---- accepted containers -----------------------------------------------------------------------------
def test_training_checkpoint_wrapper(var_official_files, var_sd, vae_sd, tmp_path):
    path = _save({"epoch": 7, "trainer": {"var_wo_ddp": var_sd, "vae_local": vae_sd}}, tmp_path / "ar-ckpt.pth")
    _assert_same_weights(load_var_transformer(path), load_var_transformer(var_official_files["var"]))
    _assert_same_weights(load_var_vqvae(path), load_var_vqvae(var_official_files["vae"]))


def test_module_prefix_is_stripped(var_official_files, var_sd, tmp_path):
    path = _save({f"module.{k}": v for k, v in var_sd.items()}, tmp_path / "ddp.pth")
    _assert_same_weights(load_var_transformer(path), load_var_transformer(var_official_files["var"]))


def test_vae_wrapped_in_a_vae_key(var_official_files, vae_sd, tmp_path):
    path = _save({"vae": vae_sd}, tmp_path / "vae_wrapped.pth")
    _assert_same_weights(load_var_vqvae(path), load_var_vqvae(var_official_files["vae"]))


@pytest.mark.parametrize("name", ["var", "vae"])
def test_safetensors_loads_identically(var_official_files, var_sd, vae_sd, tmp_path, name):
    sd = var_sd if name == "var" else vae_sd
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous().clone() for k, v in sd.items()}, str(path))
    loader = load_var_transformer if name == "var" else load_var_vqvae
    _assert_same_weights(loader(path), loader(var_official_files[name]))


def test_state_dict_is_read_as_saved(var_official_files, var_sd):
    sd = read_state_dict(var_official_files["var"])
    assert len(var_sd) > 0 and sd.keys() == var_sd.keys()
    assert all(torch.equal(sd[k], var_sd[k]) for k in sd)


# ---- loaded models -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_models_are_frozen_and_in_eval_mode(var_official_files, dtype):
    for model in (load_var_transformer(var_official_files["var"], dtype=dtype),
                  load_var_transformer(var_official_files["var_saln"], dtype=dtype),
                  load_var_vqvae(var_official_files["vae"], dtype=dtype)):
        assert len(list(model.parameters())) > 0, type(model).__name__
        assert not any(m.training for m in model.modules()), type(model).__name__
        assert not any(p.requires_grad for p in model.parameters()), type(model).__name__
        assert all(p.dtype == dtype for p in model.parameters())
        assert not any(p.is_meta for p in model.parameters())


def test_derived_buffers_are_regenerated(var_official_files, var_sd):
    t = load_var_transformer(var_official_files["var"])
    assert "lvl_1L" not in t.state_dict()                # not loaded ...
    assert torch.equal(t.lvl_1L, var_sd["lvl_1L"])      # ... but equal to the official buffer


# ---- describe_checkpoint ------------------------------------------------------------------------------
def test_describe_transformer_file(var_official_files, var_fixture_config):
    info = describe_checkpoint(var_official_files["var"])
    kw = var_fixture_config["var_kwargs"]["var"]
    model = load_var_transformer(var_official_files["var"])
    assert info["family"] == "var"
    assert info["depth"] == kw["depth"]
    assert info["num_classes"] == kw["num_classes"]
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["resolution"] == var_fixture_config["image_resolution"]
    assert info["tokens"] == model.schedule.total_tokens


def test_describe_shared_adaln_file(var_official_files):
    info = describe_checkpoint(var_official_files["var_saln"])
    assert info["family"] == "var" and info["shared_aln"] is True


def test_describe_vae_file(var_official_files, var_fixture_config):
    info = describe_checkpoint(var_official_files["vae"])
    model = load_var_vqvae(var_official_files["vae"])
    assert info["family"] == "var-vqvae"
    assert info["vocab_size"] == var_fixture_config["vae_kwargs"]["vocab_size"]
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def saved_folder(var_official_files, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "var-fixture"
    VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"]).save_pretrained(path)
    return path


def test_describe_pipeline_folder(saved_folder, var_fixture_config):
    info = describe_checkpoint(saved_folder)
    assert info["pipeline"] == "VARPipeline"
    assert info["transformer"]["depth"] == var_fixture_config["var_kwargs"]["var"]["depth"]
    assert info["vqvae"]["vocab_size"] == var_fixture_config["vae_kwargs"]["vocab_size"]


def test_describe_pipeline_folder_has_family_and_parameters(saved_folder, var_official_files):
    info = describe_checkpoint(saved_folder)
    n = sum(p.numel() for p in load_var_transformer(var_official_files["var"]).parameters())
    n += sum(p.numel() for p in load_var_vqvae(var_official_files["vae"]).parameters())
    assert info.get("family") == "var"
    assert info.get("parameters") == n


def test_describe_folder_without_index(tmp_path):
    with pytest.raises(ValueError, match=r"without model_index\.json"):
        describe_checkpoint(tmp_path)
