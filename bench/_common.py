"""What the HF ``Trainer`` benchmarks share (``fit_quality.py``, ``overhead.py``, ``gpu_check.py``,
``probe_full_depth.py``): the environment of their child processes, the model and data of a run, a
timed ``Trainer`` run, a guard whose preflight is recorded, and how the results are written and
shown.

The model is ``memguard_testing.hf_tiny.llama`` (a Llama-architecture decoder from config numbers,
random weights seeded with 0: 4 query / 2 KV heads, MLP 2 x hidden, untied head, SDPA); the rows
are random token ids (``torch.Generator`` seeded with 1), labels = inputs.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def child_env() -> Dict[str, str]:
    """The environment of a benchmark's child process: memguard importable from this checkout, no
    ``MEMGUARD_MICRO_BATCHES`` / ``MEMGUARD_SPLIT`` left over from a supervisor (it would set the starting split), and the
    calibration store off (``MEMGUARD_CALIBRATION=0`` unless set): otherwise every guarded run
    records into this machine's store and corrects the next plan, and a table would depend on the
    runs before it (even within one benchmark). The benchmarks measure the uncalibrated planner, as
    a first run sees it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MEMGUARD_SPLIT", None)
    env.pop("MEMGUARD_MICRO_BATCHES", None)
    env.setdefault("MEMGUARD_CALIBRATION", "0")
    return env


def llama(vocab: int, hidden: int, layers: int, seq: int):
    """``hf_tiny.llama(vocab, hidden, layers, max_positions=seq)``, weights seeded with 0."""
    from memguard_testing.hf_tiny import llama as build

    return build(vocab, hidden, layers, max_positions=seq)


def token_rows(n: int, seq: int, vocab: int) -> list:
    """``n`` rows of ``seq`` random token ids in [1, vocab) (int64 tensors; generator seeded with 1)."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (seq,), generator=g) for _ in range(n)]


def hf_run(model, ids: Sequence[Any], *, batch_size: int, steps: int, grad_accum: int = 1,
           callbacks: Sequence[Any] = (), before_train: Optional[Callable[[Any], None]] = None,
           on_step_end: Optional[Callable[[], None]] = None, **training_args) -> Tuple[Any, List[float]]:
    """Train ``model`` with a HF ``Trainer`` on CPU over ``ids`` (labels = inputs) for ``steps``
    optimizer steps of ``batch_size`` x ``grad_accum`` rows: AdamW at 1e-4, no logging, no saving,
    seed 0, ``training_args`` added (e.g. ``gradient_checkpointing``). The timing callback comes
    after ``callbacks`` (a ``MemGuardCallback`` moves itself to the front when it binds anyway).
    ``before_train(trainer)`` runs between building the Trainer and ``train()``; ``on_step_end()``
    right after each step's time is taken.

    Returns (the trainer, the wall time of each optimizer step in seconds, from ``on_step_begin`` to
    ``on_step_end``)."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    times, t = [], [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            t[0] = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter() - t[0])
            if on_step_end is not None:
                on_step_end()

    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=grad_accum, max_steps=steps, learning_rate=1e-4,
                             logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, **training_args)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[*callbacks, Clock()])
    if before_train is not None:
        before_train(trainer)
    trainer.train()
    return trainer, times


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    """The lines of a Markdown table: header, separator, a line a row."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def write_result(name: str, lines: Sequence[str]) -> None:
    """Write ``lines`` to ``bench/results/<name>``."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print the result rows as a rich table, every column right-aligned."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in header:
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(*r)
    Console().print(t)


def recording_guard(hf_callback: Any, **options: Any) -> Tuple[Any, List[Any]]:
    """A ``MemGuardCallback(**options)`` for a benchmark's guarded run: its ``on_train_begin`` (the
    preflight, with the in-process measurement) timed into the callback's ``begin_seconds``, and the
    measurement's own ``ProbeResult`` kept (the guard keeps only its log line). ``hf_callback`` is
    the ``memguard_hf.callback`` module, whose ``measure_fn`` is wrapped for the rest of the process.
    Returns ``(callback, results)``; ``results`` fills as the measurement runs."""
    results: List[Any] = []
    real = hf_callback.measure_fn

    def recording(*a, **k):
        measure = real(*a, **k)

        def recorded(sizes, max_seconds=None):
            r = measure(sizes, max_seconds)
            results.append(r)
            return r
        return recorded

    hf_callback.measure_fn = recording

    class TimedGuard(hf_callback.MemGuardCallback):
        begin_seconds: Optional[float] = None

        def on_train_begin(self, *a, **k):
            t = time.perf_counter()
            try:
                return super().on_train_begin(*a, **k)
            finally:
                self.begin_seconds = time.perf_counter() - t

    return TimedGuard(**options), results
