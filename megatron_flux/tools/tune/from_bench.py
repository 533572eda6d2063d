"""A tuning table from a benchmark JSON (``megatron-flux bench --out-json``): measured times,
untuned configs.

The benchmark runs ``flux`` with the configs the backend chose then, i.e. ``default_config``
(no table was shipped yet), so every entry gets ``"tuned": false`` and the config
``default_config`` returns for that shape; ``flux_ms`` / ``nccl_ms`` are the benchmark's
medians (communication on, max over ranks per trial). Only rows where both ``flux`` and
``nccl`` ran and passed the numerical check are used; nothing is interpolated.

``python -m megatron_flux.tools.tune.from_bench BENCH.json [OUT.json]`` writes the table (default:
``megatron_flux/tuning/tables/<gpu>-sm<sms>-tp<tp>-<dtype>.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_flux.tuning.keys import normalize_gpu_name, normalize_op
from megatron_flux.tuning.schema import Entry, Table, TuningFileError, default_filename, load_table, write_table


def local_nk(op: str, n: int, k: int, tp: int):
    """The benchmark's global (n, k) -> the backend's per-rank (n, k) (see keys)."""
    return (n // tp, k) if op == "ag" else (n, k // tp)


def measured_pairs(bench: Dict[str, Any], methods: Sequence[str] = ("flux", "nccl")
                   ) -> Dict[tuple, Dict[str, dict]]:
    """``{(bench op, model, m, n, k): {method: row}}`` for the cases where every one of
    ``methods`` ran and passed the numerical check (rows as in the benchmark JSON)."""
    rows: Dict[tuple, Dict[str, dict]] = {}
    for r in bench["rows"]:
        if r.get("method") in methods:
            rows.setdefault((r["op"], r.get("model"), r["m"], r["n"], r["k"]), {})[r["method"]] = r
    return {
        key: meth for key, meth in rows.items()
        if all(x is not None and x.get("status") == "ok" and x.get("check") in ("ok", None)
               and x.get("median_ms") is not None
               for x in (meth.get(m) for m in methods))
    }


def local_times(bench: Dict[str, Any], source: str, methods: Sequence[str] = ("flux", "nccl")
                ) -> Dict[tuple, Dict[str, float]]:
    """``{(op, local n, local k, m): {method: median ms}}`` from :func:`measured_pairs`, keyed
    like table entries (per-rank shapes)."""
    if "rows" not in bench or "tp" not in bench:
        raise TuningFileError(source, "rows", "not a megatron-flux benchmark JSON")
    tp = int(bench["tp"])
    out: Dict[tuple, Dict[str, float]] = {}
    for (bop, _model, m, n, k), meth in measured_pairs(bench, methods).items():
        op = normalize_op(bop)
        out[(op, *local_nk(op, n, k, tp), int(m))] = {
            name: float(row["median_ms"]) for name, row in meth.items()}
    return out


def times_by_shape(table: Table, runs: Sequence[Tuple[Dict[str, Any], str]],
                   kernel_version: Optional[int] = None) -> Dict[tuple, List[Tuple[str, Dict[str, float]]]]:
    """``{(op, local n, local k, m): [(source, {method: median ms}), ...]}`` over ``runs``, in
    run order, each run checked to come from ``table``'s machine (:func:`check_same_machine`)."""
    ran: Dict[tuple, List[Tuple[str, Dict[str, float]]]] = {}
    for bench, source in runs:
        check_same_machine(bench, table, source, kernel_version)
        for key, times in local_times(bench, source).items():
            ran.setdefault(key, []).append((source, times))
    return ran


def least_favourable(hits: Sequence[Tuple[str, Dict[str, float]]]) -> Tuple[str, Dict[str, float]]:
    """Of several runs' ``(source, times)`` of one shape, the one least favourable to the fused
    kernel (largest flux/nccl)."""
    return max(hits, key=lambda h: h[1]["flux"] / h[1]["nccl"])


def with_search(table: Table, entries, search: Dict[str, Any], drop: Sequence[str] = (),
                **extra: Any) -> Table:
    """``table`` with ``entries``, its ``search`` record updated by ``search`` (less the keys in
    ``drop``) and its other metadata by ``extra``: how each table tool records what it did."""
    merged = dict(table.extra or {})
    merged.update(extra)
    record = {k: v for k, v in dict(merged.get("search") or {}).items() if k not in drop}
    record.update(search)
    merged["search"] = record
    return dataclasses.replace(table, entries=list(entries), extra=merged)


def bench_gpus(bench: Dict[str, Any]) -> set:
    """The GPU model names a benchmark ran on: every rank's (``env.gpus``), else its ``gpu``."""
    return set((bench.get("env") or {}).get("gpus") or [bench.get("gpu")])


def check_same_machine(bench: Dict[str, Any], table: Table, source: str,
                       kernel_version: Optional[int] = None) -> None:
    """Raise :class:`TuningFileError` unless the benchmark ran where ``table`` applies: the same
    TP, GPU model (normalised name), SM count and kernel version (the table's, or
    ``kernel_version`` when given: a re-timing; where the benchmark recorded them) and dtype. Times from another GPU must never confirm or change a table (the lender
    may serve an H200 request with H100s, and the H100 ranks configs differently), nor times of
    other kernels."""
    if int(bench.get("tp", -1)) != table.tp:
        raise TuningFileError(source, "tp", f"{bench.get('tp')} != the table's {table.tp}")
    gpus = bench_gpus(bench)
    names = {normalize_gpu_name(g) for g in gpus if isinstance(g, str) and g.strip()}
    if names != {table.gpu}:
        raise TuningFileError(source, "gpu", f"{sorted(gpus)} is not the table's GPU "
                                             f"{table.gpu_name!r}")
    sms = (bench.get("env") or {}).get("sms")
    if sms is not None and int(sms) != table.sms:
        raise TuningFileError(source, "env.sms", f"{sms} != the table's {table.sms}")
    kv = (bench.get("env") or {}).get("kernel_version")
    want = table.kernel_version if kernel_version is None else kernel_version
    if kv is not None and int(kv) != want:  # (benchmarks record it since version 1)
        raise TuningFileError(source, "env.kernel_version",
                              f"{kv} != the table's {want}: times of other kernels")
    if bench.get("dtype", table.dtype) != table.dtype:
        raise TuningFileError(source, "dtype", f"{bench.get('dtype')} != the table's {table.dtype}")


def table_from_bench(bench: Dict[str, Any], source: str) -> Table:
    from megatron_flux.kernels.config import default_config

    for fld in ("gpu", "tp", "dtype", "rows", "env"):
        if fld not in bench:
            raise TuningFileError(source, fld, "missing from the benchmark JSON")
    tp = int(bench["tp"])
    env = bench["env"]
    gpus = bench_gpus(bench)
    if len(gpus) != 1:
        raise TuningFileError(source, "env.gpus", f"mixed GPU models {sorted(gpus)}")
    sms = env.get("sms")
    if not isinstance(sms, int):
        raise TuningFileError(source, "env.sms", f"must be the SM count, got {sms!r}")
    entries = []
    for (bop, model, m, n, k), meth in sorted(measured_pairs(bench).items()):
        f, c = meth["flux"], meth["nccl"]
        op = normalize_op(bop)
        ln, lk = local_nk(op, n, k, tp)
        entries.append(Entry(
            op=op, n=ln, k=lk, m=m, config=default_config(op, m, ln, lk, tp=tp), tuned=False,
            flux_ms=float(f["median_ms"]), nccl_ms=float(c["median_ms"]),
            notes={"model": model, "bench_op": bop, "global_n": n, "global_k": k,
                   "flux_spread_ms": f.get("spread_ms"), "nccl_spread_ms": c.get("spread_ms")},
        ))
    extra = {"environment": {k: env.get(k) for k in ("date", "torch", "triton", "nccl", "torch_cuda") if k in env},
             "search": {"searched": False, "b_layout": bench.get("b_layout"), "rs_k": bench.get("rs_k"),
                        "trials": bench.get("trials"), "iters": bench.get("iters"),
                        "note": "configs are default_config (not searched); times are the benchmark's medians"}}
    if "kernel_version" in env:
        extra["kernel_version"] = env["kernel_version"]
    if "date" in env:
        extra["created"] = env["date"]
    return Table(path=source, gpu_name=bench["gpu"], gpu=normalize_gpu_name(bench["gpu"]), sms=sms, tp=tp, dtype=bench["dtype"],
                 source=source, entries=entries, extra=extra)


def read_json(path: str) -> Any:
    """The JSON object in ``path``; :class:`TuningFileError` naming the file when it cannot be
    read or is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise TuningFileError(path, "<file>", exc.strerror or str(exc)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TuningFileError(path, "<file>", f"not valid JSON ({exc})") from None


def usage_or_none(argv: Sequence[str], doc: str, wrong_count: bool) -> Optional[int]:
    """The exit status after printing ``doc`` for ``--help`` (stdout, 0) or a wrong number of
    arguments (stderr, 2); ``None`` to go on."""
    if "-h" in argv or "--help" in argv:
        print(doc)
        return 0
    if wrong_count:
        print(doc, file=sys.stderr)
        return 2
    return None


def user_error(prog: str, exc: Exception) -> int:
    """Print an expected user error (a file that cannot be read or written, a tuning file or
    benchmark that does not fit) as one line on stderr; exit status 2."""
    if isinstance(exc, OSError) and exc.filename is not None:
        exc = f"{exc.filename}: {exc.strerror}"
    print(f"{prog}: {exc}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    status = usage_or_none(argv, __doc__, not 1 <= len(argv) <= 2)
    if status is not None:
        return status
    src = argv[0]
    try:
        bench = read_json(src)
        t = table_from_bench(bench, os.path.relpath(src) if not os.path.isabs(src) else src)
        from megatron_flux.tuning.registry import SHIPPED_DIR

        out = argv[1] if len(argv) > 1 else os.path.join(SHIPPED_DIR, default_filename(t.gpu_name, t.sms, t.tp, t.dtype))
        write_table(t, out)
    except (OSError, TuningFileError) as exc:
        return user_error("python -m megatron_flux.tools.tune.from_bench", exc)
    print(f"wrote {out}: {len(t.entries)} entries, fused slower than nccl in "
          f"{sum(e.flux_ms > e.nccl_ms for e in t.entries)}")
    return 0


def table_benches_out(argv):
    """The command line ``TABLE BENCH_JSON... OUT`` of :func:`run_table_tool`'s tools:
    ``(table path, [(bench JSON, its path)], out path)``; :class:`TuningFileError` naming a
    benchmark that cannot be read."""
    return argv[0], [(read_json(path), path) for path in argv[1:-1]], argv[-1]


def run_table_tool(argv, doc: str, transform, describe, *, prog: str) -> int:
    """``main`` of the tools that turn a table and benchmarks into a table (:mod:`.confirm`,
    :mod:`.adopt`, :mod:`.retime`, :mod:`.extend`, :mod:`.add`, :mod:`.retune`): read ``TABLE
    BENCH_JSON... OUT``, write ``transform(table, runs)`` to ``OUT`` and print
    ``describe(old, new)``. ``--help`` prints ``doc`` (exit 0), too few arguments print it to
    stderr (exit 2); a file that cannot be read or written, or a table or run that does not fit
    (:class:`TuningFileError`, e.g. a benchmark from another machine), is one line on stderr
    naming ``prog`` and the file (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    status = usage_or_none(argv, doc, len(argv) < 3)
    if status is not None:
        return status
    try:
        table_path, runs, out = table_benches_out(argv)
        old = load_table(table_path)
        new = transform(old, runs)
        write_table(new, out)
    except (OSError, TuningFileError) as exc:
        return user_error(prog, exc)
    print(f"wrote {out}: {describe(old, new)}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
