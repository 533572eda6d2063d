"""Experiment: what does GEMM+RS's signalling itself cost, with both ranks on one GPU?

With communication on, the held-out GEMM+RS cases at m = 1024 run 10-17 % of cuBLAS's time
slower than the same kernel with communication off (``docs/performance.md``, "Where the
held-out GEMM+RS efficiency goes"). That difference holds the NVLink traffic and its power,
the skew between the ranks, and the protocol: the grid barrier that raises an owner's signal
after the whole grid has pushed its rows, and the owner's wait for every peer's signal before
its own tiles' reduction. This separates the protocol, on one GPU: ``W`` simulated ranks, each
a grid of ``--sms`` programs (``W * sms`` at most the GPU's SMs, so every program of every rank
is resident) on its own stream, all started by one event:

* ``paired``: real signals: the ranks push into each other's slots (GPU memory) and wait for
  each other (``rs_ranks.SimulatedRanks``, the tests' wiring);
* ``apart``: the same launches, each rank wired alone (``kernel_vs_cublas.rs_on_one_gpu``:
  peers' signals pre-set, pushes into a local scratch region), so nothing waits, with the same
  SMs, memory traffic and power shared;
* ``alone``: rank 0 alone, wired alone, the rest of the GPU idle.

Per trial, ``--iters`` launches of each method back to back (the ranks' streams joined between
launches, so no launch overlaps the next one's slots), queued behind a sleep so that the GPU
never waits for the host (without it the second rank's launch started late: host-bound
times), methods in a shuffled order; the time of a launch is from the common start event to
the last rank's end. ``paired`` over ``apart``
is what the protocol costs on top of a concurrent run: its waits and barrier, and a rank's
reduction waiting for the slower rank's pushes. Every output is checked against the fp32 sum.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/rs_ranks_one_gpu.py \\
        --model-shapes yi1.5-9b:4096:22016:11008 --ms 512 1024 --json rs-ranks.json

The grid here is ``--sms`` programs a rank, so ``m`` = 512 on 66 programs has the tiles per
program of m = 1024 on a whole H200; the config is the one the backend runs (tables and rules)
at that whole-GPU m, ``m * SMs / sms``, with SM pushes where it pushes by the copy engine
(whose copies the backend's side stream makes; the record says where).
"""

import argparse
import dataclasses
import random
import statistics

import torch

from common import write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import _sleep_cycles_per_ms, rel_err, rs_on_one_gpu
from megatron_flux.tools.diagnostics.rs_ranks import SimulatedRanks

MAX_SPINS = 1 << 24


class Paired:
    """``world`` ranks wired to each other through GPU memory (real signals, epochs rising)."""

    def __init__(self, a, w, cfg, sms):
        self.ranks = SimulatedRanks(a, w, [cfg] * len(a), [sms] * len(a), max_spins=MAX_SPINS)
        self.epoch = 0

    def load(self):
        self.ranks.load()

    def launch(self, r):
        if r == 0:
            self.epoch += 1
        self.ranks.launch(r, self.epoch)

    def error(self, ref):
        self.ranks.check_protocol(self.epoch)
        return max(self.ranks.rel_errors(ref))


class Apart:
    """The same ranks' launches, each wired alone (no waits)."""

    def __init__(self, a, w, cfg, sms, ranks):
        self.errs = [torch.zeros(4, dtype=torch.int32, device=a[0].device) for _ in range(ranks)]
        self.wired = [rs_on_one_gpu(a[r], w[r], len(a), self.errs[r], num_sms=sms) for r in range(ranks)]
        self.a, self.w, self.cfg = a, w, cfg

    def load(self):
        for r in range(len(self.wired)):
            self.launch(r)
        torch.cuda.synchronize()

    def launch(self, r):
        self.wired[r][0](self.cfg)

    def error(self, _ref):
        world = len(self.a)
        worst = 0.0
        for r, (_, out, data) in enumerate(self.wired):
            if self.errs[r].any():
                raise RuntimeError(f"rank {r} alone: error word {self.errs[r].tolist()}")
            ref = (self.a[r].float() @ self.w[r].t().float())[:out.shape[0]]
            for src in range(1, world):
                ref = ref + data[src].float()
            worst = max(worst, rel_err(out.float(), ref))
        return worst


def time_method(method, ranks, streams, iters, queue_ahead_ms=0.0):
    """Mean ms per launch of ``ranks`` ranks started together, each on its stream, queued behind
    a sleep of ``queue_ahead_ms`` so the GPU does not wait for the host's launches."""
    main = torch.cuda.current_stream()
    if queue_ahead_ms:
        torch.cuda._sleep(int(queue_ahead_ms * _sleep_cycles_per_ms()))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [[torch.cuda.Event(enable_timing=True) for _ in range(ranks)] for _ in range(iters)]
    for i in range(iters):
        starts[i].record(main)
        for r in range(ranks):
            streams[r].wait_event(starts[i])
            with torch.cuda.stream(streams[r]):
                method.launch(r)
            ends[i][r].record(streams[r])
        for r in range(ranks):
            main.wait_event(ends[i][r])
    torch.cuda.synchronize()
    return statistics.mean(max(starts[i].elapsed_time(e) for e in ends[i]) for i in range(iters))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-shapes", nargs="+", required=True, help="name:hidden:fc1:ffn")
    p.add_argument("--ms", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--sms", type=int, help="programs per rank (default: the GPU's SMs / tp)")
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--queue-ahead-ms", type=float, default=20.0,
                   help="a sleep before each trial's launches, longer than issuing them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)

    from megatron_flux.tools.bench.grid import parse_model_shape
    from megatron_flux.tuning.provider import TableConfigProvider

    dev = torch.device("cuda", torch.cuda.current_device())
    world = args.tp
    total_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sms = args.sms or total_sms // world
    streams = [torch.cuda.Stream() for _ in range(world)]
    rng = random.Random(args.seed)
    rows = []
    for spec in args.model_shapes:
        model = parse_model_shape(spec)
        n, k = model.hidden, model.fc1 // world
        for m in args.ms:
            # the config a rank of the whole GPU runs at the rows that give it these tiles per program
            config_m = world * round(m * total_sms / sms / world)
            cfg = TableConfigProvider()("rs", config_m, n, k, dtype=torch.bfloat16, tp=world, device=dev)
            copy_engine = cfg.rs_copy_engine  # its pushes need the backend's side stream: SM pushes here
            cfg = dataclasses.replace(cfg, rs_copy_engine=False)
            gen = torch.Generator(device="cuda").manual_seed(args.seed)
            a = [torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(world)]
            w = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(world)]
            methods = {"paired": (Paired(a, w, cfg, sms), world), "apart": (Apart(a, w, cfg, sms, world), world),
                       "alone": (Apart(a, w, cfg, sms, 1), 1)}
            ref = methods["paired"][0].ranks.reference()
            errors = {}
            for name, (method, ranks) in methods.items():  # load every binary, check every output
                method.load()
                time_method(method, ranks, streams, 2)
                errors[name] = method.error(ref)
                if not errors[name] < 2e-2:
                    raise RuntimeError(f"{model.name} m={m} {name}: rel err {errors[name]}")
            samples = {name: [] for name in methods}
            order = list(methods)
            for _ in range(args.trials):
                rng.shuffle(order)
                for name in order:
                    method, ranks = methods[name]
                    samples[name].append(time_method(method, ranks, streams, args.iters,
                                                     args.queue_ahead_ms))
            med = {name: statistics.median(v) for name, v in samples.items()}
            ratio = statistics.median(p / q for p, q in zip(samples["paired"], samples["apart"]))
            rows.append({"model": model.name, "m": m, "config_m": config_m, "n": n, "k": k, "sms": sms,
                         "config": str(cfg), "copy_engine_replaced": copy_engine,
                         "rel_err": errors, "ms": med, "samples": samples,
                         "paired_over_apart": round(ratio, 4),
                         "apart_over_alone": round(med["apart"] / med["alone"], 4)})
            print(f"{model.name} m={m} (n={n}, k={k}, {sms} programs a rank): " +
                  ", ".join(f"{name} {v:.4f} ms" for name, v in med.items()) +
                  f"; paired/apart {ratio:.3f}, apart/alone {med['apart'] / med['alone']:.3f}", flush=True)
    write_record(args.json, rows, what="GEMM+RS of simulated ranks on one GPU: real signals vs "
                 "wired apart vs one rank alone", tp=world)
    return rows


if __name__ == "__main__":
    main()
