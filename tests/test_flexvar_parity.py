"""FlexVAR (issue #31) against the official implementation's fixtures (``tests/fixtures/flexvar`` or
``$SPARSEVAR_FIXTURES/flexvar``): first, its tokenizer (LlamaGen's VQ-16) — encoding, the independent
cosine quantisation of every scale, the teacher-forcing input, and decoding of one scale's codes,
square and not."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file



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
        torch.testing.assert_close(f, want["f"], rtol=1e-4, atol=1e-4)
        idx, x_in = vq.multiscale(img, patch_nums)
        assert len(idx) == len(patch_nums)
        for k, idx_Bl in enumerate(idx):
            assert torch.equal(idx_Bl, want[f"idx_s{k}"]), k
        torch.testing.assert_close(x_in, want["x_BLCv_wo_first_l"], rtol=1e-4, atol=1e-4)
        last = patch_nums[-1]
        torch.testing.assert_close(vq.decode_codes(idx[-1][:1], last, last), want["recon_from_idx"], rtol=1e-4,
                                   atol=2e-4)
        torch.testing.assert_close(vq.decode_codes(idx[3], patch_nums[3], patch_nums[3]), want["ms_dec_s3"],
                                   rtol=1e-4, atol=2e-4)
        h, w = want["idx_in"].shape[1:]
        torch.testing.assert_close(vq.decode_codes(want["idx_in"].view(2, h * w), h, w), want["img_from_idx_in"],
                                   rtol=1e-4, atol=2e-4)


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
        torch.testing.assert_close(got, tf["tf0.logits_BLV"], rtol=1e-4, atol=1e-4)
        img = (vae["img_uint8"].float() / 255 - 0.5) / 0.5
        idx, x_in = vq.multiscale(img, tf["tf1.patch_nums"].tolist())
        assert torch.equal(torch.cat(idx, 1), tf["tf1.gt_idx_BL"])
        torch.testing.assert_close(x_in, tf["tf1.x_BLCv_wo_first_l"], rtol=1e-4, atol=1e-4)
        got = transformer(tf["label_B"], tf["tf1.x_BLCv_wo_first_l"], tf["tf1.patch_nums"].tolist())
        torch.testing.assert_close(got, tf["tf1.logits_BLV"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("run", ["r0", "r1", "r2", "r3", "r4"])
def test_generation_through_the_engine_draws_the_references_codes(flexvar_dir, vq, transformer, run):
    """KV-cached generation: VAR-ramp guidance (ratio over at most nine steps, so past 1 on the 13-step
    schedule), LlamaGen guidance, greedy at untrained sides, and the seeded sampled run (one draw per
    scale from a CPU generator, also at greedy scales)."""
    from sparsevar.engine.sampler import generate
    from sparsevar.engine.schedule import ScaleSchedule
    from sparsevar.engine.state import SamplingSettings
    from sparsevar.models.flexvar import FlexVARAdapter, FlexVARConditioning
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
    if f"{run}.logits_BLV" in want:
        torch.testing.assert_close(torch.cat(logits, 1), want[f"{run}.logits_BLV"], rtol=1e-4, atol=1e-4)
    if f"{run}.img" in want:
        torch.testing.assert_close(out.images[:1] * 2 - 1, want[f"{run}.img"].clamp(-1, 1), rtol=1e-4, atol=2e-4)
