"""The in-process measurement (memguard_torch.preflight_probe.measure_steps) on real small models on
this CPU: the run's state is put back exactly, the measured step grows with its tokens, a failure
inside the forward is reported and never raised, and the fit (memguard_core.estimator.probe_fit)
on a model whose per-token activations the rules under-count raises the estimate toward what the
run's own size measures. The CUDA and MPS counter paths run against thin fakes of ``torch.cuda`` /
``torch.mps`` (the test machines have no GPU): only the counter functions are faked, the model
and its forward + backward are real."""

import logging
import random
import types

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.probe_fit import STEP_MOMENTS, correct_estimate, probe_train_spec, step_parts
from memguard_core.probes.linux import peak
from memguard_testing.unknown_op import BigSave
from memguard_testing.fakes import FakeTorchCuda
from memguard_torch.preflight import read_specs
from memguard_torch.preflight_probe import cut_batch, measure_steps

MiB = 2**20


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on this shared 2-core machine two OpenMP threads spin against the other
    jobs' and a 256-token step of the tiny Llama takes seconds instead of tens of milliseconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def vmhwm():
    """Skip where this process's VmHWM cannot be reset (the CPU counter needs /proc/self/clear_refs)."""
    if not peak.reset_peak():
        pytest.skip("/proc/self/clear_refs is not writable here: the CPU peak cannot be reset")


def tiny_llama(dropout: float = 0.0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, attention_dropout=dropout)
    return LlamaForCausalLM(cfg)


def lm_batch(rows: int = 2, tokens: int = 2048) -> dict:
    ids = torch.randint(0, 1000, (rows, tokens), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class Custom(torch.nn.Module):
    """A custom model: embedding, a BatchNorm over the features, the big-save op, dropout, a head."""

    def __init__(self, fail_at_tokens: int = 0, error: type = RuntimeError):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(100, 32)
        self.norm = torch.nn.BatchNorm1d(32)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(32, 100)
        self.fail_at_tokens, self.error = fail_at_tokens, error

    def forward(self, ids):
        if self.fail_at_tokens and ids.shape[1] >= self.fail_at_tokens:
            raise self.error("the custom kernel failed")
        h = self.emb(ids)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.drop(BigSave.apply(h, 8)))


def draws():
    """One draw of every generator the probe restores."""
    return torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()


def seed_all():
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)


def test_the_runs_state_is_restored_exactly(vmhwm):
    model = tiny_llama(dropout=0.2)
    model.eval()   # as from_pretrained leaves it; the probe steps in train mode
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seed_all()
    expected = draws()
    seed_all()
    res = measure_steps(model, lm_batch(), [(1, 256), (1, 512)])
    assert res.measured and len(res.steps) == 2, res.reason
    assert draws() == expected   # torch, Python random and NumPy draw as if nothing had run
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert opt.state == {} and all(not m.training for m in model.modules())
    # the check above can fail: a forward in train mode with dropout draws from torch's generator
    seed_all()
    model.train()
    model(**cut_batch(lm_batch(), 1, 64)[0])
    assert draws() != expected


def test_kept_gradients_buffers_and_train_flags_come_back(vmhwm):
    model = Custom()
    ids = torch.randint(0, 100, (4, 512), generator=torch.Generator().manual_seed(2))
    model(ids[:, :16]).sum().backward()   # a gradient the loop has not consumed yet, and BN statistics
    model.head.eval()                      # a submodule the user keeps in eval mode
    model.emb.weight.grad = None
    kept = model.head.weight.grad
    kept_copy = kept.clone()
    stats = {k: v.clone() for k, v in model.norm.state_dict().items()}
    res = measure_steps(model, ids, [(1, 128), (1, 512)])
    assert res.measured, res.reason
    assert model.head.weight.grad is kept and torch.equal(kept, kept_copy)
    assert model.emb.weight.grad is None
    assert all(torch.equal(v, stats[k]) for k, v in model.norm.state_dict().items())
    assert int(model.norm.num_batches_tracked) == 1
    assert model.training and not model.head.training
    # the check above can fail: a forward in train mode moves the statistics
    model(ids[:1, :16])
    assert int(model.norm.num_batches_tracked) == 2


def test_the_measured_step_grows_with_its_tokens(vmhwm):
    res = measure_steps(tiny_llama(), lm_batch(), [(1, 1024), (1, 256)])
    assert res.measured and res.counter == "VmHWM" and res.device == "cpu"
    small, large = res.steps
    assert (small.tokens, large.tokens) == (256, 1024)   # run in increasing size
    assert large.step_bytes > 2 * small.step_bytes > 0
    assert large.peak_bytes - large.held_bytes > small.peak_bytes - small.held_bytes
    assert res.seconds >= small.seconds + large.seconds > 0


@pytest.mark.parametrize("error", [RuntimeError, torch.OutOfMemoryError])
def test_a_failure_inside_the_forward_is_reported_not_raised(vmhwm, caplog, error):
    model = Custom(fail_at_tokens=512, error=error)
    ids = torch.randint(0, 100, (2, 512), generator=torch.Generator().manual_seed(3))
    model(ids[:, :8]).sum().backward()
    kept = model.head.weight.grad
    stats = {k: v.clone() for k, v in model.norm.state_dict().items()}
    seed_all()
    expected = draws()
    seed_all()
    with caplog.at_level(logging.WARNING, logger="memguard"):
        res = measure_steps(model, ids, [(1, 128), (1, 512)])   # the first size runs, the second fails
    assert not res.measured and res.steps == () and res.counter == ""
    assert res.reason == f"{error.__name__}: the custom kernel failed"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("memguard")]
    assert len(warnings) == 1 and "the custom kernel failed" in warnings[0].getMessage()
    assert model.head.weight.grad is kept and draws() == expected
    assert all(torch.equal(v, stats[k]) for k, v in model.norm.state_dict().items())


def test_a_hook_that_could_step_an_optimizer_inside_the_backward_is_declined(caplog):
    model = Custom()
    calls = []
    model.head.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    with caplog.at_level(logging.WARNING, logger="memguard"):
        res = measure_steps(model, torch.zeros(1, 64, dtype=torch.long), [(1, 64)])
    assert not res.measured and "post-accumulate-grad hook" in res.reason
    assert calls == [] and not [r for r in caplog.records if r.name.startswith("memguard")]


def test_the_cuda_counter_is_read_around_each_step():
    """torch.cuda's counter functions are a fake (FakeTorchCuda, no GPU here): a forward hook
    "allocates" in it what a CUDA step would -- 4 KiB per token, freed by the backward, and on the
    first step an 8 MiB workspace that stays (as cuBLAS's does) -- on top of 100 MiB held."""
    fake = FakeTorchCuda(allocated=100 * MiB, reserved=128 * MiB, peak_alloc=300 * MiB, peak_res=300 * MiB,
                         free=1 << 34, total=1 << 35)
    model = Custom()
    first = []

    def alloc(_m, args, out):
        tokens = args[0].shape[1]
        if not first:
            first.append(1)
            fake.allocated += 8 * MiB
        fake.allocated += 4096 * tokens
        fake.peak_alloc = max(fake.peak_alloc, fake.allocated)

        def free(grad):
            fake.allocated -= 4096 * tokens

        out.register_hook(free)

    model.register_forward_hook(alloc)
    res = measure_steps(model, torch.zeros(2, 512, dtype=torch.long), [(1, 256), (1, 512)], device="cuda:0",
                        torch_cuda=fake)
    assert res.measured and res.counter == "max_memory_allocated" and res.device == "cuda:0"
    assert fake.resets == [0, 0]   # a new peak window before each step
    a, b = res.steps
    assert (a.held_bytes, a.retained_bytes, a.step_bytes) == (100 * MiB, 8 * MiB, 4096 * 256)
    assert a.peak_bytes == 108 * MiB + 4096 * 256
    assert (b.held_bytes, b.retained_bytes, b.step_bytes) == (108 * MiB, 0, 4096 * 512)


def test_on_cuda_the_matmul_handles_are_made_before_the_first_step():
    """cuBLAS makes a handle and workspace per thread on its first matmul, the backward's on
    autograd's thread: a tiny linear forward and backward runs before the first measured step, so
    that step's peak and what it keeps count the same workspaces. torch.cuda is a fake here (no
    GPU); the calls are real, recorded by a TorchFunctionMode."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("linear", "backward", "embedding"):
                seen.append((name, tuple(args[0].shape) if args and hasattr(args[0], "shape") else None))
            return func(*args, **(kwargs or {}))

    fake = FakeTorchCuda(allocated=100 * MiB, reserved=128 * MiB, peak_alloc=300 * MiB, peak_res=300 * MiB,
                         free=1 << 34, total=1 << 35)
    model = Custom()
    grads = [p.grad for p in model.parameters()]
    with Record():
        res = measure_steps(model, torch.zeros(2, 512, dtype=torch.long), [(1, 256)], device="cuda:0",
                            torch_cuda=fake)
    assert res.measured
    assert seen[:2] == [("linear", (8, 8)), ("backward", ())]   # before the model's first forward
    assert any(name == "linear" and shape != (8, 8) for name, shape in seen[2:])
    assert [p.grad for p in model.parameters()] == grads


def test_the_mps_counter_reads_the_driver_figure_after_emptying_the_cache():
    """torch.mps's counter functions are a fake (no Mac here): the driver's figure grows by the
    blocks a step caches, 2 KiB per token, and ``empty_cache`` hands them back."""
    state = {"driver": 50 * MiB, "empties": 0}

    def empty_cache():
        state["empties"] += 1
        state["driver"] = 50 * MiB

    fake = types.SimpleNamespace(driver_allocated_memory=lambda: state["driver"], empty_cache=empty_cache)
    model = Custom()
    model.register_forward_hook(lambda _m, args, _o: state.update(driver=state["driver"] + 2048 * args[0].shape[1]))
    res = measure_steps(model, torch.zeros(1, 300, dtype=torch.long), [(1, 300)], device="mps", torch_mps=fake)
    assert res.measured and res.counter == "driver_allocated_memory"
    assert res.steps[0].step_bytes == 2048 * 300 and state["empties"] == 2


def test_batches_are_cut_by_rows_and_tokens():
    b = lm_batch(rows=3, tokens=100)
    b.update(position_ids=torch.arange(100)[None], mask4d=torch.ones(3, 1, 100, 100), num_items=7)
    cut, r, t = cut_batch(b, 1, 40)
    assert (r, t) == (1, 40)
    assert cut["input_ids"].shape == cut["labels"].shape == cut["attention_mask"].shape == (1, 40)
    assert cut["position_ids"].shape == (1, 40) and cut["mask4d"].shape == (1, 1, 40, 40)
    assert cut["num_items"] == 7 and torch.equal(cut["input_ids"], b["input_ids"][:1, :40])
    assert cut_batch(b, 8, 4096)[1:] == (3, 100)   # at most what the batch holds
    assert cut_batch(torch.zeros(4, 50, dtype=torch.long), 2, 10)[0].shape == (2, 10)
    assert cut_batch(torch.zeros(4, 50, 8), 2, 10)[0].shape == (2, 10, 8)
    x, r, t = cut_batch(torch.zeros(4, 50), 2, 10)   # float features: no tokens
    assert x.shape == (2, 50) and t == 1
    with pytest.raises(ValueError, match="batch: cannot cut"):
        cut_batch([1, 2], 1, 1)


def _step_seen(est):
    """The predicted step at ``est``'s size as VmHWM sees it (probe_fit's parts)."""
    return max(step_parts(est, m)["fixed"] + step_parts(est, m)["per_token"] + step_parts(est, m)["slack"]
               for m in STEP_MOMENTS)


def test_the_fit_raises_an_undercounted_estimate_toward_the_measured_step(vmhwm):
    model = tiny_llama()
    for layer in model.model.layers:   # the rules count a Llama MLP; this one keeps 48 copies of its output more
        layer.mlp.register_forward_hook(lambda _m, _a, out: BigSave.apply(out, 48))
    batch = lm_batch(rows=1)
    ms, ts = read_specs(model, torch.optim.AdamW(model.parameters()), batch)
    probe = measure_steps(model, batch, [(1, 256), (1, 1024)])
    fit = correct_estimate(ms, ts, probe)   # the run: 1 x 2048
    assert fit.applied and fit.per_token_ratio > 1.5 and fit.peak_bytes > fit.estimate_peak_bytes
    run = estimate(ms, probe_train_spec(ts, 1, 2048))
    held = step_parts(run, run.phase)["held"]
    measured = measure_steps(model, batch, [(1, 2048)]).steps[0].step_bytes
    predicted, corrected = _step_seen(run), fit.peak_bytes - held
    assert predicted < 0.6 * measured   # the rules miss the copies ...
    assert abs(corrected - measured) < 0.5 * abs(predicted - measured)   # ... the fit finds most of them


def test_activation_checkpointing_is_measured_as_part_of_the_run(vmhwm):
    model = tiny_llama(dropout=0.1, layers=4)   # with 2 blocks, one recomputed block is half of them
    batch = lm_batch(rows=1)
    plain = measure_steps(model, batch, [(1, 1024)])
    model.gradient_checkpointing_enable()   # the recompute draws dropout masks again: RNG must still come back
    seed_all()
    expected = draws()
    seed_all()
    ckpt = measure_steps(model, batch, [(1, 1024)])
    assert plain.measured and ckpt.measured, ckpt.reason
    # 4 blocks: every block input + one recomputed block against every block's activations
    assert ckpt.steps[0].step_bytes < 0.8 * plain.steps[0].step_bytes
    assert draws() == expected and all(p.grad is None for p in model.parameters())
