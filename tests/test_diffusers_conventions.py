"""What diffusers users bring (issue #35): the generic loader, loading arguments, variants."""
from __future__ import annotations

import json

import pytest
import torch
from diffusers import DiffusionPipeline

from sparsevar import FlexVARPipeline, HARTPipeline, InfinityPipeline, VARPipeline
from sparsevar.demo import DEMO_MODEL_DIR


def _call(pipe, seed: int):
    g = torch.Generator().manual_seed(seed)
    if isinstance(pipe, (InfinityPipeline, HARTPipeline)):
        kw = dict(height=256, width=256) if isinstance(pipe, InfinityPipeline) else {}
        return pipe(["a red box"], generator=g, output_type="pt", **kw).images
    return pipe([1], generator=g, output_type="pt").images


FAMILIES = {"var": lambda: VARPipeline.from_random("var-tiny"),
            "flexvar": lambda: FlexVARPipeline.from_random("flexvar-tiny"),
            "infinity": lambda: InfinityPipeline.from_random("infinity-tiny"),
            "hart": lambda: HARTPipeline.from_random("hart-tiny")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generic_diffusion_pipeline_loader_reads_every_familys_folder(family, tmp_path):
    """``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` on a folder we saved gives
    our class, and it draws the same picture as the pipeline that was saved; without
    ``trust_remote_code`` diffusers refuses (its rule for any module in a folder), naming it. (diffusers
    copies the two-line module into its modules cache, HF_MODULES_CACHE, as for any such folder.)"""
    pipe = FAMILIES[family]()
    pipe.set_progress_bar_config(disable=True)
    folder = tmp_path / family
    pipe.save_pretrained(folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == ["sparsevar_pipeline", type(pipe).__name__]
    assert "from sparsevar import " + type(pipe).__name__ in (folder / "sparsevar_pipeline.py").read_text()
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        DiffusionPipeline.from_pretrained(folder)
    loaded = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    assert type(loaded) is type(pipe)
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(_call(loaded, 3), _call(pipe, 3))
    ours = type(pipe).from_pretrained(folder)                              # and our own loader, as before
    ours.set_progress_bar_config(disable=True)
    assert torch.equal(_call(ours, 3), _call(pipe, 3))


# ---- loading arguments as diffusers users write them --------------------------------------------------
@pytest.fixture(scope="module")
def var_folder(tmp_path_factory):
    pipe = VARPipeline.from_random("var-tiny")
    folder = tmp_path_factory.mktemp("var") / "pipe"
    pipe.save_pretrained(folder)
    return pipe, folder


def test_torch_dtype_local_files_only_and_device_map_load_as_diffusers_does(var_folder):
    pipe, folder = var_folder
    loaded = VARPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16, local_files_only=True,
                                         device_map="cpu", use_safetensors=True, low_cpu_mem_usage=True)
    assert next(loaded.transformer.parameters()).dtype == torch.bfloat16
    assert loaded.device.type == "cpu"
    again = VARPipeline.from_pretrained(folder, local_files_only=False)       # nothing is downloaded either way
    assert torch.equal(_call(again, 1), _call(pipe, 1))


def test_components_passed_by_name_are_used_as_they_are(var_folder):
    pipe, folder = var_folder
    other = VARPipeline.from_random("var-tiny", seed=7)
    mixed = VARPipeline.from_pretrained(folder, transformer=other.transformer)
    assert mixed.transformer is other.transformer                             # not copied, not reloaded
    assert torch.equal(_call(mixed, 2), _call(VARPipeline(transformer=other.transformer, vqvae=pipe.vqvae), 2))
    # a component passed in need not be in the folder
    import shutil
    partial = folder.parent / "no-transformer"
    shutil.copytree(folder, partial)
    shutil.rmtree(partial / "transformer")
    assert VARPipeline.from_pretrained(partial, transformer=other.transformer).transformer is other.transformer
    with pytest.raises(FileNotFoundError, match="transformer"):
        VARPipeline.from_pretrained(partial)
    # a passed component must agree with the folder's others, as a saved one must
    cfg = other.transformer.config
    wider = type(other.transformer)(**{**cfg, "vocab_size": cfg.vocab_size + 8})
    with pytest.raises(ValueError, match=r"the transformer and the VQVAE do not match: .*vocab_size"):
        VARPipeline.from_pretrained(folder, transformer=wider)


def test_save_pretrained_variant_reads_back_with_the_same_variant(tmp_path):
    """``save_pretrained(variant="fp16")`` writes ``*.fp16.safetensors`` for every component (the
    text encoder's too) and ``from_pretrained(variant="fp16")`` reads them: the same weights and the
    same picture as the folder saved without a variant. Without the variant such a folder holds no
    default weights, and a variant a folder lacks is named with what it holds."""
    for pipe in (VARPipeline.from_random("var-tiny").to(torch.float16), InfinityPipeline.from_random("infinity-tiny")):
        folder, plain = tmp_path / type(pipe).__name__, tmp_path / f"{type(pipe).__name__}-plain"
        pipe.save_pretrained(folder, variant="fp16")
        pipe.save_pretrained(plain)
        assert sorted(p.name for p in (folder / "transformer").glob("*.safetensors")) == \
            ["diffusion_pytorch_model.fp16.safetensors"]
        if isinstance(pipe, InfinityPipeline):
            assert sorted(p.name for p in (folder / "text_encoder").glob("*.safetensors")) == ["model.fp16.safetensors"]
        loaded, reference = type(pipe).from_pretrained(folder, variant="fp16"), type(pipe).from_pretrained(plain)
        for a, b in zip(loaded.transformer.state_dict().values(), pipe.transformer.state_dict().values()):
            assert torch.equal(a, b)
        for p_ in (loaded, reference):
            p_.set_progress_bar_config(disable=True)
        assert torch.equal(_call(loaded, 4), _call(reference, 4))
        with pytest.raises(FileNotFoundError, match="diffusion_pytorch_model.safetensors is missing"):
            type(pipe).from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match=r"no 'fp16' variant .* holds diffusion_pytorch_model.safetensors"):
        VARPipeline.from_pretrained(tmp_path / "VARPipeline-plain", variant="fp16")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"device_map": "balanced"}, ValueError, r"device_map='balanced': these pipelines run on one device"),
    ({"device_map": {"transformer": 0}}, ValueError, "run on one device"),
    ({"device_map": "gpu7"}, ValueError, r"device_map='gpu7': not a device"),
    ({"device_map": "meta"}, ValueError, "not a device"),
    ({"revision": "main"}, TypeError, r"revision= fetches from the Hugging Face Hub"),
    ({"cache_dir": "/tmp"}, TypeError, r"cache_dir= fetches from the Hugging Face Hub"),
    ({"custom_pipeline": "x"}, TypeError, r"unexpected argument custom_pipeline="),
    ({"variant": "fp 16"}, ValueError, r"variant='fp 16': a weight variant is a name"),
    ({"local_files_only": "yes"}, TypeError, "local_files_only='yes'"),
    ({"use_safetensors": False}, ValueError, r"use_safetensors=False: .*leave use_safetensors out"),
    ({"low_cpu_mem_usage": False}, ValueError, "low_cpu_mem_usage=False"),
    ({"transformer": torch.nn.Linear(2, 2)}, TypeError, r"transformer=Linear: VARPipeline takes a VARTransformer"),
    ({"vqvae": None}, TypeError, r"vqvae=None: VARPipeline takes a MultiScaleVQVAE"),
])
def test_loading_arguments_that_cannot_apply_are_refused_in_one_line_before_loading(var_folder, kwargs, error,
                                                                                   match, monkeypatch):
    from sparsevar.models import loading
    _, folder = var_folder
    monkeypatch.setattr(loading, "load_pretrained_component",
                        lambda *a, **k: pytest.fail("loaded weights before refusing"))
    with pytest.raises(error, match=match) as e:
        VARPipeline.from_pretrained(folder, **kwargs)
    assert "\n" not in str(e.value)


def test_device_map_naming_a_gpu_this_machine_lacks_says_what_it_has():
    wanted = f"cuda:{torch.cuda.device_count()}"                 # one past the last GPU (cuda:0 on a CPU machine)
    with pytest.raises(ValueError, match=rf"device_map='{wanted}': this machine has (no CUDA device|\d+ CUDA device)"):
        VARPipeline.from_pretrained(DEMO_MODEL_DIR, device_map=wanted)


def test_the_shipped_demo_folder_loads_through_the_generic_loader():
    pipe = DiffusionPipeline.from_pretrained(DEMO_MODEL_DIR, trust_remote_code=True)
    assert type(pipe) is VARPipeline and pipe.labels[8] == "tree"
