"""Virtual micro-batches in a real Lightning ``Trainer`` on CPU: switching the split factor k
mid-epoch and mid accumulation window must shrink the forward batches as asked while keeping
``global_step``, the OneCycle LR sequence, the samples per optimizer step, the loss Lightning returns
and logs, and the final parameters of the unsplit run; the preflight must pick a split under a tight
budget; an out-of-memory forward is retried; two gloo DDP ranks agree."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")  # the [lightning] extra

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import memguard_testing  # noqa: E402
from memguard_core.estimator.estimate import estimate  # noqa: E402
from memguard_lightning import MemGuardCallback  # noqa: E402
from memguard_testing.lightning_tiny import TinyLM, fit, max_param_diff  # noqa: E402

BIG_BUDGET = 64 * 2**30  # the switches here are requested by the test, not by memory pressure

# batch (counted over the fit) -> k: k=2 at a window start (batch 2), k=4 mid-window (batch 5),
# k=1 mid-window (batch 9), k=3 (uneven 3/2/3 chunks) at a window start (batch 10). 96 rows / 8 =
# 12 batches per epoch, accumulation 2, 8 optimizer steps: the fit also crosses an epoch boundary.
SWITCH = {2: 2, 5: 4, 9: 1, 10: 3}
EXPECTED_BATCHES = ([[8]] * 2 + [[4, 4]] * 3 + [[2, 2, 2, 2]] * 4 + [[8]] + [[3, 2, 3]] * 6)


def _guard(**kw):
    return MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0, **kw)


def _assert_same_run(base, split, atol=2e-5):
    (tb, mb, rb), (ts, ms, rs) = base, split
    assert ts.global_step == tb.global_step
    assert rs.lrs == pytest.approx(rb.lrs, rel=1e-12)
    assert len(set(rb.lrs)) > 4  # OneCycle: the sequence is informative
    assert rs.rows_per_step(2) == rb.rows_per_step(2) == [16] * tb.global_step
    assert rs.returned_losses == pytest.approx(rb.returned_losses, rel=1e-5)
    assert rs.logged_losses == pytest.approx(rb.logged_losses, rel=1e-5)
    worst = max_param_diff(mb, ms)
    assert worst < atol, f"parameters differ by {worst}"


@pytest.fixture(scope="module")
def base_runs():
    """Unsplit runs (no guard), one per loss."""
    return {loss: fit(loss=loss) for loss in ("tokens", "samples")}


@pytest.mark.parametrize("loss,weighting", [("tokens", "auto"), ("samples", "rows")],
                         ids=["token-mean-loss", "per-sample-mean-loss"])
def test_switching_k_mid_epoch_and_mid_window_keeps_the_run(base_runs, loss, weighting):
    guard = _guard(loss_weighting=weighting)
    split = fit(guard=guard, switch=SWITCH, loss=loss)
    _, _, rec = split
    assert rec.batches == EXPECTED_BATCHES  # forward batch dims shrink (and grow back) as asked
    assert guard.samples_per_step == [16] * 8
    assert guard.split_disabled_reason is None
    _assert_same_run(base_runs[loss], split)
    init = TinyLM(loss=loss)  # the same seeded weights, untrained
    assert max_param_diff(init, split[1]) > 1e-3  # the runs really trained


def test_wrong_weights_would_be_caught(base_runs):
    """Guards the test above: with a per-sample-mean loss, token-share weights (wrong for it) give
    different parameters, so the equality really depends on the chunk weights."""
    guard = _guard(loss_weighting="tokens")
    split = fit(guard=guard, switch=SWITCH, loss="samples")
    assert max_param_diff(base_runs["samples"][1], split[1]) > 1e-3


def test_lightning_zero_grad_would_wipe_the_chunk_gradients(base_runs):
    """Lightning zeroes the gradients after ``training_step`` on the first batch of each
    accumulation window. Without memguard's early zero_grad (and the skip of Lightning's), the
    non-final chunks' gradients of a window-start batch are wiped: the run differs, and the guard
    notices it and stops splitting instead of training on silently."""
    guard = _guard()
    guard.step.zero_grad_coming = lambda batch_idx: False  # what a naive in-step split does
    split = fit(guard=guard, switch={2: 2})  # batch 2 starts a window
    assert split[2].batches[2] == [4, 4] and split[2].batches[3] == [8]  # split once, then stopped
    assert "zeroed the gradients" in (guard.split_disabled_reason or "")
    assert max_param_diff(base_runs["tokens"][1], split[1]) > 1e-3


def test_preflight_under_a_tight_budget_splits_in_place(base_runs, monkeypatch):
    """The budget lies between the estimates of micro-batch 4 and 8 with checkpointing: the plan turns
    checkpointing on and halves the micro-batch (accumulation doubled), both applied in place before
    the first forward; the run keeps the unsplit run's steps, LR, samples per step and parameters."""
    from memguard_testing.hf_tiny import tiny_llama
    from memguard_core.estimator.specs import TrainSpec
    from memguard_torch.module_spec import model_spec_from_module
    from memguard_core.probes import glibc_version

    ms = model_spec_from_module(tiny_llama(0))
    # glibc: the guard estimates a CPU run with its own process's C library release
    ts = TrainSpec(batch_size=8, seq_length=24, grad_accum=2, method="full", optimizer="adamw", dtype="fp32",
                   framework="lightning", device="cpu", glibc=glibc_version())
    budget = estimate(ms, ts.replace(batch_size=4, grad_accum=4, grad_checkpoint=True)).peak_bytes + 1024
    assert estimate(ms, ts.replace(grad_checkpoint=True)).peak_bytes > budget
    guard = MemGuardCallback(budget_bytes=budget, monitor_interval_s=0)
    # The preflight counts what the process already holds beyond runtime + weights, and plans below
    # the warning level. This pytest process holds every earlier test's imports and models, far more
    # than this tiny budget, so the decision is checked here without the resident term and against
    # the full budget (the resident term is exercised in a fresh process by test_hf_preflight.py).
    # Likewise its mapped libraries' resident pages (RssFile: every test's imports, ~300 MiB) are
    # measured by the adapter, then set back to the typical figure the budget above was built with.
    import memguard_core.guard_preflight as core_guard
    real_plan = core_guard.plan_in_place
    measured_file_pages = []

    def plan_without_this_process(ms_, ts_, b, **kw):
        measured_file_pages.append(ts_.resident_file_bytes)
        return real_plan(ms_, ts_.replace(resident_file_bytes=None, runtime_held_bytes=None), b,
                         **{**kw, "resident_bytes": None, "plan_fraction": 1.0})

    monkeypatch.setattr(core_guard, "plan_in_place", plan_without_this_process)

    class WideMonitorBudget(pl.Callback):
        """The estimate describes the tiny model's training (~0.36 GiB); this pytest process holds
        far more (every test's imports), so the runtime monitor would split further at once. Its
        budget is widened after the preflight so this test sees the preflight's decision alone."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            guard.monitor.budget_bytes = BIG_BUDGET

    split = fit(guard=guard, extra_callbacks=[WideMonitorBudget()])
    pf = guard.preflight
    assert pf is not None
    assert pf.train_spec == ts  # read from the trainer, module, dataset and first batch
    assert len(measured_file_pages) == 1 and measured_file_pages[0] > 0  # RssFile read at train start
    assert pf.micro_batches == 2
    assert pf.plan.train_spec.batch_size == 4 and pf.plan.train_spec.grad_accum == 4
    assert {c.field for c in pf.applied} == {"grad_checkpoint", "batch_size", "grad_accum"}
    assert not pf.not_applied
    assert pf.best_peak_bytes <= budget
    assert split[1].model.is_activation_checkpointing
    assert split[2].batches == [[4, 4]] * 16  # in place from the very first forward
    assert guard.samples_per_step == [16] * 8
    _assert_same_run(base_runs["tokens"], split)


def test_amp_grad_scaler_is_applied_to_every_chunk():
    """fp16 autocast with a ``GradScaler`` (scale 1024): the non-final chunks go through
    ``strategy.backward``, so their loss is scaled like Lightning's own backward and unscaled once
    at the step; a plain ``loss.backward()`` would leave their gradients 1024x too small. (Lightning
    refuses ``precision="16-mixed"`` on CPU, so the ``MixedPrecision`` plugin is built explicitly; fp16
    rounding differs between chunk sizes, hence the looser tolerance, still 100x below the update.)"""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))

    tb, mb, rb = fit(plugins=[plugin()])
    guard = _guard()
    ts, ms, rs = fit(guard=guard, switch=SWITCH, plugins=[plugin()])
    assert ts.precision_plugin.scaler.get_scale() == 1024.0  # no overflow skipped a step
    assert rs.batches == EXPECTED_BATCHES
    assert ts.global_step == tb.global_step and rs.lrs == pytest.approx(rb.lrs, rel=1e-12)
    assert rs.returned_losses == pytest.approx(rb.returned_losses, rel=1e-4)
    assert max_param_diff(mb, ms) < 2e-4
    assert max_param_diff(TinyLM(), mb) > 1e-2


def test_oom_in_forward_is_retried_with_a_finer_split(base_runs):
    """A forward that runs out of memory is redone on smaller chunks and the run equals the unsplit
    one. The out-of-memory error is injected in a forward pre-hook of the model, because no device
    here can be made to run out at a chosen batch size without killing the test process: any forward
    of more than 4 rows raises the CPU allocator's error, with the message torch gives when malloc
    fails (which Lightning's ``is_oom_error`` recognises)."""
    def too_big(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] > 4:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 1073741824 bytes.")

    guard = _guard()
    split = fit(guard=guard, module_hook=lambda m: m.model.register_forward_pre_hook(too_big, with_kwargs=True))
    rec = split[2]
    assert guard.oom_retries == 1
    assert guard.monitor.micro_batches == 2
    assert guard.micro_batch_rows[:3] == [8, 4, 4]  # the failed forward, then its two halves
    assert rec.batches == [[4, 4]] * 16  # forwards that completed (the hook raised before the recorder's)
    assert guard.samples_per_step == [16] * 8
    tb, mb, rb = base_runs["tokens"]
    assert split[0].global_step == tb.global_step
    assert rec.lrs == pytest.approx(rb.lrs, rel=1e-12)
    assert rec.returned_losses == pytest.approx(rb.returned_losses, rel=1e-5)
    assert max_param_diff(mb, split[1]) < 2e-5


def test_manual_optimization_warns_and_offers_chunks(caplog):
    """Manual optimization cannot be split behind the user's back: a warning names the alternative,
    ``guard.chunks(batch)``, which gives the unsplit run's parameters."""
    base_guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="memguard.lightning"):
        base = fit(guard=base_guard, manual=True, max_steps=4, accumulate=1)
    assert "manual optimization" in (base_guard.split_disabled_reason or "")
    assert any("guard.chunks" in r.getMessage() for r in caplog.records)
    guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0, micro_batches=4)
    split = fit(guard=guard, manual=True, max_steps=4, accumulate=1)
    assert split[2].batches[0] == [2, 2, 2, 2] and base[2].batches[0] == [8]
    assert split[0].global_step == base[0].global_step == 4
    assert max_param_diff(base[1], split[1]) < 2e-5


def test_lightning_ddp_gloo_two_ranks_agree(tmp_path):
    """2-process DDP (gloo): rank 0 alone asks for k=2 (mid window) then k=4; rank 1 follows through
    the all-reduce; no hang; parameters, steps, LR and losses equal the unsplit DDP run on each rank."""
    script = memguard_testing.script("lightning_ddp_worker.py")
    env = memguard_testing.script_env(OMP_NUM_THREADS="1")
    port = 29500 + (os.getpid() % 1000) + 7
    proc = subprocess.run([sys.executable, "-m", "memguard_testing.torchrun", "--nproc_per_node=2",
                           "--master_port", str(port), script, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {(m, r): torch.load(tmp_path / f"{m}_rank{r}.pt") for m in ("base", "split") for r in (0, 1)}
    expected = [[4], [2, 2], [2, 2], [2, 2]] + [[1, 1, 1, 1]] * 4
    for r in (0, 1):
        b, s = out[("base", r)], out[("split", r)]
        assert b["batches"] == [[4]] * 8
        assert s["batches"] == expected  # both ranks cut alike although only rank 0 asked
        assert s["global_step"] == b["global_step"] == 4
        assert s["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert s["rows_per_step"] == b["rows_per_step"] == [8] * 4
        assert s["returned_losses"] == pytest.approx(b["returned_losses"], rel=1e-5)
        worst = max((s["params"][n] - b["params"][n]).abs().max().item() for n in b["params"])
        assert worst < 2e-5
        # the base run's preflight read DDP and its bucket size from the strategy (a per-rank estimate)
        assert b["layout"] == {"world_size": 2, "sharding": "ddp", "bucket_cap_mb": 10, "applied": [], "micro_batches": 1}
    # DDP kept the ranks' replicas identical
    p0, p1 = out[("split", 0)]["params"], out[("split", 1)]["params"]
    assert max((p0[n] - p1[n]).abs().max().item() for n in p0) == 0.0


def test_memory_figures_reach_the_logger_on_lightnings_logging_steps(tmp_path):
    # log_dict costs ~1 ms of Lightning bookkeeping per call: the guard logs only on the batches
    # whose metrics Lightning writes (log_every_n_steps)
    import csv
    from lightning.pytorch.loggers import CSVLogger

    guard = _guard()

    class AskSplit(pl.Callback):   # an event at batch 6 = optimizer step 3, not a logging step
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 6:
                guard.monitor.request_micro_batches(2, "asked by the test", trainer.global_step)

    fit(guard=guard, logger=CSVLogger(str(tmp_path), name="run"), log_every_n_steps=3,
        extra_callbacks=[AskSplit()])
    path = next(p for p in tmp_path.rglob("metrics.csv"))
    rows = list(csv.DictReader(open(path)))
    split_at = {int(r["step"]): float(r["memguard/micro_batches"]) for r in rows if r.get("memguard/micro_batches")}
    # the standard figures of the step before each logged one
    logged = [r for r in rows if r.get("memguard/peak_gib")]
    assert logged and all(float(r["memguard/peak_gib"]) > 0 and 0 < float(r["memguard/usage"]) < 2
                          and float(r["memguard/budget_gib"]) > 0 for r in logged)
    assert any(e["action"] == "split" for e in guard.events)
    # Lightning writes at optimizer steps 2 and 5 (its step counter + 1 divisible by 3); the split
    # asked at step 3 shows at step 5
    assert split_at == {2: 1.0, 5: 2.0}


def test_no_logger_means_no_log_dict_calls(monkeypatch):
    calls = []
    real = pl.LightningModule.log_dict
    monkeypatch.setattr(pl.LightningModule, "log_dict", lambda self, *a, **k: (calls.append(a), real(self, *a, **k)))
    fit(guard=_guard())
    assert calls == []   # logger=False: nothing would show the figures
