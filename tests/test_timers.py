"""The wall-clock breakdown: its phases cover the step, it changes no numbers, and off means no timer calls."""

import statistics
import time

import pytest
import torch

import fspeed as fs
import fspeed.timers as timers_module
from fspeed.timers import METRIC_KEYS, StepTimers, breakdown_line, breakdown_summary


def _setup(seed=0):
    cfg = fs.models.GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64)
    model = fs.models.gpt(cfg)
    params = model.init(torch.Generator().manual_seed(seed))
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3))
    x = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1))
    return model, opt, fs.init_train_state(params, opt), {"inputs": x[:, :-1], "targets": x[:, 1:]}


def test_breakdown_parts_sum_to_the_step_time_and_change_nothing():
    model, opt, state, batch = _setup()
    _, _, plain, _ = _setup()
    timers = StepTimers()
    timed_step = fs.make_train_step(model.loss, opt, grad_accum=2, timers=timers)
    plain_step = fs.make_train_step(model.loss, opt, grad_accum=2)
    ratios = []
    for i in range(6):
        t0 = time.perf_counter()
        state, metrics = timed_step(state, batch)
        wall_ms = (time.perf_counter() - t0) * 1e3
        plain, plain_metrics = plain_step(plain, batch)
        assert metrics["loss"] == plain_metrics["loss"]  # timing changes no number
        assert set(METRIC_KEYS) <= set(metrics)
        assert metrics["bwd_ms"] == pytest.approx(metrics["bwd_inner_ms"] + metrics["bwd_allreduce_ms"])
        assert all(metrics[k] > 0 for k in ("fwd_ms", "bwd_inner_ms", "step_ms"))
        if i:  # the first step warms up
            ratios.append((metrics["fwd_ms"] + metrics["bwd_ms"] + metrics["step_ms"]) / wall_ms)
    assert 0.9 <= statistics.median(ratios) <= 1.0, ratios
    torch.testing.assert_close(state.params.buffer, plain.params.buffer, rtol=0, atol=0)
    assert breakdown_line(metrics).startswith("time (ms) | fwd: ")
    summary = breakdown_summary([metrics, metrics])
    assert "bwd_allreduce" in summary and "over 1 steps" in summary


def test_off_means_no_timer_calls(monkeypatch):
    calls = []
    real = time.perf_counter

    class Clock:  # counts the timers module's clock reads
        @staticmethod
        def perf_counter():
            calls.append(1)
            return real()

    monkeypatch.setattr(timers_module, "time", Clock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    model, opt, state, batch = _setup()
    state, metrics = fs.make_train_step(model.loss, opt, grad_accum=2)(state, batch)
    assert calls == [] and not set(METRIC_KEYS) & set(metrics)
    state, metrics = fs.make_train_step(model.loss, opt, grad_accum=2, timers=StepTimers())(state, batch)
    assert len(calls) == 2 * (2 * 2 + 2) and "sync" not in calls  # start+stop of 2 phases x 2 micro + 2; no CUDA sync


def zero_steps_with_timers(stage: int, steps: int = 3):
    """On each rank of a gloo world: the tiny GPT under ZeRO-`stage`, timed and untimed side by side."""
    from tests.parallel_cases import gpt_setup, make_opt

    mesh = fs.Mesh(data=-1)
    cfg, model, params = gpt_setup(0, n_layer=2, d_model=32, n_head=4, vocab=32, seq=16)
    opt, plan = make_opt("adamw"), fs.zero(stage, param_persistence_threshold=0)
    states = [fs.init_train_state(params, opt, plan=plan, mesh=mesh, logical_axes=model.logical_axes) for _ in "ab"]
    timed = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh, timers=StepTimers())
    plain = fs.make_train_step(model.loss, opt, grad_accum=2, plan=plan, mesh=mesh)
    out = []
    for step in range(steps):
        x = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(step * 10 + mesh.rank))
        batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
        states[0], metrics = timed(states[0], batch)
        states[1], reference = plain(states[1], batch)
        out.append((metrics, reference["loss"]))
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_breakdown_under_zero_reports_the_parameter_all_gather_wait(world2, stage):
    for rank_result in world2.run(zero_steps_with_timers, stage):
        for metrics, reference_loss in rank_result:
            assert metrics["loss"] == reference_loss
            assert metrics["fwd_ms"] > 0 and metrics["bwd_allreduce_ms"] >= 0 and metrics["step_ms"] > 0
            assert metrics["allgather_ms"] >= 0  # (how it compares with fwd_ms is wall-clock, left to the machine)
        if stage == 3:  # every unit is gathered in forward and again in backward: the first unit's is waited for
            assert all(m["allgather_ms"] > 0 for m, _ in rank_result)
        # ZeRO-1: the last update's gather runs between steps; whether the forward still waits for it (and how
        # long) depends on the machine, so only its presence is checked (allgather_ms >= 0 above)
