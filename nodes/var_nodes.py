"""ComfyUI nodes for VAR-family generation. Thin: widgets → a frozen config → one library call.

Node ids and custom type names carry the ``SparseVAR`` prefix and are never renamed (saved
workflows refer to them). The sampler applies the acceleration settings only inside its own call:
ComfyUI caches node outputs and hands the same objects to every consumer, so nothing shared is
modified.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from ..demo import DEMO_MODEL_DIR
from ..engine.state import GenerationStats
from ..models.loading import OFFICIAL_DOWNLOADS
from ..pipelines.defaults import VAR_DEFAULTS       # the sampler's widgets serve both families: VAR's
from ..pipelines.flexvar_pipeline import FlexVARPipeline
from ..pipelines.infinity_pipeline import InfinityPipeline
from ..pipelines.hart_pipeline import HARTPipeline
from ..pipelines.var_pipeline import VARPipeline
from ..policies.fastvar import FASTVAR_PRESETS, FastVARConfig, FastVARPolicy
from ..policies.scale_skip import ScaleSkipConfig, ScaleSkipPolicy
from ..policies.sparsevar import SPARSEVAR_PRESETS, SparseVARConfig, SparseVARPolicy, _replace
from ..policies.scalekv import ScaleKVConfig, ScaleKVPolicy
from ..policies.sparvar import MAPPINGS, SPARVAR_PRESETS, SparVARConfig, SparVARPolicy
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
SparVARSettings = io.Custom("SPARSEVAR_SPARVAR_SETTINGS")
ScaleKVSettings = io.Custom("SPARSEVAR_SCALEKV_SETTINGS")
GenerationStatsType = io.Custom("SPARSEVAR_STATS")
Conditioning = io.Custom("SPARSEVAR_CONDITIONING")


def register_model_folder(folder: str = FOLDER) -> None:
    """models/<folder> (models/var, models/infinity) for checkpoint files (.pth, .safetensors) and
    converted folders; paths from extra_model_paths.yaml under the same key are kept."""
    default = os.path.join(folder_paths.models_dir, folder)
    paths, exts = folder_paths.folder_names_and_paths.get(folder, ([], set()))
    paths = list(paths) + ([default] if default not in paths else [])
    folder_paths.folder_names_and_paths[folder] = (paths, set(exts) | {".pth", ".pt", ".safetensors"})


def model_roots(folder: str = FOLDER) -> list[Path]:
    try:
        paths = folder_paths.get_folder_paths(folder)
    except KeyError:                                  # a folder name this ComfyUI does not know
        return []
    return [Path(p) for p in paths if os.path.isdir(p)]


def subfolders(folder: str = FOLDER, marker: str = "model_index.json") -> list[str]:
    """Folders under models/<folder> (relative names) holding a file named ``marker`` (a glob)."""
    return sorted({str(d.relative_to(root)) for root in model_roots(folder) for d in root.rglob("*")
                   if d.is_dir() and any(d.glob(marker))})


def _folders() -> list[str]:
    return subfolders(FOLDER)


def checkpoint_files(folder: str = FOLDER, inside: list[str] = ()) -> list[str]:
    """Checkpoint files under models/<folder>, leaving out the insides of the folders ``inside``."""
    return [f for f in folder_paths.get_filename_list(folder) if not any(f.startswith(d + os.sep) for d in inside)]


def _files() -> list[str]:
    """Checkpoint files under models/var, leaving out the insides of converted folders."""
    return checkpoint_files(FOLDER, _folders())


DEMO_CHOICE = "sparsevar-demo (built in)"


def model_choices() -> list[str]:
    """The built-in demo model, then converted folders (with model_index.json) and checkpoint files
    under models/var."""
    return [DEMO_CHOICE] + _folders() + _files()


def resolve_in(name: str, folder: str, node: str, what: str) -> Path:
    """The path of choice ``name`` under models/<folder>, or a ValueError saying where to put it (and,
    for an official file, where to download it by hand: nothing is downloaded automatically)."""
    for root in model_roots(folder):
        if (root / name).exists():
            return root / name
    url = OFFICIAL_DOWNLOADS.get(Path(name).name)
    where = ", ".join(map(str, model_roots(folder))) or f"{os.path.join(folder_paths.models_dir, folder)}, missing"
    fix = f"download {url} into that folder" if url else f"put {what} there"
    raise ValueError(f"{node}: {name!r} is not in models/{folder} ({where}); {fix} and refresh (nothing is "
                     f"downloaded automatically)")


def check_choices(node: str, choices) -> bool | str:
    """A loader's ``validate_inputs``: True when every chosen file or folder is there, else the line
    ``resolve_in`` gives for the first that is not (ComfyUI shows it on the node before anything
    runs; it replaces ComfyUI's "value not in list"). ``choices``: (value, models folder, what goes
    there) per input; the built-in and from-the-folder choices need nothing."""
    for value, folder, what in choices:
        if value in (DEMO_CHOICE, FROM_FOLDER):
            continue
        try:
            resolve_in(value, folder, node, what)
        except ValueError as e:
            return str(e)
    return True


def _resolve(name: str) -> str:
    if name == DEMO_CHOICE:
        return str(DEMO_MODEL_DIR)
    return str(resolve_in(name, FOLDER, "VAR Model Loader", "the official .pth files or a converted folder"))


class _PipelineModules(torch.nn.Module):
    """Some of a pipeline's modules (the generating ones: transformer + VQVAE / VAE; or its text
    encoder) under one ``nn.Module`` with a plain ``device`` attribute, so ComfyUI's ModelPatcher
    can size, load and offload them like its own models."""

    def __init__(self, modules: dict):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.device = next(self.parameters()).device


class WholeModelPatcher(model_patcher.ModelPatcher):
    """ComfyUI's ModelPatcher for modules that load whole. ComfyUI's low-VRAM mode loads part of a
    model and streams the rest layer by layer, which only its own ``comfy.ops`` layers can do; a
    part of these modules left on the CPU would stop the engine, which reads every weight where
    the pipeline runs. So a partial load becomes a full one, said in one line of the log, and a
    partial unload frees nothing (ComfyUI then unloads the whole model)."""

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        size = self.model_size()
        if not full_load and 0 < lowvram_model_memory < size:
            logging.warning(f"SparseVAR: ComfyUI has {lowvram_model_memory / 2 ** 20:.0f} MB for this model's "
                            f"{size / 2 ** 20:.0f} MB (low-VRAM mode); it loads whole, as its layers cannot be "
                            f"streamed by ComfyUI; for less memory add a ScaleKV Settings node to the sampler")
        return super().load(device_to, 0, force_patch_weights, full_load=True)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        return 0

    def detach(self, unpatch_all=True):
        """Unloaded by ComfyUI (``unpatch_all``: its weights leave the GPU): the pipeline's workspace
        (KV cache, CUDA graphs), which ComfyUI does not count, leaves with them (``release``)."""
        model = super().detach(unpatch_all)
        release = getattr(self, "release", None)
        if unpatch_all and release is not None:
            release()
        return model


def _patcher(modules: dict):
    return WholeModelPatcher(_PipelineModules(modules), load_device=model_management.get_torch_device(),
                             offload_device=model_management.unet_offload_device())


class VARModelHandle:
    """What flows over SPARSEVAR_MODEL: the pipeline (VARPipeline, FlexVARPipeline,
    InfinityPipeline or HARTPipeline) and the ModelPatchers that manage its memory: ``patcher``
    for the modules that generate (transformer and tokenizer), ``text_patcher`` for the text
    encoder (None for class-conditional models), so that ComfyUI can offload the text encoder
    while the sampler runs."""

    def __init__(self, pipe, name: str):
        # the pipeline's own kernel choice ("auto"): Triton's on a GPU under PyTorch's native allocator
        # (--disable-cuda-malloc), plain torch under ComfyUI's default cudaMallocAsync, where a Triton
        # kernel launched inside a CUDA graph capture was refused its freshly allocated buffer
        self.pipe, self.name = pipe, name
        modules = {k: m for k, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        text = {k: modules.pop(k) for k in ("text_encoder",) if k in modules}
        self.patcher = _patcher(modules)
        self.patcher.release = pipe.release_memory
        self.text_patcher = _patcher(text) if text else None


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
    def validate_inputs(cls, model, vae):
        return check_choices("VAR Model Loader", [(model, FOLDER, "the official .pth files or a converted folder"),
                                                  (vae, FOLDER, "the VQVAE file (vae_ch160v4096z32.pth)")])

    @classmethod
    def execute(cls, model, vae, dtype) -> io.NodeOutput:
        device = model_management.get_torch_device()
        if dtype == "auto":
            dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
        pipe = VARPipeline.from_path(_resolve(model), None if vae == FROM_FOLDER else _resolve(vae),
                                     dtype=getattr(torch, dtype))
        return io.NodeOutput(VARModelHandle(pipe, model))


@dataclasses.dataclass(frozen=True)
class SparseVARChoice:
    """What the SparseVAR Settings node set. The sampler applies it over the preset of the model's
    family (``SPARSEVAR_PRESETS``: VAR, Infinity-2B …), so one node serves every family.
    tau / start_scale / block None keep the model's preset threshold (calibrated or the family's) /
    first pruned scale (VAR: −2, Infinity-2B: −3) / observed layer or block group; keep_ratio None
    uses tau."""

    tau: float | None
    start_scale: int | None
    block: int | None
    keep_ratio: float | None

    def overrides(self) -> dict:
        out = {"keep_ratio": self.keep_ratio} if self.tau is None else {"tau": self.tau, "keep_ratio": self.keep_ratio}
        if self.start_scale is not None:
            out["start_scale"] = self.start_scale
        return out if self.block is None else {**out, "block": self.block}


class SparseVARSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = SPARSEVAR_PRESETS["var"]
        return io.Schema(
            node_id="SparseVAR_Settings", display_name="SparseVAR Settings", category=CATEGORY,
            description="Frequency-aware token exclusion (SparseVAR), applied over the preset of the model's "
                        "family (VAR, Infinity). Connect to the sampler's 'sparsevar' input.",
            inputs=[
                io.Float.Input("tau", default=-1.0, min=-1.0, max=0.99, step=0.01,
                               tooltip=f"-1 = the model's preset: the tau `sparsevar calibrate` measured for this "
                                       f"checkpoint, else the family's ({d.tau:g}). "
                                       + field_doc(SparseVARConfig, "tau")),
                io.Int.Input("start_scale", default=0, min=-16, max=16,
                             tooltip="0 = the model family's preset (VAR -2, Infinity -3). "
                                     + field_doc(SparseVARConfig, "start_scale")),
                io.Int.Input("block", default=-1, min=-1, max=128,
                             tooltip="-1 = the model's preset: the layer `sparsevar calibrate` measured for "
                                     "this checkpoint, else the family's. " + field_doc(SparseVARConfig, "block")),
                io.Float.Input("keep_ratio", default=0.0, min=0.0, max=1.0, step=0.05,
                               tooltip="0 = use tau. " + field_doc(SparseVARConfig, "keep_ratio")),
            ],
            outputs=[SparseVARSettings.Output(display_name="sparsevar")],
        )

    @classmethod
    def execute(cls, tau, start_scale, block, keep_ratio) -> io.NodeOutput:
        choice = SparseVARChoice(tau=None if tau < 0 else tau, start_scale=None if start_scale == 0 else start_scale,
                                 block=None if block < 0 else block,
                                 keep_ratio=None if keep_ratio == 0 else keep_ratio)
        SparseVARConfig(**choice.overrides())            # a bad value is named here, at this node
        return io.NodeOutput(choice)


@dataclasses.dataclass(frozen=True)
class AnchorConfig:
    """alpha: anchor stride in tokens. beta: cosine threshold for copying an anchor (SparseVARConfig)."""

    alpha: int
    beta: float

    def overrides(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta}


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


@dataclasses.dataclass(frozen=True)
class FastVARChoice:
    """What the FastVAR Settings node set: the prune ratios, applied over the preset of the model's
    family (``FASTVAR_PRESETS``; Infinity-2B's prunes layers 3..27 only)."""

    ratios: tuple

    def overrides(self) -> dict:
        return {"ratios": self.ratios}


class FastVARSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = FASTVAR_PRESETS["var"]
        return io.Schema(
            node_id="SparseVAR_FastVARSettings", display_name="FastVAR Settings", category=CATEGORY,
            description="Cached token pruning (FastVAR), applied over the preset of the model's family (VAR, "
                        "Infinity). Connect to the sampler's 'fastvar' input.",
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
        return io.NodeOutput(FastVARChoice(ratios=FastVARConfig(ratios=values).ratios))   # (checked by the config)


@dataclasses.dataclass(frozen=True)
class SparVARChoice:
    """What the SparVAR Settings node set, applied over the model family's preset
    (``SPARVAR_PRESETS``); decision_scale None keeps the preset's."""

    top_keys: float
    cs4a_layers: float
    decision_scale: int | None
    mapping: str

    def overrides(self) -> dict:
        out = {"top_keys": self.top_keys, "cs4a_layers": self.cs4a_layers, "mapping": self.mapping}
        return out if self.decision_scale is None else {**out, "decision_scale": self.decision_scale}


def _sparvar_presets(name: str) -> str:
    """Each model family's preset value of SparVAR setting ``name``, as ``enable_sparvar()`` picks it
    (``SPARVAR_PRESETS`` by the pipeline's family, else the config's default): "VAR -3, …, HART -4"."""
    pipes = (VARPipeline, FlexVARPipeline, InfinityPipeline, HARTPipeline)
    return ", ".join(f"{p.__name__.removesuffix('Pipeline')} "
                     f"{getattr(SPARVAR_PRESETS.get(p.PRESET_FAMILY, SparVARConfig()), name)}" for p in pipes)


class SparVARSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        d = SPARVAR_PRESETS["var"]
        return io.Schema(
            node_id="SparseVAR_SparVARSettings", display_name="SparVAR Settings", category=CATEGORY,
            description="Sparse cross-scale attention (SparVAR: CS4A + CSLA): every token is computed, each query "
                        "reads fewer cached keys from the decision scale on. Applied over the preset of the model's "
                        "family. Connect to the sampler's 'sparvar' input; not with SparseVAR or FastVAR.",
            inputs=[
                io.Float.Input("top_keys", default=d.top_keys, min=0.01, max=1.0, step=0.01,
                               tooltip=field_doc(SparVARConfig, "top_keys")),
                io.Float.Input("cs4a_layers", default=d.cs4a_layers, min=0.0, max=1.0, step=0.05,
                               tooltip=field_doc(SparVARConfig, "cs4a_layers")),
                io.Int.Input("decision_scale", default=0, min=-16, max=16,
                             tooltip=f"0 = the model family's preset ({_sparvar_presets('decision_scale')}). "
                                     + field_doc(SparVARConfig, "decision_scale")),
                io.Combo.Input("mapping", options=list(MAPPINGS), default=d.mapping,
                               tooltip=field_doc(SparVARConfig, "mapping")),
            ],
            outputs=[SparVARSettings.Output(display_name="sparvar")],
        )

    @classmethod
    def execute(cls, top_keys, cs4a_layers, decision_scale, mapping) -> io.NodeOutput:
        choice = SparVARChoice(top_keys=top_keys, cs4a_layers=cs4a_layers,
                               decision_scale=None if decision_scale == 0 else decision_scale, mapping=mapping)
        SparVARConfig(**choice.overrides())              # a bad value is named here, at this node
        return io.NodeOutput(choice)


@dataclasses.dataclass(frozen=True)
class ScaleKVChoice:
    """What the ScaleKV Settings node set, applied over the model's preset (``pipe.scalekv_preset``);
    budget None keeps the preset's."""

    budget: float | None

    def overrides(self) -> dict:
        return {} if self.budget is None else {"budget": self.budget}


class ScaleKVSettingsNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_ScaleKVSettings", display_name="ScaleKV Settings", category=CATEGORY,
            description="KV-cache compression (ScaleKV): after each scale the refiner layers keep a budget of their "
                        "cached keys, so the KV cache takes less GPU memory (the pictures change). Applied over the "
                        "model's preset. Connect to the sampler's 'scalekv' input; not with SparseVAR, FastVAR or "
                        "SparVAR.",
            inputs=[
                io.Float.Input("budget", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="0 = the model's preset (Infinity-2B/8B: the release's budgets on the last "
                                       "five scales). " + field_doc(ScaleKVConfig, "budget")),
            ],
            outputs=[ScaleKVSettings.Output(display_name="scalekv")],
        )

    @classmethod
    def execute(cls, budget) -> io.NodeOutput:
        choice = ScaleKVChoice(budget=None if budget == 0 else budget)
        ScaleKVConfig(**choice.overrides())              # a bad value is named here, at this node
        return io.NodeOutput(choice)


def _policies(pipe, sparsevar: SparseVARChoice | None, anchors: AnchorConfig | None,
              scale_skip: ScaleSkipConfig | None, fastvar: FastVARChoice | None,
              sparvar: SparVARChoice | None = None, scalekv: ScaleKVChoice | None = None) -> list:
    """The settings nodes' choices, over the presets of the model's family (SparseVAR: the model's
    ``sparsevar_preset``, with its calibrated layer), as policies for one call (the shared pipeline
    is left unchanged)."""
    family, policies = pipe.PRESET_FAMILY, []
    if sparsevar is not None or anchors is not None:
        chosen = {**(sparsevar.overrides() if sparsevar else {}), **(anchors.overrides() if anchors else {})}
        policies.append(SparseVARPolicy(_replace(pipe.sparsevar_preset, chosen)))
    if fastvar is not None:
        preset = FASTVAR_PRESETS.get(family, FastVARConfig())
        policies.append(FastVARPolicy(dataclasses.replace(preset, **fastvar.overrides())))
    if sparvar is not None:
        preset = SPARVAR_PRESETS.get(family, SparVARConfig())
        policies.append(SparVARPolicy(dataclasses.replace(preset, **sparvar.overrides())))
    if scalekv is not None:
        policies.append(ScaleKVPolicy(dataclasses.replace(pipe.scalekv_preset, **scalekv.overrides())))
    if scale_skip is not None:
        policies.append(ScaleSkipPolicy(scale_skip))
    return policies


def _class_ids(pipe, class_label: str, node: str = "VAR Class") -> list[int]:
    """A ``class_label`` text ('207', 'golden retriever', several separated by '|') → class ids; an
    empty, unknown or out-of-range label is a ValueError naming the node, the widget and what it takes."""
    from ..pipelines.var_pipeline import ClassLabelError
    labels = [lab.strip() for lab in str(class_label).split("|") if lab.strip()]
    n = pipe.num_classes
    takes = f"class ids 0..{n - 1}" + (" or the model's class names" if pipe.labels else "")
    if not labels:
        raise ValueError(f"{node}: class_label is empty: give one of the {takes}, several separated by '|'")
    ids = []
    for lab in labels:
        value = int(lab) if lab.removeprefix("-").isdecimal() else lab
        try:
            ids += pipe.get_label_ids(value)
        except ClassLabelError as e:
            problem = e.problem if e.problem.endswith((".", "?")) else e.problem + "."
            raise ValueError(f"{node}: class_label {lab!r}: {problem} Give one of the {takes}") from None
        except ValueError as e:
            raise ValueError(f"{node}: class_label {lab!r}: {e}") from None
    return ids


@dataclasses.dataclass(frozen=True)
class ClassCondition:
    """What the VAR Class node set: the class labels as typed (ids or names, several separated by
    '|'); the sampler resolves them with the model's class names, and its errors name ``node``, the
    node that holds the widget."""

    class_label: str
    node: str = "VAR Class"


@dataclasses.dataclass(frozen=True, eq=False)
class TextCondition:
    """What the Infinity/HART Text Encode node made: the prompts and their features from the text
    encoder of the pipeline ``pipe_id`` names (``id`` of the pipeline; None: strings only, encoded
    by the sampler, as the legacy sampler's widgets are)."""

    prompt: str
    negative_prompt: str = ""
    features: object = None
    negative_features: object = None
    pipe_id: int | None = None


def _model_kind(pipe) -> str:
    return ("Infinity" if isinstance(pipe, InfinityPipeline) else "HART" if isinstance(pipe, HARTPipeline)
            else "FlexVAR" if isinstance(pipe, FlexVARPipeline) else "VAR")


def _check_condition(node: str, pipe, cond) -> None:
    """A conditioning that does not fit the model, refused in one line saying which node to use."""
    kind = _model_kind(pipe)
    text_model = kind in ("Infinity", "HART")
    if isinstance(cond, ClassCondition) and text_model:
        raise ValueError(f"{node}: the conditioning is a class label (VAR Class), and {kind} draws from text: connect "
                         f"an 'Infinity/HART Text Encode' node to 'conditioning' instead")
    if isinstance(cond, TextCondition) and not text_model:
        raise ValueError(f"{node}: the conditioning is a text prompt, and this {kind} model draws classes: connect a "
                         f"'VAR Class' node to 'conditioning' instead")
    if isinstance(cond, TextCondition) and cond.pipe_id is not None and cond.pipe_id != id(pipe):
        raise ValueError(f"{node}: the conditioning was encoded by another model's text encoder: connect the Text "
                         f"Encode node's 'model' to the loader this sampler uses")
    if kind == "HART" and isinstance(cond, TextCondition) and cond.negative_prompt:
        raise ValueError(f"{node}: HART has no negative prompt (its unconditional branch is an empty text); clear "
                         f"'negative_prompt'")


def _sample(node: str, model, cond, seed, cfg, top_k, top_p, batch_size, height, width, sparsevar, anchors,
            scale_skip, fastvar, sparvar, steps, scalekv=None) -> io.NodeOutput:
    """One sampler call for either sampler node: ``cond`` a ClassCondition or a TextCondition."""
    pipe = model.pipe
    infinity = isinstance(pipe, InfinityPipeline)
    hart = isinstance(pipe, HARTPipeline)
    flexvar = isinstance(pipe, FlexVARPipeline)
    if fastvar is not None and (sparsevar is not None or anchors is not None):
        raise ValueError(f"{node}: 'fastvar' and 'sparsevar' / 'anchors' are both connected, and the two methods "
                         f"cannot be combined (both choose the tokens each scale computes): disconnect one of them")
    if sparvar is not None and (fastvar is not None or sparsevar is not None or anchors is not None):
        raise ValueError(f"{node}: 'sparvar' and 'sparsevar' / 'anchors' / 'fastvar' are both connected, and they "
                         f"cannot be combined (SparVAR selects keys among every token of the cache; the others "
                         f"compute a subset of the tokens): disconnect one of them")
    if scalekv is not None and any(x is not None for x in (sparvar, fastvar, sparsevar, anchors)):
        raise ValueError(f"{node}: 'scalekv' and 'sparsevar' / 'anchors' / 'fastvar' / 'sparvar' are both connected, "
                         f"and they cannot be combined (ScaleKV compacts each layer's cache per head after a scale; "
                         f"SparVAR reads the whole cache, the others compute a subset of the tokens): disconnect "
                         f"one of them")
    _check_condition(node, pipe, cond)
    policies = _policies(pipe, sparsevar, anchors, scale_skip, fastvar, sparvar, scalekv)
    if infinity:
        total = pipe.resolution(height, width).schedule.num_scales     # a ValueError listing the valid sizes
    elif hart:
        total = pipe.adapter().schedule.num_scales
    elif flexvar:
        labels = _class_ids(pipe, cond.class_label, cond.node)
        try:
            schedule = pipe.resolve_schedule(height, width, steps or None)
        except ValueError as e:
            raise ValueError(f"{node}: {str(e).replace('num_scales=', 'steps=')}") from None
        total = len(schedule)
    else:
        labels = _class_ids(pipe, cond.class_label, cond.node)
        total = pipe.num_timesteps
    # the weights, and besides them what the call will need (KV cache, activations, decoder), so that
    # ComfyUI offloads other models first
    images = batch_size * (1 if infinity or hart else len(labels))
    size = {"height": height, "width": width} if infinity else {"patch_nums": schedule} if flexvar else {}
    # the text encoder too where the sampler encodes the prompt itself (a conditioning without features)
    text = [model.text_patcher] if model.text_patcher is not None and getattr(cond, "features", 1) is None else []
    model_management.load_models_gpu([model.patcher, *text], memory_required=pipe.estimate_memory(
        images, policies=policies, **size).working_bytes)
    bar = comfy_utils.ProgressBar(total)

    done = [0]

    def on_scale(p, si, t, kw):
        done[0] = si + 1
        bar.update_absolute(si + 1, total)
        model_management.throw_exception_if_processing_interrupted()
        return kw

    pipe.set_progress_bar_config(disable=True)
    gpu = pipe.adapter().device if pipe.adapter().device.type == "cuda" else None
    if gpu is not None:       # the process's peak from here on (models ComfyUI keeps loaded included), in the stats
        torch.cuda.reset_peak_memory_stats(gpu)
    common = {"guidance_scale": cfg, "top_k": top_k, "top_p": top_p, "num_images_per_prompt": batch_size,
              "generator": torch.Generator("cpu").manual_seed(seed), "output_type": "pt",
              "callback_on_step_end": on_scale, "policies": policies}
    if infinity and cond.features is not None:
        out = pipe(prompt_features=cond.features, negative_prompt_features=cond.negative_features, height=height,
                   width=width, **common)
    elif infinity:
        out = pipe(cond.prompt, negative_prompt=cond.negative_prompt or None, height=height, width=width, **common)
    elif hart:
        out = pipe(prompt_features=cond.features, **common) if cond.features is not None else pipe(cond.prompt,
                                                                                                  **common)
    elif flexvar:
        out = pipe(labels, patch_nums=schedule, **common)
    else:
        out = pipe(labels, **common)
    if done[0] < total:
        bar.update_absolute(total, total)           # skipped scales end the bar too
    stats: GenerationStats = out.stats[0]
    speedup = pipe.flop_speedup(stats, height, width) if infinity else \
        pipe.flop_speedup(stats, schedule) if flexvar else pipe.flop_speedup(stats)
    images = out.images.float().clamp(0, 1).permute(0, 2, 3, 1).to(model_management.intermediate_device())
    peak = f"; peak GPU memory {torch.cuda.max_memory_allocated(gpu) / 1e9:.2f} GB (reserved " \
           f"{torch.cuda.max_memory_reserved(gpu) / 1e9:.2f})" if gpu is not None else ""
    text = (f"{stats.summary()}; FLOP-ideal speed-up {speedup:.2f}x; kernels {pipe.kernels}{peak}\n{stats.table()}")
    return io.NodeOutput(images, text, stats)


def _sampling_inputs() -> list:
    """The sampler inputs both sampler nodes share, after the model and the conditioning."""
    return [
        io.Int.Input("seed", default=0, min=0, max=0xffffffffffffffff, control_after_generate=True,
                     tooltip="every random draw comes from a CPU generator seeded with this"),
        io.Float.Input("cfg", default=VAR_DEFAULTS.guidance_scale, min=0.0, max=20.0, step=0.1,
                       tooltip="guidance strength. VAR: ramped from 0 at the first scale to this at the "
                               "last; 0 = off (official demo 4, FID 1.5). Infinity: cfg·cond + (1 − cfg)·"
                               "uncond at every scale; 1 = off (official 3). HART: ramped like VAR; 0 = off "
                               "(official 4.5)"),
        io.Int.Input("top_k", default=VAR_DEFAULTS.top_k, min=0, max=65536,
                     tooltip="keep the k most likely codes (0 = all; HART: 0 = its reference rule, 600 "
                             "below scale 7, then 300)"),
        io.Float.Input("top_p", default=VAR_DEFAULTS.top_p, min=0.0, max=1.0, step=0.01,
                       tooltip="nucleus mass kept per token (0 = off; official VAR 0.95, Infinity 0.97)"),
        io.Int.Input("batch_size", default=1, min=1, max=64, tooltip="images per class label or prompt"),
    ]


def _size_inputs() -> list:
    return [
        io.Int.Input("height", default=1024, min=16, max=4096, step=16,
                     tooltip="Infinity: image height. Only the official sizes exist (1024×1024 and the "
                             "256–1024 px sizes of 15 aspect ratios, e.g. 768×1024); another size gives an "
                             "error listing the valid ones. FlexVAR: any square multiple of 16 (256 its "
                             "training size, 512 zero-shot). VAR models draw at their own size"),
        io.Int.Input("width", default=1024, min=16, max=4096, step=16,
                     tooltip="Infinity, FlexVAR: image width (see height). VAR models draw at their own size, "
                             "HART at 1024×1024"),
    ]


def _settings_inputs() -> list:
    return [
        SparseVARSettings.Input("sparsevar", optional=True),
        AnchorSettings.Input("anchors", optional=True),
        ScaleSkipSettings.Input("scale_skip", optional=True),
        FastVARSettings.Input("fastvar", optional=True),
        SparVARSettings.Input("sparvar", optional=True),
        io.Int.Input("steps", default=0, min=0, max=64, optional=True,
                     tooltip="FlexVAR: number of scales; 0 = the reference's for the size (10 at 256 px, 15 "
                             "at 512 px; 13 is its README variant). Other models ignore it"),
        ScaleKVSettings.Input("scalekv", optional=True),
    ]


def _sampler_outputs() -> list:
    return [io.Image.Output(display_name="images"), io.String.Output(display_name="stats"),
            GenerationStatsType.Output(display_name="token_maps")]


class VARClassNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_VARClass", display_name="VAR Class", category=CATEGORY,
            description="The class a VAR or FlexVAR model draws, for the SparseVAR Sampler's conditioning.",
            inputs=[io.String.Input("class_label", default="207",
                                    tooltip="class id or name (e.g. 207 or 'golden retriever' for ImageNet models; "
                                            "the demo model's: disc … fish); several separated by '|'")],
            outputs=[Conditioning.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, class_label) -> io.NodeOutput:
        if not str(class_label).strip():
            raise ValueError("VAR Class: class_label is empty: give a class id or name (several separated by '|')")
        return io.NodeOutput(ClassCondition(str(class_label)))


class TextEncodeNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_TextEncode", display_name="Infinity/HART Text Encode", category=CATEGORY,
            description="Encodes a prompt with the text encoder of an Infinity (Flan-T5-XL) or HART (Qwen2) model, "
                        "for the SparseVAR Sampler's conditioning; the encoding is kept while the prompt stays.",
            inputs=[SparseVARModel.Input("model"),
                    io.String.Input("prompt", default="", multiline=True, tooltip="what to draw"),
                    io.String.Input("negative_prompt", default="", multiline=True,
                                    tooltip="Infinity: what to steer away from; it replaces the unconditional branch "
                                            "of guidance (empty = the model's learned one). HART has none")],
            outputs=[Conditioning.Output(display_name="conditioning")],
        )

    @classmethod
    def execute(cls, model, prompt, negative_prompt) -> io.NodeOutput:
        pipe = model.pipe
        kind = _model_kind(pipe)
        if kind not in ("Infinity", "HART"):
            raise ValueError(f"Infinity/HART Text Encode: this {kind} model draws classes, not text: use a 'VAR Class' "
                             f"node for its conditioning")
        if not prompt.strip():
            raise ValueError("Infinity/HART Text Encode: prompt is empty: say what to draw")
        cond = TextCondition(prompt, negative_prompt)
        _check_condition("Infinity/HART Text Encode", pipe, cond)
        model_management.load_models_gpu([model.text_patcher])     # the text encoder, through ComfyUI's manager
        negative = pipe.encode_prompt(negative_prompt) if negative_prompt else None
        return io.NodeOutput(TextCondition(prompt, negative_prompt, pipe.encode_prompt(prompt), negative, id(pipe)))


class SparseVARSampler(io.ComfyNode):
    """One ProgressBar tick per scale, without a preview image: a VAR preview needs a full VQVAE
    decode of the latent, as expensive as the final one, so it is not "cheap" at any scale. What
    to draw comes from the ``conditioning`` input: a VAR Class node (VAR, FlexVAR) or an
    Infinity/HART Text Encode node; FlexVAR also reads ``height``, ``width`` and ``steps``,
    Infinity ``height`` and ``width``."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_ConditionedSampler", display_name="SparseVAR Sampler", category=CATEGORY,
            description="Generates images with a VAR, FlexVAR, Infinity or HART model from its conditioning (VAR Class "
                        "or Infinity/HART Text Encode), scale by scale, with optional acceleration.",
            inputs=[SparseVARModel.Input("model"),
                    Conditioning.Input("conditioning",
                                       tooltip="VAR, FlexVAR: a VAR Class node; Infinity, HART: an Infinity/HART Text "
                                               "Encode node fed by the same loader"),
                    *_sampling_inputs(), *_size_inputs(), *_settings_inputs()],
            outputs=_sampler_outputs(),
        )

    @classmethod
    def execute(cls, model, conditioning, seed, cfg, top_k, top_p, batch_size, height=1024, width=1024,
                sparsevar=None, anchors=None, scale_skip=None, fastvar=None, sparvar=None, steps=0,
                scalekv=None) -> io.NodeOutput:
        return _sample("SparseVAR Sampler", model, conditioning, seed, cfg, top_k, top_p, batch_size, height, width,
                       sparsevar, anchors, scale_skip, fastvar, sparvar, steps, scalekv)


class LegacySparseVARSampler(io.ComfyNode):
    """The sampler with its own class and prompt widgets, kept (deprecated, hidden from the node
    search) so that workflows saved with it still load and run; new graphs use the SparseVAR Sampler
    with a conditioning node."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_Sampler", display_name="SparseVAR Sampler (legacy: class and prompt widgets)",
            category=CATEGORY, is_deprecated=True,
            description="Deprecated: use the SparseVAR Sampler with a VAR Class or Infinity/HART Text Encode node. "
                        "Kept so that saved workflows run.",
            inputs=[
                SparseVARModel.Input("model"),
                io.String.Input("class_label", default="207",
                                tooltip="VAR: class id or ImageNet name (e.g. 207 or 'golden retriever'); "
                                        "several separated by '|'. Infinity models ignore it (they read the prompt)"),
                *_sampling_inputs(),
                io.String.Input("prompt", default="", multiline=True,
                                tooltip="Infinity, HART: what to draw. VAR models ignore it (they read class_label)"),
                io.String.Input("negative_prompt", default="", multiline=True,
                                tooltip="Infinity: what to steer away from; it replaces the unconditional branch of "
                                        "guidance (empty = the model's learned one). VAR models ignore it"),
                *_size_inputs(), *_settings_inputs(),
            ],
            outputs=_sampler_outputs(),
        )

    @classmethod
    def execute(cls, model, class_label, seed, cfg, top_k, top_p, batch_size, prompt="", negative_prompt="",
                height=1024, width=1024, sparsevar=None, anchors=None, scale_skip=None,
                fastvar=None, sparvar=None, steps=0, scalekv=None) -> io.NodeOutput:
        text_model = isinstance(model.pipe, (InfinityPipeline, HARTPipeline))
        cond = TextCondition(prompt, negative_prompt) if text_model else ClassCondition(class_label, "SparseVAR Sampler")
        return _sample("SparseVAR Sampler", model, cond, seed, cfg, top_k, top_p, batch_size, height, width,
                       sparsevar, anchors, scale_skip, fastvar, sparvar, steps, scalekv)


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
        if not token_maps.token_maps:
            raise ValueError("Token Map Preview: these stats hold no token maps: connect a SparseVAR Settings node to "
                             "the sampler's 'sparsevar' input (with tau > 0 or keep_ratio < 1); maps exist for the "
                             "scales SparseVAR pruned")
        return io.NodeOutput(token_map_images(token_maps, images))


NODES = [VARModelLoader, VARClassNode, TextEncodeNode, SparseVARSampler, LegacySparseVARSampler, SparseVARSettingsNode,
         AnchorSettingsNode, ScaleSkipNode, FastVARSettingsNode, SparVARSettingsNode, ScaleKVSettingsNode,
         TokenMapPreview]
