"""Measuring one bench case: the parent starts a fresh interpreter for it (``python -m memguard_bench
--child``, glibc's defaults restored) and reads back the child's record. docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

from .provenance import repo_root, today

__all__ = ["run_case", "libc_loader", "LibcDirError"]


class LibcDirError(ValueError):
    """``--libc DIR`` does not hold a glibc loader and ``libc.so.6``."""


def libc_loader(libc_dir: str) -> str:
    """The dynamic loader of the glibc in ``libc_dir`` (a distribution's ``libc6`` package unpacked
    with ``dpkg-deb -x``: its ``lib/x86_64-linux-gnu`` or ``usr/lib/x86_64-linux-gnu``), x86-64 only.

    Raises:
        LibcDirError: ``libc_dir`` has no ``ld-linux-x86-64.so.2`` and ``libc.so.6``.
    """
    loader = os.path.join(libc_dir, "ld-linux-x86-64.so.2")
    if not (os.path.isfile(loader) and os.path.isfile(os.path.join(libc_dir, "libc.so.6"))):
        raise LibcDirError(f"--libc: {libc_dir!r} holds no ld-linux-x86-64.so.2 and libc.so.6 (expected the "
                           "lib/x86_64-linux-gnu folder of an unpacked libc6 package)")
    return loader


def run_case(case: dict, timeout_s: float = 600.0, libc_dir: Optional[str] = None) -> dict:
    """Run one case in a fresh interpreter (killed after ``timeout_s`` seconds); returns the child's
    record (``peak_bytes`` and the model facts, dated; ``glibc``: the C library it ran with), or
    ``{"error": ..., "date": ...}``. ``libc_dir``: run the child under that glibc instead of this
    machine's (:func:`libc_loader`; the interpreter, its packages and the other libraries unchanged),
    to measure how another release's heap behaves (docs/benchmarks.md, "The CPU heap by C library
    version").

    Raises:
        LibcDirError: as :func:`libc_loader`.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root() + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # measure glibc's defaults, which the model assumes
    cmd = [sys.executable, "-m", "memguard_bench", "--child", json.dumps(case)]
    if libc_dir:
        # through the other loader the interpreter is the real binary, not the virtualenv's link:
        # its packages come in through PYTHONPATH
        cmd = [libc_loader(libc_dir), "--library-path", libc_dir, os.path.realpath(sys.executable)] + cmd[1:]
        env["PYTHONPATH"] = os.pathsep.join([repo_root()] + [p for p in sys.path if p.endswith("-packages")])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=repo_root(), env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s", "date": today()}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"error": f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}", "date": today()}
    rec = json.loads(line[-1][7:])
    rec.setdefault("date", today())  # the day it was measured (UTC): --reuse keeps it
    return rec
