"""Megatron command-line integration: ``--flux-*`` flags, their validation, and spec selection.

Megatron's training entry points take an ``extra_args_provider(parser) -> parser``;
:func:`add_flux_args` is one, and :func:`compose_extra_args_providers` chains it with a script's
own. After Megatron has parsed and validated its arguments, call :func:`validate_flux_args`, then
build the model with the spec from :func:`flux_spec_from_args` (``None`` means "flux is off, use
your stock spec").
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any, Callable, Optional

from megatron_flux.backends.registry import BACKEND_CHOICES, MEGATRON_PASSTHROUGH
from megatron_flux.options import (
    COLUMN_DGRAD_CHOICES,
    COLUMN_REGATHER_CHOICES,
    FluxOptions,
    get_options,
    set_options,
)

__all__ = [
    "FluxArgumentError",
    "add_flux_args",
    "apply_flux_args_to_config",
    "compose_extra_args_providers",
    "flux_pre_wrap_hooks",
    "flux_spec_from_args",
    "load_flux_config",
    "validate_flux_args",
]

GROUP_TITLE = "megatron-flux"


class FluxArgumentError(ValueError):
    """An invalid combination of ``--flux-*`` and Megatron arguments."""


def add_flux_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "megatron-flux" argument group to ``parser`` and return it.

    Usable directly as Megatron's ``extra_args_provider``.
    """
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument(
        "--flux-tp-overlap",
        action="store_true",
        help="Overlap tensor-parallel communication with the GEMMs of the column/row-parallel "
        "linears (all-gather+GEMM, GEMM+reduce-scatter). Needs --sequence-parallel; a no-op "
        "(with a warning) at --tensor-model-parallel-size 1.",
    )
    group.add_argument(
        "--flux-backend",
        choices=BACKEND_CHOICES,
        default="auto",
        help="Backend for the overlapped ops: 'flux' (fused Triton kernels over symmetric "
        "memory), 'nccl' (reference collectives + matmul, no overlap), 'auto' (flux where "
        "it supports the operands and the tuning table says it wins, nccl otherwise), or "
        "'megatron' (megatron-core's own code inside the same layers: an A/B baseline).",
    )
    group.add_argument(
        "--flux-step-auto",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With --flux-backend auto (the default), time the candidate backends ('megatron': "
        "megatron-core's own code; 'nccl'; 'auto': the fused kernels where the tuning tables "
        "say they win; 'flux': the fused kernels everywhere) in the job's first iterations and "
        "keep the fastest for the rest of the job (about 83 iterations; one log line says what "
        "was chosen and why). "
        "--no-flux-step-auto keeps the per-op choice from the tables. Off under CUDA graphs.",
    )
    group.add_argument(
        "--flux-config",
        metavar="PATH",
        default=None,
        help="Tuning table for the fused kernels (JSON written by `megatron-flux tune`): per-shape "
        "kernel configs, and where 'auto' uses nccl. Takes precedence over the tables shipped "
        "with megatron-flux (and $MEGATRON_FLUX_CONFIG). Fully validated with --flux-tp-overlap; "
        "an error names the file and the field.",
    )
    # Named after FluxColumnParallelLinear's `flux_keep_gathered_input` (read from the config,
    # see apply_flux_args_to_config).
    group.add_argument(
        "--flux-keep-gathered-input",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Column-parallel layers keep the all-gathered input from forward for the weight "
        "gradient (the default) instead of re-gathering it in backward as megatron-core does "
        "(--no-flux-keep-gathered-input). Keeping it saves a collective and its host time per "
        "column layer and backward; it costs, per column layer (QKV, FC1), the full-sequence "
        "input instead of this rank's shard: (tp-1)/tp x seq x micro-batch x hidden x 2 bytes "
        "of extra activation memory, held until that layer's backward.",
    )
    # Named after the layers' `flux_gradient_accumulation_fusion` (read from the config, see
    # apply_flux_args_to_config).
    group.add_argument(
        "--flux-gradient-accumulation-fusion",
        action="store_true",
        help="megatron-flux's linears accumulate their weight gradients straight into "
        "main_grad (megatron's gradient accumulation fusion, one fp32-output GEMM, no apex "
        "needed) also when Megatron's --gradient-accumulation-fusion is off, as it must be "
        "without apex for megatron-core's own output layer. Megatron-core's modules keep "
        "Megatron's setting.",
    )
    group.add_argument(
        "--no-flux-output-layer",
        dest="flux_output_layer",
        action="store_false",
        help="With --flux-tp-overlap, keep GPTModel's output layer as megatron-core built it "
        "(its all-gather then the GEMM). By default it becomes a FluxColumnParallelLinear too "
        "(in place, before DDP wraps the model; parameters and checkpoints unchanged): no spec "
        "reaches it, and it is the model's largest column-parallel GEMM.",
    )
    group.add_argument(
        "--flux-column-dgrad",
        choices=COLUMN_DGRAD_CHOICES,
        default=None,
        help="How the fused backend runs a column-parallel layer's input gradient, whose "
        "reduce-scatter megatron-core already overlaps with the weight-gradient GEMM: 'nccl' "
        "(the default: cuBLAS, then NCCL's reduce-scatter beside the wgrad, as megatron-core "
        "does), 'fused' (the GEMM+reduce-scatter kernel), 'copy_engine' (cuBLAS, the copy "
        "engine moving the peers' rows beside the wgrad, then a reduction kernel). Default: "
        "$MEGATRON_FLUX_COLUMN_DGRAD, else 'nccl'.",
    )
    group.add_argument(
        "--flux-column-regather",
        choices=COLUMN_REGATHER_CHOICES,
        default=None,
        help="How the fused backend re-gathers a column-parallel layer's input for the weight "
        "gradient (with --no-flux-keep-gathered-input): 'nccl' (NCCL's asynchronous "
        "all-gather, as megatron-core does) or 'copy_engine' (pushes into the peers' symmetric "
        "buffers, no SMs taken from the dgrad, but a bounded wait on the compute stream). "
        "Default: $MEGATRON_FLUX_COLUMN_REGATHER, else 'nccl'.",
    )
    return parser


def compose_extra_args_providers(
    *providers: Optional[Callable[[argparse.ArgumentParser], Any]],
) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """One ``extra_args_provider`` that runs ``providers`` in order (``None`` entries skipped).

    Each provider gets the parser returned by the previous one; a provider that returns
    ``None`` (a common slip) keeps the parser it was given.
    """

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for extra in providers:
            if extra is None:
                continue
            result = extra(parser)
            parser = parser if result is None else result
        return parser

    return provider


def load_flux_config(path: str) -> dict:
    """The tuning table at ``path``: must exist and hold a JSON object."""
    if not os.path.isfile(path):
        raise FluxArgumentError(f"--flux-config {path!r}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FluxArgumentError(f"--flux-config {path!r}: not valid JSON ({exc})") from None
    if not isinstance(table, dict):
        raise FluxArgumentError(
            f"--flux-config {path!r}: expected a JSON object, got {type(table).__name__}"
        )
    return table


# Megatron arguments that select a spec path megatron-flux does not build on.
_UNSUPPORTED_WITH_OVERLAP = {
    "use_legacy_models": "--use-legacy-models (megatron-flux plugs into megatron-core models)",
    "experimental_attention_variant": "--experimental-attention-variant (its spec needs "
    "Transformer Engine's TELinear)",
    "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
    "use_kitchen": "--use-kitchen (Kitchen's quantized linears replace megatron-core's)",
}

#: selective-recompute modules that megatron-core (0.16-0.19) checkpoints with
#: ``CheckpointWithoutOutput``, whose ``fp8 = fp8 is not None`` is true for the default
#: ``fp8=False``: without Transformer Engine its forward raises ``NameError:
#: FP8GlobalStateManager``
_RECOMPUTE_MODULES_NEEDING_TE = ("layernorm", "moe_act", "mla_up_proj")


def _have_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def validate_flux_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check ``--flux-*`` against Megatron's arguments; call after Megatron's validation.

    * The process's :class:`~megatron_flux.options.FluxOptions` become
      :meth:`FluxOptions.from_args(args) <megatron_flux.options.FluxOptions.from_args>`: the
      ``MEGATRON_FLUX_*`` environment's defaults with ``--flux-column-dgrad`` and
      ``--flux-column-regather`` over them (installed with
      :func:`~megatron_flux.options.set_options`; nothing is written to the environment).
    * ``--flux-config`` must name an existing file holding a JSON object (checked even without
      ``--flux-tp-overlap``: a wrong path is a mistake either way). With ``--flux-tp-overlap``
      (at TP > 1) it must also be a valid tuning table (:mod:`megatron_flux.tuning.schema`;
      the error names the file and the field), and it is installed as this process's
      highest-priority table (:func:`megatron_flux.tuning.use_table_files`).
    * ``--flux-tp-overlap`` at ``--tensor-model-parallel-size 1`` has nothing to overlap: it is
      turned off (``args.flux_tp_overlap = False``, so :func:`flux_spec_from_args` returns
      ``None``) with exactly one ``UserWarning``. This check comes first because Megatron's own
      validation already switches ``sequence_parallel`` off at TP=1.
    * ``--flux-tp-overlap`` needs ``--sequence-parallel`` (the overlapped patterns are
      all-gather/reduce-scatter along the sequence), as Megatron's ``--tp-comm-overlap`` does.
    * ``--flux-tp-overlap`` with ``--tp-comm-overlap`` is an error: two systems would both try
      to overlap the same communication (Transformer Engine userbuffers vs megatron-flux).
    * ``--flux-tp-overlap`` with ``--overlap-grad-reduce`` or ``--overlap-param-gather`` at
      data-parallel size > 1 warns once unless ``reserved_sms`` (``$MEGATRON_FLUX_RESERVED_SMS``)
      reserves SMs for the data-parallel NCCL kernels (untested: see docs/design.md).
    * ``--flux-tp-overlap`` with ``--transformer-impl transformer_engine`` is an error:
      megatron-flux rewrites megatron-core's *local* spec (Transformer Engine's linears do their
      own communication), so pass ``--transformer-impl local``.
    * ``--flux-tp-overlap`` with ``--recompute-granularity selective`` and a recompute module
      that megatron-core checkpoints with ``CheckpointWithoutOutput`` (``layernorm``,
      ``moe_act``, ``mla_up_proj``) is an error without Transformer Engine: megatron-core's
      checkpoint then fails in the first forward with ``NameError``. ``full`` recomputation
      and the ``mlp`` / ``core_attn`` modules work (tests/unit/test_gpt_model_sp.py).

    Returns ``args`` (modified only as described for TP=1).
    """
    config_path = getattr(args, "flux_config", None)
    if config_path is not None:
        load_flux_config(config_path)
    for dest, choices in (("flux_column_dgrad", COLUMN_DGRAD_CHOICES),
                          ("flux_column_regather", COLUMN_REGATHER_CHOICES)):
        value = getattr(args, dest, None)
        if value is not None and value not in choices:
            flag = "--" + dest.replace("_", "-")
            raise FluxArgumentError(f"{flag} {value!r}: choose one of {list(choices)}")
    try:
        set_options(FluxOptions.from_args(args))
    except ValueError as exc:
        raise FluxArgumentError(str(exc)) from None
    if getattr(args, "flux_backend", "auto") not in BACKEND_CHOICES:
        raise FluxArgumentError(
            f"--flux-backend {args.flux_backend!r}: choose one of {list(BACKEND_CHOICES)}"
        )
    if not getattr(args, "flux_tp_overlap", False):
        return args

    if getattr(args, "tensor_model_parallel_size", 1) == 1:
        warnings.warn(
            "--flux-tp-overlap has no effect with --tensor-model-parallel-size 1 (no "
            "tensor-parallel communication to overlap); using the stock layers.",
            UserWarning,
            stacklevel=2,
        )
        args.flux_tp_overlap = False
        return args
    if not getattr(args, "sequence_parallel", False):
        raise FluxArgumentError(
            "--flux-tp-overlap requires --sequence-parallel: megatron-flux overlaps the "
            "sequence-parallel all-gather / reduce-scatter of the tensor-parallel linears, "
            "which only exist when sequence parallelism is enabled"
        )
    if getattr(args, "tp_comm_overlap", False):
        raise FluxArgumentError(
            "--flux-tp-overlap and --tp-comm-overlap both overlap tensor-parallel communication "
            "(megatron-flux vs Transformer Engine userbuffers); enable only one of them"
        )
    impl = getattr(args, "transformer_impl", "local")
    if impl != "local":
        raise FluxArgumentError(
            f"--flux-tp-overlap with --transformer-impl {impl}: megatron-flux swaps the linears "
            "of megatron-core's local layer spec (Transformer Engine's fused linears do their "
            "own communication); use --transformer-impl local"
        )
    if getattr(args, "recompute_granularity", None) == "selective" and not _have_transformer_engine():
        needs_te = [m for m in getattr(args, "recompute_modules", None) or []
                    if m in _RECOMPUTE_MODULES_NEEDING_TE]
        if needs_te:
            raise FluxArgumentError(
                f"--recompute-modules {' '.join(needs_te)}: megatron-core recomputes these with "
                "CheckpointWithoutOutput, which needs Transformer Engine (not installed) and "
                "would fail in the first forward; drop them, or use --recompute-granularity full"
            )
    for name, what in _UNSUPPORTED_WITH_OVERLAP.items():
        if getattr(args, name, None):
            raise FluxArgumentError(f"--flux-tp-overlap is not supported with {what}")
    if getattr(args, "spec", None) is not None:
        raise FluxArgumentError(
            "--flux-tp-overlap with --spec: a custom spec is not rewritten automatically; drop "
            "--spec, or put megatron_flux.specs.swap_tp_linears(<your spec>) in your spec module"
        )
    if config_path is not None:
        from megatron_flux.tuning import TuningFileError, use_table_files

        try:
            use_table_files([config_path])
        except TuningFileError as exc:
            raise FluxArgumentError(f"--flux-config: {exc}") from None
    _warn_data_parallel_overlap(args)
    return args


def _warn_data_parallel_overlap(args: argparse.Namespace) -> None:
    """One warning when data-parallel NCCL kernels may run beside the fused persistent grids
    (``--overlap-grad-reduce`` / ``--overlap-param-gather`` at data-parallel size > 1) and no SMs
    are reserved for them: untested, and a grid that cannot become fully resident stalls its
    peers until the bounded waits raise ``FusedOpTimeout``."""
    from megatron_flux.options import ENV

    overlapped = [flag for flag, name in (("--overlap-grad-reduce", "overlap_grad_reduce"),
                                          ("--overlap-param-gather", "overlap_param_gather"))
                  if getattr(args, name, False)]
    if not overlapped or getattr(args, "data_parallel_size", 1) <= 1:
        return
    if get_options().reserved_sms > 0:
        return
    warnings.warn(
        f"--flux-tp-overlap with {' and '.join(overlapped)} at data-parallel size "
        f"{args.data_parallel_size}: NCCL's data-parallel kernels can run beside the fused "
        "kernels' persistent grids, which wait on their tensor-parallel peers while holding "
        "every SM. This combination has not been tested; if a fused op raises FusedOpTimeout, "
        f"set ${ENV['reserved_sms']} to at least NCCL's channel count (the grids then leave that "
        "many SMs free) or use --flux-backend nccl.",
        UserWarning,
        stacklevel=3,
    )


def apply_flux_args_to_config(args: argparse.Namespace, config: Any) -> Any:
    """Copy the ``--flux-*`` settings the layers read from the ``TransformerConfig``.

    Megatron's ``core_transformer_config_from_args`` copies only arguments named like a
    ``TransformerConfig`` field, so ours need this step. ``FluxColumnParallelLinear`` reads
    ``config.flux_keep_gathered_input`` and both layers ``config.flux_gradient_accumulation_fusion``
    when constructed; :func:`flux_spec_from_args` calls this when given the config. Returns
    ``config``.
    """
    config.flux_keep_gathered_input = bool(getattr(args, "flux_keep_gathered_input", True))
    config.flux_gradient_accumulation_fusion = bool(
        getattr(args, "flux_gradient_accumulation_fusion", False))
    return config


def flux_pre_wrap_hooks(args: argparse.Namespace) -> list:
    """Megatron pre-wrap hooks for these arguments (``GPTModelConfig.pre_wrap_hooks``, run on
    the list of model chunks after they are built and before DDP wraps them), with
    ``--flux-tp-overlap``:

    * unless ``--no-flux-output-layer``, one that converts GPTModel's output layer
      (:func:`megatron_flux.output_layer.swap_output_layer`, backend ``--flux-backend``);
    * with ``--flux-backend auto`` and ``--flux-step-auto`` (the defaults), one that lets the
      job's first iterations choose its backend (:func:`megatron_flux.step_auto.install_step_auto`),
      unless the job rotates backends itself (``--flux-interleave-backends``);
    * with CUDA graphs on (``--cuda-graph-impl`` other than ``none``), one that polls the fused
      kernels' error words once per forward (:func:`megatron_flux.backends.poll_fused_errors`,
      no synchronisation): calls replayed inside graphs never reach the per-call checks;
    * unless no fused kernel can run (``--flux-backend`` ``nccl`` or ``megatron``, and no fused
      backend or variant among the ones a job rotates), one that checks them before every
      optimizer step (:func:`install_optimizer_error_check`), so a timed-out wait raises before
      the update it would corrupt, with or without graphs (the per-call checks and the poll
      report it up to one step late).

    Empty otherwise, so ``model_cfg.pre_wrap_hooks.extend(flux_pre_wrap_hooks(args))`` is always
    safe."""
    if not getattr(args, "flux_tp_overlap", False):
        return []
    import functools

    hooks = []
    backend = getattr(args, "flux_backend", "auto")
    if getattr(args, "flux_output_layer", True):
        from megatron_flux.output_layer import swap_output_layer

        hooks.append(functools.partial(swap_output_layer, flux_backend=backend))
    if (backend == "auto" and getattr(args, "flux_step_auto", True)
            and not getattr(args, "flux_interleave_backends", None)):
        hooks.append(_step_auto_hook)
    from megatron_flux.step_auto import graphs_enabled

    if graphs_enabled(args):
        hooks.append(_graph_error_poll_hook)
    # the fused kernels may run: by the backend asked for, or the backends and fused variants
    # a benchmark job rotates (examples/pretrain_support.py's --flux-interleave-*)
    rotated = list(getattr(args, "flux_interleave_backends", None) or [])
    if (any(name not in ("nccl", MEGATRON_PASSTHROUGH) for name in [backend, *rotated])
            or getattr(args, "flux_interleave_variants", None)):
        hooks.append(_optimizer_error_check_hook)
    return hooks


def _graph_error_poll_hook(model_chunks):
    """A pre-wrap hook: a forward pre-hook on the first chunk that raises a timed-out wait of a
    fused kernel replayed in a CUDA graph (reported one forward late, without synchronising)."""
    from megatron_flux.backends import poll_fused_errors

    def pre_hook(module, args):
        if module.training:
            poll_fused_errors()

    list(model_chunks)[0].register_forward_pre_hook(pre_hook)
    return model_chunks


def _optimizer_error_check_hook(model_chunks):
    """A pre-wrap hook that installs :func:`install_optimizer_error_check` (once per process)."""
    install_optimizer_error_check()
    return model_chunks


_OPTIMIZER_CHECK = None


def install_optimizer_error_check():
    """Check the fused kernels' error words before every ``torch.optim.Optimizer`` step of this
    process (:func:`megatron_flux.backends.check_fused_errors`, a global step pre-hook:
    Megatron's optimizers step a torch optimizer inside), so a timed-out wait raises before the
    update that would apply its invalid outputs, and before any checkpoint of it. The check
    synchronises the current stream; Megatron's optimizer reaches the torch step after its
    gradient norm's ``.item()``, which has already waited for the backward, so little is left
    to wait for. Outside the graph under ``full_iteration``, the first eager code after a replay.
    Installed once per process; returns the hook's handle."""
    global _OPTIMIZER_CHECK
    if _OPTIMIZER_CHECK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def pre_step(optimizer, args, kwargs):
            from megatron_flux.backends import check_fused_errors

            check_fused_errors()

        _OPTIMIZER_CHECK = register_optimizer_step_pre_hook(pre_step)
    return _OPTIMIZER_CHECK


def _step_auto_hook(model_chunks):
    """A pre-wrap hook: :func:`megatron_flux.step_auto.install_step_auto` on the chunks, whose
    log lines go to stdout on global rank 0."""
    from megatron_flux.step_auto import install_step_auto

    def log(msg: str) -> None:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(msg, flush=True)

    install_step_auto(model_chunks, log=log)
    return model_chunks


def flux_spec_from_args(
    args: argparse.Namespace,
    config: Any = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
):
    """The megatron-flux GPT spec these arguments ask for, or ``None`` when flux is off.

    ``None`` (``--flux-tp-overlap`` off, or turned off by :func:`validate_flux_args` at TP=1)
    tells the caller to build its stock spec.

    Without ``config``: the *layer* spec (:func:`~megatron_flux.specs.get_gpt_layer_flux_spec`;
    GPT or Llama-style by ``args.normalization``; ``args.num_experts``, ``args.moe_grouped_gemm``,
    ``args.qk_layernorm``, ``args.multi_latent_attention``, ``args.qk_l2_norm`` and, where the
    installed megatron-core takes it, ``args.moe_use_legacy_grouped_gemm``). Given to
    ``GPTModel``, its final norm is then megatron-core's default, which without TE or apex is
    ``WrappedTorchNorm`` and asserts under sequence parallelism.

    With ``config`` (the model's ``TransformerConfig``): the *block* spec for this pipeline stage
    (:func:`~megatron_flux.specs.get_gpt_decoder_block_flux_spec`), whose final norm is ours;
    pass it as ``GPTModel(transformer_layer_spec=...)``. Prefer this form. The config also
    receives the layer settings (:func:`apply_flux_args_to_config`); in the layer-spec form call
    that yourself before building the model.
    """
    if not getattr(args, "flux_tp_overlap", False):
        return None
    from megatron_flux import specs

    backend = getattr(args, "flux_backend", "auto")
    normalization = getattr(args, "normalization", "LayerNorm")
    qk_l2_norm = bool(getattr(args, "qk_l2_norm", False))
    if config is not None:
        apply_flux_args_to_config(args, config)
        return specs.get_gpt_decoder_block_flux_spec(
            config,
            normalization=normalization,
            qk_l2_norm=qk_l2_norm,
            vp_stage=vp_stage,
            pp_rank=pp_rank,
            backend=backend,
        )
    extra = {}
    if hasattr(args, "moe_use_legacy_grouped_gemm") and (
        "moe_use_legacy_grouped_gemm" in specs._local_spec_parameters()
    ):
        extra["moe_use_legacy_grouped_gemm"] = args.moe_use_legacy_grouped_gemm
    return specs.get_gpt_layer_flux_spec(
        num_experts=getattr(args, "num_experts", None),
        moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        multi_latent_attention=bool(getattr(args, "multi_latent_attention", False)),
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
        backend=backend,
        **extra,
    )
