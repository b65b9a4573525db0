"""Calibration store: real SQLite files in a temp dir (MEMGUARD_DATA_DIR), real concurrent
processes, a corrupt file, and the correction reaching the preflight only after 3 runs."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sqlite3

import pytest

from memguard_core import calibration as cal
from memguard_core.estimator.estimate import estimate
from memguard_core.preflight import plan_in_place
from memguard_core.estimator.numbers import model_spec_from_numbers
from memguard_core.estimator.specs import TrainSpec


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMGUARD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("MEMGUARD_CALIBRATION", raising=False)
    return tmp_path / "data"


def _ms(layers=4):
    return model_spec_from_numbers(model_params=50_000_000, hidden_dim=512, num_layers=layers, num_heads=8,
                                   vocab_size=32000, intermediate_size=1376, model_bits=32)


def _ts(**kw):
    base = dict(batch_size=2, seq_length=128, method="lora", dtype="fp32", device="cpu")
    base.update(kw)
    return TrainSpec(**base)


def test_data_dir_from_env(store):
    assert cal.db_path() == os.path.join(str(store), "calibration.sqlite3")
    assert os.path.isdir(store)


def test_fingerprints_separate_what_they_should():
    d = cal.device_fingerprint("cpu")
    assert d["id"] == cal.device_fingerprint("cpu")["id"]
    assert d["id"] != cal.device_fingerprint("mlx")["id"]          # another counter
    assert d["cores"] == os.cpu_count()
    assert cal.model_fingerprint(_ms()) == cal.model_fingerprint(_ms())
    assert cal.model_fingerprint(_ms()) != cal.model_fingerprint(_ms(layers=5))
    # batch / sequence may differ within a comparable group; method / optimizer may not
    assert cal.settings_key(_ts()) == cal.settings_key(_ts(batch_size=8, seq_length=512))
    assert cal.settings_key(_ts()) != cal.settings_key(_ts(optimizer="sgd"))
    assert cal.settings_key(_ts()) != cal.settings_key(_ts(method="full"))


def test_correction_applies_after_three_runs_not_before():
    ms, ts = _ms(), _ts()
    raw = estimate(ms, ts).peak_bytes
    for i, ratio in enumerate((1.10, 1.20, 1.15)):
        c = cal.correction_for(ms, ts)
        assert c.factor == 1.0 and c.runs == i                        # not before 3 runs
        assert cal.record(ms, ts, raw, int(raw * ratio))
    c = cal.correction_for(ms, ts)
    assert c.runs == 3 and c.factor == pytest.approx(1.15, rel=1e-6)  # median
    # other settings or another model: no correction
    assert cal.correction_for(ms, _ts(optimizer="sgd")).factor == 1.0
    assert cal.correction_for(_ms(layers=5), ts).factor == 1.0
    # the preflight applies it and says so
    pf = plan_in_place(ms, ts, 10 * 2**30)
    assert pf.correction == pytest.approx(1.15) and pf.calibration_runs == 3
    assert pf.estimate.peak_bytes == pytest.approx(raw * 1.15, rel=1e-6)
    assert pf.estimate.breakdown["calibration"] > 0
    assert any("calibration: x1.150" in ln for ln in pf.report_lines())
    # an explicit correction wins over the store
    assert plan_in_place(ms, ts, 10 * 2**30, correction=1.0).estimate.peak_bytes == raw


def test_record_preflight_stores_the_uncorrected_planned_estimate():
    ms, ts = _ms(), _ts()
    pf = plan_in_place(ms, ts, 10 * 2**30, correction=2.0)
    raw = pf.plan.estimate.phases[pf.plan.estimate.phase]
    assert cal.record_preflight(pf, raw)
    rows = cal.show()
    assert len(rows) == 1 and rows[0]["runs"] == 1 and rows[0]["median_ratio"] == pytest.approx(1.0)
    assert not cal.record_preflight(None, 123) and not cal.record_preflight(pf, 0)


def test_show_and_reset():
    ms, ts = _ms(), _ts()
    for _ in range(3):
        cal.record(ms, ts, 1000, 1100)
    cal.record(ms, _ts(optimizer="sgd"), 1000, 900)
    rows = {r["settings"]["optimizer"]: r for r in cal.show()}
    assert rows["adamw"]["runs"] == 3 and rows["adamw"]["applies"]
    assert rows["sgd"]["runs"] == 1 and not rows["sgd"]["applies"]
    assert cal.reset() == 4
    assert cal.show() == [] and cal.correction_for(ms, ts).factor == 1.0


def test_the_store_tells_models_apart_and_says_once_where_it_writes(caplog, capsys, monkeypatch):
    # issue 34: two models of one name were rows a user could not tell apart, and a guarded run wrote
    # to the user's data directory without a word
    small, big = _ms(layers=4), _ms(layers=8)
    with caplog.at_level(logging.INFO, logger="memguard.calibration"):
        cal.record(small, _ts(), 1000, 1100)
        cal.record(big, _ts(), 1000, 1100)
    said = [r.getMessage() for r in caplog.records if "recording estimated vs measured peaks" in r.getMessage()]
    assert len(said) == 1 and cal.db_path(create=False) in said[0]
    rows = sorted(cal.show(), key=lambda r: r["layers"])
    assert [r["layers"] for r in rows] == [4, 8] and rows[0]["params"] == int(small.total_params)
    monkeypatch.setenv("COLUMNS", "200")   # one table row per line
    assert cal.main(["show"]) == 0
    out = capsys.readouterr().out
    assert "4 layers" in out and "8 layers" in out


def _writer(data_dir, n, q):
    os.environ["MEMGUARD_DATA_DIR"] = data_dir
    ok = 0
    for i in range(n):
        ok += bool(cal.record(_ms(), _ts(), 1000, 1000 + i))
    q.put(ok)


def test_concurrent_writers_lose_nothing(store):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(store), 25, q)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sum(q.get(timeout=5) for _ in procs) == 100
    con = sqlite3.connect(cal.db_path())
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 100
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _killed_mid_write(data_dir):
    os.environ["MEMGUARD_DATA_DIR"] = data_dir
    cal.record(_ms(), _ts(), 1000, 1200)
    con = sqlite3.connect(cal.db_path(), isolation_level=None)
    con.execute("BEGIN IMMEDIATE")
    con.execute("INSERT INTO runs (created, device_fp, model_fp, settings, counter, estimated_bytes, "
                "measured_bytes, ratio) VALUES (0, 'x', 'x', 'x', 'cpu', 1, 1, 1)")
    os._exit(9)  # killed inside an open transaction


def test_killed_writer_leaves_committed_state(store):
    p = mp.get_context("spawn").Process(target=_killed_mid_write, args=(str(store),))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    rows = cal.show()
    assert len(rows) == 1 and rows[0]["runs"] == 1                   # the open transaction is gone
    assert cal.record(_ms(), _ts(), 1000, 1100)                      # and the store still writes


def test_corrupt_file_is_recreated_with_a_warning(store, caplog):
    store.mkdir(parents=True, exist_ok=True)
    with open(cal.db_path(), "wb") as f:
        f.write(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING, logger="memguard.calibration"):
        assert cal.record(_ms(), _ts(), 1000, 1100)
    assert "not a valid database" in caplog.text
    assert any(n.startswith("calibration.sqlite3.corrupt-") for n in os.listdir(store))
    assert cal.show()[0]["runs"] == 1


def test_unwritable_store_never_raises(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("MEMGUARD_DATA_DIR", str(blocker / "sub"))   # a dir under a file: cannot exist
    with caplog.at_level(logging.WARNING, logger="memguard.calibration"):
        assert cal.record(_ms(), _ts(), 1000, 1100) is False
        assert cal.correction_for(_ms(), _ts()).factor == 1.0
        assert cal.show() == [] and cal.reset() == 0
    assert "memguard calibration" in caplog.text
    pf = plan_in_place(_ms(), _ts(), 10 * 2**30)                   # preflight still works
    assert pf.correction == 1.0


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("MEMGUARD_CALIBRATION", "0")
    assert cal.record(_ms(), _ts(), 1000, 1100) is False
    assert not os.path.exists(cal.db_path())
