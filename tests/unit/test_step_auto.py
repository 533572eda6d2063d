"""``auto`` from the job's own steps: the schedule, the decision rule, the hook and the agreement."""

import pytest
import torch

from helpers.dist_harness import gloo_world_of_one, run_distributed
from megatron_flux.step_auto import StepAutoSelector, graphs_enabled, install_step_auto


class _Layer:
    def __init__(self):
        self.flux_backend = "auto"


class _Job:
    """A fake job: each iteration takes ``step_s[backend]`` seconds (plus ``noise``) on a clock
    the selector reads; records which backend ran each iteration."""

    def __init__(self, step_s, noise=None):
        self.step_s, self.noise = step_s, noise or {}
        self.now, self.ran = 0.0, []

    def clock(self):
        return self.now

    def run(self, selector, layers, iterations, first=100, microbatches=1):
        for i in range(first, first + iterations):
            for _ in range(microbatches):
                selector.step(i)
                self.now += 0.1 / microbatches  # the micro-batches take time inside the step
            backend = layers[0].flux_backend
            assert all(layer.flux_backend == backend for layer in layers)
            self.ran.append(backend)
            self.now += self.step_s[backend] + self.noise.get(i - first, 0.0) - 0.1


def _selector(layers, job, **kw):
    logs = []
    kw = {"start_after": 2, "rounds": 2, "candidates": ("megatron", "nccl", "auto"), **kw}
    sel = StepAutoSelector(layers, clock=job.clock, synchronize=lambda: None, log=logs.append, **kw)
    return sel, logs


def test_the_fastest_candidate_wins_after_a_fixed_schedule():
    layers = [_Layer(), _Layer()]
    job = _Job({"megatron": 0.350, "nccl": 0.345, "auto": 0.330})
    sel, logs = _selector(layers, job)
    job.run(sel, layers, sel.iterations_needed + 5)
    assert sel.decided == "auto" and layers[0].flux_backend == "auto"
    # start-up iterations on the per-op auto, one warm-up iteration each, then rotated blocks
    assert job.ran[:2] == ["auto", "auto"]
    assert job.ran[2:5] == ["megatron", "nccl", "auto"]
    assert job.ran[5:14] == ["megatron"] * 3 + ["nccl"] * 3 + ["auto"] * 3
    assert job.ran[14:23] == ["nccl"] * 3 + ["auto"] * 3 + ["megatron"] * 3
    assert all(b == "auto" for b in job.ran[23:])
    # two timed iterations per block (its first is dropped), two rounds
    assert {k: len(v) for k, v in sel.samples.items()} == {"megatron": 4, "nccl": 4, "auto": 4}
    assert sel.samples["nccl"] == pytest.approx([0.345] * 4)
    assert len(logs) == 1 and "flux_backend='auto'" in logs[0] and "megatron 350.0 ms" in logs[0]
    assert sel.paired_speedups()["auto"] == pytest.approx(350 / 330)


def test_a_slow_round_does_not_decide_the_pairs_do():
    """The first timed round runs slow for every candidate but megatron (the job's start-up
    transient): per-round pairs, their median over the rounds (six by default), still find
    nccl faster; stock is kept where the pairs say nothing beats it."""
    layers = [_Layer()]
    steps = {"megatron": 0.350, "nccl": 0.330, "auto": 0.345}
    # defaults: 6 start-up iterations, a warm-up block of 3, then round 0 = offsets 9..17
    noise = {i: 0.5 for i in range(12, 18)}  # round 0's nccl and auto blocks
    job = _Job(steps, noise)
    three = ("megatron", "nccl", "auto")
    sel = StepAutoSelector(layers, clock=job.clock, synchronize=lambda: None, log=lambda m: None,
                           candidates=three)
    job.run(sel, layers, sel.iterations_needed)
    assert job.ran[9:12] == ["megatron"] * 3
    assert sel.paired_speedups()["nccl"] == pytest.approx(350 / 330)
    assert sel.decided == "nccl"
    job = _Job({"megatron": 0.330, "nccl": 0.330, "auto": 0.345}, noise)
    sel = StepAutoSelector(layers, clock=job.clock, synchronize=lambda: None, log=lambda m: None,
                           candidates=three)
    job.run(sel, layers, sel.iterations_needed)
    assert sel.decided == "megatron"


def test_every_micro_batch_may_call_it_the_step_is_timed_from_the_first():
    """Called at every forward step (each micro-batch), it times whole iterations: from the
    first micro-batch of one to the first of the next."""
    layers = [_Layer()]
    job = _Job({"megatron": 0.350, "nccl": 0.345, "auto": 0.330})
    sel, _ = _selector(layers, job)
    job.run(sel, layers, sel.iterations_needed, microbatches=4)
    assert sel.samples["nccl"] == pytest.approx([0.345] * 4)
    assert sel.decided == "auto"


def test_stock_is_kept_unless_another_candidate_beats_it_by_the_margin():
    layers = [_Layer()]
    job = _Job({"megatron": 0.350, "nccl": 0.346, "auto": 0.3445})  # 1.6 % faster: noise
    sel, _ = _selector(layers, job)
    job.run(sel, layers, sel.iterations_needed)
    assert sel.decided == "megatron" and layers[0].flux_backend == "megatron"


def test_the_first_iteration_of_a_block_and_outliers_do_not_decide():
    """A slow first iteration after each switch (dropped) and one outlier (the median) leave the
    choice to the steady state."""
    layers = [_Layer()]
    steps = {"megatron": 0.350, "nccl": 0.340, "auto": 0.345}
    # iteration offsets of each block's first iteration, and one outlier in an nccl block
    noise = {i: 1.0 for i in (5, 8, 11, 14, 17, 20)}
    noise[7] = 2.0  # megatron's second timed iteration of round 1
    job = _Job(steps, noise)
    sel, _ = _selector(layers, job)
    job.run(sel, layers, sel.iterations_needed)
    assert sel.decided == "nccl"
    assert sorted(sel.samples["megatron"])[-1] > 2  # the outlier is a sample, the median holds
    kept = sorted(sel.samples["megatron"])[:-1] + sel.samples["nccl"] + sel.samples["auto"]
    assert max(kept) < 0.5  # no block's first iteration was timed


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="at least two"):
        StepAutoSelector([_Layer()], candidates=("auto",))
    with pytest.raises(ValueError, match="unknown megatron-flux backend"):
        StepAutoSelector([_Layer()], candidates=("auto", "fast"))
    with pytest.raises(ValueError, match="steps_per_block"):
        StepAutoSelector([_Layer()], steps_per_block=1)


def test_graphs_turn_it_off():
    from types import SimpleNamespace as NS

    assert not graphs_enabled(NS(cuda_graph_impl="none"))
    assert graphs_enabled(NS(cuda_graph_impl="local"))
    assert graphs_enabled(NS(cuda_graph_impl="full_iteration"))
    assert graphs_enabled(NS(enable_cuda_graph=True))
    assert not graphs_enabled(None)


def _flux_model(group, backend="auto", graphs="none"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_flux.layers.linear import FluxColumnParallelLinear, FluxRowParallelLinear

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                            use_cpu_initialization=True)
    cfg.cuda_graph_impl = graphs
    model = torch.nn.Module()
    model.fc1 = FluxColumnParallelLinear(16, 32, config=cfg, init_method=torch.nn.init.zeros_,
                                         bias=False, gather_output=False, tp_group=group,
                                         flux_backend=backend)
    model.fc2 = FluxRowParallelLinear(32, 16, config=cfg, init_method=torch.nn.init.zeros_,
                                      bias=False, input_is_parallel=True, skip_bias_add=True,
                                      tp_group=group, flux_backend=backend)
    model.forward = lambda x: x
    return model


def test_the_forward_hook_steps_once_per_training_iteration_and_goes_away():
    with gloo_world_of_one() as group:
        model = _flux_model(group)
        it, logs = {"n": 0}, []
        sel = install_step_auto([model], iteration=lambda: it["n"], log=logs.append,
                                synchronize=lambda: None, clock=lambda: float(it["n"]))
        assert sel is not None and sel.layers == [model.fc1, model.fc2]
        seen = []
        real_step = sel.step
        sel.step = lambda i: seen.append(i) or real_step(i)
        for n in range(sel.iterations_needed + 3):
            it["n"] = n
            for _ in range(4):  # micro-batches: one step per iteration
                model(torch.zeros(1))
            model.eval()
            model(torch.zeros(1))  # evaluation never steps
            model.train()
        assert seen == list(range(sel.iterations_needed))  # removed once decided
        assert sel.decided == "megatron"  # every candidate took one clock second
        assert model.fc1.flux_backend == model.fc2.flux_backend == "megatron"
        assert len(logs) == 2 and "take turns until iteration" in logs[0]
        assert "flux_backend='megatron' for this job" in logs[1]


def test_a_job_too_short_to_choose_runs_the_per_op_auto_throughout():
    """The README's 30-iteration job: the selection needs more, so it does not start (rotating
    candidates without a choice would only spend the job's steps)."""
    with gloo_world_of_one() as group:
        model = _flux_model(group)
        it, logs = {"n": 0}, []
        sel = install_step_auto([model], iteration=lambda: it["n"], train_iters=lambda: 30,
                                log=logs.append, synchronize=lambda: None, clock=lambda: 0.0)
        assert sel.iterations_needed > 30
        for n in range(30):
            it["n"] = n
            model(torch.zeros(1))
            assert model.fc1.flux_backend == model.fc2.flux_backend == "auto"
        assert sel._first is None and sel.decided is None  # never stepped
        assert len(logs) == 1 and "30 iterations left, fewer than the" in logs[0]
        # resumed at iteration 200 of 220: 20 left
        model2, logs2 = _flux_model(group), []
        it["n"] = 200
        install_step_auto([model2], iteration=lambda: it["n"], train_iters=lambda: 220,
                          log=logs2.append, synchronize=lambda: None, clock=lambda: 0.0)
        model2(torch.zeros(1))
        assert "20 iterations left" in logs2[0] and model2.fc1.flux_backend == "auto"


def test_nothing_to_choose_without_auto_layers_or_with_graphs():
    with gloo_world_of_one() as group:
        logs = []
        assert install_step_auto([_flux_model(group, backend="flux")], log=logs.append) is None
        assert install_step_auto([_flux_model(group, graphs="local")], log=logs.append) is None
        assert len(logs) == 1 and "CUDA graphs" in logs[0]


def _disagreeing_rank(rank, world_size):
    """Rank 0 measures nccl fastest, rank 1 auto: both must end on rank 0's choice."""
    import torch.distributed as dist

    layers = [_Layer()]
    fast = "nccl" if rank == 0 else "auto"
    job = _Job({"megatron": 0.35, "nccl": 0.35, "auto": 0.35, "flux": 0.35, fast: 0.30})
    sel = StepAutoSelector(layers, clock=job.clock, synchronize=lambda: None, log=lambda m: None,
                           group=dist.group.WORLD)
    job.run(sel, layers, sel.iterations_needed)
    return sel.decided, layers[0].flux_backend


@pytest.mark.slow
def test_tp_ranks_agree_on_rank_zeros_choice():
    assert run_distributed(_disagreeing_rank, 2) == [("nccl", "nccl")] * 2


def test_by_default_fused_everywhere_is_a_candidate_too():
    """The tables time ops alone, so the per-op ``auto`` can lose to fused-everywhere in the
    step: the default candidates time ``flux`` as well, and it wins where it is fastest."""
    layers = [_Layer()]
    job = _Job({"megatron": 0.350, "nccl": 0.340, "auto": 0.330, "flux": 0.320})
    sel = StepAutoSelector(layers, clock=job.clock, synchronize=lambda: None, log=lambda m: None)
    job.run(sel, layers, sel.iterations_needed + 2)
    assert set(sel.samples) == {"megatron", "nccl", "auto", "flux"}
    assert sel.decided == "flux" and job.ran[-1] == "flux"
    assert sel.paired_speedups()["flux"] == pytest.approx(350 / 320)


def test_the_docs_state_the_iterations_the_default_selection_takes():
    """README, docs/reference.md and the --flux-step-auto help say how many iterations the
    default selection takes (start-up, warm-up and timed blocks): the number it takes."""
    import re

    from helpers.paths import REPO

    needed = StepAutoSelector([], log=lambda m: None).iterations_needed
    said = []
    for path in ("README.md", "docs/reference.md", "megatron_flux/arguments.py"):
        text = (REPO / path).read_text()
        said += [(path, int(n)) for n in re.findall(r"(?:about |~)(\d+) iterations", text)]
    # README: the introduction, the main job, Requirements; reference: --flux-backend and
    # --flux-step-auto; the flag's help
    assert len(said) >= 6 and {n for _, n in said} == {needed}, (needed, said)
