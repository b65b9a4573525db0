"""bitsandbytes inputs kept for the backward: which versions keep a 4-bit linear's input, the saved
inputs per block and the last step's inputs a kept graph holds. docs/estimator.md, "bitsandbytes".
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from .gradients import grad_layers
from .trainable import block_linear_shapes, lora_linears, num_lora_layers
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec
from .weights import weight_bits


#: First bitsandbytes whose ``MatMul4Bit`` keeps no input: commit 9e75374 (#1270), docs/estimator.md#cuda.
BNB_4BIT_INPUT_DROPPED = (0, 43, 2)

#: Attention output projections by name (the rest of a block's attention linears read the
#: normalised block input).
_ATTN_OUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj")


def bnb_4bit_keeps_input(ts: TrainSpec) -> bool:
    """Whether bitsandbytes' 4-bit matmul keeps its input A for the backward in this run:
    ``ts.bnb_version`` before :data:`BNB_4BIT_INPUT_DROPPED` (0.41.1 and 0.42.0 store
    ``ctx.tensors = (A, B)`` whenever an input needs a gradient; from 0.43.2 on ``(None, B)``). An
    unknown version (``None``) takes the older rule, the larger estimate."""
    if ts.bnb_version is None:
        return True
    return version_tuple(ts.bnb_version) < BNB_4BIT_INPUT_DROPPED


def version_tuple(version: str) -> Tuple[int, int, int]:
    """``"0.42.0"`` -> ``(0, 42, 0)``: the first three numbers of a version string, zero-padded
    (``"0.5"`` -> ``(0, 5, 0)``; a suffix such as ``.dev1`` is ignored)."""
    import re

    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return parts + (0,) * (3 - len(parts))  # type: ignore[return-value]


def bnb_saved_inputs(ms: ModelSpec, ts: TrainSpec, *, lora: bool) -> float:
    """Bytes per token that bitsandbytes' quantized linears of one frozen block save, beyond what
    the module rules count (HF / Lightning with NF4 or LLM.int8 block linears; MLX quantization is
    not bitsandbytes).

    bitsandbytes ``autograd/_functions.py``: ``MatMul4Bit.forward`` (what ``Linear4bit.forward``
    calls through ``bnb.matmul_4bit``) computes ``F.linear(A, dequantize_4bit(B, quant_state)
    .to(A.dtype).t(), bias)`` and stores ``ctx.tensors = (A, B)`` whenever
    ``any(ctx.needs_input_grad[:2])`` -- the input A is kept although the backward only needs B
    (``grad_A = grad_output @ dequantize_4bit(B)``; the weight is frozen). ``MatMul8bitLt`` (LLM.int8,
    ``Linear8bitLt``) likewise keeps A in ``ctx.tensors``. Under LoRA the activations require grad
    (the adapters upstream), so every quantized linear of every block the backward passes through
    keeps its input, in the compute dtype (``Linear4bit.forward`` casts x to ``compute_dtype``;
    under autocast the bf16 copy). A frozen 16-bit ``nn.Linear`` keeps nothing for its input
    (``derivatives.yaml`` ``mm``: the input is saved only for the weight's gradient).

    Linears sharing one input (q/k/v; gate/up) save one tensor. When the compute dtype is fp32 and
    LoRA wraps a linear of the group, PEFT's ``lora_A`` already saves that very tensor (no cast):
    nothing more. Phi's single LayerNorm feeds the attention and the MLP (one tensor for both).
    Fused MoE expert tensors are not bitsandbytes modules: not counted.

    bitsandbytes 0.43.2 and later keep no input in ``MatMul4Bit`` (``bnb_4bit_keeps_input``):
    nothing for 4-bit weights then; ``MatMul8bitLt`` still keeps A."""
    wb = weight_bits(ms, ts)
    if ts.framework == "mlx" or ts.method == "full" or wb >= 16:
        return 0.0
    if wb < 8 and not bnb_4bit_keeps_input(ts):
        return 0.0
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    b = 2 if amp else e
    h = ms.hidden_size
    lora_names = {ls.name for ls in lora_linears(ms, ts)} if lora else set()
    groups: Dict[str, List] = {}
    for ls in block_linear_shapes(ms):
        if ls.is_param or ls.kind in ("router", "experts"):
            continue
        if ls.kind == "attention":
            role = "attn_out" if ls.name in _ATTN_OUT_NAMES else "attn_in"
        else:
            role = "mlp_in" if ls.in_features == h else "mlp_out"
        if ms.model_type == "phi" and role == "mlp_in":
            role = "attn_in"
        g = groups.setdefault(role, [ls.in_features, False])
        g[1] = g[1] or ls.name in lora_names
    return float(sum(b * fin for fin, has_lora in groups.values() if not (b == 4 and has_lora)))


def bnb_last_step_inputs(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of the previous micro-batch's bitsandbytes inputs still live while the next forward
    runs, in a loop that keeps the last step's output (``TrainSpec.last_graph_kept``).

    ``MatMul4Bit`` (bitsandbytes before 0.43.2) and ``MatMul8bitLt`` keep A as a plain attribute
    of ``ctx`` (``ctx.tensors = (A, B)`` / ``(CAt, subA, A)``, ``bitsandbytes/autograd/
    _functions.py``), not through ``save_for_backward``. The backward frees only saved variables
    (``retain_graph=False``: ``PyNode::release_variables``, ``torch/csrc/autograd/python_function.cpp``),
    so a ``ctx`` attribute lives as long as the graph's nodes do -- until the last reference to the
    step's output goes. A hand-written loop that writes ``logits = model(x)`` every step (LitGPT's
    ``finetune/lora.py`` ``fit``, Lightning-AI/litgpt at 00af8b0d) drops the old list only when the
    new forward returns: the previous step's inputs of every quantized linear are live beside the
    new step's activations at the end of the forward. Counted with the micro-batch's own shape
    (the previous step at the same length), at the loss moment; 0 under gradient checkpointing
    (not modelled), without bitsandbytes weights, or when the loop keeps no graph."""
    if (ts.grad_checkpoint or not ts.last_graph_kept or ts.framework == "mlx" or ts.method == "full"
            or weight_bits(ms, ts) >= 16):
        return 0
    tokens = ts.batch_size * ts.seq_length
    n_train = num_lora_layers(ms, ts)
    n_frozen = max(grad_layers(ms, ts) - n_train, 0)
    per = n_train * bnb_saved_inputs(ms, ts, lora=True)
    if n_frozen:
        per += n_frozen * bnb_saved_inputs(ms, ts.replace(lora_targets=("__none__",)), lora=False)
    return int(per * tokens)
