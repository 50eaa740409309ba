"""Acceleration policies on Infinity (tiny random model, CPU): every policy at its neutral setting
reproduces dense generation bit for bit; active settings run on the bitwise head, the
cross-attention sub-layer and the block groups, and compute fewer tokens."""
from __future__ import annotations

import pytest
import torch

from sparsevar import InfinityPipeline, ScaleSkipConfig


@pytest.fixture(scope="module")
def modules():
    p = InfinityPipeline.from_random("infinity-tiny", seed=1)
    return p.transformer, p.vae, p.text_encoder, p.tokenizer


@pytest.fixture
def pipe(modules) -> InfinityPipeline:
    p = InfinityPipeline(*modules)
    p.set_progress_bar_config(disable=True)
    return p


def _run(pipe, **kw):
    codes = []
    out = pipe(["w3 w4 w5", "w9"], height=256, width=256, guidance_scale=3.0, top_k=1,
               generator=torch.Generator().manual_seed(0), output_type="pt",
               callback_on_step_end=lambda p, si, t, d: codes.append(d["codes"]) or d, **kw)
    return out, codes


@pytest.mark.parametrize("enable", [
    lambda p: p.enable_sparsevar(tau=0.0, block=1),
    lambda p: p.enable_sparsevar(tau=0.0, granularity="group", block=1),
    lambda p: p.enable_sparsevar(keep_ratio=1.0, start_scale=1, granularity="layer", block=2),
    lambda p: p.enable_fastvar(ratios=(0.0, 0.0, 0.0), layer_range=None),
    lambda p: p.enable_scale_skip(ScaleSkipConfig()),
    lambda p: p.enable_scale_skip(skip_last=0).enable_sparsevar(tau=0.0, block=1),
], ids=["sparsevar-tau0", "sparsevar-group-tau0", "sparsevar-keep1", "fastvar-0", "scale-skip-0", "skip+sparsevar"])
def test_neutral_settings_are_bit_exact(pipe, enable):
    dense, dense_codes = _run(pipe)
    enable(pipe)
    out, codes = _run(pipe)
    assert all(torch.equal(a, b) for a, b in zip(codes, dense_codes))
    assert torch.equal(out.images, dense.images)


@pytest.mark.parametrize("enable", [
    lambda p: p.enable_sparsevar(keep_ratio=0.4, start_scale=-2, granularity="group", block=1),
    lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-2, granularity="layer", block=2),
    lambda p: p.enable_fastvar(ratios=(0.5, 0.5), layer_range=(1, 2)),
], ids=["sparsevar-group", "sparsevar-keep", "fastvar"])
def test_active_policies_compute_fewer_tokens(pipe, enable):
    dense, _ = _run(pipe)
    enable(pipe)
    out, codes = _run(pipe)
    assert out.images.shape == dense.images.shape and torch.isfinite(out.images).all()
    assert out.stats[0].tokens_computed < dense.stats[0].tokens_computed


def test_skip_and_cond_only(pipe):
    dense, _ = _run(pipe)
    pipe.enable_scale_skip(skip_last=2)
    out, codes = _run(pipe)
    assert len(codes) == 5 and sum(s.skipped for s in out.stats[0].scales) == 2
    assert out.images.shape == dense.images.shape
    pipe.disable_scale_skip().enable_scale_skip(cond_only_from=0)
    cond_only, codes = _run(pipe)
    ref_codes = []
    InfinityPipeline(pipe.transformer, pipe.vae, pipe.text_encoder, pipe.tokenizer)(
        ["w3 w4 w5", "w9"], height=256, width=256, guidance_scale=1.0, top_k=1, generator=torch.Generator().manual_seed(0),
        output_type="latent", callback_on_step_end=lambda p, si, t, d: ref_codes.append(d["codes"]) or d)
    assert all(torch.equal(a, b) for a, b in zip(codes, ref_codes))      # cond-only from the start = guidance off
