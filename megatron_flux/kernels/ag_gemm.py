"""AllGather + GEMM: ``C = AllGather_rows(x) @ B`` as one persistent TMA GEMM.

Tile and signal schedule (rank ``r`` of ``W``; see :mod:`.tile_order`):

* Output rows are split in ``W`` segments of ``m_local`` rows; segment ``s`` holds rank ``s``'s
  rows. Program ``p`` of the persistent grid takes flat tiles ``p, p + NUM_SMS, ...``.
* Step 0 is the local segment: its A tiles are read straight from the caller's shard ``x``
  (no copy, no wait), so the GEMM starts at once.
* Steps ``1..W-1`` visit segments ``r+1, r+2, ...`` (odd steps backwards, so a step starts on
  the B columns the previous one ended on: :func:`.tile_order.serpentine`). Their rows live
  in this rank's gathered workspace ``ag``, filled chunk by chunk (``chunk_rows`` rows, independent of ``BLOCK_M``) by
  the peers' copy engines, each chunk followed by a signal ``flags[s * chunks_per_seg + c] =
  epoch``. Before a step's tiles each program waits (acquire, bounded) on that segment's
  chunks, then fences so its TMA reads come after the acquire; the wait sits between the
  persistent tile loops so they stay flattened/pipelined. Up to TP 4 the step loop is
  unrolled at compile time (``WORLD`` is a constexpr), so each step's tile loop is a top-level
  loop; above, it is a runtime loop (:func:`~megatron_flux.kernels.config.unroll_steps`).
* Merged local rows (``GemmConfig.ag_merge_local``, opt-in; no faster at TP 2, m >= 1024): after
  ``ag_merge_lead`` waves of local tiles (whole columns, from the shard, no wait), the local
  segment and the first peer's share one tile space (:func:`_merged_local_group`), the local
  rows read from the workspace, where the host copied them before the kernel. The other
  peers' segments follow one at a time (:func:`_segment_after_merge`). Stream-K is off then.
  With a lead of 0 the kernel first waits for every peer's chunks, then walks the gathered
  rows ``[W * m_local, K]`` as one plain tile space (:func:`_gathered_tiles`): tiles may span
  segments, so at small m a B column tile is read once for every row instead of once per
  segment, by one tile instead of W half-empty ones.
* Epilogue: TMA store of the tile (clipped to the segment when ``m_local % BLOCK_M != 0``).
* Stream-K tail (``GemmConfig.stream_k``, :mod:`.stream_k`): the last ``sk_tiles`` flat tiles
  (the partial last wave, in the last step's segment) leave the data-parallel loops; after them
  every program takes an equal share of those tiles' K-iterations, and each tile is completed
  by the last of its programs to finish (fp32 partials summed in a fixed order). All waits for
  the peers' chunks have happened by then (every program waits for every step).

Nothing here issues communication: the host side (:mod:`megatron_flux.backends.flux`) queues
the chunk copies and signal writes on a side stream *after* this kernel, so the kernel never
waits on work queued behind it, also with ``CUDA_DEVICE_MAX_CONNECTIONS=1``.
"""

import triton
import triton.language as tl

from megatron_flux.kernels.config import interpreting, launch_geometry, unroll_steps
from megatron_flux.kernels.descriptors import b_descriptor, ensure_descriptor_allocator, \
    host_descriptor, segments_descriptor
from megatron_flux.kernels import ag_gemm_ws, stream_k
from megatron_flux.kernels.launch import KernelLauncher, LaunchPlan, ShapePlans
from megatron_flux.kernels.mainloop import split_columns, tile_mainloop, tile_mainloop_k
from megatron_flux.kernels.phase_trace import stamp
from megatron_flux.kernels.signals import fence_async_proxy, wait_signal
from megatron_flux.kernels.stream_k import launch_with_stream_k_fallback, sk_covering, \
    sk_publish_part, sk_range, sk_sum_parts, stream_k_fits, stream_k_plan, stream_k_scratch
from megatron_flux.kernels.tile_order import first_tile_at_or_after, grouped_tile, segment_of_step, \
    step_tile


#: what ``trace[program, slot]`` holds with TRACE (:mod:`.phase_trace`); "last_wait": after the
#: last peer step's wait and fence
AG_PHASES = ("start", "descriptors", "local_done", "last_wait", "peers_done", "end")


@triton.jit
def _ag_tile(a_desc, b_desc, c_desc, a_row, c_seg, c_row, off_n, k_tiles,
             RAGGED_A: tl.constexpr, RAGGED_C: tl.constexpr, B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile: K loop over A rows ``a_row`` (segment-relative when RAGGED_A) and store."""
    acc = tile_mainloop(a_desc, b_desc, c_seg, a_row, off_n, k_tiles, RAGGED_A, B_KN,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    _epilogue(c_desc, c_seg, c_row, off_n, acc, RAGGED_C, EPI_SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _epilogue(c_desc, c_seg, c_row, off_n, acc, RAGGED_C: tl.constexpr, EPI_SPLIT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Round the fp32 tile and store it (in two column halves with EPI_SPLIT=2)."""
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    if EPI_SPLIT == 2:
        acc0, acc1 = split_columns(acc, BLOCK_M, HALF)
        _store(c_desc, c_seg, c_row, off_n, acc0.to(c_desc.dtype), RAGGED_C, BLOCK_M, HALF)
        _store(c_desc, c_seg, c_row, off_n + HALF, acc1.to(c_desc.dtype), RAGGED_C, BLOCK_M, HALF)
    else:
        _store(c_desc, c_seg, c_row, off_n, acc.to(c_desc.dtype), RAGGED_C, BLOCK_M, BLOCK_N)


@triton.jit
def _store(c_desc, c_seg, c_row, off_n, c, RAGGED_C: tl.constexpr, BLOCK_M: tl.constexpr,
           WIDTH: tl.constexpr):
    if RAGGED_C:
        c_desc.store([c_seg, c_row, off_n], c.reshape(1, BLOCK_M, WIDTH))
    else:
        c_desc.store([c_row, off_n], c)


@triton.jit(do_not_specialize=["rank", "epoch", "max_spins", "sk_tiles"])
def ag_gemm_kernel(
    x_ptr, ag_ptr, b_ptr, c_ptr,
    flags_ptr, err_ptr, sk_partials_ptr, sk_counters_ptr, trace_ptr,
    m_local, N, K, ldb, rank, epoch, chunk_rows, max_spins, sk_tiles,
    WORLD: tl.constexpr, RAGGED: tl.constexpr, B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, STREAM_K: tl.constexpr,
    ASYNC_FENCE: tl.constexpr = True, SK_LOCAL: tl.constexpr = False,
    UNROLL_STEPS: tl.constexpr = True, TRACE: tl.constexpr = False,
    MERGE_LOCAL: tl.constexpr = False, MERGE_LEAD: tl.constexpr = 1, GATHERED: tl.constexpr = False,
    HOST_DESC: tl.constexpr = False,
):
    """Pointers: ``x`` [m_local, K], ``ag`` / ``c`` [WORLD * m_local, K / N] contiguous; ``b``
    [K, N] (B_KN) or [N, K], row stride ``ldb``. TMA descriptors are built on the device, once
    per program, or with HOST_DESC (below) arrive from the host in place of the pointers. With
    STREAM_K the last
    ``sk_tiles`` tiles run split along K through the scratch ``sk_partials`` / ``sk_counters``
    (:mod:`.stream_k`); without it ``sk_tiles`` is 0 and the scratch is not touched.
    ASYNC_FENCE: a proxy fence after each step's waits (off only under the interpreter, which
    has no inline assembly). UNROLL_STEPS: the peer-step loop unrolled at compile time (up to
    TP 4, :func:`~megatron_flux.kernels.config.unroll_steps`) or a runtime loop.
    TRACE: stamp the phases of :data:`AG_PHASES` into ``trace_ptr`` (:mod:`.phase_trace`).
    MERGE_LOCAL (WORLD >= 2): the local segment and the first peer's share one tile loop after
    MERGE_LEAD waves of local tiles (``GemmConfig.ag_merge_local``, :func:`_merged_local_group`),
    the local rows read from ``ag``, where the caller copied them before the kernel; the
    launcher turns stream-K off then, so ``sk_tiles`` is 0.
    GATHERED (MERGE_LOCAL with a lead of 0; the launcher passes RAGGED=False): one wait for
    every peer, then ``ag`` is one ``[WORLD * m_local, K]`` operand (:func:`_gathered_tiles`).
    HOST_DESC: ``x_ptr``, ``ag_ptr``, ``b_ptr`` and ``c_ptr`` are host-encoded TMA descriptors of
    the same views (:func:`_host_descriptors`) instead of pointers (:mod:`.descriptors`)."""
    stamp(trace_ptr, 0, TRACE)  # start
    x_desc = segments_descriptor(x_ptr, m_local, K, 1, BLOCK_M, BLOCK_K, False, HOST_DESC)
    ag_desc = segments_descriptor(ag_ptr, m_local, K, WORLD, BLOCK_M, BLOCK_K, RAGGED, HOST_DESC)
    c_desc = segments_descriptor(c_ptr, m_local, N, WORLD, BLOCK_M, BLOCK_N // EPI_SPLIT, RAGGED,
                                 HOST_DESC)
    b_desc = b_descriptor(b_ptr, N, K, ldb, B_KN, BLOCK_N, BLOCK_K, HOST_DESC)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(m_local, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_seg = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    chunks_per_seg = tl.cdiv(m_local, chunk_rows)
    dp_end = WORLD * tiles_per_seg - sk_tiles  # tiles before it are data-parallel
    stamp(trace_ptr, 1, TRACE)  # descriptors

    if GATHERED:
        stamp(trace_ptr, 2, TRACE)  # local_done (nothing local first)
        _gathered_tiles(ag_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch, max_spins,
                        m_local, N, chunks_per_seg, k_tiles, WORLD, B_KN, EPI_SPLIT, BLOCK_M,
                        BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, FLATTEN, WARP_SPECIALIZE, ASYNC_FENCE,
                        trace_ptr, TRACE)
    elif MERGE_LOCAL:
        # The local segment and the first peer's in one tile space, after a lead of local
        # tiles; the other peers follow below.
        _merged_local_group(x_desc, ag_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank,
                            epoch, max_spins, m_local, tiles_per_seg, chunks_per_seg, k_tiles,
                            num_pid_m, num_pid_n, WORLD, MERGE_LEAD, RAGGED, B_KN, EPI_SPLIT,
                            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, FLATTEN,
                            WARP_SPECIALIZE, ASYNC_FENCE, trace_ptr, TRACE)
    else:
        # Step 0: local rows, read from the caller's shard (no wait).
        _segment_step(0, x_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch, max_spins,
                      m_local, tiles_per_seg, chunks_per_seg, dp_end, k_tiles, num_pid_m, num_pid_n,
                      True, WORLD, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                      NUM_SMS, FLATTEN, WARP_SPECIALIZE, ASYNC_FENCE, trace_ptr, TRACE)
        stamp(trace_ptr, 2, TRACE)  # local_done

    # Steps 1..WORLD-1: peers' rows in ring order, from the gathered workspace. Up to TP 4 the
    # step loop is unrolled (WORLD is a compile-time constant), so every tile loop sits at the
    # top level of the kernel: nested in a runtime step loop they ran 1-3 % slower at TP 2 with
    # communication disabled. At TP 8 the seven unrolled copies quadruple the code, and a
    # runtime loop ran up to 9-11 % faster (config.MAX_UNROLLED_WORLD).
    if GATHERED:
        pass  # every row was walked above
    elif not MERGE_LOCAL:
        if UNROLL_STEPS:
            for step in tl.static_range(1, WORLD):
                _segment_step(step, ag_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch,
                              max_spins, m_local, tiles_per_seg, chunks_per_seg, dp_end, k_tiles,
                              num_pid_m, num_pid_n, False, WORLD, RAGGED, B_KN, EPI_SPLIT,
                              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, FLATTEN,
                              WARP_SPECIALIZE, ASYNC_FENCE, trace_ptr, TRACE)
        else:
            for step in range(1, WORLD):
                _segment_step(step, ag_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch,
                              max_spins, m_local, tiles_per_seg, chunks_per_seg, dp_end, k_tiles,
                              num_pid_m, num_pid_n, False, WORLD, RAGGED, B_KN, EPI_SPLIT,
                              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, FLATTEN,
                              WARP_SPECIALIZE, ASYNC_FENCE, trace_ptr, TRACE)
    else:
        # steps 2..WORLD-1 after the merged one (step 1, walked above), a segment at a time
        if UNROLL_STEPS:
            for step in tl.static_range(2, WORLD):
                _segment_after_merge(step, ag_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank,
                                     epoch, max_spins, m_local, tiles_per_seg, chunks_per_seg,
                                     dp_end, k_tiles, num_pid_m, num_pid_n, WORLD, RAGGED, B_KN,
                                     EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS,
                                     FLATTEN, WARP_SPECIALIZE, ASYNC_FENCE, trace_ptr, TRACE)
        else:
            for step in range(2, WORLD):
                _segment_after_merge(step, ag_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank,
                                     epoch, max_spins, m_local, tiles_per_seg, chunks_per_seg,
                                     dp_end, k_tiles, num_pid_m, num_pid_n, WORLD, RAGGED, B_KN,
                                     EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS,
                                     FLATTEN, WARP_SPECIALIZE, ASYNC_FENCE, trace_ptr, TRACE)

    stamp(trace_ptr, 4, TRACE)  # peers_done
    if STREAM_K:
        _stream_k_tiles(x_desc, ag_desc, b_desc, c_desc, sk_partials_ptr, sk_counters_ptr, pid,
                        dp_end, sk_tiles, tiles_per_seg, k_tiles, m_local, num_pid_m, num_pid_n,
                        rank, WORLD, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                        NUM_SMS, SK_LOCAL)
    stamp(trace_ptr, 5, TRACE)  # end


@triton.jit
def _wait_segment(seg, flags_ptr, err_ptr, rank, epoch, max_spins, chunks_per_seg):
    """Wait (acquire, bounded) for every chunk signal of segment ``seg``:
    ``flags[seg * chunks_per_seg + c] >= epoch``."""
    for c in range(chunks_per_seg):
        idx = seg * chunks_per_seg + c
        wait_signal(flags_ptr + idx, epoch, max_spins, err_ptr, 1, rank, idx)  # OP_AG_GEMM


@triton.jit
def _workspace_tile(v, s0, pid_n, a_desc, b_desc, c_desc, rank, m_local, k_tiles, num_pid_m,
                    WORLD: tl.constexpr, RAGGED: tl.constexpr, B_KN: tl.constexpr,
                    EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """The output tile of virtual row tile ``v`` (row tile ``v % num_pid_m`` of the segment of
    step ``s0 + v // num_pid_m``) and column tile ``pid_n``, A read from the workspace."""
    j = v // num_pid_m
    seg = segment_of_step(s0 + j, rank, WORLD, False)
    off_m = (v - j * num_pid_m) * BLOCK_M
    if RAGGED:
        c_row = off_m
    else:
        c_row = seg * m_local + off_m
    _ag_tile(a_desc, b_desc, c_desc, c_row, seg, c_row, pid_n * BLOCK_N, k_tiles, RAGGED, RAGGED,
             B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _segment_step(step, a_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch, max_spins,
                  m_local, tiles_per_seg, chunks_per_seg, dp_end, k_tiles, num_pid_m, num_pid_n,
                  LOCAL: tl.constexpr, WORLD: tl.constexpr, RAGGED: tl.constexpr,
                  B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                  ASYNC_FENCE: tl.constexpr, trace_ptr, TRACE: tl.constexpr):
    """This program's tiles of one step's segment, backwards on odd steps. LOCAL (step 0): A is
    the caller's shard ``a_desc`` = ``[m_local, K]``, nothing to wait for. Else A is the
    gathered workspace: first wait once (acquire, bounded) for every chunk of the segment,
    outside the tile loop, which stays a clean pipelined persistent loop (with every peer
    pushing from time zero, a segment lands long before a program reaches it)."""
    if LOCAL:
        seg = rank
        first = pid
    else:
        seg = segment_of_step(step, rank, WORLD, False)
        _wait_segment(seg, flags_ptr, err_ptr, rank, epoch, max_spins, chunks_per_seg)
        fence_async_proxy(epoch, ASYNC_FENCE)  # the TMA reads below come after the acquire
        stamp(trace_ptr, 3, TRACE)  # last_wait
        first = first_tile_at_or_after(pid, step * tiles_per_seg, NUM_SMS)
    for t in tl.range(first, tl.minimum((step + 1) * tiles_per_seg, dp_end), NUM_SMS,
                      flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = step_tile(t, step, tiles_per_seg, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        if RAGGED:
            c_row = off_m
        else:
            c_row = seg * m_local + off_m
        if LOCAL:  # the shard holds only this rank's rows
            _ag_tile(a_desc, b_desc, c_desc, off_m, seg, c_row, pid_n * BLOCK_N, k_tiles,
                     False, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            _ag_tile(a_desc, b_desc, c_desc, c_row, seg, c_row, pid_n * BLOCK_N, k_tiles,
                     RAGGED, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _segment_after_merge(step, a_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch,
                         max_spins, m_local, tiles_per_seg, chunks_per_seg, dp_end, k_tiles,
                         num_pid_m, num_pid_n, WORLD: tl.constexpr, RAGGED: tl.constexpr,
                         B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
                         WARP_SPECIALIZE: tl.constexpr, ASYNC_FENCE: tl.constexpr, trace_ptr,
                         TRACE: tl.constexpr):
    """Merged local rows, step ``step >= 2``: the segment of a peer after the merged one. First
    one wait (acquire, bounded) for every chunk of the segment and a fence; then its flat tiles
    ``[step * tiles_per_seg, (step + 1) * tiles_per_seg)``, GROUP_M-grouped, backwards on even
    steps, so each step starts on the B columns the previous loop ended on (the merged loop of
    steps 0 and 1 runs forwards)."""
    _wait_segment(segment_of_step(step, rank, WORLD, False), flags_ptr, err_ptr, rank, epoch,
                  max_spins, chunks_per_seg)
    fence_async_proxy(epoch, ASYNC_FENCE)  # the TMA reads below come after the acquires
    stamp(trace_ptr, 3, TRACE)  # last_wait
    base = step * tiles_per_seg
    first = first_tile_at_or_after(pid, base, NUM_SMS)
    for t in tl.range(first, tl.minimum(base + tiles_per_seg, dp_end), NUM_SMS, flatten=FLATTEN,
                      warp_specialize=WARP_SPECIALIZE):
        q = t - base
        q = tl.where(step % 2 == 0, tiles_per_seg - 1 - q, q)
        v, pid_n = grouped_tile(q, num_pid_m, num_pid_n, GROUP_M)
        _workspace_tile(v, step, pid_n, a_desc, b_desc, c_desc, rank, m_local, k_tiles, num_pid_m,
                        WORLD, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _gathered_tiles(a_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch, max_spins,
                    m_local, N, chunks_per_seg, k_tiles, WORLD: tl.constexpr, B_KN: tl.constexpr,
                    EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                    ASYNC_FENCE: tl.constexpr, trace_ptr, TRACE: tl.constexpr):
    """Merged local rows with a lead of 0: wait (acquire, bounded) for every chunk of every
    peer, in ring order, then fence; then the gathered workspace (the own rows copied there by
    the host before the kernel) is one ``[WORLD * m_local, K]`` operand and the output one
    ``[WORLD * m_local, N]``: ``cdiv(WORLD * m_local, BLOCK_M)`` row tiles by ``cdiv(N,
    BLOCK_N)`` column tiles, GROUP_M-grouped, 2-D descriptors (a tile may span segments; the
    last row tile is clipped at ``WORLD * m_local``). No tile runs before the last wait: this
    is for small m, where the copies take microseconds and each segment's own tile loop would
    stream all of B again, with row tiles mostly empty when ``m_local < BLOCK_M``."""
    for step in range(1, WORLD):
        _wait_segment(segment_of_step(step, rank, WORLD, False), flags_ptr, err_ptr, rank, epoch,
                      max_spins, chunks_per_seg)
    fence_async_proxy(epoch, ASYNC_FENCE)  # the TMA reads below come after the acquires
    stamp(trace_ptr, 3, TRACE)  # last_wait
    num_pid_m = tl.cdiv(WORLD * m_local, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for t in tl.range(pid, num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN,
                      warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        row = pid_m * BLOCK_M
        _ag_tile(a_desc, b_desc, c_desc, row, 0, row, pid_n * BLOCK_N, k_tiles, False, False,
                 B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _merged_local_group(x_desc, ag_desc, b_desc, c_desc, flags_ptr, err_ptr, pid, rank, epoch,
                        max_spins, m_local, tiles_per_seg, chunks_per_seg, k_tiles, num_pid_m,
                        num_pid_n, WORLD: tl.constexpr, MERGE_LEAD: tl.constexpr,
                        RAGGED: tl.constexpr, B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr,
                        BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
                        WARP_SPECIALIZE: tl.constexpr, ASYNC_FENCE: tl.constexpr, trace_ptr,
                        TRACE: tl.constexpr):
    """Steps 0 and 1 (the local segment and the first peer's) as one tile space of
    ``2 * num_pid_m`` virtual row tiles (``v < num_pid_m``: local rows; then the peer's) by
    ``num_pid_n`` column tiles; flat tiles ``[0, 2 * tiles_per_seg)`` of the persistent walk,
    in three parts:

    * lead: the local rows of the first ``lead_cols`` columns (``MERGE_LEAD`` waves of the
      grid), from the caller's shard, no wait;
    * one wait (acquire, bounded) for every chunk of the peer's segment, then a fence;
    * the peer's rows of the lead columns, then every row of the remaining columns, row tiles
      grouped ``GROUP_M`` at a time across the two segments, all read from the workspace
      ``ag`` (the local rows: copied there by the host before the kernel, in stream order).

    So where a segment has fewer row tiles than ``GROUP_M``, a B column tile is read for both
    segments' rows at once instead of once per segment. Tiles run forwards; the next step runs
    backwards (:func:`_segment_after_merge`)."""
    rows = 2 * num_pid_m
    lead_cols = tl.minimum(num_pid_n, tl.cdiv(MERGE_LEAD * NUM_SMS, num_pid_m))
    lead_tiles = num_pid_m * lead_cols
    for t in tl.range(pid, lead_tiles, NUM_SMS, flatten=FLATTEN,
                      warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(t, num_pid_m, lead_cols, GROUP_M)
        off_m = pid_m * BLOCK_M
        if RAGGED:
            c_row = off_m
        else:
            c_row = rank * m_local + off_m
        _ag_tile(x_desc, b_desc, c_desc, off_m, rank, c_row, pid_n * BLOCK_N, k_tiles, False,
                 RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    stamp(trace_ptr, 2, TRACE)  # local_done (the lead)

    _wait_segment(segment_of_step(1, rank, WORLD, False), flags_ptr, err_ptr, rank, epoch,
                  max_spins, chunks_per_seg)
    fence_async_proxy(epoch, ASYNC_FENCE)  # the TMA reads below come after the acquire
    stamp(trace_ptr, 3, TRACE)  # last_wait

    peer_rows = num_pid_m
    rest_cols = num_pid_n - lead_cols
    lead_peer_tiles = peer_rows * lead_cols
    first = first_tile_at_or_after(pid, lead_tiles, NUM_SMS)
    for t in tl.range(first, 2 * tiles_per_seg, NUM_SMS, flatten=FLATTEN,
                      warp_specialize=WARP_SPECIALIZE):
        u = t - lead_tiles
        in_lead = u < lead_peer_tiles
        # both mappings are computed (the unused one on a clamped index) and one is selected
        v_a, n_a = grouped_tile(tl.minimum(u, tl.maximum(lead_peer_tiles - 1, 0)), peer_rows,
                                tl.maximum(lead_cols, 1), GROUP_M)
        v_b, n_b = grouped_tile(tl.maximum(u - lead_peer_tiles, 0), rows,
                                tl.maximum(rest_cols, 1), GROUP_M)
        v = tl.where(in_lead, num_pid_m + v_a, v_b)
        pid_n = tl.where(in_lead, n_a, lead_cols + n_b)
        _workspace_tile(v, 0, pid_n, ag_desc, b_desc, c_desc, rank, m_local, k_tiles, num_pid_m,
                        WORLD, RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _stream_k_tiles(x_desc, ag_desc, b_desc, c_desc, partials_ptr, counters_ptr, pid, dp_end,
                    sk_tiles, tiles_per_seg, k_tiles, m_local, num_pid_m, num_pid_n, rank, world,
                    RAGGED: tl.constexpr, B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, SK_LOCAL: tl.constexpr):
    """This program's share of the stream-K tiles ``dp_end ..``: K-iterations ``[it, end)``
    (see :mod:`.stream_k`), one tile part at a time."""
    it, end, per = sk_range(pid, sk_tiles, k_tiles, NUM_SMS)
    while it < end:
        u = it // k_tiles  # stream-K tile index
        k_lo = it - u * k_tiles
        k_hi = tl.minimum(end - u * k_tiles, k_tiles)
        t = dp_end + u
        step = t // tiles_per_seg
        seg = segment_of_step(step, rank, world, False)
        pid_m, pid_n = step_tile(t, step, tiles_per_seg, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if RAGGED:
            row = off_m
        else:
            row = seg * m_local + off_m
        if SK_LOCAL:  # world == 1: the one segment is the caller's shard
            acc = tile_mainloop_k(x_desc, b_desc, seg, off_m, off_n, k_lo, k_hi, False, B_KN,
                                  BLOCK_M, BLOCK_N, BLOCK_K)
        else:  # the last step's segment (stream_k_plan keeps them there)
            acc = tile_mainloop_k(ag_desc, b_desc, seg, row, off_n, k_lo, k_hi, RAGGED, B_KN,
                                  BLOCK_M, BLOCK_N, BLOCK_K)
        first, last = sk_covering(u, per, k_tiles)
        if first == last:  # the whole tile is this program's
            _epilogue(c_desc, seg, row, off_n, acc, RAGGED, EPI_SPLIT, BLOCK_M, BLOCK_N)
        elif sk_publish_part(acc, partials_ptr, counters_ptr, pid, u, per, k_tiles, first, last,
                             BLOCK_M, BLOCK_N):
            tile = sk_sum_parts(partials_ptr, counters_ptr, u, per, k_tiles, first, last,
                                BLOCK_M, BLOCK_N)
            _epilogue(c_desc, seg, row, off_n, tile, RAGGED, EPI_SPLIT, BLOCK_M, BLOCK_N)
        it = (u + 1) * k_tiles


def _host_descriptors(x, ag, b, out, world, m_local, n, k, ldb, b_kn, ragged, cfg):
    """``(x, ag, b, out)`` as host TMA descriptors of the views :func:`ag_gemm_kernel` builds
    on the device without HOST_DESC."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    x_desc = host_descriptor(x, [m_local, k], [k, 1], [bm, bk])
    if ragged:
        ag_desc = host_descriptor(ag, [world, m_local, k], [m_local * k, k, 1], [1, bm, bk])
        c_desc = host_descriptor(out, [world, m_local, n], [m_local * n, n, 1],
                                 [1, bm, bn // cfg.epilogue_split])
    else:
        ag_desc = host_descriptor(ag, [world * m_local, k], [k, 1], [bm, bk])
        c_desc = host_descriptor(out, [world * m_local, n], [n, 1], [bm, bn // cfg.epilogue_split])
    if b_kn:
        b_desc = host_descriptor(b, [k, n], [ldb, 1], [bk, bn])
    else:
        b_desc = host_descriptor(b, [n, k], [ldb, 1], [bn, bk])
    return x_desc, ag_desc, b_desc, c_desc


def launch_ag_gemm(x, ag, b, out, flags, err, *, rank, world, epoch, cfg, num_sms, max_spins,
                   trace=None, host_descriptors=True, direct=True):
    """Launch :func:`ag_gemm_kernel` on the current stream.

    ``x`` ``[m_local, K]`` this rank's rows; ``ag`` ``[world * m_local, K]`` the gathered
    workspace (peers' rows land there); ``b`` ``[K, N]`` row-major or a transposed row-major
    ``[N, K]``; ``out`` ``[world * m_local, N]``; ``flags`` int32 chunk signals; ``err`` int32[4].
    With ``cfg.ag_merge_local`` (and ``world > 1``) the kernel also reads this rank's own rows
    from ``ag``: the caller must have copied them there, in stream order before the kernel.
    ``trace``: an int64 ``[grid, TRACE_SLOTS]`` buffer to stamp :data:`AG_PHASES` into (a
    diagnostic build of the kernel; :mod:`.phase_trace`). With ``cfg.ag_warp_specialized`` a
    call the Gluon kernel can take runs there (:mod:`.ag_gemm_ws`). ``host_descriptors``: the
    TMA descriptors encoded on the host; ``direct``: past Triton's argument binding
    (:mod:`.launch`).
    """
    m_local, k = x.shape
    n = b.shape[1]
    if cfg.ag_warp_specialized:
        reason = ag_gemm_ws.unsupported_reason(x, cfg, trace=trace)
        if reason is None:
            return ag_gemm_ws.launch_ag_gemm_ws(x, ag, b, out, flags, err, rank=rank, world=world,
                                                epoch=epoch, cfg=cfg, num_sms=num_sms,
                                                max_spins=max_spins,
                                                host_descriptors=host_descriptors, direct=direct)
        ag_gemm_ws.warn_fallback(reason)
    host_desc = bool(host_descriptors)
    key = (m_local, n, k, b.stride(0), b.stride(1), world, id(cfg), num_sms, trace is None,
           host_desc, interpreting(), stream_k.fallback_generation())
    plan = _PLANS.get(key, cfg, lambda: _launch_plan(m_local, n, b, world, cfg, num_sms,
                                                     traced=trace is not None,
                                                     host_desc=host_desc))
    grid, sk_tiles = plan.grid, plan.sk_tiles

    def launch():
        if sk_tiles:
            scratch = stream_k_scratch(x.device, grid, cfg.block_m, cfg.block_n)
            partials, counters = scratch.partials, scratch.counters
        else:
            partials, counters = err, err  # never touched
        if host_desc:
            x_arg, ag_arg, b_arg, out_arg = _host_descriptors(
                x, ag, b, out, world, m_local, n, k, plan.ldb, plan.b_kn, plan.ragged, cfg)
        else:
            x_arg, ag_arg, b_arg, out_arg = x, ag, b, out
        args = (x_arg, ag_arg, b_arg, out_arg, flags, err, partials, counters,
                trace if trace is not None else err, m_local, n, k, plan.ldb, rank, epoch,
                cfg.chunk_rows, max_spins, sk_tiles)
        _LAUNCH(grid, args, plan.constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                direct=direct)

    ensure_descriptor_allocator()
    launch_with_stream_k_fallback(
        "AG+GEMM", cfg, launch,
        lambda: launch_ag_gemm(x, ag, b, out, flags, err, rank=rank, world=world, epoch=epoch,
                               cfg=cfg, num_sms=num_sms, max_spins=max_spins, trace=trace,
                               host_descriptors=host_desc, direct=direct),
        lambda: sk_tiles > 0)


def _launch_plan(m_local, n, b, world, cfg, num_sms, *, traced, host_desc) -> LaunchPlan:
    merge = world > 1 and cfg.ag_merge_local  # the local rows are read from `ag` too
    gathered = merge and cfg.ag_merge_lead == 0  # ... as one operand with the peers' rows
    # stream-K's tiles follow the per-segment order: off when the segments are merged
    mode = 0 if not stream_k_fits("AG+GEMM", cfg) or merge else cfg.stream_k
    geo = launch_geometry(m_local, n, b, world, cfg, num_sms, merged=gathered)
    grid, sk_tiles = stream_k_plan(geo.tiles, num_sms, mode, geo.tiles_per_segment)
    ragged = geo.ragged and not gathered
    constexprs = dict(
        WORLD=world, RAGGED=ragged, B_KN=geo.b_kn,
        EPI_SPLIT=cfg.epilogue_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        NUM_SMS=grid, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
        STREAM_K=sk_tiles > 0, ASYNC_FENCE=not interpreting(),
        SK_LOCAL=sk_tiles > 0 and world == 1, UNROLL_STEPS=unroll_steps(world),
        TRACE=traced, MERGE_LOCAL=merge,
        MERGE_LEAD=cfg.ag_merge_lead, GATHERED=gathered, HOST_DESC=host_desc)
    return LaunchPlan(grid, sk_tiles, ragged, geo.b_kn, geo.ldb, constexprs)


_PLANS = ShapePlans()
_LAUNCH = KernelLauncher(ag_gemm_kernel)
