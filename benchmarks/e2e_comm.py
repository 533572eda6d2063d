"""TP communication per training step of a sequence-parallel transformer, timed with NCCL.

Run under torchrun on the GPUs of one TP group::

    torchrun --nproc-per-node 2 benchmarks/e2e_comm.py --tokens 4096 --hidden 4096 \\
        --layers 16 --microbatches 2 --out comm.json

With sequence parallelism every column/row-parallel pair of a layer moves one [tokens, hidden]
activation per collective. Per layer and micro-batch there are 8 of them:

* forward: all-gather before linear_qkv and linear_fc1, reduce-scatter after linear_proj and
  linear_fc2;
* backward: reduce-scatter of the input gradients of linear_qkv and linear_fc1, all-gather of
  the output gradients of linear_proj and linear_fc2.

Not counted: the re-gather of the inputs of linear_qkv and linear_fc1 (and of the output layer)
for their weight gradients (2 more all-gathers per layer and one per micro-batch). megatron-core
overlaps it with the input-gradient GEMM. megatron-flux does too beside a non-fused dgrad, but
runs it to completion before a fused one, because a concurrent collective could starve a peer's
spinning grid. It skips it with
``--flux-keep-gathered-input``. The 2026-11-22 runs used neither option.

Outside the layers, per micro-batch, two more all-gathers and two more reduce-scatters of the
same size (``--model-collectives``, default 2 of each): the embedding's reduce-scatter into the
sequence-parallel region (forward; with rotary positions, as in Llama: learned absolute
positions make megatron-core all-reduce instead) and its all-gather (backward), and the output layer's
all-gather (forward) and its input gradient's reduce-scatter (backward). ``--model-collectives 0``
leaves them out (results made before the output layer became a Flux linear did).

The step's TP communication is ``microbatches x (4 x layers + model_collectives) x
(t_all_gather + t_reduce_scatter)`` (:func:`collectives_per_microbatch`, checked against the
collectives of a real GPTModel by ``tests/unit/test_e2e_comm.py``), each collective timed alone
(interleaved trials, medians, max over ranks). This is the time the
plugin's ``nccl`` backend spends with the GPU doing nothing else; the end-to-end report divides the
step time that ``flux`` saves by it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_flux.tools.bench.timing import median, spread, time_interleaved  # noqa: E402


def collectives_per_microbatch(layers: int, model_collectives: int = 2) -> dict:
    """``{"all_gather": n, "reduce_scatter": n}`` of one micro-batch's forward and backward that
    the step's TP communication counts (re-gathers for weight gradients not included)."""
    n = 4 * layers + model_collectives
    return {"all_gather": n, "reduce_scatter": n}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, required=True, help="sequence length x micro-batch size")
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True, help="per step and TP group")
    ap.add_argument("--model-collectives", type=int, default=2,
                    help="all-gathers (and as many reduce-scatters) per micro-batch outside the "
                         "layers: the embedding's and the output layer's")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    tp, rank = dist.get_world_size(), dist.get_rank()
    if args.tokens % tp:
        raise SystemExit(f"--tokens {args.tokens} is not divisible by TP {tp}")
    dev = torch.device("cuda", local_rank)
    full = torch.randn(args.tokens, args.hidden, device=dev, dtype=torch.bfloat16)
    shard = torch.randn(args.tokens // tp, args.hidden, device=dev, dtype=torch.bfloat16)
    gathered = torch.empty_like(full)
    scattered = torch.empty_like(shard)
    fns = {
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(scattered, full),
    }
    res = time_interleaved(fns, trials=args.trials, iters=args.iters, warmup=5, group=None,
                           device=dev)
    if res.errors:
        raise SystemExit(f"collective failed: {res.errors}")
    t_ag, t_rs = median(res.trials_ms["all_gather"]), median(res.trials_ms["reduce_scatter"])
    counts = collectives_per_microbatch(args.layers, args.model_collectives)
    per_step = args.microbatches * (counts["all_gather"] * t_ag + counts["reduce_scatter"] * t_rs)
    out = {
        "tp": tp,
        "gpu": torch.cuda.get_device_name(dev),
        "tokens": args.tokens,
        "hidden": args.hidden,
        "layers": args.layers,
        "microbatches": args.microbatches,
        "collectives_per_layer_and_microbatch": {"all_gather": 4, "reduce_scatter": 4},
        "collectives_per_microbatch_outside_layers": {"all_gather": args.model_collectives,
                                                      "reduce_scatter": args.model_collectives},
        "all_gather_ms": {"median": t_ag, "spread": spread(res.trials_ms["all_gather"])},
        "reduce_scatter_ms": {"median": t_rs, "spread": spread(res.trials_ms["reduce_scatter"])},
        "tp_comm_ms_per_step": per_step,
        "trials": args.trials,
        "iters": args.iters,
    }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(json.dumps(out, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
