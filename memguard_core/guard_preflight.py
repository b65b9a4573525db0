"""The preflight moment of a guarded run: read the run, plan it below the monitor's warning level,
turn checkpointing on where the plan asks, and record what changed -- or, when nothing fits, the
closest the in-place steps get. A mixin of :class:`memguard_core.guard.Guard` (it uses the guard's
``options``, ``log``, ``recorder``, ``preflight``, ``budget_bytes`` and ``split_disabled_reason``);
the rules: docs/lifecycle.md, "Preflight".
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .errors import ConfigError, DoesNotFitError
from .preflight import Preflight, default_budget, plan_in_place, resident_bytes_for

__all__ = ["PreflightMoment", "SpecReader"]

#: ``read_specs() -> (ModelSpec, TrainSpec)``: the adapter's reading of the run it guards.
SpecReader = Callable[[], Tuple[Any, Any]]


class PreflightMoment:
    """The preflight of :class:`memguard_core.guard.Guard` (see the module doc)."""

    preflight: Optional[Preflight] = None
    _nothing_fits_line: Optional[str] = None   # the preflight's decision when nothing fits
    _plan_budget: Optional[int] = None         # the budget plan() planned against, bytes
    _specs: Optional[Tuple[Any, Any]] = None   # (ModelSpec, TrainSpec) the last plan() read

    @property
    def preflight_decided(self) -> bool:
        """The preflight changed the run (or started it at the closest it could when nothing fit):
        a decision, as the monitor's are."""
        pf = self.preflight
        return self._nothing_fits_line is not None or (pf is not None and bool(pf.applied or pf.not_applied))

    def _record_start(self, k: int) -> None:
        """Open the run's records (event log, leak check, CUDA snapshots) and record the preflight's
        changes: one WARNING line and a ``preflight`` decision. Never raises."""
        try:
            from .probes import resolve_device

            self.recorder.start(resolve_device(self.options.device), self.budget_bytes)
            pf = self.preflight
            if self._nothing_fits_line is not None:   # _nothing_fits logged it at ERROR already
                self.recorder.decision("preflight", self._nothing_fits_line, step=0, warn=False, micro_batches=k)
            elif pf is not None and (pf.applied or pf.not_applied):
                done = sorted({c.reason for c in pf.applied})
                todo = sorted({c.reason for c in pf.not_applied})
                self.recorder.decision("preflight", "preflight changed the run: " + "; ".join(done)
                                       + (("; NOT applied (change it yourself): " + "; ".join(todo)) if todo else "")
                                       + f" (estimate {pf.requested_peak_bytes / 2**30:.2f} GiB -> "
                                       f"{pf.best_peak_bytes / 2**30:.2f} GiB, budget {pf.budget_bytes / 2**30:.2f} GiB)",
                                       step=0, micro_batches=k)
        except Exception:
            self.log.warning("memguard: could not open the run records", exc_info=True)

    def _run_preflight(self, read_specs: SpecReader, enable_checkpointing: Optional[Callable[[], None]],
                       rows: int, plan_hint: str) -> int:
        """The preflight moment: returns the micro-batches per batch it asks for (1: none)."""
        opts = self.options
        try:
            self.preflight = pf = self.plan(read_specs, enable_checkpointing)
        except DoesNotFitError as exc:
            if opts.fail_fast:
                raise
            return self._nothing_fits(exc, enable_checkpointing, rows)
        except ConfigError as exc:
            if opts.fail_fast:
                raise
            self.log.warning("memguard: preflight skipped: %s; the runtime guard still runs", exc)
            return 1
        except Exception:
            self.log.warning("memguard: preflight failed; the runtime guard still runs", exc_info=True)
            return 1
        for line in pf.report_lines():
            self.log.info("%s", line)
        if pf.micro_batches > 1 and self.split_disabled_reason is not None:
            ts = pf.plan.train_spec
            self.log.warning("memguard: the plan needs micro-batch %d x accumulation %d, which cannot be applied "
                             "in place here (%s)%s", ts.batch_size, ts.grad_accum,
                             self.split_disabled_reason.split(":")[0], plan_hint)
        if pf.not_applied and opts.fail_fast:
            raise DoesNotFitError(pf.shortfall_bytes, pf.budget_bytes, pf.best_peak_bytes,
                                  [c.reason for c in pf.not_applied])
        self.budget_bytes = pf.budget_bytes
        return pf.micro_batches

    def plan(self, read_specs: SpecReader, enable_checkpointing: Optional[Callable[[], None]] = None) -> Preflight:
        """Estimate the run ``read_specs()`` describes, plan it against the budget (the option, else
        the default budget of its device) below the monitor's warning level, with what this
        process already holds counted, and turn activation checkpointing on when the plan asks
        for it. Starts nothing; :meth:`start` calls it for its preflight.

        Raises:
            ConfigError: the run cannot be read or a setting is invalid.
            DoesNotFitError: nothing in the allowed search fits.
        """
        opts = self.options
        model_spec, train_spec = read_specs()
        # the estimate is of the run as guarded: with or without the step-end heap trim
        train_spec = train_spec.replace(heap_trim=bool(opts.trim_heap))
        self._specs = (model_spec, train_spec)   # read even when nothing fits (the mmap threshold needs them)
        budget = opts.budget_bytes
        if budget is None:
            budget = default_budget(train_spec.device if opts.device == "auto" else opts.device, opts.safety_ratio)
        self._plan_budget = int(budget)   # what a nothing-fits line names (the error has the target)
        apply = tuple(a for a in opts.apply if a != "grad_checkpoint" or enable_checkpointing is not None)
        # plan below the warning level: a run planned up to the budget would sit at the critical level
        # from its first step and be split further for nothing
        pf = plan_in_place(model_spec, train_spec, budget, apply=apply, plan_fraction=opts.thresholds.warning,
                           resident_bytes=resident_bytes_for(train_spec))
        if pf.checkpointing_planned and enable_checkpointing is not None:
            enable_checkpointing()
        return pf

    def _nothing_fits(self, exc: DoesNotFitError, enable_checkpointing: Optional[Callable[[], None]],
                      rows: int) -> int:
        """Nothing fits: the closest the allowed in-place steps get (one-row micro-batches,
        checkpointing on), the runtime guard watching."""
        apply = self.options.apply
        k = rows if "micro_batch" in apply else 1
        checkpointing = "grad_checkpoint" in apply and enable_checkpointing is not None
        if checkpointing:
            try:
                enable_checkpointing()
            except Exception:
                checkpointing = False
                self.log.warning("memguard: could not enable activation checkpointing", exc_info=True)
        budget = self._plan_budget or exc.budget_bytes
        self._nothing_fits_line = (
            f"preflight: nothing fits the budget of {budget / 2**30:.2f} GiB: the smallest plan is "
            f"{exc.shortfall_bytes / 2**30:.2f} GiB over the planning target ("
            f"{self.options.thresholds.warning:.0%} of the budget, the monitor's warning level, less what the "
            f"process already holds). Training continues with {k} micro-batches per batch"
            + (" and activation checkpointing" if checkpointing else "") + ", the runtime guard watching. Try: "
            + "; ".join(exc.suggestions))
        self.log.error("memguard: %s", self._nothing_fits_line)
        return k
