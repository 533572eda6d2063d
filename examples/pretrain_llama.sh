#!/usr/bin/env bash
# Llama-3-8B-shaped pretraining (16 layers, configs/llama3_8b_16l.json) with --flux-tp-overlap,
# TP = number of local GPUs, sequence parallel, mock data. Prints loss and throughput every
# LOG_INTERVAL iterations.
#
#   bash examples/pretrain_llama.sh                        # backend auto, TRAIN_ITERS=30
#   FLUX_BACKEND=nccl bash examples/pretrain_llama.sh      # same model, reference backend
#   FLUX_TP_OVERLAP=0 bash examples/pretrain_llama.sh      # megatron-core's own linears
#   MODEL_CONFIG=configs/tiny_smoke.json bash examples/pretrain_llama.sh --train-iters 20
#
# Extra arguments go to Megatron (they override the config). Needs >= 2 NVIDIA GPUs.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
require_gpus 2
require_python
ensure_megatron
flux_megatron_args
run_pretrain "${MODEL_CONFIG:-configs/llama3_8b_16l.json}" "${FLUX_ARGS[@]}" "$@"
