"""LoRA on a vision-language model's vision tower: PEFT's ``all-linear`` (and target names that match
the tower's linears by suffix) wraps the vision tower's and the projector's linears too
(peft ``tuners/tuners_utils.py`` ``_maybe_include_all_linear_layers``), so the tower gets adapters and
saves activations for the backward. Checked against PEFT's own adapters on real models and against
the tensors autograd saves in a real CPU training step with an image in the batch."""

import json
import warnings

import pytest

from memguard_core.estimator.cuda import CUDA_FRAGMENTATION
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.vision import vision_activation_bytes
from memguard_core.estimator.specs import TrainSpec
from memguard_core.estimator.trainable import lora_trainable_params, vision_lora_linears
from memguard_hf.model_spec import model_spec_from_hf_config
from memguard_torch.module_spec import model_spec_from_module
from test_model_sources import QWEN2_VL_2B

#: a Qwen2-VL narrowed to 2 decoder and 2 vision blocks; 16 x 16 patches per image (224 px) -> 64 tokens
TINY_QWEN2_VL = dict(
    model_type="qwen2_vl", image_token_id=999, vision_start_token_id=997, vision_end_token_id=996,
    text_config=dict(model_type="qwen2_vl_text", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, vocab_size=1000),
    vision_config=dict(depth=2, embed_dim=128, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2))
#: LLaVA with a CLIP tower (CLS token, QuickGELU, separate q/k/v) narrowed to 3 vision blocks, 112 px
TINY_LLAVA = dict(
    model_type="llava", image_token_id=999, image_seq_length=64,
    text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
    vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=256,
                       num_hidden_layers=3, num_attention_heads=4, image_size=112, patch_size=14))


def _config(d):
    from transformers import AutoConfig

    d = json.loads(json.dumps(d))
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _peft_model(cfg, targets, dtype="fp32", meta=False, attn="sdpa"):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if meta:
            with torch.device("meta"):
                model = AutoModelForImageTextToText.from_config(cfg, dtype=tdt)
        else:
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_config(cfg, dtype=tdt, attn_implementation=attn)
        tm = "all-linear" if targets == ("all-linear",) else list(targets)
        return get_peft_model(model, LoraConfig(r=8, target_modules=tm, lora_dropout=0.0))


def _lora_spec(targets, dtype="fp32", **kw):
    return TrainSpec(method="lora", lora_rank=8, lora_targets=targets, dtype=dtype, batch_size=1,
                     seq_length=32, **kw)


# -- which linears PEFT wraps ----------------------------------------------------------------

@pytest.mark.parametrize("name,targets", [
    ("qwen2_vl", ("all-linear",)), ("qwen2_vl", ("qkv", "fc1")), ("qwen2_vl", ("q_proj", "v_proj")),
    ("llava", ("all-linear",)), ("llava", ("q_proj", "v_proj")), ("llava", ("linear_1",)),
])
def test_adapters_match_peft(name, targets):
    """memguard's LoRA parameter count equals the adapters PEFT creates, vision side included."""
    cfg = _config(TINY_QWEN2_VL if name == "qwen2_vl" else TINY_LLAVA)
    pm = _peft_model(cfg, targets, meta=True)
    real = sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    vision = sum(p.numel() for n, p in pm.named_parameters()
                 if "lora_" in n and (".visual." in n or "vision_tower" in n or "multi_modal_projector" in n))
    ms = model_spec_from_hf_config(cfg)
    assert lora_trainable_params(ms, _lora_spec(targets)) == real
    assert bool(vision_lora_linears(ms, targets)) == (vision > 0)
    # the live module reads the same tower
    assert model_spec_from_module(pm).vision_tower == ms.vision_tower


# -- the tower's saved activations against a real step ----------------------------------------

def _saved_vision_bytes(name, targets, dtype, attn="sdpa"):
    """Bytes of the distinct non-parameter storages autograd saves from the vision tower's input to
    the projector's output in a real forward with one image, still alive when the loss is ready
    (``torch.autograd.graph.saved_tensors_hooks``); and the model's ModelSpec."""
    import gc
    import weakref

    import torch

    cfg = _config(TINY_QWEN2_VL if name == "qwen2_vl" else TINY_LLAVA)
    pm = _peft_model(cfg, targets, dtype, attn=attn)
    pm.train()
    params = {p.untyped_storage().data_ptr() for p in pm.parameters()}
    inner = pm.base_model.model.model
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (weakref.ref(t), st.nbytes())
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    tdt = next(pm.parameters()).dtype
    if name == "qwen2_vl":
        first, last, side = inner.visual, inner.visual, 16
        n_img = side * side // 4
        ids = torch.tensor([[5, 997] + [999] * n_img + [996] + [7] * 20])
        batch = dict(pixel_values=torch.randn(side * side, 3 * 2 * 14 * 14, dtype=tdt),
                     image_grid_thw=torch.tensor([[1, side, side]]), mm_token_type_ids=(ids == 999).int())
    else:
        first, last = inner.vision_tower, inner.multi_modal_projector
        ids = torch.tensor([[5] + [999] * 64 + [7] * 20])
        batch = dict(pixel_values=torch.randn(1, 3, 112, 112, dtype=tdt))
    h1 = first.register_forward_pre_hook(lambda *a: hooks.__enter__())
    h2 = last.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = pm(input_ids=ids, labels=ids, **batch)
    h1.remove()
    h2.remove()
    gc.collect()
    live = sum(nb for ref, nb in seen.values() if ref() is not None)
    out.loss.backward()  # the step runs through the tower
    ms = model_spec_from_module(pm)
    if name == "qwen2_vl":  # this image's size: 16 x 16 patches, 64 tokens (the spec assumes 448 px)
        ms = ms.replace(vision_tower=ms.vision_tower.__class__(
            **{**ms.vision_tower.__dict__, "patches_per_image": side * side, "projector_tokens": n_img}))
    return live, ms


@pytest.mark.parametrize("name,targets,dtype,attn", [
    ("qwen2_vl", ("all-linear",), "fp32", "sdpa"), ("qwen2_vl", ("all-linear",), "bf16", "sdpa"),
    ("qwen2_vl", ("qkv",), "fp32", "sdpa"), ("llava", ("all-linear",), "bf16", "sdpa"),
    ("llava", ("q_proj", "v_proj"), "bf16", "sdpa"),
    # eager attention: the probabilities instead of SDPA's output and logsumexp; Qwen2-VL's v is still
    # a view keeping the fused qkv output alive
    ("qwen2_vl", ("all-linear",), "fp32", "eager"), ("llava", ("all-linear",), "bf16", "eager"),
])
def test_vision_activations_match_a_real_step(name, targets, dtype, attn):
    """The analytic vision term (``vision_activation_bytes``, one image) is within 3 % of what autograd
    saves in the tower and projector of a real PEFT LoRA step (the rest: LayerNorm mean / rstd
    and the like, per token and small)."""
    measured, ms = _saved_vision_bytes(name, targets, dtype, attn)
    analytic = vision_activation_bytes(ms, _lora_spec(targets, dtype, attn_impl=attn), 1.0)
    assert measured > 0
    assert analytic == pytest.approx(measured, rel=0.03)


def test_qv_on_qwen2_vl_saves_nothing_in_the_tower():
    """q_proj / v_proj name no linear of Qwen2-VL's tower (qkv / proj): nothing there needs a gradient."""
    measured, ms = _saved_vision_bytes("qwen2_vl", ("q_proj", "v_proj"), "bf16")
    assert measured == 0 == vision_activation_bytes(ms, _lora_spec(("q_proj", "v_proj"), "bf16"), 1.0)


# -- the estimate ----------------------------------------------------------------------------

def _today(ms):
    """The spec as memguard read it before the tower was modelled (no vision tower numbers)."""
    return ms.replace(vision_tower=None)


def test_all_linear_adds_the_vision_term_and_qv_is_unchanged():
    """Qwen2-VL-2B, one 448 px image per row: q,v LoRA is estimated exactly as before; all-linear
    adds the tower's adapters (fp32 weights, gradients, AdamW moments: 16 bytes each) and its saved
    activations, both live at the peak, plus the caching allocator's share of them."""
    ms = model_spec_from_hf_config(QWEN2_VL_2B)
    kw = dict(batch_size=2, seq_length=512, image_tokens=256, dtype="bf16", device="cuda", method="lora")
    qv = TrainSpec(lora_targets=("q_proj", "v_proj"), **kw)
    al = TrainSpec(lora_targets=("all-linear",), **kw)
    assert estimate(ms, qv).peak_bytes == estimate(_today(ms), qv).peak_bytes
    new, old = estimate(ms, al), estimate(_today(ms), al)
    assert new.phase == old.phase == "loss"
    adapters = lora_trainable_params(ms, al) - lora_trainable_params(_today(ms), al)
    act = vision_activation_bytes(ms, al, 1.0)  # one image per row, 2 rows
    assert act > 1e9  # 32 ViT blocks x 1024 patches x 2 rows
    vision = (act + 16 * adapters) * (1 + CUDA_FRAGMENTATION)
    assert new.peak_bytes - old.peak_bytes == pytest.approx(vision, rel=0.01)
    assert new.peak_bytes > estimate(ms, qv).peak_bytes + vision * 0.9
    assert any("vision tower" in n for n in new.notes)
    # no image in the rows: adapters only
    text = estimate(ms, al.replace(image_tokens=0))
    assert text.peak_bytes - estimate(_today(ms), al.replace(image_tokens=0)).peak_bytes < 0.2e9


def test_images_per_row_scale_the_vision_term():
    ms = model_spec_from_hf_config(QWEN2_VL_2B)
    one = vision_activation_bytes(ms, TrainSpec(method="lora", lora_targets=("all-linear",), dtype="bf16",
                                            batch_size=3), 1.0)
    ts = TrainSpec(method="lora", lora_targets=("all-linear",), dtype="bf16", batch_size=3, seq_length=64)
    assert vision_activation_bytes(ms, ts, 2.0) == pytest.approx(2 * one, rel=1e-6)
    ckpt = vision_activation_bytes(ms, ts.replace(grad_checkpoint=True), 1.0)
    assert 0 < ckpt < one / 5  # one block input per vision block (+ the merger)


def test_clip_q_v_targets_reach_llava_tower():
    """LLaVA's CLIP tower names its projections q_proj / v_proj: PEFT's suffix rule wraps them with
    the decoder's, so q,v LoRA on LLaVA counts the tower's adapters and activations."""
    from transformers import AutoConfig

    ms = model_spec_from_hf_config(AutoConfig.for_model("llava"))
    ts = TrainSpec(method="lora", lora_targets=("q_proj", "v_proj"), dtype="bf16", batch_size=1,
                   seq_length=256, image_tokens=ms.image_tokens, device="cuda")
    assert {lin.path for lin, _ in vision_lora_linears(ms, ts.lora_targets)} == {"self_attn.q_proj",
                                                                                  "self_attn.v_proj"}
    assert estimate(ms, ts).peak_bytes > estimate(_today(ms), ts).peak_bytes


def test_unread_tower_is_named_in_a_note():
    """Mllama's tower is not read: all-linear says so rather than guess."""
    from transformers import AutoConfig

    ms = model_spec_from_hf_config(AutoConfig.for_model("mllama"))
    assert ms.vision_tower is None and ms.params.vision > 0
    est = estimate(ms, TrainSpec(method="lora", lora_targets=("all-linear",), dtype="bf16", seq_length=64))
    assert any("does not read" in n for n in est.notes)


def test_a_recorded_vision_language_spec_scores_as_the_live_one():
    # bench --reuse rebuilds specs from their JSON records: the tower must come back as a VisionTower
    import dataclasses

    from memguard_bench.score import model_spec_from_dict

    ms = model_spec_from_hf_config(QWEN2_VL_2B)
    back = model_spec_from_dict(json.loads(json.dumps(dataclasses.asdict(ms))))
    assert back == ms
    ts = TrainSpec(method="lora", lora_targets=("all-linear",), dtype="bf16", device="cuda",
                   image_tokens=ms.image_tokens)
    assert estimate(back, ts).peak_bytes == estimate(ms, ts).peak_bytes
