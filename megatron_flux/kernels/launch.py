"""Launching the fused kernels with less host time than Triton's ``JITFunction.run``.

Triton binds and specialises every argument on every launch, then looks the compiled kernel up.
On a slow host that is a good part of a fused op's host time: measured on 2xH100,
``JITFunction.run`` took 75-90 µs a launch, two launches a layer call, in training steps that are
host-bound at micro-batch 1.

So a :class:`KernelLauncher` sends the first launch of each specialisation through Triton, keeps
the compiled kernel Triton returns, and later calls its launcher directly. Its key refines
Triton's own specialisation (so two launches Triton would compile differently never share an
entry):

* every tensor: dtype, and whether its address is 16-byte aligned;
* every host TMA descriptor (Triton's or Gluon's): its tensor's dtype, block shape, rank,
  padding and (Gluon) shared-memory layout;
* every int: whether it is 1, whether it is divisible by 16, and whether it fits in int32 (also
  for ``do_not_specialize`` ints, which Triton still types by width);
* every constexpr, the current device, and the launch options (``num_warps``, ``num_stages``,
  Gluon's ``maxnreg``).

Launches with a Triton launch hook installed (profilers), under the interpreter, or with
``direct=False`` (``FluxOptions.direct_launch``) go through Triton as before; without an active hook the direct
call passes no hooks and no launch metadata, as Triton itself does then.

Launches under CUDA graph capture also go through Triton (the fused backend refuses capture;
this keeps any other caller's capture as Triton makes it).

On by default: on 2xH100, in one process alternating with Triton's launch over 15 trials, it
saved a median 60 µs per fc1 layer call (forward + backward, lower in 11 of 15 paired trials)
and 74 µs per fc2 call (9 of 15), of about 1.1 and 0.8 ms
(``benchmarks/experiments/host_launch_ab.py``; a second run, 21 trials: 93 and 74 µs, in 17
and 15 of 21). On 2xH200 it saved 0.01-0.03 ms per fc1/fc2 layer call, within the spread. Calling one level below
``CompiledKernel.run`` (Triton's C launcher with the descriptors expanded once) saved nothing
measurable on top and was not kept.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from megatron_flux.kernels.config import interpreting

_INT32 = (-(2**31), 2**31)


# argument kinds of specialization_key, per Python type (filled on first sight of a type)
_TENSOR, _INT, _BOOL, _DESC = range(4)
_KINDS: Dict[type, int] = {}


def _descriptor_types() -> tuple:
    """Triton's host TMA descriptor class, and Gluon's where this Triton has one."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    types = [TensorDescriptor]
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    except ImportError:  # pragma: no cover - a Triton without Gluon
        pass
    else:
        types.append(GluonDescriptor)
    return tuple(types)


def _kind(t: type) -> int:
    kind = _KINDS.get(t)
    if kind is not None:
        return kind
    if issubclass(t, torch.Tensor):
        kind = _TENSOR
    elif issubclass(t, bool):
        kind = _BOOL
    elif issubclass(t, int):
        kind = _INT
    elif issubclass(t, _descriptor_types()):
        kind = _DESC
    else:
        raise TypeError(f"direct launch: unsupported argument type {t.__name__}")
    _KINDS[t] = kind
    return kind


def specialization_key(args: Sequence[Any], constexprs: Tuple, options: Tuple) -> tuple:
    """The key described in the module docstring (runtime ``args`` in kernel order). Flat: a
    tensor adds its dtype and alignment, an int one small code, a bool and a descriptor one
    tuple each, so the kinds can be told apart position by position."""
    key = []
    add = key.append
    for a in args:
        kind = _KINDS.get(type(a))
        if kind is None:
            kind = _kind(type(a))
        if kind == _TENSOR:
            add(a.dtype)
            add(a.data_ptr() & 15 == 0)
        elif kind == _INT:
            add((a == 1) | (a & 15 == 0) << 1 | (_INT32[0] <= a < _INT32[1]) << 2)
        elif kind == _BOOL:
            add(("b", a))
        else:
            add(("desc", a.base.dtype, tuple(a.block_shape), len(a.shape), a.padding,
                 getattr(a, "layout", None)))
    return (tuple(key), constexprs, options)


def _capturing() -> bool:
    """A CUDA graph is being captured on the current stream: launch through Triton, as
    before the direct launch existed (the fused backend itself refuses capture)."""
    return torch.cuda.is_current_stream_capturing()


def _current_device() -> int:
    return torch.cuda.current_device()


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
    """``launcher(grid, args, constexprs, num_warps=, num_stages=, direct=, **options)`` launches
    ``jit_fn`` (a Triton or Gluon kernel) on the current stream: ``args`` are the runtime
    arguments in the kernel's order, ``constexprs`` a dict of the constexpr arguments (any
    subset, in any order, the same order at one call site: the key keeps it), ``num_stages``
    ``None`` for kernels that take none (Gluon), ``options`` further compile options
    (``maxnreg``), ``direct=False`` every launch through Triton."""

    def __init__(self, jit_fn):
        import inspect

        self.jit_fn = jit_fn
        self._compiled: Dict[tuple, Any] = {}
        # the interpreter's functions have no parameter list: they always launch through Triton
        params = list(getattr(jit_fn, "params", None) or [])
        n_runtime = sum(not p.is_constexpr for p in params)
        # the direct call passes every argument in declaration order: runtime ones first here
        self._direct_ok = bool(params) and all(not p.is_constexpr for p in params[:n_runtime])
        self._constexpr_params = [(p.name, None if p.default is inspect.Parameter.empty else p.default)
                                  for p in params[n_runtime:]]
        self._n_runtime = n_runtime
        self.direct_calls = 0  # launches that skipped Triton's binder (tests check it is used)

    def _through_triton(self, grid, args, constexprs, num_warps, num_stages, options):
        if num_stages is not None:
            options = dict(options, num_stages=num_stages)
        return self.jit_fn[(grid,)](*args, **constexprs, num_warps=num_warps, **options)

    def __call__(self, grid: int, args: Sequence[Any], constexprs: Dict[str, Any], *, num_warps: int,
                 num_stages: Optional[int] = 3, direct: bool = True, **options) -> None:
        if (not direct or not self._direct_ok or interpreting()
                or any(_hook_active(h) for h in _launch_hooks()) or _capturing()):
            self._through_triton(grid, args, constexprs, num_warps, num_stages, options)
            return
        if len(args) != self._n_runtime:
            name = getattr(self.jit_fn, "__name__", "kernel")
            raise TypeError(f"{name}: {len(args)} runtime arguments, the kernel takes "
                            f"{self._n_runtime}")
        device = _current_device()
        key = specialization_key(args, tuple(constexprs.items()),
                                 (device, num_warps, num_stages, tuple(options.items())))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self._through_triton(grid, args, constexprs, num_warps, num_stages, options)
            cvalues = tuple(constexprs.get(name, default) for name, default in self._constexpr_params)
            # after Triton's launch the handles are loaded: keep what the direct call passes
            self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata,
                                   cvalues)
            return
        run, function, metadata, cvalues = entry
        self.direct_calls += 1
        run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device), function, metadata, None,
            None, None, *args, *cvalues)
