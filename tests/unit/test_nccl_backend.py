"""The reference backend against dense float64 math, on gloo at TP=2 and TP=4.

Every rank builds the same full operands from a fixed seed, runs the backend on its shard, and
compares with the rows it owns of the dense single-process result. One world per TP size runs
all checks (see ``dist_harness.run_checks``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.dist_harness import run_checks

from megatron_flux.backends import get_backend, resolve_backend
from megatron_flux.backends import nccl as nccl_mod
from megatron_flux.backends.nccl import NcclBackend

M_LOCAL, K, N = 3, 5, 7
TOL = dict(rtol=1e-12, atol=1e-12)


def _full(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rows(t, rank, m_local):
    return t[rank * m_local : (rank + 1) * m_local]


def _weight_layouts(seed):
    """``b`` as the layers pass it (``weight.t()``, a strided view) and row-major."""
    w = _full(N, K, seed=seed)  # [n, k] like a linear weight
    return {"weight_t": w.t(), "row_major": w.t().contiguous()}


# ------------------------------------------------------------------------------ checks
def check_all_gather_matmul(rank, world):
    be = NcclBackend()
    a_full = _full(M_LOCAL * world, K, seed=1)
    a_shard = _rows(a_full, rank, M_LOCAL).clone()
    for layout, b in _weight_layouts(2).items():
        ref = a_full @ b
        c, gathered = be.all_gather_matmul(a_shard, b, dist.group.WORLD)
        torch.testing.assert_close(c, ref, **TOL, msg=layout)
        assert gathered is None
        c, gathered = be.all_gather_matmul(a_shard, b, dist.group.WORLD, return_gathered=True)
        torch.testing.assert_close(c, ref, **TOL)
        torch.testing.assert_close(gathered, a_full, rtol=0, atol=0)


def check_all_gather_matmul_out_buffers(rank, world):
    be = NcclBackend()
    a_full = _full(M_LOCAL * world, K, seed=3)
    b = _weight_layouts(4)["weight_t"]
    out = torch.full((M_LOCAL * world, N), float("nan"), dtype=torch.float64)
    gathered_out = torch.full((M_LOCAL * world, K), float("nan"), dtype=torch.float64)
    c, gathered = be.all_gather_matmul(
        _rows(a_full, rank, M_LOCAL).clone(), b, dist.group.WORLD,
        out=out, return_gathered=True, gathered_out=gathered_out,
    )
    assert c.data_ptr() == out.data_ptr() and gathered.data_ptr() == gathered_out.data_ptr()
    torch.testing.assert_close(out, a_full @ b, **TOL)
    torch.testing.assert_close(gathered_out, a_full, rtol=0, atol=0)
    # gathered_out is only used when the gathered input is asked for
    gathered_out.fill_(0)
    be.all_gather_matmul(_rows(a_full, rank, M_LOCAL).clone(), b, dist.group.WORLD, gathered_out=gathered_out)
    assert gathered_out.abs().sum() == 0


def check_all_gather_matmul_non_contiguous_shard(rank, world):
    be = NcclBackend()
    a_full = _full(M_LOCAL * world, K, seed=5)
    wide = torch.zeros(M_LOCAL, 2 * K, dtype=torch.float64)
    wide[:, ::2] = _rows(a_full, rank, M_LOCAL)
    shard = wide[:, ::2]  # same values, stride 2
    assert not shard.is_contiguous()
    b = _weight_layouts(6)["weight_t"]
    c, _ = be.all_gather_matmul(shard, b, dist.group.WORLD)
    torch.testing.assert_close(c, a_full @ b, **TOL)


def check_matmul_reduce_scatter(rank, world):
    be = NcclBackend()
    m = M_LOCAL * world
    partials = [_full(m, K, seed=100 + r) for r in range(world)]  # rank r's A
    bias = _full(N, seed=7)
    for layout, b in _weight_layouts(8).items():
        ref = sum(p @ b for p in partials)
        c = be.matmul_reduce_scatter(partials[rank], b, dist.group.WORLD)
        torch.testing.assert_close(c, _rows(ref, rank, M_LOCAL), **TOL, msg=layout)
        c = be.matmul_reduce_scatter(partials[rank], b, dist.group.WORLD, bias=bias)
        # the bias is added once, after the reduction (not once per rank)
        torch.testing.assert_close(c, _rows(ref, rank, M_LOCAL) + bias, **TOL)
    out = torch.empty(M_LOCAL, N, dtype=torch.float64)
    c = be.matmul_reduce_scatter(partials[rank], b, dist.group.WORLD, out=out, bias=bias)
    assert c.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, _rows(ref, rank, M_LOCAL) + bias, **TOL)


def check_matmul_reduce_scatter_start(rank, world):
    """The asynchronous twin gives the same rows, the bias once after the reduction, and
    several started calls may be in flight before the first wait."""
    be = NcclBackend()
    m = M_LOCAL * world
    partials = [_full(m, K, seed=150 + r) for r in range(world)]
    bias = _full(N, seed=17)
    b = _weight_layouts(18)["weight_t"]
    ref = _rows(sum(p @ b for p in partials), rank, M_LOCAL)
    first = be.matmul_reduce_scatter_start(partials[rank], b, dist.group.WORLD)
    second = be.matmul_reduce_scatter_start(partials[rank], b, dist.group.WORLD, bias=bias)
    torch.testing.assert_close(second.wait(), ref + bias, **TOL)
    torch.testing.assert_close(first.wait(), ref, **TOL)
    assert second.wait() is second.wait(), "wait() twice must not add the bias twice"
    torch.testing.assert_close(second.wait(), ref + bias, **TOL)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        be.matmul_reduce_scatter_start(torch.zeros(m + 1, K, dtype=torch.float64), b, dist.group.WORLD)


def check_plain_collectives(rank, world):
    be = NcclBackend()
    full = _full(2 * world, 3, 4, seed=9)
    mine = _rows(full, rank, 2).clone()
    torch.testing.assert_close(be.all_gather(mine, dist.group.WORLD), full, rtol=0, atol=0)
    per_rank = [_full(2 * world, 3, seed=200 + r) for r in range(world)]
    out = torch.empty(2, 3, dtype=torch.float64)
    got = be.reduce_scatter(per_rank[rank], dist.group.WORLD, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, _rows(sum(per_rank), rank, 2), **TOL)
    # a non-contiguous out is filled correctly too
    holder = torch.zeros(3, 2, dtype=torch.float64)
    got = be.reduce_scatter(per_rank[rank], dist.group.WORLD, out=holder.t())
    torch.testing.assert_close(holder.t(), _rows(sum(per_rank), rank, 2), **TOL)


def check_all_gather_start(rank, world):
    """The asynchronous re-gather gives all_gather's result, into the given buffer."""
    be = NcclBackend()
    full = _full(world * M_LOCAL, K, seed=9)
    mine = _rows(full, rank, M_LOCAL).clone()
    out = torch.full_like(full, float("nan"))
    pending = be.all_gather_start(mine, dist.group.WORLD, out=out)
    got = pending.wait()
    assert got is out and pending.wait() is out  # waiting twice is harmless
    torch.testing.assert_close(got, full, rtol=0, atol=0)
    torch.testing.assert_close(be.all_gather_start(mine, dist.group.WORLD).wait(), full,
                               rtol=0, atol=0)
    # a non-contiguous out: gathered synchronously through a temporary, then copied
    wide = torch.full((world * M_LOCAL, 2 * K), float("nan"), dtype=full.dtype)
    strided = wide[:, ::2]
    assert be.all_gather_start(mine, dist.group.WORLD, out=strided).wait() is strided
    torch.testing.assert_close(strided, full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="all_gather"):
        be.all_gather_start(mine, dist.group.WORLD, out=torch.empty(1, dtype=full.dtype))


def check_reduce_scatter_without_tensor_collective_raises_on_every_call(rank, world):
    """A process group without the tensor reduce-scatter gets a clear error naming the op, the
    backend and the rank, on every call: no rank switches to another collective on its own
    (its peers, not seeing the error, would run the reduce-scatter against it)."""
    calls = []

    def unsupported(out, inp, group=None, async_op=False):
        calls.append(1)
        raise RuntimeError("Backend gloo does not support _reduce_scatter_base")

    original = nccl_mod._reduce_scatter_single
    nccl_mod._reduce_scatter_single = unsupported
    try:
        be = NcclBackend()
        a, b = _full(M_LOCAL * world, K, seed=300 + rank), _weight_layouts(10)["weight_t"]
        expected = (f"megatron-flux nccl reduce_scatter: the 'gloo' process group on rank "
                    f"{rank} does not run the tensor reduce-scatter")
        with pytest.raises(RuntimeError, match=expected):
            be.matmul_reduce_scatter(a, b, dist.group.WORLD)
        with pytest.raises(RuntimeError, match=expected):
            be.matmul_reduce_scatter_start(a, b, dist.group.WORLD)
        assert len(calls) == 2, "asked again, not switched to another collective"
    finally:
        nccl_mod._reduce_scatter_single = original
    # the world is still in step: the real reduce-scatter runs on gloo, in every dtype
    for dtype in (torch.float64, torch.bfloat16):
        x = torch.full((world, 2), float(rank + 1), dtype=dtype)
        got = NcclBackend().reduce_scatter(x, dist.group.WORLD)
        torch.testing.assert_close(got, torch.full((1, 2), world * (world + 1) / 2, dtype=dtype))


def check_reduce_scatter_real_errors_propagate(rank, world):
    def broken(out, inp, group=None, async_op=False):
        raise RuntimeError("connection reset by peer")

    original = nccl_mod._reduce_scatter_single
    nccl_mod._reduce_scatter_single = broken
    try:
        with pytest.raises(RuntimeError, match="connection reset"):
            NcclBackend().reduce_scatter(torch.ones(world, 2, dtype=torch.float64), dist.group.WORLD)
    finally:
        nccl_mod._reduce_scatter_single = original


def check_single_rank_group(rank, world):
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    g = groups[rank]
    be = NcclBackend()
    a = _full(4, K, seed=11)
    b = _weight_layouts(12)["weight_t"]
    c, gathered = be.all_gather_matmul(a, b, g, return_gathered=True)
    torch.testing.assert_close(c, a @ b, **TOL)
    torch.testing.assert_close(gathered, a, rtol=0, atol=0)
    bias = _full(N, seed=13)
    torch.testing.assert_close(be.matmul_reduce_scatter(a, b, g, bias=bias), a @ b + bias, **TOL)


def check_invalid_inputs(rank, world):
    be = NcclBackend()
    g = dist.group.WORLD
    b = _weight_layouts(14)["weight_t"]
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        be.matmul_reduce_scatter(torch.zeros(world + 1, K, dtype=torch.float64), b, g)
    with pytest.raises(TypeError, match="float32.*float64"):
        be.all_gather_matmul(torch.zeros(2, K, dtype=torch.float32), b, g)
    with pytest.raises(TypeError, match="float32.*float64"):
        be.matmul_reduce_scatter(torch.zeros(world, K, dtype=torch.float32), b, g)
    with pytest.raises(ValueError, match="must be 2-D"):
        be.all_gather_matmul(torch.zeros(2, 1, K, dtype=torch.float64), b, g)
    with pytest.raises(ValueError, match="must be 2-D"):
        be.matmul_reduce_scatter(torch.zeros(world, K, dtype=torch.float64), b.unsqueeze(0), g)
    with pytest.raises(ValueError, match="inner dimensions"):
        be.all_gather_matmul(torch.zeros(2, K + 1, dtype=torch.float64), b, g)
    with pytest.raises(ValueError, match="out must be"):
        be.all_gather_matmul(torch.zeros(2, K, dtype=torch.float64), b, g, out=torch.empty(2, N, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias must be"):
        be.matmul_reduce_scatter(
            torch.zeros(world, K, dtype=torch.float64), b, g, bias=torch.zeros(N, dtype=torch.float32)
        )
    # the world is still in step after the rejected calls
    torch.testing.assert_close(
        be.all_gather(torch.full((1,), float(rank), dtype=torch.float64), g),
        torch.arange(world, dtype=torch.float64), rtol=0, atol=0,
    )


CHECKS = [
    check_all_gather_matmul,
    check_all_gather_matmul_out_buffers,
    check_all_gather_matmul_non_contiguous_shard,
    check_matmul_reduce_scatter,
    check_matmul_reduce_scatter_start,
    check_plain_collectives,
    check_all_gather_start,
    check_reduce_scatter_without_tensor_collective_raises_on_every_call,
    check_reduce_scatter_real_errors_propagate,
    check_single_rank_group,
    check_invalid_inputs,
]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def world_results(request):
    return run_checks(CHECKS, request.param, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_nccl_backend(world_results, check):
    failure = world_results[check.__name__]
    assert failure is None, failure


def test_megatron_is_a_layer_setting_not_a_backend():
    """``megatron`` is accepted wherever a layer's backend is named, but the ops refuse it and
    nothing can register under it."""
    from megatron_flux.backends import (BACKEND_CHOICES, MEGATRON_PASSTHROUGH, register_backend,
                                        validate_backend_name)

    assert MEGATRON_PASSTHROUGH in BACKEND_CHOICES
    assert validate_backend_name("megatron") == "megatron"
    a = torch.zeros(2, K, dtype=torch.float64)
    with pytest.raises(ValueError, match="layer setting"):
        resolve_backend("megatron", a, a.t(), None)
    with pytest.raises(ValueError, match="layer settings, not backends"):
        register_backend("megatron", NcclBackend())


@pytest.mark.parametrize("impl", [42, "nccl", None, NcclBackend])
def test_register_backend_takes_a_backend_or_a_factory_and_refuses_the_rest(impl, monkeypatch):
    """Something neither a TPOverlapBackend nor callable is refused when registered, naming
    the backend, instead of failing at the first forward with a bare TypeError."""
    from megatron_flux.backends import available_backends, get_backend, register_backend, registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_INSTANCES", {})
    if impl is NcclBackend:  # a class is a factory; an instance is a backend
        register_backend("mine", impl)
        register_backend("mine2", impl())
        assert isinstance(get_backend("mine"), NcclBackend) and isinstance(get_backend("mine2"), NcclBackend)
        return
    with pytest.raises(TypeError, match=r"register_backend\('mine', \.\.\.\): expected a TPOverlapBackend"):
        register_backend("mine", impl)
    assert "mine" not in available_backends()
    with pytest.raises(TypeError, match="name must be a str"):
        register_backend(42, NcclBackend)


@pytest.mark.parametrize("what", ["register_backend", "provider", "options", "registry.reset",
                                  "registry.use_table_files"])
def test_resolution_cache_is_dropped_when_its_inputs_change(what):
    """resolve_backend's cached answers (and auto's) die with whatever they were computed from: a
    newly registered backend, the tables, the decisions cached from them, or the options (the
    ``auto`` margin)."""
    from megatron_flux.backends import auto
    from megatron_flux.backends import registry as B
    from megatron_flux.options import get_options, set_options
    from megatron_flux.tuning import provider, registry

    B._RESOLVED[("sentinel",)] = NcclBackend()
    auto._CACHE[("sentinel",)] = NcclBackend()
    if what == "register_backend":
        B.register_backend("nccl", NcclBackend, override=True)
    elif what == "provider":
        provider.clear_caches()
    elif what == "options":
        set_options(get_options().replace(auto_margin=0.5))
        set_options(None)
    elif what == "registry.reset":
        registry.reset()
    else:
        registry.use_table_files([], validate=False)
    assert ("sentinel",) not in B._RESOLVED
    if what != "register_backend":
        assert ("sentinel",) not in auto._CACHE


def test_registry_resolves_nccl_on_cpu():
    """``nccl`` is registered lazily, and ``auto`` falls back to it for CPU tensors."""
    backend = get_backend("nccl")
    assert isinstance(backend, NcclBackend) and backend.name == "nccl"
    a = torch.zeros(2, K, dtype=torch.float64)
    assert resolve_backend("auto", a, a.t(), None) is backend
    assert resolve_backend("nccl", a, a.t(), None) is backend


def test_the_resolution_caches_stay_bounded_when_shapes_keep_changing(monkeypatch):
    """A job whose shapes keep changing (variable sequence lengths) asks about a new signature
    at every call: resolve_backend's cache, auto's and the fused backend's starts over at
    ``MAX_CACHED_SIGNATURES`` instead of growing without bound, and still answers."""
    from megatron_flux.backends import base
    from megatron_flux.backends import registry as B
    from megatron_flux.backends.flux import FluxBackend

    monkeypatch.setattr(base, "MAX_CACHED_SIGNATURES", 8)  # every cache's bound (base.remember)
    B.clear_resolution_cache()
    backend = get_backend("nccl")
    b = torch.zeros(K, 4, dtype=torch.float64)
    for rows in range(1, 30):
        a = torch.zeros(rows, K, dtype=torch.float64)
        assert resolve_backend("nccl", a, b, None) is backend
        assert resolve_backend("auto", a, b, None) is backend
        assert len(B._RESOLVED) <= 8
    fused = FluxBackend(config_provider=lambda op, m, n, k: ("cfg", m))
    for m in range(1, 30):
        assert fused.config("rs", m, 4, K) == ("cfg", m)
        assert len(fused._plans) <= 8
    B.clear_resolution_cache()
