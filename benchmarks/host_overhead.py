"""Host (CPU) cost per call of each backend vs its GPU time, under torchrun (TP = world size).

If issuing a call takes longer on the CPU than the call runs on the GPU, back-to-back timings
measure Python, not kernels, and so does a training step made of such calls. Per backend, op and
m (llama3-8b fc1/fc2 shapes by default) this records:

* ``cpu_issue_ms``: wall time per call of a loop of back-to-back calls, no sync inside the loop
  (median of ``--trials`` loops);
* ``gpu_ms``: CUDA-event time per call over the same loops (median);
* for the fused backend, a ``cProfile`` of one extra loop on rank 0: the functions with the most
  own time (``tottime``) and cumulative time, so the host path's cost can be attributed.

With ``--layers`` the same is measured one level up, for what a training step calls: forward and
backward of ``column_parallel_linear`` (fc1 shape) and ``row_parallel_linear`` (fc2 shape) on
``[s/tp, 1, h]`` activations, per backend (``auto`` included; ``megatron``: megatron-core's own
linears, the stock step's), cProfiled for every backend but ``nccl``. ``op`` is then
``column fwd+bwd`` / ``row fwd+bwd``.

``torchrun --nproc-per-node N benchmarks/host_overhead.py --out host.json``
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _profile_rows(prof: cProfile.Profile, calls: int, top: int):
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(path)}:{line}({func})", "calls_per_op": nc / calls,
                     "own_us_per_op": tt / calls * 1e6, "cum_us_per_op": ct / calls * 1e6})
    by_own = sorted(rows, key=lambda r: -r["own_us_per_op"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_us_per_op"])[:top]
    return {"by_own_time": by_own, "by_cumulative_time": by_cum}


def _time_loop(fn, iters: int):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    cpu = (time.perf_counter() - t0) / iters * 1e3
    end.record()
    end.synchronize()
    return cpu, start.elapsed_time(end) / iters


def init_tp():
    """The torchrun process group (NCCL) with this rank on its own GPU: ``(rank, world,
    group)``, the group being every rank (TP = world size)."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    return rank, world, dist.group.WORLD


def megatron_linears(group):
    """megatron-core's own sequence-parallel linears, as its Column/RowParallelLinear call them
    with ``--sequence-parallel`` and no gradient-accumulation fusion (no megatron-flux code):
    ``(column(x, w), row(a, w))``. Column: AllGather of ``x``, GEMM, and in backward a re-gather
    of ``x`` and a ReduceScatter of its gradient; row: GEMM, then ReduceScatter. The global
    memory buffer the column's gathers use is made if megatron's parallel state has none."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
    from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()

    def column(x, w):
        return linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=True, tp_group=group)

    def row(a, w):
        out = linear_with_grad_accumulation_and_async_allreduce(
            a, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False, tp_group=group)
        return reduce_scatter_to_sequence_parallel_region(out, group=group)

    return column, row


def layer_ops(name, group, world, m, h, fc1, ffn, dt, generator=None):
    """fwd+bwd closures of the column (fc1) and row (fc2) ops with backend ``name``, as
    ``(op, n, k, fn)``; random operands from ``generator`` (default: the global one). ``name``
    ``megatron``: megatron-core's own linears (:func:`megatron_linears`), the stock step's.
    Also used by ``benchmarks/experiments/host_sections.py`` and ``host_launch_ab.py``."""
    from megatron_flux.ops import column_parallel_linear, row_parallel_linear

    def t(*shape, grad=False):
        return torch.randn(*shape, device="cuda", dtype=dt, generator=generator).requires_grad_(grad)

    x, w1, g1 = t(m // world, 1, h, grad=True), t(fc1 // world, h, grad=True), t(m, 1, fc1 // world)
    a, w2, g2 = t(m, 1, ffn // world, grad=True), t(h, ffn // world, grad=True), t(m // world, 1, h)
    if name == "megatron":
        column_op, row_op = megatron_linears(group)
    else:
        def column_op(x, w):  # keeping the gathered input, as the layers do by default
            return column_parallel_linear(x, w, group=group, backend=name, keep_gathered_input=True)

        def row_op(a, w):
            return row_parallel_linear(a, w, group=group, backend=name)

    def column():
        column_op(x, w1).backward(g1)
        x.grad = w1.grad = None

    def row():
        row_op(a, w2).backward(g2)
        a.grad = w2.grad = None

    return (("column fwd+bwd", fc1, h, column), ("row fwd+bwd", h, ffn, row))


def paired_summary(variant_trials, reference_trials, seed=0, resamples=2000):
    """``variant - reference`` per trial, for trials that alternated in one process: the median
    difference, in how many trials the variant was lower, and a 90 % bootstrap interval of the
    median (``resamples`` draws of the trials with replacement, seeded). Host times swing by
    tens of percent between processes and trials (30 % for the same path in two processes on
    a 2xH100 host), so differences between variants are read only this way."""
    import random

    if len(variant_trials) != len(reference_trials) or not variant_trials:
        raise ValueError(f"paired_summary: {len(variant_trials)} against {len(reference_trials)} "
                         f"trials; they must pair one to one")
    diffs = [v - r for v, r in zip(variant_trials, reference_trials)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return {"median_us": statistics.median(diffs), "lower_in": sum(d < 0 for d in diffs),
            "trials": len(diffs),
            "ci90_us": [medians[int(0.05 * (resamples - 1))], medians[int(0.95 * (resamples - 1))]]}


def run_record(script, world, definition, rows, env_keys, **extra):
    """The JSON record of a torchrun host-time run of ``script`` (this command line, GPU,
    versions, the ``env_keys`` environment variables, ``definition``, ``rows``, ``extra``)."""
    import triton

    return {"command": "torchrun --nproc-per-node %d %s %s" % (world, script, " ".join(sys.argv[1:])),
            "gpu": torch.cuda.get_device_name(), "tp": world, "torch": torch.__version__,
            "triton": triton.__version__, "env_vars": {k: os.environ.get(k) for k in env_keys},
            "definition": definition, "rows": rows, **extra}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336, help="MLP width (fc1 is 2x this, gated)")
    # not --m: torchrun takes an ambiguous prefix of its own options (--m -> --master-port...)
    ap.add_argument("--ms", dest="m", type=int, nargs="+", default=[64, 1024, 4096, 8192],
                    help="global rows")
    ap.add_argument("--backends", nargs="+", default=["nccl", "flux"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--layers", action="store_true",
                    help="time the ops' forward+backward (column fc1, row fc2) instead of the backends")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from megatron_flux.backends import get_backend

    rank, world, group = init_tp()
    h, fc1, ffn = args.hidden, 2 * args.ffn, args.ffn
    dt = torch.bfloat16
    rows = []
    if "megatron" in args.backends and not args.layers:
        ap.error("--backends megatron needs --layers (megatron-core has linears, not a backend)")
    for name in args.backends:
        be = None if args.layers else get_backend(name)
        for m in args.m:
            x = torch.randn(m // world, h, device="cuda", dtype=dt)
            w1 = torch.randn(fc1 // world, h, device="cuda", dtype=dt)
            a = torch.randn(m, ffn // world, device="cuda", dtype=dt)
            w2 = torch.randn(h, ffn // world, device="cuda", dtype=dt)
            if args.layers:
                ops = layer_ops(name, group, world, m, h, fc1, ffn, dt)
            else:
                ops = (("AG+GEMM", fc1, h, lambda: be.all_gather_matmul(x, w1.t(), group)),
                       ("GEMM+RS", h, ffn, lambda: be.matmul_reduce_scatter(a, w2.t(), group)))
            for op, n, k, fn in ops:
                for _ in range(5):
                    fn()
                loops = [_time_loop(fn, args.iters) for _ in range(args.trials)]
                row = {"backend": name, "op": op, "m": m, "n": n, "k": k, "tp": world,
                       "cpu_issue_ms": statistics.median(c for c, _ in loops),
                       "gpu_ms": statistics.median(g for _, g in loops),
                       "cpu_issue_trials_ms": [c for c, _ in loops], "gpu_trials_ms": [g for _, g in loops]}
                if name not in ("nccl", "megatron"):
                    prof = cProfile.Profile()
                    torch.cuda.synchronize()
                    dist.barrier()
                    prof.enable()
                    for _ in range(args.iters):
                        fn()
                    prof.disable()
                    torch.cuda.synchronize()
                    if rank == 0:
                        row["profile_rank0"] = _profile_rows(prof, args.iters, args.top)
                rows.append(row)
                if rank == 0:
                    print(f"{name:5s} {op:8s} m={m:5d}  cpu issue {row['cpu_issue_ms']:.3f} ms/call  "
                          f"gpu {row['gpu_ms']:.3f} ms/call", flush=True)
    if rank == 0:
        record = run_record("benchmarks/host_overhead.py", world, __doc__, rows,
                            ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE",
                             "TORCH_SYMM_MEM_DISABLE_MULTICAST"))
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        buf = io.StringIO()
        for row in rows:
            for r in row.get("profile_rank0", {}).get("by_own_time", [])[:8]:
                buf.write(f"{row['op']} m={row['m']}: {r['own_us_per_op']:7.1f} us own  "
                          f"x{r['calls_per_op']:.1f}  {r['function']}\n")
        print(buf.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
