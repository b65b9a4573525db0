"""Layers (docs/design.md): memguard_core imports no adapter, at module level or inside a function;
the CLI reaches adapter features through entry points (memguard_core.features)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "memguard_core"
ADAPTERS = ("memguard_hf", "memguard_lightning", "memguard_mlx", "memguard_torch", "memguard_bench")


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_the_core_imports_no_adapter():
    found = [f"{p.relative_to(CORE.parent)}:{line} imports {name}"
             for p in sorted(CORE.rglob("*.py")) for line, name in _imports(p)
             if name.split(".")[0] in ADAPTERS]
    assert not found, "\n".join(found)


def test_adapter_features_are_registered_entry_points():
    from importlib import metadata

    from memguard_core.features import GROUP

    names = {ep.name: ep.value for ep in metadata.entry_points(group=GROUP)}
    if not names:
        pytest.skip("memguard is not installed with its metadata here")
    # the features the CLI asks for by name, each resolving to an object of its adapter
    for name in ("demo.hf", "demo.lightning", "demo.mlx", "trace", "bench", "config.hf"):
        assert name in names, f"entry point {name} missing from {GROUP}"
    for ep in metadata.entry_points(group=GROUP):
        assert ep.value.split(".")[0] in ADAPTERS, ep
        assert ep.load() is not None, ep


def test_a_missing_feature_is_one_line_naming_the_extra(monkeypatch):
    from importlib import metadata

    from memguard_core import features

    monkeypatch.setattr(metadata, "entry_points", lambda group: [
        metadata.EntryPoint(name="demo.x", value="surely_not_a_module_here.demo:run_demo", group=group)])
    with pytest.raises(features.FeatureUnavailable, match=r'pip install "memguard-train\[x\]"'):
        features.load("demo.x", "x")
    with pytest.raises(features.FeatureUnavailable, match="not registered"):
        features.load("demo.y", "y")
