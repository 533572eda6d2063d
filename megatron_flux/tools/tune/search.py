"""``megatron-flux tune``: search the fused kernels' settings per op and m-bucket on this machine.

Run under torchrun, one process per GPU of the TP group::

    torchrun --nproc-per-node 2 -m megatron_flux.tools.tune --models llama3-8b --m-set all
    torchrun --nproc-per-node 2 --no-python megatron-flux tune --shapes ag:14336:4096 --ms 4096

For every ``(op, n, k)`` (from ``--models`` / ``--model-shapes`` / ``--model-config`` like the
benchmark, or ``--shapes OP:N:K`` in the per-rank form the table keys) and every m-bucket:

1. **candidates** (:func:`.candidates.generate_candidates`): ``default_config`` first, then the
   config the shape runs untuned (:func:`untuned_config`, the tables' lookup), then GemmConfig
   variations ordered by how many knobs differ from the default (all one-knob changes, then
   pairs, ...), filtered by validity and a shared-memory budget, at most ``--max-candidates``;
2. **check**: each candidate runs once through ``FluxBackend`` with that fixed config
   (communication on) and its output is compared with the ``nccl`` backend's on fp32 copies;
   a candidate that raises or misses ``--max-rel-err`` on any rank is dropped on all, agreed
   right after it; a timed-out wait on any rank stops every rank there;
3. **screen**: one short interleaved trial of all survivors;
4. **final**: the best ``--top`` plus the default and the untuned config, and ``nccl``, timed in
   ``--trials`` interleaved trials (:func:`megatron_flux.tools.bench.timing.time_interleaved`: max
   over ranks per trial, median over trials). The winner is the fastest median, but the untuned
   config keeps its place unless that median is ``--min-gain`` (1 %) below its own: the fastest
   of several noisy medians is biased low, and a config that won by less has lost in later
   benchmarks.

The table records the winner's config (``"tuned": true``), its ``flux_ms`` and the ``nccl_ms`` of
the same trials, and the kernel version they were measured with, so ``auto`` can take ``nccl``
where even the best fused config loses. Results are merged into ``--out`` (default: the user
cache, ``~/.cache/megatron-flux/tables/<gpu>-sm<sms>-tp<tp>-<dtype>-kv<kernel version>.json``,
which every later run on this machine reads: :mod:`megatron_flux.tuning.registry`); point
``--flux-config`` / ``$MEGATRON_FLUX_CONFIG`` at another ``--out``, or copy it to
``megatron_flux/tuning/tables/`` to ship it. ``--time-budget-s`` stops between entries once the
next one would not fit, keeping what was measured; ``--skip-tuned`` continues such a run.

The comm settings searched for AllGather are the chunk size (``chunk_rows``) and the CUDA
priority of the copy-engine side stream (``comm_priority``).
``--dry-run`` prints the plan (shapes, buckets, candidate counts) without GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from megatron_flux.kernels.version import KERNEL_VERSION
from megatron_flux.tools.tune.candidates import AG_SEEDS, NOT_SEARCHED, RS_SEEDS, SEED_CONFIGS, \
    generate_candidates, search_space_for
from megatron_flux.tuning.keys import OPS, dtype_key, normalize_op
from megatron_flux.tools.model_shapes import file_problem, load_settings, tp_gemms

PROG = "megatron-flux tune"

#: polls a fused kernel's wait makes in a tune before it gives up (2x training's default): each
#: candidate's first call compiles its kernels on every rank, and a rank whose compile runs longer
#: issues its pushes later, while its peers' kernels already wait for them. 2**28 polls did not
#: save the TP 4 tune whose waits timed out: a race in a workspace's growth had stopped the
#: peers, since fixed (docs/design.md, "Known limits")
TUNE_MAX_SPINS = 1 << 26

def m_buckets(ms: Sequence[int], tp: int) -> List[int]:
    """Sorted distinct m-buckets; each must be a positive multiple of ``tp``."""
    out = sorted(set(int(m) for m in ms))
    bad = [m for m in out if m < 1 or m % tp]
    if bad:
        raise ValueError(f"m-buckets {bad} must be positive multiples of tp={tp}")
    return out


def parse_shape(spec: str) -> Tuple[str, int, int]:
    """``ag:14336:4096`` -> ``("ag", 14336, 4096)`` (per-rank n and k, as the table keys them)."""
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(f"shape {spec!r} must look like OP:N:K (OP: ag or rs; per-rank n, k)")
    op = normalize_op(parts[0])
    try:
        n, k = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"shape {spec!r}: N and K must be integers") from None
    if n < 1 or k < 1:
        raise ValueError(f"shape {spec!r}: N and K must be positive")
    return op, n, k


def plan_shapes(args: argparse.Namespace, tp: int) -> List[Tuple[str, int, int, Optional[str]]]:
    """``(op, n, k, model)`` per-rank shapes to tune, deduplicated, in a stable order."""
    from megatron_flux.tools.bench import grid as G

    out: List[Tuple[str, int, int, Optional[str]]] = []
    seen = set()
    custom = [G.parse_model_shape(s) for s in args.model_shapes]
    names = list(args.models or [])
    if not names and not args.shapes and not args.model_config:
        names = [m.name for m in custom] or list(G.MODELS)
    names += [m.name for m in custom if m.name not in names]
    for model in G.select_models(names, custom):
        for op in args.ops:
            case = G.case_for(G.AG_GEMM if op == "ag" else G.GEMM_RS, model, tp, args.rs_k)
            k_loc, n_loc = case.local_shapes(tp)["b"]
            if (op, n_loc, k_loc) not in seen:
                seen.add((op, n_loc, k_loc))
                out.append((op, n_loc, k_loc, model.name))
    for path in args.model_config:  # the model's own TP GEMMs, forward and data gradient
        for g in tp_gemms(path, tp, backward=True):
            if g.op in args.ops and (g.op, g.n, g.k) not in seen:
                seen.add((g.op, g.n, g.k))
                out.append((g.op, g.n, g.k, g.label))
    for spec in args.shapes:
        op, n, k = parse_shape(spec)
        if (op, n, k) not in seen:
            seen.add((op, n, k))
            out.append((op, n, k, None))
    return out


def op_arg(value: str) -> str:
    """``--ops``' type: ``ag`` / ``rs`` from any spelling :func:`normalize_op` knows; an
    :class:`argparse.ArgumentTypeError` saying which (argparse's own message would name this
    function)."""
    try:
        return normalize_op(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    from megatron_flux.tools.bench import grid as G

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Search the fused kernels' settings per op and m-bucket on this machine's GPUs "
        "and TP size (run under torchrun); write a tuning table with the nccl time per entry.")
    g = p.add_argument_group("what to tune")
    g.add_argument("--models", nargs="+", default=None, help=f"benchmark models ({', '.join(G.MODELS)})")
    g.add_argument("--model-shapes", nargs="+", default=[], metavar="NAME:H:FC1:FFN")
    g.add_argument("--model-config", nargs="+", default=[], metavar="PATH",
                   help="model config files (configs/*.json, or JSON/YAML with hidden_size, "
                   "ffn_hidden_size, swiglu, num_attention_heads, ...): their QKV, proj, fc1 and fc2 "
                   "GEMMs per rank, forward and data gradient (megatron_flux/tools/model_shapes.py)")
    g.add_argument("--shapes", nargs="+", default=[], metavar="OP:N:K",
                   help="explicit per-rank weight shapes as the table keys them (ag: n=fc1/tp, k=hidden; "
                   "rs: n=hidden, k=fc2_in/tp)")
    g.add_argument("--ops", nargs="+", default=list(OPS), type=op_arg, help="ag and/or rs (AG+GEMM, GEMM+RS)")
    g.add_argument("--ms", "--m", dest="m", nargs="+", type=int, default=None,
                   help="m-buckets (global tokens; spell it --ms after torchrun: torchrun's own "
                   "parser rejects --m as an ambiguous abbreviation of its options). Default: with "
                   "--model-config and no --m-set, the configs' seq-length x micro-batch-size; "
                   "else --m-set's")
    g.add_argument("--m-set", choices=("all", "large", "small"), default=None,
                   help="buckets without --ms: the benchmark grid's m (large), small m, or both "
                   "(all, the default)")
    g.add_argument("--rs-k", choices=G.RS_K_CHOICES, default=G.RS_K_CHOICES[0])
    g.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    s = p.add_argument_group("search")
    s.add_argument("--max-candidates", type=int, default=48, help="configs per (shape, m), default first")
    s.add_argument("--top", type=int, default=4, help="screened configs that go on to the final (plus the default)")
    s.add_argument("--screen-iters", type=int, default=5)
    s.add_argument("--trials", type=int, default=5, help="interleaved final trials (median)")
    s.add_argument("--iters", type=int, default=10)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--sample-warmup", type=int, default=3,
                   help="untimed calls of a candidate right before each timed block (screen and "
                        "final): see megatron_flux.tools.bench.timing")
    s.add_argument("--min-gain", type=float, default=0.01,
                   help="a finalist replaces the untuned config (what the shape runs without this "
                   "tune) only when its median is at least this fraction faster (the fastest of "
                   "several noisy medians is biased low)")
    s.add_argument("--max-rel-err", type=float, default=None, help="default: the benchmark's threshold for the dtype")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout-s", type=float, default=900.0)
    s.add_argument("--stall-timeout-s", type=float, default=600.0, metavar="S",
                   help="end the tune, printing where each rank was, when S seconds pass without "
                   "progress (a candidate checked, an entry timed); 0: never")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="table file (default: the user cache, "
                   "$XDG_CACHE_HOME or ~/.cache, megatron-flux/tables/<gpu>-sm<sms>-tp<tp>-<dtype>-kv<kernel "
                   "version>.json, which megatron-flux reads on this machine without any flag)")
    o.add_argument("--no-merge", action="store_true", help="overwrite --out instead of merging into it")
    o.add_argument("--skip-tuned", action="store_true",
                   help="skip the (op, n, k, m) that --out already holds (continue a run cut short "
                   "by --time-budget-s)")
    o.add_argument("--time-budget-s", type=float, default=None, metavar="S",
                   help="stop before an entry that would end past S seconds from the start (by the "
                   "slowest entry so far); what was measured is written")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--dry-run", action="store_true", help="print the plan and candidate counts; no GPU needed")
    o.add_argument("--tp", type=int, default=None, help="TP size for --dry-run (default: WORLD_SIZE or 2); "
                   "under torchrun it must be the number of processes")
    return p


def resolve_ms(args: argparse.Namespace, tp: int) -> List[int]:
    """The m-buckets to tune: ``--ms``; else, with ``--model-config`` and no ``--m-set``, each
    config's own tokens per micro-batch (as ``megatron-flux bench`` and ``plan`` default to);
    else ``--m-set``'s (default ``all``). ``ValueError`` for one that is not a positive multiple
    of ``tp``."""
    from megatron_flux.tools.bench import grid as G
    from megatron_flux.tools.model_shapes import tokens_per_microbatch

    if args.m:
        return m_buckets(args.m, tp)
    if args.m_set is None and args.model_config:
        ms = {tokens_per_microbatch(path) for path in args.model_config} - {None}
        if ms:
            return m_buckets(ms, tp)
    ms = {"large": G.LARGE_M, "small": G.SMALL_M, "all": G.SMALL_M + G.LARGE_M}[args.m_set or "all"]
    return m_buckets(ms, tp)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("max_candidates", "top", "screen_iters", "trials", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.sample_warmup < 0:
        p.error("--warmup and --sample-warmup must be >= 0")
    if not 0.0 <= args.min_gain < 1.0:
        p.error("--min-gain must be in [0, 1)")
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        p.error("--time-budget-s must be > 0")
    if args.tp is not None and args.tp < 2:
        p.error("--tp must be >= 2")
    try:
        for spec in args.shapes:
            parse_shape(spec)
    except ValueError as exc:
        p.error(str(exc))
    return args


def dry_run(args: argparse.Namespace, out=None) -> int:
    out = sys.stdout if out is None else out
    tp = args.tp or int(os.environ.get("WORLD_SIZE", "2"))
    ms = resolve_ms(args, tp)
    shapes = plan_shapes(args, tp)
    total = 0
    for op, n, k, model in shapes:
        for m in ms:
            c = len(generate_candidates(op, m, n, k, tp, max_candidates=args.max_candidates,
                                        space=getattr(args, "space", None)))
            total += c
            print(f"{op} n={n} k={k} m={m}{'  (' + model + ')' if model else ''}: {c} candidates", file=out)
    print(f"{len(shapes)} shapes x {len(ms)} m-buckets, {total} candidate runs, TP={tp}, {args.dtype}", file=out)
    return 0


class Incumbent(NamedTuple):
    """What a shape runs before it is tuned: ``config`` (what the lookup gives it today) and
    where that came from (``source``: its table entry, a nearby entry's, ``"default"``)."""

    config: object
    source: str


def untuned_config(op: str, m_total: int, n: int, k: int, dtype, tp: int,
                   identity: Tuple[str, int]) -> Incumbent:
    """The config this machine's tables give ``(op, m_total, n, k)`` today
    (:func:`megatron_flux.tuning.provider.kernel_config`: its own entry, else a nearby entry's,
    else ``default_config``). ``identity``: ``(GPU name, SMs)``.

    A tune that only searched around ``default_config`` could write an entry slower than what
    the shape ran untuned: on 2xH200 the GEMM+RS of a model outside the tables ran 1.08-1.29x
    NCCL's speed on nearby entries' configs, an eight-candidate search around the default found
    nothing better than the default, and the benchmark with the tuned table ran 8 of 10 of them
    3.5-11.6 % slower than before the tune (``docs/tuning.md``)."""
    from megatron_flux.tuning import provider

    return Incumbent(*provider.kernel_config(op, m_total, n, k, dtype, tp, identity))


def pick_winner(medians: Dict[str, float], default: str, min_gain: float) -> str:
    """The finalist to ship: the fastest median, unless the median of ``default`` (the
    finalist to beat: the tuner passes the untuned config's) is within ``min_gain`` of it,
    then ``default``.

    The minimum of several noisy medians is biased low (on 2×H200, two GEMM+RS entries whose
    tuned 128x128 configs had won the tune ran 1.10-1.12x cuBLAS in the benchmark, against
    1.02-1.03x for the default), so a challenger must win clearly. Ties break by name."""
    if not medians:
        raise ValueError("no finalist has a time")
    best = min(medians, key=lambda nm: (medians[nm], nm))
    if default in medians and medians[best] > (1.0 - min_gain) * medians[default]:
        return default
    return best


# --------------------------------------------------------------------------- GPU part
def _global_case(op: str, n: int, k: int, m: int, tp: int, model: Optional[str]):
    from megatron_flux.tools.bench import grid as G

    if op == "ag":
        return G.Case(G.AG_GEMM, model or "custom", m, n=n * tp, k=k)
    return G.Case(G.GEMM_RS, model or "custom", m, n=n, k=k * tp)


def tune_one(op, n, k, m, model, args, group, rank, tp, device, dtype, flux, holder, bar,
             incumbent: Optional[Incumbent] = None, progress=lambda: None) -> dict:
    """Check, screen and time the candidates of one (shape, m) on every rank; the entry dict.
    ``incumbent`` (:func:`untuned_config`): what the shape runs untuned, which a finalist
    must beat by ``--min-gain`` to replace it (without one, the default config). ``progress()``
    is called after each candidate's check and each timing phase (the stall watchdog's)."""
    import torch

    from megatron_flux.backends import get_backend
    from megatron_flux.comm.errors import FusedOpTimeout
    from megatron_flux.tools.bench import methods as M
    from megatron_flux.tools.bench.timing import agree_flags, median, time_interleaved

    case = _global_case(op, n, k, m, tp, model)
    inp = M.make_inputs(case, tp, rank, dtype=dtype, device=device, seed=args.seed)
    M.gather_inputs(inp, group)
    ref = M.reference_output(inp, group)
    out = torch.empty(case.local_shapes(tp)["out"], device=device, dtype=dtype)
    threshold = args.max_rel_err if args.max_rel_err is not None else M.default_max_rel_err(dtype)
    cands = generate_candidates(op, m, n, k, tp, max_candidates=args.max_candidates,
                                space=getattr(args, "space", None),
                                from_tables=_from_tables(incumbent))
    flux_call = M._backend_fn(flux, inp, group, out)

    def use(cfg):
        if holder[0] is not cfg:
            holder[0] = cfg
            flux.clear_config_cache()

    def fn_for(cfg):
        def call():
            use(cfg)
            return flux_call()
        return call

    # check every candidate's output against the fp32 nccl reference (same order on all ranks)
    what = f"{op} n={n} k={k} m={m}"
    bad = []
    for i, cfg in enumerate(cands):
        timed_out = False
        try:
            err = M.rel_err(fn_for(cfg)(), ref)
            flux.check_errors(sync=True)  # a wait this call timed out is this candidate's, on this rank
        except Exception as exc:  # compile or launch failure (alike on every rank), a timeout
            print(f"{PROG} (rank {rank}): {what} candidate {i} ({cfg}) failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            err, timed_out = float("inf"), isinstance(exc, FusedOpTimeout)
        # every rank learns now, before anyone's next call: a rank that went on alone could enter
        # a collective (a workspace's growth) that the others never reach
        failed, timed_out = agree_flags([not err <= threshold, timed_out], group, device)
        if timed_out:
            raise RuntimeError(timeout_message(what, f"candidate {i} ({cfg})"))
        bad.append(failed)
        bar.update(1)
        progress()
    ok = [c for c, b in zip(cands, bad) if not b]
    if not ok:
        raise RuntimeError(f"{op} n={n} k={k} m={m}: no candidate passed the output check")
    names = {f"c{i}": c for i, c in enumerate(ok)}
    # the finalist to beat: what the shape runs untuned where it passed the check, else the default
    untuned = next((nm for nm, c in names.items() if incumbent is not None and c == incumbent.config), "c0")
    screen = time_interleaved({nm: fn_for(c) for nm, c in names.items()}, trials=1,
                              iters=args.screen_iters, warmup=1, group=group, device=device,
                              sample_warmup=args.sample_warmup)
    progress()
    ranked = sorted((t[0], nm) for nm, t in screen.trials_ms.items())
    finalists = [nm for _, nm in ranked[:args.top]]
    base = cands[0]
    if base in ok and "c0" not in finalists:
        finalists.append("c0")  # the default always competes
    if untuned not in finalists:
        finalists.append(untuned)  # and what runs untuned: tuned >= untuned by construction
    fns = {nm: fn_for(names[nm]) for nm in finalists}
    fns["nccl"] = M._backend_fn(get_backend("nccl"), inp, group, out)
    final = time_interleaved(fns, trials=args.trials, iters=args.iters, warmup=args.warmup,
                             group=group, device=device, sample_warmup=args.sample_warmup)
    progress()
    agree_no_timeout(flux, group, device, what, "the screen or the final timing")
    meds = {nm: median(t) for nm, t in final.trials_ms.items()}
    flux_meds = {nm: v for nm, v in meds.items() if nm != "nccl"}
    if not flux_meds:
        raise RuntimeError(f"{op} n={n} k={k} m={m}: every finalist failed: {final.errors}")
    best = pick_winner(flux_meds, untuned, args.min_gain)
    entry = {"op": op, "n": n, "k": k, "m": m, "config": names[best].to_dict(), "tuned": True,
             "flux_ms": flux_meds[best], "nccl_ms": meds.get("nccl"),
             "notes": {"model": model, "candidates": len(cands), "passed_check": len(ok),
                       "default_ms": flux_meds.get("c0"), "finalists": len(finalists),
                       "min_gain": args.min_gain, "kept_default": best == "c0",
                       "untuned_ms": flux_meds.get(untuned),
                       "untuned_from": incumbent.source if incumbent is not None else "default",
                       "kept_untuned": best == untuned,
                       "flux_trials_ms": final.trials_ms.get(best), "nccl_trials_ms": final.trials_ms.get("nccl")}}
    del inp, ref, out
    return entry


def tune_options():
    """The process's fused-backend options with waits of at least :data:`TUNE_MAX_SPINS` polls
    (a user's longer bound is kept), allowed several hardware queues: a tune queues nothing that
    waits across ranks beside a candidate (docs/design.md, "Known limits")."""
    from megatron_flux.options import get_options

    opts = get_options()
    return opts.replace(max_spins=max(opts.max_spins, TUNE_MAX_SPINS), allow_several_queues=True)


def timeout_message(what: str, where: str) -> str:
    return (f"{what}: {where} timed out waiting for a peer on some rank (that rank's line above "
            "says which wait); the fused kernels cannot be trusted in this process after a "
            "timeout, so the tune stops here")


def agree_no_timeout(flux, group, device, what: str, where: str) -> None:
    """Every rank checks its fused kernels' error words and all agree; raise on every rank if a
    wait timed out on any."""
    from megatron_flux.comm.errors import FusedOpTimeout
    from megatron_flux.tools.bench.timing import agree_flags

    timed_out = False
    try:
        flux.check_errors(sync=True)
    except FusedOpTimeout as exc:
        print(f"{PROG}: {what}: {exc}", file=sys.stderr, flush=True)
        timed_out = True
    if agree_flags([timed_out], group, device)[0]:
        raise RuntimeError(timeout_message(what, where))


def _from_tables(incumbent: Optional[Incumbent]) -> Tuple:
    return () if incumbent is None else (incumbent.config,)


def previous_table(out: str, merge: bool):
    """``(table, problem)``: the table at ``out`` that a run merges into (None: no file, not
    merging, or measured with other kernels, which is said and then written over), or why it
    cannot be read, as one line naming the file."""
    from megatron_flux.tuning.schema import TuningFileError, load_table

    if not merge or not os.path.exists(out):
        return None, None
    try:
        previous = load_table(out)
    except TuningFileError as exc:
        return None, (f"cannot merge into {exc}; fix or remove the file, or write elsewhere "
                      "(--out) or over it (--no-merge)")
    if previous.kernel_version != KERNEL_VERSION:  # stale times: replace
        print(f"{PROG}: {out} was measured with kernel version {previous.kernel_version} "
              f"(now {KERNEL_VERSION}); writing a new table over it instead of merging")
        return None, None
    return previous, None


def table_object(args: argparse.Namespace, argv: Sequence[str], gpu_name: str, sms: int, tp: int,
                 dtype: str, pinned: Dict[str, str], entries: List[dict], environment: Dict[str, str]) -> dict:
    """A tuning table's JSON object: ``entries`` with the machine, the command (``argv``, the
    tuner's own arguments) and the search that produced them."""
    return {"format": "megatron-flux-tuning", "version": 1, "gpu": {"name": gpu_name, "sms": sms}, "tp": tp,
            "dtype": dtype, "source": table_source(argv), "kernel_version": KERNEL_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "environment": dict(environment),
            "search": {"searched": True, "max_candidates": args.max_candidates, "top": args.top,
                       "trials": args.trials, "iters": args.iters,
                       "sample_warmup": args.sample_warmup, "rs_k": args.rs_k,
                       "space": {k: list(v) for k, v in args.space.items()},
                       "seeds": [dict(s) for s in SEED_CONFIGS],
                       "rs_seeds": [dict(s) for s in RS_SEEDS],
                       "ag_seeds": [dict(s) for s in AG_SEEDS],
                       "not_searched": {**NOT_SEARCHED, **pinned}},
            "entries": entries}


def config_error(args: argparse.Namespace) -> Optional[str]:
    """The first ``--model-config`` that cannot be used, as one line, or ``None``: checked
    before any GPU work so a typo or a malformed file fails at once on every rank."""
    for path in args.model_config:
        problem = file_problem(path)
        if problem is not None:
            return f"--model-config {path}: {problem}"
        try:
            load_settings(path)
        except ValueError as exc:
            return str(exc)
    return None


def table_source(argv: Sequence[str]) -> str:
    """A table's ``source``: the tune command with the options it was given (``argv``: the
    tuner's own arguments, without the ``tune`` of the console script)."""
    return " ".join([PROG, *argv])


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    problem = config_error(args)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    if args.dry_run:
        try:
            return dry_run(args)
        except ValueError as exc:  # a config whose widths do not split over the TP size
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        print("megatron-flux tune: needs NVIDIA GPUs (one process per GPU of the TP group, launched "
              "with torchrun --nproc-per-node <tp>). `--dry-run` shows the plan without GPUs.", file=sys.stderr)
        return 2
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2:
        print("megatron-flux tune: run under torchrun with >= 2 processes (the TP group).", file=sys.stderr)
        return 2
    if args.tp is not None and args.tp != int(os.environ["WORLD_SIZE"]):
        print(f"{PROG}: --tp {args.tp} but torchrun started {os.environ['WORLD_SIZE']} processes "
              f"(one per GPU of the TP group): run with --nproc-per-node {args.tp}", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout_s), device_id=device)
    try:
        return _run(args, argv, dist.group.WORLD, dist.get_rank(), dist.get_world_size(), device)
    except TuneFailed as exc:  # every rank is here together (tune_in_budget), so the teardown does not hang
        if exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__)
        print(f"{PROG} (rank {dist.get_rank()}): {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


def _run(args, argv: Sequence[str], group, rank, tp, device) -> int:
    import torch
    import torch.distributed as dist

    from megatron_flux.backends import available_backends
    from megatron_flux.backends.flux import FluxBackend
    from megatron_flux.tuning.device import device_identity
    from megatron_flux.tools.tune.progress import progress
    from megatron_flux.tuning.registry import cache_table_path
    from megatron_flux.tuning.schema import Table, merge_tables, validate_table, write_table

    if "flux" not in available_backends():
        print("megatron-flux tune: the fused backend is unavailable (triton / symmetric memory)", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    _, sms, gpu_name = device_identity(device)
    try:
        ms = resolve_ms(args, tp)
        shapes = plan_shapes(args, tp)
    except ValueError as exc:  # m-buckets or a config's widths that do not split over this TP size
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    args.space, pinned = search_space_for(torch.cuda.get_device_capability(device))
    holder = [None]
    flux = FluxBackend(config_provider=lambda op, m, n, k: holder[0], options=tune_options())
    out = args.out or cache_table_path(gpu_name, sms, tp, dtype_key(dtype))
    previous, problem = previous_table(out, merge=not args.no_merge) if rank == 0 else (None, None)
    # rank 0 reads the file alone; what it found (or why it cannot) reaches every rank, so a
    # broken file stops all of them here instead of leaving the others in the next collective
    held = [sorted((e.op, e.n, e.k, e.m) for e in previous.entries) if previous is not None else [], problem]
    dist.broadcast_object_list(held, src=dist.get_global_rank(group, 0), group=group)
    if held[1] is not None:
        if rank == 0:
            print(f"{PROG}: {held[1]}", file=sys.stderr)
        return 2
    skip = set(map(tuple, held[0])) if args.skip_tuned else set()
    todo = [(op, n, k, m, model) for op, n, k, model in shapes for m in ms if (op, n, k, m) not in skip]
    try:  # what each shape runs untuned, from the tables as found before this run writes any
        incumbents = {(op, n, k, m, model): untuned_config(op, m, n, k, dtype, tp, (gpu_name, sms))
                      for op, n, k, m, model in todo}
    except ValueError as exc:  # a table named by $MEGATRON_FLUX_CONFIG that does not validate
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    total = sum(len(generate_candidates(op, m, n, k, tp, max_candidates=args.max_candidates, space=args.space,
                                        from_tables=_from_tables(incumbents[(op, n, k, m, model)])))
                for op, n, k, m, model in todo)
    bar = progress(total, "tune ", enabled=(rank == 0 and not args.no_progress), messages=(rank == 0))
    if rank == 0:
        print(f"{PROG}: {len(todo)} entries to tune ({len(shapes) * len(ms) - len(todo)} already in {out}), "
              f"writing {out}" if skip else f"{PROG}: {len(todo)} entries to tune, writing {out}")
    import triton

    def write(entries) -> Table:
        """The table so far (merged into what ``out`` held before this run), written by rank 0
        after every entry, so an interrupted run keeps what it measured."""
        obj = table_object(args, argv, gpu_name, sms, tp, dtype_key(dtype), pinned, entries,
                           {"torch": torch.__version__, "triton": triton.__version__})
        new: Table = validate_table(json.loads(json.dumps(obj)), out)
        if previous is not None:
            new = merge_tables(previous, new)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_table(new, out)
        return new

    from megatron_flux.tools.bench.timing import agree_flags
    from megatron_flux.tools.tune.watchdog import ProgressWatchdog

    written: List[Table] = []

    dog = ProgressWatchdog(args.stall_timeout_s, rank, PROG)

    def tune(item) -> dict:
        op, n, k, m, model = item
        bar.set_postfix_str(f"{op} n={n} k={k} m={m}")
        with dog.watching(f"{op} n={n} k={k} m={m}"):
            e = tune_one(op, n, k, m, model, args, group, rank, tp, device, dtype, flux, holder, bar,
                         incumbent=incumbents[item], progress=dog.progress)
        bar.write(entry_line(e))
        return e

    def keep(entries) -> None:
        if rank == 0:
            written[:] = [write(entries)]

    entries, left = tune_in_budget(todo, tune, keep, args.time_budget_s,
                                   agree=lambda flag: agree_flags([flag], group, device)[0],
                                   describe=lambda item: f"{item[0]} n={item[1]} k={item[2]} m={item[3]}")
    bar.close()
    if rank != 0:
        return 0
    if left:
        print(f"{PROG}: time budget of {args.time_budget_s:g} s reached: {len(entries)} of "
              f"{len(todo)} entries tuned; to tune the other {len(left)}, run the same command "
              "with --skip-tuned")
    n_entries = len(written[0].entries) if written else (len(previous.entries) if previous else 0)
    print(f"wrote {out} ({n_entries} entries)" if written else f"{out}: nothing new to write")
    return 0


def entry_line(e: dict) -> str:
    """One tuned entry in words: its time, the default's, what ran untuned (and from where), NCCL's."""
    notes = e["notes"]

    def ms(v) -> str:
        return f"{v:.4f}" if v is not None else "-"

    return (f"{e['op']} n={e['n']} k={e['k']} m={e['m']}: flux {ms(e['flux_ms'])} ms (default "
            f"{ms(notes.get('default_ms'))}, untuned {ms(notes.get('untuned_ms'))} from "
            f"{notes.get('untuned_from', 'default')}), nccl {ms(e['nccl_ms'])} ms")


class TuneFailed(RuntimeError):
    """An entry failed on some rank; raised on every rank at the same point (:func:`tune_in_budget`)."""


def tune_in_budget(todo: Sequence, tune, keep, budget_s: Optional[float], *, agree=lambda stop: stop,
                   clock=None, describe=str) -> Tuple[List[dict], List]:
    """Tune ``todo`` in order (``tune(item) -> entry``), calling ``keep(entries so far)`` after
    each, until the next item would end past ``budget_s`` seconds from the start (None: no
    budget), judged by the slowest item so far. ``agree(flag) -> bool`` makes every rank take the
    same decision (the OR over ranks): whether to stop for the budget, and whether an entry
    failed. An error in ``tune`` or ``keep`` on any rank raises :class:`TuneFailed` on every rank
    after that entry (the failing rank's error as its cause; ``describe(item)`` names the entry),
    instead of the other ranks waiting in the next entry's collectives for a rank that left.
    Returns ``(entries, items not tuned)``."""
    import time

    clock = time.monotonic if clock is None else clock
    start = clock()
    slowest = 0.0
    entries: List[dict] = []
    for i, item in enumerate(todo):
        if budget_s is not None and agree(clock() - start + slowest > budget_s):
            return entries, list(todo[i:])
        t0 = clock()
        error = None
        try:
            entry = tune(item)
            keep(entries + [entry])
        except Exception as exc:  # reported below, once every rank knows
            error = exc
        if agree(error is not None):
            if error is not None:
                raise TuneFailed(f"{describe(item)}: {type(error).__name__}: {error}") from error
            raise TuneFailed(f"{describe(item)}: failed on another rank (its error is in that rank's output)")
        entries.append(entry)
        slowest = max(slowest, clock() - t0)
    return entries, []


if __name__ == "__main__":
    sys.exit(main())
