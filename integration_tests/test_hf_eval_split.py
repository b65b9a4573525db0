"""The evaluation split in a real HF ``Trainer`` on CPU: ``evaluate()`` / ``predict()`` with each
evaluation batch cut into 2 or 4 micro-batches must return what the unsplit evaluation returns
(``eval_loss`` to float32 summation order, predictions and label ids), on a tiny Llama over rows of
different lengths with masked prompts (chunks hold different numbers of valid labels, so equal
chunk weights would be wrong), padded and packed. The evaluation OOM retry on a real allocation
failure (``RLIMIT_AS``) is in ``test_real_eval_oom_never_ends_training`` below, run in a child process, and
under 2-rank DDP with the limit on one rank in ``test_ddp_one_rank_eval_oom``."""

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
from memguard_testing import script, script_env, with_root_on_pythonpath
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
    assert set(cb.micro_batch_rows) == {8} and cb.monitor.micro_batches == 1
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


#: How much more address space the unguarded twin may start with than the guarded run before it in
#: the same process (what the guarded run mapped and kept: memguard's modules, lazily loaded
#: libraries, the heap's top): half the ~0.9 GB by which an unsplit evaluation's peak exceeds
#: ``EVAL_LIMIT``, and below the ~0.6 GB between the training peak and the limit, so the twin's
#: failure is its own and in its own phase.
LEFTOVER_MAX = 450_000_000


def _run_child(tmp_path, limit: int, modes: str) -> dict:
    """``rlimit_hf_eval_run.py`` with ``modes`` run in that order in one child; results by mode."""
    out = tmp_path / "runs.json"
    env = with_root_on_pythonpath(dict(os.environ, OMP_NUM_THREADS="2"))
    proc = subprocess.run([sys.executable, script("rlimit_hf_eval_run.py"), str(limit), modes, str(out),
                           str(tmp_path / "events")], capture_output=True, text=True, env=env, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS")
def test_real_eval_oom_never_ends_training(tmp_path):
    """A real evaluation OOM under an address-space limit (``RLIMIT_AS``): unguarded, the first
    evaluation (after optimizer step 1) kills the run with torch's allocator error; guarded, the
    evaluation batch is redone in smaller chunks, both optimizer steps and both evaluations finish,
    each ``eval_loss`` equals the unlimited unsplit run's, the training micro-batches stay whole
    batches, and the run's event log shows the evaluation re-splits. One child runs all three, each
    on a fresh model: the guarded run first (a fresh address space), then the unguarded twin under
    the same limit (starting within ``LEFTOVER_MAX`` of the guarded run's address space, so its
    failure is its own), then the reference with the limit lifted."""
    runs = _run_child(tmp_path, EVAL_LIMIT, "oom,none,ref")
    ref, bare, guarded = runs["ref"], runs["none"], runs["oom"]
    assert ref["steps"] == 2 and len(ref["eval_losses"]) == 2, ref.get("error")
    assert bare.get("failed") == "evaluation" and ALLOC_FAILED in bare["error"], bare.get("error")
    assert bare["steps"] == 1  # training was healthy up to the evaluation
    assert bare["vm_start"] - guarded["vm_start"] < LEFTOVER_MAX, (bare["vm_start"], guarded["vm_start"])
    assert "failed" not in guarded, guarded.get("error")
    assert guarded["steps"] == 2
    # float32 losses of the chunks summed in another order
    assert guarded["eval_losses"] == pytest.approx(ref["eval_losses"], rel=1e-6, abs=0)
    assert guarded["eval_oom_retries"] >= 1 and guarded["eval_micro_batches"] >= 2
    # the training split never moved: every training forward ran the whole 2-row batch
    assert guarded["rows"] == [2, 2] and guarded["micro_batches"] == 1 and guarded["oom_retries"] == 0
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


#: Growth of a rank's address space over its VmSize when its first evaluation starts
#: (memguard_testing/scripts/rlimit_hf_eval_ddp.py, one 16 x 256-token batch per rank, one malloc arena):
#: ~1.6 GB through an unsplit evaluation (logits and their log-softmax, 0.8 GB each), ~0.8 GB in
#: 2 chunks, ~0.45 GB in 4, ~0.15 GB through the next training step and ~0.5 GB through the final
#: predict. The headroom sits between: rank 1's first evaluation fails unsplit and fits split.
#: Relative to the rank's own VmSize, so the gloo threads and torch's libraries (which differ
#: between machines) are already counted in the base.
DDP_EVAL_HEADROOM = 1_200_000_000


def _ddp_eval_run(tmp_path, modes: str, headroom: int = 0):
    """``rlimit_hf_eval_ddp.py`` on 2 gloo ranks running ``modes`` in that order in one launch, rank 1
    limited to ``headroom`` bytes above its VmSize at each run's first evaluation (0: no limit; the
    ``ref`` run: none); the launcher's exit status, the ranks' results that were written (by mode,
    then rank) and the output's tail."""
    out = tmp_path / "runs"
    # one arena per process: gloo's threads would otherwise each reserve a 64 MiB heap of address space
    # at their first allocation, wherever in the run that falls
    env = script_env(OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="1", MEMGUARD_TEST_DUMP_AFTER_S="480")
    proc = subprocess.run([sys.executable, "-m", "memguard_testing.torchrun", "--standalone", "--nproc_per_node=2",
                           script("rlimit_hf_eval_ddp.py"), modes, str(out), "1", str(headroom)],
                          env=env, capture_output=True, text=True, timeout=600)   # a hang ends in the watchdog
    results = {m: {r: json.loads((out / f"{m}-rank{r}.json").read_text())
                   for r in (0, 1) if (out / f"{m}-rank{r}.json").exists()} for m in modes.split(",")}
    return proc.returncode, results, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS")
def test_ddp_one_rank_eval_oom(tmp_path):
    """2-rank gloo DDP: rank 1 alone has an address-space limit its unsplit evaluation forward does not
    fit. Unguarded, rank 1 dies in its first evaluation with torch's allocator error (and the run with
    it); guarded, rank 1 redoes its batch in smaller chunks while rank 0 runs its own unsplit (no
    agreement needed: docs/evaluation.md, "Under DDP"), nothing hangs, both ranks finish both steps and
    evaluations with the unlimited unguarded run's ``eval_loss`` (the token count summed over the ranks,
    ``average_tokens_across_devices``), and a final ``predict()`` whose batch rank 1 still splits and
    rank 0 does not gives the same predictions, labels and loss. The training micro-batches never move.
    One launch runs all three, each on a fresh model over the same process group: the guarded run, the
    unlimited reference, then the unguarded twin (its failure ends the launch); rank 1's limit is
    relative to its VmSize at each run's first evaluation, so what an earlier run left is in its base."""
    rc, runs, tail = _ddp_eval_run(tmp_path, "oom,ref,none", DDP_EVAL_HEADROOM)
    guarded, ref, bare = runs["oom"], runs["ref"], runs["none"]
    assert rc != 0, tail
    assert len(ref) == 2 and all(ref[r]["steps"] == 2 and len(ref[r]["eval_losses"]) == 2 for r in (0, 1)), tail
    assert ref[1]["limit"] == 0
    assert bare.get(1, {}).get("failed") == "evaluation", tail   # rank 1's twin wrote that it failed there
    assert ALLOC_FAILED in bare[1]["error"], tail
    assert bare[1]["steps"] == 1  # training was healthy up to the evaluation
    assert len(guarded) == 2, tail
    for r in (0, 1):
        g, b = guarded[r], ref[r]
        assert "failed" not in g and g["steps"] == 2, g.get("error")
        assert g["eval_losses"] == pytest.approx(b["eval_losses"], rel=1e-6, abs=0)
        assert [m.keys() for m in g["eval_metrics"]] == [m.keys() for m in b["eval_metrics"]]
        assert g["test_loss"] == pytest.approx(b["test_loss"], rel=1e-6, abs=0)
        assert g["pred_shape"] == b["pred_shape"] and g["pred_labels"] == b["pred_labels"]
        assert g["pred_tokens"] == b["pred_tokens"]
        np.testing.assert_allclose(g["pred_sample"], b["pred_sample"], rtol=0, atol=1e-5)
        worst = max(max(abs(x - y) for x, y in zip(b["params"][n], g["params"][n])) for n in b["params"])
        assert worst < 1e-6, f"rank {r}: parameters differ from the unlimited run by {worst}"
        # the training split never moved: every training forward ran the whole 2-row batch
        assert g["rows"] == [2, 2] and g["micro_batches"] == 1 and g["oom_retries"] == 0
    limited, free = guarded[1], guarded[0]
    assert limited["limit"] > 0 and free["limit"] == 0
    assert limited["eval_oom_retries"] >= 1 and limited["eval_micro_batches"] >= 2
    assert limited["eval_rows"][0] == 16 and max(limited["eval_rows"][1:]) <= 8
    # rank 0 never split: the other rank's retry asked nothing of it
    assert free["eval_oom_retries"] == 0 and free["eval_micro_batches"] == 1
    # two evaluations and the predict (its 8 rows dealt out as one 16-row batch per rank, filled by
    # accelerate's even_batches and cut back by gather_for_metrics), each one forward
    assert free["eval_rows"] == [16, 16, 16]


@pytest.mark.parametrize("kind, off", [("MULTI_CPU", None), ("FSDP", "FSDP forwards all-gather"),
                                       ("DEEPSPEED", "DeepSpeed ZeRO-3"), ("XLA", "not data parallel")])
def test_distributed_split_only_where_forwards_run_no_collective(tmp_path, monkeypatch, kind, off):
    """With a world size > 1 the split runs under data parallelism (DDP) and stays off, with its reason,
    where forwards run collectives (FSDP, DeepSpeed) or the distributed type is not data parallel.
    FSDP, DeepSpeed and XLA cannot be set up in this test process: the two values the decision reads
    (``args.world_size`` and accelerate's ``distributed_type``) are faked, the evaluation itself is
    real (single-process, so accelerate's gathers return their input). The real DDP run is
    ``test_ddp_one_rank_eval_oom``."""
    base, _ = _trainer(tmp_path, "base")
    m0 = base.evaluate(eval_dataset=_eval_set())
    split, cb = _trainer(tmp_path, "split", k=4)
    monkeypatch.setattr(type(split.args), "world_size", property(lambda self: 2))
    monkeypatch.setattr(type(split.accelerator), "distributed_type", property(lambda self: f"DistributedType.{kind}"))
    m1 = split.evaluate(eval_dataset=_eval_set())
    # world size 2 on one process: compute_loss scales by accelerate's process count (1), as unsplit
    assert m1["eval_loss"] == pytest.approx(m0["eval_loss"], rel=1e-6, abs=0)
    if off is None:
        assert cb._eval_off_reason is None and max(cb.eval_micro_batch_rows) == 2
    else:
        assert off in cb._eval_off_reason and cb.eval_micro_batch_rows == []
