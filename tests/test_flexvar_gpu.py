"""FlexVAR on the GPU (``pytest -m gpu``): CUDA graphs replay the eager codes, and the largest release
size (d24, random weights) runs every policy at 256 px and 512 px zero-shot in bf16."""
from __future__ import annotations

import pytest
import torch

from sparsevar import FlexVARPipeline

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)")]


def _codes(pipe, graphs, **kw):
    got = []
    out = pipe([1, 7], generator=torch.Generator("cuda").manual_seed(3), use_cuda_graphs=graphs, output_type="pt",
               callback_on_step_end=lambda p, si, t, d: got.append(d["codes"].clone()), **kw)
    return got, out.images


@pytest.mark.parametrize("setup", [
    lambda p: p,
    lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-3, block=1),
    lambda p: p.enable_fastvar(ratios=(0.5, 0.75)),
    lambda p: p.enable_scale_skip(skip_last=1),
], ids=["dense", "sparsevar-keep", "fastvar", "skip"])
def test_graphs_replay_eager_codes_exactly(setup):
    """Scales replay their compute from graphs: codes and pictures equal the eager run's bit for bit at
    the capturing call and a replaying one; another schedule gets its own graphs and equals eager too."""
    pipe = FlexVARPipeline.from_random("flexvar-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    setup(pipe)
    eager, img_e = _codes(pipe, False)
    captured, img_c = _codes(pipe, True)
    ws = pipe.adapter()._workspace
    n_graphs = len(ws.graphs)
    assert n_graphs > 0
    again, img_a = _codes(pipe, True)
    assert len(ws.graphs) == n_graphs
    for a, b, c in zip(eager, captured, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(img_e, img_c) and torch.equal(img_e, img_a)
    e13, _ = _codes(pipe, False, num_scales=13)
    g13, _ = _codes(pipe, True, num_scales=13)
    assert len(g13) == len(e13) >= 12 and all(torch.equal(a, b) for a, b in zip(e13, g13))


def test_pictures_follow_the_skipped_scales_from_call_to_call_with_graphs():
    """The decode reads the last computed scale's codes, which move with the skipped scales: with
    graphs, calls that alternate between no skip and skipping the last scale each give the eager
    picture of their own setting (the decode is not replayed from one call's buffer)."""
    pipe = FlexVARPipeline.from_random("flexvar-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)

    def setting(skip):
        pipe.disable_scale_skip()
        if skip:
            pipe.enable_scale_skip(skip_last=skip)

    want = {}
    for skip in (0, 1):
        setting(skip)
        want[skip] = _codes(pipe, False)[1]
    assert not torch.equal(want[0], want[1])
    for skip in (0, 1, 0, 1):
        setting(skip)
        torch.testing.assert_close(_codes(pipe, True)[1], want[skip], atol=0, rtol=0)


@pytest.mark.parametrize("height", [256, 512])
@pytest.mark.parametrize("setup", ["dense", "sparsevar", "fastvar", "sparvar", "skip"])
def test_flexvar_d24_real_size_random_weights(setup, height):
    pipe = FlexVARPipeline.from_random("flexvar-d24", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.set_kernels("triton")
    {"dense": lambda: None, "sparsevar": lambda: pipe.enable_sparsevar(keep_ratio=0.5, start_scale=-3),
     "fastvar": pipe.enable_fastvar, "sparvar": pipe.enable_sparvar,
     "skip": lambda: pipe.enable_scale_skip(skip_last=1)}[setup]()
    out = pipe([207, 88], height=height, width=height, generator=torch.Generator("cuda").manual_seed(0),
               output_type="pt")
    assert out.images.shape == (2, 3, height, height) and torch.isfinite(out.images).all()
    assert len(out.stats[0].scales) == (10 if height == 256 else 15)
    pipe.release_memory()
