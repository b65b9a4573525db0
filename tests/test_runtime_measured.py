"""Issue 34 item 2: in a guarded run the runtime overhead is the process's own figure (its RSS at
train start less the model's resident tensors), so the estimate no longer depends on which
packages are installed; the CLI keeps the modelled figure, and both say which was used."""

import sys

import pytest

torch = pytest.importorskip("torch")

from memguard_core.estimator import runtime  # noqa: E402
from memguard_core.estimator.runtime import (RUNTIME_OVERHEAD_BYTES, cpu_runtime_growth_bytes,  # noqa: E402
                                             runtime_overhead_bytes, runtime_source)
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.preflight import plan_in_place  # noqa: E402
from memguard_core.probes.linux.smaps import parse_smaps, resident_bytes_in  # noqa: E402

MiB = 2**20
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

SMAPS = """\
00400000-00500000 r-xp 00000000 08:01 123 /usr/bin/python3
Size:               1024 kB
Rss:                 512 kB
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
Rss:                1024 kB
Anonymous:          1024 kB
7f0000400000-7f0000800000 r--s 00000000 08:01 456 /data/model.safetensors
Size:               4096 kB
Rss:                4096 kB
"""


def test_smaps_mappings_and_ranges_capped_at_each_mappings_rss():
    maps = parse_smaps(SMAPS)
    assert maps == [(0x400000, 0x500000, 512 * 1024), (0x7F0000000000, 0x7F0000400000, 1024 * 1024),
                    (0x7F0000400000, 0x7F0000800000, 4096 * 1024)]
    # a 4 MiB storage in the anonymous mapping, of which 1 MiB is resident: 1 MiB
    assert resident_bytes_in([(0x7F0000000000, 4 * MiB)], text=SMAPS) == 1 * MiB
    # a range across two mappings counts its share of each
    assert resident_bytes_in([(0x7F0000200000, 4 * MiB)], text=SMAPS) == 1 * MiB + 2 * MiB
    # outside every mapping: nothing; empty ranges: nothing
    assert resident_bytes_in([(0x100, 4096), (0x7F0000000000, 0)], text=SMAPS) == 0


@linux
def test_resident_bytes_of_real_storages_written_and_untouched():
    import ctypes
    import mmap

    written = torch.ones(64 * MiB // 4)              # every page written
    st_w = written.untyped_storage()
    got_w = resident_bytes_in([(st_w.data_ptr(), st_w.nbytes())])
    assert 62 * MiB <= got_w <= 64 * MiB
    # an anonymous mapping of its own (not glibc's, which earlier tests in this process may have
    # tuned to reuse resident heap): untouched pages are not resident, written ones are
    region = mmap.mmap(-1, 256 * MiB)
    buf = (ctypes.c_char * (256 * MiB)).from_buffer(region)
    addr = ctypes.addressof(buf)
    assert resident_bytes_in([(addr, 256 * MiB)]) < 4 * MiB
    ctypes.memset(addr, 1, 96 * MiB)
    assert 94 * MiB <= resident_bytes_in([(addr, 256 * MiB)]) <= 98 * MiB
    del buf
    region.close()


@linux
def test_the_held_figure_takes_the_models_tensors_and_optimizer_state_out_of_the_rss():
    from memguard_core.probes.linux import proc
    from memguard_torch.train_reading import runtime_held_bytes

    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))   # 64 MiB fp32
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2048)).sum().backward()
    opt.step()                                          # gradients + two moments: 3 x 64 MiB more
    rss = proc.read_status(keys=frozenset(("VmRSS",)))["VmRSS"]
    held = runtime_held_bytes(model, [opt])
    assert held is not None
    taken = rss - held
    assert 4 * 62 * MiB <= taken <= 4 * 66 * MiB, taken / MiB   # weights, gradients, exp_avg, exp_avg_sq
    assert runtime_held_bytes(model) > held                      # without the optimizer: its moments stay in


def test_a_measured_runtime_replaces_every_modelled_term(monkeypatch):
    held = 400 * MiB
    for installed in (True, False):   # the figure a process measures does not depend on what is installed
        monkeypatch.setattr(runtime, "_DATASETS_INSTALLED", installed)
        for rf in (None, 91 * MiB, 300 * MiB):
            ts = TrainSpec(device="cpu", framework="hf", runtime_held_bytes=held, resident_file_bytes=rf)
            assert runtime_overhead_bytes(ts) == held + cpu_runtime_growth_bytes()
    assert cpu_runtime_growth_bytes() == RUNTIME_OVERHEAD_BYTES["cpu"] - runtime.CPU_RUNTIME_AT_START_BYTES > 0
    # the CLI's estimate (nothing measured) keeps the modelled figure, and says so
    monkeypatch.setattr(runtime, "_DATASETS_INSTALLED", True)
    modelled = TrainSpec(device="cpu", framework="hf")
    assert runtime_overhead_bytes(modelled) > RUNTIME_OVERHEAD_BYTES["cpu"]
    assert "modelled" in runtime_source(modelled) and "datasets" in runtime_source(modelled)
    line = runtime_source(TrainSpec(device="cpu", runtime_held_bytes=held))
    assert "measured in this process" in line and "400 MiB held" in line
    # the CUDA context grows during the first steps: modelled there, and said
    assert "modelled" in runtime_source(TrainSpec(device="cuda"))
    with pytest.raises(ConfigError, match="runtime_held_bytes"):
        TrainSpec(runtime_held_bytes=-1)


@linux
def test_a_guarded_preflight_plans_with_the_process_figure_and_counts_no_surplus_twice():
    from memguard_torch.module_spec import model_spec_from_module
    from memguard_torch.specs import train_spec
    from memguard_core.preflight import resident_bytes_for

    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))
    opt = torch.optim.AdamW(model.parameters())
    batch = {"input_ids": torch.randint(0, 512, (2, 64))}
    ms = model_spec_from_module(model)
    ts = train_spec(model, opt, batch, ms, device="cpu")
    assert ts.runtime_held_bytes is not None and ts.runtime_held_bytes > 100 * MiB
    ballast = b"\x01" * (256 * MiB)   # data the process holds: in the measured figure, not added again
    ts2 = train_spec(model, opt, batch, ms, device="cpu")
    assert ts2.runtime_held_bytes - ts.runtime_held_bytes >= 250 * MiB
    pf = plan_in_place(ms, ts2, 64 * 2**30, resident_bytes=resident_bytes_for(ts2))
    del ballast
    assert pf.resident_extra_bytes == 0
    assert pf.estimate.breakdown["runtime_overhead"] == ts2.runtime_held_bytes + cpu_runtime_growth_bytes()
    assert any("measured in this process" in line for line in pf.report_lines())
