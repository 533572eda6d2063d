"""``megatron-flux plan``: what the plugin will run for each TP GEMM of a model, without a GPU.

For a model config (the pretrain scripts' ``configs/*.json``), a TP size and a GPU identity
(the local GPU's by default, or ``--gpu NAME --sms N``), prints per GEMM, forward and data
gradient (:mod:`megatron_flux.tools.model_shapes`):

* the table entry ``auto`` and the fused backend would use (nearest m-bucket), with its measured
  fused and NCCL times, or ``-`` when no table knows the shape;
* ``auto``'s choice and where it came from: the table (with the margin of
  ``$MEGATRON_FLUX_AUTO_MARGIN``), the estimate from the nearest measured entries, or the size
  rule (:func:`megatron_flux.tuning.provider.decide`);
* the fused kernel's settings for that shape and where they came from (the table's, the
  nearest entry's, or the heuristic default), and in the text output the kernel they run in
  a few words (:func:`kernel_summary`: form, tile, and the tail it splits on that shape);
* how many of the GEMMs have a current table entry, and the ``megatron-flux tune`` command for
  the rest (``--offer``: only that, one line, nothing when all have one).

``megatron-flux plan --model-config configs/llama3_8b_16l.json --tp 2 --gpu "NVIDIA H200" --sms 132``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Dict, List, Optional, Sequence

from megatron_flux.tools.model_shapes import file_problem, tokens_per_microbatch, tp_gemms

PROG = "megatron-flux plan"

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def plan_rows(config_path: str, tp: int, m: int, device, dtype) -> List[Dict[str, object]]:
    """One row per TP GEMM of the config (see the module docstring); ``device`` is a CUDA device
    or ``(gpu name, SM count)``."""
    from megatron_flux.tuning.device import device_identity
    from megatron_flux.tuning.provider import decide, kernel_config, lookup_entry

    sms = int(device[1]) if isinstance(device, tuple) else device_identity(device)[1]
    rows = []
    for g in tp_gemms(config_path, tp, backward=True):
        hit = lookup_entry(g.op, m, g.n, g.k, dtype, tp, device)
        d = decide(g.op, m, g.n, g.k, dtype, tp, device)
        config, config_from = kernel_config(g.op, m, g.n, g.k, dtype, tp, device)
        row = {"gemm": g.label, "op": g.op, "m": m, "n": g.n, "k": g.k,
               "auto": "fused" if d.fused else "nccl", "source": d.source, "why": d.why,
               "config": config.to_dict(), "config_from": config_from,
               "kernel": kernel_summary(g.op, config, m, g.n, g.k, tp, sms)}
        if hit is not None:
            entry, table = hit
            row.update(table_m=entry.m, flux_ms=entry.flux_ms, nccl_ms=entry.nccl_ms,
                       table=getattr(table, "path", None) or getattr(table, "source", None),
                       stale=table.stale)
        rows.append(row)
    return rows


def kernel_summary(op: str, cfg, m: int, n: int, k: int, tp: int, sms: int) -> str:
    """The fused kernel ``cfg`` runs for one TP GEMM, in a few words: its form (the Gluon
    warp-specialized ping-pong or cooperative kernel, or the Triton one) and tile, copy-engine
    pushes ("ce push") or merged rows, and the partial last wave it splits on this shape and
    ``sms`` SMs, as the launchers plan it (the warp-specialized GEMM+RS's split tail: tiles x
    parts, run first or last; the Triton kernels' stream-K tail: tiles)."""
    from megatron_flux.kernels import gemm_rs_ws, split_tail
    from megatron_flux.kernels.config import launch_tiles
    from megatron_flux.kernels.gluon_ws import shape_reason
    from megatron_flux.kernels.stream_k import stream_k_plan
    from megatron_flux.tuning.estimate import tile_space

    rs = op == "rs"
    m_local = max(1, m // max(1, tp))
    ws = cfg.rs_warp_specialized if rs else cfg.ag_warp_specialized
    fallback = ""
    if ws:  # the launcher runs the Triton kernel where the shape does not fit the Gluon one
        reason = (gemm_rs_ws.shape_reason if rs else shape_reason)(m_local, k, cfg)
        if reason is not None:
            ws, fallback = False, f" (Gluon form falls back: {reason})"
            cfg = dataclasses.replace(cfg, rs_warp_specialized=False, ag_warp_specialized=False)
    form = ("ping-pong" if cfg.num_warps == 4 else "cooperative") if ws else "triton"
    words = [f"{form} {cfg.block_m}x{cfg.block_n}{fallback}"]
    if rs and cfg.rs_copy_engine:
        words.append("ce push")
    if rs and cfg.rs_merge_rows:
        words.append("merged rows")
    if not rs and cfg.ag_merge_local:
        words.append("merged local rows")
    if rs and ws:
        grid = min(sms, launch_tiles(m_local, n, tp, cfg, cfg.rs_merge_rows))
        tail, parts = split_tail.split_tail_plan(tp, m_local, n, k, cfg, grid)
        if parts > 1:
            order = "first" if split_tail.split_tail_first(tp, m_local, n, cfg, grid) else "last"
            words.append(f"split tail {tail}x{parts} {order}")
    else:
        tiles, per_segment, possible = tile_space(op, cfg, m, n, tp)
        split = stream_k_plan(tiles, sms, 1, per_segment)[1] if possible else 0
        if split:
            words.append(f"stream-K tail {split}")
    return ", ".join(words)


def _format(rows: Sequence[Dict[str, object]]) -> str:
    head = (f"{'gemm':28s} {'op':3s} {'n':>6s} {'k':>6s} {'m':>6s} {'table m':>7s} "
            f"{'flux/nccl':>9s}  {'kernel':49s} {'auto':5s} why")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("flux_ms") and r.get("nccl_ms"):
            ratio = f"{r['flux_ms'] / r['nccl_ms']:.3f}"
        else:
            ratio = "-"
        table_m = str(r.get("table_m", "-")) + ("*" if r.get("stale") else "")
        lines.append(f"{r['gemm']:28s} {r['op']:3s} {r['n']:>6d} {r['k']:>6d} {r['m']:>6d} {table_m:>7s} "
                     f"{ratio:>9s}  {r['kernel']:49s} {r['auto']:5s} {r['why']}")
    if any(r.get("stale") for r in rows):
        lines.append("* a stale table (measured with other kernels): its config runs, its times do not decide")
    return "\n".join(lines)


def tune_offer(rows: Sequence[Dict[str, object]], config_path: str, tp: int, m: int, dtype: str = "bf16"
               ) -> Optional[str]:
    """The one command that tunes the GEMMs whose ``auto`` choice does not come from a current
    table entry (None when every one does): the whole config when none does, else those shapes.
    It writes the user cache, which later runs on this machine read."""
    untuned = [r for r in rows if r["source"] != "table"]
    if not untuned:
        return None
    if len(untuned) == len(rows):
        what = f"--model-config {config_path}"
    else:
        shapes = dict.fromkeys(f"{r['op']}:{r['n']}:{r['k']}" for r in untuned)
        what = "--shapes " + " ".join(shapes)
    extra = f" --dtype {dtype}" if dtype != "bf16" else ""
    return f"torchrun --nproc-per-node {tp} --no-python megatron-flux tune {what} --ms {m}{extra}"


def coverage(rows: Sequence[Dict[str, object]]) -> str:
    tuned = sum(r["source"] == "table" for r in rows)
    return f"{tuned} of {len(rows)} TP GEMMs have a current table entry"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", required=True, metavar="PATH")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--m", type=int, default=None,
                   help="global rows of the TP GEMMs, a positive multiple of --tp (default: seq-length x "
                   "micro-batch-size of the config)")
    p.add_argument("--gpu", default=None, help="GPU name as the tables key it, e.g. 'NVIDIA H200' "
                   "(default: the local GPU)")
    p.add_argument("--sms", type=int, default=None, help="SM count, >= 1 (with --gpu)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--offer", action="store_true",
                   help="print only one line: how many GEMMs have a current table entry and the "
                   "command that tunes the rest (nothing when all do); what the launchers print")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    p = build_parser()
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if (args.gpu is None) != (args.sms is None):
        p.error("--gpu and --sms go together")
    if args.sms is not None and args.sms < 1:
        p.error(f"--sms {args.sms}: must be >= 1")
    if args.m is not None:
        from megatron_flux.tools.tune.search import m_buckets

        try:  # the rule megatron-flux tune applies to the --ms the plan suggests
            m_buckets([args.m], args.tp)
        except ValueError:
            p.error(f"--m {args.m}: must be a positive multiple of --tp {args.tp}")
    if args.gpu is not None:
        device = (args.gpu, args.sms)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        p.error("no CUDA device here: name the GPU with --gpu NAME --sms N (e.g. --gpu 'NVIDIA H200' --sms 132)")
    problem = file_problem(args.model_config)
    if problem is not None:
        print(f"{PROG}: --model-config {args.model_config}: {problem}", file=sys.stderr)
        return 2
    try:
        m = args.m if args.m is not None else tokens_per_microbatch(args.model_config)
        if not m:
            p.error(f"{args.model_config} has no seq-length: give --m")
        rows = plan_rows(args.model_config, args.tp, m, device, getattr(torch, _DTYPES[args.dtype]))
    except ValueError as exc:  # a malformed config or one whose widths do not split over --tp
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    offer = tune_offer(rows, args.model_config, args.tp, m, args.dtype)
    if args.offer:
        if offer is not None:
            print(f"{coverage(rows)} at m={m}; to tune the rest on this machine (later runs "
                  f"read the result; --time-budget-s S caps the time): {offer}")
        return 0
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(_format(rows))
    print(f"\n{coverage(rows)} at m={m}" + (
        "." if offer is None else
        f"; auto estimates the others or applies the size rule. To tune them on this machine "
        f"(the table goes to the user cache, which later runs read; --time-budget-s S caps the "
        f"time):\n  {offer}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
