"""Your own model code: a Llama-style GPTModel built with megatron-core directly, using megatron-flux.

No megatron.training here: this is what a user with their own training loop writes. The two
megatron-flux lines are the spec (``get_gpt_layer_flux_spec`` for a fresh spec, or
``swap_tp_linears`` to rewrite one you already have), the final norm, which a layer spec does
not reach (``get_flux_final_norm``; without apex or Transformer Engine, megatron-core's default
final norm cannot run under sequence parallelism), and the output layer, which GPTModel builds
outside the spec (``swap_output_layer``, in place, once the model is built).

Run on GPUs, TP = number of processes, sequence parallel on::

    torchrun --nproc-per-node 2 examples/custom_model.py --steps 10 --backend flux
    torchrun --nproc-per-node 2 examples/custom_model.py --steps 10 --backend nccl
    torchrun --nproc-per-node 2 examples/custom_model.py --spec swap   # swap_tp_linears path

Each rank prints nothing but rank 0, which prints the loss of every step and the tokens/s.
Works with megatron-core 0.16 to 0.19 (Python 3.10+).
"""

from __future__ import annotations

import argparse
import os
import time

# one hardware queue, as Megatron requires for tensor parallelism on Hopper: set before CUDA
# initialises (later it has no effect), or the fused backend runs the TP group on NCCL
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_flux import (  # noqa: E402
    get_flux_final_norm,
    get_gpt_layer_flux_spec,
    swap_output_layer,
    swap_tp_linears,
)


def llama_config(tp_size: int, args: argparse.Namespace, **overrides):
    """A small Llama-style TransformerConfig: RMSNorm, SwiGLU, no biases, GQA, sequence parallel."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_query_groups,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=tp_size > 1,
        bf16=torch.cuda.is_available(),
        params_dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
        # The fusions below need apex or Transformer Engine; this example needs neither.
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def llama_block_spec(config, spec_mode: str = "flux", backend: str = "auto"):
    """The decoder spec: a layer spec with megatron-flux linears and norms, plus our final norm.

    ``spec_mode="flux"``: ``get_gpt_layer_flux_spec`` builds the Llama layer spec directly.
    ``spec_mode="swap"``: start from megatron-core's local spec (what existing user code has)
    and rewrite its linears with ``swap_tp_linears``; its norms are swapped too, since
    megatron-core's local RMSNorm (``WrappedTorchNorm``) refuses sequence parallelism.
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if spec_mode == "flux":
        layer_spec = get_gpt_layer_flux_spec(normalization="RMSNorm", backend=backend)
    elif spec_mode == "swap":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from megatron_flux import swap_norms

        layer_spec = get_gpt_layer_local_spec()
        layer_spec = swap_tp_linears(swap_norms(layer_spec, "RMSNorm"), backend=backend)
    else:
        raise ValueError(f"spec_mode {spec_mode!r}: 'flux' or 'swap'")
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * config.num_layers,
        layer_norm=get_flux_final_norm("RMSNorm"),
    )


def build_model(config, block_spec, vocab_size: int, seq_length: int):
    """The GPTModel (rotary positions, untied embeddings, as Llama)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type="rope",
        rotary_base=500000,
        share_embeddings_and_output_weights=False,
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    from megatron_flux.backends import BACKEND_CHOICES, available_backends

    backends = list(BACKEND_CHOICES) + sorted(set(available_backends()) - set(BACKEND_CHOICES))
    p.add_argument("--backend", default="auto", choices=backends,
                   help="flux_backend of every megatron-flux linear: auto (default), flux (the "
                        "fused kernels), nccl (the reference), megatron (megatron-core's own "
                        "code in the same layers)")
    p.add_argument("--spec", dest="spec_mode", choices=["flux", "swap"], default="flux")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--ffn-hidden-size", type=int, default=3584)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-query-groups", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(
            "examples/custom_model.py trains on NVIDIA GPUs (one process per GPU under torchrun, "
            "TP = number of processes, sequence parallel on); no CUDA device is visible here."
        )
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    config = llama_config(world, args)
    spec = llama_block_spec(config, args.spec_mode, args.backend)
    model = build_model(config, spec, args.vocab_size, args.seq_length)
    swap_output_layer(model, flux_backend=args.backend)  # the vocabulary GEMM, outside the spec
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    # Fixed synthetic data, the same on every TP rank (the ranks of one TP group see one batch).
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, args.vocab_size, (b, s + 1), device="cuda", generator=gen)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(s, device="cuda").unsqueeze(0).expand(b, s)

    tp_group = parallel_state.get_tensor_model_parallel_group()
    for step in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        # With labels, GPTModel returns the per-token loss [b, s] (vocab-parallel cross entropy).
        loss = model(inputs, position_ids, attention_mask=None, labels=labels).float().mean()
        loss.backward()
        # Sequence parallelism leaves the norms' gradients partial per rank: sum them over TP
        # (what Megatron's finalize_model_grads does for params tagged sequence_parallel).
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=tp_group)
        optimizer.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(
                f"step {step + 1:3d}  loss {loss.item():.4f}  {elapsed * 1e3:8.1f} ms  "
                f"{b * s / elapsed:10.0f} tokens/s",
                flush=True,
            )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
