"""ComfyUI loader for HART (text-to-image, 1024²). Thin: choices → one HARTPipeline call.

The model goes over the same SPARSEVAR_MODEL type as VAR's and Infinity's, so the same "SparseVAR
Sampler" and settings nodes serve it (the sampler reads the prompt). Files live where ComfyUI users
expect them: HART's release folder (``llm/`` + ``tokenizer/``) or a converted folder in models/hart,
the Qwen2 text encoder as a folder in models/text_encoders. Nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..models.loading import hart_folders
from ..pipelines.hart_pipeline import HARTPipeline
from ._comfy import io, model_management
from .infinity_nodes import TEXT_FOLDER, text_encoder_choices
from .var_nodes import (CATEGORY, FROM_FOLDER, SparseVARModel, VARModelHandle, check_choices, model_roots, resolve_in,
                        subfolders)

FOLDER = "hart"                      # models/hart: hart-0.7b-1024px/ (llm/, tokenizer/), converted folders
QWEN2_HINT = ("a local copy of mit-han-lab/Qwen2-VL-1.5B-Instruct (config.json, the weights, the tokenizer files) as "
              "a folder in models/text_encoders/, e.g. models/text_encoders/Qwen2-VL-1.5B-Instruct/")


def model_choices() -> list[str]:
    """Converted folders and release folders (holding llm/ with HART's config) under models/hart."""
    release = sorted({str(d.relative_to(root)) for root in model_roots(FOLDER) for d in [root, *root.rglob("*")]
                      if d.is_dir() and d != root and (d / "llm").is_dir() and hart_folders(d) is not None})
    return subfolders(FOLDER, "model_index.json") + release


def _resolve(name: str, folder: str) -> Path:
    return resolve_in(name, folder, "HART Model Loader", "it")


class HARTModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_HARTModelLoader", display_name="HART Model Loader", category=CATEGORY,
            description="Loads HART (text to image, 1024×1024): its release folder (llm/ + tokenizer/) from "
                        "models/hart and its Qwen2 text encoder from models/text_encoders, or a folder made by "
                        "`sparsevar convert`.",
            inputs=[
                io.Combo.Input("model", options=model_choices(),
                               tooltip="HART's release folder (hart-0.7b-1024px, holding llm/ and tokenizer/) or a "
                                       "converted folder in models/hart"),
                io.Combo.Input("text_encoder", options=[FROM_FOLDER] + text_encoder_choices(),
                               tooltip="its Qwen2 folder (weights + tokenizer) in models/text_encoders; not needed for "
                                       "a converted folder"),
                io.Combo.Input("dtype", options=["auto", "bfloat16", "float16", "float32"], default="auto",
                               tooltip="transformer blocks; auto = bfloat16 on a GPU, float32 on the CPU. Qwen2 "
                                       "follows: bfloat16 on a GPU, float32 on the CPU"),
            ],
            outputs=[SparseVARModel.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, model, text_encoder):
        return check_choices("HART Model Loader", [
            (model, FOLDER, "HART's release folder (llm/ and tokenizer/) or a converted folder"),
            (text_encoder, TEXT_FOLDER, "its Qwen2 folder")])

    @classmethod
    def execute(cls, model, text_encoder, dtype) -> io.NodeOutput:
        path = _resolve(model, FOLDER)
        converted = (path / "model_index.json").is_file()
        if not converted and text_encoder == FROM_FOLDER:
            raise ValueError(f"HART Model Loader: {model} is HART's release folder, so it also needs its text encoder: "
                             f"put {QWEN2_HINT}. Then refresh and choose it in 'text_encoder' (or choose a folder "
                             f"made by `sparsevar convert`)")
        gpu = torch.device(model_management.get_torch_device()).type == "cuda"
        if dtype == "auto":
            dtype = "bfloat16" if gpu else "float32"
        te_dtype = torch.bfloat16 if gpu else torch.float32
        if converted:
            pipe = HARTPipeline.from_pretrained(path, dtype=getattr(torch, dtype), text_encoder_dtype=te_dtype)
        else:
            llm, tok = hart_folders(path)
            pipe = HARTPipeline.from_single_file(llm, tok, _resolve(text_encoder, TEXT_FOLDER),
                                                 dtype=getattr(torch, dtype), text_encoder_dtype=te_dtype)
        return io.NodeOutput(VARModelHandle(pipe, model))


NODES = [HARTModelLoader]

__all__ = ["NODES", "FOLDER", "HARTModelLoader", "model_choices"]
