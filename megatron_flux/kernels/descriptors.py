"""Scratch memory for device-side TMA descriptors.

The fused kernels build their tensor descriptors on the device (``tl.make_tensor_descriptor``),
once per program, so a launch passes plain pointers instead of having the host encode four TMA
descriptors per call. Triton takes the descriptors' global scratch from the allocator set with
``triton.set_allocator``, a context variable: autograd runs backward on its own thread, where
it is unset, so it is (re)installed before every launch unless the caller installed one.
"""

import torch
import triton
from triton.runtime import _allocation


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator() -> None:
    """Install a torch-backed scratch allocator in this context if none is installed."""
    current = _allocation._allocator.get()
    if current is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)
