"""Host-side costs of the fused launch path, timed on the CPU (no GPU needed).

* building a host TMA descriptor: Triton's and Gluon's constructors, and
  ``descriptors.bind_descriptor`` once their template exists;
* an import statement inside a function (two of them, against module-level names);
* ``triton.cdiv`` called from host code, against integer division;
* ``host_sections.py``'s timing wrapper (what its sections add per wrapped call);
* Triton's compile cache pruned to each kernel's ``.json`` and ``.cubin`` (what
  ``device_env.sh``'s ``pack_triton_cache`` keeps): a tiny kernel compiled for sm_90 into an
  empty cache, then again from the pruned cache, and which files the second one loaded.

Best of ``--repeats`` ``timeit`` loops, in µs per call.

    PYTHONPATH=. python benchmarks/experiments/host_micro_cpu.py --json out.json
"""

import argparse
import json
import os
import sys
import tempfile
import time
import timeit

import torch


def _best_us(fn, number, repeats):
    fn()
    return min(timeit.timeit(fn, number=number) for _ in range(repeats)) / number * 1e6


def _cache_pruning():
    """Seconds for a cold compile, then for the same compile from the pruned cache."""
    import subprocess

    code = r'''
import time, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
@triton.jit
def k(x, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(x + o, tl.load(x + o) * 2, mask=o < n)
src = triton.compiler.ASTSource(fn=k, signature={"x": "*fp32", "n": "i32", "B": "constexpr"},
                                constexprs={"B": 64})
t = time.perf_counter(); c = triton.compile(src, target=GPUTarget("cuda", 90, 32))
print(time.perf_counter() - t, ",".join(sorted(c.asm.keys())))
'''
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as work:
        script = os.path.join(work, "compile_once.py")  # @triton.jit needs a source file
        with open(script, "w") as f:
            f.write(code)
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        run = lambda: subprocess.run([sys.executable, script], env=env, check=True,  # noqa: E731
                                     capture_output=True, text=True).stdout.split()
        cold, cold_files = run()
        for root, _, files in os.walk(cache):
            for name in files:
                if name.rsplit(".", 1)[-1] in ("llir", "ptx", "ttir", "ttgir", "source"):
                    os.remove(os.path.join(root, name))
        warm, warm_files = run()
    return {"cold_compile_s": float(cold), "cold_asm": cold_files.split(","),
            "from_pruned_cache_s": float(warm), "pruned_asm": warm_files.split(",")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from megatron_flux.kernels import descriptors as D
    from megatron_flux.kernels import gluon_ws

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import host_sections

    t = torch.empty(2048, 4096, dtype=torch.bfloat16)
    geometry = ([2048, 4096], [4096, 1], [128, 64])
    n, r = args.number, args.repeats
    us = {
        "TensorDescriptor(...) (Triton)": _best_us(lambda: TensorDescriptor(t, *map(list, geometry)), n, r),
        "bind_descriptor (Triton)": _best_us(lambda: D.host_descriptor(t, *geometry), n, r),
    }
    if gluon_ws.GLUON_ERROR is None:
        layout = gluon_ws._shared_layout((128, 64), torch.bfloat16)
        us["TensorDescriptor(...) (Gluon)"] = _best_us(
            lambda: gluon_ws.GluonTensorDescriptor(t, *map(list, geometry), layout), n, r)
        us["bind_descriptor (Gluon)"] = _best_us(lambda: gluon_ws.host_descriptor(t, *geometry), n, r)

    def imports_inside():
        from megatron_flux.comm.signals import write_signal
        from megatron_flux.comm.streams import on_stream
        return write_signal, on_stream

    from megatron_flux.comm.signals import write_signal
    from megatron_flux.comm.streams import on_stream
    us["2 import statements inside a function, less 2 global reads"] = (
        _best_us(imports_inside, n, r) - _best_us(lambda: (write_signal, on_stream), n, r))
    us["triton.cdiv(4096, 128)"] = _best_us(lambda: triton.cdiv(4096, 128), n, r)
    us["-(-4096 // 128)"] = _best_us(lambda: -(-4096 // 128), n, r)

    class Owner:
        @staticmethod
        def f():
            return None

    plain = _best_us(lambda: Owner.f(), n, r)
    host_sections._wrap(Owner, "f", "f")
    us["host_sections wrapper, over a plain call"] = _best_us(lambda: Owner.f(), n, r) - plain
    record = {"command": " ".join([sys.executable] + sys.argv), "torch": torch.__version__,
              "triton": triton.__version__, "python": sys.version.split()[0],
              "definition": __doc__, "us_per_call": us, "cache_pruning": _cache_pruning()}
    for k, v in us.items():
        print(f"{k}: {v:.2f} us")
    print("cache:", record["cache_pruning"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
