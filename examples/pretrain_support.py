"""Helpers for ``examples/pretrain_gpt.py``: model configs, fusion fallbacks, the flux spec hook.

Kept out of the pretrain script so that they import with megatron-core alone (no
``megatron.training``, which needs Python 3.12), and so the CPU tests can check them.

* :func:`load_model_config` / :func:`config_to_argv` / :func:`expand_model_config_argv`: a model
  config in ``configs/*.json`` is a JSON object of Megatron arguments (keys without the leading
  ``--``). ``--model-config PATH`` on the command line is replaced by those arguments, placed
  first, so anything given explicitly on the command line overrides them (argparse keeps the
  last value).
* :func:`disable_unavailable_fusions`: turns off the Megatron fusions whose kernels come from
  apex or Transformer Engine when those are not installed.
* :func:`flux_layer_spec_hook`: the ``GPTModelConfig.transformer_layer_spec`` callable that gives
  Megatron's GPT builder megatron-flux's block spec.

``python examples/pretrain_support.py configs/X.json`` prints the config's arguments, one per
line (what the launchers use).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

MODEL_CONFIG_FLAG = "--model-config"


class ModelConfigError(ValueError):
    """A model config file that is not a JSON object of Megatron arguments."""


def load_model_config(path: str) -> Dict[str, Any]:
    """The config at ``path`` as a dict (keys starting with ``_`` are comments and dropped)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as exc:
        raise ModelConfigError(f"model config {path!r}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"model config {path!r}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"model config {path!r}: expected a JSON object")
    config = {}
    for key, value in raw.items():
        if key.startswith("_"):
            continue
        if key.startswith("-") or not key or " " in key:
            raise ModelConfigError(
                f"model config {path!r}: key {key!r} must be a Megatron argument name without "
                "the leading '--' (e.g. \"num-layers\")"
            )
        if isinstance(value, dict):
            raise ModelConfigError(f"model config {path!r}: {key!r} has an object value")
        config[key] = value
    return config


def config_to_argv(config: Dict[str, Any]) -> List[str]:
    """Megatron command-line arguments for ``config``.

    ``true`` → ``--key``; ``false``/``null`` → nothing (the argument keeps its default); a list →
    ``--key v1 v2 ...``; anything else → ``--key value``.
    """
    argv: List[str] = []
    for key, value in config.items():
        flag = f"--{key}"
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            argv.append(flag)
            argv.extend(str(item) for item in value)
        else:
            argv.append(flag)
            argv.append(str(value))
    return argv


def expand_model_config_argv(argv: Sequence[str]) -> List[str]:
    """``argv`` with every ``--model-config PATH`` (or ``--model-config=PATH``) expanded.

    The config's arguments go first, then the rest of ``argv`` in its order, so explicit
    command-line arguments win over the config. ``argv`` excludes the program name.
    """
    from_configs: List[str] = []
    rest: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == MODEL_CONFIG_FLAG:
            if i + 1 >= len(argv):
                raise ModelConfigError(f"{MODEL_CONFIG_FLAG} needs a path")
            from_configs.extend(config_to_argv(load_model_config(argv[i + 1])))
            i += 2
            continue
        if arg.startswith(MODEL_CONFIG_FLAG + "="):
            from_configs.extend(config_to_argv(load_model_config(arg.split("=", 1)[1])))
            i += 1
            continue
        rest.append(arg)
        i += 1
    return from_configs + rest


# --------------------------------------------------------------------------------------------
# Fusions that need apex or Transformer Engine
# --------------------------------------------------------------------------------------------


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def unavailable_fusions() -> Dict[str, str]:
    """``{args attribute: why}`` for each fusion whose kernel is not installed.

    Each check is megatron-core's own criterion where it exposes one.
    """
    missing: Dict[str, str] = {}
    # GPTModel.output_layer is megatron-core's own ColumnParallelLinear (no spec reaches it),
    # which raises at construction when gradient accumulation fusion is on and apex's
    # fused_weight_gradient_mlp_cuda is missing. (megatron-flux's linears do not need it.)
    from megatron.core.tensor_parallel import layers as tp_layers

    if not getattr(tp_layers, "_grad_accum_fusion_available", False):
        missing["gradient_accumulation_fusion"] = (
            "apex's fused_weight_gradient_mlp_cuda is not installed (needed by the stock "
            "output layer)"
        )
    # FusedScaleMaskSoftmax imports apex's scaled_*masked_softmax_cuda extensions when it runs.
    if not (
        _module_available("scaled_masked_softmax_cuda")
        and _module_available("scaled_upper_triang_masked_softmax_cuda")
    ):
        missing["masked_softmax_fusion"] = "apex's scaled masked-softmax kernels are not installed"
    # TransformerConfig raises when apply_rope_fusion is on and these (Transformer Engine's)
    # are None.
    from megatron.core.models.common.embeddings import rope_utils

    if (
        getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is None
        and getattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None) is None
    ):
        missing["apply_rope_fusion"] = "Transformer Engine's fused RoPE is not installed"
    # persist_layer_norm selects apex's persistent LayerNorm kernel in FusedLayerNorm
    # (megatron-flux's norms ignore it; turned off so the printed config says what runs).
    from megatron.core.fusions import fused_layer_norm

    if not getattr(fused_layer_norm, "HAVE_PERSIST_LAYER_NORM", False):
        missing["persist_layer_norm"] = "apex's persistent LayerNorm kernel is not installed"
    return missing


def disable_unavailable_fusions(args: Any) -> List[str]:
    """Turn off, on ``args``, the fusions of :func:`unavailable_fusions` that are on.

    Call after Megatron's argument validation and before building the model config. Returns
    one message per fusion turned off (the script prints them).
    """
    messages = []
    for attr, why in unavailable_fusions().items():
        if attr == "persist_layer_norm":
            # Megatron's argument is the negation, --no-persist-layer-norm.
            if not getattr(args, "no_persist_layer_norm", True):
                args.no_persist_layer_norm = True
                messages.append(f"{attr} turned off: {why}")
        elif getattr(args, attr, False):
            setattr(args, attr, False)
            messages.append(f"{attr} turned off: {why}")
    return messages


# --------------------------------------------------------------------------------------------
# The spec hook
# --------------------------------------------------------------------------------------------


def flux_layer_spec_hook(args: Any) -> Optional[Callable[..., Any]]:
    """``GPTModelConfig.transformer_layer_spec`` for megatron-flux, or ``None`` when it is off.

    Megatron's GPT builder (``megatron.training.models.gpt.GPTModelBuilder.build_model``) calls a
    callable ``transformer_layer_spec(model_cfg, vp_stage=...)`` once per model chunk; this one
    returns :func:`megatron_flux.flux_spec_from_args` for that chunk: the decoder *block* spec,
    so the final norm is megatron-flux's sequence-parallel-capable one too, and the
    ``--flux-*`` layer settings are copied into the model's ``TransformerConfig``.
    """
    from megatron_flux import flux_spec_from_args

    if not getattr(args, "flux_tp_overlap", False):
        return None

    def flux_layer_spec(model_cfg: Any, vp_stage: Optional[int] = None):
        config = getattr(model_cfg, "transformer", model_cfg)
        return flux_spec_from_args(args, config, vp_stage=vp_stage)

    return flux_layer_spec


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python examples/pretrain_support.py configs/<model>.json", file=sys.stderr)
        return 2
    try:
        for arg in config_to_argv(load_model_config(argv[0])):
            print(arg)
    except ModelConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
