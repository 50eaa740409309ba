"""Acceleration policies on Infinity (tiny random model, CPU): every policy at its neutral setting
reproduces dense generation bit for bit; active settings run on the bitwise head, the
cross-attention sub-layer and the block groups, and compute fewer tokens."""
from __future__ import annotations

import math

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


SCALES = (1, 2, 4, 6, 8, 12, 16)      # 256x256 (1:1, "0.06M"): square maps of these sides, 521 tokens


def _assert_same_codes(got, want, scales):
    """The per-scale codes of two runs are equal scale for scale, and each run produced ``scales`` of them
    (never vacuous: an empty or short list fails)."""
    assert len(got) == len(want) == scales > 0, (len(got), len(want), scales)
    for si, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"codes differ at scale {si}"


PROMPTS = ("w3 w4 w5", "w9")


def _run(pipe, prompts=PROMPTS, generator=None, height=256, width=256, **kw):
    codes = []
    out = pipe(list(prompts), height=height, width=width, guidance_scale=3.0, top_k=1,
               generator=generator or torch.Generator().manual_seed(0), output_type="pt",
               callback_on_step_end=lambda p, si, t, d: codes.append(d["codes"].clone()) or d, **kw)
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
    _assert_same_codes(codes, dense_codes, len(SCALES))
    assert torch.equal(out.images, dense.images)


# The last two scales' tokens computed per image, from each method's rule (the scales before run whole):
# SparseVAR keep_ratio r keeps ceil(r·n) tokens of an n-token map, anchors included (12x12 has 16 anchors
# at stride 4, 16x16 has 25: fewer than the budget), on every layer; FastVAR prunes ratio r of the map
# (n - floor(r·n) tokens stay) on its layer range only, and the count is the mean over the model's 4 layers.
@pytest.mark.parametrize("enable, last_two", [
    (lambda p: p.enable_sparsevar(keep_ratio=0.4, start_scale=-2, granularity="group", block=1),
     [math.ceil(0.4 * 144), math.ceil(0.4 * 256)]),                                      # 58, 103
    (lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-2, granularity="layer", block=2),
     [72, 128]),
    (lambda p: p.enable_fastvar(ratios=(0.5, 0.5), layer_range=(1, 2)),
     [(2 * 144 + 2 * (144 - 72)) / 4, (2 * 256 + 2 * (256 - 128)) / 4]),                # 108, 192
], ids=["sparsevar-group", "sparsevar-keep", "fastvar"])
def test_active_policies_compute_the_tokens_their_rule_says(pipe, enable, last_two):
    dense, _ = _run(pipe)
    enable(pipe)
    out, codes = _run(pipe)
    assert out.images.shape == dense.images.shape and torch.isfinite(out.images).all()
    assert [s.tokens_computed for s in dense.stats[0].scales] == [n * n for n in SCALES]
    assert [s.tokens_computed for s in out.stats[0].scales] == [n * n for n in SCALES[:-2]] + last_two
    assert len(codes) == len(SCALES)


def test_skip_and_cond_only(pipe):
    dense, _ = _run(pipe)
    pipe.enable_scale_skip(skip_last=2)
    out, codes = _run(pipe)
    assert len(codes) == 5 and [s.skipped for s in out.stats[0].scales] == [False] * 5 + [True] * 2
    assert out.images.shape == dense.images.shape
    pipe.disable_scale_skip().enable_scale_skip(cond_only_from=0)
    cond_only, codes = _run(pipe)
    assert [s.rows for s in cond_only.stats[0].scales] == [1] * len(SCALES)
    ref_codes = []
    InfinityPipeline(pipe.transformer, pipe.vae, pipe.text_encoder, pipe.tokenizer)(
        ["w3 w4 w5", "w9"], height=256, width=256, guidance_scale=1.0, top_k=1, generator=torch.Generator().manual_seed(0),
        output_type="latent", callback_on_step_end=lambda p, si, t, d: ref_codes.append(d["codes"]) or d)
    _assert_same_codes(codes, ref_codes, len(SCALES))                # cond-only from the start = guidance off


def test_sparvar_on_infinity_neutral_matches_dense_and_the_preset_reads_fewer_keys(pipe):
    """SparVAR through Infinity's RoPE self-attention (the text goes through cross-attention and is
    not touched): ``SparVARConfig.dense()`` draws dense's greedy codes; the preset changes them
    and reads fewer keys at the last three scales."""
    from sparsevar import SparVARConfig
    dense, dense_codes = _run(pipe)
    pipe.enable_sparvar(SparVARConfig.dense())
    out, codes = _run(pipe)
    _assert_same_codes(codes, dense_codes, len(SCALES))
    torch.testing.assert_close(out.images, dense.images, rtol=0, atol=1e-4)
    pipe.disable_sparvar()
    pipe.enable_sparvar(windows=(3, 1), sink_scales=2, top_keys=0.1)
    out, codes = _run(pipe)
    assert any(not torch.equal(a, b) for a, b in zip(codes, dense_codes))
    stats = out.stats[0].scales
    prefix = [sum(s * s for s in SCALES[:k + 1]) for k in range(len(SCALES))]
    assert [s.keys_read is None for s in stats] == [True] * (len(SCALES) - 3) + [False] * 3
    assert all(s.keys_read < p for s, p in zip(stats[-2:], prefix[-2:]))
    assert pipe.flop_speedup(out.stats[0], height=256, width=256) > 1.0


def test_sparvar_preset_batch_reproduces_its_images_generated_one_by_one(pipe):
    """Per-image index lists on Infinity with the family preset: each image of the batch has the
    codes of its solo run (same prompt, same generator) and its pixels up to the VAE's batched
    float rounding (measured ≤ 2.3e-5: atol 5e-5). The preset changes each image's codes (at the
    last two scales), so the comparison is not of dense runs."""
    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    dense, dense_codes = _run(pipe, generator=gens([0, 1]))
    pipe.enable_sparvar()
    both, codes = _run(pipe, generator=gens([0, 1]))
    assert len(codes) == len(dense_codes) == len(SCALES)
    for i, prompt in enumerate(PROMPTS):
        assert any(not torch.equal(a[i], b[i]) for a, b in zip(codes, dense_codes)), i          # not a no-op
        one, one_codes = _run(pipe, [prompt], generator=gens([i]))
        _assert_same_codes([c[i:i + 1] for c in codes], one_codes, len(SCALES))
        torch.testing.assert_close(both.images[i:i + 1], one.images, rtol=0, atol=5e-5,
                                   msg=lambda m: f"image {i}: {m}")


@pytest.mark.parametrize("height, width", [(176, 352), (352, 176)], ids=["1:2", "2:1"])
def test_sparvar_on_a_non_square_schedule_neutral_is_dense_and_the_preset_acts(pipe, height, width):
    """The 0.06M size of the 1:2 and 2:1 templates (maps 1×1, 2×2, 2×4, 3×6, 5×10, 8×16, 11×22 or
    their transposes): ``SparVARConfig.dense()`` draws dense's codes, so the decoded pictures are
    equal bit for bit; the preset (decision scale -3, the 5×10 map; scales before it attend densely)
    changes the codes from there on and the picture."""
    from sparsevar import SparVARConfig
    dense, dense_codes = _run(pipe, height=height, width=width)
    assert dense.images.shape == (2, 3, height, width)
    tall = height > width
    assert [c.shape[1] for c in dense_codes] == [1, 4, 8, 18, 50, 128, 242]             # tokens per scale
    assert [(s.h, s.w) for s in dense.stats[0].scales][-1] == ((22, 11) if tall else (11, 22))
    pipe.enable_sparvar(SparVARConfig.dense())
    out, codes = _run(pipe, height=height, width=width)
    _assert_same_codes(codes, dense_codes, 7)
    assert torch.equal(out.images, dense.images)
    pipe.disable_sparvar()
    pipe.enable_sparvar()
    out, codes = _run(pipe, height=height, width=width)
    _assert_same_codes(codes[:4], dense_codes[:4], 4)                                  # dense before the decision
    assert any(not torch.equal(a, b) for a, b in zip(codes[4:], dense_codes[4:]))
    assert (out.images - dense.images).abs().amax() > 0.1


def test_scalekv_on_infinity_neutral_is_dense_and_a_budget_keeps_the_last_scale_in_the_tail(pipe):
    """ScaleKV through Infinity's RoPE self-attention: ``ScaleKVConfig.dense()`` is dense bit for bit;
    a budget changes the codes, reads fewer keys, and allocates each refiner layer for its kept keys
    only, the last scale going to the tail the layers share (a compressed cache always takes it)."""
    from sparsevar import ScaleKVConfig
    from sparsevar.policies import Policy

    class KVSeen(Policy):                           # the cache after the last scale (freed before the decode)
        name = "kv_seen"

        def after_scale(self, si, guided_logits_BLV, run):
            kv = run.workspace.kv
            self.seen = (list(kv.lengths), kv.capacities, kv.transient)

    seen = KVSeen()
    pipe.add_policy(seen)
    dense, dense_codes = _run(pipe)
    assert seen.seen[2] == 0                                       # a small cache: no tail
    pipe.enable_scalekv(ScaleKVConfig.dense())
    out, codes = _run(pipe)
    _assert_same_codes(codes, dense_codes, len(SCALES))
    assert torch.equal(out.images, dense.images)
    pipe.disable_scalekv().enable_scalekv(budget=0.2, drafters=(0,), min_tokens=100)
    out, codes = _run(pipe)
    assert any(not torch.equal(a, b) for a, b in zip(codes, dense_codes))
    prefix = [sum(s * s for s in SCALES[:k + 1]) for k in range(len(SCALES))]          # 1, 5, …, 265, 521
    # after 8x8 (121 cached > 100) and 12x12 the refiners keep a fifth of what was generated
    keep = [int(0.2 * prefix[4] + 0.5), int(0.2 * prefix[5] + 0.5)]                    # 24, 53
    lengths, capacities, transient = seen.seen
    # own buffers: the drafter all but the last scale; the refiners the 57 tokens before their first
    # compression (the compressed scales and the last pass through the shared tail, sized for the
    # drafter's last scale)
    assert capacities == (prefix[-2],) + (prefix[3],) * 3 and transient == SCALES[-1] ** 2
    assert lengths == [prefix[-1]] + [keep[1] + SCALES[-1] ** 2] * 3
    reads = [s.keys_read for s in out.stats[0].scales]
    assert reads[-1] == pytest.approx((prefix[-1] + 3 * (keep[1] + SCALES[-1] ** 2)) / 4)
