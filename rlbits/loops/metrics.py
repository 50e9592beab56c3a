"""One step's metrics: accumulated by the phases on each rank, reduced once, logged as one process would.

A phase adds each statistic with the reduction that makes N ranks log exactly what one process holding the
whole batch would log (``tests/distributed/test_dist.py`` checks 1 vs 2 ranks):

- ``mean(name, total, count)``: a ratio of sums, logged as ``sum_ranks(total) / sum_ranks(count)`` (e.g. the
  mean reward: ``rewards.sum()`` over ``B``; a token mean: masked sum over the token count);
- ``sum(name, value)``: a rank's share of a global quantity, logged as ``sum_ranks(value)`` (a loss a kernel
  already divided by the *global* token count it was given; a clip fraction weighted by the global count);
- ``same(name, value)``: a value every rank holds identically (a gradient norm over all shards, a statistic
  the phase all-reduced itself, a coefficient), logged as is;
- ``max(name, value)``: logged as the maximum over ranks.

Values stay tensors on their device until ``reduce``: one all-reduce (sum) of every ``mean``/``sum``/``same``
entry, one more only if there are ``max`` entries, then one host sync. The store is a TensorDict keyed by
``(kind, name)``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rlbits.distributed.env import DistEnv
from rlbits.distributed.reduce import all_reduce_max, all_reduce_sum

_SUMMED = ("num", "den", "sum", "same")


def _as_float64(value: torch.Tensor | float) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64)  # a Python float keeps its 64 bits


class StepMetrics:
    """Accumulates one step's statistics (see the module docstring for the four reductions)."""

    def __init__(self) -> None:
        self.td = TensorDict({}, batch_size=[])

    def _add(self, kind: str, name: str, value: torch.Tensor | float) -> None:
        value = _as_float64(value)
        key = (kind, name)
        old = self.td.get(key, None)
        self.td[key] = value if old is None else old + value.to(old.device)

    def mean(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """Add ``total`` to the numerator and ``count`` to the denominator of ``name``."""
        self._add("num", name, total)
        self._add("den", name, count)

    def sum(self, name: str, value: torch.Tensor | float) -> None:
        """Add this rank's share of ``name`` (shares of all ranks and calls add up to the logged value)."""
        self._add("sum", name, value)

    def same(self, name: str, value: torch.Tensor | float) -> None:
        """Set ``name`` to a value that is identical on every rank (accumulates over calls, like ``sum``)."""
        self._add("same", name, value)

    def max(self, name: str, value: torch.Tensor | float) -> None:
        """Set ``name`` to the maximum of ``value`` over calls and ranks."""
        value = _as_float64(value)
        old = self.td.get(("max", name), None)
        self.td["max", name] = value if old is None else torch.maximum(old, value.to(old.device))

    def update(self, values: dict[str, torch.Tensor | float]) -> None:
        """``same`` for each entry: for statistics already global (or a world size of 1)."""
        for name, value in values.items():
            self.same(name, value)

    def names(self) -> list[str]:
        return sorted({key[1] for key in self.td.keys(include_nested=True, leaves_only=True)})

    def reduce(self, env: DistEnv) -> dict[str, float]:
        """The logged values (Python floats): one all-reduce over ranks for the summed kinds, one for ``max``."""
        out: dict[str, float] = {}
        summed = self.td.select(*[k for k in _SUMMED if k in self.td.keys()])
        if not summed.is_empty():
            flat = summed.flatten_keys(".")
            keys = sorted(flat.keys())  # one order on every rank, whatever order the phases added them in
            totals = all_reduce_sum(torch.stack([flat[k].to(env.device) for k in keys]), env).cpu().tolist()
            totals = dict(zip(keys, totals, strict=True))
            world = float(env.world_size)
            for key, value in totals.items():
                kind, name = key.split(".", 1)
                if kind == "num":
                    out[name] = value / totals[f"den.{name}"] if totals[f"den.{name}"] else 0.0
                elif kind == "sum":
                    out[name] = value
                elif kind == "same":
                    out[name] = value / world
        if "max" in self.td.keys():
            flat = self.td["max"]
            keys = sorted(flat.keys())
            maxima = all_reduce_max(torch.stack([flat[k].to(env.device) for k in keys]), env).cpu().tolist()
            out.update(zip(keys, maxima, strict=True))
        return dict(sorted(out.items()))


__all__ = ["StepMetrics"]
