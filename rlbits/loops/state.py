"""A loop's state: one dataclass holding its models, optimizers, generators, data position and counters.

Each loop subclasses ``LoopState`` with its own fields; the checkpoint reads the fields by type, so a state
is saved and restored as a whole (``Run.save`` / ``Run.start``):

- ``torch.nn.Module`` fields are models (weights in ``dcp/``), except those marked ``frozen()`` (a reference
  policy: rebuilt from the initial weights, never saved);
- ``torch.optim.Optimizer`` fields are optimizers, tied to their model by ``optimizer_of("policy")``;
- ``torch.Generator`` fields are random streams (their states per rank, so a resume is bit-exact);
- fields with ``state_dict()``/``load_state_dict()`` (the prompt stream, the offline sampler) and plain
  ``int``/``float``/``bool``/``str``/``None`` fields are counters, written to ``state.json``;
- fields marked ``runtime()`` (the process's ``DistEnv``, the tokenizer, the reward, this step's metrics)
  are not saved: they come from the config and the process.

What ``Run`` reads from a state (the run contract, docs/design.md "Run lifecycle"): ``trained_model`` (the
model whose context the prompts must fit and that ``final/`` exports; each loop's state defines it) and
``export_replica(cfg)`` (an unsharded model to gather it into, under FSDP2),
``num_samples`` and ``samples_per_step(cfg)`` (the run's length under ``max_num_epochs``, ``total_steps``),
``epoch`` (passes over the data done), ``count_tokens(batch)`` (``tokens_per_s``), and the counters ``step``,
``total_valid_tokens``, ``val_reward`` and ``metrics``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Any

import torch
from tensordict import TensorDictBase

from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.runtime import build_policy

_ROLE = "rlbits_role"


def runtime(**kwargs: Any) -> Any:
    """A field that is not saved (it is rebuilt from the config and the process)."""
    return dataclasses.field(metadata={_ROLE: "runtime"}, **kwargs)


def frozen(**kwargs: Any) -> Any:
    """A model field that is not saved (a frozen reference, rebuilt from the initial weights): ``runtime``."""
    return runtime(**kwargs)


def optimizer_of(model: str, **kwargs: Any) -> Any:
    """An optimizer field over the parameters of the model field ``model``."""
    return dataclasses.field(metadata={_ROLE: "optimizer", "model": model}, **kwargs)


@dataclasses.dataclass(kw_only=True)
class LoopState:
    """What every loop's state holds besides its models: the process, the step counters, this step's metrics."""

    env: DistEnv = runtime(default_factory=DistEnv, repr=False)
    """The process's place in the job (rank, world size, device)."""
    tokenizer: Any = runtime(default=None, repr=False)
    init_path: str | None = runtime(default=None)
    """The folder the trained model was loaded from (the initial policy): what an export replica loads."""
    make_env: Any = runtime(default=None, repr=False)
    """A multi-turn task's ``make_env(prompt, **cfg.env_options) -> Env``, or None (single-turn task)."""
    step: int = 0
    """Steps completed."""
    total_valid_tokens: int = 0
    """Action tokens trained on so far (all ranks)."""
    val_reward: float | None = None
    """Latest validation reward."""
    metrics: StepMetrics = runtime(default_factory=StepMetrics, repr=False)
    """The current step's statistics (reset by the run at the start of each step)."""

    @property
    def trained_model(self) -> torch.nn.Module:
        """The model the run trains: prompts are checked against its context, ``RUN_DIR/final/`` exports it.

        Raises:
            NotImplementedError: the loop's state does not define it.
        """
        raise NotImplementedError(f"{type(self).__name__} must define trained_model (the model the run exports)")

    def export_replica(self, cfg: Any) -> torch.nn.Module:
        """A fresh, unsharded CPU model of ``trained_model``'s architecture (adapters included) that
        ``Run.finish`` loads a sharded model's full weights into before exporting ``final/`` (FSDP2).

        Raises:
            NotImplementedError: the loop's state does not define it (its loop runs on one process).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot export a sharded model (no export_replica)")

    @property
    def num_samples(self) -> int | None:
        """Samples in one pass over the train data (prompts, offline rows), or None: no epochs."""
        return None

    def samples_per_step(self, cfg: Any) -> int:
        """Samples one step draws from the train data, all ranks together (1 for a state without data)."""
        return 1

    @property
    def epoch(self) -> int | None:
        """Passes over the train data completed, or None for a state without epochs (not logged)."""
        return None

    def count_tokens(self, batch: TensorDictBase) -> torch.Tensor:
        """This rank's tokens trained on in the step that returned ``batch`` (summed over ranks into
        ``total_valid_tokens`` and ``tokens_per_s``): the count of ``batch["action_mask"]``, 0 without one."""
        if "action_mask" not in batch.keys():
            return torch.zeros(())
        return batch["action_mask"].sum()

    def _fields(self, role: str) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            declared = f.metadata.get(_ROLE)
            if declared == "runtime" or value is None and role != "counter":
                continue
            if declared == "optimizer" or isinstance(value, torch.optim.Optimizer):
                kind = "optimizer"
            elif isinstance(value, torch.nn.Module):
                kind = "model"
            elif isinstance(value, torch.Generator):
                kind = "generator"
            elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                kind = "data"
            elif value is None or isinstance(value, (bool, int, float, str)):
                kind = "counter"
            else:
                raise TypeError(f"{type(self).__name__}.{f.name} ({type(value).__name__}) cannot be saved; mark it runtime()")
            if kind == role:
                out[f.name] = value
        return out

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        """The trained models by field name (frozen and runtime fields left out)."""
        return self._fields("model")

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Optimizers keyed by the name of the model they update."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get(_ROLE) == "optimizer" and getattr(self, f.name) is not None:
                out[f.metadata["model"]] = getattr(self, f.name)
        return out

    @property
    def generators(self) -> dict[str, torch.Generator]:
        return self._fields("generator")

    def counters(self) -> dict[str, Any]:
        """Everything ``state.json`` holds: counters and the data position (``state_dict()`` of data fields)."""
        out = dict(self._fields("counter"))
        for name, data in self._fields("data").items():
            out[name] = data.state_dict()
        return out

    def check_counters(self, saved: dict[str, Any]) -> None:
        """Check what ``load_counters`` would restore from ``saved``, changing nothing: each counter has its
        field's type (an ``int`` counter is an int >= 0, never a bool; a ``float`` one is finite), each data
        position is one its ``load_state_dict`` accepts.

        Raises:
            ValueError: naming the field, what it must be and what it is.
        """
        hints = typing.get_type_hints(type(self))
        for name in self._fields("counter"):
            if name in saved:
                _check_counter(name, saved[name], hints.get(name, Any))
        for name, data in self._fields("data").items():
            position = saved[name] if name in saved else saved
            if not isinstance(position, dict):
                raise ValueError(f"field {name!r} must be a JSON object, got {position!r:.80}")
            copy.copy(data).load_state_dict(position)  # a copy: raises on a bad value, changes nothing here

    def load_counters(self, saved: dict[str, Any]) -> None:
        """Restore the counters and data positions that ``counters()`` wrote (``check_counters`` first).

        Raises:
            ValueError: a counter or data position of the wrong type or range (nothing is changed).
        """
        self.check_counters(saved)
        for name in self._fields("counter"):
            if name in saved:
                setattr(self, name, saved[name])
        for name, data in self._fields("data").items():  # a lone data field may sit at the top of state.json
            data.load_state_dict(saved[name] if name in saved else saved)


def _check_counter(name: str, value: Any, hint: Any) -> None:
    """``value`` fits a counter field annotated ``hint`` (``int``, ``float``, ``bool``, ``str``, ``X | None``)."""
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if hint is Any:
        ok = value is None or isinstance(value, (bool, int, float, str))
    elif value is None or isinstance(value, (bool, str)):
        ok = type(value) in allowed
    elif isinstance(value, int):
        ok = (int in allowed and value >= 0) or float in allowed
    elif isinstance(value, float):
        ok = float in allowed and math.isfinite(value)
    else:
        ok = False
    if not ok:
        kinds = " or ".join("an int >= 0" if t is int else "a finite float" if t is float else repr(t) if t is None
                            else getattr(t, "__name__", str(t)) for t in allowed)
        raise ValueError(f"field {name!r} must be {kinds.replace('NoneType', 'null')}, got {value!r:.80}")


@dataclasses.dataclass(kw_only=True)
class StreamState(LoopState):
    """A state whose train data is a ``PromptStream`` (prompts, or the reward model's rows): its epochs and
    length are the stream's."""

    stream: PromptStream
    """The train data in a seeded order per epoch; its position is saved."""

    @property
    def epoch(self) -> int:
        """Passes over the train data completed."""
        return self.stream.epoch

    @property
    def num_samples(self) -> int:
        """Train samples (prompts, rows) in one epoch."""
        return len(self.stream)


@dataclasses.dataclass(kw_only=True)
class OnlineState(StreamState):
    """What the online loops (PPO, REINFORCE) add: the policy and its frozen reference, the prompts
    (``stream``), the reward, and their random streams."""

    policy: torch.nn.Module
    """The policy being trained: ``trained_model``, exported to ``final/``."""
    reference: torch.nn.Module | None = frozen(default=None)
    """The frozen initial policy, when a term uses it; None otherwise and with LoRA, whose reference is the
    policy with its adapters disabled (``rlbits.loops.phases.reference_model``)."""
    sampling_generator: torch.Generator
    """Sampling noise of every rollout (on the policy's device)."""
    minibatch_generator: torch.Generator
    """Shuffles rows into minibatches (CPU)."""
    reward: Any = runtime(default=None)
    """The reward (anything ``rlbits.score`` accepts)."""
    val_prompts: list[str] = runtime(default_factory=list)
    """The validation prompts (``val_prompts``, else the task's test split)."""
    decode_copy: torch.nn.Module | None = runtime(default=None)
    """With ``precision: bf16``: the bfloat16 copy of the policy the rollouts decode with (``phases.decoding``)."""

    @property
    def trained_model(self) -> torch.nn.Module:
        """The policy."""
        return self.policy

    def export_replica(self, cfg: Any) -> torch.nn.Module:
        """The initial policy with the run's adapters, unsharded on CPU (``runtime.build_policy``)."""
        return build_policy(cfg, self.init_path)

    def samples_per_step(self, cfg: Any) -> int:
        """``num_prompts_per_step`` prompts on every rank."""
        return cfg.num_prompts_per_step * self.env.world_size


__all__ = ["LoopState", "OnlineState", "StreamState", "frozen", "optimizer_of", "runtime"]
