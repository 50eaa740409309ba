"""FlexVAR (issue #31) against the official implementation's fixtures (``tests/fixtures/flexvar`` or
``$SPARSEVAR_FIXTURES/flexvar``): first, its tokenizer (LlamaGen's VQ-16) — encoding, the independent
cosine quantisation of every scale, the teacher-forcing input, and decoding of one scale's codes,
square and not — then the transformer: teacher forcing and every KV-cached run the set's ``config.json``
lists. Floats are compared at the set README's recommended atol ("Recommended checks for an fp32
implementation"), rtol 0; every index exactly."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

# The fixture README's tolerances (absolute; the set states them in prose only, not in config.json).
ATOL = {"f": 2e-5, "tf_input": 1e-6, "tf_logits": 1e-4, "guided_logits": 2e-4, "image": 2e-4}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL[what])


@pytest.fixture(scope="module")
def flexvar_dir(flexvar_fixture_dir):
    return flexvar_fixture_dir


@pytest.fixture(scope="module")
def vq(flexvar_official_files):
    from sparsevar.models.loading import load_flexvar_vq
    return load_flexvar_vq(flexvar_official_files / "FlexVAE.pth")


def test_tokenizer_encodes_quantises_and_decodes_like_the_reference(flexvar_dir, vq):
    want = load_file(flexvar_dir / "vae.safetensors")
    cfg = json.loads((flexvar_dir / "config.json").read_text())
    img = (want["img_uint8"].float() / 255 - 0.5) / 0.5
    patch_nums = cfg["constructor_patch_nums"]
    with torch.no_grad():
        f = vq.encode(img)
        _close(f, want["f"], "f")
        idx, x_in = vq.multiscale(img, patch_nums)
        assert len(idx) == len(patch_nums)
        for k, idx_Bl in enumerate(idx):
            assert torch.equal(idx_Bl, want[f"idx_s{k}"]), k
        _close(x_in, want["x_BLCv_wo_first_l"], "tf_input")
        last = patch_nums[-1]
        _close(vq.decode_codes(idx[-1][:1], last, last), want["recon_from_idx"], "image")
        _close(vq.decode_codes(idx[3], patch_nums[3], patch_nums[3]), want["ms_dec_s3"], "image")
        h, w = want["idx_in"].shape[1:]
        _close(vq.decode_codes(want["idx_in"].view(2, h * w), h, w), want["img_from_idx_in"], "image")


@pytest.fixture(scope="module")
def transformer(flexvar_official_files):
    from sparsevar.models.loading import load_flexvar_transformer
    return load_flexvar_transformer(flexvar_official_files / "FlexVARd2.pth")


def test_teacher_forced_logits_match_the_reference_at_two_schedules(flexvar_dir, vq, transformer):
    """The default 10-step schedule and a training-style one (positions area-resized per scale; the
    training schedule's codes and inputs from our tokenizer equal the reference's)."""
    tf = load_file(flexvar_dir / "flexvar_tf.safetensors")
    vae = load_file(flexvar_dir / "vae.safetensors")
    with torch.no_grad():
        got = transformer(tf["label_B"], vae["x_BLCv_wo_first_l"], tf["tf0.patch_nums"].tolist())
        _close(got, tf["tf0.logits_BLV"], "tf_logits")
        img = (vae["img_uint8"].float() / 255 - 0.5) / 0.5
        idx, x_in = vq.multiscale(img, tf["tf1.patch_nums"].tolist())
        assert torch.equal(torch.cat(idx, 1), tf["tf1.gt_idx_BL"])
        _close(x_in, tf["tf1.x_BLCv_wo_first_l"], "tf_input")
        got = transformer(tf["label_B"], tf["tf1.x_BLCv_wo_first_l"], tf["tf1.patch_nums"].tolist())
        _close(got, tf["tf1.logits_BLV"], "tf_logits")


def test_generation_through_the_engine_draws_the_references_codes(flexvar_dir, vq, transformer, flexvar_ar_run):
    """Each run of the set's ``config.json`` ``ar_runs`` (``flexvar_ar_run``, conftest): KV-cached
    generation with VAR-ramp guidance (ratio over at most nine steps, so past 1 on the 13-step
    schedule), LlamaGen guidance, greedy at untrained sides, and the seeded sampled run (one draw per
    scale from a CPU generator, also at greedy scales). Codes exact; the guided logits where the run
    stores them, the image where it stores one."""
    from sparsevar.engine.sampler import generate
    from sparsevar.engine.schedule import ScaleSchedule
    from sparsevar.engine.state import SamplingSettings
    from sparsevar.models.flexvar import FlexVARAdapter, FlexVARConditioning
    run = flexvar_ar_run
    assert run is not None, f"{flexvar_dir / 'config.json'} lists no ar_runs"
    want = load_file(flexvar_dir / "flexvar_ar.safetensors")
    spec = {r["name"]: r for r in json.loads((flexvar_dir / "config.json").read_text())["ar_runs"]}[run]
    pn = tuple(spec["patch_nums"])
    sched = ScaleSchedule.square(pn)
    adapter = FlexVARAdapter(transformer, vq, sched)
    cond = FlexVARConditioning(torch.tensor(spec["labels"]), pn, llamagen_cfg=spec["used_llamagen_cfg"],
                               max_pn=spec["max_pn"])
    codes, logits = [], []

    def keep(si, d):
        codes.append(d["codes"])
        logits.append(d["logits"])
    out = generate(adapter, cond, 2, settings=SamplingSettings(guidance_scale=spec["cfg"], top_k=spec["top_k"],
                                                               top_p=spec["top_p"]),
                   generator=torch.Generator().manual_seed(spec["g_seed"]), schedule=sched, callback=keep)
    assert len(codes) == len(pn)
    for k, c in enumerate(codes):
        assert torch.equal(c, want[f"{run}.idx_s{k}"]), k
    if "logits" in spec["stored"]:
        _close(torch.cat(logits, 1), want[f"{run}.logits_BLV"], "guided_logits")
    else:
        assert f"{run}.logits_BLV" not in want, "config.json and flexvar_ar.safetensors disagree on the stored logits"
    if "b0" in spec["stored"]:                   # batch element 0, raw decoder output; ours is clamped to [0, 1]
        _close(out.images[:1] * 2 - 1, want[f"{run}.img"].clamp(-1, 1), "image")
    else:
        assert f"{run}.img" not in want, "config.json and flexvar_ar.safetensors disagree on the stored image"
