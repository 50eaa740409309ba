"""SparVAR (issue #30) on the tiny fixture model (CPU): its position maps against hand-worked
examples, its attention op against dense attention, the neutral setting, the preset acting,
batches, composition with scale skipping and cond-only, refusals and bad settings."""
from __future__ import annotations

import pytest
import torch

from sparsevar.policies import Policy, SparVARConfig
from sparsevar.policies.sparvar import band_ranges, csla_mask, relative_key_map
from sparsevar.sparse_ops import ref as sparse_ref


@pytest.fixture
def pipe(var_pipe):
    return var_pipe


def _run(pipe, labels, seeds=None, **kw):
    """One generator per image (seeds 3, 4, … unless ``seeds``), so an image does not depend on its batch."""
    gens = [torch.Generator().manual_seed(s) for s in (seeds or range(3, 3 + len(labels)))]
    return pipe(labels, generator=gens, output_type="pt", **kw)




# ---- position maps, worked by hand --------------------------------------------------------------------
def test_relative_key_map_moves_each_key_one_scale_on_by_the_supplements_projection():
    """Scales 1×1, 2×2, 4×4 (offsets 0, 1, 5, 21), from scale 1 to scale 2: the 1×1 key lands on
    (0, 0) of the 2×2 map (position 1); a 2×2 key (u, v) on (⌊4u/2⌋, ⌊4v/2⌋) = (2u, 2v) of the
    4×4 map: 5, 5 + 2 = 7, 5 + 8 = 13, 5 + 10 = 15; one scale (the first) has no source."""
    map_L, sinks = relative_key_map(((1, 1), (2, 2), (4, 4)), 1, 2)
    assert map_L.tolist() == [1, 5, 7, 13, 15] and sinks == 1
    map_L, sinks = relative_key_map(((1, 1), (2, 2), (3, 3), (4, 4)), 1, 3)      # two scales on: 1×1 → 3×3, 2×2 → 4×4
    assert map_L.tolist() == [5, 14, 16, 22, 24] and sinks == 2


def test_band_ranges_cover_each_groups_windows_as_one_raster_range():
    """A 4×4 scale, groups of one row (4 queries), 3×3 windows: row 0's windows span rows 0–1
    (positions 0 … 7), row 1's rows 0–2 (0 … 11), row 3's rows 2–3 (8 … 15)."""
    assert band_ranges(4, 4, 4, 3).tolist() == [[0, 7], [0, 11], [4, 15], [8, 15]]
    assert band_ranges(4, 4, 16, -1).tolist() == [[0, 15]]
    assert band_ranges(3, 3, 4, 1).tolist() == [[0, 3], [4, 7], [8, 8]]           # side 1: the group itself


def test_csla_mask_reads_sinks_and_windows_only():
    """Scales 1×1, 2×2, 4×4, queries of the 4×4 scale, one sink scale, windows (1,) for the last
    key scale: every query reads the 1×1 sink, nothing of the 2×2 scale (past the tuple), and
    only itself in its own scale. With (3, -1): its 3×3 neighbourhood and the whole 2×2 scale."""
    hw = ((1, 1), (2, 2), (4, 4))
    m = csla_mask(hw, 2, 1, (1,))
    assert m.shape == (16, 21)
    assert m[:, 0].all() and not m[:, 1:5].any()
    assert torch.equal(m[:, 5:], torch.eye(16, dtype=torch.bool))
    m = csla_mask(hw, 2, 0, (3, -1))
    assert not m[:, 0].any() and m[:, 1:5].all()
    assert m[5, 5:].view(4, 4).nonzero().tolist() == [[y, x] for y in range(3) for x in range(3)]   # query (1, 1)
    assert m[15, 5:].view(4, 4).nonzero().tolist() == [[2, 2], [2, 3], [3, 2], [3, 3]]            # corner (3, 3)


# ---- the attention op --------------------------------------------------------------------------------
def _masked(q, k, v, keys_RHGL, group, scale):
    idx, count = sparse_ref.key_lists(keys_RHGL, keys_RHGL.shape[-1])
    return sparse_ref.group_sparse_attention(q, k, v, idx, count, group, scale)


def test_group_sparse_attention_is_dense_attention_over_each_groups_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (10, 13, 13))
    every = torch.ones(2, 3, 4, 13, dtype=torch.bool)                                    # 10 queries, groups of 3
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v
    torch.testing.assert_close(_masked(q, k, v, every, 3, 0.5), want, rtol=1e-5, atol=1e-6)
    one = torch.zeros_like(every)
    one[..., 2, 7] = True                                                                # group 2 (queries 6–8): key 7
    one[..., [0, 1, 3], 0] = True
    out = _masked(q, k, v, one, 3, 0.5)
    torch.testing.assert_close(out[:, :, 6:9], v[:, :, 7:8].expand(2, 3, 3, 8))          # one key: its value
    torch.testing.assert_close(out[:, :, 9:], v[:, :, 0:1])                              # the short last group
    none = one.clone()
    none[..., 1, :] = False
    assert _masked(q, k, v, none, 3, 0.5)[:, :, 3:6].abs().max() == 0                    # no key: zeros
    idx, count = sparse_ref.key_lists(every, 13)
    with pytest.raises(ValueError, match=r"need \(R, H, G\) = \(2, 3, 4\) and \(G, 2\) for 10 queries in groups of 3"):
        sparse_ref.group_sparse_attention(q, k, v, idx[:, :, :3], count[:, :, :3], 3, 0.5)
    src = torch.tensor([0, 0, 1, 1])                                  # groups reading another group's list
    sparse_ref.group_sparse_attention(q, k, v, idx[:, :, :2], count[:, :, :2], 3, 0.5, list_of_G=src)
    with pytest.raises(ValueError, match=r"list_of_G \(3,\) need .* \(with list_of_G: lists \(R, H, any\) and "
                                         r"list_of_G \(G,\)\)"):
        sparse_ref.group_sparse_attention(q, k, v, idx[:, :, :2], count[:, :, :2], 3, 0.5, list_of_G=src[:3])
    with pytest.raises(ValueError, match=r"reads_RHG \(2, 3, 4\) torch.int64 needs a contiguous \(R, H, G\) = "
                                         r"\(2, 3, 4\) int32 tensor"):
        sparse_ref.group_sparse_attention(q, k, v, idx, count, 3, 0.5, reads_RHG=torch.zeros(2, 3, 4, dtype=torch.long))


def test_csla_tiles_read_what_the_boolean_mask_reads():
    """The gathered form of CSLA (Triton backend) reads exactly the keys of ``csla_mask`` (the torch
    backend's SDPA mask) — sinks, whole scales and unread scales included, on a non-square schedule:
    the per-key tables give the mask, every query sits in one tile, each tile lists every key past
    the prefix that its queries' windows reach, and the torch twin over the tiles equals masked SDPA
    (the kernel against the twin: tests/test_sparse_ops.py)."""
    from sparsevar.policies.sparvar import csla_tables
    hw = ((1, 1), (2, 2), (3, 3), (4, 6), (9, 13), (12, 17))
    g = torch.Generator().manual_seed(1)
    for si, sinks, windows, tile in ((4, 2, (3, 1, -1), (8, 8)), (5, 1, (7, 0, 3, 1), (4, 4)), (5, 0, (1,), (3, 5)),
                                     (3, 4, (5,), (2, 2)), (5, 6, (3,), (8, 8))):
        want_lL = csla_mask(hw, si, sinks, windows)
        l, L = want_lL.shape
        ylo, yhi, xlo, xhi = csla_tables(hw, si, sinks, windows)
        w = hw[si][1]
        y, x = torch.arange(l)[:, None] // w, torch.arange(l)[:, None] % w
        assert torch.equal((ylo <= y) & (y <= yhi) & (xlo <= x) & (x <= xhi), want_lL), (si, sinks, windows)
        tile_q, tile_keys, count, prefix, tables = _check_tiles(hw, si, sinks, windows, tile, want_lL)
        q, k, v = torch.randn(2, 3, l, 16, generator=g), torch.randn(2, 3, L, 16, generator=g), torch.randn(2, 3, L, 16, generator=g)
        got = sparse_ref.window_attention(q, k, v, tile_q, tile_keys, count, prefix, tables, w, 0.25)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=want_lL, scale=0.25)
        rows = want_lL.any(1)                     # a query with no key: zeros here, NaN from SDPA
        torch.testing.assert_close(got[:, :, rows], want[:, :, rows], rtol=1e-5, atol=1e-5)
        assert got[:, :, ~rows].abs().max().item() == 0 if (~rows).any() else True


def _check_tiles(hw, si, sinks, windows, tile, want_lL):
    """``csla_tiles`` against the mask ``want_lL``: each query in one tile, the prefix read by every
    query, each tile listing every key past the prefix its queries reach and no key none reads."""
    from sparsevar.policies.sparvar import csla_tiles
    l = want_lL.shape[0]
    tile_q, tile_keys, count, prefix, tables = csla_tiles(hw, si, sinks, windows, tile)
    assert sorted(tile_q[tile_q >= 0].tolist()) == list(range(l))                       # each query once
    assert bool(want_lL[:, :prefix].all())                                              # the sinks: read by all
    read_by_any = want_lL.any(0)
    for t in range(tile_q.shape[0]):
        rows = tile_q[t][tile_q[t] >= 0].long()
        listed = tile_keys[t, :count[t]].long()
        reached = want_lL[rows][:, prefix:].any(0).nonzero().flatten().add(prefix)
        assert set(reached.tolist()) <= set(listed.tolist()), (si, t)
        assert listed.numel() == 0 or (int(listed.min()) >= prefix and bool(read_by_any[listed].all())), (si, t)
    return tile_q, tile_keys, count, prefix, tables


@pytest.mark.parametrize("name, hw, si", [
    ("Infinity-2B 1024², last scale", tuple((p, p) for p in (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)), 12),
    ("Infinity-2B 1024², second-last", tuple((p, p) for p in (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)), 11),
    ("HART 1024² (300 text slots first), last scale",
     ((1, 300),) + tuple((p, p) for p in (2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64)), 13),
    ("Infinity 2:1 (1024×512-like), last scale", ((1, 1), (1, 2), (2, 4), (4, 8), (6, 12), (8, 16), (12, 24),
                                                  (16, 32), (20, 40), (24, 48), (32, 64)), 10),
])
def test_csla_tiles_cover_the_mask_at_production_schedules(name, hw, si):
    """The tiles the Triton kernel reads, at the production schedules (paper windows 7/5/3, 5 sink
    scales, 8×8 patches): the per-key tables give ``csla_mask`` and every tile lists what its
    queries' windows reach."""
    from sparsevar.policies.sparvar import CSLA_TILE, csla_tables
    want_lL = csla_mask(hw, si, 5, (7, 5, 3))
    ylo, yhi, xlo, xhi = csla_tables(hw, si, 5, (7, 5, 3))
    w = hw[si][1]
    l = want_lL.shape[0]
    y, x = torch.arange(l)[:, None] // w, torch.arange(l)[:, None] % w
    assert torch.equal((ylo <= y) & (y <= yhi) & (xlo <= x) & (x <= xhi), want_lL), name
    _check_tiles(hw, si, 5, (7, 5, 3), CSLA_TILE, want_lL)
    # the stats' keys a query reads (counted from the per-key ranges, no mask) are the mask's
    import types
    from sparsevar.engine.schedule import ScaleSchedule
    from sparsevar.policies.sparvar import SparVARPolicy
    run = types.SimpleNamespace(shape_cache={}, schedule=ScaleSchedule(hw))
    policy = SparVARPolicy(SparVARConfig(sink_scales=5, windows=(7, 5, 3)))
    mask, keys = policy._csla_mask(si, run, "cpu", need_mask=False)
    assert mask is None and keys == pytest.approx(want_lL.sum(1).double().mean().item(), rel=1e-12)


def test_a_setting_whose_csla_queries_read_nothing_is_refused():
    with pytest.raises(ValueError, match=r"sink_scales=0 with windows=\(0, 0\) leaves CSLA's queries"):
        SparVARConfig(sink_scales=0, windows=(0, 0))
    with pytest.raises(ValueError, match=r"sink_scales >= 1 or a window"):
        SparVARConfig(sink_scales=0, windows=())
    assert SparVARConfig(sink_scales=0, windows=(0, 0), cs4a_layers=1.0).cs4a_layers == 1.0   # no CSLA layer


def test_key_lists_compact_each_groups_keys_in_order_within_the_width():
    keys = torch.tensor([[[[0, 1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]]]], dtype=torch.bool)
    idx, count = sparse_ref.key_lists(keys, 7)
    assert idx.dtype == count.dtype == torch.int32 and idx.shape == (1, 1, 3, 7)
    assert count.tolist() == [[[3, 0, 7]]]
    assert idx[0, 0, 0, :3].tolist() == [1, 3, 4] and idx[0, 0, 2].tolist() == list(range(7))
    idx, count = sparse_ref.key_lists(keys, 2)                     # more keys than the width: the first ones
    assert count.tolist() == [[[2, 0, 2]]] and idx[0, 0, 0].tolist() == [1, 3] and idx[0, 0, 2].tolist() == [0, 1]


# ---- the policy on the fixture model --------------------------------------------------------------------
class _Seen(Policy):
    """Records SparVAR's decision scale (read at the first scale, after every ``begin``) and the
    scales after which it holds CS4A state."""

    name = "seen"

    def __init__(self):
        self.decision, self.scales = None, []

    def begin(self, run):
        self.decision, self.scales = None, []

    def plan_scale(self, si, run):
        if si == 0:
            self.decision = run.policy_state["sparvar"]["decision"]
        return None

    def after_scale(self, si, guided_logits_BLV, run):
        if run.policy_state["sparvar"]["cs4a"]:
            self.scales.append(si)


def test_neutral_setting_reads_every_key_and_matches_dense(pipe):
    dense = _run(pipe, [1, 4])
    pipe.enable_sparvar(SparVARConfig.dense())
    seen = _Seen()
    pipe.add_policy(seen)
    out = _run(pipe, [1, 4])
    S = len(pipe.transformer.config.patch_nums)
    assert seen.decision == S - 3 and seen.scales == [S - 3, S - 2, S - 1]             # CS4A state from S on
    torch.testing.assert_close(out.images, dense.images, rtol=0, atol=1e-4)


def test_preset_changes_the_picture_and_a_batch_reproduces_its_images_generated_one_by_one(pipe):
    """Per-image index lists: every image of a batch is its solo run (same label, same seed) up to
    float rounding of the batched matmuls (measured ≤ 3.3e-6; lists shared across the batch move
    images 1… by ~0.8). Each image differs from dense, so the comparison is not of dense runs."""
    labels, seeds = [1, 4], [3, 4]
    dense = _run(pipe, labels, seeds)
    pipe.enable_sparvar()
    both = _run(pipe, labels, seeds)
    for i, (label, seed) in enumerate(zip(labels, seeds)):
        assert (both.images[i] - dense.images[i]).abs().amax() > 1e-3, i                   # not a no-op
        one = _run(pipe, [label], [seed])
        torch.testing.assert_close(both.images[i:i + 1], one.images, rtol=0, atol=1e-5,
                                   msg=lambda m: f"image {i}: {m}")
    pipe.disable_sparvar()
    pipe.enable_sparvar(top_keys=0.5, mapping="verbatim", windows=(3, 1), cs4a_layers=0.5)
    assert (_run(pipe, [1, 4]).images - both.images).abs().amax() > 1e-4                 # settings matter


def test_relative_index_lists_read_the_keys_of_the_mask_path(pipe):
    """The "relative" mapping moves the decision scale's index lists and hands them to the kernel
    with the list each group reads, and the sinks and the band as ranges; the kernel counts the
    listed keys it read past the ranges; the mask path (used where a
    schedule's map is not one to one) unions the same keys as masks and counts them. Same keys: the
    same pictures and the same key counts."""
    from sparsevar.policies.sparvar import SparVARPolicy

    class MaskPath(SparVARPolicy):
        def _relative_maps(self, G_from, si_from, si_to, run, device):
            return None

    cfg = SparVARConfig(top_keys=0.3, query_group=5, local_window=3, sink_scales=2)
    pipe.enable_sparvar(cfg)
    lists = _run(pipe, [1, 4])
    pipe.disable_sparvar()
    pipe.add_policy(MaskPath(cfg))
    masks = _run(pipe, [1, 4])
    torch.testing.assert_close(lists.images, masks.images, rtol=0, atol=1e-6)
    for a, b in zip(lists.stats, masks.stats):
        got, want = ([s.keys_read for s in x.scales if s.keys_read is not None] for x in (a, b))
        assert len(got) == len(want) == 3 and got == pytest.approx(want, rel=1e-6)


def test_cs4a_state_in_the_next_layers_last_scale_slots_gives_the_pictures_of_state_beside_the_cache(pipe):
    """The decision scale's O_cache and key lists of CS4A layer i live in layer i + 1's last-scale
    V and K slots of the KV cache (no memory beside it), which layer i + 1 writes only after layer
    i's last read: the pictures are those of state allocated on its own, bit for bit, in a batch."""
    from sparsevar.policies.sparvar import SparVARPolicy

    held = []

    class Held(SparVARPolicy):
        def _cs4a(self, ctx, q, k, v, run, st):
            out = super()._cs4a(ctx, q, k, v, run, st)
            entry = run.policy_state[self.name]["cs4a"][ctx.layer]
            kv = run.workspace.kv
            o_cache, idx = self._state(entry, run)
            a = kv.last_scale[0]                        # layer i + 1's first last-scale V and K slots
            held.append((ctx.layer, entry["o_cache"] is None and entry["idx"] is None
                         and o_cache.data_ptr() == kv.v_NRHTd[ctx.layer + 1, 0, 0, a].data_ptr()
                         and idx.data_ptr() == kv.k_NRHTd[ctx.layer + 1, 0, 0, a].data_ptr()))
            return out

    class Beside(SparVARPolicy):
        @staticmethod
        def _lent(*args):
            return None, None

    cfg = SparVARConfig(top_keys=0.3, query_group=5, local_window=3, sink_scales=2)
    pipe.add_policy(Held(cfg))
    inside = _run(pipe, [1, 4, 7])
    pipe.disable_sparvar()
    pipe.add_policy(Beside(cfg))
    beside = _run(pipe, [1, 4, 7])
    assert held and all(ok for layer, ok in held), held
    torch.testing.assert_close(inside.images, beside.images, rtol=0, atol=0)


def test_a_capture_warm_up_of_the_last_scale_keeps_the_cs4a_state_it_overwrites(pipe, monkeypatch):
    """A CUDA-graph capture runs a scale once before capturing it (``engine/graphs._capture``: under
    ``kv.keep_undo()``, then ``kv.undo()`` and the host state put back). Emulated here on the CPU at
    the last scale, where each layer's writes cover the next-lower layer's lent O_cache and lists:
    the run after the warm-up gives the pictures of a run without one, bit for bit."""
    from sparsevar.engine import sampler

    real = sampler.compute_scale
    warmed = []

    def with_warm_up(adapter, si, plan, run):
        if si == run.schedule.num_scales - 1:
            kv, st = run.workspace.kv, run.policy_state["sparvar"]
            before, saved = kv.host_state(), dict(st)
            kv.keep_undo()
            real(adapter, si, plan, run)
            kv.undo()
            kv.set_host_state(before)
            st.clear()
            st.update(saved)
            warmed.append(si)
        return real(adapter, si, plan, run)

    pipe.enable_sparvar(SparVARConfig(top_keys=0.3, query_group=5, local_window=3, sink_scales=2))
    plain = _run(pipe, [1, 4])
    monkeypatch.setattr(sampler, "compute_scale", with_warm_up)
    after = _run(pipe, [1, 4])
    assert warmed
    torch.testing.assert_close(after.images, plain.images, rtol=0, atol=0)


def test_decision_scale_follows_the_last_computed_scale_and_cond_only_composes(pipe):
    S = len(pipe.transformer.config.patch_nums)
    pipe.enable_scale_skip(skip_last=2)
    pipe.enable_sparvar()
    seen = _Seen()
    pipe.add_policy(seen)
    out = _run(pipe, [2])
    assert seen.decision == S - 2 - 3 and sum(not s.skipped for s in out.stats[0].scales) == S - 2
    pipe.disable_scale_skip()
    pipe.enable_scale_skip(cond_only_from=-2)                                           # rows halve after S
    out = _run(pipe, [2, 5])
    assert seen.decision == S - 3 and torch.isfinite(out.images).all()
    pipe.remove_policy("seen")
    pipe.disable_sparvar()
    cond_only = _run(pipe, [2, 5])
    pipe.enable_sparvar(SparVARConfig.dense())
    torch.testing.assert_close(_run(pipe, [2, 5]).images, cond_only.images, rtol=0, atol=1e-4)


def test_refusals_and_bad_settings_name_the_reason(pipe):
    pipe.enable_sparsevar()
    with pytest.raises(ValueError, match=r"sparvar cannot be combined with sparsevar \(.*token subsets"):
        pipe.enable_sparvar()
    pipe.disable_sparsevar()
    pipe.enable_fastvar()
    with pytest.raises(ValueError, match="sparvar cannot be combined with fastvar"):
        pipe.enable_sparvar()
    pipe.disable_fastvar()
    with pytest.raises(ValueError, match="decision_scale=-1 is the last scale"):
        pipe.enable_sparvar(decision_scale=-1)
    for bad, msg in ((dict(top_keys=0), "top_keys must be in"), (dict(top_keys=1.5), "top_keys must be"),
                     (dict(local_window=4), "local_window must be an odd"), (dict(mapping="nearest"), "mapping must"),
                     (dict(windows=[3]), "windows must be a tuple"), (dict(windows=(2,)), "windows must be"),
                     (dict(query_group=0), "query_group must be"), (dict(cs4a_layers=2), "cs4a_layers must be"),
                     (dict(sink_scales=-1), "sink_scales must be"), (dict(decision_scale=1.5), "decision_scale must")):
        with pytest.raises(ValueError, match=msg):
            SparVARConfig(**bad)
    with pytest.raises(ValueError, match="unknown SparVARConfig setting"):
        pipe.enable_sparvar(top_k=0.3)


def test_stats_count_the_keys_read_and_flop_speedup_follows(pipe):
    """CSLA with one sink scale and 1×1 windows on the last two key scales reads 1 + 1 (+ 1) keys
    per query; CS4A layers at the decision scale pay the dense pass, the column sums and the sparse
    pass (1.5 L + K keys). The FLOP speed-up counts it: the neutral setting is slower than dense."""
    S = len(pipe.transformer.config.patch_nums)
    pipe.enable_sparvar(cs4a_layers=0.0, sink_scales=1, windows=(1, 1))
    out = _run(pipe, [3])
    scales = out.stats[0].scales
    assert [s.keys_read for s in scales[:S - 3]] == [None] * (S - 3)
    assert [s.keys_read for s in scales[S - 3:]] == [1.0, 2.0, 3.0]                 # sink; + own; + previous
    assert pipe.flop_speedup(out.stats[0]) > 1.0
    pipe.disable_sparvar()
    pipe.enable_sparvar(SparVARConfig.dense())
    out = _run(pipe, [3])
    s = out.stats[0].scales[S - 3]
    L = sum(p * p for p in pipe.transformer.config.patch_nums[:S - 2])
    depth, n_cs4a = pipe.transformer.config.depth, round(0.6 * pipe.transformer.config.depth)
    assert s.keys_read == pytest.approx((n_cs4a * 2.5 * L + (depth - n_cs4a) * L) / depth)
    assert out.stats[0].scales[-1].keys_read == pytest.approx(sum(p * p for p in pipe.transformer.config.patch_nums))
    assert pipe.flop_speedup(out.stats[0]) < 1.0


def test_cs4a_output_is_the_sparse_pass_plus_the_bilinear_upsampling_of_the_decision_scales_remainder(
        pipe, monkeypatch):
    """At a sparse scale a CS4A layer returns its sparse pass plus O_cache (the decision scale's
    dense − sparse output, per row and head) bilinearly resized to the scale: the kernel adds the
    resize in its epilogue; here the sparse pass is recomputed from the recorded key lists without
    it, and O_cache resized by ``F.interpolate`` in float64."""
    from sparsevar.policies import sparvar as sparvar_mod

    calls, seen = [], []
    real = sparvar_mod.sparse_ops.group_sparse_attention

    def recording(*a, **kw):
        calls.append((a, kw))
        return real(*a, **kw)

    monkeypatch.setattr(sparvar_mod.sparse_ops, "group_sparse_attention", recording)

    class Recorder(sparvar_mod.SparVARPolicy):
        def _cs4a(self, ctx, q, k, v, run, st):
            out = super()._cs4a(ctx, q, k, v, run, st)
            entry = run.policy_state[self.name]["cs4a"][ctx.layer]
            seen.append((ctx.si, run.schedule.hw[ctx.si], entry["si"], run.schedule.hw[entry["si"]],
                         self._state(entry, run)[0].clone(), calls[-1], out))
            return out

    pipe.add_policy(Recorder(SparVARConfig(top_keys=0.3, query_group=5, local_window=3, sink_scales=2)))
    _run(pipe, [1, 4])
    S = len(pipe.transformer.config.patch_nums)
    later = [r for r in seen if r[0] > r[2]]
    assert {r[0] for r in later} == {S - 2, S - 1} and all(r[2] == S - 3 for r in later)
    for si, (h, w), _, (hS, wS), o_cache, (args, kw), out in later:
        R, H, l, d = out.shape
        assert o_cache.shape[1:] == (H, hS * wS, d)
        o_sparse = sparse_ref.group_sparse_attention(*args[:9], None, None, None, args[12])   # no map to add
        assert len(args) == 14 and args[12] is not None                  # groups read the decision scale's lists
        planes = o_cache[:R].double().reshape(R * H, hS, wS, d).permute(0, 3, 1, 2)    # (R·H, d, hS, wS)
        up = torch.nn.functional.interpolate(planes, size=(h, w), mode="bilinear", align_corners=False)
        want = o_sparse.double() + up.reshape(R, H, d, h * w).transpose(-1, -2)
        assert (out.double() - o_sparse.double()).abs().amax() > 1e-4           # the remainder is not zero
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
