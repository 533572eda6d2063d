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
from typing import Any, Dict, List, NamedTuple


class TPGemm(NamedTuple):
    op: str     # "ag" or "rs"
    n: int      # per rank
    k: int      # per rank
    label: str  # "<config name>:<linear>"


def load_settings(path: str) -> Dict[str, Any]:
    """The config at ``path`` with keys normalised to underscores; ``_``-prefixed keys dropped."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path}: not JSON, and PyYAML is not installed to read YAML") from None
        cfg = yaml.safe_load(text)
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


def tokens_per_microbatch(path: str):
    """``seq_length * micro_batch_size`` of the config (the m of its TP GEMMs), or ``None``."""
    cfg = load_settings(path)
    if cfg.get("seq_length") is None:
        return None
    return int(cfg["seq_length"]) * int(cfg.get("micro_batch_size") or 1)
