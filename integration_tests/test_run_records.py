"""What a guarded run leaves to look at, on real training runs: the JSONL event log (a record per
optimizer step and per decision), the per-step figures in each framework's own channel (HF ``logs``
and ``log_history`` -> trainer_state.json, Lightning's CSV logger, mlx_lm's report dicts), one
WARNING line per decision, and ``memguard report``'s picture of it."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys

import pytest

from memguard_core.events import read_events
from memguard_core.observe import FIGURE_NAMES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIG_BUDGET = 64 << 30


def _log_file(folder):
    files = [f for f in os.listdir(folder) if f.endswith(".jsonl")]
    assert len(files) == 1, files
    return os.path.join(folder, files[0])


def test_hf_run_leaves_event_log_log_history_and_warnings(tmp_path, caplog):
    from memguard_testing.hf_tiny import SwitchSplit, make_trainer

    from memguard_hf import MemGuardCallback

    guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0,
                             log_dir=str(tmp_path / "log"))
    trainer = make_trainer(str(tmp_path / "run"), guard=guard, max_steps=4)

    class AskSplit(SwitchSplit):  # a real request through the monitor, as pressure would make it
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 2:
                self.guard.monitor.request_micro_batches(2, "asked by the test", state.global_step)

    trainer.add_callback(AskSplit(guard))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    recs = read_events(_log_file(tmp_path / "log"))
    steps = [r for r in recs if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # the budget in each record is the effective one (the option, capped by what the machine offers)
    assert all(r["peak_bytes"] > 0 and 0 < r["budget_bytes"] <= BIG_BUDGET and r["current_bytes"] > 0 for r in steps)
    assert [r["micro_batches"] for r in steps] == [1, 1, 2, 2]
    splits = [r for r in recs if r["type"] == "decision" and r["kind"] == "split"]
    assert len(splits) == 1 and splits[0]["step"] == 2 and "asked by the test" in splits[0]["message"]
    assert recs[0]["type"] == "start" and recs[-1]["type"] == "end" and recs[-1]["optimizer_steps"] == 4
    # the decision's one WARNING line
    assert sum("asked by the test" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1
    # the figures in the log lines and in log_history, so trainer_state.json keeps them
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 4
    for h in logged[1:]:
        assert {"memguard_peak_gib", "memguard_current_gib", "memguard_budget_gib", "memguard_usage",
                "memguard_micro_batches", "memguard_max_usage"} <= set(h)
        assert set(h) & set(FIGURE_NAMES)
    assert logged[-1]["memguard_micro_batches"] == 2
    trainer.state.save_to_json(str(tmp_path / "trainer_state.json"))
    saved = json.load(open(tmp_path / "trainer_state.json"))["log_history"]
    assert saved[-2]["memguard_micro_batches"] == 2 and saved[-2]["memguard_peak_gib"] > 0
    assert guard.summary["event_log"] == _log_file(tmp_path / "log")


def test_hf_preflight_change_is_one_warning_and_a_decision(tmp_path, caplog):
    from memguard_testing.hf_tiny import make_trainer

    from memguard_hf import MemGuardCallback

    guard = MemGuardCallback(budget_bytes=BIG_BUDGET, monitor_interval_s=0,
                             log_dir=str(tmp_path / "log"))
    trainer = make_trainer(str(tmp_path / "run"), guard=guard, max_steps=2)
    # a budget between what the requested micro-batch and half of it need (the planner's own
    # figures: estimate + what the process already holds, against 85 % of the budget), so the real
    # preflight must halve the micro-batch
    def squeeze(read_specs, *a, **k):
        from memguard_core.estimator.estimate import estimate

        ms, ts = read_specs()
        # one reading for both plans: the process's own runtime figure moves by a few MiB between two
        # readings, which is the whole gap between the two micro-batches' estimates of this tiny model
        read_specs = lambda: (ms, ts)  # noqa: E731
        first = orig(read_specs, *a, **k)
        extra, c = first.resident_extra_bytes, first.correction
        need = estimate(ms, ts, correction=c).peak_bytes + extra
        half = estimate(ms, ts.replace(batch_size=ts.batch_size // 2, grad_accum=ts.grad_accum * 2),
                        correction=c).peak_bytes + extra
        assert half < need
        object.__setattr__(guard.guard.options, "budget_bytes", int((need + half) / 2 / 0.85))
        return orig(read_specs, *a, **k)

    orig = guard.guard.plan
    guard.guard.plan = squeeze
    with caplog.at_level(logging.WARNING):
        trainer.train()
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "preflight changed" in r.getMessage()]
    assert len(warns) == 1
    recs = read_events(_log_file(tmp_path / "log"))
    pre = [r for r in recs if r["type"] == "decision" and r["kind"] == "preflight"]
    assert len(pre) == 1 and pre[0]["step"] == 0 and pre[0]["message"] == warns[0].split("memguard: ", 1)[1]


def test_lightning_csv_logger_carries_the_figures(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger
    from memguard_testing.lightning_tiny import fit

    from memguard_lightning import MemGuardCallback

    guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0,
                             log_dir=str(tmp_path / "log"))
    fit(guard=guard, logger=CSVLogger(str(tmp_path), name="run"), log_every_n_steps=1)
    path = next(p for p in tmp_path.rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(open(path)) if r.get("memguard/peak_gib")]
    assert rows and all(float(r["memguard/peak_gib"]) > 0 and 0 < float(r["memguard/budget_gib"]) <= 64
                        for r in rows)
    recs = read_events(_log_file(tmp_path / "log"))
    assert sum(r["type"] == "step" for r in recs) >= 2


def _mlx_reports(tmp_path, iters: int, every: int) -> list:
    """A guarded mlx_lm run of the tiny Llama (``iters`` iterations, a loss report every
    ``every``); the report dicts mlx_lm's callback received."""
    pytest.importorskip("mlx.core")
    import numpy as np
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs
    from memguard_testing.mlx_tiny import TokenRows, build_model, schedule_optimizer

    import memguard_mlx

    class Rec(TrainingCallback):
        def __init__(self):
            self.train = []

        def on_train_loss_report(self, info):
            self.train.append(dict(info))

    np.random.seed(0)
    rec = Rec()
    args = TrainingArgs(batch_size=8, iters=iters, steps_per_report=every, steps_per_eval=100, val_batches=1,
                        steps_per_save=100, max_seq_length=64, adapter_file=str(tmp_path / "a.safetensors"))
    memguard_mlx.train(build_model("llama"), schedule_optimizer(), TokenRows(), None, args=args, training_callback=rec,
                       budget_bytes=BIG_BUDGET, preflight=False, monitor_interval_s=0, log_dir=str(tmp_path / "log"))
    return rec.train


def test_mlx_report_dicts_carry_the_figures(tmp_path):
    train = _mlx_reports(tmp_path, iters=6, every=2)
    assert [d["iteration"] for d in train] == [2, 4, 6]
    for d in train:
        assert {"train_loss", "learning_rate", "peak_memory"} <= set(d)       # mlx_lm's own keys
        assert d["memguard_micro_batches"] == 1 and 0 < d["memguard_budget_gib"] <= 64 and d["memguard_peak_gib"] > 0
    recs = read_events(_log_file(tmp_path / "log"))
    assert [r["step"] for r in recs if r["type"] == "step"][:3] == [1, 2, 3]


def test_report_draws_a_real_run(tmp_path):
    from memguard_testing.hf_tiny import make_trainer

    from memguard_hf import MemGuardCallback

    guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0,
                             log_dir=str(tmp_path / "log"))
    make_trainer(str(tmp_path / "run"), guard=guard, max_steps=3).train()
    log = _log_file(tmp_path / "log")
    p = subprocess.run([sys.executable, "-m", "memguard_core.cli", "report", log], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr
    assert "3 optimizer step records" in p.stdout
    png = log[: -len(".jsonl")] + ".png"
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


SPIKE = 96 << 20   # bytes a test allocates inside one optimizer step: far above the steps' jitter


def _spike_torch():
    import torch

    t = torch.ones(SPIKE // 4)   # touched: the RSS high-water mark rises
    del t


def test_lightning_log_row_of_a_step_carries_that_steps_figures(tmp_path):
    """A step with a memory spike (inside the step: before its optimizer step): the metrics row of
    that step shows it, not the row after; the first step's row has figures too. Each row equals
    the event log's record of its step."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from memguard_testing.lightning_tiny import fit

    from memguard_lightning import MemGuardCallback

    class Spike(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:   # the third optimizer step
                _spike_torch()

    guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0,
                             log_dir=str(tmp_path / "log"))
    fit(guard=guard, logger=CSVLogger(str(tmp_path), name="run"), log_every_n_steps=1, max_steps=5,
        extra_callbacks=[Spike()])
    path = next(p for p in tmp_path.rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(open(path)) if r.get("memguard/micro_batches")]
    recs = {r["step"]: r for r in read_events(_log_file(tmp_path / "log")) if r["type"] == "step"}
    # Lightning's row "step" is the optimizer steps done before the batch: optimizer step s + 1
    by_step = {int(r["step"]) + 1: r for r in rows}
    assert sorted(by_step) == [1, 2, 3, 4, 5] and by_step[1]["memguard/peak_gib"] != ""
    for s, row in by_step.items():
        assert float(row["memguard/peak_gib"]) == pytest.approx(round(recs[s]["peak_bytes"] / 2**30, 3))
    peaks = {s: float(r["memguard/peak_gib"]) for s, r in by_step.items()}
    assert peaks[3] - max(peaks[1], peaks[2]) > 0.06, peaks


def test_mlx_report_of_an_iteration_carries_that_iterations_figures(tmp_path):
    """Reports at every iteration: the first one has the figures, and each equals the event log's
    record of its own iteration (before, report N held iteration N-1's and the first had none)."""
    train = _mlx_reports(tmp_path, iters=5, every=1)
    recs = {r["step"]: r for r in read_events(_log_file(tmp_path / "log")) if r["type"] == "step"}
    reports = {d["iteration"]: d for d in train}
    assert sorted(reports) == [1, 2, 3, 4, 5] and "memguard_peak_gib" in reports[1]
    for it, d in reports.items():
        assert d["memguard_peak_gib"] == pytest.approx(round(recs[it]["peak_bytes"] / 2**30, 3))
        assert d["memguard_current_gib"] == pytest.approx(round(recs[it]["current_bytes"] / 2**30, 3))


def test_hf_log_line_of_a_step_carries_that_steps_figures(tmp_path):
    """A spike inside the third optimizer step (before its optimizer step): log_history's line of
    step 3 shows it; step 1's line has every figure; each line equals its step's record."""
    from transformers import TrainerCallback
    from memguard_testing.hf_tiny import make_trainer

    from memguard_hf import MemGuardCallback

    class Spike(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if state.global_step == 2:
                _spike_torch()

    guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0,
                             log_dir=str(tmp_path / "log"))
    trainer = make_trainer(str(tmp_path / "run"), guard=guard, max_steps=5)
    trainer.add_callback(Spike())
    trainer.train()
    recs = {r["step"]: r for r in read_events(_log_file(tmp_path / "log")) if r["type"] == "step"}
    lines = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert sorted(lines) == [1, 2, 3, 4, 5]
    assert {"memguard_peak_gib", "memguard_current_gib", "memguard_budget_gib", "memguard_usage"} <= set(lines[1])
    for s, h in lines.items():
        assert h["memguard_peak_gib"] == pytest.approx(round(recs[s]["peak_bytes"] / 2**30, 3))
    assert lines[3]["memguard_peak_gib"] - max(lines[2]["memguard_peak_gib"], lines[4]["memguard_peak_gib"]) > 0.06


def test_nothing_fits_is_a_preflight_record_naming_the_users_budget(tmp_path, caplog):
    """A budget nothing fits (0.30 GiB on a process already above it): the preflight's decision
    (micro-batches, checkpointing) is a ``preflight`` record, its line names the budget given, and
    every memguard line at WARNING or above (the monitor's emergency too) starts with 'memguard:'."""
    from memguard_testing.hf_tiny import make_trainer

    from memguard_hf import MemGuardCallback

    guard = MemGuardCallback(budget_gib=0.3, monitor_interval_s=0, log_dir=str(tmp_path / "log"))
    trainer = make_trainer(str(tmp_path / "run"), guard=guard, max_steps=2)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    pre = [r for r in read_events(_log_file(tmp_path / "log")) if r["type"] == "decision" and r["kind"] == "preflight"]
    assert len(pre) == 1 and pre[0]["step"] == 0 and pre[0]["micro_batches"] == guard.summary["micro_batches"] > 1
    assert "nothing fits the budget of 0.30 GiB" in pre[0]["message"] and "planning target (85% of the budget" in pre[0]["message"]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("memguard") and r.levelno >= logging.WARNING]
    assert any("memory emergency" in m for m in ours)
    assert ours and all(m.startswith("memguard: ") for m in ours), ours
