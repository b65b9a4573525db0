"""The evaluation split in a real HF ``Trainer`` on CPU: ``evaluate()`` / ``predict()`` with each
evaluation batch cut into 2 or 4 micro-batches must return what the unsplit evaluation returns
(``eval_loss`` to float32 summation order, predictions and label ids), on a tiny Llama over rows of
different lengths with masked prompts (chunks hold different numbers of valid labels, so equal
chunk weights would be wrong), padded and packed. The evaluation OOM retry on a real allocation
failure (``RLIMIT_AS``) is in ``test_hf_eval_oom`` below, run in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from memguard_core.errors import ConfigError
from memguard_core.events import read_events
from memguard_hf import MemGuardCallback
from memguard_testing import script, with_root_on_pythonpath
from memguard_testing.hf_tiny import RowsDataset, make_trainer, packed_collate, pad_collate

BIG_BUDGET = 64 * 2**30


def _trainer(tmp_path, name, k=None, collate=pad_collate, eval_batch=8, mean_loss=False):
    trainer = make_trainer(str(tmp_path / name), collate=collate, mean_loss=mean_loss)
    trainer.args.per_device_eval_batch_size = eval_batch
    cb = None
    if k is not None:
        cb = MemGuardCallback.attach(trainer, preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0)
        cb.eval_micro_batches = k
    return trainer, cb


def _eval_set(n=20):
    # 20 rows, eval batch 8: the last batch holds 4 rows (a k=4 split gives one-row chunks there)
    return RowsDataset(n=n, seed=7)


@pytest.mark.parametrize("collate", [pad_collate, packed_collate], ids=["padded", "packed"])
@pytest.mark.parametrize("mean_loss", [False, True], ids=["token-count-loss", "mean-loss"])
@pytest.mark.parametrize("k", [2, 4])
def test_evaluate_split_equals_unsplit(tmp_path, k, collate, mean_loss):
    base, _ = _trainer(tmp_path, "base", collate=collate, mean_loss=mean_loss)
    split, cb = _trainer(tmp_path, "split", k=k, collate=collate, mean_loss=mean_loss)
    data = _eval_set()
    m0 = base.evaluate(eval_dataset=data)
    m1 = split.evaluate(eval_dataset=data)
    # float32 losses summed in another order: a few ulps of a loss near ln(96) ~ 4.6
    assert m1["eval_loss"] == pytest.approx(m0["eval_loss"], rel=1e-6, abs=0)
    # the split really ran: chunks smaller than the batches, as many units as the set has
    assert max(cb.eval_micro_batch_rows) < 8 and sum(cb.eval_micro_batch_rows) == len(data)
    assert len(cb.eval_micro_batch_rows) > 3
    assert cb.eval_oom_retries == 0 and cb.eval_micro_batches == k


@pytest.mark.parametrize("k", [2, 4])
def test_predict_split_equals_unsplit(tmp_path, k):
    base, _ = _trainer(tmp_path, "base")
    split, cb = _trainer(tmp_path, "split", k=k)
    data = _eval_set()
    p0 = base.predict(data)
    p1 = split.predict(data)
    assert p1.predictions.shape == p0.predictions.shape  # (20, longest row, vocab)
    # each row's logits from a smaller forward: the same up to float32 kernel blocking
    np.testing.assert_allclose(p1.predictions, p0.predictions, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(p1.label_ids, p0.label_ids)
    assert p1.metrics["test_loss"] == pytest.approx(p0.metrics["test_loss"], rel=1e-6, abs=0)
    assert max(cb.eval_micro_batch_rows) <= -(-8 // k)


def test_compute_metrics_sees_the_whole_batch(tmp_path):
    """``compute_metrics`` receives the concatenated predictions of every batch, as unsplit."""
    seen = {}

    def metrics(pred):
        seen.setdefault("shapes", []).append(pred.predictions.shape)
        mask = pred.label_ids[:, 1:] != -100
        hits = pred.predictions[:, :-1].argmax(-1) == pred.label_ids[:, 1:]
        return {"accuracy": float(hits[mask].mean())}

    base, _ = _trainer(tmp_path, "base")
    split, cb = _trainer(tmp_path, "split", k=4)
    base.compute_metrics = split.compute_metrics = metrics
    data = _eval_set()
    m0 = base.evaluate(eval_dataset=data)
    m1 = split.evaluate(eval_dataset=data)
    assert seen["shapes"][0] == seen["shapes"][1]
    assert m1["eval_accuracy"] == m0["eval_accuracy"]
    assert m1["eval_loss"] == pytest.approx(m0["eval_loss"], rel=1e-6, abs=0)


def test_eval_split_never_changes_the_training_split(tmp_path):
    """Training (k = 1) with an evaluation at every step at k = 4: the training micro-batches stay
    whole batches and the training run equals an unguarded one."""
    base, _ = _trainer(tmp_path, "base")
    split, cb = _trainer(tmp_path, "split", k=4)
    for t in (base, split):
        t.args.eval_strategy = "steps"
        t.args.eval_steps = 2
        t.eval_dataset = _eval_set()
        t.train()
    evals0 = [h["eval_loss"] for h in base.state.log_history if "eval_loss" in h]
    evals1 = [h["eval_loss"] for h in split.state.log_history if "eval_loss" in h]
    assert len(evals1) == len(evals0) == 3
    assert evals1 == pytest.approx(evals0, rel=1e-5)
    assert set(cb.micro_batch_rows) == {8} and cb.monitor.split == 1
    assert max(cb.eval_micro_batch_rows) == 2


def test_eval_micro_batches_is_checked():
    cb = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="eval_micro_batches"):
            cb.eval_micro_batches = bad


ALLOC_FAILED = "DefaultCPUAllocator: can't allocate memory"
#: The child's VmPeak (memguard_testing/scripts/rlimit_hf_eval_run.py prints it per phase) is
#: ~2.4 GB through its training steps and ~3.9 GB through an unsplit evaluation of its 16 x 256-token
#: batch (logits and their log-softmax, 0.8 GB each); in 2 chunks ~3.1 GB, in 4 ~2.75 GB. The
#: limit sits between: the first evaluation fails unsplit and in 2 chunks, fits in 4. The figures
#: carry the baseline address space of torch's libraries and threads, which differs between machines.
EVAL_LIMIT = 3_000_000_000


def _run_child(tmp_path, limit: int, mode: str) -> dict:
    out = tmp_path / f"{mode}-{limit}.json"
    env = with_root_on_pythonpath(dict(os.environ, OMP_NUM_THREADS="2"))
    proc = subprocess.run([sys.executable, script("rlimit_hf_eval_run.py"), str(limit), mode, str(out),
                           str(tmp_path / "events")], capture_output=True, text=True, env=env, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS")
def test_real_eval_oom_never_ends_training(tmp_path):
    """A real evaluation OOM under an address-space limit (``RLIMIT_AS``): unguarded, the first
    evaluation (after optimizer step 1) kills the run with torch's allocator error; guarded, the
    evaluation batch is redone in smaller chunks, both optimizer steps and both evaluations finish,
    each ``eval_loss`` equals the unlimited unsplit run's, the training micro-batches stay whole
    batches, and the run's event log shows the evaluation re-splits."""
    ref = _run_child(tmp_path, 0, "none")
    assert ref["steps"] == 2 and len(ref["eval_losses"]) == 2, ref.get("error")
    bare = _run_child(tmp_path, EVAL_LIMIT, "none")
    assert bare.get("failed") == "evaluation" and ALLOC_FAILED in bare["error"], bare.get("error")
    assert bare["steps"] == 1  # training was healthy up to the evaluation
    guarded = _run_child(tmp_path, EVAL_LIMIT, "oom")
    assert "failed" not in guarded, guarded.get("error")
    assert guarded["steps"] == 2
    # float32 losses of the chunks summed in another order
    assert guarded["eval_losses"] == pytest.approx(ref["eval_losses"], rel=1e-6, abs=0)
    assert guarded["eval_oom_retries"] >= 1 and guarded["eval_micro_batches"] >= 2
    # the training split never moved: every training forward ran the whole 2-row batch
    assert guarded["rows"] == [2, 2] and guarded["split"] == 1 and guarded["oom_retries"] == 0
    worst = max(max(abs(a - b) for a, b in zip(ref["params"][n], guarded["params"][n])) for n in ref["params"])
    assert worst < 1e-6, f"parameters differ from the unlimited run by {worst}"
    decisions = [r for r in read_events(guarded["event_log"]) if r.get("type") == "decision"]
    assert [d["kind"] for d in decisions].count("eval_split") == guarded["eval_oom_retries"]


OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 805306368 bytes"


class FailWide:
    """A forward pre-hook on the model's first block that raises the CPU allocator's error for a
    forward of more than ``rows`` rows (every forward when ``rows`` is 0): the retry's point of
    failure chosen exactly (the real one under ``RLIMIT_AS`` is ``test_real_eval_oom_never_ends_training``)."""

    def __init__(self, model, rows):
        self.rows, self.calls = rows, 0
        model.model.layers[0].register_forward_pre_hook(self.hook)

    def hook(self, module, args):
        self.calls += 1
        if args[0].shape[0] > self.rows:
            raise RuntimeError(OOM)


def test_eval_oom_doubles_only_the_eval_split(tmp_path):
    """Forwards of more than 2 rows fail: the 8-row batch is redone at k=2, then k=4, and later
    batches (and evaluations) start at 4; eval_loss equals the unsplit one; training untouched."""
    base, _ = _trainer(tmp_path, "base")
    split, cb = _trainer(tmp_path, "split", k=1)
    data = _eval_set()
    m0 = base.evaluate(eval_dataset=data)
    FailWide(split.model, rows=2)
    m1 = split.evaluate(eval_dataset=data)
    assert m1["eval_loss"] == pytest.approx(m0["eval_loss"], rel=1e-6, abs=0)
    assert cb.eval_oom_retries == 2 and cb.eval_micro_batches == 4
    # the first batch tried whole (8), in halves (4, failed) and in quarters; the rest in quarters
    assert cb.eval_micro_batch_rows[:2] == [8, 4] and set(cb.eval_micro_batch_rows[2:]) == {2, 1}
    assert cb.guard.oom_retries == 0 and cb.guard.micro_batch_rows == []
    m2 = split.evaluate(eval_dataset=data)  # starts at the k that worked: no new failure
    assert cb.eval_oom_retries == 2 and m2["eval_loss"] == pytest.approx(m0["eval_loss"], rel=1e-6, abs=0)


def test_eval_oom_at_one_row_raises_the_original_error(tmp_path):
    split, cb = _trainer(tmp_path, "split", k=1)
    FailWide(split.model, rows=0)
    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        split.evaluate(eval_dataset=_eval_set())
    assert any("no further split can help" in n for n in getattr(info.value, "__notes__", []))
    assert cb.eval_micro_batches == 8  # 1 -> 2 -> 4 -> 8 rows of the first 8-row batch


def test_seq2seq_predict_with_generate_split_equals_unsplit(tmp_path):
    """``Seq2SeqTrainer`` with ``predict_with_generate``: each chunk generates for its own rows (a
    tiny random T5); the generated tokens and the loss equal the unsplit prediction's."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

    def run(name, k):
        torch.manual_seed(0)
        cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / name), per_device_eval_batch_size=8,
                                        predict_with_generate=True, generation_max_length=10, report_to=[],
                                        use_cpu=True, disable_tqdm=True)
        trainer = Seq2SeqTrainer(model=T5ForConditionalGeneration(cfg), args=args, data_collator=pad_collate)
        cb = None
        if k:
            cb = MemGuardCallback.attach(trainer, preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0)
            cb.eval_micro_batches = k
        return trainer.predict(_eval_set()), cb

    p0, _ = run("base", None)
    p1, cb = run("split", 4)
    assert max(cb.eval_micro_batch_rows) == 2
    np.testing.assert_array_equal(p1.predictions, p0.predictions)
    np.testing.assert_array_equal(p1.label_ids, p0.label_ids)
    assert p1.metrics["test_loss"] == pytest.approx(p0.metrics["test_loss"], rel=1e-6, abs=0)


def test_split_evaluation_false_leaves_the_step_alone(tmp_path):
    split, cb = _trainer(tmp_path, "split", k=4)
    cb.split_evaluation = False
    FailWide(split.model, rows=4)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        split.evaluate(eval_dataset=_eval_set())
    assert cb.eval_micro_batch_rows == [] and cb.eval_oom_retries == 0
