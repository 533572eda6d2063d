"""One-GPU research diagnostics (communication off), run as modules, not by the runtime.

* :mod:`.kernel_vs_cublas` the fused kernels' GEMM against cuBLAS per shape and config
* :mod:`.rs_phases`        GEMM+RS's time split into GEMM, signalling and reduction phases
* :mod:`.plain_gemm`       a plain persistent TMA GEMM, the yardstick for the fused mainloop
"""
