"""``python -m megatron_flux.tuning`` = ``megatron-flux tune``."""

import sys

from megatron_flux.tuning.search import main

sys.exit(main())
