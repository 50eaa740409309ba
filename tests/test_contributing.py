"""CONTRIBUTING.md's example policy, written only against the public hooks: it is exact at its neutral
setting, zeroes the tokens its rule names, composes with the shipped policies, and (GPU) replays
under CUDA graphs without declaring anything about capture."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.policies import Policy


# ---- the example of CONTRIBUTING.md ("Writing a policy"), verbatim ------------------------------------
class QuietTokens(Policy):
    """At the last ``last`` scales, zero the residual of every token that layer ``layer`` changed by
    less than ``threshold`` × the image's largest change (mean squared change of its hidden state,
    averaged over the CFG halves; a token the layer did not run changed by 0). 0 is neutral."""

    name = "quiet_tokens"

    def __init__(self, threshold: float, layer: int = 1, last: int = 2):
        self.threshold, self.layer, self.last = threshold, layer, last

    def validate(self, info):
        if not 0 <= self.layer < info.num_layers:
            raise ValueError(f"layer={self.layer} is not a layer of this model: use 0..{info.num_layers - 1}")

    def begin(self, run):
        run.policy_state[self.name] = {"change": None}

    def observe(self, si, unit, x_in, x_out, run):
        if unit != ("layer", self.layer) or run.schedule.from_end(si) >= self.last:
            return
        B, L = run.batch_size, run.schedule.tokens(si)
        change_Rn = (x_out - x_in).square().mean(-1)                   # the tokens the layer ran
        change_Bn = change_Rn.view(-1, B, change_Rn.shape[1]).mean(0)  # (R, n) → (halves, B, n) → (B, n)
        idx_Bn = run.plan.token_index
        if idx_Bn is not None:                                         # a subset ran: place it in the map
            change_Bn = change_Bn.new_zeros(B, L).scatter_(1, idx_Bn.to(change_Bn.device), change_Bn)
        run.policy_state[self.name]["change"] = change_Bn

    def post_residual(self, si, residual_BLc, run):
        if run.schedule.from_end(si) >= self.last:
            return residual_BLc
        change_BL = run.policy_state[self.name]["change"]
        quiet_BL = change_BL < self.threshold * change_BL.amax(dim=1, keepdim=True)
        return residual_BLc.masked_fill(quiet_BL.unsqueeze(-1), 0.0)
# ---- end of the example ------------------------------------------------------------------------------


class Recorder(Policy):
    """Records one layer's taps with the token subset that ran, and the residual handed on to the
    policies after it in the stack."""

    def __init__(self, name: str, layer: int):
        self.name, self.layer, self.taps, self.residual = name, layer, {}, {}

    def observe(self, si, unit, x_in, x_out, run):
        if unit == ("layer", self.layer):
            idx = run.plan.token_index
            self.taps[si] = (x_in.clone(), x_out.clone(), None if idx is None else idx.clone())

    def post_residual(self, si, residual_BLc, run):
        self.residual[si] = residual_BLc.clone()
        return residual_BLc


@pytest.fixture
def pipe(var_official_files):
    p = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    p.set_progress_bar_config(disable=True)
    return p


def _run(pipe, labels=(3, 7), seeds=(1, 2)):
    codes = []
    out = pipe(list(labels), generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt",
               top_k=5, top_p=0.0, callback_on_step_end=lambda p, si, t, k: codes.append(k["codes"]))
    return out, codes


def _assert_same_run(a, b, scales: int):
    (out_a, codes_a), (out_b, codes_b) = a, b
    assert len(codes_a) == len(codes_b) == scales > 0, (len(codes_a), len(codes_b), scales)
    for si, (x, y) in enumerate(zip(codes_a, codes_b)):
        assert torch.equal(x, y), f"codes differ at scale {si}"
    assert torch.equal(out_a.images, out_b.images)


def _with_recorders(pipe, quiet: QuietTokens):
    before, after = Recorder("before", quiet.layer), Recorder("after", quiet.layer)
    pipe.add_policy(before).add_policy(quiet).add_policy(after)
    return before, after


def _check_zeroed(before: Recorder, after: Recorder, quiet: QuietTokens, pipe, batch: int) -> int:
    """The residual the example hands on equals the one it got, except on the tokens its rule names,
    which are zero; the rule is evaluated here from the recorded taps in float64 (tokens within
    1e-4 of the threshold are not judged). Returns how many tokens it zeroed."""
    sch, zeroed = pipe.transformer.schedule, 0
    assert before.residual and before.residual.keys() == after.residual.keys()
    for si, got in before.residual.items():
        out = after.residual[si]
        if sch.from_end(si) >= quiet.last:
            assert torch.equal(out, got), f"scale {si} is not one of the last {quiet.last} but was changed"
            continue
        x_in, x_out, idx = before.taps[si]
        per_row = (x_out.double() - x_in.double()).pow(2).mean(-1)                  # (R, n)
        halves = per_row.shape[0] // batch
        per_image = sum(per_row[k * batch:(k + 1) * batch] for k in range(halves)) / halves
        change = per_image if idx is None else torch.zeros(batch, sch.tokens(si), dtype=torch.float64).scatter(
            1, idx, per_image)
        bound = quiet.threshold * change.amax(dim=1, keepdim=True)
        quiet_BL = change < bound
        judged = (change - bound).abs() > 1e-4 * bound
        touched = ~(out == got).all(-1)
        assert (out[touched] == 0).all(), f"scale {si}: a changed residual is not zero"
        was_zero = (got == 0).all(-1)
        assert torch.equal((touched | was_zero)[judged], (quiet_BL | was_zero)[judged]), f"scale {si}"
        if idx is not None:                                                         # tokens not run: zero
            ran = torch.zeros_like(quiet_BL).scatter(1, idx, True)
            assert (out[~ran] == 0).all(), f"scale {si}"
        zeroed += int(touched.sum())
        assert int(touched.sum()) < touched.numel(), f"scale {si}: every token was zeroed"
    return zeroed


# ---- CPU ------------------------------------------------------------------------------------------------
def test_the_example_is_the_documents_and_declares_nothing_about_capture():
    doc = (Path(__file__).resolve().parents[1] / "CONTRIBUTING.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 1 and inspect.getsource(QuietTokens).strip() in blocks[0]
    assert "from sparsevar.policies import Policy" in blocks[0]
    assert QuietTokens.plan_scale is Policy.plan_scale          # no plan: every hook it overrides acts


def test_neutral_setting_is_dense_bit_for_bit(pipe):
    dense = _run(pipe)
    before, after = _with_recorders(pipe, QuietTokens(threshold=0.0))
    _assert_same_run(_run(pipe), dense, pipe.transformer.schedule.num_scales)
    assert before.taps and all(torch.equal(after.residual[si], r) for si, r in before.residual.items())


def test_layer_out_of_range_names_the_setting(pipe):
    with pytest.raises(ValueError, match=r"layer=9 is not a layer of this model: use 0\.\.1"):
        pipe.add_policy(QuietTokens(threshold=0.5, layer=9))
    assert len(pipe.policies) == 0


def test_it_zeroes_the_quiet_tokens_after_sampling_and_changes_the_image(pipe):
    dense_out, dense_codes = _run(pipe)
    quiet = QuietTokens(threshold=0.5)
    before, after = _with_recorders(pipe, quiet)
    out, codes = _run(pipe)
    assert _check_zeroed(before, after, quiet, pipe, batch=2) > 0
    S = pipe.transformer.schedule.num_scales
    # it edits a scale's residual after that scale's codes were drawn: codes up to the first scale it
    # acts on are dense's; the image is not
    assert len(codes) == S and all(torch.equal(codes[si], dense_codes[si]) for si in range(S - 1))
    assert (out.images - dense_out.images).abs().max() > 1e-2


@pytest.mark.parametrize("enable", [
    lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-3),
    lambda p: p.enable_fastvar(ratios=(0.5, 0.75)),
    lambda p: p.enable_scale_skip(skip_last=1, cond_only_from=-3),
], ids=["sparsevar-keep", "fastvar", "skip+cond-only"])
def test_it_composes_with_the_shipped_policies(pipe, enable):
    """Stacked after a shipped policy it acts on what that one made (SparseVAR: only the kept tokens
    ran, the others count as unchanged; cond-only: one row per image), the result is deterministic,
    and it differs from the shipped policy alone."""
    enable(pipe)
    alone = _run(pipe)
    quiet = QuietTokens(threshold=0.5)
    before, after = _with_recorders(pipe, quiet)
    first = _run(pipe)
    assert _check_zeroed(before, after, quiet, pipe, batch=2) > 0
    _assert_same_run(_run(pipe), first, len(first[1]))
    assert (first[0].images - alone[0].images).abs().max() > 1e-2


# ---- GPU ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)")
def test_cuda_graphs_replay_it_with_the_eager_result():
    """The engine decides from the (absent) plan how to replay the example's scales; capture (first
    call) and replay (second) give the eager codes and images bit for bit."""
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.set_kernels("triton")

    def run(graphs: bool):
        codes = []
        out = pipe([1, 2], generator=torch.Generator("cuda").manual_seed(7), output_type="pt",
                   use_cuda_graphs=graphs, callback_on_step_end=lambda p, si, t, k: codes.append(k["codes"]))
        return out, codes

    S = pipe.transformer.schedule.num_scales
    dense = run(False)
    pipe.add_policy(QuietTokens(threshold=0.5))
    eager = run(False)
    assert not torch.equal(eager[0].images, dense[0].images)    # it acts
    for _ in range(2):                                           # capture, replay
        _assert_same_run(run(True), eager, S)
    assert pipe.adapter()._workspace.graphs, "no scale ran from a CUDA graph"
