"""The update step's plumbing: optimizers, gradient clipping, microbatches that line up across ranks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from tensordict import TensorDictBase

from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import grad_norm_and_clip, is_dtensor
from rlbits.distributed.reduce import all_reduce_max


def make_optimizer(params: Iterator[torch.nn.Parameter] | Sequence, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad.

    PyTorch's fused kernel (``fused=True``) where every parameter is a plain floating-point tensor on the CPU
    or CUDA: one pass over each tensor instead of a chain of elementwise ops (on 2 CPU threads, a step over
    SmolLM2-135M's 134.5M parameters takes 0.09 s instead of 0.35-0.39 s). Sharded (DTensor) parameters
    keep the default implementation.
    """
    trainable = [p for p in params if p.requires_grad]
    fused = bool(trainable) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() and not is_dtensor(p) for p in trainable
    )
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, fused=fused or None)


def clip_and_step(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float) -> torch.Tensor:
    """Clip the gradient's global norm (if ``max_grad_norm > 0``; over all ranks' shards), step and zero the
    gradients.

    Returns the norm before clipping (0-dim tensor). A non-finite norm raises FloatingPointError and leaves the
    parameters untouched.
    """
    norm = grad_norm_and_clip(list(params), max_grad_norm)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"gradient norm is {norm.item()}; the update was skipped")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


def pad_microbatches(micros: list[TensorDictBase], env: DistEnv) -> list[TensorDictBase]:
    """Make every rank run the same number of microbatches (sharded models run a collective in each forward
    and backward): ranks with fewer append copies of their first microbatch with every mask False, which
    add nothing to the loss or the gradients."""
    if env.world_size == 1:
        return micros
    most = int(all_reduce_max(torch.tensor(len(micros), device=env.device), env).item())
    if most == len(micros):
        return micros
    empty = micros[0].clone()
    if "response_mask" not in empty.keys():  # keep the tokens real: only the loss masks go
        empty["response_mask"] = empty["action_mask"].clone()
    masks = [key for key in ("action_mask", "loss_mask") if key in empty.keys()]
    empty.update(empty.select(*masks).apply(torch.zeros_like))
    return micros + [empty] * (most - len(micros))


__all__ = ["clip_and_step", "make_optimizer", "pad_microbatches"]
