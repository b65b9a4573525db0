"""``memguard run -- <command>``: restart a training command that was killed for memory.

No in-process guard survives the kernel's OOM killer or a Metal command-buffer abort. The
supervisor runs the command as a child and, when :func:`classify_exit` says it was killed for
memory, starts it again with twice the micro-batches (``MEMGUARD_MICRO_BATCHES``) and the latest
checkpoint in ``MEMGUARD_RESUME_FROM`` (found by :mod:`memguard_core.resume`), at most
``--max-restarts`` times; any other exit is returned unchanged. Python API: :func:`supervise`;
CLI: :func:`main` (exit status: the last child's, a signal death as ``128 + signal``; ``2`` for bad
arguments). docs/supervisor.md tells how a memory kill is recognised per platform, the child's
environment and the resume contract.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from .errors import ConfigError, require_positive_int
from .outputs import check_output
from .events import LOG_DIR_ENV, RUN_ID_ENV, append_record, event_log_path, new_run_id
from .options import MICRO_BATCHES_ENV, micro_batches_from_env
from .resume import (AUTO, FRAMEWORKS, RESUME_ENV, require_framework, checkpoint_step, detect_checkpoint_dir,
                     find_resume_checkpoint, hf_latest_checkpoint)

logger = logging.getLogger("memguard.supervisor")

#: The environment variable the child reads its starting micro-batches from.
SPLIT_ENV = MICRO_BATCHES_ENV
ATTEMPT_ENV = "MEMGUARD_ATTEMPT"
DEFAULT_MAX_RESTARTS = 3
STDERR_TAIL_BYTES = 64 * 1024

#: NTSTATUS codes of a process that died for lack of memory (ntstatus.h).
WINDOWS_OOM_STATUS = (0xC0000017, 0xC000012D)
_METAL_OOM = ("Insufficient Memory", "kIOGPUCommandBufferCallbackErrorOutOfMemory")
#: The last line of a traceback of an allocation failure: torch's (CUDA, MPS, the CPU allocator),
#: Python's, and MLX's (``[metal::malloc]`` on Metal, ``[malloc] Unable to allocate`` elsewhere:
#: mlx/backend/metal/allocator.cpp, mlx/allocator.cpp).
_PY_OOM = re.compile(r"^(torch\.OutOfMemoryError|torch\.cuda\.OutOfMemoryError|MemoryError|"
                     r"RuntimeError: .*(out of memory|DefaultCPUAllocator: (can't|not enough)|"
                     r"\[metal::malloc\]|\[malloc\] Unable to allocate)).*$",
                     re.MULTILINE)


#: The allocator setting ``memguard run`` gives a child whose environment names none
#: (:func:`child_alloc_conf`).
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def child_alloc_conf(env: Dict[str, str], platform: Optional[str] = None) -> Optional[str]:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in the child's ``env`` (in place)
    unless it names an allocator configuration already: ``PYTORCH_CUDA_ALLOC_CONF``,
    ``PYTORCH_ALLOC_CONF`` (its device-generic name, torch >= 2.9) or ``PYTORCH_HIP_ALLOC_CONF``
    (ROCm), set to anything, even empty (``memguard_core.probes.alloc_conf.ALLOC_CONF_NAMES``). Linux only
    (``platform``: default ``sys.platform``): torch's expandable segments use the CUDA driver's
    virtual memory API, which the caching allocator supports there; elsewhere it warns and ignores
    the setting.

    Why: without it the caching allocator keeps each ``cudaMalloc`` as a fixed segment, and blocks
    freed inside segments that requests of other sizes do not fit stay reserved (fragmentation: the
    "reserved but unallocated" memory of torch's out-of-memory message, which advises this setting);
    with it a segment grows and shrinks in place (PyTorch docs, "CUDA semantics: optimizing memory
    usage with PYTORCH_CUDA_ALLOC_CONF"). ``PYTORCH_CUDA_ALLOC_CONF`` rather than the newer name: torch
    2.13 still reads it first (c10/cuda/CUDAAllocatorConfig.h), and torch < 2.9 reads only it.

    Returns:
        the line to say (stderr) when it was set, else None.
    """
    from .probes.alloc_conf import ALLOC_CONF_NAMES

    plat = sys.platform if platform is None else platform
    if not plat.startswith("linux") or any(name in env for name in ALLOC_CONF_NAMES):
        return None
    env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return (f"memguard run: PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE_SEGMENTS} for the training command (the CUDA caching "
            f"allocator grows segments in place instead of fragmenting; set PYTORCH_CUDA_ALLOC_CONF yourself to choose "
            f"otherwise)")


# ------------------------------------------------------------------------------------------- helpers

def latest_checkpoint(output_dir: Optional[str]) -> Optional[str]:
    """``<output_dir>/checkpoint-N`` with the largest N (a directory), or None: the HF rule,
    :func:`memguard_core.resume.hf_latest_checkpoint` (kept here for existing callers)."""
    return hf_latest_checkpoint(output_dir)


def detect_output_dir(cmd: Sequence[str], framework: str = "hf") -> Optional[str]:
    """The directory ``cmd``'s flags name for ``framework``'s checkpoints, or None.

    hf: ``--output-dir`` / ``--output_dir`` (``X`` or ``=X``), the spellings of HF
    ``TrainingArguments`` through ``HfArgumentParser``. lightning: ``--ckpt-dir``,
    ``--default_root_dir`` / ``--default-root-dir`` / ``--trainer.default_root_dir``, then
    ``--output-dir``. mlx: ``--adapter-path``, then ``--output-dir`` (``adapters`` for an
    ``mlx_lm.lora`` command without one). See :func:`memguard_core.resume.detect_checkpoint_dir`.

    Raises:
        ConfigError: ``framework`` is not one of hf, lightning, mlx.
    """
    return detect_checkpoint_dir(cmd, framework)


def _vmstat_oom_kills(proc_root: str = "/proc") -> Optional[int]:
    try:
        with open(os.path.join(proc_root, "vmstat")) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _cgroup_oom_kills() -> Optional[int]:
    try:
        from .probes.linux.cgroup import cgroup_memory

        cg = cgroup_memory(refresh=True, detail=True)
        return None if cg is None else cg.oom_kill
    except Exception as exc:  # a probe never stops supervision
        logger.debug("cgroup oom_kill unreadable: %r", exc)
        return None


@dataclass(frozen=True)
class OomCounters:
    """OOM-kill counters read before and after a child ran (None: unreadable)."""

    cgroup: Optional[int] = None
    host: Optional[int] = None

    @classmethod
    def read(cls) -> "OomCounters":
        """Read the current counters (Linux; both None elsewhere)."""
        if not sys.platform.startswith("linux"):
            return cls()
        return cls(_cgroup_oom_kills(), _vmstat_oom_kills())


def _rose(before: Optional[int], after: Optional[int]) -> Optional[bool]:
    if before is None or after is None:
        return None
    return after > before


def classify_exit(returncode: int, before: OomCounters, after: OomCounters, *,
                  stderr_tail: str = "", platform: Optional[str] = None) -> tuple:
    """Was the child killed for memory?

    Args:
        returncode: the child's status as ``subprocess`` reports it (``-N`` for signal N).
        before, after: :class:`OomCounters` read around the run.
        stderr_tail: the end of the child's stderr.
        platform: ``sys.platform`` (default: this one).

    Returns:
        ``(for_memory: bool, reason: str)``; the reason says which evidence decided.
    """
    plat = sys.platform if platform is None else platform
    if returncode == 0:
        return False, "exited normally"
    sigkill = returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
    if plat.startswith("linux") and sigkill:
        cg, host = _rose(before.cgroup, after.cgroup), _rose(before.host, after.host)
        if cg:
            return True, (f"SIGKILL with the cgroup's oom_kill count up "
                          f"({before.cgroup} -> {after.cgroup})")
        if host:
            return True, f"SIGKILL with the host's oom_kill count up ({before.host} -> {after.host})"
        if cg is None and host is None:
            return True, "SIGKILL and no OOM counter readable: assumed to be the OOM killer"
        return False, "SIGKILL but no OOM kill was counted (killed by someone else)"
    if plat == "darwin":
        if sigkill:
            return True, "SIGKILL on macOS: assumed to be the memorystatus (jetsam) killer"
        if returncode in (-signal.SIGABRT, 128 + signal.SIGABRT) and any(s in stderr_tail for s in _METAL_OOM):
            return True, "Metal command buffer aborted: Insufficient Memory"
    if plat in ("win32", "cygwin") and (returncode & 0xFFFFFFFF) in WINDOWS_OOM_STATUS:
        return True, f"Windows exit status {returncode & 0xFFFFFFFF:#x} (out of memory)"
    m = None
    for m in _PY_OOM.finditer(stderr_tail):
        pass
    if m is not None and "Traceback" in stderr_tail[:m.start()]:
        return True, f"out-of-memory error escaped the script: {m.group(0)[:160]}"
    if sigkill:
        return False, "SIGKILL (not attributable to memory)"
    return False, f"exited with status {returncode}"


# ------------------------------------------------------------------------------------------- running

@dataclass
class Attempt:
    """One run of the child.

    Attributes:
        number: 1 for the first run, 2 for the first restart, ...
        micro_batches: the ``MEMGUARD_MICRO_BATCHES`` it ran with (None: not set).
        resume_from: the ``MEMGUARD_RESUME_FROM`` it ran with (None: from scratch).
        returncode: its exit status (``-N``: killed by signal N).
        killed_for_memory: :func:`classify_exit`'s verdict; ``reason`` its evidence.
        wall_s: seconds it ran.
        resume_framework: after a memory kill, the framework whose rule looked for the next
            attempt's checkpoint (hf, lightning, mlx; None when nothing pointed to one).
    """

    number: int
    micro_batches: Optional[int]
    resume_from: Optional[str]
    returncode: Optional[int] = None
    killed_for_memory: bool = False
    reason: str = ""
    wall_s: float = 0.0
    resume_framework: Optional[str] = None

    def to_dict(self) -> dict:
        """The fields as a dict (the ``--report`` JSON)."""
        return asdict(self)


@dataclass
class SupervisorResult:
    """Outcome of :func:`supervise`.

    Attributes:
        returncode: the last attempt's status, as a shell reports it (``128 + N`` for signal N).
        attempts: every run, in order.
        gave_up: the last attempt was killed for memory and no restart was left.
    """

    returncode: int
    attempts: List[Attempt] = field(default_factory=list)
    gave_up: bool = False

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)

    def to_dict(self) -> dict:
        return {"returncode": self.returncode, "restarts": self.restarts, "gave_up": self.gave_up,
                "attempts": [a.to_dict() for a in self.attempts]}


def _shell_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _tee(stream, sink, tail: bytearray) -> None:
    """Copy ``stream`` to ``sink`` as it comes, keeping the last STDERR_TAIL_BYTES in ``tail``."""
    try:
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                break
            try:
                sink.write(chunk)
                sink.flush()
            except (OSError, ValueError):
                pass
            tail.extend(chunk)
            if len(tail) > STDERR_TAIL_BYTES:
                del tail[:len(tail) - STDERR_TAIL_BYTES]
    except (OSError, ValueError):
        pass


def _run_once(cmd: Sequence[str], env: Mapping[str, str]) -> tuple:
    """Run ``cmd`` to completion; returns (returncode, stderr_tail). Forwards SIGINT/SIGTERM."""
    proc = subprocess.Popen(list(cmd), env=dict(env), stderr=subprocess.PIPE)
    sink = getattr(sys.stderr, "buffer", None)
    if sink is None:  # a replaced sys.stderr (pytest capture): write text
        class _TextSink:
            def write(self, b):
                sys.stderr.write(b.decode("utf-8", "replace"))

            def flush(self):
                sys.stderr.flush()
        sink = _TextSink()
    tail = bytearray()
    t = threading.Thread(target=_tee, args=(proc.stderr, sink, tail), name="memguard-run-tee",
                         daemon=True)
    t.start()
    old = {}
    if threading.current_thread() is threading.main_thread():
        def forward(signum, frame):
            try:
                proc.send_signal(signum)
            except OSError:
                pass
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                old[s] = signal.signal(s, forward)
            except (ValueError, OSError):
                pass
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    t.join(5.0)
    try:
        proc.stderr.close()
    except OSError:
        pass
    return rc, bytes(tail).decode("utf-8", "replace")


def supervise(cmd: Sequence[str], *, output_dir: Optional[str] = None, framework: str = AUTO,
              max_restarts: int = DEFAULT_MAX_RESTARTS, micro_batches: Optional[int] = None,
              env: Optional[Mapping[str, str]] = None,
              report: Optional[Callable[[str], None]] = None,
              runner: Optional[Callable[[Sequence[str], Mapping[str, str]], tuple]] = None,
              counters: Optional[Callable[[], OomCounters]] = None) -> SupervisorResult:
    """Run ``cmd``; restart it with twice the micro-batches and resume after each memory kill.

    Args:
        cmd: the training command (argument list, no shell).
        output_dir: where the script writes its checkpoints; default: the command's flags for the
            framework (:func:`memguard_core.resume.detect_checkpoint_dir`).
        framework: whose checkpoint rule finds the resume point: ``auto`` (default: the framework
            the command's flags point to, else the first of hf, lightning, mlx that finds one),
            ``hf``, ``lightning`` or ``mlx`` (:mod:`memguard_core.resume`).
        max_restarts: restarts allowed after memory kills (>= 0).
        micro_batches: the first run's ``MEMGUARD_MICRO_BATCHES`` (>= 1); default: the environment's
            (``MEMGUARD_MICRO_BATCHES``), else unset (the restart after a kill then uses 2).
        env: base environment of the child (default ``os.environ``); on Linux
            ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` is added where it names no allocator
            configuration (:func:`child_alloc_conf`, said once through ``report``).
        report: receives one human line per event (default: ``logger.warning``).
        runner, counters: the child runner and the OOM-counter reader (defaults: a real
            subprocess and :meth:`OomCounters.read`); replaceable for platforms this machine
            cannot run (tests).

    Returns:
        :class:`SupervisorResult`.

    Raises:
        ConfigError: empty ``cmd``, a command that is not an executable (on ``PATH`` or a path to
            one), bad ``framework``, ``output_dir``, ``max_restarts`` or ``micro_batches``.
    """
    if isinstance(cmd, (str, bytes)) or not cmd or not all(isinstance(c, str) for c in cmd):
        raise ConfigError("command", "a non-empty list of arguments (memguard run -- python train.py ...)",
                          cmd)
    if runner is None and shutil.which(cmd[0], path=(env or os.environ).get("PATH")) is None:
        raise ConfigError("command", "an executable on PATH or a path to one (memguard run -- python train.py ...)",
                          cmd[0])
    max_restarts = require_positive_int("max_restarts", max_restarts, allow_zero=True)
    framework = require_framework(framework)
    if output_dir is not None and (not isinstance(output_dir, (str, os.PathLike)) or not os.fspath(output_dir)):
        raise ConfigError("output_dir", "a directory path (str) or None", output_dir)
    if output_dir is not None:
        output_dir = os.fspath(output_dir)
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ConfigError("output_dir", "a directory (where the script writes its checkpoints), not a file",
                              output_dir)
    base_env: Dict[str, str] = dict(os.environ if env is None else env)
    if micro_batches is None:
        micro_batches = micro_batches_from_env(base_env)
    if micro_batches is not None:
        micro_batches = require_positive_int("micro_batches", micro_batches)
    say = report or (lambda line: logger.warning("%s", line))
    alloc_line = child_alloc_conf(base_env)
    if alloc_line:
        say(alloc_line)
    run = runner or _run_once
    read_counters = counters or OomCounters.read

    result = SupervisorResult(returncode=0)
    resume: Optional[str] = base_env.get(RESUME_ENV) or None
    # with an event log, every attempt writes to the same file (one run id), and the restarts are
    # recorded in it between the killed attempt's records and the next one's
    log_dir = base_env.get(LOG_DIR_ENV)
    # one id for the run's attempts, also without an event log (README: set by memguard run)
    base_env.setdefault(RUN_ID_ENV, new_run_id())
    while True:
        attempt = Attempt(number=len(result.attempts) + 1, micro_batches=micro_batches, resume_from=resume)
        child_env = dict(base_env)
        child_env[ATTEMPT_ENV] = str(attempt.number)
        if micro_batches is not None:
            child_env[SPLIT_ENV] = str(micro_batches)
        if resume:
            child_env[RESUME_ENV] = resume
        else:
            child_env.pop(RESUME_ENV, None)
        before = read_counters()
        t0 = time.monotonic()
        rc, tail = run(cmd, child_env)
        attempt.wall_s = round(time.monotonic() - t0, 2)
        after = read_counters()
        attempt.returncode = rc
        attempt.killed_for_memory, attempt.reason = classify_exit(rc, before, after, stderr_tail=tail)
        result.attempts.append(attempt)
        result.returncode = _shell_status(rc)
        if not attempt.killed_for_memory:
            if attempt.number > 1 or rc != 0:
                # the reason names the status when the exit was a plain one; a signal's adds it
                status = "" if f"status {rc}" in attempt.reason else f" (status {rc})"
                say(f"memguard run: attempt {attempt.number} ended: {attempt.reason}{status}")
            return result
        if result.restarts >= max_restarts:
            result.gave_up = True
            say(f"memguard run: attempt {attempt.number} killed for memory ({attempt.reason}); "
                f"no restart left (--max-restarts {max_restarts}); giving up with status {result.returncode}")
            return result
        micro_batches = 2 * (micro_batches or 1)
        resume, found_fw, searched = find_resume_checkpoint(cmd, framework, output_dir)
        attempt.resume_framework = found_fw
        where = (f"resuming from {resume} ({found_fw})" if resume else
                 ("no checkpoint found" if found_fw is None else f"no {found_fw} checkpoint found")
                 + (f" in {searched}" if searched else
                    " (no --output-dir / --default_root_dir / --ckpt-dir / --adapter-path given or detected)")
                 + ": restarting from step 0")
        message = (f"memguard run: attempt {attempt.number} killed for memory after {attempt.wall_s:.1f} s "
                   f"({attempt.reason}); restart {result.restarts + 1}/{max_restarts} with {SPLIT_ENV}={micro_batches}, {where}")
        say(message)
        if log_dir:
            append_record(event_log_path(log_dir, base_env[RUN_ID_ENV], 0),
                          {"type": "decision", "kind": "restart", "step": checkpoint_step(resume),
                           "message": message.split(": ", 1)[1], "attempt": attempt.number + 1,
                           "micro_batches": micro_batches})


# ------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    """The ``memguard run`` argument parser (everything after ``--`` is the training command)."""
    p = argparse.ArgumentParser(
        prog="memguard run",
        description="Run a training command; if it is killed for memory (the cgroup OOM killer, a\n"
                    "Metal abort), restart it with twice the micro-batches per batch\n"
                    "(MEMGUARD_MICRO_BATCHES) and from its latest checkpoint (MEMGUARD_RESUME_FROM).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="MEMGUARD_RESUME_FROM names, per framework, what the script resumes from:\n"
               "  hf         <output dir>/checkpoint-N (largest N):\n"
               "             trainer.train(resume_from_checkpoint=memguard_hf.resume_checkpoint())\n"
               "  lightning  a ModelCheckpoint .ckpt (last.ckpt, else the largest step=N) under --ckpt-dir or\n"
               "             --default_root_dir (also its checkpoints/ and */*/checkpoints/):\n"
               "             trainer.fit(model, ckpt_path=memguard_lightning.resume_checkpoint())\n"
               "  mlx        <--adapter-path>/NNNNNNN_adapters.safetensors (largest N): memguard_mlx loads it\n"
               "             and skips the N finished iterations\n"
               "With no checkpoint the restart begins at step 0 (reported).")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help=f"restarts after memory kills [{DEFAULT_MAX_RESTARTS}]")
    p.add_argument("--framework", default=AUTO, metavar="{" + ",".join((AUTO,) + FRAMEWORKS) + "}",
                   help="whose checkpoints to resume from [auto: the framework the command's flags point to "
                        "(--adapter-path / mlx_lm.lora: mlx; --ckpt-dir / --default_root_dir: lightning; "
                        "--output-dir: hf), else the first of hf, lightning, mlx that has a checkpoint]")
    p.add_argument("--output-dir", default=None,
                   help="where the script writes its checkpoints [detected from the command: --output-dir/--output_dir "
                        "(hf), --ckpt-dir/--default_root_dir (lightning), --adapter-path (mlx)]")
    p.add_argument("--micro-batches", dest="micro_batches", type=int, default=None, metavar="K",
                   help="first run's MEMGUARD_MICRO_BATCHES [environment's, else unset]")
    p.add_argument("--report", default=None, metavar="PATH", help="write the attempts as JSON to PATH")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    return p


_FLAG_OF = {"max_restarts": "--max-restarts", "micro_batches": "--micro-batches", "command": "command",
            "framework": "--framework", "output_dir": "--output-dir"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``memguard run [--max-restarts N] [--framework F] [--output-dir D] [--micro-batches K] [--report PATH] -- CMD...``.

    Returns the exit status (see the module doc). Bad arguments: a message naming the flag on
    stderr and status 2.
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.report:
            check_output(args.report, "--report")   # before the run, not after hours of it
        res = supervise(cmd, output_dir=args.output_dir, framework=args.framework,
                        max_restarts=args.max_restarts, micro_batches=args.micro_batches,
                        report=lambda line: print(line, file=sys.stderr, flush=True))
    except ConfigError as exc:
        flag = _FLAG_OF.get(exc.field, exc.field)
        print(f"memguard run: error: invalid {flag}: expected {exc.expected}, got {exc.got!r}", file=sys.stderr)
        return 2
    if args.report:
        try:
            with open(args.report, "w") as f:
                json.dump(res.to_dict(), f, indent=1)
        except OSError as exc:
            print(f"memguard run: could not write --report {args.report}: {exc}", file=sys.stderr)
            return res.returncode or 2
    return res.returncode


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
