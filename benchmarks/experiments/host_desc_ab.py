"""Experiment: the fused Triton kernels with TMA descriptors encoded on the host against built on
the device (``host_descriptors``), communication off (``kernel_vs_cublas``'s TP 2 wiring).

Per shape (the table's config at m >= 1024, the default below): GPU time with the methods taking
turns launch by launch (``kernel_vs_cublas._time_alternating``: each ratio is the median of
per-round ratios to the cuBLAS launch beside it), and the host time of one launch call (mean
over ``--host-calls`` calls queued behind a GPU sleep, so the host never waits for the GPU).

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/host_desc_ab.py \
        --ops ag rs --m 64 1024 --json host-desc.json
"""

import argparse
import functools
import statistics
import time

import torch

from common import named_configs, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import (
    _sleep_cycles_per_ms,
    _time_alternating,
    ag_on_one_gpu,
    grid_shape,
    rs_on_one_gpu,
)
from megatron_flux.kernels.ag_gemm import launch_ag_gemm
from megatron_flux.kernels.gemm_rs import launch_gemm_rs
from megatron_flux.tuning.provider import TableConfigProvider

MODELS = ("gpt3-175b", "llama3-70b", "llama3-8b")


def host_us(fn, calls):
    """Mean host time of one ``fn()`` call (µs), the GPU kept busy by a sleep so no call
    waits for it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(200 * _sleep_cycles_per_ms()))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def ws_config(op):
    """The Gluon ping-pong 128x128x64/5 (``--ws``)."""
    from megatron_flux.kernels.config import GemmConfig

    knob = "ag_warp_specialized" if op == "ag" else "rs_warp_specialized"
    return GemmConfig(128, 128, 64, 5, 4, 8, chunk_rows=4096, epilogue_split=1, **{knob: True})


def methods(op, model, m, ws=False):
    n, k = grid_shape(op, model, 2)
    if ws:
        cfg = ws_config(op)
    else:
        cfg = named_configs(TableConfigProvider(), op, m, n, k, 2)["table" if m >= 1024 else "default"]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    fns, outs = {"cublas": lambda: torch.matmul(a, w.t())}, {}
    for label, host in (("host", True), ("device", False)):
        err = torch.zeros(4, dtype=torch.int32, device="cuda")
        if op == "ag":
            launch, out = ag_on_one_gpu(a, w, 2, cfg, err, functools.partial(
                launch_ag_gemm, host_descriptors=host))
            fns[label] = launch
        else:
            launch, out, data = rs_on_one_gpu(a, w, 2, err, functools.partial(
                launch_gemm_rs, host_descriptors=host))
            fns[label] = functools.partial(launch, cfg)
        outs[label] = (out, err)
    return n, k, cfg, fns, outs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", default=["ag", "rs"])
    p.add_argument("--m", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--host-calls", type=int, default=200)
    p.add_argument("--ws", action="store_true",
                   help="time the Gluon ping-pong (128x128x64/5) instead of the table/default")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for op in args.ops:
        for model in MODELS:
            for m in args.m:
                n, k, cfg, fns, outs = methods(op, model, m, args.ws)
                for fn in fns.values():
                    fn()
                torch.cuda.synchronize()
                host_out, host_err = outs["host"]
                dev_out, dev_err = outs["device"]
                same = bool(torch.equal(host_out, dev_out)) and int(host_err[0]) == int(dev_err[0]) == 0
                times, ratios = _time_alternating(fns, args.trials, args.rounds, args.warmup, 0, 5.0)
                host = {name: host_us(fns[name], args.host_calls) for name in ("host", "device")}
                row = {"op": op, "model": model, "m": m, "n": n, "k": k, "cfg": cfg.to_dict(),
                       "bitwise_equal": same,
                       "ms": {x: statistics.median(t) for x, t in times.items()},
                       "ratio": {x: statistics.median(r) for x, r in ratios.items()},
                       "trials_ratio": ratios, "host_us": host}
                rows.append(row)
                print(f"{op} {model:10s} m={m:5d} equal={same} host x{row['ratio']['host']:.3f} "
                      f"device x{row['ratio']['device']:.3f}  host-side us: "
                      f"{host['host']:.1f} vs {host['device']:.1f}", flush=True)
                write_record(args.json, rows)  # so far: a run cut short keeps its rows


if __name__ == "__main__":
    main()
