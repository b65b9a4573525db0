"""The first guarantee, across the kinds of model people fine-tune: a batch cut into k micro-batches
(k = 2 and 4, from the first step) trains to the same parameters and logs the same loss as the
unsplit batch (SGD, no clipping, 2 optimizer steps, rows of different lengths), under the HF
``Trainer``, Lightning and ``TorchGuard``; and under TRL's SFT, DPO and reward trainers. A loss a
split cannot reproduce is refused at train start. The matrix is in docs/lifecycle.md."""

from __future__ import annotations

import logging

import pytest
import torch

from memguard_testing import equivalence as eq

# float32 sums in another order: relative to the largest parameter update of the run
TOL = 1e-4


def _check(kind, ref, runs, init):
    for k, run in runs.items():
        assert run["steps"] == ref["steps"] == eq.STEPS
        assert run["rows"] and max(run["rows"]) < eq.BATCH, (kind, k, run["rows"])   # the split happened
        assert eq.update_ratio(init, ref["params"], run["params"]) == pytest.approx(1.0, abs=1e-3), (kind, k)
        assert eq.max_rel_diff(ref["params"], run["params"], init) < TOL, (kind, k)
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), (kind, k)


@pytest.mark.parametrize("kind", eq.KINDS)
def test_hf_trainer_split_equals_unsplit(tmp_path, kind):
    init = eq.params(eq.build_model(kind))
    ref = eq.run_hf(kind, str(tmp_path / "1"))
    _check(kind, ref, {k: eq.run_hf(kind, str(tmp_path / str(k)), k=k) for k in (2, 4)}, init)


@pytest.mark.parametrize("kind", eq.KINDS)
def test_torch_guard_split_equals_unsplit(kind):
    init = eq.params(eq.build_model(kind))
    ref = eq.run_torch(kind)
    _check(kind, ref, {k: eq.run_torch(kind, k=k) for k in (2, 4)}, init)


@pytest.mark.parametrize("kind", eq.KINDS)
def test_lightning_split_equals_unsplit(tmp_path, kind):
    init = eq.params(eq.build_model(kind))
    ref = eq.run_lightning(kind, str(tmp_path / "1"))
    _check(kind, ref, {k: eq.run_lightning(kind, str(tmp_path / str(k)), k=k) for k in (2, 4)}, init)


# ---------------------------------------------------------------------------------------------- HF losses
def _hf_case(tmp_path, kind, **kw):
    init = eq.params(eq.build_model(kind))
    ref = eq.run_hf(kind, str(tmp_path / "1"), **kw)
    return init, ref, {k: eq.run_hf(kind, str(tmp_path / str(k)), k=k, **kw) for k in (2, 4)}


@pytest.mark.parametrize("kind", ["t5", "llama-padded", "bert-seq-cls"])
def test_label_smoothing(tmp_path, kind):
    _check(kind, *_reorder(_hf_case(tmp_path, kind, args_kwargs={"label_smoothing_factor": 0.1})))


def _reorder(case):
    init, ref, runs = case
    return ref, runs, init


def _token_mean_ce(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func`` that ignores the count: the mean over valid shifted tokens."""
    logits = outputs["logits"][:, :-1].flatten(0, 1)
    return torch.nn.functional.cross_entropy(logits.float(), labels[:, 1:].flatten(), ignore_index=-100)


def _token_sum_over_count(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func`` normalised by the Trainer's count (the sum over valid shifted tokens / count)."""
    logits = outputs["logits"][:, :-1].flatten(0, 1)
    loss = torch.nn.functional.cross_entropy(logits.float(), labels[:, 1:].flatten(), ignore_index=-100,
                                             reduction="sum")
    return loss / num_items_in_batch


def test_compute_loss_func_with_and_without_the_count(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="memguard.hf"):
        _check("mean", *_reorder(_hf_case(tmp_path / "mean", "llama-padded",
                                          trainer_kwargs={"compute_loss_func": _token_mean_ce})))
    said = [r for r in caplog.records if "does not use num_items_in_batch" in r.getMessage()]
    assert len(said) == 2 and "compute_loss_func" in said[0].getMessage()   # once per split run
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memguard.hf"):
        _check("sum", *_reorder(_hf_case(tmp_path / "sum", "llama-padded",
                                         trainer_kwargs={"compute_loss_func": _token_sum_over_count})))
    assert not [r for r in caplog.records if "does not use num_items_in_batch" in r.getMessage()]


def _row_mean_trainer():
    from transformers import Trainer

    class RowMeanTrainer(Trainer):
        """A ``compute_loss`` override: per row, the mean squared logit of its valid positions; the
        batch's loss is the mean over rows (a per-sample loss, not a token mean)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            mask = inputs.pop("labels").ne(-100).float()
            logits = model(**inputs).logits
            per_row = (logits.pow(2).mean(-1) * mask).sum(1) / mask.sum(1)
            loss = per_row.mean()
            return (loss, logits) if return_outputs else loss

    return RowMeanTrainer


def test_compute_loss_override_with_rows_weighting(tmp_path, caplog):
    """An override memguard has no rule for: said once, and ``loss_weighting="rows"`` makes it exact
    (the ``auto`` token share would not: rows hold different numbers of valid tokens)."""
    cls = _row_mean_trainer()
    init = eq.params(eq.build_model("llama-padded"))
    ref = eq.run_hf("llama-padded", str(tmp_path / "1"), trainer_cls=cls)
    runs = {}
    for k in (2, 4):
        with caplog.at_level(logging.WARNING, logger="memguard.hf"):
            auto = eq.run_hf("llama-padded", str(tmp_path / f"a{k}"), k=k, trainer_cls=cls)
        assert any("RowMeanTrainer.compute_loss" in r.getMessage() for r in caplog.records)
        caplog.clear()
        assert eq.max_rel_diff(ref["params"], auto["params"], init) > 10 * TOL   # tokens share: not exact
        runs[k] = eq.run_hf("llama-padded", str(tmp_path / f"r{k}"), k=k, trainer_cls=cls,
                            guard_kwargs={"loss_weighting": "rows"})
        # an explicit weighting is not an assumption: nothing said
        assert not [r for r in caplog.records if "num_items_in_batch" in r.getMessage()]
    _check("row-mean override", ref, runs, init)


class OwnLossModel(torch.nn.Module):
    """A model that computes its own loss without labels in the batch: the mean over rows of each
    row's mean squared output (an autoencoder-style objective)."""

    def __init__(self):
        super().__init__()
        self.inner = eq.build_model("llama-padded")

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        mask = attention_mask.float()
        per_row = (out.pow(2).mean(-1) * mask).sum(1) / mask.sum(1)
        return {"loss": per_row.mean(), "logits": out}


def test_model_with_its_own_loss_and_no_labels(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(eq, "build_model", _own_loss_builder(eq.build_model))
    monkeypatch.setattr(eq, "rows", _no_labels(eq.rows))
    init = eq.params(eq.build_model("own-loss"))
    ref = eq.run_hf("own-loss", str(tmp_path / "1"))
    with caplog.at_level(logging.WARNING, logger="memguard.hf"):
        runs = {k: eq.run_hf("own-loss", str(tmp_path / str(k)), k=k) for k in (2, 4)}
    assert any("model's own loss" in r.getMessage() for r in caplog.records)
    _check("own loss", ref, runs, init)


def _own_loss_builder(orig):
    def build(kind, seed=0):
        if kind != "own-loss":
            return orig(kind, seed)
        torch.manual_seed(seed)
        return OwnLossModel()
    return build


def _no_labels(orig):
    def rows(kind, *a, **kw):
        out = orig("llama-padded" if kind == "own-loss" else kind, *a, **kw)
        if kind == "own-loss":
            out = [{"input_ids": r["input_ids"]} for r in out]
        return out
    return rows


# ---------------------------------------------------------------------------------------------- TRL
def _trl_run(kind, out_dir, k=1, **cfg_kw):
    """TRL's SFT / DPO / reward trainer on the tiny Llama (a sequence classifier for the reward
    model), word-level text, fp32, SGD without clipping; ``k`` > 1 under ``MemGuardCallback``."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from transformers import LlamaForSequenceClassification

    from memguard_hf import MemGuardCallback
    from memguard_testing.hf_tiny import tiny_llama
    from memguard_testing.trl_tiny import preference_rows, text_rows, word_tokenizer

    common = dict(output_dir=out_dir, per_device_train_batch_size=eq.BATCH, max_steps=eq.STEPS,
                  learning_rate=eq.LR, optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1,
                  save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
                  dataloader_num_workers=0, bf16=False, max_length=32, **cfg_kw)
    torch.manual_seed(0)
    if kind == "sft":
        model = tiny_llama(0)
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(packing=False, **common),
                                 train_dataset=datasets.Dataset.from_dict(text_rows(eq.ROWS)),
                                 processing_class=word_tokenizer())
    elif kind == "dpo":
        model = tiny_llama(0)
        # the reference model given (TRL would load it from the hub id in the config)
        trainer = trl.DPOTrainer(model=model, ref_model=tiny_llama(0), args=trl.DPOConfig(beta=0.5, **common),
                                 train_dataset=datasets.Dataset.from_dict(preference_rows(eq.ROWS, prompt=True)),
                                 processing_class=word_tokenizer())
    else:
        base = tiny_llama(0)
        model = LlamaForSequenceClassification(base.config.__class__(**{**base.config.to_dict(), "num_labels": 1}))
        model.config.pad_token_id = 0
        trainer = trl.RewardTrainer(model=model, args=trl.RewardConfig(**common),
                                    train_dataset=datasets.Dataset.from_dict(preference_rows(eq.ROWS, prompt=False)),
                                    processing_class=word_tokenizer())
    trainer._get_train_sampler = lambda *a, **kw: torch.utils.data.SequentialSampler(trainer.train_dataset)
    init = eq.params(trainer.model)
    guard = None
    if k > 1:
        guard = MemGuardCallback(preflight=False, budget_bytes=64 * 2**30, monitor_interval_s=0, micro_batches=k)
        trainer.add_callback(guard)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return init, {"params": eq.params(trainer.model), "losses": losses, "steps": trainer.state.global_step,
                  "rows": list(guard.micro_batch_rows) if guard is not None else None,
                  "refused": guard.split_disabled_reason if guard is not None else None}


@pytest.mark.parametrize("kind", ["sft", "dpo", "reward"])
def test_trl_trainers_split_equals_unsplit(tmp_path, kind):
    init, ref = _trl_run(kind, str(tmp_path / "1"))
    runs = {k: _trl_run(kind, str(tmp_path / str(k)), k=k)[1] for k in (2, 4)}
    if kind != "sft":
        # a preference batch is 8 pairs: 16 rows, chosen then rejected; a micro-batch keeps its pairs
        for k, run in runs.items():
            assert run["rows"] == [2 * eq.BATCH // k] * (k * eq.STEPS), (kind, k, run["rows"])
            run["rows"] = [r // 2 for r in run["rows"]]
    _check(kind, ref, runs, init)


def test_trl_dpo_loss_that_couples_pairs_is_refused_at_train_start(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="memguard.hf"):
        _, run = _trl_run("dpo", str(tmp_path / "aot"), k=2, loss_type=["aot"])
    assert "aot" in run["refused"]
    assert any("in-place micro-batching disabled" in r.getMessage() and "aot" in r.getMessage()
               for r in caplog.records)
    init, ref = _trl_run("dpo", str(tmp_path / "ref"), loss_type=["aot"])
    assert eq.max_rel_diff(ref["params"], run["params"], init) < TOL   # whole batches, as unsplit


def test_moe_router_loss_is_refused_at_train_start(tmp_path, caplog, monkeypatch):
    """A Mixtral with ``output_router_logits`` adds its load-balancing loss (a mean over the forward's
    tokens) to every forward: a split would count it k times, so the guard refuses to split and the
    run equals the unsplit one."""
    import transformers as tf

    def build(kind, seed=0):
        torch.manual_seed(seed)
        cfg = tf.MixtralConfig(vocab_size=eq.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5,
                               max_position_embeddings=64, use_cache=False)
        return tf.MixtralForCausalLM(cfg)

    orig_rows = eq.rows
    monkeypatch.setattr(eq, "build_model", build)
    monkeypatch.setattr(eq, "rows", lambda kind, *a, **kw: orig_rows("llama-padded", *a, **kw))
    init = eq.params(build("moe"))
    ref = eq.run_hf("moe", str(tmp_path / "1"))
    with caplog.at_level(logging.WARNING, logger="memguard.hf"):
        run = eq.run_hf("moe", str(tmp_path / "2"), k=2)
    assert any("router loss" in r.getMessage() and "disabled" in r.getMessage() for r in caplog.records)
    assert eq.max_rel_diff(ref["params"], run["params"], init) < TOL
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
