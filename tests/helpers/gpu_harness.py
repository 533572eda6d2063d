"""Spawn one NCCL rank per GPU for the GPU tests and collect what each rank reports.

A worker is a module-level ``worker(rank, world, port, *args, queue)`` that puts
``(rank, "ok", payload)`` or ``(rank, "error", traceback_text)`` on ``queue`` exactly once;
:func:`nccl_worker` makes one from a plain function that returns the payload.
:func:`run_nccl_world` fails the test with every rank's traceback, never waits past
``timeout``, and kills ranks left behind (one may be stuck in a collective)."""

import functools
import os
import traceback

import torch
import torch.multiprocessing as mp

from .dist_harness import free_port


#: never NVLink multicast on the shared GPU boxes
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


def init_rank(rank, world, port, env=None):
    """In a spawned worker: set ``env`` (plus :data:`NO_MULTICAST_ENV`), pick GPU ``rank`` and
    join the NCCL world at ``port``."""
    os.environ.update({**NO_MULTICAST_ENV, **(env or {})})
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world, device_id=torch.device("cuda", rank))


def nccl_worker(body):
    """Decorator: ``body(rank, world, port, *args) -> payload`` becomes a worker for
    :func:`run_nccl_world` (queue last), reporting the payload or the traceback exactly once
    and leaving the process group however ``body`` ended. Module-level use keeps it
    picklable for spawn (the wrapper takes ``body``'s name)."""

    @functools.wraps(body)
    def worker(rank, world, port, *args):
        *args, queue = args
        try:
            queue.put((rank, "ok", body(rank, world, port, *args)))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            queue.put((rank, "error", traceback.format_exc()))
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    return worker


def run_nccl_world(worker, world, *args, timeout=600, env=None):
    """Run ``worker`` on ``world`` spawned ranks; return the ranks' payloads in arrival order.

    ``env``: variables the ranks start with, over :data:`NO_MULTICAST_ENV` and Megatron's
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (an empty value unsets one), in their environment from
    the first instruction: CUDA reads ``CUDA_DEVICE_MAX_CONNECTIONS`` when it initialises,
    which importing a test module (its skip marks) already does, so :func:`init_rank` setting
    it would be too late."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    env = {**NO_MULTICAST_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v == "":
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results = []
    try:
        for _ in range(world):
            results.append(queue.get(timeout=timeout))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [str(r[2]) for r in results if r[1] != "ok"]
    assert not errors, "\n".join(errors)
    return [r[2] for r in results]


def launch_gemm_rs_without_its_peer(err, max_spins=1000):
    """A small GEMM+RS as rank 0 of 2 on GPU 0 whose peer never runs: both "ranks" map to this
    GPU's buffers, rank 0 pushes into itself, and its wait for rank 1's partial runs out after
    ``max_spins`` polls, filling the int32[4] error word ``err``."""
    from megatron_flux.kernels.config import GemmConfig, rs_signal_count
    from megatron_flux.kernels.gemm_rs import launch_gemm_rs

    dev = torch.device("cuda", 0)
    cfg = GemmConfig(block_m=64, block_n=64, block_k=64, num_stages=2, num_warps=4)
    a = torch.randn(256, 64, device=dev, dtype=torch.bfloat16)
    b = torch.randn(64, 128, device=dev, dtype=torch.bfloat16)
    out = torch.empty(128, 128, device=dev, dtype=torch.bfloat16)
    data = torch.empty(2, 128, 128, device=dev, dtype=torch.bfloat16)
    flags = torch.zeros(rs_signal_count(2), dtype=torch.int32, device=dev)

    def ptrs(t):
        return torch.tensor([t.data_ptr()] * 2, dtype=torch.int64, device=dev)

    launch_gemm_rs(a, b, out, data, ptrs(data), ptrs(flags), None, err, rank=0, world=2, epoch=1,
                   cfg=cfg, num_sms=4, max_spins=max_spins)
