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


def _run(adapter, *policies, guidance_scale=4.0):
    pn = tuple(adapter.transformer.config.patch_nums)
    codes = []
    out = generate(adapter, FlexVARConditioning(torch.tensor([1, 8]), pn), 2,
                   settings=SamplingSettings(guidance_scale=guidance_scale, top_k=1, top_p=0.0),
                   generator=torch.Generator().manual_seed(0), policies=PolicyStack(policies),
                   schedule=ScaleSchedule.square(pn), callback=lambda si, d: codes.append(d["codes"]))
    return out, codes


@pytest.fixture(scope="module")
def dense(adapter):
    return _run(adapter)


@pytest.mark.parametrize("policy", [
    SparseVARPolicy(SparseVARConfig(tau=0.0, block=1)),
    SparseVARPolicy(SparseVARConfig(keep_ratio=1.0, block=1)),
    FastVARPolicy(FastVARConfig(ratios=(0.0, 0.0))),
    ScaleSkipPolicy(ScaleSkipConfig()),
    SparVARPolicy(SparVARConfig.dense()),
    ScaleKVPolicy(ScaleKVConfig.dense()),
], ids=["sparsevar", "sparsevar-keep1", "fastvar", "scale_skip", "sparvar", "scalekv"])
def test_neutral_settings_reproduce_dense(adapter, dense, policy):
    """Codes and images bit for bit. keep_ratio 1.0 (tau left at its active default) runs the selection
    at every scale from ``start_scale`` and keeps every token: its role maps are recorded, none excluded."""
    out, codes = _run(adapter, policy)
    want, want_codes = dense
    assert len(codes) == len(want_codes) == adapter.schedule.num_scales
    assert all(torch.equal(a, b) for a, b in zip(codes, want_codes))
    assert torch.equal(out.images, want.images)
    if isinstance(policy, SparseVARPolicy) and policy.config.keep_ratio == 1.0:
        from sparsevar.policies.sparsevar import TOKEN_EXCLUDED
        S = adapter.schedule.num_scales
        assert sorted(out.stats.token_maps) == list(range(S - 3, S))          # start_scale -3: selected, all kept
        assert all(not (m == TOKEN_EXCLUDED).any() for m in out.stats.token_maps.values())
        assert [s.tokens_computed for s in out.stats.scales] == [s.tokens for s in want.stats.scales]


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


def test_sparsevar_tau_mode_excludes_tokens_and_counts_what_it_computes(adapter, dense):
    """The threshold rule (tau 0.9: a token is excluded when its change is at most 0.9 × the image's
    largest) from scale -3 on: the scales before run whole and draw dense's codes, the picture changes,
    and each pruned scale's computed-token count is the mean over the images of the tokens its role map
    marks computed (kept or anchor), fewer than the map's tokens."""
    from sparsevar.policies.sparsevar import TOKEN_KEPT
    out, codes = _run(adapter, SparseVARPolicy(SparseVARConfig(tau=0.9, start_scale=-3, block=1)))
    want, want_codes = dense
    S = adapter.schedule.num_scales
    assert all(torch.equal(a, b) for a, b in zip(codes[:S - 3], want_codes[:S - 3]))
    assert (out.images - want.images).abs().max() > 1e-2
    stats = out.stats.scales
    assert [s.tokens_computed for s in stats[:S - 3]] == [s.tokens for s in stats[:S - 3]]
    assert sorted(out.stats.token_maps) == list(range(S - 3, S))
    for si, roles_Bhw in out.stats.token_maps.items():
        computed_B = (roles_Bhw >= TOKEN_KEPT).flatten(1).sum(1).float()
        assert stats[si].tokens_computed == computed_B.mean().item() < stats[si].tokens, si
    assert sum(s.tokens_computed for s in stats) < sum(s.tokens for s in stats)


def test_cond_only_drops_guidance_from_its_scale(adapter, dense):
    """cond_only_from -2 runs the last two scales on the conditional rows alone: the rows per scale
    say so, the scales before draw dense's codes, the picture changes. Where guidance does nothing
    (guidance scale 0: the VAR ramp's t is 0, guided = cond), cond-only from -3 reproduces dense at that
    guidance bit for bit (the unconditional half dropped from a filled KV cache)."""
    out, codes = _run(adapter, ScaleSkipPolicy(ScaleSkipConfig(cond_only_from=-2)))
    want, want_codes = dense
    S = adapter.schedule.num_scales
    assert [s.rows for s in out.stats.scales] == [2] * (S - 2) + [1] * 2
    assert all(torch.equal(a, b) for a, b in zip(codes[:S - 2], want_codes[:S - 2]))
    assert (out.images - want.images).abs().max() > 1e-2
    off, off_codes = _run(adapter, guidance_scale=0.0)
    out, codes = _run(adapter, ScaleSkipPolicy(ScaleSkipConfig(cond_only_from=-3)), guidance_scale=0.0)
    assert [s.rows for s in out.stats.scales] == [2] * (S - 3) + [1] * 3
    assert len(codes) == S and all(torch.equal(a, b) for a, b in zip(codes, off_codes))
    assert torch.equal(out.images, off.images)


def test_skip_last_decodes_the_upsampled_codes_of_the_last_computed_scale(adapter, dense):
    """skip_last 2: the last two scales do not run and the picture is the decoder's output for the codes
    drawn at the last computed scale — their L2-normalised codebook vectors, bicubic-upsampled to the
    schedule's last side, through ``post_quant_conv`` and the decoder, clamped and mapped to [0, 1] —
    built here from those pieces (within 1e-4: the adapter holds the vectors as input + change, 6e-8
    off, which the decoder amplifies to about 1e-5; a bilinear upsample is 0.33 off, the dense picture
    0.63). The returned latent is that scale's map, and decoding its upsample reproduces the image bit
    for bit."""
    import torch.nn.functional as F
    out, codes = _run(adapter, ScaleSkipPolicy(ScaleSkipConfig(skip_last=2)))
    _, want_codes = dense
    pn = [h for h, _ in adapter.schedule.hw]
    S = len(pn)
    assert [s.skipped for s in out.stats.scales] == [False] * (S - 2) + [True] * 2
    assert len(codes) == S - 2 and all(torch.equal(a, b) for a, b in zip(codes, want_codes))
    vq = adapter.vqvae
    book_VC = F.normalize(vq.quantize.embedding.weight, dim=1)
    side = pn[S - 3]
    q_BChw = book_VC[codes[-1]].transpose(1, 2).reshape(2, -1, side, side)        # (B, hw, C) → (B, C, h, w)
    torch.testing.assert_close(out.latent, q_BChw, rtol=0, atol=1e-6)

    def decode(z_BChw):
        up_BChw = F.interpolate(z_BChw, size=(pn[-1], pn[-1]), mode="bicubic", align_corners=False)
        with torch.no_grad():
            return (vq.decoder(vq.post_quant_conv(up_BChw)).clamp(-1, 1) + 1) / 2
    assert out.images.shape == (2, 3, 16 * pn[-1], 16 * pn[-1])
    torch.testing.assert_close(out.images, decode(q_BChw), rtol=0, atol=1e-4)
    assert torch.equal(out.images, decode(out.latent))
