"""megatron_flux.kernels.launch: the direct launch's specialisation key and call shape,
with a stand-in for Triton's JIT function (the real launch is exercised by the GPU tests)."""

import inspect

import pytest
import torch

pytest.importorskip("triton")

from megatron_flux.kernels import launch as L  # noqa: E402


def test_key_refines_tritons_specialisation():
    k = lambda *args: L.specialization_key(args, (("C", 1),), (4, 3))  # noqa: E731
    base = torch.zeros(64, dtype=torch.float16)
    assert k(base, 32) == k(torch.zeros(64, dtype=torch.float16), 48)  # both aligned, both % 16
    assert k(base, 1) != k(base, 2)                                    # Triton makes 1 a constant
    assert k(base, 16) != k(base, 17)                                  # divisibility by 16
    assert k(base, 17) == k(base, 33)                                  # Triton keeps no other facts
    assert k(base, 5) != k(base, 2**31 + 5)                            # int32 vs int64
    assert k(base[1:], 16) != k(base, 16)                              # 2-byte offset: unaligned
    assert k(base.float(), 16) != k(base, 16)                          # dtype
    assert L.specialization_key((base,), (("C", 1),), (4, 3)) != L.specialization_key((base,), (("C", 2),), (4, 3))
    assert L.specialization_key((base,), (), (4, 3)) != L.specialization_key((base,), (), (8, 3))
    assert k(base, True) != k(base, 1) and k(base, True) != k(base, False)  # bools are not ints
    assert k(base, False) != k(base, 2**31 + 5)  # ... nor equal to an int's code (0 here)
    assert k(base, 16, base) != k(base, 16, 16)                       # kinds told apart by position
    with pytest.raises(TypeError, match="unsupported argument type"):
        k(base, 1.5)


def test_key_tells_descriptors_apart():
    from triton.tools.tensor_descriptor import TensorDescriptor

    k = lambda *args: L.specialization_key(args, (), (4, 3))  # noqa: E731
    t = torch.zeros(64, 64, dtype=torch.float16)
    d = lambda block, tt=t: TensorDescriptor(tt, [64, 64], [64, 1], block)  # noqa: E731
    assert k(d([16, 16])) == k(d([16, 16], torch.zeros(64, 64, dtype=torch.float16)))
    assert k(d([16, 16])) != k(d([16, 32]))
    assert k(d([16, 16])) != k(d([16, 16], t.float()))


class _Param:
    def __init__(self, name, constexpr, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _Compiled:
    function, packed_metadata = "fn", "md"

    def __init__(self):
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class _FakeJit:
    __name__ = "fake_kernel"
    params = [_Param("x", False), _Param("n", False), _Param("A", True), _Param("B", True, 7)]

    def __init__(self):
        self.launches, self.compiled = [], _Compiled()

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.launches.append((grid, args, kw))
            return self.compiled
        return run


def test_direct_launch_is_the_default_and_reuses_the_compiled_kernel(monkeypatch):
    jit = _FakeJit()
    launcher = L.KernelLauncher(jit)
    x = torch.zeros(8, dtype=torch.float16)
    for _ in range(2):
        launcher(3, (x, 16), {"A": 2}, num_warps=4, direct=False)
    assert len(jit.launches) == 2 and not jit.compiled.runs  # off: Triton every time
    assert jit.launches[0] == ((3,), (x, 16), {"A": 2, "num_warps": 4, "num_stages": 3})

    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_capturing", lambda: False)
    monkeypatch.setattr(L.torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    launcher(5, (x, 32), {"A": 2}, num_warps=4)   # new key: through Triton, compiled kept
    launcher(5, (x, 48), {"A": 2}, num_warps=4)   # same key: direct
    assert len(jit.launches) == 3
    assert jit.compiled.runs == [(5, 1, 1, 99, "fn", "md", None, None, None, x, 48, 2, 7)]
    assert launcher.direct_calls == 1
    launcher(5, (x, 1), {"A": 2}, num_warps=4)    # 1 is its own specialisation: Triton again
    assert len(jit.launches) == 4
    assert len(launcher._compiled) == 2
    # Gluon's form: no num_stages, a further option; both reach Triton and key the entry
    launcher(5, (x, 48), {"A": 2}, num_warps=4, num_stages=None, maxnreg=128)
    assert jit.launches[-1] == ((5,), (x, 48), {"A": 2, "num_warps": 4, "maxnreg": 128})
    launcher(5, (x, 48), {"A": 2}, num_warps=4, num_stages=None, maxnreg=128)
    assert len(jit.launches) == 5 and launcher.direct_calls == 2
    launcher(5, (x, 48), {"A": 2}, num_warps=4, num_stages=None, maxnreg=64)  # another option
    assert len(jit.launches) == 6 and jit.launches[-1][2]["maxnreg"] == 64
    launcher(5, (x, 48), {"A": 2}, num_warps=4, num_stages=5)  # stages reach Triton as given
    assert len(jit.launches) == 7 and jit.launches[-1][2]["num_stages"] == 5
    with pytest.raises(TypeError, match="3 runtime arguments, the kernel takes 2"):
        launcher(5, (x, 48, 3), {"A": 2}, num_warps=4)


def test_direct_launch_steps_aside_for_hooks_and_odd_signatures(monkeypatch):
    jit = _FakeJit()
    jit.params = [_Param("A", True), _Param("x", False)]  # a constexpr before a runtime argument
    launcher = L.KernelLauncher(jit)
    x = torch.zeros(8, dtype=torch.float16)
    for _ in range(2):
        launcher(1, (x,), {"A": 1}, num_warps=1)
    assert len(jit.launches) == 2 and not jit.compiled.runs
    jit2 = _FakeJit()
    launcher2 = L.KernelLauncher(jit2)
    monkeypatch.setattr(L, "_launch_hooks", lambda: (lambda *a: None, None))  # a profiler's hook
    for _ in range(2):
        launcher2(1, (x, 16), {"A": 1}, num_warps=1)
    assert len(jit2.launches) == 2 and not jit2.compiled.runs
    jit3 = _FakeJit()  # no hook, but a CUDA graph being captured
    launcher3 = L.KernelLauncher(jit3)
    monkeypatch.setattr(L, "_launch_hooks", lambda: (None, None))
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_capturing", lambda: True)
    for _ in range(2):
        launcher3(1, (x, 16), {"A": 1}, num_warps=1)
    assert len(jit3.launches) == 2 and not jit3.compiled.runs


def test_empty_hook_chains_are_inactive():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not L._hook_active(None) and not L._hook_active(Chain([]))
    assert L._hook_active(Chain([print])) and L._hook_active(print)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_both_launchers_unroll_the_step_loop_up_to_tp_4(monkeypatch, world):
    """The step loop is unrolled at compile time up to TP 4 and a runtime loop above (at TP 8
    seven unrolled copies were slower: config.MAX_UNROLLED_WORLD); both launchers pass the same
    choice."""
    from megatron_flux.kernels import ag_gemm, gemm_rs
    from megatron_flux.kernels.config import GemmConfig, MAX_UNROLLED_WORLD, unroll_steps

    assert MAX_UNROLLED_WORLD == 4 and unroll_steps(world) is (world <= 4)
    seen = {}

    def recorder(name):
        def launch(grid, args, constexprs, **kw):
            seen[name] = constexprs["UNROLL_STEPS"]
        return launch

    monkeypatch.setattr(ag_gemm, "_LAUNCH", recorder("ag"))
    monkeypatch.setattr(gemm_rs, "_LAUNCH", recorder("rs"))
    cfg, m_local, k, n = GemmConfig(), 16, 32, 64
    err = torch.zeros(4, dtype=torch.int32)
    ag_gemm.launch_ag_gemm(torch.zeros(m_local, k), torch.zeros(world * m_local, k),
                           torch.zeros(k, n), torch.zeros(world * m_local, n),
                           torch.zeros(world, dtype=torch.int32), err, rank=0, world=world,
                           epoch=1, cfg=cfg, num_sms=4, max_spins=1)
    data = torch.zeros(world, m_local, n)
    ptrs = torch.zeros(world, dtype=torch.int64)
    gemm_rs.launch_gemm_rs(torch.zeros(world * m_local, k), torch.zeros(k, n),
                           torch.zeros(m_local, n), data, ptrs, ptrs, None, err, rank=0,
                           world=world, epoch=1, cfg=cfg, num_sms=4, max_spins=1)
    assert seen == {"ag": world <= 4, "rs": world <= 4}


def test_stream_k_fallback_relaunches_only_a_split_that_did_not_fit(monkeypatch):
    """Both fused launchers go through stream_k.launch_with_stream_k_fallback: an
    OutOfResources from a launch that split a tail marks (op, config) as too big, warns once
    and relaunches; from a launch without a split it propagates; other ops and configs keep
    their split."""
    from triton.runtime.errors import OutOfResources

    from megatron_flux.kernels import stream_k as SK
    from megatron_flux.kernels.config import GemmConfig

    monkeypatch.setattr(SK, "_TOO_BIG", set())
    cfg = GemmConfig(stream_k=1)
    calls = []

    def overflow():
        calls.append("launch")
        raise OutOfResources(300000, 232448, "shared memory")

    with pytest.raises(OutOfResources):  # no split planned: not ours to handle
        SK.launch_with_stream_k_fallback("GEMM+RS", cfg, overflow, lambda: calls.append("again"),
                                         lambda: False)
    assert calls == ["launch"] and SK.stream_k_fits("GEMM+RS", cfg)
    with pytest.warns(UserWarning, match="GEMM.RS.*without stream-K"):
        SK.launch_with_stream_k_fallback("GEMM+RS", cfg, overflow, lambda: calls.append("again"),
                                         lambda: True)
    assert calls == ["launch", "launch", "again"]
    assert not SK.stream_k_fits("GEMM+RS", cfg)
    assert SK.stream_k_fits("AG+GEMM", cfg) and SK.stream_k_fits("GEMM+RS", GemmConfig())
    SK.launch_with_stream_k_fallback("AG+GEMM", cfg, lambda: calls.append("fits"),
                                     lambda: calls.append("again"), lambda: True)
    assert calls[-1] == "fits"


class CudaLauncher:
    """Stands in for Triton 3.6's launcher: its ``launch`` wraps the generated C function the
    way ``wrap_handle_tensordesc`` does (a closure over ``launcher``)."""

    def __init__(self, c_launch, scratch=0):
        self.profile_scratch_size, self.launch_pdl, self.num_ctas = 0, False, 1
        self.global_scratch_size, self.launch_cooperative_grid = scratch, False
        launcher = c_launch

        def inner(*args):
            return launcher(*args)

        self.launch = inner
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _CLaunch:  # a callable without Python code, like the generated extension's function
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _Meta:
    tensordesc_meta = [{"block": 16}]


def _desc(t, shape):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(shape), [shape[1], 1], [16, 16])


def test_c_launcher_is_found_behind_tritons_wrapper_or_not_at_all():
    c = _CLaunch()
    assert L._c_launcher(CudaLauncher(c).launch) is c
    assert L._c_launcher(c) is c                      # no descriptors: the C function itself
    launcher = lambda *a: None  # noqa: E731 - Python code: not Triton's generated launcher

    def wrapped(*a):
        return launcher(*a)
    assert L._c_launcher(wrapped) is None

    def other(*a):
        return c(*a)
    assert L._c_launcher(other) is None               # a closure without `launcher`


def test_raw_launch_passes_addresses_and_encodes_each_descriptor_once(monkeypatch):
    """The raw launch hands Triton's C launcher what CudaLauncher would: addresses for tensors,
    descriptors expanded by Triton's own function, constexprs last; a descriptor of the same
    address and geometry is not encoded again, another address or geometry is; the global
    scratch is one buffer per (device, stream, size)."""
    expanded = []

    def expand(desc, meta):
        expanded.append((desc.base.data_ptr(), tuple(desc.shape)))
        return ["map", *desc.shape, *desc.strides]

    c = _CLaunch()
    made = []
    monkeypatch.setattr(L.torch, "empty",
                        lambda size, dtype, device: made.append(size) or torch.zeros(size, dtype=dtype))
    raw = L.RawLaunch(c, "fn", "md", (7,), ({"m": 1},), {1: 0}, 64, False, expand)
    x = torch.zeros(32, 32, dtype=torch.float16)
    y = torch.zeros(32, 32, dtype=torch.float16)
    raw(4, 0, 11, (x, _desc(x, (32, 32)), 5, True))
    raw(4, 0, 11, (y, _desc(x, (32, 32)), 6, True))     # same descriptor: cached
    assert expanded == [(x.data_ptr(), (32, 32))] and made == [4 * 64]
    first, second = c.calls
    scratch = first[7]
    assert first[:7] == (4, 1, 1, 11, "fn", False, False)
    assert first[8:13] == (None, "md", None, None, None)
    assert first[13:] == (x.data_ptr(), "map", 32, 32, 32, 1, 5, True, 7)
    assert second[13:] == (y.data_ptr(), "map", 32, 32, 32, 1, 6, True, 7) and second[7] == scratch
    raw(4, 0, 11, (x, _desc(y, (32, 32)), 5, True))     # another address: encoded
    raw(4, 0, 11, (x, _desc(x, (16, 32)), 5, True))     # another geometry: encoded
    raw(8, 0, 11, (x, _desc(x, (16, 32)), 5, True))     # another grid: another scratch
    raw(8, 0, 12, (x, _desc(x, (16, 32)), 5, True))     # another stream: another scratch
    assert expanded[1:] == [(y.data_ptr(), (32, 32)), (x.data_ptr(), (16, 32))]
    assert made == [256, 512, 512]


def test_direct_launch_goes_raw_where_tritons_launcher_has_the_known_form(monkeypatch):
    c = _CLaunch()
    jit = _FakeJit()
    jit.compiled.run = CudaLauncher(c)
    jit.compiled.metadata = _Meta()
    jit.params = [_Param("x", False), _Param("d", False), _Param("A", True)]
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_capturing", lambda: False)
    monkeypatch.setattr(L, "_launch_hooks", lambda: (None, None))
    monkeypatch.setattr(L.torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    monkeypatch.setattr(L, "_triton_expander", lambda: lambda d, m: ["map", m["block"]])
    launcher = L.KernelLauncher(jit)
    x = torch.zeros(32, 32, dtype=torch.float16)
    for _ in range(3):
        launcher(2, (x, _desc(x, (32, 32))), {"A": 3}, num_warps=4)
    assert len(jit.launches) == 1 and launcher.direct_calls == 2 and launcher.raw_calls == 2
    assert c.calls[-1][13:] == (x.data_ptr(), "map", 16, 3) and not jit.compiled.run.calls
    launcher.raw = False                                 # the A/B switch: CompiledKernel.run
    launcher(2, (x, _desc(x, (32, 32))), {"A": 3}, num_warps=4)
    assert launcher.raw_calls == 2 and len(jit.compiled.run.calls) == 1

    jit2 = _FakeJit()                                    # a Triton RawLaunch does not know
    jit2.compiled.run = CudaLauncher(c)
    jit2.compiled.metadata = _Meta()
    jit2.params = jit.params
    monkeypatch.setattr(L, "_triton_expander", lambda: None)
    launcher2 = L.KernelLauncher(jit2)
    for _ in range(2):
        launcher2(2, (x, _desc(x, (32, 32))), {"A": 3}, num_warps=4)
    assert launcher2.raw_calls == 0 and len(jit2.compiled.run.calls) == 1


def test_raw_launch_is_gated_on_tritons_version(monkeypatch):
    import triton

    from triton.backends.nvidia import driver

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert L._triton_expander() is driver.make_tensordesc_arg
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert L._triton_expander() is None


def test_shape_plans_are_made_once_per_key_and_config_identity():
    from megatron_flux.kernels.config import GemmConfig

    plans, made = L.ShapePlans(limit=2), []
    cfg, twin = GemmConfig(), GemmConfig()   # equal, not identical
    make = lambda tag: lambda: made.append(tag) or tag  # noqa: E731
    assert plans.get(("s",), cfg, make("a")) == "a"
    assert plans.get(("s",), cfg, make("b")) == "a" and made == ["a"]
    assert plans.get(("s",), twin, make("c")) == "c"     # another config object: a new plan
    plans.get(("t",), cfg, make("d"))
    plans.get(("u",), cfg, make("e"))                    # past the bound: starts over
    assert plans.get(("t",), cfg, make("f")) == "f"


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_fused_launchers_plan_once_per_shape(monkeypatch, op):
    """A launcher derives geometry, grid and constexprs once per shape and config; a stream-K
    fallback (which changes the plan) makes a new one."""
    from megatron_flux.kernels import ag_gemm, gemm_rs
    from megatron_flux.kernels import stream_k as SK
    from megatron_flux.kernels.config import GemmConfig

    mod = ag_gemm if op == "ag" else gemm_rs
    monkeypatch.setattr(mod, "_PLANS", L.ShapePlans())
    monkeypatch.setattr(SK, "_TOO_BIG", set())
    made, launched = [], []
    real = mod._launch_plan
    monkeypatch.setattr(mod, "_launch_plan", lambda *a, **kw: made.append(1) or real(*a, **kw))
    monkeypatch.setattr(mod, "_LAUNCH",
                        lambda grid, args, constexprs, **kw: launched.append(constexprs))
    cfg, world, m_local, k, n = GemmConfig(), 2, 16, 32, 64
    err = torch.zeros(4, dtype=torch.int32)

    def call(m_rows=m_local):
        if op == "ag":
            ag_gemm.launch_ag_gemm(torch.zeros(m_rows, k), torch.zeros(world * m_rows, k),
                                   torch.zeros(k, n), torch.zeros(world * m_rows, n),
                                   torch.zeros(world, dtype=torch.int32), err, rank=0,
                                   world=world, epoch=1, cfg=cfg, num_sms=4, max_spins=1)
        else:
            ptrs = torch.zeros(world, dtype=torch.int64)
            gemm_rs.launch_gemm_rs(torch.zeros(world * m_rows, k), torch.zeros(k, n),
                                   torch.zeros(m_rows, n), torch.zeros(world, m_rows, n), ptrs,
                                   ptrs, None, err, rank=0, world=world, epoch=1, cfg=cfg,
                                   num_sms=4, max_spins=1)

    call(), call()
    assert len(made) == 1 and len(launched) == 2 and launched[0] == launched[1]
    call(32)                                             # another shape
    assert len(made) == 2
    SK._TOO_BIG.add(("GEMM+RS" if op == "rs" else "AG+GEMM", cfg))  # a fallback happened
    call(32)
    assert len(made) == 3


class _NoSpecParam(_Param):
    do_not_specialize = True


def _bound_setup(monkeypatch):
    """A launcher whose kernel takes (x: tensor, d: descriptor of x, y: tensor, epoch: int,
    do_not_specialize) with Triton 3.6's launcher form, its first launch made."""
    c = _CLaunch()
    jit = _FakeJit()
    jit.compiled.run = CudaLauncher(c)
    jit.compiled.metadata = _Meta()
    jit.params = [_Param("x", False), _Param("d", False), _Param("y", False),
                  _NoSpecParam("epoch", False), _Param("A", True)]
    expanded = []

    def expand(desc, meta):
        expanded.append(desc.base.data_ptr())
        return ["map", desc.base.data_ptr(), *desc.shape]

    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_capturing", lambda: False)
    monkeypatch.setattr(L, "_launch_hooks", lambda: (None, None))
    monkeypatch.setattr(L.torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    monkeypatch.setattr(L, "_triton_expander", lambda: expand)
    launcher = L.KernelLauncher(jit)
    x = torch.zeros(32, 32, dtype=torch.float16)
    y = torch.zeros(8, dtype=torch.int32)
    L.forget_last_launch()
    launcher(2, (x, _desc(x, (32, 32)), y, 5), {"A": 3}, num_warps=4)
    return launcher, c, expanded, x, y


def test_a_bound_launch_passes_what_the_raw_launch_would_with_only_the_roles_changed(monkeypatch):
    """The bound launch of a call site hands Triton's C launcher exactly what the raw launch
    of the same arguments hands it (the reference: the launcher itself, launched again), with
    the roles' addresses and encodings per call and the fixed operands' as bound; an address
    seen before is not encoded again."""
    launcher, c, expanded, x, y = _bound_setup(monkeypatch)
    bound = L.bind_last_launch((x,), ("epoch",), (y,))
    assert bound is not None
    x2 = torch.ones(32, 32, dtype=torch.float16)
    assert bound((x2, 37)) and launcher.bound_calls == 1
    launcher(2, (x2, _desc(x2, (32, 32)), y, 37), {"A": 3}, num_warps=4)  # the raw launch
    assert c.calls[-2] == c.calls[-1]
    assert c.calls[-1][13:] == (x2.data_ptr(), "map", x2.data_ptr(), 32, 32, y.data_ptr(), 37, 3)
    n = len(expanded)
    assert bound((x2, 38)) and bound((x, 39)) and len(expanded) == n  # both addresses known
    assert c.calls[-1][13:] == (x.data_ptr(), "map", x.data_ptr(), 32, 32, y.data_ptr(), 39, 3)


def test_a_bound_launch_steps_aside_where_the_call_would_specialise_otherwise(monkeypatch):
    """Another dtype, a 2-byte offset, another shape, the same shape with other strides (a
    padded or a transposed view: its descriptor would be encoded with the bound one's strides),
    an int64 epoch, the raw launch off, a launch hook, another current device: ``False`` and
    nothing launched."""
    launcher, c, _, x, y = _bound_setup(monkeypatch)
    bound = L.bind_last_launch((x,), ("epoch",), (y,))
    n = len(c.calls)
    big = torch.zeros(32 * 32 + 1, dtype=torch.float16)
    padded = torch.zeros(32, 48, dtype=torch.float16)[:, :32]
    transposed = torch.zeros(32, 32, dtype=torch.float16).t()
    for values in [(x.float(), 5), (big[1:].view(32, 32), 5),
                   (torch.zeros(16, 64, dtype=torch.float16), 5), (padded, 5), (transposed, 5),
                   (x, 2**31 + 5)]:
        assert not bound(values)
    launcher.raw = False
    assert not bound((x, 5))
    launcher.raw = True
    monkeypatch.setattr(L, "_launch_hooks", lambda: (print, None))
    assert not bound((x, 5))
    monkeypatch.setattr(L, "_launch_hooks", lambda: (None, None))
    monkeypatch.setattr(L, "_current_device", lambda: 1)
    assert not bound((x, 5))
    assert len(c.calls) == n and launcher.bound_calls == 0
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    assert bound((x, 5)) and len(c.calls) == n + 1


def test_only_launches_whose_other_tensors_are_kept_are_bound(monkeypatch):
    """No launch since forget_last_launch, a tensor that is neither a role nor kept (a scratch
    that may be replaced), an int role the kernel does not take, or an int Triton specialised
    on its value: nothing is bound."""
    launcher, c, _, x, y = _bound_setup(monkeypatch)
    assert L.bind_last_launch((x,), ("epoch",), ()) is None              # y neither
    assert L.bind_last_launch((x,), ("epochs",), (y,)) is None           # no such parameter
    assert L.bind_last_launch((None, x), ("epoch",), (y,)) is not None   # None roles match nothing
    z = torch.zeros(32, 32, dtype=torch.float16)
    launcher(2, (x, _desc(z, (32, 32)), y, 5), {"A": 3}, num_warps=4)
    assert L.bind_last_launch((x,), ("epoch",), (y,)) is None            # z: a descriptor's base
    assert L.bind_last_launch((x, z), ("epoch",), (y,)) is not None
    L.forget_last_launch()
    assert L.bind_last_launch((x,), ("epoch",), (y,)) is None
    launcher.jit_fn.params[3] = _Param("epoch", False)                   # specialised on value
    launcher(2, (x, _desc(x, (32, 32)), y, 32), {"A": 3}, num_warps=4)
    assert L.bind_last_launch((x,), ("epoch",), (y,)) is None            # 32: % 16
    launcher(2, (x, _desc(x, (32, 32)), y, 33), {"A": 3}, num_warps=4)
    assert L.bind_last_launch((x,), ("epoch",), (y,)) is not None        # generic: binds


def test_a_launch_passing_the_stream_k_scratch_is_bound_to_that_stream_and_scratch(monkeypatch):
    """The stream-K scratch is neither a role nor kept by the caller: a launch passing the
    scratch held for its stream binds, and its bound launch runs only on that stream and while
    that scratch is still the one held (a grown one replaces it)."""
    from megatron_flux.kernels import stream_k as SK

    monkeypatch.setattr(SK, "_SCRATCH", {})
    launcher, c, _, x, _ = _bound_setup(monkeypatch)
    held = SK._Scratch(torch.zeros(64, dtype=torch.int32), torch.zeros(8, dtype=torch.int32))
    launcher(2, (x, _desc(x, (32, 32)), held.partials, 5), {"A": 3}, num_warps=4)
    assert L.bind_last_launch((x,), ("epoch",), ()) is None             # not held for stream 99
    SK._SCRATCH[(0, 99)] = held
    launcher(2, (x, _desc(x, (32, 32)), held.partials, 5), {"A": 3}, num_warps=4)
    bound = L.bind_last_launch((x,), ("epoch",), ())
    assert bound is not None and bound((x, 6))
    monkeypatch.setattr(L.torch._C, "_cuda_getCurrentRawStream", lambda device: 100, raising=False)
    assert not bound((x, 7))                                            # another stream
    monkeypatch.setattr(L.torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    SK._SCRATCH[(0, 99)] = SK._Scratch(torch.zeros(128, dtype=torch.int32), held.counters)
    assert not bound((x, 8))                                            # replaced
    assert launcher.bound_calls == 1
