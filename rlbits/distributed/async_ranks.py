"""The ranks and the transport of ``async_mode: ranks`` (docs/async.md): which ranks train and which only
generate, the bounded rollout queue between them (point-to-point messages) and the weight broadcast.

The first ``T = world size - rollout_ranks`` ranks train together (FSDP2 over their own process group, as a
colocated run at world size T); the last R = ``rollout_ranks`` ranks only generate, rollout rank j the shards
r with r % R == j of every batch (``owned_shards``; R <= T). Messages are JSON objects sent as uint8 tensors (a
length, then the bytes): no pickle crosses ranks. The weights go from trainer rank 0 on a group
made of it and the rollout ranks, in place into the rollout ranks' tensors (a sharded trainer policy's
parameters are gathered one at a time first); under ``async_schedule: eager`` trainer rank 0 sends them point
to point without waiting (``isend_weights``) and the rollout rank takes them when it looks (``WeightInbox``).
Gloo on CPU (the tensors stay on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlbits.distributed.env import DistEnv, init, use_role_env
from rlbits.distributed.parallelize import is_dtensor

TRAINER_RANK = 0
"""The world rank that sends the weights and the start of the run to the rollout ranks (trainer rank 0)."""


@dataclasses.dataclass(frozen=True)
class RankRoles:
    """This process's place in an ``async_mode: ranks`` world: ``rank`` of ``world_size`` (world ranks); the
    first ranks train (``trainer_ranks``), the last ``len(rollout_ranks)`` only generate; ``group``: trainer
    rank 0 and the rollout ranks (the weights and the control messages); ``env``: what this process's loop
    sees (``init()`` returns it): a trainer is rank r of the T trainer ranks, collectives on their group; a
    rollout rank is rank 0 of 1."""

    rank: int
    world_size: int
    rollout_ranks: tuple[int, ...]
    group: Any
    trainer_ranks: tuple[int, ...]
    env: DistEnv

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def in_group(self) -> bool:
        """True on the ranks of ``group``: trainer rank 0 and the rollout ranks."""
        return self.rank == TRAINER_RANK or self.is_rollout

    def shards_of(self, rollout_rank: int) -> tuple[int, ...]:
        """The shards (trainer ranks, ascending) that the rollout rank of world rank ``rollout_rank`` produces
        (``owned_shards``)."""
        index = self.rollout_ranks.index(rollout_rank)
        return owned_shards(index, len(self.trainer_ranks), len(self.rollout_ranks))

    def owner_of(self, shard: int) -> int:
        """The world rank of the rollout rank that produces shard ``shard`` (trainer rank ``shard``'s rows)."""
        return next(r for r in self.rollout_ranks if shard in self.shards_of(r))


def owned_shards(rollout_index: int, trainers: int, rollouts: int) -> tuple[int, ...]:
    """The shards of each batch that rollout rank ``rollout_index`` (0 .. ``rollouts`` - 1) produces, with
    ``trainers`` trainer ranks: shard r (trainer rank r's rows, as rank r of a colocated run at world size
    ``trainers`` draws them) belongs to rollout rank ``r % rollouts``, so each produces every ``rollouts``-th
    shard and the shards of a batch are spread as evenly as they can be.

    Raises:
        ValueError: ``rollouts`` not in 1 .. ``trainers`` (a shard is one colocated rank's draw: it cannot be
            split over rollout ranks without changing the samples), or ``rollout_index`` not in 0 .. ``rollouts`` - 1.
    """
    if not 1 <= rollouts <= trainers:
        raise ValueError(
            f"{rollouts} rollout ranks for {trainers} trainer ranks: each rollout rank produces whole shards (a "
            "shard is one colocated rank's draw and cannot be split without changing the samples), so there are "
            "at least 1 and at most as many rollout ranks as trainer ranks"
        )
    if not 0 <= rollout_index < rollouts:
        raise ValueError(f"rollout_index must be in 0 .. {rollouts - 1}, got {rollout_index}")
    return tuple(range(rollout_index, trainers, rollouts))


def split_ranks(rollout_ranks: int, device: str = "cpu", timeout_s: float | None = None) -> RankRoles:
    """Initialise torchrun's process group (``rlbits.distributed.env.init``), give the last ``rollout_ranks``
    ranks the rollout role and the others the trainer role, and create the trainers' group and ``group``
    (trainer rank 0 and the rollout ranks). Every rank must call it (it creates groups).

    Afterwards this process's ``init()`` (and so its loop) returns ``RankRoles.env``: on a trainer, rank r of
    the T = world size - ``rollout_ranks`` trainer ranks with their group (its reductions, sharding and
    checkpoints span the trainers only, as a colocated run at world size T); on a rollout rank, rank 0 of 1
    (its policy unsharded; it builds its state as a 1-process run does).

    Raises:
        ValueError: not under torchrun (``WORLD_SIZE`` < 2), or ``rollout_ranks`` not in 1 .. T (each rollout
            rank produces whole shards of the trainers' batches: ``owned_shards``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise ValueError("async_mode: ranks runs under torchrun with at least 2 processes (WORLD_SIZE >= 2)")
    if not 1 <= rollout_ranks <= world - rollout_ranks:
        raise ValueError(
            f"rollout_ranks must be in 1 .. {world // 2} (at most the trainer ranks; world size {world}), got "
            f"{rollout_ranks}"
        )
    env = init(device, timeout_s=timeout_s, cpu_collectives=True)  # batches: host bytes; weights: on the device
    trainers = tuple(range(world - rollout_ranks))
    ranks = tuple(range(world - rollout_ranks, world))
    trainer_group = dist.new_group(list(trainers))
    group = dist.new_group([TRAINER_RANK, *ranks])
    if env.rank in trainers:
        role = DistEnv(env.rank, len(trainers), env.local_rank, env.device, trainer_group)
    else:
        role = DistEnv(0, 1, env.local_rank, env.device)
    use_role_env(role)
    return RankRoles(env.rank, world, ranks, group, trainers, role)


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def send_json(obj: Any, dst: int | Sequence[int]) -> list[Any]:
    """Send ``obj`` (JSON-serialisable) to world rank ``dst`` (or to each of several) without waiting; returns
    the pending works (``wait()`` them before exit; their tensors stay alive with them)."""
    data = _to_bytes(obj)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    out = []
    for rank in [dst] if isinstance(dst, int) else dst:
        out += [(dist.isend(size, rank), size), (dist.isend(data, rank), data)]
    return out


def recv_json(src: int) -> Any:
    """The next object ``send_json`` sent from world rank ``src`` (blocks until it arrives)."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src)
    return json.loads(bytes(data.numpy()).decode())


def all_gather_json(obj: Any, env: DistEnv) -> list[Any]:
    """``obj`` (JSON-serialisable) of every rank of ``env.group`` (None: the world), in rank order: a
    collective of that group. ``[obj]`` at world size 1."""
    if env.world_size == 1:
        return [obj]
    data = _to_bytes(obj).to(env.device)  # on the device: NCCL gathers CUDA tensors only
    sizes = [torch.zeros(1, dtype=torch.int64, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=env.device), group=env.group)
    width = int(max(sizes).item())
    padded = torch.zeros(width, dtype=torch.uint8, device=env.device)
    padded[: data.numel()] = data
    out = [torch.empty(width, dtype=torch.uint8, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(out, padded, group=env.group)
    return [json.loads(bytes(t[: int(n.item())].cpu().numpy()).decode()) for t, n in zip(out, sizes, strict=True)]


def broadcast_json(obj: Any, roles: RankRoles) -> Any:
    """``obj`` of trainer rank 0, on every rank of ``roles.group`` (a collective of that group: only its
    ranks call it)."""
    size = torch.zeros(1, dtype=torch.int64)
    data = _to_bytes(obj) if roles.rank == TRAINER_RANK else torch.empty(0, dtype=torch.uint8)
    size[0] = data.numel()
    dist.broadcast(size, TRAINER_RANK, group=roles.group)
    if roles.rank != TRAINER_RANK:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, TRAINER_RANK, group=roles.group)
    return json.loads(bytes(data.numpy()).decode())


def broadcast_weights(module: torch.nn.Module, roles: RankRoles) -> None:
    """Copy trainer rank 0's parameters and buffers into ``module``'s on the rollout ranks, in place.

    Every trainer rank and rollout rank calls it, with ``module`` built alike everywhere (the same parameters
    in the same order): a parameter sharded over the trainers (a DTensor) is gathered whole first, one at a
    time (``full_tensor()``, a collective of the trainers' group), then broadcast on ``roles.group``; the
    rollout ranks' copies are unsharded."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            full = t.full_tensor() if is_dtensor(t) else t.data
            if roles.in_group:
                dist.broadcast(full, TRAINER_RANK, group=roles.group)


def isend_weights(module: torch.nn.Module | None, roles: RankRoles, version: int, stop: bool = False) -> list[Any]:
    """The ``eager`` schedule's weight update, trainer side: trainer rank 0 sends each rollout rank a header
    (``version``, ``stop``) and, unless ``stop`` (``module`` then unused), a copy of every parameter and
    buffer of ``module`` (in ``broadcast_weights``' order), point to point, without waiting; the rollout rank
    takes them when it looks (``WeightInbox``). Every trainer rank calls it: a sharded parameter is gathered whole first
    (``full_tensor()``, a collective of the trainers' group). Returns the pending works with their tensors
    (``wait()`` them before the next call: one copy of the weights in flight at most)."""
    header = torch.tensor([int(version), int(stop)], dtype=torch.int64)
    copies = []
    with torch.no_grad():
        for t in [] if stop else [*module.parameters(), *module.buffers()]:
            full = t.full_tensor() if is_dtensor(t) else t.data
            if roles.rank == TRAINER_RANK:  # a copy: training goes on in place while the send is pending
                copies.append(full.detach().to("cpu", copy=True))
    if roles.rank != TRAINER_RANK:
        return []
    return [(dist.isend(t, dst), t) for dst in roles.rollout_ranks for t in (header, *copies)]


def _recv_into(t: torch.Tensor, src: int) -> None:
    """Receive a tensor ``isend_weights`` sent into ``t`` in place: directly on the CPU, through a host buffer
    on a device (``isend_weights`` sends host copies, so the eager schedule's weights travel over gloo)."""
    if t.device.type == "cpu":
        dist.recv(t, src)
        return
    host = torch.empty(t.shape, dtype=t.dtype)
    dist.recv(host, src)
    t.copy_(host)


class WeightInbox:
    """The ``eager`` schedule's weight updates, rollout-rank side: ``take(module)`` looks, without blocking,
    for a header ``isend_weights`` sent; when one has arrived it receives the weights into ``module``'s
    parameters and buffers in place and returns ``(version, stop)``, else None. The header's receive is posted
    ahead and waited on by a daemon thread (gloo's ``irecv`` reports completion only once waited)."""

    def __init__(self) -> None:
        self._post()

    def _post(self) -> None:
        self.header = torch.zeros(2, dtype=torch.int64)
        work = dist.irecv(self.header, TRAINER_RANK)
        self.thread = threading.Thread(target=work.wait, daemon=True)
        self.thread.start()

    def take(self, module: torch.nn.Module) -> tuple[int, bool] | None:
        if self.thread.is_alive():
            return None
        version, stop = (int(v) for v in self.header.tolist())
        if not stop:
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    _recv_into(t.data, TRAINER_RANK)
            self._post()
        return version, bool(stop)


__all__ = [
    "TRAINER_RANK", "RankRoles", "WeightInbox", "all_gather_json", "broadcast_json", "broadcast_weights",
    "isend_weights", "owned_shards", "recv_json", "send_json", "split_ranks",
]
