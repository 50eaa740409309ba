"""Which implementation of a sparse op runs: the Triton kernel or its pure-torch twin.

Decided per call from the requested backend and the tensors' device, never at import time:

- ``"torch"``: the references in ``ref.py``, everywhere.
- ``"auto"``: Triton on a CUDA device where it can run, the torch path otherwise (CPU, no
  Triton, Windows, a GPU older than sm_80). When Triton cannot run, one log line says why (once
  per device kind and process: the probe below is cached).
- ``"triton"``: the kernels, or a ValueError that says why they cannot run here. On CPU they run
  only through Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which
  is how CI tests them.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import platform
import shutil

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_status(device_type: str, device_index: int, interpret: bool) -> tuple[bool, str]:
    """(usable, reason) for Triton kernels on one device.

    A pure probe of the installed packages and the hardware, neither of which changes while the
    process runs, so it is cached (and its log line is written once per device)."""
    ok, why = _probe(device_type, device_index, interpret)
    if not ok:
        log.info("sparse_ops: the pure-torch path runs on %s: %s", device_type, why)
    return ok, why


def _probe(device_type: str, device_index: int, interpret: bool) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'sparsevar[triton]' on Linux with a CUDA GPU)"
    if interpret:
        return True, "Triton's CPU interpreter (TRITON_INTERPRET=1): correct but slow, for tests"
    if platform.system() == "Windows":
        return False, "Triton kernels are not used on Windows (no official triton wheel)"
    if device_type != "cuda":
        return False, f"Triton kernels run on CUDA devices only, these tensors are on {device_type}"
    if torch.version.hip is not None:
        return False, "the kernels are tuned and tested on NVIDIA GPUs only (ROCm build of torch)"
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install must not break generation
        return False, f"import triton failed: {e!r}"
    try:                    # the chained kernels' programmatic dependent launch (_gdc.py)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except Exception:
        return False, (f"triton {triton.__version__} has no programmatic dependent launch (gdc_wait), which the "
                       f"kernels use: triton 3.4 or newer has it")
    if not any(shutil.which(c) for c in (os.environ.get("CC") or "cc", "gcc", "clang")):
        return False, "Triton builds its launcher with a C compiler and none was found (install gcc, or set CC)"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return False, f"GPU sm_{major}{minor} is older than sm_80 (bf16 kernels need Ampere or newer)"
    return True, f"triton {triton.__version__} on sm_{major}{minor}"


def check_backend(backend: str, name: str = "backend") -> None:
    """ValueError naming the argument, its value and the fix unless ``backend`` is known."""
    if backend not in BACKENDS:
        raise ValueError(f"{name}={backend!r} is not a kernel backend: use 'auto' (Triton on a CUDA GPU where it "
                         f"can run, else pure torch), 'triton' (require the kernels) or 'torch' (pure torch)")


def resolve_backend(backend: str, device: torch.device | str, name: str = "backend") -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device``. ``backend="triton"`` where the kernels
    cannot run raises a ValueError naming ``name`` and the reason."""
    check_backend(backend, name)
    if backend == "torch":
        return "torch"
    device = torch.device(device)
    interpret = interpreting()
    if backend == "auto" and device.type != "cuda":
        triton_status(device.type, -1, False)       # logs once why the torch path runs
        return "torch"
    index = (device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else -1
    ok, why = triton_status(device.type, index, interpret)
    if ok:
        return "triton"
    if backend == "triton":
        raise ValueError(f"{name}='triton' but the Triton kernels cannot run on {device}: {why}. "
                         f"Use {name}='auto' (Triton where it can run, else pure torch) or 'torch'")
    return "torch"


# Bytes of shared memory a launch shape leaves unplanned (``fit_stages``): Triton's epilogues and
# reductions use a little beside the pipelined tiles
SHARED_MEMORY_SLACK = 2048


# the per-block opt-in shared memory by compute capability, for a torch whose device properties lack it
_SHARED_MEMORY_BY_CAPABILITY = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448}


@functools.lru_cache(maxsize=None)
def _shared_memory_optin(device_index: int) -> int:
    limit = getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", None)
    return limit or _SHARED_MEMORY_BY_CAPABILITY.get(_capability(device_index), 101376)


def shared_memory(device: torch.device | str) -> int | None:
    """Bytes of shared memory one Triton program may use on ``device``: the per-block opt-in limit
    (232,448 on H100/H200, 166,912 on A100, 101,376 on sm_86/sm_89 cards such as the RTX 3090/4090);
    None in Triton's interpreter or off CUDA (no limit)."""
    device = torch.device(device)
    if interpreting() or device.type != "cuda":
        return None
    return _shared_memory_optin(device.index if device.index is not None else torch.cuda.current_device())


def sm_count(device: torch.device | str) -> int:
    """The GPU's streaming multiprocessors (1 off CUDA: the interpreter's launches), for grid sizing."""
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def fit_stages(stages: int, resident: int, per_stage: int, limit: int | None, least: int = 2) -> int | None:
    """The most software-pipeline stages, at most ``stages``, whose tiles fit in ``limit`` bytes of
    shared memory (less ``SHARED_MEMORY_SLACK``): ``resident`` bytes loaded once (a query tile) plus
    ``per_stage`` bytes for each stage (the tiles one loop step loads). That sum is what Triton's
    pipeliner allocates on sm_90 and at least what it allocates on sm_80/86/89 (the kernels compiled
    for sm_86 are checked against it in tests/test_sparse_ops.py). ``stages`` where ``limit`` is None;
    None where not even ``least`` stages fit."""
    if limit is None:
        return stages
    for s in range(stages, least - 1, -1):
        if resident + s * per_stage <= limit - SHARED_MEMORY_SLACK:
            return s
    return None


# Products of at most this many rows run on this package's GEMM under the fused kernels
# (Kernels.SMALL_GEMM_ROWS), so a layer there is a chain of this package's kernels only, and
# only there do they use programmatic dependent launch (``_gdc``). Above it cuBLAS's products sit
# between them, where dependent launches of the short kernels are slower.
CHAIN_ROWS = 64


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def dependent_launch(device: torch.device, rows: int, pdl: bool | None = None) -> bool:
    """Whether a chained kernel over ``rows`` rows on ``device`` is launched with programmatic
    dependent launch (``_gdc``): on a CUDA GPU of sm_90 or newer at most ``CHAIN_ROWS`` rows, never
    in Triton's interpreter or on older GPUs. ``pdl`` (True / False) overrides the row rule (tests,
    benchmarks); True where the GPU cannot is a ValueError."""
    if interpreting() or device.type != "cuda":
        able = False
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        able = _capability(index) >= (9, 0)
    if pdl is None:
        return able and rows <= CHAIN_ROWS
    if pdl and not able:
        raise ValueError(f"pdl=True but programmatic dependent launch needs a CUDA GPU of sm_90 or newer outside "
                         f"Triton's interpreter, these tensors are on {device}: pass pdl=None (decide per call) "
                         f"or pdl=False")
    return bool(pdl)
