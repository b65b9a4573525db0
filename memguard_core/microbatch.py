"""The framework-free arithmetic of micro-batches: cutting units (rows, sequences) into ranges of
near-equal weight, merging ranges without valid labels into a neighbour, raising the micro-batches
after an out-of-memory error, and freeing what a failed step left. The torch batch splitter built on
it is ``memguard_torch.microbatch``; the design story is docs/lifecycle.md.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import frameworks

__all__ = ["split_count", "merge_empty", "split_after_oom", "without_frames", "free_caches", "free_after_oom"]


def split_count(weights: Sequence[int], k: int) -> List[Tuple[int, int]]:
    """Cut ``len(weights)`` items into at most ``k`` contiguous ranges of near-equal total weight.

    Each cut is placed at the item boundary whose prefix sum is nearest to ``i * total / k``.
    Returns ``[(start, stop), ...]`` covering ``range(len(weights))`` in order, no range empty.
    """
    n = len(weights)
    k = max(1, min(k, n))
    w = list(weights) if sum(weights) > 0 else [1] * n
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    total = prefix[-1]
    bounds = [0]
    for i in range(1, k):
        target = total * i / k
        lo = bounds[-1] + 1
        hi = n - (k - i)  # leave at least one item for each remaining range
        if lo > hi:
            break
        best = min(range(lo, hi + 1), key=lambda j: (abs(prefix[j] - target), -j))
        bounds.append(best)
    bounds.append(n)
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def merge_empty(ranges: List[Tuple[int, int]], valid: List[int]) -> Tuple[List[Tuple[int, int]], List[int]]:
    """Merge ranges with no valid label into a neighbour (previous, else next)."""
    if all(v == 0 for v in valid):
        return [(ranges[0][0], ranges[-1][1])], [0]
    out_r: List[List[int]] = []
    out_v: List[int] = []
    pending_start: Optional[int] = None
    for (a, b), v in zip(ranges, valid):
        if v == 0:
            if out_r:
                out_r[-1][1] = b
            elif pending_start is None:
                pending_start = a
            continue
        if pending_start is not None:
            a, pending_start = pending_start, None
        out_r.append([a, b])
        out_v.append(v)
    return [tuple(r) for r in out_r], out_v


def free_caches() -> None:
    """``gc.collect()``, then every registered framework's cache cleaner
    (:func:`memguard_core.frameworks.clean_caches`: ``torch.cuda.empty_cache()`` where CUDA is
    initialised, ``torch.mps.empty_cache()`` where MPS is in use, ``mx.clear_cache()``). Never raises:
    what an out-of-memory forward left goes back before the retry."""
    gc.collect()
    frameworks.clean_caches()


def split_after_oom(monitor: Any, exc: BaseException, k: int, units_left: int, step: Optional[int],
                    log: Any, free: Callable[[], None] = None) -> int:
    """After an out-of-memory forward on a chunk of a k-way split: ask ``monitor`` for a doubled k
    (at most ``units_left``, the rows or sequences not yet processed), free what the failed forward
    left (``free``: default :func:`free_caches`; MLX passes its own) and return the k to redo
    those units with (the monitor's, if it is larger).

    Raises:
        ``exc`` itself: when a single unit already failed (``units_left <= 1`` or ``k >=
        units_left``), as no split can help; logged on ``log`` first.
    """
    if units_left <= 1 or k >= units_left:
        log.error("memguard: out of memory on a chunk of a single row/sequence; cannot split further (%s)", exc)
        raise exc
    new_k = min(max(2, k * 2), units_left)
    monitor.request_micro_batches(new_k, f"out of memory in a forward ({type(exc).__name__}); redoing the "
                          f"{units_left} rows not yet processed in smaller chunks", step)
    (free or free_caches)()
    return max(new_k, monitor.micro_batches)


def without_frames(exc: BaseException) -> BaseException:
    """``exc`` with its traceback and chained errors dropped, returned: the traceback's frames hold
    the failed step's outputs, loss and autograd graph, and a free while they live hands nothing
    back. The type and message, all a retry or a final error needs, stay."""
    exc.__traceback__ = None
    exc.__context__ = exc.__cause__ = None
    return exc


def free_after_oom() -> None:
    """Hand back what a failed step left once its references are dropped (never raises):
    ``gc.collect()`` (autograd graphs sit in reference cycles through the traceback's frames), the
    C heap's free pages (``malloc_trim`` on Linux: the CPU allocator's freed activations stay mapped
    and still count against an address-space limit), and the CUDA / MPS caching allocators' blocks."""
    free_caches()
    try:
        from .probes import trim_heap

        trim_heap()
    except Exception:  # pragma: no cover - trim_heap never raises; the import may
        pass
