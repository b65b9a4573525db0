"""The adapters' shared preflight (memguard_core.preflight): plan target below the warning level,
the resident surplus counted, and the demos' budget helper."""

from __future__ import annotations

import os

import pytest

from memguard_core.errors import DoesNotFitError
from memguard_core.estimator.estimate import estimate
from memguard_core.preflight import budget_that_fits, plan_in_place, resident_extra
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config

SMOL = os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")
MiB = 2**20


@pytest.fixture(scope="module")
def ms():
    return model_spec_from_hf_config(SMOL)


def test_budget_that_fits_makes_the_planner_choose_that_split(ms):
    ts = TrainSpec(batch_size=8, seq_length=256, method="lora", dtype="fp32")
    half = ts.replace(batch_size=4, grad_accum=2)
    resident = estimate(ms, ts).breakdown["weights"] + estimate(ms, ts).breakdown["runtime_overhead"] + 80 * MiB
    budget = budget_that_fits(ms, half, resident_bytes=resident)
    pf = plan_in_place(ms, ts, budget, plan_fraction=0.85, resident_bytes=resident)
    assert pf.micro_batches == 2 and not pf.checkpointing_planned  # 4 x 256 tokens: cheaper than recompute
    assert pf.resident_extra_bytes == 80 * MiB
    assert pf.best_peak_bytes <= 0.85 * budget
    # without the 80 MiB surplus the same budget would have fitted a larger plan than the one chosen
    assert estimate(ms, half).peak_bytes + 80 * MiB == pf.best_peak_bytes
    # print(preflight) is one readable line with the figures, not the dataclass's ~10 KB (issue 34)
    text = repr(pf)
    assert len(text) < 1000 and "\n" not in text and "micro_batches=2" in text
    assert f"planned {pf.best_peak_bytes / 2**30:.2f} GiB of budget {pf.budget_bytes / 2**30:.2f} GiB" in text


def test_resident_extra_is_what_exceeds_runtime_and_weights():
    b = {"runtime_overhead": 100, "weights": 50, "activations": 999}
    assert resident_extra(b, 400) == 250
    assert resident_extra(b, 120) == 0
    assert resident_extra(b, None) == 0


def test_a_process_already_over_budget_does_not_fit(ms):
    ts = TrainSpec(batch_size=1, seq_length=64, method="lora")
    with pytest.raises(DoesNotFitError) as e:
        plan_in_place(ms, ts, 512 * MiB, plan_fraction=0.85, resident_bytes=4096 * MiB)
    assert e.value.shortfall_bytes > 0 and "before training" in " ".join(e.value.suggestions)


def test_method_and_lora_read_from_live_modules():
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    from memguard_core.preflight import attn_impl_from
    from memguard_torch.train_reading import method_and_lora
    from memguard_torch.module_spec import model_spec_from_module

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    assert method_and_lora(base, model_spec_from_module(base)) == ("full", {})
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    method, kw = method_and_lora(lora, model_spec_from_module(lora))
    assert method == "lora" and kw == {"lora_rank": 4, "lora_targets": ("q_proj", "v_proj"), "lora_dropout": 0.0}
    assert [attn_impl_from(n) for n in ("eager", "sdpa", "flash_attention_2", None)] == \
        ["eager", "sdpa", "flash", "sdpa"]


def test_report_lines_leave_out_terms_the_run_does_not_have(ms):
    """SGD without momentum keeps no optimizer states: the preflight's log lists the terms the run
    has, not a column of zeros."""
    ts = TrainSpec(batch_size=2, seq_length=128, method="full", dtype="fp32", optimizer="sgd")
    pf = plan_in_place(ms, ts, 64 * 2**30, plan_fraction=0.85)
    zero = [n for n, v in pf.estimate.breakdown.items() if v == 0]
    assert zero  # the premise: this run has terms at zero
    lines = pf.report_lines()
    for name, val in pf.estimate.breakdown.items():
        listed = any(ln.strip().startswith(name + " ") for ln in lines)
        assert listed == (val != 0), name


@pytest.mark.parametrize("bits,label", [(2, "2-bit"), (3, "3-bit"), (4, "4-bit"), (8, "8-bit")])
def test_plain_number_bits_are_labelled_by_their_bits_not_nf4(bits, label):
    # issue 34: --model-bits 2 / 3 were labelled NF4 in the estimate table
    from memguard_core.estimator.numbers import model_spec_from_numbers
    from memguard_core.report import weights_label

    ms = model_spec_from_numbers(model_params=1e9, hidden_dim=2048, num_layers=16, num_heads=16, model_bits=bits)
    assert weights_label(ms).startswith(label + " + ")


def test_a_4bit_hf_config_is_labelled_nf4(ms):
    from memguard_core.report import weights_label
    from memguard_hf.model_spec import model_spec_from_hf_config

    assert weights_label(model_spec_from_hf_config(SMOL, quantization_bits=4)).startswith("NF4 + ")
    assert "NF4" not in weights_label(ms)


def test_the_estimate_table_shows_the_gradients_at_the_loss_peak(ms):
    # issue 34: the table had no gradients row when the peak is the loss moment (gradients 0 there)
    from rich.console import Console

    from memguard_core.report import estimate_table

    est = estimate(ms, TrainSpec(batch_size=8, seq_length=1024, method="full", dtype="fp32", device="cpu"))
    assert est.phase == "loss" and est.breakdown["gradients"] == 0
    con = Console(width=200, record=True)
    con.print(estimate_table(est))
    text = con.export_text()
    grads = est.phase_breakdowns["backward"]["gradients"]
    assert f"gradients (none yet at the loss moment; {grads / 2**30:,.2f} GiB at the backward moment)" in text


def test_does_not_fit_names_the_budget_the_user_set_and_how_the_target_derives(ms):
    # issue 34 item 1: fail_fast said "the budget is 0.25 GiB" after budget_gib=0.3 (it quoted the
    # planner's target, 85 % of the budget less what the process holds)
    from memguard_core.errors import DoesNotFitError

    ts = TrainSpec(batch_size=8, seq_length=512, method="full", dtype="fp32")
    budget = int(0.3 * 2**30)
    with pytest.raises(DoesNotFitError) as e:
        plan_in_place(ms, ts, budget, plan_fraction=0.85, resident_bytes=None, apply=("micro_batch",))
    msg = str(e.value)
    target = f"{int(budget * 0.85) / 2**30:.2f}"
    assert e.value.budget_bytes == budget and f"the budget is 0.30 GiB; the plan targets {target} GiB of it (85%" in msg
    assert e.value.best_peak_bytes - e.value.shortfall_bytes == int(budget * 0.85)
