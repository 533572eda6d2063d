"""megatron-flux: tensor-parallel communication hidden inside the GEMMs that need it.

Public API (imported lazily so ``import megatron_flux`` stays cheap):

* :class:`FluxColumnParallelLinear`, :class:`FluxRowParallelLinear`: drop-in subclasses of
  megatron-core's Column/RowParallelLinear.
* :func:`swap_tp_linears`, :func:`get_gpt_layer_flux_spec`: put them into Megatron layer specs.
* :func:`swap_output_layer`: GPTModel's output layer (built outside the spec) converted in place.
* :class:`SDPACoreAttention`, :func:`swap_core_attention`: megatron-core's local
  ``DotProductAttention`` on torch's fused scaled-dot-product attention, and its spec swap.
* :func:`add_flux_args`: Megatron ``extra_args_provider`` adding ``--flux-tp-overlap`` & co.
* :func:`register_backend`, :func:`get_backend`: the backend registry.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "FluxColumnParallelLinear": "megatron_flux.layers.linear",
    "FluxRowParallelLinear": "megatron_flux.layers.linear",
    "SequenceParallelLayerNorm": "megatron_flux.layers.norms",
    "SequenceParallelRMSNorm": "megatron_flux.layers.norms",
    "SDPACoreAttention": "megatron_flux.layers.attention",
    "swap_tp_linears": "megatron_flux.specs",
    "get_gpt_layer_flux_spec": "megatron_flux.specs",
    "get_gpt_decoder_block_flux_spec": "megatron_flux.specs",
    "get_flux_final_norm": "megatron_flux.specs",
    "swap_norms": "megatron_flux.specs",
    "swap_core_attention": "megatron_flux.specs",
    "FluxSpecProvider": "megatron_flux.specs",
    "swap_output_layer": "megatron_flux.output_layer",
    "add_flux_args": "megatron_flux.arguments",
    "flux_pre_wrap_hooks": "megatron_flux.arguments",
    "validate_flux_args": "megatron_flux.arguments",
    "flux_spec_from_args": "megatron_flux.arguments",
    "compose_extra_args_providers": "megatron_flux.arguments",
    "apply_flux_args_to_config": "megatron_flux.arguments",
    "load_flux_config": "megatron_flux.arguments",
    "register_backend": "megatron_flux.backends",
    "get_backend": "megatron_flux.backends",
    "available_backends": "megatron_flux.backends",
    "resolve_backend": "megatron_flux.backends",
    "validate_backend_name": "megatron_flux.backends",
    "TPOverlapBackend": "megatron_flux.backends.base",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron_flux' has no attribute {name!r}")


def __dir__():
    return __all__
