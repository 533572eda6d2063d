"""Host time of building one TMA descriptor argument (CPU only, no GPU needed): the Triton
kernels' ``descriptors.host_descriptor`` and the Gluon kernels' ``gluon_ws.host_descriptor``,
the latter with its shared-layout cache and, for comparison, with the layout recomputed
(``NVMMASharedLayout.get_default_for``) as before the cache. Mean of ``--calls`` calls, µs.

    PYTHONPATH=. python benchmarks/experiments/host_descriptor_cost.py --json cost.json
"""

import argparse
import json
import platform
import sys
import timeit

import torch
import triton


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--json")
    args = p.parse_args()
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from megatron_flux.kernels import descriptors, gluon_ws

    t = torch.empty(1024, 4096, dtype=torch.bfloat16)
    shape, strides, block = [1024, 4096], [4096, 1], [128, 64]

    def uncached_gluon():
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return GluonDescriptor(t, shape, strides, block, layout)

    cases = {
        "triton host_descriptor": lambda: descriptors.host_descriptor(t, shape, strides, block),
        "gluon host_descriptor (layout cached)": lambda: gluon_ws.host_descriptor(
            t, shape, strides, block),
        "gluon descriptor, layout recomputed": uncached_gluon,
        "NVMMASharedLayout.get_default_for": lambda: gl.NVMMASharedLayout.get_default_for(
            block, gl.bfloat16),
    }
    rows = {name: timeit.timeit(fn, number=args.calls) / args.calls * 1e6
            for name, fn in cases.items()}
    for name, us in rows.items():
        print(f"{name}: {us:.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv),
                       "cpu": platform.processor() or platform.machine(),
                       "torch": torch.__version__, "triton": triton.__version__,
                       "calls": args.calls, "us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
