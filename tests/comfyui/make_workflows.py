"""Writes the shipped UI-format (v0.4) VAR and Infinity workflows in workflows/ (the HART, FlexVAR
and SparVAR ones are kept by hand). Run after changing a node's widgets: `python
tests/comfyui/make_workflows.py` (the contract test checks they still fit). The graphs are laid out
with the legacy sampler's widgets, then moved to the sampler with a conditioning node
(migrate_sampler.py)."""
from __future__ import annotations

import json
from pathlib import Path

from migrate_sampler import migrate
from sparsevar.models.loading import OFFICIAL_DOWNLOADS

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
# The frontend's workflow schema wants a url per model: the official release's (the library itself
# never downloads). The frontend (1.32) offers downloads of .safetensors files only, so for these .pth
# files the loaders' validation names the address instead (nodes/var_nodes.check_choices).
MODEL_NAMES = ("var_d16.pth", "vae_ch160v4096z32.pth")
MODELS = [{"name": n, "url": OFFICIAL_DOWNLOADS[n], "directory": "var"} for n in MODEL_NAMES]
LOADER = ("SparseVAR_VARModelLoader", ["var_d16.pth", "vae_ch160v4096z32.pth", "auto"])
# class_label, seed (+ its control), cfg, top_k, top_p, batch_size, then the Infinity inputs that VAR ignores:
# prompt, negative_prompt, height, width, and FlexVAR's steps (0: its default)
SAMPLER_WIDGETS = ["207", 0, "fixed", 4.0, 900, 0.95, 1, "", "", 1024, 1024, 0]
# The built-in demo model: nothing to download, so the workflow runs on a fresh install.
DEMO_LOADER = ("SparseVAR_VARModelLoader", ["sparsevar-demo (built in)", "(converted folder: none needed)", "auto"])
DEMO_SAMPLER_WIDGETS = ["tree", 0, "fixed", 4.0, 900, 0.95, 1, "", "", 1024, 1024, 0]
# Infinity-2B (text to image): the transformer and its VAE in models/infinity, Flan-T5-XL as a folder in
# models/text_encoders (a folder, so the frontend cannot offer it as a download: the README says where it goes).
INFINITY_MODEL_NAMES = ("infinity_2b_reg.pth", "infinity_vae_d32reg.pth")
INFINITY_MODELS = [{"name": n, "url": OFFICIAL_DOWNLOADS[n], "directory": "infinity"} for n in INFINITY_MODEL_NAMES]
INFINITY_LOADER = ("SparseVAR_InfinityModelLoader", [*INFINITY_MODEL_NAMES, "flan-t5-xl", "auto"])
PROMPT = "a red fox standing in fresh snow at golden hour, detailed fur, photograph"
# official Infinity-2B sampling (guidance 3, top-k 900, top-p 0.97) at 1024x1024; class_label is ignored
INFINITY_SAMPLER_WIDGETS = ["", 0, "fixed", 3.0, 900, 0.97, 1, PROMPT, "", 1024, 1024, 0]
OUT_TYPES = {
    "SparseVAR_VARModelLoader": [("model", "SPARSEVAR_MODEL")],
    "SparseVAR_InfinityModelLoader": [("model", "SPARSEVAR_MODEL")],
    "SparseVAR_Settings": [("sparsevar", "SPARSEVAR_SETTINGS")],
    "SparseVAR_AnchorSettings": [("anchors", "SPARSEVAR_ANCHOR_SETTINGS")],
    "SparseVAR_ScaleSkip": [("scale_skip", "SPARSEVAR_SCALE_SKIP")],
    "SparseVAR_FastVARSettings": [("fastvar", "SPARSEVAR_FASTVAR_SETTINGS")],
    "SparseVAR_ScaleKVSettings": [("scalekv", "SPARSEVAR_SCALEKV_SETTINGS")],
    "SparseVAR_Sampler": [("images", "IMAGE"), ("stats", "STRING"), ("token_maps", "SPARSEVAR_STATS")],
    "SparseVAR_TokenMapPreview": [("maps", "IMAGE")],
    "PreviewImage": [],
    "PreviewAny": [],
}
IN_TYPES = {
    "SparseVAR_Sampler": [("model", "SPARSEVAR_MODEL"), ("sparsevar", "SPARSEVAR_SETTINGS"),
                          ("anchors", "SPARSEVAR_ANCHOR_SETTINGS"), ("scale_skip", "SPARSEVAR_SCALE_SKIP"),
                          ("fastvar", "SPARSEVAR_FASTVAR_SETTINGS")],
    "SparseVAR_TokenMapPreview": [("token_maps", "SPARSEVAR_STATS"), ("images", "IMAGE")],
    "PreviewImage": [("images", "IMAGE")],
    "PreviewAny": [("source", "*")],            # core "Preview Any" (PreviewAny): shows the sampler's stats as text
}
COLUMN = 360                                     # canvas x of column k: 40 + COLUMN * k
SIZES = {"SparseVAR_Sampler": [320, 470], "PreviewImage": [320, 250], "PreviewAny": [320, 180]}


# the sampler's inputs up to ScaleKV's (the workflows made before it keep the list above)
SCALEKV_SAMPLER_INPUTS = IN_TYPES["SparseVAR_Sampler"] + [("sparvar", "SPARSEVAR_SPARVAR_SETTINGS"),
                                                          ("scalekv", "SPARSEVAR_SCALEKV_SETTINGS")]


def build(nodes: list[tuple[int, str, list]], edges: list[tuple[int, int, int, str]], title: str,
          at: dict[int, tuple[int, int]], inputs: dict | None = None) -> dict:
    """nodes: (id, type, widgets); edges: (from id, from slot, to id, to input name); at: node id →
    (column, canvas y). Layouts keep every node inside the frontend's first screen (the thumbnail):
    inputs on the left, one column per sampler, outputs on the right."""
    links, ui_nodes = [], []
    for n, (nid, ntype, widgets) in enumerate(nodes):
        slots = [{"name": name, "type": t, "link": None} for name, t in {**IN_TYPES, **(inputs or {})}.get(ntype, [])]
        outputs = [{"name": name, "type": t, "links": [], "slot_index": k}
                   for k, (name, t) in enumerate(OUT_TYPES[ntype])]
        props = {"Node name for S&R": ntype}
        if ntype.startswith("SparseVAR_"):
            props.update(cnr_id="sparsevar", ver=VERSION)
        if ntype == "SparseVAR_VARModelLoader" and widgets[0] in MODEL_NAMES:
            props["models"] = MODELS
        if ntype == "SparseVAR_InfinityModelLoader" and widgets[0] in INFINITY_MODEL_NAMES:
            props["models"] = INFINITY_MODELS
        col, y = at[nid]
        ui_nodes.append({"id": nid, "type": ntype, "pos": [40 + COLUMN * col, y],
                         "size": SIZES.get(ntype, [320, 160]), "flags": {}, "order": n, "mode": 0, "inputs": [],
                         "outputs": outputs, "properties": props, "widgets_values": widgets})
        ui_nodes[-1]["inputs"] = slots
    by_id = {n["id"]: n for n in ui_nodes}
    for lid, (src, slot, dst, name) in enumerate(edges, start=1):
        s, d = by_id[src], by_id[dst]
        t = s["outputs"][slot]["type"]
        s["outputs"][slot]["links"].append(lid)
        inp = next(i for i in d["inputs"] if i["name"] == name)
        inp["link"] = lid
        links.append([lid, src, slot, dst, [i["name"] for i in d["inputs"]].index(name), t])
        if inp["type"] == "*":
            inp["type"] = t                      # a wildcard ("*") input is saved with its link's type
    return {"last_node_id": max(by_id), "last_link_id": len(links), "nodes": ui_nodes, "links": links,
            "groups": [], "config": {}, "extra": {"title": title}, "version": 0.4}


# loader + settings | dense sampler | SparseVAR sampler | their previews | token maps
SIDE_BY_SIDE = {1: (0, 60), 4: (0, 250), 2: (1, 60), 5: (2, 60), 3: (3, 60), 6: (3, 360), 7: (4, 60), 8: (4, 230)}
# loader + one settings node | sampler | image and stats
ONE_SAMPLER = {1: (0, 60), 2: (0, 250), 3: (1, 60), 4: (2, 60), 5: (2, 360)}


def workflows() -> dict[str, dict]:
    sv = ("SparseVAR_Settings", [0.6, -2, -1, 0.0])
    return {
        "demo_dense_vs_sparsevar.json": build(
            [(1, *DEMO_LOADER), (2, "SparseVAR_Sampler", DEMO_SAMPLER_WIDGETS), (3, "PreviewImage", []),
             (4, *sv), (5, "SparseVAR_Sampler", DEMO_SAMPLER_WIDGETS), (6, "PreviewImage", []),
             (7, "SparseVAR_TokenMapPreview", []), (8, "PreviewImage", [])],
            [(1, 0, 2, "model"), (2, 0, 3, "images"), (1, 0, 5, "model"), (4, 0, 5, "sparsevar"),
             (5, 0, 6, "images"), (5, 2, 7, "token_maps"), (5, 0, 7, "images"), (7, 0, 8, "images")],
            "Demo model (built in): dense and SparseVAR side by side", SIDE_BY_SIDE),
        "var_dense_vs_sparsevar.json": build(
            [(1, *LOADER), (2, "SparseVAR_Sampler", SAMPLER_WIDGETS), (3, "PreviewImage", []),
             (4, *sv), (5, "SparseVAR_Sampler", SAMPLER_WIDGETS), (6, "PreviewImage", []),
             (7, "SparseVAR_TokenMapPreview", []), (8, "PreviewImage", [])],
            [(1, 0, 2, "model"), (2, 0, 3, "images"), (1, 0, 5, "model"), (4, 0, 5, "sparsevar"),
             (5, 0, 6, "images"), (5, 2, 7, "token_maps"), (5, 0, 7, "images"), (7, 0, 8, "images")],
            "VAR: dense and SparseVAR side by side", SIDE_BY_SIDE),
        "var_sparsevar_anchors_scale_skip.json": build(
            [(1, *LOADER), (2, "SparseVAR_Settings", [0.6, -3, -1, 0.3]), (3, "SparseVAR_AnchorSettings", [4, 0.8]),
             (4, "SparseVAR_ScaleSkip", [1, 0]), (5, "SparseVAR_Sampler", SAMPLER_WIDGETS),
             (6, "PreviewImage", []), (7, "SparseVAR_TokenMapPreview", []), (8, "PreviewImage", [])],
            [(1, 0, 5, "model"), (2, 0, 5, "sparsevar"), (3, 0, 5, "anchors"), (4, 0, 5, "scale_skip"),
             (5, 0, 6, "images"), (5, 2, 7, "token_maps"), (5, 0, 7, "images"), (7, 0, 8, "images")],
            "VAR: SparseVAR (keep 30 % of the last three scales) + Anchor Settings + Scale Skip",
            {1: (0, 60), 2: (0, 250), 3: (0, 450), 4: (0, 600), 5: (1, 60), 6: (2, 60), 7: (2, 360), 8: (3, 60)}),
        "var_fastvar.json": build(
            [(1, *LOADER), (2, "SparseVAR_FastVARSettings", ["0.5, 0.75"]), (3, "SparseVAR_Sampler", SAMPLER_WIDGETS),
             (4, "PreviewImage", [])],
            [(1, 0, 3, "model"), (2, 0, 3, "fastvar"), (3, 0, 4, "images")],
            "VAR: FastVAR cached token pruning", {1: (0, 60), 2: (0, 250), 3: (1, 60), 4: (2, 60)}),
        **infinity_workflows(),
    }


def infinity_workflows() -> dict[str, dict]:
    """Infinity-2B at 1024x1024, one file per method; every sampler's stats go to a core "Preview Any"."""
    loader, sampler = INFINITY_LOADER, ("SparseVAR_Sampler", INFINITY_SAMPLER_WIDGETS)
    return {
        "infinity_dense.json": build(
            [(1, *loader), (2, *sampler), (3, "PreviewImage", []), (4, "PreviewAny", [])],
            [(1, 0, 2, "model"), (2, 0, 3, "images"), (2, 1, 4, "source")],
            "Infinity-2B: text to image, dense", {1: (0, 60), 2: (1, 60), 3: (2, 60), 4: (2, 360)}),
        "infinity_sparsevar.json": build(
            [(1, *loader), (2, *sampler), (3, "PreviewImage", []), (4, "PreviewAny", []),
             (5, "SparseVAR_Settings", [0.6, -3, -1, 0.0]), (6, "SparseVAR_AnchorSettings", [4, 0.8]),
             (7, *sampler), (8, "PreviewImage", []), (9, "PreviewAny", []),
             (10, "SparseVAR_TokenMapPreview", []), (11, "PreviewImage", [])],
            [(1, 0, 2, "model"), (2, 0, 3, "images"), (2, 1, 4, "source"), (1, 0, 7, "model"),
             (5, 0, 7, "sparsevar"), (6, 0, 7, "anchors"), (7, 0, 8, "images"), (7, 1, 9, "source"),
             (7, 2, 10, "token_maps"), (7, 0, 10, "images"), (10, 0, 11, "images")],
            "Infinity-2B: dense and SparseVAR (paper preset: block group 3, tau 0.6, last three scales, anchors "
            "every 4 tokens) side by side",
            {1: (0, 60), 5: (0, 250), 6: (0, 450), 2: (1, 60), 7: (2, 60), 3: (3, 60), 4: (3, 360), 8: (4, 60),
             9: (4, 360), 10: (3, 590), 11: (4, 590)}),
        "infinity_fastvar.json": build(
            [(1, *loader), (2, "SparseVAR_FastVARSettings", ["0.4, 0.5, 1.0, 1.0"]), (3, *sampler),
             (4, "PreviewImage", []), (5, "PreviewAny", [])],
            [(1, 0, 3, "model"), (2, 0, 3, "fastvar"), (3, 0, 4, "images"), (3, 1, 5, "source")],
            "Infinity-2B: FastVAR (official schedule: prune 40 % and 50 % of two scales, skip the last two; "
            "layers 3..27)", ONE_SAMPLER),
        "infinity_scale_skip.json": build(
            [(1, *loader), (2, "SparseVAR_ScaleSkip", [1, 2]), (3, *sampler), (4, "PreviewImage", []),
             (5, "PreviewAny", [])],
            [(1, 0, 3, "model"), (2, 0, 3, "scale_skip"), (3, 0, 4, "images"), (3, 1, 5, "source")],
            "Infinity-2B: Scale Skip (skip the last scale, run the two before it without guidance)", ONE_SAMPLER),
        "infinity_scalekv.json": build(
            [(1, *loader), (2, "SparseVAR_ScaleKVSettings", [0.0]), (3, *sampler), (4, "PreviewImage", []),
             (5, "PreviewAny", [])],
            [(1, 0, 3, "model"), (2, 0, 3, "scalekv"), (3, 0, 4, "images"), (3, 1, 5, "source")],
            "Infinity-2B on a small GPU: ScaleKV KV-cache compression (the release's budgets; the stats show the "
            "peak GPU memory)", ONE_SAMPLER, {"SparseVAR_Sampler": SCALEKV_SAMPLER_INPUTS}),
    }


if __name__ == "__main__":
    out = ROOT / "workflows"
    out.mkdir(exist_ok=True)
    for name, wf in workflows().items():
        wf = migrate(wf)                          # built with the legacy sampler, saved with a conditioning node
        (out / name).write_text(json.dumps(wf, indent=1) + "\n")
        print("wrote", out / name)
