"""Device-to-device copies issued straight to the CUDA driver, for the copy-engine collectives.

``Tensor.copy_`` builds a TensorIterator, checks overlap and dispatches before it reaches
``cudaMemcpyAsync``. On the 2xH100 box of session 30 a fused column layer call's copies took
about 27 µs of host time each (``benchmarks/experiments/host_sections.py``), where a plain
same-device ``copy_`` took 9 µs; the fused path makes three or four per layer call, in training
steps that are host-bound at micro-batch 1 (``benchmarks/NOTES.md``, sessions 28-30).

:func:`copy_on_stream` sends a copy between two contiguous tensors of one dtype and size on one
device (a symmetric workspace's peer views count as this device's memory) to
``cuMemcpyDtoDAsync`` on the given stream, and anything else to ``Tensor.copy_``. Opt-in with
``MEGATRON_FLUX_DRIVER_COPY=1`` until it is measured; ``0`` (the default) keeps ``copy_``.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

ENV_DRIVER_COPY = "MEGATRON_FLUX_DRIVER_COPY"

_memcpy = None
_memcpy_error: Optional[str] = None
driver_copies = 0  # copies that went to the driver (the GPU tests check the path ran)


def driver_copy_enabled() -> bool:
    """``$MEGATRON_FLUX_DRIVER_COPY``: ``1`` on, ``0`` or unset off; anything else raises, so a
    typo does not silently pick a path."""
    value = os.environ.get(ENV_DRIVER_COPY, "0")
    if value == "0":
        return False
    if value == "1":
        return True
    raise ValueError(f"${ENV_DRIVER_COPY} must be 0 or 1, got {value!r}")


def _load_memcpy():
    """``cuMemcpyDtoDAsync_v2`` from the CUDA driver, or None with the reason in
    ``_memcpy_error`` (looked up once)."""
    global _memcpy, _memcpy_error
    if _memcpy is not None or _memcpy_error is not None:
        return _memcpy
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        _memcpy_error = f"libcuda.so.1 not loadable: {exc}"
        return None
    fn = getattr(lib, "cuMemcpyDtoDAsync_v2", None)
    if fn is None:
        _memcpy_error = "libcuda has no cuMemcpyDtoDAsync_v2"
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    _memcpy = fn
    return fn


def driver_copy_unavailable_reason() -> Optional[str]:
    """Why :func:`copy_on_stream` falls back to ``Tensor.copy_`` everywhere here, or None."""
    _load_memcpy()
    return _memcpy_error


def plain_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst[...] = src`` is one flat byte copy on one CUDA device."""
    return (dst.dtype == src.dtype and dst.numel() == src.numel() and dst.is_cuda and src.is_cuda
            and dst.get_device() == src.get_device() and dst.is_contiguous()
            and src.is_contiguous())


def copy_on_stream(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream,
                   driver: bool) -> None:
    """``dst[...] = src``, queued on ``stream``, which must be the current stream (the fallback,
    ``Tensor.copy_``, queues there). With ``driver`` (the caller reads
    :func:`driver_copy_enabled` once per call of its own) a plain copy goes to
    ``cuMemcpyDtoDAsync``. The source and destination must not overlap (the fused collectives
    copy between a caller's tensor and a workspace)."""
    global driver_copies
    fn = (_memcpy if _memcpy is not None else _load_memcpy()) if driver else None
    if fn is None or not plain_copy(dst, src):
        dst.copy_(src)
        return
    driver_copies += 1
    nbytes = src.numel() * src.element_size()
    if nbytes:
        rc = fn(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"megatron-flux: cuMemcpyDtoDAsync of {nbytes} bytes on device "
                               f"{src.get_device()} failed with CUresult {rc}")
