"""Acceleration policies on HART (issue #29; the fixture model, CPU, greedy): every policy's neutral
setting reproduces dense generation bit for bit; active settings change the picture and compute
fewer tokens or read fewer keys, and every method still hands the diffusion head the full last map."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sparsevar.engine.contract import PolicyStack
from sparsevar.engine.sampler import generate
from sparsevar.engine.state import SamplingSettings
from sparsevar.models.hart import HARTAdapter, HARTConditioning, HARTTransformer
from sparsevar.policies import FastVARConfig, ScaleSkipConfig, SparseVARConfig, SparVARConfig
from sparsevar.policies.fastvar import FastVARPolicy
from sparsevar.policies.scale_skip import ScaleSkipPolicy
from sparsevar.policies.sparsevar import SparseVARPolicy
from sparsevar.policies.scalekv import ScaleKVConfig, ScaleKVPolicy
from sparsevar.policies.sparvar import SPARVAR_PRESETS, SparVARPolicy


@pytest.fixture(scope="module")
def adapter(hart_official_files):
    from sparsevar.models.loading import load_hart_tokenizer, load_hart_transformer
    return HARTAdapter(load_hart_transformer(hart_official_files["llm"]),
                       load_hart_tokenizer(hart_official_files["tokenizer"]))


@pytest.fixture(scope="module")
def inputs(hart_fixture_dir):
    return load_file(hart_fixture_dir / "inputs.safetensors")


def _run(adapter, inputs, *policies, rows=None, seeds=None):
    """The fixture's prompts (or those of ``rows``), greedy; one generator (seed 0), or one per image
    (``seeds``: the diffusion head's noise then does not depend on the batch)."""
    codes = []
    rows = list(range(inputs["context"].shape[0])) if rows is None else rows
    cond = HARTConditioning(inputs["context"][rows], inputs["context_position_ids"][rows], inputs["context_mask"][rows])
    gen = torch.Generator().manual_seed(0) if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]
    out = generate(adapter, cond, len(rows), settings=SamplingSettings(guidance_scale=4.5, top_k=1, top_p=0.0),
                   generator=gen, policies=PolicyStack(policies), callback=lambda si, d: codes.append(d["codes"].clone()))
    return out, codes


@pytest.fixture(scope="module")
def dense(adapter, inputs):
    return _run(adapter, inputs)


@pytest.mark.parametrize("policy", [
    SparseVARPolicy(SparseVARConfig(tau=0.0, block=1)),
    FastVARPolicy(FastVARConfig(ratios=(0.0, 0.0))),
    ScaleSkipPolicy(ScaleSkipConfig()),
    SparVARPolicy(SparVARConfig.dense()),
    ScaleKVPolicy(ScaleKVConfig.dense()),
], ids=["sparsevar", "fastvar", "scale_skip", "sparvar", "scalekv"])
def test_neutral_settings_reproduce_dense(adapter, inputs, dense, policy):
    out, codes = _run(adapter, inputs, policy)
    (want, want_codes) = dense
    assert len(codes) == len(want_codes) == adapter.schedule.num_scales
    assert all(torch.equal(a, b) for a, b in zip(codes, want_codes))
    tol = 1e-5 if isinstance(policy, SparVARPolicy) else 0.0                 # SparVAR re-sums attention
    torch.testing.assert_close(out.images, want.images, rtol=0, atol=tol)


@pytest.mark.parametrize("policy", [
    SparseVARPolicy(SparseVARConfig(keep_ratio=0.3, block=1)),
    FastVARPolicy(FastVARConfig(ratios=(0.5, 0.75))),
    SparVARPolicy(SparVARConfig(decision_scale=-4, top_keys=0.2, windows=(3, 1), sink_scales=1, query_group=4)),
    ScaleKVPolicy(ScaleKVConfig(budget=0.3, min_tokens=0, window=4)),
], ids=["sparsevar", "fastvar", "sparvar", "scalekv"])
def test_active_settings_act_and_the_diffusion_head_gets_the_full_map(adapter, inputs, dense, policy):
    out, codes = _run(adapter, inputs, policy)
    want, want_codes = dense
    assert (out.images - want.images).abs().max() > 1e-4
    assert torch.isfinite(out.images).all() and out.images.shape == want.images.shape
    stats = out.stats.scales
    if isinstance(policy, (SparVARPolicy, ScaleKVPolicy)):
        assert all(s.keys_read is not None for s in stats[-3:])
        assert stats[-1].keys_read < sum(s.tokens for s in stats)                  # fewer than every key
    else:
        assert sum(s.tokens_computed for s in stats) < sum(s.tokens_computed for s in want.stats.scales)


def test_skipping_the_last_scale_leaves_out_the_continuous_residual(adapter, inputs, dense):
    out, codes = _run(adapter, inputs, ScaleSkipPolicy(ScaleSkipConfig(skip_last=1)))
    assert len(codes) == adapter.schedule.num_scales - 1 and out.stats.scales[-1].skipped
    assert torch.isfinite(out.images).all()


def test_flop_model_matches_the_compute_profile_of_the_research_notes():
    """hart.md §7 (depth 24, width 1536, 1024², FLOPs = 2·MACs, attention 4·n_q·n_kv·C): 24.6 TFLOP
    per image and CFG branch, 9.7 % of it the 8-step diffusion MLP, 56.5 % the last scale."""
    from types import SimpleNamespace as NS

    from accelerate import init_empty_weights

    from sparsevar.models.hart import HART_PRESETS, hart_loop_flops
    with init_empty_weights():
        cfg = HARTTransformer(**HART_PRESETS["hart-0.7b"]["transformer"]).config
    total = hart_loop_flops(cfg, cfg_rows=1)
    assert total / 1e12 == pytest.approx(24.6, abs=0.05)
    no_diffusion = hart_loop_flops(NS(**{**dict(cfg), "num_sampling_steps": 0}), cfg_rows=1)
    assert 1 - no_diffusion / total == pytest.approx(0.097, abs=0.001)
    sizes = [cfg.context_token] + [p * p for p in cfg.patch_nums[1:]]
    prefix = [sum(sizes[:k + 1]) for k in range(len(sizes))]
    last = hart_loop_flops(cfg, cfg_rows=1, tokens_per_scale=[0] * 13 + [sizes[-1]], kv_per_scale=prefix)
    assert last / total == pytest.approx(0.565, abs=0.002)


def test_sparvar_relative_lists_serve_hart_whose_first_scale_is_its_text(adapter, inputs):
    """HART's scale 0 is its text slots (a 1 × n "scale"): the relative map moves them into a sink
    scale, several onto one position. Every group reads the sinks whole, so that is harmless, and
    the index lists (not the slower mask path, which the map's collisions used to force) serve
    HART's sparse scales; both read the same keys."""
    seen = []

    class Lists(SparVARPolicy):
        def _relative_maps(self, G_from, si_from, si_to, run, device):
            out = super()._relative_maps(G_from, si_from, si_to, run, device)
            seen.append(out is not None)
            return out

    class MaskPath(SparVARPolicy):
        def _relative_maps(self, G_from, si_from, si_to, run, device):
            return None

    cfg = SparVARConfig(decision_scale=-3, top_keys=0.3, query_group=4, local_window=3, sink_scales=3)
    lists, _ = _run(adapter, inputs, Lists(cfg))
    masks, _ = _run(adapter, inputs, MaskPath(cfg))
    assert seen and all(seen)
    torch.testing.assert_close(lists.images, masks.images, rtol=0, atol=1e-6)


def test_sparvar_preset_batch_reproduces_its_images_generated_one_by_one(adapter, inputs):
    """Per-image index lists on HART with the family preset: each image of the batch of two has the
    codes of its solo run (same prompt, same generator) and its pixels up to the float rounding of
    the batched matmuls (measured ≤ 1.0e-6, dense batch against solo 7.7e-7: atol 5e-6). The
    preset changes every image (codes and pixels), so the comparison is not of dense runs."""
    seeds = [0, 1]
    dense, dense_codes = _run(adapter, inputs, rows=[0, 1], seeds=seeds)
    both, codes = _run(adapter, inputs, SparVARPolicy(SPARVAR_PRESETS["hart"]), rows=[0, 1], seeds=seeds)
    assert len(codes) == len(dense_codes) == adapter.schedule.num_scales
    for i, seed in enumerate(seeds):
        assert any(not torch.equal(a[i], b[i]) for a, b in zip(codes, dense_codes)), i          # not a no-op
        assert (both.images[i] - dense.images[i]).abs().amax() > 1e-2, i
        one, one_codes = _run(adapter, inputs, SparVARPolicy(SPARVAR_PRESETS["hart"]), rows=[i], seeds=[seed])
        assert len(one_codes) == len(codes)
        for si, (a, b) in enumerate(zip(codes, one_codes)):
            assert torch.equal(a[i:i + 1], b), f"image {i}: codes differ at scale {si}"
        torch.testing.assert_close(both.images[i:i + 1], one.images, rtol=0, atol=5e-6,
                                   msg=lambda m: f"image {i}: {m}")


def test_enable_sparvar_without_arguments_takes_harts_preset_decision_scale():
    """HART's preset (issue #30: decision scale 11 of the 14 scales, counted from 1) is the
    fourth-last scale: at 1024² (text slots, then 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64) the
    engine's run state resolves it to index 10, the 27×27 map, leaving 36, 48 and 64 sparse; on the
    tiny model's 6 scales to index 2, from which on (and not before) a generation reads fewer keys."""
    from sparsevar import HARTPipeline
    from sparsevar.engine.state import RunState

    big = HARTPipeline.from_random("hart-0.7b", device="meta", dtype="bfloat16")       # release size, no weights
    big.enable_sparvar()
    info = big.adapter().model_info()
    assert info.schedule.hw == ((1, 300),) + tuple((p, p) for p in (2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64))
    run = RunState(schedule=info.schedule, batch_size=1, settings=SamplingSettings(4.5, 1, 0.0), info=info,
                   generator=None, policies=big.policies, device=torch.device("cpu"), dtype=torch.float32)
    big.policies.begin(run)                                                              # what generate() calls
    assert run.policy_state["sparvar"]["decision"] == 10 and info.schedule.hw[10] == (27, 27)

    tiny = HARTPipeline.from_random("hart-tiny", seed=0)
    tiny.set_progress_bar_config(disable=True)
    assert tiny.adapter().schedule.num_scales == 6
    tiny.enable_sparvar()
    out = tiny("w1 w2", generator=torch.Generator().manual_seed(0), output_type="pt")
    assert [s.keys_read is None for s in out.stats[0].scales] == [True, True, False, False, False, False]
