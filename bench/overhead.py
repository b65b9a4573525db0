"""Guard overhead: median step time of the same real training run with and without memguard.

    python bench/overhead.py            # HF Trainer, Lightning, mlx_lm; ~8 min on 2 cores
    python bench/overhead.py --sessions 1 --rounds 4 --only hf

For each framework, the same run (a Llama-architecture model from config numbers, random weights:
hidden 128, 2 blocks, vocab 4096, micro-batch 8 x 64 tokens, full fine-tune with AdamW; mlx_lm:
hidden 64, vocab 1024, LoRA r=8 on every linear, as MLX's CPU backend is slow here) is trained
repeatedly in ONE process, unguarded and guarded in alternating order (off/on, on/off, ...; a
fresh Trainer / loop each time, the same model), after a warm-up pair. A run's step time is the
median over its steps after a warm-up; each adjacent pair gives a ratio guarded / unguarded, and
the result is the median of those ratios over all pairs of ``--sessions`` fresh processes: the
pairing cancels what differs between processes (memory layout, thread placement) and the drifts
of a shared machine, which made ratios of separate processes swing by +-5 % here. Target: <= 1.005.

Also measured (in this process): the cost of one per-step check (``MemoryMonitor.step_sample`` on
the real probe: /proc/self/status, /proc/meminfo, cgroup files, peak reset) and of one background
sample, as a fraction of the median step.

Writes bench/results/overhead.md (the table) and prints it (rich).
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

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "integration_tests"))

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


def child_hf(guarded: bool, steps: int, cache: dict):
    import torch
    torch.set_num_threads(2)
    ids = token_rows(ROWS * steps, SEQ, VOCAB)
    cbs, clock = [], GuardClock()
    if guarded:
        from memguard_hf import MemGuardCallback
        cb = MemGuardCallback()
        # the trainer binds the guard's wrappers at init; its hooks are looked up per call
        clock.wrap(cb, ("_guarded_training_step", "_weighted_compute_loss", "on_step_begin", "on_step_end"))
        cbs.append(cb)
    if "m" not in cache:
        cache["m"] = llama(VOCAB, HIDDEN, LAYERS, SEQ)
    before = (lambda tr: clock.wrap(cb, ("_orig_training_step", "_orig_compute_loss"), inner=True)) if guarded else None
    times = hf_run(cache["m"], ids, batch_size=ROWS, steps=steps, callbacks=cbs, before_train=before,
                   on_step_end=clock.step_end if guarded else None)[1]
    return times, clock.per_step if guarded else None


def child_lightning(guarded: bool, steps: int, cache: dict):
    import logging
    import lightning.pytorch as pl
    import torch
    for n in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(n).setLevel(logging.ERROR)
    torch.set_num_threads(2)
    ids = token_rows(ROWS * steps, SEQ, VOCAB)

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = llama(VOCAB, HIDDEN, LAYERS, SEQ)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    times, t = [], [0.0]
    clock = GuardClock()

    class Clock(pl.Callback):
        def on_train_batch_start(self, *a, **k):
            t[0] = time.perf_counter()

        def on_train_batch_end(self, *a, **k):
            times.append(time.perf_counter() - t[0])
            clock.step_end()

    class WrapInner(pl.Callback):
        # after the guard's setup (callbacks run in list order), which saved the module's originals
        def setup(self, trainer, pl_module, stage):
            if guarded and not getattr(self, "done", False):
                clock.wrap(cb, ("_orig_training_step", "_orig_zero_grad"), inner=True)
                self.done = True

    cbs = [Clock()]
    if guarded:
        from memguard_lightning import MemGuardCallback
        cb = MemGuardCallback()
        clock.wrap(cb, ("_guarded_training_step", "_guarded_zero_grad", "on_train_batch_start",
                        "on_before_optimizer_step", "on_train_batch_end"))
        cbs += [cb, WrapInner()]
    loader = torch.utils.data.DataLoader(torch.stack(ids), batch_size=ROWS)
    tr = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
    if "m" not in cache:
        cache["m"] = LM()
    tr.fit(cache["m"], loader)
    return times, clock.per_step if guarded else None


def child_mlx(guarded: bool, steps: int, cache: dict):
    import tempfile
    import numpy as np
    import mlx.optimizers as optim
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs
    from mlx_tiny import TokenRows, build_model
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


CHILDREN = {"hf": child_hf, "lightning": child_lightning, "mlx": child_mlx}
LABELS = {"hf": "HF Trainer", "lightning": "Lightning", "mlx": "mlx_lm (MLX CPU)"}


def session(fw: str, steps: int, rounds: int) -> dict:
    """One process: the same model trained ``rounds`` times unguarded and guarded, in the order
    off/on, on/off, off/on, ... (a fresh ``Trainer`` / loop each time, the guard attached or not).
    Round 0 is a warm-up (allocator, compile caches, page faults) and is dropped. Returns the
    per-run median step times (s) of each arm and the per-round paired ratios on/off."""
    cache: dict = {}
    off, on, pairs, own = [], [], [], []
    check = _time_step_samples()
    for r in range(rounds + 1):
        got = {}
        for g in ((False, True) if r % 2 == 0 else (True, False)):
            times, guard_s = CHILDREN[fw](g, steps, cache)
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


def run_session(fw: str, steps: int, rounds: int, shape: str = "toy") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", fw, "--steps", str(steps), "--rounds", str(rounds),
           "--shape", shape]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("SESSION "):
            return json.loads(line[8:])
    raise RuntimeError(f"{fw} session failed (rc={p.returncode}): {p.stderr[-2000:]}")


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=2, help="fresh processes per framework [2]")
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds per process, after a warm-up round [8]")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--only", default="", help="comma list of hf,lightning,mlx")
    ap.add_argument("--shape", default="toy,medium",
                    help="comma list of " + ",".join(SHAPES) + " [toy,medium]: model sizes (see SHAPES)")
    ap.add_argument("--child", default=None)
    a = ap.parse_args(argv)
    if a.child:
        global HIDDEN, LAYERS, VOCAB, SEQ
        HIDDEN, LAYERS, VOCAB, SEQ = SHAPES[a.shape]
        print("SESSION " + json.dumps(session(a.child, a.steps, a.rounds)), flush=True)
        return 0
    fws = [f for f in (a.only.split(",") if a.only else list(CHILDREN))]
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
    header = ["run", "unguarded ms/step (median run)", "guarded ms/step (median run)",
              "median paired ratio (target <= 1.005)", "paired ratios, quartiles", "ratio of medians",
              "pairs", "per-step check in the run (median)", "memguard's own time per step (median) / step"]
    sections = []
    for shape in shapes:
        hidden, layers, vocab, seq = SHAPES[shape]   # the children set their own from --shape
        these = [f for f in fws if shape == "toy" or f != "mlx"]
        res = {f: {"off": [], "on": [], "pairs": [], "own": [], "check": []} for f in these}
        for sidx in range(a.sessions):
            for f in these:
                r = run_session(f, a.steps, a.rounds, shape)
                for key in res[f]:
                    res[f][key] += r[key]
                print(f"{shape} session {sidx} {f}: paired ratios " + " ".join(f"{x:.3f}" for x in r["pairs"]) +
                      f" (median {statistics.median(r['pairs']):.4f})", flush=True)
        rows = []
        for f in these:
            off, on, pairs = res[f]["off"], res[f]["on"], sorted(res[f]["pairs"])
            n = len(pairs)
            q1, q3 = pairs[n // 4], pairs[(3 * n) // 4]
            own = statistics.median(res[f]["own"]) if res[f]["own"] else None
            check = statistics.median(res[f]["check"]) if res[f]["check"] else None
            rows.append([LABELS[f], f"{statistics.median(off) * 1e3:.1f}", f"{statistics.median(on) * 1e3:.1f}",
                         f"{statistics.median(pairs):.4f}", f"{q1:.3f} .. {q3:.3f}",
                         f"{statistics.median(on) / statistics.median(off):.4f}", str(n),
                         f"{check * 1e6:.0f} us" if check is not None else "-",
                         f"{own * 1e6:.0f} us = {own / statistics.median(off) * 100:.2f} %" if own is not None else "-"])
        model = (f"Llama-shape model (hidden {hidden}, {layers} blocks, vocab {vocab}), micro-batch {ROWS} x {seq} "
                 f"tokens, AdamW, full fine-tune" + (" (mlx_lm: hidden 64, vocab 1024, LoRA r=8 on every linear)"
                                                     if "mlx" in these else ""))
        sections.append((shape, model, header, rows))
        print_table(f"memguard guard overhead ({shape})", header, rows)
    wall = time.time() - t_start
    lines = ["# Guard overhead", "",
             f"`python bench/overhead.py` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, shared machine; "
             f"{wall / 60:.1f} min). Each process trains the same model {a.rounds + 1} x 2 times, unguarded and "
             f"guarded in alternating order (a fresh Trainer / loop each time, the guard with its defaults: preflight, "
             f"monitor thread at 0.5 s, per-micro-batch check), the first pair dropped as warm-up; "
             f"{a.sessions} processes per framework. A run's step time is the median of steps {WARMUP + 1}.."
             f"{a.steps}; a pair's ratio is guarded / unguarded of two adjacent runs, so drifts of this "
             f"shared machine and differences between processes cancel. The last column times memguard's own code "
             f"inside the guarded runs (its per-step hooks, and its wrappers of training_step / compute_loss / "
             f"zero_grad minus the wrapped call; the timing wrappers' own cost is included), a measure this "
             f"machine's step-time noise does not blur; the column before it is the per-micro-batch memory check "
             f"(`MemoryMonitor.step_sample`) alone, timed inside the same runs (right after a training step the "
             f"interpreter's and the kernel's caches are cold: it costs several times its warm-loop figure)."]
    for shape, model, hdr, rows in sections:
        lines += ["", f"## {shape}: {model}", "", *markdown_table(hdr, rows)]
    lines += ["", f"Per-step check in a warm loop (`MemoryMonitor.step_sample`, real Linux probe, this machine): "
              f"{costs['step_us']:.0f} us best of 5 x 3000 (median {costs['step_us_median']:.0f} us); background "
              f"sample (full probe with PSI, every 0.5 s on its own thread): {costs['background_us']:.0f} us."]
    write_result("overhead.md", lines)
    print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
