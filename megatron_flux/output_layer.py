"""The output layer: the one tensor-parallel linear of a GPT model that no layer spec reaches.

``GPTModel`` builds ``self.output_layer`` itself, as megatron-core's ``ColumnParallelLinear``
(hidden → vocabulary / TP). With sequence parallelism its forward all-gathers the final norm's
output like every column layer of the decoder, and it is the model's largest GEMM (Llama-3-8B
at TP 2: n = 64128 per rank). :func:`swap_output_layer` turns it into
:class:`~megatron_flux.layers.linear.FluxColumnParallelLinear` in place
(:meth:`~megatron_flux.layers.linear.FluxColumnParallelLinear.convert_`): parameters (the tied
embedding weight included), ``state_dict`` keys and checkpoints stay as they are, and
``flux_backend="megatron"`` runs megatron-core's code exactly as before.

Call it after the model is built and before it is wrapped (DDP, ``Float16Module``); as Megatron's
pre-wrap hook (``GPTModelConfig.pre_wrap_hooks``, megatron-core 0.19's training builder) it takes
and returns the list of model chunks. Layers that are exactly ``ColumnParallelLinear`` are
converted; layers that already are Flux ones (an earlier call, or built as such) are re-targeted
to ``flux_backend``, as :func:`~megatron_flux.specs.swap_tp_linears` re-targets Flux linears in a
spec; other subclasses (Transformer Engine's LM head) are left alone.
"""

from __future__ import annotations

from typing import Any, List

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from megatron_flux.backends import MEGATRON_PASSTHROUGH, expect_cuda_graphs, validate_backend_name
from megatron_flux.layers.linear import FluxColumnParallelLinear

__all__ = ["swap_output_layer", "output_layers"]


def _chunks(model: Any) -> List[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def output_layers(model: Any) -> List[torch.nn.Module]:
    """Every ``output_layer`` attribute of a module in ``model`` (a module or a list of model
    chunks, wrapped or not), once each."""
    found, seen = [], set()
    for chunk in _chunks(model):
        for module in chunk.modules():
            layer = getattr(module, "output_layer", None)
            if isinstance(layer, torch.nn.Module) and id(layer) not in seen:
                seen.add(id(layer))
                found.append(layer)
    return found


def swap_output_layer(model: Any, flux_backend: str = "auto") -> Any:
    """Convert the megatron-core ``ColumnParallelLinear`` output layers in ``model`` to
    ``FluxColumnParallelLinear.with_backend(flux_backend)`` in place; returns ``model``.

    ``model``: a module or a list of model chunks (pipeline stages without an output layer have
    nothing to convert). The converted layer reads ``flux_keep_gathered_input`` and
    ``flux_gradient_accumulation_fusion`` from its ``config`` as spec-built Flux linears do.
    An output layer that already is a ``FluxColumnParallelLinear`` (or a subclass) becomes
    ``type(layer).with_backend(flux_backend)`` with ``flux_backend`` set, so calling this again
    with another backend switches it, as :func:`~megatron_flux.specs.swap_tp_linears` does for
    spec-built Flux linears; its other settings stay.
    """
    backend = validate_backend_name(flux_backend)
    for layer in output_layers(model):
        if type(layer) is ColumnParallelLinear:
            FluxColumnParallelLinear.convert_(layer, flux_backend=backend)
        elif isinstance(layer, FluxColumnParallelLinear):
            from megatron_flux.step_auto import graphs_enabled

            layer.__class__ = type(layer).with_backend(backend)
            layer.flux_backend = backend
            if backend != MEGATRON_PASSTHROUGH and graphs_enabled(layer.config):
                expect_cuda_graphs()  # as a layer built for this backend does
    return model
