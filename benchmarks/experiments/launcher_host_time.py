"""Python time of the fused kernels' launchers alone, on the CPU (no GPU, no Triton launch).

The Triton launch (``_LAUNCH``) is replaced by a no-op, so what is timed is the launcher's own
work: launch geometry, the stream-K plan, the programs-per-SM plan, host descriptors, argument
tuples. Shapes are llama3-8b fc1 (AG+GEMM) and fc2 (GEMM+RS) at m = 1024, TP = 2, on CPU tensors
(the launchers read only shapes and strides), with a Triton-kernel config (128x256, stream-K)
and, as ``*_ws``, the Gluon ping-pong (128x128x64, 5 stages). Best of ``--repeats`` loops of
``--calls`` calls, in µs per call.

    PYTHONPATH=. python benchmarks/experiments/launcher_host_time.py          # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/experiments/launcher_host_time.py --json out.json
"""

import argparse
import json
import sys
import time

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="append this run's record to a JSON list here")
    args = p.parse_args(argv)

    from megatron_flux.kernels import ag_gemm, ag_gemm_ws, gemm_rs, gemm_rs_ws
    from megatron_flux.kernels.config import GemmConfig

    class NoLaunch:  # a kernel whose launches do nothing (``kernel[grid](...)``)
        def __getitem__(self, grid):
            return lambda *a, **k: None

    ag_gemm._LAUNCH = gemm_rs._LAUNCH = lambda *a, **k: None
    ag_gemm_ws._LAUNCH = gemm_rs_ws._LAUNCH = lambda *a, **k: None
    if ag_gemm_ws.ag_gemm_ws_kernel is not None:  # older checkouts launched these so
        ag_gemm_ws.ag_gemm_ws_kernel, gemm_rs_ws.gemm_rs_ws_kernel = NoLaunch(), NoLaunch()
    ping_pong = dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4,
                     epilogue_split=1)
    ag_ws = GemmConfig(**ping_pong, ag_warp_specialized=True)
    rs_ws = GemmConfig(**ping_pong, rs_warp_specialized=True)
    cfg = GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, stream_k=1)
    bf16 = dict(dtype=torch.bfloat16)
    x, ag = torch.empty(512, 4096, **bf16), torch.empty(1024, 4096, **bf16)
    w1, out1 = torch.empty(14336, 4096, **bf16).t(), torch.empty(1024, 14336, **bf16)
    a, w2 = torch.empty(1024, 14336, **bf16), torch.empty(4096, 14336, **bf16).t()
    out2, data = torch.empty(512, 4096, **bf16), torch.empty(2, 512, 4096, **bf16)
    flags, err, ptrs = (torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int32),
                        torch.zeros(2, dtype=torch.int64))
    common = dict(rank=0, world=2, epoch=1, cfg=cfg, num_sms=132, max_spins=10)
    calls = {
        "launch_ag_gemm": lambda: ag_gemm.launch_ag_gemm(x, ag, w1, out1, flags, err, **common),
        "launch_gemm_rs": lambda: gemm_rs.launch_gemm_rs(a, w2, out2, data, ptrs, ptrs, None, err,
                                                         **common),
    }
    if ag_gemm_ws.ag_gemm_ws_kernel is not None:  # a Triton with Gluon
        ws = dict(common, cfg=ag_ws)
        calls["launch_ag_gemm_ws"] = lambda: ag_gemm.launch_ag_gemm(x, ag, w1, out1, flags, err, **ws)
        ws_rs = dict(common, cfg=rs_ws)
        calls["launch_gemm_rs_ws"] = lambda: gemm_rs.launch_gemm_rs(a, w2, out2, data, ptrs, ptrs,
                                                                    None, err, **ws_rs)
    us = {}
    for name, fn in calls.items():
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / args.calls)
        us[name] = best * 1e6
        print(f"{name}: {us[name]:.2f} us per call")
    if args.json:
        import megatron_flux

        try:
            with open(args.json) as f:
                runs = json.load(f)
        except FileNotFoundError:
            runs = []
        runs.append({"command": " ".join([sys.executable] + sys.argv),
                     "package": megatron_flux.__file__, "torch": torch.__version__,
                     "calls": args.calls, "repeats": args.repeats, "us_per_call": us})
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
