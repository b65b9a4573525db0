"""Auto-calibration: past runs' measured peaks correct later estimates on the same machine.

After each guarded run the adapters call :func:`record_preflight` (or :func:`record`) with the
estimate and the measured peak of the counter it predicts. A row holds a device fingerprint, a
model fingerprint, the settings and both numbers, in SQLite at ``<data dir>/calibration.sqlite3``
(the data dir: ``$MEMGUARD_DATA_DIR``, else ``platformdirs.user_data_dir("memguard")``). Once
``MIN_RUNS`` (3) comparable runs exist -- same device fingerprint, same model fingerprint, same
settings class (method, optimizer, dtype, mixed precision, checkpointing, attention, framework,
counter; batch and sequence may differ, the ratio is relative) -- :func:`correction_for` returns
the median of ``measured / estimated`` over the latest ``WINDOW`` of them, and
``memguard_core.preflight.plan_in_place`` passes it to ``estimate(..., correction=...)`` (shown as
the ``calibration`` term and a line of the preflight report).

Robustness (the store must never break training): every public function catches its own errors and
logs them on ``memguard.calibration``; SQLite runs in WAL mode with a busy timeout so several ranks
or runs can write at once (each write is one short transaction; a locked database is retried); a
process killed mid-write leaves the last committed state (SQLite's journal); a file that is not a
valid database is moved aside to ``calibration.sqlite3.corrupt-<time>`` with a warning and a new
one is created. ``MEMGUARD_CALIBRATION=0`` turns recording and correction off.

This module imports no framework.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sqlite3
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .errors import ConfigError

logger = logging.getLogger("memguard.calibration")

__all__ = ["MIN_RUNS", "WINDOW", "Correction", "data_dir", "db_path", "device_fingerprint",
           "model_fingerprint", "settings_key", "record", "record_preflight", "correction_for",
           "show", "reset", "enabled"]

#: Comparable runs needed before a correction applies.
MIN_RUNS = 3
#: The latest runs a correction is computed from.
WINDOW = 20
#: A correction outside [1/MAX_FACTOR, MAX_FACTOR] is treated as a broken measurement, not applied.
MAX_FACTOR = 3.0
_FILE = "calibration.sqlite3"
_SCHEMA = """CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    device_fp TEXT NOT NULL,
    model_fp TEXT NOT NULL,
    settings TEXT NOT NULL,
    counter TEXT NOT NULL,
    estimated_bytes INTEGER NOT NULL,
    measured_bytes INTEGER NOT NULL,
    ratio REAL NOT NULL,
    details TEXT
);
CREATE INDEX IF NOT EXISTS runs_key ON runs (device_fp, model_fp, settings);"""


def enabled() -> bool:
    """False when ``MEMGUARD_CALIBRATION`` is 0 / false / off."""
    return os.environ.get("MEMGUARD_CALIBRATION", "1").strip().lower() not in ("0", "false", "off", "no")


def data_dir(create: bool = True) -> str:
    """``$MEMGUARD_DATA_DIR`` or platformdirs' user data dir for ``memguard`` (created unless
    ``create`` is False: a read, as ``memguard calibration show``, creates nothing).

    Raises:
        ConfigError: the path exists and is not a folder, or cannot be created (the field named is
            ``MEMGUARD_DATA_DIR`` when that is set). Recording and reading catch it: a guarded run
            goes on without calibration.
    """
    d = os.environ.get("MEMGUARD_DATA_DIR")
    if not d:
        try:
            from platformdirs import user_data_dir

            d = user_data_dir("memguard", appauthor=False)
        except Exception:  # platformdirs missing: a dot-dir in the home
            d = os.path.join(os.path.expanduser("~"), ".memguard")
    if os.path.exists(d) and not os.path.isdir(d):
        raise ConfigError("MEMGUARD_DATA_DIR" if os.environ.get("MEMGUARD_DATA_DIR") else "data dir",
                          "a folder (or a path where one can be created)", d)
    if not create:
        return d
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as exc:
        raise ConfigError("MEMGUARD_DATA_DIR" if os.environ.get("MEMGUARD_DATA_DIR") else "data dir",
                          "a folder memguard can create and write", f"{d} ({exc.strerror or exc})") from None
    return d


def db_path(create: bool = True) -> str:
    """Path of the calibration database (its folder created unless ``create`` is False)."""
    return os.path.join(data_dir(create), _FILE)


def _store_exists() -> bool:
    """True when the database file is there (reads of a store never written create nothing)."""
    try:
        return os.path.isfile(db_path(create=False))
    except ConfigError:
        return False


def _hash(d: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo "model name"; elsewhere ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def device_fingerprint(counter: str = "cpu") -> Dict[str, Any]:
    """What a measured peak depends on besides the model and the settings: the counter, OS, CPU
    model, core count, total memory (GiB, rounded), Python and the framework versions (major.minor)
    that change allocator behaviour. ``["id"]`` is its hash."""
    fp: Dict[str, Any] = dict(counter=counter, os=platform.system(), machine=platform.machine(),
                              cores=os.cpu_count(), python=".".join(platform.python_version_tuple()[:2]),
                              cpu=cpu_model())
    try:
        from .probes import probe

        fp["memory_gib"] = round(probe().total_bytes / 2**30)
    except Exception:
        pass
    from importlib import metadata

    for pkg in ("torch", "transformers", "mlx", "mlx-lm", "lightning", "pytorch-lightning"):
        try:
            fp[pkg] = ".".join(metadata.version(pkg).split(".")[:2])
        except Exception:
            pass
    fp["id"] = _hash({k: v for k, v in fp.items() if k != "id"})
    return fp


def model_fingerprint(ms: Any) -> str:
    """Hash of the architecture numbers of a ``ModelSpec`` (type, vocabulary, widths, layers, heads,
    experts, parameter count, storage bits, LoRA found)."""
    return _hash(dict(t=ms.model_type, v=ms.vocab_size, h=ms.hidden_size, i=ms.intermediate_size,
                      l=ms.num_layers, nh=ms.num_heads, kv=ms.num_kv_heads, e=ms.num_experts,
                      k=ms.num_experts_per_tok, p=int(ms.params.total), wb=ms.weight_bits, db=ms.dense_bits))


def settings_key(ts: Any) -> str:
    """The settings class of a ``TrainSpec`` runs must share to be comparable (batch, sequence
    length, accumulation and LoRA rank may differ)."""
    return json.dumps(dict(method=ts.method, optimizer=ts.optimizer, dtype=ts.dtype, mixed=ts.mixed_precision,
                           ckpt=ts.grad_checkpoint, attn=ts.attn_impl, framework=ts.framework,
                           device=ts.device, targets=list(ts.lora_targets) if ts.method != "full" else [],
                           # another model code keeps other tensors; transformers' keys stay as they were
                           **({"code": ts.model_code} if getattr(ts, "model_code", "transformers") != "transformers"
                              else {})),
                      sort_keys=True)


def _connect(path: Optional[str] = None) -> sqlite3.Connection:
    """Open (creating or, when corrupt, recreating) the database; WAL + busy timeout."""
    path = path or db_path()
    for attempt in range(2):
        try:
            con = sqlite3.connect(path, timeout=30.0, isolation_level=None)
            con.execute("PRAGMA busy_timeout=30000")
            try:
                con.execute("PRAGMA journal_mode=WAL")
            except sqlite3.OperationalError:  # another process holds it mid-switch: it is WAL already
                pass
            con.executescript(_SCHEMA)
            con.execute("SELECT count(*) FROM runs").fetchone()
            return con
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise
            if attempt:
                raise
            try:
                con.close()
            except Exception:
                pass
            aside = f"{path}.corrupt-{int(time.time())}"
            logger.warning("memguard calibration store %s is not a valid database (%s): moved to %s and "
                           "recreated", path, exc, aside)
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.replace(path + suffix, aside + suffix)
                except OSError:
                    pass
    raise RuntimeError("unreachable")  # pragma: no cover


def _retry(fn, what: str):
    """Run ``fn(con)`` in a fresh connection, retrying a locked database; None on failure (logged)."""
    if not enabled():
        return None
    delay = 0.05
    for attempt in range(8):
        con = None
        try:
            con = _connect()
            return fn(con)
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            logger.warning("memguard calibration: %s failed: %s", what, exc)
            return None
        except Exception as exc:
            logger.warning("memguard calibration: %s failed: %s", what, exc)
            return None
        finally:
            if con is not None:
                try:
                    con.close()
                except Exception:
                    pass
    logger.warning("memguard calibration: %s gave up (database locked)", what)
    return None


def record(model_spec: Any, train_spec: Any, estimated_bytes: int, measured_bytes: int, *,
           details: Optional[dict] = None) -> bool:
    """Store one run: the UNcorrected estimate (bytes) and the measured peak of the counter
    ``train_spec.device`` predicts (bytes). Returns True when stored; never raises."""
    try:
        est, meas = int(estimated_bytes), int(measured_bytes)
        if est <= 0 or meas <= 0:
            return False
        row = (time.time(), device_fingerprint(train_spec.device)["id"], model_fingerprint(model_spec),
               settings_key(train_spec), train_spec.device, est, meas, meas / est,
               json.dumps(dict(details or {}, model=model_spec.name, params=int(model_spec.total_params),
                               layers=model_spec.num_layers, batch_size=train_spec.batch_size,
                               seq_length=train_spec.seq_length, grad_accum=train_spec.grad_accum), default=str))
    except Exception as exc:
        logger.warning("memguard calibration: cannot record this run: %s", exc)
        return False

    first = not _store_exists()

    def ins(con):
        if first:   # said once, where a user looks: guarded runs write to the user's data directory
            logger.info("memguard calibration: recording estimated vs measured peaks in %s (memguard calibration "
                        "show | reset; MEMGUARD_CALIBRATION=0 turns it off)", db_path(create=False))
        con.execute("INSERT INTO runs (created, device_fp, model_fp, settings, counter, estimated_bytes, "
                    "measured_bytes, ratio, details) VALUES (?,?,?,?,?,?,?,?,?)", row)
        return True

    return bool(_retry(ins, "record"))


def record_preflight(preflight: Any, measured_bytes: Optional[int], *, micro_batches: Optional[int] = None) -> bool:
    """Record an adapter's run from its ``memguard_core.preflight.Preflight``: the planned settings
    (what ran) and their uncorrected estimate plus the resident memory preflight counted, against
    ``measured_bytes``. ``micro_batches``: the micro-batches per batch the run ended with; a run the guard split
    further than planned did not run the planned settings and is not recorded. Returns True when
    stored; never raises."""
    try:
        if preflight is None or not measured_bytes:
            return False
        if micro_batches is not None and int(micro_batches) != int(preflight.micro_batches):
            logger.debug("memguard calibration: not recorded (%s micro-batches at the end, %s planned)", micro_batches,
                         preflight.micro_batches)
            return False
        est = preflight.plan.estimate
        raw = int(est.phases.get(est.phase, est.peak_bytes)) + int(preflight.resident_extra_bytes or 0)
        return record(preflight.model_spec, preflight.plan.train_spec, raw, int(measured_bytes),
                      details=dict(correction=float(getattr(est, "correction", 1.0))))
    except Exception as exc:
        logger.warning("memguard calibration: cannot record this run: %s", exc)
        return False


@dataclass(frozen=True)
class Correction:
    """A calibration factor: ``factor`` multiplies the estimate (1.0: none); ``runs`` comparable
    runs were found (the factor applies only when ``runs >= MIN_RUNS``)."""

    factor: float = 1.0
    runs: int = 0

    @property
    def applied(self) -> bool:
        return self.factor != 1.0


def correction_for(model_spec: Any, train_spec: Any, *, min_runs: int = MIN_RUNS) -> Correction:
    """The median ``measured / estimated`` of the latest ``WINDOW`` comparable runs, when at least
    ``min_runs`` exist (else factor 1.0). Never raises (a failing store gives 1.0)."""
    try:
        key = (device_fingerprint(train_spec.device)["id"], model_fingerprint(model_spec), settings_key(train_spec))
    except Exception as exc:
        logger.warning("memguard calibration: no correction (%s)", exc)
        return Correction()

    def q(con):
        return [r[0] for r in con.execute(
            "SELECT ratio FROM runs WHERE device_fp=? AND model_fp=? AND settings=? ORDER BY id DESC LIMIT ?",
            key + (WINDOW,))]

    ratios = _retry(q, "lookup") or []
    if len(ratios) < min_runs:
        return Correction(1.0, len(ratios))
    f = float(statistics.median(ratios))
    if not (1 / MAX_FACTOR <= f <= MAX_FACTOR):
        logger.warning("memguard calibration: median ratio %.2f of %d runs looks broken; not applied", f, len(ratios))
        return Correction(1.0, len(ratios))
    return Correction(f, len(ratios))


def show() -> List[Dict[str, Any]]:
    """One dict per (device, model, settings) group: ``runs``, ``median_ratio``, ``last`` (time),
    ``model``, ``params``, ``layers`` (the model's size; None for runs recorded before they were kept),
    ``batch_size``, ``seq_length`` (the last run's), ``settings``, ``counter``, ``applies`` (>= MIN_RUNS). Empty on failure and when no
    store exists (nothing is created then)."""
    if not _store_exists():
        return []

    def q(con):
        groups: Dict[tuple, Dict[str, Any]] = {}
        for r in con.execute("SELECT device_fp, model_fp, settings, counter, ratio, created, details FROM runs "
                             "ORDER BY id DESC"):
            d = json.loads(r[6] or "{}")
            g = groups.setdefault(r[:3], dict(device=r[0], model_fp=r[1], settings=json.loads(r[2]), counter=r[3],
                                              ratios=[], last=r[5], model=d.get("model"), params=d.get("params"),
                                              layers=d.get("layers"), batch_size=d.get("batch_size"),
                                              seq_length=d.get("seq_length")))
            if len(g["ratios"]) < WINDOW:
                g["ratios"].append(r[4])
        out = []
        for g in groups.values():
            rs = g.pop("ratios")
            out.append(dict(g, runs=len(rs), median_ratio=statistics.median(rs), applies=len(rs) >= MIN_RUNS))
        return out

    return _retry(q, "show") or []


def reset() -> int:
    """Delete every recorded run; returns how many were deleted (0 on failure, and when no store
    exists: nothing is created then)."""
    if not _store_exists():
        return 0

    def d(con):
        n = con.execute("SELECT count(*) FROM runs").fetchone()[0]
        con.execute("DELETE FROM runs")
        return int(n)

    return _retry(d, "reset") or 0


def main(argv: Optional[List[str]] = None) -> int:
    """``memguard calibration show|reset`` (``python -m memguard_core.calibration show``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="memguard calibration")
    ap.add_argument("action", choices=("show", "reset"))
    ap.add_argument("--json", action="store_true", help="show: one JSON list")
    a = ap.parse_args(argv)
    try:
        path = db_path(create=False)  # show / reset read: a missing store stays missing
    except ConfigError as exc:
        print(f"memguard calibration: error: invalid {exc.field}: expected {exc.expected}, got {exc.got!r}",
              file=sys.stderr)
        return 2
    if a.action == "reset":
        if not os.path.isfile(path):
            print(f"no calibration store at {path}: nothing to delete")
            return 0
        print(f"deleted {reset()} recorded runs from {path}")
        return 0
    rows = show()
    if a.json:
        print(json.dumps(rows, default=str))
        return 0
    if not rows:
        where = path if os.path.isfile(path) else f"{path} (not created yet)"
        print(f"the calibration store is empty: {where}; guarded runs record their measured peaks there "
              f"(a correction applies after {MIN_RUNS} comparable runs)")
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"memguard calibration ({path})")
    for c in ("model", "size", "settings", "counter", "runs", "measured / estimated", "applies"):
        t.add_column(c)
    for r in rows:
        s = r["settings"]
        size = (f"{r['params'] / 1e6:,.1f}M params, {r['layers']} layers" if r.get("params") else "-")
        if r.get("batch_size"):
            size += f"; last {r['batch_size']} x {r['seq_length']} tokens"
        t.add_row(str(r.get("model")), size, f"{s['method']} {s['optimizer']} {s['dtype']}{' ckpt' if s['ckpt'] else ''} "
                  f"{s['framework']}", r["counter"], str(r["runs"]), f"{r['median_ratio']:.3f}",
                  "yes" if r["applies"] else f"after {MIN_RUNS} runs")
    Console(highlight=False).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
