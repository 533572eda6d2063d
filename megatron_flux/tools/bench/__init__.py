"""FLUX-style operation-level benchmark: ``megatron-flux bench`` under torchrun.

Compares, per op (AG+GEMM, GEMM+RS) × model × token count, the non-overlapped Megatron path
(``nccl``), PyTorch's async-TP ops and the fused ``flux`` backend, reporting the FLUX paper's
effective communication time and overlap efficiency (§2.3). Modules, one job each:

* :mod:`.grid`    models, ops, m values and the per-rank shapes they imply
* :mod:`.methods` the timed methods, their operands and the fp32 correctness reference
* :mod:`.timing`  interleaved, rank-synchronised trials
* :mod:`.report`  metrics, terminal table, JSON (with schema check) and PNG
* ``__main__``    command line and the per-case driver

The package is imported by ``megatron-flux bench`` without pulling in matplotlib; plotting
imports it only when a PNG is requested.
"""
