"""``memguard demo --framework mlx`` end to end (small settings): the planned split is applied, the
squeeze makes the runtime guard split further, and updates / LR schedule / rows per update are those
requested."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")


def test_mlx_demo_runs_and_keeps_the_effective_batch(tmp_path, capsys):
    from memguard_mlx.demo import run_demo

    args = argparse.Namespace(steps=4, batch_size=8, grad_accum=1, seq_length=32, budget_gib=None,
                              squeeze_at=2, output_dir=str(tmp_path))
    assert run_demo(args) == 0
    out = capsys.readouterr().out
    assert "effective batch kept" in out and "LR schedule followed" in out
    assert (tmp_path / "adapters.safetensors").exists()
