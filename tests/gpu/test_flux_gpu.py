"""GPU correctness of the fused backend against NCCL + torch.matmul in fp32.

Spawns one process per visible GPU (skipped below 2 GPUs). Each check draws fresh random
inputs, poisons outputs with NaN first, and compares with the reference; repeated calls with
changing shapes exercise signal/epoch reuse and the workspace parity; repeated identical calls
must be bitwise identical; AllGather's small chunks and GEMM+RS's schedule knobs run over every
shape; fused calls queued back to back alternate signal layouts and RS push modes (TMA,
vector stores, copy engine); the copy-engine all-gather runs beside GEMM+RS (SM and copy-engine
pushes) in the column backward's order; AG+GEMM's stream-K
tail and its merged local rows (``ag_merge_local``) run over every shape. Runs under both
``CUDA_DEVICE_MAX_CONNECTIONS=1``
(Megatron's setting) and the driver default.
"""

import dataclasses
import os
import sys
import time

import pytest
import torch

from helpers.gpu_harness import (init_rank, launch_gemm_rs_without_its_peer, nccl_worker,
                                 run_nccl_world)

pytestmark = pytest.mark.gpu

_NEEDS_2_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs"
)

# (m_local, k, n): training-like, ragged m_local (not a multiple of any block), tiny, odd n
SHAPES = [(256, 512, 1024), (100, 264, 520), (1, 64, 64), (777, 1024, 392), (1024, 2048, 3072)]


def _rel(x, ref):
    return float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _check_ag(flux, group, rank, world, m_local, k, n, dtype, layout, tol, gen):
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(m_local, k, generator=gen, device=dev).to(dtype)
    w = torch.randn(n, k, generator=gen, device=dev).to(dtype)  # same on all ranks
    torch.distributed.broadcast(w, 0, group=group)
    b = w.t() if layout == "nk" else w.t().contiguous()
    gathered_ref = torch.empty(world * m_local, k, dtype=dtype, device=dev)
    torch.distributed.all_gather_into_tensor(gathered_ref, x, group=group)
    ref = gathered_ref.float() @ b.float()
    out = torch.full((world * m_local, n), float("nan"), dtype=dtype, device=dev)
    out, gathered = flux.all_gather_matmul(x, b, group, out=out, return_gathered=True)
    assert not torch.isnan(out).any(), "AG+GEMM left output elements unwritten"
    err = _rel(out, ref)
    assert err < tol, f"AG+GEMM rel err {err} ({m_local},{k},{n},{dtype},{layout})"
    assert torch.equal(gathered, gathered_ref), "AG+GEMM gathered input differs from NCCL's"
    return out


def _check_rs(flux, group, rank, world, m_local, k, n, dtype, layout, tol, gen, with_bias):
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(world * m_local, k, generator=gen, device=dev).to(dtype)
    w = torch.randn(n, k, generator=gen, device=dev).to(dtype)  # differs per rank (k is a shard)
    b = w.t() if layout == "nk" else w.t().contiguous()
    bias = torch.randn(n, generator=gen, device=dev).to(dtype) if with_bias else None
    if bias is not None:
        torch.distributed.broadcast(bias, 0, group=group)
    full = a.float() @ b.float()
    torch.distributed.all_reduce(full, group=group)
    ref = full[rank * m_local:(rank + 1) * m_local]
    if bias is not None:
        ref = ref + bias.float()
    out = torch.full((m_local, n), float("nan"), dtype=dtype, device=dev)
    out = flux.matmul_reduce_scatter(a, b, group, out=out, bias=bias)
    assert not torch.isnan(out).any(), "GEMM+RS left output elements unwritten"
    err = _rel(out, ref)
    assert err < tol, f"GEMM+RS rel err {err} ({m_local},{k},{n},{dtype},{layout},bias={with_bias})"
    again = flux.matmul_reduce_scatter(a, b, group, bias=bias)
    assert torch.equal(out, again), "GEMM+RS is not bitwise deterministic"
    return out


def _check_rs_start_every_shape(flux, group, rank, world, gen):
    """``matmul_reduce_scatter_start`` (the column backward's dgrad) over every shape of SHAPES,
    with a GEMM queued before ``wait()`` as the wgrad is, the output checked against fp32 math
    and bitwise against a second call; returns the number of checks."""
    dev = torch.device("cuda", torch.cuda.current_device())
    for (m_local, k, n) in SHAPES:
        a = torch.randn(world * m_local, k, generator=gen, device=dev).to(torch.bfloat16)
        b = torch.randn(k, n, generator=gen, device=dev).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen, device=dev).to(torch.bfloat16) if m_local % 2 == 0 else None
        if bias is not None:
            torch.distributed.broadcast(bias, 0, group=group)
        full = a.float() @ b.float()
        torch.distributed.all_reduce(full, group=group)
        ref = full[rank * m_local:(rank + 1) * m_local] + (bias.float() if bias is not None else 0)
        outs = []
        for _ in range(2):
            pending = flux.matmul_reduce_scatter_start(a, b, group, bias=bias)
            beside = a.t() @ a  # the wgrad's place
            outs.append(pending.wait().clone())
            del beside
        err = _rel(outs[0], ref)
        assert err < 2e-2, f"dgrad ({flux.column_dgrad}) rel err {err} ({m_local},{k},{n})"
        assert torch.equal(outs[0], outs[1]), f"dgrad ({flux.column_dgrad}) is not deterministic"
    flux.check_errors()
    return len(SHAPES)


def _default_config_with(op, m_total, n, k, **fields):
    """The heuristic default config of a shape with ``fields`` changed."""
    from megatron_flux.kernels.config import default_config

    return dataclasses.replace(default_config(op, m_total, n, k), **fields)


def _default_with(**fields):
    """A FluxBackend whose every config is the heuristic default with ``fields`` changed."""
    from megatron_flux.backends.flux import FluxBackend

    return FluxBackend(config_provider=lambda op, m_total, n, k: _default_config_with(
        op, m_total, n, k, **fields))


def _check_ag_every_shape(flux, group, rank, world, gen):
    """:func:`_check_ag` (bf16) over every shape of SHAPES in both B layouts, then the
    backend's error word; returns the number of checks."""
    for layout in ("nk", "kn"):
        for (m_local, k, n) in SHAPES:
            _check_ag(flux, group, rank, world, m_local, k, n, torch.bfloat16, layout, 2e-2, gen)
    flux.check_errors()
    return 2 * len(SHAPES)


def _check_back_to_back(flux, group, rank, world, gen, rounds=12):
    """AG+GEMM and GEMM+RS calls queued back to back, with no collective between them (the
    references are computed first), alternating two shapes whose configs give different signal
    layouts; every output is checked afterwards."""
    dev = torch.device("cuda", torch.cuda.current_device())
    m_local, k, dtype = 256, 512, torch.bfloat16
    cases = []
    for n in (512, 1024):
        x = torch.randn(m_local, k, generator=gen, device=dev).to(dtype)
        w = torch.randn(n, k, generator=gen, device=dev).to(dtype)
        torch.distributed.broadcast(w, 0, group=group)
        gathered = torch.empty(world * m_local, k, dtype=dtype, device=dev)
        torch.distributed.all_gather_into_tensor(gathered, x, group=group)
        ag_ref = gathered.float() @ w.t().float()
        a = torch.randn(world * m_local, k, generator=gen, device=dev).to(dtype)
        wr = torch.randn(n, k, generator=gen, device=dev).to(dtype)
        full = a.float() @ wr.t().float()
        torch.distributed.all_reduce(full, group=group)
        rs_ref = full[rank * m_local:(rank + 1) * m_local]
        cases.append((x, w.t(), ag_ref, a, wr.t(), rs_ref))
    outs = []
    for i in range(rounds):
        x, b, _, a, br, _ = cases[i % 2]
        outs.append((i % 2, flux.all_gather_matmul(x, b, group)[0], flux.matmul_reduce_scatter(a, br, group)))
    torch.cuda.synchronize()
    flux.check_errors()
    for which, ag_out, rs_out in outs:
        _, _, ag_ref, _, _, rs_ref = cases[which]
        assert _rel(ag_out, ag_ref) < 2e-2, f"back-to-back AG+GEMM rel err {_rel(ag_out, ag_ref)}"
        assert _rel(rs_out, rs_ref) < 2e-2, f"back-to-back GEMM+RS rel err {_rel(rs_out, rs_ref)}"
    return 2 * rounds


def _check_gather_beside_rs(flux, group, rank, world, gen, rounds=10):
    """The copy-engine all-gather in the column backward's order: started, then a GEMM+RS
    queued, then waited for; rounds queued back to back (no collective between them) over
    changing shapes, 3-D and fp32 inputs. Rows must equal NCCL's gather exactly."""
    dev = torch.device("cuda", torch.cuda.current_device())
    cases = []
    for i in range(rounds):
        m_local, k, n = SHAPES[i % len(SHAPES)]
        dtype = torch.float32 if i == 3 else torch.bfloat16
        shape = (m_local, 2, k // 2) if i % 2 else (m_local, k)
        x = torch.randn(*shape, generator=gen, device=dev).to(dtype)
        g_ref = torch.empty((world * m_local, *shape[1:]), dtype=dtype, device=dev)
        torch.distributed.all_gather_into_tensor(g_ref, x, group=group)
        a = torch.randn(world * m_local, k, generator=gen, device=dev).to(torch.bfloat16)
        w = torch.randn(n, k, generator=gen, device=dev).to(torch.bfloat16)
        full = a.float() @ w.t().float()
        torch.distributed.all_reduce(full, group=group)
        cases.append((x, g_ref, a, w.t(), full[rank * m_local:(rank + 1) * m_local]))
    results = []
    for x, _, a, b, _ in cases:
        pending = flux.all_gather_start(x, group)
        rs_out = flux.matmul_reduce_scatter(a, b, group)
        results.append((pending.wait().clone(), rs_out))  # valid until the next start
    torch.cuda.synchronize()
    flux.check_errors()
    for (g, rs_out), (_, g_ref, _, _, rs_ref) in zip(results, cases):
        assert g.shape == g_ref.shape, f"gather shape {tuple(g.shape)} != {tuple(g_ref.shape)}"
        assert torch.equal(g, g_ref), "copy-engine all-gather differs from NCCL's"
        assert _rel(rs_out, rs_ref) < 2e-2, f"GEMM+RS beside the gather: rel err {_rel(rs_out, rs_ref)}"
    out = torch.full_like(cases[0][1], float("nan"))
    assert flux.all_gather_start(cases[0][0], group, out=out).wait() is out
    assert torch.equal(out, cases[0][1]), "copy-engine all-gather into out= differs"
    return rounds + 1


def _bound_launches():
    from megatron_flux.kernels import ag_gemm, ag_gemm_ws, gemm_rs, gemm_rs_ws

    return sum(m._LAUNCH.bound_calls for m in (ag_gemm, ag_gemm_ws, gemm_rs, gemm_rs_ws)
               if m._LAUNCH is not None)


def _check_bound_launches(flux, group, rank, world, gen, calls=10):
    """Calls of one signature after each parity's first launch through the call plan's bound
    launch (:class:`megatron_flux.kernels.launch.BoundLaunch`), which keeps the plan's buffers
    and takes the operands per call: three inputs and two weights (and biases) alive together
    at distinct addresses, used in turn, each result against NCCL + fp32 matmul; the bound
    launches must have run. Returns the number of checks."""
    dev = torch.device("cuda", torch.cuda.current_device())
    m_local, k, n = 512, 1024, 768
    dt = torch.bfloat16
    xs = [torch.randn(m_local, k, generator=gen, device=dev).to(dt) for _ in range(3)]
    a_s = [torch.randn(world * m_local, k, generator=gen, device=dev).to(dt) for _ in range(3)]
    ws = [torch.randn(n, k, generator=gen, device=dev).to(dt) for _ in range(2)]
    biases = [torch.randn(n, generator=gen, device=dev).to(dt) for _ in range(2)]
    for t in ws + biases:  # AG's weight and the bias: the same on every rank
        torch.distributed.broadcast(t, 0, group=group)
    ag_refs, rs_refs = {}, {}
    for i, x in enumerate(xs):
        gathered = torch.empty(world * m_local, k, dtype=dt, device=dev)
        torch.distributed.all_gather_into_tensor(gathered, x, group=group)
        for j, w in enumerate(ws):
            ag_refs[i, j] = gathered.float() @ w.float().t()
            full = a_s[i].float() @ w.float().t()
            torch.distributed.all_reduce(full, group=group)
            rs_refs[i, j] = full[rank * m_local:(rank + 1) * m_local] + biases[j].float()
    before, kept = _bound_launches(), []
    for c in range(calls):
        i, j = c % 3, c % 2
        out = flux.all_gather_matmul(xs[i], ws[j].t(), group)[0]
        err = _rel(out, ag_refs[i, j])
        assert err < 2e-2, f"AG+GEMM call {c} (input {i}, weight {j}) rel err {err}"
        out_rs = flux.matmul_reduce_scatter(a_s[i], ws[j].t(), group, bias=biases[j])
        err = _rel(out_rs, rs_refs[i, j])
        assert err < 2e-2, f"GEMM+RS call {c} (input {i}, weight {j}) rel err {err}"
        kept += [out, out_rs]  # outputs alive together too: distinct addresses
    torch.cuda.synchronize()
    flux.check_errors()
    if os.environ.get("MEGATRON_FLUX_DIRECT_LAUNCH", "1") == "1":
        from megatron_flux.kernels.launch import _triton_expander

        if _triton_expander() is not None:  # a Triton whose C launcher RawLaunch knows
            assert _bound_launches() - before >= 2 * (calls - 2), "bound launches did not run"
    return 2 * calls


def _gluon_config(op, m_total, n, k):  # both Gluon kernels, ping-pong form
    from megatron_flux.kernels.config import GemmConfig

    return GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4,
                      chunk_rows=128, epilogue_split=1, rs_warp_specialized=True,
                      ag_warp_specialized=True)


def _default_with_copy_engine(op, m_total, n, k):
    from megatron_flux.kernels.config import GemmConfig

    return dataclasses.replace(GemmConfig(), rs_copy_engine=True)


#: the bound-launch section's backends: the tables', copy-engine RS, the Gluon kernels
BOUND_LAUNCH_PROVIDERS = (None, _default_with_copy_engine, _gluon_config)


# consecutive calls under different signal layouts (chunks per segment, tiles per segment): at
# TP >= 3 a peer may signal the next call while this rank still waits on a third rank (the
# workspace keeps the two calls' signals apart by parity)
def _alternating(op, m_total, n, k):  # AG alternates chunk layouts, RS TMA and vector pushes
    from megatron_flux.kernels.config import GemmConfig

    if n == 1024:
        return GemmConfig(block_m=64, block_n=128, num_stages=3, num_warps=4, chunk_rows=32,
                          epilogue_split=1, rs_tma_push=False, flatten=False)
    return GemmConfig(block_m=128, block_n=128, num_stages=3, num_warps=8, chunk_rows=128,
                      epilogue_split=1)


def _alternating_ce(op, m_total, n, k):  # RS alternates copy-engine and SM pushes
    return dataclasses.replace(_alternating(op, m_total, n, k), rs_copy_engine=n == 1024)


def _alternating_ws(op, m_total, n, k):  # RS alternates the Gluon and the Triton kernel
    return dataclasses.replace(_alternating(op, m_total, n, k), rs_warp_specialized=n == 1024)


def _alternating_forms(op, m_total, n, k):  # both ops alternate the Gluon kernels' forms
    from megatron_flux.kernels.config import GemmConfig

    cfg = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4,
                     chunk_rows=128, epilogue_split=1)
    if n != 1024:
        cfg = dataclasses.replace(cfg, block_n=256, num_stages=3, num_warps=8)
    return dataclasses.replace(cfg, rs_warp_specialized=op == "rs", ag_warp_specialized=op == "ag")


#: the back-to-back section's backends, in its order
ALTERNATING_PROVIDERS = (_alternating, _alternating_ce, _alternating_ws, _alternating_forms)


def _stage(rank, t0, name):
    """Rank 0 prints which check section starts, with the seconds since the worker began, to
    stderr (unbuffered under ``pytest -s``): a section that compiles or waits long shows
    where a run that hit its time limit stood."""
    if rank == 0:
        print(f"[test_flux_gpu rank 0 +{time.perf_counter() - t0:.1f}s] {name}", file=sys.stderr,
              flush=True)


@nccl_worker
def _worker(rank, world, port, env):
    t0 = time.perf_counter()
    init_rank(rank, world, port, env)
    from megatron_flux.backends.flux import FluxBackend

    _stage(rank, t0, "both dtypes and layouts")
    group = torch.distributed.group.WORLD
    flux = FluxBackend()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1000 + rank + int.from_bytes(os.urandom(2), "little"))
    n_checks = 0
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
        for layout in ("nk", "kn"):
            for (m_local, k, n) in SHAPES:
                _check_ag(flux, group, rank, world, m_local, k, n, dtype, layout, tol, gen)
                _check_rs(flux, group, rank, world, m_local, k, n, dtype, layout, tol, gen,
                          with_bias=(m_local % 2 == 0))
                n_checks += 2
    _stage(rank, t0, "bound launches: operands at distinct addresses")
    for provider in BOUND_LAUNCH_PROVIDERS:
        flux_bound = FluxBackend(config_provider=provider)
        n_checks += _check_bound_launches(flux_bound, group, rank, world, gen)
    _stage(rank, t0, "60 calls with changing shapes")
    # many back-to-back calls with changing shapes: epochs, parity, workspace growth
    for i in range(60):
        m_local, k, n = SHAPES[i % len(SHAPES)]
        _check_ag(flux, group, rank, world, m_local, k, n, torch.bfloat16, "nk", 2e-2, gen)
        _check_rs(flux, group, rank, world, m_local, k, n, torch.bfloat16, "nk", 2e-2, gen, False)
        n_checks += 2
    _stage(rank, t0, "back to back: alternating layouts")
    for provider in ALTERNATING_PROVIDERS:
        flux_alt = FluxBackend(config_provider=provider)
        n_checks += _check_back_to_back(flux_alt, group, rank, world, gen)
        flux_alt.check_errors()
    _stage(rank, t0, "gather beside GEMM+RS, column dgrad modes")
    n_checks += _check_gather_beside_rs(flux, group, rank, world, gen)
    # column_regather="nccl": NCCL's asynchronous all-gather beside the fused GEMM+RS grid
    n_checks += _check_gather_beside_rs(FluxBackend(column_regather="nccl"), group, rank, world,
                                        gen)
    for column_dgrad in ("copy_engine", "fused", "nccl"):
        n_checks += _check_rs_start_every_shape(FluxBackend(column_dgrad=column_dgrad), group,
                                                rank, world, gen)
    flux_ce = _default_with(rs_copy_engine=True)
    n_checks += _check_gather_beside_rs(flux_ce, group, rank, world, gen)
    flux_ce.check_errors()
    _stage(rank, t0, "AllGather in small chunks")
    # the AllGather in 64-row chunks (many signals per segment) over every shape and layout
    n_checks += _check_ag_every_shape(_default_with(chunk_rows=64), group, rank, world, gen)
    # GEMM+RS schedule knobs over every shape: vector-store pushes, unflattened loops, the
    # reduction spread over the grid, every rank's rows in one tile space (rows tiles
    # spanning owners where m_local is not a multiple of block_m)
    merged_rs = dict(rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True)
    rs_variants = [merged_rs, dict(merged_rs, block_m=64, block_n=128, block_k=128,
                                   num_stages=4, num_warps=4, epilogue_split=1),
                   dict(rs_tma_push=False), dict(rs_tma_push=False, flatten=False),
                   dict(flatten=False, flatten_consume=False, epilogue_split=1),
                   dict(rs_spread_reduce=True),
                   dict(rs_copy_engine=True), dict(rs_copy_engine=True, rs_tma_push=False),
                   dict(rs_copy_engine=True, rs_spread_reduce=True),
                   dict(stream_k=1), dict(stream_k=1, rs_copy_engine=True)]
    _stage(rank, t0, "GEMM+RS schedule knobs")
    for variant in rs_variants:
        flux_rs = _default_with(**variant)
        for (m_local, k, n) in SHAPES:
            _check_rs(flux_rs, group, rank, world, m_local, k, n, torch.bfloat16, "nk", 2e-2, gen,
                      with_bias=(m_local % 2 == 0))
            n_checks += 1
        flux_rs.check_errors()
    # GEMM+RS's stream-K tail with real peers, SM and copy-engine pushes, on a shape whose
    # tail it splits: 8 x 9 own tiles of 128x256 per rank, 144 in all, 12 past 132 SMs
    for variant in (dict(stream_k=1), dict(stream_k=1, rs_copy_engine=True)):
        flux_rs = _default_with(**variant)
        for with_bias in (False, True):
            _check_rs(flux_rs, group, rank, world, 1024, 4096, 2304, torch.bfloat16, "nk", 2e-2,
                      gen, with_bias=with_bias)
            n_checks += 1
        flux_rs.check_errors()
    # the warp-specialized Gluon GEMM+RS (kernels/gemm_rs_ws.py), SM and copy-engine
    # pushes, both layouts and dtypes, with and without a bias; shapes whose rows per rank
    # are not a multiple of block_m (or too short a K) run the Triton kernel instead, except
    # with merged rows (every rank's rows in one tile space: tiles span owners there)
    _stage(rank, t0, "Gluon GEMM+RS")
    ws = dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4,
              epilogue_split=1, rs_warp_specialized=True)
    coop = dict(ws, block_n=256, num_stages=3, num_warps=8)  # the cooperative form
    for variant in (ws, dict(ws, rs_copy_engine=True), dict(ws, block_m=64, num_stages=5),
                    coop, dict(coop, rs_copy_engine=True), dict(ws, **merged_rs),
                    dict(coop, **merged_rs)):
        flux_ws = _default_with(**variant)
        for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
            for layout in ("nk", "kn"):
                for (m_local, k, n) in SHAPES:
                    _check_rs(flux_ws, group, rank, world, m_local, k, n, dtype, layout, tol,
                              gen, with_bias=(m_local % 2 == 0))
                    n_checks += 1
        flux_ws.check_errors()
    # the warp-specialized Gluon AG+GEMM (kernels/ag_gemm_ws.py), with the default and with
    # small chunks, over every shape and layout (shapes whose rows per rank are not a
    # multiple of block_m run the Triton kernel instead)
    _stage(rank, t0, "Gluon AG+GEMM")
    ag_ws = dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4,
                 epilogue_split=1, ag_warp_specialized=True)
    ag_coop = dict(ag_ws, block_n=256, num_stages=3, num_warps=8)  # the cooperative form
    for variant in (ag_ws, dict(ag_ws, chunk_rows=64),
                    dict(ag_ws, block_m=64, num_stages=4, chunk_rows=128),
                    ag_coop, dict(ag_coop, chunk_rows=64)):
        flux_ag_ws = _default_with(**variant)
        n_checks += _check_ag_every_shape(flux_ag_ws, group, rank, world, gen)
        flux_ag_ws.check_errors()
    # AG+GEMM's stream-K tail (default tiles, and 128x256 with warp specialization) over
    # every shape and layout, and bitwise repeatable on a shape whose tail it splits
    _stage(rank, t0, "AG+GEMM stream-K")
    sk_variants = [dict(stream_k=1),
                   dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8,
                        epilogue_split=1, warp_specialize=True, stream_k=1)]
    for variant in sk_variants:
        flux_sk = _default_with(**variant)
        n_checks += _check_ag_every_shape(flux_sk, group, rank, world, gen)
        # 8 x 9 tiles of 128x256 per rank: the tail (world * 72 % SMs) is split on H200
        x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
        b = torch.randn(4096, 2304, device="cuda", dtype=torch.bfloat16, generator=gen)
        first = flux_sk.all_gather_matmul(x, b, group)[0].clone()
        for _ in range(3):
            assert torch.equal(first, flux_sk.all_gather_matmul(x, b, group)[0]), \
                f"AG+GEMM with {variant} not deterministic"
        flux_sk.check_errors()
    # AG+GEMM with the local rows merged with the first peer's (the shard copied into
    # the workspace before the kernel), leads of 0 (the gathered rows as one operand, tiles
    # spanning segments: small m's default) and 1 waves, small chunks, and the
    # 128x128 warp-specialized tile of the llama3-8b TP 2 table entries
    _stage(rank, t0, "AG+GEMM merged local rows")
    merge_variants = [dict(ag_merge_local=True),
                      dict(ag_merge_local=True, ag_merge_lead=0, chunk_rows=64),
                      dict(ag_merge_local=True, chunk_rows=64),
                      dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4,
                           epilogue_split=1, warp_specialize=True, ag_merge_local=True)]
    for variant in merge_variants:
        n_checks += _check_ag_every_shape(_default_with(**variant), group, rank, world, gen)
    _stage(rank, t0, "AG+GEMM determinism")
    # bitwise determinism of AG+GEMM
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16, generator=gen)
    first = flux.all_gather_matmul(x, b, group)[0].clone()
    for _ in range(5):
        assert torch.equal(first, flux.all_gather_matmul(x, b, group)[0]), "AG+GEMM not deterministic"
    torch.cuda.synchronize()
    flux.check_errors()
    if os.environ.get("MEGATRON_FLUX_DIRECT_LAUNCH", "1") == "1":  # the direct path really ran
        from megatron_flux.kernels import ag_gemm, ag_gemm_ws, gemm_rs, gemm_rs_ws, ready_barrier

        from megatron_flux.kernels.launch import _triton_expander

        raw_known = _triton_expander() is not None  # a Triton whose C launcher RawLaunch knows
        for mod in (ag_gemm, gemm_rs, ready_barrier):
            assert mod._LAUNCH.direct_calls > 0, f"{mod.__name__}: no direct launch happened"
            if raw_known:
                assert mod._LAUNCH.raw_calls > 0, f"{mod.__name__}: no raw launch happened"
        for mod in (ag_gemm_ws, gemm_rs_ws):  # the warp-specialized kernels, where they ran
            if mod._LAUNCH is not None and mod._LAUNCH._compiled:
                assert mod._LAUNCH.direct_calls > 0, f"{mod.__name__}: no direct launch happened"
    torch.distributed.barrier()
    return n_checks


@_NEEDS_2_GPUS
@pytest.mark.parametrize("max_connections", ["1", "default", "1-triton-launch"])
def test_fused_ops_match_nccl(max_connections):
    """Every check, under Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 and the driver default, and
    once more with every kernel launched through Triton's own launcher (the direct launch of
    megatron_flux.kernels.launch off)."""
    world = torch.cuda.device_count()
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "MEGATRON_FLUX_MAX_SPINS": str(1 << 24)}
    if max_connections.endswith("-triton-launch"):
        env["MEGATRON_FLUX_DIRECT_LAUNCH"] = "0"
        max_connections = max_connections[: -len("-triton-launch")]
    if max_connections != "default":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = max_connections
    else:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = ""  # unset: several hardware queues
        if world > 2:  # a group fed through several queues runs NCCL (docs/design.md)
            assert run_nccl_world(_several_queues_worker, world, env, env=env, timeout=120)
            return
        # at TP 2 no wait cycle can close (the only peer's signal needs nothing from this
        # rank): the fused kernels are checked under several queues too
        env["MEGATRON_FLUX_ALLOW_SEVERAL_QUEUES"] = "1"
    n_checks = run_nccl_world(_worker, world, env, env=env, timeout=600)
    assert all(n > 100 for n in n_checks)


@nccl_worker
def _split_tail_worker(rank, world, port, env):
    """The warp-specialized GEMM+RS's split tail with real peers (SM and copy-engine pushes,
    with and without a bias) against NCCL + fp32 math; the launch's plan does split."""
    init_rank(rank, world, port, env)
    from megatron_flux.kernels.split_tail import split_tail_plan

    group = torch.distributed.group.WORLD
    gen = torch.Generator(device=torch.device("cuda", rank)).manual_seed(17)
    sms = torch.cuda.get_device_properties(rank).multi_processor_count
    # 4 x 20 own tiles of 128x128 per rank: at TP 2 a tail of 28 of 160, at TP 4 of 56 of 320
    m_local, k, n = 512, 4096, 2560
    ws = dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4,
              epilogue_split=1, rs_warp_specialized=True, stream_k=1)
    checks = 0
    for variant in (ws, dict(ws, rs_copy_engine=True)):
        flux = _default_with(**variant)
        cfg = _default_config_with("rs", world * m_local, n, k, **variant)
        tiles = world * (m_local // 128) * (n // 128)
        assert split_tail_plan(world, m_local, n, k, cfg, min(sms, tiles))[1] > 1
        for with_bias in (False, True):
            _check_rs(flux, group, rank, world, m_local, k, n, torch.bfloat16, "nk", 2e-2, gen,
                      with_bias=with_bias)
            checks += 1
        flux.check_errors()
    return checks


@_NEEDS_2_GPUS
def test_gemm_rs_split_tail_with_real_peers():
    world = torch.cuda.device_count()
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "MEGATRON_FLUX_MAX_SPINS": str(1 << 24)}
    assert all(n == 4 for n in run_nccl_world(_split_tail_worker, world, env, env=env,
                                              timeout=300))


@nccl_worker
def _several_queues_worker(rank, world, port, env):
    """Several hardware queues at TP >= 3: every rank's fused backend refuses the group with the
    reason naming the variable, and a fused call raises it instead of running."""
    init_rank(rank, world, port, env)
    from megatron_flux.backends.flux import FluxBackend
    from megatron_flux.comm.queues import SEVERAL, hardware_queues

    dev = torch.device("cuda", rank)
    assert hardware_queues(dev) == SEVERAL
    flux = FluxBackend()
    group = torch.distributed.group.WORLD
    x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    reason = flux.unsupported_reason(x, w.t(), group)
    assert reason is not None and "CUDA_DEVICE_MAX_CONNECTIONS=1 is not in effect" in reason
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=1 is not in effect"):
        flux.all_gather_matmul(x, w.t(), group)
    return True



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wait_times_out_loudly():
    """A signal that never arrives ends the wait and raises, naming the op and rank."""
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout
    from megatron_flux.kernels.ag_gemm import launch_ag_gemm
    from megatron_flux.kernels.config import GemmConfig

    dev = torch.device("cuda", 0)
    x = torch.randn(128, 64, device=dev, dtype=torch.bfloat16)
    ag = torch.randn(256, 64, device=dev, dtype=torch.bfloat16)
    b = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty(256, 128, device=dev, dtype=torch.bfloat16)
    flags = torch.zeros(2, dtype=torch.int32, device=dev)  # never signalled
    word = DeviceErrorWord(dev, interval=1)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=2, num_warps=4, chunk_rows=128)
    launch_ag_gemm(x, ag, b, out, flags, word.device_word, rank=0, world=2, epoch=1, cfg=cfg,
                   num_sms=4, max_spins=1000)
    word.after_launch()
    with pytest.raises(FusedOpTimeout, match="AG\\+GEMM: rank 0 timed out"):
        word.check(sync=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rs_wait_times_out_loudly():
    """GEMM+RS whose peer never pushes: the owner's one wait per peer gives up and raises."""
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout

    word = DeviceErrorWord(torch.device("cuda", 0), interval=1)
    launch_gemm_rs_without_its_peer(word.device_word)
    word.after_launch()
    with pytest.raises(FusedOpTimeout, match="GEMM\\+RS: rank 0 timed out"):
        word.check(sync=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_wait_times_out_loudly():
    """The copy-engine all-gather's wait for a peer whose rows never come gives up and raises,
    naming the op, this rank and the peer."""
    from megatron_flux.comm.errors import DeviceErrorWord, FusedOpTimeout
    from megatron_flux.kernels.ready_barrier import launch_ready_barrier
    from megatron_flux.kernels.signals import OP_GATHER

    dev = torch.device("cuda", 0)
    flags = torch.zeros(2, dtype=torch.int32, device=dev)  # never signalled
    ptrs = torch.tensor([flags.data_ptr()] * 2, dtype=torch.int64, device=dev)
    word = DeviceErrorWord(dev, interval=1)
    launch_ready_barrier(ptrs, word.device_word, rank=0, world=2, base=0, epoch=1, max_spins=1000,
                         signal=False, wait=True, op_code=OP_GATHER)
    word.after_launch()
    with pytest.raises(FusedOpTimeout, match="all-gather \\(copy engine\\): rank 0 timed out waiting for rank 1"):
        word.check(sync=True)


@nccl_worker
def _late_growth_worker(rank, world, port):
    from megatron_flux.comm import workspace

    init_rank(rank, world, port)
    workspace.BARRIER_TIMEOUT_MS = 20_000  # a barrier that never ends traps here, not in 10 min
    group = torch.distributed.group.WORLD
    ws = workspace.SymmetricWorkspace("ag", group, torch.device("cuda", rank), torch.bfloat16)
    seconds = []
    for late in range(world):  # every rank is the busy one once; each round grows
        torch.distributed.barrier()
        torch.cuda.synchronize()
        if rank == late:
            torch.cuda._sleep(500_000_000)  # about 0.25 s of GPU time queued before the growth
        t0 = time.perf_counter()
        ws.reserve((late + 1) << 20, 8 * (late + 1))
        torch.cuda.synchronize()  # raises if this rank's growth barrier trapped
        seconds.append(time.perf_counter() - t0)
        assert int(ws.flags(rank, 0).abs().sum()) == 0 and int(ws.flags(rank, 1).abs().sum()) == 0
    assert ws.generation == world
    return seconds


@_NEEDS_2_GPUS
def test_growth_with_a_busy_rank_completes():
    """A rank whose GPU is still busy when the workspace grows: torch's memset of its new block
    runs late, and without the drain before the rendezvous it erased the peers' barrier
    signals, so that rank's barrier never ended (``benchmarks/experiments/growth_race.py``)."""
    world = min(torch.cuda.device_count(), 4)
    rounds = run_nccl_world(_late_growth_worker, world, timeout=240)
    assert all(len(r) == world for r in rounds)
