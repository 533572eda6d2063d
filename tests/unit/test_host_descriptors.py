"""megatron_flux.kernels.descriptors.bind_descriptor: the host TMA descriptors a launch builds
are the constructor's, validated once per geometry (CPU; the kernels consume them on the GPU)."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from megatron_flux.kernels import descriptors as D  # noqa: E402
from megatron_flux.kernels import gluon_ws  # noqa: E402


def _fields(desc):
    return {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc)}


def _same(a, b):
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        if name == "base":
            assert fa[name] is fb[name]
        else:
            assert fa[name] == fb[name], name


@pytest.fixture(autouse=True)
def _fresh_templates(monkeypatch):
    monkeypatch.setattr(D, "_TEMPLATES", {})


def test_bound_descriptors_equal_the_constructors():
    geometry = ([256, 64], [64, 1], [128, 64])
    first = torch.empty(256, 64, dtype=torch.bfloat16)
    second = torch.empty(256, 64, dtype=torch.bfloat16)
    a = D.host_descriptor(first, *geometry)           # constructed (and checked)
    b = D.host_descriptor(second, *geometry)          # bound from the checked fields
    assert type(b) is TensorDescriptor and b.base is second
    _same(a, TensorDescriptor(first, *map(list, geometry)))
    _same(b, TensorDescriptor(second, *map(list, geometry)))
    assert len(D._TEMPLATES) == 1
    # another dtype, block, shape or stride is another geometry, checked by the constructor
    # again; every call, first or later, gives what the constructor gives
    half = torch.empty(256, 64, dtype=torch.float16)
    wide = second.view(128, 128)
    others = [(half, geometry), (second, ([256, 64], [64, 1], [64, 64])),
              (wide, ([128, 128], [128, 1], [128, 64])), (wide, ([128, 64], [128, 1], [128, 64])),
              (second, ([128, 64], [64, 1], [128, 64]))]
    for _ in range(2):
        for t, (shape, strides, block) in others:
            _same(D.host_descriptor(t, shape, strides, block),
                  TensorDescriptor(t, list(shape), list(strides), list(block)))
    assert len(D._TEMPLATES) == 6


def test_bad_geometry_still_fails_on_every_call():
    t = torch.empty(256, 64, dtype=torch.bfloat16)
    for _ in range(2):  # a failed construction leaves no template behind
        with pytest.raises(Exception):
            D.host_descriptor(t, [256, 64], [64, 1], [96, 64])  # not a power of two
    assert not D._TEMPLATES


def test_unaligned_base_is_refused_before_and_after_the_template():
    t = torch.empty(256 * 64 + 8, dtype=torch.bfloat16)
    aligned, unaligned = t[:256 * 64].view(256, 64), t[1:256 * 64 + 1].view(256, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        D.host_descriptor(unaligned, [256, 64], [64, 1], [128, 64])
    D.host_descriptor(aligned, [256, 64], [64, 1], [128, 64])
    with pytest.raises(ValueError, match="16-byte aligned"):
        D.host_descriptor(unaligned, [256, 64], [64, 1], [128, 64])


def test_templates_are_bounded(monkeypatch):
    monkeypatch.setattr(D, "_MAX_TEMPLATES", 3)
    t = torch.empty(512, 64, dtype=torch.bfloat16)
    for rows in (128, 256, 384, 512):
        D.host_descriptor(t, [rows, 64], [64, 1], [128, 64])
    assert len(D._TEMPLATES) <= 3


@pytest.mark.skipif(gluon_ws.GLUON_ERROR is not None, reason="this Triton has no Gluon")
def test_gluon_descriptors_keep_their_layout():
    t, u = torch.empty(256, 64, dtype=torch.bfloat16), torch.empty(256, 64, dtype=torch.bfloat16)
    geometry = ([256, 64], [64, 1], [128, 64])
    a = gluon_ws.host_descriptor(t, *geometry)
    b = gluon_ws.host_descriptor(u, *geometry)
    assert type(b) is gluon_ws.GluonTensorDescriptor and b.base is u
    layout = gluon_ws._shared_layout((128, 64), torch.bfloat16)
    _same(a, gluon_ws.GluonTensorDescriptor(t, *map(list, geometry), layout))
    _same(b, gluon_ws.GluonTensorDescriptor(u, *map(list, geometry), layout))


def test_templates_do_not_keep_tensors_alive():
    import gc
    import weakref

    t = torch.empty(256, 64, dtype=torch.bfloat16)
    ref = weakref.ref(t)
    D.host_descriptor(t, [256, 64], [64, 1], [128, 64])
    del t
    gc.collect()
    assert ref() is None and D._TEMPLATES  # the geometry stays, the activation does not


@pytest.mark.skipif(gluon_ws.GLUON_ERROR is not None, reason="this Triton has no Gluon")
def test_a_geometry_with_another_layout_is_another_template():
    from triton.experimental.gluon import language as gl

    t = torch.empty(256, 64, dtype=torch.bfloat16)
    geometry = ([256, 64], [64, 1], [128, 64])
    for swizzle in (128, 64, 128):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
        desc = D.bind_descriptor(gluon_ws.GluonTensorDescriptor, t, *geometry, layout)
        assert desc.layout == layout
