"""Memory-pressure episodes of the runtime monitor, pure: when sustained pressure (Linux PSI, macOS
memorystatus, the CUDA caching allocator's retries) acts, first a clean, later a split. The policy
that turns an episode's action into an event is :class:`memguard_core.monitor_policy.MicroBatchPolicy`;
the rules and their sources are in docs/monitor.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .errors import ConfigError, require_fraction, require_int, require_number

__all__ = ["PsiPolicy", "MemorystatusPolicy", "AllocRetryPolicy", "PressureEpisodes", "AllocRetryEpisodes",
           "MemorystatusEpisodes"]


@dataclass(frozen=True)
class PsiPolicy:
    """When sustained memory pressure (PSI ``some avg10``, percent) triggers an action.

    An *episode* starts when a background sample's pressure is >= ``threshold`` and ends when it
    falls below ``threshold x release`` (hysteresis). Within an episode the monitor acts when the
    samples since the episode start (or since its last action) span >= ``sustain_s`` seconds,
    number >= ``min_samples``, and the newest pressure is higher than the oldest (rising). The
    first action of an episode is ``clean``; each later one is ``split`` (k doubled). A falling
    or flat window is not acted on: the kernel is recovering on its own.

    Defaults: ``threshold`` 10 % is where the kernel documentation's example trigger for memory
    pressure (``some 150000 1000000`` = 150 ms of stall per 1 s window, i.e. 15 %) and systemd-oomd's
    default ``DefaultMemoryPressureLimit=60%`` bracket "pressure that costs throughput"; we warn
    earlier than oomd acts. ``sustain_s`` 3 s = several 0.5 s samples, shorter than the 10 s
    ``avg10`` window so a rising average is still news.

    Raises:
        ConfigError: ``threshold`` outside (0, 100], ``sustain_s`` < 0, ``min_samples`` < 1,
            ``release`` outside (0, 1].
    """

    threshold: float = 10.0
    sustain_s: float = 3.0
    min_samples: int = 3
    release: float = 0.5

    def __post_init__(self) -> None:
        require_number("psi.threshold", self.threshold, "a percentage in (0, 100]", lo=0.0, lo_open=True, hi=100.0)
        require_number("psi.sustain_s", self.sustain_s, "a number of seconds >= 0", lo=0.0)
        require_int("psi.min_samples", self.min_samples, "an integer >= 1")
        require_fraction("psi.release", self.release)


@dataclass(frozen=True)
class MemorystatusPolicy:
    """When macOS memory pressure triggers an action: the darwin pressure model (background samples
    of the host probe on macOS, and of MLX on Metal). Never fed PSI figures, nor PSI this one's.

    A reading is ``used`` = ``100 - kern.memorystatus_level`` (percent of memory in use), the
    kernel's own level (``kern.memorystatus_vm_pressure_level``: normal / warn / critical, when
    readable) and swap in use (``vm.swapusage``, bytes; its rise per second is the swap activity).
    Its severity is the highest of:

    * **critical**: the kernel says critical, or ``used >= critical`` (95 %, i.e. at most 5 % of
      memory quickly reclaimable: xnu's jetsam ``critical_threshold_percentage`` = 5,
      bsd/kern/kern_memorystatus.c);
    * **warn**: the kernel says warn, or ``used >= warn`` (85 %: ``pressure_threshold_percentage``
      = 15, where memorystatus starts warning and kills processes over their soft limits; xnu
      doc/memorystatus/overview.md: "under 15% available pages"), or swap in use rising by at
      least ``swap_bytes_per_s`` (the compressor swaps to disk only past its swap threshold, 0.4
      x available memory on macOS, between the kernel's warning and critical levels: xnu
      doc/vm/memorystatus_notify.md);
    * else normal. (Activity Monitor's memory pressure graph combines the same inputs: free
      memory, swap rate, wired and file cache.)

    An *episode* opens at a warn or critical reading and closes at a normal one below ``release``
    (80 %; the kernel's level is normal or unread and swap is not rising): hysteresis, as the
    kernel's own falling thresholds are 1.2-1.4x its rising ones. Within it, readings spanning
    ``sustain_s`` (at least ``min_samples``) whose newest is warn or critical *and* not easing
    (``used`` rose over the window, swap is rising, or the level is critical) act: the first
    action cleans, each later one splits; every action needs a new window. 55-65 % in use, the
    everyday state of a Mac with a few apps open, never opens an episode.

    Raises:
        ConfigError: not ``0 < release <= warn < critical <= 100``, ``swap_bytes_per_s`` <= 0,
            ``sustain_s`` < 0 or ``min_samples`` < 1 (the error names ``memorystatus.<field>``).
    """

    warn: float = 85.0
    critical: float = 95.0
    release: float = 80.0
    swap_bytes_per_s: float = float(4 << 20)
    sustain_s: float = 3.0
    min_samples: int = 3

    def __post_init__(self) -> None:
        for name in ("warn", "critical", "release", "swap_bytes_per_s", "sustain_s"):
            require_number(f"memorystatus.{name}", getattr(self, name), "a finite number")
        if not (0.0 < self.release <= self.warn < self.critical <= 100.0):
            raise ConfigError("memorystatus", "0 < release <= warn < critical <= 100",
                              (self.release, self.warn, self.critical))
        if self.swap_bytes_per_s <= 0:
            raise ConfigError("memorystatus.swap_bytes_per_s", "a rate > 0 (bytes/s)", self.swap_bytes_per_s)
        if self.sustain_s < 0:
            raise ConfigError("memorystatus.sustain_s", "a number of seconds >= 0", self.sustain_s)
        require_int("memorystatus.min_samples", self.min_samples, "an integer >= 1")


@dataclass(frozen=True)
class AllocRetryPolicy:
    """When the CUDA caching allocator's retries trigger an action (step samples on a CUDA device).

    ``num_alloc_retries`` (``torch.cuda.memory_stats``) counts the allocations whose
    ``cudaMalloc`` failed, after which the allocator freed every cached block and retried: the
    run is at the edge of the device's memory, every retry synchronises the device and costs
    time, and an out-of-memory error is the next failure that no cached block can absorb. An
    optimizer step *retried* when the count rose over it (read once per optimizer step, at the
    first batch boundary after it). ``steps`` (2) retried steps in a row act: the first action of
    an episode cleans (the device cache and Python's garbage), each later one splits (k doubled);
    every action needs a new run of ``steps`` retried steps. A step whose ``num_ooms`` rose is not
    counted and restarts the run (the out-of-memory handling split already). The episode closes
    after ``release_steps`` (4) steps in a row without a retry.

    The rule is Composer's auto-microbatching (composer/trainer/trainer.py,
    ``_update_num_consecutive_thrashes`` and ``Trainer._train_batch``: a batch "thrashes" when
    ``num_alloc_retries`` rose during it; at ``num_consecutive_thrashes >= 2`` the micro-batch size
    is lowered as after an OOM and the count restarts; a batch that hit an OOM is not counted).
    One retried step alone is not acted on: a first step, an evaluation or a long sequence can
    retry once and never again.

    Raises:
        ConfigError: ``steps`` or ``release_steps`` not an integer >= 1 (the error names
            ``alloc_retries.<field>``).
    """

    steps: int = 2
    release_steps: int = 4

    def __post_init__(self) -> None:
        require_int("alloc_retries.steps", self.steps, "an integer >= 1")
        require_int("alloc_retries.release_steps", self.release_steps, "an integer >= 1")


class PressureEpisodes:
    """PSI episodes of one run (:class:`PsiPolicy`), from readings fed in time order.

    ``window`` holds ``(monotonic s, pressure %)`` since the episode started or since its last
    action; it is empty while no episode is open. Not thread-safe by itself: :class:`MicroBatchPolicy`
    feeds it under its lock.
    """

    def __init__(self, policy: PsiPolicy):
        self.policy = policy
        self.window: List[Tuple[float, float]] = []
        self.actions = 0          # actions taken in the open episode

    @property
    def open(self) -> bool:
        """True while an episode is open (pressure went >= threshold and has not fallen below
        ``threshold x release`` since)."""
        return bool(self.window)

    def feed(self, pressure: float, now: float, act: bool = True) -> Optional[Tuple[int, str]]:
        """Feed one reading (percent) taken at ``now`` (monotonic s).

        Returns ``(n, description)`` when the episode calls for its n-th action (n = 1: the first,
        a clean; later ones split): pressure sustained over ``sustain_s`` with ``min_samples``
        readings and rising; the next action then needs a new window. Else None. With
        ``act=False`` the reading only extends or ends the episode.
        """
        pol, win = self.policy, self.window
        if not win:
            if pressure >= pol.threshold:
                win.append((now, pressure))
            return None
        if pressure < pol.threshold * pol.release:
            win.clear()                      # the episode is over
            self.actions = 0
            return None
        win.append((now, pressure))
        (t0, p0), (t1, p1) = win[0], win[-1]
        span = t1 - t0
        if not (act and len(win) >= pol.min_samples and span >= pol.sustain_s and p1 > p0):
            return None
        self.actions += 1
        win[:] = [(t1, p1)]                  # the next action needs a new sustained window
        return self.actions, (f"memory pressure: PSI some avg10 {p1:.1f}% (>= {pol.threshold:g}% for "
                              f"{span:.1f} s, rising from {p0:.1f}%)")


class AllocRetryEpisodes:
    """Allocator-retry episodes of one run (:class:`AllocRetryPolicy`), from the cumulative
    ``num_alloc_retries`` / ``num_ooms`` counts read once per optimizer step, in order. Not
    thread-safe by itself (fed under :class:`MicroBatchPolicy`'s lock)."""

    def __init__(self, policy: AllocRetryPolicy):
        self.policy = policy
        self.last: Optional[Tuple[int, Optional[int]]] = None   # (retries, ooms) at the last reading
        self.streak = 0           # retried steps in a row since the episode's last action
        self.calm = 0             # steps in a row without a retry
        self.actions = 0          # actions taken in the open episode
        self.retries_in_streak = 0

    @property
    def open(self) -> bool:
        """True while an episode is open: a retried step since the last ``release_steps`` calm ones."""
        return self.streak > 0 or self.actions > 0

    def feed(self, retries: int, ooms: Optional[int], act: bool = True) -> Optional[Tuple[int, str]]:
        """Feed one optimizer step's counts (cumulative, as the allocator reports them). Returns
        ``(n, description)`` when the episode calls for its n-th action (n = 1 cleans, later ones
        split), else None. The first reading is the baseline; a count that fell (the stats were
        reset) is a new baseline. With ``act=False`` the step is counted but nothing is decided."""
        pol, last = self.policy, self.last
        self.last = (retries, ooms)
        if last is None or retries < last[0]:
            self.streak, self.retries_in_streak = 0, 0   # what the step did is unknown
            return None
        rose = retries - last[0]
        if ooms is not None and last[1] is not None and ooms > last[1]:
            # an out-of-memory error in this step: its handling split already (Composer does not
            # count a batch that hit one either)
            self.streak, self.retries_in_streak, self.calm = 0, 0, 0
            return None
        if rose <= 0:
            self.calm += 1
            self.streak, self.retries_in_streak = 0, 0
            if self.calm >= pol.release_steps:
                self.actions = 0          # the episode is over
            return None
        self.calm = 0
        self.streak += 1
        self.retries_in_streak += rose
        if not act or self.streak < pol.steps:
            return None
        n, total = self.streak, self.retries_in_streak
        self.streak, self.retries_in_streak = 0, 0   # the next action needs a new run
        self.actions += 1
        return self.actions, (f"CUDA allocator retries: num_alloc_retries rose in {n} optimizer steps in a row "
                              f"(+{total}, {retries} in all; the caching allocator freed its cache and retried "
                              f"a cudaMalloc: the step before an out-of-memory error)")


_SEVERITY = ("normal", "warn", "critical")
_KERNEL_SEVERITY = {"normal": 0, "warn": 1, "critical": 2}


class MemorystatusEpisodes:
    """macOS pressure episodes of one run (:class:`MemorystatusPolicy`), from readings fed in time
    order. ``window`` holds ``(monotonic s, used %, severity)`` since the episode started or since
    its last action; empty while no episode is open. Not thread-safe by itself (fed under
    :class:`MicroBatchPolicy`'s lock)."""

    def __init__(self, policy: MemorystatusPolicy):
        self.policy = policy
        self.window: List[Tuple[float, float, int]] = []
        self.actions = 0
        self._swap: Optional[Tuple[float, int]] = None   # (monotonic s, swap used bytes) last read
        self.swap_rate: Optional[float] = None            # bytes/s between the last two readings

    @property
    def open(self) -> bool:
        """True while an episode is open."""
        return bool(self.window)

    def severity(self, used: Optional[float], kernel: Optional[str], swap_rate: Optional[float]) -> int:
        """0 normal, 1 warn, 2 critical (see :class:`MemorystatusPolicy`)."""
        pol = self.policy
        sev = _KERNEL_SEVERITY.get(kernel, 0) if kernel is not None else 0
        if used is not None:
            if used >= pol.critical:
                sev = 2
            elif used >= pol.warn:
                sev = max(sev, 1)
        if swap_rate is not None and swap_rate >= pol.swap_bytes_per_s:
            sev = max(sev, 1)
        return sev

    def feed(self, used: Optional[float], now: float, *, kernel: Optional[str] = None,
             swap_used: Optional[int] = None, act: bool = True) -> Optional[Tuple[int, str]]:
        """Feed one reading: ``used`` percent in use (None: unread), ``kernel`` the kernel's level
        name, ``swap_used`` bytes, taken at ``now`` (monotonic s). Returns ``(n, description)``
        when the episode calls for its n-th action (n = 1 cleans, later ones split), else None."""
        pol, win = self.policy, self.window
        rate = None
        if swap_used is not None:
            last = self._swap
            if last is not None and now > last[0]:
                rate = max(0.0, (swap_used - last[1]) / (now - last[0]))
            self._swap = (now, int(swap_used))
        self.swap_rate = rate
        sev = self.severity(used, kernel, rate)
        u = 0.0 if used is None else float(used)
        if not win:
            if sev >= 1:
                win.append((now, u, sev))
            return None
        if sev == 0 and u < pol.release:
            win.clear()                  # the episode is over
            self.actions = 0
            return None
        win.append((now, u, sev))
        t0, u0, _ = win[0]
        span = now - t0
        swapping = rate is not None and rate >= pol.swap_bytes_per_s
        pressing = sev >= 1 and (u > u0 or swapping or sev == 2)
        if not (act and pressing and len(win) >= pol.min_samples and span >= pol.sustain_s):
            return None
        self.actions += 1
        win[:] = [(now, u, sev)]
        parts = [f"{u:.0f}% in use (memorystatus level {100 - u:.0f}%)"]
        if kernel is not None:
            parts.append(f"kernel level {kernel}")
        if rate is not None:
            parts.append(f"swap {'+' if rate > 0 else ''}{rate / 2**20:.1f} MiB/s")
        return self.actions, (f"memory pressure (macOS {_SEVERITY[sev]}): {', '.join(parts)}, for "
                              f"{span:.1f} s (from {u0:.0f}% in use)")
