"""Guard overhead: median step time of the same real training run with and without memguard.

    python bench/overhead.py                 # HF Trainer, Lightning, mlx_lm; ~35 min on 2 cores
    python bench/overhead.py --only hf --shape toy --sessions 1

HF Trainer and Lightning: ONE run per process (a Llama-architecture model from config numbers,
random weights; ``--shape`` toy: hidden 128, 2 blocks, vocab 4096, 8 x 64 tokens, about 30 ms a
step; medium: hidden 256, 4 blocks, vocab 8192, 8 x 128 tokens, about 0.2 s a step; full fine-tune
with AdamW) in which the guard is switched on and off every ``--block`` steps in ABBA order
(:class:`BlockSwitch`): an "off" step runs exactly the unguarded code. The result is the ratio of
the median guarded step to the median unguarded step, with a 95 % bootstrap interval over ABBA
cycles. Runs of their own (a fresh Trainer each) swung by up to 10 % in median step time on this
shared virtual machine, so pairs of whole runs could not resolve a 0.5 % effect; two steps apart,
both arms see the same machine. Target: <= 1.005.

mlx_lm (whose guarded loop is ``memguard_mlx.train``, not a callback): runs of 25 steps, unguarded
(``mlx_lm.tuner.trainer.train``) and guarded in alternating order in one process; median of the
paired ratios.

Also measured: memguard's own time per guarded step (its hooks and wrappers, timed inside the
runs), the per-micro-batch check (``MemoryMonitor.step_sample`` on the real probe) inside the runs
and in a warm loop, and one background sample.

Writes bench/results/overhead.md (the tables) and prints them (rich).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _common import ROOT, child_env, hf_run, llama, markdown_table, print_table, token_rows, write_result

#: (hidden, blocks, vocab, tokens per row) of the Llama-shape model per ``--shape``: ``toy`` has
#: 30 ms steps (the hardest case for a fixed per-step cost), ``medium`` (6.6M parameters, 8 x 128
#: tokens) about 0.2 s steps, still far shorter than a real fine-tune's. mlx_lm runs ``toy`` only
#: (MLX's CPU matmul is slow here).
SHAPES = {"toy": (128, 2, 4096, 64), "medium": (256, 4, 8192, 128)}
HIDDEN, LAYERS, VOCAB, SEQ = SHAPES["toy"]
ROWS = 8
WARMUP = 3


class GuardClock:
    """Wall time spent in memguard's own code during a guarded run, per optimizer step: its
    per-step hooks, plus its wrappers' time outside the call they wrap (outer - inner). One-off work
    (the preflight at the first step) shows up in one step only, so the median per step leaves it out."""

    def __init__(self) -> None:
        self.outer = self.inner = 0.0
        self._last = 0.0
        self.per_step: list = []

    def wrap(self, obj, names, inner: bool = False) -> None:
        for name in names:
            f = getattr(obj, name)

            def timed(*a, _f=f, **k):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    if inner:
                        self.inner += dt
                    else:
                        self.outer += dt
            setattr(obj, name, timed)

    def step_end(self) -> None:
        now = self.outer - self.inner
        self.per_step.append(now - self._last)
        self._last = now


def child_mlx(guarded: bool, steps: int, cache: dict):
    import tempfile
    import numpy as np
    import mlx.optimizers as optim
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs
    from memguard_testing.mlx_tiny import TokenRows, build_model
    # MLX's CPU backend runs matmuls at a few GFLOP/s here: a smaller shape keeps steps near 0.1 s
    if "m" not in cache:
        cache["m"] = build_model("llama", lora_rank=8, lora_layers=LAYERS, hidden_size=64, num_hidden_layers=LAYERS,
                                 intermediate_size=128, vocab_size=1024)
    model = cache["m"]
    stamps = []
    clock = GuardClock()

    class Clock(TrainingCallback):
        def on_train_loss_report(self, info):
            stamps.append(time.perf_counter())
            clock.step_end()

    d = tempfile.mkdtemp()
    args = TrainingArgs(batch_size=ROWS, iters=steps, steps_per_report=1, steps_per_eval=10**6, val_batches=1,
                        steps_per_save=10**6, max_seq_length=SEQ, adapter_file=os.path.join(d, "a.safetensors"))
    data = TokenRows(ROWS * steps, vocab=1024, min_len=SEQ - 8, max_len=SEQ, offsets=False)
    val = TokenRows(ROWS, vocab=1024, min_len=SEQ - 8, max_len=SEQ, offsets=False, seed=5)
    np.random.seed(0)
    opt = optim.AdamW(learning_rate=1e-4)
    if guarded:
        import memguard_mlx
        guard = memguard_mlx.MlxGuard()
        # the guard's per-batch work; the loop's own difference from mlx_lm's (the gradient is
        # evaluated before the update, so that an allocation failure can be redone in chunks) is
        # not a call to time: the paired ratio carries it
        clock.wrap(guard, ("split_for_batch", "after_update", "peak_so_far"))
        memguard_mlx.train(model, opt, data, val, args=args, training_callback=Clock(), guard=guard)
    else:
        from mlx_lm.tuner.trainer import train
        train(model, opt, data, val, args=args, training_callback=Clock())
    return [b - a for a, b in zip(stamps, stamps[1:])], (clock.per_step[1:] if guarded else None)


class BlockSwitch:
    """Switches the guard on and off in blocks of steps inside ONE training run.

    ``attach(obj, names)`` remembers the guard's wrappers that the framework holds as instance
    attributes (``Trainer.training_step`` / ``compute_loss``, ``LightningModule.training_step`` /
    ``optimizer_zero_grad``); ``off()`` deletes them (the class's own methods answer again), takes
    the guard out of the callback list (a new list: the framework may be iterating the old one) and
    makes the monitor thread skip its samples; ``on()`` puts all of it back. An "off" step runs
    exactly the code of an unguarded run; the thread still wakes every 0.5 s in both arms (an
    ``Event.wait`` timeout, a few microseconds), its sample only in "on" steps.

    Steps are timed from one step's first hook to the next step's: everything the step does (the
    guard's hooks, the data loader, the optimizer) is inside. The order of blocks is on, off, off,
    on, on, off, ... (ABBA, so a drift of the machine within a pair of blocks cancels); the switch
    happens between two steps' timings, outside both.
    """

    def __init__(self, block: int, control: bool = False) -> None:
        self.block = block
        self.control = control
        self.enabled = True
        self.held: dict = {}
        self.attached = False
        self.times: list = []      # (guard on?, seconds) per kept step
        self.step = 0
        self._t = None

    def attach(self, first, obj, names, get_cbs, set_cbs, guard, monitor_of) -> None:
        """``first``: the callback calling :meth:`tick`, put at the front (before the guard)."""
        self.attached = True
        self.first, self.obj, self.names = first, obj, names
        self.held = {n: obj.__dict__[n] for n in names}
        self.get_cbs, self.set_cbs, self.guard = get_cbs, set_cbs, guard
        self._switch(True)   # the order: this callback, the guard, the rest
        mon = monitor_of()
        if mon is None:
            return        # an empty callback in the guard's place: nothing else to switch
        if self.control:
            # A/A control: the guard out and its thread stopped for the whole run, the labels still
            # alternate: the ratio then measures the method's own noise and bias
            self._switch(False)
            mon.stop()
            self._switch = self._relabel
        real = mon.background_sample
        mon.background_sample = lambda: real() if self.enabled else None

    def arm_for(self, step: int) -> bool:
        b = step // self.block
        return (b % 4) in (0, 3)   # ABBA: on, off, off, on

    def tick(self) -> None:
        """Call first thing at every step start."""
        now = time.perf_counter()
        if self._t is not None:
            self.times.append((self.enabled, now - self._t))
        self.step += 1
        want = self.arm_for(self.step)
        if want != self.enabled:
            self._switch(want)
        self._t = time.perf_counter()

    def _relabel(self, on: bool) -> None:
        self.enabled = on

    def _switch(self, on: bool) -> None:
        cbs = [self.first] + [c for c in self.get_cbs() if c is not self.guard and c is not self.first]
        if on:
            for n, f in self.held.items():
                setattr(self.obj, n, f)
            cbs.insert(1, self.guard)
        else:
            for n in self.names:
                self.obj.__dict__.pop(n, None)
        self.set_cbs(cbs)
        self.enabled = on


def child_hf_blocks(steps: int, block: int, control: bool = False):
    import torch
    from transformers import TrainerCallback
    torch.set_num_threads(2)
    from memguard_hf import MemGuardCallback
    ids = token_rows(ROWS * steps, SEQ, VOCAB)
    sw = BlockSwitch(block, control)
    cb = MemGuardCallback()
    clock = GuardClock()
    clock.wrap(cb, ("_guarded_training_step", "_weighted_compute_loss", "on_step_begin", "on_step_end"))

    class Switch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not sw.attached:
                tr = cb.trainer
                h = tr.callback_handler
                sw.attach(self, tr, ("training_step", "compute_loss"), lambda: h.callbacks,
                          lambda new: setattr(h, "callbacks", new), cb, lambda: cb.monitor)
                clock.wrap(cb, ("_orig_training_step", "_orig_compute_loss"), inner=True)
            sw.tick()

        def on_step_end(self, *a, **k):
            if sw.enabled:
                clock.step_end()

    model = llama(VOCAB, HIDDEN, LAYERS, SEQ)
    hf_run(model, ids, batch_size=ROWS, steps=steps, callbacks=[cb, Switch()])
    return sw.times, clock.per_step


def child_lightning_blocks(steps: int, block: int, control: bool = False, null: bool = False):
    import logging
    import lightning.pytorch as pl
    import torch
    for n in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(n).setLevel(logging.ERROR)
    torch.set_num_threads(2)
    from memguard_lightning import MemGuardCallback
    ids = token_rows(ROWS * steps, SEQ, VOCAB)
    sw = BlockSwitch(block, control)
    clock = GuardClock()
    if null:
        # an empty Callback switched in and out instead of the guard: Lightning's dispatch of every
        # hook to every callback (a profiler context and a state_key string each) is what any
        # callback costs, the guard included
        cb = type("EmptyCallback", (pl.Callback,), {})()
    else:
        cb = MemGuardCallback()
        clock.wrap(cb, ("_guarded_training_step", "_guarded_zero_grad", "on_train_batch_start",
                        "on_before_optimizer_step", "on_train_batch_end"))

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = llama(VOCAB, HIDDEN, LAYERS, SEQ)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Switch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not sw.attached and null:
                sw.attach(self, pl_module, (), lambda: trainer.callbacks,
                          lambda new: setattr(trainer, "callbacks", new), cb, lambda: None)
            elif not sw.attached and cb.monitor is not None:
                sw.attach(self, pl_module, ("training_step", "optimizer_zero_grad"), lambda: trainer.callbacks,
                          lambda new: setattr(trainer, "callbacks", new), cb, lambda: cb.monitor)
                clock.wrap(cb.step, ("orig_training_step", "orig_zero_grad"), inner=True)
            if sw.attached:
                sw.tick()

        def on_train_batch_end(self, *a, **k):
            if sw.enabled and sw.attached:
                clock.step_end()

    loader = torch.utils.data.DataLoader(torch.stack(ids), batch_size=ROWS)
    # the guard first: its first on_train_batch_start runs the preflight and starts the monitor
    tr = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, Switch()])
    tr.fit(LM(), loader)
    return sw.times, clock.per_step


def block_session(fw: str, steps: int, block: int, mode: str = "guard") -> dict:
    """One process, one run of ``steps`` steps with the guard switched on and off in blocks of
    ``block`` steps (see :class:`BlockSwitch`); the first 4 blocks (one ABBA cycle: allocator
    warm-up, the preflight) are dropped. Returns each kept step as (cycle index, guard on?,
    seconds), memguard's own time per guarded step, and the per-micro-batch check's durations."""
    check = _time_step_samples()
    if fw == "hf":
        times, own = child_hf_blocks(steps, block, mode == "control")
    else:
        times, own = child_lightning_blocks(steps, block, mode == "control", mode == "null")
    cycle = 4 * block
    kept = [(i // cycle, on, dt) for i, (on, dt) in enumerate(times) if i >= cycle]
    return {"steps": kept, "own": own[2 * block:], "check": check[len(check) // 10:]}


def ratio_of_medians(steps) -> float:
    on = [dt for _, g, dt in steps if g]
    off = [dt for _, g, dt in steps if not g]
    return statistics.median(on) / statistics.median(off)


def session_ratio(sessions) -> float:
    """Geometric mean over processes of each one's ratio of medians (processes differ in speed by
    a few percent: pooling their steps would mix those differences into the medians)."""
    import math
    return math.exp(statistics.fmean(math.log(ratio_of_medians(steps)) for steps in sessions))


def cycle_bootstrap(sessions, n: int = 2000, seed: int = 0):
    """95 % interval of :func:`session_ratio`, resampling whole ABBA cycles with replacement within
    each process (a cycle holds both arms in balance, and its steps share the machine's state of
    the moment)."""
    import random
    rng = random.Random(seed)
    cycles = []
    for steps in sessions:
        by: dict = {}
        for st in steps:
            by.setdefault(st[0], []).append(st)
        cycles.append(list(by.values()))
    stats = sorted(session_ratio([[st for _ in cs for st in rng.choice(cs)] for cs in cycles])
                   for _ in range(n))
    return stats[int(0.025 * n)], stats[int(0.975 * n) - 1]


def session(fw: str, steps: int, rounds: int) -> dict:
    """mlx_lm (whose guarded loop is ``memguard_mlx.train`` itself, not a switchable callback): one
    process, the same model trained ``rounds`` times unguarded and guarded, in the order
    off/on, on/off, off/on, ... (a fresh ``Trainer`` / loop each time, the guard attached or not).
    Round 0 is a warm-up (allocator, compile caches, page faults) and is dropped. Returns the
    per-run median step times (s) of each arm and the per-round paired ratios on/off."""
    cache: dict = {}
    off, on, pairs, own = [], [], [], []
    check = _time_step_samples()
    for r in range(rounds + 1):
        got = {}
        for g in ((False, True) if r % 2 == 0 else (True, False)):
            times, guard_s = child_mlx(g, steps, cache)
            got[g] = statistics.median(times[WARMUP:])
            if guard_s and r > 0:
                own.append(statistics.median(guard_s[WARMUP:]))
        if r == 0:
            continue
        off.append(got[False])
        on.append(got[True])
        pairs.append(got[True] / got[False])
    return {"off": off, "on": on, "pairs": pairs, "own": own, "check": check[len(check) // 10:]}


def _time_step_samples() -> list:
    """Time every ``MemoryMonitor.step_sample`` call of this process (seconds, appended to the
    returned list): the per-micro-batch check as it runs inside training."""
    from memguard_core.monitor import MemoryMonitor
    durations: list = []
    real = MemoryMonitor.step_sample

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            durations.append(time.perf_counter() - t0)
    MemoryMonitor.step_sample = timed
    return durations


def run_child(args: list) -> dict:
    """Run this file with ``--child ...`` in a fresh process; returns its SESSION record."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("SESSION "):
            return json.loads(line[8:])
    raise RuntimeError(f"{args[0]} session failed (rc={p.returncode}): {p.stderr[-2000:]}")


def check_costs(n: int = 3000) -> dict:
    """Microseconds per step_sample / background_sample of a real monitor on this machine."""
    from memguard_core.monitor import MemoryMonitor
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0)
    mon.prime()
    for _ in range(50):
        mon.step_sample(0)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            mon.step_sample(0)
        samples.append((time.perf_counter() - t0) / n * 1e6)
    bg = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 10):
            mon.background_sample()
        bg.append((time.perf_counter() - t0) / (n // 10) * 1e6)
    return {"step_us": min(samples), "step_us_median": statistics.median(samples), "background_us": min(bg)}


#: steps per process and shape of the switched (HF, Lightning) runs: about 2 minutes each here
BLOCK_STEPS = {"toy": 3000, "medium": 400}
LABELS = {"hf": "HF Trainer", "lightning": "Lightning", "mlx": "mlx_lm (MLX CPU)"}


def _pct(x: float) -> str:
    return f"{x * 100:.2f} %"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Writes bench/results/overhead.md. About 35 minutes with the defaults on 2 cores.")
    ap.add_argument("--sessions", type=int, default=2, help="fresh processes per framework and shape [2]")
    ap.add_argument("--steps", type=int, default=0,
                    help="steps per switched (HF, Lightning) run [toy 3000, medium 400]")
    ap.add_argument("--block", type=int, default=2, help="steps per on / off block of a switched run [2]")
    ap.add_argument("--rounds", type=int, default=8, help="mlx_lm: paired rounds per process, after a warm-up round [8]")
    ap.add_argument("--mlx-steps", type=int, default=25, help="mlx_lm: steps per run [25]")
    ap.add_argument("--only", default="", help="comma list of hf,lightning,mlx [all three]")
    ap.add_argument("--shape", default="toy,medium",
                    help="comma list of " + ",".join(SHAPES) + " [toy,medium]: model sizes (see SHAPES)")
    ap.add_argument("--no-control", action="store_true",
                    help="skip the reference rows: the A/A control (HF, guard off in both arms: the method's "
                         "own noise) and Lightning with an empty Callback (what any callback costs)")
    ap.add_argument("--mode", default="guard", help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.block < 1 or a.sessions < 1 or a.rounds < 1:
        ap.error("--block, --sessions and --rounds must be >= 1")
    if a.child:
        global HIDDEN, LAYERS, VOCAB, SEQ
        HIDDEN, LAYERS, VOCAB, SEQ = SHAPES[a.shape]
        rec = session("mlx", a.mlx_steps, a.rounds) if a.child == "mlx" else \
            block_session(a.child, a.steps or BLOCK_STEPS[a.shape], a.block, a.mode)
        print("SESSION " + json.dumps(rec), flush=True)
        return 0
    fws = [f for f in (a.only.split(",") if a.only else list(LABELS))]
    for f in fws:
        if f not in LABELS:
            ap.error(f"--only: {f!r} is not one of {', '.join(LABELS)}")
    try:
        import mlx_lm  # noqa: F401
    except Exception:
        fws = [f for f in fws if f != "mlx"]
    try:
        import lightning  # noqa: F401
    except Exception:
        fws = [f for f in fws if f != "lightning"]
    shapes = [x for x in a.shape.split(",") if x]
    for x in shapes:
        if x not in SHAPES:
            ap.error(f"--shape: {x!r} is not one of {', '.join(SHAPES)}")
    t_start = time.time()
    costs = check_costs()
    header = ["run", "steps per arm", "unguarded ms/step (median)", "guarded ms/step (median)",
              "guarded / unguarded (target <= 1.005)", "95 % interval (cycle bootstrap)", "ratio at q1 / q3",
              "per-step check in the run (median)", "memguard's own time per step (median) / step"]
    sections = []
    for shape in shapes:
        hidden, layers, vocab, seq = SHAPES[shape]   # the children set their own from --shape
        rows = []
        runs = [(LABELS[f], f, "guard") for f in fws if f != "mlx"]
        if "lightning" in fws and not a.no_control:
            runs.append(("Lightning, an empty Callback in the guard's place", "lightning", "null"))
        if "hf" in fws and not a.no_control:
            runs.append(("A/A control: HF Trainer, guard off in both arms", "hf", "control"))
        for label, f, mode in runs:
            control = mode != "guard"
            steps, own, check, sessions = [], [], [], []
            for sidx in range(a.sessions):
                r = run_child([f, "--shape", shape, "--steps", str(a.steps or BLOCK_STEPS[shape]),
                               "--block", str(a.block), "--mode", mode])
                sessions.append(r["steps"])
                steps += r["steps"]
                own += r["own"]
                check += r["check"]
                print(f"{shape} {label} session {sidx}: ratio of medians {ratio_of_medians(r['steps']):.4f} "
                      f"({len(r['steps'])} steps)", flush=True)
            on = sorted(dt for _, g, dt in steps if g)
            off = sorted(dt for _, g, dt in steps if not g)
            lo, hi = cycle_bootstrap(sessions)
            q = lambda xs, p: xs[int(p * (len(xs) - 1))]  # noqa: E731
            med_off = statistics.median(off)
            own_med = statistics.median(own) if own and not control else None
            rows.append([label, str(min(len(on), len(off))), f"{med_off * 1e3:.1f}",
                         f"{statistics.median(on) * 1e3:.1f}", f"{session_ratio(sessions):.4f}",
                         f"{lo:.4f} .. {hi:.4f}", f"{q(on, .25) / q(off, .25):.4f} / {q(on, .75) / q(off, .75):.4f}",
                         f"{statistics.median(check) * 1e6:.0f} us" if check and not control else "-",
                         f"{own_med * 1e6:.0f} us = {_pct(own_med / med_off)}" if own_med is not None else "-"])
        if rows:
            model = (f"Llama-shape model (hidden {hidden}, {layers} blocks, vocab {vocab}), micro-batch {ROWS} x "
                     f"{seq} tokens, AdamW, full fine-tune, torch on 2 threads")
            sections.append((f"{shape}: {model}", header, rows))
            print_table(f"memguard guard overhead ({shape}, switched in one run)", header, rows)
    mlx_rows = []
    if "mlx" in fws:
        res = {"off": [], "on": [], "pairs": [], "own": [], "check": []}
        for sidx in range(a.sessions):
            r = run_child(["mlx", "--shape", "toy", "--rounds", str(a.rounds), "--mlx-steps", str(a.mlx_steps)])
            for key in res:
                res[key] += r[key]
        pairs = sorted(res["pairs"])
        n = len(pairs)
        own_med = statistics.median(res["own"])
        med_off = statistics.median(res["off"])
        mhdr = ["run", "pairs", "unguarded ms/step (median run)", "guarded ms/step (median run)",
                "median paired ratio (target <= 1.005)", "paired ratios, quartiles", "per-step check in the run (median)",
                "memguard's own time per step (median) / step"]
        mlx_rows = [[LABELS["mlx"], str(n), f"{med_off * 1e3:.1f}", f"{statistics.median(res['on']) * 1e3:.1f}",
                     f"{statistics.median(pairs):.4f}", f"{pairs[n // 4]:.3f} .. {pairs[(3 * n) // 4]:.3f}",
                     f"{statistics.median(res['check']) * 1e6:.0f} us" if res["check"] else "-",
                     f"{own_med * 1e6:.0f} us = {_pct(own_med / med_off)}"]]
        print_table("memguard guard overhead (mlx_lm, paired runs)", mhdr, mlx_rows)
    wall = time.time() - t_start
    lines = ["# Guard overhead", "",
             f"`python bench/overhead.py` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, shared virtual machine; "
             f"{wall / 60:.1f} min).", "",
             f"**HF Trainer and Lightning: the guard switched on and off inside one run.** Each process trains the "
             f"model once, for the steps in the table's second column times two, with the guard (its defaults: "
             f"preflight, monitor thread at 0.5 s, per-micro-batch check) switched on and off in blocks of "
             f"{a.block} steps in the order on, off, off, on (ABBA): an off step runs exactly the unguarded code "
             f"(the guard's wrappers and callback taken out, the monitor thread's samples skipped). Step time = from "
             f"one step's first hook to the next step's, so the guard's hooks, the data loader and the optimizer "
             f"are inside; the first cycle is dropped; {a.sessions} processes per row. On this shared machine "
             f"separate runs of the same thing differ by up to 10 % in median step time, far more than the effect "
             f"measured; switching every {a.block} steps puts both arms under the same conditions. The ratio is "
             f"the median guarded step over the median unguarded step of a process, geometric mean over the "
             f"processes; the interval a bootstrap over whole ABBA cycles within each process. Two reference rows "
             f"measure the method itself: the A/A control switches nothing (the guard is off in both arms, only "
             f"the labels alternate), and the empty-callback row switches a Lightning `Callback` without any hook "
             f"in and out in the guard's place (Lightning's dispatch of every hook to every callback: what any "
             f"callback costs). The last column times memguard's own code inside the guarded "
             f"steps (its hooks, and its wrappers minus the call they wrap; the timing wrappers' own cost "
             f"included), a figure the step-time noise does not blur; the column before it is the per-micro-batch "
             f"memory check (`MemoryMonitor.step_sample`) alone, in the same runs (right after a training step the "
             f"interpreter's and the kernel's caches are cold: it costs several times its warm-loop figure)."]
    for title, hdr, rows in sections:
        lines += ["", f"## {title}", "", *markdown_table(hdr, rows)]
    if mlx_rows:
        lines += ["", f"## mlx_lm: hidden 64, 2 blocks, vocab 1024, LoRA r=8 on every linear, micro-batch {ROWS} x "
                  f"{SHAPES['toy'][3]} tokens (MLX CPU)", "",
                  f"The guarded loop is `memguard_mlx.train` itself, not a callback that can be switched off: each "
                  f"process trains the same model {a.rounds + 1} x 2 times ({a.mlx_steps} steps), with "
                  f"`mlx_lm.tuner.trainer.train` and with `memguard_mlx.train`, in alternating order, the first pair "
                  f"dropped; a pair's ratio is guarded / unguarded of two adjacent runs.", "", *markdown_table(mhdr, mlx_rows)]
    lines += ["", f"Per-step check in a warm loop (`MemoryMonitor.step_sample`, real Linux probe, this machine): "
              f"{costs['step_us']:.0f} us best of 5 x 3000 (median {costs['step_us_median']:.0f} us); background "
              f"sample (full probe with PSI, every 0.5 s on its own thread): {costs['background_us']:.0f} us."]
    write_result("overhead.md", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
