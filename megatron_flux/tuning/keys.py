"""Keys of the tuning tables, and the nearest-m-bucket rule.

A table entry is keyed by ``(gpu, sms, tp, dtype, op, n, k, m)``:

* ``gpu``: the device name normalised by :func:`normalize_gpu_name` (``"NVIDIA H200"`` ->
  ``"h200"``), plus ``sms``, the SM count, which tells apart parts that share a name stem
  (H100 SXM 132 SMs vs H100 PCIe 114) and MIG slices;
* ``tp``: the tensor-parallel group size; ``dtype``: ``"bf16"``, ``"fp16"`` or ``"fp32"``;
* ``op``: ``"ag"`` (AllGather+GEMM) or ``"rs"`` (GEMM+ReduceScatter);
* ``n``, ``k``: the shape of the weight **as the backend sees it on one rank** (``b`` is
  ``[k, n]``): for AG+GEMM ``n = fc1/tp, k = hidden``; for GEMM+RS ``n = hidden, k = fc2_in/tp``;
* ``m``: the m-bucket, the *global* row count ``m_total`` the backend computes (AG+GEMM: the
  gathered rows; GEMM+RS: the rows before the scatter), i.e. the token count of the layer.

These are exactly the arguments of ``FluxBackend.config(op, m_total, n, k)``, so the runtime
never converts shapes.

**Nearest bucket.** A table stores a few m values per ``(…, op, n, k)``. A call with any other m
uses the stored bucket nearest in ``log2`` space (``|log2 m - log2 bucket|`` smallest): GEMM
cost and the comm/compute balance scale with the ratio of sizes, not their difference, so 3000
maps to 4096 rather than 2048. Ties (m exactly at the geometric mean of two buckets, e.g. m=32
between 16 and 64) go to the **smaller** bucket. m outside the
stored range uses the closest end. ``n`` and ``k`` are never approximated here: an (n, k) the
table does not list is a miss, which :mod:`.estimate` answers from the nearest entries.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional, Sequence

#: backend op names, and the benchmark's names for them
OPS = ("ag", "rs")
OP_ALIASES = {"ag": "ag", "rs": "rs", "AG+GEMM": "ag", "GEMM+RS": "rs", "ag_gemm": "ag", "gemm_rs": "rs"}
DTYPES = ("bf16", "fp16", "fp32")
_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


class ShapeKey(NamedTuple):
    """Everything but the m-bucket: one list of buckets per ShapeKey."""

    gpu: str
    sms: int
    tp: int
    dtype: str
    op: str
    n: int
    k: int


def normalize_gpu_name(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``.

    Lower case, vendor prefix dropped, every run of non-alphanumerics one ``-``. Stable across
    driver versions, which only ever vary case and spacing of the marketing name.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"GPU name must be a non-empty string, got {name!r}")
    s = name.strip().lower()
    s = re.sub(r"^(nvidia|amd)\s+", "", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "unknown"


def normalize_op(op: str) -> str:
    """``"ag"`` / ``"rs"`` from the backend's or the benchmark's spelling."""
    try:
        return OP_ALIASES[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(OP_ALIASES)}") from None


def dtype_key(dtype) -> str:
    """``"bf16"`` / ``"fp16"`` / ``"fp32"`` from a ``torch.dtype`` or a string alias."""
    key = _DTYPE_ALIASES.get(str(dtype))
    if key is None:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {DTYPES}")
    return key


def nearest_bucket(m: int, buckets: Sequence[int]) -> Optional[int]:
    """The bucket nearest to ``m`` in log2 space (ties -> smaller); ``None`` if no buckets.

    ``buckets`` must be positive; they need not be sorted.
    """
    if not buckets:
        return None
    if m < 1:
        m = 1
    lm = math.log2(m)
    best, best_d = None, math.inf
    for b in sorted(buckets):
        d = abs(lm - math.log2(b))
        if d < best_d - 1e-12:
            best, best_d = b, d
    return best
