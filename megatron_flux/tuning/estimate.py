"""Shapes no table lists: the kernel config and ``auto``'s choice from the nearest measured entries.

**Shape space.** The entries of one ``(GPU, SM count, TP, dtype, op)`` are points ``(m, n, k)``
(global rows, per-rank weight shape, as :mod:`.keys` defines them), compared in log2 with

    d = sqrt((M_WEIGHT * dlog2 m)^2 + (dlog2 n)^2 + (dlog2 k)^2),   M_WEIGHT = 2.

Rows weigh twice the weight's sides: in the shipped tables both the fused/NCCL time ratio and
the tuned schedule change more from one m-bucket to the next (2x rows) than between the grid's
models at one bucket (2xH200, AG+GEMM at m = 1024: 0.913-0.952 over the three models; one
model over m = 64-8192: 0.811-2.231). Only entries within :data:`REACH` count (a factor of 2 in
m alone, of 4 in n or k alone): farther, the tables say nothing about the shape.

**Kernel config** (:func:`wave_aware_config`): that of the nearest entry (stale tables
included: their configs run) whose config can run the shape (:func:`config_problem`: the Gluon
warp-specialized kernels need the rows per rank to be a multiple of ``block_m`` and at least
``num_stages`` K steps; no tile larger than the shape, as the tuner's candidates), with its
tail split on where its kernel has one (the Triton kernels' stream-K tail, the warp-specialized
GEMM+RS's split tail: :func:`transplanted`), unless another winning entry's config fills the
SMs' waves of tiles clearly better on the new shape (:func:`wave_work`). None within reach:
``default_config``. At TP 2 and 4 a GEMM+RS shape then runs the ping-pong Gluon kernel with its
split tail where few waves of wide tiles make its overlapped epilogue pay (at TP 2 from 2048
rows with copy-engine pushes; :func:`pingpong_rs_config`); :func:`unlisted_config` applies the
rules in that order. Where that rule gives the config on an H200 at TP 2 (bf16), ``auto`` runs it
fused without an estimate (:data:`PINGPONG_FUSED`).

**Fused or NCCL** (:class:`Estimator`): the predicted ratio for ``m`` rows is the geometric mean
of ``flux_ms / nccl_ms`` of the ``K = 2`` entries nearest to ``(m / ROW_SHIFT, n, k)``
(current tables only, ``ROW_SHIFT = 2``): the fused kernel must have won on the neighbours with
half the rows. The row count from which it wins differs by up to that factor between
neighbouring models in the tables (2xH100 AG+GEMM: llama3-8b from m = 2048, llama3-70b from
1024, gpt3-175b from 512; 4xH200: 4096, 2048, 1024), and a smaller GEMM starts later. Below
:data:`MONOTONE_FROM_M` rows the ratio is not monotone in m (NCCL's latency floor: 4xH200
AG+GEMM llama3-70b 0.92 at m = 128, 1.01 at 256), so there the prediction is the
larger of those at ``m / ROW_SHIFT`` and at ``m``: the neighbours must have won at both. Fused
only where

    predicted * allowance < 1 - margin,

``allowance`` (a factor >= 1) being the error of the same prediction measured on the tables
themselves, leaving out one shape family (one per-rank ``(n, k)``, every m) at a time: the
smallest that turns every such prediction that said fused where the entry measured NCCL faster
(by the margin) into NCCL. From :data:`LARGE_M` rows up the allowance is measured on the
leave-out predictions from those rows up only: the small-m ratios spread widely between
models (4xH200 GEMM+RS at m = 64-512: 0.42-1.03), and their errors would otherwise set the
allowance of every m. Below, all predictions count; m = 1024 is predicted from neighbours at
512, where the kernels run another schedule (every rank's rows as one tile space), so its
errors stay with the small rows'. It needs two families of the op; with
fewer, or nothing within reach, the estimate abstains.

**Size rule** (:func:`size_rule`, where the estimate abstains): fused from
:data:`SIZE_RULE_ROWS_PER_RANK` rows per rank up, by op. ``megatron_flux.tools.auto_eval``
measures the rules on the shipped tables (``docs/tuning.md``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from megatron_flux.kernels.config import default_config, launch_tiles, tiles_per_segment

#: weight of log2 m against log2 n and log2 k in the distance
M_WEIGHT = 2.0
#: entries farther than this (in the distance above) are not neighbours
REACH = 2.0
#: neighbours whose ratios the prediction averages (geometric mean)
K_NEAREST = 2
#: the prediction for m rows comes from the neighbours of m / ROW_SHIFT rows
ROW_SHIFT = 2.0
#: below this many rows (global m) the prediction is also made at m itself and the larger one
#: counts: there the fused/NCCL ratio does not fall with m (module docstring); from it up the
#: allowance comes from those rows only. Held out on four models at TP 4
#: (bench-h200x4-2026-11-28-unseen-rerun.json) the shifted prediction alone chooses fused
#: AG+GEMM at m = 256 for three of them, where it ran 1.27-1.54x NCCL's time; with this, none.
#: 2048 was measured and rejected: TP 4
#: leave-out 0.921x NCCL's time instead of 0.934x, but held out it chose fused GEMM+RS for
#: gemma2-27b at m = 8192, which ran 1.014x NCCL's time
MONOTONE_FROM_M = 1024
#: from this many rows (global m) up, the allowance comes from the leave-out errors at those
#: rows only (module docstring). 1024 was the value before: on the 4xH200 table with the
#: ping-pong GEMM+RS adopted, two m = 1024 predictions from m = 512 neighbours (0.789, where
#: the entries measured 1.00 and 1.06) set GEMM+RS's allowance to 1.241 for every m from 1024,
#: and the estimate took NCCL for every GEMM+RS of five held-out models (m = 1024-8192,
#: ``bench-h200x4-2026-11-28-unseen-b.json``, first run) where the fused kernel ran 0.81x
#: NCCL's time at best; from 2048 the allowance there is 1.0. Held out on the two TP 4 sets as
#: rerun with the current configs: 0.910x and 0.920x NCCL's time, none slower; leave-out on the
#: table 0.897x against 0.929x, the same one false fused at m = 256
#: (``benchmarks/results/auto-rule-eval-2026-11-29.json``)
LARGE_M = 2048
#: Where the estimate abstains (no current table for the machine, nothing within reach), fused
#: from this many rows per rank (``m_total / tp``) up; None: never. Derived from the shipped
#: tables, stale ones included (the only TP 4 data), by
#: :func:`megatron_flux.tools.auto_eval.derive_size_rule`: the smallest rows-per-rank bucket
#: from which, on every table, the fused kernel wins on average by the margin (geometric mean
#: of flux/nccl over the op's entries at and above it <= 0.98) and no entry is slower than NCCL
#: by more than the 8 % the same NCCL op varied between two runs. AG+GEMM: 1024 (from 512,
#: llama3-8b at m = 1024 ran 1.215x NCCL's time on 2xH100 and at m = 2048 1.312x on 4xH200).
#: GEMM+RS: from 512 rows per rank by the tables' own configs (since the 2xH200 entries at
#: m = 1024 adopted the ping-pong with its split tail), but where the estimate abstains the
#: default config runs, not those, and at 512 rows per rank (m = 1024, TP 2) two models outside
#: the grid ran 0.86-0.87x NCCL's speed on 2xH200 with it (2026-11-27): NCCL.
SIZE_RULE_ROWS_PER_RANK: Dict[str, Optional[int]] = {"ag": 1024, "rs": None}


class Point(NamedTuple):
    """One measured entry: its shape, ``flux_ms / nccl_ms`` (None without both times), config
    and the file it came from."""

    m: int
    n: int
    k: int
    ratio: Optional[float]
    config: object
    where: str = ""

    @property
    def family(self) -> Tuple[int, int]:
        return (self.n, self.k)

    def label(self) -> str:
        r = f" {self.ratio:.3f}" if self.ratio is not None else ""
        return f"n={self.n} k={self.k} m={self.m}{r}"


def distance(m: float, n: int, k: int, p: Point) -> float:
    """The distance of ``(m, n, k)`` from ``p`` (module docstring)."""
    return math.sqrt((M_WEIGHT * math.log2(max(m, 1) / p.m)) ** 2 + math.log2(n / p.n) ** 2
                     + math.log2(k / p.k) ** 2)


def nearest(points: Iterable[Point], m: float, n: int, k: int, *, reach: Optional[float] = None
            ) -> List[Tuple[float, Point]]:
    """``(distance, point)`` of every point within ``reach`` (default :data:`REACH`), nearest
    first (ties: smaller ``n``, ``k``, ``m``, so every rank orders them alike)."""
    reach = REACH if reach is None else reach
    out = []
    for p in points:
        d = distance(m, n, k, p)
        if d <= reach + 1e-9:
            out.append((d, p))
    out.sort(key=lambda t: (round(t[0], 9), t[1].n, t[1].k, t[1].m))
    return out


class Estimate(NamedTuple):
    """An estimated choice: ``fused``, the predicted ratio, the allowance (a factor, >= 1) and
    the neighbours it came from."""

    fused: bool
    ratio: float
    allowance: float
    neighbours: Tuple[Point, ...]

    def why(self, limit: float) -> str:
        near = "; ".join(p.label() for p in self.neighbours)
        cmp = "<" if self.fused else ">="
        return (f"estimate from {len(self.neighbours)} nearest ({near}): "
                f"{self.ratio:.3f} x allowance {self.allowance:.3f} {cmp} {limit:.2f}")


class Estimator:
    """The prediction of one ``(GPU, SMs, TP, dtype, op)`` from its current entries with times."""

    def __init__(self, points: Sequence[Point], k_nearest: Optional[int] = None):
        self.points = [p for p in points if p.ratio is not None and p.ratio > 0]
        self.k_nearest = K_NEAREST if k_nearest is None else k_nearest
        self.families = sorted({p.family for p in self.points})
        self._allowance: Dict[Tuple[float, bool], Optional[float]] = {}
        self._leave_out: Optional[List[Tuple[Point, Optional[float]]]] = None  # both allowances read it

    def predict(self, m: int, n: int, k: int, exclude: Optional[Tuple[int, int]] = None
                ) -> Optional[Tuple[float, Tuple[Point, ...]]]:
        """``(predicted ratio, neighbours)`` for ``m`` rows (from the neighbours of
        ``m / ROW_SHIFT``; below :data:`MONOTONE_FROM_M` the larger of that and the prediction
        from the neighbours of ``m``), or None with no entry within reach. ``exclude``: leave
        that family out (the leave-out measurement)."""
        pool = self.points if exclude is None else [p for p in self.points if p.family != exclude]
        shifted = self._from(pool, m / ROW_SHIFT, n, k)
        if shifted is None or m >= MONOTONE_FROM_M:
            return shifted
        same = self._from(pool, m, n, k)
        return shifted if same is None or shifted[0] >= same[0] else same

    def _from(self, pool, m: float, n: int, k: int) -> Optional[Tuple[float, Tuple[Point, ...]]]:
        near = [p for _, p in nearest(pool, m, n, k)[:self.k_nearest]]
        if not near:
            return None
        return math.exp(sum(math.log(p.ratio) for p in near) / len(near)), tuple(near)

    def leave_out(self) -> List[Tuple[Point, Optional[float]]]:
        """Every entry with the ratio predicted from the other families' entries (None: none
        within reach)."""
        out = []
        for p in self.points:
            pred = self.predict(p.m, p.n, p.k, exclude=p.family)
            out.append((p, None if pred is None else pred[0]))
        return out

    def allowance(self, margin: float, large: bool = False) -> Optional[float]:
        """The allowance (a factor >= 1) at ``margin``, for m below :data:`LARGE_M` (from every
        leave-out prediction) or, ``large``, from it up (from those rows' only);
        None with fewer than two families."""
        key = (margin, large)
        if key not in self._allowance:
            self._allowance[key] = self._measure_allowance(margin, large)
        return self._allowance[key]

    def _measure_allowance(self, margin: float, large: bool) -> Optional[float]:
        if len(self.families) < 2:
            return None
        if self._leave_out is None:
            self._leave_out = self.leave_out()
        limit = 1.0 - margin
        worst = 1.0
        for p, pred in self._leave_out:
            if large and p.m < LARGE_M:
                continue
            if pred is not None and pred < limit and p.ratio > limit:  # would be a false fused
                worst = max(worst, limit / pred)
        return worst

    def decide(self, m: int, n: int, k: int, margin: float) -> Optional[Estimate]:
        """The estimated choice for ``(m, n, k)``, or None where the estimate abstains."""
        allow = self.allowance(margin, large=m >= LARGE_M)
        if allow is None:
            return None
        pred = self.predict(m, n, k)
        if pred is None:
            return None
        ratio, near = pred
        return Estimate(ratio * allow < 1.0 - margin, ratio, allow, near)


def size_rule(op: str, m_total: int, tp: int) -> bool:
    """Fused from :data:`SIZE_RULE_ROWS_PER_RANK` rows per rank up (never where it is None)."""
    rows = SIZE_RULE_ROWS_PER_RANK[op]
    return rows is not None and m_total >= rows * max(1, tp)


def size_rule_why(op: str, tp: int) -> str:
    rows = SIZE_RULE_ROWS_PER_RANK[op]
    if rows is None:
        return "size rule: no estimate for this shape, and without one GEMM+RS runs NCCL"
    return f"size rule: no estimate for this shape; fused from {rows} rows per rank (m >= {rows * max(1, tp)})"


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def config_problem(op: str, cfg, m_total: int, n: int, k: int, tp: int) -> Optional[str]:
    """Why ``cfg`` (tuned for another shape) should not run ``op`` on ``(m_total, n, k)`` at TP
    ``tp``: None where it can. The warp-specialized kernels' own limits (they would fall back to
    the Triton kernel), and no tile larger than the shape (the tuner's candidate filter)."""
    m_local = max(1, m_total // max(1, tp))
    ws = cfg.ag_warp_specialized if op == "ag" else cfg.rs_warp_specialized
    spans = (cfg.rs_merge_rows if op == "rs" else (cfg.ag_merge_local and cfg.ag_merge_lead == 0))
    if ws:
        if op == "rs" and cfg.rs_merge_rows and m_local == 1:
            return "1 row per rank"
        rows = None if (op == "rs" and cfg.rs_merge_rows) else m_local
        if rows is not None and rows % cfg.block_m:
            return f"{rows} rows per rank are not a multiple of block_m={cfg.block_m}"
        if -(-k // cfg.block_k) < cfg.num_stages:
            return f"K={k} has fewer than num_stages={cfg.num_stages} steps of block_k={cfg.block_k}"
    rows_max = max(64, _pow2_at_least(m_total if spans else m_local))
    if cfg.block_m > rows_max:
        return f"block_m={cfg.block_m} is taller than the {m_local} rows per rank"
    if cfg.block_n > max(64, _pow2_at_least(n)) or cfg.block_k > max(32, _pow2_at_least(k)):
        return f"a {cfg.block_n}x{cfg.block_k} tile is larger than n={n}, k={k}"
    return None


def nearest_config(op: str, points: Iterable[Point], m_total: int, n: int, k: int, tp: int
                   ) -> Optional[Point]:
    """The nearest point within reach whose config can run the shape, or None."""
    for _, p in nearest(points, m_total, n, k):
        if config_problem(op, p.config, m_total, n, k, tp) is None:
            return p
    return None


#: Another measured config replaces the nearest entry's for a shape no table lists when it
#: leaves each SM at least this share less work (:func:`wave_work`)
WAVE_GAIN = 0.10
#: The smallest tile (block_m x block_n) such a replacement may have, and its fewest rows.
#: Smaller tiles lose more than whole waves: comm off on one H200, GEMM+RS's time over
#: cuBLAS's divided by the wave quantisation was 1.02-1.14 for 64x128 Gluon tiles and
#: 1.44-1.54 for 128x64 ones, against 0.97-1.04 for 128x128 Gluon and 128x256 Triton tiles;
#: 64x256 Triton tiles with a stream-K tail, predicted at 0.79 and 0.87 of the work of the
#: nearest entry's tile, ran 1.19x and 1.04x its time (``kernel-vs-cublas-h200-2026-11-28-waves.json``)
MIN_TILE_AREA = 128 * 128
MIN_TILE_ROWS = 128
#: A split stream-K tail takes this many times its share of a wave (at most one wave): comm
#: off on one H200, TP 2, GEMM+RS with 128x256 tiles at 1.09 and 1.21 waves ran 1.13 and 1.31x
#: cuBLAS's time with the tail split, 1.76 and 1.59x without (same file)
STREAM_K_TAIL_COST = 2.7


def tile_space(op: str, cfg, m_total: int, n: int, tp: int) -> Tuple[int, int, bool]:
    """``(tiles, tiles per segment, stream-K possible)`` of ``cfg``'s launch on the shape, as
    :func:`megatron_flux.kernels.config.launch_geometry` lays it out."""
    world = max(1, tp)
    m_local = max(1, m_total // world)
    if op == "rs":
        merged = cfg.rs_merge_rows
        sk = not (cfg.rs_warp_specialized or cfg.rs_spread_reduce or merged)
    else:
        merged = cfg.ag_merge_local and cfg.ag_merge_lead == 0
        sk = not (cfg.ag_warp_specialized or cfg.ag_merge_local)
    return (launch_tiles(m_local, n, world, cfg, merged), tiles_per_segment(m_local, n, cfg),
            sk and bool(cfg.stream_k))


def wave_work(op: str, cfg, m_total: int, n: int, k: int, tp: int, num_sms: int,
              split_tail: bool = True) -> float:
    """The work ``cfg`` leaves the busiest SM on the shape, in output elements: tile area x
    the waves of tiles it runs (whole waves; with ``split_tail``, a stream-K tail that the
    kernel would split as :data:`STREAM_K_TAIL_COST` times its share, and the
    warp-specialized GEMM+RS's split tail as the kernel plans it, its last wave as
    :func:`~megatron_flux.kernels.split_tail.split_tail_wave` of one). The time of one K step
    per element is taken as equal across the configs compared (they are all at least
    :data:`MIN_TILE_AREA`), so this orders them by time where wave quantisation separates
    them. Comm off on one H200 at
    TP 2, GEMM+RS's time over cuBLAS's divided by (whole waves / waves) had a median of 0.97
    for 128x256 Triton tiles (61 shapes) and 0.98 for 128x128 Gluon ones (58); e.g. at
    m = 1024, n = 5120, 128x256 tiles make 1.21 waves, run as 2 (1.57x cuBLAS's time), and
    128x128 tiles 2.42, run as 3 (1.23x)."""
    from megatron_flux.kernels.stream_k import stream_k_plan

    tiles, per_segment, sk = tile_space(op, cfg, m_total, n, tp)
    waves = tiles / num_sms
    whole = math.ceil(waves)
    if split_tail and sk and stream_k_plan(tiles, num_sms, 1, per_segment)[1]:
        full = math.floor(waves)
        whole = min(whole, full + STREAM_K_TAIL_COST * (waves - full))
    elif split_tail and op == "rs" and cfg.rs_warp_specialized:  # the plan reads stream_k
        from megatron_flux.kernels.split_tail import split_tail_plan, split_tail_wave

        m_local = max(1, m_total // max(1, tp))
        grid = min(num_sms, tiles)
        tail, parts = split_tail_plan(max(1, tp), m_local, n, k, cfg, grid)
        if parts > 1:
            whole = math.floor(waves) + split_tail_wave(tail, parts, grid)
    return cfg.block_m * cfg.block_n * whole


def wave_aware_config(op: str, points: Iterable[Point], m_total: int, n: int, k: int, tp: int,
                      num_sms: int, candidates: Optional[Iterable[Point]] = None,
                      ws_split: bool = True) -> Optional[Tuple[object, Point, bool]]:
    """The config for a shape no table lists: ``(config, the entry it comes from, whether it
    replaced the nearest entry's)``, or None with no entry within reach.

    The nearest entry's config that can run the shape (:func:`nearest_config`, stream-K tail on:
    :func:`transplanted`), unless the config of another entry that beat NCCL (``ratio < 1``),
    with tiles of at least :data:`MIN_TILE_AREA` and :data:`MIN_TILE_ROWS` rows, that can run
    the shape, leaves the busiest SM at least :data:`WAVE_GAIN` less work
    (:func:`wave_work`; the nearest entry's config counted with its split stream-K tail, a
    replacement in whole waves): the nearest entry's tile may quantise badly on the new width.
    A split tail is where the work model erred: comm off on one H200, four replacements that
    relied on one ran 0.77-0.99x the nearest config's time where it predicted 0.62-0.87x, and
    with communication on (2xH200) one of them (128x128 tiles at n = 2560, m = 1024) ran 1.02x.
    The least work wins, nearer entries first among equals. ``candidates``: the entries whose
    configs may replace it (default ``points``; the provider passes the current tables'
    entries, so only configs measured with the current kernels, communication on, compete).
    ``ws_split``: :func:`transplanted`'s, False as the rules ran before the warp-specialized
    GEMM+RS's split tail."""
    points = list(points)
    near = nearest_config(op, points, m_total, n, k, tp)
    if near is None:
        return None
    base = transplanted(near.config, op, ws_split=ws_split)
    best, best_work = None, wave_work(op, base, m_total, n, k, tp, num_sms) * (1.0 - WAVE_GAIN)
    pool = points if candidates is None else list(candidates)
    ranked = sorted(pool, key=lambda p: (round(distance(m_total, n, k, p), 9), p.n, p.k, p.m))
    for p in ranked:
        cfg = p.config
        if (p.ratio is None or p.ratio >= 1.0 or cfg.block_m * cfg.block_n < MIN_TILE_AREA
                or cfg.block_m < MIN_TILE_ROWS
                or config_problem(op, cfg, m_total, n, k, tp) is not None):
            continue
        cfg = transplanted(cfg, op, ws_split=ws_split)
        work = wave_work(op, cfg, m_total, n, k, tp, num_sms, split_tail=False)
        if work < best_work - 1e-9:
            best, best_work = (cfg, p), work
    if best is None:
        return base, near, False
    return best[0], best[1], True


#: GEMM+RS at these TP sizes, for a shape no table lists, runs the ping-pong Gluon kernel
#: (:data:`PINGPONG_RS`) from :data:`PINGPONG_MIN_M` rows while the Triton kernel's 128x256
#: tiles would make fewer than :data:`PINGPONG_MAX_WAVES` waves and the per-rank K is below
#: :data:`PINGPONG_MAX_K` (:func:`pingpong_rs_config`)
PINGPONG_RS_TPS = (2, 4)
PINGPONG_MIN_M = 1024
PINGPONG_MAX_WAVES = 10.0
PINGPONG_MAX_K = 32768
#: ... with copy-engine pushes at these TP sizes from this many rows (:func:`pingpong_rs_config`)
PINGPONG_CE_TPS = (2,)
PINGPONG_CE_MIN_M = 2048
#: how :func:`unlisted_config` names the ping-pong rule as a config's source
PINGPONG_SOURCE = "ping-pong GEMM+RS"
#: On these (GPU, TP, dtype) ``auto`` runs a GEMM+RS shape fused where its config is the
#: ping-pong rule's (``megatron_flux.tuning.provider.decide``), without the estimate. 2xH200, bf16,
#: communication on, models no table holds: the rule's config as it stands ran 1.019-1.317x
#: NCCL + cuBLAS's speed (paired 1.019-1.318x) in all 16 cases measured (12 models, m =
#: 1024-8192), its form before copy-engine pushes from m = 2048 1.013-1.271x in 6 more
#: (``bench-h200x2-2026-11-29-unseen-h.json``; the rule's rows and variant rows of
#: ``ab-rs-split-h200x2-2026-11-28-unseen.json`` and ``ab-rs-pingpong-ce-h200x2-2026-11-29-unseen.json``).
#: The estimate, predicting from neighbours at half the rows, is conservative for GEMM+RS
#: (``docs/tuning.md``, "Leave-out error"). At TP 4 the rule's config ran with communication on
#: only before its split tail (0.85x and 0.97x at m = 1024 on two of nine models), and no other
#: GPU or dtype ran it: the estimate decides there.
PINGPONG_FUSED = (("h200", 2, "bf16"),)
#: On these (GPU, TP, dtype) ``auto`` runs an AG+GEMM shape no table lists fused from
#: :data:`AG_RULE_ROWS_PER_RANK` rows per rank, without the estimate, where its per-rank GEMM is
#: within the current entries' sizes (:func:`ag_rows_rule`). 2xH200, bf16: every AG+GEMM measured
#: there from 1024 rows per rank ran faster than NCCL + cuBLAS, the TP 2 table's entries and the
#: cases of models no table held in the op benchmarks (``docs/tuning.md``, "Leave-out error":
#: ``python -m megatron_flux.tools.auto_eval`` scores the rule as ``ag_rows``), where the
#: estimate, predicting from the neighbours at half the rows, took NCCL for most of them. Not on
#: 2xH100 (two entries ran 1.016x and 1.054x NCCL's time); at TP 4 the estimate already takes
#: the fused kernel in every such case measured.
AG_ROWS_FUSED = (("h200", 2, "bf16"),)
#: the rows per rank from which :data:`AG_ROWS_FUSED` runs AG+GEMM fused
AG_RULE_ROWS_PER_RANK = 1024


def ag_rows_rule(points: Sequence["Point"], m_total: int, n: int, k: int, tp: int) -> bool:
    """The AG+GEMM rule of :data:`AG_ROWS_FUSED`: fused from :data:`AG_RULE_ROWS_PER_RANK` rows
    per rank where the per-rank ``n * k`` lies within the ``points``' range: no extrapolation
    to larger GEMMs, where the communication's share of the time, and with it the fused
    kernel's margin over NCCL, shrinks, nor to smaller ones, where fixed costs weigh more."""
    sizes = [p.n * p.k for p in points]
    return (m_total >= AG_RULE_ROWS_PER_RANK * max(1, tp) and bool(sizes)
            and min(sizes) <= n * k <= max(sizes))
#: the ping-pong form of the warp-specialized GEMM+RS (``kernels/gemm_rs_ws.py``): 128x128
#: tiles on two MMA warpgroups, so one tile's epilogue (the pushes to the owner, or the
#: reduction of the peers' partials) runs beside the other tile's MMAs; pushes from the SMs;
#: the split tail on (``stream_k=1``: a partial last wave of own tiles cut along K where
#: ``split_tail_plan`` says it pays). 2xH200, TP 2, ten cases of five models outside the
#: tables at m = 1024-2048 against the configs the rules gave (the ping-pong unsplit, or the
#: entries' configs), A/B with a same-config control: 1.118x NCCL's speed (geomean) against
#: 1.022x, none slower against four, 0.67-0.91x the time where the ping-pong replaced a
#: 128x256 tile (``ab-rs-split-h200x2-2026-11-28-unseen.json``). At TP 4 the split was
#: measured with communication off only (``kernel-vs-cublas-h200-2026-11-28-split-tail.json``)
PINGPONG_RS = dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, group_m=8,
                   epilogue_split=1, warp_specialize=False, rs_warp_specialized=True,
                   rs_copy_engine=False, rs_tma_push=True, rs_spread_reduce=False,
                   rs_merge_rows=False, stream_k=1)


def pingpong_rs_config(base, m_total: int, n: int, k: int, tp: int, num_sms: int):
    """``base`` (the config the other rules chose for a GEMM+RS shape no table lists) as the
    ping-pong Gluon kernel (:data:`PINGPONG_RS`), or None to keep ``base``.

    It applies at TP :data:`PINGPONG_RS_TPS`, from :data:`PINGPONG_MIN_M` rows, while
    ``ceil(m / 128) * ceil(n / 256)`` tiles are fewer than :data:`PINGPONG_MAX_WAVES` waves
    of ``num_sms`` and the per-rank ``k`` is below :data:`PINGPONG_MAX_K`, where the kernel
    can run the shape (:func:`config_problem`) and ``base`` is not already a
    warp-specialized or merged-rows config. Why (A/B against the configs the tables gave, 11
    interleaved trials with a same-config control, paired medians):

    * 4xH200, TP 4 (``benchmarks/results/ab-rs-pingpong-h200x4-2026-11-28-*.json``): on four
      models outside the table (n = 4608-7168, m = 1024-8192) the ping-pong ran 0.55-1.00x the
      time of the config the rules gave in all 13 cases under 10 waves, and 0.99x and 1.01x
      in the two above 11; on the grid's entries, tuned without it, 0.91-0.99x in the 9 cases
      up to 7.8 waves and 1.03-1.06x in the 3 from 11.6 waves, where the wide tile's fewer
      operand loads per output count more than the overlapped epilogue.
    * 2xH200, TP 2 (``ab-rs-pingpong-h200x2-2026-11-28.json``, six models at m = 1024-4096):
      at m = 1024, where the tables and the nearest entries gave 128x256 tiles, the ping-pong
      ran 1.04-1.35x their speed in the four cases at per-rank K = 12288-27392, and 0.84x at
      K = 36864 (gemma2-27b), where the long main loop favours the wide tile; from m = 2048
      (and internlm2-20b's m = 1024) the entries already run it.

    At TP :data:`PINGPONG_CE_TPS` from :data:`PINGPONG_CE_MIN_M` rows the copy engine delivers
    the pushes (``rs_copy_engine``), as the tuned TP 2 entries from m = 2048 do: 2xH200, six
    models outside the tables, the ping-pong with its split tail, 0.913-0.989x the time with
    SM pushes in the five cases from m = 4096 the rule gave it (same-config control
    0.995-1.003x); at m = 1024 0.92-0.96x on three models and 1.147x on phi-2 (per-rank K
    5120), so not there (``ab-rs-pingpong-ce-h200x2-2026-11-29-unseen.json``). At TP 4 the
    ping-pong with copy-engine pushes ran up to 1.75x cuBLAS's time
    (``ab-rs-pingpong-ce-h200x4-2026-11-28-*.json``).
    """
    if (tp not in PINGPONG_RS_TPS or m_total < PINGPONG_MIN_M or k >= PINGPONG_MAX_K
            or base.rs_warp_specialized or base.rs_merge_rows):
        return None
    cfg = dataclasses.replace(base, **PINGPONG_RS)
    if config_problem("rs", cfg, m_total, n, k, tp) is not None:
        return None
    wide_tiles = -(-m_total // 128) * -(-n // 256)
    if wide_tiles >= PINGPONG_MAX_WAVES * num_sms:
        return None
    if tp in PINGPONG_CE_TPS and m_total >= PINGPONG_CE_MIN_M:
        cfg = dataclasses.replace(cfg, rs_copy_engine=True)
    return cfg


def unlisted_config(op: str, points: Iterable[Point], m_total: int, n: int, k: int, tp: int,
                    num_sms: int, candidates: Iterable[Point] = (), pingpong: bool = False,
                    ws_split: bool = True) -> Tuple[object, str]:
    """``(config, where it came from)`` for a shape no table lists: :func:`wave_aware_config`
    with ``candidates`` (none: the nearest entry's config, its stream-K tail on), else
    ``default_config``; with ``pingpong``, a GEMM+RS shape then runs the ping-pong Gluon kernel
    where :func:`pingpong_rs_config` says so. What the runtime runs
    (:func:`megatron_flux.tuning.provider.kernel_config`) and what
    :mod:`megatron_flux.tools.tune.extend` records a benchmark ran (``ws_split=False``: as the
    rules ran before the warp-specialized GEMM+RS's split tail, :func:`transplanted`)."""
    hit = wave_aware_config(op, points, m_total, n, k, tp, num_sms, candidates=candidates,
                            ws_split=ws_split)
    if hit is None:
        cfg, where = default_config(op, m_total, n, k, tp=tp), "default"
    else:
        cfg, p, replaced = hit
        where = (f"entry {p.label()}: fewer waves than the nearest entry's tile" if replaced
                 else f"nearest entry ({p.label()})")
    if pingpong and op == "rs":
        ping = pingpong_rs_config(cfg, m_total, n, k, tp, num_sms)
        if ping is not None:
            if not ws_split:
                ping = dataclasses.replace(ping, stream_k=0)
            return ping, f"{PINGPONG_SOURCE} under {PINGPONG_MAX_WAVES:g} waves (else {where})"
    return cfg, where


def transplanted(cfg, op: str, ws_split: bool = True):
    """``cfg`` (the nearest entry's, for a shape it was not tuned on) with its kernel's tail
    split on: the persistent Triton kernels' stream-K tail, and for GEMM+RS the
    warp-specialized kernel's split tail (not merged rows, the spread reduction, or the
    warp-specialized AG+GEMM, which have none). A tuned entry may turn it off because its own
    shape has no small partial last wave; the new shape may have one (``default_config`` turns
    it on for the same reason), and each kernel plans the split only where it pays
    (:func:`~megatron_flux.kernels.stream_k.stream_k_plan`,
    :func:`~megatron_flux.kernels.split_tail.split_tail_plan`). A/Bs with a same-config control
    on 2xH200:

    * Triton, GEMM+RS at m = 1024 on three models whose 128x256 tiles leave 21 % of a last wave
      (n = 5120): 0.73x -> 0.87x NCCL's speed, level where the tail is too large to split
      (n = 6144; ``benchmarks/results/ab-stream-k-h200x2-2026-11-27.json``);
    * warp-specialized GEMM+RS, split alone: 0.89-0.92x the unsplit time at 3.4-4.4 waves
      (four models at m = 2048, ``ab-rs-split-h200x2-2026-11-28.json``), 0.91x on falcon-180b's
      nearest entry at m = 1024 (7 waves, a tail of 4 tiles in 8 parts) and 0.96x at 2048
      (``...-unseen.json``); 1.035x on phi-2 at m = 2048 (per-rank K 5120, 2.4 waves).

    ``ws_split=False``: the warp-specialized GEMM+RS left alone, as before its split tail."""
    if cfg.stream_k:
        return cfg
    if op == "rs" and cfg.rs_warp_specialized and ws_split:
        return cfg if cfg.rs_merge_rows else dataclasses.replace(cfg, stream_k=1)
    if (cfg.rs_warp_specialized or cfg.ag_warp_specialized or cfg.rs_merge_rows
            or cfg.rs_spread_reduce or cfg.ag_merge_local):
        return cfg
    return dataclasses.replace(cfg, stream_k=1)
