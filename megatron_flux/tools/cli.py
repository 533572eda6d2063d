"""The ``megatron-flux`` console script: ``megatron-flux {bench,tune,plan,check} [options]``.

A thin dispatcher so one installed entry point covers the package's tools; each subcommand
owns its own options (``megatron-flux bench --help``). Under torchrun use
``torchrun --nproc-per-node N --no-python megatron-flux bench ...``.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional, Sequence

USAGE = """usage: megatron-flux {bench,tune,plan,check} [options]

subcommands:
  bench   FLUX-style benchmark of AG+GEMM / GEMM+RS methods (run under torchrun;
          see `megatron-flux bench --help`)
  tune    per-shape search of the fused kernels' settings, with the nccl time, written
          as a tuning table (run under torchrun; see `megatron-flux tune --help`)
  plan    what the plugin runs for each TP GEMM of a model config: table entry, auto's
          choice and why, kernel settings (no GPU needed; see `megatron-flux plan --help`)
  check   what this machine offers the plugin (versions, GPUs, peer access, environment,
          tables) and whether the fused backend can run here (see `megatron-flux check --help`)
"""


def quiet_on_broken_pipe(run: Callable[[], int]) -> int:
    """``run()`` with its output flushed, or 1 when the reader of stdout went away (``... |
    head``): the rest of the output goes to ``os.devnull``, as the Python documentation advises
    for SIGPIPE, so neither a traceback nor the interpreter's own flush error follows."""
    try:
        status = run()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``); returns the process exit code."""
    return quiet_on_broken_pipe(lambda: _dispatch(argv))


def _dispatch(argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from megatron_flux.tools.bench.__main__ import main as bench_main

        return bench_main(rest)
    if cmd == "tune":
        from megatron_flux.tools.tune.search import main as tune_main

        return tune_main(rest)
    if cmd == "plan":
        from megatron_flux.tools.plan import main as plan_main

        return plan_main(rest)
    if cmd == "check":
        from megatron_flux.tools.check import main as check_main

        return check_main(rest)
    print(f"megatron-flux: unknown subcommand {cmd!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
