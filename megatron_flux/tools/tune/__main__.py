"""``python -m megatron_flux.tools.tune`` = ``megatron-flux tune``; see :mod:`megatron_flux.tools.tune.search`."""

from megatron_flux.tools.tune.search import main

if __name__ == "__main__":
    import sys

    from megatron_flux.tools.cli import quiet_on_broken_pipe

    sys.exit(quiet_on_broken_pipe(main))
