"""``python -m megatron_flux.tune`` = ``megatron-flux tune``; see :mod:`megatron_flux.tuning.search`."""

from megatron_flux.tuning.search import main

if __name__ == "__main__":
    import sys

    sys.exit(main())
