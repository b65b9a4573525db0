"""The logits term: the logits and loss working set (fp32 upcast, log_softmax and its gradient) and
the head's saved inputs, for the task head the model trains with (:mod:`.heads`).
docs/estimator.md, "How the peak is composed" and "Task heads".
"""

from __future__ import annotations

from typing import Tuple

from .attention import dropout_bytes
from .heads import (MASKED_LM, QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, TaskHead,
                    head_of)
from . import image_blocks, seq2seq_blocks
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec


def _loss_bytes_per_logit(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes per logit of the loss moment (see :func:`logits_bytes`): max(forward, backward start)."""
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    fwd = (e + 4 + 4) if e < 4 else 8
    if amp:
        fwd = 2 + 4 + 4
    return max(fwd, 12)


def logits_bytes(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int]:
    """Logits and loss working set, (loss-moment peak, final-norm/head saved) in bytes.

    LM heads (causal, masked): transformers 5.x ``LlamaForCausalLM.forward`` computes ``lm_head``
    on every position (``logits_to_keep=0``), and ``loss/loss_utils.py`` ``ForCausalLMLoss`` upcasts
    with ``logits.float()`` and pads the labels instead of slicing the logits; ``cross_entropy`` =
    ``log_softmax`` (saves its fp32 output) + ``nll_loss``. With N = batch x seq x vocab:
      forward:  logits (e) + fp32 copy (4, absent when e = 4) + log_softmax output (4);
      backward start: log_softmax output + nll_loss grad + log_softmax grad, all fp32 (3 x 4), the
      logits being freed when ``compute_loss`` drops the model output;
      head backward: grad in e (+ the fp32 grad while casting) -- below the backward-start peak.
    So the loss moment holds max(e + 4 + 4 (or 8 when e = 4), 12) x N bytes.
    mlx_lm (``tuner/trainer.py`` ``default_loss``) computes ``nn.losses.cross_entropy`` on the
    model-dtype logits: logits + logsumexp-based loss + grad: ~3 x e x N.

    Classifier heads (:func:`classifier_logits`): the same cross-entropy working set on the
    logits the loss reads -- ``rows x num_labels`` for sequence classification, ``tokens x
    num_labels`` for token classification, ``tokens x 2`` for question answering (start and end) --
    plus, for a sequence classifier that scores every position (``GenericForSequenceClassification``
    in transformers/modeling_layers.py: ``score(hidden_states)`` then ``logits[arange, last_token]``),
    its ``tokens x num_labels`` logits in the compute dtype.
    """
    head = head_of(ms)
    if not head.is_lm:
        return classifier_logits(ms, ts, head), 0
    n, _ = _logits_counts(ms, ts, head)
    if seq2seq_blocks.is_seq2seq(ms):  # over the target tokens, the loss on the head's dtype
        return seq2seq_blocks.loss_bytes_per_logit(ms, ts) * n, 0
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    if ts.framework == "mlx":
        return 3 * e * n, 0
    peak = _loss_bytes_per_logit(ms, ts) * n
    if ms.final_logit_softcapping:
        peak += (2 if amp else e) * n  # ``tanh(logits / cap) * cap``: the tanh output is saved
    return peak, 0


def _logits_counts(ms: ModelSpec, ts: TrainSpec, head: TaskHead) -> Tuple[int, int]:
    """(elements of the logits the loss reads, elements of the whole logits tensor where the head
    makes more than the loss reads: a sequence classifier that scores every position, tokens x
    labels; else 0) for one micro-batch: the one place the logits' shapes are written (see
    :func:`logits_elements`)."""
    rows = ts.batch_size
    if head.is_lm:
        per_row = ts.decoder_tokens if seq2seq_blocks.is_seq2seq(ms) else ts.seq_length
        return rows * per_row * ms.vocab_size, 0
    k = head.out_features(ms.vocab_size)
    if image_blocks.is_image_classifier(ms):
        return rows * k, 0
    if head.kind == SEQUENCE_CLASSIFICATION:
        return rows * k, (rows * ts.seq_length * k if head.reads == "all_tokens" else 0)
    return rows * ts.seq_length * k, 0    # token classification, question answering (k = 2)


def logits_elements(ms: ModelSpec, ts: TrainSpec) -> int:
    """Elements of the logits tensor the head makes for one micro-batch: tokens x vocabulary for an
    LM head (an encoder-decoder's over its target tokens, ``TrainSpec.decoder_tokens``), ``rows x
    num_labels`` for a sequence or image classifier (``tokens x num_labels`` where it scores every
    position), ``tokens x num_labels`` for token classification, ``tokens x 2`` for question
    answering. What the CPU heap rule sizes against glibc's mmap ceiling (``cpu_heap.heap_slack``)."""
    read, scored = _logits_counts(ms, ts, head_of(ms))
    return scored or read


def classifier_logits(ms: ModelSpec, ts: TrainSpec, head: TaskHead) -> int:
    """The loss moment's logits and cross-entropy bytes of a classifier head (not an LM head).

    transformers 5.x: ``BertForSequenceClassification`` / ``ForSequenceClassificationLoss``
    (loss/loss_utils.py) take ``CrossEntropyLoss`` over ``rows x num_labels``;
    ``BertForTokenClassification`` / ``ForTokenClassification`` over ``tokens x num_labels``;
    ``BertForQuestionAnswering`` / ``ForQuestionAnsweringLoss`` split ``tokens x 2`` logits into
    start and end and take one cross-entropy over the positions of each row for each (``tokens``
    logits twice); ``ViTForImageClassification.loss_function``, cross-entropy over ``rows x
    num_labels`` for a single-label problem. Bytes per logit as for an LM head
    (:func:`logits_bytes`); a sequence classifier that scores every position also holds those
    logits in the compute dtype."""
    e = DTYPE_BYTES[ts.dtype]
    n_loss, scored = _logits_counts(ms, ts, head)
    per = 3 * e if ts.framework == "mlx" else _loss_bytes_per_logit(ms, ts)
    return per * n_loss + e * scored


def head_input_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """transformers + PEFT (not mlx_lm): what the head keeps for the backward, bytes for the
    micro-batch, plus the embedding dropout's noise.

    Causal LM: the final norm's saved input (fp32) and, when the head trains (full fine-tune), the
    head's input in the compute dtype twice (the norm's weight multiply and ``lm_head``).
    An encoder-decoder: what its two stacks keep outside their blocks
    (``seq2seq_blocks.outside_bytes``: embedding dropouts, final norms, the encoder's output, the
    head's input). Other heads: :func:`task_head_input_bytes`."""
    if ts.framework == "mlx":
        return 0
    if seq2seq_blocks.is_seq2seq(ms):
        return seq2seq_blocks.outside_bytes(ms, ts)
    if image_blocks.is_image_classifier(ms):  # pixels, final LayerNorm, the classifier's CLS view
        return image_blocks.outside_bytes(ms, ts)
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length
    head = head_of(ms)
    if head.kind == "causal_lm":
        head_in = 4 * ms.hidden_size * tokens
        if ts.method == "full":
            head_in += e * ms.hidden_size * tokens * 2
    else:
        head_in = task_head_input_bytes(ms, ts, head)
    if ms.embedding_dropout > 0:
        head_in += dropout_bytes(ts, e) * ms.hidden_size * tokens  # the embedding dropout's noise
    return head_in


def task_head_input_bytes(ms: ModelSpec, ts: TrainSpec, head: TaskHead) -> int:
    """What a masked-LM or classifier head keeps for the backward, bytes for the micro-batch
    (T = tokens, R = rows, h = hidden, e = compute-dtype bytes, d = a dropout's saved bytes per
    element, :func:`memguard_core.estimator.attention.dropout_bytes`). The classifier trains in
    every method (PEFT's ``SEQ_CLS`` / ``TOKEN_CLS`` / ``QUESTION_ANS`` task types put it in
    ``modules_to_save``), so its linear keeps its input; a pooler or transform trains only in a
    full fine-tune. From transformers 5.x ``models/bert/modeling_bert.py``, ``roberta``,
    ``deberta_v2`` and ``modeling_layers.py`` (the decoders' ``GenericFor*`` heads):

    - a final norm outside the blocks (pre-norm decoders): its fp32 input 4 h T, and its weight
      multiply's input e h T when it trains (full);
    - masked LM with a transform (``BertLMPredictionHead``: dense, GELU, LayerNorm, decoder):
      GELU and LayerNorm inputs 2 e h T, plus the dense and decoder inputs 2 e h T when they
      train (full); a bare head: the decoder's input e h T when full;
    - token classification: the dropout's noise d h T (p > 0) and the classifier's input e h T;
    - question answering: ``qa_outputs``' input e h T;
    - sequence classification scoring every position: the score's input e h T; reading the
      first token: ``rows x h`` tensors (the pooler's activation, two dropouts, two linear inputs:
      at most (3 e + 2 d) h R) and, when the first op on the ``[:, 0]`` view is a linear that
      trains (``BertPooler.dense`` in a full fine-tune; DistilBERT's ``pre_classifier``, which
      PEFT's task type trains, in every method), the view it saves holds the whole last hidden
      state's storage: e h T.
    """
    e = DTYPE_BYTES[ts.dtype]
    h = ms.hidden_size
    tokens, rows = ts.batch_size * ts.seq_length, ts.batch_size
    full = ts.method == "full"
    d = dropout_bytes(ts, e) if head.dropout > 0 else 0
    out = 0
    if head.final_norm:
        out += 4 * h * tokens + (e * h * tokens if full else 0)
    if head.kind == MASKED_LM:
        if head.transform:
            out += 2 * e * h * tokens + (2 * e * h * tokens if full else 0)
        elif full:
            out += e * h * tokens
    elif head.kind == TOKEN_CLASSIFICATION:
        out += (d + e) * h * tokens
    elif head.kind == QUESTION_ANSWERING:
        out += e * h * tokens
    elif head.reads == "all_tokens":
        out += e * h * tokens
    else:
        out += (3 * e + 2 * d) * h * rows
        if head.pooler_linear and (full or head.pooler_trains):
            out += e * h * tokens
    return out
