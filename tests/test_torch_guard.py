"""memguard_torch.TorchGuard in a plain loop, single process, on a tiny MLP: the chunks and their
weights, equal gradients split and unsplit, the forward re-split and the window redo after REAL
allocator failures (the test model asks torch's CPU allocator for a petabyte when a forward or a
backward sees more rows than it "fits": ``DefaultCPUAllocator: can't allocate memory``, the error a
real shortfall raises), the errors that pass through, bad arguments."""

from __future__ import annotations

import pytest
import torch

from memguard_core.errors import ConfigError, WindowOOMError
from memguard_torch import TorchGuard, is_oom_error

PETABYTE = 1 << 50


class _FailBackward(torch.autograd.Function):
    """Identity; its backward asks the allocator for a petabyte when the gradient has more than
    ``rows`` rows (after the later layer's gradients were accumulated)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.rows = rows
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if grad.shape[0] > ctx.rows:
            torch.empty(PETABYTE, dtype=torch.uint8)
        return grad, None


class Net(torch.nn.Module):
    """4 -> 8 -> 1 MLP whose forward (``fwd_rows``) or backward (``bwd_rows``) fails with a real
    allocator error above that many rows; ``calls`` counts forwards."""

    def __init__(self, fwd_rows=None, bwd_rows=None):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        self.fwd_rows, self.bwd_rows, self.calls = fwd_rows, bwd_rows, 0

    def forward(self, x):
        self.calls += 1
        if self.fwd_rows is not None and x.shape[0] > self.fwd_rows:
            torch.empty(PETABYTE, dtype=torch.uint8)
        h = self.l1(x)
        if self.bwd_rows is not None:
            h = _FailBackward.apply(h, self.bwd_rows)
        return self.l2(torch.relu(h))


def _batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def _guard(model, **kw):
    kw.setdefault("budget_gib", 8)
    return TorchGuard(model, None, monitor_interval_s=0, preflight=False, leak_detector=False, **kw)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _reference(batches):
    model = Net()
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
    return _grads(model)


def _train(guard, model, batches, form="loop"):
    for x, y in batches:
        if form == "run":
            guard.run((x, y), lambda c, w: (torch.nn.functional.mse_loss(model(c[0]), c[1]) * w).backward())
            continue
        for (cx, cy), w in guard.chunks((x, y)):
            with guard.micro_step():
                loss = torch.nn.functional.mse_loss(model(cx), cy) * w
                loss.backward()


def _close(a, b):
    assert all(torch.allclose(x, y, atol=1e-6, rtol=1e-5) for x, y in zip(a, b)), "gradients differ"


def test_chunks_cover_the_batch_with_weights_summing_to_one():
    model = Net()
    guard = _guard(model, micro_batches=3)
    x, y = _batch(8)
    got = list(guard.chunks((x, y)))
    assert [c[0].shape[0] for c, _ in got] == [3, 2, 3]
    assert torch.equal(torch.cat([c[0] for c, _ in got]), x)
    assert sum(w for _, w in got) == pytest.approx(1.0)
    assert isinstance(got[0][0], tuple)
    guard.close()


def test_dict_batch_token_weights_follow_valid_labels():
    ids = torch.arange(24).reshape(4, 6)
    labels = ids.clone()
    labels[0, :5] = -100              # row 0: one valid label, rows 1-3: six
    guard = TorchGuard(None, None, micro_batches=2, budget_gib=8, monitor_interval_s=0, preflight=False,
                       shift_labels=False, leak_detector=False)
    got = list(guard.chunks({"input_ids": ids, "labels": labels}))
    assert [c["input_ids"].shape[0] for c, _ in got] == [2, 2]
    assert [w for _, w in got] == pytest.approx([7 / 19, 12 / 19])
    guard.close()


@pytest.mark.parametrize("form", ["loop", "run"])
def test_split_gradients_equal_unsplit(form):
    batches = [_batch(8, 0)]
    model = Net()
    guard = _guard(model, micro_batches=4)
    _train(guard, model, batches, form)
    _close(_grads(model), _reference(batches))
    assert guard.micro_batch_rows == [2, 2, 2, 2]
    guard.close()


def test_forward_oom_resplits_the_rows_not_yet_processed():
    batches = [_batch(8, 0)]
    model = Net(fwd_rows=3)
    guard = _guard(model, micro_batches=2)        # 4-row chunks: the first forward fails
    _train(guard, model, batches)
    _close(_grads(model), _reference(batches))
    assert guard.oom_retries == 1
    assert guard.micro_batch_rows == [4, 2, 2, 2, 2]   # the failed forward, then the 8 rows at k=4
    assert guard.monitor.micro_batches == 4
    guard.close()


def test_backward_oom_redoes_the_window_including_earlier_batches():
    batches = [_batch(8, 0), _batch(8, 1)]
    model = Net(bwd_rows=4)
    guard = _guard(model, micro_batches=1)
    # the first batch's backward fails at 8 rows after l2's gradient was added: window redo at k=2
    _train(guard, model, batches)
    _close(_grads(model), _reference(batches))
    assert guard.oom_retries == 1
    assert guard.micro_batch_rows[:3] == [8, 4, 4]
    guard.close()


def test_backward_oom_in_a_later_batch_reruns_the_window():
    batches = [_batch(4, 0), _batch(8, 1)]
    model = Net(bwd_rows=4)
    guard = _guard(model, micro_batches=1)
    _train(guard, model, batches)                 # batch 0 (4 rows) fits; batch 1 fails at 8 rows
    _close(_grads(model), _reference(batches))
    # batch 0, batch 1 failed, then the window again at k=2: batch 0 as 2 + 2, batch 1 as 4 + 4
    assert guard.micro_batch_rows == [4, 8, 2, 2, 4, 4]
    guard.close()


def test_step_end_closes_the_window():
    model = Net(bwd_rows=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = TorchGuard(model, opt, budget_gib=8, monitor_interval_s=0, preflight=False, leak_detector=False)
    _train(guard, model, [_batch(4, 0)])
    opt.step()
    opt.zero_grad()
    guard.step_end()
    _train(guard, model, [_batch(8, 1)])          # the redo reruns only this batch
    assert guard.micro_batch_rows == [4, 8, 4, 4]
    summary = guard.finish()
    assert summary["optimizer_steps"] == 1 and summary["oom_retries"] == 1
    assert summary["samples_per_step"] == [4]


def test_one_row_that_fails_raises_window_oom_error():
    model = Net(fwd_rows=0)
    guard = _guard(model, micro_batches=1)
    with pytest.raises(WindowOOMError) as info:
        _train(guard, model, [_batch(2, 0)])
    assert "one row per forward" in str(info.value)
    guard.close()


def test_other_errors_and_oom_outside_micro_step_pass_through():
    model = Net(fwd_rows=3)
    guard = _guard(model, micro_batches=2)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        for (cx, cy), w in guard.chunks(_batch(8)):
            model(cx)                              # no micro_step: the OOM is the loop's
    with pytest.raises(ValueError, match="user bug"):
        for (cx, cy), w in guard.chunks(_batch(2)):
            with guard.micro_step():
                raise ValueError("user bug")
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with guard.micro_step():                   # not inside a chunk
            torch.empty(PETABYTE, dtype=torch.uint8)
    guard.close()


def test_is_oom_error():
    assert is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("out of memory"))


@pytest.mark.parametrize("kw, field", [({"model": "net"}, "model"), ({"oom_sync": "yes"}, "oom_sync"),
                                       ({"grad_accum": 0}, "grad_accum"), ({"label_key": 1.5}, "label_key"),
                                       ({"micro_batchez": 2}, "micro_batchez"), ({"optimizer": 3}, "optimizer"),
                                       # the loop's evaluation is the user's: the option would do nothing
                                       ({"eval_micro_batches": 2}, "eval_micro_batches")])
def test_bad_arguments_name_the_field(kw, field):
    with pytest.raises(ConfigError) as info:
        TorchGuard(**kw)
    assert info.value.field == field


def test_event_log_has_a_record_per_optimizer_step(tmp_path):
    import json

    model = Net(fwd_rows=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = TorchGuard(model, opt, micro_batches=2, budget_gib=8, monitor_interval_s=0, preflight=False,
                       leak_detector=False, log_dir=str(tmp_path))
    for seed in range(3):
        _train(guard, model, [_batch(8, seed)])
        opt.step()
        opt.zero_grad()
        guard.step_end()
    summary = guard.finish()
    records = [json.loads(line) for line in open(summary["event_log"])]
    kinds = [r.get("kind") or r.get("type") for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert summary["oom_retries"] == 1 and summary["optimizer_steps"] == 3
    assert any("out of memory" in json.dumps(r) for r in records)   # the re-split is recorded


def test_sync_points_answer_locally_outside_a_process_group():
    from memguard_torch.sync import OomSync, PeerOutOfMemoryError, _wrap

    sync = OomSync(None)
    sync.inside = True
    sync.point("test")                     # no group: nothing to agree with, never raises
    assert sync.end(2) == (2, 2) and not sync.inside
    assert is_oom_error(PeerOutOfMemoryError("before an FSDP all-gather"))

    class Out(dict):                       # a HF ModelOutput is a dict subclass with attributes
        pass

    x = torch.ones(2, requires_grad=True)
    calls = []

    class Hooks:
        def backward_point(self, where):
            calls.append(where)

    out = _wrap(Out(loss=x * 2, logits=x * 3, n=1), Hooks(), "here")
    assert type(out) is Out and out["n"] == 1
    (out["loss"].sum() + out["logits"].sum()).backward()
    assert calls == ["here"] and torch.equal(x.grad, torch.full((2,), 5.0))   # one point, identity gradients


def test_compat_names_and_fallbacks():
    from memguard_core.versions import in_range, installed_version
    from memguard_torch import _compat

    assert in_range(installed_version("torch"), _compat.CHECKED) and _compat.check_version()
    model = Net()
    assert _compat.fsdp_modules(model) == [] and _compat.fsdp_root(model) is None
    assert _compat.reset_fsdp_after_abort(model) is False       # no FSDP module: nothing to reset
    assert _compat.find_ddp(model) is None
    assert _compat.sync_fsdp_comms(model, lambda kind: None) is None   # not an FSDP module: hooks instead
    assert _compat.queue_backward_callback(lambda: None) is False     # outside a backward: refused, no raise
