"""/proc/self/smaps for the preflight: how many of given address ranges' bytes are resident
(kernel Documentation/filesystems/proc.rst, "/proc/<pid>/smaps"). The preflight uses it to take
the model's own tensors out of the process's resident set at train start. docs/estimator.md,
"Runtime overhead".
"""

from __future__ import annotations

import os
from typing import Iterable, List, Optional, Tuple

from .files import read_text

__all__ = ["parse_smaps", "resident_bytes_in"]

Mapping = Tuple[int, int, int]   # (start, end, resident bytes), addresses in bytes


def parse_smaps(text: str) -> List[Mapping]:
    """``(start, end, Rss)`` of every mapping in a /proc/<pid>/smaps text, in file order (the
    kernel lists mappings by address); Rss in bytes (the file's ``kB`` is KiB). A mapping whose
    ``Rss:`` line is missing or garbled counts 0."""
    out: List[Mapping] = []
    start = end = None
    rss = 0
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            a, _, b = head.partition("-")
            try:
                s, e = int(a, 16), int(b, 16)
            except ValueError:
                continue
            if start is not None:
                out.append((start, end, rss))
            start, end, rss = s, e, 0
        elif head == "Rss:" and start is not None:
            try:
                rss = int(rest.split()[0]) * 1024
            except (ValueError, IndexError):
                rss = 0
    if start is not None:
        out.append((start, end, rss))
    return out


def resident_bytes_in(ranges: Iterable[Tuple[int, int]], *, proc_root: str = "/proc",
                      text: Optional[str] = None) -> Optional[int]:
    """Resident bytes of the address ranges ``(start, nbytes)`` (non-overlapping: distinct tensor
    storages), read per mapping from /proc/self/smaps: for each mapping, the ranges' bytes inside
    it, capped at the mapping's ``Rss``. Exact for a range that is a whole mapping (an mmapped
    storage, a memory-mapped checkpoint file); for ranges sharing a mapping with other data (the
    glibc heap) it assumes the ranges are resident first, which holds for written tensors.

    Args:
        ranges: ``(address, nbytes)`` pairs, bytes.
        text: the smaps text (tests); default read from ``proc_root``.

    Returns:
        Bytes, or None when smaps cannot be read. Never raises on file contents.
    """
    if text is None:
        text = read_text(os.path.join(proc_root, "self", "smaps"))
        if text is None:
            return None
    maps = parse_smaps(text)
    spans = sorted((int(a), int(a) + int(n)) for a, n in ranges if n > 0)
    total, i = 0, 0
    for start, end, rss in maps:
        inside = 0
        while i < len(spans) and spans[i][1] <= start:
            i += 1
        j = i
        while j < len(spans) and spans[j][0] < end:
            inside += min(end, spans[j][1]) - max(start, spans[j][0])
            j += 1
        total += min(inside, rss)
    return total
