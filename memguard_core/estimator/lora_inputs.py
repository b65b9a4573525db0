"""The inputs LoRA'd frozen linears save for their adapters, per token (PEFT's casts and LoRA
dropout): shared by the block rules of :mod:`.activations`, :mod:`.encoder_blocks` and :mod:`.vision`.
docs/estimator.md, "LoRA input copies and the heap".
"""

from __future__ import annotations

from .attention import dropout_bytes
from .specs import TrainSpec

__all__ = ["lora_input_bytes"]


def lora_input_bytes(ts: TrainSpec, n_lora: int, fin: int, e: int, amp: bool) -> float:
    """Bytes per token that ``n_lora`` LoRA'd frozen linears reading one shared input of ``fin``
    features save for their adapters (PEFT ``peft/tuners/lora/layer.py`` ``Linear.forward``:
    ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``, then ``lora_A(dropout(x))``):

    * ``lora_dropout`` 0 (``nn.Identity``): ``lora_A`` saves its input -- the shared tensor itself
      when it is already in the adapter's dtype (fp32 weights: one e x fin for the group), a
      separate fp32 copy per linear when the base is half (PEFT's ``autocast_adapter_dtype``
      keeps the adapters in fp32), a bf16 autocast copy per linear under autocast;
    * ``lora_dropout`` > 0: per linear, the dropout's output (fp32, or the autocast copy ``lora_A``
      saves in its place) and the dropout's mask on an fp32 input: on CPU / mps the ``noise``
      tensor ``_dropout_impl`` multiplies by (4 bytes), on CUDA ``native_dropout``'s 1-byte mask
      (``dropout_bytes``). The dropout saves its mask only when its input requires grad, which
      is every LoRA'd linear but those ahead of the first trainable one (the first block's
      q/k/v); they are counted alike (a slight over-estimate, one block's worth at most).
    """
    if n_lora <= 0:
        return 0.0
    per = 2 if amp else 4          # lora_A's saved input: the autocast copy, or fp32
    if ts.lora_dropout > 0:
        return (per + dropout_bytes(ts, 4)) * fin * n_lora
    if amp:
        return 2 * fin * n_lora
    return e * fin if e == 4 else 4 * fin * n_lora
