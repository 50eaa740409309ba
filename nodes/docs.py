"""Widget tooltips taken from the config dataclasses' docstrings, so every setting is described
once (in the config) and the ComfyUI widgets say the same as the Python API."""
from __future__ import annotations

import inspect
import re


def field_doc(cls, name: str) -> str:
    """The docstring paragraph ``name: …`` of a config class, joined into one line."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    out, grab = [], False
    for line in lines:
        m = re.match(r"^(\w+):\s*(.*)$", line)
        if m:
            if grab:
                break
            if m.group(1) == name:
                grab = True
                out.append(m.group(2))
            continue
        if grab:
            if not line.strip():
                break
            out.append(line.strip())
    if not out:
        raise KeyError(f"{cls.__name__} documents no field {name!r}")
    return " ".join(out)
