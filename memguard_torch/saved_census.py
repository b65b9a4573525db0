"""A census of the tensors each block saves for its backward while a forward runs: autograd's
``saved_tensors_hooks`` see every tensor an op keeps, forward hooks on the blocks say whose forward
is running. Used on fake tensors (``FakeTensorMode``) to measure a block kind the estimator's rules do
not model. docs/estimator.md, "Block kinds".
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

__all__ = ["saved_bytes_per_block"]


def saved_bytes_per_block(forward: Callable[[], Any], blocks: Sequence[Any], exclude: Sequence[Any] = ()) -> List[int]:
    """Bytes of the distinct storages autograd saves inside each block's forward.

    Args:
        forward: runs the model's forward once (its result is dropped).
        blocks: the ``nn.Module`` blocks to attribute saves to (a save outside every block, in
            the embeddings or the head, is not counted).
        exclude: tensors whose storages are not activations (the parameters and buffers).

    Returns:
        Per block, the bytes of the storages first saved inside its forward (a storage saved
        again, in this block or a later one, counts once: where it was first kept). A storage is
        counted whole, as the allocator holds it, even when only a view is saved.

    Raises:
        Whatever ``forward`` raises; the hooks are removed in every case.
    """
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    skip = {StorageWeakRef(t.untyped_storage()) for t in exclude}
    seen = set()
    per = [0] * len(blocks)
    current: List[int] = []

    def enter(i: int):
        def hook(_m, _args):
            current.append(i)
        return hook

    def leave(_m, _args, _out):
        if current:
            current.pop()

    def pack(t):
        if current and isinstance(t, torch.Tensor):
            ref = StorageWeakRef(t.untyped_storage())
            if ref not in skip and ref not in seen:
                seen.add(ref)
                per[current[-1]] += int(t.untyped_storage().nbytes())
        return t

    handles = []
    try:
        for i, b in enumerate(blocks):
            handles.append(b.register_forward_pre_hook(enter(i)))
            handles.append(b.register_forward_hook(leave, always_call=True))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for h in handles:
            h.remove()
    return per
