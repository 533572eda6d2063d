"""Rank-swizzled tile schedules.

Both fused kernels split the ``[M, N]`` output, ``M = world * m_local``, into *segments* of
``m_local`` rows (one per owning rank). Each segment is tiled on its own, ``cdiv(m_local, BM)``
row-tiles by ``cdiv(N, BN)`` column-tiles, so a tile never spans two ranks and any ``m_local``
works (the last row-tile of a segment is clipped by the TMA descriptor).

A flat tile index ``t`` in ``[0, world * tiles_per_seg)`` is walked by a persistent grid
(program ``p`` takes ``t = p, p + NUM_SMS, ...``); ``t // tiles_per_seg`` is the *step* and
selects the segment, ``t % tiles_per_seg`` is grouped GROUP_M-wise inside it for L2 reuse.
Odd steps walk their segment backwards (:func:`serpentine`): every step sweeps all of B, and
the next step then starts on the B columns the previous one ended on, still in L2.

* AllGather+GEMM visits segments ``rank, rank+1, ..., rank-1`` (local rows first, they need no
  communication; then ring order, the order in which peers' chunks arrive).
* GEMM+ReduceScatter visits ``rank+1, ..., rank-1, rank`` (rows owned by other ranks first so
  their partials are pushed early; the own segment last, when the peers' partials are there).

At every step the ranks address pairwise distinct segments, so no two ranks contend for one
peer's link in the same phase.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a flat tile index inside one segment to ``(pid_m, pid_n)``, GROUP_M rows at a time."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = t // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (t % group_size_m)
    pid_n = (t % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def serpentine(t, step, tiles_per_seg):
    """Index inside its segment (in :func:`grouped_tile` order) of flat tile ``t``, visited at
    ``step``: odd steps run backwards, so a step's first tiles share their B columns with the
    previous step's last ones. With GROUP_M >= the segment's row tiles (small ``m_local``)
    every step reads all of B, which is larger than L2 on the small-m shapes; this turns the
    seam's reads into L2 hits."""
    t_in_seg = t - step * tiles_per_seg
    return tl.where(step % 2 == 1, tiles_per_seg - 1 - t_in_seg, t_in_seg)


@triton.jit
def step_tile(t, step, tiles_per_seg, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` inside its segment of flat tile ``t``, visited at ``step``."""
    return grouped_tile(serpentine(t, step, tiles_per_seg), num_pid_m, num_pid_n, GROUP_M)


@triton.jit
def segment_of_step(step, rank, world, OWN_LAST: tl.constexpr):
    """Segment (owning rank) visited at ``step``: own first (AG) or own last (RS)."""
    if OWN_LAST:
        return (rank + 1 + step) % world
    else:
        return (rank + step) % world


@triton.jit
def first_tile_at_or_after(pid, start, NUM_SMS: tl.constexpr):
    """Smallest ``t >= start`` with ``t % NUM_SMS == pid`` (``pid < NUM_SMS``)."""
    return pid + tl.cdiv(tl.maximum(start - pid, 0), NUM_SMS) * NUM_SMS


@triton.jit
def row_turn(t, tiles_per_seg, num_pid_m, num_pid_n, GROUP_M: tl.constexpr, WORLD: tl.constexpr):
    """GEMM+RS's row groups in turn (``rs_row_turns``): flat tile ``t``'s ``(step, index inside
    its segment in grouped_tile order)``, the segments' row groups (``GROUP_M`` row tiles, every
    column) one after another, each the peers' steps' tiles of it (steps ``0..WORLD-2``), then
    the own step's. No serpentine: a step of one group is short."""
    group = GROUP_M * num_pid_n
    whole = (num_pid_m // GROUP_M) * group  # a segment's tiles in whole row groups
    if t < WORLD * whole:
        step = (t % (WORLD * group)) // group
        local = (t // (WORLD * group)) * group + t % group
    else:  # the last, shorter group
        rest = tiles_per_seg - whole
        step = (t - WORLD * whole) // rest
        local = whole + (t - WORLD * whole) % rest
    return step, local


@triton.jit
def tile_order_probe_kernel(
    out_ptr, rank, world, num_pid_m, num_pid_n,
    OWN_LAST: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    ROW_TURNS: tl.constexpr = False, WORLD: tl.constexpr = 0,
):
    """Test aid: write ``(step, segment, pid_m, pid_n, program)`` for every tile each program
    visits, in visit order, to ``out_ptr[t]`` (5 int32 per tile) — the same walk the kernels do
    (with ROW_TURNS, :func:`row_turn`'s, for ``WORLD`` = ``world``)."""
    pid = tl.program_id(0)
    tiles_per_seg = num_pid_m * num_pid_n
    total = world * tiles_per_seg
    for t in range(pid, total, NUM_SMS):
        if ROW_TURNS:
            step, local = row_turn(t, tiles_per_seg, num_pid_m, num_pid_n, GROUP_M, WORLD)
            pid_m, pid_n = grouped_tile(local, num_pid_m, num_pid_n, GROUP_M)
        else:
            step = t // tiles_per_seg
            pid_m, pid_n = step_tile(t, step, tiles_per_seg, num_pid_m, num_pid_n, GROUP_M)
        seg = segment_of_step(step, rank, world, OWN_LAST)
        base = out_ptr + t * 5
        tl.store(base + 0, step)
        tl.store(base + 1, seg)
        tl.store(base + 2, pid_m)
        tl.store(base + 3, pid_n)
        tl.store(base + 4, pid)
