"""Experiment: does ``CUDA_DEVICE_MAX_CONNECTIONS=1`` take effect when a process sets it after
``torch.cuda.is_available()`` (as the GPU test harness does: the spawned worker imports the
test module, whose skip marks call it, then sets the variable in ``init_rank``)?

Probe, on one GPU: stream A holds at a stream wait (``cuStreamWaitValue32``) for a word that a
kernel on stream B writes, queued after it. With one hardware queue the wait at its head holds
B's kernel too, and neither ever finishes; with several, B runs and releases A. Each case runs in
its own process, which is abandoned (``os._exit``) once it has waited long enough.

    python benchmarks/experiments/connections_probe.py --json out.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

CASES = {
    "unset": None,
    "1, in the environment before start": "env",
    "1, set after torch.cuda.is_available() and device_count()": "after_is_available",
    "1, set after the CUDA context exists": "after_context",
}


def probe(when):
    if when == "env":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # before torch: as if from the shell
    import torch

    from megatron_flux.comm.signals import wait_signal_on_stream

    torch.cuda.is_available()
    torch.cuda.device_count()
    if when == "after_is_available":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    torch.cuda.set_device(0)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    if when == "after_context":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    wait_signal_on_stream(flag, 0, 1, a)
    done_a = torch.cuda.Event()
    done_a.record(a)
    with torch.cuda.stream(b):
        flag.fill_(1)
    t0 = time.time()
    while time.time() - t0 < 5:
        if done_a.query():
            print(json.dumps({"serialized": False, "seconds": round(time.time() - t0, 4)}), flush=True)
            os._exit(0)
        time.sleep(0.01)
    print(json.dumps({"serialized": True, "seconds": 5.0}), flush=True)
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case is not None:
        probe(args.case or None)
        return
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    records = []
    for name, when in CASES.items():
        out = subprocess.run([sys.executable, __file__, "--case", when or ""], env=env,
                             capture_output=True, text=True, timeout=60)
        line = (out.stdout.strip().splitlines() or ["{}"])[-1]
        rec = {"case": name, "rc": out.returncode, **json.loads(line)}
        if out.returncode:
            rec["stderr"] = out.stderr[-400:]
        records.append(rec)
        print(rec, flush=True)
    if args.json:
        import torch

        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/experiments/connections_probe.py",
                       "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "records": records}, f)


if __name__ == "__main__":
    main()
