"""A missing optional dependency is one line naming the extra (#34 item 3): each adapter imported in
a fresh interpreter with its framework blocked (``sys.modules[name] = None``, what Python does for
a module that cannot be imported)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memguard_core.extras import MissingExtraError, require


@pytest.mark.parametrize("adapter,blocked,extra", [
    ("memguard_hf", "transformers", "hf"),
    ("memguard_hf", "torch", "hf"),
    ("memguard_lightning", "lightning", "lightning"),
    ("memguard_torch", "torch", "torch"),
    ("memguard_mlx", "mlx_lm", "mlx"),
])
def test_adapter_without_its_extra_names_it(adapter, blocked, extra):
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            f"try:\n    import {adapter}\nexcept ModuleNotFoundError as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("MissingExtraError"), line
    assert blocked in line and f'pip install "memguard-train[{extra}]"' in line
    assert "\n" not in line


def test_require_imports_nothing_and_passes_when_installed():
    require("memguard_core", ["json", "os"], "none")      # installed: no error
    with pytest.raises(MissingExtraError, match=r'pip install "memguard-train\[x\]"') as info:
        require("an adapter", ["json", "surely_not_a_module_here"], "x")
    assert info.value.name == "surely_not_a_module_here"
    assert "surely_not_a_module_here" not in sys.modules
