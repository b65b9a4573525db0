"""Validation, test and prediction batches cut into micro-batches in a real Lightning ``Trainer`` on
CPU: the logged validation / test loss equals the unsplit one (rows hold different numbers of
valid labels, so only token-share weights give it), predictions are the unsplit ones concatenated,
and a real out-of-memory error in validation (``RLIMIT_AS`` in a child process) is survived:
training goes on with its own split and the validation metric is the unlimited run's."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import memguard_testing  # noqa: E402
from memguard_lightning import MemGuardCallback  # noqa: E402
from memguard_testing.forkserver import run_script  # noqa: E402
from memguard_testing.lightning_tiny import TinyLM, fit, make_trainer, make_val_loader, max_param_diff  # noqa: E402

BIG_BUDGET = 64 * 2**30


def _guard(**kw):
    return MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0, **kw)


@pytest.fixture(scope="module")
def base_run():
    return fit(val_loader=make_val_loader(), val_check_interval=4)


def test_validation_split_logs_the_unsplit_loss(base_run):
    """k_eval = 5 on 12-row validation batches (uneven chunks of 2 and 3 rows): every validation's
    logged ``val_loss`` (Lightning's epoch mean of the batch values) equals the unsplit run's;
    the batch sizes Lightning weighs them by are the full batches' (``val_rows`` summed); the
    training run itself is unchanged."""
    tb, mb, rb = base_run
    guard = _guard(eval_micro_batches=5)
    ts, ms, rs = fit(guard=guard, val_loader=make_val_loader(), val_check_interval=4)
    assert len(rb.val_metrics) == 4
    assert [m["val_loss"] for m in rs.val_metrics] == pytest.approx([m["val_loss"] for m in rb.val_metrics],
                                                                  rel=1e-5)
    assert [m["val_rows"] for m in rs.val_metrics] == [m["val_rows"] for m in rb.val_metrics] == [36.0] * 4
    rows = guard.evals.rows                               # 3 batches x 4 validations, each in 5 chunks
    assert len(rows) == 60 and set(rows) == {2, 3} and sum(rows) == 36 * 4
    assert rs.batches == rb.batches == [[8]] * 16         # training k untouched
    assert max_param_diff(mb, ms) < 2e-5


def test_row_weights_would_be_caught(base_run):
    """Guards the test above: rows-share weights (wrong for a token-mean loss) give another
    validation loss, so the equality depends on the chunk weights."""
    tb, mb, rb = base_run
    guard = _guard(eval_micro_batches=5, loss_weighting="rows")
    ts, ms, rs = fit(guard=guard, val_loader=make_val_loader(), val_check_interval=4, max_steps=2)
    assert abs(rs.val_metrics[0]["val_loss"] - rb.val_metrics[0]["val_loss"]) > 1e-4


def _eval_trainer(guard=None):
    return make_trainer(callbacks=[guard] if guard is not None else [], max_steps=1)


def test_test_and_predict_are_split_and_combined():
    """``trainer.test``: the logged ``test_loss`` equals the unsplit one and the returned dict's
    loss is combined with token weights; ``trainer.predict``: the logits of every row are the
    unsplit ones, concatenated in row order."""
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    module = TinyLM()
    base_test = _eval_trainer().test(module, make_val_loader(), verbose=False)
    base_pred = _eval_trainer().predict(module, make_val_loader())
    guard = _guard(eval_micro_batches=4)
    split_test = _eval_trainer(guard).test(module, make_val_loader(), verbose=False)
    assert split_test[0]["test_loss"] == pytest.approx(base_test[0]["test_loss"], rel=1e-5)
    assert guard.evals.rows == [3] * 12
    guard2 = _guard(eval_micro_batches=4)
    split_pred = _eval_trainer(guard2).predict(module, make_val_loader())
    assert guard2.evals.rows == [3] * 12
    assert len(split_pred) == len(base_pred) == 3
    for b, s in zip(base_pred, split_pred):
        assert s["logits"].shape == b["logits"].shape
        assert torch.allclose(s["logits"], b["logits"], atol=1e-5)
        assert float(s["loss"]) == pytest.approx(float(b["loss"]), rel=1e-5)
    # the wrappers are gone after each run
    assert "test_step" not in module.__dict__ and "predict_step" not in module.__dict__


def test_eval_oom_doubles_k_eval_only(base_run):
    """An out-of-memory error in a validation forward of more than 3 rows (raised from a forward
    pre-hook with the allocator's message, at a chosen size; the real one is below): the batch is
    redone with k_eval 2 then 4, the validation loss is the unsplit one, the training split stays
    1 and the training equals the unsplit run."""
    tb, mb, rb = base_run

    def hook(m):
        def too_big(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not torch.is_grad_enabled() and ids is not None and ids.shape[0] > 3:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                   "memory: you tried to allocate 1073741824 bytes.")
        m.model.register_forward_pre_hook(too_big, with_kwargs=True)

    guard = _guard()
    ts, ms, rs = fit(guard=guard, val_loader=make_val_loader(), val_check_interval=4, module_hook=hook)
    assert guard.evals.oom_retries == 2 and guard.evals.micro_batches == 4
    assert guard.evals.rows[:6] == [12, 6, 3, 3, 3, 3]    # 12 fails, its first 6-row half fails, then 3s
    assert guard.monitor.micro_batches == 1 and guard.oom_retries == 0
    assert rs.batches == [[8]] * 16
    assert [m["val_loss"] for m in rs.val_metrics] == pytest.approx([m["val_loss"] for m in rb.val_metrics],
                                                                  rel=1e-5)
    assert max_param_diff(mb, ms) < 2e-5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS")
def test_real_validation_oom_is_survived(tmp_path):
    """The rlimit script's fine-tune (SmolLM2-135M shape, 2 blocks, vocabulary 32768, batch 8 x 256,
    2 optimizer steps) with a validation after step 2 on one 32-row batch, under an address-space
    limit placed 384 MiB above the unlimited run's training peak before that validation (step 2:
    AdamW's states held): training fits, the unsplit validation forward does not (the reference's
    validation peak is over the limit by more than 256 MiB). Guarded (nothing injected), the
    validation meets the allocator's failure and its batch is redone in more micro-batches with
    training's split left at 1, the logged validation loss is the unlimited run's, and so are the
    parameters. (One validation batch, the last thing the fit runs: the failure comes in the first;
    the combination of several batches' losses, and training going on after a split validation
    with its own split, are the tiny-model tests' above. No unguarded twin: the guarded run's own
    failure shows the limit bites; a Lightning twin dying at such a limit is
    test_lightning_window_redo.py's.)"""
    script = memguard_testing.script("rlimit_lightning_run.py")
    shape = ["--steps", "2", "--vocab", "32768", "--layers", "2", "--batch", "8", "--val-batch", "32",
             "--val-batches", "1", "--val-every", "2"]

    def run(limit, mode):
        out = tmp_path / f"{mode}-{limit}.json"
        proc = run_script(script, str(limit), mode, str(out), *shape,
                          env=memguard_testing.script_env(OMP_NUM_THREADS="2"), timeout=600)
        assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(out.read_text())

    reference = run(0, "none")
    assert reference["steps"] == 2 and len(reference["val_losses"]) == 1, reference.get("error")
    names = [name for name, _ in reference["peaks"]]
    first_val = names.index("validation")            # VmPeak is a running maximum: read it before
    train_peak = reference["peaks"][first_val - 1][1]
    val_peak = reference["peaks"][first_val][1]
    limit = train_peak + 384 * 2**20
    assert val_peak > limit + 256 * 2**20, reference["peaks"]   # the unsplit validation cannot fit
    guarded = run(limit, "oom")
    assert "failed" not in guarded, guarded.get("error")
    assert guarded["steps"] == 2
    assert guarded["eval_oom_retries"] >= 1 and guarded["eval_k"] >= 2
    assert guarded["micro_batches"] == 1 and guarded["oom_retries"] == 0 and set(guarded["rows"]) == {8}
    assert guarded["val_losses"] == pytest.approx(reference["val_losses"], rel=1e-5)
    ref, got = reference["params"], guarded["params"]
    assert max(max(abs(a - b) for a, b in zip(ref[n], got[n])) for n in ref) < 1e-6
