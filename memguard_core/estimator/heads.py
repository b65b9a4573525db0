"""The task head a model trains with (``ModelSpec.head``): what kind it is, how many features it
outputs and how it reads the last hidden states, and the rule naming a head from a transformers
architecture class name. The bytes each head keeps live in :mod:`.logits`.
docs/estimator.md, "Task heads".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from ..errors import ConfigError

CAUSAL_LM = "causal_lm"
MASKED_LM = "masked_lm"
SEQUENCE_CLASSIFICATION = "sequence_classification"
TOKEN_CLASSIFICATION = "token_classification"
QUESTION_ANSWERING = "question_answering"
#: An encoder-decoder's LM head (T5, BART ``*ForConditionalGeneration``): logits over the target tokens.
SEQ2SEQ_LM = "seq2seq_lm"
#: A vision transformer's classifier (``ViTForImageClassification``): ``num_labels`` logits per image,
#: read from the first (CLS) token of the patch tokens.
IMAGE_CLASSIFICATION = "image_classification"
#: The heads the estimator counts.
HEAD_KINDS = (CAUSAL_LM, MASKED_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, QUESTION_ANSWERING, SEQ2SEQ_LM,
              IMAGE_CLASSIFICATION)
#: Heads over the vocabulary (their logits are ``tokens x vocab_size``).
LM_HEADS = (CAUSAL_LM, MASKED_LM, SEQ2SEQ_LM)
#: Encoder-decoder text families whose blocks the estimator counts (``memguard_core.estimator.seq2seq_blocks``),
#: by ``model_type``: T5 (and mT5, the same modules) and BART.
SEQ2SEQ_FAMILIES = ("t5", "mt5", "bart")
#: Vision transformer families whose image classifier the estimator counts
#: (``memguard_core.estimator.image_blocks``), by ``model_type``, with the tokens each adds in front of the
#: patch tokens: ViT's CLS token (``modeling_vit.py`` ``ViTEmbeddings``); DeiT's CLS and distillation
#: tokens (``modeling_deit.py`` ``DeiTEmbeddings``).
IMAGE_FAMILIES = {"vit": 1, "deit": 2}
#: How the classifier of a sequence-classification head reads the hidden states.
#: ``all_tokens``: a linear on every position, one position's logits picked after (transformers'
#: ``GenericForSequenceClassification``: Llama, Qwen2, Mistral, GPT-2 ``score``);
#: ``first_token``: the first position's hidden state only (BERT's ``BertPooler``, RoBERTa's
#: ``RobertaClassificationHead``, DeBERTa-v2's ``ContextPooler``: ``hidden_states[:, 0]``).
READS = ("all_tokens", "first_token")

#: The transformers Auto class that builds a model with each head (transformers/models/auto/modeling_auto.py).
AUTO_CLASSES = {CAUSAL_LM: "AutoModelForCausalLM", MASKED_LM: "AutoModelForMaskedLM",
                SEQUENCE_CLASSIFICATION: "AutoModelForSequenceClassification",
                TOKEN_CLASSIFICATION: "AutoModelForTokenClassification",
                QUESTION_ANSWERING: "AutoModelForQuestionAnswering", SEQ2SEQ_LM: "AutoModelForSeq2SeqLM",
                IMAGE_CLASSIFICATION: "AutoModelForImageClassification"}

# transformers' naming convention for heads, ``<Family>For<Task>`` (models/auto/modeling_auto.py
# ``MODEL_FOR_*_MAPPING_NAMES``), longest suffix first; GPT-2 / GPT-J style ``LMHeadModel`` is causal.
_SUFFIXES = (
    ("ForSequenceClassification", SEQUENCE_CLASSIFICATION),
    ("ForTokenClassification", TOKEN_CLASSIFICATION),
    ("ForQuestionAnswering", QUESTION_ANSWERING),
    ("ForImageClassification", IMAGE_CLASSIFICATION),
    ("ForMaskedLM", MASKED_LM),
    ("ForCausalLM", CAUSAL_LM),
    ("LMHeadModel", CAUSAL_LM),
    ("ForConditionalGeneration", CAUSAL_LM),  # a vision-language decoder; an encoder-decoder's is SEQ2SEQ_LM
    ("ForImageTextToText", CAUSAL_LM),
)
# Heads transformers has that the estimator does not count (named in the one-line refusal).
_NOT_COUNTED = ("ForImageClassificationWithTeacher", "ForAudioClassification", "ForMultipleChoice", "ForSpeechSeq2Seq",
                "ForCTC", "ForPreTraining", "ForNextSentencePrediction", "ForSemanticSegmentation",
                "ForObjectDetection", "ForDepthEstimation", "ForMaskGeneration", "ForTextToSpeech",
                "ForMaskedImageModeling")

SUPPORTED = ("causal LM (*ForCausalLM, *LMHeadModel, vision-language *ForConditionalGeneration), masked LM, "
             "sequence / token classification, question answering, on a decoder-only or encoder-only model; "
             "seq2seq LM on T5, mT5, BART; image classification on ViT, DeiT")


@dataclass(frozen=True)
class TaskHead:
    """The head on top of the model's last hidden states, as the estimator needs it.

    Attributes:
        kind: one of :data:`HEAD_KINDS`.
        num_labels: output features of a classifier (``config.num_labels``; 2 for question
            answering: start and end logits); 0 for an LM head, whose outputs are the vocabulary.
        reads: for sequence classification, :data:`READS`: ``all_tokens`` (a ``score`` linear on
            every position) or ``first_token`` (a pooler / classification head on ``[:, 0]``).
        final_norm: the base model ends in a norm outside its blocks (pre-norm decoders:
            ``model.norm``, ``transformer.ln_f``); False for post-norm encoders (BERT, RoBERTa,
            DeBERTa: every block ends in its own LayerNorm).
        pooler_linear: the first-token head starts with a linear on the ``[:, 0]`` view (BERT's
            ``BertPooler.dense``, ALBERT's ``pooler``), which keeps the view -- and with it the
            whole last-hidden storage -- for its weight's gradient; False when a dropout comes
            first (RoBERTa, DeBERTa-v2), whose output is a new ``rows x hidden`` tensor.
        pooler_trains: that first linear trains under LoRA too: PEFT's ``SEQ_CLS`` task type puts
            it in ``modules_to_save`` (its name ends with ``classifier`` / ``score``: DistilBERT's
            ``pre_classifier``); False: only a full fine-tune trains it (BERT's pooler).
        transform: an LM head's hidden-sized transform before the vocabulary projection (BERT's
            ``BertPredictionHeadTransform``: dense, activation, LayerNorm); False for a bare
            ``lm_head``.
        dropout: the probability of the dropout a classifier head applies to the hidden states it
            reads (BERT's ``classifier_dropout`` / ``hidden_dropout_prob``, the decoders'
            ``GenericForTokenClassification.dropout``); 0.0 for none.
        architecture: the class the head was read from (``BertForSequenceClassification``); empty
            for the default.
        peft_saved_params: elements PEFT trains beside the adapters of a LoRA run (copies in
            ``modules_to_save``, each with its gradient and optimizer state): on a model PEFT
            wrapped, what its ``modules_to_save`` hold; from a config, what PEFT's task type puts
            there (peft/peft_model.py: ``classifier`` / ``score`` for ``SEQ_CLS`` and ``TOKEN_CLS``,
            ``qa_outputs`` for ``QUESTION_ANS``, matched as name suffixes). 0 for an LM head, for a
            kind PEFT has no task type for (image classification: ``modules_to_save`` is the user's
            choice there) and where the head was not read from a module tree.
    """

    kind: str = CAUSAL_LM
    num_labels: int = 0
    reads: str = "all_tokens"
    final_norm: bool = True
    pooler_linear: bool = False
    pooler_trains: bool = False
    transform: bool = False
    dropout: float = 0.0
    architecture: str = ""
    peft_saved_params: int = 0

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ConfigError("head", f"one of {', '.join(HEAD_KINDS)}", self.kind)
        p = self.dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) < 1.0:
            raise ConfigError("head.dropout", "a probability p with 0 <= p < 1", p)
        if self.reads not in READS:
            raise ConfigError("head.reads", " or ".join(READS), self.reads)
        n = self.num_labels
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or (n == 0 and self.kind not in LM_HEADS):
            raise ConfigError("head.num_labels", "a positive integer (classes) for a classifier head, 0 for an "
                              "LM head", n)
        k = self.peft_saved_params
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError("head.peft_saved_params", "a non-negative integer (elements)", k)

    @property
    def is_lm(self) -> bool:
        """An LM head: logits over the vocabulary."""
        return self.kind in LM_HEADS

    def out_features(self, vocab_size: int) -> int:
        """Logits per position (per row for a first-token sequence classifier): the vocabulary for
        an LM head, ``num_labels`` otherwise."""
        return int(vocab_size) if self.is_lm else int(self.num_labels)


#: The default head: every spec built without one is a causal LM, as before heads were read.
DEFAULT_HEAD = TaskHead()


def head_kind_of(architecture: str) -> Optional[str]:
    """The head kind a transformers class name names (``LlamaForSequenceClassification`` ->
    ``sequence_classification``), ``None`` for a class that names none of :data:`HEAD_KINDS`
    (a bare ``BertModel``).

    Raises:
        ConfigError: (field ``architectures``, one line) a head transformers has and the estimator
            does not count (``DeiTForImageClassificationWithTeacher``, ``BertForMultipleChoice``, ...).
    """
    name = str(architecture)
    for suffix, kind in _SUFFIXES:
        if name.endswith(suffix):
            return kind
    for suffix in _NOT_COUNTED:
        if name.endswith(suffix):
            raise ConfigError("architectures", SUPPORTED + " (--head names the head the run trains)", name)
    return None


def head_kind_from_architectures(architectures: Optional[Iterable[str]], model_type: Optional[str] = None,
                                 encoder_decoder: bool = False) -> str:
    """The head kind of a config's ``architectures`` list: the first entry that names one, causal
    LM when none does (a config without the list, or a bare ``*Model``; image classification for a
    model type of :data:`IMAGE_FAMILIES`, whose bare ``ViTModel`` has no LM head). For an encoder-decoder
    config (``is_encoder_decoder``) the head is :data:`SEQ2SEQ_LM` (``AutoModelForSeq2SeqLM``:
    ``T5ForConditionalGeneration``, ``BartForConditionalGeneration``, or no list at all) once
    :func:`check_seq2seq_family` accepts ``model_type``.

    Raises:
        ConfigError: as :func:`head_kind_of`, for the first entry naming a head not counted; as
            :func:`check_seq2seq_family` for an encoder-decoder family not counted (Whisper); as
            :func:`check_image_family` for an image classifier of a family not counted (DINOv2); for an
            encoder-decoder, an entry naming another head (``BartForSequenceClassification``).
    """
    if encoder_decoder:
        check_seq2seq_family(model_type)
        for arch in architectures or ():
            if str(arch).endswith("ForConditionalGeneration"):
                return SEQ2SEQ_LM
            if head_kind_of(arch) is not None:  # BartForSequenceClassification: not the seq2seq LM
                raise ConfigError("architectures", "*ForConditionalGeneration (the seq2seq LM head) on an "
                                  "encoder-decoder", arch)
        return SEQ2SEQ_LM
    for arch in architectures or ():
        kind = head_kind_of(arch)
        if kind is not None:
            if kind == IMAGE_CLASSIFICATION:
                check_image_family(model_type)
            return kind
    return IMAGE_CLASSIFICATION if str(model_type) in IMAGE_FAMILIES else CAUSAL_LM


def check_image_family(model_type: Optional[str]) -> int:
    """Accept an image classifier's ``model_type`` whose blocks the estimator counts
    (:data:`IMAGE_FAMILIES`) and return the tokens it puts in front of the patch tokens (1: ViT's
    CLS; 2: DeiT's CLS and distillation tokens).

    Raises:
        ConfigError: (field ``model_type``, one line naming what is supported) any other vision
            family: DINOv2 (its ``Dinov2LayerScale`` multiplies save tensors the ViT rule has not,
            and its head reads the CLS token and the patch mean), Swin, BEiT, ConvNeXt, ...
    """
    if str(model_type) not in IMAGE_FAMILIES:
        raise ConfigError("model_type", "an image classifier of a family memguard counts ("
                          + ", ".join(IMAGE_FAMILIES) + ")", f"{model_type} (image classification)")
    return IMAGE_FAMILIES[str(model_type)]


def check_seq2seq_family(model_type: Optional[str]) -> None:
    """Accept an encoder-decoder ``model_type`` whose blocks the estimator counts
    (:data:`SEQ2SEQ_FAMILIES`).

    Raises:
        ConfigError: (field ``model_type``, one line naming what is supported) any other
            encoder-decoder: speech (Whisper, Speech2Text), Pegasus, Marian, LED, ...
    """
    if str(model_type) not in SEQ2SEQ_FAMILIES:
        raise ConfigError("model_type", "an encoder-decoder of a family memguard counts ("
                          + ", ".join(SEQ2SEQ_FAMILIES) + "), or " + SUPPORTED.split("; seq2seq")[0],
                          f"{model_type} (encoder-decoder)")


def parse_head(value: str) -> str:
    """A head kind as a user spells it (``--head sequence-classification``, ``seq_cls``).

    Raises:
        ConfigError: (field ``head``) anything else, naming the choices.
    """
    v = str(value).strip().lower().replace("-", "_")
    v = {"seq_cls": SEQUENCE_CLASSIFICATION, "token_cls": TOKEN_CLASSIFICATION, "qa": QUESTION_ANSWERING,
         "mlm": MASKED_LM, "clm": CAUSAL_LM, "seq2seq": SEQ2SEQ_LM, "image_cls": IMAGE_CLASSIFICATION}.get(v, v)
    if v not in HEAD_KINDS:
        raise ConfigError("head", f"one of {', '.join(HEAD_KINDS)}", value)
    return v


def head_of(model_spec) -> TaskHead:
    """``model_spec.head`` as a :class:`TaskHead`: the default causal LM for a spec without one
    (``None``), and rebuilt from its ``dataclasses.asdict`` form for a spec read back from a
    record (a dict).

    Raises:
        ConfigError: (field ``head``) anything else.
    """
    h = getattr(model_spec, "head", None)
    if h is None:
        return DEFAULT_HEAD
    if isinstance(h, TaskHead):
        return h
    if isinstance(h, dict):
        return TaskHead(**h)
    raise ConfigError("head", "a memguard_core.estimator.heads.TaskHead", type(h).__name__)
