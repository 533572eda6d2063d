"""What the fused kernels can run: the operand checks behind ``FluxBackend.unsupported_reason``,
and the alignment fix-up every call applies."""

from __future__ import annotations

import socket
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist


def off_current_device_error(what: str, device, current_device: int) -> ValueError:
    """The error for an operand off the current CUDA device. Not a reason to run NCCL instead:
    a rank that fell back alone (say, a loop that never called ``torch.cuda.set_device``, where
    rank 0's operands are on its current device and the others' are not) would pair an NCCL
    collective with its peers' fused kernels or their support check, and hang."""
    return ValueError(
        f"megatron-flux: {what} on {device} but the current CUDA device is cuda:{current_device}: "
        f"the fused kernels launch on the current device. Call "
        f"torch.cuda.set_device({device.index}) first (Megatron does).")


def signature_reason(a, b, group, capability, current_device: int) -> Optional[str]:
    """Why the fused kernels cannot run ``a @ b`` over ``group``, from the operands' signature
    alone (shapes, strides, dtypes, device) and the index of the current CUDA device, or
    ``None``. The kernels launch on the current device's stream (Triton's rule) while the
    workspaces, events, side streams and copies follow the operands' device, so operands on
    another device than the current one raise :func:`off_current_device_error` (every rank
    the same way, rather than one rank running NCCL). ``capability()`` gives the device's
    compute capability (asked last: it is the only query that touches the driver)."""
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
        raise off_current_device_error("the operands are", a.device, current_device)
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


def local_peer_access(device) -> Tuple[str, Dict[str, bool]]:
    """This process's view of its GPUs: ``device``'s UUID and, for every other GPU visible to
    this process, its UUID: whether ``device`` has peer access to it. UUIDs name a GPU alike in
    every process, where device indices need not (per-rank ``CUDA_VISIBLE_DEVICES``)."""

    def uuid(index: int) -> str:
        return str(torch.cuda.get_device_properties(index).uuid)

    return uuid(device.index), {
        uuid(j): bool(torch.cuda.can_device_access_peer(device.index, j))
        for j in range(torch.cuda.device_count()) if j != device.index}


def group_reason(group, device, *, allow_several_queues: bool = False,
                 gather: Callable = dist.all_gather_object,
                 peers: Callable = local_peer_access,
                 queues: Optional[Callable] = None) -> Optional[str]:
    """Why the fused kernels cannot span ``group`` from ``device``: its ranks on more than one
    host (torch symmetric memory maps peers' memory within a host), a pair of its GPUs without
    peer access, or a rank whose GPU is fed through several hardware queues
    (:func:`~megatron_flux.comm.queues.hardware_queues`, ``queues`` here; unless
    ``allow_several_queues``); or ``None``. A collective over ``group``: its ranks ask at their
    first fused call, which they make in the same order (the same shapes, in SPMD).

    Every rank gathers what every rank sees (host, GPU UUID, hardware queues, and the peer
    access from its GPU to each GPU visible to it: ``peers``, :func:`local_peer_access`) and
    decides from that alone, so all of them reach the same verdict whatever each process can
    see. A pair is judged by the first rank's view of the second's GPU, else (not visible to
    it, as under per-rank ``CUDA_VISIBLE_DEVICES``) by the second's view of the first's; a
    pair that neither sees is not refused (nothing here can ask). A rank whose query failed
    makes the reason."""
    if queues is None:
        from megatron_flux.comm.queues import hardware_queues as queues
    try:
        gpu, access = peers(device)
    except Exception as exc:  # reported through the gather: every rank must reach it
        gpu, access = None, f"{type(exc).__name__}: {exc}"
    here = (socket.gethostname(), gpu, queues(device), access)
    ranks = [None] * group.size()
    gather(ranks, here, group=group)
    hosts = sorted({host for host, _, _, _ in ranks})
    if len(hosts) > 1:
        return (f"the tensor-parallel group spans {len(hosts)} hosts ({', '.join(hosts)}); "
                "symmetric memory maps peers' memory within one host")
    for rank, (_, _, _, access) in enumerate(ranks):
        if isinstance(access, str):
            return f"group rank {rank} could not query its GPUs' peer access ({access})"
    for rank, (_, gpu, _, access) in enumerate(ranks):
        for peer, (_, other, _, other_access) in enumerate(ranks):
            if other == gpu:
                continue
            ok = access.get(other)
            if ok is None:
                ok = other_access.get(gpu)
            if ok is False:
                return (f"no peer access (P2P) between the GPUs of group ranks {rank} ({gpu}) "
                        f"and {peer} ({other})")
    several = [rank for rank, (_, _, answer, _) in enumerate(ranks) if answer == "several"]
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
