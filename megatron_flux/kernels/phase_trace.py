"""Per-program phase timestamps inside the fused kernels (a diagnostic, off in production).

With the constexpr ``TRACE`` on, a kernel calls :func:`stamp` at fixed points of its schedule
(the kernels name them in ``*_PHASES``); each call stores the GPU's nanosecond
``%globaltimer`` at ``trace[program, slot]`` (int64, ``[grid, TRACE_SLOTS]``). Slots a program
never reaches keep whatever the caller filled in (``-1`` by :func:`new_trace`). With ``TRACE``
off (every production launch) :func:`stamp` compiles to nothing: the kernels' PTX is the same
as without it.

Why: with communication disabled the fused kernels run 1-6 % behind a plain persistent GEMM of
the same tile at some shapes, and the kernel-level timings cannot say which phase of the
schedule (descriptors, producer loop, grid barrier, wait, reduction epilogue) costs it.
``benchmarks/experiments/phase_trace.py`` turns the stamps into a per-phase timeline.

``%globaltimer`` is one clock for every SM, so stamps of different programs compare. Its
update granularity is a property of the GPU and driver (the summary reports the smallest
non-zero step it saw); a stamp costs a few instructions and one store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: timestamp slots per program (the kernels use the first few)
TRACE_SLOTS = 8


@triton.jit
def stamp(trace_ptr, slot, TRACE: tl.constexpr):
    """Store ``%globaltimer`` at ``trace[program_id, slot]`` when TRACE (else nothing)."""
    if TRACE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(trace_ptr + tl.program_id(0) * 8 + slot, now)  # 8 == TRACE_SLOTS


def new_trace(grid: int, device) -> torch.Tensor:
    """A ``[grid, TRACE_SLOTS]`` int64 trace buffer, every slot ``-1`` (never stamped)."""
    return torch.full((grid, TRACE_SLOTS), -1, dtype=torch.int64, device=device)
