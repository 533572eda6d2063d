"""``megatron-flux check``: what this machine offers the plugin, and which backend ``auto`` picks.

One process, no GPU work beyond querying properties; run it on a training node before a job::

    megatron-flux check [--tp N] [--json]

It reports the versions that matter (torch, Triton and whether it has Gluon, megatron-core),
the visible GPUs (name, compute capability, SMs), peer access between the first ``--tp`` of
them (default: all visible, as the launchers use), the environment variables the plugin and its
GPU runs depend on, the optional kernels (apex's weight-gradient kernel, Transformer Engine),
and the tuning tables that match this machine. It ends with a verdict: whether the fused backend
can run here at all, and if not, why ``auto`` will use ``nccl``. Exit status 0 either way (a
machine without the fused backend is a supported setup); 2 on bad arguments.

Everything it checks is a condition the layers check again at run time (and report once in the
log); this only says it before the job starts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence

from megatron_flux.options import ENV as OPTIONS_ENV
from megatron_flux.options import FluxOptions
from megatron_flux.tuning.registry import ENV_CACHED, ENV_FILES, ENV_SHIPPED

#: the plugin's own environment variables (also recorded with every benchmark run,
#: :mod:`megatron_flux.tools.bench.report`): the tables' (:mod:`megatron_flux.tuning.registry`)
#: and every default of :class:`~megatron_flux.options.FluxOptions` (``options.ENV``), taken from
#: where they are read so that a new one is reported without a change here
PLUGIN_ENV_VARS = (ENV_FILES, ENV_SHIPPED, ENV_CACHED) + tuple(OPTIONS_ENV.values())
#: environment variables that change what the plugin, NCCL or torch symmetric memory do
ENV_VARS = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
) + PLUGIN_ENV_VARS


def _version(*distributions: str) -> Optional[str]:
    """The installed version of the first of ``distributions`` found (package metadata: nothing
    is imported, so megatron-core's import-time warnings stay out of the report)."""
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _gluon() -> Optional[str]:
    """``None`` when Gluon imports, else why not."""
    try:
        from megatron_flux.kernels.gluon_ws import GLUON_ERROR
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return GLUON_ERROR


def _devices(torch) -> List[Dict[str, Any]]:
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": props.name, "capability": [props.major, props.minor],
                    "sms": int(props.multi_processor_count),
                    "memory_gib": round(props.total_memory / 2**30, 1)})
    return out


def _peer_access(torch, n: int) -> Dict[str, bool]:
    return {f"{i}->{j}": bool(torch.cuda.can_device_access_peer(i, j))
            for i in range(n) for j in range(n) if i != j}


def _machine_tables(devices: List[Dict[str, Any]], tp: int) -> list:
    """The tuning tables (given, cached, shipped) whose GPU, SM count and TP size match the
    first device at ``tp``."""
    from megatron_flux.tuning import registry
    from megatron_flux.tuning.keys import normalize_gpu_name

    index = registry.get_index()  # reads (and validates) every table, GPU or not
    if not devices:
        return []
    gpu, sms = normalize_gpu_name(devices[0]["name"]), devices[0]["sms"]
    return [t for t in index.tables if (t.gpu, t.sms, t.tp) == (gpu, sms, tp)]


def _tables(devices: List[Dict[str, Any]], tp: int) -> List[str]:
    """:func:`_machine_tables`, named; a stale one (measured with other kernels) says so."""
    return [f"{t.path} ({t.describe()}" + (f"; stale: kernel version {t.kernel_version})" if t.stale else ")")
            for t in _machine_tables(devices, tp)]


def _tables_triton(devices: List[Dict[str, Any]], tp: int) -> List[str]:
    """The Triton versions the tables of :func:`_machine_tables` were measured with."""
    versions = (t.extra.get("environment", {}).get("triton") for t in _machine_tables(devices, tp))
    return sorted({str(v) for v in versions if v})


def invalid_settings(environ: Mapping[str, str]) -> List[str]:
    """One message per ``MEGATRON_FLUX_*`` option variable in ``environ`` whose value
    :class:`~megatron_flux.options.FluxOptions` rejects, as it does when the job starts
    (``validate_flux_args``) and when the layers first read their options."""
    bad = []
    for var in OPTIONS_ENV.values():
        if environ.get(var, "") == "":
            continue
        try:
            FluxOptions.from_env({var: environ[var]})
        except ValueError as exc:
            bad.append(str(exc))
    return bad


def collect(tp: Optional[int] = None) -> Dict[str, Any]:
    """The report as a dict (see the module docstring); ``tp`` defaults to the visible GPUs."""
    import torch

    import megatron_flux

    info: Dict[str, Any] = {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": _version("triton"),
            "megatron.core": _version("megatron-core", "megatron_core"),
            "megatron_flux": megatron_flux.__version__,
        },
        "gluon": _gluon() or "available",
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "invalid_settings": invalid_settings(os.environ),
        "optional": {
            "apex_wgrad_kernel": _apex_wgrad(),
            "transformer_engine": _version("transformer-engine", "transformer_engine"),
        },
    }
    cuda = torch.cuda.is_available()
    devices = _devices(torch) if cuda else []
    tp = tp if tp is not None else max(len(devices), 1)
    info["cuda_available"] = cuda
    info["devices"] = devices
    info["tp"] = tp
    info["peer_access"] = _peer_access(torch, min(tp, len(devices))) if len(devices) > 1 else {}
    info["symmetric_memory"] = symmetric_memory_status(torch, devices)
    try:
        info["tables"] = _tables(devices, tp)
        info["tables_triton"] = _tables_triton(devices, tp)
    except Exception as exc:  # noqa: BLE001 (a bad $MEGATRON_FLUX_CONFIG: the job would fail)
        info["tables"], info["tables_error"] = [], f"{type(exc).__name__}: {exc}"
    info["fused_backend"] = verdict(info)
    return info


def symmetric_memory_status(torch, devices: List[Dict[str, Any]]) -> str:
    """``"usable"``, or ``"not usable: <why>"``: whether torch symmetric memory can back the
    fused kernels' workspaces on this machine. It lives in GPU memory, so importing the module
    is not enough: it needs a torch built with distributed support and a visible CUDA device
    (peer access between the GPUs is checked apart, per pair)."""
    if not torch.distributed.is_available():
        return "not usable: this torch is built without torch.distributed"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as exc:
        return f"not usable: torch.distributed._symmetric_memory does not import ({exc})"
    if not devices:
        return "not usable: no CUDA device is visible (symmetric memory is GPU memory)"
    return "usable"


def _apex_wgrad() -> bool:
    from megatron_flux.ops.grad_accumulation import fused_wgrad_kernel

    return fused_wgrad_kernel() is not None


def verdict(info: Dict[str, Any]) -> Dict[str, Any]:
    """``{"available": bool, "why": [...], "notes": [...]}`` from a :func:`collect` dict: ``why``
    lists every reason the fused backend cannot run (``auto`` then uses ``nccl``), ``notes``
    what runs but may not be what was meant."""
    from megatron_flux.backends.flux import flux_backend_factory_or_reason

    why, notes = [], []
    _, reason = flux_backend_factory_or_reason()
    if reason is not None:
        why.append(f"fused backend not importable: {reason}")
    if not info["cuda_available"]:
        why.append("no CUDA device is visible")
    tp, devices = info["tp"], info["devices"]
    if tp < 2:
        why.append("tensor-parallel size 1: nothing to overlap")
    elif devices and len(devices) < tp:
        why.append(f"--tp {tp} but only {len(devices)} GPU(s) visible on this node")
    for d in devices[:tp]:
        if d["capability"][0] < 9:
            why.append(f"GPU {d['index']} ({d['name']}) has compute capability "
                       f"{d['capability'][0]}.{d['capability'][1]}; the fused kernels need >= 9.0 (TMA)")
    missing = [pair for pair, ok in info["peer_access"].items() if not ok]
    if missing:
        why.append(f"no peer access between GPUs {', '.join(missing)} (symmetric memory needs P2P)")
    symm = str(info["symmetric_memory"])
    if symm != "usable" and info["cuda_available"]:  # without CUDA the reason is already listed
        why.append(f"torch symmetric memory {symm}")
    if info.get("tables_error"):
        why.append(f"the tuning tables cannot be read ({info['tables_error']}); the layers' "
                   "first fused call would fail the same way")
    env = info["env"]
    if env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        several = env.get(OPTIONS_ENV["allow_several_queues"]) == "1"
        notes.append("CUDA_DEVICE_MAX_CONNECTIONS is not 1 (Megatron requires it for tensor "
                     "parallelism on Hopper): set it before the processes start, or a TP group "
                     + ("runs fused anyway, as MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES=1 asks (a fused "
                        "grid can then deadlock beside another kernel that waits across ranks)"
                        if several else "runs NCCL unless MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES=1"))
    if env.get("NCCL_NVLS_ENABLE") != "0" or env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
        notes.append("NVLink multicast is not turned off (NCCL_NVLS_ENABLE=0, "
                     "TORCH_SYMM_MEM_DISABLE_MULTICAST=1): harmless where the fabric has none")
    if info["gluon"] != "available":
        notes.append(f"Gluon unavailable ({info['gluon']}): configs asking for the "
                     "warp-specialized kernels run the Triton ones, with one warning")
    if not why and not [t for t in info["tables"] if "; stale:" not in t]:
        notes.append(f"no current tuning table for {devices[0]['name']} ({devices[0]['sms']} SMs) "
                     f"at TP {tp}: 'auto' runs AG+GEMM fused from 1024 rows per rank and "
                     "GEMM+RS on NCCL, with default configs (tune your model with `megatron-flux "
                     "tune --model-config CONFIG`; `megatron-flux plan` shows what runs)")
    triton_here, measured = info["versions"].get("triton"), info.get("tables_triton") or []
    if triton_here and measured and triton_here.split("+")[0] not in {
            v.split("+")[0] for v in measured}:  # a local build's suffix is the same release
        notes.append(f"triton {triton_here} is not the Triton this machine's tuning tables were "
                     f"measured with ({', '.join(measured)}): their configs run, untimed with it "
                     "(with 3.7-3.9 some ping-pong GEMM+RS builds spill registers: docs/design.md, "
                     "\"Known limits\"); `megatron-flux tune --model-config CONFIG` times your "
                     "model's GEMMs with it")
    if not info["optional"]["apex_wgrad_kernel"]:
        notes.append("apex's weight-gradient kernel is not installed: megatron-flux's linears "
                     "accumulate into main_grad with torch (--flux-gradient-accumulation-fusion)")
    return {"available": not why, "why": why, "notes": notes}


def format_report(info: Dict[str, Any]) -> str:
    lines = ["megatron-flux check", ""]
    v = info["versions"]
    lines.append("versions: " + ", ".join(f"{k} {v[k] or 'missing'}" for k in v))
    lines.append(f"gluon: {info['gluon']}")
    lines.append(f"symmetric memory: {info['symmetric_memory']}")
    if info["devices"]:
        for d in info["devices"]:
            lines.append(f"GPU {d['index']}: {d['name']}, sm_{d['capability'][0]}{d['capability'][1]}, "
                         f"{d['sms']} SMs, {d['memory_gib']} GiB")
    else:
        lines.append("GPUs: none visible")
    if info["peer_access"]:
        bad = [p for p, ok in info["peer_access"].items() if not ok]
        lines.append("peer access: " + ("all pairs" if not bad else "missing " + ", ".join(bad)))
    lines.append("env: " + ", ".join(f"{k}={val}" for k, val in info["env"].items() if val is not None)
                 if any(val is not None for val in info["env"].values()) else "env: none of the "
                 "plugin's variables set")
    opt = info["optional"]
    lines.append(f"apex wgrad kernel: {'yes' if opt['apex_wgrad_kernel'] else 'no'}; "
                 f"transformer-engine: {opt['transformer_engine'] or 'no'}")
    lines.append(f"tuning tables for this machine at TP {info['tp']}: "
                 + ("; ".join(info["tables"]) if info["tables"] else "none"))
    lines.append("")
    fb = info["fused_backend"]
    if fb["available"]:
        lines.append(f"fused backend: AVAILABLE at TP {info['tp']} ('auto' uses it where the "
                     "table, the estimate or the size rule says it wins)")
    else:
        lines.append("fused backend: UNAVAILABLE, 'auto' will use 'nccl':")
        lines += [f"  - {w}" for w in fb["why"]]
    if fb["notes"]:
        lines.append("notes:")
        lines += [f"  - {n}" for n in fb["notes"]]
    if info.get("invalid_settings"):
        lines.append("INVALID settings: the job stops at start-up on each of these (fix or unset it):")
        lines += [f"  - {b}" for b in info["invalid_settings"]]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-flux check", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size to check for (default: the visible GPUs)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp {args.tp}: must be >= 1")
    info = collect(args.tp)
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 2 if info["invalid_settings"] else 0


if __name__ == "__main__":
    sys.exit(main())
