"""The structure of every memguard package read from the sources (issue 32): no import cycle between
modules, no module importing another module's ``_private`` name, no file over 800 lines and no class
over 300. Imports placed inside functions count the same as top-level ones, since they hide a cycle
rather than remove it. Which package may import which: tests/test_layering_contract.py."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("memguard_core", "memguard_torch", "memguard_hf", "memguard_lightning", "memguard_mlx",
            "memguard_bench", "memguard_testing")
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 300


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set) -> list:
    """(imported module, imported name or None) for every import in the file, at any depth."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:  # ``from . import litgpt``: the submodule itself
                    out.append((sub, None))
                else:
                    out.append((mod, a.name))
    return out


def _graph():
    mods = _modules()
    known = set(mods)
    edges, private = {}, set()
    for name, path in mods.items():
        deps = set()
        for mod, attr in _imports(name, path, known):
            if mod not in known or mod == name:
                continue
            deps.add(mod)
            if attr and attr.startswith("_") and not attr.startswith("__"):
                private.add((name, mod, attr))
        edges[name] = deps
    return edges, private


def _cycles(edges: dict) -> set:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_imports():
    edges, _ = _graph()
    # estimate.py imports litgpt at the top; step_heap.py imports probes inside a function
    assert "memguard_core.estimator.litgpt" in edges["memguard_core.estimator.estimate"]
    assert "memguard_core.probes" in edges["memguard_core.step_heap"]
    assert "memguard_torch.train_reading" in edges["memguard_hf.specs"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}


def test_no_import_cycle():
    edges, _ = _graph()
    assert not _cycles(edges)


def test_no_cross_module_private_import():
    _, private = _graph()
    assert not private, sorted(private)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_files_and_classes_stay_small(name):
    path = _modules()[name]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, name
    big = [(c.name, c.end_lineno - c.lineno + 1) for c in ast.walk(ast.parse(text))
           if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES]
    assert not big, big


def test_zero_bucket_keys_follow_the_rules_table():
    from memguard_core.estimator.layout import ZERO_BUCKET_KEYS
    from memguard_core.estimator.sharding import ZERO_BUCKETS

    for table in ZERO_BUCKETS.values():
        assert tuple(table) == ZERO_BUCKET_KEYS
