"""The embedded demo model (issue #7): its procedural data, its training command, and what it draws.

The quality checks use the classifier that ships beside the model (trained by ``train-demo`` on
scenes and on their VQVAE reconstructions). Thresholds come from measurements recorded in the
comments next to them.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from sparsevar import VARPipeline
from sparsevar.benchmarks.metrics import psnr
from sparsevar.cli import main
from sparsevar.demo import CLASS_NAMES, DEMO_MODEL_DIR, NUM_CLASSES, SceneConfig, class_id, render_scenes
from sparsevar.demo.classifier import SceneClassifier
from sparsevar.demo.measures import corner_smudge_ratio, strong_edge_fraction
from sparsevar.demo.train import DemoTrainConfig, measure_demo, train_demo


# ---- procedural scenes -----------------------------------------------------------------------------
def test_scenes_are_deterministic_per_seed_and_differ_between_seeds():
    labels = torch.arange(NUM_CLASSES)
    a = render_scenes(labels, torch.Generator().manual_seed(3), SceneConfig(size=64))
    b = render_scenes(labels, torch.Generator().manual_seed(3), SceneConfig(size=64))
    c = render_scenes(labels, torch.Generator().manual_seed(4), SceneConfig(size=64))
    assert a.shape == (NUM_CLASSES, 3, 64, 64) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert (a - c).abs().mean() > 0.05
    assert a.min() >= 0 and a.max() <= 1


def test_scenes_have_flat_regions_and_sharp_edges():
    """What SparseVAR exploits: most 16×16 cells are nearly flat, and objects have edges (strong ones
    in most images; a few objects happen to have a colour close to their background)."""
    x = render_scenes(torch.arange(NUM_CLASSES).repeat(2), torch.Generator().manual_seed(0))
    cells = x.unfold(2, 16, 16).unfold(3, 16, 16)                       # (B, 3, 16, 16, 16, 16) cells
    spread = cells.flatten(-2).std(-1).mean(1)                          # (B, 16, 16) per-cell std
    assert (spread < 0.03).float().mean() > 0.4                          # large low-frequency areas
    grad = (x[..., 1:, :] - x[..., :-1, :]).abs().amax(dim=(1, 2, 3))
    assert (grad > 0.1).all() and (grad > 0.3).float().mean() >= 0.8


def test_scene_inputs_are_validated():
    with pytest.raises(ValueError, match="labels must be in 0..11"):
        render_scenes(torch.tensor([12]))
    with pytest.raises(ValueError, match="min_scale"):
        SceneConfig(min_scale=0.4, max_scale=0.3)
    assert class_id("Tree") == CLASS_NAMES.index("tree") and class_id("3") == 3
    with pytest.raises(ValueError, match="the demo classes are"):
        class_id("dragon")


def test_strong_edge_fraction_counts_pixels_over_the_threshold():
    """A 4×4 picture, left half black, right half grey: of the 3×3 pixels that have a right and a
    lower neighbour, the three in column 1 see the step (3 channels × the step in 0–255 units)."""
    def picture(level):
        x = torch.zeros(1, 3, 4, 4)
        x[..., 2:] = level / 255
        return x
    assert strong_edge_fraction(picture(255)).item() == pytest.approx(3 / 9)
    assert strong_edge_fraction(picture(41)).item() == pytest.approx(3 / 9)      # 3 × 41 = 123 > 120
    assert strong_edge_fraction(picture(40)).item() == 0.0                      # 3 × 40 = 120, not over
    assert strong_edge_fraction(picture(40), threshold=119).item() == pytest.approx(3 / 9)
    with pytest.raises(ValueError, match=r"strong_edge_fraction: images must be \(B, 3, H, W\)"):
        strong_edge_fraction(torch.zeros(3, 4, 4))


def test_corner_smudge_ratio_sees_a_noisy_corner():
    ramp = torch.linspace(0, 1, 64).view(1, 1, 1, 64).expand(2, 3, 64, 64).clone()   # the same slope everywhere
    ramp[1, :, :12, :12] += 0.2 * torch.rand(3, 12, 12, generator=torch.Generator().manual_seed(0))
    ratio = corner_smudge_ratio(ramp)
    assert ratio[0].item() == pytest.approx(1.0, abs=1e-9)
    assert ratio[1].item() > 4.0
    with pytest.raises(ValueError, match="k=12 needs pictures of at least 13×25 px"):
        corner_smudge_ratio(torch.zeros(1, 3, 20, 20))


def test_train_config_pairs_the_schedule_with_the_downsampling():
    with pytest.raises(ValueError, match=r"schedule=999: choose one of \[256, 512, 1024\]"):
        DemoTrainConfig(schedule=999)
    with pytest.raises(ValueError, match=r"draws 512-px pictures.*vq_ch_mult=\(1, 1, 2, 4\)"):
        DemoTrainConfig(schedule=512)
    with pytest.raises(ValueError, match=r"vq_ch_mult=\(1, 0, 4\): give one int >= 1 per level"):
        DemoTrainConfig(vq_ch_mult=(1, 0, 4))
    with pytest.raises(ValueError, match="measure_count=-1"):
        DemoTrainConfig(measure_count=-1)
    assert DemoTrainConfig(schedule=512, vq_ch_mult=(1, 1, 2, 4)).schedule == 512
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"dec_adv_weight=.*: must be 0 \(no discriminator\) or a positive"):
            DemoTrainConfig(dec_adv_weight=bad)
    with pytest.raises(ValueError, match="dec_adv_start=-1"):
        DemoTrainConfig(dec_adv_start=-1)


# ---- the shipped model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_pipe():
    return VARPipeline.from_demo()


def test_demo_model_is_small_and_names_its_classes(demo_pipe):
    size_mb = sum(p.stat().st_size for p in DEMO_MODEL_DIR.rglob("*") if p.is_file()) / 2**20
    assert size_mb <= 40, f"the demo model folder is {size_mb:.1f} MB (issue #7 allows 40)"
    assert demo_pipe.num_classes == NUM_CLASSES
    assert [demo_pipe.labels[i] for i in range(NUM_CLASSES)] == list(CLASS_NAMES)
    assert demo_pipe.get_label_ids(["tree", "fish", 0]) == [8, 11, 0]
    meta = json.loads((DEMO_MODEL_DIR / "train_demo.json").read_text())
    assert set(meta["stages"]) == {"vqvae", "decoder", "var", "classifier"}


@pytest.fixture(scope="module")
def demo_batch(demo_pipe):
    """Two images of every class at the default settings, image i from its own generator seeded i
    (so any leading part of the batch is the same as a batch of those images alone)."""
    labels = list(range(NUM_CLASSES)) * 2
    gens = [torch.Generator().manual_seed(i) for i in range(len(labels))]
    # drawn a class set at a time: on a CPU a whole batch at once costs more per image (60: 3.0 s against 2.1)
    images = [demo_pipe(labels[i:i + NUM_CLASSES], generator=gens[i:i + NUM_CLASSES], output_type="pt").images
              for i in range(0, len(labels), NUM_CLASSES)]
    return torch.tensor(labels), torch.cat(images)


def test_generated_images_show_their_class(demo_batch):
    """Issue #34: the shipped classifier recognises ≥ 80 % of generated images at default settings:
    81.9 % of 360 pictures on an H200 (``measure_demo``, seeds 0–2; the 512-schedule model, Session
    25), 79.2 % of these 24 on a CPU (one generator per image, seeds 0–23; 83.3 % of the first 36,
    85.0 % of the first 60). A random guess is 8 %. Misses are mostly the simple shapes (box read as
    disc, ring as crescent). The bound, 60 %, sits 2.8 standard errors of a 24-image sample (±7.9 %)
    under the GPU rate: a different CPU's float rounding can flip sampled tokens and change
    individual images, but not the rate."""
    labels, images = demo_batch
    assert images.shape == (len(labels), 3, 256, 256)
    clf = SceneClassifier.from_file(DEMO_MODEL_DIR / "classifier.safetensors", NUM_CLASSES)
    with torch.no_grad():
        acc = (clf(images).argmax(-1) == labels).float().mean().item()
    assert acc >= 0.60, f"classifier accuracy {acc:.2f} on generated images"


def test_demo_pictures_have_crisp_edges(demo_batch):
    """Issue #34: at least 0.4 % of a generated picture's pixels on strong edges (rendered scenes:
    0.5–1.9 %; the first demo model's pictures 0.03–0.07 %). Measured here: median 3.2 %, tenth
    percentile 1.3 %; over 360
    pictures on an H200 (``measure_demo``) median 2.7 %, tenth percentile 1.2 %."""
    fraction = strong_edge_fraction(demo_batch[1]) * 100
    low, median = torch.quantile(fraction, 0.1).item(), fraction.median().item()
    assert low >= 0.4, f"strong-edge pixels: tenth percentile {low:.2f} %, median {median:.2f} %"


def test_demo_pictures_have_no_smudge_in_the_top_left_corner(demo_pipe, demo_batch):
    """Issue #27: every picture of the first demo model had a noisy smudge in its top-left ~12 px
    (ratio 4–8 on every class and seed; rendered scenes are at 1.0). Its GroupNorm decoder (one
    channel per group at 32 channels) had learned a spike of huge activations there; the decoder
    now normalises per pixel and pads by replication (``demo/train.py``, stage ``decoder``).
    Measured on the 512-schedule model (CPU): at most 1.34 over these 24 pictures (1.97 over the first
    60), 1.26 over 12 reconstructions; ``measure_demo``: at most 1.95 over 360 (H200)."""
    labels, images = demo_batch                                             # two per class
    ratios = [corner_smudge_ratio(images)]
    scenes = render_scenes(torch.arange(NUM_CLASSES), torch.Generator().manual_seed(5))
    with torch.no_grad():
        recs = (demo_pipe.vqvae(scenes * 2 - 1) + 1) / 2
    assert corner_smudge_ratio(scenes).max() <= 1.5                        # the measure on clean pictures
    ratios.append(corner_smudge_ratio(recs))
    worst = torch.cat(ratios).max().item()
    assert worst <= 3.0, f"top-left corner gradient {worst:.1f}× the band beside it"


def test_classifier_recognises_clean_scenes():
    clf = SceneClassifier.from_file(DEMO_MODEL_DIR / "classifier.safetensors", NUM_CLASSES)
    labels = torch.arange(NUM_CLASSES).repeat(4)
    with torch.no_grad():
        acc = (clf(render_scenes(labels, torch.Generator().manual_seed(99))).argmax(-1) == labels).float().mean()
    assert acc >= 0.95


def test_sparsevar_preset_stays_close_to_dense(demo_pipe, demo_batch):
    """SparseVAR at the demo model's preset (the VAR family's, observing its calibrated layer)
    against dense, same seed (dense: the first 12 of ``demo_batch``, one generator per image).
    Threshold: see the measurement below."""
    labels = list(range(NUM_CLASSES))
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(labels))]   # one per image
    assert demo_batch[0][:len(labels)].tolist() == labels
    dense = demo_batch[1][:len(labels)]
    demo_pipe.enable_sparsevar()
    try:
        out = demo_pipe(labels, generator=gens(), output_type="pt")
        again = demo_pipe(labels[:3], generator=gens()[:3], output_type="pt", policies=[]).images
    finally:
        demo_pipe.disable_sparsevar()
    assert torch.equal(again, dense[:3])                     # per-call policies=[] overrides the enabled stack
    kept = sum(s.tokens_computed for s in out.stats[0].scales) / sum(p * p for p in demo_pipe.transformer.config.patch_nums)
    assert kept < 1.0                                                    # the preset does exclude tokens here
    value = psnr(out.images, dense).median().item()
    assert value >= PRESET_PSNR_DB, f"SparseVAR preset: median PSNR {value:.1f} dB against dense"


# Measured on the 512-schedule model (Session 26), at its calibrated preset (layer 7, tau 0.5 from the
# second-to-last scale): 23.3 dB median (min 19.9, max 30.5) over the first 24 images (one generator per
# image) on a CPU, with 46 % of the tokens computed (a batch drawn from one generator seeded 0: 24.3 dB;
# the family's tau 0.6: 23.1 dB); over the 12 of this test (Session 30): 22.8 dB median (min 19.9), 47 %
# of the tokens computed.
# Images of the same classes from other seeds are 12.0 dB apart (median), so 19 dB means "the same
# picture, slightly changed"; once one sampled token differs, later scales diverge, which is why the
# bound sits about 4 dB under the measurement.
PRESET_PSNR_DB = 19.0


def test_sparvar_preset_changes_the_pictures_and_stays_a_sanity_distance_from_dense(demo_pipe, demo_batch):
    """Issue #30: SparVAR at the VAR family's preset on the demo model changes every picture (it is
    not a no-op) and stays above 18 dB PSNR against dense (median over the 12 classes and seeds of
    ``test_sparsevar_preset_stays_close_to_dense``). PSNR here by its formula, over RGB with data
    range 1: 10·log10(1 / mean squared error). Measured (CPU): median 20.6 dB (torch's
    lower median; min 17.4, max 28.0), every picture's largest pixel change 0.67 or more; the bound
    is the issue's, 2.6 dB under the measurement."""
    labels = list(range(NUM_CLASSES))
    dense = demo_batch[1][:len(labels)]
    assert demo_batch[0][:len(labels)].tolist() == labels
    demo_pipe.enable_sparvar()
    try:
        out = demo_pipe(labels, generator=[torch.Generator().manual_seed(i) for i in labels], output_type="pt")
    finally:
        demo_pipe.disable_sparvar()
    patch_nums = demo_pipe.transformer.config.patch_nums
    reads = [s.keys_read for s in out.stats[0].scales]
    assert reads[:-3] == [None] * (len(patch_nums) - 3)                      # dense before the decision scale
    assert reads[-1] < sum(p * p for p in patch_nums)                        # fewer keys than the whole cache
    images, dense = out.images.double(), dense.double()
    assert images.shape == dense.shape and 0 <= images.min() and images.max() <= 1
    assert ((images - dense).abs().flatten(1).amax(1) > 0.1).all()           # every picture changed
    psnr_db = 10 * torch.log10(1.0 / ((images - dense) ** 2).flatten(1).mean(1))
    value = psnr_db.median().item()
    assert value >= SPARVAR_PSNR_DB, f"SparVAR preset: median PSNR {value:.1f} dB against dense ({psnr_db.tolist()})"


SPARVAR_PSNR_DB = 18.0                 # issue #30's sanity bound


# ---- the commands ----------------------------------------------------------------------------------
def test_generate_without_a_model_uses_the_demo_model(tmp_path, capsys):
    out = tmp_path / "x.png"
    assert main(["generate", "--class", "tree", "--out", str(out), "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "built-in demo model" in captured.err
    assert "tokens computed" in captured.out and out.is_file()


def test_train_demo_quick_writes_a_loadable_model_and_keeps_the_old_one_on_error(tmp_path, capsys):
    folder = tmp_path / "demo"
    assert main(["train-demo", "--quick", "--out", str(folder), "--device", "cpu", "--quiet"]) == 0
    pipe = VARPipeline.from_pretrained(folder)
    img = pipe(["car"], generator=torch.Generator().manual_seed(0)).images[0]
    assert img.size == (256, 256)
    assert (folder / "classifier.safetensors").is_file() and not (folder / "stage_vqvae.safetensors").exists()
    before = sorted(p.name for p in folder.rglob("*"))
    with pytest.raises(ValueError, match="stages"):
        train_demo(folder, DemoTrainConfig().quick(), stages=["gan"], device="cpu")
    assert sorted(p.name for p in folder.rglob("*")) == before and not list(tmp_path.glob(".*partial"))


def test_train_demo_512_schedule_draws_256px_pictures_from_a_32x32_latent_and_measures_them(tmp_path, capsys):
    """The sharper variant (8× downsampling, VAR's 512 schedule) end to end at a few steps, and
    ``measure_demo`` on its folder (its reconstruction PSNR checked against ``metrics.psnr``)."""
    folder = tmp_path / "demo512"
    assert main(["train-demo", "--quick", "--schedule", "512", "--vq-ch-mult", "1", "1", "2", "4", "--out",
                 str(folder), "--device", "cpu", "--quiet"]) == 0
    pipe = VARPipeline.from_pretrained(folder)
    assert tuple(pipe.transformer.config.patch_nums) == (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)
    out = pipe(["car", "fish"], generator=torch.Generator().manual_seed(0), output_type="pt")
    assert out.images.shape == (2, 3, 256, 256)
    m = measure_demo(folder, "cpu", count=3, batch=2, scenes=6)
    assert m["pictures"] == 3 and 0.0 <= m["classifier_accuracy"] <= 1.0
    assert 0.0 <= m["strong_edge_pct_p10"] <= m["strong_edge_pct_median"] <= 100.0
    from sparsevar.demo.scenes import random_labels                              # the measure's own scenes
    scenes = render_scenes(random_labels(6, torch.Generator().manual_seed(9000)), torch.Generator().manual_seed(9001))
    with torch.no_grad():
        recs = torch.cat([((pipe.vqvae(x * 2 - 1) + 1) / 2).clamp(0, 1) for x in scenes.split(60)])
    expected = -10 * torch.log10(((recs - scenes) ** 2).mean()).item()
    assert m["reconstruction_psnr_db"] == pytest.approx(expected, abs=0.011)
    assert m["scenes_strong_edge_pct_median"] > 0.5                             # rendered scenes have edges
    capsys.readouterr()
    assert main(["train-demo", "--quick", "--schedule", "512", "--out", str(tmp_path / "x"), "--device", "cpu"]) == 2
    assert "draws 512-px pictures" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def quick_base(tmp_path_factory):
    """A folder with the quick config's tokenizer and transformer trained (stages vqvae and var),
    which the decoder-stage tests copy and train on."""
    base = tmp_path_factory.mktemp("quick") / "base"
    train_demo(base, DemoTrainConfig().quick(), stages=["vqvae", "var"], device="cpu", log=lambda s: None)
    return base


def test_decoder_stage_replaces_only_the_decode_side_of_a_finished_folder(tmp_path, quick_base):
    """Stage ``decoder`` on a finished model: a per-pixel-norm, replicate-padded decoder; the encoder,
    codebook and transformer stay byte for byte, so the codes a seed samples stay the same."""
    import shutil

    from safetensors.torch import load_file
    folder = tmp_path / "demo"
    cfg = DemoTrainConfig().quick()
    shutil.copytree(quick_base, folder)
    old_vq = load_file(folder / "vqvae" / "diffusion_pytorch_model.safetensors")
    old_var = (folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    first = VARPipeline.from_pretrained(folder)(["car"], generator=torch.Generator().manual_seed(0), output_type="latent")
    train_demo(folder, cfg, stages=["decoder"], device="cpu", log=lambda s: None)
    assert json.loads((folder / "vqvae" / "config.json").read_text())["decoder_norm"] == "channel"
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == old_var
    new_vq = load_file(folder / "vqvae" / "diffusion_pytorch_model.safetensors")
    assert new_vq.keys() == old_vq.keys()
    decode_side = [k for k in new_vq if k.startswith(("decoder.", "post_quant_conv."))]
    assert len(decode_side) > 0 and any(not torch.equal(new_vq[k], old_vq[k]) for k in decode_side)
    assert all(torch.equal(new_vq[k], old_vq[k]) for k in new_vq if k not in decode_side)
    pipe = VARPipeline.from_pretrained(folder)
    assert type(pipe.vqvae.decoder.norm_out).__name__ == "ChannelNorm"
    assert pipe.vqvae.decoder.conv_out.padding_mode == "replicate"
    again = pipe(["car"], generator=torch.Generator().manual_seed(0), output_type="latent")
    assert torch.equal(again.images, first.images)                          # the same codes, the same latent
    assert not list(tmp_path.glob(".*partial"))


def test_adversarial_decoder_stage_trains_the_decoder_differently_and_keeps_the_codes(tmp_path, quick_base):
    """``dec_adv_weight`` adds a discriminator to the decoder stage: from the same folder and seed, the
    decoder it trains differs from the one without it, and the encoder and codebook stay byte for byte."""
    import shutil

    from safetensors.torch import load_file
    cfg = DemoTrainConfig().quick()
    base = quick_base
    old_vq = load_file(base / "vqvae" / "diffusion_pytorch_model.safetensors")
    results = {}
    for weight in (0.0, 0.5):
        folder = tmp_path / f"w{weight}"
        shutil.copytree(base, folder)
        lines = []
        train_demo(folder, replace(cfg, dec_adv_weight=weight, dec_adv_start=0), stages=["decoder"], device="cpu",
                   log=lines.append)
        results[weight] = load_file(folder / "vqvae" / "diffusion_pytorch_model.safetensors")
        logged = [" lambda " in line for line in lines if line.startswith("decoder ") and "/" in line]
        assert logged and all(has == (weight > 0) for has in logged)
        assert json.loads((folder / "train_demo.json").read_text())["config"]["dec_adv_weight"] == weight
    decode_side = [k for k in old_vq if k.startswith(("decoder.", "post_quant_conv."))]
    assert any(not torch.equal(results[0.0][k], results[0.5][k]) for k in decode_side)
    for w in results.values():
        assert all(torch.equal(w[k], old_vq[k]) for k in old_vq if k not in decode_side)


def test_var_stage_can_continue_from_the_folders_transformer(tmp_path):
    """``var_continue`` starts stage ``var`` from the trained transformer in the folder: at learning
    rate 0 the saved transformer comes back bit for bit, where a fresh start at learning rate 0 gives
    the initial weights; without a transformer in the folder the stage says what to run first."""
    from safetensors.torch import load_file
    cfg = replace(DemoTrainConfig().quick(), var_steps=1)
    folder = tmp_path / "demo"
    train_demo(folder, replace(cfg, vq_steps=1), stages=["vqvae"], device="cpu", log=lambda s: None)
    with pytest.raises(ValueError, match="var_continue: .* has no trained transformer"):
        train_demo(folder, replace(cfg, var_continue=True), stages=["var"], device="cpu", log=lambda s: None)
    train_demo(folder, cfg, stages=["var"], device="cpu", log=lambda s: None)
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    trained = load_file(path)
    train_demo(folder, replace(cfg, var_continue=True, var_lr=0.0, seed=1), stages=["var"], device="cpu",
               log=lambda s: None)
    again = load_file(path)
    assert again.keys() == trained.keys() and all(torch.equal(again[k], trained[k]) for k in trained)
    train_demo(folder, replace(cfg, var_lr=0.0, seed=1), stages=["var"], device="cpu", log=lambda s: None)
    fresh = load_file(path)
    assert any(not torch.equal(fresh[k], trained[k]) for k in trained)
    assert json.loads((folder / "train_demo.json").read_text())["config"]["var_continue"] is False


def test_training_schedule_warms_up_then_falls_to_a_tenth():
    """The stages' learning rate (transformers' cosine schedule with a floor): linear warm-up to the
    optimizer's rate, then a cosine to 10 % of it at the last step."""
    from sparsevar.demo.train import _schedule
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = _schedule(opt, total=100, warmup=10)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(1.0) and lrs[10] == pytest.approx(2.0)
    assert lrs[55] == pytest.approx(0.2 + 1.8 * 0.5)                       # half-way down the cosine
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[99] == pytest.approx(0.2, abs=1e-3)
