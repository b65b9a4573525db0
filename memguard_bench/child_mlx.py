"""The MLX child of the bench: one unmodified ``mlx_lm.tuner.trainer.train`` run of a case in a fresh
interpreter, measured by ``mx.get_peak_memory()``, with the model and train facts
(``memguard_mlx.specs``) recorded beside it. docs/benchmarks.md.
"""

from __future__ import annotations

import os
import time
from typing import List

from .cases import arch_of
from .readings import json_safe

__all__ = ["run_mlx_child"]


def _build_model(kw: dict, arch: dict):
    """The case's architecture with random weights in the case's dtype, frozen but for what is
    trained: the last ``lora_layers`` blocks (every block by default) unfrozen for full
    fine-tuning, else LoRA-wrapped as mlx_lm's lora does."""
    import importlib

    import mlx.core as mx
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mod = importlib.import_module(f"mlx_lm.models.{arch['model_type']}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(arch))
    if kw["dtype"] in ("bf16", "fp16"):
        model.set_dtype(mx.bfloat16 if kw["dtype"] == "bf16" else mx.float16)
    model.freeze()
    n_layers = kw["lora_layers"] or arch.get("num_hidden_layers") or arch["n_layer"]
    if kw["method"] == "full":
        for layer in model.layers[-n_layers:]:  # mlx_lm lora.py, fine_tune_type="full"
            layer.unfreeze()
    else:
        cfg = {"rank": kw["lora_rank"], "scale": 20.0, "dropout": 0.0}
        if kw["lora_targets"] != ["all-linear"]:
            cfg["keys"] = [f"self_attn.{t}" for t in kw["lora_targets"]]
        linear_to_lora_layers(model, n_layers, cfg)
    mx.eval(model.parameters())
    return model


def _rows(kw: dict, vocab_size: int, steps: int):
    """The training rows: random token ids of ``seq_length + 1`` tokens, the same every run."""
    import numpy as np

    rng = np.random.default_rng(1)
    rows = [(rng.integers(3, vocab_size, size=kw["seq_length"] + 1).tolist(), 0)
            for _ in range(kw["batch_size"] * kw["grad_accum"] * steps)]

    class Rows:
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return rows[i]

    return Rows


def _step_peaks_callback():
    """An mlx_lm ``TrainingCallback`` recording each iteration's peak (bytes) and seconds."""
    import mlx.core as mx
    from mlx_lm.tuner.callbacks import TrainingCallback

    class StepPeaks(TrainingCallback):
        """mlx_lm reports after every iteration here (``steps_per_report=1``, after the
        iteration's ``mx.eval``): the peak since the last report is that iteration's
        (the first also holds the compile); then reset."""

        def __init__(self):
            self.steps: List[int] = []
            self.seconds: List[float] = []
            self._t = time.time()

        def on_train_loss_report(self, info):
            self.steps.append(int(mx.get_peak_memory()))
            mx.reset_peak_memory()
            now = time.time()
            self.seconds.append(round(now - self._t, 2))
            self._t = now

    return StepPeaks()


def run_mlx_child(case: dict) -> dict:
    """One unmodified ``mlx_lm.tuner.trainer.train`` run (``case["steps"]`` iterations, default 2)
    on random token rows; returns the measurement (bytes, seconds). The peak is
    ``mx.get_peak_memory()`` from before the first step (the weights, evaluated before, are in it)."""
    t0 = time.time()
    import contextlib
    import dataclasses
    import io

    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import TrainingArgs, train

    from memguard_mlx.specs import model_spec_from_mlx_module, train_spec

    kw = case["train"]
    arch = arch_of(case)
    steps = int(case.get("steps", 2))
    per_step = bool(case.get("per_step"))
    model = _build_model(kw, arch)
    Rows = _rows(kw, arch["vocab_size"], steps)
    opt = {"adamw": optim.AdamW, "adam": optim.Adam, "sgd": optim.SGD}[kw["optimizer"]](learning_rate=1e-4)
    out = os.path.join("/tmp", f"memguard_bench_{os.getpid()}.safetensors")
    args = TrainingArgs(batch_size=kw["batch_size"], iters=steps * kw["grad_accum"],
                        steps_per_report=1 if per_step else 1000,
                        steps_per_eval=10**6, steps_per_save=10**6, max_seq_length=kw["seq_length"] + 1,
                        adapter_file=out, grad_checkpoint=kw["grad_checkpoint"],
                        grad_accumulation_steps=kw["grad_accum"])
    ms = model_spec_from_mlx_module(model, args, name=case["arch"])
    ts = train_spec(model, opt, args, ms, train_dataset=Rows())
    mx.reset_peak_memory()
    cb = _step_peaks_callback() if per_step else None
    with contextlib.redirect_stdout(io.StringIO()):
        train(model, opt, Rows(), None, args=args, training_callback=cb)
    peak = int(mx.get_peak_memory())
    try:
        os.remove(out)
    except OSError:
        pass
    rec = dict(peak_bytes=peak, counter="mlx", seconds=time.time() - t0, model_spec=dataclasses.asdict(ms),
               train_spec=dataclasses.asdict(ts), model_config=json_safe(dataclasses.asdict(model.args))
               if dataclasses.is_dataclass(getattr(model, "args", None)) else None)
    if cb is not None:
        rec.update(peak_bytes=max(cb.steps + [peak]), step_peak_bytes=cb.steps, after_train_peak_bytes=peak,
                   step_seconds=cb.seconds)
    return rec
