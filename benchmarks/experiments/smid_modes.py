"""Experiment: which SMs a fused GEMM+RS launch ran on, and its phases, in fast and slow launches.

``launch_modes.py`` (session 23) found the merged GEMM+RS at gpt3-175b m = 64 running either
~0.150 ms (as fast as its plain yardstick) or ~0.180 ms, each mode held for a whole block of
back-to-back launches, while cuBLAS and the yardstick in the blocks around it did not move. This
records, per launch, the GPU time (one event pair per launch) and per program its SM
(``%smid``), and its phase stamps (:data:`megatron_flux.kernels.gemm_rs.RS_PHASES`, relative to
the launch's first start), so fast and slow launches can be compared: the SMs used, when each
program started and finished its tiles, arrived at the grid barrier, and ended.

The SM id comes from a diagnostic twin of :func:`megatron_flux.kernels.phase_trace.stamp`,
patched into the kernel module for this process only: at the "start" stamp it also stores
``%smid`` in slot 6 (unused by the spread reduction's schedule).

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/smid_modes.py \
        --model gpt3-175b --m 64 --json smid-modes.json
"""

import argparse
import dataclasses

import torch
import triton
import triton.language as tl

from common import write_record
from megatron_flux.bench.kernel_vs_cublas import _sleep_cycles_per_ms, grid_shape, rs_on_one_gpu
from megatron_flux.kernels import gemm_rs
from megatron_flux.kernels.config import default_config
from megatron_flux.kernels.phase_trace import new_trace

SMID_SLOT = 6


@triton.jit
def stamp_with_smid(trace_ptr, slot, TRACE: tl.constexpr):
    if TRACE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(trace_ptr + tl.program_id(0) * 8 + slot, now)
        if slot == 0:
            smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                             is_pure=False, pack=1)
            tl.store(trace_ptr + tl.program_id(0) * 8 + 6, smid.to(tl.int64))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--m", type=int, default=64)
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json")
    args = p.parse_args()
    gemm_rs.stamp = stamp_with_smid  # before the first compile in this process
    n, k = grid_shape("rs", args.model, 2)
    cfg = default_config("rs", args.m, n, k, tp=2)
    a = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    launch, out, data = rs_on_one_gpu(a, w, 2, err)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    traces = [new_trace(sms, "cuda") for _ in range(args.block)]
    cublas = lambda: torch.matmul(a, w.t())  # noqa: E731
    sleep = int(5 * _sleep_cycles_per_ms())
    launch(cfg, trace=traces[0])
    torch.cuda.synchronize()
    launches = []
    for b in range(args.blocks):
        for _ in range(args.warmup):  # cuBLAS between blocks, as in the interleaved timings
            cublas()
        for _ in range(args.warmup):
            launch(cfg, trace=traces[0])
        for t in traces:
            t.fill_(-1)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(args.block + 1)]
        torch.cuda._sleep(sleep)
        events[0].record()
        for i in range(args.block):
            launch(cfg, trace=traces[i])
            events[i + 1].record()
        events[-1].synchronize()
        for i in range(args.block):
            tr = traces[i].cpu()
            used = tr[:, 0] >= 0
            t0 = int(tr[used, 0].min())
            rows = tr[used]
            rel = lambda col: [(-1 if v < 0 else round((v - t0) / 1000.0, 3))  # noqa: E731
                               for v in rows[:, col].tolist()]
            launches.append({
                "block": b, "index": i, "ms": events[i].elapsed_time(events[i + 1]),
                "smid": rows[:, SMID_SLOT].tolist(),
                **{name: rel(slot) for slot, name in enumerate(gemm_rs.RS_PHASES)
                   if slot != SMID_SLOT}})
        ms = [x["ms"] for x in launches[-args.block:]]
        print(f"block {b}: " + " ".join(f"{t:.3f}" for t in ms), flush=True)
    write_record(args.json, launches, case=f"rs {args.model} m={args.m} default",
                 cfg=dataclasses.asdict(cfg), phases=list(gemm_rs.RS_PHASES), sms=sms)


if __name__ == "__main__":
    main()
