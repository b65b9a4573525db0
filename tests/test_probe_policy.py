"""When the preflight runs its in-process measurement (#33 item 3): ``preflight_probe`` and the
"auto" rule (cost and a step large enough for the CPU counter)."""

from memguard_core.estimator.specs import ModelSpec, ParamCounts, TrainSpec
from memguard_core.probe_policy import (AUTO_MAX_SECONDS, CPU_MIN_STEP_BYTES, predicted_seconds,
                                        predicted_step_bytes, probe_decision, probe_sizes)


def llama(hidden, layers, vocab=32000, inter=None):
    inter = inter or 4 * hidden
    p = ParamCounts(embeddings=vocab * hidden, attention=layers * 4 * hidden * hidden,
                    mlp=layers * 3 * hidden * inter, norms=(2 * layers + 1) * hidden,
                    norms_in_blocks=2 * layers * hidden, lm_head=vocab * hidden)
    return ModelSpec(name="t", model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=hidden // 64, num_kv_heads=hidden // 64, head_dim=64, params=p)


def test_sizes_are_one_row_capped_at_the_runs_rows():
    assert probe_sizes(TrainSpec(seq_length=2048)) == ((1, 256), (1, 512))
    assert probe_sizes(TrainSpec(seq_length=300)) == ((1, 256), (1, 300))
    assert probe_sizes(TrainSpec(seq_length=128)) == ((1, 128),)


def test_the_option_and_the_auto_rule():
    small, big = llama(512, 3, vocab=4000), llama(2048, 22)
    cpu = TrainSpec(method="full", dtype="fp32", seq_length=2048, device="cpu")
    assert probe_decision(False, small, cpu) == (False, "off (preflight_probe=False)")
    assert probe_decision(True, big, cpu) == (True, "")
    assert probe_decision("auto", big, cpu.replace(device="cuda")) == (True, "")
    assert probe_decision("auto", big, cpu.replace(device="mps"))[0]
    assert not probe_decision("auto", small, cpu.replace(device="mlx", framework="mlx"))[0]
    ranks = probe_decision(True, small, cpu.replace(world_size=2))
    assert not ranks[0] and "2 ranks" in ranks[1]
    # a 1B model on a CPU costs far more than the auto limit: said, with the option that runs it
    assert predicted_seconds(big, cpu) > AUTO_MAX_SECONDS
    run, why = probe_decision("auto", big, cpu)
    assert not run and "True runs it" in why
    # a small model whose step is large enough runs; a tiny one's step is within the counter's noise
    assert predicted_seconds(small, cpu) <= AUTO_MAX_SECONDS
    assert predicted_step_bytes(small, cpu) >= CPU_MIN_STEP_BYTES
    assert probe_decision("auto", small, cpu) == (True, "")
    tiny = llama(64, 2, vocab=256)
    assert predicted_step_bytes(tiny, cpu) < CPU_MIN_STEP_BYTES
    assert "noise" in probe_decision("auto", tiny, cpu)[1]


def test_a_cpu_reading_below_the_estimate_never_lowers_the_plan():
    # a CPU probe of one row reads the glibc heap at that row only; the demo's one-row reading of
    # x0.64 lowered its plan to 17 % under the run's peak: on a CPU the measurement only raises
    import logging

    from memguard_core.estimator.probe_fit import ProbeResult, ProbeStep
    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions

    ms = llama(512, 3, vocab=4000)
    ts = TrainSpec(method="full", dtype="fp32", seq_length=512, batch_size=8, device="cpu", framework="torch")

    def reading(step_mib):
        return lambda sizes, max_s: ProbeResult(
            measured=True, device="cpu", counter="vmhwm", seconds=0.1,
            steps=tuple(ProbeStep(rows=r, tokens=t, held_bytes=2**30, peak_bytes=2**30 + int(step_mib * t / 512) * 2**20,
                                  retained_bytes=0, seconds=0.05) for r, t in sizes))

    guard = Guard(GuardOptions.from_kwargs(budget_gib=64, preflight_probe=True, monitor_interval_s=0),
                  log=logging.getLogger("test"))
    low = guard.plan(lambda: (ms, ts), measure=reading(20))
    assert low.measurement.factor is None and "only raises" in low.measurement.line
    high = guard.plan(lambda: (ms, ts), measure=reading(4000))
    assert high.measurement.factor > 1.0 and high.correction == high.measurement.factor
    assert high.best_peak_bytes > low.best_peak_bytes
