"""The ``megatron-flux`` console script: ``megatron-flux {bench,tune} [options]``.

A thin dispatcher so one installed entry point covers the package's tools; each subcommand
owns its own options (``megatron-flux bench --help``). Under torchrun use
``torchrun --nproc-per-node N --no-python megatron-flux bench ...``.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

USAGE = """usage: megatron-flux {bench,tune} [options]

subcommands:
  bench   FLUX-style benchmark of AG+GEMM / GEMM+RS methods (run under torchrun;
          see `megatron-flux bench --help`)
  tune    tile-configuration tuner for the fused kernels (not available yet)
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``); returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr, end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        from megatron_flux.bench.__main__ import main as bench_main

        return bench_main(rest)
    if cmd == "tune":
        print("megatron-flux tune: not available yet — the kernel tuner has not been written. "
              "Use `megatron-flux bench` to measure the current configuration.", file=sys.stderr)
        return 2
    print(f"megatron-flux: unknown subcommand {cmd!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
