"""The in-process measurement's arithmetic (memguard_core.estimator.probe_fit): the estimate's step
split in held / fixed / per-token parts, the correction read from measured steps, its bounds, and
its application at the run's size. The "measured" figures here are built from the estimate's own
parts with a known error put in (rules that under-count the per-token part 1.5 times, a fixed part
40 MiB short), so each test knows the correction the fit must find; the fit on steps a real model
measured is in tests/test_preflight_probe.py."""

import pytest

from memguard_core.errors import ConfigError
from memguard_core.estimator import probe_fit as pf
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.moments import MOMENTS
from memguard_core.estimator.mps import MPS_FRAGMENTATION
from memguard_core.estimator.numbers import model_spec_from_numbers
from memguard_core.estimator.specs import MiB, TrainSpec

MS = model_spec_from_numbers(135_000_000, 576, 30, 9, num_kv_heads=3, vocab_size=49152, intermediate_size=1536,
                             tie_word_embeddings=True, model_bits=32)
SIZES = ((1, 256), (1, 512))


def _train(device: str, **kw) -> TrainSpec:
    return TrainSpec(batch_size=4, seq_length=1024, method="full", dtype="fp32", framework="torch", device=device, **kw)


def _seen_parts(ts, rows, tokens):
    e = estimate(MS, pf.probe_train_spec(ts, rows, tokens))
    return e, max(((pf.step_parts(e, m)["fixed"], pf.step_parts(e, m)["per_token"]
                    + (pf.step_parts(e, m)["slack"] if ts.device == "cpu" else 0)) for m in pf.STEP_MOMENTS),
                  key=sum)


def _measured(ts, ratio=1.0, fixed=0, sizes=SIZES, scale=1.0, retained=0):
    """A ProbeResult whose steps read fixed + ``fixed`` + ``ratio`` x per-token (the estimate's
    parts at each size), times ``scale``; and the estimates at those sizes."""
    steps, ests = [], []
    for rows, tokens in sizes:
        e, (f, v) = _seen_parts(ts, rows, tokens)
        held = 500 * MiB
        steps.append(pf.ProbeStep(rows=rows, tokens=tokens, held_bytes=held,
                                  peak_bytes=held + retained + int((f + fixed + ratio * v) * scale),
                                  retained_bytes=retained, seconds=0.4))
        ests.append(e)
    kind = ts.device
    return pf.ProbeResult(True, kind, pf.PROBE_COUNTERS[kind], tuple(steps), 0.8), ests


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
@pytest.mark.parametrize("kw", [{}, {"grad_checkpoint": True}, {"grad_accum": 4}])
def test_the_parts_sum_to_each_moment_and_an_identity_correction_keeps_the_peak(device, kw):
    est = estimate(MS, _train(device, **kw))
    for m in MOMENTS:
        assert sum(pf.step_parts(est, m).values()) == est.phases[m]
    assert pf.corrected_peak(est, 1.0, 0) == est.peak_bytes
    cal = estimate(MS, _train(device, **kw), correction=1.1)
    assert pf.corrected_peak(cal, 1.0, 0) == cal.peak_bytes


@pytest.mark.parametrize("device, sizes", [("cpu", SIZES), ("cuda", ((1, 512), (1, 1024)))])
def test_two_sizes_recover_the_per_token_ratio_and_the_fixed_part(device, sizes):
    # two sizes whose steps the estimate has largest at the same moment (cpu: the backward at
    # 256 and 512 tokens, the heap slack per token; cuda: the loss at 512 and 1024)
    ts = _train(device)
    probe, ests = _measured(ts, ratio=1.5, fixed=40 * MiB, sizes=sizes)
    run = estimate(MS, ts)
    fit = pf.fit_probe(probe, ests, run)
    assert fit.applied and fit.per_token_ratio == pytest.approx(1.5, rel=1e-6)
    assert fit.fixed_delta_bytes == pytest.approx(40 * MiB, abs=2)
    assert fit.moment == {"cpu": "backward", "cuda": "loss"}[device]
    # the fixed delta goes to the moment it was read at, the per-token ratio to both
    assert fit.peak_bytes == pf.corrected_peak(run, 1.5, fit.fixed_delta_bytes, fixed_moments=(fit.moment,)) \
        > run.peak_bytes
    assert f"2 forward+backward steps (1 x {sizes[0][1]}, 1 x {sizes[1][1]} tokens) in 0.8 s" in fit.explanation
    assert f"per-token x1.50, fixed +40 MiB at the {fit.moment} moment" in fit.explanation
    # the same correction applied to another micro-batch size of the run
    other = estimate(MS, ts.replace(batch_size=2))
    assert fit.apply(other) == pf.corrected_peak(other, 1.5, fit.fixed_delta_bytes, fixed_moments=(fit.moment,))


def test_sizes_that_peak_at_different_moments_fit_the_larger_alone():
    # cuda, full fp32: one row of 256 tokens peaks in the backward (gradients), of 512 at the loss
    ts = _train("cuda")
    probe, ests = _measured(ts, ratio=1.5)
    assert [pf._seen(e)[2] for e in ests] == ["backward", "loss"]
    fit = pf.fit_probe(probe, ests, estimate(MS, ts))
    one, one_ests = _measured(ts, ratio=1.5, sizes=SIZES[1:])
    alone = pf.fit_probe(one, one_ests, estimate(MS, ts))
    assert (fit.per_token_ratio, fit.fixed_delta_bytes, fit.peak_bytes) == \
        (alone.per_token_ratio, alone.fixed_delta_bytes, alone.peak_bytes)
    assert fit.per_token_ratio == pytest.approx(1.5, rel=1e-6) and fit.moment == "loss"


def test_a_fixed_dominated_backward_peak_corrects_the_backward_alone():
    # a full fine-tune in bf16 autocast on CUDA: one row's step peaks in its backward (gradients,
    # weight copies, a few MiB of activations), and the weight copies are freed block by block as
    # the gradients are made, so the step reads less than the estimate's fixed part. That says
    # nothing of the activations and logits the run's loss moment holds: the run's peak (at the
    # loss) stays, the backward moment alone is lowered, and no per-token ratio is read.
    ms = model_spec_from_numbers(1_235_814_400, 2048, 16, 32, num_kv_heads=8, vocab_size=128256,
                                 intermediate_size=8192, tie_word_embeddings=True, model_bits=32)
    ts = TrainSpec(batch_size=1, seq_length=2048, method="full", dtype="bf16", mixed_precision=True,
                   framework="hf", device="cuda")
    run = estimate(ms, ts)
    assert run.phase == "loss"
    steps, ests = [], []
    for rows, tokens in SIZES:
        e = estimate(ms, pf.probe_train_spec(ts, rows, tokens))
        f, v, m = pf._seen(e)
        assert m == "backward" and v < pf.FIXED_CUT_SHARE * f
        steps.append(pf.ProbeStep(rows, tokens, 4 * 2**30, 4 * 2**30 + int(0.7 * f), 0, 0.4))
        ests.append(e)
    fit = pf.fit_probe(pf.ProbeResult(True, "cuda", "max_memory_allocated", tuple(steps), 0.9), ests, run)
    assert fit.applied and fit.ratio_read is None and fit.per_token_ratio == 1.0
    assert fit.fixed_delta_bytes == -int(pf.FIXED_CUT_SHARE * pf._seen(ests[-1])[0])   # bounded
    assert fit.peak_bytes == run.peak_bytes   # the loss moment, the run's peak, is kept
    lowered = pf.corrected_peak(run, 1.0, fit.fixed_delta_bytes, fixed_moments=("backward",))
    assert lowered == run.peak_bytes and "per-token not read (a fixed-dominated peak)" in fit.explanation


def test_one_size_gives_a_per_token_ratio_and_keeps_the_fixed_part():
    ts = _train("cpu")
    probe, ests = _measured(ts, ratio=1.25, sizes=((1, 512),))
    fit = pf.fit_probe(probe, ests, estimate(MS, ts))
    assert fit.per_token_ratio == pytest.approx(1.25, rel=1e-6) and fit.fixed_delta_bytes == 0
    assert "1 forward+backward step (1 x 512 tokens)" in fit.explanation


def test_what_the_step_kept_is_not_read_as_part_of_it():
    ts = _train("cuda")
    probe, ests = _measured(ts, ratio=1.0, retained=8 * MiB)   # e.g. cuBLAS workspaces made at the first matmul
    assert probe.steps[0].step_bytes == probe.steps[0].peak_bytes - probe.steps[0].held_bytes - 8 * MiB
    fit = pf.fit_probe(probe, ests, estimate(MS, ts))
    assert fit.per_token_ratio == pytest.approx(1.0) and abs(fit.fixed_delta_bytes) <= 2


def test_cuda_compares_without_the_allocator_slack_and_mps_with_the_drivers_cache():
    # max_memory_allocated sees tensors only: a reading of exactly the live step is no error
    ts = _train("cuda")
    probe, ests = _measured(ts)
    run = estimate(MS, ts)
    fit = pf.fit_probe(probe, ests, run)
    assert fit.per_token_ratio == pytest.approx(1.0) and abs(fit.peak_bytes - run.peak_bytes) <= 4
    # the MPS driver's figure holds the cache the step leaves: the live step times (1 + fragmentation)
    ts = _train("mps")
    probe, ests = _measured(ts, scale=1 + MPS_FRAGMENTATION)
    run = estimate(MS, ts)
    fit = pf.fit_probe(probe, ests, run)
    assert fit.per_token_ratio == pytest.approx(1.0, abs=1e-6) and abs(fit.peak_bytes - run.peak_bytes) <= 8


def test_the_cpu_comparison_holds_the_heap_slack():
    ts = _train("cpu")
    e, (f, v) = _seen_parts(ts, 1, 512)
    b = e.phase_breakdowns[e.phase]
    assert b["allocator_slack"] > 0
    assert v == b["activations"] + b["attention_scores"] + b["logits"] + b["allocator_slack"]


def test_the_correction_is_bounded():
    ts = _train("cpu")
    run = estimate(MS, ts)
    probe, ests = _measured(ts, ratio=10.0)
    fit = pf.fit_probe(probe, ests, run)
    assert fit.per_token_ratio == pf.PER_TOKEN_RATIO_BOUNDS[1] and fit.ratio_read == pytest.approx(10.0)
    assert "per-token x4.00 (bounded; read x10.00)" in fit.explanation
    probe, ests = _measured(ts, ratio=0.2)
    fit = pf.fit_probe(probe, ests, run)
    assert fit.per_token_ratio == pf.PER_TOKEN_RATIO_BOUNDS[0]
    fixed = max(pf.step_parts(e, m)["fixed"] for e in ests for m in pf.STEP_MOMENTS)
    assert -pf.FIXED_CUT_SHARE * fixed <= fit.fixed_delta_bytes <= 0
    # a fixed part read far below the predicted one is cut by at most FIXED_CUT_SHARE of it
    probe, ests = _measured(ts, ratio=1.0, fixed=-int(0.9 * fixed))
    fit = pf.fit_probe(probe, ests, run)
    assert fit.per_token_ratio == pytest.approx(1.0)
    assert fit.fixed_delta_bytes == -int(pf.FIXED_CUT_SHARE * fixed)
    # raised by at most the whole predicted step at the largest size
    probe, ests = _measured(ts, ratio=1.0, fixed=10 * 2**30)
    fit = pf.fit_probe(probe, ests, run)
    assert fit.fixed_delta_bytes == sum(_seen_parts(ts, *SIZES[-1])[1])


def test_nothing_measured_keeps_the_estimate():
    ts = _train("cpu")
    run = estimate(MS, ts)
    fit = pf.fit_probe(pf.ProbeResult(False, "cpu", "", (), 0.01, reason="a compiled model"), [], run)
    assert not fit.applied and fit.peak_bytes == run.peak_bytes
    assert fit.explanation == "in-process measurement: not measured (a compiled model)"
    nothing = pf.ProbeStep(1, 256, 100 * MiB, 100 * MiB, 0, 0.1)
    fit = pf.fit_probe(pf.ProbeResult(True, "cpu", "VmHWM", (nothing,), 0.1),
                       [estimate(MS, pf.probe_train_spec(ts, 1, 256))], run)
    assert not fit.applied and "nothing above the held memory" in fit.explanation
    assert fit.apply(run) == run.peak_bytes


def test_correct_estimate_makes_the_estimates_itself():
    ts = _train("cpu")
    probe, ests = _measured(ts, ratio=1.5)
    assert pf.correct_estimate(MS, ts, probe) == pf.fit_probe(probe, ests, estimate(MS, ts))


def test_probe_train_spec_is_the_probes_step():
    ts = _train("cpu", grad_accum=8, heap_trim=False)
    p = pf.probe_train_spec(ts, 1, 256)
    assert (p.batch_size, p.seq_length, p.grad_accum, p.heap_trim) == (1, 256, 1, True)
    assert pf.probe_train_spec(_train("cuda", grad_accum=8), 1, 256).grad_accum == 1


def test_estimates_that_do_not_match_the_probe_are_refused_naming_the_field():
    ts = _train("cpu")
    probe, ests = _measured(ts)
    with pytest.raises(ConfigError, match=r"invalid at_probe\[0\]"):
        pf.fit_probe(probe, [ests[1], ests[0]], estimate(MS, ts))
    with pytest.raises(ConfigError, match=r"invalid at_probe:"):
        pf.fit_probe(probe, ests[:1], estimate(MS, ts))
    with pytest.raises(ConfigError, match=r"invalid run:"):
        pf.fit_probe(probe, ests, estimate(MS, _train("cuda")))
    with pytest.raises(ConfigError, match=r"invalid per_token_ratio:"):
        pf.corrected_peak(estimate(MS, ts), 0.0, 0)
