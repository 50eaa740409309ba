"""The staged sampler and the policy hooks (engine/, its contract in engine/contract.py) on the tiny fixture model,
plus the engine's building blocks: ScaleSchedule, KVCache, top-k/top-p sampling, GenerationStats."""
from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.engine import GenerationStats, KVCache, ScaleSchedule, ScaleStats, generate
from sparsevar.engine.sampling import filter_top_k_top_p, sample_codes, sample_codes_per_image
from sparsevar.engine.state import SamplingSettings
from sparsevar.policies import Policy, PolicyStack, ScalePlan


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def modules(var_official_files):
    p = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    return p.transformer, p.vqvae


@pytest.fixture
def pipe(modules) -> VARPipeline:
    """A fresh pipeline (empty policy stack) over the shared fixture modules."""
    p = VARPipeline(transformer=modules[0], vqvae=modules[1])
    p.set_progress_bar_config(disable=True)
    return p


def _run(pipe, labels, seed=0, **kw):
    """Output and a clone of every callback tensor, per scale."""
    steps = []

    def cb(p, si, t, d):
        steps.append({k: v.clone() for k, v in d.items()})
        return d

    kw.setdefault("output_type", "latent")
    out = pipe(labels, generator=_g(seed), callback_on_step_end=cb,
               callback_on_step_end_tensor_inputs=["codes", "logits", "latent"], **kw)
    return out, steps


# ---- a neutral policy overriding every hook -------------------------------------------------------------
class Recorder(Policy):
    name = "recorder"

    def __init__(self):
        self.calls: list[tuple] = []
        self.shapes: dict[str, list] = {}

    def _shape(self, hook, t):
        self.shapes.setdefault(hook, []).append(tuple(t.shape))

    def validate(self, info):
        assert info.family == "var" and info.num_layers >= 1 and info.schedule.num_scales >= 1
        self.calls.append(("validate", -1))

    def begin(self, run):
        self.calls.append(("begin", run.si))
        run.policy_state[self.name] = {"begun": True}

    def plan_scale(self, si, run):
        assert run.policy_state[self.name]["begun"]
        self.calls.append(("plan_scale", si))
        return None

    def wrap_sublayer(self, sub, x_RlC, run):
        self.calls.append(("wrap_sublayer", sub.ctx.si, sub.ctx.layer, sub.ctx.kind))
        return sub(x_RlC)

    def observe(self, si, unit, x_in, x_out, run):
        self.calls.append(("observe", si, unit))
        self._shape("observe", x_out)

    def attention(self, ctx, q, k, v, run):
        self.calls.append(("attention", ctx.si, ctx.layer, ctx.kind))
        self._shape("attention.q", q)
        self._shape("attention.k", k)
        return None

    def post_hidden(self, si, h_RLC, run):
        self.calls.append(("post_hidden", si))
        self._shape("post_hidden", h_RLC)
        return h_RLC

    def post_residual(self, si, residual_BLc, run):
        self.calls.append(("post_residual", si))
        self._shape("post_residual", residual_BLc)
        return residual_BLc

    def after_scale(self, si, guided_logits_BLV, run):
        self.calls.append(("after_scale", si))
        self._shape("after_scale", guided_logits_BLV)


def test_every_hook_is_called_at_every_scale_and_neutral_is_bit_exact(pipe):
    labels, B = [2, 7], 2
    dense = pipe(labels, generator=_g(4), output_type="pt").images
    rec = Recorder()
    pipe.add_policy(rec)
    out = pipe(labels, generator=_g(4), output_type="pt").images
    assert torch.equal(out, dense)                                  # neutral hooks change nothing

    sched, depth = pipe.transformer.schedule, pipe.transformer.config.depth
    cfg = pipe.transformer.config
    H, d = cfg.num_heads, cfg.embed_dim // cfg.num_heads
    S = sched.num_scales
    # validated once when added to the pipeline, then again (and begun) at the generation
    assert rec.calls[:3] == [("validate", -1), ("validate", -1), ("begin", -1)]
    per_scale = Counter((c[0], c[1]) for c in rec.calls[3:])
    for si in range(S):
        assert per_scale[("plan_scale", si)] == 1
        assert per_scale[("wrap_sublayer", si)] == 2 * depth
        assert per_scale[("observe", si)] == depth
        assert per_scale[("attention", si)] == depth
        assert per_scale[("post_hidden", si)] == 1
        assert per_scale[("post_residual", si)] == 1
        assert per_scale[("after_scale", si)] == 1
    assert sum(per_scale.values()) == S * (4 + 4 * depth)
    # order inside one layer: attention sub-layer (with its attention call), then the FFN, then observe
    scale3 = [c for c in rec.calls if len(c) > 1 and c[1] == 3]
    expected = [("plan_scale", 3)]
    for i in range(depth):
        expected += [("wrap_sublayer", 3, i, "self_attn"), ("attention", 3, i, "self_attn"),
                     ("wrap_sublayer", 3, i, "ffn"), ("observe", 3, ("layer", i))]
    expected += [("post_hidden", 3), ("post_residual", 3), ("after_scale", 3)]
    assert scale3 == expected
    # shapes: [cond; uncond] rows through the layers, the cache holds every earlier token
    C, V, c = cfg.embed_dim, cfg.vocab_size, cfg.z_channels
    for si in range(S):
        l = sched.tokens(si)
        assert rec.shapes["post_hidden"][si] == (2 * B, l, C)
        assert rec.shapes["post_residual"][si] == (B, l, c)
        assert rec.shapes["after_scale"][si] == (B, l, V)
        assert rec.shapes["attention.q"][si * depth] == (2 * B, H, l, d)
        assert rec.shapes["attention.k"][si * depth] == (2 * B, H, sched.offsets[si + 1], d)


# ---- plans -------------------------------------------------------------------------------------------------
class SkipFrom(Policy):
    name = "skip_from"

    def __init__(self, k):
        self.k, self.asked = k, []

    def plan_scale(self, si, run):
        self.asked.append(si)
        return ScalePlan(skip=True) if si >= self.k else None


@pytest.mark.parametrize("k", [1, 6])
def test_skip_decodes_the_latent_of_the_earlier_scales(pipe, k):
    _, dense_steps = _run(pipe, [5], seed=1)
    policy = SkipFrom(k)
    pipe.add_policy(policy)
    out, steps = _run(pipe, [5], seed=1, output_type="pt")
    assert len(steps) == k
    assert policy.asked == list(range(k + 1))                      # not consulted after the skip
    expected = (pipe.vqvae.fhat_to_img(dense_steps[k - 1]["latent"]) + 1) * 0.5
    torch.testing.assert_close(out.images, expected, atol=1e-6, rtol=0)
    stats = out.stats[0]
    S = pipe.num_timesteps
    assert [s.skipped for s in stats.scales] == [False] * k + [True] * (S - k)
    assert [s.tokens_computed for s in stats.scales[k:]] == [0] * (S - k)
    assert stats.tokens_computed == pipe.transformer.schedule.offsets[k]

    latent = pipe(5, generator=_g(1), output_type="latent").images
    assert torch.equal(latent, dense_steps[k - 1]["latent"])


class AllTokens(Policy):
    name = "all_tokens"

    def plan_scale(self, si, run):
        B, l = run.batch_size, run.schedule.tokens(si)
        return ScalePlan(token_index=torch.arange(l).expand(B, l))


@pytest.mark.parametrize("labels", [[3], [3, 8]], ids=["B1", "B2"])
def test_token_index_of_every_token_equals_dense(pipe, labels):
    dense, dense_steps = _run(pipe, labels, top_k=1)
    pipe.add_policy(AllTokens())
    out, steps = _run(pipe, labels, top_k=1)
    assert len(steps) == len(dense_steps) == pipe.num_timesteps
    for si, (a, b) in enumerate(zip(steps, dense_steps)):
        assert torch.equal(a["codes"], b["codes"]), f"scale {si}"
        torch.testing.assert_close(a["logits"], b["logits"], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.images, dense.images, atol=1e-5, rtol=0)
    assert out.stats[0].tokens_computed == pipe.transformer.schedule.total_tokens


class HalfFrom(Policy):
    """Runs every other token (even positions) from scale ``first`` on; checks what the engine keeps."""

    name = "half_from"

    def __init__(self, first, adapter):
        self.first, self.adapter = first, adapter
        self.kv_lengths, self.kept_inputs = [], []

    def index(self, si, run):
        l = run.schedule.tokens(si)
        return torch.arange(0, l, 2).expand(run.batch_size, -1)

    def plan_scale(self, si, run):
        return ScalePlan(token_index=self.index(si, run)) if si >= self.first else None

    def post_hidden(self, si, h_RLC, run):
        if si >= self.first:      # tokens that did not run keep their stage input
            x0 = self.adapter.stage_input(si, run)
            self.kept_inputs.append(torch.equal(h_RLC[:, 1::2], x0[:, 1::2]))
        return h_RLC

    def after_scale(self, si, guided, run):
        self.kv_lengths.append(list(run.workspace.kv.lengths))


def test_token_subset_fills_the_kv_cache_with_the_computed_tokens_only(pipe):
    sched, depth = pipe.transformer.schedule, pipe.transformer.config.depth
    first = 4
    policy = HalfFrom(first, pipe.adapter())
    pipe.add_policy(policy)
    out, steps = _run(pipe, [1, 9])
    computed = [sched.tokens(si) if si < first else (sched.tokens(si) + 1) // 2 for si in range(sched.num_scales)]
    filled = [sum(computed[: si + 1]) for si in range(sched.num_scales)]
    assert policy.kv_lengths == [[n] * depth for n in filled]
    assert filled[-1] < sched.total_tokens
    assert policy.kept_inputs and all(policy.kept_inputs)
    assert [s.tokens_computed for s in out.stats[0].scales] == computed
    assert out.stats[0].tokens_computed == filled[-1]
    # the full map is still sampled: one code per token at every scale
    assert [st["codes"].shape[1] for st in steps] == [sched.tokens(si) for si in range(sched.num_scales)]


class CondOnly(Policy):
    name = "cond_only"

    def __init__(self):
        self.rows = []

    def plan_scale(self, si, run):
        return ScalePlan(cond_only=True)

    def after_scale(self, si, guided, run):
        self.rows.append((run.rows, run.workspace.kv.rows))


def test_cond_only_from_the_start_equals_guidance_off(pipe):
    _, unguided = _run(pipe, [6, 0], guidance_scale=0.0, top_k=1)
    policy = CondOnly()
    pipe.add_policy(policy)
    _, steps = _run(pipe, [6, 0], guidance_scale=4.0, top_k=1)
    assert len(policy.rows) == pipe.num_timesteps
    assert all(rows == (2, 2) for rows in policy.rows)              # the uncond half is dropped
    assert len(steps) == len(unguided) == pipe.num_timesteps
    for si, (a, b) in enumerate(zip(steps, unguided)):
        assert torch.equal(a["codes"], b["codes"]), f"scale {si}"


# ---- the policy stack ----------------------------------------------------------------------------------------
class Named(Policy):
    def __init__(self, name, incompatible=()):
        self.name, self.incompatible = name, tuple(incompatible)


def test_same_policy_twice_is_refused_by_a_stack_and_replaced_by_the_pipeline(pipe):
    stack = PolicyStack([Named("sparsevar")])
    with pytest.raises(ValueError, match=r"sparsevar is already enabled"):
        stack.with_policy(Named("sparsevar"))
    first, second = Named("sparsevar"), Named("sparsevar")
    pipe.add_policy(first).add_policy(second)          # enabling again replaces the settings
    assert list(pipe.policies) == [second]


@pytest.mark.parametrize("first, second", [
    (Named("fastvar", incompatible=["sparsevar"]), Named("sparsevar")),
    (Named("fastvar"), Named("sparsevar", incompatible=["fastvar"])),
])
def test_incompatible_policies_are_refused_both_ways(pipe, first, second):
    pipe.add_policy(first)
    with pytest.raises(ValueError, match=r"sparsevar cannot be combined with fastvar: call disable_fastvar\(\) first"):
        pipe.add_policy(second)
    assert [p.name for p in pipe.policies] == ["fastvar"]           # the stack is unchanged
    pipe.remove_policy("fastvar").add_policy(second)
    assert [p.name for p in pipe.policies] == ["sparsevar"]


def test_policy_stack_bookkeeping():
    stack = PolicyStack([Named("a"), Recorder()])
    assert len(stack) == 2 and [p.name for p in stack] == ["a", "recorder"]
    assert stack.get("recorder").name == "recorder" and stack.get("zzz") is None
    assert stack.active["plan_scale"] == (stack.get("recorder"),)   # Named overrides no hook
    run = SimpleNamespace(policy_state={"recorder": {"begun": True}}, hooks=None)
    assert stack.plan_scale(0, run).dense
    # without a plan of its own, a policy acts through every hook it overrides, at every layer
    assert run.hooks["observe"] == run.hooks["wrap_sublayer"] == (stack.get("recorder"),)
    assert run.hooks.acts_in_model() and run.hooks.acts_after_head() and run.hooks.wraps(5) and run.hooks.tapped(5)
    assert not run.hooks.static                                     # and its in-layer hooks run eagerly
    PolicyStack([Named("a")]).plan_scale(0, run)
    assert not run.hooks.acts_in_model() and not run.hooks.acts_after_head() and run.hooks.static
    assert len(stack.without("recorder")) == 1 and len(stack) == 2  # without() returns a new stack


class SubsetA(AllTokens):
    name = "subset_a"


class SubsetB(AllTokens):
    name = "subset_b"


class WrapA(Policy):
    name = "wrap_a"

    def wrap_sublayer(self, sub, x, run):
        return sub(x)


class WrapB(WrapA):
    name = "wrap_b"


@pytest.mark.parametrize("policies, message", [
    ((SubsetA(), SubsetB()), r"two policies chose a token subset at scale 0.*subset_a"),
    ((WrapA(), WrapB()), r"two policies wrap the same sub-layers.*wrap_a"),
])
def test_conflicting_policies_fail_the_call_and_leave_the_pipeline_usable(pipe, policies, message):
    for p in policies:
        pipe.add_policy(p)
    with pytest.raises(ValueError, match=message):
        pipe(1, generator=_g(0), output_type="latent")
    for p in policies:
        pipe.remove_policy(p.name)
    assert len(pipe.policies) == 0
    out = pipe(1, generator=_g(0), output_type="latent")
    assert not any(s.skipped for s in out.stats[0].scales)


# ---- engine.generate directly ------------------------------------------------------------------------------
def test_generate_without_decode(pipe):
    adapter = pipe.adapter()
    res = generate(adapter, torch.tensor([4]), 1, settings=SamplingSettings(guidance_scale=4.0, top_k=1, top_p=0.95), generator=_g(0), decode=False)
    assert res.images is None
    ref = pipe(4, top_k=1, generator=_g(0), output_type="latent").images
    assert torch.equal(res.latent, ref)
    again = generate(adapter, torch.tensor([7]), 1, settings=SamplingSettings(guidance_scale=4.0, top_k=1, top_p=0.95), generator=_g(0), decode=False)
    assert torch.equal(res.latent, ref)          # a copy: the reused workspace does not overwrite it
    assert not torch.equal(again.latent, ref)


# ---- ScaleSchedule ------------------------------------------------------------------------------------------------
def test_scale_schedule_offsets_and_indexing():
    s = ScaleSchedule.square([1, 2, 4])
    assert s.hw == ((1, 1), (2, 2), (4, 4))
    assert s.offsets == (0, 1, 5, 21) and s.total_tokens == 21
    assert [s.tokens(i) for i in range(3)] == [1, 4, 16]
    assert len(s) == s.num_scales == 3 and s.latent_hw == (4, 4)
    assert [s.from_end(si) for si in range(3)] == [2, 1, 0]
    assert [s.index_from_end(k) for k in range(3)] == [2, 1, 0]
    assert all(s.index_from_end(s.from_end(si)) == si for si in range(3))
    assert str(s) == "1,2,4"


def test_scale_schedule_non_square():
    s = ScaleSchedule.from_any([(1, 2), (2, 3), (3, 5)])
    assert s.offsets == (0, 2, 8, 23) and s.latent_hw == (3, 5)
    assert str(s) == "1x2,2x3,3x5"
    assert ScaleSchedule.from_any([1, 2]) == ScaleSchedule.square([1, 2])
    assert ScaleSchedule.from_any(s) is s


@pytest.mark.parametrize("k", [3, -1, 10])
def test_scale_schedule_index_from_end_out_of_range(k):
    with pytest.raises(ValueError, match=rf"scale {k} from the end does not exist: this schedule has 3 scales"):
        ScaleSchedule.square([1, 2, 3]).index_from_end(k)


def test_scale_schedule_invalid():
    with pytest.raises(ValueError, match=r"at least one scale"):
        ScaleSchedule(())
    with pytest.raises(ValueError, match=r"must be positive.*0"):
        ScaleSchedule.square([1, 0, 2])


# ---- KVCache ---------------------------------------------------------------------------------------------------
def test_kv_cache_transient_tail_holds_the_last_scale_of_one_layer_at_a_time():
    """Per-layer buffers sized for all but the last scale; the last scale of each layer goes
    through the shared tail, with that layer's earlier keys, positions and validity moved along."""
    kv = KVCache(num_layers=2, rows=2, heads=1, head_dim=2, capacity=3, dtype=torch.float32, device="cpu",
                 transient=4)
    assert kv.k_NRHTd.shape[3] == 3 and kv.tail_k_RHTd.shape[2] == 7
    first = [torch.randn(2, 1, 3, 2) for _ in range(2)]
    for layer in range(2):
        kv.append(layer, first[layer], first[layer], torch.tensor([0, 1, 2]))
    kv.record_positions(3, torch.tensor([3, 4, 5, 6]))               # a dense last scale, every layer
    for layer in range(2):
        last = torch.randn(2, 1, 4, 2)
        valid = torch.tensor([[True, True, False, True], [True, True, True, True]])
        k, v = kv.append(layer, last, -last, valid_Rn=valid)
        assert torch.equal(k, torch.cat((first[layer], last), dim=2)) and torch.equal(v[:, :, 3:], -last)
        assert kv.key_mask(layer)[:, 0, 0].tolist() == [[True] * 5 + [False, True], [True] * 7]
        assert kv.tail_pos_RT[0].tolist() == list(range(7))
    assert kv.lengths == [7, 7]
    with pytest.raises(AssertionError, match="layer 0's last-scale keys were overwritten by layer 1"):
        kv.view(0)
    with pytest.raises(AssertionError, match="overflow"):
        kv.append(1, torch.randn(2, 1, 1, 2), torch.randn(2, 1, 1, 2))
    kv.reset()
    assert kv.tail_owner is None and kv.key_mask(0) is None


def test_kv_cache_tail_with_layers_out_of_step_and_cond_only_rows():
    """FastVAR prunes per layer, so layers reach the last scale with different fill lengths: a layer
    whose last-scale write still fits stays in its own buffer, one that runs past goes to the tail;
    after keep_rows (cond-only) only the kept rows move."""
    kv = KVCache(num_layers=2, rows=4, heads=1, head_dim=2, capacity=5, dtype=torch.float32, device="cpu",
                 transient=4)
    a0, a1 = torch.randn(4, 1, 2, 2), torch.randn(4, 1, 4, 2)
    kv.append(0, a0, a0, torch.tensor([0, 1]))                       # layer 0 kept 2 tokens
    kv.append(1, a1, a1, torch.tensor([0, 1, 2, 3]))                 # layer 1 kept 4
    kv.keep_rows(2)                                                  # cond-only from here on
    b0, b1 = torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2)
    k0, _ = kv.append(0, b0, b0, torch.tensor([4, 5, 6]))            # 2 + 3 = 5: fits, own buffer
    assert kv.tail_owner is None and torch.equal(k0, torch.cat((a0[:2], b0), dim=2))
    k1, _ = kv.append(1, b1, b1, torch.tensor([4, 5, 6]))            # 4 + 3 = 7 > 5: the tail
    assert kv.tail_owner == 1 and k1.shape == (2, 1, 7, 2)
    assert torch.equal(k1, torch.cat((a1[:2], b1), dim=2))
    assert kv.tail_pos_RT[:2, :7].tolist() == [[0, 1, 2, 3, 4, 5, 6]] * 2
    assert torch.equal(kv.view(0)[0], k0)                            # layer 0 still reads its own buffer


def test_kv_cache_lent_slots_are_a_layers_last_scale_untouched_until_it_writes_it_and_kept_across_a_warm_up():
    """``lend``: views of the first slots of a layer's last scale, which earlier scales (pruned or
    not) never write; None where a tail holds the last scale, where layers have their own
    capacities, or past the last scale's size. While ``keep_undo`` records (a capture's warm-up),
    the layer's last-scale write keeps the lent contents, and ``undo`` puts them back."""
    kv = KVCache.for_schedule(3, 2, 1, 2, [1, 4, 9], torch.float32, "cpu")
    assert kv.last_scale == (5, 9)
    k_lent, v_lent = kv.lend(2, 6)
    assert k_lent.shape == v_lent.shape == (2, 1, 6, 2)
    assert k_lent.data_ptr() == kv.k_NRHTd[2, :, :, 5:].data_ptr() and v_lent.data_ptr() == kv.v_NRHTd[2, :, :, 5:].data_ptr()
    k_lent.fill_(7.0)
    v_lent.fill_(-7.0)
    for layer in range(3):                                    # the first two scales, one layer pruned
        n = 5 if layer != 1 else 3
        kv.append(layer, torch.zeros(2, 1, n, 2), torch.zeros(2, 1, n, 2))
    assert (k_lent == 7.0).all() and (v_lent == -7.0).all()
    kv.keep_undo()                                            # a warm-up of the last scale, then undo
    kv.append(2, torch.ones(2, 1, 9, 2), torch.ones(2, 1, 9, 2))
    assert (k_lent == 1.0).all()
    kv.undo()
    kv.lengths[2] = 5
    assert (k_lent == 7.0).all() and (v_lent == -7.0).all()
    kv.append(2, torch.ones(2, 1, 9, 2), 2 * torch.ones(2, 1, 9, 2))   # the run itself overwrites them
    assert (k_lent == 1.0).all() and (v_lent == 2.0).all()
    assert kv.lend(0, 10) is None
    tailed = KVCache.for_schedule(3, 2, 1, 2, [1, 4, 9], torch.float32, "cpu", tail=True)
    assert tailed.last_scale is None and tailed.lend(2, 1) is None
    compressed = KVCache.for_schedule(3, 2, 1, 2, [1, 4, 9], torch.float32, "cpu",
                                      slots=[[1, 5, 14], [1, 3, 12], [1, 5, 14]])
    assert compressed.lend(2, 1) is None


def test_kv_cache_append_and_keep_rows():
    kv = KVCache(num_layers=2, rows=4, heads=2, head_dim=3, capacity=10, dtype=torch.float32, device="cpu")
    k1, v1 = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    k, v = kv.append(0, k1, v1, torch.tensor([0, 1, 2]))
    assert torch.equal(k, k1) and torch.equal(v, v1)
    k2, v2 = torch.randn(4, 2, 2, 3), torch.randn(4, 2, 2, 3)
    k, v = kv.append(0, k2, v2, torch.tensor([7, 9]))
    assert torch.equal(k, torch.cat((k1, k2), dim=2)) and torch.equal(v, torch.cat((v1, v2), dim=2))
    assert kv.lengths == [5, 0]                                     # each layer has its own fill
    assert kv.pos_NRT[0, :, :5].tolist() == [[0, 1, 2, 7, 9]] * 4       # recorded for every row
    assert kv.key_mask(0) is None                                   # no padding, no mask
    assert kv.view(1)[0].shape == (4, 2, 0, 3)
    ptr = kv.k_NRHTd.data_ptr()

    kv.keep_rows(2)                                                  # drop the uncond half
    k3 = torch.randn(2, 2, 1, 3)
    k, v = kv.append(0, k3, k3)
    assert k.shape == (2, 2, 6, 3)
    assert torch.equal(k[:, :, :5], torch.cat((k1, k2), dim=2)[:2]) and torch.equal(k[:, :, 5:], k3)
    with pytest.raises(ValueError, match=r"cannot keep 3 of 2 cache rows"):
        kv.keep_rows(3)
    with pytest.raises(ValueError, match=r"cannot keep 0 of 2 cache rows"):
        kv.keep_rows(0)

    # a padded write: row 1 holds one padding slot, masked out of attention from then on
    kv.append(1, torch.randn(2, 2, 2, 3), torch.randn(2, 2, 2, 3), torch.tensor([[3, 4], [3, 3]]),
              torch.tensor([[True, True], [True, False]]))
    assert kv.masked and kv.key_mask(1)[:, 0, 0].tolist() == [[True, True], [True, False]]
    assert kv.key_mask(0)[:, 0, 0].all()                           # other layers: everything valid

    kv.reset()
    assert kv.lengths == [0, 0] and kv.rows == 4 and not kv.masked
    assert kv.k_NRHTd.data_ptr() == ptr                              # buffers keep their address
    assert kv.nbytes() == 2 * (2 * 4 * 2 * 10 * 3 * 4) + 2 * 4 * 10 * 8      # k, v (fp32) + positions per row (int64)


# ---- sampling -----------------------------------------------------------------------------------------------------
def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    before = logits.clone()
    out = filter_top_k_top_p(logits, top_k=2)
    assert torch.isfinite(out).tolist() == [[False, True, True, True, False]]
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])
    assert torch.equal(logits, before)                                # the input is not modified
    assert torch.equal(filter_top_k_top_p(logits, top_k=0), logits)
    assert torch.equal(filter_top_k_top_p(logits, top_k=5), logits)


def test_top_p_semantics():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    logits = probs.log()
    # ascending cumulative mass 0.2, 0.5, 1.0: entries with cum <= 1 - top_p are removed
    assert torch.isfinite(filter_top_k_top_p(logits, top_p=0.7)).tolist() == [[True, True, False]]
    assert torch.isfinite(filter_top_k_top_p(logits, top_p=0.45)).tolist() == [[True, False, False]]
    assert torch.isfinite(filter_top_k_top_p(logits, top_p=1.0)).all()


@pytest.mark.parametrize("top_p", [1e-6, 0.01])
def test_top_p_always_keeps_the_largest_entry(top_p):
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [0.0, 0.0, 0.0, 0.0]])
    finite = torch.isfinite(filter_top_k_top_p(logits, top_p=top_p))
    assert finite.sum(dim=-1).tolist() == [1, 1]
    assert finite[0, 1]


@pytest.mark.parametrize("top_k, top_p", [(0, 0.97), (1, 0.0), (1, 0.97), (900, 0.97), (2, 0.6), (0, 0.3), (900, 0.0)])
def test_two_way_logits_take_the_closed_form_with_the_sorted_paths_result(top_k, top_p):
    """Infinity's bit logits (rows of two) skip the sort and cumsum; the kept entries are those of
    the sorted path, ties and near-ties at the nucleus boundary included."""
    from sparsevar.sparse_ops.ref import _filter_sorted

    g = _g(11)
    logits = torch.randn(4000, 2, generator=g) * 3
    logits[:50, 1] = logits[:50, 0]                                   # exact ties
    p_small = torch.tensor([0.03, 0.4, 0.5 - 1e-7])                  # the small entry at a few masses
    logits[50:53, 0] = 0.0
    logits[50:53, 1] = (1 - p_small).log() - p_small.log()
    logits[60] = torch.tensor([float("-inf"), 2.0])
    fast = filter_top_k_top_p(logits, top_k, top_p)
    slow = _filter_sorted(logits, top_k, top_p)
    assert torch.equal(torch.isfinite(fast), torch.isfinite(slow))
    assert torch.equal(fast[torch.isfinite(fast)], slow[torch.isfinite(slow)])
    assert torch.isfinite(fast).any(-1).all()                        # the larger entry always survives


def test_draw_one_is_torch_multinomial_for_one_sample():
    from sparsevar.engine.sampling import draw_one

    probs = torch.softmax(torch.randn(500, 37, generator=_g(2)) * 2, dim=-1)
    probs[:7, 3:] = 0.0                                              # rows with zero-probability entries
    probs[:7] /= probs[:7].sum(-1, keepdim=True)
    want = torch.multinomial(probs, 1, replacement=True, generator=_g(5))[:, 0]
    assert torch.equal(draw_one(probs, _g(5)), want)
    assert (draw_one(probs, _g(6))[:7] < 3).all()


def test_sample_codes_is_reproducible_and_respects_the_filters():
    logits = torch.randn(2, 50, 40, generator=_g(0))
    a = sample_codes(logits, 0, 0.0, _g(3))
    b = sample_codes(logits, 0, 0.0, _g(3))
    c = sample_codes(logits, 0, 0.0, _g(4))
    assert a.shape == (2, 50) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(sample_codes(logits, 1, 0.0, _g(5)), logits.argmax(-1))     # top_k=1 is greedy
    top3 = logits.topk(3, dim=-1).indices
    drawn = sample_codes(logits, 3, 0.0, _g(6))
    assert (drawn.unsqueeze(-1) == top3).any(-1).all()              # never outside the top 3


def test_sample_codes_per_image_uses_one_generator_per_image():
    logits = torch.randn(3, 20, 30, generator=_g(1))
    batch = sample_codes_per_image(logits, 10, 0.9, [_g(7), _g(8), _g(9)])
    for b, seed in enumerate((7, 8, 9)):
        assert torch.equal(batch[b:b + 1], sample_codes(logits[b:b + 1], 10, 0.9, _g(seed)))
    assert torch.equal(sample_codes_per_image(logits, 10, 0.9, _g(7)), sample_codes(logits, 10, 0.9, _g(7)))


def test_noise_drawn_beforehand_gives_the_same_codes_and_is_refused_where_it_cannot():
    """The whole-scale CUDA graphs draw the sampler's Exp(1) noise before the replay into a buffer:
    one ``exponential_`` of the sampler's shape from the same generator must give the same codes."""
    from sparsevar.engine.sampling import takes_drawn_noise

    logits = torch.randn(2, 50, 40, generator=_g(0))
    noise = torch.empty(100, 40).exponential_(generator=_g(3))
    for top_k, top_p in ((0, 0.0), (10, 0.9), (1, 0.0)):
        want = sample_codes_per_image(logits, top_k, top_p, _g(3))
        assert torch.equal(sample_codes_per_image(logits, top_k, top_p, _g(3), noise_NV=noise), want)
    assert takes_drawn_noise(_g(3), torch.device("cpu")) and takes_drawn_noise(None, torch.device("cpu"))
    assert not takes_drawn_noise([_g(1), _g(2)], torch.device("cpu"))
    with pytest.raises(ValueError, match="noise_NV.*one generator, not a list"):
        sample_codes_per_image(logits, 10, 0.9, [_g(1), _g(2)], noise_NV=noise)
    with pytest.raises(ValueError, match=r"noise_NV has shape \(1, 40\); it must be \(B·l, V\) = \(100, 40\)"):
        sample_codes(logits, 10, 0.9, _g(3), noise_NV=noise[:1])    # would broadcast silently


# The inverse-CDF branch of sample_codes (generator on another device than the logits) needs a
# second device; it cannot be reached on a CPU-only machine, so it is not tested here.


# ---- GenerationStats ------------------------------------------------------------------------------------------------
def test_generation_stats_arithmetic():
    st = GenerationStats(scales=[ScaleStats(0, 1, 1, 1, 1, ms=1.0), ScaleStats(1, 2, 2, 4, 2, ms=2.5),
                                 ScaleStats(2, 4, 4, 16, 0, skipped=True)], decode_ms=4.0)
    assert st.tokens == 21 and st.tokens_computed == 3 and st.transformer_ms == 3.5
    assert st.scales[1].kept_ratio == 0.5
    assert st.summary() == "2/3 scales, 3/21 tokens computed per image (14%), scale loop 3.5 ms, decode 4.0 ms"
    lines = st.table().splitlines()
    assert len(lines) == 4 and "skipped" in lines[3] and "50%" in lines[2]
    d = st.as_dict()
    assert d["tokens_computed"] == sum(s["tokens_computed"] for s in d["scales"]) == 3
    assert d["tokens"] == 21 and d["transformer_ms"] == 3.5 and d["decode_ms"] == 4.0


def test_generation_stats_print_counts_as_integers_unless_fractional():
    """Counts are per image, means over images (or layers) where those differ: a whole mean prints
    as an integer ("404", not "404.0"), a fractional one with one decimal."""
    whole = GenerationStats(scales=[ScaleStats(0, 16, 16, 256, 128.0, ms=1.0), ScaleStats(1, 20, 20, 400, 276.0, ms=1.0)])
    assert whole.summary() == "2/2 scales, 404/656 tokens computed per image (62%), scale loop 2.0 ms"
    assert [line.split()[3] for line in whole.table().splitlines()[1:]] == ["128", "276"]
    mean = GenerationStats(scales=[ScaleStats(0, 16, 16, 256, 85.0625, ms=1.0)])   # a mean: 1361 tokens over 16 images
    assert mean.summary().startswith("1/1 scales, 85.1/256 tokens computed per image (33%)")
    assert mean.table().splitlines()[1].split()[3] == "85.1"


class SlowPlan(Policy):
    """Spends ``sec`` in its plan at scale ``si`` (host time: the CPU timer measures it)."""
    name = "slow_plan"

    def __init__(self, si, sec):
        self.si, self.sec = si, sec

    def plan_scale(self, si, run):
        if si == self.si:
            time.sleep(self.sec)
        return None


def test_a_scale_time_includes_the_policies_plan(pipe):
    """The plan's work (e.g. SparseVAR's selection and anchor matching) belongs to its scale: a
    speed-up must not leave it out of the scale loop's time."""
    pipe.add_policy(SlowPlan(3, 0.05)).add_policy(SkipFrom(8))
    st = pipe([2], generator=_g(0), output_type="latent").stats[0]
    s3 = st.scales[3]
    assert s3.policy_ms >= 50 and s3.ms >= s3.policy_ms           # slept 50 ms: a lower bound, not a timing
    assert len(st.scales) == pipe.num_timesteps == 10
    assert all(s.ms >= s.policy_ms >= 0 for s in st.scales[:8])  # every scale's time holds its policies' part
    assert all(s.ms != s.ms for s in st.scales[8:])            # skipped: no time (NaN)
    assert st.transformer_ms == pytest.approx(sum(s.ms for s in st.scales[:8]))


def test_generation_stats_of_a_real_run_add_up(pipe):
    pipe.add_policy(HalfFrom(5, pipe.adapter())).add_policy(SkipFrom(8))
    out = pipe([2], generator=_g(0), output_type="pt")
    st = out.stats[0]
    sched = pipe.transformer.schedule
    assert st.tokens == sched.total_tokens
    assert st.tokens_computed == sum(s.tokens_computed for s in st.scales)
    assert st.tokens_computed == sched.offsets[5] + sum((sched.tokens(si) + 1) // 2 for si in (5, 6, 7))
    ran = [s for s in st.scales if not s.skipped]
    assert len(ran) == 8 and all(s.ms > 0 for s in ran)
    assert st.transformer_ms == pytest.approx(sum(s.ms for s in ran))
    assert st.decode_ms > 0
    assert st.summary().startswith(f"8/{sched.num_scales} scales, {st.tokens_computed}/{st.tokens} tokens")
    d = st.as_dict()
    assert d["tokens_computed"] == sum(s["tokens_computed"] for s in d["scales"]) == st.tokens_computed
    assert len(st.table().splitlines()) == 1 + sched.num_scales
    assert sum("skipped" in line for line in st.table().splitlines()) == 2


def _tiny_of(family):
    """(make a tiny random pipeline of ``family``, one seeded generation → its latent)."""
    from sparsevar import FlexVARPipeline, HARTPipeline, InfinityPipeline
    if family == "hart":
        return (lambda: HARTPipeline.from_random("hart-tiny", seed=0)), \
            lambda p: p(["w3 w4 w5", "w6"], generator=[torch.Generator().manual_seed(k) for k in (0, 1)],
                        output_type="latent", guidance_scale=2.0, top_k=1).images
    if family == "infinity":
        return (lambda: InfinityPipeline.from_random("infinity-tiny", seed=0)), \
            lambda p: p(["w3 w4 w5", "w6"], height=256, width=256, generator=torch.Generator().manual_seed(0),
                        output_type="latent", guidance_scale=2.0, top_k=1).images
    make = (lambda: VARPipeline.from_random("var-tiny", seed=0)) if family == "var" else \
        (lambda: FlexVARPipeline.from_random("flexvar-tiny", seed=0))
    return make, lambda p: p([1, 2], generator=torch.Generator().manual_seed(0), output_type="latent",
                             guidance_scale=2.0, top_k=1).images


@pytest.mark.parametrize("family", ["var", "flexvar", "infinity", "hart"])
def test_weights_changed_in_place_are_used_by_the_next_call(family):
    """The workspace holds what depends on the weights alone (positions, qkv biases, q/k multipliers,
    Infinity's per-block AdaLN offsets) and is kept between calls; weights loaded in place (same
    storage, new version) must still reach the next generation: it equals a fresh pipeline's with
    those weights, not the old one's. (HART: qkv biases and level embeddings.)"""
    make, run = _tiny_of(family)
    pipe, fresh = make(), make()
    for p in (pipe, fresh):
        p.set_progress_bar_config(disable=True)
    before = run(pipe)
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
               for k, v in pipe.transformer.state_dict().items()
               if "bias" in k or "scale_mul" in k or "pos" in k or "ada_gss" in k or "lvl_embed" in k}
    assert changed
    pipe.transformer.load_state_dict(changed, strict=False)              # in place: the same storage
    fresh.transformer.load_state_dict(changed, strict=False)
    after, want = run(pipe), run(fresh)
    assert not torch.equal(after, before) and torch.equal(after, want)


@pytest.mark.parametrize("family", ["var", "infinity"])
def test_a_model_made_under_inference_mode_still_sees_weights_changed_in_place(family):
    """ComfyUI loads models under ``torch.inference_mode``: such parameters keep no version counter,
    so the weight constants are recomputed at every call instead, and an in-place change still
    reaches the next generation."""
    make, run = _tiny_of(family)
    with torch.inference_mode():
        pipe, fresh = make(), make()
        pipe.set_progress_bar_config(disable=True)
        fresh.set_progress_bar_config(disable=True)
        assert pipe.transformer.weights_key()[1] is False
        before = run(pipe)
        for p in (pipe, fresh):
            blk = p.transformer.blocks[0]
            (blk.attn.q_bias if family == "var" else blk.sa.q_bias).add_(0.5)
            if family == "infinity":
                blk.ada_gss.add_(0.5)
        after, want = run(pipe), run(fresh)
    assert not torch.equal(after, before) and torch.equal(after, want)
