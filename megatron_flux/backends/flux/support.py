"""What the fused kernels can run: the operand checks behind ``FluxBackend.unsupported_reason``,
and the alignment fix-up every call applies."""

from __future__ import annotations

import socket
from typing import Callable, Optional

import torch
import torch.distributed as dist


def signature_reason(a, b, group, capability, current_device: int) -> Optional[str]:
    """Why the fused kernels cannot run ``a @ b`` over ``group``, from the operands' signature
    alone (shapes, strides, dtypes, device) and the index of the current CUDA device, or
    ``None``. The kernels launch on the current device's stream (Triton's rule) while the
    workspaces, events, side streams and copies follow the operands' device, so both operands
    must be on the current device. ``capability()`` gives the device's compute capability
    (asked last: it is the only query that touches the driver)."""
    world = group.size() if group is not None else 1
    if world < 2:
        return "tensor-parallel group has one rank"
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {a.dtype} (fused kernels take bfloat16/float16)"
    if b.dtype != a.dtype:
        return f"operand dtypes differ ({a.dtype} vs {b.dtype})"
    if b.device != a.device:
        return f"operands are on different devices ({a.device} and {b.device})"
    if a.device.index != current_device:
        return (f"operands are on {a.device} but the current CUDA device is cuda:{current_device} "
                "(the kernels launch on the current device: torch.cuda.set_device first)")
    if a.dim() != 2 or b.dim() != 2:
        return "operands must be 2-D"
    if not a.is_contiguous():
        return "input is not contiguous"
    if not (b.stride(1) == 1 or b.stride(0) == 1):
        return f"weight strides {tuple(b.stride())} are neither row- nor column-major"
    k, n = b.shape
    if a.shape[1] != k:
        return f"shapes {tuple(a.shape)} x {tuple(b.shape)} do not chain"
    if k % 8 or n % 8:
        return f"k={k} and n={n} must be multiples of 8 (16-byte TMA strides)"
    lead = b.stride(0) if b.stride(1) == 1 else b.stride(1)
    if lead % 8:
        return f"weight leading stride {lead} is not a multiple of 8 (16-byte TMA strides)"
    if capability()[0] < 9:
        return "fused kernels need compute capability >= 9.0 (TMA)"
    if a.shape[0] == 0:
        return "empty input"
    return None


def group_reason(group, device, *, allow_several_queues: bool = False,
                 gather: Callable = dist.all_gather_object,
                 peer_access: Callable = torch.cuda.can_device_access_peer,
                 queues: Optional[Callable] = None) -> Optional[str]:
    """Why the fused kernels cannot span ``group`` from ``device``: its ranks on more than one
    host (torch symmetric memory maps peers' memory within a host), a peer's GPU without peer
    access from this one, or a rank whose GPU is fed through several hardware queues
    (:func:`~megatron_flux.comm.queues.hardware_queues`, ``queues`` here; unless
    ``allow_several_queues``); or ``None``. A collective over ``group``: its ranks ask at their
    first fused call, which they make in the same order (the same shapes, in SPMD), and all of
    them get the same answer."""
    if queues is None:
        from megatron_flux.comm.queues import hardware_queues as queues
    here = (socket.gethostname(), device.index, queues(device))
    ranks = [None] * group.size()
    gather(ranks, here, group=group)
    hosts = sorted({host for host, _, _ in ranks})
    if len(hosts) > 1:
        return (f"the tensor-parallel group spans {len(hosts)} hosts ({', '.join(hosts)}); "
                "symmetric memory maps peers' memory within one host")
    for _, index, _ in ranks:
        if index != device.index and not peer_access(device.index, index):
            return f"GPU {device.index} has no peer access to GPU {index} (P2P)"
    several = [rank for rank, (_, _, answer) in enumerate(ranks) if answer == "several"]
    if several and not allow_several_queues:
        return (f"CUDA_DEVICE_MAX_CONNECTIONS=1 is not in effect on group rank(s) "
                f"{', '.join(map(str, several))}: with several hardware queues a fused grid "
                "waiting on its peers can deadlock beside another kernel that waits across "
                "ranks. Set it before the process starts (setting it after CUDA initialised "
                "has no effect), or MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES=1 to run fused anyway")
    return None


def aligned(t):
    """``t``, or a copy when its address is not 16-byte aligned (TMA needs 16).

    Alignment is not a reason to fall back: ``auto`` decides on each rank alone, and every other
    input to that decision (shapes, dtypes, strides, device) is the same on all ranks of an SPMD
    program, while addresses need not be; ranks choosing differently would pair a fused kernel
    with an NCCL collective."""
    if t.data_ptr() % 16 == 0:
        return t
    if t.stride(1) == 1:
        return t.clone(memory_format=torch.contiguous_format)
    return t.t().clone(memory_format=torch.contiguous_format).t()
