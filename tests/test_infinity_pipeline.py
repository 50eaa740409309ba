"""Infinity beyond the fixture outputs: official sizes, architecture facts at real size (meta device),
loaders (aliases, validation, containers), the pipeline's inputs, batching, save/load, and the
KV-cached path against teacher forcing at a non-square size and with spatial patchify.

Generation runs on random tiny models (``from_random("infinity-tiny")``) at 256-px-class sizes, and on
the fixture model loaded from its official files.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from accelerate import init_empty_weights

from sparsevar import InfinityPipeline, InfinityPipelineOutput
from sparsevar.models.bsq_vae import BSQVAE, next_scale_input
from sparsevar.models._blocks import CrossMemory, absorbs_cross_attention
from sparsevar.models.infinity import (INFINITY_PRESETS, InfinityCrossAttention, InfinityTransformer, ffn_hidden,
                                       infinity_resolution, infinity_resolutions, resolve_resolution, rope_positions,
                                       text_pool_heads)
from sparsevar.models.loading import load_infinity_transformer, load_infinity_vae
from sparsevar.models.text_encoder import random_t5

KEYS_DIR = Path(__file__).resolve().parent / "fixtures" / "infinity" / "keys"


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def tiny() -> InfinityPipeline:
    p = InfinityPipeline.from_random("infinity-tiny", seed=0)
    p.set_progress_bar_config(disable=True)
    return p


def _bits(pipe, prompt, **kw):
    steps = []

    def grab(p, si, t, d):
        steps.append(d)
        return d

    kw.setdefault("height", 256)
    kw.setdefault("width", 256)
    kw.setdefault("top_k", 1)
    out = pipe(prompt, generator=_g(0), output_type="latent", callback_on_step_end=grab,
               callback_on_step_end_tensor_inputs=["codes", "logits", "latent"], **kw)
    return torch.cat([s["codes"] for s in steps], dim=1), out.images, steps


# ---- sizes ------------------------------------------------------------------------------------------------
def test_every_official_size_resolves_to_its_template():
    sizes = infinity_resolutions()
    assert len(sizes) == 15 * 4
    assert len({(r.height, r.width) for r in sizes}) == len(sizes)
    for r in sizes:
        assert resolve_resolution(r.height, r.width).hw == r.hw
        assert abs(r.height / r.width - r.h_div_w) < 0.01 * max(1.0, r.h_div_w)
    r = resolve_resolution(1024, 1024)
    assert len(r.hw) == 13 and r.schedule.total_tokens == 10521 and r.rope_grid == (64, 64)
    r = resolve_resolution(864, 1152)                                           # 3:4 at 1M
    assert r.h_div_w == 0.75 and r.hw[2] == (3, 4) and r.rope_grid == (54, 72)
    assert [s.height for s in (infinity_resolution(1.0, pn) for pn in ("0.06M", "0.25M", "0.60M", "1M"))] == \
        [256, 512, 768, 1024]


@pytest.mark.parametrize("height, width, listed", [
    (1000, 1000, "256x256, 512x512, 768x768, 1024x1024"),
    (864, 1150, "240x320, 432x576, 720x960, 864x1152"),
])
def test_unknown_size_lists_the_sizes_of_its_aspect_ratio(tiny, height, width, listed):
    with pytest.raises(ValueError, match=f"height={height}, width={width}.*{listed}"):
        tiny("w3", height=height, width=width)


def test_zero_shot_2048_appends_two_scales_that_reuse_the_last_trained_level(tiny, caplog):
    """FastVAR's 2K extension: 1M schedule + 1.5× and 2× its final map; levels and RoPE positions stay
    inside what the model was trained on; a log line says the size is zero-shot."""
    from sparsevar.models.infinity import TRAINED_SCALES, level_index
    r = resolve_resolution(2048, 2048)
    assert r.pn == "4M" and r.hw[-3:] == ((64, 64), (96, 96), (128, 128)) and r.rope_grid == (64, 64)
    assert rope_positions(r.hw, r.rope_grid).max().item() == 63
    assert level_index(r.hw).max().item() == TRAINED_SCALES - 1
    assert resolve_resolution(1728, 2304).hw[-1] == (108, 144)                  # 3:4 zero-shot
    # pruned, never skipped (the Infinity preset's ratio 1.0 would skip exactly the two zero-shot scales)
    tiny.enable_fastvar(layer_range=(1, 3), ratios=(0.5, 0.75))
    try:
        with caplog.at_level("WARNING"):
            out = tiny("w3", height=2048, width=2048, generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        tiny.disable_fastvar()
    scales = out.stats[0].scales
    assert out.images.shape[-2:] == (128, 128) and len(scales) == 15
    assert [(s.h, s.w, s.skipped) for s in scales[-2:]] == [(96, 96, False), (128, 128, False)]
    assert 0 < scales[-1].tokens_computed < 128 * 128                               # computed, pruned
    assert any("2048x2048 is a zero-shot size: 2 scales past the 13" in m for m in caplog.messages)


def test_rope_positions_scale_to_the_1m_grid_with_half_to_even_rounding():
    r = infinity_resolution(0.75, "0.06M")                                      # 3:4, rope grid (54, 72)
    assert r.hw[5] == (12, 16)
    pos = rope_positions(r.hw, r.rope_grid)
    start = sum(h * w for h, w in r.hw[:5])
    rows = pos[start:start + 12 * 16:16, 0].tolist()                              # 54/12 = 4.5 per row
    assert rows == [0, 4, 9, 14, 18, 22, 27, 32, 36, 40, 45, 50]
    cols = pos[start:start + 16, 1].tolist()                                    # 72/16 = 4.5 per column
    assert cols == [round(c * 4.5) for c in range(16)]                          # Python round: half to even
    assert pos[0].tolist() == [0, 0]


# ---- architecture facts at real size ----------------------------------------------------------------------
def _key_file(name: str) -> tuple[dict, int]:
    """An official key list (``key<TAB>[shape]<TAB>dtype`` rows, ``#`` header) as {key: (shape, dtype)}, and
    the parameter count its header states. The file's own header is checked against its rows (entry count,
    and the parameter count = the elements of every key but the ``zero_k_bias`` buffers), so a truncated or
    edited copy fails here rather than agreeing with a model that lost the same keys."""
    out, header = {}, {}
    for line in (KEYS_DIR / name).read_text().splitlines():
        if line.startswith("#"):
            if m := re.fullmatch(r"# parameters: ([\d,]+)\b.*", line):
                header["parameters"] = int(m.group(1).replace(",", ""))
            elif m := re.fullmatch(r"# (\d+) entries, ([\d,]+) elements", line):
                header["entries"], header["elements"] = int(m.group(1)), int(m.group(2).replace(",", ""))
            continue
        if not line.strip():
            continue
        key, shape, dtype = line.split("\t")
        out[key] = ([int(s) for s in shape.strip("[]").split(",") if s.strip()], dtype)
    assert len(out) == header["entries"] > 0, name
    assert sum(math.prod(s) for s, _ in out.values()) == header["elements"], name
    if "parameters" in header:
        assert sum(math.prod(s) for k, (s, _) in out.items() if not k.endswith("zero_k_bias")) == \
            header["parameters"], name
    return out, header.get("parameters", 0)


def _layout(module: torch.nn.Module) -> dict:
    return {k: (list(p.shape), str(p.dtype).removeprefix("torch.")) for k, p in module.state_dict().items()}


def test_infinity_2b_and_its_vae_have_the_official_keys_shapes_and_size():
    """Key for key against the official constructor's lists (``keys/``): every key with its shape and
    dtype; the only official keys the model does not hold are the all-zero ``zero_k_bias`` buffers
    (the loader checks they are zero) and the VAE's ``lfq`` bit-weight buffers (derived constants)."""
    spec = INFINITY_PRESETS["infinity-2b"]
    with init_empty_weights():
        t = InfinityTransformer(**spec["transformer"])
        v = BSQVAE(**spec["vae"])
    keys, parameters = _key_file("infinity_2b_keys.txt")
    assert parameters == 2_204_564_032
    official = {k: s for k, s in keys.items() if not k.endswith("zero_k_bias")}
    assert len(keys) - len(official) == 2 * 32 + 1                    # sa and ca per block, and the text pool
    assert _layout(t) == official
    assert sum(p.numel() for p in t.parameters()) == parameters
    vae_keys, _ = _key_file("infinity_vae_keys.txt")
    vae_official = {k: s for k, s in vae_keys.items() if ".lfq." not in k}
    assert len(vae_keys) - len(vae_official) == 2                       # quantizer.lfq.mask and its alias
    assert _layout(v) == vae_official


def test_infinity_8b_has_the_official_keys_shapes_and_size():
    """The "infinity-8b" preset against the official constructor's 862 keys (``keys/infinity_8b_keys.txt``,
    built by the official loader on the meta device): every key with its shape and dtype, and its
    8,375,791,824 parameters."""
    with init_empty_weights():
        t = InfinityTransformer(**INFINITY_PRESETS["infinity-8b"]["transformer"])
    keys, parameters = _key_file("infinity_8b_keys.txt")
    assert len(keys) == 862 and parameters == 8_375_791_824
    official = {k: s for k, s in keys.items() if not k.endswith("zero_k_bias")}
    assert len(keys) - len(official) == 2 * 40 + 1
    assert _layout(t) == official
    assert sum(p.numel() for p in t.parameters()) == parameters


def test_text_pool_heads_follow_the_t5_width_and_ffn_rounds_half_to_even():
    assert text_pool_heads(2048, 2048) == 16
    assert text_pool_heads(2048, 3584) == 16
    assert text_pool_heads(2048, 4608) == 32
    assert ffn_hidden(96, 4) == 512 and ffn_hidden(3360, 4) == 13312 and ffn_hidden(2048, 4) == 8192


# ---- loaders ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def official_sd(infinity_official_files):
    return torch.load(infinity_official_files["transformer"], weights_only=True)


@pytest.fixture(scope="module")
def official_vae_sd(infinity_official_files):
    return torch.load(infinity_official_files["vae"], weights_only=True)["vae"]


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return len(sa) > 0 and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_missing_and_unexpected_transformer_keys_are_named(official_sd, tmp_path):
    sd = dict(official_sd)
    del sd["block_chunks.1.module.0.ca.mat_q.bias"]
    sd["block_chunks.0.module.0.sa.extra"] = torch.zeros(3)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match=r"missing 1 keys \(block_chunks\.1\.module\.0\.ca\.mat_q\.bias\).*"
                                         r"unexpected 1 keys \(block_chunks\.0\.module\.0\.sa\.extra\)"):
        load_infinity_transformer(tmp_path / "bad.pth")


def test_wrong_shape_and_nonzero_key_bias_are_refused(official_sd, tmp_path):
    sd = dict(official_sd)
    sd["head.bias"] = torch.zeros(7)
    torch.save(sd, tmp_path / "shape.pth")
    with pytest.raises(ValueError, match="shapes do not fit"):
        load_infinity_transformer(tmp_path / "shape.pth")
    sd = dict(official_sd)
    sd["block_chunks.0.module.0.sa.zero_k_bias"] = torch.ones_like(sd["block_chunks.0.module.0.sa.zero_k_bias"])
    torch.save(sd, tmp_path / "kbias.pth")
    with pytest.raises(ValueError, match="zero_k_bias must be zero"):
        load_infinity_transformer(tmp_path / "kbias.pth")


def test_swapped_files_are_named(infinity_official_files):
    f = infinity_official_files
    with pytest.raises(ValueError, match="Infinity VAE"):
        load_infinity_transformer(f["vae"])
    with pytest.raises(ValueError, match="transformer checkpoint, but it was passed as the VAE"):
        load_infinity_vae(f["transformer"])


def test_transformer_containers_and_aliases(infinity_official_files, official_sd, tmp_path):
    ref = load_infinity_transformer(infinity_official_files["transformer"])
    # training checkpoint layout
    torch.save({"trainer": {"gpt_fsdp": official_sd}, "args": {"lr": 1.0}}, tmp_path / "ar-ckpt.pth")
    assert _same_weights(load_infinity_transformer(tmp_path / "ar-ckpt.pth"), ref)
    # legacy buffers, `module.` prefix, flash-attn (1, 1, H, 1) temperatures
    sd = {"module." + k: v for k, v in official_sd.items()}
    sd["module.lvl_1L"] = torch.zeros(1, 5, dtype=torch.long)
    k = "module.block_chunks.0.module.1.sa.scale_mul_1H11"
    sd[k] = sd[k].reshape(1, 1, -1, 1)
    torch.save(sd, tmp_path / "aliases.pth")
    assert _same_weights(load_infinity_transformer(tmp_path / "aliases.pth"), ref)
    # safetensors with the same keys
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in official_sd.items()}, str(tmp_path / "t.safetensors"))
    assert _same_weights(load_infinity_transformer(tmp_path / "t.safetensors"), ref)


def test_short_unconditional_table_is_padded_like_the_reference(official_sd, tmp_path):
    sd = dict(official_sd)
    sd["cfg_uncond"] = sd["cfg_uncond"][:100].clone()
    torch.save(sd, tmp_path / "short.pth")
    t = load_infinity_transformer(tmp_path / "short.pth")
    assert t.cfg_uncond.shape[0] == 512
    assert torch.equal(t.cfg_uncond[:100], official_sd["cfg_uncond"][:100])


def test_vae_containers_and_unwrapped_alias_keys(infinity_official_files, official_vae_sd, tmp_path):
    ref = load_infinity_vae(infinity_official_files["vae"])
    unwrapped = {k.replace(".conv.weight", ".weight").replace(".conv.bias", ".bias")
                 .replace(".norm.weight", ".weight").replace(".norm.bias", ".bias"): v
                 for k, v in official_vae_sd.items()}
    torch.save({"vae": unwrapped, "ema": unwrapped}, tmp_path / "infinity_vae_d32_reg.pth")
    assert _same_weights(load_infinity_vae(tmp_path / "infinity_vae_d32_reg.pth"), ref)
    sd = dict(official_vae_sd)
    del sd["decoder.conv_out.conv.bias"]
    torch.save({"vae": sd}, tmp_path / "bad_vae.pth")
    with pytest.raises(ValueError, match=r"missing 1 keys \(decoder\.conv_out\.conv\.bias\)"):
        load_infinity_vae(tmp_path / "bad_vae.pth")


def test_missing_files_say_what_to_put_where(infinity_official_files, tmp_path):
    f = infinity_official_files
    with pytest.raises(FileNotFoundError, match="flan-t5-xl"):
        InfinityPipeline.from_single_file(f["transformer"], f["vae"], text_encoder=tmp_path / "no_t5")
    with pytest.raises(FileNotFoundError, match="not found"):
        InfinityPipeline.from_single_file(tmp_path / "infinity_2b_reg.pth", f["vae"], text_encoder=f["t5"])
    with pytest.raises(FileNotFoundError, match="Nothing is downloaded"):
        InfinityPipeline.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"read as an official Infinity transformer checkpoint, which needs vae and "
                                         r"text_encoder \(vae: its VAE file"):
        InfinityPipeline.from_path(f["transformer"])
    with pytest.raises(FileNotFoundError, match=r"no such file or folder; give a converted folder"):
        InfinityPipeline.from_path(tmp_path / "missing")


def test_text_encoder_width_must_match(infinity_official_files):
    f = infinity_official_files
    tok, t5 = random_t5(64)
    with pytest.raises(ValueError, match="64-channel features.*reads 256"):
        InfinityPipeline(load_infinity_transformer(f["transformer"]), load_infinity_vae(f["vae"]), t5, tok)


# ---- pipeline inputs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=None), r"prompt is required"),
    (dict(prompt=[]), r"prompt must be a string or a non-empty list"),
    (dict(prompt=["a", 3]), r"prompt must be a string or a non-empty list"),
    (dict(negative_prompt=["x", "y", "z"], prompt=["a", "b"]), r"got 3 negative prompts for 2 prompts"),
    (dict(guidance_scale=-1.0), r"guidance_scale must be a number in \[0, 100\] \(1 disables guidance\).*-1\.0"),
    (dict(guidance_scale=float("inf")), r"guidance_scale must be a number in \[0, 100\].*inf"),
    (dict(temperature=0.0), r"temperature must be a number > 0"),
    (dict(top_k=-1), r"top_k must be an int >= 0"),
    (dict(top_p=1.5), r"top_p must be in \[0, 1\]"),
    (dict(num_images_per_prompt=0), r"num_images_per_prompt must be an int >= 1"),
    (dict(output_type="jpeg"), r"output_type must be one of"),
    (dict(prompt=["a", "b"], generator=[torch.Generator()] * 3), r"got 3 generators for 2 images"),
    (dict(callback_on_step_end_tensor_inputs=["codes", "hidden"]), r"has \['hidden'\]"),
    (dict(height=256, width=-3), r"width=-3: give a positive number of pixels"),
])
def test_invalid_arguments_are_named(tiny, kwargs, message):
    kw = dict(prompt="w3 w4", height=256, width=256)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


def test_from_random_takes_diffusers_dtype_strings_and_names_a_bad_one():
    p = InfinityPipeline.from_random("infinity-tiny", vae_dtype="bf16")
    assert {prm.dtype for prm in p.vae.parameters()} == {torch.bfloat16}
    with pytest.raises(TypeError, match=r"vae_dtype='int8' is not a weight dtype; pass torch.float32"):
        InfinityPipeline.from_random("infinity-tiny", vae_dtype="int8")


# ---- generation -----------------------------------------------------------------------------------------------
def test_output_types_and_sizes(tiny):
    out = tiny("w3 w4 w5", height=240, width=320, generator=_g(0), output_type="pt")  # 3:4, 7 scales
    assert isinstance(out, InfinityPipelineOutput)
    assert out.images.shape == (1, 3, 240, 320) and 0 <= out.images.min() and out.images.max() <= 1
    assert len(out.stats[0].scales) == 7 and out.stats[0].tokens == sum(h * w for h, w in
                                                                          resolve_resolution(240, 320).hw)
    pil = tiny("w3 w4 w5", height=240, width=320, generator=_g(0)).images
    assert isinstance(pil[0], PIL.Image.Image) and pil[0].size == (320, 240)
    arr = tiny("w3 w4 w5", height=240, width=320, generator=_g(0), output_type="np").images
    assert arr.shape == (1, 240, 320, 3)
    np.testing.assert_allclose(arr[0], out.images[0].permute(1, 2, 0).numpy(), atol=1e-6)
    lat, _ = tiny("w3 w4 w5", height=240, width=320, generator=_g(0), output_type="latent", return_dict=False)
    assert lat.shape == (1, 32, 15, 20)


def test_same_seed_same_bits_other_seed_other_bits(tiny):
    a = _bits(tiny, "w7 w8", top_k=900)[0]
    b = _bits(tiny, "w7 w8", top_k=900)[0]
    assert torch.equal(a, b)
    steps = []
    tiny("w7 w8", height=256, width=256, generator=_g(1), output_type="latent",
         callback_on_step_end=lambda p, si, t, d: steps.append(d) or d)
    assert not torch.equal(torch.cat([s["codes"] for s in steps], 1), a)


def test_batch_of_prompts_of_different_lengths_equals_single_runs(tiny):
    """Padded text (pool and cross-attention masks) must not leak between images of a batch, nor
    between the conditional and a shorter/longer negative prompt."""
    prompts = ["w3 w9 w10 w11 w12 w13 w14", "w5"]
    for kw in (dict(guidance_scale=3.0), dict(guidance_scale=3.0, negative_prompt=["w20 w21 w22", "w23"])):
        both, _, _ = _bits(tiny, prompts, **kw)
        for b, p in enumerate(prompts):
            one_kw = dict(kw)
            if "negative_prompt" in kw:
                one_kw["negative_prompt"] = kw["negative_prompt"][b]
            one, _, _ = _bits(tiny, p, **one_kw)
            assert torch.equal(both[b:b + 1], one), (kw, p)


def test_num_images_per_prompt_repeats_each_prompt(tiny):
    bits, _, _ = _bits(tiny, ["w3 w4", "w9"], num_images_per_prompt=2)
    assert bits.shape[0] == 4
    assert torch.equal(bits[0], bits[1]) and torch.equal(bits[2], bits[3]) and not torch.equal(bits[0], bits[2])


def test_negative_prompt_and_guidance_off(tiny):
    plain, _, _ = _bits(tiny, "w3 w4", guidance_scale=3.0)
    neg, _, _ = _bits(tiny, "w3 w4", guidance_scale=3.0, negative_prompt="w30 w31")
    assert not torch.equal(plain, neg)
    off, _, steps = _bits(tiny, "w3 w4", guidance_scale=1.0, negative_prompt="w30 w31")
    off2, _, _ = _bits(tiny, "w3 w4", guidance_scale=1.0)
    assert torch.equal(off, off2)                                            # guidance off ignores the negative


def test_save_pretrained_round_trip(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "inf")
    assert {p.name for p in (tmp_path / "inf").iterdir()} >= {"model_index.json", "transformer", "vae",
                                                               "text_encoder", "tokenizer"}
    loaded = InfinityPipeline.from_pretrained(tmp_path / "inf")
    loaded.set_progress_bar_config(disable=True)
    a = tiny("w3 w4", height=256, width=256, generator=_g(0), output_type="pt").images
    b = loaded("w3 w4", height=256, width=256, generator=_g(0), output_type="pt").images
    assert torch.equal(a, b)
    assert all(not p.requires_grad for p in loaded.transformer.parameters())


def test_interrupt_decodes_the_scales_so_far(tiny):
    def stop_after_3(p, si, t, d):
        if si == 2:
            p._interrupt = True
        return d

    out = tiny("w3", height=256, width=256, generator=_g(0), output_type="pt", callback_on_step_end=stop_after_3)
    assert sum(not s.skipped for s in out.stats[0].scales) == 3
    assert out.images.shape == (1, 3, 256, 256)


# ---- the KV-cached path equals teacher forcing (non-square, patchify) -----------------------------------------
def _patchify_pipe() -> InfinityPipeline:
    """A tiny random model in the 8B layout: 8-bit VAE at stride 8, 2×2 patches → 32-bit tokens."""
    torch.manual_seed(0)
    t = InfinityTransformer(token_dim=32, depth=2, embed_dim=128, num_heads=4, text_channels=256, num_block_chunks=2)
    t.init_random_weights(0.05)
    v = BSQVAE(codebook_dim=8, base_ch=32, ch_mult=(1, 1, 1, 2), num_res_blocks=1, patch_size=8).init_random_weights()
    tok, t5 = random_t5(256)
    p = InfinityPipeline(t.eval().requires_grad_(False), v.eval().requires_grad_(False), t5, tok)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.mark.parametrize("which, height, width, absorb", [("tiny", 240, 320, "auto"), ("tiny", 336, 224, "never"),
                                                            ("patchify", 256, 256, "auto")])
def test_kv_cached_generation_equals_teacher_forcing(tiny, which, height, width, absorb):
    """Teacher forcing runs the cross-attention's projections as such; the KV-cached path runs the
    absorbed form ("auto" with these short prompts) or the projections ("never")."""
    pipe = tiny if which == "tiny" else _patchify_pipe()
    assert pipe.is_patchify == (which == "patchify")
    res = resolve_resolution(height, width)
    adapter = pipe.adapter()
    adapter.absorb_cross_attention = absorb
    try:
        bits, latent, steps = _bits(pipe, ["w3 w4 w5", "w6"], height=height, width=width, guidance_scale=1.0,
                                    temperature=1.0)
        assert adapter._workspace.ca_absorbed == (absorb == "auto")
    finally:
        adapter.absorb_cross_attention = "auto"
    x = torch.cat([next_scale_input(steps[k]["latent"], res.hw[k + 1], pipe.is_patchify)
                   for k in range(len(res.hw) - 1)], dim=1)
    with torch.no_grad():
        logits = pipe.transformer(pipe.encode_prompt(["w3 w4 w5", "w6"]), x, res)
    torch.testing.assert_close(torch.cat([s["logits"] for s in steps], dim=1), logits, atol=1e-4, rtol=0)
    if pipe.is_patchify:
        H, W = res.hw[-1]
        assert latent.shape == (2, 8, 2 * H, 2 * W)
        img = pipe("w6", height=height, width=width, generator=_g(0), output_type="pt").images
        assert img.shape == (1, 3, height, width)


@pytest.mark.parametrize("R, l, T, H, d, masked", [(1, 1, 1, 1, 8, False), (3, 13, 7, 4, 16, True),
                                                    (2, 37, 33, 2, 24, True)])
def test_absorbed_cross_attention_equals_projections_then_attention(R, l, T, H, d, masked):
    """Folding mat_q and proj into the text memory is exact up to float32 rounding, also where it is
    not the cheaper form (T = 33 with H·T > C/2), with per-row key masks and non-zero biases."""
    g = torch.Generator().manual_seed(R * 100 + l)
    ca = InfinityCrossAttention(H * d, H)
    with torch.no_grad():
        for prm in ca.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
    text_RTC = torch.randn(R, T, H * d, generator=g)
    y_RlC = torch.randn(R, l, H * d, generator=g)
    lens = torch.randint(1, T + 1, (R,), generator=g) if masked else torch.full((R,), T)
    valid_RT = torch.arange(T)[None, :] < lens[:, None]
    k, v = ca.text_kv(text_RTC)
    with torch.no_grad():
        ref = ca(y_RlC, CrossMemory(k, v, valid_RT[:, None, None, :] if masked else None))
        out = ca(y_RlC, ca.absorb(k, v, valid_RT if masked else None))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_absorbed_form_is_chosen_only_where_it_is_less_work_and_small():
    assert absorbs_cross_attention(16, 32, 2048) and absorbs_cross_attention(16, 64, 2048)
    assert not absorbs_cross_attention(16, 96, 2048) and not absorbs_cross_attention(28, 96, 3584)
    assert not absorbs_cross_attention(16, 32, 2048, memory_bytes=2 << 30)     # too large a memory


def test_shared_last_scale_tail_of_the_kv_cache_changes_nothing(tiny):
    """The KV cache with one last-scale tail shared by the layers (what large caches get) and the
    full per-layer cache give the same bits and logits; "auto" keeps a tiny model's cache whole."""
    adapter = tiny.adapter()
    got = {}
    try:
        for tail in (True, False, "auto"):
            adapter.kv_tail = tail
            bits, _, steps = _bits(tiny, ["w3 w4 w5", "w6"], height=240, width=320, guidance_scale=3.0)
            got[tail] = (bits, steps[-1]["logits"])
            assert adapter._workspace.kv_tail == (tail is True)
            assert adapter._workspace.kv.transient == (240 // 16 * 320 // 16 if tail is True else 0)
    finally:
        adapter.kv_tail = "auto"
    for tail in (False, "auto"):
        assert torch.equal(got[tail][0], got[True][0])
        torch.testing.assert_close(got[tail][1], got[True][1], atol=1e-5, rtol=0)
    for knob, value in (("kv_tail", "yes"), ("absorb_cross_attention", "sometimes")):
        setattr(adapter, knob, value)
        try:
            with pytest.raises(ValueError, match=f"{knob}={value!r}: choose 'auto'"):
                _bits(tiny, "w3", height=256, width=256)
        finally:
            setattr(adapter, knob, "auto")
        _bits(tiny, "w3", height=256, width=256)                       # the next run works


def test_flop_model_counts_the_dense_loop_and_the_tokens_a_policy_drops(tiny):
    out = tiny("w3", height=256, width=256, generator=_g(0), output_type="latent")
    assert tiny.flop_speedup(out.stats[0], 256, 256, text_tokens=64) == 1.0
    tiny.enable_sparsevar(keep_ratio=0.5, start_scale=-2, granularity="layer", block=2)
    try:
        kept = tiny("w3", height=256, width=256, generator=_g(0), output_type="latent").stats[0]
    finally:
        tiny.disable_sparsevar()
    sides = (1, 2, 4, 6, 8, 12, 16)                                            # 256x256: 7 square scales
    computed = [n * n for n in sides[:-2]] + [72, 128]                          # keep half of 12² and 16²
    assert [s.tokens_computed for s in kept.scales] == computed
    # The expectation from first principles (2 FLOPs per multiply-add), infinity-tiny, guidance (2 rows):
    C, hidden, V, depth, T = 128, 512, 2 * 32, 4, 64                            # V: two logits per bit
    cfg = tiny.transformer.config
    assert (cfg.embed_dim, cfg.depth, 2 * cfg.token_dim, tiny.transformer.blocks[0].ffn.fc1.out_features) == \
        (C, depth, V, hidden)

    def loop(tokens):
        total = 2 * depth * T * 2 * (2 * C * C)                   # text K and V, once per layer and row
        cached = 0
        for side, n in zip(sides, tokens):
            cached += n                                           # attends to every token computed so far
            per_layer = n * 2 * (4 * C * C)                       # self-attention q, k, v, output
            per_layer += n * 2 * (2 * C * C)                      # cross-attention q, output
            per_layer += n * 2 * (2 * C * hidden)                 # FFN
            per_layer += 2 * (2 * n * cached * C) + 2 * (2 * n * T * C)   # q·kᵀ, attention·v: self, cross
            total += 2 * (depth * per_layer + 2 * side * side * C * V)    # the head on the whole map
        return total

    expected = Fraction(loop([n * n for n in sides]), loop(computed))
    assert expected == Fraction(694209, 385657)                                # ≈ 1.8001
    # integers below 2**53 summed in float64 are exact; the one division is correctly rounded
    assert tiny.flop_speedup(kept, 256, 256, text_tokens=64) == float(expected)


def test_sharded_folder_like_the_8b_release(infinity_official_files, official_sd, tmp_path):
    import json
    from safetensors.torch import save_file
    keys = list(official_sd)
    half = len(keys) // 2
    shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: official_sd[k].contiguous() for k in ks}, str(tmp_path / name))
        weight_map.update({k: name for k in ks})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ref = load_infinity_transformer(infinity_official_files["transformer"])
    assert _same_weights(load_infinity_transformer(tmp_path), ref)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard .*model-00002-of-00002.safetensors.* is missing"):
        load_infinity_transformer(tmp_path)


def test_describe_infinity_files(infinity_official_files):
    from sparsevar.models.loading import describe_infinity_checkpoint
    t = describe_infinity_checkpoint(infinity_official_files["transformer"])
    assert t["family"] == "infinity" and t["depth"] == 4 and t["token_dim"] == 32
    v = describe_infinity_checkpoint(infinity_official_files["vae"])
    assert v["family"] == "infinity-vae" and v["codebook_dim"] == 32 and v["patch_size"] == 16


# ---- call defaults and per-call policies ------------------------------------------------------------------------
def test_temperature_defaults_to_half_and_to_one_for_a_patchify_model(tiny):
    """The signature's None is τ = 0.5 for the 2B layout and 1.0 for a patchify (8B-layout) model."""
    for pipe, default, other in ((tiny, 0.5, 1.0), (_patchify_pipe(), 1.0, 0.5)):
        codes = _bits(pipe, "a red fox", top_k=900)[0]
        assert torch.equal(codes, _bits(pipe, "a red fox", top_k=900, temperature=default)[0])
        assert not torch.equal(codes, _bits(pipe, "a red fox", top_k=900, temperature=other)[0])


def test_per_call_policies_are_validated_before_any_work(tiny):
    """A per-call policy this model cannot run is refused as VAR refuses it: a ValueError before the
    prompt is encoded or any scale runs."""
    from sparsevar.policies.scale_skip import ScaleSkipConfig, ScaleSkipPolicy

    encoded, scales = [], []
    hook = tiny.text_encoder.register_forward_pre_hook(lambda module, args: encoded.append(1))
    try:
        with pytest.raises(ValueError, match=r"skip_last=99 would skip every scale"):
            tiny("a red fox", height=256, width=256, policies=[ScaleSkipPolicy(ScaleSkipConfig(skip_last=99))],
                 callback_on_step_end=lambda p, si, t, kw: scales.append(si) or kw)
        assert encoded == [] and scales == []
        tiny("a red fox", height=256, width=256, top_k=1, output_type="latent")    # the hook does see a call
        assert encoded != []
    finally:
        hook.remove()
