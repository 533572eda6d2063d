"""A whole Llama-style GPTModel through the plugin at TP 2 with sequence parallelism, on gloo,
against megatron-core's stock model at TP 1 with the same full weights (float64).

The TP 2 model is what the pretrain scripts build: the plugin's decoder-block spec (Flux linears,
SP-capable norms, ``nccl`` backend) and GPTModel's output layer converted by
``swap_output_layer``. The reference is megatron-core's local spec at TP 1 without sequence
parallelism, so every collective, every shard layout (vocabulary-parallel embedding and output
layer, grouped QKV rows, the SwiGLU fc1 halves) and the vocabulary-parallel cross entropy are
checked end to end: the per-token losses, and every parameter's gradient against its shard of
the reference gradient (norm gradients after megatron-core's own TP all-reduce of
``sequence_parallel`` parameters). Tied and untied output weights; with activation
recomputation (full, and selective ``mlp``); with the linears' weight gradients accumulated into
megatron's ``main_grad`` buffers (``--flux-gradient-accumulation-fusion``), checking which
parameters took that path; with mixture-of-experts layers; and with two pipeline stages (TP 2 x
PP 2, megatron-core's 1F1B schedule over two micro-batches, and its interleaved schedule with two
virtual stages).

Pieces of megatron-core that move no data but need CUDA (or, in 0.16, Transformer Engine) are
stubbed in the workers: ``torch.cuda.current_device`` (the embedding's scatter allocates its
output there), the CUDA RNG tracker the embedding forks for dropout (dropout is 0 here), the RNG
state save/restore of activation recomputation, the MoE router's TE GEMM name, and the pipeline
schedule's few ``device="cuda"`` tensors and synchronizations.
"""

import contextlib
import dataclasses
import re
import traceback
import types

import pytest
import torch
import torch.nn.functional as F

from helpers.dist_harness import run_distributed
from helpers.paths import REPO

TP = 2
VOCAB, SEQ, BATCH = 128, 16, 2


def _stub_cuda_only_helpers():
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as megatron_random

    tensor_parallel.get_cuda_rng_tracker = lambda: types.SimpleNamespace(fork=contextlib.nullcontext)
    # activation recomputation saves and restores the CPU, CUDA and tracker RNG states
    megatron_random._get_all_rng_states = lambda: (torch.get_rng_state(), None, None)
    megatron_random._set_all_rng_states = lambda cpu_state, *_: torch.set_rng_state(cpu_state)
    # megatron-core 0.16's MoE router names Transformer Engine's GEMM even when TE is missing
    # (0.19 sets it to None)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


#: activation recomputation (TransformerConfig fields): the whole layer (``--recompute-granularity
#: full``), and the selective modules that re-run the plugin's linears or norms inside backward
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["mlp"]),
}

#: mixture of experts: every layer's MLP four SequentialMLP experts (expert TP = TP), top-2, the
#: all-gather token dispatcher (the all-to-all one takes a CUDA stream at construction)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
           moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")

#: the whole-model cases: (tied output weight, recomputation, main_grad accumulation, MoE)
CASES = {
    "untied": (False, "none", False, False),
    "tied": (True, "none", False, False),
    "untied-recompute-full": (False, "full", False, False),
    "untied-recompute-selective": (False, "selective", False, False),
    "untied-main-grad": (False, "none", True, False),
    "tied-recompute-full-main-grad": (True, "full", True, False),
    "moe": (False, "none", False, True),
    "moe-recompute-full-main-grad": (False, "full", True, True),
}


def _config(tp, **kw):
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float64,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False,
        bias_dropout_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    return TransformerConfig(**{**fields, **kw})


def _with_cpu_attention(block):
    """A block spec with every layer's core attention runnable on CPU (test_specs'
    :func:`with_cpu_attention`)."""
    from test_specs import with_cpu_attention

    return dataclasses.replace(block, layer_specs=[with_cpu_attention(s) for s in block.layer_specs])


def _gpt_model(cfg, spec, tie):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", share_embeddings_and_output_weights=tie)


def _microbatches(count):
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, torch.arange(SEQ).expand(BATCH, SEQ), labels))
    return out


def _run(model):
    ids, pos, labels = _microbatches(1)[0]
    loss = model(ids, pos, None, labels=labels)  # [b, s] per-token losses
    loss.sum().backward()
    return loss.detach()


def _stock_tp1(rank, world, tie, num_layers=2, microbatches=0, moe=False):
    """The reference: loss and gradients of one batch, or with ``microbatches`` the mean over
    that many micro-batches of each one's summed per-token loss, as a pipeline schedule scales
    them."""
    _stub_cuda_only_helpers()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from test_specs import with_cpu_attention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", **(
        dict(num_experts=MOE["num_moe_experts"], moe_grouped_gemm=False) if moe else {}))
    model = _gpt_model(_config(1, num_layers=num_layers, **(MOE if moe else {})),
                       with_cpu_attention(spec), tie)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # away from init, norms too, so every gradient is exercised
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    if microbatches:
        loss = []
        for ids, pos, labels in _microbatches(microbatches):
            total = model(ids, pos, None, labels=labels).sum()
            (total / microbatches).backward()
            loss.append(total.detach())
    else:
        loss = _run(model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss, params, grads


def _shard(name, full, rank, tp=TP):
    """This rank's slice of a full (TP 1) GPTModel parameter, megatron-core's TP layout."""
    from test_specs import shard_llama_param

    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return full.chunk(tp, dim=0)[rank]  # vocabulary rows
    if name == "decoder.final_layernorm.weight":
        return full
    prefix, _, rest = name.partition(".layers.")
    assert prefix == "decoder", name
    local = rest.partition(".")[2]
    if local == "mlp.router.weight":
        return full  # replicated
    # an expert's linears are split like the dense MLP's (expert TP = TP)
    return shard_llama_param(re.sub(r"^mlp\.experts\.local_experts\.\d+\.", "mlp.", local), full, rank, tp)


def _flux_tp2(rank, world, tie, full_params, recompute="none", main_grad=False, moe=False):
    _stub_cuda_only_helpers()
    from test_specs import allreduce_sp_grads

    from megatron_flux import specs
    from megatron_flux.layers.linear import FluxColumnParallelLinear
    from megatron_flux.output_layer import swap_output_layer

    cfg = _config(world, **RECOMPUTE[recompute], **(MOE if moe else {}))
    cfg.flux_gradient_accumulation_fusion = main_grad  # what --flux-gradient-accumulation-fusion sets
    block = specs.get_gpt_decoder_block_flux_spec(cfg, backend="nccl")
    block = _with_cpu_attention(block)
    model = swap_output_layer(_gpt_model(cfg, block, tie), "nccl")
    assert isinstance(model.output_layer, FluxColumnParallelLinear)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(full_params)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_shard(n, full_params[n], rank, world))
    if main_grad:  # as megatron's DDP: an fp32 (here float64) buffer per parameter
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)
    loss = _run(model)
    fused, plain = set(), set()
    if main_grad:  # the fused linears wrote main_grad; DDP's hook adds what reached .grad
        for n, p in model.named_parameters():
            if p.main_grad.any():
                fused.add(n)
            if p.grad is not None:
                plain.add(n)
                p.main_grad += p.grad
                p.grad = None
    allreduce_sp_grads(model, cfg)
    grads = {n: p.main_grad if main_grad else p.grad for n, p in model.named_parameters()}
    return loss, grads, (fused, plain)


# ---------------------------------------------------------------------- one world per kind
# Spawning a world costs seconds (each process imports torch and megatron-core), more than a
# tiny model's forward and backward. So the module spawns three: one process computes every
# stock TP 1 reference, two TP 2 ranks run every whole-model case and the sharded state
# dicts, four ranks run both pipeline schedules. Each case runs as it would alone (its own
# config, model and seed); a case that raises is reported by its own test.

#: the README's spec-swap snippets' reference: untied, 2 layers, one batch, dense
README_REFERENCE = (False, 2, 0, False)
#: the README's two spec-swap forms: the plugin's block spec, and a rewritten layer spec of one's own
README_FORMS = ("block", "layer")

#: the pipeline tests' reference: untied, 4 layers, 2 micro-batches, dense
PP_REFERENCE = (False, 4, 2, False)
PP_LAYERS, PP_MICROBATCHES = 4, 2


def _reference_key(case):
    """The stock TP 1 run a whole-model case compares with: (tie, layers, micro-batches, MoE)."""
    tie, _, _, moe = CASES[case]
    return (tie, 2, 0, moe)


def _each(fn, items):
    """``{item: ("ok", fn(item)) | ("error", traceback)}``: one item's failure does not stop
    the rest (a rank that raises before a collective leaves the others blocked there, and the
    world's timeout then stops every item)."""
    out = {}
    for item in items:
        try:
            out[item] = ("ok", fn(item))
        except Exception:  # noqa: BLE001 - reported by the item's test
            out[item] = ("error", traceback.format_exc())
    return out


def _stock_references(rank, world, keys):
    return _each(lambda key: _stock_tp1(rank, world, *key), keys)


def _tp2_world(rank, world, full_params, cases, moes, readme_forms):
    flux = _each(lambda case: _flux_tp2(rank, world, CASES[case][0], full_params[_reference_key(case)],
                                        *CASES[case][1:]), cases)
    sharded = _each(lambda moe: _sharded_state_dicts(rank, world, moe), moes)
    readme = _each(lambda form: _readme_tp2(rank, world, full_params[README_REFERENCE], form),
                   readme_forms)
    return flux, sharded, readme


def _pp_world(rank, world, full_params, virtuals):
    return _each(lambda virtual: _flux_tp2_pp2(rank, world, full_params, PP_LAYERS, PP_MICROBATCHES,
                                               virtual), virtuals)


def _value(result, what):
    status, value = result
    if status != "ok":
        pytest.fail(f"{what} raised:\n{value}")
    return value


@pytest.fixture(scope="module")
def references():
    """``{(tie, layers, micro-batches, moe): (loss, full params, grads)}`` of stock TP 1."""
    keys = sorted({_reference_key(case) for case in CASES} | {PP_REFERENCE, README_REFERENCE})
    (refs,) = run_distributed(_stock_references, 1, keys, tensor_model_parallel_size=1, timeout=300)
    return refs


@pytest.fixture(scope="module")
def tp2_world(references):
    """Every rank's results of every whole-model case and of both sharded state dicts."""
    full = {key: _value(references[key], f"stock TP 1 {key}")[1]
            for key in {_reference_key(case) for case in CASES} | {README_REFERENCE}}
    return run_distributed(_tp2_world, TP, full, list(CASES), [False, True], list(README_FORMS),
                           tensor_model_parallel_size=TP, timeout=600)


@pytest.fixture(scope="module")
def pp_world(references):
    full = _value(references[PP_REFERENCE], "stock TP 1 pipeline reference")[1]
    return run_distributed(_pp_world, 2 * TP, full, [1, 2], timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_gpt_model_tp2_sp_through_the_plugin_matches_stock_tp1(case, references, tp2_world):
    """With activation recomputation the plugin's linears run their forward a second time
    inside backward; the reference never recomputes. With ``main_grad`` the linears'
    weight gradients are accumulated into megatron's ``main_grad`` buffers (the pretrain
    scripts' ``--flux-gradient-accumulation-fusion``), every other gradient reaches ``.grad``.
    With MoE the experts' linears are the plugin's too (no sequence-parallel communication of
    their own: the token dispatcher gathers the sequence)."""
    tie, recompute, main_grad, moe = CASES[case]
    ref_loss, full_params, ref_grads = _value(references[_reference_key(case)], "stock TP 1")
    per_rank = [_value(flux[case], f"rank {rank}") for rank, (flux, _, _) in enumerate(tp2_world)]
    output_weight = "embedding.word_embeddings.weight" if tie else "output_layer.weight"
    # (an expert's linears run without sequence parallelism, so on megatron-core's own path,
    # whose accumulation fusion needs apex: their gradients reach .grad, as in stock)
    linears = {n for n in full_params if "linear_" in n and n.endswith(".weight")
               and ".experts." not in n} | {output_weight}
    for rank, (_, _, (fused, plain)) in enumerate(per_rank):
        if not main_grad:
            continue
        # every linear weight went through main_grad, the converted output layer's too (tied:
        # the embedding's weight, whose lookup gradient also reaches .grad); nothing else did
        assert fused == linears, (rank, fused ^ linears)
        assert plain == (set(full_params) - linears) | ({output_weight} if tie else set()), rank
    # float64 everywhere but megatron-core's vocabulary-parallel cross entropy, which computes
    # in float32 (``logits.float()``) and sums each rank's vocabulary shard apart at TP 2
    tol = dict(rtol=1e-5, atol=1e-6)
    for rank, (loss, grads, _) in enumerate(per_rank):
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"rank {rank} loss: {m}")
        for name, ref in ref_grads.items():
            assert grads[name] is not None, (rank, name)
            # (the stock TP 1 model's torch RMSNorm keeps float32 weights whatever params_dtype)
            torch.testing.assert_close(grads[name], _shard(name, ref, rank), **tol, check_dtype=False,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def readme_spec_swap_snippets():
    """The Python blocks of the README's "3. A spec swap" paragraph, as written."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("**3. A spec swap"):text.index("Or use the layers directly")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _readme_tp2(rank, world, full_params, form):
    """The README's spec-swap snippets run as written at TP 2 with sequence parallelism (no
    apex, no Transformer Engine): ``block`` runs the first (the plugin's block spec, GPTModel,
    ``swap_output_layer``); ``layer`` runs the second on megatron-core's local layer spec, then
    the first's model lines. Core attention stays megatron-core's ``DotProductAttention``, as
    in the snippet; only its default causal mask, which it makes on ``"cuda"``, is made on the
    CPU."""
    _stub_cuda_only_helpers()
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from test_specs import allreduce_sp_grads

    from megatron_flux.layers.linear import FluxColumnParallelLinear
    from megatron_flux.layers.norms import SequenceParallelRMSNorm

    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq).triu(1).bool()
    block, layer = readme_spec_swap_snippets()
    cfg = _config(world)
    ns = dict(config=cfg, vocab_size=VOCAB, seq_length=SEQ)
    torch.manual_seed(0)
    if form == "block":
        exec(block, ns)
    else:
        ns["my_layer_spec"] = get_gpt_layer_local_spec()
        exec(layer, ns)
        exec("\n".join(line for line in block.splitlines() if not line.startswith("spec =")), ns)
    model = ns["model"]
    assert isinstance(model.decoder.final_layernorm, SequenceParallelRMSNorm)
    assert isinstance(model.output_layer, FluxColumnParallelLinear)
    assert isinstance(model.decoder.layers[0].self_attention.linear_qkv, FluxColumnParallelLinear)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(full_params)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_shard(n, full_params[n], rank, world))
    loss = _run(model)
    allreduce_sp_grads(model, cfg)
    return loss, {n: p.grad for n, p in model.named_parameters()}


def test_readme_has_the_two_spec_swap_snippets():
    block, layer = readme_spec_swap_snippets()
    assert "get_gpt_decoder_block_flux_spec(config" in block and "swap_output_layer(model" in block
    assert "get_flux_final_norm(" in layer and "swap_norms(my_layer_spec" in layer


@pytest.mark.slow
@pytest.mark.parametrize("form", README_FORMS)
def test_readme_spec_swap_snippets_run_at_tp2_sp_and_match_stock_tp1(form, references, tp2_world):
    """The README's spec-swap snippets, run as written (backend ``auto``: ``nccl`` on the
    CPU), build a model that runs under sequence parallelism without apex or Transformer Engine
    (megatron-core's own final norm would refuse it) and computes stock's loss and gradients."""
    ref_loss, _, ref_grads = _value(references[README_REFERENCE], "stock TP 1")
    tol = dict(rtol=1e-5, atol=1e-6)
    for rank, (_, _, readme) in enumerate(tp2_world):
        loss, grads = _value(readme[form], f"rank {rank} README {form}")
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"rank {rank} loss: {m}")
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], _shard(name, ref, rank), **tol, check_dtype=False,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _stub_pipeline_cuda_calls():
    """megatron-core's pipeline schedule and p2p communication create small tensors with
    ``device="cuda"`` and synchronize the device; on CPU they get the CPU and no-op."""
    zeros, tensor = torch.zeros, torch.tensor

    def cpu(device):
        cuda = device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda")
        return "cpu" if cuda else device

    if getattr(zeros, "cpu_stub", False):  # stubbed already (an earlier schedule in this world)
        return
    torch.zeros = lambda *a, device=None, **k: zeros(*a, device=cpu(device), **k)
    torch.tensor = lambda *a, device=None, **k: tensor(*a, device=cpu(device), **k)
    torch.zeros.cpu_stub = torch.tensor.cpu_stub = True
    torch.cuda.synchronize = lambda *a, **k: None


def _flux_tp2_pp2(rank, world, full_params, num_layers, microbatches, virtual=1):
    """TP 2 x PP 2 (world 4): each stage builds its layers from the plugin's block spec for its
    pipeline rank (and, with ``virtual`` > 1, one model chunk per virtual stage, megatron-core's
    interleaved schedule), the last stage's output layer is converted, and megatron-core's
    schedule runs ``microbatches`` micro-batches."""
    _stub_cuda_only_helpers()
    _stub_pipeline_cuda_calls()
    from megatron.core import parallel_state
    from test_specs import allreduce_sp_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_flux import specs
    from megatron_flux.layers.linear import FluxColumnParallelLinear
    from megatron_flux.output_layer import swap_output_layer

    vpp = virtual if virtual > 1 else None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=vpp)
    try:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        cfg = _config(TP, num_layers=num_layers, pipeline_model_parallel_size=2,
                      virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float64)
        chunks, offsets = [], []
        for vp in range(virtual):
            block = specs.get_gpt_decoder_block_flux_spec(cfg, backend="nccl", pp_rank=pp_rank,
                                                          vp_stage=vp if vpp else None)
            block = _with_cpu_attention(block)
            first = pp_rank == 0 and vp == 0
            last = pp_rank == 1 and vp == virtual - 1
            torch.manual_seed(0)
            chunks.append(GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=VOCAB,
                                   max_sequence_length=SEQ, position_embedding_type="rope",
                                   share_embeddings_and_output_weights=False,
                                   pre_process=first, post_process=last,
                                   **({"vp_stage": vp} if vpp else {})))
            # this chunk's layer i is the model's layer (vp * PP + pp_rank) * per_chunk + i
            offsets.append((vp * 2 + pp_rank) * len(block.layer_specs))
        swap_output_layer(chunks, "nccl")  # a list of model chunks, as Megatron's hook gets
        if pp_rank == 1:
            assert isinstance(chunks[-1].output_layer, FluxColumnParallelLinear)

        def global_name(name, offset):
            if ".layers." not in name:
                return name
            prefix, _, rest = name.partition(".layers.")
            index, _, tail = rest.partition(".")
            return f"{prefix}.layers.{int(index) + offset}.{tail}"

        with torch.no_grad():
            for chunk, offset in zip(chunks, offsets):
                for n, p in chunk.named_parameters():
                    p.copy_(_shard(global_name(n, offset), full_params[global_name(n, offset)], tp_rank))

        def forward_step(data_iterator, model):
            ids, pos, labels = next(data_iterator)
            out = model(ids, pos, None, labels=labels)
            return out, lambda t: (t.sum(), {"loss": t.sum().detach().clone()})

        iterators = [iter(_microbatches(microbatches)) for _ in chunks]
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if vpp else iterators[0],
            model=chunks, num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=BATCH,
            forward_only=False)
        grads = {}
        for chunk, offset in zip(chunks, offsets):
            allreduce_sp_grads(chunk, cfg)
            grads.update({global_name(n, offset): p.grad for n, p in chunk.named_parameters()})
        losses = [r["loss"] for r in reduced]  # the last stage's; empty on the first
        return pp_rank, tp_rank, losses, grads
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("virtual", [1, 2], ids=["1f1b", "interleaved"])
def test_gpt_model_tp2_pp2_through_the_plugin_matches_stock_tp1(virtual, references, pp_world):
    """Pipeline parallelism: two stages of two TP ranks, 1F1B over 2 micro-batches, or two
    virtual stages each (the interleaved schedule, one layer per model chunk); every stage's
    gradients and the last stage's per-micro-batch losses against stock TP 1."""
    ref_losses, full_params, ref_grads = _value(references[PP_REFERENCE], "stock TP 1")
    per_rank = [_value(results[virtual], f"rank {rank}") for rank, results in enumerate(pp_world)]
    tol = dict(rtol=1e-5, atol=1e-6)
    seen = set()
    for pp_rank, tp_rank, losses, grads in per_rank:
        if pp_rank == 1:
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), **tol)
        else:
            assert losses == []
        for name, grad in grads.items():
            assert grad is not None, (pp_rank, tp_rank, name)
            torch.testing.assert_close(grad, _shard(name, ref_grads[name], tp_rank), **tol, check_dtype=False,
                                       msg=lambda m: f"pp {pp_rank} tp {tp_rank} {name}: {m}")
        seen |= set(grads)
    assert seen == set(ref_grads)  # the stages together hold every parameter


def _sharded_layout(entry):
    """A sharded state-dict entry as comparable data: a ShardedTensorFactory (SwiGLU's fc1) by
    the ShardedTensors it builds, a ShardedTensor by every field but its local data (whose
    shape and dtype stand in), anything else as is."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        return ("factory", _sharded_layout(entry.build()))
    if isinstance(entry, (list, tuple)):
        return [_sharded_layout(e) for e in entry]
    if isinstance(entry, dict):
        return {k: _sharded_layout(v) for k, v in entry.items()}
    if dataclasses.is_dataclass(entry):
        fields = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}
        return (type(entry).__name__, {n: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                                       for n, v in fields.items()})
    return (tuple(entry.shape), entry.dtype) if isinstance(entry, torch.Tensor) else entry


def _sharded_state_dicts(rank, world, moe):
    """This rank's sharded state-dict layout of the plugin's model and of the same model with
    megatron-core's own linears (the plugin's SP norms in both: stock torch norms refuse
    sequence parallelism)."""
    _stub_cuda_only_helpers()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_flux import specs
    from megatron_flux.output_layer import swap_output_layer

    cfg = _config(world, **(MOE if moe else {}))
    stock_block = specs.swap_norms(
        get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=None), "RMSNorm")
    flux_block = specs.get_gpt_decoder_block_flux_spec(cfg, backend="nccl")
    layouts = []
    for block, convert in ((stock_block, False), (flux_block, True)):
        block = _with_cpu_attention(block)
        model = _gpt_model(cfg, block, tie=False)
        if convert:
            swap_output_layer(model, "nccl")
        metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        layouts.append({k: _sharded_layout(v) for k, v in model.sharded_state_dict(metadata=metadata).items()})
    return layouts


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_sharded_state_dict_is_megatron_cores(moe, tp2_world):
    """A distributed checkpoint of the plugin's model has exactly the keys, global shapes,
    offsets and replica ids of megatron-core's own linears at TP 2 (MoE experts included), so
    either loads the other's checkpoint and Megatron can reshard it."""
    for rank, (_, sharded, _) in enumerate(tp2_world):
        stock, flux = _value(sharded[moe], f"rank {rank}")
        assert list(flux) == list(stock), rank
        for key in stock:
            assert flux[key] == stock[key], (rank, key)
