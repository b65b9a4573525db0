"""``memguard`` command line: estimate | probe | demo | run | bench | calibration.

    memguard estimate Qwen/Qwen2.5-7B-Instruct --batch-size 4 --seq-length 2048   # hub id (config only)
    memguard estimate --config config.json --batch-size 8 --seq-length 2048 --method lora
    memguard estimate --config config.json ... --budget-gib 20      # and plan against a budget
    memguard estimate ... --json                                     # one JSON object
    memguard probe                                                   # what this machine offers
    memguard demo                                                    # a guarded real fine-tune
    memguard run -- python train.py --output_dir out                 # restart after an OOM kill
    memguard bench [--quick] [--only TEXT] [--json PATH] [--submit]  # the estimate vs real runs here
    memguard calibration show | reset                                # the auto-calibration store
    memguard report run.jsonl --png run.png                          # a guarded run's timeline

Exit codes: 0 ok; 2 bad input (the message names the flag); 3 the run does not fit the budget.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import List, Optional

from . import __version__
from .errors import ConfigError, DoesNotFitError, MemGuardError

# TrainSpec / ModelSpec field -> the CLI flag that sets it (so errors name what the user typed)
FLAG_OF = {
    "config": "--config", "model": "MODEL", "head": "--head", "image_tokens": "--image-tokens", "revision": "--revision",
    "batch_size": "--batch-size", "seq_length": "--seq-length", "grad_accum": "--grad-accum",
    "target_length": "--target-length",
    "method": "--method", "lora_rank": "--lora-rank", "lora_targets": "--lora-targets",
    "lora_layers": "--lora-layers", "lora_dropout": "--lora-dropout", "optimizer": "--optimizer", "dtype": "--dtype",
    "attn_impl": "--attn", "framework": "--framework", "model_code": "--model-code",
    "litgpt_version": "--litgpt-version", "device": "--device", "bnb_version": "--bnb-version",
    "model_params": "--model-params", "hidden_dim": "--hidden-dim", "num_layers": "--num-layers",
    "num_heads": "--num-heads", "num_kv_heads": "--num-kv-heads", "model_bits": "--model-bits",
    "vocab_size": "--vocab-size", "intermediate_size": "--intermediate-size",
    "budget_bytes": "--budget-gib", "safety_ratio": "--safety-ratio",
    "world_size": "--world-size", "sharding": "--sharding", "offload": "--offload",
    "shard_group_size": "--shard-group-size", "deepspeed": "--deepspeed", "zero_buckets": "--deepspeed",
}

GiB = 2**30

#: Flags that describe the model by plain numbers; a config (MODEL / --config) describes it instead.
SHAPE_FLAGS = ("model_params", "hidden_dim", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
               "intermediate_size", "model_bits")
#: Defaults of the plain-number flags that have one (given as None so that a flag set next to a
#: config can be told apart from its default).
SHAPE_DEFAULTS = {"vocab_size": 32000, "model_bits": 16}


def _note(args, text: str) -> None:
    """One line on stderr for a choice the CLI made for the user (stdout stays the table / JSON)."""
    print(f"memguard {args.command}: note: {text}", file=sys.stderr)


def _glibc_arg(args, device: str):
    """``--glibc``: the release given (``none``: unknown), else on a ``cpu`` estimate this machine's
    (``probes.glibc_version``; a note says so when it selects the newer heap factors).

    Raises:
        ConfigError: (``--glibc``) not a release such as 2.39 or ``none``.
    """
    from .estimator.specs import is_glibc_release

    given = getattr(args, "glibc", None)
    if given is None:
        if device != "cpu":
            return None
        from .estimator.cpu_heap import is_newer_glibc
        from .probes import glibc_version

        mine = glibc_version()
        if is_newer_glibc(mine):
            _note(args, f"--glibc not given: {mine} (this machine's), whose heap takes the heap-slack factors "
                        "fitted from 2.39 on")
        return mine
    v = str(given).strip().lower()
    if v in ("none", ""):
        return None
    if not is_glibc_release(v):
        raise ConfigError("--glibc", "a glibc release such as 2.39, or none", given)
    return v


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a Hugging Face Hub id (Qwen/Qwen2.5-7B-Instruct: its config.json only, through the "
                        "HF cache; HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE apply), a local model folder, or a "
                        "config.json")
    m = p.add_argument_group("model (give MODEL, --config, or the plain numbers; the plain-number flags "
                             "--model-params ... --model-bits apply without a config only)")
    m.add_argument("--config", metavar="PATH", help="HF config.json (or a folder holding one)")
    m.add_argument("--revision", default=None, help="hub branch, tag or commit of MODEL [the default branch]")
    m.add_argument("--head", default=None, help="the task head trained (with a config): causal_lm | masked_lm | "
                   "sequence_classification | token_classification | question_answering | image_classification "
                   "(ViT, DeiT: over the patch tokens, --seq-length not used) [the config's architectures]")
    m.add_argument("--model-params", type=float, help="total parameters, e.g. 7e9")
    m.add_argument("--hidden-dim", type=int)
    m.add_argument("--num-layers", type=int)
    m.add_argument("--num-heads", type=int)
    m.add_argument("--num-kv-heads", type=int, help="KV heads (GQA); default: --num-heads")
    m.add_argument("--vocab-size", type=int, default=None, help="[32000]")
    m.add_argument("--intermediate-size", type=int)
    m.add_argument("--model-bits", type=float, default=None, help="storage bits of the weights (16, 8, 4) [16]")
    t = p.add_argument_group("training settings")
    t.add_argument("--batch-size", type=int, default=1, help="micro-batch (rows per forward) [1]")
    t.add_argument("--seq-length", type=int, default=512, help="tokens per row [512]; an encoder-decoder's "
                   "source tokens (the encoder's input_ids)")
    t.add_argument("--target-length", "--target-len", dest="target_length", type=int, default=None,
                   help="an encoder-decoder's (T5, BART) target tokens per row: the decoder's labels / "
                        "decoder_input_ids length [= --seq-length]; not for other models")
    t.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps [1]")
    t.add_argument("--method", default="lora", help="full | lora | qlora [lora]")
    t.add_argument("--lora-rank", type=int, default=None, help="LoRA rank r (lora / qlora) [8]")
    t.add_argument("--lora-dropout", type=float, default=None,
                   help="LoRA dropout probability (lora / qlora; PEFT LoraConfig.lora_dropout); above 0 each "
                        "LoRA'd linear also keeps its dropout's output and mask for the backward [0.0, PEFT's "
                        "default; 0.05 with --model-code litgpt, `litgpt finetune lora`'s default]")
    t.add_argument("--lora-targets", default=None,
                   help="comma list of module names, or all-linear (lora / qlora) [what PEFT picks for "
                        "LoraConfig(target_modules=None): its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_"
                        "MAPPING entry for the config's model_type (gpt2: c_attn, gpt_neox: query_key_value, "
                        "llama / mistral / qwen2: q_proj,v_proj); q_proj,v_proj with plain numbers or a "
                        "model_type PEFT has no entry for]")
    t.add_argument("--lora-layers", type=int, default=None,
                   help="LoRA on the last N blocks only (mlx_lm's num_layers) [all]")
    t.add_argument("--optimizer", default="adamw",
                   help="adam | adamw | sgd (no momentum, as HF) | sgd-momentum | adafactor | adamw-8bit | "
                        "paged-adamw-8bit | paged-adamw-32bit (bitsandbytes paged AdamW: its large states "
                        "in CUDA unified memory); HF optim names too (paged_adamw_8bit, adamw_bnb_8bit, "
                        "...) [adamw]")
    t.add_argument("--dtype", default=None,
                   help="fp32 | bf16 | fp16: the dtype the weights are stored and computed in (pure "
                        "bf16: weights loaded in bf16, no autocast); with --mixed-precision, the "
                        "autocast dtype over fp32 weights [the config's torch_dtype; fp32 when it "
                        "has none; with plain numbers, --model-bits]")
    t.add_argument("--mixed-precision", action="store_true",
                   help="fp32 weights with autocast to --dtype (HF bf16=True / fp16=True on an fp32 "
                        "model); --dtype defaults to bf16 then")
    t.add_argument("--grad-checkpoint", action="store_true", help="activation (gradient) checkpointing")
    t.add_argument("--no-heap-trim", action="store_true",
                   help="cpu: a plain run that does not return glibc's free heap at every optimizer step's "
                        "end (nor fix glibc's mmap threshold for a bf16 MoE model) [off: the run as "
                        "memguard's guard runs it (GuardOptions.trim_heap)]")
    t.add_argument("--glibc", default=None, metavar="VERSION",
                   help="cpu: the glibc release of the machine that trains ('2.39'; 'none': not glibc or "
                        "unknown); from 2.39 on glibc's heap keeps less of a step's freed tensors and the "
                        "heap-slack factors fitted on 2.41 apply [this machine's glibc]")
    t.add_argument("--attn", default="sdpa", help="eager | sdpa | flash [sdpa]")
    t.add_argument("--double-quant", action="store_true",
                   help="QLoRA with double quantization (4.127 bits); not with --method full")
    t.add_argument("--bnb-version", default=None,
                   help="bitsandbytes version of a QLoRA run: before 0.43.2 each 4-bit linear keeps its "
                        "input for the backward [unknown: counted as kept]")
    t.add_argument("--image-tokens", type=int, default=None,
                   help="image tokens per row of a vision-language model (not a text-only config), on "
                        "top of --seq-length "
                        "[one image at the model family's default: the config's mm_tokens_per_image / "
                        "image_seq_len, or its vision patch grid; 256 for Qwen2-VL at 448 px]")
    t.add_argument("--framework", default="hf",
                   help="hf | lightning | mlx | torch (a plain PyTorch / accelerate loop) (its conventions apply) [hf]")
    t.add_argument("--model-code", default="transformers",
                   help="whose model code runs: transformers (its modules, LoRA by PEFT) | litgpt (LitGPT's own "
                        "GPT under `litgpt finetune lora`: LoRA / QLoRA on the fused qkv linear, --lora-targets "
                        "any of query,key,value [query,value: LitGPT's default], --lora-dropout [0.05, "
                        "LitGPT's default]; Phi, GPT-NeoX, Llama and Mistral configs) [transformers]")
    t.add_argument("--litgpt-version", default=None,
                   help="the LitGPT release (--model-code litgpt): from 0.5.0 on its QLoRA trains a "
                        "StableEmbedding whose gradient no optimizer clears [the current LitGPT]")
    t.add_argument("--device", default=None,
                   help="counter predicted: cpu (peak RSS, VmHWM) | cuda (peak device memory) | mlx "
                        "(mx.get_peak_memory) | mps (PyTorch on Apple Silicon, driver_allocated_memory; "
                        "not validated on a Mac) [the device this machine would train on: cuda when torch "
                        "sees a GPU, mlx for --framework mlx, mps on Apple Silicon, else cpu]")
    t.add_argument("--world-size", type=int, default=1,
                   help="data-parallel processes: the effective batch, and with --sharding the ranks the "
                        "model state is divided over [1]")
    t.add_argument("--sharding", default=None,
                   help="none | ddp | fsdp-full | fsdp-grad-op | fsdp-hybrid | fsdp-no-shard | zero1 | zero2 | "
                        "zero3: the estimate is then per rank; none: one process [none; ddp with "
                        "--world-size above 1 (torchrun's usual DDP), said on stderr]")
    t.add_argument("--offload", default="none",
                   help="none | optimizer (ZeRO offload_optimizer) | params (FSDP CPU offload, ZeRO-3 "
                        "offload_param) [none]")
    t.add_argument("--deepspeed", default=None, metavar="DS_CONFIG_JSON",
                   help="a DeepSpeed config file: the ZeRO stage (--sharding zero1-3; stage 0 as ddp), "
                        "offload_optimizer / offload_param (--offload) and the bucket sizes it gives as "
                        "numbers (\"auto\" ones follow --framework, missing ones DeepSpeed's defaults); "
                        "not with --sharding / --offload")
    t.add_argument("--shard-group-size", type=int, default=None,
                   help="ranks per shard group; only with --sharding fsdp-hybrid [--world-size]")
    b = p.add_argument_group("planning (optional)")
    b.add_argument("--budget-gib", type=float, help="plan against this budget (GiB); not with --available-gib")
    b.add_argument("--available-gib", type=float,
                   help="plan against this much available memory x --safety-ratio; not with --budget-gib")
    b.add_argument("--safety-ratio", type=float, default=None,
                   help="fraction of --available-gib used, in (0, 1] [0.8]")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memguard",
        description="Keep fine-tuning from dying of memory: estimate peak memory before the first "
                    "step, fit the settings to a budget, and guard the run.")
    p.add_argument("--version", action="version", version=f"memguard {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    e = sub.add_parser("estimate", help="estimate the peak memory of a training configuration",
                       description="Estimate the peak memory of a fine-tuning run, with a breakdown; "
                                   "with --budget-gib / --available-gib also plan the settings that fit.")
    _add_train_args(e)
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--trace", action="store_true",
                   help="also run one training step of the model's own code on fake tensors (needs a model "
                        "config: MODEL or --config, and the [hf] extra; seconds) and compare its live tensor "
                        "bytes with the estimate; one process: not with --sharding or --world-size above 1")

    pr = sub.add_parser("probe", help="what memory this machine offers (container-aware)")
    pr.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mlx | mps [auto]")
    pr.add_argument("--json", action="store_true", help="print one JSON object")

    d = sub.add_parser("demo", help="a guarded real LoRA fine-tune (SmolLM2-135M shapes, random weights)",
                       description="Runs a real LoRA fine-tune of SmolLM2-135M's architecture (random "
                                   "weights, no hub) on a text shipped with memguard, under a memory budget "
                                   "the requested batch does not fit: HF Trainer + MemGuardCallback (hf), "
                                   "Lightning + MemGuardCallback (lightning) or memguard_mlx.train (mlx).")
    d.add_argument("--framework", default="hf", choices=["hf", "lightning", "mlx"],
                   help="which trainer: hf (transformers Trainer) | lightning | mlx (mlx_lm) [hf]")
    d.add_argument("--steps", type=int, default=4, help="optimizer steps [4]")
    d.add_argument("--batch-size", type=int, default=8, help="requested micro-batch [8]")
    d.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation [1]")
    d.add_argument("--seq-length", type=int, default=64, help="tokens per row [64]")
    d.add_argument("--budget-gib", type=float, default=None,
                   help="memory budget; default: one that the requested batch does not fit")
    d.add_argument("--squeeze-at", type=int, default=2,
                   help="optimizer step at which the demo takes 15%% of the budget away, as a "
                        "co-tenant would, to show the runtime guard (0: never) [2]")
    d.add_argument("--output-dir", default=None, help="trainer output dir [a temp dir]")

    sub.add_parser("run", help="run a training command; after an out-of-memory kill, restart it with twice the "
                               "micro-batches from its latest checkpoint (HF, Lightning, mlx_lm; memguard run -- "
                               "python train.py ...)",
                   add_help=False)
    sub.add_parser("bench", help="run real training cases here and score the estimate against them "
                                 "(--quick: a 30-second subset; --submit: a markdown report)", add_help=False)
    sub.add_parser("calibration", help="the auto-calibration store: show | reset", add_help=False)
    sub.add_parser("report", help="draw a guarded run's event log (MEMGUARD_LOG_DIR): memory per step against "
                                  "the budget with the decisions (memguard report FILE.jsonl --png OUT.png)",
                   add_help=False)
    return p


def _model_spec(args):
    from .estimator.numbers import model_spec_from_numbers

    qbits = None
    if args.method.strip().lower() == "qlora":
        qbits = 4
    if args.model or args.config:
        given = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
        if given:
            raise ConfigError(FLAG_OF[given[0]], "no value with a config (MODEL / --config describes the model; "
                              "the plain-number flags apply to plain numbers only)", getattr(args, given[0]))
    if args.model:
        from .sources import looks_like_hub_id, resolve_model_config

        if args.config:
            raise ConfigError("--config", "not given together with MODEL (one model source)", args.config)
        local = os.path.exists(os.path.expanduser(args.model.strip())) or not looks_like_hub_id(args.model.strip())
        if args.revision is not None and local:
            _note(args, f"--revision {args.revision} ignored: MODEL is a local path, not a hub id")
        args.config = resolve_model_config(args.model, revision=args.revision)
    elif args.config and args.revision is not None:
        _note(args, f"--revision {args.revision} ignored: --config is a local file (a revision applies to a "
                    "hub id given as MODEL)")
    if args.config:
        from .features import load

        # transformers builds the config class and counts on the meta device: memguard_hf's reader
        model_spec_from_hf_config = load("config.hf", "hf")
        return model_spec_from_hf_config(args.config, quantization_bits=qbits, double_quant=args.double_quant,
                                         head=getattr(args, "head", None))
    if getattr(args, "head", None) is not None:
        raise ConfigError("--head", "a model config (MODEL / --config): the head's shape is read from it", args.head)
    if args.trace:
        raise ConfigError("--trace", "a model config (MODEL: a hub id, model folder or config.json; or --config "
                          "PATH): the trace runs the model's own code, which plain numbers do not give", None)
    if all(getattr(args, f) is None for f in SHAPE_FLAGS):
        raise ConfigError("MODEL", "a hub id (Qwen/Qwen2.5-7B-Instruct), a model folder or a config.json "
                          "(or --config PATH, or the plain numbers --model-params --hidden-dim --num-layers "
                          "--num-heads)", None)
    missing = [f for f in ("model_params", "hidden_dim", "num_layers", "num_heads") if getattr(args, f) is None]
    if missing:
        raise ConfigError(FLAG_OF[missing[0]], "a value (or give MODEL / --config PATH)", None)
    for f, v in SHAPE_DEFAULTS.items():
        if getattr(args, f) is None:
            setattr(args, f, v)
    bits = 4 if qbits else args.model_bits
    return model_spec_from_numbers(
        model_params=int(args.model_params), hidden_dim=args.hidden_dim, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, model_bits=bits,
        vocab_size=args.vocab_size, intermediate_size=args.intermediate_size)


def resolve_dtype(dtype, mixed_precision: bool, model_spec) -> str:
    """The compute dtype of ``memguard estimate``: ``--dtype`` when given; with
    ``--mixed-precision`` bf16; else the dtype the model source declares (the config's
    ``torch_dtype``, fp32 when it has none; ``--model-bits`` 32 -> fp32, 16 -> bf16 for plain
    numbers). Without ``--mixed-precision`` this is also the weights' dtype
    (``memguard_core.estimator.trainable.weights_for_training``).

    Raises:
        ConfigError: ``--dtype fp32`` with ``--mixed-precision`` (autocast needs a half dtype).
    """
    if dtype is not None:
        d = str(dtype).strip().lower()
        if mixed_precision and d == "fp32":
            raise ConfigError("dtype", "bf16 or fp16 with --mixed-precision (the autocast dtype over "
                              "fp32 weights)", dtype)
        return d
    if mixed_precision:
        return "bf16"
    if model_spec.weight_dtype:
        return model_spec.weight_dtype
    if model_spec.source == "hf-config":
        return "fp32"  # no torch_dtype: transformers builds fp32
    return "fp32" if model_spec.dense_bits >= 32 else "bf16"


def default_device(framework: str = "hf", torch_cuda=None, *, nvidia_gpus: Optional[int] = None,
                   apple_silicon: Optional[bool] = None) -> str:
    """The counter ``memguard estimate`` predicts when ``--device`` is not given: the device this
    machine would train on. ``mlx`` for ``--framework mlx`` (mlx_lm has only MLX's counter);
    ``cuda`` when an NVIDIA GPU is visible to this process; ``mps`` on Apple Silicon (macOS on
    arm64: what HF ``Trainer`` and Lightning pick there; ``apple_silicon`` replaces the check:
    tests); else ``cpu``.

    Visible: ``torch.cuda.is_available()`` when memguard_torch is loaded (it registers with
    :mod:`memguard_core.frameworks`; ``torch_cuda``, an object with ``is_available()``, replaces it:
    tests); otherwise without importing torch (the analytic path stays framework-free):
    ``CUDA_VISIBLE_DEVICES`` not set to an empty list / -1, and NVML's device count (nvidia-ml-py,
    the ``[cuda]`` extra) or, without it, the GPUs the NVIDIA driver lists in
    ``/proc/driver/nvidia/gpus``; ``nvidia_gpus`` replaces that count (tests)."""
    if str(framework).strip().lower() == "mlx":
        return "mlx"
    if apple_silicon is None:
        import platform

        apple_silicon = sys.platform == "darwin" and platform.machine() == "arm64"
    if torch_cuda is not None:
        try:
            available: Optional[bool] = bool(torch_cuda.is_available())
        except Exception:
            available = False
    else:
        from . import frameworks

        available = frameworks.cuda_available()
    if available is not None:
        return "cuda" if available else "mps" if apple_silicon else "cpu"
    if apple_silicon:
        return "mps"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "cpu"
    if nvidia_gpus is None:
        nvidia_gpus = _nvidia_gpu_count()
    return "cuda" if nvidia_gpus > 0 else "cpu"


def _nvidia_gpu_count() -> int:
    """NVIDIA GPUs on this machine without torch: NVML if installed, else the driver's /proc list."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _train_spec(args, model_spec):
    """The TrainSpec of ``memguard estimate``'s flags, after the cross-flag checks; the choices made
    for the user (PEFT's LoRA targets, ``ddp`` for ``--world-size`` > 1) are said on stderr.

    Raises:
        ConfigError (naming the flag): LoRA flags with ``--method full``; ``--image-tokens`` on a
            text-only config; ``--shard-group-size`` without ``--sharding fsdp-hybrid``;
            ``--trace`` with a per-rank estimate; ``--safety-ratio`` outside (0, 1]; ``--deepspeed``
            with ``--sharding`` / ``--offload``, or a config it cannot read (naming the key);
            ``--budget-gib`` together with ``--available-gib``.
    """
    from .estimator.lora_targets import with_default_lora_targets
    from .estimator.specs import DEFAULT_LORA_TARGETS, TrainSpec

    full = str(args.method).strip().lower() == "full"
    if full:
        for flag, value in (("lora_rank", args.lora_rank), ("lora_targets", args.lora_targets),
                            ("lora_dropout", args.lora_dropout or None)):
            if value is not None:
                raise ConfigError(FLAG_OF[flag], "no value with --method full (it applies to lora / qlora)", value)
        if args.double_quant:
            raise ConfigError("--double-quant", "not set with --method full (it is QLoRA's 4-bit double "
                              "quantization)", True)
    if args.image_tokens and model_spec.source == "hf-config" and not model_spec.image_tokens:
        raise ConfigError("--image-tokens", f"no value for a text-only model ({model_spec.name}: model_type "
                          f"{model_spec.model_type!r} has no vision tower)", args.image_tokens)
    if getattr(args, "target_length", None) is not None and not model_spec.is_encoder_decoder:
        raise ConfigError("--target-length", f"no value for a model without a decoder stack ({model_spec.name}: "
                          f"model_type {model_spec.model_type!r}; it is an encoder-decoder's target tokens)",
                          args.target_length)
    ratio = 0.8 if args.safety_ratio is None else args.safety_ratio
    if not (math.isfinite(ratio) and 0 < ratio <= 1):
        raise ConfigError("--safety-ratio", "a fraction in (0, 1] of --available-gib", args.safety_ratio)
    if args.safety_ratio is not None and args.available_gib is None:
        _note(args, "--safety-ratio applies to --available-gib only; without it, it changes nothing")
    if args.budget_gib is not None and args.available_gib is not None:
        raise ConfigError("--budget-gib", "not given together with --available-gib (one budget: --budget-gib "
                          "as is, or --available-gib x --safety-ratio)", args.budget_gib)
    world = args.world_size
    sharding, offload, zero_buckets = args.sharding, args.offload, None
    if getattr(args, "deepspeed", None):
        from .deepspeed_config import zero_settings

        for flag, value, default in (("--sharding", args.sharding, None), ("--offload", args.offload, "none")):
            if value != default:
                raise ConfigError(flag, "not given together with --deepspeed (the config sets it)", value)
        ds = zero_settings(args.deepspeed)
        sharding, offload, zero_buckets = ds["sharding"], ds.get("offload", "none"), ds.get("zero_buckets")
    if sharding is None:
        sharding = "none"
        if isinstance(world, int) and world > 1 and str(args.framework).strip().lower() != "mlx":
            sharding = "ddp"
            _note(args, f"--world-size {world} without --sharding: estimating per rank of DDP (--sharding "
                        "ddp, torchrun's usual data parallelism); --sharding none for one process that holds "
                        "everything without DDP's buckets")
    if args.shard_group_size is not None and str(sharding).strip().lower() != "fsdp-hybrid":
        raise ConfigError("--shard-group-size", f"given only with --sharding fsdp-hybrid (ranks per shard "
                          f"group; --sharding is {sharding})", args.shard_group_size)
    if args.trace and (str(sharding).strip().lower() != "none" or (isinstance(world, int) and world > 1)):
        raise ConfigError("--trace", "no --sharding and --world-size 1: the trace runs one process's step, "
                          "which cannot be compared with a per-rank estimate", True)
    litgpt = str(getattr(args, "model_code", "transformers")).strip().lower() == "litgpt"
    if getattr(args, "litgpt_version", None) is not None and not litgpt:
        raise ConfigError("--litgpt-version", "given only with --model-code litgpt", args.litgpt_version)
    if args.trace and litgpt:
        raise ConfigError("--trace", "not with --model-code litgpt: the trace runs transformers' modules, not "
                          "LitGPT's", True)
    lora_dropout = args.lora_dropout
    if lora_dropout is None:   # each model code's own default: PEFT's LoraConfig 0.0, LitGPT's finetune/lora.py
        from .estimator.litgpt import DEFAULT_LORA_DROPOUT

        lora_dropout = DEFAULT_LORA_DROPOUT if litgpt and not full else 0.0
    targets = DEFAULT_LORA_TARGETS
    if args.lora_targets is not None:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    dtype = resolve_dtype(args.dtype, args.mixed_precision, model_spec)
    ts = TrainSpec(batch_size=args.batch_size, seq_length=args.seq_length, grad_accum=args.grad_accum,
                     target_length=getattr(args, "target_length", None), method=args.method, lora_rank=8 if args.lora_rank is None else args.lora_rank,
                     lora_targets=targets, lora_dropout=lora_dropout,
                     lora_layers=args.lora_layers, optimizer=args.optimizer, dtype=dtype,
                     mixed_precision=args.mixed_precision, grad_checkpoint=args.grad_checkpoint,
                     attn_impl=args.attn, framework=args.framework,
                     device=args.device or default_device(args.framework),
                     image_tokens=model_spec.image_tokens if args.image_tokens is None else args.image_tokens,
                     world_size=args.world_size, sharding=sharding,
                     offload=offload, shard_group_size=args.shard_group_size, zero_buckets=zero_buckets,
                     bnb_version=getattr(args, "bnb_version", None),
                     heap_trim=not getattr(args, "no_heap_trim", False),
                     glibc=_glibc_arg(args, args.device or default_device(args.framework)),
                     model_code=getattr(args, "model_code", "transformers"),
                     litgpt_version=getattr(args, "litgpt_version", None))
    if ts.method != "full" and args.lora_dropout is None and litgpt:
        _note(args, f"--lora-dropout not given: {lora_dropout:g} (LitGPT's finetune/lora.py default)")
    if ts.method != "full" and args.lora_targets is None and litgpt:
        _note(args, "--lora-targets not given: query,value (LitGPT's finetune/lora.py default)")
    elif ts.method != "full" and args.lora_targets is None:
        resolved = with_default_lora_targets(model_spec, ts)
        names = ",".join(resolved.lora_targets)
        if resolved is not ts:
            why = f"PEFT's default for model_type {model_spec.model_type!r}"
        elif model_spec.source == "numbers":
            why = "the default with plain numbers"
        else:
            why = f"PEFT has no default for model_type {model_spec.model_type!r}"
        _note(args, f"--lora-targets not given: {names} ({why})")
        ts = resolved
    return ts


def cmd_estimate(args) -> int:
    from .estimator.estimate import estimate
    from .estimator.trainable import check_train_spec
    from .plan import budget_from_available, plan

    ms = _model_spec(args)
    ts = _train_spec(args, ms)
    # settings the model cannot take are refused before the block census builds it (with PEFT's
    # adapters: minutes for an impossible rank); the warnings are logged once, by the estimate
    check_train_spec(ms, ts, log=False)
    if args.config and ts.model_code != "litgpt":
        from .features import load

        # the kinds of block the config builds; those the rules do not model traced on fake tensors
        ms = load("blocks.hf", "hf")(args.config, ms, ts)
    est = estimate(ms, ts)
    trace = None
    if args.trace and (ms.is_encoder_decoder or ms.patch_size):
        raise ConfigError("--trace", "a decoder-only or encoder-only text model: the trace builds a causal-LM step, "
                          "not an encoder-decoder's or an image classifier's", ms.model_type)
    if args.trace:  # torch / transformers / peft are imported only here
        from .features import load

        tracing = load("trace", "hf")
        trace = tracing.trace_for_cli(args.config, ts)
    budget = None
    ratio = 0.8 if args.safety_ratio is None else args.safety_ratio
    if args.budget_gib is not None:
        if not math.isfinite(args.budget_gib) or args.budget_gib <= 0 or int(args.budget_gib * GiB) < 1:
            raise ConfigError("--budget-gib", "a number of GiB > 0 (at least one byte)", args.budget_gib)
        budget = int(args.budget_gib * GiB)
    elif args.available_gib is not None:
        if not math.isfinite(args.available_gib) or args.available_gib <= 0 or int(args.available_gib * GiB) < 1:
            raise ConfigError("--available-gib", "a number of GiB > 0 (at least one byte)", args.available_gib)
        budget = budget_from_available(int(args.available_gib * GiB), ratio)
    chosen = None
    not_fit = None
    if budget is not None:
        try:
            chosen = plan(ms, ts, budget)
        except DoesNotFitError as exc:
            not_fit = exc
    if args.json:
        out = est.to_dict()
        out["peak_bytes"] = int(est.peak_bytes)
        out["breakdown"] = {k: int(v) for k, v in est.breakdown.items()}
        if budget is not None:
            out["budget_bytes"] = budget
            out["fits"] = est.peak_bytes <= budget
            out["plan"] = chosen.to_dict() if chosen else None
            if not_fit is not None:
                out["does_not_fit"] = {"shortfall_bytes": not_fit.shortfall_bytes,
                                       "suggestions": not_fit.suggestions}
        if trace is not None:
            out["trace"] = tracing.trace_json(trace, est)
        print(json.dumps(out, indent=None, sort_keys=False))
    else:
        from .report import print_estimate, print_plan
        print_estimate(est, budget)
        if trace is not None:
            tracing.print_trace(trace, est)
        if chosen is not None and chosen.changes:
            print_plan(chosen)
        if not_fit is not None:
            print(str(not_fit))
    return 3 if not_fit is not None else 0


def cmd_probe(args) -> int:
    from .probes import probe, total_limit

    snap = probe(args.device)
    if args.json:
        d = {k: getattr(snap, k) for k in ("device", "total_bytes", "available_bytes", "process_bytes",
                                           "process_peak_bytes", "pressure", "limit_bytes",
                                           "limit_source", "source")}
        for k in ("address_limit_bytes", "address_limit_source", "address_headroom_bytes", "pressure_kind"):
            d[k] = getattr(snap, k)
        # the limit that set total_bytes: the virtual-memory rlimit, the container's, or none (host)
        d["total_limit_bytes"], d["total_limit_source"] = total_limit(snap)
        d["used_fraction"] = round(snap.used_fraction, 4)
        print(json.dumps(d))
    else:
        from .report import print_probe
        print_probe(snap)
    return 0


_DEMO_EXTRAS = {"hf": "hf", "lightning": "lightning", "mlx": "mlx"}


def cmd_demo(args) -> int:
    from .features import FeatureUnavailable, load

    for name in ("steps", "batch_size", "grad_accum", "seq_length"):
        if getattr(args, name) < 1:
            raise ConfigError("--" + name.replace("_", "-"), "an integer >= 1", getattr(args, name))
    try:
        run_demo = load(f"demo.{args.framework}", _DEMO_EXTRAS[args.framework])
    except FeatureUnavailable as exc:
        print(f"memguard demo --framework {args.framework}: {exc}", file=sys.stderr)
        return 2
    return run_demo(args)


def main(argv: Optional[List[str]] = None) -> int:
    """``memguard`` entry point; returns the exit status. A reader that closes stdout early
    (``memguard estimate ... --json | head -c 200``) ends it quietly with 141 (128 + SIGPIPE, what
    a shell reports for a CLI killed by the closed pipe), without a traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        try:  # the interpreter's final flush of stdout would fail again: point it at /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141


def _main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # the supervisor parses its own arguments (everything after -- is the command)
        from .supervisor import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["bench"]:  # the bench parses its own arguments; it lives above the adapters
        from .features import FeatureUnavailable, load

        try:
            bench_main = load("bench", "hf")
        except FeatureUnavailable as exc:
            print(f"memguard bench: {exc}", file=sys.stderr)
            return 2
        return bench_main(argv[1:])
    if argv[:1] == ["report"]:  # memguard report FILE.jsonl [--png OUT] [--html OUT]
        from .timeline import report_main

        return report_main(argv[1:])
    if argv[:1] == ["calibration"]:  # memguard calibration show [--json] | reset
        from .calibration import main as calibration_main

        return calibration_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(name)s: %(message)s",
                        handlers=[RichHandler(show_path=False, show_time=False, rich_tracebacks=False,
                                              console=Console(stderr=True))])  # stdout: tables / --json
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"estimate": cmd_estimate, "probe": cmd_probe, "demo": cmd_demo}[args.command]
    try:
        return handler(args)
    except ConfigError as exc:
        flag = FLAG_OF.get(exc.field, exc.field)
        print(f"memguard {args.command}: error: invalid {flag}: expected {exc.expected}, got {exc.got!r}",
              file=sys.stderr)
        return 2
    except DoesNotFitError as exc:
        print(f"memguard {args.command}: {exc}", file=sys.stderr)
        return 3
    except MemGuardError as exc:
        print(f"memguard {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
