"""megatron-core layers with megatron-flux behaviour.

* :mod:`.linear`: ``FluxColumnParallelLinear`` / ``FluxRowParallelLinear`` (TP communication
  hidden in the GEMMs on the sequence-parallel path).
* :mod:`.norms`: sequence-parallel-capable ``LayerNorm`` / ``RMSNorm`` in pure torch.
* :mod:`.attention`: ``SDPACoreAttention``, the local spec's ``DotProductAttention`` on
  ``torch.nn.functional.scaled_dot_product_attention`` (no ``[b, np, s, s]`` score matrix).
"""

from megatron_flux.layers.attention import SDPACoreAttention
from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear
from megatron_flux.layers.norms import SequenceParallelLayerNorm, SequenceParallelRMSNorm

__all__ = [
    "FluxColumnParallelLinear",
    "FluxRowParallelLinear",
    "SDPACoreAttention",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
]
