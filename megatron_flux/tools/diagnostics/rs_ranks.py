"""GEMM+RS of several simulated ranks on one GPU, wired to each other through GPU memory.

Each simulated rank ``r`` multiplies its ``a[r] @ w[r].T`` on a persistent grid of ``sms[r]``
programs, pushes its peers' rows into their slots and waits for their signals, exactly as on a
real group, except that every slot and signal lies in this GPU's memory. The grids run at once
only if they fit the GPU together (every program of every rank resident), as they must on a
real group; the caller launches each rank on its own stream.

Used by the GPU tests of the signal protocol across ranks (``tests/gpu/test_kernels_one_gpu.py``)
and by ``benchmarks/experiments/rs_ranks_one_gpu.py``, which times it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_flux.kernels.config import rs_signal_count
from megatron_flux.tools.diagnostics.kernel_vs_cublas import rel_err


class SimulatedRanks:
    """``len(a)`` ranks of GEMM+RS wired to each other on this GPU.

    Args:
        a: per rank, its ``[world * m_local, k]`` activation.
        w: per rank, its ``[n, k]`` weight.
        cfgs: per rank, its :class:`~megatron_flux.kernels.config.GemmConfig` (ranks may differ:
            the protocol does not depend on the kernel form).
        sms: per rank, its grid's program count.
        max_spins: the bound of every wait, in polls.
    """

    def __init__(self, a: Sequence[torch.Tensor], w: Sequence[torch.Tensor], cfgs, sms: Sequence[int],
                 max_spins: int = 1 << 22):
        from megatron_flux.kernels.gemm_rs import launch_gemm_rs

        self.world = world = len(a)
        if not (len(w) == len(cfgs) == len(sms) == world):
            raise ValueError(f"one weight, config and grid size per rank: {len(a)} activations, "
                             f"{len(w)} weights, {len(cfgs)} configs, {len(sms)} grid sizes")
        self.a, self.w, self.cfgs, self.sms, self.max_spins = list(a), list(w), list(cfgs), list(sms), max_spins
        self._launch_gemm_rs = launch_gemm_rs
        self.m_local, n = a[0].shape[0] // world, w[0].shape[0]
        dev, dtype = a[0].device, a[0].dtype
        self.data = [torch.zeros(world, self.m_local, n, device=dev, dtype=dtype) for _ in range(world)]
        self.flags = [torch.zeros(rs_signal_count(world, row_turns=True), dtype=torch.int32, device=dev)
                      for _ in range(world)]
        self._counters = rs_signal_count(world)  # where rs_row_turns' row-group counters start
        # the kernels reach slots and signals only through these tables: this object owns both
        self.data_ptrs = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64, device=dev)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=dev)
        self.errs = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(world)]
        self.outs = [torch.empty(self.m_local, n, device=dev, dtype=dtype) for _ in range(world)]

    def launch(self, r: int, epoch: int) -> None:
        """Rank ``r``'s fused call at ``epoch`` on the current stream."""
        self._launch_gemm_rs(self.a[r], self.w[r].t(), self.outs[r], self.data[r], self.data_ptrs,
                             self.flag_ptrs, None, self.errs[r], rank=r, world=self.world,
                             epoch=epoch, cfg=self.cfgs[r], num_sms=self.sms[r],
                             max_spins=self.max_spins)

    def load(self, streams: Optional[Sequence[torch.cuda.Stream]] = None) -> None:
        """Every rank's kernel binary loaded, one rank at a time, before the grids run at once.

        Under CUDA's lazy loading a binary's first launch waits for the running grids, so a grid
        spinning on its peer would wait for a launch queued behind it. Epoch 0: every wait
        passes at once (the signals start at 0; with ``rs_row_turns`` the rank's row-group
        counters are filled first, and every rank's zeroed after); the outputs are not
        meaningful. ``streams``: each rank's stream (the split tail's scratch is per stream)."""
        for r in range(self.world):
            if self.cfgs[r].rs_row_turns:  # alone, its row groups' counters must be full
                self.flags[r][self._counters:].fill_(1 << 30)  # (its grid resets them at its end)
            with torch.cuda.stream(streams[r] if streams else torch.cuda.current_stream()):
                self.launch(r, 0)
            torch.cuda.synchronize()
            self.check_protocol(0, ranks=[r])
        for flags in self.flags:  # what the later ranks counted into the earlier ones' counters
            flags[self._counters:].zero_()
        torch.cuda.synchronize()

    def poison(self) -> None:
        """Every slot and output NaN, so a tile nobody wrote shows."""
        for t in self.outs + self.data:
            t.fill_(float("nan"))

    def check_protocol(self, epoch: int, ranks: Optional[Sequence[int]] = None) -> None:
        """After a synchronize: each rank's error word clean, its arrival counter and row-group
        counters back at zero and (from epoch 1) every peer's signal at ``epoch``; raises naming
        the rank otherwise."""
        for r in range(self.world) if ranks is None else ranks:
            if self.errs[r].any():
                raise RuntimeError(f"rank {r}, epoch {epoch}: error word {self.errs[r].tolist()}")
            if int(self.flags[r][self.world]) != 0:
                raise RuntimeError(f"rank {r}, epoch {epoch}: arrival counter "
                                   f"{int(self.flags[r][self.world])}, not back at zero")
            if self.flags[r][self._counters:].any():  # rs_row_turns' row-group counters
                raise RuntimeError(f"rank {r}, epoch {epoch}: row-group counters not back at zero")
            for peer in range(self.world):
                if epoch and peer != r and int(self.flags[r][peer]) != epoch:
                    raise RuntimeError(f"rank {r}, epoch {epoch}: peer {peer}'s signal is "
                                       f"{int(self.flags[r][peer])}")

    def reference(self) -> torch.Tensor:
        """The fp32 sum of every rank's partial, ``[world * m_local, n]``."""
        return sum(x.float() @ y.t().float() for x, y in zip(self.a, self.w))

    def rel_errors(self, ref: torch.Tensor) -> list:
        """Per rank, ``|out - ref rows| / |ref rows|`` (NaN where a tile was left unwritten)."""
        m = self.m_local
        return [rel_err(out.float(), ref[r * m:(r + 1) * m]) for r, out in enumerate(self.outs)]
