"""Heap probe: where in a training step the CPU peak (VmHWM) is reached, and what glibc's heap holds
there, beside memguard's estimate of the same run.

    python bench/heap_probe.py --arch mixtral-4l --method lora --batch-size 2 --seq-length 128 --dtype bf16
    python bench/heap_probe.py --arch smollm2-135m --layers 2 --method full --seq-length 128 --saved-tensors

One HF ``Trainer`` run on CPU in this process, as ``memguard bench`` runs its HF cases: an
architecture of ``memguard_bench.cases.HF_ARCHS`` / ``HF_FULL_DEPTH_ARCHS`` built from its config
numbers (``--layers`` cuts or extends the blocks), random weights seeded with 0, weights in
``--dtype`` (pure bf16, no autocast), SDPA attention, full fine-tune or PEFT LoRA (alpha = 2 x rank,
no dropout), ``adamw_torch_fused``, random token ids seeded with 1 (labels = inputs), and glibc's
free heap returned at every optimizer step's end (``memguard_core.probes.trim_heap``, what the guard
does on a CPU device) and, for a mixture-of-experts model in bf16, glibc's mmap threshold fixed at
train start (``memguard_core.step_heap.fix_mmap_threshold``, as the guard does); ``--no-trim`` for a
plain run.

What it measures, per optimizer step: the step's VmHWM (reset with ``/proc/self/clear_refs`` at the
step's start), and samples of ``VmRSS`` / ``RssAnon`` (/proc/self/status) with glibc's
``mallinfo2()`` (``uordblks`` in use, ``fordblks`` free inside the arenas, ``hblkhd`` mmapped,
``arena``) taken every 5 ms by a thread and at the forward hooks of the model, of each block and of
each block's direct children (and when the gradient reaches each block's output, the start of its
backward). The sample with the largest RSS of a step says how much of the peak was live heap, free
heap or mmapped tensors: what tells the estimator's live terms from its heap-slack terms
(docs/estimator.md). RSS keeps the freed heap until the trim, so that sample is the first one at
the step's top, not necessarily the moment that built it; the sample with the most bytes in use +
mmapped places the live peak. A 5 ms thread can miss a peak shorter than that; the step's VmHWM
cannot, so the table shows both. The samples cost time (a /proc read and a walk of glibc's
free lists each), not memory worth counting.

Then memguard's estimate (``memguard_core.estimator.estimate.estimate``) of the same model (read from the
live module) and settings, with the file-backed pages read before training as a guard's preflight
reads them, its peak moment and breakdown, and its error against the largest step VmHWM.

``--saved-tensors``, after the run: a census of what one forward of the first micro-batch keeps
for the backward (``torch.autograd.graph.saved_tensors_hooks``), per block and by dtype, each
storage counted once and the parameters' storages left out, beside the estimate's activations term
(checkpointing off for the census: it counts what each block saves).

Linux only (/proc/self, glibc): elsewhere it says so and exits 2. ``mallinfo2`` needs glibc >=
2.33; with an older glibc the heap columns come from ``mallinfo`` (32-bit fields: they wrap at
4 GiB), without glibc they are left out. Keep runs small on a shared machine (``OMP_NUM_THREADS``=1
or 2); ``--json PATH`` keeps every sample.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from _common import markdown_table

MiB = 1 << 20
#: The sampling thread's period, seconds.
PERIOD_S = 0.005
#: Fields of a sample, in order (bytes, seconds since the run began). ``step``: n inside optimizer
#: step n, -n between step n's end and the next step, 0 before the first.
SAMPLE_FIELDS = ("step", "where", "t_s", "rss", "rss_anon", "heap_in_use", "heap_free", "heap_mmapped", "heap_arena")


# ---------------------------------------------------------------------------------------------
# the counters


def proc_status(keys=("VmRSS", "VmHWM", "RssAnon", "RssFile")) -> Dict[str, int]:
    """The ``keys`` of /proc/self/status, bytes (the kernel reports kB = KiB)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


class _Mallinfo2(ctypes.Structure):
    # glibc malloc.h (>= 2.33): ten size_t fields
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


class _Mallinfo(ctypes.Structure):
    # the older struct: int fields (read unsigned, so they wrap at 4 GiB rather than go negative at 2)
    _fields_ = [(n, ctypes.c_uint) for n, _ in _Mallinfo2._fields_]


class Heap:
    """glibc's heap counters of this process: ``read()`` returns (in use, free, mmapped, arena) in
    bytes, all arenas summed (``uordblks``, ``fordblks``, ``hblkhd``, ``arena`` of mallinfo(3)), or
    None where there is no glibc. ``source`` names the call used and ``note`` what it lacks."""

    def __init__(self) -> None:
        self.fn, self.source, self.note = None, "none", "no glibc: heap columns left out"
        try:
            libc = ctypes.CDLL(None)
        except OSError:
            return
        for name, struct, note in (("mallinfo2", _Mallinfo2, ""),
                                   ("mallinfo", _Mallinfo, "glibc < 2.33: mallinfo's 32-bit fields, which wrap "
                                                           "at 4 GiB")):
            fn = getattr(libc, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = struct, []
                self.fn, self.source, self.note = fn, name, note
                return

    def read(self) -> Optional[Tuple[int, int, int, int]]:
        if self.fn is None:
            return None
        m = self.fn()
        return int(m.uordblks), int(m.fordblks), int(m.hblkhd), int(m.arena)


class Sampler:
    """Samples (:data:`SAMPLE_FIELDS`) taken at hooks and every ``period`` seconds by a thread.
    ``where`` is the hook's tag; a thread sample is tagged ``thread@`` + the last hook's tag, the
    part of the step the training thread was in."""

    def __init__(self, heap: Heap, period: float = PERIOD_S) -> None:
        self.heap, self.period = heap, period
        self.samples: List[tuple] = []
        self.step = 0
        self.in_step = False
        self.last = "setup"
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heap-probe", daemon=True)

    def sample(self, where: str) -> None:
        st = proc_status(("VmRSS", "RssAnon"))
        h = self.heap.read() or (None, None, None, None)
        step = self.step if self.in_step else -self.step
        self.samples.append((step, where, round(time.perf_counter() - self.t0, 4), st.get("VmRSS"), st.get("RssAnon"))
                            + h)

    def mark(self, where: str) -> None:
        """A hook's sample: remembered as the place the training thread is in."""
        self.last = where
        self.sample(where)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample("thread@" + self.last)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# the model


def arch_config(arch: str, layers: Optional[int]):
    """The ``transformers`` config of ``arch`` (a key of ``HF_ARCHS`` / ``HF_FULL_DEPTH_ARCHS``),
    with ``layers`` blocks when given. Raises KeyError for an unknown arch."""
    from transformers import AutoConfig

    from memguard_bench import cases as B

    a = dict({**B.HF_ARCHS, **B.HF_FULL_DEPTH_ARCHS}[arch])
    mt = a.pop("model_type")
    if layers:
        a["n_layer" if "n_layer" in a else "num_hidden_layers"] = layers
    return AutoConfig.for_model(mt, **a)


def build_model(cfg, a):
    """The model of ``cfg`` in ``a.dtype`` (seeded with 0), PEFT LoRA applied for ``--method lora``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="sdpa")
    if a.method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = a.targets
        lc = LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                        target_modules="all-linear" if targets == ("all-linear",) else list(targets))
        model = get_peft_model(model, lc)
    return model


def decoder_blocks(model, n: int) -> List[Tuple[str, object]]:
    """(name, module) of the model's decoder blocks: the first ``ModuleList`` of ``n`` modules of
    one class (``model.layers``, ``transformer.h``, ``model.decoder.layers``, ...); [] if none."""
    import torch

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n and len({type(m) for m in mod}) == 1:
            return [(f"{name}.{i}", m) for i, m in enumerate(mod)]
    return []


def short(name: str) -> str:
    """A module name without PEFT's wrapper prefix (``base_model.model.``)."""
    return name.replace("base_model.model.", "", 1)


def add_hooks(model, blocks, sampler: Sampler) -> None:
    """Forward pre / post hooks that sample at the whole model (its post hook follows the loss: HF
    computes it inside the forward), each block, each block's direct children and the output
    embedding; and a gradient hook on each block's output (the start of that block's backward).
    Backward module hooks are not used: they wrap the modules' outputs in extra autograd nodes."""
    import torch

    def fwd(mod, tag):
        mod.register_forward_pre_hook(lambda m, i: sampler.mark("pre:" + tag))
        mod.register_forward_hook(lambda m, i, o: sampler.mark("post:" + tag))

    fwd(model, "model")
    head = model.get_output_embeddings()
    if head is not None:
        fwd(head, "head")
    for name, block in blocks:
        tag = short(name)
        fwd(block, tag)
        for cname, child in block.named_children():
            fwd(child, f"{tag}.{cname}")

        def grad_hook(m, i, o, tag=tag):
            t = o if isinstance(o, torch.Tensor) else (o[0] if isinstance(o, (tuple, list)) and o else None)
            if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
                t.register_hook(lambda g: sampler.mark("bwd:" + tag))
        block.register_forward_hook(grad_hook)


# ---------------------------------------------------------------------------------------------
# the run


def train(model, cfg, a, sampler: Sampler) -> Tuple[Optional[int], List[dict], Optional[int], float]:
    """``a.steps`` optimizer steps of HF ``Trainer`` on ``model``; returns (the file-backed resident
    bytes before training, one dict per step: ``vm_hwm`` bytes and ``seconds``, VmHWM before the
    first step, the trim's state)."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from memguard_core.probes import trim_heap
    from memguard_core.probes.linux.peak import reset_peak
    from memguard_core.stats import process_file_resident_bytes

    b, s, steps = a.batch_size, a.seq_length, a.steps
    ids = torch.randint(0, cfg.vocab_size, (b * steps, s), generator=torch.Generator().manual_seed(1))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i], "attention_mask": torch.ones(s, dtype=torch.long)}

    rows: List[dict] = []
    pre = [None]

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if pre[0] is None:
                pre[0] = proc_status(("VmHWM",))["VmHWM"]
            sampler.step += 1
            sampler.in_step = True
            self.reset_ok = reset_peak()
            sampler.mark("step_begin")
            self.t = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            sampler.mark("optimizer_begin")

        def on_optimizer_step(self, args, state, control, **kw):
            sampler.mark("optimizer_end")

        def on_step_end(self, args, state, control, **kw):
            sampler.mark("step_end")
            rows.append(dict(step=sampler.step, vm_hwm=proc_status(("VmHWM",))["VmHWM"],
                             seconds=round(time.perf_counter() - self.t, 2), hwm_reset=self.reset_ok))
            sampler.in_step = False
            sampler.last = "between steps"
            if not a.no_trim:  # what the guard does at every optimizer step's end on a CPU device
                trim_heap()

    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="mg-heap-probe-"), per_device_train_batch_size=b,
                             max_steps=steps, learning_rate=1e-4, optim="adamw_torch_fused", use_cpu=True,
                             gradient_checkpointing=a.grad_checkpoint, report_to=[], save_strategy="no",
                             logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
                             remove_unused_columns=False, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Probe()])
    resident_file = process_file_resident_bytes()  # where a guard's preflight reads it (on_train_begin)
    if not a.no_trim:  # and what the guard does there for a mixture-of-experts model in bf16 on a CPU
        from memguard_core.step_heap import fix_mmap_threshold
        from memguard_core.estimator.specs import TrainSpec
        from memguard_torch.module_spec import model_spec_from_module

        fix_mmap_threshold(model_spec_from_module(model), TrainSpec(dtype=a.dtype, device="cpu"))
    t0 = time.perf_counter()
    sampler.start()
    try:
        trainer.train()
    finally:
        sampler.stop()
    return resident_file, rows, pre[0], time.perf_counter() - t0


def memguard_estimate(model, arch: str, a, resident_file: Optional[int], grad_checkpoint: Optional[bool] = None):
    """memguard's estimate (a ``MemoryEstimate``) of this run: the live model's spec and the run's
    settings (``heap_trim`` as the run; ``grad_checkpoint`` overrides the run's)."""
    from memguard_core.estimator.estimate import estimate
    from memguard_core.estimator.specs import TrainSpec
    from memguard_torch.module_spec import model_spec_from_module

    ms = model_spec_from_module(model, name=arch)
    kw = dict(batch_size=a.batch_size, seq_length=a.seq_length, method=a.method, lora_rank=a.lora_rank,
              optimizer="adamw", dtype=a.dtype,
              grad_checkpoint=a.grad_checkpoint if grad_checkpoint is None else grad_checkpoint,
              attn_impl="sdpa", framework="hf", device="cpu", resident_file_bytes=resident_file,
              heap_trim=not a.no_trim)
    if a.targets is not None:
        kw["lora_targets"] = a.targets
    return estimate(ms, TrainSpec(**kw))


def saved_tensor_census(model, ids, blocks) -> Dict[str, Dict[str, int]]:
    """What one forward of ``ids`` (labels = inputs) keeps for the backward, bytes per place and
    dtype: ``{block name | "outside the blocks": {dtype: bytes}}``. Each storage counted once, at
    the first block that saves it; storages of parameters (and views of them) and leaf tensors that
    require grad left out. The output is dropped without a backward."""
    import torch

    stack = ["outside the blocks"]
    handles = []
    for name, block in blocks:
        tag = short(name)
        handles.append(block.register_forward_pre_hook(lambda m, i, tag=tag: stack.append(tag)))
        # a forward hook's return value replaces the output: None
        handles.append(block.register_forward_hook(lambda m, i, o: (stack.pop(), None)[1]))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()
    per: Dict[str, Dict[str, int]] = {"outside the blocks": {}}
    for name, _ in blocks:
        per[short(name)] = {}

    def pack(t):
        try:
            key = t.untyped_storage().data_ptr()
            if key not in seen and key not in params and not (t.is_leaf and t.requires_grad):
                seen.add(key)
                d = str(t.dtype).replace("torch.", "")
                row = per.setdefault(stack[-1], {})
                row[d] = row.get(d, 0) + t.untyped_storage().nbytes()
        except Exception:  # a tensor without storage (nested / sparse): not counted
            pass
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)
        del out
    finally:
        for h in handles:
            h.remove()
    return per


# ---------------------------------------------------------------------------------------------
# output


def mib(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / MiB:,.0f}"


def step_table(rows: List[dict], samples: List[tuple], heap: bool) -> List[str]:
    """Markdown lines: one row per step, its VmHWM and its largest-RSS sample."""
    header = ["step", "VmHWM MiB", "max sampled RSS MiB", "at", "RssAnon MiB"]
    if heap:
        header += ["heap in use MiB", "heap free MiB", "mmapped MiB", "arena MiB", "max in use + mmapped MiB", "at"]
    header.append("s")
    out = []
    for r in rows:
        ss = [x for x in samples if x[0] == r["step"] and x[3] is not None]
        top = max(ss, key=lambda x: x[3]) if ss else (r["step"], "-", 0, None, None, None, None, None, None)
        r["peak_sample"] = dict(zip(SAMPLE_FIELDS, top))
        line = [str(r["step"]), mib(r["vm_hwm"]), mib(top[3]), f"`{top[1]}`", mib(top[4])]
        if heap:
            line += [mib(top[5]), mib(top[6]), mib(top[7]), mib(top[8])]
            # the live heap's peak: where the step's tensors were largest, which RSS (it keeps the
            # free heap until the trim) cannot place
            hs = [x for x in ss if x[5] is not None]
            live = max(hs, key=lambda x: x[5] + x[7]) if hs else None
            r["live_peak_sample"] = dict(zip(SAMPLE_FIELDS, live)) if live else None
            line += [mib(live[5] + live[7]), f"`{live[1]}`"] if live else ["-", "-"]
        line.append(f"{r['seconds']:.1f}")
        out.append(line)
    return markdown_table(header, out)


def census_table(per: Dict[str, Dict[str, int]]) -> List[str]:
    dtypes = sorted({d for row in per.values() for d in row}, key=lambda d: -sum(r.get(d, 0) for r in per.values()))
    rows = []
    for place, row in per.items():
        rows.append([place] + [f"{row.get(d, 0) / MiB:,.2f}" for d in dtypes] + [f"{sum(row.values()) / MiB:,.2f}"])
    blocks = [row for place, row in per.items() if place != "outside the blocks"]
    rows.append(["**blocks**"] + [f"{sum(r.get(d, 0) for r in blocks) / MiB:,.2f}" for d in dtypes]
                + [f"{sum(sum(r.values()) for r in blocks) / MiB:,.2f}"])
    return markdown_table(["saved by", *[f"{d} MiB" for d in dtypes], "total MiB"], rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--arch", required=True,
                    help="a key of memguard_bench.cases.HF_ARCHS or HF_FULL_DEPTH_ARCHS (e.g. mixtral-4l, tinyllama-2l)")
    ap.add_argument("--layers", type=int, default=0, help="decoder blocks [the arch's own]")
    ap.add_argument("--method", choices=("full", "lora"), default="lora", help="[lora]")
    ap.add_argument("--lora-rank", type=int, default=16, help="[16]")
    ap.add_argument("--lora-targets", default="",
                    help="comma list of module names, or all-linear [PEFT's default for the model type: "
                         "memguard_core.estimator.lora_targets.peft_default_lora_targets]")
    ap.add_argument("--batch-size", type=int, default=2, help="rows per micro-batch [2]")
    ap.add_argument("--seq-length", type=int, default=512, help="tokens per row [512]")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="weights and compute (pure, no autocast) [fp32]")
    ap.add_argument("--grad-checkpoint", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps [2]")
    ap.add_argument("--no-trim", action="store_true",
                    help="skip glibc's malloc_trim at every step's end (a plain run, not a guarded one); "
                         "the estimate then has heap_trim=False")
    ap.add_argument("--saved-tensors", action="store_true",
                    help="after the run, also print the saved-tensor census of one forward per block, by dtype")
    ap.add_argument("--json", metavar="PATH", help="write the steps, every sample, the estimate and the census here")
    a = ap.parse_args(argv)
    for k in ("layers", "lora_rank", "batch_size", "seq_length", "steps"):
        if getattr(a, k) < (0 if k == "layers" else 1):
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    t = tuple(x.strip() for x in a.lora_targets.split(",") if x.strip())
    a.targets = t or None
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("heap_probe.py needs Linux (/proc/self/status, /proc/self/clear_refs, glibc's mallinfo2); "
              f"this is {sys.platform}.", file=sys.stderr)
        return 2
    from memguard_bench import cases as B

    if a.arch not in B.HF_ARCHS and a.arch not in B.HF_FULL_DEPTH_ARCHS:
        print(f"unknown --arch {a.arch!r}; one of: " + ", ".join([*B.HF_ARCHS, *B.HF_FULL_DEPTH_ARCHS]),
              file=sys.stderr)
        return 2
    import torch
    import transformers

    heap = Heap()
    sampler = Sampler(heap)
    cfg = arch_config(a.arch, a.layers or None)
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer")
    if a.method == "lora" and a.targets is None:
        from memguard_core.estimator.lora_targets import peft_default_lora_targets

        # named here, so that PEFT and the estimate get the same list
        a.targets = peft_default_lora_targets(cfg.model_type)
        if not a.targets:
            print(f"PEFT has no default LoRA targets for {cfg.model_type}: give --lora-targets", file=sys.stderr)
            return 2
    model = build_model(cfg, a)
    blocks = decoder_blocks(model, n_layers)
    add_hooks(model, blocks, sampler)
    resident_file, rows, pre_hwm, seconds = train(model, cfg, a, sampler)

    what = (f"{a.arch}, {n_layers} blocks, {a.method}"
            + (f" r{a.lora_rank} {','.join(a.targets)}"
               if a.method == "lora" else "")
            + f", {a.dtype}, {a.batch_size} x {a.seq_length} tokens"
            + (", checkpointed" if a.grad_checkpoint else "")
            + f", {a.steps} steps, {'plain (no trim)' if a.no_trim else 'heap trimmed at each step end'}")
    print(f"\n## Heap probe: {what}\n")
    print(f"HF Trainer, torch {torch.__version__} ({torch.get_num_threads()} threads), transformers "
          f"{transformers.__version__}; {len(sampler.samples)} samples (every {PERIOD_S * 1000:.0f} ms and at "
          f"hooks), heap counters: {heap.source}{' (' + heap.note + ')' if heap.note else ''}. "
          f"VmHWM before the first step: {mib(pre_hwm)} MiB.\n")
    print("\n".join(step_table(rows, sampler.samples, heap.fn is not None)))
    if not all(r["hwm_reset"] for r in rows):
        print("\n/proc/self/clear_refs could not be written: VmHWM is the run's peak so far, not the step's.")

    est = memguard_estimate(model, a.arch, a, resident_file)
    measured = max(r["vm_hwm"] for r in rows)
    err = 100.0 * (est.peak_bytes - measured) / measured
    print(f"\n### memguard's estimate: {mib(est.peak_bytes)} MiB at the {est.phase} moment; "
          f"largest step VmHWM {mib(measured)} MiB: error {err:+.1f} %\n")
    print("\n".join(markdown_table(["term", "MiB"], [[k, f"{v / MiB:,.1f}"] for k, v in est.breakdown.items() if v])))
    print("\nmoments: " + ", ".join(f"{k} {mib(v)} MiB" for k, v in est.phases.items()))

    census = None
    if a.saved_tensors:
        if a.grad_checkpoint and hasattr(model, "gradient_checkpointing_disable"):
            model.gradient_checkpointing_disable()
        model.train()
        ids = torch.randint(0, cfg.vocab_size, (a.batch_size, a.seq_length), generator=torch.Generator().manual_seed(1))
        census = saved_tensor_census(model, ids, blocks)
        plain = est if not a.grad_checkpoint else memguard_estimate(model, a.arch, a, resident_file,
                                                                    grad_checkpoint=False)
        act = plain.phase_breakdowns.get("loss", {}).get("activations", 0)
        total = sum(sum(r.values()) for k, r in census.items() if k != "outside the blocks")
        print(f"\n### Saved tensors of one forward ({a.batch_size} x {a.seq_length}, checkpointing off; "
              f"parameters' storages left out)\n")
        print("\n".join(census_table(census)))
        print(f"\nblocks: {total / MiB:,.1f} MiB; the estimate's activations term at the loss moment "
              f"(no checkpointing): {act / MiB:,.1f} MiB")

    if a.json:
        out = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   machine=f"{platform.machine()} {os.cpu_count()} cores, Linux {platform.release()}",
                   torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads(),
                   args=dict({k: v for k, v in vars(a).items() if k != "targets"},
                             lora_targets=list(a.targets or ())), layers=n_layers,
                   heap_counters=heap.source, pre_train_vm_hwm=pre_hwm, resident_file_bytes=resident_file,
                   train_seconds=round(seconds, 1), steps=rows, estimate=est.to_dict(), error_pct=err,
                   saved_tensors=census, sample_fields=list(SAMPLE_FIELDS), samples=sampler.samples)
        with open(a.json, "w") as f:
            json.dump(out, f, default=str)
        print(f"\nwrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
