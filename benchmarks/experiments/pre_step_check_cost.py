"""How much host time does the check before every optimizer step (``check_fused_errors``) take?

One GPU, the fused backend with the three error words a training job makes (AG+GEMM, GEMM+RS,
the copy-engine re-gather), the device idle before each call as it is after Megatron's gradient
norm ``.item()``: the check's wall time per call, against one bare stream synchronize and one
``.item()`` of a device scalar, alternating call by call. Needs 1 GPU.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/pre_step_check_cost.py \\
        --json /tmp/pre-step-check.json
"""

import argparse
import json
import statistics
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)

    import torch

    from megatron_flux.backends import check_fused_errors, registry
    from megatron_flux.backends.flux import FluxBackend

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    fused = FluxBackend()
    for op in ("ag", "rs", "gather"):
        fused.resources.error_word(op, dev)
    registry._INSTANCES["flux"] = fused
    scalar = torch.ones((), device=dev)
    cases = {"check_fused_errors": check_fused_errors,
             "stream_synchronize": lambda: torch.cuda.current_stream(dev).synchronize(),
             "item": scalar.item}
    times = {name: [] for name in cases}
    for _ in range(100):  # warm-up
        for fn in cases.values():
            fn()
    for _ in range(args.calls):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    summary = {}
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        summary[name] = {"median_us": round(statistics.median(values), 2),
                         "p10_us": round(q[0], 2), "p90_us": round(q[-1], 2)}
        print(name, summary[name], flush=True)
    record = {"command": " ".join([sys.executable] + sys.argv),
              "gpu": torch.cuda.get_device_name(0),
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
              "error_words": 3, "calls": args.calls, "host_us": summary}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
