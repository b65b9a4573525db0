"""Case heap probe: where a full-depth bench case's CPU peak goes, live tensors or glibc's free heap.

    python bench/case_heap_probe.py hf-fd-bert-base-12l-lora-r16-b8-s128-fp32-query+value-3steps
    python bench/case_heap_probe.py CASE --mmap-threshold 1048576      # glibc's threshold fixed
    python bench/case_heap_probe.py CASE --set attention_probs_dropout_prob=0   # a config field changed

One HF ``Trainer`` run of a case recorded in ``bench/results/full_depth_cpu.json``, built as the
bench's HF child builds it (``memguard_bench.child_hf``: the head ``architectures`` names, PEFT LoRA
with the case's targets, random weights seeded with 0, the head's random targets seeded with 1,
``adamw_torch_fused``, glibc's free heap trimmed at every optimizer step's end as the guard does).
At the whole model's forward pre / post hooks (HF computes the loss inside the forward, so the post
hook is the estimate's ``loss`` moment), when the gradient reaches the loss (the backward's start),
and at the Trainer's optimizer and step callbacks it prints VmHWM (reset at each step's start),
VmRSS and glibc's ``mallinfo2`` (bytes in use, free inside the arenas, mmapped; all arenas). In use
+ mmapped is the live set (tensors and the interpreter's own heap); free is what the estimate's
``allocator_slack`` stands for. A 3 ms sampling thread adds the sample with the largest RSS per step.

``--libc DIR`` runs the probe under another glibc: DIR holds that glibc's ``ld-linux-x86-64.so.2``
and ``libc.so.6`` (e.g. a distribution's ``libc6`` package unpacked with ``dpkg-deb -x``); the
script starts itself again through that loader, the other libraries and the packages unchanged,
and prints the glibc version it ran with.

``--mmap-threshold N`` fixes glibc's mmap threshold at N bytes before the model is built
(``memguard_core.probes.pin_mmap_threshold``): tensors of at least N bytes are then mmapped and
leave no hole when freed. ``--set field=value`` changes a config field of the arch (a number, or text);
``--batch-size N`` the rows per micro-batch.
Linux / glibc only. Findings: docs/benchmarks.md, "Encoder blocks" (2026-11-28).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from heap_probe import Heap, Sampler, proc_status  # noqa: E402

MiB = 1 << 20


def _value(text: str, current=None):
    """A ``--set`` value: an int where the arch's current value is one (a block count), else a
    number where it reads as one, else the text (an activation's name)."""
    if isinstance(current, int) and not isinstance(current, bool):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", help="a case name of bench/results/full_depth_cpu.json")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps [2]")
    ap.add_argument("--mmap-threshold", type=int, default=0, help="fix glibc's mmap threshold at this many bytes")
    ap.add_argument("--libc", metavar="DIR", help="run under the glibc whose loader and libc.so.6 are in DIR")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config field of the arch (a number, or text)")
    ap.add_argument("--batch-size", type=int, default=0, help="rows per micro-batch instead of the case's")
    a = ap.parse_args(argv)
    if a.libc:
        return _under_libc(a.libc, sys.argv[1:] if argv is None else list(argv))
    print(f"glibc {os.confstr('CS_GNU_LIBC_VERSION').split()[-1]}")

    import torch
    from transformers import Trainer, TrainerCallback

    from memguard_bench import child_hf as C
    from memguard_core.probes import pin_mmap_threshold, trim_heap
    from memguard_core.probes.linux.peak import reset_peak

    if a.mmap_threshold and not pin_mmap_threshold(a.mmap_threshold):
        print("could not fix the mmap threshold", file=sys.stderr)
        return 2
    d = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "full_depth_cpu.json")))
    found = [c["case"] for c in d["cases"] if c["name"] == a.case]
    if not found:
        print(f"case: no case named {a.case!r} in full_depth_cpu.json", file=sys.stderr)
        return 2
    case = dict(json.loads(json.dumps(found[0])), steps=a.steps)
    if a.batch_size:
        case["train"]["batch_size"] = a.batch_size
    if a.set:
        over = dict(s.split("=", 1) for s in a.set)
        base = C.arch_of

        def arch_of(c):
            arch = base(c)
            return {**arch, **{k: _value(v, arch.get(k)) for k, v in over.items()}}
        C.arch_of = arch_of
    torch.manual_seed(0)
    kw = case["train"]
    model, config, _ = C._build_model(case, torch)
    ds = C._dataset(kw["batch_size"] * a.steps, kw["seq_length"], config.vocab_size, torch, C._head_kind(config),
                    int(getattr(config, "num_labels", 2)), int(kw.get("target_length") or 0))
    heap = Heap()
    sampler = Sampler(heap, 0.003)
    marks = []

    def mark(tag: str) -> None:
        st = proc_status(("VmRSS", "VmHWM"))
        marks.append((sampler.step, tag, st["VmHWM"], st["VmRSS"], heap.read() or (0, 0, 0, 0)))
        sampler.mark(tag)

    def post(m, i, o):
        mark("post_forward")
        loss = o["loss"] if hasattr(o, "keys") else o[0]
        loss.register_hook(lambda g: mark("bwd_start"))

    model.register_forward_pre_hook(lambda m, i: mark("pre_forward"))
    model.register_forward_hook(post)

    class Marks(TrainerCallback):
        def on_step_begin(self, *args, **kw):
            sampler.step += 1
            sampler.in_step = True
            reset_peak()
            mark("step_begin")

        def on_pre_optimizer_step(self, *args, **kw):
            mark("pre_opt")

        def on_step_end(self, *args, **kw):
            mark("step_end")
            sampler.in_step = False
            trim_heap()

    trainer = Trainer(model=model, args=C._training_args(kw, a.steps, "cpu"), train_dataset=ds, callbacks=[Marks()])
    t0 = time.time()
    sampler.start()
    try:
        trainer.train()
    finally:
        sampler.stop()
    print("| step | where | VmHWM MiB | RSS MiB | in use MiB | free MiB | mmapped MiB |\n|---|---|---|---|---|---|---|")
    for st, tag, hwm, rss, h in marks:
        print(f"| {st} | {tag} | {hwm / MiB:,.1f} | {rss / MiB:,.1f} | {h[0] / MiB:,.1f} | {h[1] / MiB:,.1f} | {h[2] / MiB:,.1f} |")
    for s in range(1, a.steps + 1):
        x = max((x for x in sampler.samples if x[0] == s), key=lambda x: x[3], default=None)
        if x and x[5] is not None:
            print(f"step {s}, largest RSS sample ({x[1]}): RSS {x[3] / MiB:,.1f}, in use {x[5] / MiB:,.1f}, "
                  f"free {x[6] / MiB:,.1f}, mmapped {x[7] / MiB:,.1f} MiB")
    print(f"{time.time() - t0:.0f} s")
    return 0


def _under_libc(libc_dir: str, argv: list) -> int:
    """Run this script again through the loader in ``libc_dir`` (``--libc`` dropped), with this
    interpreter's ``sys.path`` so the same packages load; returns its exit status."""
    import subprocess

    from memguard_bench.measure import LibcDirError, libc_loader

    try:
        loader = libc_loader(libc_dir)
    except LibcDirError as exc:
        print(exc, file=sys.stderr)
        return 2
    rest, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--libc":
            skip = True
        elif not x.startswith("--libc="):
            rest.append(x)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    cmd = [loader, "--library-path", libc_dir, os.path.realpath(sys.executable), os.path.abspath(__file__), *rest]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
