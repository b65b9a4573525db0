"""What the training scripts run as child processes (``container_train.py``, ``grow_train.py``,
``preflight_run.py``, ``lightning_preflight_run.py``) and the tests that drive them share.

Script side: the common command-line options, the HF ``TrainingArguments`` of the container runs,
waiting for a go file, the process's peak RSS (VmHWM), writing ``result.json``.

Test side: the child environment, the co-tenant process (takes memory in the same cgroup and
holds it), starting a trainer inside a cgroup as the process the OOM killer takes, waiting for a
marker file while the trainer is alive, and the tight-budget preflight scenario of the HF and
Lightning preflight tests.

No torch / transformers import at module level: the test side runs in the pytest process, and the
scripts import what they need after parsing their options.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, Sequence, Tuple

from memguard_testing import script, script_env, with_root_on_pythonpath

MiB = 1 << 20

# ----------------------------------------------------------------------------------- script side


def script_parser(description: str, *, steps: int, layers: int) -> argparse.ArgumentParser:
    """The options every container script takes: ``--output-dir`` (required), ``--steps``
    (default ``steps``), ``--batch-size`` 16, ``--seq-len`` 256, the model's ``--vocab`` 16384,
    ``--hidden`` 256 and ``--layers`` (default ``layers``), and torch's ``--threads`` 2."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--threads", type=int, default=2)
    return p


def model_of(a: argparse.Namespace, max_positions: int):
    """``hf_tiny.llama`` of the scripts' ``--vocab`` / ``--hidden`` / ``--layers`` (weights seeded 0)."""
    from memguard_testing.hf_tiny import llama

    return llama(a.vocab, a.hidden, a.layers, max_positions=max_positions)


def training_args(a: argparse.Namespace, **extra: Any):
    """The ``TrainingArguments`` of the container runs: CPU, micro-batch ``--batch-size``,
    ``--steps`` optimizer steps, AdamW at 1e-3 with a linear schedule after 1 warmup step, a log
    line per step, seeds 0, sequential sampling (the same rows come at the same steps, also on a
    resume), no reporting, no progress bar; ``extra`` added or overriding (e.g.
    ``gradient_accumulation_steps``, ``save_strategy``)."""
    from transformers import TrainingArguments

    kw: Dict[str, Any] = dict(
        output_dir=a.output_dir, per_device_train_batch_size=a.batch_size, max_steps=a.steps, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, train_sampling_strategy="sequential",
        optim="adamw_torch")
    kw.update(extra)
    return TrainingArguments(**kw)


def wait_for_go(path: str, timeout_s: float, poll_s: float) -> bool:
    """Wait until ``path`` exists, polling every ``poll_s`` seconds, at most ``timeout_s``.
    Returns whether it appeared."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmHWM``, ``VmPeak``, ``VmSize``; proc(5)) in bytes;
    0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def preflight_layout(pf, *fields: str):
    """What a guard's preflight (``Preflight`` or None) read of the data-parallel layout --
    ``world_size``, ``sharding`` and the ``TrainSpec`` ``fields`` named -- and whether it changed
    anything (``applied`` reasons, ``split``); None without a preflight. The multi-process workers
    save it for their tests."""
    if pf is None:
        return None
    ts = pf.train_spec
    out = {"world_size": ts.world_size, "sharding": ts.sharding}
    out.update({name: getattr(ts, name) for name in fields})
    out.update(applied=[c.reason for c in pf.applied], micro_batches=pf.micro_batches)
    return out


def vm_hwm_bytes() -> int:
    """This process's peak resident set (``VmHWM`` of /proc/self/status, proc(5)); 0 if absent."""
    return proc_status_bytes("VmHWM")


def alloc_fails_at(calls):
    """A module backward hook raising the CPU allocator's own error message at the given backward
    calls (1-based): a chosen failure point for the redo tests, beside the real ``RLIMIT_AS`` ones."""
    state = {"n": 0}

    def hook(module, grad_in, grad_out):
        state["n"] += 1
        if state["n"] in calls:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                               "allocate memory: you tried to allocate 268435456 bytes.")

    return hook


def write_result(out_dir: str, result: Dict[str, Any]) -> None:
    """``<out_dir>/result.json`` (what the tests read; written only when the run completed)."""
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


# ------------------------------------------------------------------------------------- test side

#: The co-tenant: takes argv[1] MiB (every page touched), says "held", holds it until killed.
HOLD = """
import sys, time
n = int(sys.argv[1]) << 20
b = bytearray(n)
for i in range(0, n, 4096):
    b[i] = 1
print("held", flush=True)
while True:
    time.sleep(60)
"""


def read_result(out_dir: str):
    """The ``result.json`` a script wrote into ``out_dir``, or None (the run did not complete)."""
    path = os.path.join(out_dir, "result.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def child_env(**extra: str) -> Dict[str, str]:
    """The environment of a training script: memguard importable from this checkout, no
    ``MEMGUARD_MICRO_BATCHES`` (``MEMGUARD_SPLIT``) / ``MEMGUARD_RESUME_FROM`` left from a supervisor, then ``extra``."""
    env = dict(os.environ)
    env.pop("MEMGUARD_SPLIT", None)
    env.pop("MEMGUARD_MICRO_BATCHES", None)
    env.pop("MEMGUARD_RESUME_FROM", None)
    env = with_root_on_pythonpath(env)
    env.update(extra)
    return env


def start_trainer(cg, cmd: Sequence[str], out_dir: str) -> Tuple[subprocess.Popen, Any]:
    """Start ``cmd`` inside the cgroup ``cg`` (``cgroup_harness.MemoryCgroup``), its output to
    ``<out_dir>/trainer.log``, as the process the OOM killer takes (``oom_score_adj`` 500), as in a
    container whose other tenant is a service (lowering the co-tenant's score needs
    CAP_SYS_RESOURCE; raising ours does not). Returns (process, the open log file)."""
    log = open(os.path.join(out_dir, "trainer.log"), "w")
    proc = cg.popen(list(cmd), env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    with open(f"/proc/{proc.pid}/oom_score_adj", "w") as f:
        f.write("500")
    return proc, log


def wait_for(path: str, proc: subprocess.Popen, timeout_s: float = 240, poll_s: float = 0.05) -> None:
    """Wait until ``path`` exists; fails the test if ``proc`` ends first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert proc.poll() is None, f"trainer ended before {os.path.basename(path)}: rc={proc.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(poll_s)


def start_cotenant(cg, take_bytes: int) -> subprocess.Popen:
    """Start the co-tenant (:data:`HOLD`) in ``cg``; returns once it holds ``take_bytes``."""
    proc = cg.popen([sys.executable, "-c", HOLD, str(take_bytes // MiB)], stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    said = proc.stdout.readline().strip()
    assert said == "held", f"co-tenant said {said!r}"
    return proc


#: The model of the preflight scenario (``preflight_run.py``, ``lightning_preflight_run.py``): its
#: activations and logits dominate memory.
PREFLIGHT_CONFIG = dict(model_type="llama", vocab_size=16384, hidden_size=256, intermediate_size=688,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")


#: The file-page growth after ``trainer.train()`` starts that ``RUNTIME_OVERHEAD_BYTES`` holds
#: (docs/estimator.md "Runtime overhead": RssFile 128 MiB at the start of the ``tiny`` case, 139 MiB
#: by its end).
FILE_PAGES_GROWTH_IN_OVERHEAD = 11 * MiB


def check_tight_budget_run(script_name: str, out_dir: str, **train_spec: Any) -> Dict[str, Any]:
    """The tight-budget preflight scenario: micro-batch 16 x 256 tokens, full fine-tune, AdamW,
    fp32 (``train_spec`` adds e.g. ``framework``), under a budget where micro-batch 4 with
    checkpointing fits below the guard's warning level (85 %, which the preflight plans against)
    and 16 does not fit at all. Runs ``memguard_testing/scripts/<script_name> BUDGET OUT_DIR`` in
    a fresh process and checks: a split was planned and applied (with or without checkpointing,
    whichever the planner predicts faster; deeper when the memory the fresh process already holds
    is counted), the run did its 3 steps of 16 samples, and its measured peak stayed under the
    budget, less the library pages mapped after the preflight beyond the overhead's growth (see
    below). Returns the script's result."""
    from memguard_core.estimator.estimate import estimate
    from memguard_core.estimator.specs import TrainSpec
    from memguard_hf.model_spec import model_spec_from_hf_config

    ms = model_spec_from_hf_config(PREFLIGHT_CONFIG)
    requested = TrainSpec(batch_size=16, seq_length=256, method="full", optimizer="adamw", dtype="fp32",
                          device="cpu", **train_spec)
    lo = estimate(ms, requested.replace(batch_size=4, grad_accum=4, grad_checkpoint=True)).peak_bytes
    budget = int(lo / 0.85 * 1.03)
    assert estimate(ms, requested).peak_bytes > budget, (estimate(ms, requested).peak_bytes, budget)
    proc = subprocess.run([sys.executable, script(script_name), str(budget), str(out_dir)],
                          capture_output=True, text=True, timeout=900, env=script_env(PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    assert r["requested_peak"] > budget and r["planned_peak"] <= 0.85 * budget, (budget, r)
    assert r["micro_batches"] >= 2, r
    assert max(r["forward_rows"]) <= 16 // r["micro_batches"], r
    assert r["global_step"] == 3 and r["samples_per_step"] == [16, 16, 16], r
    # library pages the process maps after the preflight read them (RssFile), beyond the growth the
    # runtime overhead holds: they follow how the page cache holds the libraries, not the run's
    # settings (a freshly written venv, as CI's, is cached in large folios and maps ~120 MiB more by
    # the peak than a used one; docs/estimator.md "Runtime overhead") and are clean, reclaimable pages
    late_files = max(0, (r["file_at_end"] or 0) - (r["file_at_preflight"] or 0) - FILE_PAGES_GROWTH_IN_OVERHEAD)
    assert r["measured_peak"] - late_files < budget, (
        f"measured {r['measured_peak'] / MiB:.0f} MiB (library pages mapped after the preflight beyond the "
        f"overhead's: {late_files / MiB:.0f} MiB) >= budget {budget / MiB:.0f} MiB; events: {r['events']}")
    return r

