"""Experiment: does work on a second stream start late beside *any* spinning grid, or only
beside the fused kernels? (one GPU; a sleep kernel on a priority -1 stream once ended 0.8-2.6 s
after a fused AG+GEMM grid started spinning: CUDA's lazy loading, see docs/design.md)

A plain Triton grid of ``G`` programs spins (acquire loads, bounded) on one int32 flag; a second
stream ("the releaser", priority 0 or -1) runs an optional 1 ms sleep kernel, then raises the
flag: with a ``fill_`` kernel, or with a copy (``cudaMemcpyAsync``, the copy engine). The
spinner runs on its own stream or on the legacy default stream. Printed, in ms after the
spinner's start: when the releaser got past its sleep and when it raised the flag, when the
spinner ended, and the spinner's most polls (``max_polls`` means it gave up, unreleased).

    PYTHONPATH=. python3 benchmarks/experiments/spin_beside.py [--json out.json]
"""

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl


@triton.jit
def spin_kernel(flag_ptr, polls_ptr, max_polls, a_ptr, out_ptr, K,
                BIG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    if BIG:  # a pipelined GEMM tile first: Triton gives the CTA its stages' shared memory
        a_desc = tl.make_tensor_descriptor(a_ptr, [BN, K], [K, 1], [BM, BK])
        b_desc = tl.make_tensor_descriptor(a_ptr, [BN, K], [K, 1], [BN, BK])
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for kk in tl.range(0, K, BK):
            acc = tl.dot(a_desc.load([0, kk]), b_desc.load([0, kk]).T, acc)
        tl.store(out_ptr + tl.program_id(0) * BM * BN + offs_m[:, None] * BN + offs_n[None, :],
                 acc.to(tl.bfloat16))
    polls = 0
    seen = tl.load(flag_ptr, volatile=True)
    while (seen == 0) & (polls < max_polls):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.store(polls_ptr + tl.program_id(0), polls)


_BIG = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4)
_A = {}


def launch_spinner(grid, flag, polls, max_polls, big):
    k = 1024
    if "a" not in _A:
        _A["a"] = torch.randn(256, k, device="cuda").to(torch.bfloat16)
        _A["out"] = torch.empty(132 * 128 * 256, device="cuda", dtype=torch.bfloat16)
    cfg = _BIG if big else dict(BM=16, BN=16, BK=16, num_warps=4, num_stages=1)
    from megatron_flux.kernels.descriptors import ensure_descriptor_allocator
    ensure_descriptor_allocator()
    return spin_kernel[(grid,)](flag, polls, max_polls, _A["a"], _A["out"], k, BIG=big, **cfg)


def run(grid, spin_stream, prio, sleep, release, max_polls, big=False):
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    polls = torch.zeros(grid, dtype=torch.int32, device="cuda")
    rel = torch.cuda.Stream(priority=prio)
    sp = torch.cuda.current_stream() if spin_stream == "default" else torch.cuda.Stream()
    with torch.cuda.stream(rel):  # load the releaser's kernels before anything spins
        torch.cuda._sleep(1)
        torch.zeros(1, dtype=torch.int32, device="cuda").fill_(1)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    with torch.cuda.stream(sp):
        ev[0].record()
        kernel = launch_spinner(grid, flag, polls, max_polls, big)
        ev[1].record()
    with torch.cuda.stream(rel):
        if sleep:
            torch.cuda._sleep(2_000_000)
        ev[2].record()
        if release == "fill":
            flag.fill_(1)
        else:
            flag.copy_(one)
        ev[3].record()
    torch.cuda.synchronize()
    row = dict(grid=grid, smem=kernel.metadata.shared, spin_stream=spin_stream,
               releaser_priority=prio, sleep=sleep, release=release, spinner_end_ms=ev[0].elapsed_time(ev[1]),
               releaser_after_sleep_ms=ev[0].elapsed_time(ev[2]),
               released_ms=ev[0].elapsed_time(ev[3]), most_polls=int(polls.max()),
               gave_up=int(polls.max()) >= max_polls)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grids", nargs="+", type=int, default=[8, 66])
    p.add_argument("--max-polls", type=int, default=1 << 21)
    p.add_argument("--big", action="store_true",
                   help="the spinner first runs a pipelined 128x256 GEMM tile (about 200 KB of "
                        "shared memory, 8 warps), like a fused kernel's CTA")
    p.add_argument("--cases", default="all", choices=("all", "sleep"),
                   help="sleep: only the cases with a sleep kernel before the release")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    run(8, "own", 0, False, "fill", args.max_polls, args.big)  # warm-up: not recorded
    sleeps = (True,) if args.cases == "sleep" else (True, False)
    for grid, spin_stream, prio, sleep, release in itertools.product(
            args.grids, ("own", "default"), (0, -1), sleeps, ("fill", "copy")):
        rows.append(run(grid, spin_stream, prio, sleep, release, args.max_polls, args.big))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
