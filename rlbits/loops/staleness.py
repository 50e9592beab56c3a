"""Asynchronous RL with bounded staleness, simulated in one process (docs/async.md).

Every rollout row records ``policy_version`` [B] int64: the steps the policy that sampled it had taken
(``state.step`` when it was sampled; the trainer publishes its weights once per step). With ``async_mode:
simulated`` and ``max_staleness: k`` the loop trains step t (0-based, policy version t) on the batch that the
policy of version ``max(0, t - k)`` produced, as rollout workers that generate continuously, ``k`` batches
ahead of the trainer through a bounded queue, would produce it:

    step 0     produce B_0 .. B_k with version 0, train on B_0
    step t>0   produce B_{t+k} with version t, train on B_t (version max(0, t - k))

Batches are produced in their index order, so the prompt stream and the sampling generator are drawn in the
same order as by one rollout worker. ``RolloutQueue`` holds the batches produced ahead (at most k + 1) with
the statistics their production logged; it is a field of the loop's state, so a checkpoint saves it in
``state.json`` and a resumed run trains on the very rows the uninterrupted run would.

With ``async_mode: ranks`` (under torchrun) a rollout rank runs the same schedule for real
(``serve_rollouts``): it produces ``B_{t+k}`` once it holds the weights of version t, and sends each batch to
the trainer, which receives them into the same queue (``next_rollouts``) and publishes its weights after each
step (``publish``); the transport is ``rlbits.distributed.async_ranks``.
"""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

from rlbits.loops.metrics import StepMetrics

VERSION_KEY = "policy_version"
"""The batch key (docs/batch.md) of each row's policy version."""


def stamp_version(batch: TensorDictBase, version: int) -> TensorDictBase:
    """Write ``policy_version`` [B] int64 = ``version`` (on the device of ``batch["action_mask"]``); returns
    ``batch``."""
    device = batch["action_mask"].device if "action_mask" in batch.keys() else None
    batch[VERSION_KEY] = torch.full((batch.batch_size[0],), int(version), dtype=torch.int64, device=device)
    return batch


def encode_batch(batch: TensorDictBase) -> dict[str, Any]:
    """A flat batch as JSON: each tensor as ``{dtype, shape, data}`` (its bytes in base64, so the round trip
    is bit-exact), each string column as a list of ``str``.

    Raises:
        TypeError: a column that is neither a tensor nor a column of strings.
    """
    columns: dict[str, Any] = {}
    for key in batch.keys():
        value = batch.get(key)
        if is_non_tensor(value):
            texts = value.tolist()
            if not all(isinstance(t, str) for t in texts):
                raise TypeError(f"cannot save batch column {key!r}: a non-tensor column must hold strings")
            columns[key] = {"strings": texts}
        elif isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
            data = base64.b64encode(raw.numpy().tobytes()).decode("ascii")
            columns[key] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}
        else:
            raise TypeError(f"cannot save batch column {key!r} of type {type(value).__name__}")
    return {"rows": int(batch.batch_size[0]), "columns": columns}


def decode_batch(saved: dict[str, Any]) -> TensorDictBase:
    """The CPU batch ``encode_batch`` wrote.

    Raises:
        ValueError: ``saved`` is not what ``encode_batch`` writes.
    """
    try:
        rows, columns = int(saved["rows"]), saved["columns"]
        out = TensorDict({}, batch_size=[rows])
        for key, col in columns.items():
            if "strings" in col:
                out.set(key, NonTensorStack.from_list(list(col["strings"])))
                continue
            dtype = getattr(torch, col["dtype"])
            raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
            data = bytearray(base64.b64decode(col["data"]))
            t = torch.frombuffer(data, dtype=raw_dtype) if data else torch.empty(0, dtype=raw_dtype)
            out.set(key, t.view(dtype).reshape(col["shape"]).clone())
    except (KeyError, TypeError, AttributeError, RuntimeError, ValueError) as e:
        raise ValueError(f"a saved rollout batch does not load: {e}") from e
    return out


def _metric_rows(metrics: StepMetrics) -> list[list[Any]]:
    return [[kind, name, float(metrics.td[kind, name])] for kind, name in
            metrics.td.keys(include_nested=True, leaves_only=True)]


def merge_metrics(rows: list[list[Any]], into: StepMetrics) -> None:
    """Add the statistics ``_metric_rows`` listed (a production's) to ``into``, with their reductions."""
    values = {(kind, name): value for kind, name, value in rows}
    for (kind, name), value in values.items():
        if kind == "num":
            into.mean(name, value, values[("den", name)])
        elif kind in ("sum", "same", "max"):
            getattr(into, kind)(name, value)


class RolloutQueue:
    """The batches produced ahead of the trainer (oldest first), each with the statistics its production
    logged, and ``produced``: the batches produced so far (the next one's index). Saved with the state
    (``state_dict`` / ``load_state_dict``, JSON); empty with ``async_mode: off``."""

    def __init__(self) -> None:
        self.produced = 0
        self.pending: list[tuple[TensorDictBase, list[list[Any]]]] = []
        self.link: _TrainerLink | None = None
        """With ``async_mode: ranks``, on the trainer: the rollout rank's end (not saved)."""

    def __len__(self) -> int:
        return len(self.pending)

    def state_dict(self) -> dict[str, Any]:
        return {
            "produced": self.produced,
            "pending": [{"batch": encode_batch(b), "metrics": m} for b, m in self.pending],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a checkpoint without a queue (``produced`` absent) restores an
        empty one.

        Raises:
            ValueError: a malformed queue (nothing is changed).
        """
        if "produced" not in saved:
            self.produced, self.pending = 0, []
            return
        produced, pending = saved["produced"], saved.get("pending", [])
        if isinstance(produced, bool) or not isinstance(produced, int) or produced < 0:
            raise ValueError(f"rollout queue: produced must be an int >= 0, got {produced!r:.80}")
        if not isinstance(pending, list) or len(pending) > produced:
            raise ValueError("rollout queue: pending must be a list of at most `produced` batches")
        loaded = []
        for entry in pending:
            metrics = entry.get("metrics", []) if isinstance(entry, dict) else None
            if not isinstance(metrics, list) or not all(isinstance(r, list) and len(r) == 3 for r in metrics):
                raise ValueError("rollout queue: each pending entry needs metrics as [kind, name, value] rows")
            loaded.append((decode_batch(entry.get("batch", {})), metrics))
        self.produced, self.pending = produced, loaded


def next_rollouts(state: Any, cfg: Any, produce: Callable[[], TensorDictBase]) -> TensorDictBase:
    """The batch step ``state.step`` trains on, by ``cfg.async_mode`` (docs/async.md).

    ``produce()``: the loop's rollout side (rollout, score, ...) with ``state.policy`` as it is now, writing its
    statistics to ``state.metrics``; each batch it returns gets ``policy_version = state.step``.

    - ``off``: ``produce()`` once; the batch has this step's version.
    - ``simulated``: ``produce()`` until ``state.rollout_queue`` has produced batches 0 .. step + k
      (k = ``cfg.max_staleness``), each with its own statistics kept aside; then the oldest batch is taken and
      its statistics added to this step's. A batch more than k versions old (only after resuming with a
      smaller ``max_staleness``) is dropped and the next one taken. Adds ``staleness/mean`` and
      ``staleness/max`` (the rows' version lag ``state.step - policy_version``) and ``staleness/dropped_frac``
      (rows dropped over rows taken or dropped).
    - ``ranks`` (on the trainer rank; ``produce`` is not called): the batches come from the rollout rank
      (``serve_rollouts``) until batch ``step`` has arrived, then as ``simulated``; the first call sends the
      rollout rank the weights and where to start. Adds ``time/trainer_idle`` and ``time/rollout_idle``
      (seconds blocked waiting for the other side).
    """
    if cfg.async_mode == "off":
        return stamp_version(produce(), state.step)
    queue: RolloutQueue = state.rollout_queue
    k, dropped = cfg.max_staleness, 0
    if cfg.async_mode == "ranks":
        if queue.link is None:
            queue.link = _TrainerLink(state, cfg)
        elif queue.link.version < state.step:  # a skipped step (on_nonfinite: skip) published nothing
            queue.link.publish(state, state.step)
        fill, ahead = queue.link.receive, 0
    else:
        fill, ahead = functools.partial(_produce_into, produce), k
    while True:
        while not queue.pending or queue.produced <= state.step + ahead:
            fill(state)
        batch, rows = queue.pending.pop(0)
        batch = batch.to(state.env.device)
        lag = state.step - batch[VERSION_KEY]
        if int(lag.max()) <= k:
            break
        dropped += batch.batch_size[0]
    merge_metrics(rows, state.metrics)
    n = batch.batch_size[0]
    state.metrics.mean("staleness/mean", lag.sum().float(), n)
    state.metrics.max("staleness/max", lag.max().float())
    state.metrics.mean("staleness/dropped_frac", float(dropped), n + dropped)
    return batch


def _produce_into(produce: Callable[[], TensorDictBase], state: Any) -> None:
    """Produce the next batch into ``state.rollout_queue`` with its statistics kept aside."""
    queue = state.rollout_queue
    outer, state.metrics = state.metrics, StepMetrics()
    try:
        batch = stamp_version(produce(), state.step)
    finally:
        produced_metrics, state.metrics = state.metrics, outer
    queue.pending.append((batch, _metric_rows(produced_metrics)))
    queue.produced += 1


# --- async_mode: ranks ------------------------------------------------------------------------------------

ROLLOUT_GENERATORS = ("sampling_generator",)
"""The generators the rollout side draws from (the trainer keeps the others)."""


def _rollout_state(state: Any) -> dict[str, Any]:
    """The rollout side's position: the prompt stream's and the sampling generators' states (JSON)."""
    gens = {name: base64.b64encode(getattr(state, name).get_state().numpy().tobytes()).decode("ascii")
            for name in ROLLOUT_GENERATORS}
    return {"stream": state.stream.state_dict(), "generators": gens}


def _load_rollout_state(state: Any, saved: dict[str, Any]) -> None:
    state.stream.load_state_dict(saved["stream"])
    for name, data in saved["generators"].items():
        raw = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8).clone()
        getattr(state, name).set_state(raw)


class _TrainerLink:
    """The trainer's end of the rollout rank: sends the start (version, batches produced, the rollout
    side's position) and the weights; receives the batches in index order."""

    def __init__(self, state: Any, cfg: Any) -> None:
        from rlbits.distributed.async_ranks import broadcast_json, broadcast_weights

        self.roles, self.k = _roles(), cfg.max_staleness
        self.src = self.roles.rollout_ranks[0]
        queue = state.rollout_queue
        # the rollout rank resumes from the last batch received: the checkpointed queue holds those after it
        start = {"version": state.step, "produced": queue.produced, "rollout_state": _rollout_state(state)}
        t0 = time.monotonic()
        broadcast_json(start, self.roles)
        broadcast_weights(state.policy, self.roles)
        self.version, self.received = state.step, queue.produced
        state.metrics.sum("time/trainer_idle", time.monotonic() - t0)

    def receive(self, state: Any) -> None:
        """The next batch into ``state.rollout_queue``, the rollout side's position into ``state`` (what
        a checkpoint saves), its idle time into ``state.metrics``."""
        from rlbits.distributed.async_ranks import recv_json

        queue = state.rollout_queue
        t0 = time.monotonic()
        msg = recv_json(self.src)
        state.metrics.sum("time/trainer_idle", time.monotonic() - t0)
        if msg["index"] != queue.produced:
            raise RuntimeError(f"rollout rank sent batch {msg['index']}, expected batch {queue.produced}")
        _load_rollout_state(state, msg["rollout_state"])
        state.metrics.sum("time/rollout_idle", float(msg["idle_s"]))
        queue.pending.append((decode_batch(msg["batch"]), msg["metrics"]))
        queue.produced += 1
        self.received += 1

    def publish(self, state: Any, version: int) -> None:
        """Send the weights as ``version``, then receive the batches up to ``version + k - 1`` (those the
        rollout rank produced with the previous weights meanwhile): the queue a checkpoint of this step saves."""
        from rlbits.distributed.async_ranks import broadcast_json, broadcast_weights

        t0 = time.monotonic()
        self.version = version
        broadcast_json({"version": self.version}, self.roles)
        broadcast_weights(state.policy, self.roles)
        state.metrics.sum("time/trainer_idle", time.monotonic() - t0)
        while state.rollout_queue.produced < self.version + self.k:
            self.receive(state)

    def stop(self) -> None:
        """Tell the rollout rank to stop, and take the batches it produced with the last weights (unused)."""
        from rlbits.distributed.async_ranks import broadcast_json, recv_json

        broadcast_json({"stop": True}, self.roles)
        for _ in range(self.received, self.version + self.k + 1):
            recv_json(self.src)


_ROLES: list[Any] = []


def _roles() -> Any:
    """This process's ``RankRoles`` (``rank_role`` sets them)."""
    if not _ROLES:
        raise RuntimeError("async_mode: ranks needs rank_role(cfg) called first (the loop's train does)")
    return _ROLES[0]


def rank_role(cfg: Any) -> str:
    """``"off"`` unless ``cfg.async_mode`` is ``ranks``; then split torchrun's ranks (every rank calls it
    once, before the run starts: ``rlbits.distributed.async_ranks.split_ranks``) and return this rank's
    role, ``"trainer"`` or ``"rollout"``.

    Raises:
        ConfigError: not under torchrun, or ``cfg.rollout_ranks`` leaves no trainer rank, or more than one
            trainer rank (one trainer rank is what is built).
    """
    from rlbits.distributed.async_ranks import split_ranks
    from rlbits.loops.config import ConfigError

    if cfg.async_mode != "ranks":
        return "off"
    if not _ROLES:
        import os

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != cfg.rollout_ranks + 1:
            raise ConfigError(
                f"async_mode: ranks runs under torchrun with rollout_ranks + 1 = {cfg.rollout_ranks + 1} processes "
                f"(one trainer rank), got world size {world}"
            )
        try:
            _ROLES.append(split_ranks(cfg.rollout_ranks, cfg.device, cfg.collective_timeout_s))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return "rollout" if _ROLES[0].is_rollout else "trainer"


def publish(state: Any, cfg: Any) -> None:
    """After step ``state.step``'s update, with ``async_mode: ranks``: the new weights (version step + 1) to
    the rollout rank, and its batches up to step + 1 + k received (``_TrainerLink.publish``). Nothing
    otherwise."""
    link = state.rollout_queue.link
    if cfg.async_mode == "ranks" and link is not None:
        link.publish(state, state.step + 1)


def stop_rollouts(state: Any, cfg: Any) -> None:
    """At the end of a run with ``async_mode: ranks`` (trainer): stop the rollout rank. Nothing otherwise."""
    if cfg.async_mode != "ranks":
        return
    link = state.rollout_queue.link or _TrainerLink(state, cfg)  # a run that took no step starts it too
    link.stop()
    state.rollout_queue.link = None


def serve_rollouts(
    cfg: Any, init_state: Callable[..., Any], produce: Callable[[Any], TensorDictBase], **inputs: Any
) -> Path:
    """The rollout rank of ``async_mode: ranks`` (docs/async.md): build the loop's state as a 1-process run
    does (``init_state(cfg, env, setup=, **inputs)``; ``inputs``: ``reward``, ``prompts``, ``val_prompts``),
    then until the trainer says stop: take the weights and version v (in place into ``state.policy``),
    produce (``produce(state)``) and send the batches up to index v + k with version v, each with its
    statistics, the rollout side's position after it and the seconds spent waiting for weights since the
    previous one. Writes nothing to the run directory; returns ``cfg.run_dir``."""
    from rlbits.distributed.async_ranks import TRAINER_RANK, broadcast_json, broadcast_weights, send_json
    from rlbits.loops.runtime import Setup, setup

    roles = _roles()
    state = init_state(cfg, setup(cfg), setup=Setup.of(cfg), **inputs)
    ctrl = broadcast_json(None, roles)
    broadcast_weights(state.policy, roles)
    _load_rollout_state(state, ctrl["rollout_state"])
    produced, version, idle, sends = ctrl["produced"], ctrl["version"], 0.0, []
    while True:
        while produced <= version + cfg.max_staleness:
            state.metrics = StepMetrics()
            batch = stamp_version(produce(state), version)
            msg = {
                "index": produced, "batch": encode_batch(batch), "metrics": _metric_rows(state.metrics),
                "rollout_state": _rollout_state(state), "idle_s": idle,
            }
            sends += send_json(msg, TRAINER_RANK)
            produced, idle = produced + 1, 0.0
            sends = [(w, t) for w, t in sends if not w.is_completed()]
        t0 = time.monotonic()
        ctrl = broadcast_json(None, roles)
        if ctrl.get("stop"):
            break
        broadcast_weights(state.policy, roles)
        version, idle = ctrl["version"], idle + time.monotonic() - t0
    for work, _ in sends:
        work.wait()
    return Path(cfg.run_dir)


__all__ = [
    "VERSION_KEY",
    "RolloutQueue",
    "decode_batch",
    "encode_batch",
    "merge_metrics",
    "next_rollouts",
    "publish",
    "rank_role",
    "serve_rollouts",
    "stamp_version",
    "stop_rollouts",
]
