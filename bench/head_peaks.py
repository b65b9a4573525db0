"""Peaks of encoder task-head runs (sequence / token classification, question answering) beside
memguard's estimate of the same run: docs/benchmarks.md, "Task heads".

    python bench/head_peaks.py --model-type bert --head sequence_classification --batch-size 8 --seq-length 128
    python bench/head_peaks.py --all            # the table of docs/benchmarks.md, one child per case

Each case runs in a fresh interpreter (this file with ``--child``): the transformers config of
``--model-type`` at its defaults (full depth: BERT-base is 12 x 768), random weights seeded with 0,
built by the Auto class of the head (``AutoModelForSequenceClassification`` ...), fp32, SDPA
attention, full fine-tune with ``adamw_torch_fused`` under an HF ``Trainer``, 3 optimizer steps on
random token ids seeded with 1 and random labels, glibc's free heap returned at every step's end (what
the guard does on a CPU device, ``memguard_core.probes.trim_heap``). Measured: the process's VmHWM
over ``train()`` (Linux ``/proc/self/status``), the peak the estimate predicts for ``device="cpu"``.
The estimate reads the live model (``model_spec_from_module``) and the file-backed pages before
training as a guard's preflight does. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = [
    dict(model_type="bert", head="sequence_classification", batch_size=8, seq_length=128, num_labels=2),
    dict(model_type="bert", head="token_classification", batch_size=8, seq_length=128, num_labels=9),
    dict(model_type="bert", head="question_answering", batch_size=8, seq_length=128, num_labels=2),
    dict(model_type="roberta", head="sequence_classification", batch_size=8, seq_length=128, num_labels=2),
    dict(model_type="bert", head="masked_lm", batch_size=8, seq_length=128, num_labels=2),
    # a decoder classifier: SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json numbers)
    dict(model_type="llama", head="sequence_classification", batch_size=4, seq_length=256, num_labels=2,
         config=dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                     max_position_embeddings=8192, rope_theta=100000.0, pad_token_id=0)),
]
_AUTO = {"sequence_classification": "AutoModelForSequenceClassification",
         "token_classification": "AutoModelForTokenClassification",
         "question_answering": "AutoModelForQuestionAnswering",
         "masked_lm": "AutoModelForMaskedLM"}
GiB = float(1 << 30)


def _dataset(case: dict, n: int, vocab: int):
    import torch
    from torch.utils.data import Dataset

    g = torch.Generator().manual_seed(1)
    b, s, k = n, case["seq_length"], case["num_labels"]
    ids = torch.randint(5, vocab, (b, s), generator=g)
    head = case["head"]
    if head == "sequence_classification":
        extra = {"labels": torch.randint(0, k, (b,), generator=g)}
    elif head == "token_classification":
        extra = {"labels": torch.randint(0, k, (b, s), generator=g)}
    elif head == "question_answering":
        extra = {"start_positions": torch.randint(0, s, (b,), generator=g),
                 "end_positions": torch.randint(0, s, (b,), generator=g)}
    else:
        extra = {"labels": ids}

    class DS(Dataset):
        def __len__(self):
            return b

        def __getitem__(self, i):
            row = {"input_ids": ids[i], "attention_mask": torch.ones(s, dtype=torch.long)}
            row.update({k2: v[i] for k2, v in extra.items()})
            return row

    return DS()


def child(case: dict) -> dict:
    """One Trainer run of ``case`` in this process; the measurement and the estimate."""
    import torch
    import transformers
    from transformers import AutoConfig, Trainer, TrainerCallback, TrainingArguments

    from memguard_core.estimator.estimate import estimate
    from memguard_core.estimator.specs import TrainSpec
    from memguard_core.probes import trim_heap
    from memguard_core.stats import process_file_resident_bytes
    from memguard_bench.readings import peak_rss_bytes
    from memguard_torch.module_spec import model_spec_from_module

    class Trim(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trim_heap()

    torch.manual_seed(0)
    steps = 3
    cfg = AutoConfig.for_model(case["model_type"], num_labels=case["num_labels"], **case.get("config", {}))
    model = getattr(transformers, _AUTO[case["head"]]).from_config(cfg, attn_implementation="sdpa")
    ms = model_spec_from_module(model, name=f"{case['model_type']}-{case['head']}")
    args = TrainingArguments(output_dir="/tmp/memguard_head_peaks", per_device_train_batch_size=case["batch_size"],
                             max_steps=steps, learning_rate=1e-4, optim="adamw_torch_fused", use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
                             disable_tqdm=True, remove_unused_columns=False)
    ds = _dataset(case, case["batch_size"] * steps, cfg.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Trim()])
    resident_file = process_file_resident_bytes()
    t0 = time.time()
    trainer.train()
    peak = peak_rss_bytes()
    ts = TrainSpec(batch_size=case["batch_size"], seq_length=case["seq_length"], method="full", optimizer="adamw",
                   dtype="fp32", attn_impl="sdpa", device="cpu", resident_file_bytes=resident_file)
    est = estimate(ms, ts)
    return dict(case=case, peak_bytes=peak, estimate_bytes=est.peak_bytes, breakdown=est.breakdown,
                phase=est.phase, head=repr(getattr(ms, "head", None)), train_seconds=round(time.time() - t0, 1),
                resident_file_bytes=resident_file, torch=torch.__version__, transformers=transformers.__version__,
                date=time.strftime("%Y-%m-%d", time.gmtime()))


def run(case: dict) -> dict:
    """``case`` in a fresh interpreter (glibc's defaults: no ``MALLOC_MMAP_THRESHOLD_``)."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)],
                       capture_output=True, text=True, env=env, cwd=root)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"case": case, "error": (p.stderr or p.stdout)[-1500:]}
    return json.loads(lines[-1][7:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--all", action="store_true", help="every case of CASES")
    ap.add_argument("--model-type", default="bert")
    ap.add_argument("--head", default="sequence_classification", choices=sorted(_AUTO))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--num-labels", type=int, default=2)
    a = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("Linux only (VmHWM)", file=sys.stderr)
        return 2
    if a.child:
        print("RESULT " + json.dumps(child(json.loads(a.child)), default=str))
        return 0
    cases = CASES if a.all else [dict(model_type=a.model_type, head=a.head, batch_size=a.batch_size,
                                      seq_length=a.seq_length, num_labels=a.num_labels)]
    for case in cases:
        r = run(case)
        if "error" in r:
            print(json.dumps(r))
            continue
        err = 100.0 * (r["estimate_bytes"] - r["peak_bytes"]) / r["peak_bytes"]
        print(f"{case['model_type']:8s} {case['head']:24s} {case['batch_size']} x {case['seq_length']}  "
              f"peak {r['peak_bytes'] / GiB:.2f} GiB  estimate {r['estimate_bytes'] / GiB:.2f} GiB  {err:+.1f} %  "
              f"({r['date']})", flush=True)
        print("  " + json.dumps({k: r[k] for k in ("breakdown", "phase", "head", "train_seconds")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
