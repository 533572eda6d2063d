"""The host's plan of the warp-specialized GEMM+RS's split tail (``stream_k=1``, :mod:`.gemm_rs_ws`).

Where a launch's partial last wave lies in the own segment, its tiles are cut along K into
equal parts dealt over the programs; these functions decide how many tiles, how many parts and
whether the parts run first or last. Host arithmetic only (no Triton), so the tuning estimate
and ``megatron-flux plan`` ask it without a GPU.
"""

from megatron_flux.kernels.config import launch_tiles, mma_partitions


#: at most this many K-parts per split tail tile
MAX_TAIL_SPLIT = 8
#: split tail units a program's scratch slots hold: :func:`.stream_k.stream_k_scratch` keeps
#: ``[grid, 2, block_m * block_n]`` fp32, four tiles a program in a 2-byte output dtype
SCRATCH_UNITS = 4
#: at most this many split tail units per program (never more than :data:`SCRATCH_UNITS`). The
#: kernel runs several, which lets tails over half the grid split; one H200, communication off,
#: that lost where K is short (two units of 5-14 K-steps: 1.02-1.53x the unsplit time) and
#: gained at most 5 % where it is long (two to four units of 40-112 K-steps: 0.95-1.06x;
#: ``benchmarks/results/kernel-ab-tail-units-h200-2026-11-29.json``)
MAX_TAIL_UNITS = 1


def tail_sum_rows(cfg, parts: int) -> int:
    """Rows per chunk of a split tail tile's sum (TAIL_ROWS): few enough chunks that each of
    the ``parts`` programs sums at most one (a chunk costs its program about one load latency,
    2-2.5 us on an H200, whatever its size), at most 64 rows (registers) and at least the sum
    layout's rows (16 in ping-pong, 32 cooperative)."""
    least = 4 * (8 // mma_partitions(cfg))
    rows = 1 << max(0, -(-cfg.block_m // max(1, parts)) - 1).bit_length()
    return max(least, min(64, rows, cfg.block_m))


def split_tail_first(world: int, m_local: int, n: int, cfg, grid: int) -> bool:
    """Whether a split tail's parts run as their programs' first work item (TAIL_FIRST) rather
    than their last: at TP 2, and below two waves at any TP. Run first, a part's epilogue and
    its share of the sum run beside the whole tiles' MMAs instead of after them. One H200,
    communication off, the ping-pong at 1.09-4.36 waves: first ran 0.88-1.00x the time of last
    on the 10 split TP 2 shapes and 0.92-0.94x on the two TP 4 shapes below two waves
    (``benchmarks/results/kernel-ab-split-first-h200-2026-11-29-tp{2,4}.json``); but with the
    parts first at every TP, eight of nine TP 4 shapes of two waves or more ran 1.018-1.118x
    the time of last, one 0.999x, no register spilled in either order
    (``kernel-ab-part-first-tp4-h200-2026-11-29.json``; why is not established: a phase trace
    of one showed its whole tiles' MMAs about 9 us slower in all, not a longer end)."""
    return world == 2 or launch_tiles(m_local, n, world, cfg) < 2 * grid


#: A tail tile cut into ``parts`` costs its programs about this many ``/ parts`` of a whole
#: tile's time (the parts' stores, the count and the sum): 2xH200, TP 2, communication on, the
#: split alone (same config otherwise, A/B with a same-config control) ran 0.895-0.919x the
#: unsplit time at 3.4-4.4 waves with two parts, (3 + 0.58-0.60) / 4 and (4 + 0.50-0.60) / 5
#: waves' worth (``benchmarks/results/ab-rs-split-h200x2-2026-11-28.json``; measured while
#: the last part summed the tile alone, before the parts shared the sum)
SPLIT_PART_COST = 1.2
#: Split only where that model saves at least this share of the launch's whole waves: at 17-28
#: waves two to six parts saved a tile's 0.4-0.8 of 18-28 (2-3 %) and ran 0.95-1.03x the
#: unsplit time, within the control's spread (``...-split-h200x2-2026-11-28-m8192.json``)
MIN_SPLIT_GAIN = 0.04


def tail_units(tail: int, parts: int, grid: int) -> int:
    """Split tail units a program runs at most: ``tail * parts`` units dealt over ``grid``."""
    return -(-tail * parts // grid)


def split_tail_wave(tail: int, parts: int, grid: int) -> float:
    """The modelled cost of a split tail, in whole tiles per program: its programs' most units,
    each :data:`SPLIT_PART_COST` ``/ parts`` of a tile."""
    return tail_units(tail, parts, grid) * SPLIT_PART_COST / parts


def split_tail_plan(world: int, m_local: int, n: int, k: int, cfg, grid: int):
    """``(tail tiles, parts)`` of a launch, or ``(0, 1)`` for none (``stream_k`` off, or merged
    rows, which have no segments): the partial last wave's ``T % grid`` tiles (``T = world *
    tiles per segment``), when they lie in the own segment, each split along K into equal
    parts of at least ``num_stages`` K-steps (the ping-pong ring protocol needs that), at most
    :data:`MAX_TAIL_SPLIT`. A tail of at most half the grid: as many parts as fit one per
    program. A longer one: the parts count whose units, dealt round-robin over the programs
    (:data:`MAX_TAIL_UNITS` at most each), leave the least work per program
    (:func:`split_tail_wave`; the fewest parts of equals). No split where the last wave would
    not save :data:`MIN_SPLIT_GAIN` of the ``ceil(T / grid)`` waves."""
    if not cfg.stream_k or cfg.rs_merge_rows:
        return 0, 1
    total = launch_tiles(m_local, n, world, cfg)
    tail = total % grid if total > grid else 0
    if not tail or tail > total // world:  # (a tail longer than the own segment)
        return 0, 1
    k_tiles = -(-k // cfg.block_k)
    most = min(k_tiles // cfg.num_stages, MAX_TAIL_SPLIT)
    cap = min(MAX_TAIL_UNITS, SCRATCH_UNITS)
    if 2 * tail <= grid:
        parts = min(grid // tail, most)
    elif cap < 2:  # two parts of a tail over half the grid already take two units somewhere
        return 0, 1
    else:
        fits = [q for q in range(2, most + 1) if tail_units(tail, q, grid) <= cap]
        parts = min(fits, key=lambda q: (split_tail_wave(tail, q, grid), q), default=1)
    if parts < 2 or 1.0 - split_tail_wave(tail, parts, grid) < MIN_SPLIT_GAIN * -(-total // grid):
        return 0, 1
    return tail, parts
