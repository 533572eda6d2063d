"""The Flux layers inside CUDA graphs: captured, replayed many times, right every time.

An MLP block (column fc1 -> GeLU -> row fc2, sequence parallel, bf16) with ``flux_backend`` set
to ``auto`` or ``flux`` runs its first iterations eagerly (the fused kernels), then is captured
forward and backward with ``torch.cuda.make_graphed_callables``, the way Megatron's graphs
capture layers. The fused calls are captured too (on the graph workspaces the eager iterations
reserved after ``expect_cuda_graphs``); the capture must not fail (a cuBLAS handle created
inside a capture did), and every replay, each on fresh inputs, must match an eager NCCL +
cuBLAS block with the same weights.

The fused ops alone: two graphs, one holding AG+GEMM, GEMM+RS, AG+GEMM and the other one
GEMM+RS (odd counts on a workspace, so consecutive replays meet on one parity and only the
graph-entry fence keeps them apart), replayed back to back in a random order with eager fused
calls between, fresh inputs before every replay and no host synchronisation, each result
compared afterwards with NCCL + fp32 matmuls; with SM and copy-engine GEMM+RS pushes.
Skipped below 2 GPUs.
"""

import dataclasses

import pytest
import torch

from helpers.gpu_harness import init_rank, nccl_worker, run_nccl_world
from test_layers_gpu import _mlp, _rel, _tp_world

pytestmark = pytest.mark.gpu

_NEEDS_2_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs"
)
REPLAYS = 24


class _Block(torch.nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        y1, _ = self.fc1(x)
        y, _ = self.fc2(torch.nn.functional.gelu(y1))
        return y


@nccl_worker
def _worker(rank, world, port, backend):
    from megatron.core import parallel_state

    config = _tp_world(rank, world, port)
    from megatron_flux.backends import expect_cuda_graphs, get_backend

    expect_cuda_graphs()  # before the eager iterations, as the layers do with graphs configured
    h, ffn, s, b = 1024, 4096, 512, 2
    graphed = _Block(*_mlp(config, h, ffn, backend, False))
    ref = _Block(*_mlp(config, h, ffn, "nccl", False))
    ref.load_state_dict(graphed.state_dict())
    params = list(graphed.parameters())

    def inputs(seed):
        g = torch.Generator(device="cuda").manual_seed(seed * world + rank)
        x = torch.randn(s // world, b, h, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(s // world, b, h, device="cuda", dtype=torch.bfloat16, generator=g)
        return x, dy

    # eager first: the fused kernels run (workspaces, compiles), on this thread and autograd's
    for step in range(2):
        x, dy = inputs(step)
        graphed(x.requires_grad_(True)).backward(dy)
    for p in params:
        p.grad = None
    sample = inputs(99)[0].requires_grad_(True)
    graphed = torch.cuda.make_graphed_callables(graphed, (sample,), num_warmup_iters=3)
    checks = 0
    for replay in range(REPLAYS):
        x, dy = inputs(1000 + replay)
        for p in params + list(ref.parameters()):
            p.grad = None
        xg = x.clone().requires_grad_(True)
        y = graphed(xg)
        y.backward(dy)
        xr = x.clone().requires_grad_(True)
        y_ref = ref(xr)
        y_ref.backward(dy)
        torch.cuda.synchronize()
        err = _rel(y, y_ref)
        assert err < 2e-2, f"replay {replay}: forward rel err {err}"
        grads = [xg.grad] + [p.grad for p in params]
        refs = [xr.grad] + [p.grad for p in ref.parameters()]
        for i, (g, r) in enumerate(zip(grads, refs)):
            err = _rel(g, r)
            assert err < 3e-2, f"replay {replay}: grad {i} rel err {err}"
            checks += 1
    fused = get_backend("flux")
    fused.check_errors(sync=True)
    if backend == "flux":
        # fc1's AG+GEMM, fc2's GEMM+RS, fc2's backward AG+GEMM (fc1's backward is NCCL's)
        assert fused.captured_calls >= 3 and fused.capture_fallbacks == 0, (
            f"the fused calls were not captured: {fused.captured_calls} captured, "
            f"{fused.capture_fallbacks} on NCCL, reserve_for_capture={fused.reserve_for_capture}, "
            f"{len(fused._capture_plans)} graph plans")
    parallel_state.destroy_model_parallel()
    return checks


@_NEEDS_2_GPUS
@pytest.mark.parametrize("backend", ["auto", "flux"])
def test_graph_replays_match_nccl(backend):
    checks = run_nccl_world(_worker, 2, backend, timeout=900)
    assert checks == [REPLAYS * 5] * 2


STEPS = 48


@nccl_worker
def _ops_worker(rank, world, port, rs_copy_engine):
    import random

    from megatron_flux.backends.flux import FluxBackend
    from megatron_flux.kernels.config import default_config

    init_rank(rank, world, port)
    group = torch.distributed.group.WORLD
    dev = torch.device("cuda", rank)
    flux = FluxBackend(config_provider=lambda op, m_total, n, k: dataclasses.replace(
        default_config(op, m_total, n, k), rs_copy_engine=rs_copy_engine))
    flux.expect_capture()
    m_local, k, n = 512, 1024, 768
    g = torch.Generator(device=dev).manual_seed(1234)  # the same weights on every rank
    b_ag = torch.randn(n, k, device=dev, generator=g).to(torch.bfloat16).t()
    b_rs = torch.randn(k, n, device=dev, generator=g).to(torch.bfloat16)
    x1 = torch.empty(m_local, k, device=dev, dtype=torch.bfloat16)
    x2, a1, a2 = torch.empty_like(x1), torch.empty(world * m_local, k, device=dev,
                                                   dtype=torch.bfloat16), None
    a2 = torch.empty_like(a1)

    def fill(step):
        gen = torch.Generator(device=dev).manual_seed(10_000 * step + rank)
        for t in (x1, x2, a1, a2):
            t.copy_(torch.randn(t.shape, device=dev, generator=gen))
        return [t.clone() for t in (x1, x2, a1, a2)]

    def graph1():
        y1, _ = flux.all_gather_matmul(x1, b_ag, group)
        z1 = flux.matmul_reduce_scatter(a1, b_rs, group)
        y2, _ = flux.all_gather_matmul(x2, b_ag, group)
        return y1, z1, y2

    def graph2():
        return (flux.matmul_reduce_scatter(a2, b_rs, group),)

    fill(0)
    for _ in range(2):  # eager: compiles, and the plans of the captured calls
        graph1(), graph2()
    torch.cuda.synchronize()
    graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph, body in zip(graphs, (graph1, graph2)):
        with torch.cuda.graph(graph):
            outs.append(body())
    assert flux.captured_calls == 4
    order = random.Random(7).choices([0, 1, 2], weights=[4, 4, 1], k=STEPS)  # 2: eager calls
    results = []
    for step, which in enumerate(order):
        inputs = fill(step + 1)
        if which == 2:
            got = graph1() + graph2()
            results.append((inputs, "eager", [t.clone() for t in got]))
        else:
            graphs[which].replay()
            results.append((inputs, which, [t.clone() for t in outs[which]]))
    torch.cuda.synchronize()
    flux.check_errors(sync=True)

    def ag_ref(x):
        gathered = torch.empty(world * m_local, k, device=dev, dtype=x.dtype)
        torch.distributed.all_gather_into_tensor(gathered, x, group=group)
        return gathered.float() @ b_ag.float()

    def rs_ref(a):
        full = a.float() @ b_rs.float()
        torch.distributed.all_reduce(full, group=group)
        return full[rank * m_local:(rank + 1) * m_local]

    checks = 0
    for step, ((ix1, ix2, ia1, ia2), which, got) in enumerate(results):
        if which == 0:
            refs = [ag_ref(ix1), rs_ref(ia1), ag_ref(ix2)]
        elif which == 1:
            refs = [rs_ref(ia2)]
        else:
            refs = [ag_ref(ix1), rs_ref(ia1), ag_ref(ix2), rs_ref(ia2)]
        for i, (out, ref) in enumerate(zip(got, refs)):
            err = float((out.float() - ref).norm() / ref.norm())
            assert err < 1e-2, f"step {step} ({which}) output {i}: rel err {err}"
            checks += 1
    return checks


@_NEEDS_2_GPUS
@pytest.mark.parametrize("rs_copy_engine", [False, True])
def test_captured_fused_ops_replay_right_in_any_order(rs_copy_engine):
    checks = run_nccl_world(_ops_worker, 2, rs_copy_engine, timeout=150)
    assert checks[0] == checks[1] and checks[0] >= STEPS
