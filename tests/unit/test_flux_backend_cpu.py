"""CPU-checkable parts of the fused backend: what it refuses, and how it fixes alignment.

The kernels themselves are tested on GPUs (test_flux_gpu.py) and under the interpreter
(test_kernels_interpret.py)."""

from types import SimpleNamespace

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
    from megatron_flux.backends.flux.support import aligned

    storage = torch.randn(1 + 16 * 8, dtype=torch.float16)
    if layout == "kn":
        t = storage[1:].view(16, 8)          # row-major [k, n], 2 bytes off
    else:
        t = storage[1:].view(8, 16).t()      # weight.t() of a row-major [n, k], 2 bytes off
    assert t.data_ptr() % 16 != 0
    fixed = aligned(t)
    assert fixed.data_ptr() % 16 == 0
    assert torch.equal(fixed, t)
    assert (fixed.stride(1) == 1) == (t.stride(1) == 1), "layout changed"
    ok = torch.randn(16, 8, dtype=torch.float16)
    assert aligned(ok) is ok


def test_which_backends_may_run_beside_other_kernels():
    """Which backends spin on peers while holding SMs (their re-gather beside the dgrad must then
    need no SM: the fused backend's runs on the copy engine), and which a graph may capture
    (the fused one unless ``options.capture`` is off; an ``auto`` split only if both sides)."""
    from megatron_flux.backends.auto import AutoDispatch
    from megatron_flux.backends.nccl import NcclBackend
    from megatron_flux.options import FluxOptions

    assert FluxBackend.waits_across_ranks_on_sms is True
    assert NcclBackend.waits_across_ranks_on_sms is False
    fused, nccl = FluxBackend(), NcclBackend()
    assert (fused.capturable, nccl.capturable) == (True, True)
    assert AutoDispatch(fused, nccl, True, False).waits_across_ranks_on_sms is True
    assert AutoDispatch(fused, nccl, False, False).waits_across_ranks_on_sms is False
    off = FluxBackend(options=FluxOptions(capture=False))
    assert off.capturable is False
    assert AutoDispatch(off, nccl, True, False).capturable is False
    assert AutoDispatch(off, nccl, False, False).capturable is True
    assert FluxOptions.from_env({"MEGATRON_FLUX_CAPTURE": "0"}).capture is False


def test_reserved_sms_from_the_options():
    from megatron_flux.backends.flux import reserved_sms
    from megatron_flux.kernels.config import GemmConfig, launch_geometry
    from megatron_flux.options import FluxOptions

    assert reserved_sms(132, FluxOptions()) == 0
    assert reserved_sms(132, FluxOptions.from_env({"MEGATRON_FLUX_RESERVED_SMS": "32"})) == 32
    for bad in ("x", "-1"):
        with pytest.raises(ValueError, match="MEGATRON_FLUX_RESERVED_SMS"):
            FluxOptions.from_env({"MEGATRON_FLUX_RESERVED_SMS": bad})
    with pytest.raises(ValueError, match="MEGATRON_FLUX_RESERVED_SMS.*132"):
        reserved_sms(132, FluxOptions(reserved_sms=132))  # more than the device has
    # the grid shrinks with the SMs it may fill; the tiles per segment (signal regions) do not
    b = torch.empty(4096, 14336).t()
    full = launch_geometry(2048, 14336, b, 2, GemmConfig(), 132)
    reserved = launch_geometry(2048, 14336, b, 2, GemmConfig(), 100)
    assert (full.grid, reserved.grid) == (132, 100)
    assert full.tiles_per_segment == reserved.tiles_per_segment


@pytest.mark.parametrize("word,expected", [
    ([1, 0, 5, 3], r"AG\+GEMM: rank 0 timed out waiting for signal 5 \(last value seen 3\)"),
    ([2, 1, 7, 0], r"GEMM\+RS: rank 1 timed out waiting for signal 7"),
    ([3, 2, 1, 4], r"ready barrier: rank 2 timed out waiting for rank 1's signal"),
    ([4, 0, 1, 6], r"all-gather \(copy engine\): rank 0 timed out waiting for rank 1's rows"),
    ([5, 1, 0, 0], r"CUDA graph fence: rank 1 timed out waiting for rank 0 at a captured graph"),
    ([6, 0, 3, 2], r"GEMM\+RS split tail: rank 0 timed out waiting for the K-parts of its tail "
                   r"tile 3 \(count seen 2\)"),
])
def test_a_timed_out_wait_names_the_op_the_rank_and_what_it_waited_for(word, expected):
    """The error word a kernel fills becomes an exception naming op, rank and signal (or, for
    the ready barrier and the copy-engine all-gather's wait, the peer whose signal never came;
    for a split tail's wait for its K-parts, the tile)."""
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout

    err = DeviceErrorWord.__new__(DeviceErrorWord)  # no pinned memory on a CPU-only build
    err.host_word = torch.tensor(word, dtype=torch.int32)
    with pytest.raises(FusedOpTimeout, match=expected):
        err.check()
    err.host_word = torch.zeros(4, dtype=torch.int32)
    err.check()  # all clear: no error


def test_polling_the_error_word_reports_one_poll_late_without_synchronising():
    """``poll`` (the per-step check of graph replays) raises what the previous poll's queued
    read found, then queues the next read."""
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout

    err = DeviceErrorWord.__new__(DeviceErrorWord)
    err.host_word = torch.zeros(4, dtype=torch.int32)
    err.device_word = torch.zeros(4, dtype=torch.int32)
    err.poll()
    err.device_word.copy_(torch.tensor([2, 0, 1, 0], dtype=torch.int32))  # a replay timed out
    err.poll()                                                           # read queued
    with pytest.raises(FusedOpTimeout, match="GEMM\\+RS: rank 0"):
        err.poll()


def test_the_synchronous_check_reads_every_word_behind_one_synchronize_per_device(monkeypatch):
    """``check_errors(sync=True)`` (what runs before every optimizer step) queues every error
    word's copy, synchronises each device's current stream once (on an H200 three words read
    one by one took 58 us, one synchronize 8 us), and then raises what any word holds."""
    from megatron_flux.backends.flux.resources import DeviceResources
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout
    from megatron_flux.options import FluxOptions

    synced = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(
        synchronize=lambda: synced.append(device)))
    res = DeviceResources(FluxOptions())
    for op, index in (("ag", 0), ("rs", 0), ("gather", 0), ("ag", 1)):
        word = DeviceErrorWord.__new__(DeviceErrorWord)
        word.host_word = torch.zeros(4, dtype=torch.int32)
        word.device_word = SimpleNamespace(device=torch.device("cuda", index))
        word.describe = None
        word.queue_read = (lambda w: lambda: w.host_word.copy_(w.staged))(word)
        word.staged = torch.zeros(4, dtype=torch.int32)
        res._errors[(op, index)] = word
    res.check_errors(sync=True)
    assert sorted(d.index for d in synced) == [0, 1]
    res._errors[("gather", 0)].staged = torch.tensor([2, 1, 5, 3], dtype=torch.int32)
    with pytest.raises(FusedOpTimeout, match="GEMM\\+RS: rank 1 timed out waiting for signal 5"):
        res.check_errors(sync=True)


def test_a_timeout_report_carries_this_ranks_signal_words():
    """A timed-out wait's exception ends with what the error word's ``describe`` reports (the
    backend's: every workspace's signal words); a ``describe`` that fails does not hide the
    timeout."""
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout

    err = DeviceErrorWord.__new__(DeviceErrorWord)
    err.host_word = torch.tensor([2, 3, 1, 143], dtype=torch.int32)
    err.describe = lambda: "rs bfloat16 epoch 145: parity 1 [145, 143, 145, 145, 7, 0]"
    with pytest.raises(FusedOpTimeout, match=r"GEMM\+RS: rank 3 timed out waiting for signal 1 "
                       r".* This rank's signal words: rs bfloat16 epoch 145: parity 1 "
                       r"\[145, 143, 145, 145, 7, 0\]$"):
        err.check()

    def broken():
        raise RuntimeError("device lost")

    err.describe = broken
    with pytest.raises(FusedOpTimeout, match=r"rank 3 .*could not read them: RuntimeError"):
        err.check()


def test_the_signal_report_lists_every_workspace_of_the_device_and_both_parities():
    """``DeviceResources.describe_signals``: per workspace of the device, its op, dtype, last
    epoch and this rank's signal words of parity 0 and 1 (long regions cut, with a count)."""
    from helpers.fake_symm import FakeWorld

    from megatron_flux.backends.flux.resources import DeviceResources
    from megatron_flux.options import FluxOptions

    rs = FakeWorld(4, "rs", torch.bfloat16)
    rs.reserve(64, 6)
    ws = rs.ws[2]
    ws.epoch = 145
    ws.flags(2, 0)[:6] = torch.tensor([144, 144, 0, 144, 0, 0], dtype=torch.int32)
    ws.flags(2, 1)[:6] = torch.tensor([145, 143, 0, 145, 7, 0], dtype=torch.int32)
    gather = FakeWorld(4, "gather", torch.float32)
    gather.reserve(4096, 40)
    res = DeviceResources(FluxOptions())
    res._workspaces[("rs", "fake-tp", None, torch.bfloat16)] = ws
    res._workspaces[("gather", "fake-tp", None, torch.float32)] = gather.ws[2]
    text = res.describe_signals(torch.device("cpu"))
    gather_part, rs_part = text.split("; ")
    more = f" +{ws.flag_count - 16} more"
    assert rs_part == (f"rs bfloat16 epoch 145: parity 0 [144, 144, 0, 144{', 0' * 12}]{more}, "
                       f"parity 1 [145, 143, 0, 145, 7{', 0' * 11}]{more}")
    assert gather_part.startswith("gather float32 epoch 0: parity 0 [0, 0")


def test_a_timeout_report_reads_the_signal_words_without_waiting_for_the_device(monkeypatch):
    """Work queued before a timeout report may itself wait on the stalled peer, so the report
    never synchronises the device: on CUDA it reads the signal words through a bounded copy to
    the host (its own stream, an event polled until a deadline) and, where they do not arrive
    in time, says so; the timeout is raised either way."""
    from helpers.fake_symm import FakeWorld

    from megatron_flux.backends.flux.resources import DeviceResources
    from megatron_flux.comm import errors
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout, read_without_blocking
    from megatron_flux.options import FluxOptions

    def blocks(*args, **kwargs):
        raise AssertionError("the report waited for the device")

    monkeypatch.setattr(torch.cuda, "synchronize", blocks)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", blocks, raising=False)
    cuda = torch.device("cuda", 0)
    world = FakeWorld(2, "rs", torch.bfloat16)
    world.reserve(64, 3)
    ws = world.ws[1]
    ws.device, ws.epoch = cuda, 9
    ws.flags(1, 1)[:3] = torch.tensor([9, 7, 0], dtype=torch.int32)
    res = DeviceResources(FluxOptions())
    res._workspaces[("rs", "fake-tp", 0, torch.bfloat16)] = ws
    asked = []

    def arrived(tensors):
        asked.append(len(tensors))
        return [t.tolist() for t in tensors]

    text = res.describe_signals(cuda, read=arrived)
    assert asked == [2] and text.startswith("rs bfloat16 epoch 9: parity 0 [0, 0, 0")
    assert "parity 1 [9, 7, 0" in text
    # by default the device's reader, made with its first error word, before any launch
    assert res.describe_signals(cuda) == "not read (no fused kernel has run on this device)"
    from megatron_flux.backends.flux import resources
    made = []
    monkeypatch.setattr(resources.deps(), "HostReader",
                        lambda device: made.append(device) or SimpleNamespace(read=arrived))
    monkeypatch.setattr(resources.deps(), "DeviceErrorWord",
                        lambda *a, **k: SimpleNamespace(check_if_due=lambda: None))
    res.error_word("GEMM+RS", cuda), res.error_word("AG+GEMM", cuda)
    assert made == [cuda] and res.describe_signals(cuda).startswith("rs bfloat16 epoch 9")
    # a device's first workspace makes it first, before the workspace's rendezvous
    order = []
    monkeypatch.setattr(resources.deps(), "HostReader", lambda device: order.append("reader"))
    monkeypatch.setattr(resources.deps(), "SymmetricWorkspace",
                        lambda *a: order.append("workspace"))
    DeviceResources(FluxOptions()).workspace("ag", SimpleNamespace(group_name="g"),
                                             torch.device("cuda", 1), torch.bfloat16)
    assert order == ["reader", "workspace"]

    # not inside a CUDA graph capture (nothing may be allocated there): the next eager call
    capturing = DeviceResources(FluxOptions())
    made.clear()
    monkeypatch.setattr(resources.deps(), "HostReader",
                        lambda device: made.append(device) or SimpleNamespace(read=arrived))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    capturing.error_word("GEMM+RS", cuda)
    assert made == [] and capturing.describe_signals(cuda).startswith("not read (no fused")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    capturing.error_word("AG+GEMM", cuda)
    assert made == [cuda]

    def refused(device):
        raise RuntimeError("cuStreamCreate failed")

    fresh = DeviceResources(FluxOptions())
    monkeypatch.setattr(resources.deps(), "HostReader", refused)
    fresh.error_word("GEMM+RS", cuda)  # the call goes on; its report says why it has no words
    assert fresh.describe_signals(cuda) == (
        "not read (no reader: RuntimeError: cuStreamCreate failed)")
    stuck = res.describe_signals(cuda, read=lambda tensors: None)
    assert stuck.startswith("not read (the copy to the host did not finish within 2 s")

    err = DeviceErrorWord.__new__(DeviceErrorWord)
    err.host_word = torch.tensor([2, 1, 0, 8], dtype=torch.int32)
    err.describe = lambda: res.describe_signals(cuda, read=lambda tensors: None)
    with pytest.raises(FusedOpTimeout, match=r"rank 1 timed out .* This rank's signal words: "
                                             r"not read \(the copy"):
        err.check()

    # the bounded read: polls the copy's event until the deadline, never longer
    now, polls = [0.0], []

    def never_done(tensors):
        return [torch.zeros(2)], lambda: polls.append(now[0]) or False

    def sleep(seconds):
        now[0] += seconds

    t = [torch.ones(2)]
    assert read_without_blocking(t, never_done, 0.01, clock=lambda: now[0], sleep=sleep) is None
    assert 5 <= len(polls) <= 12 and now[0] < 0.02
    assert read_without_blocking(t, lambda ts: ([torch.ones(2)], lambda: True), 0.01) == [
        [1.0, 1.0]]
    assert read_without_blocking([], never_done) == [] and errors.REPORT_READ_SECONDS == 2.0


def test_the_report_stream_is_a_driver_stream_of_its_own(monkeypatch):
    """``own_stream`` makes a non-blocking driver stream (``cuStreamCreate`` with flag 1) and
    wraps it, not one of torch's pooled streams; without the driver library, a pooled stream;
    a driver error raises, naming the device."""
    import contextlib
    import ctypes

    from megatron_flux.comm import errors

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: ("pooled", device))
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda ptr, device=None: ("external", ptr, device))
    calls = []

    class Driver:
        def __init__(self, rc):
            self.rc = rc

        def cuStreamCreate(self, handle, flags):
            calls.append(flags.value)
            ctypes.cast(handle, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1234
            return self.rc

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver(0))
    assert errors.own_stream(cuda) == ("external", 0x1234, cuda) and calls == [1]
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver(2))
    with pytest.raises(RuntimeError, match="cuStreamCreate failed on cuda:0"):
        errors.own_stream(cuda)

    def no_driver(name):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert errors.own_stream(cuda) == ("pooled", cuda)


def test_replaced_staging_stays_alive_for_captured_graphs():
    """Growing the copy-engine staging keeps the old buffer (a captured graph may address it)
    and drops the copy plans that view it."""
    from megatron_flux.backends.flux.resources import DeviceResources
    from megatron_flux.options import FluxOptions

    class _Side:
        pass

    res = DeviceResources(FluxOptions())
    dev = torch.device("cpu")
    real = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, s: None
    try:
        first = res.staging(dev, torch.float32, 16, _Side())
        assert res.staging(dev, torch.float32, 8, _Side()) is first
        second = res.staging(dev, torch.float32, 64, _Side())
    finally:
        torch.Tensor.record_stream = real
    assert second is not first and second.numel() >= 64
    assert any(t is first for t in res._retired_staging)


class _CudaLike:
    """Stands in for a CUDA tensor where only its signature is read."""

    is_cuda = True
    device = torch.device("cpu")
    dtype = torch.bfloat16

    def __init__(self, *shape):
        self.shape = torch.Size(shape)

    def stride(self):
        return (self.shape[1], 1)


def test_a_capture_keeps_the_choice_unless_capture_is_off_and_cublas_is_ready_before_it(
        monkeypatch, caplog):
    """Inside a capture ``resolve_backend`` chooses as outside it: the fused backend is
    capturable (its captured calls run on graph workspaces). With ``options.capture`` off it is
    not, and both ``auto`` and an explicit ``flux`` go to NCCL with one log line instead of
    failing the job. Outside capture, the first call on a thread creates its cuBLAS handle, so
    that NCCL's matmul inside a later capture never has to (cublasCreate fails there)."""
    import logging
    import threading

    from megatron_flux.backends import registry as B
    from megatron_flux.backends import registry
    from megatron_flux.options import FluxOptions

    fused = FluxBackend.__new__(FluxBackend)
    FluxBackend.__init__(fused)
    monkeypatch.setattr(fused, "unsupported_reason", lambda a, b, g: None)
    monkeypatch.setitem(registry._INSTANCES, "flux", fused)
    monkeypatch.setitem(registry._REGISTRY, "flux", fused)
    monkeypatch.setattr(registry, "fused_unavailable_reason", lambda device: None)
    monkeypatch.setattr(registry, "_choose_auto", lambda fused, nccl, a, b, tp, op, log: fused)
    handles = []
    monkeypatch.setattr(torch.cuda, "current_blas_handle", lambda: handles.append(
        threading.get_ident()))
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(registry, "_TLS", threading.local())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    B.clear_resolution_cache()
    a, b = _CudaLike(4096, 512), _CudaLike(512, 1024)

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert B.resolve_backend("flux", a, b, _Group(2), op="ag") is fused
    assert B.resolve_backend("flux", a, b, _Group(2), op="rs") is fused
    assert len(handles) == 1, "one cuBLAS handle per thread, created outside capture"
    worker = threading.Thread(target=lambda: B.resolve_backend("flux", a, b, _Group(2), op="ag"))
    worker.start()
    worker.join()
    assert len(handles) == 2 and handles[0] != handles[1]

    capturing[0] = True
    assert B.resolve_backend("flux", a, b, _Group(2), op="ag") is fused
    assert B.resolve_backend("auto", a, b, _Group(2), op="rs") is fused
    fused.set_options(FluxOptions(capture=False))
    B.clear_resolution_cache()
    with caplog.at_level(logging.WARNING, logger="megatron_flux"):
        assert B.resolve_backend("flux", a, b, _Group(2), op="ag").name == "nccl"
        assert B.resolve_backend("auto", a, b, _Group(2), op="rs").name == "nccl"
    assert sum("not captured into CUDA graphs" in r.getMessage() for r in caplog.records) <= 1
    assert len(handles) == 2, "no handle is created inside a capture"
    B.clear_resolution_cache()


def test_column_dgrad_choice_from_argument_options_or_environment():
    """``column_dgrad="nccl"`` (the default) hands the column backward's input gradient to the
    NCCL backend's overlapped form (cuBLAS, then a reduce-scatter left running); ``"fused"``
    keeps the fused GEMM+RS. The options (whose defaults the environment sets) give the value, an
    argument overrides them; anything else is refused by name."""
    from megatron_flux.backends.base import PendingGather
    from megatron_flux.options import FluxOptions

    calls = []

    class _Nccl:
        def matmul_reduce_scatter_start(self, a, b, group, *, bias=None):
            calls.append(("nccl", a.shape, b.shape, bias))
            return PendingGather(a @ b)

    be = FluxBackend(options=FluxOptions())
    assert be.column_dgrad == "nccl"
    env = FluxOptions.from_env({"MEGATRON_FLUX_COLUMN_DGRAD": "fused"})
    assert FluxBackend(options=env).column_dgrad == "fused"
    assert FluxBackend(options=env, column_dgrad="nccl").column_dgrad == "nccl"
    be._nccl = _Nccl()
    a, b = torch.randn(4, 3), torch.randn(3, 2)
    assert torch.equal(be.matmul_reduce_scatter_start(a, b, _Group(2)).wait(), a @ b)
    assert calls == [("nccl", (4, 3), (3, 2), None)]

    fused = FluxBackend(column_dgrad="fused")
    fused._nccl = _Nccl()
    fused.matmul_reduce_scatter = lambda a, b, group, bias=None: ("fused", a, b)
    assert fused.matmul_reduce_scatter_start(a, b, _Group(2)).wait()[0] == "fused"
    assert len(calls) == 1
    assert FluxBackend(column_dgrad="copy_engine").column_dgrad == "copy_engine"
    with pytest.raises(ValueError, match=r"MEGATRON_FLUX_COLUMN_DGRAD.*\('nccl', 'fused', 'copy_engine'\).*'cublas'"):
        FluxOptions.from_env({"MEGATRON_FLUX_COLUMN_DGRAD": "cublas"})
    with pytest.raises(ValueError, match="column_dgrad"):
        FluxBackend(column_dgrad="cublas")


def test_column_regather_choice_from_argument_options_or_environment(monkeypatch):
    """``column_regather="nccl"`` (the default) sends the column backward's re-gather to NCCL's
    asynchronous all-gather even where the copy-engine gather could run; ``"copy_engine"`` takes
    the copy-engine path there. Anything else is refused by name."""
    from megatron_flux.backends.base import PendingGather
    from megatron_flux.backends.flux import regather
    from megatron_flux.options import FluxOptions

    calls = []

    class _Nccl:
        def all_gather_start(self, x, group, *, out=None):
            calls.append(("nccl", tuple(x.shape)))
            return PendingGather(torch.cat([x] * group.size()))

    class _CopyEngineTaken(Exception):
        pass

    def copy_engine_workspace(*args, **kwargs):
        raise _CopyEngineTaken

    monkeypatch.setattr(regather, "unsupported_reason", lambda x, group: None)
    x = torch.randn(4, 3)
    for choice in (None, "copy_engine", "nccl"):
        be = FluxBackend(options=FluxOptions(), column_regather=choice)
        be._nccl = _Nccl()
        monkeypatch.setattr(be.resources, "workspace", copy_engine_workspace)
        if choice in (None, "nccl"):
            assert be.column_regather == "nccl"
            assert torch.equal(be.all_gather_start(x, _Group(2)).wait(), torch.cat([x, x]))
        else:
            with pytest.raises(_CopyEngineTaken):
                be.all_gather_start(x, _Group(2))
    assert calls == [("nccl", (4, 3))] * 2
    env = FluxOptions.from_env({"MEGATRON_FLUX_COLUMN_REGATHER": "copy_engine"})
    assert FluxBackend(options=env).column_regather == "copy_engine"
    with pytest.raises(ValueError, match=r"MEGATRON_FLUX_COLUMN_REGATHER.*'gloo'"):
        FluxOptions.from_env({"MEGATRON_FLUX_COLUMN_REGATHER": "gloo"})


def test_new_process_options_reach_the_built_backends():
    """``set_options`` (what ``validate_flux_args`` calls) reaches a backend the registry already
    built, without the environment."""
    from megatron_flux.backends import registry
    from megatron_flux.options import FluxOptions, get_options, set_options

    be = FluxBackend()
    saved = get_options()
    registry._INSTANCES["flux-test"] = be
    try:
        set_options(saved.replace(column_dgrad="copy_engine", max_spins=7))
        assert (be.column_dgrad, be.max_spins) == ("copy_engine", 7)
    finally:
        registry._INSTANCES.pop("flux-test")
        set_options(saved if saved != FluxOptions.from_env() else None)


def test_column_settings_given_to_a_backend_survive_new_options():
    """``column_dgrad`` / ``column_regather`` given to the constructor, or set through the
    properties, belong to that backend: new options (process options reach every built backend
    through ``set_options``) change everything else and keep them; settings not given follow
    the options. A bad value is refused before anything is kept."""
    from megatron_flux.backends import registry
    from megatron_flux.options import FluxOptions, get_options, set_options

    be = FluxBackend(column_dgrad="fused", column_regather="copy_engine")
    be.set_options(FluxOptions(max_spins=1 << 20))
    assert (be.column_dgrad, be.column_regather, be.max_spins) == ("fused", "copy_engine", 1 << 20)
    half = FluxBackend(column_dgrad="copy_engine")
    half.set_options(FluxOptions(column_dgrad="nccl", column_regather="copy_engine"))
    assert (half.column_dgrad, half.column_regather) == ("copy_engine", "copy_engine")
    half.column_regather = "nccl"
    half.set_options(FluxOptions(column_regather="copy_engine", max_spins=3))
    assert (half.column_dgrad, half.column_regather, half.max_spins) == ("copy_engine", "nccl", 3)
    with pytest.raises(ValueError, match="column_dgrad"):
        half.column_dgrad = "cublas"
    half.set_options(FluxOptions())
    assert half.column_dgrad == "copy_engine"

    saved = get_options()
    registry._INSTANCES["flux-test"] = be
    try:
        set_options(saved.replace(column_dgrad="nccl", column_regather="nccl", max_spins=7))
        assert (be.column_dgrad, be.column_regather, be.max_spins) == ("fused", "copy_engine", 7)
    finally:
        registry._INSTANCES.pop("flux-test")
        set_options(saved if saved != FluxOptions.from_env() else None)


def test_auto_dispatch_starts_the_dgrad_on_the_backend_it_chose_for_rs():
    """The column backward's overlapped form goes to the GEMM+RS side of an ``auto`` split, so an
    NCCL choice keeps its reduce-scatter running beside the wgrad GEMM (not run to completion)."""
    from megatron_flux.backends.auto import AutoDispatch

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
    """The fused calls reach the comm and kernel helpers through ``resources.deps()`` (imported
    once, not per call). Many of those paths run only on GPUs, some only with rare configs
    (copy-engine GEMM+RS), so a misspelt helper would surface there first: every
    ``d.<name>`` / ``deps().<name>`` in the package must be in the namespace, and nothing in the
    namespace may go unused."""
    import glob
    import os
    import re

    from megatron_flux.backends.flux import resources

    used = set()
    for path in glob.glob(os.path.join(os.path.dirname(resources.__file__), "*.py")):
        used |= set(re.findall(r"\b(?:d|deps\(\))\.([A-Za-z_]+)", open(path).read()))
    provided = set(vars(resources.deps()))
    assert used and used == provided, (sorted(used - provided), sorted(provided - used))


def test_a_group_fed_through_several_hardware_queues_runs_nccl_unless_allowed():
    """A rank whose context has several hardware queues (CUDA_DEVICE_MAX_CONNECTIONS=1 not in
    effect) makes the whole group's reason, the same on every rank since each rank's answer is
    gathered: the persistent grids could deadlock beside another rank-spanning kernel. The
    option lets it run fused; an answer the probe could not give does not refuse."""
    from megatron_flux.backends.flux.support import group_reason

    def gather_of(*ranks):
        def gather(out, mine, group):
            out[:] = list(ranks)
        return gather

    dev = torch.device("cuda", 0)
    asked = []
    kw = dict(peers=lambda device: ("GPU-0", {}),
              queues=lambda device: asked.append(device) or "one")
    mixed = gather_of(("a", "GPU-0", "one", {}), ("a", "GPU-1", "several", {}),
                      ("a", "GPU-2", "one", {}), ("a", "GPU-3", "several", {}))
    why = group_reason(_Group(4), dev, gather=mixed, **kw)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 is not in effect on group rank(s) 1, 3" in why
    assert "MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES=1" in why and asked == [dev]
    assert group_reason(_Group(4), dev, gather=mixed, allow_several_queues=True, **kw) is None
    unknown = gather_of(("a", "GPU-0", "one", {}),
                        ("a", "GPU-1", "unknown (asked inside a capture)", {}))
    assert group_reason(_Group(2), dev, gather=unknown, **kw) is None
    # the backend passes its option, and asks again after the option changes
    import megatron_flux.backends.flux.backend as FB
    from megatron_flux.options import FluxOptions

    seen = []
    real = FB.group_reason
    FB.group_reason = lambda group, device, **k: seen.append(k["allow_several_queues"]) or None
    try:
        be = FluxBackend(options=FluxOptions())
        group = _Group(2)
        assert be._group_reason(group, dev) is None and be._group_reason(group, dev) is None
        be.set_options(be.options.replace(allow_several_queues=True))
        assert be._group_reason(group, dev) is None
        assert seen == [False, True]
    finally:
        FB.group_reason = real


def test_hardware_queues_needs_cuda_and_is_asked_once_per_device(monkeypatch):
    """The probe's answer is cached per device; where the driver's stream wait is missing it
    says why instead of guessing."""
    from megatron_flux.comm import queues

    monkeypatch.setattr(queues, "_cache", {})
    monkeypatch.setattr(queues.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(queues, "stream_wait_unavailable_reason", lambda: "libcuda has none")
    probes = []
    monkeypatch.setattr(queues, "_probe", lambda device: probes.append(device) or "one")
    assert queues.hardware_queues(torch.device("cuda", 1)) == "unknown (libcuda has none)"
    monkeypatch.setattr(queues, "_cache", {})
    monkeypatch.setattr(queues, "stream_wait_unavailable_reason", lambda: None)
    assert queues.hardware_queues(torch.device("cuda", 1)) == "one"
    assert queues.hardware_queues(torch.device("cuda", 1)) == "one" and len(probes) == 1
    monkeypatch.setattr(queues.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert queues.hardware_queues(torch.device("cuda", 2)).startswith("unknown (asked inside")


def test_groups_across_hosts_or_without_peer_access_are_refused_with_a_reason():
    """``auto`` falls back to NCCL (and ``flux`` raises) where symmetric memory cannot map the
    peers: a TP group over several hosts, or a GPU pair without P2P; asked once per group."""
    from megatron_flux.backends.flux.support import group_reason

    def gather_of(*ranks):
        def gather(out, mine, group):
            out[:] = list(ranks)
        return gather

    dev = torch.device("cuda", 0)
    one = dict(queues=lambda device: "one", peers=lambda device: ("GPU-a", {}))
    ok = group_reason(_Group(2), dev, gather=gather_of(("a", "GPU-a", "one", {"GPU-b": True}),
                                                       ("a", "GPU-b", "one", {"GPU-a": True})),
                      **one)
    assert ok is None
    hosts = group_reason(_Group(2), dev, gather=gather_of(("a", "GPU-a", "one", {}),
                                                          ("b", "GPU-b", "one", {})), **one)
    assert "spans 2 hosts (a, b)" in hosts
    p2p = group_reason(_Group(2), dev, gather=gather_of(("a", "GPU-a", "one", {"GPU-b": False}),
                                                        ("a", "GPU-b", "one", {"GPU-a": False})),
                       **one)
    assert p2p == "no peer access (P2P) between the GPUs of group ranks 0 (GPU-a) and 1 (GPU-b)"

    be = FluxBackend()
    asked = []
    import megatron_flux.backends.flux.backend as FB

    real = FB.group_reason
    FB.group_reason = lambda group, device, **kw: asked.append(group) or "no P2P"
    real_sig = FB.signature_reason
    FB.signature_reason = lambda a, b, group, capability, current: None
    real_current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        group = _Group(2)
        a, b = _CudaLike(4096, 512), _CudaLike(512, 1024)
        assert be.unsupported_reason(a, b, group) == "no P2P"
        assert be._group_reason(group, dev) == "no P2P" and len(asked) == 1
    finally:
        FB.group_reason, FB.signature_reason = real, real_sig
        torch.cuda.current_device = real_current


def test_peer_access_is_judged_by_gpu_uuid_and_every_rank_reaches_the_same_verdict(monkeypatch):
    """Device indices are process-local (per-rank ``CUDA_VISIBLE_DEVICES`` makes every rank's
    GPU ``cuda:0``), so ranks exchange GPU UUIDs and each one's peer access to the GPUs it sees,
    and decide from the gathered views alone: the same verdict on every rank, even where only
    one rank can see the pair. A pair no rank sees is not refused; a rank whose query failed
    makes the reason on every rank (after the gather, which it still joins)."""
    from megatron_flux.backends.flux import support
    from megatron_flux.backends.flux.support import group_reason

    def world(*views):
        """group_reason on every rank, each with its own ``(uuid, access)`` view (or the
        exception its query raises), over one gather of what the ranks sent."""
        sent = []

        def ask(view, gather):
            def peers(device):
                if isinstance(view, Exception):
                    raise view
                return view
            return group_reason(_Group(len(views)), torch.device("cuda", 0), gather=gather,
                                peers=peers, queues=lambda device: "one")

        def send(out, here, group):
            sent.append(here)
            out[:] = [here] * len(views)

        def receive(out, here, group):
            out[:] = sent

        for view in views:
            ask(view, send)
        answers = {ask(view, receive) for view in views}
        assert len(answers) == 1, answers
        return answers.pop()

    # every rank on cuda:0 of its own process, no P2P: refused although the indices agree
    why = world(("GPU-a", {"GPU-b": False}), ("GPU-b", {"GPU-a": False}))
    assert why == "no peer access (P2P) between the GPUs of group ranks 0 (GPU-a) and 1 (GPU-b)"
    # only rank 1 sees rank 0's GPU (and has no access): both ranks refuse
    assert world(("GPU-a", {}), ("GPU-b", {"GPU-a": False})) == why
    # rank 0 sees the pair with access, rank 1 does not see it: both run fused
    assert world(("GPU-a", {"GPU-b": True}), ("GPU-b", {})) is None
    # isolated processes: nothing can be asked, nothing refused (as before)
    assert world(("GPU-a", {}), ("GPU-b", {}), ("GPU-c", {})) is None
    # a rank whose query raised still joins the gather; every rank names it
    assert world(("GPU-a", {}), RuntimeError("driver gone")) == (
        "group rank 1 could not query its GPUs' peer access (RuntimeError: driver gone)")

    # the default view: this GPU's UUID and peer access to every other visible GPU, by UUID
    props = {0: "GPU-x", 1: "GPU-y", 2: "GPU-z"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"uuid": props[i]})())
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) != (1, 2))
    assert support.local_peer_access(torch.device("cuda", 1)) == (
        "GPU-y", {"GPU-x": True, "GPU-z": False})


class _PlanWorkspace:
    generation = 0

    def __init__(self):
        self.epoch = 0

    def next_epoch(self):
        self.epoch += 1
        return self.epoch


class _PlanErr:
    device_word = None

    def __init__(self):
        self.launches = 0

    def check_if_due(self):
        pass

    def after_launch(self):
        self.launches += 1


def _plan_harness(monkeypatch):
    """A fused backend whose plan builders and kernel launchers are recorders (CPU operands).
    Graph plans (``graph=True``) have their own workspace and int32 signal tensors (ones), named
    ``gflags<parity>`` in the launch records."""
    from megatron_flux.backends.flux import ag, rs
    from megatron_flux.backends.flux.resources import deps

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    ws, gws, made, launched, names = _PlanWorkspace(), _PlanWorkspace(), [], [], {}

    def graph_flags():
        flags = tuple(torch.ones(4, dtype=torch.int32) for _ in (0, 1))
        for p, t in enumerate(flags):
            names[id(t)] = f"gflags{p}"
        return flags

    def rs_plan(backend, a, b, group, bias, graph=False):
        made.append((f"{'rs-graph' if graph else 'rs'}", group))
        w, tag = (gws, "g") if graph else (ws, "")
        return rs.RsPlan(group, 2, 0, a.shape[0] // 2, b.shape[1], "cfg", w, w.generation,
                         _PlanErr(), 4, a.device, None, None,
                         tuple((f"data{p}", f"{tag}table{p}", f"flags{p}", None, None)
                               for p in (0, 1)), graph_flags(), [None, None])

    def ag_plan(backend, a, b, group, graph=False):
        made.append((f"{'ag-graph' if graph else 'ag'}", group))
        order = lambda waiter, producer: None  # noqa: E731
        w = gws if graph else ws
        flags = graph_flags() if graph else ("flags0", "flags1")
        return ag.AgPlan(group, 2, 0, 2 * a.shape[0], b.shape[1], "cfg", False, w,
                         w.generation, _PlanErr(), 4, a.device, "side", order, order,
                         tuple((f"gathered{p}", None, flags[p], []) for p in (0, 1)),
                         [None, None])

    class _Switch:
        def __init__(self, *a):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    def record(*a, **kw):
        target = a[4]
        launched.append((target if isinstance(target, str) else names[id(target)], kw["epoch"]))

    monkeypatch.setattr(rs, "rs_plan", rs_plan)
    monkeypatch.setattr(ag, "ag_plan", ag_plan)
    d = deps()
    monkeypatch.setattr(d, "launch_gemm_rs", record)
    monkeypatch.setattr(d, "launch_ag_gemm", record)
    monkeypatch.setattr(d, "on_stream", _Switch)
    backend = FluxBackend()
    backend.graph_workspace = gws
    return backend, ws, made, launched, capturing


@pytest.mark.parametrize("op", ["rs", "ag"])
def test_call_plans_are_reused_per_signature_and_rebuilt_when_stale(monkeypatch, op):
    """A call plan is made once per operand signature and group; a call on it still takes a
    fresh epoch (alternating parities), and a grown workspace, another group object or new
    options make a new plan. With plans off every call builds its own
    (with the real checks, the CPU operands are refused)."""
    from megatron_flux.backends.flux import ag as ag_mod, rs as rs_mod

    real_rs_plan, real_ag_plan = rs_mod.rs_plan, ag_mod.ag_plan
    backend, ws, made, launched, capturing = _plan_harness(monkeypatch)
    group, other = _Group(2), _Group(2)
    a, b = torch.zeros(8, 16), torch.zeros(16, 4)

    def call(g=group):
        if op == "rs":
            return backend.matmul_reduce_scatter(a, b, g)
        return backend.all_gather_matmul(a, b, g)[0]

    assert call().shape == ((4, 4) if op == "rs" else (16, 4))
    call()
    assert made == [(op, group)]
    index = "table" if op == "rs" else "flags"
    assert launched == [(f"{index}1", 1), (f"{index}0", 2)]  # epoch 1: parity 1, then parity 0
    ws.generation += 1                                       # the workspace grew
    call()
    assert len(made) == 2
    call(other)                                              # another group object
    assert made[-1] == (op, other)
    backend.set_options(backend.options)                     # new options: plans start over
    call()
    assert len(made) == 4
    backend.call_plans = False
    call(), call()                                       # plans off: every call builds one
    assert len(made) == 6
    monkeypatch.setattr(rs_mod, "rs_plan", real_rs_plan)  # ... with the real checks, which
    monkeypatch.setattr(ag_mod, "ag_plan", real_ag_plan)  # refuse the CPU operands
    with pytest.raises(ValueError, match="CUDA"):
        call()
    assert len(made) == 6


class _CudaFlagged(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the fused calls ask before asking about capture)."""

    is_cuda = True


class _FakeNccl:
    name = "nccl"

    def __init__(self):
        self.calls = 0

    def matmul_reduce_scatter(self, a, b, group, *, out=None, bias=None):
        self.calls += 1
        return "nccl-out"

    def all_gather_matmul(self, a, b, group, **kw):
        self.calls += 1
        return "nccl-out", None


@pytest.mark.parametrize("op", ["rs", "ag"])
def test_captured_calls_use_graph_plans_a_constant_epoch_fences_and_resets(monkeypatch, caplog, op):
    """Inside a capture a fused call runs on the graph plan that an eager call of its signature
    made after ``expect_capture`` (none: NCCL, one log line). Its epoch is the constant
    ``CAPTURED_EPOCH``; parities alternate from 0 within each graph; a graph's first call queues
    the fence (the ready barrier on the fence words, then their reset); every captured call
    resets this rank's signals of its parity afterwards; eager epochs are untouched."""
    import logging

    from megatron_flux.backends.flux import backend as backend_mod
    from megatron_flux.backends.flux.resources import deps
    from megatron_flux.comm import capture
    from megatron_flux.kernels.signals import OP_GRAPH_FENCE

    backend, ws, made, launched, capturing = _plan_harness(monkeypatch)
    nccl = backend._nccl = _FakeNccl()
    graph = [0]
    monkeypatch.setattr(capture, "capture_id", lambda stream: graph[0])
    monkeypatch.setattr(backend, "keep_scratch_alive", lambda device: None)
    fences, fence_words = [], torch.ones(8, dtype=torch.int32)

    class _Fence:
        def flag_ptrs(self, parity):
            return "fence-table"

        def flags(self, rank, parity):
            return fence_words

    monkeypatch.setattr(backend.resources, "fence", lambda group, device: _Fence())
    monkeypatch.setattr(deps(), "launch_ready_barrier",
                        lambda table, err, **kw: fences.append((graph[0], table, kw)))
    group = _Group(2)
    a = torch.Tensor._make_subclass(_CudaFlagged, torch.zeros(8, 16))  # takes the capture test
    b = torch.zeros(16, 4)

    def call():
        if op == "rs":
            return backend.matmul_reduce_scatter(a, b, group)
        return backend.all_gather_matmul(a, b, group)[0]

    call()                                    # eager, no capture expected: no graph plan
    capturing[0], graph[0] = True, 7
    with caplog.at_level(logging.WARNING, logger="megatron_flux"):
        assert call() == "nccl-out" and call() == "nccl-out"
    assert nccl.calls == 2 and fences == []
    assert sum("no graph workspace" in r.getMessage() for r in caplog.records) == 1

    capturing[0], graph[0] = False, 0
    backend.expect_capture()                  # the next eager call makes both plans and runs
    call()                                    # the graph plan once, behind a fence
    assert made[-2:] == [(op, group), (f"{op}-graph", group)]
    target = "gtable" if op == "rs" else "gflags"
    assert [e for t, e in launched if not t.startswith("g")] == [1, 2]
    assert [x for x in launched if x[0].startswith("g")] == [(f"{target}0", capture.CAPTURED_EPOCH)]
    assert [g for g, _, _ in fences] == [0]

    plan = backend._capture_plans[next(iter(backend._capture_plans))]
    own = plan.own_flags if op == "rs" else tuple(p[2] for p in plan.parities)
    assert int(own[0].abs().sum()) == 0, "the build's call reset its signals"
    capturing[0] = True
    for g, calls in ((21, 3), (22, 1)):
        graph[0] = g
        for i in range(calls):
            own[0].fill_(1), own[1].fill_(1)
            call()
            parity = i & 1
            assert launched[-1] == (f"{target}{parity}", capture.CAPTURED_EPOCH)
            assert int(own[parity].abs().sum()) == 0, "this rank's signals of the parity reset"
            assert int(own[1 - parity].sum()) == 4, "the other parity untouched"
    assert [(g, t) for g, t, _ in fences[1:]] == [(21, "fence-table"), (22, "fence-table")]
    kw = fences[0][2]
    slot = backend_mod.FENCE_SLOTS[op]
    assert (kw["epoch"], kw["base"], kw["op_code"]) == (capture.CAPTURED_EPOCH, 2 * slot, OP_GRAPH_FENCE)
    assert int(fence_words[2 * slot:2 * slot + 2].sum()) == 0
    assert backend.captured_calls == 4 and any(p is plan for p in backend._keepalive)
    capturing[0] = False
    call()
    assert launched[-1][1] == 3, "eager epochs go on from where they were"


def test_capture_sequence_alternates_per_graph_and_marks_first_calls():
    from megatron_flux.comm.capture import CaptureSequence

    seq = CaptureSequence(limit=3)
    assert [seq.next(1, "ag") for _ in range(3)] == [(0, True), (1, False), (0, False)]
    assert seq.next(1, "rs") == (0, True)
    assert seq.next(2, "ag") == (0, True)      # another graph starts over, with a fence
    assert seq.next(1, "ag") == (1, False)
    # past the limit the counts start over: the next call is a first call again, so it fences
    assert seq.next(3, "ag") == (0, True)
    assert seq.next(1, "ag") == (0, True)


def test_a_grown_graph_workspace_rebuilds_the_plans_it_made_stale():
    """A graph plan whose workspace grew while another signature's graph plan was built is
    dropped, with the eager plans, so the next eager call of its signature makes it again
    (else its captures would fall back to NCCL)."""
    backend = FluxBackend()
    ws = SimpleNamespace(generation=1)
    old = SimpleNamespace(ws=ws, generation=1, group="g")
    backend.register_capture_plan("a", old)
    backend._call_plan_cache["a"] = "eager plan of a"
    assert backend.has_capture_plan("a", "g")
    ws.generation = 2                          # building b's graph plan grew the workspace
    backend.register_capture_plan("b", SimpleNamespace(ws=ws, generation=2, group="g"))
    assert not backend.has_capture_plan("a", "g") and "a" not in backend._capture_plans
    assert backend._call_plan_cache == {}, "a's eager plan is rebuilt on its next call"
    assert backend.has_capture_plan("b", "g")
    assert not backend.has_capture_plan("b", "other group")


def test_driver_functions_are_looked_up_in_order_or_say_why_not(monkeypatch):
    """The first of the names libcuda exports, typed to return its CUresult; else the reason
    (no library, or none of the names)."""
    import ctypes

    from megatron_flux.comm.driver import load_driver_function

    class _Fn:
        pass

    class _Lib:
        cuA, cuB = _Fn(), _Fn()

    monkeypatch.setattr(ctypes, "CDLL", lambda name: _Lib())
    fn, why_not = load_driver_function(("cuX", "cuA", "cuB"), (ctypes.c_void_p,))
    assert fn is _Lib.cuA and why_not is None
    assert fn.restype is ctypes.c_int and fn.argtypes == [ctypes.c_void_p]
    fn, why_not = load_driver_function(("cuX", "cuY"), ())
    assert fn is None and why_not == "libcuda has no cuX or cuY"

    def missing(name):
        raise OSError("not found")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert load_driver_function(("cuA",), ()) == (None, "libcuda.so.1 not loadable: not found")


@pytest.mark.parametrize("op", ["rs", "ag"])
def test_eager_calls_launch_through_their_plans_bound_launch_per_parity(monkeypatch, op):
    """Each parity's first eager call launches through the launcher and binds that launch
    with the call's operands as roles and the plan's buffers as kept; later calls of that
    parity pass only their operands and epoch to it; where it steps aside (``False``) the
    launcher launches and that launch is bound; a launch that cannot be bound is not tried
    again. Off (``bound_launches``, ``call_plans`` or the direct launch): never bound."""
    from megatron_flux.backends.flux.resources import deps

    backend, ws, made, launched, capturing = _plan_harness(monkeypatch)
    d = deps()
    binds, fired, answer = [], [], [True]

    def bind(roles, int_roles, kept):
        binds.append((len(roles), int_roles, kept[0]))

        def bound(values):
            fired.append(values)
            return answer[0]
        return bound

    monkeypatch.setattr(d, "bind_last_launch", bind)
    monkeypatch.setattr(d, "forget_last_launch", lambda: None)
    group = _Group(2)
    a, b = torch.zeros(8, 16), torch.zeros(16, 4)
    call = ((lambda: backend.matmul_reduce_scatter(a, b, group)) if op == "rs"
            else (lambda: backend.all_gather_matmul(a, b, group)[0]))
    buf = "table" if op == "rs" else "flags"
    call(), call()                                    # epochs 1, 2: parities 1, 0, launched
    assert [e for _, e in launched] == [1, 2]
    kept = ("data1", "data0") if op == "rs" else ("gathered1", "gathered0")
    assert binds == [(4 if op == "rs" else 3, ("epoch",), k) for k in kept]
    call(), call()                                    # epochs 3, 4: bound
    assert len(launched) == 2 and [v[-1] for v in fired] == [3, 4]
    assert fired[0][0] is a and fired[0][1] is b and fired[0][2].shape == call().shape
    answer[0] = False                                 # steps aside: the launcher launches,
    call()                                            # and that launch is bound instead
    assert launched[-1] == (f"{buf}0", 6) and len(binds) == 3
    monkeypatch.setattr(d, "bind_last_launch", lambda *a: binds.append("none"))  # not bindable
    call(), call(), call(), call()                    # epochs 7-10: each parity tries once
    assert len(launched) == 7 and binds[3:] == ["none", "none"]
    for switch in ("bound_launches", "call_plans"):
        fresh, _, _, launched2, _ = _plan_harness(monkeypatch)
        monkeypatch.setattr(d, "bind_last_launch", bind)
        setattr(fresh, switch, False)
        n = len(binds)
        for _ in range(3):
            (fresh.matmul_reduce_scatter(a, b, group) if op == "rs"
             else fresh.all_gather_matmul(a, b, group))
        assert len(binds) == n and len(launched2) == 3
    fresh, _, _, launched3, _ = _plan_harness(monkeypatch)
    monkeypatch.setattr(d, "bind_last_launch", bind)
    fresh.set_options(fresh.options.replace(direct_launch=False))
    n = len(binds)
    for _ in range(3):
        fresh.matmul_reduce_scatter(a, b, group) if op == "rs" else fresh.all_gather_matmul(a, b, group)
    assert len(binds) == n and len(launched3) == 3


def test_copy_engine_configs_push_from_the_sms_where_the_driver_has_no_stream_wait(monkeypatch):
    """Where libcuda lacks ``cuStreamWaitValue32`` no copy-engine delivery can be queued, so an
    ``rs_copy_engine`` config runs as its SM-push twin (one warning): a kernel compiled for
    copy-engine delivery with no side stream would never raise its peers' signals. With the
    stream wait the plan keeps the config and queues the side stream."""
    import warnings

    from megatron_flux.backends.flux import rs
    from megatron_flux.backends.flux.resources import deps
    from megatron_flux.kernels.config import GemmConfig

    class _Ws:
        generation = 0

        def data(self, rank, parity, n):
            return torch.zeros(n)

        def data_ptrs(self, parity):
            return f"data_ptrs{parity}"

        def flag_ptrs(self, parity):
            return f"flag_ptrs{parity}"

        def flags(self, rank, parity, dtype=torch.int32):
            return torch.zeros(4, dtype=dtype)

        def memo(self, key, make):
            return ("table", "copies", "my_flags")

    cfg = GemmConfig(rs_copy_engine=True)
    be = FluxBackend()
    monkeypatch.setattr(be, "check", lambda *a: None)
    monkeypatch.setattr(be, "config", lambda *a, **k: cfg)
    monkeypatch.setattr(be.resources, "sms", lambda device: 132)
    monkeypatch.setattr(rs, "rs_workspace", lambda *a, **k: (_Ws(), None))
    monkeypatch.setattr(deps(), "stream_wait_unavailable_reason", lambda: "libcuda has none")
    a = torch.zeros(64, 32, dtype=torch.bfloat16)
    b = torch.zeros(32, 16, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = rs.rs_plan(be, a, b, _Group(2), None)
        again = rs.rs_plan(be, a, b, _Group(2), None)
    assert [str(w.message) for w in caught] == [
        "megatron-flux GEMM+RS: rs_copy_engine configs push from the SMs instead "
        "(libcuda has none)"]
    assert plan.side is None and not plan.cfg.rs_copy_engine and not again.cfg.rs_copy_engine
    assert plan.cfg == GemmConfig(rs_copy_engine=False)
    assert plan.parities[0][1] == "data_ptrs0", "the kernel pushes to the peers' slots"

    with_wait = FluxBackend()
    monkeypatch.setattr(with_wait, "check", lambda *a: None)
    monkeypatch.setattr(with_wait, "config", lambda *a, **k: cfg)
    monkeypatch.setattr(with_wait.resources, "sms", lambda device: 132)
    monkeypatch.setattr(with_wait.resources, "side_stream", lambda *a: "side")
    monkeypatch.setattr(with_wait.resources, "staging", lambda *a: torch.zeros(8))
    monkeypatch.setattr(deps(), "stream_wait_unavailable_reason", lambda: None)
    plan = rs.rs_plan(with_wait, a, b, _Group(2), None)
    assert plan.side == "side" and plan.cfg.rs_copy_engine
    assert plan.parities[0][1:4] == ("table", "flag_ptrs0", "copies")


class _OnDevice:
    """Stands in for a contiguous bfloat16 CUDA tensor on ``device`` (its signature only)."""

    is_cuda = True
    dtype = torch.bfloat16

    def __init__(self, device, *shape):
        self.device, self.shape = torch.device(device), torch.Size(shape)

    def stride(self, dim=None):
        strides = (self.shape[1], 1)
        return strides if dim is None else strides[dim]

    def dim(self):
        return len(self.shape)

    def is_contiguous(self):
        return True


def test_operands_off_the_current_device_raise_on_every_backend_choice(monkeypatch):
    """The kernels launch on the current device's stream while the workspaces, events, side
    streams and copies follow the operands' device. Operands off the current device raise a
    ValueError naming ``torch.cuda.set_device``, under ``auto`` as under ``flux``: a rank that
    ran NCCL alone there (a loop that never set the device: rank 0 on its current device, the
    others not) would leave its peers' fused kernels or support check waiting. The answer
    follows the current device; operands on two devices are a reason (NCCL's matmul says
    why). A bias on another device than the input is refused by name, and the copy-engine
    re-gather of an input off the current device raises too."""
    import threading

    import megatron_flux.backends.flux.backend as FB
    from megatron_flux.backends import registry
    from megatron_flux.backends.flux import regather, rs
    from megatron_flux.backends.flux.support import signature_reason

    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    cap = lambda: (9, 0)  # noqa: E731
    a, b = _OnDevice("cuda:1", 4096, 512), _OnDevice("cuda:1", 512, 1024)
    off = r"the operands are on cuda:1 but the current CUDA device is cuda:0.*set_device\(1\)"
    assert signature_reason(a, b, _Group(2), cap, 1) is None
    with pytest.raises(ValueError, match=off):
        signature_reason(a, b, _Group(2), cap, 0)
    assert signature_reason(a, _OnDevice("cuda:0", 512, 1024), _Group(2), cap, 1) == (
        "operands are on different devices (cuda:1 and cuda:0)")

    fused = FluxBackend()
    monkeypatch.setattr(FB, "group_reason", lambda group, device, **kw: None)
    monkeypatch.setattr(fused.resources, "capability", lambda device: (9, 0))
    monkeypatch.setitem(registry._INSTANCES, "flux", fused)
    monkeypatch.setitem(registry._REGISTRY, "flux", fused)
    monkeypatch.setattr(registry, "fused_unavailable_reason", lambda device: None)
    monkeypatch.setattr(registry, "_choose_auto", lambda fused, nccl, a, b, tp, op, log: fused)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    tls = threading.local()
    tls.blas = True  # the cuBLAS handle is made
    monkeypatch.setattr(registry, "_TLS", tls)
    registry.clear_resolution_cache()
    group = _Group(2)
    try:
        for requested in ("auto", "flux", "auto"):
            with pytest.raises(ValueError, match=off):
                registry.resolve_backend(requested, a, b, group, op="rs")
        current[0] = 1  # torch.cuda.set_device(1)
        assert registry.resolve_backend("auto", a, b, group, op="rs") is fused
        assert registry.resolve_backend("flux", a, b, group, op="ag") is fused
        current[0] = 0
        with pytest.raises(ValueError, match=off):
            registry.resolve_backend("auto", a, b, group, op="rs")
    finally:
        registry.clear_resolution_cache()

    x = torch.zeros(8, 4, dtype=torch.bfloat16)
    bias = torch.zeros(4, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"GEMM\+RS: bias must be contiguous \(4,\) on cpu, "
                                         r"got \(4,\) on meta"):
        rs.rs_rows(x, 4, 2, bias)
    assert rs.rs_rows(x, 4, 2, torch.zeros(4, dtype=torch.bfloat16)) == 4
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    current[0] = 1
    with pytest.raises(ValueError, match="the input to re-gather is on cpu but the current CUDA "
                                         "device is cuda:1"):
        regather.unsupported_reason(x, group)


def test_each_group_object_is_asked_its_own_collective_once(monkeypatch):
    """The operands' part of the verdict is cached per signature, the group's per group object:
    a second group of the same size (other GPUs, other hosts) runs its own collective check
    rather than inheriting the first's verdict; a rank that met another group first must not
    skip the collective its peers of this group run. Each group is asked once, and again after
    the queue option changes; a dropped group's answer goes with it, and ``resolve_backend``
    keys its answers by the group object too."""
    import gc

    import megatron_flux.backends.flux.backend as FB
    from megatron_flux.backends import registry

    class _Named(_Group):
        def __init__(self, name):
            super().__init__(2)
            self.name = name

    asked = []
    verdicts = {"intra-host": None, "cross-host": "the tensor-parallel group spans 2 hosts"}
    monkeypatch.setattr(FB, "group_reason",
                        lambda group, device, **kw: asked.append(group.name) or verdicts[group.name])
    monkeypatch.setattr(FB, "signature_reason",
                        lambda a, b, group, capability, current: None if a.shape[0] > 8 else "small")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    be = FluxBackend()
    a, b = _CudaLike(4096, 512), _CudaLike(512, 1024)
    intra, cross = _Named("intra-host"), _Named("cross-host")
    assert be.unsupported_reason(a, b, intra) is None
    assert be.unsupported_reason(a, b, cross) == "the tensor-parallel group spans 2 hosts"
    assert be.unsupported_reason(a, b, intra) is None
    assert be.unsupported_reason(_CudaLike(8, 512), b, _Named("other")) == "small"
    assert asked == ["intra-host", "cross-host"], "each group once; no group asked for 'small'"
    be.set_options(be.options.replace(allow_several_queues=True))
    assert be.unsupported_reason(a, b, cross) == "the tensor-parallel group spans 2 hosts"
    assert be.unsupported_reason(a, b, intra) is None
    assert asked[2:] == ["cross-host", "intra-host"]
    del cross
    gc.collect()
    assert [g.name for g in be._group_reasons] == ["intra-host"]

    fused = FluxBackend()
    monkeypatch.setitem(registry._INSTANCES, "flux", fused)
    monkeypatch.setitem(registry._REGISTRY, "flux", fused)
    monkeypatch.setattr(registry, "fused_unavailable_reason", lambda device: None)
    monkeypatch.setattr(registry, "_choose_auto", lambda fused, nccl, a, b, tp, op, log: fused)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(registry._TLS, "blas", True, raising=False)
    registry.clear_resolution_cache()
    try:
        first, second = _Named("intra-host"), _Named("cross-host")
        assert registry.resolve_backend("auto", a, b, first, op="rs") is fused
        assert registry.resolve_backend("auto", a, b, second, op="rs").name == "nccl"
        assert asked[-2:] == ["intra-host", "cross-host"]
        assert all(key[-2] is not None and not isinstance(key[-2], int)
                   for key in registry._RESOLVED), "keyed by the group, not its id"
    finally:
        registry.clear_resolution_cache()
