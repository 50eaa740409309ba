"""Acceleration policies on FlexVAR (issue #31; the fixture model, CPU, greedy): each neutral setting
reproduces dense generation bit for bit; active settings run, change the picture and compute fewer
tokens (or read fewer keys)."""
from __future__ import annotations

import pytest
import torch

from sparsevar.engine.contract import PolicyStack
from sparsevar.engine.sampler import generate
from sparsevar.engine.schedule import ScaleSchedule
from sparsevar.engine.state import SamplingSettings
from sparsevar.models.flexvar import FlexVARAdapter, FlexVARConditioning
from sparsevar.policies import FastVARConfig, ScaleSkipConfig, SparseVARConfig, SparVARConfig
from sparsevar.policies.fastvar import FastVARPolicy
from sparsevar.policies.scale_skip import ScaleSkipPolicy
from sparsevar.policies.sparsevar import SparseVARPolicy
from sparsevar.policies.scalekv import ScaleKVConfig, ScaleKVPolicy
from sparsevar.policies.sparvar import SparVARPolicy


@pytest.fixture(scope="module")
def adapter(flexvar_official_files):
    from sparsevar.models.loading import load_flexvar_transformer, load_flexvar_vq
    return FlexVARAdapter(load_flexvar_transformer(flexvar_official_files / "FlexVARd2.pth"),
                          load_flexvar_vq(flexvar_official_files / "FlexVAE.pth"))


def _run(adapter, *policies):
    pn = tuple(adapter.transformer.config.patch_nums)
    codes = []
    out = generate(adapter, FlexVARConditioning(torch.tensor([1, 8]), pn), 2,
                   settings=SamplingSettings(guidance_scale=4.0, top_k=1, top_p=0.0),
                   generator=torch.Generator().manual_seed(0), policies=PolicyStack(policies),
                   schedule=ScaleSchedule.square(pn), callback=lambda si, d: codes.append(d["codes"]))
    return out, codes


@pytest.fixture(scope="module")
def dense(adapter):
    return _run(adapter)


@pytest.mark.parametrize("policy", [
    SparseVARPolicy(SparseVARConfig(tau=0.0, block=1)),
    FastVARPolicy(FastVARConfig(ratios=(0.0, 0.0))),
    ScaleSkipPolicy(ScaleSkipConfig()),
    SparVARPolicy(SparVARConfig.dense()),
    ScaleKVPolicy(ScaleKVConfig.dense()),
], ids=["sparsevar", "fastvar", "scale_skip", "sparvar", "scalekv"])
def test_neutral_settings_reproduce_dense(adapter, dense, policy):
    out, codes = _run(adapter, policy)
    want, want_codes = dense
    assert len(codes) == len(want_codes) == adapter.schedule.num_scales
    assert all(torch.equal(a, b) for a, b in zip(codes, want_codes))
    tol = 1e-5 if isinstance(policy, SparVARPolicy) else 0.0
    torch.testing.assert_close(out.images, want.images, rtol=0, atol=tol)


@pytest.mark.parametrize("policy", [
    SparseVARPolicy(SparseVARConfig(keep_ratio=0.3, block=1)),
    FastVARPolicy(FastVARConfig(ratios=(0.5, 0.75))),
    SparVARPolicy(SparVARConfig(top_keys=0.2, windows=(3, 1), sink_scales=2, query_group=16)),
    ScaleSkipPolicy(ScaleSkipConfig(skip_last=1)),
    ScaleKVPolicy(ScaleKVConfig(budget=0.3, min_tokens=0, window=4)),
], ids=["sparsevar", "fastvar", "sparvar", "skip", "scalekv"])
def test_active_settings_act(adapter, dense, policy):
    out, codes = _run(adapter, policy)
    want, _ = dense
    assert torch.isfinite(out.images).all() and out.images.shape == want.images.shape
    assert (out.images - want.images).abs().max() > 1e-4
    stats = out.stats.scales
    if isinstance(policy, (SparVARPolicy, ScaleKVPolicy)):
        assert all(s.keys_read is not None for s in stats[-3:])
        assert stats[-1].keys_read < sum(s.tokens for s in stats)                  # fewer than every key
    else:
        assert sum(s.tokens_computed for s in stats) < sum(s.tokens_computed for s in want.stats.scales)


def test_sparsevar_excluded_tokens_keep_the_interpolated_previous_prediction(adapter):
    """FlexVAR predicts whole maps: a token SparseVAR excludes keeps the previous scale's vectors
    upsampled bicubically (the paper's appendix A), not a zero vector; the tokens it computes hold
    their own code vectors."""
    import torch.nn.functional as F
    from sparsevar.policies.sparsevar import TOKEN_EXCLUDED
    pn = tuple(adapter.transformer.config.patch_nums)
    latents, codes = [], []
    out = generate(adapter, FlexVARConditioning(torch.tensor([1, 8]), pn), 2,
                   settings=SamplingSettings(guidance_scale=4.0, top_k=1, top_p=0.0),
                   generator=torch.Generator().manual_seed(0),
                   policies=PolicyStack([SparseVARPolicy(SparseVARConfig(keep_ratio=0.3, block=1))]),
                   schedule=ScaleSchedule.square(pn),
                   callback=lambda si, d: (latents.append(d["latent"].clone()), codes.append(d["codes"])))
    book = adapter.vqvae.codebook()
    checked = 0
    for si, roles in out.stats.token_maps.items():
        excluded_BL = (roles == TOKEN_EXCLUDED).flatten(1)
        assert excluded_BL.any(), si
        prev = F.interpolate(latents[si - 1], size=(pn[si], pn[si]), mode="bicubic").flatten(2).transpose(1, 2)
        got = latents[si].flatten(2).transpose(1, 2)                                    # (B, c, h, w) → (B, hw, c)
        torch.testing.assert_close(got[excluded_BL], prev[excluded_BL], rtol=0, atol=1e-6)
        own = F.embedding(codes[si], book)
        torch.testing.assert_close(got[~excluded_BL], own[~excluded_BL], rtol=0, atol=1e-6)
        assert (got[excluded_BL].norm(dim=-1) > 0.1).all()                       # not a hole in the map
        checked += 1
    assert checked >= 2
