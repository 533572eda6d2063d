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
OP_AG_READY = 3  # the ready barrier's default (signal and wait): the index is the peer's rank
OP_GATHER = 4  # the copy-engine all-gather's wait for every peer's rows; the index is the peer


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


@triton.jit
def drain_async_stores(token, ASYNC_STORES: tl.constexpr):
    """Wait until this thread's TMA stores are complete (not merely read out of shared memory,
    which is all Triton waits for) and order them before later generic-proxy accesses, so a
    following release publishes them. A no-op without TMA stores (and under the interpreter,
    whose stores are synchronous and which has no inline assembly)."""
    if ASYNC_STORES:
        tl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, $1;",
            "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_async_proxy(token, ENABLED: tl.constexpr):
    """Order this thread's earlier generic-proxy accesses (an acquire) before its later
    async-proxy ones (TMA loads). A no-op when not ENABLED (the interpreter)."""
    if ENABLED:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, $1;", "=r,r", [token],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def release_fence(token, ENABLED: tl.constexpr):
    """``fence.acq_rel.sys``: every relaxed (strong) write this thread makes after it is a
    release of everything the thread saw or wrote before it (a PTX release pattern). One fence
    before ``W`` relaxed signal writes replaces ``W`` release writes, each of which fences on
    its own. A no-op when not ENABLED (the interpreter, which has no inline assembly: there the
    caller must write with release semantics)."""
    if ENABLED:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, $1;", "=r,r", [token],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def arrive_at_grid_barrier(counter_ptr, grid, ASYNC_STORES: tl.constexpr):
    """Count this program in at ``counter_ptr``; True for the last of ``grid`` programs, which
    has reset the counter (so the next call, stream-ordered after this one, starts from zero).

    Every program first drains its stores and releases them at system scope with its arrival
    (acq_rel), and the last arrival acquires all of them, so a release by the last program
    covers every program's stores (release is cumulative)."""
    drain_async_stores(tl.program_id(0), ASYNC_STORES)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    last = arrived == grid - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def publish_when_grid_done(counter_ptr, grid, flag_ptr, epoch, ASYNC_STORES: tl.constexpr):
    """:func:`arrive_at_grid_barrier`, then the last of the ``grid`` programs publishes
    ``epoch`` at ``flag_ptr`` (release, system scope), after every program's stores."""
    if arrive_at_grid_barrier(counter_ptr, grid, ASYNC_STORES):
        tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


#: op code of the captured calls' graph-entry fence (:mod:`megatron_flux.comm.capture`): the ready
#: barrier's words in the fence workspace; the index is the peer's rank (defined after the
#: kernels so that adding it moved none of them)
OP_GRAPH_FENCE = 5

#: op code of the warp-specialized GEMM+RS's wait for every K-part of a split tail tile (one
#: GPU's programs; :mod:`.gemm_rs_ws`): the index is the tail tile
OP_SPLIT_TAIL = 6
