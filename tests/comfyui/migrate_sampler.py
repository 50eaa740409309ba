"""Moves UI-format (v0.4) workflows from the legacy "SparseVAR_Sampler" (class and prompt widgets on
the sampler) to the "SparseVAR Sampler" fed by a conditioning node: a "VAR Class" node for VAR and
FlexVAR loaders, an "Infinity/HART Text Encode" node (fed by the same loader) for Infinity and HART.
Samplers of one loader with the same class or prompt share one conditioning node, placed under the
first of them. `python tests/comfyui/migrate_sampler.py FILE...` rewrites the files in place; the
shipped workflows were moved with it (make_workflows.py applies it to what it builds)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

LEGACY, SAMPLER = "SparseVAR_Sampler", "SparseVAR_ConditionedSampler"
CLASS_NODE, TEXT_NODE = "SparseVAR_VARClass", "SparseVAR_TextEncode"
TEXT_LOADERS = ("SparseVAR_InfinityModelLoader", "SparseVAR_HARTModelLoader")
SAMPLER_SIZE = [320, 400]
NODE_SIZES = {CLASS_NODE: [320, 90], TEXT_NODE: [320, 230]}
GAP = 50


def migrate(wf: dict) -> dict:
    """``wf`` with every legacy sampler replaced (a new dict; ``wf`` is left as it is)."""
    wf = json.loads(json.dumps(wf))
    nodes = {n["id"]: n for n in wf["nodes"]}
    links = wf["links"]
    next_node, next_link = wf["last_node_id"] + 1, wf["last_link_id"] + 1
    shared: dict[tuple, int] = {}
    for sampler in [n for n in wf["nodes"] if n["type"] == LEGACY]:
        (class_label, seed, control, cfg, top_k, top_p, batch, prompt, negative, height, width,
         *steps) = sampler["widgets_values"]
        model_link = next(i["link"] for i in sampler["inputs"] if i["name"] == "model")
        loader = nodes[next(link[1] for link in links if link[0] == model_link)]
        text = loader["type"] in TEXT_LOADERS
        kind, widgets = (TEXT_NODE, [prompt, negative]) if text else (CLASS_NODE, [class_label])
        key = (loader["id"], kind, json.dumps(widgets))
        if key not in shared:
            cond = {"id": next_node, "type": kind,
                    "pos": [sampler["pos"][0], sampler["pos"][1] + SAMPLER_SIZE[1] + GAP],
                    "size": NODE_SIZES[kind], "flags": {}, "order": 0, "mode": 0,
                    "inputs": [{"name": "model", "type": "SPARSEVAR_MODEL", "link": None}] if text else [],
                    "outputs": [{"name": "conditioning", "type": "SPARSEVAR_CONDITIONING", "links": [],
                                 "slot_index": 0}],
                    "properties": {**sampler["properties"], "Node name for S&R": kind}, "widgets_values": widgets}
            if text:                                   # the loader's model into the text encode node
                links.append([next_link, loader["id"], 0, cond["id"], 0, "SPARSEVAR_MODEL"])
                loader["outputs"][0]["links"].append(next_link)
                cond["inputs"][0]["link"] = next_link
                next_link += 1
            wf["nodes"].append(cond)
            nodes[cond["id"]] = cond
            shared[key] = cond["id"]
            next_node += 1
        cond = nodes[shared[key]]
        for link in links:                             # inputs after the model move one slot down
            if link[3] == sampler["id"] and link[4] >= 1:
                link[4] += 1
        sampler["inputs"].insert(1, {"name": "conditioning", "type": "SPARSEVAR_CONDITIONING", "link": next_link})
        links.append([next_link, cond["id"], 0, sampler["id"], 1, "SPARSEVAR_CONDITIONING"])
        cond["outputs"][0]["links"].append(next_link)
        next_link += 1
        sampler["type"] = SAMPLER
        sampler["properties"]["Node name for S&R"] = SAMPLER
        sampler["size"] = SAMPLER_SIZE
        sampler["widgets_values"] = [seed, control, cfg, top_k, top_p, batch, height, width, *(steps or [0])]
    for order, n in enumerate(sorted(wf["nodes"], key=lambda n: (n["order"], n["id"]))):
        n["order"] = order
    wf["last_node_id"], wf["last_link_id"] = next_node - 1, next_link - 1
    return wf


if __name__ == "__main__":
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(json.dumps(migrate(json.loads(path.read_text())), indent=1) + "\n")
        print("migrated", path)
