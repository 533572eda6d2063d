"""The fused kernels' compiled code paths on one GPU, communication wired away (the benchmarks'
one-GPU wiring: GEMM+RS as rank 0 with its peers' partials in local slots, every peer signal
pre-set). The 2-GPU tests (``test_flux_gpu.py``) cover the kernels with real peers; these run
where only one GPU is lent, and cover what the CPU interpreter cannot see: the compiled
kernels' flattened and warp-specialized loops, TMA clipping of ragged tiles, and bitwise
repeatability."""

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: the warp-specialized kernels' two forms (``gluon_ws``): two 4-warp MMA partitions taking
#: alternate tiles, or one 8-warp partition taking every tile
WS_FORMS = {"pingpong": dict(block_m=128, block_n=128, block_k=64, num_warps=4),
            "coop": dict(block_m=128, block_n=256, block_k=64, num_warps=8)}

# (world, m_local, n, k): several own tiles per program, ragged m_local, a partial N tile
RS_SHAPES = [(2, 1024, 1024, 512), (2, 300, 1000, 512), (4, 256, 768, 1024)]
RS_CONFIGS = [
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=2,
         flatten_consume=True),
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=2,
         flatten_consume=False),
    dict(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4, epilogue_split=1,
         flatten_consume=True),
    # one epilogue store and warp specialization (a shipped TP 2 table config)
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=1,
         warp_specialize=True, flatten_consume=True),
    # the warp-specialized Gluon kernel (gemm_rs_ws); the ragged shape runs the Triton kernel
    # instead, with a warning
    dict(WS_FORMS["pingpong"], num_stages=5, rs_warp_specialized=True),
    dict(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4, rs_warp_specialized=True),
    # its cooperative form: one 8-warp MMA partition, 128x256 tiles
    dict(WS_FORMS["coop"], num_stages=3, rs_warp_specialized=True),
    # every rank's rows in one tile space (small m's default): on the ragged shape row tiles
    # span segments, and each owner's rows go to its own slot
    dict(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4, epilogue_split=1,
         rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True),
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=2,
         rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True),
    # the narrow and the tall merged tiles of the small-m default (config.merged_rs_tile)
    dict(block_m=64, block_n=32, block_k=256, num_stages=4, num_warps=4, epilogue_split=1,
         rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True),
    dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8, epilogue_split=1,
         rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True),
    # merged rows on the warp-specialized Gluon kernel: TMA pushes per owner (a tile spanning
    # two owners starts at a negative row of the second's slot), ping-pong and cooperative
    dict(block_m=64, block_n=128, block_k=64, num_stages=8, num_warps=4, epilogue_split=1,
         rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True, rs_warp_specialized=True),
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=1,
         rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True, rs_warp_specialized=True),
    # ... with the owners' row tiles in turn (rs_interleave_owners; on the ragged shape, whose row
    # tiles span owners, the order stays as it is)
    dict(WS_FORMS["pingpong"], num_stages=5, epilogue_split=1, rs_spread_reduce=True,
         rs_tma_push=False, rs_merge_rows=True, rs_warp_specialized=True,
         rs_interleave_owners=True),
    # the owners' row groups in turn, counted per row group (rs_row_turns): groups of one and
    # of three row tiles (a shorter last group); the ragged shape runs the Triton kernel
    dict(WS_FORMS["pingpong"], num_stages=5, epilogue_split=1, group_m=1,
         rs_warp_specialized=True, rs_row_turns=True),
    dict(WS_FORMS["coop"], num_stages=3, epilogue_split=1, group_m=3, rs_warp_specialized=True,
         rs_row_turns=True),
]


@pytest.mark.parametrize("shape", RS_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fields", RS_CONFIGS, ids=range(len(RS_CONFIGS)))
def test_gemm_rs_reduction_paths(shape, fields):
    """Own rows = own partial + the peers' slots, against fp32 math; a repeated launch is
    bitwise identical."""
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import rs_on_one_gpu
    from megatron_flux.kernels.config import GemmConfig

    world, m_local, n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    a = torch.randn(world * m_local, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    launch, out, data = rs_on_one_gpu(a, w, world, err, num_sms=24)
    data.copy_(torch.randn(data.shape, device="cuda", generator=gen).to(data.dtype) * 8)
    cfg = GemmConfig(**fields)
    first = _poisoned_run(launch, out, cfg)
    again = _poisoned_run(launch, out, cfg)
    assert int(err[0]) == 0
    ref = (a.float() @ w.t().float())[:m_local] + data[1:].float().sum(0)
    rel = float((first.float() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel
    assert torch.equal(again, first), "repeated GEMM+RS launches differ"


def _poisoned_run(launch, out, cfg):
    """``launch(cfg)`` into ``out`` poisoned with NaN first (an unwritten tile shows); a copy
    of what it wrote, once the GPU is done."""
    out.fill_(float("nan"))
    launch(cfg)
    torch.cuda.synchronize()
    return out.clone()


#: GEMM+RS's stream-K tail: the table's 128x256 tiles (two epilogue halves, or one with
#: Triton's warp specialization) and a 128x128 tile
RS_SK_CONFIGS = [
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=2),
    dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=1,
         warp_specialize=True),
    dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4, epilogue_split=1),
]


@pytest.mark.parametrize("shape", [(2, 1024, 1280, 1024), (2, 700, 1000, 640), (4, 256, 2560, 512)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fields", RS_SK_CONFIGS, ids=range(len(RS_SK_CONFIGS)))
def test_gemm_rs_stream_k_tail(shape, fields):
    """``stream_k=1`` on GEMM+RS: on a grid whose partial last wave it splits along K (a tile
    over several programs), own rows = own partial + the peers' slots against fp32 math, the
    same up to rounding as the data-parallel schedule, bitwise repeatable, every tile counter
    back at zero."""
    import dataclasses

    from megatron_flux.tools.diagnostics.kernel_vs_cublas import rs_on_one_gpu
    from megatron_flux.kernels import stream_k as SK
    from megatron_flux.kernels.config import GemmConfig, tiles_per_segment

    world, m_local, n, k = shape
    cfg = GemmConfig(**fields, stream_k=1)
    tps = tiles_per_segment(m_local, n, cfg)
    grids = [g for g in range(8, 64) if SK.stream_k_plan(world * tps, g, 1, tps)[1] > 0
             and (world * tps % g) * (k // cfg.block_k) > g]  # some tile spans programs
    assert grids, (shape, fields)
    sms = grids[len(grids) // 2]
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    a = torch.randn(world * m_local, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    launch, out, data = rs_on_one_gpu(a, w, world, err, num_sms=sms)
    data.copy_(torch.randn(data.shape, device="cuda", generator=gen).to(data.dtype) * 8)
    dp = _poisoned_run(launch, out, dataclasses.replace(cfg, stream_k=0))
    first = _poisoned_run(launch, out, cfg)
    again = _poisoned_run(launch, out, cfg)
    assert err.tolist() == [0, 0, 0, 0], err.tolist()
    ref = (a.float() @ w.t().float())[:m_local] + data[1:].float().sum(0)
    for got, label in ((first, "stream-K"), (dp, "data-parallel")):
        rel = float((got.float() - ref).norm() / ref.norm())
        assert rel < 1e-2, (label, sms, rel)
    assert torch.equal(again, first), f"repeated stream-K GEMM+RS launches differ (grid {sms})"
    assert float((first.float() - dp.float()).abs().max()) <= 0.05 * float(ref.abs().max())
    assert all(int(s.counters.abs().sum()) == 0 for s in SK._SCRATCH.values())
    assert SK.stream_k_fits("GEMM+RS", cfg), "ran without the split (shared memory)"


# (world, m_local, n, k): a few row tiles per segment (llama3-8b m = 1024 at TP 2, scaled
# down), one ragged row tile per segment (small m), and TP 4
AG_SHAPES = [(2, 512, 2048, 512), (2, 40, 1000, 512), (4, 256, 768, 1024)]
AG_MERGED = [
    dict(ag_merge_local=True),
    dict(ag_merge_local=True, ag_merge_lead=0),
    # the llama3-8b TP 2 table tile: 128x128, warp-specialized
    dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4, epilogue_split=1,
         warp_specialize=True, ag_merge_local=True),
    # the wide gathered-rows tile of the small-m default (config.gathered_ag_tile)
    dict(block_n=256, num_stages=4, ag_merge_local=True, ag_merge_lead=0),
]


@pytest.mark.parametrize("shape", AG_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("fields", AG_MERGED, ids=range(len(AG_MERGED)))
def test_ag_gemm_merged_local_rows(shape, fields):
    """AG+GEMM with the local rows merged with the first peer's (``ag_merge_local``),
    compiled: against fp32 math, every element written, bitwise equal to the per-segment
    schedule with the same tile (same K order per tile) and to a repeated launch."""
    import dataclasses

    from megatron_flux.tools.diagnostics.kernel_vs_cublas import ag_on_one_gpu
    from megatron_flux.kernels.config import GemmConfig

    world, m_local, n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    a = torch.randn(world * m_local, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    cfg = GemmConfig(**{"block_m": 64, "block_n": 128, "block_k": 64, "num_stages": 3,
                        "num_warps": 4, "epilogue_split": 1, **fields})
    plain = dataclasses.replace(cfg, ag_merge_local=False, stream_k=0)
    launch_plain, out_plain = ag_on_one_gpu(a, w, world, plain, err, num_sms=24)
    launch_plain()
    torch.cuda.synchronize()
    launch, out = ag_on_one_gpu(a, w, world, cfg, err, num_sms=24)
    launch()
    torch.cuda.synchronize()
    first = out.clone()
    out.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    assert int(err[0]) == 0
    assert not torch.isnan(first).any(), "unwritten output"
    ref = a.float() @ w.t().float()
    rel = float((first.float() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel
    assert torch.equal(first, out_plain), "merged schedule differs from the per-segment one"
    assert torch.equal(out, first), "repeated AG+GEMM launches differ"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m_local,n", [(4096, 4096), (300, 1000)], ids=["full", "ragged"])
def test_rs_reduce_sums_in_rank_order(world, with_bias, m_local, n):
    """The copy-engine ReduceScatter's reduction (``column_dgrad="copy_engine"``), compiled:
    bitwise equal to the fp32 sum of the partials in rank order (then the bias), rounded once,
    for every rank; the slot of the rank itself is never read (poisoned)."""
    from megatron_flux.kernels.rs_reduce import launch_rs_reduce

    gen = torch.Generator(device="cuda").manual_seed(world * 7 + m_local + with_bias)
    parts = torch.randn(world, m_local, n, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if with_bias else None
    for rank in range(world):
        slots = parts.clone()
        slots[rank].fill_(float("nan"))  # its own rows come from ``own``, never from its slot
        own = parts[rank].clone()
        out = torch.full((m_local, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch_rs_reduce(own, slots, out, bias, rank=rank, world=world)
        torch.cuda.synchronize()
        ref = parts[0].float()
        for src in range(1, world):
            ref = ref + parts[src].float()
        if bias is not None:
            ref = ref + bias.float()
        assert torch.equal(out, ref.to(torch.bfloat16)), f"rank {rank}"


def _rank0_rs_wiring(world, m_local, n, k, dtype, seed):
    """GEMM+RS as rank 0 of ``world`` on one GPU: ``(a, w, bias, out, data, pushed, flags,
    data_ptrs, flag_ptrs, err)``. ``data`` is rank 0's slot region, the peers' slots random;
    rank 0's pushes to owner ``s`` land in ``pushed[s]`` (``data_ptrs[s]`` points there, so
    rank 0's slot 0 of it); every owner's signal words are the one ``flags`` array, the peers'
    words already past any epoch; ``out`` is NaN."""
    from megatron_flux.kernels.config import rs_signal_count

    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(world * m_local, k, device="cuda", generator=gen).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    out = torch.full((m_local, n), float("nan"), device="cuda", dtype=dtype)
    data = (torch.randn(world, m_local, n, device="cuda", generator=gen) * 8).to(dtype)
    pushed = torch.zeros(world, m_local, n, device="cuda", dtype=dtype)  # [owner]: rank 0's push
    flags = torch.zeros(rs_signal_count(world), dtype=torch.int32, device="cuda")
    flags[1:world] = 1 << 30  # the peers have delivered
    data_ptrs = torch.tensor([data.data_ptr()] + [pushed[s].data_ptr() for s in range(1, world)],
                             dtype=torch.int64, device="cuda")
    flag_ptrs = torch.tensor([flags.data_ptr()] * world, dtype=torch.int64, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    return a, w, bias, out, data, pushed, flags, data_ptrs, flag_ptrs, err


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("b_kn", [False, True], ids=["b_nk", "b_kn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("copy_engine", [False, True], ids=["sm_push", "ce_push"])
@pytest.mark.parametrize("form", list(WS_FORMS))
def test_gemm_rs_ws_bias_layouts_and_signals(world, b_kn, dtype, copy_engine, form):
    """The warp-specialized GEMM+RS as rank 0 of ``world`` on one GPU: own rows = own partial
    + the peers' slots (+ bias) against fp32 math, for both B layouts and dtypes; its producer
    tiles land in the pushed-to slots (``data_ptrs``); the grid's last partition raises every
    owner's signal (or, with the copy engine's staging, only the "produced" word) with this
    call's epoch and leaves the arrival counter at zero; repeated launches are bitwise
    identical and it took the Gluon kernel (no fallback warning)."""
    import warnings

    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs

    m_local, n, k = 512, 384, 640
    a, w, bias, out, data, pushed, flags, data_ptrs, flag_ptrs, err = _rank0_rs_wiring(
        world, m_local, n, k, dtype, seed=world + 2 * b_kn)
    b = w.t().contiguous() if b_kn else w.t()  # [K, N] row-major, or a transposed [N, K]
    cfg = GemmConfig(**WS_FORMS[form], num_stages=3, rs_warp_specialized=True,
                     rs_copy_engine=copy_engine)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the Triton kernel would warn
        for epoch in (1, 2):
            out.fill_(float("nan"))
            # 4 programs: every MMA partition gets several own tiles, so the later ones take
            # the partial loaded before their MMAs
            launch_gemm_rs(a, b, out, data, data_ptrs, flag_ptrs, bias, err, rank=0, world=world,
                           epoch=epoch, cfg=cfg, num_sms=4, max_spins=1 << 20)
            torch.cuda.synchronize()
            results.append(out.clone())
            assert int(err[0]) == 0
            assert int(flags[world]) == 0  # the arrival counter is back at zero
            if copy_engine:
                assert int(flags[world + 1]) == epoch and int(flags[0]) == 0
            else:  # every owner's word [rank 0] (all owners share this one flags array here)
                assert int(flags[0]) == epoch and int(flags[world + 1]) == 0
    full = a.float() @ w.t().float()
    ref = full[:m_local] + data[1:].float().sum(0) + bias.float()
    rel = float((results[0].float() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel
    assert torch.equal(results[0], results[1]), "repeated GEMM+RS launches differ"
    # rank 0's producer tiles: segment s's partial went to owner s's slot 0
    for s in range(1, world):
        pushed_ref = full[s * m_local:(s + 1) * m_local]
        rel_p = float((pushed[s].float() - pushed_ref).norm() / pushed_ref.norm())
        assert rel_p < 1e-2, (s, rel_p)


# (world, m_local, n, k, num_sms): a partial last wave of own tiles, split along K into 3, 5, 5,
# 8 (ping-pong) and 3, 3, 7 (cooperative) parts, one per program, so the parts sum chunks of 64,
# 32 and 16 rows (cooperative: 64 and 32; split_tail.tail_sum_rows); then tails over half the
# grid, planned with two units a program at most (MAX_TAIL_UNITS = 2: the kernel runs several,
# the shipped plan gives one), in 3 parts: 8 tiles over 12 programs, 12 over 22 (one row of
# tiles), cooperative 6 over 10
_SPLIT_TAIL_CASES = {
    "pingpong": [(2, 512, 384, 640, 11), (4, 256, 1152, 2048, 33), (2, 384, 1024, 1024, 44),
                 (2, 256, 640, 2048, 18), (2, 256, 640, 2048, 12), (2, 128, 2176, 2048, 22)],
    "coop": [(2, 512, 384, 640, 7), (4, 256, 1280, 2048, 12), (2, 256, 512, 2048, 7),
             (2, 256, 1024, 2048, 10)],
}


@pytest.mark.parametrize("part_first", [True, False], ids=["part_first", "part_last"])
@pytest.mark.parametrize("copy_engine", [False, True], ids=["sm_push", "ce_push"])
@pytest.mark.parametrize("form, case", [(f, c) for f, cases in _SPLIT_TAIL_CASES.items()
                                        for c in cases],
                         ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v)))
def test_gemm_rs_ws_split_tail(form, case, copy_engine, part_first, monkeypatch):
    """The warp-specialized GEMM+RS with ``stream_k=1``: the partial last wave's own tiles split
    along K into equal parts, one per program (two, for a tail over half the grid, with the
    plan's ``MAX_TAIL_UNITS`` raised), each its program's first or last work items
    (``split_tail_first`` forced either way), once all have arrived each part summing a share
    of the tile's rows in part order, then the peers' slots. Rank 0 of ``world`` on one GPU
    against fp32 math and against the same config unsplit, producer tiles pushed from the SMs
    or staged for the copy engine; the split happened (``split_tail_plan``); repeated launches
    bitwise identical; every tile counter back at zero; the producer tiles pushed."""
    import warnings

    from megatron_flux.kernels import stream_k
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs
    from megatron_flux.kernels import split_tail
    from megatron_flux.kernels.split_tail import split_tail_plan

    monkeypatch.setattr(split_tail, "split_tail_first", lambda *args: part_first)
    monkeypatch.setattr(split_tail, "MAX_TAIL_UNITS", 2)  # plans of shorter tails: the same
    world, m_local, n, k, num_sms = case
    dtype = torch.bfloat16
    a, w, bias, out, data, pushed, flags, data_ptrs, flag_ptrs, err = _rank0_rs_wiring(
        world, m_local, n, k, dtype, seed=11)
    b = w.t()
    cfg = GemmConfig(**WS_FORMS[form], num_stages=3, epilogue_split=1, rs_warp_specialized=True,
                     stream_k=1, rs_copy_engine=copy_engine)
    tiles = world * -(-m_local // cfg.block_m) * -(-n // cfg.block_n)
    tail, parts = split_tail_plan(world, m_local, n, k, cfg, min(num_sms, tiles))
    assert tail > 0 and parts >= 2, (tail, parts)
    assert (tail * parts <= num_sms) == (2 * tail <= num_sms), (tail, parts)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the Triton kernel would warn
        for epoch, c in ((1, cfg), (2, cfg), (3, dataclasses.replace(cfg, stream_k=0))):
            out.fill_(float("nan"))
            pushed.fill_(float("nan"))
            launch_gemm_rs(a, b, out, data, data_ptrs, flag_ptrs, bias, err, rank=0, world=world,
                           epoch=epoch, cfg=c, num_sms=num_sms, max_spins=1 << 20)
            torch.cuda.synchronize()
            results.append(out.clone())
            assert int(err[0]) == 0 and int(flags[world]) == 0
    scratch = stream_k.current_scratch(a.device)
    assert scratch is not None and int(scratch.counters[:tail].abs().sum()) == 0
    full = a.float() @ w.t().float()
    ref = full[:m_local] + data[1:].float().sum(0) + bias.float()
    rel = float((results[0].float() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel
    assert torch.equal(results[0], results[1]), "repeated split-tail launches differ"
    unsplit = float((results[0].float() - results[2].float()).norm() / results[2].float().norm())
    assert unsplit < 1e-2, unsplit
    for s_ in range(1, world):
        pushed_ref = full[s_ * m_local:(s_ + 1) * m_local]
        rel_p = float((pushed[s_].float() - pushed_ref).norm() / pushed_ref.norm())
        assert rel_p < 1e-2, (s_, rel_p)


@pytest.mark.parametrize("form", list(WS_FORMS))
def test_gemm_rs_ws_split_tail_wait_times_out_loudly(form):
    """A K-part of a split tail tile that never counts in (its counter set one short): the
    parts' bounded wait gives up and records (op split tail, rank, tail tile, count seen)
    instead of hanging; the other tail tiles' parts are not held up."""
    from megatron_flux.kernels import stream_k
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs
    from megatron_flux.kernels.split_tail import split_tail_plan
    from megatron_flux.kernels.signals import OP_SPLIT_TAIL

    world, m_local, n, k, num_sms = _SPLIT_TAIL_CASES[form][0]
    a, w, bias, out, data, pushed, flags, data_ptrs, flag_ptrs, err = _rank0_rs_wiring(
        world, m_local, n, k, torch.bfloat16, seed=13)
    cfg = GemmConfig(**WS_FORMS[form], num_stages=3, epilogue_split=1, rs_warp_specialized=True,
                     stream_k=1)
    tiles = world * -(-m_local // cfg.block_m) * -(-n // cfg.block_n)
    tail, parts = split_tail_plan(world, m_local, n, k, cfg, min(num_sms, tiles))
    assert tail >= 1 and parts >= 2

    def launch(epoch, max_spins):
        launch_gemm_rs(a, w.t(), out, data, data_ptrs, flag_ptrs, bias, err, rank=0, world=world,
                       epoch=epoch, cfg=cfg, num_sms=num_sms, max_spins=max_spins)
        torch.cuda.synchronize()

    launch(1, 1 << 20)  # allocates the scratch; a clean run
    assert err.tolist() == [0, 0, 0, 0]
    counters = stream_k.current_scratch(a.device).counters
    try:
        counters[tail - 1] = -1  # the last tail tile: one count short of its parts
        launch(2, 1 << 12)
        assert err.tolist() == [OP_SPLIT_TAIL, 0, tail - 1, parts - 1], err.tolist()
    finally:
        counters.zero_()


def test_gemm_rs_ws_builds_spill_no_registers(monkeypatch):
    """No build of the warp-specialized GEMM+RS that the tables, the tuner's seeds or the rules
    can choose spills registers, at TP 2 and TP 4 on this GPU's whole grid (``NUM_PROGRAMS`` is
    a compile-time constant, so the grid is part of the build): the ping-pong (5 stages) with
    and without bias, both B layouts, SM and copy-engine pushes, a split tail with its parts
    first and last (with either push), merged rows; the cooperative form (3 stages). Holding a split unit's tile,
    part and K range across the tile loop spilled 12 registers, and the kernel ran up to 5 %
    slower where it split (``docs/performance.md``, "No registers spilled")."""
    import dataclasses

    from megatron_flux.kernels import gemm_rs_ws, split_tail
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    forms = {"pingpong": dict(WS_FORMS["pingpong"], num_stages=5),
             "coop": dict(WS_FORMS["coop"], num_stages=3)}
    launched = []
    for world in (2, 4):
        m_local = 1024 // world
        for form, fields in forms.items():
            # 1024 rows (8 row tiles) by num_sms // 8 + 1 column tiles: a wave and a short tail
            n, k = fields["block_n"] * (num_sms // 8 + 1), 2048
            a, w, bias, out, data, pushed, flags, data_ptrs, flag_ptrs, err = _rank0_rs_wiring(
                world, m_local, n, k, torch.bfloat16, seed=17)
            base = GemmConfig(**fields, epilogue_split=1, rs_warp_specialized=True)
            split = dataclasses.replace(base, stream_k=1)
            assert split_tail.split_tail_plan(world, m_local, n, k, split, num_sms)[1] > 1
            cases = [(base, False, None, False), (base, False, bias, False),
                     (base, False, bias, True), (split, True, bias, False),
                     (split, False, bias, False)]
            if form == "pingpong":
                merged = dataclasses.replace(base, rs_merge_rows=True, rs_spread_reduce=True,
                                             rs_tma_push=False)
                ce_split = dataclasses.replace(split, rs_copy_engine=True)
                cases += [(dataclasses.replace(base, rs_copy_engine=True), False, bias, False),
                          (ce_split, True, bias, False), (ce_split, False, bias, False),
                          (split, True, None, False), (split, False, None, False),
                          (merged, False, bias, False)]
            for cfg, first, with_bias, b_kn in cases:
                monkeypatch.setattr(split_tail, "split_tail_first", lambda *args, f=first: f)
                launched.append(dict(WORLD=world, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages,
                                     HAS_BIAS=with_bias is not None, B_KN=b_kn,
                                     CE_PUSH=cfg.rs_copy_engine, SPLIT_TAIL=bool(cfg.stream_k),
                                     TAIL_FIRST=bool(cfg.stream_k) and first,
                                     MERGE_ROWS=cfg.rs_merge_rows))
                launch_gemm_rs(a, w.t().contiguous() if b_kn else w.t(), out, data, data_ptrs,
                               flag_ptrs, with_bias, err, rank=0, world=world,
                               epoch=len(launched), cfg=cfg, num_sms=num_sms, max_spins=1 << 20)
            torch.cuda.synchronize()
            assert int(err[0]) == 0, err.tolist()
    builds = [(kern, _build_constexprs(kern))
              for caches in gemm_rs_ws.gemm_rs_ws_kernel.device_caches.values()
              for kern in caches[0].values()]
    mine = [(kern, c) for kern, c in builds if c.get("NUM_PROGRAMS") == num_sms
            and {key: c.get(key) for key in launched[0]} in launched]
    assert len(mine) >= len(launched), (len(mine), len(launched))  # other dtypes may add
    spilled = [(kern.n_spills, c) for kern, c in mine if kern.n_spills]
    assert not spilled, f"{len(spilled)} of {len(mine)} builds spill registers: {spilled}"


def _build_constexprs(kern):
    """A compiled kernel's warps, stages and constexpr arguments, by name (what tells one build
    of a kernel from another in a failure message)."""
    src = getattr(kern, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    consts = getattr(src, "constants", None) or {}
    named = {names[key[0]] if names and isinstance(key, tuple) else str(key): value
             for key, value in consts.items()}
    return {"num_warps": kern.metadata.num_warps, "num_stages": kern.metadata.num_stages, **named}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", list(WS_FORMS))
def test_gemm_rs_ws_merged_rows_bias_and_signals(world, dtype, form):
    """Merged rows on the warp-specialized GEMM+RS as rank 0 of ``world``, 40 rows per rank:
    its row tiles span owners, so some owners' rows start inside a tile (the vector-store
    path). Own rows = the own partial it pushed to its own slot + the peers' slots + bias,
    against fp32 math; every peer's rows land in that owner's slot 0; the grid's last partition
    raises every owner's signal, this rank's too; repeated launches are bitwise identical and
    it took the Gluon kernel (no fallback warning)."""
    import warnings

    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs

    m_local, n, k = 40, 384, 640
    a, w, bias, out, data, pushed, flags, data_ptrs, flag_ptrs, err = _rank0_rs_wiring(
        world, m_local, n, k, dtype, seed=world + 5)
    cfg = GemmConfig(**WS_FORMS[form], num_stages=3, epilogue_split=1, rs_warp_specialized=True,
                     rs_merge_rows=True, rs_spread_reduce=True, rs_tma_push=False)
    peers = data[1:].float().sum(0)  # before the launch: slot 0 is overwritten by the push
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the Triton kernel would warn
        for epoch in (1, 2):
            out.fill_(float("nan"))
            launch_gemm_rs(a, w.t(), out, data, data_ptrs, flag_ptrs, bias, err, rank=0,
                           world=world, epoch=epoch, cfg=cfg, num_sms=4, max_spins=1 << 20)
            torch.cuda.synchronize()
            results.append(out.clone())
            assert err.tolist() == [0, 0, 0, 0], err.tolist()
            assert int(flags[world]) == 0  # the arrival counter is back at zero
            assert int(flags[0]) == epoch  # every owner's word [rank 0], this rank's included
    full = a.float() @ w.t().float()
    ref = full[:m_local] + peers + bias.float()
    rel = float((results[0].float() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel
    assert torch.equal(results[0], results[1]), "repeated GEMM+RS launches differ"
    for s in range(1, world):  # rank 0's rows of segment s went to owner s's slot 0
        pushed_ref = full[s * m_local:(s + 1) * m_local]
        rel_p = float((pushed[s].float() - pushed_ref).norm() / pushed_ref.norm())
        assert rel_p < 1e-2, (s, rel_p)


@pytest.mark.parametrize("mode", ["segments", "merged", "turns"])
@pytest.mark.parametrize("form", list(WS_FORMS))
def test_gemm_rs_ws_times_out_loudly_without_peer(form, mode):
    """A peer that never signals: the warp-specialized kernel's bounded wait (in the own
    tiles, with merged rows in the spread reduction, with the owners' row groups in turn on a
    row group's counter) gives up and records (op GEMM+RS, rank, peer, value seen) instead of
    hanging."""
    from megatron_flux.kernels.config import GemmConfig, rs_signal_count
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs
    from megatron_flux.kernels.signals import OP_GEMM_RS

    world, m_local, n, k = 2, 256, 256, 512
    a = torch.randn(world * m_local, k, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    out = torch.empty(m_local, n, device="cuda", dtype=torch.bfloat16)
    data = torch.zeros(world, m_local, n, device="cuda", dtype=torch.bfloat16)
    pushed = torch.zeros_like(data)
    flags = torch.zeros(rs_signal_count(world, mode == "turns"), dtype=torch.int32,
                        device="cuda")  # no peer signal
    data_ptrs = torch.tensor([data.data_ptr(), pushed.data_ptr()], dtype=torch.int64, device="cuda")
    flag_ptrs = torch.tensor([flags.data_ptr()] * world, dtype=torch.int64, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    more = {"segments": {}, "merged": dict(rs_merge_rows=True, rs_spread_reduce=True, rs_tma_push=False),
            "turns": dict(rs_row_turns=True)}[mode]
    cfg = GemmConfig(**WS_FORMS[form], num_stages=3, rs_warp_specialized=True, **more)
    # rank 1 of 2: its peer (rank 0) signals at flags[0]; rank 1's own grid raises flags[1]
    launch_gemm_rs(a, w.t(), out, data, data_ptrs, flag_ptrs, None, err, rank=1, world=world,
                   epoch=5, cfg=cfg, num_sms=8, max_spins=1000)
    torch.cuda.synchronize()
    assert err.tolist() == [OP_GEMM_RS, 1, 0, 0], err.tolist()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("b_kn", [False, True], ids=["b_nk", "b_kn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", list(WS_FORMS))
def test_ag_gemm_ws_reads_shard_and_workspace(world, b_kn, dtype, form):
    """The warp-specialized AG+GEMM as rank 1 of ``world``: its own rows come from the shard
    (the workspace's copy of them is NaN), the peers' from the workspace after their chunk
    signals (several chunks per segment); against fp32 math, bitwise repeatable, and it took
    the Gluon kernel (no fallback warning)."""
    import warnings

    from megatron_flux.kernels.ag_gemm import launch_ag_gemm
    from megatron_flux.kernels.config import GemmConfig

    rank, m_local, n, k, chunk = 1, 384, 640, 512, 128
    gen = torch.Generator(device="cuda").manual_seed(world + 2 * b_kn)
    xs = [torch.randn(m_local, k, device="cuda", generator=gen).to(dtype) for _ in range(world)]
    w = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    b = w.t().contiguous() if b_kn else w.t()
    ag = torch.cat(xs).clone()
    ag[rank * m_local:(rank + 1) * m_local] = float("nan")
    flags = torch.full((world * (m_local // chunk),), 3, dtype=torch.int32, device="cuda")
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    out = torch.full((world * m_local, n), float("nan"), device="cuda", dtype=dtype)
    cfg = GemmConfig(**WS_FORMS[form], num_stages=3, chunk_rows=chunk, ag_warp_specialized=True)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            out.fill_(float("nan"))
            launch_ag_gemm(xs[rank], ag, b, out, flags, err, rank=rank, world=world, epoch=3,
                           cfg=cfg, num_sms=20, max_spins=1 << 20)
            torch.cuda.synchronize()
            results.append(out.clone())
    assert err.tolist() == [0, 0, 0, 0]
    ref = torch.cat(xs).float() @ w.t().float()
    rel = float((results[0].float() - ref).norm() / ref.norm())
    assert rel < 1e-2, rel
    assert torch.equal(results[0], results[1]), "repeated AG+GEMM launches differ"


@pytest.mark.parametrize("form", list(WS_FORMS))
def test_ag_gemm_ws_times_out_loudly_on_a_missing_chunk(form):
    """One chunk of one peer never arrives: the load warp's bounded wait gives up and records
    (op AG+GEMM, rank, the chunk's signal index, the value seen) instead of hanging."""
    from megatron_flux.kernels.ag_gemm import launch_ag_gemm
    from megatron_flux.kernels.config import GemmConfig
    from megatron_flux.kernels.signals import OP_AG_GEMM

    world, rank, m_local, n, k, chunk = 2, 0, 256, 256, 512, 128
    x = torch.randn(world * m_local, k, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    out = torch.empty(world * m_local, n, device="cuda", dtype=torch.bfloat16)
    flags = torch.full((world * 2,), 9, dtype=torch.int32, device="cuda")
    flags[3] = 8  # segment 1's second chunk is a call behind
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    cfg = GemmConfig(**WS_FORMS[form], num_stages=3, chunk_rows=chunk, ag_warp_specialized=True)
    launch_ag_gemm(x[:m_local], x, w.t(), out, flags, err, rank=rank, world=world, epoch=9,
                   cfg=cfg, num_sms=8, max_spins=1000)
    torch.cuda.synchronize()
    assert err.tolist() == [OP_AG_GEMM, rank, 3, 8], err.tolist()


# Two ranks on one GPU: each rank's grid gets half the SMs and its own stream, so both run at
# once and wait on each other through real signals (GPU memory instead of a peer's; the
# release/acquire pairs are the same instructions). Every wait is bounded: a schedule that
# could not keep both grids resident would show as a timeout in the error words, not a hang.
_RS_PAIR = {
    "triton": dict(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, epilogue_split=2),
    "ws": dict(WS_FORMS["pingpong"], num_stages=5, epilogue_split=1, rs_warp_specialized=True),
    "coop": dict(WS_FORMS["coop"], num_stages=3, epilogue_split=1, rs_warp_specialized=True),
    "merged": dict(block_m=64, block_n=128, block_k=128, num_stages=4, num_warps=4,
                   epilogue_split=1, rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True),
    "wsmerged": dict(block_m=64, block_n=128, block_k=64, num_stages=8, num_warps=4,
                     epilogue_split=1, rs_spread_reduce=True, rs_tma_push=False,
                     rs_merge_rows=True, rs_warp_specialized=True),
    "coopmerged": dict(WS_FORMS["coop"], num_stages=3, epilogue_split=1, rs_spread_reduce=True,
                       rs_tma_push=False, rs_merge_rows=True, rs_warp_specialized=True),
    # merged rows with the owners' row tiles in turn (rs_interleave_owners)
    "wsinterleave": dict(WS_FORMS["pingpong"], num_stages=5, epilogue_split=1,
                         rs_spread_reduce=True, rs_tma_push=False, rs_merge_rows=True,
                         rs_warp_specialized=True, rs_interleave_owners=True),
    # the owners' row groups in turn, a counter per row group (rs_row_turns): every rank of a
    # group runs it or none (its protocol is not the grid barrier's); row groups of one row
    # tile, and of three (a shorter last group)
    "wsturns": dict(WS_FORMS["pingpong"], num_stages=5, epilogue_split=1, group_m=1,
                    rs_warp_specialized=True, rs_row_turns=True),
    "coopturns": dict(WS_FORMS["coop"], num_stages=3, epilogue_split=1, group_m=3,
                      rs_warp_specialized=True, rs_row_turns=True),
}


@pytest.mark.parametrize("configs, split", [
    (("ws", "ws"), "even"), (("triton", "triton"), "even"), (("ws", "triton"), "even"),
    (("coop", "coop"), "even"), (("coop", "ws"), "even"),
    (("ws", "ws"), "skewed"), (("coop", "coop"), "skewed"), (("triton", "triton"), "skewed"),
    (("merged", "merged"), "even"), (("merged", "triton"), "skewed"),
    (("ws", "merged"), "skewed"),
    (("wsmerged", "wsmerged"), "even"), (("wsmerged", "merged"), "skewed"),
    (("coopmerged", "wsmerged"), "skewed"), (("coopmerged", "triton"), "even"),
    (("wsinterleave", "wsinterleave"), "even"), (("wsinterleave", "ws"), "skewed"),
    (("wsturns", "wsturns"), "even"), (("wsturns", "wsturns"), "skewed"),
    (("coopturns", "coopturns"), "skewed")],
    ids=lambda c: "-".join(c) if isinstance(c, tuple) else c)
def test_gemm_rs_two_ranks_on_one_gpu(configs, split):
    """GEMM+RS of two simulated ranks running concurrently: rank ``r``'s output is rows ``r``
    of ``A_0 @ B_0 + A_1 @ B_1``, over several epochs (signals are never reset; the slots the
    peers push into are poisoned before each), for the warp-specialized kernel, the Triton
    kernel, and one of each (the same protocol); also with merged rows (``rs_merge_rows``: a
    rank pushes into its own slot too and waits for its own signal as well as the peer's).

    ``skewed``: rank 0 runs 3 programs, whose producer tiles do not divide evenly among them,
    and rank 1 most of the GPU, so rank 1 sits at its wait while rank 0's programs finish
    their last producer tiles one tile apart. A signal raised before the last of them has
    stored (a grid barrier that counts wrong) lets rank 1 read poisoned slots."""
    from megatron_flux.kernels.config import GemmConfig

    total = torch.cuda.get_device_properties(0).multi_processor_count
    sms = [total // 2] * 2 if split == "even" else [3, total - 3 - 8]
    _gemm_rs_ranks_on_one_gpu(512, 512, 1024, [GemmConfig(**_RS_PAIR[c]) for c in configs], sms)


def _gemm_rs_ranks_on_one_gpu(m_local, n, k, cfgs, sms, epochs=(1, 2, 3), late_ms=0.0):
    """GEMM+RS of ``len(cfgs)`` simulated ranks on this GPU (``rs_ranks.SimulatedRanks``), rank
    ``r`` with ``cfgs[r]`` on a grid of ``sms[r]`` programs and its own stream, all launched at
    once per epoch (the last rank ``late_ms`` later, behind a sleep on its stream: every other
    rank then reaches its waits before that rank has pushed anything); every rank's output
    checked against the fp32 sum of every rank's partial, its error word clean, its arrival
    counter back at zero and every peer's signal at the epoch. The slots and outputs are
    poisoned (NaN) before each epoch. The grids together must fit the GPU (every program of
    every rank resident), as they must on a real group."""
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import _sleep_cycles_per_ms
    from megatron_flux.tools.diagnostics.rs_ranks import SimulatedRanks

    world = len(cfgs)
    gen = torch.Generator(device="cuda").manual_seed(7)
    a = [torch.randn(world * m_local, k, device="cuda", generator=gen).to(torch.bfloat16)
         for _ in range(world)]
    w = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(world)]
    ranks = SimulatedRanks(a, w, cfgs, sms)
    streams = [torch.cuda.Stream() for _ in range(world)]
    ref = ranks.reference()
    # the sleep kernel timed (and so loaded) before any grid runs: under lazy loading its first
    # launch would wait for the grids, which wait for the rank queued behind it
    late_cycles = int(late_ms * _sleep_cycles_per_ms()) if late_ms else 0
    # every rank's binary loaded before the grids run at once (lazy loading: see ``load``)
    ranks.load(streams)
    for epoch in epochs:
        ranks.poison()
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                if late_cycles and r == world - 1:
                    torch.cuda._sleep(late_cycles)
                ranks.launch(r, epoch)
        torch.cuda.synchronize()
        ranks.check_protocol(epoch)
        for r, rel in enumerate(ranks.rel_errors(ref)):
            assert rel < 1e-2, (epoch, r, cfgs[r], rel)


@pytest.mark.parametrize("late", [False, True], ids=["together", "last-late"])
@pytest.mark.parametrize("configs", [("ws", "ws", "ws", "ws"), ("coop", "triton", "ws", "merged"),
                                     ("wsmerged", "coopmerged", "merged", "ws"),
                                     ("wsinterleave",) * 4, ("wsturns",) * 4],
                         ids=lambda c: "-".join(c))
def test_gemm_rs_four_ranks_on_one_gpu(configs, late):
    """GEMM+RS of four simulated ranks running at once, a quarter of the GPU each: three peers
    push into every owner and the owner waits for three signals (TP 4's protocol, which the
    two-rank test does not reach), the kernels mixed across ranks; with ``late`` the last rank
    starts 2 ms after the others, so every owner's wait for it is a real one."""
    from megatron_flux.kernels.config import GemmConfig

    sms = torch.cuda.get_device_properties(0).multi_processor_count // 4
    _gemm_rs_ranks_on_one_gpu(256, 512, 1024, [GemmConfig(**_RS_PAIR[c]) for c in configs],
                              [sms] * 4, late_ms=2.0 if late else 0.0)


# (form, world, m_local, n, k, whether the parts run first): on 132 SMs shared evenly, each
# rank's partial last wave split along K; at TP 2 the parts run first, at TP 4 first below two
# waves and last from two waves on (split_tail.split_tail_first)
_SPLIT_RANKS = [("pingpong", 2, 512, 1152, 2048, True), ("pingpong", 4, 256, 640, 2048, True),
                ("pingpong", 4, 256, 1152, 2048, False), ("coop", 2, 512, 2304, 2048, True),
                ("coop", 4, 256, 1152, 2048, True), ("coop", 4, 256, 2304, 2048, False)]


@pytest.mark.parametrize("late", [False, True], ids=["together", "last-late"])
@pytest.mark.parametrize("form, world, m_local, n, k, first", _SPLIT_RANKS,
                         ids=lambda v: str(v))
def test_gemm_rs_ws_split_tail_ranks_on_one_gpu(form, world, m_local, n, k, first, late):
    """The warp-specialized GEMM+RS with its split tail (``stream_k=1``) on ``world`` simulated
    ranks running at once on this GPU: the tail tiles are own tiles, so a part's program and
    the program summing a share of the tile wait for the other parts (counters in this rank's
    scratch) and for every peer's signal (its grid barrier, raised after the peers' pushes);
    both must hold across concurrent ranks, in either order of the parts, and the sums must be
    right over several epochs; with ``late`` the last rank starts 2 ms after the others, so the
    other ranks' sums wait for its signal for real. The plan is checked to split, in the
    expected order."""
    from megatron_flux.kernels import split_tail
    from megatron_flux.kernels.config import GemmConfig

    if torch.cuda.get_device_properties(0).multi_processor_count < 132:
        pytest.skip("the shapes are chosen for 132 SMs")
    sms = 132 // world
    cfg = GemmConfig(**WS_FORMS[form], num_stages=5 if form == "pingpong" else 3,
                     epilogue_split=1, rs_warp_specialized=True, stream_k=1)
    tail, parts = split_tail.split_tail_plan(world, m_local, n, k, cfg, sms)
    assert parts > 1 and tail > 0, (tail, parts)
    assert split_tail.split_tail_first(world, m_local, n, cfg, sms) == first
    _gemm_rs_ranks_on_one_gpu(m_local, n, k, [cfg] * world, [sms] * world,
                              late_ms=2.0 if late else 0.0)


# (the kernel's stream, a sleep kernel first on the peer stream)
_PEER_TIMING = [("own", True), ("own", False), ("default", True), ("default", False)]


@pytest.mark.parametrize("kernel_stream, sleep", _PEER_TIMING,
                         ids=["own-sleep", "own-nosleep", "default-sleep", "default-nosleep"])
@pytest.mark.parametrize("kernel", ["ws", "coop", "triton"])
def test_ag_gemm_waits_for_chunks_that_land_while_it_runs(kernel, kernel_stream, sleep):
    """AG+GEMM as rank 0 of 2 while "the peer's copy engine" (a second stream, optionally
    after a sleep kernel) copies its rows into the workspace chunk by chunk and raises each
    chunk's signal: the kernel spins on real, late signals and computes the right product.

    The peer stream's work runs once before any grid spins, on scratch tensors of the same
    shapes and offsets, so every kernel it launches is loaded. With CUDA's lazy loading (the
    default) the first launch of a kernel function waits for the context's running grids; a
    grid spinning on work queued behind such a launch then waits until its bounded polls run
    out (with ``CUDA_MODULE_LOADING=EAGER`` the same case passes; it is not a stream-priority
    effect). The backend queues no kernel behind its fused grids, only copies and stream
    memory operations."""
    from megatron_flux.kernels.ag_gemm import launch_ag_gemm
    from megatron_flux.kernels.config import GemmConfig

    world, m_local, n, k, chunk = 2, 512, 1024, 1024, 128
    chunks = m_local // chunk
    sms = torch.cuda.get_device_properties(0).multi_processor_count // 2
    gen = torch.Generator(device="cuda").manual_seed(11)
    xs = [torch.randn(m_local, k, device="cuda", generator=gen).to(torch.bfloat16)
          for _ in range(world)]
    w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
    ref = torch.cat(xs).float() @ w.t().float()
    fields = {"ws": dict(WS_FORMS["pingpong"], num_stages=5, ag_warp_specialized=True),
              "coop": dict(WS_FORMS["coop"], num_stages=3, ag_warp_specialized=True),
              "triton": dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4)}
    cfg = GemmConfig(**fields[kernel], epilogue_split=1, chunk_rows=chunk)
    peer = torch.cuda.Stream()
    kstream = torch.cuda.current_stream() if kernel_stream == "default" else torch.cuda.Stream()

    def deliver(ag, flags, epoch, sleep_cycles):  # the peer's chunks, each then its signal
        with torch.cuda.stream(peer):
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            for c in range(chunks):
                rows = slice(m_local + c * chunk, m_local + (c + 1) * chunk)
                ag[rows].copy_(xs[1][c * chunk:(c + 1) * chunk])
                flags[chunks + c].fill_(epoch)

    # load the peer stream's kernels (the sleep, the fills at these offsets) before any grid spins
    deliver(torch.empty(world * m_local, k, device="cuda", dtype=torch.bfloat16),
            torch.zeros(world * chunks, dtype=torch.int32, device="cuda"), 0, 1)
    torch.cuda.synchronize()
    for epoch in (1, 2):
        ag = torch.full((world * m_local, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        flags = torch.full((world * chunks,), epoch - 1, dtype=torch.int32, device="cuda")
        flags[:chunks] = epoch  # the own segment is never waited for
        err = torch.zeros(4, dtype=torch.int32, device="cuda")
        out = torch.full((world * m_local, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with torch.cuda.stream(kstream):
            launch_ag_gemm(xs[0], ag, w.t(), out, flags, err, rank=0, world=world, epoch=epoch,
                           cfg=cfg, num_sms=sms, max_spins=1 << 22)
        # with a sleep the kernel reaches its first wait before any chunk
        deliver(ag, flags, epoch, 2_000_000 if sleep else 0)
        torch.cuda.synchronize()
        assert err.tolist() == [0, 0, 0, 0], err.tolist()
        rel = float((out.float() - ref).norm() / ref.norm())
        assert rel < 1e-2, (epoch, rel)
