"""The in-process measurement (``preflight_probe``) on full-depth guarded HF ``Trainer`` runs.

    python bench/probe_full_depth.py                    # the default cases, ~15-30 min on 2 cores
    python bench/probe_full_depth.py --only gpt2-12l    # cases whose name holds a substring
    python bench/probe_full_depth.py --list             # the cases, nothing run

Each case of ``memguard_bench/data/cases.toml`` ``[full_depth] hf`` chosen here (their peaks stay
under ~8.5 GiB on the CPU) runs in a fresh interpreter as a GUARDED run:
``trainer.add_callback(MemGuardCallback(preflight_probe=True, budget_bytes=...))``, the model built
by the bench's HF child (``memguard_bench.child_hf``: the case's architecture from
``archs_full_depth.toml``, random weights, the same rows and ``TrainingArguments``), with a budget
large enough that the preflight changes nothing. Read from the run:

* the estimate the guard acted on: ``Preflight.best_peak_bytes`` (the planned settings = the
  requested ones here), with the probe's correction where the guard applied it;
* the estimate without the probe, from the same run's preflight: ``estimate(model_spec,
  train_spec)`` of the specs the guard read, at correction 1.0 (the calibration store is off:
  ``MEMGUARD_CALIBRATION=0``), plus the same resident surplus -- what ``plan_in_place`` plans from
  when no measurement corrects it (``memguard_core.preflight.plan_in_place``);
* the factor the probe read (``memguard_core.estimator.probe_fit.correct_estimate`` on the probe's
  own ``ProbeResult``, the guard's computation in ``guard_preflight.PreflightMoment._measure``),
  whether it was applied (on a CPU a factor below 1 is logged, not applied), the guard's log line
  (``Preflight.measurement.line``) and the probe's cost in seconds (``ProbeResult.seconds``) and the
  whole preflight's (``on_train_begin``);
* the run's measured peak by the guard's own per-step figures: the largest ``peak_bytes`` of the
  ``step`` records of its event log (docs/events.md; the guard resets VmHWM at every step sample
  and primes it after the preflight, so the probe's own step is not in it).

Error = (estimate - measured peak) / measured peak. Writes bench/results/probe_full_depth.md and
.json; docs/benchmarks.md, "In-process measurement at full depth".
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MiB = 2**20

#: The cases run by default (substrings of the full-depth HF case names): those whose measured
#: peak stays under ~8.5 GiB on this CPU (bench/results/full_depth_cpu.md), so a run leaves room
#: for others on a shared 24 GiB machine.
DEFAULT_CASES = (
    "hf-fd-gpt2-12l-lora-r16-b2-s1024-fp32-c_attn",
    "hf-fd-gpt2-12l-full-b1-s1024-fp32",
    "hf-fd-smollm2-135m-30l-lora-r16-b2-s1024-bf16-3steps",
    "hf-fd-smollm2-135m-30l-lora-r32-b1-s2048-fp32-gc-all-linear",
    "hf-fd-smollm2-135m-30l-full-b4-s512-fp32-adafactor",
    "hf-fd-smollm2-360m-32l-lora-r16-b4-s512-bf16-amp",
    "hf-fd-smollm2-360m-32l-full-b2-s1024-bf16-gc",
    "hf-fd-qwen2.5-0.5b-24l-full-b1-s1024-bf16-gc",
    "hf-fd-qwen2.5-0.5b-24l-lora-r16-b2-s512-bf16-drop0.05-all-linear",
    "hf-fd-tinyllama-1.1b-22l-lora-r16-b1-s2048-bf16-gc",
)
#: The issue's bar (#33 item 3): the acted-on estimate within this share of the measured peak.
TARGET = 0.05

_PROBE_LINE = re.compile(
    r"measured (?P<steps>\d+) forward\+backward steps? \((?P<sizes>[^)]*)\) in (?P<seconds>[\d.]+) s "
    r"\((?P<counter>[^)]*)\)(?::\s*(?P<rest>.*))?$")
_RATIO = re.compile(r"per-token x(?P<ratio>[\d.]+)(?: \(bounded; read x(?P<read>[\d.]+)\))?")
_FIXED = re.compile(r"fixed (?P<fixed>[+-]?\d+) MiB")
_PEAK = re.compile(r"peak (?P<before>[\d.]+) -> (?P<after>[\d.]+) GiB")


# ---------------------------------------------------------------------------------- pure parts
def parse_probe_line(line: str) -> Dict[str, Any]:
    """The figures of the guard's in-process measurement line (``Preflight.measurement.line``, made
    by ``memguard_core.estimator.probe_fit.fit_probe`` and ``guard_preflight.PreflightMoment._measure``).

    Returns:
        ``measured`` (bool), and when measured: ``steps`` (int), ``sizes`` (str), ``seconds``
        (float, the measurement's cost as logged, one decimal), ``counter`` (str), ``ratio`` (the
        per-token ratio applied; ``ratio_read`` where bounded), ``fixed_mib`` (int), ``peak_gib``
        ((before, after) of the run's estimate, GiB, two decimals), ``applied`` (False when the
        line says the correction was not applied: a CPU factor below 1).

    Raises:
        ValueError: ``line`` is not a string.
    """
    if not isinstance(line, str):
        raise ValueError(f"line: expected the measurement's log line (a string), got {type(line).__name__}")
    m = _PROBE_LINE.search(line.split("; not applied")[0])
    if m is None:
        return {"measured": False}
    rest = m.group("rest") or ""
    out: Dict[str, Any] = {"measured": True, "steps": int(m.group("steps")), "sizes": m.group("sizes"),
                           "seconds": float(m.group("seconds")), "counter": m.group("counter"),
                           "applied": "not applied" not in line and "estimate kept" not in rest}
    r = _RATIO.search(rest)
    if r:
        out["ratio"] = float(r.group("ratio"))
        if r.group("read"):
            out["ratio_read"] = float(r.group("read"))
    f = _FIXED.search(rest)
    if f:
        out["fixed_mib"] = int(f.group("fixed"))
    p = _PEAK.search(rest)
    if p:
        out["peak_gib"] = (float(p.group("before")), float(p.group("after")))
    return out


def step_peaks(records: Iterable[Dict[str, Any]]) -> Dict[int, Dict[str, int]]:
    """The guard's per-step figures from its event log records (docs/events.md): optimizer step ->
    ``{"peak_bytes", "micro_batches"}``. A step recorded twice (the run's end records its last step
    again) keeps the larger peak. Records of other types and steps without a peak are skipped.

    Raises:
        ValueError: a ``step`` record whose ``step`` or ``peak_bytes`` is not an integer.
    """
    out: Dict[int, Dict[str, int]] = {}
    for rec in records:
        if rec.get("type") != "step" or rec.get("peak_bytes") is None:
            continue
        step, peak = rec.get("step"), rec["peak_bytes"]
        for name, v in (("step", step), ("peak_bytes", peak)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name}: expected an integer in a step record, got {v!r}")
        k = int(rec.get("micro_batches") or 1)
        prev = out.get(step)
        if prev is None or peak > prev["peak_bytes"]:
            out[step] = {"peak_bytes": peak, "micro_batches": k}
    return out


def error(estimate: Optional[int], measured: Optional[int]) -> Optional[float]:
    """(estimate - measured) / measured; None when either is missing or ``measured`` is not positive."""
    if estimate is None or not measured or measured <= 0:
        return None
    return (estimate - measured) / measured


def summarise(rows: Sequence[Dict[str, Any]], key: str, target: float = TARGET) -> Dict[str, Any]:
    """Over the rows that have ``key`` (an error, fraction): how many, how many within ``target``,
    the median and largest absolute error, the worst under-estimate (most negative) and the cases
    outside ``target``."""
    errs = [(r["case"], r[key]) for r in rows if r.get(key) is not None]
    if not errs:
        return {"cases": 0, "within": 0, "median_abs": None, "max_abs": None, "worst_under": None, "outside": []}
    a = sorted(abs(e) for _, e in errs)
    mid = len(a) // 2
    median = a[mid] if len(a) % 2 else (a[mid - 1] + a[mid]) / 2
    return {"cases": len(errs), "within": sum(abs(e) <= target for _, e in errs), "median_abs": median,
            "max_abs": a[-1], "worst_under": min(e for _, e in errs),
            "outside": [c for c, e in errs if abs(e) > target]}


# ---------------------------------------------------------------------------------- the child
def run_guarded(case: dict, budget_bytes: int, log_dir: str, probe: bool = True) -> Dict[str, Any]:
    """One guarded HF ``Trainer`` run of ``case`` in this process (``case["steps"]`` optimizer
    steps, default 2); returns the record (bytes, seconds) described in the module doc."""
    t0 = time.time()
    import torch
    from transformers import Trainer

    import memguard_hf.callback as hf_callback
    from memguard_bench.child_hf import _build_model, _dataset, _head_kind, _training_args
    from memguard_core.estimator.estimate import estimate
    from memguard_core.estimator.probe_fit import correct_estimate
    from memguard_core.events import read_events

    torch.manual_seed(0)
    kw = case["train"]
    steps = int(case.get("steps", 2))
    model, config, _ = _build_model(case, torch)
    ds = _dataset(kw["batch_size"] * kw["grad_accum"] * steps, kw["seq_length"], config.vocab_size, torch,
                  _head_kind(config), int(getattr(config, "num_labels", 2)))
    args = _training_args(kw, steps, "cpu")

    from _common import recording_guard

    # keep the probe's own result (its steps and seconds): the guard keeps only its log line
    cb, results = recording_guard(hf_callback, budget_bytes=budget_bytes, preflight_probe=bool(probe),
                                  log_dir=log_dir)
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(cb)
    t_train = time.time()
    trainer.train()
    train_seconds = time.time() - t_train
    pf = cb.preflight
    if pf is None:
        raise RuntimeError("the guard ran no preflight")
    ms, ts = pf.model_spec, pf.train_spec
    no_probe = int(estimate(ms, ts, correction=1.0).peak_bytes) + pf.resident_extra_bytes
    rec: Dict[str, Any] = dict(
        case=case["name"], steps=steps, budget_bytes=budget_bytes, probe_on=bool(probe),
        estimate_acted_bytes=int(pf.best_peak_bytes), requested_bytes=int(pf.requested_peak_bytes),
        estimate_no_probe_bytes=no_probe, resident_extra_bytes=int(pf.resident_extra_bytes),
        correction=float(pf.correction), plan_changed=bool(pf.applied or pf.not_applied),
        planned_micro_batches=int(pf.micro_batches), preflight_seconds=cb.begin_seconds,
        measurement_line=pf.measurement.line if pf.measurement is not None else None,
        train_seconds=round(train_seconds, 1), seconds=round(time.time() - t0, 1),
        runtime_held_bytes=ts.runtime_held_bytes, seq_length=ts.seq_length)
    if results and results[-1].measured:
        r = results[-1]
        fit = correct_estimate(ms, ts, r)
        factor = fit.peak_bytes / fit.estimate_peak_bytes if fit.applied and fit.estimate_peak_bytes else None
        rec.update(probe_seconds=r.seconds, probe_counter=r.counter,
                   probe_steps=[dict(rows=s.rows, tokens=s.tokens, held_bytes=s.held_bytes, peak_bytes=s.peak_bytes,
                                     retained_bytes=s.retained_bytes, seconds=s.seconds) for s in r.steps],
                   factor_read=factor, factor_applied=pf.measurement is not None and pf.measurement.factor is not None)
        if factor is not None:   # what the plan would have been with the factor applied (a CPU factor < 1 is not)
            rec["estimate_if_applied_bytes"] = int(estimate(ms, ts, correction=factor).peak_bytes) \
                + pf.resident_extra_bytes
    elif results:
        rec.update(probe_seconds=results[-1].seconds, probe_reason=results[-1].reason)
    paths = glob.glob(os.path.join(log_dir, "*.jsonl"))
    peaks = step_peaks(e for p in paths for e in read_events(p))
    rec["step_peak_bytes"] = [peaks[s]["peak_bytes"] for s in sorted(peaks)]
    rec["step_micro_batches"] = [peaks[s]["micro_batches"] for s in sorted(peaks)]
    rec["measured_peak_bytes"] = max(rec["step_peak_bytes"]) if peaks else None
    summary = cb.guard.summary or {}
    rec["summary_measured_peak_bytes"] = summary.get("measured_peak_bytes")
    rec["process_peak_rss_bytes"] = summary.get("process_peak_rss_bytes")
    rec["events"] = summary.get("events")
    return rec


def _child_env() -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("MEMGUARD_SPLIT", "MEMGUARD_MICRO_BATCHES", "MEMGUARD_LOG_DIR", "MALLOC_MMAP_THRESHOLD_"):
        env.pop(k, None)
    env["MEMGUARD_CALIBRATION"] = "0"   # the uncalibrated planner, as a first run sees it
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return env


def run_case(case: dict, budget_bytes: int, probe: bool, timeout_s: float) -> Dict[str, Any]:
    """``case`` as a guarded run in a fresh interpreter; the child's record, or ``{"case", "error"}``."""
    with tempfile.TemporaryDirectory(prefix="probe_fd_") as log_dir:
        payload = json.dumps({"case": case, "budget_bytes": budget_bytes, "log_dir": log_dir, "probe": probe})
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", payload], capture_output=True,
                               text=True, cwd=ROOT, env=_child_env(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"case": case["name"], "probe_on": probe, "error": f"timed out after {timeout_s:.0f} s"}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"case": case["name"], "probe_on": probe, "error": f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}"}
    return json.loads(line[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------- report
def _mib(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / MiB:,.0f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def score(rec: Dict[str, Any]) -> Dict[str, Any]:
    """``rec`` with its errors: ``error_no_probe``, ``error_acted``, ``error_if_applied`` (fractions)."""
    m = rec.get("measured_peak_bytes")
    return dict(rec, error_no_probe=error(rec.get("estimate_no_probe_bytes"), m),
                error_acted=error(rec.get("estimate_acted_bytes"), m),
                error_if_applied=error(rec.get("estimate_if_applied_bytes"), m))


def table(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The markdown table of the scored records (errors are shown, not the failures' text)."""
    head = ["| case | probe s | preflight s | factor read | applied | estimate w/o probe MiB | acted-on MiB | "
            "measured peak MiB (per step) | error w/o probe | error acted on | error if applied | k |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    out = list(head)
    for r in rows:
        if r.get("error") and isinstance(r["error"], str):
            out.append(f"| {r['case']} | failed: {r['error'].splitlines()[0][:80]} |" + " |" * 10)
            continue
        per_step = ", ".join(_mib(v) for v in r.get("step_peak_bytes") or [])
        f = r.get("factor_read")
        out.append(
            f"| {r['case']} | {r.get('probe_seconds', 0):.1f} | {r.get('preflight_seconds') or 0:.1f} | "
            f"{'-' if f is None else f'x{f:.3f}'} | {'yes' if r.get('factor_applied') else 'no'} | "
            f"{_mib(r.get('estimate_no_probe_bytes'))} | {_mib(r.get('estimate_acted_bytes'))} | "
            f"{_mib(r.get('measured_peak_bytes'))} ({per_step}) | {_pct(r.get('error_no_probe'))} | "
            f"{_pct(r.get('error_acted'))} | {_pct(r.get('error_if_applied'))} | "
            f"{','.join(str(k) for k in sorted(set(r.get('step_micro_batches') or [])))} |")
    return out


def _summary_line(name: str, s: Dict[str, Any]) -> str:
    if not s["cases"]:
        return f"- {name}: no case"
    return (f"- {name}: {s['within']} of {s['cases']} within {TARGET:.0%}; median |error| {s['median_abs'] * 100:.1f}%, "
            f"largest {s['max_abs'] * 100:.1f}%, worst under-estimate {s['worst_under'] * 100:+.1f}%"
            + (f"; outside: {', '.join(s['outside'])}" if s["outside"] else ""))


def write_report(rows: Sequence[Dict[str, Any]], meta: Dict[str, Any], stem: str) -> str:
    """Write ``stem``.json (the records and ``meta``) and ``stem``.md (the table and summaries); returns the md."""
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "records": list(rows)}, f, indent=1, default=str)
    lines = [f"# In-process measurement on full-depth guarded HF runs ({meta['date']})", "",
             f"Machine: {meta['machine']}; budget option {meta['budget_gib']:g} GiB (the preflight changes nothing); "
             "calibration store off; `preflight_probe=True`.", "",
             "Runs this file was built from: " + "; ".join(f"{d} (memguard {', '.join(cs)})" for d, cs in runs_of(meta))
             + " (a row's own run: its `measured_at` in the JSON, where it has one).", ""]
    lines += table(rows)
    lines += ["", _summary_line("estimate without the probe", summarise(rows, "error_no_probe")),
              _summary_line("estimate the guard acted on (probe on)", summarise(rows, "error_acted")),
              _summary_line("with the read factor applied (a CPU factor below 1 is not)", summarise(rows, "error_if_applied"))]
    secs = [r["probe_seconds"] for r in rows if r.get("probe_seconds") is not None]
    if secs:
        lines.append(f"- the measurement's cost: {min(secs):.1f}-{max(secs):.1f} s (median {sorted(secs)[len(secs) // 2]:.1f} s)")
    lines.append("")
    md = "\n".join(lines)
    with open(stem + ".md", "w") as f:
        f.write(md)
    return md


def runs_of(meta: Dict[str, Any]) -> List[Tuple[str, List[str]]]:
    """``[(date, [memguard commits])]``, oldest date first, of the run that wrote ``meta`` and of
    every run before it in its ``--reuse`` chain (``meta["reused_from"]``, nested; a run whose
    records were all run again is listed too), each commit once, oldest run first."""
    runs: Dict[str, List[str]] = {}
    m: Optional[Dict[str, Any]] = meta
    while m:
        head, sep, commit = str(m.get("machine", "")).rpartition("memguard ")
        commit = commit if sep and commit else "?"
        seen = runs.setdefault(str(m.get("date", "?")), [])
        if commit not in seen:
            seen.insert(0, commit)
        m = m.get("reused_from")
    return sorted(runs.items())


def _machine() -> str:
    import platform

    try:
        import torch
        import transformers
        vers = f"torch {torch.__version__}, transformers {transformers.__version__}"
    except Exception:   # the report still names the machine
        vers = ""
    return f"{platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, {vers}, memguard {_commit()}"


def _commit() -> str:
    """This checkout's short commit."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def select_cases(only: Sequence[str]) -> List[dict]:
    """The full-depth HF cases to run: ``DEFAULT_CASES``, or every full-depth HF case whose name
    holds one of ``only``.

    Raises:
        ValueError: a name of ``DEFAULT_CASES`` or a substring of ``only`` that matches no case.
    """
    from memguard_bench.cases import full_depth_cases

    hf = [c for c in full_depth_cases() if c["backend"] == "hf"]
    names = {c["name"]: c for c in hf}
    if only:
        out = [c for c in hf if any(o in c["name"] for o in only)]
        if not out:
            raise ValueError(f"--only: no full-depth HF case matches {list(only)}")
        return out
    missing = [n for n in DEFAULT_CASES if n not in names]
    if missing:
        raise ValueError(f"DEFAULT_CASES: not in cases.toml [full_depth] hf: {missing}")
    return [names[n] for n in DEFAULT_CASES]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="SUBSTRING",
                    help="run the full-depth HF cases whose name holds it (repeatable); default: DEFAULT_CASES")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--budget-gib", type=float, default=20.0,
                    help="the guard's budget option, GiB (default 20: large enough that nothing changes)")
    ap.add_argument("--probe-off", action="store_true",
                    help="also run each case with preflight_probe=False (a second guarded run)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "probe_full_depth"),
                    help="path stem of the .md / .json written (default bench/results/probe_full_depth)")
    ap.add_argument("--timeout-s", type=float, default=None,
                    help="seconds a case may run (default: its cases.toml timeout_s + 300 s)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the records of cases already in OUT.json (failed ones run again)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        p = json.loads(a.child)
        print("RESULT " + json.dumps(run_guarded(p["case"], p["budget_bytes"], p["log_dir"], p["probe"]), default=str),
              flush=True)
        return 0
    if a.timeout_s is not None and not a.timeout_s > 0:
        ap.error(f"--timeout-s: expected a positive number of seconds, got {a.timeout_s}")
    if not a.budget_gib > 0:
        ap.error(f"--budget-gib: expected a positive number of GiB, got {a.budget_gib}")
    try:
        cases = select_cases(a.only)
    except ValueError as exc:
        ap.error(str(exc))
    if a.list:
        print("\n".join(c["name"] for c in cases))
        return 0
    budget = int(a.budget_gib * 2**30)
    rows: List[Dict[str, Any]] = []
    meta = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": _machine(), "budget_gib": a.budget_gib,
            "target": TARGET}
    kept: Dict[Any, Dict[str, Any]] = {}
    if a.reuse and os.path.exists(a.out + ".json"):
        with open(a.out + ".json") as f:
            old = json.load(f)
        kept = {(r["case"], r.get("probe_on", True)): r for r in old.get("records", [])
                if not isinstance(r.get("error"), str)}
        meta["reused_from"] = old.get("meta")
    # --only with --reuse: the saved records of the cases not selected stay in the reports
    chosen = {c["name"] for c in cases}
    order = [c["name"] for c in select_cases([])]
    others = [score(r) for (name, _), r in sorted(kept.items(), key=lambda kv: order.index(kv[0][0])
                                                  if kv[0][0] in order else len(order)) if name not in chosen]

    def listed(recs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        return sorted(recs, key=lambda r: order.index(r["case"]) if r.get("case") in order else len(order))

    for c in cases:
        for probe in (True, False) if a.probe_off else (True,):
            if (c["name"], probe) in kept:
                rows.append(score(kept[(c["name"], probe)]))
                continue
            t = time.time()
            limit = a.timeout_s if a.timeout_s else float(c.get("timeout_s", 600)) + 300
            rec = score(dict(run_case(c, budget, probe, limit), measured_at=f"{meta['date']} {_commit()}"))
            rows.append(rec)
            print(f"{c['name']} probe={'on' if probe else 'off'}: "
                  + (f"FAILED {rec['error'][:300]}" if "error" in rec and isinstance(rec["error"], str) else
                     f"acted {_mib(rec.get('estimate_acted_bytes'))} MiB, w/o probe "
                     f"{_mib(rec.get('estimate_no_probe_bytes'))}, peak {_mib(rec.get('measured_peak_bytes'))} "
                     f"({_pct(rec.get('error_acted'))} / {_pct(rec.get('error_no_probe'))}), factor "
                     f"{rec.get('factor_read')}, probe {rec.get('probe_seconds') or 0:.1f} s")
                  + f" [{time.time() - t:.0f} s]", flush=True)
            write_report(listed(rows + others), meta, a.out)   # after each case: a run cut short keeps the cases done
    print(write_report(listed(rows + others), meta, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
