"""How a timed-out wait reaches Python, on one GPU: the timeout report's read of device words
never waits for the device, and the check the Megatron integration runs before every optimizer
step raises a timeout that no per-call check has seen yet, before the update."""

import time

import pytest
import torch

from helpers.gpu_harness import launch_gemm_rs_without_its_peer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_report_read_returns_while_a_kernel_still_spins():
    """A :class:`HostReader` made before the launch (what a timeout report reads the signal
    words with) reads device words while the device is busy with a kernel that waits on a peer:
    its stream is its own (not one of torch's pooled streams) and not ordered behind the
    default stream the kernel runs on. The spinning wait polls a word in pinned host memory,
    which the test writes to end it, so nothing waits for the spin bound."""
    from megatron_flux.comm.errors import DeviceErrorWord, HostReader
    from megatron_flux.kernels.ready_barrier import launch_ready_barrier
    from megatron_flux.kernels.signals import OP_GATHER

    dev = torch.device("cuda", 0)
    flags = torch.zeros(2, dtype=torch.int32, pin_memory=True)  # the "peer's" words, on the host
    ptrs = torch.tensor([flags.data_ptr()] * 2, dtype=torch.int64, device=dev)
    word = DeviceErrorWord(dev, interval=1)
    probe = torch.arange(4, dtype=torch.int32, device=dev)
    reader = HostReader(dev)
    torch.cuda.synchronize()
    launch_ready_barrier(ptrs, word.device_word, rank=0, world=2, base=0, epoch=1,
                         max_spins=1 << 26, signal=False, wait=True, op_code=OP_GATHER)
    spinning = torch.cuda.Event()
    spinning.record()
    try:
        start = time.monotonic()
        got = reader.read([probe], seconds=1.0)
        elapsed = time.monotonic() - start
        assert elapsed < 1.5, f"the read waited {elapsed:.2f} s"
        assert not spinning.query(), "the kernel had stopped spinning: the test proves nothing"
        # its own non-blocking stream: the copy is not ordered behind the spinning kernel
        assert got == [[0, 1, 2, 3]]
    finally:
        flags.fill_(1)  # the peer's signal: the wait ends
        torch.cuda.synchronize()
    assert word.device_word.tolist() == [0, 0, 0, 0], "the wait ended on the signal, in time"
    assert reader.read([probe, word.device_word]) == [[0, 1, 2, 3], [0, 0, 0, 0]]
    pooled = {torch.cuda.Stream(device=dev).cuda_stream for _ in range(96)}
    assert reader.stream.cuda_stream not in pooled  # no other code is handed its stream
    with pytest.raises(ValueError, match="contiguous"):
        reader.queue([probe[::2]])  # a copy that needs a kernel first
    with pytest.raises(ValueError, match="exceed"):
        reader.queue([torch.zeros(1 << 15, dtype=torch.int32, device=dev)])


def test_the_check_before_an_optimizer_step_raises_a_timeout_before_the_update(monkeypatch):
    """A GEMM+RS whose peer never pushes fills the fused backend's error word; no per-call check
    has read it (the launch was never counted). The pre-step check
    (``install_optimizer_error_check``, ``check_fused_errors``) raises it, naming the op and
    the rank, before the optimizer changes a weight; with the word clean it lets steps run."""
    from megatron_flux import arguments
    from megatron_flux.backends import registry
    from megatron_flux.backends.flux import FluxBackend
    from megatron_flux.comm.errors import FusedOpTimeout

    dev = torch.device("cuda", 0)
    fused = FluxBackend()
    word = fused.resources.error_word("GEMM+RS", dev)
    monkeypatch.setitem(registry._INSTANCES, "flux", fused)
    monkeypatch.setattr(arguments, "_OPTIMIZER_CHECK", None)
    model = torch.nn.Linear(4, 4, device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    try:
        arguments.install_optimizer_error_check()
        model(torch.ones(2, 4, device=dev)).sum().backward()
        opt.step()  # a clean word: the step runs
        launch_gemm_rs_without_its_peer(word.device_word)
        before = model.weight.detach().clone()
        with pytest.raises(FusedOpTimeout, match="GEMM\\+RS: rank 0 timed out"):
            opt.step()
        assert torch.equal(model.weight, before), "no update after the timeout"
    finally:
        if arguments._OPTIMIZER_CHECK is not None:
            arguments._OPTIMIZER_CHECK.remove()
