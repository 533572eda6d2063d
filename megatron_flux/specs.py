"""Put megatron-flux's linears and sequence-parallel norms into megatron-core layer specs.

Megatron builds models from *specs*: trees of ``ModuleSpec`` objects, ``*Submodules``
dataclasses, lists (``TransformerBlockSubmodules.layer_specs``) and, in 0.19,
``functools.partial`` builders (``partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))``,
``partial(SequentialMLP, ...)``, ``partial(MoELayer, ...)``). Leaves are classes.
Rather than re-typing Megatron's spec functions (which change every release), we take the spec
Megatron builds for its *local* implementation and rewrite its leaves:

* :func:`swap_tp_linears`: ``ColumnParallelLinear`` / ``RowParallelLinear`` →
  ``FluxColumnParallelLinear.with_backend(b)`` / ``FluxRowParallelLinear.with_backend(b)``.
* :func:`swap_norms`: megatron-core's local norms (``FusedLayerNorm``, ``WrappedTorchNorm``)
  → :class:`~megatron_flux.layers.norms.SequenceParallelLayerNorm` / ``...RMSNorm``, because
  ``WrappedTorchNorm`` (the local norm without apex) cannot run with sequence parallelism, which
  the overlap needs.
* :func:`swap_core_attention`: megatron-core's local ``DotProductAttention`` →
  :class:`~megatron_flux.layers.attention.SDPACoreAttention` (torch's fused
  scaled-dot-product attention instead of a materialised ``[b, np, s, s]`` score matrix).

The rewrite copies every container (never mutating the input, which Megatron callers may reuse)
and memoises by object identity, so an object shared by several layers (Megatron passes the same
layer spec ``num_layers`` times) is copied once and stays shared in the result.

Not rewritten, on purpose: MLA's ``linear_q_down_proj`` / ``linear_kv_down_proj`` /
``linear_qkv_down_proj`` (``MLASelfAttention`` accepts them only if they *are*
``ColumnParallelLinear``, by an identity check, in 0.16 and 0.19) and linears that are not
megatron-core's TP linears (Transformer Engine, custom subclasses), which keep their own
communication. Modules Megatron builds outside the spec are not reached either: for
``GPTModel.output_layer`` see :func:`megatron_flux.output_layer.swap_output_layer`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import warnings
from typing import Any, Callable, Dict, Optional

from megatron_flux.backends import validate_backend_name
from megatron_flux.layers.attention import SDPACoreAttention
from megatron_flux.layers.norms import (
    SequenceParallelLayerNorm,
    SequenceParallelRMSNorm,
    get_flux_norm,
)

__all__ = [
    "FluxSpecProvider",
    "get_flux_final_norm",
    "get_gpt_decoder_block_flux_spec",
    "get_gpt_layer_flux_spec",
    "swap_core_attention",
    "swap_norms",
    "swap_tp_linears",
    "validate_backend_name",
]

#: ``*Submodules`` fields that megatron-core checks by identity against ``ColumnParallelLinear``
#: (``MLASelfAttention.__init__``): a subclass there raises "Unsupported linear_..._down_proj".
IDENTITY_CHECKED_FIELDS = frozenset(
    {"linear_q_down_proj", "linear_kv_down_proj", "linear_qkv_down_proj"}
)


# --------------------------------------------------------------------------------------------
# The generic rewrite
# --------------------------------------------------------------------------------------------


def _resolve_module_path(module: Any) -> Any:
    """A ``ModuleSpec.module`` given as ``(import_path, name)`` → the object, else unchanged."""
    if (
        isinstance(module, tuple)
        and len(module) == 2
        and all(isinstance(part, str) for part in module)
    ):
        try:
            return getattr(importlib.import_module(module[0]), module[1])
        except (ImportError, AttributeError):
            return module
    return module


def _rewrite_spec(spec: Any, replace: Callable[[Any], Any]) -> Any:
    """Copy ``spec``'s containers, mapping every leaf through ``replace``.

    Containers: dataclass instances (``ModuleSpec`` and the ``*Submodules`` classes), lists,
    tuples, dicts and ``functools.partial`` (function, positional and keyword arguments).
    ``replace(leaf)`` returns the replacement or the leaf itself. Fields in
    :data:`IDENTITY_CHECKED_FIELDS` are kept as they are. A ``TransformerConfig`` (any
    ``ModelParallelConfig``) bound into a spec is a leaf, not a container: a model's modules
    share one config object, and a copy would silently split it.
    """
    from megatron.core.model_parallel_config import ModelParallelConfig

    memo: Dict[int, Any] = {}
    originals = []  # keeps walked objects alive so their ids stay unique during the walk

    def remember(obj: Any, new: Any) -> Any:
        memo[id(obj)] = new
        originals.append(obj)
        return new

    def walk(obj: Any) -> Any:
        if id(obj) in memo:
            return memo[id(obj)]
        if (
            dataclasses.is_dataclass(obj)
            and not isinstance(obj, type)
            and not isinstance(obj, ModelParallelConfig)
        ):
            new = remember(obj, copy.copy(obj))  # copy.copy skips __init__ (required fields)
            for f in dataclasses.fields(obj):
                if f.name in IDENTITY_CHECKED_FIELDS:
                    continue
                value = getattr(obj, f.name)
                if f.name == "module":  # ModuleSpec.module may be an import path
                    resolved = _resolve_module_path(value)
                    new_value = walk(resolved)
                    if new_value is resolved:
                        new_value = value
                else:
                    new_value = walk(value)
                object.__setattr__(new, f.name, new_value)
            return new
        if isinstance(obj, list):
            new = remember(obj, [])
            new.extend(walk(item) for item in obj)
            return new
        if isinstance(obj, dict):
            new = remember(obj, copy.copy(obj))  # keeps dict subclasses (defaultdict, ...)
            for key, value in obj.items():
                new[key] = walk(value)
            return new
        if isinstance(obj, tuple):
            items = [walk(item) for item in obj]
            if hasattr(obj, "_fields"):  # namedtuple
                return remember(obj, type(obj)._make(items))
            return remember(obj, type(obj)(items))
        if isinstance(obj, functools.partial):
            return remember(
                obj,
                functools.partial(
                    walk(obj.func),
                    *(walk(arg) for arg in obj.args),
                    **{key: walk(value) for key, value in obj.keywords.items()},
                ),
            )
        return remember(obj, replace(obj))

    return walk(spec)


# --------------------------------------------------------------------------------------------
# Linears
# --------------------------------------------------------------------------------------------


def _flux_linear_classes():
    """(FluxColumnParallelLinear, FluxRowParallelLinear), imported on first use."""
    from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear

    return FluxColumnParallelLinear, FluxRowParallelLinear


def swap_tp_linears(spec: Any, backend: str = "auto") -> Any:
    """A copy of ``spec`` whose megatron-core TP linears are megatron-flux's.

    Works on a layer spec (``ModuleSpec(TransformerLayer, ...)``), a block spec
    (``TransformerBlockSubmodules``), any ``*Submodules`` dataclass, or a 0.19
    ``functools.partial`` builder. Leaves that *are* ``ColumnParallelLinear`` /
    ``RowParallelLinear`` (bare, or as ``ModuleSpec.module``) become
    ``FluxColumnParallelLinear.with_backend(backend)`` / ``FluxRowParallelLinear.with_backend
    (backend)``; leaves that are already Flux linears (or subclasses of them) become
    ``leaf.with_backend(backend)``, i.e. the same class re-targeted to ``backend``. Matching is
    by identity, so other subclasses (Transformer Engine's, quantized or custom linears) are left
    alone with a warning, since their communication is not ours to replace. ``spec`` itself is
    never modified (see the module docstring for what is deliberately not rewritten).

    Args:
        spec: the spec to rewrite.
        backend: ``"auto"`` or a registered backend name (``BACKEND_CHOICES``).

    Returns:
        The rewritten copy. Warns if it contains no TP linear at all (a TE spec, say).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    validate_backend_name(backend)
    flux_col, flux_row = _flux_linear_classes()
    swapped = []
    skipped = set()

    def replace(leaf: Any) -> Any:
        if not isinstance(leaf, type):
            return leaf
        if issubclass(leaf, (flux_col, flux_row)):
            # with_backend on a class it made re-targets that class's root, so a user's own
            # Flux subclass keeps its behaviour and only changes backend.
            swapped.append(leaf)
            return leaf.with_backend(backend)
        if leaf is ColumnParallelLinear:
            swapped.append(leaf)
            return flux_col.with_backend(backend)
        if leaf is RowParallelLinear:
            swapped.append(leaf)
            return flux_row.with_backend(backend)
        if leaf.__name__.endswith("Linear") and "Grouped" not in leaf.__name__:
            skipped.add(f"{leaf.__module__}.{leaf.__qualname__}")
        return leaf

    new_spec = _rewrite_spec(spec, replace)
    if skipped:
        warnings.warn(
            "megatron-flux swap_tp_linears left these linears unchanged (not megatron-core's "
            f"Column/RowParallelLinear, so their TP communication is not overlapped): "
            f"{sorted(skipped)}",
            stacklevel=2,
        )
    if not swapped:
        warnings.warn(
            "megatron-flux swap_tp_linears found no ColumnParallelLinear/RowParallelLinear in the "
            "spec; nothing will be overlapped. Build it from megatron-core's local spec "
            "(get_gpt_layer_local_spec / --transformer-impl local).",
            stacklevel=2,
        )
    return new_spec


# --------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------


def _stock_norm_classes() -> tuple:
    """megatron-core's local-spec norms (``LNImpl`` is one of these in 0.16 and 0.19)."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return (FusedLayerNorm, WrappedTorchNorm, SequenceParallelLayerNorm, SequenceParallelRMSNorm)


def swap_norms(spec: Any, normalization: str) -> Any:
    """A copy of ``spec`` with megatron-core's local norms replaced by our SP-capable ones.

    ``FusedLayerNorm`` / ``WrappedTorchNorm`` leaves (and our own norms, re-targeted) become
    ``get_flux_norm(normalization)``. ``L2Norm`` (parameter-free) and ``IdentityOp`` stay.
    ``normalization`` must equal ``TransformerConfig.normalization`` of the model built from the
    spec; the norms check this when constructed.
    """
    norm_cls = get_flux_norm(normalization)
    stock = _stock_norm_classes()

    def replace(leaf: Any) -> Any:
        return norm_cls if isinstance(leaf, type) and leaf in stock else leaf

    return _rewrite_spec(spec, replace)


def get_flux_final_norm(normalization: str = "LayerNorm") -> type:
    """The final-norm class to put in ``TransformerBlockSubmodules.layer_norm``.

    Why: given a *layer* spec, megatron-core's ``TransformerBlock`` builds its final norm from
    its module-level ``LayerNormImpl`` (TENorm, else apex FusedLayerNorm, else
    ``WrappedTorchNorm``, which asserts under sequence parallelism), in 0.16 and 0.19. Passing a
    block spec with this class avoids that; :func:`get_gpt_decoder_block_flux_spec` does so.
    """
    return get_flux_norm(normalization)


# --------------------------------------------------------------------------------------------
# Core attention
# --------------------------------------------------------------------------------------------


def swap_core_attention(spec: Any, core_attention_cls: type = SDPACoreAttention) -> Any:
    """A copy of ``spec`` whose megatron-core ``DotProductAttention`` leaves are ``core_attention_cls``.

    Why: the local spec's ``DotProductAttention`` materialises the ``[b, np, sq, sk]`` scores
    and probabilities, which dominate a long-sequence step; :class:`~megatron_flux.layers.
    attention.SDPACoreAttention` (the default) computes the same attention with torch's fused
    kernels. Works on the same spec forms as :func:`swap_tp_linears` (layer, block,
    ``*Submodules``, 0.19 ``functools.partial`` builders), with the same copy and sharing
    semantics; ``spec`` itself is never modified. Only leaves that *are* ``DotProductAttention``
    (bare, or as ``ModuleSpec.module``, also given as an import path) are replaced, wherever
    they are (the local spec's self-attention, MLA's local spec too); subclasses and Transformer
    Engine's ``TEDotProductAttention`` are left alone, and so is everything else in the spec.

    Args:
        spec: the spec to rewrite.
        core_attention_cls: the replacement, a class with ``DotProductAttention``'s
            constructor and forward signatures; default ``SDPACoreAttention``.

    Returns:
        The rewritten copy. Warns if it contains neither ``DotProductAttention`` nor
        ``core_attention_cls`` (a TE spec, say).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    if not isinstance(core_attention_cls, type):
        raise TypeError(
            f"swap_core_attention: core_attention_cls must be a class, got {core_attention_cls!r}"
        )
    swapped = []

    def replace(leaf: Any) -> Any:
        if leaf is DotProductAttention:
            swapped.append(leaf)
            return core_attention_cls
        if leaf is core_attention_cls:
            swapped.append(leaf)  # already swapped: no "nothing replaced" warning
        return leaf

    new_spec = _rewrite_spec(spec, replace)
    if not swapped:
        warnings.warn(
            "megatron-flux swap_core_attention found no megatron-core DotProductAttention in the "
            "spec; nothing was replaced. Build it from megatron-core's local spec "
            "(get_gpt_layer_local_spec / --transformer-impl local).",
            stacklevel=2,
        )
    return new_spec


# --------------------------------------------------------------------------------------------
# GPT / Llama specs
# --------------------------------------------------------------------------------------------


def _local_spec_parameters() -> Dict[str, inspect.Parameter]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(inspect.signature(get_gpt_layer_local_spec).parameters)


def get_gpt_layer_flux_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    normalization: str = "LayerNorm",
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    backend: str = "auto",
    **local_spec_kwargs: Any,
):
    """GPT / Llama transformer-layer spec with megatron-flux linears and SP-capable norms.

    Built as: the installed megatron-core's ``get_gpt_layer_local_spec(...)`` → its norms
    replaced by :func:`swap_norms` (input, pre-MLP and, with ``qk_layernorm``, q/k norms) →
    :func:`swap_tp_linears`. Arguments mirror ``get_gpt_layer_local_spec``; any other keyword it
    accepts in the installed version (``moe_use_legacy_grouped_gemm`` in 0.16,
    ``use_kitchen_attention``, ``kitchen_attention_backend``, ...) is passed through, unknown ones
    raise ``TypeError``.

    GPT: ``normalization="LayerNorm"``. Llama-style: ``normalization="RMSNorm"``; the rest of
    Llama is ``TransformerConfig``, not spec: SwiGLU is ``gated_linear_unit=True`` with
    ``activation_func=torch.nn.functional.silu`` (``--swiglu``), no linear bias is
    ``add_bias_linear=False`` (``--disable-bias-linear``), grouped-query attention is
    ``num_query_groups < num_attention_heads`` (``--group-query-attention
    --num-query-groups``), RoPE is ``GPTModel(position_embedding_type="rope")``.
    ``config.normalization`` must equal ``normalization``.

    The final norm of ``GPTModel`` is not part of a layer spec; see :func:`get_flux_final_norm`
    and :func:`get_gpt_decoder_block_flux_spec`.

    Args:
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, qk_l2_norm:
            as in ``get_gpt_layer_local_spec``. MoE experts' and shared experts' linears are
            swapped too (experts run without TP communication inside the linear in Megatron,
            so the Flux linear takes its non-overlapped path there).
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        use_kitchen: must be False: Kitchen replaces the linears with its quantized ones, whose
            communication megatron-flux cannot take over.
        backend: ``"auto"`` or a registered backend name, for every swapped linear.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    validate_backend_name(backend)
    get_flux_norm(normalization)  # validates the name early
    if use_kitchen:
        raise ValueError(
            "get_gpt_layer_flux_spec(use_kitchen=True): Kitchen's quantized linears replace "
            "megatron-core's Column/RowParallelLinear, so there is nothing for megatron-flux "
            "to overlap; use one or the other"
        )
    accepted = _local_spec_parameters()
    unknown = sorted(set(local_spec_kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"get_gpt_layer_flux_spec got {unknown}, which the installed megatron-core's "
            f"get_gpt_layer_local_spec does not accept (it accepts {sorted(accepted)})"
        )
    kwargs = dict(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
        # None, not `normalization`: with "RMSNorm" megatron's LocalSpecProvider rebinds its
        # module-global LNImpl to WrappedTorchNorm (a process-wide side effect); we replace
        # whichever norm it picks anyway.
        normalization=None,
        qk_l2_norm=qk_l2_norm,
        **local_spec_kwargs,
    )
    if "use_kitchen" in accepted:
        kwargs["use_kitchen"] = False
    local_spec = get_gpt_layer_local_spec(**kwargs)
    return swap_tp_linears(swap_norms(local_spec, normalization), backend)


def get_gpt_decoder_block_flux_spec(
    config,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    backend: str = "auto",
):
    """Block spec (``TransformerBlockSubmodules``) for ``GPTModel(transformer_layer_spec=...)``.

    megatron-core's ``get_gpt_decoder_block_spec(config, use_transformer_engine=False, ...)``
    (this pipeline stage's layers, dense/MoE per ``config.moe_layer_freq``, pipeline layout
    honoured) with our norms, including the final norm (see :func:`get_flux_final_norm`), and
    megatron-flux linears. ``normalization`` defaults to ``config.normalization``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    validate_backend_name(backend)
    normalization = normalization or config.normalization
    if getattr(config, "use_kitchen", False):
        raise ValueError(
            "config.use_kitchen: Kitchen's quantized linears cannot be combined with megatron-flux"
        )
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=False,
        normalization=None,  # see get_gpt_layer_flux_spec
        qk_l2_norm=qk_l2_norm,
        vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    # LNImpl (the final norm and the layers' norms) is FusedLayerNorm or WrappedTorchNorm here.
    return swap_tp_linears(swap_norms(block, normalization), backend)


# --------------------------------------------------------------------------------------------
# BackendSpecProvider (megatron.core.models.backends, present in 0.16 and 0.19)
# --------------------------------------------------------------------------------------------

try:
    from megatron.core.models.backends import LocalSpecProvider as _LocalSpecProvider
except ImportError:  # older megatron-core without the provider protocol
    _LocalSpecProvider = None
    FluxSpecProvider = None
else:

    class FluxSpecProvider(_LocalSpecProvider):
        """megatron-core's ``LocalSpecProvider`` with megatron-flux linears and norms.

        For spec builders that take a ``BackendSpecProvider``
        (``get_mlp_module_spec_for_backend``, ``get_moe_module_spec_for_backend``, ...). Core
        attention and activation stay local. Transformer-Engine-only requests (``linear()``,
        i.e. ``TELinear`` in ``parallel_mode="duplicated"``) raise.
        """

        def __init__(self, backend: str = "auto"):
            self.backend = validate_backend_name(backend)

        def column_parallel_linear(self) -> type:
            """FluxColumnParallelLinear for this provider's backend."""
            return _flux_linear_classes()[0].with_backend(self.backend)

        def row_parallel_linear(self) -> type:
            """FluxRowParallelLinear for this provider's backend."""
            return _flux_linear_classes()[1].with_backend(self.backend)

        def fuse_layernorm_and_linear(self) -> bool:
            """No fused norm+linear: the norm is a separate SP-capable module."""
            return False

        def column_parallel_layer_norm_linear(self) -> Optional[type]:
            """None, as for the local provider."""
            return None

        def layer_norm(
            self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False
        ) -> type:
            """SequenceParallelRMSNorm if ``rms_norm`` else SequenceParallelLayerNorm.

            Unlike ``LocalSpecProvider.layer_norm`` this does not rebind megatron's global
            ``LNImpl``. ``has_residual`` (0.19) is accepted and has no effect.
            """
            return SequenceParallelRMSNorm if rms_norm else SequenceParallelLayerNorm

        def grouped_mlp_modules(self, *args, **kwargs):
            """The local experts builder with Flux linears (0.16 and 0.19 signatures)."""
            experts = super().grouped_mlp_modules(*args, **kwargs)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # legacy GroupedMLP has no TP linears: fine
                return swap_tp_linears(experts, self.backend)

        def linear(self) -> type:
            """Not available: ``TELinear`` (duplicated, no TP) exists only with TE."""
            raise NotImplementedError(
                "FluxSpecProvider.linear(): the spec asks for Transformer Engine's TELinear "
                "(parallel_mode='duplicated'), a TE-only feature; megatron-flux builds on the "
                "local spec. Use --transformer-impl transformer_engine without --flux-tp-overlap "
                "for this model."
            )
