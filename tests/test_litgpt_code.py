"""``model_code="litgpt"``: what LitGPT's own model code keeps for the backward of a LoRA step,
measured on the real ``litgpt`` package and compared with ``memguard_core._litgpt.block_saves``.

LitGPT's ``GPT`` / ``LoRAQKVLinear`` (``litgpt/lora.py``) run as ``litgpt finetune lora`` runs them
(``litgpt/finetune/lora.py``): built under Lightning Fabric's ``bf16-true`` / ``32-true`` precision
(``fabric.init_module``), ``mark_only_lora_as_trainable``, ``fabric.setup_module``, a forward with
``lm_head_chunk_size=128``, the loss by ``chunked_cross_entropy`` and ``fabric.backward``. The bytes
autograd saves are counted with ``torch.autograd.graph.saved_tensors_hooks``: one count per
storage (a view such as SDPA's v keeps its whole fused qkv buffer), parameters and buffers left
out, each storage charged to the block whose forward was running when it was first saved. Two
sequence lengths are run and the difference is divided by the extra tokens, so per-block
constants (LoRA's index tensor, a norm's weight cast to fp32) drop out and what is left is bytes
per token. On CPU, dropout keeps its noise in the input dtype (``memguard_core.estimator.attention.dropout_bytes``).

The package is optional: the test skips unless ``litgpt`` imports. It needs only what the
``hf`` / ``lightning`` / ``dev`` extras already install (lightning, huggingface_hub, safetensors,
tokenizers, tqdm, psutil), so ``pip install --no-deps litgpt`` is enough (``make install`` does it:
litgpt's own pins, huggingface-hub < 1.4 and psutil 7.2.2, conflict with transformers 5) (checked with 0.4.13,
whose model code equals LitGPT commit 00af8b0d, and 0.5.13, which splits the fused qkv output into
q | k | v and repeats k / v with ``repeat_interleave`` for grouped queries: the same bytes).
"""

from __future__ import annotations

import collections
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("litgpt.lora")

from memguard_core.estimator import litgpt as _litgpt  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_hf.model_spec import model_spec_from_hf_config

C, HEADS, LAYERS, VOCAB, INTER = 256, 8, 3, 512, 1024
#: the two sequence lengths whose difference gives bytes per token (multiples of the head chunk, 128)
SHORT, LONG = 128, 256

#: LitGPT ``Config`` fields and the transformers config of the same model, per block layout
#: (``litgpt/config.py`` presets: Phi-1.5 / Phi-2, Pythia / StableLM-Alpha, Llama 2, Llama 3 / Mistral)
FAMILIES = {
    "phi": (dict(n_query_groups=HEADS, parallel_residual=True, shared_attention_norm=True,
                 norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", rotary_percentage=0.5,
                 bias=True, gelu_approximate="tanh"),
            dict(model_type="phi", num_key_value_heads=HEADS, partial_rotary_factor=0.5)),
    "gpt_neox": (dict(n_query_groups=HEADS, parallel_residual=True, shared_attention_norm=False,
                      norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", rotary_percentage=0.25,
                      bias=True),
                 dict(model_type="gpt_neox", rotary_pct=0.25, use_parallel_residual=True)),
    "llama": (dict(n_query_groups=HEADS, parallel_residual=False, shared_attention_norm=False,
                   norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", rotary_percentage=1.0, bias=False),
              dict(model_type="llama", num_key_value_heads=HEADS)),
    "llama_gqa": (dict(n_query_groups=2, parallel_residual=False, shared_attention_norm=False,
                       norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", rotary_percentage=1.0, bias=False),
                  dict(model_type="llama", num_key_value_heads=2)),
}

_SPECS: dict = {}


def _model_spec(family: str):
    if family not in _SPECS:
        hf = dict(FAMILIES[family][1], hidden_size=C, intermediate_size=INTER, num_attention_heads=HEADS,
                  num_hidden_layers=LAYERS, vocab_size=VOCAB)
        _SPECS[family] = model_spec_from_hf_config(hf, name=f"tiny-{family}")
    return _SPECS[family]


def _saved_per_block(family: str, dtype: str, p: float, tokens: int,
                     targets: tuple = ("query", "value")) -> list:
    """Bytes autograd saves in each block's forward of one LitGPT LoRA step of ``tokens`` tokens
    (batch 1), LoRA on ``targets`` of the fused qkv (default: query and value, ``finetune/lora.py``'s
    defaults), rank 4."""
    import lightning as L
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
    from litgpt.utils import chunked_cross_entropy

    cfg = Config(n_layer=LAYERS, n_embd=C, n_head=HEADS, intermediate_size=INTER, vocab_size=VOCAB,
                 padded_vocab_size=VOCAB, block_size=LONG, lora_r=4, lora_alpha=8, lora_dropout=p,
                 lora_query="query" in targets, lora_key="key" in targets, lora_value="value" in targets,
                 **FAMILIES[family][0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=f"{dtype}-true" if dtype == "bf16" else "32-true")
        torch.manual_seed(0)
        with fabric.init_module():
            model = GPT(cfg)
        mark_only_lora_as_trainable(model)
        model = fabric.setup_module(model)
    inner = model.module
    trainable = [n for n, t in inner.named_parameters() if t.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    owned = {t.untyped_storage().data_ptr() for t in list(inner.parameters()) + list(inner.buffers())}
    current = [None]
    for i, block in enumerate(inner.transformer.h):
        block.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        block.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    seen = set()
    per_block = collections.Counter()

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        # LoRA's index tensor is created lazily as a buffer during the first forward (0.4.x)
        if ptr not in seen and ptr not in owned and current[0] is not None:
            seen.add(ptr)
            per_block[current[0]] += st.nbytes()
        return t

    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]          # finetune/lora.py: output n predicts token n + 1
        loss = chunked_cross_entropy(logits, ids[..., 1:])
    fabric.backward(loss)
    assert torch.isfinite(loss)
    assert all(inner.get_parameter(n).grad is not None for n in trainable)
    return [per_block[i] for i in range(LAYERS)]


@pytest.mark.parametrize("p", [0.05, 0.0])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_saves_match_what_litgpt_keeps(family, dtype, p):
    _check_block_saves(family, dtype, p, ("query", "value"))


# the other parts of the fused qkv: all three (no zero padding: index_copy has nothing to fill) and
# key alone (the padding's source is the kv-wide slice)
@pytest.mark.parametrize("targets", [("query", "key", "value"), ("key",)])
@pytest.mark.parametrize("dtype,p", [("bf16", 0.05), ("fp32", 0.0)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_saves_for_other_qkv_targets(family, dtype, p, targets):
    _check_block_saves(family, dtype, p, targets)


def _check_block_saves(family: str, dtype: str, p: float, targets: tuple) -> None:
    ms = _model_spec(family)
    ts = TrainSpec(batch_size=1, seq_length=LONG, method="lora", lora_rank=4, lora_targets=targets,
                   lora_dropout=p, dtype=dtype, device="cpu", framework="lightning", model_code="litgpt")
    rule = _litgpt.block_saves(ms, ts)
    short = _saved_per_block(family, dtype, p, SHORT, targets)
    long_ = _saved_per_block(family, dtype, p, LONG, targets)
    per_token = [(b - a) / (LONG - SHORT) for a, b in zip(short, long_)]
    # every block above the bottom one (whose input needs no gradient) keeps the same
    middle = per_token[1:]
    assert len(set(middle)) == 1, per_token
    # what the rules leave out is a few bytes per token: a norm's mean / rstd, lora_A's r-wide output
    assert middle[0] == pytest.approx(rule.block, rel=0.02), (family, dtype, p, targets, per_token, rule)
    # the bottom block: no dropout mask, no first norm input (parallel residual: neither norm, nor the MLP)
    assert per_token[0] == pytest.approx(rule.first, rel=0.02), (family, dtype, p, targets, per_token, rule)
