"""Extend a table with a benchmark's measurements of shapes it does not hold.

``auto`` estimates a shape no table lists from the nearest entries, and how far it can trust
that estimate is measured on the table itself, leaving one shape family out at a time
(:mod:`megatron_flux.tuning.estimate`). A table of three models gives that measurement two
families to learn from; benchmarks of other models add families. This takes a benchmark JSON
made on the table's machine (``megatron-flux bench --model-shapes ...``, methods ``flux`` and
``nccl``) and adds, for every case whose per-rank shape and m-bucket the table lacks, an
**untuned** entry: the config the ``flux`` method ran (the nearest entry's that can run the
shape, :func:`~megatron_flux.tuning.estimate.nearest_config`, its stream-K tail on, as the
runtime picks it; else the default) and the benchmark's median times. Entries the table holds are left as they are; the
notes say where each new one came from (``measured_by``, ``config_from``, every trial).

``python -m megatron_flux.tools.tune.extend [--no-transplant | --waves [--pingpong]] [--no-split-tail] TABLE.json BENCH.json [BENCH2.json ...] OUT.json``
(``--no-transplant``: benchmarks made before the stream-K transplant, which ran the nearest
entry's config as it stands; ``--waves``: benchmarks made with the wave rule,
:func:`~megatron_flux.tuning.estimate.wave_aware_config`, every one of them with ``TABLE`` as
it stands, so each is read against ``TABLE``, not against the entries an earlier one added;
``--pingpong`` with it: made with the ping-pong GEMM+RS rule too,
:func:`~megatron_flux.tuning.estimate.pingpong_rs_config`, as the runtime runs today;
``--no-split-tail``: benchmarks made before the warp-specialized GEMM+RS's split tail, which
ran those configs with ``stream_k=0``, :func:`~megatron_flux.tuning.estimate.transplanted`)
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence

from megatron_flux.kernels.config import default_config
from megatron_flux.tools.tune.from_bench import check_same_machine, local_nk, measured_pairs, run_table_tool, with_search
from megatron_flux.tuning import estimate
from megatron_flux.tuning.keys import normalize_op
from megatron_flux.tuning.schema import Entry, Table


def _points(table: Table, op: str, ratios: bool = False):
    """The table's entries of ``op`` as estimate points (with ``ratios``: their flux/NCCL time
    ratio, which the wave rule's candidates need; without, a note names an entry by its shape
    alone)."""
    return [estimate.Point(e.m, e.n, e.k,
                           e.flux_ms / e.nccl_ms if ratios and e.flux_ms and e.nccl_ms else None,
                           e.config, table.path)
            for e in table.entries if e.op == op]


def extend_table(table: Table, bench: Dict[str, Any], bench_source: str, *,
                 transplant: bool = True, waves: bool = False, pingpong: bool = False,
                 ran_with: Optional[Table] = None, ws_split: bool = True) -> Table:
    """``table`` plus an untuned entry for each case of ``bench`` it lacks (module docstring).
    ``transplant=False``: the benchmark ran the nearest entry's config as it stands (before
    :func:`~megatron_flux.tuning.estimate.transplanted` existed). ``waves``: it ran the wave
    rule's choice (:func:`~megatron_flux.tuning.estimate.wave_aware_config`, the stream-K tail
    transplanted); ``pingpong`` with it: and the ping-pong GEMM+RS rule's
    (:func:`~megatron_flux.tuning.estimate.pingpong_rs_config`). ``ran_with``: the table the
    benchmark ran with, whose entries chose its configs (default ``table``). ``ws_split=False``:
    it ran before the warp-specialized GEMM+RS's split tail (``stream_k=0`` on those configs)."""
    if waves and not transplant:
        raise ValueError("extend_table: the wave rule's configs carry the stream-K transplant "
                         "(waves=True needs transplant=True)")
    if pingpong and not waves:
        raise ValueError("extend_table: the ping-pong rule came after the wave rule "
                         "(pingpong=True needs waves=True)")
    check_same_machine(bench, table, bench_source)
    tp = int(bench["tp"])
    have = {(e.op, e.n, e.k, e.m) for e in table.entries}
    source = table if ran_with is None else ran_with
    points = {op: _points(source, op) for op in ("ag", "rs")}
    # the runtime's candidates: entries of a current table with both times
    use = waves and not source.stale
    candidates = {op: [p for p in _points(source, op, ratios=True) if p.ratio] if use else []
                  for op in ("ag", "rs")}
    added = []
    for (bop, model, m, n, k), meth in sorted(measured_pairs(bench).items(),
                                             key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
        op = normalize_op(bop)
        ln, lk = local_nk(op, n, k, tp)
        if (op, ln, lk, int(m)) in have:
            continue
        if transplant:  # as the runtime picks it (with the wave rule when ``waves``)
            config, where = estimate.unlisted_config(op, points[op], int(m), ln, lk, tp, source.sms,
                                                     candidates=candidates[op], pingpong=pingpong,
                                                     ws_split=ws_split)
        else:  # the nearest entry's config as it stands
            near = estimate.nearest_config(op, points[op], int(m), ln, lk, tp)
            config, where = ((default_config(op, int(m), ln, lk, tp=tp), "default") if near is None
                             else (near.config, f"nearest entry ({near.label()})"))
        gemm = "fc1" if op == "ag" else "fc2"
        notes = {"model": f"{model}:{gemm}", "measured_by": bench_source, "config_from": where,
                 "flux_trials_ms": meth["flux"].get("trials_ms"),
                 "nccl_trials_ms": meth["nccl"].get("trials_ms"), "confirmed": False}
        added.append(Entry(op=op, n=ln, k=lk, m=int(m), config=config, tuned=False,
                           flux_ms=float(meth["flux"]["median_ms"]),
                           nccl_ms=float(meth["nccl"]["median_ms"]), notes=notes))
        have.add((op, ln, lk, int(m)))
    earlier = list(dict((table.extra or {}).get("search") or {}).get("extended_by") or [])
    return with_search(table, list(table.entries) + added, {"extended_by": earlier + [
        {"bench": bench_source, "entries": len(added)}]})


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    transplant = "--no-transplant" not in argv
    waves, pingpong = "--waves" in argv, "--pingpong" in argv
    ws_split = "--no-split-tail" not in argv
    if waves and not transplant:
        print("--waves and --no-transplant exclude each other", file=sys.stderr)
        return 2
    if pingpong and not waves:
        print("--pingpong needs --waves (the runtime's rules came in that order)", file=sys.stderr)
        return 2

    def extend_all(t, runs):
        base = t
        for bench, source in runs:
            t = extend_table(t, bench, source, transplant=transplant, waves=waves,
                             pingpong=pingpong, ran_with=base if waves else None,
                             ws_split=ws_split)
        return t

    flags = ("--no-transplant", "--waves", "--pingpong", "--no-split-tail")
    return run_table_tool([a for a in argv if a not in flags], __doc__, extend_all,
                          lambda old, t: f"{len(t.entries)} entries "
                                         f"({len(t.entries) - len(old.entries)} measured, untuned)",
                          prog="python -m megatron_flux.tools.tune.extend")


if __name__ == "__main__":
    sys.exit(main())
