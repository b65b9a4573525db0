"""Validate memguard_core.estimate against real HF Trainer runs on this machine's CPU.

Each case runs in a FRESH subprocess (so VmHWM is that case's own high-water mark): it builds a
real architecture from config numbers with random weights (``AutoModelForCausalLM.from_config``,
no hub), optionally wraps it in PEFT LoRA, runs a few ``Trainer`` steps on random token ids and
reads ``VmHWM`` from /proc/self/status at the end. The child records the model facts (parameter
counts by kind from the live module, one block's linears) next to the measurement; the parent
builds the ModelSpec / TrainSpec, calls ``estimate`` and prints estimate vs actual.

Usage:
    python bench/measure_hf_cpu.py                 # all cases, table + bench/results/hf_cpu.json
    python bench/measure_hf_cpu.py --only smol     # cases whose name contains "smol"
    python bench/measure_hf_cpu.py --reuse         # re-estimate from saved measurements
    python bench/measure_hf_cpu.py --child '{...}' # (internal) one case
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "hf_cpu.json")

# Architectures by their published config numbers (random weights). Layer counts are cut where
# noted so that one case runs in < 30 s on 2 cores.
ARCHS = {
    # HuggingFaceTB/SmolLM2-135M config.json numbers (all 30 layers)
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0),
    # openai-community/gpt2 numbers, 4 of its 12 layers
    "gpt2-4l": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=4, n_head=12,
                    n_positions=1024),
    # Qwen/Qwen2-0.5B-like numbers, narrowed: 151936 vocab (logits-heavy), 4 layers, GQA 8/2
    "qwen2-4l": dict(model_type="qwen2", vocab_size=151936, hidden_size=512,
                     intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=4096),
    # Llama-style MHA, untied head, 8 layers
    "llama-8l": dict(model_type="llama", vocab_size=32000, hidden_size=512,
                     intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=8, tie_word_embeddings=False,
                     max_position_embeddings=4096),
    # a negligible model: what remains is the runtime overhead of Python + torch + Trainer
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 tie_word_embeddings=True, max_position_embeddings=512),
    # tiny Mixtral: 8 experts, top-2, 4 layers
    "mixtral-4l": dict(model_type="mixtral", vocab_size=32000, hidden_size=256,
                       intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                       tie_word_embeddings=False, max_position_embeddings=4096),
}

# (name, arch, train settings)
def _cases():
    c = []

    def add(arch, **kw):
        kw.setdefault("method", "lora")
        kw.setdefault("batch_size", 2)
        kw.setdefault("seq_length", 128)
        kw.setdefault("dtype", "fp32")
        kw.setdefault("optimizer", "adamw")
        kw.setdefault("attn_impl", "sdpa")
        kw.setdefault("grad_checkpoint", False)
        kw.setdefault("lora_rank", 8)
        kw.setdefault("lora_targets", ["q_proj", "v_proj"])
        kw.setdefault("mixed_precision", False)
        kw.setdefault("grad_accum", 1)
        parts = [arch, kw["method"], f"b{kw['batch_size']}", f"s{kw['seq_length']}", kw["dtype"]]
        if kw["mixed_precision"]:
            parts.append("amp")
        parts.append(kw["attn_impl"])
        if kw["grad_checkpoint"]:
            parts.append("gc")
        if kw["optimizer"] != "adamw":
            parts.append(kw["optimizer"])
        if kw["grad_accum"] != 1:
            parts.append(f"ga{kw['grad_accum']}")
        if kw["method"] != "full" and kw["lora_targets"] != ["q_proj", "v_proj"]:
            parts.append("+".join(kw["lora_targets"]))
        c.append(("-".join(parts), arch, kw))

    add("tiny", batch_size=1, seq_length=32)
    add("tiny", method="full", batch_size=1, seq_length=32)
    # SmolLM2-135M: LoRA batch/seq sweep, gc, eager, bf16, autocast, full FT
    for b, sl in [(1, 128), (4, 128), (2, 256), (1, 512)]:
        add("smollm2-135m", batch_size=b, seq_length=sl)
    add("smollm2-135m", batch_size=4, seq_length=256, grad_checkpoint=True)
    add("smollm2-135m", batch_size=2, seq_length=256, attn_impl="eager")
    add("smollm2-135m", batch_size=2, seq_length=256, dtype="bf16")
    add("smollm2-135m", batch_size=2, seq_length=256, dtype="bf16", mixed_precision=True)
    add("smollm2-135m", method="full", batch_size=1, seq_length=128)
    add("smollm2-135m", method="full", batch_size=1, seq_length=128, optimizer="sgd")
    add("smollm2-135m", method="full", batch_size=2, seq_length=128, grad_checkpoint=True)
    # GPT-2: LoRA c_attn, full
    add("gpt2-4l", batch_size=4, seq_length=256, lora_targets=["c_attn"])
    add("gpt2-4l", method="full", batch_size=4, seq_length=128)
    add("gpt2-4l", method="full", batch_size=4, seq_length=256, attn_impl="eager")
    # Qwen2 (huge vocab): LoRA, full, bf16
    add("qwen2-4l", batch_size=4, seq_length=256)
    add("qwen2-4l", batch_size=8, seq_length=256, grad_checkpoint=True)
    add("qwen2-4l", method="full", batch_size=2, seq_length=256)
    add("qwen2-4l", method="full", batch_size=2, seq_length=256, dtype="bf16")
    add("qwen2-4l", method="full", batch_size=2, seq_length=256, optimizer="sgd")
    # Llama 8 layers: all-linear LoRA, eager long seq, full fp32
    add("llama-8l", batch_size=4, seq_length=256, lora_targets=["all-linear"])
    add("llama-8l", batch_size=2, seq_length=512, attn_impl="eager")
    add("llama-8l", method="full", batch_size=4, seq_length=256)
    add("llama-8l", method="full", batch_size=4, seq_length=256, grad_accum=2)
    # MoE
    add("mixtral-4l", batch_size=4, seq_length=256)
    add("mixtral-4l", method="full", batch_size=4, seq_length=256)
    # held out: added after CPU_HEAP_SLACK_* were fitted on the cases above
    add("smollm2-135m", batch_size=2, seq_length=128, lora_rank=16,
        lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    add("qwen2-4l", batch_size=2, seq_length=512, dtype="bf16")
    add("llama-8l", batch_size=8, seq_length=128, grad_checkpoint=True)
    add("gpt2-4l", batch_size=2, seq_length=512, attn_impl="eager", lora_targets=["c_attn"])
    add("mixtral-4l", batch_size=8, seq_length=128, dtype="bf16", mixed_precision=True)
    add("llama-8l", method="full", batch_size=2, seq_length=256, optimizer="adafactor")
    add("llama-8l", method="full", batch_size=2, seq_length=256, dtype="bf16", attn_impl="eager")
    return c


CASES = _cases()


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else 0


def _linear_shapes(model, block):
    """One block's projections as LinearShape dicts (nn.Linear, GPT-2 Conv1D, fused 3-D experts)."""
    import torch

    out = []
    for name, mod in block.named_modules():
        short = name.split(".")[-1]
        kind = ("experts" if "experts" in name else "router" if short in ("gate", "router")
                and "mlp" in name or "block_sparse_moe" in name and short == "gate"
                else "attention" if "attn" in name else "mlp")
        if isinstance(mod, torch.nn.Linear):
            out.append(dict(name=short, in_features=mod.in_features, out_features=mod.out_features,
                            count=1, kind=kind, bias=mod.bias is not None))
        elif type(mod).__name__ == "Conv1D":  # GPT-2: weight (in, out)
            i, o = mod.weight.shape
            out.append(dict(name=short, in_features=i, out_features=o, count=1, kind=kind,
                            bias=mod.bias is not None))
    # fused expert parameters (transformers 5: experts.gate_up_proj (E, 2I, H), experts.down_proj)
    for pname, p in block.named_parameters():
        if "experts" in pname and p.dim() == 3:
            e, o, i = p.shape
            out.append(dict(name=pname.split(".")[-1], in_features=i, out_features=o, count=e,
                            kind="experts", bias=False))
    # router as a plain parameter (transformers 5 routers may hold a 2-D weight, not nn.Linear)
    for pname, p in block.named_parameters():
        if ("gate" in pname and "experts" not in pname and "proj" not in pname and p.dim() == 2
                and not any(d["kind"] == "router" for d in out)):
            o, i = p.shape
            out.append(dict(name="gate", in_features=i, out_features=o, count=1, kind="router"))
    return out


def _param_counts(model):
    """Parameter counts by kind from the live (base) model; tied weights counted once."""
    seen = set()
    c = dict(embeddings=0, attention=0, mlp=0, experts=0, router=0, norms=0, lm_head=0, other=0,
             norms_in_blocks=0)
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or "lora_" in name:
            continue
        seen.add(id(p))
        n = p.numel()
        in_block = ".layers." in name or ".h." in name
        if "embed" in name or ".wte." in name or ".wpe." in name:
            c["embeddings"] += n
        elif "lm_head" in name:
            c["lm_head"] += n
        elif "norm" in name or ".ln_" in name:
            c["norms"] += n
            if in_block:
                c["norms_in_blocks"] += n
        elif "experts" in name:
            c["experts"] += n
        elif ("gate" in name and "proj" not in name) or "router" in name:
            c["router"] += n
        elif "attn" in name:
            c["attention"] += n
        elif "mlp" in name:
            c["mlp"] += n
        else:
            c["other"] += n
    return c


def child(case: dict) -> dict:
    t0 = time.time()
    rss0 = _status_kib("VmRSS")
    import torch
    from torch.utils.data import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    kw = case["train"]
    arch = dict(ARCHS[case["arch"]])
    mt = arch.pop("model_type")
    config = AutoConfig.for_model(mt, **arch)
    dtype = torch.bfloat16 if (kw["dtype"] == "bf16" and not kw["mixed_precision"]) else torch.float32
    rss_import = _status_kib("VmRSS")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=kw["attn_impl"])
    base = model
    counts = _param_counts(model)
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if blocks is None:
        blocks = model.transformer.h
    linears = _linear_shapes(model, blocks[0])
    if kw["method"] == "lora":
        from peft import LoraConfig, get_peft_model

        targets = kw["lora_targets"]
        lc = LoraConfig(r=kw["lora_rank"], lora_alpha=2 * kw["lora_rank"], lora_dropout=0.0,
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        task_type="CAUSAL_LM")
        model = get_peft_model(model, lc)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rss_model = _status_kib("VmRSS")
    try:  # the project's own introspection (memguard_core.spec), when available
        import dataclasses

        sys.path.insert(0, ROOT)
        from memguard_core.spec import model_spec_from_module

        spec_dict = dataclasses.asdict(model_spec_from_module(model, name=case["arch"]))
    except Exception as exc:  # older checkout: the parent falls back to the facts below
        spec_dict = {"error": repr(exc)}

    n, s = kw["batch_size"] * kw["grad_accum"] * 4, kw["seq_length"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (n, s), generator=g)

    class DS(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i], "attention_mask": torch.ones(s, dtype=torch.long)}

    optim = {"adamw": "adamw_torch_fused", "adam": "adamw_torch_fused", "sgd": "sgd",
             "adafactor": "adafactor"}[kw["optimizer"]]
    args = TrainingArguments(
        output_dir="/tmp/memguard_bench_out", per_device_train_batch_size=kw["batch_size"],
        gradient_accumulation_steps=kw["grad_accum"], max_steps=2, learning_rate=1e-4,
        optim=optim, bf16=kw["dtype"] == "bf16" and kw["mixed_precision"], use_cpu=True,
        gradient_checkpointing=kw["grad_checkpoint"], report_to=[], save_strategy="no",
        logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=DS())
    rss_trainer = _status_kib("VmRSS")
    trainer.train()
    return dict(
        vmhwm=_status_kib("VmHWM") * 1024, rss_start=rss0 * 1024, rss_import=rss_import * 1024,
        rss_model=rss_model * 1024, rss_trainer=rss_trainer * 1024, seconds=time.time() - t0,
        counts=counts, linears=linears, trainable=trainable, model_spec=spec_dict,
        config=dict(vocab_size=config.vocab_size,
                    hidden_size=getattr(config, "hidden_size", None) or config.n_embd,
                    intermediate_size=getattr(config, "intermediate_size", None)
                    or (getattr(config, "n_inner", None) or 4 * config.n_embd),
                    num_layers=config.num_hidden_layers,
                    num_heads=config.num_attention_heads,
                    num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                    num_experts=getattr(config, "num_local_experts", 0) or 0,
                    num_experts_per_tok=getattr(config, "num_experts_per_tok", 0) or 0,
                    tie=bool(getattr(config, "tie_word_embeddings", False)),
                    model_type=mt),
    )


def spec_from_record(case: dict, rec: dict):
    """ModelSpec/TrainSpec for a measured case (built from the child's live-module facts)."""
    sys.path.insert(0, ROOT)
    from memguard_core.spec import LinearShape, ModelSpec, ParamCounts, TrainSpec

    cfg = rec["config"]
    kw = case["train"]
    sd = rec.get("model_spec") or {}
    if "params" in sd:  # introspected by memguard_core.spec.model_spec_from_module in the child
        sd = dict(sd)
        sd["params"] = ParamCounts(**sd["params"])
        sd["block_linears"] = tuple(LinearShape(**d) for d in sd["block_linears"])
        ms = ModelSpec(**sd)
        return ms, _train_spec(kw)
    dense_bits = 16.0 if (kw["dtype"] == "bf16" and not kw["mixed_precision"]) else 32.0
    ms = ModelSpec(
        name=case["arch"], model_type=cfg["model_type"], vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_layers"], num_heads=cfg["num_heads"], num_kv_heads=cfg["num_kv_heads"],
        head_dim=cfg["hidden_size"] // cfg["num_heads"], params=ParamCounts(**rec["counts"]),
        block_linears=tuple(LinearShape(**d) for d in rec["linears"]),
        num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"] if cfg["num_experts"] else 0,
        tie_word_embeddings=cfg["tie"], weight_bits=dense_bits, dense_bits=dense_bits,
        source="module")
    return ms, _train_spec(kw)


def _train_spec(kw: dict):
    from memguard_core.spec import TrainSpec

    return TrainSpec(batch_size=kw["batch_size"], seq_length=kw["seq_length"],
                   grad_accum=kw["grad_accum"], method=kw["method"], lora_rank=kw["lora_rank"],
                   lora_targets=tuple(kw["lora_targets"]), optimizer=kw["optimizer"],
                   dtype=kw["dtype"], mixed_precision=kw["mixed_precision"],
                   grad_checkpoint=kw["grad_checkpoint"], attn_impl=kw["attn_impl"],
                   framework="hf", device="cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--only", default="")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--new", action="store_true", help="run only cases without a saved result")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if a.child:
        os.environ.setdefault("OMP_NUM_THREADS", "2")
        print("RESULT " + json.dumps(child(json.loads(a.child))))
        return
    sys.path.insert(0, ROOT)
    try:
        from memguard_core.estimate import estimate
    except ImportError:  # measuring before the estimator exists
        estimate = None

    saved = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            saved = json.load(f)
    rows = []
    for name, arch, kw in CASES:
        if a.only and a.only not in name:
            continue
        case = dict(arch=arch, train=kw)
        if a.new and name in saved:
            continue
        if a.reuse and name in saved:
            rec = saved[name]["measured"]
        else:
            p = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)],
                               capture_output=True, text=True, cwd=ROOT)
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                print(f"{name}: FAILED rc={p.returncode}\n{p.stderr[-3000:]}")
                continue
            rec = json.loads(line[0][7:])
        if estimate is None:
            saved[name] = dict(case=case, measured=rec)
            print(f"{name:58s} actual {rec['vmhwm'] / 2**20:8.1f} MiB ({rec['seconds']:.0f}s)", flush=True)
            continue
        ms, ts = spec_from_record(case, rec)
        est = estimate(ms, ts)
        err = (est.peak_bytes - rec["vmhwm"]) / rec["vmhwm"]
        saved[name] = dict(case=case, measured=rec, estimate=est.to_dict(), error=err)
        rows.append((name, est.peak_bytes, rec["vmhwm"], err, rec["seconds"], est))
        print(f"{name:58s} est {est.peak_bytes / 2**20:8.1f} MiB  actual {rec['vmhwm'] / 2**20:8.1f} MiB"
              f"  err {err * 100:+6.1f}%  ({rec['seconds']:.0f}s, phase {est.phase})", flush=True)
        if a.verbose:
            print("    ", {k: round(v / 2**20, 1) for k, v in est.breakdown.items()})
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(saved, f, indent=1, default=str)
    if rows:
        errs = [r[3] for r in rows]
        print(f"\n{len(rows)} cases: median |err| {statistics.median(abs(e) for e in errs) * 100:.1f}%,"
              f" worst under {min(errs) * 100:+.1f}%, worst over {max(errs) * 100:+.1f}%")


if __name__ == "__main__":
    main()
