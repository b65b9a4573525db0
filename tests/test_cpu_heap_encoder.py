"""LoRA on encoder-style blocks (BERT, ViT, T5, BART) takes its own CPU heap-slack factor at the loss
moment (``cpu_heap.forward_kind``; docs/estimator.md, "LoRA on encoder-style blocks"): which specs
take it, what it changes in the estimate, and that the committed factors are what
bench/fit_cpu_heap_slack.py fits on the committed small-matrix measurements."""

from __future__ import annotations

import os

import pytest
import transformers

from memguard_core.estimator import cpu_heap
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.gradients import grad_layers
from memguard_core.estimator.logits import logits_elements
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config
from memguard_testing.bench_scripts import load_bench_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL = os.path.join(ROOT, "tests", "configs", "smollm2-135m.json")
GPT2 = os.path.join(ROOT, "tests", "configs", "gpt2.json")
_SMALL = dict(hidden_size=256, num_attention_heads=4, intermediate_size=1024, num_hidden_layers=2)


def _bert():
    return model_spec_from_hf_config(transformers.BertConfig(
        vocab_size=1000, architectures=["BertForSequenceClassification"], num_labels=2, **_SMALL))


def _vit():
    return model_spec_from_hf_config(transformers.ViTConfig(
        image_size=64, patch_size=16, architectures=["ViTForImageClassification"], num_labels=10, **_SMALL))


def _t5():
    return model_spec_from_hf_config(transformers.T5Config(
        d_model=256, d_ff=1024, num_layers=2, num_heads=4, d_kv=64, vocab_size=1000,
        architectures=["T5ForConditionalGeneration"], decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _bart():
    return model_spec_from_hf_config(transformers.BartConfig(
        d_model=256, encoder_ffn_dim=1024, decoder_ffn_dim=1024, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=1000,
        architectures=["BartForConditionalGeneration"]))


@pytest.mark.parametrize("build", [_bert, _vit, _t5, _bart], ids=["bert", "vit", "t5", "bart"])
def test_encoders_image_classifiers_and_encoder_decoders_are_encoder_style(build):
    ms = build()
    assert cpu_heap.encoder_style_blocks(ms)
    assert cpu_heap.forward_kind(ms, TrainSpec(method="lora")) == "lora_encoder"
    assert cpu_heap.forward_kind(ms, TrainSpec(method="full")) == "full"


@pytest.mark.parametrize("config", [SMOL, GPT2], ids=["smollm2", "gpt2"])
def test_decoders_keep_the_lora_factor(config):
    # GPT-2 has one key / value head per query head and an ungated MLP, but it is a causal LM: its
    # LoRA cases were fitted with the decoders' factor and stay with it
    ms = model_spec_from_hf_config(config)
    assert not cpu_heap.encoder_style_blocks(ms)
    assert cpu_heap.forward_kind(ms, TrainSpec(method="lora")) == "lora"


@pytest.mark.parametrize("glibc", [None, "2.36", "2.41"])
def test_the_loss_moment_of_encoder_lora_takes_the_encoder_factor(glibc):
    ms = _bert()
    ts = TrainSpec(method="lora", batch_size=8, seq_length=128, lora_rank=16, lora_targets=("query", "value"),
                   glibc=glibc)
    f = cpu_heap.slack_factors(ts)
    assert f["forward"]["lora_encoder"] > f["forward"]["lora"]
    traffic = cpu_heap.activation_traffic(ms, ts)
    # BERT's attention dropout sends SDPA down its math path, which saves three score-sized tensors
    # per block (fp32 probabilities, the dropout mask, the dropped probabilities: 12 bytes per score,
    # 2 MiB each here), which the heap serves and which keep the LoRA factor
    scores = cpu_heap.score_traffic(ms, ts)
    assert scores == 2 * 12 * 8 * 4 * 128 * 128
    assert scores < traffic
    assert cpu_heap.forward_split(ms, ts, traffic, 0) == {"lora_encoder": traffic - scores, "lora": scores}
    slack = cpu_heap.heap_slack(ms, ts, gradients=0, param_bytes=4, logits=0)
    temp = f["lora_temp"] * cpu_heap.lora_forward_traffic(ms, ts)
    want = f["forward"]["lora_encoder"] * (traffic - scores) + f["forward"]["lora"] * scores + temp
    assert abs(slack["loss"] - want) <= 1
    # without the math path's scores (attention dropout 0: the flash kernel, whose only score-sized
    # output is its log-sum-exp) nearly all of it takes the encoder factor
    flash = ms.replace(attention_dropout=0.0)
    t = cpu_heap.activation_traffic(flash, ts)
    split = cpu_heap.forward_split(flash, ts, t, 0)
    assert split["lora"] == cpu_heap.score_traffic(flash, ts) < 0.01 * t and sum(split.values()) == t
    # the later moments and the checkpointed rule are not the forward's: unchanged
    assert slack["backward"] == int(f["backward"]["lora"] * traffic)
    gc_ts = ts.replace(grad_checkpoint=True)
    gc = cpu_heap.heap_slack(ms, gc_ts, gradients=0, param_bytes=4, logits=0)
    gc_traffic = cpu_heap.activation_traffic(ms, gc_ts)
    assert gc["loss"] == int(f["checkpointed"]["lora"] * gc_traffic
                             + f["checkpointed_lora_blocks"] * gc_traffic / grad_layers(ms, gc_ts))
    # what the estimate plans at the loss moment carries it (with the head's logits, small here)
    loss = estimate(ms, ts).phase_breakdowns["loss"]
    assert loss["allocator_slack"] == cpu_heap.heap_slack(ms, ts, gradients=0, param_bytes=4,
                                                          logits=loss.get("logits", 0))["loss"]


@pytest.mark.parametrize("which, path, offset", [
    ("older", "bench_cpu.json", 0), ("newer", "bench_cpu_glibc241.json", 42)])
def test_the_committed_encoder_factor_is_the_fit_on_the_committed_matrix(which, path, offset, capsys):
    # the factor was fitted with the others held (``--knob``); refitting on the same measurements
    # must give the module's value, so a changed constant or changed data without a refit fails here
    fit = load_bench_script("fit_cpu_heap_slack")
    assert fit.main([os.path.join(ROOT, "bench", "results", path), "--set", which, "--offset-mib", str(offset),
                     "--knob", "forward[lora_encoder]"]) == 0
    out = capsys.readouterr().out
    now = fit.current(which)[("forward", "lora_encoder")]
    assert f"forward[lora_encoder] {now} -> {now}," in out
    # the matrix's encoder and encoder-decoder cases are among the cases fitted on
    names = {c[0] for c in fit.load(os.path.join(ROOT, "bench", "results", path), True)}
    assert {"hf-bert-base-4l-lora-r16-b8-s128-fp32-query+value-3steps",
            "hf-t5-base-2l-lora-r16-b4-s512-fp32-q+v-t128"} <= names


def test_an_encoder_decoders_logits_are_sized_on_its_target_tokens_and_keep_the_lora_factor():
    # 2 rows x 128 target tokens x 32,128 vocabulary x 4 B = 31.4 MiB: under glibc's 32 MiB ceiling,
    # so the heap serves the logits (their holes count at the loss moment); sized on the 512 source
    # tokens they would be 125 MiB and mmapped
    ms = model_spec_from_hf_config(transformers.T5Config(
        d_model=256, d_ff=1024, num_layers=2, num_heads=4, d_kv=64, vocab_size=32128,
        architectures=["T5ForConditionalGeneration"], decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    ts = TrainSpec(method="lora", batch_size=2, seq_length=512, target_length=128, lora_rank=16,
                   lora_targets=("q", "v"))
    assert logits_elements(ms, ts) == 2 * 128 * 32128
    assert cpu_heap.logits_heap_served(ms, ts)
    assert not cpu_heap.logits_heap_served(ms, ts.replace(target_length=512))
    traffic, scores = cpu_heap.activation_traffic(ms, ts), cpu_heap.score_traffic(ms, ts)
    assert cpu_heap.forward_split(ms, ts, traffic, 1000) == {"lora_encoder": traffic + 1000 - scores - 1000,
                                                            "lora": scores + 1000}
    # never more than the whole traffic keeps the LoRA factor
    assert cpu_heap.forward_split(ms, ts, 10, 0) == {"lora_encoder": 0, "lora": 10}


def test_a_classifiers_logits_are_its_labels_not_the_vocabulary():
    ms = _bert()
    ts = TrainSpec(method="lora", batch_size=8, seq_length=128)
    assert logits_elements(ms, ts) == 8 * 2
    assert logits_elements(_vit(), ts) == 8 * 10
    assert logits_elements(model_spec_from_hf_config(SMOL), ts) == 8 * 128 * 49152

