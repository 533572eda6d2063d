"""Host time per layer call of the launch paths, A/B in one process, trials interleaved.

Timed in separate processes, the same launch path moved by 30 % from one process to the next
on a 2xH100 host, more than the effect. Here one process holds every variant and alternates
them trial by trial (order shuffled per trial, seeded):

* ``megatron``: megatron-core's own linears, as the stock step calls them (no megatron-flux code;
  ``host_overhead.megatron_linears``);
* ``nccl``: the reference backend (NCCL + cuBLAS);
* ``flux``: the fused backend as shipped: call plans per operand signature
  (``FluxBackend.call_plans``), each launching through its bound launch
  (:class:`~megatron_flux.kernels.launch.BoundLaunch`: only the operands, output and epoch
  passed per call), made from a launch through Triton's generated C launcher with addresses,
  encoded descriptors and scratch kept (:class:`~megatron_flux.kernels.launch.RawLaunch`,
  where the Triton is one it knows);
* ``flux unbound``: every call through the kernel's launcher and that raw launch
  (``FluxBackend.bound_launches = False``);
* ``flux no plans``: a call plan built on every call (``call_plans = False``);
* ``flux run``: launched directly through ``CompiledKernel.run`` (``KernelLauncher.raw =
  False``);
* ``flux triton``: launched through Triton's ``JITFunction.run``
  (``FluxOptions.direct_launch = False``).

Per variant and op (column fc1 / row fc2 layer call, forward + backward, m = 4096 by
default): the host issue time per call of a loop of ``--iters`` back-to-back calls (no sync
inside), median and quartiles over ``--trials``; and the GPU time of the same loops. Then,
paired trial by trial, each variant against ``nccl`` and each other fused variant against
the first fused one (``flux``; ``flux run`` in runs saved before the others existed): the median difference, how often it was lower, and a 90 % bootstrap interval
(``paired`` in the JSON). ``--from-json RUN... --out F`` prints and records the same for
saved runs, without a GPU.

``torchrun --nproc-per-node 2 benchmarks/experiments/host_launch_ab.py --out ab.json``
"""

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from host_overhead import init_tp, layer_ops, paired_summary, run_record  # noqa: E402

VARIANTS = {  # label: (backend, FluxOptions.direct_launch, KernelLauncher.raw, call_plans,
    #                  FluxBackend.bound_launches)
    "megatron": ("megatron", True, True, True, True),
    "nccl": ("nccl", True, True, True, True),
    "flux": ("flux", True, True, True, True),
    "flux unbound": ("flux", True, True, True, False),
    "flux no plans": ("flux", True, True, False, True),
    "flux run": ("flux", True, False, True, True),
    "flux triton": ("flux", False, True, True, True),
}


def _launchers():
    from megatron_flux.kernels import ag_gemm, ag_gemm_ws, gemm_rs, gemm_rs_ws, ready_barrier, rs_reduce

    mods = (ag_gemm, ag_gemm_ws, gemm_rs, gemm_rs_ws, ready_barrier, rs_reduce)
    return [m._LAUNCH for m in mods if m._LAUNCH is not None]


def _loop(fn, iters):
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    host = (time.perf_counter_ns() - t0) / iters / 1e3
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / iters * 1e3


def _quartiles(xs):
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def paired_rows(samples, variants):
    """Per op, every variant's host time against ``megatron`` (where it ran), the fused
    variants against ``nccl``, and the other fused variants against the first fused one
    (:func:`host_overhead.paired_summary`: trial-by-trial differences); each pair once."""
    ops = sorted({op for _, op in samples})
    fused = [v for v in variants if v.startswith("flux")]
    refs = [r for r in ("megatron", "nccl") if r in variants] + fused[:1]
    out = []
    for i, ref in enumerate(refs):
        for v in variants:
            if v in refs[:i + 1]:  # the reference itself, or a pair made against an earlier one
                continue
            for op in ops:
                var = [h for h, _ in samples[(v, op)]]
                base = [h for h, _ in samples[(ref, op)]]
                out.append({"variant": v, "reference": ref, "op": op, **paired_summary(var, base)})
    return out


def _print_paired(paired):
    for p in paired:
        lo, hi = p["ci90_us"]
        print(f"paired {p['variant']} - {p['reference']:9s} {p['op']:15s} {p['median_us']:+6.0f} us "
              f"(90% CI {lo:+.0f}..{hi:+.0f}), lower in {p['lower_in']}/{p['trials']}", flush=True)


def paired_from_runs(paths):
    """The paired rows of saved runs (their JSON), as a run prints them; no GPU needed."""
    out = []
    for path in paths:
        with open(path) as f:
            rows = json.load(f)["rows"]
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        samples = {(r["variant"], r["op"]): [(h, None) for h in r["host_trials_us"]] for r in rows}
        out.append({"run": path, "paired": paired_rows(samples, variants)})
    return out


def main():
    if "--from-json" in sys.argv:  # no torchrun: the paired reading of earlier runs
        ap = argparse.ArgumentParser(description="paired differences of saved host_launch_ab runs")
        ap.add_argument("--from-json", nargs="+", required=True, metavar="RUN")
        ap.add_argument("--out", required=True)
        args = ap.parse_args()
        runs = paired_from_runs(args.from_json)
        for run in runs:
            print(run["run"])
            _print_paired(run["paired"])
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/experiments/host_launch_ab.py "
                       + " ".join(sys.argv[1:]), "runs": runs}, f, indent=1)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", dest="m", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    rank, world, group = init_tp()
    dt, h = torch.bfloat16, args.hidden
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    ops = {v: {op: fn for op, _, _, fn in layer_ops(VARIANTS[v][0], group, world, args.m, h,
                                                    2 * args.ffn, args.ffn, dt, generator=gen)}
           for v in args.variants}

    from megatron_flux.backends.registry import get_backend

    flux = get_backend("flux")

    def select(variant):
        _, direct, raw, plans, bound = VARIANTS[variant]
        if flux.options.direct_launch != direct:
            flux.set_options(flux.options.replace(direct_launch=direct))
        flux.call_plans = plans
        flux.bound_launches = bound
        for plan in flux._call_plan_cache.values():  # a variant that could not bind left
            plan.bound[:] = [None, None]              # its parities unbound for good
        for launcher in _launchers():
            launcher.raw = raw

    for v in args.variants:  # compile and warm every path
        select(v)
        for fn in ops[v].values():
            for _ in range(5):
                fn()
    torch.cuda.synchronize()
    order_rng = random.Random(args.seed)  # the same order on every rank
    samples = {(v, op): [] for v in args.variants for op in ops[args.variants[0]]}
    for _ in range(args.trials):
        order = list(args.variants)
        order_rng.shuffle(order)
        for v in order:
            select(v)
            for op, fn in ops[v].items():
                samples[(v, op)].append(_loop(fn, args.iters))
    rows = []
    for (v, op), got in samples.items():
        host, gpu = [h_ for h_, _ in got], [g for _, g in got]
        lo, hi = _quartiles(host)
        rows.append({"variant": v, "op": op, "m": args.m, "host_us": statistics.median(host),
                     "host_q1_us": lo, "host_q3_us": hi, "gpu_us": statistics.median(gpu),
                     "host_trials_us": host, "gpu_trials_us": gpu})
        if rank == 0:
            print(f"{v:12s} {op:15s} host {statistics.median(host):7.0f} us (IQR {lo:.0f}-{hi:.0f})"
                  f"  gpu {statistics.median(gpu):7.0f} us", flush=True)
    paired = paired_rows(samples, args.variants)
    if rank == 0:
        _print_paired(paired)
        record = run_record("benchmarks/experiments/host_launch_ab.py", world, __doc__, rows,
                            ("CUDA_DEVICE_MAX_CONNECTIONS",), paired=paired)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
