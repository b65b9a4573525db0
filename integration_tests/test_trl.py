"""TRL's ``SFTTrainer`` (a ``Trainer`` subclass with its own ``compute_loss``) guarded by
``trainer.add_callback(MemGuardCallback())`` alone: a split mid-run keeps the step count, the LR
sequence, the samples per step and the logged loss."""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from memguard_testing.hf_tiny import SwitchSplit, loss_sequence, lr_sequence, params, tiny_llama  # noqa: E402
from memguard_testing.trl_tiny import word_tokenizer  # noqa: E402
from memguard_hf import MemGuardCallback  # noqa: E402


def text_dataset(n: int = 64):
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 24, (1,), generator=g))
        rows.append(" ".join(f"w{int(i)}" for i in torch.randint(0, 90, (length,), generator=g)))
    return datasets.Dataset.from_dict({"text": rows})


def sft(out, guard=None, extra=(), steps=4, bf16=None):
    """``bf16=None`` keeps ``SFTConfig``'s own default (``bf16=True``: accelerate's bf16 autocast, on CPU too)."""
    precision = {} if bf16 is None else {"bf16": bf16}
    cfg = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                        max_steps=steps, warmup_steps=1, logging_steps=1, save_strategy="no",
                        report_to=[], use_cpu=True, seed=0, data_seed=0, max_length=32, packing=False,
                        disable_tqdm=True, dataloader_num_workers=0,
                        optim="sgd", learning_rate=0.5, **precision)
    model = tiny_llama(0)
    model.config.pad_token_id = 0
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=text_dataset(), processing_class=word_tokenizer(),
                             callbacks=list(extra))
    if guard is not None:
        trainer.add_callback(guard)
    trainer.train()
    return trainer


def _runs(tmp_path, bf16=None):
    base = sft(tmp_path / "base", bf16=bf16)
    guard = MemGuardCallback(preflight=False, budget_bytes=64 * 2**30, monitor_interval_s=0)
    split = sft(tmp_path / "split", guard=guard, extra=[SwitchSplit(guard, at_step={1: 2}, at_substep={2: 4})],
                bf16=bf16)
    return base, guard, split


def test_sft_trainer_is_guarded_by_add_callback_alone(tmp_path):
    base, guard, split = _runs(tmp_path)
    assert guard.trainer is split  # found by the stack walk from add_callback alone
    assert split.state.global_step == base.state.global_step == 4
    assert lr_sequence(split) == pytest.approx(lr_sequence(base))
    assert guard.samples_per_step == [16] * 4
    assert max(guard.micro_batch_rows[4:]) < 8  # the split happened
    assert loss_sequence(split) == pytest.approx(loss_sequence(base), rel=1e-3)


def test_sft_trainer_split_parameters_equal_unsplit(tmp_path):
    """In fp32 (``bf16=False``) the split run's parameters equal the unsplit run's.

    Not under ``SFTConfig``'s default ``bf16=True``: accelerate's autocast runs the decoder's
    ``nn.Linear`` layers in bf16, so each backward's weight gradient arrives rounded to bf16
    (~3 significant digits) before it is added to the fp32 ``.grad``. More backwards per step
    means more rounded partial sums: split vs unsplit then differ by ~6e-5 in the parameters
    here, about as much as plain TRL with 4 rows x 4 accumulation steps instead of 8 x 2 (no
    memguard), while the gradients of the embedding, the RMSNorm weights and TRL's fused LM head
    (fp32 accumulation) still agree to 1e-7 (relative)."""
    base, guard, split = _runs(tmp_path, bf16=False)
    assert max(guard.micro_batch_rows[4:]) < 8  # the split happened
    pb, ps = params(base), params(split)
    worst = max((pb[n] - ps[n]).abs().max().item() for n in pb)
    assert worst < 2e-6, worst
