"""``auto`` at the level that users pay for: the backend that makes this job's step fastest.

Per-op tables are timed in isolation. They cannot see a host-bound step, where the GPU idles
between kernels and the extra host time of a fused call costs more than the communication it
hides; nor what a job runs beside the TP ops. So in Megatron training, ``--flux-backend auto``
times the candidates in the job itself, in its first iterations, and keeps the fastest:

1. the first ``start_after`` iterations run the per-op ``auto`` (Megatron's start-up: the first
   iterations of a job run several times slower than the rest, allocator and compile included);
2. a warm-up block runs each candidate for one iteration (compiles, workspaces), not timed;
3. ``rounds`` rounds run each candidate for ``steps_per_block`` iterations, the order rotated
   every round so that drift hits every candidate alike; the first iteration of each block is
   dropped (the switch), the rest are timed between the starts of consecutive iterations, with
   the GPU synchronised at each start (only while selecting);
4. paired, as the benchmarks are: per round, the median of the ``megatron`` block over each
   candidate's block median; over the rounds (six: in 2×H200 micro-batch-1 jobs, medians of
   three such pairs for one setting spread 0.99-1.09 across a job, of six 1.02-1.06), the
   median of those ratios. ``megatron``
   (megatron-core's own code in the same layers, the stock step) is kept unless another
   candidate is at least ``min_gain`` (2 %) faster that way: a choice inside the noise would
   only risk a slower job (in one 2×H200 job, blocks of the same backend measured 1.6 % apart,
   and a setting picked at 0.8 % ran 0.5 % slower than stock afterwards). Without ``megatron`` among the candidates, the lowest median step wins. TP rank
   0's choice is broadcast to its TP group (the fused ops need every rank of the group on the
   same path), and logged once.

The candidates are layer settings (``flux_backend``): by default ``megatron``, ``nccl``
(megatron-flux's own path without fused kernels), ``auto`` (the fused kernels where the
tables say they win) and ``flux`` (the fused kernels for every op: the tables time ops alone,
and in a 2×H200 micro-batch-1 job the per-op choice ran 1.058× stock where fused everywhere
ran 1.081×). With CUDA graphs on, the layers' code is frozen into the graphs at capture,
so there is nothing to switch between: the selection is skipped and the per-op ``auto`` runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["StepAutoSelector", "flux_layers", "install_step_auto", "set_layers_backend"]

DEFAULT_CANDIDATES = ("megatron", "nccl", "auto", "flux")
TAG = "[flux-auto]"


def flux_layers(model: Any) -> List[Any]:
    """Every Flux linear of ``model`` (a module, or a list of model chunks)."""
    from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear

    chunks = model if isinstance(model, (list, tuple)) else [model]
    flux = (FluxColumnParallelLinear, FluxRowParallelLinear)
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, flux)]


def set_layers_backend(layers: Sequence[Any], name: str) -> None:
    """Set ``flux_backend`` on every layer of ``layers``."""
    for layer in layers:
        layer.flux_backend = name


def graphs_enabled(config: Any) -> bool:
    """Whether megatron-core will capture CUDA graphs for this ``TransformerConfig``."""
    impl = getattr(config, "cuda_graph_impl", None)
    if impl not in (None, "none"):
        return True
    return bool(getattr(config, "enable_cuda_graph", False)
                or getattr(config, "external_cuda_graph", False))


class StepAutoSelector:
    """Chooses ``flux_backend`` for a job's Flux linears from its measured steps (see the module
    docstring). Call :meth:`step` at the start of every training iteration, before the first
    forward of that iteration (:func:`install_step_auto` does so from a forward pre-hook);
    ``iteration`` is the job's iteration number; later calls with the same number (the
    iteration's other micro-batches) change nothing."""

    def __init__(self, layers: Sequence[Any], *, candidates: Sequence[str] = DEFAULT_CANDIDATES,
                 start_after: int = 6, steps_per_block: int = 3, rounds: int = 6,
                 min_gain: float = 0.02, group=None,
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.perf_counter,
                 synchronize: Optional[Callable[[], None]] = None):
        from megatron_flux.backends.registry import validate_backend_name

        if len(candidates) < 2:
            raise ValueError("StepAutoSelector: name at least two candidates")
        for name in candidates:
            validate_backend_name(name)
        if steps_per_block < 2 or rounds < 1 or start_after < 0:
            raise ValueError("StepAutoSelector: steps_per_block >= 2, rounds >= 1, "
                             "start_after >= 0")
        self.layers = list(layers)
        self.candidates = list(candidates)
        self.steps_per_block = steps_per_block
        self.min_gain = float(min_gain)
        self.group = group
        self._log, self._clock = log, clock
        self._sync = synchronize if synchronize is not None else _synchronize
        # the plan: one (candidate, round or None if not timed) per iteration
        plan = [(name, None) for name in self.candidates]  # warm-up block
        for r in range(rounds):
            order = self.candidates[r % len(self.candidates):] + self.candidates[:r % len(self.candidates)]
            for name in order:
                plan += [(name, None)] + [(name, r)] * (steps_per_block - 1)
        self._plan = plan
        self.start_after = start_after
        self._first: Optional[int] = None  # the first iteration seen
        self._last: Optional[tuple] = None  # (iteration, its planned entry, start time)
        self.samples: Dict[str, List[float]] = {name: [] for name in self.candidates}
        self.rounds: List[Dict[str, List[float]]] = [{} for _ in range(rounds)]
        self.decided: Optional[str] = None

    @property
    def iterations_needed(self) -> int:
        """Iterations from the first one seen until the choice is made."""
        return self.start_after + len(self._plan) + 1

    def step(self, iteration: int) -> Optional[str]:
        """The start of ``iteration``: time the iteration that just ended, set the layers'
        backend for this one; returns the backend chosen, once chosen (``None`` before)."""
        if self.decided is not None:
            return self.decided
        if self._last is not None and iteration == self._last[0]:
            return None  # another micro-batch of the iteration already seen
        if self._first is None:
            self._first = iteration
        index = iteration - self._first - self.start_after  # position in the plan
        if index < 0:
            return None
        self._sync()
        now = self._clock()
        if self._last is not None:
            last_iter, (name, rnd), started = self._last
            if rnd is not None and iteration == last_iter + 1:
                self.samples[name].append(now - started)
                self.rounds[rnd].setdefault(name, []).append(now - started)
        if index >= len(self._plan):
            self._decide()
            return self.decided
        entry = self._plan[index]
        if self._last is None or self._last[1][0] != entry[0]:
            set_layers_backend(self.layers, entry[0])
        self._last = (iteration, entry, now)
        return None

    def paired_speedups(self) -> Dict[str, float]:
        """Per candidate, the median over rounds of megatron's block median over its own (> 1:
        faster than megatron); empty without ``megatron`` among the candidates."""
        out = {}
        for name in self.candidates:
            ratios = [statistics.median(r["megatron"]) / statistics.median(r[name])
                      for r in self.rounds if r.get("megatron") and r.get(name)]
            if ratios and name != "megatron":
                out[name] = statistics.median(ratios)
        return out

    def _decide(self) -> None:
        medians = {name: statistics.median(s) for name, s in self.samples.items() if s}
        choice = min(medians, key=medians.get)
        speedups = self.paired_speedups()
        if "megatron" in medians:
            choice = "megatron"
            best = max(speedups, key=speedups.get, default=None)
            if best is not None and speedups[best] >= 1.0 + self.min_gain:
                choice = best
        choice = self._agree(choice)
        self.decided = choice
        set_layers_backend(self.layers, choice)
        times = ", ".join(f"{name} {medians[name] * 1e3:.1f} ms"
                          + (f" (x{speedups[name]:.3f})" if name in speedups else "")
                          for name in self.candidates if name in medians)
        self._log(f"{TAG} flux_backend={choice!r} for this job, from its measured steps "
                  f"(median step, paired speedup vs megatron: {times}; "
                  f"{len(next(iter(self.samples.values())))} timed iterations each; another "
                  f"backend must beat megatron by {self.min_gain:.1%})")

    def _agree(self, choice: str) -> str:
        """TP rank 0's choice on every rank of the group (the fused ops need all of them)."""
        group = self.group
        if group is None or not torch.distributed.is_initialized() or group.size() < 2:
            return choice
        device = (torch.device("cuda", torch.cuda.current_device())
                  if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu"))
        code = torch.tensor([self.candidates.index(choice)], dtype=torch.int64, device=device)
        torch.distributed.broadcast(code, src=torch.distributed.get_global_rank(group, 0),
                                    group=group)
        return self.candidates[int(code.item())]


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _megatron_iteration() -> Optional[int]:
    """Megatron's current training iteration (``args.curr_iteration``), or ``None`` outside
    ``megatron.training``."""
    try:
        from megatron.training.global_vars import get_args
    except ImportError:
        return None
    try:
        return getattr(get_args(), "curr_iteration", None)
    except (AssertionError, AttributeError):  # args not initialised
        return None


def _megatron_train_iters() -> Optional[int]:
    """Megatron's ``args.train_iters`` (None for jobs sized in samples, or outside
    ``megatron.training``)."""
    try:
        from megatron.training.global_vars import get_args
    except ImportError:
        return None
    try:
        return getattr(get_args(), "train_iters", None)
    except (AssertionError, AttributeError):
        return None


def install_step_auto(model_chunks: Sequence[Any], *, log: Callable[[str], None] = print,
                      iteration: Callable[[], Optional[int]] = _megatron_iteration,
                      train_iters: Callable[[], Optional[int]] = _megatron_train_iters,
                      **selector_args) -> Optional[StepAutoSelector]:
    """Let ``auto`` pick the job's backend from its measured steps: a forward pre-hook on the
    first model chunk runs :meth:`StepAutoSelector.step` at the first forward of each training
    iteration (``iteration()``, default Megatron's ``args.curr_iteration``). Returns the selector,
    or ``None`` (with one log line) where there is nothing to choose: no Flux linear set to
    ``auto``, or CUDA graphs on. A job whose iterations left at its first one (``train_iters()``,
    default Megatron's ``args.train_iters``, less that iteration) are fewer than the selection
    needs does not start it: rotating the candidates without a choice would only spend the
    job's steps, so the per-op ``auto`` runs throughout (one log line says so)."""
    chunks = list(model_chunks)
    layers = [layer for layer in flux_layers(chunks) if layer.flux_backend == "auto"]
    if not layers:
        return None
    config = getattr(layers[0], "config", None)
    if graphs_enabled(config):
        log(f"{TAG} CUDA graphs are on: the layers' code is fixed at capture, so 'auto' chooses "
            "per op from the tuning tables (fused calls are captured on graph workspaces)")
        return None
    selector = StepAutoSelector(layers, group=getattr(layers[0], "tp_group", None), log=log,
                                **selector_args)
    state = {"iteration": None}

    def pre_hook(module, args):
        if not module.training:
            return None
        it = iteration()
        if it is None or it == state["iteration"]:
            return None
        if state["iteration"] is None:  # the job's first training iteration here
            total = train_iters()
            if total is not None and total - it < selector.iterations_needed:
                log(f"{TAG} {total - it} iterations left, fewer than the {selector.iterations_needed} "
                    "that choosing from measured steps takes: 'auto' chooses per op from the "
                    "tuning tables for this job")
                selector.handle.remove()
                return None
            log(f"{TAG} choosing this job's backend from its steps: from its iteration "
                f"{it + selector.start_after + 1} on, {', '.join(selector.candidates)} take turns "
                f"until iteration {it + selector.iterations_needed}, then the fastest runs")
        state["iteration"] = it
        if selector.step(it) is not None:
            selector.handle.remove()
        return None

    selector.handle = chunks[0].register_forward_pre_hook(pre_hook)
    return selector
