"""Public names imported at first use (PEP 562), for the package root, ``engine`` and ``pipelines``:
importing one light submodule (the CLI's) then imports neither torch nor diffusers."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable


def lazy_exports(package: str, source: dict) -> tuple[Callable, Callable]:
    """(``__getattr__``, ``__dir__``) for ``package``, whose public names (``source``: name → the
    module that defines it, relative to ``package`` or absolute) are imported at their first use and
    then set on the package; its submodules too (``sparsevar.engine.sampler`` after ``import
    sparsevar``, as eager imports allowed)."""
    def __getattr__(name: str):
        module = source.get(name)
        if module is None:
            if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f"{package}.{name}")     # binds itself on the package
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)           # later lookups find it without this function
        return value

    def __dir__() -> list:
        return sorted(set(vars(sys.modules[package])) | set(source))

    return __getattr__, __dir__
