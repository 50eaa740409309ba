"""ComfyUI nodes for VAR-family generation. Thin: widgets → a frozen config → one library call.

Node ids and custom type names carry the ``SparseVAR`` prefix and are never renamed (saved
workflows refer to them). The sampler applies the acceleration settings only inside its own call:
ComfyUI caches node outputs and hands the same objects to every consumer, so nothing shared is
modified.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..demo import DEMO_MODEL_DIR
from ..engine.state import GenerationStats
from ..pipelines.var_pipeline import VARPipeline
from ..policies.fastvar import FASTVAR_PRESETS, FastVARConfig, FastVARPolicy
from ..policies.scale_skip import ScaleSkipConfig, ScaleSkipPolicy
from ..policies.sparsevar import SPARSEVAR_PRESETS, SparseVARConfig, SparseVARPolicy
from ._comfy import comfy_utils, folder_paths, io, model_management, model_patcher
from .docs import field_doc

CATEGORY = "SparseVAR"
FOLDER = "var"                      # models/var
FROM_FOLDER = "(converted folder: none needed)"

SparseVARModel = io.Custom("SPARSEVAR_MODEL")
SparseVARSettings = io.Custom("SPARSEVAR_SETTINGS")
AnchorSettings = io.Custom("SPARSEVAR_ANCHOR_SETTINGS")
ScaleSkipSettings = io.Custom("SPARSEVAR_SCALE_SKIP")
FastVARSettings = io.Custom("SPARSEVAR_FASTVAR_SETTINGS")
GenerationStatsType = io.Custom("SPARSEVAR_STATS")


def register_model_folder() -> None:
    """models/var for checkpoint files (.pth, .safetensors) and converted folders."""
    default = os.path.join(folder_paths.models_dir, FOLDER)
    paths, exts = folder_paths.folder_names_and_paths.get(FOLDER, ([], set()))
    paths = list(paths) + ([default] if default not in paths else [])
    folder_paths.folder_names_and_paths[FOLDER] = (paths, set(exts) | {".pth", ".pt", ".safetensors"})


def _model_roots() -> list[Path]:
    return [Path(p) for p in folder_paths.get_folder_paths(FOLDER) if os.path.isdir(p)]


def _folders() -> list[str]:
    return sorted({str(d.relative_to(root)) for root in _model_roots() for d in root.rglob("*")
                   if d.is_dir() and (d / "model_index.json").is_file()})


def _files() -> list[str]:
    """Checkpoint files under models/var, leaving out the insides of converted folders."""
    folders = _folders()
    return [f for f in folder_paths.get_filename_list(FOLDER) if not any(f.startswith(d + os.sep) for d in folders)]


DEMO_CHOICE = "sparsevar-demo (built in)"


def model_choices() -> list[str]:
    """The built-in demo model, then converted folders (with model_index.json) and checkpoint files
    under models/var."""
    return [DEMO_CHOICE] + _folders() + _files()


def _resolve(name: str) -> str:
    if name == DEMO_CHOICE:
        return str(DEMO_MODEL_DIR)
    for root in _model_roots():
        if (root / name).exists():
            return str(root / name)
    raise ValueError(f"VAR Model Loader: {name!r} is not in models/var ({', '.join(map(str, _model_roots()))}); "
                     f"put the official .pth files or a converted folder there and refresh")


class _VARModules(torch.nn.Module):
    """The pipeline's modules under one ``nn.Module`` with a plain ``device`` attribute, so
    ComfyUI's ModelPatcher can size, load and offload them like its own models."""

    def __init__(self, pipe: VARPipeline):
        super().__init__()
        self.transformer, self.vqvae = pipe.transformer, pipe.vqvae
        self.device = pipe.transformer.device


class VARModelHandle:
    """What flows over SPARSEVAR_MODEL: the pipeline and the ModelPatcher that manages its memory."""

    def __init__(self, pipe: VARPipeline, name: str):
        self.pipe, self.name = pipe, name
        self.patcher = model_patcher.ModelPatcher(_VARModules(pipe), load_device=model_management.get_torch_device(),
                                                  offload_device=model_management.unet_offload_device())


class VARModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_VARModelLoader", display_name="VAR Model Loader", category=CATEGORY,
            description="Loads an official VAR checkpoint (var_d16.pth … var_d36.pth + vae_ch160v4096z32.pth) or a "
                        "converted folder from models/var.",
            inputs=[
                io.Combo.Input("model", options=model_choices(),
                               tooltip="transformer file (var_d*.pth) or converted folder in models/var; the built-in "
                                       "demo model draws 12 simple classes (disc … fish) with nothing to download"),
                io.Combo.Input("vae", options=[FROM_FOLDER] + _files(),
                               tooltip="the VQVAE file (vae_ch160v4096z32.pth); not needed for a converted folder"),
                io.Combo.Input("dtype", options=["auto", "bfloat16", "float16", "float32"], default="auto",
                               tooltip="transformer weights; auto = bfloat16 on a GPU, float32 on the CPU"),
            ],
            outputs=[SparseVARModel.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, vae, dtype) -> io.NodeOutput:
        device = model_management.get_torch_device()
        if dtype == "auto":
            dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
        pipe = VARPipeline.from_path(_resolve(model), None if vae == FROM_FOLDER else _resolve(vae),
                                     dtype=getattr(torch, dtype))
        return io.NodeOutput(VARModelHandle(pipe, model))


class SparseVARSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = SPARSEVAR_PRESETS["var"]
        return io.Schema(
            node_id="SparseVAR_Settings", display_name="SparseVAR Settings", category=CATEGORY,
            description="Frequency-aware token exclusion (SparseVAR). Connect to the sampler's 'sparsevar' input.",
            inputs=[
                io.Float.Input("tau", default=d.tau, min=0.0, max=0.99, step=0.01,
                               tooltip=field_doc(SparseVARConfig, "tau")),
                io.Int.Input("start_scale", default=d.start_scale, min=-16, max=16,
                             tooltip=field_doc(SparseVARConfig, "start_scale")),
                io.Int.Input("block", default=-1, min=-1, max=128,
                             tooltip="-1 = the model family's preset. " + field_doc(SparseVARConfig, "block")),
                io.Float.Input("keep_ratio", default=0.0, min=0.0, max=1.0, step=0.05,
                               tooltip="0 = use tau. " + field_doc(SparseVARConfig, "keep_ratio")),
            ],
            outputs=[SparseVARSettings.Output(display_name="sparsevar")],
        )

    @classmethod
    def execute(cls, tau, start_scale, block, keep_ratio) -> io.NodeOutput:
        return io.NodeOutput(dataclasses.replace(SPARSEVAR_PRESETS["var"], tau=tau, start_scale=start_scale,
                                                 block=None if block < 0 else block,
                                                 keep_ratio=None if keep_ratio == 0 else keep_ratio))


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """alpha: anchor stride in tokens. beta: cosine threshold for copying an anchor (SparseVARConfig)."""

    alpha: int
    beta: float


class AnchorSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = SPARSEVAR_PRESETS["var"]
        return io.Schema(
            node_id="SparseVAR_AnchorSettings", display_name="Anchor Settings", category=CATEGORY,
            description="SparseVAR's anchor grid and copy threshold. Connect to the sampler's 'anchors' input.",
            inputs=[
                io.Int.Input("alpha", default=d.alpha, min=1, max=16, tooltip=field_doc(SparseVARConfig, "alpha")),
                io.Float.Input("beta", default=d.beta, min=0.0, max=1.0, step=0.01,
                               tooltip=field_doc(SparseVARConfig, "beta")),
            ],
            outputs=[AnchorSettings.Output(display_name="anchors")],
        )

    @classmethod
    def execute(cls, alpha, beta) -> io.NodeOutput:
        return io.NodeOutput(AnchorConfig(alpha=alpha, beta=beta))


class ScaleSkipNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_ScaleSkip", display_name="Scale Skip", category=CATEGORY,
            description="Skip the last scales and/or run the last scales without guidance.",
            inputs=[
                io.Int.Input("skip_last", default=0, min=0, max=16,
                             tooltip="0 disables. " + field_doc(ScaleSkipConfig, "skip_last")),
                io.Int.Input("cond_only_last", default=0, min=0, max=16,
                             tooltip="Run the last N scales without the unconditional half (0 disables). "
                                     + field_doc(ScaleSkipConfig, "cond_only_from")),
            ],
            outputs=[ScaleSkipSettings.Output(display_name="scale_skip")],
        )

    @classmethod
    def execute(cls, skip_last, cond_only_last) -> io.NodeOutput:
        return io.NodeOutput(ScaleSkipConfig(skip_last=skip_last,
                                             cond_only_from=-cond_only_last if cond_only_last else None))


class FastVARSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = FASTVAR_PRESETS["var"]
        return io.Schema(
            node_id="SparseVAR_FastVARSettings", display_name="FastVAR Settings", category=CATEGORY,
            description="Cached token pruning (FastVAR). Connect to the sampler's 'fastvar' input.",
            inputs=[
                io.String.Input("ratios", default=", ".join(str(r) for r in d.ratios),
                                tooltip="comma-separated. " + field_doc(FastVARConfig, "ratios")),
            ],
            outputs=[FastVARSettings.Output(display_name="fastvar")],
        )

    @classmethod
    def execute(cls, ratios) -> io.NodeOutput:
        try:
            values = tuple(float(v) for v in ratios.replace(";", ",").split(",") if v.strip())
        except ValueError:
            raise ValueError(f"FastVAR Settings: ratios must be numbers separated by commas, e.g. '0.5, 0.75'; "
                             f"got {ratios!r}") from None
        return io.NodeOutput(FastVARConfig(ratios=values))


class SparseVARSampler(io.ComfyNode):
    """One ProgressBar tick per scale, without a preview image: a VAR preview needs a full VQVAE
    decode of the latent, as expensive as the final one, so it is not "cheap" at any scale."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_Sampler", display_name="SparseVAR Sampler", category=CATEGORY,
            description="Generates images with a VAR model, scale by scale, with optional acceleration.",
            inputs=[
                SparseVARModel.Input("model"),
                io.String.Input("class_label", default="207",
                                tooltip="class id or ImageNet name (e.g. 207 or 'golden retriever'); "
                                        "several separated by '|'"),
                io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff, control_after_generate=True,
                             tooltip="every random draw comes from a CPU generator seeded with this"),
                io.Float.Input("cfg", default=4.0, min=0.0, max=20.0, step=0.1,
                               tooltip="guidance strength, ramped from 0 at the first scale to this at the last; "
                                       "0 = off (official demo 4, FID 1.5)"),
                io.Int.Input("top_k", default=900, min=0, max=65536, tooltip="keep the k most likely codes (0 = all)"),
                io.Float.Input("top_p", default=0.95, min=0.0, max=1.0, step=0.01,
                               tooltip="nucleus mass kept per token (0 = off)"),
                io.Int.Input("batch_size", default=1, min=1, max=64, tooltip="images per class label"),
                SparseVARSettings.Input("sparsevar", optional=True),
                AnchorSettings.Input("anchors", optional=True),
                ScaleSkipSettings.Input("scale_skip", optional=True),
                FastVARSettings.Input("fastvar", optional=True),
            ],
            outputs=[io.Image.Output(display_name="images"), io.String.Output(display_name="stats"),
                     GenerationStatsType.Output(display_name="token_maps")],
        )

    @classmethod
    def execute(cls, model, class_label, seed, cfg, top_k, top_p, batch_size, sparsevar=None, anchors=None,
                scale_skip=None, fastvar=None) -> io.NodeOutput:
        pipe: VARPipeline = model.pipe
        policies = []
        if anchors is not None and sparsevar is None:
            sparsevar = SPARSEVAR_PRESETS["var"]
        if sparsevar is not None:
            if anchors is not None:
                sparsevar = dataclasses.replace(sparsevar, alpha=anchors.alpha, beta=anchors.beta)
            policies.append(SparseVARPolicy(sparsevar))
        if fastvar is not None:
            policies.append(FastVARPolicy(fastvar))
        if scale_skip is not None:
            policies.append(ScaleSkipPolicy(scale_skip))
        labels = [lab.strip() for lab in str(class_label).split("|") if lab.strip()]
        labels = [int(lab) if lab.isdigit() else lab for lab in labels]
        model_management.load_models_gpu([model.patcher])
        total = pipe.num_timesteps
        bar = comfy_utils.ProgressBar(total)

        done = [0]

        def on_scale(p, si, t, kw):
            done[0] = si + 1
            bar.update_absolute(si + 1, total)
            model_management.throw_exception_if_processing_interrupted()
            return kw

        pipe.set_progress_bar_config(disable=True)
        out = pipe(labels, guidance_scale=cfg, top_k=top_k, top_p=top_p, num_images_per_prompt=batch_size,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type="pt",
                   callback_on_step_end=on_scale, policies=policies)
        if done[0] < total:
            bar.update_absolute(total, total)           # skipped scales end the bar too
        stats: GenerationStats = out.stats[0]
        images = out.images.float().clamp(0, 1).permute(0, 2, 3, 1).to(model_management.intermediate_device())
        text = (f"{stats.summary()}; FLOP-ideal speed-up {pipe.flop_speedup(stats):.2f}x\n{stats.table()}")
        return io.NodeOutput(images, text, stats)


class TokenMapPreview(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_TokenMapPreview", display_name="Token Map Preview", category=CATEGORY,
            description="Which tokens each pruned scale computed (clear), left out (dark), copied from an anchor "
                        "(blue), and the anchors (red).",
            inputs=[GenerationStatsType.Input("token_maps"), io.Image.Input("images")],
            outputs=[io.Image.Output(display_name="maps")],
        )

    @classmethod
    def execute(cls, token_maps, images) -> io.NodeOutput:
        from ..viz import token_map_images
        return io.NodeOutput(token_map_images(token_maps, images))


NODES = [VARModelLoader, SparseVARSampler, SparseVARSettingsNode, AnchorSettingsNode, ScaleSkipNode,
         FastVARSettingsNode, TokenMapPreview]
