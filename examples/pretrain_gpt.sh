#!/usr/bin/env bash
# GPT-3-shaped pretraining (175B shapes, 4 layers, configs/gpt3_175b_4l.json) with
# --flux-tp-overlap, TP = number of local GPUs, sequence parallel, mock data.
#
#   bash examples/pretrain_gpt.sh
#   FLUX_BACKEND=nccl TRAIN_ITERS=10 bash examples/pretrain_gpt.sh
#
# Extra arguments go to Megatron (they override the config). Needs >= 2 NVIDIA GPUs.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
require_gpus 2
require_python
ensure_megatron
flux_megatron_args
run_pretrain "${MODEL_CONFIG:-configs/gpt3_175b_4l.json}" "${FLUX_ARGS[@]}" "$@"
