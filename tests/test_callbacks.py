"""callback_on_step_end as diffusers users write it (issue #35): "latents" under diffusers' name (the old
"latent" still works), and a returned "latents" replaces the latent — the next scales build on the edit
and it is what gets decoded — for every family."""
from __future__ import annotations

import pytest
import torch

from sparsevar import FlexVARPipeline, HARTPipeline, InfinityPipeline, VARPipeline


def _families():
    return {
        "var": (lambda: VARPipeline.from_random("var-tiny"), dict(class_labels=[3])),
        "infinity": (lambda: InfinityPipeline.from_random("infinity-tiny"), dict(prompt="w3 w4", height=256,
                                                                                width=256)),
        "hart": (lambda: HARTPipeline.from_random("hart-tiny"), dict(prompt="w3 w4")),
        "flexvar": (lambda: FlexVARPipeline.from_random("flexvar-tiny"), dict(class_labels=[3])),
    }


@pytest.mark.parametrize("family", ["var", "infinity", "hart", "flexvar"])
def test_returned_latents_steer_the_next_scales_and_the_picture(family):
    make, call = _families()[family]
    pipe = make()
    pipe.set_progress_bar_config(disable=True)
    kw = dict(call, output_type="pt", top_k=1)
    seen = {}

    def watch(p, si, t, d):
        seen[si] = (d["latents"], d["latent"], d["codes"])
        return d                                                   # unchanged: the run stays the same

    base = pipe(**kw, generator=torch.Generator().manual_seed(0), callback_on_step_end=watch, callback_on_step_end_tensor_inputs=["latents", "latent", "codes"])
    assert all(torch.equal(a, b) for a, b, _ in seen.values())       # the old name is the same tensor
    plain = pipe(**kw, generator=torch.Generator().manual_seed(0))
    assert torch.equal(base.images, plain.images)                   # returning the given dict changes nothing
    S = len(seen)
    edit_at = S - 3

    def edit(p, si, t, d):
        if si == edit_at:
            d["latents"] = torch.zeros_like(d["latents"])
        return d

    codes = {}

    def record(p, si, t, d):
        codes[si] = d["codes"]

    edited = pipe(**kw, generator=torch.Generator().manual_seed(0), callback_on_step_end=lambda p, si, t, d: (record(p, si, t, d), edit(p, si, t, d))[1],
                  callback_on_step_end_tensor_inputs=["latents", "codes"])
    assert all(torch.equal(codes[si], seen[si][2]) for si in range(edit_at + 1))       # before the edit: the same
    assert any(not torch.equal(codes[si], seen[si][2]) for si in range(edit_at + 1, S))  # after: they follow it
    assert (edited.images - base.images).abs().max() > 1e-3


def test_a_latent_of_another_shape_is_refused():
    pipe = VARPipeline.from_random("var-tiny")
    pipe.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match=r"the callback returned a latent of shape \(1, 2\); it must keep the latent's "
                                         r"shape \(1, 32, 16, 16\)"):
        pipe([3], generator=torch.Generator().manual_seed(0), output_type="pt",
             callback_on_step_end=lambda p, si, t, d: {"latents": torch.zeros(1, 2)},
             callback_on_step_end_tensor_inputs=["latents"])
