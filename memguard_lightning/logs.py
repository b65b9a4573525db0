"""``self.log`` values of a step cut into micro-batches: recorded per chunk and logged once per batch,
combined by their ``reduce_fx``, so Lightning sees the unsplit batch's values. Used by the training
step (``memguard_lightning.step``) and the evaluation split (``memguard_lightning.eval``);
see docs/lightning.md, "How the step runs"."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

__all__ = ["LogRecorder", "Discard"]


class LogRecorder:
    """Stands in for ``LightningModule.log`` during a split step: records each chunk's calls and
    replays them once per name, combined over the chunks by the call's ``reduce_fx``: ``sum`` /
    ``max`` / ``min`` over the chunks' values, anything else (``mean``, the default) as the
    chunk-weighted mean; an explicit ``batch_size`` is replayed as the chunks' total."""

    def __init__(self, real_log):
        self.real_log = real_log
        self.committed: List[Tuple[float, List[tuple]]] = []
        self.current: List[tuple] = []

    def __call__(self, name, value, *args, **kwargs):
        self.current.append((name, value, args, kwargs))

    def end_chunk(self, weight: float, commit: bool) -> None:
        if commit:
            self.committed.append((weight, self.current))
        self.current = []

    def flush(self) -> None:
        order: List[str] = []
        by_name: Dict[str, List[tuple]] = {}
        for weight, calls in self.committed:
            for name, value, args, kwargs in calls:
                if name not in by_name:
                    order.append(name)
                    by_name[name] = []
                by_name[name].append((weight, value, args, kwargs))
        for name in order:
            entries = by_name[name]
            _, last_value, args, kwargs = entries[-1]
            value = last_value
            if all(_is_scalar(v) for _, v, _, _ in entries):
                value = _reduce(entries, _reduce_name(args, kwargs))
                if not torch.is_tensor(last_value):
                    value = float(value)
            sizes = [e[3].get("batch_size") for e in entries]
            if len(entries) > 1 and all(isinstance(b, int) for b in sizes):
                kwargs = dict(kwargs, batch_size=sum(sizes))
            self.real_log(name, value, *args, **kwargs)


def _reduce_name(args: tuple, kwargs: dict) -> str:
    """The ``reduce_fx`` of a ``LightningModule.log`` call (its 7th parameter) as a name."""
    fx = kwargs.get("reduce_fx", args[4] if len(args) > 4 else "mean")
    for name in ("sum", "max", "min"):
        if fx == name or fx is getattr(torch, name):
            return name
    return "mean"


def _reduce(entries: List[tuple], how: str):
    """The chunks' scalar values combined (see ``LogRecorder``); a tensor."""
    values = [(v.detach().float() if torch.is_tensor(v) else torch.tensor(float(v))).reshape(())
              for _, v, _, _ in entries]
    if how == "sum":
        return torch.stack(values).sum()
    if how == "max":
        return torch.stack(values).max()
    if how == "min":
        return torch.stack(values).min()
    wsum = sum(w for w, _, _, _ in entries) or 1.0
    total = None
    for (w, _, _, _), v in zip(entries, values):
        term = v * (w / wsum)
        total = term if total is None else total + term
    return total


def _is_scalar(v: Any) -> bool:
    if torch.is_tensor(v):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Discard:
    """``LightningModule.log`` during a window redo: the values were already logged by the first
    attempt (the redone values are the same up to summation order)."""

    def __call__(self, *args, **kwargs):
        return None
