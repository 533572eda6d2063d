"""The tensor-parallel GEMMs of a model config, per rank, as the tuning tables key them.

A Megatron GPT/Llama layer with sequence parallelism runs four of them per micro-batch in forward:

=========  ======  ===================================  =======================
linear     op      n (per rank)                          k (per rank)
=========  ======  ===================================  =======================
QKV        AG      (heads + 2 * groups) * kv_channels/tp  hidden
proj       RS      hidden                                heads * kv_channels / tp
fc1        AG      ffn (x2 when gated: SwiGLU) / tp      hidden
fc2        RS      hidden                                ffn / tp
=========  ======  ===================================  =======================

plus, once per model and micro-batch, the output layer (``vocab_size`` in the config): AG with
``n`` = the vocabulary padded as Megatron pads it (to a multiple of
``make_vocab_size_divisible_by`` (128) x tp) / tp and ``k`` = hidden, labelled ``output``;

and in backward each linear's data gradient is the reverse pair with ``n`` and ``k`` swapped:
a column linear's (QKV, fc1) is GEMM+RS, a row linear's (proj, fc2) is AG+GEMM. With
``backward=True`` those four follow, labelled ``<linear>.dgrad``; shapes that coincide are the
same table entry and appear once in a tuning plan.

``groups`` is ``num_query_groups`` under grouped-query attention, else ``heads``;
``kv_channels`` defaults to ``hidden / heads``. Config files are the ones the pretrain scripts
take (``configs/*.json``, Megatron argument names, ``-`` or ``_``), or YAML/JSON with the same
keys, optionally nested under ``model`` or ``model_config``. Without ``num_attention_heads`` only
the MLP's two GEMMs are planned.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, NamedTuple, Optional


class TPGemm(NamedTuple):
    op: str     # "ag" or "rs"
    n: int      # per rank
    k: int      # per rank
    label: str  # "<config name>:<linear>"


#: extensions read as YAML (needs PyYAML); ``.json`` is read as JSON only, anything else as JSON
#: and then, where PyYAML is installed, as YAML
YAML_SUFFIXES = (".yaml", ".yml")


def file_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be read as a config file (``"no such file"``, ...), or ``None``: the
    command lines check this first, so a typo is one line, not a traceback."""
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "is a directory"
    if not os.access(path, os.R_OK):
        return "not readable"
    return None


def _parse(text: str, path: str) -> Any:
    """``text`` as JSON, or as YAML for a ``.yaml`` / ``.yml`` file; a ``ValueError`` that says
    where the text is malformed (JSON: line and column)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in YAML_SUFFIXES:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path}: a YAML file, and PyYAML is not installed "
                             "(pip install pyyaml)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        json_error = ValueError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno}, "
                                f"column {exc.colno}")
    if suffix != ".json":  # no telling extension: YAML is the documented other format
        try:
            import yaml

            cfg = yaml.safe_load(text)
        except Exception:  # noqa: BLE001 (no PyYAML, or not YAML either: the JSON error says more)
            cfg = None
        if isinstance(cfg, dict):
            return cfg
    raise json_error


def load_settings(path: str) -> Dict[str, Any]:
    """The config at ``path`` with keys normalised to underscores; ``_``-prefixed keys dropped.

    JSON, or YAML for ``.yaml`` / ``.yml`` files (and for other extensions that are not JSON
    but parse as a YAML mapping); a malformed file is a ``ValueError`` naming the file and
    where the parser stopped."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    cfg = _parse(text, path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping of model settings")
    cfg = _underscored(cfg)
    for sub in ("model", "model_config"):  # nested layouts
        if isinstance(cfg.get(sub), dict) and "hidden_size" not in cfg:
            cfg = _underscored(cfg[sub])
    return cfg


def _underscored(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron argument names with ``_`` for ``-``; ``_``-prefixed (comment) keys dropped."""
    return {str(k).replace("-", "_"): v for k, v in cfg.items() if not str(k).startswith("_")}


def _int(cfg: Dict[str, Any], key: str, path: str, default=None) -> int:
    value = cfg.get(key, default)
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: {key} must be an integer (got {value!r})") from None
    if value < 1:
        raise ValueError(f"{path}: {key} must be positive (got {value})")
    return value


def _per_rank(width: int, tp: int, what: str, path: str) -> int:
    if width % tp:
        raise ValueError(f"{path}: {what} = {width} is not divisible by TP = {tp}")
    return width // tp


def tp_gemms(path: str, tp: int, backward: bool = False) -> List[TPGemm]:
    """The config's TP GEMMs at TP size ``tp``, in layer order (QKV, proj, fc1, fc2, then the
    output layer when the config names a vocabulary), then with ``backward`` their
    data-gradient GEMMs in the same order."""
    cfg = load_settings(path)
    if "hidden_size" not in cfg:
        raise ValueError(f"{path}: needs hidden_size (and ffn_hidden_size)")
    hidden = _int(cfg, "hidden_size", path)
    ffn = _int(cfg, "ffn_hidden_size", path, default=4 * hidden)
    gated = bool(cfg.get("swiglu") or cfg.get("gated_linear_unit"))
    name = os.path.splitext(os.path.basename(path))[0]
    out: List[TPGemm] = []
    if cfg.get("num_attention_heads") is not None:
        heads = _int(cfg, "num_attention_heads", path)
        groups = _int(cfg, "num_query_groups", path) if cfg.get("group_query_attention") else heads
        if heads % groups:
            raise ValueError(f"{path}: num_attention_heads = {heads} is not a multiple of "
                             f"num_query_groups = {groups}")
        kv = cfg.get("kv_channels")
        if kv is None:
            if hidden % heads:
                raise ValueError(f"{path}: hidden_size = {hidden} is not a multiple of "
                                 f"num_attention_heads = {heads}; set kv_channels")
            kv = hidden // heads
        kv = int(kv)
        out.append(TPGemm("ag", _per_rank((heads + 2 * groups) * kv, tp, "QKV width", path), hidden,
                          f"{name}:qkv"))
        out.append(TPGemm("rs", hidden, _per_rank(heads * kv, tp, "attention output width", path),
                          f"{name}:proj"))
    fc1 = 2 * ffn if gated else ffn
    out.append(TPGemm("ag", _per_rank(fc1, tp, "fc1 width (from ffn_hidden_size)", path), hidden, f"{name}:fc1"))
    out.append(TPGemm("rs", hidden, _per_rank(ffn, tp, "ffn_hidden_size", path), f"{name}:fc2"))
    if cfg.get("vocab_size") is not None:
        multiple = _int(cfg, "make_vocab_size_divisible_by", path, default=128) * tp
        padded = -(-_int(cfg, "vocab_size", path) // multiple) * multiple
        out.append(TPGemm("ag", padded // tp, hidden, f"{name}:output"))
    if backward:
        out += [TPGemm("rs" if g.op == "ag" else "ag", g.k, g.n, f"{g.label}.dgrad") for g in list(out)]
    return out


def bench_widths(path: str, tp: int) -> List[tuple]:
    """The config's TP GEMMs as the op benchmark's models: ``[(name, hidden, width), ...]``,
    one per forward linear (QKV, proj, fc1, fc2, the output layer). A model of fc1 = ffn =
    ``width`` gives the benchmark an AG+GEMM of ``n = width`` and a GEMM+RS of ``k = width``
    (either ``--rs-k``): for QKV and fc1 their forward and data gradient, for proj and fc2
    their data gradient and forward, for the output layer its forward and data gradient. So
    the five models' ten cases are :func:`tp_gemms` with ``backward=True``, whatever the
    benchmark's per-rank split (``width`` is global: the per-rank width times ``tp``)."""
    out = []
    for g in tp_gemms(path, tp):  # an AG+GEMM's k and a GEMM+RS's n are the hidden size
        hidden, width = (g.k, g.n * tp) if g.op == "ag" else (g.n, g.k * tp)
        out.append((g.label.replace(":", "."), hidden, width))
    return out


def tokens_per_microbatch(path: str):
    """``seq_length * micro_batch_size`` of the config (the m of its TP GEMMs), or ``None``."""
    cfg = load_settings(path)
    if cfg.get("seq_length") is None:
        return None
    return int(cfg["seq_length"]) * int(cfg.get("micro_batch_size") or 1)
