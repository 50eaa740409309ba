"""Sweep cuBLAS over row counts for the layer products of the VAR and Infinity models and write the
GPU's row padding table (``sparse_ops/gemm_rows.py``).

    sparsevar bench gemm-rows --out benchmarks/results/gemm_rows_H100.csv
    sparsevar bench gemm-rows --models infinity-2b --max-rows 8200 --out benchmarks/results/gemm_rows_infinity_H100.csv

(``python -m sparsevar.benchmarks.bench_gemm_rows`` takes the same options.)

For every model's four layer products (qkv + bias, proj + bias, fc1 + bias + tanh-GELU, fc2 + bias;
bf16) and every row count from ``--min-rows`` to ``--max-rows`` in steps of 8, it times the product
the way the layers run it: in a CUDA graph, cycling through enough weight copies that each call reads
its weights from HBM (a layer's 88 MB do not stay in L2), median of ``--runs`` replays. Then, per
row count M, the fastest count M' in [M, M + ROW_SLACK] becomes the table's entry when it is at
least ``--min-gain`` faster than M itself.

The table goes to the user's table folder (``~/.cache/sparsevar/gemm_rows/<GPU>-cuda<version>.json``,
or ``$SPARSEVAR_GEMM_ROWS_DIR``), where the sampler finds it before the tables shipped in
``sparse_ops/gemm_rows/`` (``--table`` writes elsewhere, e.g. there for a release); a table already
at that path for the same GPU and CUDA version keeps the shapes this run did not sweep. The CSV holds every timing, with the GPU name and versions. The sampler only reads the
shipped table: no choice depends on a timing taken at run time.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from ._results import atomic_write, write_csv
from .bench_ops import time_graph_ms
from ..models.infinity import INFINITY_PRESETS, ffn_hidden
from ..models.var import VAR_PRESETS
from ..sparse_ops.gemm_rows import ROW_SLACK, file_name, linear_rows, shape_key, user_table_dir

DEFAULT_MODELS = ("var-d16", "var-d20", "var-d24", "var-d30", "var-d36")
STEP = 8


def layer_products(preset: str) -> list[tuple[str, int, int, str]]:
    """(name, N, K, epilogue) of a VAR or Infinity block's four self-attention and FFN products."""
    if preset in VAR_PRESETS:
        C = VAR_PRESETS[preset]["embed_dim"]
        F = 4 * C                                              # VAR's FFN: mlp_ratio 4
    elif preset in INFINITY_PRESETS:
        t = INFINITY_PRESETS[preset]["transformer"]
        C = t["embed_dim"]
        F = ffn_hidden(C, t.get("mlp_ratio", 4.0))
    else:
        raise ValueError(f"--models: {preset!r} is neither a VAR nor an Infinity preset; choose from "
                         f"{sorted(VAR_PRESETS) + sorted(INFINITY_PRESETS)}")
    return [("qkv", 3 * C, C, "bias"), ("proj", C, C, "bias"), ("fc1", F, C, "gelu"), ("fc2", C, F, "bias")]


def time_rows_us(M: int, weights: list, x_flat: torch.Tensor, gelu: bool, runs: int) -> float:
    """µs per product at M rows: one graph replays a pass over every weight copy."""
    N, K = weights[0][0].shape
    x = x_flat[:M * K].view(M, K)

    def one_pass():
        for w, b in weights:
            linear_rows(x, w, b, gelu)

    return time_graph_ms(one_pass, runs=runs, calls=1) * 1e3 / len(weights)


def padding_table(times: dict[int, float], min_gain: float, near: float = 0.03) -> dict[int, int]:
    """{M: M'}: M' ∈ (M, M + ROW_SLACK] (swept counts) is ≥ ``min_gain`` faster than M; of the
    counts within ``near`` of the fastest one, the smallest (fewer wasted rows, and timing noise
    does not push the pad further)."""
    out = {}
    for M, t in times.items():
        window = [m for m in times if M <= m <= M + ROW_SLACK]
        best = min(times[m] for m in window)
        if best < (1.0 - min_gain) * t:
            out[M] = min(m for m in window if times[m] <= (1.0 + near) * best)
    return out


def run_sweep(models: Sequence[str], min_rows: int, max_rows: int, runs: int, min_gain: float,
              l2_bytes: int = 3 * 50 * 2 ** 20, log=print) -> tuple[list[dict], dict[str, dict[int, int]]]:
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    versions = dict(gpu=name, torch=torch.__version__, cuda=torch.version.cuda)
    shapes = {}
    for preset in models:
        for prod, N, K, epi in layer_products(preset):
            shapes.setdefault(shape_key(N, K, epi), (preset, prod, N, K, epi))
    counts = list(range(-(-min_rows // STEP) * STEP, max_rows + 1, STEP))
    rows, tables = [], {}
    x_flat = torch.randn((max_rows + ROW_SLACK) * max(k for *_, k, _ in shapes.values()), device=dev,
                         dtype=torch.bfloat16)
    for key, (preset, prod, N, K, epi) in shapes.items():
        copies = max(2, -(-l2_bytes // (N * K * 2)))              # weights cold at every call
        weights = [(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02,
                    torch.randn(N, device=dev, dtype=torch.bfloat16)) for _ in range(copies)]
        times = {}
        for M in counts:
            times[M] = time_rows_us(M, weights, x_flat, epi == "gelu", runs)
            rows.append(dict(model=preset, product=prod, N=N, K=K, epilogue=epi, rows=M, us=round(times[M], 3),
                             tflops=round(2 * M * N * K / times[M] / 1e6, 1), **versions))
        tables[key] = padding_table(times, min_gain)
        gain = sum(times[m] - times[mp] for m, mp in tables[key].items())
        log(f"{preset} {prod} ({key}): {len(tables[key])} of {len(counts)} row counts padded "
            f"(saves {gain:.0f} µs over the sweep)")
        del weights
    return rows, tables


def write_table(path: Path, tables: dict[str, dict[int, int]], args_line: str, min_gain: float) -> None:
    """The table file; the shapes of an existing table of the same GPU and CUDA version that this
    sweep did not measure are kept (and the commands that measured them)."""
    shapes, commands = {}, []
    if path.is_file():
        old = json.loads(path.read_text())
        if (old.get("device"), old.get("cuda")) == (torch.cuda.get_device_name(), torch.version.cuda):
            shapes = {k: v for k, v in old["shapes"].items() if k not in tables}
            commands = [c for c in old.get("commands", []) if c != args_line]
    shapes.update({k: sorted([m, mp] for m, mp in t.items()) for k, t in tables.items()})
    data = dict(device=torch.cuda.get_device_name(), cuda=torch.version.cuda, torch=torch.__version__,
                dtype="bfloat16", slack=ROW_SLACK, step=STEP, min_gain=min_gain, commands=commands + [args_line],
                shapes=shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda p: p.write_text(table_json(data)))


def table_json(data: dict) -> str:
    """The table as JSON with one line per product shape (readable diffs)."""
    head = {k: v for k, v in data.items() if k != "shapes"}
    shapes = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data["shapes"].items())
    return json.dumps(head, indent=1)[:-2] + ',\n "shapes": {\n' + shapes + "\n }\n}\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sweep's options (shared by ``python -m`` and ``sparsevar bench gemm-rows``)."""
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                   help="VAR or Infinity presets whose products to sweep")
    p.add_argument("--min-rows", type=int, default=40, help="first row count (the fused path's own GEMM "
                   "takes ≤ 32 rows)")
    p.add_argument("--max-rows", type=int, default=4200, help="last row count")
    p.add_argument("--runs", type=int, default=3, help="graph replays per row count (median)")
    p.add_argument("--min-gain", type=float, default=0.05, help="pad only when this much faster (fraction)")
    p.add_argument("--out", type=Path, default=None, help="CSV of every timing")
    p.add_argument("--table", type=Path, default=None,
                   help="table file (default: this GPU's file in ~/.cache/sparsevar/gemm_rows or $SPARSEVAR_GEMM_ROWS_DIR)")


def command_line(program: str, args) -> str:
    """The sweep's command with every option spelled out (recorded in the table)."""
    line = (f"{program} --models {' '.join(args.models)} --min-rows {args.min_rows} --max-rows {args.max_rows} "
            f"--runs {args.runs} --min-gain {args.min_gain}")
    for flag, value in (("--out", args.out), ("--table", args.table)):
        if value is not None:
            line += f" {flag} {value}"
    return line


def run_from_args(args, program: str) -> Path:
    """Check the options, sweep, write the CSV (``--out``) and the table (its ``commands`` name this
    run as ``program`` + the options); returns the table's path. ValueError names a bad option;
    RuntimeError says that a CUDA GPU is needed."""
    for preset in args.models:
        layer_products(preset)                                 # an unknown preset fails before any timing
    if not 0 < args.min_rows <= args.max_rows:
        raise ValueError(f"--min-rows {args.min_rows} / --max-rows {args.max_rows}: need 0 < min ≤ max")
    if not 0.0 <= args.min_gain < 1.0:
        raise ValueError(f"--min-gain {args.min_gain}: give a fraction in [0, 1), e.g. 0.05")
    if args.runs < 1:
        raise ValueError(f"--runs {args.runs}: need at least 1 replay per row count")
    if not torch.cuda.is_available():
        raise RuntimeError("the GEMM row sweep times cuBLAS on a CUDA GPU, and none is available here; run it on "
                           "the GPU whose table you want")
    rows, tables = run_sweep(args.models, args.min_rows, args.max_rows, args.runs, args.min_gain)
    if args.out is not None:
        write_csv(rows, args.out, log=print)
    table = args.table or user_table_dir() / file_name(torch.cuda.get_device_name(), torch.version.cuda)
    write_table(table, tables, command_line(program, args), args.min_gain)
    print(f"wrote {table} ({sum(len(t) for t in tables.values())} padded row counts)")
    return table


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sparsevar.benchmarks.bench_gemm_rows",
                                description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        run_from_args(args, "python -m sparsevar.benchmarks.bench_gemm_rows")
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"bench_gemm_rows: {e}") from None


if __name__ == "__main__":
    main()
