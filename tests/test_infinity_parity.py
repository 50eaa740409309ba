"""Parity with the official Infinity implementation on the fixture sets (CPU, float32).

Everything is read from the set's config.json and safetensors files (schedule, aspect ratio, bit
depth, prompts, inference cases), so any set in this format runs. Weights are materialised from
the manifests, written as official files (flat transformer .pth, ``{'vae': …}`` VAE .pth, a real
``transformers`` T5 folder) and loaded through the project's own loaders; prompts go through the
tokenizer and T5 like user prompts. Tolerances are those of the fixtures README.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sparsevar import InfinityPipeline
from sparsevar.models.bsq_vae import next_scale_input
from sparsevar.models.infinity import infinity_resolution
from sparsevar.models.loading import load_infinity_transformer, load_infinity_vae
from sparsevar.models.text_encoder import TextFeatures
from sparsevar.policies import Policy


def token_words(ids, eos_id: int) -> str:
    """The prompt that the fixture T5 folder's word-level tokenizer (conftest) turns into ``ids``: id i is
    the word ``w{i}``; the tokenizer appends the EOS."""
    ids = [int(i) for i in ids]
    if not ids or ids[-1] != eos_id or eos_id in ids[:-1]:
        raise ValueError(f"fixture prompt {ids} must end with its only EOS id {eos_id}")
    return " ".join(f"w{i}" for i in ids[:-1])

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def pipe(infinity_official_files) -> InfinityPipeline:
    f = infinity_official_files
    p = InfinityPipeline.from_single_file(f["transformer"], f["vae"], text_encoder=f["t5"])
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def resolution(infinity_fixture_config):
    c = infinity_fixture_config
    res = infinity_resolution(c["h_div_w_template"], c["pn"])
    assert [list(x) for x in res.hw] == [s[1:] for s in c["scale_schedule"]], "fixture schedule is not a template"
    assert [res.height, res.width] == c["image_hw"]
    return res


@pytest.fixture(scope="module")
def prompts(infinity_fixture_config) -> dict:
    t5 = infinity_fixture_config["t5"]
    eos = t5["eos_token_id"]
    return {"prompt": [token_words(ids, eos) for ids in t5["prompts_token_ids"]],
            "neg": token_words(t5["negative_prompt_token_ids"], eos)}


def _split(x_BLd: torch.Tensor, hw) -> list[torch.Tensor]:
    out, start = [], 0
    for h, w in hw:
        out.append(x_BLd[:, start:start + h * w])
        start += h * w
    return out


def _text(f: dict, prefix: str = "") -> TextFeatures:
    return TextFeatures(f[prefix + "kv_compact"], tuple(int(n) for n in f[prefix + "lens"].tolist()))


# ---- loaders ---------------------------------------------------------------------------------------------
def test_loaders_infer_the_fixture_configuration(infinity_official_files, infinity_fixture_config):
    kw = infinity_fixture_config["infinity_constructor_kwargs"]
    t = load_infinity_transformer(infinity_official_files["transformer"])
    for ours, theirs in (("depth", "depth"), ("embed_dim", "embed_dim"), ("num_heads", "num_heads"),
                         ("text_channels", "text_channels"), ("text_maxlen", "text_maxlen"),
                         ("num_block_chunks", "block_chunks")):
        assert t.config[ours] == kw[theirs], ours
    d = infinity_fixture_config["derived"]
    assert t.config.token_dim == d["codebook_dim"] * (4 if kw["apply_spatial_patchify"] else 1)
    assert t.text_proj_for_sos.ca.num_heads == d["text_pool_heads"]
    assert t.blocks[0].ffn.fc1.out_features == d["ffn_hidden"]
    v = load_infinity_vae(infinity_official_files["vae"])
    vk = infinity_fixture_config["vae"]
    assert (v.config.codebook_dim, v.config.base_ch, list(v.config.ch_mult), v.config.num_res_blocks,
            v.config.patch_size) == (vk["codebook_dim"], vk["base_ch"], vk["ch_mult"], vk["num_res_blocks"],
                                     vk["patch_size"])


# ---- (a) VAE ---------------------------------------------------------------------------------------------
def test_vae_encode_bits_and_decode(infinity_fixture_dir, infinity_official_files, resolution):
    ref = load_file(infinity_fixture_dir / "vae.safetensors")
    vae = load_infinity_vae(infinity_official_files["vae"])
    x = ref["image_uint8"].permute(0, 3, 1, 2).float() / 255                      # (B, H, W, 3) → (B, 3, H, W)
    x = x + x - 1
    h, bits, z = vae.encode(x, resolution.hw)
    torch.testing.assert_close(h, ref["h"], atol=2e-4, rtol=0)
    assert torch.equal(torch.cat(bits, dim=1), ref["bits"])
    torch.testing.assert_close(z, ref["z"], atol=1e-5, rtol=0)
    torch.testing.assert_close(vae.summed_codes(_split(ref["bits"], resolution.hw), resolution.hw), ref["z"],
                               atol=1e-5, rtol=0)
    recon = vae.decode(ref["z"][: ref["recon"].shape[0]])
    torch.testing.assert_close(recon, ref["recon"], atol=2e-4, rtol=0)


# ---- text ------------------------------------------------------------------------------------------------
def test_t5_features_through_the_tokenizer(infinity_fixture_dir, pipe, prompts):
    ref = load_file(infinity_fixture_dir / "text.safetensors")
    got = pipe.encode_prompt(prompts["prompt"])
    assert got.lens == _text(ref).lens
    torch.testing.assert_close(got.kv_compact_NC, ref["kv_compact"], atol=1e-5, rtol=0)
    neg = pipe.encode_prompt([prompts["neg"]] * len(prompts["prompt"]))
    assert neg.lens == _text(ref, "neg.").lens
    torch.testing.assert_close(neg.kv_compact_NC, ref["neg.kv_compact"], atol=1e-5, rtol=0)


# ---- (b) teacher forcing ---------------------------------------------------------------------------------
def test_teacher_forced_logits_and_intermediates(infinity_fixture_dir, infinity_official_files, resolution):
    text = _text(load_file(infinity_fixture_dir / "text.safetensors"))
    tf = load_file(infinity_fixture_dir / "teacher_forced.safetensors")
    model = load_infinity_transformer(infinity_official_files["transformer"])
    taps: dict = {}
    with torch.no_grad():
        logits = model(text, tf["x_BLC_wo_prefix"], resolution, taps)
    torch.testing.assert_close(logits, tf["logits"], atol=2e-4, rtol=0)
    for k in ("text_norm_out", "cond_BD", "ca_kv", "ada_cond", "rope_cos_sin"):
        torch.testing.assert_close(taps[k], tf[k], atol=1e-5, rtol=0, msg=k)
    for k in ("block0_in", "block0_out", "last_block_out"):
        torch.testing.assert_close(taps[k][: tf[k].shape[0]], tf[k], atol=1e-5, rtol=0, msg=k)


def test_next_scale_inputs_of_the_training_path(infinity_fixture_dir, infinity_official_files, resolution):
    """The teacher-forcing inputs are trilinear resizes of the running code sum (not the VAE's area mode)."""
    tf = load_file(infinity_fixture_dir / "teacher_forced.safetensors")
    vae = load_infinity_vae(infinity_official_files["vae"])
    hw = resolution.hw
    bits = _split(tf["gt_bits"], hw)
    inputs = [next_scale_input(vae.summed_codes(bits[:k + 1], list(hw[:k + 1]) + [hw[-1]]), hw[k + 1])
              for k in range(len(hw) - 1)]
    torch.testing.assert_close(torch.cat(inputs, dim=1), tf["x_BLC_wo_prefix"], atol=1e-5, rtol=0)


# ---- (c) KV-cached generation ----------------------------------------------------------------------------
def _case_kwargs(case: dict, prompts: dict) -> dict:
    kw = dict(guidance_scale=case["cfg"], temperature=case["tau"], top_k=case["top_k"], top_p=case["top_p"])
    if case.get("negative"):
        kw["negative_prompt"] = prompts[case["negative"]]
    return kw


def _generate(pipe, prompts, resolution, kwargs, seed, policies=None):
    steps = []

    def grab(p, si, t, d):
        steps.append(d)
        return d

    out = pipe(prompts["prompt"], height=resolution.height, width=resolution.width, output_type="pt",
               generator=torch.Generator().manual_seed(seed), callback_on_step_end=grab,
               callback_on_step_end_tensor_inputs=["codes", "logits", "latent"], policies=policies, **kwargs)
    return out.images, steps


def _greedy_cases(config):
    return [name for name, c in config["inference_cases"].items() if c["top_k"] == 1]


@pytest.fixture(params=["auto", "never"])
def absorb(request, pipe):
    """The cross-attention's form: absorbed projections (what "auto" picks for the fixtures' short
    prompts) or the projections as the reference runs them."""
    adapter = pipe.adapter()
    adapter.absorb_cross_attention = request.param
    yield request.param
    adapter.absorb_cross_attention = "auto"


def test_greedy_generation(infinity_fixture_dir, infinity_fixture_config, pipe, prompts, resolution, absorb):
    """Free-running KV-cached generation through the pipeline: bits exact, guided logits, next-scale
    inputs, summed codes and the returned image within the README tolerances."""
    ref = load_file(infinity_fixture_dir / "inference.safetensors")
    cases = _greedy_cases(infinity_fixture_config)
    assert cases, "the fixture set has no greedy case"
    hw = resolution.hw
    for name in cases:
        case = infinity_fixture_config["inference_cases"][name]
        images, steps = _generate(pipe, prompts, resolution, _case_kwargs(case, prompts), case["g_seed"])
        assert pipe.adapter()._workspace.ca_absorbed == (absorb == "auto"), name
        assert len(steps) == len(hw)
        bits = torch.cat([s["codes"] for s in steps], dim=1).to(torch.uint8)
        mismatch = (bits != ref[f"{name}.bits"]).sum().item()
        assert mismatch == 0, f"{name}: {mismatch} bits differ"
        if f"{name}.logits" in ref:
            atol = 2e-4 if case["cfg"] == 1 else 2e-3
            torch.testing.assert_close(torch.cat([s["logits"] for s in steps], dim=1), ref[f"{name}.logits"],
                                       atol=atol, rtol=0, msg=name)
        if f"{name}.next_inputs" in ref:
            nxt = torch.cat([next_scale_input(steps[k]["latent"], hw[k + 1], pipe.is_patchify)
                             for k in range(len(hw) - 1)], dim=1)
            torch.testing.assert_close(nxt, ref[f"{name}.next_inputs"], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(steps[-1]["latent"], ref[f"{name}.summed_codes"], atol=1e-5, rtol=0, msg=name)
        if f"{name}.image_uint8_bgr" in ref:
            u8 = (images.permute(0, 2, 3, 1) * 255).to(torch.uint8).flip(-1)      # the reference's return value
            assert (u8.int() - ref[f"{name}.image_uint8_bgr"].int()).abs().max() <= 1, name


class _ForceBits(Policy):
    """Teacher forcing for the scale-by-scale protocol: the residual of every scale is replaced by the
    codes of the reference bits, so each scale sees the reference's past."""

    name = "force_bits"

    def __init__(self, bits_per_scale, code):
        self.bits, self.code = bits_per_scale, code

    def post_residual(self, si, residual, run):
        return torch.where(self.bits[si].bool(), self.code, -self.code).float()


def test_scale_by_scale_with_reference_bits_fed_back(infinity_fixture_dir, infinity_fixture_config, pipe, prompts,
                                                     resolution):
    """The fixtures README protocol: at every scale the previous scales' reference bits are fed back;
    that scale's logits and argmax must match, and so must next inputs and summed codes."""
    ref = load_file(infinity_fixture_dir / "inference.safetensors")
    hw = resolution.hw
    code = pipe.adapter()._code
    cases = _greedy_cases(infinity_fixture_config)
    assert cases, "the fixture set has no greedy case"
    for name in cases:
        case = infinity_fixture_config["inference_cases"][name]
        forced = _ForceBits(_split(ref[f"{name}.bits"], hw), code)
        _, steps = _generate(pipe, prompts, resolution, _case_kwargs(case, prompts), case["g_seed"], [forced])
        assert len(steps) == len(hw), name
        ref_bits = _split(ref[f"{name}.bits"], hw)
        ref_logits = _split(ref[f"{name}.logits"], hw) if f"{name}.logits" in ref else None
        for si, s in enumerate(steps):
            assert torch.equal(s["codes"].to(torch.uint8), ref_bits[si]), f"{name}: bits differ at scale {si}"
            if ref_logits is not None:
                atol = 2e-4 if case["cfg"] == 1 else 2e-3
                torch.testing.assert_close(s["logits"], ref_logits[si], atol=atol, rtol=0, msg=f"{name} scale {si}")
        torch.testing.assert_close(steps[-1]["latent"], ref[f"{name}.summed_codes"], atol=1e-5, rtol=0)


def test_sampled_generation_reproduces_the_reference_random_stream(infinity_fixture_dir, infinity_fixture_config,
                                                                   pipe, prompts, resolution):
    """RNG-stream parity (informational in the README): one CPU generator seeded once, multinomial per
    bit in the reference's call order. Runs on every torch (it holds on 2.13.0, which made the
    fixtures, and on 2.14.1); a failure names both versions, since torch may change its CPU random
    stream between releases."""
    ref = load_file(infinity_fixture_dir / "inference.safetensors")
    if "sampled_official_defaults.bits" not in ref or "sampled_official_defaults" not in infinity_fixture_config:
        pytest.skip("this fixture set has no sampled run")
    log = json.loads((infinity_fixture_dir / "generation_log.json").read_text())
    case = infinity_fixture_config["sampled_official_defaults"]
    _, steps = _generate(pipe, prompts, resolution, _case_kwargs(case, prompts), case["g_seed"])
    assert len(steps) == len(resolution.hw)
    bits = torch.cat([s["codes"] for s in steps], dim=1).to(torch.uint8)
    expected = ref["sampled_official_defaults.bits"]
    assert bits.shape == expected.shape
    mismatch = (bits != expected).sum().item()
    assert mismatch == 0, (f"{mismatch} of {bits.numel()} sampled bits differ; the fixtures were made with torch "
                           f"{log['torch']}, this is torch {torch.__version__} (an RNG stream can change between "
                           f"torch releases)")
