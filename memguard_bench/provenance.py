"""Where and when a bench result comes from: the checkout's root, today's date, the machine and
software fingerprint (with the commit of the estimator scored), the machine line of a report
re-scored with ``--reuse``, and the dates git history gives saved records. docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from typing import Dict, Optional

__all__ = ["MACHINE_KEYS", "repo_root", "today", "machine_fingerprint", "reported_fingerprint",
           "git_measured_dates"]

#: The fingerprint fields that name the machine (not the software) a measurement ran on.
MACHINE_KEYS = ("os", "machine", "cpu", "cores", "memory_total_gib")


def repo_root() -> str:
    """The directory holding ``memguard_bench`` (the checkout's root in a checkout)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def today() -> str:
    """Today's date (UTC), ``YYYY-MM-DD``."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def reported_fingerprint(here: dict, saved: Optional[dict], fresh: int) -> dict:
    """The machine line of a report re-scored with ``--reuse``: ``here`` is this machine's
    :func:`machine_fingerprint`, ``saved`` the reused file's, ``fresh`` how many cases ran here.

    Every measurement reused (``fresh`` 0): the reused file's machine and versions, with this
    checkout's ``memguard_commit`` (the estimator scored) and the commit the file was measured at as
    ``measured_at_commit`` where they differ. Some cases run here on another machine: this machine,
    with ``reused_measurements_from`` naming the other one. Otherwise ``here`` as it is."""
    if not saved:
        return here
    if fresh == 0:
        out = {**saved, "memguard_commit": here.get("memguard_commit")}
        if saved.get("memguard_commit") and saved.get("memguard_commit") != here.get("memguard_commit"):
            out["measured_at_commit"] = saved["memguard_commit"]
        return out
    if any(saved.get(k) != here.get(k) for k in MACHINE_KEYS):
        return {**here, "reused_measurements_from": " / ".join(str(saved.get(k)) for k in MACHINE_KEYS)}
    return here


def _git_commit(root: str) -> Optional[str]:
    """The short commit of the tree at ``root`` (the estimator scored), marked when memguard's
    packages have uncommitted changes; None outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=30)
        if rev.returncode == 0 and rev.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "memguard_core", "memguard_mlx",
                                    "memguard_hf"], cwd=root, capture_output=True, text=True, timeout=30)
            return rev.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except Exception:
        pass
    return None


def machine_fingerprint() -> dict:
    """What the results depend on: OS, CPU, cores, memory, the C library's release, Python and
    framework versions."""
    from memguard_core.calibration import cpu_model

    fp = dict(os=f"{platform.system()} {platform.release()}", machine=platform.machine(),
              cpu=cpu_model(), cores=os.cpu_count(), python=platform.python_version())
    try:
        from memguard_core.probes import probe

        snap = probe()
        fp["memory_total_gib"] = round(snap.total_bytes / 2**30, 1)
    except Exception:
        pass
    from importlib import metadata

    from memguard_core.probes import glibc_version

    libc = glibc_version()   # the CPU heap's release (docs/estimator.md, "CPU heap slack by glibc release")
    if libc:
        fp["glibc"] = libc
    commit = _git_commit(repo_root())
    if commit:
        fp["memguard_commit"] = commit
    for pkg in ("memguard-train", "torch", "transformers", "peft", "accelerate", "mlx", "mlx-lm", "ml-memguard"):
        try:
            fp[pkg] = metadata.version(pkg)
        except Exception:
            pass
    return fp


def git_measured_dates(path: str, peaks: Dict[str, int]) -> Dict[str, str]:
    """For saved records without a ``date`` (made before records carried one): the date of the
    oldest commit of ``path`` from which on the record's ``peak_bytes`` is unchanged, i.e. when it
    was measured (a ``--reuse`` re-score commits the same peaks again and does not move it).
    ``peaks``: name -> peak_bytes as in the file now. Empty outside git."""
    cwd, base = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        p = subprocess.run(["git", "log", "--format=%H %cs", "--", base], cwd=cwd, capture_output=True,
                           text=True, timeout=60)
        commits = [ln.split() for ln in p.stdout.splitlines() if ln.strip()] if p.returncode == 0 else []
    except Exception:
        return {}
    dates: Dict[str, str] = {}
    pending = dict(peaks)
    for sha, day in commits:  # newest first
        try:
            q = subprocess.run(["git", "show", f"{sha}:./{base}"], cwd=cwd, capture_output=True, text=True,
                               timeout=60)
            old = {r.get("name"): (r.get("measured") or {}).get("peak_bytes")
                   for r in json.loads(q.stdout).get("cases", [])}
        except Exception:
            break
        for name in list(pending):
            if old.get(name) == pending[name]:
                dates[name] = day
            else:
                del pending[name]
        if not pending:
            break
    return dates
