"""A Metal allocation failure in a real mlx_lm LoRA run on MLX's CPU backend: the window redo.

What is faked, and only this: MLX raises an allocation failure on Metal only (its Linux CPU backend
dies with SIGSEGV on a failed malloc, which no test can catch), so the test wraps the single boundary
where the guarded loop evaluates a micro-batch's loss and gradient (``memguard_mlx.trainer.
_eval_gradient``, an ``mx.eval``; likewise the validation and the optimizer-update boundaries) and
raises Metal's own message there, before evaluating: once at a chosen micro-batch of a chosen
iteration, or at every evaluation of one iteration for the one-row floor. Everything else -- the
model, the data, ``iterate_batches``, the compiled steps, the optimizer, the adapter saves -- is real
mlx / mlx_lm on the CPU backend.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.tuner.trainer import iterate_batches  # noqa: E402

import memguard_mlx.trainer as tr  # noqa: E402
from memguard_core.errors import WindowOOMError  # noqa: E402
from memguard_mlx import MlxGuard  # noqa: E402

from memguard_testing.mlx_tiny import assert_same_run, run_tiny  # noqa: E402

#: Metal's allocator, a buffer above the device's maximum (mlx/backend/metal/allocator.cpp; as quoted
#: in public reports of mlx runs, e.g. "[metal::malloc] Attempting to allocate 13902151680 bytes ...").
METAL_OOM = ("[metal::malloc] Attempting to allocate 13902151680 bytes which is greater than the maximum "
             "allowed buffer size of 8589934592 bytes.")


def _metal_oom_at(monkeypatch, guard: MlxGuard, *, iteration: int, chunk: int, times: int = 1):
    """Make the ``chunk``-th (1-based) gradient evaluation of ``iteration`` raise Metal's allocation
    error, ``times`` attempts in a row (every evaluation of that iteration with ``times=None``).
    Returns the log of evaluations: ``(iteration, rows, raised)``."""
    real = tr._eval_gradient
    log, seen = [], {}

    def eval_or_metal_oom(rows, *arrays):
        it = guard._it
        seen[it] = seen.get(it, 0) + 1
        failures = sum(1 for i, _, r in log if i == it and r)
        if it == iteration and (times is None or failures < times) and (times is None or seen[it] == chunk):
            log.append((it, rows, True))
            seen[it] = 0  # the batch is redone from its first micro-batch
            raise RuntimeError(METAL_OOM)
        log.append((it, rows, False))
        return real(rows, *arrays)

    monkeypatch.setattr(tr, "_eval_gradient", eval_or_metal_oom)
    return log


def _decisions(log_dir):
    """The decision records of the run's JSONL event log(s) in ``log_dir`` (docs/events.md)."""
    import glob
    import json

    out = []
    for path in sorted(glob.glob(str(log_dir / "*.jsonl"))):
        with open(path) as f:
            out += [r for r in map(json.loads, f) if r.get("type") == "decision" and r.get("kind") != "preflight"]
    return out


def _counting_batches(draws: list):
    """mlx_lm's own iterate_batches; counts the training batches drawn (``loop=True``; validation
    draws its own with ``loop=False``)."""

    def batches(**kw):
        for b in iterate_batches(**kw):
            if kw.get("loop"):
                draws.append(int(b[0].shape[0]))
            yield b

    return batches


def test_metal_oom_in_a_micro_batch_redoes_the_batch_from_its_first_chunk(tmp_path, monkeypatch):
    ref = run_tiny(tmp_path, "ref", guarded=False)
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0, micro_batches=2, log_dir=str(tmp_path / "events"))
    # iteration 6 is the second batch of update 3 (accumulation 2): the window's first batch's
    # gradient (iteration 5) is kept; the failure hits the second of the two micro-batches, after
    # the first one's gradient went into the partial sum that is dropped
    log = _metal_oom_at(monkeypatch, guard, iteration=6, chunk=2)
    draws = []
    run = run_tiny(tmp_path, "oom", guarded=True, guard=guard, batches=_counting_batches(draws))

    at6 = [(rows, raised) for it, rows, raised in log if it == 6]
    print("split history:", guard.micro_batches_history, " evaluations at iteration 6:", at6)
    assert [r for _, r in at6] == [False, True] + [False] * (len(at6) - 2)  # redone from micro-batch 1
    assert sum(rows for rows, _ in at6[2:]) == 8 and len(at6) - 2 >= 3  # the whole batch, in more pieces
    # every iteration ran, nothing drawn twice, samples per update exact
    assert len(draws) == 10 and guard.summary["iterations"] == 10
    assert guard.optimizer_steps == 5 and guard.samples_per_step == [16] * 5
    # k raised (2 -> 4) at iteration 6 and kept after; the event recorded
    assert guard.micro_batches_history == [(1, 2), (6, 4)] and guard.oom_retries == 1
    oom_events = [e for e in guard.events if "out of memory in the forward and backward" in str(e)]
    assert len(oom_events) == 1, guard.events
    assert [(r["kind"], r["micro_batches"]) for r in _decisions(tmp_path / "events")] == [("oom_retry", 4)]
    # the same run as mlx_lm's unsplit one: updates, LR sequence, losses, tokens, saves, weights.
    # Tolerance atol 1e-4 / rtol 1e-3 (weights move > 1e-2): a cut batch sums its micro-batches'
    # token-weighted gradients in float32 in another order than one unsplit reduction, and Adam's
    # division by sqrt(v) turns such rounding differences of small gradient entries into relative
    # differences of the update, over 5 updates
    assert_same_run(ref, run, atol=1e-4)
    diff = max(float(abs(run["final"][k] - ref["final"][k]).max()) for k in ref["final"])
    print(f"largest weight difference from the unsplit run: {diff:.2e}")


def test_metal_oom_at_one_row_per_micro_batch_raises_window_oom_error_with_the_plan(tmp_path, monkeypatch):
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0)
    log = _metal_oom_at(monkeypatch, guard, iteration=3, chunk=1, times=None)
    with pytest.raises(WindowOOMError) as ei:
        run_tiny(tmp_path, "floor", guarded=True, guard=guard)
    err = ei.value
    print(err)
    assert err.phase == "forward and backward" and err.rows == 8 and err.micro_batches == 8
    assert "out of memory" in str(err) and err.plan and METAL_OOM in str(err)
    # 1 -> 2 -> 4 -> 8 rows' worth, then one more try at one row per micro-batch after the free
    assert [k for it, k in guard.micro_batches_history if it == 3] == [2, 4, 8]
    failed_rows = [rows for it, rows, raised in log if it == 3 and raised]  # first micro-batch of each try
    assert len(failed_rows) == 5 and failed_rows[0] == 8 and failed_rows[-2:] == [1, 1]  # token-balanced cuts
    assert guard.summary is not None and guard.summary["iterations"] == 3  # the guard stopped cleanly


# ---------------------------------------------------------------------------------------------
# validation: cut into the guard's k, the unsplit loss


def _observe(monkeypatch, module, name: str, guard: MlxGuard, *, fail_at=None):
    """Wrap ``module.name`` (an eval boundary ``fn(rows, *arrays)``) to log ``(iteration, rows)``
    of every evaluation; with ``fail_at=(iteration, n)`` the n-th evaluation (1-based) of that
    iteration's pass raises Metal's allocation error once instead (the fake: see the module doc)."""
    real = getattr(module, name)
    log, state = [], {"n": 0, "done": False}

    def wrapped(rows, *arrays):
        it = guard.validation.iteration if guard.validation is not None else None
        if fail_at is not None and not state["done"] and it == fail_at[0]:
            state["n"] += 1
            if state["n"] == fail_at[1]:
                state["done"] = True
                log.append((it, rows, True))
                raise RuntimeError(METAL_OOM)
        log.append((it, rows, False))
        return real(rows, *arrays)

    monkeypatch.setattr(module, name, wrapped)
    return log


def test_validation_is_cut_into_the_guards_k_and_reports_the_unsplit_loss(tmp_path, monkeypatch):
    import memguard_mlx.eval as val

    ref = run_tiny(tmp_path, "ref", guarded=False)
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0, micro_batches=4)
    log = _observe(monkeypatch, val, "_eval_validation", guard)
    run = run_tiny(tmp_path, "k4", guarded=True, guard=guard)
    print("validation evaluations (iteration, rows):", [(it, r) for it, r, _ in log])
    # 3 validation passes (iterations 1, 5, 10) x 2 batches of 8 rows, each in >= 3 micro-batches
    assert guard.validation.history == [(1, 4), (5, 4), (10, 4)]
    for it in (1, 5, 10):
        rows = [r for i, r, _ in log if i == it]
        assert sum(rows) == 16 and len(rows) >= 6 and max(rows) <= 4, (it, rows)
    # the reported validation losses equal mlx_lm's unsplit evaluate (rel 1e-5: float32 sums of
    # the micro-batches' token-weighted losses in another order), as does everything else
    assert [d["val_loss"] for d in run["rec"].val] == pytest.approx([d["val_loss"] for d in ref["rec"].val],
                                                                    rel=1e-5)
    assert_same_run(ref, run, atol=1e-4)


def test_metal_oom_in_validation_raises_only_the_validation_k(tmp_path, monkeypatch):
    import memguard_mlx.eval as val

    ref = run_tiny(tmp_path, "ref", guarded=False)
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0, log_dir=str(tmp_path / "events"))
    # the second batch of the validation pass at iteration 5, evaluated unsplit, fails
    log = _observe(monkeypatch, val, "_eval_validation", guard, fail_at=(5, 2))
    run = run_tiny(tmp_path, "valoom", guarded=True, guard=guard)
    at5 = [(r, raised) for it, r, raised in log if it == 5]
    print("validation at iteration 5 (rows, raised):", at5, " history:", guard.validation.history)
    assert at5[:2] == [(8, False), (8, True)] and sum(r for r, _ in at5[2:]) == 8 and len(at5) >= 4
    assert guard.validation.history == [(1, 1), (5, 1), (5, 2), (10, 2)]  # raised, and kept for later passes
    assert guard.micro_batches_history == [(1, 1)]  # training never cut
    assert guard.oom_retries == 1 and max(guard.micro_batch_rows) == 8
    assert [(r["kind"], r["phase"], r["micro_batches"], r["step"]) for r in _decisions(tmp_path / "events")] == [
        ("oom_retry", "validation", 2, 5)]
    assert_same_run(ref, run, atol=1e-6)  # training unsplit: the same arithmetic as mlx_lm's


def test_metal_oom_in_the_optimizer_update_is_not_redone(tmp_path, monkeypatch):
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0)
    real, updates = tr._eval_update, []

    def update_or_metal_oom(*arrays):
        updates.append(guard._it)
        if len(updates) == 3:
            raise RuntimeError(METAL_OOM)
        return real(*arrays)

    monkeypatch.setattr(tr, "_eval_update", update_or_metal_oom)
    with pytest.raises(WindowOOMError) as ei:
        run_tiny(tmp_path, "update", guarded=True, guard=guard)
    assert ei.value.phase == "optimizer step" and ei.value.redos == 0 and METAL_OOM in str(ei.value)
    assert updates == [2, 4, 6] and guard.optimizer_steps == 2  # stopped at the failed update, not redone
    assert guard.oom_retries == 0 and guard.summary["iterations"] == 6
