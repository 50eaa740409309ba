"""Tests of the multi-scale VQVAE (``sparsevar.models.vqvae``).

Parity tests load the fixture VQVAE from an official-format checkpoint (``var_official_files['vae']``)
and compare with ``vqvae.safetensors``. Schedule, sizes and batch are read from the fixture files,
so any fixture set in the same format works.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sparsevar.models.vqvae import MultiScaleVQVAE, phi_index_table

ATOL_LATENT = 1e-5   # f, fhat_*, x_BLCv_wo_first_l
ATOL_IMAGE = 1e-4    # decoded images


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------------------------------
# parity fixtures
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vae(var_official_files) -> MultiScaleVQVAE:
    sd = torch.load(var_official_files["vae"], map_location="cpu", weights_only=True)
    for k in MultiScaleVQVAE.official_extra_keys():
        sd.pop(k, None)
    model = MultiScaleVQVAE(**MultiScaleVQVAE.config_from_state_dict(sd))
    model.load_state_dict(sd, strict=True)
    return model.eval().float()


@pytest.fixture(scope="module")
def vq_expected(var_fixture_dir) -> dict[str, torch.Tensor]:
    return load_file(str(var_fixture_dir / "vqvae.safetensors"))


@pytest.fixture(scope="module")
def schedule(var_fixture_config) -> list[tuple[int, int]]:
    return [(int(p), int(p)) for p in var_fixture_config["patch_nums"]]


@pytest.fixture(scope="module")
def img(vq_expected) -> torch.Tensor:
    x = vq_expected["img_uint8"].float() / 255
    return x + x - 1  # reference data pipeline, [-1, 1]


@pytest.fixture(scope="module")
def encoded(vae, img, schedule):
    """(f, idx_list, fhat_list) of our implementation on the fixture images."""
    with torch.no_grad():
        f = vae.encode(img)
        idx_list, fhat_list = vae.quantize_multiscale(f, schedule)
    return f, idx_list, fhat_list


def _expected_idx(vq_expected, schedule) -> list[torch.Tensor]:
    return [vq_expected[f"idx_s{k}"] for k in range(len(schedule))]


@pytest.mark.parity
def test_phi_table_matches_fixture(vae, var_fixture_config, schedule):
    want = var_fixture_config["phi_index_per_scale"]
    assert [vae.phi_index(si, len(schedule)) for si in range(len(schedule))] == want


@pytest.mark.parity
def test_encode(encoded, vq_expected):
    f, _, _ = encoded
    err = _max_abs(f, vq_expected["f"])
    assert err <= ATOL_LATENT, f"f max abs err {err:.3e}"


@pytest.mark.parity
def test_indices_exact(encoded, vq_expected, schedule, vae, img):
    _, idx_list, _ = encoded
    want = _expected_idx(vq_expected, schedule)
    assert len(idx_list) == len(want)
    for k, (got, exp) in enumerate(zip(idx_list, want)):
        assert got.dtype == torch.int64
        assert got.shape == exp.shape, (k, tuple(got.shape), tuple(exp.shape))
        assert torch.equal(got, exp), f"idx_s{k}: {(got != exp).sum().item()} codes differ"
    # img_to_idx is the same path
    with torch.no_grad():
        again = vae.img_to_idx(img, schedule)
    assert len(again) == len(idx_list) > 0 and all(torch.equal(a, b) for a, b in zip(again, idx_list))


@pytest.mark.parity
def test_fhat_per_scale(encoded, vq_expected, schedule):
    _, _, fhat_list = encoded
    for k in range(len(schedule)):
        exp = vq_expected[f"fhat_s{k}"]
        got = fhat_list[k][: exp.shape[0]]
        assert got.dtype == torch.float32
        err = _max_abs(got, exp)
        assert err <= ATOL_LATENT, f"fhat_s{k} max abs err {err:.3e}"


@pytest.mark.parity
def test_fhat_from_idx(vae, vq_expected, schedule):
    with torch.no_grad():
        got = vae.idx_to_fhat(_expected_idx(vq_expected, schedule), schedule)
    err = _max_abs(got, vq_expected["fhat_from_idx"])
    assert err <= ATOL_LATENT, f"fhat_from_idx max abs err {err:.3e}"


@pytest.mark.parity
def test_recon_from_idx(vae, vq_expected, schedule):
    exp = vq_expected["recon_from_idx"]
    n = exp.shape[0]
    idx = [i[:n] for i in _expected_idx(vq_expected, schedule)]
    with torch.no_grad():
        got = vae.idx_to_img(idx, schedule)
    assert got.min() >= -1 and got.max() <= 1
    err = _max_abs(got, exp)
    assert err <= ATOL_IMAGE, f"recon_from_idx max abs err {err:.3e}"


@pytest.mark.parity
def test_img_from_fhat_non_square(vae, vq_expected):
    fhat_in = vq_expected["fhat_in"]
    before = fhat_in.clone()
    with torch.no_grad():
        got = vae.fhat_to_img(fhat_in)
    assert torch.equal(fhat_in, before), "fhat_to_img modified its input"
    err = _max_abs(got, vq_expected["img_from_fhat"])
    assert err <= ATOL_IMAGE, f"img_from_fhat max abs err {err:.3e}"


@pytest.mark.parity
def test_var_input(vae, vq_expected, schedule):
    idx = _expected_idx(vq_expected, schedule)
    with torch.no_grad():
        got = vae.idx_to_var_input(idx, schedule)
        got_short = vae.idx_to_var_input(idx[:-1], schedule)
    exp = vq_expected["x_BLCv_wo_first_l"]
    err = _max_abs(got, exp)
    assert err <= ATOL_LATENT, f"x_BLCv_wo_first_l max abs err {err:.3e}"
    assert torch.equal(got, got_short)


@pytest.mark.parity
def test_next_stage_input_matches_fhat_from_idx(vae, vq_expected, schedule):
    """The AR step, fed with the fixture codes, reproduces fhat_from_idx and the TF inputs."""
    idx = _expected_idx(vq_expected, schedule)
    B = idx[0].shape[0]
    H, W = schedule[-1]
    f_hat = torch.zeros(B, vae.config.z_channels, H, W)
    nexts = []
    with torch.no_grad():
        for si, (ph, pw) in enumerate(schedule):
            f_hat, nxt = vae.next_stage_input(si, schedule, f_hat, vae.embed(idx[si], ph, pw))
            if si < len(schedule) - 1:
                nexts.append(nxt.flatten(2).transpose(1, 2))
    assert _max_abs(f_hat, vq_expected["fhat_from_idx"]) <= ATOL_LATENT
    assert _max_abs(torch.cat(nexts, 1), vq_expected["x_BLCv_wo_first_l"]) <= ATOL_LATENT


# ------------------------------------------------------------------------------------------------
# unit tests (no fixtures)
# ------------------------------------------------------------------------------------------------
def _small_model(seed: int = 0, **kw) -> MultiScaleVQVAE:
    torch.manual_seed(seed)
    kw = {"vocab_size": 16, "z_channels": 8, "ch": 32, "ch_mult": (1, 2), "num_res_blocks": 1,
          "patch_nums": (1, 2, 3, 4), **kw}
    model = MultiScaleVQVAE(**kw).eval()
    with torch.no_grad():  # O(1) random weights so that every path matters
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_phi_index_tables():
    assert phi_index_table(10) == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert phi_index_table(14) == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    assert phi_index_table(1) == [0]
    m = _small_model()
    assert [m.phi_index(si, 10) for si in range(10)] == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert [m.phi_index(si, 14) for si in range(14)] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    with pytest.raises(ValueError, match="si"):
        m.phi_index(10, 10)


@pytest.mark.parametrize("kw", [
    {},
    {"ch_mult": (1, 1, 2), "num_res_blocks": 2, "num_phi": 3},
    {"ch_mult": (1, 2), "using_sa": False, "using_mid_sa": False, "num_phi": 1},
])
def test_config_from_state_dict_roundtrip(kw):
    m = _small_model(**kw)
    sd = m.state_dict()
    cfg = MultiScaleVQVAE.config_from_state_dict(sd)
    for key, val in cfg.items():
        want = m.config[key]
        assert (list(val) if isinstance(val, (list, tuple)) else val) == \
            (list(want) if isinstance(want, (list, tuple)) else want), key
    m2 = MultiScaleVQVAE(**cfg, patch_nums=m.config.patch_nums)
    m2.load_state_dict(sd, strict=True)
    assert set(m2.state_dict()) == set(sd)
    assert "quantize.ema_vocab_hit_SV" not in sd
    assert MultiScaleVQVAE.official_extra_keys() == {"quantize.ema_vocab_hit_SV"}


def test_config_lists_accepted():
    m = MultiScaleVQVAE(vocab_size=16, z_channels=8, ch=32, ch_mult=[1, 2], num_res_blocks=1,
                        patch_nums=[1, 2, 4])
    assert m.default_schedule() == [(1, 1), (2, 2), (4, 4)]


def test_config_from_state_dict_rejects_other_dicts():
    with pytest.raises(ValueError, match="not a VAR VQVAE"):
        MultiScaleVQVAE.config_from_state_dict({"blocks.0.attn.mat_qkv.weight": torch.zeros(3, 3)})
    sd = {"vae." + k: v for k, v in _small_model().state_dict().items()}
    with pytest.raises(ValueError, match="prefix"):
        MultiScaleVQVAE.config_from_state_dict(sd)


def test_next_stage_input_non_square():
    m = _small_model()
    schedule = [(1, 1), (1, 2), (2, 3), (3, 4), (4, 6)]
    B, C = 2, m.config.z_channels
    gen = torch.Generator().manual_seed(0)
    idx = [torch.randint(0, m.config.vocab_size, (B, h * w), generator=gen) for h, w in schedule]
    H, W = schedule[-1]
    f_hat = torch.zeros(B, C, H, W)
    nexts = []
    with torch.no_grad():
        for si, (h, w) in enumerate(schedule):
            f_in = f_hat
            f_hat, nxt = m.next_stage_input(si, schedule, f_hat, m.embed(idx[si], h, w))
            assert f_hat is f_in  # in-place accumulation
            if si < len(schedule) - 1:
                assert nxt.shape == (B, C, *schedule[si + 1])
                nexts.append(nxt.flatten(2).transpose(1, 2))
            else:
                assert nxt is f_hat
        ref = m.idx_to_fhat(idx, schedule)
        var_in = m.idx_to_var_input(idx, schedule)
        img = m.idx_to_img(idx, schedule)
    assert f_hat.shape == (B, C, H, W)
    assert (f_hat - ref).abs().max().item() <= 1e-5
    L = sum(h * w for h, w in schedule)
    assert var_in.shape == (B, L - 1, C)
    assert (torch.cat(nexts, 1) - var_in).abs().max().item() <= 1e-5
    f = m.downsample_factor
    assert img.shape == (B, 3, H * f, W * f) and img.abs().max() <= 1


def test_quantize_non_square_roundtrip():
    m = _small_model()
    schedule = [(1, 1), (2, 3), (4, 6)]
    img = torch.rand(2, 3, 4 * m.downsample_factor, 6 * m.downsample_factor) * 2 - 1
    with torch.no_grad():
        f = m.encode(img)
        idx, fhats = m.quantize_multiscale(f, schedule)
        assert [tuple(i.shape) for i in idx] == [(2, h * w) for h, w in schedule]
        assert (m.idx_to_fhat(idx, schedule) - fhats[-1]).abs().max().item() <= 1e-5
        with pytest.raises(ValueError, match="schedule"):
            m.quantize_multiscale(f)  # default square schedule ends at 4x4, latent is 4x6


@pytest.mark.parametrize("hw,size", [((1, 1), (16, 16)), ((2, 3), (16, 16)), ((13, 13), (16, 16)), ((5, 7), (16, 24))])
def test_bicubic_operator_is_torch_bicubic(hw, size):
    """The operator VAR's latent update multiplies by on CUDA is PyTorch's bicubic upsampling
    (borders clamped; odd and non-square maps) to float32 rounding."""
    from sparsevar.models.vqvae import bicubic_operator
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, *hw, generator=g) * 3
    want = F.interpolate(x, size=size, mode="bicubic", align_corners=False)
    got = (x.reshape(12, hw[0] * hw[1]) @ bicubic_operator(hw, size, "cpu")).view(4, 3, *size)
    assert (got - want).abs().max().item() <= 4e-6 * want.abs().max().item()


# ------------------------------------------------------------------------------------------------
# the decode side's options (the demo model's decoder)
# ------------------------------------------------------------------------------------------------
def test_channel_norm_normalises_each_pixel_over_its_channels():
    from sparsevar.models.vqvae import ChannelNorm
    g = torch.Generator().manual_seed(0)
    norm = ChannelNorm(6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6, generator=g))
        norm.bias.copy_(torch.randn(6, generator=g))
    x = torch.randn(2, 6, 5, 7, generator=g) * 4 + 3
    got = norm(x)
    x64 = x.double()
    for b, y, xx in ((0, 0, 0), (1, 4, 6), (1, 2, 3)):                      # pixel by pixel, in float64
        v = x64[b, :, y, xx]
        want = (v - v.mean()) / torch.sqrt(((v - v.mean()) ** 2).mean() + 1e-6)
        want = want * norm.weight.double() + norm.bias.double()
        assert torch.allclose(got[b, :, y, xx].double(), want, atol=1e-5)
    shifted = x.clone()
    shifted[0, :, 0, 0] += 1e4                                               # a spike in one pixel ...
    assert torch.equal(norm(shifted)[0, :, 1:], got[0, :, 1:])              # ... leaves the others alone


def test_demo_decode_side_keeps_flat_latents_flat_up_to_the_corners():
    """With per-pixel norm and replicate padding a constant latent decodes to a constant picture,
    whatever the weights: no corner or border can differ. The official decode side (GroupNorm, zero
    padding) does not have this property, which is how the demo's first decoder could paint a
    smudge into the top-left corner of every picture."""
    latent = torch.randn(1, 32, 1, 1, generator=torch.Generator().manual_seed(1)).expand(2, 32, 8, 8).contiguous()
    spreads = {}
    for norm, padding in (("channel", "replicate"), ("group", "zeros")):
        torch.manual_seed(0)
        m = MultiScaleVQVAE(vocab_size=16, ch=32, ch_mult=(1, 2), num_res_blocks=1, patch_nums=(1, 2, 8),
                            decoder_norm=norm, decoder_padding=padding).eval()
        with torch.no_grad():
            for p in m.parameters():                                         # every weight random, norms too
                p.normal_(0, 0.3)
            img = m.decoder(m.post_quant_conv(latent))
        assert img.shape == (2, 3, 16, 16)
        spreads[norm] = (img - img[:, :, :1, :1]).abs().max().item()
    assert spreads["channel"] <= 1e-5 and spreads["group"] > 1e-2, spreads


def test_decode_side_options_keep_the_keys_and_are_validated():
    kw = dict(vocab_size=16, ch=32, ch_mult=(1, 2), num_res_blocks=1, patch_nums=(1, 2, 4))
    official = MultiScaleVQVAE(**kw).state_dict()
    demo = MultiScaleVQVAE(**kw, decoder_norm="channel", decoder_padding="replicate")
    assert {k: v.shape for k, v in demo.state_dict().items()} == {k: v.shape for k, v in official.items()}
    demo.load_state_dict(official, strict=True)                             # warm start from a GroupNorm decoder
    assert demo.encoder.down[0].block[0].norm1.__class__ is torch.nn.GroupNorm      # the encoder is official
    with pytest.raises(ValueError, match="decoder_norm='layer'.*'group', 'channel'"):
        MultiScaleVQVAE(**kw, decoder_norm="layer")
    with pytest.raises(ValueError, match="decoder_padding='reflect'.*'zeros', 'replicate'"):
        MultiScaleVQVAE(**kw, decoder_padding="reflect")


@pytest.mark.parametrize("cin,cout", [(32, 32), (32, 64)])
def test_a_residual_block_with_its_biases_folded_gives_the_block(cin, cout):
    """The decoders' fast path runs the convolutions without their biases: conv1's is added by the
    next norm as it reads, conv2's and the 1×1 shortcut's by the residual add. Forced on the CPU (the
    ops' torch twins) it gives the module's own result, with every bias and norm affine non-zero."""
    from sparsevar.models._blocks import resnet_block
    from sparsevar.models.vqvae import ResnetBlock
    torch.manual_seed(0)
    blk = ResnetBlock(cin, cout).eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0, 0.3)
        x = torch.randn(2, cin, 9, 7) * 2 + 1
        plain = blk(x)
        shortcut = None if cin == cout else blk.nin_shortcut
        folded = resnet_block(x, blk.norm1, blk.conv1, blk.norm2, blk.conv2, shortcut, fold=True)
        no_biases = resnet_block(x, blk.norm1, blk.conv1, blk.norm2, blk.conv2, shortcut, fold=False)
    assert torch.equal(no_biases, plain)                                   # fold=False is the module itself
    assert blk.conv1.bias.abs().min() > 0 and (plain - folded).abs().max() <= 1e-5 * plain.abs().max()
    with torch.no_grad():                                                   # the biases matter: dropping one shows
        blk.conv2.bias.zero_()
        assert (blk(x) - plain).abs().max() > 1e-2


def test_the_decode_graph_key_stops_past_one_megapixel():
    """The engine replays a decode from a graph only up to one 1024² picture's pixels (a graph keeps
    its activations' memory between calls); the decoder's weights are in the workspace's key."""
    from sparsevar.models._blocks import DECODE_GRAPH_PIXELS, decode_graph_key
    assert DECODE_GRAPH_PIXELS == 1024 * 1024
    def latent(b, h, w):                                    # (B, C, h, w), as the workspaces hold it
        return torch.empty(b, 32, h, w, device="meta")
    assert decode_graph_key(latent(1, 64, 64), 16) == () and decode_graph_key(latent(4, 32, 32), 16) == ()
    assert decode_graph_key(latent(2, 64, 64), 16) is None and decode_graph_key(latent(1, 64, 65), 16) is None
    assert decode_graph_key(latent(1, 128, 128), 8) == () and decode_graph_key(latent(1, 128, 129), 8) is None
