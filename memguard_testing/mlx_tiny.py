"""Tiny real mlx_lm models and data for the MLX integration tests (random weights, no hub).

Shapes are Llama / Qwen2 layouts (GQA, SwiGLU, RMSNorm; Qwen2 with q/k/v biases and a tied head)
at test scale: MLX's CPU backend runs matmuls at a few GFLOP/s on this machine.
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx
import mlx.optimizers as optim
from mlx_lm.models import llama, qwen2
from mlx_lm.tuner.utils import linear_to_lora_layers

ARCHS = {
    "llama": (llama, dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                          tie_word_embeddings=False)),
    "qwen2": (qwen2, dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256,
                          tie_word_embeddings=True)),
}


def build_model(arch: str = "llama", *, seed: int = 0, lora_rank: int = 4, lora_layers: int = 2,
                **overrides):
    """A LoRA'd mlx_lm model (mlx_lm's own ``linear_to_lora_layers``: every linear of the last
    ``lora_layers`` blocks), base frozen, as ``mlx_lm.lora`` builds it."""
    mod, cfg = ARCHS[arch]
    cfg = dict(cfg, **overrides)
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs(**cfg))
    model.freeze()
    if lora_rank:
        linear_to_lora_layers(model, lora_layers, {"rank": lora_rank, "scale": 10.0, "dropout": 0.0})
    mx.eval(model.parameters())
    return model


class TokenRows:
    """mlx_lm dataset protocol: ``ds[i] -> (tokens, offset)``, rows of varied lengths (so padding
    and masking matter), with an optional prompt offset (masked prompt tokens)."""

    def __init__(self, n: int = 48, *, vocab: int = 256, min_len: int = 6, max_len: int = 31,
                 seed: int = 1, offsets: bool = True):
        rng = np.random.default_rng(seed)
        self.rows = []
        for i in range(n):
            L = int(rng.integers(min_len, max_len + 1))
            off = int(rng.integers(0, L // 2)) if offsets else 0
            self.rows.append((rng.integers(3, vocab, size=L).tolist(), off))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def schedule_optimizer(lr: float = 1e-2, steps: int = 20):
    """AdamW with a warmup + cosine schedule (mlx_lm ``build_schedule`` style), so the LR differs at
    every update and a shifted update count would show."""
    warm = optim.linear_schedule(0.0, lr, 3)
    cos = optim.cosine_decay(lr, steps)
    return optim.AdamW(learning_rate=optim.join_schedules([warm, cos], [3]))


# ---------------------------------------------------------------------------------------------
# one tiny run, guarded or not, and its comparison with another


class Recorder:
    """An mlx_lm ``TrainingCallback`` keeping every train and validation report dict."""

    def __init__(self):
        self.train, self.val = [], []

    def on_train_loss_report(self, info):
        self.train.append(dict(info))

    def on_val_loss_report(self, info):
        self.val.append(dict(info))


def training_args(tmp, name: str, **kw):
    """mlx_lm ``TrainingArgs`` of the tiny runs (batch 8, 10 iterations, accumulation 2: 5 updates;
    validation at 1, 5, 10 on 2 batches; saves at 4 and 8) with the adapters under ``tmp/name``;
    ``kw`` overrides."""
    from pathlib import Path

    from mlx_lm.tuner.trainer import TrainingArgs

    base = dict(batch_size=8, iters=10, steps_per_report=1, steps_per_eval=5, val_batches=2,
                steps_per_save=4, max_seq_length=64, grad_accumulation_steps=2,
                adapter_file=str(Path(tmp) / name / "adapters.safetensors"))
    base.update(kw)
    (Path(tmp) / name).mkdir(parents=True, exist_ok=True)
    return TrainingArgs(**base)


def run_tiny(tmp, name: str, *, guarded: bool, arch: str = "llama", guard=None, loss=None, batches=None,
             resume_from=None, **kw) -> dict:
    """One tiny LoRA run: ``memguard_mlx.train`` (``guarded``) or ``mlx_lm.tuner.trainer.train``, on
    :class:`TokenRows` (48 rows train, 16 validation), numpy seeded 0 first (``iterate_batches``
    shuffles with numpy's global generator, as ``mlx_lm.lora`` seeds it). Returns model, opt, rec
    (:class:`Recorder`), guard, init / final trainable weights (numpy), args, secs."""
    import time

    from mlx.utils import tree_flatten
    from mlx_lm.tuner.trainer import default_loss, iterate_batches
    from mlx_lm.tuner.trainer import train as mlx_lm_train

    loss = default_loss if loss is None else loss
    batches = iterate_batches if batches is None else batches
    np.random.seed(0)
    model = build_model(arch)
    init = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    opt = schedule_optimizer()
    rec = Recorder()
    args = training_args(tmp, name, **kw)
    t0 = time.perf_counter()
    if guarded:
        import memguard_mlx

        extra = {} if resume_from is None else {"resume_from": resume_from}
        guard = memguard_mlx.train(model, opt, TokenRows(), TokenRows(16, seed=5), args=args, loss=loss,
                                   iterate_batches=batches, training_callback=rec, guard=guard, **extra)
    else:
        mlx_lm_train(model, opt, TokenRows(), TokenRows(16, seed=5), args=args, loss=loss,
                     iterate_batches=batches, training_callback=rec)
    secs = time.perf_counter() - t0
    final = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    return dict(model=model, opt=opt, rec=rec, guard=guard, init=init, final=final, args=args, secs=secs)


def assert_same_run(ref: dict, run: dict, atol: float = 1e-4) -> None:
    """Two :func:`run_tiny` results trained alike: 5 optimizer updates, the same reported
    iterations, learning rates, tokens, train and validation losses (rel 1e-5), checkpoint files and
    final weights (``atol`` / rtol 1e-3), the weights having moved far more than ``atol``."""
    from pathlib import Path

    import pytest

    assert int(run["opt"].state["step"]) == int(ref["opt"].state["step"]) == 5
    assert [d["iteration"] for d in run["rec"].train] == [d["iteration"] for d in ref["rec"].train]
    assert [d["learning_rate"] for d in run["rec"].train] == pytest.approx(
        [d["learning_rate"] for d in ref["rec"].train], rel=1e-7, abs=1e-12)
    assert [d["trained_tokens"] for d in run["rec"].train] == [d["trained_tokens"] for d in ref["rec"].train]
    assert [d["train_loss"] for d in run["rec"].train] == pytest.approx(
        [d["train_loss"] for d in ref["rec"].train], rel=1e-5)
    assert [d["iteration"] for d in run["rec"].val] == [d["iteration"] for d in ref["rec"].val]
    assert [d["val_loss"] for d in run["rec"].val] == pytest.approx([d["val_loss"] for d in ref["rec"].val],
                                                                    rel=1e-5)
    moved = max(float(np.abs(ref["final"][k] - ref["init"][k]).max()) for k in ref["final"])
    assert moved > 100 * atol
    for k in ref["final"]:
        np.testing.assert_allclose(run["final"][k], ref["final"][k], atol=atol, rtol=1e-3, err_msg=k)
    names = lambda r: sorted(p.name for p in Path(r["args"].adapter_file).parent.iterdir())  # noqa: E731
    assert names(run) == names(ref) == ["0000004_adapters.safetensors", "0000008_adapters.safetensors",
                                        "adapters.safetensors"]
    a, b = mx.load(run["args"].adapter_file), mx.load(ref["args"].adapter_file)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), atol=atol, rtol=1e-3)


#: The block census tests' dimensions (tests/test_mlx_census*.py)
CENSUS_DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=256, rms_norm_eps=1e-5)


def mlx_lm_model(model_type: str, **kw):
    """An mlx_lm ``Model`` of ``model_type`` from ``ModelArgs`` ``kw``, its random weights seeded (0)
    and evaluated."""
    import importlib

    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    m = mod.Model(mod.ModelArgs.from_dict(dict(model_type=model_type, **kw)))
    mx.eval(m.parameters())
    return m


def lfm2_model(layers: int, attn=(0,)):
    """An mlx_lm LFM2 hybrid at ``CENSUS_DIMS``: ``layers`` blocks, attention at the indices in
    ``attn``, short-convolution (``ShortConv``) blocks elsewhere; tied head."""
    return mlx_lm_model("lfm2", **dict(CENSUS_DIMS, num_hidden_layers=layers, max_position_embeddings=512,
                                       norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=128,
                                       block_ff_dim=256, block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                                       block_auto_adjust_ff_dim=False, full_attn_idxs=list(attn),
                                       rope_theta=10000.0, tie_embedding=True))
