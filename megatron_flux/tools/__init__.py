"""The edge: what people run, never what a training step imports.

* :mod:`.cli`          the ``megatron-flux`` console script (``bench``, ``tune``, ``plan``, ``check``)
* :mod:`.check`        ``megatron-flux check``: what this machine offers the plugin
* :mod:`.plan`         ``megatron-flux plan``: what runs for each TP GEMM of a model config
* :mod:`.model_shapes` a model config's TP GEMMs per rank, as the tuning tables key them
* :mod:`.bench`        ``megatron-flux bench``: the FLUX-style op benchmark (torchrun)
* :mod:`.tune`         ``megatron-flux tune``: the GPU tuner, and the tools that write tables
                       (from a benchmark, confirm, adopt an A/B)
* :mod:`.diagnostics`  one-GPU research tools: the fused kernels against cuBLAS with
                       communication off, GEMM+RS phase timing, the plain persistent GEMM

The runtime (layers, ops, backends, kernels, comm, tuning) never imports this package;
``tests/unit/test_import_layers.py`` holds it to that.
"""
