"""Image classifiers (memguard_core/estimator/image_blocks.py, docs/estimator.md "Image classification
(ViT)"): what one ViT / DeiT block saves for its backward per token, against a census of the tensors
real blocks save (``memguard_torch.saved_census``: autograd's ``saved_tensors_hooks``, parameters and
buffers left out), full fine-tune and LoRA (PEFT, q_proj / v_proj), fp32, pure bf16 and bf16
autocast, dropouts 0 and 0.1; what the model saves outside its blocks against the census of a whole
forward; the spec read from a config (patch tokens, the head, the one-line refusals). Small configs,
random weights, CPU.

Per token: the census at two micro-batch sizes, the difference over the added tokens, so what does
not grow with the rows (autocast's weight casts, counted by the weights term) drops out.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.estimator.activations import block_act_per_token  # noqa: E402
from memguard_core.estimator.image_blocks import is_image_classifier, outside_bytes, with_patch_tokens  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_hf.model_spec import model_spec_from_hf_config  # noqa: E402
from memguard_torch.block_kinds import find_blocks  # noqa: E402
from memguard_torch.saved_census import saved_bytes_per_block  # noqa: E402

H, I, NH, L, IMG, P, B = 128, 512, 4, 3, 64, 8, 2   # 64 patches + CLS (+ DeiT's distillation token)
_ARCH = {"vit": "ViTForImageClassification", "deit": "DeiTForImageClassification"}


def _config(model_type: str, p: float):
    return transformers.AutoConfig.for_model(
        model_type, hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_hidden_layers=L,
        image_size=IMG, patch_size=P, num_labels=10, hidden_dropout_prob=p, attention_probs_dropout_prob=p,
        architectures=[_ARCH[model_type]])


def _model(model_type: str, *, p: float, attn: str, method: str, dtype: str, amp: bool, targets: tuple, lora_p: float):
    torch.manual_seed(0)
    model = transformers.AutoModelForImageClassification.from_config(_config(model_type, p), attn_implementation=attn)
    if dtype == "bf16" and not amp:
        model = model.to(torch.bfloat16)
    if method == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(targets), lora_dropout=lora_p,
                                                           modules_to_save=["classifier"]))
    return model.train()


def _census(model_type: str, rows=(B, 2 * B), **kw) -> list:
    """(saved bytes of the last block, saved bytes outside every block) at each micro-batch size."""
    model = _model(model_type, **kw)
    blocks = find_blocks(model, L)
    out = []
    for b in rows:
        pixels = torch.randn(b, 3, IMG, IMG)   # fp32, as image processors return them
        labels = torch.randint(0, 10, (b,))

        def forward():
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if kw["amp"] else contextlib.nullcontext()
            with ctx:
                return model(pixel_values=pixels, labels=labels).loss

        per = saved_bytes_per_block(forward, [model] + list(blocks),
                                    exclude=list(model.parameters()) + list(model.buffers()))
        out.append((per[-1], per[0]))
    return out


def _spec_ts(model_type: str, rows: int, **kw):
    ms = model_spec_from_hf_config(_config(model_type, kw["p"]))
    ts = TrainSpec(batch_size=rows, seq_length=512, method=kw["method"], dtype=kw["dtype"], mixed_precision=kw["amp"],
                   attn_impl=kw["attn"], lora_dropout=kw["lora_p"], lora_rank=4,
                   lora_targets=kw["targets"] or ("q_proj",), device="cpu")
    return ms, with_patch_tokens(ms, ts)


_SETTINGS = [
    # (method, dtype, autocast, attention, config dropout, LoRA targets, LoRA dropout)
    ("full", "fp32", False, "sdpa", 0.0, (), 0.0),     # ViT's configs: no dropout, SDPA's CPU flash kernel
    ("full", "fp32", False, "sdpa", 0.1, (), 0.0),     # SDPA's math path (attention dropout)
    ("full", "fp32", False, "eager", 0.0, (), 0.0),
    ("full", "bf16", False, "sdpa", 0.0, (), 0.0),
    ("full", "bf16", False, "eager", 0.0, (), 0.0),     # the fp32 softmax and its cast
    ("full", "bf16", True, "sdpa", 0.0, (), 0.0),
    ("full", "bf16", True, "eager", 0.1, (), 0.0),
    ("lora", "fp32", False, "sdpa", 0.0, ("q_proj", "v_proj"), 0.0),
    ("lora", "fp32", False, "sdpa", 0.1, ("q_proj", "v_proj"), 0.1),
    ("lora", "bf16", False, "sdpa", 0.0, ("q_proj", "v_proj"), 0.0),
    ("lora", "bf16", True, "sdpa", 0.0, ("q_proj", "v_proj"), 0.0),
    ("lora", "fp32", False, "sdpa", 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"), 0.0),
]


@pytest.mark.parametrize("model_type", ["vit", "deit"])
@pytest.mark.parametrize("method,dtype,amp,attn,p,targets,lora_p", _SETTINGS)
def test_block_rule_equals_the_census_per_token(model_type, method, dtype, amp, attn, p, targets, lora_p):
    kw = dict(p=p, attn=attn, method=method, dtype=dtype, amp=amp, targets=targets, lora_p=lora_p)
    (small, _), (large, _) = _census(model_type, **kw)
    ms, ts = _spec_ts(model_type, B, **kw)
    per_token = (large - small) / (B * ts.seq_length)
    assert per_token > 0
    a = block_act_per_token(ms, ts, lora=method == "lora", trainable_block=method == "full")
    assert (a.hidden + a.scores + a.lora) == pytest.approx(per_token, rel=0.005)


@pytest.mark.parametrize("method,dtype,amp,targets", [
    ("full", "fp32", False, ()), ("full", "bf16", False, ()), ("full", "bf16", True, ()),
    ("lora", "fp32", False, ("q_proj", "v_proj")), ("lora", "bf16", True, ("q_proj", "v_proj")),
])
def test_outside_the_blocks_equals_the_census(method, dtype, amp, targets):
    """What the forward saves outside every block (the embeddings, the final LayerNorm, the
    classifier, the loss), against ``outside_bytes`` less the pixels (the batch is not a saved
    tensor unless the convolution keeps it); per added row, so autocast's weight casts drop out."""
    kw = dict(p=0.0, attn="sdpa", method=method, dtype=dtype, amp=amp, targets=targets, lora_p=0.0)
    (_, out_s), (_, out_l) = _census("vit", **kw)
    ms, ts = _spec_ts("vit", B, **kw)
    _, ts2 = _spec_ts("vit", 2 * B, **kw)
    outside_census = out_l - out_s
    pixels = 4 * 3 * IMG * IMG * B * 2   # the HF Trainer's batch and accelerate's next one (pixel_rows)
    # the batch tensor itself is a saved tensor only where the fp32 convolution trains on it
    batch_saved = pixels // 2 if (method == "full" and dtype == "fp32") else 0
    rule = outside_bytes(ms, ts2) - outside_bytes(ms, ts) - pixels + batch_saved
    assert rule == pytest.approx(outside_census, rel=0.01, abs=4096)


def test_spec_from_a_vit_config():
    ms = model_spec_from_hf_config(_config("vit", 0.0))
    assert is_image_classifier(ms)
    assert (ms.image_size, ms.patch_size, ms.num_channels, ms.prefix_tokens, ms.patch_tokens) == (IMG, P, 3, 1, 65)
    assert ms.head.num_labels == 10 and ms.head.kind == "image_classification" and ms.vocab_size == 1
    deit = model_spec_from_hf_config(_config("deit", 0.0))
    assert deit.patch_tokens == 66
    ts = with_patch_tokens(ms, TrainSpec(seq_length=512))
    assert ts.seq_length == 65
    # a bare ViTModel's config (the in21k checkpoints) is read as the image classifier too
    bare = dict(_config("vit", 0.0).to_dict(), architectures=["ViTModel"])
    assert model_spec_from_hf_config(bare).patch_tokens == 65


@pytest.mark.parametrize("change,field", [
    (dict(model_type="dinov2", architectures=["Dinov2ForImageClassification"], image_size=56, patch_size=14),
     "model_type"),
    (dict(architectures=["DeiTForImageClassificationWithTeacher"], model_type="deit"), "architectures"),
    (dict(patch_size=0), "patch_size"),
    (dict(image_size=4), "image_size"),
    (dict(architectures=["ViTForMaskedImageModeling"]), "architectures"),   # its decoder and pixel loss
])
def test_bad_image_configs_refused_in_one_line(change, field):
    d = dict(model_type="vit", hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_hidden_layers=L,
             image_size=IMG, patch_size=P, num_labels=10, architectures=["ViTForImageClassification"])
    d.update(change)
    with pytest.raises(ConfigError) as err:
        model_spec_from_hf_config(d)
    assert "\n" not in str(err.value) and field in str(err.value)


def test_a_spec_field_at_zero_is_named():
    from memguard_core.estimator.specs import ModelSpec

    ms = model_spec_from_hf_config(_config("vit", 0.0))
    assert isinstance(ms, ModelSpec)
    for f in ("num_channels", "image_size"):
        with pytest.raises(ConfigError) as err:
            ms.replace(**{f: 0, "patch_size": P})
        assert err.value.field == f


def test_cli_estimates_a_vit_config(tmp_path, capsys):
    """``memguard estimate`` on a ViT config.json: the head from ``architectures``, the rows' tokens
    the patch count whatever ``--seq-length`` says; ``--head image_classification`` on a bare
    ``ViTModel`` config gives the same figure. (The CLI's ``main`` in this process: it needs no
    environment of its own.)"""
    import json

    from memguard_core.cli import main

    def cli(*args):
        code = main(["estimate", *args])
        out, err = capsys.readouterr()
        return code, out, err

    d = _config("vit", 0.0).to_dict()
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    run = ["--config", str(p), "--device", "cpu", "--method", "full", "--dtype", "fp32", "--batch-size", "4",
           "--json"]
    code, text, err = cli(*run)
    assert code == 0, err
    out = json.loads(text)
    assert out["model"]["head"]["kind"] == "image_classification"
    assert (out["model"]["image_size"], out["model"]["patch_size"]) == (IMG, P)
    assert out["breakdown"]["activations"] > 0 and out["breakdown"]["logits"] < 4096
    code, text, err = cli(*run, "--seq-length", "4096")
    assert code == 0, err
    assert json.loads(text)["peak_bytes"] == out["peak_bytes"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(dict(d, architectures=["ViTModel"])))
    code, text, err = cli(*[a if a != str(p) else str(bare) for a in run], "--head", "image_classification")
    assert code == 0, err
    assert json.loads(text)["peak_bytes"] == out["peak_bytes"]
    d2 = dict(d, model_type="dinov2", architectures=["Dinov2ForImageClassification"])
    (tmp_path / "dino.json").write_text(json.dumps(d2))
    code, _, err = cli(*[a if a != str(p) else str(tmp_path / "dino.json") for a in run])
    assert code != 0 and "model_type" in err and "vit, deit" in err
    # --trace builds a causal-LM step: refused in one line, not transformers' list of every class
    code, _, err = cli(*run, "--trace")
    assert code == 2 and "--trace" in err and len(err.strip().splitlines()) == 1, err


def test_the_in_process_measurement_runs_on_an_image_batch():
    """The preflight's measurement on a live ViT (CPU, VmHWM): an image batch is cut by rows only
    (its patches cannot be cut), one row at the run's patch count (``probe_sizes`` with the model
    spec, whatever the run's ``seq_length`` says), the fit made against the estimate at that size.
    Before, the pixels' channel dimension was read as the tokens (3)."""
    from memguard_core.estimator.probe_fit import correct_estimate
    from memguard_core.probe_policy import probe_sizes
    from memguard_hf.model_spec import live_model_spec
    from memguard_torch.preflight_probe import cut_batch, measure_steps

    torch.manual_seed(0)
    img = 160   # 400 patches + CLS: above the text sizes' 256, so the image rule is what gives 401
    cfg = _config("vit", 0.0)
    cfg.image_size = img
    model = transformers.AutoModelForImageClassification.from_config(cfg)
    batch = {"pixel_values": torch.randn(2, 3, img, img), "labels": torch.tensor([1, 3])}
    cut, r, t = cut_batch(batch, 1, 401)
    assert (r, t) == (1, 401) and cut["pixel_values"].shape == (1, 3, img, img) and cut["labels"].shape == (1,)
    ms = live_model_spec(model)
    ts = TrainSpec(batch_size=2, seq_length=2048, method="full", dtype="fp32", framework="hf", device="cpu")
    sizes = probe_sizes(ts, ms)
    assert sizes == ((1, 401),) and probe_sizes(ts) == ((1, 256), (1, 512))
    ts = ts.replace(seq_length=401)
    res = measure_steps(model, batch, sizes, device="cpu")
    assert res.measured, res.reason
    assert [(s.rows, s.tokens) for s in res.steps] == [(1, 401)] and res.steps[0].peak_bytes > res.steps[0].held_bytes
    fit = correct_estimate(ms, ts, res)
    assert fit.applied and "1 x 401 tokens" in fit.explanation


def test_the_planner_never_shortens_an_image_classifiers_tokens():
    """An image's patches cannot be cut by the run: the planner takes the patch count whatever
    ``seq_length`` it is given, never halves it, and never suggests shorter sequences; it reaches
    the LoRA rank instead."""
    from memguard_core.errors import DoesNotFitError
    from memguard_core.estimator.estimate import estimate
    from memguard_core.plan import plan

    ms = model_spec_from_hf_config(_config("vit", 0.0))
    ts = TrainSpec(batch_size=1, seq_length=512, method="lora", lora_rank=64, lora_targets=("all-linear",),
                   grad_checkpoint=True, dtype="fp32", framework="hf", device="cpu")
    need = estimate(ms, ts.replace(seq_length=ms.patch_tokens, lora_rank=8)).peak_bytes
    p = plan(ms, ts, int(need * 1.01), allow=("seq_length", "lora_rank"))
    assert p.train_spec.seq_length == ms.patch_tokens == (IMG // P) ** 2 + 1
    assert [c.field for c in p.changes] and all(c.field == "lora_rank" for c in p.changes), p.changes
    try:
        plan(ms, ts, 2**20, allow=("seq_length",))
    except DoesNotFitError as exc:
        assert not any("shorter sequences" in s for s in exc.suggestions), exc.suggestions
    else:
        raise AssertionError("1 MiB cannot fit")


def test_the_generic_module_reader_refuses_an_image_model_in_one_line():
    # Lightning's and TorchGuard's preflight read a live module without the HF image fields: a ViT
    # (no token vocabulary, a patch conv as its input embedding) is refused naming the model, not
    # an AttributeError
    from memguard_torch.module_spec import model_spec_from_module

    model = transformers.AutoModelForImageClassification.from_config(_config("vit", 0.0))
    with pytest.raises(ConfigError) as err:
        model_spec_from_module(model)
    assert err.value.field == "model" and "\n" not in str(err.value)


def test_an_in_place_split_still_holds_the_collated_batches_pixels():
    """The guard cuts each collated batch into micro-batches in place: the HF ``Trainer`` still
    holds the accumulation window's batches and accelerate's next one, whole (Lightning: the batch
    and the next; a plain loop: its batch), so a split plan counts the requested batch's pixels."""
    from memguard_core.estimator.estimate import estimate
    from memguard_core.estimator.image_blocks import pixel_rows
    from memguard_core.preflight import plan_in_place

    ts = TrainSpec(batch_size=8, grad_accum=2, seq_length=65, method="full", dtype="fp32", framework="hf")
    assert pixel_rows(ts) == 2 * 8 + 8                                   # unsplit: as before
    split = ts.replace(batch_size=2, grad_accum=8, collated_rows=8)
    assert pixel_rows(split) == 16 + 8                                   # the same images held
    assert pixel_rows(split.replace(collated_rows=None)) == 16 + 2       # a real micro-batch of 2
    assert pixel_rows(split.replace(framework="lightning")) == 16 and pixel_rows(split.replace(framework="torch")) == 8
    with pytest.raises(ConfigError, match="collated_rows"):
        ts.replace(collated_rows=4)

    ms = model_spec_from_hf_config(_config("vit", 0.0))
    per_image = 4 * 3 * IMG * IMG
    at_4 = estimate(ms, ts.replace(batch_size=4, grad_accum=4, collated_rows=8)).peak_bytes
    assert at_4 < estimate(ms, ts).peak_bytes
    pf = plan_in_place(ms, ts, budget_bytes=at_4 + (1 << 20), correction=1.0)
    chosen = pf.plan.train_spec
    assert chosen.batch_size < 8 and chosen.collated_rows == 8 and pf.micro_batches == 8 // chosen.batch_size
    own = estimate(ms, chosen.replace(collated_rows=None))
    assert estimate(ms, chosen).phases["loss"] - own.phases["loss"] == (8 - chosen.batch_size) * per_image
