"""Tiny text data for TRL's trainers in the tests: a word-level tokenizer built in memory (no hub
here; ids below the tiny Llama's vocabulary of 96), plain text rows and preference pairs whose
completions have different lengths."""

from __future__ import annotations

from typing import Dict, List

import torch

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(90)]


def word_tokenizer():
    """A ``PreTrainedTokenizerFast`` over :data:`WORDS` (whitespace split), pad 0, eos 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _words(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 90, (n,), generator=g))


def text_rows(n: int, seed: int = 3) -> Dict[str, List[str]]:
    """``{"text": [...]}``: ``n`` rows of 6..23 words."""
    g = torch.Generator().manual_seed(seed)
    return {"text": [_words(g, 6, 24) for _ in range(n)]}


def preference_rows(n: int, *, prompt: bool, seed: int = 4) -> Dict[str, List[str]]:
    """``n`` preference pairs: ``chosen`` / ``rejected`` of 2..9 words (and a ``prompt`` of 2..5)."""
    g = torch.Generator().manual_seed(seed)
    out: Dict[str, List[str]] = {"chosen": [], "rejected": []}
    if prompt:
        out["prompt"] = []
    for _ in range(n):
        if prompt:
            out["prompt"].append(_words(g, 2, 6))
        out["chosen"].append(_words(g, 2, 10))
        out["rejected"].append(_words(g, 2, 10))
    return out
