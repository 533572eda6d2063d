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

Launches under CUDA graph capture also go through Triton: a capture happens once per graph, so
its host cost does not matter, and the graph then holds exactly what Triton launches.

On by default: on 2xH100, in one process alternating with Triton's launch over 15 trials, it
saved a median 60 µs per fc1 layer call (forward + backward, lower in 11 of 15 paired trials)
and 74 µs per fc2 call (9 of 15), of about 1.1 and 0.8 ms
(``benchmarks/experiments/host_launch_ab.py``; a second run, 21 trials: 93 and 74 µs, in 17
and 15 of 21). On 2xH200 it saved 0.01-0.03 ms per fc1/fc2 layer call, within the spread. 
Below ``CompiledKernel.run``, a direct launch calls Triton's generated C launcher itself
(:class:`RawLaunch`, where this Triton's launcher has the known form: Triton 3.6's
``CudaLauncher``), because the layers above it do per-launch work whose result rarely changes:

* a tensor argument costs a ``data_ptr()`` method call and a ``cuPointerGetAttribute`` driver
  call in the C launcher; the raw launch passes the address as an int;
* every host TMA descriptor is re-encoded (``cuTensorMapEncodeTiled`` behind Triton's
  ``make_tensordesc_arg``); the raw launch keeps each encoded descriptor per (argument,
  address, shape, strides, padding), so weights and workspaces encode once;
* a kernel with device-built descriptors asks the Triton allocator for its global scratch on
  every launch (a ``torch.empty``); the raw launch keeps one scratch buffer per (device,
  stream, size), which stream order makes safe to reuse.

In the 2xH200 host sections (m = 4096) Triton's launcher took 58 µs a launch of the fused
GEMM+RS against 10 µs for an empty kernel.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Sequence, Tuple

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
    """A CUDA graph is being captured on the current stream: launch through Triton (a capture
    runs once per graph; the replays cost no host time either way)."""
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


#: encoded descriptors kept per compiled kernel before the cache starts over (addresses of
#: activations cycle through the caching allocator's blocks; a bound keeps a leak impossible)
_MAX_DESCRIPTORS = 256


class RawLaunch:
    """One compiled specialisation, launched through Triton's generated C launcher with the
    per-launch work of the layers above it cached (the module docstring). Built by
    :meth:`from_compiled`, which answers ``None`` for a launcher of another form (another
    Triton, a profile scratch, programmatic dependent launch, descriptors not lowered to TMA):
    those launch through ``CompiledKernel.run``."""

    __slots__ = ("c_launch", "function", "metadata", "cvalues", "desc_meta", "desc_at",
                 "scratch_bytes", "coop", "expand", "_descs", "_scratch")

    def __init__(self, c_launch, function, metadata, cvalues, desc_meta, desc_at, scratch_bytes,
                 coop, expand):
        self.c_launch = c_launch
        self.expand = expand                # Triton's make_tensordesc_arg(desc, meta)
        self.function = function
        self.metadata = metadata
        self.cvalues = cvalues
        self.desc_meta = desc_meta          # per descriptor argument, Triton's TMA metadata
        self.desc_at = desc_at              # runtime-argument position -> descriptor index
        self.scratch_bytes = scratch_bytes  # global scratch per program (0: none)
        self.coop = coop
        self._descs: Dict[tuple, tuple] = {}
        self._scratch: Dict[tuple, torch.Tensor] = {}

    @classmethod
    def from_compiled(cls, compiled, args: Sequence[Any], cvalues: tuple) -> Optional["RawLaunch"]:
        expand = _triton_expander()
        run = compiled.run
        if expand is None or type(run).__name__ != "CudaLauncher":
            return None
        if (getattr(run, "profile_scratch_size", 1) != 0 or getattr(run, "launch_pdl", True)
                or getattr(run, "num_ctas", 1) != 1):
            return None
        c_launch = _c_launcher(run.launch)
        if c_launch is None:
            return None
        desc_pos = [i for i, a in enumerate(args) if _KINDS.get(type(a)) == _DESC]
        meta = getattr(compiled.metadata, "tensordesc_meta", None)
        if desc_pos and (not meta or len(meta) != len(desc_pos) or any(m is None for m in meta)):
            return None
        return cls(c_launch, compiled.function, compiled.packed_metadata, cvalues,
                   tuple(meta or ()), {p: j for j, p in enumerate(desc_pos)},
                   int(run.global_scratch_size), bool(run.launch_cooperative_grid), expand)

    def _descriptor(self, j: int, desc) -> tuple:
        """Descriptor argument ``j`` expanded as Triton's launcher expands it, encoded once per
        (argument, address, shape, strides, padding)."""
        key = (j, desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), desc.padding)
        out = self._descs.get(key)
        if out is None:
            if len(self._descs) >= _MAX_DESCRIPTORS:
                self._descs.clear()
            out = self._descs[key] = tuple(self.expand(desc, self.desc_meta[j]))
        return out

    def _scratch_ptr(self, device: int, stream: int, grid: int) -> int:
        """A global scratch of ``grid`` programs, one buffer per (device, stream, size): the
        kernels of one stream run in order, so each launch may reuse it."""
        size = grid * self.scratch_bytes
        key = (device, stream, size)
        buf = self._scratch.get(key)
        if buf is None:
            if len(self._scratch) >= 16:
                self._scratch.clear()
            buf = self._scratch[key] = torch.empty(size, dtype=torch.int8,
                                                   device=torch.device("cuda", device))
        return buf.data_ptr()

    def __call__(self, grid: int, device: int, stream: int, args: Sequence[Any]) -> None:
        flat = []
        add = flat.append
        desc_at = self.desc_at
        for i, a in enumerate(args):
            kind = _KINDS[type(a)]
            if kind == _TENSOR:
                add(a.data_ptr())
            elif kind == _DESC:
                flat.extend(self._descriptor(desc_at[i], a))
            else:
                add(a)
        scratch = self._scratch_ptr(device, stream, grid) if self.scratch_bytes else None
        self.c_launch(grid, 1, 1, stream, self.function, self.coop, False, scratch, None,
                      self.metadata, None, None, None, *flat, *self.cvalues)


#: Triton releases whose launcher layout RawLaunch knows (``CudaLauncher.__call__(gridX, gridY,
#: gridZ, stream, function, *args)`` over a generated C ``launch``, descriptors expanded by
#: ``make_tensordesc_arg(arg, metadata)``); others launch through ``CompiledKernel.run``
RAW_LAUNCH_TRITON = ("3.6",)


def _triton_expander():
    """Triton's ``make_tensordesc_arg`` where this Triton is one RawLaunch knows, else None."""
    import triton

    if ".".join(triton.__version__.split(".")[:2]) not in RAW_LAUNCH_TRITON:
        return None
    try:
        from triton.backends.nvidia.driver import make_tensordesc_arg
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return None
    return make_tensordesc_arg


def _c_launcher(launch):
    """Triton's generated C ``launch`` behind ``CudaLauncher.launch``: the function itself, or
    the ``launcher`` its tensor-descriptor wrapper closes over; ``None`` for any other form."""
    code = getattr(launch, "__code__", None)
    if code is None:
        return launch if callable(launch) else None
    if "launcher" not in code.co_freevars or launch.__closure__ is None:
        return None
    inner = launch.__closure__[code.co_freevars.index("launcher")].cell_contents
    return inner if callable(inner) and getattr(inner, "__code__", None) is None else None


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
        self.raw_calls = 0     # ... of them, through Triton's C launcher itself (RawLaunch)
        self.bound_calls = 0   # launches through a BoundLaunch of this kernel
        self.raw = True        # False: direct launches through CompiledKernel.run (A/B)

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
            raw = RawLaunch.from_compiled(compiled, args, cvalues)
            self._compiled[key] = (raw, compiled.run, compiled.function,
                                   compiled.packed_metadata, cvalues)
            if raw is not None:
                _LAST[0] = (self, raw, grid, device, torch._C._cuda_getCurrentRawStream(device),
                            args)
            return
        raw, run, function, metadata, cvalues = entry
        self.direct_calls += 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        if raw is not None and self.raw:
            self.raw_calls += 1
            _LAST[0] = (self, raw, grid, device, stream, args)
            raw(grid, device, stream, args)
            return
        run(grid, 1, 1, stream, function, metadata, None, None, None, *args, *cvalues)


class LaunchPlan(NamedTuple):
    """What a fused launcher (AG+GEMM, GEMM+RS) launches with for one shape, config and set of
    flags: the grid, the stream-K tiles, the layout facts and the constexprs."""

    grid: int
    sk_tiles: int
    ragged: bool
    b_kn: bool
    ldb: int
    constexprs: dict


class ShapePlans:
    """A launcher's per-shape plans: what a launch derives from its shapes, config and flags
    alone (geometry, grid, stream-K split, constexprs), made once per key. The config is part
    of the key by identity (hashing a ``GemmConfig`` costs more than the lookup saves) and
    checked on every hit, so a config collected and another allocated at its address never
    shares a plan. Bounded: at ``limit`` plans the cache starts over."""

    def __init__(self, limit: int = 256):
        self._plans: Dict[tuple, tuple] = {}
        self._limit = limit

    def get(self, key: tuple, cfg, make):
        hit = self._plans.get(key)
        if hit is not None and hit[0] is cfg:
            return hit[1]
        if len(self._plans) >= self._limit:
            self._plans.clear()
        plan = make()
        self._plans[key] = (cfg, plan)
        return plan

    def clear(self) -> None:
        self._plans.clear()


# ---------------------------------------------------------------- bound launches

#: ``(launcher, RawLaunch, grid, device, stream, args)`` of this process's last launch that has
#: a raw form (:func:`bind_last_launch`); ``forget_last_launch`` clears it
_LAST: list = [None]


def forget_last_launch() -> None:
    """Clear the record :func:`bind_last_launch` binds (call it before the launch to bind)."""
    _LAST[0] = None


def bind_last_launch(roles: Sequence[Optional[torch.Tensor]], int_roles: Sequence[str],
                     fixed: Sequence[torch.Tensor]) -> Optional["BoundLaunch"]:
    """The last launch with a raw form (since :func:`forget_last_launch`) as a
    :class:`BoundLaunch`, whose per-call arguments are the tensors ``roles`` (matched by
    identity, passed directly or as a host TMA descriptor's base; ``None`` entries match
    nothing) and the int parameters named ``int_roles``; every other argument is kept as it was.

    ``None`` where that would not be safe: no such launch, an int role that is not a runtime
    parameter of the kernel, or a tensor argument (or descriptor base) that is neither a role
    nor one of ``fixed``, the tensors the caller keeps alive and in place for as long as it
    keeps the bound launch, nor the stream-K scratch held for the launch's stream
    (:func:`~megatron_flux.kernels.stream_k.scratch_of`; the bound launch then runs only on
    that stream and while that scratch is held). An int role should be ``do_not_specialize`` (only its width is kept
    apart); one Triton specialised would be bound only from a launch whose value was generic
    (not 1, not a multiple of 16), whose compiled code holds for every value."""
    last = _LAST[0]
    if last is None:
        return None
    launcher, raw, grid, device, stream, args = last
    params = launcher.jit_fn.params[:launcher._n_runtime]
    names = [p.name for p in params]
    if any(name not in names for name in int_roles):
        return None
    role_of = {id(t): i for i, t in enumerate(roles) if t is not None}
    kept = {id(t) for t in fixed}
    from megatron_flux.kernels.stream_k import scratch_of

    scratch = scratch_of(device, stream)
    held = {id(scratch.partials), id(scratch.counters)} if scratch is not None else set()
    guarded = False
    n_tensor = len(roles)
    flat: list = []
    slots = []
    for pos, a in enumerate(args):
        kind = _KINDS[type(a)]
        if kind == _TENSOR:
            role = role_of.get(id(a))
            if role is None and id(a) not in kept:
                if id(a) not in held:
                    return None
                guarded = True
            if role is not None:
                slots.append((_TENSOR, len(flat), role, (a.dtype, a.data_ptr() & 15 == 0)))
            flat.append(a.data_ptr())
        elif kind == _DESC:
            j = raw.desc_at[pos]
            encoded = raw._descriptor(j, a)
            role = role_of.get(id(a.base))
            if role is None and id(a.base) not in kept:
                return None
            if role is not None:
                cache = {a.base.data_ptr(): encoded}
                slots.append((_DESC, len(flat), role,
                              (a.base.dtype, tuple(a.base.shape), a, j, len(encoded), cache,
                               a.base.stride())))
            flat.extend(encoded)
        else:
            if names[pos] in int_roles:
                # a compiled kernel serves every value of the width only if Triton did not
                # specialise it on this one (== 1, divisible by 16)
                if not getattr(params[pos], "do_not_specialize", False) and (a == 1 or a % 16 == 0):
                    return None
                slots.append((_INT, len(flat), n_tensor + int_roles.index(names[pos]),
                              _INT32[0] <= a < _INT32[1]))
            flat.append(a)
    flat.extend(raw.cvalues)
    return BoundLaunch(launcher, raw, grid, device, flat, tuple(slots),
                       (stream, scratch, scratch_of) if guarded else None)


class BoundLaunch:
    """A raw launch of one call site's fixed operands (:func:`bind_last_launch`): a call passes
    only what changes from call to call, ``bound(values)`` with ``values`` the roles' tensors
    then the int roles' values, in the order they were bound. No specialisation key, no
    argument loop over the fixed operands, no descriptor objects: each per-call tensor costs an
    address (and, as a descriptor's base, a lookup of its encoding by address, encoded on a
    miss); the fixed operands' addresses and encodings are those of the launch it was bound
    from. Answers ``False`` without launching where the call would need another
    specialisation (a tensor role's dtype, alignment, shape or, as a descriptor's base, strides;
    an int role's width), where a
    launch hook is active, the raw launch is switched off, another device is current, or, for
    a launch that passes the stream-K scratch, another stream is current or the scratch was
    replaced; the caller then launches as usual (and may bind that launch instead)."""

    __slots__ = ("launcher", "raw", "grid", "device", "flat", "slots", "guard")

    def __init__(self, launcher, raw, grid, device, flat, slots, guard=None):
        self.launcher, self.raw, self.grid, self.device = launcher, raw, grid, device
        self.flat, self.slots = flat, slots
        self.guard = guard  # (stream, the stream-K scratch it passes, scratch_of) or None

    def __call__(self, values: Sequence[Any]) -> bool:
        launcher, raw = self.launcher, self.raw
        if not launcher.raw or _current_device() != self.device:
            return False
        enter, leave = _launch_hooks()
        if _hook_active(enter) or _hook_active(leave):
            return False
        flat = self.flat[:]
        for kind, at, role, facts in self.slots:
            v = values[role]
            if kind == _INT:
                if facts and not _INT32[0] <= v < _INT32[1]:
                    return False
                flat[at] = v
                continue
            if v.dtype is not facts[0]:
                return False
            ptr = v.data_ptr()
            if kind == _TENSOR:
                if facts[1] and ptr & 15:
                    return False
                flat[at] = ptr
                continue
            _, shape, template, j, width, cache, strides = facts
            if v.stride() != strides:  # the template's strides are what would be encoded
                return False
            encoded = cache.get(ptr)
            if encoded is None:
                if ptr & 15 or tuple(v.shape) != shape:
                    return False
                desc = object.__new__(type(template))
                desc.__dict__.update(vars(template))
                desc.base = v
                if len(cache) >= _MAX_DESCRIPTORS:
                    cache.clear()
                encoded = cache[ptr] = tuple(raw.expand(desc, raw.desc_meta[j]))
            elif v.shape != shape:
                return False
            flat[at:at + width] = encoded
        device, grid = self.device, self.grid
        stream = torch._C._cuda_getCurrentRawStream(device)
        guard = self.guard
        if guard is not None and (stream != guard[0] or guard[2](device, stream) is not guard[1]):
            return False
        scratch = raw._scratch_ptr(device, stream, grid) if raw.scratch_bytes else None
        raw.c_launch(grid, 1, 1, stream, raw.function, raw.coop, False, scratch, None,
                     raw.metadata, None, None, None, *flat)
        launcher.bound_calls += 1
        return True
