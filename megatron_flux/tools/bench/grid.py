"""The benchmark grid: which models, which ops, which token counts, and the shapes they imply.

Shapes are stated *globally* (the numbers a reader compares with the FLUX paper and with
``/work/shared/reference/anchors-*.json``) and turned into per-rank shapes here, in one place,
so the methods and the tests cannot disagree about what "m=4096 on llama3-70b" means:

* ``AG+GEMM`` (column-parallel fc1 forward): ``C = AllGather_rows(A) @ B`` with
  ``n = fc1 width``, ``k = hidden``.  Per rank: ``A_shard [m/tp, k]``, ``B [k, n/tp]``,
  output ``[m, n/tp]``.
* ``GEMM+RS`` (row-parallel fc2 forward): ``C = ReduceScatter_rows(A @ B)`` with ``n = hidden``,
  ``k`` per :data:`RS_K_CHOICES`.  Per rank: ``A [m, k/tp]``, ``B [k/tp, n]``, output ``[m/tp, n]``.

The GEMM+RS contraction width has two conventions, which differ for gated (SwiGLU) models only:
``"fc1"`` (the default) uses the fc1 width — what the reference measurements in
``anchors-2xH200-2026-11-22.json`` timed (llama3-70b: k = 57344), so results compare row for
row; ``"ffn"`` uses the true fc2 input width of Megatron's SwiGLU MLP (llama3-70b: k = 28672).
For GPT-3 (no gate) both give k = 4h.

The non-split local GEMM (FLUX's ``GEMM_non-split``, the ``cublas_gemm`` method) is the GEMM
each rank would run if communication were free: ``[m, k] @ [k, n/tp]`` for AG+GEMM and
``[m, k/tp] @ [k/tp, n]`` for GEMM+RS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

AG_GEMM = "AG+GEMM"
GEMM_RS = "GEMM+RS"
OPS: Tuple[str, ...] = (AG_GEMM, GEMM_RS)

#: token counts (rows of the flattened ``[s*b, h]`` activation) of the main grid
LARGE_M: Tuple[int, ...] = (1024, 2048, 4096, 8192)
#: decode / small-batch token counts, where fused kernels are most likely to lose
SMALL_M: Tuple[int, ...] = (64, 128, 256, 512)
#: GEMM+RS contraction-width conventions (see the module docstring); the first is the default
RS_K_CHOICES: Tuple[str, ...] = ("fc1", "ffn")


@dataclass(frozen=True)
class ModelShape:
    """The MLP widths of one model; ``fc1`` includes the gate of gated MLPs (SwiGLU: 2×ffn)."""

    name: str
    hidden: int
    fc1: int
    ffn: int


#: The default models. GPT-3 175B has a plain GeLU MLP (fc1 = ffn = 4h); the Llama-3 models use
#: SwiGLU, so their fc1 produces gate and up projections at once (fc1 = 2 × ffn).
MODELS: Dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("gpt3-175b", hidden=12288, fc1=49152, ffn=49152),
        ModelShape("llama3-70b", hidden=8192, fc1=2 * 28672, ffn=28672),
        ModelShape("llama3-8b", hidden=4096, fc1=2 * 14336, ffn=14336),
    )
}


@dataclass(frozen=True)
class Case:
    """One benchmarked problem in global shapes: ``op`` on ``model`` with ``m`` tokens."""

    op: str
    model: str
    m: int
    n: int
    k: int

    def local_shapes(self, tp: int) -> Dict[str, Tuple[int, int]]:
        """Per-rank operand shapes at tensor-parallel size ``tp``.

        Keys: ``a`` (this rank's input: the row shard for AG+GEMM, the k-split activation for
        GEMM+RS), ``b`` (this rank's weight as ``[k, n]``), ``out`` (this rank's result),
        ``gemm_a`` / ``gemm_b`` (operands of the non-split local GEMM), ``comm_in`` /
        ``comm_out`` (the collective alone).
        """
        check_divisible(self, tp)
        m, n, k = self.m, self.n, self.k
        if self.op == AG_GEMM:
            return {
                "a": (m // tp, k),
                "b": (k, n // tp),
                "out": (m, n // tp),
                "gemm_a": (m, k),
                "gemm_b": (k, n // tp),
                "comm_in": (m // tp, k),
                "comm_out": (m, k),
            }
        if self.op == GEMM_RS:
            return {
                "a": (m, k // tp),
                "b": (k // tp, n),
                "out": (m // tp, n),
                "gemm_a": (m, k // tp),
                "gemm_b": (k // tp, n),
                "comm_in": (m, n),
                "comm_out": (m // tp, n),
            }
        raise ValueError(f"unknown op {self.op!r}; expected one of {OPS}")

    def gemm_flops(self, tp: int) -> int:
        """FLOPs of the non-split local GEMM on one rank (2·m·n·k / tp for both ops)."""
        return 2 * self.m * self.n * self.k // tp


def check_divisible(case: Case, tp: int) -> None:
    """Raise ``ValueError`` if ``case`` cannot be split evenly over ``tp`` ranks.

    The row split needs ``m % tp == 0`` for both ops; the weight split needs ``n % tp == 0``
    (AG+GEMM shards fc1's output features) or ``k % tp == 0`` (GEMM+RS shards fc2's inputs).
    """
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    split = case.n if case.op == AG_GEMM else case.k
    what = "n" if case.op == AG_GEMM else "k"
    if case.m % tp or split % tp:
        raise ValueError(
            f"{case.op} {case.model} m={case.m}: m and {what}={split} must be divisible by tp={tp}"
        )


def case_for(op: str, model: ModelShape, m: int, rs_k: str = RS_K_CHOICES[0]) -> Case:
    """The global ``(n, k)`` of ``op`` for ``model`` (see the module docstring)."""
    if rs_k not in RS_K_CHOICES:
        raise ValueError(f"rs_k must be one of {RS_K_CHOICES}, got {rs_k!r}")
    if op == AG_GEMM:
        return Case(op, model.name, m, n=model.fc1, k=model.hidden)
    if op == GEMM_RS:
        return Case(op, model.name, m, n=model.hidden, k=model.fc1 if rs_k == "fc1" else model.ffn)
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def build_grid(
    ops: Sequence[str],
    models: Iterable[ModelShape],
    ms: Sequence[int],
    tp: int,
    rs_k: str = RS_K_CHOICES[0],
) -> List[Case]:
    """All cases, ordered model → m → op (so both ops of one layer run back to back).

    Every case is checked for divisibility up front: a grid that cannot run is rejected before
    any GPU time is spent, with the same answer on every rank.
    """
    cases = [case_for(op, model, m, rs_k) for model in models for m in ms for op in ops]
    for case in cases:
        check_divisible(case, tp)
    return cases


def parse_model_shape(spec: str) -> ModelShape:
    """``name:hidden:fc1:ffn`` → :class:`ModelShape` (for custom or tiny smoke-test models)."""
    parts = spec.split(":")
    if len(parts) != 4 or not parts[0]:
        raise ValueError(f"model shape {spec!r} must look like name:hidden:fc1:ffn")
    try:
        hidden, fc1, ffn = (int(p) for p in parts[1:])
    except ValueError:
        raise ValueError(f"model shape {spec!r}: hidden, fc1 and ffn must be integers") from None
    if min(hidden, fc1, ffn) < 1:
        raise ValueError(f"model shape {spec!r}: sizes must be positive")
    return ModelShape(parts[0], hidden=hidden, fc1=fc1, ffn=ffn)


def select_models(names: Sequence[str], custom: Sequence[ModelShape]) -> List[ModelShape]:
    """Resolve ``--models`` names against the built-in table plus ``--model-shapes`` entries."""
    table = dict(MODELS)
    for shape in custom:
        table[shape.name] = shape
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {sorted(table)}")
    return [table[n] for n in names]
