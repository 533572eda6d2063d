"""``GemmConfig.rs_warp_specialized`` / ``ag_warp_specialized`` and when the warp-specialized
Gluon kernels run (CPU).

The Gluon kernels have no interpreter: they are compiled for sm_90 in
``test_kernels_compile.py`` and run in ``test_kernels_one_gpu.py`` / ``test_flux_gpu.py``; that
a config with them runs the Triton kernels under the interpreter is
``interpret_checks.check_ws_configs_run_the_triton_kernels``."""

import dataclasses
import warnings

import pytest
import torch

from megatron_flux.kernels import ag_gemm_ws, gemm_rs_ws, gluon_ws, split_tail
from megatron_flux.kernels.config import GemmConfig

WS = dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, epilogue_split=1,
          rs_warp_specialized=True)


def test_rs_warp_specialized_round_trips_and_defaults_off():
    assert GemmConfig().rs_warp_specialized is False
    cfg = GemmConfig(**WS)
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    assert GemmConfig.from_dict({"block_m": 64}).rs_warp_specialized is False  # older tables


@pytest.mark.parametrize("fields, match", [
    (dict(block_n=256), "at most 128x128"),            # two warpgroups' accumulators: no room
    (dict(block_m=256, block_n=64), "at most 128x128"),
    (dict(block_k=256), "block_k"),
    # the cooperative form's two warpgroups take 64 rows each
    (dict(num_warps=8, block_m=64, block_n=256), "block_m=128"),
    (dict(num_warps=8, block_m=256, block_n=128), "block_m=128"),
    (dict(num_warps=8, block_n=512), "block_n <= 256"),
    (dict(num_warps=16), "num_warps=4 .ping-pong. or 8"),
    (dict(rs_spread_reduce=True), "rs_spread_reduce"),
    (dict(rs_warp_specialized=1), "must be a bool"),
])
def test_rs_warp_specialized_refuses_what_the_kernel_does_not_do(fields, match):
    with pytest.raises(ValueError, match=match):
        GemmConfig(**{**WS, **fields})


def test_the_copy_engine_push_and_a_64_row_tile_are_accepted():
    GemmConfig(**{**WS, "rs_copy_engine": True})
    GemmConfig(**{**WS, "block_m": 64, "block_n": 256})


MERGED = dict(rs_merge_rows=True, rs_spread_reduce=True, rs_tma_push=False)


def test_merged_rows_run_on_it_with_the_spread_reduction_only():
    """Merged rows (every rank's rows in one tile space) reduce spread, on the SMs; the
    kernel takes them."""
    GemmConfig(**{**WS, **MERGED})
    GemmConfig(**{**WS, **MERGED, "num_warps": 8, "block_n": 256, "num_stages": 3})
    with pytest.raises(ValueError, match="rs_copy_engine"):
        GemmConfig(**{**WS, **MERGED, "rs_copy_engine": True})


def test_owners_in_turn_order_merged_rows_on_it_only():
    """``rs_interleave_owners`` is an order of merged rows on the Gluon kernel: refused without
    either; on it, a launch walks the owners in turn only where every row tile lies in one
    owner's rows (``gemm_rs_ws.interleaves_owners``)."""
    from megatron_flux.kernels.gemm_rs_ws import interleaves_owners

    cfg = GemmConfig(**{**WS, **MERGED, "rs_interleave_owners": True})
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    assert GemmConfig.from_dict({**WS, **MERGED}).rs_interleave_owners is False  # older tables
    with pytest.raises(ValueError, match="rs_interleave_owners"):
        GemmConfig(**{**WS, "rs_interleave_owners": True})
    with pytest.raises(ValueError, match="rs_interleave_owners"):
        GemmConfig(**{**MERGED, "rs_interleave_owners": True})
    assert interleaves_owners(cfg, 1024) and interleaves_owners(cfg, 128)
    assert not interleaves_owners(cfg, 300) and not interleaves_owners(cfg, 64)
    assert not interleaves_owners(GemmConfig(**{**WS, **MERGED}), 1024)


def test_row_turns_on_the_per_segment_schedule_only():
    """``rs_row_turns`` orders the Gluon kernel's per-segment schedule with SM pushes: refused
    with merged rows, copy-engine pushes, the split tail or another kernel; older tables load
    without it; a call with more row groups per rank than the signal region counts is named
    as unsupported (the launcher falls back); the counters follow the grid barrier's words."""
    from megatron_flux.kernels.config import ROW_GROUPS, rs_signal_count

    cfg = GemmConfig(**{**WS, "rs_row_turns": True})
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    assert GemmConfig.from_dict(WS).rs_row_turns is False  # older tables
    for bad in (MERGED, {"rs_copy_engine": True}, {"stream_k": 1}, {"rs_warp_specialized": False}):
        with pytest.raises(ValueError, match="rs_row_turns"):
            GemmConfig(**{**WS, **bad, "rs_row_turns": True})
    assert rs_signal_count(2) == 4 and rs_signal_count(4, row_turns=True) == 6 + 4 * ROW_GROUPS
    rows = cfg.block_m * cfg.group_m
    assert gemm_rs_ws.shape_reason(ROW_GROUPS * rows, 4096, cfg) is None
    assert "row groups" in gemm_rs_ws.shape_reason(ROW_GROUPS * rows + cfg.block_m, 4096, cfg)
    assert gemm_rs_ws.shape_reason(ROW_GROUPS * rows + cfg.block_m, 4096,
                                   GemmConfig(**WS)) is None


def test_merged_rows_take_any_row_count_but_one(monkeypatch):
    if gemm_rs_ws.gemm_rs_ws_kernel is None:
        pytest.skip(gemm_rs_ws.GLUON_ERROR)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _reason(m_local=300, **MERGED) is None   # tiles span segments
    assert _reason(m_local=40, **MERGED) is None
    assert "1 row per rank" in _reason(m_local=1, **MERGED)
    assert "fewer than num_stages=5" in _reason(m_local=40, k=256, **MERGED)


def test_num_warps_picks_the_form_and_its_launch():
    """4 warps: two MMA partitions (ping-pong), each with an epilogue tile; 8: one cooperative
    partition of two warpgroups and one epilogue tile. Both launch 12 warps once Triton pads
    the CTA to whole warpgroups, so both take the same register cap."""
    pingpong = GemmConfig(**WS)
    coop = GemmConfig(**{**WS, "num_warps": 8, "block_n": 256, "num_stages": 3})
    assert gluon_ws.mma_partitions(pingpong) == 2 and gluon_ws.mma_partitions(coop) == 1
    assert gluon_ws.launch_options(pingpong) == dict(num_warps=4, maxnreg=gluon_ws.MAXNREG)
    assert gluon_ws.launch_options(coop) == dict(num_warps=8, maxnreg=gluon_ws.MAXNREG)
    assert gluon_ws.MAXNREG * 12 * 32 <= 65536 and gluon_ws.MAXNREG % 8 == 0
    # 3 stages of 128x256x64 plus one 128x256 epilogue tile fit; 4 stages do not
    assert gemm_rs_ws.smem_bytes(coop) == 3 * 384 * 64 * 2 + 128 * 256 * 2 + 1024 <= gluon_ws.SMEM_LIMIT
    assert gemm_rs_ws.smem_bytes(GemmConfig(**{**WS, "num_warps": 8, "block_n": 256})) > gluon_ws.SMEM_LIMIT


def _reason(m_local=512, k=4096, dtype=torch.bfloat16, **cfg_fields):
    a = torch.empty(2 * m_local, k, dtype=dtype)
    return gemm_rs_ws.unsupported_reason(a, m_local, GemmConfig(**{**WS, **cfg_fields}))


def test_unsupported_reasons_name_the_shape(monkeypatch):
    if gemm_rs_ws.gemm_rs_ws_kernel is None:
        pytest.skip(gemm_rs_ws.GLUON_ERROR)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _reason() is None
    assert _reason(dtype=torch.float16) is None
    assert "multiple of block_m=128" in _reason(m_local=300)
    assert "fewer than num_stages=5" in _reason(k=256)          # 4 K-steps of 64
    assert _reason(k=320) is None                               # 5 K-steps
    assert "float32" in _reason(dtype=torch.float32)
    a = torch.empty(1024, 4096, dtype=torch.bfloat16)
    assert "phase traces" in gemm_rs_ws.unsupported_reason(a, 512, GemmConfig(**WS),
                                                           trace=torch.empty(1))
    assert "phase traces" in gemm_rs_ws.unsupported_reason(a, 512, GemmConfig(**WS), consume=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in _reason()


def test_shared_memory_bound_matches_the_launch_rule():
    # 5 stages of 128x128x64 and two epilogue tiles fit Hopper (the compiled kernel: 229 760 B)
    assert gemm_rs_ws.smem_bytes(GemmConfig(**WS)) <= gluon_ws.SMEM_LIMIT
    big = GemmConfig(**{**WS, "num_stages": 6})
    assert gemm_rs_ws.smem_bytes(big) > gluon_ws.SMEM_LIMIT
    if gemm_rs_ws.gemm_rs_ws_kernel is not None and "TRITON_INTERPRET" not in __import__("os").environ:
        assert "shared memory" in _reason(num_stages=6)


def test_fallback_warns_once_per_reason():
    gemm_rs_ws.warn_fallback.seen.discard("a test reason")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gemm_rs_ws.warn_fallback("a test reason")
        gemm_rs_ws.warn_fallback("a test reason")
    assert len(caught) == 1 and "runs the Triton kernel instead (a test reason)" in str(caught[0].message)


AG_WS = dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, epilogue_split=1,
             chunk_rows=1024, ag_warp_specialized=True)


@pytest.mark.parametrize("fields, match", [
    (dict(block_n=256), "at most 128x128"),
    (dict(num_warps=8, block_m=64), "block_m=128"),
    (dict(ag_merge_local=True), "per-segment schedule"),
    (dict(ag_warp_specialized="yes"), "must be a bool"),
])
def test_ag_warp_specialized_refuses_what_the_kernel_does_not_do(fields, match):
    with pytest.raises(ValueError, match=match):
        GemmConfig(**{**AG_WS, **fields})


def test_ag_warp_specialized_round_trips_and_takes_stream_k_flags():
    assert GemmConfig().ag_warp_specialized is False
    cfg = GemmConfig(**{**AG_WS, "stream_k": 1})  # stream-K is ignored
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg


def test_ag_unsupported_reasons_name_the_shape(monkeypatch):
    if ag_gemm_ws.ag_gemm_ws_kernel is None:
        pytest.skip(ag_gemm_ws.GLUON_ERROR)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def reason(m_local=512, k=4096, dtype=torch.bfloat16, **fields):
        return ag_gemm_ws.unsupported_reason(torch.empty(m_local, k, dtype=dtype),
                                             GemmConfig(**{**AG_WS, **fields}))

    assert reason() is None and reason(dtype=torch.float16) is None
    assert "multiple of block_m=128" in reason(m_local=40)
    assert "fewer than num_stages=5" in reason(k=256)
    assert "shared memory" in reason(num_stages=6)
    assert "phase traces" in ag_gemm_ws.unsupported_reason(torch.empty(512, 4096, dtype=torch.bfloat16),
                                                           GemmConfig(**AG_WS), trace=torch.empty(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in reason()


def test_launch_geometry_counts_row_tiles_over_every_ranks_rows():
    """One program per output tile at most: per segment that is ``world * m_local / block_m``
    row tiles, and for a tile space over every rank's rows (merged GEMM+RS rows, 2 ranks of
    40 rows, 64-row tiles) two row tiles over the 80 rows, where the per-segment count gives
    none."""
    b = torch.empty(384, 640).t()  # a transposed [N, K]: N = 384, three 128-column tiles
    cfg = GemmConfig(**{**WS, "block_m": 64})
    assert gluon_ws.launch_geometry(b, 512, 2, cfg, 132)[3] == 2 * 8 * 3
    assert gluon_ws.launch_geometry(b, 512, 2, cfg, 20)[3] == 20  # capped at the SMs
    assert gluon_ws.launch_geometry(b, 40, 2, GemmConfig(**{**cfg.to_dict(), **MERGED}), 132)[3] == 2 * 3


@pytest.mark.skipif(gluon_ws.GLUON_ERROR is not None, reason="this Triton has no Gluon")
def test_host_descriptors_carry_the_layouts_of_the_kernels_buffers():
    """A Gluon host descriptor's layout is the one the kernels give the same box
    (``NVMMASharedLayout.get_default_for``), per dtype and box, also when it comes from the
    cache; the Gluon launchers build A, B, output and slot descriptors of the kernels' views."""
    from triton.experimental.gluon import language as gl

    for dtype, gdtype in ((torch.bfloat16, gl.bfloat16), (torch.float16, gl.float16)):
        t = torch.empty(512, 256, dtype=dtype)
        for block in ([128, 64], [64, 128], [128, 256], [128, 32]):  # last: a 64-byte swizzle
            for _ in range(2):  # computed, then cached
                d = gluon_ws.host_descriptor(t, [512, 256], [256, 1], block)
                assert d.layout == gl.NVMMASharedLayout.get_default_for(block, gdtype)
                assert list(d.block_shape) == block and d.base is t
    cfg = GemmConfig(128, 128, 64, 5, 4, 8, epilogue_split=1, rs_warp_specialized=True)
    a, out = torch.empty(2 * 256, 512, dtype=torch.bfloat16), torch.empty(256, 384, dtype=torch.bfloat16)
    w, data = torch.empty(384, 512, dtype=torch.bfloat16), torch.empty(2, 256, 384, dtype=torch.bfloat16)
    descs = gemm_rs_ws._host_descriptors(a, w.t(), out, data, 2, 256, 384, 512, 512, False, cfg)
    assert [list(d.shape) for d in descs] == [[512, 512], [384, 512], [256, 384], [512, 384]]
    assert [list(d.block_shape) for d in descs] == [[128, 64], [128, 64], [128, 128], [128, 128]]
    x, ag, c = a[:256], a, torch.empty(512, 384, dtype=torch.bfloat16)
    descs = ag_gemm_ws._host_descriptors(x, ag, w.t().contiguous(), c, 2, 256, 384, 512, 384,
                                         True, cfg)
    assert [list(d.shape) for d in descs] == [[256, 512], [512, 512], [512, 384], [512, 384]]
    assert list(descs[2].block_shape) == [64, 128]  # B as [K, N]: boxes [BK, BN]


def test_split_tail_plan_cuts_only_a_partial_last_wave_of_own_tiles():
    """``stream_k=1`` on the warp-specialized GEMM+RS: the partial last wave's tiles (inside the
    own segment) are cut into equal K-parts, one unit per program at most, each of at least
    ``num_stages`` K-steps, at most ``MAX_TAIL_SPLIT``; no full wave before it, no tail, a tail
    over half the grid (as shipped, ``MAX_TAIL_UNITS = 1``) or longer than the own segment, too
    short a K, or too small a saving of the launch's waves: no split."""
    import itertools

    plan = split_tail.split_tail_plan
    cfg = GemmConfig(**WS, stream_k=1)
    # gemma2-27b's fc2 at TP 4, m = 1024 (per-rank K 18432): 288 tiles, 24 in the last wave
    assert plan(4, 256, 4608, 18432, cfg, 132) == (24, 5)
    assert plan(4, 256, 5120, 13696, cfg, 132) == (56, 2)  # qwen1.5-32b: 320 tiles
    assert plan(4, 256, 4096, 18432, cfg, 132) == (0, 1)   # 256 tiles: 124 left, over 64 own
    assert split_tail.MAX_TAIL_UNITS == 1
    assert plan(2, 512, 5376, 10752, cfg, 132) == (0, 1)  # gemma3-27b: 336 tiles, 72 left
    assert plan(4, 256, 4608, 18432, cfg, 288) == (0, 1)   # one whole wave: no tail
    assert plan(2, 128, 1024, 18432, cfg, 132) == (0, 1)   # 16 tiles: no full wave
    assert plan(4, 256, 4608, 4 * 64, cfg, 132) == (0, 1)  # 4 K-steps: no part of 5 stages
    assert plan(8, 128, 1280, 18432, cfg, 66) == (0, 1)  # a tail of 14 over a segment of 10
    # stream_k off, or merged rows (no segments): no split wherever the shape would have one
    assert plan(4, 256, 4608, 18432, dataclasses.replace(cfg, stream_k=0), 132) == (0, 1)
    merged = dataclasses.replace(cfg, rs_merge_rows=True, rs_spread_reduce=True, rs_tma_push=False)
    assert plan(4, 256, 4608, 18432, merged, 132) == (0, 1)
    # many waves: a split must save MIN_SPLIT_GAIN of them (1 - SPLIT_PART_COST / parts)
    assert plan(2, 1024, 14848, 29696, cfg, 132) == (8, 8)  # 15 waves: 0.85 >= 0.6
    assert plan(2, 4096, 4544, 9088, cfg, 132) == (0, 1)    # 18 waves: 0.4 < 0.72
    assert plan(2, 4096, 7168, 14336, cfg, 132) == (0, 1)   # 28 waves, 6 parts: 0.8 < 1.12
    for world, rows, n, k, grid in itertools.product((2, 4, 8), (128, 256, 512, 1024),
                                                     (1024, 3840, 4608, 5376, 7168), (1024, 8192),
                                                     (66, 132)):
        tail, parts = plan(world, rows, n, k, cfg, grid)
        per_segment = -(-rows // 128) * -(-n // 128)
        if parts == 1:
            assert tail == 0
            continue
        assert tail == (world * per_segment) % grid and world * per_segment > grid
        assert 2 <= parts <= split_tail.MAX_TAIL_SPLIT
        assert tail <= per_segment and (k // 64) // parts >= cfg.num_stages
        assert tail * parts <= grid  # one unit per program
        assert 1 - split_tail.SPLIT_PART_COST / parts >= \
            split_tail.MIN_SPLIT_GAIN * -(-world * per_segment // grid)


@pytest.mark.parametrize("units", [2, 4, 8])
def test_split_tail_plan_over_half_the_grid_with_several_units_a_program(units, monkeypatch):
    """With ``MAX_TAIL_UNITS`` raised (the kernel runs several units a program; the plan ships
    with one), a tail over half the grid is cut into the parts count whose units, dealt over
    the programs, leave each the least work, the fewest parts of equals, never more units a
    program than its scratch slots hold (``SCRATCH_UNITS``, also when asked for eight); a tail
    up to half the grid is planned as before."""
    import itertools

    monkeypatch.setattr(split_tail, "MAX_TAIL_UNITS", units)
    units = min(units, split_tail.SCRATCH_UNITS)
    plan = split_tail.split_tail_plan
    cfg = GemmConfig(**WS, stream_k=1)
    # gemma3-27b's fc2 at TP 2, m = 1024 (336 tiles, 72 left): 3 parts (216 units, two a
    # program: 2/3 of a tile), with four a program 7 parts (504 units: 4/7); qwen2.5-7b's
    # (224, 92): 2 or 3 parts leave a whole tile a program, 4 parts need three units
    assert plan(2, 512, 5376, 10752, cfg, 132) == ((72, 3) if units == 2 else (72, 7))
    assert plan(2, 512, 3584, 9472, cfg, 132) == ((0, 1) if units == 2 else (92, 4))
    assert plan(4, 256, 4608, 18432, cfg, 132) == (24, 5)  # a short tail: as before
    seen = 0
    for world, rows, n, k, grid in itertools.product((2, 4, 8), (128, 256, 512, 1024),
                                                     (1024, 3840, 4608, 5376, 7168), (1024, 8192),
                                                     (66, 132)):
        tail, parts = plan(world, rows, n, k, cfg, grid)
        if parts == 1:
            continue
        if 2 * tail <= grid:  # as with one unit a program
            assert tail * parts <= grid
            continue
        seen += 1
        most = min((k // 64) // cfg.num_stages, split_tail.MAX_TAIL_SPLIT)
        per_program = -(-tail * parts // grid)  # the most units a program runs, counted here
        assert 2 <= parts <= most and per_program <= units
        for q in range(2, most + 1):  # no other fitting count leaves less work a program
            if -(-tail * q // grid) <= units:
                assert (per_program / parts, parts) <= (-(-tail * q // grid) / q, q)
        waves = -(-world * -(-rows // 128) * -(-n // 128) // grid)
        assert 1 - per_program * split_tail.SPLIT_PART_COST / parts >= \
            split_tail.MIN_SPLIT_GAIN * waves
    assert seen


def test_split_tail_parts_run_first_at_tp2_and_below_two_waves():
    """``split_tail_first``: the split parts run as their programs' first work item at TP 2
    and, at any TP, below two waves of tiles; at TP 4 and 8 from two waves on they run last
    (there, first ran slower on six of nine shapes measured)."""
    first = split_tail.split_tail_first
    cfg = GemmConfig(**WS, stream_k=1)
    assert first(2, 512, 2304, cfg, 132)        # minicpm-2b, m = 1024: 144 tiles
    assert first(2, 1024, 2304, cfg, 132)       # m = 2048: 288 tiles, 2.2 waves
    assert first(4, 256, 2304, cfg, 132)        # TP 4, 144 tiles: 1.09 waves
    assert not first(4, 512, 2304, cfg, 132)    # TP 4, 288 tiles
    assert not first(4, 256, 5120, cfg, 132)    # qwen1.5-32b, TP 4, m = 1024: 320 tiles
    assert first(4, 256, 4096, cfg, 132) and not first(4, 256, 4224, cfg, 132)  # 256, 264 tiles
    assert not first(8, 256, 2304, cfg, 132)    # 288 tiles at TP 8
    assert first(8, 128, 2304, cfg, 132)        # 144


@pytest.mark.parametrize("form", ["pingpong", "coop"])
def test_split_tail_sum_chunks_give_each_part_at_most_one_where_they_can(form):
    """``tail_sum_rows``: the rows per chunk of a split tile's sum are a power of two that
    divides the tile, within the sum layout's rows (16 ping-pong, 32 cooperative) and 64, and
    the smallest such that each part's program sums at most one chunk (a chunk costs its
    program a load latency whatever its size; smaller chunks keep registers free)."""
    tiles = {"pingpong": [(128, 128, 4), (64, 128, 4)], "coop": [(128, 256, 8)]}[form]
    for block_m, block_n, warps in tiles:
        cfg = GemmConfig(block_m=block_m, block_n=block_n, block_k=64, num_stages=3,
                         num_warps=warps, group_m=8, epilogue_split=1, rs_warp_specialized=True,
                         stream_k=1)
        least = 16 if warps == 4 else 32
        for parts in range(2, split_tail.MAX_TAIL_SPLIT + 1):
            rows = split_tail.tail_sum_rows(cfg, parts)
            assert rows & (rows - 1) == 0 and block_m % rows == 0, (block_m, parts, rows)
            assert least <= rows <= 64
            chunks = block_m // rows
            if rows < min(64, block_m):  # not held down by the register bound: one chunk each
                assert chunks <= parts, (block_m, parts, rows)
            if rows > least:  # and no smaller: half the rows would leave some part two chunks
                assert block_m // (rows // 2) > parts, (block_m, parts, rows)
    assert split_tail.tail_sum_rows(GemmConfig(**WS, stream_k=1), 8) == 16
    assert split_tail.tail_sum_rows(GemmConfig(**WS, stream_k=1), 2) == 64
