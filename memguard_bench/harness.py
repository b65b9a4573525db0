"""``memguard bench``: the estimator against real training runs on this machine.

Every case is a real fine-tuning run in a FRESH subprocess (so the counter it reads is that run's
own high-water mark): a real architecture built from its published config numbers with random
weights (no model hub), a few optimizer steps, and the counter the estimate predicts
(``memguard_core.estimate``, README "The estimate"):

* HF ``Trainer`` on torch CPU: ``VmHWM`` of the process (/proc/self/status), glibc's free heap
  returned at every optimizer step's end as a guarded run returns it, and glibc's mmap threshold
  fixed at train start for a mixture-of-experts model in bf16 as a guarded run fixes it
  (``GuardOptions.trim_heap``; a case with ``"trim_heap": false`` measures the plain run);
* HF ``Trainer`` on CUDA, when a GPU is present (``--cuda``): the CUDA context + peak reserved bytes
  of the caching allocator (``torch.cuda.max_memory_reserved``);
* mlx_lm (``mlx_lm.tuner.trainer.train``, unmodified) on MLX: ``mx.get_peak_memory()``.

The child records the model facts (``memguard_core.spec.model_spec_from_module`` /
``memguard_mlx.specs.model_spec_from_mlx_module`` on the live model) next to the measurement; the
parent estimates from them, so ``--reuse`` re-scores a saved measurement after a model change
without re-running it (per-step peaks, the model's ``config.to_dict()`` and the measurement date
are kept in the record too). When the seed product (``ml-memguard``, import ``memory_guard``) is
installed, its ``estimate_training_memory`` is scored on the same measured cases (``--seed``).

Case sets (``--set``): ``matrix`` — the small / truncated matrix (2-8 blocks, 64-512 tokens) some
constants were fitted on (docs/estimator.md, "Where the constants come from"); ``held-out`` — architectures nothing was fitted on; ``all`` (default) —
those two; ``full-depth`` — every block of published configs (GPT-2, SmolLM2-135M / 360M,
Qwen2.5-0.5B, TinyLlama-1.1B, Llama-3.2-1B, and the MoEs Granite-3 1B-A400M and TinyMixtral-4x248M)
at 512-2048 tokens per micro-batch on HF and 64-128 on mlx_lm, pure bf16 / fp32 / autocast, LoRA
and full, checkpointing on and off, AdamW / SGD / Adafactor; 2-3 optimizer steps for dense models,
6-8 for MoE, the peak of every step recorded (``step_peak_bytes``), a timeout per case; by far the
longest set (per-case times in its report), so ``all`` (and ``--quick``, CI's) leave it out. No constant was fitted on it; its
report states that, with its summaries and the small matrix's beside them, dated.

    python -m memguard_bench                 # matrix + held out
    python -m memguard_bench --quick         # a small subset (CI)
    python -m memguard_bench --set full-depth --json fd.json --markdown fd.md
    python -m memguard_bench --only smollm2  # cases whose name contains the text
    python -m memguard_bench --json out.json --markdown out.md
    python -m memguard_bench --reuse bench/results/bench_cpu.json   # re-estimate only
    python -m memguard_bench --submit        # a markdown report to file as an issue

This module imports no framework at module level (the children import torch / mlx).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["main", "CASES", "cases", "run_case", "score", "summarize", "seed_estimate_bytes",
           "machine_fingerprint", "reported_fingerprint", "markdown_report", "gate_failures"]

MiB = 1 << 20

# ---------------------------------------------------------------------------------------------
# architectures: published config numbers (random weights); layer counts cut where noted so that
# one case runs in well under a minute on 2 cores.

#: HF ``AutoConfig.for_model(model_type, **numbers)``.
HF_ARCHS: Dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M config.json (all 30 layers)
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         rope_theta=100000.0),
    # the same, 8 of its 30 layers (sweeps)
    "smollm2-8l": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=8, num_attention_heads=9, num_key_value_heads=3,
                       tie_word_embeddings=True, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       rope_theta=100000.0),
    # HuggingFaceTB/SmolLM2-360M (hidden 960, GQA 15/5, vocab 49152, tied), 8 of its 32 layers
    "smollm2-360m-8l": dict(model_type="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                            num_hidden_layers=8, num_attention_heads=15, num_key_value_heads=5,
                            tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                            rope_theta=100000.0),
    # openai-community/gpt2, 4 of its 12 layers
    "gpt2-4l": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=4, n_head=12,
                    n_positions=1024),
    # Qwen/Qwen2.5-0.5B config.json (vocab 151936, GQA 14/2, tied), 4 of its 24 layers
    "qwen2.5-0.5b-4l": dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                            intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                            num_key_value_heads=2, tie_word_embeddings=True,
                            max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # TinyLlama/TinyLlama-1.1B (hidden 2048, GQA 32/4, vocab 32000, untied), 2 of its 22 layers
    "tinyllama-2l": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                         tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5),
    # a small Mixtral: 8 experts, top-2 (mistralai/Mixtral-8x7B's routing, narrowed), 4 layers
    "mixtral-4l": dict(model_type="mixtral", vocab_size=32000, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                       max_position_embeddings=4096),
    # not held out: the OPT and GPT-NeoX block models were built while looking at these cases, so
    # they are part of what the estimator was fitted on (docs/estimator.md, "Attention and dropout
    # rules")
    # EleutherAI/pythia-160m config.json (GPT-NeoX: fused query_key_value, parallel residual), 6 of 12
    "pythia-160m-6l": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=768, intermediate_size=3072,
                           num_hidden_layers=6, num_attention_heads=12, rotary_pct=0.25,
                           max_position_embeddings=2048, use_parallel_residual=True, tie_word_embeddings=False),
    # facebook/opt-125m config.json (learned positions, LayerNorm, fc1/fc2), all 12 layers
    "opt-125m": dict(model_type="opt", vocab_size=50272, hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
                     num_attention_heads=12, max_position_embeddings=2048, word_embed_proj_dim=768,
                     do_layer_norm_before=True, tie_word_embeddings=True),
    # a negligible Llama: what remains is the runtime of Python + torch + Trainer
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 tie_word_embeddings=True, max_position_embeddings=512),
}

#: mlx_lm ``models.<model_type>.ModelArgs(**numbers)``. MLX's CPU backend is an order of magnitude
#: slower at matmuls than torch's (docs/estimator.md, "Bench and trace run times"), so the MLX cases
#: keep 1-2 blocks and short rows.
MLX_ARCHS: Dict[str, dict] = {
    "smollm2-135m-2l": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                            tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0),
    "qwen2.5-0.5b-1l": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                            num_hidden_layers=1, num_attention_heads=14, num_key_value_heads=2,
                            tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0),
    # TinyLlama's head layout (head_dim 64, GQA 8:1 -> 8/1 here), vocab 32000, narrowed to 512
    "tinyllama-narrow-2l": dict(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                                tie_word_embeddings=False, rms_norm_eps=1e-5),
    "mixtral-2l": dict(model_type="mixtral", vocab_size=32000, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5),
    # not held out: its block model was built while looking at it
    # EleutherAI/pythia-160m, 2 of 12 layers
    "pythia-160m-2l": dict(model_type="gpt_neox", vocab_size=50304, hidden_size=768, intermediate_size=3072,
                           num_hidden_layers=2, num_attention_heads=12, rotary_pct=0.25,
                           max_position_embeddings=2048, use_parallel_residual=True, layer_norm_eps=1e-5,
                           rotary_emb_base=10000),
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=False, rms_norm_eps=1e-5),
}

#: Held-out architectures: never used to fit a constant of the estimator (no constant was
#: fitted on them or tuned while looking at them); their cases are scored separately.
HF_HELD_OUT_ARCHS: Dict[str, dict] = {
    # microsoft/Phi-3-mini-4k-instruct config.json (fused qkv_proj and gate_up_proj), 2 of 32 layers
    "phi3-mini-2l": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
                         tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         pad_token_id=32000),
    # google/gemma-2-2b config.json (head_dim 256, vocab 256000, tied, soft-capping), 2 of 26 layers
    "gemma2-2b-2l": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                         query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                         attn_logit_softcapping=50.0, tie_word_embeddings=True, max_position_embeddings=8192),
    # Qwen/Qwen3-0.6B config.json (head_dim 128 != hidden / heads, q/k norms), 4 of 28 layers
    "qwen3-0.6b-4l": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6),
    # meta-llama/Llama-3.2-1B config.json (vocab 128256, tied, GQA 32/8), 2 of 16 layers
    "llama3.2-1b-2l": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                           tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
                           rms_norm_eps=1e-5),
    # stabilityai/stablelm-2-1_6b config.json (LayerNorm, qkv bias, partial rotary 25 %, vocab 100352,
    # untied), 2 of 24 layers
    "stablelm2-1.6b-2l": dict(model_type="stablelm", vocab_size=100352, hidden_size=2048,
                              intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32,
                              num_key_value_heads=32, partial_rotary_factor=0.25, use_qkv_bias=True,
                              layer_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096),
    # bigcode/starcoder2-3b config.json (GQA 24/2, biases, gelu MLP c_fc/c_proj, LayerNorm), 2 of 30
    "starcoder2-3b-2l": dict(model_type="starcoder2", vocab_size=49152, hidden_size=3072,
                             intermediate_size=12288, num_hidden_layers=2, num_attention_heads=24,
                             num_key_value_heads=2, use_bias=True, norm_epsilon=1e-5, sliding_window=4096,
                             rope_theta=999999.4420358813, max_position_embeddings=16384,
                             tie_word_embeddings=True),
    # microsoft/phi-2 config.json (parallel attention/MLP, partial rotary 40 %, residual dropout 0.1,
    # untied), 2 of 32 layers
    "phi2-2l": dict(model_type="phi", vocab_size=51200, hidden_size=2560, intermediate_size=10240,
                    num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
                    partial_rotary_factor=0.4, resid_pdrop=0.1, embd_pdrop=0.0, attention_dropout=0.0,
                    hidden_act="gelu_new", layer_norm_eps=1e-5, tie_word_embeddings=False,
                    max_position_embeddings=2048),
    # Qwen/Qwen1.5-MoE-A2.7B's block (routed experts top-4 + a gated shared expert), narrowed:
    # hidden 256, 16 experts, vocab 32000, 4 layers
    "qwen2-moe-4l": dict(model_type="qwen2_moe", vocab_size=32000, hidden_size=256, intermediate_size=512,
                         moe_intermediate_size=128, shared_expert_intermediate_size=512, num_experts=16,
                         num_experts_per_tok=4, decoder_sparse_step=1, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
                         max_position_embeddings=4096),
}

#: Held-out mlx_lm architectures (see ``HF_HELD_OUT_ARCHS``).
MLX_HELD_OUT_ARCHS: Dict[str, dict] = {
    # Qwen/Qwen3-0.6B, 1 of 28 layers
    "qwen3-0.6b-1l": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-6),
    # microsoft/Phi-3-mini-4k-instruct, 1 of 32 layers
    "phi3-mini-1l": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=32,
                         rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False),
    # HuggingFaceTB/SmolLM2-360M (hidden 960, GQA 15/5, tied), 2 of 32 layers
    "smollm2-360m-2l": dict(model_type="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                            num_hidden_layers=2, num_attention_heads=15, num_key_value_heads=5,
                            tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0),
    # openai-community/gpt2 (LayerNorm, learned positions, fused c_attn), 2 of 12 layers
    "gpt2-2l": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=2, n_head=12, n_ctx=1024,
                    n_positions=1024, layer_norm_epsilon=1e-5),
    # Qwen1.5-MoE's block (top-4 of 16 experts + gated shared expert), narrowed, 2 layers
    "qwen2-moe-2l": dict(model_type="qwen2_moe", vocab_size=32000, hidden_size=256, intermediate_size=512,
                         moe_intermediate_size=128, shared_expert_intermediate_size=512, num_experts=16,
                         num_experts_per_tok=4, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, rms_norm_eps=1e-6, tie_word_embeddings=False),
}

#: Full-depth architectures (``--set full-depth``): every block of the published config, no
#: truncation (``FULL_DEPTH_LAYERS`` states the published count, and a test checks it). Their cases
#: run at 512-2048 tokens per micro-batch, as users' runs do. No constant of the estimator was
#: fitted on them or tuned while looking at them (held out by scale; granitemoe also by
#: architecture).
HF_FULL_DEPTH_ARCHS: Dict[str, dict] = {
    # openai-community/gpt2 config.json (n_layer 12, n_positions 1024: rows of at most 1024 tokens)
    "gpt2-12l": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_ctx=1024,
                     n_positions=1024, layer_norm_epsilon=1e-5),
    # HuggingFaceTB/SmolLM2-135M config.json (30 layers, GQA 9/3, tied)
    "smollm2-135m-30l": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                             rope_theta=100000.0),
    # HuggingFaceTB/SmolLM2-360M config.json (32 layers, hidden 960, inter 2560, GQA 15/5, tied;
    # 361,821,120 parameters)
    "smollm2-360m-32l": dict(model_type="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                             num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                             tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                             rope_theta=100000.0),
    # Qwen/Qwen2.5-0.5B config.json (24 layers, GQA 14/2, qkv bias, vocab 151936, tied)
    "qwen2.5-0.5b-24l": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
                             rms_norm_eps=1e-6),
    # TinyLlama/TinyLlama-1.1B (intermediate-step-1431k-3T) config.json (22 layers, hidden 2048, GQA
    # 32/4, vocab 32000, untied)
    "tinyllama-1.1b-22l": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                               tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5),
    # meta-llama/Llama-3.2-1B config.json (16 layers, GQA 32/8, head_dim 64, vocab 128256, tied;
    # its rope_scaling "llama3" changes no tensor shape and is left out)
    "llama3.2-1b-16l": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                            tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
                            rms_norm_eps=1e-5),
    # MoE: ibm-granite/granite-3.1-1b-a400m-instruct config.json (the granite-3.0/3.1-1b-a400m shape:
    # model_type granitemoe, 24 layers, hidden 1024, 32 experts of width 512, top-8, GQA 16/8,
    # vocab 49155, tied; 1.33 B parameters, ~0.4 B active). Numbers as read from the public copy
    # of that file in github.com/leok7v/nano-lamma (models/granite-3.1-1b-a400m-instruct/config.json).
    "granite3-1b-a400m-24l": dict(model_type="granitemoe", vocab_size=49155, hidden_size=1024,
                                  intermediate_size=512, num_hidden_layers=24, num_attention_heads=16,
                                  num_key_value_heads=8, num_local_experts=32, num_experts_per_tok=8,
                                  attention_multiplier=0.015625, embedding_multiplier=12.0, logits_scaling=6.0,
                                  residual_multiplier=0.22, rms_norm_eps=1e-6, rope_theta=1500000.0,
                                  max_position_embeddings=131072, tie_word_embeddings=True,
                                  router_aux_loss_coef=0.0, output_router_logits=False),
    # MoE, Mixtral format: Isotonic/TinyMixtral-4x248M-MoE (a mergekit MoE of four
    # Locutusque/TinyMistral-248M models: model_type mixtral, 4 experts, top-2). Its own config.json
    # is not the source; the shape is TinyMistral-248M-v2's config.json (12
    # layers, hidden 1024, inter 4096, GQA 32/8, vocab 32005, sliding_window 32, untied), as quoted
    # in a public adapter, with the 4 experts / top-2 the model name and card state. ~0.7 B
    # parameters, ~0.33 B active.
    "tinymixtral-4x248m-12l": dict(model_type="mixtral", vocab_size=32005, hidden_size=1024,
                                   intermediate_size=4096, num_hidden_layers=12, num_attention_heads=32,
                                   num_key_value_heads=8, num_local_experts=4, num_experts_per_tok=2,
                                   sliding_window=32, max_position_embeddings=32768,
                                   tie_word_embeddings=False, output_router_logits=False),
}

#: Full-depth mlx_lm architectures (``mlx_lm.models.<model_type>.ModelArgs``), same sources as
#: ``HF_FULL_DEPTH_ARCHS``. MLX's CPU backend is slow at matmuls (docs/estimator.md, "Bench and
#: trace run times"): short rows only.
MLX_FULL_DEPTH_ARCHS: Dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M (30 layers)
    "smollm2-135m-30l": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0),
    # openai-community/gpt2 (12 layers)
    "gpt2-12l": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_ctx=1024,
                     n_positions=1024, layer_norm_epsilon=1e-5),
    # Qwen/Qwen2.5-0.5B (24 layers)
    "qwen2.5-0.5b-24l": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0),
    # MoE, Mixtral format: Isotonic/TinyMixtral-4x248M-MoE as in HF_FULL_DEPTH_ARCHS (12 layers,
    # 4 experts top-2; TinyMistral-248M-v2's shape)
    "tinymixtral-4x248m-12l": dict(model_type="mixtral", vocab_size=32005, hidden_size=1024,
                                   intermediate_size=4096, num_hidden_layers=12, num_attention_heads=32,
                                   num_key_value_heads=8, num_local_experts=4, num_experts_per_tok=2,
                                   tie_word_embeddings=False),
}

#: The published layer count of each full-depth architecture (what "full depth" means; checked
#: by tests/test_bench_full_depth.py against the arch tables above).
FULL_DEPTH_LAYERS: Dict[str, int] = {
    "gpt2-12l": 12, "smollm2-135m-30l": 30, "smollm2-360m-32l": 32, "qwen2.5-0.5b-24l": 24,
    "tinyllama-1.1b-22l": 22, "llama3.2-1b-16l": 16, "granite3-1b-a400m-24l": 24, "tinymixtral-4x248m-12l": 12,
}

#: The model types whose block model was fitted on the matrix, per backend: a full-depth case
#: of another type is held out by architecture as well as by scale.
FITTED_MODEL_TYPES = {"hf": frozenset({"llama", "gpt2", "qwen2", "mixtral", "gpt_neox", "opt"}),
                      "mlx": frozenset({"llama", "qwen2", "mixtral", "gpt_neox"})}


def num_layers_of(arch: dict) -> int:
    """The layer count an arch dict builds (``num_hidden_layers`` or GPT-2's ``n_layer``)."""
    return int(arch.get("num_hidden_layers") or arch["n_layer"])


_DEFAULTS = dict(method="lora", batch_size=2, seq_length=128, dtype="fp32", optimizer="adamw",
                 attn_impl="sdpa", grad_checkpoint=False, lora_rank=8, lora_targets=None,
                 mixed_precision=False, grad_accum=1, lora_layers=None, lora_dropout=0.0)


def _case(backend: str, arch: str, quick: bool = False, held_out: bool = False, *, full_depth: bool = False,
          steps: int = 2, timeout_s: Optional[float] = None, **kw) -> dict:
    """One case: ``train`` holds the settings (``_DEFAULTS`` overridden by ``kw``). Full-depth cases
    (``full_depth=True``: an arch of ``HF_FULL_DEPTH_ARCHS`` / ``MLX_FULL_DEPTH_ARCHS``) also carry
    ``steps`` (optimizer steps run), ``per_step`` (the child records the peak of every step) and
    ``timeout_s``; their names start with ``<backend>-fd-``."""
    t = dict(_DEFAULTS, **kw)
    if t["lora_targets"] is None:
        t["lora_targets"] = ["q_proj", "v_proj"] if backend == "hf" else ["all-linear"]
    parts = [backend] + (["fd"] if full_depth else []) + [
             arch, t["method"] if t["method"] == "full" else f"lora-r{t['lora_rank']}",
             f"b{t['batch_size']}", f"s{t['seq_length']}", t["dtype"]]
    if t["mixed_precision"]:
        parts.append("amp")
    if backend == "hf" and t["attn_impl"] != "sdpa":
        parts.append(t["attn_impl"])
    if t["grad_checkpoint"]:
        parts.append("gc")
    if t["optimizer"] != "adamw":
        parts.append(t["optimizer"])
    if t["grad_accum"] != 1:
        parts.append(f"ga{t['grad_accum']}")
    if t["lora_layers"]:
        parts.append(f"last{t['lora_layers']}")
    if t["method"] != "full" and t.get("lora_dropout"):
        parts.append(f"drop{t['lora_dropout']:g}")
    default_t = ["q_proj", "v_proj"] if backend == "hf" else ["all-linear"]
    if t["method"] != "full" and t["lora_targets"] != default_t:
        parts.append("+".join(t["lora_targets"]))
    if steps != 2:
        parts.append(f"{steps}steps")
    c = dict(name="-".join(parts), backend=backend, arch=arch, train=t, quick=quick, held_out=held_out)
    if steps != 2:
        c.update(steps=steps, per_step=True)
    if full_depth:
        archs = HF_FULL_DEPTH_ARCHS if backend == "hf" else MLX_FULL_DEPTH_ARCHS
        mt = archs[arch]["model_type"]
        c.update(full_depth=True, steps=steps, per_step=True, model_type=mt,
                 arch_fitted=mt in FITTED_MODEL_TYPES[backend])
        if timeout_s:
            c["timeout_s"] = float(timeout_s)
    return c


def cases() -> List[dict]:
    """The bench matrix: HF Trainer on torch CPU, and mlx_lm on MLX (run when mlx is installed)."""
    c: List[dict] = []
    hf = lambda arch, quick=False, **kw: c.append(_case("hf", arch, quick, **kw))  # noqa: E731
    mlx = lambda arch, quick=False, **kw: c.append(_case("mlx", arch, quick, **kw))  # noqa: E731
    # --- HF Trainer, torch CPU
    hf("tiny", True, batch_size=1, seq_length=32)
    hf("tiny", True, method="full", batch_size=1, seq_length=32)
    hf("smollm2-135m", batch_size=2, seq_length=128, lora_rank=16,
       lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    hf("smollm2-135m", method="full", batch_size=1, seq_length=128)
    hf("smollm2-135m", batch_size=4, seq_length=256, grad_checkpoint=True)
    hf("smollm2-135m", method="full", batch_size=2, seq_length=256, grad_checkpoint=True)
    for b, s in [(1, 128), (4, 128), (2, 512)]:            # batch / sequence sweep
        hf("smollm2-8l", batch_size=b, seq_length=s)
    hf("smollm2-8l", batch_size=2, seq_length=256, attn_impl="eager")
    hf("smollm2-8l", batch_size=2, seq_length=256, dtype="bf16")
    hf("smollm2-8l", batch_size=2, seq_length=256, dtype="bf16", mixed_precision=True)
    hf("smollm2-8l", method="full", batch_size=2, seq_length=128, optimizer="sgd")
    hf("smollm2-8l", method="full", batch_size=2, seq_length=128, optimizer="adafactor")
    hf("gpt2-4l", batch_size=4, seq_length=256, lora_targets=["c_attn"])
    hf("gpt2-4l", method="full", batch_size=4, seq_length=128)
    hf("gpt2-4l", method="full", batch_size=2, seq_length=256, attn_impl="eager")
    hf("qwen2.5-0.5b-4l", batch_size=2, seq_length=256)
    hf("qwen2.5-0.5b-4l", batch_size=4, seq_length=256, grad_checkpoint=True)
    hf("qwen2.5-0.5b-4l", batch_size=2, seq_length=256, dtype="bf16", lora_targets=["all-linear"])
    hf("qwen2.5-0.5b-4l", method="full", batch_size=1, seq_length=256, dtype="bf16")
    hf("qwen2.5-0.5b-4l", method="full", batch_size=1, seq_length=256, dtype="bf16", grad_checkpoint=True)
    hf("smollm2-8l", method="full", batch_size=2, seq_length=256, grad_checkpoint=True)
    hf("tinyllama-2l", batch_size=4, seq_length=256, lora_targets=["all-linear"])
    hf("tinyllama-2l", method="full", batch_size=2, seq_length=128, grad_accum=2)
    # checkpointed at 2 k tokens per micro-batch, truncated (the long-row checkpointed fit points)
    hf("smollm2-360m-8l", method="full", batch_size=2, seq_length=1024, dtype="bf16", grad_checkpoint=True)
    hf("tinyllama-2l", batch_size=1, seq_length=2048, dtype="bf16", grad_checkpoint=True)
    hf("mixtral-4l", batch_size=4, seq_length=256)
    hf("mixtral-4l", method="full", batch_size=4, seq_length=256)
    # MoE in bf16 on the CPU: the experts' slices take new sizes every step (6 steps, per-step peaks)
    hf("mixtral-4l", batch_size=4, seq_length=256, dtype="bf16", steps=6)
    hf("mixtral-4l", method="full", batch_size=4, seq_length=256, dtype="bf16", steps=6)
    hf("pythia-160m-6l", method="full", batch_size=2, seq_length=256)
    hf("opt-125m", batch_size=4, seq_length=256, grad_checkpoint=True)
    # --- mlx_lm on MLX (all-linear LoRA on the last blocks, as mlx_lm's lora does)
    mlx("tiny", True, batch_size=4, seq_length=64, lora_rank=4)
    mlx("tiny", True, method="full", batch_size=4, seq_length=64)
    for b, s in [(1, 64), (4, 64), (2, 128)]:
        mlx("smollm2-135m-2l", batch_size=b, seq_length=s)
    mlx("smollm2-135m-2l", batch_size=2, seq_length=128, dtype="bf16")
    mlx("smollm2-135m-2l", batch_size=4, seq_length=64, grad_checkpoint=True)
    mlx("smollm2-135m-2l", batch_size=2, seq_length=64, lora_layers=1, lora_rank=16)
    mlx("smollm2-135m-2l", method="full", batch_size=2, seq_length=64)
    mlx("smollm2-135m-2l", method="full", batch_size=2, seq_length=64, optimizer="sgd")
    mlx("qwen2.5-0.5b-1l", batch_size=1, seq_length=64)
    mlx("tinyllama-narrow-2l", batch_size=4, seq_length=128)
    mlx("tinyllama-narrow-2l", method="full", batch_size=2, seq_length=128, dtype="bf16")
    mlx("mixtral-2l", batch_size=4, seq_length=128)
    mlx("pythia-160m-2l", method="full", batch_size=2, seq_length=64)
    # --- held out: architectures no constant was fitted on (scored apart)
    ho = lambda arch, **kw: c.append(_case("hf", arch, held_out=True, **kw))  # noqa: E731
    ho("phi3-mini-2l", batch_size=2, seq_length=128, lora_targets=["qkv_proj", "o_proj"])
    ho("gemma2-2b-2l", batch_size=1, seq_length=256, dtype="bf16", lora_rank=16, lora_targets=["all-linear"],
       attn_impl="eager")  # transformers 5.23 has no SDPA path for Gemma-2
    ho("qwen3-0.6b-4l", method="full", batch_size=1, seq_length=128)
    ho("llama3.2-1b-2l", batch_size=2, seq_length=256, dtype="bf16", mixed_precision=True)
    ho("stablelm2-1.6b-2l", batch_size=2, seq_length=256)
    ho("starcoder2-3b-2l", batch_size=2, seq_length=256, grad_checkpoint=True)
    ho("phi2-2l", batch_size=2, seq_length=256, lora_targets=["q_proj", "k_proj", "v_proj", "dense"])
    ho("qwen2-moe-4l", method="full", batch_size=4, seq_length=256)
    mo = lambda arch, **kw: c.append(_case("mlx", arch, held_out=True, **kw))  # noqa: E731
    mo("qwen3-0.6b-1l", batch_size=1, seq_length=64)
    mo("phi3-mini-1l", batch_size=1, seq_length=64, lora_rank=16)
    mo("gpt2-2l", batch_size=2, seq_length=64)
    mo("qwen2-moe-2l", batch_size=4, seq_length=64)
    mo("smollm2-360m-2l", method="full", batch_size=2, seq_length=64, dtype="bf16")
    c += full_depth_cases()
    return c


def full_depth_cases() -> List[dict]:
    """The full-depth set (``--set full-depth``): every block of published configs
    (``HF_FULL_DEPTH_ARCHS``, ``MLX_FULL_DEPTH_ARCHS``), HF at 512-2048 tokens per micro-batch,
    mlx_lm at 64-128; dense cases run 2-3 optimizer steps (the peak is reached by step 2), MoE
    cases 6-8 (their heap grows step after step); each has its own timeout. Sized to run in
    <= 60 min on the 2-core bench machine (per-case times in bench/results/full_depth_cpu.md)."""
    c: List[dict] = []
    hf = lambda arch, steps=2, t=600, **kw: c.append(_case("hf", arch, full_depth=True, steps=steps,  # noqa: E731
                                                            timeout_s=t, **kw))
    mlx = lambda arch, steps=2, t=600, **kw: c.append(_case("mlx", arch, full_depth=True, steps=steps,  # noqa: E731
                                                             timeout_s=t, **kw))
    # --- HF Trainer, torch CPU (b x s = tokens per micro-batch). t = the case's timeout (s), about
    # 2.5x its run time in sizing runs (per-case times in bench/results/full_depth_cpu.md).
    hf("gpt2-12l", t=300, batch_size=2, seq_length=1024, lora_rank=16, lora_targets=["c_attn"])
    hf("gpt2-12l", t=240, method="full", batch_size=1, seq_length=1024)
    # the dense per-step check: 3 steps (the peak is reached by step 2)
    hf("smollm2-135m-30l", steps=3, t=400, batch_size=2, seq_length=1024, dtype="bf16", lora_rank=16)
    hf("smollm2-135m-30l", t=540, batch_size=1, seq_length=2048, lora_rank=32, lora_targets=["all-linear"],
       grad_checkpoint=True)
    hf("smollm2-135m-30l", t=400, method="full", batch_size=4, seq_length=512, optimizer="adafactor")
    hf("smollm2-360m-32l", t=240, batch_size=4, seq_length=512, dtype="bf16", mixed_precision=True, lora_rank=16)
    hf("smollm2-360m-32l", t=300, method="full", batch_size=2, seq_length=1024, dtype="bf16", grad_checkpoint=True)
    hf("qwen2.5-0.5b-24l", t=300, batch_size=2, seq_length=1024, dtype="bf16", lora_rank=64,
       lora_targets=["all-linear"])
    # LoRA dropout as PEFT / TRL examples set it: each LoRA'd linear keeps its dropout's output and mask
    hf("qwen2.5-0.5b-24l", t=300, batch_size=2, seq_length=512, dtype="bf16", lora_rank=16,
       lora_targets=["all-linear"], lora_dropout=0.05)
    hf("qwen2.5-0.5b-24l", t=240, method="full", batch_size=1, seq_length=1024, dtype="bf16", grad_checkpoint=True)
    hf("qwen2.5-0.5b-24l", t=480, method="full", batch_size=1, seq_length=1024)     # fp32 AdamW: 16 B/param
    hf("tinyllama-1.1b-22l", t=540, batch_size=1, seq_length=2048, dtype="bf16", lora_rank=16, grad_checkpoint=True)
    hf("tinyllama-1.1b-22l", t=420, batch_size=4, seq_length=512, dtype="bf16", mixed_precision=True, lora_rank=16,
       lora_targets=["all-linear"])
    hf("llama3.2-1b-16l", t=420, batch_size=2, seq_length=1024, dtype="bf16", lora_rank=16)
    hf("llama3.2-1b-16l", t=540, batch_size=1, seq_length=1024, lora_rank=32, lora_targets=["all-linear"],
       optimizer="sgd")
    # MoE: 8 optimizer steps, per-step peaks (the heap grows step after step)
    hf("granite3-1b-a400m-24l", steps=8, t=540, batch_size=2, seq_length=512, dtype="bf16", lora_rank=16)
    hf("tinymixtral-4x248m-12l", steps=8, t=540, method="full", batch_size=2, seq_length=512, dtype="bf16")
    # --- mlx_lm on MLX (all-linear LoRA on every block, as mlx_lm's lora does with num_layers=-1)
    mlx("smollm2-135m-30l", t=240, batch_size=1, seq_length=128)
    mlx("gpt2-12l", t=240, batch_size=2, seq_length=64)
    mlx("qwen2.5-0.5b-24l", t=360, batch_size=1, seq_length=64, dtype="bf16")
    mlx("tinymixtral-4x248m-12l", steps=6, t=540, batch_size=1, seq_length=64)
    return c


CASES = cases()

# ---------------------------------------------------------------------------------------------
# children (run in a fresh interpreter: ``python -m memguard_bench --child JSON``)


def _status_kib(key: str) -> int:
    import re

    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def _peak_rss_bytes() -> int:
    """VmHWM on Linux; ``ru_maxrss`` elsewhere (KiB on Linux, bytes on macOS)."""
    v = _status_kib("VmHWM")
    if v:
        return v * 1024
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def _json_safe(d: Any) -> Any:
    """``d`` as JSON can hold it (dtypes and other objects as their ``str``)."""
    return json.loads(json.dumps(d, default=str))


def _hf_step_peaks_callback(read, reset):
    """A ``TrainerCallback`` that records the peak of the counter in each optimizer step: at
    ``on_step_begin`` it reads the peak since the last reset (the first read covers everything
    before the first step: model, optimizer setup, ``on_train_begin``) and resets it; at
    ``on_step_end`` it reads the step's peak and resets again (so the next read is the gap between
    steps: logging, scheduler). ``read`` returns bytes; ``reset`` returns False when the counter
    cannot be reset (then the per-step peaks are cumulative and ``resets_ok`` says so)."""
    from transformers import TrainerCallback

    class StepPeaks(TrainerCallback):
        def __init__(self):
            self.pre_train = None
            self.steps: List[int] = []
            self.gaps: List[int] = []
            self.seconds: List[float] = []
            self.resets_ok = True
            self._t = 0.0

        def _reset(self):
            self.resets_ok = bool(reset()) and self.resets_ok

        def on_step_begin(self, args, state, control, **kw):
            v = read()
            if self.pre_train is None:
                self.pre_train = v
            else:
                self.gaps.append(v)
            self._reset()
            self._t = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(read())
            self.seconds.append(round(time.time() - self._t, 2))
            self._reset()

    return StepPeaks()


def _hf_trim_heap_callback():
    """A ``TrainerCallback`` doing what a guarded run does at every optimizer step's end on a CPU
    device (``GuardOptions.trim_heap``: ``probes.trim_heap``, glibc's ``malloc_trim(0)``), so the
    peaks measured are a guarded run's. It runs after the per-step peak callback has read the step."""
    from transformers import TrainerCallback

    from memguard_core.probes import trim_heap

    class TrimHeap(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trim_heap()

    return TrimHeap()


def _child_hf(case: dict) -> dict:
    """One HF ``Trainer`` run (``case["steps"]`` optimizer steps, default 2) on random token ids;
    returns the measurement. With ``case["per_step"]`` the peak of every step is recorded too
    (``step_peak_bytes``; ``peak_bytes`` stays the peak of the whole run: the largest of the
    pre-train, per-step, between-step and after-train readings)."""
    t0 = time.time()
    import dataclasses

    import torch
    from torch.utils.data import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from memguard_core.spec import model_spec_from_module

    torch.manual_seed(0)
    kw = case["train"]
    device = case.get("device", "cpu")
    arch = dict((HF_FULL_DEPTH_ARCHS if case.get("full_depth") else {**HF_ARCHS, **HF_HELD_OUT_ARCHS})[case["arch"]])
    steps = int(case.get("steps", 2))
    mt = arch.pop("model_type")
    config = AutoConfig.for_model(mt, **arch)
    half = kw["dtype"] in ("bf16", "fp16") and not kw["mixed_precision"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kw["dtype"]) if half else torch.float32
    ctx = 0
    if device == "cuda":
        torch.zeros(1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        ctx = (total - free) - torch.cuda.memory_reserved()  # context (assumes an otherwise idle GPU)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=kw["attn_impl"])
    if kw["method"] != "full":
        from peft import LoraConfig, get_peft_model

        targets = kw["lora_targets"]
        lc = LoraConfig(r=kw["lora_rank"], lora_alpha=2 * kw["lora_rank"], lora_dropout=kw.get("lora_dropout", 0.0),
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        task_type="CAUSAL_LM")
        model = get_peft_model(model, lc)
    ms = model_spec_from_module(model, name=case["arch"])
    spec = dataclasses.asdict(ms)
    n, s = kw["batch_size"] * kw["grad_accum"] * steps, kw["seq_length"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (n, s), generator=g)

    class DS(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i], "attention_mask": torch.ones(s, dtype=torch.long)}

    optim = {"adamw": "adamw_torch_fused", "adam": "adamw_torch_fused", "sgd": "sgd",
             "adafactor": "adafactor"}[kw["optimizer"]]
    amp = kw["mixed_precision"]
    args = TrainingArguments(
        output_dir="/tmp/memguard_bench_out", per_device_train_batch_size=kw["batch_size"],
        gradient_accumulation_steps=kw["grad_accum"], max_steps=steps, learning_rate=1e-4,
        optim=optim, bf16=amp and kw["dtype"] == "bf16", fp16=amp and kw["dtype"] == "fp16",
        use_cpu=device == "cpu", gradient_checkpointing=kw["grad_checkpoint"], report_to=[],
        save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False)
    if device == "cuda":
        def read() -> int:
            return int(ctx + torch.cuda.max_memory_reserved())

        def reset() -> bool:
            torch.cuda.reset_peak_memory_stats()
            return True
    else:
        from memguard_core.probes.linux import reset_peak

        read, reset = _peak_rss_bytes, reset_peak
    callbacks = [_hf_step_peaks_callback(read, reset)] if case.get("per_step") else []
    cb = callbacks[0] if callbacks else None
    pinned = False
    if device == "cpu" and case.get("trim_heap", True):
        callbacks.append(_hf_trim_heap_callback())
        from memguard_core.guard import fix_mmap_threshold
        from memguard_core.spec import TrainSpec

        pinned = fix_mmap_threshold(ms, TrainSpec(dtype=kw["dtype"], device="cpu"))  # as the guard at train start
    trainer = Trainer(model=model, args=args, train_dataset=DS(), callbacks=callbacks or None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # read where a guard's preflight reads it (on_train_begin): the mapped libraries' pages
    from memguard_core.stats import process_file_resident_bytes
    resident_file = process_file_resident_bytes() if device == "cpu" else None
    trainer.train()
    peak = read()
    rec = dict(peak_bytes=peak, counter=device, seconds=time.time() - t0, model_spec=spec,
               resident_file_bytes=resident_file, heap_trim=bool(device == "cpu" and case.get("trim_heap", True)),
               mmap_threshold_pinned=pinned,
               model_config=_json_safe(getattr(model, "config", config).to_dict()))
    if cb is not None:
        readings = [cb.pre_train or 0] + cb.steps + cb.gaps + [peak]
        rec.update(peak_bytes=max(readings), step_peak_bytes=cb.steps, pre_train_peak_bytes=cb.pre_train,
                   between_step_peak_bytes=cb.gaps, after_train_peak_bytes=peak, step_seconds=cb.seconds,
                   step_peak_resets_ok=cb.resets_ok)
    return rec


def _child_mlx(case: dict) -> dict:
    """One unmodified ``mlx_lm.tuner.trainer.train`` run (2 iterations) on random token rows;
    the peak is ``mx.get_peak_memory()`` from before the first step (the weights, evaluated before,
    are in it)."""
    t0 = time.time()
    import dataclasses
    import importlib

    import numpy as np
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from memguard_mlx.specs import model_spec_from_mlx_module, train_spec

    kw = case["train"]
    arch = dict((MLX_FULL_DEPTH_ARCHS if case.get("full_depth") else {**MLX_ARCHS, **MLX_HELD_OUT_ARCHS})[case["arch"]])
    steps = int(case.get("steps", 2))
    per_step = bool(case.get("per_step"))
    mod = importlib.import_module(f"mlx_lm.models.{arch['model_type']}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(arch))
    if kw["dtype"] in ("bf16", "fp16"):
        model.set_dtype(mx.bfloat16 if kw["dtype"] == "bf16" else mx.float16)
    model.freeze()
    n_layers = kw["lora_layers"] or arch.get("num_hidden_layers") or arch["n_layer"]
    if kw["method"] == "full":
        for layer in model.layers[-n_layers:]:  # mlx_lm lora.py, fine_tune_type="full"
            layer.unfreeze()
    else:
        cfg = {"rank": kw["lora_rank"], "scale": 20.0, "dropout": 0.0}
        if kw["lora_targets"] != ["all-linear"]:
            cfg["keys"] = [f"self_attn.{t}" for t in kw["lora_targets"]]
        linear_to_lora_layers(model, n_layers, cfg)
    mx.eval(model.parameters())
    s = kw["seq_length"]
    rng = np.random.default_rng(1)
    rows = [(rng.integers(3, arch["vocab_size"], size=s + 1).tolist(), 0)
            for _ in range(kw["batch_size"] * kw["grad_accum"] * steps)]

    class Rows:
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    opt = {"adamw": optim.AdamW, "adam": optim.Adam, "sgd": optim.SGD}[kw["optimizer"]](learning_rate=1e-4)
    out = os.path.join("/tmp", f"memguard_bench_{os.getpid()}.safetensors")
    args = TrainingArgs(batch_size=kw["batch_size"], iters=steps * kw["grad_accum"],
                        steps_per_report=1 if per_step else 1000,
                        steps_per_eval=10**6, steps_per_save=10**6, max_seq_length=s + 1,
                        adapter_file=out, grad_checkpoint=kw["grad_checkpoint"],
                        grad_accumulation_steps=kw["grad_accum"])
    ms = model_spec_from_mlx_module(model, args, name=case["arch"])
    ts = train_spec(model, opt, args, ms, train_dataset=Rows())
    mx.reset_peak_memory()
    import contextlib
    import io

    cb = None
    if per_step:
        from mlx_lm.tuner.callbacks import TrainingCallback

        class StepPeaks(TrainingCallback):
            """mlx_lm reports after every iteration here (``steps_per_report=1``, after the
            iteration's ``mx.eval``): the peak since the last report is that iteration's
            (the first also holds the compile); then reset."""

            def __init__(self):
                self.steps: List[int] = []
                self.seconds: List[float] = []
                self._t = time.time()

            def on_train_loss_report(self, info):
                self.steps.append(int(mx.get_peak_memory()))
                mx.reset_peak_memory()
                now = time.time()
                self.seconds.append(round(now - self._t, 2))
                self._t = now

        cb = StepPeaks()
    with contextlib.redirect_stdout(io.StringIO()):
        train(model, opt, Rows(), None, args=args, training_callback=cb)
    peak = int(mx.get_peak_memory())
    try:
        os.remove(out)
    except OSError:
        pass
    rec = dict(peak_bytes=peak, counter="mlx", seconds=time.time() - t0, model_spec=dataclasses.asdict(ms),
               train_spec=dataclasses.asdict(ts), model_config=_json_safe(dataclasses.asdict(model.args))
               if dataclasses.is_dataclass(getattr(model, "args", None)) else None)
    if cb is not None:
        rec.update(peak_bytes=max(cb.steps + [peak]), step_peak_bytes=cb.steps, after_train_peak_bytes=peak,
                   step_seconds=cb.seconds)
    return rec


def _child(case: dict) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return _child_mlx(case) if case["backend"] == "mlx" else _child_hf(case)


# ---------------------------------------------------------------------------------------------
# parent: run, estimate, score


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(case: dict, timeout_s: float = 600.0) -> dict:
    """Run one case in a fresh interpreter; returns the child's record, or ``{"error": ...}``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _root() + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # measure glibc's defaults, which the model assumes
    try:
        p = subprocess.run([sys.executable, "-m", "memguard_bench", "--child", json.dumps(case)],
                           capture_output=True, text=True, cwd=_root(), env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s", "date": _today()}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"error": f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}", "date": _today()}
    rec = json.loads(line[-1][7:])
    rec.setdefault("date", _today())  # the day it was measured (UTC): --reuse keeps it
    return rec


def _today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


def _model_spec(d: dict):
    from memguard_core.spec import LinearShape, ModelSpec, ParamCounts, VisionTower

    d = dict(d)
    d["params"] = ParamCounts(**d["params"])
    d["block_linears"] = tuple(LinearShape(**x) for x in d.get("block_linears") or ())
    vt = d.get("vision_tower")
    if isinstance(vt, dict):  # a recorded vision-language spec: its tower's linears as LinearShape too
        vt = dict(vt)
        for key in ("block_linears", "projector_linears", "unused_linears"):
            vt[key] = tuple(LinearShape(**x) if isinstance(x, dict) else x for x in vt.get(key) or ())
        d["vision_tower"] = VisionTower(**vt)
    return ModelSpec(**d)


#: ModelSpec fields read from the config that records made before the field existed lack.
_CONFIG_FIELDS = ("attention_dropout", "residual_dropout", "embedding_dropout", "attn_logit_softcapping",
                  "final_logit_softcapping")


def _with_config_fields(case: dict, spec: dict) -> dict:
    """A recorded HF model spec with the config-derived fields it lacks (a record measured before
    they existed) read from the case's architecture config, so ``--reuse`` scores today's model."""
    if case.get("backend") != "hf" or all(f in spec for f in _CONFIG_FIELDS):
        return spec
    try:
        from transformers import AutoConfig

        from memguard_core.estimator.readers_hf import config_numbers as _config_numbers

        archs = HF_FULL_DEPTH_ARCHS if case.get("full_depth") else {**HF_ARCHS, **HF_HELD_OUT_ARCHS}
        arch = dict(archs[case["arch"]])
        nums = _config_numbers(AutoConfig.for_model(arch.pop("model_type"), **arch))
    except Exception:
        return spec
    return dict(spec, **{f: nums[f] for f in _CONFIG_FIELDS if f not in spec and f in nums})


def specs_of(case: dict, rec: dict):
    """(ModelSpec, TrainSpec) of a measured case: the model as introspected in the child; the
    settings from the case (HF) or as ``memguard_mlx`` read them from mlx_lm's args (MLX)."""
    from memguard_core.spec import TrainSpec

    ms = _model_spec(_with_config_fields(case, rec["model_spec"]))
    if rec.get("train_spec"):
        t = dict(rec["train_spec"])
        t["lora_targets"] = tuple(t["lora_targets"])
        if "ranks" in t:  # records written before TrainSpec.ranks became world_size
            t["world_size"] = t.pop("ranks")
        return ms, TrainSpec(**t)
    kw = case["train"]
    return ms, TrainSpec(batch_size=kw["batch_size"], seq_length=kw["seq_length"], grad_accum=kw["grad_accum"],
                         method=kw["method"], lora_rank=kw["lora_rank"], lora_targets=tuple(kw["lora_targets"]),
                         lora_layers=kw["lora_layers"], lora_dropout=kw.get("lora_dropout", 0.0),
                         optimizer=kw["optimizer"], dtype=kw["dtype"],
                         mixed_precision=kw["mixed_precision"], grad_checkpoint=kw["grad_checkpoint"],
                         attn_impl=kw["attn_impl"], framework="hf", device=case.get("device", "cpu"),
                         resident_file_bytes=rec.get("resident_file_bytes"),
                         heap_trim=bool(rec.get("heap_trim", case.get("trim_heap", True))))


def seed_estimate_bytes(ms, ts) -> Optional[int]:
    """The seed product's estimate (``ml-memguard``'s ``memory_guard.estimate_training_memory``,
    when installed) for the same model and settings, in bytes; None when it is not installed or
    refuses the input. Mapping: total parameters, hidden / heads / kv heads / layers /
    intermediate size, weight bits, MoE experts; method, micro-batch, sequence, LoRA rank, LoRA
    layers (all blocks unless limited), number of LoRA'd projections per block, optimizer,
    checkpointing, accumulation, mixed precision (= a half compute dtype), flash attention
    (= not eager), MLX lazy evaluation for MLX runs."""
    try:
        import memory_guard as mg  # noqa: F401
        from memory_guard.estimator import (FinetuneMethod, ModelArch, ModelSpec as SMS, TrainSpec as STS,
                                            estimate_training_memory)
    except Exception:
        return None
    try:
        from memguard_core.estimator.trainable import block_linear_shapes as _block_linears, lora_linears as _lora_linears

        n_targets = len(_lora_linears(ms, ts)) if ts.method != "full" else 0
        moe = ms.num_experts > 1
        sm = SMS(params=int(ms.total_params), hidden_dim=ms.hidden_size, num_heads=ms.num_heads,
                 num_kv_heads=ms.num_kv_heads, num_layers=ms.num_layers,
                 intermediate_dim=ms.moe_intermediate_size or ms.intermediate_size,
                 bits=int(min(32, max(4, round(ms.dense_bits)))),
                 arch=ModelArch.MOE if moe else ModelArch.DENSE,
                 num_experts=max(1, ms.num_experts), num_active_experts=max(1, ms.num_experts_per_tok))
        method = {"full": FinetuneMethod.FULL, "lora": FinetuneMethod.LORA, "qlora": FinetuneMethod.QLORA}[ts.method]
        opt = {"adamw-8bit": "adamw"}.get(ts.optimizer, ts.optimizer)
        st = STS(method=method, batch_size=ts.batch_size, seq_length=ts.seq_length, lora_rank=ts.lora_rank,
                 lora_layers=ts.lora_layers or ms.num_layers, lora_targets=max(1, n_targets),
                 optimizer=opt.replace("sgd-momentum", "sgd"), grad_checkpoint=ts.grad_checkpoint,
                 grad_accumulation=ts.grad_accum, mixed_precision=ts.dtype != "fp32",
                 flash_attention=ts.attn_impl != "eager", lazy_evaluation=ts.framework == "mlx")
        del _block_linears
        return int(estimate_training_memory(model=sm, train=st).total_mb * MiB)
    except Exception:
        return None


#: The label of the cases whose CPU counter carries a backend effect beyond the estimator's tensors:
#: a mixture-of-experts model computing in bf16 on torch's CPU backend. The experts' row slices,
#: their bf16-matmul transients and gradients take new sizes every step (tokens per expert follow
#: the routing, and the router changes with every update) and oneDNN's per-shape caches place new
#: entries among them; under glibc's dynamic mmap threshold the freed space stays resident, so the
#: peak grows step after step while the bytes in use stay flat. A guarded run fixes the threshold
#: (``guard.fix_mmap_threshold``) and so do these cases' children. The same loop in fp32 is flat,
#: and so are mlx_lm runs of the same shapes (docs/estimator.md, "MoE in bf16 on CPU"). CUDA's
#: caching allocator rounds and pools blocks instead of growing a heap.
CPU_BF16_MOE = "cpu-bf16-moe"


def cpu_bf16_moe(ms, ts) -> bool:
    """True for a mixture-of-experts model (``ms.is_moe``) whose matmuls run in bf16 (pure bf16 or
    bf16 autocast) on torch's CPU backend (``ts.framework`` hf / lightning, ``ts.device`` cpu):
    the cases :data:`CPU_BF16_MOE` labels and the reports summarise apart."""
    from memguard_core.spec import routed_half_precision_on_cpu

    return routed_half_precision_on_cpu(ms, ts) and ts.dtype == "bf16"


def score(case: dict, rec: dict, *, seed: bool = True) -> dict:
    """Estimate a measured case; returns a result row (name, backend, counter, estimate_bytes,
    actual_bytes, error = (estimate - actual) / actual, phase, seconds, breakdown, seed_*)."""
    from memguard_core.estimate import estimate

    ms, ts = specs_of(case, rec)
    est = estimate(ms, ts)
    actual = int(rec["peak_bytes"])
    row = dict(name=case["name"], backend=case["backend"], held_out=bool(case.get("held_out")),
               counter=rec.get("counter", ts.device),
               estimate_bytes=int(est.peak_bytes), actual_bytes=actual,
               error=(est.peak_bytes - actual) / actual, phase=est.phase, seconds=rec.get("seconds"),
               breakdown=est.breakdown)
    if case.get("full_depth"):
        row.update(full_depth=True, arch_fitted=bool(case.get("arch_fitted")), date=rec.get("date"))
    if cpu_bf16_moe(ms, ts):
        row["cpu_backend_effect"] = CPU_BF16_MOE
    if rec.get("step_peak_bytes"):
        row["step_peak_bytes"] = list(rec["step_peak_bytes"])
    if seed:
        sb = seed_estimate_bytes(ms, ts)
        if sb is not None:
            row["seed_estimate_bytes"] = sb
            row["seed_error"] = (sb - actual) / actual
    return row


def _pct(xs: Sequence[float], q: float) -> float:
    """The q-quantile (linear interpolation between order statistics, numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(rows: Sequence[dict], key: str = "error") -> dict:
    """``{"cases", "median_abs", "p90_abs", "worst_under", "worst_over", "worst_under_case"}`` over
    the rows that have ``key`` (fractions, signed: negative = under-estimate)."""
    rs = [r for r in rows if r.get(key) is not None]
    if not rs:
        return {"cases": 0}
    errs = [r[key] for r in rs]
    under = min(rs, key=lambda r: r[key])
    return dict(cases=len(rs), median_abs=statistics.median(abs(e) for e in errs),
                p90_abs=_pct([abs(e) for e in errs], 0.9), worst_under=min(errs), worst_over=max(errs),
                worst_under_case=under["name"])


#: The fingerprint fields that name the machine (not the software) a measurement ran on.
MACHINE_KEYS = ("os", "machine", "cpu", "cores", "memory_total_gib")


def reported_fingerprint(here: dict, saved: Optional[dict], fresh: int) -> dict:
    """The machine line of a report re-scored with ``--reuse``: ``here`` is this machine's
    :func:`machine_fingerprint`, ``saved`` the reused file's, ``fresh`` how many cases ran here.

    Every measurement reused (``fresh`` 0): the reused file's machine and versions, with this
    checkout's ``memguard_commit`` (the estimator scored) and the commit the file was measured at as
    ``measured_at_commit`` where they differ. Some cases run here on another machine: this machine,
    with ``reused_measurements_from`` naming the other one. Otherwise ``here`` as it is."""
    if not saved:
        return here
    if fresh == 0:
        out = {**saved, "memguard_commit": here.get("memguard_commit")}
        if saved.get("memguard_commit") and saved.get("memguard_commit") != here.get("memguard_commit"):
            out["measured_at_commit"] = saved["memguard_commit"]
        return out
    if any(saved.get(k) != here.get(k) for k in MACHINE_KEYS):
        return {**here, "reused_measurements_from": " / ".join(str(saved.get(k)) for k in MACHINE_KEYS)}
    return here


def machine_fingerprint() -> dict:
    """What the results depend on: OS, CPU, cores, memory, Python and framework versions."""
    from memguard_core.calibration import cpu_model

    fp = dict(os=f"{platform.system()} {platform.release()}", machine=platform.machine(),
              cpu=cpu_model(), cores=os.cpu_count(), python=platform.python_version())
    try:
        from memguard_core.probes import probe

        snap = probe()
        fp["memory_total_gib"] = round(snap.total_bytes / 2**30, 1)
    except Exception:
        pass
    from importlib import metadata

    try:  # the tree the bench ran from (the estimator scored), when it is a git checkout
        root = _root()
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=30)
        if rev.returncode == 0 and rev.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "memguard_core", "memguard_mlx",
                                    "memguard_hf"], cwd=root, capture_output=True, text=True, timeout=30)
            fp["memguard_commit"] = rev.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except Exception:
        pass
    for pkg in ("memguard-train", "torch", "transformers", "peft", "accelerate", "mlx", "mlx-lm", "ml-memguard"):
        try:
            fp[pkg] = metadata.version(pkg)
        except Exception:
            pass
    return fp


def _fmt_mib(b: Optional[int]) -> str:
    return "-" if b is None else f"{b / MiB:,.1f}"


def _fmt_err(e: Optional[float]) -> str:
    return "-" if e is None else f"{e * 100:+.1f}%"


def _summary_line(s: dict, label: str) -> str:
    if not s.get("cases"):
        return f"{label}: no cases"
    return (f"{label}: {s['cases']} cases, median |error| {s['median_abs'] * 100:.1f}%, p90 "
            f"{s['p90_abs'] * 100:.1f}%, worst under-estimate {s['worst_under'] * 100:+.1f}% "
            f"({s['worst_under_case']}), worst over {s['worst_over'] * 100:+.1f}%")


def _git_measured_dates(path: str, peaks: Dict[str, int]) -> Dict[str, str]:
    """For saved records without a ``date`` (made before records carried one): the date of the
    oldest commit of ``path`` from which on the record's ``peak_bytes`` is unchanged, i.e. when it
    was measured (a ``--reuse`` re-score commits the same peaks again and does not move it).
    ``peaks``: name -> peak_bytes as in the file now. Empty outside git."""
    cwd, base = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        p = subprocess.run(["git", "log", "--format=%H %cs", "--", base], cwd=cwd, capture_output=True,
                           text=True, timeout=60)
        commits = [ln.split() for ln in p.stdout.splitlines() if ln.strip()] if p.returncode == 0 else []
    except Exception:
        return {}
    dates: Dict[str, str] = {}
    pending = dict(peaks)
    for sha, day in commits:  # newest first
        try:
            q = subprocess.run(["git", "show", f"{sha}:./{base}"], cwd=cwd, capture_output=True, text=True,
                               timeout=60)
            old = {r.get("name"): (r.get("measured") or {}).get("peak_bytes")
                   for r in json.loads(q.stdout).get("cases", [])}
        except Exception:
            break
        for name in list(pending):
            if old.get(name) == pending[name]:
                dates[name] = day
            else:
                del pending[name]
        if not pending:
            break
    return dates


def baseline_summary(path: str) -> Optional[dict]:
    """The small / truncated matrix saved by an earlier ``--json`` run (``bench/results/bench_cpu.json``),
    its measurements re-scored by this estimator: ``{"path", "date", "date_source", "cases",
    "hf", "mlx", "all"}`` (each a ``summarize`` dict); None when the file cannot be read. Its date is
    the file's ``date`` field, else the date of the last commit of the file, else its mtime."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    rows, recs = [], {}
    for r in old.get("cases", []):
        rec, case = r.get("measured") or {}, r.get("case")
        if not case or "peak_bytes" not in rec or case.get("full_depth"):
            continue
        try:
            rows.append(score(case, rec, seed=False))
            recs[case["name"]] = rec
        except Exception:
            continue
    days = {n: rec["date"] for n, rec in recs.items() if rec.get("date")}
    src = "the records' dates"
    missing = {n: rec["peak_bytes"] for n, rec in recs.items() if n not in days}
    if missing:
        days.update(_git_measured_dates(path, missing))
        src = "the records' dates and the file's git history" if len(days) > len(missing) else \
            "the file's git history (the commit each peak was first saved in)"
    date = ", ".join(sorted(set(days.values())))
    if len(days) < len(recs):  # some records dated by nothing better: the file's own stamp
        fallback = old.get("date") or time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(path)))
        date, src = ", ".join(sorted(set(days.values()) | {fallback})), src + "; the rest: the file's date"
    return dict(path=path, date=date, date_source=src, cases=len(rows),
                hf=summarize([r for r in rows if r["backend"] == "hf"]),
                mlx=summarize([r for r in rows if r["backend"] == "mlx"]), all=summarize(rows))


def _full_depth_section(rows: Sequence[dict], baseline: Optional[dict]) -> List[str]:
    """The markdown of the full-depth summaries: (a) the full-depth set per backend, split by
    whether the architecture's block was in the fitted matrix; (b) the small / truncated matrix;
    the per-step peaks."""
    fd = [r for r in rows if r.get("full_depth") and "error" in r]
    dates = sorted({r.get("date") for r in fd if r.get("date")})
    out = ["### Summaries", "",
           "**No constant of the estimator was fitted on the full-depth cases.** The constants were "
           "fitted on the small matrix (`bench/results/bench_cpu.json`: 2-12 blocks of most architectures; "
           "SmolLM2-135M's 30 and OPT-125M's 12 blocks at 128-256 tokens; two checkpointed cases cut to 2 "
           "and 8 blocks at 2048 tokens; docs/estimator.md, \"Where the "
           "constants come from\"). HF CPU runs, here and there, return glibc's free heap at every optimizer "
           "step's end as a guarded run does (`GuardOptions.trim_heap`). These cases are held out by scale (every block of the published config; "
           "512-2048 tokens per micro-batch on HF) and, where the block type is not in the fitted matrix "
           "of that backend (granitemoe on HF, GPT-2 on mlx_lm), by architecture as well. The estimator "
           "scored here is the commit in the machine line.", "",
           f"(a) **full-depth set**, measured {', '.join(dates) or '-'}:"]
    for backend in ("hf", "mlx"):
        b = [r for r in fd if r["backend"] == backend]
        out.append("- " + _summary_line(summarize(b), f"full depth, {backend}"))
        for fitted, label in ((True, "architecture in the fitted matrix (held out by scale)"),
                              (False, "architecture not in the fitted matrix (held out by architecture and scale)")):
            sub = [r for r in b if bool(r.get("arch_fitted")) == fitted]
            if sub:
                out.append("  - " + _summary_line(summarize(sub), label))
        moe = [r for r in b if r.get("cpu_backend_effect") == CPU_BF16_MOE]
        if moe:
            out.append("  - " + _summary_line(summarize([r for r in b if r not in moe]),
                                              "without the bf16 MoE cases (what the estimator models)"))
            out.append("  - " + _summary_line(summarize(moe), "MoE in bf16 on the CPU (run as the guard runs "
                                                              "them: glibc's mmap threshold fixed, below)"))
    out.append("- " + _summary_line(summarize(fd), "**full depth, all**"))
    if baseline:
        out += ["", f"(b) **the small / truncated matrix** (`{os.path.relpath(baseline['path'], _root())}`, "
                    f"measured {baseline['date']} ({baseline['date_source']}), re-scored by this estimator):"]
        for k in ("hf", "mlx", "all"):
            out.append("- " + _summary_line(baseline[k], f"small matrix, {k}"))
    moe = [r["name"] for r in fd if r.get("cpu_backend_effect") == CPU_BF16_MOE]
    if moe:
        out += ["", f"**MoE in bf16 on the CPU ({', '.join(moe)}): counted in every summary above.** "
                    "The experts' row slices, bf16-matmul transients and gradients take new sizes every "
                    "step (tokens per expert follow the routing) and oneDNN's per-shape caches place new "
                    "entries among them, so under glibc's defaults the freed space stays resident as holes "
                    "and the peak grows step after step while the bytes in use stay flat. These runs did "
                    "what a guarded run does (`GuardOptions.trim_heap`): glibc's mmap threshold fixed at "
                    "4 MiB at train start and the free heap handed back at every step's end; compare the "
                    "per-step peaks below (last / first step). A plain run of such a model on a CPU needs "
                    "the headroom of the growth (docs/estimator.md, \"MoE in bf16 on CPU\"; "
                    "docs/monitor.md, \"The CPU heap between steps\")."]
    steps = _per_step_table(rows)
    return out + ([""] + steps if steps else [])


def _per_step_table(rows: Sequence[dict]) -> List[str]:
    """The per-step peaks of the rows that recorded them (markdown lines; none when no row did)."""
    steps = [r for r in rows if r.get("step_peak_bytes")]
    if not steps:
        return []
    out = ["Per-step peaks (the counter's peak inside each optimizer step, MiB; the whole-run peak "
               "is the largest of these and the readings before, between and after the steps):", "",
           "| case | steps | per-step peak MiB | whole run MiB | last / first step |", "|---|---|---|---|---|"]
    for r in steps:
        sp = r["step_peak_bytes"]
        out.append(f"| {r['name']} | {len(sp)} | {', '.join(f'{b / MiB:,.0f}' for b in sp)} | "
                   f"{_fmt_mib(r.get('actual_bytes'))} | {sp[-1] / sp[0]:.3f} |")
    return out


def markdown_report(rows: Sequence[dict], fingerprint: Optional[dict] = None, *, elapsed_s: float = 0,
                    title: str = "memguard bench", date: Optional[str] = None,
                    baseline: Optional[dict] = None) -> str:
    """A markdown report: the date header, the machine, one table row per case, the summaries
    (memguard, and the seed package when it was scored); with full-depth rows also their
    summaries, the small matrix's (``baseline``, see ``baseline_summary``) and the per-step peaks."""
    out = [f"## {title}", ""]
    if date:
        measured = sorted({r.get("date") for r in rows if r.get("date")})
        out += [f"Report date: {date}" + (f"; measured: {', '.join(measured)}" if measured else ""), ""]
    if fingerprint:
        out += ["Machine: " + ", ".join(f"{k} `{v}`" for k, v in fingerprint.items()), ""]
    has_seed = any("seed_error" in r for r in rows)
    has_s = any(r.get("full_depth") for r in rows)
    hdr = ("| case | counter | estimate MiB | actual MiB | error | phase |" + (" s |" if has_s else "")
           + (" ml-memguard MiB | ml-memguard error |" if has_seed else ""))
    out += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in rows:
        line = (f"| {r['name']} | {r.get('counter', '')} | {_fmt_mib(r.get('estimate_bytes'))} | "
                f"{_fmt_mib(r.get('actual_bytes'))} | {_fmt_err(r.get('error')) if 'error' in r else 'FAILED'} | "
                f"{r.get('phase', '')} |")
        if has_s:
            line += f" {r['seconds']:.0f} |" if r.get("seconds") else " - |"
        if has_seed:
            line += f" {_fmt_mib(r.get('seed_estimate_bytes'))} | {_fmt_err(r.get('seed_error'))} |"
        out.append(line)
    out.append("")
    ok = [r for r in rows if "error" in r]
    for backend in sorted({r["backend"] for r in ok}):
        out.append("- " + _summary_line(summarize([r for r in ok if r["backend"] == backend]), f"memguard, {backend}"))
    out.append("- " + _summary_line(summarize(ok), "**memguard, all**"))
    held = [r for r in ok if r.get("held_out")]
    if held:
        out.append("- " + _summary_line(summarize([r for r in ok if not r.get("held_out")]),
                                         "memguard, the matrix the constants were fitted on"))
        out.append("- " + _summary_line(summarize(held), "**memguard, held out** (architectures no constant was "
                                                         "fitted on)"))
    moe = [r for r in ok if r.get("cpu_backend_effect") == CPU_BF16_MOE and not r.get("full_depth")]
    if moe:
        out.append("- " + _summary_line(summarize([r for r in ok if r not in moe]),
                                         "memguard, without MoE in bf16 on the CPU"))
        out.append("- " + _summary_line(summarize(moe), "MoE in bf16 on the CPU (a backend effect not modelled; "
                                                        "per-step peaks below)"))
    if has_seed:
        out.append("- " + _summary_line(summarize(ok, "seed_error"), "ml-memguard (seed), same cases"))
    failed = [r["name"] for r in rows if "error" not in r]
    if failed:
        out.append(f"- failed: {', '.join(failed)}")
    if elapsed_s:
        out.append(f"- wall time {elapsed_s / 60:.1f} min")
    out.append("")
    if any(r.get("full_depth") for r in rows):
        out += _full_depth_section(rows, baseline) + [""]
        for r in rows:
            if "error" not in r:
                out.append(f"- {r['name']} failed: {str(r.get('failure', ''))[-300:]}")
        out.append("")
    else:  # (the full-depth section carries its own)
        steps = _per_step_table(rows)
        out += steps + [""] if steps else []
    return "\n".join(out)


def _rich_table(rows: Sequence[dict]):
    from rich.table import Table

    has_seed = any("seed_error" in r for r in rows)
    t = Table(title="memguard bench: estimate vs measured peak (fresh process per case)")
    for col, just in (("case", "left"), ("counter", "left"), ("estimate MiB", "right"), ("actual MiB", "right"),
                      ("error", "right"), ("phase", "left"), ("s", "right")):
        t.add_column(col, justify=just)
    if has_seed:
        t.add_column("ml-memguard MiB", justify="right")
        t.add_column("ml-memguard err", justify="right")
    for r in rows:
        if "error" not in r:
            t.add_row(r["name"], "", "", "", "[red]FAILED[/red]", "", "")
            continue
        e = r["error"]
        col = "red" if e < -0.05 else ("yellow" if abs(e) > 0.10 else "green")
        cells = [r["name"], r["counter"], _fmt_mib(r["estimate_bytes"]), _fmt_mib(r["actual_bytes"]),
                 f"[{col}]{_fmt_err(e)}[/{col}]", r.get("phase", ""), f"{r.get('seconds') or 0:.0f}"]
        if has_seed:
            cells += [_fmt_mib(r.get("seed_estimate_bytes")), _fmt_err(r.get("seed_error"))]
        t.add_row(*cells)
    return t


def _mlx_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None


def _cuda_available() -> bool:
    try:
        p = subprocess.run([sys.executable, "-c", "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True, timeout=120)
        return p.returncode == 0
    except Exception:
        return False


#: ``--set`` choices: ``matrix`` (the fitted small / truncated matrix), ``held-out`` (architectures
#: no constant was fitted on), ``all`` (those two: the long full-depth set is not in it),
#: ``full-depth`` (every block of published configs at 512-2048 tokens, HF and mlx_lm).
CASE_SETS = ("all", "matrix", "held-out", "full-depth")


def in_set(case: dict, case_set: str) -> bool:
    """Whether ``case`` belongs to ``case_set`` (see ``CASE_SETS``)."""
    if case_set == "full-depth":
        return bool(case.get("full_depth"))
    if case.get("full_depth"):
        return False
    if case_set == "matrix":
        return not case.get("held_out")
    if case_set == "held-out":
        return bool(case.get("held_out"))
    return True


def select(quick: bool = False, only: Sequence[str] = (), backends: Sequence[str] = ("hf", "mlx"),
           cuda: bool = False, case_set: str = "all") -> List[dict]:
    """The cases to run: the quick subset or all, filtered by name substrings, backend and set
    (``CASE_SETS``); with ``cuda`` each HF case also runs on the GPU (counter ``cuda``).

    Raises:
        ValueError: ``case_set`` not in ``CASE_SETS``.
    """
    if case_set not in CASE_SETS:
        raise ValueError(f"case_set: expected one of {CASE_SETS}, got {case_set!r}")
    out = []
    for c in CASES:
        if quick and not c["quick"]:
            continue
        if not in_set(c, case_set):
            continue
        if only and not any(o in c["name"] for o in only):
            continue
        if c["backend"] not in backends:
            continue
        out.append(c)
        if cuda and c["backend"] == "hf":
            g = dict(c, device="cuda", name=c["name"].replace("hf-", "hf-cuda-", 1))
            out.append(g)
    return out


def _write_json(path: str, records: list, rows: list, elapsed: float, fp: Optional[dict] = None, *,
                date: Optional[str] = None, case_set: Optional[str] = None,
                baseline: Optional[dict] = None) -> None:
    ok = [r for r in rows if "error" in r]
    extra: Dict[str, Any] = {}
    fd = [r for r in ok if r.get("full_depth")]
    if fd:
        extra["full_depth_summary"] = {k: summarize([r for r in fd if k == "all" or r["backend"] == k])
                                       for k in ("hf", "mlx", "all")}
        if any(r.get("cpu_backend_effect") for r in fd):
            extra["full_depth_summary"]["hf_without_cpu_bf16_moe"] = summarize(
                [r for r in fd if r["backend"] == "hf" and not r.get("cpu_backend_effect")])
            extra["full_depth_summary"][CPU_BF16_MOE] = summarize(
                [r for r in fd if r.get("cpu_backend_effect") == CPU_BF16_MOE])
    if baseline:
        extra["baseline_summary"] = baseline
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(date=date or _today(), set=case_set, fingerprint=fp or {}, elapsed_s=elapsed,
                       summary=summarize(ok), seed_summary=summarize(ok, "seed_error"), **extra,
                       cases=[dict(r, result=row) for r, row in zip(records, rows)]), f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``memguard bench``: run the matrix, print the table and the summary. Returns the exit code
    (0: every selected case ran; 1: some failed; 2: bad arguments)."""
    ap = argparse.ArgumentParser(prog="memguard bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (~1-2 min; CI)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="cases whose name contains TEXT (repeatable)")
    ap.add_argument("--set", dest="case_set", choices=CASE_SETS, default="all",
                    help="matrix: the small / truncated matrix the estimator's constants were fitted on; "
                         "held-out: architectures nothing was fitted on; all: those two (~20 min); "
                         "full-depth: every block of published configs (GPT-2, SmolLM2-135M/360M, "
                         "Qwen2.5-0.5B, TinyLlama-1.1B, Llama-3.2-1B, Granite-3 1B-A400M and TinyMixtral "
                         "MoEs) at 512-2048 tokens per micro-batch on HF and short rows on mlx_lm, per-step "
                         "peaks recorded (~1 hour; not part of all) [all]"),
    ap.add_argument("--backend", action="append", choices=("hf", "mlx"),
                    help="only these backends (default: hf, and mlx when installed)")
    ap.add_argument("--cuda", action="store_true", help="also run the HF cases on CUDA (when a GPU is present)")
    ap.add_argument("--json", metavar="PATH", help="write cases, measurements and results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the markdown report")
    ap.add_argument("--submit", action="store_true", help="print a ready-to-file markdown report")
    ap.add_argument("--reuse", metavar="PATH",
                    help="re-estimate measurements saved by --json (runs only the missing; the report's machine "
                         "line stays the measuring machine's, with this checkout's commit as the estimator's)")
    ap.add_argument("--no-seed", action="store_true", help="do not score ml-memguard even when installed")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per case [the case's own limit (full-depth cases), else 600]")
    ap.add_argument("--date", default=None, metavar="YYYY-MM-DD",
                    help="the date stamped on the markdown / JSON report [today, UTC]")
    ap.add_argument("--baseline", default=None, metavar="PATH",
                    help="with full-depth cases: the small matrix's saved JSON whose summary (re-scored) "
                         "the report shows beside them [bench/results/bench_cpu.json; 'none' to skip]")
    ap.add_argument("--gate", action="store_true",
                    help="exit 4 when a case is under-estimated by more than --max-under or the median "
                         "|error| is above --max-median (make test runs --quick --gate)")
    ap.add_argument("--max-under", type=float, default=0.05, metavar="FRACTION",
                    help="gate: the largest under-estimate allowed [0.05]")
    ap.add_argument("--max-median", type=float, default=0.05, metavar="FRACTION",
                    help="gate: the largest median |error| allowed [0.05]")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(_child(json.loads(a.child))), flush=True)
        return 0

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    backends = a.backend or (["hf", "mlx"] if _mlx_available() else ["hf"])
    if "mlx" in backends and not _mlx_available():
        con.print("[yellow]mlx / mlx-lm not installed: skipping the MLX cases[/yellow]")
        backends = [b for b in backends if b != "mlx"]
    cuda = bool(a.cuda and _cuda_available())
    if a.cuda and not cuda:
        con.print("[yellow]--cuda: no CUDA device visible to torch; CPU only[/yellow]")
    sel = select(a.quick, a.only, backends, cuda, a.case_set)
    if a.list:
        for c in sel:
            con.print(c["name"])
        return 0
    if not sel:
        con.print("[red]no case matches[/red]")
        return 2
    date = a.date or _today()
    saved: Dict[str, Any] = {}
    saved_fp: Optional[dict] = None   # the reused file's machine
    fresh = 0                         # cases run here
    measured_s = 0.0  # wall time of the runs a reused file measured
    if a.reuse and os.path.exists(a.reuse):
        with open(a.reuse) as f:
            old = json.load(f)
        saved = {r["name"]: r for r in old.get("cases", [])}
        saved_fp = old.get("fingerprint") or None
        measured_s = float(old.get("elapsed_s") or 0)
    t0 = time.time()
    rows, records = [], []
    with Progress(TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=con,
                  transient=False) as prog:
        task = prog.add_task("", total=len(sel))
        for c in sel:
            prog.update(task, description=c["name"])
            rec = saved.get(c["name"], {}).get("measured") if a.reuse else None
            if rec is None:
                rec = run_case(c, a.timeout or c.get("timeout_s") or 600.0)
                fresh += 1
            records.append(dict(name=c["name"], case=c, measured=rec))
            if "error" in rec:
                rows.append(dict(name=c["name"], backend=c["backend"], failure=rec["error"],
                                 full_depth=bool(c.get("full_depth"))))
                prog.console.print(f"[red]{c['name']}: FAILED[/red] {rec['error'][-400:]}")
            else:
                try:
                    rows.append(score(c, rec, seed=not a.no_seed))
                except Exception as exc:  # an estimator error is a bench result, not a crash
                    rows.append(dict(name=c["name"], backend=c["backend"], failure=repr(exc),
                                     full_depth=bool(c.get("full_depth"))))
                    prog.console.print(f"[red]{c['name']}: estimate failed[/red] {exc!r}")
            prog.advance(task)
            if a.json:  # after every case: a long run interrupted keeps what it measured
                _write_json(a.json, records, rows, time.time() - t0, date=date, case_set=a.case_set)
    elapsed = time.time() - t0
    if a.reuse and all(c["name"] in saved for c in sel):
        elapsed = max(elapsed, measured_s)
    con.print(_rich_table(rows))
    ok = [r for r in rows if "error" in r]
    for backend in sorted({r["backend"] for r in ok}):
        con.print(_summary_line(summarize([r for r in ok if r["backend"] == backend]), f"memguard {backend}"))
    con.print("[bold]" + _summary_line(summarize(ok), "memguard all") + "[/bold]")
    if any(r.get("held_out") for r in ok):
        con.print(_summary_line(summarize([r for r in ok if not r.get("held_out")]), "memguard fitted matrix"))
        con.print("[bold]" + _summary_line(summarize([r for r in ok if r.get("held_out")]), "memguard held out")
                  + "[/bold]")
    fd = [r for r in ok if r.get("full_depth")]
    baseline = None
    if any(r.get("full_depth") for r in rows):
        for backend in sorted({r["backend"] for r in fd}):
            con.print("[bold]" + _summary_line(summarize([r for r in fd if r["backend"] == backend]),
                                               f"memguard full depth {backend}") + "[/bold]")
            moe = [r for r in fd if r["backend"] == backend and r.get("cpu_backend_effect")]
            if moe:
                con.print(_summary_line(summarize([r for r in fd if r["backend"] == backend and r not in moe]),
                                        f"memguard full depth {backend} without the bf16 MoE cases"))
        bpath = a.baseline or os.path.join(_root(), "bench", "results", "bench_cpu.json")
        if bpath.lower() != "none":
            baseline = baseline_summary(bpath)
            if baseline:
                con.print(_summary_line(baseline["all"], f"memguard small matrix ({baseline['date']}, re-scored)"))
    if any("seed_error" in r for r in ok):
        con.print(_summary_line(summarize(ok, "seed_error"), "ml-memguard (seed) on the same cases"))
    con.print(f"wall time {elapsed:.0f} s{' (of the reused measurements)' if a.reuse else ''}")
    fp = reported_fingerprint(machine_fingerprint(), saved_fp if a.reuse else None, fresh)
    if a.json:
        _write_json(a.json, records, rows, elapsed, fp, date=date, case_set=a.case_set, baseline=baseline)
    title = "memguard bench: full-depth set" if a.case_set == "full-depth" else "memguard bench"
    md = markdown_report(rows, fp, elapsed_s=elapsed, title=title, date=date, baseline=baseline)
    if a.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(a.markdown)), exist_ok=True)
        with open(a.markdown, "w") as f:
            f.write(md)
    if a.submit:
        print("\n<!-- memguard bench report: paste into a new issue -->\n" + md)
    if a.gate:
        failures = gate_failures(ok, max_under=a.max_under, max_median=a.max_median)
        for f in failures:
            con.print(f"[red]gate: {f}[/red]")
        if failures:
            return 4
        con.print(f"gate: passed (no case under by more than {a.max_under:.0%}, median |error| at most "
                  f"{a.max_median:.0%})")
    return 0 if len(ok) == len(rows) else 1


def gate_failures(rows: Sequence[dict], *, max_under: float = 0.05, max_median: float = 0.05) -> List[str]:
    """The accuracy gate of ``make test``: one message per violation among scored rows (fractions:
    an ``error`` below ``-max_under``, or a median |error| above ``max_median``); empty when the
    rows pass. No scored row at all is a violation too (the gate would prove nothing)."""
    scored = [r for r in rows if r.get("error") is not None]
    if not scored:
        return ["no case was scored"]
    out = [f"{r['name']} under-estimated by {-r['error']:.1%} (allowed {max_under:.0%})"
           for r in scored if r["error"] < -max_under]
    med = statistics.median(abs(r["error"]) for r in scored)
    if med > max_median:
        out.append(f"median |error| {med:.1%} above {max_median:.0%}")
    return out


if __name__ == "__main__":
    sys.exit(main())
