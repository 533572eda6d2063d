"""Cross-rank barrier on signal words (one program, one warp).

Signal schedule (rank ``r`` of ``W``, call epoch ``e``, signal words from ``base`` on):

* signal: for every peer ``p != r``, ``flags[p][base + r] = e`` (release, system scope);
* wait: for every peer ``p != r``, spin (acquire, bounded) until ``flags[r][base + p] >= e``. A
  wait that runs out records ``(op_code, r, p, seen)`` in the error word and gives up, so the
  error names the peer whose signal never came.

The fused backend runs the wait half alone (``signal=False``), on the caller's stream: it ends
the copy-engine all-gather (``FluxBackend.all_gather_start``) and the copy-engine
ReduceScatter (``column_dgrad="copy_engine"``), whose signals are the peers' stream memory
writes (:mod:`megatron_flux.backends.flux.handles`). One warp: it never competes with a
persistent grid for SMs.

``SIGNAL``/``WAIT`` split the two halves for simulated ranks under the interpreter, where
programs run one after another.
"""

import triton
import triton.language as tl

from megatron_flux.kernels.launch import KernelLauncher
from megatron_flux.kernels.signals import OP_AG_READY, set_signal, wait_signal


@triton.jit(do_not_specialize=["rank", "base", "epoch", "max_spins"])
def ready_barrier_kernel(flag_ptrs, err_ptr, rank, world, base, epoch, max_spins,
                         SIGNAL: tl.constexpr, WAIT: tl.constexpr, OP_CODE: tl.constexpr):
    if SIGNAL:
        for p in range(0, world):
            if p != rank:
                peer = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int32))
                set_signal(peer + base + rank, epoch)
    if WAIT:
        mine = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
        for p in range(0, world):
            if p != rank:
                wait_signal(mine + base + p, epoch, max_spins, err_ptr, OP_CODE, rank, p)


def launch_ready_barrier(flag_ptrs, err, *, rank, world, base, epoch, max_spins, signal=True, wait=True,
                         op_code=OP_AG_READY, direct=True):
    """Queue the barrier on the current stream. ``flag_ptrs``: int64 table of every rank's
    signal region (this call's parity); ``err``: the op's int32[4] error word. With
    ``signal=False`` it is a bounded wait for signals the peers raise otherwise (the
    copy-engine all-gather's stream memory writes); ``op_code`` names the op in a timeout."""
    _LAUNCH(1, (flag_ptrs, err, rank, world, base, epoch, max_spins),
            dict(SIGNAL=signal, WAIT=wait, OP_CODE=op_code), num_warps=1, direct=direct)


_LAUNCH = KernelLauncher(ready_barrier_kernel)
