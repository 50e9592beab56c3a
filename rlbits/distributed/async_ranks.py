"""The ranks and the transport of ``async_mode: ranks`` (docs/async.md): which ranks train and which only
generate, the bounded rollout queue between them (point-to-point messages) and the weight broadcast.

Messages are JSON objects sent as uint8 tensors (a length, then the bytes): no pickle crosses ranks. The
weights go as the module's own tensors, broadcast in place from trainer rank 0 on a group made of it and the
rollout ranks. Gloo on CPU (the tensors stay on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from rlbits.distributed.env import init

TRAINER_RANK = 0
"""The world rank that sends the weights and receives the rollouts (trainer rank 0)."""


@dataclasses.dataclass(frozen=True)
class RankRoles:
    """This process's place in an ``async_mode: ranks`` world: ``rank`` of ``world_size``; the last
    ``len(rollout_ranks)`` ranks only generate; ``group``: trainer rank 0 and the rollout ranks."""

    rank: int
    world_size: int
    rollout_ranks: tuple[int, ...]
    group: Any

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks


def split_ranks(rollout_ranks: int, device: str = "cpu", timeout_s: float | None = None) -> RankRoles:
    """Initialise torchrun's process group (``rlbits.distributed.env.init``) and give the last
    ``rollout_ranks`` ranks the rollout role. Every rank must call it (it creates a group).

    Afterwards this process's ``init()`` (and so its loop) sees rank 0 of 1: a trainer rank trains alone and a
    rollout rank draws its prompts and sampling noise as a 1-process run does (``WORLD_SIZE`` and ``RANK``
    are set to 1 and 0 in ``os.environ``; the world group stays, for this module's messages).

    Raises:
        ValueError: not under torchrun (``WORLD_SIZE`` < 2), or ``rollout_ranks`` not in 1 .. world size - 1.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise ValueError("async_mode: ranks runs under torchrun with at least 2 processes (WORLD_SIZE >= 2)")
    if not 1 <= rollout_ranks < world:
        raise ValueError(f"rollout_ranks must be in 1 .. {world - 1} (world size {world}), got {rollout_ranks}")
    env = init(device, timeout_s=timeout_s)
    ranks = tuple(range(world - rollout_ranks, world))
    group = dist.new_group([TRAINER_RANK, *ranks])
    os.environ.update(WORLD_SIZE="1", RANK="0")
    return RankRoles(rank=env.rank, world_size=world, rollout_ranks=ranks, group=group)


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def send_json(obj: Any, dst: int) -> list[Any]:
    """Send ``obj`` (JSON-serialisable) to world rank ``dst`` without waiting; returns the pending works
    (``wait()`` them before exit; their tensors stay alive with them)."""
    data = _to_bytes(obj)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return [(dist.isend(size, dst), size), (dist.isend(data, dst), data)]


def recv_json(src: int) -> Any:
    """The next object ``send_json`` sent from world rank ``src`` (blocks until it arrives)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src)
    return json.loads(bytes(data.numpy()).decode())


def broadcast_json(obj: Any, roles: RankRoles) -> Any:
    """``obj`` of trainer rank 0, on every rank of ``roles.group`` (a collective of that group)."""
    size = torch.zeros(1, dtype=torch.int64)
    data = _to_bytes(obj) if roles.rank == TRAINER_RANK else torch.empty(0, dtype=torch.uint8)
    size[0] = data.numel()
    dist.broadcast(size, TRAINER_RANK, group=roles.group)
    if roles.rank != TRAINER_RANK:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, TRAINER_RANK, group=roles.group)
    return json.loads(bytes(data.numpy()).decode())


def broadcast_weights(module: torch.nn.Module, roles: RankRoles) -> None:
    """Copy trainer rank 0's parameters and buffers into ``module``'s on the rollout ranks, in place (a
    collective of ``roles.group``; ``module`` built alike on every rank and not sharded)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, TRAINER_RANK, group=roles.group)


__all__ = ["TRAINER_RANK", "RankRoles", "broadcast_json", "broadcast_weights", "recv_json", "send_json", "split_ranks"]
