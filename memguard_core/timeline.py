"""``memguard report``: a guarded run's event log as a timeline picture and a short summary.

The picture: memory per optimizer step (peak solid, current dashed, one colour per run and rank)
against the budget (with one run, its 85 / 90 / 95 % lines too), each decision marked and labelled
where it happened, and the micro-batches per batch underneath. Records are grouped by run id first:
a log folder collects every run, and separate runs are never drawn as one. matplotlib draws it (Agg
backend: no display needed).
"""

from __future__ import annotations

import base64
import html
import os
import re
import sys
from typing import Any, Dict, List, Optional, Sequence

from .errors import ConfigError
from .outputs import check_output
from .events import read_events

__all__ = ["load_runs", "summarize", "draw_timeline", "write_html", "summary_text", "report_text",
           "MAX_RUNS_DRAWN"]

GiB = float(1 << 30)
#: Decisions listed under the picture (all of them are in the printed summary).
MAX_LISTED = 12
#: The usage lines drawn on the picture: the monitor's default warn / critical / emergency levels
#: (``memguard_core.monitor_policy.Thresholds``).
USAGE_LINES = (0.85, 0.90, 0.95)
_DECISION_COLOURS = {"preflight": "#6a3d9a", "clean": "#1f78b4", "split": "#e31a1c", "grow": "#33a02c",
                     "oom_retry": "#b15928", "restart": "#000000", "leak": "#ff7f00", "snapshot": "#a6cee3",
                     "pressure": "#fb9a99"}


#: Runs one picture overlays at most; with more, ``memguard report`` asks for ``--run``.
MAX_RUNS_DRAWN = 6

#: ``{run id: {rank: [record, ...]}}``, the runs in the order they started.
Runs = Dict[str, Dict[int, List[Dict[str, Any]]]]


def load_runs(paths: Sequence[str], run_ids: Sequence[str] = ()) -> Runs:
    """Records by run id, then by rank, from one or more event logs (a folder: every
    ``memguard-*.jsonl`` in it). A run's id is its start record's ``run_id``, else the one in its
    file name (``memguard-<run id>-rank<r>.jsonl``, :func:`memguard_core.events.event_log_path`),
    else the file name: one ``MEMGUARD_LOG_DIR`` collects every run, and records of separate runs
    are never drawn as one. Runs are ordered by their first record's time.

    Args:
        paths: files or folders.
        run_ids: keep only these runs (an id or a unique prefix of one); empty: every run.

    Raises:
        ConfigError: no file, a file that is not an event log, or a ``run_ids`` entry that names
            no run (or several).
    """
    files: List[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p)
                            if f.startswith("memguard-") and f.endswith(".jsonl"))
        else:
            files.append(p)
    if not files:
        raise ConfigError("FILE", "a memguard event log (.jsonl) or a folder holding some", list(paths))
    runs: Runs = {}
    first_t: Dict[str, float] = {}
    for f in files:
        recs = read_events(f)
        run = _run_id(f, recs)
        for rec in recs:
            runs.setdefault(run, {}).setdefault(int(rec.get("rank", 0)), []).append(rec)
            if isinstance(rec.get("t"), (int, float)):
                first_t[run] = min(first_t.get(run, rec["t"]), rec["t"])
    if not any(r.get("type") in ("step", "decision") for ranks in runs.values() for recs in ranks.values()
               for r in recs):
        raise ConfigError("FILE", "an event log with step or decision records", files)
    order = sorted(runs, key=lambda r: (first_t.get(r, float("inf")), r))
    if run_ids:
        chosen: List[str] = []
        for want in run_ids:
            hits = [r for r in order if r == want] or [r for r in order if r.startswith(want)]
            if len(hits) != 1:
                raise ConfigError("--run", "one run id (or a unique prefix) of: " + ", ".join(order), want)
            chosen += [h for h in hits if h not in chosen]
        order = chosen
    return {r: runs[r] for r in order}


def _run_id(path: str, records: List[Dict[str, Any]]) -> str:
    """The run id of one event log file (see :func:`load_runs`)."""
    for rec in records:
        if rec.get("type") == "start" and rec.get("run_id"):
            return str(rec["run_id"])
    m = re.match(r"memguard-(.+)-rank\d+\.jsonl$", os.path.basename(path))
    return m.group(1) if m else os.path.basename(path)


def summarize(ranks: Dict[int, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """One run's summary (its records by rank, one entry of :func:`load_runs`): steps, the highest
    peak (bytes) and its share of the budget, the process's peak RSS over its life
    (``process_peak_rss_bytes``, the largest rank's), decisions by kind, restarts."""
    steps = [r for recs in ranks.values() for r in recs if r.get("type") == "step"]
    decisions = [r for recs in ranks.values() for r in recs if r.get("type") == "decision"]
    peaks = [r["peak_bytes"] for r in steps if r.get("peak_bytes") is not None]
    # the process's peak over its life (step and end records; the largest rank's), docs/events.md
    lives = [r["process_peak_rss_bytes"] for recs in ranks.values() for r in recs
             if isinstance(r.get("process_peak_rss_bytes"), int)]
    budgets = [r["budget_bytes"] for r in steps if r.get("budget_bytes")]
    top = max(steps, key=lambda r: r.get("peak_bytes") or 0) if peaks else None
    kinds: Dict[str, int] = {}
    for d in decisions:
        kinds[d.get("kind", "?")] = kinds.get(d.get("kind", "?"), 0) + 1
    return {
        "ranks": sorted(ranks), "steps": len({(r.get("rank"), r.get("step")) for r in steps}),
        "peak_bytes": max(peaks) if peaks else None,
        "peak_step": top.get("step") if top else None,
        "budget_bytes": (top.get("budget_bytes") if top else None) or (max(budgets) if budgets else None),
        "peak_usage": (max(peaks) / top["budget_bytes"]) if top and top.get("budget_bytes") else None,
        "micro_batches_last": steps[-1].get("micro_batches") if steps else None,
        "process_peak_rss_bytes": max(lives) if lives else None,
        "decisions": kinds,
        "decision_lines": [f"step {d.get('step')}: {_rank_tag(d, len(ranks))}{d.get('kind')}: {d.get('message')}"
                           for d in decisions],
    }


def summary_text(s: Dict[str, Any]) -> str:
    """One run's summary (:func:`summarize`) as a few lines of text."""
    ranks = s["ranks"]
    who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
    lines = [f"{s['steps']} optimizer step records ({who})"]
    if s["peak_bytes"] is not None:
        usage = f" = {s['peak_usage']:.0%} of the {s['budget_bytes'] / GiB:.2f} GiB budget" if s["peak_usage"] else ""
        lines.append(f"highest step peak {s['peak_bytes'] / GiB:.2f} GiB at step {s['peak_step']}{usage}")
    if s.get("process_peak_rss_bytes") is not None:
        lines.append(f"process peak RSS {s['process_peak_rss_bytes'] / GiB:.2f} GiB over its life (process_peak_rss_bytes: "
                     "read it, not ru_maxrss / time -v, while the guard resets VmHWM per step)")
    if s["micro_batches_last"] is not None:
        lines.append(f"micro-batches per batch at the last step: {s['micro_batches_last']}")
    lines.append("decisions: " + (", ".join(f"{k} x{n}" for k, n in sorted(s["decisions"].items())) or "none"))
    lines += ["  " + d for d in s["decision_lines"]]
    return "\n".join(lines)


def report_text(runs: Runs) -> str:
    """Every run's summary, each under a ``run <id>`` line (:func:`load_runs`' order)."""
    return "\n\n".join(f"run {run}\n" + summary_text(summarize(ranks)) for run, ranks in runs.items())


def draw_timeline(runs: Runs, out_png: str, *, title: Optional[str] = None) -> str:
    """Draw the timeline of ``runs`` (:func:`load_runs`) to ``out_png`` (PNG) and return its path:
    one series per run and rank, each run against its own budget (with one run, the budget's
    85 / 90 / 95 % lines too).

    Raises:
        ConfigError: more than :data:`MAX_RUNS_DRAWN` runs (the message lists their ids),
            matplotlib is not installed, or the file cannot be written.
    """
    if len(runs) > MAX_RUNS_DRAWN:
        raise ConfigError("--run", f"at most {MAX_RUNS_DRAWN} runs in one picture; these logs hold "
                          f"{len(runs)}: " + ", ".join(runs), "every run")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--png", "matplotlib installed (pip install matplotlib)", out_png) from None
    several = len(runs) > 1
    decisions = [dict(r, _run=run) for run, ranks in runs.items() for rank in sorted(ranks) for r in ranks[rank]
                 if r.get("type") == "decision" and r.get("step") is not None]
    listed = decisions[:MAX_LISTED]
    fig = plt.figure(figsize=(11, 6.5 + 0.22 * (len(listed) + (len(decisions) > len(listed)))))
    lines = len(listed) + (len(decisions) > len(listed))
    grid = fig.add_gridspec(4, 1, height_ratios=[4, 1, 0.45, 0.2 * max(lines, 1)], hspace=0.12)
    ax = fig.add_subplot(grid[0])
    axk = fig.add_subplot(grid[1], sharex=ax)
    axt = fig.add_subplot(grid[3])
    axt.axis("off")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ymax = 0.0
    i = 0
    for run, ranks in runs.items():
        run_colour = colours[i % len(colours)]
        for rank in sorted(ranks):
            steps = [r for r in ranks[rank] if r.get("type") == "step"]
            c = colours[i % len(colours)]
            i += 1
            tag = " ".join(t for t in (f"run {run}" if several else "",
                                       f"rank {rank}" if len(ranks) > 1 else "") if t)
            xs = [r["step"] for r in steps]
            peak = [_gib(r.get("peak_bytes")) for r in steps]
            cur = [_gib(r.get("current_bytes")) for r in steps]
            if xs:
                ax.plot(xs, peak, "-o", color=c, ms=3, label=f"peak per step {tag}".strip())
                if any(v is not None for v in cur):
                    ax.plot(xs, cur, "--", color=c, alpha=0.7, label=f"current at step end {tag}".strip())
                axk.step(xs, [r.get("micro_batches", 1) for r in steps], where="post", color=c,
                         label=tag or None)
                ymax = max([ymax] + [v for v in peak if v is not None])
        # the budget as it was at each step (a co-tenant or a container change moves it), from the
        # start record's at step 0; the run's first rank that has one
        for rank in sorted(ranks):
            recs = ranks[rank]
            start = [r for r in recs if r.get("type") == "start" and r.get("budget_bytes")]
            steps = [r for r in recs if r.get("type") == "step" and r.get("budget_bytes")]
            bx = ([0] if start else []) + [r["step"] for r in steps]
            by = ([start[0]["budget_bytes"] / GiB] if start else []) + [r["budget_bytes"] / GiB for r in steps]
            if not by:
                continue
            if several:
                ax.step(bx, by, where="mid", color=run_colour, lw=1.5, ls="-.",
                        label=f"budget run {run} (last {by[-1]:.2f} GiB)")
            else:
                ax.step(bx, by, where="mid", color="black", lw=1.5, label=f"budget (last {by[-1]:.2f} GiB)")
                for frac, style in zip(USAGE_LINES, (":", "-.", "--")):
                    ax.step(bx, [b * frac for b in by], where="mid", color="grey", lw=0.8, ls=style)
                    ax.annotate(f"{frac:.0%}", xy=(1.0, by[-1] * frac), xycoords=("axes fraction", "data"),
                                xytext=(3, 0), textcoords="offset points", va="center", fontsize=8, color="grey")
            ymax = max([ymax] + by)
            break
    ax.set_ylim(0, ymax * 1.22 if ymax else 1)
    # decisions: a vertical line at their step with a number on top; the numbered list underneath
    placed: Dict[Any, int] = {}
    for i, r in enumerate(decisions, 1):
        colour = _DECISION_COLOURS.get(r.get("kind"), "#555555")
        x = r["step"]
        n = placed.get(x, 0)
        placed[x] = n + 1
        ax.axvline(x, color=colour, lw=1, alpha=0.6)
        ax.annotate(str(i), xy=(x, ax.get_ylim()[1]), xytext=(3 + 12 * n, -4), textcoords="offset points",
                    fontsize=9, fontweight="bold", color=colour, va="top")
    for i, r in enumerate(listed, 1):
        run = f"run {r['_run']} " if several else ""
        axt.text(0.0, 1.0 - (i - 1) / max(lines, 1), f"{i}  {run}step {r['step']}  {_label(r)}",
                 transform=axt.transAxes, fontsize=8.5, va="top",
                 color=_DECISION_COLOURS.get(r.get("kind"), "#555555"))
    if len(decisions) > len(listed):
        axt.text(0.0, 1.0 - len(listed) / max(lines, 1), f"... and {len(decisions) - len(listed)} more "
                 "(memguard report prints them all)", transform=axt.transAxes, fontsize=8.5, va="top")
    ax.set_ylabel("memory (GiB)")
    ax.legend(loc="best" if several else "lower right", fontsize=8)
    ax.grid(alpha=0.3)
    if several:
        axk.legend(loc="upper left", fontsize=7)
    axk.set_ylabel("micro-batches\nper batch", fontsize=9)
    axk.set_xlabel("optimizer step")
    plt.setp(ax.get_xticklabels(), visible=False)
    axk.grid(alpha=0.3)
    axk.yaxis.get_major_locator().set_params(integer=True)
    axk.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(title or "memguard: memory per step against the budget")
    fig.subplots_adjust(left=0.08, right=0.93, top=0.95, bottom=0.03)
    try:
        fig.savefig(out_png, dpi=110, format="png")   # exactly where named: no ".png" appended
    except OSError as exc:
        raise ConfigError("--png", "a writable path", f"{out_png} ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return out_png


def _gib(v: Any) -> Optional[float]:
    return None if v is None else float(v) / GiB


def _rank_tag(r: Dict[str, Any], n_ranks: int) -> str:
    return f"rank {r.get('rank', 0)}: " if n_ranks > 1 else ""


def _label(r: Dict[str, Any]) -> str:
    kind = r.get("kind", "?")
    msg = str(r.get("message", ""))
    rank = f"rank {r['rank']} " if r.get("rank") else ""
    return f"{rank}{kind}: {msg[:110]}{'...' if len(msg) > 110 else ''}"


def write_html(runs: Runs, out_html: str, png_path: Optional[str] = None) -> str:
    """A one-file HTML page: the picture of ``runs`` (:func:`load_runs`; embedded) and every run's
    summary with every decision."""
    import tempfile

    own = png_path is None
    if own:
        fd, png_path = tempfile.mkstemp(suffix=".png")
        os.close(fd)
        draw_timeline(runs, png_path)
    with open(png_path, "rb") as fh:
        data = base64.b64encode(fh.read()).decode("ascii")
    if own:
        os.unlink(png_path)
    body = (f"<h1>memguard run report</h1><img alt='timeline' src='data:image/png;base64,{data}'>"
            f"<pre>{html.escape(report_text(runs))}</pre>")
    try:
        with open(out_html, "w", encoding="utf-8") as fh:
            fh.write(f"<!doctype html><meta charset='utf-8'><title>memguard report</title>{body}")
    except OSError as exc:
        raise ConfigError("--html", "a writable path", f"{out_html} ({exc.strerror or exc})") from None
    return out_html


def report_main(argv: Optional[List[str]] = None) -> int:
    """``memguard report FILE.jsonl [...] [--run ID ...] [--png OUT.png] [--html OUT.html]``."""
    import argparse

    p = argparse.ArgumentParser(prog="memguard report",
                                description="Draw guarded runs' event logs (MEMGUARD_LOG_DIR): memory per step "
                                            "against the budget, with the decisions, one series per run, and "
                                            "print a summary per run.")
    p.add_argument("files", nargs="+", metavar="FILE", help="event log(s) (.jsonl), or a folder of them")
    p.add_argument("--run", action="append", default=[], metavar="ID",
                   help="only this run (its id or a unique prefix; repeatable) [every run in FILE]")
    p.add_argument("--png", metavar="OUT", help="write the timeline picture here [FILE with .png]")
    p.add_argument("--html", metavar="OUT", help="also write a one-file HTML report")
    args = p.parse_args(argv)
    try:
        png = args.png or (os.path.splitext(args.files[0].rstrip("/"))[0] + ".png")
        # every output is checked before any work: nothing is written when one cannot be
        check_output(png, "--png")
        if args.html:
            check_output(args.html, "--html")
        runs = load_runs(args.files, args.run)
        draw_timeline(runs, png)
        print(report_text(runs))
        print(f"timeline: {png}")
        if args.html:
            print(f"html: {write_html(runs, args.html, png)}")
    except ConfigError as exc:
        print(f"memguard report: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
