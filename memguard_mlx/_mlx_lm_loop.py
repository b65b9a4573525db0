"""Code copied from mlx-lm 0.32.2, file ``mlx_lm/tuner/trainer.py``, function ``train()``
(Copyright © 2024 Apple Inc., MIT License), cut where memguard needs to act and nothing else.

:func:`compile_halves` is upstream's ``step`` in two compiled halves (gradient, update);
:func:`train_loop` is upstream's loop with hooks for what happens to one batch, evaluation,
reports and a resumed start (``memguard_mlx.trainer``). Why a copy and not a wrapper, and what
differs from upstream: docs/mlx.md, "How one batch runs". ``memguard_mlx._compat`` names the
private names used here; ``integration_tests/test_mlx_train.py`` compares the loop with upstream.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten, tree_map

from . import _compat

#: ``run_batch(batch, prev_grad, do_update, it) -> (loss, ntoks, grad_accum)``: one batch's part
#: of upstream's ``step`` (grad_accum None after an update).
RunBatch = Callable[[Any, Any, bool, int], Tuple[Any, Any, Any]]


def compile_halves(model: Any, optimizer: Any, loss_value_and_grad: Callable, grad_accum_steps: int
                   ) -> Tuple[List[Any], Callable, Callable]:
    """``(state, grad_step, update_step)``: upstream's compiled ``step`` in two halves.

    ``grad_step(batch) -> (lvalue, toks, grad)``; ``update_step(grad, scale, prev_grad, do_update)
    -> grad_accum``: ``grad / scale`` (a weight sum, None for an unsplit batch), plus ``prev_grad``,
    then on ``do_update`` averaged over ranks, divided by ``grad_accum_steps`` and applied (None
    returned). ``state`` is upstream's compile state ``[model.state, optimizer.state,
    mx.random.state]``.
    """
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def grad_step(batch):
        (lvalue, toks), grad = loss_value_and_grad(model, *batch)
        return lvalue, toks, grad

    @partial(mx.compile, inputs=state, outputs=state)
    def update_step(grad, scale, prev_grad, do_update):
        if scale is not None:
            grad = tree_map(lambda g: g / scale.astype(g.dtype), grad)
        if prev_grad is not None:
            grad = tree_map(lambda x, y: x + y, grad, prev_grad)
        if do_update:
            grad = average_gradients(grad)
            if grad_accum_steps > 1:
                grad = tree_map(lambda x: x / grad_accum_steps, grad)
            optimizer.update(model, grad)
            grad = None
        return grad

    return state, grad_step, update_step


def train_loop(model: Any, optimizer: Any, train_dataset: Any, val_dataset: Any, args: Any, loss: Callable,
               iterate_batches: Callable, training_callback: Any, *, state: List[Any], run_batch: RunBatch,
               world: Any, on_update: Optional[Callable[[int], None]] = None,
               peak_memory: Callable[[], int] = mx.get_peak_memory,
               report_extra: Optional[Callable[[Any, int, int], None]] = None,
               report_figures: Optional[Callable[[], dict]] = None,
               evaluate: Optional[Callable[..., float]] = None, first_iteration: int = 1,
               save_metadata: Optional[Callable[[int], Optional[Dict[str, str]]]] = None) -> int:
    """Upstream ``train()``'s loop from ``model.train()`` to the final adapter save, with the hooks
    of the module doc (``save_metadata(it)``: the string metadata of the numbered adapter save of
    iteration ``it``, None: none). Returns the last iteration reached (0 before the first batch)."""
    world_size = world.size()
    rank = world.rank()
    grad_accum_steps = args.grad_accumulation_steps

    model.train()
    losses = 0
    n_tokens = 0
    steps = 0
    trained_tokens = 0
    train_time = 0
    grad_accum = None
    it = 0

    ui = _compat.TrainUI(args.iters, rank=rank)
    with ui:
        for it, batch in zip(
            range(first_iteration, args.iters + 1),
            iterate_batches(
                dataset=train_dataset,
                batch_size=args.batch_size,
                max_seq_length=args.max_seq_length,
                loop=True,
                comm_group=world,
            ),
        ):
            tic = time.perf_counter()
            if val_dataset and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
                if args.val_batches == -1:
                    val_total = len(val_dataset) // args.batch_size
                else:
                    val_total = min(len(val_dataset) // args.batch_size, args.val_batches)
                tic = time.perf_counter()
                with ui.val_task(val_total) as advance_val:
                    val_loss = (evaluate or _compat.evaluate)(
                        model=model,
                        dataset=val_dataset,
                        loss=loss,
                        batch_size=args.batch_size,
                        num_batches=args.val_batches,
                        max_seq_length=args.max_seq_length,
                        iterate_batches=iterate_batches,
                        progress_callback=advance_val,
                    )
                model.train()
                val_time = time.perf_counter() - tic
                ui.report_val(it, val_loss, val_time)
                if training_callback is not None:
                    training_callback.on_val_loss_report(
                        {"iteration": it - 1, "val_loss": val_loss, "val_time": val_time})
                tic = time.perf_counter()

            do_update = it % grad_accum_steps == 0
            lvalue, toks, grad_accum = run_batch(batch, grad_accum, do_update, it)

            losses += lvalue
            n_tokens += toks
            steps += 1
            mx.eval(state, losses, n_tokens, grad_accum)
            _compat.clear_cache(args.clear_cache_threshold)
            train_time += time.perf_counter() - tic
            if do_update and on_update is not None:
                on_update(it)

            ui.advance()

            if it % args.steps_per_report == 0 or it == args.iters:
                train_loss = mx.distributed.all_sum(losses, stream=mx.cpu).item()
                train_loss /= steps * world_size
                n_tokens = mx.distributed.all_sum(n_tokens, stream=mx.cpu).item()
                learning_rate = optimizer.learning_rate.item()
                it_sec = args.steps_per_report / train_time
                tokens_sec = float(n_tokens) / train_time
                trained_tokens += n_tokens
                peak_mem = peak_memory() / 1e9
                ui.report_train(it, train_loss, tokens_sec, trained_tokens)
                if report_extra is not None:
                    report_extra(ui, it, rank)
                if training_callback is not None:
                    training_callback.on_train_loss_report(
                        {
                            "iteration": it,
                            "train_loss": train_loss,
                            "learning_rate": learning_rate,
                            "iterations_per_second": it_sec,
                            "tokens_per_second": tokens_sec,
                            "trained_tokens": trained_tokens,
                            "peak_memory": peak_mem,
                            # memguard: the guard's per-step figures (extra keys; None: upstream's dict)
                            **(report_figures() if report_figures is not None else {}),
                        }
                    )
                losses = 0
                n_tokens = 0
                steps = 0
                train_time = 0

            if it % args.steps_per_save == 0 and rank == 0:
                adapter_weights = dict(tree_flatten(model.trainable_parameters()))
                mx.save_safetensors(str(args.adapter_file), adapter_weights)
                checkpoint = Path(args.adapter_file).parent / f"{it:07d}_adapters.safetensors"
                # memguard: the guard's state in the numbered save's metadata
                mx.save_safetensors(str(checkpoint), adapter_weights,
                                    metadata=save_metadata(it) if save_metadata is not None else None)
                ui.report_save(checkpoint)

    if rank == 0:
        adapter_weights = dict(tree_flatten(model.trainable_parameters()))
        mx.save_safetensors(str(args.adapter_file), adapter_weights)
    return it
