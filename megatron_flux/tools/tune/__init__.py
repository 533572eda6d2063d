"""Tools that write tuning tables (the runtime only reads them: :mod:`megatron_flux.tuning`).

* :mod:`.search`     the GPU tuner behind ``megatron-flux tune`` (candidates, checking, timing)
* :mod:`.progress`   its progress bar
* :mod:`.from_bench` a table from a benchmark JSON (untuned configs, measured times)
* :mod:`.confirm`    a tuned table's times checked against independent benchmark runs
* :mod:`.adopt`      a knob adopted where interleaved A/B benchmarks timed it faster

``python -m megatron_flux.tools.tune`` = ``megatron-flux tune``.
"""
