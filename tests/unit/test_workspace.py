"""Layout of the symmetric workspace (simulated ranks on CPU tensors, see fake_symm.py).

The regression guarded here: at TP >= 3 a peer that finished call ``e`` may already signal call
``e + 1`` (under another shape's signal layout) while this rank still waits for a third rank's
call-``e`` signal. Signals of consecutive calls must therefore never share a word."""

import torch

from helpers.fake_symm import FakeWorld


def _span(t):
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


def _overlap(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def test_signal_regions_and_data_slots_are_disjoint_per_parity():
    w = FakeWorld(3)
    w.reserve(data_elems=1000, flag_count=40)
    for r, ws in enumerate(w.ws):
        views = [ws.flags(r, 0), ws.flags(r, 1), ws.data(r, 0, 1000), ws.data(r, 1, 1000)]
        for i in range(4):
            for j in range(i + 1, 4):
                assert not _overlap(views[i], views[j]), (r, i, j)
        assert ws.flags(r, 0).numel() >= 40 and ws.data(r, 1, 1000).numel() == 1000


def test_peer_views_and_pointer_tables_agree():
    w = FakeWorld(4)
    w.reserve(data_elems=512, flag_count=16)
    for ws in w.ws:
        for parity in (0, 1):
            for peer in range(4):
                owner = w.ws[peer]
                assert ws.flags(peer, parity).data_ptr() == owner.flags(peer, parity).data_ptr()
                assert ws.flag_ptrs(parity)[peer].item() == owner.flags(peer, parity).data_ptr()
                assert ws.data_ptrs(parity)[peer].item() == owner.data(peer, parity, 8).data_ptr()
            # uint32 view (stream memory ops) and int32 view (kernels) are the same words
            assert ws.flags(0, parity, torch.uint32).data_ptr() == ws.flags(0, parity).data_ptr()


def test_next_call_signals_never_share_a_word_with_this_call():
    """AG at TP=3: call e awaits rank 2's chunks at 4 chunks per segment; rank 1, already in call
    e + 1 at 8 chunks per segment, signals segment 1. In one shared region these index sets
    overlap (8..11 vs 8..15); with per-parity regions they are different words."""
    world, me = 3, 0
    w = FakeWorld(world)
    w.reserve(data_elems=64, flag_count=world * 8)
    ws = w.ws[me]
    for epoch in (5, 6):
        awaited = {ws.flags(me, epoch & 1)[2 * 4 + c].data_ptr() for c in range(4)}
        early = {ws.flags(me, (epoch + 1) & 1)[1 * 8 + c].data_ptr() for c in range(8)}
        assert not awaited & early
        assert {2 * 4 + c for c in range(4)} & {1 * 8 + c for c in range(8)}  # the same indices


def test_growth_keeps_the_layout_consistent_on_every_rank():
    w = FakeWorld(2)
    w.reserve(data_elems=100, flag_count=4)
    w.reserve(data_elems=10_000, flag_count=64)  # grows: a new allocation on every rank
    for ws in w.ws:
        assert ws.flag_count >= 64 and ws.data_elems >= 10_000
        assert not _overlap(ws.flags(ws.rank, 1), ws.data(ws.rank, 0, 10_000))
        assert (ws.flags(ws.rank, 0) == 0).all() and (ws.flags(ws.rank, 1) == 0).all()


def test_forget_drops_only_the_tagged_memos():
    ws = FakeWorld(2).ws[0]
    ws.memo(("rs-ce", 1), lambda: "a")
    ws.memo(("rs-ce", 2), lambda: "b")
    ws.memo(("ag-call", 1), lambda: "c")
    ws.forget("rs-ce")
    assert ws.memo(("rs-ce", 1), lambda: "new") == "new"
    assert ws.memo(("ag-call", 1), lambda: "new") == "c"


def test_growth_keeps_the_old_buffer_and_its_address_tables():
    """A captured CUDA graph keeps addressing the buffer and the pointer tables it was captured
    with, so growth retires them instead of freeing them; ``fits`` says when a reservation
    would allocate (which a capture cannot)."""
    w = FakeWorld(2)
    w.reserve(data_elems=100, flag_count=4)
    ws = w.ws[0]
    assert ws.fits(100, 4) and not ws.fits(ws.data_elems + 1, 4) and not ws.fits(100, 1000)
    old = [ws._buffer, ws.flag_ptrs(0), ws.flag_ptrs(1), ws.data_ptrs(0), ws.data_ptrs(1)]
    w.reserve(data_elems=10_000, flag_count=64)
    assert all(any(t is r for r in ws._retired) for t in old)


def test_the_barrier_after_a_growth_is_bounded():
    """A peer that never grows with this rank must not leave it spinning forever (a tune on
    2x H200 did): every growth's barrier carries the timeout."""
    from megatron_flux.comm.workspace import BARRIER_TIMEOUT_MS

    w = FakeWorld(2)
    w.reserve(data_elems=100, flag_count=4)
    w.reserve(data_elems=10_000, flag_count=64)
    for ws in w.ws:
        assert ws._handle.barrier_timeouts == [BARRIER_TIMEOUT_MS]
    assert 0 < BARRIER_TIMEOUT_MS <= 10 * 60 * 1000


def test_a_new_allocation_is_drained_before_it_is_shared(monkeypatch):
    """The allocator's memset of a new block (the barrier's signal pad included) runs
    asynchronously on the device; a peer that got through the rendezvous first could signal
    into the pad before it, and the memset would erase that signal (a barrier that never ends).
    So every growth drains the device between the allocation and the rendezvous."""
    from megatron_flux.comm import workspace

    w = FakeWorld(2)
    events = []
    monkeypatch.setattr(workspace, "_drain_before_sharing",
                        lambda buf: events.append(("drain", buf.data_ptr())))
    rendezvous = w.fake.rendezvous

    def recorded(buf):
        events.append(("rendezvous", buf.data_ptr()))
        return rendezvous(buf)

    monkeypatch.setattr(w.fake, "rendezvous", recorded)
    w.reserve(data_elems=100, flag_count=4)
    w.reserve(data_elems=10_000, flag_count=64)  # grows
    w.reserve(data_elems=50, flag_count=2)  # fits: nothing allocated, nothing drained
    assert [kind for kind, _ in events] == ["drain", "rendezvous"] * 4
    assert all(events[i][1] == events[i + 1][1] for i in range(0, len(events), 2))
