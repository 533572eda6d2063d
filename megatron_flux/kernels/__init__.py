"""Triton kernels: persistent TMA GEMMs with the tensor-parallel communication fused in.

* :mod:`.tile_order` — rank-swizzled tile schedules shared by both kernels.
* :mod:`.ag_gemm`   — AllGather+GEMM: tiles spin on chunk signals before loading remote rows.
* :mod:`.gemm_rs`   — GEMM+ReduceScatter: remote tiles are pushed to their owner, own tiles
  reduce the pushed partials in a fixed rank order.
* :mod:`.config`    — GEMM block configurations and the default heuristic.
"""
