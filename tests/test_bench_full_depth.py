"""The full-depth bench set (``memguard bench --set full-depth``): selection, listing, and that every
case runs its architecture at the full published depth. Cheap: nothing is trained here (the models
are built on the meta device only, to count their parameters)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from importlib import resources

import pytest

from memguard_bench.baseline import baseline_summary
from memguard_bench.cases import (CASE_SETS, CASES, FULL_DEPTH_LAYERS, HF_FULL_DEPTH_ARCHS, MLX_FULL_DEPTH_ARCHS,
                                  build_case, num_layers_of, select)
from memguard_bench.provenance import repo_root
from memguard_bench.report import markdown_report
from memguard_bench.score import CPU_BF16_MOE, cpu_bf16_moe, score, specs_of
from memguard_bench.stats import summarize

#: Published layer counts, typed from each hub config (independent of cases.FULL_DEPTH_LAYERS).
PUBLISHED_LAYERS = {
    "gpt2-12l": 12,                 # openai-community/gpt2: n_layer
    "smollm2-135m-30l": 30,         # HuggingFaceTB/SmolLM2-135M
    "smollm2-360m-32l": 32,         # HuggingFaceTB/SmolLM2-360M
    "qwen2.5-0.5b-24l": 24,         # Qwen/Qwen2.5-0.5B
    "tinyllama-1.1b-22l": 22,       # TinyLlama/TinyLlama-1.1B
    "llama3.2-1b-16l": 16,          # meta-llama/Llama-3.2-1B
    "granite3-1b-a400m-24l": 24,    # ibm-granite/granite-3.x-1b-a400m
    "tinymixtral-4x248m-12l": 12,   # Isotonic/TinyMixtral-4x248M-MoE (TinyMistral-248M's depth)
    "granite4-h-350m-32l": 32,      # ibm-granite/granite-4.0-h-350m (28 Mamba-2 + 4 attention blocks)
    "lfm2-1.2b-16l": 16,            # LiquidAI/LFM2-1.2B (10 short-convolution + 6 attention blocks)
    "bert-base-12l": 12,            # google-bert/bert-base-uncased
    "bert-base-12l-token-cls": 12,  # the same, token-classification head
    "roberta-base-12l": 12,         # FacebookAI/roberta-base
    "distilbert-base-6l": 6,        # distilbert/distilbert-base-uncased: n_layers
    "t5-base-12l": 12,              # google-t5/t5-base: num_layers (and num_decoder_layers 12)
    "flan-t5-base-12l": 12,         # google/flan-t5-base: num_layers (and num_decoder_layers 12)
    "bart-base-6l": 6,              # facebook/bart-base: encoder_layers (and decoder_layers 6)
    "vit-base-16-224-12l": 12,      # google/vit-base-patch16-224
}

#: Published parameter counts (model cards / ``num_parameters()`` of the released checkpoints).
PUBLISHED_PARAMS = {
    "gpt2-12l": 124_439_808,
    "smollm2-135m-30l": 134_515_008,
    "smollm2-360m-32l": 361_821_120,
    "qwen2.5-0.5b-24l": 494_032_768,
    "tinyllama-1.1b-22l": 1_100_048_384,
    "llama3.2-1b-16l": 1_235_814_400,
}


def _fd():
    return select(case_set="full-depth", backends=("hf", "mlx"))


def _arch(case):
    return (HF_FULL_DEPTH_ARCHS if case["backend"] == "hf" else MLX_FULL_DEPTH_ARCHS)[case["arch"]]


def test_full_depth_set_is_selected_alone_and_kept_out_of_the_other_sets():
    fd = _fd()
    assert len(fd) >= 15
    assert all(c.get("full_depth") is True for c in fd)
    assert [c for c in CASES if c.get("full_depth")] == fd
    names = [c["name"] for c in fd]
    assert len(names) == len(set(names)) and all(n.startswith(("hf-fd-", "mlx-fd-")) for n in names)
    for s in ("all", "matrix", "held-out"):
        sel = select(case_set=s, backends=("hf", "mlx"))
        assert sel and not any(c.get("full_depth") for c in sel), s
    # `all` is still the matrix plus the held-out set, and --quick (make test) is unchanged
    assert len(select(case_set="all")) == (len(select(case_set="matrix"))
                                           + len(select(case_set="held-out")))
    quick = select(quick=True)
    assert [c["name"] for c in quick] == ["hf-tiny-lora-r8-b1-s32-fp32", "hf-tiny-full-b1-s32-fp32",
                                         "mlx-tiny-lora-r4-b4-s64-fp32", "mlx-tiny-full-b4-s64-fp32"]
    assert select(quick=True, case_set="full-depth") == []
    assert "full-depth" in CASE_SETS
    with pytest.raises(ValueError):
        select(case_set="full_depth")


def test_every_full_depth_case_runs_every_published_block():
    assert set(FULL_DEPTH_LAYERS) == set(PUBLISHED_LAYERS)
    assert FULL_DEPTH_LAYERS == PUBLISHED_LAYERS
    for c in _fd():
        arch = _arch(c)
        assert num_layers_of(arch) == PUBLISHED_LAYERS[c["arch"]], c["name"]
        assert c["model_type"] == arch["model_type"]
    for table in (HF_FULL_DEPTH_ARCHS, MLX_FULL_DEPTH_ARCHS):
        for key, arch in table.items():
            assert num_layers_of(arch) == PUBLISHED_LAYERS[key], key


def test_full_depth_configs_have_the_published_parameter_counts():
    """The config numbers are the released models' (parameters counted on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for key, n in PUBLISHED_PARAMS.items():
        arch = dict(HF_FULL_DEPTH_ARCHS[key])
        cfg = AutoConfig.for_model(arch.pop("model_type"), **arch)
        with torch.device("meta"):  # (accelerate's init_empty_weights skips the tying here)
            model = AutoModelForCausalLM.from_config(cfg)
        assert model.num_parameters() == n, key
        assert model.config.num_hidden_layers == PUBLISHED_LAYERS[key]


#: Published parameter counts of the encoders' and encoder-decoders' base models (``AutoModel``: BERT
#: and RoBERTa with their pooler), from the model cards / ``num_parameters()`` of the released checkpoints.
PUBLISHED_ENCODER_PARAMS = {
    "t5-base-12l": 222_903_552,
    "flan-t5-base-12l": 222_903_552,  # T5Model without its untied 24.7M LM head (the card: 248M)
    "bart-base-6l": 139_420_416,
    "bert-base-12l": 109_482_240,
    "bert-base-12l-token-cls": 109_482_240,
    "roberta-base-12l": 124_645_632,
    "distilbert-base-6l": 66_362_880,
    "vit-base-16-224-12l": 86_389_248,  # ViTModel with its pooler (google/vit-base-patch16-224-in21k)
}


def test_full_depth_encoders_have_the_published_parameter_counts_and_their_heads():
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel

    from memguard_core.estimator.heads import AUTO_CLASSES, head_kind_from_architectures

    for key, n in PUBLISHED_ENCODER_PARAMS.items():
        arch = dict(HF_FULL_DEPTH_ARCHS[key])
        cfg = AutoConfig.for_model(arch.pop("model_type"), **arch)
        with torch.device("meta"):
            base = AutoModel.from_config(cfg)
            kind = head_kind_from_architectures(cfg.architectures, cfg.model_type, cfg.is_encoder_decoder)
            headed = getattr(transformers, AUTO_CLASSES[kind]).from_config(cfg)
        assert base.num_parameters() == n, key
        assert cfg.num_hidden_layers == PUBLISHED_LAYERS[key]
        assert type(headed).__name__ == cfg.architectures[0], key
        last = [m for m in headed.modules() if isinstance(m, torch.nn.Linear)][-1]
        # the head's own classifier on top; an encoder-decoder's LM head over the vocabulary
        assert last.out_features == (cfg.vocab_size if cfg.is_encoder_decoder else cfg.num_labels), key


def test_full_depth_rows_are_grouped_by_how_the_estimator_saw_their_family():
    from memguard_bench.report import family_group

    fd = _fd()
    groups = {c["model_type"]: family_group(c) for c in fd if c["backend"] == "hf"}
    assert groups["llama"] == groups["gpt2"] == "fitted"
    # BERT and T5 are fitted on since the encoder LoRA heap factor (their cut cases in the matrix)
    assert groups["bert"] == groups["t5"] == "fitted"
    assert groups["roberta"] == groups["distilbert"] == groups["bart"] == "rules"
    assert groups["vit"] == "rules"
    assert groups["granitemoehybrid"] == groups["lfm2"] == groups["granitemoe"] == "held-out"


def test_every_full_depth_arch_names_its_source():
    src = resources.files("memguard_bench").joinpath("data", "archs_full_depth.toml").read_text()
    for backend, table in (("hf", HF_FULL_DEPTH_ARCHS), ("mlx", MLX_FULL_DEPTH_ARCHS)):
        for key in table:
            m = re.search(rf'^(?P<pre>(?:#.*\n)+)\[{backend}\."{re.escape(key)}"\]$', src, re.M)
            assert m, key
            assert re.search(r"[A-Za-z0-9-]+/[A-Za-z0-9._-]+", m.group("pre")), key


def test_full_depth_set_covers_what_users_run():
    fd = _fd()
    hf = [c for c in fd if c["backend"] == "hf"]
    mlx = [c for c in fd if c["backend"] == "mlx"]
    moe = {"granitemoe", "mixtral"}
    assert len({c["arch"] for c in hf if c["model_type"] not in moe}) >= 6
    assert {c["model_type"] for c in hf} >= moe
    assert len({c["arch"] for c in mlx}) >= 3
    # text rows (an image classifier's are its patch tokens: 16 images x 197 for ViT-base)
    tokens = [c["train"]["batch_size"] * c["train"]["seq_length"] for c in hf if c["model_type"] != "vit"]
    assert max(tokens) == 2048 and min(tokens) >= 512
    assert all(c["train"]["batch_size"] * c["train"]["seq_length"] <= 128 for c in mlx)
    t = [c["train"] for c in hf]
    assert any(x["dtype"] == "bf16" and not x["mixed_precision"] for x in t)       # pure bf16
    assert any(x["dtype"] == "bf16" and x["mixed_precision"] for x in t)           # autocast
    assert any(x["dtype"] == "fp32" for x in t)
    assert any(x["method"] == "full" for x in t) and any(x["method"] == "lora" for x in t)
    assert any(x["lora_targets"] == ["q_proj", "v_proj"] for x in t)
    assert {x["lora_rank"] for x in t if x["lora_targets"] == ["all-linear"]} & {16, 32, 64}
    assert all(16 <= x["lora_rank"] <= 64 for x in t if x["method"] == "lora")
    assert {x["grad_checkpoint"] for x in t} == {True, False}
    assert {x["optimizer"] for x in t} >= {"adamw", "sgd", "adafactor"}
    for c in fd:
        assert c["timeout_s"] > 0 and c["per_step"] is True
        if c["model_type"] in moe:
            assert c["steps"] >= 6, c["name"]
        else:
            assert 2 <= c["steps"] <= 3, c["name"]


def test_list_prints_the_full_depth_cases():
    p = subprocess.run([sys.executable, "-m", "memguard_bench", "--list", "--set", "full-depth", "--backend", "hf"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [c["name"] for c in select(case_set="full-depth", backends=("hf",))]
    h = subprocess.run([sys.executable, "-m", "memguard_bench", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert "full-depth" in h.stdout and "--date" in h.stdout


def test_a_per_step_record_is_scored_and_reported():
    from memguard_core.estimator.numbers import model_spec_from_numbers

    ms = model_spec_from_numbers(model_params=10_000_000, hidden_dim=256, num_layers=2, num_heads=4,
                                 vocab_size=1000, intermediate_size=512, model_bits=32)
    case = [c for c in _fd() if c["model_type"] == "granitemoe"][0]
    steps = [500 << 20, 510 << 20, 520 << 20, 530 << 20, 535 << 20, 536 << 20]
    rec = dict(peak_bytes=540 << 20, counter="cpu", seconds=3.0, model_spec=dataclasses.asdict(ms),
               step_peak_bytes=steps, pre_train_peak_bytes=300 << 20, date="2026-11-25",
               model_config={"model_type": "granitemoe"})
    row = score(case, rec, seed=False)
    assert row["full_depth"] and row["arch_fitted"] is False and row["step_peak_bytes"] == steps
    assert row["date"] == "2026-11-25"
    base = dict(path=repo_root() + "/bench/results/bench_cpu.json", date="2026-11-24",
                date_source="the last commit of the file", cases=1,
                hf=summarize([dict(name="a", error=0.01)]), mlx={"cases": 0},
                all=summarize([dict(name="a", error=0.01)]))
    md = markdown_report([row], {"cores": 2}, date="2026-11-26", baseline=base)
    assert "Report date: 2026-11-26; measured: 2026-11-25" in md
    assert "No constant of the estimator was fitted on the full-depth cases." in md
    assert "(a) **full-depth set**, measured 2026-11-25" in md
    assert "(b) **the small / truncated matrix**" in md and "measured 2026-11-24" in md
    assert "| 500, 510, 520, 530, 535, 536 |" in md


def test_baseline_summary_rescored_from_the_saved_matrix(tmp_path):
    import json

    from memguard_core.estimator.numbers import model_spec_from_numbers

    ms = model_spec_from_numbers(model_params=10_000_000, hidden_dim=256, num_layers=2, num_heads=4,
                                 vocab_size=1000, intermediate_size=512, model_bits=32)
    case = build_case("hf", "tiny", batch_size=2, seq_length=64)
    rec = dict(peak_bytes=500 << 20, counter="cpu", model_spec=dataclasses.asdict(ms))
    p = tmp_path / "b.json"
    p.write_text(json.dumps(dict(date="2026-11-20", cases=[dict(name=case["name"], case=case, measured=rec),
                                                           dict(name="x", case=case, measured={"error": "rc=1"})])))
    b = baseline_summary(str(p))
    assert b["date"] == "2026-11-20" and b["cases"] == 1 and b["hf"]["cases"] == 1 and b["mlx"] == {"cases": 0}
    assert baseline_summary(str(tmp_path / "missing.json")) is None


def test_bf16_moe_on_cpu_is_reported_apart_and_still_counted():
    """A mixture-of-experts model computing in bf16 on torch's CPU backend grows step after step
    (oneDNN's per-shape state): the report keeps its cases in every summary and shows the summary
    without them beside it, with the reason in plain words; dense and fp32 MoE cases are not
    labelled."""
    from memguard_hf.model_spec import model_spec_from_hf_config

    fd = {c["name"]: c for c in _fd()}
    moe_bf16 = [c for c in fd.values() if c["backend"] == "hf" and c["model_type"] in ("granitemoe", "mixtral")
                and c["train"]["dtype"] == "bf16"]
    dense = [c for c in fd.values() if c["backend"] == "hf" and c["model_type"] == "llama"]
    assert moe_bf16 and dense
    rows = []
    for c in moe_bf16 + dense[:2]:
        cfg = dict(HF_FULL_DEPTH_ARCHS[c["arch"]])
        ms = model_spec_from_hf_config(cfg)
        rec = dict(peak_bytes=6 << 30, counter="cpu", seconds=3.0, model_spec=dataclasses.asdict(ms),
                   step_peak_bytes=[5 << 30, 6 << 30], date="2026-11-25", model_config=cfg)
        rows.append(score(c, rec, seed=False))
    labelled = [r["name"] for r in rows if r.get("cpu_backend_effect") == CPU_BF16_MOE]
    assert labelled == [c["name"] for c in moe_bf16]
    # the same MoE in fp32, or on mlx, is not labelled
    ms_moe, ts_moe = specs_of(moe_bf16[0], dict(model_spec=dataclasses.asdict(
        model_spec_from_hf_config(dict(HF_FULL_DEPTH_ARCHS[moe_bf16[0]["arch"]]))), counter="cpu"))
    assert cpu_bf16_moe(ms_moe, ts_moe)
    assert not cpu_bf16_moe(ms_moe, ts_moe.replace(dtype="fp32"))
    assert not cpu_bf16_moe(ms_moe, ts_moe.replace(framework="mlx", device="mlx"))
    md = markdown_report(rows, {"cores": 2}, date="2026-11-25")
    n_all, n_moe = len(rows), len(moe_bf16)
    assert f"full depth, hf: {n_all} cases" in md                     # counted in the whole
    assert f"without the bf16 MoE cases (what the estimator models): {n_all - n_moe} cases" in md
    assert f"MoE in bf16 on the CPU (run as the guard runs them: glibc's mmap threshold fixed, below): {n_moe} cases" in md
    assert "counted in every summary above" in md and "mmap threshold fixed at 4 MiB" in md
    for c in moe_bf16:
        assert f"| {c['name']} |" in md                                  # the cases stay in the table
