"""The TP-communication count of ``benchmarks/e2e_comm.py`` against a real GPTModel's collectives.

e2e_comm turns two timed collectives into "TP communication per step" by a count: per
micro-batch ``4 x layers + 2`` all-gathers and as many reduce-scatters of one [tokens, hidden]
activation (re-gathers for weight gradients not counted). Here a Llama-style megatron-core
GPTModel (rotary positions, RMSNorm, SwiGLU) with the plugin's spec, ``nccl`` backend and
converted output layer runs one forward and backward with TP 2 and sequence parallelism on gloo,
and every c10d collective it issues is counted by a dispatch mode.

The model and the stubs of megatron-core's CUDA-only helpers (which move no data) are
``tests/unit/test_gpt_model_sp.py``'s.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.dist_harness import run_distributed

import e2e_comm

TP = 2


class _CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            self.counts[name.split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def _count_gpt_model_collectives(rank, world, layers, keep_gathered_input):
    from megatron_flux import specs
    from megatron_flux.output_layer import swap_output_layer
    from test_gpt_model_sp import (_config, _gpt_model, _microbatches, _stub_cuda_only_helpers,
                                   _with_cpu_attention)

    _stub_cuda_only_helpers()
    cfg = _config(world, num_layers=layers, params_dtype=torch.float32)
    cfg.flux_keep_gathered_input = keep_gathered_input
    block = specs.get_gpt_decoder_block_flux_spec(cfg, backend="nccl")
    block = _with_cpu_attention(block)
    model = swap_output_layer(_gpt_model(cfg, block, tie=False), "nccl")
    ids, pos, labels = _microbatches(1)[0]
    mode = _CountCollectives()
    with mode:
        loss = model(ids, pos, None, labels=labels)
        loss.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return dict(mode.counts)


def _count_cases(rank, world, cases):
    """Every case in one world: spawning one (importing torch and megatron-core in each
    process) costs more than the tiny models' forward and backward."""
    return [_count_gpt_model_collectives(rank, world, layers, keep) for layers, keep in cases]


@pytest.mark.slow
def test_collective_count_matches_a_gpt_model():
    cases = [(1, False), (2, False), (2, True)]
    per_rank = run_distributed(_count_cases, TP, cases, tensor_model_parallel_size=TP, timeout=240)
    for (layers, keep), counts in zip(cases, zip(*per_rank)):
        assert counts[0] == counts[1], counts
        expected = e2e_comm.collectives_per_microbatch(layers)
        regathers = 0 if keep else 2 * layers + 1  # qkv and fc1 per layer, and the output layer
        got = counts[0]
        assert got.get("_reduce_scatter_base_", 0) == expected["reduce_scatter"], (layers, keep, got)
        assert got.get("_allgather_base_", 0) == expected["all_gather"] + regathers, (layers, keep, got)
        # the rest are the vocabulary-parallel cross entropy's three small all-reduces
        assert set(got) <= {"_reduce_scatter_base_", "_allgather_base_", "allreduce_"}, got
        assert got.get("allreduce_", 0) == 3, got


def test_collectives_per_microbatch():
    assert e2e_comm.collectives_per_microbatch(16) == {"all_gather": 66, "reduce_scatter": 66}
    assert e2e_comm.collectives_per_microbatch(16, 0) == {"all_gather": 64, "reduce_scatter": 64}
