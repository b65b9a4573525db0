"""Every public input of the core API and the CLI is validated with an error naming the field.

A table of (callable, bad input, field the error must name). Each row builds the object or calls
the function with one bad value and checks the ``ConfigError``'s ``field`` (API) or the CLI's
``invalid <flag>`` message and exit status 2.
"""

from __future__ import annotations

import os

import pytest

from memguard_core.cli import main as cli_main
from memguard_core.errors import ConfigError
from memguard_core.estimator.estimate import estimate
from memguard_core.monitor import MemoryMonitor, PsiPolicy, Thresholds
from memguard_core.plan import budget_from_available, plan
from memguard_core.estimator.numbers import model_spec_from_numbers
from memguard_core.estimator.specs import TrainSpec

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
SMOL = os.path.join(CONFIGS, "smollm2-135m.json")
GiB = 2**30
NUMS = dict(model_params=135_000_000, hidden_dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
            vocab_size=49152, intermediate_size=1536)


def _ms():
    return model_spec_from_numbers(**NUMS)


def _numbers(**bad):
    return model_spec_from_numbers(**{**NUMS, **bad})


API_CASES = [
    # TrainSpec
    (lambda: TrainSpec(batch_size=0), "batch_size"),
    (lambda: TrainSpec(batch_size=-1), "batch_size"),
    (lambda: TrainSpec(batch_size=2.5), "batch_size"),
    (lambda: TrainSpec(batch_size=True), "batch_size"),
    (lambda: TrainSpec(seq_length=0), "seq_length"),
    (lambda: TrainSpec(grad_accum=0), "grad_accum"),
    (lambda: TrainSpec(world_size=2.5), "world_size"),
    (lambda: TrainSpec(world_size=0), "world_size"),
    (lambda: TrainSpec(method="prefix"), "method"),
    (lambda: TrainSpec(optimizer="lion"), "optimizer"),
    (lambda: TrainSpec(dtype="fp8"), "dtype"),
    (lambda: TrainSpec(attn_impl="xformers"), "attn_impl"),
    (lambda: TrainSpec(framework="jax"), "framework"),
    (lambda: TrainSpec(device="tpu"), "device"),
    (lambda: TrainSpec(lora_rank=0), "lora_rank"),
    (lambda: TrainSpec(lora_layers=0), "lora_layers"),
    (lambda: TrainSpec(lora_targets=()), "lora_targets"),
    # Thresholds / PsiPolicy
    (lambda: Thresholds(warning=0), "thresholds.warning"),
    (lambda: Thresholds(critical=1.2), "thresholds.critical"),
    (lambda: Thresholds(emergency="high"), "thresholds.emergency"),
    (lambda: Thresholds(warning=0.95, critical=0.9), "thresholds"),
    (lambda: Thresholds(hysteresis=0.9), "thresholds.hysteresis"),
    (lambda: PsiPolicy(threshold=-1), "psi.threshold"),
    (lambda: PsiPolicy(min_samples=0), "psi.min_samples"),
    # MemoryMonitor
    (lambda: MemoryMonitor(0), "budget_bytes"),
    (lambda: MemoryMonitor(1.5 * GiB), "budget_bytes"),
    (lambda: MemoryMonitor(GiB, device="gpu"), "device"),
    (lambda: MemoryMonitor(GiB, safety_ratio=0), "safety_ratio"),
    (lambda: MemoryMonitor(GiB, thresholds={"warning": 0.8}), "thresholds"),
    (lambda: MemoryMonitor(GiB, interval_s=-0.1), "interval_s"),
    (lambda: MemoryMonitor(GiB, micro_batches=0), "micro_batches"),
    (lambda: MemoryMonitor(GiB, max_micro_batches=0), "max_micro_batches"),
    (lambda: MemoryMonitor(GiB, psi=10), "psi"),
    (lambda: MemoryMonitor(GiB, clean_fn="gc"), "clean_fn"),
    (lambda: MemoryMonitor(GiB, on_event=1), "on_event"),
    # plan / estimate / budget_from_available
    (lambda: budget_from_available(-1), "available_bytes"),
    (lambda: budget_from_available(GiB, 1.5), "safety_ratio"),
    (lambda: budget_from_available(GiB, 0), "safety_ratio"),
    (lambda: estimate("smollm", TrainSpec()), "model_spec"),
    (lambda: estimate(_ms(), {"batch_size": 4}), "train_spec"),
    (lambda: estimate(_ms(), TrainSpec(), correction=0), "correction"),
    (lambda: estimate(_ms(), TrainSpec(lora_targets=("w_nope",))), "lora_targets"),
    (lambda: plan(_ms(), TrainSpec(), 0), "budget_bytes"),
    (lambda: plan(_ms(), TrainSpec(), GiB, allow=("quantize",)), "allow"),
    (lambda: plan(_ms(), TrainSpec(), GiB, min_batch=0), "min_batch"),
    (lambda: plan(None, TrainSpec(), GiB), "model_spec"),
    # model_spec_from_numbers
    (lambda: _numbers(model_params=0), "model_params"),
    (lambda: _numbers(model_params=1000), "model_params"),
    (lambda: _numbers(hidden_dim=-576), "hidden_dim"),
    (lambda: _numbers(hidden_dim=577), "hidden_dim"),
    (lambda: _numbers(num_layers=0), "num_layers"),
    (lambda: _numbers(num_heads=0), "num_heads"),
    (lambda: _numbers(num_kv_heads=2), "num_kv_heads"),
    (lambda: _numbers(vocab_size=0), "vocab_size"),
    (lambda: _numbers(intermediate_size=0), "intermediate_size"),
    (lambda: _numbers(model_bits=7), "model_bits"),
    (lambda: _numbers(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    (lambda: _numbers(tie_word_embeddings="yes"), "tie_word_embeddings"),
    (lambda: _numbers(name=""), "name"),
]


@pytest.mark.parametrize("make,field", API_CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(API_CASES)])
def test_core_api_names_the_bad_field(make, field):
    with pytest.raises(ConfigError) as e:
        make()
    assert e.value.field == field
    assert field in str(e.value)


CALLBACK_CASES = [
    (dict(budget_bytes=0), "budget_bytes"),
    (dict(budget_bytes="1GiB"), "budget_bytes"),
    (dict(safety_ratio=2), "safety_ratio"),
    (dict(thresholds=0.9), "thresholds"),
    (dict(seq_length=0), "seq_length"),
    (dict(apply=("quantize",)), "apply"),
    (dict(fail_fast="yes"), "fail_fast"),
    (dict(loss_weighting="mean"), "loss_weighting"),
    (dict(split=0), "split"),
    (dict(micro_batches=0), "micro_batches"),
    (dict(grow=16), "grow"),
    (dict(monitor_interval_s=-1), "monitor_interval_s"),
    (dict(device="gpu"), "device"),
    (dict(preflight=None), "preflight"),
    (dict(monitor_interval_s=float("nan")), "monitor_interval_s"),
    (dict(eval_micro_batches=0), "eval_micro_batches"),
    (dict(budget_byts=2**30), "budget_byts"),  # a misspelt option is named, not a TypeError
]


@pytest.mark.parametrize("kw,field", CALLBACK_CASES, ids=[c[1] for c in CALLBACK_CASES])
def test_memguard_callback_kwargs_name_the_bad_field(kw, field, monkeypatch):
    pytest.importorskip("transformers")
    from memguard_hf import MemGuardCallback

    monkeypatch.delenv("MEMGUARD_SPLIT", raising=False)
    monkeypatch.delenv("MEMGUARD_MICRO_BATCHES", raising=False)
    with pytest.raises(ConfigError) as e:
        MemGuardCallback(**kw)
    assert e.value.field == field


def test_adapters_take_the_same_guard_options():
    """Both torch callbacks list every guard option in their signatures (help(), IDEs), so the
    shared keywords live once, in GuardOptions.from_kwargs."""
    import inspect

    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    from memguard_core.options import GUARD_OPTION_NAMES
    from memguard_hf import MemGuardCallback as HF
    from memguard_lightning import MemGuardCallback as PL

    hf = list(inspect.signature(HF).parameters)
    pl = list(inspect.signature(PL).parameters)
    assert hf == list(GUARD_OPTION_NAMES)
    assert pl == ["label_key", "shift_labels"] + list(GUARD_OPTION_NAMES)
    assert PL(label_key="y", budget_gib=1.0).options.budget_bytes == 2**30


MLX_CASES = [
    (dict(tresholds=Thresholds()), "tresholds"),   # misspelt: named, not Python's TypeError
    (dict(device="cpu"), "device"),                # a torch adapters' option MLX does not take
    (dict(budget_gb=8), "budget_gb"),
    (dict(safety_ratio=3), "safety_ratio"),
]


@pytest.mark.parametrize("kw,field", MLX_CASES, ids=[c[1] for c in MLX_CASES])
def test_mlx_guard_kwargs_name_the_bad_field(kw, field):
    pytest.importorskip("mlx_lm")
    import inspect

    from memguard_mlx import MlxGuard

    with pytest.raises(ConfigError) as e:
        MlxGuard(**kw)
    assert e.value.field == field
    # the catch-all for misspelt names stays out of the signature help() and IDEs show
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in inspect.signature(MlxGuard).parameters.values())


def test_memguard_callback_bad_micro_batches_environment(monkeypatch):
    pytest.importorskip("transformers")
    from memguard_hf import MemGuardCallback

    monkeypatch.setenv("MEMGUARD_SPLIT", "two")   # the name before issue 32: not read
    assert MemGuardCallback().options.micro_batches == 1
    monkeypatch.setenv("MEMGUARD_MICRO_BATCHES", "two")
    with pytest.raises(ConfigError) as e:
        MemGuardCallback()
    assert e.value.field == "MEMGUARD_MICRO_BATCHES"


CLI_CASES = [
    (["--batch-size", "0"], "--batch-size"),
    (["--seq-length", "-5"], "--seq-length"),
    (["--grad-accum", "0"], "--grad-accum"),
    (["--method", "prefix"], "--method"),
    (["--lora-rank", "0"], "--lora-rank"),
    (["--lora-layers", "0"], "--lora-layers"),
    (["--optimizer", "lion"], "--optimizer"),
    (["--dtype", "fp8"], "--dtype"),
    (["--attn", "xformers"], "--attn"),
    (["--framework", "jax"], "--framework"),
    (["--device", "tpu"], "--device"),
    (["--world-size", "-3"], "--world-size"),
    (["--world-size", "0"], "--world-size"),
    (["--budget-gib", "0"], "--budget-gib"),
    (["--available-gib", "-1"], "--available-gib"),
    (["--available-gib", "8", "--safety-ratio", "1.5"], "--safety-ratio"),
]


@pytest.mark.parametrize("argv,flag", CLI_CASES, ids=[c[1] + "=" + c[0][-1] for c in CLI_CASES])
def test_cli_estimate_flags_name_the_bad_flag(argv, flag, capsys):
    code = cli_main(["estimate", "--config", SMOL, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"invalid {flag}" in err


NUMBER_CASES = [
    (["--model-params", "0"], "--model-params"),
    (["--hidden-dim", "0"], "--hidden-dim"),
    (["--num-layers", "-1"], "--num-layers"),
    (["--num-heads", "0"], "--num-heads"),
    (["--num-kv-heads", "2"], "--num-kv-heads"),
    (["--vocab-size", "0"], "--vocab-size"),
    (["--model-bits", "7"], "--model-bits"),
]


@pytest.mark.parametrize("argv,flag", NUMBER_CASES, ids=[c[1] for c in NUMBER_CASES])
def test_cli_model_numbers_name_the_bad_flag(argv, flag, capsys):
    base = {"--model-params": "135e6", "--hidden-dim": "576", "--num-layers": "30", "--num-heads": "9",
            "--num-kv-heads": "3"}
    base[argv[0]] = argv[1]
    args = [x for kv in base.items() for x in kv]
    if argv[0] not in base:
        args += argv
    code = cli_main(["estimate", *args])
    _, err = capsys.readouterr()
    assert code == 2 and f"invalid {flag}" in err


@pytest.mark.parametrize("argv,word", [
    (["estimate", "--config", "/nonexistent/config.json"], "config"),
    (["estimate", "--hidden-dim", "576"], "--model-params"),
    (["probe", "--device", "gpu"], "--device"),
])
def test_cli_other_bad_inputs(argv, word, capsys):
    code = cli_main(argv)
    _, err = capsys.readouterr()
    assert code == 2 and word in err
