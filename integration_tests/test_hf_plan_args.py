"""``plan_training_arguments``: the preflight plan applied to ``TrainingArguments`` before the
``Trainer`` exists (the route for runs the callback cannot split in place, DeepSpeed's). A real tiny
Llama, real ``TrainingArguments``, a real ``Trainer`` run with the planned arguments."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.preflight import budget_that_fits, resident_bytes_for  # noqa: E402
from memguard_hf import MemGuardCallback, plan_training_arguments  # noqa: E402
from memguard_hf.preflight import read_specs  # noqa: E402
from memguard_testing.hf_tiny import VOCAB, RowsDataset, llama, pad_collate, tiny_llama  # noqa: E402


def _model_and_rows():
    """Long rows (up to 1024 tokens): activations are most of the estimate, not the runtime."""
    return llama(VOCAB, hidden=128, layers=4, max_positions=1024, seed=0), RowsDataset(32, max_len=1024)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                max_steps=2, learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                disable_tqdm=True, dataloader_num_workers=0, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def _budget_for_half_micro_batch(model, args, ds):
    """A budget the requested micro-batch does not fit and half of it does (as the demos place theirs)."""
    ms, ts = read_specs(SimpleNamespace(args=args, model=model, train_dataset=ds))
    ts = ts.replace(heap_trim=True)
    half = budget_that_fits(ms, ts.replace(batch_size=ts.batch_size // 2, grad_accum=ts.grad_accum * 2),
                            resident_bytes=resident_bytes_for(ts))
    assert budget_that_fits(ms, ts, resident_bytes=resident_bytes_for(ts)) > half
    return half


def test_the_plan_reaches_the_arguments_and_the_run_keeps_its_effective_batch(tmp_path):
    model, ds = _model_and_rows()
    args = _args(tmp_path)
    budget = _budget_for_half_micro_batch(model, args, ds)
    new, pf = plan_training_arguments(model, args, train_dataset=ds, budget_bytes=budget, apply=("micro_batch",))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 2)   # not modified
    assert new is not args
    assert new.per_device_train_batch_size * new.gradient_accumulation_steps == 16
    assert new.per_device_train_batch_size < 8
    assert pf.plan.estimate.peak_bytes < pf.estimate.peak_bytes
    # the callback's own preflight, same budget: the planned arguments fit, nothing more to split
    guard = MemGuardCallback(budget_bytes=budget, apply=("micro_batch",), monitor_interval_s=0)
    trainer = Trainer(model=model, args=new, train_dataset=ds, data_collator=pad_collate, callbacks=[guard])
    trainer.train()
    assert trainer.state.global_step == 2
    assert guard.preflight.micro_batches == 1
    assert guard.samples_per_step == [16, 16]


def test_a_run_that_fits_keeps_its_arguments(tmp_path):
    model, ds = tiny_llama(0), RowsDataset(64)
    args = _args(tmp_path)
    new, pf = plan_training_arguments(model, args, train_dataset=ds, budget_bytes=64 * 2**30)
    assert new is args and pf.micro_batches == 1


def test_unknown_option_names_itself(tmp_path):
    with pytest.raises(ConfigError) as e:
        plan_training_arguments(tiny_llama(0), _args(tmp_path), budget=1)
    assert e.value.field == "budget"


def test_deepspeed_config_numbers_follow_the_plan(tmp_path):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    model, ds = _model_and_rows()
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": 2}}
    args = _args(tmp_path, deepspeed=cfg)
    budget = _budget_for_half_micro_batch(model, args, ds)
    new, pf = plan_training_arguments(model, args, train_dataset=ds, budget_bytes=budget, apply=("micro_batch",))
    assert pf.train_spec.sharding == "zero2"   # read from the config, one process included
    assert cfg["train_micro_batch_size_per_gpu"] == 8                        # the caller's dict untouched
    got = new.hf_deepspeed_config.config
    assert got["train_micro_batch_size_per_gpu"] == new.per_device_train_batch_size < 8
    # "auto" stays "auto" in the planned config; HF fills it from the planned arguments
    assert new.deepspeed["gradient_accumulation_steps"] == "auto"
    assert got["gradient_accumulation_steps"] == new.gradient_accumulation_steps > 2


def test_planned_checkpointing_reaches_the_arguments(tmp_path):
    # transformers 5 reads ``activation_checkpointing``; a copy that sets only its deprecated alias
    # ``gradient_checkpointing`` is overwritten by the copied ``activation_checkpointing=False``
    model, ds = _model_and_rows()
    args = _args(tmp_path)
    ms, ts = read_specs(SimpleNamespace(args=args, model=model, train_dataset=ds))
    ts = ts.replace(heap_trim=True)
    budget = budget_that_fits(ms, ts.replace(grad_checkpoint=True), resident_bytes=resident_bytes_for(ts))
    assert budget_that_fits(ms, ts, resident_bytes=resident_bytes_for(ts)) > budget
    new, pf = plan_training_arguments(model, args, train_dataset=ds, budget_bytes=budget, apply=("grad_checkpoint",))
    assert pf.plan.train_spec.grad_checkpoint and not args.gradient_checkpointing
    assert new.gradient_checkpointing is True
    assert getattr(new, "activation_checkpointing", True) is True
    # what the Trainer and the callback's preflight read from the planned arguments
    assert read_specs(SimpleNamespace(args=new, model=model, train_dataset=ds))[1].grad_checkpoint
