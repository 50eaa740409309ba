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
    seen.clear()
    first = call()
    ws = pipe.adapter()._workspace
    graphs, ptrs = dict(ws.graphs), ws.kv.storage_ptrs()
    assert graphs
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
def test_var_offload_saves_the_smaller_component_at_the_peak():
    """Resident, the peak holds both components and the workspace; offloaded, the transformer has
    left before the decoder arrives, so the peak is lower by at least the smaller of the two."""
    pipe = VARPipeline.from_random("var-d16", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)

    def peak_call():
        pipe.release_memory()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        images = pipe([1, 2], generator=torch.Generator("cuda").manual_seed(0), output_type="pt").images
        return images, torch.cuda.max_memory_allocated()

    nbytes = {k: sum(t.nbytes for t in (*m.parameters(), *m.buffers())) for k, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    resident, resident_peak = peak_call()
    pipe.enable_model_cpu_offload()
    out, offload_peak = peak_call()
    assert torch.equal(out, resident)
    assert offload_peak <= resident_peak - 0.9 * min(nbytes.values()), (offload_peak, resident_peak, nbytes)
    after = torch.cuda.memory_allocated()
    pipe.release_memory()
    assert after - torch.cuda.memory_allocated() >= 0 and torch.cuda.memory_allocated() < min(nbytes.values())
