"""Process-group set-up: one code path from a notebook (world size 1) to ``torchrun`` (world size N)."""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: ``rank`` of ``world_size`` processes, on ``device``; ``group``: the process
    group of its collectives (``rlbits.distributed.reduce``, ``barrier``, sharding, checkpoints), None for the
    default (world) group. With ``async_mode: ranks`` a trainer's ``DistEnv`` is its rank among the trainer
    ranks and their group (``rlbits.distributed.async_ranks.split_ranks``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: Any = None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that writes logs and exports."""
        return self.rank == 0


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _elastic_store(rank: int, world_size: int) -> dict:
    """Under torchrun, a store whose keys are prefixed by the restart attempt: after ``--max-restarts``
    restarts the workers, a new rank must not read an address a killed rank published in an earlier
    attempt (seen as gloo "connection refused" on restart). Empty (the env:// default) otherwise."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt is None:
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
        timeout=timedelta(minutes=10),
    )
    return {"store": dist.PrefixStore(f"rlbits/attempt_{attempt}", store), "rank": rank, "world_size": world_size}


_ROLE_ENV: list[DistEnv] = []


def use_role_env(env: DistEnv) -> None:
    """Make ``init()`` return ``env`` from now on in this process: its place within the ranks of its role
    (``rlbits.distributed.async_ranks.split_ranks``, after the process group exists)."""
    _ROLE_ENV[:] = [env]


def _backend(device: torch.device, cpu_collectives: bool = False) -> str:
    """The process group's backend on ``device``: ``gloo`` on CPU; on CUDA ``nccl``, or with
    ``cpu_collectives`` ``cpu:gloo,cuda:nccl`` (CUDA tensors over NCCL, CPU tensors over gloo: the
    ``async_mode: ranks`` queue sends its batches as host bytes while the weights stay on the device)."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


def init(device: str = "auto", timeout_s: float | None = None, cpu_collectives: bool = False) -> DistEnv:
    """Return ``(rank, world_size, device)`` from the torchrun environment, initialising the process group.

    Without torchrun (no ``WORLD_SIZE`` in the environment, or 1) no process group is created and the
    result is rank 0 of 1: the same code path as N ranks. NCCL on CUDA, gloo on CPU. Once
    ``use_role_env`` has set this process's role (``async_mode: ranks``), that ``DistEnv`` is returned.

    Args:
        device: ``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda``, or a device string.
        timeout_s: how long a collective waits for the other ranks before it fails (gloo raises in the
            waiting call; NCCL's watchdog aborts the process); None: torch's default (10 minutes for NCCL,
            30 for gloo). Only applies when this call creates the process group.
        cpu_collectives: on CUDA, also give CPU tensors a backend (``_backend``). Only applies when this
            call creates the process group.

    Returns:
        A ``DistEnv``.
    """
    if _ROLE_ENV:
        return _ROLE_ENV[0]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        dist.init_process_group(
            backend=_backend(dev, cpu_collectives), **timeout, **_elastic_store(rank, world_size)
        )
        # Without it, gloo's threads can outlive the interpreter: "terminate called without an active
        # exception" (SIGABRT) at exit after a finished run (seen once, in tutorial 08 under CI).
        atexit.register(_destroy)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def is_collective_failure(error: BaseException) -> bool:
    """True for the error a failed collective raises: a ``torch.distributed.DistError`` (NCCL, the store) or
    a gloo ``RuntimeError`` (a timeout, a peer that closed its connection)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and "/gloo/" in str(error)


def barrier(env: DistEnv) -> None:
    """Wait for every rank of ``env.group`` (nothing at world size 1)."""
    if env.world_size > 1:
        dist.barrier(group=env.group)


def main_rank_first(fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0 first, then on the other ranks once rank 0 has succeeded; just ``fn()`` outside a
    process group of several ranks.

    For work that fills a cache the ranks share, such as a base model built on first use: transformers'
    ``save_pretrained`` writes nothing on a rank other than 0 while a process group is initialised, so the
    rank that builds must be rank 0, and the others then find the folder built. The ranks agree on rank 0's
    outcome (one all-reduce) before the others run, so a failure on rank 0 does not leave them waiting.

    Raises:
        whatever ``fn`` raises on rank 0 (there); RuntimeError on the other ranks when rank 0 failed.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    rank = dist.get_rank()
    error: BaseException | None = None
    if rank == 0:
        try:
            out = fn()
        except BaseException as e:  # re-raised below, once every rank knows
            error = e
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    failed = torch.tensor([float(error is not None)], device=device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"rank {rank}: rank 0 failed at what every rank waits for (its error is in rank 0's log)")
    return out if rank == 0 else fn()


__all__ = [
    "DistEnv",
    "barrier",
    "init",
    "is_collective_failure",
    "main_rank_first",
    "use_role_env",
]
