"""Which CUDA graph a captured fused call belongs to, and its place in that graph.

A fused call captured into a graph cannot take a fresh epoch per replay: whatever the host
passes is frozen into the graph. Captured calls therefore run on workspaces of their own
(``"ag:graph"``, ``"rs:graph"``) with a constant signal value (``CAPTURED_EPOCH``): each
consumer waits for its words to reach it and, after the call, sets its own words of that
parity back to zero (a memset queued behind the call). Why that is safe is the argument that
makes epochs safe (:mod:`megatron_flux.comm.workspace`): consecutive calls on one workspace
alternate its two halves, and a peer writes a half again only in the call after next, which
needs what this rank sends after its reset.

The halves alternate by position inside one graph (:class:`CaptureSequence`): call ``i`` of a
graph on a workspace takes parity ``i & 1``. Graphs replay in any order and may hold an odd
number of calls, so consecutive calls of *different* graphs may land on the same half. The
first call of each graph on a workspace is therefore preceded by a fence, a bounded barrier of
the TP group on words of its own (:func:`megatron_flux.kernels.ready_barrier.launch_ready_barrier`
then a reset): every rank has finished its previous call on that workspace, reset included,
before anyone pushes into it again.
"""

from __future__ import annotations

import ctypes
from typing import Dict, Tuple

import torch

from megatron_flux.comm.driver import load_driver_function

#: the signal value of every captured call (signals are reset to zero after each call)
CAPTURED_EPOCH = 1

_get_info = None  # (cuStreamGetCaptureInfo_v2 or None, why not or None), looked up on first use


def capture_id(stream: torch.cuda.Stream) -> int:
    """The id of the capture ``stream`` takes part in (0: none). Unique per capture in the
    process, so it names the graph being built."""
    global _get_info
    if _get_info is None:
        _get_info = load_driver_function(
            ("cuStreamGetCaptureInfo_v2",),
            (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p))
    fn, why_not = _get_info
    if fn is None:
        raise RuntimeError(f"megatron-flux: capture id unavailable: {why_not}")
    status, cid = ctypes.c_int(0), ctypes.c_uint64(0)
    rc = fn(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(status), ctypes.byref(cid),
            None, None, None)
    if rc != 0:
        raise RuntimeError(f"megatron-flux: cuStreamGetCaptureInfo failed with CUresult {rc}")
    return int(cid.value) if status.value == 1 else 0  # CU_STREAM_CAPTURE_STATUS_ACTIVE


class CaptureSequence:
    """Per (graph, workspace): how many captured calls that graph has made on it so far."""

    def __init__(self, limit: int = 4096):
        self._counts: Dict[Tuple[int, object], int] = {}
        self._limit = limit

    def next(self, graph: int, workspace_key) -> Tuple[int, bool]:
        """``(parity, first)`` of the next captured call of ``graph`` on the workspace:
        parities alternate from 0 inside each graph; ``first`` is True for a graph's first
        call on the workspace (the call that needs the fence)."""
        key = (graph, workspace_key)
        count = self._counts.get(key)
        if count is None:
            if len(self._counts) >= self._limit:  # graphs captured long ago never come back
                self._counts.clear()
            count = 0
        self._counts[key] = count + 1
        return count & 1, count == 0
