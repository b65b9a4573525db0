"""The preflight moment of a guarded run: read the run, plan it below the monitor's warning level,
turn checkpointing on where the plan asks, and record what changed -- or, when nothing fits, the
closest the in-place steps get; on a resume, take back what the guard decided before
(:mod:`memguard_core.guard_state`) instead of deciding again. A mixin of
:class:`memguard_core.guard.Guard` (it uses the guard's ``options``, ``log``, ``recorder``,
``preflight``, ``monitor``, ``budget_bytes`` and ``split_disabled_reason``); the rules:
docs/lifecycle.md, "Preflight" and "What a resume restores".
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .errors import ConfigError, DoesNotFitError
from .guard_state import GuardState, parse_state
from .preflight import Measurement, Preflight, default_budget, plan_in_place, resident_bytes_for
from .probe_policy import AUTO_MAX_SECONDS, Measure, probe_decision, probe_sizes

__all__ = ["PreflightMoment", "SpecReader"]

#: ``read_specs() -> (ModelSpec, TrainSpec)``: the adapter's reading of the run it guards.
SpecReader = Callable[[], Tuple[Any, Any]]



def _with_process_glibc(train_spec):
    """A CPU run's spec with this process's glibc release (``probes.glibc_version``) where it names
    none: the heap release decides the estimate's heap-slack factors (``cpu_heap.slack_factors``)."""
    if train_spec.device != "cpu" or train_spec.glibc is not None:
        return train_spec
    from .probes import glibc_version

    return train_spec.replace(glibc=glibc_version())

class PreflightMoment:
    """The preflight of :class:`memguard_core.guard.Guard` (see the module doc)."""

    preflight: Optional[Preflight] = None
    _nothing_fits_line: Optional[str] = None   # the preflight's decision when nothing fits
    _plan_budget: Optional[int] = None         # the budget plan() planned against, bytes
    _specs: Optional[Tuple[Any, Any]] = None   # (ModelSpec, TrainSpec) the last plan() read
    #: the state a resumed run took back at its start, and where it came from (None: decided afresh)
    restored: Optional[GuardState] = None
    restored_from: Optional[str] = None
    _pending_state: Optional[Tuple[GuardState, str]] = None   # restore_state's, until the next start
    _checkpointing_on = False    # this start turned activation checkpointing on
    _planned_k = 1               # the preflight's k of this start (restored: the saved one)
    _rows = 1                    # rows of a batch at this start

    @property
    def preflight_decided(self) -> bool:
        """The preflight changed the run (or started it at the closest it could when nothing fit,
        or took back a resumed run's state): a decision, as the monitor's are."""
        pf = self.preflight
        return (self._nothing_fits_line is not None or self.restored is not None
                or (pf is not None and bool(pf.applied or pf.not_applied)))

    # ------------------------------------------------------------------ resume
    def restore_state(self, data: Any, source: str, *, step: Optional[int] = None) -> Optional[GuardState]:
        """Take back the state a checkpoint saved (:class:`memguard_core.guard_state.GuardState`, or
        its dict as read from the checkpoint) for the next :meth:`start`, which then restores it
        instead of running the preflight. Call before the start.

        Args:
            data: the state, or its dict (``GuardState.to_dict``).
            source: where it was read (a path), for the log line.
            step: the step the run resumes at; a state saved at another step is not used.

        Returns:
            the state that the start will restore, or None: ``data`` is not a usable state
            (corrupt, foreign, another version, another step), which is logged on the guard's
            logger and ignored. Never raises.
        """
        try:
            state = data if isinstance(data, GuardState) else parse_state(data, source, self.log)
            if state is not None and step is not None and state.step is not None and state.step != step:
                self.log.warning("memguard: the guard state in %s was saved at step %d, the run resumes at step %d: "
                                 "not used; the preflight decides again", source, state.step, step)
                state = None
        except Exception:
            self.log.warning("memguard: the guard state in %s could not be taken", source, exc_info=True)
            state = None
        self._pending_state = (state, str(source)) if state is not None else None
        return state

    def export_state(self, *, step: Optional[int] = None, eval_micro_batches: Optional[int] = None,
                     framework: str = "") -> Optional[GuardState]:
        """The state to save with a checkpoint taken now (``step``: its optimizer step or MLX
        iteration; ``eval_micro_batches``: the adapter's evaluation k; ``framework``: the adapter's
        name), or None before the start. Never raises."""
        mon = getattr(self, "monitor", None)
        if mon is None:
            return None
        try:
            pf, back = self.preflight, self.restored
            if pf is not None:
                peak, corr, runs = pf.best_peak_bytes, pf.correction, pf.calibration_runs
            elif back is not None:
                peak, corr, runs = back.planned_peak_bytes, back.correction, back.calibration_runs
            else:
                peak, corr, runs = None, 1.0, 0
            return GuardState(
                rows=int(self._rows), micro_batches=int(mon.micro_batches), planned_micro_batches=int(self._planned_k),
                budget_bytes=int(mon.budget_bytes), budget_set=self.options.budget_bytes is not None,
                eval_micro_batches=None if eval_micro_batches is None else int(eval_micro_batches),
                checkpointing=bool(self._checkpointing_on), preflight=self._decision_line(),
                planned_peak_bytes=None if peak is None else int(peak), correction=float(corr),
                calibration_runs=int(runs),
                peak_at_micro_batches={int(k): int(v) for k, v in dict(mon.peak_at_micro_batches).items()},
                step=None if step is None else int(step), framework=str(framework))
        except Exception:
            self.log.warning("memguard: could not export the guard state", exc_info=True)
            return None

    def _take_restored(self, rows: int) -> Optional[GuardState]:
        """The pending restored state if it fits this start (same rows per batch, and no budget
        option other than the budget it ran with), else None with one WARNING line saying why."""
        pending, self._pending_state = self._pending_state, None
        if pending is None:
            return None
        state, source = pending
        opt = self.options.budget_bytes
        why = None
        if state.rows != rows:
            why = f"it was saved for batches of {state.rows} rows, this run's have {rows}"
        elif opt is not None and int(opt) != state.budget_bytes:
            why = (f"it was decided for a budget of {state.budget_bytes / 2**30:.2f} GiB, this run sets "
                   f"{int(opt) / 2**30:.2f} GiB")
        if why is not None:
            self.log.warning("memguard: the guard state in %s is not restored (%s); the preflight decides again",
                             source, why)
            return None
        self.restored, self.restored_from = state, source
        return state

    def _apply_restored(self, state: GuardState, read_specs: Optional[SpecReader],
                        enable_checkpointing: Optional[Callable[[], None]]) -> int:
        """A resumed start: the budget and activation checkpointing as the saved run had them (the
        budget option, when set, is the same), the specs read for the heap's settings only, no
        plan. Returns the saved micro-batches per batch."""
        opts = self.options
        if opts.budget_bytes is None:
            self.budget_bytes = state.budget_bytes
        self._planned_k = state.planned_micro_batches
        if state.checkpointing and enable_checkpointing is not None and "grad_checkpoint" in opts.apply:
            try:
                enable_checkpointing()
                self._checkpointing_on = True
            except Exception:
                self.log.warning("memguard: could not enable activation checkpointing again", exc_info=True)
        if read_specs is not None and opts.trim_heap:
            try:
                model_spec, train_spec = read_specs()
                self._specs = (model_spec, train_spec.replace(heap_trim=True))
            except Exception:
                self.log.debug("memguard: the run's specs not read on the resume", exc_info=True)
        return state.micro_batches

    def _restored_line(self, k: int) -> str:
        """The one line a resumed start logs: what was restored and from where."""
        st = self.restored
        parts = [f"{k} micro-batches per batch (saved {st.micro_batches}, planned {st.planned_micro_batches})"]
        if st.eval_micro_batches is not None:
            parts.append(f"evaluation micro-batches {st.eval_micro_batches}")
        parts.append(f"budget {self.budget_bytes / 2**30:.2f} GiB ("
                     + ("the budget option" if st.budget_set else "derived at the first start") + ")")
        if st.checkpointing:
            parts.append("activation checkpointing on again" if self._checkpointing_on
                         else "activation checkpointing NOT turned on again (not allowed here)")
        if st.correction != 1.0 or st.calibration_runs:
            parts.append(f"calibration x{st.correction:.3f} ({st.calibration_runs} past runs)")
        if st.peak_at_micro_batches:
            parts.append(f"{len(st.peak_at_micro_batches)} measured step peak(s) by micro-batches")
        at = f" saved at step {st.step}" if st.step is not None else ""
        return (f"resumed from {self.restored_from}: the guard state{at} restored: " + ", ".join(parts)
                + "; the preflight does not decide again" + (f" (its decision: {st.preflight})" if st.preflight else ""))

    def _decision_line(self) -> Optional[str]:
        """The preflight's decision of this run (its first start's, on a resume), None without one."""
        if self.restored is not None:
            return self.restored.preflight
        if self._nothing_fits_line is not None:
            return self._nothing_fits_line
        pf = self.preflight
        if pf is None or not (pf.applied or pf.not_applied):
            return None
        done = sorted({c.reason for c in pf.applied})
        todo = sorted({c.reason for c in pf.not_applied})
        return ("preflight changed the run: " + "; ".join(done)
                + (("; NOT applied (change it yourself): " + "; ".join(todo)) if todo else "")
                + f" (estimate {pf.requested_peak_bytes / 2**30:.2f} GiB -> "
                f"{pf.best_peak_bytes / 2**30:.2f} GiB, budget {pf.budget_bytes / 2**30:.2f} GiB)")

    def _record_start(self, k: int) -> None:
        """Open the run's records (event log, leak check, CUDA snapshots) and record the preflight's
        changes: one WARNING line and a ``preflight`` decision. Never raises."""
        try:
            from .probes import resolve_device

            self.recorder.start(resolve_device(self.options.device), self.budget_bytes)
            if self.restored is not None:
                self.recorder.decision("preflight", self._restored_line(k), step=self.restored.step, micro_batches=k)
            elif self._nothing_fits_line is not None:   # _nothing_fits logged it at ERROR already
                self.recorder.decision("preflight", self._nothing_fits_line, step=0, warn=False, micro_batches=k)
            else:
                line = self._decision_line()
                if line is not None:
                    self.recorder.decision("preflight", line, step=0, micro_batches=k)
        except Exception:
            self.log.warning("memguard: could not open the run records", exc_info=True)

    def _run_preflight(self, read_specs: SpecReader, enable_checkpointing: Optional[Callable[[], None]],
                       rows: int, plan_hint: str, measure: Optional[Measure] = None) -> int:
        """The preflight moment: returns the micro-batches per batch it asks for (1: none)."""
        opts = self.options
        try:
            self.preflight = pf = self.plan(read_specs, enable_checkpointing, measure)
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

    def plan(self, read_specs: SpecReader, enable_checkpointing: Optional[Callable[[], None]] = None,
             measure: Optional[Measure] = None) -> Preflight:
        """Estimate the run ``read_specs()`` describes, plan it against the budget (the option, else
        the default budget of its device) below the monitor's warning level, with what this
        process already holds counted, and turn activation checkpointing on when the plan asks
        for it. Starts nothing (it may fix glibc's mmap threshold for a bf16 MoE on a CPU, as the run
        would: :mod:`memguard_core.step_heap`); :meth:`start` calls it for its preflight.

        Raises:
            ConfigError: the run cannot be read or a setting is invalid.
            DoesNotFitError: nothing in the allowed search fits.
        """
        opts = self.options
        model_spec, train_spec = read_specs()
        # the estimate is of the run as guarded: with or without the step-end heap trim
        train_spec = _with_process_glibc(train_spec.replace(heap_trim=bool(opts.trim_heap)))
        self._specs = (model_spec, train_spec)   # read even when nothing fits (the mmap threshold needs them)
        budget = opts.budget_bytes
        if budget is None:
            budget = default_budget(train_spec.device if opts.device == "auto" else opts.device, opts.safety_ratio)
        self._plan_budget = int(budget)   # what a nothing-fits line names (the error has the target)
        apply = tuple(a for a in opts.apply if a != "grad_checkpoint" or enable_checkpointing is not None)
        # plan below the warning level: a run planned up to the budget would sit at the critical level
        # from its first step and be split further for nothing
        # what the process holds is read before the measurement allocates, and the heap is set up
        # as the steps will run (a bf16 MoE's mmap threshold), so the probe reads the run's heap
        resident = resident_bytes_for(train_spec)
        pin = getattr(self, "_pin_mmap_threshold", None)
        if pin is not None:
            pin()
        probe = self._measure(model_spec, train_spec, measure)
        pf = plan_in_place(model_spec, train_spec, budget, apply=apply, plan_fraction=opts.thresholds.warning,
                           resident_bytes=resident,
                           correction=probe.factor if probe is not None and probe.factor else None)
        pf.measurement = probe
        if pf.checkpointing_planned and enable_checkpointing is not None:
            enable_checkpointing()
            self._checkpointing_on = True
        return pf

    def _measure(self, model_spec: Any, train_spec: Any, measure: Optional[Measure]) -> Optional[Measurement]:
        """The in-process measurement as ``preflight_probe`` says (``memguard_core.probe_policy``);
        None where there is no live model. Never raises: a failure is logged and the estimate kept."""
        if measure is None:
            return None
        try:
            want, why = probe_decision(self.options.preflight_probe, model_spec, train_spec)
            if not want:
                return Measurement(None, f"in-process measurement {why}")
            from .estimator.probe_fit import correct_estimate

            result = measure(probe_sizes(train_spec, model_spec), AUTO_MAX_SECONDS * 2 if self.options.preflight_probe == "auto"
                             else None)
            fit = correct_estimate(model_spec, train_spec, result)
            factor = fit.peak_bytes / fit.estimate_peak_bytes if fit.applied and fit.estimate_peak_bytes else None
            if factor is not None and factor < 1.0 and train_spec.device == "cpu":
                # one row's glibc heap reading does not carry to the run's rows, and lowering is
                # the direction that ends in an OOM (docs/estimator.md, "In-process measurement")
                return Measurement(None, f"{fit.explanation}; not applied: a CPU reading only raises the estimate")
            return Measurement(factor, fit.explanation)
        except Exception as exc:
            self.log.warning("memguard: the in-process measurement failed (%s: %s); planning from the estimate "
                             "alone", type(exc).__name__, exc)
            return Measurement(None, "in-process measurement failed; the estimate alone")

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
                self._checkpointing_on = True
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
