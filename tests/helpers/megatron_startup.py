"""Run the training script's start-up, as far as it goes without GPUs, on Megatron's own code.

``python tests/helpers/megatron_startup.py MCORE_PATH CASES.json`` imports megatron-core 0.19 (with
``megatron.training``) from ``MCORE_PATH`` (an unpacked wheel). ``CASES.json`` is a list of
``{"env": {NAME: VALUE}, "argv": [...]}``, each a launcher's command as ``FLUX_DRY_RUN=1``
prints it. For each case it sets the environment, then does what ``examples/pretrain_gpt.py``
does before training: parses and validates the arguments with Megatron's
``parse_and_validate_args`` and megatron-flux's checks, turns off the fusions that need apex or
Transformer Engine, builds the model config and the pretrain config container, then builds the
learning-rate scheduler with Megatron's ``get_optimizer_param_scheduler``, whose asserts are the
ones a job meets in its first steps. Prints one JSON line per case, ``{"ok": bool, "error":
str}``, and exits 0.

``megatron.training`` needs only ``typing.override`` from Python 3.12; on an older Python it is
given a stand-in that returns its argument (what it does at run time), so CI's Python can run
this. Megatron's validation asks the GPU's architecture; without one it is told it runs on a
Hopper GPU (compute capability 9.0, 132 SMs), the GPUs the launchers are for.
"""

import json
import os
import sys
import traceback
import types
import typing

if not hasattr(typing, "override"):
    typing.override = lambda f: f

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reset_megatron_globals() -> None:
    """Forget the previous case's global arguments, tokenizer, timers and micro-batch
    calculator (Megatron refuses to set them twice in one process)."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training import global_vars

    for name in dir(global_vars):
        if name.startswith("_GLOBAL_"):
            setattr(global_vars, name, None)
    nmc.destroy_num_microbatches_calculator()


def run_case(case) -> dict:
    import torch

    os.environ.update(case["env"])
    sys.argv = ["pretrain_gpt.py", *case["argv"]]
    try:
        import pretrain_gpt
        from megatron.training.training import get_optimizer_param_scheduler

        _reset_megatron_globals()
        sys.argv = [sys.argv[0]] + pretrain_gpt.pretrain_support.expand_model_config_argv(
            sys.argv[1:])
        parsed, _config = pretrain_gpt.make_pretrain_config()
        param = torch.nn.Parameter(torch.zeros(1))
        get_optimizer_param_scheduler(torch.optim.SGD([param], lr=parsed.lr))
    except BaseException as exc:  # SystemExit from argparse included
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return {"ok": True, "error": ""}


def main(argv) -> int:
    mcore, cases_path = argv
    sys.path[:0] = [mcore, REPO, os.path.join(REPO, "examples")]
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    import torch

    if not torch.cuda.is_available():
        hopper = types.SimpleNamespace(major=9, minor=0, name="NVIDIA H200",
                                       multi_processor_count=132, total_memory=141 << 30)
        torch.cuda.get_device_properties = lambda *a, **k: hopper
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        print(json.dumps(run_case(case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
