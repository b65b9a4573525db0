"""How the Lightning adapter puts a split step's results back together: evaluation outputs
(``memguard_lightning.eval.combine``), ``self.log`` values by their ``reduce_fx``
(``memguard_lightning.logs.LogRecorder``), which errors count as a redoable out-of-memory error, and the
``eval_micro_batches`` argument check."""

from __future__ import annotations

from collections import namedtuple

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from memguard_core.errors import ConfigError, WindowOOMError  # noqa: E402
from memguard_lightning import MemGuardCallback  # noqa: E402
from memguard_lightning.eval import combine  # noqa: E402
from memguard_lightning.logs import LogRecorder  # noqa: E402
from memguard_torch.oom import is_oom_error  # noqa: E402

ALLOC = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes."


def test_scalars_are_weighted_and_batch_tensors_concatenated():
    w = [0.25, 0.75]
    out = combine([{"loss": torch.tensor(2.0), "logits": torch.ones(1, 3), "acc": 1.0, "note": "a"},
                   {"loss": torch.tensor(4.0), "logits": torch.zeros(3, 3), "acc": 0.0, "note": "b"}], w)
    assert float(out["loss"]) == pytest.approx(0.25 * 2 + 0.75 * 4)
    assert out["logits"].shape == (4, 3) and float(out["logits"][0].sum()) == 3.0
    assert out["acc"] == pytest.approx(0.25)
    assert out["note"] == "b"  # not combinable: the last chunk's


def test_nested_structures_and_none():
    P = namedtuple("P", "pred score")
    out = combine([(P(torch.tensor([1]), torch.tensor(1.0)), None),
                   (P(torch.tensor([2, 3]), torch.tensor(3.0)), None)], [0.5, 0.5])
    assert isinstance(out, tuple) and isinstance(out[0], P) and out[1] is None
    assert out[0].pred.tolist() == [1, 2, 3] and float(out[0].score) == 2.0
    assert combine([None, None], [0.5, 0.5]) is None


def test_logged_values_follow_reduce_fx():
    logged = {}

    def real_log(name, value, *args, **kwargs):
        logged[name] = (float(value), kwargs)

    rec = LogRecorder(real_log)
    for w, v in ((0.2, 1.0), (0.8, 6.0)):
        rec("mean", torch.tensor(v))
        rec("sum", v, reduce_fx="sum", batch_size=3)
        rec("max", torch.tensor(v), reduce_fx=torch.max)
        rec("min", v, False, None, None, None, "min")  # reduce_fx passed by position
        rec.end_chunk(w, commit=True)
    rec("mean", torch.tensor(100.0))
    rec.end_chunk(0.0, commit=False)  # a failed chunk's calls are dropped
    rec.flush()
    assert logged["mean"][0] == pytest.approx(0.2 * 1 + 0.8 * 6)
    assert logged["sum"] == (7.0, {"reduce_fx": "sum", "batch_size": 6})  # batch size: the chunks' total
    assert logged["max"][0] == 6.0 and logged["min"][0] == 1.0


def test_what_counts_as_a_redoable_oom():
    assert is_oom_error(RuntimeError(ALLOC))
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    # memguard's own error quotes the allocator's message but means splitting already failed
    assert not is_oom_error(WindowOOMError("backward", 8, 8, 1, f"last error: {ALLOC}"))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_eval_micro_batches_is_checked(bad):
    with pytest.raises(ConfigError) as err:
        MemGuardCallback(eval_micro_batches=bad)
    assert err.value.field == "eval_micro_batches"
