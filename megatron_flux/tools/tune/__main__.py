"""``python -m megatron_flux.tools.tune`` = ``megatron-flux tune``; see :mod:`megatron_flux.tools.tune.search`."""

from megatron_flux.tools.tune.search import main

if __name__ == "__main__":
    import sys

    sys.exit(main())
