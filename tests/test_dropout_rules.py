"""Dropout and the SDPA path from what the config says (not from lists of model types)."""

from __future__ import annotations

import os

import pytest

from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.config_fields import dropout_probabilities
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config

GPT2 = os.path.join(os.path.dirname(__file__), "configs", "gpt2.json")


class Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_dropout_fields_by_role():
    assert dropout_probabilities(Cfg(attn_pdrop=0.1, resid_pdrop=0.2, embd_pdrop=0.05)) == {
        "attention_dropout": 0.1, "residual_dropout": 0.2, "embedding_dropout": 0.05}
    # OPT: ``dropout`` is the residual one; Llama: attention only
    assert dropout_probabilities(Cfg(attention_dropout=0.0, dropout=0.1))["residual_dropout"] == 0.1
    assert dropout_probabilities(Cfg(attention_dropout=0.0)) == {
        "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0}
    # not a probability: read as none
    assert dropout_probabilities(Cfg(attention_dropout="flash", hidden_dropout=None))["attention_dropout"] == 0.0


def _gpt2(**drop):
    ms = model_spec_from_hf_config(GPT2)
    return ms.replace(**drop) if drop else ms


def test_gpt2_config_dropouts_reach_the_spec():
    ms = _gpt2()
    assert (ms.attention_dropout, ms.residual_dropout, ms.embedding_dropout) == (0.1, 0.1, 0.1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attention_dropout_takes_the_math_path(dtype):
    # GPT-2 full fine-tune, 1 x 256 tokens: with attention dropout SDPA runs its math path on CPU
    # (fp32 softmax, noise and dropped probabilities: 12 B per score, whatever the input dtype);
    # without, the flash kernel keeps only an fp32 logsumexp per head.
    t = TrainSpec(method="full", batch_size=1, seq_length=256, dtype=dtype)
    with_drop = estimate(_gpt2(), t).phase_breakdowns["loss"]["attention_scores"]
    no_drop = estimate(_gpt2(attention_dropout=0.0), t).phase_breakdowns["loss"]["attention_scores"]
    L, nh, s = 12, 12, 256
    assert with_drop == L * nh * s * 12 * s
    assert no_drop == L * nh * 4 * s
    # CUDA: the flash (bf16) / memory-efficient (fp32) kernels take dropout (philox seed, no mask
    # kept): an fp32 logsumexp per head, 256 queries being a multiple of the 32-query padding
    cuda = estimate(_gpt2(), t.replace(device="cuda")).phase_breakdowns["loss"]["attention_scores"]
    assert cuda == L * nh * 4 * s


def test_residual_dropout_noise_is_counted_per_block():
    t = TrainSpec(method="full", batch_size=1, seq_length=128, dtype="fp32")
    a = estimate(_gpt2(), t).phase_breakdowns["loss"]["activations"]
    b = estimate(_gpt2(residual_dropout=0.0, embedding_dropout=0.0), t).phase_breakdowns["loss"]["activations"]
    h, tokens, L = 768, 128, 12
    # two fp32 noise tensors per block + one after the embeddings
    assert a - b == 4 * h * tokens * (2 * L + 1)


def test_llama_with_attention_dropout_is_not_flash():
    ms = model_spec_from_hf_config(os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json"))
    t = TrainSpec(method="lora", batch_size=1, seq_length=128, dtype="bf16")
    flash = estimate(ms, t).phase_breakdowns["loss"]["attention_scores"]
    math = estimate(ms.replace(attention_dropout=0.1), t).phase_breakdowns["loss"]["attention_scores"]
    assert flash == ms.num_layers * ms.num_heads * 4 * 128
    assert math == ms.num_layers * ms.num_heads * 12 * 128 * 128
