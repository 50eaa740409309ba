"""UI-format (v0.4) ComfyUI workflow → API-format prompt, using a live server's /object_info.

Widget values are matched to the node's widget inputs in schema order; a seed widget with
``control_after_generate`` is followed by one extra UI value (the control mode), which is skipped.
Link-fed inputs come from the workflow's ``links`` table. Unknown node types raise.
"""
from __future__ import annotations

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def _inputs_in_order(info: dict) -> list[tuple[str, str, dict]]:
    out = []
    for section in ("required", "optional"):
        for name in info["input_order"].get(section, []):
            spec = info["input"][section][name]
            kind = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if isinstance(kind, list):
                kind = "COMBO"
            out.append((name, kind, opts))
    return out


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    links = {l[0]: l for l in workflow.get("links", [])}         # id, from_node, from_slot, to_node, to_slot, type
    prompt = {}
    for node in workflow["nodes"]:
        ntype = node["type"]
        if ntype not in object_info:
            raise ValueError(f"workflow node {node['id']} has unknown type {ntype!r}")
        info = object_info[ntype]
        inputs = {}
        linked = {}
        for inp in node.get("inputs", []):
            if inp.get("link") is not None:
                l = links[inp["link"]]
                linked[inp["name"]] = [str(l[1]), l[2]]
        values = list(node.get("widgets_values", []))
        for name, kind, opts in _inputs_in_order(info):
            if name in linked:
                inputs[name] = linked[name]
                continue
            if kind not in WIDGET_TYPES:
                continue
            if not values:
                break
            inputs[name] = values.pop(0)
            if opts.get("control_after_generate") and values and values[0] in (
                    "fixed", "increment", "decrement", "randomize", True, False):
                values.pop(0)
        prompt[str(node["id"])] = {"class_type": ntype, "inputs": inputs}
    return prompt
