"""Where a killed training run resumes from: the latest checkpoint per framework.

The ``memguard run`` supervisor (:mod:`memguard_core.supervisor`) names what the run saved before
it died in the child's ``MEMGUARD_RESUME_FROM``: :func:`find_resume_checkpoint` picks the
directory from the command's flags (:data:`DIR_FLAGS`) and the framework (``auto``: the one the
flags point to first, :func:`command_framework`), then :func:`hf_latest_checkpoint` (a
``checkpoint-N`` folder), :func:`lightning_latest_checkpoint` (a ModelCheckpoint ``.ckpt``) or
:func:`mlx_latest_adapter` (an ``NNNNNNN_adapters.safetensors``). Each adapter reads the variable
back with :func:`resume_from_env`. Only file names and times are read; no framework is imported.
The contract and the finding rules: docs/supervisor.md.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import zipfile
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import ConfigError

logger = logging.getLogger("memguard.resume")

#: The environment variable that names the checkpoint a restarted run resumes from.
RESUME_ENV = "MEMGUARD_RESUME_FROM"
#: Frameworks with a resume rule, in the order ``auto`` tries them.
FRAMEWORKS = ("hf", "lightning", "mlx")
AUTO = "auto"

#: Command-line flags naming where each framework's checkpoints go, most specific first.
#: hf: ``TrainingArguments.output_dir`` through ``HfArgumentParser`` (both spellings accepted).
#: lightning: a script's ``ModelCheckpoint(dirpath=...)`` (``--ckpt-dir``), ``Trainer(default_root_dir=...)``
#: (``LightningCLI`` spells it ``--trainer.default_root_dir``), then a generic ``--output-dir``.
#: mlx: ``mlx_lm.lora --adapter-path`` (lora.py), then ``--output-dir``.
DIR_FLAGS: Dict[str, Tuple[str, ...]] = {
    "hf": ("--output-dir", "--output_dir"),
    "lightning": ("--ckpt-dir", "--ckpt_dir", "--default_root_dir", "--default-root-dir",
                  "--trainer.default_root_dir", "--output-dir", "--output_dir"),
    "mlx": ("--adapter-path", "--adapter_path", "--output-dir", "--output_dir"),
}
# flags that only a Lightning script has (LightningCLI's are all --trainer.* / --model.* / --data.*)
_LIGHTNING_ONLY_FLAGS = ("--ckpt-dir", "--ckpt_dir", "--default_root_dir", "--default-root-dir",
                         "--trainer.default_root_dir")
#: mlx_lm.lora's default ``adapter_path`` (lora.py ``CONFIG_DEFAULTS``), relative to the working dir.
MLX_LM_DEFAULT_ADAPTER_PATH = "adapters"

_HF_RE = re.compile(r"^checkpoint-(\d+)$")
_MLX_RE = re.compile(r"^(\d+)_adapters\.safetensors$")
_STEP_RE = re.compile(r"(?:^|[-_])step=(\d+)(?=$|[-_.])")
# ModelCheckpoint.CHECKPOINT_NAME_LAST = "last"; _find_last_checkpoints matches the stem against
# rf"^{CHECKPOINT_NAME_LAST}(-(\d+))?" with re.match (no end anchor), so last-v1 matches too
_LAST_RE = re.compile(r"^last(-(\d+))?")
_CKPT_EXT = ".ckpt"  # ModelCheckpoint.FILE_EXTENSION
# where a ModelCheckpoint under a root directory writes (ModelCheckpoint.__resolve_ckpt_dir)
_LIGHTNING_SUBDIRS = ("", "checkpoints", os.path.join("*", "checkpoints"),
                      os.path.join("*", "*", "checkpoints"))


def require_framework(framework: str, field: str = "framework", allow_auto: bool = True) -> str:
    """``framework`` lower-cased if it is one of :data:`FRAMEWORKS` (or ``auto`` when allowed).

    Raises:
        ConfigError: naming ``field`` otherwise.
    """
    allowed = ((AUTO,) if allow_auto else ()) + FRAMEWORKS
    if not isinstance(framework, str) or framework.strip().lower() not in allowed:
        raise ConfigError(field, "one of " + ", ".join(allowed), framework)
    return framework.strip().lower()


def _path_str(path, field: str) -> Optional[str]:
    if path is None:
        return None
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ConfigError(field, "a path (str or os.PathLike) or None", path)
    return os.fspath(path)


# ------------------------------------------------------------------------------------------- steps

def checkpoint_step(path) -> Optional[int]:
    """The optimizer step (hf, lightning) or iteration (mlx) a checkpoint was saved at, from its name.

    Args:
        path: a checkpoint path (str or os.PathLike; a trailing ``/`` is ignored) or None.

    Returns:
        N for ``.../checkpoint-N`` (hf), for a ``.ckpt`` whose name has ``step=N``
        (``epoch=0-step=N.ckpt``, ``step=N-v1.ckpt``; Lightning's ``global_step``), and for
        ``.../NNNNNNN_adapters.safetensors`` (mlx_lm's iteration counter: with gradient
        accumulation it counts micro-batches, not optimizer updates). None for None and for any
        other name (``last.ckpt``, ``adapters.safetensors``): the file is not opened.

    Raises:
        ConfigError: ``path`` is neither a path nor None.
    """
    p = _path_str(path, "path")
    if not p:
        return None
    name = os.path.basename(p.rstrip("/\\"))
    m = _HF_RE.match(name) or _MLX_RE.match(name)
    if m:
        return int(m.group(1))
    if name.endswith(_CKPT_EXT):
        m = _STEP_RE.search(name[:-len(_CKPT_EXT)])
        if m:
            return int(m.group(1))
    return None


# ------------------------------------------------------------------------------------------- finding

def _listdir(directory: Optional[str]) -> List[str]:
    if not directory:
        return []
    try:
        return os.listdir(directory)
    except OSError:
        return []


def hf_latest_checkpoint(output_dir) -> Optional[str]:
    """``<output_dir>/checkpoint-N`` with the largest N (a directory), or None.

    The rule of ``transformers.trainer_utils.get_last_checkpoint`` (the number, not the mtime).
    A missing or unreadable ``output_dir`` gives None.

    Raises:
        ConfigError: ``output_dir`` is neither a path nor None.
    """
    return _largest_numbered(_path_str(output_dir, "output_dir"), _HF_RE, os.path.isdir)


def _largest_numbered(d: Optional[str], pattern, kind) -> Optional[str]:
    """The entry of folder ``d`` whose name matches ``pattern`` with the largest number (its first
    group) and passes ``kind`` (``os.path.isdir`` / ``isfile``), as a path; None without one."""
    best = None
    for name in _listdir(d):
        m = pattern.match(name)
        if m and kind(os.path.join(d, name)):
            n = int(m.group(1))
            if best is None or n > best[0]:
                best = (n, name)
    return os.path.join(d, best[1]) if best else None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return float("-inf")


def _complete_zip(path: str) -> bool:
    # a torch.save archive ends with the zip central directory; a write cut short by a kill has none
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def lightning_checkpoints(root) -> List[str]:
    """Every ``.ckpt`` file where a ModelCheckpoint under ``root`` writes (docs/supervisor.md, "Finding the latest checkpoint").

    Args:
        root: ``--ckpt-dir`` (a ModelCheckpoint dirpath) or ``default_root_dir``; None -> [].

    Returns:
        Absolute-or-as-given file paths, sorted, without duplicates.
    """
    r = _path_str(root, "root")
    if not r:
        return []
    found = set()
    for sub in _LIGHTNING_SUBDIRS:
        for d in glob.glob(os.path.join(glob.escape(r), sub)) if sub else [r]:
            for name in _listdir(d):
                p = os.path.join(d, name)
                if name.endswith(_CKPT_EXT) and os.path.isfile(p):
                    found.add(os.path.normpath(p))
    return sorted(found)


def lightning_latest_checkpoint(root) -> Optional[str]:
    """The checkpoint a killed Lightning run resumes from, or None (the rules: docs/supervisor.md, "Finding the latest checkpoint").

    Args:
        root: ``--ckpt-dir`` (a ModelCheckpoint dirpath) or ``default_root_dir``.

    Returns:
        The path of a ``.ckpt`` file: the newest ``last*.ckpt`` (Lightning's ``ckpt_path="last"``),
        else the largest ``step=N``, else the newest; incomplete archives skipped. None when
        there is none or ``root`` is missing.

    Raises:
        ConfigError: ``root`` is neither a path nor None.
    """
    files = lightning_checkpoints(root)
    last = [p for p in files if _LAST_RE.match(os.path.basename(p)[:-len(_CKPT_EXT)])]
    others = [p for p in files if p not in last]
    ordered = sorted(last, key=_mtime, reverse=True)
    ordered += sorted(others, key=lambda p: (checkpoint_step(p) is not None, checkpoint_step(p) or 0, _mtime(p)),
                      reverse=True)
    for p in ordered:
        if _complete_zip(p):
            return p
        logger.warning("memguard: %s is not a complete checkpoint archive (a save cut short?); passing over it", p)
    return None


def mlx_latest_adapter(adapter_path) -> Optional[str]:
    """``<adapter_path>/NNNNNNN_adapters.safetensors`` with the largest N (a file), or None.

    Raises:
        ConfigError: ``adapter_path`` is neither a path nor None.
    """
    return _largest_numbered(_path_str(adapter_path, "adapter_path"), _MLX_RE, os.path.isfile)


_FINDERS = {"hf": hf_latest_checkpoint, "lightning": lightning_latest_checkpoint, "mlx": mlx_latest_adapter}


# ------------------------------------------------------------------------------------------- the command

def _flag_value(cmd: Sequence[str], flags: Sequence[str]) -> Optional[str]:
    """The value of the first of ``flags`` found in ``cmd`` (``--flag X`` or ``--flag=X``), flags in order."""
    for flag in flags:
        for i, tok in enumerate(cmd):
            if tok == flag and i + 1 < len(cmd):
                return cmd[i + 1]
            if tok.startswith(flag + "="):
                return tok[len(flag) + 1:]
    return None


def _is_mlx_lm(cmd: Sequence[str]) -> bool:
    # ``python -m mlx_lm.lora``, ``mlx_lm.lora``, ``mlx_lm lora``, ``python -m mlx_lm lora``
    toks = [os.path.basename(t) for t in cmd]
    return any(t == "mlx_lm.lora" for t in toks) or any(
        t == "mlx_lm" and i + 1 < len(toks) and toks[i + 1] == "lora" for i, t in enumerate(toks))


def detect_checkpoint_dir(cmd: Sequence[str], framework: str) -> Optional[str]:
    """Where ``cmd`` saves ``framework``'s checkpoints, from its flags (:data:`DIR_FLAGS`), or None.

    An ``mlx_lm.lora`` command without ``--adapter-path`` saves in mlx_lm's default ``adapters``.

    Raises:
        ConfigError: ``framework`` is not one of hf, lightning, mlx.
    """
    fw = require_framework(framework, allow_auto=False)
    d = _flag_value(cmd, DIR_FLAGS[fw])
    if d is None and fw == "mlx" and _is_mlx_lm(cmd):
        d = MLX_LM_DEFAULT_ADAPTER_PATH
    return d


def command_framework(cmd: Sequence[str]) -> Optional[str]:
    """The framework ``cmd``'s flags point to, or None when they say nothing specific.

    mlx: ``--adapter-path`` or an ``mlx_lm.lora`` command; lightning: ``--ckpt-dir``,
    ``--default_root_dir`` or a ``LightningCLI`` ``--trainer.`` flag; hf: ``--output_dir`` /
    ``--output-dir`` alone (the HF spelling, also used by other scripts: a hint, not a proof).
    """
    flags = {t.split("=", 1)[0] for t in cmd if t.startswith("--")}
    if _is_mlx_lm(cmd) or flags & {"--adapter-path", "--adapter_path"}:
        return "mlx"
    if flags & set(_LIGHTNING_ONLY_FLAGS) or any(f.startswith("--trainer.") for f in flags):
        return "lightning"
    if flags & set(DIR_FLAGS["hf"]):
        return "hf"
    return None


def find_resume_checkpoint(cmd: Sequence[str], framework: str = AUTO,
                      output_dir: Optional[str] = None) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """The checkpoint a restart of ``cmd`` resumes from.

    Args:
        cmd: the training command (argument list).
        framework: ``auto``, ``hf``, ``lightning`` or ``mlx``.
        output_dir: the directory to search (the supervisor's ``--output-dir``); default: the
            command's flags for each framework (:func:`detect_checkpoint_dir`).

    Returns:
        ``(path, framework, directory)``: the checkpoint (None when there is none), the framework
        whose rule found it (with ``auto`` and nothing found: the one the command points to, or
        None) and the directory searched (None when no directory was given or detected).

    Raises:
        ConfigError: ``framework`` is not one of auto, hf, lightning, mlx.
    """
    fw = require_framework(framework)
    hint = command_framework(cmd)
    order = [fw] if fw != AUTO else ([hint] if hint else []) + [f for f in FRAMEWORKS if f != hint]
    first_dir = None
    for f in order:
        d = output_dir if output_dir is not None else detect_checkpoint_dir(cmd, f)
        if first_dir is None:
            first_dir = d
        path = _FINDERS[f](d) if d else None
        if path:
            return path, f, d
    return None, (fw if fw != AUTO else hint), first_dir


# ------------------------------------------------------------------------------------------- the child

def resume_from_env(framework: str, default: Optional[str] = None,
                    env: Optional[Mapping[str, str]] = None, log: Optional[logging.Logger] = None) -> Optional[str]:
    """The checkpoint named in ``MEMGUARD_RESUME_FROM`` if it is ``framework``'s kind, else ``default``.

    What each framework accepts: hf a directory; lightning an existing ``.ckpt`` file; mlx an
    existing ``.safetensors`` file. Anything else (a stale path, another framework's checkpoint)
    is logged and ignored: the run starts as it would without the variable.

    Args:
        framework: hf, lightning or mlx.
        default: returned when the variable is unset, empty or not usable.
        env: the environment (default ``os.environ``).
        log: where the warning goes (default ``memguard.resume``).

    Raises:
        ConfigError: ``framework`` is not one of hf, lightning, mlx.
    """
    fw = require_framework(framework, allow_auto=False)
    path = (os.environ if env is None else env).get(RESUME_ENV, "").strip()
    if not path:
        return default
    if fw == "hf":
        ok, want = os.path.isdir(path), "a checkpoint-N directory"
    elif fw == "lightning":
        ok, want = os.path.isfile(path) and path.endswith(_CKPT_EXT), "a .ckpt file"
    else:
        ok, want = os.path.isfile(path) and path.endswith(".safetensors"), "an adapters .safetensors file"
    if not ok:
        (log or logger).warning("memguard: %s=%r is not %s; not resuming from it", RESUME_ENV, path, want)
        return default
    return path
