"""The GPU tests' worker protocol (``gpu_harness.nccl_worker``), on the CPU: what a worker reports
and that a decorated module-level worker still pickles by name, as spawn needs."""

import pickle
import queue as queue_mod

from helpers.gpu_harness import nccl_worker


@nccl_worker
def _returns(rank, world, port, factor):
    return rank * factor + world


@nccl_worker
def _raises(rank, world, port):
    raise AssertionError(f"rank {rank} saw a wrong value")


def test_worker_reports_its_payload_or_traceback_once():
    q = queue_mod.Queue()
    _returns(1, 2, 12345, 10, q)
    assert q.get_nowait() == (1, "ok", 12)
    _raises(0, 2, 12345, q)
    rank, status, text = q.get_nowait()
    assert (rank, status) == (0, "error")
    assert "AssertionError: rank 0 saw a wrong value" in text and "_raises" in text
    assert q.empty()


def test_decorated_worker_pickles_by_name():
    assert _returns.__name__ == "_returns" and _returns.__module__ == __name__
    assert pickle.loads(pickle.dumps(_returns)) is _returns
