"""Experiment: a warp-specialized persistent Hopper GEMM in Gluon, ``C = A @ B^T`` (bf16), in
the AllGather+GEMM form (``WORLD = 1`` is the plain GEMM).

Why: Triton 3.6's persistent TMA GEMM is not warp-specialized on Hopper. While a program rounds
and stores a tile, its SM's tensor cores idle, and at short K that is several per cent of the
tile (the plain yardstick runs 1.07-1.10x cuBLAS at AG llama3-8b m = 1024, K = 4096). cuBLAS's
Hopper kernels hide the epilogue behind the next tile's MMAs with warp specialization. Gluon
(``triton.experimental.gluon``, in Triton 3.6) exposes shared memory, mbarriers, TMA and
``warp_specialize`` directly, so the same schedule can be written without leaving Triton.
If this kernel reaches cuBLAS where the plain one does not, the fused kernels' tile loops
move onto it (their prologue waits and epilogue pushes/reductions are per tile, as here).

Tile and barrier schedule (one program per SM, ``G`` programs; program ``p`` owns tiles
``p, p + G, ...`` in GROUP_M-grouped order, local index ``j = 0, 1, ...``):

* **AllGather order** (as ``kernels/ag_gemm.py``): flat tile ``t`` is step ``t //
  tiles_per_segment``; step 0 is the local rows, read from the caller's shard, steps 1.. the
  peers' segments in ring order, read from the gathered workspace. The *load warp* waits
  (acquire, bounded, per chunk signal) for a peer segment before issuing its first TMA read
  of it, then fences the async proxy; the MMA warps never spin on communication. The two A
  descriptors cost nothing here: the shared-memory ring is explicit, so both feed one ring
  (in Triton's ``tl.range`` loops two K loops needed two pipelines' buffers).
* **Load partition** (1 warp, 24 registers): walks every K-step of every tile of its program
  in order, position ``pos = j * k_tiles + kk`` in a ring of ``STAGES`` shared-memory slots
  (A ``[BLOCK_M, BLOCK_K]`` and B ``[BLOCK_N, BLOCK_K]`` per slot). Per step: wait the slot's
  ``empty`` barrier (phase ``pos // STAGES + 1``, so the first round passes), ``expect`` both
  boxes' bytes on its ``ready`` barrier, issue the two TMA loads onto it.
* **Two MMA partitions** (one warpgroup each, the default one and a worker): MMA partition
  ``c`` computes the tiles with ``j % 2 == c`` into a 128-register fp32 accumulator. Per K-step:
  wait ``ready`` (phase ``pos // STAGES``), issue an async ``wgmma`` on the slot, wait until
  only it is in flight, arrive on the *previous* slot's ``empty``. After the last step: wait
  for all, release the last slot, round to bf16 into its own epilogue buffer (after its
  previous TMA store has read it out), TMA store.
* Because the ring is filled in tile order, partition ``1 - c`` starts tile ``j + 1``'s MMAs
  as soon as the loader reaches it, which is while partition ``c`` finishes tile ``j``'s last
  steps and its epilogue: the epilogue of one tile runs beside the MMAs of the next (the
  "ping-pong" of CUTLASS's Hopper kernels).
* **Handoff.** A parity wait is only sound when the waiter is at most one phase ahead of the
  barrier. An MMA partition that finished tile ``j - 2`` early would wait on tile ``j``'s
  first slot while the slot may still be two phases behind (tile ``j - 1``'s loads not landed)
  and pass on stale data. So partition ``c`` arrives on ``handoff[1 - c]`` once the last slot
  of its tile has landed, and waits on ``handoff[c]`` (phase = the index of tile ``j - 1``
  among the other partition's tiles) before tile ``j``. Then every load of positions before
  tile ``j`` has completed, each ready wait is at most one phase ahead, and ``handoff`` itself
  cannot run two phases ahead (the other partition's next arrival needs tile ``j``'s slots to
  be consumed first). This needs ``k_tiles >= STAGES`` (the launcher checks). A randomized
  model of the protocol (``ws_protocol_model.py``) reads stale data without the handoff and
  finds no stale read, overwrite or deadlock with it.

Shared memory: ``STAGES * (BLOCK_M + BLOCK_N) * BLOCK_K * 2`` + two ``BLOCK_M x BLOCK_N`` bf16
epilogue buffers (4 stages of 128x128x64: 192 KB). Registers: 12 warps (4 + 4 + 1, rounded up
to warpgroups) under ``maxnreg`` 168; the worker MMA partition gets ``CONSUMER_REGS``, the
default one what is left.

The kernel is the package's ``megatron_flux/kernels/ag_gemm_ws.py`` (``ag_warp_specialized``,
with both B layouts and fp16; its K loop and ring are ``kernels/gluon_ws.py``); this script
times it (at ``WORLD = 1`` as a plain GEMM, and in the AG+GEMM form) beside cuBLAS and the
Triton kernels. ``tests/unit/test_kernels_compile.py`` compiles the package's kernel.

    python benchmarks/experiments/gluon_ws_gemm.py --shapes 1024x14336x4096 [--json PATH]

The GPU run also times the AG form as rank 0 of ``--ag-world`` with every signal pre-set, beside
the package's AG kernel wired the same way (``kernel_vs_cublas.ag_on_one_gpu``). Run as a script
with the repository root on ``PYTHONPATH`` (it imports ``common`` beside it).
"""

import argparse

from megatron_flux.kernels.config import GemmConfig

#: (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS); the package's kernel fixes
#: CONSUMER_REGS at 232
CONFIGS = [(128, 128, 64, 4, 232), (128, 128, 64, 5, 232), (128, 128, 64, 3, 232)]


def _cfg(cfg, chunk_rows=1024):
    bm, bn, bk, stages, _ = cfg
    return GemmConfig(bm, bn, bk, stages, 4, 8, chunk_rows=chunk_rows, epilogue_split=1,
                      ag_warp_specialized=True)


def launch_ws_ag_gemm(x, ag, b_nk, c, flags, err, *, rank, world, epoch, chunk_rows, cfg,
                      num_sms, max_spins=1 << 20):
    """``c = AllGather_rows(x) @ b_nk.T`` as rank ``rank`` of ``world`` on the package's kernel,
    with ``cfg`` = ``(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CONSUMER_REGS)``."""
    from megatron_flux.kernels.ag_gemm_ws import launch_ag_gemm_ws, unsupported_reason

    gcfg = _cfg(cfg, chunk_rows)
    reason = unsupported_reason(x, gcfg)
    if reason is not None:
        raise ValueError(f"ws_ag_gemm: {reason}")
    launch_ag_gemm_ws(x, ag, b_nk.t(), c, flags, err, rank=rank, world=world, epoch=epoch, cfg=gcfg,
                      num_sms=num_sms, max_spins=max_spins)


def launch_ws_gemm(a, b_nk, c, cfg, num_sms, _scratch={}):
    """The plain GEMM ``c = a @ b_nk.T``: the kernel at ``world = 1`` (no signal is read)."""
    key = a.device
    if key not in _scratch:
        import torch

        _scratch[key] = (torch.zeros(1, dtype=torch.int32, device=a.device),
                         torch.zeros(4, dtype=torch.int32, device=a.device))
    flags, err = _scratch[key]
    launch_ws_ag_gemm(a, a, b_nk, c, flags, err, rank=0, world=1, epoch=1, chunk_rows=a.shape[0],
                      cfg=cfg, num_sms=num_sms)


def main(argv=None):
    from common import add_timing_args

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1024x14336x4096"], help="MxNxK")
    p.add_argument("--ag-world", type=int, default=2, help="also time the AG+GEMM form as rank 0 "
                   "of this many (one-GPU wiring, signals pre-set), beside the package's AG kernel")
    add_timing_args(p)
    p.add_argument("--ag-config", type=int, default=0,
                   help="index into CONFIGS of the AG form's config (0: 4 stages, 1: 5 stages)")
    p.add_argument("--ws-configs", nargs="+", default=None, metavar="BMxBNxBKxSTAGES",
                   help="the warp-specialized (ping-pong) configs to time (default: CONFIGS)")
    p.add_argument("--plain-configs", nargs="+", default=["128x128x64x4x4", "128x256x64x3x8"],
                   metavar="BMxBNxBKxSTAGESxWARPS", help="the plain Triton yardstick's configs")
    p.add_argument("--ag-table", action="store_true",
                   help="time the package's AG kernel with the shipped table's config (else the "
                        "heuristic default without stream-K)")
    args = p.parse_args(argv)
    import torch

    from common import parse_shape, problem, time_and_check, write_record
    from megatron_flux.tools.diagnostics.kernel_vs_cublas import ag_on_one_gpu
    from megatron_flux.tools.diagnostics.plain_gemm import launch_plain_gemm
    from megatron_flux.kernels.config import GemmConfig, default_config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plain_cfgs = {f"plain-{spec}": GemmConfig(*map(int, spec.split("x")), 8)
                  for spec in args.plain_configs}
    ws_cfgs = ([(*map(int, spec.split("x")), 232) for spec in args.ws_configs]
               if args.ws_configs else CONFIGS)
    rows = []
    for shape in args.shapes:
        m, n, k = parse_shape(shape)
        a, w, full = problem(m, n, k)
        fns = {"cublas": lambda: torch.matmul(a, w.t())}
        outs = {}
        for name, cfg in plain_cfgs.items():
            o = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns[name] = lambda o=o, cfg=cfg: launch_plain_gemm(a, w, o, cfg, sms)
            outs[name] = (o, lambda: full)
        for cfg in ws_cfgs:
            name = "ws-" + "x".join(map(str, cfg))
            o = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            try:  # a config that does not build or run is reported and skipped
                launch_ws_gemm(a, w, o, cfg, sms)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                print(f"{shape} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            fns[name] = lambda o=o, cfg=cfg: launch_ws_gemm(a, w, o, cfg, sms)
            outs[name] = (o, lambda: full)
        world = args.ag_world
        ag_cfg = CONFIGS[args.ag_config]
        if world > 1 and (m // world) % ag_cfg[0] == 0:  # the AG form, one config
            m_local = m // world
            err = torch.zeros(4, dtype=torch.int32, device="cuda")
            flags = torch.full((world,), 1 << 30, dtype=torch.int32, device="cuda")
            o = torch.full((m, n), float("nan"), device="cuda", dtype=a.dtype)
            fns["ws-ag"] = lambda o=o: launch_ws_ag_gemm(
                a[:m_local], a, w, o, flags, err, rank=0, world=world, epoch=1,
                chunk_rows=m_local, cfg=ag_cfg, num_sms=sms)
            outs["ws-ag"] = (o, lambda: full)
            if args.ag_table:
                from megatron_flux.tuning.provider import TableConfigProvider

                tcfg = TableConfigProvider()("ag", m, n, k, dtype=a.dtype, tp=world,
                                             device=torch.device("cuda", 0))
            else:
                tcfg = GemmConfig.from_dict(dict(default_config("ag", m, n, k).to_dict(), stream_k=0))
            fns["triton-ag"], ag_out = ag_on_one_gpu(a, w, world, tcfg, err)
            outs["triton-ag"] = (ag_out, lambda: full)
        rows += time_and_check(fns, outs, args, shape,
                               {"m": m, "n": n, "k": k})
    write_record(args.json, rows)


if __name__ == "__main__":
    main()
