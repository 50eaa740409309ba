"""Regression tests for review findings that reproduce on the CPU (tiny fixture model): each
states the intended behaviour that a bug once broke."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.policies import FastVARConfig, Policy


@pytest.fixture
def pipe(var_official_files):
    p = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    p.set_progress_bar_config(disable=True)
    return p


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _FastVARCacheProbe(Policy):
    """Records, per scale, the map sizes of the FastVAR restoration cache (read-only)."""

    name = "fastvar_cache_probe"

    def __init__(self):
        self.cache_hw: dict[int, set] = {}

    def after_scale(self, si, guided_logits, run):
        st = run.policy_state.get("fastvar")
        if st and st["cache"]:
            self.cache_hw[si] = {hw for _, hw in st["cache"].values()}


# ---- FastVAR ----------------------------------------------------------------------------------------------
def test_fastvar_cache_comes_from_the_scale_just_before_the_first_pruned_one(pipe):
    probe = _FastVARCacheProbe()
    pipe.enable_fastvar(ratios=(0.0, 0.75)).add_policy(probe)   # only the last scale (16x16) is pruned
    pipe([3], generator=_gen(0), output_type="latent")
    sch = pipe.transformer.schedule
    last_unpruned = sch.hw[sch.num_scales - 2]                  # 13x13
    assert probe.cache_hw[sch.num_scales - 2] == {last_unpruned}


def test_fastvar_ratios_given_as_one_number_names_the_setting():
    with pytest.raises((TypeError, ValueError), match="ratios"):
        FastVARConfig(ratios=0.5)


# ---- SparseVAR + scale skipping -------------------------------------------------------------------------------
def test_no_token_map_is_recorded_for_a_skipped_scale(pipe):
    pipe.enable_sparsevar(keep_ratio=0.3, start_scale=-2).enable_scale_skip(skip_last=1)
    out = pipe([3], generator=_gen(0), output_type="latent")
    st = out.stats[0]
    S = pipe.transformer.schedule.num_scales
    assert {s.si for s in st.scales if s.skipped} == {S - 1}
    assert set(st.token_maps) == {S - 2}                        # start_scale=-2: the one scale SparseVAR ran


# ---- pipeline input validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_guidance_scale_is_a_value_error(pipe, bad):
    with pytest.raises(ValueError, match="guidance_scale"):
        pipe([3], guidance_scale=bad, generator=_gen(0), output_type="latent")


def test_numpy_float32_settings_are_accepted(pipe):
    """A NumPy float means the same number as the Python float of its value: the same generation."""
    out = pipe([3], guidance_scale=np.float32(1.5), top_p=np.float32(0.9), generator=_gen(0), output_type="latent")
    same = pipe([3], guidance_scale=1.5, top_p=float(np.float32(0.9)), generator=_gen(0), output_type="latent")
    assert out.images.shape[0] == 1 and torch.equal(out.images, same.images)
