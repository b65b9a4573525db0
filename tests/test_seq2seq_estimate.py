"""Encoder-decoder models (memguard_core/estimator/seq2seq_blocks.py, docs/estimator.md
"Encoder-decoder models"): T5 / FLAN-T5 / BART configs read into a spec with a decoder stack; the
block rule against a census of the tensors real blocks save (``memguard_torch.saved_census``:
autograd's ``saved_tensors_hooks``, parameters and buffers left out) for the encoder's last block
over the source tokens and the decoder's last block over the target tokens; the CLI with
``--target-length``; the HF guard reading the target length from the rows; a speech
encoder-decoder refused in one line. Small configs, random weights, CPU.

Per row: the census at two micro-batch sizes, the difference over the added rows, so what does not
grow with the rows (autocast's weight casts, T5's position-bias masks and bucket indices) drops out.
"""

from __future__ import annotations

import contextlib
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.estimator.estimate import estimate  # noqa: E402
from memguard_core.estimator.heads import SEQ2SEQ_LM, head_kind_from_architectures  # noqa: E402
from memguard_core.estimator.seq2seq_blocks import block_bytes_per_row  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_hf.model_spec import model_spec_from_hf_config, with_seq2seq_fields  # noqa: E402
from memguard_torch.module_spec import model_spec_from_module  # noqa: E402
from memguard_torch.saved_census import saved_bytes_per_block  # noqa: E402

H, F, NH, L, S, T = 64, 256, 4, 2, 40, 24


def _config(kind: str, p: float = 0.1, attn_p: float = 0.0):
    if kind in ("t5", "flan-t5"):
        return transformers.T5Config(d_model=H, d_ff=F, num_layers=L, num_heads=NH, d_kv=16, vocab_size=1000,
                                     feed_forward_proj="relu" if kind == "t5" else "gated-gelu", dropout_rate=p,
                                     architectures=["T5ForConditionalGeneration"], decoder_start_token_id=0,
                                     pad_token_id=0, eos_token_id=1)
    return transformers.BartConfig(d_model=H, encoder_ffn_dim=F, decoder_ffn_dim=F, encoder_layers=L, decoder_layers=L,
                                   encoder_attention_heads=NH, decoder_attention_heads=NH, vocab_size=1000, dropout=p,
                                   attention_dropout=attn_p, architectures=["BartForConditionalGeneration"])


_QV = {"t5": ("q", "v"), "flan-t5": ("q", "v"), "bart": ("q_proj", "v_proj")}
_ALL = {"t5": ("q", "k", "v", "o", "wi", "wo"), "flan-t5": ("q", "k", "v", "o", "wi_0", "wi_1", "wo"),
        "bart": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")}


def _census(kind, *, p, attn_p, method, dtype, amp, attn, targets, lora_p, rows):
    """Saved bytes of the encoder's last block and the decoder's last block, ``rows`` rows."""
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(_config(kind, p, attn_p), attn_implementation=attn)
    if dtype == "bf16" and not amp:
        model = model.to(torch.bfloat16)
    if method == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(targets), lora_dropout=lora_p,
                                                           task_type="SEQ_2_SEQ_LM"))
    model.train()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    enc, dec = base.get_encoder(), base.get_decoder()
    eb, db = list(getattr(enc, "block", None) or enc.layers), list(getattr(dec, "block", None) or dec.layers)
    ids, labels = torch.randint(5, 1000, (rows, S)), torch.randint(5, 1000, (rows, T))

    def forward():
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
        with ctx:
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)

    per = saved_bytes_per_block(forward, eb + db, exclude=list(model.parameters()) + list(model.buffers()))
    return per[len(eb) - 1], per[-1]


def _rule(kind, *, p, attn_p, method, dtype, amp, attn, targets, lora_p):
    """The rule's bytes per row of the encoder's and the decoder's block."""
    ms = model_spec_from_hf_config(_config(kind, p, attn_p))
    ts = TrainSpec(batch_size=2, seq_length=S, target_length=T, method=method, dtype=dtype, mixed_precision=amp,
                   attn_impl=attn, lora_rank=4, lora_targets=targets or ("q",), lora_dropout=lora_p, device="cpu")
    out = []
    for decoder in (False, True):
        r = block_bytes_per_row(ms, ts, decoder=decoder, trainable=method == "full")
        out.append(r.hidden + r.scores + r.lora)
    return out


_SETTINGS = [
    # (method, dtype, autocast, attention, config dropout, LoRA targets, LoRA dropout)
    ("full", "fp32", False, "sdpa", 0.1, "", 0.0),     # T5: SDPA's math path (dropout)
    ("full", "fp32", False, "sdpa", 0.0, "", 0.0),     # T5: the trained bias -> math; cross-attention flash
    ("full", "fp32", False, "eager", 0.1, "", 0.0),
    ("full", "bf16", False, "sdpa", 0.1, "", 0.0),
    ("full", "bf16", True, "sdpa", 0.1, "", 0.0),
    ("lora", "fp32", False, "sdpa", 0.1, "qv", 0.0),
    ("lora", "fp32", False, "sdpa", 0.0, "qv", 0.0),   # T5: CPU flash with the bias as its mask
    ("lora", "bf16", False, "sdpa", 0.1, "qv", 0.0),
    ("lora", "bf16", True, "sdpa", 0.1, "qv", 0.0),
    ("lora", "fp32", False, "sdpa", 0.1, "qv", 0.1),
    ("lora", "bf16", False, "eager", 0.0, "all", 0.0),
]


@pytest.mark.parametrize("kind", ["t5", "flan-t5", "bart"])
@pytest.mark.parametrize("method,dtype,amp,attn,p,which,lora_p", _SETTINGS)
def test_rule_equals_the_census_per_row(kind, method, dtype, amp, attn, p, which, lora_p):
    targets = {"": (), "qv": _QV[kind], "all": _ALL[kind]}[which]
    kw = dict(p=p, attn_p=p if kind == "bart" and attn == "eager" else 0.0, method=method, dtype=dtype, amp=amp,
              attn=attn, targets=targets, lora_p=lora_p)
    small, large = _census(kind, rows=2, **kw), _census(kind, rows=4, **kw)
    rule = _rule(kind, **kw)
    for i, which_block in enumerate(("encoder", "decoder")):
        per_row = (large[i] - small[i]) / 2
        assert per_row > 0
        assert rule[i] == pytest.approx(per_row, rel=0.005), (which_block, rule[i], per_row)


@pytest.mark.parametrize("kind,act,decoder_linears", [("t5", "relu", 10), ("flan-t5", "gelu_new", 11),
                                                      ("bart", "gelu", 10)])
def test_spec_reads_the_two_stacks(kind, act, decoder_linears):
    cfg = _config(kind)
    ms = model_spec_from_hf_config(cfg)
    real = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    assert ms.params.total == sum(p.numel() for p in real.parameters())
    assert (ms.num_layers, ms.decoder_layers, ms.hidden_size, ms.intermediate_size) == (L, L, H, F)
    assert ms.head.kind == SEQ2SEQ_LM and ms.head.is_lm and ms.ffn_act == act
    assert ms.residual_dropout == 0.1
    # the encoder's blocks have no cross-attention; the decoder's do (4 more linears)
    assert not any("EncDecAttention" in ls.path or "encoder_attn" in ls.path for ls in ms.block_linears)
    assert len(ms.decoder_block_linears) == decoder_linears
    # the live module, PEFT-wrapped, reads the same decoder stack
    lora = peft.get_peft_model(real, peft.LoraConfig(r=4, target_modules=list(_QV[kind]), task_type="SEQ_2_SEQ_LM"))
    live = with_seq2seq_fields(lora, model_spec_from_module(lora))
    assert (live.num_layers, live.decoder_layers, live.head.kind) == (L, L, SEQ2SEQ_LM)
    assert [ls.name for ls in live.decoder_block_linears] == [ls.name for ls in ms.decoder_block_linears]
    # LoRA's trainable count from the shapes (both stacks) equals PEFT's
    ts = TrainSpec(batch_size=2, seq_length=S, target_length=T, lora_rank=4, lora_targets=_QV[kind], device="cpu")
    assert estimate(ms, ts).trainable_params == sum(p.numel() for p in lora.parameters() if p.requires_grad)


def test_target_length_drives_the_decoder_and_the_logits():
    ms = model_spec_from_hf_config(_config("flan-t5"))
    base = TrainSpec(batch_size=2, seq_length=S, target_length=T, method="full", dtype="fp32", device="cpu")
    longer = estimate(ms, base.replace(target_length=4 * T))
    est = estimate(ms, base)
    assert est.phase_breakdowns["loss"]["logits"] == 12 * 2 * T * 1000
    assert longer.phase_breakdowns["loss"]["logits"] == 4 * est.phase_breakdowns["loss"]["logits"]
    assert longer.phase_breakdowns["loss"]["activations"] > est.phase_breakdowns["loss"]["activations"]
    assert TrainSpec(seq_length=64).decoder_tokens == 64       # no target length: the source's
    with pytest.raises(ConfigError) as e:
        TrainSpec(target_length=0)
    assert e.value.field == "target_length"


def _cli(capsys, *args):
    """``memguard estimate *args`` through the CLI's ``main`` in this process (it needs no
    environment of its own): (exit code, stdout, stderr)."""
    from memguard_core.cli import main

    try:
        code = main(["estimate", *args])
    except SystemExit as e:  # argparse's --help
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_estimates_a_t5_config_with_target_length(tmp_path, capsys):
    cfg = _config("flan-t5").to_dict()
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    run = ["--config", str(p), "--device", "cpu", "--batch-size", "2", "--seq-length", "64", "--json"]
    code, text, err = _cli(capsys, *run, "--target-length", "16")
    assert code == 0, err
    out = json.loads(text)
    assert out["train"]["target_length"] == 16 and out["train"]["seq_length"] == 64
    code, text, err = _cli(capsys, *run, "--target-len", "48")
    assert code == 0, err
    assert json.loads(text)["peak_bytes"] > out["peak_bytes"]
    code, helped, _ = _cli(capsys, "--help")
    assert code == 0 and "--target-length" in helped and "labels" in helped


def test_target_length_on_a_decoder_only_model_is_one_line(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000).to_dict()))
    code, _, err = _cli(capsys, "--config", str(p), "--device", "cpu", "--target-length", "16")
    said = [ln for ln in err.splitlines() if "--target-length" in ln]
    assert code != 0 and len(said) == 1 and "decoder stack" in said[0], err


def test_speech_encoder_decoder_is_refused_in_one_line(tmp_path):
    whisper = transformers.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                         decoder_attention_heads=2, vocab_size=1000,
                                         architectures=["WhisperForConditionalGeneration"])
    p = tmp_path / "config.json"
    p.write_text(json.dumps(whisper.to_dict()))
    for src in (str(p), whisper):
        with pytest.raises(ConfigError) as e:
            model_spec_from_hf_config(src)
        msg = str(e.value)
        assert e.value.field == "model_type" and "whisper" in msg and "t5" in msg and "bart" in msg
        assert "\n" not in msg and len(msg) < 400
    with pytest.raises(ConfigError):
        head_kind_from_architectures(["BartForSequenceClassification"], "bart", encoder_decoder=True)


def test_hf_guard_reads_the_target_length_from_the_rows(tmp_path):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from memguard_hf.preflight import read_specs

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": torch.randint(5, 1000, (S,)), "attention_mask": torch.ones(S, dtype=torch.long),
                    "labels": torch.randint(5, 1000, (T + i,))}

    model = transformers.AutoModelForSeq2SeqLM.from_config(_config("t5"))
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, use_cpu=True,
                                    report_to=[])
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Rows())
    ms, ts = read_specs(trainer, device="cpu")
    assert ms.decoder_layers == L and ms.head.kind == SEQ2SEQ_LM
    assert (ts.seq_length, ts.target_length) == (S, T + 3)   # the longest row of each
    assert estimate(ms, ts).peak_bytes > 0


def test_settings_an_encoder_decoder_cannot_have_are_refused_in_one_line():
    """What has no meaning for T5 / BART is refused naming the field, not estimated wrongly: a
    decoder stack on a family without one, mlx_lm, ``lora_layers``, a bad FFN dropout."""
    from memguard_core.errors import ConfigError
    from memguard_core.estimator.specs import TrainSpec
    from memguard_core.estimator.trainable import check_train_spec
    from memguard_hf.model_spec import model_spec_from_hf_config
    import transformers

    t5 = model_spec_from_hf_config(transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=2,
                                                         vocab_size=1000))
    assert t5.is_encoder_decoder
    cases = [(lambda: t5.replace(decoder_layers=-1), "decoder_layers"),
             (lambda: t5.replace(decoder_layers=True), "decoder_layers"),
             (lambda: t5.replace(model_type="llama"), "decoder_layers"),
             (lambda: t5.replace(decoder_block_linears=()), "decoder_block_linears"),
             (lambda: t5.replace(ffn_dropout=1.0), "ffn_dropout"),
             (lambda: check_train_spec(t5, TrainSpec(framework="mlx", device="mlx")), "framework"),
             (lambda: check_train_spec(t5, TrainSpec(method="lora", lora_targets=("q", "v"), lora_layers=1)),
              "lora_layers")]
    for make, field in cases:
        with pytest.raises(ConfigError) as e:
            make()
        assert e.value.field == field and "\n" not in str(e.value)
    assert check_train_spec(t5, TrainSpec(method="lora", lora_targets=("q", "v"))) == []
