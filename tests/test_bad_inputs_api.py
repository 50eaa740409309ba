"""Bad input from Python (issue #27 §3, the second campaign): pipeline calls with arguments of the wrong
type or value, and the ComfyUI nodes' ``execute`` methods called directly with widget values a user
can type. Each mistake is one ValueError / TypeError line naming the argument (or the node and its
widget), the value and the fix, raised before any work — never an AttributeError deep inside, and
never Python advice in a node."""
from __future__ import annotations

import json

import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.policies.sparsevar import SparseVARConfig, SparseVARPolicy



@pytest.fixture(scope="module")
def demo():
    pipe = VARPipeline.from_demo()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg, msg
    return msg


# ---- 1. pipeline calls: the type of every argument is checked before the scale loop ------------------------
@pytest.mark.parametrize("kwargs, error, words", [
    (dict(class_labels=3.0), TypeError, "class_labels must be a class id, a class name, or a list of them, got "
                                        "float 3.0"),
    (dict(class_labels={"tree": 1}), TypeError, "got dict"),             # was: its keys read as class names
    (dict(class_labels="²"), ValueError, "unknown class name '²'"),      # was: int()'s own message
    (dict(class_labels=1, generator=42), TypeError, "generator must be a torch.Generator (or a list of one per "
                                                    "image), got int 42; e.g. generator=torch.Generator()"),
    (dict(class_labels=[1, 2], generator=[1, 2]), TypeError, "generator must be a torch.Generator"),
    (dict(class_labels=1, generator="cuda"), TypeError, "got str 'cuda'"),
    (dict(class_labels=1, num_images_per_prompt=True), TypeError,
     "num_images_per_prompt must be an int >= 1, got True"),
    (dict(class_labels=1, callback_on_step_end=5), TypeError, "callback_on_step_end must be a function fn(pipe, "
                                                              "step, timestep, callback_kwargs), got int 5"),
    (dict(class_labels=1, callback_on_step_end_tensor_inputs="codes"), TypeError,
     "callback_on_step_end_tensor_inputs must be a list of names, got the string 'codes'; e.g. ['codes']"),
    (dict(class_labels=1, policies=SparseVARConfig()), TypeError,
     "policies must be a list of Policy objects, got a SparseVARConfig, not a list; e.g. "
     "policies=[SparseVARPolicy(config)]"),
    (dict(class_labels=1, policies=[SparseVARConfig()]), TypeError, "got a SparseVARConfig; e.g. "
                                                                    "policies=[SparseVARPolicy(config)]"),
])
def test_call_arguments_of_the_wrong_type_are_named_before_any_scale_runs(demo, kwargs, error, words):
    scales = []
    kwargs = {"generator": torch.Generator().manual_seed(0), **kwargs}
    cb = kwargs.get("callback_on_step_end")
    if cb is None:
        kwargs["callback_on_step_end"] = lambda p, si, t, kw: scales.append(si) or kw
    with pytest.raises(error) as e:
        demo(**kwargs)
    assert words in _one_line(e)
    assert scales == []                                   # refused before the first scale


def test_the_pipeline_works_after_a_refused_call_and_after_a_callback_that_raised(demo):
    def boom(p, si, t, kw):
        raise ZeroDivisionError("from the callback")
    with pytest.raises(ZeroDivisionError, match="from the callback"):    # the user's own error, passed through
        demo(3, generator=torch.Generator().manual_seed(0), callback_on_step_end=boom)
    with pytest.raises(TypeError):
        demo(3, generator=7)
    a = demo(3, generator=torch.Generator().manual_seed(0), output_type="pt").images
    b = VARPipeline.from_demo()(3, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert a.shape == b.shape == (1, 3, 256, 256) and torch.equal(a, b)


@pytest.mark.parametrize("call, error, words", [
    (lambda: VARPipeline.from_pretrained(None), TypeError,
     "pretrained_model_name_or_path must be a local path (str or pathlib.Path), got NoneType None"),
    (lambda: VARPipeline.from_pretrained(""), ValueError, "pretrained_model_name_or_path='' is empty"),
    (lambda: VARPipeline.from_single_file(3, "vae.pth"), TypeError, "var_ckpt must be a local path"),
    (lambda: VARPipeline.from_path(None), TypeError, "model must be a local path"),
    (lambda: VARPipeline.from_demo().to("bogus"), ValueError,
     "to('bogus'): not a device; pass 'cpu', 'cuda' or 'cuda:N' (or a torch.device)"),
    (lambda: VARPipeline.from_demo().to("float16"), ValueError, "for a dtype pass torch.float16"),
    (lambda: VARPipeline.from_demo().to("meta"), ValueError,       # was: "unsupported scalarType" at the next call
     "to('meta'): the meta device holds no weights, so the pipeline could not generate again; pass 'cpu'"),
    (lambda: VARPipeline.from_demo().to(torch.device("meta")), ValueError, "to('meta'): the meta device"),
    (lambda: VARPipeline.from_demo().to(device="meta", dtype=torch.float16), ValueError, "to('meta')"),
])
def test_paths_and_devices_of_the_wrong_kind_name_the_argument(call, error, words):
    with pytest.raises(error) as e:
        call()
    assert words in _one_line(e)


def test_an_anchor_stride_past_the_map_is_the_stride_of_the_map(demo):
    """alpha=10**20 raised OverflowError inside the scale loop; every stride at or past the largest
    map's side (16 on the demo model) draws the same anchor grid, so the same image."""
    side = max(demo.transformer.config.patch_nums)
    images = []
    for alpha in (side, 10 ** 20):
        out = demo(3, generator=torch.Generator().manual_seed(0), output_type="pt",
                   policies=[SparseVARPolicy(SparseVARConfig(tau=0.3, start_scale=-3, alpha=alpha))])
        images.append(out.images)
    assert images[0].shape == (1, 3, 256, 256) and torch.equal(images[0], images[1])


# ---- 2. the ComfyUI nodes, called directly (a real ComfyUI on the path, no server) --------------------------
UNLOAD_SCRIPT = r"""
import json
import comfy.cli_args
comfy.cli_args.args.cpu = True
from sparsevar.nodes import var_nodes as V
demo = V.VARModelLoader.execute(V.DEMO_CHOICE, V.FROM_FOLDER, "auto").result[0]
base = dict(model=demo, conditioning=V.VARClassNode.execute("3").result[0], seed=0, cfg=4.0, top_k=900, top_p=0.95,
            batch_size=1)
V.SparseVARSampler.execute(**base)
ws = lambda: demo.pipe.adapter()._workspace is not None
out = {"after a call": ws()}
demo.patcher.detach(unpatch_all=False)
out["detached, weights kept"] = ws()
demo.patcher.detach(unpatch_all=True)
out["unloaded"] = ws()
out["class"] = type(demo.patcher).__name__
print("UNLOAD", json.dumps(out))
"""


def test_comfyui_unloading_the_model_frees_its_workspace(node_calls):
    out = node_calls["UNLOAD"]
    assert out == {"after a call": True, "detached, weights kept": True, "unloaded": False,
                   "class": "WholeModelPatcher"}



NODE_SCRIPT = r"""
import json, sys
import comfy.cli_args
comfy.cli_args.args.cpu = True
from sparsevar.nodes import var_nodes as V
demo = V.VARModelLoader.execute(V.DEMO_CHOICE, V.FROM_FOLDER, "auto").result[0]
cls = lambda label: V.VARClassNode.execute(label).result[0]
base = dict(model=demo, conditioning=cls("3"), seed=0, cfg=4.0, top_k=900, top_p=0.95, batch_size=1)
sv = V.SparseVARSettingsNode.execute(tau=0.6, start_scale=0, block=-1, keep_ratio=0.0).result[0]
fv = V.FastVARSettingsNode.execute(ratios="0.5").result[0]
cases = {
    "empty": dict(conditioning=cls(" | ")),
    "superscript": dict(conditioning=cls("²")),
    "negative": dict(conditioning=cls("-1")),
    "typo": dict(conditioning=cls("tre")),
    "both methods": dict(sparsevar=sv, fastvar=fv),
}
out = {}
for name, kw in cases.items():
    try:
        V.SparseVARSampler.execute(**{**base, **kw})
        out[name] = "no error"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
for name, kw in (("blank class", dict(class_label="  ")), ("legacy typo", dict(class_label="tre"))):
    try:
        V.VARClassNode.execute(**kw) if name == "blank class" else V.LegacySparseVARSampler.execute(
            **{k: v for k, v in base.items() if k != "conditioning"}, **kw)
        out[name] = "no error"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
dense = V.SparseVARSampler.execute(**base).result
try:
    V.TokenMapPreview.execute(token_maps=dense[2], images=dense[0])
    out["preview"] = "no error"
except Exception as e:
    out["preview"] = f"{type(e).__name__}: {e}"
print("NODES", json.dumps(out))
"""


@pytest.fixture(scope="module")
def node_calls(run_with_comfyui, tmp_path_factory):
    """NODE_SCRIPT, then UNLOAD_SCRIPT, in one fresh interpreter (importing ComfyUI is most of their
    time): {"NODES": its output, "UNLOAD": its output, "cwd": the empty folder they ran in}."""
    cwd = tmp_path_factory.mktemp("comfyui-nodes")
    r = run_with_comfyui(NODE_SCRIPT + UNLOAD_SCRIPT, cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines()
           if line.startswith(("NODES ", "UNLOAD "))}
    assert set(got) == {"NODES", "UNLOAD"}, r.stdout[-3000:]
    return {**got, "cwd": cwd}


def test_node_widgets_get_one_line_that_names_the_node_and_the_widget(node_calls):
    out = node_calls["NODES"]
    for name, msg in out.items():
        assert msg.startswith("ValueError: ") and "\n" not in msg, (name, msg)
        assert "pipe." not in msg and "disable_" not in msg, (name, msg)   # no Python advice in a node
    takes = "Give one of the class ids 0..11 or the model's class names"
    assert out["empty"] == ("ValueError: VAR Class: class_label is empty: give one of the class ids 0..11 "
                            "or the model's class names, several separated by '|'")
    assert out["superscript"] == f"ValueError: VAR Class: class_label '²': unknown class name '²'. {takes}"
    assert out["negative"] == ("ValueError: VAR Class: class_label '-1': class label -1 is out of range: this "
                               "model has classes 0..11")
    assert out["typo"].startswith("ValueError: VAR Class: class_label 'tre'")
    assert out["typo"].endswith("Did you mean 'tree'? " + takes)
    assert out["blank class"].startswith("ValueError: VAR Class: class_label is empty")
    assert out["legacy typo"].startswith("ValueError: SparseVAR Sampler: class_label 'tre'")   # where its widget is
    assert out["legacy typo"].endswith("Did you mean 'tree'? " + takes)
    assert "'fastvar' and 'sparsevar' / 'anchors' are both connected" in out["both methods"]
    assert "disconnect one of them" in out["both methods"]
    assert out["preview"].startswith("ValueError: Token Map Preview: these stats hold no token maps: connect a "
                                     "SparseVAR Settings node to the sampler's 'sparsevar' input")
    assert sorted(p.name for p in node_calls["cwd"].iterdir()) == []    # nothing written where they ran


def test_save_pretrained_onto_a_file_names_it_and_leaves_the_file(tmp_path):
    """Was: diffusers' raw NotADirectoryError from deep inside save_pretrained."""
    target = tmp_path / "model.png"
    target.write_bytes(b"an image")
    with pytest.raises(ValueError) as e:
        VARPipeline.from_demo().save_pretrained(target)
    assert f"save_directory={str(target)!r} is a file; pass a folder" in _one_line(e)
    assert target.read_bytes() == b"an image" and sorted(tmp_path.iterdir()) == [target]


def test_a_half_precision_pipeline_on_the_cpu_runs_without_diffusers_warning(demo, caplog):
    """diffusers warns that float16 "cannot run" on the CPU; it runs here, so the warning is wrong."""
    caplog.set_level("WARNING")
    pipe = VARPipeline.from_demo(dtype=torch.float16).to("cpu")
    assert "cannot run with `cpu` device" not in caplog.text
    image = pipe(3, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert image.shape == (1, 3, 256, 256) and torch.isfinite(image).all() and image.std() > 0.05
