"""What ``TorchGuard`` does across ranks (a mixin): every rank cuts a batch into the same number of
micro-batches, FSDP / DDP state is reset alike after a chunk that failed on some rank, and under DDP
with OOM sync points the gradients are averaged once every rank's batch has gone through.
The module-level functions (:func:`agreed_ranges`, :func:`fsdp_after_abort`) are shared with the HF
adapter's FSDP2 split (``memguard_hf.step``). The design: docs/torch_loop.md.
"""

from __future__ import annotations

from typing import List, Tuple

from . import train_reading as tt
from .distributed import agree_max, all_reduce_max
from memguard_core.errors import ConfigError
from memguard_core.microbatch import free_after_oom
from .microbatch import BatchSplitter

from . import _compat
from .specs import world_size


def agree_max_pair(a: int, b: int, group=None) -> Tuple[int, int]:
    """The MAX over ranks of two integers: on ``group`` (the flag group) when there is one, else
    through ``memguard_torch.distributed.agree_max`` (its gloo side group under NCCL)."""
    if group is not None:
        top, other = all_reduce_max([a, b], group)
        return top, other
    return agree_max(a), agree_max(b)


def agreed_ranges(sp: BatchSplitter, k: int, start: int, group=None) -> List[Tuple[int, int]]:
    """``sp.ranges(k, start)``, with the same number of chunks on every rank (FSDP runs one
    all-gather per unit per forward: a rank with one chunk fewer would hang the others). A rank
    whose cut came out shorter (a short last batch, rows without labels merged) cuts finer.
    Collective over every rank (on ``group`` when given, see :func:`agree_max_pair`).

    Raises:
        ConfigError: the ranks cannot cut their batches into the same number of micro-batches.
    """
    ranges = sp.ranges(k, start)
    if world_size() <= 1:
        return ranges
    top, neg = agree_max_pair(len(ranges), -len(ranges), group)
    kk = k
    while top != -neg:
        if len(ranges) < top and kk < sp.units - start:
            kk += 1
            ranges = sp.ranges(kk, start)
        top, neg = agree_max_pair(len(ranges), -len(ranges), group)
        if len(ranges) < top and kk >= sp.units - start and top != -neg:
            raise ConfigError("batch", "the same number of rows on every rank (the ranks could not cut "
                              "their batches into the same number of micro-batches)",
                              f"{-neg} to {top} micro-batches")
    return ranges


def fsdp_after_abort(model) -> None:
    """After a chunk that failed on some rank, on every rank: FSDP2's iteration state reset and the
    unsharded gradients of the aborted backward dropped (``_compat.reset_fsdp_after_abort``; a peer
    stopped mid-forward or mid-backward too), or FSDP1's (``_compat.reset_fsdp1_after_abort``: the
    completed chunks' sharded gradients kept, this chunk's dropped), then memory freed
    (``free_after_oom``).

    Raises:
        RuntimeError: FSDP1's state could not be reset (logged there).
    """
    if model is not None and _compat.fsdp_modules(model):
        _compat.reset_fsdp_after_abort(model)
    elif model is not None and _compat.fsdp1_modules(model) and not _compat.reset_fsdp1_after_abort(model):
        # this rank's FSDP1 state is unknown: going on would desynchronise its collectives from its
        # peers'; ending the rank lets the launcher end the others
        raise RuntimeError("memguard: FSDP1's state could not be reset after an out-of-memory error")
    free_after_oom()


class RankAgreement:
    """Uses ``TorchGuard``'s ``sync`` (``memguard_torch.sync.OomSync``), ``model``, ``_ddp`` and
    ``_manual_reduce``."""

    def _agreed_ranges(self, sp: BatchSplitter, k: int, start: int) -> List[Tuple[int, int]]:
        """:func:`agreed_ranges` on this run's flag group."""
        return agreed_ranges(sp, k, start, self.sync.group)

    def _after_abort(self) -> None:
        """After a chunk that failed on some rank: FSDP's iteration state reset (every rank: a peer
        stopped mid-forward or mid-backward too), DDP's buffer-broadcast flag set alike on every
        rank, memory freed."""
        if self._ddp is not None and self._manual_reduce:
            _compat.ddp_after_abort(self._ddp)
        fsdp_after_abort(self.model)

    def _reduce_ddp_gradients(self) -> None:
        """Average the gradients over the DDP ranks once every rank's last chunk of the batch has
        succeeded (``memguard_torch.train_reading.average_ddp_gradients``)."""
        tt.average_ddp_gradients(self._ddp, self.sync.group)
