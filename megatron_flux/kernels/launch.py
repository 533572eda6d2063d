"""Launching the fused kernels with less host time than Triton's ``JITFunction.run`` (opt-in).

Triton binds and specialises every argument on every launch, then looks the compiled kernel up:
about 25 µs per launch of these kernels on the 2×H200 box, 2–3 launches per fused op, hundreds
of ops per training step, in steps that are host-bound at micro-batch 1
(``benchmarks/NOTES.md``, session 5).

With ``MEGATRON_FLUX_DIRECT_LAUNCH=1`` a :class:`KernelLauncher` sends the first launch of each
specialisation through Triton, keeps the compiled kernel Triton returns, and later calls it
directly. Its key refines Triton's own specialisation (so two launches Triton would compile
differently never share an entry):

* every tensor: dtype, and whether its address is 16-byte aligned;
* every host TMA descriptor: its tensor's dtype, block shape, rank and padding;
* every int: whether it is 1, whether it is divisible by 16, and whether it fits in int32 (also
  for ``do_not_specialize`` ints, which Triton still types by width);
* every constexpr, ``num_warps`` and ``num_stages``.

Launches with a Triton launch hook installed (profilers), under the interpreter, or with the
variable unset go through Triton as before; without an active hook the direct call passes no
hooks and no launch metadata, as Triton itself does then.

Status (session 6, 2×H200): ``tests/test_flux_gpu.py`` passes with it on (its
``1-direct-launch`` case asserts the direct path ran). It saved 0.01–0.03 ms of host time per
fc1/fc2 layer call (fwd+bwd), within the trials' spread, and the training step did not move
measurably (``benchmarks/NOTES.md``, session 6). So it stays opt-in.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Sequence, Tuple

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megatron_flux.kernels.config import interpreting

ENV_DIRECT_LAUNCH = "MEGATRON_FLUX_DIRECT_LAUNCH"
_INT32 = (-(2**31), 2**31)


def direct_launch_enabled() -> bool:
    return os.environ.get(ENV_DIRECT_LAUNCH, "0") == "1"


def specialization_key(args: Sequence[Any], constexprs: Tuple, options: Tuple) -> tuple:
    """The key described in the module docstring (runtime ``args`` in kernel order)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, TensorDescriptor):  # Triton types it by dtype and block shape
            key.append(("desc", a.base.dtype, tuple(a.block_shape), len(a.shape), a.padding))
        elif isinstance(a, bool):
            key.append(("b", a))
        elif isinstance(a, int):
            key.append((a == 1, a & 15 == 0, _INT32[0] <= a < _INT32[1]))
        else:
            raise TypeError(f"direct launch: unsupported argument type {type(a).__name__}")
    return (tuple(key), constexprs, options)


def _hook_active(hook) -> bool:
    """A launch hook that would run: not ``None`` and, for Triton >= 3.9's ``HookChain``, not
    empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hook_holder():
    """Where this Triton keeps its launch hooks (``triton.knobs.runtime`` from 3.4 on, the
    ``CompiledKernel`` class before), looked up once: :func:`_launch_hooks` runs per launch."""
    global _HOOKS
    if _HOOKS is None:
        try:
            from triton import knobs

            _HOOKS = knobs.runtime
        except (ImportError, AttributeError):
            from triton.compiler.compiler import CompiledKernel

            _HOOKS = CompiledKernel
    return _HOOKS


_HOOKS = None


def _launch_hooks():
    holder = _hook_holder()
    return holder.launch_enter_hook, holder.launch_exit_hook


class KernelLauncher:
    """``launcher(grid, args, constexprs, num_warps=, num_stages=)`` launches ``jit_fn`` on the
    current stream: ``args`` are the runtime arguments in the kernel's order, ``constexprs`` a
    dict of the constexpr arguments (all of them, in any order)."""

    def __init__(self, jit_fn):
        import inspect

        self.jit_fn = jit_fn
        self._compiled: Dict[tuple, Any] = {}
        self._occupancy: Dict[tuple, int] = {}
        # the interpreter's functions have no parameter list: they always launch through Triton
        params = list(getattr(jit_fn, "params", None) or [])
        n_runtime = sum(not p.is_constexpr for p in params)
        # the direct call passes every argument in declaration order: runtime ones first here
        self._direct_ok = bool(params) and all(not p.is_constexpr for p in params[:n_runtime])
        self._constexpr_params = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                                  for p in params[n_runtime:]]
        self._n_runtime = n_runtime
        self.direct_calls = 0  # launches that skipped Triton's binder (tests check it is used)

    def occupancy(self, grid: int, args: Sequence[Any], constexprs: Dict[str, Any], *,
                  num_warps: int, num_stages: int = 3) -> int:
        """Programs of this kernel, compiled for these arguments (nothing is launched), that fit
        on one SM at once (:mod:`.residency`); cached per constexprs and options. Unbounded
        under the interpreter, which runs programs one after another."""
        if interpreting():
            return 1 << 30
        device = next(a for a in args if isinstance(a, torch.Tensor)).get_device()
        key = (tuple(sorted(constexprs.items())), num_warps, num_stages, device)
        fit = self._occupancy.get(key)
        if fit is None:
            from megatron_flux.kernels.residency import compiled_occupancy

            compiled = self.jit_fn.warmup(*args, grid=(grid,), **constexprs, num_warps=num_warps,
                                          num_stages=num_stages)
            fit = self._occupancy[key] = compiled_occupancy(compiled)
        return fit

    def __call__(self, grid: int, args: Sequence[Any], constexprs: Dict[str, Any], *, num_warps: int,
                 num_stages: int = 3) -> None:
        if (not self._direct_ok or not direct_launch_enabled() or interpreting()
                or any(_hook_active(h) for h in _launch_hooks())):
            self.jit_fn[(grid,)](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            return
        cvals = tuple(sorted(constexprs.items()))
        key = specialization_key(args, cvals, (num_warps, num_stages))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.jit_fn[(grid,)](*args, **constexprs, num_warps=num_warps,
                                            num_stages=num_stages)
            self._compiled[key] = compiled
            return
        if len(args) != self._n_runtime:
            name = getattr(self.jit_fn, "__name__", "kernel")
            raise TypeError(f"{name}: {len(args)} runtime arguments, the kernel takes "
                            f"{self._n_runtime}")
        values = list(args) + [constexprs.get(name, default) for name, default in self._constexpr_params]
        device = next(a for a in args if isinstance(a, torch.Tensor)).get_device()
        stream = torch._C._cuda_getCurrentRawStream(device)
        self.direct_calls += 1
        compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *values)
