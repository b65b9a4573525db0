"""``memguard demo --framework mlx``: a guarded real LoRA fine-tune with mlx_lm on this machine.

The same job as the HF demo (``memguard_hf/demo.py``), run by ``memguard_mlx.train`` -- the drop-in
for ``mlx_lm.tuner.trainer.train`` -- with mlx_lm's own model code, LoRA layers, batching and loss.
The model is mlx_lm's Llama (``mlx_lm.models.llama``) in SmolLM2's layout (GQA 2:1, SwiGLU, tied
head) at demo scale -- hidden 128, 4 blocks -- with random weights: MLX's CPU backend multiplies at a
few GFLOP/s on 2 cores, where SmolLM2-135M itself would take minutes per step. The text shipped
with memguard is tokenised byte-wise (ids 3..258), as in the HF demo.

The budget is chosen so that the requested batch does not fit (the estimate of half of it + 5 %, over
the warning level the preflight plans to);
the preflight plans k micro-batches per batch, which the drop-in applies in place. At ``--squeeze-at`` the demo
takes 15 % of the budget away, as a co-tenant would, and the runtime guard reacts. At the end: the
estimate vs the measured ``mx.get_peak_memory()``, and the proof that the optimizer updates, the LR
schedule and the samples per update were those of the requested run.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx.optimizers as optim
from mlx_lm.models import llama
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches
from mlx_lm.tuner.utils import linear_to_lora_layers

from memguard_core.estimator.estimate import estimate
from memguard_core.probes import probe
from memguard_core.report import (console, demo_budget, demo_result_table, demo_rows, demo_squeeze, mib,
                                  print_applied_plan, probe_table, yes_no)

from .specs import model_spec_from_mlx_module, train_spec
from .trainer import MlxGuard, train

logger = logging.getLogger("memguard.demo")


def estimate_table(est, budget_bytes, title):
    """The estimate's terms in MiB (the demo's figures are tens of MiB) and the verdict against
    ``budget_bytes``; ``memguard_core.report.estimate_table`` shows GiB."""
    from rich.table import Table

    t = Table(title=title, caption=f"predicts {est.counter}: mx.get_peak_memory(); phase {est.phase}")
    t.add_column("term")
    t.add_column("bytes", justify="right")
    for name, val in est.breakdown.items():
        if val:
            t.add_row(name, mib(val))
    t.add_section()
    t.add_row("[bold]peak", f"[bold]{mib(est.peak_bytes)}")
    fits = est.peak_bytes <= budget_bytes
    t.add_row("budget", f"{mib(budget_bytes)} ({'fits' if fits else '[red]does not fit[/red]'})")
    return t


DEMO_MODEL = dict(model_type="llama", hidden_size=128, num_hidden_layers=4, intermediate_size=384,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=259,
                  rope_theta=100000.0, tie_word_embeddings=True)


class ByteRows:
    """mlx_lm dataset protocol (``ds[i] -> (tokens, offset)``): non-overlapping windows of
    ``seq_length`` byte tokens over the shipped text (``memguard_core.report.demo_rows``)."""

    def __init__(self, seq_length: int):
        self.rows = demo_rows(seq_length)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i], 0


def build_model(seed: int = 0, rank: int = 16):
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(**DEMO_MODEL))
    model.freeze()
    linear_to_lora_layers(model, DEMO_MODEL["num_hidden_layers"], {"rank": rank, "scale": 2.0, "dropout": 0.0,
                                                                    "keys": ["self_attn.q_proj", "self_attn.k_proj",
                                                                             "self_attn.v_proj", "self_attn.o_proj"]})
    mx.eval(model.parameters())
    return model


class _Progress(TrainingCallback):
    def __init__(self):
        self.reports = []

    def on_train_loss_report(self, info):
        self.reports.append(dict(info))


def _squeezing_batches(guard: MlxGuard, at_update: int, grad_accum: int, fraction: float = 0.15):
    def batches(**kw):
        for i, b in enumerate(iterate_batches(**kw)):
            mon = guard.monitor
            if at_update and i == at_update * grad_accum and mon is not None:
                demo_squeeze(mon, fraction, f"update {at_update}", fmt=mib)
            yield b

    return batches


def run_demo(args) -> int:
    """Run the MLX demo; returns 0 when the run completed with the requested updates, LR sequence and
    samples per update."""
    con = console()
    con.rule("[bold]memguard demo: a guarded LoRA fine-tune (mlx_lm, MLX CPU backend)")
    con.print(probe_table(probe("mlx")))
    np.random.seed(0)
    t0 = time.time()
    model = build_model()
    ms = model_spec_from_mlx_module(model, name="llama (SmolLM2 layout, demo scale)")
    con.print(f"model: mlx_lm Llama, hidden 128, 4 blocks, GQA 4/2, tied head, random weights; LoRA r=16 on "
              f"q/k/v/o: {ms.total_params / 1e6:.2f}M params, {ms.trainable_params / 1e6:.3f}M trainable "
              f"(built in {time.time() - t0:.1f}s)")
    data = ByteRows(args.seq_length + 1)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="memguard_mlx_demo_"))
    out.mkdir(parents=True, exist_ok=True)
    iters = args.steps * args.grad_accum  # mlx_lm counts batches; an update every grad_accum of them
    targs = TrainingArgs(batch_size=args.batch_size, iters=iters, steps_per_report=max(1, args.grad_accum),
                         steps_per_eval=10**9, steps_per_save=10**9, max_seq_length=args.seq_length + 1,
                         grad_accumulation_steps=args.grad_accum, adapter_file=str(out / "adapters.safetensors"))
    sched = optim.join_schedules([optim.linear_schedule(0.0, 2e-3, 2), optim.cosine_decay(2e-3, args.steps)], [2])
    opt = optim.AdamW(learning_rate=sched)
    con.print(f"data: {len(data)} rows of {args.seq_length} byte tokens from the shipped text; requested "
              f"batch {args.batch_size} x accumulation {args.grad_accum} = effective batch "
              f"{args.batch_size * args.grad_accum}, {args.steps} optimizer updates ({iters} mlx_lm iterations)")

    ts = train_spec(model, opt, targs, ms, train_dataset=data)
    requested = estimate(ms, ts)
    # mx.get_peak_memory does not see the process's other memory: no resident surplus to count
    budget = demo_budget(ms, ts, args.budget_gib, margin=1.05, what="batch", fmt=mib)
    con.print(estimate_table(requested, budget, title="preflight: requested settings"))

    guard = MlxGuard(budget_bytes=budget, monitor_interval_s=0.2, apply=("micro_batch",),
                     leak_detector=True)
    progress = _Progress()
    t1 = time.time()
    train(model, opt, data, args=targs, training_callback=progress, guard=guard,
          iterate_batches=_squeezing_batches(guard, args.squeeze_at, args.grad_accum))
    wall = time.time() - t1

    print_applied_plan(guard.preflight)
    s = guard.summary
    updates = int(opt.state["step"])
    expected_lr = [float(sched(mx.array(i))) for i in range(args.steps)]  # lr used at update i+1 (mlx: scheduler(step) before step += 1)
    lr_ok = np.allclose(guard.learning_rates, expected_lr, rtol=1e-6, atol=1e-12)
    rows_per_update = sum(guard.micro_batch_rows) / max(1, updates)
    kept = updates == args.steps and lr_ok and rows_per_update == args.batch_size * args.grad_accum
    rows = [("optimizer updates (requested / done)", f"{args.steps} / {updates}"),
            ("LR schedule followed", yes_no(lr_ok)),
            ("rows per optimizer update", f"{rows_per_update:g}"),
            ("effective batch kept", yes_no(kept)),
            ("rows per forward seen", ", ".join(str(r) for r in sorted(set(guard.micro_batch_rows)))),
            ("micro-batches per batch by iteration", ", ".join(f"it {it}: k={k}" for it, k in guard.micro_batches_history)),
            ("runtime decisions", str(len(guard.events))),
            ("MLX limits set", ", ".join(f"{k}={mib(v)}" for k, v in guard.limits.items()) or "-"),
            ("leak reports", str(s["leaks"]))]
    con.print(demo_result_table(
        "memguard demo (mlx): result", rows, requested_peak_bytes=requested.peak_bytes, summary=s,
        measured="mx.get_peak_memory", budget_bytes=budget, end_budget_bytes=guard.monitor.budget_bytes,
        wall_s=wall, extra_rows=[("adapters", str(targs.adapter_file))], fmt=mib))
    return 0 if kept else 1
