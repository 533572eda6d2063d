"""The tuner's whole run on two CPU ranks: everything but the fused kernels.

``megatron-flux tune`` needs GPUs for what it measures, but most of what it does is
orchestration: the plan, the broadcast of what the table already holds, each entry's check,
screen and final timing with collectives between ranks, rank 0's table write after every entry,
and the agreement that stops every rank when one fails. Here that runs for real on a gloo group
of two processes, with the fused backend replaced by the NCCL one (candidate configs then time
alike) and the GPU's identity given, so a fault on that path fails on the CPU instead of on the
device (a name error in rank 0's table writer once left the other ranks waiting there).
"""

import json
import os

import pytest
import torch

from megatron_flux.tuning import schema

from helpers.dist_harness import run_distributed

SHAPES = ["ag:128:64", "rs:64:128"]
ARGV = ["--shapes", *SHAPES, "--ms", "64", "--max-candidates", "2", "--top", "1", "--screen-iters", "1",
        "--trials", "1", "--iters", "1", "--warmup", "1", "--sample-warmup", "0", "--no-progress"]


def _tune_on_cpu(rank, world, out, fail_write_on_rank=None, extra=(), challenger_ms=None,
                 timeout_on_rank=None, watch=None):
    import torch.distributed as dist

    import megatron_flux.backends as backends
    import megatron_flux.backends.flux as flux_pkg
    import megatron_flux.tuning.device as device_mod
    import megatron_flux.tuning.schema as schema_mod
    from megatron_flux.backends.nccl import NcclBackend
    from megatron_flux.tools.tune import search

    class CpuFlux(NcclBackend):
        """The tuner's fused backend, as the NCCL one: every candidate config computes alike."""

        def __init__(self, config_provider=None, *, options=None):
            super().__init__()
            self.config_provider = config_provider
            # the tuner waits longer than training: a peer may still be compiling a candidate
            assert options.max_spins == search.TUNE_MAX_SPINS

        def clear_config_cache(self):
            pass

        checks = 0

        def check_errors(self, sync=True):
            # the second candidate's wait times out on ``timeout_on_rank`` alone
            CpuFlux.checks += 1
            if rank == timeout_on_rank and CpuFlux.checks == 2:
                from megatron_flux.comm.errors import FusedOpTimeout
                raise FusedOpTimeout("megatron-flux AG+GEMM: rank 1 timed out waiting for signal 0")

    backends.available_backends = lambda: ["nccl", "flux", "auto"]
    flux_pkg.FluxBackend = CpuFlux
    if challenger_ms is not None:
        _time_by_config(CpuFlux, search, challenger_ms)
    device_mod.device_identity = lambda device: ("h200", 132, "NVIDIA H200")
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    if fail_write_on_rank == rank:
        def broken_write(table, path):
            raise OSError(f"disk full writing {path}")
        schema_mod.write_table = broken_write
    if watch is not None:  # record what the stall watchdog is told
        import megatron_flux.tools.tune.watchdog as watchdog_mod

        class Recording(watchdog_mod.ProgressWatchdog):
            def watching(self, what):
                watch.setdefault("entries", []).append(what)
                return super().watching(what)

            def progress(self):
                watch["progress"] = watch.get("progress", 0) + 1
                super().progress()

        watchdog_mod.ProgressWatchdog = Recording
    argv = [*ARGV, *extra, "--out", out]
    args = search.parse_args(argv)
    try:
        code = search._run(args, argv, dist.group.WORLD, rank, world, torch.device("cpu"))
    except search.TuneFailed as exc:
        return f"TuneFailed: {exc}"
    return code if watch is None else (code, watch)


#: the config the tables give each shape untuned, in :func:`_time_by_config`'s runs
INCUMBENT = {"block_m": 64, "block_n": 64, "block_k": 32, "num_stages": 2}


def _time_by_config(cpu_flux, search, challenger_ms):
    """Make every fused call record the config it ran, give each shape an untuned config of
    its own (:data:`INCUMBENT`), and replace the timing by fixed times per config: the untuned
    config 1.000 ms, the default 1.006 ms, any other ``challenger_ms``, NCCL 2 ms."""
    import dataclasses

    from megatron_flux.kernels.config import default_config
    from megatron_flux.tools.bench import timing

    ran = []

    class Recording(cpu_flux):
        def all_gather_matmul(self, a, b, group, **kw):
            ran.append(self.config_provider("ag", 0, 0, 0))
            return super().all_gather_matmul(a, b, group, **kw)

        def matmul_reduce_scatter(self, a, b, group, **kw):
            ran.append(self.config_provider("rs", 0, 0, 0))
            return super().matmul_reduce_scatter(a, b, group, **kw)

    import megatron_flux.backends.flux as flux_pkg
    flux_pkg.FluxBackend = Recording
    fixed = {}  # config -> ms: each shape's untuned config and its default

    def untuned_config(op, m, n, k, dtype, tp, identity):
        default = default_config(op, m, n, k, tp=tp)
        untuned = dataclasses.replace(default, **INCUMBENT)
        fixed.update({default: 1.006, untuned: 1.0})
        return search.Incumbent(untuned, "a test table")

    def time_interleaved(fns, *, trials, **kw):
        result = timing.TimingResult()
        for name, fn in fns.items():
            ran.clear()
            fn()
            result.trials_ms[name] = [2.0 if name == "nccl" else fixed.get(ran[-1], challenger_ms)] * trials
        return result

    search.untuned_config = untuned_config
    timing.time_interleaved = time_interleaved


@pytest.mark.slow
@pytest.mark.parametrize("challenger_ms, winner", [(0.992, "untuned"), (0.985, "challenger")])
def test_a_tuned_config_must_beat_what_the_shape_ran_untuned(tmp_path, challenger_ms, winner):
    """The finalist to beat is the config the tables gave the shape before the tune, not the
    default: a challenger 0.8 % faster than it (1.4 % faster than the default) does not replace
    it, one 1.5 % faster does."""
    import dataclasses

    from megatron_flux.kernels.config import default_config

    out = str(tmp_path / "table.json")
    assert run_distributed(_tune_on_cpu, 2, out, challenger_ms=challenger_ms, timeout=180,
                           extra=("--max-candidates", "4")) == [0, 0]
    table = schema.validate_table(json.load(open(out)), out)
    assert len(table.entries) == 2
    for e in table.entries:
        untuned = dataclasses.replace(default_config(e.op, e.m, e.n, e.k, tp=2), **INCUMBENT)
        assert (e.config == untuned) == (winner == "untuned"), (e.op, e.config)
        assert e.flux_ms == (1.0 if winner == "untuned" else challenger_ms)
        assert e.notes["untuned_ms"] == 1.0 and e.notes["untuned_from"] == "a test table"
        assert e.notes["kept_untuned"] == (winner == "untuned") and not e.notes["kept_default"]


@pytest.mark.slow
def test_a_tune_runs_on_two_ranks_and_writes_a_valid_table(tmp_path):
    out = str(tmp_path / "table.json")
    assert run_distributed(_tune_on_cpu, 2, out, timeout=180) == [0, 0]
    with open(out) as f:
        obj = json.load(f)
    table = schema.validate_table(obj, out)
    assert table.tp == 2 and table.gpu_name == "NVIDIA H200" and table.sms == 132
    assert sorted((e.op, e.n, e.k, e.m) for e in table.entries) == [("ag", 128, 64, 64), ("rs", 64, 128, 64)]
    assert all(e.tuned and e.flux_ms > 0 and e.nccl_ms > 0 for e in table.entries)
    assert table.source == "megatron-flux tune " + " ".join([*ARGV, "--out", out])
    # a second run with --skip-tuned finds both entries and tunes nothing: the file stays as it was
    before = open(out).read()
    assert run_distributed(_tune_on_cpu, 2, out, extra=("--skip-tuned",), timeout=180) == [0, 0]
    assert open(out).read() == before


@pytest.mark.slow
def test_a_failure_on_rank_0_alone_stops_both_ranks_after_that_entry(tmp_path):
    out = str(tmp_path / "table.json")
    results = run_distributed(_tune_on_cpu, 2, out, fail_write_on_rank=0, timeout=180)
    assert results[0].startswith("TuneFailed: ag n=128 k=64 m=64: OSError: disk full")
    assert results[1] == "TuneFailed: ag n=128 k=64 m=64: failed on another rank (its error is in that rank's output)"
    assert not os.path.exists(out)


@pytest.mark.slow
def test_a_wait_that_timed_out_on_one_rank_stops_every_rank_at_that_candidate(tmp_path):
    """A timed-out wait poisons that rank's fused kernels: continuing alone, a rank could enter
    a collective (a workspace's growth) the others never reach, which hung a tune on 2x H200.
    Every rank learns of it right after the candidate and the tune stops, naming it."""
    out = str(tmp_path / "table.json")
    results = run_distributed(_tune_on_cpu, 2, out, timeout_on_rank=1, timeout=180)
    assert results[0] == results[1], results  # the same error, raised at the same point
    assert results[0].startswith("TuneFailed: ag n=128 k=64 m=64: RuntimeError: ag n=128 k=64 m=64: "
                                 "candidate 1 (GemmConfig("), results[0]
    assert "timed out waiting for a peer on some rank" in results[0]
    assert not os.path.exists(out)


def test_every_entry_runs_under_the_stall_watchdog_and_reports_progress(tmp_path):
    """Each entry is watched; each candidate's check and each timing phase count as progress
    (two candidates, the screen and the final per entry)."""
    out = str(tmp_path / "table.json")
    for code, watch in run_distributed(_tune_on_cpu, 2, out, watch={}, timeout=180):
        assert code == 0
        assert watch["entries"] == ["ag n=128 k=64 m=64", "rs n=64 k=128 m=64"]
        assert watch["progress"] >= 2 * 4
