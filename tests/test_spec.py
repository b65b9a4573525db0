"""Model introspection (memguard_core.estimator): exact parameter counts by kind, block linears,
LoRA sizes, trainable counts and input validation.

Real architectures are built from their config numbers with random weights (no model hub here);
the big ones only on the meta device. bitsandbytes cannot quantize without CUDA on this machine,
so its 4-bit parameter is replaced by a named stand-in (see ``Params4bit`` below).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.estimator.numbers import model_spec_from_numbers  # noqa: E402
from memguard_core.estimator.specs import NF4_BITS, NF4_DOUBLE_QUANT_BITS, LinearShape, TrainSpec
from memguard_core.estimator.trainable import lora_trainable_params, trainable_params
from memguard_hf.model_spec import model_spec_from_hf_config
from memguard_torch.module_spec import model_spec_from_module

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def _llama_count(V, H, I, L, nh, kv, tied, qkv_bias=False):
    """Llama/Qwen2 parameter count by hand (independent of the code under test)."""
    hd = H // nh
    attn = H * nh * hd + 2 * H * kv * hd + nh * hd * H + ((nh + 2 * kv) * hd if qkv_bias else 0)
    block = attn + 3 * H * I + 2 * H
    return V * H * (1 if tied else 2) + L * block + H


# ---------------------------------------------------------------- published counts (meta device)

PUBLISHED = [
    # file, published parameter count (model cards / safetensors metadata)
    ("gpt2.json", 124_439_808),
    ("smollm2-135m.json", 134_515_008),
    ("qwen2.5-0.5b.json", 494_032_768),
    ("tinyllama-1.1b.json", 1_100_048_384),
    ("llama-3-8b.json", 8_030_261_248),
    ("llama-2-70b.json", 68_976_648_192),
]


@pytest.mark.parametrize("fname,published", PUBLISHED)
def test_real_configs_match_published_counts(fname, published):
    spec = model_spec_from_hf_config(os.path.join(CONFIGS, fname))
    assert spec.total_params == published
    assert spec.source == "hf-config"
    with open(os.path.join(CONFIGS, fname)) as fh:
        raw = json.load(fh)
    if raw["model_type"] in ("llama", "qwen2"):
        assert published == _llama_count(
            raw["vocab_size"], raw["hidden_size"], raw["intermediate_size"],
            raw["num_hidden_layers"], raw["num_attention_heads"], raw["num_key_value_heads"],
            raw["tie_word_embeddings"], qkv_bias=raw["model_type"] == "qwen2")
        assert spec.dense_bits == 16.0 and spec.weight_bits == 16.0  # torch_dtype bf16/fp16


def test_smollm2_numbers_and_tied_head():
    spec = model_spec_from_hf_config(os.path.join(CONFIGS, "smollm2-135m.json"))
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.vocab_size) == (576, 1536, 30, 49152)
    assert spec.tie_word_embeddings and spec.params.lm_head == 0
    assert spec.params.embeddings == 49152 * 576
    assert spec.params.norms == 61 * 576 and spec.params.norms_in_blocks == 60 * 576
    # mlx_lm full fine-tune trains the blocks: everything but the embedding and the final norm
    assert spec.params.blocks == 134_515_008 - 49152 * 576 - 576


def test_moe_config_matches_published_total_and_active():
    """Qwen1.5-MoE-A2.7B: published "14.3B parameters, 2.7B activated"."""
    spec = model_spec_from_hf_config(os.path.join(CONFIGS, "qwen1.5-moe-a2.7b.json"))
    H, L, E, k, Ie, S, V = 2048, 24, 60, 4, 1408, 5632, 151936
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (E, k, Ie)
    p = spec.params
    assert p.experts == L * E * 3 * H * Ie
    assert p.mlp == L * 3 * H * S                      # the shared expert is always active
    assert p.router == L * (E * H + H)                 # gate + shared_expert_gate
    assert p.attention == L * (4 * H * H + 3 * H)      # q/k/v biases
    assert p.embeddings == p.lm_head == V * H          # untied
    assert spec.total_params == 14_315_784_192
    assert round(spec.total_params / 1e9, 1) == 14.3
    active = p.total - p.experts + p.experts * k // E
    assert round(active / 1e9, 1) == 2.7
    experts = [lin for lin in spec.block_linears if lin.kind == "experts"]
    assert {lin.name for lin in experts} == {"gate_up_proj", "down_proj"}
    assert all(lin.count == E and lin.is_param for lin in experts)
    gate_up = next(lin for lin in experts if lin.name == "gate_up_proj")
    assert (gate_up.in_features, gate_up.out_features) == (H, 2 * Ie)


def test_70b_is_fast_and_allocates_nothing():
    psutil = pytest.importorskip("psutil")
    model_spec_from_hf_config(os.path.join(CONFIGS, "smollm2-135m.json"))  # imports warmed
    with open(os.path.join(CONFIGS, "llama-2-70b.json")) as fh:
        raw = json.load(fh)
    raw["rope_theta"] = 12345.0  # a config not seen before: no cache hit
    rss0 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    spec = model_spec_from_hf_config(raw)
    elapsed = time.perf_counter() - t0
    assert spec.total_params == 68_976_648_192
    assert elapsed < 3.0
    assert psutil.Process().memory_info().rss - rss0 < 512 * 2**20
    t0 = time.perf_counter()
    again = model_spec_from_hf_config(raw)
    assert time.perf_counter() - t0 < 0.2 and again.params == spec.params  # cached


def test_path_dir_dict_and_config_object_agree(tmp_path):
    src = os.path.join(CONFIGS, "qwen2.5-0.5b.json")
    shutil.copy(src, tmp_path / "config.json")
    with open(src) as fh:
        raw = json.load(fh)
    a = model_spec_from_hf_config(src)
    b = model_spec_from_hf_config(str(tmp_path))
    c = model_spec_from_hf_config(raw, name="q")
    d = model_spec_from_hf_config(AutoConfig.for_model(**raw))
    assert a.params == b.params == c.params == d.params
    assert a.block_linears == d.block_linears
    assert c.name == "q" and a.name == src


def test_quantization_bits():
    p = os.path.join(CONFIGS, "tinyllama-1.1b.json")
    assert model_spec_from_hf_config(p, quantization_bits=4).weight_bits == NF4_BITS == 4.5
    dq = model_spec_from_hf_config(p, quantization_bits=4, double_quant=True)
    assert dq.weight_bits == pytest.approx(4.127, abs=1e-3) and dq.dense_bits == 16.0
    with open(p) as fh:
        raw = json.load(fh)
    raw["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                  "bnb_4bit_use_double_quant": True}
    assert model_spec_from_hf_config(raw).weight_bits == NF4_DOUBLE_QUANT_BITS
    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(p, quantization_bits=3)
    assert ei.value.field == "quantization_bits"


# ----------------------------------------------------- tiny real instantiations vs the meta count

TINY = {
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=128,
                 bos_token_id=0, eos_token_id=0),
    "llama_gqa_untied": dict(model_type="llama", hidden_size=64, intermediate_size=96,
                             num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                             vocab_size=128, tie_word_embeddings=False),
    "llama_gqa_tied": dict(model_type="llama", hidden_size=64, intermediate_size=96,
                           num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                           vocab_size=128, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  tie_word_embeddings=True),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, shared_expert_intermediate_size=80,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=128, num_experts=4, num_experts_per_tok=2,
                      tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=4,
                      num_experts_per_tok=2, tie_word_embeddings=False),
}


def _real(key):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY[key]))


@pytest.mark.parametrize("key", sorted(TINY))
def test_meta_count_equals_real_instantiation(key):
    spec = model_spec_from_hf_config(dict(TINY[key]))
    model = _real(key)
    assert spec.total_params == model.num_parameters()
    live = model_spec_from_module(model)
    assert live.params == spec.params           # same classification on both routes
    assert live.block_linears == spec.block_linears
    assert live.tie_word_embeddings == spec.tie_word_embeddings
    assert live.trainable_params == model.num_parameters() and live.lora_rank_found is None
    assert live.dense_bits == live.weight_bits == 32.0
    p = spec.params
    assert p.other == 0
    # the block linears of one block, times the blocks, plus the block norms, are the blocks
    assert sum(lin.params for lin in spec.block_linears) * spec.num_layers + p.norms_in_blocks == p.blocks
    assert p.total == p.blocks + p.embeddings + p.lm_head + (p.norms - p.norms_in_blocks)


def test_tied_vs_untied_head():
    tied = model_spec_from_hf_config(dict(TINY["llama_gqa_tied"]))
    untied = model_spec_from_hf_config(dict(TINY["llama_gqa_untied"]))
    assert tied.params.lm_head == 0 and untied.params.lm_head == 128 * 64
    assert untied.total_params - tied.total_params == 128 * 64
    assert tied.total_params == _llama_count(128, 64, 96, 3, 8, 2, True)
    assert _real("llama_gqa_tied").num_parameters() == tied.total_params


def test_per_kind_llama_gqa():
    s = model_spec_from_hf_config(dict(TINY["llama_gqa_untied"]))
    H, I, L, nh, kv, V = 64, 96, 3, 8, 2, 128
    hd = H // nh
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (nh, kv, hd)
    assert s.params.attention == L * (2 * H * H + 2 * H * kv * hd)
    assert s.params.mlp == L * 3 * H * I
    assert s.params.norms == (2 * L + 1) * H and s.params.norms_in_blocks == 2 * L * H
    assert s.params.embeddings == V * H == s.params.lm_head
    names = {lin.name: lin for lin in s.block_linears}
    assert (names["k_proj"].in_features, names["k_proj"].out_features) == (H, kv * hd)
    assert (names["down_proj"].in_features, names["down_proj"].out_features) == (I, H)


def test_per_kind_gpt2_conv1d_and_position_embeddings():
    s = model_spec_from_hf_config(dict(TINY["gpt2"]))
    H, L, V, P = 64, 2, 128, 32
    assert s.params.embeddings == V * H + P * H          # wte + learned wpe
    assert s.params.attention == L * (H * 3 * H + 3 * H + H * H + H)
    assert s.params.mlp == L * (H * 4 * H + 4 * H + 4 * H * H + H)
    assert s.params.norms == (2 * L + 1) * 2 * H and s.params.lm_head == 0
    assert s.intermediate_size == 4 * H                 # n_inner=None -> 4 * n_embd
    c_attn = next(lin for lin in s.block_linears if lin.name == "c_attn")
    assert (c_attn.in_features, c_attn.out_features, c_attn.bias) == (H, 3 * H, True)
    c_fc = next(lin for lin in s.block_linears if lin.name == "c_fc")
    assert (c_fc.in_features, c_fc.out_features, c_fc.kind) == (H, 4 * H, "mlp")


def test_per_kind_qwen2_biases():
    s = model_spec_from_hf_config(dict(TINY["qwen2"]))
    bias = {lin.name: lin.bias for lin in s.block_linears}
    assert bias == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False,
                    "gate_proj": False, "up_proj": False, "down_proj": False}
    H, kv, hd, L = 64, 2, 16, 2
    assert s.params.attention == L * (2 * H * H + H + 2 * (H * kv * hd + kv * hd))


def test_per_kind_mixtral():
    s = model_spec_from_hf_config(dict(TINY["mixtral"]))
    H, I, L, E = 64, 48, 2, 4
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (E, 2, I)
    assert s.params.experts == L * E * 3 * H * I and s.params.mlp == 0
    assert s.params.router == L * E * H
    kinds = {lin.name: (lin.kind, lin.count, lin.in_features, lin.out_features)
             for lin in s.block_linears}
    assert kinds["gate"] == ("router", 1, H, E)
    assert kinds["gate_up_proj"] == ("experts", E, H, 2 * I)
    assert kinds["down_proj"] == ("experts", E, I, H)


def test_qwen3_moe_qk_norms_are_norms():
    s = model_spec_from_hf_config(dict(TINY["qwen3_moe"]))
    H, L, hd = 64, 2, 16
    assert s.params.norms_in_blocks == L * (2 * H + 2 * hd)   # two block norms + q_norm, k_norm


# --------------------------------------------------------------------------- LoRA vs PEFT

def _peft_trainable(model, **lora_kwargs):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(**lora_kwargs))
    return pm, pm.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("key,ours,theirs", [
    ("llama_gqa_untied", dict(lora_rank=8, lora_targets=("q_proj", "v_proj")),
     dict(r=8, target_modules=["q_proj", "v_proj"])),
    ("llama_gqa_untied", dict(lora_rank=4, lora_targets=("all-linear",)),
     dict(r=4, target_modules="all-linear")),
    ("llama_gqa_untied", dict(lora_rank=4, lora_targets=("q_proj", "k_proj", "down_proj"), lora_layers=2),
     dict(r=4, target_modules=["q_proj", "k_proj", "down_proj"], layers_to_transform=[1, 2])),
    ("qwen2", dict(lora_rank=16, lora_targets=("all-linear",)),
     dict(r=16, target_modules="all-linear")),
    ("gpt2", dict(lora_rank=4, lora_targets=("c_attn", "c_proj")),
     dict(r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)),
    ("mixtral", dict(lora_rank=4, lora_targets=("q_proj", "experts.gate_up_proj", "experts.down_proj")),
     dict(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"])),
    ("qwen2_moe", dict(lora_rank=4, lora_targets=("q_proj", "gate_proj", "down_proj")),
     dict(r=4, target_modules=["q_proj", "gate_proj", "down_proj"])),  # shared expert only
])
def test_lora_count_equals_peft(key, ours, theirs):
    spec = model_spec_from_hf_config(dict(TINY[key]))
    expected = lora_trainable_params(spec, TrainSpec(method="lora", **ours))
    _, got = _peft_trainable(_real(key), **theirs)
    assert expected == got
    assert trainable_params(spec, TrainSpec(method="lora", **ours)) == got


def test_lora_experts_only_when_named():
    spec = model_spec_from_hf_config(dict(TINY["mixtral"]))
    attn_only = lora_trainable_params(spec, TrainSpec(lora_rank=4, lora_targets=("all-linear",)))
    H, kv, hd, L = 64, 2, 16, 2
    assert attn_only == L * 4 * (2 * (H + H) + 2 * (H + kv * hd))   # r(in+out) of q, o, k, v only
    # a plain "down_proj" names no module in a transformers-5 Mixtral block (experts are fused)
    with pytest.raises(ConfigError) as ei:
        lora_trainable_params(spec, TrainSpec(lora_rank=4, lora_targets=("down_proj",)))
    assert ei.value.field == "lora_targets"


def test_model_spec_from_peft_module():
    from peft import LoraConfig, get_peft_model

    cfg_dict = TINY["llama_gqa_untied"]
    pm = get_peft_model(_real("llama_gqa_untied"),
                        LoraConfig(r=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    n_trainable, n_all = pm.get_nb_trainable_parameters()
    live = model_spec_from_module(pm)
    assert live.trainable_params == n_trainable
    assert live.lora_rank_found == 8
    assert live.adapter_params == n_trainable
    assert live.params.total + live.adapter_params == n_all
    ref = model_spec_from_hf_config(dict(cfg_dict))
    assert live.params == ref.params and live.block_linears == ref.block_linears
    ts = TrainSpec(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj", "o_proj"))
    assert trainable_params(live, ts) == n_trainable
    assert lora_trainable_params(live, ts) == n_trainable


def test_live_count_vs_method():
    model = _real("llama_gqa_untied")
    for name, p in model.named_parameters():
        if "layers.0." in name:
            p.requires_grad_(False)
    live = model_spec_from_module(model)
    frozen = sum(p.numel() for n, p in model.named_parameters() if "layers.0." in n)
    assert live.trainable_params == model.num_parameters() - frozen
    assert trainable_params(live, TrainSpec(method="full")) == live.trainable_params
    # a plain model before get_peft_model: the LoRA size is derived, not "everything trainable"
    lora = TrainSpec(method="lora", lora_rank=8, lora_targets=("q_proj",))
    assert trainable_params(live, lora) == 3 * 8 * (64 + 64)


def test_full_finetune_conventions():
    spec = model_spec_from_hf_config(dict(TINY["llama_gqa_untied"]))
    assert trainable_params(spec, TrainSpec(method="full", framework="hf")) == spec.total_params
    assert trainable_params(spec, TrainSpec(method="full", framework="lightning")) == spec.total_params
    assert trainable_params(spec, TrainSpec(method="full", framework="mlx")) == spec.params.blocks
    one = trainable_params(spec, TrainSpec(method="full", framework="mlx", lora_layers=1))
    assert one * 3 == spec.params.blocks
    model = _real("llama_gqa_untied")
    last = sum(p.numel() for n, p in model.named_parameters() if ".layers.2." in n)
    assert one == last


# ------------------------------------------------------------------- bitsandbytes 4-bit weights

class Params4bit(torch.nn.Parameter):
    """STAND-IN for bitsandbytes.nn.Params4bit (bitsandbytes cannot quantize without CUDA here).

    Only what memguard reads: the class name, a packed uint8 tensor of numel n/2 (two 4-bit
    values per byte, as bitsandbytes.functional.quantize_4bit stores them) and
    ``quant_state.shape`` / ``quant_state.nested`` (double quantization).
    """


def _quantize_blocks_standin(model, nested):
    for mod in model.model.layers.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            packed = torch.zeros(((w.numel() + 1) // 2, 1), dtype=torch.uint8)
            p = Params4bit(packed, requires_grad=False)
            p.quant_state = types.SimpleNamespace(shape=w.shape, nested=nested)
            mod.weight = p


@pytest.mark.parametrize("nested,bits", [(False, 4.5), (True, 4.127)])
def test_bnb_4bit_detection(nested, bits):
    ref = model_spec_from_hf_config(dict(TINY["llama_gqa_untied"]))
    model = _real("llama_gqa_untied").to(torch.bfloat16)
    _quantize_blocks_standin(model, nested)
    naive = sum(p.numel() for p in model.parameters())
    assert naive < ref.total_params          # packed storage under-counts ...
    live = model_spec_from_module(model)
    assert live.params == ref.params         # ... memguard counts the real weights
    assert live.weight_bits == pytest.approx(bits, abs=1e-3)
    assert live.dense_bits == 16.0


# ------------------------------------------------------------------------ numbers (seed API)

def test_numbers_equal_meta_count_for_llama_shapes():
    smol = model_spec_from_hf_config(os.path.join(CONFIGS, "smollm2-135m.json"))
    s = model_spec_from_numbers(134_515_008, hidden_dim=576, num_layers=30, num_heads=9,
                                num_kv_heads=3, vocab_size=49152, tie_word_embeddings=True)
    assert s.params == smol.params
    assert s.intermediate_size == 1536              # derived from the remainder
    assert s.block_linears == smol.block_linears
    ts = TrainSpec(lora_rank=16, lora_targets=("all-linear",), lora_layers=8)
    assert lora_trainable_params(s, ts) == lora_trainable_params(smol, ts)


def test_numbers_moe_equal_meta_count():
    mix = model_spec_from_hf_config(dict(TINY["mixtral"]))
    s = model_spec_from_numbers(mix.total_params, 64, 2, 4, 2, vocab_size=128, num_experts=4,
                                num_experts_per_tok=2)
    assert s.params == mix.params and s.moe_intermediate_size == 48 and s.is_moe
    ts = TrainSpec(lora_rank=4, lora_targets=("q_proj", "experts.gate_up_proj"))
    assert lora_trainable_params(s, ts) == lora_trainable_params(mix, ts)


@pytest.mark.parametrize("kw", [
    dict(model_params=9_000_000_000, hidden_dim=4096, num_layers=32, num_heads=32, model_bits=4),
    dict(model_params=7e9, hidden_dim=4096, num_layers=32, num_heads=32, intermediate_size=11008),
    dict(model_params=8_100_000_000, hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
         vocab_size=128256, intermediate_size=14336),
    dict(model_params=46_702_792_704, hidden_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
         num_experts=8, num_experts_per_tok=2),
])
def test_numbers_total_is_exact(kw):
    s = model_spec_from_numbers(**kw)
    assert s.total_params == int(kw["model_params"])
    assert s.source == "numbers" and s.params.other == 0


def test_numbers_bits():
    s = model_spec_from_numbers(9_000_000_000, 4096, 32, 32, model_bits=4)
    assert (s.weight_bits, s.dense_bits) == (4.5, 16.0)
    assert s.intermediate_size > 0
    s = model_spec_from_numbers(9_000_000_000, 4096, 32, 32, model_bits=32)
    assert (s.weight_bits, s.dense_bits) == (32.0, 32.0)
    assert model_spec_from_numbers(9_000_000_000, 4096, 32, 32, model_bits=4.127).weight_bits == 4.127


@pytest.mark.parametrize("kw,field", [
    (dict(model_params=0), "model_params"),
    (dict(model_params=1000), "model_params"),            # smaller than the embeddings
    (dict(hidden_dim=100), "hidden_dim"),                 # not divisible by 32 heads
    (dict(num_kv_heads=5), "num_kv_heads"),
    (dict(num_kv_heads=64), "num_kv_heads"),
    (dict(model_bits=7), "model_bits"),
    (dict(model_bits="4"), "model_bits"),
    (dict(num_layers=-1), "num_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts_per_tok=2), "num_experts_per_tok"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings"),
])
def test_numbers_bad_inputs(kw, field):
    base = dict(model_params=7_000_000_000, hidden_dim=4096, num_layers=32, num_heads=32)
    base.update(kw)
    with pytest.raises(ConfigError) as ei:
        model_spec_from_numbers(**base)
    assert ei.value.field == field


# ------------------------------------------------------------------------------ bad configs

def test_bad_config_inputs(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(str(missing))
    assert ei.value.field == "config" and "nope.json" in str(ei.value)

    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(str(tmp_path))          # a directory without config.json
    assert "config.json" in str(ei.value)

    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(str(bad))
    assert "bad.json" in str(ei.value) and "JSON" in str(ei.value)

    no_hidden = {k: v for k, v in TINY["llama_gqa_untied"].items() if k != "hidden_size"}
    p = tmp_path / "nohidden.json"
    p.write_text(json.dumps(no_hidden))
    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(str(p))
    assert "hidden_size" in ei.value.field and "nohidden.json" in ei.value.field

    no_embd = {k: v for k, v in TINY["gpt2"].items() if k != "n_embd"}
    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(no_embd)
    assert "hidden_size" in ei.value.field and "n_embd" in ei.value.field

    no_type = {k: v for k, v in TINY["llama_gqa_untied"].items() if k != "model_type"}
    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(no_type)
    assert "model_type" in ei.value.field

    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(dict(TINY["llama_gqa_untied"], model_type="not-a-model"))
    assert "model_type" in ei.value.field

    with pytest.raises(ConfigError) as ei:
        model_spec_from_hf_config(dict(TINY["llama_gqa_untied"], num_hidden_layers=0))
    assert ei.value.field == "num_hidden_layers"

    with pytest.raises(ConfigError):
        model_spec_from_hf_config(42)

    with pytest.raises(ConfigError) as ei:
        model_spec_from_module("not a module")
    assert ei.value.field == "model"


def test_linear_shape_params():
    lin = LinearShape("gate_up_proj", 64, 96, count=4, kind="experts", bias=True)
    assert lin.params == 4 * (64 * 96 + 96)


def test_model_spec_from_peft_module_with_fused_experts():
    """PEFT ``target_parameters`` wraps transformers-5 fused experts (lora_A is (r * E, in))."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(_real("mixtral"), LoraConfig(
        r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    live = model_spec_from_module(pm)
    ref = model_spec_from_hf_config(dict(TINY["mixtral"]))
    assert live.params == ref.params and live.block_linears == ref.block_linears
    assert live.lora_rank_found == 4
    assert live.trainable_params == pm.get_nb_trainable_parameters()[0]
    ts = TrainSpec(lora_rank=4, lora_targets=("q_proj", "experts.gate_up_proj", "experts.down_proj"))
    assert lora_trainable_params(live, ts) == live.trainable_params
