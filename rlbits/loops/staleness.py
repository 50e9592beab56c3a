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
"""

from __future__ import annotations

import base64
from collections.abc import Callable
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
    """
    if cfg.async_mode == "off":
        return stamp_version(produce(), state.step)
    queue: RolloutQueue = state.rollout_queue
    k, dropped = cfg.max_staleness, 0
    while True:
        while not queue.pending or queue.produced <= state.step + k:
            outer, state.metrics = state.metrics, StepMetrics()
            try:
                batch = stamp_version(produce(), state.step)
            finally:
                produced_metrics, state.metrics = state.metrics, outer
            queue.pending.append((batch, _metric_rows(produced_metrics)))
            queue.produced += 1
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


__all__ = [
    "VERSION_KEY",
    "RolloutQueue",
    "decode_batch",
    "encode_batch",
    "merge_metrics",
    "next_rollouts",
    "stamp_version",
]
