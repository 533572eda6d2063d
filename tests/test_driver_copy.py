"""megatron_flux.comm.driver_copy: which copies go to the driver, with what arguments, and the
fallback to ``Tensor.copy_`` (CPU, with stand-ins for CUDA tensors and the driver call); on a
GPU, the driver's copy against ``copy_``."""

import pytest
import torch

from megatron_flux.comm import driver_copy as dc


class FakeCuda:
    """Just what ``plain_copy`` and ``copy_on_stream`` read of a CUDA tensor."""

    def __init__(self, ptr, numel, dtype=torch.bfloat16, device=0, contiguous=True):
        self.ptr, self._numel, self.dtype = ptr, numel, dtype
        self.device_index, self.contiguous, self.is_cuda = device, contiguous, True
        self.copied_from = None

    def numel(self):
        return self._numel

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def get_device(self):
        return self.device_index

    def is_contiguous(self):
        return self.contiguous

    def data_ptr(self):
        return self.ptr

    def copy_(self, src):
        self.copied_from = src


class FakeStream:
    cuda_stream = 0xABC


@pytest.fixture
def driver(monkeypatch):
    calls = []

    def memcpy(dst, src, nbytes, stream):
        calls.append((dst, src, nbytes, stream))
        return memcpy.rc

    memcpy.rc = 0
    monkeypatch.setattr(dc, "_memcpy", memcpy)
    monkeypatch.setattr(dc, "driver_copies", 0)
    return memcpy, calls


def test_env_switch(monkeypatch):
    monkeypatch.delenv(dc.ENV_DRIVER_COPY, raising=False)
    assert dc.driver_copy_enabled() is False
    monkeypatch.setenv(dc.ENV_DRIVER_COPY, "1")
    assert dc.driver_copy_enabled() is True
    monkeypatch.setenv(dc.ENV_DRIVER_COPY, "0")
    assert dc.driver_copy_enabled() is False
    monkeypatch.setenv(dc.ENV_DRIVER_COPY, "yes")
    with pytest.raises(ValueError, match="MEGATRON_FLUX_DRIVER_COPY"):
        dc.driver_copy_enabled()


def test_plain_copy_goes_to_the_driver(driver):
    memcpy, calls = driver
    dst, src = FakeCuda(0x1000, 300), FakeCuda(0x9000, 300)
    dc.copy_on_stream(dst, src, FakeStream(), True)
    assert calls == [(0x1000, 0x9000, 600, 0xABC)]  # destination first, bytes, the given stream
    assert dst.copied_from is None and dc.driver_copies == 1


@pytest.mark.parametrize("change", [
    dict(dtype=torch.float16), dict(numel=299), dict(device=1), dict(contiguous=False),
])
@pytest.mark.parametrize("side", ["dst", "src"])
def test_anything_else_falls_back(driver, change, side):
    memcpy, calls = driver
    kw = dict(ptr=0x1000, numel=300)
    kw.update({k: v for k, v in change.items() if k != "numel"})
    odd = FakeCuda(**kw)
    if "numel" in change:
        odd._numel = change["numel"]
    plain = FakeCuda(0x9000, 300)
    dst, src = (odd, plain) if side == "dst" else (plain, odd)
    dc.copy_on_stream(dst, src, FakeStream(), True)
    assert calls == [] and dst.copied_from is src and dc.driver_copies == 0


def test_off_and_unavailable_fall_back(driver, monkeypatch):
    memcpy, calls = driver
    dst, src = FakeCuda(0x1000, 8), FakeCuda(0x9000, 8)
    dc.copy_on_stream(dst, src, FakeStream(), False)
    assert calls == [] and dst.copied_from is src
    monkeypatch.setattr(dc, "_memcpy", None)
    monkeypatch.setattr(dc, "_memcpy_error", "no driver here")
    dst2 = FakeCuda(0x1000, 8)
    dc.copy_on_stream(dst2, src, FakeStream(), True)
    assert dst2.copied_from is src and dc.driver_copies == 0


def test_driver_error_raises(driver):
    memcpy, calls = driver
    memcpy.rc = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="cuMemcpyDtoDAsync of 16 bytes on device 0 .*CUresult 1"):
        dc.copy_on_stream(FakeCuda(0x1000, 8), FakeCuda(0x9000, 8), FakeStream(), True)


def test_empty_copy_queues_nothing(driver):
    memcpy, calls = driver
    dc.copy_on_stream(FakeCuda(0x1000, 0), FakeCuda(0x9000, 0), FakeStream(), True)
    assert calls == []


def test_cpu_tensors_copy_through_torch():
    dst, src = torch.zeros(6), torch.arange(6.0)
    dc.copy_on_stream(dst, src, None, True)
    assert torch.equal(dst, src)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_driver_copy_matches_copy_on_gpu():
    if dc.driver_copy_unavailable_reason():
        pytest.skip(dc.driver_copy_unavailable_reason())
    gen = torch.Generator("cuda").manual_seed(0)
    src = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16, generator=gen)
    dst = torch.full_like(src, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    before = dc.driver_copies
    with torch.cuda.stream(side):  # the given stream must be the current one
        dc.copy_on_stream(dst[1:], src[:-1], side, True)  # views at an offset
    torch.cuda.current_stream().wait_stream(side)
    assert dc.driver_copies == before + 1
    assert torch.isnan(dst[0]) and torch.equal(dst[1:], src[:-1])
    rows = torch.randn(64, 32, device="cuda", generator=gen)
    out = torch.zeros(32, 64, device="cuda")
    dc.copy_on_stream(out, rows.t(), torch.cuda.current_stream(), True)  # strided: copy_
    assert torch.equal(out, rows.t()) and dc.driver_copies == before + 1
