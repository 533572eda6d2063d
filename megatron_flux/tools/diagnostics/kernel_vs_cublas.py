"""GEMM quality of the fused kernels with communication disabled, against cuBLAS.

``python -m megatron_flux.tools.diagnostics.kernel_vs_cublas [--tp 2] [--json PATH]`` on one GPU.

The fused kernels run their exact production code path, but wired to this GPU alone: every
signal is pre-set (no wait ever spins), AG+GEMM's "remote" rows are read from a local buffer and
GEMM+RS pushes its "remote" tiles into local memory and reduces local partials. What is left is
the GEMM plus the fused epilogue, which must stay within ~1.02x of cuBLAS for the overlap to pay.
Shapes are the benchmark grid's per-rank shapes at ``--tp``. Per shape it times the heuristic
default config, the shipped table's config (what the backend runs) and their stream-K variants
(``--configs``). Timing: CUDA events, ``--iters`` back-to-back launches per trial after
``--warmup`` untimed ones, methods interleaved inside every trial (in a shuffled order with
``--shuffle-seed``), median over trials. With ``--alternate`` the methods take turns launch by
launch instead, and each ratio is the median of per-round ratios to the cuBLAS launch beside it
(:func:`_time_alternating`): the SM clock moves under large GEMMs by more than the differences
being measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from typing import Callable, Dict, List

import torch

from megatron_flux.kernels.config import (ROW_GROUPS, GemmConfig, default_config, row_groups,
                                          rs_signal_count)

CANDIDATES = [
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True, warp_specialize=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=1, flatten=False),
    GemmConfig(128, 128, 64, 4, 4, 8, epilogue_split=1, flatten=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=False),
    GemmConfig(128, 128, 64, 4, 8, 8, epilogue_split=1, flatten=False),
    GemmConfig(64, 256, 64, 4, 4, 8, epilogue_split=2, flatten=True),
    GemmConfig(256, 128, 64, 3, 8, 8, epilogue_split=1, flatten=False),
]
#: GEMM+RS: the knobs of its schedule (TMA or vector pushes, flattened reduction loop)
RS_CANDIDATES = [
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=1, flatten=True, flatten_consume=True),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True, flatten_consume=False),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=2, flatten=True, flatten_consume=True,
               rs_tma_push=False),
    GemmConfig(128, 256, 64, 3, 8, 8, epilogue_split=1, flatten=True, flatten_consume=True,
               warp_specialize=True),
]


def _time(fns: Dict[str, Callable], trials: int, iters: int, warmup: int = 0,
          shuffle_seed=None, queue_ahead_ms: float = 0.0) -> Dict[str, List[float]]:
    """Per method, ``trials`` samples of the mean time of ``iters`` back-to-back calls, the
    methods interleaved inside every trial. ``warmup`` untimed calls of the same method run
    right before each sample: a GEMM's time depends on the clock the power limiter allows, and
    that follows the last few milliseconds of load, so without them a sample partly measures
    the method before it (on one H200 a 0.7 ms GEMM ran 5-10 % apart depending on its
    neighbour). With ``shuffle_seed`` the order of the methods changes from trial to trial.
    ``queue_ahead_ms``: see :func:`mean_ms`."""
    import random

    out = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    for fn in fns.values():  # warm-up / compile
        fn()
    torch.cuda.synchronize()
    for _ in range(trials):
        if rng is not None:
            rng.shuffle(order)
        for name in order:
            fn = fns[name]
            for _ in range(warmup):
                fn()
            out[name].append(mean_ms(fn, iters, queue_ahead_ms))
    return out


def _time_alternating(fns: Dict[str, Callable], trials: int, rounds: int, warmup: int = 0,
                      shuffle_seed=None, queue_ahead_ms: float = 0.0, base: str = "cublas"):
    """``(times, ratios)``: per method, ``trials`` samples of its mean GPU time per launch, and
    of the median over ``rounds`` of its time / ``base``'s time in the same round.

    A round launches every method once, back to back, each between its own pair of CUDA events
    (one event between neighbours), in an order shuffled per trial with ``shuffle_seed``; a
    trial is ``warmup`` untimed launches of each method, then ``rounds`` rounds, queued behind a
    sleep of ``queue_ahead_ms`` (:func:`mean_ms`). Why: on one H200 the SM clock steps by up
    to 25 % within tens of milliseconds under large GEMMs, for cuBLAS as for the fused kernels
    (per-launch times of gpt3-175b m = 1024 moved between 0.76 and 0.95 ms inside one block, each level held for many launches). Blocks of ``iters``
    launches per method then compare methods at different clocks; neighbours in one round
    share theirs."""
    import random

    names = list(fns)
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    times = {name: [] for name in names}
    ratios = {name: [] for name in names}
    for fn in fns.values():  # warm-up / compile
        fn()
    torch.cuda.synchronize()
    sleep = int(queue_ahead_ms * _sleep_cycles_per_ms()) if queue_ahead_ms > 0 else 0
    for _ in range(trials):
        if rng is not None:
            rng.shuffle(names)
        for name in names:
            for _ in range(warmup):
                fns[name]()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(rounds * len(names) + 1)]
        if sleep:
            torch.cuda._sleep(sleep)
        events[0].record()
        j = 0
        for _ in range(rounds):
            for name in names:
                fns[name]()
                j += 1
                events[j].record()
        events[-1].synchronize()
        per = {name: [] for name in names}
        j = 0
        for _ in range(rounds):
            for name in names:
                per[name].append(events[j].elapsed_time(events[j + 1]))
                j += 1
        for name in names:
            times[name].append(sum(per[name]) / rounds)
            ratios[name].append(statistics.median(t / b for t, b in zip(per[name], per[base])))
    return times, ratios


def mean_ms(fn: Callable, iters: int, queue_ahead_ms: float = 0.0) -> float:
    """Mean time of ``iters`` back-to-back calls of ``fn``, by CUDA events (ms).

    With ``queue_ahead_ms > 0`` a sleep kernel of about that long runs before the start event,
    so the host queues the calls while the GPU is busy and the events time the GPU's work
    alone, not the host's issue time (which bounds small, short kernels: host cost per call is
    measured apart, ``benchmarks/host_overhead.py``). It must outlast issuing the ``iters``
    calls; a sample whose calls were still being issued when the sleep ended is not marked."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queue_ahead_ms > 0:
        torch.cuda._sleep(int(queue_ahead_ms * _sleep_cycles_per_ms()))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


_CYCLES_PER_MS: Dict[int, float] = {}


def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on the current device (timed once)."""
    dev = torch.cuda.current_device()
    if dev not in _CYCLES_PER_MS:
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[dev] = cycles / start.elapsed_time(end)
    return _CYCLES_PER_MS[dev]


def ag_on_one_gpu(a, w, world, cfg, err, launch_ag_gemm=None, num_sms=None):
    """AG+GEMM of ``a @ w.T`` wired to this GPU alone, as rank 0 of ``world``: the local shard
    is ``a``'s first ``m / world`` rows, the "gathered" workspace is ``a`` itself, every chunk
    signal is pre-set (no wait spins). Returns ``(launch, out)``: ``launch(trace=None)`` runs the
    kernel with ``cfg`` (its ``chunk_rows`` capped at the shard) into ``out`` ``[m, n]``
    (``trace``: stamp its phases, :mod:`megatron_flux.kernels.phase_trace`).
    ``launch_ag_gemm``: another version of the launcher (default: the package's); ``num_sms``:
    the persistent grid's size (default: the device's SM count)."""
    import dataclasses

    if launch_ag_gemm is None:
        from megatron_flux.kernels.ag_gemm import launch_ag_gemm

    m_local = a.shape[0] // world
    cfg = dataclasses.replace(cfg, chunk_rows=min(cfg.chunk_rows, m_local))
    out = torch.full((a.shape[0], w.shape[0]), float("nan"), device=a.device, dtype=a.dtype)
    flags = torch.full((world * -(-m_local // cfg.chunk_rows),), 1 << 30, dtype=torch.int32,
                       device=a.device)
    sms = num_sms or _num_sms(a.device)

    def launch(trace=None):
        kwargs = {} if trace is None else {"trace": trace}  # earlier launchers have no trace
        launch_ag_gemm(a[:m_local], a, w.t(), out, flags, err, rank=0, world=world, epoch=1,
                       cfg=cfg, num_sms=sms, max_spins=1 << 20, **kwargs)

    return launch, out


def _ag_runner(m, n, k, tp, cfg, dtype):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    launch, out = ag_on_one_gpu(a, w, tp, cfg, err)
    return launch, (lambda: torch.matmul(a, w.t())), (lambda: (out.float(), a.float() @ w.t().float())), err


def rs_on_one_gpu(a, w, world, err, launch_gemm_rs=None, num_sms=None):
    """GEMM+RS of ``a @ w.T`` wired to this GPU alone, as rank 0 of ``world``: every peer slot
    is a local buffer, every peer signal pre-set (no wait spins), the arrival counter zero. This
    rank's own signal starts at zero and each launch takes the next epoch, so a spread
    reduction (``rs_spread_reduce``) waits for its own grid's barrier as it does in a real call.
    Returns ``(launch, out, data)``: ``launch(cfg, produce=True, consume=True, trace=None)``
    runs the kernel into ``out`` ``[m / world, n]``; ``data[src]`` holds what "rank src" pushed.
    ``launch_gemm_rs``: another version of the launcher (default: the package's); ``num_sms``:
    the persistent grid's size (default: the device's SM count). With ``rs_row_turns`` an own
    tile waits for real counts, which this grid's own pushes for each peer supply (below): no
    extra work per launch."""
    if launch_gemm_rs is None:
        from megatron_flux.kernels.gemm_rs import launch_gemm_rs

    m_local, n = a.shape[0] // world, w.shape[0]
    out = torch.full((m_local, n), float("nan"), device=a.device, dtype=a.dtype)  # unwritten tiles show
    data = torch.zeros(world, m_local, n, device=a.device, dtype=a.dtype)
    # the pushes to "peers" land in a scratch region, so they never overwrite this rank's own
    # slot (which the spread reduction reads)
    pushed = torch.zeros_like(data)
    flags = torch.full((rs_signal_count(world, row_turns=True),), 1 << 30, dtype=torch.int32,
                       device=a.device)
    flags[0] = 0  # this rank's own signal: raised by its own grid's barrier, every call
    flags[world:] = 0  # the arrival counter starts at zero
    data_ptrs = torch.tensor([data.data_ptr()] + [pushed.data_ptr()] * (world - 1),
                             dtype=torch.int64, device=a.device)
    flag_ptrs = torch.tensor([flags.data_ptr()] * world, dtype=torch.int64, device=a.device)
    # rs_row_turns: an own tile waits until each peer has counted in its tiles of the row group.
    # Here a peer's count is this grid's own pushes for that peer (the same shape): peer s's
    # signal region is this one moved by s blocks of counters, so a push for owner s, counted
    # at owner s's block of rank 0, lands in this rank's block of peer s. The epoch the grid
    # raises for owner s (its word 0) lands in block s - 1 at row group 62 - world, past the
    # row groups a call here may have (checked at launch).
    turn_views = [flags[ROW_GROUPS * s:] for s in range(world)]
    turn_ptrs = torch.tensor([v.data_ptr() for v in turn_views], dtype=torch.int64,
                             device=a.device)
    sms = num_sms or _num_sms(a.device)

    epoch = [0]

    def launch(cfg, produce=True, consume=True, trace=None):
        epoch[0] += 1  # peers' signals stay ahead (1 << 30); the own one must be raised anew
        ptrs = flag_ptrs
        if cfg.rs_row_turns:
            if row_groups(m_local, cfg) > ROW_GROUPS - 2 - world:
                raise ValueError(f"rs_on_one_gpu: rs_row_turns with more than "
                                 f"{ROW_GROUPS - 2 - world} row groups per rank ({m_local} rows)")
            ptrs = turn_ptrs
        kwargs = {} if trace is None else {"trace": trace}  # earlier launchers have no trace
        launch_gemm_rs(a, w.t(), out, data, data_ptrs, ptrs, None, err, rank=0, world=world,
                       epoch=epoch[0], cfg=cfg, num_sms=sms, max_spins=1 << 20, produce=produce,
                       consume=consume, **kwargs)

    # The kernel reaches the slots and signals only through the addresses in the pointer
    # tables, so ``launch`` must own them: a freed ``flags`` (reused by the next allocation)
    # made every later call spin out its waits (~240 ms a call).
    launch.buffers = (out, data, pushed, *turn_views, turn_ptrs, flags, data_ptrs, flag_ptrs)
    return launch, out, data


def _num_sms(device):
    """SM count of a CUDA device, once per wiring (not per timed launch); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def rel_err(got, ref) -> float:
    """``|got - ref| / |ref|`` (Frobenius); NaN when ``got`` has an unwritten (NaN) tile."""
    return float((got - ref).norm() / ref.norm())


def _rs_runner(m, n, k, tp, cfg, dtype):
    m_local = m // tp
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    launch, out, data = rs_on_one_gpu(a, w, tp, err)

    def fused():
        launch(cfg)

    def check():
        # own rows = own partial + the other slots (its pushes to peers land in a scratch region)
        ref = (a.float() @ w.t().float())[:m_local]
        for src in range(1, tp):
            ref = ref + data[src].float()
        return out.float(), ref

    return fused, (lambda: torch.matmul(a, w.t())), check, err


def _plain_runner(m, n, k, tp, cfg, dtype, host_descriptors=False):
    """The yardstick (:mod:`.plain_gemm`) on the whole ``[m, k] @ [k, n]`` with ``cfg``."""
    from megatron_flux.tools.diagnostics.plain_gemm import launch_plain_gemm

    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    c = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    err = torch.zeros(4, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return ((lambda: launch_plain_gemm(a, w, c, cfg, sms, host_descriptors)),
            (lambda: torch.matmul(a, w.t())),
            (lambda: (c.float(), a.float() @ w.t().float())), err)


def run(args) -> dict:
    dtype = torch.bfloat16
    rows = []
    result = {"what": "fused kernels with communication disabled vs cuBLAS (per-rank shapes)",
              "command": " ".join([sys.executable] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__, "tp": args.tp,
              "rows": rows}
    for op, model, m, n, k in _grid(args):
        best = None
        results = {}
        configs, labels = _configs(op, m, n, k, args)
        if args.only_config is not None:  # one candidate per process: a faulting variant
            configs = [configs[args.only_config]]  # (sticky CUDA error) cannot hide the others
        fns = {}
        checks = {}
        cublas = None
        for i, cfg in enumerate(configs):
            try:
                maker = _runner(op, labels[i])
                fused, ref_fn, check, err = maker(m, n, k, args.tp, cfg, dtype)
                fused()
                torch.cuda.synchronize()
                rel = rel_err(*check())
                if not rel <= 2e-2 or int(err[0]):  # NaN (an unwritten tile) fails too
                    results[f"cfg{i}"] = {"cfg": cfg.to_dict(), "label": labels[i],
                                          "error": f"rel err {rel}"}
                    continue
                fns[f"cfg{i}"] = fused
                checks[f"cfg{i}"] = cfg
                cublas = ref_fn
            except Exception as exc:  # out of shared memory etc.
                results[f"cfg{i}"] = {"cfg": cfg.to_dict(), "label": labels[i],
                                      "error": repr(exc)[:200]}
        if cublas is None:
            rows.append({"op": op, "model": model, "m": m, "n": n, "k": k, "error": results})
            continue
        fns["cublas"] = cublas
        paired = None
        if getattr(args, "alternate", False):
            times, paired = _time_alternating(fns, args.trials, args.iters, args.warmup,
                                              args.shuffle_seed, args.queue_ahead_ms)
        else:
            times = _time(fns, args.trials, args.iters, args.warmup, args.shuffle_seed,
                          args.queue_ahead_ms)
        cub = statistics.median(times["cublas"])
        for name, cfg in checks.items():
            med = statistics.median(times[name])
            i = int(name[3:])
            ratio = statistics.median(paired[name]) if paired else med / cub
            results[name] = {"cfg": cfg.to_dict(), "label": labels[i], "ms": med, "ratio": ratio,
                             "trials_ms": times[name]}
            if paired:
                results[name]["trials_ratio"] = paired[name]
            if _runner_kind(labels[i]) == "fused" and (best is None or ratio < best[1]):
                best = (name, ratio)
        by_label = {r["label"]: r.get("ratio") for r in results.values()}
        row = {"op": op, "model": model, "m": m, "n": n, "k": k, "cublas_ms": cub,
               "cublas_trials_ms": times["cublas"],
               "default_ratio": by_label.get("default"), "table_ratio": by_label.get("table"),
               "best_ratio": best and results[best[0]]["ratio"],
               "best_label": best and results[best[0]]["label"],
               "best_cfg": best and results[best[0]]["cfg"], "configs": results}
        rows.append(row)
        shown = "  ".join(f"{lab} x{r:.3f}" for lab, r in by_label.items() if r is not None)
        print(f"{op:8s} {model:11s} M={m:5d} N={n:6d} K={k:6d} cublas {cub:.4f} ms  {shown}  "
              f"best {row['best_label']}", flush=True)
        write_json(result, getattr(args, "json", None))  # so far: a run cut short keeps its rows
        del fns, checks
        torch.cuda.empty_cache()
    return result


def _configs(op, m, n, k, args):
    """``(configs, labels)`` to time for one shape, per ``--configs``: the heuristic ``default``,
    the shipped ``table``'s entry (the config the backend runs), the ``nearest`` entry's config
    (what the backend ran on a shape no table lists before the wave rule), their stream-K variants
    (``sk``; not of a warp-specialized config, which has no stream-K), their
    twins reducing the other way (``spread``: ``rs_spread_reduce`` flipped, GEMM+RS only; not
    of a warp-specialized config without merged rows, which cannot reduce spread), the
    fixed ``candidates`` lists and the plain persistent GEMM with the default's and the table's
    tile (``plain``, :mod:`.plain_gemm`: the yardstick for the fused tile loop); duplicates
    dropped."""
    import dataclasses

    from megatron_flux.tuning.provider import TableConfigProvider

    short = "ag" if op == "AG+GEMM" else "rs"
    default = default_config(short, m, n, k, tp=args.tp)
    table = TableConfigProvider()(short, m, n, k, dtype=torch.bfloat16, tp=args.tp,
                                  device=torch.device("cuda", torch.cuda.current_device()))
    out = []
    if "default" in args.configs:
        out.append(("default", default))
    if "table" in args.configs:
        out.append(("table", table))
    if "nearest" in args.configs:  # without the wave rule (tuning.estimate.wave_aware_config)
        from megatron_flux.tuning.provider import kernel_config

        out.append(("nearest", kernel_config(short, m, n, k, torch.bfloat16, args.tp, torch.device(
            "cuda", torch.cuda.current_device()), wave_aware=False)[0]))
    if "sk" in args.configs:  # with and without stream-K (the Gluon kernels have none)
        ws = "ag_warp_specialized" if op == "AG+GEMM" else "rs_warp_specialized"
        for label, cfg in (("default", default), ("table", table)):
            if getattr(cfg, ws):
                continue
            twin = dataclasses.replace(cfg, stream_k=1 - cfg.stream_k)
            out.append((f"{label}{'+sk' if twin.stream_k else '-sk'}", twin))
    if "spread" in args.configs and op == "GEMM+RS":  # the other place to reduce
        for label, cfg in (("default", default), ("table", table)):
            if cfg.rs_warp_specialized and not cfg.rs_merge_rows:
                continue  # its Gluon kernel reduces spread only with merged rows (GemmConfig)
            twin = dataclasses.replace(cfg, rs_spread_reduce=not cfg.rs_spread_reduce)
            out.append((f"{label}{'+spread' if twin.rs_spread_reduce else '-spread'}", twin))
    if "candidates" in args.configs:
        extra = CANDIDATES if op == "AG+GEMM" else RS_CANDIDATES
        out += [(f"cand{i}", c) for i, c in enumerate(extra)]
    for i, fields in enumerate(getattr(args, "extra", None) or []):  # --extra: the default with fields changed
        plain = fields.get("runner") == "plain"
        cfg = dataclasses.replace(default, **{f: v for f, v in fields.items() if f != "runner"})
        out.append((f"plain-extra{i}" if plain else f"extra{i}", cfg))
    if "plain" in args.configs:  # the yardstick with the default's and the table's tile
        out += [("plain-default", default), ("plain-table", table),
                ("plain-hostdesc-default", default)]
    seen, configs, labels = set(), [], []
    for label, cfg in out:
        key = (_runner_kind(label), cfg)
        if key not in seen:
            seen.add(key)
            configs.append(cfg)
            labels.append(label)
    return configs, labels


def _runner_kind(label):
    """What a ``_configs`` label runs: ``"fused"``, ``"plain"`` or ``"plain-hostdesc"``."""
    if label.startswith("plain-hostdesc"):
        return "plain-hostdesc"
    return "plain" if label.startswith("plain") else "fused"


def _runner(op, label):
    """The runner factory ``(m, n, k, tp, cfg, dtype) -> (fn, cublas_fn, check, err)``."""
    kind = _runner_kind(label)
    if kind == "fused":
        return _ag_runner if op == "AG+GEMM" else _rs_runner
    return functools.partial(_plain_runner, host_descriptors=kind == "plain-hostdesc")


def grid_shape(op: str, model: str, tp: int):
    """``(n, k)`` of ``op`` ("ag" or "rs") for ``model`` at TP size ``tp``, per rank: AG+GEMM
    n = fc1 width / tp, k = hidden; GEMM+RS n = hidden, k = fc1 width / tp (k as in the
    anchors file)."""
    from megatron_flux.tools.bench.grid import MODELS

    spec = MODELS[model]
    if op == "ag":
        return spec.fc1 // tp, spec.hidden
    return spec.hidden, spec.fc1 // tp


def model_shapes(args, op: str):
    """``(model, n, k)`` per model of ``args`` (:func:`add_model_args`) for ``op`` ("ag" /
    "AG+GEMM" or "rs" / "GEMM+RS"), ``n`` and ``k`` per rank at ``args.tp``, as the main
    benchmark's grid defines them (:func:`megatron_flux.tools.bench.grid.case_for`, ``--rs-k``)."""
    from megatron_flux.tools.bench import grid as G

    custom = [G.parse_model_shape(s) for s in getattr(args, "model_shapes", None) or []]
    names = args.models or ([c.name for c in custom] if custom else
                            getattr(args, "fallback_models", None) or list(G.MODELS))
    full_op = G.AG_GEMM if op in ("ag", G.AG_GEMM) else G.GEMM_RS
    for model in G.select_models(names, custom):
        # n, k do not depend on m; any m divisible by tp stands in for the shapes
        shapes = G.case_for(full_op, model, args.tp, getattr(args, "rs_k", "fc1")).local_shapes(args.tp)
        yield model.name, shapes["gemm_b"][1], shapes["gemm_a"][1]


def _grid(args):
    """``(op, model, m, n, k)`` per case (:func:`model_shapes`), model by model, then m."""
    ops = [op for op in ("AG+GEMM", "GEMM+RS") if op in args.ops]
    per_op = {op: list(model_shapes(args, op)) for op in ops}
    models = [name for name, _, _ in per_op[ops[0]]] if ops else []
    for i, model in enumerate(models):
        for m in args.m:
            for op in ops:
                yield (op, model, m) + per_op[op][i][1:]


def add_model_args(p: argparse.ArgumentParser, default_models=None) -> None:
    """``--models``, ``--model-shapes`` and ``--rs-k`` (read by :func:`model_shapes`). Without
    ``--models`` the tool runs the ``--model-shapes`` models if given, else ``default_models``
    (else the grid's three)."""
    p.add_argument("--models", nargs="+", default=None,
                   help="model names (default: the --model-shapes ones if given, else "
                        f"{' '.join(default_models or ['the grid models'])})")
    p.set_defaults(fallback_models=default_models)
    p.add_argument("--model-shapes", nargs="+", default=[], metavar="NAME:H:FC1:FFN",
                   help="extra models, e.g. a training config's projections")
    p.add_argument("--rs-k", choices=["fc1", "ffn"], default="fc1",
                   help="GEMM+RS contraction width: the fc1 width (the grid's) or the true fc2 input")


def add_grid_args(p: argparse.ArgumentParser) -> None:
    """The shape grid, timing and output arguments of the single-GPU kernel benchmarks."""
    p.add_argument("--tp", type=int, default=2)
    add_model_args(p)
    p.add_argument("--m", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    add_sample_args(p)
    p.add_argument("--json", default=None)


def add_sample_args(p: argparse.ArgumentParser) -> None:
    """``--warmup`` and ``--shuffle-seed``, as :func:`_time` takes them (shared with the
    experiment scripts)."""
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed calls of a method right before each of its samples")
    p.add_argument("--shuffle-seed", type=int, default=None,
                   help="shuffle the methods' order in every trial (seeded)")
    p.add_argument("--queue-ahead-ms", type=float, default=0.0,
                   help="before each sample, a GPU sleep of this long while the host queues "
                        "the calls: times GPU work alone, not host issue time (small m)")


def write_json(result: dict, path) -> dict:
    """``result`` to ``path`` (when given), then returned."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_grid_args(p)
    p.add_argument("--ops", nargs="+", default=["AG+GEMM", "GEMM+RS"])
    p.add_argument("--configs", nargs="+", default=["default", "table", "sk"],
                   choices=["default", "table", "nearest", "sk", "spread", "candidates", "plain"],
                   help="which configs to time per shape (see _configs)")
    p.add_argument("--default-only", action="store_true", help="same as --configs default")
    p.add_argument("--only-config", type=int, default=None,
                   help="run only the i-th config of the --configs list")
    p.add_argument("--extra", type=json.loads, default=None,
                   help='a JSON list of GemmConfig field dicts, each timed as the default config '
                        'with those fields changed ("extraI"); {"runner": "plain", ...} runs the '
                        'plain yardstick with it ("plain-extraI")')
    p.add_argument("--alternate", action="store_true",
                   help="launch the methods in turn, one launch each per round (--iters "
                        "rounds per trial), and report each config's median over trials of its "
                        "median per-round time / cuBLAS's (clock steps cancel; see "
                        "_time_alternating)")
    p.add_argument("--sk-max-tail", type=float, default=None,
                   help="experiment: split the last wave along K when it fills at most this "
                        "share of the grid (stream_k.MAX_TAIL_FRACTION for this run)")
    args = p.parse_args(argv)
    if args.sk_max_tail is not None:
        from megatron_flux.kernels import stream_k

        stream_k.MAX_TAIL_FRACTION = args.sk_max_tail
    if args.default_only:
        args.configs = ["default"]
    return write_json(run(args), args.json)


if __name__ == "__main__":
    main()
