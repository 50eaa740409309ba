"""ScaleKV (issue #32) on the VAR fixture model (CPU): the observation window and the key selection
against hand-worked and brute-force answers, the cache's compaction and per-layer capacities, the
neutral setting, what an active setting keeps and allocates, batches, composition with scale
skipping and cond-only, refusals and bad settings, the CLI flag and the quality-bench forms."""
from __future__ import annotations

import math

import pytest
import torch

from sparsevar.engine.kv_cache import COMPACTED, KVCache, layer_capacities
from sparsevar.engine.schedule import ScaleSchedule
from sparsevar.policies import ScaleKVConfig
from sparsevar.policies.scalekv import RELEASED_2B, ScaleKVPolicy, scalekv_preset, window_positions


@pytest.fixture
def pipe(var_pipe):
    return var_pipe


def _run(pipe, labels, **kw):
    """One generator per image (seeds 3, 4, …), so an image does not depend on its batch."""
    gens = [torch.Generator().manual_seed(3 + i) for i in range(len(labels))]
    return pipe(labels, generator=gens, output_type="pt", **kw)




# ---- worked by hand ----------------------------------------------------------------------------------
def test_window_is_the_centres_of_a_four_by_four_grid():
    # 20 × 20: cells of 5, centres at 2, 7, 12, 17 (the release's (5 - 1) // 2 offset)
    assert window_positions(20, 20, 16) == [r * 20 + c for r in (2, 7, 12, 17) for c in (2, 7, 12, 17)]
    # 3 × 8 (fewer rows than the grid): 3 rows of 1, 4 columns of 2 → offsets 0
    assert window_positions(3, 8, 16) == [r * 8 + c for r in (0, 1, 2) for c in (0, 2, 4, 6)]
    assert window_positions(6, 6, 4) == [1 * 6 + 1, 1 * 6 + 4, 4 * 6 + 1, 4 * 6 + 4]


def test_released_budgets_give_back_the_released_token_counts_at_1024():
    """Infinity-2B 1024²: the release keeps 632 / 594 / 526 / 420 / 465 tokens in refiner layers after
    the scales of 20², 24², 32², 40² and 48² tokens, 920 / 1490 / 2510 / 4100 / 6385 in drafters."""
    sides = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
    sch = ScaleSchedule.square(sides)
    policy = ScaleKVPolicy(ScaleKVConfig(budget=RELEASED_2B, drafters=(0, 23)))
    assert policy._keep(sch, len(sides)) == [None] * 7 + [632, 594, 526, 420, 465, None]
    from sparsevar.engine.state import ModelInfo
    slots = policy.kv_slots(ModelInfo(family="infinity", schedule=sch, num_layers=32), len(sides))
    assert slots[0] == slots[23] == sch.offsets[1:]                       # drafters keep everything
    assert slots[1][6:] == (521, 632, 594, 526, 420, 465, 465 + 4096)
    # each scale a refiner compresses after, and the last, pass through the shared tail: its own buffer
    # holds the most it keeps (632), a drafter's everything but the last scale; the tail the largest sum
    caps, tail = layer_capacities(slots, [s * s for s in sides])
    assert caps[1] == 632 and caps[0] == sch.offsets[-2] and tail == sch.offsets[-1]
    assert scalekv_preset("infinity-2b", 32).drafters == (0, 23)
    assert scalekv_preset("infinity-2b", 40).drafters == (0, 1, 2)        # the 40-layer model is the 8B
    assert scalekv_preset("infinity-2b", 4).drafters == (0,)              # another size: the first layer


def _pooled_scores(q, k, window, kernel):
    """The release's ranking, loop by loop: per row and head, the window's logits summed over its
    queries (the window's own keys left out), max-pooled over ``kernel`` neighbouring keys."""
    R, H, l, _ = q.shape
    L = k.shape[2]
    slots = [L - l + w for w in window]
    out = torch.empty(R, H, L, dtype=torch.float64)
    for r in range(R):
        for h in range(H):
            score = [sum(float(q[r, h, w] @ k[r, h, j]) for w in window) if j not in slots else -math.inf
                     for j in range(L)]
            out[r, h] = torch.tensor([max(score[max(0, j - kernel // 2):j + kernel // 2 + 1]) for j in range(L)])
    return out, slots


@pytest.mark.parametrize("kernel", [1, 3])
def test_selection_is_the_releases_rule(kernel):
    """The window's keys plus the ``keep − window`` other keys of the highest pooled score, in
    increasing order. Pooling copies a high score onto its neighbours, so with kernel 3 keys tie and
    any of the tied ones may be kept: every kept key must score at least as high as every dropped one."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 9, 4), torch.randn(2, 3, 30, 4)
    window = window_positions(3, 3, 4)
    got = ScaleKVPolicy(ScaleKVConfig(window=4, pool_kernel=kernel)).select(q, k, torch.tensor(window), keep=12)
    pooled, slots = _pooled_scores(q, k, window, kernel)
    assert got.shape == (2, 3, 12) and not torch.equal(got[0, 0], got[0, 1])        # heads choose their own
    for r in range(2):
        for h in range(3):
            kept = got[r, h].tolist()
            assert kept == sorted(kept) and set(slots) <= set(kept)
            others = [j for j in kept if j not in slots]
            dropped = [j for j in range(30) if j not in kept]
            assert len(others) == 8
            assert min(pooled[r, h, others]) >= max(pooled[r, h, dropped]) - 1e-5
            if kernel == 1:                                                  # no ties: exactly the best 8
                best = sorted(j for j in range(30) if j not in slots)
                best = sorted(sorted(best, key=lambda j: -pooled[r, h, j])[:8])
                assert others == best


def test_compaction_moves_each_heads_kept_slots_to_the_front():
    kv = KVCache(num_layers=2, rows=2, heads=2, head_dim=3, capacity=8, dtype=torch.float32, device="cpu")
    k = torch.arange(2 * 2 * 6 * 3, dtype=torch.float32).view(2, 2, 6, 3)
    kv.append(1, k, -k, pos=torch.arange(6))
    idx = torch.tensor([[[0, 2, 5], [1, 3, 4]], [[2, 3, 4], [0, 1, 5]]])
    kv.compact(1, idx)
    got_k, got_v = kv.view(1)
    assert kv.lengths == [0, 3] and got_k.shape == (2, 2, 3, 3)
    assert torch.equal(got_k, k.gather(2, idx[..., None].expand(-1, -1, -1, 3)))
    assert torch.equal(got_v, -got_k)
    assert kv.pos_NRT[1, :, :3].eq(COMPACTED).all() and kv.pos_NRT[1, :, 3:6].tolist() == [[3, 4, 5]] * 2
    after_k, _ = kv.append(1, torch.ones(2, 2, 1, 3), torch.ones(2, 2, 1, 3))          # appends after the kept
    assert after_k.shape[2] == 4 and after_k[:, :, 3].eq(1).all()
    # a capture's warm-up compacts and then puts back what it overwrote (engine/graphs.py)
    kv.reset()
    kv.append(1, k, -k, pos=torch.arange(6))
    kv.keep_undo()
    kv.compact(1, idx)
    kv.undo()
    kv.set_host_state(([0, 6], None))
    assert torch.equal(kv.view(1)[0], k) and torch.equal(kv.view(1)[1], -k)
    assert kv.pos_NRT[1, :, :6].tolist() == [list(range(6))] * 2
    kv.compact(1, idx)                                                                  # no longer kept
    assert kv._undo is None


def test_layers_of_different_capacities_get_their_own_buffers():
    # layer 0 keeps everything; layers 1 and 2 compress 5 → 3 after the second scale: 1 + 4 and 3 + 9
    # pass through the tail, their own buffers hold 3; layer 0's the 5 before the last scale
    kv = KVCache.for_schedule(3, 2, 1, 2, [1, 4, 9], torch.float32, "cpu",
                              slots=((1, 5, 14), (1, 3, 12), (1, 3, 12)))
    assert kv.capacities == (5, 3, 3) and kv.capacity == 5 and kv.transient == 14 - 5
    assert kv.k_NRHTd.shape[0] == 1 and len(kv.storage_ptrs()) == 9         # two groups and the tail
    short = KVCache.for_schedule(3, 2, 1, 2, [1, 4, 9], torch.float32, "cpu", slots=((1, 5), (1, 3), (1, 3)))
    assert short.capacities == (1, 1, 1) and short.transient == 4            # two scales run: 1 + 4
    dense = KVCache.for_schedule(3, 2, 1, 2, [1, 4, 9], torch.float32, "cpu")
    assert dense.capacities == (14,) * 3 and dense.transient == 0
    # a scale compressed in the tail: the layer's kept slots come back to its own buffer
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).view(2, 1, 5, 2)
    kv.append(1, k[:, :, :1], k[:, :, :1], pos=torch.arange(1))
    kv.append(1, k[:, :, 1:], k[:, :, 1:], pos=torch.arange(1, 5))            # 5 > 3: in the tail
    assert kv.tail_owner == 1
    kv.compact(1, torch.tensor([[[0, 2, 4]], [[1, 2, 3]]]))
    assert kv.tail_owner is None and kv.lengths[1] == 3
    assert kv.view(1)[0].flatten(1).tolist() == [[0, 1, 4, 5, 8, 9], [12, 13, 14, 15, 16, 17]]


# ---- the policy on the fixture model --------------------------------------------------------------------
def test_neutral_setting_is_dense_bit_for_bit(pipe):
    dense = _run(pipe, [1, 4])
    pipe.enable_scalekv(ScaleKVConfig.dense())
    out = _run(pipe, [1, 4])
    assert torch.equal(out.images, dense.images)
    assert all(s.keys_read is None for s in out.stats[0].scales)


def _tokens(pipe):
    return [h * w for h, w in pipe.adapter().schedule.hw]


def test_active_setting_keeps_its_budget_and_allocates_only_that(pipe):
    dense = _run(pipe, [1, 4])
    dense_bytes = pipe.adapter()._workspace.kv.nbytes()
    pipe.enable_scalekv(budget=0.3, drafters=(1,), min_tokens=0, window=4)
    out = _run(pipe, [1, 4])
    assert (out.images - dense.images).abs().amax() > 1e-3                               # not a no-op
    assert torch.isfinite(out.images).all()
    n = _tokens(pipe)
    offsets = [sum(n[:i + 1]) for i in range(len(n))]
    # a refiner holds what it kept plus each new scale; after every scale but the last it keeps
    # 0.3 of the tokens generated so far (at least the 4 window keys) when that is fewer
    held, before, own = 0, [], 0
    for si in range(len(n)):
        before.append(held)
        held += n[si]
        if si < len(n) - 1:
            kept = min(held, max(4, int(0.3 * offsets[si] + 0.5)))
            own = max(own, kept)          # compressed: the scale passes through the shared tail
            held = kept
    assert before[2] == 4 and held == before[-1] + n[-1]              # compressed from the second scale on
    kv = pipe.adapter()._workspace.kv
    depth = pipe.transformer.config.depth
    assert kv.lengths == [held if i != 1 else offsets[-1] for i in range(depth)]       # the drafter keeps all
    # own buffers: the drafter everything but the last scale, the refiners the most they keep; the tail
    # holds one layer's largest moment, the drafter's last scale
    assert kv.capacities == tuple(offsets[-2] if i == 1 else own for i in range(depth))
    assert kv.capacity + kv.transient == offsets[-1]
    # K and V (float32, embed_dim per token) and a position (int64) per slot, for 2 images × 2 CFG rows
    per_slot = 4 * (2 * pipe.transformer.config.embed_dim * 4 + 8)
    assert dense_bytes == depth * offsets[-1] * per_slot
    assert kv.nbytes() == (offsets[-2] + (depth - 1) * own + offsets[-1]) * per_slot
    # from the first compression on, a query reads the kept keys plus its scale's, averaged over layers
    reads = [s.keys_read for s in out.stats[0].scales]
    assert reads[0] is None
    for si in range(1, len(n)):
        assert reads[si] == pytest.approx(((depth - 1) * (before[si] + n[si]) + offsets[si]) / depth)


def test_a_batch_equals_its_images_one_by_one(pipe):
    pipe.enable_scalekv(budget=0.25, min_tokens=0, window=4)
    both = _run(pipe, [1, 4])
    one = _run(pipe, [1])
    torch.testing.assert_close(both.images[:1], one.images, rtol=0, atol=1e-5)


def test_composes_with_scale_skipping_and_cond_only(pipe):
    pipe.enable_scalekv(budget=0.3, min_tokens=0, window=4).enable_scale_skip(skip_last=2)
    out = _run(pipe, [1, 4])
    n = _tokens(pipe)
    kv = pipe.adapter()._workspace.kv
    keep = max(4, int(0.3 * sum(n[:-3]) + 0.5))                     # after the fourth-last scale
    assert [s.skipped for s in out.stats[0].scales][-2:] == [True, True]
    assert kv.lengths[1] == keep + n[-3]
    assert kv.capacity + kv.transient == sum(n[:-2])                         # allocated for the scales that run
    pipe.disable_scale_skip().enable_scale_skip(cond_only_from=-3)
    out = _run(pipe, [1, 4])
    assert [s.rows for s in out.stats[0].scales][-3:] == [1, 1, 1] and torch.isfinite(out.images).all()


def test_refusals_and_bad_settings_name_the_reason(pipe):
    pipe.enable_scalekv()
    for enable, other in ((pipe.enable_sparvar, "sparvar"), (pipe.enable_sparsevar, "sparsevar"),
                          (pipe.enable_fastvar, "fastvar")):
        with pytest.raises(ValueError, match=f"{other} cannot be combined with scalekv|scalekv cannot be combined "
                                             f"with {other}") as e:
            enable()
        assert "per head" in str(e.value)
    pipe.disable_scalekv()
    depth = pipe.transformer.config.depth
    with pytest.raises(ValueError, match=f"drafters=\\(0, {depth}\\): layer {depth} does not exist"):
        pipe.enable_scalekv(drafters=(0, depth))
    with pytest.raises(ValueError, match="budget has 10 entries"):
        pipe.enable_scalekv(budget=(0.5,) * 10)
    for bad, match in ((dict(budget=0.0), "budget must be a fraction in \\(0, 1\\]"),
                       (dict(budget=(0.5, 1.5)), "budget must be"), (dict(budget=True), "budget must be"),
                       (dict(window=15), "window must be a square number"),
                       (dict(pool_kernel=4), "pool_kernel must be an odd int"),
                       (dict(min_tokens=-1), "min_tokens must be an int >= 0"),
                       (dict(drafters=(-1,)), "drafters must be a tuple of layer indices")):
        with pytest.raises(ValueError, match=match):
            ScaleKVConfig(**bad)
    assert ScaleKVConfig(budget=[0.5, 0.2]).budget == (0.5, 0.2)            # lists become tuples (hashable)


def test_cli_flag_generates_and_refuses_what_cannot_combine(tmp_path, capsys):
    from sparsevar.cli import main
    out = tmp_path / "img.png"
    assert main(["generate", "--class", "1", "--scalekv", "0.2", "--out", str(out), "--quiet"]) == 0
    assert out.is_file() and out.stat().st_size > 0
    capsys.readouterr()
    assert main(["generate", "--class", "1", "--scalekv", "--fastvar", "--out", str(tmp_path / "no.png")]) == 2
    assert "--scalekv and --fastvar cannot be combined" in capsys.readouterr().err
    assert not (tmp_path / "no.png").exists()


def test_quality_bench_forms():
    from sparsevar.benchmarks.bench_quality import parse_setting
    s = parse_setting("scalekv-b0.3+cond-only-last-2")
    assert s.family == "combo" and s.scalekv.budget == 0.3 and s.scale_skip.cond_only_from == -2
    assert [type(p).__name__ for p in s.policies()] == ["ScaleKVPolicy", "ScaleSkipPolicy"]
    with pytest.raises(ValueError, match="combines ScaleKV with another method"):
        parse_setting("scalekv-preset+sparvar-preset")
