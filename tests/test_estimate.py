"""Estimator components against hand-computed values, monotonicity, and input validation.

The tiny spec used throughout (a Llama layout, counted by hand):
  vocab V=1000, hidden h=64, intermediate i=128, L=2 layers, 4 heads of 16, 2 kv heads (GQA).
  per block: q 64x64=4096, k 64x32=2048, v 64x32=2048, o 64x64=4096     -> attention 12288
             gate/up/down 3 x 64x128 = 24576                            -> mlp 24576
             2 RMSNorms x 64 = 128
  embeddings 1000x64 = 64000, untied lm_head 64000, final norm 64.
  total = 64000 + 2*12288 + 2*24576 + (2*128 + 64) + 64000 = 202048
"""

import json

import pytest

from memguard_core.errors import ConfigError
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.result import MemoryEstimate
from memguard_core.estimator.runtime import (HF_DATASETS_ANON_BYTES, HF_DATASETS_FILE_PAGES_BYTES, RUNTIME_OVERHEAD_BYTES,
                                             runtime_overhead_bytes)
from memguard_core.estimator.specs import NF4_BITS
from memguard_core.estimator.trainable import trainable_param_count
from memguard_core.estimator.specs import ModelSpec, ParamCounts, TrainSpec

TOTAL = 202048


def tiny(**kw) -> ModelSpec:
    p = ParamCounts(embeddings=64000, attention=2 * 12288, mlp=2 * 24576, norms=2 * 128 + 64,
                    norms_in_blocks=2 * 128, lm_head=64000)
    base = dict(name="tiny", model_type="llama", vocab_size=1000, hidden_size=64,
                intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                params=p, weight_bits=32.0, dense_bits=32.0)
    base.update(kw)
    return ModelSpec(**base)


def moe(experts=8, top_k=2) -> ModelSpec:
    h, i, L = 64, 96, 2
    p = ParamCounts(embeddings=1000 * h, attention=L * 12288, experts=L * experts * 3 * h * i,
                    router=L * experts * h, norms=L * 2 * h + h, norms_in_blocks=L * 2 * h,
                    lm_head=1000 * h)
    return tiny(params=p, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=i,
                intermediate_size=i, model_type="mixtral")


def ts(**kw) -> TrainSpec:
    base = dict(batch_size=2, seq_length=8, dtype="fp32", method="full", optimizer="adamw",
                device="cpu")
    base.update(kw)
    return TrainSpec(**base)


def test_param_total_is_the_hand_count():
    assert tiny().params.total == TOTAL


def test_full_fp32_adamw_components():
    e = estimate(tiny(), ts())
    opt = e.phase_breakdowns["optimizer"]
    bwd = e.phase_breakdowns["backward"]
    assert e.trainable_params == TOTAL
    assert opt["weights"] == TOTAL * 4 == 808192
    assert opt["gradients"] == TOTAL * 4                      # grads of every parameter, fp32
    assert opt["optimizer_states"] == 2 * 4 * TOTAL == 1616384  # exp_avg + exp_avg_sq, fp32
    assert opt["optimizer_temporaries"] == 0                   # fused AdamW
    # end of backward: tiny() has an untied head and grad_accum 1, so autograd steals both fresh
    # V x h gradients into .grad -- nothing beyond ``gradients`` (was 2 copies for every head; the
    # held-out untied Pythia measured 2508 MiB vs 2503 estimated without them, +17 % with them)
    assert bwd["backward_transients"] == 0
    assert e.phase_breakdowns["loss"]["backward_transients"] == 0
    assert opt["runtime_overhead"] == runtime_overhead_bytes(ts())  # + datasets' import when installed
    assert runtime_overhead_bytes(ts()) - RUNTIME_OVERHEAD_BYTES["cpu"] in (
        0, HF_DATASETS_ANON_BYTES + HF_DATASETS_FILE_PAGES_BYTES)


def test_embedding_gradient_transients_by_tied_head_and_accumulation():
    # EMBEDDING_GRAD_COPIES, V x h fp32 = 1000 x 64 x 4 = 256000 bytes:
    vh = 1000 * 64 * 4
    p_tied = ParamCounts(embeddings=64000, attention=2 * 12288, mlp=2 * 24576, norms=2 * 128 + 64,
                         norms_in_blocks=2 * 128, lm_head=0)
    tied = tiny(params=p_tied, tie_word_embeddings=True)
    # tied: the head's gradient waits in the shared AccumulateGrad's input buffer and is summed with
    # the embedding's dense gradient at the end: 2 tensors beyond .grad (Qwen3 measured 2.1)
    assert estimate(tied, ts()).phase_breakdowns["backward"]["backward_transients"] == 2 * vh
    # untied and accumulating: each new V x h gradient is added into .grad -- one copy at the end
    # (embedding) and one at the start of the backward (head), counted at the loss moment (TinyLlama
    # 2 x 2: both segments measured 250 MiB = V x h above the resident set at their ends)
    ga = estimate(tiny(), ts(grad_accum=2))
    assert ga.phase_breakdowns["backward"]["backward_transients"] == vh
    assert ga.phase_breakdowns["loss"]["backward_transients"] == vh
    # LoRA and MLX never train the embeddings
    assert estimate(tiny(), ts(method="lora")).phase_breakdowns["backward"]["backward_transients"] == 0
    mlx = estimate(tiny(), ts(framework="mlx", device="mlx"))
    assert mlx.phase_breakdowns["backward"]["backward_transients"] == 0


def test_opt_and_gpt_neox_block_activations_hand_computed():
    # Per token and block, fp32, sdpa, h 64, i 128, 4 heads (logsumexp 4 x 4 = 16 B):
    from memguard_core.estimator.activations import block_act_per_token
    from memguard_core.estimator.specs import LinearShape
    opt_lins = (LinearShape("q_proj", 64, 64, kind="attention"), LinearShape("k_proj", 64, 64, kind="attention"),
                LinearShape("v_proj", 64, 64, kind="attention"), LinearShape("out_proj", 64, 64, kind="attention"),
                LinearShape("fc1", 64, 128, kind="mlp"), LinearShape("fc2", 128, 64, kind="mlp"))
    opt = tiny(model_type="opt", block_linears=opt_lins, num_kv_heads=4)
    # OPT, LoRA q/v: LayerNorm input 256 + q/v input 256 + q, k, v 768 + SDPA output 256 +
    # 2 dropout noises (fp32 on CPU) 512 + post-attention LayerNorm input 256 + relu result 512
    # = 2816 hidden; x @ A of q and v: 2 x 8 x 4 = 64
    a = block_act_per_token(opt, ts(method="lora", lora_targets=("q_proj", "v_proj")), lora=True,
                             trainable_block=False)
    assert (a.hidden, a.scores, a.lora) == (2816, 16, 64)
    # the same on CUDA: the fused dropout keeps 1-byte masks: 2816 - 2 x 64 x 3 = 2432
    a = block_act_per_token(opt, ts(method="lora", lora_targets=("q_proj", "v_proj"), device="cuda"),
                             lora=True, trainable_block=False)
    assert a.hidden == 2432
    neox_lins = (LinearShape("query_key_value", 64, 192, kind="attention"),
                 LinearShape("dense", 64, 64, kind="attention"),
                 LinearShape("dense_h_to_4h", 64, 128, kind="mlp"), LinearShape("dense_4h_to_h", 128, 64, kind="mlp"))
    neox = tiny(model_type="gpt_neox", block_linears=neox_lins, num_kv_heads=4)
    # GPT-NeoX full fine-tune (parallel residual, no dropout, exact gelu): block input 256 + its
    # LayerNorm output 256 + q, k, v 768 + SDPA output 256 + merged heads for ``dense`` 256 + the
    # second LayerNorm's output 256 + gelu input 512 + gelu output 512 = 3072
    a = block_act_per_token(neox, ts(), lora=False, trainable_block=True)
    assert (a.hidden, a.scores) == (3072, 16)


def test_breakdown_sums_to_peak_and_json():
    for t in (ts(), ts(method="lora", dtype="bf16"), ts(device="cuda"), ts(device="mlx", framework="mlx")):
        e = estimate(tiny(), t)
        assert sum(e.breakdown.values()) == e.peak_bytes
        d = json.loads(json.dumps(e.to_dict()))
        assert d["peak_bytes"] == e.peak_bytes and isinstance(d["peak_bytes"], int)
        assert all(isinstance(v, int) for v in d["breakdown"].values())
        assert d["counter"] == t.device
    e = estimate(tiny(), ts(), correction=1.1)
    assert sum(e.breakdown.values()) == e.peak_bytes
    assert e.breakdown["calibration"] > 0


def test_optimizers():
    states = {o: estimate(tiny(), ts(optimizer=o)).phase_breakdowns["optimizer"]["optimizer_states"]
              for o in ("adamw", "adam", "sgd", "sgd-momentum", "adamw-8bit", "adafactor")}
    assert states["adam"] == states["adamw"] == 8 * TOTAL
    assert states["sgd"] == 0                    # HF "sgd": torch SGD without momentum
    assert states["sgd-momentum"] == 4 * TOTAL
    # 2 x 1 byte + fp32 absmax per 256 elements: 202048 * 2.03125 = 410410
    assert states["adamw-8bit"] == 410410
    # Adafactor, factored: per block sum(in+out) = 128+96+96+128+192+192+192 = 1024, x2 blocks;
    # block norms 2 x 128 full; embedding 1000+64, head 1000+64, final norm 64  -> 4496 fp32
    assert states["adafactor"] == 4 * (2 * 1024 + 256 + 1064 + 1064 + 64) == 17984


def test_lora_counts_and_weights():
    # LoRA r=8 on q (64->64) and v (64->32): 8*(64+64) + 8*(64+32) = 1792 per block, 2 blocks
    t = ts(method="lora", lora_rank=8, lora_targets=("q_proj", "v_proj"), dtype="bf16")
    m = tiny(weight_bits=16.0, dense_bits=16.0)
    assert trainable_param_count(m, t) == 3584
    e = estimate(m, t)
    # bf16 base (2 bytes) + fp32 adapters (PEFT autocast_adapter_dtype)
    assert e.breakdown["weights"] == TOTAL * 2 + 3584 * 4 == 418432
    assert e.phase_breakdowns["optimizer"]["gradients"] == 3584 * 4
    assert e.phase_breakdowns["optimizer"]["optimizer_states"] == 3584 * 8
    # lora_layers=1: only the last block
    assert trainable_param_count(m, t.replace(lora_layers=1)) == 1792
    # all-linear: q,k,v,o,gate,up,down: 8 * (128+96+96+128+192+192+192) = 8192 per block
    assert trainable_param_count(m, t.replace(lora_targets=("all-linear",))) == 2 * 8192


def test_qlora_quantizes_block_linears_only():
    m = tiny(weight_bits=16.0, dense_bits=16.0)
    e = estimate(m, ts(method="qlora", dtype="bf16"))
    block_linears = 2 * 12288 + 2 * 24576            # 73728 at 4.5 bits
    dense = TOTAL - block_linears                     # embeddings, head, norms at 16 bits
    assert e.breakdown["weights"] == int(block_linears * NF4_BITS / 8 + dense * 2) + 3584 * 4
    # a spec already quantized with double quant keeps its 4.127 bits
    e2 = estimate(m.replace(weight_bits=4.127), ts(method="qlora", dtype="bf16"))
    assert e2.breakdown["weights"] < e.breakdown["weights"]


def test_logits_term_hand_computed():
    # N = b*s*V = 2*8*1000 = 16000; loss moment holds the fp32 log_softmax output, the nll grad
    # and the log_softmax grad: 3 x 4 bytes x N
    e = estimate(tiny(), ts(method="lora"))
    assert e.phase_breakdowns["loss"]["logits"] == 12 * 16000
    # bf16 forward holds bf16 logits + fp32 copy + log_softmax (10 B) < 12 B of the backward start
    e = estimate(tiny(weight_bits=16.0, dense_bits=16.0), ts(method="lora", dtype="bf16"))
    assert e.phase_breakdowns["loss"]["logits"] == 12 * 16000


def test_lora_activations_hand_computed():
    # per token per block, fp32, sdpa, LoRA on q and v (bytes):
    #   input_layernorm fp32 input 4*64=256; q/v LoRA input (shared) 256; q 4*64=256; k 4*32=128;
    #   v 128; sdpa output 256; post-attn norm input 256; gate, up, act 3*4*128=1536  -> 3072
    #   logsumexp 4 bytes x 4 heads = 16 (attention_scores); LoRA x@A: 2 x 8 x 4 = 64
    # 16 tokens, 2 blocks; plus the final norm input 4*64*16 = 4096
    e = estimate(tiny(), ts(method="lora"))
    lb = e.phase_breakdowns["loss"]
    assert lb["activations"] == 3072 * 16 * 2 + 64 * 16 * 2 + 4096 == 104448
    assert lb["attention_scores"] == 16 * 16 * 2


def test_cpu_heap_slack_counts_lora_forward_temporaries():
    # HF on CPU, LoRA, loss moment: slack = 0.5 x (saved-activation traffic + logits working set
    # (a 64000-byte tensor, below the 32 MiB mmap threshold)) + 0.4 x LoRA forward temporaries of
    # at most LORA_TEMP_BLOCKS (2) blocks (LORA_TEMP_SLACK: the temporaries' holes are refilled).
    #   traffic = 3072*16*2 + 16*16*2 + 64*16*2 = 98304 + 512 + 2048 = 100864 (as above)
    #   logits  = 12 * 16000 = 192000
    #   LoRA temporaries (PEFT: lora_B output, scaled product, out-of-place sum, fp32), q (out 64)
    #   and v (out 32): 3 x 4 B x (64 + 32) x 16 tokens x 2 blocks = 36864
    #   0.5 x (100864 + 192000) + 0.4 x 36864 = 146432 + 14745.6 = 161177
    e = estimate(tiny(), ts(method="lora"))
    assert e.phase_breakdowns["loss"]["allocator_slack"] == 161177
    # a deeper model: the temporaries count for 2 blocks, not for every block
    from memguard_core.estimator.cpu_heap import lora_forward_traffic as lft
    deep = tiny(num_layers=8)
    assert lft(deep, ts(method="lora")) == lft(tiny(), ts(method="lora")) == 36864
    # bf16 base, fp32 adapters: 3 fp32 temporaries + the sum cast back to bf16 = 14 B per element:
    # 14 x 96 x 16 x 2 = 43008 of the slack's input
    e16 = estimate(tiny(weight_bits=16.0, dense_bits=16.0), ts(method="lora", dtype="bf16"))
    from memguard_core.estimator.cpu_heap import lora_forward_traffic
    assert lora_forward_traffic(e16.model_spec, e16.train_spec) == 43008
    # no term for full fine-tuning, MLX, or under checkpointing (nothing pins the heap there)
    assert lora_forward_traffic(tiny(), ts(method="lora", grad_checkpoint=True)) == 0
    assert lora_forward_traffic(tiny(), ts(method="full")) == 0
    assert lora_forward_traffic(tiny(), ts(method="lora", framework="mlx", device="mlx")) == 0


def test_mlx_full_fine_tune_window_norms_and_update():
    # mlx_lm full fine-tune of both blocks, fp32, 2 x 8 = 16 tokens, h 64, i 128, 4 heads, q 64,
    # kv 32; P = trainable bytes = 4 x (2 x 12288 + 2 x 24576 + 2 x 128) = 295936.
    m = tiny()
    e = estimate(m, ts(framework="mlx", device="mlx"))
    lo, opt = e.phase_breakdowns["loss"], e.phase_breakdowns["optimizer"]
    P = 4 * (2 * 12288 + 2 * 24576 + 2 * 128)
    # saved per block per token: 4 x (4h + 2q + 2kv + 5i) + the trained norms' normalised inputs
    # 4 x 2h = 4 x (256 + 128 + 64 + 640) + 512 = 4864; one-time window (full): 4 x (20h + 3i) =
    # 6656; probs 4 x 4 heads x 8 = 128 per block, + the attention backward's 2 score arrays
    assert lo["activations"] == 2 * 4864 * 16 + 6656 * 16 == 262144
    assert lo["attention_scores"] == 2 * 128 * 16 + 2 * 128 * 16 == 8192
    # the LoRA path keeps the LoRA constants (4 x (16h + 6i) = 7168) and no norm / score terms
    el = estimate(m, ts(framework="mlx", device="mlx", method="lora", lora_targets=("q_proj",)))
    assert el.phase_breakdowns["loss"]["activations"] == 2 * 4352 * 16 + 7168 * 16
    assert el.phase_breakdowns["loss"]["attention_scores"] == 2 * 128 * 16
    # end of the compiled step: gradient + new m, v, parameter of min(2, 2.25) blocks = 4 x P in
    # flight, the one-time window and the attention backward's scores; no block below the window
    assert opt["gradients"] == P and opt["optimizer_temporaries"] == 3 * P
    assert opt["optimizer_states"] == 2 * P
    assert opt["activations"] == 6656 * 16 and opt["attention_scores"] == 2 * 128 * 16
    # 6 blocks: the window stays at 2.25 blocks, the 3.75 blocks below it keep their saved arrays
    p6 = ParamCounts(embeddings=64000, attention=6 * 12288, mlp=6 * 24576, norms=6 * 128 + 64,
                     norms_in_blocks=6 * 128, lm_head=64000)
    e6 = estimate(tiny(num_layers=6, params=p6), ts(framework="mlx", device="mlx"))
    o6 = e6.phase_breakdowns["optimizer"]
    assert o6["gradients"] == int(4 * 2.25 * (12288 + 24576 + 128))
    assert o6["activations"] == int(6656 * 16 + 3.75 * (4864 + 128) * 16)
    # SGD in MLX keeps v = zeros_like(parameter) (mlx.optimizers.SGD.init_single): one state;
    # the new parameter mostly takes the gradient's buffer: 1.25 x the window
    es = estimate(m, ts(framework="mlx", device="mlx", optimizer="sgd"))
    assert es.phase_breakdowns["optimizer"]["optimizer_states"] == P
    assert es.phase_breakdowns["optimizer"]["optimizer_temporaries"] == int(0.25 * P)
    # HF's SGD (torch, no momentum) keeps no state
    assert estimate(m, ts(optimizer="sgd")).phase_breakdowns["optimizer"]["optimizer_states"] == 0


def test_mlx_full_trains_blocks_only():
    m = tiny()
    blocks = 2 * 12288 + 2 * 24576 + 2 * 128
    assert trainable_param_count(m, ts(framework="mlx", device="mlx")) == blocks
    assert trainable_param_count(m, ts(framework="hf")) == TOTAL


def test_monotone_in_batch_and_seq():
    m = tiny()
    for method in ("full", "lora"):
        peaks = [estimate(m, ts(method=method, batch_size=b, seq_length=64)).peak_bytes for b in (1, 2, 4, 8)]
        assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
        peaks = [estimate(m, ts(method=method, batch_size=2, seq_length=s)).peak_bytes for s in (16, 64, 256, 1024)]
        assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_checkpointing_and_attention_impl():
    m = tiny()
    t = ts(method="lora", batch_size=4, seq_length=512)
    a = estimate(m, t).phase_breakdowns["loss"]
    g = estimate(m, t.replace(grad_checkpoint=True)).phase_breakdowns["loss"]
    assert g["activations"] + g["attention_scores"] < a["activations"] + a["attention_scores"]
    # checkpointing keeps L block inputs (4*64 bytes per token each) + one recomputed block + head
    assert g["activations"] >= 2 * 4 * 64 * 4 * 512
    eager = estimate(m, t.replace(attn_impl="eager"))
    sdpa = estimate(m, t)
    assert sdpa.peak_bytes <= eager.peak_bytes
    # eager keeps the fp32 softmax: heads x s^2 x 4 bytes per row and block, and the b x s^2 mask
    assert eager.phase_breakdowns["loss"]["attention_scores"] >= 2 * 4 * 4 * 512 * 512 * 4


def test_moe_counts_active_experts_only():
    t = ts(method="lora", batch_size=2, seq_length=128)
    a8 = estimate(moe(8, 2), t).phase_breakdowns["loss"]["activations"]
    a32 = estimate(moe(32, 2), t).phase_breakdowns["loss"]["activations"]
    a8k4 = estimate(moe(8, 4), t).phase_breakdowns["loss"]["activations"]
    # more experts (same top-k): only the router logits grow (E x (4 + 4) bytes per token per block)
    assert a32 - a8 == (32 - 8) * 8 * 256 * 2
    # top-k 2 -> 4: per extra (token, expert) pair gate_up + act (3i) and the down output (h), fp32
    assert a8k4 - a8 == 2 * 4 * (3 * 96 + 64) * 256 * 2


def test_gqa_uses_kv_heads():
    t = ts(method="lora", batch_size=2, seq_length=64)
    gqa = estimate(tiny(num_kv_heads=2), t).phase_breakdowns["loss"]["activations"]
    mha = estimate(tiny(num_kv_heads=4), t).phase_breakdowns["loss"]["activations"]
    # k and v: 2 x (64 - 32) x 4 bytes per token per block
    assert mha - gqa == 2 * 32 * 4 * 128 * 2


def test_mixed_precision_and_master_weights():
    m32 = tiny()
    amp = estimate(m32, ts(dtype="bf16", mixed_precision=True))
    assert amp.phase_breakdowns["loss"]["weight_copies"] > 0     # autocast bf16 weight casts
    assert amp.breakdown["master_weights"] == 0                  # fp32 weights are the masters
    # a live bf16 module trained with fp32 masters (accelerate / DeepSpeed bf16): only a spec read
    # from a module keeps half weights under mixed precision (weights_for_training)
    m16 = tiny(weight_bits=16.0, dense_bits=16.0, source="module")
    masters = estimate(m16, ts(dtype="bf16", mixed_precision=True))
    assert masters.phase_breakdowns["optimizer"]["master_weights"] == 4 * TOTAL
    plain = estimate(m16, ts(dtype="bf16"))
    assert plain.phase_breakdowns["optimizer"]["master_weights"] == 0
    assert plain.phase_breakdowns["optimizer"]["optimizer_states"] == 2 * 2 * TOTAL  # bf16 states


def test_counters_differ_by_overhead():
    m = tiny()
    cpu = estimate(m, ts(device="cpu"))
    mlx = estimate(m, ts(device="mlx", framework="mlx"))
    cuda = estimate(m, ts(device="cuda"))
    assert cpu.counter == "cpu" and mlx.counter == "mlx" and cuda.counter == "cuda"
    assert mlx.breakdown["runtime_overhead"] == 0
    assert cuda.breakdown["runtime_overhead"] == RUNTIME_OVERHEAD_BYTES["cuda"]
    assert cuda.breakdown["allocator_slack"] > 0


def test_bad_inputs():
    with pytest.raises(ConfigError) as ei:
        estimate({"hidden_size": 64}, ts())
    assert ei.value.field == "model_spec"
    with pytest.raises(ConfigError) as ei:
        estimate(tiny(), {"batch_size": 1})
    assert ei.value.field == "train_spec"
    with pytest.raises(ConfigError):
        estimate(tiny(), ts(), correction=0)
    with pytest.raises(ConfigError) as ei:
        estimate(tiny(), ts(method="lora", lora_targets=("nope",)))
    assert ei.value.field == "lora_targets"
    with pytest.raises(ConfigError):
        estimate(tiny(weight_bits=4.5, dense_bits=16.0), ts(method="full", dtype="bf16"))
    with pytest.raises(ConfigError):
        estimate(tiny(hidden_size=0), ts())


def test_measured_file_pages_replace_the_typical_figure():
    from memguard_core.estimator.runtime import CPU_FILE_PAGES_AT_START_BYTES

    MiB = 2**20
    ms = tiny()
    base = ts(framework="lightning")
    typical = base.replace(resident_file_bytes=CPU_FILE_PAGES_AT_START_BYTES)
    fresh = base.replace(resident_file_bytes=CPU_FILE_PAGES_AT_START_BYTES + 99 * MiB)
    assert runtime_overhead_bytes(typical) == runtime_overhead_bytes(base)
    assert runtime_overhead_bytes(fresh) - runtime_overhead_bytes(base) == 99 * MiB
    assert estimate(ms, fresh).peak_bytes - estimate(ms, base).peak_bytes == 99 * MiB
    # only where it was measured: the MLX counter has no runtime term
    mlx = TrainSpec(framework="mlx", device="mlx", resident_file_bytes=500 * MiB)
    assert runtime_overhead_bytes(mlx) == RUNTIME_OVERHEAD_BYTES["mlx"]


@pytest.mark.parametrize("installed", [True, False])
def test_datasets_pages_counted_once(monkeypatch, installed):
    """An HF Trainer process with ``datasets`` importable holds its anonymous memory and maps its
    libraries; a measured mapped-file figure already holds those libraries, so only the anonymous
    part is added to it (the detection of the installed package is the faked boundary)."""
    from memguard_core.estimator import runtime

    MiB = 2**20
    monkeypatch.setattr(runtime, "_DATASETS_INSTALLED", installed)
    ds = int(installed)
    assert runtime_overhead_bytes(ts()) == RUNTIME_OVERHEAD_BYTES["cpu"] + ds * (
        HF_DATASETS_ANON_BYTES + HF_DATASETS_FILE_PAGES_BYTES)
    measured = ts(resident_file_bytes=runtime.CPU_FILE_PAGES_AT_START_BYTES + ds * HF_DATASETS_FILE_PAGES_BYTES)
    assert runtime_overhead_bytes(measured) == runtime_overhead_bytes(ts())
    assert runtime_overhead_bytes(ts(framework="lightning", resident_file_bytes=200 * MiB)) == \
        RUNTIME_OVERHEAD_BYTES["cpu"] + 200 * MiB - runtime.CPU_FILE_PAGES_AT_START_BYTES


@pytest.mark.parametrize("bad", [-1, 1.5, "128", True])
def test_resident_file_bytes_validated(bad):
    with pytest.raises(ConfigError, match="resident_file_bytes"):
        TrainSpec(resident_file_bytes=bad)


def test_process_file_resident_bytes_reads_rssfile():
    import sys

    from memguard_core.stats import process_file_resident_bytes
    MiB = 2**20
    got = process_file_resident_bytes()
    if sys.platform.startswith("linux"):
        assert got is not None and got > MiB   # the interpreter and its libraries are mapped
    else:  # pragma: no cover - other platforms
        assert got is None


def _gpt2_like(**kw) -> ModelSpec:
    """GPT-2's published config (openai-community/gpt2: 12 heads of 64, vocab 50257, tied; attention
    dropout ``attn_pdrop`` 0.1, which sends SDPA on the CPU down its math path: score-sized fp32
    tensors), read by the config reader."""
    import dataclasses

    from memguard_hf.model_spec import model_spec_from_hf_config
    cfg = dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024,
               attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, torch_dtype="float32")
    return dataclasses.replace(model_spec_from_hf_config(cfg), **kw)


def test_cpu_heap_slack_leaves_out_score_tensors_glibc_mmaps():
    # glibc mmaps every request >= its mmap threshold (32 MiB at most) and unmaps it on free: such
    # tensors leave no hole in the heap, so the heap-slack traffic counts score-sized tensors only
    # while each of them is below MMAP_THRESHOLD_MAX (SDPA's CPU math path: fp32 per score)
    from memguard_core.estimator.activations import activation_bytes
    from memguard_core.estimator.cpu_heap import MMAP_THRESHOLD_MAX, activation_traffic, _score_tensors_mmapped
    m = _gpt2_like()
    for b, s in ((1, 256), (2, 512), (1, 1024), (2, 1024)):
        t = ts(method="lora", lora_targets=("c_attn",), batch_size=b, seq_length=s)
        h, sc, lo, _ = activation_bytes(m, t)
        assert sc > 0
        big = b * 12 * s * s * 4 >= MMAP_THRESHOLD_MAX
        assert _score_tensors_mmapped(m, t) is big
        assert activation_traffic(m, t) == (h + lo if big else h + sc + lo)
    # 1 x 12 x 1024^2 x 4 B = 48 MiB per score tensor: above; 2 x 12 x 512^2 x 4 = 24 MiB: below
    assert _score_tensors_mmapped(m, ts(batch_size=1, seq_length=1024))
    assert not _score_tensors_mmapped(m, ts(batch_size=2, seq_length=512))
    # the fused SDPA kernel (no attention dropout) saves a per-head logsumexp only: never mmapped
    assert not _score_tensors_mmapped(_gpt2_like(attention_dropout=0.0), ts(batch_size=8, seq_length=1024))
    # so the loss moment's slack stops growing with the score tensors once they are mmapped: from
    # s = 1024 to 2 x 1024 only the hidden-sized traffic (linear in tokens) is added
    t1 = ts(method="lora", lora_targets=("c_attn",), batch_size=1, seq_length=1024)
    e1, e2 = estimate(m, t1), estimate(m, t1.replace(batch_size=2))
    h1, _, lo1, _ = activation_bytes(m, t1)
    assert activation_traffic(m, t1.replace(batch_size=2)) == 2 * (h1 + lo1)
    assert e2.phase_breakdowns["loss"]["attention_scores"] == 2 * e1.phase_breakdowns["loss"]["attention_scores"]


def test_checkpointed_slack_is_the_forward_heap_or_the_last_steps_gradient_holes():
    # Under activation checkpointing the backward never holds every block's activations at once
    # (one block is recomputed at a time), so no moment's heap slack is the un-checkpointed traffic
    # of all blocks: every moment gets the checkpointed factor of it. A plain run (heap_trim=False)
    # also keeps the holes of the last step's gradients (freed by zero_grad(set_to_none=True); the
    # next forward runs inside them and the new gradients, the same sizes, take fresh heap) when
    # they are larger; a run that trims the heap at each step's end (the guard) handed them back
    # A trimmed full fine-tune's loss moment is the exception: one block's traffic, scaled by
    # CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS (the trim handed the last backward's heap back and the
    # checkpointed forward touches about one block's working set again).
    from memguard_core.estimator.cpu_heap import (CPU_HEAP_SLACK_BACKWARD, CPU_HEAP_SLACK_CHECKPOINTED,
                                                  CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS, activation_traffic,
                                                  heap_gradient_bytes)
    from memguard_core.estimator.gradients import grad_layers
    m = tiny()
    for method, tokens in (("full", (1, 16)), ("full", (4, 256)), ("lora", (4, 256))):
        for trim in (False, True):
            t = ts(method=method, batch_size=tokens[0], seq_length=tokens[1], grad_checkpoint=True, heap_trim=trim)
            e = estimate(m, t)
            pb = e.phase_breakdowns
            heap_grads = heap_gradient_bytes(e.model_spec, t, pb["backward"]["gradients"], 4)
            # every tensor of the tiny model is small: all its gradients are on the heap
            assert heap_grads == pb["backward"]["gradients"] > 0
            kind = "full" if method == "full" else "lora"
            # the fitted checkpointed factor of the un-checkpointed traffic and the logits' working
            # set (small here, so on the heap); no LoRA temporaries under checkpointing
            forward = int(CPU_HEAP_SLACK_CHECKPOINTED[kind] * (activation_traffic(m, t) + pb["loss"]["logits"]))
            one_block = activation_traffic(m, t) / grad_layers(m, t)
            for k in ("loss", "backward", "optimizer"):
                want = forward if trim else max(forward, heap_grads)
                if trim and kind == "full" and k == "loss":
                    want = int(CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS * one_block
                               + CPU_HEAP_SLACK_CHECKPOINTED[kind] * pb["loss"]["logits"])
                assert pb[k]["allocator_slack"] == want, (method, tokens, trim, k)
    # a short row of a plain full fine-tune: the gradients' holes dominate; a long one: the forward's
    short = estimate(m, ts(method="full", batch_size=1, seq_length=16, grad_checkpoint=True, heap_trim=False))
    assert short.phase_breakdowns["backward"]["allocator_slack"] == short.phase_breakdowns["backward"]["gradients"]
    trimmed = estimate(m, ts(method="full", batch_size=1, seq_length=16, grad_checkpoint=True))
    assert trimmed.phase_breakdowns["backward"]["allocator_slack"] < short.phase_breakdowns["backward"]["allocator_slack"]
    assert trimmed.peak_bytes < short.peak_bytes
    long_ = estimate(m, ts(method="full", batch_size=8, seq_length=1024, grad_checkpoint=True, heap_trim=False))
    assert long_.phase_breakdowns["backward"]["allocator_slack"] > long_.phase_breakdowns["backward"]["gradients"]
    # without checkpointing the backward keeps the fitted factor of the whole traffic
    t = ts(method="full", batch_size=4, seq_length=256)
    u = estimate(m, t)
    assert u.phase_breakdowns["backward"]["allocator_slack"] == int(
        CPU_HEAP_SLACK_BACKWARD["full"] * activation_traffic(m, t))
    assert u.phase_breakdowns["backward"]["allocator_slack"] > estimate(
        m, t.replace(grad_checkpoint=True)).phase_breakdowns["backward"]["allocator_slack"]


def test_heap_gradient_bytes_leave_out_mmapped_tensors():
    from memguard_core.estimator.cpu_heap import MMAP_THRESHOLD_MAX, heap_gradient_bytes
    # a vocabulary large enough that V x h x 2 B >= 32 MiB: the embedding's gradient is mmapped
    V, h = 50000, 512
    assert V * h * 2 >= MMAP_THRESHOLD_MAX
    for tied in (True, False):
        m = tiny(vocab_size=V, hidden_size=h, num_heads=8, num_kv_heads=8, head_dim=64,
                 tie_word_embeddings=tied, weight_bits=16.0, dense_bits=16.0)
        t = ts(method="full", dtype="bf16")
        grads = 10 * V * h * 2
        assert heap_gradient_bytes(m, t, grads, 2) == grads - (1 if tied else 2) * V * h * 2
        # in fp32 the block linears stay small too; LoRA's adapters are all small
        assert heap_gradient_bytes(m, t.replace(method="lora"), 12345, 4) == 12345
    # a block linear of 32 MiB or more (8192 x 2048 in bf16) is mmapped, in every block
    big = tiny(intermediate_size=8192, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
               vocab_size=1000, weight_bits=16.0, dense_bits=16.0)
    g = heap_gradient_bytes(big, ts(method="full", dtype="bf16"), 10 ** 10, 2)
    assert g == 10 ** 10 - 3 * 2048 * 8192 * 2 * 2
