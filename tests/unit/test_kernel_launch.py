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
