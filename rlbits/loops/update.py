"""The update engine: every loop's optimizer steps, written once.

A loop supplies an **objective** ``objective(state, micro, cfg, den) -> (loss, stats)``: the forward pass
of its models on one microbatch and the loss, one expression over the global ``Denominators`` ``den``.
``optimize`` does the rest (docs/design.md, "The update engine")::

    for each of `epochs` passes:
        minibatches (whole groups, shuffled by `shuffle`; or the batch as it is)
        for each minibatch:
            den = global token / sequence / row counts of the minibatch, over all ranks
            with cfg.balance_batch: rows moved between ranks, about equal tokens on each
            for each microbatch (as many on every rank): cfg.microbatch_size rows, or rows balanced by
                    length within cfg.max_tokens_per_microbatch tokens
                loss, stats = objective(state, micro, cfg, den)      under autocast; packed with
                                                                       cfg.pack_sequences
                a non-finite loss on any rank -> NonFiniteError on every rank
                loss.backward()
            clip each model's gradient norm (cfg.max_grad_norm); a non-finite norm -> NonFiniteError
            step every optimizer (at its Trained.lr rate, when it has a schedule)

A loss divided by the global denominators makes the microbatches' gradients add up to the minibatch's, on
one rank or N. On a ``NonFiniteError`` (its message names the step, the phase and the values) every
gradient is zeroed and no optimizer steps; ``Run`` then stops or skips the step (``on_nonfinite``).

Statistics: each value of ``stats`` says how it is reduced (``log_stats``).

Packed updates (``cfg.pack_sequences``): each objective runs inside ``rlbits.models.forward.packed_sequences``,
so its ``policy_logprobs`` and ``critic_values`` concatenate the microbatch's rows into one row without
padding and scatter the results back to [b, R]: the objectives and losses are unchanged (docs/design.md,
"Packed updates").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from rlbits.batch import split_microbatches, split_microbatches_by_tokens, split_minibatches
from rlbits.distributed.balance import balance_rows
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import grad_norm_and_clip
from rlbits.distributed.reduce import all_reduce_max, all_reduce_sum, any_rank
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.run import NonFiniteError
from rlbits.loops.runtime import autocast
from rlbits.models.forward import packed_sequences

MASKS = ("action_mask", "loss_mask")
"""The loss masks a padding microbatch (``pad_microbatches``) has all False."""


@dataclasses.dataclass(frozen=True)
class Denominators:
    """The global counts of one minibatch (all ranks' rows), the denominators of its losses.

    ``num_tokens`` and ``num_seqs`` count the True entries of the update's mask and the rows with at least
    one (both at least 1); ``num_rows`` counts rows. 0-dim float32 tensors on the batch's device."""

    num_tokens: torch.Tensor
    num_seqs: torch.Tensor
    num_rows: torch.Tensor

    def agg(self, loss_agg: str, loss_scale_factor: float | None = None) -> dict[str, Any]:
        """The keywords of ``rlbits.aggregate_loss`` (and the losses built on it) for ``loss_agg``.

        ``seq-mean-token-sum-norm`` with a ``loss_scale_factor`` is passed as ``seq-mean-token-sum`` over
        ``num_seqs * loss_scale_factor`` rows (the same value: the losses take no factor of their own);
        without one, each loss divides by its tensors' width R (verl's default)."""
        if loss_agg == "seq-mean-token-sum-norm" and loss_scale_factor is not None:
            num_seqs = self.num_seqs * loss_scale_factor
            return {"agg": "seq-mean-token-sum", "num_tokens": self.num_tokens, "num_seqs": num_seqs}
        return {"agg": loss_agg, "num_tokens": self.num_tokens, "num_seqs": self.num_seqs}

    def share(self, mask: torch.Tensor) -> torch.Tensor:
        """This microbatch's weight in a token mean over the minibatch: ``mask.sum() / num_tokens``."""
        return mask.sum() / self.num_tokens


@dataclasses.dataclass(frozen=True)
class Trained:
    """A model the update trains: its optimizer, the metric its gradient norm (before clipping) is logged as,
    and its learning-rate schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    grad_norm: str = "grad_norm"
    lr: Callable[[int], float] | None = None
    """``lr(u)``: the rate of this training step's ``u``-th optimizer step (0-based), set on every parameter
    group just before it (``rlbits.loops.optim.lr_schedule``) and logged as ``lr_metric`` (mean over the step's
    optimizer steps); None leaves the optimizer's rate as it is and logs nothing."""
    lr_metric: str = "lr"


Objective = Callable[[Any, TensorDictBase, Any, Denominators], tuple[torch.Tensor, dict[str, Any]]]
"""``objective(state, micro, cfg, den) -> (loss, stats)``: a 0-dim loss with gradients, statistics."""


def denominators(minibatch: TensorDictBase, mask: str | None, env: DistEnv) -> Denominators:
    """The global counts of ``minibatch`` (one all-reduce). ``mask``: the key of its [B, T] bool loss
    mask; None counts every row as one token and one sequence."""
    rows = torch.tensor(float(minibatch.batch_size[0]), device=env.device)
    if mask is None:
        counts = rows.repeat(3)
    else:
        m = minibatch[mask]
        counts = torch.stack([m.sum().float(), m.any(-1).sum().float(), rows.to(m.device)])
    tokens, seqs, rows = all_reduce_sum(counts, env).unbind()
    return Denominators(num_tokens=tokens.clamp(min=1), num_seqs=seqs.clamp(min=1), num_rows=rows)


def microbatches(
    minibatch: TensorDictBase, cfg: Any, env: DistEnv
) -> tuple[list[TensorDictBase], list[torch.Tensor] | None]:
    """This rank's microbatches of ``minibatch`` and the rows of each (None: consecutive slices in order).

    ``cfg.max_tokens_per_microbatch`` None: slices of ``cfg.microbatch_size`` rows (``split_microbatches``).
    Else rows balanced by length under that token budget (``split_microbatches_by_tokens``; packed: real
    tokens, with ``cfg.pack_sequences``; padded: rows x longest row, without), at least as many as the
    rank needing the most (one all-reduce: every rank's microbatches get about the same tokens). Every
    rank must call it. The losses' denominators do not depend on the split (``denominators``).
    """
    budget, pack = getattr(cfg, "max_tokens_per_microbatch", None), getattr(cfg, "pack_sequences", False)
    if budget is None:
        return split_microbatches(minibatch, cfg.microbatch_size), None
    count = 1
    if pack and env.world_size > 1 and "attention_mask" in minibatch.keys():
        tokens = minibatch["attention_mask"].sum()
        count = int(all_reduce_max(torch.ceil(tokens.float() / budget), env).item())
    return split_microbatches_by_tokens(minibatch, budget, padded=not pack, min_count=count)


def _in_row_order(values: list[torch.Tensor], rows: list[torch.Tensor] | None) -> torch.Tensor:
    """The per-row statistics of one minibatch's microbatches, back in the minibatch's row order (those of
    padding microbatches, past ``len(rows)``, after them)."""
    if rows is None:
        return torch.cat(values)
    real = torch.cat(values[: len(rows)])
    ordered = torch.empty_like(real)
    ordered[torch.cat(rows).to(real.device)] = real
    return torch.cat([ordered, *values[len(rows) :]])


def pad_microbatches(micros: list[TensorDictBase], env: DistEnv) -> list[TensorDictBase]:
    """Make every rank run the same number of microbatches (sharded models run a collective in each forward
    and backward): ranks with fewer append copies of their first microbatch with every loss mask
    (``MASKS``) False, which add nothing to the loss or the gradients."""
    if env.world_size == 1:
        return micros
    most = int(all_reduce_max(torch.tensor(len(micros), device=env.device), env).item())
    if most == len(micros):
        return micros
    empty = micros[0].clone()
    if "response_mask" not in empty.keys():  # keep the tokens real: only the loss masks go
        empty["response_mask"] = empty["action_mask"].clone()
    masks = [key for key in MASKS if key in empty.keys()]
    empty.update(empty.select(*masks).apply(torch.zeros_like))
    return micros + [empty] * (most - len(micros))


def log_stats(metrics: StepMetrics, stats: dict[str, Any], num_updates: int, rows: dict[str, list]) -> None:
    """Add one microbatch's ``stats`` to the step's metrics; each value says how it is reduced:

    - a 0-dim tensor: this microbatch's share of a minibatch quantity (a loss over the global denominators,
      a token mean weighted by ``den.share(mask)``); logged as the mean over the step's optimizer steps of
      the minibatch's total (shares of every microbatch and rank added, divided by ``num_updates``);
    - a pair ``(total, count)``: a weighted mean over the whole step, ``sum(total) / sum(count)`` over
      microbatches, optimizer steps and ranks;
    - a 1-D tensor: one value per row, not logged; ``optimize`` returns them, concatenated over the step.
    """
    for name, value in stats.items():
        if isinstance(value, tuple):
            metrics.mean(name, value[0], value[1])
        elif value.dim() == 1:
            rows.setdefault(name, []).append(value.detach())
        else:
            metrics.sum(name, value.detach() / num_updates)


def _values(stats: dict[str, Any]) -> str:
    """``actor_loss=nan, clipfrac=0.1, ...``: the 0-dim and pair stats, for an error message (host syncs: only
    on the error path)."""
    out = {}
    for name, value in stats.items():
        if isinstance(value, tuple):
            out[name] = float(value[0]) / max(float(value[1]), 1e-30)
        elif value.dim() == 0:
            out[name] = float(value)
    return ", ".join(f"{k}={v:.6g}" for k, v in out.items())


def _zero_grads(trained: Sequence[Trained]) -> None:
    for t in trained:
        t.optimizer.zero_grad(set_to_none=True)


def step_optimizers(
    trained: Sequence[Trained], max_grad_norm: float, metrics: StepMetrics, num_updates: int, where: str,
    update: int = 0,
) -> None:
    """Clip each model's gradient to ``max_grad_norm`` (if > 0; the norm is over all ranks' shards) and, if
    every norm is finite, step every optimizer (at its ``Trained.lr`` of ``update``, the index of this
    optimizer step in the training step) and zero the gradients. Logs each norm (before clipping) and rate
    divided by ``num_updates`` (``same``: a mean over the step's optimizer steps).

    Raises:
        NonFiniteError: a norm is not finite (on every rank: the norms are global); ``where`` starts the
            message. Every gradient is zeroed and no optimizer steps.
    """
    norms = [
        grad_norm_and_clip([p for p in t.model.parameters() if p.requires_grad], max_grad_norm)
        for t in trained
    ]
    if not all(bool(torch.isfinite(n)) for n in norms):
        _zero_grads(trained)
        values = ", ".join(f"{t.grad_norm}={float(n):.6g}" for t, n in zip(trained, norms, strict=True))
        raise NonFiniteError(f"{where}: non-finite gradient norm ({values}); no optimizer stepped")
    for t, norm in zip(trained, norms, strict=True):
        if t.lr is not None:
            lr = t.lr(update)
            for group in t.optimizer.param_groups:
                group["lr"] = lr
            metrics.same(t.lr_metric, lr / num_updates)
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        metrics.same(t.grad_norm, norm.detach() / num_updates)


def optimize(
    state: Any,
    batch: TensorDictBase,
    cfg: Any,
    objective: Objective,
    *,
    trained: Sequence[Trained],
    mask: str | None = "action_mask",
    epochs: int = 1,
    num_minibatches: int = 1,
    shuffle: torch.Generator | None = None,
    phase: str = "update",
) -> dict[str, torch.Tensor]:
    """``epochs`` x ``num_minibatches`` optimizer steps of ``trained`` on ``objective`` (module docstring).

    Args:
        state: the loop's state (``env``, ``metrics``, ``step``); passed on to ``objective``.
        batch: the step's rows, batch_size [B].
        cfg: the loop's config (``microbatch_size``, ``max_grad_norm``, ``precision``; optionally
            ``max_tokens_per_microbatch`` and ``pack_sequences``, None and False where a cfg of one's own
            lacks them); passed on.
        objective: ``objective(state, micro, cfg, den) -> (loss, stats)``; ``stats`` as ``log_stats`` reads them.
        trained: the models that train and their optimizers, stepped in this order after every minibatch;
            the first one's precision sets the autocast.
        mask: the key of the [B, T] bool mask the token and sequence denominators count (PPO
            ``action_mask``, REINFORCE ``loss_mask``); None: rows only.
        epochs: passes over ``batch``.
        num_minibatches: optimizer steps per pass; must be 1 without ``shuffle``.
        shuffle: the generator of ``split_minibatches`` (whole groups, shuffled every pass); None: ``batch``
            as it is is the one minibatch.
        phase: the phase named in a ``NonFiniteError``.

    Returns:
        The 1-D statistics (one value per row) of every minibatch, concatenated in order, each minibatch's in
        its row order.

    Raises:
        ValueError: ``num_minibatches > 1`` without ``shuffle``; ``pack_sequences`` with an objective that
            runs no packed forward pass (ILQL's, the reward model's); ``balance_batch`` with an objective that
            returns per-row statistics (the reward model's); a row over ``max_tokens_per_microbatch``.
        NonFiniteError: a non-finite loss (checked before each backward and agreed over ranks) or gradient
            norm, naming step, phase, where and the values; every gradient is zeroed and no optimizer steps.
    """
    if shuffle is None and num_minibatches != 1:
        raise ValueError(f"num_minibatches={num_minibatches} needs a shuffle generator")
    env, metrics = state.env, state.metrics
    num_updates = epochs * num_minibatches
    balance = getattr(cfg, "balance_batch", False) and env.world_size > 1
    pad_token_id = getattr(getattr(state, "tokenizer", None), "pad_token_id", None)
    rows: dict[str, list] = {}
    for epoch in range(epochs):
        minibatches = (
            [batch] if shuffle is None else split_minibatches(batch, num_minibatches, generator=shuffle)
        )
        for index, minibatch in enumerate(minibatches):
            den = denominators(minibatch, mask, env)
            placement = None
            if balance:  # after the counts: the union of the rows over ranks is the same
                minibatch, placement = balance_rows(minibatch, env, pad_token_id)
            where = f"step {state.step + 1}, phase {phase}, epoch {epoch}, minibatch {index}"
            micros, micro_rows = microbatches(minibatch, cfg, env)
            minibatch_rows: dict[str, list] = {}
            for j, micro in enumerate(pad_microbatches(micros, env)):
                with autocast(trained[0].model, cfg), packed_sequences(getattr(cfg, "pack_sequences", False)) as packed:
                    loss, stats = objective(state, micro, cfg, den)
                if packed is not None and packed.count == 0:
                    raise ValueError(
                        f"pack_sequences=True but the {phase} objective ran no packed forward pass (only "
                        "policy_logprobs and critic_values pack: PPO, REINFORCE, the preference loop); set "
                        "pack_sequences=False"
                    )
                if any_rank(~torch.isfinite(loss.detach()), env):  # every rank raises together
                    _zero_grads(trained)
                    raise NonFiniteError(
                        f"{where}, microbatch {j}: non-finite loss {float(loss.detach())} ({_values(stats)})"
                    )
                loss.backward()
                log_stats(metrics, stats, num_updates, minibatch_rows)
            if placement is not None and minibatch_rows:
                raise ValueError(
                    f"balance_batch=True but the {phase} objective returns per-row statistics "
                    f"({', '.join(sorted(minibatch_rows))}), which would belong to other ranks' rows; set "
                    "balance_batch=False"
                )
            for name, values in minibatch_rows.items():
                rows.setdefault(name, []).append(_in_row_order(values, micro_rows))
            step_optimizers(
                trained, cfg.max_grad_norm, metrics, num_updates, where, update=epoch * num_minibatches + index
            )
    return {name: torch.cat(values) for name, values in rows.items()}


__all__ = [
    "Denominators",
    "Objective",
    "Trained",
    "denominators",
    "log_stats",
    "microbatches",
    "optimize",
    "pad_microbatches",
    "step_optimizers",
]
