"""The Flux layers inside CUDA graphs: captured, replayed many times, right every time.

An MLP block (column fc1 -> GeLU -> row fc2, sequence parallel, bf16) with ``flux_backend`` set
to ``auto`` or ``flux`` runs its first iterations eagerly (the fused kernels), then is captured
forward and backward with ``torch.cuda.make_graphed_callables``, the way Megatron's graphs
capture layers. Inside the capture the fused backend gives way to NCCL and cuBLAS
(``resolve_backend``); the capture must not fail (a cuBLAS handle created inside a capture did),
and every replay, each on fresh inputs, must match an eager NCCL + cuBLAS block with the same
weights. Skipped below 2 GPUs.
"""

import pytest
import torch

from helpers.gpu_harness import nccl_worker, run_nccl_world
from test_layers_gpu import _mlp, _rel, _tp_world

pytestmark = pytest.mark.gpu

_NEEDS_2_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs"
)
REPLAYS = 12


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
    parallel_state.destroy_model_parallel()
    return checks


@_NEEDS_2_GPUS
@pytest.mark.parametrize("backend", ["auto", "flux"])
def test_graph_replays_match_nccl(backend):
    checks = run_nccl_world(_worker, 2, backend, timeout=900)
    assert checks == [REPLAYS * 5] * 2
