"""FluxColumnParallelLinear / FluxRowParallelLinear on gloo at TP=2 and TP=4.

The sequence-parallel path is checked against a dense single-process float64 reference (the full
weight is megatron's own ``master_weight``, so the sharding -- ``stride=2`` for SwiGLU's fc1
included -- is megatron's): forward output, input / weight / bias gradients of each rank's
shard. Everything else (TP=1, SP off, expert layers) must equal the stock layers bit for bit,
and parameters, their attributes, ``state_dict`` and ``sharded_state_dict`` must match stock.

Most checks run on the ``scratch`` backend: the reference backend, except that a gathered
buffer it hands out (``gathered_out=None``) is poisoned with NaN on its next call, as a fused
backend's workspace may be. An op that held on to such a buffer would produce NaN gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist

from helpers.dist_harness import run_checks

S_LOCAL, B, H, F = 2, 3, 8, 16  # per-rank sequence, batch, hidden, ffn (divisible by 2 * TP)
TOL = dict(rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------- helpers
def _imports():
    """megatron imports, done inside the ranks (and the few single-process tests)."""
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear

    return (ModelParallelConfig, parallel_state, ColumnParallelLinear, RowParallelLinear,
            FluxColumnParallelLinear, FluxRowParallelLinear)


def _register_scratch_backend():
    from megatron_flux.backends import register_backend
    from megatron_flux.backends.nccl import NcclBackend

    class ScratchBackend(NcclBackend):
        """Reference math; a gathered buffer it owns is clobbered by its next call (the one of
        ``all_gather_start``, by its next ``all_gather_start``, which is all the contract
        promises)."""

        name = "scratch"

        def __init__(self):
            super().__init__()
            self._handed_out = None
            self._started_out = None
            self._depth = 0  # NcclBackend's fused ops call its own all_gather: not a new call
            self.calls = []

        @contextlib.contextmanager
        def _call(self, *entry):
            if self._depth == 0:
                if self._handed_out is not None:
                    self._handed_out.fill_(float("nan"))
                    self._handed_out = None
                self.calls.append(entry)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1

        def all_gather_matmul(self, a_shard, b, group, *, out=None, return_gathered=False, gathered_out=None):
            with self._call("all_gather_matmul", return_gathered, gathered_out is not None):
                c, gathered = super().all_gather_matmul(
                    a_shard, b, group, out=out, return_gathered=return_gathered, gathered_out=gathered_out
                )
            if return_gathered and gathered_out is None:
                self._handed_out = gathered
            return c, gathered

        def matmul_reduce_scatter(self, a, b, group, *, out=None, bias=None):
            with self._call("matmul_reduce_scatter", bias is not None):
                return super().matmul_reduce_scatter(a, b, group, out=out, bias=bias)

        def all_gather(self, x, group, *, out=None):
            with self._call("all_gather", out is not None):
                return super().all_gather(x, group, out=out)

        def all_gather_start(self, x, group, *, out=None):
            if self._depth == 0 and self._started_out is not None:
                self._started_out.fill_(float("nan"))
                self._started_out = None
            with self._call("all_gather_start", out is not None):
                pending = super().all_gather_start(x, group, out=out)
            if out is None:
                self._started_out = pending.wait()
            return self._logged_wait(pending, "all_gather_start")

        def matmul_reduce_scatter_start(self, a, b, group, *, bias=None):
            with self._call("matmul_reduce_scatter_start", bias is not None):
                pending = super().matmul_reduce_scatter_start(a, b, group, bias=bias)
            return self._logged_wait(pending, "matmul_reduce_scatter_start")

        def _logged_wait(self, pending, what):
            """``pending`` whose wait() is recorded as ``(what + ".wait",)`` in the calls (not
            for the backend's own nested use, e.g. ``all_gather`` waiting at once)."""
            if self._depth > 0:
                return pending
            calls, inner = self.calls, pending.wait

            def wait():
                calls.append((what + ".wait",))
                return inner()

            pending.wait = wait
            return pending

        def reduce_scatter(self, x, group, *, out=None):
            with self._call("reduce_scatter", out is not None):
                return super().reduce_scatter(x, group, out=out)

    backend = ScratchBackend()
    register_backend("scratch", backend, override=True)
    return backend


def _config(tp, sp=True, **kw):
    ModelParallelConfig = _imports()[0]
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        params_dtype=torch.float64,
        **kw,
    )
    return cfg


def _init(w):
    return torch.nn.init.normal_(w, 0.0, 0.5)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _shard_index(full, tp, rank, stride=1):
    """Rows (column layer) / columns (row layer) of the full weight that rank owns, the way
    megatron's ``_initialize_affine_weight_cpu`` splits them (chunks of per_partition/stride,
    every tp-th chunk from ``rank``)."""
    chunks = torch.arange(full).split(full // tp // stride)
    return torch.cat(chunks[rank::tp])


def _dense(x, w, b, g):
    """float64 reference: ``y = x wᵀ + b`` and the gradients for upstream gradient ``g``."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = torch.matmul(x, w.t())
    if b is not None:
        y = y + b
    y.backward(g)
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def _build(cls, seed, *args, **kwargs):
    torch.manual_seed(seed)  # same master weight on every rank, as megatron's CPU init needs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(*args, keep_master_weight_for_test=True, **kwargs)


def _column(cls, tp, *, bias=True, stride=1, seed=0, cfg=None, **kwargs):
    layer = _build(cls, seed, H, F, config=cfg or _config(tp), init_method=_init, bias=bias,
                   stride=stride, **kwargs)
    if bias:
        rank = dist.get_rank(group=layer.tp_group)
        with torch.no_grad():  # non-zero bias so that adding it is tested
            layer.bias.copy_(_randn(F, seed=seed + 1)[_shard_index(F, tp, rank, stride)])
    return layer


def _row(cls, tp, *, bias=True, seed=0, cfg=None, **kwargs):
    kwargs.setdefault("input_is_parallel", True)
    kwargs.setdefault("skip_bias_add", False)
    layer = _build(cls, seed, F, H, config=cfg or _config(tp), init_method=_init, bias=bias, **kwargs)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(_randn(H, seed=seed + 1))
    return layer


def _assert_close(actual, expected, what):
    assert actual is not None, f"{what}: no gradient"
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------- sequence-parallel column
def _shift_in_place(out):
    """What megatron-core's vocabulary-parallel cross entropy does to fp32 logits (subtract the
    row maximum in place), which autograd refuses on a view made inside a custom Function and
    the stock layers allow. A constant shift leaves every gradient as it was."""
    assert not out._is_view()
    out.sub_(1.0)


def _check_column_sp(rank, tp, *, stride=1, bias=True, skip_bias_add=False, gather_output=False,
                     runtime_gather_output=None, keep=False, backend="scratch", frozen=False,
                     non_contiguous=False, convert=False, in_place=False):
    """``convert``: build megatron-core's own ColumnParallelLinear and turn it into a Flux one in
    place (``FluxColumnParallelLinear.convert_``, as ``swap_output_layer`` does), instead of
    constructing the Flux class."""
    _, _, stock_col, _, flux_col, _ = _imports()
    if convert:
        layer = _column(stock_col, tp, bias=bias, stride=stride, skip_bias_add=skip_bias_add,
                        gather_output=gather_output)
        params = dict(layer.named_parameters())
        keys = list(layer.state_dict())
        assert flux_col.convert_(layer, flux_backend=backend, flux_keep_gathered_input=keep) is layer
        assert type(layer) is flux_col.with_backend(backend)
        assert layer.flux_backend == backend and layer.flux_keep_gathered_input is keep
        assert dict(layer.named_parameters()) == params and list(layer.state_dict()) == keys
    else:
        layer = _column(flux_col, tp, bias=bias, stride=stride, skip_bias_add=skip_bias_add,
                        gather_output=gather_output, flux_backend=backend,
                        flux_keep_gathered_input=keep)
    w_full = layer.master_weight.double()
    b_full = _randn(F, seed=1) if bias else None
    idx = _shard_index(F, tp, rank, stride)
    torch.testing.assert_close(layer.weight.detach(), w_full[idx], rtol=0, atol=0)
    if frozen:
        layer.weight.requires_grad_(False)

    s = S_LOCAL * tp
    x_full = _randn(s, B, H, seed=10)
    if non_contiguous:  # [s, b, h] view of a [b, s, h] tensor, as after a transpose
        base = x_full.transpose(0, 1).contiguous()[:, rank * S_LOCAL:(rank + 1) * S_LOCAL].requires_grad_()
        x = base.transpose(0, 1)
        assert not x.is_contiguous()
    else:
        base = x = x_full[rank * S_LOCAL:(rank + 1) * S_LOCAL].clone().requires_grad_()
    g_full = _randn(s, B, F, seed=11)

    out, out_bias = layer(x, runtime_gather_output=runtime_gather_output)
    gathered = gather_output if runtime_gather_output is None else runtime_gather_output
    if skip_bias_add:
        assert out_bias is layer.bias
    else:
        assert out_bias is None
    y_ref, dx_ref, dw_ref, db_ref = _dense(x_full, w_full, None if skip_bias_add else b_full, g_full)
    # megatron's gather concatenates the ranks' shards: with stride > 1 that is a permutation
    cols = torch.cat([_shard_index(F, tp, r, stride) for r in range(tp)]) if gathered else idx
    _assert_close(out, y_ref[..., cols], "output")
    if in_place:
        _shift_in_place(out)
    out.backward(g_full[..., cols])

    grad_x = base.grad.transpose(0, 1) if non_contiguous else base.grad
    _assert_close(grad_x, dx_ref[rank * S_LOCAL:(rank + 1) * S_LOCAL], "input grad")
    if frozen:
        assert layer.weight.grad is None
    else:
        _assert_close(layer.weight.grad, dw_ref[idx], "weight grad")
    if bias and not skip_bias_add:
        _assert_close(layer.bias.grad, db_ref[idx], "bias grad")
    elif bias:
        assert layer.bias.grad is None
    return layer


def check_column_sp_bias(rank, tp):
    _check_column_sp(rank, tp)


def check_column_sp_no_bias(rank, tp):
    _check_column_sp(rank, tp, bias=False)


def check_column_sp_skip_bias_add(rank, tp):
    _check_column_sp(rank, tp, skip_bias_add=True)


def check_column_sp_gated_fc1_stride2(rank, tp):
    _check_column_sp(rank, tp, stride=2, bias=False)
    _check_column_sp(rank, tp, stride=2, bias=True)


def check_column_sp_gather_output(rank, tp):
    _check_column_sp(rank, tp, gather_output=True)
    _check_column_sp(rank, tp, stride=2, gather_output=True)


def check_column_sp_runtime_gather_output(rank, tp):
    _check_column_sp(rank, tp, runtime_gather_output=True)
    _check_column_sp(rank, tp, gather_output=True, runtime_gather_output=False)


def check_column_sp_keep_gathered_input(rank, tp):
    _check_column_sp(rank, tp, keep=True)


def check_column_sp_frozen_weight(rank, tp):
    _check_column_sp(rank, tp, frozen=True)
    _check_column_sp(rank, tp, frozen=True, keep=True)


def check_column_sp_non_contiguous_input(rank, tp):
    _check_column_sp(rank, tp, non_contiguous=True)


def check_column_sp_auto_and_nccl_backends(rank, tp):
    _check_column_sp(rank, tp, backend="auto")
    _check_column_sp(rank, tp, backend="nccl", keep=True)


def check_column_reuse_equals_regather(rank, tp):
    """Keeping the forward's gathered input and re-gathering it give identical gradients."""
    grads = []
    for keep in (False, True):
        layer = _check_column_sp(rank, tp, keep=keep)
        grads.append((layer.weight.grad.clone(), layer.bias.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def check_column_backend_calls(rank, tp):
    """One fused call per GEMM. Without reuse, the re-gather starts before the dgrad (so it
    runs beside it) and may hand back a buffer the backend owns; the dgrad is started before
    the wgrad and waited for after it. The same order whatever the backend's kind: the fused
    backend's re-gather needs no SM beside its persistent grid."""
    backend = _register_scratch_backend()
    for spins_on_sms in (False, True):
        backend.waits_across_ranks_on_sms = spins_on_sms
        try:
            _check_column_sp(rank, tp, keep=False)
        finally:
            backend.waits_across_ranks_on_sms = False
        assert backend.calls == [
            ("all_gather_matmul", False, False),
            ("all_gather_start", False),
            ("matmul_reduce_scatter_start", False),
            ("all_gather_start.wait",),              # after the dgrad is queued
            ("matmul_reduce_scatter_start.wait",),   # after the wgrad
        ], backend.calls
        backend.calls.clear()
    _check_column_sp(rank, tp, keep=True)
    assert backend.calls == [
        ("all_gather_matmul", True, True),  # kept past the next call: passes gathered_out
        ("matmul_reduce_scatter_start", False),
        ("matmul_reduce_scatter_start.wait",),
    ], backend.calls


def _check_weight_passed(layer, rank, tp, seed, **forward_kwargs):
    """A column layer without a weight of its own (``skip_weight_param_allocation``, as GPTModel's
    output layer with tied embeddings) given this rank's shard in forward: output, input and
    weight gradients against the dense reference. Returns ``(layer's input, weight)``."""
    assert layer.weight is None
    w_full = _randn(F, H, seed=seed)
    idx = _shard_index(F, tp, rank)
    weight = w_full[idx].clone().requires_grad_()
    x_full = _randn(S_LOCAL * tp, B, H, seed=seed + 1)
    x = x_full[rank * S_LOCAL:(rank + 1) * S_LOCAL].clone().requires_grad_()
    g_full = _randn(S_LOCAL * tp, B, F, seed=seed + 2)
    out, _ = layer(x, weight=weight, **forward_kwargs)
    out.backward(g_full[..., idx])
    y_ref, dx_ref, dw_ref, _ = _dense(x_full, w_full, None, g_full)
    _assert_close(out, y_ref[..., idx], "output")
    _assert_close(x.grad, dx_ref[rank * S_LOCAL:(rank + 1) * S_LOCAL], "input grad")
    _assert_close(weight.grad, dw_ref[idx], "weight grad")
    return x, weight


def check_column_weight_passed_to_forward(rank, tp):
    flux_col = _imports()[4]
    layer = _column(flux_col, tp, bias=False, skip_weight_param_allocation=True, flux_backend="scratch")
    x, weight = _check_weight_passed(layer, rank, tp, seed=20)
    with pytest.raises(RuntimeError, match="supplied weight's shape"):
        layer(x, weight=weight[:-1])


def check_converted_column_sp(rank, tp):
    """megatron-core's ColumnParallelLinear converted in place computes what a constructed Flux
    one does (against the dense reference), with its parameters and state_dict keys kept."""
    _check_column_sp(rank, tp, convert=True)
    _check_column_sp(rank, tp, convert=True, bias=False, keep=True)
    _check_column_sp(rank, tp, convert=True, stride=2, gather_output=True)


def check_converted_output_layer_tied_weight(rank, tp):
    """GPTModel's output layer with tied embeddings: no weight of its own, the embedding's passed
    to forward; converted by swap_output_layer (and the config's flux flags read), its gradients
    land on the passed weight."""
    from megatron_flux.output_layer import swap_output_layer

    _, _, stock_col, _, flux_col, _ = _imports()
    cfg = _config(tp)
    cfg.flux_keep_gathered_input = True
    model = torch.nn.Module()
    model.output_layer = _column(stock_col, tp, bias=False, skip_weight_param_allocation=True,
                                 cfg=cfg)
    assert swap_output_layer([model], flux_backend="scratch") == [model]
    layer = model.output_layer
    assert type(layer) is flux_col.with_backend("scratch")
    assert layer.flux_keep_gathered_input is True
    _check_weight_passed(layer, rank, tp, seed=30, runtime_gather_output=False)


def check_swap_output_layer_converts_only_stock_column_layers(rank, tp):
    """Every ``output_layer`` of megatron-core's exact class is converted, through wrappers and
    in every chunk; Flux layers are re-targeted to the backend asked for (as swap_tp_linears
    does in a spec); subclasses (Transformer Engine's LM head stands for these) and other
    modules are left alone; ``convert_`` refuses all but megatron-core's class."""
    from megatron_flux.output_layer import output_layers, swap_output_layer

    _, _, stock_col, stock_row, flux_col, flux_row = _imports()

    class LMHead(stock_col):
        pass

    cfg = _config(tp)
    chunks = [torch.nn.Module() for _ in range(4)]
    chunks[0].module = torch.nn.Module()  # a wrapper (DDP, Float16Module) around the model
    chunks[0].module.output_layer = _column(stock_col, tp, cfg=cfg)
    chunks[1].output_layer = _column(LMHead, tp, cfg=cfg)
    chunks[2].output_layer = _column(flux_col.with_backend("nccl"), tp, cfg=cfg)
    chunks[3].linear = _column(stock_col, tp, cfg=cfg)  # not an output layer
    assert len(output_layers(chunks)) == 3
    swap_output_layer(chunks, flux_backend="auto")
    assert type(chunks[0].module.output_layer) is flux_col.with_backend("auto")
    assert type(chunks[1].output_layer) is LMHead
    assert type(chunks[2].output_layer) is flux_col.with_backend("auto")
    assert chunks[2].output_layer.flux_backend == "auto"
    assert type(chunks[3].linear) is stock_col
    # a second call with another backend switches every Flux output layer, the converted one too
    swap_output_layer(chunks, flux_backend="megatron")
    for layer in (chunks[0].module.output_layer, chunks[2].output_layer):
        assert type(layer) is flux_col.with_backend("megatron") and layer.flux_backend == "megatron"
    with pytest.raises(ValueError, match="unknown megatron-flux backend"):
        swap_output_layer(chunks, flux_backend="nope")

    class MyHead(flux_col):  # a user's own Flux subclass keeps its class, re-targeted
        pass

    mine = torch.nn.Module()
    mine.output_layer = _column(MyHead, tp, cfg=cfg, flux_backend="nccl")
    swap_output_layer(mine, flux_backend="scratch")
    assert isinstance(mine.output_layer, MyHead) and type(mine.output_layer) is MyHead.with_backend("scratch")
    assert mine.output_layer.flux_backend == "scratch"
    for layer, cls in ((chunks[1].output_layer, flux_col), (chunks[2].output_layer, flux_col),
                       (_column(stock_col, tp, cfg=cfg), flux_row)):
        with pytest.raises(TypeError, match="convert_: expected megatron-core's"):
            cls.convert_(layer)
    with pytest.raises(ValueError, match="unknown megatron-flux backend"):
        flux_col.convert_(_column(stock_col, tp, cfg=cfg), flux_backend="nope")
    row = _row(stock_row, tp, cfg=cfg)
    assert type(flux_row.convert_(row, flux_backend="nccl")) is flux_row.with_backend("nccl")
    # gradient accumulation fusion: megatron's own setting is kept (on where the stock layer was
    # built with apex; set by hand here, where stock construction would refuse it), and the
    # config's flux flag turns it on for the plugin's ops alone
    apex_built = _column(stock_col, tp, cfg=cfg)
    apex_built.gradient_accumulation_fusion = True
    flux_col.convert_(apex_built)
    assert apex_built.gradient_accumulation_fusion and apex_built.flux_gradient_accumulation_fusion
    flag_cfg = _config(tp)
    flag_cfg.flux_gradient_accumulation_fusion = True
    flagged = flux_col.convert_(_column(stock_col, tp, cfg=flag_cfg))
    assert not flagged.gradient_accumulation_fusion and flagged.flux_gradient_accumulation_fusion


# ---------------------------------------------------------------------- sequence-parallel row
def _check_row_sp(rank, tp, *, bias=True, skip_bias_add=False, backend="scratch", frozen=False,
                  non_contiguous=False, in_place=False):
    flux_row = _imports()[5]
    layer = _row(flux_row, tp, bias=bias, skip_bias_add=skip_bias_add, flux_backend=backend)
    w_full = layer.master_weight.double()
    b_full = _randn(H, seed=1) if bias else None
    cols = _shard_index(F, tp, rank)
    rows = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    torch.testing.assert_close(layer.weight.detach(), w_full[:, cols], rtol=0, atol=0)
    if bias:
        assert layer.bias.sequence_parallel is True
    if frozen:
        layer.weight.requires_grad_(False)

    s = S_LOCAL * tp
    x_full = _randn(s, B, F, seed=30)
    if non_contiguous:
        base = x_full[..., cols].transpose(0, 1).contiguous().requires_grad_()
        x = base.transpose(0, 1)
        assert not x.is_contiguous()
    else:
        base = x = x_full[..., cols].clone().requires_grad_()
    g_full = _randn(s, B, H, seed=31)

    out, out_bias = layer(x)
    assert (out_bias is layer.bias) if skip_bias_add else (out_bias is None)
    y_ref, dx_ref, dw_ref, db_ref = _dense(x_full, w_full, None if skip_bias_add else b_full, g_full)
    _assert_close(out, y_ref[rows], "output")
    if in_place:
        _shift_in_place(out)
    out.backward(g_full[rows])

    grad_x = base.grad.transpose(0, 1) if non_contiguous else base.grad
    _assert_close(grad_x, dx_ref[..., cols], "input grad")
    if frozen:
        assert layer.weight.grad is None
    else:
        _assert_close(layer.weight.grad, dw_ref[:, cols], "weight grad")
    if bias and not skip_bias_add:
        # each rank holds the sum over its own tokens; megatron's finalize_model_grads sums
        # sequence_parallel params over the TP group -- do that here
        db = layer.bias.grad.clone()
        dist.all_reduce(db)
        _assert_close(db, db_ref, "bias grad (summed over TP)")
    elif bias:
        assert layer.bias.grad is None
    return layer


def check_outputs_modifiable_in_place(rank, tp):
    """Column and row outputs are not autograd views: modified in place before backward, the
    gradients still match the float64 reference."""
    for backend in ("nccl", "scratch"):
        _check_column_sp(rank, tp, backend=backend, in_place=True)
        _check_row_sp(rank, tp, backend=backend, in_place=True)


def check_row_sp_bias(rank, tp):
    _check_row_sp(rank, tp)


def check_row_sp_no_bias(rank, tp):
    _check_row_sp(rank, tp, bias=False)


def check_row_sp_skip_bias_add(rank, tp):
    _check_row_sp(rank, tp, skip_bias_add=True)


def check_row_sp_frozen_weight(rank, tp):
    _check_row_sp(rank, tp, frozen=True)


def check_row_sp_non_contiguous_input(rank, tp):
    _check_row_sp(rank, tp, non_contiguous=True)


def check_row_sp_auto_and_nccl_backends(rank, tp):
    _check_row_sp(rank, tp, backend="auto")
    _check_row_sp(rank, tp, backend="nccl")


def check_row_backend_calls(rank, tp):
    """Forward fuses the bias into GEMM+RS; backward takes the gathered dY from the dgrad."""
    backend = _register_scratch_backend()
    _check_row_sp(rank, tp)
    assert backend.calls == [
        ("matmul_reduce_scatter", True),
        ("all_gather_matmul", True, False),
    ], backend.calls
    backend.calls.clear()
    _check_row_sp(rank, tp, frozen=True)
    assert backend.calls == [("matmul_reduce_scatter", True), ("all_gather_matmul", False, False)]


def check_megatron_passthrough_routing(rank, tp):
    """``flux_backend='megatron'`` hands the sequence-parallel path back to megatron-core's own
    code (no backend call at all), and the attribute may change between forwards (the
    interleaved benchmark switches it per block of iterations)."""
    flux_col, flux_row = _imports()[4:6]
    backend = _register_scratch_backend()
    col = _column(flux_col, tp, flux_backend="megatron")
    row = _row(flux_row, tp, flux_backend="megatron")
    assert not col._uses_flux_ops() and not row._uses_flux_ops()
    for layer in (col, row):
        layer.flux_backend = "scratch"
    assert col._uses_flux_ops() and row._uses_flux_ops()
    x = _randn(S_LOCAL, B, H, seed=40)
    col(x)
    # the column layer keeps its gathered input by default: the op asks for it back
    assert backend.calls == [("all_gather_matmul", True, True)], backend.calls


def check_mlp_block_sp(rank, tp):
    """fc1 (gated, stride 2) → SwiGLU → fc2, both Flux, against the dense block."""
    _, _, _, _, flux_col, flux_row = _imports()
    cfg = _config(tp)
    fc1 = _build(flux_col, 40, H, 2 * F, config=cfg, init_method=_init, bias=False, stride=2,
                 gather_output=False, flux_backend="scratch")
    fc2 = _build(flux_row, 41, F, H, config=cfg, init_method=_init, bias=False,
                 input_is_parallel=True, skip_bias_add=False, flux_backend="scratch")
    w1, w2 = fc1.master_weight.double(), fc2.master_weight.double()
    x_full = _randn(S_LOCAL * tp, B, H, seed=42)
    g_full = _randn(S_LOCAL * tp, B, H, seed=43)
    rows = slice(rank * S_LOCAL, (rank + 1) * S_LOCAL)
    x = x_full[rows].clone().requires_grad_()

    def swiglu(h):
        gate, up = torch.chunk(h, 2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    h, _ = fc1(x)
    y, _ = fc2(swiglu(h))
    y.backward(g_full[rows])

    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x_full, w1, w2))
    yr = swiglu(xr @ w1r.t()) @ w2r.t()
    yr.backward(g_full)
    _assert_close(y, yr.detach()[rows], "block output")
    _assert_close(x.grad, xr.grad[rows], "block input grad")
    _assert_close(fc1.weight.grad, w1r.grad[_shard_index(2 * F, tp, rank, 2)], "fc1 weight grad")
    _assert_close(fc2.weight.grad, w2r.grad[:, _shard_index(F, tp, rank)], "fc2 weight grad")


def check_forward_under_no_grad(rank, tp):
    """Inference: no graph, nothing kept, same output as with autograd."""
    _, _, _, _, flux_col, flux_row = _imports()
    col = _column(flux_col, tp, flux_backend="scratch", flux_keep_gathered_input=True)
    row = _row(flux_row, tp, flux_backend="scratch")
    x = _randn(S_LOCAL, B, H, seed=45)
    with torch.no_grad():
        h, _ = col(x)
        y, _ = row(h)
    assert not h.requires_grad and not y.requires_grad
    torch.testing.assert_close(y, row(col(x)[0])[0].detach(), rtol=0, atol=0)


# -------------------------------------------------------------------------------- bad inputs
def check_bad_inputs(rank, tp):
    _, _, _, _, flux_col, flux_row = _imports()
    row = _row(flux_row, tp, flux_backend="scratch")
    with pytest.raises(ValueError, match="sequence length .* not divisible by the tensor-parallel size"):
        row(torch.zeros(S_LOCAL * tp + 1, B, F // tp, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32 but weight is torch.float64"):
        row(torch.zeros(S_LOCAL * tp, B, F // tp, dtype=torch.float32))
    col = _column(flux_col, tp, flux_backend="scratch")
    with pytest.raises(TypeError, match="float32 but weight is torch.float64"):
        col(torch.zeros(S_LOCAL, B, H, dtype=torch.float32))
    with pytest.raises(ValueError, match="input's last dimension is"):
        col(torch.zeros(S_LOCAL, B, H + 1, dtype=torch.float64))
    # the world is still in step
    _check_column_sp(rank, tp, bias=False)


# --------------------------------------------------------- stock parity (no SP or TP=1 or experts)
def _assert_same_params(stock, flux):
    sp, fp = dict(stock.named_parameters()), dict(flux.named_parameters())
    assert sp.keys() == fp.keys()
    for name in sp:
        assert torch.equal(sp[name], fp[name]), name
        assert sp[name].requires_grad == fp[name].requires_grad
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce",
                     "sequence_parallel", "expert_tp", "is_qkv"):
            assert hasattr(sp[name], attr) == hasattr(fp[name], attr), (name, attr)
            if hasattr(sp[name], attr):
                assert getattr(sp[name], attr) == getattr(fp[name], attr), (name, attr)
    assert list(dict(stock.named_buffers())) == list(dict(flux.named_buffers()))


def _assert_bitwise_same_run(stock, flux, x, g, **fwd):
    outs = []
    for layer in (stock, flux):
        xi = x.clone().requires_grad_()
        out, ob = layer(xi, **fwd)
        out.backward(g)
        outs.append((out, ob, xi.grad, layer.weight.grad,
                     layer.bias.grad if layer.bias is not None else None))
    for name, a, b in zip(("output", "output bias", "input grad", "weight grad", "bias grad"), *outs):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name} differs from stock"


def _parity_pairs(tp, cfg, seed, *, col_kwargs=(), row_kwargs=()):
    _, _, stock_col, stock_row, flux_col, flux_row = _imports()
    col_kwargs, row_kwargs = dict(col_kwargs), dict(row_kwargs)
    cols = [_column(c, tp, cfg=cfg, seed=seed, **col_kwargs) for c in (stock_col, flux_col)]
    rows = [_row(c, tp, cfg=cfg, seed=seed + 5, **row_kwargs) for c in (stock_row, flux_row)]
    return cols, rows


def check_sp_off_equals_stock(rank, tp):
    cfg = _config(tp, sp=False)
    for skip in (False, True):
        cols, rows = _parity_pairs(tp, cfg, 50, col_kwargs={"skip_bias_add": skip},
                                   row_kwargs={"skip_bias_add": skip})
        for stock, flux in (cols, rows):
            _assert_same_params(stock, flux)
        _assert_bitwise_same_run(*cols, _randn(S_LOCAL * tp, B, H, seed=51), _randn(S_LOCAL * tp, B, F // tp, seed=52))
        _assert_bitwise_same_run(*rows, _randn(S_LOCAL * tp, B, F // tp, seed=53), _randn(S_LOCAL * tp, B, H, seed=54))


def check_tp1_equals_stock(rank, tp):
    groups = [dist.new_group([r]) for r in range(tp)]  # every rank creates every group
    cfg = _config(1, sp=False)
    cols, rows = _parity_pairs(1, cfg, 60, col_kwargs={"tp_group": groups[rank]},
                               row_kwargs={"tp_group": groups[rank]})
    for stock, flux in (cols, rows):
        _assert_same_params(stock, flux)
    _assert_bitwise_same_run(*cols, _randn(4, B, H, seed=61), _randn(4, B, F, seed=62))
    _assert_bitwise_same_run(*rows, _randn(4, B, F, seed=63), _randn(4, B, H, seed=64))
    # sequence_parallel switched on with TP=1 changes nothing either (megatron ignores it)
    cfg.sequence_parallel = True
    cols, rows = _parity_pairs(1, cfg, 65, col_kwargs={"tp_group": groups[rank]},
                               row_kwargs={"tp_group": groups[rank]})
    _assert_bitwise_same_run(*cols, _randn(4, B, H, seed=66), _randn(4, B, F, seed=67))
    _assert_bitwise_same_run(*rows, _randn(4, B, F, seed=68), _randn(4, B, H, seed=69))


def check_expert_layers_equal_stock(rank, tp):
    """Experts with explicit communication do no TP comm inside the linear: stock path."""
    cfg = _config(tp)
    cols, rows = _parity_pairs(tp, cfg, 70, col_kwargs={"is_expert": True},
                               row_kwargs={"is_expert": True, "skip_bias_add": True})
    assert cols[1].explicit_expert_comm and rows[1].explicit_expert_comm
    for stock, flux in (cols, rows):
        _assert_same_params(stock, flux)
    _assert_bitwise_same_run(*cols, _randn(4, B, H, seed=71), _randn(4, B, F // tp, seed=72))
    _assert_bitwise_same_run(*rows, _randn(4, B, F // tp, seed=73), _randn(4, B, H, seed=74))


def check_sp_params_match_stock(rank, tp):
    """With SP on (where stock cannot run on CPU) the parameters are still stock's."""
    cfg = _config(tp)
    for kwargs in ({}, {"stride": 2}, {"bias": False}):
        cols, rows = _parity_pairs(tp, cfg, 80, col_kwargs=kwargs,
                                   row_kwargs={k: v for k, v in kwargs.items() if k != "stride"})
        for stock, flux in (cols, rows):
            _assert_same_params(stock, flux)


# ---------------------------------------------------------------------------- checkpoints
def _assert_same_sharded(a, b):
    assert a.keys() == b.keys()
    for key in a:
        sa, sb = a[key], b[key]
        assert type(sa) is type(sb), key
        for field in dataclasses.fields(sa):
            va, vb = getattr(sa, field.name), getattr(sb, field.name)
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), (key, field.name)
            else:
                assert va == vb, (key, field.name, va, vb)


def check_state_dicts_match_stock(rank, tp):
    parallel_state = _imports()[1]
    cfg = _config(tp)
    cols, rows = _parity_pairs(tp, cfg, 90)
    # 0.16.1 and 0.19 both read metadata["dp_cp_group"] in the linears' sharded_state_dict
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    for stock, flux in (cols, rows):
        sd_stock, sd_flux = stock.state_dict(), flux.state_dict()
        assert list(sd_stock) == list(sd_flux)
        for k in sd_stock:
            if isinstance(sd_stock[k], torch.Tensor):
                assert torch.equal(sd_stock[k], sd_flux[k]), k
            else:
                assert sd_stock[k] == sd_flux[k], k
        _assert_same_sharded(
            stock.sharded_state_dict(prefix="layer.", metadata=dict(metadata)),
            flux.sharded_state_dict(prefix="layer.", metadata=dict(metadata)),
        )


def check_state_dict_round_trip(rank, tp):
    """stock → Flux → stock, with different initial weights on each side."""
    cfg = _config(tp)
    (stock_a, _), (stock_ra, _) = _parity_pairs(tp, cfg, 100)
    (_, flux), (_, flux_r) = _parity_pairs(tp, cfg, 110)
    (stock_b, _), (stock_rb, _) = _parity_pairs(tp, cfg, 120)
    for src, mid, dst in ((stock_a, flux, stock_b), (stock_ra, flux_r, stock_rb)):
        assert not torch.equal(src.weight, mid.weight)
        mid.load_state_dict(src.state_dict(), strict=True)
        dst.load_state_dict(mid.state_dict(), strict=True)
        for name, p in src.named_parameters():
            assert torch.equal(p, dict(mid.named_parameters())[name]), name
            assert torch.equal(p, dict(dst.named_parameters())[name]), name
    # a checkpoint without _extra_state (older or TE-less) still loads strictly, as in stock
    sd = stock_a.state_dict()
    sd.pop("_extra_state", None)
    flux.load_state_dict(sd, strict=True)


def check_constructor_arguments(rank, tp):
    """0.19's ``name=``, ``with_backend`` defaults, and explicit overrides."""
    _, _, _, _, flux_col, flux_row = _imports()
    layer = _column(flux_col, tp, name="decoder.layers.0.mlp.linear_fc1")
    assert layer.flux_backend == "auto"
    nccl_col = flux_col.with_backend("nccl")
    assert _column(nccl_col, tp).flux_backend == "nccl"
    assert _column(nccl_col, tp, flux_backend="scratch").flux_backend == "scratch"
    assert _row(flux_row.with_backend("nccl"), tp, name="linear_fc2").flux_backend == "nccl"
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_argument'"):
        _column(flux_col, tp, not_an_argument=1)


def _with_output_dtype(layer, dtype):
    """``layer`` as megatron-core after 0.19 builds and runs it: an ``output_dtype`` attribute
    that its forward passes to ``_forward_impl`` (0.16 has neither; where the installed
    megatron-core takes ``output_dtype``, its forward passes it already)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    layer.output_dtype = dtype
    if "output_dtype" in inspect.signature(ColumnParallelLinear.__init__).parameters:
        return layer
    impl = layer._forward_impl
    layer._forward_impl = lambda *a, **kw: impl(*a, **kw, output_dtype=layer.output_dtype)
    return layer


@contextlib.contextmanager
def _parent_matmul_with_output_dtype(stock_col, calls):
    """The parent's ``_forward_impl`` as megatron-core after 0.19 has it (forward only):
    sequence-parallel gather, then the GEMM's output in ``output_dtype``."""

    def forward_impl(self, input, weight, bias=None, sequence_parallel=False, tp_group=None,
                     output_dtype=None, **_):
        calls.append(output_dtype)
        if sequence_parallel:
            parts = [torch.empty_like(input) for _ in range(tp_group.size())]
            dist.all_gather(parts, input.contiguous(), group=tp_group)
            input = torch.cat(parts)
        dtype = output_dtype or input.dtype
        out = torch.matmul(input.to(dtype), weight.to(dtype).t())
        return out if bias is None else out + bias.to(dtype)

    original = stock_col.__dict__["_forward_impl"]
    stock_col._forward_impl = forward_impl
    try:
        yield
    finally:
        stock_col._forward_impl = original


def check_column_sp_output_dtype(rank, tp):
    """A column layer asked for an output dtype other than its input's (megatron-core after
    0.19: fp32 logits from bf16 inputs; float64 from float32 here) returns that dtype, computed
    by megatron-core's own matmul, instead of megatron-flux's ops' input-dtype result; asked for
    the input's dtype (or none), it runs megatron-flux's ops."""
    ModelParallelConfig, _, stock_col, _, flux_col, _ = _imports()
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True,
                              use_cpu_initialization=True, params_dtype=torch.float32)
    layer = _with_output_dtype(_column(flux_col, tp, cfg=cfg, flux_backend="scratch"), torch.float64)
    x_full = _randn(S_LOCAL * tp, B, H, seed=60).float()
    x = x_full[rank * S_LOCAL:(rank + 1) * S_LOCAL]
    ref = torch.matmul(x_full.double(), layer.weight.double().t()) + layer.bias.double()
    calls = []
    with _parent_matmul_with_output_dtype(stock_col, calls), torch.no_grad():
        out, _ = layer(x)
        assert calls == [torch.float64] and out.dtype == torch.float64
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for same in (torch.float32, None):
            layer.output_dtype = same
            out, _ = layer(x)
            assert calls == [torch.float64] and out.dtype == torch.float32  # megatron-flux's ops
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


SP_CHECKS = [
    check_column_sp_output_dtype,
    check_column_sp_bias,
    check_column_sp_no_bias,
    check_column_sp_skip_bias_add,
    check_column_sp_gated_fc1_stride2,
    check_column_sp_gather_output,
    check_column_sp_runtime_gather_output,
    check_column_sp_keep_gathered_input,
    check_column_sp_frozen_weight,
    check_column_sp_non_contiguous_input,
    check_column_sp_auto_and_nccl_backends,
    check_column_reuse_equals_regather,
    check_column_backend_calls,
    check_column_weight_passed_to_forward,
    check_converted_column_sp,
    check_converted_output_layer_tied_weight,
    check_swap_output_layer_converts_only_stock_column_layers,
    check_row_sp_bias,
    check_row_sp_no_bias,
    check_row_sp_skip_bias_add,
    check_row_sp_frozen_weight,
    check_row_sp_non_contiguous_input,
    check_row_sp_auto_and_nccl_backends,
    check_row_backend_calls,
    check_outputs_modifiable_in_place,
    check_megatron_passthrough_routing,
    check_mlp_block_sp,
    check_forward_under_no_grad,
    check_bad_inputs,
]
PARITY_CHECKS = [
    check_sp_off_equals_stock,
    check_tp1_equals_stock,
    check_expert_layers_equal_stock,
    check_sp_params_match_stock,
    check_state_dicts_match_stock,
    check_state_dict_round_trip,
    check_constructor_arguments,
]


def _with_scratch_backend(rank, tp):
    _register_scratch_backend()


CHECKS = [_with_scratch_backend] + SP_CHECKS + PARITY_CHECKS
_RESULTS = {}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def world_results(request):
    tp = request.param
    return run_checks(CHECKS, tp, timeout=180, tensor_model_parallel_size=tp)


@pytest.mark.slow
@pytest.mark.parametrize("check", SP_CHECKS + PARITY_CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_layers(world_results, check):
    assert world_results["_with_scratch_backend"] is None, world_results["_with_scratch_backend"]
    failure = world_results[check.__name__]
    assert failure is None, failure


# ------------------------------------------------------------------- single-process tests
def test_with_backend_is_cached_named_and_picklable():
    from megatron_flux.layers import linear

    for base in (linear.FluxColumnParallelLinear, linear.FluxRowParallelLinear):
        cls = base.with_backend("nccl")
        assert cls is base.with_backend("nccl")
        assert cls.with_backend("nccl") is cls and cls.with_backend("auto") is base.with_backend("auto")
        assert issubclass(cls, base) and cls.__name__ == f"{base.__name__}_nccl"
        assert cls.__qualname__ == cls.__name__ and cls.__module__ == base.__module__
        assert pickle.loads(pickle.dumps(cls)) is cls
        assert getattr(linear, f"{base.__name__}_auto") is base.with_backend("auto")

        class Custom(base):
            pass

        assert issubclass(Custom.with_backend("nccl"), Custom)


def test_unknown_backend_is_rejected_before_construction():
    from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear

    with pytest.raises(ValueError, match="unknown megatron-flux backend 'nope'"):
        FluxColumnParallelLinear.with_backend("nope")
    with pytest.raises(ValueError, match="unknown megatron-flux backend 'nope'.*auto"):
        FluxRowParallelLinear(8, 8, config=None, init_method=_init, bias=False, input_is_parallel=True,
                              skip_bias_add=False, flux_backend="nope")
    with pytest.raises(TypeError, match="flux_backend must be a str"):
        FluxColumnParallelLinear(8, 8, config=None, init_method=_init, flux_backend=None)
