"""GEMM + ReduceScatter on a warp-specialized Hopper GEMM, written in Gluon (``rs_warp_specialized``).

Same inputs, outputs, workspace, signals and tile order as :mod:`.gemm_rs`; what differs is how
an SM runs its tiles. A Triton 3.6 persistent GEMM is not warp-specialized on Hopper, so while
a program reads the peers' partials of an own tile, adds them and stores the sum, its tensor
cores idle; at short K that epilogue is a large part of the tile (the partials' reads alone
cost 6-7 % of the kernel at k = 2048-3072, m = 8192, one H200). Here
two MMA warpgroups take alternate tiles ("ping-pong", ``num_warps=4``), so one's epilogue runs
beside the other's MMAs. The cooperative form (``num_warps=8``: one MMA partition of two
warpgroups takes every tile, up to 128x256) is for long K, where tile size matters more than
hiding the epilogue (:mod:`.gluon_ws`).

Tile and signal schedule (rank ``r`` of ``W``, ``G`` programs, one per SM):

* Flat tile ``t`` over ``W * tiles_per_segment``, as :mod:`.tile_order`: step ``t //
  tiles_per_segment``; steps ``0..W-2`` are the peers' segments ``r+1, r+2, ...`` (producer),
  step ``W-1`` the own segment (consumer); odd steps walk their segment backwards
  (``serpentine``), GROUP_M-grouped inside. Program ``p`` owns ``t = p, p + G, ...``; its
  ``j``-th tile belongs to MMA partition ``j % P`` (``P`` = 2 in ping-pong, 1 cooperative).
* **Load partition** (1 warp, 24 registers): every K-step of every tile of the program, in
  order, into a ring of ``num_stages`` shared-memory slots (A ``[BM, BK]``, B ``[BN, BK]`` or
  ``[BK, BN]``): wait the slot's ``empty`` barrier, expect both boxes on its ``ready`` barrier,
  issue the two TMA loads.
* **MMA partitions** (two of one warpgroup each, or one of two): per K-step wait ``ready``,
  issue an async ``wgmma``, keep one in flight, release the previous slot. In ping-pong a
  partition arrives on the other's ``handoff`` barrier once its tile's last slot has landed
  and waits on its own before a tile,
  so every ``ready`` wait is at most one phase ahead (the argument and a randomized model of it:
  ``benchmarks/experiments/gluon_ws_gemm.py``, ``ws_protocol_model.py``); this needs
  ``k_tiles >= num_stages``.
* Producer tile epilogue = the *write* of ReduceScatter: round to the output dtype, TMA-store
  into the owner's slot ``r`` (``data_ptrs[owner] + r * m_local * N``; with ``rs_copy_engine``
  the host's table points that into local staging, :func:`.gemm_rs.rs_staging_table`).
* **Grid barrier**: before its first own tile (or at its end, if it has none) each MMA
  partition drains its TMA stores (``cp.async.bulk.wait_group 0``, proxy fence), meets its
  warpgroup at a named barrier, and counts itself in at ``flags[r][W]`` (acq_rel, system
  scope). The last of the grid's ``P G`` partitions resets the counter and, after one
  ``fence.acq_rel.sys``, writes ``epoch`` (relaxed) to every peer owner's ``flags[owner][r]``
  (with ``rs_copy_engine``: to this rank's "produced" word ``flags[r][W + 1]``, which the copy
  engine's stream waits for). Its atomics run on a ``[1]`` tensor one thread owns, masked.
* Consumer tile epilogue = the *reduction*: a partition's first own tile runs its MMAs, then
  waits (acquire, system scope, bounded: ``signals.wait_signal``) for every peer's
  ``flags[r][src]`` and fences the async proxy. Each peer's partial tile is TMA-loaded into the
  partition's epilogue buffer and added to the fp32 accumulator in rank order ``0..W-1`` (bias
  once), the sum rounded and TMA-stored to ``out``. After the first own tile, the first peer's
  partial is loaded *before* the tile's MMAs, so it has landed by the epilogue. Results are
  bitwise repeatable (fixed order, no atomics on data); the sum is the same expression as
  :mod:`.gemm_rs`'s, though not necessarily the same bits (another MMA instruction shape).

* **Split tail** (``stream_k=1``, SPLIT_TAIL; :func:`.split_tail.split_tail_plan`): the partial last wave's
  ``tail`` tiles (own tiles, at the end of the flat order) leave the tile loop and each is cut
  along K into ``parts`` equal ranges of at least ``num_stages`` K-steps, ``tail * parts`` units
  dealt round-robin: program ``p`` runs units ``p, p + G, ...`` (unit ``u`` is part ``u %
  parts`` of tail tile ``u // parts``; the plan gives one a program) as its first work items
  (TAIL_FIRST, :func:`.split_tail.split_tail_first`) or its last, on the ring and partition their item
  indices give (one wgmma site: running the tail after the tile loop, through a second one, made
  ptxas serialise every wgmma of the kernel, C7515; ``test_kernels_compile.py`` checks). A
  unit's tile, part and K range are recomputed where they are used, not held across the tile
  loop (held, they cost the MMA partitions 12 spilled registers). A unit's epilogue rounds its
  part, TMA-stores it into its scratch slot, drains the store and counts in at the tail tile's
  counter (acq_rel, GPU scope). A part run first does not count in at the grid barrier (whole
  tiles, maybe producers, follow it). After its last work item and its count-in at the grid
  barrier, the program's MMA partition that did not run that item (the earlier to finish in
  ping-pong) waits, for each of the program's units, (acquire, bounded) until all parts of the
  unit's tile have counted in, and for the peers' signals if it has not, and sums a share of the
  tile's rows (chunks dealt round-robin over the parts, one per part where :func:`.split_tail.tail_sum_rows`
  can): parts in part order, then the peers' partials in rank order, bias once, plain loads and
  stores; the last to count out resets the counter. The parts share the sum because one program
  summing the whole tile took 8-10 us after the last part arrived (2-2.5 us per 32-row chunk,
  whether a chunk's parts loaded one by one or at once); run first, a part's epilogue and its
  share of the sum run beside the whole tiles' MMAs instead of after them (one H200, comm off,
  ``benchmarks/experiments/phase_trace_ws.py``). Each part is rounded to the output dtype, as a
  peer's partial is.
* **Merged rows** (``rs_merge_rows``, MERGE_ROWS; small m): no steps. The flat tile ``t``
  walks every rank's rows ``[W * m_local, K]`` as one GROUP_M-grouped tile space, so a row tile
  may span owners. With INTERLEAVE (``rs_interleave_owners``, where ``m_local`` is a multiple
  of ``BLOCK_M``) logical row tile ``i`` is owner ``(r + 1 + i) % W``'s row tile ``i // W``:
  the owners take turns, so the pushes to the peers spread over the whole launch instead of
  coming in one stretch, which the per-segment schedule's peers-first order asks of the link. Each tile is rounded into the partition's epilogue buffer and stored into
  the slot ``r`` of every owner whose rows it reaches, the own slot included: by TMA when the
  tile starts inside the owner's segment (TMA clips the rows past its end), else by masked
  vector stores read back from the buffer (a TMA store at a negative row raised an illegal
  instruction on H200). After its last tile each partition counts in at the grid barrier; the
  last raises every owner's signal, this rank's too. Then every MMA partition waits (bounded)
  for all ``W`` signals and sums the ``W`` slots of a share of the own rows into ``out``
  (the spread reduction of :mod:`.gemm_rs`, same order).

* **Row turns** (``rs_row_turns``, ROW_TURNS; per-segment schedule, SM pushes, no split tail):
  the flat order walks the segments' row groups (``GROUP_M`` row tiles, every column) in turn,
  for each group the peers' steps' tiles of it, then the own step's (no serpentine), so the
  pushes spread over the launch instead of filling its first ``(W - 1) / W``. A producer tile's
  epilogue drains its TMA store, meets its partition and counts the tile in (one thread, add,
  release, system scope) at the owner's counter of (this rank, its row group)
  (:func:`~megatron_flux.kernels.config.rs_signal_count`). Every own tile waits (acquire,
  bounded) until each peer's counter of its row group holds the group's tile count, then
  reduces in its epilogue as above (no prefetch). No grid barrier before the own tiles: each
  partition counts in after its last tile, and the last of the grid resets this rank's row
  counters (every own tile has read them, and every peer's tile of the call was counted in
  before that; a peer's next use of this parity comes after this rank's next call) and raises
  the epoch signals as above. Not under CUDA graph capture.

Limits (the launcher falls back to :mod:`.gemm_rs`, with one warning naming why, when a call
breaks one): ``m_local`` a multiple of ``block_m`` (merged rows: any but 1); at least
``num_stages`` K-steps; bf16 or fp16; a Triton with Gluon (3.6 and 3.9 checked); not under the
interpreter, phase traces or the separate produce/consume test phases; ``rs_row_turns``: at
most ``ROW_GROUPS`` row groups per rank, not under graph capture. ``rs_spread_reduce``
without merged rows is not implemented, and ``GemmConfig`` refuses it together with this
kernel.
"""

from typing import Optional

import torch

# (no `from __future__ import annotations`: Triton 3.6 checks an aggregate's attribute types
# against its class annotations, which that import would turn into strings)

from megatron_flux.kernels import gluon_ws, split_tail, stream_k
from megatron_flux.kernels.config import ROW_GROUPS, interpreting, row_groups
from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
from megatron_flux.kernels.launch import KernelLauncher
from megatron_flux.kernels.gluon_ws import (CONSUMER_REGS, GLUON_ERROR, aggregate,
                                            fence_async_shared, gl, gluon, mbarrier, tma)
from megatron_flux.kernels.signals import OP_GEMM_RS, OP_SPLIT_TAIL, fence_async_proxy, wait_signal
from megatron_flux.kernels.tile_order import grouped_tile, row_turn, segment_of_step, serpentine

#: TRACE: int64 words per program of the trace buffer, and what the kernel stamps there
#: (``%globaltimer``, ns): per MMA partition ``c`` at ``6 c + i`` its start, its last work item's
#: start and MMAs' end, that item's epilogue issued, the time it counted in as a split tile's
#: part, its end (:data:`WS_RS_PHASES`); the load partition's start and end at 12 and 13; the
#: split sum's wait for every part and the peers' signals done, at 14, and its share summed, at
#: 15; per MMA partition at ``16 + 2 c + i`` the time it had counted in at the grid barrier
#: (its pushes drained) and the time its first own tile had the peers' signals
#: (:data:`WS_RS_SYNC`)
WS_TRACE_SLOTS = 20
WS_RS_PHASES = ("start", "last_item", "last_mma_done", "last_epilogue", "part_in", "end")
WS_RS_SYNC = ("counted_in", "peers_acquired")

if gluon is not None:
    from megatron_flux.kernels.gluon_ws import b_operand, load_ab, mma_steps, mma_tile, \
        partition_barrier, ring_barriers, tiles_of_program, tiles_per_segment, tma_descriptor, \
        tma_load, tma_store

    _OP_GEMM_RS = gl.constexpr(OP_GEMM_RS)
    _OP_SPLIT_TAIL = gl.constexpr(OP_SPLIT_TAIL)
    _WS_TRACE_SLOTS = gl.constexpr(WS_TRACE_SLOTS)
    _ROW_GROUPS = gl.constexpr(ROW_GROUPS)

    @aggregate
    class _Args:
        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        out_desc: tma.tensor_descriptor
        slots_desc: tma.tensor_descriptor
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        c_bufs: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        handoff: gl.shared_memory_descriptor
        pload: gl.shared_memory_descriptor
        data_ptr: gl.tensor
        out_ptr: gl.tensor
        data_ptrs: gl.tensor
        flag_ptrs: gl.tensor
        bias_ptr: gl.tensor
        err_ptr: gl.tensor
        trace_ptr: gl.tensor
        parts_ptr: gl.tensor
        counters_ptr: gl.tensor
        m_local: gl.tensor
        N: gl.tensor
        K: gl.tensor
        rank: gl.tensor
        epoch: gl.tensor
        max_spins: gl.tensor
        sk_tiles: gl.tensor
        sk_split: gl.tensor
        WORLD: gl.constexpr
        B_KN: gl.constexpr
        HAS_BIAS: gl.constexpr
        CE_PUSH: gl.constexpr
        GROUP_M: gl.constexpr
        NUM_PROGRAMS: gl.constexpr
        PARTITIONS: gl.constexpr
        MERGE_ROWS: gl.constexpr
        INTERLEAVE: gl.constexpr
        ROW_TURNS: gl.constexpr
        SPLIT_TAIL: gl.constexpr
        TAIL_ROWS: gl.constexpr
        TAIL_FIRST: gl.constexpr
        TRACE: gl.constexpr
        OWNER_STEPS: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, out_desc, slots_desc, a_bufs, b_bufs, c_bufs, ready,
                     empty, handoff, pload, data_ptr, out_ptr, data_ptrs, flag_ptrs, bias_ptr,
                     err_ptr, trace_ptr, parts_ptr, counters_ptr, m_local, N, K, rank, epoch,
                     max_spins, sk_tiles, sk_split, WORLD, B_KN, HAS_BIAS, CE_PUSH, GROUP_M,
                     NUM_PROGRAMS, PARTITIONS, MERGE_ROWS, INTERLEAVE, ROW_TURNS, SPLIT_TAIL,
                     TAIL_ROWS, TAIL_FIRST, TRACE):
            self.a_desc = a_desc
            self.b_desc = b_desc
            self.out_desc = out_desc
            self.slots_desc = slots_desc
            self.a_bufs = a_bufs
            self.b_bufs = b_bufs
            self.c_bufs = c_bufs
            self.ready = ready
            self.empty = empty
            self.handoff = handoff
            self.pload = pload
            self.data_ptr = data_ptr
            self.out_ptr = out_ptr
            self.data_ptrs = data_ptrs
            self.flag_ptrs = flag_ptrs
            self.bias_ptr = bias_ptr
            self.err_ptr = err_ptr
            self.trace_ptr = trace_ptr
            self.parts_ptr = parts_ptr
            self.counters_ptr = counters_ptr
            self.m_local = m_local
            self.N = N
            self.K = K
            self.rank = rank
            self.epoch = epoch
            self.max_spins = max_spins
            self.sk_tiles = sk_tiles
            self.sk_split = sk_split
            self.WORLD = gl.constexpr(WORLD)
            self.B_KN = gl.constexpr(B_KN)
            self.HAS_BIAS = gl.constexpr(HAS_BIAS)
            self.CE_PUSH = gl.constexpr(CE_PUSH)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.NUM_PROGRAMS = gl.constexpr(NUM_PROGRAMS)
            self.PARTITIONS = gl.constexpr(PARTITIONS)
            self.MERGE_ROWS = gl.constexpr(MERGE_ROWS)
            self.INTERLEAVE = gl.constexpr(INTERLEAVE)
            self.ROW_TURNS = gl.constexpr(ROW_TURNS)
            self.SPLIT_TAIL = gl.constexpr(SPLIT_TAIL)
            self.TAIL_ROWS = gl.constexpr(TAIL_ROWS)
            self.TAIL_FIRST = gl.constexpr(TAIL_FIRST)
            self.TRACE = gl.constexpr(TRACE)
            # owners whose signal the grid's last arrival raises: the peers, and with merged
            # rows (whose own partial is pushed to the own slot too) this rank
            self.OWNER_STEPS = gl.constexpr(WORLD if MERGE_ROWS else WORLD - 1)

    @gluon.jit
    def _tile(p, j):
        """This program's ``j``-th tile: ``(step, seg, a_row, off_m, off_n)`` (``off_m`` inside
        the segment, ``a_row`` in A)."""
        return _flat_tile(p, gl.program_id(0) + j * p.NUM_PROGRAMS)

    @gluon.jit
    def _flat_tile(p, t):
        """Flat tile ``t``'s ``(step, seg, a_row, off_m, off_n)``."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        if p.MERGE_ROWS:  # one tile space over every rank's rows; off_m = a_row is global
            pid_m, pid_n = grouped_tile(t, gl.cdiv(p.WORLD * p.m_local, BLOCK_M),
                                        gl.cdiv(p.N, BLOCK_N), p.GROUP_M)
            if p.INTERLEAVE:  # the owners' row tiles in turn, the next rank's first
                owner = (p.rank + 1 + pid_m % p.WORLD) % p.WORLD
                pid_m = owner * (p.m_local // BLOCK_M) + pid_m // p.WORLD
            step = 0
            seg = 0
            off_m = pid_m * BLOCK_M
            a_row = off_m
        else:
            tps = tiles_per_segment(p.m_local, p.N, BLOCK_M, BLOCK_N)
            if p.ROW_TURNS:  # per row group, the peers' tiles of it, then the own ones
                step, local = row_turn(t, tps, gl.cdiv(p.m_local, BLOCK_M), gl.cdiv(p.N, BLOCK_N),
                                       p.GROUP_M, p.WORLD)
            else:
                step = t // tps
                local = serpentine(t, step, tps)
            seg = segment_of_step(step, p.rank, p.WORLD, True)
            pid_m, pid_n = grouped_tile(local, gl.cdiv(p.m_local, BLOCK_M), gl.cdiv(p.N, BLOCK_N),
                                        p.GROUP_M)
            off_m = pid_m * BLOCK_M
            a_row = seg * p.m_local + off_m
        return step, seg, a_row, off_m, pid_n * BLOCK_N

    @gluon.jit
    def _row_counter(p, flags, src, off_m):
        """ROW_TURNS: the word of ``flags`` (an owner's signal region) counting the tiles rank
        ``src`` pushed into the row group of row ``off_m`` (:data:`ROW_GROUPS` per rank, after
        the ``WORLD + 2`` words of the grid barrier's protocol)."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        return flags + p.WORLD + 2 + src * _ROW_GROUPS + off_m // (BLOCK_M * p.GROUP_M)

    @gluon.jit
    def _num_tiles(p):
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        if p.MERGE_ROWS:
            n = tiles_of_program(gl.cdiv(p.WORLD * p.m_local, BLOCK_M) * gl.cdiv(p.N, BLOCK_N), 1,
                                 p.NUM_PROGRAMS)
        elif p.SPLIT_TAIL:  # the whole tiles, without the split tail
            n = gl.cdiv(_tail_start(p) - gl.program_id(0), p.NUM_PROGRAMS)
        else:
            n = tiles_of_program(tiles_per_segment(p.m_local, p.N, BLOCK_M, BLOCK_N), p.WORLD,
                                 p.NUM_PROGRAMS)
        return n

    @gluon.jit
    def _tail_start(p):
        """SPLIT_TAIL: the flat index of the first split tail tile (the whole tiles end there)."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        return p.WORLD * tiles_per_segment(p.m_local, p.N, BLOCK_M, BLOCK_N) - p.sk_tiles

    @gluon.jit
    def _tail_unit(p, i):
        """SPLIT_TAIL: this program's ``i``-th unit of the split tail, ``(has it, flat tile,
        part, first K-step, K-steps, unit)``: unit ``u = program + i * NUM_PROGRAMS`` (of
        ``sk_tiles * sk_split``) is part ``u % sk_split`` of tail tile ``u // sk_split``, an
        equal share of the K-steps."""
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        k_tiles = gl.cdiv(p.K, BLOCK_K)
        u = gl.program_id(0) + i * p.NUM_PROGRAMS
        part = u % p.sk_split
        k0 = part * k_tiles // p.sk_split
        k1 = (part + 1) * k_tiles // p.sk_split
        return (u < p.sk_tiles * p.sk_split, _tail_start(p) + u // p.sk_split, part, k0, k1 - k0,
                u)

    @gluon.jit
    def _tail_units(p):
        """SPLIT_TAIL: how many units of the split tail this program runs (program ``< G``, so
        the numerator is never negative)."""
        return (p.sk_tiles * p.sk_split - gl.program_id(0) + p.NUM_PROGRAMS - 1) // p.NUM_PROGRAMS

    @gluon.jit
    def _tail_steps(p, count):
        """SPLIT_TAIL: the K-steps of this program's first ``count`` units (ring positions)."""
        steps = 0
        for i in range(count):
            _, _, _, _, unit_steps, _ = _tail_unit(p, i)
            steps += unit_steps
        return steps

    @gluon.jit
    def _load_partition(p):
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        k_tiles = gl.cdiv(p.K, BLOCK_K)
        loader_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        _stamp(p, 12, loader_layout)
        pos = 0
        if p.SPLIT_TAIL and p.TAIL_FIRST:
            pos = _load_tail_units(p, pos)
        for j in range(_num_tiles(p)):
            step, seg, a_row, off_m, off_n = _tile(p, j)
            for kk in range(k_tiles):
                load_ab(p.a_desc, a_row, p.b_desc, off_n, p.a_bufs, p.b_bufs, p.ready, p.empty,
                        pos, kk, p.B_KN)
                pos += 1
        if p.SPLIT_TAIL and not p.TAIL_FIRST:
            pos = _load_tail_units(p, pos)
        _stamp(p, 13, loader_layout)

    @gluon.jit
    def _load_tail_units(p, pos):
        """The load warp's K-steps of this program's split tail units, in unit order, from ring
        position ``pos``; returns the next position."""
        for i in range(_tail_units(p)):
            _, t, _, k0, steps, _ = _tail_unit(p, i)
            step, seg, a_row, off_m, off_n = _flat_tile(p, t)
            for kk in range(steps):
                load_ab(p.a_desc, a_row, p.b_desc, off_n, p.a_bufs, p.b_bufs, p.ready, p.empty,
                        pos, k0 + kk, p.B_KN)
                pos += 1
        return pos

    @gluon.jit
    def _stage(c_buf, acc, dtype: gl.constexpr):
        """``acc`` rounded to ``dtype`` into the epilogue buffer ``c_buf`` once its last TMA
        store has read it out, fenced for the async proxy (a TMA store of it follows)."""
        tma.store_wait(0)
        c_buf.store(acc.to(dtype))
        fence_async_shared()

    @gluon.jit
    def _drain_stores(zero):
        """Every thread waits for its own bulk groups to complete (the issuing thread's are the
        TMA stores: complete, not merely read out of shared memory) and orders them before its
        later global accesses; ``zero`` is a ``[1]`` tensor the asm is applied to."""
        gl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;",
            "=r,r", [zero], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _stamp(p, slot, layout: gl.constexpr):
        """TRACE: ``%globaltimer`` into ``trace[program, slot]`` (:data:`WS_RS_PHASES`; every
        thread of the partition stores the same word); without TRACE nothing."""
        if p.TRACE:
            zero = gl.arange(0, 1, layout)
            now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero],
                                            dtype=gl.int64, is_pure=False, pack=1)
            gl.store(p.trace_ptr.to(gl.pointer_type(gl.int64), bitcast=True)
                     + gl.program_id(0) * _WS_TRACE_SLOTS + slot + zero, now)

    @gluon.jit
    def _wait_peers(p):
        """Wait (acquire, bounded; a timeout names the op and both ranks) for every peer's
        signal of this call's epoch."""
        my_flags = gl.load(p.flag_ptrs + p.rank).to(gl.pointer_type(gl.int32))
        for src in range(p.WORLD):
            if src != p.rank:
                wait_signal(my_flags + src, p.epoch, p.max_spins, p.err_ptr, _OP_GEMM_RS,
                            p.rank, src)

    @gluon.jit
    def _wait_row_group(p, off_m):
        """ROW_TURNS: wait (acquire, bounded; a timeout names the op, this rank and the peer)
        until every peer has counted in all its tiles of the row group of row ``off_m``."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        g = off_m // (BLOCK_M * p.GROUP_M)
        rows = gl.minimum(gl.cdiv(p.m_local, BLOCK_M) - g * p.GROUP_M, p.GROUP_M)
        my_flags = gl.load(p.flag_ptrs + p.rank).to(gl.pointer_type(gl.int32))
        for src in range(p.WORLD):
            if src != p.rank:
                wait_signal(_row_counter(p, my_flags, src, off_m), rows * gl.cdiv(p.N, BLOCK_N),
                            p.max_spins, p.err_ptr, _OP_GEMM_RS, p.rank, src)

    @gluon.jit
    def _arrive(p, layout: gl.constexpr):
        """Count this partition in at the grid barrier (see the module docstring)."""
        zero = gl.arange(0, 1, layout)  # a [1] tensor of 0: one thread owns its atomics
        _drain_stores(zero)
        partition_barrier()
        my_flags = gl.load(p.flag_ptrs + p.rank + zero).to(gl.pointer_type(gl.int32))
        counter = my_flags + p.WORLD
        arrived = gl.atomic_add(counter, 1 + zero, sem="acq_rel", scope="sys")
        last = arrived == p.PARTITIONS * p.NUM_PROGRAMS - 1
        gl.atomic_xchg(counter, zero, mask=last, sem="relaxed", scope="gpu")
        if p.ROW_TURNS:  # at the end of every partition's tiles: every own tile has read its
            # counters, and every peer's tile of this call was counted in before that. One
            # vector store per peer: a loop of single-thread atomics cost ~27 us per launch
            groups = gl.arange(0, _ROW_GROUPS, layout)
            is_last = (groups * 0 + gl.max(arrived, 0)) == p.PARTITIONS * p.NUM_PROGRAMS - 1
            for src in range(p.WORLD):
                gl.store(counter + 2 + src * _ROW_GROUPS + groups, groups * 0, mask=is_last)
            partition_barrier()  # every thread's reset before the epoch signals below
        gl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, $1;", "=r,r", [zero],
                                  dtype=gl.int32, is_pure=False, pack=1)
        if p.CE_PUSH:  # the copy engine delivers; it waits for this rank's "produced" word
            gl.atomic_xchg(my_flags + p.WORLD + 1, p.epoch + zero, mask=last, sem="relaxed",
                           scope="sys")
        else:
            for owner_step in gl.static_range(p.OWNER_STEPS):
                seg = segment_of_step(owner_step, p.rank, p.WORLD, True)
                owner_flags = gl.load(p.flag_ptrs + seg + zero).to(gl.pointer_type(gl.int32))
                gl.atomic_xchg(owner_flags + p.rank, p.epoch + zero, mask=last, sem="relaxed",
                               scope="sys")

    @gluon.jit
    def _mma_partition(p, C: gl.constexpr):
        if p.MERGE_ROWS:
            _merged_mma_partition(p, C)
        else:
            _segment_mma_partition(p, C)

    @gluon.jit
    def _merged_mma_partition(p, C: gl.constexpr):
        """MERGE_ROWS: MMA partition ``C``'s tiles of the ``[WORLD * m_local, N]`` partial, each
        stored into the slot ``r`` of every owner whose rows it reaches: by TMA (which clips
        the rows past the slot's end), or, for the owner whose segment starts inside the tile,
        by masked vector stores (:func:`_store_rows`); then the grid barrier and the spread
        reduction (:func:`_spread_reduce`)."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        dtype: gl.constexpr = p.out_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8 // p.PARTITIONS, 1], instr_shape=[16, BLOCK_N, 16])
        one_layout: gl.constexpr = gl.BlockedLayout([1], [32], [8 // p.PARTITIONS], [0])
        red_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8 // p.PARTITIONS, 1], [1, 0])
        k_tiles = gl.cdiv(p.K, BLOCK_K)
        c_buf = p.c_bufs.index(C)
        slot = (p.rank * p.m_local).to(gl.int64) * p.N  # this rank's slot in every owner's region
        for j in range(C, _num_tiles(p), p.PARTITIONS):
            step, seg, a_row, off_m, off_n = _tile(p, j)
            acc = mma_tile(p.a_bufs, p.b_bufs, p.ready, p.empty, p.handoff, j, k_tiles, C,
                           p.PARTITIONS, p.B_KN, BLOCK_M, BLOCK_N, acc_layout)
            _stage(c_buf, acc, dtype)
            for owner in gl.static_range(p.WORLD):
                first = owner * p.m_local
                if (a_row < first + p.m_local) & (a_row + BLOCK_M > first):
                    dst = gl.load(p.data_ptrs + owner).to(gl.pointer_type(dtype)) + slot
                    if a_row >= first:  # TMA clips the rows past the slot's end
                        push = tma.make_tensor_descriptor(dst, [p.m_local, p.N], [p.N, 1],
                                                          [BLOCK_M, BLOCK_N], p.out_desc.layout)
                        tma_store(push, [a_row - first, off_n], c_buf)
                    else:  # the tile starts in an earlier segment: TMA takes no negative row
                        _store_rows(c_buf, dst, a_row - first, off_n, p.m_local, p.N, red_layout)
        _arrive(p, one_layout)
        _stamp(p, 16 + 2 * C, one_layout)  # counted in
        tma.store_wait(0)
        _spread_reduce(p, C, red_layout)

    @gluon.jit
    def _store_rows(c_buf, dst, row0, off_n, m_local, N, layout: gl.constexpr):
        """Masked vector stores of the rounded tile in ``c_buf`` at rows ``row0 ..`` of the
        ``[m_local, N]`` slot at ``dst``, only the rows inside it (``row0`` < 0: a tile that
        starts in an earlier segment; a TMA store with a negative row raised an illegal
        instruction on H200). Between two barriers of the partition: every thread's tile is in
        ``c_buf`` before the reads, and every read is done before the next tile overwrites it."""
        BLOCK_M: gl.constexpr = c_buf.type.shape[0]
        BLOCK_N: gl.constexpr = c_buf.type.shape[1]
        partition_barrier()
        vals = c_buf.load(layout)
        rows = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, layout))
        cols = off_n + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
        mask = (rows[:, None] >= 0) & (rows[:, None] < m_local) & (cols[None, :] < N)
        gl.store(dst + (rows.to(gl.int64)[:, None] * N + cols[None, :]), vals, mask=mask)
        partition_barrier()

    @gluon.jit
    def _spread_reduce(p, C: gl.constexpr, layout: gl.constexpr):
        """Wait (acquire, bounded) until every rank, this one included, has pushed its partial
        of this rank's rows, then sum the ``WORLD`` slots in rank order ``0..W-1`` (+ bias) into
        ``out``, ``RED_M x RED_N`` chunks dealt round-robin over the grid's ``P G`` MMA
        partitions: :func:`.gemm_rs._spread_reduce`'s sum and order, so the same bits."""
        RED_M: gl.constexpr = 32
        RED_N: gl.constexpr = 256
        dtype: gl.constexpr = p.out_desc.dtype
        my_flags = gl.load(p.flag_ptrs + p.rank).to(gl.pointer_type(gl.int32))
        for peer in range(p.WORLD):
            wait_signal(my_flags + peer, p.epoch, p.max_spins, p.err_ptr, _OP_GEMM_RS, p.rank, peer)
        num_n = gl.cdiv(p.N, RED_N)
        workers: gl.constexpr = p.NUM_PROGRAMS * p.PARTITIONS
        for c in range(gl.program_id(0) * p.PARTITIONS + C, gl.cdiv(p.m_local, RED_M) * num_n,
                       workers):
            rows = (c // num_n) * RED_M + gl.arange(0, RED_M, gl.SliceLayout(1, layout))
            off_n = (c % num_n) * RED_N
            cols = off_n + gl.arange(0, RED_N, gl.SliceLayout(0, layout))
            mask = (rows[:, None] < p.m_local) & (cols[None, :] < p.N)
            offs = rows.to(gl.int64)[:, None] * p.N + cols[None, :]
            acc = gl.zeros([RED_M, RED_N], gl.float32, layout)
            for src in gl.static_range(p.WORLD):
                acc += gl.load(p.data_ptr + (p.m_local * src).to(gl.int64) * p.N + offs, mask=mask,
                               other=0.0).to(gl.float32)
            if p.HAS_BIAS:
                acc += gl.load(p.bias_ptr + cols, mask=cols < p.N, other=0.0).to(gl.float32)[None, :]
            gl.store(p.out_ptr + offs, acc.to(dtype), mask=mask)

    @gluon.jit
    def _segment_mma_partition(p, C: gl.constexpr):
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = p.a_desc.block_type.shape[1]
        dtype: gl.constexpr = p.out_desc.dtype
        # one warpgroup (ping-pong) or two stacked along M (cooperative)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8 // p.PARTITIONS, 1], instr_shape=[16, BLOCK_N, 16])
        one_layout: gl.constexpr = gl.BlockedLayout([1], [32], [8 // p.PARTITIONS], [0])
        nbytes: gl.constexpr = p.slots_desc.block_type.nbytes
        k_tiles = gl.cdiv(p.K, BLOCK_K)
        c_buf = p.c_bufs.index(C)
        slot = (p.rank * p.m_local).to(gl.int64) * p.N  # this rank's slot in every owner's region
        # the first peer step's destination, built once (the only one at TP 2)
        dst0 = gl.load(p.data_ptrs + segment_of_step(0, p.rank, p.WORLD, True)).to(
            gl.pointer_type(dtype)) + slot
        push0 = tma.make_tensor_descriptor(dst0, [p.m_local, p.N], [p.N, 1], [BLOCK_M, BLOCK_N],
                                           p.out_desc.layout)
        src0 = (p.rank == 0).to(gl.int32)  # the first peer in rank order
        arrived = 0
        waited = 0
        nload = 0
        n_tiles = _num_tiles(p)
        first = 0  # work items before the whole tiles: the split tail units, TAIL_FIRST
        if p.SPLIT_TAIL:
            n_units = _tail_units(p)
            unit0 = n_tiles  # the units' work items: the program's first or last
            if p.TAIL_FIRST:
                first = n_units
                unit0 = 0
            n_work = n_tiles + n_units
        else:
            n_work = n_tiles
        _stamp(p, 6 * C, one_layout)  # start
        for j in range(C, n_work, p.PARTITIONS):
            steps = k_tiles
            pos0 = j * k_tiles
            is_unit = False
            unit = gl.program_id(0)  # (a tensor: reassigned below)
            if p.SPLIT_TAIL:
                is_unit = (j >= unit0) & (j < unit0 + n_units)
                if is_unit:
                    _, unit_t, _, _, steps, unit = _tail_unit(p, j - unit0)
                    step, seg, a_row, off_m, off_n = _flat_tile(p, unit_t)
                    pos0 = unit0 * k_tiles + _tail_steps(p, j - unit0)
                else:
                    step, seg, a_row, off_m, off_n = _tile(p, j - first)
                    if p.TAIL_FIRST:  # the units' K-steps, recomputed (not held: spills)
                        pos0 = (j - first) * k_tiles + _tail_steps(p, first)
            else:
                step, seg, a_row, off_m, off_n = _tile(p, j)
            own = step == p.WORLD - 1
            # (a split part first counts in at the end: whole tiles, maybe producers, follow)
            if own and j >= first and arrived == 0 and not p.ROW_TURNS:
                _arrive(p, one_layout)
                _stamp(p, 16 + 2 * C, one_layout)  # counted in
                arrived = 1
            prefetched = 0
            if own and not is_unit and waited == 1 and not p.ROW_TURNS:
                # the peers' signals were acquired at an earlier own tile: load the first peer's
                # partial into the epilogue buffer now, beside this tile's MMAs
                tma.store_wait(0)
                mbarrier.expect(p.pload.index(C), nbytes)
                tma_load(p.slots_desc, [src0 * p.m_local + off_m, off_n], p.pload.index(C), c_buf)
                prefetched = 1
            _stamp(p, 6 * C + 1, one_layout)  # the last work item's start
            acc = mma_steps(p.a_bufs, p.b_bufs, p.ready, p.empty, p.handoff, j, pos0, steps, C,
                            p.PARTITIONS, p.B_KN, BLOCK_M, BLOCK_N, acc_layout)
            _stamp(p, 6 * C + 2, one_layout)  # its MMAs done
            if p.SPLIT_TAIL:
                if is_unit:
                    _publish_part(p, acc, unit, unit // p.sk_split, c_buf, one_layout)
                    _stamp(p, 6 * C + 4, one_layout)  # counted in
                elif own:
                    waited, nload = _reduce_own(p, acc, off_m, off_n, c_buf, C, src0, prefetched,
                                                waited, nload, acc_layout)
                else:
                    _push_partial(p, acc, seg, off_m, off_n, c_buf, push0, slot)
            else:
                if own:
                    waited, nload = _reduce_own(p, acc, off_m, off_n, c_buf, C, src0, prefetched,
                                                waited, nload, acc_layout)
                else:
                    _push_partial(p, acc, seg, off_m, off_n, c_buf, push0, slot)
            _stamp(p, 6 * C + 3, one_layout)  # its epilogue issued
        if arrived == 0:  # no whole own tile: count in anyway
            _arrive(p, one_layout)
            _stamp(p, 16 + 2 * C, one_layout)  # counted in
        if p.SPLIT_TAIL:
            # each unit's share of its tile's sum, by the partition that does not run the
            # program's last work item (ping-pong: the earlier to finish), after its count-in
            if n_work % p.PARTITIONS == C:
                for i in range(n_units):
                    _, unit_t, part, _, _, unit = _tail_unit(p, i)
                    step, seg, a_row, off_m, off_n = _flat_tile(p, unit_t)
                    waited = _sum_split_rows(p, unit // p.sk_split, part, off_m, off_n, waited,
                                             one_layout)
                _stamp(p, 15, one_layout)  # its shares summed
        tma.store_wait(0)
        _stamp(p, 6 * C + 5, one_layout)  # end

    @gluon.jit
    def _push_partial(p, acc, seg, off_m, off_n, c_buf, push0, slot):
        """A producer tile's epilogue: round, TMA-store into owner ``seg``'s slot ``rank``."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        dtype: gl.constexpr = p.out_desc.dtype
        _stage(c_buf, acc, dtype)
        if p.WORLD == 2:
            tma_store(push0, [off_m, off_n], c_buf)
        else:
            dst = gl.load(p.data_ptrs + seg).to(gl.pointer_type(dtype)) + slot
            push = tma.make_tensor_descriptor(dst, [p.m_local, p.N], [p.N, 1],
                                              [BLOCK_M, BLOCK_N], p.out_desc.layout)
            tma_store(push, [off_m, off_n], c_buf)
        if p.ROW_TURNS:  # count the tile in at the owner's counter of its row group
            one_layout: gl.constexpr = gl.BlockedLayout([1], [32], [8 // p.PARTITIONS], [0])
            zero = gl.arange(0, 1, one_layout)  # a [1] tensor of 0: one thread owns the atomic
            _drain_stores(zero)  # complete, not merely read out of shared memory
            partition_barrier()
            owner_flags = gl.load(p.flag_ptrs + seg + zero).to(gl.pointer_type(gl.int32))
            gl.atomic_add(_row_counter(p, owner_flags, p.rank, off_m), 1 + zero, sem="release",
                          scope="sys")

    @gluon.jit
    def _reduce_own(p, acc, off_m, off_n, c_buf, C: gl.constexpr, src0, prefetched, waited, nload,
                    acc_layout: gl.constexpr):
        """The reduction epilogue of an own tile: at the partition's first, wait (bounded) for
        every peer's signal; then each peer's partial tile TMA-loaded into ``c_buf`` (the first
        peer's already, when ``prefetched``) and added in rank order, bias once, the sum stored
        to ``out``. Returns ``(waited, nload)``."""
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        dtype: gl.constexpr = p.out_desc.dtype
        nbytes: gl.constexpr = p.slots_desc.block_type.nbytes
        one_layout: gl.constexpr = gl.BlockedLayout([1], [32], [8 // p.PARTITIONS], [0])
        if p.ROW_TURNS:  # every own tile: the peers' tiles of its row group all counted in
            _wait_row_group(p, off_m)
            fence_async_proxy(p.epoch, True)
        elif waited == 0:
            _wait_peers(p)
            fence_async_proxy(p.epoch, True)  # the TMA reads below follow the acquire
            _stamp(p, 17 + 2 * C, one_layout)  # the peers' signals acquired
            waited = 1
        for src in gl.static_range(p.WORLD):  # rank order; the own partial is acc
            if src != p.rank:
                if (prefetched == 0) | (src != src0):
                    tma.store_wait(0)
                    mbarrier.expect(p.pload.index(C), nbytes)
                    tma_load(p.slots_desc, [src * p.m_local + off_m, off_n], p.pload.index(C),
                             c_buf)
                mbarrier.wait(p.pload.index(C), nload & 1)
                nload += 1
                acc += c_buf.load(acc_layout).to(gl.float32)
                partition_barrier()  # every thread has read the buffer before reuse
                fence_async_shared()
        if p.HAS_BIAS:
            cols = off_n + gl.arange(0, BLOCK_N, gl.SliceLayout(0, acc_layout))
            acc += gl.load(p.bias_ptr + cols, mask=cols < p.N, other=0.0).to(gl.float32)[None, :]
        _stage(c_buf, acc, dtype)
        tma_store(p.out_desc, [off_m, off_n], c_buf)
        return waited, nload

    @gluon.jit
    def _publish_part(p, acc, unit, tile_index, c_buf, one_layout: gl.constexpr):
        """Round this unit's part of a split tail tile to the output dtype (as a peer's partial
        is) and TMA-store it into its scratch slot, drained (complete, not merely read out of
        shared memory) and ordered before the count; then count it in at the tile's counter
        (acq_rel, GPU scope, after every thread of the partition)."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        dtype: gl.constexpr = p.out_desc.dtype
        _stage(c_buf, acc, dtype)
        parts = p.parts_ptr.to(gl.pointer_type(dtype), bitcast=True)
        desc = tma.make_tensor_descriptor(parts, [p.sk_tiles * p.sk_split * BLOCK_M, BLOCK_N],
                                          [BLOCK_N, 1], [BLOCK_M, BLOCK_N], p.out_desc.layout)
        tma_store(desc, [unit * BLOCK_M, 0], c_buf)
        zero = gl.arange(0, 1, one_layout)
        _drain_stores(zero)
        partition_barrier()
        gl.atomic_add(p.counters_ptr + tile_index + zero, 1 + zero, sem="acq_rel", scope="gpu")

    @gluon.jit
    def _sum_split_rows(p, tile_index, part, off_m, off_n, waited, one_layout: gl.constexpr):
        """Part ``part``'s share of split tail tile ``tile_index``'s sum: wait (acquire, bounded)
        until all ``sk_split`` parts have counted in, and for every peer's signal unless this
        partition has; then sum its share of the tile's rows, chunks of ``TAIL_ROWS`` rows
        (:func:`.split_tail.tail_sum_rows`) dealt round-robin: per chunk the parts in fp32 in part order
        (fixed, so launches are bitwise repeatable), the peers' partials in rank order, bias once,
        stored to ``out``. Then count out; the last part out resets the counter for the next
        launch. Returns 1: the peers' signals are acquired. The wait needs every program of the
        grid resident at once, as the waits for the peers' signals already do (``docs/design.md``,
        "Other kernels beside a fused grid"); then it cannot deadlock: a part is published right
        after its MMAs, which wait for nothing but the program's own loads, and the sum runs after
        the partition's last work item and its count-in at the grid barrier, so the peers' signals
        never wait for a split tail."""
        BLOCK_M: gl.constexpr = p.out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = p.out_desc.block_type.shape[1]
        RED_M: gl.constexpr = p.TAIL_ROWS
        dtype: gl.constexpr = p.out_desc.dtype
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8 // p.PARTITIONS, 1], [1, 0])
        counter = p.counters_ptr + tile_index
        wait_signal(counter, p.sk_split, p.max_spins, p.err_ptr, _OP_SPLIT_TAIL, p.rank,
                    tile_index)
        if waited == 0:
            _wait_peers(p)
        _stamp(p, 14, one_layout)  # every part in, peers acquired
        parts = p.parts_ptr.to(gl.pointer_type(dtype), bitcast=True)
        first = (tile_index * p.sk_split).to(gl.int64) * (BLOCK_M * BLOCK_N)
        for chunk in range(part, BLOCK_M // RED_M, p.sk_split):
            r = chunk * RED_M + gl.arange(0, RED_M, gl.SliceLayout(1, layout))
            c = gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
            in_tile = r[:, None] * BLOCK_N + c[None, :]
            rows = off_m + r
            cols = off_n + c
            mask = (rows[:, None] < p.m_local) & (cols[None, :] < p.N)
            acc = gl.zeros([RED_M, BLOCK_N], gl.float32, layout)
            for q in range(p.sk_split):
                acc += gl.load(parts + first + q * (BLOCK_M * BLOCK_N) + in_tile,
                               cache_modifier=".cg").to(gl.float32)
            offs = rows.to(gl.int64)[:, None] * p.N + cols[None, :]
            for src in gl.static_range(p.WORLD):  # rank order; the own partial is the parts' sum
                if src != p.rank:
                    acc += gl.load(p.data_ptr + (p.m_local * src).to(gl.int64) * p.N + offs,
                                   mask=mask, other=0.0).to(gl.float32)
            if p.HAS_BIAS:
                acc += gl.load(p.bias_ptr + cols, mask=cols < p.N, other=0.0).to(gl.float32)[None, :]
            gl.store(p.out_ptr + offs, acc.to(dtype), mask=mask)
        zero = gl.arange(0, 1, one_layout)
        partition_barrier()  # every thread's loads of the parts are done
        out_count = gl.atomic_add(counter + zero, 1 + zero, sem="relaxed", scope="gpu")
        gl.atomic_xchg(counter + zero, zero, mask=out_count == 2 * p.sk_split - 1,
                       sem="relaxed", scope="gpu")
        return 1  # the peers' signals acquired

    @gluon.jit
    def _mma_partition_1(p):
        _mma_partition(p, 1)

    @gluon.jit(do_not_specialize=["rank", "epoch", "max_spins", "sk_tiles", "sk_split"])
    def gemm_rs_ws_kernel(a_ptr, b_ptr, out_ptr, data_ptr, data_ptrs, flag_ptrs, bias_ptr, err_ptr,
                          trace_ptr, parts_ptr, counters_ptr, a_hd, b_hd, out_hd, slots_hd,
                          m_local, N, K, ldb, rank, epoch, max_spins, sk_tiles, sk_split,
                          WORLD: gl.constexpr,
                          B_KN: gl.constexpr, HAS_BIAS: gl.constexpr, CE_PUSH: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                          PARTITIONS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          MERGE_ROWS: gl.constexpr = False, INTERLEAVE: gl.constexpr = False,
                          ROW_TURNS: gl.constexpr = False, HOST_DESC: gl.constexpr = False,
                          SPLIT_TAIL: gl.constexpr = False, TAIL_ROWS: gl.constexpr = 16,
                          TAIL_FIRST: gl.constexpr = False, TRACE: gl.constexpr = False):
        """``a`` ``[WORLD * m_local, K]``; ``b`` ``[K, N]`` row-major (B_KN) or a transposed
        row-major ``[N, K]`` (leading stride ``ldb``); ``out`` ``[m_local, N]``; ``data_ptr``
        this rank's ``[WORLD, m_local, N]`` slot region of this call's parity; ``data_ptrs`` /
        ``flag_ptrs`` every rank's slot region and signal words (as
        :func:`.gemm_rs.gemm_rs_kernel`); ``PARTITIONS`` MMA partitions (2: ping-pong, 1:
        cooperative). Launch with :func:`.gluon_ws.launch_options`; descriptors are built on
        the device, or with HOST_DESC are ``a_hd`` / ``b_hd`` / ``out_hd`` / ``slots_hd``,
        encoded on the host with the same views and layouts (:func:`_host_descriptors`; the
        peers' push descriptors stay device-built). MERGE_ROWS: one tile space over every
        rank's rows, pushed by owner, then the spread reduction (:func:`_merged_mma_partition`).
        ROW_TURNS: the owners' row groups in turn, a counter per (peer, row group) instead of
        the grid barrier before the own tiles (the module docstring).
        SPLIT_TAIL: the last ``sk_tiles`` flat tiles (own ones) are split along K in ``sk_split``
        parts, dealt round-robin over the programs, each rounded to the output dtype in
        ``parts_ptr``, counted at ``counters_ptr`` and summed in fp32 (:func:`.split_tail.split_tail_plan`),
        each part its program's first work item with TAIL_FIRST, else its last
        (:func:`.split_tail.split_tail_first`); without SPLIT_TAIL those are unused."""
        dtype: gl.constexpr = a_ptr.dtype.element_ty
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        b_desc, b_bufs = b_operand(b_ptr, b_hd, K, N, ldb, B_KN, BLOCK_N, BLOCK_K, STAGES,
                                   HOST_DESC)
        a_desc = tma_descriptor(a_ptr, a_hd, [WORLD * m_local, K], [K, 1], [BLOCK_M, BLOCK_K],
                                a_layout, HOST_DESC)
        out_desc = tma_descriptor(out_ptr, out_hd, [m_local, N], [N, 1], [BLOCK_M, BLOCK_N],
                                  c_layout, HOST_DESC)
        # this rank's slots as one [WORLD * m_local, N] matrix (m_local % BLOCK_M == 0: no tile
        # crosses a slot)
        slots_desc = tma_descriptor(data_ptr, slots_hd, [WORLD * m_local, N], [N, 1],
                                    [BLOCK_M, BLOCK_N], c_layout, HOST_DESC)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        c_bufs = gl.allocate_shared_memory(dtype, [PARTITIONS, BLOCK_M, BLOCK_N], c_layout)
        ready, empty, handoff = ring_barriers(STAGES)
        pload = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(pload.index(i), count=1)
        p = _Args(a_desc, b_desc, out_desc, slots_desc, a_bufs, b_bufs, c_bufs, ready, empty,
                  handoff, pload, data_ptr, out_ptr, data_ptrs, flag_ptrs, bias_ptr, err_ptr,
                  trace_ptr, parts_ptr, counters_ptr, m_local, N, K, rank, epoch, max_spins,
                  sk_tiles, sk_split, WORLD, B_KN, HAS_BIAS, CE_PUSH, GROUP_M, NUM_PROGRAMS,
                  PARTITIONS, MERGE_ROWS, INTERLEAVE, ROW_TURNS, SPLIT_TAIL, TAIL_ROWS, TAIL_FIRST,
                  TRACE)
        if PARTITIONS == 2:
            gl.warp_specialize([(_mma_partition, (p, 0)), (_mma_partition_1, (p, )),
                                (_load_partition, (p, ))], [4, 1], [CONSUMER_REGS, 24])
        else:
            gl.warp_specialize([(_mma_partition, (p, 0)), (_load_partition, (p, ))], [1], [24])
else:  # pragma: no cover
    gemm_rs_ws_kernel = None


smem_bytes = gluon_ws.smem_bytes
warn_fallback = gluon_ws.FallbackWarning("GEMM+RS", "rs_warp_specialized")


def unsupported_reason(a, m_local: int, cfg, *, trace=None, produce=True, consume=True) -> Optional[str]:
    """Why this call cannot run :func:`gemm_rs_ws_kernel` (None: it can)."""
    if GLUON_ERROR is None and not interpreting() and (trace is not None or not (produce and consume)):
        return ("RS_PHASES phase traces and split phases exist only in the Triton kernel (this "
                "one's own stamps: launch_gemm_rs_ws(trace=...), WS_RS_PHASES)")
    if cfg.rs_row_turns and a.is_cuda and torch.cuda.is_current_stream_capturing():
        return ("rs_row_turns is not captured into CUDA graphs (its row counters are reset by "
                "the owner's last program, which a replay's order does not cover)")
    return gluon_ws.environment_reason(a) or shape_reason(m_local, a.shape[1], cfg,
                                                          a.element_size())


def shape_reason(m_local: int, k: int, cfg, element_size: int = 2) -> Optional[str]:
    """The part of :func:`unsupported_reason` that depends on the shape and the config alone
    (``megatron-flux plan`` asks it without a GPU)."""
    if cfg.rs_merge_rows and m_local == 1:  # Triton makes an argument equal to 1 a constant,
        return "1 row per rank"  # which the kernel's arguments (tensors) cannot hold
    if cfg.rs_row_turns and row_groups(m_local, cfg) > ROW_GROUPS:
        return (f"rs_row_turns counts at most {ROW_GROUPS} row groups of block_m * group_m rows "
                f"per rank ({m_local} rows)")
    # merged rows: row tiles may span segments, so any m_local
    return gluon_ws.shape_reason(None if cfg.rs_merge_rows else m_local, k, cfg, element_size)


def _host_descriptors(a, b, out, data, world, m_local, n, k, ldb, b_kn, cfg):
    """``(a, b, out, slots)`` host descriptors of the views :func:`gemm_rs_ws_kernel` builds
    on the device without HOST_DESC."""
    hd = gluon_ws.host_descriptor
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    return (hd(a, [world * m_local, k], [k, 1], [bm, bk]),
            gluon_ws.b_host_descriptor(b, n, k, ldb, b_kn, cfg),
            hd(out, [m_local, n], [n, 1], [bm, bn]),
            hd(data, [world * m_local, n], [n, 1], [bm, bn]))


def launch_gemm_rs_ws(a, b, out, data, data_ptrs, flag_ptrs, bias, err, *, rank, world, epoch,
                      cfg, num_sms, max_spins, host_descriptors=True, direct=True, trace=None):
    """:func:`gemm_rs_ws_kernel` on the current stream, with :func:`.gemm_rs.launch_gemm_rs`'s
    arguments (the caller has checked :func:`unsupported_reason`). ``cfg`` gives block_m/n/k,
    num_stages, group_m and rs_copy_engine, and its num_warps the form (4: ping-pong, 8:
    cooperative; :func:`.gluon_ws.launch_options`). ``host_descriptors`` and
    ``direct``: as :func:`.gemm_rs.launch_gemm_rs`."""
    m, k = a.shape
    m_local = m // world
    n, b_kn, ldb, grid = gluon_ws.launch_geometry(b, m_local, world, cfg, num_sms)
    host_desc = bool(host_descriptors)
    descs = (_host_descriptors(a, b, out, data, world, m_local, n, k, ldb, b_kn, cfg)
             if host_desc else (err, err, err, err))  # unused without HOST_DESC
    sk_tiles, sk_split = split_tail.split_tail_plan(world, m_local, n, k, cfg, grid)
    parts = counters = err  # never touched without a split tail
    if sk_split > 1:
        scratch = stream_k.stream_k_scratch(a.device, grid, cfg.block_m, cfg.block_n)
        parts, counters = scratch.partials, scratch.counters
    ensure_descriptor_allocator()
    _LAUNCH(grid, (a, b, out, data, data_ptrs, flag_ptrs, bias if bias is not None else data, err,
                   trace if trace is not None else err, parts, counters, *descs, m_local, n, k,
                   ldb, rank, epoch, max_spins, sk_tiles, sk_split),
            dict(HOST_DESC=host_desc, WORLD=world, B_KN=b_kn, HAS_BIAS=bias is not None,
                 CE_PUSH=cfg.rs_copy_engine, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
                 NUM_PROGRAMS=grid, PARTITIONS=gluon_ws.mma_partitions(cfg),
                 CONSUMER_REGS=CONSUMER_REGS, MERGE_ROWS=cfg.rs_merge_rows,
                 INTERLEAVE=interleaves_owners(cfg, m_local), ROW_TURNS=cfg.rs_row_turns,
                 SPLIT_TAIL=sk_split > 1, TAIL_ROWS=split_tail.tail_sum_rows(cfg, sk_split),
                 TAIL_FIRST=sk_split > 1 and split_tail.split_tail_first(world, m_local, n, cfg, grid),
                 TRACE=trace is not None),
            num_stages=None, direct=direct, **gluon_ws.launch_options(cfg))


def interleaves_owners(cfg, m_local: int) -> bool:
    """Whether a launch walks the owners' row tiles in turn (``rs_interleave_owners``, INTERLEAVE):
    merged rows whose every row tile lies in one owner's rows (``m_local`` a multiple of
    ``block_m``); elsewhere the knob leaves the order as it is."""
    return bool(cfg.rs_interleave_owners and cfg.rs_merge_rows and m_local % cfg.block_m == 0)


_LAUNCH = KernelLauncher(gemm_rs_ws_kernel) if gemm_rs_ws_kernel is not None else None
