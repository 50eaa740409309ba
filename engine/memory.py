"""Handing freed host memory back to the operating system when a workspace is released."""
from __future__ import annotations

import ctypes
import sys

import torch


def trim_host_heap(device: torch.device) -> bool:
    """After freeing CPU tensors, ask the C allocator to return its heaps' free pages to the
    operating system (glibc's ``malloc_trim(0)``). Returns whether it did: False for a device
    other than the CPU (CUDA memory goes back to PyTorch's caching allocator, which keeps it for
    the next allocation) and where the C library has no such call (not Linux, or not glibc).

    Why: PyTorch's CPU tensors come from ``malloc``. glibc serves a request below its mmap
    threshold from a heap and raises that threshold (up to 32 MB) whenever a larger block it had
    mapped is freed, so after a few generations KV caches and activations live in heaps, and a
    block freed in the middle of a heap still counts in the process's resident memory. The bound this
    keeps is a test (tests/test_memory.py)."""
    if torch.device(device).type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):              # no C library symbols, or not glibc (e.g. musl)
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True
