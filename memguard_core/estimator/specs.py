"""The estimator's inputs: ``ModelSpec`` (the architecture) and ``TrainSpec`` (the training settings),
the choices their fields take and the bytes of each dtype. Imports no rule of the estimator; the parallel
layout's fields are checked by :mod:`.layout`. docs/estimator.md, "The dtype contract".
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..errors import ConfigError, require_choice, require_positive_int
from .heads import DEFAULT_HEAD, SEQ2SEQ_FAMILIES, TaskHead
from .layout import validate_sharding


MiB = 1 << 20
#: Bytes per element of the compute dtype.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPE_BITS = {
    "float32": 32.0, "fp32": 32.0, "float": 32.0, "float64": 64.0, "double": 64.0,
    "bfloat16": 16.0, "bf16": 16.0, "float16": 16.0, "fp16": 16.0, "half": 16.0,
    "int8": 8.0, "uint8": 8.0, "float8_e4m3fn": 8.0, "float8_e5m2": 8.0,
}
DTYPE_NAMES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adafactor", "adamw-8bit", "paged-adamw-8bit",
              "paged-adamw-32bit")
#: Optimizer names as users spell them -> ``OPTIMIZERS`` (HF ``TrainingArguments.optim`` values,
#: ``transformers/training_args.py`` ``OptimizerNames``; underscores read as hyphens first).
OPTIMIZER_ALIASES = {"adamw-torch": "adamw", "adamw-torch-fused": "adamw", "adamw-bnb-8bit": "adamw-8bit",
                     "paged-adamw": "paged-adamw-32bit"}
#: The optimizers whose states bitsandbytes pages to CUDA unified memory (``bnb.optim.PagedAdamW*``).
PAGED_OPTIMIZERS = ("paged-adamw-8bit", "paged-adamw-32bit")
DTYPES = ("fp32", "bf16", "fp16")
FRAMEWORKS = ("hf", "lightning", "mlx", "torch")
#: Whose model code runs: transformers' modules (+ PEFT), or LitGPT's own (``memguard_core.estimator.litgpt``).
MODEL_CODES = ("transformers", "litgpt")
#: Data-parallel memory layouts (memguard_core/estimator/sharding.py says what each divides and adds).
DEVICES = ("cpu", "cuda", "mlx", "mps")
ATTN_IMPLS = ("eager", "sdpa", "flash")


class PeftDefaultTargets(tuple):
    """The LoRA targets of a ``TrainSpec`` built without ``lora_targets``: read as ``q_proj, v_proj``
    until :func:`with_default_lora_targets` replaces them by PEFT's default for the model type.
    Unequal to the same names given explicitly, so specs that resolve differently never compare
    (or hash) equal."""

    __slots__ = ()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, PeftDefaultTargets) and tuple.__eq__(self, other)

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("peft-default", tuple(self)))

    def __repr__(self) -> str:
        return f"DEFAULT_LORA_TARGETS{tuple.__repr__(self)}"


#: ``TrainSpec.lora_targets`` when none are given: PEFT's default for the model type
#: (:func:`peft_default_lora_targets`) wherever the model type is known; ``q_proj, v_proj`` for
#: a spec from plain numbers or a model type PEFT has no default for.
DEFAULT_LORA_TARGETS = PeftDefaultTargets(("q_proj", "v_proj"))


@dataclass(frozen=True)
class LinearShape:
    """One linear projection inside a transformer block.

    Attributes:
        name: module name as frameworks spell it (``q_proj``, ``c_attn``, ``gate_proj``, ...).
        in_features / out_features: weight shape is ``(out_features, in_features)``.
        count: how many such modules one block holds (``num_experts`` for expert weights).
        kind: ``attention`` | ``mlp`` | ``experts`` | ``router`` | ``shared_experts``.
        bias: whether the projection has a bias vector.
        path: dotted path inside the block, expert indices removed (``self_attn.q_proj``,
            ``mlp.experts.gate_up_proj``); LoRA targets match it the way PEFT matches module
            names (equal, or a ``.``-suffix). Empty: ``name`` is used.
        is_param: a bare weight tensor rather than a module (transformers 5 fused experts,
            ``(E, out, in)``): PEFT reaches it only through ``target_parameters`` by a dotted
            name (``experts.gate_up_proj``), never through ``target_modules`` or ``all-linear``.
    """

    name: str
    in_features: int
    out_features: int
    count: int = 1
    kind: str = "attention"
    bias: bool = False
    path: str = ""
    is_param: bool = False

    @property
    def params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts by kind (elements, not bytes). Tied weights are counted once
    (``lm_head`` is 0 when the head is tied to the input embedding).

    ``attention``, ``mlp``, ``experts``, ``router`` and ``norms`` cover all blocks together;
    ``norms`` also holds the final norm; ``embeddings`` holds token (and learned position) embeddings.
    ``vision`` holds a vision-language model's vision tower and multimodal projector (everything
    outside the language model's blocks whose module path names the vision side, see
    ``_VISION_PARTS``); frozen under LoRA unless the targets reach its linears (``all-linear``, or
    names PEFT's suffix rule matches there: ``ModelSpec.vision_tower``), which then get adapters.
    """

    embeddings: int = 0
    attention: int = 0
    mlp: int = 0
    experts: int = 0
    router: int = 0
    norms: int = 0
    lm_head: int = 0
    other: int = 0
    vision: int = 0

    # norms of the blocks only (a subset of ``norms``, without the final norm)
    norms_in_blocks: int = 0

    @property
    def total(self) -> int:
        return (self.embeddings + self.attention + self.mlp + self.experts + self.router
                + self.norms + self.lm_head + self.other + self.vision)

    @property
    def blocks(self) -> int:
        """Parameters inside the transformer blocks (what mlx_lm's full fine-tune trains)."""
        return self.attention + self.mlp + self.experts + self.router + self.norms_in_blocks

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("norms_in_blocks")
        return d


@dataclass(frozen=True)
class VisionTower:
    """The vision tower (ViT) and projector of a vision-language model, as the estimator needs them
    when LoRA reaches their linears (:func:`vision_tower_from_config`).

    Attributes:
        model_type: the VLM's ``model_type`` (the family whose modeling file the rules follow).
        hidden_size / intermediate_size / num_layers / num_heads: the tower's blocks.
        patches_per_image: tokens the blocks run on per image, all tiles together, before any merger
            or pixel shuffle, at the image size :func:`image_tokens_per_image` assumes.
        projector_tokens: tokens the projector's linears run on per image (after a merger / pixel
            shuffle / pooling).
        norm: ``layernorm`` | ``rmsnorm`` (the blocks' pre-norms).
        act: the MLP's activation: ``quick_gelu`` | ``gelu`` (exact or tanh) | ``silu_gated``.
        block_linears: the linears of ONE block, ``path`` relative to the block (``attn.qkv``,
            ``self_attn.q_proj``, ``mlp.fc1``).
        projector_linears: the projector's linears (``path`` from the VLM's vision-side module name:
            ``merger.mlp.0``, ``multi_modal_projector.linear_1``), ``in_features`` per projector token.
        projector_norm: features of the norm ahead of the projector's first linear, per projector
            token (Qwen2-VL's ``ln_q``; 0: none).
        projector_act: features of the activation between the projector's two linears (0: none).
        extra_patch_features: further hidden-sized tensors per patch the tower saves outside its
            blocks once they need a gradient (a final ``post_layernorm``, Gemma-3's average pool).
        unused_linears: linears PEFT wraps whose output never reaches the loss (a SigLIP pooling
            ``head`` with ``vision_use_head``): adapters, no activations.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patches_per_image: int
    projector_tokens: int
    norm: str = "layernorm"
    act: str = "gelu"
    block_linears: tuple = ()
    projector_linears: tuple = ()
    projector_norm: int = 0
    projector_act: int = 0
    extra_patch_features: int = 0
    unused_linears: tuple = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // max(self.num_heads, 1)


@dataclass(frozen=True)
class BlockKind:
    """One kind of block in the model's block list, read from its own module tree
    (``memguard_torch.block_kinds``): docs/estimator.md, "Block kinds".

    Attributes:
        name: what the block holds beyond linears and norms, as its code names it: the class of the
            token mixer that sets it apart (``Mamba2Mixer``, ``Lfm2ShortConv``), else the block's
            own class (``LlamaDecoderLayer``).
        count: blocks of this kind.
        modelled: True when every module in the block is of a kind the estimator's rules count
            (linears, norms, attention, MLPs, experts, routers, dropout, activations); False for a
            block holding anything else (convolutions, state-space parameters, custom modules).
        saved_per_token: for a block not modelled, the bytes ONE block of this kind saves for its
            backward per token, from a census of the saved tensors of the model's own code run on
            fake tensors (``memguard_hf.block_trace``); ``None`` when it was not traced.
        traced_under: the settings the census ran under (dtype, method, LoRA targets and rank,
            attention kernel), as :func:`trace_key` spells them; the figure holds for any batch
            size and checkpointing choice under the same settings.
    """

    name: str
    count: int
    modelled: bool = True
    saved_per_token: Optional[float] = None
    traced_under: str = ""


def trace_key(ts: "TrainSpec") -> str:
    """The training settings a block census depends on (not the batch size or checkpointing,
    which scale or replace what it measured): dtype, autocast, method, LoRA rank / targets /
    dropout, attention kernel, device rule."""
    lora = "" if ts.method == "full" else f" r{ts.lora_rank} {','.join(ts.lora_targets)} p{ts.lora_dropout:g}"
    return (f"{ts.dtype}{' amp' if ts.mixed_precision else ''} {ts.method}{lora} "
            f"{ts.attn_impl} {ts.device}")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as the memory estimator needs it.

    Attributes:
        name: free-form label (model id or config path).
        model_type: HF ``model_type`` (``llama``, ``gpt2``, ``qwen2``, ``mixtral``, ...).
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim:
            the usual config numbers (``num_kv_heads < num_heads`` is GQA).
        num_experts / num_experts_per_tok / moe_intermediate_size: MoE routing (0 for dense).
        tie_word_embeddings: lm_head shares the input embedding.
        params: exact counts by kind (see ``ParamCounts``).
        block_linears: the linear projections of ONE block (used for LoRA sizes and LoRA
            input buffers); blocks are assumed homogeneous.
        weight_bits: storage bits of the block linear weights (32, 16, 8, 4.5 for NF4,
            4.127 for NF4 with double quantization). Embeddings, head and norms are never
            quantized and are stored in ``dense_bits``.
        dense_bits: storage bits of non-quantized weights (32 for fp32, 16 for bf16/fp16).
        trainable_params: exact count of trainable parameters when known from a live module
            (``None``: derive it from the TrainSpec).
        lora_rank_found: LoRA rank found on a live PEFT module (``None`` if none).
        adapter_params: elements of adapter tensors (LoRA A/B, DoRA magnitudes, PEFT
            ``modules_to_save`` copies) found on a live module; not part of ``params``.
        source: ``hf-config`` | ``module`` | ``numbers``.
        attention_dropout: dropout probability on the attention probabilities in training
            (config ``attention_dropout`` / ``attn_pdrop``; see ``dropout_probabilities``).
        residual_dropout: dropout probability on each sub-layer's output before the residual add
            (``resid_pdrop`` / ``hidden_dropout`` / ``residual_dropout`` / OPT's ``dropout``).
        embedding_dropout: dropout probability on the embedding output (``embd_pdrop`` /
            ``embedding_dropout``).
        attn_logit_softcapping / final_logit_softcapping: Gemma-2's ``tanh`` soft-capping of the
            attention scores / of the logits (the config's cap; 0.0 = none).
        weight_dtype: the stored dtype the source declares (``fp32`` | ``bf16`` | ``fp16``; the
            config's ``torch_dtype``, a live module's embedding dtype), ``None`` when unknown.
            For specs not read from a live module the TrainSpec decides what is counted: see
            :func:`weights_for_training`.
        max_position_embeddings: the longest sequence the positions cover (config
            ``max_position_embeddings`` / ``n_positions``; 0 when unknown).
        image_tokens: tokens one image adds to the language model's sequence for a
            vision-language model (:func:`image_tokens_per_image`; 0 for text-only models).
        vision_tower: the vision tower's numbers (:class:`VisionTower`), read from the config of a
            supported vision-language family; ``None`` for text-only models and families whose
            tower memguard does not read (Mllama).
        block_kinds: the kinds of block in the block list (:class:`BlockKind`), read from the
            model's module tree; empty for a spec from plain numbers (every block counted by the
            rules).
        head: the task head (:class:`memguard_core.estimator.heads.TaskHead`: causal / masked LM,
            sequence / token classification, question answering, seq2seq LM, its output features),
            read from the config's ``architectures`` or the live module; a causal LM by default.
        decoder_layers: an encoder-decoder's decoder blocks (T5 ``num_decoder_layers``, BART
            ``decoder_layers``); ``num_layers`` / ``block_linears`` then describe the encoder's
            blocks, which run over the source tokens (``TrainSpec.seq_length``) while the decoder's
            run over the target tokens (``TrainSpec.target_length``). 0: no decoder stack
            (decoder-only or encoder-only model).
        decoder_block_linears: the linears of ONE decoder block: self-attention, cross-attention
            (its ``path`` names the cross-attention module: T5 ``layer.1.EncDecAttention.q``, BART
            ``encoder_attn.q_proj``; its keys and values read the encoder's output, source tokens)
            and the feed-forward network. Empty without a decoder stack.
        ffn_act: an encoder-decoder's feed-forward activation as its config names it (T5
            ``dense_act_fn``: ``relu``, ``gelu_new`` for ``gated-gelu``; BART
            ``activation_function``: ``gelu``); empty otherwise.
        ffn_dropout: an encoder-decoder's dropout on the feed-forward activation's output (T5
            ``dropout_rate``, BART ``activation_dropout``); 0.0 otherwise.
        image_size / patch_size / num_channels: an image classifier's (ViT, DeiT) square input in
            pixels, its patch side in pixels and the pixel channels (config ``image_size``,
            ``patch_size``, ``num_channels``; a guarded run reads the size from ``pixel_values``);
            0 for a text model. The blocks then run on :attr:`patch_tokens` tokens per image.
        prefix_tokens: tokens an image classifier puts in front of the patch tokens (ViT's CLS: 1;
            DeiT's CLS and distillation tokens: 2; ``heads.IMAGE_FAMILIES``); 0 for a text model.
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: ParamCounts
    block_linears: tuple = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    weight_bits: float = 16.0
    dense_bits: float = 16.0
    trainable_params: Optional[int] = None
    lora_rank_found: Optional[int] = None
    source: str = "numbers"
    adapter_params: int = 0
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    weight_dtype: Optional[str] = None
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    max_position_embeddings: int = 0
    image_tokens: int = 0
    vision_tower: Optional[VisionTower] = None
    block_kinds: tuple = ()
    head: TaskHead = DEFAULT_HEAD
    decoder_layers: int = 0
    decoder_block_linears: tuple = ()
    ffn_act: str = ""
    ffn_dropout: float = 0.0
    image_size: int = 0
    patch_size: int = 0
    num_channels: int = 0
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        for f in ("image_size", "patch_size", "num_channels", "prefix_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f, "a whole number >= 0 (0: not an image classifier)", v)
        if self.image_size or self.patch_size:
            if not (self.image_size and self.patch_size and self.num_channels):
                zero = next(f for f in ("image_size", "patch_size", "num_channels") if not getattr(self, f))
                raise ConfigError(zero, "> 0 for an image classifier (image_size, patch_size and num_channels "
                                  "all set)", getattr(self, zero))
            if self.image_size < self.patch_size:
                raise ConfigError("image_size", f"at least patch_size ({self.patch_size} pixels)", self.image_size)
        n = self.decoder_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError("decoder_layers", "a whole number >= 0 (0: no decoder stack)", n)
        if n > 0:
            if self.model_type not in SEQ2SEQ_FAMILIES:
                raise ConfigError("decoder_layers", f"0 unless model_type is one of {', '.join(SEQ2SEQ_FAMILIES)}",
                                  f"{n} for model_type {self.model_type!r}")
            if not self.decoder_block_linears:
                raise ConfigError("decoder_block_linears", "the decoder block's linears when decoder_layers > 0", "()")
        p = self.ffn_dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
            raise ConfigError("ffn_dropout", "a probability p with 0 <= p < 1", p)

    @property
    def patch_tokens(self) -> int:
        """Tokens an image classifier's blocks run on per image: ``(image_size // patch_size) ** 2``
        patches (a ``patch_size``-strided convolution, ``ViTPatchEmbeddings.num_patches``) plus the
        :attr:`prefix_tokens`; 0 for a text model."""
        if not self.patch_size:
            return 0
        return (self.image_size // self.patch_size) ** 2 + self.prefix_tokens

    @property
    def is_encoder_decoder(self) -> bool:
        """An encoder-decoder (T5, BART): a decoder stack with cross-attention over the encoder."""
        return self.decoder_layers > 0

    @property
    def total_params(self) -> int:
        return self.params.total

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def unmodelled_blocks(self) -> int:
        """Blocks of a kind the rules do not count (:attr:`BlockKind.modelled` False)."""
        return sum(k.count for k in self.block_kinds if not k.modelled)

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def is_glibc_release(value: Any) -> bool:
    """True for a glibc release as ``confstr`` gives it (``"2.39"``, ``"2.40.1"``): what
    :attr:`TrainSpec.glibc` and ``memguard estimate --glibc`` accept."""
    return isinstance(value, str) and re.fullmatch(r"\d+\.\d+(\.\d+)?", value) is not None


@dataclass(frozen=True)
class TrainSpec:
    """Training settings that drive memory.

    Attributes:
        batch_size: micro-batch size (rows one forward pass sees), >= 1.
        seq_length: tokens per row (padded length), >= 1.
        grad_accum: gradient accumulation steps (effective batch = batch_size x grad_accum x world_size).
        method: ``full`` | ``lora`` | ``qlora``.
        lora_rank: LoRA rank r.
        lora_targets: module names LoRA wraps, or ``("all-linear",)``. Not given (or ``None``):
            PEFT's default for the model type (``LoraConfig(target_modules=None)``:
            :func:`peft_default_lora_targets`, gpt2 ``c_attn``, llama ``q_proj, v_proj``), applied by
            ``estimate`` / ``plan`` (:func:`with_default_lora_targets`); ``q_proj, v_proj`` for a
            model from plain numbers.
        lora_layers: LoRA on the last N blocks only (mlx_lm's ``num_layers``); ``None`` = all.
        lora_dropout: PEFT ``LoraConfig.lora_dropout``, a probability in [0, 1). With p > 0 each
            LoRA'd linear runs ``lora_A(dropout(x))``: ``lora_A`` saves the dropout's output (a
            tensor per linear) and the dropout its mask (``activations.lora_input_bytes``).
        optimizer: ``adam`` | ``adamw`` | ``sgd`` (no momentum, as HF's ``sgd``) | ``sgd-momentum`` |
            ``adafactor`` | ``adamw-8bit`` | ``paged-adamw-8bit`` | ``paged-adamw-32bit`` (bitsandbytes
            paged AdamW: the states of tensors from 1e5 elements on live in CUDA unified memory,
            outside ``torch.cuda.max_memory_allocated``). HF ``optim`` spellings are accepted
            (``paged_adamw_8bit``, ``paged_adamw_32bit``, ``adamw_8bit``, ``adamw_bnb_8bit``,
            ``adamw_torch``: :data:`OPTIMIZER_ALIASES`).
        dtype: compute dtype: ``fp32`` | ``bf16`` | ``fp16``. Without ``mixed_precision`` it is
            also the dtype the weights are stored in (pure bf16: weights created in bf16); the
            estimate counts them so for any spec not read from a live module
            (:func:`weights_for_training`).
        mixed_precision: weights kept in fp32 with autocast to ``dtype`` (HF ``bf16=True`` on fp32
            weights). False: weights are stored in ``dtype``.
        grad_checkpoint: activation (gradient) checkpointing per block.
        attn_impl: ``eager`` (O(s^2) scores kept) | ``sdpa`` | ``flash`` (O(s)).
        framework: ``hf`` | ``lightning`` | ``mlx`` | ``torch`` (whose conventions apply; ``torch`` is
            a plain PyTorch / accelerate loop: HF's without the ``Trainer``'s imports).
        device: which counter the estimate predicts: ``cpu`` (peak RSS, VmHWM), ``cuda`` (peak
            device memory incl. context), ``mlx`` (``mx.get_peak_memory()``), ``mps`` (PyTorch on
            Apple Silicon: ``torch.mps.driver_allocated_memory()``; not validated on a Mac).
        world_size: data-parallel processes (the effective batch; with ``sharding`` the shard group).
        sharding: how the ranks lay out the model state (``memguard_core.estimator.sharding``): ``none`` (one
            process, or ranks that each hold everything without DDP's buckets) | ``ddp`` |
            ``fsdp-full`` | ``fsdp-grad-op`` | ``fsdp-hybrid`` | ``fsdp-no-shard`` | ``zero1`` |
            ``zero2`` | ``zero3``. ``peak_bytes`` is then per rank.
        offload: ``none`` | ``optimizer`` (ZeRO ``offload_optimizer``) | ``params`` (FSDP
            ``CPUOffload(Policy)``, ZeRO-3 ``offload_param``; implies the optimizer's).
        shard_group_size: ranks one shard spans under ``fsdp-hybrid`` (HSDP's shard mesh dimension);
            ``None`` = ``world_size``.
        bucket_cap_mb: DDP ``bucket_cap_mb`` (MiB, default 25 as in ``DistributedDataParallel``).
        gradient_as_bucket_view: DDP ``gradient_as_bucket_view`` (``.grad`` are views of the buckets).
        fsdp_version: 2 (``fully_shard``) | 1 (``FullyShardedDataParallel``, flat parameters).
        zero_buckets: DeepSpeed bucket sizes a config sets (elements: its numbers, DeepSpeed's
            defaults for the keys it leaves out; not its "auto" ones), overriding the
            framework's values (``memguard_core.estimator.sharding.zero_buckets``): keys ``reduce``,
            ``allgather``, ``prefetch``, ``max_live``, ``persistence`` (integers >= 0) and
            ``overlap_comm`` (bool); only with ``zero1``..``zero3``. ``None`` = none set.
        resident_file_bytes: this process's file-backed resident pages (``RssFile``: mapped
            libraries) when training starts, bytes, as the adapters read it on Linux; ``None`` =
            the typical figure of :data:`memguard_core.estimator.runtime.CPU_FILE_PAGES_AT_START_BYTES`. It
            is part of VmHWM and depends on the page cache, not on the model (a freshly written
            copy of a venv reads higher): docs/estimator.md, "Runtime overhead".
        runtime_held_bytes: ``device="cpu"`` only: what this process holds when training starts
            apart from the model's tensors (its RSS less their resident bytes: interpreter,
            libraries, the heap kept from loading, data in memory), bytes, as a guarded run
            measures it (``memguard_torch.train_reading.runtime_held_kwargs``). Given, the runtime
            overhead is this figure plus the modelled growth to the step's peak, and the modelled
            terms (``resident_file_bytes`` and the ``datasets`` import included) are not used;
            ``None`` (the CLI, a plain estimate) = modelled: docs/estimator.md, "Runtime overhead".
        cublas_workspace_bytes: ``device="cuda"`` only: one matmul thread's cuBLAS + cuBLASLt
            workspaces on the run's GPU, bytes, as the torch adapter reads them
            (``memguard_torch.cublas.workspace_bytes``: the GPU's compute capability and
            ``CUBLAS_WORKSPACE_CONFIG`` / ``CUBLASLT_WORKSPACE_SIZE`` /
            ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``); the step holds two (forward and backward thread).
            ``None`` (the CLI, a plan made off the machine) = Hopper's default, the larger
            (:data:`memguard_core.estimator.cuda.CUDA_CUBLAS_WORKSPACES_BYTES`).
        image_tokens: image tokens per row of a vision-language model, on top of ``seq_length``
            (the text tokens): the language model's sequence is ``seq_length + image_tokens``
            (images per row x :attr:`ModelSpec.image_tokens`); 0 for text-only rows.
        heap_trim: ``device="cpu"`` only: True (default) for a run that hands glibc's free heap back
            to the kernel at every optimizer step's end, as memguard's guard does
            (``GuardOptions.trim_heap``, which also fixes glibc's mmap threshold for a bf16 / fp16
            mixture-of-experts model: :func:`routed_half_precision_on_cpu`); False for a plain
            run, whose later steps also keep
            resident the pages the last step's freed tensors left (under activation checkpointing
            the last step's gradients: docs/estimator.md, "Gradient checkpointing on CPU").
        glibc: ``device="cpu"`` only: the GNU C library release of the process that trains
            (``"2.39"``), whose heap decides how much of a step's freed memory stays resident:
            from 2.39 on the heap-slack factors of that release apply
            (:func:`memguard_core.estimator.cpu_heap.slack_factors`). ``None`` = not glibc or not
            known: the factors fitted on glibc 2.36. The guard passes its own process's
            (``memguard_core.probes.glibc_version``); ``memguard estimate`` this machine's.
        bnb_version: the bitsandbytes version of a QLoRA run (``"0.42.0"``); it decides whether
            each 4-bit linear keeps its input for the backward (before 0.43.2) or not
            (``memguard_core.estimator.bnb.bnb_4bit_keeps_input``). ``None`` = unknown: the older rule,
            the larger estimate. The HF adapter passes the installed version.
        keeps_last_graph: the training loop holds the last micro-batch's output (logits, loss)
            until the next forward returns -- a hand-written loop's ``logits = model(x)``
            reassigned each step -- so that step's autograd graph lives on. ``None`` = by
            framework: True for ``torch`` and for ``model_code="litgpt"`` (LitGPT's
            ``finetune/lora.py``), False for ``hf`` / ``lightning`` (their training steps hand a
            detached loss on). It matters only where the graph holds tensors the backward
            does not free (bitsandbytes before 0.43.2: ``bnb.bnb_last_step_inputs``).
        model_code: whose model code runs: ``transformers`` (transformers' modules, LoRA by PEFT;
            the default) | ``litgpt`` (LitGPT's own ``GPT`` and ``LoRAQKVLinear`` under its
            ``finetune/lora.py``: LoRA / QLoRA on the fused qkv linear, adapters in the weights'
            dtype, the head in chunks, Lightning's bitsandbytes precision quantizing every linear;
            ``memguard_core.estimator.litgpt`` says what it covers and refuses the rest).
        litgpt_version: the LitGPT release of a ``model_code="litgpt"`` run (``"0.4.13"``); from
            0.5.0 on its QLoRA swaps in a trainable ``StableEmbedding``
            (``memguard_core.estimator.litgpt.stable_embedding``). ``None`` = the current LitGPT.
        target_length: an encoder-decoder's target tokens per row (the decoder's ``labels`` /
            ``decoder_input_ids`` length, padded), >= 1; ``seq_length`` stays the source tokens
            (the encoder's ``input_ids``). ``None`` = ``seq_length`` (:attr:`decoder_tokens`).
            Ignored for a model without a decoder stack.
        collated_rows: rows of one batch as the dataloader collates it, when a guard cuts it into
            micro-batches of ``batch_size`` rows in place (``memguard_core.preflight.plan_in_place``
            sets it to the requested micro-batch): the framework still holds whole collated batches,
            which matters where a batch's inputs are large (an image classifier's pixels,
            ``image_blocks.pixel_rows``). ``None`` = ``batch_size``; at least ``batch_size``.
    """

    batch_size: int = 1
    seq_length: int = 512
    grad_accum: int = 1
    method: str = "lora"
    lora_rank: int = 8
    lora_targets: tuple = DEFAULT_LORA_TARGETS
    lora_layers: Optional[int] = None
    lora_dropout: float = 0.0
    optimizer: str = "adamw"
    dtype: str = "bf16"
    mixed_precision: bool = False
    grad_checkpoint: bool = False
    attn_impl: str = "sdpa"
    framework: str = "hf"
    device: str = "cpu"
    world_size: int = 1
    resident_file_bytes: Optional[int] = None
    runtime_held_bytes: Optional[int] = None
    cublas_workspace_bytes: Optional[int] = None
    image_tokens: int = 0
    sharding: str = "none"
    offload: str = "none"
    shard_group_size: Optional[int] = None
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    fsdp_version: int = 2
    zero_buckets: Optional[Dict[str, Any]] = dataclasses.field(default=None, hash=False)
    bnb_version: Optional[str] = None
    keeps_last_graph: Optional[bool] = None
    heap_trim: bool = True
    glibc: Optional[str] = None
    model_code: str = "transformers"
    litgpt_version: Optional[str] = None
    target_length: Optional[int] = None
    collated_rows: Optional[int] = None

    def __post_init__(self) -> None:
        require_positive_int("batch_size", self.batch_size)
        if self.target_length is not None:
            require_positive_int("target_length", self.target_length)
        cr = self.collated_rows
        if cr is not None and (isinstance(cr, bool) or not isinstance(cr, int) or cr < self.batch_size):
            raise ConfigError("collated_rows", f"None or a whole number >= batch_size ({self.batch_size})", cr)
        rf = self.resident_file_bytes
        if rf is not None and (isinstance(rf, bool) or not isinstance(rf, int) or rf < 0):
            raise ConfigError("resident_file_bytes", "an integer >= 0 (bytes) or None", rf)
        rh = self.runtime_held_bytes
        if rh is not None and (isinstance(rh, bool) or not isinstance(rh, int) or rh < 0):
            raise ConfigError("runtime_held_bytes", "an integer >= 0 (bytes) or None", rh)
        cw = self.cublas_workspace_bytes
        if cw is not None and (isinstance(cw, bool) or not isinstance(cw, int) or cw < 0):
            raise ConfigError("cublas_workspace_bytes", "an integer >= 0 (bytes) or None", cw)
        require_positive_int("seq_length", self.seq_length)
        require_positive_int("grad_accum", self.grad_accum)
        it = self.image_tokens
        if isinstance(it, bool) or not isinstance(it, int) or it < 0:
            raise ConfigError("image_tokens", "an integer >= 0 (image tokens per row)", it)
        require_positive_int("world_size", self.world_size)
        object.__setattr__(self, "method", require_choice("method", self.method, METHODS))
        object.__setattr__(self, "optimizer", require_choice("optimizer", optimizer_alias(self.optimizer), OPTIMIZERS))
        bv = self.bnb_version
        if bv is not None and not (isinstance(bv, str) and re.match(r"\s*\d+\.\d+", bv)):
            raise ConfigError("bnb_version", "a bitsandbytes version such as '0.42.0', or None", bv)
        if not isinstance(self.heap_trim, bool):
            raise ConfigError("heap_trim", "True (the guard returns the free heap at every step's end) or False",
                              self.heap_trim)
        gv = self.glibc
        if gv is not None and not is_glibc_release(gv):
            raise ConfigError("glibc", "a glibc release such as '2.39', or None (not glibc / unknown)", gv)
        lv = self.litgpt_version
        if lv is not None and not (isinstance(lv, str) and re.match(r"\s*\d+\.\d+", lv)):
            raise ConfigError("litgpt_version", "a LitGPT version such as '0.5.13', or None", lv)
        klg = self.keeps_last_graph
        if klg is not None and not isinstance(klg, bool):
            raise ConfigError("keeps_last_graph", "True, False or None (by framework)", klg)
        object.__setattr__(self, "dtype", require_choice("dtype", self.dtype, DTYPES))
        object.__setattr__(self, "attn_impl", require_choice("attn_impl", self.attn_impl, ATTN_IMPLS))
        object.__setattr__(self, "framework", require_choice("framework", self.framework, FRAMEWORKS))
        object.__setattr__(self, "model_code", require_choice("model_code", self.model_code, MODEL_CODES))
        object.__setattr__(self, "device", require_choice("device", self.device, DEVICES))
        validate_sharding(self)  # the parallel layout's fields (.layout)
        if self.method != "full":
            require_positive_int("lora_rank", self.lora_rank)
        if self.lora_layers is not None:
            require_positive_int("lora_layers", self.lora_layers)
        ld = self.lora_dropout
        if isinstance(ld, bool) or not isinstance(ld, (int, float)) or not 0.0 <= float(ld) < 1.0:
            raise ConfigError("lora_dropout", "a probability p with 0 <= p < 1 (PEFT LoraConfig.lora_dropout)", ld)
        object.__setattr__(self, "lora_dropout", float(ld))
        targets = self.lora_targets
        if isinstance(targets, PeftDefaultTargets):
            return  # PEFT's default, resolved against the model (with_default_lora_targets)
        if targets is None:  # as LoraConfig(target_modules=None)
            object.__setattr__(self, "lora_targets", DEFAULT_LORA_TARGETS)
            return
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError("lora_targets", "a non-empty list of module names or 'all-linear'",
                              self.lora_targets)
        object.__setattr__(self, "lora_targets", tuple(targets))

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step: micro-batch x accumulation x world_size."""
        return self.batch_size * self.grad_accum * self.world_size

    @property
    def rows_per_batch(self) -> int:
        """Rows of one collated batch: ``collated_rows``, ``batch_size`` when None."""
        return int(self.collated_rows or self.batch_size)

    @property
    def decoder_tokens(self) -> int:
        """An encoder-decoder's target tokens per row: ``target_length``, ``seq_length`` when None."""
        return int(self.target_length or self.seq_length)

    @property
    def paged(self) -> bool:
        """A bitsandbytes paged optimizer (:data:`PAGED_OPTIMIZERS`): its large states live in CUDA
        unified memory, outside the caching allocator's counters."""
        return self.optimizer in PAGED_OPTIMIZERS

    @property
    def last_graph_kept(self) -> bool:
        """``keeps_last_graph``, or by framework when None: a plain ``torch`` loop keeps it."""
        if self.keeps_last_graph is not None:
            return self.keeps_last_graph
        # LitGPT's finetune/lora.py writes ``logits = model(...)`` every iteration
        return self.framework == "torch" or self.model_code == "litgpt"

    def replace(self, **changes: Any) -> "TrainSpec":
        """A copy with ``changes`` (field names)."""
        return dataclasses.replace(self, **changes)


def optimizer_alias(name: Any) -> Any:
    """``name`` as :data:`OPTIMIZERS` spells it: lower case, underscores read as hyphens, HF
    ``optim`` spellings mapped (:data:`OPTIMIZER_ALIASES`: ``paged_adamw_8bit`` ->
    ``paged-adamw-8bit``, ``adamw_bnb_8bit`` -> ``adamw-8bit``); anything else is returned as
    given (``TrainSpec`` then names the choices)."""
    if not isinstance(name, str):
        return name
    n = name.strip().lower().replace("_", "-")
    n = OPTIMIZER_ALIASES.get(n, n)
    return n if n in OPTIMIZERS else name


# Storage bits of a quantized block-linear weight, including the per-block constants.
# NF4 (bitsandbytes, QLoRA): 4 bits per weight + one fp32 absmax per block of 64 weights
#   = 4 + 32/64 = 4.5.  Dettmers et al. 2023, "QLoRA", section 2 (blocksize 64).
# NF4 with double quantization: the absmax are themselves quantized to 8 bits with one fp32
#   constant per 256 of them: 4 + 8/64 + 32/(64*256) = 4.127 (QLoRA, section 2, "Double
#   Quantization": 0.127 bits per parameter).
# MLX affine quantization (mlx.nn.quantize, group_size 64, one fp16/bf16 scale and one bias per
#   group): b + 2*16/64 = b + 0.5 bits, which for b = 4 equals NF4's 4.5.
NF4_BITS = 4.5
NF4_DOUBLE_QUANT_BITS = 4.0 + 8.0 / 64 + 32.0 / (64 * 256)
GROUP64_OVERHEAD_BITS = 0.5


def dtype_bits(dtype: Any) -> Optional[float]:
    """Bits per element of a torch dtype or dtype name (``torch.bfloat16``, ``"bfloat16"``)."""
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "").strip().lower()
    return DTYPE_BITS.get(name)
