"""What the experiment scripts share: loading an earlier copy of a kernel module, the random
problem per shape, timing a set of methods in one interleaved loop with a correctness check per
output, and the JSON record."""

import importlib.util
import json
import statistics
import sys

import torch

from megatron_flux.tools.diagnostics.kernel_vs_cublas import _time, add_sample_args, rel_err


def flux_backend_under_torchrun(override=None):
    """Under torchrun: this rank's GPU selected, the NCCL process group started, and the
    registered ``flux`` backend, as a layer would call it, every config it picks with
    ``override``'s GemmConfig fields (a dict) replaced. ``(group, rank, world, dev, backend)``."""
    import dataclasses
    import os

    import torch.distributed as dist

    from megatron_flux import backends

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    backend = backends.get_backend("flux")
    if override:
        picked = backend.config
        backend.config = lambda *a, **kw: dataclasses.replace(picked(*a, **kw), **override)
    return group, group.rank(), group.size(), dev, backend


def load_module(path, name):
    """The Python file at ``path`` as a module (an earlier copy of ``kernels/*.py``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_timing_args(p):
    """``--trials``, ``--iters`` (per trial, back to back), ``--warmup`` and ``--shuffle-seed``
    (see ``kernel_vs_cublas._time``) and ``--json`` (the record's path)."""
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--iters", type=int, default=10)
    add_sample_args(p)
    p.add_argument("--json")


def without_phases(launch_gemm_rs_ws):
    """``launch_gemm_rs``'s signature (``produce`` / ``consume``, which the Gluon kernel does
    not split) onto the Gluon GEMM+RS launcher or a copy of it, for ``rs_on_one_gpu``; other
    keywords (``trace``) pass through (the package's dispatch runs traces on the Triton
    kernel)."""
    def launch(*args, produce=True, consume=True, **kwargs):
        assert produce and consume
        return launch_gemm_rs_ws(*args, **kwargs)

    return launch


def parse_shape(spec):
    """``"MxNxK"`` -> ``(m, n, k)``."""
    m, n, k = map(int, spec.split("x"))
    return m, n, k


def problem(m, n, k):
    """Random bf16 ``a`` [m, k] and ``w`` [n, k] on the GPU, and ``a @ w.T`` in fp32."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return a, w, a.float() @ w.t().float()


def named_configs(table, op, m, n, k, tp):
    """``{"table": ..., "default": ...}``: the shipped table's config for ``op`` ("ag" or "rs")
    on this shape (``table`` a ``TableConfigProvider``) and the heuristic default."""
    from megatron_flux.kernels.config import default_config

    dev = torch.device("cuda", torch.cuda.current_device())
    return {"table": table(op, m, n, k, dtype=torch.bfloat16, tp=tp, device=dev),
            "default": default_config(op, m, n, k, tp=tp)}


def time_and_check(fns, outs, args, title, row):
    """Time ``fns`` (one of them ``"cublas"``) interleaved, as ``args`` (from
    :func:`add_timing_args`) say; check each ``outs[name] = (got,
    ref_fn)`` after the timing (rel. error < 1e-2, else the line says WRONG); print ``title``
    with every method's time / cuBLAS. Returns one record per method, ``row``'s fields plus
    ``method``, ``median_ms``, ``spread_ms``, ``times_ms`` and ``rel_err``."""
    times = _time(fns, args.trials, args.iters, args.warmup, args.shuffle_seed,
                  getattr(args, "queue_ahead_ms", 0.0))
    base = statistics.median(times["cublas"])
    line, rows = [f"{title} cublas {base:.4f}"], []
    for name, ts in times.items():
        med = statistics.median(ts)
        e = None
        if name in outs:
            got, ref = outs[name]
            e = rel_err(got.float(), ref())
            if not e < 1e-2:
                line.append(f"{name} WRONG({e:.3g})")
        rows.append({**row, "method": name, "median_ms": med, "spread_ms": max(ts) - min(ts),
                     "times_ms": ts, "rel_err": e})
        if name != "cublas":
            line.append(f"{name} x{med / base:.3f}")
    print("  ".join(line), flush=True)
    return rows


def next_rank_buffer(elems, group, dev):
    """A bf16 symmetric buffer of ``elems`` on this rank, rendezvoused over ``group``, and a view
    of the next rank's: ``(buf, handle, peer)``. Keep all three alive while ``peer`` is written,
    and barrier before dropping them (a peer may still be writing into ``buf``)."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(elems, dtype=torch.bfloat16, device=dev)
    handle = symm_mem.rendezvous(buf, group.group_name)
    peer = handle.get_buffer((group.rank() + 1) % group.size(), (elems,), torch.bfloat16)
    return buf, handle, peer


def write_record(path, rows, **extra):
    """The run's JSON record (command, GPU, versions, ``extra``, rows) to ``path`` if given."""
    if path:
        with open(path, "w") as f:
            json.dump({"command": " ".join([sys.executable] + sys.argv),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, **extra, "rows": rows},
                      f, indent=1)
