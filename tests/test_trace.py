"""``memguard_hf.trace``: one training step of the model's own code on fake tensors, against the
analytic estimate (``memguard_core.estimator``).

Every trace here is a real step of the transformers model (2 blocks, 2 x 128 tokens) run on
FakeTensors under torch's MemTracker; nothing is mocked. The analytic side is
``estimate(model_spec_from_hf_config(config), train_spec)`` of the same config and settings.

Tolerances, measured on these cases (traced / analytic, torch 2.13, transformers 5.24, peft 0.21):

* weights, gradients, optimizer states: counted from the parameters on both sides -- 1.0000 on
  every case (AdamW's per-tensor ``step`` scalars are the only difference: 4 bytes per parameter
  tensor). Tolerance 1 %.
* saved activations at the end of the forward vs the analytic loss moment's ``activations +
  attention_scores``: 0.957 (SmolLM2 block, sdpa), 0.972 (Mixtral), 1.033 (Phi-3, LoRA on the fused
  qkv_proj), 0.987 (GPT-2), 0.980 (Qwen2.5, bf16 LoRA). The largest known difference is the sdpa
  output and o_proj's input, which are one storage on the CPU kernel (its output is already laid out
  (batch, seq, heads, dim), so ``transpose(1, 2).contiguous()`` copies nothing) and which the
  analytic model counts twice: -4.3 % on the SmolLM2 block. Tolerance 6 %.
* logits + loss working set: 1.000. Tolerance 1 %.
* peaks of the live tensors (the analytic moment less runtime overhead and allocator slack):
  0.976-1.006. Tolerance 3 %.
* Gemma-2 (eager, soft-capping) was off by +16 % (activations) and +33 % (logits) until the analytic
  model counted its extra block norms and both soft-cappings; it is compared like the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.estimator.estimate import estimate  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_hf.model_spec import model_spec_from_hf_config
from memguard_hf.trace import STAGES, compare, trace_step  # noqa: E402
from memguard_testing import script_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _config(name: str, **changes) -> dict:
    with open(os.path.join(HERE, "configs", name), encoding="utf-8") as fh:
        d = json.load(fh)
    d.pop("_comment", None)
    d.update(changes)
    return d


#: six families, 2 blocks each
ARCHS = {
    # dense GQA: HuggingFaceTB/SmolLM2-135M (llama, vocab 49152, hidden 576, heads 9/3, tied)
    "llama": _config("smollm2-135m.json", num_hidden_layers=2),
    # MoE: Mixtral's routing (8 experts, top-2), narrowed to hidden 256 (transformers' grouped_mm experts)
    "mixtral": dict(model_type="mixtral", vocab_size=32000, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=4096),
    # fused projections: microsoft/Phi-3-mini-4k-instruct (qkv_proj, gate_up_proj)
    "phi3": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                 num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
                 tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=32000),
    # soft-capping: google/gemma-2-2b (head_dim 256, vocab 256000, tied, sandwich norms)
    "gemma2": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, tie_word_embeddings=True, max_position_embeddings=8192),
    # GPT-2 (LayerNorm, Conv1D c_attn, dropout 0.1) and Qwen2.5-0.5B (q/k/v biases, GQA 14/2)
    "gpt2": _config("gpt2.json", n_layer=2),
    "qwen2": _config("qwen2.5-0.5b.json", num_hidden_layers=2),
    # vision-language: Qwen/Qwen2-VL-2B-Instruct's layout (vision tower + merger + Qwen2 decoder with
    # M-RoPE), narrowed to 2 decoder and 2 vision blocks; a text-only batch (the tower's weights count,
    # LoRA q/v adapts the decoder only: Qwen2-VL's vision blocks name their projections qkv / proj)
    "qwen2_vl": dict(model_type="qwen2_vl", tie_word_embeddings=True,
                     text_config=dict(model_type="qwen2_vl_text", hidden_size=1536, intermediate_size=8960,
                                      num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=2,
                                      vocab_size=151936, tie_word_embeddings=True),
                     vision_config=dict(depth=2, embed_dim=1280, hidden_size=1536, num_heads=16,
                                        patch_size=14, spatial_merge_size=2)),
}

#: one representative setting per architecture (2 x 128 tokens)
CASES = {
    "llama": dict(method="full", dtype="fp32"),
    "mixtral": dict(method="full", dtype="fp32"),
    "phi3": dict(method="lora", dtype="fp32", lora_targets=("qkv_proj", "o_proj")),
    "gemma2": dict(method="full", dtype="fp32", attn_impl="eager"),
    "gpt2": dict(method="full", dtype="fp32"),
    "qwen2": dict(method="lora", dtype="bf16", lora_rank=16, lora_targets=("all-linear",)),
    "qwen2_vl": dict(method="lora", dtype="bf16", lora_rank=16, lora_targets=("q_proj", "v_proj")),
}

_CACHE: dict = {}


def traced(arch: str, **overrides):
    """(trace, estimate, comparison rows by term) of ``arch`` with its case's settings + overrides."""
    kw = dict(batch_size=2, seq_length=128)
    kw.update(CASES[arch])
    kw.update(overrides)
    key = (arch, tuple(sorted((k, str(v)) for k, v in kw.items())))
    if key not in _CACHE:
        ts = TrainSpec(**kw)
        tr = trace_step(ARCHS[arch], ts, top_modules=1000)
        est = estimate(model_spec_from_hf_config(ARCHS[arch]), ts)
        _CACHE[key] = (tr, est, {r["term"]: r for r in compare(tr, est)})
    return _CACHE[key]


def ratio(rows, term):
    return rows[term]["traced"] / rows[term]["analytic"]


# ---------------------------------------------------------------------------------------------
# the parameter-counted terms


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_weights_gradients_states_match(arch):
    tr, est, rows = traced(arch)
    for term in ("weights", "gradients", "optimizer_states"):
        assert rows[term]["analytic"] > 0
        assert ratio(rows, term) == pytest.approx(1.0, rel=0.01), (arch, term, rows[term])
    # the weights are stored in the TrainSpec's dtype
    assert tr.settings["weights_dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[CASES[arch]["dtype"]]


# ---------------------------------------------------------------------------------------------
# activations and logits against the analytic loss moment


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_activations_end_of_forward(arch):
    tr, est, rows = traced(arch)
    assert tr.terms["activations"] > 0
    assert ratio(rows, "activations (end of forward)") == pytest.approx(1.0, abs=0.06), rows


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_working_set(arch):
    tr, est, rows = traced(arch)
    assert ratio(rows, "logits + loss (peak)") == pytest.approx(1.0, abs=0.01), rows


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_live_peaks(arch):
    tr, est, rows = traced(arch)
    assert ratio(rows, "peak, loss moment") == pytest.approx(1.0, abs=0.03), rows
    assert ratio(rows, "peak of live tensors") == pytest.approx(1.0, abs=0.03), rows
    # what a tensor trace cannot see is reported, not compared
    assert rows["runtime_overhead"]["traced"] is None and rows["runtime_overhead"]["analytic"] > 0
    assert tr.peak_phase in STAGES and tr.peak_bytes == max(tr.phase_peaks.values())
    assert tr.peak_bytes == pytest.approx(sum(tr.at_peak.values()), abs=1)


def test_gemma2_soft_capping_and_extra_norms_are_modelled():
    """Gemma-2 (eager): its four norms per block and the attention and final-logit soft-capping
    are what the analytic model had missed (+16 % activations, +33 % logits before)."""
    tr, est, rows = traced("gemma2")
    assert tr.settings["attn_implementation"] == "eager"
    assert ratio(rows, "activations (end of forward)") == pytest.approx(1.0, abs=0.02)
    assert ratio(rows, "logits + loss (peak)") == pytest.approx(1.0, abs=0.01)


# ---------------------------------------------------------------------------------------------
# what the trace itself shows


def test_module_rows_add_up_to_the_activations():
    tr, _, _ = traced("llama")
    assert sum(r.activation_bytes for r in tr.modules) == tr.terms["activations"]
    names = [r.name for r in tr.modules]
    assert any(n.endswith("layers.0.self_attn") for n in names)
    assert any(n.endswith("layers.1.mlp.act_fn") for n in names)
    assert all(a.activation_bytes >= b.activation_bytes for a, b in zip(tr.modules, tr.modules[1:]))
    row = next(r for r in tr.modules if r.name.endswith("layers.0.self_attn"))
    assert row.param_bytes > 0 and row.forward_peak_bytes > 0
    d = tr.to_dict()
    json.dumps(d)
    assert d["terms"]["activations"] == tr.terms["activations"]


def test_mixed_precision_fp32_weights_and_autocast_copies():
    tr, est, rows = traced("llama", dtype="bf16", mixed_precision=True)
    assert tr.settings["weights_dtype"] == "float32" and tr.settings["autocast"] == "bfloat16"
    assert ratio(rows, "weights") == pytest.approx(1.0, rel=0.01)
    assert ratio(rows, "weight_copies") == pytest.approx(1.0, rel=0.01), rows


def test_pure_bf16_halves_the_weights():
    fp32, _, _ = traced("llama")
    bf16, _, rows = traced("llama", dtype="bf16")
    assert bf16.terms["weights"] * 2 == fp32.terms["weights"]
    assert bf16.terms["weight_copies"] == 0 and bf16.settings["autocast"] is None
    assert ratio(rows, "weights") == pytest.approx(1.0, rel=0.01)


def test_grad_checkpoint_keeps_only_block_inputs():
    plain, _, _ = traced("llama")
    ckpt, est, rows = traced("llama", grad_checkpoint=True)
    tokens, h = 2 * 128, 576
    # each block keeps its input (fp32, b x s x h) -- plus the final norm's tensors
    assert ckpt.terms["activations"] < 0.3 * plain.terms["activations"]
    assert ckpt.terms["activations"] >= 2 * tokens * h * 4
    assert ratio(rows, "peak, loss moment") == pytest.approx(1.0, abs=0.03), rows
    assert ratio(rows, "peak of live tensors") == pytest.approx(1.0, abs=0.03), rows


def test_optimizers_and_accumulation():
    _, _, sgd = traced("llama", optimizer="sgd")
    assert sgd["optimizer_states"]["traced"] == 0 == sgd["optimizer_states"]["analytic"]
    ada, _, rows = traced("llama", optimizer="adafactor")
    assert ratio(rows, "optimizer_states") == pytest.approx(1.0, rel=0.01), rows
    assert ratio(rows, "optimizer_temporaries") == pytest.approx(1.0, rel=0.01), rows
    assert ada.settings["optimizer"] == "Adafactor"
    acc, _, rows = traced("llama", grad_accum=2)
    # accumulating: the earlier micro-batch's .grad is resident from the start of the step
    assert acc.phase_breakdowns["forward"]["gradients"] == acc.terms["gradients"] > 0
    assert ratio(rows, "gradients") == pytest.approx(1.0, rel=0.01)


def test_moe_fp32_runs_through_grouped_mm():
    tr, _, _ = traced("mixtral")
    assert tr.settings["experts_implementation"] == "grouped_mm"
    assert tr.settings["weights_dtype"] == "float32"


def test_lora_on_fake_tensors():
    tr, est, rows = traced("phi3")
    # PEFT's adapters are fp32 on the fp32 base; only they train
    assert 0 < tr.terms["gradients"] < 0.01 * tr.terms["weights"]
    assert ratio(rows, "gradients") == pytest.approx(1.0, rel=0.01)
    assert tr.settings["lora_targets"] == ["qkv_proj", "o_proj"]


def test_lora_default_targets_are_peft_defaults():
    """A TrainSpec without lora_targets traces what PEFT adapts with target_modules=None for the
    model type (GPT-2: c_attn), as estimate() counts it, not Llama's q_proj / v_proj."""
    tr, est, rows = traced("gpt2", method="lora", lora_rank=8)
    assert tr.settings["lora_targets"] == ["c_attn"]
    assert ratio(rows, "gradients") == pytest.approx(1.0, rel=0.01)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("kwargs,field", [
    (dict(method="qlora"), "method"),
    (dict(optimizer="adamw-8bit"), "optimizer"),
    (dict(attn_impl="flash"), "attn_impl"),
    (dict(framework="mlx"), "framework"),
])
def test_unsupported_settings_raise_config_error(kwargs, field):
    with pytest.raises(ConfigError) as info:
        trace_step(ARCHS["llama"], TrainSpec(**kwargs))
    assert info.value.field == field


def test_only_cpu_fake_tensors():
    with pytest.raises(ConfigError) as info:
        trace_step(ARCHS["llama"], TrainSpec(), device="cuda")
    assert info.value.field == "device" and "cuda" in info.value.expected
    with pytest.raises(ConfigError):
        trace_step(ARCHS["llama"], "not a TrainSpec")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        trace_step(dict(ARCHS["llama"], model_type="no-such-model"), TrainSpec())
    with pytest.raises(ConfigError) as info:
        trace_step(ARCHS["llama"], TrainSpec(lora_targets=("no_such_proj",)))
    assert info.value.field == "lora_targets"


# ---------------------------------------------------------------------------------------------
# cost: a 1B config allocates nothing of its size; a 30-block model takes seconds


def test_1b_config_allocates_nothing_of_its_size():
    """TinyLlama-1.1B, every block, fp32 full fine-tune: 4.1 GiB of (fake) weights, and the fresh
    process that traces it -- interpreter, torch, transformers, peft included -- peaks far below.

    The tracing process is exec'd from a parent holding 1.6 GiB, more than the bound: its
    ``ru_maxrss`` starts at that parent's resident set (fs/exec.c ``exec_mmap``), so the figure
    checked is the process's own peak, whatever started it."""
    launcher = "import subprocess, sys; held = bytearray(1638 << 20); sys.exit(subprocess.call(sys.argv[1:]))"
    code = f"""
import json
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.trace import trace_step
d = json.load(open({os.path.join(HERE, "configs", "tinyllama-1.1b.json")!r})); d.pop("_comment", None)
tr = trace_step(d, TrainSpec(method="full", dtype="fp32", batch_size=1, seq_length=256))
print(json.dumps(dict(weights=tr.terms["weights"], peak=tr.peak_bytes, layers=tr.settings["layers"],
                      rss=tr.process_peak_rss_bytes, seconds=tr.seconds)))
"""
    env = script_env(TRANSFORMERS_VERBOSITY="error")
    res = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["layers"] == 22 and out["weights"] > 4 * 2**30
    assert out["rss"] < 1.5 * 2**30 < out["weights"], out


def test_30_block_model_is_traced_whole():
    """SmolLM2-135M, all 30 blocks, 4 x 256 tokens, full fp32: every block, its weights exact, and the
    time the trace took reported (its run time is measured in docs/estimator.md, "Bench and trace run
    times", not asserted here: this host is shared)."""
    tr = trace_step(_config("smollm2-135m.json"), TrainSpec(method="full", dtype="fp32", batch_size=4,
                                                            seq_length=256))
    assert tr.settings["layers"] == 30
    assert tr.seconds > 0
    assert tr.terms["weights"] == 4 * 134_515_008


# ---------------------------------------------------------------------------------------------
# CLI


def _cli(args, tmp_path, capsys):
    from memguard_core.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(ARCHS["llama"]))
    capsys.readouterr()
    rc = main(["estimate", "--config", str(cfg), "--method", "full", "--dtype", "fp32", "--batch-size", "2",
               "--seq-length", "64"] + args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_trace_json(tmp_path, capsys):
    rc, out, err = _cli(["--trace", "--json"], tmp_path, capsys)
    assert rc == 0, err
    out = json.loads(out)
    assert out["peak_bytes"] > 0 and "breakdown" in out
    t = out["trace"]
    rows = {r["term"]: r for r in t["comparison"]}
    assert rows["weights"]["traced"] == rows["weights"]["analytic"] == t["terms"]["weights"]
    assert rows["allocator_slack"]["traced"] is None
    assert t["peak_phase"] in STAGES and t["modules"] and t["seconds"] > 0


def test_cli_trace_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    import memguard_core.report as report

    monkeypatch.setattr(report, "_console", None)
    rc, out, err = _cli(["--trace"], tmp_path, capsys)
    assert rc == 0, err
    assert "memguard estimate" in out and "traced" in out
    assert "activations (end of forward)" in out and "peak of live tensors" in out


def test_cli_trace_needs_a_config(capsys):
    from memguard_core.cli import main

    rc = main(["estimate", "--model-params", "1e8", "--hidden-dim", "512", "--num-layers", "4",
               "--num-heads", "8", "--trace"])
    assert rc == 2 and "--config" in capsys.readouterr().err


def test_analytic_path_does_not_load_the_tracer():
    code = ("import sys; import memguard_core.cli as c; "
            "assert 'torch' not in sys.modules; "
            "c.main(['estimate', '--model-params', '1e8', '--hidden-dim', '512', '--num-layers', '4', "
            "'--num-heads', '8', '--json']); "
            "assert 'torch' not in sys.modules and 'memguard_hf.trace' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=script_env())
    assert res.returncode == 0, res.stderr[-2000:]


def test_vision_language_trace_counts_the_vision_tower():
    """The traced weights of Qwen2-VL hold its vision tower (2 blocks of width 1280 + patch embedding
    + merger here), which the analytic estimate counts as ``vision`` (frozen under LoRA)."""
    tr, est, rows = traced("qwen2_vl")
    vision = est.model_spec.params.vision
    assert vision > 60e6
    language = (est.model_spec.total_params - vision) * 2  # bf16 bytes
    assert rows["weights"]["traced"] - language == pytest.approx(vision * 2, rel=0.02)


def test_the_module_table_shows_each_names_distinguishing_tail_at_80_columns():
    # issue 34: at 80 columns every name was cut to the same PEFT-wrapped prefix
    from rich.console import Console

    from memguard_hf.trace.report import module_table
    from memguard_hf.trace.result import ModuleRow, TraceResult

    stem = "base_model.model.model.layers"
    tails = ["self_attn.q_proj.lora_A.default", "self_attn.v_proj.lora_B.default", "mlp.act_fn",
             "input_layernorm", "post_attention_layernorm"]
    rows = [ModuleRow(f"{stem}.{i}.{t}", (j + 1) * 2**20, 0, 0, 0) for i in range(3) for j, t in enumerate(tails)]
    trace = TraceResult(peak_bytes=1, peak_phase="forward", at_peak={}, category_peaks={}, phase_peaks={},
                        phase_breakdowns={}, terms={"activations": 45 * 2**20}, modules=rows, seconds=0.0,
                        build_seconds=0.0)
    con = Console(width=80, record=True)
    con.print(module_table(trace, modules=8))
    text = con.export_text()
    assert f"start with {stem}.*." in " ".join(text.split())
    for tail in tails:
        assert tail in text.replace("\n", " ") or tail in "".join(text.split()), tail
