"""Reading whether activation checkpointing is on (``memguard_torch.train_reading``) through PEFT's
wrapper: QLoRA recipes turn it on on the base model before ``get_peft_model``
(``peft.prepare_model_for_kbit_training(use_gradient_checkpointing=True)``, or
``model.gradient_checkpointing_enable()`` by hand), with ``TrainingArguments.gradient_checkpointing``
left off. PEFT forwards ``gradient_checkpointing_enable`` to the model inside, not the flag that says
it is on, so the reader must look inside the wrapper, or the estimate counts every block's
activations of a checkpointed run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memguard_torch.train_reading import checkpoint_target, checkpointing_on  # noqa: E402


def _peft_llama(checkpointing: bool):
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, num_hidden_layers=2, vocab_size=128)
    base = transformers.LlamaForCausalLM(cfg)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return base, peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("on", [True, False])
def test_checkpointing_turned_on_under_peft_is_read(on):
    base, wrapped = _peft_llama(on)
    assert checkpoint_target(wrapped) is base
    assert checkpointing_on(wrapped) is on
    assert checkpointing_on(base) is on


def test_hf_train_spec_reads_checkpointing_the_recipe_turned_on(tmp_path):
    """A ``Trainer`` whose arguments leave checkpointing off, on a PEFT model whose base has it on."""
    from transformers import Trainer, TrainingArguments

    from memguard_hf.model_spec import live_model_spec
    from memguard_hf.specs import train_spec

    _, wrapped = _peft_llama(True)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                             use_cpu=True, report_to=[], save_strategy="no")
    assert args.gradient_checkpointing is False
    trainer = Trainer(model=wrapped, args=args)
    ts = train_spec(trainer, live_model_spec(wrapped), seq_length=32)
    assert ts.grad_checkpoint is True and ts.method == "lora"
