"""ComfyUI loader for Infinity (text-to-image). Thin: choices → one InfinityPipeline call.

The model goes over the same SPARSEVAR_MODEL type as VAR's, so the same "SparseVAR Sampler" and
settings nodes serve both families (the sampler reads the prompt for an Infinity model). Files
live where ComfyUI users expect them: the transformer and its VAE in models/infinity, the T5 text
encoder as a folder in models/text_encoders. Nothing is downloaded.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..pipelines.infinity_pipeline import InfinityPipeline
from ._comfy import io, model_management
from .var_nodes import (CATEGORY, FROM_FOLDER, SparseVARModel, VARModelHandle, check_choices, checkpoint_files,
                        resolve_in, subfolders)

FOLDER = "infinity"                  # models/infinity: infinity_2b_reg.pth, infinity_vae_d32reg.pth, folders
TEXT_FOLDER = "text_encoders"        # ComfyUI's own folder for text encoders (models/text_encoders, models/clip)
T5_HINT = ("a local copy of google/flan-t5-xl (config.json, the weights, tokenizer.json or spiece.model, "
           "tokenizer_config.json) as a folder in models/text_encoders/, e.g. models/text_encoders/flan-t5-xl/")


def _pipeline_folders() -> list[str]:
    return subfolders(FOLDER, "model_index.json")


def _shard_folders() -> list[str]:
    """The 8B release: a folder of shards with a ``*.index.json`` (not a sharded part of a converted folder)."""
    converted = _pipeline_folders()
    return [d for d in subfolders(FOLDER, "*.index.json") if not any(d.startswith(c + os.sep) for c in converted)]


def _files() -> list[str]:
    return checkpoint_files(FOLDER, _pipeline_folders() + _shard_folders())


def model_choices() -> list[str]:
    """Converted folders, shard folders and checkpoint files under models/infinity."""
    return _pipeline_folders() + _shard_folders() + _files()


def text_encoder_choices() -> list[str]:
    """Folders under models/text_encoders holding a transformers model (config.json)."""
    return subfolders(TEXT_FOLDER, "config.json")


def _resolve(name: str, folder: str) -> Path:
    return resolve_in(name, folder, "Infinity Model Loader", "it")


class InfinityModelLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="SparseVAR_InfinityModelLoader", display_name="Infinity Model Loader", category=CATEGORY,
            description="Loads Infinity (text to image): the official transformer (infinity_2b_reg.pth, or the 8B "
                        "shard folder) + its VAE from models/infinity and a Flan-T5-XL folder from "
                        "models/text_encoders, or a folder made by `sparsevar convert`.",
            inputs=[
                io.Combo.Input("model", options=model_choices(),
                               tooltip="transformer file (infinity_2b_reg.pth), 8B shard folder, or converted "
                                       "folder in models/infinity"),
                io.Combo.Input("vae", options=[FROM_FOLDER] + _files(),
                               tooltip="the VAE file in models/infinity (infinity_vae_d32reg.pth; 8B: "
                                       "infinity_vae_d56_f8_14_patchify.pth); not needed for a converted folder"),
                io.Combo.Input("text_encoder", options=[FROM_FOLDER] + text_encoder_choices(),
                               tooltip="a google/flan-t5-xl folder (T5 weights + tokenizer) in models/text_encoders; "
                                       "not needed for a converted folder"),
                io.Combo.Input("dtype", options=["auto", "bfloat16", "float16", "float32"], default="auto",
                               tooltip="transformer blocks; auto = bfloat16 on a GPU (as the official runs), float32 "
                                       "on the CPU. The T5 and the VAE follow: bfloat16 on a GPU, float32 on the CPU"),
            ],
            outputs=[SparseVARModel.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, model, vae, text_encoder):
        return check_choices("Infinity Model Loader", [
            (model, FOLDER, "the official transformer (infinity_2b_reg.pth, the 8B shard folder) or a converted "
                            "folder"),
            (vae, FOLDER, "its VAE file"), (text_encoder, TEXT_FOLDER, "the Flan-T5-XL folder")])

    @classmethod
    def execute(cls, model, vae, text_encoder, dtype) -> io.NodeOutput:
        path = _resolve(model, FOLDER)
        if not (path / "model_index.json").is_file():
            missing = [what for what, chosen in (
                ("its VAE: put infinity_vae_d32reg.pth (8B: infinity_vae_d56_f8_14_patchify.pth) in models/infinity/",
                 vae), ("its text encoder: put " + T5_HINT, text_encoder)) if chosen == FROM_FOLDER]
            if missing:
                raise ValueError(f"Infinity Model Loader: {model} is an official transformer checkpoint, so it also "
                                 f"needs {'; and '.join(missing)}. Then refresh and choose them in 'vae' / "
                                 f"'text_encoder' (or choose a folder made by `sparsevar convert`)")
        gpu = torch.device(model_management.get_torch_device()).type == "cuda"
        if dtype == "auto":
            dtype = "bfloat16" if gpu else "float32"
        pipe = InfinityPipeline.from_path(
            path, vae=None if vae == FROM_FOLDER else _resolve(vae, FOLDER),
            text_encoder=None if text_encoder == FROM_FOLDER else _resolve(text_encoder, TEXT_FOLDER),
            dtype=getattr(torch, dtype), text_encoder_dtype=torch.bfloat16 if gpu else torch.float32,
            # on a GPU the VAE decodes in bfloat16, as the reference does (under autocast): half the decoder's
            # memory, the largest phase on a small card
            vae_dtype=torch.bfloat16 if gpu else torch.float32)
        return io.NodeOutput(VARModelHandle(pipe, model))


NODES = [InfinityModelLoader]

__all__ = ["NODES", "FOLDER", "InfinityModelLoader", "model_choices", "text_encoder_choices"]
