"""``torchrun`` for the tests' multi-process runs, with the ranks forked from a launcher that has
already imported what the worker script imports.

    python -m memguard_testing.torchrun [torchrun's options] SCRIPT [ARGS ...]

The options are parsed by ``torch.distributed.run``'s own parser and turned into its
``LaunchConfig`` by its own ``config_from_args``, and the ranks are run by the same elastic agent
(``torch.distributed.launcher.api.elastic_launch``): the same rendezvous, the same ``RANK`` /
``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` / ``TORCHELASTIC_*``
environment in each rank, the same handling of a failed rank (the others are stopped, the launcher
exits non-zero). The one difference: torchrun starts a script's ranks as new interpreters, each
importing torch, transformers or Lightning again (seconds of CPU per rank on a small machine; the
tests launch dozens), where here the launcher runs the script's top level once (its imports and
definitions, not its ``__main__`` block) and the agent forks the ranks from it (its
``start_method="fork"`` for a function entrypoint, as torchrun's own ``--run-path`` uses). Each
rank then runs the script as ``__main__`` with its arguments.

Nothing runs a parallel region before the fork (importing torch starts no OpenMP threads), and
each rank starts with the launcher's environment (``OMP_NUM_THREADS``, ``MALLOC_ARENA_MAX`` and
the like are read at library load, so they are set for the launcher, as they are for torchrun). A
rank's address space holds what the launcher mapped before the fork, so a test places its limits
from a reference launched the same way.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import subprocess
import sys
import uuid
from typing import Dict, Optional, Tuple


class _RankDone(BaseException):
    """A rank's script ended with ``os._exit(0)`` (see :func:`_rank`)."""


def _rank(script: str, *argv: str) -> None:
    """One rank: the script as ``__main__`` with ``argv``, as torchrun's ``--run-path`` runs it
    (``run_script_path``). The agent counts a forked rank as done when its function returns (the
    rank then waits for the agent and leaves without interpreter teardown), and a rank that exits
    with status 0 before that as never done: so an exit with status 0, ``sys.exit`` or
    ``os._exit`` (which the workers use to skip gloo's teardown), ends the function instead; any
    other status ends the rank with it, as in torchrun."""
    from torch.distributed.run import run_script_path

    real_exit = os._exit

    def _exit(status: int) -> None:
        if status:
            real_exit(status)
        raise _RankDone

    os._exit = _exit
    try:
        run_script_path(script, *argv)
    except _RankDone:
        pass
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        os._exit = real_exit


def main(argv=None) -> None:
    """torchrun with ``argv`` (its options, then SCRIPT and the script's arguments), the ranks
    forked from this process after it ran the script's top level."""
    import torch.distributed.run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    argv = list(sys.argv[1:] if argv is None else argv)
    args = torchrun.parse_args(argv)
    if args.module or args.no_python or args.run_path:
        raise SystemExit("memguard_testing.torchrun: give a script path (no --module, --no-python or --run-path)")
    script = os.path.abspath(args.training_script)
    sys.path.insert(0, os.path.dirname(script))   # as `python SCRIPT` puts the script's folder first
    runpy.run_path(script, run_name="__memguard_launcher__")   # its imports and definitions only
    if args.standalone:   # what torchrun's run() does for --standalone
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    args.start_method = "fork"
    config, _, script_args = torchrun.config_from_args(args)
    # torchrun would run [python, -u, SCRIPT, ARGS]; the same script and arguments, in a forked rank
    elastic_launch(config, _rank)(script, *script_args[script_args.index(args.training_script) + 1:])


def launch(script: str, *args: str, env: Dict[str, str], nproc: int = 2,
           timeout: float = 600) -> Tuple[Optional[int], str]:
    """``script`` on ``nproc`` ranks on this host through this launcher (a free loopback port),
    its stdout and stderr together; (return code, output), the code ``None`` when the launch had
    not ended after ``timeout`` seconds (a hang: the launcher and its ranks, one process group,
    are killed). ``env`` needs this repository on ``PYTHONPATH`` (``memguard_testing.script_env``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "memguard_testing.torchrun", f"--nproc_per_node={nproc}",
                             "--master_addr", "127.0.0.1", "--master_port", str(port), script, *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None, proc.communicate()[0]
    return proc.returncode, output


if __name__ == "__main__":
    main()
