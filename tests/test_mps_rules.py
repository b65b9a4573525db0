"""The ``mps`` counter (PyTorch on Apple Silicon) in the estimator, the options and the device
default. NOT validated on a Mac (no Apple GPU here): these tests check that the rules follow the
torch code they cite -- SDPA's math path while training, ``_dropout_impl``'s noise, the caching
allocator's slack -- against the other counters' estimates of the same run, not measured figures.
"""

from __future__ import annotations

import os

import pytest

from memguard_core.cli import default_device
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.mps import MPS_FRAGMENTATION
from memguard_core.estimator.runtime import RUNTIME_OVERHEAD_BYTES
from memguard_core.options import GuardOptions
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config

SMOL = os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")


@pytest.fixture(scope="module")
def smol():
    return model_spec_from_hf_config(SMOL)


def _ts(**kw):
    base = dict(batch_size=2, seq_length=512, method="lora", lora_rank=16, dtype="bf16")
    base.update(kw)
    return TrainSpec(**base)


def test_mps_keeps_the_fp32_probabilities_of_sdpas_math_path(smol):
    """Training SDPA on mps runs ``_scaled_dot_product_attention_math``: one fp32 probability per
    score and layer is saved, where the CPU's flash kernel keeps a logsumexp per query."""
    mps = estimate(smol, _ts(device="mps"))
    cpu = estimate(smol, _ts(device="cpu"))
    b, s, L, nh = 2, 512, smol.num_layers, smol.num_heads
    scores = mps.phase_breakdowns[mps.phase]["attention_scores"]
    assert scores >= L * b * nh * s * s * 4
    assert cpu.phase_breakdowns[cpu.phase]["attention_scores"] < scores / 100
    # eager attention is eager on every device: the same scores term as on the CPU
    e_mps = estimate(smol, _ts(device="mps", attn_impl="eager"))
    e_cpu = estimate(smol, _ts(device="cpu", attn_impl="eager"))
    assert e_mps.phase_breakdowns["loss"]["attention_scores"] == e_cpu.phase_breakdowns["loss"]["attention_scores"]


def test_mps_dropout_saves_the_noise_in_the_compute_dtype(smol):
    """``F.dropout`` on mps goes through ``_dropout_impl`` (no fused ``native_dropout``): the noise is
    saved in the input's dtype as on the CPU, not CUDA's 1-byte mask (eager attention's dropout on
    the probabilities, where the three devices share every other term)."""
    drop = smol.replace(attention_dropout=0.1)

    def added(device):
        ts = _ts(device=device, attn_impl="eager")
        return (estimate(drop, ts).phase_breakdowns["loss"]["attention_scores"]
                - estimate(smol, ts).phase_breakdowns["loss"]["attention_scores"])

    assert added("mps") == added("cpu") > added("cuda") > 0


def test_mps_has_allocator_slack_and_no_cpu_or_cuda_overheads(smol):
    est = estimate(smol, _ts(device="mps"))
    br = est.phase_breakdowns[est.phase]
    assert br.get("runtime_overhead", 0) == RUNTIME_OVERHEAD_BYTES["mps"] == 0
    rest = sum(v for k, v in br.items() if k not in ("allocator_slack", "calibration"))
    assert br["allocator_slack"] == pytest.approx(MPS_FRAGMENTATION * rest, rel=1e-6, abs=2)
    assert est.counter == "mps"


def test_options_and_the_device_default_take_mps():
    assert GuardOptions.from_kwargs(device="mps").device == "mps"
    assert default_device("hf", apple_silicon=True, nvidia_gpus=0) == "mps"
    assert default_device("mlx", apple_silicon=True) == "mlx"       # mlx_lm has MLX's counter
    assert default_device("hf", apple_silicon=False, nvidia_gpus=0) == "cpu"


def test_counter_device_follows_weights_on_mps():
    pytest.importorskip("torch")
    from memguard_torch.train_reading import counter_device

    assert counter_device("auto", "mps") == "mps"
    assert counter_device("auto", "cuda") == "cuda"
    assert counter_device("auto", "meta") == "cpu"
    assert counter_device("mps", "cpu") == "mps"
