"""Per block kind of a bench architecture: the bytes one forward saves for the backward and the bytes
it allocates and frees inside the block (split at glibc's largest mmap threshold, 32 MiB: below it a
freed tensor leaves a heap hole, above it it is unmapped), on real CPU tensors with PEFT's LoRA.

    python bench/freed_census.py granite4-h-350m-32l --rows 1 --seq 512 --targets all-linear --layers 11

A storage is "freed" when it was first made by an op inside the block's forward and no reference
to it is left when the block returns (``StorageWeakRef.expired``); "saved" counts what autograd's
``saved_tensors_hooks`` see inside the block (each storage once, parameters excluded). The
architectures are the bench's (``memguard_bench/data/archs_*.toml``), random weights; ``--layers``
cuts the block count (the figures are per block). Used for docs/estimator.md, "The heap of traced
blocks and of checkpointed LoRA: two censuses".
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Dict, List, Optional

from memguard_core.estimator.cpu_heap import MMAP_THRESHOLD_MAX  # glibc's largest mmap threshold, 32 MiB


def census(key: str, rows: int, seq: int, targets: List[str], rank: int = 16, dtype: str = "fp32",
           layers: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """Block kind -> {blocks, saved, freed_heap, freed_mmap} (bytes per block) for one forward of
    ``rows`` x ``seq`` tokens of the bench architecture ``key`` with LoRA on ``targets``.

    Raises:
        SystemExit: ``key`` names no bench architecture, or one that is not a decoder-only language
            model or a sequence classifier over ``input_ids`` (an encoder-decoder or image model:
            the census does not build their inputs or both stacks).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from memguard_bench.cases import HF_ARCHS, HF_FULL_DEPTH_ARCHS

    if key not in HF_FULL_DEPTH_ARCHS and key not in HF_ARCHS:
        raise SystemExit(f"freed_census: no bench architecture {key!r} (archs_full_depth.toml / archs_matrix.toml)")
    arch = dict(HF_FULL_DEPTH_ARCHS.get(key) or HF_ARCHS[key])
    heads = " ".join(arch.get("architectures") or [])
    if arch.get("is_encoder_decoder") or "ImageClassification" in heads or "TokenClassification" in heads:
        raise SystemExit(f"freed_census: {key} ({heads}) is not a decoder-only LM or a sequence classifier; "
                         "only those are built here")
    model_type = arch.pop("model_type")
    if layers:
        for f in ("num_hidden_layers", "n_layer", "n_layers"):
            if f in arch:
                arch[f] = layers
        if "layer_types" in arch:
            arch["layer_types"] = arch["layer_types"][:layers]
    cfg = AutoConfig.for_model(model_type, **arch)
    auto = AutoModelForSequenceClassification if "SequenceClassification" in str(arch.get("architectures")) \
        else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(cfg, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    lora = LoraConfig(r=rank, target_modules="all-linear" if targets == ["all-linear"] else targets)
    model = get_peft_model(model, lora)
    model.train()
    blocks = next(list(m) for m in model.modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) == cfg.num_hidden_layers)

    stack: List[int] = []
    made = collections.defaultdict(list)
    seen = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    kept = set(seen)
    per = collections.defaultdict(collections.Counter)

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if stack:
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(t, torch.Tensor):
                        ref = StorageWeakRef(t.untyped_storage())
                        if ref not in seen:
                            seen.add(ref)
                            made[stack[-1]].append((ref, t.untyped_storage().nbytes()))
            return out

    def enter(i):
        return lambda _m, _a: stack.append(i)

    def leave(i):
        def hook(_m, _a, _o):
            stack.pop()
            for ref, n in made[i]:
                if ref.expired():
                    per[i]["freed_heap" if n < MMAP_THRESHOLD_MAX else "freed_mmap"] += n
        return hook

    def pack(t):
        if stack and isinstance(t, torch.Tensor):
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in kept:
                kept.add(ref)
                per[stack[-1]]["saved"] += t.untyped_storage().nbytes()
        return t

    for i, b in enumerate(blocks):
        b.register_forward_pre_hook(enter(i))
        b.register_forward_hook(leave(i))
    ids = torch.randint(0, cfg.vocab_size, (rows, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Track():
        model(input_ids=ids)

    out: Dict[str, Dict[str, float]] = {}
    for i, b in enumerate(blocks):
        mixers = [type(m).__name__ for m in b.modules()
                  if any(w in type(m).__name__ for w in ("Mamba", "Conv", "Attention"))]
        kind = mixers[0] if mixers else type(b).__name__
        row = out.setdefault(kind, {"blocks": 0, "saved": 0.0, "freed_heap": 0.0, "freed_mmap": 0.0})
        row["blocks"] += 1
        for f in ("saved", "freed_heap", "freed_mmap"):
            row[f] += per[i][f]
    for row in out.values():
        for f in ("saved", "freed_heap", "freed_mmap"):
            row[f] /= row["blocks"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", help="a bench architecture key (archs_full_depth.toml or archs_matrix.toml)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--targets", default="q_proj,v_proj", help="LoRA targets, comma-separated, or all-linear")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many blocks")
    a = ap.parse_args(argv)
    rows = census(a.arch, a.rows, a.seq, a.targets.split(","), a.rank, a.dtype, a.layers)
    M = 2 ** 20
    print(f"| {a.arch} {a.rows} x {a.seq} {a.dtype} | block kind | blocks | saved MiB | freed, heap MiB "
          "| freed, mmapped MiB |")
    print("|---|---|---|---|---|---|")
    for kind, r in rows.items():
        print(f"| | {kind} | {r['blocks']} | {r['saved'] / M:.1f} | {r['freed_heap'] / M:.1f} "
              f"| {r['freed_mmap'] / M:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
