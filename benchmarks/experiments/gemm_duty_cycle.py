"""Experiment: the fused kernels (communication off) against cuBLAS back to back, where the GPU
sits at its power cap, and with near-idle gaps between launches, as in a training step.

Why: in a profiled training step (2xH200, micro-batch 2, ``docs/performance.md``, "Inside the
step") cuBLAS ran the large TP GEMMs 8-16 % faster than in the op benchmark's back-to-back
loop, with the SM clock at a median of 1.75 GHz of 1.98. The op benchmark and the tuner time
kernels back to back, where the power limiter sets the clock; a kernel that draws less power
there runs at a higher clock, which it does not gain in a step whose other kernels and host
gaps leave the GPU below the cap. If the fused kernels and their configs rank differently in
the two regimes, the tables' choices (made back to back) are not the step's.

Per shape (``--config``'s TP GEMMs at ``--tp``, on the benchmarks' one-GPU wiring of
``kernel_vs_cublas``: peers' partials in local slots, every peer signal pre-set) and method
(``cublas``, ``fused`` with the config the backend runs, ``--variant`` configs), per regime:

* ``loop``: back-to-back launches for about ``--block-ms``;
* ``gap<R>`` per ``--gap-ratios`` R: each launch followed by a sleep kernel (one SM spinning)
  lasting about R times the method's loop time, for about ``--block-ms``.

Each block is preceded by ``--lead-ms`` of the same pattern, untimed (the limiter follows the
last milliseconds of load). Blocks rotate over methods (shuffled per round) and regimes for
``--rounds`` rounds. Per block: the median GPU time per launch (CUDA events around every
launch), and the median SM clock and power of NVML samples taken every ``--sample-ms`` on a
host thread while the block runs (NVML's total-energy counter was tried for energy per launch:
over 300 ms blocks it gave 544-849 W at a 700 W cap, too coarse;
``benchmarks/results/energy-counter-h200-2026-11-29.json``). Per regime, each method's
time over cuBLAS's in the same round, and over its own loop time, medians over rounds.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/gemm_duty_cycle.py \
        --config configs/llama3_8b_16l.json --backward --tp 2 --m 8192 \
        --variant "pp=$(tr -d ' \n' < benchmarks/variants/gluon-pingpong.json)" --json duty.json

NVML is reached through ``libnvidia-ml.so.1`` (ctypes): the device with this CUDA device's
PCI bus id.
"""

import argparse
import ctypes
import dataclasses
import json
import random
import statistics
import threading
import time

import torch

from common import write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import _ag_runner, _rs_runner, \
    _sleep_cycles_per_ms, mean_ms, rel_err


class Nvml:
    """The few NVML calls this needs, on the device whose PCI bus id is ``bus_id`` (else NVML's
    device ``index``)."""

    def __init__(self, bus_id: str, index: int):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2())
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(self.handle)):
            self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)))

    @staticmethod
    def _check(rc):
        if rc != 0:
            raise RuntimeError(f"NVML call failed with code {rc}")

    def sm_clock_mhz(self) -> int:
        v = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(v)))  # NVML_CLOCK_SM
        return v.value

    def power_w(self) -> float:
        v = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(v)))
        return v.value / 1000.0


class Sampler:
    """NVML SM clock and power every ``period_s`` on a host thread, between start() and stop()."""

    def __init__(self, nvml: Nvml, period_s: float):
        self.nvml, self.period_s = nvml, period_s
        self.samples, self._stop, self._thread = [], threading.Event(), None

    def start(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((self.nvml.sm_clock_mhz(), self.nvml.power_w()))
            time.sleep(self.period_s)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.samples


def pci_bus_id(device) -> str:
    """NVML's PCI bus id string of a CUDA device ("" when torch does not report it)."""
    props = torch.cuda.get_device_properties(device)
    try:
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return ""


def problem(op, m, n, k, tp, cfg, dtype=torch.bfloat16):
    """``(fused launch, cublas launch, check, error word)`` of one shape on this GPU alone:
    ``kernel_vs_cublas``'s runners, ``check`` giving the relative error."""
    fused, cublas, outputs, err = (_ag_runner if op == "ag" else _rs_runner)(m, n, k, tp, cfg, dtype)
    return fused, cublas, (lambda: rel_err(*outputs())), err


def run_block(fn, launches, gap_cycles, nvml, sampler, lead_launches):
    """One timed block of ``launches`` calls of ``fn`` (each followed by a sleep of
    ``gap_cycles`` when non-zero) after ``lead_launches`` untimed ones of the same pattern."""
    for _ in range(lead_launches):
        fn()
        if gap_cycles:
            torch.cuda._sleep(gap_cycles)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(launches)]
    torch.cuda.synchronize()
    sampler.start()
    for start, end in events:
        start.record()
        fn()
        end.record()
        if gap_cycles:
            torch.cuda._sleep(gap_cycles)
    torch.cuda.synchronize()
    samples = sampler.stop()
    ms = [s.elapsed_time(e) for s, e in events]
    return {"ms": round(statistics.median(ms), 5), "launches": launches,
            "sm_clock_mhz": statistics.median(c for c, _ in samples) if samples else None,
            "sampled_power_w": round(statistics.median(p for _, p in samples), 1) if samples else None,
            "samples": len(samples)}


def loop_ms(fn, iters=20):
    """``fn``'s back-to-back time per call after three untimed calls (sizes the blocks)."""
    for _ in range(3):
        fn()
    return mean_ms(fn, iters)


def shapes(args):
    if args.shapes:
        for s in args.shapes:
            op, n, k = s.split(":")
            yield f"{op}:{n}:{k}", op, int(n), int(k)
    else:
        from megatron_flux.tools.model_shapes import tp_gemms

        for g in tp_gemms(args.config, args.tp, backward=args.backward):
            if not args.only or g.label.split(":")[-1] in args.only:
                yield g.label, g.op, g.n, g.k


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/llama3_8b_16l.json")
    p.add_argument("--only", nargs="+", help="GEMM names of --config (qkv, proj, fc1, ...)")
    p.add_argument("--backward", action="store_true", help="with --config's data-gradient GEMMs")
    p.add_argument("--shapes", nargs="+", help="op:n:k per rank instead of --config's")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--variant", nargs="+", default=[],
                   help="label=JSON: the backend's config with these GemmConfig fields replaced")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block-ms", type=float, default=300.0)
    p.add_argument("--lead-ms", type=float, default=60.0)
    p.add_argument("--gap-ratios", type=float, nargs="+", default=[1.0],
                   help="one gapped regime per ratio: sleep / the method's loop time")
    p.add_argument("--sample-ms", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)

    from megatron_flux.tuning.provider import TableConfigProvider

    torch.manual_seed(args.seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    nvml = Nvml(pci_bus_id(dev), dev.index)
    sampler = Sampler(nvml, args.sample_ms / 1000.0)
    cycles_per_ms = _sleep_cycles_per_ms()
    variants = [(label, json.loads(fields)) for label, fields in (v.split("=", 1) for v in args.variant)]
    rng = random.Random(args.seed)
    rows = []
    for label, op, n, k in shapes(args):
        table = TableConfigProvider()(op, args.m, n, k, dtype=torch.bfloat16, tp=args.tp, device=dev)
        fns, checks, configs = {}, {}, {}
        fused, cublas, check, err = problem(op, args.m, n, k, args.tp, table)
        fns["cublas"], fns["fused"], checks["fused"], configs["fused"] = cublas, fused, (check, err), table
        for vlabel, fields in variants:
            cfg = dataclasses.replace(table, **fields)
            vfused, _, vcheck, verr = problem(op, args.m, n, k, args.tp, cfg)
            fns[vlabel], checks[vlabel], configs[vlabel] = vfused, (vcheck, verr), cfg
        errors = {}
        for name, (chk, e) in checks.items():
            fns[name]()
            torch.cuda.synchronize()
            errors[name] = chk()
            if e.any() or not errors[name] < 2e-2:
                raise RuntimeError(f"{label} {name}: wrong result (rel err {errors[name]}, error word {e.tolist()})")
        base_ms = {name: loop_ms(fn) for name, fn in fns.items()}
        regimes = {"loop": 0.0, **{f"gap{g:g}": g for g in args.gap_ratios}}
        blocks = {name: {r: [] for r in regimes} for name in fns}
        for _ in range(args.rounds):
            for regime, ratio in regimes.items():
                order = list(fns)
                rng.shuffle(order)
                for name in order:
                    per = base_ms[name] * (1 + ratio)
                    launches = max(5, int(args.block_ms / per))
                    lead = max(2, int(args.lead_ms / per))
                    gap = int(ratio * base_ms[name] * cycles_per_ms)
                    blocks[name][regime].append(run_block(fns[name], launches, gap, nvml, sampler, lead))
        summary = {}
        for name in fns:
            summary[name] = {regime: {key: statistics.median(b[key] for b in bl)
                                      for key in ("ms", "sm_clock_mhz", "sampled_power_w")}
                             for regime, bl in blocks[name].items()}
            # per regime, the median over rounds of this method's time / cuBLAS's in that round,
            # and of its time in the regime / in the loop of the same round
            summary[name]["vs_cublas"] = {regime: round(statistics.median(
                f["ms"] / c["ms"] for f, c in zip(bl, blocks["cublas"][regime])), 4)
                for regime, bl in blocks[name].items()}
            summary[name]["vs_loop"] = {regime: round(statistics.median(
                g["ms"] / lp["ms"] for g, lp in zip(bl, blocks[name]["loop"])), 4)
                for regime, bl in blocks[name].items() if regime != "loop"}
        row = {"gemm": label, "op": op, "m": args.m, "n": n, "k": k,
               "configs": {name: dataclasses.asdict(c) for name, c in configs.items()},
               "rel_err": errors, "summary": summary, "blocks": blocks}
        rows.append(row)
        print(f"{label} m={args.m}", flush=True)
        for name, s in summary.items():
            clocks = {regime: s[regime]["sm_clock_mhz"] for regime in regimes}
            print(f"   {name}: x cuBLAS {s['vs_cublas']}  x loop {s['vs_loop']}  MHz {clocks}  "
                  f"loop {s['loop']['ms']:.4f} ms", flush=True)
    write_record(args.json, rows, what="fused kernels (communication off) vs cuBLAS back to back "
                 "(at the power cap) and with near-idle gaps, SM clock and power", tp=args.tp, m=args.m)
    return rows


if __name__ == "__main__":
    main()
