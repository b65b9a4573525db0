"""The dtype contract of ``memguard estimate`` and ``estimate()``: without mixed precision the
weights are stored in the compute dtype (``--dtype`` / ``TrainSpec.dtype``); the config's
``torch_dtype`` is only the default; ``--mixed-precision`` means fp32 weights with autocast."""

from __future__ import annotations

import json
import os

import pytest

from memguard_core.cli import main
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.specs import TrainSpec
from memguard_core.estimator.trainable import weights_for_training
from memguard_hf.model_spec import model_spec_from_hf_config

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def _config(tmp_path, dtype):
    with open(os.path.join(CONFIGS, "tinyllama-1.1b.json")) as f:
        d = json.load(f)
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    if dtype:
        d["torch_dtype"] = dtype
    p = tmp_path / f"config-{dtype}.json"
    p.write_text(json.dumps(d))
    return str(p)


def _est(capsys, *argv):
    code = main(["estimate", *argv, "--method", "full", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("declared", ["float32", None, "bfloat16"])
def test_dtype_flag_sets_the_weights_dtype(capsys, tmp_path, declared):
    cfg = _config(tmp_path, declared)
    d = _est(capsys, "--config", cfg, "--dtype", "bf16")
    n = d["trainable_params"]  # full fine-tune: every parameter
    assert d["train"]["dtype"] == "bf16" and not d["train"]["mixed_precision"]
    assert d["model"]["dense_bits"] == 16.0 and d["model"]["weight_dtype"] == "bf16"
    assert d["breakdown"]["weights"] == 2 * n  # 2 bytes per weight, whatever the config said


@pytest.mark.parametrize("declared,expected", [("float32", "fp32"), (None, "fp32"), ("bfloat16", "bf16"),
                                               ("float16", "fp16")])
def test_without_dtype_the_config_decides(capsys, tmp_path, declared, expected):
    d = _est(capsys, "--config", _config(tmp_path, declared))
    assert d["train"]["dtype"] == expected
    assert d["breakdown"]["weights"] == (4 if expected == "fp32" else 2) * d["trainable_params"]


def test_mixed_precision_keeps_fp32_weights(capsys, tmp_path):
    d = _est(capsys, "--config", _config(tmp_path, "bfloat16"), "--mixed-precision")
    assert d["train"]["dtype"] == "bf16" and d["train"]["mixed_precision"]
    assert d["model"]["dense_bits"] == 32.0
    assert d["breakdown"]["weights"] == 4 * d["trainable_params"]


def test_mixed_precision_with_fp32_is_refused(capsys, tmp_path):
    code = main(["estimate", "--config", _config(tmp_path, None), "--mixed-precision", "--dtype", "fp32"])
    _, err = capsys.readouterr()
    assert code == 2 and "--dtype" in err and "Traceback" not in err


def test_python_api_counts_the_train_spec_dtype(tmp_path):
    ms = model_spec_from_hf_config(_config(tmp_path, "float32"))
    assert ms.dense_bits == 32.0 and ms.weight_dtype == "fp32"
    bf16 = estimate(ms, TrainSpec(method="full", dtype="bf16", batch_size=1, seq_length=64))
    fp32 = estimate(ms, TrainSpec(method="full", dtype="fp32", batch_size=1, seq_length=64))
    assert bf16.breakdown["weights"] * 2 == fp32.breakdown["weights"] == 4 * ms.total_params
    assert bf16.model_spec.dense_bits == 16.0
    # a spec read from a live module keeps what it found
    live = ms.replace(source="module")
    assert weights_for_training(live, TrainSpec(dtype="bf16")) is live


def test_qlora_keeps_nf4_block_linears(tmp_path):
    ms = model_spec_from_hf_config(_config(tmp_path, "bfloat16"), quantization_bits=4)
    out = weights_for_training(ms, TrainSpec(method="qlora", dtype="bf16"))
    assert out.weight_bits == ms.weight_bits < 5 and out.dense_bits == 16.0


def test_table_names_the_weights_dtype_and_phases(capsys, tmp_path):
    code = main(["estimate", "--config", _config(tmp_path, "float32"), "--dtype", "bf16", "--method", "full"])
    out, _ = capsys.readouterr()
    out = " ".join(out.split())  # the caption wraps at the console width
    assert code == 0
    assert "weights bf16" in out and "compute bf16" in out
    for phase in ("loss moment", "backward moment", "optimizer moment"):
        assert phase in out
