"""Experiment: when does work on a second stream start beside a fused AG+GEMM grid that is
spinning on chunk signals? (session 19, one GPU)

Rank 0 of a simulated TP 2 AG+GEMM runs on its own stream with ``grid_sms`` programs; a "peer"
stream at ``peer_prio`` queues an optional sleep kernel, then copies the peer's rows into the
workspace chunk by chunk, raising each chunk's signal with a one-element ``fill_`` (a kernel).
Events give the kernel's end and when the peer stream got past its sleep and finished, in ms
after the kernel's start; ``err`` is the kernel's error word (a wait that ran out of polls).

    PYTHONPATH=. python3 benchmarks/experiments/peer_stream_delay.py [--repeat N] [--triton-first]
"""
import torch
from megatron_flux.kernels.ag_gemm import launch_ag_gemm
from megatron_flux.kernels.config import GemmConfig
world, m_local, n, k, chunk = 2, 512, 1024, 1024, 128
chunks = m_local // chunk
gen = torch.Generator(device="cuda").manual_seed(11)
xs = [torch.randn(m_local, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(world)]
w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
def run(ws, grid_sms, sleep_cycles, peer_prio):
    cfg = GemmConfig(**(dict(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, epilogue_split=1, ag_warp_specialized=True) if ws else dict(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4, epilogue_split=1)), chunk_rows=chunk)
    peer = torch.cuda.Stream(priority=peer_prio); ks = torch.cuda.Stream()
    with torch.cuda.stream(peer):
        torch.cuda._sleep(1); torch.zeros(1, dtype=torch.int32, device="cuda").fill_(1)
    ag = torch.full((world * m_local, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    flags = torch.zeros((world * chunks,), dtype=torch.int32, device="cuda"); flags[:chunks] = 1
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    out = torch.empty((world * m_local, n), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    with torch.cuda.stream(ks):
        evs[0].record()
        launch_ag_gemm(xs[0], ag, w.t(), out, flags, err, rank=0, world=world, epoch=1, cfg=cfg, num_sms=grid_sms, max_spins=1 << 22)
        evs[1].record()
    with torch.cuda.stream(peer):
        if sleep_cycles: torch.cuda._sleep(sleep_cycles)
        evs[2].record()
        for c in range(chunks):
            ag[m_local + c * chunk: m_local + (c + 1) * chunk].copy_(xs[1][c * chunk:(c + 1) * chunk])
            flags[chunks + c].fill_(1)
        evs[3].record()
    torch.cuda.synchronize()
    print(f"ws={int(ws)} grid_sms={grid_sms} sleep={sleep_cycles} prio={peer_prio}: err={err.tolist()} kernel_end={evs[0].elapsed_time(evs[1]):.2f}ms peer_after_sleep={evs[0].elapsed_time(evs[2]):.2f}ms peer_done={evs[0].elapsed_time(evs[3]):.2f}ms", flush=True)
import sys
# --repeat N: each case N times in a row (session 20: only a case's first run, which compiles the
# kernel for its grid size, was late)
repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 1
# --triton-first: the Triton kernel's cases before the warp-specialized one's
for ws in ((False, True) if "--triton-first" in sys.argv else (True, False)):
    for grid in (66, 32):
        for sleep in (2_000_000, 0):
            for _ in range(repeat):
                run(ws, grid, sleep, -1)
for _ in range(repeat):
    run(True, 66, 2_000_000, 0)
