"""Run a function in N spawned processes that form a gloo (CPU) process group.

Import it from a test module (``from helpers.dist_harness import run_distributed, run_checks``;
``tests/`` is on ``sys.path``: see :mod:`helpers`). The functions it runs must be defined at
module level so the spawned processes can import them by name.

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

* :func:`gloo_world_of_one` (a context manager): an in-process gloo group of one rank, for the
  tests that need a process group but no peers; torn down afterwards if it made it.

``tensor_model_parallel_size=N`` also runs megatron-core's
``parallel_state.initialize_model_parallel(tensor_model_parallel_size=N)`` (and tears it down).
Each rank uses one torch thread, so a 4-rank world does not oversubscribe a small machine.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["DistributedError", "free_port", "gloo_world_of_one", "run_checks", "run_distributed"]

#: after a check fails on some rank, how long the other ranks get to finish that check before
#: the world is stopped (a rank that failed before a collective leaves the others blocked in it)
CHECK_GRACE_S = 15.0

_PROGRESS = None  # in a worker: the queue run_checks reports each finished check through


class DistributedError(RuntimeError):
    """A rank of a :func:`run_distributed` world raised; the message holds its traceback."""


def free_port() -> int:
    """A localhost TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_world_of_one():
    """``torch.distributed`` as a gloo group of one rank in this process (file rendezvous);
    yields ``dist.group.WORLD``. An existing group is reused and left alone."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    path = None
    if created:
        fd, path = tempfile.mkstemp()
        os.close(fd)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()
            with contextlib.suppress(FileNotFoundError):  # the FileStore may remove it itself
                os.unlink(path)


def _worker(rank, world_size, port, timeout, tp_size, fn, args, kwargs, messages) -> None:
    global _PROGRESS
    _PROGRESS = messages
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
        messages.put(("done", rank, payload))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        messages.put(("error", rank, traceback.format_exc()))


def _run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    *,
    timeout: float,
    tensor_model_parallel_size: Optional[int],
    on_progress: Optional[Callable[[int, Any], Optional[float]]] = None,
) -> List[Any]:
    """Spawn the world and wait for it. ``on_progress(rank, item)`` sees what the ranks report
    along the way and returns ``None`` or an earlier deadline (a ``time.monotonic()`` value)
    for the world, in force until the next report."""
    if tensor_model_parallel_size is not None and world_size % tensor_model_parallel_size:
        raise ValueError(f"world size {world_size} is not a multiple of TP {tensor_model_parallel_size}")
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, timeout, tensor_model_parallel_size, fn, args, kwargs, messages),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: Dict[int, Any] = {}
    name = getattr(fn, "__name__", repr(fn))
    deadline = overall_deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"{name}: ranks {missing} of {world_size} did not finish in time")
            try:
                kind, rank, payload = messages.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise DistributedError(
                        f"{name}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                        f"without reporting (crash or kill)"
                    )
                continue
            if kind == "error":
                raise DistributedError(f"{name}: rank {rank} of {world_size} failed:\n{payload}")
            if kind == "progress":
                early = on_progress(rank, payload) if on_progress else None
                deadline = overall_deadline if early is None else min(overall_deadline, early)
                continue
            values[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if len(values) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        messages.close()
    return [values[r] for r in range(world_size)]


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
    return _run_world(
        fn, world_size, args, kwargs, timeout=timeout, tensor_model_parallel_size=tensor_model_parallel_size
    )


def _run_checks_on_rank(rank: int, world_size: int, checks: Sequence[Callable]) -> None:
    for check in checks:
        try:
            check(rank, world_size)
            failure = None
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - reported per check (pytest.fail is a BaseException)
            failure = traceback.format_exc()
        _PROGRESS.put(("progress", rank, (check.__name__, failure)))


def run_checks(
    checks: Sequence[Callable[[int, int], None]],
    world_size: int,
    *,
    timeout: float = 120.0,
    tensor_model_parallel_size: Optional[int] = None,
) -> Dict[str, Optional[str]]:
    """Run each ``check(rank, world_size)`` in turn in one world; ``{name: None | failure}``.

    A check fails if it raised on any rank; the failure text has each failing rank's
    traceback. A check that fails on one rank while another is still inside it (typically
    blocked in a collective the failed rank never entered) cannot be recovered from: once the
    ranks have not all finished a failed check within ``CHECK_GRACE_S`` seconds, the world is
    stopped and the checks not finished by every rank are reported as not run.
    """
    names = [c.__name__ for c in checks]
    if len(set(names)) != len(names):
        raise ValueError(f"check names must be unique: {names}")
    reports: Dict[str, Dict[int, Optional[str]]] = {n: {} for n in names}
    grace = {"until": None}  # set while a failed check is unfinished on some rank

    def on_progress(rank: int, item) -> Optional[float]:
        check_name, failure = item
        reports[check_name][rank] = failure
        failed = [n for n in names if any(f is not None for f in reports[n].values())]
        if not any(len(reports[n]) < world_size for n in failed):
            grace["until"] = None
        elif grace["until"] is None:
            grace["until"] = time.monotonic() + CHECK_GRACE_S
        return grace["until"]

    stopped = None
    try:
        _run_world(
            _run_checks_on_rank,
            world_size,
            (list(checks),),
            {},
            timeout=timeout,
            tensor_model_parallel_size=tensor_model_parallel_size,
            on_progress=on_progress,
        )
    except TimeoutError as exc:
        if not any(f is not None for rep in reports.values() for f in rep.values()):
            raise
        stopped = exc  # stopped after a failure left the ranks out of step
    merged: Dict[str, Optional[str]] = {}
    first_failed = next(
        (n for n in names if any(f is not None for f in reports[n].values())), None
    )
    for name in names:
        texts = [f"rank {r}:\n{f}" for r, f in sorted(reports[name].items()) if f is not None]
        missing = sorted(set(range(world_size)) - set(reports[name]))
        if missing:
            texts.append(
                f"not finished on ranks {missing}: the world was stopped ({stopped}) after "
                f"{first_failed} failed and left the ranks out of step"
            )
        merged[name] = "\n".join(texts) if texts else None
    return merged
