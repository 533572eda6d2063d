"""``FluxBackend``: AG+GEMM and GEMM+RS as single Triton kernels over torch symmetric memory.

The backend object holds the options and the per-shape kernel configs, and routes each call:

* :mod:`.ag`        the fused AllGather+GEMM (copy-engine pushes, signals per chunk)
* :mod:`.rs`        the fused GEMM+ReduceScatter (SM pushes or copy-engine delivery), and the
                    column backward's copy-engine ReduceScatter
* :mod:`.regather`  the column backward's copy-engine re-gather
* :mod:`.resources` workspaces, error words, streams and staging, per device and group
* :mod:`.support`   which operands the kernels take

Calls inside a CUDA graph capture run fused too (``options.capture``), on workspaces reserved
for graphs before the capture (:meth:`FluxBackend.expect_capture`) and with constant, reset
signals (:mod:`megatron_flux.comm.capture`); where none was reserved the call runs on NCCL,
with one log line.

The plain collectives (``all_gather``, ``reduce_scatter``) and the NCCL forms of the column
backward (``column_dgrad="nccl"``, ``column_regather="nccl"``, the defaults) are the NCCL
backend's.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, Optional, Tuple

import torch

from megatron_flux.backends.base import TPOverlapBackend, remember
from megatron_flux.backends.flux import ag, regather, rs
from megatron_flux.backends.flux.resources import FENCE_SLOTS, DeviceResources
from megatron_flux.backends.flux.support import group_reason, signature_reason
from megatron_flux.options import FluxOptions, get_options


def flux_backend_factory_or_reason():
    """``(factory, None)`` when triton and torch symmetric memory import, else ``(None, reason)``."""
    try:
        import triton  # noqa: F401
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:
        return None, f"import failed: {exc}"
    return FluxBackend, None


class FluxBackend(TPOverlapBackend):
    """Fused Triton kernels; see the package modules for each call's schedule."""

    name = "flux"
    waits_across_ranks_on_sms = True  # persistent grids spin on peers' signals
    #: resolve each operand signature once (config, workspace views, streams, copy plans) and
    #: reuse it (:meth:`call_plan`); False resolves every call (A/B)
    call_plans = True
    #: eager fused calls launch through a BoundLaunch of their call plan (after one launch of
    #: each parity made it: :func:`~megatron_flux.kernels.launch.bind_last_launch`); False
    #: launches every call through the launcher (A/B)
    bound_launches = True

    def __init__(self, config_provider=None, *, options: Optional[FluxOptions] = None,
                 column_dgrad: Optional[str] = None, column_regather: Optional[str] = None):
        """``config_provider(op, m_total, n, k) -> GemmConfig``; default: the tuning tables
        (:class:`~megatron_flux.tuning.provider.TableConfigProvider`: table hit at the nearest
        m-bucket, else ``default_config``). A provider with ``accepts_context = True`` is also
        given ``dtype=``, ``tp=`` and ``device=``.

        ``options``: the :class:`~megatron_flux.options.FluxOptions` to run with (default: the
        process's, :func:`~megatron_flux.options.get_options`); ``column_dgrad`` and
        ``column_regather`` override theirs. ``column_dgrad`` is how
        :meth:`matmul_reduce_scatter_start`, the column backward's input gradient, runs:
        ``"nccl"``, cuBLAS then NCCL's reduce-scatter left running beside the weight-gradient
        GEMM, as megatron-core does; ``"fused"``, the GEMM+RS kernel; ``"copy_engine"``, cuBLAS,
        then the copy engine moves the peers' rows beside the weight-gradient GEMM and a
        reduction kernel sums them after it. Megatron already hides this reduce-scatter behind
        the wgrad, so the fused kernel can only lose its margin to cuBLAS there: 1.041x stock
        with ``"nccl"`` against 1.027x with ``"fused"`` (Llama-3-8B-16L, TP 2, micro-batch 2,
        2xH200). ``column_regather`` is how :meth:`all_gather_start`, the column backward's
        re-gather of the input for the weight gradient, runs: ``"nccl"``, NCCL's asynchronous
        all-gather, or ``"copy_engine"`` (:mod:`.regather`)."""
        if config_provider is None:
            from megatron_flux.tuning.provider import TableConfigProvider

            config_provider = TableConfigProvider()
        base = get_options() if options is None else options
        self._options = base.replace(column_dgrad=column_dgrad, column_regather=column_regather)
        #: the column settings given to this backend (here or by its properties): they keep
        #: overriding the options' through :meth:`set_options`
        self._own = {k: v for k, v in (("column_dgrad", column_dgrad),
                                        ("column_regather", column_regather)) if v is not None}
        self._config_provider = config_provider
        self._provider_context = bool(getattr(config_provider, "accepts_context", False))
        self.resources = DeviceResources(self._options)
        self._plans: Dict[Tuple, object] = {}
        self._call_plan_cache: Dict[Tuple, object] = {}
        #: signature_reason's answers per operand signature, current device and TP size
        self._reasons: Dict[Tuple, Optional[str]] = {}
        #: group_reason's answers per group object (not its size or id: another group of the
        #: same size, or one made where a destroyed one lived, is asked again, collectively)
        self._group_reasons: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stream_wait: Optional[bool] = None
        self._nccl = None
        #: eager calls also reserve the graph workspaces of their shapes (:meth:`expect_capture`)
        self.reserve_for_capture = False
        #: fused calls captured into CUDA graphs so far (each replays with its graph), and
        #: captured calls that ran on NCCL because no graph plan was made for them
        self.captured_calls = 0
        self.capture_fallbacks = 0
        self._capture_plans: Dict[Tuple, object] = {}
        self._capture_sequence = None
        self._keepalive: list = []  # what captured graphs address: never freed

    # ---------------------------------------------------------------- options
    @property
    def options(self) -> FluxOptions:
        return self._options

    def set_options(self, options: FluxOptions) -> None:
        """Run with ``options`` from the next call on (workspaces and configs are kept), except
        for the ``column_dgrad`` / ``column_regather`` given to this backend (constructor or
        property), which keep theirs: new process options (``megatron_flux.options.set_options``
        reaches every built backend) do not undo a setting made for this backend alone."""
        options = options.replace(**self._own)
        if options.allow_several_queues != self._options.allow_several_queues:
            self._group_reasons.clear()  # asked again (collectively) at the next call
        self._options = options
        self.resources.set_options(options)
        self._call_plan_cache.clear()

    @property
    def column_dgrad(self) -> str:
        return self._options.column_dgrad

    @column_dgrad.setter
    def column_dgrad(self, value: str) -> None:
        """This backend's ``column_dgrad`` from now on, whatever later options say."""
        options = self._options.replace(column_dgrad=value)  # checks the value
        self._own["column_dgrad"] = value
        self.set_options(options)

    @property
    def column_regather(self) -> str:
        return self._options.column_regather

    @column_regather.setter
    def column_regather(self, value: str) -> None:
        """This backend's ``column_regather`` from now on, whatever later options say."""
        options = self._options.replace(column_regather=value)  # checks the value
        self._own["column_regather"] = value
        self.set_options(options)

    @property
    def max_spins(self) -> int:
        return self._options.max_spins

    @property
    def capturable(self) -> bool:
        """Whether calls inside a CUDA graph capture run fused (``options.capture``); else
        ``resolve_backend`` hands them to ``nccl``."""
        return self._options.capture

    # ---------------------------------------------------------------- support
    def unsupported_reason(self, a, b, group) -> Optional[str]:
        if not a.is_cuda:
            return f"input is on {a.device.type}, not CUDA"
        # the operands' part depends on their signature and the current device only: asked on
        # every call, answered once
        current = torch.cuda.current_device()
        key = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
               current, group.size() if group is not None else 1)
        try:
            reason = self._reasons[key]
        except KeyError:
            reason = remember(self._reasons, key, signature_reason(
                a, b, group, lambda: self.resources.capability(a.device), current))
        if reason is None:
            reason = self._group_reason(group, a.device)
        return reason

    def _group_reason(self, group, device) -> Optional[str]:
        """:func:`~megatron_flux.backends.flux.support.group_reason`, once per group object: its
        first ask on each rank is the collective, which the ranks of an SPMD program reach at
        the same call (the operands' part, asked first, is the same on all of them)."""
        try:
            return self._group_reasons[group]
        except KeyError:
            reason = self._group_reasons[group] = group_reason(
                group, device, allow_several_queues=self._options.allow_several_queues)
            return reason

    def check(self, op: str, a, b, group) -> None:
        """Raise for operands the kernels cannot take."""
        reason = self.unsupported_reason(a, b, group)
        if reason is not None:
            raise ValueError(f"megatron-flux {op}: {reason}")

    def call_plan(self, op: str, key, group, build):
        """The call plan (:func:`.rs.rs_plan`, :func:`.ag.ag_plan`: a NamedTuple with ``group``,
        ``ws`` and the ``generation`` of ``ws`` it was made at) cached under ``key``, the
        operands' signature. A plan is reused while its group is ``group`` and its workspace's
        views are alive (the generation is unchanged); else ``build()`` makes a new one (its
        checks raise before anything is kept), first dropping plans whose views died (they
        would keep replaced buffers alive) and, past 256 plans, all of them. With
        ``call_plans`` off every call builds. Captured calls take :meth:`capture_plan`."""
        if not self.call_plans:
            return build()
        cache = self._call_plan_cache
        plan = cache.get(key)
        if plan is not None and plan.group is group and plan.ws.generation == plan.generation:
            return plan
        plan = build()
        for k in [k for k, p in cache.items() if p.ws.generation != p.generation]:
            del cache[k]
        if len(cache) >= 256:
            cache.clear()
        cache[key] = plan
        return plan

    # ---------------------------------------------------------------- CUDA graphs
    def expect_capture(self) -> None:
        """CUDA graphs will capture calls of the shapes the next eager calls run: from now on
        each eager call plan also reserves (collectively) the graph workspaces of its shape and
        the fences, which cannot be allocated inside a capture. Megatron's CUDA graphs run eager
        iterations before they capture; the layers call this when their config enables graphs."""
        if not self.reserve_for_capture:
            self.reserve_for_capture = True
            self._call_plan_cache.clear()

    def register_capture_plan(self, key, plan) -> None:
        """Keep ``plan`` (built outside a capture, on the graph workspace) for captured calls
        of signature ``key``. Graph plans that building it made stale (their workspace grew)
        are dropped, and so are the eager plans, whose next calls rebuild both."""
        stale = [k for k, p in self._capture_plans.items()
                 if p.ws is plan.ws and p.generation != plan.ws.generation]
        for k in stale:
            del self._capture_plans[k]
        if stale:
            self._call_plan_cache.clear()
        if len(self._capture_plans) >= 256:
            self._capture_plans.clear()
        self._capture_plans[key] = plan

    def has_capture_plan(self, key, group) -> bool:
        """Whether captured calls of signature ``key`` on ``group`` have a live graph plan."""
        plan = self._capture_plans.get(key)
        return (plan is not None and plan.group is group
                and plan.ws.generation == plan.generation)

    def capture_plan(self, op: str, key, group):
        """The plan of a captured call of signature ``key``, or None (with one log line) where
        no eager call of it since :meth:`expect_capture` made one: the call then runs on NCCL.
        Every plan a capture used is kept for the life of the backend, with what it addresses:
        the graphs replay those addresses."""
        if not self.has_capture_plan(key, group):
            from megatron_flux.backends.registry import log_once

            self.capture_fallbacks += 1
            log_once(f"capture-not-ready:{op}",
                     f"megatron-flux {op}: a call captured into a CUDA graph has no graph "
                     f"workspace reserved for its shape; it runs on 'nccl'. Call "
                     f"megatron_flux.backends.expect_cuda_graphs() before the eager calls that "
                     f"precede the capture (layers whose config enables CUDA graphs do).")
            return None
        plan = self._capture_plans[key]
        self.keep_alive(plan)
        return plan

    def capture_parity(self, plan, kind: str) -> int:
        """The parity of a captured call on ``plan``'s graph workspace (``kind``: ``"ag"`` or
        ``"rs"``); a graph's first call on it queues the fence first
        (:mod:`megatron_flux.comm.capture`)."""
        from megatron_flux.comm.capture import CaptureSequence, capture_id

        if self._capture_sequence is None:
            self._capture_sequence = CaptureSequence()
        stream = torch.cuda.current_stream(plan.device)
        parity, first = self._capture_sequence.next(capture_id(stream), (kind, id(plan.ws)))
        if first:
            self.graph_fence(plan, kind)
        self.captured_calls += 1
        return parity

    def graph_fence(self, plan, kind: str) -> None:
        """Queue the fence of ``plan``'s graph workspace: a bounded barrier of the TP group on
        the fence words of ``kind``, then this rank's words reset."""
        from megatron_flux.backends.flux.resources import deps
        from megatron_flux.comm.capture import CAPTURED_EPOCH

        d = deps()
        fence = self.resources.fence(plan.group, plan.device)
        base = FENCE_SLOTS[kind] * plan.world
        d.launch_ready_barrier(fence.flag_ptrs(0), plan.err.device_word, rank=plan.rank,
                               world=plan.world, base=base, epoch=CAPTURED_EPOCH,
                               max_spins=self._options.max_spins, op_code=d.OP_GRAPH_FENCE,
                               direct=self._options.direct_launch)
        fence.flags(plan.rank, 0)[base:base + plan.world].zero_()

    def keep_alive(self, obj) -> None:
        """Keep ``obj`` (a plan or buffer a captured graph addresses) for the life of the
        backend (capture time only: the check is linear)."""
        if obj is not None and not any(obj is kept for kept in self._keepalive):
            self._keepalive.append(obj)

    def keep_scratch_alive(self, device) -> None:
        """Keep the stream-K scratch that a launch just captured on the current stream used (a
        later, larger one would replace it, and the graph would address freed memory)."""
        from megatron_flux.kernels import stream_k

        self.keep_alive(stream_k.current_scratch(device))

    def poll_errors(self) -> None:
        """Raise a timed-out wait that an earlier replay reported, then queue the next read:
        the per-step check of jobs whose fused calls all run inside CUDA graphs (eager calls
        check every ``error_check_interval`` calls). No synchronisation."""
        self.resources.poll_errors()

    def check_errors(self, sync: bool = True) -> None:
        """Raise if any fused kernel on this process reported a timed-out wait."""
        self.resources.check_errors(sync=sync)

    # ---------------------------------------------------------------- configs
    def config(self, op: str, m_total: int, n: int, k: int, *, dtype=None, tp=None, device=None):
        """Kernel configuration for one op and global shape (cached: the provider may be a
        tuning-table lookup). ``dtype``/``tp``/``device`` key the table; without them a
        context-aware provider answers with the heuristic default."""
        key = (op, m_total, n, k, dtype, tp, device)
        cfg = self._plans.get(key)
        if cfg is None:
            if self._provider_context:
                cfg = self._config_provider(op, m_total, n, k, dtype=dtype, tp=tp, device=device)
            else:
                cfg = self._config_provider(op, m_total, n, k)
            remember(self._plans, key, cfg)
        return cfg

    def clear_config_cache(self) -> None:
        """Forget cached configs (the tuner swaps the provider's answer between candidates)."""
        self._plans.clear()
        self._call_plan_cache.clear()

    def config_without_copy_engine(self, cfg):
        """``cfg`` pushing from the SMs (the captured GEMM+RS calls' form, :mod:`.rs`)."""
        key = ("no-ce", cfg)
        out = self._plans.get(key)
        if out is None:
            out = self._plans[key] = dataclasses.replace(cfg, rs_copy_engine=False)
        return out

    def config_with_chunk(self, cfg, chunk: int):
        key = ("chunk", cfg, chunk)
        out = self._plans.get(key)
        if out is None:
            out = self._plans[key] = dataclasses.replace(cfg, chunk_rows=chunk)
        return out

    # ---------------------------------------------------------------- the ops
    def all_gather_matmul(self, a_shard, b, group, *, out=None, return_gathered=False,
                          gathered_out=None):
        return ag.all_gather_matmul(self, a_shard, b, group, out, return_gathered, gathered_out)

    def matmul_reduce_scatter(self, a, b, group, *, out=None, bias=None):
        return rs.matmul_reduce_scatter(self, a, b, group, out, bias)

    def matmul_reduce_scatter_start(self, a, b, group, *, bias=None):
        """The column backward's input gradient, as ``column_dgrad`` says."""
        dgrad = self._options.column_dgrad
        if dgrad == "nccl":
            return self._nccl_backend().matmul_reduce_scatter_start(a, b, group, bias=bias)
        if dgrad == "copy_engine":
            return rs.reduce_scatter_copy_engine_start(self, a, b, group, bias)
        return super().matmul_reduce_scatter_start(a, b, group, bias=bias)

    def all_gather_start(self, x, group, *, out=None):
        """The column backward's re-gather, as ``column_regather`` says; NCCL's asynchronous
        all-gather also where the copy engine's cannot run (CPU, one rank, CUDA graph capture,
        other dtypes). Without ``out`` the copy engine's result is this backend's gather
        workspace, valid until its next ``all_gather_start`` on this group."""
        if (self._options.column_regather == "nccl"
                or regather.unsupported_reason(x, group) is not None):
            return self._nccl_backend().all_gather_start(x, group, out=out)
        return regather.all_gather_start(self, x, group, out)

    def all_gather(self, x, group, *, out=None):
        return self._nccl_backend().all_gather(x, group, out=out)

    def reduce_scatter(self, x, group, *, out=None):
        return self._nccl_backend().reduce_scatter(x, group, out=out)

    def _nccl_backend(self):
        if self._nccl is None:
            from megatron_flux.backends.registry import get_backend

            self._nccl = get_backend("nccl")
        return self._nccl
