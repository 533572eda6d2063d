"""Kernel checks under the Triton CPU interpreter, with simulated ranks in one process.

Run by ``tests/unit/test_kernels_interpret.py`` in a subprocess with ``TRITON_INTERPRET=1`` (the
variable must be set before the kernels are imported, so it cannot share the pytest process).
Peers are plain CPU tensors; an int64 tensor of their addresses is the peer-pointer table.
Interpreted programs run one after another, so a kernel whose waits depend on another rank's
kernel runs in phases: every rank's producer first, then every rank's consumer.

``python -m helpers.interpret_checks [CHECK...]`` (with ``tests/`` on ``PYTHONPATH``) prints one
JSON object ``{check_name: null | failure}``.
"""

import json
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megatron_flux.tools.diagnostics.plain_gemm import launch_plain_gemm  # noqa: E402
from megatron_flux.kernels.ag_gemm import launch_ag_gemm  # noqa: E402
from megatron_flux.kernels.config import GemmConfig, rs_signal_count  # noqa: E402
from megatron_flux.kernels.gemm_rs import launch_gemm_rs, rs_staging_table  # noqa: E402
from megatron_flux.kernels.stream_k import _slot_ptrs, sk_covering, sk_range  # noqa: E402
from megatron_flux.kernels.tile_order import tile_order_probe_kernel  # noqa: E402

CFG = GemmConfig(block_m=16, block_n=32, block_k=16, num_stages=1, num_warps=4, group_m=2,
                 chunk_rows=8, epilogue_split=2)
#: GEMM+RS pushing with vector stores, one epilogue store per tile; the spread reduction; every
#: rank's rows in one tile space (small m's default)
MERGED_RS = GemmConfig(**{**CFG.to_dict(), "rs_spread_reduce": True, "rs_tma_push": False,
                          "rs_merge_rows": True})
RS_CFGS = (CFG, GemmConfig(**{**CFG.to_dict(), "rs_tma_push": False, "epilogue_split": 1}),
           GemmConfig(**{**CFG.to_dict(), "rs_spread_reduce": True}), MERGED_RS)
DTYPE = torch.float16
TOL = 2e-3
NSMS = 5  # simulated persistent grid


def _rel(x, ref):
    return float((x.float() - ref).norm() / ref.norm())


def _dot_is_row_invariant() -> bool:
    """Whether this process's float32 matmul, which the interpreter's ``tl.dot`` runs
    (``np.matmul`` with a float32 result), gives a row the same bits wherever the row sits in
    the tile. The GPU's MMA does, so two schedules that put the same rows at different places in
    their tiles (merged vs per-segment rows) are bitwise equal there. OpenBLAS's Haswell kernels
    are not row-invariant (``OPENBLAS_CORETYPE=Haswell``, which some machines here set: every row
    of a 32x32 product changed bits when the rows were rotated), so there such schedules agree
    only up to the last rounding."""
    rng = np.random.default_rng(0)
    for m, k, n in ((16, 16, 32), (64, 16, 32), (32, 32, 64)):
        a = rng.standard_normal((m, k)).astype(np.float16).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float16).astype(np.float32)
        c = np.matmul(a, b, dtype=np.float32)
        for shift in (1, m // 2 + 1):
            moved = np.matmul(np.roll(a, shift, axis=0), b, dtype=np.float32)
            if not np.array_equal(np.roll(moved, -shift, axis=0), c):
                return False
    return True


DOT_ROW_INVARIANT = _dot_is_row_invariant()


def _assert_schedules_agree(out, base, label):
    """``out`` and ``base`` come from two schedules that give every element the same K order and
    the same rank order in its sum, but may put its row at another place in a tile: bitwise
    equal where the interpreter's dot is row-invariant (:func:`_dot_is_row_invariant`), else
    equal up to the roundings of the partials (a few output ulps at the tensor's scale). A row
    or column landing in the wrong place differs by the values' own size, so either check
    catches it."""
    if DOT_ROW_INVARIANT:
        assert torch.equal(out, base), f"{label}: not bitwise equal"
        return
    diff = float((out.float() - base.float()).abs().max())
    bound = 4 * torch.finfo(out.dtype).eps * float(base.float().abs().max())
    assert diff <= bound, f"{label}: differs by {diff} (> {bound}, beyond rounding)"


def _probe(rank, world, num_pid_m, num_pid_n, own_last):
    total = world * num_pid_m * num_pid_n
    out = torch.full((total, 5), -1, dtype=torch.int32)
    tile_order_probe_kernel[(NSMS,)](out, rank, world, num_pid_m, num_pid_n,
                                     OWN_LAST=own_last, GROUP_M=2, NUM_SMS=NSMS)
    return out


def check_tile_order():
    """Every tile once; AG visits its own segment first, RS last; ring order; each step starts
    on the tile (same rows and columns) the previous one ended on; at every step the ranks
    address pairwise distinct segments (no two ranks on one owner)."""
    for world in (2, 4, 8):
        num_pid_m, num_pid_n = 3, 4
        tps = num_pid_m * num_pid_n
        for own_last in (False, True):
            segs_at_step = {}
            for rank in range(world):
                out = _probe(rank, world, num_pid_m, num_pid_n, own_last)
                assert (out >= 0).all(), "a tile was never visited"
                seen = {(int(s), int(pm), int(pn)) for _, s, pm, pn, _ in out.tolist()}
                assert len(seen) == world * tps, f"tiles visited more than once (world={world})"
                for t, (step, seg, pm, pn, prog) in enumerate(out.tolist()):
                    assert step == t // tps and prog == t % NSMS
                    expect = (rank + 1 + step) % world if own_last else (rank + step) % world
                    assert seg == expect, f"world={world} rank={rank} step={step}: segment {seg}"
                    segs_at_step.setdefault(step, []).append(seg)
                rows = out.tolist()
                for step in range(1, world):  # serpentine: a step starts where the last ended
                    assert rows[step * tps][2:4] == rows[step * tps - 1][2:4], \
                        f"world={world} rank={rank}: step {step} does not start on the seam"
                own = [s for st, s, *_ in out.tolist() if s == rank]
                assert own and all(st == (world - 1 if own_last else 0)
                                   for st, s, *_ in out.tolist() if s == rank)
            for step, segs in segs_at_step.items():
                by_rank = segs[::tps]  # one entry per rank
                assert len(set(by_rank)) == world, f"ranks contend at step {step}: {by_rank}"


def check_row_turn_order():
    """GEMM+RS's row groups in turn (``tile_order.row_turn``, ``rs_row_turns``): every tile
    once; groups one after another, each the peers' tiles (steps before the last, ring order)
    before the own ones, in every shape of a shorter last group, one group, and groups of one
    row tile; the segment of a step as without the turns."""
    for world in (2, 4):
        for num_pid_m, num_pid_n, group_m in ((5, 3, 2), (4, 3, 2), (3, 2, 4), (4, 1, 1)):
            tps = num_pid_m * num_pid_n
            for rank in range(world):
                out = torch.full((world * tps, 5), -1, dtype=torch.int32)
                tile_order_probe_kernel[(NSMS,)](out, rank, world, num_pid_m, num_pid_n,
                                                 OWN_LAST=True, GROUP_M=group_m, NUM_SMS=NSMS,
                                                 ROW_TURNS=True, WORLD=world)
                rows = out.tolist()
                assert min(min(r) for r in rows) >= 0, "a tile was never visited"
                seen = {(s, pm, pn) for _, s, pm, pn, _ in rows}
                assert len(seen) == world * tps, (world, num_pid_m, num_pid_n, group_m, rank)
                groups = [pm // group_m for _, _, pm, _, _ in rows]
                assert groups == sorted(groups), "row groups out of turn"
                for t, (step, seg, pm, pn, prog) in enumerate(rows):
                    assert seg == (rank + 1 + step) % world and prog == t % NSMS
                for g in set(groups):
                    steps = [step for (step, *_), gg in zip(rows, groups) if gg == g]
                    assert steps == sorted(steps), f"group {g}: a step out of order {steps}"
                    assert steps.count(world - 1) == (min(num_pid_m, (g + 1) * group_m)
                                                      - g * group_m) * num_pid_n


def _ag_case(world, m_local, k, n, b_kn):
    xs = [torch.randn(m_local, k).to(DTYPE) for _ in range(world)]
    b = torch.randn(k, n).to(DTYPE) if b_kn else torch.randn(n, k).to(DTYPE).t()
    return xs, b, torch.cat(xs).float() @ b.float()


def _gathered_by(rank, xs, own=False):
    """Rank ``rank``'s gathered workspace after the peers' copies: every peer's rows in place,
    its own rows NaN (the kernel must read those from its shard, never from here) unless
    ``own`` (``ag_merge_local``: the host copied them there too)."""
    m_local, k = xs[0].shape
    ag = torch.full((len(xs) * m_local, k), float("nan")).to(DTYPE)
    for s, x in enumerate(xs):
        if s != rank or own:
            ag[s * m_local:(s + 1) * m_local] = x
    return ag


def _ag_on_rank(xs, b, rank, cfg, label):
    """Rank ``rank``'s AG+GEMM output (every peer chunk signalled, output poisoned first), after
    checking that every element was written and no wait timed out."""
    world, (m_local, _) = len(xs), xs[0].shape
    flags = torch.full((world * triton.cdiv(m_local, cfg.chunk_rows),), 7, dtype=torch.int32)
    err = torch.zeros(4, dtype=torch.int32)
    out = torch.full((world * m_local, b.shape[1]), float("nan")).to(DTYPE)
    launch_ag_gemm(xs[rank], _gathered_by(rank, xs, own=cfg.ag_merge_local), b, out, flags, err,
                   rank=rank, world=world, epoch=7, cfg=cfg, num_sms=NSMS, max_spins=10)
    assert not torch.isnan(out).any(), f"unwritten output ({label})"
    assert err.tolist() == [0, 0, 0, 0], (label, err.tolist())
    return out


def check_ag_gemm_all_ranks():
    """AG+GEMM output on every rank of TP 2/4/8, aligned and ragged m_local, both B layouts."""
    for world, m_local, b_kn in ((2, 32, False), (4, 20, True), (8, 9, False), (4, 48, False)):
        xs, b, ref = _ag_case(world, m_local, 32, 64, b_kn)
        for rank in range(world):
            e = _rel(_ag_on_rank(xs, b, rank, CFG, f"{world=} {rank=}"), ref)
            assert e < TOL, f"world={world} rank={rank} m_local={m_local}: rel err {e}"


def check_ag_stream_k():
    """The stream-K tail at TP 1/2/4: same product as the data-parallel schedule on every rank
    (aligned and ragged m_local, tiles split over 2-4 programs), bitwise identical when
    repeated, every counter back at zero; and the plan's rule (small tails only)."""
    import dataclasses

    from megatron_flux.kernels import stream_k as SK

    # (world, m_local, k, n, grid): tiles = world * cdiv(m_local, 16) * cdiv(n, 32); the
    # tail (tiles % grid) is at most 0.35 of the grid and lies in the last segment
    cases = [(2, 64, 64, 64, 5), (1, 48, 48, 96, 4), (1, 40, 64, 64, 5), (4, 40, 32, 64, 11),
             (2, 48, 80, 32, 5), (2, 25, 64, 64, 7)]
    cfg = dataclasses.replace(CFG, stream_k=1)
    for world, m_local, k, n, grid in cases:
        xs, b, ref = _ag_case(world, m_local, k, n, False)
        tps = triton.cdiv(m_local, CFG.block_m) * triton.cdiv(n, CFG.block_n)
        chunks = triton.cdiv(m_local, CFG.chunk_rows)
        _, sk = SK.stream_k_plan(world * tps, grid, 1, tps)
        assert sk > 0, (world, m_local, n, grid)
        for rank in range(world):
            ag = _gathered_by(rank, xs)
            flags = torch.full((world * chunks,), 7, dtype=torch.int32)
            runs = []
            for _ in range(2):
                err = torch.zeros(4, dtype=torch.int32)
                out = torch.full((world * m_local, n), float("nan")).to(DTYPE)
                launch_ag_gemm(xs[rank], ag, b, out, flags, err, rank=rank, world=world,
                               epoch=7, cfg=cfg, num_sms=grid, max_spins=10)
                assert err.tolist() == [0, 0, 0, 0], err.tolist()
                assert not torch.isnan(out).any(), f"unwritten tile {(world, rank)}"
                runs.append(out.clone())
            where = f"world={world} rank={rank} m_local={m_local} grid={grid} sk={sk}"
            assert _rel(runs[0], ref) < TOL, f"{where}: rel err {_rel(runs[0], ref)}"
            assert torch.equal(runs[0], runs[1]), f"{where}: not bitwise repeatable"
            assert int(SK._SCRATCH[("cpu",)].counters.abs().sum()) == 0, f"{where}: counters"
    # the plan (132 SMs; 128x256 tiles of the TP=2 grid: llama3-8b fc1 m=1024 has 448 tiles)
    assert SK.stream_k_plan(3584, 132, 0, 1792) == (132, 0)
    assert SK.stream_k_plan(3584, 132, 1, 1792) == (132, 20)  # llama3-70b m=4096: tail 0.15
    assert SK.stream_k_plan(3072, 132, 1, 1536) == (132, 36)  # gpt3-175b m=4096: tail 0.27
    assert SK.stream_k_plan(448, 132, 1, 224) == (132, 0)  # tail 0.39 of a wave: not split
    assert SK.stream_k_plan(1792, 132, 1, 896) == (132, 0)  # tail 0.58: not split
    assert SK.stream_k_plan(396, 132, 1, 198) == (132, 0)  # whole waves: nothing to split
    assert SK.stream_k_plan(100, 132, 1, 100) == (100, 0)  # below one wave
    assert SK.stream_k_plan(3584, 132, 1, 10) == (132, 0)  # would span two segments
    # Slots: within one launch no two partial writes share a slot. (The interpreter runs
    # programs one after another, so a program finishes its first tile before it writes its
    # next partial; the math above cannot see a slot reused by the same program, the GPU can.)
    for sk_tiles, k_tiles, grid in ((3, 4, 5), (7, 10, 4), (20, 64, 132), (1, 64, 132), (5, 3, 2)):
        partials = torch.zeros(grid * 2 * 4)
        log = torch.zeros(grid * 8, dtype=torch.float32)
        _sk_slot_probe[(grid,)](partials, log, sk_tiles, k_tiles, NUM_SMS=grid)
        written = sorted(v for v in log.tolist() if v)
        kept = sorted(v for v in partials.tolist() if v)
        assert written and written == sorted(set(kept)), \
            f"slot reused (sk_tiles={sk_tiles}, k_tiles={k_tiles}, grid={grid})"


@triton.jit
def _sk_slot_probe(partials_ptr, log_ptr, sk_tiles, k_tiles, NUM_SMS: tl.constexpr):
    """Walk each program's stream-K range as the AG kernel does and write a marker
    ``1 + u * NUM_SMS + pid`` (a 2x2 block) into the slot of every partial tile part; log it."""
    pid = tl.program_id(0)
    it, end, per = sk_range(pid, sk_tiles, k_tiles, NUM_SMS)
    n = 0
    while it < end:
        u = it // k_tiles
        first, last = sk_covering(u, per, k_tiles)
        if first != last:
            marker = (1 + u * NUM_SMS + pid).to(tl.float32)
            tl.store(_slot_ptrs(partials_ptr, pid, u, per, k_tiles, 2, 2),
                     tl.full((2, 2), 0.0, tl.float32) + marker)
            tl.store(log_ptr + pid * 8 + n, marker)
            n += 1
        it = (u + 1) * k_tiles


def check_ag_merged_local():
    """AG+GEMM with the local segment merged with the first peer's (``ag_merge_local``): the
    same product, bitwise equal to the per-segment schedule (up to rounding where the
    interpreter's dot is not row-invariant: :func:`_assert_schedules_agree`), at TP 2 (every
    rank), 4 and 8 (two ranks; the later peers' segments one at a time after the merged one,
    unrolled and in a runtime loop), aligned (two row tiles per segment) and ragged (one)
    m_local, leads of 0 waves (wait for every peer first, then the gathered rows as one
    operand: at ragged m_local its row tiles span segments), 1 (some columns local-only) and 2
    (every column: nothing left after the wait but the peer's rows). The own rows are in the
    workspace (the host copies them before the kernel). With 5 column tiles and a 5-program
    grid, lead 1 covers 3 columns at two row tiles per segment, 5 at one."""
    import dataclasses

    cases = [  # world, m_local, ranks, leads
        (2, 32, (0, 1), (0, 1, 2)),
        (2, 9, (0, 1), (0, 1)),
        (4, 20, (1, 3), (1, 0)),
        (8, 9, (5,), (1, 0)),
    ]
    for world, m_local, ranks, leads in cases:
        xs, b, ref = _ag_case(world, m_local, 32, 160, False)
        for rank in ranks:
            base = _ag_on_rank(xs, b, rank, CFG, f"{world=} {rank=} per-segment")
            for lead in leads:
                cfg = dataclasses.replace(CFG, ag_merge_local=True, ag_merge_lead=lead)
                label = f"{world=} {rank=} {m_local=} {lead=}"
                out = _ag_on_rank(xs, b, rank, cfg, label)
                e = _rel(out, ref)
                assert e < TOL, f"{label}: rel err {e}"
                _assert_schedules_agree(out, base, f"{label} against the per-segment one")


def check_ag_merged_signals():
    """Merged local rows: a missing or stale chunk signal of any peer (the merged one's or a
    later one's) is the one reported (index segment * chunks + c); the local segment's signals
    are never waited for (its rows are copied into the workspace before the kernel, in stream
    order)."""
    import dataclasses

    world, m_local, k, n, rank = 4, 24, 16, 32, 1
    xs, b, _ = _ag_case(world, m_local, k, n, False)
    chunks = triton.cdiv(m_local, CFG.chunk_rows)
    for lead in (0, 1):
        cfg = dataclasses.replace(CFG, ag_merge_local=True, ag_merge_lead=lead)
        for missing_seg in (2, 3, 0):
            for missing_chunk in range(chunks):
                flags = torch.full((world * chunks,), 5, dtype=torch.int32)
                flags[rank * chunks:(rank + 1) * chunks] = 0  # own rows: never signalled
                idx = missing_seg * chunks + missing_chunk
                flags[idx] = 4  # previous epoch
                err = torch.zeros(4, dtype=torch.int32)
                out = torch.empty(world * m_local, n, dtype=DTYPE)
                launch_ag_gemm(xs[rank], _gathered_by(rank, xs, own=True), b, out, flags, err,
                               rank=rank, world=world, epoch=5, cfg=cfg, num_sms=NSMS,
                               max_spins=3)
                assert err.tolist() == [1, rank, idx, 4], (lead, missing_seg, missing_chunk,
                                                           err.tolist())
        flags = torch.full((world * chunks,), 5, dtype=torch.int32)
        flags[rank * chunks:(rank + 1) * chunks] = 0
        err = torch.zeros(4, dtype=torch.int32)
        out = torch.full((world * m_local, n), float("nan")).to(DTYPE)
        launch_ag_gemm(xs[rank], _gathered_by(rank, xs, own=True), b, out, flags, err,
                       rank=rank, world=world, epoch=5, cfg=cfg, num_sms=NSMS, max_spins=3)
        assert err.tolist() == [0, 0, 0, 0] and not torch.isnan(out).any(), err.tolist()


def check_ag_signal_indexing():
    """A missing chunk signal is the one the kernel reports: index = segment * chunks + chunk,
    the local segment needs no signal, a stale epoch does not count (per segment)."""
    world, m_local, k, n, rank = 4, 24, 16, 32, 1
    xs, b, _ = _ag_case(world, m_local, k, n, False)
    chunks = triton.cdiv(m_local, CFG.chunk_rows)
    for missing_seg in (0, 2, 3):
        for missing_chunk in range(chunks):
            flags = torch.full((world * chunks,), 5, dtype=torch.int32)
            flags[rank * chunks:(rank + 1) * chunks] = 0  # own rows: never signalled or read
            idx = missing_seg * chunks + missing_chunk
            flags[idx] = 4  # previous epoch
            err = torch.zeros(4, dtype=torch.int32)
            ag = torch.randn(world * m_local, k).to(DTYPE)
            out = torch.empty(world * m_local, n, dtype=DTYPE)
            launch_ag_gemm(xs[rank], ag, b, out, flags, err, rank=rank, world=world,
                           epoch=5, cfg=CFG, num_sms=NSMS, max_spins=3)
            assert err.tolist() == [1, rank, idx, 4], (missing_seg, missing_chunk, err.tolist())


def check_next_call_cannot_release_a_wait():
    """TP=3, workspace of simulated ranks: rank 0 in call 5 has rank 1's chunks but not rank 2's;
    rank 1, already in call 6 under a layout with twice the chunks, has signalled segment 1 into
    rank 0's signals. Rank 0's kernel must keep waiting on rank 2 (and time out here), not take
    rank 1's call-6 signals for rank 2's call-5 data, which it would in one shared region."""
    from .fake_symm import FakeWorld

    world, me, m_local, k, n, epoch = 3, 0, 32, 16, 32, 5
    xs, b, _ = _ag_case(world, m_local, k, n, False)
    chunks = triton.cdiv(m_local, CFG.chunk_rows)  # call 5's layout: 4 chunks per segment
    w = FakeWorld(world, "ag", DTYPE)
    w.reserve(world * m_local * k, world * 2 * chunks)
    ws = w.ws[me]

    def run(flags):
        err = torch.zeros(4, dtype=torch.int32)
        ag = torch.randn(world * m_local, k).to(DTYPE)
        out = torch.empty(world * m_local, n, dtype=DTYPE)
        launch_ag_gemm(xs[me], ag, b, out, flags, err, rank=me, world=world, epoch=epoch,
                       cfg=CFG, num_sms=NSMS, max_spins=3)
        return err.tolist()

    now, early = ws.flags(me, epoch & 1), ws.flags(me, (epoch + 1) & 1)
    now[1 * chunks:2 * chunks] = epoch        # rank 1's call-5 chunks arrived
    early[1 * 2 * chunks:2 * 2 * chunks] = epoch + 1  # rank 1's call-6 signals, 8 per segment
    op, rank, index, seen = run(now)  # the last program to give up writes the word
    assert (op, rank, seen) == (1, me, 0) and 2 * chunks <= index < 3 * chunks, \
        f"rank 0 did not wait for rank 2's chunks: {(op, rank, index, seen)}"
    # control: the same writes into one shared region release the wait (the bug this prevents)
    shared = now.clone()
    shared[1 * 2 * chunks:2 * 2 * chunks] = epoch + 1
    assert run(shared) == [0, 0, 0, 0]


def check_ready_barrier():
    """The ready barrier (signal and wait) at TP 2/4/8: every rank signals every peer at
    ``base + rank``, then waits for all peers; with one rank missing, every other rank reports
    that rank's word, and nobody writes its own."""
    from .fake_symm import FakeWorld

    from megatron_flux.kernels.ready_barrier import launch_ready_barrier

    for world in (2, 4, 8):
        for missing in (None, world - 1):
            w = FakeWorld(world, "ag", DTYPE)
            w.reserve(16, 3 * world)
            base, epoch, parity = 2 * world, 9, 1
            errs = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
            for phase in ("signal", "wait"):
                for r in range(world):
                    if r == missing:
                        continue
                    launch_ready_barrier(w.ws[r].flag_ptrs(parity), errs[r], rank=r, world=world,
                                         base=base, epoch=epoch, max_spins=3,
                                         signal=phase == "signal", wait=phase == "wait")
            for r in range(world):
                flags = w.ws[r].flags(r, parity)
                assert (flags[:base] == 0).all() and flags[base + r] == 0, (world, r, flags.tolist())
                senders = [p for p in range(world) if p not in (r, missing)]
                assert all(flags[base + p] == epoch for p in senders), (world, r, flags.tolist())
                assert (w.ws[r].flags(r, 1 - parity) == 0).all(), "wrote the other parity"
                if r == missing:
                    continue
                expect = [0, 0, 0, 0] if missing is None else [3, r, missing, 0]  # OP_AG_READY
                assert errs[r].tolist() == expect, (world, r, missing, errs[r].tolist())


def check_copy_engine_gather():
    """The copy-engine all-gather (the column backward's re-gather) at TP 2/4/8: each rank's plan
    pushes its rows into every peer's slot and signals word ``rank`` there; the wait half of the
    ready barrier (base 0) then passes on every rank and the gathered rows are everyone's rows in
    rank order. With one rank's pushes missing, every other rank's wait reports that rank."""
    from .fake_symm import FakeWorld

    from megatron_flux.comm.ag_copies import ag_copy_plan, materialize
    from megatron_flux.kernels.ready_barrier import launch_ready_barrier
    from megatron_flux.kernels.signals import OP_GATHER

    m_local, k, epoch, parity = 3, 5, 7, 1
    for world in (2, 4, 8):
        m = world * m_local
        shards = [torch.randn(m_local, k).to(DTYPE) for _ in range(world)]
        for missing in (None, 1):
            w = FakeWorld(world, "gather", DTYPE)
            w.reserve(m * k, world)
            int_flags = {w.ws[r].flags(r, parity).data_ptr(): r for r in range(world)}
            for r in range(world):  # what all_gather_start and wait() queue, in order
                if r == missing:
                    continue
                plan = ag_copy_plan(w.ws[r], m_local, k, rank=r, world=world, parity=parity,
                                    chunk=m_local)
                assert len(plan) == world - 1, "one push per peer"
                for dst, src, flags, index in materialize(plan, shards[r]):
                    dst.copy_(src)
                    peer = int_flags[flags.data_ptr()]
                    assert peer != r and index == r, (world, r, peer, index)
                    w.ws[peer].flags(peer, parity)[index] = epoch
                w.ws[r].data(r, parity, m * k).view(m, k)[r * m_local:(r + 1) * m_local].copy_(shards[r])
            errs = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
            for r in range(world):
                if r == missing:
                    continue
                launch_ready_barrier(w.ws[r].flag_ptrs(parity), errs[r], rank=r, world=world,
                                     base=0, epoch=epoch, max_spins=3, signal=False, wait=True,
                                     op_code=OP_GATHER)
                assert (w.ws[r].flags(r, 1 - parity) == 0).all(), "wrote the other parity"
                if missing is None:
                    assert errs[r].tolist() == [0, 0, 0, 0], (world, r, errs[r].tolist())
                    got = w.ws[r].data(r, parity, m * k).view(m, k)
                    assert torch.equal(got, torch.cat(shards)), f"TP={world} rank {r}: wrong rows"
                else:
                    assert errs[r].tolist() == [OP_GATHER, r, missing, 0], (world, r, errs[r].tolist())


def _rs_world(world, m_local, k, n, b_kn, bias, epoch=3, cfg=CFG):
    m = world * m_local
    a_s = [torch.randn(m, k).to(DTYPE) for _ in range(world)]
    b_s = [torch.randn(k, n).to(DTYPE) if b_kn else torch.randn(n, k).to(DTYPE).t()
           for _ in range(world)]
    bias_t = torch.randn(n).to(DTYPE) if bias else None
    tps = triton.cdiv(m_local, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    data = [torch.full((world, m_local, n), float("nan")).to(DTYPE) for _ in range(world)]
    flags = [torch.zeros(rs_signal_count(world), dtype=torch.int32) for _ in range(world)]
    return dict(a=a_s, b=b_s, bias=bias_t, tps=tps, data=data, flags=flags, cfg=cfg,
                dptr=torch.tensor([d.data_ptr() for d in data], dtype=torch.int64),
                fptr=torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64),
                outs=[torch.full((m_local, n), float("nan")).to(DTYPE) for _ in range(world)],
                errs=[torch.zeros(4, dtype=torch.int32) for _ in range(world)],
                world=world, m_local=m_local, epoch=epoch)


def _rs_run(w, phases=("produce", "consume"), max_spins=10, num_sms=NSMS, host_descriptors=None):
    for phase in phases:
        for r in range(w["world"]):
            launch_gemm_rs(w["a"][r], w["b"][r], w["outs"][r], w["data"][r], w["dptr"], w["fptr"],
                           w["bias"], w["errs"][r], rank=r, world=w["world"], epoch=w["epoch"],
                           cfg=w["cfg"], num_sms=num_sms, max_spins=max_spins,
                           produce=phase == "produce", consume=phase == "consume",
                           host_descriptors=host_descriptors)


def check_gemm_rs_all_ranks():
    """GEMM+RS output on every rank of TP 2/4/8 (bias, ragged m_local, both B layouts; n wider
    than the spread reduction's 256-column chunks once, so their column offset counts)."""
    cases = [(2, 32, False, True, 64), (4, 20, True, False, 64), (8, 9, False, True, 64),
             (2, 16, False, True, 288)]
    for (world, m_local, b_kn, bias, n), cfg in [(c, f) for c in cases for f in RS_CFGS]:
        k = 32
        w = _rs_world(world, m_local, k, n, b_kn, bias, cfg=cfg)
        _rs_run(w)
        full = sum(a.float() @ b.float() for a, b in zip(w["a"], w["b"]))
        if bias:
            full = full + w["bias"].float()
        for r in range(world):
            assert w["errs"][r].tolist() == [0, 0, 0, 0], w["errs"][r].tolist()
            assert not torch.isnan(w["outs"][r]).any(), f"unwritten output rank {r}"
            e = _rel(w["outs"][r], full[r * m_local:(r + 1) * m_local])
            assert e < TOL, f"world={world} rank={r} {cfg}: rel err {e}"


def check_ws_configs_run_the_triton_kernels():
    """A warp-specialized config (``rs_warp_specialized`` / ``ag_warp_specialized``: Gluon
    kernels, which have no interpreter) runs the Triton kernel here, with one warning naming
    the interpreter, and gets the same bits as the same tiles without the knob, on every
    rank."""
    import warnings

    from megatron_flux.kernels import ag_gemm_ws, gemm_rs_ws

    base = GemmConfig(block_m=64, block_n=64, block_k=16, num_stages=1, num_warps=4, group_m=2,
                      epilogue_split=1, chunk_rows=16)

    def said(caught, knob):
        return [str(c.message) for c in caught if knob in str(c.message)]

    rs_outs, ag_outs = [], []
    torch.manual_seed(1)
    xs, b, _ = _ag_case(2, 64, 32, 64, False)
    for ws in (False, True):
        gemm_rs_ws.warn_fallback.seen.clear()
        ag_gemm_ws.warn_fallback.seen.clear()
        torch.manual_seed(2)  # the same inputs for both configs
        w = _rs_world(2, 64, 32, 64, False, True,
                      cfg=GemmConfig(**{**base.to_dict(), "rs_warp_specialized": ws}))
        ag_cfg = GemmConfig(**{**base.to_dict(), "ag_warp_specialized": ws})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _rs_run(w)
            ag_outs.append([_ag_on_rank(xs, b, r, ag_cfg, f"ws={ws} rank={r}") for r in range(2)])
        for knob in ("rs_warp_specialized", "ag_warp_specialized"):
            lines = said(caught, knob)
            assert len(lines) == (1 if ws else 0) and (not ws or "interpreter" in lines[0]), lines
        assert all(e.tolist() == [0, 0, 0, 0] for e in w["errs"])
        rs_outs.append([o.clone() for o in w["outs"]])
    for r in range(2):
        assert torch.equal(rs_outs[0][r], rs_outs[1][r]), f"rank {r}: the RS fallback changed the result"
        assert torch.equal(ag_outs[0][r], ag_outs[1][r]), f"rank {r}: the AG fallback changed the result"
        assert not torch.isnan(rs_outs[1][r]).any()


def check_gemm_rs_ownership():
    """Each producer writes exactly its own slot of each owner and signals exactly
    ``flags[owner][src]`` (its arrival counters back at zero); nobody writes its own slot or
    signal, except with the spread reduction, which reads the own slot like the peers'."""
    for cfg in RS_CFGS:
        _check_gemm_rs_ownership(cfg)


def _check_gemm_rs_ownership(cfg):
    world, m_local, k, n = 4, 16, 32, 64
    w = _rs_world(world, m_local, k, n, False, False, epoch=9, cfg=cfg)
    _rs_run(w, phases=("produce",))
    for owner in range(world):
        flags = w["flags"][owner][:world].view(world, 1)
        assert (w["flags"][owner][world:] == 0).all(), "arrival counters not reset"
        for src in range(world):
            partial = (w["a"][src].float() @ w["b"][src].float())[owner * m_local:(owner + 1) * m_local]
            slot = w["data"][owner][src]
            if src == owner and not cfg.rs_spread_reduce:
                assert torch.isnan(slot).all(), "a rank wrote its own slot"
                assert (flags[src] == 0).all(), "a rank signalled itself"
            else:  # a spread reduction reads the own slot too
                assert not torch.isnan(slot).any(), f"slot {src} of owner {owner} not fully written"
                assert _rel(slot, partial) < TOL, f"slot {src} of owner {owner} holds the wrong rows"
                assert (flags[src] == 9).all(), f"signals of src {src} at owner {owner}"


def check_gemm_rs_deterministic_and_timeout():
    """Repeated runs are bitwise identical; a consumer without producers times out instead of
    hanging, reporting op, rank, a peer's signal index and the stale epoch it saw."""
    world, m_local, k, n = 4, 16, 32, 64
    w = _rs_world(world, m_local, k, n, False, True)
    _rs_run(w)
    first = [o.clone() for o in w["outs"]]
    w["epoch"] += 1
    _rs_run(w)
    for a, b in zip(first, w["outs"]):
        assert torch.equal(a, b), "GEMM+RS is not bitwise deterministic"
    w["epoch"] += 1
    _rs_run(w, phases=("consume",), max_spins=3)  # nobody produced this epoch
    for r in range(world):
        op, rank, index, seen = w["errs"][r].tolist()  # the last program to give up wins
        assert (op, rank, seen) == (2, r, w["epoch"] - 1), w["errs"][r].tolist()
        assert 0 <= index < world and index != r, "index is not a peer's step signal"


def check_gemm_rs_merged_rows():
    """``rs_merge_rows``: every rank's rows in one tile space, row tiles spanning owners
    (ragged m_local, a row tile larger than a segment, TP 2/4/8, both epilogue splits, bias):
    every slot holds exactly its partial (no row written into a neighbour's segment) and the
    outputs are bitwise those of the per-segment schedule with the spread reduction (the same
    K order per element, the same rank order in the sum; up to rounding where the
    interpreter's dot is not row-invariant: :func:`_assert_schedules_agree`)."""
    cases = [(2, 9, 16, True), (4, 20, 16, False), (8, 5, 16, True), (2, 24, 64, False)]
    for world, m_local, block_m, bias in cases:
        for split in (1, 2):
            merged = GemmConfig(**{**MERGED_RS.to_dict(), "block_m": block_m,
                                   "epilogue_split": split})
            per_segment = GemmConfig(**{**merged.to_dict(), "rs_merge_rows": False})
            runs = []
            for cfg in (per_segment, merged):
                torch.manual_seed(world * 100 + m_local + split)
                w = _rs_world(world, m_local, 32, 64, False, bias, cfg=cfg)
                _rs_run(w)
                assert all(e.tolist() == [0, 0, 0, 0] for e in w["errs"]), (world, cfg)
                runs.append(w)
            label = f"{world=} {m_local=} {block_m=} {split=}"
            for r in range(world):
                assert not torch.isnan(runs[1]["outs"][r]).any(), f"{label}: unwritten rank {r}"
                _assert_schedules_agree(runs[1]["outs"][r], runs[0]["outs"][r], f"{label}: rank {r}")
                for src in range(world):
                    partial = (runs[1]["a"][src].float() @ runs[1]["b"][src].float())[
                        r * m_local:(r + 1) * m_local]
                    slot = runs[1]["data"][r][src]
                    assert _rel(slot, partial) < TOL, f"{label}: slot {src} of owner {r}"


def check_gemm_rs_stream_k():
    """GEMM+RS's stream-K tail (``stream_k=1``) at TP 2/4/8: the own segment's partial last
    wave split along K over the grid (a tile over 1-7 programs, aligned and ragged m_local, both
    B layouts, bias, host- and device-built descriptors) gives the right output on every rank,
    bitwise the same when repeated, every tile counter back at zero; a consumer whose peers did
    not produce this epoch times out on a peer's signal instead of reducing stale partials."""
    import dataclasses

    from megatron_flux.kernels import stream_k as SK

    # (world, m_local, k, n, grid, b_kn, bias, host descriptors): tiles = world *
    # cdiv(m_local, 16) * cdiv(n, 32), the tail (tiles % grid) at most 0.35 of the grid
    cases = [(2, 64, 64, 64, 5, False, True, True), (2, 64, 64, 64, 7, True, False, True),
             (4, 40, 32, 64, 11, False, True, False), (2, 48, 80, 32, 5, False, True, True),
             (2, 25, 64, 64, 7, True, True, False), (8, 9, 32, 64, 5, False, False, True),
             (2, 48, 112, 32, 5, False, False, False), (4, 16, 48, 64, 6, False, True, True)]
    cfg = dataclasses.replace(CFG, stream_k=1)
    for world, m_local, k, n, grid, b_kn, bias, host in cases:
        label = f"{world=} {m_local=} {k=} {n=} {grid=}"
        tps = triton.cdiv(m_local, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        _, sk = SK.stream_k_plan(world * tps, grid, 1, tps)
        assert sk > 0, f"{label}: no stream-K tiles"
        torch.manual_seed(world * 1000 + m_local + grid)
        w = _rs_world(world, m_local, k, n, b_kn, bias, cfg=cfg)
        full = sum(a.float() @ b.float() for a, b in zip(w["a"], w["b"]))
        if bias:
            full = full + w["bias"].float()
        runs = []
        for _ in range(2):
            for o in w["outs"]:
                o.fill_(float("nan"))
            _rs_run(w, num_sms=grid, host_descriptors=host)
            runs.append([o.clone() for o in w["outs"]])
            w["epoch"] += 1
            assert int(SK._SCRATCH[("cpu",)].counters.abs().sum()) == 0, f"{label}: counters"
        for r in range(world):
            assert w["errs"][r].tolist() == [0, 0, 0, 0], (label, r, w["errs"][r].tolist())
            assert not torch.isnan(runs[0][r]).any(), f"{label}: unwritten output rank {r}"
            e = _rel(runs[0][r], full[r * m_local:(r + 1) * m_local])
            assert e < TOL, f"{label} rank {r}: rel err {e}"
            assert torch.equal(runs[0][r], runs[1][r]), f"{label} rank {r}: not repeatable"
    # Nobody produced this epoch: the stream-K tiles' reduction must wait for the peers, not
    # reduce stale partials. TP 4, 2 tiles a segment, 6 programs: the own segment is all tail,
    # so only the stream-K phase can wait (and time out).
    world, m_local, k, n, grid = 4, 16, 48, 64, 6
    w = _rs_world(world, m_local, k, n, False, False, cfg=cfg)
    assert SK.stream_k_plan(world * 2, grid, 1, 2) == (grid, 2)
    _rs_run(w, phases=("consume",), max_spins=3, num_sms=grid)
    for r in range(world):
        op, rank, index, seen = w["errs"][r].tolist()
        assert (op, rank, seen) == (2, r, 0) and index in set(range(world)) - {r}, \
            w["errs"][r].tolist()
    assert int(SK._SCRATCH[("cpu",)].counters.abs().sum()) == 0, "counters after a timeout"


def check_gemm_rs_spread_waits_for_its_own_grid():
    """With the spread reduction a rank also reads its own slot, so its consumers wait for its
    own producers' barrier: every peer produced this epoch, the rank itself did not, and its
    consumers time out on its own signal (index = its rank) instead of reading a stale slot."""
    world, m_local, k, n = 4, 16, 32, 64
    cfg = GemmConfig(**{**CFG.to_dict(), "rs_spread_reduce": True})
    w = _rs_world(world, m_local, k, n, False, False, cfg=cfg)
    _rs_run(w)  # epoch 3: everyone
    w["epoch"] += 1
    lazy = 2
    for r in range(world):
        if r != lazy:
            launch_gemm_rs(w["a"][r], w["b"][r], w["outs"][r], w["data"][r], w["dptr"], w["fptr"],
                           None, w["errs"][r], rank=r, world=world, epoch=w["epoch"], cfg=cfg,
                           num_sms=NSMS, max_spins=10, produce=True, consume=False)
    launch_gemm_rs(w["a"][lazy], w["b"][lazy], w["outs"][lazy], w["data"][lazy], w["dptr"],
                   w["fptr"], None, w["errs"][lazy], rank=lazy, world=world, epoch=w["epoch"],
                   cfg=cfg, num_sms=NSMS, max_spins=3, produce=False, consume=True)
    assert w["errs"][lazy].tolist() == [2, lazy, lazy, w["epoch"] - 1], w["errs"][lazy].tolist()


def _rs_ce_produce(w, ranks=None):
    """Copy-engine GEMM+RS producers: every rank (or ``ranks``) writes its peers' partials into
    a local staging buffer through the staging table; returns the staging buffers."""
    world, m_local, n = w["world"], w["m_local"], w["outs"][0].shape[1]
    staging = [torch.full(((world - 1) * m_local, n), float("nan")).to(DTYPE) for _ in range(world)]
    for r in range(world) if ranks is None else ranks:
        table = torch.tensor(rs_staging_table(staging[r].data_ptr(), w["data"][r].data_ptr(),
                                              rank=r, world=world, m_local=m_local, n=n,
                                              elt=staging[r].element_size()), dtype=torch.int64)
        launch_gemm_rs(w["a"][r], w["b"][r], w["outs"][r], w["data"][r], table, w["fptr"],
                       w["bias"], w["errs"][r], rank=r, world=world, epoch=w["epoch"],
                       cfg=w["cfg"], num_sms=NSMS, max_spins=10, produce=True, consume=False)
    return staging


def _rs_ce_deliver(w, staging, r):
    """What rank ``r``'s copy-engine stream does once its "produced" word holds the epoch: each
    step's staged partial into its owner's slot ``r``, then the owner's signal ``[r]``."""
    world, m_local = w["world"], w["m_local"]
    for step in range(world - 1):
        owner = (r + 1 + step) % world
        w["data"][owner][r].copy_(staging[r][step * m_local:(step + 1) * m_local])
        w["flags"][owner][r] = w["epoch"]


def check_gemm_rs_copy_engine():
    """``rs_copy_engine`` at TP 2/4/8 (with the spread reduction too): the producers write only
    local staging (no owner's slot or signal changes; only their own "produced" word, and with
    the spread reduction their own slot and signal), staging step ``s`` holds the partial of
    segment ``r + 1 + s``; after the simulated copy-engine delivery the consumers' outputs match
    the dense reference and equal the SM-push kernel's bitwise. A consumer whose peer's copies
    never came times out on that peer's signal."""
    cases = [(2, 32, False, True, 64), (4, 20, True, False, 64), (8, 9, False, True, 64)]
    for (world, m_local, b_kn, bias, n), spread in [(c, s) for c in cases for s in (False, True)]:
        k = 32
        base = GemmConfig(**{**CFG.to_dict(), "rs_spread_reduce": spread})
        cfg = GemmConfig(**{**base.to_dict(), "rs_copy_engine": True})
        torch.manual_seed(world * 10 + spread)
        w = _rs_world(world, m_local, k, n, b_kn, bias, cfg=cfg)
        staging = _rs_ce_produce(w)
        for r in range(world):
            assert w["errs"][r].tolist() == [0, 0, 0, 0], w["errs"][r].tolist()
            assert w["flags"][r][world + 1] == w["epoch"], f"rank {r}: 'produced' not raised"
            assert w["flags"][r][world] == 0, "arrival counter not reset"
            for src in range(world):
                own = src == r
                if own and spread:
                    assert w["flags"][r][src] == w["epoch"], "spread: own signal not raised"
                    assert not torch.isnan(w["data"][r][src]).any(), "spread: own slot not written"
                else:
                    assert w["flags"][r][src] == 0, f"rank {src} signalled owner {r} before its copy"
                    assert torch.isnan(w["data"][r][src]).all(), f"rank {src} wrote owner {r}'s slot"
            for step in range(world - 1):
                seg = (r + 1 + step) % world
                partial = (w["a"][r].float() @ w["b"][r].float())[seg * m_local:(seg + 1) * m_local]
                got = staging[r][step * m_local:(step + 1) * m_local]
                assert _rel(got, partial) < TOL, f"TP {world} rank {r}: staging step {step} wrong"
        for r in range(world):
            _rs_ce_deliver(w, staging, r)
        _rs_run(w, phases=("consume",))
        full = sum(a.float() @ b.float() for a, b in zip(w["a"], w["b"]))
        if bias:
            full = full + w["bias"].float()
        ce_outs = [o.clone() for o in w["outs"]]
        w_ref = dict(w, cfg=base, epoch=w["epoch"] + 1,
                     outs=[torch.full_like(o, float("nan")) for o in w["outs"]])
        _rs_run(w_ref)
        for r in range(world):
            assert w["errs"][r].tolist() == [0, 0, 0, 0], w["errs"][r].tolist()
            e = _rel(ce_outs[r], full[r * m_local:(r + 1) * m_local])
            assert e < TOL, f"TP {world} spread={spread} rank {r}: rel err {e}"
            assert torch.equal(ce_outs[r], w_ref["outs"][r]), "copy-engine and SM push differ"
    # a peer whose copies never came: its signal stays at the last epoch
    world, m_local, n = 4, 16, 64
    cfg = GemmConfig(**{**CFG.to_dict(), "rs_copy_engine": True})
    w = _rs_world(world, m_local, 32, n, False, False, cfg=cfg)
    staging = _rs_ce_produce(w)
    silent = 1
    for r in range(world):
        if r != silent:
            _rs_ce_deliver(w, staging, r)
    owner = 3
    launch_gemm_rs(w["a"][owner], w["b"][owner], w["outs"][owner], w["data"][owner], w["dptr"],
                   w["fptr"], None, w["errs"][owner], rank=owner, world=world, epoch=w["epoch"],
                   cfg=cfg, num_sms=NSMS, max_spins=3, produce=False, consume=True)
    assert w["errs"][owner].tolist() == [2, owner, silent, 0], w["errs"][owner].tolist()


def check_copy_engine_reduce_scatter():
    """``column_dgrad="copy_engine"`` at TP 2/4/8 on simulated symmetric workspaces: each
    rank's copy plan writes its partial's rows of segment ``p`` into peer ``p``'s slot (ring
    order, so at each step the ranks write distinct owners) and signals word ``rank`` there;
    the owner's bounded wait passes, and the reduction (own rows + slots in rank order, in
    fp32, + bias) equals the same sum done by torch bitwise. A rank whose copies never came is
    named by every owner's wait (op GEMM+RS)."""
    from .fake_symm import FakeWorld

    from megatron_flux.comm.rs_copies import rs_copy_plan
    from megatron_flux.kernels.ready_barrier import launch_ready_barrier
    from megatron_flux.kernels.rs_reduce import launch_rs_reduce
    from megatron_flux.kernels.signals import OP_GEMM_RS

    epoch, parity = 5, 1
    for world, m_local, n in ((2, 40, 300), (4, 9, 64), (8, 3, 40)):
        m = world * m_local
        torch.manual_seed(world)
        partials = [torch.randn(m, n).to(DTYPE) for _ in range(world)]
        bias = torch.randn(n).to(DTYPE)
        for missing in (None, 2 % world):
            w = FakeWorld(world, "rs", DTYPE)
            w.reserve(world * m_local * n, rs_signal_count(world))
            for r in range(world):
                w.ws[r].flags(r, parity).zero_()
            for r in range(world):
                if r == missing:
                    continue
                plan = rs_copy_plan(w.ws[r], m_local, n, rank=r, world=world, parity=parity)
                assert [c.peer for c in plan] == [(r + s) % world for s in range(1, world)]
                for peer, dst, flags in plan:
                    dst.copy_(partials[r][peer * m_local:(peer + 1) * m_local].reshape(-1))
                    flags.view(torch.int32)[r] = epoch
            for r in range(world):
                err = torch.zeros(4, dtype=torch.int32)
                launch_ready_barrier(w.ws[r].flag_ptrs(parity), err, rank=r, world=world, base=0,
                                     epoch=epoch, max_spins=3, signal=False, wait=True,
                                     op_code=OP_GEMM_RS)
                if missing is not None:
                    if r != missing:
                        assert err.tolist()[:3] == [OP_GEMM_RS, r, missing], err.tolist()
                    continue
                assert err.tolist() == [0, 0, 0, 0], err.tolist()
                out = torch.full((m_local, n), float("nan")).to(DTYPE)
                rows = slice(r * m_local, (r + 1) * m_local)
                launch_rs_reduce(partials[r][rows], w.ws[r].data(r, parity, world * m_local * n), out,
                                 bias, rank=r, world=world, block_m=16, block_n=64)
                ref = torch.zeros(m_local, n)
                for src in range(world):
                    ref += partials[src][rows].float()
                ref = (ref + bias.float()).to(DTYPE)
                assert torch.equal(out, ref), f"TP {world} rank {r}: reduction differs"


def check_plain_gemm():
    """The benchmarks' plain persistent GEMM (the yardstick) on ragged shapes, every tile once."""
    for m, n, k in ((40, 72, 48), (16, 32, 16), (33, 104, 24)):
        a = torch.randn(m, k).to(DTYPE)
        b = torch.randn(n, k).to(DTYPE)
        c = torch.full((m, n), float("nan")).to(DTYPE)
        for host in (False, True):
            c.fill_(float("nan"))
            launch_plain_gemm(a, b, c, CFG, NSMS, host_descriptors=host)
            assert not torch.isnan(c).any(), f"unwritten output ({m}x{n}x{k}, host={host})"
            e = _rel(c, a.double() @ b.double().T)
            assert e < TOL, f"{m}x{n}x{k} host={host}: rel err {e}"
    try:
        launch_plain_gemm(a[:, :20].contiguous(), b[:, :20].contiguous(), c, CFG, NSMS)
    except ValueError as exc:
        assert "multiples of 8" in str(exc), exc
    else:
        raise AssertionError("a k that TMA cannot stride was accepted")


def check_host_and_device_descriptors_agree():
    """TMA descriptors encoded on the host (``host_descriptors=True``, kernel parameters) and
    built on the device give bitwise the same outputs: AG+GEMM per segment with ragged 3-D
    views, with B as [K, N], and with the gathered rows as one operand; GEMM+RS per segment
    (ragged) and with merged rows. The other checks run the default (host descriptors)."""
    import dataclasses

    for world, m_local, b_kn, cfg in ((4, 20, False, CFG), (2, 32, True, CFG),
                                      (2, 9, False, dataclasses.replace(
                                          CFG, ag_merge_local=True, ag_merge_lead=0))):
        xs, b, _ = _ag_case(world, m_local, 32, 64, b_kn)
        outs = []
        for host in (True, False):
            flags = torch.full((world * triton.cdiv(m_local, cfg.chunk_rows),), 7,
                               dtype=torch.int32)
            err = torch.zeros(4, dtype=torch.int32)
            out = torch.full((world * m_local, b.shape[1]), float("nan")).to(DTYPE)
            launch_ag_gemm(xs[1], _gathered_by(1, xs, own=cfg.ag_merge_local), b, out, flags,
                           err, rank=1, world=world, epoch=7, cfg=cfg, num_sms=NSMS,
                           max_spins=10, host_descriptors=host)
            assert err.tolist() == [0, 0, 0, 0] and not torch.isnan(out).any(), (world, host)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"AG+GEMM {world=} {m_local=}: host != device"
    for world, m_local, cfg in ((4, 20, CFG), (2, 9, MERGED_RS)):
        runs = []
        for host in (True, False):
            torch.manual_seed(world + m_local)
            w = _rs_world(world, m_local, 32, 64, False, True, cfg=cfg)
            _rs_run(w, host_descriptors=host)
            assert all(e.tolist() == [0, 0, 0, 0] for e in w["errs"]), (world, host)
            runs.append(w)
        for r in range(world):
            assert torch.equal(runs[0]["outs"][r], runs[1]["outs"][r]), \
                f"GEMM+RS {world=} {m_local=} rank {r}: host != device"


CHECKS = [check_plain_gemm, check_tile_order, check_row_turn_order, check_ag_gemm_all_ranks, check_ag_merged_local, check_ag_merged_signals, check_ag_stream_k, check_ag_signal_indexing,
          check_gemm_rs_all_ranks, check_gemm_rs_ownership, check_gemm_rs_deterministic_and_timeout,
          check_gemm_rs_spread_waits_for_its_own_grid, check_gemm_rs_merged_rows,
          check_gemm_rs_stream_k,
          check_gemm_rs_copy_engine,
          check_copy_engine_reduce_scatter,
          check_next_call_cannot_release_a_wait, check_ready_barrier, check_copy_engine_gather,
          check_ws_configs_run_the_triton_kernels,
          check_host_and_device_descriptors_agree]


@triton.jit
def _persistent_loop_probe(out_ptr, STEP: tl.constexpr):
    for t in range(tl.program_id(0), 4, STEP):
        tl.store(out_ptr + t, t)


def interpreter_limitation():
    """Why this Triton's interpreter cannot run the kernels' persistent loops, or None.

    Triton 3.6's interpreter turns ``tl.program_id`` into a 1-element array that numpy >= 2.5
    refuses to use as a ``range`` bound; the GPU tests cover the kernels there."""
    out = torch.full((4,), -1, dtype=torch.int32)
    try:
        _persistent_loop_probe[(2,)](out, STEP=2)
    except Exception as exc:  # the interpreter itself fails, not our code
        return (f"the Triton {triton.__version__} interpreter cannot run a persistent loop over "
                f"tl.program_id with numpy {np.__version__}: {exc!r}")
    if out.tolist() != [0, 1, 2, 3]:
        return f"the Triton {triton.__version__} interpreter ran a persistent loop wrongly: {out.tolist()}"
    return None


def main(names):
    torch.manual_seed(0)
    limitation = interpreter_limitation()
    if limitation:
        print("RESULTS " + json.dumps({"__skipped__": limitation}))
        return
    results = {}
    for check in CHECKS:
        if names and check.__name__ not in names:
            continue
        try:
            check()
            results[check.__name__] = None
        except BaseException:
            results[check.__name__] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
