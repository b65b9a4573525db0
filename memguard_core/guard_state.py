"""The guard's state that a resumed run takes back: what is saved with the framework's checkpoint
(micro-batches per batch, evaluation micro-batches, the budget, the preflight's decision and the
changes it applied, calibration), as a versioned JSON-safe dict, and the file beside a checkpoint
that holds it. Reading never raises into the run: a missing, corrupt, foreign or other-version
file is logged and ignored. Where each adapter keeps it and what a resume restores:
docs/lifecycle.md, "What a resume restores".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

__all__ = ["FORMAT", "VERSION", "FILE_NAME", "METADATA_KEY", "GuardState", "StateError", "parse_state",
           "parse_state_json", "read_state", "write_state"]

#: The ``format`` key of a saved state: a dict without it was not written by this module.
FORMAT = "memguard.guard_state"
#: The layout version; a state of another version is ignored (the preflight decides again).
VERSION = 1
#: The file name of a state saved inside a checkpoint folder (HF ``checkpoint-N``).
FILE_NAME = "memguard_state.json"
#: The key of the state's JSON text in a checkpoint file's own string metadata (mlx_lm's
#: ``NNNNNNN_adapters.safetensors`` header, ``__metadata__``).
METADATA_KEY = "memguard_state"
# a state file is a few hundred bytes; anything far larger is not one (and is not read into memory)
_MAX_FILE_BYTES = 1 << 20


class StateError(ValueError):
    """A dict that is not a usable guard state (the reason in the message). Raised only by
    :meth:`GuardState.from_dict`; :func:`parse_state` and :func:`read_state` log it instead."""


@dataclass(frozen=True)
class GuardState:
    """The guard's state at a checkpoint.

    Attributes:
        rows: rows (packed: sequences) of a batch the state was decided for.
        micro_batches: micro-batches per batch k in use at the checkpoint (>= 1).
        planned_micro_batches: the preflight's k (where growing back stops without a measured
            prediction below it; docs/monitor.md).
        budget_bytes: the budget the guard ran with (bytes).
        budget_set: the budget was the user's option (else derived at the first start).
        eval_micro_batches: micro-batches of an evaluation batch (None: the adapter has none).
        checkpointing: the preflight turned activation checkpointing on.
        preflight: the preflight's decision line (its changes, applied and not), None when it
            changed nothing or did not run.
        planned_peak_bytes: the preflight's estimate of the planned settings (bytes), None without one.
        correction: the calibration factor the preflight's estimate used (1.0: none).
        calibration_runs: comparable past runs the calibration store had.
        peak_at_micro_batches: k -> the largest step peak measured at k (bytes): the runtime's
            measured calibration, which growing back predicts from.
        step: the optimizer step (MLX: iteration) the checkpoint was saved at, None unknown.
        framework: the adapter that saved it (``hf``, ``lightning``, ``mlx``).
        saved_at: time of the save (s since the epoch).
    """

    rows: int
    micro_batches: int
    planned_micro_batches: int
    budget_bytes: int
    budget_set: bool = False
    eval_micro_batches: Optional[int] = None
    checkpointing: bool = False
    preflight: Optional[str] = None
    planned_peak_bytes: Optional[int] = None
    correction: float = 1.0
    calibration_runs: int = 0
    peak_at_micro_batches: Dict[int, int] = field(default_factory=dict)
    step: Optional[int] = None
    framework: str = ""
    saved_at: float = 0.0

    def to_dict(self) -> Dict[str, Any]:
        """The JSON-safe dict (``format``, ``version``, then the attributes; the peaks' keys as
        strings, as JSON has them)."""
        from . import __version__

        return {"format": FORMAT, "version": VERSION, "memguard_version": __version__,
                "framework": self.framework, "step": self.step, "saved_at": self.saved_at, "rows": self.rows,
                "micro_batches": self.micro_batches, "planned_micro_batches": self.planned_micro_batches,
                "eval_micro_batches": self.eval_micro_batches, "budget_bytes": self.budget_bytes,
                "budget_set": self.budget_set, "checkpointing": self.checkpointing, "preflight": self.preflight,
                "planned_peak_bytes": self.planned_peak_bytes, "correction": self.correction,
                "calibration_runs": self.calibration_runs,
                "peak_at_micro_batches": {str(k): int(v) for k, v in sorted(self.peak_at_micro_batches.items())}}

    @classmethod
    def from_dict(cls, data: Any) -> "GuardState":
        """The state in ``data`` (a dict as :meth:`to_dict` writes it, e.g. read back from JSON).

        Raises:
            StateError: not a dict, another ``format`` (foreign), another ``version``, or a field
                missing or of the wrong type / range (named in the message).
        """
        if not isinstance(data, Mapping):
            raise StateError(f"not a guard state (a {type(data).__name__}, not a dict)")
        if data.get("format") != FORMAT:
            raise StateError(f"not a memguard guard state (format {data.get('format')!r}, expected {FORMAT!r})")
        version = data.get("version")
        if version != VERSION:
            raise StateError(f"saved in guard-state version {version!r} (by memguard "
                             f"{data.get('memguard_version', '?')}); this memguard reads version {VERSION}")
        peaks = data.get("peak_at_micro_batches", {})
        if not isinstance(peaks, Mapping):
            raise StateError("peak_at_micro_batches: expected a dict k -> bytes")
        try:
            peak_map = {int(k): _int(f"peak_at_micro_batches[{k}]", v, 1) for k, v in peaks.items()}
        except (TypeError, ValueError) as exc:
            raise StateError(f"peak_at_micro_batches: {exc}") from None
        if any(k < 1 for k in peak_map):
            raise StateError("peak_at_micro_batches: a k below 1")
        eval_k = data.get("eval_micro_batches")
        planned_peak = data.get("planned_peak_bytes")
        step = data.get("step")
        preflight = data.get("preflight")
        if preflight is not None and not isinstance(preflight, str):
            raise StateError("preflight: expected a string or null")
        correction = data.get("correction", 1.0)
        if isinstance(correction, bool) or not isinstance(correction, (int, float)) or not (
                math.isfinite(correction) and correction > 0):
            raise StateError(f"correction: expected a positive number, got {correction!r}")
        return cls(rows=_int("rows", data.get("rows"), 1),
                   micro_batches=_int("micro_batches", data.get("micro_batches"), 1),
                   planned_micro_batches=_int("planned_micro_batches", data.get("planned_micro_batches"), 1),
                   budget_bytes=_int("budget_bytes", data.get("budget_bytes"), 1),
                   budget_set=_bool("budget_set", data.get("budget_set", False)),
                   eval_micro_batches=None if eval_k is None else _int("eval_micro_batches", eval_k, 1),
                   checkpointing=_bool("checkpointing", data.get("checkpointing", False)),
                   preflight=preflight,
                   planned_peak_bytes=None if planned_peak is None else _int("planned_peak_bytes", planned_peak, 1),
                   correction=float(correction),
                   calibration_runs=_int("calibration_runs", data.get("calibration_runs", 0), 0),
                   peak_at_micro_batches=peak_map,
                   step=None if step is None else _int("step", step, 0),
                   framework=str(data.get("framework") or ""),
                   saved_at=float(data.get("saved_at") or 0.0))


def _int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise StateError(f"{name}: expected an integer >= {least}, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise StateError(f"{name}: expected true or false, got {value!r}")
    return value


def parse_state(data: Any, source: str, log: logging.Logger) -> Optional[GuardState]:
    """:meth:`GuardState.from_dict`, never raising: a dict that is not a usable state is logged
    (one WARNING line on ``log`` naming ``source`` and why) and gives None. An empty dict (a
    checkpoint saved before the guard started) gives None silently."""
    if isinstance(data, Mapping) and not data:
        return None
    try:
        return GuardState.from_dict(data)
    except StateError as exc:
        log.warning("memguard: the guard state in %s is not used (%s); the preflight decides again", source, exc)
    except Exception:
        log.warning("memguard: the guard state in %s could not be read; the preflight decides again", source,
                    exc_info=True)
    return None


def read_state(path: str, log: logging.Logger) -> Optional[GuardState]:
    """The state saved in the file ``path``, or None: a missing file (a checkpoint saved without
    memguard) is said at INFO; an unreadable, corrupt (not JSON), foreign or other-version file at
    WARNING. Never raises."""
    try:
        if not os.path.isfile(path):
            log.info("memguard: no guard state at %s (a checkpoint saved without it); the preflight decides", path)
            return None
        if os.path.getsize(path) > _MAX_FILE_BYTES:
            raise StateError(f"{os.path.getsize(path)} bytes: too large for a guard state")
        with open(path, "rb") as fh:
            text = fh.read()
    except (OSError, StateError) as exc:
        log.warning("memguard: the guard state in %s is not used (%s: %s); the preflight decides again",
                    path, type(exc).__name__, exc)
        return None
    return parse_state_json(text, path, log)


def write_state(path: str, state: GuardState, log: logging.Logger) -> bool:
    """Write ``state`` to ``path`` as JSON, atomically (a temporary file in the same folder, then
    ``os.replace``: a kill mid-write leaves the previous file or none, never half of one). Returns
    True when written; a failure is logged (WARNING) and gives False. Never raises."""
    tmp = None
    try:
        if not state.saved_at:
            state = dataclasses.replace(state, saved_at=round(time.time(), 3))
        text = json.dumps(state.to_dict(), indent=1, sort_keys=True, allow_nan=False)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".memguard_state.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        os.replace(tmp, path)
        return True
    except Exception as exc:
        log.warning("memguard: could not save the guard state to %s (%s: %s); a resume from this checkpoint "
                    "decides again", path, type(exc).__name__, exc)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


def parse_state_json(text: Any, source: str, log: logging.Logger) -> Optional[GuardState]:
    """:func:`parse_state` of a JSON text (``str`` or UTF-8 ``bytes``), e.g. the
    :data:`METADATA_KEY` entry of a safetensors header; text that is not JSON is logged (WARNING)
    and gives None. Never raises."""
    try:
        data = json.loads(text.decode("utf-8") if isinstance(text, (bytes, bytearray)) else text)
    except (TypeError, ValueError) as exc:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.warning("memguard: the guard state in %s is not used (%s: %s); the preflight decides again",
                    source, type(exc).__name__, exc)
        return None
    return parse_state(data, source, log)
