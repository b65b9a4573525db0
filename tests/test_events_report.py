"""The run event log (JSONL), ``memguard report``'s timeline, the torch leak detector and the CUDA
snapshot trigger."""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from memguard_torch.cuda_snapshots import CudaSnapshots
from memguard_core.errors import ConfigError
from memguard_core.events import EventLog, read_events
from memguard_core.leak import LeakDetector
from memguard_core.timeline import draw_timeline, load_runs, summarize, summary_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_a_killed_run_leaves_every_record_it_wrote(tmp_path):
    """SIGKILL right after the 5th step record: the 5 steps and the decision are in the file."""
    code = f"""
import os, signal
from memguard_core.events import EventLog
log = EventLog({str(tmp_path)!r}, run_id="killed", budget_bytes=4 << 30)
log.decision("split", "micro-batches 1 -> 2", step=2)
for s in range(1, 6):
    log.step(s, peak_bytes=s << 28, current_bytes=s << 27, budget_bytes=4 << 30, micro_batches=2)
os.kill(os.getpid(), signal.SIGKILL)
"""
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL
    recs = read_events(str(tmp_path / "memguard-killed-rank0.jsonl"))
    assert [r["type"] for r in recs] == ["start", "decision"] + ["step"] * 5
    assert recs[-1]["step"] == 5 and recs[-1]["usage"] == pytest.approx(5 / 16)
    assert recs[1]["kind"] == "split" and recs[1]["message"] == "micro-batches 1 -> 2"


def test_records_from_two_threads_stay_whole_lines(tmp_path):
    log = EventLog(str(tmp_path), run_id="threads")

    def write(kind):
        for i in range(300):
            log.decision(kind, "x" * 200, step=i)

    ts = [threading.Thread(target=write, args=(k,)) for k in ("clean", "split")]
    [t.start() for t in ts]
    [t.join() for t in ts]
    log.close(steps=0)
    recs = read_events(log.path)
    assert len(recs) == 1 + 600 + 1 and recs[-1]["type"] == "end"


def test_truncated_last_line_is_skipped_and_a_bad_middle_line_is_an_error(tmp_path):
    path = tmp_path / "memguard-x-rank0.jsonl"
    path.write_text('{"type": "step", "step": 1, "peak_bytes": 5}\n{"type": "st')
    assert len(read_events(str(path))) == 1
    path.write_text('{"type": "step"}\nnot json\n{"type": "step"}\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_events(str(path))


def test_an_unwritable_log_dir_turns_the_log_off_without_raising(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = EventLog(str(blocker), run_id="off")  # a file where the folder should be
    assert not log.enabled
    log.step(1, peak_bytes=1)
    log.decision("clean", "nothing")
    log.close()


def test_from_env_and_run_id_shared_with_children(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMGUARD_LOG_DIR", raising=False)
    monkeypatch.delenv("MEMGUARD_RUN_ID", raising=False)
    assert EventLog.from_env() is None
    monkeypatch.setenv("MEMGUARD_LOG_DIR", str(tmp_path))
    log = EventLog.from_env(rank=1)
    assert os.environ["MEMGUARD_RUN_ID"] == log.run_id
    assert log.path.endswith(f"memguard-{log.run_id}-rank1.jsonl") and os.path.exists(log.path)


def _two_rank_run(tmp_path):
    for rank in (0, 1):
        log = EventLog(str(tmp_path), rank=rank, run_id="two", budget_bytes=3 * GiB)
        log.decision("preflight", "micro-batch 8 -> 4 x accumulation 2", step=0)
        k = 1
        for s in range(1, 11):
            if s == 4 and rank == 1:
                log.decision("split", "micro-batches 1 -> 2 (critical 93 %)", step=s)
                k = 2
            peak = (2.0 + 0.1 * rank + (0.8 if s in (3, 4) and rank == 1 else 0)) * GiB
            log.step(s, peak_bytes=int(peak), current_bytes=int(peak * 0.7), budget_bytes=3 * GiB, micro_batches=k)
        log.close()


def test_timeline_png_and_summary_of_two_ranks(tmp_path):
    _two_rank_run(tmp_path)
    runs = load_runs([str(tmp_path)])
    assert list(runs) == ["two"] and sorted(runs["two"]) == [0, 1]
    s = summarize(runs["two"])
    assert s["steps"] == 20 and s["peak_bytes"] == int(2.9 * GiB) and s["peak_step"] == 3
    assert s["decisions"] == {"preflight": 2, "split": 1}
    text = summary_text(s)
    assert "97% of the 3.00 GiB budget" in text and "step 4: rank 1: split" in text
    assert text.startswith("20 optimizer step records (ranks 0, 1)")
    png = draw_timeline(runs, str(tmp_path / "t.png"))
    with open(png, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_report_cli(tmp_path):
    _two_rank_run(tmp_path)
    f = str(tmp_path / "memguard-two-rank0.jsonl")
    p = subprocess.run([sys.executable, "-m", "memguard_core.cli", "report", f, "--html", str(tmp_path / "r.html")],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "timeline: " + str(tmp_path / "memguard-two-rank0.png") in p.stdout
    assert os.path.getsize(tmp_path / "memguard-two-rank0.png") > 10_000
    assert "data:image/png;base64," in (tmp_path / "r.html").read_text()
    bad = subprocess.run([sys.executable, "-m", "memguard_core.cli", "report", str(tmp_path / "none.jsonl")],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "FILE" in bad.stderr and "Traceback" not in bad.stderr


def test_report_outputs_are_written_where_named_and_checked_first(tmp_path):
    """#34 item 4: a non-UTF-8 log, ``--png`` without the suffix, a folder, an unwritable ``--html``."""
    _two_rank_run(tmp_path)
    f = str(tmp_path / "memguard-two-rank0.jsonl")

    def report(*args):
        return subprocess.run([sys.executable, "-m", "memguard_core.cli", "report", *args], env=_env(),
                              capture_output=True, text=True, timeout=120)

    out = report(f, "--png", str(tmp_path / "picture"))
    assert out.returncode == 0, out.stderr
    assert "timeline: " + str(tmp_path / "picture") in out.stdout
    assert (tmp_path / "picture").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "picture.png").exists()
    folder = report(f, "--png", str(tmp_path))
    assert folder.returncode == 2 and "--png" in folder.stderr and "folder" in folder.stderr
    before = set(os.listdir(tmp_path))
    unwritable = report(f, "--png", str(tmp_path / "p2.png"), "--html", str(tmp_path / "no" / "such" / "r.html"))
    assert unwritable.returncode == 2 and "--html" in unwritable.stderr and "Traceback" not in unwritable.stderr
    assert set(os.listdir(tmp_path)) == before and unwritable.stdout == ""   # nothing written first
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"type": "step", "note": "caf\xe9"}\n')
    bad = report(str(latin))
    assert bad.returncode == 2 and "UTF-8" in bad.stderr and "Traceback" not in bad.stderr


def test_leak_detector_flags_steady_growth_only():
    d = LeakDetector(window=4, min_growth_bytes=1 << 20, warmup=1, what="CPU RSS")
    reports = [d.sample(i, (1 << 30) + i * (1 << 19)) for i in range(7)]
    assert reports[:5] == [None] * 5 and reports[5] is not None
    assert "CPU RSS grew at every step for 4 steps" in reports[5].message
    assert reports[5].per_step_bytes == 1 << 19
    flat = LeakDetector(window=4, min_growth_bytes=1 << 20, warmup=0)
    noise = [0, 3, 1, 4, 2, 5, 3, 6]
    assert all(flat.sample(i, (1 << 30) + v * (1 << 20)) is None for i, v in enumerate(noise))


class _FakeCudaMemory:
    """Thinnest stand-in for ``torch.cuda.memory`` (no GPU here): records the calls the snapshot
    trigger makes and writes a file where torch would write its pickle."""

    def __init__(self, fail_dump=False):
        self.calls = []
        self.retries = 0
        self.fail_dump = fail_dump

    def _record_memory_history(self, enabled="all", max_entries=None, **kw):
        self.calls.append(("record", enabled, max_entries))

    def _dump_snapshot(self, filename):
        if self.fail_dump:
            raise RuntimeError("no CUDA")
        with open(filename, "wb") as fh:
            fh.write(b"snapshot")
        self.calls.append(("dump", os.path.basename(filename)))

    def memory_stats(self):
        return {"num_alloc_retries": self.retries}


def test_cuda_snapshots_at_steps_pressure_retries_and_oom(tmp_path):
    mem = _FakeCudaMemory()
    snap = CudaSnapshots(str(tmp_path), rank=1, max_entries=5000, at_steps=(2,), cuda_memory=mem)
    assert snap.start() and mem.calls == [("record", "all", 5000)]
    snap.step_end(1, "ok")
    snap.step_end(2, "ok")
    snap.step_end(3, "critical")
    snap.step_end(4, "critical")   # the same episode: no second dump
    snap.step_end(5, "ok")
    mem.retries = 3                 # the allocator freed its cache and retried: pressure
    snap.step_end(6, "ok")
    snap.oom(7)
    dumps = [c[1] for c in mem.calls if c[0] == "dump"]
    assert dumps == ["rank1_step2_step.pickle", "rank1_step3_critical.pickle", "rank1_step6_critical.pickle",
                     "rank1_step7_oom.pickle"]
    assert all(os.path.exists(p) for p in snap.written)
    snap.stop()
    assert mem.calls[-1] == ("record", None, None)


def _guard_on_fake_cuda(monkeypatch, tmp_path, order, **options):
    """A ``Guard`` on "cuda:0" with snapshots on. No CUDA device here: ``torch.cuda`` is the thin
    counter fake (``FakeTorchCuda``) whose ``memory`` is :class:`_FakeCudaMemory`; the free path
    (``empty_torch_cache`` -> ``torch.cuda.empty_cache``) and the dump write into ``order``."""
    import types

    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions
    from memguard_core.probes import nvml
    from memguard_testing.fakes import FakeTorchCuda, use_fake_torch
    from memguard_torch import probes_cuda as cuda

    tc = FakeTorchCuda(allocated=20 * GiB, reserved=24 * GiB, peak_alloc=22 * GiB, peak_res=26 * GiB,
                       free=50 * GiB, total=80 * GiB)
    mem = _FakeCudaMemory()
    dump = mem._dump_snapshot
    mem._dump_snapshot = lambda filename: (order.append("dump"), dump(filename))
    tc.memory = mem
    tc.empty_cache = lambda: order.append("empty_cache")
    use_fake_torch(monkeypatch, types.SimpleNamespace(cuda=tc))
    monkeypatch.setattr(cuda, "torch_cuda_module", lambda: tc)
    monkeypatch.setattr(nvml, "nvml_module", lambda nvml=None: None)
    monkeypatch.setenv("RANK", "3")
    g = Guard(GuardOptions.from_kwargs(device="cuda:0", budget_bytes=60 * GiB, monitor_interval_s=0, preflight=False,
                                       cuda_snapshots=str(tmp_path), **options))
    g.start(rows=8)
    return g, mem


def test_a_caught_oom_dumps_one_snapshot_per_rank_before_anything_is_freed(monkeypatch, tmp_path):
    """Forward retry, window redo, a peer's failure, a failure that cannot be split: each dumps
    ``rank{r}_step{n}_...`` first, then the guard frees (``torch.cuda.empty_cache``)."""
    order = []
    g, mem = _guard_on_fake_cuda(monkeypatch, tmp_path, order)
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert g.after_oom(oom, 1, 8, 5) == 2
    assert order == ["dump", "empty_cache"]
    order.clear()
    assert g.after_window_oom(oom, 2, 8, 5, redos=0) == 4
    assert order == ["dump", "empty_cache"]
    order.clear()
    g.after_window_oom(None, 4, 8, 6, redos=0)                 # another rank failed: this one redoes too
    assert order == ["dump", "empty_cache"]
    order.clear()
    with pytest.raises(RuntimeError):                          # one row left: re-raised, still dumped first
        g.after_oom(oom, 1, 1, 7)
    assert order == ["dump"]
    names = [c[1] for c in mem.calls if c[0] == "dump"]
    # named by rank and step (optimizer steps completed); a second OOM of step 5 does not overwrite the first
    assert names == ["rank3_step5_oom.pickle", "rank3_step5_oom-2.pickle", "rank3_step6_peer-oom.pickle",
                     "rank3_step7_oom.pickle"]
    assert sorted(os.listdir(tmp_path)) == sorted(names)
    g.finish(7)
    assert mem.calls[-1] == ("record", None, None)


def test_an_adapter_can_dump_earlier_and_the_guard_does_not_dump_twice(monkeypatch, tmp_path):
    order = []
    g, mem = _guard_on_fake_cuda(monkeypatch, tmp_path, order)
    g.snapshot_oom(2)                    # the adapter's except block, the failed step still referenced
    g.after_oom(RuntimeError("CUDA out of memory"), 1, 8, 2)
    assert order == ["dump", "empty_cache"]
    g.after_oom(RuntimeError("CUDA out of memory"), 2, 8, 2)   # the next failure dumps again
    assert [c[1] for c in mem.calls if c[0] == "dump"] == ["rank3_step2_oom.pickle", "rank3_step2_oom-2.pickle"]
    g.stop()


def test_cuda_snapshot_failures_are_logged_not_raised(tmp_path, caplog):
    snap = CudaSnapshots(str(tmp_path), cuda_memory=_FakeCudaMemory(fail_dump=True))
    snap.start()
    assert snap.oom(3) is None
    assert "not written" in caplog.text
    with pytest.raises(ConfigError, match="snapshot_max_entries"):
        CudaSnapshots(str(tmp_path), max_entries=0)


def test_recorder_writes_one_record_per_optimizer_step_and_flags_a_leak(tmp_path):
    """Batch boundaries with gradient accumulation (two per optimizer step) make one record per
    step with the larger peak of its batches and the k its batches ran with; a process figure
    rising at every step is reported as a ``leak`` decision."""
    import logging

    from memguard_core.observe import RunRecorder
    from memguard_core.options import GuardOptions

    rec = RunRecorder(GuardOptions.from_kwargs(log_dir=str(tmp_path), leak_detector=True), logging.getLogger("t"))
    rec.start("cpu", 8 * GiB)
    rec.leak.window, rec.leak.warmup = 3, 0
    boundaries = [(0, 1, 1), (0, 5, 1)]  # (completed steps, peak GiB/8 of the batch just done, next k)
    for s in range(1, 7):
        boundaries += [(s, 2 + s % 2, 1 if s < 3 else 2), (s, 6, 1 if s < 3 else 2)]
    for i, (s, p, k) in enumerate(boundaries):
        rec.step(s, {"peak": p * GiB // 8, "current": GiB + i * (4 << 20), "budget": 8 * GiB}, k, "ok")
    rec.finish({"optimizer_steps": 6})
    recs = read_events(rec.events.path)
    steps = [r for r in recs if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    # the larger batch of each step: its first batch is sampled at the boundary before
    assert [r["peak_bytes"] for r in steps] == [5 * GiB // 8] + [6 * GiB // 8] * 5
    assert [r["micro_batches"] for r in steps] == [1, 1, 1, 2, 2, 2]  # k asked at step 3 runs in step 4
    leaks = [r for r in recs if r.get("kind") == "leak"]
    assert leaks and "grew at every step" in leaks[0]["message"]


def test_report_keeps_two_runs_in_one_folder_apart(tmp_path):
    """Two runs (different budgets) logged to one folder: grouped by run id, a summary per run,
    one series per run in the picture; --run picks one; too many runs is an error naming them."""
    from memguard_core.timeline import MAX_RUNS_DRAWN, report_text

    for run, budget, clock in (("20260101-000000-aaaaaa", 8 * GiB, 100.0), ("20260101-000100-bbbbbb", GiB, 200.0)):
        log = EventLog(str(tmp_path), run_id=run, budget_bytes=budget, clock=lambda c=clock: c)
        for s in range(1, 5):
            log.step(s, peak_bytes=budget // 2 + s, current_bytes=budget // 4, budget_bytes=budget,
                     micro_batches=1 if budget > GiB else 4)
        log.close()
    runs = load_runs([str(tmp_path)])
    assert list(runs) == ["20260101-000000-aaaaaa", "20260101-000100-bbbbbb"]
    assert all(sorted(r) == [0] for r in runs.values())
    assert [summarize(r)["steps"] for r in runs.values()] == [4, 4]
    assert [summarize(r)["budget_bytes"] for r in runs.values()] == [8 * GiB, GiB]
    text = report_text(runs)
    assert text.count("4 optimizer step records (rank 0)") == 2 and "ranks 0;" not in text
    assert "run 20260101-000000-aaaaaa\n" in text and "run 20260101-000100-bbbbbb\n" in text
    png = draw_timeline(runs, str(tmp_path / "two.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert list(load_runs([str(tmp_path)], ["20260101-0001"])) == ["20260101-000100-bbbbbb"]
    with pytest.raises(ConfigError, match="aaaaaa, 20260101-000100-bbbbbb"):
        load_runs([str(tmp_path)], ["20260101"])    # a prefix of both
    for i in range(MAX_RUNS_DRAWN):
        EventLog(str(tmp_path), run_id=f"extra{i}").step(1, peak_bytes=1)
    with pytest.raises(ConfigError, match="extra0"):
        draw_timeline(load_runs([str(tmp_path)]), str(tmp_path / "many.png"))
    p = subprocess.run([sys.executable, "-m", "memguard_core.cli", "report", str(tmp_path), "--run", "20260101-0000",
                        "--png", str(tmp_path / "one.png")], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "run 20260101-000000-aaaaaa" in p.stdout and "bbbbbb" not in p.stdout


def test_guard_end_step_closes_the_step_before_the_log_and_samples_once(tmp_path):
    """``Guard.end_step`` right after an optimizer step writes that step's record (the figures an
    adapter logs next) without deciding; every batch boundary decides once, on a fresh sample, and
    writes no second record of a step ``end_step`` closed."""
    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions

    g = Guard(GuardOptions.from_kwargs(preflight=False, budget_bytes=8 * GiB, monitor_interval_s=0,
                                       log_dir=str(tmp_path)))
    g.start(rows=4)
    samples = []
    real = g.monitor.step_sample
    g.monitor.step_sample = lambda step=None: samples.append(step) or real(step)
    g.micro_batches_for_step(0)
    assert g.figures == {}
    g.end_step(1)
    assert g.figures["memguard_peak_gib"] > 0 and g.recorder.closed_step == 1
    g.end_step(1)                      # again (Lightning after a batch inside a window): nothing
    g.micro_batches_for_step(1)        # the boundary after it: its decision, no second record
    g.end_step(2)
    g.finish(2)
    assert samples == [0, 1]           # one decision per batch boundary, none in end_step
    steps = [r["step"] for r in read_events(g.recorder.events.path) if r["type"] == "step"]
    assert steps == [1, 2]


def test_a_split_at_the_boundary_after_end_step_is_the_next_records_k(tmp_path):
    """The k decided at a batch boundary whose step ``end_step`` already recorded is the k the
    next step's record says it ran with (not the step before's)."""
    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions

    g = Guard(GuardOptions.from_kwargs(preflight=False, budget_bytes=8 * GiB, monitor_interval_s=0,
                                       log_dir=str(tmp_path)))
    g.start(rows=4)
    g.micro_batches_for_step(0)
    g.end_step(1)
    g.monitor.request_micro_batches(4, "a test's request", 1)   # what a decision at the next boundary does
    assert g.micro_batches_for_step(1) == 4
    g.end_step(2)
    g.finish(2)
    ks = {r["step"]: r["micro_batches"] for r in read_events(g.recorder.events.path) if r["type"] == "step"}
    assert ks == {1: 1, 2: 4}
