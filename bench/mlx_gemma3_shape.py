"""Reproduce the Gemma-3-1B-shape mlx_lm LoRA case (``bench/configs/gemma3-1b-text.json``, random
weights, tied embeddings as the published checkpoint loads): one unmodified
``mlx_lm.tuner.trainer.train`` run, the peak of ``mx.get_peak_memory()`` per step, and memguard's
estimate from the live module and from the config. docs/mlx.md, "The 262k vocabulary".

Usage: .venv/bin/python bench/mlx_gemma3_shape.py [--seq 128] [--steps 3] [--layers N] [--vocab V]
       [--untied] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers override (smaller runs)")
    ap.add_argument("--vocab", type=int, default=None, help="vocab_size override")
    ap.add_argument("--untied", action="store_true", help="keep mlx_lm's untied lm_head of a bare ModelArgs build")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm.models import gemma3_text
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from memguard_core.estimator.estimate import estimate
    from memguard_mlx.specs import model_spec_from_mlx_module, train_spec

    here = os.path.dirname(os.path.abspath(__file__))
    cfg = json.load(open(os.path.join(here, "configs", "gemma3-1b-text.json")))
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    if a.vocab:
        cfg["vocab_size"] = a.vocab
    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    if not a.untied:
        model.sanitize({})  # no lm_head.weight in the checkpoint: mlx_lm ties it to embed_tokens
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 20.0, "dropout": 0.0,
                                                     "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    mx.eval(model.parameters())
    rng = np.random.default_rng(1)
    rows = [(rng.integers(3, cfg["vocab_size"], size=a.seq + 1).tolist(), 0) for _ in range(a.batch * a.steps)]

    class Rows:
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    class Peaks(TrainingCallback):
        def __init__(self):
            self.steps = []

        def on_train_loss_report(self, info):
            self.steps.append(int(mx.get_peak_memory()))
            mx.reset_peak_memory()

    out = f"/tmp/mlx_gemma3_{os.getpid()}.safetensors"
    opt = optim.AdamW(learning_rate=1e-5)
    args = TrainingArgs(batch_size=a.batch, iters=a.steps, steps_per_report=1, steps_per_eval=10**6,
                        steps_per_save=10**6, max_seq_length=a.seq + 1, adapter_file=out)
    ms = model_spec_from_mlx_module(model, args, name="gemma3-1b-shape")
    ts = train_spec(model, opt, args, ms, train_dataset=Rows())
    est = estimate(ms, ts)  # before the run: a failure here costs no measurement
    held = int(mx.get_active_memory())
    mx.reset_peak_memory()
    cb = Peaks()
    t0 = time.time()
    with contextlib.redirect_stdout(io.StringIO()):
        train(model, opt, Rows(), None, args=args, training_callback=cb)
    with contextlib.suppress(OSError):
        os.remove(out)
    peak = max(cb.steps)
    rec = dict(seq=a.seq, batch=a.batch, layers=ms.num_layers, vocab=ms.vocab_size, tied=ms.tie_word_embeddings,
               held_before_bytes=held, step_peak_bytes=cb.steps, peak_bytes=peak,
               estimate_bytes=est.peak_bytes, error_pct=round(100.0 * (est.peak_bytes - peak) / peak, 2),
               breakdown=est.breakdown, notes=list(est.notes), seconds=round(time.time() - t0, 1))
    print(json.dumps(rec, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
