"""Experiment: the fused kernels' phase stamps with communication on, every rank of a TP group.

``phase_trace.py`` runs one GPU with the peers' signals pre-set, so it cannot show what the
peers cost: the pushes over NVLink (GEMM+RS), waiting for a slower rank, chunks landing late
(AG+GEMM). This script calls the registered ``flux`` backend exactly as the layers do, under
torchrun, with the launcher wrapped so the kernel's ``TRACE`` build stamps its phases
(:mod:`megatron_flux.kernels.phase_trace`). Per shape: ``--warmup`` untraced calls, the mean
time of ``--iters`` untraced and traced calls (CUDA events, back to back as in training), then
``--launches`` traced calls back to back. Per rank and phase the record keeps the earliest,
median and latest program (µs after that rank's first program start), median over launches;
and per launch each rank's first start in ``%globaltimer`` ns. ``%globaltimer`` is not
calibrated between GPUs, so the skew is only indicative.

A GEMM+RS config of the warp-specialized kernel (``rs_warp_specialized``) runs that kernel
(where it can take the shape) with its own stamps (``gemm_rs_ws.WS_RS_PHASES`` and
``WS_RS_SYNC`` per MMA partition, summarised as ``phase_trace_ws.py`` does: with communication
on, ``counted_in`` after the last push's epilogue is the drain of the pushes over NVLink, and
``peers_acquired`` after the first own tile's MMAs the wait for the peers' signals), not the
Triton kernel that the package's dispatch traces. The
backend's bound launches are off here, so every call goes through the launcher that stamps.
An AG+GEMM config of the warp-specialized kernel is still traced on the Triton kernel.

``--comm off`` is the control: every rank runs the same kernel and config at the same time,
wired to its own GPU alone (``kernel_vs_cublas``'s one-GPU wiring: peers' signals pre-set,
pushes into local scratch). Both GPUs are then as busy as with communication on, but nothing
crosses NVLink, so a difference between the two runs is the communication's, not the box's
(a one-GPU run as the control cannot tell the two apart).

    torchrun --nproc-per-node 2 benchmarks/experiments/phase_trace_tp.py --op rs \
        --models llama3-70b --ms 8192 --json rs-tp-trace.json
    torchrun --nproc-per-node 2 benchmarks/experiments/phase_trace_tp.py --op rs \
        --model-shapes yi1.5-9b:4096:22016:11008 --ms 1024 --comm off --json rs-tp-trace-off.json

(run as a script, with the repository root on ``PYTHONPATH``: it imports ``phase_trace`` beside it)
"""

import argparse
import json

import torch
import torch.distributed as dist

from common import flux_backend_under_torchrun, next_rank_buffer, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import (add_model_args, ag_on_one_gpu,
                                                              mean_ms, model_shapes,
                                                              rs_on_one_gpu)
from megatron_flux.backends.flux.resources import deps
from megatron_flux.kernels import ag_gemm as ag_module
from megatron_flux.kernels import gemm_rs as rs_module
from megatron_flux.kernels import gemm_rs_ws
from megatron_flux.kernels.phase_trace import new_trace
from phase_trace import summarize
from phase_trace_ws import summarize as summarize_ws


class TracedLauncher:
    """Wraps a module's ``launch_*`` (and the backend's reference to it, ``deps()``) so every
    launch stamps into ``self.trace`` when it is set. With ``ws_launch`` (GEMM+RS), a traced
    launch whose config is the warp-specialized kernel's runs ``ws_launch`` with the trace (the
    package's dispatch would trace the Triton kernel instead)."""

    def __init__(self, module, name, ws_launch=None):
        self.module, self.name, self.ws_launch = module, name, ws_launch
        self.inner = getattr(module, name)
        self.trace = None
        setattr(module, name, self)
        setattr(deps(), name, self)

    def __call__(self, *args, **kwargs):
        # the one-GPU wiring (``--comm off``) passes its own ``trace``; the backend never does
        kwargs.setdefault("trace", self.trace)
        if (self.ws_launch is not None and kwargs["trace"] is not None
                and ws_traced(args[0], kwargs["world"], kwargs["cfg"])):
            assert kwargs.pop("produce", True) and kwargs.pop("consume", True)
            return self.ws_launch(*args, **kwargs)
        return self.inner(*args, **kwargs)


def ws_traced(a, world: int, cfg) -> bool:
    """Whether a GEMM+RS of ``a`` (all ranks' rows) with ``cfg`` runs, and is traced on, the
    warp-specialized kernel: its config asks for it and the kernel can take the shape (else
    the Triton kernel runs, with its own stamp layout)."""
    return (bool(getattr(cfg, "rs_warp_specialized", False))
            and gemm_rs_ws.unsupported_reason(a, a.shape[0] // world, cfg) is None)


def trace_buffer(ws: bool, grid: int, dev) -> torch.Tensor:
    """A stamp buffer of every program, every slot ``-1``: the warp-specialized kernel's
    layout (``WS_TRACE_SLOTS``) or the Triton kernels' (:func:`new_trace`)."""
    if ws:
        return torch.full((grid, gemm_rs_ws.WS_TRACE_SLOTS), -1, dtype=torch.int64, device=dev)
    return new_trace(grid, dev)


def make_call(op, comm, backend, launcher, group, m, n, k, cfg, dev):
    """``(call, keep)``: ``call(trace)`` runs one op (``trace``: a stamp buffer or None);
    ``keep`` holds its tensors until the caller drops it. ``comm == "on"``: the registered flux
    backend as a layer calls it (each rank's ``m / world`` rows for AG+GEMM, all ``m`` rows
    for GEMM+RS); ``"off"``: the kernel with ``cfg`` in ``kernel_vs_cublas``'s one-GPU wiring."""
    world = group.size()
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    b = w.t()  # [K, N] view of the weight, as a layer's
    if comm == "off":
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        err = torch.zeros(4, dtype=torch.int32, device=dev)
        if op == "ag":
            launch, out = ag_on_one_gpu(a, w, world, cfg, err)
            return (lambda trace: launch(trace=trace)), (a, w, out, err)
        launch, out, data = rs_on_one_gpu(a, w, world, err)
        return (lambda trace: launch(cfg, trace=trace)), (a, w, out, data, err, launch)
    if op == "ag":
        a = torch.randn(m // world, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        fn = backend.all_gather_matmul
    else:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m // world, n, device=dev, dtype=torch.bfloat16)
        fn = backend.matmul_reduce_scatter

    def call(trace):
        launcher.trace = trace
        try:
            fn(a, b, group, out=out)
        finally:
            launcher.trace = None

    return call, (a, w, out)


class Trickle:
    """``--trickle-kib``: beside every call a side stream copies that many KiB into the next
    rank's symmetric buffer by the copy engine, so the link is in use while the kernel runs
    (with ``--comm off``: the kernel's own traffic stays local; on a power-capped 2xH200 any
    NVLink traffic near cuBLAS cost it 1-3 %, whatever the bytes, ``link_power.py``)."""

    def __init__(self, kib, group, dev):
        elems = kib * 1024 // 2
        self.buf, self.handle, self.peer = next_rank_buffer(elems, group, dev)
        self.src = torch.randn(elems, device=dev, dtype=torch.bfloat16)
        self.side = torch.cuda.Stream(dev)

    def wrap(self, call):
        def with_trickle(trace):
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self.peer.copy_(self.src, non_blocking=True)
            call(trace)
            main.wait_stream(self.side)
        return with_trickle


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--op", choices=["ag", "rs"], default="rs")
    add_model_args(p, default_models=["llama3-70b"])  # --models, --model-shapes, --rs-k
    p.add_argument("--ms", nargs="+", type=int, default=[8192],
                   help="token counts (not --m: torchrun would take that for one of its own)")
    p.add_argument("--comm", choices=["on", "off"], default="on",
                   help="off: every rank runs the kernel wired to its own GPU alone (peers' "
                        "signals pre-set, pushes to local scratch) at the same time, the control "
                        "that separates communication from two busy GPUs")
    p.add_argument("--override", type=json.loads, default=None,
                   help="GemmConfig fields (JSON) applied to every config the backend picks")
    p.add_argument("--trickle-kib", type=int, default=0,
                   help="copy this many KiB to the next rank beside every call (see Trickle)")
    p.add_argument("--launches", type=int, default=7)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args(argv)

    group, rank, world, dev, backend = flux_backend_under_torchrun(args.override)
    backend.bound_launches = False  # a bound launch would skip the launcher that stamps
    launcher = (TracedLauncher(ag_module, "launch_ag_gemm") if args.op == "ag"
                else TracedLauncher(rs_module, "launch_gemm_rs", gemm_rs_ws.launch_gemm_rs_ws))
    phases = ag_module.AG_PHASES if args.op == "ag" else rs_module.RS_PHASES
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    trickle = Trickle(args.trickle_kib, group, dev) if args.trickle_kib else None
    rows = []
    args.tp = world
    for model, n, k in model_shapes(args, args.op):
        for m in args.ms:
            torch.manual_seed(1234 + rank)
            cfg = backend.config(args.op, m, n, k, dtype=torch.bfloat16, tp=world, device=dev)
            call, keep = make_call(args.op, args.comm, backend, launcher, group, m, n, k, cfg, dev)
            ws = args.op == "rs" and ws_traced(keep[0], world, cfg)  # keep[0]: all ranks' rows
            if trickle is not None:
                call = trickle.wrap(call)
            grid_cap = sms
            scratch = trace_buffer(ws, grid_cap, dev)
            for _ in range(args.warmup):
                call(None)
            dist.barrier()
            untraced_ms = mean_ms(lambda call=call: call(None), args.iters)
            for _ in range(args.warmup):
                call(scratch)
            dist.barrier()
            traced_ms = mean_ms(lambda call=call: call(scratch), args.iters)
            bufs = [trace_buffer(ws, grid_cap, dev) for _ in range(args.launches)]
            dist.barrier()
            for buf in bufs:
                call(buf)
            torch.cuda.synchronize()
            if ws:
                summary = summarize_ws([buf.cpu() for buf in bufs], 2 if cfg.num_warps == 4 else 1)
                summary.pop("span_us")  # every phase below is {first, median, last, programs}
                step = None
            else:
                summary, step = summarize(bufs, phases)
            starts = [int(buf[buf >= 0].min()) for buf in bufs]
            mine = {"rank": rank, "phases": summary, "timer_step_ns": step,
                    "untraced_ms": untraced_ms, "traced_ms": traced_ms, "starts_ns": starts}
            every = [None] * world
            dist.all_gather_object(every, mine)
            record = {"comm": args.comm, "override": args.override,
                      "kernel": "gemm_rs_ws" if ws else args.op,
                      "trickle_kib": args.trickle_kib, "op": args.op, "model": model,
                      "m": m, "n": n, "k": k, "tp": world, "cfg": cfg.to_dict(), "ranks": every}
            rows.append(record)
            if rank == 0:
                for r in every:
                    shown = "  ".join(f"{name} {v['first']:.1f}/{v['median']:.1f}/{v['last']:.1f}"
                                      for name, v in r["phases"].items())
                    skew = [(s - s0) / 1000.0 for s, s0 in zip(r["starts_ns"], every[0]["starts_ns"])]
                    print(f"{args.op} {model} m={m} comm {args.comm}{'+trickle' if args.trickle_kib else ''} rank {r['rank']}: {r['untraced_ms']:.4f} ms "
                          f"(traced {r['traced_ms']:.4f})  start-vs-rank0 "
                          f"{min(skew):+.1f}..{max(skew):+.1f} us  {shown}", flush=True)
            del call, keep
            torch.cuda.empty_cache()
    dist.barrier()  # every rank's last trickle into a peer's buffer has landed
    if rank == 0:
        write_record(args.json, rows, what=f"per-program phase stamps, communication {args.comm} "
                     "(µs after each rank's first program start: earliest/median/latest program, "
                     "median over launches)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
