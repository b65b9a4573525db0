"""The task head (``ModelSpec.head``, docs/estimator.md "Task heads"): read from a config's
``architectures`` and from a live module, its parameters counted as the classifier they are, the
logits and head terms per head checked against what transformers' heads save for the backward
(a census of ``torch.autograd.graph.saved_tensors_hooks``, parameters left out), and the one-line
refusal of a speech encoder-decoder or a head the estimator does not count."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.estimator.estimate import estimate  # noqa: E402
from memguard_core.estimator.heads import (AUTO_CLASSES, DEFAULT_HEAD, TaskHead, head_kind_from_architectures,  # noqa: E402
                                           head_of, parse_head)
from memguard_core.estimator.logits import head_input_bytes, logits_bytes  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_hf.model_spec import model_spec_from_hf_config  # noqa: E402
from memguard_torch.module_spec import model_spec_from_module  # noqa: E402

SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256, vocab_size=1000)
LLAMA = dict(SMALL, num_key_value_heads=2, pad_token_id=0)
B, S = 4, 64


def _config(model_type: str, arch: str, **kw):
    base = LLAMA if model_type == "llama" else SMALL
    return transformers.AutoConfig.for_model(model_type, architectures=[arch], **dict(base, **kw))


def _live(cfg):
    """The model ``cfg.architectures[0]`` names, random weights, training mode, fp32 (SDPA where the
    class has it)."""
    torch.manual_seed(0)
    kind = head_kind_from_architectures(cfg.architectures)
    return getattr(transformers, AUTO_CLASSES[kind]).from_config(cfg).train()


@pytest.mark.parametrize("model_type,arch,kind,reads,pooler_linear", [
    ("bert", "BertForSequenceClassification", "sequence_classification", "first_token", True),
    ("roberta", "RobertaForSequenceClassification", "sequence_classification", "first_token", False),
    ("distilbert", "DistilBertForSequenceClassification", "sequence_classification", "first_token", True),
    ("deberta-v2", "DebertaV2ForSequenceClassification", "sequence_classification", "first_token", True),
    ("llama", "LlamaForSequenceClassification", "sequence_classification", "all_tokens", False),
    ("bert", "BertForTokenClassification", "token_classification", "all_tokens", False),
    ("llama", "LlamaForQuestionAnswering", "question_answering", "all_tokens", False),
])
def test_head_read_from_architectures_and_counted_as_the_classifier(model_type, arch, kind, reads, pooler_linear):
    cfg = _config(model_type, arch, num_labels=2 if kind == "question_answering" else 3)
    ms = model_spec_from_hf_config(cfg)
    h = ms.head
    assert (h.kind, h.reads, h.pooler_linear, h.architecture) == (kind, reads, pooler_linear, arch)
    assert h.num_labels == (2 if kind == "question_answering" else 3)
    assert h.final_norm is (model_type == "llama")  # post-norm encoders end in a block's LayerNorm
    live = _live(cfg)
    # every parameter of the model users train is counted, and none as a vocabulary head
    assert ms.params.total == sum(p.numel() for p in live.parameters())
    assert ms.params.lm_head == 0 and not ms.tie_word_embeddings
    assert model_spec_from_module(live).head == h  # the live module reads the same head


def test_peft_sequence_classifier_reads_the_same_head():
    peft = pytest.importorskip("peft")
    cfg = _config("llama", "LlamaForSequenceClassification", num_labels=3)
    plain = model_spec_from_module(_live(cfg)).head
    wrapped = peft.get_peft_model(_live(cfg), peft.LoraConfig(r=4, task_type="SEQ_CLS", target_modules=["q_proj"]))
    assert model_spec_from_module(wrapped).head == plain
    assert (plain.kind, plain.reads, plain.num_labels) == ("sequence_classification", "all_tokens", 3)


_PEFT_TASK = {"sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
              "question_answering": "QUESTION_ANS"}
_QV = {"bert": ["query", "value"], "roberta": ["query", "value"], "distilbert": ["q_lin", "v_lin"],
       "deberta-v2": ["query_proj", "value_proj"], "llama": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("model_type,arch", [
    ("bert", "BertForSequenceClassification"), ("roberta", "RobertaForSequenceClassification"),
    ("distilbert", "DistilBertForSequenceClassification"), ("deberta-v2", "DebertaV2ForSequenceClassification"),
    ("llama", "LlamaForSequenceClassification"), ("bert", "BertForTokenClassification"),
    ("llama", "LlamaForQuestionAnswering"),
])
def test_lora_count_from_a_config_is_peft_count_with_its_task_head(model_type, arch):
    """PEFT's task type trains the classifier (``classifier`` / ``score``; RoBERTa's whole
    classification head, DistilBERT's ``pre_classifier`` too) or ``qa_outputs`` beside the adapters:
    the trainable count read from a config is PEFT's own count on the model built from it."""
    peft = pytest.importorskip("peft")
    kind = head_kind_from_architectures([arch])
    cfg = _config(model_type, arch, num_labels=2 if kind == "question_answering" else 3)
    ms = model_spec_from_hf_config(cfg)
    ts = TrainSpec(method="lora", lora_rank=8, lora_targets=tuple(_QV[model_type]), batch_size=B, seq_length=S)
    wrapped = peft.get_peft_model(_live(cfg), peft.LoraConfig(r=8, target_modules=_QV[model_type],
                                                              task_type=_PEFT_TASK[kind]))
    assert ms.head.peft_saved_params > 0
    assert estimate(ms, ts).trainable_params == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert model_spec_from_module(wrapped).head.peft_saved_params == ms.head.peft_saved_params


@pytest.mark.parametrize("model_type,arch,task,saved", [
    ("roberta", "RobertaForSequenceClassification", "SEQ_CLS", None),   # PEFT trains the head
    ("roberta", "RobertaForSequenceClassification", None, None),        # no task type: the head stays frozen
    ("llama", "LlamaForCausalLM", None, ["lm_head"]),                    # a user's modules_to_save
])
def test_live_lora_count_at_another_rank_keeps_what_peft_trains_beside_the_adapters(model_type, arch, task, saved):
    """The planner's rank cut on a live PEFT model: the adapters are re-derived at the new rank, and
    what the run trains beside them -- the ``modules_to_save`` copies PEFT made, or none -- is what
    PEFT's own count at that rank holds."""
    peft = pytest.importorskip("peft")
    cfg = _config(model_type, arch, num_labels=3)

    def wrapped(r):
        kw = dict(r=r, target_modules=_QV[model_type])
        if task:
            kw["task_type"] = task
        if saved:
            kw["modules_to_save"] = saved
        return peft.get_peft_model(_live(cfg), peft.LoraConfig(**kw))

    ms = model_spec_from_module(wrapped(8))
    assert ms.lora_rank_found == 8
    ts = TrainSpec(method="lora", lora_rank=4, lora_targets=tuple(_QV[model_type]), batch_size=B, seq_length=S)
    assert estimate(ms, ts).trainable_params == sum(p.numel() for p in wrapped(4).parameters() if p.requires_grad)


def test_masked_lm_head_and_causal_default():
    ms = model_spec_from_hf_config(_config("bert", "BertForMaskedLM"))
    assert (ms.head.kind, ms.head.transform, ms.head.final_norm) == ("masked_lm", True, False)
    assert ms.head.out_features(ms.vocab_size) == 1000
    llama = model_spec_from_hf_config(_config("llama", "LlamaForCausalLM"))
    assert llama.head is DEFAULT_HEAD
    assert model_spec_from_hf_config(_config("llama", "LlamaModel")).head is DEFAULT_HEAD  # names no head
    assert head_kind_from_architectures(None) == "causal_lm"


def test_head_override_builds_that_head():
    cfg = _config("bert", "BertForMaskedLM")
    ms = model_spec_from_hf_config(cfg, head="token-classification")
    assert ms.head.kind == "token_classification" and ms.head.num_labels == cfg.num_labels
    assert ms.params.lm_head == 0
    with pytest.raises(ConfigError, match="head"):
        parse_head("regression")


def test_head_override_wins_over_an_architecture_not_counted(tmp_path):
    """``--head`` names the head the run trains: a config whose ``architectures`` names a head the
    estimator does not count is estimated with the given head (as the refusal tells the user to
    do), from a config object and from a config.json alike; a Whisper config stays refused."""
    cfg = _config("llama", "LlamaForMultipleChoice")
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg.to_dict()))
    for src in (cfg, str(p)):
        with pytest.raises(ConfigError, match="--head names the head"):
            model_spec_from_hf_config(src)
        assert model_spec_from_hf_config(src, head="causal-lm").head.kind == "causal_lm"
    whisper = transformers.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                         decoder_attention_heads=2, vocab_size=1000)
    with pytest.raises(ConfigError) as e:
        model_spec_from_hf_config(whisper, head="seq2seq")
    assert "encoder-decoder" in str(e.value) and "\n" not in str(e.value)


def _full(dtype="fp32", **kw):
    return TrainSpec(batch_size=B, seq_length=S, method="full", optimizer="adamw", dtype=dtype, device="cpu", **kw)


def test_logits_term_per_head():
    h, T = 128, B * S
    bert = model_spec_from_hf_config(_config("bert", "BertForSequenceClassification", num_labels=3))
    ts = _full()
    # fp32: max(8, 12) bytes per logit (log_softmax output + nll grad + log_softmax grad)
    assert logits_bytes(bert, ts)[0] == 12 * B * 3
    tok = bert.replace(head=TaskHead("token_classification", num_labels=9))
    assert logits_bytes(tok, ts)[0] == 12 * T * 9
    qa = bert.replace(head=TaskHead("question_answering", num_labels=2))
    assert logits_bytes(qa, ts)[0] == 12 * T * 2
    # a decoder's score runs on every position: its tokens x labels logits too (compute dtype)
    llama = model_spec_from_hf_config(_config("llama", "LlamaForSequenceClassification", num_labels=3))
    assert logits_bytes(llama, ts)[0] == 12 * B * 3 + 4 * T * 3
    # LM heads as before: over the vocabulary
    lm = bert.replace(head=DEFAULT_HEAD)
    assert logits_bytes(lm, ts)[0] == 12 * T * 1000
    assert logits_bytes(bert.replace(head=TaskHead("masked_lm")), ts)[0] == 12 * T * 1000
    assert head_input_bytes(lm, ts) == 4 * h * T + 2 * 4 * h * T
    # the vocabulary logits are gone from the classifier's estimate, nothing else changed
    a, b = estimate(bert, ts), estimate(lm, ts)
    assert a.phase_breakdowns["loss"]["logits"] == 12 * B * 3
    assert b.phase_breakdowns["loss"]["logits"] == 12 * T * 1000
    assert a.breakdown["weights"] == b.breakdown["weights"]


def test_head_dict_from_a_record_reads_back():
    ms = model_spec_from_hf_config(_config("bert", "BertForTokenClassification", num_labels=5))
    d = json.loads(json.dumps(ms.head.__dict__))
    assert head_of(ms.replace(head=d)) == ms.head
    assert head_of(ms.replace(head=None)) is DEFAULT_HEAD
    with pytest.raises(ConfigError, match="head.num_labels"):
        TaskHead("sequence_classification", num_labels=0)


def _head_census(model, batch) -> int:
    """Bytes of the hidden-sized tensors saved for the backward outside the embeddings and the
    blocks (the final norm, pooler, dropouts, classifier, LM-head transform): unique storages,
    parameters excluded (the loss's logits are the logits term's; norm statistics are not
    hidden-sized)."""
    base = model.base_model
    blocks = next(m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == 2)
    emb = getattr(base, "embeddings", None) or base.get_input_embeddings()
    depth = {"n": 0}
    for m in (*blocks, emb):
        m.register_forward_pre_hook(lambda *a: depth.update(n=depth["n"] + 1))
        m.register_forward_hook(lambda *a: depth.update(n=depth["n"] - 1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if depth["n"] == 0 and st.data_ptr() not in params and t.dim() >= 2 and t.shape[-1] == 128:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return sum(seen.values())


def _batch(kind: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 1000, (B, S), generator=g)
    b = dict(input_ids=ids, attention_mask=torch.ones(B, S, dtype=torch.long))
    if kind == "sequence_classification":
        b["labels"] = torch.randint(0, 3, (B,), generator=g)
    elif kind == "token_classification":
        b["labels"] = torch.randint(0, 3, (B, S), generator=g)
    elif kind == "question_answering":
        b.update(start_positions=torch.randint(0, S, (B,), generator=g),
                 end_positions=torch.randint(0, S, (B,), generator=g))
    else:
        b["labels"] = ids
    return b


_PEFT_TASK = {"sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
              "question_answering": "QUESTION_ANS"}


@pytest.mark.parametrize("setting", ["full fp32", "full bf16", "lora fp32"])
@pytest.mark.parametrize("model_type,arch", [
    ("bert", "BertForSequenceClassification"), ("roberta", "RobertaForSequenceClassification"),
    ("deberta-v2", "DebertaV2ForSequenceClassification"), ("llama", "LlamaForSequenceClassification"),
    ("distilbert", "DistilBertForSequenceClassification"),
    ("bert", "BertForTokenClassification"), ("llama", "LlamaForTokenClassification"),
    ("bert", "BertForQuestionAnswering"), ("llama", "LlamaForQuestionAnswering"), ("bert", "BertForMaskedLM"),
])
def test_head_term_matches_what_the_head_saves(model_type, arch, setting):
    method, dtype = setting.split()
    cfg = _config(model_type, arch, num_labels=2 if arch.endswith("QuestionAnswering") else 3)
    model = _live(cfg)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    kind = model_spec_from_module(model).head.kind
    inner = model
    if method == "lora":  # PEFT's task type: the classifier in modules_to_save, LoRA on q and v
        peft = pytest.importorskip("peft")
        if kind not in _PEFT_TASK:
            pytest.skip("no PEFT task type trains a masked-LM head")
        targets = ["q_proj", "v_proj"] if model_type == "llama" else ["query", "value", "query_proj", "value_proj",
                                                                       "q_lin", "v_lin"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, task_type=_PEFT_TASK[kind], target_modules=targets))
        inner = model.base_model.model
    ms = model_spec_from_module(model)
    measured = _head_census(inner, _batch(kind))
    est = head_input_bytes(ms, TrainSpec(batch_size=B, seq_length=S, method=method, dtype=dtype, device="cpu"))
    # first-token heads: the rows-sized terms are an upper bound, (3 e + 2 d) h rows
    e = 4 if dtype == "fp32" else 2
    assert abs(est - measured) <= max(0.01 * measured, 5 * e * 128 * B), (arch, setting, est, measured)


@pytest.mark.parametrize("arch,why", [
    ("DeiTForImageClassificationWithTeacher", "architectures"), ("BertForMultipleChoice", "architectures"),
    ("Dinov2ForImageClassification", "model_type"),  # an image family not counted (test_image_blocks.py)
])
def test_heads_not_counted_get_one_line(arch, why):
    with pytest.raises(ConfigError) as e:
        head_kind_from_architectures([arch])
    assert e.value.field == why and "\n" not in str(e.value) and len(str(e.value)) < 400


def test_encoder_decoder_and_unbuildable_heads_get_one_line(tmp_path):
    # a T5 config is estimated as a seq2seq LM (tests/test_seq2seq_estimate.py); a speech
    # encoder-decoder is refused in one line naming the families counted
    t5 = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=2, vocab_size=1000,
                               architectures=["T5ForConditionalGeneration"])
    p = tmp_path / "config.json"
    p.write_text(json.dumps(t5.to_dict()))
    for src in (str(p), t5):
        assert model_spec_from_hf_config(src).head.kind == "seq2seq_lm"
    whisper = transformers.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                         decoder_attention_heads=2, vocab_size=1000,
                                         architectures=["WhisperForConditionalGeneration"])
    with pytest.raises(ConfigError) as e:
        model_spec_from_hf_config(whisper)
    assert "encoder-decoder" in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400
    # GPT-2 has no masked-LM class: transformers' message lists every class; ours is one line
    with pytest.raises(ConfigError) as e:
        model_spec_from_hf_config(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000),
                                  head="masked_lm")
    assert e.value.field == "architectures" and "\n" not in str(e.value) and len(str(e.value)) < 200
