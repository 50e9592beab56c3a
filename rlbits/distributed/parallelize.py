"""Apply data parallelism to a model from outside it: activation checkpointing, per-block compile, FSDP2.

``shard(model, env, ...)`` works on any transformers model (and rlbits' ``ValueModel`` / ``ILQLModel``, which
hold one): its transformer blocks are the modules whose class is listed in a ``_no_split_modules`` of a
``PreTrainedModel`` inside it. Each block gets ``fully_shard`` (FSDP2, ``torch.distributed.fsdp``), then the
root, so a block's parameters are all-gathered just before it runs and freed after.

FSDP2 sums gradients over ranks with ``set_gradient_divide_factor(1)``: rlbits' losses are normalised by the
*global* token (or sequence) count (``global_count``), so the sum over ranks of the local gradients is the
gradient of the whole batch, as on one process. At world size 1 there is no process group and no sharding;
checkpointing and compile still apply, so the code path is the same.

Generation calls the model once per token: ``unsharded(model)`` all-gathers every parameter once for the whole
rollout (and keeps it gathered across forwards), so decoding runs no collective at all and ranks may decode
different numbers of tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rlbits.distributed.env import DistEnv


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: modules whose class name is in some ``_no_split_modules``.

    Raises:
        ValueError: ``model`` holds no transformers model declaring ``_no_split_modules``.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"cannot find the transformer blocks of {type(model).__name__}: no submodule's class is listed in a "
            "_no_split_modules (shard works on transformers models and modules holding one)"
        )
    return blocks


def is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a DTensor (a parameter of a sharded model)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_sharded(model: nn.Module) -> bool:
    """True if ``shard`` (``fully_shard``) was applied to ``model``."""
    return isinstance(model, FSDPModule)


def shard(
    model: nn.Module,
    env: DistEnv,
    *,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    compile_blocks: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Activation checkpointing, ``torch.compile`` and ``fully_shard`` per block, then ``fully_shard`` on the root.

    Module names (and so state-dict keys) are unchanged: checkpointing uses the composable
    ``torch.distributed._composable.checkpoint`` and compile ``nn.Module.compile``.

    Args:
        model: on ``env.device``, built the same way (same initial weights) on every rank.
        env: from ``rlbits.distributed.init``; no sharding at world size 1. The model is sharded over the
            ranks of ``env.group`` (all ranks when None).
        mixed_precision: FSDP2 ``MixedPrecisionPolicy`` with bf16 parameters in forward/backward and fp32
            gradient reduction (sharded master weights and optimizer states stay fp32). Ignored at world size 1,
            where the loops use ``torch.autocast`` instead.
        activation_checkpointing: recompute each block's activations in backward (memory for ~1/3 more compute).
        compile_blocks: ``torch.compile`` each block (worth it on GPU; slow to compile on CPU).
        reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3); False keeps them
            until backward (ZeRO-2-like: more memory, one all-gather fewer).

    Returns:
        ``model`` itself, modified in place (its class becomes ``FSDP<Class>`` when sharded).
    """
    blocks = transformer_blocks(model)
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block)
        for m in model.modules():  # a KV cache filled in forward would be filled again by the recompute
            config = getattr(m, "config", None)
            if hasattr(config, "use_cache"):
                config.use_cache = False
    if compile_blocks:
        for block in blocks:
            block.compile()
    if env.world_size == 1:
        return model
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if env.group is None:
        mesh = init_device_mesh(env.device.type, (env.world_size,))
    else:  # the ranks of env.group only (async_mode: ranks: the trainer ranks)
        mesh = DeviceMesh.from_group(env.group, env.device.type)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    kw = dict(mesh=mesh, mp_policy=policy)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    for m in _fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)  # losses are already divided by the global count
        m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    model.rlbits_reshard_after_forward = reshard_after_forward  # restored by ``unsharded``
    # Make ``model`` the FSDP root now, not at its first forward: a fast path that calls a submodule
    # directly first (e.g. generate's decode through the backbone) would make each block its own root.
    model._get_fsdp_state()._lazy_init()
    return model


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients of ``params`` (sharded or not), clipped to ``max_norm`` if > 0.

    Returns:
        The norm before clipping, a plain 0-dim tensor (a sharded model's norm is reduced over ranks).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Keep every parameter of a sharded ``model`` gathered inside the block (one all-gather per module).

    Use it around generation and other no-grad passes of uneven length across ranks: inside, forwards run
    no collective. A no-op for a model that is not sharded.
    """
    modules = _fsdp_modules(model)
    if not modules:
        yield model
        return
    for m in modules:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield model
    finally:
        again = getattr(model, "rlbits_reshard_after_forward", True)
        for m in modules:
            m.reshard()
            # FSDP2 never reshards the root after forward (backward would gather it again at once).
            m.set_reshard_after_forward(again and m is not model)


__all__ = ["grad_norm_and_clip", "is_sharded", "shard", "transformer_blocks", "unsharded"]
