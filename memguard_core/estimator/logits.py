"""The logits term: the logits and loss working set (fp32 upcast, log_softmax and its gradient) and
the head's saved inputs. docs/estimator.md, "How the peak is composed".
"""

from __future__ import annotations

from typing import Tuple

from .attention import dropout_bytes
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec


def logits_bytes(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int]:
    """Logits and loss working set, (loss-moment peak, final-norm/head saved) in bytes.

    transformers 5.x ``LlamaForCausalLM.forward`` computes ``lm_head`` on every position
    (``logits_to_keep=0``), and ``loss/loss_utils.py`` ``ForCausalLMLoss`` upcasts with
    ``logits.float()`` and pads the labels instead of slicing the logits; ``cross_entropy`` =
    ``log_softmax`` (saves its fp32 output) + ``nll_loss``. With N = batch x seq x vocab:
      forward:  logits (e) + fp32 copy (4, absent when e = 4) + log_softmax output (4);
      backward start: log_softmax output + nll_loss grad + log_softmax grad, all fp32 (3 x 4), the
      logits being freed when ``compute_loss`` drops the model output;
      head backward: grad in e (+ the fp32 grad while casting) -- below the backward-start peak.
    So the loss moment holds max(e + 4 + 4 (or 8 when e = 4), 12) x N bytes.
    mlx_lm (``tuner/trainer.py`` ``default_loss``) computes ``nn.losses.cross_entropy`` on the
    model-dtype logits: logits + logsumexp-based loss + grad: ~3 x e x N.
    """
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    n = ts.batch_size * ts.seq_length * ms.vocab_size
    if ts.framework == "mlx":
        return 3 * e * n, 0
    fwd = (e + 4 + 4) if e < 4 else 8
    if amp:
        fwd = 2 + 4 + 4
    peak = max(fwd, 12) * n
    if ms.final_logit_softcapping:
        peak += (2 if amp else e) * n  # ``tanh(logits / cap) * cap``: the tanh output is saved
    return peak, 0


def head_input_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """transformers + PEFT (not mlx_lm): the final norm's saved input (fp32) and, when the head
    trains (full fine-tune), the head's input in the compute dtype twice, plus the embedding
    dropout's noise, bytes for the micro-batch."""
    if ts.framework == "mlx":
        return 0
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length
    head_in = 4 * ms.hidden_size * tokens
    if ts.method == "full":
        head_in += e * ms.hidden_size * tokens * 2
    if ms.embedding_dropout > 0:
        head_in += dropout_bytes(ts, e) * ms.hidden_size * tokens  # the embedding dropout's noise
    return head_in
