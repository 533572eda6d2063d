"""How many programs of a persistent grid may share one SM (``GemmConfig.programs_per_sm``).

Two programs per SM let one program's epilogue (rounding, stores, GEMM+RS's reduction reads)
run beside the other's K loop, which one program of Triton's non-warp-specialized persistent
loop cannot do. Measured on H200 with 128x128 tiles, it
beat the shipped configs by no more than run-to-run noise, so every config ships with 1 and the
tuner does not search it; the knob is there for other GPUs and shapes.

A grid of ``p x SMs`` programs is only safe when all of them are resident at once: a GEMM+RS
consumer spins on the peer's grid-done signal, which is raised once every one of the peer's
programs has produced, and stream-K programs wait on each other's partials. A program that
never got an SM would leave those waits to run out. So the launchers ask CUDA's occupancy
calculator (``cuOccupancyMaxActiveBlocksPerMultiprocessor``) about the compiled kernel, and run
fewer programs per SM, with one warning, when fewer fit.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Callable, Set, Tuple


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def occupancy_per_sm(function_handle: int, threads: int, dynamic_smem: int) -> int:
    """Blocks of ``threads`` threads and ``dynamic_smem`` bytes of dynamic shared memory of the
    loaded CUDA function ``function_handle`` that one SM holds at once (the CUDA driver's
    answer, registers and static shared memory included)."""
    count = ctypes.c_int(0)
    rc = _libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(count), ctypes.c_void_p(function_handle), ctypes.c_int(threads),
        ctypes.c_size_t(dynamic_smem))
    if rc != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed (CUresult {rc})")
    return count.value


def compiled_occupancy(compiled) -> int:
    """Programs of a Triton ``CompiledKernel`` that fit on one SM."""
    compiled._init_handles()  # loads the binary (Triton does it lazily, on the first launch)
    md = compiled.metadata
    threads = md.num_warps * getattr(md, "warp_size", 32)
    return occupancy_per_sm(compiled.function, threads, md.shared)


_WARNED: Set[Tuple] = set()


def resident_programs_per_sm(cfg, num_sms: int, plan: Callable[[int], Tuple], launcher,
                             op: str) -> int:
    """The programs per SM to launch for ``cfg`` on ``num_sms`` SMs. ``plan(p)`` gives the
    launch at ``p`` programs per SM as ``(grid, runtime args, constexprs)``; ``launcher`` (a
    :class:`~megatron_flux.kernels.launch.KernelLauncher`) says how many programs of the kernel
    compiled for it fit on one SM. ``cfg.programs_per_sm`` is kept when the whole grid fits,
    else 1, with one warning per ``op`` and ``cfg`` (formatted only then: this runs on every
    launch). 1 is not checked: it is how the kernels always ran (a kernel that does not fit
    once fails at launch with Triton's own error)."""
    requested = cfg.programs_per_sm
    if requested <= 1:
        return 1
    grid, args, constexprs = plan(requested)
    fit = launcher.occupancy(grid, args, constexprs, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages)
    if grid <= num_sms * fit:
        return requested
    if (op, cfg) not in _WARNED:
        _WARNED.add((op, cfg))
        warnings.warn(f"megatron-flux {op} {cfg}: programs_per_sm={requested} asked for, but "
                      f"only {fit} of this kernel fit on one SM (registers / shared memory); "
                      f"running one program per SM", stacklevel=3)
    return 1
