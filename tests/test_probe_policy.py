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
