"""What a LoRA'd block's adapter path allocates for its inputs, kept for the backward or freed
(``memguard_core.estimator.activations.adapter_input_bytes``, which ``cpu_heap.activation_traffic``
uses), checked against a census of a real PEFT block: every tensor the adapter path and autocast
allocate inside the block's linears (a ``TorchDispatchMode`` over one forward), split by whether
autograd packed it (``torch.autograd.graph.saved_tensors_hooks``); and the block's whole saved set
against ``block_act_per_token`` with and without checkpointing. docs/estimator.md, "LoRA input
copies and the heap"."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from memguard_core.estimator import activations as A  # noqa: E402
from memguard_core.estimator.cpu_heap import activation_traffic  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_torch.module_spec import model_spec_from_module  # noqa: E402

TOKENS = 256


def _peft_llama(dtype, p: float, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)
    cfg._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(LlamaForCausalLM(cfg).to(dtype),
                               LoraConfig(r=8, lora_alpha=16, lora_dropout=p, target_modules=targets))
    return model.train()


class _Census(TorchDispatchMode):
    """Records, inside the second decoder block, the tensors allocated for a linear's input: casts
    made by PEFT's wrapper of its own input (``_cast_input_dtype``), by autocast inside the base
    linear or ``lora_A`` (of the input, not of the weight), and everything the LoRA dropout
    allocates (noise, output). Holds them, so no storage address is reused while the census runs."""

    def __init__(self, model):
        super().__init__()
        from peft.tuners.lora.layer import Linear as LoraLinear

        self.stack, self.on, self.inputs, self.found, self.weight_casts = [], False, [], {}, set()
        layer = model.base_model.model.model.layers[1]
        layer.register_forward_pre_hook(lambda *a: setattr(self, "on", True))
        layer.register_forward_hook(lambda *a: setattr(self, "on", False))
        roles = {}
        for mod in layer.modules():
            if isinstance(mod, LoraLinear):
                roles[mod] = "wrapper"
                roles.update({m: "lora_A" for m in mod.lora_A.values()})
                roles.update({m: "dropout" for m in mod.lora_dropout.values()})
            elif isinstance(mod, torch.nn.Linear):
                roles.setdefault(mod, "base")  # a frozen linear, or the base layer of a wrapper
        for m, role in roles.items():
            m.register_forward_pre_hook(lambda mm, args, role=role: self._enter(role, args))
            m.register_forward_hook(self._leave)

    def _leave(self, *args):
        self.stack.pop()

    def _enter(self, role, args):
        self.stack.append((role, args[0] if args else None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (self.on and self.stack):
            return out
        role, x = self.stack[-1]
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.nn.Parameter):
            self.inputs.append(out)
            self.weight_casts.add(out.untyped_storage().data_ptr())
        # a cast of an activation; autocast's casts of the weights are the weight-copies term's
        cast = func is torch.ops.aten._to_copy.default and not isinstance(args[0], torch.nn.Parameter)
        keep = (role == "dropout" or (cast and role in ("base", "lora_A"))
                or (cast and role == "wrapper" and x is not None and args[0] is x))
        if keep and isinstance(out, torch.Tensor):
            self.inputs.append(out)
            st = out.untyped_storage()
            self.found[st.data_ptr()] = st.nbytes()
        return out


def _census(model, amp: bool):
    """(kept, freed, saved): bytes per token of the input-path tensors of block 1 that autograd
    packed and that it did not, and every storage packed inside block 1 (parameters, autocast's
    weight casts and the rotary tables all blocks share excluded)."""
    census = _Census(model)
    layer = model.base_model.model.model.layers[1]
    inside = {"on": False}
    shared = set()  # the rotary cos / sin every block reads: the model's, not the block's

    def enter(mod, args, kwargs):
        inside.update(on=True)
        shared.update(t.untyped_storage().data_ptr() for t in kwargs.get("position_embeddings") or ())

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.register_forward_hook(lambda *a: inside.update(on=False))
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    packed = {}

    def pack(t):
        st = t.untyped_storage()
        if inside["on"] and st.data_ptr() not in params:
            packed[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 512, (1, TOKENS))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), census:
            model(input_ids=ids)
    kept = sum(n for p, n in census.found.items() if p in packed)
    freed = sum(n for p, n in census.found.items() if p not in packed)
    # autocast's weight copies are their own term
    saved = sum(n for p, n in packed.items() if p not in census.weight_casts and p not in shared)
    return kept / TOKENS, freed / TOKENS, saved / TOKENS


CASES = [  # (weights, compute dtype name, autocast, lora_dropout, targets)
    (torch.float32, "fp32", False, 0.0, "all-linear"),
    (torch.float32, "fp32", False, 0.1, "all-linear"),
    (torch.bfloat16, "bf16", False, 0.0, "all-linear"),
    (torch.bfloat16, "bf16", False, 0.1, "all-linear"),
    (torch.float32, "bf16", True, 0.0, "all-linear"),
    (torch.float32, "bf16", True, 0.0, ["q_proj", "v_proj"]),
    (torch.float32, "bf16", True, 0.1, ["q_proj", "v_proj"]),
]


@pytest.mark.parametrize("wdtype,name,amp,p,targets", CASES)
def test_adapter_input_tensors_match_a_real_block(wdtype, name, amp, p, targets):
    model = _peft_llama(wdtype, p, targets)
    ms = model_spec_from_module(model)
    tgt = ("all-linear",) if targets == "all-linear" else tuple(targets)
    ts = TrainSpec(batch_size=1, seq_length=TOKENS, method="lora", lora_rank=8, lora_targets=tgt,
                   lora_dropout=p, dtype=name, mixed_precision=amp)
    kept, freed = A.adapter_input_bytes(ms, ts)
    got_kept, got_freed, saved = _census(model, amp)
    assert kept == pytest.approx(got_kept, abs=1.0), (kept, got_kept)
    assert freed == pytest.approx(got_freed, abs=1.0), (freed, got_freed)
    # the kept copies are part of what the block saves, which the block rule counts as a whole (it
    # counts ~1 KiB per token more than this fp32 block keeps, ~6 %: not a term of this split)
    a = A.block_act_per_token_modules(ms, ts, lora=True, trainable_block=False)
    assert a.hidden + a.scores + a.lora == pytest.approx(saved, rel=0.06)
    assert got_kept <= saved


def test_only_the_copies_glibc_mmaps_leave_the_heap_traffic():
    from memguard_core.estimator.cpu_heap import MMAP_THRESHOLD_MAX

    model = _peft_llama(torch.bfloat16, 0.0, "all-linear")
    ms = model_spec_from_module(model)
    base = TrainSpec(batch_size=1, seq_length=TOKENS, method="lora", lora_rank=8, lora_targets=("all-linear",),
                     dtype="bf16")
    # a half base keeps one fp32 copy per LoRA'd linear: 6 linears read 256 features, down_proj 640
    assert A.adapter_input_bytes(ms, base) == (4 * (6 * 256 + 640), 0.0)
    # 256 tokens: every copy is a heap chunk, the traffic is the saved set
    h, sc, lo, _ = A.activation_bytes(ms, base)
    assert activation_traffic(ms, base) == h + sc + lo
    # 4 x 4096 tokens: down_proj's copy (640 x 4 B x 16,384 = 40 MiB) is mmapped, the others
    # (256 x 4 B x 16,384 = 16 MiB) are not
    big = base.replace(batch_size=4, seq_length=4096)
    tokens = 4 * 4096
    assert 640 * 4 * tokens >= MMAP_THRESHOLD_MAX > 256 * 4 * tokens
    h, sc, lo, _ = A.activation_bytes(ms, big)
    assert activation_traffic(ms, big) == h + sc + lo - 2 * 640 * 4 * tokens   # 2 LoRA'd blocks
    # fp32 weights: lora_A saves the block's own tensor, no copy to leave out
    assert A.adapter_input_bytes(ms, big.replace(dtype="fp32")) == (0.0, 0.0)
    # a full fine-tune's linears save their inputs as trained weights do: no adapter path
    assert A.adapter_input_bytes(ms, base.replace(method="full")) == (0.0, 0.0)
