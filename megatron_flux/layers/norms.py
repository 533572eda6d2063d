"""Sequence-parallel-capable LayerNorm / RMSNorm in pure torch.

Why these exist: with megatron-core's *local* spec the norm is ``LNImpl``, which is apex's
``FusedLayerNorm`` when apex is installed and ``WrappedTorchNorm`` otherwise. ``WrappedTorchNorm``
asserts ``not config.sequence_parallel`` (and rejects zero-centred gamma), and ``FusedLayerNorm``
only does LayerNorm. megatron-flux's overlap needs sequence parallelism (the column layer
all-gathers a sequence-sharded input), so without these modules an RMSNorm (Llama-style) model
could not run the local spec with SP at all, and a LayerNorm one would need apex.

Sequence parallelism changes nothing in a norm's arithmetic: a norm acts on each token's hidden
vector independently, so on an ``[s/tp, b, h]`` shard it computes exactly the rows of the full
result that the rank owns. What changes is the gradient of ``weight``/``bias``: each rank only
sums over its own tokens, so the partial gradients must be summed across the tensor-parallel
group. Megatron does that in ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``
alias ``_allreduce_layernorm_grads``, 0.16 and 0.19 alike) for every parameter with
``param.sequence_parallel`` true while ``config.sequence_parallel`` is on; so, like
``FusedLayerNorm`` and TE's norms, we tag the parameters.

State-dict keys are ``weight`` (and ``bias`` for LayerNorm), as in ``FusedLayerNorm``,
``torch.nn.LayerNorm``/``RMSNorm`` and TE's norms, so checkpoints interoperate. These modules
define no ``sharded_state_dict``: megatron-core's ``sharded_state_dict_default`` then treats their
tensors as replicated across TP, exactly as it does for ``FusedLayerNorm``/``WrappedTorchNorm``,
and ``TransformerLayer``'s ``sharded_state_dict_keys_map`` applies unchanged.
"""

from __future__ import annotations

import logging
import numbers
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch.nn import init
from torch.nn.parameter import Parameter

__all__ = ["SequenceParallelLayerNorm", "SequenceParallelRMSNorm", "get_flux_norm"]

logger = logging.getLogger("megatron_flux")
_LOGGED_IGNORED: set = set()


def _params_device(config) -> torch.device:
    """Where the norm's parameters are allocated, following megatron-core's linears and TE norms.

    ``init_model_with_meta_device`` → meta; ``use_cpu_initialization`` → CPU; otherwise the
    current CUDA device. Without CUDA we allocate on CPU rather than fail, since the CPU/gloo
    path (tests, reference backend) is supported by megatron-flux.
    """
    if getattr(config, "init_model_with_meta_device", False):
        return torch.device("meta")
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _log_ignored_once(option: str, why: str) -> None:
    if option in _LOGGED_IGNORED:
        return
    _LOGGED_IGNORED.add(option)
    logger.info("megatron-flux norms: config.%s is ignored (%s)", option, why)


class _SequenceParallelNorm(torch.nn.Module):
    """Shared construction for the two norms; subclasses set ``NORMALIZATION``/``HAS_BIAS``.

    Constructor signature is megatron-core's norm signature: ``TransformerLayer``,
    ``TransformerBlock`` (final norm) and attention (q/k norms) call it with keyword arguments
    ``config``, ``hidden_size`` and ``eps`` in 0.16 (via ``build_module``) and 0.19 (directly,
    the ``LayerNormBuilder`` protocol). The trailing ``persist_layer_norm``,
    ``zero_centered_gamma`` and ``normalization`` match ``FusedLayerNorm``/``WrappedTorchNorm``
    so any caller written for those works here too.

    Args:
        config: the ``TransformerConfig``. Used: ``normalization`` (must match this class),
            ``layernorm_zero_centered_gamma``, ``sequence_parallel``, ``params_dtype``,
            ``use_cpu_initialization``, ``init_model_with_meta_device``. Ignored, with reason:
            ``persist_layer_norm`` (selects an apex kernel; no numerical effect) and
            ``memory_efficient_layer_norm`` (an apex option that saves the output instead of the
            input for backward; torch autograd saves the input plus per-token statistics, so
            memory differs, values do not). ``perform_initialization`` is not consulted: norm
            initialisation is deterministic (ones/zeros) and cheap, and leaving
            ``torch.empty`` garbage would be a trap when no checkpoint overwrites it, so, like
            ``FusedLayerNorm`` and TE's norms, we always initialise.
        hidden_size: normalised (trailing) shape, an int or a sequence of ints.
        eps: added to the variance (LayerNorm) or mean square (RMSNorm).
        persist_layer_norm: accepted for interface compatibility; ignored (see above).
        zero_centered_gamma: if true, or if ``config.layernorm_zero_centered_gamma``, the weight
            is stored centred on zero and ``1 + weight`` is applied (better bf16 resolution
            near 1, weight decay pulls towards identity).
        normalization: if given, must name this class's normalization.
    """

    NORMALIZATION: str = ""
    HAS_BIAS: bool = True

    def __init__(
        self,
        config,
        hidden_size: Union[int, Sequence[int]],
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: Optional[str] = None,
    ):
        super().__init__()
        name = type(self).__name__
        cfg_norm = getattr(config, "normalization", self.NORMALIZATION)
        if cfg_norm != self.NORMALIZATION:
            raise ValueError(
                f"{name} built with config.normalization={cfg_norm!r}: the layer spec and the "
                f"TransformerConfig disagree. Build the spec with normalization={cfg_norm!r} "
                "(e.g. get_gpt_layer_flux_spec(normalization=config.normalization))."
            )
        if normalization is not None and normalization != self.NORMALIZATION:
            raise ValueError(f"{name} cannot build normalization={normalization!r}")
        if getattr(config, "memory_efficient_layer_norm", False):
            _log_ignored_once(
                "memory_efficient_layer_norm",
                "apex-only option; torch autograd saves the norm input, values are identical",
            )
        if getattr(config, "persist_layer_norm", False) or persist_layer_norm:
            _log_ignored_once("persist_layer_norm", "apex kernel choice; no numerical effect")

        self.config = config
        if isinstance(hidden_size, numbers.Integral):
            hidden_size = (int(hidden_size),)
        self.hidden_size = torch.Size(hidden_size)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(
            zero_centered_gamma or getattr(config, "layernorm_zero_centered_gamma", False)
        )
        self.sequence_parallel = bool(config.sequence_parallel)

        factory = dict(device=_params_device(config), dtype=config.params_dtype)
        self.weight = Parameter(torch.empty(self.hidden_size, **factory))
        if self.HAS_BIAS:
            self.bias = Parameter(torch.empty(self.hidden_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

        # finalize_model_grads all-reduces these grads over TP when SP is on (see module doc).
        for param in (self.weight, self.bias):
            if param is not None:
                setattr(param, "sequence_parallel", self.sequence_parallel)

    def reset_parameters(self) -> None:
        """Identity transform: weight 1 (0 when zero-centred), bias 0."""
        if self.weight.device.type == "meta":
            return
        if self.zero_centered_gamma:
            init.zeros_(self.weight)
        else:
            init.ones_(self.weight)
        if self.bias is not None:
            init.zeros_(self.bias)

    def _affine_params(self, x: torch.Tensor):
        """Weight (``1 + weight`` if zero-centred) and bias in the input's dtype.

        Parameters and activations can differ in dtype (``fp32_residual_connection`` feeds fp32
        activations to bf16 norms); torch's norm kernels want them equal, and the cast is
        differentiable so the gradient reaches the parameter in its own dtype.
        """
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        weight = weight.to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return weight, bias

    def extra_repr(self) -> str:
        return (
            f"{tuple(self.hidden_size)}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class SequenceParallelLayerNorm(_SequenceParallelNorm):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``hidden_size``.

    Works with ``config.sequence_parallel`` on (see the module docstring for why that needs no
    communication here). Drop-in for megatron-core's ``FusedLayerNorm`` / ``WrappedTorchNorm``
    with ``config.normalization == "LayerNorm"``.
    """

    NORMALIZATION = "LayerNorm"
    HAS_BIAS = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._affine_params(x)
        return F.layer_norm(x, self.hidden_size, weight, bias, self.eps)


class SequenceParallelRMSNorm(_SequenceParallelNorm):
    """``y = x / sqrt(mean(x**2) + eps) * weight`` over the trailing ``hidden_size``; no bias.

    Works with ``config.sequence_parallel`` on. Drop-in for megatron-core's ``WrappedTorchNorm``
    with ``config.normalization == "RMSNorm"`` (which cannot run with sequence parallelism).
    ``torch.nn.functional.rms_norm`` accumulates half-precision inputs in fp32.
    """

    NORMALIZATION = "RMSNorm"
    HAS_BIAS = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self._affine_params(x)
        return F.rms_norm(x, self.hidden_size, weight, self.eps)


_NORMS = {"LayerNorm": SequenceParallelLayerNorm, "RMSNorm": SequenceParallelRMSNorm}


def get_flux_norm(normalization: str) -> type:
    """The norm class for ``normalization`` (``"LayerNorm"`` or ``"RMSNorm"``)."""
    try:
        return _NORMS[normalization]
    except KeyError:
        raise ValueError(
            f"megatron-flux has no sequence-parallel norm for normalization={normalization!r}; "
            f"choose one of {sorted(_NORMS)}"
        ) from None
