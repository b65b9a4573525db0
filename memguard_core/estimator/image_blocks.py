"""Image classifiers (ViT, DeiT ``*ForImageClassification``): the patch tokens the blocks run on, what
one pre-LN ViT block saves per token, and what the model keeps outside its blocks (the pixels, the
final LayerNorm, the classifier on the CLS token). Called by ``activations``, ``logits`` and
``estimate``. docs/estimator.md, "Image classification (ViT)".
"""

from __future__ import annotations

from typing import Any

from .attention import dropout_bytes
from .encoder_blocks import encoder_block_act
from .heads import IMAGE_CLASSIFICATION, head_of
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec

__all__ = ["is_image_classifier", "with_patch_tokens", "image_block_act", "outside_bytes",
           "pixel_bytes", "pixel_rows"]


def is_image_classifier(ms: ModelSpec) -> bool:
    """True for a ViT / DeiT image classifier: the image-classification head on a spec with a patch
    grid (``ModelSpec.patch_size`` > 0)."""
    return head_of(ms).kind == IMAGE_CLASSIFICATION and ms.patch_size > 0


def with_patch_tokens(ms: ModelSpec, ts: TrainSpec) -> TrainSpec:
    """``ts`` with ``seq_length`` = the tokens an image classifier's blocks run on per image
    (``ModelSpec.patch_tokens``: ``(image_size // patch_size) ** 2`` plus the CLS / distillation
    tokens), whatever it held (the CLI's ``--seq-length`` default); ``ts`` itself for any other
    model."""
    if not is_image_classifier(ms) or ts.seq_length == ms.patch_tokens:
        return ts
    return ts.replace(seq_length=ms.patch_tokens)


def image_block_act(ms: ModelSpec, ts: TrainSpec, a: Any, lora_names: set, trainable_block: bool,
                    e: int, r: int, amp: bool) -> Any:
    """Adds to ``a`` (bytes per token: ``hidden``, ``scores``) what one ViT / DeiT block saves for its
    backward and returns it; the arguments as ``encoder_blocks.encoder_block_act`` takes them.

    transformers 5 ``modeling_vit.py`` ``ViTLayer`` is pre-LN: ``layernorm_before`` -> ``ViTAttention``
    (``q_proj``, ``k_proj``, ``v_proj``, the attention interface, ``o_proj`` on a contiguous copy) ->
    ``dropout`` -> ``+ residual`` -> ``layernorm_after`` -> ``ViTMLP`` (``fc1``, exact GELU,
    ``fc2``) -> ``dropout`` -> ``+ residual`` (``modeling_deit.py`` ``DeiTLayer`` is the same code).
    Moving the two LayerNorms from after the residual adds (BERT's post-LN ``BertLayer``) to before
    the sub-layers keeps the set of tensors one block saves (``derivatives.yaml``): two
    ``native_layer_norm`` inputs (the residual stream, r x h) with their per-token mean and rstd,
    two LayerNorm outputs read by the linears (q / k / v's and ``fc1``'s input), the attention core,
    ``o_proj``'s input, GELU's input and output, a dropout's noise after each sub-layer when
    ``hidden_dropout_prob`` > 0. Only which block a tensor is born in moves (BERT's block input is
    the last block's LayerNorm output; ViT's last LayerNorm output sits outside the blocks,
    :func:`outside_bytes`), so the count is ``encoder_block_act``'s; the linears are told apart
    by shape and path (``o_proj`` the attention's output, ``fc1`` reads h features, ``fc2`` the
    intermediate ones). One difference in the attention: ViT's ``eager_attention_forward`` takes
    the softmax in fp32 and casts it back (``softmax(..., dtype=torch.float32).to(query.dtype)``),
    where BERT's runs in the compute dtype: with a half compute dtype it saves the fp32
    probabilities (4 bytes per score) and the cast that the second matmul saves (e; with dropout
    the dropout's noise and output, as BERT's), 4 - e bytes more per score with dropout, 4 without.
    Checked against the saved tensors of real ViT and DeiT blocks: tests/test_image_blocks.py."""
    a = encoder_block_act(ms, ts, a, lora_names, trainable_block, e, r, amp)
    if ts.attn_impl == "eager" and e < 4:
        a.scores += ms.num_heads * ts.seq_length * (4 - e + (0 if ms.attention_dropout > 0 else e))
    return a


def pixel_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """One micro-batch's ``pixel_values``, ``batch x num_channels x image_size ** 2`` in fp32 (image
    processors return float32), bytes."""
    return 4 * ts.batch_size * ms.num_channels * ms.image_size ** 2


def pixel_rows(ts: TrainSpec) -> int:
    """Images whose ``pixel_values`` are alive during a step, in collated batches of
    ``TrainSpec.rows_per_batch`` rows: the HF ``Trainer`` takes the accumulation window's batches
    before its first forward (transformers ``Trainer.get_batch_samples``: ``grad_accum x batch_size``
    rows) and accelerate's ``DataLoaderShard.__iter__`` has fetched the next one ("We iterate one
    batch ahead"); Lightning's ``_PrefetchDataFetcher`` holds the batch and one ahead; a plain loop
    its own batch. When a guard cuts each batch into micro-batches in place (``collated_rows`` >
    ``batch_size``) these stay whole batches."""
    per = ts.rows_per_batch
    if ts.framework == "hf":
        return ts.grad_accum * ts.batch_size + per
    return 2 * per if ts.framework == "lightning" else per


def outside_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """What an image classifier keeps for the backward outside its blocks, bytes for the micro-batch
    (T = batch x patch tokens, R = rows, h = hidden, e = compute-dtype bytes, r = the residual
    stream's: fp32 under autocast):

    * the collated pixels (:func:`pixel_rows` images) and, when the patch
      convolution trains (a full
      fine-tune), the copy it saves of them in a half compute dtype (``ViTModel.forward`` casts
      ``pixel_values`` to the projection's dtype; autocast casts a conv's input): 2 bytes per pixel;
    * the embedding dropout's noise (``ViTEmbeddings.dropout``, ``hidden_dropout_prob`` > 0) on the
      T x h embeddings (``attention.dropout_bytes``);
    * the final ``layernorm`` (``ViTModel.layernorm``): its input r h T and per-token mean and rstd
      (fp32 on CUDA, r on CPU);
    * the classifier (``ViTForImageClassification.classifier``, trained in every method: PEFT's
      LoRA recipes for image classification name it in ``modules_to_save``) on
      ``sequence_output[:, 0, :]``: the linear saves that view, which keeps the whole LayerNorm
      output alive (e h T); under autocast it saves its own bf16 cast of the R x h view instead.

    The convolution's output, the concatenation with the CLS token and the position embeddings'
    add save nothing (``derivatives.yaml``: ``cat`` and ``add`` need no inputs for their
    gradients)."""
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    r = 4 if amp else e
    h = ms.hidden_size
    rows = ts.batch_size
    tokens = rows * ms.patch_tokens
    out = pixel_bytes(ms, ts) // ts.batch_size * pixel_rows(ts)
    if ts.method == "full" and (amp or e < 4):
        out += pixel_bytes(ms, ts) // 2
    if ms.embedding_dropout > 0:
        out += dropout_bytes(ts, e) * h * tokens
    stat = 4 if ts.device == "cuda" else r
    out += (r * h + 2 * stat) * tokens
    out += 2 * h * rows if amp else e * h * tokens
    return int(out)


