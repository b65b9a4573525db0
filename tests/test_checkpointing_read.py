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


def test_torch_loop_train_spec_and_turning_it_on_through_peft():
    """``TorchGuard``'s reading (``memguard_torch.specs.train_spec``) sees the recipe's checkpointing,
    and ``enable_activation_checkpointing`` on the PEFT model turns it on in the model inside."""
    from memguard_hf.model_spec import live_model_spec
    from memguard_torch.specs import train_spec
    from memguard_torch.train_reading import enable_activation_checkpointing

    _, wrapped = _peft_llama(True)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad])
    batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long)}
    assert train_spec(wrapped, opt, batch, live_model_spec(wrapped)).grad_checkpoint is True
    base, off = _peft_llama(False)
    assert train_spec(off, opt, batch, live_model_spec(off)).grad_checkpoint is False
    enable_activation_checkpointing(off)
    assert checkpointing_on(off) and checkpointing_on(base)


def test_a_wrapper_whose_inner_model_cannot_checkpoint_is_kept():
    """A wrapper with ``get_base_model`` whose inner module has no ``gradient_checkpointing_enable``
    while the wrapper has one: the wrapper stays the target."""
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(2, 2)

        def get_base_model(self):
            return self.inner

        def gradient_checkpointing_enable(self, **kw):
            pass

    w = Wrapper()
    assert checkpoint_target(w) is w
