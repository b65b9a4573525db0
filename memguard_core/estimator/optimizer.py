"""The optimizer-state terms: AdamW / SGD / Adafactor / 8-bit and paged bitsandbytes states and the
optimizer step's temporaries. docs/estimator.md, "bitsandbytes: QLoRA (NF4) and LLM.int8" for the
paged states.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from .trainable import block_linear_shapes, lora_linears, num_lora_layers
from .specs import ModelSpec, TrainSpec
from .weights import master_weight_bytes, trainable_param_bytes


#: Smallest tensor whose paged state goes to unified memory: bnb ``Optimizer8bit.get_state_buffer``.
BNB_PAGED_MIN_NUMEL = 100_000


def paged_state_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of optimizer state a bitsandbytes *paged* optimizer (``paged_adamw_8bit`` /
    ``paged_adamw_32bit``, HF ``optim="paged_adamw_8bit"``) would hold in CUDA unified memory for
    these settings: the states (``optimizer_state_bytes`` per element: 8-bit 2 x (1 + 4/256), 32-bit
    2 x 4 -- bnb's 32-bit states are fp32 whatever the parameter dtype) of the trainable tensors of
    at least ``BNB_PAGED_MIN_NUMEL`` elements. Those bytes are outside the caching allocator:
    ``max_memory_allocated`` / ``max_memory_reserved`` never count them; ``nvidia-smi`` does while
    they are resident on the GPU. ``ts.optimizer`` ``paged-adamw-8bit`` (or ``adamw-8bit``) means
    the 8-bit states, anything else the 32-bit ones. ``cuda_counter_bytes`` leaves these bytes out
    of the allocator's counters when ``ts.optimizer`` is a paged one (``TrainSpec.paged``)."""
    per = 2 * (1 + 4 / 256) if ts.optimizer in ("adamw-8bit", "paged-adamw-8bit") else 8.0
    big = 0
    if ts.method != "full":
        r = ts.lora_rank
        for ls in lora_linears(ms, ts):
            for numel in (r * ls.in_features, ls.out_features * r):
                if numel >= BNB_PAGED_MIN_NUMEL:
                    big += ls.count * numel
        big *= num_lora_layers(ms, ts)
    else:
        for ls in block_linear_shapes(ms):
            numel = ls.in_features * ls.out_features
            if numel >= BNB_PAGED_MIN_NUMEL:
                big += ls.count * numel * ms.num_layers
        big += ms.params.embeddings + ms.params.lm_head
    return int(math.ceil(per * big))


def _adafactor_state_elems(ms: ModelSpec, ts: TrainSpec) -> int:
    """Adafactor (Shazeer & Stern 2018; transformers ``optimization.py`` ``Adafactor`` with its
    default ``beta1=None``): a matrix (rows x cols) keeps a row vector and a column vector of second
    moments (rows + cols elements); a vector keeps a full second moment; no first moment."""
    r = ts.lora_rank
    n_lora = num_lora_layers(ms, ts)
    if ts.method != "full":
        return n_lora * sum(ls.count * ((r + ls.in_features) + (ls.out_features + r))
                            for ls in lora_linears(ms, ts))
    lins = block_linear_shapes(ms)
    lin = sum(ls.count * (ls.in_features + ls.out_features) for ls in lins)
    # block vectors (norms, biases): full second moments
    block_vectors = max(ms.params.blocks - ms.num_layers * sum(ls.params for ls in lins), 0)
    n = num_lora_layers(ms, ts) if ts.framework == "mlx" else ms.num_layers
    elems = n * lin + block_vectors * n // ms.num_layers
    if ts.framework != "mlx":
        h = ms.hidden_size
        elems += (ms.vocab_size + h) + ms.params.norms - ms.params.norms_in_blocks
        if ms.params.lm_head:
            elems += ms.vocab_size + h
        extra_emb = ms.params.embeddings - ms.vocab_size * h  # learned positions (GPT-2 wpe)
        if extra_emb > 0:
            elems += extra_emb // h + h
    return elems


def optimizer_state_bytes(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """Optimizer state bytes.

    * adam / adamw: exp_avg + exp_avg_sq in the parameter's dtype (``torch/optim/adamw.py``
      ``_init_group``; mlx ``optimizers.Adam.init_single``): 2 x param bytes per trainable element.
    * sgd: HF ``optim="sgd"`` builds ``torch.optim.SGD`` without momentum: no state. MLX's
      ``optimizers.SGD.init_single`` creates ``v = zeros_like(parameter)`` whatever the momentum,
      and the compiled step keeps it: one buffer per parameter (checked on the memory held between
      mlx_lm steps; docs/estimator.md, "MLX constants").
    * sgd-momentum: one momentum buffer per parameter.
    * adafactor: factored second moments, see ``_adafactor_state_elems``.
    * adamw-8bit / paged-adamw-8bit: bitsandbytes block-wise 8-bit states (Dettmers et al. 2022,
      "8-bit Optimizers via Block-wise Quantization"): 2 states x 1 byte + one fp32 absmax per
      256-element block (bitsandbytes ``optim/optimizer.py``, blocksize 256) = 2 x (1 + 4/256)
      bytes per element.
    * paged-adamw-32bit: bitsandbytes ``Optimizer2State`` with 32-bit states allocates them fp32
      whatever the parameter dtype (``optim/optimizer.py`` ``init_state``: ``dtype=torch.float32``
      when ``config["optim_bits"] == 32``): 8 bytes per element. Paged or not, they are counted
      here; ``cuda_counter_bytes`` splits the paged part off the allocator's counters.
    """
    pb = 4 if master_weight_bytes(ms, ts, trainable) else trainable_param_bytes(ms, ts)
    o = ts.optimizer
    if o in ("adam", "adamw"):
        return 2 * pb * trainable
    if o == "sgd":
        return pb * trainable if ts.framework == "mlx" else 0
    if o == "sgd-momentum":
        return pb * trainable
    if o == "adafactor":
        return pb * _adafactor_state_elems(ms, ts)
    if o in ("adamw-8bit", "paged-adamw-8bit"):
        return int(math.ceil(2 * (1 + 4 / 256) * trainable))
    if o == "paged-adamw-32bit":
        return 8 * trainable
    raise ConfigError("optimizer", "a known optimizer", o)  # pragma: no cover (TrainSpec validates)


def _largest_trainable_tensor(ms: ModelSpec, ts: TrainSpec) -> int:
    if ts.method != "full":
        r = ts.lora_rank
        return max((r * max(ls.in_features, ls.out_features) for ls in lora_linears(ms, ts)),
                   default=0)
    big = max((ls.in_features * ls.out_features * ls.count for ls in block_linear_shapes(ms)), default=0)
    if ts.framework != "mlx":
        big = max(big, ms.vocab_size * ms.hidden_size)
    return big


def optimizer_temporary_bytes(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """Transient memory of ``optimizer.step()``.

    * torch adam/adamw: HF's default ``adamw_torch_fused`` (transformers ``training_args.py``, torch
      >= 2.8) runs the fused kernel in place: none. sgd / sgd-momentum update in place: none.
    * adafactor: HF's loop (transformers ``optimization.py`` ``Adafactor.step``) works one
      parameter at a time: ``update = grad**2 + eps`` and ``update = _approx_sq_grad(row, col)``
      (the first freed as the second is built, the rest in place) -- 2 fp32 copies of the largest
      tensor; half-precision parameters add their fp32 upcasts of ``grad`` and ``p`` (2 more).
    * mlx: ``mx.eval`` of the new parameters and states materialises them before the old arrays
      are released: one extra copy of the trainable parameters (MLX arrays are immutable).
    """
    if ts.framework == "mlx" and ts.optimizer != "sgd":
        return trainable * trainable_param_bytes(ms, ts)
    if ts.optimizer == "adafactor":
        copies = 2 if trainable_param_bytes(ms, ts) == 4 else 4
        return copies * 4 * _largest_trainable_tensor(ms, ts)
    return 0
