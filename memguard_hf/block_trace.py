"""The kinds of block a transformers config builds, and for each kind the estimator's rules do not
model (a Mamba mixer, a short convolution, a gated delta net) the bytes one block saves for its
backward per token, from a census of the model's own code run on fake tensors under the run's
settings. docs/estimator.md, "Block kinds".
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any, Dict, Tuple

from memguard_core.estimator.heads import AUTO_CLASSES, head_of
from memguard_core.estimator.specs import ModelSpec, TrainSpec, trace_key
from memguard_torch.block_kinds import block_kinds, find_blocks
from memguard_torch.saved_census import saved_bytes_per_block

from .trace.build import build_model, dtypes, load_config, resolve_lora_targets

__all__ = ["with_block_kinds"]

logger = logging.getLogger("memguard.hf")

# (config fingerprint, trace key, seq length, head's Auto class) -> (kinds, seconds): a planner or a CLI that asks
# twice for the same model and settings traces once.
_CACHE: Dict[Tuple[str, str, int, str], Tuple[tuple, float]] = {}


def with_block_kinds(config_or_path: Any, ms: ModelSpec, ts: TrainSpec) -> ModelSpec:
    """``ms`` with :attr:`ModelSpec.block_kinds` read from the model ``config_or_path`` builds
    (on the meta device, PEFT's LoRA on it as ``ts`` says), and, for every kind the rules do not
    model, its saved bytes per token per block from a census of one forward on fake tensors at
    ``ts``'s sequence length (one row: saved tensors scale with the rows).

    Never raises: a config that does not build or a model whose code cannot run on fake tensors
    (a data-dependent shape) leaves the kinds untraced (``saved_per_token`` None) -- the estimate
    then says they were counted by the rules -- and the reason is logged on ``memguard.hf``.

    Args:
        config_or_path: a config path / folder / dict / ``PretrainedConfig``.
        ms: the spec read from the same config.
        ts: the settings the census runs under (``trace_key``).
    """
    try:
        kinds, seconds = _kinds(config_or_path, ts, AUTO_CLASSES[head_of(ms).kind])
    except Exception as exc:  # the census must never stop an estimate
        logger.info("block kinds not read (%s: %s); every block counted by the rules", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return ms
    if any(k.saved_per_token is not None for k in kinds):
        logger.info("traced %s in %.1f s (saved tensors per token, fake tensors)",
                    ", ".join(f"{k.name} x {k.count}" for k in kinds if k.saved_per_token is not None), seconds)
    return ms.replace(block_kinds=kinds)


def _kinds(config_or_path: Any, ts: TrainSpec, auto_class: str) -> Tuple[tuple, float]:
    cfg = load_config(config_or_path)
    ts = resolve_lora_targets(ts, cfg)
    key = (cfg.to_json_string(use_diff=False), trace_key(ts), ts.seq_length, auto_class)
    if key in _CACHE:
        return _CACHE[key]
    t0 = time.perf_counter()
    amp, compute, wdtype = dtypes(ts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, inner = build_model(cfg, ts, wdtype, auto_class)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    blocks = find_blocks(inner, getattr(text_cfg, "num_hidden_layers", None))
    kinds, where = block_kinds(blocks)
    if all(k.modelled for k in kinds):
        out = (kinds, time.perf_counter() - t0)
    else:
        try:
            per = _census(model, inner, blocks, ts, amp, compute, int(text_cfg.vocab_size))
        except Exception as exc:
            logger.info("census of %s on fake tensors failed (%s: %s): those blocks are counted by the rules",
                        ", ".join(k.name for k in kinds if not k.modelled), type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "")
            per = None
        s = ts.seq_length
        kinds = tuple(k if k.modelled or per is None else
                      dataclasses.replace(k, saved_per_token=sum(per[i] for i in where[k.name]) / (k.count * s),
                                          traced_under=trace_key(ts))
                      for k in kinds)
        out = (kinds, time.perf_counter() - t0)
    _CACHE[key] = out
    return out


def _census(model: Any, inner: Any, blocks: list, ts: TrainSpec, amp: bool, compute: Any, vocab: int) -> list:
    """Saved bytes per block of one forward of one row of ``ts.seq_length`` tokens, in training
    mode without checkpointing, under autocast when ``amp``, on fake CPU tensors."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if hasattr(inner, "tie_weights"):
            inner.tie_weights()
        model.train()
        ids = torch.randint(0, vocab, (1, ts.seq_length))
        state = list(model.parameters()) + list(model.buffers())
        autocast = torch.autocast("cpu", dtype=compute) if amp else contextlib.nullcontext()

        def forward():
            with autocast:
                model(input_ids=ids)

        return saved_bytes_per_block(forward, blocks, exclude=state)
