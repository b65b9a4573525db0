"""The layering contract of docs/design.md ("Layers"), enforced three ways:

* import-linter's contracts in pyproject.toml (``lint-imports``): ``memguard_core`` imports no
  framework, at any depth (imports inside functions count); HF and Lightning sit above
  ``memguard_torch``, which sits with ``memguard_mlx`` above the core;
* no core module reaches a framework without importing it (``sys.modules["torch"]`` and the like);
* every core module imports with the frameworks made unimportable.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ROOT / "memguard_core"
FRAMEWORKS = ("torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "trl", "lightning",
              "pytorch_lightning", "mlx", "mlx_lm", "datasets", "litgpt")


def test_import_linter_contracts_are_kept():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (the [dev] extra brings it)")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") >= 2, proc.stdout[-2000:]


def _framework_lookups(path: pathlib.Path, root: pathlib.Path = ROOT) -> list:
    """``sys.modules.get("torch...")`` / ``sys.modules["mlx.core"]`` / ``"torch" in sys.modules`` in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func.value) == "sys.modules" and node.args:
            names = [node.args[0]]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
            names = [node.slice]
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "sys.modules" for c in node.comparators):
            names = [node.left]
        for n in names:
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.split(".")[0] in FRAMEWORKS:
                found.append(f"{path.relative_to(root)}:{node.lineno} {n.value}")
    return found


def test_the_core_does_not_reach_a_framework_through_sys_modules():
    found = [hit for p in sorted(CORE.rglob("*.py")) for hit in _framework_lookups(p)]
    assert not found, "\n".join(found)


def test_the_lookup_check_sees_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import sys\ntorch = sys.modules.get("torch")\nmx = sys.modules["mlx.core"]\n'
                   'ok = "torch.distributed" in sys.modules\nfine = sys.modules.get("json")\n')
    hits = [h.split(" ")[-1] for h in _framework_lookups(bad, tmp_path)]
    assert hits == ["torch", "mlx.core", "torch.distributed"]


def test_every_core_module_imports_with_the_frameworks_blocked():
    mods = []
    for p in sorted(CORE.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods.append(".".join(parts))
    code = ("import importlib, sys\n"
            f"for name in {FRAMEWORKS!r}:\n"
            "    sys.modules[name] = None   # an import of it raises ImportError\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            "print('ok', len(sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]
