"""VARPipeline: input checking, class names, outputs, seeding, batching, save/load, progress bar,
step callback and interrupt.

Generation runs on the tiny fixture model (10 classes, vocab 96, 256 px); class-name lookup runs on
the 1000-class random ``var-tiny`` model, which carries the ImageNet names.
"""
from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import PIL.Image
import pytest
import torch

from sparsevar import VARPipeline, VARPipelineOutput
from sparsevar.policies.scale_skip import ScaleSkipConfig, ScaleSkipPolicy


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def pipe(var_official_files) -> VARPipeline:
    p = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def tiny() -> VARPipeline:
    p = VARPipeline.from_random("var-tiny", seed=0)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def size(var_fixture_config) -> int:
    return var_fixture_config["image_resolution"]


def _record(store: list):
    def cb(p, si, t, kw):
        store.append((si, t, {k: v.clone() for k, v in kw.items()}))
        return kw
    return cb


# ---- check_inputs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(class_labels=10), r"class label 10 is out of range.*0\.\.9"),
    (dict(class_labels=[1, -1]), r"class label -1 is out of range"),
    (dict(class_labels=None), r"class_labels is required"),
    (dict(class_labels=[]), r"class_labels is empty"),
    (dict(guidance_scale=-0.5), r"guidance_scale must be a number in \[0, 100\].*-0\.5"),
    (dict(guidance_scale=1e308), r"guidance_scale must be a number in \[0, 100\].*1e\+308"),
    (dict(top_k=-1), r"top_k must be an int >= 0.*-1"),
    (dict(top_k=2.5), r"top_k must be an int >= 0.*2\.5"),
    (dict(top_p=1.5), r"top_p must be in \[0, 1\].*1\.5"),
    (dict(top_p=-0.1), r"top_p must be in \[0, 1\].*-0\.1"),
    (dict(num_images_per_prompt=0), r"num_images_per_prompt must be an int >= 1.*0"),
    (dict(output_type="jpeg"), r"output_type must be one of .*'jpeg'"),
    (dict(class_labels=[1, 2], generator=[torch.Generator()] * 3), r"got 3 generators for 2 images"),
    (dict(class_labels=[1, 2], num_images_per_prompt=2, generator=[torch.Generator()] * 2),
     r"got 2 generators for 4 images"),
    (dict(callback_on_step_end_tensor_inputs=["codes", "hidden"]),
     r"callback_on_step_end_tensor_inputs has \['hidden'\]"),
])
def test_invalid_arguments_are_named(pipe, kwargs, message):
    kwargs = {"class_labels": 1, "output_type": "latent", **kwargs}
    with pytest.raises(ValueError, match=message):
        pipe(**kwargs)


def test_boolean_label_is_a_type_error(pipe):
    with pytest.raises(TypeError, match=r"class_labels entries must be ints or names, got True"):
        pipe(True, output_type="latent")


def test_empty_label_tensor_is_rejected(pipe):
    with pytest.raises(ValueError, match=r"class_labels is empty"):
        pipe(torch.tensor([], dtype=torch.long), output_type="latent")


# ---- class names ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", [
    ("golden retriever", 207), ("goldfish", 1), ("Goldfish", 1), ("  goldfish ", 1),
    ("Carassius auratus", 1), ("tench, Tinca tinca", 0), ("207", 207),
])
def test_names_resolve(tiny, name, expected):
    assert tiny.get_label_ids(name) == [expected]


def test_mixed_ids_and_names(tiny):
    assert tiny.get_label_ids([1, "golden retriever", np.int64(980)]) == [1, 207, 980]
    assert tiny.get_label_ids(torch.tensor([3, 4])) == [3, 4]
    assert tiny.labels[207] == "golden retriever"


def test_misspelled_name_gets_a_suggestion(tiny):
    with pytest.raises(ValueError, match=r"unknown class name 'golden retrever'\. Did you mean 'golden retriever'"):
        tiny(["golden retrever"], output_type="latent")


@pytest.mark.parametrize("name, ids", [("crane", (134, 517)), ("panda", (387, 388))])
def test_ambiguous_name_lists_every_id(tiny, name, ids):
    with pytest.raises(ValueError, match=rf"class name '{name}' is ambiguous") as exc:
        tiny.get_label_ids(name)
    for i in ids:
        assert f"{i} = " in str(exc.value)


def test_names_on_a_model_without_names(pipe):
    assert pipe.labels == {}
    with pytest.raises(ValueError, match=r"class name 'cat' given, but this model has no class names.*0\.\.9"):
        pipe.get_label_ids("cat")


def test_id2label_gives_names(pipe):
    named = VARPipeline(transformer=pipe.transformer, vqvae=pipe.vqvae,
                        id2label={i: f"class {chr(97 + i)}" for i in range(10)})
    assert named.get_label_ids(["class c", "CLASS J"]) == [2, 9]


# ---- outputs ----------------------------------------------------------------------------------------------------
def test_output_types(pipe, size):
    kw = dict(class_labels=[2, 7], guidance_scale=1.5)
    pt = pipe(**kw, generator=_g(0), output_type="pt").images
    assert isinstance(pt, torch.Tensor) and pt.dtype == torch.float32 and pt.shape == (2, 3, size, size)
    assert 0.0 <= pt.min() and pt.max() <= 1.0 and pt.std() > 0

    arr = pipe(**kw, generator=_g(0), output_type="np").images
    assert isinstance(arr, np.ndarray) and arr.shape == (2, size, size, 3) and arr.dtype == np.float32
    np.testing.assert_array_equal(arr, pt.permute(0, 2, 3, 1).numpy())

    pil = pipe(**kw, generator=_g(0), output_type="pil").images
    assert isinstance(pil, list) and len(pil) == 2
    assert all(isinstance(im, PIL.Image.Image) and im.mode == "RGB" and im.size == (size, size) for im in pil)
    np.testing.assert_array_equal(np.stack([np.asarray(im) for im in pil]), (arr * 255).round().astype(np.uint8))
    from diffusers.image_processor import VaeImageProcessor             # converted on the device, same pictures
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(pil, VaeImageProcessor.numpy_to_pil(arr)))

    latent = pipe(**kw, generator=_g(0), output_type="latent").images
    z = pipe.vqvae.config.z_channels
    h = pipe.transformer.config.patch_nums[-1]
    assert latent.shape == (2, z, h, h)
    img = (pipe.vqvae.fhat_to_img(latent) + 1) * 0.5
    torch.testing.assert_close(img, pt, atol=1e-6, rtol=0)     # "latent" is what "pt" decodes


def test_return_dict_false_gives_a_tuple(pipe):
    out = pipe(3, generator=_g(0), output_type="latent", return_dict=False)
    assert isinstance(out, tuple) and len(out) == 2
    images, stats = out
    ref = pipe(3, generator=_g(0), output_type="latent")
    assert isinstance(ref, VARPipelineOutput)
    assert torch.equal(images, ref.images)
    assert len(stats) == 1 and len(stats[0].scales) == pipe.num_timesteps


# ---- seeding and batching ------------------------------------------------------------------------------------
def test_same_seed_same_image_other_seed_other_image(pipe):
    a = pipe([4], generator=_g(11), output_type="pt").images
    b = pipe([4], generator=_g(11), output_type="pt").images
    c = pipe([4], generator=_g(12), output_type="pt").images
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert (a - c).abs().mean() > 1e-3


def test_batch_with_one_generator_per_image_equals_single_runs(pipe):
    """Image b draws only from generators[b], so it gets the codes it would get alone.

    The codes are compared bit for bit. The images only within float tolerance: CPU conv2d / matmul
    kernels are not batch-size invariant (about 1e-6 here), so a batch of 2 cannot equal two
    batches of 1 bit for bit even though every random draw is the same.
    """
    batch_codes, single_codes = [], [[], []]
    batch = pipe([3, 5], generator=[_g(1), _g(2)], output_type="pt", callback_on_step_end=_record(batch_codes))
    singles = []
    for b, (label, seed) in enumerate([(3, 1), (5, 2)]):
        singles.append(pipe([label], generator=_g(seed), output_type="pt",
                            callback_on_step_end=_record(single_codes[b])).images)
    scales = len(pipe.transformer.config.patch_nums)
    assert len(batch_codes) == len(single_codes[0]) == len(single_codes[1]) == scales > 0
    for si in range(scales):
        codes = batch_codes[si][2]["codes"]
        assert torch.equal(codes[0:1], single_codes[0][si][2]["codes"]), f"image 0, scale {si}"
        assert torch.equal(codes[1:2], single_codes[1][si][2]["codes"]), f"image 1, scale {si}"
    torch.testing.assert_close(batch.images, torch.cat(singles), atol=1e-5, rtol=0)


def test_num_images_per_prompt_repeats_each_label(pipe):
    gens = lambda: [_g(s) for s in (5, 6, 7, 8)]  # noqa: E731
    rep = pipe([3, 5], num_images_per_prompt=2, generator=gens(), output_type="latent").images
    explicit = pipe([3, 3, 5, 5], generator=gens(), output_type="latent").images
    other_order = pipe([3, 5, 3, 5], generator=gens(), output_type="latent").images
    assert rep.shape[0] == 4
    assert torch.equal(rep, explicit)
    assert not torch.equal(rep, other_order)


# ---- save / load ------------------------------------------------------------------------------------------------
def test_save_pretrained_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "folder")
    index = json.loads((tmp_path / "folder" / "model_index.json").read_text())
    assert index["_class_name"] == ["sparsevar_pipeline", "VARPipeline"]      # diffusers' [module, class] form
    assert index["transformer"] == ["sparsevar", "VARTransformer"]
    assert index["vqvae"] == ["sparsevar", "MultiScaleVQVAE"]

    loaded = VARPipeline.from_pretrained(tmp_path / "folder")
    loaded.set_progress_bar_config(disable=True)
    public = lambda cfg: {k: v for k, v in dict(cfg).items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.transformer.config) == public(pipe.transformer.config)
    assert public(loaded.vqvae.config) == public(pipe.vqvae.config)
    a = pipe([1, 8], generator=_g(3), output_type="pt").images
    b = loaded([1, 8], generator=_g(3), output_type="pt").images
    assert torch.equal(a, b)


def test_save_pretrained_keeps_class_names(pipe, tmp_path):
    named = VARPipeline(transformer=pipe.transformer, vqvae=pipe.vqvae, id2label={4: "four"})
    named.save_pretrained(tmp_path / "named")
    loaded = VARPipeline.from_pretrained(tmp_path / "named")
    assert loaded.labels == {4: "four"}
    assert loaded.get_label_ids("four") == [4]


def test_from_pretrained_models_are_frozen_like_from_single_file(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "folder")
    loaded = VARPipeline.from_pretrained(tmp_path / "folder")
    assert not any(m.training for m in loaded.transformer.modules())
    assert not any(p.requires_grad for p in loaded.transformer.parameters())
    assert not any(p.requires_grad for p in loaded.vqvae.parameters())


def test_from_pretrained_missing_folder(tmp_path):
    path = tmp_path / "not-a-pipeline"
    with pytest.raises(FileNotFoundError, match=r"not-a-pipeline.*no model_index\.json.*from_single_file"):
        VARPipeline.from_pretrained(path)


def test_from_pretrained_rejects_unknown_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"revision"):
        VARPipeline.from_pretrained(tmp_path, revision="main")


def test_from_random_unknown_preset():
    with pytest.raises(ValueError, match=r"preset='var-d17' is unknown.*var-tiny"):
        VARPipeline.from_random("var-d17")


# ---- progress bar -------------------------------------------------------------------------------------------------
def test_progress_bar_config_is_honoured(pipe, capsys):
    try:
        pipe.set_progress_bar_config(disable=False)
        pipe(1, generator=_g(0), output_type="latent")
        shown = capsys.readouterr()
        assert f"{pipe.num_timesteps}/{pipe.num_timesteps}" in shown.err
        pipe.set_progress_bar_config(disable=True)
        pipe(1, generator=_g(0), output_type="latent")
        hidden = capsys.readouterr()
        assert hidden.err == "" and hidden.out == ""
    finally:
        pipe.set_progress_bar_config(disable=True)


# ---- callback and interrupt ---------------------------------------------------------------------------------------
def test_callback_is_called_once_per_scale_with_the_requested_tensors(pipe):
    calls, current = [], []

    def cb(p, si, t, kw):
        current.append(p.current_timestep)
        calls.append((si, t, {k: v.clone() for k, v in kw.items()}))
        return kw

    out = pipe([2, 6], generator=_g(0), output_type="latent", callback_on_step_end=cb,
               callback_on_step_end_tensor_inputs=["codes", "logits", "latent"])
    sched = pipe.transformer.schedule
    V = pipe.transformer.config.vocab_size
    assert [c[0] for c in calls] == list(range(sched.num_scales)) == [c[1] for c in calls]
    assert current == list(range(sched.num_scales)) and pipe.current_timestep is None
    for si, _, kw in calls:
        assert set(kw) == {"codes", "logits", "latent"}
        assert kw["codes"].shape == (2, sched.tokens(si)) and kw["codes"].dtype == torch.long
        assert kw["logits"].shape == (2, sched.tokens(si), V)
        assert kw["latent"].shape == out.images.shape
        assert 0 <= kw["codes"].min() and kw["codes"].max() < V
    assert torch.equal(calls[-1][2]["latent"], out.images)

    only_codes = []
    pipe([2], generator=_g(0), output_type="latent", callback_on_step_end=_record(only_codes))
    assert [si for si, _, _ in only_codes] == list(range(sched.num_scales))
    assert all(set(kw) == {"codes"} for _, _, kw in only_codes)       # default: codes only


def test_interrupt_inside_the_callback_stops_early(pipe, size):
    latents = []

    def cb(p, si, t, kw):
        latents.append(kw["latent"].clone())
        if si == 3:
            p._interrupt = True
        return kw

    out = pipe([2], generator=_g(0), output_type="pt", callback_on_step_end=cb,
               callback_on_step_end_tensor_inputs=["latent"])
    assert len(latents) == 4
    stats = out.stats[0]
    assert [s.skipped for s in stats.scales] == [False] * 4 + [True] * (pipe.num_timesteps - 4)
    assert all(s.tokens_computed == 0 for s in stats.scales[4:])
    assert out.images.shape == (1, 3, size, size)
    expected = (pipe.vqvae.fhat_to_img(latents[-1]) + 1) * 0.5      # the latent of scales 0..3, decoded
    torch.testing.assert_close(out.images, expected, atol=1e-6, rtol=0)

    again = pipe([2], generator=_g(0), output_type="latent")        # the flag does not outlive the call
    assert not any(s.skipped for s in again.stats[0].scales)


def test_flop_speedup_counts_the_rows_cond_only_drops():
    """Cond-only scales run one row per image instead of two: the FLOP ideal must show it."""
    pipe = VARPipeline.from_random("var-tiny")
    pipe.set_progress_bar_config(disable=True)
    dense = pipe([1], generator=torch.Generator().manual_seed(0), output_type="latent").stats[0]
    assert [s.rows for s in dense.scales] == [2] * 10 and pipe.flop_speedup(dense) == 1.0
    cond = pipe([1], generator=torch.Generator().manual_seed(0), output_type="latent",
                policies=[ScaleSkipPolicy(ScaleSkipConfig(cond_only_from=-2))]).stats[0]
    assert [s.rows for s in cond.scales] == [2] * 8 + [1] * 2
    # The expectation from first principles (2 FLOPs per multiply-add), for var-tiny's configuration:
    cfg = pipe.transformer.config
    C, hidden, V, depth, patch_nums = 256, 1024, 4096, 4, (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
    assert (cfg.embed_dim, round(cfg.embed_dim * cfg.mlp_ratio), cfg.vocab_size, cfg.depth, tuple(cfg.patch_nums)) \
        == (C, hidden, V, depth, patch_nums)
    per_row, cached = [], 0
    for p in patch_nums:
        n = p * p                                       # every token computed (no policy drops any)
        cached += n                                     # block-causal: a scale attends to itself and all before it
        per_layer = n * 2 * (4 * C * C)                 # q, k, v and output projections
        per_layer += n * 2 * (2 * C * hidden)           # FFN fc1 and fc2
        per_layer += 2 * (2 * n * cached * C)           # q·kᵀ and attention·v
        per_row.append(depth * per_layer + 2 * n * C * V)   # the head on every token of the map
    expected = Fraction(2 * sum(per_row), 2 * sum(per_row[:8]) + 1 * sum(per_row[8:]))
    assert expected == Fraction(839537, 560503)         # ≈ 1.4978: the last two scales hold most of the FLOPs
    # every term is an integer below 2**53, so the float sums are exact and the one division is correctly
    # rounded: exact equality, no tolerance needed
    assert pipe.flop_speedup(cond) == float(expected)


# ---- sampling defaults: one set per family, the same at every entry point -----------------------------------
NODE_DEFAULTS = r"""
import json
import comfy.cli_args
comfy.cli_args.args.cpu = True
from sparsevar.nodes import var_nodes as V
inputs = V.SparseVARSampler.define_schema().inputs
print(json.dumps({i.id: i.default for i in inputs if i.id in ("cfg", "top_k", "top_p")}))
"""


def test_sampling_defaults_agree_in_the_pipelines_the_cli_and_the_sampler_node(tmp_path):
    """VAR: guidance 4, top-k 900, top-p 0.95; Infinity: guidance 3, top-k 900, top-p 0.97 and a temperature
    chosen per model (None in the signature: 0.5, or 1.0 for patchify models, test_infinity_pipeline). The CLI
    leaves each flag unset so the pipeline's default applies, and says the numbers in its help; the sampler
    node's widgets (one set for both families) start at VAR's."""
    import inspect
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sparsevar import InfinityPipeline
    from sparsevar.cli import build_parser

    def defaults(fn, names):
        params = inspect.signature(fn).parameters
        return {k: params[k].default for k in names}

    assert defaults(VARPipeline.__call__, ("guidance_scale", "top_k", "top_p")) == \
        {"guidance_scale": 4.0, "top_k": 900, "top_p": 0.95}
    assert defaults(InfinityPipeline.__call__, ("guidance_scale", "top_k", "top_p", "temperature")) == \
        {"guidance_scale": 3.0, "top_k": 900, "top_p": 0.97, "temperature": None}

    parser = build_parser()
    args = parser.parse_args(["generate"])
    assert (args.cfg, args.top_k, args.top_p, args.temperature) == (None, None, None, None)
    generate = next(a for a in parser._actions if a.dest == "command").choices["generate"]
    helps = {a.dest: a.help for a in generate._actions}
    assert "VAR default 4, Infinity 3" in helps["cfg"]
    assert "VAR default 900, Infinity 900" in helps["top_k"]
    assert "VAR default 0.95, Infinity 0.97" in helps["top_p"]
    assert "default 0.5, 1 for 8B" in helps["temperature"]

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here / "comfyui"))
    try:
        from setup_comfyui import ensure
    finally:
        sys.path.pop(0)
    server = ensure(Path(os.environ.get("SPARSEVAR_COMFY_DIR", "/tmp/sparsevar-comfyui")))
    path = [*server["pythonpath"], str(server["main_dir"]), *filter(None, [os.environ.get("PYTHONPATH")])]
    r = subprocess.run([sys.executable, "-c", NODE_DEFAULTS], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    widgets = json.loads(r.stdout.strip().splitlines()[-1])
    assert widgets == {"cfg": 4.0, "top_k": 900, "top_p": 0.95}


def test_auto_kernels_are_tritons_on_a_gpu_that_runs_them_but_not_under_cuda_malloc_async(monkeypatch):
    """"auto" resolves per call from the adapter's device and the allocator: plain torch on the CPU,
    Triton where the GPU runs it, plain torch under cudaMallocAsync (a Triton kernel inside a CUDA
    graph capture was refused its buffer there). The device and the probes are stood in for."""
    from types import SimpleNamespace

    import torch

    from sparsevar.pipelines import _accelerated
    pipe = VARPipeline.from_demo()
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    assert pipe._kernel_kind(SimpleNamespace(device=torch.device("cpu"))) == "torch"
    monkeypatch.setattr(_accelerated, "resolve_backend", lambda backend, device: "triton")
    for allocator, want in (("native", "triton"), ("cudaMallocAsync", "torch")):
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: allocator)
        assert pipe._kernel_kind(on_gpu) == want, allocator
    monkeypatch.setattr(_accelerated, "resolve_backend", lambda backend, device: "torch")   # a GPU Triton can't use
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert pipe._kernel_kind(on_gpu) == "torch"
    assert pipe.set_kernels("torch")._kernel_kind(on_gpu) == "torch"                  # a chosen kind stays


def test_the_triton_probe_names_a_triton_without_dependent_launch_and_a_missing_compiler(monkeypatch):
    import shutil
    import sys
    import types

    import triton.language.extra.cuda  # noqa: F401  (the real module, before it is stood in for below)

    from sparsevar.sparse_ops import _backend
    monkeypatch.setattr(shutil, "which", lambda name: None)
    ok, why = _backend._probe("cuda", 0, False)
    assert not ok and why == "Triton builds its launcher with a C compiler and none was found (install gcc, or set CC)"
    monkeypatch.setitem(sys.modules, "triton.language.extra.cuda", types.ModuleType("triton.language.extra.cuda"))
    ok, why = _backend._probe("cuda", 0, False)
    assert not ok and why.endswith("has no programmatic dependent launch (gdc_wait), which the kernels use: triton "
                                   "3.4 or newer has it")


def test_kernels_are_chosen_by_set_kernels_and_the_old_name_still_works_with_a_warning():
    pipe = VARPipeline.from_demo()
    assert pipe.kernels == "torch" and pipe.adapter().ops.kind == "torch"    # "auto" on the CPU
    with pytest.raises(ValueError, match=r"kernels='fused': use 'auto' .*, 'triton' .*, 'compile' .* or 'torch'"):
        pipe.set_kernels("fused")
    with pytest.raises(ValueError, match=r"set_kernels\('triton'\) needs the model on a CUDA device"):
        pipe.set_kernels("triton")                     # this test runs on the CPU
    assert pipe.kernels == "torch"
    with pytest.warns(DeprecationWarning, match=r"use pipe.set_kernels\('triton'\)"):
        assert pipe.enable_compiled_elementwise(False) is pipe
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="needs the model on a CUDA device"):
        pipe.enable_compiled_elementwise()             # = set_kernels("triton")
    assert pipe.set_kernels("torch").kernels == "torch"
    assert pipe.set_kernels("auto").kernels == "torch" and pipe.adapter().ops.kind == "torch"
