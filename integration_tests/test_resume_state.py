"""A resumed run starts with the micro-batches it had (issue 34 item 7; docs/lifecycle.md, "What a
resume restores"): a real tiny HF ``Trainer`` / Lightning fit / ``memguard_mlx.train`` run split to
4 micro-batches at step 2, saved a checkpoint every step and SIGKILLed itself once the checkpoint of
step 4 was written (``memguard_testing/scripts/resume_state_run.py``); a second process resumes
from that checkpoint the framework's own way (HF ``train(resume_from_checkpoint=...)``, Lightning
``fit(ckpt_path=...)``, mlx_lm ``resume_from``).

Asserted from what ran (the forwards' rows by a pre-hook on the model, the checkpoint files): the
resumed process starts at step 4 with 4 micro-batches per batch (2-row forwards from its first
step), its preflight does not run, and one log line names what was restored and from where. Without
a usable state (a corrupt file; none beside the adapter) the same resume decides afresh: 1
micro-batch, the preflight run, the file named in a warning. HF also carries the preflight's
changes: a run whose budget nothing fits starts at 1-row micro-batches with activation
checkpointing, and its resume turns checkpointing on again on the new model without planning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from memguard_core.guard_state import FILE_NAME, METADATA_KEY
from memguard_testing import script
from memguard_testing.forkserver import run_script
from memguard_testing.train_scripts import child_env

RUN = script("resume_state_run.py")
KILLED = -signal.SIGKILL
#: What each framework's runs import, loaded once by their fork server (memguard_testing.forkserver;
#: the script imports its framework inside ``main``). None for MLX: importing ``mlx.core`` starts
#: no thread, but its stream thread once started would not survive a fork, and mlx_lm is cheap to
#: import, so its runs start as fresh interpreters.
PRELOAD = {"hf": ("transformers.trainer", "memguard_hf", "memguard_testing.hf_tiny"),
           "lightning": ("lightning.pytorch", "memguard_lightning", "memguard_testing.lightning_tiny"),
           "mlx": None}


def _run(framework: str, out, *args: str, rc: int = 0) -> None:
    argv = (framework, "--out", str(out), *args)
    if PRELOAD[framework] is None:
        p = subprocess.run([sys.executable, RUN, *argv], env=child_env(), capture_output=True, text=True,
                           timeout=400)
    else:
        p = run_script(RUN, *argv, env=child_env(), timeout=400, preload=PRELOAD[framework])
    assert p.returncode == rc, (p.returncode, p.stdout[-2000:], p.stderr[-4000:])


def _lines(out, name: str) -> list:
    path = os.path.join(str(out), name)
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _log(out) -> str:
    return open(os.path.join(str(out), "memguard.log")).read()


def _killed_after_a_split(framework: str, out) -> None:
    """The first run: split to 4 at step 2, SIGKILLed after the checkpoint of step 4."""
    _run(framework, out, "--steps", "6", "--split-at", "2", "--split-to", "4", "--kill-at", "4", rc=KILLED)
    first = _lines(out, "steps.jsonl")
    assert [s["step"] for s in first] == [1, 2, 3, 4] and [len(s["forwards"]) for s in first] == [1, 1, 4, 4]
    assert not _lines(out, "done.jsonl")   # killed: the run never finished


def _assert_resumed_at_4_with_4(out, source: str) -> None:
    starts = _lines(out, "starts.jsonl")
    assert len(starts) == 2 and starts[0]["preflight_ran"] and starts[0]["k"] == 1
    resumed = starts[1]
    assert resumed["step"] == 4 and resumed["k"] == 4 and not resumed["preflight_ran"]
    assert resumed["restored_from"] == source and resumed["planned_k"] == 1
    steps = [s for s in _lines(out, "steps.jsonl") if s["pid"] == resumed["pid"]]
    assert [s["step"] for s in steps] == [5, 6] and all(len(s["forwards"]) == 4 for s in steps)
    assert all(sum(s["forwards"]) == 8 for s in steps)   # the effective batch kept
    log = _log(out)
    lines = [line for line in log.splitlines() if "resumed from" in line]
    assert len(lines) == 1 and source in lines[0] and "4 micro-batches per batch" in lines[0]
    assert "the preflight does not decide again" in lines[0]
    assert log.count("memguard preflight:") == 1   # the first run's only


def test_hf_resume_restores_the_micro_batches_and_a_corrupt_state_decides_again(tmp_path):
    out = tmp_path / "hf"
    _killed_after_a_split("hf", out)
    ckpt4 = out / "ckpt" / "checkpoint-4"
    saved = json.loads((ckpt4 / FILE_NAME).read_text())
    assert saved["micro_batches"] == 4 and saved["step"] == 4 and saved["framework"] == "hf"
    _run("hf", out, "--steps", "6", "--resume", "auto")   # train(resume_from_checkpoint=True)
    _assert_resumed_at_4_with_4(out, str(ckpt4 / FILE_NAME))

    # the same resume, named explicitly, with the state file corrupted: logged, then decided afresh
    (ckpt4 / FILE_NAME).write_text('{"format": "memguard.guard_state", "version": 1, "micro_batc')
    _run("hf", out, "--steps", "6", "--resume", str(ckpt4))
    third = _lines(out, "starts.jsonl")[2]
    assert third["step"] == 4 and third["k"] == 1 and third["preflight_ran"] and third["restored_from"] is None
    assert [len(s["forwards"]) for s in _lines(out, "steps.jsonl") if s["pid"] == third["pid"]] == [1, 1]
    assert f"the guard state in {ckpt4 / FILE_NAME} is not used" in _log(out)


def test_hf_resume_turns_the_preflights_checkpointing_on_again_without_planning(tmp_path):
    out = tmp_path / "hf-nothing-fits"
    budget = ("--budget-bytes", str(2**20))   # nothing fits: 1-row micro-batches and checkpointing
    _run("hf", out, "--steps", "4", "--kill-at", "2", *budget, rc=KILLED)
    _run("hf", out, "--steps", "4", "--resume", "auto", *budget)
    first, resumed = _lines(out, "starts.jsonl")
    assert first["k"] == 8 and first["checkpointing"]
    assert resumed["step"] == 2 and resumed["k"] == 8 and resumed["restored_from"] and resumed["checkpointing"]
    log = _log(out)
    assert log.count("nothing fits the budget") == 2   # the first run's decision, quoted once on the resume
    line = next(line for line in log.splitlines() if "resumed from" in line)
    assert "activation checkpointing on again" in line and "(its decision: preflight: nothing fits" in line


def test_lightning_resume_restores_the_micro_batches(tmp_path):
    import torch

    out = tmp_path / "lightning"
    _killed_after_a_split("lightning", out)
    ckpt = str(out / "ckpt" / "epoch=0-step=4.ckpt")
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["callbacks"]["MemGuardCallback"]
    assert saved["micro_batches"] == 4 and saved["step"] == 4 and saved["framework"] == "lightning"
    _run("lightning", out, "--steps", "6", "--resume", ckpt)
    _assert_resumed_at_4_with_4(out, ckpt)


def test_mlx_resume_restores_the_micro_batches_and_without_the_state_decides_again(tmp_path):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    import mlx.core as mx

    out = tmp_path / "mlx"
    _killed_after_a_split("mlx", out)
    adapters = out / "adapters"
    adapter = str(adapters / "0000004_adapters.safetensors")
    arrays, meta = mx.load(adapter, return_metadata=True)
    assert json.loads(meta[METADATA_KEY])["micro_batches"] == 4
    assert sorted(p.name for p in adapters.iterdir()) == [f"000000{i}_adapters.safetensors" for i in range(1, 5)] + [
        "adapters.safetensors"]   # mlx_lm's own files, no other
    _run("mlx", out, "--steps", "6", "--resume", adapter)
    _assert_resumed_at_4_with_4(out, adapter)

    mx.save_safetensors(adapter, arrays)   # the same weights saved by mlx_lm itself: the preflight decides
    _run("mlx", out, "--steps", "6", "--resume", adapter)
    third = _lines(out, "starts.jsonl")[2]
    assert third["k"] == 1 and third["preflight_ran"] and third["restored_from"] is None
    assert f"no guard state in {adapter}" in _log(out)


def test_lightning_a_validate_checkpoint_does_not_reach_a_later_fit(tmp_path):
    # Lightning hands callback states back on validate(ckpt_path=...) too: no fit starts from it
    from memguard_lightning import MemGuardCallback
    from memguard_testing.lightning_tiny import TinyLM, make_loader, make_trainer, make_val_loader

    first = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0, grow=None)
    trainer = make_trainer(callbacks=[first], max_steps=2, accumulate=1)
    module = TinyLM(total_steps=4)
    trainer.fit(module, make_loader(8))
    first.monitor.request_micro_batches(4, "test: memory pressure")   # what the checkpoint will hold
    ckpt = str(tmp_path / "step2.ckpt")
    trainer.save_checkpoint(ckpt)

    guard = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0, grow=None)
    trainer = make_trainer(callbacks=[guard], max_steps=2, accumulate=1)
    trainer.validate(module, make_val_loader(), ckpt_path=ckpt)
    trainer.fit(module, make_loader(8))
    assert guard.guard.restored is None and guard.preflight is not None and guard.monitor.micro_batches == 1

    guard = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0, grow=None)
    trainer = make_trainer(callbacks=[guard], max_steps=4, accumulate=1)
    trainer.fit(module, make_loader(8), ckpt_path=ckpt)   # the control: a fit from it restores k = 4
    assert guard.guard.restored_from == ckpt and guard.preflight is None and guard.summary["micro_batches"] == 4
