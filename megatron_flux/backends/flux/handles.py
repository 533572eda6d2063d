"""The pending handles of the fused backend's copy-engine collectives: the column backward's
re-gather (``column_regather="copy_engine"``) and its copy-engine ReduceScatter
(``column_dgrad="copy_engine"``). Each ``wait()`` queues the signal writes behind the copies
(after whatever the caller queued meanwhile: with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` a write that
waits for its copy holds the one hardware queue, and the kernel behind it), makes the caller's
stream wait for the side stream, and runs a one-warp bounded wait for every peer's signal."""

from __future__ import annotations

import torch

from megatron_flux.backends.flux.resources import deps


def signal_and_wait(backend, ws, err, signals, *, rank, world, parity, epoch, current, side,
                    done: str, op_code: int) -> None:
    """On ``side``, each ``(uint32 flags, index)`` of ``signals`` receives ``epoch`` behind the
    copies queued there; ``current`` waits for ``side`` (hand-off ``done``); then a one-warp
    bounded wait on ``current`` for every peer's signal ``[peer]`` of this rank (``op_code``
    names the op in a timeout)."""
    d = deps()
    res, opts = backend.resources, backend.options
    caller = torch.cuda.current_stream(current.device)
    with d.on_stream(side, caller):
        for flags, index in signals:
            d.write_signal(flags, index, epoch)  # after its copy, on the same stream
    res.order(current.device, done)(current, side)
    with d.on_stream(current, caller):
        d.launch_ready_barrier(ws.flag_ptrs(parity), err.device_word, rank=rank, world=world,
                               base=0, epoch=epoch, max_spins=opts.max_spins, signal=False,
                               wait=True, op_code=op_code, direct=opts.direct_launch)
    err.after_launch()


class CopyEngineGather:
    """The handle :meth:`FluxBackend.all_gather_start` returns; :meth:`wait` finishes the call."""

    def __init__(self, backend, ws, err, copies, gathered, out, rank, world, parity, epoch,
                 current, side):
        self._backend, self._ws, self._err, self._copies = backend, ws, err, copies
        self._gathered, self._out = gathered, out
        self._rank, self._world, self._parity, self._epoch = rank, world, parity, epoch
        self._current, self._side = current, side
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        # "done": the pushes finished (the shard is free for reuse), on the stream that started
        # the gather
        signal_and_wait(self._backend, self._ws, self._err,
                        [(flags, index) for _, _, flags, index in self._copies],
                        rank=self._rank, world=self._world, parity=self._parity,
                        epoch=self._epoch, current=self._current, side=self._side, done="done",
                        op_code=deps().OP_GATHER)
        self._copies = None
        if self._out is not None:
            self._out.copy_(self._gathered)
            self._result = self._out
        else:
            self._result = self._gathered
        return self._result


class CopyEngineReduceScatter:
    """The handle of a copy-engine ReduceScatter; :meth:`wait` signals, waits and sums the
    partials in rank order (:mod:`megatron_flux.kernels.rs_reduce`)."""

    def __init__(self, backend, ws, err, copies, partial, bias, rank, world, parity, epoch,
                 m_local, n, current, side):
        self._backend, self._ws, self._err, self._copies = backend, ws, err, copies
        self._partial, self._bias = partial, bias
        self._rank, self._world, self._parity, self._epoch = rank, world, parity, epoch
        self._m_local, self._n, self._current, self._side = m_local, n, current, side
        self._result = None

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        d = deps()
        m_local, n, rank, world = self._m_local, self._n, self._rank, self._world
        signal_and_wait(self._backend, self._ws, self._err,
                        [(flags, rank) for _, _, flags in self._copies], rank=rank,
                        world=world, parity=self._parity, epoch=self._epoch,
                        current=self._current, side=self._side, done="rs-dgrad-done",
                        op_code=d.OP_GEMM_RS)
        out = torch.empty((m_local, n), dtype=self._partial.dtype, device=self._current.device)
        own = self._partial[rank * m_local:(rank + 1) * m_local]
        slots = self._ws.data(rank, self._parity, world * m_local * n)
        with d.on_stream(self._current, torch.cuda.current_stream(self._current.device)):
            d.launch_rs_reduce(own, slots, out, self._bias, rank=rank, world=world,
                               direct=self._backend.options.direct_launch)
        self._copies = self._partial = None
        self._result = out
        return out
