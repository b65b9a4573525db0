"""Under activation checkpointing the top block's recompute and the logits' working set are never
live together, so the loss moment holds the larger of the two (moments.recompute_beyond_logits):
a real torch run checks the premise, the tiny spec of test_estimate checks the composition by hand.
"""
import weakref

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memguard_core.estimator.activations import activation_bytes
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.logits import head_input_bytes, logits_bytes
from memguard_core.estimator.moments import top_block_gradient_bytes
from tests.test_estimate import tiny, ts


def test_the_top_block_is_recomputed_after_the_logits_are_freed():
    # transformers' checkpointing as Trainer enables it (use_reentrant=False) and Trainer's
    # compute_loss, which returns the loss only: when the backward recomputes the top block, the
    # logits tensor is gone
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
    model = AutoModelForCausalLM.from_config(cfg)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    seen = []
    logits_ref = []

    def in_norm_hook(module, args):
        seen.append(logits_ref[0]() if logits_ref else "forward")

    # input_layernorm runs inside the checkpointed forward, so it runs again in the recompute
    # (transformers 5.x wraps the layer's own forward, whose hooks fire outside the checkpoint)
    model.model.layers[-1].input_layernorm.register_forward_pre_hook(in_norm_hook)

    def compute_loss(ids):
        out = model(input_ids=ids, labels=ids)
        logits_ref.append(weakref.ref(out.logits))
        return out.loss

    ids = torch.randint(0, 512, (1, 64))
    loss = compute_loss(ids)
    assert logits_ref[0]() is None  # nothing but the output held it; the loss keeps log_softmax's output
    loss.backward()
    # once in the forward (before the logits existed), once in the backward's recompute
    assert len(seen) == 2 and seen[1] is None
    assert model.model.layers[-1].self_attn.q_proj.weight.grad is not None


def test_loss_moment_holds_the_larger_of_logits_and_recompute():
    m = tiny()
    t = ts(method="lora", batch_size=4, seq_length=512, grad_checkpoint=True)
    tokens = 4 * 512
    loss = estimate(m, t).phase_breakdowns["loss"]
    blocks, _, _, one = activation_bytes(m, t)
    logits = logits_bytes(m, t)[0]
    assert blocks == 2 * 4 * 64 * tokens and logits == 12 * tokens * 1000   # fp32: hand counts
    grad = top_block_gradient_bytes(m, t)
    assert grad == 4 * 64 * tokens
    # a 1000-word vocabulary: the logits' working set outweighs the recomputed block + its gradient
    assert one + grad < logits
    assert loss["logits"] == logits
    assert loss["activations"] == blocks + head_input_bytes(m, t)
    # a 16-word vocabulary: the recompute does; only what it holds beyond the logits is added
    small = tiny(vocab_size=16)
    sl = estimate(small, t).phase_breakdowns["loss"]
    s_logits = logits_bytes(small, t)[0]
    assert one + grad > s_logits
    assert sl["logits"] == s_logits
    assert sl["activations"] == blocks + head_input_bytes(small, t) + one + grad - s_logits
    # without checkpointing nothing is recomputed: the loss moment keeps every block's activations
    plain = estimate(m, t.replace(grad_checkpoint=False)).phase_breakdowns["loss"]
    h, sc, lo, _ = activation_bytes(m, t.replace(grad_checkpoint=False))
    assert plain["activations"] == h + lo + head_input_bytes(m, t)



def test_cuda_holds_the_recompute_apart_from_the_logits_and_reserves_the_cache_they_leave():
    # the recompute runs after the logits are freed on cuda too; the caching allocator keeps the
    # freed logits' segment and the forward's block tensors reserved beside them
    # (cuda.unusable_cache_bytes; docs/estimator.md, "The CUDA reserved share of a checkpointed run")
    from memguard_core.estimator.cuda import unusable_cache_bytes
    from memguard_core.estimator.moments import top_block_gradient_bytes as top

    m = tiny()
    t = ts(method="lora", batch_size=4, seq_length=512, grad_checkpoint=True, device="cuda")
    blocks, _, _, one = activation_bytes(m, t)
    loss = estimate(m, t).phase_breakdowns["loss"]
    assert loss["activations"] == blocks + head_input_bytes(m, t) + max(0, one + top(m, t) - loss["logits"])
    assert loss["allocator_slack"] >= unusable_cache_bytes(m, t, one) > 0


def test_an_encoder_decoders_top_block_gradient_is_over_the_target_tokens():
    # the first block the backward recomputes is the decoder's last: its output gradient is
    # batch x target tokens x d_model, not batch x source tokens
    from transformers import T5Config

    from memguard_core.estimator.specs import TrainSpec
    from memguard_hf.model_spec import model_spec_from_hf_config

    t5 = model_spec_from_hf_config(T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=16,
                                            vocab_size=1000))
    assert t5.decoder_layers
    spec = TrainSpec(batch_size=4, seq_length=512, target_length=128, method="lora", dtype="fp32",
                     grad_checkpoint=True, framework="hf", device="cpu")
    assert top_block_gradient_bytes(t5, spec) == 4 * 128 * 64 * 4
    assert top_block_gradient_bytes(t5, spec.replace(target_length=None)) == 4 * 512 * 64 * 4
    assert top_block_gradient_bytes(tiny(), spec) == 4 * 512 * tiny().hidden_size * 4   # a decoder-only model
