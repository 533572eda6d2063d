"""GEMM + ReduceScatter: ``out = ReduceScatter_rows(A @ B) (+ bias)`` as one persistent TMA GEMM.

Tile and signal schedule (rank ``r`` of ``W``; see :mod:`.tile_order`):

* The partial product's rows are split in ``W`` segments of ``m_local`` rows; segment ``s`` is
  owned by rank ``s``. Program ``p`` of the persistent grid (``G`` programs) takes tiles
  ``p, p + G, ...`` of each step; odd steps walk their segment backwards, so a step starts on
  the B columns the previous one ended on (:func:`.tile_order.serpentine`).
* Producer, steps ``0..W-2``: the peers' segments ``r+1, r+2, ...`` (each rank hits a different
  owner at each step), one flattened, pipelined tile loop per step (the step loop unrolled up
  to TP 4, a runtime loop above: :func:`~megatron_flux.kernels.config.unroll_steps`).
  Epilogue = the *write* of ReduceScatter: the tile is rounded to the output dtype and stored
  straight into the owner's symmetric buffer, slot ``r`` (``data[owner][r, rows, cols]``), by
  TMA (``rs_tma_push``) or vector stores.
* Signals: after its last producer step every program drains its stores and counts itself in
  at ``flags[r][W]``; the last of the ``G`` programs raises ``flags[owner][r] = epoch``
  (release, system scope) for every peer owner. One barrier for all steps: an owner needs
  every peer's partial, and the peer that visits it last raises it at the end of its producer
  phase whichever way, so per-step signals made no owner ready sooner and cost each program a
  store drain and a barrier per step (seven at TP 8). Nothing synchronises inside the loops.
  (A schedule that raised a signal per pushed tile and waited per tile had its release in the
  loop, which then could not be flattened; measured against this one, it ran 2.3-3.7x slower
  flattened.)
* Copy-engine push (``rs_copy_engine``, CE_PUSH): the producer's "owner's slot" is a local
  staging area per step (the host hands a table whose entries point there), so no SM store
  crosses NVLink; the last program raises only this rank's ``flags[r][W+1]`` ("produced"). A
  copy-engine stream, queued behind a stream wait for that word, copies each step's partial
  into its owner's slot ``r`` and then writes ``flags[owner][r] = epoch``; the consumer below
  is unchanged. With the spread reduction the own step's partial stays local and the kernel
  raises the own signal itself.
* Consumer, step ``W-1``: the own segment. Each program computes its first own tile's GEMM, then
  waits once (acquire, bounded) for every peer's ``flags[r][src]``, then runs the rest of its
  tiles without waits. Epilogue = the *reduction*: the fp32 accumulator
  plus the peers' pushed partials in fixed rank order ``0..W-1``, bias once, TMA store to
  ``out``. The fixed order makes results bitwise identical run to run.
* Stream-K tail (``GemmConfig.stream_k``, :mod:`.stream_k`): when the partial last wave is
  small it lies in the own segment (the last step); its ``sk_tiles`` tiles leave the consumer
  loop, and after it every program takes an equal share of their K-iterations. A tile's last
  program to finish sums the fp32 parts in program order, waits (bounded) for the peers'
  signals if it has not yet, and runs the reduction epilogue on the sum, so results stay
  bitwise repeatable. Nobody waits for anybody's part.
* Spread reduction (``rs_spread_reduce``): the own segment is a producer step too (step
  ``W-1``, pushed into the own slot, the own signal raised with the peers'), and after the
  grid barrier every program waits for all ``W`` signals and sums the ``W`` slots of a share of
  the own rows (:func:`_spread_reduce`). For few own tiles (TP 8, small m: 16 of 128 programs
  would each read seven peer tiles) the whole grid shares the reads.

* Merged rows (``rs_merge_rows``, MERGE_ROWS; with the spread reduction): no steps. One tile
  loop walks every rank's rows, ``[W * m_local, K]``, as one GROUP_M-grouped tile space, so a
  row tile may span owners; its epilogue stores each owner's rows into that owner's slot
  ``r`` (the own rows into the own slot) by masked vector stores (:func:`_push_rows`), and the
  grid barrier and the spread reduction follow as above. For small m, where each segment is
  one mostly empty row of tiles.

Waiting for a peer's whole step costs little makespan: programs that finish producing early
would only start their reduction tiles early, the last producer program also finishes its
reduction last, and when the grid covers every tile in one wave the first own tile's GEMM runs
beside the peers' producers before the wait. Every rank computes the others' rows first, so the partials have normally
landed before the owner reaches its reduction.

Workspace slots and signals alternate between two parities from call to call (chosen by the
host), so a rank racing one call ahead never overwrites partials its owner has not consumed
yet; signals hold epochs and are never reset (the arrival counter is reset by its last
arrival).
"""

import triton
import triton.language as tl

from megatron_flux.kernels.config import interpreting, launch_geometry, unroll_steps
from megatron_flux.kernels.descriptors import b_descriptor, ensure_descriptor_allocator, \
    host_descriptor, segments_descriptor
from megatron_flux.kernels import gemm_rs_ws, stream_k
from megatron_flux.kernels.launch import KernelLauncher, LaunchPlan, ShapePlans
from megatron_flux.kernels.mainloop import segment_tile, split_columns, tile_mainloop, \
    tile_mainloop_k
from megatron_flux.kernels.phase_trace import stamp
from megatron_flux.kernels.signals import arrive_at_grid_barrier, fence_async_proxy, \
    release_fence, wait_signal
from megatron_flux.kernels.stream_k import launch_with_stream_k_fallback, sk_covering, \
    sk_publish_part, sk_range, sk_sum_parts, stream_k_fits, stream_k_plan, stream_k_scratch
from megatron_flux.kernels.tile_order import first_tile_at_or_after, grouped_tile, segment_of_step, \
    serpentine


#: what ``trace[program, slot]`` holds with TRACE (:mod:`.phase_trace`); a program stamps
#: "own_gemm" .. "first_reduced" only if it has an own tile (epilogue reduction), "waited" also
#: in the spread reduction
RS_PHASES = ("start", "descriptors", "produced", "arrived", "own_gemm", "waited", "first_reduced",
             "end")


@triton.jit
def _tile_ptrs(base, slot_base, off_m, off_n, m_local, N, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Pointers and mask of a ``[BLOCK_M, WIDTH]`` tile of the ``[m_local, N]`` slot at
    ``base + slot_base``: one 64-bit scalar base, 32-bit offsets inside the tile (whole-tile
    64-bit offsets cost the consumer spilled registers)."""
    rows = tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, WIDTH)
    ptrs = (base + slot_base + off_m.to(tl.int64) * N) + (rows[:, None] * N + cols[None, :])
    mask = ((off_m + rows)[:, None] < m_local) & (cols[None, :] < N)
    return ptrs, mask


@triton.jit
def _push_part(part, dst, dst_desc, slot_base, off_m, off_n, m_local, N, TMA_PUSH: tl.constexpr,
               BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Round ``part`` and store it into the owner's slot, by TMA or by masked vector stores."""
    if TMA_PUSH:
        dst_desc.store([off_m, off_n], part.to(dst_desc.dtype))
    else:
        ptrs, mask = _tile_ptrs(dst, slot_base, off_m, off_n, m_local, N, BLOCK_M, WIDTH)
        tl.store(ptrs, part.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _push_rows(acc, data_ptr, data_ptrs, slot_base, row0, off_n, m_local, N, WORLD: tl.constexpr,
               EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the fp32 tile at global rows ``row0 ..`` (MERGE_ROWS), rounded, into every owner's
    slot ``rank`` (``slot_base``) that its rows reach: per owner one masked vector store of the
    rows inside its segment (fully masked for the others)."""
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    if EPI_SPLIT == 2:
        acc0, acc1 = split_columns(acc, BLOCK_M, HALF)
        for owner in tl.static_range(0, WORLD):
            dst = tl.load(data_ptrs + owner).to(tl.pointer_type(data_ptr.dtype.element_ty))
            _push_owner_rows(acc0, dst, slot_base, row0 - owner * m_local, off_n, m_local, N,
                             BLOCK_M, HALF)
            _push_owner_rows(acc1, dst, slot_base, row0 - owner * m_local, off_n + HALF,
                             m_local, N, BLOCK_M, HALF)
    else:
        for owner in tl.static_range(0, WORLD):
            dst = tl.load(data_ptrs + owner).to(tl.pointer_type(data_ptr.dtype.element_ty))
            _push_owner_rows(acc, dst, slot_base, row0 - owner * m_local, off_n, m_local, N,
                             BLOCK_M, BLOCK_N)


@triton.jit
def _push_owner_rows(part, dst, slot_base, off_m, off_n, m_local, N, BLOCK_M: tl.constexpr,
                     WIDTH: tl.constexpr):
    """The rows of ``part`` that fall inside the owner's ``[m_local, N]`` slot when the tile
    starts at its row ``off_m`` (negative: the tile starts in an earlier segment)."""
    ptrs, mask = _tile_ptrs(dst, slot_base, off_m, off_n, m_local, N, BLOCK_M, WIDTH)
    mask = mask & ((off_m + tl.arange(0, BLOCK_M)) >= 0)[:, None]
    tl.store(ptrs, part.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _merged_rows_producer(a_desc, b_desc, data_ptr, data_ptrs, pid, slot_base, m_local, N,
                          k_tiles, num_pid_n, WORLD: tl.constexpr, B_KN: tl.constexpr,
                          EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                          FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """MERGE_ROWS: this program's tiles of the ``[WORLD * m_local, N]`` partial (A a 2-D
    descriptor over every row), each pushed by owner (:func:`_push_rows`)."""
    num_pid_m = tl.cdiv(WORLD * m_local, BLOCK_M)
    for t in tl.range(pid, num_pid_m * num_pid_n, NUM_SMS, flatten=FLATTEN,
                      warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(t, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tile_mainloop(a_desc, b_desc, 0, row0, off_n, k_tiles, False, B_KN, BLOCK_M,
                            BLOCK_N, BLOCK_K)
        _push_rows(acc, data_ptr, data_ptrs, slot_base, row0, off_n, m_local, N, WORLD,
                   EPI_SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _add_bias(part, bias_ptr, off_n, N, WIDTH: tl.constexpr):
    cols = off_n + tl.arange(0, WIDTH)
    return part + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _push_tile(acc, dst, dst_desc, slot_base, off_m, off_n, m_local, N, TMA_PUSH: tl.constexpr,
               EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store one fp32 partial tile, rounded, into the owner's slot (TMA or vector stores)."""
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    if EPI_SPLIT == 2:
        acc0, acc1 = split_columns(acc, BLOCK_M, HALF)
        _push_part(acc0, dst, dst_desc, slot_base, off_m, off_n, m_local, N, TMA_PUSH, BLOCK_M, HALF)
        _push_part(acc1, dst, dst_desc, slot_base, off_m, off_n + HALF, m_local, N, TMA_PUSH,
                   BLOCK_M, HALF)
    else:
        _push_part(acc, dst, dst_desc, slot_base, off_m, off_n, m_local, N, TMA_PUSH, BLOCK_M, BLOCK_N)


@triton.jit
def _reduce_tile(acc, slots_desc, bias_ptr, out_desc, off_m, off_n, N, rank, world,
                 HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The reduction epilogue of one own tile: ``acc`` (fp32, own partial) + the peers'
    partials in rank order ``0..W-1`` (+ bias), stored to ``out`` (in two column halves with
    EPI_SPLIT=2).

    Each peer's whole ``BLOCK_M x BLOCK_N`` partial is one TMA load through ``slots_desc``
    (``[world, m_local, N]``, rows past a segment's end read as zeros). Triton waits for each
    TMA load before the next, so one load per peer instead of one per column half takes one
    load latency off every own tile: the epilogue went from 4.5-5.9 to 3.8-4.0 us in the phase
    stamps, and the kernel ran 0.2 % faster (paired median; at most 1.3 %) on the TP 2 grid
    with communication off. It also needs fewer registers (ptxas: 159 against 168, and 163
    against 254 with a bias); masked vector loads spilled (docs/design.md, "Measured and
    rejected")."""
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    for src in range(world):
        if src != rank:
            acc += slots_desc.load([src, off_m, off_n]).reshape(BLOCK_M, BLOCK_N).to(tl.float32)
    if HAS_BIAS:
        acc = _add_bias(acc, bias_ptr, off_n, N, BLOCK_N)
    if EPI_SPLIT == 2:
        acc0, acc1 = split_columns(acc, BLOCK_M, HALF)
        out_desc.store([off_m, off_n], acc0.to(out_desc.dtype))
        out_desc.store([off_m, off_n + HALF], acc1.to(out_desc.dtype))
    else:
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@triton.jit(do_not_specialize=["rank", "epoch", "max_spins"])
def gemm_rs_kernel(
    a_ptr, b_ptr, out_ptr,
    data_ptr, data_ptrs, flag_ptrs, bias_ptr, err_ptr, trace_ptr, parts_ptr, counters_ptr,
    out_hd, slots_hd,
    m_local, N, K, ldb, rank, epoch, max_spins, sk_tiles,
    WORLD: tl.constexpr, RAGGED: tl.constexpr, B_KN: tl.constexpr, HAS_BIAS: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    FLATTEN: tl.constexpr, FLATTEN_CONSUME: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    TMA_PUSH: tl.constexpr, ASYNC_FENCE: tl.constexpr,
    PRODUCE: tl.constexpr = True, CONSUME: tl.constexpr = True,
    SPREAD_REDUCE: tl.constexpr = False, UNROLL_STEPS: tl.constexpr = True,
    CE_PUSH: tl.constexpr = False, TRACE: tl.constexpr = False,
    MERGE_ROWS: tl.constexpr = False, HOST_DESC: tl.constexpr = False,
    STREAM_K: tl.constexpr = False,
):
    """``data_ptr``: this rank's slot region (``[WORLD, m_local, N]``, output dtype) for this
    call's parity; ``data_ptrs``/``flag_ptrs``: int64 tables of every rank's slot region and
    int32 signal region (layout: :func:`~megatron_flux.kernels.config.rs_signal_count`).
    PRODUCE/CONSUME select the phases (both in production; the CPU tests run all ranks'
    producers before their consumers). ASYNC_FENCE: drain TMA stores before the grid
    signal (off only under the interpreter). CE_PUSH: ``data_ptrs[seg] + rank * m_local * N``
    is this rank's local staging area for segment ``seg``, and the grid signals only its own
    "produced" word (the copy engine delivers; see the module docstring). TMA descriptors are
    built on the device, or with HOST_DESC (below) come from the host; those of peers' slots
    are always device-built.
    TRACE: stamp the phases of :data:`RS_PHASES` into ``trace_ptr`` (:mod:`.phase_trace`).
    MERGE_ROWS (with SPREAD_REDUCE, vector-store pushes, RAGGED=False: A is one ``[WORLD *
    m_local, K]`` operand): one tile loop over every rank's rows (:func:`_merged_rows_producer`).
    HOST_DESC: ``a_ptr`` and ``b_ptr`` are host-encoded TMA descriptors of the same views
    (:func:`_host_descriptors`) instead of pointers, and ``out_hd`` / ``slots_hd`` those of the
    own tiles' output and slot region (:mod:`.descriptors`); without it ``out_hd`` and
    ``slots_hd`` are unused.
    STREAM_K: the last ``sk_tiles`` own tiles are split along K over the grid after the
    consumer loop (:func:`_own_stream_k_tiles`); without it ``sk_tiles`` is 0 and the scratch
    ``parts`` / ``counters`` is not touched."""
    stamp(trace_ptr, 0, TRACE)  # start
    a_desc = segments_descriptor(a_ptr, m_local, K, WORLD, BLOCK_M, BLOCK_K, RAGGED, HOST_DESC)
    b_desc = b_descriptor(b_ptr, N, K, ldb, B_KN, BLOCK_N, BLOCK_K, HOST_DESC)
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(m_local, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_seg = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    slot_base = (rank * m_local).to(tl.int64) * N  # this rank's slot in every owner's region
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    stamp(trace_ptr, 1, TRACE)  # descriptors

    if PRODUCE:
        # Up to TP 4 the step loop is unrolled (WORLD is a compile-time constant): every tile
        # loop at the top level of the kernel; nested in a runtime step loop, the AG kernel's
        # ran 1-3 % slower at TP 2. At TP 8 a runtime loop is up to 2-3 % faster: seven
        # unrolled copies are four times the code (config.MAX_UNROLLED_WORLD).
        if MERGE_ROWS:
            _merged_rows_producer(a_desc, b_desc, data_ptr, data_ptrs, pid, slot_base, m_local,
                                  N, k_tiles, num_pid_n, WORLD, B_KN, EPI_SPLIT, BLOCK_M,
                                  BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, FLATTEN, WARP_SPECIALIZE)
        elif UNROLL_STEPS:
            for step in tl.static_range(0, WORLD - 1 + SPREAD_REDUCE):  # + own when spread
                _producer_step(step, a_desc, b_desc, data_ptr, data_ptrs, pid, rank, slot_base,
                               m_local, N, k_tiles, tiles_per_seg, num_pid_m, num_pid_n, WORLD,
                               RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                               NUM_SMS, FLATTEN, WARP_SPECIALIZE, TMA_PUSH)
        else:
            for step in range(0, WORLD - 1 + SPREAD_REDUCE):
                _producer_step(step, a_desc, b_desc, data_ptr, data_ptrs, pid, rank, slot_base,
                               m_local, N, k_tiles, tiles_per_seg, num_pid_m, num_pid_n, WORLD,
                               RAGGED, B_KN, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                               NUM_SMS, FLATTEN, WARP_SPECIALIZE, TMA_PUSH)
        stamp(trace_ptr, 2, TRACE)  # produced
        # One grid barrier after every producer step, not one per step: each owner waits for
        # all its peers, and the peer that visits it last publishes it at the end of its
        # producer phase either way, so earlier per-step signals made no owner ready sooner;
        # they cost every program a store drain and a barrier per step (TP 8: seven).
        # The last arrival raises every owner's signal: one system-scope fence, then relaxed
        # writes (a release pattern each). A release write per owner fenced once per owner:
        # at TP 8 the last program's eight fences took ~5 us (phase stamps, .phase_trace).
        if arrive_at_grid_barrier(my_flags + WORLD, NUM_SMS, ASYNC_FENCE and TMA_PUSH):
            release_fence(epoch, ASYNC_FENCE)
            if CE_PUSH:  # the copy engine delivers; the own spread partial is already home
                if SPREAD_REDUCE:
                    _raise(my_flags + rank, epoch, ASYNC_FENCE)
                _raise(my_flags + WORLD + 1, epoch, ASYNC_FENCE)
            else:
                for owner_step in tl.static_range(0, WORLD - 1 + SPREAD_REDUCE):
                    seg = segment_of_step(owner_step, rank, WORLD, True)
                    owner_flags = tl.load(flag_ptrs + seg).to(tl.pointer_type(tl.int32))
                    _raise(owner_flags + rank, epoch, ASYNC_FENCE)
        stamp(trace_ptr, 3, TRACE)  # arrived

    if CONSUME and SPREAD_REDUCE:
        _spread_reduce(data_ptr, out_ptr, bias_ptr, my_flags, err_ptr, trace_ptr, pid, m_local,
                       N, rank, epoch, max_spins, WORLD, HAS_BIAS, NUM_SMS, 16, 256,
                       TRACE)  # 16 x 256 chunks
    if CONSUME and not SPREAD_REDUCE:
        # The first own tile is peeled so its GEMM runs before the one wait for the peers (when
        # the grid covers every tile in one wave, a program's only reduction tile then overlaps
        # the peers' producer tiles); the rest of the loop has no synchronisation. Programs
        # without an own tile build no descriptor for it.
        own_start = (WORLD - 1) * tiles_per_seg
        if STREAM_K:  # the partial last wave leaves the loop
            dp_end = WORLD * tiles_per_seg - sk_tiles
        else:
            dp_end = WORLD * tiles_per_seg
        first = first_tile_at_or_after(pid, own_start, NUM_SMS)
        if first < dp_end:
            if HOST_DESC:
                out_desc = out_hd
                slots_desc = slots_hd
            else:
                out_desc = tl.make_tensor_descriptor(out_ptr, [m_local, N], [N, 1],
                                                     [BLOCK_M, HALF])
                slots_desc = tl.make_tensor_descriptor(data_ptr, [WORLD, m_local, N],
                                                       [m_local * N, N, 1], [1, BLOCK_M, BLOCK_N])
            _consume_tile(a_desc, b_desc, out_desc, slots_desc, bias_ptr, my_flags, err_ptr,
                          trace_ptr, serpentine(first, WORLD - 1, tiles_per_seg), m_local, N,
                          k_tiles, rank, WORLD, epoch, max_spins, num_pid_m, num_pid_n, True,
                          RAGGED, B_KN, HAS_BIAS, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                          ASYNC_FENCE, TRACE)
            for t in tl.range(first + NUM_SMS, dp_end, NUM_SMS, flatten=FLATTEN_CONSUME):
                _consume_tile(a_desc, b_desc, out_desc, slots_desc, bias_ptr, my_flags, err_ptr,
                              trace_ptr, serpentine(t, WORLD - 1, tiles_per_seg), m_local, N,
                              k_tiles, rank, WORLD, epoch, max_spins, num_pid_m, num_pid_n, False,
                              RAGGED, B_KN, HAS_BIAS, EPI_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K,
                              GROUP_M, ASYNC_FENCE, False)
        if STREAM_K:
            _own_stream_k_tiles(a_desc, b_desc, out_ptr, data_ptr, out_hd, slots_hd, bias_ptr,
                                my_flags, err_ptr, parts_ptr, counters_ptr, pid, dp_end, sk_tiles,
                                tiles_per_seg, k_tiles, m_local, N, num_pid_m, num_pid_n, rank,
                                epoch, max_spins, WORLD, RAGGED, B_KN, HAS_BIAS, EPI_SPLIT,
                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, ASYNC_FENCE,
                                HOST_DESC)
    stamp(trace_ptr, 7, TRACE)  # end


@triton.jit
def _own_stream_k_tiles(a_desc, b_desc, out_ptr, data_ptr, out_hd, slots_hd, bias_ptr, my_flags,
                        err_ptr, parts_ptr, counters_ptr, pid, dp_end, sk_tiles, tiles_per_seg,
                        k_tiles, m_local, N, num_pid_m, num_pid_n, rank, epoch, max_spins,
                        WORLD: tl.constexpr, RAGGED: tl.constexpr, B_KN: tl.constexpr,
                        HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        NUM_SMS: tl.constexpr, ASYNC_FENCE: tl.constexpr,
                        HOST_DESC: tl.constexpr):
    """This program's share of the own segment's stream-K tiles (flat tiles ``dp_end ..``):
    K-iterations ``[it, end)`` (:mod:`.stream_k`), one tile part at a time. A tile covered by
    this program alone, or whose parts this program completes, is reduced here
    (:func:`_reduce_stream_k_tile`); the two calls stay apart so the accumulator is never
    merged with the summed tile (that made ptxas serialise every wgmma, C7515)."""
    it, end, per = sk_range(pid, sk_tiles, k_tiles, NUM_SMS)
    while it < end:
        u = it // k_tiles
        k_lo = it - u * k_tiles
        k_hi = tl.minimum(end - u * k_tiles, k_tiles)
        pid_m, pid_n = grouped_tile(serpentine(dp_end + u, WORLD - 1, tiles_per_seg), num_pid_m,
                                    num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if RAGGED:
            row = off_m
        else:
            row = rank * m_local + off_m
        acc = tile_mainloop_k(a_desc, b_desc, rank, row, off_n, k_lo, k_hi, RAGGED, B_KN,
                              BLOCK_M, BLOCK_N, BLOCK_K)
        first, last = sk_covering(u, per, k_tiles)
        if first == last:
            _reduce_stream_k_tile(acc, out_ptr, data_ptr, out_hd, slots_hd, bias_ptr, my_flags,
                                  err_ptr, off_m, off_n, m_local, N, rank, epoch, max_spins, WORLD,
                                  HAS_BIAS, EPI_SPLIT, BLOCK_M, BLOCK_N, ASYNC_FENCE, HOST_DESC)
        elif sk_publish_part(acc, parts_ptr, counters_ptr, pid, u, per, k_tiles, first, last,
                             BLOCK_M, BLOCK_N):
            tile = sk_sum_parts(parts_ptr, counters_ptr, u, per, k_tiles, first, last, BLOCK_M,
                                BLOCK_N)
            _reduce_stream_k_tile(tile, out_ptr, data_ptr, out_hd, slots_hd, bias_ptr, my_flags,
                                  err_ptr, off_m, off_n, m_local, N, rank, epoch, max_spins, WORLD,
                                  HAS_BIAS, EPI_SPLIT, BLOCK_M, BLOCK_N, ASYNC_FENCE, HOST_DESC)
        it = (u + 1) * k_tiles


@triton.jit
def _reduce_stream_k_tile(acc, out_ptr, data_ptr, out_hd, slots_hd, bias_ptr, my_flags, err_ptr,
                          off_m, off_n, m_local, N, rank, epoch, max_spins, WORLD: tl.constexpr,
                          HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, ASYNC_FENCE: tl.constexpr,
                          HOST_DESC: tl.constexpr):
    """The reduction epilogue of a completed stream-K tile: wait (acquire, bounded) for every
    peer's signal (one load each when this program already waited in the consumer loop), then
    :func:`_reduce_tile`, through the host's descriptors or ones built here (a program may
    have had no own tile in the loop, and then built none)."""
    for src in range(0, WORLD):
        if src != rank:
            wait_signal(my_flags + src, epoch, max_spins, err_ptr, 2, rank, src)  # OP_GEMM_RS
    fence_async_proxy(epoch, ASYNC_FENCE)
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    if HOST_DESC:
        out_desc = out_hd
        slots_desc = slots_hd
    else:
        out_desc = tl.make_tensor_descriptor(out_ptr, [m_local, N], [N, 1], [BLOCK_M, HALF])
        slots_desc = tl.make_tensor_descriptor(data_ptr, [WORLD, m_local, N], [m_local * N, N, 1],
                                               [1, BLOCK_M, BLOCK_N])
    _reduce_tile(acc, slots_desc, bias_ptr, out_desc, off_m, off_n, N, rank, WORLD, HAS_BIAS,
                 EPI_SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _raise(flag_ptr, epoch, FENCED: tl.constexpr):
    """Write ``epoch`` at system scope: relaxed after :func:`release_fence` (FENCED), else as a
    release write (the interpreter, which has no fence)."""
    if FENCED:
        tl.atomic_xchg(flag_ptr, epoch, sem="relaxed", scope="sys")
    else:
        tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


@triton.jit
def _producer_step(step, a_desc, b_desc, data_ptr, data_ptrs, pid, rank, slot_base, m_local, N,
                   k_tiles, tiles_per_seg, num_pid_m, num_pid_n, WORLD: tl.constexpr,
                   RAGGED: tl.constexpr, B_KN: tl.constexpr, EPI_SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
                   WARP_SPECIALIZE: tl.constexpr, TMA_PUSH: tl.constexpr):
    """One producer step: this program's tiles of the step's segment (backwards on odd
    steps), each pushed into the owner's slot ``rank``. A program builds the step's push
    descriptor only when it has a tile in the step (a device-side descriptor is a global write
    and a proxy fence; at TP 8 and small m most programs have a tile in one step of seven)."""
    HALF: tl.constexpr = BLOCK_N // EPI_SPLIT
    first = first_tile_at_or_after(pid, step * tiles_per_seg, NUM_SMS)
    if first < (step + 1) * tiles_per_seg:
        seg = segment_of_step(step, rank, WORLD, True)
        dst = tl.load(data_ptrs + seg).to(tl.pointer_type(data_ptr.dtype.element_ty))
        dst_desc = tl.make_tensor_descriptor(dst + slot_base, [m_local, N], [N, 1],
                                             [BLOCK_M, HALF])
        for t in tl.range(first, (step + 1) * tiles_per_seg, NUM_SMS, flatten=FLATTEN,
                          warp_specialize=WARP_SPECIALIZE):
            t_in_seg = serpentine(t, step, tiles_per_seg)
            acc, off_m, off_n = segment_tile(a_desc, b_desc, t_in_seg, seg, m_local, k_tiles,
                                             num_pid_m, num_pid_n, RAGGED, B_KN, BLOCK_M,
                                             BLOCK_N, BLOCK_K, GROUP_M)
            _push_tile(acc, dst, dst_desc, slot_base, off_m, off_n, m_local, N, TMA_PUSH,
                       EPI_SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _consume_tile(a_desc, b_desc, out_desc, slots_desc, bias_ptr, my_flags, err_ptr, trace_ptr,
                  t_in_seg, m_local, N, k_tiles, rank, world, epoch, max_spins, num_pid_m,
                  num_pid_n, WAIT: tl.constexpr, RAGGED: tl.constexpr, B_KN: tl.constexpr,
                  HAS_BIAS: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  ASYNC_FENCE: tl.constexpr, TRACE: tl.constexpr):
    """One tile of the own segment: its GEMM, with WAIT the wait for every peer's step signal,
    then the reduction epilogue. After the wait (generic-proxy acquire), TMA reads of the
    partials are ordered behind it with a proxy fence. TRACE stamps the phases of the first
    (WAIT) tile."""
    acc, off_m, off_n = segment_tile(a_desc, b_desc, t_in_seg, rank, m_local, k_tiles,
                                     num_pid_m, num_pid_n, RAGGED, B_KN, BLOCK_M, BLOCK_N,
                                     BLOCK_K, GROUP_M)
    if WAIT:
        stamp(trace_ptr, 4, TRACE)  # own_gemm
        for src in range(0, world):
            if src != rank:
                wait_signal(my_flags + src, epoch, max_spins, err_ptr, 2, rank, src)  # OP_GEMM_RS
        fence_async_proxy(epoch, ASYNC_FENCE)
        stamp(trace_ptr, 5, TRACE)  # waited
    _reduce_tile(acc, slots_desc, bias_ptr, out_desc, off_m, off_n, N, rank, world, HAS_BIAS,
                 EPI_SPLIT, BLOCK_M, BLOCK_N)
    if WAIT:
        stamp(trace_ptr, 6, TRACE)  # first_reduced


@triton.jit
def _spread_reduce(data_ptr, out_ptr, bias_ptr, my_flags, err_ptr, trace_ptr, pid, m_local, N,
                   rank, epoch, max_spins, WORLD: tl.constexpr, HAS_BIAS: tl.constexpr,
                   NUM_SMS: tl.constexpr, RED_M: tl.constexpr, RED_N: tl.constexpr,
                   TRACE: tl.constexpr):
    """The reduction spread over the whole grid (``rs_spread_reduce``): wait (acquire, bounded)
    until every rank, this one included, has pushed its partial of this rank's rows, then sum
    the ``WORLD`` slots in rank order ``0..W-1`` (+ bias) into ``out``, one ``RED_M x RED_N``
    chunk per program at a time (program ``p`` takes chunks ``p, p + G, ...``). Every slot
    holds a partial rounded to the output dtype, the own one too, as NCCL's reduce-scatter
    sums them."""
    for src in tl.static_range(0, WORLD):
        wait_signal(my_flags + src, epoch, max_spins, err_ptr, 2, rank, src)  # op code OP_GEMM_RS
    stamp(trace_ptr, 5, TRACE)  # waited
    num_n = tl.cdiv(N, RED_N)
    for c in range(pid, tl.cdiv(m_local, RED_M) * num_n, NUM_SMS):
        rows = (c // num_n) * RED_M + tl.arange(0, RED_M)
        off_n = (c % num_n) * RED_N
        cols = off_n + tl.arange(0, RED_N)
        mask = (rows[:, None] < m_local) & (cols[None, :] < N)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        acc = tl.zeros((RED_M, RED_N), dtype=tl.float32)
        for src in tl.static_range(0, WORLD):
            acc += tl.load(data_ptr + tl.cast(src * m_local, tl.int64) * N + offs, mask=mask,
                           other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc = _add_bias(acc, bias_ptr, off_n, N, RED_N)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def rs_staging_table(staging_addr: int, own_slot_addr: int, *, rank: int, world: int,
                     m_local: int, n: int, elt: int):
    """The ``data_ptrs`` entries of a copy-engine GEMM+RS call (``rs_copy_engine``), as ints.

    ``staging_addr``: a local ``[world - 1, m_local, n]`` buffer, one partial per producer step
    (step ``s`` is segment ``(rank + 1 + s) % world``); the kernel writes segment ``seg`` at
    ``data_ptrs[seg] + rank * m_local * n`` elements, so entry ``seg`` is the step's area less
    that offset. The own entry is the own slot region (the spread reduction pushes its own
    partial there)."""
    table = []
    for seg in range(world):
        if seg == rank:
            table.append(own_slot_addr)
        else:
            step = (seg - rank - 1) % world
            table.append(staging_addr + (step - rank) * m_local * n * elt)
    return table


def _host_descriptors(a, b, out, data, world, m_local, n, k, ldb, b_kn, ragged, cfg,
                      own_tiles=True):
    """``(a, b, out, data)`` as host TMA descriptors of the views :func:`gemm_rs_kernel`
    builds on the device without HOST_DESC; ``out`` and ``data`` stay as they are without
    ``own_tiles`` (a spread reduction or a launch without its consumer reads neither through
    a descriptor)."""
    if ragged:
        a_desc = host_descriptor(a, [world, m_local, k], [m_local * k, k, 1],
                                 [1, cfg.block_m, cfg.block_k])
    else:
        a_desc = host_descriptor(a, [world * m_local, k], [k, 1], [cfg.block_m, cfg.block_k])
    if b_kn:
        b_desc = host_descriptor(b, [k, n], [ldb, 1], [cfg.block_k, cfg.block_n])
    else:
        b_desc = host_descriptor(b, [n, k], [ldb, 1], [cfg.block_n, cfg.block_k])
    if not own_tiles:
        return a_desc, b_desc, out, data
    out_desc = host_descriptor(out, [m_local, n], [n, 1],
                               [cfg.block_m, cfg.block_n // cfg.epilogue_split])
    slots_desc = host_descriptor(data, [world, m_local, n], [m_local * n, n, 1],
                                 [1, cfg.block_m, cfg.block_n])
    return a_desc, b_desc, out_desc, slots_desc


def launch_gemm_rs(a, b, out, data, data_ptrs, flag_ptrs, bias, err, *, rank, world, epoch, cfg,
                   num_sms, max_spins, produce=True, consume=True, trace=None,
                   host_descriptors=True, direct=True):
    """Launch :func:`gemm_rs_kernel` on the current stream.

    ``a`` ``[world * m_local, K]``; ``b`` ``[K, N]`` row-major or a transposed row-major
    ``[N, K]``; ``out`` ``[m_local, N]``; ``data`` this rank's ``[world, m_local, N]`` slot
    region of this call's parity (the address ``data_ptrs[rank]`` points at). ``trace``: an
    int64 ``[grid, TRACE_SLOTS]`` buffer to stamp :data:`RS_PHASES` into (a diagnostic build of
    the kernel; :mod:`.phase_trace`). With ``cfg.rs_copy_engine`` the caller passes the
    staging table as ``data_ptrs`` (:func:`rs_staging_table`) and queues the copies. With
    ``cfg.rs_warp_specialized`` a call the Gluon kernel can take runs there
    (:mod:`.gemm_rs_ws`). ``host_descriptors``: A's and B's TMA descriptors encoded on the host;
    ``direct``: past Triton's argument binding (:mod:`.launch`)."""
    m, k = a.shape
    m_local = m // world
    n = b.shape[1]
    if cfg.rs_warp_specialized:
        reason = gemm_rs_ws.unsupported_reason(a, m_local, cfg, trace=trace, produce=produce,
                                               consume=consume)
        if reason is None:
            return gemm_rs_ws.launch_gemm_rs_ws(a, b, out, data, data_ptrs, flag_ptrs, bias, err,
                                                rank=rank, world=world, epoch=epoch, cfg=cfg,
                                                num_sms=num_sms, max_spins=max_spins,
                                                host_descriptors=host_descriptors,
                                                direct=direct)
        gemm_rs_ws.warn_fallback(reason)

    host_desc = bool(host_descriptors)
    key = (m_local, n, k, b.stride(0), b.stride(1), world, id(cfg), num_sms, produce, consume,
           trace is None, bias is None, host_desc, interpreting(), stream_k.fallback_generation())
    plan = _PLANS.get(key, cfg, lambda: _launch_plan(m_local, n, b, world, cfg, num_sms,
                                                     produce=produce, consume=consume,
                                                     traced=trace is not None,
                                                     has_bias=bias is not None,
                                                     host_desc=host_desc))
    grid, sk_tiles = plan.grid, plan.sk_tiles

    def launch():
        parts, counters = err, err  # never touched without stream-K tiles
        if sk_tiles:
            scratch = stream_k_scratch(a.device, grid, cfg.block_m, cfg.block_n)
            parts, counters = scratch.partials, scratch.counters
        if host_desc:
            a_arg, b_arg, out_hd, slots_hd = _host_descriptors(
                a, b, out, data, world, m_local, n, k, plan.ldb, plan.b_kn, plan.ragged, cfg,
                own_tiles=consume and not cfg.rs_spread_reduce)
        else:
            a_arg, b_arg, out_hd, slots_hd = a, b, out, data  # the last two unused
        args = (a_arg, b_arg, out, data, data_ptrs, flag_ptrs, bias if bias is not None else data,
                err, trace if trace is not None else err, parts, counters, out_hd, slots_hd,
                m_local, n, k, plan.ldb, rank, epoch, max_spins, sk_tiles)
        _LAUNCH(grid, args, plan.constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                direct=direct)

    ensure_descriptor_allocator()
    launch_with_stream_k_fallback(
        "GEMM+RS", cfg, launch,
        lambda: launch_gemm_rs(a, b, out, data, data_ptrs, flag_ptrs, bias, err, rank=rank,
                               world=world, epoch=epoch, cfg=cfg, num_sms=num_sms,
                               max_spins=max_spins, produce=produce, consume=consume,
                               trace=trace, host_descriptors=host_desc, direct=direct),
        lambda: sk_tiles > 0)


def _launch_plan(m_local, n, b, world, cfg, num_sms, *, produce, consume, traced, has_bias,
                 host_desc) -> LaunchPlan:
    merge_rows = cfg.rs_merge_rows  # GemmConfig: with the spread reduction, vector pushes
    # stream-K splits own tiles, which the spread reduction and merged rows do not have
    sk_mode = 0 if (not stream_k_fits("GEMM+RS", cfg) or cfg.rs_spread_reduce or merge_rows
                    or not consume) else cfg.stream_k
    geo = launch_geometry(m_local, n, b, world, cfg, num_sms, merged=merge_rows)
    grid, sk_tiles = geo.grid, 0
    if sk_mode:
        grid, sk_tiles = stream_k_plan(geo.tiles, num_sms, sk_mode, geo.tiles_per_segment)
    ragged = geo.ragged and not merge_rows
    constexprs = dict(
        WORLD=world, RAGGED=ragged, B_KN=geo.b_kn,
        HAS_BIAS=has_bias,
        EPI_SPLIT=cfg.epilogue_split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_SMS=grid, FLATTEN=cfg.flatten,
        FLATTEN_CONSUME=cfg.flatten_consume, WARP_SPECIALIZE=cfg.warp_specialize,
        TMA_PUSH=cfg.rs_tma_push, ASYNC_FENCE=not interpreting(), PRODUCE=produce,
        CONSUME=consume, SPREAD_REDUCE=cfg.rs_spread_reduce,
        UNROLL_STEPS=unroll_steps(world), CE_PUSH=cfg.rs_copy_engine, TRACE=traced,
        MERGE_ROWS=merge_rows, HOST_DESC=host_desc, STREAM_K=sk_tiles > 0)
    return LaunchPlan(grid, sk_tiles, ragged, geo.b_kn, geo.ldb, constexprs)


_PLANS = ShapePlans()
_LAUNCH = KernelLauncher(gemm_rs_kernel)
