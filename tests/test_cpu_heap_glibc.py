"""The CPU heap-slack factors follow the glibc release of the process that trains
(docs/benchmarks.md, "The CPU heap by C library version"): the release is read from the process,
validated, chosen by the CLI and the guard, and selects the factor set."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from memguard_core.cli import main
from memguard_core.errors import ConfigError
from memguard_core.estimator import cpu_heap
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.specs import TrainSpec
from memguard_core.guard import Guard
from memguard_core.options import GuardOptions
from memguard_core.probes import glibc_version
from memguard_hf.model_spec import model_spec_from_hf_config

SMOL = os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")
GiB = 2 ** 30


def test_glibc_version_reads_this_process():
    # this machine is Linux with glibc: the release its confstr names
    v = glibc_version()
    assert v is not None and re.fullmatch(r"\d+\.\d+(\.\d+)?", v)
    assert os.confstr("CS_GNU_LIBC_VERSION") == f"glibc {v}"


def test_glibc_version_is_none_off_glibc(monkeypatch):
    # a C library that is not glibc cannot be had here: confstr's answer is faked, at the one call
    monkeypatch.setattr(os, "confstr", lambda name: None)
    assert glibc_version() is None

    def refuse(name):
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(os, "confstr", refuse)
    assert glibc_version() is None


@pytest.mark.parametrize("bad", ["x", "2", "glibc 2.36", 2.39, ""])
def test_train_spec_glibc_names_the_field(bad):
    with pytest.raises(ConfigError, match="glibc"):
        TrainSpec(glibc=bad)


@pytest.mark.parametrize("version, newer", [(None, False), ("2.35", False), ("2.36", False),
                                            ("2.38", False), ("2.39", True), ("2.41", True),
                                            ("2.40.1", True), ("3.0", True)])
def test_the_release_picks_the_factor_set(version, newer):
    ts = TrainSpec(glibc=version)
    assert cpu_heap.newer_glibc_heap(ts) is newer
    f = cpu_heap.slack_factors(ts)
    if newer:
        assert f is cpu_heap.NEWER_GLIBC_SLACK
    else:
        assert f["forward"] is cpu_heap.CPU_HEAP_SLACK_FORWARD
        assert f["lora_temp"] == cpu_heap.LORA_TEMP_SLACK


def _lora(**kw):
    base = dict(batch_size=4, seq_length=256, method="lora", dtype="fp32", device="cpu")
    base.update(kw)
    return TrainSpec(**base)


def test_a_cpu_estimate_uses_its_release_s_factors():
    ms = model_spec_from_hf_config(SMOL)
    for gc in (False, True):
        old = estimate(ms, _lora(grad_checkpoint=gc, glibc="2.36"))
        new = estimate(ms, _lora(grad_checkpoint=gc, glibc="2.41"))
        f_old = cpu_heap.slack_factors(old.train_spec)
        f_new = cpu_heap.slack_factors(new.train_spec)
        kind = "checkpointed" if gc else "forward"
        # everything but the heap slack is the same estimate
        assert {k: v for k, v in old.breakdown.items() if k != "allocator_slack"} == \
               {k: v for k, v in new.breakdown.items() if k != "allocator_slack"}
        if f_old[kind]["lora"] != f_new[kind]["lora"]:
            assert (old.breakdown["allocator_slack"] > new.breakdown["allocator_slack"]) is \
                   (f_old[kind]["lora"] > f_new[kind]["lora"])
    # and only on the CPU: a CUDA estimate has no glibc heap in it
    cuda = [estimate(ms, _lora(device="cuda", glibc=v)).peak_bytes for v in ("2.36", "2.41")]
    assert cuda[0] == cuda[1]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_glibc_flag(capsys):
    base = ("estimate", "--config", SMOL, "--batch-size", "4", "--seq-length", "256", "--device", "cpu", "--json")
    peaks = {}
    for v in ("2.36", "2.41", "none"):
        code, out, _ = run(capsys, *base, "--glibc", v)
        assert code == 0
        peaks[v] = json.loads(out)["peak_bytes"]
    assert peaks["none"] == peaks["2.36"]     # unknown: the factors fitted on 2.36
    code, out, _ = run(capsys, *base)         # not given: this machine's release
    mine = TrainSpec(glibc=glibc_version())
    assert json.loads(out)["peak_bytes"] == peaks["2.41" if cpu_heap.newer_glibc_heap(mine) else "2.36"]
    code, _, err = run(capsys, *base, "--glibc", "two")
    assert code == 2 and "--glibc" in err


def test_the_guard_estimates_with_its_own_process_release():
    ms = model_spec_from_hf_config(SMOL)
    g = Guard(GuardOptions.from_kwargs(budget_bytes=64 * GiB, device="cpu", monitor_interval_s=0),
              log=logging.getLogger("memguard.test"))
    pf = g.plan(lambda: (ms, _lora()))
    assert pf.train_spec.glibc == glibc_version()


def test_the_estimate_names_whose_heap_it_counts():
    ms = model_spec_from_hf_config(SMOL)
    notes = {v: [n for n in estimate(ms, _lora(glibc=v)).notes if n.startswith("cpu heap")]
             for v in ("2.36", "2.41", None)}
    assert notes["2.41"] == ["cpu heap: glibc 2.41 (the heap-slack factors of glibc >= 2.39)"]
    assert "2.35 / 2.36" in notes["2.36"][0] and "not given" in notes[None][0]
    assert not [n for n in estimate(ms, _lora(device="cuda")).notes if n.startswith("cpu heap")]


def test_the_committed_newer_checkpointed_lora_factors_are_the_fit_on_the_241_matrix(capsys):
    # fitted jointly with the others held (``--knob`` twice) on the small matrix measured under
    # glibc 2.41; a refit on the same measurements must give the module's values back
    from memguard_testing.bench_scripts import load_bench_script

    fit = load_bench_script("fit_cpu_heap_slack")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results",
                        "bench_cpu_glibc241.json")
    assert fit.main([path, "--set", "newer", "--offset-mib", "42", "--knob", "checkpointed[lora]",
                     "--knob", "checkpointed_lora_blocks"]) == 0
    out = capsys.readouterr().out
    now = fit.current("newer")
    blocks, share = now[("checkpointed_lora_blocks", None)], now[("checkpointed", "lora")]
    assert f"checkpointed_lora_blocks {blocks} -> {blocks}," in out and f"checkpointed[lora] {share} -> {share}," in out
    # the older set keeps no one-block term (the form was fitted there and not adopted)
    assert cpu_heap.CPU_HEAP_SLACK_CHECKPOINTED_LORA_BLOCKS == 0.0


def _smol_cut(blocks: int):
    """SmolLM2-135M's config cut to ``blocks`` blocks (its ModelSpec read again, not replaced)."""
    import transformers

    with open(SMOL) as f:
        cfg = dict(json.load(f), num_hidden_layers=blocks)
    return model_spec_from_hf_config(transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg))


def test_on_a_newer_heap_checkpointed_lora_slack_grows_slowly_with_the_blocks():
    # from glibc 2.39 a freed block-sized hole takes an equal request: the slack is about one
    # block's working set plus a small share per block, where 2.35 / 2.36 add most of a block's
    # traffic for every block (docs/estimator.md, "Checkpointed LoRA on glibc 2.39 and later")
    def slack(version, blocks):
        return cpu_heap.heap_slack(_smol_cut(blocks), _lora(grad_checkpoint=True, glibc=version),
                                   gradients=0, param_bytes=4, logits=0)["loss"]

    one = cpu_heap.activation_traffic(_smol_cut(1), _lora())
    assert cpu_heap.activation_traffic(_smol_cut(8), _lora()) == pytest.approx(8 * one, rel=1e-6)
    f_new = cpu_heap.NEWER_GLIBC_SLACK
    # four more blocks add the newer share of their traffic, or the older set's share
    assert slack("2.41", 8) - slack("2.41", 4) == pytest.approx(4 * f_new["checkpointed"]["lora"] * one, rel=1e-5)
    assert slack("2.36", 8) - slack("2.36", 4) == pytest.approx(
        4 * cpu_heap.CPU_HEAP_SLACK_CHECKPOINTED["lora"] * one, rel=1e-5)
    # the newer set's one-block term beside it
    assert slack("2.41", 4) == pytest.approx((f_new["checkpointed_lora_blocks"] + 4 * f_new["checkpointed"]["lora"]) * one,
                                             rel=1e-5)
    assert slack("2.36", 4) == pytest.approx(4 * cpu_heap.CPU_HEAP_SLACK_CHECKPOINTED["lora"] * one, rel=1e-5)
