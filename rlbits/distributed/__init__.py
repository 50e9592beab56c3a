"""Distributed helpers, the only package in rlbits that imports ``torch.distributed``: the process group and
its ``DistEnv`` (``env``), reductions across ranks (``reduce``), FSDP2 sharding (``parallelize``), checkpoints
at any world size (``checkpoint``), the rollout queue and weight broadcast of ``async_mode: ranks``
(``async_ranks``), and rows balanced by tokens over the data-parallel ranks (``balance``).

Names load on first use, so ``import rlbits.distributed`` stays cheap (no transformers until a checkpoint
name is used)."""

from __future__ import annotations

from rlbits._lazy import lazy_exports

_LAZY = {
    # async_ranks
    "TRAINER_RANK": "rlbits.distributed.async_ranks",
    "RankRoles": "rlbits.distributed.async_ranks",
    "WeightInbox": "rlbits.distributed.async_ranks",
    "all_gather_json": "rlbits.distributed.async_ranks",
    "broadcast_json": "rlbits.distributed.async_ranks",
    "broadcast_weights": "rlbits.distributed.async_ranks",
    "owned_shards": "rlbits.distributed.async_ranks",
    "isend_weights": "rlbits.distributed.async_ranks",
    "recv_json": "rlbits.distributed.async_ranks",
    "send_json": "rlbits.distributed.async_ranks",
    "split_ranks": "rlbits.distributed.async_ranks",
    # balance
    "Placement": "rlbits.distributed.balance",
    "all_gather_batch": "rlbits.distributed.balance",
    "balance_rows": "rlbits.distributed.balance",
    # checkpoint
    "checkpoint": "rlbits.distributed.checkpoint",
    # env
    "DistEnv": "rlbits.distributed.env",
    "barrier": "rlbits.distributed.env",
    "init": "rlbits.distributed.env",
    "is_collective_failure": "rlbits.distributed.env",
    "main_rank_first": "rlbits.distributed.env",
    "use_role_env": "rlbits.distributed.env",
    # reduce
    "all_reduce_max": "rlbits.distributed.reduce",
    "all_reduce_sum": "rlbits.distributed.reduce",
    "any_rank": "rlbits.distributed.reduce",
    "global_count": "rlbits.distributed.reduce",
    "masked_var": "rlbits.distributed.reduce",
    "masked_whiten": "rlbits.distributed.reduce",
    # parallelize
    "grad_norm_and_clip": "rlbits.distributed.parallelize",
    "is_sharded": "rlbits.distributed.parallelize",
    "shard": "rlbits.distributed.parallelize",
    "transformer_blocks": "rlbits.distributed.parallelize",
    "unsharded": "rlbits.distributed.parallelize",
    # checkpoint
    "CHECKPOINTS": "rlbits.distributed.checkpoint",
    "CHUNK": "rlbits.distributed.checkpoint",
    "MANIFEST": "rlbits.distributed.checkpoint",
    "SMALL_FILE": "rlbits.distributed.checkpoint",
    "CheckpointError": "rlbits.distributed.checkpoint",
    "discard_checkpoints": "rlbits.distributed.checkpoint",
    "export_model": "rlbits.distributed.checkpoint",
    "is_rlbits_checkpoint": "rlbits.distributed.checkpoint",
    "latest_checkpoint": "rlbits.distributed.checkpoint",
    "list_checkpoints": "rlbits.distributed.checkpoint",
    "load_checkpoint": "rlbits.distributed.checkpoint",
    "read_dcp_metadata": "rlbits.distributed.checkpoint",
    "restore_checkpoint": "rlbits.distributed.checkpoint",
    "resume_checkpoint": "rlbits.distributed.checkpoint",
    "save_checkpoint": "rlbits.distributed.checkpoint",
    "verify_checkpoint": "rlbits.distributed.checkpoint",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
