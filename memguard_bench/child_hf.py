"""The HF child of the bench: one ``Trainer`` run of a case on torch (CPU or CUDA) in a fresh
interpreter, measured by the counter the estimate predicts (VmHWM on the CPU, the CUDA context +
peak reserved bytes on a GPU), with the model facts recorded beside it. docs/benchmarks.md.
"""

from __future__ import annotations

import time
from typing import List

from .cases import arch_of
from .readings import json_safe, peak_rss_bytes

__all__ = ["run_hf_child"]


def _step_peaks_callback(read, reset):
    """A ``TrainerCallback`` that records the peak of the counter in each optimizer step: at
    ``on_step_begin`` it reads the peak since the last reset (the first read covers everything
    before the first step: model, optimizer setup, ``on_train_begin``) and resets it; at
    ``on_step_end`` it reads the step's peak and resets again (so the next read is the gap between
    steps: logging, scheduler). ``read`` returns bytes; ``reset`` returns False when the counter
    cannot be reset (then the per-step peaks are cumulative and ``resets_ok`` says so)."""
    from transformers import TrainerCallback

    class StepPeaks(TrainerCallback):
        def __init__(self):
            self.pre_train = None
            self.steps: List[int] = []
            self.gaps: List[int] = []
            self.seconds: List[float] = []
            self.resets_ok = True
            self._t = 0.0

        def _reset(self):
            self.resets_ok = bool(reset()) and self.resets_ok

        def on_step_begin(self, args, state, control, **kw):
            v = read()
            if self.pre_train is None:
                self.pre_train = v
            else:
                self.gaps.append(v)
            self._reset()
            self._t = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(read())
            self.seconds.append(round(time.time() - self._t, 2))
            self._reset()

    return StepPeaks()


def _trim_heap_callback():
    """A ``TrainerCallback`` doing what a guarded run does at every optimizer step's end on a CPU
    device (``GuardOptions.trim_heap``: ``probes.trim_heap``, glibc's ``malloc_trim(0)``), so the
    peaks measured are a guarded run's. It runs after the per-step peak callback has read the step."""
    from transformers import TrainerCallback

    from memguard_core.probes import trim_heap

    class TrimHeap(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trim_heap()

    return TrimHeap()


#: PEFT ``task_type`` per head kind (``peft.TaskType``): what a user's ``LoraConfig`` for that head names.
_PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "masked_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS",
               "token_classification": "TOKEN_CLS", "question_answering": "QUESTION_ANS",
               "seq2seq_lm": "SEQ_2_SEQ_LM", "image_classification": None}
#: What a ``LoraConfig`` for a head without a PEFT task type trains besides the adapters: PEFT's image
#: classification guide (``LoraConfig(..., modules_to_save=["classifier"])``) trains ViT's classifier.
_MODULES_TO_SAVE = {"image_classification": ["classifier"]}


def _head_kind(config) -> str:
    """The head the case trains: the first its arch's ``architectures`` names (an encoder's
    ``BertForSequenceClassification``), a causal LM when it names none; the seq2seq LM of an
    encoder-decoder (T5, BART: ``AutoModelForSeq2SeqLM``)."""
    from memguard_core.estimator.heads import head_kind_from_architectures

    return head_kind_from_architectures(getattr(config, "architectures", None), getattr(config, "model_type", None),
                                        bool(getattr(config, "is_encoder_decoder", False)))


def _build_model(case: dict, torch):
    """(model, config, CUDA context bytes): the case's architecture with random weights in the
    case's dtype, built by the Auto class of the head its ``architectures`` names
    (``heads.AUTO_CLASSES``; ``AutoModelForCausalLM`` when it names none), LoRA-wrapped by PEFT
    unless the method is full."""
    import transformers
    from transformers import AutoConfig

    from memguard_core.estimator.heads import AUTO_CLASSES

    kw = case["train"]
    arch = arch_of(case)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    half = kw["dtype"] in ("bf16", "fp16") and not kw["mixed_precision"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(kw["dtype"]) if half else torch.float32
    ctx = 0
    if case.get("device", "cpu") == "cuda":
        torch.zeros(1, device="cuda")
        free, total = torch.cuda.mem_get_info()
        ctx = (total - free) - torch.cuda.memory_reserved()  # context (assumes an otherwise idle GPU)
    kind = _head_kind(config)
    model = getattr(transformers, AUTO_CLASSES[kind]).from_config(config, dtype=dtype,
                                                                  attn_implementation=kw["attn_impl"])
    if kw["method"] != "full":
        from peft import LoraConfig, get_peft_model

        targets = kw["lora_targets"]
        lc = LoraConfig(r=kw["lora_rank"], lora_alpha=2 * kw["lora_rank"], lora_dropout=kw.get("lora_dropout", 0.0),
                        target_modules="all-linear" if targets == ["all-linear"] else targets,
                        task_type=_PEFT_TASKS[kind], modules_to_save=_MODULES_TO_SAVE.get(kind))
        model = get_peft_model(model, lc)
    return model, config, ctx


def _pixel_dataset(n: int, config, torch, num_labels: int):
    """``n`` rows of random fp32 ``pixel_values`` (``num_channels x image_size x image_size``, as an
    image processor returns them) with a random class each, the same every run."""
    from torch.utils.data import Dataset

    g = torch.Generator().manual_seed(1)
    side = int(config.image_size)
    pixels = torch.randn(n, int(getattr(config, "num_channels", 3)), side, side, generator=g)
    labels = torch.randint(0, num_labels, (n,), generator=g)

    class DS(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"pixel_values": pixels[i], "labels": labels[i]}

    return DS()


def _dataset(n: int, s: int, vocab_size: int, torch, kind: str = "causal_lm", num_labels: int = 2,
             target_length: int = 0, config=None):
    """``n`` rows of ``s`` random token ids, the same every run, with the targets of the head
    ``kind``: labels = inputs for an LM head, a random class per row (sequence classification) or
    per token (token classification), random start / end positions (question answering), random
    target ids of ``target_length`` (``s`` when 0) for a seq2seq LM (the model shifts them into its
    ``decoder_input_ids``); an image classifier's rows are random pixels (:func:`_pixel_dataset`,
    at ``config``'s image size)."""
    from torch.utils.data import Dataset

    if kind == "image_classification":
        return _pixel_dataset(n, config, torch, num_labels)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (n, s), generator=g)
    targets = {"sequence_classification": lambda: {"labels": torch.randint(0, num_labels, (n,), generator=g)},
               "token_classification": lambda: {"labels": torch.randint(0, num_labels, (n, s), generator=g)},
               "question_answering": lambda: {"start_positions": torch.randint(0, s, (n,), generator=g),
                                              "end_positions": torch.randint(0, s, (n,), generator=g)},
               "seq2seq_lm": lambda: {"labels": torch.randint(0, vocab_size, (n, target_length or s), generator=g)},
               }.get(kind, lambda: {"labels": ids})()

    class DS(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            row = {"input_ids": ids[i], "attention_mask": torch.ones(s, dtype=torch.long)}
            row.update({k: v[i] for k, v in targets.items()})
            return row

    return DS()


def _training_args(kw: dict, steps: int, device: str):
    from transformers import TrainingArguments

    optim = {"adamw": "adamw_torch_fused", "adam": "adamw_torch_fused", "sgd": "sgd",
             "adafactor": "adafactor"}[kw["optimizer"]]
    amp = kw["mixed_precision"]
    return TrainingArguments(
        output_dir="/tmp/memguard_bench_out", per_device_train_batch_size=kw["batch_size"],
        gradient_accumulation_steps=kw["grad_accum"], max_steps=steps, learning_rate=1e-4,
        optim=optim, bf16=amp and kw["dtype"] == "bf16", fp16=amp and kw["dtype"] == "fp16",
        use_cpu=device == "cpu", gradient_checkpointing=kw["grad_checkpoint"], report_to=[],
        save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False)


def _counter(device: str, ctx: int, torch):
    """(read, reset) of the peak the estimate predicts: the CUDA context + the caching allocator's
    peak reserved bytes on a GPU, the process's VmHWM on the CPU."""
    if device == "cuda":
        def read() -> int:
            return int(ctx + torch.cuda.max_memory_reserved())

        def reset() -> bool:
            torch.cuda.reset_peak_memory_stats()
            return True

        return read, reset
    from memguard_core.probes.linux.peak import reset_peak

    return peak_rss_bytes, reset_peak


def run_hf_child(case: dict) -> dict:
    """One HF ``Trainer`` run (``case["steps"]`` optimizer steps, default 2) on random token ids;
    returns the measurement (bytes, seconds). With ``case["per_step"]`` the peak of every step is
    recorded too (``step_peak_bytes``; ``peak_bytes`` stays the peak of the whole run: the largest of
    the pre-train, per-step, between-step and after-train readings)."""
    t0 = time.time()
    import dataclasses

    import torch
    from transformers import Trainer

    from memguard_hf.model_spec import live_model_spec, with_seq2seq_fields

    torch.manual_seed(0)
    kw = case["train"]
    device = case.get("device", "cpu")
    steps = int(case.get("steps", 2))
    model, config, ctx = _build_model(case, torch)
    train_ds = _dataset(kw["batch_size"] * kw["grad_accum"] * steps, kw["seq_length"],
                        int(getattr(config, "vocab_size", 1) or 1), torch, _head_kind(config),
                        int(getattr(config, "num_labels", 2)), int(kw.get("target_length") or 0), config)
    ms = with_seq2seq_fields(model, live_model_spec(model, train_ds, name=case["arch"]))
    spec = dataclasses.asdict(ms)
    args = _training_args(kw, steps, device)
    read, reset = _counter(device, ctx, torch)
    callbacks = [_step_peaks_callback(read, reset)] if case.get("per_step") else []
    cb = callbacks[0] if callbacks else None
    pinned = False
    if device == "cpu" and case.get("trim_heap", True):
        callbacks.append(_trim_heap_callback())
        from memguard_core.step_heap import fix_mmap_threshold
        from memguard_core.estimator.specs import TrainSpec

        pinned = fix_mmap_threshold(ms, TrainSpec(dtype=kw["dtype"], device="cpu"))  # as the guard at train start
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, callbacks=callbacks or None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # read where a guard's preflight reads it (on_train_begin): the mapped libraries' pages
    from memguard_core.stats import process_file_resident_bytes
    resident_file = process_file_resident_bytes() if device == "cpu" else None
    trainer.train()
    peak = read()
    rec = dict(peak_bytes=peak, counter=device, seconds=time.time() - t0, model_spec=spec,
               resident_file_bytes=resident_file, heap_trim=bool(device == "cpu" and case.get("trim_heap", True)),
               mmap_threshold_pinned=pinned,
               model_config=json_safe(getattr(model, "config", config).to_dict()))
    if cb is not None:
        readings = [cb.pre_train or 0] + cb.steps + cb.gaps + [peak]
        rec.update(peak_bytes=max(readings), step_peak_bytes=cb.steps, pre_train_peak_bytes=cb.pre_train,
                   between_step_peak_bytes=cb.gaps, after_train_peak_bytes=peak, step_seconds=cb.seconds)
        rec["step_peak_resets_ok"] = cb.resets_ok
    return rec
