"""Run tests/gpu/test_layers_gpu.py's whole-model worker on the visible GPUs, any count.

On one GPU (TP 1, sequence parallelism off) it checks only the worker's plumbing (megatron-core
0.19's GPTModel on CUDA, the converted output layer, main_grad accumulation, recomputation):
both backends then run megatron-core's own code. ``python
benchmarks/experiments/gpt_model_worker_smoke.py [--recompute]``
"""

import os
import sys

import torch

TESTS = os.path.join(os.path.dirname(__file__), "..", "..", "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "gpu")]
from helpers.gpu_harness import run_nccl_world  # noqa: E402
from test_layers_gpu import _gpt_model_worker  # noqa: E402

if __name__ == "__main__":
    checks = run_nccl_world(_gpt_model_worker, torch.cuda.device_count(), "--recompute" in sys.argv,
                            timeout=300)
    print("checks per rank:", checks)
