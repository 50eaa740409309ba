"""Acceleration policies on the tiny fixture model (CPU): neutral settings are exact, the kept
sets follow the rules, excluded tokens add no K/V, batches equal their images, composition and
validation errors."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.policies import FastVARConfig, Policy, ScalePlan, ScaleSkipConfig, SparseVARConfig
from sparsevar.policies.fastvar import pivotal_tokens
from sparsevar.policies.sparsevar import (TOKEN_ANCHOR, TOKEN_COPIED, TOKEN_EXCLUDED, TOKEN_KEPT, anchor_candidates,
                                          anchor_count, anchor_mask)
from sparsevar.sparse_ops import ref as sparse_ref


@pytest.fixture
def pipe(var_official_files):
    p = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    p.set_progress_bar_config(disable=True)
    return p


def _assert_same_codes(got, want, scales):
    """The per-scale codes of two runs are equal scale for scale, and each run produced ``scales`` of them
    (never vacuous: an empty or short list fails)."""
    assert len(got) == len(want) == scales > 0, (len(got), len(want), scales)
    for si, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"codes differ at scale {si}"


def _run(pipe, labels=(3, 7), seeds=(1, 2), **kw):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    codes = []
    out = pipe(list(labels), generator=gens, output_type="pt", top_k=5, top_p=0.0,
               callback_on_step_end=lambda p, si, t, k: codes.append(k["codes"]), **kw)
    return out, codes


class Probe(Policy):
    """Records what the policies before it in the stack produced."""

    name = "probe"

    def __init__(self):
        self.kv_lengths, self.rows, self.hidden, self.residual = {}, {}, {}, {}

    def post_hidden(self, si, h, run):
        self.hidden[si] = h.clone()
        return h

    def post_residual(self, si, r, run):
        self.residual[si] = r.clone()
        return r

    def after_scale(self, si, logits, run):
        self.kv_lengths[si] = list(run.workspace.kv.lengths)
        self.rows[si] = run.workspace.kv.rows


# ---- neutral settings reproduce dense generation bit for bit --------------------------------------
@pytest.mark.parametrize("enable", [
    lambda p: p.enable_sparsevar(tau=0.0),
    lambda p: p.enable_sparsevar(keep_ratio=1.0, start_scale=1),
    lambda p: p.enable_fastvar(ratios=(0.0, 0.0, 0.0)),
    lambda p: p.enable_scale_skip(ScaleSkipConfig()),
    lambda p: p.enable_scale_skip(skip_last=0).enable_sparsevar(tau=0.0),
], ids=["sparsevar-tau0", "sparsevar-keep1", "fastvar-0", "scale-skip-0", "skip+sparsevar"])
def test_neutral_settings_are_bit_exact(pipe, enable):
    dense, dense_codes = _run(pipe)
    enable(pipe)
    out, codes = _run(pipe)
    _assert_same_codes(codes, dense_codes, pipe.transformer.schedule.num_scales)
    assert torch.equal(out.images, dense.images)


# ---- the kept-set rule on hand-made maps ------------------------------------------------------------
def test_anchor_grid_includes_last_row_and_column_on_odd_non_square_maps():
    m = anchor_mask(5, 7, alpha=4)
    assert m.nonzero().tolist() == [[r, c] for r in (0, 4) for c in (0, 4, 6)]
    assert anchor_mask(1, 1, 4).all()
    assert anchor_mask(13, 13, 4).sum() == 4 * 4          # rows/cols 0, 4, 8, 12 (12 is also the last)
    assert anchor_mask(16, 16, 4).sum() == 5 * 5          # 0, 4, 8, 12 and the last, 15
    for h, w, a in ((5, 7, 4), (13, 13, 4), (16, 16, 4), (1, 9, 2), (40, 60, 4)):
        assert anchor_count(h, w, a) == int(anchor_mask(h, w, a).sum())


def test_anchor_candidates_are_the_corners_of_the_token_cell():
    h, w, a = 6, 9, 4                                     # anchor rows 0, 4, 5; cols 0, 4, 8
    cand = anchor_candidates(h, w, a).view(h, w, 4)
    assert sorted(set(cand[2, 6].tolist())) == [0 * w + 4, 0 * w + 8, 4 * w + 4, 4 * w + 8]
    assert set(cand[4, 4].tolist()) == {4 * w + 4}         # an anchor's candidate is itself
    assert sorted(set(cand[5, 1].tolist())) == [5 * w + 0, 5 * w + 4]  # on the last anchor row
    assert anchor_mask(h, w, a).view(-1)[cand.view(-1)].all()


def select_tokens(change_BL, anchors_L, tau, keep_ratio):
    """The kept set of ``sparse_ops.ref.select_kept`` on a map at its scale's size, with the policy's
    budget: ceil(keep_ratio · L) tokens, and at least the anchors."""
    L = change_BL.shape[1]
    budget = None if keep_ratio is None else max(math.ceil(keep_ratio * L), int(anchors_L.sum()))
    return sparse_ref.select_kept(change_BL, torch.arange(L), anchors_L, tau, budget)[2]


def test_tau_rule_is_strict_and_per_image():
    change = torch.tensor([[0.0, 1.0, 6.0, 10.0], [5.0, 5.0, 5.0, 5.0]])
    anchors = torch.tensor([False, False, False, False])
    keep = select_tokens(change, anchors, tau=0.6, keep_ratio=None)
    assert keep.tolist() == [[False, False, False, True], [True, True, True, True]]   # 6 = 0.6·10 is not kept


def test_keep_ratio_counts_anchors_and_breaks_ties_by_position():
    change = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]])
    anchors = torch.tensor([True, False, False, False, False, False])
    keep = select_tokens(change, anchors, tau=0.6, keep_ratio=0.5)                   # budget 3, anchor included
    assert keep.tolist() == [[True, True, True, False, False, False]]
    keep = select_tokens(change, torch.ones(6, dtype=torch.bool), tau=0.6, keep_ratio=0.1)
    assert keep.all()                                                                 # at least the anchors


def test_pivotal_tokens_are_farthest_from_the_mean():
    x = torch.zeros(1, 5, 2)
    x[0, 3] = 10.0
    x[0, 1] = -4.0
    assert pivotal_tokens(x, 2).tolist() == [[1, 3]]


# ---- behaviour inside generation ---------------------------------------------------------------------
def test_sparsevar_excluded_tokens_add_no_kv_and_get_zero_or_anchor_hidden(pipe):
    probe = Probe()
    pipe.enable_sparsevar(tau=0.6, start_scale=-3, beta=0.9).add_policy(probe)
    out, _ = _run(pipe, labels=(3,), seeds=(4,))
    st = out.stats[0]
    sch = pipe.transformer.schedule
    total = 0
    for s in st.scales:
        total += int(s.tokens_computed)
        assert probe.kv_lengths[s.si] == [total] * pipe.transformer.config.depth   # only computed tokens cached
    pruned = [s.si for s in st.scales if s.tokens_computed < s.tokens]
    assert pruned and min(pruned) >= sch.num_scales - 3
    for si in pruned:
        roles = st.token_maps[si].view(-1)
        assert int((roles == TOKEN_KEPT).sum() + (roles == TOKEN_ANCHOR).sum()) == st.scales[si].tokens_computed
        zero = roles == TOKEN_EXCLUDED
        assert zero.any() and (~zero).any(), si
        assert torch.all(probe.residual[si][0, zero] == 0) and torch.all(probe.residual[si][0, ~zero] != 0)
        copied = (roles == TOKEN_COPIED).nonzero().view(-1)
        assert len(copied) > 0, si
        h = probe.hidden[si]
        for i in copied.tolist():                       # each copied token equals some anchor of its cell
            h_, w_ = sch.hw[si]
            cands = anchor_candidates(h_, w_, 4)[i]
            assert any(torch.equal(h[:, i], h[:, c]) for c in cands.tolist())


@pytest.mark.parametrize("similarity", ["probs", "logits"])
def test_an_excluded_token_copies_its_anchor_exactly_when_their_distributions_are_alike(pipe, similarity):
    """The copy rule recomputed from the previous scale's guided logits: cosine of the softmax
    ("probs") or of the logits themselves, between the token's upsampled vector and its 4 cell
    anchors'; copied ⇔ the best is ≥ beta (near-ties within 1e-5 are not judged)."""
    from sparsevar.policies.sparsevar import nearest_source

    class Logits(Policy):
        name = "logits-probe"

        def __init__(self):
            self.logits = {}

        def after_scale(self, si, logits, run):
            self.logits[si] = logits.clone()

    probe, beta = Logits(), 0.9
    pipe.enable_sparsevar(tau=0.6, start_scale=-3, beta=beta, similarity=similarity).add_policy(probe)
    out, _ = _run(pipe, labels=(3,), seeds=(4,))
    sch, judged, copies = pipe.transformer.schedule, 0, 0
    for si, roles in out.stats[0].token_maps.items():
        (h, w), (hp, wp) = sch.hw[si], sch.hw[si - 1]
        prev = probe.logits[si - 1][0].double()                       # (h'·w', V), image 0
        vec = prev.softmax(-1) if similarity == "probs" else prev
        vec = torch.nn.functional.normalize(vec[nearest_source((hp, wp), (h, w))], dim=-1)   # (h·w, V)
        cands = anchor_candidates(h, w, 4)
        best = torch.stack([(vec * vec[cands[:, j]]).sum(-1) for j in range(4)], -1).amax(-1)
        roles = roles.view(-1)
        excluded = (roles == TOKEN_COPIED) | (roles == TOKEN_EXCLUDED)
        clear = excluded & ((best - beta).abs() > 1e-5)
        assert torch.equal(roles[clear] == TOKEN_COPIED, best[clear] >= beta), si
        judged, copies = judged + int(clear.sum()), copies + int((roles[clear] == TOKEN_COPIED).sum())
    assert judged > 0 and 0 < copies


def test_beta_one_turns_the_anchor_copy_off(pipe):
    """beta 1 copies nothing, not even tokens whose distribution equals their anchor's (whether a
    cosine of equal vectors reaches exactly 1 depends on rounding, which differs between a batch and
    its images)."""
    out, _ = _run(pipe.enable_sparsevar(tau=0.5, start_scale=-3, beta=1.0))
    maps = out.stats[0].token_maps
    assert maps and not any((m == TOKEN_COPIED).any() for m in maps.values())
    assert any((m == TOKEN_EXCLUDED).any() for m in maps.values())


def test_sparsevar_batch_with_different_token_counts_equals_its_images(pipe):
    pipe.enable_sparsevar(tau=0.5, start_scale=-3)
    batch, batch_codes = _run(pipe, labels=(3, 7), seeds=(1, 2))
    maps = batch.stats[0].token_maps
    counts = {si: [(m[b] >= TOKEN_KEPT).sum().item() for b in range(2)] for si, m in maps.items()}
    assert any(c[0] != c[1] for c in counts.values()), "the two images should keep different counts"
    for b, (label, seed) in enumerate(((3, 1), (7, 2))):
        alone, alone_codes = _run(pipe, labels=(label,), seeds=(seed,))
        _assert_same_codes([a[b:b + 1] for a in batch_codes], alone_codes, pipe.transformer.schedule.num_scales)
        torch.testing.assert_close(batch.images[b:b + 1], alone.images, atol=1e-5, rtol=0)


def test_fastvar_prunes_kv_per_layer_and_keeps_the_layer_range(pipe):
    probe = Probe()
    pipe.enable_fastvar(ratios=(0.5, 0.75), layer_range=(1, 1)).add_policy(probe)
    out, _ = _run(pipe, labels=(3,), seeds=(2,))
    sch = pipe.transformer.schedule
    dense_len = sch.total_tokens
    last, prev = sch.tokens(sch.num_scales - 1), sch.tokens(sch.num_scales - 2)
    kept = (prev - prev // 2) + (last - int(last * 0.75))
    assert probe.kv_lengths[sch.num_scales - 1] == [dense_len, dense_len - prev - last + kept]
    s = out.stats[0].scales
    assert s[-1].tokens_computed == pytest.approx((last + last - int(last * 0.75)) / 2)


def test_fastvar_wraps_the_sub_layers_only_where_it_works(pipe):
    """Before the cache scale the layers run the dense path, chained across sub-layer borders."""
    class WrapProbe(Policy):
        name = "wrap-probe"

        def __init__(self):
            self.wraps = {}

        def after_scale(self, si, logits, run):
            self.wraps[si] = bool(run.hooks["wrap_sublayer"])

    probe = WrapProbe()
    out, codes = _run(pipe.enable_fastvar(ratios=(0.5, 0.75)).add_policy(probe))
    S = pipe.transformer.schedule.num_scales
    assert probe.wraps == {si: si >= S - 3 for si in range(S)}           # cache scale, then the two pruned ones
    pipe.disable_fastvar().remove_policy("wrap-probe")
    _, dense_codes = _run(pipe)
    assert len(codes) == len(dense_codes) == S
    _assert_same_codes(codes[:S - 2], dense_codes[:S - 2], S - 2)


def test_which_scales_replay_from_which_graphs(pipe):
    """engine.graphs.capture_mode on the plans the real policies make (the graphs themselves are
    tested on the GPU): every SparseVAR scale with a fixed keep ratio replays whole with its hooks
    from the scale before the first pruned one on; FastVAR's cache and pruned scales too (fixed-size
    selections); a policy that says nothing about its hooks keeps its scales eager, and one that
    only observes gets the layer stack replayed. The probe acts only after the head (its own plan
    says so, static), which turns the scales no other policy touches from "whole" into "compute"."""
    from sparsevar.engine.graphs import capture_mode

    class ModeProbe(Policy):
        name = "mode-probe"

        def __init__(self):
            self.mode, self.part = {}, {}        # with whole-scale graphs, and for an adapter without them

        def plan_scale(self, si, run):
            return ScalePlan(hooks=frozenset({"after_scale"}), static=True)

        def after_scale(self, si, logits, run):
            self.mode[si] = capture_mode(run.plan, run.hooks, whole_scales=True)
            self.part[si] = capture_mode(run.plan, run.hooks, whole_scales=False)

    class Silent(Policy):                          # acts after every head, says nothing
        name = "silent"

        def post_residual(self, si, r, run):
            return r

    class Watcher(Policy):                         # observes every layer, says nothing
        name = "watcher"

        def observe(self, si, unit, x_in, x_out, run):
            pass

    S = pipe.transformer.schedule.num_scales
    probe = ModeProbe()
    _run(pipe.enable_sparsevar(keep_ratio=0.5, start_scale=-3).add_policy(probe))
    assert probe.mode == {si: "compute" if si < S - 4 else "whole with hooks" for si in range(S)}
    # without whole-scale graphs a subset (SparseVAR keep) replays its layer stack only
    assert probe.part == {si: "compute" if si < S - 4 else "layers" for si in range(S)}
    _run(pipe.disable_sparsevar().enable_fastvar(ratios=(0.5, 0.75)))
    assert probe.mode == {si: "compute" if si < S - 3 else "whole with hooks" for si in range(S)}
    # FastVAR prunes inside the layers and runs every token at the scale's level: its compute and
    # head replay with its hooks inside
    assert probe.part == {si: "compute" if si < S - 3 else "compute with hooks" for si in range(S)}
    _run(pipe.disable_fastvar().add_policy(Silent()))
    assert probe.mode == {si: "compute" for si in range(S)}         # no in-model hook: the compute replays
    _run(pipe.remove_policy("silent").add_policy(Watcher()))
    assert probe.mode == probe.part == {si: "layers" for si in range(S)}
    # SparVAR's static attention hooks: the whole scale with them, or (no whole-scale graphs) the
    # compute with them, its head inside the graph
    _run(pipe.remove_policy("watcher").enable_sparvar(decision_scale=-3))
    assert probe.mode == {si: "compute" if si < S - 3 else "whole with hooks" for si in range(S)}
    assert probe.part == {si: "compute" if si < S - 3 else "compute with hooks" for si in range(S)}
    pipe.disable_sparvar().add_policy(Watcher())
    out, _ = _run(pipe.remove_policy("watcher").enable_sparsevar(tau=0.5, start_scale=-3))
    pruned = [s.si for s in out.stats[0].scales if s.tokens_computed < s.tokens]
    assert pruned and all(probe.mode[si] is None for si in pruned)   # tau: the kept counts are read back, eager


def test_fastvar_layers_outside_its_range_run_chained(pipe, monkeypatch):
    """With a layer range, the layers FastVAR leaves alone run the chained dense path at its scales
    too; on the eager ops that is the same arithmetic as running them through the wrapper."""
    from sparsevar.policies.fastvar import FastVARPolicy

    class LayerProbe(Policy):
        name = "layer-probe"

        def __init__(self):
            self.wraps = {}

        def after_scale(self, si, logits, run):
            self.wraps[si] = [run.hooks.wraps(i) for i in range(run.info.num_layers)]

    probe = LayerProbe()
    pipe.enable_fastvar(ratios=(0.5, 0.75), layer_range=(1, 1)).add_policy(probe)
    out, codes = _run(pipe)
    S, N = pipe.transformer.schedule.num_scales, pipe.transformer.config.depth
    assert N >= 2 and all(probe.wraps[si] == [si >= S - 3 and i == 1 for i in range(N)] for si in range(S))
    plan = FastVARPolicy.plan_scale                  # the same plans, but wrapping every layer
    monkeypatch.setattr(FastVARPolicy, "plan_scale",
                        lambda self, si, run: dataclasses.replace(plan(self, si, run), layers=None))
    out_all, codes_all = _run(pipe)
    _assert_same_codes(codes, codes_all, S)
    torch.testing.assert_close(out.images, out_all.images, atol=0, rtol=0)


def test_fastvar_ratio_one_skips_the_final_scales(pipe):
    out, codes = _run(pipe.enable_fastvar(ratios=(0.5, 1.0)))
    assert [s.skipped for s in out.stats[0].scales][-2:] == [False, True] and len(codes) == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fastvar_keeps_its_cache_in_the_blocks_dtype(var_official_files, monkeypatch, dtype):
    """The cache scale's gated branch outputs are kept in the blocks' dtype — bf16 blocks: bf16, half
    the memory of the float32 residual stream — and the pruned scales restore from them."""
    from sparsevar.sparse_ops import ops as sparse_ops
    p = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"], dtype=dtype)
    p.set_progress_bar_config(disable=True)
    seen, real = [], sparse_ops.restore_residual

    def spy(x, idx, branch, gate, cache, *args, **kwargs):
        seen.append(cache.dtype)
        return real(x, idx, branch, gate, cache, *args, **kwargs)
    monkeypatch.setattr(sparse_ops, "restore_residual", spy)
    out, _ = _run(p.enable_fastvar())
    assert seen and set(seen) == {dtype}
    assert torch.isfinite(out.images).all()


def test_skip_last_decodes_the_latent_of_the_scales_run(pipe):
    latents = []
    pipe([3], generator=torch.Generator().manual_seed(0), output_type="latent",
         callback_on_step_end=lambda p, si, t, k: latents.append(k["latent"]),
         callback_on_step_end_tensor_inputs=["latent"])
    out = pipe.enable_scale_skip(skip_last=2)([3], generator=torch.Generator().manual_seed(0), output_type="latent")
    assert torch.equal(out.images, latents[-3])
    assert [s.skipped for s in out.stats[0].scales] == [False] * 8 + [True] * 2


def test_cond_only_drops_the_unconditional_rows(pipe):
    probe = Probe()
    pipe.enable_scale_skip(cond_only_from=-2).add_policy(probe)
    _run(pipe, labels=(3, 7))
    S = pipe.transformer.schedule.num_scales
    assert [probe.rows[si] for si in range(S)] == [4] * (S - 2) + [2] * 2


def test_stats_add_up(pipe):
    out, _ = _run(pipe.enable_sparsevar(keep_ratio=0.3))
    st = out.stats[0]
    assert st.tokens_computed == pytest.approx(sum(s.tokens_computed for s in st.scales))
    assert st.tokens == pipe.transformer.schedule.total_tokens
    assert len(st.scales) == pipe.transformer.schedule.num_scales
    assert all(s.tokens_computed <= s.tokens for s in st.scales)
    assert st.token_maps
    for si, m in st.token_maps.items():
        assert m.shape == (2, *pipe.transformer.schedule.hw[si])


# ---- composition and validation ----------------------------------------------------------------------
def test_composition_rules(pipe):
    pipe.enable_sparsevar()
    with pytest.raises(ValueError, match=r"disable_sparsevar\(\)"):
        pipe.enable_fastvar()
    pipe.enable_scale_skip(skip_last=1)                       # composes
    pipe.enable_sparsevar(tau=0.3)                            # re-enabling replaces the settings
    assert [p.name for p in pipe.policies] == ["scale_skip", "sparsevar"]
    assert pipe.policies.get("sparsevar").config.tau == 0.3
    pipe.disable_sparsevar().enable_fastvar()
    assert [p.name for p in pipe.policies] == ["scale_skip", "fastvar"]
    pipe.disable_fastvar().disable_scale_skip()
    assert len(pipe.policies) == 0


@pytest.mark.parametrize("call, match", [
    (lambda p: p.enable_sparsevar(tau=1.0), r"tau must be in \[0, 1\)"),
    (lambda p: p.enable_sparsevar(beta=1.5), r"beta must be in \[0, 1\]"),
    (lambda p: p.enable_sparsevar(similarity="cos"), r"similarity must be one of \('logits', 'probs'\), got 'cos'"),
    (lambda p: p.enable_sparsevar(alpha=0), r"alpha must be an int >= 1"),
    (lambda p: p.enable_sparsevar(keep_ratio=0.0), r"keep_ratio must be in \(0, 1\]"),
    (lambda p: p.enable_sparsevar(start_scale=10), r"start_scale=10 is past the schedule.*10 scales"),
    (lambda p: p.enable_sparsevar(start_scale=0), r"start_scale=0 is the first scale"),
    (lambda p: p.enable_sparsevar(block=5), r"block=5 is not a layer of this model: use 0..1"),
    (lambda p: p.enable_sparsevar(granularity="group"), r"no block groups"),
    (lambda p: p.enable_sparsevar(interpolation="cubic"), r"interpolation must be one of"),
    (lambda p: p.enable_sparsevar(tua=0.5), r"unknown SparseVARConfig setting.*tua"),
    (lambda p: p.enable_fastvar(ratios=(0.5, 1.2)), r"prune ratio must be in \[0, 1\]"),
    (lambda p: p.enable_fastvar(ratios=(1.0, 0.5)), r"1.0 \(skip the scale\) is allowed only on the final"),
    (lambda p: p.enable_fastvar(ratios=(0.1,) * 10), r"at most 9"),
    (lambda p: p.enable_fastvar(layer_range=(0, 7)), r"layer_range=\(0, 7\) is outside.*0..1"),
    (lambda p: p.enable_scale_skip(skip_last=10), r"skip_last=10 would skip every scale"),
    (lambda p: p.enable_scale_skip(skip_last=-1), r"skip_last must be an int >= 0"),
    (lambda p: p.enable_scale_skip(cond_only_from=12), r"cond_only_from=12 is past the schedule"),
])
def test_invalid_settings_name_the_value_and_the_range(pipe, call, match):
    with pytest.raises(ValueError, match=match):
        call(pipe)
    assert len(pipe.policies) == 0                             # nothing half-enabled


def test_config_objects_are_frozen_and_typed():
    cfg = SparseVARConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tau = 0.1
    assert FastVARConfig(ratios=[0.5, 0.75]).ratios == (0.5, 0.75)
    with pytest.raises(TypeError, match="SparseVARConfig"):
        VARPipeline.enable_sparsevar(object.__new__(VARPipeline), FastVARConfig())
