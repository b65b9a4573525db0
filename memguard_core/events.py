"""The run event log: one JSONL file per rank, one record per optimizer step and one per decision.

A guarded run writes it when ``MEMGUARD_LOG_DIR`` is set (or ``log_dir=`` is given). Each record is
flushed as it is written, so a run the kernel kills leaves everything up to its last step.
``memguard run`` appends its restarts to the same file (the run id travels in ``MEMGUARD_RUN_ID``).
``memguard report FILE.jsonl`` draws it (``memguard_core.timeline``). Record formats: docs/events.md.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from . import __version__

__all__ = ["EventLog", "LOG_DIR_ENV", "RUN_ID_ENV", "DECISION_KINDS", "read_events", "event_log_path",
           "append_record", "new_run_id"]

LOG_DIR_ENV = "MEMGUARD_LOG_DIR"
RUN_ID_ENV = "MEMGUARD_RUN_ID"

#: What a ``decision`` record's ``kind`` can be.
DECISION_KINDS = ("preflight", "clean", "split", "grow", "oom_retry", "eval_split", "restart", "leak", "snapshot",
                  "pressure")

_log = logging.getLogger("memguard.events")


def new_run_id() -> str:
    """A run id: UTC time and 6 random hex digits (sortable, unique enough per machine)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def event_log_path(log_dir: str, run_id: str, rank: int = 0) -> str:
    """``<log_dir>/memguard-<run_id>-rank<rank>.jsonl``."""
    return os.path.join(log_dir, f"memguard-{run_id}-rank{int(rank)}.jsonl")


class EventLog:
    """Append-only JSONL log of a guarded run, for one rank.

    Args:
        log_dir: folder for the file (created if missing).
        rank: this process's rank (0 for a single process).
        run_id: shared by the ranks and restarts of one run; default ``MEMGUARD_RUN_ID`` from the
            environment, else a new id (and this process exports it, so a child it starts shares it).
        clock: seconds since the epoch (tests pass their own).

    Every write is one line, flushed at once; a failure to write is logged once at WARNING and turns
    the log off -- it never raises into the training loop. Thread-safe (the monitor's thread writes
    decisions while the training thread writes steps).
    """

    def __init__(self, log_dir: str, *, rank: int = 0, run_id: Optional[str] = None,
                 clock: Callable[[], float] = time.time, device: Optional[str] = None,
                 budget_bytes: Optional[int] = None):
        self.rank = int(rank)
        self.run_id = run_id or os.environ.get(RUN_ID_ENV) or new_run_id()
        os.environ.setdefault(RUN_ID_ENV, self.run_id)
        self.path = event_log_path(log_dir, self.run_id, self.rank)
        self._clock = clock
        self._lock = threading.Lock()
        self._fh = None
        self.records_written = 0
        try:
            os.makedirs(log_dir, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            _log.warning("memguard: event log off: cannot open %s (%s)", self.path, exc)
            return
        self._write({"type": "start", "run_id": self.run_id, "pid": os.getpid(), "host": socket.gethostname(),
                     "memguard": __version__, "device": device, "budget_bytes": budget_bytes})

    @classmethod
    def from_env(cls, log_dir: Optional[str] = None, **kw: Any) -> Optional["EventLog"]:
        """An EventLog in ``log_dir`` or ``MEMGUARD_LOG_DIR``; ``None`` when neither is set."""
        d = log_dir or os.environ.get(LOG_DIR_ENV)
        return cls(d, **kw) if d else None

    @property
    def enabled(self) -> bool:
        return self._fh is not None

    def _write(self, record: Dict[str, Any]) -> None:
        if self._fh is None:
            return
        rec = {"t": round(float(self._clock()), 3), "rank": self.rank, **record}
        try:
            line = json.dumps(rec, separators=(",", ":"), default=str)
            with self._lock:
                if self._fh is None:
                    return
                self._fh.write(line + "\n")
                self._fh.flush()
                self.records_written += 1
        except Exception as exc:  # a full disk, a closed file: the run goes on without the log
            _log.warning("memguard: event log off: cannot write %s (%s)", self.path, exc)
            self._close_quietly()

    def step(self, step: int, *, peak_bytes: Optional[int], current_bytes: Optional[int] = None,
             budget_bytes: Optional[int] = None, micro_batches: int = 1, reserved_bytes: Optional[int] = None,
             pressure: Optional[str] = None, **extra: Any) -> None:
        """One optimizer step: its peak and current memory (bytes, the guard's counter), the budget
        (bytes), ``usage`` = peak / budget, micro-batches per batch, the pressure level."""
        usage = (peak_bytes / budget_bytes) if peak_bytes is not None and budget_bytes else None
        self._write({"type": "step", "step": int(step), "peak_bytes": _int(peak_bytes),
                     "current_bytes": _int(current_bytes), "reserved_bytes": _int(reserved_bytes),
                     "budget_bytes": _int(budget_bytes), "usage": None if usage is None else round(usage, 4),
                     "micro_batches": int(micro_batches), "pressure": pressure, **extra})

    def decision(self, kind: str, message: str, *, step: Optional[int] = None, **fields: Any) -> None:
        """One decision (``DECISION_KINDS``) with the one-line message the logs carry."""
        self._write({"type": "decision", "kind": str(kind), "step": step, "message": str(message), **fields})

    def close(self, **summary: Any) -> None:
        """Write an ``end`` record (with ``summary``) and close the file."""
        if self._fh is not None:
            self._write({"type": "end", **summary})
        self._close_quietly()

    def _close_quietly(self) -> None:
        with self._lock:
            fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except Exception:
                pass


def append_record(path: str, record: Dict[str, Any], *, rank: int = 0) -> bool:
    """Append one record to an event log from outside the run (``memguard run``'s restarts): one
    line, in append mode, so it lands after what the killed run wrote. False (logged) on failure."""
    rec = {"t": round(time.time(), 3), "rank": int(rank), **record}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec, separators=(",", ":"), default=str) + "\n")
        return True
    except OSError as exc:
        _log.warning("memguard: cannot append to the event log %s (%s)", path, exc)
        return False


def _int(v: Any) -> Optional[int]:
    return None if v is None else int(v)


def read_events(path: str) -> List[Dict[str, Any]]:
    """The records of one JSONL event log, in file order. A truncated last line (a run killed
    mid-write) is skipped.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 text, or a line other than the last is
            not JSON.
    """
    from .errors import ConfigError

    try:
        with open(path, "r", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ConfigError("FILE", "a readable memguard event log (.jsonl)", f"{path} ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("FILE", "a memguard event log (.jsonl: UTF-8 text)",
                          f"{path} (not UTF-8 at byte {exc.start})") from None
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ConfigError("FILE", f"one JSON object per line in {path}", f"line {i + 1}: {line[:60]}") from None
        if isinstance(rec, dict):
            out.append(rec)
    return out
