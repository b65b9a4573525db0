"""The encoder block rule (memguard_core/estimator/encoder_blocks.py, docs/estimator.md "Encoder blocks"):
what one post-LN block of BERT, RoBERTa, DistilBERT and DeBERTa-v2 saves for its backward, per token,
against a census of the tensors real blocks save (``memguard_torch.saved_census``: autograd's
``saved_tensors_hooks``, parameters and buffers left out), for full fine-tuning and LoRA (PEFT),
fp32, pure bf16 and bf16 autocast, with the configs' dropouts at 0.1 and at 0; which specs take the
rule; and the bench's HF child building an encoder's head. Small configs, random weights, CPU.

Per token: the census at two micro-batch sizes, the difference over the added tokens, so what does
not grow with the rows (autocast's weight casts, counted by the weights term; DeBERTa's gather
indices) drops out; DeBERTa-v2's per-block part is checked on the totals.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memguard_core.estimator.activations import block_act_per_token  # noqa: E402
from memguard_core.estimator.encoder_blocks import is_post_norm_encoder  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_hf.model_spec import model_spec_from_hf_config  # noqa: E402
from memguard_torch.block_kinds import find_blocks  # noqa: E402
from memguard_torch.saved_census import saved_bytes_per_block  # noqa: E402

H, I, NH, L, S, B = 128, 512, 4, 3, 64, 2
_ARCH = {"bert": "BertForTokenClassification", "roberta": "RobertaForTokenClassification",
         "distilbert": "DistilBertForTokenClassification", "deberta-v2": "DebertaV2ForTokenClassification"}
#: q / v as PEFT's defaults name them (DistilBERT has no PEFT default), and every block linear
_QV = {"bert": ("query", "value"), "roberta": ("query", "value"), "distilbert": ("q_lin", "v_lin"),
       "deberta-v2": ("query_proj", "value_proj")}
_ALL = {"bert": ("query", "key", "value", "dense"), "roberta": ("query", "key", "value", "dense"),
        "distilbert": ("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"),
        "deberta-v2": ("query_proj", "key_proj", "value_proj", "dense")}


def _config(model_type: str, p: float, seq: int = S):
    kw = dict(vocab_size=1000, max_position_embeddings=512, architectures=[_ARCH[model_type]])
    if model_type == "distilbert":
        kw.update(dim=H, hidden_dim=I, n_heads=NH, n_layers=L, dropout=p, attention_dropout=p)
    else:
        kw.update(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_hidden_layers=L,
                  hidden_dropout_prob=p, attention_probs_dropout_prob=p)
    if model_type == "deberta-v2":
        # the released checkpoints' attention (microsoft/deberta-v3-base config.json): relative
        # positions in 256 buckets over 512 positions, c2p and p2c, shared position projections
        kw.update(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=256,
                  max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True,
                  position_biased_input=False)
    return transformers.AutoConfig.for_model(model_type, **kw)


def _census(model_type: str, *, p: float, attn: str, method: str, dtype: str, amp: bool, targets: tuple,
            lora_p: float, seq: int = S, rows=(B, 2 * B)) -> list:
    """Saved bytes of the last block at each micro-batch size in ``rows``."""
    torch.manual_seed(0)
    cfg = _config(model_type, p, seq)
    model = transformers.AutoModelForTokenClassification.from_config(cfg, attn_implementation=attn)
    if dtype == "bf16" and not amp:
        model = model.to(torch.bfloat16)
    if method == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(targets), lora_dropout=lora_p,
                                                           task_type="TOKEN_CLS"))
    model.train()
    blocks = find_blocks(model, L)
    out = []
    for b in rows:
        ids = torch.randint(5, 1000, (b, seq))

        def forward():
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
            with ctx:
                return model(input_ids=ids, attention_mask=torch.ones_like(ids))

        out.append(saved_bytes_per_block(forward, blocks, exclude=list(model.parameters()) + list(model.buffers()))[-1])
    return out


def _rule(model_type: str, *, p: float, attn: str, method: str, dtype: str, amp: bool, targets: tuple,
          lora_p: float, seq: int = S, rows: int = B) -> float:
    """The rule's bytes per token for one block, times the tokens of ``rows`` rows."""
    ms = model_spec_from_hf_config(_config(model_type, p, seq))
    assert is_post_norm_encoder(ms)
    ts = TrainSpec(batch_size=rows, seq_length=seq, method=method, dtype=dtype, mixed_precision=amp, attn_impl=attn,
                   lora_dropout=lora_p, lora_rank=4, lora_targets=targets or ("query",), device="cpu")
    a = block_act_per_token(ms, ts, lora=method != "full", trainable_block=method == "full")
    return (a.hidden + a.scores + a.lora) * rows * seq


_SETTINGS = [
    # (method, dtype, autocast, attention, config dropout, LoRA targets, LoRA dropout)
    ("full", "fp32", False, "sdpa", 0.1, "", 0.0),     # SDPA's math path (attention dropout)
    ("full", "fp32", False, "sdpa", 0.0, "", 0.0),     # SDPA's CPU flash kernel
    ("full", "fp32", False, "eager", 0.1, "", 0.0),
    ("full", "fp32", False, "eager", 0.0, "", 0.0),
    ("full", "bf16", False, "sdpa", 0.1, "", 0.0),
    ("full", "bf16", False, "sdpa", 0.0, "", 0.0),
    ("full", "bf16", True, "sdpa", 0.1, "", 0.0),
    ("full", "bf16", True, "sdpa", 0.0, "", 0.0),
    ("full", "bf16", True, "eager", 0.1, "", 0.0),
    ("lora", "fp32", False, "sdpa", 0.1, "qv", 0.0),
    ("lora", "fp32", False, "sdpa", 0.0, "qv", 0.0),
    ("lora", "bf16", False, "sdpa", 0.1, "qv", 0.0),
    ("lora", "bf16", True, "sdpa", 0.0, "qv", 0.0),
    ("lora", "fp32", False, "sdpa", 0.1, "qv", 0.1),
    ("lora", "fp32", False, "sdpa", 0.0, "all", 0.0),
    ("lora", "bf16", True, "sdpa", 0.1, "all", 0.0),
    ("lora", "bf16", False, "eager", 0.0, "all", 0.1),
]


def _targets(model_type: str, which: str) -> tuple:
    return {"": (), "qv": _QV[model_type], "all": _ALL[model_type]}[which]


@pytest.mark.parametrize("model_type", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("method,dtype,amp,attn,p,which,lora_p", _SETTINGS)
def test_rule_equals_the_census_per_token(model_type, method, dtype, amp, attn, p, which, lora_p):
    kw = dict(p=p, attn=attn, method=method, dtype=dtype, amp=amp, targets=_targets(model_type, which), lora_p=lora_p)
    small, large = _census(model_type, **kw)
    per_token = (large - small) / (B * S)
    assert per_token > 0
    assert _rule(model_type, **kw) / (B * S) == pytest.approx(per_token, rel=0.005)


def test_bert_base_block_is_24_units_of_4h_per_token():
    """BERT-base's block in fp32 full fine-tuning, 128 tokens per row, on CPU: 24 units of 4 x hidden
    bytes per token, 18 hidden-sized and 6 of scores (12 heads x 128 x 12 bytes / (4 x 768)), as the
    census of a real block says (the census here on the small config, whose scores are 6 units too:
    4 heads x 64 x 12 / (4 x 128))."""
    kw = dict(p=0.1, attn="sdpa", method="full", dtype="fp32", amp=False, targets=(), lora_p=0.0)
    bert = transformers.AutoConfig.for_model("bert", architectures=["BertForSequenceClassification"])
    ms = model_spec_from_hf_config(bert)
    ts = TrainSpec(batch_size=8, seq_length=128, method="full", dtype="fp32", device="cpu")
    a = block_act_per_token(ms, ts, lora=False, trainable_block=True)
    unit = 4 * ms.hidden_size
    assert a.hidden / unit == pytest.approx(18, abs=0.02) and a.scores / unit == pytest.approx(6)
    small, large = _census("bert", **kw)
    assert (large - small) / (B * S) / (4 * H) == pytest.approx(24, abs=0.05)


def test_deberta_v2_disentangled_attention():
    """DeBERTa-v2 as released (c2p and p2c over 512 relative positions): per token exactly, and the
    per-block part (gather indices, the dropped relative embeddings) on the totals."""
    for method, dtype, amp, p, which in (("full", "fp32", False, 0.1, ""), ("full", "fp32", False, 0.0, ""),
                                         ("full", "bf16", False, 0.1, ""), ("full", "bf16", True, 0.1, ""),
                                         ("lora", "fp32", False, 0.1, "qv"), ("lora", "bf16", True, 0.0, "all")):
        kw = dict(p=p, attn="eager", method=method, dtype=dtype, amp=amp, targets=_targets("deberta-v2", which),
                  lora_p=0.0, seq=128)
        small, large = _census("deberta-v2", **kw)
        rule_small, rule_large = _rule("deberta-v2", rows=B, **kw), _rule("deberta-v2", rows=2 * B, **kw)
        assert rule_large - rule_small == pytest.approx(large - small, rel=0.005), kw
        if not amp:  # autocast's weight casts are in the census totals, not per token
            assert rule_small == pytest.approx(small, rel=0.04), kw


def _spec(model_type: str, arch: str, **kw):
    return model_spec_from_hf_config(transformers.AutoConfig.for_model(
        model_type, architectures=[arch], hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=256, **kw))


@pytest.mark.parametrize("model_type,arch", [
    ("bert", "BertForSequenceClassification"), ("bert", "BertForTokenClassification"),
    ("bert", "BertForQuestionAnswering"), ("bert", "BertForMaskedLM"),
    ("roberta", "RobertaForSequenceClassification"), ("deberta-v2", "DebertaV2ForSequenceClassification"),
    ("electra", "ElectraForSequenceClassification"), ("xlm-roberta", "XLMRobertaForTokenClassification"),
])
def test_post_norm_encoders_take_the_rule(model_type, arch):
    assert is_post_norm_encoder(_spec(model_type, arch))


@pytest.mark.parametrize("model_type,arch,kw", [
    ("llama", "LlamaForSequenceClassification", dict(num_key_value_heads=2, pad_token_id=0)),
    ("llama", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    ("qwen2", "Qwen2ForTokenClassification", dict(num_key_value_heads=2, pad_token_id=0)),
    ("bert", "BertLMHeadModel", dict(is_decoder=True)),  # a causal LM: the default head, the decoder rule
])
def test_decoders_and_causal_heads_keep_their_rules(model_type, arch, kw):
    assert not is_post_norm_encoder(_spec(model_type, arch, **kw))


def test_bench_child_builds_the_head_an_arch_names(monkeypatch):
    """``memguard_bench/child_hf.py``: an arch naming ``architectures`` is built by its head's Auto class
    and trained on that head's targets (one Trainer step, tiny BERT); an arch naming none stays a causal
    LM with labels = inputs. The arch table lookup is given the tiny config (the case is not in the
    TOML tables)."""
    import memguard_bench.child_hf as child

    arch = dict(model_type="bert", architectures=["BertForTokenClassification"], hidden_size=32,
                intermediate_size=64, num_attention_heads=2, num_hidden_layers=2, vocab_size=128,
                id2label={str(i): f"L{i}" for i in range(5)})
    monkeypatch.setattr(child, "arch_of", lambda case: dict(arch))
    train = dict(method="lora", batch_size=2, seq_length=16, dtype="fp32", optimizer="adamw", attn_impl="sdpa",
                 grad_checkpoint=False, lora_rank=4, lora_targets=["query", "value"], mixed_precision=False,
                 grad_accum=1, lora_layers=None, lora_dropout=0.0)
    case = dict(name="tiny-bert-tokcls", backend="hf", arch="tiny-bert", train=train, steps=1, trim_heap=False)
    model, config, _ = child._build_model(case, torch)
    assert type(model.get_base_model()).__name__ == "BertForTokenClassification"
    assert model.peft_config["default"].task_type == "TOKEN_CLS"
    ds = child._dataset(4, 16, config.vocab_size, torch, child._head_kind(config), config.num_labels)
    row = ds[0]
    assert row["labels"].shape == (16,) and int(row["labels"].max()) < 5
    rec = child.run_hf_child(case)
    assert rec["model_spec"]["head"]["kind"] == "token_classification" and rec["peak_bytes"] > 0
    causal = child._dataset(2, 8, 128, torch)
    assert torch.equal(causal[1]["labels"], causal[1]["input_ids"])


@pytest.mark.parametrize("dtype,amp,lora_p", [("fp32", False, 0.1), ("bf16", False, 0.0), ("bf16", True, 0.0),
                                               ("bf16", True, 0.1)])
def test_adapter_inputs_kept_are_what_the_rule_adds_for_lora(dtype, amp, lora_p):
    """``activations.adapter_input_tensors`` (the CPU heap's view of the adapters' input copies) keeps
    for an encoder what the block rule adds when LoRA wraps every linear: the LoRA'd block's saved
    bytes less the same block without adapters and the adapters' ``x @ A``."""
    from memguard_core.estimator.activations import adapter_input_tensors

    ms = _spec("bert", "BertForTokenClassification")
    ts = TrainSpec(batch_size=2, seq_length=64, method="lora", lora_rank=4, lora_targets=_ALL["bert"], dtype=dtype,
                   mixed_precision=amp, lora_dropout=lora_p, device="cpu")
    with_lora = block_act_per_token(ms, ts, lora=True, trainable_block=False)
    without = block_act_per_token(ms, ts.replace(lora_targets=("__none__",)), lora=False, trainable_block=False)
    kept = sum(n * b for k, b, n in adapter_input_tensors(ms, ts) if k)
    added = (with_lora.hidden + with_lora.scores) - (without.hidden + without.scores)
    assert kept > 0 and added == pytest.approx(kept)
