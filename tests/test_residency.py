"""``GemmConfig.programs_per_sm`` and the residency rule the launchers apply to it (CPU)."""

import warnings

import pytest

from megatron_flux.kernels import residency
from megatron_flux.kernels.config import GemmConfig


@pytest.mark.parametrize("bad", [0, 5, True, 1.5, "2"])
def test_programs_per_sm_must_be_a_small_int(bad):
    with pytest.raises(ValueError, match="programs_per_sm"):
        GemmConfig(programs_per_sm=bad)


def test_programs_per_sm_round_trips_and_defaults_to_one():
    assert GemmConfig().programs_per_sm == 1
    cfg = GemmConfig(block_n=128, num_warps=4, programs_per_sm=2)
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    assert GemmConfig.from_dict({"block_m": 64}).programs_per_sm == 1  # tables written before it


PPS1, PPS2 = GemmConfig(programs_per_sm=1), GemmConfig(programs_per_sm=2)


class _Launcher:
    """Stands in for a KernelLauncher: ``plan`` gives ``grid``, occupancy answers ``fit``."""

    def __init__(self, grid, fit):
        self.grid, self.fit, self.asked = grid, fit, []

    def plan(self, per_sm):
        self.asked.append(per_sm)
        return self.grid, ("args",), {"NUM_SMS": self.grid}

    def occupancy(self, grid, args, constexprs, *, num_warps, num_stages):
        assert (grid, args, constexprs) == (self.grid, ("args",), {"NUM_SMS": self.grid})
        return self.fit


def _resident(cfg, launcher, op):
    return residency.resident_programs_per_sm(cfg, 132, launcher.plan, launcher, op)


def test_one_per_sm_is_never_checked():
    def fail(_):
        raise AssertionError("queried")

    assert residency.resident_programs_per_sm(PPS1, 132, fail, None, "op") == 1


def test_kept_when_the_whole_grid_fits():
    launcher = _Launcher(264, 2)
    assert _resident(PPS2, launcher, "op-fits") == 2
    assert launcher.asked == [2]


def test_a_grid_of_few_tiles_needs_no_second_slot():
    # 150 tiles on 132 SMs at 2 per SM: 150 programs, 132 x 1 slots do not hold them, 132 x 2 do
    assert _resident(PPS2, _Launcher(150, 2), "op-few") == 2
    assert _resident(PPS2, _Launcher(100, 1), "op-fewer") == 2


def test_falls_back_to_one_with_one_warning():
    cfg = PPS2
    residency._WARNED.discard(("op-big", cfg))
    with pytest.warns(UserWarning, match="programs_per_sm=2 asked for, but only 1"):
        assert _resident(cfg, _Launcher(264, 1), "op-big") == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is quiet
        assert _resident(cfg, _Launcher(264, 1), "op-big") == 1


def test_grid_follows_programs_per_sm():
    import torch

    from megatron_flux.kernels.config import launch_geometry

    cfg = GemmConfig(block_m=128, block_n=128, num_warps=4, programs_per_sm=2)
    b = torch.empty(4096, 1024).t()  # [K, N] view of an [N, K] weight
    geo = launch_geometry(4096, 4096, b, 2, cfg, 132 * 2)
    assert geo.grid == 264  # 2 x 32 x 32 tiles: enough for both slots of every SM
    assert launch_geometry(256, 1024, b, 2, cfg, 264).grid == 32  # capped at the tiles


def test_merged_tile_space_grid_has_no_idle_programs():
    """A tile space over every rank's rows (merged GEMM+RS rows, AG+GEMM's gathered rows) has
    fewer row tiles than ``world`` segments' own when ``m_local`` is not a multiple of
    ``block_m``: the grid is capped at its tiles, so no program sits without a tile (gpt3-175b
    GEMM+RS m = 64 at TP 2: 96 tiles of 64x128, not the 2 x 96 of two half-empty segments)."""
    import torch

    from megatron_flux.kernels.config import launch_geometry

    cfg = GemmConfig(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4)
    b = torch.empty(24576, 12288)  # [K, N]
    per_segment = launch_geometry(32, 12288, b, 2, cfg, 132)
    merged = launch_geometry(32, 12288, b, 2, cfg, 132, merged=True)
    assert (per_segment.tiles, per_segment.grid) == (192, 132)
    assert (merged.tiles, merged.grid) == (96, 96)
    assert merged.tiles_per_segment == per_segment.tiles_per_segment == 96
    # where m_local is a multiple of block_m both count the same
    assert launch_geometry(128, 12288, b, 4, cfg, 132, merged=True).tiles == 4 * 2 * 96
    # TP 4, 40 rows per rank: 160 rows are 3 row tiles, not 4 segments' 4
    assert launch_geometry(40, 1000, b, 4, cfg, 132, merged=True).tiles == 3 * 8
