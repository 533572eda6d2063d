"""Experiment: can copy-engine work queued *behind* a running persistent kernel start before the
kernel ends, when a stream wait-value op gates it on a flag the kernel writes?

A copy-engine GEMM+RS (producer tiles into local memory, the copy engine moving them to the
owner while the own rows compute, as async-TP does) needs this: its copies can only start after
the kernel's producer phase, so they are queued after the kernel, gated by
``cuStreamWaitValue32`` on a flag the kernel raises, and the kernel's consumer phase waits for
the copies' signal (``cuStreamWriteValue32``). Under ``CUDA_DEVICE_MAX_CONNECTIONS=1``
(Megatron's setting) every stream shares one hardware queue, and whether that queue dispatches
the gated ops while the kernel still runs decides whether the design overlaps, or deadlocks
(here: the bounded spin runs out).

One GPU: a grid of one program per SM raises flag A, then spins (bounded) until flag B is set.
A side stream, queued after the kernel: wait until A >= 1, copy ``--copy-mib`` MiB, write B = 1.
Prints whether the kernel saw B, after how many polls, and the kernel's time.

``--gate event`` is the two-launch alternative: a first kernel (a cuBLAS GEMM
standing in for the producer launch), an event recorded after it, then the spinning kernel (the
consumer launch) on the same stream; the side stream, queued after both, waits for the event
(not for a flag), copies and writes B. ``--gate event-first`` queues the side stream's work
before the spinning kernel instead (expected: no deadlock, but the copy before the kernel).
``--gate none`` queues the copy and the write with no gate at all (the AllGather's pattern).

Run once per setting (the variable must be set before CUDA starts):

    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/experiments/stream_wait_overlap.py
    python benchmarks/experiments/stream_wait_overlap.py
"""

import argparse
import ctypes
import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def raise_then_wait(flag_a, flag_b, out, max_spins):
    pid = tl.program_id(0)
    if pid == 0:
        tl.atomic_xchg(flag_a, 1, sem="release", scope="sys")
    seen = tl.atomic_add(flag_b, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < 1) & (spins < max_spins):
        seen = tl.atomic_add(flag_b, 0, sem="acquire", scope="sys")
        spins += 1
    tl.store(out + 2 * pid, seen)
    tl.store(out + 2 * pid + 1, spins)


def _driver_fn(lib, names):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            return name, fn
    raise RuntimeError(f"none of {names} in libcuda")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--copy-mib", type=int, default=64)
    p.add_argument("--max-spins", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gate", choices=("value", "event", "event-first", "none"), default="value")
    p.add_argument("--dst", choices=("local", "peer"), default="local",
                   help="copy into this GPU's memory, or into GPU 1's over NVLink (P2P, copy engine)")
    p.add_argument("--json")
    args = p.parse_args(argv)

    lib = ctypes.CDLL("libcuda.so.1")
    wait_name, wait_value = _driver_fn(lib, ["cuStreamWaitValue32_v2", "cuStreamWaitValue32"])
    write_name, write_value = _driver_fn(lib, ["cuStreamWriteValue32_v2", "cuStreamWriteValue32"])
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    side = torch.cuda.Stream(dev)
    src = torch.empty(args.copy_mib << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src, device=torch.device("cuda", 1) if args.dst == "peer" else dev)
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    rows = []
    for rep in range(args.repeats + 1):  # the first compiles the kernel
        flags = torch.zeros(2, dtype=torch.int32, device=dev)
        out = torch.full((sms, 2), -1, dtype=torch.int32, device=dev)
        main_stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(main_stream)  # the buffers above exist before the side stream reads them
        before = torch.cuda.Event()
        rc = 0
        if args.gate != "value":
            torch.mm(x, x)  # the "producer" launch, ~0.2 ms: not done when the side work is queued
            before.record()

        def side_work():
            nonlocal rc
            with torch.cuda.stream(side):
                if args.gate == "value":
                    rc = wait_value(ctypes.c_void_p(side.cuda_stream), flags[0:].data_ptr(), 1, 0)  # GEQ
                elif args.gate.startswith("event"):
                    side.wait_event(before)
                dst.copy_(src, non_blocking=True)
                return write_value(ctypes.c_void_p(side.cuda_stream), flags[1:].data_ptr(), 1, 0)

        rc2 = side_work() if args.gate == "event-first" else 0
        start.record()
        raise_then_wait[(sms,)](flags[0:], flags[1:], out, args.max_spins)
        end.record()
        if args.gate != "event-first":
            rc2 = side_work()
        torch.cuda.synchronize()
        if rc or rc2:
            raise RuntimeError(f"{wait_name} -> {rc}, {write_name} -> {rc2}")
        o = out.cpu()
        row = {"repeat": rep, "saw_signal_programs": int((o[:, 0] >= 1).sum()),
               "programs": sms, "max_polls": int(o[:, 1].max()),
               "kernel_ms": start.elapsed_time(end)}
        if rep:
            rows.append(row)
        print(json.dumps(row), flush=True)
    record = {"command": " ".join([sys.executable] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
              "driver_fns": [wait_name, write_name], "gate": args.gate, "dst": args.dst, "copy_mib": args.copy_mib,
              "max_spins": args.max_spins, "rows": rows}
    overlapped = all(r["saw_signal_programs"] == r["programs"] for r in rows)
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={record['CUDA_DEVICE_MAX_CONNECTIONS']}, gate {args.gate}, dst {args.dst}: copy ran "
          f"{'during' if overlapped else 'NOT during'} the kernel in {len(rows)} repeats", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
