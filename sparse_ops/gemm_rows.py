"""Row padding for cuBLAS products: a product of M rows runs on M' ≥ M rows where the GPU's
kernel choice at M was measured to be slow.

Why: cuBLAS picks its kernel from (M, N, K) by a heuristic, and at some row counts it picks a poor
one (an example is in benchmarks/results/README.md). Rows of a product are independent, so the first
M rows of the M'-row product are the M-row product, rounded by the kernel chosen for M'
(deterministic: the same M' always takes the same kernel).

How:
- the producers of the layers' product inputs on the fused path (the LayerNorm + AdaLN launch,
  the attention step, the products themselves) allocate ``ROW_SLACK`` spare rows after their
  output (:func:`empty_rows`); the spare rows hold whatever the allocator gave and only ever reach
  spare output rows;
- a product whose input has the spare rows and whose row count the table of this GPU lists runs
  on the padded count (:func:`linear_rows`) and returns the first M rows.

The table is measured offline (``sparsevar bench gemm-rows``), one file per GPU
model and CUDA version, in the user's folder (``$SPARSEVAR_GEMM_ROWS_DIR`` when set, else
``~/.cache/sparsevar/gemm_rows``, where the benchmark writes by default) and among the tables shipped
in ``gemm_rows/`` beside this file; for a shape in both, the user's entries win. No choice depends on a timing taken at
run time, so one seed still gives one image; a GPU or CUDA version without a table pads nothing.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch

ROW_SLACK = 64            # spare rows after a padded-capable buffer; the table pads by at most this
TABLE_DIR = Path(__file__).resolve().parent / "gemm_rows"      # the tables shipped with the package
DIR_ENV = "SPARSEVAR_GEMM_ROWS_DIR"
EPILOGUES = ("none", "bias", "gelu")      # the product's epilogue: plain, + bias, + bias then tanh-GELU


def empty_rows(shape, *, dtype: torch.dtype, device, row_dims: int = 1) -> torch.Tensor:
    """``torch.empty(shape)`` whose storage holds ``ROW_SLACK`` more rows after it; a row is the
    last ``row_dims`` dimensions (e.g. (R, l, H, d) with ``row_dims=2`` has R·l rows of H·d)."""
    shape = tuple(shape)
    row = math.prod(shape[len(shape) - row_dims:])
    rows = math.prod(shape[:len(shape) - row_dims])
    flat = torch.empty((rows + ROW_SLACK) * row, dtype=dtype, device=device)
    return flat[:rows * row].view(shape)


def spare_rows(x: torch.Tensor) -> int:
    """How many whole rows of ``x.shape[-1]`` its storage holds after ``x`` itself (0 unless ``x`` is
    contiguous)."""
    K = x.shape[-1]
    if K == 0 or not x.is_contiguous():
        return 0
    total = x.untyped_storage().nbytes() // x.element_size() - x.storage_offset()
    return max(0, total // K - x.numel() // K)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, gelu: bool = False,
                rows: Optional[int] = None) -> torch.Tensor:
    """``x · weightᵀ (+ bias) (then tanh-GELU)`` through cuBLAS on ``rows`` ≥ M rows (the spare rows
    after ``x`` fill the difference; :func:`spare_rows` must cover it). Returns the M rows, in a
    buffer that again has ``ROW_SLACK`` spare rows. GELU needs a bias (cuBLASLt's epilogue)."""
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else 0
    rows = M if rows is None else rows
    if rows < M:
        raise ValueError(f"rows={rows} is fewer than the input's {M} rows")
    if rows > M and spare_rows(x) < rows - M:
        raise ValueError(f"rows={rows}: the input has {spare_rows(x)} spare rows after its {M}; "
                         "allocate it with sparse_ops.gemm_rows.empty_rows")
    if gelu and bias is None:
        raise ValueError("gelu=True needs a bias (the GELU epilogue adds it)")
    x2 = x.reshape(M, K) if rows == M else x.as_strided((rows, K), (K, 1), x.storage_offset())
    y = empty_rows((rows, N), dtype=x.dtype, device=x.device)
    wt = weight.t()
    if gelu and x.is_cuda:
        torch._addmm_activation(bias, x2, wt, use_gelu=True, out=y)         # cuBLASLt's epilogue: tanh-GELU
    elif gelu:                                                              # (on CPU the fused op's GELU is erf)
        torch.addmm(bias, x2, wt, out=y)
        y.copy_(torch.nn.functional.gelu(y, approximate="tanh"))
    elif bias is not None:
        torch.addmm(bias, x2, wt, out=y)
    else:
        torch.mm(x2, wt, out=y)
    return y[:M].view(*x.shape[:-1], N)                                           # (M', N) → (…, N)


def padded_rows(table: Optional["GemmRowTable"], x: torch.Tensor, N: int, epilogue: str) -> int:
    """The row count to run ``x``'s product (N outputs) on: the table's count when the spare rows
    after ``x`` cover it, else x's own M."""
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if table is None or M == 0 or not table.covers(N, K, epilogue, x.dtype):
        return M
    rows = table.rows(M, N, K, epilogue)
    return rows if rows == M or spare_rows(x) >= rows - M else M


def shape_key(N: int, K: int, epilogue: str) -> str:
    """The table's key of a product: output width × reduction width, epilogue."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r}: choose one of {EPILOGUES}")
    return f"{N}x{K}:{epilogue}"


class GemmRowTable:
    """Padded row counts per product shape, for one GPU model, CUDA version and operand dtype (the
    sweep's: bfloat16 — another dtype takes other kernels, so it is not covered).

    ``rows(M, N, K, epilogue)`` is the count to run an M-row product on: the table's entry for M,
    or for M rounded up to a multiple of 8 (the sweep's step), else M itself."""

    def __init__(self, entries: dict[str, dict[int, int]], device_name: str = "", cuda: str = "",
                 source: str = "", dtype: str = "bfloat16"):
        for key, table in entries.items():
            for m, mp in table.items():
                if not m <= mp <= m + ROW_SLACK:
                    raise ValueError(f"{source or 'table'}: {key} pads {m} rows to {mp}; "
                                     f"entries must pad by 0–{ROW_SLACK} rows")
        self.entries, self.device_name, self.cuda, self.source = entries, device_name, cuda, source
        self.dtype = dtype

    def covers(self, N: int, K: int, epilogue: str, dtype: Optional[torch.dtype] = None) -> bool:
        """Whether the sweep measured this product shape (and operand dtype, when given): then the
        table alone decides its rows."""
        if dtype is not None and str(dtype).removeprefix("torch.") != self.dtype:
            return False
        return shape_key(N, K, epilogue) in self.entries

    def rows(self, M: int, N: int, K: int, epilogue: str) -> int:
        table = self.entries.get(shape_key(N, K, epilogue))
        if not table:
            return M
        if M in table:
            return table[M]
        up = -(-M // 8) * 8
        return table.get(up, M) if up != M else M

    def __len__(self) -> int:
        return sum(len(t) for t in self.entries.values())

    @classmethod
    def load(cls, path) -> "GemmRowTable":
        """A table file written by ``bench_gemm_rows``."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            entries = {key: {int(m): int(mp) for m, mp in pairs} for key, pairs in data["shapes"].items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a GEMM row table ({e}); write one with "
                             "sparsevar bench gemm-rows") from e
        return cls(entries, data.get("device", ""), data.get("cuda", ""), str(path), data.get("dtype", "bfloat16"))

    @classmethod
    def find(cls, device_name: str, cuda: str) -> Optional["GemmRowTable"]:
        """The tables of this GPU model and CUDA version in :func:`table_dirs`, merged shape by shape
        (the first folder's entries for a shape win: a user's sweep of some shapes keeps the shipped
        entries of the others), or None."""
        name = file_name(device_name, cuda)
        found = [cls.load(d / name) for d in table_dirs() if (d / name).is_file()]
        if not found:
            return None
        entries: dict[str, dict[int, int]] = {}
        for t in reversed(found):
            entries.update(t.entries)
        dtypes = {t.dtype for t in found}
        if len(dtypes) > 1:
            raise ValueError(f"GEMM row tables for {device_name} disagree on the dtype ({sorted(dtypes)}): "
                             + ", ".join(t.source for t in found))
        return cls(entries, device_name, cuda, " + ".join(t.source for t in found), found[0].dtype)

    @classmethod
    def for_device(cls, device) -> Optional["GemmRowTable"]:
        """The table of this CUDA device's model and this torch's CUDA version, or None."""
        device = torch.device(device)
        if device.type != "cuda" or torch.version.cuda is None:
            return None
        return cls.find(torch.cuda.get_device_name(device), torch.version.cuda)


def user_table_dir() -> Path:
    """Where ``bench_gemm_rows`` writes by default: ``$SPARSEVAR_GEMM_ROWS_DIR``, else
    ``$XDG_CACHE_HOME/sparsevar/gemm_rows`` (``~/.cache/sparsevar/gemm_rows``)."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "sparsevar" / "gemm_rows"


def table_dirs() -> list[Path]:
    """Where tables are looked up, first match first: the user's folder, then the shipped tables
    (only the shipped ones where no home folder can be determined, e.g. a service account)."""
    try:
        return [user_table_dir(), TABLE_DIR]
    except (RuntimeError, KeyError):                     # Path.home(): no $HOME and no passwd entry
        return [TABLE_DIR]


def file_name(device_name: str, cuda: str) -> str:
    """The table file of a GPU model and CUDA version, e.g. ``NVIDIA_H100_80GB_HBM3-cuda13.0.json``."""
    safe = "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in device_name.strip())
    return f"{safe}-cuda{cuda}.json"
