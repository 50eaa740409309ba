"""Models built by size (``from_random``: meta device, then ``to_empty``) hold uninitialised memory
until ``init_random_weights`` runs: it must set every parameter. Each model's parameters are filled
with NaN first, so one left out shows up as non-finite (a benchmark or ComfyUI test model once drew
its cosine-attention temperatures from whatever memory ``to_empty`` handed out)."""
from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights

from sparsevar.models.bsq_vae import BSQVAE
from sparsevar.models.flexvar import FLEXVAR_PRESETS, FlexVARTransformer
from sparsevar.models.flexvar_vq import FlexVQ16
from sparsevar.models.hart import HART_PRESETS, HARTTransformer
from sparsevar.models.infinity import INFINITY_PRESETS, InfinityTransformer
from sparsevar.models.var import VAR_PRESETS, VARTransformer
from sparsevar.models.vqvae import MultiScaleVQVAE

TINY_HART = HART_PRESETS["hart-tiny"]["transformer"]
CASES = {
    "var": lambda: VARTransformer(**VAR_PRESETS["var-tiny"]),
    "var-shared-aln": lambda: VARTransformer(**{**VAR_PRESETS["var-tiny"], "shared_aln": True}),
    "vqvae": lambda: MultiScaleVQVAE(ch=32, ch_mult=(1, 2), vocab_size=64, z_channels=8),
    "infinity": lambda: InfinityTransformer(**INFINITY_PRESETS["infinity-tiny"]["transformer"]),
    "bsq-vae": lambda: BSQVAE(**INFINITY_PRESETS["infinity-tiny"]["vae"]),
    "hart": lambda: HARTTransformer(**TINY_HART),
    "hart-adaln-cosine": lambda: HARTTransformer(**{**TINY_HART, "disable_aln": False, "attn_l2_norm": True,
                                                    "use_timestep_embed": False}),
    "flexvar": lambda: FlexVARTransformer(**FLEXVAR_PRESETS["flexvar-tiny"]["transformer"]),
    "flexvq16": lambda: FlexVQ16(**FLEXVAR_PRESETS["flexvar-tiny"]["vqvae"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_init_random_weights_sets_every_parameter(name):
    with init_empty_weights():
        model = CASES[name]()
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_random_weights()
    left = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    assert not left, f"{name}: init_random_weights leaves {left[:5]} unset"
