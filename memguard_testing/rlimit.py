"""What the ``RLIMIT_AS`` child scripts (``scripts/rlimit_*_run.py``) share: the phase a failure
happened in, the address-space peaks per phase, the token rows they train on, a SmolLM2-shaped model,
the guard that acts only on a caught out-of-memory error, and the run-and-report tail that sets the
limit, runs, and writes one JSON result.

Imports torch and transformers (the scripts' frameworks); the guard's adapter is imported by the
caller.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any, Callable, Dict, Optional

import torch

from memguard_testing import ROOT

#: The phase the script is in (``setup``, ``forward``, ``backward``, ``optimizer``, ``evaluation``,
#: ...): where an allocation failure is reported to have happened.
PHASE: Dict[str, str] = {"now": "setup"}
#: ``(phase, VmPeak bytes)`` as the run goes: tests place their limits between these.
PEAKS: list = []


def vm_peak() -> int:
    """This process's peak virtual size (``VmPeak``), bytes: what ``RLIMIT_AS`` bounds."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmPeak:"))


def mark(phase_done: str, next_phase: Optional[str] = None) -> None:
    """Record the peak at the end of ``phase_done``; the run is in ``next_phase`` from here."""
    PEAKS.append((phase_done, vm_peak()))
    if next_phase is not None:
        PHASE["now"] = next_phase


class TokenRows(torch.utils.data.Dataset):
    """``rows`` random token rows of ``seq`` tokens (seeded), labels = the inputs; with ``ragged`` each
    row masks a different tail (-100), so chunks of a batch hold different numbers of valid labels."""

    def __init__(self, vocab: int, rows: int, seq: int, seed: int = 0, ragged: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (rows, seq), generator=g)
        self.labels = self.ids.clone()
        if ragged:
            for i in range(rows):
                self.labels[i, seq - (i * 7) % (seq // 2):] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def smollm2(layers: int, **overrides: Any):
    """A SmolLM2-135M-shaped causal LM (tests/configs/smollm2-135m.json) with ``layers`` blocks and
    the config fields in ``overrides``, fp32, random weights seeded 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(os.path.join(ROOT, "tests", "configs", "smollm2-135m.json"))
    config.num_hidden_layers = layers
    for k, v in overrides.items():
        setattr(config, k, v)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def act_only_on_oom() -> None:
    """Make the monitor's step samples do nothing, so the guard acts only on a caught out-of-memory
    error (a step sample would read the limit and split before the failure the test wants)."""
    from memguard_core.monitor import Action, MemoryMonitor

    MemoryMonitor.step_sample = lambda self, step=None: Action.NONE


def run_limited(limit: int, mode: str, out: str, train: Callable[[Dict[str, Any]], None],
                finish: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
    """Set ``RLIMIT_AS`` to ``limit`` (0: none), run ``train(result)``, and write ``result`` as JSON
    to ``out``: ``mode``, ``limit``, what ``train`` put in, ``failed`` (the phase) and ``error`` when
    it raised, ``peaks``, and what ``finish(result)`` adds (run whether or not training failed)."""
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    r: Dict[str, Any] = {"mode": mode, "limit": limit}
    try:
        train(r)
    except Exception as exc:
        r.update(failed=PHASE["now"], error=f"{type(exc).__name__}: {exc}"[:2000])
    r["peaks"] = PEAKS
    if finish is not None:
        finish(r)
    with open(out, "w") as f:
        json.dump(r, f)


def vm_size() -> int:
    """This process's virtual size now (``VmSize``), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def run_limited_once(limit: int, mode: str, train: Callable[[Dict[str, Any]], None],
                     finish: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """:func:`run_limited` for one of several runs in this process: the result returned instead of
    written, the soft limit lifted to the hard one afterwards (the next run sets its own), and
    ``vm_start``: VmSize before the limit was set (bytes), so a test can check what earlier runs left."""
    import tempfile

    vm_start = vm_size()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        run_limited(limit, mode, out, train, finish)
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        with open(out) as f:
            r = json.load(f)
    r["vm_start"] = vm_start
    return r


def sampled_params(module: torch.nn.Module) -> Dict[str, list]:
    """Every 997th value of each parameter (enough to compare two runs' final weights)."""
    return {n: p.detach().flatten()[::997].tolist() for n, p in module.named_parameters()}
