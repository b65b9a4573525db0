"""Rank agreement on k (memguard_torch.distributed.agree_max) in two real gloo processes.

This machine has no NCCL (no GPU): the NCCL case is reached by making ``get_backend`` report
"nccl" inside the workers -- the one fake here, at the thinnest boundary -- so the gloo side group
is really created and used, which is what an NCCL run does.
"""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, pretend_nccl: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from memguard_torch import distributed as md

        if pretend_nccl:
            dist.get_backend = lambda *a, **k: "nccl"  # no NCCL here: see the module docstring
        ks = [(1, 4), (2, 2), (8, 1)]
        got = [md.agree_max(pair[rank]) for pair in ks]
        out.put((rank, got, len(md._GROUPS)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pretend_nccl", [False, True])
def test_two_ranks_agree_on_the_max(pretend_nccl):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, pretend_nccl, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, got, groups in res:
        assert got == [4, 2, 8]
        # a side group only when the default group is not gloo, created once
        assert groups == (1 if pretend_nccl else 0)


def test_single_process_returns_k():
    from memguard_torch.distributed import agree_max

    assert agree_max(3) == 3
