"""What ``TorchGuard`` does across ranks (a mixin): every rank cuts a batch into the same number of
micro-batches, FSDP / DDP state is reset alike after a chunk that failed on some rank, and under DDP
with OOM sync points the gradients are averaged once every rank's batch has gone through.
The design: docs/torch_loop.md.
"""

from __future__ import annotations

from typing import List, Tuple

from memguard_core import torch_train as tt
from memguard_core.distributed import agree_max, all_reduce_max
from memguard_core.errors import ConfigError
from memguard_core.microbatch import BatchSplitter, free_after_oom

from . import _compat
from .preflight import world_size


class RankAgreement:
    """Uses ``TorchGuard``'s ``sync`` (``memguard_torch.sync.OomSync``), ``model``, ``_ddp`` and
    ``_manual_reduce``."""

    def _agreed_ranges(self, sp: BatchSplitter, k: int, start: int) -> List[Tuple[int, int]]:
        """``sp.ranges(k, start)``, with the same number of chunks on every rank (FSDP runs one
        all-gather per unit per forward: a rank with one chunk fewer would hang the others). A rank
        whose cut came out shorter (a short last batch, rows without labels merged) cuts finer."""
        ranges = sp.ranges(k, start)
        if world_size() <= 1:
            return ranges
        top, neg = self._agree_max_pair(len(ranges), -len(ranges))
        kk = k
        while top != -neg:
            if len(ranges) < top and kk < sp.units - start:
                kk += 1
                ranges = sp.ranges(kk, start)
            top, neg = self._agree_max_pair(len(ranges), -len(ranges))
            if len(ranges) < top and kk >= sp.units - start and top != -neg:
                raise ConfigError("batch", "the same number of rows on every rank (the ranks could not cut "
                                  "their batches into the same number of micro-batches)",
                                  f"{-neg} to {top} micro-batches")
        return ranges

    def _agree_max_pair(self, a: int, b: int) -> Tuple[int, int]:
        """The MAX over ranks of two integers: on the flag group when there is one, else through
        ``memguard_core.distributed.agree_max`` (its gloo side group under NCCL)."""
        if self.sync.group is not None:
            top, other = all_reduce_max([a, b], self.sync.group)
            return top, other
        return agree_max(a), agree_max(b)

    def _after_abort(self) -> None:
        """After a chunk that failed on some rank: FSDP's iteration state reset (every rank: a peer
        stopped mid-forward or mid-backward too), DDP's buffer-broadcast flag set alike on every
        rank, memory freed."""
        if self.model is not None and _compat.fsdp_modules(self.model):
            _compat.reset_fsdp_after_abort(self.model)
        if self._ddp is not None and self._manual_reduce:
            _compat.ddp_after_abort(self._ddp)
        free_after_oom()

    def _reduce_ddp_gradients(self) -> None:
        """Average the gradients over the DDP ranks once every rank's last chunk of the batch has
        succeeded (``memguard_core.torch_train.average_ddp_gradients``)."""
        tt.average_ddp_gradients(self._ddp, self.sync.group)
