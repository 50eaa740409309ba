"""Model CPU offload (issue #32, pipelines/offload.py): each component is on the GPU only while it
runs, the pictures equal those of a pipeline kept on the GPU, and the transformer's CUDA graphs
survive from call to call. The GPU tests run on the GPU machine; the refusal runs everywhere."""
from __future__ import annotations

import pytest
import torch

from sparsevar import InfinityPipeline, VARPipeline


def test_offload_without_a_gpu_is_refused_in_one_line():
    pipe = VARPipeline.from_random("var-tiny")
    with pytest.raises(ValueError, match="enable_model_cpu_offload needs a CUDA GPU .*device='cpu'"):
        pipe.enable_model_cpu_offload(device="cpu")
    assert not pipe.model_cpu_offload


def _devices(pipe) -> dict:
    return {name: next(m.parameters()).device.type for name, m in pipe.components.items()
            if isinstance(m, torch.nn.Module)}


@pytest.mark.gpu
def test_infinity_components_visit_the_gpu_one_at_a_time_and_the_pictures_do_not_change():
    pipe = InfinityPipeline.from_random("infinity-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def call():
        return pipe(["w3 w4 w5", "w9"], height=256, width=256, generator=torch.Generator("cuda").manual_seed(0),
                    output_type="pt", callback_on_step_end=lambda p, si, t, d: seen.append(_devices(p)) or d).images

    resident = call()
    pipe.enable_model_cpu_offload()
    assert _devices(pipe) == {"transformer": "cpu", "vae": "cpu", "text_encoder": "cpu"}
    first = call()                       # the weights come back at new addresses: graphs captured again
    call()
    ws = pipe.adapter()._workspace
    graphs, ptrs = dict(ws.graphs), ws.kv.storage_ptrs()
    assert graphs
    seen.clear()
    second = call()
    # during the scale loop only the transformer is on the GPU; after the call nothing is
    assert seen and all(d == {"transformer": "cuda", "vae": "cpu", "text_encoder": "cpu"} for d in seen)
    assert _devices(pipe) == {"transformer": "cpu", "vae": "cpu", "text_encoder": "cpu"}
    assert torch.equal(first, resident) and torch.equal(second, resident)
    assert ws.graphs == graphs and ws.kv.storage_ptrs() == ptrs          # replayed, not captured again
    with pytest.raises(ValueError, match="while model CPU offload is on"):
        pipe.to("cuda")
    pipe.disable_model_cpu_offload().to("cuda")
    assert torch.equal(call(), resident)


@pytest.mark.gpu
def test_var_offload_keeps_the_tokenizer_for_the_loop_and_frees_the_gpu_after_the_call():
    """VAR's loop needs the VQVAE's quantizer (each scale's codes are accumulated through it), so
    both are on the GPU for the loop and the VQVAE alone for the decode; between calls the GPU holds
    the workspace only, and the peak is no higher than resident."""
    pipe = VARPipeline.from_random("var-d16", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def peak_call():
        pipe.release_memory()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        images = pipe([1, 2], generator=torch.Generator("cuda").manual_seed(0), output_type="pt",
                      callback_on_step_end=lambda p, si, t, d: seen.append(_devices(p)) or d).images
        return images, torch.cuda.max_memory_allocated()

    nbytes = {k: sum(t.nbytes for t in (*m.parameters(), *m.buffers())) for k, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    resident, resident_peak = peak_call()
    pipe.enable_model_cpu_offload()
    seen.clear()
    out, offload_peak = peak_call()
    assert torch.equal(out, resident) and offload_peak <= resident_peak
    assert seen and all(d == {"transformer": "cuda", "vqvae": "cuda"} for d in seen)
    assert _devices(pipe) == {"transformer": "cpu", "vqvae": "cpu"}
    pipe.release_memory()
    assert torch.cuda.memory_allocated() < min(nbytes.values())
