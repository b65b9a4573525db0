"""What ``memguard estimate --trace`` measures: :class:`TraceResult` (one traced training step's live
tensor bytes by stage, category and module) and the stages of the step (docs/estimator.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

__all__ = ["TraceResult", "ModuleRow", "STAGES", "MOMENT_STAGES", "CATEGORY"]

#: The stages of the traced step, in order:
#:   ``forward``       from the first op until the decoder stack (``model.base_model``) returns;
#:   ``loss``          the head, the loss, and the backward until the gradient of the head's output
#:                     (the logits) is ready: the logits' working set;
#:   ``backward``      the head's backward and the blocks' down to the lowest block the backward
#:                     reaches (exclusive): the saved activations are released block by block;
#:   ``backward_end``  that lowest block's backward, the embeddings' and the last gradient
#:                     accumulations: the end of the backward, where all gradients are held;
#:   ``optimizer``     ``optimizer.step()``.
#: The analytic ``loss`` moment (end of the forward / start of the backward) covers ``forward`` and
#: ``loss``, its ``backward`` moment (end of the backward) ``backward_end``, its ``optimizer``
#: moment ``optimizer``; nothing analytic corresponds to the ``backward`` stage alone.
STAGES = ("forward", "loss", "backward", "backward_end", "optimizer")

#: analytic moment -> the traced stages it covers
MOMENT_STAGES = {"loss": ("forward", "loss"), "backward": ("backward_end",), "optimizer": ("optimizer",)}

#: MemTracker reference type value -> the trace's category name
CATEGORY = {"Parameter": "weights", "Buffer": "buffers", "Gradient": "gradients",
            "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer_states",
            "Other": "inputs"}


@dataclass(frozen=True)
class ModuleRow:
    """One module's share of the traced step (bytes).

    Attributes:
        name: the module's qualified name in the model as traced (PEFT-wrapped names included);
            the root model is its class name.
        activation_bytes: bytes of the tensors this module's own code created in the forward (not
            its children's) that are still alive at the end of the forward (saved for the backward,
            or held as outputs).
        param_bytes: bytes of the module's parameters (its children's included), as MemTracker
            counts them.
        forward_peak_bytes: how far the live bytes rose above their level at the module's first
            forward call, during that call (MemTracker's ``Peak-Forward`` minus ``Pre-Forward``).
        backward_peak_bytes: the same for its backward (``Peak-Backward`` minus ``Pre-Backward``);
            0 when its backward was not tracked.
    """

    name: str
    activation_bytes: int
    param_bytes: int = 0
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0


@dataclass(frozen=True)
class TraceResult:
    """A traced training step. All sizes in bytes.

    Attributes:
        peak_bytes: peak of the live tensor bytes over the step (every category, the batch included).
        peak_phase: the stage of that peak (one of :data:`STAGES`).
        at_peak: category -> bytes at that peak: ``weights``, ``buffers``, ``gradients``,
            ``optimizer_states`` (with the optimizer's temporaries while it steps),
            ``activations`` (created in the forward or a recompute), ``temporaries`` (created in
            the backward), ``inputs`` (the batch).
        category_peaks: category -> the largest value the category reached (at any moment).
        phase_peaks: stage -> the peak of the live bytes within it.
        phase_breakdowns: stage -> the categories at that stage's peak.
        terms: the terms comparable with the analytic breakdown:
            ``weights`` (parameters), ``buffers``, ``gradients`` (all ``.grad`` after the
            backward), ``optimizer_states`` (before the step), ``optimizer_temporaries`` (the
            step's rise above its states), ``weight_copies`` (autocast's weight casts alive at
            the end of the forward), ``activations`` (tensors created in the forward up to the
            end of the decoder stack that are alive when the loss is returned: the blocks' saved
            tensors, the final norm's, under checkpointing each block's input), ``logits`` (peak
            of the tensors created by the head and the loss, forward and backward, until the
            gradient of the logits is ready: the ``loss`` stage), ``backward_working_set``
            (activations and temporaries at the ``backward_end`` stage's peak), ``inputs``.
        modules: per-module rows, the ``top_modules`` largest by ``activation_bytes``.
        seconds: wall time of reading the config, the build and the step (the imports of torch,
            transformers and peft excluded).
        build_seconds: of it, building the model, the adapters and the optimizer states.
        settings: what ran: model class, weights dtype, autocast dtype, attention and experts
            implementations, optimizer class, LoRA targets, checkpointing, batch shape.
        process_peak_rss_bytes: the process's own peak resident set size after the trace, bytes
            (VmHWM on Linux, :func:`memguard_core.process_peak.process_peak_rss_bytes`; ``ru_maxrss``
            where that cannot be read), for checking that nothing of model size was allocated.
        notes: assumptions that applied.
    """

    peak_bytes: int
    peak_phase: str
    at_peak: Dict[str, int]
    category_peaks: Dict[str, int]
    phase_peaks: Dict[str, int]
    phase_breakdowns: Dict[str, Dict[str, int]]
    terms: Dict[str, int]
    modules: List[ModuleRow]
    seconds: float
    build_seconds: float
    settings: Dict[str, Any] = field(default_factory=dict)
    process_peak_rss_bytes: int = 0
    notes: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-safe dict of every field (bytes as ints; ``modules`` as a list of dicts)."""
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d
