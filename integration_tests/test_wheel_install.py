"""The base install as a new user gets it (#34): the wheel built from this checkout, installed into a
clean virtualenv outside the repository with its base dependencies only (no torch, transformers or
mlx), then the CLI and the adapters run from another folder. Everything a base install cannot do
must say, in one line, which extra to install; what it can do (plain-number estimates) must work.
Needs the package registry for the base dependencies, as ``make install`` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, cwd, timeout=600):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    build = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                  str(tmp / "dist"), REPO], cwd=str(tmp))
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = [f for f in os.listdir(tmp / "dist") if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(str(env_dir))
    py = str(env_dir / "bin" / "python")
    inst = _run([py, "-m", "pip", "install", "-q", str(tmp / "dist" / wheels[0])], cwd=str(tmp))
    if inst.returncode != 0 and "No matching distribution" in inst.stderr:
        pytest.skip("the base dependencies are not reachable from this machine's package registry")
    assert inst.returncode == 0, inst.stderr[-3000:]
    return tmp, env_dir


def test_base_install_has_no_framework(clean_venv):
    tmp, env_dir = clean_venv
    out = _run([str(env_dir / "bin" / "python"), "-c",
                "import importlib.util as u, memguard_core; print([m for m in ('torch', 'transformers', 'mlx') "
                "if u.find_spec(m)]); print(memguard_core.__file__)"], cwd=str(tmp))
    assert out.returncode == 0, out.stderr
    found, where = out.stdout.strip().splitlines()
    assert found == "[]"
    assert where.startswith(str(env_dir)), where  # the installed wheel, not the checkout


@pytest.mark.parametrize("adapter,extra", [("memguard_hf", "hf"), ("memguard_lightning", "lightning"),
                                           ("memguard_torch", "torch"), ("memguard_mlx", "mlx")])
def test_adapter_without_its_extra_is_one_line(clean_venv, adapter, extra):
    tmp, env_dir = clean_venv
    out = _run([str(env_dir / "bin" / "python"), "-c", f"import {adapter}"], cwd=str(tmp))
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert f'pip install "memguard-train[{extra}]"' in last, out.stderr[-2000:]


def test_cli_on_a_base_install(clean_venv):
    tmp, env_dir = clean_venv
    mg = str(env_dir / "bin" / "memguard")
    assert _run([mg, "--help"], cwd=str(tmp)).returncode == 0
    # plain numbers need no framework
    plain = _run([mg, "estimate", "--model-params", "7e9", "--hidden-dim", "4096", "--num-layers", "32",
                  "--num-heads", "32", "--device", "cpu", "--json"], cwd=str(tmp))
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert json.loads(plain.stdout)["peak_bytes"] > 7e9
    # a config needs transformers: one line naming the extra, no traceback
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}))
    out = _run([mg, "estimate", str(cfg)], cwd=str(tmp))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    assert 'pip install "memguard-train[hf]"' in out.stderr, out.stderr
