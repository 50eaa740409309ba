"""Writes the shipped UI-format (v0.4) workflows in workflows/. Run after changing a node's
widgets: `python tests/comfyui/make_workflows.py` (the contract test checks they still fit)."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
# The frontend's workflow schema wants a url per model: the official release (the library itself
# never downloads; ComfyUI may offer it to the user when the file is missing from models/var).
OFFICIAL = "https://huggingface.co/FoundationVision/var/resolve/main/"
MODEL_NAMES = ("var_d16.pth", "vae_ch160v4096z32.pth")
MODELS = [{"name": n, "url": OFFICIAL + n, "directory": "var"} for n in MODEL_NAMES]
LOADER = ("SparseVAR_VARModelLoader", ["var_d16.pth", "vae_ch160v4096z32.pth", "auto"])
SAMPLER_WIDGETS = ["207", 0, "fixed", 4.0, 900, 0.95, 1]
# The built-in demo model: nothing to download, so the workflow runs on a fresh install.
DEMO_LOADER = ("SparseVAR_VARModelLoader", ["sparsevar-demo (built in)", "(converted folder: none needed)", "auto"])
DEMO_SAMPLER_WIDGETS = ["tree", 0, "fixed", 4.0, 900, 0.95, 1]
OUT_TYPES = {
    "SparseVAR_VARModelLoader": [("model", "SPARSEVAR_MODEL")],
    "SparseVAR_Settings": [("sparsevar", "SPARSEVAR_SETTINGS")],
    "SparseVAR_AnchorSettings": [("anchors", "SPARSEVAR_ANCHOR_SETTINGS")],
    "SparseVAR_ScaleSkip": [("scale_skip", "SPARSEVAR_SCALE_SKIP")],
    "SparseVAR_FastVARSettings": [("fastvar", "SPARSEVAR_FASTVAR_SETTINGS")],
    "SparseVAR_Sampler": [("images", "IMAGE"), ("stats", "STRING"), ("token_maps", "SPARSEVAR_STATS")],
    "SparseVAR_TokenMapPreview": [("maps", "IMAGE")],
    "PreviewImage": [],
}
IN_TYPES = {
    "SparseVAR_Sampler": [("model", "SPARSEVAR_MODEL"), ("sparsevar", "SPARSEVAR_SETTINGS"),
                          ("anchors", "SPARSEVAR_ANCHOR_SETTINGS"), ("scale_skip", "SPARSEVAR_SCALE_SKIP"),
                          ("fastvar", "SPARSEVAR_FASTVAR_SETTINGS")],
    "SparseVAR_TokenMapPreview": [("token_maps", "SPARSEVAR_STATS"), ("images", "IMAGE")],
    "PreviewImage": [("images", "IMAGE")],
}


def build(nodes: list[tuple[int, str, list]], edges: list[tuple[int, int, int, str]], title: str) -> dict:
    """nodes: (id, type, widgets); edges: (from id, from slot, to id, to input name)."""
    links, ui_nodes = [], []
    for n, (nid, ntype, widgets) in enumerate(nodes):
        inputs = [{"name": name, "type": t, "link": None} for name, t in IN_TYPES.get(ntype, [])]
        outputs = [{"name": name, "type": t, "links": [], "slot_index": k}
                   for k, (name, t) in enumerate(OUT_TYPES[ntype])]
        props = {"Node name for S&R": ntype}
        if ntype.startswith("SparseVAR_"):
            props.update(cnr_id="sparsevar", ver=VERSION)
        if ntype == "SparseVAR_VARModelLoader" and widgets[0] in MODEL_NAMES:
            props["models"] = MODELS
        ui_nodes.append({"id": nid, "type": ntype, "pos": [40 + 360 * (n % 4), 60 + 320 * (n // 4)],
                         "size": [320, 160], "flags": {}, "order": n, "mode": 0, "inputs": inputs,
                         "outputs": outputs, "properties": props, "widgets_values": widgets})
    by_id = {n["id"]: n for n in ui_nodes}
    for lid, (src, slot, dst, name) in enumerate(edges, start=1):
        s, d = by_id[src], by_id[dst]
        t = s["outputs"][slot]["type"]
        s["outputs"][slot]["links"].append(lid)
        inp = next(i for i in d["inputs"] if i["name"] == name)
        inp["link"] = lid
        links.append([lid, src, slot, dst, [i["name"] for i in d["inputs"]].index(name), t])
    return {"last_node_id": max(by_id), "last_link_id": len(links), "nodes": ui_nodes, "links": links,
            "groups": [], "config": {}, "extra": {"title": title}, "version": 0.4}


def workflows() -> dict[str, dict]:
    sv = ("SparseVAR_Settings", [0.6, -2, -1, 0.0])
    return {
        "demo_dense_vs_sparsevar.json": build(
            [(1, *DEMO_LOADER), (2, "SparseVAR_Sampler", DEMO_SAMPLER_WIDGETS), (3, "PreviewImage", []),
             (4, *sv), (5, "SparseVAR_Sampler", DEMO_SAMPLER_WIDGETS), (6, "PreviewImage", []),
             (7, "SparseVAR_TokenMapPreview", []), (8, "PreviewImage", [])],
            [(1, 0, 2, "model"), (2, 0, 3, "images"), (1, 0, 5, "model"), (4, 0, 5, "sparsevar"),
             (5, 0, 6, "images"), (5, 2, 7, "token_maps"), (5, 0, 7, "images"), (7, 0, 8, "images")],
            "Demo model (built in): dense and SparseVAR side by side"),
        "var_dense_vs_sparsevar.json": build(
            [(1, *LOADER), (2, "SparseVAR_Sampler", SAMPLER_WIDGETS), (3, "PreviewImage", []),
             (4, *sv), (5, "SparseVAR_Sampler", SAMPLER_WIDGETS), (6, "PreviewImage", []),
             (7, "SparseVAR_TokenMapPreview", []), (8, "PreviewImage", [])],
            [(1, 0, 2, "model"), (2, 0, 3, "images"), (1, 0, 5, "model"), (4, 0, 5, "sparsevar"),
             (5, 0, 6, "images"), (5, 2, 7, "token_maps"), (5, 0, 7, "images"), (7, 0, 8, "images")],
            "VAR: dense and SparseVAR side by side"),
        "var_sparsevar_anchors_scale_skip.json": build(
            [(1, *LOADER), (2, "SparseVAR_Settings", [0.6, -3, -1, 0.3]), (3, "SparseVAR_AnchorSettings", [4, 0.8]),
             (4, "SparseVAR_ScaleSkip", [1, 0]), (5, "SparseVAR_Sampler", SAMPLER_WIDGETS),
             (6, "PreviewImage", []), (7, "SparseVAR_TokenMapPreview", []), (8, "PreviewImage", [])],
            [(1, 0, 5, "model"), (2, 0, 5, "sparsevar"), (3, 0, 5, "anchors"), (4, 0, 5, "scale_skip"),
             (5, 0, 6, "images"), (5, 2, 7, "token_maps"), (5, 0, 7, "images"), (7, 0, 8, "images")],
            "VAR: SparseVAR (keep 30 % of the last three scales) + Anchor Settings + Scale Skip"),
        "var_fastvar.json": build(
            [(1, *LOADER), (2, "SparseVAR_FastVARSettings", ["0.5, 0.75"]), (3, "SparseVAR_Sampler", SAMPLER_WIDGETS),
             (4, "PreviewImage", [])],
            [(1, 0, 3, "model"), (2, 0, 3, "fastvar"), (3, 0, 4, "images")],
            "VAR: FastVAR cached token pruning"),
    }


if __name__ == "__main__":
    out = ROOT / "workflows"
    out.mkdir(exist_ok=True)
    for name, wf in workflows().items():
        (out / name).write_text(json.dumps(wf, indent=1) + "\n")
        print("wrote", out / name)
