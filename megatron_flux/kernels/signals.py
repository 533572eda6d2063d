"""Device-side signal helpers shared by the fused kernels.

Signals are int32 words in symmetric memory holding an *epoch*: the producer of call ``e``
writes ``e`` (release, system scope) after its data; the consumer waits until the word is
``>= e`` (acquire, system scope). Epochs only grow, so signals never need resetting and
never need a host synchronisation. Every wait is bounded by ``max_spins`` polls; a wait that
runs out records ``(op, rank, signal index, value seen)`` in a per-op error word and gives up
(the host turns that into an exception naming the op and rank; see
:mod:`megatron_flux.comm.errors`), so a dead or diverged peer never hangs the GPU.
"""

import triton
import triton.language as tl

#: op codes written into the error word
OP_AG_GEMM = 1
OP_GEMM_RS = 2
OP_AG_READY = 3  # the pulling AllGather's "shards ready" barrier; the index is the peer's rank


@triton.jit
def wait_signal(flag_ptr, epoch, max_spins, err_ptr, op_code, rank, index):
    """Spin (acquire, system scope) until ``*flag_ptr >= epoch`` or ``max_spins`` polls."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while (seen < epoch) & (spins < max_spins):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    if seen < epoch:
        tl.atomic_xchg(err_ptr + 1, rank)
        tl.atomic_xchg(err_ptr + 2, index)
        tl.atomic_xchg(err_ptr + 3, seen)
        tl.atomic_xchg(err_ptr + 0, op_code)


@triton.jit
def set_signal(flag_ptr, epoch):
    """Publish ``epoch`` (release, system scope) after this program's stores.

    The CTA barrier first makes every thread's stores part of what the release orders."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")
