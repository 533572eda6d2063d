"""Host-side signal operations queued on a stream (no SM needed).

``write_signal`` sets a signal word after the stream's earlier copies; ``wait_signal_on_stream``
holds a stream (a copy-engine side stream) until a word that a running kernel raises reaches a
value. Both can be captured into a CUDA graph (as memory-operation nodes); captured fused calls
write the constant value of :mod:`megatron_flux.comm.capture` and never wait on a stream (their
GEMM+RS pushes from the SMs).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch._C._distributed_c10d import _SymmetricMemory

from megatron_flux.comm.driver import load_driver_function

_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_wait_value32 = None  # (cuStreamWaitValue32 or None, why not or None), looked up on first use


def write_signal(flags_u32: torch.Tensor, index: int, value: int) -> None:
    """Queue ``flags_u32[index] = value`` on the current stream: ``cuStreamWriteValue32``, a
    stream memory op ordered after the stream's earlier copies (with a system-scope fence first)."""
    _SymmetricMemory.stream_write_value32(flags_u32, index, value)


def _load_wait_value32():
    """``cuStreamWaitValue32`` from the CUDA driver (torch exposes only the write):
    ``(function, None)`` or ``(None, why not)``."""
    global _wait_value32
    if _wait_value32 is None:
        _wait_value32 = load_driver_function(
            ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"),
            (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint))
    return _wait_value32


def stream_wait_unavailable_reason() -> Optional[str]:
    """Why :func:`wait_signal_on_stream` cannot run here, or None."""
    return _load_wait_value32()[1]


def wait_signal_on_stream(flags_u32: torch.Tensor, index: int, value: int,
                          stream: Optional[torch.cuda.Stream] = None) -> None:
    """Queue on ``stream`` (default: the current one): wait until ``flags_u32[index] >= value``
    (unsigned), then go on with the stream's later work (``cuStreamWaitValue32``, GEQ). The word
    must be raised by work that does not itself wait for this stream, or the stream never moves
    again: the fused GEMM+RS raises it from a producer phase that waits for nothing."""
    if flags_u32.dtype not in (torch.uint32, torch.int32) or not flags_u32.is_cuda:
        raise ValueError("wait_signal_on_stream: flags must be a CUDA int32/uint32 tensor")
    if stream is None:
        stream = torch.cuda.current_stream(flags_u32.device)
    wait_address_on_stream(flags_u32.data_ptr() + 4 * index, value, stream)


def wait_address_on_stream(addr: int, value: int, stream: torch.cuda.Stream) -> None:
    """:func:`wait_signal_on_stream` on the 32-bit word at ``addr`` (device memory, or pinned
    host memory, which the host can then release)."""
    fn, why_not = _load_wait_value32()
    if fn is None:
        raise RuntimeError(f"megatron-flux: stream wait unavailable: {why_not}")
    rc = fn(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(addr), ctypes.c_uint32(value),
            _CU_STREAM_WAIT_VALUE_GEQ)
    if rc != 0:
        raise RuntimeError(f"megatron-flux: cuStreamWaitValue32 failed with CUresult {rc}")
