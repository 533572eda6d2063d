"""The TP-communication count of ``benchmarks/e2e_comm.py`` against a real GPTModel's collectives.

e2e_comm turns two timed collectives into "TP communication per step" by a count: per
micro-batch ``4 x layers + 2`` all-gathers and as many reduce-scatters of one [tokens, hidden]
activation (re-gathers for weight gradients not counted). Here a Llama-style megatron-core
GPTModel (rotary positions, RMSNorm, SwiGLU) with the plugin's spec, ``nccl`` backend and
converted output layer runs one forward and backward with TP 2 and sequence parallelism on gloo,
and every c10d collective it issues is counted by a dispatch mode.

Two CUDA-only pieces of megatron-core are stubbed in the worker, neither of which communicates:
``torch.cuda.current_device`` (the embedding's scatter allocates its output there) and the CUDA
RNG tracker the embedding forks for dropout (dropout is 0 here).
"""

import collections
import contextlib
import dataclasses
import importlib.util
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_harness import run_distributed  # noqa: E402

TP = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _e2e_comm():
    spec = importlib.util.spec_from_file_location("e2e_comm", os.path.join(ROOT, "benchmarks", "e2e_comm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            self.counts[name.split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def _with_core_attention(block, core_attention):
    def layer(spec):
        attn = spec.submodules.self_attention
        attn = dataclasses.replace(
            attn, submodules=dataclasses.replace(attn.submodules, core_attention=core_attention))
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))

    return dataclasses.replace(block, layer_specs=[layer(s) for s in block.layer_specs])


def _count_gpt_model_collectives(rank, world, layers, keep_gathered_input):
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker = lambda: types.SimpleNamespace(fork=contextlib.nullcontext)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_flux import specs
    from megatron_flux.output_layer import swap_output_layer
    from test_specs import CpuCoreAttention

    cfg = TransformerConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, tensor_model_parallel_size=world, sequence_parallel=True,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, attention_dropout=0.0,
        hidden_dropout=0.0, masked_softmax_fusion=False, bias_dropout_fusion=False,
        bias_activation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    cfg.flux_keep_gathered_input = keep_gathered_input
    block = _with_core_attention(specs.get_gpt_decoder_block_flux_spec(cfg, backend="nccl"), CpuCoreAttention)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=128,
                     max_sequence_length=16, position_embedding_type="rope")
    swap_output_layer(model, "nccl")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).expand(2, 16)
    mode = _CountCollectives()
    with mode:
        loss = model(ids, pos, None, labels=ids)
        loss.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return dict(mode.counts)


@pytest.mark.slow
def test_collective_count_matches_a_gpt_model():
    e2e_comm = _e2e_comm()
    cases = [(1, False), (2, False), (2, True)]
    for layers, keep in cases:
        counts = run_distributed(_count_gpt_model_collectives, TP, layers, keep,
                                 tensor_model_parallel_size=TP, timeout=240)
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
    e2e_comm = _e2e_comm()
    assert e2e_comm.collectives_per_microbatch(16) == {"all_gather": 66, "reduce_scatter": 66}
    assert e2e_comm.collectives_per_microbatch(16, 0) == {"all_gather": 64, "reduce_scatter": 64}
