"""What a bench child reads and records besides the framework's own counters: the process's peak
resident set (Linux ``VmHWM``, else ``ru_maxrss``) and records made JSON-safe. docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

__all__ = ["peak_rss_bytes", "json_safe"]


def _status_kib(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes: VmHWM on Linux; ``ru_maxrss`` elsewhere (KiB on
    Linux, bytes on macOS)."""
    v = _status_kib("VmHWM")
    if v:
        return v * 1024
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def json_safe(d: Any) -> Any:
    """``d`` as JSON can hold it (dtypes and other objects as their ``str``)."""
    return json.loads(json.dumps(d, default=str))
