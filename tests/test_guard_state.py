"""The guard state a resumed run takes back (memguard_core.guard_state, Guard.export_state /
restore_state; docs/lifecycle.md, "What a resume restores"): the saved dict round-trips through
JSON, a bad file is logged and ignored, and a start with a restored state does not plan again."""

from __future__ import annotations

import json
import logging
import os

import pytest

from memguard_core.estimator.specs import TrainSpec
from memguard_core.guard import Guard
from memguard_core.guard_state import (FILE_NAME, FORMAT, VERSION, GuardState, StateError, parse_state,
                                       parse_state_json, read_state, write_state)
from memguard_core.options import GuardOptions
from memguard_hf.model_spec import model_spec_from_hf_config

SMOL = os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")
GiB = 2**30
LOG = logging.getLogger("memguard.test")


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("MEMGUARD_MICRO_BATCHES", raising=False)
    monkeypatch.setenv("MEMGUARD_CALIBRATION", "0")


@pytest.fixture(scope="module")
def specs():
    # the MLX counter: no resident-memory term from this (large) pytest process
    return (model_spec_from_hf_config(SMOL),
            TrainSpec(batch_size=8, seq_length=128, method="lora", framework="mlx", device="mlx"))


@pytest.fixture(scope="module")
def split_budget(specs):
    """A budget the planner meets with micro-batches (no checkpointing allowed): k > 1."""
    from memguard_core.estimator.estimate import estimate

    ms, ts = specs
    peak8 = estimate(ms, ts).peak_bytes
    peak2 = estimate(ms, ts.replace(batch_size=2, grad_accum=4)).peak_bytes
    return int((peak8 + peak2) / 2 / 0.85)


def _guard(**kw) -> Guard:
    kw.setdefault("monitor_interval_s", 0)
    kw.setdefault("device", "cpu")
    return Guard(GuardOptions.from_kwargs(**kw), log=LOG)


class Reader:
    """``read_specs`` that counts its calls (the run's reading, not the thing under test)."""

    def __init__(self, specs):
        self.specs, self.calls = specs, 0

    def __call__(self):
        self.calls += 1
        return self.specs


def _state(**kw) -> GuardState:
    base = dict(rows=8, micro_batches=4, planned_micro_batches=2, budget_bytes=3 * GiB, budget_set=False,
                eval_micro_batches=2, checkpointing=True, preflight="preflight changed the run: x",
                planned_peak_bytes=2 * GiB, correction=1.05, calibration_runs=3,
                peak_at_micro_batches={2: 2 * GiB, 4: GiB}, step=6, framework="hf")
    base.update(kw)
    return GuardState(**base)


# ------------------------------------------------------------------------------------------ the dict

def test_the_state_round_trips_through_json():
    st = _state(saved_at=12.5)
    d = json.loads(json.dumps(st.to_dict()))
    assert d["format"] == FORMAT and d["version"] == VERSION and d["peak_at_micro_batches"] == {"2": 2 * GiB, "4": GiB}
    assert GuardState.from_dict(d) == st


@pytest.mark.parametrize("change, why", [
    ({"format": "lightning"}, "not a memguard guard state"),
    ({"version": VERSION + 1}, f"version {VERSION + 1}"),
    ({"micro_batches": 0}, "micro_batches"),
    ({"micro_batches": True}, "micro_batches"),
    ({"budget_bytes": "3G"}, "budget_bytes"),
    ({"rows": None}, "rows"),
    ({"checkpointing": "yes"}, "checkpointing"),
    ({"eval_micro_batches": 1.5}, "eval_micro_batches"),
    ({"peak_at_micro_batches": {"two": 5}}, "peak_at_micro_batches"),
    ({"peak_at_micro_batches": {"0": 5}}, "peak_at_micro_batches"),
    ({"correction": float("nan")}, "correction"),
    ({"preflight": 3}, "preflight"),
])
def test_a_bad_dict_names_why(change, why):
    d = {**_state().to_dict(), **change}
    with pytest.raises(StateError, match=why):
        GuardState.from_dict(d)


def test_parse_state_logs_and_ignores_never_raises(caplog):
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        assert parse_state({**_state().to_dict(), "version": 99}, "SRC", LOG) is None
        assert parse_state(["not", "a", "dict"], "SRC2", LOG) is None
    assert "SRC" in caplog.text and "version 99" in caplog.text and "SRC2" in caplog.text
    caplog.clear()
    assert parse_state({}, "EMPTY", LOG) is None and "EMPTY" not in caplog.text   # saved before the start


# ------------------------------------------------------------------------------------------ the file

def test_write_then_read(tmp_path):
    path = str(tmp_path / FILE_NAME)
    assert write_state(path, _state(), LOG)
    back = read_state(path, LOG)
    assert back is not None and back.micro_batches == 4 and back.saved_at > 0   # the save's time is stamped
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]   # no temporary file left


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b'{"format": "other"}', b"[1, 2]"])
def test_a_corrupt_or_foreign_file_is_logged_and_ignored(tmp_path, caplog, content):
    path = tmp_path / FILE_NAME
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        assert read_state(str(path), LOG) is None
    assert str(path) in caplog.text and "decides again" in caplog.text


def test_a_missing_file_is_said_at_info(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="memguard.test"):
        assert read_state(str(tmp_path / FILE_NAME), LOG) is None
    assert caplog.records and all(r.levelno == logging.INFO for r in caplog.records)


def test_a_write_that_fails_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        assert write_state(str(blocker / FILE_NAME), _state(), LOG) is False
    assert "could not save the guard state" in caplog.text


def test_json_text_that_is_not_json_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        assert parse_state_json("{cut sho", "META", LOG) is None
    assert "META" in caplog.text and "JSONDecodeError" in caplog.text
    assert parse_state_json(json.dumps(_state().to_dict()).encode(), "META", LOG) == _state()


# ------------------------------------------------------------------------------------------ the guard

def test_export_before_the_start_is_none():
    assert _guard(budget_bytes=GiB).export_state(step=0) is None


def test_a_resumed_start_restores_the_plan_without_planning_again(specs, split_budget, tmp_path, caplog):
    first = _guard(budget_bytes=split_budget)
    mon = first.start(rows=8, read_specs=Reader(specs))
    planned = mon.micro_batches
    assert first.preflight is not None and planned > 1
    mon.request_micro_batches(planned * 2, "pressure at step 3", 3)   # the runtime split once more
    mon.peak_at_micro_batches.update({planned: 5 * 10**8, planned * 2: 4 * 10**8})
    saved = first.export_state(step=3, eval_micro_batches=2, framework="test")
    first.stop()
    assert saved.micro_batches == planned * 2 and saved.planned_micro_batches == planned and saved.budget_set
    assert saved.preflight.startswith("preflight changed the run")
    path = str(tmp_path / FILE_NAME)
    assert write_state(path, saved, LOG)

    second = _guard(budget_bytes=split_budget, log_dir=str(tmp_path / "logs"))
    assert second.restore_state(json.load(open(path)), path, step=3) is not None
    reader = Reader(specs)
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        mon2 = second.start(rows=8, read_specs=reader)
    try:
        assert second.preflight is None and second.restored is not None and second.restored_from == path
        assert mon2.micro_batches == planned * 2 and mon2.planned_micro_batches == planned
        assert mon2.peak_at_micro_batches == {planned: 5 * 10**8, planned * 2: 4 * 10**8}
        assert reader.calls <= 1   # read for the heap's settings only: no estimate, no plan
        lines = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
        assert len(lines) == 1 and path in lines[0] and "the preflight does not decide again" in lines[0]
        assert f"{planned * 2} micro-batches per batch" in lines[0] and "evaluation micro-batches 2" in lines[0]
    finally:
        s = second.finish(3)
    recs = [json.loads(line) for line in open(s["event_log"])]
    assert [r["message"] for r in recs if r.get("kind") == "preflight"] == [lines[0][len("memguard: "):]]
    assert s["events"] == len(second.events) + 1
    # a second resume carries the first start's decision on
    again = second.export_state(step=5)
    assert again.preflight == saved.preflight and again.planned_micro_batches == planned


def test_the_budget_learnt_at_the_first_start_comes_back(specs):
    g = _guard()   # no budget option: the default one would be derived from this machine
    g.restore_state(_state(budget_bytes=7 * GiB, checkpointing=False).to_dict(), "SRC")
    mon = g.start(rows=8, read_specs=Reader(specs))
    g.stop()
    assert mon.budget_bytes == g.budget_bytes == 7 * GiB and mon.micro_batches == 4


def test_checkpointing_is_turned_on_again_only_where_allowed(specs):
    on = []
    g = _guard(budget_bytes=3 * GiB)
    g.restore_state(_state(), "SRC")
    g.start(rows=8, read_specs=Reader(specs), enable_checkpointing=lambda: on.append(1))
    assert on == [1] and g.export_state().checkpointing
    g.stop()
    on.clear()
    g = _guard(budget_bytes=3 * GiB, apply=("micro_batch",))
    g.restore_state(_state(), "SRC")
    g.start(rows=8, read_specs=Reader(specs), enable_checkpointing=lambda: on.append(1))
    g.stop()
    assert on == [] and not g.export_state().checkpointing


def test_the_supervisors_larger_micro_batches_win(specs):
    g = _guard(budget_bytes=3 * GiB, micro_batches=8)
    g.restore_state(_state(micro_batches=2), "SRC")
    mon = g.start(rows=8, read_specs=Reader(specs))
    g.stop()
    assert mon.micro_batches == 8 and g.restored is not None


@pytest.mark.parametrize("kw, state_kw, why", [
    ({"budget_bytes": 3 * GiB}, {"rows": 16}, "batches of 16 rows"),
    ({"budget_bytes": 5 * GiB}, {}, "this run sets 5.00 GiB"),
])
def test_a_state_for_another_run_is_not_restored(specs, caplog, kw, state_kw, why):
    g = _guard(**kw)
    g.restore_state(_state(**state_kw), "SRC")
    reader = Reader(specs)
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        g.start(rows=8, read_specs=reader)
    g.stop()
    assert g.restored is None and g.preflight is not None and why in caplog.text


def test_a_state_of_another_step_is_not_taken(caplog):
    g = _guard(budget_bytes=3 * GiB)
    with caplog.at_level(logging.WARNING, logger="memguard.test"):
        assert g.restore_state(_state(step=6).to_dict(), "SRC", step=8) is None
    assert "saved at step 6" in caplog.text


def test_a_restored_state_serves_one_start_only(specs):
    g = _guard(budget_bytes=3 * GiB)
    g.restore_state(_state(), "SRC")
    g.start(rows=8, read_specs=Reader(specs))
    g.stop()
    g.start(rows=8, read_specs=Reader(specs))   # Lightning: a second fit without a checkpoint
    g.stop()
    assert g.restored is None and g.preflight is not None


# ------------------------------------------------------------------------------------------ mlx_lm's file

def test_an_adapter_file_whose_state_is_missing_or_broken_is_passed_over(tmp_path, caplog):
    mx = pytest.importorskip("mlx.core")
    from memguard_core.guard_state import METADATA_KEY
    from memguard_mlx.resume import restore_guard_state, safetensors_metadata

    good = str(tmp_path / "0000006_adapters.safetensors")
    mx.save_safetensors(good, {"a": mx.zeros(2)}, metadata={METADATA_KEY: json.dumps(_state().to_dict())})
    assert json.loads(safetensors_metadata(good)[METADATA_KEY])["micro_batches"] == 4
    g = _guard(budget_bytes=3 * GiB)
    assert restore_guard_state(g, good)   # saved at iteration 6, the file's number
    (tmp_path / "b").mkdir()
    bad_json = str(tmp_path / "b" / "0000006_adapters.safetensors")
    mx.save_safetensors(bad_json, {"a": mx.zeros(2)}, metadata={METADATA_KEY: "{cut"})
    not_st = tmp_path / "0000007_adapters.safetensors"
    not_st.write_bytes(b"\xff" * 4)
    other_step = str(tmp_path / "0000008_adapters.safetensors")
    mx.save_safetensors(other_step, {"a": mx.zeros(2)}, metadata={METADATA_KEY: json.dumps(_state().to_dict())})
    with caplog.at_level(logging.WARNING, logger="memguard.mlx"):
        for path in (bad_json, str(not_st), other_step):
            assert not restore_guard_state(_guard(budget_bytes=3 * GiB), path)
    assert caplog.text.count("not used") == 3 and "JSONDecodeError" in caplog.text and "saved at step 6, the run resumes at step 8" in caplog.text


# ------------------------------------------------------------------------------------------ HF's folder

def test_hf_finds_the_folder_the_trainer_resumes_from(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from memguard_hf.resume import resumed_folder

    monkeypatch.delenv("MEMGUARD_RESUME_FROM", raising=False)
    args, trainer = SimpleNamespace(output_dir=str(tmp_path / "out")), object()
    fresh, resumed = SimpleNamespace(global_step=0), SimpleNamespace(global_step=3)
    assert resumed_folder(trainer, args, fresh) == (None, None)
    assert resumed_folder(trainer, args, resumed) == (str(tmp_path / "out" / "checkpoint-3"), 3)
    env_dir = tmp_path / "elsewhere" / "checkpoint-3"
    env_dir.mkdir(parents=True)
    monkeypatch.setenv("MEMGUARD_RESUME_FROM", str(env_dir))
    assert resumed_folder(trainer, args, resumed) == (str(env_dir), 3)
    assert resumed_folder(trainer, args, fresh) == (str(env_dir), None)   # a script that starts at 0

    class Trainer:   # Trainer.train's frame holds the folder it loads: that one wins
        def train(self, resume_from_checkpoint):
            return resumed_folder(self, args, resumed)

    assert Trainer().train("/ckpts/checkpoint-3") == ("/ckpts/checkpoint-3", 3)
