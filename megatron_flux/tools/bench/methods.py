"""The benchmarked methods: ways of computing one op (or a part of it) on this rank's operands.

Every method is built once per case as a zero-argument callable that runs one iteration and
returns its output tensor, so the timing loop (:mod:`.timing`) and the correctness check treat
them alike:

* ``cublas_gemm``    the non-split local GEMM alone (``torch.mm``) — FLUX's ``GEMM_non-split``;
                     the floor every method is measured against (ECT = method − this). On
                     CUDA ``torch.mm`` is cuBLAS; elsewhere (``--device cpu``) it is torch's CPU
                     matmul, so the printed table calls it ``local_gemm (torch.mm, cpu)``
                     (:func:`method_label`) while the JSON keeps the method name
                     ``cublas_gemm`` that reports and tables key on.
* ``comm``           the collective alone (all-gather of the row shard / reduce-scatter of the
                     partial product): how much communication there is to hide.
* ``nccl``           the registered ``nccl`` backend: collective, then GEMM (or GEMM, then
                     collective), i.e. what Megatron does without overlap. The baseline.
* ``torch_async_tp`` PyTorch's own micro-pipelined ops over symmetric memory
                     (``torch.ops.symm_mem.fused_all_gather_matmul`` /
                     ``fused_matmul_reduce_scatter``). CUDA only.
* ``flux``           the registered fused ``flux`` backend (Triton over symmetric memory), with
                     the kernel settings of the matching tuning table (or the defaults).
* ``flux_default``   the fused backend with the untuned heuristic settings (``default_config``)
                     whatever the tables say: the "untuned" side of tuned-vs-untuned.
* ``flux_variant``   the fused backend with the tables' settings changed by ``--flux-variant``
                     (a JSON object of ``GemmConfig`` fields, e.g. ``{"rs_copy_engine": true}``):
                     a knob's A/B inside the same interleaved trials as ``flux``.
* ``flux_control``   a second fused backend built as ``flux`` is (the tables' settings), with
                     its own symmetric workspaces, streams and config cache, as ``flux_default``'s
                     and ``flux_variant``'s are: ``flux_control`` ÷ ``flux`` is what two backend
                     objects with identical configs measure apart in the same trials, the floor
                     under any A/B of ``flux`` against one of those (``tools.tune.adopt`` uses it).
* ``auto``           whatever ``resolve_backend("auto", ...)`` picks for these operands.

A method that cannot run here raises :class:`MethodSkipped` with the reason at build time; the
reason ends up in the JSON row instead of a silent gap.
"""

from __future__ import annotations

import math
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
import torch.distributed as dist

from megatron_flux.tools.bench.grid import AG_GEMM, GEMM_RS, Case

#: the methods that run a FluxBackend (the registered one, or a second object of its own)
FUSED_METHODS: Tuple[str, ...] = ("flux", "flux_default", "flux_variant", "flux_control")
METHODS: Tuple[str, ...] = (("cublas_gemm", "comm", "nccl", "torch_async_tp") + FUSED_METHODS
                            + ("auto",))
#: methods whose output is the op's result (checked against the fp32 reference, get metrics)
COMPUTES_OP: Tuple[str, ...] = ("nccl", "torch_async_tp") + FUSED_METHODS + ("auto",)
#: methods that overlap communication with the GEMM (the ones overlap efficiency is about)
OVERLAPPING: Tuple[str, ...] = ("torch_async_tp",) + FUSED_METHODS + ("auto",)

#: ``b_layout`` choices: ``weight_t`` passes ``weight.t()`` of a row-major ``[n, k]`` weight (what
#: Megatron's forward does), ``row_major`` a contiguous ``[k, n]`` matrix.
B_LAYOUTS: Tuple[str, ...] = ("weight_t", "row_major")


def method_label(name: str, device_type: str) -> str:
    """What the terminal table calls method ``name`` on a ``device_type`` device: its name,
    except ``cublas_gemm`` off CUDA, where ``torch.mm`` does not run cuBLAS."""
    if name == "cublas_gemm" and device_type != "cuda":
        return f"local_gemm (torch.mm, {device_type})"
    return name


class MethodSkipped(Exception):
    """This method cannot run on this machine / these operands; ``str(exc)`` says why."""


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CaseInputs:
    """This rank's operands of one case, plus the buffers the non-fused methods write into.

    ``gemm_a`` is the real gathered activation (AG+GEMM) so ``cublas_gemm`` multiplies the same
    numbers the op does; ``comm_in`` is the real partial product (GEMM+RS) for the same reason.
    """

    case: Case
    tp: int
    a: torch.Tensor
    b: torch.Tensor
    gemm_a: torch.Tensor
    comm_in: torch.Tensor


def case_seed(seed: int, case: Case, rank: int) -> int:
    """A per-(case, rank) seed that is stable across processes (``hash()`` of str is not)."""
    key = f"{seed}|{case.op}|{case.model}|{case.m}|{case.n}|{case.k}|{rank}".encode()
    return zlib.crc32(key)


def make_inputs(
    case: Case,
    tp: int,
    rank: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    b_layout: str = "weight_t",
) -> CaseInputs:
    """Fresh random operands for ``case`` on this rank (local work only, no collective).

    Activations are standard normal; weights are scaled by ``1/sqrt(k)`` so outputs stay O(1)
    like a trained layer's, which keeps the bf16 error check meaningful at every k. For AG+GEMM
    ``gemm_a`` is only allocated here: :func:`gather_inputs` fills it, after the ranks have
    agreed that every one of them got this far (a rank that ran out of memory here must not
    leave the others waiting in the all-gather).
    """
    if b_layout not in B_LAYOUTS:
        raise ValueError(f"b_layout must be one of {B_LAYOUTS}, got {b_layout!r}")
    shapes = case.local_shapes(tp)
    gen = torch.Generator(device=device)
    gen.manual_seed(case_seed(seed, case, rank))
    a = torch.randn(shapes["a"], generator=gen, device=device, dtype=torch.float32).to(dtype)
    k_loc, n_loc = shapes["b"]
    w = torch.randn((n_loc, k_loc), generator=gen, device=device, dtype=torch.float32)
    w = (w * (1.0 / math.sqrt(case.k))).to(dtype)
    b = w.t() if b_layout == "weight_t" else w.t().contiguous()
    del w
    if case.op == AG_GEMM:
        gemm_a = torch.empty(shapes["gemm_a"], device=device, dtype=dtype)
        comm_in = a
    elif case.op == GEMM_RS:
        gemm_a = a
        comm_in = torch.mm(a, b)
    else:
        raise ValueError(f"unknown op {case.op!r}")
    return CaseInputs(case, tp, a, b, gemm_a, comm_in)


def gather_inputs(inp: CaseInputs, group: dist.ProcessGroup) -> None:
    """Fill AG+GEMM's ``gemm_a`` with the real gathered activation (collective; no-op for RS)."""
    if inp.case.op == AG_GEMM:
        _all_gather(inp.gemm_a, inp.a, group=group)


def _symm_mem_ops(device: torch.device, group: dist.ProcessGroup) -> Tuple[object, str]:
    """``(torch.ops.symm_mem, group_name)`` with symmetric memory enabled, or MethodSkipped."""
    if device.type != "cuda":
        raise MethodSkipped(f"torch async-TP needs CUDA symmetric memory; tensors are on {device.type}")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        raise MethodSkipped(f"torch.distributed._symmetric_memory unavailable ({exc})") from None
    ops = torch.ops.symm_mem
    for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        if not hasattr(ops, op):
            raise MethodSkipped(f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{op}")
    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # required up to torch 2.10, a deprecated no-op-ish call after
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(name)
    return ops, name


def _backend_fn(backend, inp: CaseInputs, group, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One call of a registered :class:`TPOverlapBackend` on the case's operands."""
    a, b = inp.a, inp.b
    if inp.case.op == AG_GEMM:
        return lambda: backend.all_gather_matmul(a, b, group, out=out)[0]
    return lambda: backend.matmul_reduce_scatter(a, b, group, out=out)


_DEFAULT_CONFIG_BACKEND = []
_CONTROL_BACKEND = []
_VARIANT = {}  # the --flux-variant fields, and its backend once built


def set_flux_variant(fields: Dict[str, object]) -> None:
    """The ``GemmConfig`` fields ``flux_variant`` changes (validated here: unknown names fail)."""
    from megatron_flux.backends.flux.variant import check_variant_fields

    fields = check_variant_fields(fields)
    _VARIANT.clear()
    _VARIANT["fields"] = fields


def _variant_backend(backend_cls):
    """One FluxBackend per process whose configs are the tables' with ``--flux-variant``'s fields."""
    if "backend" not in _VARIANT:
        from megatron_flux.backends.flux.variant import variant_backend

        _VARIANT["backend"] = variant_backend(_VARIANT.get("fields", {}), backend_cls=backend_cls)
    return _VARIANT["backend"]


def _control_backend(backend_cls):
    """One more FluxBackend per process, built as the registered ``flux`` one is (no arguments:
    the tables' configs), so it differs from ``flux`` only in being another object."""
    if not _CONTROL_BACKEND:
        _CONTROL_BACKEND.append(backend_cls())
    return _CONTROL_BACKEND[0]


def _default_config_backend(backend_cls, default_config):
    """One FluxBackend per process that always uses ``default_config`` at the group's TP (its
    workspaces are reused across cases, like the registered backend's)."""
    if not _DEFAULT_CONFIG_BACKEND:
        def provider(op, m, n, k, *, tp=None, **context):
            return default_config(op, m, n, k, tp=tp)

        provider.accepts_context = True
        _DEFAULT_CONFIG_BACKEND.append(backend_cls(config_provider=provider))
    return _DEFAULT_CONFIG_BACKEND[0]


def config_notes(backend, inp: CaseInputs, with_source: bool) -> Dict[str, object]:
    """For a fused method's JSON row: ``kernel_config``, the config ``backend`` runs on the case,
    and with ``with_source`` (a backend configured by the tables) ``config_from``, which rule of
    :func:`megatron_flux.tuning.provider.kernel_config` chose it (a table entry, the nearest
    entry, the wave or ping-pong rule, the default)."""
    from megatron_flux.tuning import provider

    a, b = inp.a, inp.b
    op = "ag" if inp.case.op == AG_GEMM else "rs"
    m_total = a.shape[0] * inp.tp if op == "ag" else a.shape[0]
    n, k = b.shape[1], a.shape[1]
    notes: Dict[str, object] = {"kernel_config": backend.config(
        op, m_total, n, k, dtype=a.dtype, tp=inp.tp, device=a.device).to_dict()}
    if with_source:
        notes["config_from"] = provider.kernel_config(op, m_total, n, k, a.dtype, inp.tp, a.device)[1]
    return notes


def build_method(
    name: str, inp: CaseInputs, group: dist.ProcessGroup
) -> Tuple[Callable[[], torch.Tensor], Dict[str, object]]:
    """The callable for method ``name`` on ``inp`` and notes for its JSON row (the fused
    methods': :func:`config_notes`).

    Raises :class:`MethodSkipped` when the method cannot run here (no CUDA, backend not
    registered, operands unsupported); any other exception is a real error.
    """
    from megatron_flux import backends  # lazy: importing the registry probes optional deps

    case, a, b = inp.case, inp.a, inp.b
    shapes = case.local_shapes(inp.tp)
    dev, dt = a.device, a.dtype
    out = None
    if name in ("cublas_gemm", "nccl") + FUSED_METHODS + ("auto",):
        out_shape = (inp.gemm_a.shape[0], b.shape[1]) if name == "cublas_gemm" else shapes["out"]
        out = torch.empty(out_shape, device=dev, dtype=dt)

    if name == "cublas_gemm":
        ga = inp.gemm_a
        return (lambda: torch.mm(ga, b, out=out)), {}
    if name == "comm":
        comm_out = torch.empty(shapes["comm_out"], device=dev, dtype=dt)
        src = inp.comm_in
        collective = _all_gather if case.op == AG_GEMM else _reduce_scatter

        def comm() -> torch.Tensor:
            collective(comm_out, src, group=group)
            return comm_out

        return comm, {}
    if name == "nccl":
        return _backend_fn(backends.get_backend("nccl"), inp, group, out), {}
    if name == "torch_async_tp":
        ops, gname = _symm_mem_ops(dev, group)
        if case.op == AG_GEMM:
            return (lambda: ops.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=gname)[1][0]), {}
        return (lambda: ops.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name=gname)), {}
    if name in FUSED_METHODS:
        reason = backends.fused_unavailable_reason(dev)
        if reason is not None:
            raise MethodSkipped(reason)
        if name == "flux":
            backend = backends.get_backend("flux")
        else:
            from megatron_flux.backends.flux import FluxBackend
            from megatron_flux.kernels.config import default_config

            backend = (_variant_backend(FluxBackend) if name == "flux_variant"
                       else _control_backend(FluxBackend) if name == "flux_control"
                       else _default_config_backend(FluxBackend, default_config))
        reason = backend.unsupported_reason(a, b, group)
        if reason is not None:
            raise MethodSkipped(f"flux backend does not support these operands: {reason}")
        return _backend_fn(backend, inp, group, out), config_notes(backend, inp, with_source=name == "flux")
    if name == "auto":
        backend = backends.resolve_backend("auto", a, b, group, op="ag" if case.op == AG_GEMM else "rs")
        notes = {"resolved_backend": backend.name}
        if hasattr(backend, "config"):
            notes.update(config_notes(backend, inp, with_source=True))
        return _backend_fn(backend, inp, group, out), notes
    raise ValueError(f"unknown method {name!r}; expected one of {METHODS}")


def reference_output(inp: CaseInputs, group: dist.ProcessGroup) -> torch.Tensor:
    """The op's output computed by the ``nccl`` backend on fp32 copies of the operands (collective).

    The global matmul-precision setting is left alone (flipping it mixes torch's legacy and new
    TF32 APIs, which newer torch turns into errors); :func:`cuda_fp32_matmul_mode` records it.
    """
    from megatron_flux.backends import get_backend

    nccl = get_backend("nccl")
    a32, b32 = inp.a.float(), inp.b.float()
    if inp.case.op == AG_GEMM:
        return nccl.all_gather_matmul(a32, b32, group)[0]
    return nccl.matmul_reduce_scatter(a32, b32, group)


def cuda_fp32_matmul_mode() -> str:
    """How cuBLAS runs fp32 matmuls here (``ieee`` = true fp32, ``tf32``), for the JSON record."""
    matmul = torch.backends.cuda.matmul
    try:
        if hasattr(matmul, "fp32_precision"):
            return str(matmul.fp32_precision)
        return "tf32" if matmul.allow_tf32 else "ieee"
    except RuntimeError as exc:  # torch refuses to answer after mixed legacy/new API use
        return f"unknown ({str(exc).splitlines()[0][:80]})"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in fp32; ``inf`` for a wrong shape or non-finite output."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf
    diff = torch.linalg.vector_norm(out.float() - ref).item()
    scale = torch.linalg.vector_norm(ref).item()
    err = diff / scale if scale > 0 else diff
    return err if math.isfinite(err) else math.inf


def default_max_rel_err(dtype: torch.dtype) -> float:
    """Flag threshold for the relative error vs the fp32 reference.

    bf16 keeps 8 significant bits (rounding alone costs ~1e-3 relative), fp16 11; the
    thresholds leave an order of magnitude for accumulation-order differences between
    kernels. fp32 allows for Triton's TF32 dots (10-bit mantissa inputs).
    """
    return {torch.bfloat16: 2e-2, torch.float16: 1e-2}.get(dtype, 5e-3)

