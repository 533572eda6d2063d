"""`megatron-flux plan`: per TP GEMM of a model config, the table entry, auto's choice and why."""

import json
import os

import pytest

from megatron_flux.tools import cli
from megatron_flux.tools import plan as P
from megatron_flux.tuning import provider

from helpers import paths

REPO = str(paths.REPO)
LLAMA = os.path.join(REPO, "configs", "llama3_8b_16l.json")
LLAMA1_30B = os.path.join(REPO, "configs", "llama1_30b_4l.json")
H200 = ("NVIDIA H200", 132)


@pytest.fixture(autouse=True)
def _fresh_decisions():
    provider.clear_caches()
    yield
    provider.clear_caches()


def _rows(capsys, *argv):
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_at_tp2_on_h200_uses_the_table_where_it_has_the_shape(capsys):
    rows = _rows(capsys, "--model-config", LLAMA, "--tp", "2", "--gpu", "NVIDIA H200", "--sms", "132")
    assert [r["gemm"].split(":")[1] for r in rows] == [
        "qkv", "proj", "fc1", "fc2", "output", "qkv.dgrad", "proj.dgrad", "fc1.dgrad",
        "fc2.dgrad", "output.dgrad"]
    assert all(r["m"] == 4096 for r in rows)  # seq-length x micro-batch-size of the config
    # the shipped TP=2 table holds all ten (fc1 and its dgrad from the benchmark grid, the rest
    # from tunes of this very config)
    assert all("flux_ms" in r for r in rows)
    for r in rows:
        assert r["source"] == "table" and r["why"].startswith("table")
        assert (r["auto"] == "fused") == (r["flux_ms"] <= 0.98 * r["nccl_ms"])
        assert r["config_from"] == "table (m=4096)"
    # so does the TP 4 table (tuned at TP 4 from this config too)
    rows = _rows(capsys, "--model-config", LLAMA, "--tp", "4", "--gpu", "NVIDIA H200", "--sms", "132")
    assert len(rows) == 10 and all(r["source"] == "table" and "flux_ms" in r for r in rows)
    # a model no table was measured on: every GEMM estimated from the nearest entries, with the
    # nearest entry's kernel config
    rows = _rows(capsys, "--model-config", LLAMA1_30B, "--tp", "4", "--gpu", "NVIDIA H200", "--sms", "132")
    assert len(rows) == 10
    for r in rows:
        assert "flux_ms" not in r and r["source"] == "estimate"
        assert r["why"].startswith("estimate from ") and "nearest (" in r["why"]
        assert "nearest entry" in r["config_from"]  # its config, or a tile that fills waves better


def test_the_margin_and_unknown_gpus(capsys, monkeypatch):
    from megatron_flux.options import FluxOptions, set_options

    set_options(FluxOptions(auto_margin=0.5))
    try:
        rows = _rows(capsys, "--model-config", LLAMA, "--tp", "2", "--gpu", "NVIDIA H200", "--sms",
                     "132")
    finally:
        set_options(None)
    assert all(r["auto"] == "nccl" for r in rows if "flux_ms" in r)  # no entry wins by 50 %
    rows = _rows(capsys, "--model-config", LLAMA, "--tp", "2", "--gpu", "NVIDIA A100-SXM4-80GB", "--sms", "108",
                 "--m", "512")
    assert all("flux_ms" not in r and r["auto"] == "nccl" for r in rows)  # unknown GPU, m < 1024


def test_kernel_settings_come_from_the_table_entry():
    from megatron_flux.tuning.provider import lookup_entry

    rows = P.plan_rows(LLAMA, 4, 4096, H200, __import__("torch").bfloat16)
    fc1 = next(r for r in rows if r["gemm"].endswith(":fc1"))
    entry, _ = lookup_entry("ag", 4096, fc1["n"], fc1["k"], __import__("torch").bfloat16, 4, H200)
    assert fc1["config"] == entry.config.to_dict()


def test_bad_invocations_say_what_is_missing(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--model-config", LLAMA, "--tp", "2", "--gpu", "NVIDIA H200"])
    assert "--gpu and --sms go together" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            cli.main(["plan", "--model-config", LLAMA, "--tp", "2"])
        assert "--gpu NAME --sms N" in capsys.readouterr().err
    assert cli.main(["plan", "--model-config", LLAMA, "--tp", "3", "--gpu", "NVIDIA H200", "--sms", "132"]) == 2
    assert "not divisible by TP = 3" in capsys.readouterr().err


def test_the_kernel_column_names_form_tile_and_split_tail(capsys):
    """The text output's kernel column: the form and tile of the row's config, copy-engine
    pushes, and the tail its launcher splits on that shape, worked out here by hand."""
    import torch

    from megatron_flux.kernels.config import GemmConfig

    rows = P.plan_rows(LLAMA1_30B, 2, 2048, H200, torch.bfloat16)
    proj = next(r for r in rows if r["gemm"].endswith(":proj"))
    cfg = proj["config"]
    assert (cfg["rs_warp_specialized"], cfg["num_warps"], cfg["block_m"], cfg["block_n"],
            cfg["stream_k"], cfg["rs_copy_engine"]) == (True, 4, 128, 128, 1, True)
    # 1024 rows a rank in 8 row tiles, n = 6656 in 52: 2 x 8 x 52 = 832 tiles on 132 SMs, 40
    # left (under half the grid): 132 // 40 = 3 parts, each 52 // 3 >= 5 stages of K; TP 2: first
    assert proj["kernel"] == "ping-pong 128x128, ce push, split tail 40x3 first"
    assert cli.main(["plan", "--model-config", LLAMA1_30B, "--tp", "2", "--gpu", "NVIDIA H200",
                     "--sms", "132"]) == 0
    assert "ping-pong 128x128, ce push, split tail 40x3 first" in capsys.readouterr().out
    # TP 4 from two waves on: the parts run last (qwen1.5-32b's fc2 at m = 1024: 320 tiles, 56
    # left, 132 // 56 = 2 parts)
    pp = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4,
                    epilogue_split=1, rs_warp_specialized=True, stream_k=1)
    assert P.kernel_summary("rs", pp, 1024, 5120, 13696, 4, 132) == \
        "ping-pong 128x128, split tail 56x2 last"
    # the Triton kernel's stream-K tail: n = 5120 at m = 1024, TP 2, 128x256 tiles make 160, 28
    # left (at most 0.35 of a wave); with stream_k off, none
    tr = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8,
                    epilogue_split=2, stream_k=1)
    assert P.kernel_summary("rs", tr, 1024, 5120, 13824, 2, 132) == \
        "triton 128x256, stream-K tail 28"
    tr_off = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8,
                        epilogue_split=2, stream_k=0)
    assert P.kernel_summary("rs", tr_off, 1024, 5120, 13824, 2, 132) == "triton 128x256"
    # the form follows the op's own switch: the Gluon AG+GEMM (no split tail), else Triton's
    ag_pp = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4,
                       epilogue_split=1, ag_warp_specialized=True, stream_k=1)
    assert P.kernel_summary("ag", ag_pp, 1024, 5120, 13824, 2, 132) == "ping-pong 128x128"
    assert P.kernel_summary("ag", pp, 1024, 5120, 13824, 2, 132).startswith("triton 128x128")
    # a shape the Gluon kernel cannot take runs the Triton one: 1000 rows a rank, not a multiple
    # of 128 (the launcher warns and falls back), or K of 4 steps under 5 stages
    assert P.kernel_summary("rs", pp, 2000, 5120, 13696, 2, 132) == (
        "triton 128x128 (Gluon form falls back: 1000 rows per rank are not a multiple of "
        "block_m=128)")
    assert P.kernel_summary("ag", ag_pp, 1024, 5120, 256, 2, 132).startswith(
        "triton 128x128 (Gluon form falls back: K=256 has fewer than num_stages=5")


@pytest.mark.parametrize("flag, value, message", [
    ("--sms", "0", "--sms 0: must be >= 1"),
    ("--sms", "-1", "--sms -1: must be >= 1"),
    ("--m", "0", "--m 0: must be a positive multiple of --tp 2"),
    ("--m", "-5", "--m -5: must be a positive multiple of --tp 2"),
    ("--m", "3", "--m 3: must be a positive multiple of --tp 2"),
])
def test_bad_sms_and_m_are_usage_errors(flag, value, message, capsys):
    """Rejected as argparse does (exit 2, the flag named) instead of a ZeroDivisionError, a
    silent default (--m 0) or a plan whose tune suggestion tune itself rejects."""
    flags = {"--model-config": LLAMA, "--tp": "2", "--gpu": "NVIDIA H200", "--sms": "132", flag: value}
    argv = ["plan"] + [a for item in flags.items() for a in item]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
