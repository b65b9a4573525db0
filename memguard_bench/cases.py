"""The bench's cases: the architecture and case tables read from ``memguard_bench/data/*.toml``, each
case named and filled in from its settings, and the selection (``--quick``, ``--only``, ``--set``,
``--backend``, ``--cuda``) of the cases a run measures. docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import tomllib
from importlib import resources
from typing import Dict, List, Optional, Sequence

__all__ = ["HF_ARCHS", "MLX_ARCHS", "HF_HELD_OUT_ARCHS", "MLX_HELD_OUT_ARCHS", "HF_FULL_DEPTH_ARCHS",
           "MLX_FULL_DEPTH_ARCHS", "FULL_DEPTH_LAYERS", "FITTED_MODEL_TYPES", "RULES_MODEL_TYPES", "TRAIN_DEFAULTS", "CASE_SETS",
           "CASES", "num_layers_of", "arch_of", "build_case", "cases", "full_depth_cases", "in_set", "select"]


def _load(name: str) -> dict:
    with resources.files(__package__).joinpath("data", name).open("rb") as f:
        return tomllib.load(f)


_MATRIX, _HELD_OUT, _FULL_DEPTH = (_load(f"archs_{s}.toml") for s in ("matrix", "held_out", "full_depth"))
_TABLES = _load("cases.toml")

#: HF ``AutoConfig.for_model(model_type, **numbers)`` of the matrix (data/archs_matrix.toml).
HF_ARCHS: Dict[str, dict] = _MATRIX["hf"]
#: mlx_lm ``models.<model_type>.ModelArgs(**numbers)`` of the matrix (data/archs_matrix.toml).
MLX_ARCHS: Dict[str, dict] = _MATRIX["mlx"]
#: Held-out architectures: no constant of the estimator was fitted on them (data/archs_held_out.toml).
HF_HELD_OUT_ARCHS: Dict[str, dict] = _HELD_OUT["hf"]
MLX_HELD_OUT_ARCHS: Dict[str, dict] = _HELD_OUT["mlx"]
#: Full-depth architectures: every block of the published config (data/archs_full_depth.toml).
HF_FULL_DEPTH_ARCHS: Dict[str, dict] = _FULL_DEPTH["hf"]
MLX_FULL_DEPTH_ARCHS: Dict[str, dict] = _FULL_DEPTH["mlx"]
#: The published layer count of each full-depth architecture (checked by tests/test_bench_full_depth.py).
FULL_DEPTH_LAYERS: Dict[str, int] = _FULL_DEPTH["layers"]
#: The model types whose block model was fitted on the matrix, per backend: a full-depth case of
#: another type is held out by architecture as well as by scale.
FITTED_MODEL_TYPES = {b: frozenset(types) for b, types in _MATRIX["fitted_model_types"].items()}
#: The model types whose block rule was written from their code while looking at them (no constant
#: fitted on them), per backend: reported apart from the fitted types and from the types no rule was
#: written for (data/archs_full_depth.toml ``rules_model_types``).
RULES_MODEL_TYPES = {b: frozenset(types) for b, types in _FULL_DEPTH["rules_model_types"].items()}
#: The train settings a case does not give (``lora_targets`` "backend" and ``lora_layers`` "all"
#: stand for the backend's default targets and None, TOML having no null).
TRAIN_DEFAULTS: Dict[str, object] = _TABLES["defaults"]
_DEFAULT_TARGETS: Dict[str, List[str]] = _TABLES["default_lora_targets"]

#: ``--set`` choices: ``matrix`` (the fitted small / truncated matrix), ``held-out`` (architectures
#: no constant was fitted on), ``all`` (those two: the long full-depth set is not in it),
#: ``full-depth`` (every block of published configs at 512-2048 tokens, HF and mlx_lm).
CASE_SETS = ("all", "matrix", "held-out", "full-depth")


def num_layers_of(arch: dict) -> int:
    """The layer count an arch dict builds (``num_hidden_layers``, GPT-2's ``n_layer``,
    DistilBERT's ``n_layers``; an encoder-decoder's encoder blocks: T5's ``num_layers``, BART's
    ``encoder_layers``)."""
    for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers"):
        if arch.get(key):
            return int(arch[key])
    raise KeyError("num_hidden_layers")


def _arch_table(backend: str, full_depth: bool) -> Dict[str, dict]:
    if backend == "hf":
        return HF_FULL_DEPTH_ARCHS if full_depth else {**HF_ARCHS, **HF_HELD_OUT_ARCHS}
    return MLX_FULL_DEPTH_ARCHS if full_depth else {**MLX_ARCHS, **MLX_HELD_OUT_ARCHS}


def arch_of(case: dict) -> dict:
    """A copy of the numbers of ``case``'s architecture (``model_type`` included).

    Raises:
        KeyError: the architecture is not in the backend's tables.
    """
    return dict(_arch_table(case["backend"], bool(case.get("full_depth")))[case["arch"]])


def _name(backend: str, arch: str, t: dict, full_depth: bool, steps: int) -> str:
    """The case's name: backend, arch and every setting that differs from the defaults."""
    parts = [backend] + (["fd"] if full_depth else []) + [
             arch, t["method"] if t["method"] == "full" else f"lora-r{t['lora_rank']}",
             f"b{t['batch_size']}", f"s{t['seq_length']}", t["dtype"]]
    if t["mixed_precision"]:
        parts.append("amp")
    if backend == "hf" and t["attn_impl"] != "sdpa":
        parts.append(t["attn_impl"])
    if t["grad_checkpoint"]:
        parts.append("gc")
    if t["optimizer"] != "adamw":
        parts.append(t["optimizer"])
    if t["grad_accum"] != 1:
        parts.append(f"ga{t['grad_accum']}")
    if t["lora_layers"]:
        parts.append(f"last{t['lora_layers']}")
    if t["method"] != "full" and t.get("lora_dropout"):
        parts.append(f"drop{t['lora_dropout']:g}")
    if t["method"] != "full" and t["lora_targets"] != _DEFAULT_TARGETS[backend]:
        parts.append("+".join(t["lora_targets"]))
    if t.get("target_length"):
        parts.append(f"t{t['target_length']}")
    if steps != 2:
        parts.append(f"{steps}steps")
    return "-".join(parts)


def build_case(backend: str, arch: str, quick: bool = False, held_out: bool = False, *, full_depth: bool = False,
               steps: int = 2, timeout_s: Optional[float] = None, **kw) -> dict:
    """One case: ``train`` holds the settings (``TRAIN_DEFAULTS`` overridden by ``kw``). Full-depth
    cases (``full_depth=True``: an arch of ``HF_FULL_DEPTH_ARCHS`` / ``MLX_FULL_DEPTH_ARCHS``) also
    carry ``steps`` (optimizer steps run), ``per_step`` (the child records the peak of every step)
    and ``timeout_s`` (seconds); their names start with ``<backend>-fd-``."""
    t = dict(TRAIN_DEFAULTS, **kw)
    if t["lora_targets"] == "backend":
        t["lora_targets"] = list(_DEFAULT_TARGETS[backend])
    if t["lora_layers"] == "all":
        t["lora_layers"] = None
    c = dict(name=_name(backend, arch, t, full_depth, steps), backend=backend, arch=arch, train=t, quick=quick,
             held_out=held_out)
    if steps != 2:
        c.update(steps=steps, per_step=True)
    if full_depth:
        mt = _arch_table(backend, True)[arch]["model_type"]
        c.update(full_depth=True, steps=steps, per_step=True, model_type=mt,
                 arch_fitted=mt in FITTED_MODEL_TYPES[backend], arch_rules=mt in RULES_MODEL_TYPES[backend])
        if timeout_s:
            c["timeout_s"] = float(timeout_s)
    return c


def _table_cases(group: str, **flags) -> List[dict]:
    """The cases of one group of data/cases.toml (``matrix``, ``held_out``, ``full_depth``), HF first."""
    out = []
    for backend in ("hf", "mlx"):
        for entry in _TABLES[group][backend]:
            kw = copy.deepcopy(entry)  # the parsed tables stay as read
            out.append(build_case(backend, kw.pop("arch"), **flags, **kw))
    return out


def cases() -> List[dict]:
    """Every case, in the order they run: the matrix (HF Trainer on torch CPU, then mlx_lm on MLX,
    run when mlx is installed), the held-out architectures, then the full-depth set."""
    return _table_cases("matrix") + _table_cases("held_out", held_out=True) + full_depth_cases()


def full_depth_cases() -> List[dict]:
    """The full-depth set (``--set full-depth``): every block of published configs
    (``HF_FULL_DEPTH_ARCHS``, ``MLX_FULL_DEPTH_ARCHS``), HF at 512-2048 tokens per micro-batch,
    mlx_lm at 64-128; dense cases run 2-3 optimizer steps, MoE cases 6-8; each has its own timeout."""
    return _table_cases("full_depth", full_depth=True)


CASES = cases()


def in_set(case: dict, case_set: str) -> bool:
    """Whether ``case`` belongs to ``case_set`` (see ``CASE_SETS``)."""
    if case_set == "full-depth":
        return bool(case.get("full_depth"))
    if case.get("full_depth"):
        return False
    if case_set == "matrix":
        return not case.get("held_out")
    if case_set == "held-out":
        return bool(case.get("held_out"))
    return True


def select(quick: bool = False, only: Sequence[str] = (), backends: Sequence[str] = ("hf", "mlx"),
           cuda: bool = False, case_set: str = "all") -> List[dict]:
    """The cases to run: the quick subset or all, filtered by name substrings, backend and set
    (``CASE_SETS``); with ``cuda`` each HF case also runs on the GPU (counter ``cuda``).

    Raises:
        ValueError: ``case_set`` not in ``CASE_SETS``.
    """
    if case_set not in CASE_SETS:
        raise ValueError(f"case_set: expected one of {CASE_SETS}, got {case_set!r}")
    out = []
    for c in CASES:
        if quick and not c["quick"]:
            continue
        if not in_set(c, case_set):
            continue
        if only and not any(o in c["name"] for o in only):
            continue
        if c["backend"] not in backends:
            continue
        out.append(c)
        if cuda and c["backend"] == "hf":
            out.append(dict(c, device="cuda", name=c["name"].replace("hf-", "hf-cuda-", 1)))
    return out
