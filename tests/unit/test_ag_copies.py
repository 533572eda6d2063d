"""The AllGather's copy-engine schedule, executed on simulated ranks' CPU
workspaces: after every rank's copies, every rank holds every peer's rows, every chunk signal
it waits on carries the epoch, and nothing else was written."""

import pytest
import torch

from helpers.fake_symm import FakeWorld

from megatron_flux.comm.ag_copies import ag_chunk_copies


def _exchange(world, m_local, k, chunk, epoch=7):
    w = FakeWorld(world, "ag", torch.float16)
    chunks = -(-m_local // chunk)
    w.reserve(world * m_local * k, world * chunks)
    parity = epoch & 1
    shards = [torch.randn(m_local, k).half() for _ in range(world)]
    plans = []
    for r in range(world):
        plans.append(ag_chunk_copies(w.ws[r], shards[r], rank=r, world=world, parity=parity,
                                     chunk=chunk))
    for plan in plans:  # each rank's copy engine, one after another
        for dst, src, flags, index in plan:
            dst.copy_(src)
            flags[index] = epoch
    return w, shards, plans, chunks, parity


@pytest.mark.parametrize("world,m_local,chunk", [(2, 8, 8), (3, 10, 4), (4, 16, 5), (8, 3, 1)])
def test_every_rank_gets_every_peers_rows_and_signals(world, m_local, chunk):
    k = 6
    w, shards, plans, chunks, parity = _exchange(world, m_local, k, chunk)
    for r, ws in enumerate(w.ws):
        gathered = ws.data(r, parity, world * m_local * k).view(world * m_local, k)
        for s in range(world):
            rows = gathered[s * m_local:(s + 1) * m_local]
            if s != r:
                assert torch.equal(rows, shards[s]), (r, s)
            else:  # the own slot is left alone (the GEMM reads the shard itself)
                assert not torch.equal(rows, shards[s])
        flags = ws.flags(r, parity)
        awaited = [s * chunks + c for s in range(world) if s != r for c in range(chunks)]
        assert all(flags[i] == 7 for i in awaited), (r, flags.tolist())
        others = [i for i in range(flags.numel()) if i not in awaited]
        assert (flags[others] == 0).all(), (r, flags.tolist())
        assert (ws.flags(r, 1 - parity) == 0).all()
        other_slot = ws.data(r, 1 - parity, world * m_local * k)
        assert (other_slot.view(torch.uint8) == 0xAB).all(), "wrote the other parity's slot"


def test_copies_go_in_the_order_the_consumers_need_them():
    world, m_local, chunk = 4, 8, 4
    w, shards, plans, chunks, parity = _exchange(world, m_local, 2, chunk)
    for r, plan in enumerate(plans):
        segs = [index // chunks for _, _, _, index in plan]
        # peer r-1 reaches segment r first, then r-2, ...: every index is segment r
        assert segs == [r] * ((world - 1) * chunks)
        owners = [next(p for p in range(world)
                       if w.ws[p].flags(p, parity).data_ptr() == flags.data_ptr())
                  for _, _, flags, _ in plan]
        assert owners == [(r - step) % world for step in range(1, world) for _ in range(chunks)]
        assert len(plan) == (world - 1) * chunks
