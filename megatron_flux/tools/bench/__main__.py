"""``megatron-flux bench``: time AG+GEMM and GEMM+RS methods over a grid, FLUX-style.

Launch one process per GPU of the tensor-parallel group, e.g.::

    torchrun --nproc-per-node 2 -m megatron_flux.tools.bench --out-json results/bench.json
    torchrun --nproc-per-node 2 --no-python megatron-flux bench --m-set large --methods nccl flux

Each case (op × model × m) gets fresh random operands; every method is built, run once and
checked against an fp32 reference computed by the ``nccl`` backend, then all methods are timed
together in interleaved trials (:mod:`.timing`). Rank 0 prints a table and writes JSON and PNG
(:mod:`.report`). On CPU (gloo, ``--device cpu``) the same code runs with wall-clock timing so it
can be smoke-tested without GPUs.

Never hang, never stop early: process-group creation and collectives have ``--timeout-s``; a
method that is unavailable or raises on one case is recorded (``status`` ``skipped`` /
``error`` with the reason) and the run goes on, with every rank taking the same decision.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shlex
import sys
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_flux.tools.bench import grid as G
from megatron_flux.tools.bench import methods as M
from megatron_flux.tools.bench import report as R
from megatron_flux.tools.bench.timing import gather_failures, median, short_error, spread, time_interleaved

PROG = "megatron-flux bench"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_METHODS = ("cublas_gemm", "comm", "nccl", "torch_async_tp", "flux")
OP_ALIASES = {"ag+gemm": G.AG_GEMM, "ag": G.AG_GEMM, "gemm+rs": G.GEMM_RS, "rs": G.GEMM_RS}


#: methods whose kernel settings (and, for auto, backend choice) come from the tuning tables
TABLE_METHODS = ("flux", "flux_variant", "flux_control", "auto")


def _validate_user_tables() -> None:
    """Read every user-given table (``$MEGATRON_FLUX_CONFIG``) now: a missing or malformed file
    fails the run before any rank times anything, instead of turning every table method's row
    into an error."""
    from megatron_flux.tuning.registry import user_table_files
    from megatron_flux.tuning.schema import load_table

    for path in user_table_files():
        load_table(path)  # TuningFileError (a ValueError) names the file and field


def _split(values: Optional[Sequence[str]]) -> List[str]:
    """``["a,b", "c"]`` → ``["a", "b", "c"]``: lists may be given space- or comma-separated."""
    return [p for v in values or () for p in v.split(",") if p]


def json_object(text: str) -> dict:
    """``--flux-variant``'s type: a JSON object; an :class:`argparse.ArgumentTypeError` saying
    what is wrong (argparse's own message would name this function)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of GemmConfig fields, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="FLUX-style benchmark of TP communication/GEMM overlap (run under torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("grid")
    g.add_argument("--ops", nargs="+", default=list(G.OPS), help="AG+GEMM and/or GEMM+RS (aliases: ag, rs)")
    g.add_argument("--models", nargs="+", default=None,
                   help=f"model names; default: {', '.join(G.MODELS)} (or only the --model-shapes models if given)")
    g.add_argument("--model-shapes", nargs="+", default=[], metavar="NAME:H:FC1:FFN",
                   help="extra models by shape (fc1 includes the gate of gated MLPs)")
    g.add_argument("--model-config", nargs="+", default=[], metavar="PATH",
                   help="training configs (configs/*.json, as megatron-flux tune takes them): their TP "
                   "GEMMs at this TP size as five models each (QKV, proj, fc1, fc2, the output layer; "
                   "each model's AG+GEMM and GEMM+RS are a linear's forward and data gradient), "
                   "named <config>.<linear>; --ms defaults to the config's seq-length x micro-batch")
    g.add_argument("--ms", "--m", dest="m", nargs="+", default=None,
                   help="token counts; overrides --m-set (spell it --ms after torchrun: torchrun's own "
                        "parser rejects --m as an ambiguous abbreviation of its options)")
    g.add_argument("--m-set", choices=("all", "large", "small"), default="all",
                   help=f"large = {G.LARGE_M}, small = {G.SMALL_M}, all = both")
    g.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help=f"any of {', '.join(M.METHODS)}. cublas_gemm is the local non-split GEMM "
                   "alone (torch.mm): cuBLAS on CUDA; with --device cpu torch's CPU matmul runs "
                   "and the table prints it as local_gemm (the JSON keeps the name cublas_gemm)")
    g.add_argument("--flux-variant", type=json_object, default=None, metavar="JSON",
                   help="GemmConfig fields the flux_variant method changes in the tables' configs, "
                        "e.g. '{\"rs_copy_engine\": true}' (required by that method)")
    g.add_argument("--rs-k", choices=G.RS_K_CHOICES, default=G.RS_K_CHOICES[0],
                   help="GEMM+RS contraction width: fc1 = fc1 width (as the 2xH200 anchors measured; 2x ffn for "
                        "SwiGLU models), ffn = Megatron's true fc2 input width")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    g.add_argument("--b-layout", choices=M.B_LAYOUTS, default="weight_t",
                   help="weight_t: B = weight.t() of a row-major [n, k] weight (Megatron's forward); row_major: contiguous [k, n]")
    g.add_argument("--list-grid", action="store_true",
                   help="print the cases with their per-rank shapes (tp = $WORLD_SIZE or 2) and exit; no GPU needed")
    t = p.add_argument_group("timing")
    t.add_argument("--trials", type=int, default=7, help="interleaved trials per case (median over these)")
    t.add_argument("--iters", type=int, default=20, help="back-to-back calls per timed block")
    t.add_argument("--warmup", type=int, default=5, help="untimed calls per method before the trials")
    t.add_argument("--sample-warmup", type=int, default=10,
                   help="untimed calls of a method right before each of its timed blocks (the "
                        "clock of a power-limited GPU follows the last milliseconds of load)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA (NCCL) when available, else CPU (gloo)")
    t.add_argument("--timeout-s", type=float, default=900.0, help="process-group init / collective timeout")
    o = p.add_argument_group("output")
    o.add_argument("--out-json", default="megatron_flux_bench.json")
    o.add_argument("--out-png", default=None, help="default: --out-json with .png; 'none' to skip the plot")
    o.add_argument("--max-rel-err", type=float, default=None,
                   help="flag rows whose error vs the fp32 reference exceeds this (default: 2e-2 bf16, 1e-2 fp16, 5e-3 fp32)")
    o.add_argument("--strict", action="store_true", help="exit 1 if any row errored or failed the numerical check")
    return p


def resolve_args(args: argparse.Namespace, tp: int) -> argparse.Namespace:
    """Validate list options and derive ``ops``/``model_list``/``ms``/``method_list``/``cases``.

    Raises ``ValueError`` with a readable message; runs before the process group exists, so a
    bad command line fails fast and identically on every rank.
    """
    ops = []
    for o in _split(args.ops):
        if o.lower() not in OP_ALIASES:
            raise ValueError(f"unknown op {o!r}; expected AG+GEMM, GEMM+RS (or ag, rs)")
        ops.append(OP_ALIASES[o.lower()])
    custom = [G.parse_model_shape(s) for s in _split(args.model_shapes)]
    configs = _config_models(getattr(args, "model_config", None) or [], tp)
    custom += configs
    names = _split(args.models) or ([c.name for c in custom] if custom else list(G.MODELS))
    models = G.select_models(names, custom)
    if args.m is None and configs:
        from megatron_flux.tools.model_shapes import tokens_per_microbatch

        ms = sorted({tokens_per_microbatch(path) for path in args.model_config} - {None})
        if ms:
            args.m = [str(m) for m in ms]
    if args.m is not None:
        try:
            ms = [int(v) for v in _split(args.m)]
        except ValueError:
            raise ValueError(f"--ms takes integers, got {args.m}") from None
        if not ms or min(ms) < 1:
            raise ValueError("--ms values must be positive")
    else:
        ms = {"all": list(G.LARGE_M) + list(G.SMALL_M), "large": list(G.LARGE_M), "small": list(G.SMALL_M)}[args.m_set]
        ms = sorted(ms)
    methods = _split(args.methods)
    unknown = [m for m in methods if m not in M.METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; expected any of {M.METHODS}")
    if "flux_variant" in methods:
        if not isinstance(args.flux_variant, dict) or not args.flux_variant:
            raise ValueError("method flux_variant needs --flux-variant '{\"field\": value, ...}'")
        M.set_flux_variant(args.flux_variant)
    elif args.flux_variant is not None:
        raise ValueError("--flux-variant is only used by method flux_variant")
    if any(m in methods for m in TABLE_METHODS):
        _validate_user_tables()
    if args.trials < 1 or args.iters < 1 or args.warmup < 0 or args.sample_warmup < 0:
        raise ValueError("--trials and --iters must be >= 1, --warmup and --sample-warmup >= 0")
    args.op_list = list(dict.fromkeys(ops))
    args.model_list = models
    args.ms = list(dict.fromkeys(ms))
    args.method_list = [m for m in M.METHODS if m in methods]  # canonical order
    args.cases = G.build_grid(args.op_list, models, args.ms, tp, args.rs_k)
    args.threshold = args.max_rel_err if args.max_rel_err is not None else M.default_max_rel_err(DTYPES[args.dtype])
    return args


def _config_models(paths: Sequence[str], tp: int) -> List[G.ModelShape]:
    """``--model-config``'s models (:func:`megatron_flux.tools.model_shapes.bench_widths`);
    ``ValueError`` naming the file for one that cannot be read or split over ``tp``."""
    from megatron_flux.tools.model_shapes import bench_widths, file_problem

    out = []
    for path in paths:
        problem = file_problem(path)
        if problem is not None:
            raise ValueError(f"--model-config {path}: {problem}")
        for name, hidden, width in bench_widths(path, tp):
            out.append(G.ModelShape(name, hidden=hidden, fc1=width, ffn=width))
    return out


def describe_command(argv: Sequence[str]) -> str:
    """The command line that started this run, launcher included when it can be told.

    torchrun is recognised by the variables it sets (``TORCHELASTIC_RUN_ID``,
    ``LOCAL_WORLD_SIZE``); the program part comes from ``sys.argv[0]``.
    """
    a0 = sys.argv[0] if sys.argv else ""
    if a0.replace(os.sep, "/").endswith("megatron_flux/tools/bench/__main__.py"):
        prog, is_python = ["-m", "megatron_flux.tools.bench"], True
    elif os.path.basename(a0) == "megatron-flux":
        prog, is_python = ["megatron-flux", "bench"], False
    elif a0.replace(os.sep, "/").endswith("megatron_flux/tools/cli.py"):  # python -m ...tools.cli bench
        prog, is_python = ["-m", "megatron_flux.tools.cli", "bench"], True
    else:
        prog, is_python = [a0], True
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env:
        lws = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
        ws = int(env.get("WORLD_SIZE", lws))
        launcher = ["torchrun", f"--nproc-per-node={lws}"]
        if ws != lws:
            launcher.append(f"--nnodes={ws // max(lws, 1)}")
        if not is_python:
            launcher.append("--no-python")
        parts = launcher + prog + list(argv)
    else:
        parts = (["python"] if is_python else []) + prog + list(argv)
    return " ".join(shlex.quote(p) for p in parts)


def init_distributed(args: argparse.Namespace):
    """Create the default process group over all launched ranks: one TP group of WORLD_SIZE."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    if not use_cuda and not args.model_shapes and not args.model_config:
        # the default grid is GPU-sized: on CPU it would run for hours and measure nothing useful
        raise SystemExit(
            "megatron-flux bench: no CUDA GPU here. The benchmark needs >= 2 NVIDIA GPUs (NCCL, "
            "P2P); launch it with torchrun --nproc-per-node <gpus>. For a CPU smoke run of the "
            "harness pass --device cpu with a tiny --model-shapes model.")
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size(), device


def _row(case: G.Case, method: str) -> dict:
    return {
        "op": case.op, "model": case.model, "m": case.m, "n": case.n, "k": case.k, "method": method,
        "status": "ok", "reason": None, "median_ms": None, "spread_ms": None, "trials_ms": [],
        "max_rel_err": None, "check": None,
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_case(case: G.Case, args: argparse.Namespace, group, rank: int, tp: int, device: torch.device, say) -> List[dict]:
    """Build, check and time every requested method on one case; one row per method.

    Every step that can fail on one rank only is followed by an agreement
    (:func:`~.timing.gather_failures`) before the next collective, so all ranks drop the same
    methods and the recorded reason names the rank that failed.
    """
    rows: Dict[str, dict] = {name: _row(case, name) for name in args.method_list}
    for name, row in rows.items():
        label = M.method_label(name, device.type)
        if label != name:  # what ran, where the method's name says otherwise (JSON and table)
            row["label"] = label

    def drop(name: str, status: str, reason: str) -> None:
        rows[name].update(status=status, reason=reason)

    # 1. operands (local), then the gather that completes them (collective)
    inp, local = None, {}
    try:
        inp = M.make_inputs(case, tp, rank, dtype=DTYPES[args.dtype], device=device, seed=args.seed, b_layout=args.b_layout)
    except Exception as exc:
        local["inputs"] = short_error(exc)
    failed = gather_failures(local, group)
    if failed:
        for name in rows:
            drop(name, "error", f"input setup failed: {failed['inputs']}")
        del inp
        _free(device)
        return list(rows.values())
    M.gather_inputs(inp, group)

    # 2. fp32 reference through the nccl backend (collective)
    ref, local = None, {}
    try:
        ref = M.reference_output(inp, group)
    except Exception as exc:
        local["ref"] = short_error(exc)
    ref_err = gather_failures(local, group).get("ref")
    if ref_err is not None:
        ref = None
        say(f"  reference failed, outputs not checked: {ref_err}")

    # 3. build (local work); an error on any rank beats a skip
    fns, skips, errors = {}, {}, {}
    for name in args.method_list:
        try:
            fn, notes = M.build_method(name, inp, group)
            fns[name] = fn
            rows[name].update(notes)
        except M.MethodSkipped as exc:
            skips[name] = str(exc)
        except Exception as exc:
            errors[name] = "build: " + short_error(exc)
    skips, errors = gather_failures(skips, group), gather_failures(errors, group)
    for name in args.method_list:
        if name in errors or name in skips:
            fns.pop(name, None)
            drop(name, "error" if name in errors else "skipped", errors.get(name) or skips[name])

    # 4. one probe call per method (also the first warm-up), agreed after each method
    checked = []
    for name in list(fns):
        out, local = None, {}
        try:
            out = fns[name]()
        except Exception as exc:
            local[name] = short_error(exc)
        failed = gather_failures(local, group)
        if failed:
            drop(name, "error", "first call: " + failed[name])
            del fns[name]
            continue
        if name in M.COMPUTES_OP:
            checked.append((name, M.rel_err(out, ref) if ref is not None else None))
        del out
    if checked:
        vals = torch.tensor([-1.0 if e is None else e for _, e in checked], dtype=torch.float64, device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
        for (name, _), v in zip(checked, vals.tolist()):
            r = rows[name]
            r["max_rel_err_threshold"] = args.threshold
            if ref is None:
                r["check"] = f"not checked: reference failed ({ref_err})"
            elif not math.isfinite(v):
                r["check"] = "FAIL"
                r["check_detail"] = "wrong shape or non-finite output"
            else:
                r["max_rel_err"] = float(v)
                r["check"] = "FAIL" if v > args.threshold else "ok"
            if r["check"] == "FAIL":
                say(f"  WARNING: {name} on {case.op} {case.model} m={case.m}: output differs from the fp32 nccl "
                    f"reference (max_rel_err {r['max_rel_err']}, threshold {args.threshold:g})"
                    + (f": {r['check_detail']}" if "check_detail" in r else ""))
    del ref

    # 5. interleaved timing
    if fns:
        res = time_interleaved(fns, trials=args.trials, iters=args.iters, warmup=args.warmup,
                               group=group, device=device, sample_warmup=args.sample_warmup)
        for name, e in res.errors.items():
            drop(name, "error", "timing: " + e)
        for name, ts in res.trials_ms.items():
            rows[name].update(median_ms=median(ts), spread_ms=spread(ts), trials_ms=[float(t) for t in ts])
    del fns, inp
    _free(device)
    return list(rows.values())


def list_grid(args: argparse.Namespace, tp: int) -> None:
    for c in args.cases:
        shapes = c.local_shapes(tp)
        local = "  ".join(f"{k}={v[0]}x{v[1]}" for k, v in shapes.items())
        print(f"{c.op:8s} {c.model:12s} m={c.m:<5d} n={c.n:<6d} k={c.k:<6d} | tp={tp}: {local}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    tp = int(os.environ.get("WORLD_SIZE", "2"))
    try:
        resolve_args(args, tp)
    except ValueError as exc:
        parser.error(str(exc))
    if args.list_grid:
        list_grid(args, tp)
        return 0
    if not launched:
        print(f"{PROG}: run me under torchrun, one process per GPU of the TP group, e.g.\n"
              f"  torchrun --nproc-per-node 2 --no-python {PROG}", file=sys.stderr)
        return 2

    group, rank, tp, device = init_distributed(args)
    # the benchmark queues nothing that waits across ranks beside a fused kernel, so the fused
    # ops may run with several hardware queues too (docs/design.md, "Known limits")
    from megatron_flux.options import get_options, set_options

    set_options(get_options().replace(allow_several_queues=True))
    try:
        return _run(args, argv, group, rank, tp, device)
    finally:
        dist.destroy_process_group()


def _run(args, argv, group, rank, tp, device) -> int:
    def say(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    env = R.collect_env(device, group)
    command = describe_command(argv)
    say(f"{PROG}: {len(args.cases)} cases x {len(args.method_list)} methods, tp={tp}, "
        f"{args.dtype}, {args.trials} trials x {args.iters} iters on {device.type}")
    rows: List[dict] = []
    for i, case in enumerate(args.cases, 1):
        say(f"[{i}/{len(args.cases)}] {case.op} {case.model} m={case.m} n={case.n} k={case.k}")
        case_rows = run_case(case, args, group, rank, tp, device, say)
        say("  " + "  ".join(
            f"{r.get('label', r['method'])}={r['median_ms']:.4f}ms" if r["status"] == "ok"
            else f"{r.get('label', r['method'])}={r['status']}"
            for r in case_rows))
        rows.extend(case_rows)
    if rank != 0:
        return 0

    R.add_metrics(rows)
    summary = R.summarize(rows)
    doc = {
        "command": command,
        "argv": list(sys.argv),
        "launcher": {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")},
        "gpu": env["gpus"][0] if env["gpus"] else device.type,
        "tp": tp,
        "torch": env["torch"],
        "triton": env["triton"],
        "dtype": args.dtype,
        "b_layout": args.b_layout,
        "rs_k": args.rs_k,
        "trials": args.trials,
        "iters": args.iters,
        "warmup": args.warmup,
        "sample_warmup": args.sample_warmup,
        "flux_variant": args.flux_variant,
        "seed": args.seed,
        "max_rel_err_threshold": args.threshold,
        "timing": {
            "clock": "cuda events on the current stream" if device.type == "cuda" else "time.perf_counter",
            "per_trial": "elapsed / iters of one block of back-to-back calls, max over ranks",
            "median_ms": "median over trials",
            "spread_ms": "max - min over trials",
        },
        "check": {
            "max_rel_err": "max over ranks of ||out - ref||_F / ||ref||_F, ref = nccl backend on fp32 copies",
            "threshold": args.threshold,
            "reference_fp32_matmul": M.cuda_fp32_matmul_mode() if device.type == "cuda" else "cpu fp32",
        },
        "env": env,
        "rows": rows,
        "summary": summary,
    }
    table = R.format_table(rows)
    print(table)
    if summary:
        gemm = M.method_label("cublas_gemm", device.type).split(" ")[0]
        print(f"\nsummary (overlap efficiency = 1 - ECT/ECT_nccl, ECT = T - T_{gemm})")
        print(R.format_summary(summary))
    R.write_json(args.out_json, doc)
    print(f"\nwrote {args.out_json}")
    png = args.out_png if args.out_png is not None else os.path.splitext(args.out_json)[0] + ".png"
    if png.lower() != "none":
        why_not = R.plot_png(png, rows, summary, f"{command}\n{doc['gpu']} x{tp}, {args.dtype}, torch {env['torch']}")
        print(f"wrote {png}" if why_not is None else f"no plot: {why_not}")
    failed = [r for r in rows if r["status"] == "error" or r.get("check") == "FAIL"]
    for r in failed:
        print(f"WARNING: {r['op']} {r['model']} m={r['m']} {r['method']}: "
              + (r["reason"] if r["status"] == "error" else f"check FAILED (max_rel_err {r['max_rel_err']})"),
              file=sys.stderr)
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
    from megatron_flux.tools.cli import quiet_on_broken_pipe

    sys.exit(quiet_on_broken_pipe(main))
