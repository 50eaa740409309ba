"""Token-map pictures (sparsevar.viz) and the CLI acceleration flags."""
from __future__ import annotations

import PIL.Image
import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.cli import main
from sparsevar.policies.sparsevar import TOKEN_ANCHOR, TOKEN_EXCLUDED
from sparsevar.engine.state import GenerationStats
from sparsevar.viz import LEGEND_ITEMS, ROLE_STYLE, save_token_maps, token_map_figure, token_map_panel


def test_panel_tints_each_token_by_its_role():
    roles = torch.tensor([[TOKEN_EXCLUDED, TOKEN_ANCHOR]], dtype=torch.uint8)    # 1×2 map
    img = torch.ones(3, 8, 8)                                                    # white image
    px = PIL.Image.Image.getpixel
    panel = token_map_panel(roles, img, size=8)
    (rgb_x, a_x), (rgb_a, a_a) = ROLE_STYLE[TOKEN_EXCLUDED], ROLE_STYLE[TOKEN_ANCHOR]
    for xy, rgb, a in (((1, 1), rgb_x, a_x), ((6, 6), rgb_a, a_a)):          # ±1: float32 blending
        expected = [(1 - a) * 255 + a * c for c in rgb]
        got = px(panel, xy)
        assert len(got) == len(expected) == 3 and all(abs(g - e) <= 1 for g, e in zip(got, expected))


def _ink(img: PIL.Image.Image):
    """Mask of the pixels text darkened (anything clearly off white), as a uint8 numpy array."""
    import numpy as np
    return (np.asarray(img.convert("L")) < 200).astype(np.uint8)


@pytest.mark.parametrize("num_scales", [1, 2, 3])
def test_figure_legend_fits_the_figure(num_scales):
    """Issue #27: with one or two pruned scales the legend ran off the figure ("red: anch"). Every
    legend item, measured in PIL's default font, fits the figure's width, and the legend drawn
    below the panels holds all of their ink with nothing touching the right edge."""
    import PIL.ImageDraw
    roles = torch.randint(0, 4, (2, 10, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    stats = GenerationStats(token_maps={9 - k: roles for k in range(num_scales)})
    fig = token_map_figure(stats, size=192)
    measure = PIL.ImageDraw.Draw(PIL.Image.new("RGB", (1, 1)))
    assert all(measure.textlength(item) <= fig.width for item in LEGEND_ITEMS)
    band = _ink(fig.crop((0, 18 + 192 + 1, fig.width, fig.height)))     # below the panels: the legend alone
    assert band[:, -4:].sum() == 0                                          # no glyph reaches the right edge
    expected = 0
    for item in LEGEND_ITEMS:                                               # each item alone, on a wide canvas
        canvas = PIL.Image.new("RGB", (1200, 30), (255, 255, 255))
        PIL.ImageDraw.Draw(canvas).text((4, 4), item, fill=(60, 60, 60))
        expected += int(_ink(canvas).sum())
    assert expected > 0 and band.sum() >= 0.97 * expected, (band.sum(), expected)
    assert token_map_figure(stats, batch_index=1).size == fig.size          # a batch's figures stack


def test_save_token_maps_writes_one_png_per_image(tmp_path, var_official_files):
    pipe = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"])
    pipe.set_progress_bar_config(disable=True)
    plain = pipe([3], generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="enable_sparsevar"):
        token_map_figure(plain.stats[0])
    out = pipe.enable_sparsevar(keep_ratio=0.5, start_scale=-3)([3, 4], generator=torch.Generator().manual_seed(0))
    paths = save_token_maps(out.stats[0], out.images, tmp_path / "maps")
    assert [p.name for p in paths] == ["token_maps_0.png", "token_maps_1.png"]
    fig = PIL.Image.open(paths[0])
    assert fig.width > 3 * 192 and fig.height > 192                              # three pruned scales side by side


def test_cli_acceleration_flags(tmp_path, var_official_files, capsys):
    files = ["--var-ckpt", str(var_official_files["var"]), "--vae-ckpt", str(var_official_files["vae"])]
    rc = main(["generate", *files, "--class", "3", "--out", str(tmp_path / "a.png"), "--quiet", "--sparsevar",
               "--keep-ratio", "0.5", "--start-scale", "-2", "--save-token-maps", str(tmp_path / "maps"), "--stats"])
    text = capsys.readouterr().out
    assert rc == 0 and (tmp_path / "maps" / "a_tokens_0.png").is_file()
    assert "50%" in text                                                          # the per-scale table
    assert main(["generate", *files, "--class", "3", "--out", str(tmp_path / "b.png"), "--quiet",
                 "--fastvar", "0.5", "1.0", "--skip-last", "1"]) == 0
    assert "9/10 scales" in capsys.readouterr().out
    assert main(["generate", *files, "--class", "3", "--out", str(tmp_path / "c.png"), "--quiet", "--tau", "0.5"]) == 2
    assert "add --sparsevar" in capsys.readouterr().err
    assert main(["generate", *files, "--class", "3", "--out", str(tmp_path / "d.png"), "--quiet", "--sparsevar",
                 "--fastvar"]) == 2
    err = capsys.readouterr().err                                                 # CLI flags, not Python advice
    assert "--sparsevar and --fastvar" in err and "disable_sparsevar" not in err and not (tmp_path / "d.png").exists()
