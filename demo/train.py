"""`sparsevar train-demo`: train the embedded demo model on procedural scenes, from a seed.

Four stages, each resumable from the output folder:
1. ``vqvae``: a multi-scale residual VQVAE (VAR's tokenizer architecture at width 32, 1024 codes)
   with reconstruction + commitment losses and dead-code restarts. The shipped model (the
   defaults) downsamples 16× with the 256-px token schedule 1…16; ``schedule=512`` with
   ``vq_ch_mult=(1, 1, 2, 4)`` downsamples 8× so that 256-px pictures have a 32×32 latent and
   VAR's 512-px schedule 1…32, where the late scales carry most of the work as on Infinity and
   HART. Stage 1 keeps the official GroupNorm decoder: trained jointly with the encoder, a decoder
   that normalises each pixel on its own cannot see the latent's scale, and in one such run the
   latent collapsed towards zero (commitment loss 0, a flat mean picture).
2. ``decoder``: the final decoder, normalised per pixel with replicate padding
   (``decoder_norm="channel"``, ``decoder_padding="replicate"``), warm-started from stage 1's and
   trained against its frozen encoder and codebook on the exact latents sampling decodes, so the
   codes (and a transformer trained on them) stay valid. The GroupNorm of stage 1 is one channel
   per group at 32 channels (instance normalisation): the first demo model's decoder learned a
   spike of huge activations in the top-left corner to steer those statistics, a noisy smudge
   there in every picture (see ``models.vqvae.ChannelNorm``).
3. ``var``: a depth-8 VAR transformer (width 256, 4 heads) by teacher forcing over all scales with
   10 % label dropout (for classifier-free guidance), on scenes tokenised by the stage-1 VQVAE.
4. ``classifier``: a small CNN that names the class of a picture (the quality tests' judge),
   trained on scenes and on their VQVAE reconstructions. When the folder is complete the stage
   then measures the model (``measure_demo``) into ``train_demo.json``.

The result is a ``VARPipeline`` folder (``model_index.json``, ``transformer/``, ``vqvae/``; weights
in bfloat16 / float16) plus ``classifier.safetensors``. Data and initialisation follow the seed;
on a GPU the last bits of training can differ run to run (cuDNN / cuBLAS reductions).
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..models.var import VAR_SCHEDULES, VARTransformer
from ..models.vqvae import MultiScaleVQVAE, bicubic_operator
from .classifier import INPUT_SIZE as CLASSIFIER_SIZE
from .classifier import SceneClassifier
from .measures import strong_edge_fraction
from .scenes import CLASS_NAMES, NUM_CLASSES, SceneConfig, random_labels, render_scenes

STAGES = ("vqvae", "decoder", "var", "classifier")


@dataclass(frozen=True)
class DemoTrainConfig:
    """Sizes and schedules of the demo model's training (the measured times per stage on one H100 are
    in the shipped folder's ``train_demo.json``).

    seed: fixes data and initialisation of every stage.
    vq_*: VQVAE width, channel multipliers per level (``len - 1`` halvings: (1, 1, 2, 2, 4)
        downsamples 16×, (1, 1, 2, 4) 8×), codebook size, steps, batch and learning rate.
    schedule: the token schedule, a key of ``VAR_SCHEDULES`` (256: 1 … 16; 512: 1, 2, 3, 4, 6, 9,
        13, 18, 24, 32); its last side times the VQVAE's downsampling must be the scenes' 256 px.
    dec_steps, dec_lr: steps and peak learning rate of the ``decoder`` stage (batch ``vq_batch``, on
        the ``vq_data`` scenes of stage 1).
    dec_adv_weight: weight of the ``decoder`` stage's adversarial term (a patch discriminator with
        the hinge loss, scaled as in VQGAN by the ratio of the reconstruction and adversarial
        gradients at the decoder's last convolution; 0: no discriminator). Pixel and edge losses
        alone average over where an edge may lie and draw it soft; the discriminator asks for
        edges as sharp as the scenes'. Typical 0.1–0.8.
    dec_adv_start: decoder step from which the adversarial term counts (the discriminator trains
        from step 0).
    var_*: transformer depth / width / heads, steps, batch, peak learning rate, label dropout.
    var_continue: stage ``var`` starts from the folder's trained transformer instead of a fresh
        initialisation (its schedule and learning-rate curve start again; pass a new ``seed`` to
        train on scenes it has not seen).
    vq_data, var_data, cls_data: distinct scenes each stage trains on (rendered once, re-used over
        epochs; ``var_data`` scenes are kept tokenised, ≈45 KB each in bfloat16 at the 256
        schedule, ≈143 KB at the 512 one).
    cls_steps, cls_batch: the classifier's steps and batch.
    cls_render_size: side at which the classifier's scenes are rendered (then resized to its 64 px);
        128 renders 4× faster than 256 and looks the same at 64 px.
    cls_reconstructions: also train the classifier on the VQVAE's reconstructions of its scenes
        (on by default: the classifier then judges a generated picture's shape, not the tokenizer's
        softening of it. Off, the stage renders at ``cls_render_size`` and runs in minutes on a CPU).
    measure_count: generated pictures ``measure_demo`` judges after the classifier stage (0: none).
    compile: run the transformer's training step through torch.compile on CUDA (≈2× faster).
    """

    seed: int = 0
    vq_ch: int = 32
    vq_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    vq_vocab: int = 1024
    vq_steps: int = 3600
    vq_batch: int = 32
    vq_data: int = 24_000
    vq_lr: float = 1e-3
    vq_beta: float = 0.25
    schedule: int = 256
    dec_steps: int = 3000
    dec_lr: float = 5e-4
    dec_adv_weight: float = 0.0
    dec_adv_start: int = 500
    var_depth: int = 8
    var_width: int = 256
    var_heads: int = 4
    var_steps: int = 10_000
    var_batch: int = 96
    var_lr: float = 8e-4
    var_label_dropout: float = 0.1
    var_continue: bool = False
    var_data: int = 60_000
    cls_steps: int = 5_000
    cls_batch: int = 128
    cls_data: int = 48_000
    cls_render_size: int = 128
    cls_reconstructions: bool = True
    measure_count: int = 360
    compile: bool = True

    def __post_init__(self):
        for name in ("vq_steps", "dec_steps", "var_steps", "cls_steps", "vq_batch", "var_batch", "cls_batch", "vq_data",
                     "var_data", "cls_data"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be at least 1 "
                                 f"(`sparsevar train-demo --{name.replace('_', '-')} N`)")
        if not self.vq_ch_mult or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1
                                          for m in self.vq_ch_mult):
            raise ValueError(f"vq_ch_mult={tuple(self.vq_ch_mult)!r}: give one int >= 1 per level "
                             f"(`sparsevar train-demo --vq-ch-mult 1 1 2 4`)")
        if self.schedule not in VAR_SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: choose one of {sorted(VAR_SCHEDULES)}")
        side = 2 ** (len(self.vq_ch_mult) - 1) * VAR_SCHEDULES[self.schedule][-1]
        if side != SceneConfig().size:
            need = SceneConfig().size / VAR_SCHEDULES[self.schedule][-1]
            example = {4: " (vq_ch_mult=(1, 2, 4))", 8: " (vq_ch_mult=(1, 1, 2, 4))", 16: " (vq_ch_mult=(1, 1, 2, 2, 4))"}
            raise ValueError(f"schedule={self.schedule} with vq_ch_mult={tuple(self.vq_ch_mult)} draws {side}-px "
                             f"pictures; the scenes are {SceneConfig().size} px: pair the schedule's last side "
                             f"({VAR_SCHEDULES[self.schedule][-1]}) with a downsampling of {need:g}"
                             f"{example.get(need, '')}")
        if not (self.dec_adv_weight >= 0 and math.isfinite(self.dec_adv_weight)):
            raise ValueError(f"dec_adv_weight={self.dec_adv_weight!r}: must be 0 (no discriminator) or a positive "
                             f"number (0.1–0.8 is typical)")
        if self.dec_adv_start < 0:
            raise ValueError(f"dec_adv_start={self.dec_adv_start!r}: must be a decoder step, 0 or more")
        if self.measure_count < 0:
            raise ValueError(f"measure_count={self.measure_count!r}: must be 0 (no measurement) or more")

    def quick(self) -> "DemoTrainConfig":
        """A tiny run of every stage with a small transformer (smoke tests: seconds on a CPU; draws no
        real pictures): the schedule and the tokenizer stay as set."""
        return replace(self, vq_steps=2, vq_batch=2, vq_data=4, dec_steps=2, var_depth=2, var_width=64, var_heads=2,
                       var_steps=2, var_batch=2, var_data=8, cls_steps=2, cls_batch=4, cls_data=4, measure_count=0,
                       compile=False)


def _schedule(opt: torch.optim.Optimizer, total: int, warmup: int):
    """Each group's learning rate: a linear warm-up over ``warmup`` steps to the rate the optimizer was
    made with, then a cosine down to a tenth of it at ``total`` (transformers' schedule; step it after
    every optimizer step)."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup
    return get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr_rate=0.1)


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def render_dataset(count: int, seed: int, device: torch.device, batch: int = 1024, size: int = 256):
    """(images (N, 3, size, size) uint8, labels (N,)) of ``count`` scenes, rendered in large batches
    (rendering is launch-bound at small batches)."""
    gen = torch.Generator(device).manual_seed(seed)
    imgs, labels = [], []
    for start in range(0, count, batch):
        lab_B = random_labels(min(batch, count - start), gen)
        imgs.append((render_scenes(lab_B, gen, SceneConfig(size=size)) * 255).round().to(torch.uint8))
        labels.append(lab_B)
    return torch.cat(imgs), torch.cat(labels)


def _batch(imgs_NCHW, labels_N, size: int, gen: torch.Generator):
    """A random batch in [-1, 1] with random horizontal flips, and its labels."""
    pick = torch.randint(0, imgs_NCHW.shape[0], (size,), generator=gen, device=imgs_NCHW.device)
    x = imgs_NCHW[pick].float() / 127.5 - 1
    flip = torch.rand(size, generator=gen, device=x.device) < 0.5
    x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
    return x, labels_N[pick]


# ---- stage 1: the VQVAE --------------------------------------------------------------------------
def build_vqvae(cfg: DemoTrainConfig, final_decoder: bool = False) -> MultiScaleVQVAE:
    """Stage 1's VQVAE (the official architecture at the config's size), or with ``final_decoder`` the
    same with the decode side of the ``decoder`` stage (per-pixel norm, replicate padding)."""
    extra = dict(decoder_norm="channel", decoder_padding="replicate") if final_decoder else {}
    return MultiScaleVQVAE(vocab_size=cfg.vq_vocab, z_channels=32, ch=cfg.vq_ch, ch_mult=tuple(cfg.vq_ch_mult),
                           patch_nums=VAR_SCHEDULES[cfg.schedule], **extra)


def _vq_forward(vq: MultiScaleVQVAE, img_B3HW: torch.Tensor, beta: float, upsample_ops: dict):
    """Training forward: multi-scale residual quantisation with a straight-through estimator.
    ``upsample_ops`` keeps the bicubic operators between steps (filled on first use).
    Returns (reconstruction, vq loss, the un-quantised vectors seen at every scale (N, C), codes)."""
    f_BChw = vq.encode(img_B3HW).float()
    B, C, H, W = f_BChw.shape
    sched = vq.default_schedule()
    SN = len(sched)
    codebook_VC = vq.quantize.embedding.weight.float()
    f_rest_BChw = f_BChw.detach()
    f_hat_BChw = torch.zeros_like(f_BChw)
    seen, codes = [], []
    vq_loss = f_BChw.new_zeros(())
    for si, (ph, pw) in enumerate(sched):
        with torch.no_grad():
            z_BChw = F.interpolate(f_rest_BChw, size=(ph, pw), mode="area") if si != SN - 1 else f_rest_BChw
            z_NC = z_BChw.permute(0, 2, 3, 1).reshape(-1, C)                      # (B, C, ph, pw) → (N, C)
            idx_N = torch.cdist(z_NC, codebook_VC).argmin(dim=1)
            seen.append(z_NC)
            codes.append(idx_N)
        h_BChw = F.embedding(idx_N.view(B, ph, pw), codebook_VC).permute(0, 3, 1, 2)  # (B,ph,pw,C) → (B,C,ph,pw)
        if si != SN - 1:
            # bicubic upsampling as one float32 product with its operator: CUDA's bicubic backward
            # (atomic adds per output pixel) was most of a training step's time at a 32×32 latent
            with torch.autocast(f_BChw.device.type, enabled=False):
                key = (ph, pw, H, W)
                if key not in upsample_ops:
                    upsample_ops[key] = bicubic_operator((ph, pw), (H, W), f_BChw.device)   # (ph·pw, H·W)
                op = upsample_ops[key]
                h_BChw = (h_BChw.reshape(B * C, ph * pw).float() @ op).view(B, C, H, W)
        h_BChw = vq.apply_phi(h_BChw, si, SN)
        f_hat_BChw = f_hat_BChw + h_BChw
        f_rest_BChw = f_rest_BChw - h_BChw.detach()
        vq_loss = vq_loss + F.mse_loss(f_hat_BChw, f_BChw.detach()) + beta * F.mse_loss(f_hat_BChw.detach(), f_BChw)
    f_st_BChw = f_hat_BChw.detach() - f_BChw.detach() + f_BChw                   # straight-through
    # the commitment/codebook terms reach the codebook and phi; the decoder sees f_hat (with phi's gradient)
    f_dec_BChw = f_st_BChw + (f_hat_BChw - f_hat_BChw.detach())
    rec_B3HW = vq.decoder(vq.post_quant_conv(f_dec_BChw))
    return rec_B3HW, vq_loss / SN, torch.cat(seen), torch.cat(codes)


def _edges(x_B3HW):
    return (x_B3HW[..., 1:, :] - x_B3HW[..., :-1, :]), (x_B3HW[..., :, 1:] - x_B3HW[..., :, :-1])


def _reconstruction_loss(rec_B3HW: torch.Tensor, img_B3HW: torch.Tensor) -> torch.Tensor:
    """L1 + MSE of the pixels plus L1 of the vertical and horizontal differences (sharp edges)."""
    ry, rx = _edges(rec_B3HW)
    iy, ix = _edges(img_B3HW)
    rec_loss = (rec_B3HW - img_B3HW).abs().mean() + F.mse_loss(rec_B3HW, img_B3HW)
    return rec_loss + (ry - iy).abs().mean() + (rx - ix).abs().mean()


def _psnr(rec_B3HW: torch.Tensor, img_B3HW: torch.Tensor) -> float:
    mse = F.mse_loss((rec_B3HW.clamp(-1, 1) + 1) / 2, (img_B3HW + 1) / 2).item()
    return -10 * math.log10(max(mse, 1e-10))


def train_vqvae(cfg: DemoTrainConfig, device: torch.device, log: Callable[[str], None]) -> MultiScaleVQVAE:
    torch.manual_seed(cfg.seed)
    vq = build_vqvae(cfg).to(device).train()
    with torch.no_grad():
        vq.quantize.embedding.weight.normal_(0, 0.5)
    opt = torch.optim.AdamW(vq.parameters(), lr=cfg.vq_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device).manual_seed(cfg.seed * 1000 + 1)
    t0 = time.time()
    data_N3HW, labels_N = render_dataset(cfg.vq_data, cfg.seed * 1000 + 5, device)
    log(f"vqvae: rendered {data_N3HW.shape[0]} scenes in {time.time() - t0:.0f}s")
    upsample_ops: dict = {}
    usage_V = torch.ones(cfg.vq_vocab, device=device)
    t0 = time.time()
    lr_sched = _schedule(opt, cfg.vq_steps, min(500, cfg.vq_steps // 10 + 1))
    for step in range(cfg.vq_steps):
        img_B3HW, _ = _batch(data_N3HW, labels_N, cfg.vq_batch, gen)
        with _autocast(device):
            rec_B3HW, vq_loss, seen_NC, codes_N = _vq_forward(vq, img_B3HW, cfg.vq_beta, upsample_ops)
        rec_B3HW = rec_B3HW.float()
        rec_loss = _reconstruction_loss(rec_B3HW, img_B3HW)
        loss = rec_loss + vq_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vq.parameters(), 2.0)
        opt.step()
        lr_sched.step()
        with torch.no_grad():                              # restart codes nobody uses
            usage_V.mul_(0.99).add_(torch.bincount(codes_N, minlength=cfg.vq_vocab).float(), alpha=0.01)
            if step % 100 == 99 and step < cfg.vq_steps * 0.8:
                dead_V = usage_V < 0.02
                n_dead = int(dead_V.sum())
                if n_dead:
                    pick = torch.randint(0, seen_NC.shape[0], (n_dead,), generator=gen, device=device)
                    vq.quantize.embedding.weight[dead_V] = seen_NC[pick].to(vq.quantize.embedding.weight.dtype)
                    usage_V[dead_V] = 1.0
        if step % 500 == 0 or step == cfg.vq_steps - 1:
            psnr = _psnr(rec_B3HW, img_B3HW)
            used = int((usage_V > 0.02).sum())
            log(f"vqvae {step:5d}/{cfg.vq_steps} loss {loss.item():.4f} rec {rec_loss.item():.4f} "
                f"vq {vq_loss.item():.4f} psnr {psnr:.2f} dB codes used {used}/{cfg.vq_vocab} {time.time() - t0:.0f}s")
    return vq.eval().requires_grad_(False)


# ---- stage 2: the final decoder ------------------------------------------------------------------
class PatchDiscriminator(torch.nn.Module):
    """(B, 3, H, W) in [-1, 1] → (B, 1, H/8 - 2, W/8 - 2) real/fake scores of overlapping patches
    (a PatchGAN: three stride-2 4×4 convolutions, one stride-1, then a 1-channel one; GroupNorm)."""

    def __init__(self, ch: int = 64):
        super().__init__()
        act = torch.nn.LeakyReLU(0.2)
        layers = [torch.nn.Conv2d(3, ch, 4, 2, 1), act]
        c = ch
        for stride in (2, 2, 1):
            layers += [torch.nn.Conv2d(c, 2 * c, 4, stride, 1, bias=False), torch.nn.GroupNorm(32, 2 * c), act]
            c *= 2
        layers.append(torch.nn.Conv2d(c, 1, 4, 1, 1))
        self.net = torch.nn.Sequential(*layers)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        return self.net(img_B3HW)


def train_decoder(cfg: DemoTrainConfig, vq: MultiScaleVQVAE, device: torch.device,
                  log: Callable[[str], None]) -> MultiScaleVQVAE:
    """A copy of ``vq`` (its own sizes and schedule) with the final decode side (per-pixel norm,
    replicate padding), warm-started from ``vq``'s decoder and ``post_quant_conv`` and trained on the
    latents of the frozen encoder and codebook: the same codes decode to new pictures. From an
    official GroupNorm decoder this removes its top-left smudge (see the module docstring)."""
    torch.manual_seed(cfg.seed)
    new = MultiScaleVQVAE.from_config(vq.config, decoder_norm="channel", decoder_padding="replicate")
    new.load_state_dict({k: v.float() for k, v in vq.state_dict().items()})      # the same keys and shapes
    new = new.to(device).eval().requires_grad_(False)
    params = [*new.decoder.parameters(), *new.post_quant_conv.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.dec_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device).manual_seed(cfg.seed * 1000 + 7)
    disc = None
    if cfg.dec_adv_weight > 0:
        disc = PatchDiscriminator().to(device).train()
        opt_d = torch.optim.AdamW(disc.parameters(), lr=cfg.dec_lr, betas=(0.5, 0.9), weight_decay=0.0)
        last_W = new.decoder.conv_out.weight
    t0 = time.time()
    data_N3HW, labels_N = render_dataset(cfg.vq_data, cfg.seed * 1000 + 5, device)      # stage 1's scenes
    log(f"decoder: rendered {data_N3HW.shape[0]} scenes in {time.time() - t0:.0f}s")
    t0 = time.time()
    lr_sched = _schedule(opt, cfg.dec_steps, min(200, cfg.dec_steps // 10 + 1))
    for step in range(cfg.dec_steps):
        img_B3HW, _ = _batch(data_N3HW, labels_N, cfg.vq_batch, gen)
        with torch.no_grad(), _autocast(device):
            f_hat_BChw = new.quantize_multiscale(new.encode(img_B3HW))[1][-1]      # float32, what sampling decodes
        with _autocast(device):
            rec_B3HW = new.decoder(new.post_quant_conv(f_hat_BChw)).float()
        loss = rec_loss = _reconstruction_loss(rec_B3HW, img_B3HW)
        adv = ""
        if disc is not None and step >= cfg.dec_adv_start:
            with _autocast(device):
                g_loss = -disc(rec_B3HW).float().mean()
            # VQGAN's balance: the adversarial gradient at the last layer as large as the reconstruction's
            g_rec = torch.autograd.grad(rec_loss, last_W, retain_graph=True)[0].norm()
            g_adv = torch.autograd.grad(g_loss, last_W, retain_graph=True)[0].norm()
            lam = (g_rec / (g_adv + 1e-4)).clamp(0, 1e4).detach() * cfg.dec_adv_weight
            loss = rec_loss + lam * g_loss
            adv = f" g {g_loss.item():.3f} lambda {lam.item():.3f}"
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 2.0)
        opt.step()
        lr_sched.step()
        if disc is not None:                             # hinge loss on real scenes and this step's pictures
            with _autocast(device):
                d_real_B = disc(img_B3HW).float()
                d_fake_B = disc(rec_B3HW.detach()).float()
            d_loss = F.relu(1 - d_real_B).mean() + F.relu(1 + d_fake_B).mean()
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            opt_d.step()
            adv += f" d {d_loss.item():.3f}"
        if step % 500 == 0 or step == cfg.dec_steps - 1:
            edges = 100 * strong_edge_fraction(((rec_B3HW.detach() + 1) / 2).clamp(0, 1)).median().item()
            log(f"decoder {step:5d}/{cfg.dec_steps} loss {loss.item():.4f} rec {rec_loss.item():.4f}{adv} "
                f"psnr {_psnr(rec_B3HW, img_B3HW):.2f} dB strong edges {edges:.2f} % {time.time() - t0:.0f}s")
    return new.eval().requires_grad_(False)


# ---- stage 3: the transformer --------------------------------------------------------------------
def build_var(cfg: DemoTrainConfig) -> VARTransformer:
    return VARTransformer(vocab_size=cfg.vq_vocab, z_channels=32, num_classes=NUM_CLASSES, depth=cfg.var_depth,
                          embed_dim=cfg.var_width, num_heads=cfg.var_heads, patch_nums=VAR_SCHEDULES[cfg.schedule])


def _init_var(model: VARTransformer) -> VARTransformer:
    """Trunc-normal weights with AdaLN-zero: every block's and the head's modulation starts at 0,
    so the network starts as the identity on its inputs (stable from the first step)."""
    model.init_random_weights(0.02)
    with torch.no_grad():
        for blk in model.blocks:
            blk.ada_lin[1].weight.zero_()
            blk.ada_lin[1].bias.zero_()
            blk.attn.scale_mul_1H11.fill_(math.log(4.0))
        model.head_nm.ada_lin[1].weight.zero_()
        model.head_nm.ada_lin[1].bias.zero_()
    return model


@torch.no_grad()
def tokenize_scenes(vq: MultiScaleVQVAE, count: int, seed: int, device: torch.device, batch: int = 512):
    """Codes (N, L) int16, teacher-forcing inputs (N, L - 1, Cvae) bfloat16 and labels (N,) of
    ``count`` fresh scenes."""
    imgs_N3HW, labels_N = render_dataset(count, seed, device)
    codes, inputs = [], []
    for start in range(0, count, batch):
        img_B3HW = imgs_N3HW[start:start + batch].float() / 127.5 - 1
        with _autocast(device):
            idx_list = vq.img_to_idx(img_B3HW)
        codes.append(torch.cat(idx_list, dim=1).to(torch.int16))
        inputs.append(vq.idx_to_var_input(idx_list).to(torch.bfloat16))
    return torch.cat(codes), torch.cat(inputs), labels_N


def train_var(cfg: DemoTrainConfig, vq: MultiScaleVQVAE, device: torch.device,
              log: Callable[[str], None], init: Optional[VARTransformer] = None) -> VARTransformer:
    """The transformer, trained on ``cfg.var_data`` tokenised scenes from a fresh initialisation, or
    further from ``init`` (its weights, in float32)."""
    t0 = time.time()
    codes_NL, inputs_NLC, labels_N = tokenize_scenes(vq, cfg.var_data, cfg.seed * 1000 + 2, device)
    log(f"var: tokenised {codes_NL.shape[0]} scenes in {time.time() - t0:.0f}s")
    torch.manual_seed(cfg.seed)
    model = _init_var(build_var(cfg))
    if init is not None:
        model.load_state_dict({k: v.float() for k, v in init.state_dict().items()})
    model = model.to(device).train()
    model.rebuild_buffers()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "pos_" not in n and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "pos_" not in n and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.var_lr, betas=(0.9, 0.95))
    gen = torch.Generator(device).manual_seed(cfg.seed * 1000 + 3)
    sizes = [h * w for h, w in model.schedule.hw]
    step_fn = torch.compile(model) if cfg.compile and device.type == "cuda" else model
    t0 = time.time()
    lr_sched = _schedule(opt, cfg.var_steps, min(500, cfg.var_steps // 10 + 1))
    for step in range(cfg.var_steps):
        pick_B = torch.randint(0, codes_NL.shape[0], (cfg.var_batch,), generator=gen, device=device)
        flat_BL = codes_NL[pick_B].long()
        label_B = labels_N[pick_B].clone()
        drop_B = torch.rand(cfg.var_batch, generator=gen, device=device) < cfg.var_label_dropout
        label_B[drop_B] = model.null_class
        x_BLCv = inputs_NLC[pick_B].float()
        with _autocast(device):
            logits_BLV = step_fn(label_B, x_BLCv)
        loss = F.cross_entropy(logits_BLV.float().flatten(0, 1), flat_BL.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        opt.step()
        lr_sched.step()
        if step % 500 == 0 or step == cfg.var_steps - 1:
            with torch.no_grad():
                last = sizes[-1]
                acc = (logits_BLV[:, -last:].argmax(-1) == flat_BL[:, -last:]).float().mean().item()
            log(f"var {step:5d}/{cfg.var_steps} loss {loss.item():.4f} last-scale acc {acc:.3f} "
                f"{time.time() - t0:.0f}s")
    return model.eval().requires_grad_(False)


# ---- stage 4: the classifier ---------------------------------------------------------------------
def _soften(x_B3HW: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Blur two thirds of the batch (one or two 3×3 box passes at the classifier's 64 px, about
    12 / 20 px at 256): generated pictures are softer than renders, and the judge should not be
    thrown by that alone."""
    B = x_B3HW.shape[0]
    which_B = torch.randint(0, 3, (B,), generator=gen, device=x_B3HW.device).view(-1, 1, 1, 1)
    blur1 = F.avg_pool2d(x_B3HW, 3, 1, 1, count_include_pad=False)
    blur2 = F.avg_pool2d(blur1, 3, 1, 1, count_include_pad=False)
    return torch.where(which_B == 0, x_B3HW, torch.where(which_B == 1, blur1, blur2))


def _to_classifier_size(img_N3HW_u8: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, S, S) → uint8 (N, 3, 64, 64), antialiased as the classifier resizes."""
    out = []
    for chunk in img_N3HW_u8.split(512):
        small = F.interpolate(chunk.float(), size=(CLASSIFIER_SIZE, CLASSIFIER_SIZE), mode="bilinear",
                              antialias=True, align_corners=False)
        out.append(small.round().clamp(0, 255).to(torch.uint8))
    return torch.cat(out)


def train_classifier(cfg: DemoTrainConfig, vq: Optional[MultiScaleVQVAE], device: torch.device,
                     log: Callable[[str], None]) -> SceneClassifier:
    """Trained on scenes, a third of them blurred (and, with ``cls_reconstructions``, on their VQVAE
    reconstructions too), so it judges generated pictures, which are softer than renders."""
    torch.manual_seed(cfg.seed)
    clf = SceneClassifier(NUM_CLASSES).to(device).train()
    opt = torch.optim.AdamW(clf.parameters(), lr=2e-3, weight_decay=0.01)
    gen = torch.Generator(device).manual_seed(cfg.seed * 1000 + 4)
    t0 = time.time()
    size = 256 if cfg.cls_reconstructions else cfg.cls_render_size      # the VQVAE needs 256 px inputs
    with_recs = vq is not None and cfg.cls_reconstructions
    # rendered, reconstructed and shrunk to the classifier's 64 px chunk by chunk (the same scenes and
    # order as one render_dataset call): 48 000 scenes at 256 px would hold ~19 GB at once
    scene_gen = torch.Generator(device).manual_seed(cfg.seed * 1000 + 6)
    clean, recs, labels = [], [], []
    for start in range(0, cfg.cls_data, 1024):
        lab_B = random_labels(min(1024, cfg.cls_data - start), scene_gen)
        img_B3HW = (render_scenes(lab_B, scene_gen, SceneConfig(size=size)) * 255).round().to(torch.uint8)
        if with_recs:
            with torch.no_grad():
                for sub in img_B3HW.split(256):
                    with _autocast(device):
                        rec = vq(sub.float() / 127.5 - 1).float()
                    recs.append(_to_classifier_size(((rec + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)))
        clean.append(_to_classifier_size(img_B3HW))
        labels.append(lab_B)
    clean_N3HW, labels_N = torch.cat(clean + recs), torch.cat(labels)
    if with_recs:
        labels_N = labels_N.repeat(2)
    log(f"classifier: {clean_N3HW.shape[0]} training images in {time.time() - t0:.0f}s")
    t0 = time.time()
    lr_sched = _schedule(opt, cfg.cls_steps, min(100, cfg.cls_steps // 10 + 1))
    for step in range(cfg.cls_steps):
        img_B3HW, lab_B = _batch(clean_N3HW, labels_N, cfg.cls_batch, gen)
        img_B3HW = _soften(img_B3HW, gen)
        loss = F.cross_entropy(clf((img_B3HW + 1) / 2), lab_B)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        lr_sched.step()
        if step % 250 == 0 or step == cfg.cls_steps - 1:
            with torch.no_grad():
                acc = (clf((img_B3HW + 1) / 2).argmax(-1) == lab_B).float().mean().item()
            log(f"classifier {step:4d}/{cfg.cls_steps} loss {loss.item():.4f} batch acc {acc:.3f} "
                f"{time.time() - t0:.0f}s")
    return clf.eval().requires_grad_(False)


# ---- measuring the result -------------------------------------------------------------------------
@torch.no_grad()
def measure_demo(folder, device, count: int = 360, batch: int = 60, scenes: int = 240) -> dict:
    """What the demo model draws, measured on ``count`` pictures (classes in turn; batches of ``batch``
    with seeds 0, 1, … at the pipeline's default settings, float32) and on ``scenes`` fresh scenes
    (labels from seed 9000, pictures from seed 9001): the classifier's accuracy on the pictures,
    their strong-edge fraction (median, 10th percentile) and worst top-left smudge ratio; the
    VQVAE's reconstruction PSNR and the strong-edge fraction of scenes and of their
    reconstructions."""
    from ..pipelines.var_pipeline import VARPipeline
    from .measures import corner_smudge_ratio, strong_edge_fraction

    folder, device = Path(folder), torch.device(device)
    pipe = VARPipeline.from_pretrained(folder).to(device)
    pipe.set_progress_bar_config(disable=True)
    clf = SceneClassifier.from_file(folder / "classifier.safetensors", NUM_CLASSES).to(device)
    hits, edges, smudge = [], [], []
    for i, start in enumerate(range(0, count, batch)):
        labels = [(start + j) % NUM_CLASSES for j in range(min(batch, count - start))]
        img_B3HW = pipe(labels, generator=torch.Generator(device).manual_seed(i), output_type="pt").images.float()
        hits.append(clf(img_B3HW).argmax(-1).cpu() == torch.tensor(labels))
        edges.append(strong_edge_fraction(img_B3HW).cpu())
        smudge.append(corner_smudge_ratio(img_B3HW).cpu())
    scenes_B3HW = render_scenes(random_labels(scenes, torch.Generator(device).manual_seed(9000)),
                                torch.Generator(device).manual_seed(9001))
    recs_B3HW = torch.cat([((pipe.vqvae(x * 2 - 1).float() + 1) / 2).clamp(0, 1) for x in scenes_B3HW.split(60)])
    mse = F.mse_loss(recs_B3HW, scenes_B3HW).item()
    edges_N = torch.cat(edges) if edges else torch.zeros(0, dtype=torch.float64)
    out = {"pictures": count,
           "classifier_accuracy": round(torch.cat(hits).float().mean().item(), 4) if hits else None,
           "strong_edge_pct_median": round(100 * edges_N.median().item(), 3) if count else None,
           "strong_edge_pct_p10": round(100 * edges_N.quantile(0.1).item(), 3) if count else None,
           "corner_smudge_ratio_max": round(torch.cat(smudge).max().item(), 2) if smudge else None,
           "reconstruction_psnr_db": round(-10 * math.log10(max(mse, 1e-10)), 2),
           "scenes_strong_edge_pct_median": round(100 * strong_edge_fraction(scenes_B3HW).median().item(), 3),
           "reconstructions_strong_edge_pct_median": round(100 * strong_edge_fraction(recs_B3HW).median().item(), 3)}
    pipe.to("cpu")
    return out


# ---- the command ---------------------------------------------------------------------------------
def _save_folder(out: Path, vq: MultiScaleVQVAE, var: VARTransformer, cfg: DemoTrainConfig) -> None:
    from ..pipelines.var_pipeline import VARPipeline

    half = torch.nn.Module.to                                   # plain casts (no diffusers dtype warnings)
    pipe = VARPipeline(transformer=half(var, torch.bfloat16), vqvae=half(vq, torch.float16),
                       id2label={i: n for i, n in enumerate(CLASS_NAMES)})
    pipe.save_pretrained(out)
    half(vq, torch.float32)


def _save_stage_vqvae(path: Path, vq: MultiScaleVQVAE) -> None:
    """The VQVAE's weights in float16; the file's metadata says whose decoder it has (stage 1's or the
    ``decoder`` stage's)."""
    from safetensors.torch import save_file
    final = vq.config.decoder_norm == "channel"
    save_file({k: v.half().contiguous() for k, v in vq.state_dict().items()}, path,
              metadata={"decoder": "final" if final else "stage1"})


def train_demo(out_dir, config: DemoTrainConfig = DemoTrainConfig(), stages=STAGES, device=None,
               log: Callable[[str], None] = print) -> Path:
    """Run the requested stages, reading earlier stages' results from ``out_dir`` (no default: the
    shipped model in ``demo.DEMO_MODEL_DIR`` is replaced only when it is named). Files are written
    to a temporary folder beside it and moved into place, so an interrupted run leaves the previous
    model intact. The ``decoder`` stage alone, on a finished folder, replaces its VQVAE's decoder
    and keeps its transformer (the codes are unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    stages = tuple(stages)
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"stages={bad}: choose from {', '.join(STAGES)}")
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tmp = out.with_name(f".{out.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    if out.exists():
        shutil.copytree(out, tmp)
    else:
        tmp.mkdir(parents=True)
    try:
        vq = var = None
        seconds = {}
        stage_file = tmp / "stage_vqvae.safetensors"                   # a VQVAE not yet in a model folder
        if "vqvae" in stages:
            t0 = time.time()
            vq = train_vqvae(config, device, log)
            seconds["vqvae"] = time.time() - t0
            _save_stage_vqvae(stage_file, vq)
        elif stage_file.is_file():                                     # between stages 1 and 3
            with safe_open(stage_file, "pt") as f:
                final = (f.metadata() or {}).get("decoder") == "final"          # older files: stage 1's
            vq = build_vqvae(config, final_decoder=final)
            vq.load_state_dict({k: v.float() for k, v in load_file(stage_file).items()})
            vq = vq.to(device).eval().requires_grad_(False)
        elif (tmp / "vqvae" / "config.json").is_file():             # a finished model folder
            vq = MultiScaleVQVAE.from_pretrained(tmp, subfolder="vqvae", local_files_only=True,
                                                 torch_dtype=torch.float32).to(device).eval().requires_grad_(False)
        if "decoder" in stages:
            if vq is None:
                raise ValueError(f"stage 'decoder' needs a trained VQVAE: run stage 'vqvae' first (into {out})")
            t0 = time.time()
            vq = train_decoder(config, vq, device, log)
            seconds["decoder"] = time.time() - t0
            if stage_file.is_file():
                _save_stage_vqvae(stage_file, vq)
            else:                                                      # the folder's own VQVAE, decoder replaced
                half = torch.nn.Module.to
                half(vq, torch.float16).save_pretrained(tmp / "vqvae")
                half(vq, torch.float32)
        if "var" in stages:
            if vq is None:
                raise ValueError(f"stage 'var' needs a trained VQVAE: run stage 'vqvae' first (into {out})")
            if tuple(vq.config.patch_nums) != VAR_SCHEDULES[config.schedule]:
                raise ValueError(f"stage 'var': the VQVAE in {out} has the schedule {tuple(vq.config.patch_nums)}, "
                                 f"the config asks for {VAR_SCHEDULES[config.schedule]} (schedule={config.schedule}): "
                                 f"train stage 'vqvae' again, or pass the VQVAE's schedule")
            init = None
            if config.var_continue:
                if not (tmp / "transformer" / "config.json").is_file():
                    raise ValueError(f"var_continue: {out} has no trained transformer (transformer/config.json) "
                                     f"to continue from; run stage 'var' without it first")
                init = VARTransformer.from_pretrained(tmp, subfolder="transformer", local_files_only=True,
                                                      torch_dtype=torch.float32)
            t0 = time.time()
            var = train_var(config, vq, device, log, init=init)
            seconds["var"] = time.time() - t0
            _save_folder(tmp, vq, var, config)
            (tmp / "stage_vqvae.safetensors").unlink(missing_ok=True)    # the folder's vqvae/ holds it now
        if "classifier" in stages:
            t0 = time.time()
            clf = train_classifier(config, vq, device, log)
            save_file({k: v.half().contiguous() for k, v in clf.state_dict().items()}, tmp / "classifier.safetensors")
            seconds["classifier"] = time.time() - t0
        measured = None
        if "classifier" in stages and config.measure_count and (tmp / "model_index.json").is_file():
            measured = measure_demo(tmp, device, config.measure_count)
            log("measured: " + ", ".join(f"{k} {v}" for k, v in measured.items()))
        meta_path = tmp / "train_demo.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        meta.update(config=asdict(config), classes=list(CLASS_NAMES),
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    torch=torch.__version__)
        meta.setdefault("stages", {}).update({s: time.strftime("%Y-%m-%d %H:%M:%S") for s in stages})
        meta.setdefault("seconds", {}).update({s: round(t) for s, t in seconds.items()})
        if measured is not None:
            meta["measured"] = measured
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
