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

With ``async_mode: ranks`` (under torchrun) the rollout ranks run the same schedule for real
(``serve_rollouts``): they produce ``B_{t+k}`` once they hold the weights of version t (as T shards for T
trainer ranks, shard r as rank r of a colocated T-rank run would, by the rollout rank owning it), and send
each batch's shards to every trainer rank, which receive them into the same queue (``next_rollouts``) and
publish the weights after each step (``publish``); the transport is ``rlbits.distributed.async_ranks``.
With ``async_schedule: eager`` (one rollout rank) it instead produces back to back with the newest weights it
holds (batch i with version v only if i <= v + k), the trainer sends each version without waiting for it to
be taken, and with ``partial_rollouts`` new weights are taken between decode steps (``_serve_eager``).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

from rlbits.distributed.env import DistEnv
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
    logged, and ``produced``: the batches produced so far (the next one's index). At world size N each batch
    is N shards, one per rank, all held by every rank in rank order (``shards``), so the queue that rank 0's
    checkpoint saves is every rank's. Saved with the state (``state_dict`` / ``load_state_dict``, JSON); empty
    with ``async_mode: off``."""

    def __init__(self) -> None:
        self.produced = 0
        self.shards = 1
        self.pending: list[tuple[TensorDictBase, list[list[Any]]]] = []
        self.link: _TrainerLink | None = None
        """With ``async_mode: ranks``, on the trainer: the rollout ranks' end (not saved)."""

    def __len__(self) -> int:
        return len(self.pending)

    def state_dict(self) -> dict[str, Any]:
        return {
            "produced": self.produced,
            "shards": self.shards,
            "pending": [{"batch": encode_batch(b), "metrics": m} for b, m in self.pending],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a checkpoint without a queue (``produced`` absent) restores an
        empty one.

        Raises:
            ValueError: a malformed queue (nothing is changed).
        """
        if "produced" not in saved:
            self.produced, self.shards, self.pending = 0, 1, []
            return
        produced, shards, pending = saved["produced"], saved.get("shards", 1), saved.get("pending", [])
        if isinstance(produced, bool) or not isinstance(produced, int) or produced < 0:
            raise ValueError(f"rollout queue: produced must be an int >= 0, got {produced!r:.80}")
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise ValueError(f"rollout queue: shards must be an int >= 1, got {shards!r:.80}")
        if not isinstance(pending, list) or len(pending) > produced * shards or len(pending) % shards:
            raise ValueError("rollout queue: pending must be a list of at most `produced` batches of `shards` shards")
        loaded = []
        for entry in pending:
            metrics = entry.get("metrics", []) if isinstance(entry, dict) else None
            if not isinstance(metrics, list) or not all(isinstance(r, list) and len(r) == 3 for r in metrics):
                raise ValueError("rollout queue: each pending entry needs metrics as [kind, name, value] rows")
            loaded.append((decode_batch(entry.get("batch", {})), metrics))
        self.produced, self.shards, self.pending = produced, shards, loaded


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
    - ``ranks`` (on every trainer rank; ``produce`` is not called): the batches come from the rollout ranks
      (``serve_rollouts``) until batch ``step`` has arrived, then as ``simulated``; the first call sends the
      rollout ranks the weights and where to start. With T trainer ranks each batch is T shards (the queue
      holds them all, in trainer-rank order) and trainer rank r trains on shard r. Adds ``time/trainer_idle``
      and ``time/rollout_idle`` (seconds blocked waiting for the other side; the means over the trainer
      ranks and over the rollout ranks).
      With ``cfg.async_schedule: eager`` the versions the batches carry depend on timing (docs/async.md).
    """
    if cfg.async_mode == "off":
        return stamp_version(produce(), state.step)
    queue: RolloutQueue = state.rollout_queue
    k, dropped, shards, shard = cfg.max_staleness, 0, state.env.world_size, state.env.rank
    if queue.pending and queue.shards != shards:  # a resumed queue: one shard per rank of the saving run
        raise RuntimeError(
            f"the checkpoint's rollout queue holds each batch in {queue.shards} shards (one per rank), this run "
            f"has {shards} ranks: resume async_mode: {cfg.async_mode} at the world size it was saved with"
            + (" (trainer ranks: the world size less rollout_ranks)" if cfg.async_mode == "ranks" else "")
        )
    queue.shards = shards
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
        batch, rows = [queue.pending.pop(0) for _ in range(shards)][shard]
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
    if "token_version" in batch.keys():  # partial rollouts: the tokens' own lag (rows count their oldest token's)
        mask = batch["action_mask"]
        token_lag = (state.step - batch["token_version"]).masked_fill(~mask, 0)
        state.metrics.mean("staleness/token_mean", token_lag.sum().float(), mask.sum().float())
    return batch


def _produce_into(produce: Callable[[], TensorDictBase], state: Any) -> None:
    """Produce the next batch into ``state.rollout_queue`` with its statistics kept aside."""
    queue, env = state.rollout_queue, state.env
    outer, state.metrics = state.metrics, StepMetrics()
    try:
        batch = stamp_version(produce(), state.step)
    finally:
        produced_metrics, state.metrics = state.metrics, outer
    rows = _metric_rows(produced_metrics)
    if env.world_size == 1:
        queue.pending.append((batch, rows))
    else:  # every rank keeps every rank's shard (as the ranks mode's trainers do): rank 0's checkpoint saves all
        from rlbits.distributed.async_ranks import all_gather_json

        shards = all_gather_json({"batch": encode_batch(batch), "metrics": rows}, env)
        queue.pending += [(batch, rows) if r == env.rank else (decode_batch(s["batch"]), s["metrics"])
                          for r, s in enumerate(shards)]
    queue.produced += 1


# --- async_mode: ranks ------------------------------------------------------------------------------------

ROLLOUT_GENERATORS = ("sampling_generator",)
"""The generators the rollout side draws from (the trainer keeps the others)."""


def _rollout_state(state: Any) -> dict[str, Any]:
    """The rollout side's position: the prompt stream's and the sampling generators' states (JSON)."""
    gens = {name: base64.b64encode(getattr(state, name).get_state().numpy().tobytes()).decode("ascii")
            for name in ROLLOUT_GENERATORS}
    return {"stream": state.stream.state_dict(), "generators": gens}


def _set_generator_state(gen: torch.Generator, data: str) -> None:
    gen.set_state(torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8).clone())


def _load_rollout_state(state: Any, saved: dict[str, Any]) -> None:
    state.stream.load_state_dict(saved["stream"])
    for name, data in saved["generators"].items():
        _set_generator_state(getattr(state, name), data)


class _TrainerLink:
    """A trainer rank's end of the rollout ranks: trainer rank 0 sends the start (version, batches produced,
    the rollout side's position) to all of them and every other trainer rank its shard's sampling generators
    to the rollout rank that produces its shard; all of them send the weights (``broadcast_weights``) and
    receive every batch (all ``shards`` of it, one message per rollout rank) in index order."""

    def __init__(self, state: Any, cfg: Any) -> None:
        from rlbits.distributed.async_ranks import TRAINER_RANK, broadcast_json, broadcast_weights, send_json

        self.roles, self.k = _roles(), cfg.max_staleness
        self.shards = len(self.roles.trainer_ranks)
        self.eager, self.weight_sends = cfg.async_schedule == "eager", []
        self.src = self.roles.rollout_ranks[0]  # the eager schedule's one rollout rank
        self.is_first = self.roles.rank == TRAINER_RANK
        queue = state.rollout_queue
        t0, sends = time.monotonic(), []
        # the rollout ranks resume from the last batch received: the queue holds those after it
        if self.is_first:
            start = {"version": state.step, "produced": queue.produced, "rollout_state": _rollout_state(state)}
            broadcast_json(start, self.roles)
        else:
            sends = send_json(_rollout_state(state), self.roles.owner_of(self.roles.rank))
        broadcast_weights(state.policy, self.roles)
        for work, _ in sends:
            work.wait()
        self.version, self.received = state.step, queue.produced
        state.metrics.same("time/trainer_idle", time.monotonic() - t0)

    def receive(self, state: Any) -> None:
        """The next batch (its shards) into ``state.rollout_queue``, this trainer rank's shard's rollout side's
        position into ``state`` (what a checkpoint saves), the idle times into ``state.metrics``."""
        from rlbits.distributed.async_ranks import recv_json

        queue = state.rollout_queue
        t0 = time.monotonic()
        msgs = {src: recv_json(src) for src in self.roles.rollout_ranks}
        state.metrics.same("time/trainer_idle", time.monotonic() - t0)
        shards = _merge_shards(msgs, self.roles, queue.produced)
        _load_rollout_state(state, shards[state.env.rank]["rollout_state"])
        state.metrics.same("time/rollout_idle", sum(float(m["idle_s"]) for m in msgs.values()) / len(msgs))
        queue.pending += [(decode_batch(s["batch"]), s["metrics"]) for s in shards]
        queue.produced += 1
        self.received += 1

    def publish(self, state: Any, version: int) -> None:
        """Send the weights as ``version``, then receive the batches up to ``version + k - 1`` (those the
        rollout ranks produced with the previous weights meanwhile): the queue a checkpoint of this step saves."""
        from rlbits.distributed.async_ranks import broadcast_json, broadcast_weights, isend_weights

        t0 = time.monotonic()
        self.version = version
        if self.eager:  # sent without waiting; the rollout rank takes them when it looks (serve_rollouts)
            self._wait_weight_sends()
            self.weight_sends = isend_weights(state.policy, self.roles, version)
            state.metrics.same("time/trainer_idle", time.monotonic() - t0)
            return
        if self.is_first:
            broadcast_json({"version": self.version}, self.roles)
        broadcast_weights(state.policy, self.roles)
        state.metrics.same("time/trainer_idle", time.monotonic() - t0)
        while state.rollout_queue.produced < self.version + self.k:
            self.receive(state)

    def stop(self) -> None:
        """Tell the rollout ranks to stop (trainer rank 0), and take the batches they produced with the last
        weights (unused)."""
        from rlbits.distributed.async_ranks import broadcast_json, isend_weights, recv_json

        if self.eager:  # the rollout rank answers the stop with an end message after its last batch
            self._wait_weight_sends()
            self.weight_sends = isend_weights(None, self.roles, self.version, stop=True)
            while not recv_json(self.src).get("end"):
                pass
            self._wait_weight_sends()
            return
        if self.is_first:
            broadcast_json({"stop": True}, self.roles)
        for _ in range(self.received, self.version + self.k + 1):
            for src in self.roles.rollout_ranks:
                recv_json(src)

    def _wait_weight_sends(self) -> None:
        for work, _ in self.weight_sends:
            work.wait()
        self.weight_sends = []


def _merge_shards(msgs: dict[int, Any], roles: Any, index: int) -> list[dict[str, Any]]:
    """Batch ``index``'s shards in trainer-rank order, from ``msgs``: each rollout rank's message (by world
    rank) holding the shards it owns (``RankRoles.shards_of``), in their order.

    Raises:
        RuntimeError: a message of another batch, or with another number of shards than its rollout rank owns.
    """
    out: list[Any] = [None] * len(roles.trainer_ranks)
    for src, msg in msgs.items():
        owned = roles.shards_of(src)
        if msg["index"] != index or len(msg["shards"]) != len(owned):
            raise RuntimeError(
                f"rollout rank {src} sent batch {msg['index']} in {len(msg['shards'])} shards, expected batch "
                f"{index} in {len(owned)} (shards {list(owned)})"
            )
        for shard, part in zip(owned, msg["shards"], strict=True):
            out[shard] = part
    return out


_ROLES: list[Any] = []


def _roles() -> Any:
    """This process's ``RankRoles`` (``rank_role`` sets them)."""
    if not _ROLES:
        raise RuntimeError("async_mode: ranks needs rank_role(cfg) called first (the loop's train does)")
    return _ROLES[0]


def rank_role(cfg: Any) -> str:
    """``"off"`` unless ``cfg.async_mode`` is ``ranks``; then split torchrun's ranks (every rank calls it
    once, before the run starts: ``rlbits.distributed.async_ranks.split_ranks``) and return this rank's
    role, ``"trainer"`` (the first world size - ``cfg.rollout_ranks`` ranks) or ``"rollout"``.

    Raises:
        ConfigError: ``partial_rollouts`` with a multi-turn task; not under torchrun, or ``cfg.rollout_ranks``
            leaves no trainer rank or exceeds the trainer ranks (a rollout rank produces whole shards), or
            ``dynamic_sampling`` with several trainer ranks (its draws are agreed over the ranks).
    """
    from rlbits.distributed.async_ranks import split_ranks
    from rlbits.loops.config import ConfigError

    if cfg.async_mode != "ranks":
        return "off"
    if getattr(cfg, "partial_rollouts", False) and cfg.task is not None:
        from rlbits.tasks import get_task

        if getattr(get_task(cfg.task), "make_env", None) is not None:  # before any rank waits on another
            raise ConfigError(
                f"partial_rollouts apply to single-turn rollouts; task {cfg.task!r} is multi-turn (its episodes "
                "are not decoded in one generate call); set partial_rollouts: false"
            )
    if not _ROLES:
        import os

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world < cfg.rollout_ranks + 1:
            raise ConfigError(
                f"async_mode: ranks runs under torchrun with at least rollout_ranks + 1 = {cfg.rollout_ranks + 1} "
                f"processes (the trainer ranks, then the rollout ranks), got world size {world}"
            )
        trainers = world - cfg.rollout_ranks
        if cfg.rollout_ranks > trainers:
            raise ConfigError(
                f"rollout_ranks: {cfg.rollout_ranks} with {trainers} trainer ranks (world size {world}): at most as "
                "many rollout ranks as trainer ranks, since each rollout rank produces whole shards of a batch (a "
                "shard is one colocated trainer rank's draw and cannot be split without changing the samples); "
                f"use rollout_ranks <= {world // 2}"
            )
        if world > cfg.rollout_ranks + 1 and getattr(cfg, "dynamic_sampling", False):
            raise ConfigError(
                f"dynamic_sampling with async_mode: ranks runs with one trainer rank (and so one rollout rank: "
                f"world size 2), got {trainers}: its extra draws are agreed over the trainer ranks, which rollout "
                "ranks producing their shards in turn cannot emulate; use async_mode: simulated"
            )
        try:
            _ROLES.append(split_ranks(cfg.rollout_ranks, cfg.device, cfg.collective_timeout_s))
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return "rollout" if _ROLES[0].is_rollout else "trainer"


def publish(state: Any, cfg: Any) -> None:
    """After step ``state.step``'s update, with ``async_mode: ranks`` (every trainer rank calls it): the new
    weights (version step + 1) to the rollout ranks, and their batches up to step + 1 + k received
    (``_TrainerLink.publish``). Nothing otherwise."""
    link = state.rollout_queue.link
    if cfg.async_mode == "ranks" and link is not None:
        link.publish(state, state.step + 1)


def stop_rollouts(state: Any, cfg: Any) -> None:
    """At the end of a run with ``async_mode: ranks`` (every trainer rank calls it): stop the rollout ranks.
    Nothing otherwise."""
    if cfg.async_mode != "ranks":
        return
    link = state.rollout_queue.link or _TrainerLink(state, cfg)  # a run that took no step starts it too
    link.stop()
    state.rollout_queue.link = None


def serve_rollouts(
    cfg: Any, init_state: Callable[..., Any], produce: Callable[[Any], TensorDictBase], **inputs: Any
) -> Path:
    """A rollout rank of ``async_mode: ranks`` (docs/async.md): build the loop's state as a 1-process run
    does (``init_state(cfg, env, setup=, **inputs)``; ``inputs``: ``reward``, ``prompts``, ``val_prompts``),
    then until the trainer says stop: take the weights and version v (in place into ``state.policy``),
    produce and send the batches up to index v + k with version v, each with its statistics, the rollout
    side's position after it and the seconds spent waiting for weights since the previous one, to every
    trainer rank.

    With T trainer ranks a batch is T shards, shard r the rows rank r of a colocated run at world size T
    would produce (``produce(state)`` with ``state.env`` rank r of T, so the prompt stream gives it rank r's
    slice of the same draw, and with rank r's sampling generator), each with its own statistics. Of the R
    rollout ranks, each produces the shards it owns (``RankRoles.shards_of``: r with r % R == its index) and
    sends them as one message per batch. Writes nothing to the run directory; returns ``cfg.run_dir``."""
    from rlbits.distributed.async_ranks import broadcast_json, broadcast_weights, recv_json
    from rlbits.loops.runtime import Setup, setup

    roles = _roles()
    state = init_state(cfg, setup(cfg), setup=Setup.of(cfg), **inputs)
    trainers, owned = roles.trainer_ranks, roles.shards_of(roles.rank)
    ctrl = broadcast_json(None, roles)  # trainer rank 0's start: its position is shard 0's
    starts = [ctrl["rollout_state"] if r == 0 else recv_json(trainers[r]) for r in owned]
    broadcast_weights(state.policy, roles)
    shards = [_ShardState(state, start, r, len(trainers)) for r, start in zip(owned, starts, strict=True)]
    produced, version, idle, sends = ctrl["produced"], ctrl["version"], 0.0, []
    if cfg.async_schedule == "eager":
        _serve_eager(cfg, state, produce, shards, produced, version)
        return Path(cfg.run_dir)
    while True:
        while produced <= version + cfg.max_staleness:
            sends += _send_batch(state, shards, produce, lambda v=version: v, produced, idle, trainers)
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


EAGER_POLL_S = 0.002
"""How long the ``eager`` rollout rank sleeps when it may not produce (k + 1 batches ahead) and no weights
have arrived, between two looks."""


def _serve_eager(
    cfg: Any, state: Any, produce: Callable[[Any], TensorDictBase], shards: list[_ShardState], produced: int,
    version: int,
) -> None:
    """The rollout rank's ``async_schedule: eager`` loop (docs/async.md): between batches, take the newest
    weights that have arrived (``WeightInbox``, without blocking); produce batch ``produced`` when it is at
    most ``version + k`` (its rows then train at most k versions old), else sleep ``EAGER_POLL_S``; on the
    trainer's stop, send every trainer an end message. With ``cfg.partial_rollouts`` the decode loop also
    looks for new weights between two decode steps (``state.decode_hook``, ``generate(on_step=...)``); a
    row's ``policy_version`` is then its oldest token's (``token_version``)."""
    from rlbits.distributed.async_ranks import WeightInbox, send_json

    roles, inbox, k = _roles(), WeightInbox(), cfg.max_staleness
    trainers, idle, sends, stop = roles.trainer_ranks, 0.0, [], False

    def take() -> None:  # the newest weights that have arrived (each update is taken in turn)
        nonlocal version, stop
        while not stop and (got := inbox.take(state.policy)) is not None:
            new, stop = got
            if not stop:
                version = new
                if getattr(state, "decode_copy", None) is not None:  # precision: bf16 decodes from a copy
                    from rlbits.loops.phases import bf16_copy

                    bf16_copy(state.policy, state.decode_copy)

    def on_step(t: int) -> int:
        before = version
        take()
        if version != before:
            state.metrics.sum("staleness/partial_updates", 1.0)
        return version

    state.decode_hook = on_step if cfg.partial_rollouts else None
    while True:
        take()
        if stop:
            break
        if produced > version + k:  # k + 1 batches ahead of the trainer's newest weights: wait for newer ones
            t0 = time.monotonic()
            time.sleep(EAGER_POLL_S)
            idle += time.monotonic() - t0
            continue
        sends += _send_batch(
            state, shards, produce, lambda: version, produced, idle, trainers, partial=cfg.partial_rollouts
        )
        produced, idle = produced + 1, 0.0
        sends = [(w, t) for w, t in sends if not w.is_completed()]
    sends += send_json({"end": True}, trainers)
    for work, _ in sends:
        work.wait()


def _send_batch(
    state: Any, shards: list[_ShardState], produce: Callable[[Any], TensorDictBase], version: Callable[[], int],
    index: int, idle_s: float, trainers: Sequence[int], partial: bool = False,
) -> list[Any]:
    """Produce batch ``index`` as this rollout rank's ``shards``, in turn, each as its colocated rank draws (no
    collective runs here), its rows stamped with ``version()`` read just before the shard's production
    (``_stamp_oldest``), and send it to every trainer rank without waiting; returns the sends' works. With
    ``partial`` (partial rollouts) every shard's statistics carry ``staleness/partial_updates``, so the
    trainer ranks reduce the same keys."""
    from rlbits.distributed.async_ranks import send_json

    out = []
    for shard in shards:
        with shard.active(state):
            if partial:
                state.metrics.sum("staleness/partial_updates", 0.0)
            start = version()  # before the production, which may take newer weights (partial rollouts)
            batch = _stamp_oldest(produce(state), start)
            rows, position = _metric_rows(state.metrics), _rollout_state(state)
            out.append({"batch": encode_batch(batch), "metrics": rows, "rollout_state": position})
    return send_json({"index": index, "shards": out, "idle_s": idle_s}, trainers)


def _stamp_oldest(batch: TensorDictBase, version: int) -> TensorDictBase:
    """``policy_version`` of each row: ``version`` (the weights its production started with), or with
    ``token_version`` (partial rollouts) the oldest version among its action tokens."""
    stamp_version(batch, version)
    if "token_version" in batch.keys():
        tokens = batch["token_version"].masked_fill(~batch["action_mask"], torch.iinfo(torch.int64).max)
        oldest = tokens.min(dim=1).values
        batch[VERSION_KEY] = torch.where(oldest == torch.iinfo(torch.int64).max, batch[VERSION_KEY], oldest)
    return batch


class _ShardState:
    """On the rollout rank, what shard ``rank`` of ``shards`` draws from, as rank ``rank`` of a colocated run
    at world size ``shards`` would: its ``DistEnv`` (for the prompt stream's slice; ``state.env`` itself for
    one shard), its prompt stream position and its rollout generators (shard 0 uses ``state``'s own), from
    ``start`` (``_rollout_state``). ``active(state)`` puts them in ``state`` around one production."""

    def __init__(self, state: Any, start: dict[str, Any], rank: int, shards: int) -> None:
        self.env = DistEnv(rank, shards, state.env.local_rank, state.env.device) if shards > 1 else state.env
        self.stream = start["stream"]
        self.generators = {}
        for name in ROLLOUT_GENERATORS:
            own = getattr(state, name)
            self.generators[name] = own if rank == 0 else torch.Generator(device=own.device)
            _set_generator_state(self.generators[name], start["generators"][name])

    @contextlib.contextmanager
    def active(self, state: Any) -> Iterator[None]:
        """``state`` as this shard's rank would hold it (a fresh ``state.metrics``); its stream position is
        kept after a production that raised nothing."""
        env, saved = state.env, {name: getattr(state, name) for name in ROLLOUT_GENERATORS}
        state.env, state.metrics = self.env, StepMetrics()
        state.stream.load_state_dict(self.stream)
        for name, gen in self.generators.items():
            setattr(state, name, gen)
        try:
            yield
            self.stream = state.stream.state_dict()
        finally:
            state.env = env
            for name, gen in saved.items():
                setattr(state, name, gen)


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
