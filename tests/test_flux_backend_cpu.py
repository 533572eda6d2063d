"""CPU-checkable parts of the fused backend: what it refuses, and how it fixes alignment.

The kernels themselves are tested on GPUs (test_flux_gpu.py) and under the interpreter
(test_kernels_interpret.py)."""

import pytest
import torch

pytest.importorskip("triton")

from megatron_flux.backends.flux import FluxBackend  # noqa: E402


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def test_cpu_tensors_are_refused_with_a_reason():
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    assert "CUDA" in FluxBackend().unsupported_reason(a, b, _Group(2))


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_misaligned_operands_are_copied_not_refused(layout):
    """Addresses may differ across ranks, so alignment must never change the backend choice:
    a misaligned operand is copied to an aligned one with the same values and layout."""
    storage = torch.randn(1 + 16 * 8, dtype=torch.float16)
    if layout == "kn":
        t = storage[1:].view(16, 8)          # row-major [k, n], 2 bytes off
    else:
        t = storage[1:].view(8, 16).t()      # weight.t() of a row-major [n, k], 2 bytes off
    assert t.data_ptr() % 16 != 0
    fixed = FluxBackend._aligned(t)
    assert fixed.data_ptr() % 16 == 0
    assert torch.equal(fixed, t)
    assert (fixed.stride(1) == 1) == (t.stride(1) == 1), "layout changed"
    aligned = torch.randn(16, 8, dtype=torch.float16)
    assert FluxBackend._aligned(aligned) is aligned


def test_which_backends_may_run_beside_other_kernels():
    """Which backends spin on peers while holding SMs (their re-gather beside the dgrad must then
    need no SM: the fused backend's runs on the copy engine)."""
    from megatron_flux.backends.flux import FluxBackend
    from megatron_flux.backends.nccl import NcclBackend
    from megatron_flux.tuning.auto import AutoDispatch

    assert FluxBackend.waits_across_ranks_on_sms is True
    assert NcclBackend.waits_across_ranks_on_sms is False
    fused, nccl = FluxBackend.__new__(FluxBackend), NcclBackend()
    assert AutoDispatch(fused, nccl, True, False).waits_across_ranks_on_sms is True
    assert AutoDispatch(fused, nccl, False, False).waits_across_ranks_on_sms is False


def test_reserved_sms_from_the_environment(monkeypatch):
    from megatron_flux.backends import flux as F
    from megatron_flux.kernels.config import GemmConfig, launch_geometry

    monkeypatch.delenv(F.ENV_RESERVED_SMS, raising=False)
    assert F.reserved_sms(132) == 0
    monkeypatch.setenv(F.ENV_RESERVED_SMS, "32")
    assert F.reserved_sms(132) == 32
    for bad in ("x", "-1", "132"):
        monkeypatch.setenv(F.ENV_RESERVED_SMS, bad)
        with pytest.raises(ValueError, match="MEGATRON_FLUX_RESERVED_SMS"):
            F.reserved_sms(132)
    # the grid shrinks with the SMs it may fill; the tiles per segment (signal regions) do not
    b = torch.empty(4096, 14336).t()
    full = launch_geometry(2048, 14336, b, 2, GemmConfig(), 132)
    reserved = launch_geometry(2048, 14336, b, 2, GemmConfig(), 100)
    assert (full.grid, reserved.grid) == (132, 100)
    assert full.tiles_per_segment == reserved.tiles_per_segment


@pytest.mark.parametrize("word,expected", [
    ([1, 0, 5, 3], r"AG\+GEMM: rank 0 timed out waiting for signal 5 \(last value seen 3\)"),
    ([2, 1, 7, 0], r"GEMM\+RS: rank 1 timed out waiting for signal 7"),
    ([3, 2, 1, 4], r"AG\+GEMM \(pull\): rank 2 timed out waiting for rank 1's shard to be ready"),
    ([4, 0, 1, 6], r"all-gather \(copy engine\): rank 0 timed out waiting for rank 1's rows"),
])
def test_a_timed_out_wait_names_the_op_the_rank_and_what_it_waited_for(word, expected):
    """The error word a kernel fills becomes an exception naming op, rank and signal (or, for
    the pulling AllGather's ready barrier, the peer whose shard never came)."""
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout

    err = DeviceErrorWord.__new__(DeviceErrorWord)  # no pinned memory on a CPU-only build
    err.host_word = torch.tensor(word, dtype=torch.int32)
    with pytest.raises(FusedOpTimeout, match=expected):
        err.check()
    err.host_word = torch.zeros(4, dtype=torch.int32)
    err.check()  # all clear: no error


def test_cuda_graph_capture_is_refused_so_auto_falls_back(monkeypatch):
    """Under capture the epoch would be frozen into the graph and replays would not wait for
    their data: the fused backend says so, and `auto` then takes NCCL (capturable)."""

    class _CudaLike:
        is_cuda = True
        device = torch.device("cpu")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    reason = FluxBackend().unsupported_reason(_CudaLike(), _CudaLike(), _Group(2))
    assert reason is not None and "CUDA graph capture" in reason


def test_column_dgrad_choice_from_argument_or_environment(monkeypatch):
    """``column_dgrad="nccl"`` (the default) hands the column backward's input gradient to the
    NCCL backend's overlapped form (cuBLAS, then a reduce-scatter left running); ``"fused"``
    keeps the fused GEMM+RS. The environment overrides the default; anything else is refused
    by name."""
    from megatron_flux.backends.base import PendingGather
    from megatron_flux.backends.flux import ENV_COLUMN_DGRAD

    calls = []

    class _Nccl:
        def matmul_reduce_scatter_start(self, a, b, group, *, bias=None):
            calls.append(("nccl", a.shape, b.shape, bias))
            return PendingGather(a @ b)

    monkeypatch.delenv(ENV_COLUMN_DGRAD, raising=False)
    be = FluxBackend()
    assert be.column_dgrad == "nccl"
    monkeypatch.setenv(ENV_COLUMN_DGRAD, "fused")
    assert FluxBackend().column_dgrad == "fused"
    assert be.column_dgrad == "nccl"
    be._nccl = _Nccl()
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    assert torch.equal(be.matmul_reduce_scatter_start(a, b, _Group(2)).wait(), a @ b)
    assert calls == [("nccl", (4, 3), (3, 2), None)]

    fused = FluxBackend(column_dgrad="fused")
    fused._nccl = _Nccl()
    monkeypatch.setattr(fused, "matmul_reduce_scatter", lambda a, b, group, bias=None: ("fused", a, b))
    assert fused.matmul_reduce_scatter_start(a, b, _Group(2)).wait()[0] == "fused"
    assert len(calls) == 1
    assert FluxBackend(column_dgrad="copy_engine").column_dgrad == "copy_engine"
    monkeypatch.setenv(ENV_COLUMN_DGRAD, "cublas")
    with pytest.raises(ValueError, match=r"MEGATRON_FLUX_COLUMN_DGRAD.*\('nccl', 'fused', 'copy_engine'\).*'cublas'"):
        FluxBackend()


def test_column_regather_choice_from_argument_or_environment(monkeypatch):
    """``column_regather="nccl"`` sends the column backward's re-gather to NCCL's asynchronous
    all-gather even where the copy-engine gather could run; ``"copy_engine"`` (the default)
    takes the copy-engine path there. The environment sets the default; anything else is
    refused by name."""
    from megatron_flux.backends.base import PendingGather
    from megatron_flux.backends.flux import ENV_COLUMN_REGATHER

    calls = []

    class _Nccl:
        def all_gather_start(self, x, group, *, out=None):
            calls.append(("nccl", tuple(x.shape)))
            return PendingGather(torch.cat([x] * group.size()))

    class _CopyEngineTaken(Exception):
        pass

    def copy_engine_workspace(*args, **kwargs):
        raise _CopyEngineTaken

    monkeypatch.delenv(ENV_COLUMN_REGATHER, raising=False)
    x = torch.randn(4, 3)
    for regather in (None, "copy_engine", "nccl"):
        be = FluxBackend(column_regather=regather)
        be._nccl = _Nccl()
        monkeypatch.setattr(be, "_gather_unsupported_reason", lambda x, group: None)
        monkeypatch.setattr(be, "_workspace", copy_engine_workspace)
        if regather == "nccl":
            assert torch.equal(be.all_gather_start(x, _Group(2)).wait(), torch.cat([x, x]))
        else:
            assert be.column_regather == "copy_engine"
            with pytest.raises(_CopyEngineTaken):
                be.all_gather_start(x, _Group(2))
    assert calls == [("nccl", (4, 3))]
    monkeypatch.setenv(ENV_COLUMN_REGATHER, "nccl")
    assert FluxBackend().column_regather == "nccl"
    assert FluxBackend(column_regather="copy_engine").column_regather == "copy_engine"
    monkeypatch.setenv(ENV_COLUMN_REGATHER, "gloo")
    with pytest.raises(ValueError, match=r"MEGATRON_FLUX_COLUMN_REGATHER.*'gloo'"):
        FluxBackend()


def test_auto_dispatch_starts_the_dgrad_on_the_backend_it_chose_for_rs():
    """The column backward's overlapped form goes to the GEMM+RS side of an ``auto`` split, so an
    NCCL choice keeps its reduce-scatter running beside the wgrad GEMM (not run to completion)."""
    from megatron_flux.tuning.auto import AutoDispatch

    class _Be:
        waits_across_ranks_on_sms = False

        def __init__(self, name):
            self.name = name

        def matmul_reduce_scatter_start(self, a, b, group, **kw):
            return self.name

    fused, nccl = _Be("fused"), _Be("nccl")
    assert AutoDispatch(fused, nccl, True, False).matmul_reduce_scatter_start(None, None, None) == "nccl"
    assert AutoDispatch(fused, nccl, False, True).matmul_reduce_scatter_start(None, None, None) == "fused"


def test_every_helper_the_fused_calls_use_resolves():
    """The fused calls reach the comm and kernel helpers through ``flux._deps()`` (imported
    once, not per call). Many of those paths run only on GPUs, some only with rare configs
    (copy-engine GEMM+RS bands), so a misspelt helper would surface there first: every
    ``d.<name>`` / ``_deps().<name>`` in the module must be in the namespace, and nothing in the
    namespace may go unused."""
    import re

    from megatron_flux.backends import flux

    used = set(re.findall(r"\b(?:d|_deps\(\))\.([A-Za-z_]+)", open(flux.__file__).read()))
    provided = set(vars(flux._deps()))
    assert used and used == provided, (sorted(used - provided), sorted(provided - used))
