"""The ``memguard`` CLI: the JSON contract of ``estimate`` and clear errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memguard_core.cli import main

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
SMOL = os.path.join(CONFIGS, "smollm2-135m.json")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_contract(capsys):
    code, out, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "4", "--seq-length", "256",
                       "--method", "lora", "--json")
    assert code == 0
    d = json.loads(out)
    assert isinstance(d["peak_bytes"], int) and d["peak_bytes"] > 0
    assert all(isinstance(v, int) for v in d["breakdown"].values())
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    assert d["counter"] == "cpu"


def test_estimate_grows_with_batch_and_plans_against_a_budget(capsys):
    _, out4, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "4", "--json")
    _, out8, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "8", "--json")
    p4, p8 = json.loads(out4)["peak_bytes"], json.loads(out8)["peak_bytes"]
    assert p8 > p4
    budget_gib = (p4 + p8) / 2 / 2**30
    code, out, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "8", "--json",
                       "--budget-gib", f"{budget_gib:.4f}")
    d = json.loads(out)
    assert code == 0 and d["fits"] is False
    assert d["plan"]["peak_bytes"] <= d["budget_bytes"]
    assert d["plan"]["changes"]


def test_no_heap_trim_estimates_a_plain_checkpointed_run_higher(capsys):
    # the default is the run as the guard runs it (the heap trimmed at every step's end); a plain
    # checkpointed full fine-tune on CPU also keeps the last step's gradient holes
    base = ("estimate", "--config", SMOL, "--method", "full", "--dtype", "fp32", "--batch-size", "1",
            "--seq-length", "16", "--grad-checkpoint", "--device", "cpu", "--json")
    _, trimmed, _ = run(capsys, *base)
    code, plain, _ = run(capsys, *base, "--no-heap-trim")
    assert code == 0
    assert json.loads(plain)["peak_bytes"] > json.loads(trimmed)["peak_bytes"]


def test_estimate_from_plain_numbers(capsys):
    code, out, _ = run(capsys, "estimate", "--model-params", "9e9", "--model-bits", "4", "--hidden-dim", "4096",
                       "--num-heads", "32", "--num-layers", "32", "--batch-size", "4", "--seq-length", "2048",
                       "--lora-rank", "32", "--lora-layers", "16", "--method", "qlora", "--device", "mlx",
                       "--framework", "mlx", "--json")
    assert code == 0
    assert json.loads(out)["counter"] == "mlx"


def test_paged_optimizer_and_bnb_version_flags(capsys):
    # HF optim spellings are taken; the paged states leave nothing to split by hand, and an older
    # bitsandbytes (its 4-bit linears keep their inputs) estimates higher than a newer one
    base = ("estimate", "--config", os.path.join(CONFIGS, "llama-3-8b.json"), "--method", "qlora",
            "--device", "cuda", "--seq-length", "512", "--json")
    peaks = {}
    for opt in ("paged_adamw_8bit", "paged_adamw_32bit", "adamw_bnb_8bit"):
        for ver in ("0.42.0", "0.45.0"):
            code, out, _ = run(capsys, *base, "--optimizer", opt, "--bnb-version", ver)
            assert code == 0
            peaks[opt, ver] = json.loads(out)["peak_bytes"]
    for opt in ("paged_adamw_8bit", "paged_adamw_32bit"):
        assert peaks[opt, "0.42.0"] > peaks[opt, "0.45.0"]
    code, _, err = run(capsys, *base, "--bnb-version", "latest")
    assert code != 0 and "--bnb-version" in err


def test_does_not_fit_exits_3_with_suggestions(capsys):
    code, out, _ = run(capsys, "estimate", "--config", os.path.join(CONFIGS, "llama-3-8b.json"),
                       "--method", "full", "--batch-size", "8", "--seq-length", "4096",
                       "--budget-gib", "1", "--json")
    assert code == 3
    d = json.loads(out)
    assert d["does_not_fit"]["shortfall_bytes"] > 0 and d["does_not_fit"]["suggestions"]


@pytest.mark.parametrize("argv,flag", [
    (["--batch-size", "-1"], "--batch-size"),
    (["--seq-length", "0"], "--seq-length"),
    (["--optimizer", "lion"], "--optimizer"),
    (["--method", "prefix"], "--method"),
    (["--dtype", "fp8"], "--dtype"),
    (["--budget-gib", "-2"], "--budget-gib"),
])
def test_bad_values_name_the_flag(capsys, argv, flag):
    code, out, err = run(capsys, "estimate", "--config", SMOL, *argv)
    assert code == 2
    assert f"invalid {flag}" in err
    assert out == ""


def test_missing_config_field_is_named(capsys, tmp_path):
    cfg = json.load(open(SMOL))
    del cfg["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, _, err = run(capsys, "estimate", "--config", str(path))
    assert code == 2 and "hidden_size" in err


def test_unreadable_or_invalid_file(capsys, tmp_path):
    code, _, err = run(capsys, "estimate", "--config", str(tmp_path / "nope.json"))
    assert code == 2 and "nope.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "estimate", "--config", str(bad))
    assert code == 2 and "bad.json" in err


def test_numbers_without_config_name_the_missing_flag(capsys):
    code, _, err = run(capsys, "estimate", "--model-params", "1e9")
    assert code == 2 and "--hidden-dim" in err


def test_probe_json(capsys):
    code, out, _ = run(capsys, "probe", "--json")
    d = json.loads(out)
    assert code == 0
    assert 0 < d["available_bytes"] <= d["total_bytes"]
    assert d["process_bytes"] > 0


def test_console_script_help_and_exit_code():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", "--help"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "--lora-targets" in proc.stdout and "--grad-checkpoint" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", "--config", SMOL,
                           "--optimizer", "lion"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "invalid --optimizer" in proc.stderr


def test_core_imports_no_framework():
    code = ("import sys, memguard_core, memguard_core.cli, memguard_core.estimator, memguard_core.plan, "
            "memguard_core.monitor, memguard_core.probes, memguard_core.stats, memguard_core.estimator.estimate; "
            "bad = [m for m in ('torch', 'mlx', 'transformers', 'accelerate') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ defaults said, nonsense refused

GPT2 = os.path.join(CONFIGS, "gpt2.json")
NUMBERS = ("--model-params", "7e9", "--hidden-dim", "4096", "--num-layers", "32", "--num-heads", "32")


def test_default_lora_targets_are_peft_defaults_for_the_model_type(capsys):
    # gpt2 has no q_proj: PEFT's LoraConfig(target_modules=None) adapts c_attn there
    from memguard_core.estimator.lora_targets import peft_default_lora_targets

    code, out, err = run(capsys, "estimate", GPT2, "--device", "cpu", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["train"]["lora_targets"] == ["c_attn"] == list(peft_default_lora_targets("gpt2"))
    assert "--lora-targets not given: c_attn" in err and "gpt2" in err
    _, out_given, _ = run(capsys, "estimate", GPT2, "--device", "cpu", "--json", "--lora-targets", "c_attn")
    assert json.loads(out_given)["peak_bytes"] == d["peak_bytes"]
    # plain numbers keep q_proj,v_proj, and say so
    code, out, err = run(capsys, "estimate", *NUMBERS, "--json")
    assert code == 0 and json.loads(out)["train"]["lora_targets"] == ["q_proj", "v_proj"]
    assert "--lora-targets not given: q_proj,v_proj" in err
    # a full fine-tune has no targets to pick: nothing said
    code, _, err = run(capsys, "estimate", GPT2, "--device", "cpu", "--method", "full", "--json")
    assert code == 0 and "--lora-targets" not in err


def test_peft_default_targets_match_peft_itself():
    # read from the installed peft's source without importing it; the same table peft applies
    peft_constants = pytest.importorskip("peft.utils.constants")
    from memguard_core.estimator.lora_targets import peft_default_lora_targets

    table = peft_constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    for model_type, names in table.items():
        if isinstance(names, str):
            continue
        assert peft_default_lora_targets(model_type) == tuple(names)
    assert peft_default_lora_targets("no-such-model-type") is None


def test_python_api_applies_peft_default_targets():
    # TrainSpec() without lora_targets on a config-built spec: PEFT's targets, in estimate and plan
    from memguard_core.estimator.estimate import estimate
    from memguard_core.plan import plan
    from memguard_core.estimator.numbers import model_spec_from_numbers
    from memguard_core.estimator.specs import TrainSpec
    from memguard_hf.model_spec import model_spec_from_hf_config

    ms = model_spec_from_hf_config(GPT2)
    est = estimate(ms, TrainSpec(batch_size=2, seq_length=128))
    same = estimate(ms, TrainSpec(batch_size=2, seq_length=128, lora_targets=("c_attn",)))
    assert est.peak_bytes == same.peak_bytes and est.to_dict()["train"]["lora_targets"] == ["c_attn"]
    p = plan(ms, TrainSpec(batch_size=2, seq_length=128), 1 << 40)
    assert p.train_spec.lora_targets == ("c_attn",)
    # an explicit q_proj,v_proj is not the default: gpt2 has no such module
    with pytest.raises(Exception, match="lora_targets"):
        estimate(ms, TrainSpec(lora_targets=("q_proj", "v_proj")))
    assert TrainSpec() != TrainSpec(lora_targets=("q_proj", "v_proj"))
    nums = model_spec_from_numbers(model_params=int(1e9), hidden_dim=2048, num_layers=16, num_heads=16)
    assert estimate(nums, TrainSpec()).to_dict()["train"]["lora_targets"] == ["q_proj", "v_proj"]


def test_world_size_without_sharding_is_ddp_and_said(capsys):
    base = ("estimate", os.path.join(CONFIGS, "llama-3-8b.json"), "--method", "full", "--dtype", "bf16",
            "--grad-checkpoint", "--device", "cuda", "--json")
    code, out_default, err = run(capsys, *base, "--world-size", "2")
    assert code == 0 and "--sharding ddp" in err
    _, out_ddp, _ = run(capsys, *base, "--world-size", "2", "--sharding", "ddp")
    _, out_none, err_none = run(capsys, *base, "--world-size", "2", "--sharding", "none")
    assert json.loads(out_default)["peak_bytes"] == json.loads(out_ddp)["peak_bytes"]
    assert json.loads(out_ddp)["peak_bytes"] > json.loads(out_none)["peak_bytes"]
    assert "--sharding" not in err_none
    _, _, err1 = run(capsys, *base)
    assert "--sharding" not in err1


@pytest.mark.parametrize("argv,flag,words", [
    (["--trace", "--sharding", "fsdp-full", "--world-size", "2"], "--trace", "per-rank"),
    (["--trace", "--world-size", "2"], "--trace", "per-rank"),
    (["--num-layers", "4"], "--num-layers", "plain numbers only"),
    (["--vocab-size", "32000"], "--vocab-size", "plain numbers only"),
    (["--model-bits", "4"], "--model-bits", "plain numbers only"),
    (["--model-params", "1e9"], "--model-params", "plain numbers only"),
    (["--image-tokens", "64"], "--image-tokens", "text-only"),
    (["--safety-ratio", "1.5"], "--safety-ratio", "(0, 1]"),
    (["--safety-ratio", "0"], "--safety-ratio", "(0, 1]"),
    (["--budget-gib", "2", "--available-gib", "3"], "--budget-gib", "--available-gib"),
    (["--method", "full", "--lora-rank", "16"], "--lora-rank", "--method full"),
    (["--method", "full", "--lora-targets", "q_proj"], "--lora-targets", "--method full"),
    (["--method", "full", "--double-quant"], "--double-quant", "--method full"),
    (["--shard-group-size", "2", "--world-size", "4", "--sharding", "fsdp-full"], "--shard-group-size",
     "--sharding fsdp-hybrid"),
])
def test_contradictory_flags_are_refused(capsys, argv, flag, words):
    code, out, err = run(capsys, "estimate", SMOL, "--device", "cpu", *argv)
    assert code == 2 and out == ""
    assert f"invalid {flag}" in err and words in err and "Traceback" not in err


def test_missing_model_and_trace_without_config_say_what_is_needed(capsys):
    code, _, err = run(capsys, "estimate")
    assert code == 2 and "invalid MODEL" in err and "config.json" in err and "hub id" in err
    code, _, err = run(capsys, "estimate", *NUMBERS, "--trace")
    assert code == 2 and "invalid --trace" in err and "model config" in err


def test_revision_with_a_local_file_is_said(capsys):
    code, _, err = run(capsys, "estimate", SMOL, "--revision", "main", "--device", "cpu")
    assert code == 0 and "--revision main ignored" in err


def test_help_states_the_defaults_chosen_for_the_user():
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="100")

    def help_of(cmd):
        proc = subprocess.run([sys.executable, "-m", "memguard_core.cli", cmd, "--help"], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 0
        return " ".join(proc.stdout.split())

    est = help_of("estimate")
    assert "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING" in est and "gpt2: c_attn" in est
    assert "ddp with --world-size above 1" in est
    assert "cuda:N | mlx | mps" in help_of("probe")


def test_closed_stdout_ends_quietly():
    # the reader is gone before the JSON is written: no BrokenPipeError traceback, 128 + SIGPIPE
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "memguard_core.cli", "estimate", *NUMBERS, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_trace_runs_for_a_plain_pytorch_loop(capsys):
    # --framework torch runs the same torch model as hf: the trace applies (it needs transformers)
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    code, out, err = run(capsys, "estimate", SMOL, "--device", "cpu", "--framework", "torch", "--batch-size", "1",
                         "--seq-length", "32", "--trace", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["trace"] and d["train"]["framework"] == "torch"
