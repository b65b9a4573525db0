"""bench/freed_census.py: its saved bytes agree with memguard_torch.saved_census on the same blocks,
and what a block frees grows with the tokens (the matrix's tiny Llama, real CPU tensors)."""

import pytest

pytest.importorskip("peft")

from memguard_testing.bench_scripts import load_bench_script  # noqa: E402

F = load_bench_script("freed_census")


def _saved_by_the_estimators_census(rows, seq):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from memguard_bench.cases import HF_ARCHS
    from memguard_torch.saved_census import saved_bytes_per_block

    arch = dict(HF_ARCHS["tiny"])
    cfg = AutoConfig.for_model(arch.pop("model_type"), **arch)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model.train()
    blocks = list(model.base_model.model.model.layers)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq))
    return saved_bytes_per_block(lambda: model(input_ids=ids), blocks, exclude=list(model.parameters()))


def test_saved_bytes_match_the_estimators_census_and_frees_grow_with_tokens():
    small = F.census("tiny", 2, 64, ["q_proj", "v_proj"])
    (kind, row), = small.items()
    assert row["blocks"] == 2
    assert row["saved"] == sum(_saved_by_the_estimators_census(2, 64)) / 2
    assert row["freed_heap"] > 0 and row["freed_mmap"] == 0  # nothing of this size reaches 32 MiB
    big = F.census("tiny", 4, 64, ["q_proj", "v_proj"])[kind]
    assert big["saved"] == sum(_saved_by_the_estimators_census(4, 64)) / 2
    assert big["saved"] > row["saved"]
    assert big["freed_heap"] > 1.5 * row["freed_heap"]


@pytest.mark.parametrize("key", ["t5-base-12l", "vit-base-16-224-12l", "no-such-arch"])
def test_models_it_does_not_build_are_refused_in_one_line(key):
    with pytest.raises(SystemExit, match="freed_census"):
        F.census(key, 1, 64, ["q", "v"])

