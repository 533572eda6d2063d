"""Interleaved, rank-synchronised timing of several methods on the same problem.

Why interleaved: GPU clocks, NVLink traffic from other jobs and thermal state drift over seconds.
Timing method A for a minute and then method B attributes that drift to the methods. Here every
trial runs each method once, in turn, so drift lands on all methods alike. The order changes from
trial to trial (:func:`trial_order`): the first method rotates, and the rest are shuffled with a
seed that is the trial number (the same on every rank). A plain rotation keeps each method's
predecessor fixed, and on 2xH200/4xH200 a method that always followed the untuned fused kernel
measured 5-20 % slower at small m than the *same* NCCL callable that always followed ``comm``.

One timed block = ``iters`` back-to-back calls of one method, bracketed by CUDA events on the
current stream (``time.perf_counter`` on CPU, where the gloo collectives are synchronous),
after ``sample_warmup`` untimed calls of the same method. Those matter on a power-limited GPU:
the SM clock follows the last milliseconds of load (an H200 ran 1.98 GHz idle and ~1.5 GHz
under sustained GEMMs), so a block that starts after the idle sync point, or after
a lighter method, runs its first calls faster; on one GPU a 0.7 ms GEMM measured 5-10 % apart
depending on its neighbour without them.
Before each block all ranks meet at a sync point that also waits for their GPUs to go idle, so
every rank starts the block together. The per-iteration time of a block is ``elapsed / iters``;
the time of a trial is the **maximum over ranks** (a collective op is only as fast as its slowest
rank). A method's result is the **median over trials**; its spread is **max − min over trials**
(the full range, the most conservative of the usual spreads; ``trials_ms`` is kept so readers
can compute any other).

Python's garbage collector is collected once and then disabled for the duration of one call of
:func:`time_interleaved` (as ``timeit`` does): at small m the ops are host-bound, and a
collection triggered by one method's allocations would otherwise land in whichever method's
block comes next.

Failures: the sync point is an all-reduce of per-method failure flags, so a method that raised
on any rank is dropped on every rank before anyone calls it again; no rank is left waiting in a
collective that its peers skipped. (A method that raises on one rank *inside* a collective that
the other ranks have already entered cannot be rescued from here; the process group's timeout
ends that run.)
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


def agree_flags(
    flags: Sequence[bool], group: Optional[dist.ProcessGroup], device: torch.device
) -> List[bool]:
    """Element-wise OR of ``flags`` over all ranks of ``group``.

    Doubles as a barrier that includes the GPUs: reading the reduced flags back on the host
    waits for the all-reduce, which on NCCL starts only after every rank's queued GPU work.
    """
    if not flags:
        flags = [False]
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def gather_failures(local: Dict[str, str], group: Optional[dist.ProcessGroup]) -> Dict[str, str]:
    """Merge every rank's ``{name: failure text}`` (collective; every rank gets the same dict).

    A name fails everywhere if it failed anywhere, so all ranks drop the same methods; the text
    says which rank failed and why (one plain text when every rank failed the same way).
    """
    world = dist.get_world_size(group)
    everyone: List[Optional[Dict[str, str]]] = [None] * world
    dist.all_gather_object(everyone, dict(local), group=group)
    merged: Dict[str, str] = {}
    names = list(dict.fromkeys(n for d in everyone for n in (d or {})))
    for name in names:
        per_rank = [(r, d[name]) for r, d in enumerate(everyone) if d and name in d]
        texts = {t for _, t in per_rank}
        if len(per_rank) == world and len(texts) == 1:
            merged[name] = per_rank[0][1]
        else:
            merged[name] = "; ".join(f"rank {r}: {t}" for r, t in per_rank)
    return merged


def short_error(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` plus its innermost frame, short enough for a JSON row."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg[:300]}{where}"


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence (the mean of the middle two for even lengths)."""
    if not xs:
        raise ValueError("median of an empty sequence")
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> float:
    """Max − min of a non-empty sequence: the full range over trials."""
    if not xs:
        raise ValueError("spread of an empty sequence")
    return float(max(xs) - min(xs))


@dataclass
class TimingResult:
    """Per-method trial times (ms per iteration, max over ranks) and per-method failures."""

    trials_ms: Dict[str, List[float]] = field(default_factory=dict)
    errors: Dict[str, str] = field(default_factory=dict)


def trial_order(names: Sequence[str], trial: int) -> List[str]:
    """Trial ``trial``'s order: method ``trial mod len`` first, the others shuffled (seed ``trial``).

    Deterministic, so every rank runs the same order without talking.
    """
    if not names:
        return []
    first = names[trial % len(names)]
    rest = [n for n in names if n != first]
    random.Random(trial).shuffle(rest)
    return [first] + rest


def time_interleaved(
    fns: Dict[str, Callable[[], object]],
    *,
    trials: int,
    iters: int,
    warmup: int,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
    sample_warmup: int = 0,
) -> TimingResult:
    """Time every callable in ``fns`` (see the module docstring for the protocol). ``warmup``
    calls per method run once before the trials; ``sample_warmup`` before every timed block.

    Must be called on every rank of ``group`` with the same method names in the same order.
    Returns times only for methods that never failed on any rank; the others get an error text
    naming the rank(s) that failed (the same on every rank).
    """
    if trials < 1 or iters < 1 or warmup < 0 or sample_warmup < 0:
        raise ValueError(f"need trials >= 1, iters >= 1, warmup >= 0, sample_warmup >= 0 (got "
                         f"{trials}, {iters}, {warmup}, {sample_warmup})")
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _time_interleaved(fns, trials=trials, iters=iters, warmup=warmup, group=group,
                                 device=device, sample_warmup=sample_warmup)
    finally:
        if gc_was_enabled:
            gc.enable()


def _time_interleaved(fns, *, trials, iters, warmup, group, device, sample_warmup) -> TimingResult:
    names = list(fns)
    result = TimingResult()
    alive = {n: True for n in names}
    local_err: Dict[str, str] = {}

    def run_block(name: str, count: int) -> None:
        if count and alive[name] and name not in local_err:
            try:
                for _ in range(count):
                    fns[name]()
            except Exception as exc:  # recorded, agreed on at the next sync point
                local_err[name] = short_error(exc)

    def sync() -> None:
        failed = agree_flags([n in local_err for n in names], group, device)
        for n, f in zip(names, failed):
            if f:
                alive[n] = False

    use_events = device.type == "cuda"
    # Warm-up per method (compiles Triton kernels, picks cuBLAS algorithms, fills allocators).
    for name in names:
        run_block(name, warmup)
        sync()

    # times[t][j]: ms/iter of method j in trial t on this rank; -1 = not timed.
    times = [[-1.0] * len(names) for _ in range(trials)]
    events = []
    for t in range(trials):
        for name in trial_order(names, t):
            sync()
            if not alive[name]:
                continue
            j = names.index(name)
            run_block(name, sample_warmup)
            if use_events:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run_block(name, iters)
                end.record()
                events.append((t, j, start, end))
            else:
                t0 = time.perf_counter()
                run_block(name, iters)
                times[t][j] = (time.perf_counter() - t0) * 1e3 / iters
    sync()
    if use_events:
        torch.cuda.synchronize(device)
        for t, j, start, end in events:
            times[t][j] = start.elapsed_time(end) / iters

    result.errors = gather_failures(local_err, group)
    # A failed block left a partial time; forget all times of failed methods.
    for j, n in enumerate(names):
        if not alive[n]:
            for row in times:
                row[j] = -1.0
    reduced = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    per_trial = reduced.cpu().tolist()
    for j, n in enumerate(names):
        if alive[n]:
            result.trials_ms[n] = [per_trial[t][j] for t in range(trials)]
    return result
