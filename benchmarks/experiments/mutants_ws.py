"""Mutation check of the fused kernels' one-GPU tests (the warp-specialized kernels, and a few
of the Triton kernels' mutants): break one line of a kernel (a
wait dropped, a partial scaled, a signal raised early, ...), run the tests that should notice,
and record whether they failed. A mutant the tests pass is a hole in the tests.

Each mutant is an exact text replacement that must match once; the file is restored after
its run. Every run has a time limit (a mutant may hang a kernel on an unbounded barrier).

    python3 benchmarks/experiments/mutants_ws.py --json mutants.json [--only NAME ...]
"""

import argparse
import json
import os
import subprocess
import sys
import time

RS = "megatron_flux/kernels/gemm_rs_ws.py"
AG = "megatron_flux/kernels/ag_gemm_ws.py"
WS = "megatron_flux/kernels/gluon_ws.py"
TRS = "megatron_flux/kernels/gemm_rs.py"
TAG = "megatron_flux/kernels/ag_gemm.py"
T = "tests/gpu/test_kernels_one_gpu.py"

#: name -> (file, old text, new text, pytest -k expression)
MUTANTS = {
    # GEMM+RS: the own tiles do not wait for the peers' signals
    "rs_no_peer_wait": (
        RS, "wait_signal(my_flags + src, p.epoch, p.max_spins, p.err_ptr, _OP_GEMM_RS,\n"
            "                            p.rank, src)",
        "pass",
        "rs_ws_times_out or two_ranks_on_one_gpu and (ws-ws or coop-coop)"),
    # GEMM+RS: each peer's partial enters the sum at half weight
    "rs_half_partial": (
        RS, "acc += c_buf.load(acc_layout).to(gl.float32)",
        "acc += c_buf.load(acc_layout).to(gl.float32) * 0.5",
        "rs_ws_bias and sm_push and bf16 and b_nk"),
    # GEMM+RS: the first partition to arrive raises the owners' signals
    "rs_early_signal": (
        RS, "last = arrived == p.PARTITIONS * p.NUM_PROGRAMS - 1", "last = arrived == 0",
        "two_ranks_on_one_gpu and skewed and (ws-ws or coop-coop)"),
    # GEMM+RS: the prefetched partial (own tiles after the first) comes from the wrong slot
    "rs_prefetch_wrong_slot": (
        RS, "tma_load(p.slots_desc, [src0 * p.m_local + off_m, off_n], p.pload.index(C), c_buf)",
        "tma_load(p.slots_desc, [(1 - src0) * p.m_local + off_m, off_n], p.pload.index(C), c_buf)",
        "rs_ws_bias and sm_push and bf16 and b_nk"),
    # AG+GEMM: the load warp reads a peer's segment without waiting for its chunks
    "ag_no_wait": (
        AG, "                _wait_segment(p, seg)\n", "                pass\n",
        "ag_gemm_ws_times_out or land_while and (ws or coop)"),
    # AG+GEMM: only a segment's first chunk is waited for
    "ag_first_chunk_only": (
        AG, "        for c in range(chunks):", "        for c in range(1):",
        "ag_gemm_ws_times_out or land_while and (ws or coop)"),
    # ping-pong: a partition starts its tile without the other's handoff
    "pingpong_no_handoff_wait": (
        WS, "mbarrier.wait(handoff.index(C), ((j - 2 + C) // 2) & 1, pred=j > 0)",
        "mbarrier.wait(handoff.index(C), ((j - 2 + C) // 2) & 1, pred=j < 0)",
        "(rs_ws_bias and pingpong and sm_push and bf16) or (ag_gemm_ws_reads and pingpong and bf16)"),
    # cooperative: the grid barrier expects two partitions per program (ping-pong's count)
    "coop_grid_barrier_count": (
        RS, "last = arrived == p.PARTITIONS * p.NUM_PROGRAMS - 1",
        "last = arrived == 2 * p.NUM_PROGRAMS - 1",
        "rs_ws_bias and coop and sm_push and bf16 and b_nk"),
    # Gluon merged rows (rs_merge_rows on the warp-specialized kernel)
    # a tile that starts in an earlier segment never reaches the later owner's slot
    "ws_merged_span_skipped": (
        RS, "if (a_row < first + p.m_local) & (a_row + BLOCK_M > first):",
        "if (a_row < first + p.m_local) & (a_row >= first):",
        "ws_merged_rows_bias or two_ranks_on_one_gpu and wsmerged"),
    # the grid barrier raises the peers' signals but not this rank's own
    "ws_merged_own_signal_not_raised": (
        RS, "self.OWNER_STEPS = gl.constexpr(WORLD if MERGE_ROWS else WORLD - 1)",
        "self.OWNER_STEPS = gl.constexpr(WORLD - 1)",
        "ws_merged_rows_bias or two_ranks_on_one_gpu and wsmerged"),
    # this rank's rows go into the next rank's slot of every owner
    "ws_merged_wrong_slot": (
        RS, "c_buf = p.c_bufs.index(C)\n        slot = (p.rank * p.m_local).to(gl.int64) * p.N  "
            "# this rank's slot in every owner's region\n        for j in",
        "c_buf = p.c_bufs.index(C)\n        slot = (((p.rank + 1) % p.WORLD) * p.m_local).to(gl.int64) "
        "* p.N\n        for j in",
        "ws_merged_rows_bias or two_ranks_on_one_gpu and wsmerged"),
    # the spread reduction leaves out the last rank's slot
    "ws_merged_reduce_drops_rank": (
        RS, "            for src in gl.static_range(p.WORLD):\n                acc += gl.load(p.data_ptr",
        "            for src in gl.static_range(p.WORLD - 1):\n                acc += gl.load(p.data_ptr",
        "ws_merged_rows_bias or two_ranks_on_one_gpu and wsmerged"),
    # GEMM+RS split tail: a partition that sums a share of a tail tile without having waited
    # for the peers' signals reads their slots anyway
    "rs_split_sum_no_peer_wait": (
        RS, "        if waited == 0:\n            _wait_peers(p)\n        _stamp(p, 14, one_layout)",
        "        _stamp(p, 14, one_layout)",
        "split_tail_ranks_on_one_gpu and last-late"),
    # GEMM+RS: the owner waits for the first two ranks' signals only (TP 4 needs three)
    "rs_wait_two_ranks_only": (
        RS, "        for src in range(p.WORLD):\n            if src != p.rank:\n"
            "                wait_signal(my_flags + src",
        "        for src in range(2):\n            if src != p.rank:\n"
        "                wait_signal(my_flags + src",
        "four_ranks_on_one_gpu and ws-ws-ws-ws and last-late"),
    # merged rows in owner turns (rs_interleave_owners): every owner's turn lands on its first
    # row tile
    "ws_interleave_rows_collapsed": (
        RS, "pid_m = owner * (p.m_local // BLOCK_M) + pid_m // p.WORLD",
        "pid_m = owner * (p.m_local // BLOCK_M)",
        "reduction_paths and 13- or wsinterleave"),
    # owners' row groups in turn (rs_row_turns): an own tile reduces without waiting for its row
    # group's counters
    "rs_turns_no_row_wait": (
        RS, "            _wait_row_group(p, off_m)\n", "            pass\n",
        "two_ranks_on_one_gpu and wsturns or four_ranks_on_one_gpu and wsturns and last-late"),
    # ... a producer counts every tile into its first row group's counter
    "rs_turns_wrong_group": (
        RS, "gl.atomic_add(_row_counter(p, owner_flags, p.rank, off_m)",
        "gl.atomic_add(_row_counter(p, owner_flags, p.rank, 0 * off_m)",
        "two_ranks_on_one_gpu and wsturns-wsturns-even"),
    # ... the last arrival leaves the row counters as they are (the next call would not wait)
    "rs_turns_no_reset": (
        RS, "groups * 0, mask=is_last)", "groups * 0, mask=is_last & (groups < 0))",
        "two_ranks_on_one_gpu and wsturns"),
    # ... every arrival resets them, while other programs' own tiles still wait on them
    "rs_turns_reset_early": (
        RS, "groups * 0, mask=is_last)", "groups * 0, mask=groups >= 0)",
        "two_ranks_on_one_gpu and wsturns-wsturns-skewed"),
    # the Triton kernels, against the same one-GPU tests
    # Triton GEMM+RS: the grid barrier of one program (every arrival raises the signals)
    "triton_rs_early_signal": (
        TRS, "if arrive_at_grid_barrier(my_flags + WORLD, NUM_SMS, ASYNC_FENCE and TMA_PUSH):",
        "if arrive_at_grid_barrier(my_flags + WORLD, 1, ASYNC_FENCE and TMA_PUSH):",
        "two_ranks_on_one_gpu and skewed and triton-triton"),
    # Triton GEMM+RS: the own tiles do not wait for the peers
    "triton_rs_no_peer_wait": (
        TRS, "                wait_signal(my_flags + src, epoch, max_spins, err_ptr, 2, rank, src)  # OP_GEMM_RS",
        "                pass",
        "two_ranks_on_one_gpu and triton-triton"),
    # Triton AG+GEMM: only a segment's first chunk is waited for
    "triton_ag_first_chunk_only": (
        TAG, "    for c in range(chunks_per_seg):\n        idx = seg * chunks_per_seg + c",
        "    for c in range(1):\n        idx = seg * chunks_per_seg + c",
        "land_while and triton"),
}


def run(name, timeout):
    path, old, new, expr = MUTANTS[name]
    src = open(path).read()
    if src.count(old) != 1:
        return dict(name=name, outcome="not applied", detail=f"{src.count(old)} matches in {path}")
    open(path, "w").write(src.replace(old, new))
    t0 = time.time()
    try:
        cmd = [sys.executable, "-m", "pytest", T, "-x", "-q", "-p", "no:cacheprovider", "-k", expr]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:]
        outcome = "killed (tests failed)" if p.returncode == 1 else \
            ("SURVIVED (tests passed)" if p.returncode == 0 else f"pytest exit {p.returncode}")
    except subprocess.TimeoutExpired:
        outcome, tail = "killed (hung past the time limit)", []
    finally:
        open(path, "w").write(src)
    return dict(name=name, file=path, expr=expr, outcome=outcome, seconds=round(time.time() - t0, 1),
                tail=tail)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--json", default=None)
    p.add_argument("--check", action="store_true", help="only check that every mutant applies")
    args = p.parse_args()
    names = args.only or list(MUTANTS)
    if args.check:
        for n in names:
            path, old, _, _ = MUTANTS[n]
            print(n, open(path).read().count(old))
        return
    rows = []
    for n in names:
        rows.append(run(n, args.timeout))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), cwd=os.getcwd(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
