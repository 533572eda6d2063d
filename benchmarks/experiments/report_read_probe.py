"""Which host call of a timeout report's read waits for a kernel that spins on another stream?

Each variant runs in a fresh process: it launches a bounded wait on a pinned host word (the
ready barrier, spin bound 2**22: about 5 s on an H200), then times, one by one, what a read of
device words to the host does (make a stream, allocate pinned memory, queue the copy and an
event), and whether the kernel was still spinning after them. ``--warm`` variants do some of
those steps before the launch; the ``own`` variant makes the stream as the package's
``HostReader`` does (``comm.errors.own_stream``: a driver stream, not torch's pool). Needs 1
GPU.

    PYTHONPATH=.:benchmarks/experiments python benchmarks/experiments/report_read_probe.py \\
        --json /tmp/report-read.json
"""

import argparse
import json
import subprocess
import sys
import time

VARIANTS = ["", "stream", "stream,pinned", "stream,pinned,copy", "own"]


def one(warm: set) -> dict:
    import torch

    from megatron_flux.comm.errors import DeviceErrorWord
    from megatron_flux.kernels.ready_barrier import launch_ready_barrier
    from megatron_flux.kernels.signals import OP_GATHER

    dev = torch.device("cuda", 0)
    flags = torch.zeros(2, dtype=torch.int32, pin_memory=True)  # the "peer's" words
    ptrs = torch.tensor([flags.data_ptr()] * 2, dtype=torch.int64, device=dev)
    word = DeviceErrorWord(dev, interval=1)
    probe = torch.arange(4, dtype=torch.int32, device=dev)
    if "stream" in warm:
        torch.cuda.Stream(device=dev)
    if "pinned" in warm:
        torch.empty(4, dtype=torch.int32, pin_memory=True)
    if "copy" in warm:
        with torch.cuda.stream(torch.cuda.Stream(device=dev)):
            torch.empty(4, dtype=torch.int32, pin_memory=True).copy_(probe, non_blocking=True)
    torch.cuda.synchronize()
    launch_ready_barrier(ptrs, word.device_word, rank=0, world=2, base=0, epoch=1,
                         max_spins=1 << 22, signal=False, wait=True, op_code=OP_GATHER)
    spinning = torch.cuda.Event()
    spinning.record()
    time.sleep(0.05)
    seconds = {}

    def timed(name, fn):
        start = time.monotonic()
        value = fn()
        seconds[name] = round(time.monotonic() - start, 4)
        return value

    if "own" in warm:
        from megatron_flux.comm.errors import own_stream

        stream = timed("make_own_stream", lambda: own_stream(dev))
    else:
        stream = timed("make_stream", lambda: torch.cuda.Stream(device=dev))
    host = timed("pinned_alloc", lambda: torch.empty(4, dtype=torch.int32, pin_memory=True))

    def queue():
        with torch.cuda.stream(stream):
            host.copy_(probe, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    done = timed("queue_copy_and_event", queue)
    still = not spinning.query()
    start = time.monotonic()
    while not done.query() and time.monotonic() - start < 2:
        time.sleep(0.001)
    seconds["copy_arrived_after"] = round(time.monotonic() - start, 4)
    flags.fill_(1)  # end the wait
    torch.cuda.synchronize()
    return {"warm_before_launch": sorted(warm), "seconds": seconds,
            "kernel_still_spinning_after_the_steps": still,
            "read": host.tolist()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(set(filter(None, args.one.split(","))))))
        return
    import torch

    runs = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--json", "-", "--one", variant],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    record = {"command": " ".join([sys.executable] + sys.argv),
              "gpu": torch.cuda.get_device_name(0),
              "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
              "runs": runs}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
