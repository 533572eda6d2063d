"""Where a layer call's host time goes, with less distortion than cProfile.

``benchmarks/host_overhead.py --layers`` measures a layer call's host (CPU) issue time and
cProfiles it, but cProfile charges every profiled call, so code made of many small calls looks
slower than it is and the sums do not add up to the measured time. Here a short list of
functions is wrapped (``time.perf_counter_ns`` around the call, about 0.3 µs each) and their
*inclusive* time is summed per layer call; everything else runs unwrapped. Nested targets
count in both (read ``jit.run`` inside ``launch_ag_gemm_ws`` inside ``all_gather_matmul``).

Also timed, per call, on rank-local work only (no peer): the primitive host operations the
fused path is made of (a same-device ``copy_``, ``stream_write_value32``, an event hand-off
between streams, an empty Triton launch, a ``torch.empty``, ``torch.matmul``'s issue).

``torchrun --nproc-per-node 2 benchmarks/experiments/host_sections.py --out sections.json``
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from host_overhead import init_tp, layer_ops, run_record  # noqa: E402

_SUMS = defaultdict(int)
_CALLS = defaultdict(int)


def _wrap(owner, attr, label):
    fn = getattr(owner, attr)

    def wrapper(*a, **kw):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            _SUMS[label] += time.perf_counter_ns() - t0
            _CALLS[label] += 1

    wrapper.__wrapped__ = fn
    setattr(owner, attr, wrapper)
    return owner, attr, fn


def _targets():
    """(owner, attribute, label) of every wrapped function; owners are modules or classes."""
    import triton.backends.nvidia.driver as nvdriver
    from triton.runtime.jit import JITFunction

    from megatron_flux.backends import nccl as N
    from megatron_flux.backends.flux import ag, handles, regather, rs
    from megatron_flux.backends.flux.backend import FluxBackend
    from megatron_flux.comm import signals, streams
    from megatron_flux.kernels import ag_gemm, ag_gemm_ws, gemm_rs, gemm_rs_ws, launch, ready_barrier
    from megatron_flux.ops import column_parallel as C
    from megatron_flux.ops import row_parallel as R

    t = [
        (C, "resolve_backend", "resolve_backend (column)"),
        (R, "resolve_backend", "resolve_backend (row)"),
        (C, "accumulate_weight_grad", "wgrad (column)"),
        (R, "accumulate_weight_grad", "wgrad (row)"),
        (ag, "all_gather_matmul", "flux.all_gather_matmul"),
        (rs, "matmul_reduce_scatter", "flux.matmul_reduce_scatter"),
        (FluxBackend, "matmul_reduce_scatter_start", "flux.matmul_reduce_scatter_start"),
        (regather, "all_gather_start", "flux.all_gather_start (copy engine)"),
        (handles.CopyEngineGather, "wait", "flux gather wait()"),
        (FluxBackend, "check", "flux.check"),
        (FluxBackend, "config", "flux.config"),
        (rs, "_deliver", "flux GEMM+RS copy-engine delivery (side stream)"),
        (ag, "_push", "flux AG+GEMM pushes (side stream)"),
        (rs, "rs_plan", "flux GEMM+RS call plan made"),
        (ag, "ag_plan", "flux AG+GEMM call plan made"),
        (N.NcclBackend, "all_gather_matmul", "nccl.all_gather_matmul"),
        (N.NcclBackend, "matmul_reduce_scatter", "nccl.matmul_reduce_scatter"),
        (N.NcclBackend, "matmul_reduce_scatter_start", "nccl.matmul_reduce_scatter_start"),
        (N.NcclBackend, "all_gather_start", "nccl.all_gather_start"),
        (ag_gemm, "launch_ag_gemm", "launch_ag_gemm"),
        (ag_gemm_ws, "launch_ag_gemm_ws", "launch_ag_gemm_ws"),
        (gemm_rs, "launch_gemm_rs", "launch_gemm_rs"),
        (gemm_rs_ws, "launch_gemm_rs_ws", "launch_gemm_rs_ws"),
        (ready_barrier, "launch_ready_barrier", "launch_ready_barrier"),
        (launch.KernelLauncher, "__call__", "KernelLauncher.__call__"),
        (launch, "specialization_key", "specialization_key"),
        (launch.RawLaunch, "__call__", "RawLaunch.__call__ (Triton's C launcher)"),
        (launch.BoundLaunch, "__call__", "BoundLaunch.__call__ (a call plan's launch)"),
        (rs, "launch_or_bound", "flux GEMM+RS launch, bound or not"),
        (ag, "launch_or_bound", "flux AG+GEMM launch, bound or not"),
        (JITFunction, "run", "triton JITFunction.run"),
        (nvdriver.CudaLauncher, "__call__", "triton CudaLauncher.__call__"),
        (nvdriver, "make_tensordesc_arg", "triton make_tensordesc_arg"),
        (signals, "write_signal", "write_signal"),
        (streams.StreamOrder, "__call__", "StreamOrder"),
        (torch.Tensor, "copy_", "Tensor.copy_"),
        (torch, "matmul", "torch.matmul"),
        (torch, "empty", "torch.empty"),
    ]
    for mod in (ag_gemm_ws, gemm_rs_ws):
        if hasattr(mod, "_host_descriptors"):
            t.append((mod, "_host_descriptors", f"{mod.__name__.rsplit('.', 1)[1]}._host_descriptors"))
    return t


def _loop(fn, iters, across_ranks=True):
    """Host µs per call of ``iters`` back-to-back calls (no sync inside); with
    ``across_ranks`` the ranks start together (a barrier), else this rank alone."""
    torch.cuda.synchronize()
    if across_ranks:
        dist.barrier()
        torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    host = (time.perf_counter_ns() - t0) / iters / 1e3
    torch.cuda.synchronize()
    return host


@triton.jit
def _noop(ptr, n, BLOCK: tl.constexpr):
    pass


def _primitives(iters, trials):
    """Host µs per call of the fused path's building blocks, on this GPU alone."""
    from megatron_flux.comm.signals import write_signal
    from megatron_flux.comm.streams import StreamOrder, on_stream
    from megatron_flux.kernels.launch import KernelLauncher

    src = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    flags = torch.zeros(64, dtype=torch.uint32, device="cuda")
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    order = StreamOrder()
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    epoch = [0]
    noop = KernelLauncher(_noop)

    def signal():
        epoch[0] += 1
        write_signal(flags, 0, epoch[0])

    def side_copy():
        with on_stream(side, cur):
            dst.copy_(src)

    cases = {
        "copy_ 2 MB same device": lambda: dst.copy_(src),
        "stream_write_value32": signal,
        "StreamOrder (record + wait_event)": lambda: order(side, cur),
        "on_stream enter/exit + copy_": side_copy,
        "torch.empty 2 MB": lambda: torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda"),
        "torch.matmul 256^3": lambda: torch.matmul(a, a),
        "triton empty kernel launch": lambda: _noop[(1,)](src, 1, BLOCK=16),
        "KernelLauncher empty kernel launch": lambda: noop(1, (src, 1), {"BLOCK": 16}, num_warps=1),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        out[name] = statistics.median(_loop(fn, iters, across_ranks=False) for _ in range(trials))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", dest="m", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--backends", nargs="+", default=["nccl", "flux"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron_flux.backends.flux import resources

    rank, world, group = init_tp()
    h, fc1, ffn = args.hidden, 2 * args.ffn, args.ffn
    dt = torch.bfloat16
    rows = []
    for name in args.backends:
        for op, _, _, fn in layer_ops(name, group, world, args.m, h, fc1, ffn, dt):
            for _ in range(5):
                fn()
            plain, wrapped, sums = [], [], []
            for _ in range(args.trials):  # plain and wrapped loops alternate
                plain.append(_loop(fn, args.iters))
                patched = [_wrap(o, a, lbl) for o, a, lbl in _targets()]
                resources._DEPS = None  # the fused backend's functions table picks up the wrappers
                _SUMS.clear()
                _CALLS.clear()
                try:
                    wrapped.append(_loop(fn, args.iters))
                finally:
                    for o, a, f in reversed(patched):
                        setattr(o, a, f)
                    resources._DEPS = None
                sums.append({k: (v / args.iters / 1e3, _CALLS[k] / args.iters) for k, v in _SUMS.items()})
            labels = sorted({k for s in sums for k in s})
            sections = {k: {"us_per_layer_call": statistics.median(s.get(k, (0.0, 0))[0] for s in sums),
                            "calls_per_layer_call": statistics.median(s.get(k, (0.0, 0))[1] for s in sums)}
                        for k in labels}
            row = {"backend": name, "op": op, "m": args.m, "host_us": statistics.median(plain),
                   "host_us_trials": plain, "host_us_wrapped": statistics.median(wrapped),
                   "sections": sections}
            rows.append(row)
            if rank == 0:
                print(f"{name:5s} {op}: host {row['host_us']:.0f} us/call "
                      f"(wrapped {row['host_us_wrapped']:.0f})", flush=True)
                for k, v in sorted(sections.items(), key=lambda kv: -kv[1]["us_per_layer_call"]):
                    print(f"    {v['us_per_layer_call']:8.1f} us  x{v['calls_per_layer_call']:.1f}  {k}")
    prims = _primitives(200, args.trials)
    if rank == 0:
        for k, v in prims.items():
            print(f"  primitive {k}: {v:.1f} us")
        record = run_record("benchmarks/experiments/host_sections.py", world, __doc__, rows,
                            ("CUDA_DEVICE_MAX_CONNECTIONS", "MEGATRON_FLUX_DIRECT_LAUNCH",
                             "MEGATRON_FLUX_HOST_DESCRIPTORS"), primitives_us=prims)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
