"""The guard lifecycle (memguard_core.guard.Guard, docs/lifecycle.md) without a framework: one rule
per moment, the summary keys, the deprecated names and the version warning of the ``_compat``
modules."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from memguard_core import versions
from memguard_core.errors import ConfigError, DoesNotFitError
from memguard_core.guard import Guard
from memguard_core.options import GuardOptions, micro_batches_from_env, option_kwargs
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config

SMOL = os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")
GiB = 2**30
SUMMARY_KEYS = {"micro_batches", "max_usage", "budget_bytes", "measured_peak_bytes", "process_peak_rss_bytes",
                "estimated_peak_bytes",
                "requested_peak_bytes", "optimizer_steps", "samples_per_step", "oom_retries", "events", "event_log"}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("MEMGUARD_MICRO_BATCHES", raising=False)
    monkeypatch.delenv("MEMGUARD_SPLIT", raising=False)


@pytest.fixture(scope="module")
def specs():
    # the MLX counter: no resident-memory term from this (large) pytest process
    return (model_spec_from_hf_config(SMOL),
            TrainSpec(batch_size=8, seq_length=128, method="lora", framework="mlx", device="mlx"))


def _guard(**kw) -> Guard:
    kw.setdefault("monitor_interval_s", 0)
    kw.setdefault("device", "cpu")
    return Guard(GuardOptions.from_kwargs(**kw), log=logging.getLogger("memguard.test"))


def test_a_plan_that_fits_changes_nothing_and_keeps_the_budget(specs):
    g = _guard(budget_bytes=64 * GiB)
    mon = g.start(rows=8, read_specs=lambda: specs)
    try:
        assert g.preflight is not None and g.preflight.micro_batches == 1 and mon.micro_batches == 1
        assert g.budget_bytes == mon.budget_bytes == 64 * GiB
        assert g.preflight.plan_fraction == g.options.thresholds.warning  # planned below the warning level
    finally:
        g.stop()


def test_nothing_fits_starts_with_one_row_micro_batches_and_checkpointing(specs, caplog):
    turned_on = []
    g = _guard(budget_bytes=2**20)
    with caplog.at_level(logging.ERROR, logger="memguard.test"):
        mon = g.start(rows=8, read_specs=lambda: specs, enable_checkpointing=lambda: turned_on.append(True))
    g.stop()
    assert mon.micro_batches == 8 and turned_on == [True] and g.preflight is None
    assert "nothing fits" in caplog.text


def test_the_summary_counts_the_preflights_decision_and_names_only_a_written_log(specs, tmp_path):
    # issue 34 item 1: "events: 0" after the preflight changed the run; an event log that was never
    # written (its folder cannot be made: a file is in the way) was still named
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    g = _guard(budget_bytes=2**20, log_dir=str(blocker / "logs"))
    g.start(rows=8, read_specs=lambda: specs, enable_checkpointing=lambda: None)
    s = g.finish(0)
    assert s["events"] == len(g.events) + 1 and s["event_log"] is None
    g = _guard(budget_bytes=2**20, log_dir=str(tmp_path / "logs"))
    g.start(rows=8, read_specs=lambda: specs, enable_checkpointing=lambda: None)
    s = g.finish(0)
    assert s["event_log"] is not None and os.path.isfile(s["event_log"])
    assert sum('"kind":"preflight"' in line for line in open(s["event_log"])) == 1


def test_nothing_fits_with_fail_fast_raises(specs):
    g = _guard(budget_bytes=2**20, fail_fast=True)
    with pytest.raises(DoesNotFitError):
        g.start(rows=8, read_specs=lambda: specs)
    assert g.monitor is None


def test_nothing_fits_only_takes_the_allowed_steps(specs):
    g = _guard(budget_bytes=2**20, apply=("grad_checkpoint",))
    mon = g.start(rows=8, read_specs=lambda: specs, enable_checkpointing=lambda: None)
    g.stop()
    assert mon.micro_batches == 1


@pytest.mark.parametrize("exc", [ConfigError("model", "a readable model"), RuntimeError("broken")])
def test_a_preflight_that_cannot_read_the_run_is_skipped(exc, caplog):
    def read():
        raise exc

    g = _guard(budget_bytes=GiB)
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        mon = g.start(rows=4, read_specs=read)
    g.stop()
    assert g.preflight is None and mon is not None and mon.micro_batches == 1 and "preflight" in caplog.text


def test_a_preflight_config_error_is_raised_with_fail_fast():
    def read():
        raise ConfigError("model", "a readable model")

    with pytest.raises(ConfigError):
        _guard(budget_bytes=GiB, fail_fast=True).start(rows=4, read_specs=read)


def test_micro_batches_never_exceed_the_rows_and_the_default_budget_is_read():
    g = _guard(micro_batches=16, preflight=False)
    mon = g.start(rows=4)
    g.stop()
    assert mon.micro_batches == 4 and mon.max_micro_batches == 4 and g.budget_bytes > 0


def test_after_oom_doubles_counts_and_gives_up_on_one_row():
    g = _guard(budget_bytes=GiB, preflight=False)
    g.start(rows=8)
    freed = []
    assert g.after_oom(MemoryError("x"), 1, 8, 3, free=lambda: freed.append(1)) == 2
    assert g.monitor.micro_batches == 2 and g.oom_retries == 1 and freed == [1]
    exc = MemoryError("one row")
    with pytest.raises(MemoryError):
        g.after_oom(exc, 1, 1, 3)
    g.stop()


def test_summary_keys_and_no_calibration_record_after_an_oom_retry(specs, monkeypatch):
    recorded = []
    import memguard_core.calibration as cal

    monkeypatch.setattr(cal, "record_preflight", lambda *a, **k: recorded.append(a))
    g = _guard(budget_bytes=64 * GiB)
    g.start(rows=8, read_specs=lambda: specs)
    g.samples_per_step += [8, 8]
    s = g.finish(2, extra_key=1)
    assert set(s) == SUMMARY_KEYS | {"extra_key"} and s["optimizer_steps"] == 2 and s["samples_per_step"] == [8]
    assert len(recorded) == 1
    # one name per figure: the MLX adapter's names before issue 32 are not keys
    assert not {"optimizer_updates", "alloc_retries", "split"} & set(s)
    g2 = _guard(budget_bytes=64 * GiB)
    g2.start(rows=8, read_specs=lambda: specs)
    g2.after_oom(MemoryError("x"), 1, 8, 1)
    g2.finish(1)
    assert len(recorded) == 1  # a peak measured into an OOM is not the settings' peak


def test_finish_without_a_start_is_none():
    assert _guard(budget_bytes=GiB).finish(0) is None


def test_micro_batches_is_the_one_name():
    # "split", the name before issue 32, is an unknown option: the error lists micro_batches
    with pytest.raises(ConfigError) as e:
        option_kwargs({"split": 4})
    assert e.value.field == "split" and "micro_batches" in str(e.value)
    assert GuardOptions.from_kwargs(micro_batches=4).micro_batches == 4
    with pytest.raises(ConfigError) as e:
        GuardOptions.from_kwargs(micro_batches=0)
    assert e.value.field == "micro_batches"


def test_micro_batches_from_the_environment():
    assert micro_batches_from_env({"MEMGUARD_MICRO_BATCHES": "4", "MEMGUARD_SPLIT": "2"}) == 4
    assert micro_batches_from_env({"MEMGUARD_SPLIT": "2"}) is None   # the name before issue 32: not read
    with pytest.raises(ConfigError) as e:
        micro_batches_from_env({"MEMGUARD_MICRO_BATCHES": "0"})
    assert e.value.field == "MEMGUARD_MICRO_BATCHES"
    assert micro_batches_from_env({}) is None


def test_the_adapters_read_the_guards_state_under_one_name_each():
    from memguard_core.guard import GuardAttributes
    from memguard_hf import MemGuardCallback as HfCallback
    from memguard_lightning import MemGuardCallback as LightningCallback

    names = ("monitor", "preflight", "events", "micro_batch_rows", "samples_per_step", "oom_retries")
    for cls in (HfCallback, LightningCallback):
        assert issubclass(cls, GuardAttributes)
        assert not any(hasattr(cls, old) for old in ("forward_rows", "chunk_rows", "alloc_retries", "updates"))
    cb = HfCallback(budget_bytes=GiB, preflight=False)
    assert [getattr(cb, n) == getattr(cb.guard, n) for n in names] == [True] * len(names)


def test_version_outside_the_checked_range_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(versions, "installed_version", lambda dist: "9.1.0")
    monkeypatch.setattr(versions, "_warned", set())
    log = logging.getLogger("memguard.test")
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        assert not versions.warn_outside("somepkg", ("1.2", "1.4"), ["Thing._private"], log)
        assert not versions.warn_outside("somepkg", ("1.2", "1.4"), ["Thing._private"], log)
    assert caplog.text.count("Thing._private") == 1
    assert versions.in_range("1.4.7", ("1.2", "1.4")) and not versions.in_range("1.10", ("1.2", "1.4"))
    monkeypatch.setattr(versions, "installed_version", lambda dist: "1.3.0")
    assert versions.warn_outside("otherpkg", ("1.2", "1.4"), ["x"], log)


def test_the_core_and_the_guard_import_no_framework():
    code = ("import sys, memguard_core, memguard_core.guard, memguard_core.options, memguard_core.supervisor; "
            "bad = [m for m in ('torch', 'transformers', 'mlx', 'lightning') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trainspec_world_size_is_the_one_name():
    ts = TrainSpec(batch_size=2, grad_accum=3, world_size=4)
    assert ts.effective_batch == 24 and ts.replace(batch_size=1).world_size == 4
    assert not hasattr(ts, "ranks")   # the name before issue 32
    with pytest.raises(TypeError):
        TrainSpec(ranks=4)


def test_budget_as_float_bytes_or_gib_and_record_options(tmp_path):
    """``budget_bytes`` takes an int or a float of bytes (``8.5e9``), ``budget_gib`` GiB; non-finite
    or non-positive values and both at once are errors naming the field; folders for the records
    must not be files."""
    from memguard_core.options import GuardOptions

    assert GuardOptions.from_kwargs(budget_bytes=8.5e9).budget_bytes == 8_500_000_000
    assert GuardOptions.from_kwargs(budget_gib=1.5).budget_bytes == 3 * 2**29
    for bad in (float("nan"), float("inf"), 0, -1.0, "8GB", True):
        with pytest.raises(ConfigError, match="budget_bytes"):
            GuardOptions.from_kwargs(budget_bytes=bad)
    with pytest.raises(ConfigError, match="budget_gib"):
        GuardOptions.from_kwargs(budget_gib=float("nan"))
    with pytest.raises(ConfigError, match="budget_gib"):
        GuardOptions.from_kwargs(budget_gib=1, budget_bytes=2**30)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="log_dir"):
        GuardOptions.from_kwargs(log_dir=str(f))
    with pytest.raises(ConfigError, match="snapshot_steps"):
        GuardOptions.from_kwargs(snapshot_steps=(0,))
    o = GuardOptions.from_kwargs(log_dir=tmp_path / "logs", cuda_snapshots=str(tmp_path / "snaps"), snapshot_steps=3)
    assert o.log_dir == str(tmp_path / "logs") and o.snapshot_steps == (3,)


def test_summary_requested_and_planned_peaks_compare():
    """Both summary peaks include what the process already held at train start beyond the
    estimate (here 768 MiB of written bytes this process holds on the cpu counter), so a plan that
    changes nothing reports the same figure twice rather than a planned peak above the requested one."""
    ms = model_spec_from_hf_config(SMOL)
    ts = TrainSpec(batch_size=2, seq_length=64, method="lora", framework="hf", device="cpu")
    held = b"\x01" * (768 * 2**20)  # resident: every page written
    g = _guard(budget_bytes=64 * GiB)
    g.start(rows=2, read_specs=lambda: (ms, ts))
    del held
    pf = g.preflight
    s = g.finish(0)
    assert pf.resident_extra_bytes > 0 and pf.micro_batches == 1    # the premise
    assert s["requested_peak_bytes"] == s["estimated_peak_bytes"] == pf.best_peak_bytes


def test_the_preflight_estimates_the_run_with_or_without_the_heap_trim():
    # the guard trims glibc's heap at every step's end by default (GuardOptions.trim_heap): its
    # preflight estimates that run; with the option off, the plain run's (a checkpointed full
    # fine-tune then keeps the last step's gradient holes: a larger CPU estimate)
    ms = model_spec_from_hf_config(SMOL)
    ts = TrainSpec(batch_size=1, seq_length=16, method="full", dtype="fp32", grad_checkpoint=True, device="cpu")
    peaks = {}
    for trim in (True, False):
        g = _guard(budget_bytes=64 * GiB, trim_heap=trim)
        pf = g.plan(lambda: (ms, ts))
        assert pf.train_spec.heap_trim is trim
        peaks[trim] = pf.estimate.peak_bytes
    assert peaks[False] > peaks[True]


def test_the_max_usage_figure_is_never_below_this_steps_usage(specs):
    # issue 34 item 1: memguard_max_usage was lower than memguard_usage in the same log line (the
    # monitor's maximum moves at the next decision, one step later)
    g = _guard(budget_bytes=4 * GiB, preflight=False)
    g.start(rows=8)
    try:
        g.micro_batches_for_step(0)
        junk = bytearray(64 * 2**20)   # a real peak in this step
        g.end_step(1)
        del junk
        f = g.figures
        assert f["memguard_usage"] > 0 and f["memguard_max_usage"] >= f["memguard_usage"]
        assert g.finish(1)["max_usage"] >= f["memguard_usage"]
    finally:
        g.stop()


def test_one_runs_figures_derive_from_one_budget_and_one_estimate(caplog):
    """Issue 34 item 1: the preflight's lines, the plan's reason, the decision line and the summary
    of one run quote one budget (the one set) and one estimate per settings (requested, planned;
    both with what the process already holds), and the planning target as 85 % of that budget."""
    import re

    ms = model_spec_from_hf_config(SMOL)
    ts = TrainSpec(batch_size=8, seq_length=256, method="lora", framework="hf", device="cpu")
    held = b"\x01" * (256 * 2**20)   # resident beyond the estimate: every page written
    probe = _guard(budget_bytes=64 * GiB)
    probe.start(rows=8, read_specs=lambda: (ms, ts))
    probe.stop()
    pf0 = probe.preflight
    # a budget the requested settings miss at the planning target but half the micro-batch fits
    budget = int((pf0.requested_peak_bytes + pf0.best_peak_bytes) / 2 / 0.85 * 0.9)
    g = _guard(budget_bytes=budget, log_dir=None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memguard.test"):
        g.start(rows=8, read_specs=lambda: (ms, ts))
    del held
    pf = g.preflight
    s = g.finish(0)
    assert pf.micro_batches > 1   # the premise: the preflight changed the run
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    text = caplog.text
    budgets = set(re.findall(r"budget ([0-9.]+ GiB)", text)) | set(re.findall(r"of the ([0-9.]+ GiB) budget", text))
    assert budgets == {gib(budget)}, budgets
    assert f"estimate {gib(s['requested_peak_bytes'])} -> {gib(s['estimated_peak_bytes'])}, budget {gib(budget)}" in text
    # the plan's reason: the planned peak (held memory included) against 85 % of the budget
    assert re.search(re.escape(f"estimated peak {gib(pf.best_peak_bytes)}") + r"( \([0-9.]+ GiB of it already held\))? <= "
                     + re.escape(f"{gib(int(budget * 0.85))}, 85% of the {gib(budget)} budget"), text), text
    assert f"85% of the {gib(budget)} budget" in text
    assert s["requested_peak_bytes"] == pf.requested_peak_bytes and s["estimated_peak_bytes"] == pf.best_peak_bytes
    # the plan table the demos print: the same peaks, the target as a share of the same budget
    from rich.console import Console

    from memguard_core.report import plan_table

    con = Console(width=250, record=True)
    con.print(plan_table(pf.plan, pf))
    table = con.export_text()
    assert gib(pf.requested_peak_bytes) in table and gib(pf.best_peak_bytes) in table
    assert f"85% of the {gib(budget)} budget" in table and set(re.findall(r"([0-9.]+ GiB) budget", table)) == {gib(budget)}
