"""Fast unit tests of memguard_mlx on real MLX (CPU backend): introspection, batch cutting, limits,
leak rule, utilities. No training loop here (integration_tests/test_mlx_*.py run those)."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, iterate_batches  # noqa: E402

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_mlx import (LeakDetector, MemoryControls, MemoryTimeline, find_max_batch_size,  # noqa: E402
                          is_allocation_error, model_spec_from_mlx_module, profile_peak,
                          train_spec)
from memguard_mlx.specs import seq_length_of  # noqa: E402
from memguard_mlx.trainer import row_token_counts  # noqa: E402

from memguard_testing.mlx_tiny import TokenRows, build_model  # noqa: E402


def _total(model):
    return sum(int(v.size) for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_spec_counts_every_parameter_by_kind(arch):
    m = build_model(arch, lora_rank=0)
    ms = model_spec_from_mlx_module(m)
    assert ms.total_params == _total(m)
    p = ms.params
    assert p.embeddings == 256 * 64
    assert p.lm_head == (0 if arch == "qwen2" else 256 * 64) and ms.tie_word_embeddings == (arch == "qwen2")
    assert p.mlp == 2 * 3 * 64 * 128
    bias = 2 * (64 + 32 + 32) if arch == "qwen2" else 0  # Qwen2: q/k/v biases
    assert p.attention == 2 * (64 * 64 * 2 + 2 * 64 * 32) + bias
    assert p.norms == 2 * 2 * 64 + 64 and p.norms_in_blocks == 256
    assert (ms.num_layers, ms.num_heads, ms.num_kv_heads, ms.head_dim) == (2, 4, 2, 16)
    assert {lin.name for lin in ms.block_linears} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"}
    assert ms.lora_rank_found is None and ms.weight_bits == 32.0


def test_spec_finds_blocks_outside_model_layers():
    """GPT-NeoX keeps its blocks in ``model.h`` (``Model.layers`` is a property returning them), its
    embeddings in ``embed_in`` and its untied head in ``embed_out``: every parameter must still land
    in its kind, and block 0's linears must be found."""
    from mlx_lm.models import gpt_neox

    a = dict(model_type="gpt_neox", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             rotary_pct=0.25, max_position_embeddings=128, use_parallel_residual=True, layer_norm_eps=1e-5,
             rotary_emb_base=10000)
    m = gpt_neox.Model(gpt_neox.ModelArgs.from_dict(a))
    ms = model_spec_from_mlx_module(m)
    p = ms.params
    assert ms.total_params == _total(m) and p.other == 0
    assert p.embeddings == 512 * 64 and p.lm_head == 512 * 64 and not ms.tie_word_embeddings
    assert p.attention == 2 * (64 * 192 + 192 + 64 * 64 + 64)       # fused query_key_value + dense
    assert p.mlp == 2 * (64 * 256 + 256 + 256 * 64 + 64)
    assert p.norms_in_blocks == 2 * 2 * 2 * 64 and p.norms == p.norms_in_blocks + 2 * 64
    assert {lin.name for lin in ms.block_linears} == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
    assert ms.intermediate_size == 256


def test_full_fine_tune_of_the_last_blocks_sets_lora_layers():
    """mlx_lm's full fine-tune with num_layers=1 unfreezes only the last block: the TrainSpec says so
    (the estimator's backward and trainable counts cover that block alone)."""
    m = build_model("llama", lora_rank=0)
    m.layers[-1].unfreeze()
    ms = model_spec_from_mlx_module(m)
    ts = train_spec(m, optim.AdamW(learning_rate=1e-3), TrainingArgs(batch_size=2), ms, seq_length=16)
    assert ts.method == "full" and ts.lora_layers == 1
    for layer in m.layers:
        layer.unfreeze()
    ts = train_spec(m, optim.AdamW(learning_rate=1e-3), TrainingArgs(batch_size=2), ms, seq_length=16)
    assert ts.method == "full" and ts.lora_layers is None


def test_spec_lora_found_on_the_model():
    m = build_model("llama", lora_rank=4, lora_layers=1)
    ms = model_spec_from_mlx_module(m)
    assert ms.total_params == _total(m) - ms.adapter_params  # adapters are not base parameters
    assert ms.lora_rank_found == 4
    trainable = sum(int(v.size) for _, v in tree_flatten(m.trainable_parameters()))
    assert ms.trainable_params == trainable == ms.adapter_params
    ts = train_spec(m, optim.AdamW(learning_rate=1e-3), TrainingArgs(batch_size=4), ms,
                              train_dataset=TokenRows(8, max_len=40))
    assert ts.method == "lora" and ts.lora_rank == 4 and ts.lora_layers == 1
    assert set(ts.lora_targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (ts.framework, ts.device, ts.optimizer, ts.dtype) == ("mlx", "mlx", "adamw", "fp32")


def test_spec_quantized_bits_measured_from_arrays():
    m = build_model("llama", lora_rank=0)
    n = _total(m)
    nn.quantize(m, group_size=32, bits=4)
    ms = model_spec_from_mlx_module(m)
    assert ms.total_params == n  # real weights, not packed uint32 elements
    # 4 bits + fp32 scale and bias per group of 32: 4 + 64/32 = 6 bits
    assert ms.weight_bits == pytest.approx(6.0)
    m.freeze()
    from mlx_lm.tuner.utils import linear_to_lora_layers

    linear_to_lora_layers(m, 2, {"rank": 2, "scale": 10.0, "dropout": 0.0})
    ms = model_spec_from_mlx_module(m)
    ts = train_spec(m, optim.Adam(learning_rate=1e-3), TrainingArgs(batch_size=2), ms)
    assert ts.method == "qlora" and ts.lora_rank == 2 and ts.optimizer == "adam"


def test_seq_length_follows_iterate_batches_padding():
    ds = TokenRows(8, min_len=40, max_len=40)
    assert seq_length_of(ds, 2048) == 64  # padded to 1 + 32 * 2 = 65, the model sees 64
    assert seq_length_of(ds, 50) == 49
    b = next(iterate_batches(ds, 4, 2048))
    assert b[0].shape[1] - 1 == seq_length_of(ds, 2048)


def test_row_token_counts_equal_default_loss_mask():
    ds = TokenRows(16, seed=3)
    batch = next(iterate_batches(ds, 8, 64))
    counts = row_token_counts(batch)
    model = build_model("llama", lora_rank=0)
    for i in range(8):
        _, ntoks = default_loss(model, batch[0][i:i + 1], batch[1][i:i + 1])
        assert int(ntoks) == int(counts[i])
    assert row_token_counts((mx.zeros((2, 3, 4)), mx.zeros((2, 2)))) is None


def test_memory_controls_plan_apply_restore():
    c = MemoryControls()
    assert c.plan(1000, 600) == {"memory_limit": 1000, "cache_limit": 400}
    assert c.plan(1000, 990)["cache_limit"] == 125  # at least budget / 8
    assert c.plan(1000, None, {"max_recommended_working_set_size": 800})["wired_limit"] == 800
    assert c.plan(1000, None, {"max_recommended_working_set_size": 5000})["wired_limit"] == 1000
    assert MemoryControls(memory_limit=False, cache_limit=123).plan(1000) == {"cache_limit": 123}
    with pytest.raises(ConfigError):
        MemoryControls(cache_limit=-1)
    before = mx.get_memory_limit()
    applied = c.apply(3 << 30, 1 << 30)
    assert applied["memory_limit"] == 3 << 30 and mx.get_memory_limit() == 3 << 30
    assert "wired_limit" not in applied  # CPU backend: no working set, wired limit left alone
    c.restore()
    assert mx.get_memory_limit() == before


def test_leak_rule():
    flat = LeakDetector(window=4, min_growth_bytes=1000, min_step_bytes=100, warmup=1)
    for i, a in enumerate([500, 10_000, 10_000, 10_032, 10_000, 10_032, 10_032, 10_000, 10_032]):
        flat.sample(i, a)
    assert not flat.fired
    leak = LeakDetector(window=4, min_growth_bytes=1000, min_step_bytes=100, warmup=1)
    reps = [leak.sample(i, 10_000 + 500 * i) for i in range(12)]
    first = next(i for i, r in enumerate(reps) if r is not None)
    assert first == 1 + 4  # warmup + window + 1 samples
    assert leak.reports[0].growth_bytes == 2000 and leak.reports[0].per_step_bytes == 500
    assert len(leak.reports) == 2  # re-armed one window later, not at every sample
    sawtooth = LeakDetector(window=4, min_growth_bytes=1000, min_step_bytes=100, warmup=0)
    for i, a in enumerate([0, 800, 400, 1200, 800, 1600, 1200, 2000]):
        sawtooth.sample(i, a)
    assert not sawtooth.fired  # not monotonic
    with pytest.raises(ConfigError):
        LeakDetector(window=1)


def test_is_allocation_error():
    assert is_allocation_error(RuntimeError("[malloc] Unable to allocate 123 bytes."))
    assert is_allocation_error(RuntimeError("[metal::malloc] Resource limit (499000) exceeded."))
    assert is_allocation_error(MemoryError())
    assert not is_allocation_error(RuntimeError("shape mismatch"))
    assert not is_allocation_error(ValueError("[malloc] Unable to allocate"))


def test_profile_peak_and_timeline():
    prof = profile_peak(lambda n: mx.ones((n, n)) @ mx.ones((n, n)), 256)
    assert prof.result.shape == (256, 256)
    assert prof.added_peak >= 2 * 256 * 256 * 4  # the two operands at least
    assert prof.leaked >= 256 * 256 * 4  # the result stays alive
    tl = MemoryTimeline()
    tl.mark("start")
    x = mx.ones((512, 512))
    mx.eval(x)
    e = tl.mark("after 1 MiB")
    assert e["active"] - tl.entries[0]["active"] >= 512 * 512 * 4 and e["peak"] >= e["active"]
    assert len(tl.report()) == 3 and tl.max_peak() >= 512 * 512 * 4


def test_find_max_batch_size_stays_inside_the_budget():
    w = mx.ones((256, 256))
    mx.eval(w)

    def step(b):
        x = mx.ones((b, 256))
        return mx.grad(lambda w: (nn.relu(x @ w) @ w).sum())(w)

    _, peaks = find_max_batch_size(step, budget_bytes=1 << 40, max_batch_size=64)
    per_row = (peaks[64] - peaks[32]) / 32
    budget = int(peaks[16] + per_row * 10)  # room for 26 rows
    best, peaks2 = find_max_batch_size(step, budget_bytes=budget, max_batch_size=1024)
    assert best == 16
    assert max(peaks2.values()) <= budget  # never ran a batch that did not fit (32 was predicted)
    assert 32 not in peaks2


# ---------------------------------------------------------------------------------------------
# resume after a restart (memguard_mlx.resume)


def test_resume_adapter_file_reads_the_env_and_ignores_a_missing_file(tmp_path, monkeypatch, caplog):
    from memguard_mlx import resume_adapter_file

    monkeypatch.delenv("MEMGUARD_RESUME_FROM", raising=False)
    assert resume_adapter_file() is None
    saved = tmp_path / "0000008_adapters.safetensors"
    mx.save_safetensors(str(saved), {"a": mx.zeros((2,))})
    monkeypatch.setenv("MEMGUARD_RESUME_FROM", str(saved))
    assert resume_adapter_file() == str(saved)
    monkeypatch.setenv("MEMGUARD_RESUME_FROM", str(tmp_path / "0000012_adapters.safetensors"))
    with caplog.at_level("WARNING", logger="memguard.mlx"):
        assert resume_adapter_file() is None
    assert "not resuming" in caplog.text and "0000012_adapters" in caplog.text


def test_resume_point_goes_back_to_the_last_update_saved():
    from memguard_mlx.resume import resume_point

    assert resume_point("a/0000008_adapters.safetensors", 2) == (8, 4)
    assert resume_point("a/0000008_adapters.safetensors", 1) == (8, 8)
    # saved inside an accumulation window: its batches were never applied, so they are redone
    assert resume_point("a/0000009_adapters.safetensors", 4) == (8, 2)
    assert resume_point("a/0000003_adapters.safetensors", 4) == (0, 0)
    with pytest.raises(ConfigError) as ei:
        resume_point("a/adapters.safetensors", 2)
    assert ei.value.field == "MEMGUARD_RESUME_FROM"


def test_load_adapter_loads_this_models_weights_and_refuses_others(tmp_path):
    from memguard_mlx.resume import load_adapter

    src, dst = build_model("llama", seed=3), build_model("llama", seed=0)
    weights = dict(tree_flatten(src.trainable_parameters()))
    path = tmp_path / "0000004_adapters.safetensors"
    mx.save_safetensors(str(path), weights)
    assert load_adapter(dst, str(path)) == len(weights)
    got = dict(tree_flatten(dst.trainable_parameters()))
    for k, v in weights.items():
        assert np.array_equal(np.array(got[k]), np.array(v)), k
    other = tmp_path / "0000005_adapters.safetensors"
    mx.save_safetensors(str(other), {"model.layers.0.mlp.up_proj.lora_a": mx.zeros((3, 3)), "nope": mx.zeros((1,))})
    with pytest.raises(ConfigError) as ei:
        load_adapter(dst, str(other), field="resume_from")
    assert ei.value.field == "resume_from" and "nope" in str(ei.value)


def test_set_optimizer_step_puts_the_schedule_where_it_was():
    from memguard_mlx.resume import set_optimizer_step

    from memguard_testing.mlx_tiny import schedule_optimizer

    model = build_model("llama")
    ran, resumed = schedule_optimizer(), schedule_optimizer()
    grads = {k: mx.ones_like(v) for k, v in tree_flatten(model.trainable_parameters())}
    from mlx.utils import tree_unflatten

    for _ in range(4):
        ran.update(model, tree_unflatten(list(grads.items())))
    mx.eval(ran.state)
    set_optimizer_step(resumed, 4)
    assert int(resumed.state["step"]) == 4
    assert float(resumed.learning_rate) == pytest.approx(float(ran.learning_rate), rel=1e-7)
    resumed.update(model, tree_unflatten(list(grads.items())))
    ran.update(model, tree_unflatten(list(grads.items())))
    assert int(resumed.state["step"]) == 5  # init on the first update keeps the step
    assert float(resumed.learning_rate) == pytest.approx(float(ran.learning_rate), rel=1e-7)


@pytest.mark.parametrize("bad", ["/no/such/0000004_adapters.safetensors", 3, True])
def test_train_resume_from_bad_values_are_config_errors(bad):
    from memguard_mlx.resume import resume_from_arg

    with pytest.raises(ConfigError) as ei:
        resume_from_arg(bad)
    assert ei.value.field == "resume_from"


# ---------------------------------------------------------------------------------------------
# validation cut into micro-batches (memguard_mlx.eval)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_split_evaluate_equals_mlx_lm_evaluate(k):
    from mlx_lm.tuner.trainer import evaluate as mlx_lm_evaluate

    from memguard_mlx import evaluate

    model = build_model("qwen2")
    data = TokenRows(24, seed=7)
    np.random.seed(4)
    ref = mlx_lm_evaluate(model, data, batch_size=8, num_batches=-1, max_seq_length=64)
    np.random.seed(4)
    got = evaluate(model, data, batch_size=8, num_batches=-1, max_seq_length=64, micro_batches=k)
    assert got == pytest.approx(ref, rel=1e-6)
    if k == 1:
        assert got == ref  # upstream's arithmetic, operation for operation


def test_split_evaluate_rejects_bad_micro_batches():
    from memguard_mlx import evaluate

    with pytest.raises(ConfigError) as ei:
        evaluate(build_model("llama"), TokenRows(8), batch_size=8, num_batches=1, micro_batches=0)
    assert ei.value.field == "micro_batches"


def test_guarded_eval_starts_at_eval_micro_batches():
    """``eval_micro_batches`` is the validation k a pass starts at; the training k wins when larger."""
    from mlx_lm.tuner.trainer import evaluate as mlx_lm_evaluate

    from memguard_mlx import GuardedEval

    model, data = build_model("qwen2"), TokenRows(24, seed=7)
    np.random.seed(4)
    ref = mlx_lm_evaluate(model, data, batch_size=8, num_batches=-1, max_seq_length=64)
    for training_k, eval_k, started in ((1, 3, 3), (4, 2, 4)):
        ev = GuardedEval(lambda: training_k, eval_micro_batches=eval_k)
        np.random.seed(4)
        assert ev.evaluate(model, data, batch_size=8, num_batches=-1, max_seq_length=64) == pytest.approx(ref, rel=1e-6)
        assert ev.history == [(None, started)]


def test_mlx_guard_takes_the_shared_guard_options():
    """``MlxGuard`` is built from ``GuardOptions`` like the torch adapters: every shared option in its
    signature; those that mean nothing on MLX refused by name (docs/mlx.md, "Options")."""
    import inspect

    from memguard_core.options import GUARD_OPTION_NAMES
    from memguard_mlx import MlxGuard

    own = ["memory_controls", "leak_detector", "clear_cache_on_warning", "chunk_weight", "on_event"]
    assert list(inspect.signature(MlxGuard).parameters) == own + [n for n in GUARD_OPTION_NAMES if n not in own]
    g = MlxGuard(eval_micro_batches=2, trim_heap=False, device="mlx", budget_gib=1.0)
    assert (g.options.eval_micro_batches, g.options.trim_heap, g.options.device) == (2, False, "mlx")
    assert g.options.budget_bytes == 2**30 and not g.options.leak_detector and g.leak is not None
    for kw in (dict(device="cuda"), dict(loss_weighting="rows"), dict(cuda_snapshots="snaps"),
               dict(snapshot_steps=(3,)), dict(eval_micro_batches=0)):
        with pytest.raises(ConfigError) as ei:
            MlxGuard(**kw)
        assert ei.value.field == next(iter(kw))
