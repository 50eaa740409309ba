"""HART (issue #29) against the official implementation's fixtures (``tests/fixtures/hart``, or
``$SPARSEVAR_FIXTURES/hart``): the hybrid tokenizer, the teacher-forced transformer and the
residual diffusion head with the recorded noise, at the fixture README's tolerances."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sparsevar.models.hart import HARTTransformer, RespacedIDDPM, sample_residual
from sparsevar.models.vqvae import MultiScaleVQVAE



@pytest.fixture(scope="module")
def hart_dir(hart_fixture_dir):
    return hart_fixture_dir


@pytest.fixture(scope="module")
def manifest(hart_dir):
    return json.loads((hart_dir / "manifest.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(hart_state_dicts, manifest):
    def build(phi_on_last: bool):
        sd = {k.removeprefix("vae."): v for k, v in hart_state_dicts["tokenizer"].items()}
        for k in MultiScaleVQVAE.official_extra_keys():
            sd.pop(k, None)
        cfg = MultiScaleVQVAE.config_from_state_dict(sd, patch_nums=manifest["tokenizer_config"]["v_patch_nums"])
        vq = MultiScaleVQVAE(**cfg, phi_on_last=phi_on_last)
        vq.load_state_dict(sd, strict=True)
        return vq.eval()
    return build


@pytest.fixture(scope="module")
def transformer(hart_state_dicts, manifest):
    c = manifest["transformer_config"]
    t = manifest["tokenizer_config"]
    sd = dict(hart_state_dicts["transformer"])
    for k in HARTTransformer.official_extra_keys(c["depth"]):
        sd.pop(k)
    model = HARTTransformer(vocab_size=t["vocab_size"], z_channels=t["z_channels"], context_token=c["context_token"],
                            context_dim=c["context_dim"], depth=c["depth"], embed_dim=c["embed_dim"],
                            num_heads=c["num_heads"], mlp_ratio=c["mlp_ratio"], norm_eps=c["norm_eps"],
                            use_timestep_embed=c["use_timestep_embed"], disable_aln=c["disable_aln"],
                            sep_aln_pooling_mode=c["sep_aln_pooling_mode"], attn_l2_norm=c["attn_l2_norm"],
                            diff_width=c["diff_width"], diff_depth=c["diff_depth"],
                            num_sampling_steps=int(c["num_sampling_steps"]), patch_nums=c["patch_nums"])
    model.load_state_dict(sd, strict=True)
    return model.eval()


def test_hybrid_tokenizer_encodes_and_decodes_like_the_reference(hart_dir, manifest, tokenizer):
    inputs = load_file(hart_dir / "inputs.safetensors")
    want = load_file(hart_dir / "tokenizer_expected.safetensors")
    vq = tokenizer(phi_on_last=False)
    with torch.no_grad():
        f = vq.encode(inputs["image"])
        idx, fhat = vq.quantize_multiscale(f)
        torch.testing.assert_close(f, want["latent_f"], rtol=1e-4, atol=1e-4)
        assert len(idx) == len(manifest["tokenizer_config"]["v_patch_nums"])
        for si, idx_Bl in enumerate(idx):
            assert torch.equal(idx_Bl, want[f"idx_s{si}"]), si
        B, C, h, w = f.shape
        rest = (f - fhat[-2]).flatten(2).transpose(1, 2)                  # (B, C, h, w) → (B, h·w, C)
        torch.testing.assert_close(rest, want["frest_wo_last"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vq.idx_to_var_input(idx), want["var_input"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fhat[-1], want["fhat_discrete"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vq.idx_to_fhat(idx), want["fhat_discrete"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vq.fhat_to_img(f), want["recon_continuous"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vq.fhat_to_img(fhat[-1]), want["recon_discrete"], rtol=1e-4, atol=1e-4)
        # VAR's rule (φ on the last scale too) is the reference's idxBl_to_fhat, not HART's generation
        varstyle = tokenizer(phi_on_last=True).idx_to_fhat(idx)
        torch.testing.assert_close(varstyle, want["fhat_discrete_varstyle"], rtol=1e-4, atol=1e-4)
        assert (varstyle - fhat[-1]).abs().max() > 1e-3


def test_teacher_forced_logits_match_the_reference(hart_dir, transformer):
    inputs = load_file(hart_dir / "inputs.safetensors")
    want = load_file(hart_dir / "teacher_forced_expected.safetensors")
    with torch.no_grad():
        logits = transformer(inputs["context"], want["x_BLCv_wo_first_l"], inputs["context_position_ids"],
                             inputs["context_mask"])
    assert logits.shape == want["logits"].shape
    torch.testing.assert_close(logits, want["logits"], rtol=1e-4, atol=1e-4)


def test_respaced_schedule_is_the_references():
    s = RespacedIDDPM(8)
    assert s.timesteps == [0, 143, 285, 428, 571, 714, 856, 999]
    torch.testing.assert_close(torch.tensor(s.betas), torch.tensor(
        [4.128e-5, 0.054878, 0.148746, 0.249546, 0.366072, 0.517566, 0.735439, 0.99999995], dtype=torch.float64),
        rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("cfg", ["1", "4.5"])
def test_diffusion_head_samples_the_references_residual_from_the_recorded_noise(hart_dir, manifest, transformer, cfg):
    """The recorded condition and noise through our sampler give the reference's residual; the
    guidance is the generation's stale last ratio, cfg·(S−2)/(S−1)."""
    got_f = load_file(hart_dir / f"infer_cfg{cfg}.safetensors")
    S = len(manifest["transformer_config"]["patch_nums"])
    t = float(cfg) * (S - 2) / (S - 1)
    z = got_f["diff_cond_z"]                                            # (2B, h², C): cond rows, then uncond
    B, n = z.shape[0] // 2, z.shape[1]
    noise_steps = [step[:B * n] for step in got_f["diff_noise_steps"]]
    with torch.no_grad():
        out = sample_residual(transformer.diffloss.net, transformer.sampler, z[:B].flatten(0, 1),
                              z[B:].flatten(0, 1), t, got_f["diff_noise_init"], noise_steps)
    torch.testing.assert_close(out.view(B, n, -1), got_f["diff_out"], rtol=1e-4, atol=1e-4)


def _generate(transformer, tokenizer, inputs, fixture, cfg: float, generator=None, **settings):
    from sparsevar.engine.sampler import generate
    from sparsevar.engine.state import SamplingSettings
    from sparsevar.models.hart import HARTAdapter, HARTConditioning
    adapter = HARTAdapter(transformer, tokenizer(phi_on_last=False))
    noise = None
    if fixture is not None:
        B, n = fixture["diff_out"].shape[:2]
        noise = (fixture["diff_noise_init"], list(fixture["diff_noise_steps"]))
    cond = HARTConditioning(inputs["context"], inputs["context_position_ids"], inputs["context_mask"], noise)
    codes = []
    out = generate(adapter, cond, inputs["context"].shape[0],
                   settings=SamplingSettings(guidance_scale=cfg, **settings), generator=generator,
                   callback=lambda si, d: codes.append(d["codes"]))
    return out, codes


@pytest.mark.parametrize("cfg", ["1", "4.5"])
def test_greedy_generation_with_the_recorded_diffusion_noise_matches_the_reference(hart_dir, manifest, transformer,
                                                                                  tokenizer, cfg):
    """Through the engine: every scale's argmax codes, the last latent and the image, with the
    diffusion noise the reference recorded (its own draws come from the global RNG)."""
    inputs = load_file(hart_dir / "inputs.safetensors")
    want = load_file(hart_dir / f"infer_cfg{cfg}.safetensors")
    out, codes = _generate(transformer, tokenizer, inputs, want, float(cfg), top_k=1, top_p=0.0)
    assert len(codes) == len(manifest["transformer_config"]["patch_nums"])
    for si, c in enumerate(codes):
        assert torch.equal(c, want[f"tokens_s{si}"]), si
    torch.testing.assert_close(out.latent, want["fhat_final"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.images, want["image"], rtol=2e-4, atol=2e-4)


def test_seeded_smooth_sampling_reproduces_the_references_random_stream(hart_dir, manifest, transformer, tokenizer):
    """The reference's demo path (``more_smooth``, top-k 600 then 300): codes from the seeded CPU
    generator, Gumbel draws after each scale's codes; its diffusion noise came from the global RNG
    seeded with seed + 2 (one (B·P², C) start, then one (2B·P², C) draw per step), passed here."""
    from sparsevar.engine.sampler import generate
    from sparsevar.engine.state import SamplingSettings
    from sparsevar.models.hart import HARTAdapter, HARTConditioning
    inputs = load_file(hart_dir / "inputs.safetensors")
    want = load_file(hart_dir / "infer_sampled_cfg4.5.safetensors")
    seed = manifest["seed"]
    B, n, C = want["diff_out"].shape
    g = torch.Generator().manual_seed(seed + 2)
    init = torch.randn(B * n, C, generator=g)
    steps = [torch.randn(2 * B * n, C, generator=g) for _ in range(8)]
    adapter = HARTAdapter(transformer, tokenizer(phi_on_last=False))
    cond = HARTConditioning(inputs["context"], inputs["context_position_ids"], inputs["context_mask"],
                            (init, steps), smooth=True)
    codes = []
    out = generate(adapter, cond, B, settings=SamplingSettings(guidance_scale=4.5, top_k=0, top_p=0.0),
                   generator=torch.Generator().manual_seed(seed), callback=lambda si, d: codes.append(d["codes"]))
    for si, c in enumerate(codes):
        assert torch.equal(c, want[f"tokens_s{si}"]), si
    torch.testing.assert_close(out.latent, want["fhat_final"], rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(out.images, want["image"], rtol=5e-3, atol=5e-3)
