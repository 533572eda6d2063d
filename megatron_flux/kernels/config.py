"""GEMM block configurations for the fused kernels.

The defaults come from a sweep of a plain persistent TMA GEMM against cuBLAS on H200
(``shared/reference/triton-gemm-vs-cublas-h200-2026-11-22.json``): 128x256x64 with 3 stages
and 8 warps wins on the large training shapes, 128x128x64 with 4 stages and 4 warps at
``M <= 2048``. The tuner (``megatron-flux tune``) overrides them per shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional, Tuple


def interpreting() -> bool:
    """Whether kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One fused-kernel configuration: :func:`default_config` picks one per shape, a tuning
    table entry overrides it. One line per knob; "AG" / "RS" knobs only change AllGather+GEMM /
    GEMM+RS, the other kernel ignores them. The measurements behind the defaults are in
    :func:`default_config`, those behind what was rejected in docs/design.md.

    Both kernels:

    * ``block_m``, ``block_n``, ``block_k``: the output tile and the K step (powers of two >= 16).
    * ``num_stages``: depth of the TMA load pipeline (A and B buffers in shared memory).
    * ``num_warps``: warps per program; for the Gluon kernels 4 = ping-pong, 8 = cooperative.
    * ``group_m``: row tiles walked together for L2 reuse of B (2 ran 10 % slower than 8).
    * ``epilogue_split``: store the output tile in 1 or 2 column halves (less shared memory).
    * ``flatten``: ask Triton to flatten the persistent tile loop into the K loop.
    * ``warp_specialize``: Triton's automatic warp specialization (same PTX either way on sm_90a).
    * ``stream_k``: 1 splits a small partial last wave along K over the grid (:mod:`.stream_k`;
      the Gluon GEMM+RS cuts each tail tile into equal K-parts, ``split_tail.split_tail_plan``).

    AG:

    * ``chunk_rows``: rows of a rank's segment copied and signalled at once (not tied to block_m).
    * ``comm_priority``: CUDA priority of the copy-engine side stream (-1 is above the default 0).
    * ``ag_merge_local``: the local segment and the first peer's share one tile loop.
    * ``ag_merge_lead``: waves of local tiles before the first wait; 0: the gathered rows at once.
    * ``ag_warp_specialized``: run the warp-specialized Gluon kernel (:mod:`.ag_gemm_ws`).

    RS:

    * ``rs_tma_push``: push partial tiles into the owner's slot by TMA stores (else vector stores).
    * ``flatten_consume``: ask Triton to flatten the reduction loop (the same kernel either way).
    * ``rs_spread_reduce``: push the own partials too and spread the reduction over the grid.
    * ``rs_copy_engine``: stage the peers' partials locally; the copy engine delivers them.
    * ``rs_merge_rows``: every rank's rows in one tile space (spread reduction, vector pushes).
    * ``rs_warp_specialized``: run the warp-specialized Gluon kernel (:mod:`.gemm_rs_ws`).
    * ``rs_interleave_owners``: with merged rows on the Gluon kernel, walk the owners' row tiles
      in turn, so the pushes spread over the launch (``gemm_rs_ws.interleaves_owners``).
    * ``rs_row_turns``: on the Gluon kernel's per-segment schedule, walk the owners' row groups
      in turn, each own tile reduced once the peers' tiles of its row group are counted in (a
      signal per row group instead of the grid barrier), so the pushes spread over the launch.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_stages: int = 3
    num_warps: int = 8
    group_m: int = 8
    chunk_rows: int = 1024
    epilogue_split: int = 2
    flatten: bool = True
    flatten_consume: bool = False
    warp_specialize: bool = False
    comm_priority: int = -1
    rs_tma_push: bool = True
    rs_spread_reduce: bool = False
    rs_copy_engine: bool = False
    stream_k: int = 0
    ag_merge_local: bool = False
    ag_merge_lead: int = 1
    rs_warp_specialized: bool = False
    ag_warp_specialized: bool = False
    rs_merge_rows: bool = False
    rs_interleave_owners: bool = False
    rs_row_turns: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name}={v} must be a power of two >= 16")
        if self.num_stages < 1 or self.num_warps not in (4, 8, 16):
            raise ValueError(f"bad GemmConfig pipeline settings: {self}")
        if self.epilogue_split not in (1, 2) or self.block_n // self.epilogue_split < 16:
            raise ValueError(f"GemmConfig.epilogue_split must be 1 or 2 (block_n/split >= 16): {self}")
        if not isinstance(self.comm_priority, int) or not -5 <= self.comm_priority <= 0:
            raise ValueError(f"GemmConfig.comm_priority must be an int in [-5, 0]: {self}")
        for name in ("flatten", "flatten_consume", "warp_specialize", "rs_tma_push",
                     "rs_spread_reduce", "rs_copy_engine",
                     "ag_merge_local", "rs_warp_specialized", "ag_warp_specialized",
                     "rs_merge_rows", "rs_interleave_owners", "rs_row_turns"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GemmConfig.{name} must be a bool: {self}")
        if self.stream_k not in (0, 1) or isinstance(self.stream_k, bool):
            raise ValueError(f"GemmConfig.stream_k must be 0 or 1: {self}")
        if (isinstance(self.ag_merge_lead, bool) or not isinstance(self.ag_merge_lead, int)
                or not 0 <= self.ag_merge_lead <= 8):
            raise ValueError(f"GemmConfig.ag_merge_lead must be an int in [0, 8]: {self}")
        for knob in ("rs_warp_specialized", "ag_warp_specialized"):
            if not getattr(self, knob):
                continue
            if self.num_warps == 4:  # ping-pong: a tile is one warpgroup's accumulator
                if self.block_m not in (64, 128) or self.block_n not in (64, 128, 256) \
                        or self.block_m * self.block_n > 128 * 128 or self.block_k > 128:
                    raise ValueError(f"GemmConfig.{knob} with num_warps=4 (ping-pong) takes tiles "
                                     f"of at most 128x128 and block_k <= 128: {self}")
            elif self.num_warps == 8:  # cooperative: two warpgroups, 64 rows each
                if self.block_m != 128 or self.block_n not in (64, 128, 256) or self.block_k > 128:
                    raise ValueError(f"GemmConfig.{knob} with num_warps=8 (cooperative) takes "
                                     f"block_m=128, block_n <= 256 and block_k <= 128: {self}")
            else:
                raise ValueError(f"GemmConfig.{knob} runs num_warps=4 (ping-pong) or 8 "
                                 f"(cooperative): {self}")
        if self.rs_merge_rows and (not self.rs_spread_reduce or self.rs_tma_push
                                   or self.rs_copy_engine):
            raise ValueError("GemmConfig.rs_merge_rows reduces with rs_spread_reduce and pushes "
                             "with vector stores (rs_tma_push=False), on the SMs (no "
                             f"rs_copy_engine): {self}")
        if self.rs_warp_specialized and self.rs_spread_reduce and not self.rs_merge_rows:
            raise ValueError("GemmConfig.rs_warp_specialized does not implement rs_spread_reduce "
                             f"without rs_merge_rows (its merged rows reduce spread): {self}")
        if self.rs_interleave_owners and not (self.rs_merge_rows and self.rs_warp_specialized):
            raise ValueError("GemmConfig.rs_interleave_owners orders merged rows "
                             f"(rs_merge_rows) on the warp-specialized kernel: {self}")
        if self.rs_row_turns and not (self.rs_warp_specialized and not self.rs_merge_rows
                                      and not self.rs_copy_engine and not self.stream_k):
            raise ValueError("GemmConfig.rs_row_turns orders the per-segment schedule of the "
                             "warp-specialized kernel with SM pushes (rs_warp_specialized, no "
                             f"rs_merge_rows, rs_copy_engine or stream_k): {self}")
        if self.ag_warp_specialized and self.ag_merge_local:
            raise ValueError("GemmConfig.ag_warp_specialized runs the per-segment schedule: no "
                             f"ag_merge_local: {self}")
        if self.group_m < 1 or self.chunk_rows < 1:
            raise ValueError(f"GemmConfig.group_m and chunk_rows must be >= 1: {self}")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GemmConfig":
        """The config of ``d``'s fields; a field of :data:`REMOVED_FIELDS` is dropped at the
        value it always had and refused at any other."""
        d = dict(d)
        for name in sorted(set(d) & set(REMOVED_FIELDS)):
            problem = removed_field_problem(name, d.pop(name))
            if problem is not None:
                raise ValueError(f"GemmConfig.{name}: {problem}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown GemmConfig fields {sorted(unknown)}")
        return cls(**d)


#: Knobs GemmConfig no longer has, with the one value they took in every shipped tuning table
#: (what other values measured: docs/design.md, "Measured and rejected"). Tables and configs
#: written before their removal name them at that value, which :meth:`GemmConfig.from_dict`
#: and :mod:`megatron_flux.tuning.schema` drop.
REMOVED_FIELDS: Dict[str, Any] = {
    "ag_peer_group": 1,
    "ag_pull": False,
    "programs_per_sm": 1,
    "rs_ce_bands": False,
    "rs_split_k": 1,
    "rs_tma_reduce": True,
}


def removed_field_problem(name: str, value: Any) -> Optional[str]:
    """Why a config may not name the removed knob ``name`` at ``value``, or None where it is
    the value the knob always had (then the field is dropped)."""
    kept = REMOVED_FIELDS[name]
    if type(value) is type(kept) and value == kept:
        return None
    return (f"knob {name} was removed; a config may name it only at {json.dumps(kept)}, the "
            f"value it always had, not {json.dumps(value, default=repr)}")


@dataclasses.dataclass(frozen=True)
class LaunchGeometry:
    """How one fused launch is laid out; the host code that sizes signal regions and the
    launchers must agree on it, so both take it from :func:`launch_geometry`."""

    tiles_per_segment: int  # output tiles in one rank's m_local rows
    tiles: int              # output tiles of the launch's tile space (see launch_geometry)
    grid: int               # persistent programs
    ragged: bool            # m_local is not a multiple of block_m (3-D, clipped descriptors)
    b_kn: bool              # B is row-major [K, N] (else a transposed row-major [N, K])
    ldb: int                # B's leading stride


def tiles_per_segment(m_local: int, n: int, cfg: GemmConfig) -> int:
    return -(-m_local // cfg.block_m) * -(-n // cfg.block_n)


def launch_tiles(m_local: int, n: int, world: int, cfg: GemmConfig, merged: bool = False) -> int:
    """Output tiles of a launch's tile space (:func:`launch_geometry`): ``world`` segments of
    :func:`tiles_per_segment`, or with ``merged`` one tile space over every rank's rows."""
    if merged:
        return -(-world * m_local // cfg.block_m) * -(-n // cfg.block_n)
    return world * tiles_per_segment(m_local, n, cfg)


def mma_partitions(cfg: GemmConfig) -> int:
    """MMA partitions of the warp-specialized Gluon kernels' form: 2 for the ping-pong
    (``num_warps=4``), 1 for the cooperative one (``num_warps=8``)."""
    return 2 if cfg.num_warps == 4 else 1


#: row groups (``block_m * group_m`` rows each) per rank that ``rs_row_turns`` counts in
ROW_GROUPS = 64


def row_groups(m_local: int, cfg: GemmConfig) -> int:
    """Row groups of ``block_m * group_m`` rows in ``m_local`` rows (the last may be shorter):
    what ``rs_row_turns`` counts per (peer, group)."""
    return -(-m_local // (cfg.block_m * cfg.group_m))


def rs_signal_count(world: int, row_turns: bool = False) -> int:
    """Signal words one GEMM+RS call needs per rank and parity: ``[src]`` (raised by the peer
    ``src`` when its grid finished producing, or with ``rs_copy_engine`` by the copy engine
    after its partial landed), then ``[world]``, the arrival counter this rank's own programs
    count up and the last one resets, then ``[world + 1]``, this rank's "produced" word
    (``rs_copy_engine``: raised by its own grid, awaited by its copy-engine stream). With
    ``row_turns`` (a call with ``rs_row_turns``) then, per rank ``src``, :data:`ROW_GROUPS`
    counters of the tiles ``src`` pushed into each row group, reset to zero by this rank's grid
    at the end of the call. The layout does not depend on the shape; the counters follow the
    words every call uses, so a workspace grown for them serves every call."""
    return world + 2 + (world * ROW_GROUPS if row_turns else 0)


#: Largest TP size whose step loops the fused kernels unroll at compile time. Comm off on one
#: H200, unrolled step loops ran 1-3 % faster than a runtime loop at TP 2 and level at TP 4.
#: At TP 8 the runtime loop ran faster, by up to 9-11 % (AG+GEMM) and 2-3 % (GEMM+RS) in two
#: runs: seven unrolled copies of a pipelined tile loop are four times the code.
MAX_UNROLLED_WORLD = 4


def unroll_steps(world: int) -> bool:
    """Whether the fused kernels unroll their per-segment step loop at TP size ``world``."""
    return world <= MAX_UNROLLED_WORLD


def launch_geometry(m_local: int, n: int, b, world: int, cfg: GemmConfig, num_sms: int,
                    merged: bool = False) -> LaunchGeometry:
    """The layout of a launch over ``world`` segments of ``m_local`` rows. ``merged``: one tile
    space over every rank's rows (merged GEMM+RS rows, AG+GEMM's gathered rows), whose row
    tiles may span segments: ``cdiv(world * m_local, block_m)`` row tiles, fewer than
    ``world`` segments' own where ``m_local`` is not a multiple of ``block_m``. The grid is
    one program per SM, at most one per tile. A grid with programs that have no tile is slower
    than one without them when the kernel streams B from memory: on one H200 the merged
    GEMM+RS at gpt3-175b m = 64 (96 tiles) ran 0.150 or 0.165-0.185 ms in a block of
    launches, by where the 96 working programs of 132 landed, and its plain yardstick, whose
    grid is the 96 tiles, 0.149 every time."""
    b_kn = b.stride(1) == 1
    tiles = launch_tiles(m_local, n, world, cfg, merged)
    return LaunchGeometry(
        tiles_per_segment=tiles_per_segment(m_local, n, cfg),
        tiles=tiles,
        grid=min(num_sms, tiles),
        ragged=m_local % cfg.block_m != 0,
        b_kn=b_kn,
        ldb=b.stride(0) if b_kn else b.stride(1),
    )


def default_config(op: str, m_total: int, n: int, k: int, interpret: bool = False,
                   tp: Optional[int] = None, gather_small_m: bool = True) -> GemmConfig:
    """Heuristic configuration for ``op`` ("ag" or "rs") on a ``[m_total, k] x [k, n]`` GEMM
    at TP size ``tp`` (``None``: unknown, taken as below 8).

    Measured on H200 with communication disabled (benchmarks/results/kernel-vs-cublas-*.json):
    AG+GEMM wants the flattened persistent loop with a split epilogue (0.94-1.04x cuBLAS on the
    grid). GEMM+RS has no synchronisation inside its loops and flattens both (its first
    schedule, a release per tile inside the loop, ran 2.3-3.7x slower flattened). Both split a
    small last wave along K (``stream_k=1``, a no-op elsewhere: :mod:`megatron_flux.kernels.stream_k`):
    AG+GEMM 0.9-3.8 % faster where it applies; GEMM+RS on its 128x256 tiles 1.2 % at gpt3-175b
    m = 8192, the grid's one shape with a tail that small (H100, communication off, two runs;
    level with communication on). GEMM+RS at TP >= 8 spreads its reduction over the grid
    (``rs_spread_reduce``): with communication off on one H200 it ran up to 14 % faster there
    (median 2.3 % over m = 1024-4096), level at TP 4 and 0.5-2.6 % slower at TP 2.

    GEMM+RS at small m (``m_total <= 256``, TP >= 2) likewise runs every rank's rows as one
    tile space (``rs_merge_rows``, with the spread reduction), on the tile that loads the
    busiest SM least (:func:`merged_rs_tile`: narrower at small n, where 32 tiles of 64x128
    would leave 100 SMs without B to stream). On the grid's m = 64-256 shapes it ran 0.98-1.35x
    cuBLAS's GPU time against 1.21-1.79x for the per-segment table configs (two runs, faster
    on all 9); at m = 512 merged rows ran 1.30-1.37x against their 1.03-1.14x (one H200).

    AG+GEMM at small m (``m_total <= 512``, TP >= 2) waits for every peer first and treats the
    gathered rows as one operand (``ag_merge_local`` with a lead of 0): each rank's segment is
    then at most 256 rows, and the per-segment schedule streams all of B once per segment,
    mostly through half-empty row tiles. With communication off (TP 2 wiring, GPU time alone)
    that took the grid's m = 64-512 shapes from 1.09-2.32x cuBLAS to 0.98-1.22x on one H200
    (1.21-2.43x to 1.00-1.30x on one H100). At m <= 128 its tile is :func:`gathered_ag_tile`'s
    (64x128 or 64x256). The copies it
    then waits for are m_local x K (at most 6 MiB there). ``gather_small_m=False`` gives the
    earlier per-segment defaults of both ops there: what tuning-table entries that do not name
    these knobs were measured with (:mod:`megatron_flux.tuning.schema` fills missing fields
    from it).
    """
    if interpret:  # the CPU interpreter runs whole blocks in numpy: keep them small
        return GemmConfig(block_m=16, block_n=32, block_k=16, num_stages=1, num_warps=4, group_m=2,
                          chunk_rows=16)
    if op == "rs":
        spread = tp is not None and tp >= 8
        if gather_small_m and tp is not None and tp >= 2 and m_total <= RS_MERGE_MAX_M:
            bm, bn, bk, stages, warps = merged_rs_tile(m_total, n)
            return GemmConfig(bm, bn, bk, stages, warps, 8, epilogue_split=1, flatten=True,
                              flatten_consume=True, rs_spread_reduce=True, rs_tma_push=False,
                              rs_merge_rows=True)
        if m_total < 1024:  # few rows: 64-row tiles (what the tuner picked on H200 below m=1024)
            return GemmConfig(64, 128, 128, 4, 4, 8, epilogue_split=1, flatten=True, flatten_consume=True,
                              rs_spread_reduce=spread)
        return GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True, flatten_consume=True,
                          rs_spread_reduce=spread, stream_k=0 if spread else 1)
    split = 1 if m_total <= 1024 and n <= 16384 else 2
    if gather_small_m and tp is not None and tp >= 2 and m_total <= AG_GATHER_MAX_M:
        tile = gathered_ag_tile(m_total, n) if m_total <= 128 else (128, 256, 64, 3, 8)
        return GemmConfig(*tile, 8, chunk_rows=4096, epilogue_split=split, flatten=True,
                          ag_merge_local=True, ag_merge_lead=0)
    if split == 1:
        return GemmConfig(128, 128, 64, 4, 4, 8, chunk_rows=4096, epilogue_split=1, flatten=True,
                          stream_k=1)
    return GemmConfig(128, 256, 64, 3, 8, 8, chunk_rows=4096, epilogue_split=2, flatten=True,
                      stream_k=1)


#: up to this many global rows AG+GEMM's default gathers first (merged local rows, a lead of 0)
AG_GATHER_MAX_M = 512
#: up to this many global rows GEMM+RS's default runs every rank's rows as one tile space
#: (``rs_merge_rows``); at m = 512 (TP 2) the per-segment table configs ran faster
RS_MERGE_MAX_M = 256
#: merged GEMM+RS tiles to choose from: (block_m, block_n, block_k, num_stages, num_warps)
MERGED_RS_TILES = ((64, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 32, 256, 4, 4),
                   (128, 128, 64, 4, 8), (128, 256, 64, 3, 8))
#: AG+GEMM's gathered-rows tiles to choose from at m <= 128 (the 64-row pair; above, 128x256)
GATHERED_AG_TILES = ((64, 128, 128, 4, 4), (64, 256, 64, 4, 4))
#: SMs the small-m tile choice assumes (H100 / H200)
ASSUMED_SMS = 132


def least_streaming_tile(tiles: Tuple[Tuple[int, ...], ...], m_total: int, n: int,
                         sms: int = ASSUMED_SMS):
    """The entry of ``tiles`` ((block_m, block_n, ...) each) whose busiest SM streams the fewest
    operand columns: at small m the GEMM reads B from memory and every SM streams
    ``block_m + block_n`` rows of K per tile, so the cost is ``ceil(tiles / sms) * (block_m +
    block_n)``; the first of equals wins."""
    def cost(tile):
        bm, bn = tile[0], tile[1]
        count = -(-m_total // bm) * -(-n // bn)
        return -(-count // sms) * (bm + bn)

    return min(tiles, key=cost)


def merged_rs_tile(m_total: int, n: int, sms: int = ASSUMED_SMS):
    """GEMM+RS's merged-rows tile: :func:`least_streaming_tile` of :data:`MERGED_RS_TILES`. On
    one H200 this picked what ran best among 64x128, 64x64 and 64x32 at m = 64-256
    (llama3-8b m = 64: 128 tiles of 64x32, 1.11x cuBLAS against 1.47x for 32 tiles of
    64x128)."""
    return least_streaming_tile(MERGED_RS_TILES, m_total, n, sms)


def gathered_ag_tile(m_total: int, n: int, sms: int = ASSUMED_SMS):
    """AG+GEMM's gathered-rows tile at m <= 128: :func:`least_streaming_tile` of
    :data:`GATHERED_AG_TILES`. Communication off on one H200, three runs: 64x256 where it
    streams less, gpt3-175b m = 64 1.10-1.19x cuBLAS -> 1.015x,
    llama3-70b m = 64 1.02x -> 0.98x and m = 128 1.07x -> 1.03x; 64x128 kept where it wins
    (gpt3-175b m = 128, llama3-8b m = 64); llama3-8b m = 128 about 1 % slower (1.09-1.11x ->
    1.11x). With all four 64/128-row tiles the same rule picked 128x256 on gpt3-175b m = 128,
    10 % slower than 64x128 (96 tiles leave 36 SMs without B to stream), so it chooses among
    the 64-row pair only."""
    return least_streaming_tile(GATHERED_AG_TILES, m_total, n, sms)
