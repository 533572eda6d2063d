"""megatron-core layers with megatron-flux behaviour.

* :mod:`.linear`: ``FluxColumnParallelLinear`` / ``FluxRowParallelLinear`` (TP communication
  hidden in the GEMMs on the sequence-parallel path).
* :mod:`.norms`: sequence-parallel-capable ``LayerNorm`` / ``RMSNorm`` in pure torch.
"""

from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear
from megatron_flux.layers.norms import SequenceParallelLayerNorm, SequenceParallelRMSNorm

__all__ = [
    "FluxColumnParallelLinear",
    "FluxRowParallelLinear",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
]
