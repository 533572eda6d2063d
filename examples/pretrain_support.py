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
* :func:`add_example_args`: this script's own arguments (``--core-attention``,
  ``--flux-interleave-backends``/``--flux-interleave-steps``).
* :class:`BackendInterleaver`: switches every Flux linear of the model between backends in
  blocks of iterations, so one training job times stock megatron-core (``megatron``), the
  plugin's ``nccl``, ``flux`` and ``auto`` back to back under the same conditions
  (``benchmarks/interleave_report.py`` reads the log).
* :func:`layer_spec_hook`: the ``GPTModelConfig.transformer_layer_spec`` callable: megatron-flux's
  block spec with ``--flux-tp-overlap`` (:func:`flux_layer_spec_hook`); without it, under
  sequence parallelism with the local layers, megatron-core's own linears with SP-capable norms
  (:func:`stock_layer_spec_hook`, the baseline the flux runs are compared with).

``python examples/pretrain_support.py configs/X.json`` prints the config's arguments, one per
line. ``python examples/pretrain_support.py --tokens-per-microbatch ARGS...`` prints
:func:`tokens_per_microbatch` of a Megatron command line (the launchers' pre-flight plan uses it).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


def tokens_per_microbatch(argv: Sequence[str]) -> Optional[int]:
    """``seq-length x micro-batch-size`` of a Megatron command line: the global rows (m) of the
    model's TP GEMMs. ``--model-config`` is expanded first and the last value of each wins, as
    in Megatron's parser (which takes no abbreviations). None without a ``--seq-length``."""
    values: Dict[str, str] = {}
    args = expand_model_config_argv(argv)
    for i, arg in enumerate(args):
        for flag in ("--seq-length", "--micro-batch-size"):
            if arg == flag and i + 1 < len(args):
                values[flag] = args[i + 1]
            elif arg.startswith(flag + "="):
                values[flag] = arg.split("=", 1)[1]
    if "--seq-length" not in values:
        return None
    return int(values["--seq-length"]) * int(values.get("--micro-batch-size", 1))


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
            if attr == "gradient_accumulation_fusion" and getattr(args, "flux_tp_overlap", False):
                # megatron-flux's linears do it without apex: they keep what was asked for
                args.flux_gradient_accumulation_fusion = True
                messages.append("megatron-flux's linears keep gradient accumulation fusion "
                                "(--flux-gradient-accumulation-fusion: one fp32-output GEMM "
                                "into main_grad, no apex)")
    return messages


def use_prebuilt_dataset_helpers() -> Optional[str]:
    """Skip Megatron's ``make`` of the dataset helpers when the installed wheel ships them built.

    ``megatron.training`` runs ``make -C megatron/core/datasets`` on rank 0 at start-up and exits
    if it fails. The megatron-core wheels on PyPI ship the compiled ``helpers_cpp`` extension but
    not the Makefile, so that ``make`` always fails there. When the extension imports and there
    is no Makefile, replace ``compile_helpers`` with a no-op (Megatron imports it at call time)
    and return a message saying so; otherwise (a source checkout) leave it alone, return None.
    """
    import os

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
        from megatron.core.datasets import utils as dataset_utils
    except ImportError:
        return None
    if os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        return None
    dataset_utils.compile_helpers = lambda: None
    return ("dataset helpers: using the prebuilt megatron.core.datasets.helpers_cpp (the wheel "
            "has no Makefile to rebuild it from)")


# --------------------------------------------------------------------------------------------
# The spec hook
# --------------------------------------------------------------------------------------------


CORE_ATTENTION_CHOICES = ("local", "sdpa")


def add_example_args(parser):
    """``--core-attention {local,sdpa}`` (this script's own argument, not megatron-flux's)."""
    group = parser.add_argument_group(title="pretrain_gpt.py example")
    group.add_argument(
        "--core-attention",
        choices=CORE_ATTENTION_CHOICES,
        default="local",
        help="core attention of the local layer spec: Megatron's DotProductAttention ('local', "
        "materializes the [s, s] scores) or megatron-flux's SDPACoreAttention ('sdpa', "
        "torch.nn.functional.scaled_dot_product_attention, flash kernels on CUDA). Applies "
        "with and without --flux-tp-overlap, so both are measured on the same attention.",
    )
    group.add_argument(
        "--flux-interleave-backends",
        nargs="+",
        metavar="BACKEND",
        default=None,
        help="Benchmarking: rotate the Flux linears' backend between these ('megatron' = "
        "megatron-core's own code in the same layers, 'nccl', 'flux', 'auto' = what the "
        "default --flux-backend auto chose from this job's first steps, 'auto-op' = the "
        "tables' per-op choice) every --flux-interleave-steps iterations, logging each switch. "
        "Step times of one job then compare the backends under the same conditions. A name may "
        "carry modifiers: '+keep' / '+nokeep' (the column layers keep the gathered input, or "
        "gather it again in backward), '+ncclgather' / '+cegather' (that re-gather on NCCL or "
        "the copy engine). Needs --flux-tp-overlap.",
    )
    group.add_argument(
        "--flux-interleave-variants",
        nargs="+",
        metavar="NAME=JSON",
        default=None,
        help="Benchmarking: register fused backends named NAME whose kernel settings are the "
        "tuning tables' with JSON's GemmConfig fields changed (an optional \"ops\": [\"rs\"] or "
        "[\"ag\"] limits the change to GEMM+ReduceScatter or AllGather+GEMM), to name in "
        "--flux-interleave-backends beside 'flux': the training step, not an op in a loop, then "
        "times a config change. Each is another backend object with its own workspaces.",
    )
    group.add_argument(
        "--flux-interleave-steps",
        type=int,
        default=5,
        metavar="N",
        help="Iterations per block of --flux-interleave-backends (default 5).",
    )
    return parser


INTERLEAVE_TAG = "[flux-interleave]"

#: the block name that stands for what ``--flux-backend auto`` runs in a job: the backend its
#: step-time selection (megatron_flux.step_auto) chose at the start of this job
STEP_AUTO_BLOCK = "auto"
#: the per-op ``auto`` (the tables' choice per GEMM), the layer setting
PER_OP_AUTO_BLOCK = "auto-op"


class BackendInterleaver:
    """Set ``flux_backend`` on every Flux linear of a model, in blocks of ``steps`` iterations.

    Iteration ``i`` (0-based, Megatron's ``args.curr_iteration``) runs ``backends[(i // steps) %
    len(backends)]``. Call :meth:`switch` at the start of every forward step: it does nothing
    unless the block changed, and then logs ``[flux-interleave] iteration <i + 1>: backend <name>``
    (Megatron's 1-based iteration numbers, as in its ``iteration N/ T`` lines). A micro-batch's
    backward uses the backend its forward used (the ops keep it on the autograd context).

    ``auto`` stands for what the default ``--flux-backend auto`` runs: when a block names it, the
    job first runs the step-time selection of :mod:`megatron_flux.step_auto` (its iterations are
    logged as backend ``selecting``), and the blocks start after it; each ``auto`` block then
    runs the backend it chose. ``auto-op`` is the per-op choice from the tables.

    A backend name may carry modifiers (``flux+keep``):

    * ``+keep`` / ``+nokeep``: the column layers' ``flux_keep_gathered_input`` on / off (off:
      the input is gathered again in backward, as megatron-core does);
    * ``+ncclgather`` / ``+cegather``: the fused backend's ``column_regather`` set to ``"nccl"`` /
      ``"copy_engine"`` (how that re-gather runs).

    Blocks without a modifier run with the values the job configured. So one job times these
    forms against each other under the same conditions.
    """

    def __init__(self, backends: Sequence[str], steps: int, selector_factory=None):
        from megatron_flux.backends import validate_backend_name

        if not backends:
            raise ValueError("--flux-interleave-backends: name at least one backend")
        if steps < 1:
            raise ValueError(f"--flux-interleave-steps {steps}: must be >= 1")
        for name in backends:
            backend = _split_block_name(name)[0]
            if backend not in (STEP_AUTO_BLOCK, PER_OP_AUTO_BLOCK):
                validate_backend_name(backend)
        self._fused = None  # the fused backend, once a block names a re-gather modifier
        self._configured_regather: Optional[str] = None
        self.backends = list(backends)
        self.steps = int(steps)
        self.current: Optional[str] = None
        self._layers: Dict[int, List[Any]] = {}
        self._configured_keep: Dict[int, bool] = {}  # id(column layer) -> the job's own value
        self._applied: Dict[int, str] = {}  # id(model) -> the block name its layers are set to
        self._wants_selector = any(_split_block_name(b)[0] == STEP_AUTO_BLOCK for b in backends)
        self._selector_factory = selector_factory
        self.selector = None
        self._offset = 0  # the first iteration of the blocks (after the selection)

    def backend_for(self, iteration: int) -> str:
        return self.backends[((iteration - self._offset) // self.steps) % len(self.backends)]

    def _flux_layers(self, model: Any) -> List[Any]:
        from megatron_flux.step_auto import flux_layers

        layers = self._layers.get(id(model))
        if layers is None:
            layers = flux_layers(model)
            if not layers:
                raise RuntimeError(
                    "--flux-interleave-backends: the model has no Flux linears (pass "
                    "--flux-tp-overlap)")
            self._layers[id(model)] = layers
        return layers

    def _select(self, model: Any, iteration: int, log: Callable[[str], None]) -> bool:
        """Run the step-time selection at ``iteration``; whether it is still going."""
        layers = self._flux_layers(model)
        if self.selector is None:
            from megatron_flux.step_auto import StepAutoSelector

            for layer in layers:
                layer.flux_backend = "auto"
            make = self._selector_factory or (lambda ls, log: StepAutoSelector(
                ls, group=getattr(ls[0], "tp_group", None), log=log))
            self.selector = make(layers, log)
            log(f"{INTERLEAVE_TAG} iteration {iteration + 1}: backend selecting")
            self.current = "selecting"
        if self.selector.step(iteration) is None:
            return True
        self._offset = iteration
        self._applied.clear()
        return False

    def switch(self, model: Any, iteration: int, log: Callable[[str], None] = print) -> str:
        if self._wants_selector and (self.selector is None or self.selector.decided is None):
            if self._select(model, iteration, log):
                return "selecting"
        name = self.backend_for(iteration)
        backend, mods = _split_block_name(name)
        if backend == STEP_AUTO_BLOCK:
            backend = self.selector.decided
        elif backend == PER_OP_AUTO_BLOCK:
            backend = "auto"
        layers = self._flux_layers(model)
        if self._applied.get(id(model)) != name:
            for layer in layers:
                layer.flux_backend = backend
                if hasattr(layer, "flux_keep_gathered_input"):  # column layers only
                    configured = self._configured_keep.setdefault(
                        id(layer), layer.flux_keep_gathered_input)
                    keep = configured
                    if "keep" in mods or "nokeep" in mods:
                        keep = "keep" in mods
                    layer.flux_keep_gathered_input = keep
            regather = None
            if "ncclgather" in mods:
                regather = "nccl"
            elif "cegather" in mods:
                regather = "copy_engine"
            self._set_regather(regather)
            self._applied[id(model)] = name
        if name != self.current:
            self.current = name
            log(f"{INTERLEAVE_TAG} iteration {iteration + 1}: backend {name}")
        return name

    def _set_regather(self, value: Optional[str]) -> None:
        """The fused backend's ``column_regather``: ``value``, or (``None``) the job's own."""
        if self._fused is None:
            if value is None:
                return  # never changed
            from megatron_flux.backends import get_backend

            self._fused = get_backend("flux")
            self._configured_regather = self._fused.column_regather
        self._fused.column_regather = value or self._configured_regather


#: modifiers a block name may carry after its backend (``BackendInterleaver``)
BLOCK_MODIFIERS = ("keep", "nokeep", "ncclgather", "cegather")


def _split_block_name(name: str) -> Tuple[str, frozenset]:
    """``"flux+keep"`` -> ``("flux", {"keep"})``; ``"nccl"`` -> ``("nccl", {})``."""
    if not isinstance(name, str) or "+" not in name:
        return name, frozenset()
    backend, *mods = name.split("+")
    unknown = [m for m in mods if m not in BLOCK_MODIFIERS]
    if unknown:
        raise ValueError(f"--flux-interleave-backends {name!r}: unknown modifier(s) {unknown}; "
                         f"choose from {list(BLOCK_MODIFIERS)}")
    if {"keep", "nokeep"} <= set(mods) or {"ncclgather", "cegather"} <= set(mods):
        raise ValueError(f"--flux-interleave-backends {name!r}: contradictory modifiers")
    return backend, frozenset(mods)


def parse_variant(spec: str) -> Tuple[str, Dict[str, Any], Optional[List[str]]]:
    """``"rsce={\"ops\": [\"rs\"], \"rs_copy_engine\": true}"`` -> ``("rsce",
    {"rs_copy_engine": True}, ["rs"])`` (``--flux-interleave-variants``); a clear error for a
    bad name, JSON, op or field."""
    from megatron_flux.backends.flux.variant import check_variant_fields
    from megatron_flux.backends import BACKEND_CHOICES
    from megatron_flux.tuning.keys import normalize_op

    name, sep, text = spec.partition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"--flux-interleave-variants {spec!r}: expected NAME=JSON with a name of "
                         "letters, digits, '-' and '_'")
    if name in BACKEND_CHOICES + (STEP_AUTO_BLOCK, PER_OP_AUTO_BLOCK):
        raise ValueError(f"--flux-interleave-variants {spec!r}: {name!r} is taken; choose another name")
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--flux-interleave-variants {name}: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--flux-interleave-variants {name}: expected a JSON object, got {text!r}")
    ops = fields.pop("ops", None)
    if ops is not None:
        if not isinstance(ops, list) or not ops:
            raise ValueError(f"--flux-interleave-variants {name}: \"ops\" must be a non-empty list")
        try:
            ops = [normalize_op(op) for op in ops]
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"--flux-interleave-variants {name}: {exc}") from None
    try:
        fields = check_variant_fields(fields)
    except ValueError as exc:
        raise ValueError(f"--flux-interleave-variants {name}: {exc}") from None
    return name, fields, ops


def register_variants(specs: Sequence[str]) -> List[str]:
    """Register each ``NAME=JSON`` of ``--flux-interleave-variants`` as a fused backend
    (:func:`megatron_flux.backends.flux.variant.variant_backend`, built on first use); returns
    the names."""
    from megatron_flux.backends import register_backend
    from megatron_flux.backends.flux.variant import variant_backend

    names = []
    for spec in specs:
        name, fields, ops = parse_variant(spec)
        if name in names:
            raise ValueError(f"--flux-interleave-variants: {name!r} is named twice")
        register_backend(name, lambda fields=fields, ops=ops: variant_backend(fields, ops), override=True)
        names.append(name)
    return names


def backend_interleaver(args: Any) -> Optional[BackendInterleaver]:
    """The interleaver these arguments ask for (cached on ``args``), or ``None``. Registers the
    ``--flux-interleave-variants`` first, so blocks can name them."""
    backends = getattr(args, "flux_interleave_backends", None)
    variants = getattr(args, "flux_interleave_variants", None)
    if not backends:
        if variants:
            raise ValueError("--flux-interleave-variants needs --flux-interleave-backends (name "
                             "the variants there)")
        return None
    cached = getattr(args, "_flux_interleaver", None)
    if cached is None:
        if not getattr(args, "flux_tp_overlap", False):
            raise ValueError("--flux-interleave-backends needs --flux-tp-overlap (it switches "
                             "the Flux linears' backend)")
        if variants:
            register_variants(variants)
        cached = BackendInterleaver(backends, getattr(args, "flux_interleave_steps", 5))
        args._flux_interleaver = cached
    return cached


def _with_core_attention(spec: Any, args: Any) -> Any:
    if getattr(args, "core_attention", "local") != "sdpa":
        return spec
    from megatron_flux.specs import swap_core_attention

    return swap_core_attention(spec)


def stock_layer_spec_hook(args: Any) -> Optional[Callable[..., Any]]:
    """Megatron's own local block spec, made to run under sequence parallelism, or ``None``.

    Without Transformer Engine or apex, Megatron's local spec normalizes with
    ``WrappedTorchNorm``, which asserts under sequence parallelism, so a stock SP run of a
    ``--transformer-impl local`` model cannot start. This spec keeps megatron-core's
    Column/RowParallelLinear (NCCL, then the GEMM) and replaces only the norms with
    megatron-flux's SP-capable ones (:func:`megatron_flux.specs.swap_norms`), plus
    ``--core-attention``. ``None`` (Megatron's default spec) when sequence parallelism is off,
    the layers are Transformer Engine's, or nothing needs changing.
    """
    if getattr(args, "flux_tp_overlap", False):
        return None
    local = getattr(args, "transformer_impl", "local") == "local"
    needs_norms = local and getattr(args, "sequence_parallel", False)
    if not local or not (needs_norms or getattr(args, "core_attention", "local") == "sdpa"):
        return None

    def stock_layer_spec(model_cfg: Any, vp_stage: Optional[int] = None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        from megatron_flux.specs import swap_norms

        config = getattr(model_cfg, "transformer", model_cfg)
        block = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=None if needs_norms else config.normalization,
            qk_l2_norm=bool(getattr(args, "qk_l2_norm", False)),
            vp_stage=vp_stage,
        )
        if needs_norms:
            block = swap_norms(block, config.normalization)
        return _with_core_attention(block, args)

    return stock_layer_spec


def layer_spec_hook(args: Any) -> Optional[Callable[..., Any]]:
    """The spec callable for these arguments: flux's, the SP-capable stock one, or ``None``."""
    return flux_layer_spec_hook(args) or stock_layer_spec_hook(args)


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
        return _with_core_attention(flux_spec_from_args(args, config, vp_stage=vp_stage), args)

    return flux_layer_spec


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--tokens-per-microbatch"]:
        try:
            tokens = tokens_per_microbatch(argv[1:])
        except (ModelConfigError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if tokens is None:
            print("error: no --seq-length (in the model config or the arguments)", file=sys.stderr)
            return 1
        print(tokens)
        return 0
    if len(argv) != 1:
        print("usage: python examples/pretrain_support.py configs/<model>.json\n"
              "       python examples/pretrain_support.py --tokens-per-microbatch "
              "[--model-config PATH] [megatron args...]", file=sys.stderr)
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
