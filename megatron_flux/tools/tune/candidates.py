"""Which configs ``megatron-flux tune`` tries for one shape, in which order.

The search space (``GemmConfig`` knobs and the values tried, and the knobs left out and why), the
multi-knob seeds that go first (the warp-specialized kernels' forms, merged rows at small m), and
:func:`generate_candidates`, which orders the default, the untuned config, the seeds and the
one-knob-then-more variations and filters them by validity and shared memory. No GPU needed:
``megatron-flux tune --dry-run`` and the tests call it on CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_flux.tuning.keys import normalize_op

#: knob -> values searched (GemmConfig fields); chunk_rows only for AG (RS ignores it)
SEARCH_SPACE: Dict[str, Tuple] = {
    "block_m": (64, 128, 256),
    "block_n": (64, 128, 256),
    "block_k": (32, 64, 128),
    "num_stages": (2, 3, 4, 5),
    "num_warps": (4, 8),
    "group_m": (1, 4, 8, 16),
    "chunk_rows": (256, 512, 1024, 2048, 4096),
    "epilogue_split": (1, 2),
    "flatten": (True, False),
    "warp_specialize": (False, True),
    "comm_priority": (-1, 0),
    "rs_tma_push": (True, False),
    "rs_spread_reduce": (False, True),
    "rs_copy_engine": (False, True),
    "stream_k": (0, 1),
}
#: knobs only one op has; the other op keeps its default's value
_OP_KNOBS = {"ag": ("chunk_rows", "comm_priority", "stream_k"),
             "rs": ("rs_tma_push", "rs_spread_reduce", "rs_copy_engine")}
#: order of the single-knob variations within each round (see generate_candidates)
_VARIATION_ORDER = ("stream_k", "chunk_rows", "comm_priority", "rs_copy_engine",
                    "rs_tma_push", "rs_spread_reduce", "num_stages", "block_n", "block_m",
                    "block_k", "warp_specialize", "epilogue_split", "group_m", "num_warps", "flatten")
#: knobs the backend has but the search leaves alone (recorded in the table's search.not_searched)
NOT_SEARCHED: Dict[str, str] = {
    "ag_merge_local": "the default at m <= 512 (gathered first, lead 0), where the per-segment "
                      "default is tried as a seed; at m = 1024-2048 no faster with "
                      "communication on, slower in 7 of 8 paired comm-off cases at TP 2",
    "ag_merge_lead": "only matters with ag_merge_local",
    "rs_merge_rows": "the default at m <= 256, where the per-segment default is tried as a "
                     "seed",
    "rs_warp_specialized": "a kernel, not a knob to vary alone (its tiles and warps come in two "
                           "fixed forms); GEMM+RS gets its ping-pong form as two seeds (SM and "
                           "copy-engine pushes) and its cooperative form as a third (RS_SEEDS), "
                           "and with merged rows up to m = 512 as another (RS_MERGED_SEEDS)",
    "rs_interleave_owners": "an order of merged rows (rs_merge_rows), which the search tries at "
                            "small m only; at short K and large m it is meant for a "
                            "communication-on A/B (--flux-interleave-variants) before any seed",
    "rs_row_turns": "a schedule of the warp-specialized GEMM+RS for short K, where the "
                    "peers-first order asks the link for the whole reduce-scatter in half the "
                    "GEMM; communication off it costs the ping-pong up to 5 % on the training "
                    "config's GEMM+RS (proj the most), and it is meant for a "
                    "communication-on A/B (--flux-interleave-variants) before any seed",
    "ag_warp_specialized": "a kernel, not a knob to vary alone (its tiles and warps come in two "
                           "fixed forms); AG+GEMM gets both forms as seeds (AG_SEEDS)",
    "flatten_consume": "compiles to the same GEMM+RS kernel either way (Triton does not flatten "
                       "the reduction loop); a kernel that did flatten it ran level "
                       "(paired median 1.000 at TP 2, 1.001 at TP 4, communication off)",
}
#: knobs that compile to the same kernel below a compute capability: searching them there
#: times one kernel twice and lets noise pick (knob -> (first capability where it matters, why))
SAME_CODE_BELOW: Dict[str, Tuple[Tuple[int, int], str]] = {
    "warp_specialize": ((10, 0), "compiles to the same PTX either way on Hopper (sm_90a) for "
                                 "every shipped kernel, Triton 3.6 and 3.9 "
                                 "(checked on the CPU with benchmarks/experiments/ptx_fingerprint.py)"),
}


def search_space_for(capability: Optional[Tuple[int, int]]) -> Tuple[Dict[str, Tuple], Dict[str, str]]:
    """``(space, dropped)``: :data:`SEARCH_SPACE` for a GPU of ``capability`` (``None``: all of
    it), with every :data:`SAME_CODE_BELOW` knob pinned to its first value where it changes
    nothing, and ``{knob: why}`` for those pinned."""
    space = dict(SEARCH_SPACE)
    dropped = {}
    for knob, (since, why) in SAME_CODE_BELOW.items():
        if capability is not None and tuple(capability) < since and knob in space:
            space[knob] = space[knob][:1]
            dropped[knob] = f"sm_{capability[0]}{capability[1]}: {why}"
    return space, dropped


#: Multi-knob configurations tried right after the default, before the one-knob variations:
#: the winners of a 44-config sweep of a plain persistent TMA GEMM against cuBLAS on H200
#: (128x256x64/3/8 with or without warp specialization and a split epilogue; 128x128x64/4/4 at
#: M <= 2048), and smaller-M tiles for decode-sized m, where 128-row tiles are mostly padding.
#: Fields not given keep the default's values (chunk_rows, flatten, ...).
SEED_CONFIGS: Tuple[Dict[str, object], ...] = (
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, group_m=8,
         epilogue_split=2, warp_specialize=False),
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, group_m=8,
         epilogue_split=1, warp_specialize=True),
    dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4, group_m=8,
         epilogue_split=1),
    dict(block_m=128, block_n=128, block_k=128, num_stages=3, num_warps=8, group_m=8,
         epilogue_split=1),
    dict(block_m=64, block_n=256, block_k=64, num_stages=4, num_warps=4, group_m=8,
         epilogue_split=1),
    dict(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4, group_m=8,
         epilogue_split=1),
)
#: The warp-specialized Gluon kernels' two forms as the seeds give them: ping-pong (two 4-warp
#: MMA partitions on alternate 128x128 tiles, 5 stages) and cooperative (one 8-warp partition on
#: 128x256 tiles, 3 stages)
PINGPONG_FORM: Dict[str, object] = dict(block_m=128, block_n=128, block_k=64, num_stages=5,
                                        num_warps=4, group_m=8, epilogue_split=1,
                                        warp_specialize=False)
COOPERATIVE_FORM: Dict[str, object] = dict(block_m=128, block_n=256, block_k=64, num_stages=3,
                                           num_warps=8, group_m=8, epilogue_split=1,
                                           warp_specialize=False)


#: GEMM+RS also tries running one tile's epilogue (its pushes to the owner, or the reduction of
#: the peers' partials) beside another tile's MMAs, where a plain persistent program idles its
#: tensor cores: the ping-pong warp-specialized Gluon kernel (``rs_warp_specialized``, 128x128,
#: 5 stages), with SM pushes and with the copy engine delivering. With communication off on one
#: H200 it ran 0.92x the TP 2 table's config on the training step's proj and qkv-dgrad GEMM+RS
#: (k = 2048 / 3072, m = 8192); with communication on at TP 4 (4xH200, A/B against the grid's
#: entries, tuned by a search that tried it only at short K,
#: ``benchmarks/results/ab-rs-pingpong-h200x4-2026-11-28-*.json``) it ran 0.91-0.99x their
#: time on 9 of 12 (k = 7168-14336 per rank, up to 7.8 waves of 128x256 tiles) and 1.03-1.06x
#: on the three from 11.6 waves. Its cooperative form (one 8-warp partition, 128x256, 3
#: stages, SM pushes) ran, communication off on one H200, 0.93-1.00x the TP 2 table's config's
#: time on the training config's four fused GEMM+RS at m = 4096 and 8192 with idle gaps between
#: launches (the SM clock near its 1.98 GHz maximum) and 0.94-1.08x back to back at the power
#: cap, where the tuner measures (``benchmarks/results/duty-cycle-h200-2026-11-29-train-*.json``);
#: with communication on it has not been timed against them. As a rule replacing those configs
#: wholesale it was measured and not taken at TP 4 (``docs/tuning.md``); a tune keeps it only
#: where it times faster.
RS_SEEDS: Tuple[Dict[str, object], ...] = (
    dict(PINGPONG_FORM, rs_warp_specialized=True, rs_copy_engine=False),
    dict(PINGPONG_FORM, rs_warp_specialized=True, rs_copy_engine=True),
    dict(COOPERATIVE_FORM, rs_warp_specialized=True, rs_copy_engine=False),
)


#: AG+GEMM also tries the warp-specialized Gluon kernel (``ag_warp_specialized``) in both its
#: forms. Ping-pong (128x128, 5 stages): with communication off on one H200 it ran 0.95-0.99x
#: the TP 2 table's config on the training step's AG+GEMMs and the grid's m <= 2048 shapes,
#: 1.02-1.06x on the largest. Cooperative (128x256, 3 stages): 0.97-1.005x the table on those
#: largest shapes, where ping-pong loses.
AG_SEEDS: Tuple[Dict[str, object], ...] = (
    dict(PINGPONG_FORM, ag_warp_specialized=True, ag_merge_local=False),
    dict(COOPERATIVE_FORM, ag_warp_specialized=True, ag_merge_local=False),
)


#: GEMM+RS at small m also tries merged rows on the warp-specialized Gluon kernel, ping-pong
#: 128x128x64 with 5 stages (``rs_warp_specialized``): communication off it ran 0.90-0.91x /
#: 0.94-0.95x the default on gpt3-175b m = 128 and llama3-70b m = 256 in two runs on one H200
#: (0.96x / 0.93x on one H100), 0.91-0.92x the TP 2 table's per-segment config on gpt3-175b
#: m = 512, and lost at m = 64 and at small n. It names the merged-rows knobs, so it also
#: applies where the default does not merge (up to :data:`RS_MERGED_SEED_MAX_M`). It comes
#: before the generic seeds, so a short candidate list keeps it.
RS_MERGED_SEEDS: Tuple[Dict[str, object], ...] = (
    dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, epilogue_split=1,
         rs_warp_specialized=True, rs_merge_rows=True, rs_spread_reduce=True,
         rs_tma_push=False, rs_copy_engine=False),)
#: GEMM+RS tries :data:`RS_MERGED_SEEDS` up to this many global rows
RS_MERGED_SEED_MAX_M = 512


def seeds_for(op: str) -> Tuple[Dict[str, object], ...]:
    """The multi-knob seeds tried for ``op``: :data:`SEED_CONFIGS`, plus :data:`AG_SEEDS` for
    AG+GEMM and :data:`RS_SEEDS` for GEMM+RS."""
    op = normalize_op(op)
    if op == "ag":
        return SEED_CONFIGS + AG_SEEDS
    return SEED_CONFIGS + RS_SEEDS


#: Hopper: 227 KiB of shared memory per block
SMEM_BYTES = 227 * 1024


def smem_bytes(cfg, elem_bytes: int = 2) -> int:
    """Shared memory a config needs: the A/B pipeline stages plus one epilogue tile."""
    stages = cfg.num_stages * (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * elem_bytes
    epilogue = cfg.block_m * (cfg.block_n // cfg.epilogue_split) * elem_bytes
    return stages + epilogue


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def generate_candidates(op: str, m_total: int, n: int, k: int, tp: int, *, max_candidates: int = 48,
                        space: Optional[Dict[str, Sequence]] = None, elem_bytes: int = 2,
                        smem_limit: int = SMEM_BYTES,
                        seeds: Optional[Sequence[Dict[str, object]]] = None,
                        from_tables: Sequence = ()) -> List:
    """Configs to try for one shape: the default first, then ``from_tables`` (the config this
    machine's tables give the shape today: :func:`untuned_config`), then at small m, where the default runs
    every rank's rows as one tile space, the per-segment default (``default_config(...,
    gather_small_m=False)``), and for RS the default with the other ReduceScatter delivery
    (copy engine vs SM pushes), then
    the multi-knob seeds (``seeds``; by default :data:`RS_MERGED_SEEDS` for GEMM+RS up to
    :data:`RS_MERGED_SEED_MAX_M` rows, then :func:`seeds_for` the op), then
    variations by distance from the default; the
    single-knob ones breadth-first (one value of each knob, comm knobs first, then the next).

    Distance = number of knobs that differ from ``default_config``; within a distance the order
    is the product order of ``space`` (deterministic, so every rank builds the same list).
    Filters: ``GemmConfig`` validity, shared memory ``<= smem_limit``, ``block_m`` no larger
    than the rows per rank segment rounded up to a power of two (at least 64; every rank's
    rows where the tile space spans segments: merged GEMM+RS rows, AG+GEMM gathered first), ``block_n`` /
    ``block_k`` no larger than ``n`` / ``k`` rounded up, and for AG ``chunk_rows`` below the rows
    of a segment (a chunk that large is one chunk: the default already covers it). RS keeps the
    default ``chunk_rows`` and side-stream priority (it has no chunked copy); AG keeps the
    default's RS knobs. ``flatten`` / ``warp_specialize`` are searched for both ops.
    """
    from megatron_flux.kernels.config import GemmConfig, default_config

    op = normalize_op(op)
    if m_total % tp:
        raise ValueError(f"m={m_total} is not divisible by tp={tp}")
    space = dict(SEARCH_SPACE if space is None else space)
    base = default_config(op, m_total, n, k, tp=tp)
    if seeds is None:
        merged = op == "rs" and (base.rs_merge_rows or m_total <= RS_MERGED_SEED_MAX_M)
        seeds = (RS_MERGED_SEEDS if merged else ()) + seeds_for(op)
    m_local = m_total // tp
    for other, knobs_of_other in _OP_KNOBS.items():  # e.g. RS has no chunked copy, no side stream
        if other != op:
            for knob in knobs_of_other:
                if knob in space:
                    space[knob] = (getattr(base, knob),)
    knobs = [f for f in space if f in {x.name for x in dataclasses.fields(GemmConfig)}]
    unknown = set(space) - set(knobs)
    if unknown:
        raise ValueError(f"search space has knobs GemmConfig does not have: {sorted(unknown)}")
    seen = {base}
    table_cfgs = []
    for cfg in from_tables:  # measured on this machine: they run the shape, no filter but duplicates
        if cfg not in seen:
            seen.add(cfg)
            table_cfgs.append(cfg)

    bm_spans, bm_segment = max(64, _pow2_at_least(m_total)), max(64, _pow2_at_least(m_local))
    bn_max, bk_max = max(64, _pow2_at_least(n)), max(32, _pow2_at_least(k))

    def fits(v) -> bool:
        """``v``: a config's fields by name. A row tile covers at most one segment's rows, or
        every rank's where the tile space spans segments (merged GEMM+RS rows, AG+GEMM
        gathered first)."""
        bm, bn, bk = v["block_m"], v["block_n"], v["block_k"]
        smem = (v["num_stages"] * (bm * bk + bk * bn) + bm * (bn // v["epilogue_split"])) * elem_bytes
        spans = v["rs_merge_rows"] or (v["ag_merge_local"] and v["ag_merge_lead"] == 0)
        return (smem <= smem_limit and bm <= (bm_spans if spans else bm_segment)
                and bn <= bn_max and bk <= bk_max)

    seed_cfgs = []
    if base.ag_merge_local or base.rs_merge_rows:  # small m: also the per-segment default
        twin = default_config(op, m_total, n, k, tp=tp, gather_small_m=False)
        seen.add(twin)
        seed_cfgs.append(twin)
    if (op == "rs" and not base.rs_merge_rows  # (merged rows push from the SMs)
            and len(set(space.get("rs_copy_engine", ()))) > 1):  # SM vs copy-engine pushes
        twin = dataclasses.replace(base, rs_copy_engine=not base.rs_copy_engine)
        seen.add(twin)
        seed_cfgs.append(twin)
    pinned = {f: vals[0] for f, vals in space.items() if len(set(vals)) == 1}
    for seed in seeds:
        try:
            # a knob the space pins keeps its one value (e.g. warp_specialize on Hopper)
            cfg = dataclasses.replace(base, **{f: pinned.get(f, v) for f, v in seed.items()})
        except (ValueError, TypeError):
            continue
        if cfg not in seen and fits(vars(cfg)):
            seen.add(cfg)
            seed_cfgs.append(cfg)
    wanted = max(1, max_candidates) - 1 - len(table_cfgs) - len(seed_cfgs)
    variations = _variations(base, space, knobs, wanted, seen, fits, op, m_local) if wanted > 0 else []
    out = [base] + table_cfgs + seed_cfgs + variations
    return out[:max(1, max_candidates)]


def _variations(base, space: Dict[str, Sequence], knobs: List[str], wanted: int, seen: set,
                fits, op: str, m_local: int) -> List:
    """The configs of ``itertools.product(*(space[f] for f in knobs))`` that differ from
    ``base``, are valid, ``fits`` and are not in ``seen``, in :func:`generate_candidates`'s
    order: by distance (knobs changed) from ``base``; the single-knob ones breadth-first (the
    first value of every knob in :data:`_VARIATION_ORDER`, then the second, ...), the rest in
    product order. Built one distance at a time, stopping at the first distance that brings
    the list to ``wanted``: the order is the same as sorting the whole product (the key starts
    with the distance), without building the tens of thousands of configs no caller gets."""
    cls = type(base)
    base_vals = {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}
    # per knob: the index of its base value (None: every value changes it) and its other
    # values with their indices (a repeated value only at its first index, as the product
    # meets it first); strides turn per-knob indices into the product index
    base_idx, others, strides = [], [], []
    stride = 1
    for f in reversed(knobs):
        strides.append(stride)
        stride *= len(space[f])
    strides.reverse()
    for f in knobs:
        b, alt, met = None, [], []
        for j, v in enumerate(space[f]):
            if base_vals[f] == v:
                b = j if b is None else b
            elif not any(v == u for u in met):
                met.append(v)
                alt.append((j, v))
        base_idx.append(b)
        others.append(alt)
    if stride == 0:  # a knob with no values: the product is empty
        return []
    forced = [x for x in range(len(knobs)) if base_idx[x] is None]
    free = [x for x in range(len(knobs)) if base_idx[x] is not None and others[x]]
    base_offset = sum(base_idx[x] * strides[x] for x in range(len(knobs)) if base_idx[x] is not None)
    out: List = []
    for d in range(max(1, len(forced)), len(forced) + len(free) + 1):
        level = []
        for combo in itertools.combinations(free, d - len(forced)):
            changed = sorted(forced + list(combo))
            offset = base_offset - sum(base_idx[x] * strides[x] for x in combo)
            for choice in itertools.product(*(others[x] for x in changed)):
                changes = {knobs[x]: v for x, (_, v) in zip(changed, choice)}
                vals = {**base_vals, **changes}
                try:
                    ok = fits(vals)
                except (TypeError, ValueError, ZeroDivisionError):
                    ok = None  # not numbers a config takes: the constructor refuses it below
                if ok is False:
                    continue
                if op == "ag" and "chunk_rows" in changes and vals["chunk_rows"] >= m_local:
                    continue
                try:
                    cfg = cls(**vals)
                except (ValueError, TypeError):
                    continue
                if cfg in seen or (ok is None and not fits(vals)):
                    continue  # (seen: the default and the seeds; the product has no repeats)
                i = offset + sum(j * strides[x] for x, (j, _) in zip(changed, choice))
                level.append((i, cfg, changes))
        level.sort(key=lambda t: t[0])
        if d == 1:
            # single-knob variations breadth-first: one value of every knob (comm knobs
            # first), then a second value of every knob, ...; a capped list covers every knob
            per_knob: Dict[str, int] = {}
            keyed = []
            for i, cfg, changes in level:
                (knob,) = changes
                nth = per_knob[knob] = per_knob.get(knob, -1) + 1
                keyed.append(((nth, _VARIATION_ORDER.index(knob) if knob in _VARIATION_ORDER
                               else len(_VARIATION_ORDER), i), cfg))
            keyed.sort(key=lambda t: t[0])
            out += [cfg for _, cfg in keyed]
        else:
            out += [cfg for _, cfg, _ in level]
        if len(out) >= wanted:
            break
    return out
