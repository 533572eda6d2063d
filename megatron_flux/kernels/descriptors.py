"""Where the fused Triton kernels' TMA descriptors come from.

Device-built (``tl.make_tensor_descriptor``, once per program): a launch passes plain
pointers, and Triton takes the descriptors' global scratch from the allocator set with
``triton.set_allocator``, a context variable: autograd runs backward on its own thread, where
it is unset, so :func:`ensure_descriptor_allocator` (re)installs it before every launch unless
the caller installed one. Every program then spends its first microseconds writing and fencing
descriptors before its first TMA load.

Host-encoded (:func:`host_descriptor`, ``triton.tools.tensor_descriptor.TensorDescriptor``
kernel arguments): Triton's launcher encodes each one on the host (``cuTensorMapEncodeTiled``)
and passes it as a kernel parameter. The kernels take A and B this way (AG+GEMM also its
gathered rows and output, GEMM+RS its own tiles' output and slots; the Gluon kernels through
:func:`megatron_flux.kernels.gluon_ws.host_descriptor`, with their buffers' layouts) when
their ``host_descriptors`` argument is true (``FluxOptions.host_descriptors``); descriptors of
peers' buffers stay device-built. With communication off on one H200, the plain yardstick ran
0.3-2 % faster with host descriptors at m >= 1024 and 2-8 % at m <= 512.
"""

from typing import Dict, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor



#: validated descriptor fields per (class, dtype, shape, strides, block shape, layout); bounded
_TEMPLATES: Dict[tuple, dict] = {}
_MAX_TEMPLATES = 4096


def bind_descriptor(cls, t: torch.Tensor, shape: Sequence[int], strides: Sequence[int],
                    block_shape: Sequence[int], layout=None):
    """``cls(t, shape, strides, block_shape[, layout])`` (Triton's or Gluon's host
    ``TensorDescriptor``), validated by its constructor once per geometry.

    A launch builds up to four descriptors, and the constructor's checks (ranks, alignment of the
    strides, power-of-two blocks, the layout) cost 1.2-1.6 µs each on this repo's CPU machine,
    several times that on the GPU boxes' hosts. All but one depend on the geometry alone, so
    later descriptors of the same geometry copy the checked fields and test only what changes
    with the tensor: its 16-byte alignment (and its dtype is part of the key)."""
    if t.data_ptr() % 16:
        raise ValueError(f"TMA descriptor base {t.data_ptr():#x} is not 16-byte aligned")
    # a layout by identity: the template keeps it alive, and hashing it costs more than a call
    key = (cls, t.dtype, tuple(shape), tuple(strides), tuple(block_shape), id(layout))
    fields = _TEMPLATES.get(key)
    if fields is None:
        args = (t, list(shape), list(strides), list(block_shape)) + ((layout,) if layout is not None else ())
        desc = cls(*args)  # the constructor's own checks, with this tensor
        if len(_TEMPLATES) >= _MAX_TEMPLATES:
            _TEMPLATES.clear()
        fields = _TEMPLATES[key] = {k: v for k, v in vars(desc).items() if k != "base"}
        return desc
    desc = object.__new__(cls)
    desc.__dict__.update(fields)
    desc.base = t
    return desc


def host_descriptor(t: torch.Tensor, shape: Sequence[int], strides: Sequence[int],
                    block_shape: Sequence[int]):
    """A host TMA descriptor of ``t``'s memory seen as ``shape`` / ``strides`` (elements)."""
    return bind_descriptor(TensorDescriptor, t, shape, strides, block_shape)


@triton.jit
def b_descriptor(b, N, K, ldb, B_KN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HOST_DESC: tl.constexpr):
    """B's TMA descriptor: ``b`` itself when it arrived host-encoded (HOST_DESC), else built on
    the device over ``b``'s memory as ``[K, N]`` (B_KN) or ``[N, K]``, leading stride ``ldb``."""
    if HOST_DESC:
        desc = b
    elif B_KN:
        desc = tl.make_tensor_descriptor(b, [K, N], [ldb, 1], [BLOCK_K, BLOCK_N])
    else:
        desc = tl.make_tensor_descriptor(b, [N, K], [ldb, 1], [BLOCK_N, BLOCK_K])
    return desc


@triton.jit
def segments_descriptor(ptr, rows, cols, WORLD: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                        BLOCK_COLS: tl.constexpr, RAGGED: tl.constexpr, HOST_DESC: tl.constexpr):
    """The TMA descriptor of ``WORLD`` row-major segments of ``[rows, cols]`` laid end to end:
    ``ptr`` itself when it arrived host-encoded (HOST_DESC); else built on the device as
    ``[WORLD, rows, cols]`` with a ``[1, BLOCK_ROWS, BLOCK_COLS]`` box (RAGGED: a box never
    reads or writes past its segment's last row), or as one ``[WORLD * rows, cols]`` operand."""
    if HOST_DESC:
        desc = ptr
    elif RAGGED:
        desc = tl.make_tensor_descriptor(ptr, [WORLD, rows, cols], [rows * cols, cols, 1],
                                         [1, BLOCK_ROWS, BLOCK_COLS])
    else:
        desc = tl.make_tensor_descriptor(ptr, [WORLD * rows, cols], [cols, 1],
                                         [BLOCK_ROWS, BLOCK_COLS])
    return desc


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator() -> None:
    """Install a torch-backed scratch allocator in this context if none is installed."""
    current = _allocation._allocator.get()
    if current is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_torch_scratch)
