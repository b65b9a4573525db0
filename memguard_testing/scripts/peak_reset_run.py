"""A guarded run on the CPU whose peak is known: one large block held in one step (or before the
guard starts), then smaller steps. The core ``Guard`` is driven as an adapter drives it (a batch
boundary, then the optimizer step's end). Prints one JSON line: the RSS while the block was held,
``ru_maxrss`` in the middle of the run and after it, VmHWM after it, the run summary, the resets
done and whether the largest step peak is exact (``StepSampler.peaks_exact``).
tests/test_peak_reset.py; docs/monitor.md, "The process's own peak".

usage: python peak_reset_run.py on|off during|before|limited LOG_DIR

``limited``: as ``during``, under an ``RLIMIT_AS`` that leaves room for the block but not for
raising VmHWM back at the end (the guard must then leave it and say so). The guard's lines go to
stderr.
"""

import json
import logging
import resource
import sys

from memguard_core.guard import Guard
from memguard_core.options import GuardOptions
from memguard_core.probes.linux import peak
from memguard_core.probes.linux.proc import read_status

MiB = 1 << 20
BIG, SMALL, STEPS = 384 * MiB, 32 * MiB, 5


def rss() -> int:
    return read_status(keys=frozenset(("VmRSS",)))["VmRSS"]


def ru_maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # KiB on Linux


def hold(size: int) -> int:
    """Allocate ``size`` bytes, write every page, return the RSS while they are held; freed on
    return (a block this large is its own mmap in glibc: freeing it unmaps it)."""
    block = bytearray(size)
    block[::4096] = b"\x01" * len(range(0, size, 4096))
    held = rss()
    del block
    return held


def main() -> None:
    reset, where, log_dir = sys.argv[1] == "on", sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if where == "limited":
        size = read_status(keys=frozenset(("VmSize",)))["VmSize"]
        resource.setrlimit(resource.RLIMIT_AS, (size + BIG + 128 * MiB, resource.RLIM_INFINITY))
        where = "during"
    held = hold(BIG) if where == "before" else None
    guard = Guard(GuardOptions.from_kwargs(budget_bytes=64 * 2**30, monitor_interval_s=0, preflight=False,
                                           leak_detector=False, trim_heap=False, device="cpu",
                                           reset_peak_rss=reset, log_dir=log_dir))
    guard.start(rows=1)
    ru_mid = None
    for step in range(STEPS):
        guard.micro_batches_for_step(step)
        h = hold(BIG if step == 0 and where == "during" else SMALL)
        held = held if step else max(held or 0, h)
        guard.end_step(step + 1)
        if step == STEPS - 2:
            ru_mid = ru_maxrss()
    summary = guard.finish(STEPS)
    print("RESULT " + json.dumps({"held": held, "ru_mid": ru_mid, "ru_after": ru_maxrss(),
                                  "hwm_after": read_status(keys=frozenset(("VmHWM",)))["VmHWM"],
                                  "summary": summary, "resets": peak.resets_done(),
                                  "exact": guard.monitor.sampler.peaks_exact}))


if __name__ == "__main__":
    main()
