"""CUDA rules of the estimator: the SDPA kernel torch picks, what it saves, the caching allocator's
rounding, the counters a published figure can be; bitsandbytes (QLoRA / LLM.int8) storage and
saved tensors. Analytic: no GPU needed."""

from __future__ import annotations

import math
import os

import pytest

from memguard_core.estimator.bnb import bnb_last_step_inputs, bnb_saved_inputs
from memguard_core.estimator.optimizer import optimizer_state_bytes
from memguard_core.estimator.weights import dequant_transient_bytes
from memguard_core.estimator.bnb import bnb_4bit_keeps_input
from memguard_core.estimator.cuda import (CUDA_CONTEXT_BYTES, CUDA_CUBLAS_WORKSPACES_BYTES, cuda_block_bytes, cuda_counter_bytes, cuda_sdpa_backend, cuda_segment_bytes)
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.optimizer import paged_state_bytes
from memguard_core.estimator.runtime import RUNTIME_OVERHEAD_BYTES, runtime_overhead_bytes
from memguard_core.estimator.weights import nf4_storage_bytes
from memguard_core.errors import ConfigError
from memguard_core.estimator.specs import NF4_BITS, NF4_DOUBLE_QUANT_BITS, TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config

HERE = os.path.join(os.path.dirname(__file__), "configs")
PHI = os.path.join(HERE, "phi-1_5.json")
LLAMA3 = os.path.join(HERE, "llama-3-8b.json")
MiB = 1 << 20


def _cuda(**kw) -> TrainSpec:
    base = dict(batch_size=1, seq_length=1044, method="lora", dtype="bf16", device="cuda",
                framework="lightning")
    base.update(kw)
    return TrainSpec(**base)


def test_phi_on_cuda_keeps_no_score_matrix():
    # phi-1.5: attention_dropout 0.0, head dim 64, bf16: the flash kernel, which saves an fp32
    # logsumexp per head and query -- nothing of size s x s
    ms = model_spec_from_hf_config(PHI)
    assert ms.attention_dropout == 0.0 and ms.head_dim == 64
    ts = _cuda(lora_targets=("q_proj", "v_proj"))
    assert cuda_sdpa_backend(ms, ts) == "flash"
    est = estimate(ms, ts)
    scores = est.phase_breakdowns["loss"]["attention_scores"]
    assert scores == ms.num_layers * ms.num_heads * 4 * 1044
    # the math path would keep fp32 probabilities: layers x heads x s x s x 4 bytes (3.9 GiB here)
    assert scores * 1000 < ms.num_layers * ms.num_heads * 1044 * 1044 * 4
    assert "cuda: SDPA kernel flash" in est.notes


def test_attention_dropout_does_not_force_math_on_cuda():
    ms = model_spec_from_hf_config(PHI).replace(attention_dropout=0.1)
    for dtype in ("bf16", "fp16"):
        assert cuda_sdpa_backend(ms, _cuda(dtype=dtype)) == "flash"
    # fp32 has no flash kernel: memory-efficient (head dim 64 divisible by 4), also with dropout
    assert cuda_sdpa_backend(ms, _cuda(dtype="fp32")) == "efficient"
    # the same settings on CPU still take the math path (sdp_utils_cpp.cpp check_for_dropout)
    cpu = estimate(ms, _cuda(device="cpu", framework="hf")).phase_breakdowns["loss"]["attention_scores"]
    assert cpu >= ms.num_layers * ms.num_heads * 1044 * 1044 * 12


def test_backend_selection_rules():
    ms = model_spec_from_hf_config(PHI)
    assert cuda_sdpa_backend(ms, _cuda(attn_impl="eager")) == "eager"
    assert cuda_sdpa_backend(ms, _cuda(attn_impl="flash")) == "flash"
    # head dim above 256: no flash; 512 divisible by 8 -> memory-efficient
    assert cuda_sdpa_backend(ms.replace(head_dim=512), _cuda()) == "efficient"
    # fp32 with a head dim not divisible by 4: math, whose probabilities are saved (s x s)
    odd = ms.replace(head_dim=66)
    assert cuda_sdpa_backend(odd, _cuda(dtype="fp32")) == "math"
    # autocast: the half compute dtype decides
    assert cuda_sdpa_backend(ms, _cuda(dtype="bf16", mixed_precision=True)) == "flash"


def test_memory_efficient_logsumexp_is_padded_to_32_queries():
    ms = model_spec_from_hf_config(PHI)
    ts = _cuda(dtype="fp32", seq_length=100)
    assert cuda_sdpa_backend(ms, ts) == "efficient"
    scores = estimate(ms, ts).phase_breakdowns["loss"]["attention_scores"]
    assert scores == ms.num_layers * ms.num_heads * 4 * 128


def test_caching_allocator_rounding():
    assert cuda_block_bytes(1) == 512 and cuda_block_bytes(512) == 512 and cuda_block_bytes(513) == 1024
    assert cuda_segment_bytes(1) == 2 * MiB and cuda_segment_bytes(MiB) == 2 * MiB
    assert cuda_segment_bytes(MiB + 1) == 20 * MiB and cuda_segment_bytes(9 * MiB) == 20 * MiB
    assert cuda_segment_bytes(10 * MiB) == 10 * MiB and cuda_segment_bytes(11 * MiB + 1) == 12 * MiB


def test_context_and_cublas_workspaces():
    # a GPU not read: Hopper's 32 MiB cuBLAS + 1 MiB cuBLASLt workspace, forward + backward threads
    # (an H200 run held 33 MiB per thread)
    assert CUDA_CUBLAS_WORKSPACES_BYTES == 2 * 33 * MiB
    assert RUNTIME_OVERHEAD_BYTES["cuda"] == CUDA_CONTEXT_BYTES + CUDA_CUBLAS_WORKSPACES_BYTES
    assert runtime_overhead_bytes(_cuda()) == RUNTIME_OVERHEAD_BYTES["cuda"]
    # the run's GPU read (an A100's default :4096:2:16:8 + 1 MiB): two of that, and the estimate
    # moves by exactly the difference
    a100 = (2 * 4096 + 8 * 16) * 1024 + MiB
    assert runtime_overhead_bytes(_cuda(cublas_workspace_bytes=a100)) == CUDA_CONTEXT_BYTES + 2 * a100
    ms = model_spec_from_hf_config(LLAMA3)
    hopper, read = estimate(ms, _cuda(seq_length=512)), estimate(ms, _cuda(seq_length=512, cublas_workspace_bytes=a100))
    assert hopper.breakdown["runtime_overhead"] - read.breakdown["runtime_overhead"] == 2 * (33 * MiB - a100)
    with pytest.raises(ConfigError, match="cublas_workspace_bytes"):
        _cuda(cublas_workspace_bytes=-1)


def test_cuda_counters_nest():
    ms = model_spec_from_hf_config(LLAMA3)
    est = estimate(ms, _cuda(seq_length=512))
    smi = cuda_counter_bytes(est, "nvidia-smi")
    reserved = cuda_counter_bytes(est, "max_memory_reserved")
    allocated = cuda_counter_bytes(est, "max_memory_allocated")
    assert smi == est.peak_bytes
    assert reserved == smi - CUDA_CONTEXT_BYTES
    assert allocated == reserved - est.breakdown["allocator_slack"]
    with pytest.raises(ConfigError):
        cuda_counter_bytes(est, "rss")
    with pytest.raises(ConfigError):
        cuda_counter_bytes(estimate(ms, _cuda(device="cpu", framework="hf")), "nvidia-smi")


@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (14336, 4096), (8192, 2048)])
def test_nf4_storage_matches_bitsandbytes_quantize_4bit(shape):
    n = shape[0] * shape[1]
    blocks = math.ceil(n / 64)
    # bitsandbytes functional.quantize_4bit: uint8 (n + 1) // 2, fp32 absmax per 64, 16-entry code
    assert nf4_storage_bytes(n) == (n + 1) // 2 + 4 * blocks + 64
    # double quant: uint8 absmax + fp32 absmax per 256 blocks + 256-entry fp32 code + fp32 offset
    assert nf4_storage_bytes(n, double_quant=True) == (n + 1) // 2 + 64 + blocks + 4 * math.ceil(blocks / 256) + 1024 + 4
    # the per-weight bits the QLoRA paper gives, up to the per-tensor constants
    assert nf4_storage_bytes(n) * 8 / n == pytest.approx(NF4_BITS, rel=1e-3)
    assert nf4_storage_bytes(n, True) * 8 / n == pytest.approx(NF4_DOUBLE_QUANT_BITS, rel=1e-3)


def test_qlora_linears_save_their_inputs():
    # bitsandbytes MatMul4Bit keeps ctx.tensors = (A, B): every quantized linear's input stays,
    # one tensor per shared input (q/k/v; gate/up), in the compute dtype
    ms = model_spec_from_hf_config(LLAMA3)
    h, i, qd = ms.hidden_size, ms.intermediate_size, ms.num_heads * ms.head_dim
    qlora = _cuda(method="qlora", seq_length=512, lora_targets=("q_proj", "v_proj"))
    assert bnb_saved_inputs(ms, qlora, lora=True) == 2 * (h + qd + h + i)
    lora = qlora.replace(method="lora")
    assert bnb_saved_inputs(ms, lora, lora=True) == 0
    a_q = estimate(ms, qlora).phase_breakdowns["loss"]["activations"]
    a_l = estimate(ms, lora).phase_breakdowns["loss"]["activations"]
    assert a_q - a_l == ms.num_layers * 512 * 2 * (h + qd + h + i)
    # fp32 compute: PEFT's lora_A saves the very input of q/k/v, so only o, gate/up, down add
    fp32 = qlora.replace(dtype="fp32")
    assert bnb_saved_inputs(ms, fp32, lora=True) == 4 * (qd + h + i)
    # MLX quantization is not bitsandbytes
    assert bnb_saved_inputs(ms, qlora.replace(framework="mlx", device="mlx"), lora=True) == 0


def test_qlora_dequantizes_one_weight_at_a_time():
    ms = model_spec_from_hf_config(LLAMA3)
    big = ms.intermediate_size * ms.hidden_size
    ts = _cuda(method="qlora", seq_length=512)
    assert dequant_transient_bytes(ms, ts) == 2 * big
    dq = model_spec_from_hf_config(LLAMA3, quantization_bits=4, double_quant=True)
    assert dequant_transient_bytes(dq, ts) == 2 * big + 4 * math.ceil(big / 64)
    est = estimate(ms, ts)
    assert est.phase_breakdowns["loss"]["weight_copies"] == 2 * big
    assert dequant_transient_bytes(ms, ts.replace(method="lora")) == 0


def test_paged_optimizer_states_only_for_large_tensors():
    # bitsandbytes get_state_buffer pages a tensor's state only from 1e5 elements on
    ms = model_spec_from_hf_config(LLAMA3)
    small = _cuda(method="qlora", lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert paged_state_bytes(ms, small) == 0            # 8 x 4096 = 32768 elements per tensor
    big = small.replace(lora_rank=64)                   # 64 x 4096 = 262144; B of v: 1024 x 64
    n = ms.num_layers * (64 * 4096 + 4096 * 64 + 64 * 4096)  # q: A and B; v: A (B is 65536)
    assert paged_state_bytes(ms, big) == 8 * n
    est = estimate(ms, big)
    assert (cuda_counter_bytes(est, "max_memory_allocated", paged=True)
            < cuda_counter_bytes(est, "max_memory_allocated"))


def test_llm_int8_linears_save_their_inputs_too():
    # bitsandbytes MatMul8bitLt: ctx.tensors = (CAt, subA, A) -- A kept; the forward's int8 copy of
    # the input and the int32 product are transients
    ms = model_spec_from_hf_config(LLAMA3, quantization_bits=8)
    assert ms.weight_bits == 8
    h, i, qd = ms.hidden_size, ms.intermediate_size, ms.num_heads * ms.head_dim
    ts = _cuda(method="lora", seq_length=512, lora_targets=("q_proj", "v_proj"))
    assert bnb_saved_inputs(ms, ts, lora=True) == 2 * (h + qd + h + i)
    tokens = 512
    assert dequant_transient_bytes(ms, ts) == max(tokens * (h + 4 * i), tokens * (i + 4 * h), tokens * (h + 4 * qd))


@pytest.mark.parametrize("version,kept", [(None, True), ("0.41.1", True), ("0.42.0", True), ("0.43.1", True),
                                          ("0.43.2", False), ("0.44.1", False), ("0.45.0.dev0", False),
                                          ("1.0", False)])
def test_4bit_input_kept_only_before_bitsandbytes_0_43_2(version, kept):
    # bitsandbytes 9e75374 (#1270, first in 0.43.2): MatMul4Bit keeps ctx.tensors = (None, B)
    ms = model_spec_from_hf_config(LLAMA3)
    h, i, qd = ms.hidden_size, ms.intermediate_size, ms.num_heads * ms.head_dim
    ts = _cuda(method="qlora", seq_length=512, bnb_version=version)
    assert bnb_4bit_keeps_input(ts) is kept
    assert bnb_saved_inputs(ms, ts, lora=True) == (2 * (h + qd + h + i) if kept else 0)
    # LLM.int8's MatMul8bitLt keeps A in every version
    int8 = model_spec_from_hf_config(LLAMA3, quantization_bits=8)
    assert bnb_saved_inputs(int8, ts.replace(method="lora"), lora=True) == 2 * (h + qd + h + i)


def test_bnb_version_is_validated():
    with pytest.raises(ConfigError, match="bnb_version"):
        _cuda(method="qlora", bnb_version="new")
    with pytest.raises(ConfigError, match="keeps_last_graph"):
        _cuda(method="qlora", keeps_last_graph="yes")


def test_a_loop_that_keeps_its_output_keeps_the_last_steps_bnb_inputs():
    # ctx.tensors are plain attributes: the backward frees saved variables only, so a loop holding the
    # last step's logits keeps that step's quantized-linear inputs into the next forward
    ms = model_spec_from_hf_config(LLAMA3)
    tokens = 2 * 512
    per_block = 2 * (ms.hidden_size + ms.num_heads * ms.head_dim + ms.hidden_size + ms.intermediate_size)
    loop = _cuda(method="qlora", batch_size=2, seq_length=512, framework="torch", bnb_version="0.42.0")
    assert loop.last_graph_kept and not loop.replace(framework="hf").last_graph_kept
    assert bnb_last_step_inputs(ms, loop) == ms.num_layers * tokens * per_block
    kept = estimate(ms, loop).phase_breakdowns["loss"]["activations"]
    dropped = estimate(ms, loop.replace(keeps_last_graph=False)).phase_breakdowns["loss"]["activations"]
    assert kept - dropped == ms.num_layers * tokens * per_block
    # nothing to keep: a newer bitsandbytes, a trainer that hands a detached loss on, no quantization
    assert bnb_last_step_inputs(ms, loop.replace(bnb_version="0.43.2")) == 0
    assert bnb_last_step_inputs(ms, loop.replace(framework="hf")) == 0
    assert bnb_last_step_inputs(ms, loop.replace(framework="lightning", keeps_last_graph=True)) > 0
    assert bnb_last_step_inputs(ms, loop.replace(method="lora")) == 0


@pytest.mark.parametrize("name,canonical", [("paged_adamw_8bit", "paged-adamw-8bit"),
                                            ("paged_adamw_32bit", "paged-adamw-32bit"),
                                            ("PAGED-ADAMW-8BIT", "paged-adamw-8bit"),
                                            ("adamw_bnb_8bit", "adamw-8bit"), ("adamw_8bit", "adamw-8bit"),
                                            ("adamw_torch_fused", "adamw")])
def test_optimizer_names_as_hf_spells_them(name, canonical):
    from memguard_torch.train_reading import optimizer_name

    ts = _cuda(optimizer=name)
    assert ts.optimizer == canonical
    assert ts.paged == canonical.startswith("paged-")
    assert optimizer_name(name) == canonical            # the HF adapter's reading of args.optim
    with pytest.raises(ConfigError, match="optimizer"):
        _cuda(optimizer="paged_lamb")


def test_paged_optimizer_states_leave_the_allocator_counters_by_themselves():
    # TrainSpec(optimizer="paged-adamw-*"): cuda_counter_bytes needs no paged= from the caller
    ms = model_spec_from_hf_config(LLAMA3)
    plain = _cuda(method="qlora", lora_rank=64, optimizer="adamw", bnb_version="0.45.0")
    paged = plain.replace(optimizer="paged_adamw_32bit")
    trainable = estimate(ms, paged).trainable_params
    assert optimizer_state_bytes(ms, paged, trainable) == 8 * trainable   # bnb 32-bit states are fp32
    est = estimate(ms, paged)
    p = paged_state_bytes(ms, paged)
    assert p > 0
    assert cuda_counter_bytes(est, "max_memory_allocated") == cuda_counter_bytes(est, "max_memory_allocated",
                                                                                 paged=True)
    assert (cuda_counter_bytes(est, "max_memory_allocated", paged=False)
            - cuda_counter_bytes(est, "max_memory_allocated")) == int(p * 1.05) - int(0.05 * int(p * 1.05) / 1.05)
    assert cuda_counter_bytes(est, "nvidia-smi") == est.peak_bytes     # resident: nvidia-smi sees them
    # the 8-bit paged states: 2 x (1 + 4/256) bytes per element
    p8 = paged.replace(optimizer="paged_adamw_8bit")
    assert paged_state_bytes(ms, p8) == math.ceil(2 * (1 + 4 / 256) * p / 8)
    assert cuda_counter_bytes(estimate(ms, plain), "max_memory_allocated") == cuda_counter_bytes(
        estimate(ms, plain), "max_memory_allocated", paged=False)


QWEN = os.path.join(os.path.dirname(HERE), "..", "bench", "configs", "qwen2.5-1.5b.json")


def _qwen(**kw) -> TrainSpec:
    base = dict(batch_size=4, seq_length=2048, method="lora", lora_targets=("all-linear",), dtype="bf16",
                device="cuda", framework="hf", grad_checkpoint=True)
    base.update(kw)
    return TrainSpec(**base)


def test_unusable_cache_is_the_freed_half_logits_and_under_checkpointing_one_block():
    # c10/cuda/CUDACachingAllocator.cpp serves a request from one free block at least its size and
    # never merges across segments: the freed bf16 logits cannot hold the loss backward's fp32
    # tensors, the checkpointed forward's freed block tensors cannot hold any logits request
    from memguard_core.estimator.cuda import unusable_cache_bytes

    ms = model_spec_from_hf_config(QWEN)
    n = 4 * 2048 * ms.vocab_size
    one = 123 * MiB
    assert unusable_cache_bytes(ms, _qwen(), one) == 2 * n + one
    assert unusable_cache_bytes(ms, _qwen(grad_checkpoint=False), one) == 2 * n
    assert unusable_cache_bytes(ms, _qwen(dtype="fp32"), one) == one            # fp32 logits: reused in place
    assert unusable_cache_bytes(ms, _qwen(dtype="fp32", grad_checkpoint=False), one) == 0
    assert unusable_cache_bytes(ms, _qwen(dtype="bf16", mixed_precision=True, method="full"), one) == 2 * n + one
    # a vocabulary narrower than the MLP: the logits fit the cached block tensors
    narrow = model_spec_from_hf_config(dict(json_config(QWEN), vocab_size=4096))
    assert unusable_cache_bytes(narrow, _qwen(), one) == 2 * 4 * 2048 * 4096


def json_config(path: str) -> dict:
    import json

    with open(path) as f:
        return json.load(f)


def _five_percent(est, moment: str) -> int:
    b = est.phase_breakdowns[moment]
    return int(0.05 * (est.phases[moment] - b["allocator_slack"] - b["runtime_overhead"]))


def test_checkpointed_lora_on_cuda_holds_the_recompute_apart_from_the_logits_and_reserves_their_cache():
    # bench/results/cuda_reserved_h200_2026-11-28.md: the recompute runs after the logits are freed
    # (max_memory_allocated), and the reserved gap is the freed bf16 logits' segment plus the
    # forward's cached block tensors
    ms = model_spec_from_hf_config(QWEN)
    ts = _qwen()
    est = estimate(ms, ts)
    assert est.phase == "loss"
    loss = est.phase_breakdowns["loss"]
    from memguard_core.estimator.activations import activation_bytes

    one_block = activation_bytes(ms, ts)[3]
    freed_logits = 2 * 4 * 2048 * ms.vocab_size
    assert est.slack_floors == {"loss": freed_logits + one_block}
    assert loss["allocator_slack"] == freed_logits + one_block > _five_percent(est, "loss")
    allocated = cuda_counter_bytes(est, "max_memory_allocated")
    reserved = cuda_counter_bytes(est, "max_memory_reserved")
    assert reserved - allocated == freed_logits + one_block


def test_the_slack_is_the_larger_of_the_fraction_and_the_floor():
    ms = model_spec_from_hf_config(QWEN)
    for ts in (_qwen(grad_checkpoint=False, batch_size=1, seq_length=3072), _qwen(grad_checkpoint=False, batch_size=1,
                                                                                 seq_length=512)):
        est = estimate(ms, ts)
        floor = 2 * ts.seq_length * ms.vocab_size
        assert est.slack_floors == {"loss": floor}
        assert est.phase_breakdowns["loss"]["allocator_slack"] == max(_five_percent(est, "loss"), floor)
    assert estimate(ms, _qwen(dtype="fp32", grad_checkpoint=False)).slack_floors == {}
    assert estimate(ms, _qwen(device="cpu")).slack_floors == {}


def test_no_floor_for_mlx_classifiers_and_litgpt_and_only_the_blocks_for_seq2seq():
    from memguard_core.estimator.cuda import unusable_cache_bytes
    from transformers import BertConfig, T5Config

    ms = model_spec_from_hf_config(QWEN)
    assert unusable_cache_bytes(ms, _qwen(framework="mlx"), 5 * MiB) == 0
    bert = model_spec_from_hf_config(BertConfig(architectures=["BertForSequenceClassification"]))
    assert unusable_cache_bytes(bert, _qwen(), 5 * MiB) == 0
    t5 = model_spec_from_hf_config(T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64,
                                            vocab_size=32128))
    ts = _qwen(seq_length=512, target_length=128, batch_size=2)
    assert unusable_cache_bytes(t5, ts, 5 * MiB) == 5 * MiB     # no upcast; 128 x 32128 > 512 x 2048
    assert unusable_cache_bytes(t5, ts.replace(target_length=16), 5 * MiB) == 0   # 16 x 32128 < 512 x 2048


def test_the_probe_correction_scales_the_cached_logits_with_the_per_token_part():
    from memguard_core.estimator import probe_fit as pf

    ms = model_spec_from_hf_config(QWEN)
    for ts in (_qwen(), _qwen(grad_checkpoint=False, batch_size=1, seq_length=3072)):
        est = estimate(ms, ts)
        assert pf.corrected_peak(est, 1.0, 0) == est.peak_bytes
        for r in (0.8, 1.1, 1.5):
            p = pf.step_parts(est, "loss")
            live = p["held"] + p["fixed"] + r * p["per_token"]
            rule = int(0.05 * (live - est.phase_breakdowns["loss"]["runtime_overhead"]))
            want = math.ceil(max(live + max(rule, int(r * est.slack_floors["loss"])), est.phases["backward"],
                                 est.phases["optimizer"]))
            assert pf.corrected_peak(est, r, 0, fixed_moments=("loss",)) == want


@pytest.mark.parametrize("sharding", ["ddp", "fsdp-full", "zero2", "zero3"])
def test_data_parallel_ranks_keep_their_cached_logits(sharding):
    # each rank runs its own micro-batch: its logits and block tensors are the single process's,
    # also where sharding shrinks the 5 % fraction below them
    llama = os.path.join(os.path.dirname(HERE), "..", "bench", "configs", "llama-3.2-1b.json")
    ms = model_spec_from_hf_config(llama)
    ts = _qwen(method="full", mixed_precision=True, grad_checkpoint=False, batch_size=2, seq_length=4096,
               sharding=sharding, world_size=8)
    est = estimate(ms, ts)
    floor = 2 * 2 * 4096 * ms.vocab_size
    assert est.slack_floors == {"loss": floor}
    assert est.phase_breakdowns["loss"]["allocator_slack"] >= floor
