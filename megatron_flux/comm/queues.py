"""Whether this process's CUDA context feeds the GPU through one hardware queue.

The fused kernels are persistent grids whose programs spin on their peers' signals while they
hold their SMs. Another kernel that waits across ranks (NCCL's collectives, on their own
streams) then needs every rank to start the two in the same order: with several hardware queues
the GPU may start the grid first on one rank and the collective first on another, and at TP 3
and up the waits close a cycle (rank A's grid waits for rank C's, which waits for SMs that C's
collective holds, which waits for B's, queued behind B's grid, which waits for A's). With
``CUDA_DEVICE_MAX_CONNECTIONS=1`` in effect every stream shares one queue, so kernels start in
the order the ranks queue them, which SPMD keeps the same. The variable counts only when it is
set before the driver initialises: setting it after ``torch.cuda.is_available()`` does nothing
(``benchmarks/results/connections-probe-h200-2026-11-28.json``).

:func:`hardware_queues` asks the context, not the environment: stream A waits
(``cuStreamWaitValue32``) on a word in pinned host memory, and a small kernel and an event
queued after it on stream B are watched for :data:`PROBE_SECONDS`. With one queue the wait at
its head holds them; with several the event completes at once. The host then writes the word,
so neither stream stays held.
"""

from __future__ import annotations

import time
from typing import Dict

import torch

from megatron_flux.comm.signals import stream_wait_unavailable_reason, wait_address_on_stream

#: how long the probe watches stream B (its kernel, not held, completes in microseconds)
PROBE_SECONDS = 0.1

ONE = "one"
SEVERAL = "several"

_cache: Dict[int, str] = {}


def hardware_queues(device: torch.device) -> str:
    """:data:`ONE`, :data:`SEVERAL`, or ``"unknown (why)"`` for ``device``'s context (probed
    once per device; not inside a CUDA graph capture, where nothing may wait on the host)."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index in _cache:
        return _cache[index]
    if torch.cuda.is_current_stream_capturing():
        return "unknown (asked inside a CUDA graph capture)"
    why = stream_wait_unavailable_reason()
    if why is not None:
        answer = f"unknown ({why})"
    else:
        answer = _probe(torch.device("cuda", index))
    _cache[index] = answer
    return answer


def _probe(device: torch.device) -> str:
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    with torch.cuda.device(device):
        marker = torch.zeros(1, dtype=torch.int32, device=device)
        held, watched = torch.cuda.Stream(device), torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        wait_address_on_stream(word.data_ptr(), 1, held)
        with torch.cuda.stream(watched):
            marker.fill_(1)  # a kernel: an event on an idle stream may complete without one
        event = torch.cuda.Event()
        event.record(watched)
        deadline = time.perf_counter() + PROBE_SECONDS
        done = event.query()
        while not done and time.perf_counter() < deadline:
            time.sleep(0.001)
            done = event.query()
        word[0] = 1  # release the held stream either way
        torch.cuda.synchronize(device)
    return SEVERAL if done else ONE
