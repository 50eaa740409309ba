"""ComfyUI loader for FlexVAR (class-conditional, any size and number of steps). Thin: choices → one
FlexVARPipeline call.

The model goes over the same SPARSEVAR_MODEL type as the other families', so the same "SparseVAR
Sampler" (its height, width and steps widgets) and settings nodes serve it. Files live in
models/flexvar: the official FlexVARd16/d20/d24 .pth files with FlexVAE.pth, or a folder made by
`sparsevar convert`. Nothing is downloaded.
"""
from __future__ import annotations

import torch

from ..pipelines.flexvar_pipeline import FlexVARPipeline
from ._comfy import io, model_management
from .var_nodes import (CATEGORY, FROM_FOLDER, SparseVARModel, VARModelHandle, check_choices, checkpoint_files,
                        resolve_in, subfolders)

FOLDER = "flexvar"                   # models/flexvar: FlexVARd24-epo349.pth, FlexVAE.pth, converted folders


def _folders() -> list[str]:
    return subfolders(FOLDER)


def _files() -> list[str]:
    return checkpoint_files(FOLDER, _folders())


def model_choices() -> list[str]:
    """Converted folders (with model_index.json), then checkpoint files under models/flexvar."""
    return _folders() + _files()


class FlexVARModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_FlexVARModelLoader", display_name="FlexVAR Model Loader", category=CATEGORY,
            description="Loads FlexVAR (class-conditional, any square size that is a multiple of 16 and any number "
                        "of steps): FlexVARd16/d20/d24 .pth with FlexVAE.pth, or a folder made by `sparsevar convert`, "
                        "from models/flexvar. Set the size and steps on the sampler (256 px, 10 steps by default).",
            inputs=[
                io.Combo.Input("model", options=model_choices(),
                               tooltip="transformer file (FlexVARd24-epo349.pth …) or converted folder in models/flexvar"),
                io.Combo.Input("vae", options=[FROM_FOLDER] + _files(),
                               tooltip="the tokenizer file (FlexVAE.pth); not needed for a converted folder"),
                io.Combo.Input("dtype", options=["auto", "bfloat16", "float16", "float32"], default="auto",
                               tooltip="transformer weights; auto = bfloat16 on a GPU, float32 on the CPU"),
            ],
            outputs=[SparseVARModel.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, model, vae):
        return check_choices("FlexVAR Model Loader", [
            (model, FOLDER, "the official .pth files or a converted folder"), (vae, FOLDER, "FlexVAE.pth")])

    @classmethod
    def execute(cls, model, vae, dtype) -> io.NodeOutput:
        path = resolve_in(model, FOLDER, "FlexVAR Model Loader", "the official .pth files or a converted folder")
        if dtype == "auto":
            dtype = "bfloat16" if torch.device(model_management.get_torch_device()).type == "cuda" else "float32"
        if path.is_dir():
            pipe = FlexVARPipeline.from_pretrained(path, dtype=getattr(torch, dtype))
        elif vae == FROM_FOLDER:
            raise ValueError(f"FlexVAR Model Loader: {model} is a transformer file, so it also needs its tokenizer: put "
                             f"FlexVAE.pth in models/{FOLDER}, refresh and choose it in 'vae' (or choose a folder made "
                             f"by `sparsevar convert`)")
        else:
            vae_path = resolve_in(vae, FOLDER, "FlexVAR Model Loader", "FlexVAE.pth")
            pipe = FlexVARPipeline.from_single_file(path, vae_path, dtype=getattr(torch, dtype))
        return io.NodeOutput(VARModelHandle(pipe, model))


NODES = [FlexVARModelLoader]

__all__ = ["NODES", "FOLDER", "FlexVARModelLoader", "model_choices"]
