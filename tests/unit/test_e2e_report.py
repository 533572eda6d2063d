"""benchmarks/e2e_report.py: log parsing, step-time medians and the loss-parity bounds."""

import json
import subprocess

import pytest

import e2e_report as R
from helpers.paths import REPO

LINE = (" [2026-11-22 06:53:30.472809] iteration {it:8d}/{n:8d} | consumed samples: {s:12d} | "
        "elapsed time per iteration (ms): {t:.1f} | throughput per GPU (TFLOP/s/GPU): 300.0 | "
        "learning rate: 1.000000E-04 | global batch size:     2 | lm loss: {loss:.6E} | "
        "loss scale: 1.0 | grad norm: 1.000 | number of skipped iterations:   0 |\n")


def write_log(path, losses, times):
    with open(path, "w") as f:
        f.write("> building train, validation, and test datasets for GPT ...\n")
        for i, (loss, t) in enumerate(zip(losses, times), 1):
            f.write(LINE.format(it=i, n=len(losses), s=2 * i, t=t, loss=loss))
    return str(path)


def curve(n=120, offset=0.0, spike_at=None, spike=0.0):
    out = [max(0.05, 12.0 * 0.93 ** i) + offset for i in range(n)]
    if spike_at is not None:
        out[spike_at] += spike
    return out


def run(tmp_path, logs, *extra):
    out = tmp_path / "e2e.json"
    argv = [f"--log={k}={v}" for k, v in logs.items()]
    argv += ["--tokens-per-step", "8192", "--warmup", "10", "--command", "test", "--model", "m",
             "--out", str(out), *extra]
    rc = R.main(argv)
    return rc, json.loads(out.read_text())


def test_parse_log_reads_loss_time_and_throughput(tmp_path):
    p = write_log(tmp_path / "a.log", [10.0, 9.5], [500.0, 300.0])
    rows = R.parse_log(p)
    assert rows == {1: (10.0, 500.0, 300.0), 2: (9.5, 300.0, 300.0)}


def test_step_time_median_after_warmup_and_tokens_per_s(tmp_path):
    n = 60
    logs = {name: write_log(tmp_path / f"{name}.log", curve(n), [1000.0] * 10 + [t] * (n - 10))
            for name, t in (("stock", 400.0), ("nccl", 380.0), ("flux", 320.0))}
    rc, d = run(tmp_path, logs)
    assert rc == 0 and d["steps"] == n and d["failed_runs"] == []
    assert d["step_time_ms"] == {"stock": 400.0, "nccl": 380.0, "flux": 320.0}
    assert d["tokens_per_s"]["flux"] == pytest.approx(8192 / 0.32)
    assert d["speedup_vs_stock"]["flux"] == pytest.approx(1.25)


def test_parity_passes_at_noise_level_and_fails_for_a_wrong_kernel(tmp_path):
    n = 120
    base = curve(n)
    stock = [x + (0.0005 if i < 40 else 0.01) * (-1) ** i for i, x in enumerate(base)]
    close = [x + (0.0008 if i < 40 else 0.012) * (-1) ** (i + 1) for i, x in enumerate(base)]
    logs = {"stock": write_log(tmp_path / "s.log", stock, [300.0] * n),
            "nccl": write_log(tmp_path / "n.log", base, [300.0] * n),
            "flux": write_log(tmp_path / "f.log", close, [300.0] * n)}
    _, d = run(tmp_path, logs)
    p = d["loss_parity"]["flux"]
    assert p["within_bound"] is True and p["early_max_abs_diff"] <= 0.01
    assert d["loss_parity"]["stock"]["within_early_bound"] is True
    # a wrong kernel: off by a tenth of a nat from the first step
    logs["flux"] = write_log(tmp_path / "bad.log", [x + 0.1 for x in base], [300.0] * n)
    _, d = run(tmp_path, logs)
    assert d["loss_parity"]["flux"]["within_bound"] is False
    # off by 0.05 nats for the first steps only, then at noise: the early bound catches it
    early_off = [x + (0.05 if i < 10 else 0.0008 if i < 40 else 0.012) * (-1) ** (i + 1)
                 for i, x in enumerate(base)]
    logs["flux"] = write_log(tmp_path / "early.log", early_off, [300.0] * n)
    _, d = run(tmp_path, logs)
    p = d["loss_parity"]["flux"]
    assert p["mean_abs_diff"] <= 2 * p["noise_floor_mean_abs_diff"]  # the means alone pass
    assert p["within_bound"] is False
    # noise-level early, but drifting far more than stock later: fails the noise-floor bound
    drift = [x + (0.0008 if i < 40 else 0.2) for i, x in enumerate(base)]
    logs["flux"] = write_log(tmp_path / "drift.log", drift, [300.0] * n)
    _, d = run(tmp_path, logs)
    assert d["loss_parity"]["flux"]["early_max_abs_diff"] <= 0.01
    assert d["loss_parity"]["flux"]["within_bound"] is False


def test_parity_against_stock_uses_two_stock_runs_as_the_noise_floor(tmp_path):
    """With a second stock run every run is also compared with stock, the two stock runs'
    difference being the floor: noise-level runs pass, a drifting one fails."""
    n = 120
    base = curve(n)
    stock2 = [x + (0.0005 if i < 40 else 0.01) * (-1) ** i for i, x in enumerate(base)]
    close = [x + (0.0008 if i < 40 else 0.012) * (-1) ** (i + 1) for i, x in enumerate(base)]
    drift = [x + (0.0008 if i < 40 else 0.2) for i, x in enumerate(base)]
    logs = {"stock": write_log(tmp_path / "s.log", base, [300.0] * n),
            "stock2": write_log(tmp_path / "s2.log", stock2, [300.0] * n),
            "flux": write_log(tmp_path / "f.log", close, [300.0] * n),
            "auto": write_log(tmp_path / "a.log", drift, [300.0] * n)}
    _, d = run(tmp_path, logs)
    block = d["loss_parity_vs_stock"]
    assert block["reference"] == "stock" and "stock2" in block["noise_floor"]
    assert block["stock2"]["within_early_bound"] is True
    assert block["flux"]["within_bound"] is True
    assert block["flux"]["noise_floor_mean_abs_diff"] == pytest.approx(
        sum(abs(a - b) for a, b in zip(base, stock2)) / n, rel=1e-4)
    assert block["auto"]["within_bound"] is False
    del logs["stock2"]
    _, d = run(tmp_path, logs)
    assert "loss_parity_vs_stock" not in d


def test_hidden_communication_fraction(tmp_path):
    n = 30
    comm = tmp_path / "comm.json"
    comm.write_text(json.dumps({"tp_comm_ms_per_step": 40.0}))
    logs = {name: write_log(tmp_path / f"{name}.log", curve(n), [t] * n)
            for name, t in (("stock", 330.0), ("nccl", 340.0), ("flux", 310.0))}
    _, d = run(tmp_path, logs, "--comm", str(comm))
    assert d["tp_comm_hidden_fraction"] == {"flux_vs_plugin_nccl": pytest.approx(0.75),
                                            "flux_vs_stock": pytest.approx(0.5)}


def test_a_failed_run_is_reported_and_exits_non_zero(tmp_path):
    empty = tmp_path / "flux.log"
    empty.write_text("Traceback (most recent call last):\n")
    logs = {"nccl": write_log(tmp_path / "n.log", curve(20), [300.0] * 20), "flux": str(empty)}
    rc, d = run(tmp_path, logs)
    assert rc == 1 and d["failed_runs"] == ["flux"]


def test_the_committed_e2e_result_passes_its_own_bound():
    d = json.loads((REPO / "benchmarks/results/e2e-h200x2-2026-11-22.json").read_text())
    assert d["steps"] >= 200 and set(d["loss"]) == {"stock", "nccl", "flux"}
    assert all(len(v) == d["steps"] for v in d["loss"].values())
    assert d["loss_parity"]["flux"]["within_bound"] is True
    for key in ("command", "gpu", "tp", "model", "step_time_ms", "tokens_per_s"):
        assert key in d


def test_gpu_utilization_counts_only_the_timed_iterations(tmp_path):
    """Samples before the first timed iteration (start-up, warm-up) and after the last are
    left out; the median is per GPU."""
    import datetime

    log = tmp_path / "flux.log"
    t0 = datetime.datetime(2026, 11, 22, 6, 53, 30)
    with open(log, "w") as f:
        for i in range(1, 31):  # one iteration per second
            stamp = (t0 + datetime.timedelta(seconds=i)).strftime("%Y-%m-%d %H:%M:%S.%f")
            f.write(LINE.replace("2026-11-22 06:53:30.472809", stamp)
                    .format(it=i, n=30, s=2 * i, t=300.0, loss=5.0))
    util = tmp_path / "flux.util.csv"
    with open(util, "w") as f:
        for sec in range(0, 40):
            stamp = (t0 + datetime.timedelta(seconds=sec, milliseconds=500)).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
            busy = 0 if sec < 11 or sec >= 30 else (90 if sec % 2 else 70)  # idle outside 11..30
            for gpu in (0, 1):
                f.write(f"{stamp}, {gpu}, {busy + gpu}\n")
    _, out = run(tmp_path, {"flux": str(log)}, f"--util=flux={util}")
    u = out["gpu_utilization"]["flux"]
    assert u["samples"] == {"0": 19, "1": 19}  # iterations 11..30 span seconds 11.0-30.0
    assert u["median_pct"] == {"0": 90.0, "1": 91.0}
