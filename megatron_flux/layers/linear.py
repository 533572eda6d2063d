"""``FluxColumnParallelLinear`` / ``FluxRowParallelLinear``: megatron-core's TP linears, overlapped.

They are subclasses, not copies, of megatron-core's ``ColumnParallelLinear`` and
``RowParallelLinear`` (0.16 and 0.19): construction, parameters and their attributes,
``state_dict`` keys, ``sharded_state_dict`` and every code path other than the
sequence-parallel one are the parent's, so checkpoints move between stock and Flux layers both
ways and a model behaves exactly as stock wherever there is nothing to overlap (TP=1, sequence
parallelism off, experts with explicit communication).

With sequence parallelism on and TP > 1 the matmul runs through :mod:`megatron_flux.ops`
(all-gather + GEMM for the column layer, GEMM + reduce-scatter for the row layer, and their
backward twins) on the backend named by ``flux_backend``. That path also runs on CPU/gloo,
which the stock one cannot (it allocates on ``torch.cuda.current_device()``).

Differences from stock, each deliberate:

* ``config.gradient_accumulation_fusion`` works without apex: the accumulation into
  ``weight.main_grad`` falls back to torch (stock raises at construction), one fp32-output GEMM
  on CUDA (:mod:`megatron_flux.ops.grad_accumulation`). ``config.flux_gradient_accumulation_fusion``
  (``--flux-gradient-accumulation-fusion``) turns it on for the sequence-parallel path alone,
  where megatron's flag must stay off because megatron-core's own modules (GPTModel's output
  layer) would need apex.
* ``gather_output`` on the sequence-parallel path uses a device-agnostic gather.
* The row layer adds its bias inside the backend's reduce-scatter (``RS(X Wᵀ) + b``, the same
  value as stock's ``RS(X Wᵀ)`` then ``+ b``).

* The column layer keeps its all-gathered input for the weight gradient by default
  (``flux_keep_gathered_input``), where stock gathers it a second time in backward.
* A column layer whose ``output_dtype`` (megatron-core after 0.19: fp32 logits with
  ``--output-logit-dtype fp32``) differs from its input's dtype runs megatron-core's own
  sequence-parallel matmul, which computes the GEMM's output in that dtype; megatron-flux's ops
  produce the input's dtype. The torch fallback for gradient accumulation without apex computes
  that dtype itself.

``flux_backend="megatron"`` turns all of that off: the layer runs its parent's code, exactly as
stock megatron-core would. ``flux_backend`` is read on every forward (and checked when set), so
a job can switch one model between ``megatron``, ``nccl``, ``flux`` and ``auto`` between
iterations (:mod:`megatron_flux.step_auto`, ``--flux-interleave-backends``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Dict, Optional, Tuple

import torch
from megatron.core.tensor_parallel import layers as _mcore_layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_flux.backends import MEGATRON_PASSTHROUGH, expect_cuda_graphs, validate_backend_name
from megatron_flux.backends.registry import log_once
from megatron_flux.ops import (
    LinearWithMainGradAccumulation,
    column_parallel_linear,
    fused_wgrad_kernel,
    gather_along_last_dim,
    row_parallel_linear,
)

__all__ = ["FluxColumnParallelLinear", "FluxRowParallelLinear"]

#: constructor arguments that only some supported megatron-core versions take (0.19 added
#: ``name``); dropped when the installed parent does not accept them. Anything else unknown is
#: passed on so the parent raises its usual ``TypeError``.
_VERSION_SPECIFIC_ARGS = frozenset({"name"})


def _parent_params(parent: type) -> frozenset:
    return frozenset(inspect.signature(parent.__init__).parameters)


@contextlib.contextmanager
def _without_grad_accumulation_fusion(config, hide: bool):
    """Hide ``config.gradient_accumulation_fusion`` while the parent constructs.

    Stock ``ColumnParallelLinear.__init__`` raises when the flag is on and apex's
    ``fused_weight_gradient_mlp_cuda`` is missing; megatron-flux accumulates in torch then. The
    config object is shared by every layer of the model, so it is restored even on error.
    """
    if not hide:
        yield
        return
    config.gradient_accumulation_fusion = False
    try:
        yield
    finally:
        config.gradient_accumulation_fusion = True


def _other_output_dtype(input: torch.Tensor, kwargs: dict) -> bool:
    """Whether a ``_forward_impl`` call asks for an output dtype other than its input's
    (megatron-core after 0.19 passes ``output_dtype``; earlier versions never do)."""
    output_dtype = kwargs.get("output_dtype")
    return output_dtype is not None and output_dtype != input.dtype


def _mark_activation_offloading(config, input_: torch.Tensor) -> None:
    """What the parents' forward does to its input inside megatron's CPU-offloading context."""
    ctx = getattr(config, "_cpu_offloading_context", None)
    if ctx is None or ctx.inside_context is not True:
        return
    if not _mcore_layers.HAVE_TE:
        assert config.cpu_offloading is False, "CPU Offloading cannot be enabled while TE is not present"
    else:
        input_.activation_offloading = config.cpu_offloading_activations


class _FluxLinearMixin:
    """Construction, backend selection and the apex-free fallback shared by both layers."""

    @property
    def flux_backend(self) -> str:
        """``"auto"``, ``"megatron"`` or a registered backend name; a misspelt one raises when
        set. It decides only where this layer runs megatron-flux's sequence-parallel ops
        (:meth:`_uses_flux_ops`); elsewhere the layer runs its parent's code whatever it says."""
        return self._flux_backend

    @flux_backend.setter
    def flux_backend(self, name: str) -> None:
        self._flux_backend = validate_backend_name(name)

    #: the megatron-core class this layer extends (set by the concrete classes)
    _megatron_parent: type = torch.nn.Module
    #: in classes made by :meth:`with_backend`: the class they were made from
    _flux_root: Optional[type] = None

    def __init__(self, input_size: int, output_size: int, *, flux_backend: str = "auto", **kwargs):
        backend = validate_backend_name(flux_backend)
        parent_params = _parent_params(self._megatron_parent)
        kwargs = {
            k: v for k, v in kwargs.items() if k in parent_params or k not in _VERSION_SPECIFIC_ARGS
        }
        config = kwargs.get("config")
        gaf = bool(getattr(config, "gradient_accumulation_fusion", False))
        no_apex = gaf and fused_wgrad_kernel() is None
        if no_apex and getattr(config, "defer_embedding_wgrad_compute", False):
            raise RuntimeError(
                f"{type(self).__name__}: defer_embedding_wgrad_compute needs apex's "
                "fused_weight_gradient_mlp_cuda (megatron's drain_embedding_wgrad_compute "
                "imports it); install apex or turn the deferral off"
            )
        with _without_grad_accumulation_fusion(config, no_apex):
            super().__init__(input_size, output_size, **kwargs)
        self._init_flux(gaf, backend)

    def _init_flux(self, gaf: bool, backend: str) -> None:
        """The attributes megatron-flux adds to a constructed megatron-core layer (also what
        :meth:`convert_` sets on one built by megatron-core)."""
        # megatron-core's own code paths (flux_backend="megatron", SP off) read this one
        self.gradient_accumulation_fusion = gaf
        # megatron-flux's sequence-parallel ops read this one: also on where megatron's is off
        # only because apex is missing (config.flux_gradient_accumulation_fusion)
        self.flux_gradient_accumulation_fusion = gaf or bool(
            getattr(self.config, "flux_gradient_accumulation_fusion", False))
        self.flux_backend = backend
        from megatron_flux.step_auto import graphs_enabled

        if backend != MEGATRON_PASSTHROUGH and graphs_enabled(self.config):
            expect_cuda_graphs()  # the eager iterations before the capture reserve for it

    @classmethod
    def convert_(cls, layer: torch.nn.Module, flux_backend: str = "auto", **flux_kwargs) -> torch.nn.Module:
        """Turn ``layer``, built by megatron-core as exactly this class's parent, into this class
        in place (for modules no spec reaches, e.g. ``GPTModel.output_layer``) and return it.

        Parameters, buffers, hooks and ``state_dict`` keys stay as they are: only the class
        changes and megatron-flux's attributes are added, as the constructor would have set
        them for ``layer.config``. The class is ``cls.with_backend(flux_backend)``, the one a
        spec would hold. A layer of any other class (a subclass, Transformer Engine's, already
        a Flux one) raises ``TypeError``.
        """
        root = cls.__dict__.get("_flux_root") or cls
        if type(layer) is not root._megatron_parent:
            raise TypeError(
                f"{root.__name__}.convert_: expected megatron-core's "
                f"{root._megatron_parent.__name__}, got {type(layer).__module__}."
                f"{type(layer).__qualname__}")
        backend = validate_backend_name(flux_backend)
        layer.__class__ = root.with_backend(backend)
        layer._init_flux(bool(getattr(layer, "gradient_accumulation_fusion", False)), backend,
                         **flux_kwargs)
        return layer

    # ----------------------------------------------------------------------- spec integration
    @classmethod
    def with_backend(cls, name: str) -> type:
        """A subclass whose constructor defaults ``flux_backend`` to ``name`` (cached).

        Megatron specs hold classes, not instances, so this is how a spec selects a backend.
        The same class object is returned for the same ``(cls, name)``; calling it on a class it
        made re-targets the original class. The class is reachable as
        ``megatron_flux.layers.linear.<Base>_<name>``, so modules and specs holding it pickle.
        """
        root = cls.__dict__.get("_flux_root") or cls
        name = validate_backend_name(name)
        key = (root, name)
        if key not in _WITH_BACKEND:
            class_name = f"{root.__name__}_{name}"
            _WITH_BACKEND[key] = type(
                class_name,
                (root,),
                {
                    "__init__": functools.partialmethod(root.__init__, flux_backend=name),
                    "__module__": root.__module__,
                    "__qualname__": class_name,
                    "__doc__": f"{root.__name__} with ``flux_backend={name!r}`` by default.",
                    "_flux_root": root,
                },
            )
        return _WITH_BACKEND[key]

    # ---------------------------------------------------------------------- non-SP fallback
    def _forward_impl(self, input, weight, *args, **kwargs):
        """Megatron's matmul, except where it cannot run without apex.

        With ``gradient_accumulation_fusion`` on and apex's kernel unusable (not installed, or
        CPU tensors) megatron's function would fail in backward on the missing extension; the
        torch equivalent runs instead. Only non-sequence-parallel calls reach here (the SP path
        of both layers goes through :mod:`megatron_flux.ops`).
        """
        if (
            kwargs.get("gradient_accumulation_fusion")
            and weight.requires_grad
            and kwargs.get("gtp_remat_size", 1) <= 1
            and (fused_wgrad_kernel() is None or not weight.is_cuda)
        ):
            if kwargs.get("sequence_parallel"):
                other_backend = ", or use flux_backend 'nccl'/'flux'/'auto'"
                if self.flux_backend == MEGATRON_PASSTHROUGH:
                    why = "flux_backend='megatron' runs megatron-core's own sequence-parallel matmul"
                elif _other_output_dtype(input, kwargs):
                    why = (f"output_dtype={kwargs['output_dtype']} (inputs {input.dtype}) runs "
                           "megatron-core's own sequence-parallel matmul")
                    other_backend = ""  # every backend takes megatron-core's path there
                else:
                    why = "the sequence-parallel matmul with wgrad deferral is megatron-core's"
                raise RuntimeError(
                    f"megatron-flux {type(self).__name__}: {why}, which needs apex's "
                    "fused_weight_gradient_mlp_cuda for gradient_accumulation_fusion; install "
                    f"apex or turn the fusion off{other_backend}"
                )
            return LinearWithMainGradAccumulation.apply(
                input, weight, kwargs.get("bias"), kwargs.get("allreduce_dgrad", False),
                kwargs.get("tp_group"), kwargs.get("output_dtype"),
            )
        return super()._forward_impl(input, weight, *args, **kwargs)

    def _uses_flux_ops(self) -> bool:
        """Whether this layer's matmul goes through megatron-flux's sequence-parallel ops."""
        return (
            self.flux_backend != MEGATRON_PASSTHROUGH
            and bool(self.sequence_parallel)
            and self.tp_group.size() > 1
            and not self.explicit_expert_comm
            and getattr(self, "gtp_remat_size", 1) <= 1
        )


_WITH_BACKEND: Dict[Tuple[type, str], type] = {}


class FluxColumnParallelLinear(_FluxLinearMixin, ColumnParallelLinear):
    """megatron-core ``ColumnParallelLinear`` whose sequence-parallel all-gather hides in the GEMM.

    Args: every argument of the installed ``ColumnParallelLinear`` (0.19's ``name`` is accepted
    and dropped on 0.16), plus

        flux_backend: ``"auto"`` (the fused backend when it supports the operands, else the
            ``nccl`` reference), a registered backend name, or ``"megatron"`` (the parent's
            own code, for A/B comparisons in one model).
        flux_keep_gathered_input: keep the forward's all-gathered input for the weight gradient
            instead of re-gathering it in backward as megatron does. Trades ``tp - 1`` extra
            activation shards per layer for one collective and its host time. ``None`` reads
            ``config.flux_keep_gathered_input`` (absent → ``True``).
    """

    _megatron_parent = ColumnParallelLinear

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        flux_backend: str = "auto",
        flux_keep_gathered_input: Optional[bool] = None,
        **kwargs,
    ):
        super().__init__(input_size, output_size, flux_backend=flux_backend, **kwargs)
        if flux_keep_gathered_input is not None:
            self.flux_keep_gathered_input = bool(flux_keep_gathered_input)

    def _init_flux(self, gaf: bool, backend: str,
                   flux_keep_gathered_input: Optional[bool] = None) -> None:
        super()._init_flux(gaf, backend)
        if flux_keep_gathered_input is None:
            flux_keep_gathered_input = getattr(self.config, "flux_keep_gathered_input", True)
        self.flux_keep_gathered_input = bool(flux_keep_gathered_input)

    def _uses_flux_ops(self) -> bool:
        # Wgrad deferral (megatron's output-layer trick) stays megatron's: its buffers are
        # drained by megatron's own pipeline code.
        return super()._uses_flux_ops() and not self.config.defer_embedding_wgrad_compute

    def _forward_impl(self, input, weight, *args, **kwargs):
        if (
            kwargs.get("sequence_parallel")
            and self.flux_backend != MEGATRON_PASSTHROUGH
            and kwargs.get("grad_output_buffer") is None
            and kwargs.get("gtp_remat_size", 1) <= 1
        ):
            if _other_output_dtype(input, kwargs):
                # megatron-core after 0.19 passes output_dtype (fp32 logits): its own matmul
                # computes the GEMM's output in that dtype, megatron-flux's ops in the input's
                log_once(
                    f"output_dtype:{kwargs['output_dtype']}:{input.dtype}",
                    f"megatron-flux: a {type(self).__name__} asks for output_dtype="
                    f"{kwargs['output_dtype']} from {input.dtype} inputs; megatron-flux's ops "
                    "produce the input dtype, so it runs megatron-core's own sequence-parallel "
                    "matmul (not overlapped)",
                )
                return super()._forward_impl(input, weight, *args, **kwargs)
            return column_parallel_linear(
                input,
                weight,
                kwargs.get("bias"),
                group=self.tp_group,
                backend=self.flux_backend,
                keep_gathered_input=self.flux_keep_gathered_input,
                gradient_accumulation_fusion=bool(kwargs.get("gradient_accumulation_fusion"))
                or self.flux_gradient_accumulation_fusion,
            )
        return super()._forward_impl(input, weight, *args, **kwargs)

    def forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The parent's forward; on the sequence-parallel path its matmul (``_forward_impl``)
        is megatron-flux's all-gather + GEMM and ``gather_output`` is device-agnostic."""
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        # 0.19's inference-optimized gather (eval only) is left to the parent.
        inference_gather = getattr(self, "use_inference_optimized_all_gather", False)
        if not (self._uses_flux_ops() and gather) or (inference_gather and not self.training):
            return super().forward(input_, weight, runtime_gather_output)
        output_parallel, output_bias = super().forward(input_, weight, runtime_gather_output=False)
        return gather_along_last_dim(output_parallel, self.tp_group), output_bias


class FluxRowParallelLinear(_FluxLinearMixin, RowParallelLinear):
    """megatron-core ``RowParallelLinear`` whose sequence-parallel reduce-scatter hides in the GEMM.

    Args: every argument of the installed ``RowParallelLinear`` (0.19's ``name`` is accepted
    and dropped on 0.16), plus ``flux_backend`` as for :class:`FluxColumnParallelLinear`.
    """

    _megatron_parent = RowParallelLinear

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``RS(input_ @ Wᵀ) (+ b)`` on the sequence-parallel path, else the parent's forward."""
        if not self._uses_flux_ops():
            return super().forward(input_)
        _mark_activation_offloading(self.config, input_)
        output = row_parallel_linear(
            input_,
            self.weight,
            None if self.skip_bias_add else self.bias,
            group=self.tp_group,
            backend=self.flux_backend,
            gradient_accumulation_fusion=self.flux_gradient_accumulation_fusion,
        )
        return output, (self.bias if self.skip_bias_add else None)


def __getattr__(name: str) -> type:
    """Resolve ``<Base>_<backend>`` to ``Base.with_backend(backend)`` (unpickling in a process
    that has not built that class yet)."""
    for base in (FluxColumnParallelLinear, FluxRowParallelLinear):
        prefix = base.__name__ + "_"
        if name.startswith(prefix):
            try:
                return base.with_backend(name[len(prefix):])
            except ValueError as exc:
                raise AttributeError(f"module {__name__!r} has no attribute {name!r} ({exc})") from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
