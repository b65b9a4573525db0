"""The preflight plan applied to ``TrainingArguments`` before the ``Trainer`` is built.

Where the callback cannot split batches in place -- DeepSpeed, whose engine counts micro-steps
itself (docs/torch_loop.md, "DeepSpeed") -- the plan has to reach the run through its settings:
``per_device_train_batch_size`` / k, ``gradient_accumulation_steps`` x k (the effective batch and so
the LR schedule and step count unchanged) and ``gradient_checkpointing``, and, in a DeepSpeed
config that gives them as numbers rather than "auto", ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` and ``train_batch_size`` (HF's ``deepspeed_init`` refuses a config
that disagrees with the arguments). :func:`plan_training_arguments` does that with the estimate and
planner the callback uses; the callback's own preflight then finds the run fits.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace
from typing import Any, Optional, Tuple

from memguard_core.errors import ConfigError
from memguard_core.guard import Guard
from memguard_core.options import GuardOptions
from memguard_core.preflight import Preflight
from memguard_core.deepspeed_config import deepspeed_config

from .preflight import read_specs

logger = logging.getLogger("memguard.hf")

#: ``MemGuardCallback`` options :func:`plan_training_arguments` takes (those that shape a plan).
PLAN_OPTIONS = ("budget_bytes", "budget_gib", "safety_ratio", "thresholds", "apply", "device", "trim_heap")


def plan_training_arguments(model: Any, args: Any, *, train_dataset: Any = None, seq_length: Optional[int] = None,
                            **options: Any) -> Tuple[Any, Preflight]:
    """Plan ``model`` trained with ``args`` against the memory budget and return a copy of ``args``
    with the plan applied, before the ``Trainer`` exists::

        args, pf = plan_training_arguments(model, args, train_dataset=ds)
        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[MemGuardCallback()])

    Args:
        model: the model to train (PEFT and 4-bit aware, as the callback reads it).
        args: the run's ``TrainingArguments`` (TRL's ``SFTConfig`` included); not modified.
        train_dataset: rows the sequence length is read from when ``args`` and ``seq_length`` do
            not give it (the longest ``input_ids`` of the first 2048).
        seq_length: tokens per row, overriding what is read.
        **options: ``MemGuardCallback`` options that shape the plan (:data:`PLAN_OPTIONS`):
            ``budget_bytes`` / ``budget_gib`` (default: the process's memory plus what is
            available, x ``safety_ratio``), ``safety_ratio``, ``thresholds`` (the plan targets the
            warning level), ``apply``, ``device``, ``trim_heap`` (CPU: the run trims its heap at
            every step's end, as the callback does by default).

    Returns:
        ``(new_args, preflight)``: ``new_args`` is ``args`` itself when the plan changes nothing,
        else a new ``TrainingArguments`` (``dataclasses.replace``) with the micro-batch,
        accumulation and activation checkpointing of the plan (and the DeepSpeed config's numeric
        batch fields to match); ``preflight.not_applied`` lists the changes it could not make
        (sequence length, LoRA rank / layers), each with the exact change in its reason, also
        logged as warnings.

    Raises:
        ConfigError: an option, the model or a setting that cannot be read (naming it).
        DoesNotFitError: nothing the planner may change fits the budget.
    """
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        raise ConfigError(unknown[0], f"one of the options that shape a plan: {', '.join(PLAN_OPTIONS)}",
                          options[unknown[0]])
    opts = GuardOptions.from_kwargs(seq_length=seq_length, **options)
    trainer = SimpleNamespace(args=args, model=model, train_dataset=train_dataset)
    pf = Guard(opts, log=logger).plan(lambda: read_specs(trainer, seq_length=opts.seq_length, device=opts.device),
                                      enable_checkpointing=lambda: None)
    for line in pf.report_lines():
        logger.info("%s", line)
    for change in pf.not_applied:
        logger.warning("memguard: not applied to TrainingArguments: %s", change.reason)
    new, old = pf.plan.train_spec, pf.train_spec
    changes = {}
    if new.batch_size != old.batch_size or new.grad_accum != old.grad_accum:
        changes.update(per_device_train_batch_size=new.batch_size, gradient_accumulation_steps=new.grad_accum)
    if new.grad_checkpoint and not old.grad_checkpoint:
        # transformers >= 5 reads ``activation_checkpointing``; its deprecated alias
        # ``gradient_checkpointing`` alone is overwritten in __post_init__ by the copied new name
        fields = {f.name for f in dataclasses.fields(args)}
        changes.update({name: True for name in ("activation_checkpointing", "gradient_checkpointing")
                        if name in fields})
    if not changes:
        return args, pf
    if getattr(args, "deepspeed", None):
        ds = copy.deepcopy(dict(deepspeed_config(args.deepspeed)))
        for key, value in (("train_micro_batch_size_per_gpu", new.batch_size),
                           ("gradient_accumulation_steps", new.grad_accum),
                           ("train_batch_size", new.batch_size * new.grad_accum * new.world_size)):
            if key in ds and not (isinstance(ds[key], str) and ds[key].strip().lower() == "auto"):
                ds[key] = value
        changes["deepspeed"] = ds
    logger.warning("memguard: TrainingArguments planned: %s", ", ".join(f"{k}={v}" for k, v in changes.items()
                                                                      if k != "deepspeed"))
    return dataclasses.replace(args, **changes), pf
