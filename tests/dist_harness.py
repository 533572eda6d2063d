"""Run a function in N spawned processes that form a gloo (CPU) process group.

Import it from a test module (``from dist_harness import run_distributed, run_checks``; pytest
puts ``tests/`` on ``sys.path`` for rootdir-less test modules; the test modules here also add it
explicitly). The function must be defined at module level so the spawned processes can import
it by name.

* :func:`run_distributed` ``(fn, world_size, *args, timeout=120, tensor_model_parallel_size=None,
  **kwargs)`` calls ``fn(rank, world_size, *args, **kwargs)`` on every rank and returns the list
  of return values (rank order; they must pickle). If any rank raises, the other ranks are
  killed (they may be blocked in a collective waiting for it) and :class:`DistributedError`
  carries that rank's traceback. Nothing hangs: past ``timeout`` seconds every rank is killed
  and :class:`TimeoutError` says which ranks had not finished.
* :func:`run_checks` ``(checks, world_size, ...)`` runs several check functions
  ``check(rank, world_size)`` one after another in the *same* world (spawning costs seconds,
  mostly importing torch and megatron) and returns ``{check.__name__: None | failure text}``,
  so a test module can spawn once and report every check as its own pytest test.

``tensor_model_parallel_size=N`` also runs megatron-core's
``parallel_state.initialize_model_parallel(tensor_model_parallel_size=N)`` (and tears it down).
Each rank uses one torch thread, so a 4-rank world does not oversubscribe a small machine.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["DistributedError", "free_port", "run_checks", "run_distributed"]


class DistributedError(RuntimeError):
    """A rank of a :func:`run_distributed` world raised; the message holds its traceback."""


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, timeout, tp_size, fn, args, kwargs, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            if tp_size is not None:
                from megatron.core import parallel_state

                parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
            value = fn(rank, world_size, *args, **kwargs)
            payload = pickle.dumps(value)  # fail here, with a traceback, not in the queue thread
        finally:
            if tp_size is not None:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    tensor_model_parallel_size: Optional[int] = None,
    **kwargs: Any,
) -> List[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` gloo processes.

    Returns the ranks' return values in rank order. Raises :class:`DistributedError` with the
    first failing rank's traceback, or :class:`TimeoutError` after ``timeout`` seconds (the
    whole run, spawning included; collectives inside also time out after ``timeout``).
    """
    if tensor_model_parallel_size is not None and world_size % tensor_model_parallel_size:
        raise ValueError(f"world size {world_size} is not a multiple of TP {tensor_model_parallel_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, timeout, tensor_model_parallel_size, fn, args, kwargs, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)}: ranks {missing} of {world_size} did not finish "
                    f"within {timeout:.0f}s"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise DistributedError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                        f"without reporting (crash or kill)"
                    )
                continue
            if not ok:
                raise DistributedError(f"rank {rank} of {world_size} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [values[r] for r in range(world_size)]


def _run_checks_on_rank(rank: int, world_size: int, checks: Sequence[Callable]) -> Dict[str, Optional[str]]:
    outcome: Dict[str, Optional[str]] = {}
    for check in checks:
        try:
            check(rank, world_size)
            outcome[check.__name__] = None
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - reported per check (pytest.fail is a BaseException)
            outcome[check.__name__] = traceback.format_exc()
    return outcome


def run_checks(
    checks: Sequence[Callable[[int, int], None]],
    world_size: int,
    *,
    timeout: float = 120.0,
    tensor_model_parallel_size: Optional[int] = None,
) -> Dict[str, Optional[str]]:
    """Run each ``check(rank, world_size)`` in turn in one world; ``{name: None | failure}``.

    A check fails if it raised on any rank; the failure text has each failing rank's
    traceback. A check that raises on one rank only, before a collective the others enter,
    leaves them waiting: the whole run then ends in :class:`TimeoutError` after ``timeout``.
    """
    names = [c.__name__ for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"check names must be unique: {names}")
    per_rank = run_distributed(
        _run_checks_on_rank,
        world_size,
        list(checks),
        timeout=timeout,
        tensor_model_parallel_size=tensor_model_parallel_size,
    )
    merged: Dict[str, Optional[str]] = {}
    for name in names:
        failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(per_rank) if res[name] is not None]
        merged[name] = "\n".join(failures) if failures else None
    return merged
