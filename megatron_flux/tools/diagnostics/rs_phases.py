"""Where GEMM+RS loses to cuBLAS with communication disabled: its two phases timed apart.

``python -m megatron_flux.tools.diagnostics.rs_phases [--tp 2] [--json PATH]`` on one GPU.

The GEMM+RS kernel computes the peers' row segments first (producer: tiles pushed into the
owner's slot) and then its own segment (consumer: tiles plus the reduction of the peers'
partials). Wired to one GPU as in :mod:`.kernel_vs_cublas` (signals pre-set, "remote" slots
local), this times, per grid shape and for the config the backend runs (shipped table, else
default):

* ``full``: both phases, the production launch;
* ``produce``: the producer phase alone (``(tp-1)/tp`` of the tiles, push epilogue);
* ``consume``: the consumer phase alone (``1/tp`` of the tiles, reduction epilogue), and the
  same with the other ``flatten_consume`` setting;
* ``single``: the same kernel at ``world = 1`` on one segment's rows, a plain persistent GEMM
  (``consume - single`` is what the reduction's reads cost, ``single - cublas_seg`` the tile);
* ``plain``: the whole ``[m, k] @ [k, n]`` by the AG+GEMM kernel, signals pre-set, no stream-K:
  this codebase's persistent GEMM with no ReduceScatter (compare with ``full``);
* ``triton_plain``: :mod:`.plain_gemm`, a plain persistent TMA GEMM over the whole output
  (no segments, grouped over all rows) with the same config: the yardstick for the tile loop;
  ``triton_plain_hostdesc`` the same with host-encoded TMA descriptors;
* ``cublas``: ``torch.matmul`` of the whole ``[m, k] @ [k, n]``; ``cublas_seg``: of one
  ``m / tp``-row segment (what one phase's tiles amount to at TP=2).

Each phase's ratio to ``cublas_seg`` (scaled by its share of the rows) says which epilogue or
loop structure costs the time; ``full`` against ``produce + consume`` says what the phase
boundary costs. Timing as in :mod:`.kernel_vs_cublas` (interleaved, median of trials).

``--config '{"block_n": 128, "num_warps": 4, ...}'`` overrides fields of that config (e.g. the
tile that a plain Triton GEMM prefers at the shape); repeat it (``'{}'``: the config as is) to
time several configs in one interleaved loop, which is the only fair comparison on this box.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from megatron_flux.tools.diagnostics.kernel_vs_cublas import _ag_runner, _grid, _time, add_grid_args, rel_err, \
    rs_on_one_gpu, write_json


def _runners(m, n, k, tp, cfg, dtype):
    from megatron_flux.tools.diagnostics.plain_gemm import launch_plain_gemm

    m_local = m // tp
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launch, out, data = rs_on_one_gpu(a, w, tp, err)
    flipped = dataclasses.replace(cfg, flatten_consume=not cfg.flatten_consume)
    seg = a[:m_local]
    # the same kernel at world = 1 on one segment's rows: a plain persistent GEMM (own tiles,
    # nothing to reduce), so consume - single = the reduction's reads, single - cublas_seg = the tile
    launch1, out1, _ = rs_on_one_gpu(seg, w, 1, err)
    # the whole [m, k] @ [k, n] by the AG+GEMM kernel with its signals pre-set and no stream-K:
    # the fused codebase's persistent GEMM over the same rows as ``full``, with no RS at all
    plain, _, plain_check, _ = _ag_runner(m, n, k, tp, dataclasses.replace(cfg, stream_k=0), dtype)
    # the yardstick: a plain persistent TMA GEMM over the whole output, no segments, same config
    c_plain = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    fns = {
        "triton_plain": lambda: launch_plain_gemm(a, w, c_plain, cfg, sms),
        "triton_plain_hostdesc": lambda: launch_plain_gemm(a, w, c_plain, cfg, sms, host_descriptors=True),
        "plain": plain,
        "single": lambda: launch1(cfg),
        "full": lambda: launch(cfg),
        "produce": lambda: launch(cfg, consume=False),
        "consume": lambda: launch(cfg, produce=False),
        f"consume_flatten_consume={flipped.flatten_consume}": lambda: launch(flipped, produce=False),
        "cublas": lambda: torch.matmul(a, w.t()),
        "cublas_seg": lambda: torch.matmul(seg, w.t()),
    }
    # correctness of each kernel's production-shaped launch
    fns["full"]()
    fns["single"]()
    plain()
    fns["triton_plain"]()
    torch.cuda.synchronize()
    ref = a.float() @ w.t().float()
    own = ref[:m_local] + sum(data[src].float() for src in range(1, tp))  # own partial + pushed slots
    errs = {"full": rel_err(out.float(), own), "single": rel_err(out1.float(), ref[:m_local]),
            "plain": rel_err(*plain_check()), "triton_plain": rel_err(c_plain.float(), ref)}
    if not all(e <= 2e-2 for e in errs.values()) or int(err[0]):
        raise RuntimeError(f"GEMM+RS m={m} n={n} k={k}: rel errors {errs}, err flag {int(err[0])}")
    return fns


def run(args) -> dict:
    from megatron_flux.tuning.provider import TableConfigProvider

    rows = []
    for op, model, m, n, k in _grid(args):
        if op != "GEMM+RS":
            continue
        table = TableConfigProvider()("rs", m, n, k, dtype=torch.bfloat16, tp=args.tp,
                                      device=torch.device("cuda", torch.cuda.current_device()))
        cfgs = [dataclasses.replace(table, **json.loads(c)) for c in (args.config or ["{}"])]
        fns = {}
        for i, cfg in enumerate(cfgs):  # every config's methods in one interleaved loop
            fns.update({f"{i}:{name}": fn
                        for name, fn in _runners(m, n, k, args.tp, cfg, torch.bfloat16).items()})
        times = _time(fns, args.trials, args.iters)
        allmed = {name: statistics.median(t) for name, t in times.items()}
        for i, cfg in enumerate(cfgs):
            med = {name.split(":", 1)[1]: v for name, v in allmed.items() if name.startswith(f"{i}:")}
            seg = med["cublas_seg"]
            row = {"op": op, "model": model, "m": m, "n": n, "k": k, "cfg": cfg.to_dict(),
                   "cfg_index": i, "median_ms": med,
                   "trials_ms": {name.split(":", 1)[1]: t for name, t in times.items()
                                 if name.startswith(f"{i}:")},
                   "full_vs_cublas": med["full"] / med["cublas"],
                   "produce_vs_cublas_seg": med["produce"] / ((args.tp - 1) * seg),
                   "consume_vs_cublas_seg": med["consume"] / seg,
                   "single_vs_cublas_seg": med["single"] / seg,
                   "plain_vs_cublas": med["plain"] / med["cublas"],
                   "triton_plain_vs_cublas": med["triton_plain"] / med["cublas"],
                   "triton_plain_hostdesc_vs_cublas": med["triton_plain_hostdesc"] / med["cublas"],
                   "full_vs_phases": med["full"] / (med["produce"] + med["consume"])}
            rows.append(row)
            flipped = [name for name in med if name.startswith("consume_flatten")][0]
            print(f"RS[{i}] {model:11s} M={m:5d} N={n:6d} K={k:6d} cublas {med['cublas']:.4f} "
                  f"full x{row['full_vs_cublas']:.3f}  produce x{row['produce_vs_cublas_seg']:.3f}  "
                  f"consume x{row['consume_vs_cublas_seg']:.3f} ({flipped} x{med[flipped] / seg:.3f})  "
                  f"single x{row['single_vs_cublas_seg']:.3f}  plain x{row['plain_vs_cublas']:.3f}  "
                  f"triton_plain x{row['triton_plain_vs_cublas']:.3f} "
                  f"(host desc x{row['triton_plain_hostdesc_vs_cublas']:.3f})  "
                  f"full/(produce+consume) {row['full_vs_phases']:.3f}", flush=True)
        del fns
        torch.cuda.empty_cache()
    return {"what": "GEMM+RS phases with communication disabled vs cuBLAS (per-rank shapes)",
            "command": " ".join([sys.executable] + sys.argv), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__, "tp": args.tp,
            "rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_args(p)
    p.add_argument("--config", action="append", default=None,
                   help="JSON object of GemmConfig fields that override the backend's config; "
                        "repeat to time several configs in one interleaved loop (none: as is)")
    args = p.parse_args(argv)
    args.ops = ["GEMM+RS"]
    return write_json(run(args), args.json)


if __name__ == "__main__":
    main()
