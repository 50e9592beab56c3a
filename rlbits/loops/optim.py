"""The optimizer of every loop and its learning-rate schedules (the update itself is ``rlbits.loops.update``).

A schedule is a pure function of the optimizer step: ``rate(step)`` for the ``step``-th optimizer step of a
run (0 for the first), set on the optimizer's parameter groups just before that step
(``rlbits.loops.update.step_optimizers``). A resumed run computes the same rates from its step counter, so
no scheduler state is saved (torch's ``LRScheduler`` objects, which the seeds step, hold only that counter).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rlbits.distributed.parallelize import is_dtensor
from rlbits.loops.run import total_steps


def make_optimizer(
    params: Iterator[torch.nn.Parameter] | Sequence,
    lr: float,
    weight_decay: float,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad, with Adam's ``betas`` (beta1, beta2) and ``eps``
    (``RunConfig.adam_betas`` / ``adam_eps``; torch's defaults).

    PyTorch's fused kernel (``fused=True``) where every parameter is a plain floating-point tensor on the CPU
    or CUDA: one pass over each tensor instead of a chain of elementwise ops (on 2 CPU threads, a step over
    SmolLM2-135M's 134.5M parameters takes 0.09 s instead of 0.35-0.39 s). Sharded (DTensor) parameters
    keep the default implementation.
    """
    trainable = [p for p in params if p.requires_grad]
    fused = bool(trainable) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() and not is_dtensor(p) for p in trainable
    )
    b1, b2 = betas
    return torch.optim.AdamW(
        trainable, lr=lr, betas=(b1, b2), eps=eps, weight_decay=weight_decay, fused=fused or None
    )


# --- learning-rate schedules: rate(step) for the step-th optimizer step (0-based) --------------------------


def linear_warmup_lr(step: int, *, lr: float, warmup_steps: int, start_factor: float) -> float:
    """NeMo-RL's ``policy.scheduler`` of its example configs (``grpo_math_1B.yaml``): torch ``LinearLR(
    start_factor, end_factor=1.0, total_iters=warmup_steps)`` then ``ConstantLR(factor=1.0)`` from the
    milestone ``warmup_steps`` on (``SequentialLR``): ``lr * (start_factor + (1 - start_factor) *
    min(step, warmup_steps) / warmup_steps)``; ``lr`` from ``warmup_steps`` on (and always when it is 0)."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return lr
    return lr * (start_factor + (1.0 - start_factor) * step / warmup_steps)


def warmup_cosine_lr(
    step: int,
    *,
    lr: float,
    max_steps: int,
    warmup_steps: int = 0,
    constant_steps: int = 0,
    min_lr: float = 0.0,
) -> float:
    """NeMo's ``CosineAnnealing`` (``nemo/core/optim/lr_scheduler.py``), NeMo-Aligner's actor and critic
    ``optim.sched`` (``gpt_ppo_actor.yaml``: ``warmup_steps``, ``constant_steps``, ``min_lr``, ``max_steps``).
    With ``decay = max_steps - warmup_steps - constant_steps``:

    - ``constant_steps == 0``: ``lr * (step + 1) / (warmup_steps + 1)`` while ``step <= warmup_steps`` (when
      ``warmup_steps > 0``), then ``min_lr + (lr - min_lr) * (1 + cos(pi * (step - warmup_steps) /
      (max_steps - warmup_steps))) / 2``, and ``min_lr`` past ``max_steps``;
    - ``constant_steps > 0`` (Megatron's schedule): ``lr * step / warmup_steps`` while ``step <=
      warmup_steps``, then ``min_lr + (lr - min_lr) * (1 + cos(pi * (step - warmup_steps) / decay)) / 2``, and
      ``min_lr`` past ``warmup_steps + decay`` (the ``constant_steps`` hold and beyond).

    Raises:
        ValueError: ``decay < 1`` (the warm-up and hold leave no step to decay over), or ``min_lr > lr``.
    """
    decay = max_steps - warmup_steps - constant_steps
    if decay < 1:
        raise ValueError(
            f"a cosine schedule of {max_steps} optimizer steps has no step left to decay over after "
            f"{warmup_steps} warm-up and {constant_steps} constant steps"
        )
    if min_lr > lr:
        raise ValueError(f"min_lr ({min_lr}) must be <= the learning rate ({lr})")
    if constant_steps == 0:
        if warmup_steps > 0 and step <= warmup_steps:
            return lr * (step + 1) / (warmup_steps + 1)
        if step > max_steps:
            return min_lr
        return min_lr + (lr - min_lr) * 0.5 * (
            1 + math.cos(math.pi * (step - warmup_steps) / (max_steps - warmup_steps))
        )
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if step > warmup_steps + decay:
        return min_lr
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / decay))


def cosine_annealing_lr(step: int, *, lr: float, t_max: int, min_lr: float = 0.0) -> float:
    """trlx's ``scheduler: {name: cosine_annealing, kwargs: {T_max, eta_min}}`` (``default_configs.py``;
    stepped after every optimizer step in ``accelerate_base_trainer.py``): torch ``CosineAnnealingLR``,
    ``min_lr + (lr - min_lr) * (1 + cos(pi * step / t_max)) / 2`` (its closed form; past ``t_max`` the
    cosine goes on, rising again, as torch's does).

    Raises:
        ValueError: ``t_max < 1``.
    """
    if t_max < 1:
        raise ValueError(f"cosine_annealing needs t_max >= 1 optimizer steps, got {t_max}")
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * step / t_max))


LR_SCHEDULERS = ("constant", "linear_warmup", "cosine", "cosine_annealing")
"""The names ``lr_scheduler`` takes: ``constant``, ``linear_warmup`` (``linear_warmup_lr``), ``cosine``
(``warmup_cosine_lr``) and ``cosine_annealing`` (``cosine_annealing_lr``)."""


def lr_schedule(cfg: Any, lr: float, *, length: int) -> Callable[[int], float]:
    """The rate of each optimizer step under ``cfg``'s ``lr_scheduler`` fields (``PolicyConfig``) for an
    optimizer whose base rate is ``lr``: ``rate(step)``, ``step`` the optimizer steps it took before.
    ``length``: its optimizer steps in the run, the schedule's ``max_steps`` / ``T_max`` unless
    ``lr_max_steps`` sets them.

    Raises:
        ValueError: a ``cosine`` schedule with no step left to decay over, or ``min_lr > lr``.
    """
    name, total = cfg.lr_scheduler, cfg.lr_max_steps if cfg.lr_max_steps is not None else length
    if name == "constant":
        return lambda step: lr
    if name == "linear_warmup":
        warm = dict(warmup_steps=cfg.lr_warmup_steps, start_factor=cfg.lr_warmup_start_factor)
        return lambda step: linear_warmup_lr(step, lr=lr, **warm)
    if name == "cosine":
        args = dict(
            max_steps=total,
            warmup_steps=cfg.lr_warmup_steps,
            constant_steps=cfg.lr_constant_steps,
            min_lr=cfg.min_lr,
        )
        warmup_cosine_lr(0, lr=lr, **args)  # raises on arguments it cannot follow, before the first step
        return lambda step: warmup_cosine_lr(step, lr=lr, **args)
    if name == "cosine_annealing":
        return lambda step: cosine_annealing_lr(step, lr=lr, t_max=total, min_lr=cfg.min_lr)
    raise ValueError(f"lr_scheduler must be one of {', '.join(LR_SCHEDULERS)}, got {name!r}")


def scheduled(cfg: Any, lr: float, step: int, per_step: int, steps: int) -> Callable[[int], float] | None:
    """``Trained.lr`` of an optimizer in training step ``step`` (0-based, counted from the one where it
    starts training): the rate of its ``u``-th optimizer step there is ``lr_schedule(cfg, lr)`` at optimizer
    step ``step * per_step + u``, over ``steps * per_step`` (``steps``: its training steps in the run). A
    pure function of the step counter, so a resumed run follows the uninterrupted run's rates exactly; a step
    with fewer optimizer steps (REINFORCE's dynamic sampling) leaves the rest of its share unused, and a
    skipped one (``on_nonfinite: skip``) all of it. None for
    ``constant``: the optimizer keeps ``lr`` and no rate is logged."""
    if cfg.lr_scheduler == "constant":
        return None
    rate = lr_schedule(cfg, lr, length=max(steps, 1) * per_step)
    return lambda update: rate(step * per_step + update)


def run_length(state: Any, cfg: Any) -> int:
    """Training steps of the run (``rlbits.loops.run.total_steps`` of the state's data), as ``Run`` counts them."""
    return total_steps(cfg, state.num_samples, state.samples_per_step(cfg))


__all__ = [
    "LR_SCHEDULERS",
    "cosine_annealing_lr",
    "linear_warmup_lr",
    "lr_schedule",
    "make_optimizer",
    "run_length",
    "scheduled",
    "warmup_cosine_lr",
]
