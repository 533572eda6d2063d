"""Experiment: a fused kernel against an earlier version of itself, communication disabled.

One GPU; per grid shape and config (the shipped table's and the heuristic default), in one
interleaved loop: cuBLAS, the plain yardstick, and the launcher of the module at ``--prev`` (a
copy of an earlier ``kernels/ag_gemm.py`` or ``kernels/gemm_rs.py``) and of the current one,
both wired as rank 0 of ``--tp`` with every signal pre-set (``kernel_vs_cublas``'s wiring;
GEMM+RS pushes into local slots and reduces them). Prints time / cuBLAS.

    git show <commit>:megatron_flux/kernels/ag_gemm.py > /tmp/ag_gemm_prev.py
    python benchmarks/experiments/kernel_ab.py --op ag --prev /tmp/ag_gemm_prev.py
    python benchmarks/experiments/kernel_ab.py --op rs --prev /tmp/gemm_rs_prev.py
    python benchmarks/experiments/kernel_ab.py --op rs --prev /tmp/gemm_rs_prev.py \
        --new-override '{"rs_spread_reduce": true}'   # also the current kernel, config changed
    git show HEAD:megatron_flux/kernels/ag_gemm_ws.py > /tmp/ag_ws_prev.py  # a Gluon kernel
    python benchmarks/experiments/kernel_ab.py --op ag --prev /tmp/ag_ws_prev.py \
        --launcher launch_ag_gemm_ws --forms '{"pp": {"ag_warp_specialized": true, ...}}'
    git show HEAD:megatron_flux/kernels/gemm_rs_ws.py > /tmp/rs_ws_prev.py
    python benchmarks/experiments/kernel_ab.py --op rs --prev /tmp/rs_ws_prev.py \
        --launcher launch_gemm_rs_ws --forms '{"pp": {"rs_warp_specialized": true, ...}}'

(run as scripts, with the repository root on ``PYTHONPATH``: they import ``common`` beside them)
"""

import argparse
import dataclasses
import json

import torch

from common import add_timing_args, load_module, named_configs, problem, time_and_check, \
    without_phases, write_record
from megatron_flux.tools.diagnostics.kernel_vs_cublas import add_model_args, ag_on_one_gpu, model_shapes, rs_on_one_gpu
from megatron_flux.tools.diagnostics.plain_gemm import launch_plain_gemm
from megatron_flux.tuning.provider import TableConfigProvider


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prev", required=True)
    p.add_argument("--op", choices=["ag", "rs"], default="ag")
    p.add_argument("--tp", type=int, default=2)
    add_model_args(p, ["gpt3-175b", "llama3-70b", "llama3-8b"])
    p.add_argument("--m", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--new-override", type=json.loads, default=None,
                   help='GemmConfig fields (JSON) for a third runner, "new+": the current '
                        'kernel with the config changed, e.g. {"rs_spread_reduce": true}')
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PATH",
                   help="one more runner: the launcher of the module at PATH, timed as NAME")
    p.add_argument("--launcher", default=None,
                   help="the launcher's name in --prev / --variant modules (default "
                        "launch_ag_gemm / launch_gemm_rs; launch_ag_gemm_ws for a copy of the "
                        "Gluon AG kernel, whose configs must then select it)")
    p.add_argument("--forms", type=json.loads, default=None,
                   help='{"label": {GemmConfig fields}, ...}: time these configs (each the '
                        "heuristic default with the fields replaced) instead of the table's "
                        "and the default")
    add_timing_args(p)
    args = p.parse_args(argv)
    launcher = args.launcher or ("launch_ag_gemm" if args.op == "ag" else "launch_gemm_rs")
    launchers = {"prev": getattr(load_module(args.prev, "kernel_prev"), launcher),
                 "new": None}  # None: the package's
    for spec in args.variant:
        name, path = spec.split("=", 1)
        launchers[name] = getattr(load_module(path, f"kernel_{name}"), launcher)
    if launcher == "launch_gemm_rs_ws":  # copies of the Gluon GEMM+RS: its own launcher, for
        from megatron_flux.kernels import gemm_rs_ws  # "new" too, without the split phases

        launchers["new"] = gemm_rs_ws.launch_gemm_rs_ws
        launchers = {name: without_phases(fn) for name, fn in launchers.items()}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = TableConfigProvider()
    rows = []
    try:  # a failing shape (a variant's wait timing out) keeps the record of those before it
        _run_shapes(args, launchers, sms, table, rows)
    finally:
        write_record(args.json, rows, tp=args.tp)


def _run_shapes(args, launchers, sms, table, rows):
    """Time every shape and config of ``args``, appending the records to ``rows``."""
    for model, n, k in model_shapes(args, args.op):
        for m in args.m:
            a, w, full = problem(m, n, k)
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            cfgs = named_configs(table, args.op, m, n, k, args.tp)
            if args.forms:
                cfgs = {label: dataclasses.replace(cfgs["default"], **fields)
                        for label, fields in args.forms.items()}
            for label, cfg in cfgs.items():
                plain_out = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
                fns = {"cublas": lambda: torch.matmul(a, w.t()),
                       "plain": lambda cfg=cfg: launch_plain_gemm(a, w, plain_out, cfg, sms)}
                outs = {"plain": (plain_out, lambda: full)}
                for name, launch_fn in launchers.items():
                    fns[name], outs[name] = _wire(args.op, a, w, full, args.tp, cfg, err, launch_fn)
                if args.new_override:
                    fns["new+"], outs["new+"] = _wire(
                        args.op, a, w, full, args.tp,
                        dataclasses.replace(cfg, **args.new_override), err, None)
                title = (f"{args.op.upper()} {model:10s} m={m:5d} {label:7s} "
                         f"ws={int(cfg.warp_specialize)} sk={cfg.stream_k} {cfg.block_m}x{cfg.block_n}")
                shape_rows = time_and_check(fns, outs, args, title,
                                            {"op": args.op, "model": model, "m": m, "n": n,
                                             "k": k, "config_label": label,
                                             "config": cfg.to_dict()})
                rows += shape_rows
                if err.any():  # a wait timed out (op, rank, peer, value seen): these times
                    for row in shape_rows:  # include it, so the record says so, and stops
                        row["error_word"] = err.tolist()
                    raise RuntimeError(f"{title}: error word {err.tolist()}")


def _wire(op, a, w, full, tp, cfg, err, launch_fn):
    """``(fn, (out, ref_fn))``: ``launch_fn``'s AG+GEMM or GEMM+RS of ``a @ w.T`` as rank 0 of
    ``tp`` on this GPU alone (``kernel_vs_cublas``'s wiring)."""
    if op == "ag":
        launch, out = ag_on_one_gpu(a, w, tp, cfg, err, launch_fn)
        return launch, (out, lambda: full)
    launch, out, data = rs_on_one_gpu(a, w, tp, err, launch_fn)
    m_local = a.shape[0] // tp
    # own rows = own partial + the other slots (its pushes to peers land in a scratch region)
    return ((lambda: launch(cfg)),
            (out, lambda: full[:m_local] + sum(data[src].float() for src in range(1, tp))))


if __name__ == "__main__":
    main()
