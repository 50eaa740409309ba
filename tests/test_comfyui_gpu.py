"""ComfyUI's memory manager on a real GPU (issue #32), run on the GPU machine: a real ComfyUI server
on the GPU (not ``--cpu``) with Infinity-2B and Flan-T5-XL's encoder at their real sizes (random
weights) under the shipped workflows' file names, on simulated smaller cards.

``--reserve-vram`` tells ComfyUI's manager that only the card's size is there, so it must offload
the text encoder before the sampler; a low-VRAM partial load (offered here with ``--novram``, as
ComfyUI does on a card too small for a model) becomes a full load with one line in the log
(``nodes/var_nodes.WholeModelPatcher``). Where the card is also
enforced, the server's PyTorch is capped at its size (``torch.cuda.set_per_process_memory_fraction``
from a test-only ``sitecustomize``), so that a run which would not fit such a card fails as it would
there; that server runs PyTorch's own allocator with expandable segments (``--disable-cuda-malloc``),
as the README advises for small cards. The other runs ComfyUI's default, cudaMallocAsync, which the
engine's CUDA graphs must work under. The pipelines keep their own kernel choice ("auto"): Triton's
under the native allocator, plain torch under cudaMallocAsync; each stats line names them. Each sampler reports its peak in its stats line; the test
prints them (``-s``) for the results.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.comfyui]

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "comfyui"
sys.path.insert(0, str(HERE))
from setup_comfyui import ensure as ensure_comfyui, get_json, running_server  # noqa: E402
from ui_to_api import ui_to_api  # noqa: E402

GB = 1e9
PEAK = re.compile(r"peak GPU memory ([\d.]+) GB \(reserved ([\d.]+)\)")


@pytest.fixture(scope="module")
def real_size_base(tmp_path_factory):
    """A ComfyUI base folder: this pack, Infinity-2B (random, bf16) and its VAE in models/infinity under
    the official names, a Flan-T5-XL-sized encoder in models/text_encoders/flan-t5-xl."""
    from sparsevar import InfinityPipeline
    from sparsevar.models.text_encoder import random_t5_xl
    base = tmp_path_factory.mktemp("comfy_gpu_base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "sparsevar").symlink_to(ROOT, target_is_directory=True)
    (base / "models" / "infinity").mkdir(parents=True)
    pipe = InfinityPipeline.from_random("infinity-2b", device="cuda", dtype=torch.bfloat16)
    torch.save({k: v.cpu() for k, v in pipe.transformer.state_dict().items()},
               base / "models" / "infinity" / "infinity_2b_reg.pth")
    torch.save({"vae": {k: v.float().cpu() for k, v in pipe.vae.state_dict().items()}},
               base / "models" / "infinity" / "infinity_vae_d32reg.pth")
    del pipe
    tokenizer, t5 = random_t5_xl("cuda", torch.bfloat16)
    t5.save_pretrained(base / "models" / "text_encoders" / "flan-t5-xl")
    tokenizer.save_pretrained(base / "models" / "text_encoders" / "flan-t5-xl")
    del t5
    torch.cuda.empty_cache()
    return base


def _run_workflows(url: str, names: list[str], tmp_path: Path) -> dict:
    """name → (status, stats text) of each shipped workflow run on the server at ``url``."""
    info = get_json(url + "/object_info")
    out = {}
    for name in names:
        prompt = ui_to_api(json.loads((ROOT / "workflows" / name).read_text()), info)
        path = tmp_path / f"{name}.api.json"
        path.write_text(json.dumps(prompt))
        res = subprocess.run([sys.executable, str(HERE / "run_prompt.py"), url, str(path)], capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        rep = json.loads(res.stdout)
        texts = [o["text"][0] for o in rep["outputs"].values() if "text" in o]
        out[name] = (rep["status"], texts, rep)
    return out


def _card(tmp_path: Path, gb: float) -> Path:
    """A sitecustomize folder that caps the server's PyTorch at ``gb`` GB of this GPU."""
    site = tmp_path / f"card_{gb:g}"
    site.mkdir()
    total = torch.cuda.get_device_properties(0).total_memory
    (site / "sitecustomize.py").write_text(
        "import torch\n"
        f"torch.cuda.set_per_process_memory_fraction({gb * GB / total!r})   # a {gb:g} GB card (test only)\n")
    return site


def _reserve(gb: float) -> str:
    """--reserve-vram (GiB, as ComfyUI counts) that leaves ``gb`` GB of this GPU to ComfyUI's manager."""
    return f"{max(0.0, (torch.cuda.get_device_properties(0).total_memory - gb * GB) / 2 ** 30):.2f}"


def _memory_lines(log: str) -> str:
    """What ComfyUI's manager did and any out-of-memory report, from the server log."""
    keep = ("Requested to load", "loaded completely", "loaded partially", "models unloaded", "Unloaded", "SparseVAR:",
            "out of memory", "Got an OOM")
    return "\n".join(line[:400] for line in log.splitlines() if any(k in line for k in keep))


@pytest.mark.parametrize("card", [12, 8])
def test_on_a_small_card_comfyui_offloads_the_text_encoder_and_scalekv_fits(real_size_base, tmp_path, card):
    """The card enforced (PyTorch capped at its size) and told (--reserve-vram): ComfyUI's manager
    unloads the text encoder for the sampler (the Text Encode node loaded it), and the ScaleKV workflow
    runs within the card, twice (the second run reuses the first's graphs)."""
    server = ensure_comfyui(Path(os.environ.get("SPARSEVAR_COMFY_DIR", "/tmp/sparsevar-comfyui")))
    with running_server(server, real_size_base, args=("--disable-cuda-malloc", "--reserve-vram", _reserve(card)),
                        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                        pythonpath=[_card(tmp_path, card)]) as url:
        first = _run_workflows(url, ["infinity_scalekv.json"], tmp_path)["infinity_scalekv.json"]
        second = _run_workflows(url, ["infinity_scalekv.json"], tmp_path)["infinity_scalekv.json"]
    log = (real_size_base / "server.log").read_text()
    print(f"\n{card} GB card, ComfyUI's memory manager:\n{_memory_lines(log)}")
    for status, texts, rep in (first, second):
        assert status == "success", (rep["messages"][-2:] if rep.get("messages") else rep)
    (allocated, reserved), = [tuple(map(float, m.groups())) for t in second[1] for m in [PEAK.search(t)] if m]
    print(f"{card} GB card, infinity_scalekv.json (second run): peak {allocated} GB allocated, {reserved} GB reserved")
    assert reserved <= card
    assert "loaded partially" not in log                   # these models load whole, or not at all
    assert all("kernels triton" in t for t in second[1] if PEAK.search(t))   # "auto" under the native allocator


def test_offered_a_partial_load_the_models_load_whole_under_cuda_malloc_async(real_size_base, tmp_path):
    """ComfyUI's --novram offers every model a partial load (as it does on a card too small for the
    model): it loads whole, with the one line, and the workflows run, on a 12 GB card as ComfyUI's
    manager sees it and ComfyUI's default allocator."""
    server = ensure_comfyui(Path(os.environ.get("SPARSEVAR_COMFY_DIR", "/tmp/sparsevar-comfyui")))
    with running_server(server, real_size_base, args=("--novram", "--reserve-vram", _reserve(12))) as url:
        runs = _run_workflows(url, ["infinity_scalekv.json", "infinity_dense.json"], tmp_path)
    log = (real_size_base / "server.log").read_text()
    assert "cudaMallocAsync" in log                         # ComfyUI's default allocator
    assert re.search(r"SparseVAR: ComfyUI has \d+ MB for this model's \d+ MB \(low-VRAM mode\); it loads whole", log)
    assert "loaded partially" not in log
    for name, (status, texts, rep) in runs.items():
        assert status == "success", (name, rep, log[-3000:])
        peaks = [m.groups() for t in texts for m in [PEAK.search(t)] if m]
        assert len(peaks) == 1
        assert all("kernels torch" in t for t in texts if PEAK.search(t))      # "auto" under cudaMallocAsync
        print(f"\n12 GB (ComfyUI's view, --novram), {name}: peak {peaks[0][0]} GB allocated, {peaks[0][1]} GB reserved")
