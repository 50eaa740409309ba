"""Programmatic dependent launch (sm_90+) for the chain of kernels a layer runs at few rows.

At VAR's first scales a layer is seven short launches — the four products (2–64 rows, this
package's GEMM), the attention step and two residual + norm steps — and at each border between
two of them the GPU drains: the next grid is set up only after the last program of the previous
one has finished. Launched with programmatic dependent launch (``launch_pdl``), a kernel may start
while the previous one still runs; ``PDL`` in the kernels below decides where:

- the short kernels (norms, attention, split-K sums) release the next launch at once and wait for
  the previous grid before they read anything;
- the products ask L2 for their first two reduction steps of weights (a prefetch: a hint that
  returns no data, and L2 is where global memory is coherent), wait before their first read, and
  release the next launch after their reduction loop, so the next (short) kernel is set up while
  their results are written.

Releasing a product's successor earlier, or prefetching more of its weights, measured slower
(benchmarks/results/README.md). ``griddepcontrol.wait`` returns once the whole previous grid has
finished and its writes are visible; that grid waited the same way on its own predecessor, so every
earlier result is visible after it. Nothing is read or written before the wait (the L2 prefetch
reads nothing into the program). ``_backend.dependent_launch`` says where these launches are used (a
CUDA GPU of sm_90 or newer, at most ``CHAIN_ROWS`` rows, never in Triton's interpreter); elsewhere
``PDL`` is False and the kernels are the plain ones.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def release_then_wait(PDL: tl.constexpr):
    """Top of a short chained kernel: let the next launch start, then wait for the previous grid."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next launch of the chain start (its programs wait for this grid before reading)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the previous grid has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, ok):
    """Ask L2 to fetch the lines at ``ptrs`` (one pointer per 128-byte line; ``ok`` False → skipped)."""
    addr = tl.where(ok, ptrs.to(tl.int64), 0)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s64 p, $1, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
