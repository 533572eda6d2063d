# Based on Megatron-LM's pretrain_gpt.py (core_v0.19.0), Copyright (c) 2025 NVIDIA CORPORATION &
# AFFILIATES, Apache-2.0; trimmed to GPT/Llama pretraining (no SFT, FIM, ModelOpt, distillation,
# packed sequences) and wired to megatron-flux.
"""Pretrain a GPT or Llama-style model with Megatron (megatron.training, megatron-core 0.19).

megatron-flux adds one flag, ``--flux-tp-overlap`` (and ``--flux-backend``, ``--flux-config``,
``--flux-keep-gathered-input``), through Megatron's ``extra_args_provider``. With it on, the
model is built from megatron-flux's block spec: the column/row-parallel linears overlap their
tensor-parallel communication with the GEMM, and the norms are sequence-parallel-capable ones that
need neither apex nor Transformer Engine.

Extra argument of this script: ``--model-config configs/<model>.json`` expands to the Megatron
arguments in that file (explicit arguments override it).

Run under torchrun, e.g. (see examples/pretrain_llama.sh)::

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --model-config configs/tiny_smoke.json \\
        --tensor-model-parallel-size 2 --sequence-parallel --transformer-impl local \\
        --mock-data --tokenizer-type NullTokenizer --train-iters 20 --flux-tp-overlap

Needs Python >= 3.12 (megatron.training uses typing.override), CUDA GPUs and megatron-core 0.19
with its ``megatron.training`` package.
"""

import os
import sys
import time

_PROGRAM_START_TIME = time.time()

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import pretrain_support  # noqa: E402  (examples/pretrain_support.py)

# Megatron parses sys.argv itself: expand --model-config before it does.
sys.argv = [sys.argv[0]] + pretrain_support.expand_model_config_argv(sys.argv[1:])

import typing  # noqa: E402

if not hasattr(typing, "override"):
    sys.exit(
        "examples/pretrain_gpt.py needs Python >= 3.12: megatron.training (megatron-core 0.19) "
        f"imports typing.override; this is Python {sys.version.split()[0]}"
    )

import warnings  # noqa: E402
from functools import partial  # noqa: E402
from typing import List, Optional  # noqa: E402

if int(os.environ.get("RANK", 0)) != 0:
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import (  # noqa: E402
    GPTDataset,
    GPTDatasetConfig,
    MockGPTDataset,
)
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.package_info import __version__ as mcore_version  # noqa: E402
from megatron.core.parallel_state import get_context_parallel_group  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    StragglerDetector,
    get_batch_on_this_cp_rank,
    get_attr_wrapped_model,
    get_batch_on_this_tp_rank,
    get_torch_version,
)
from megatron.training import get_args, get_timers, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    gpt_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import (  # noqa: E402
    get_blend_and_blend_per_split,
    is_first_or_last_pipeline_stage,
)

import megatron_flux  # noqa: E402
from megatron_flux import (  # noqa: E402
    add_flux_args,
    compose_extra_args_providers,
    flux_pre_wrap_hooks,
    validate_flux_args,
)

stimer = StragglerDetector()

# get_batch returns these, in this (alphabetical) order, as upstream does.
BATCH_KEYS = ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """The micro-batch on this rank: TP rank 0 reads it and broadcasts it to the TP group."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return [None for _ in BATCH_KEYS]
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        for key in BATCH_KEYS:
            value = batch.get(key)
            batch[key] = value.cuda(non_blocking=True) if value is not None else None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=get_context_parallel_group()
    )
    return [batch.get(key) for key in BATCH_KEYS]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Sum of the masked per-token losses, the token count, and the report for logging."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    if args.check_for_nan_in_loss_and_grad:
        rerun_state_machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    return loss, num_tokens, report


def forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False):
    """Forward step: the batch, the model's per-token losses, and the loss function."""
    args = get_args()
    interleaver = pretrain_support.backend_interleaver(args)
    if interleaver is not None:  # benchmarking: this iteration's backend (see --flux-interleave-*)
        interleaver.switch(model, args.curr_iteration, print_rank_0)
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        attention_mask, labels, loss_mask, position_ids, tokens = get_batch(
            data_iterator, vp_stage
        )
    timers("batch-generator").stop()
    with stimer:
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank(vp_stage=None):
    """Datasets are built on TP rank 0 of the first and last pipeline stages."""
    return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    """GPT dataset config from the arguments (mock data needs only the tokenizer)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock (``--mock-data``) or indexed GPT datasets."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        core_gpt_dataset_config_from_args(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


# Megatron calls the provider with the dataset sizes on every rank (and builds on TP rank 0).
train_valid_test_datasets_provider.is_distributed = True


def make_pretrain_config():
    """Parse and validate the arguments; return ``(args, PretrainConfigContainer)``."""
    # megatron-flux's flags (and this script's --core-attention) join Megatron's through the
    # extra-args provider.
    args = parse_and_validate_args(
        extra_args_provider=compose_extra_args_providers(
            add_flux_args, pretrain_support.add_example_args
        ),
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    validate_flux_args(args)
    pretrain_support.backend_interleaver(args)  # a bad --flux-interleave-* fails here, not later

    # With --transformer-impl local and neither apex nor Transformer Engine installed, several
    # of Megatron's default-on fusions have no kernel: gradient accumulation fusion (apex's
    # fused_weight_gradient_mlp_cuda; megatron-flux's linears do without it, but GPTModel's
    # output layer is megatron-core's and raises), masked-softmax fusion (apex), RoPE fusion
    # (Transformer Engine) and the persistent LayerNorm (apex). Turn off whichever is missing,
    # before the model config is made from the arguments.
    for message in pretrain_support.disable_unavailable_fusions(args):
        print_rank_0(f"> {message}")
    message = pretrain_support.use_prebuilt_dataset_helpers()
    if message:
        print_rank_0(f"> {message}")

    model_cfg = gpt_config_from_args(args)
    # The spec swap: Megatron's GPT builder calls this per model chunk and gets megatron-flux's
    # block spec. Without --flux-tp-overlap: megatron-core's linears with SP-capable norms (the
    # stock local norm cannot run sequence-parallel), or None, Megatron's default spec.
    layer_spec = pretrain_support.layer_spec_hook(args)
    if layer_spec is not None:
        model_cfg.transformer_layer_spec = layer_spec
    # GPTModel builds its output layer outside any spec: with --flux-tp-overlap a pre-wrap hook
    # converts it to a Flux linear before DDP wraps the model (unless --no-flux-output-layer).
    model_cfg.pre_wrap_hooks.extend(flux_pre_wrap_hooks(args))
    if args.flux_tp_overlap:
        print_rank_0(
            f"> megatron-flux: --flux-tp-overlap on, backend {args.flux_backend}, "
            f"TP {args.tensor_model_parallel_size}, sequence parallel {args.sequence_parallel}, "
            f"core attention {args.core_attention}, output layer "
            f"{'flux' if args.flux_output_layer else 'megatron-core'}"
        )
    elif layer_spec is not None:
        print_rank_0(
            "> megatron-flux off: megatron-core's linears with sequence-parallel-capable "
            f"norms, core attention {args.core_attention}"
        )
    return args, pretrain_cfg_container_from_args(args, model_cfg)


def main() -> None:
    print_rank_0(f"> PyTorch version ................ {get_torch_version()}")
    print_rank_0(f"> Megatron-Core version .......... {mcore_version}")
    print_rank_0(f"> megatron-flux version .......... {megatron_flux.__version__}")
    _, full_config = make_pretrain_config()
    pretrain(
        full_config,
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )


if __name__ == "__main__":
    main()
