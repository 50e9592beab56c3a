"""``rlbits.loops.state``: what a loop's state saves, and the contract ``Run`` reads it through."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensordict import TensorDict

from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.loops import ilql, ppo, reinforce, reward_model
from rlbits.loops.state import LoopState, OnlineState, frozen, optimizer_of, runtime


@dataclasses.dataclass(kw_only=True)
class Bare(LoopState):
    """A state that defines nothing of the contract."""


@dataclasses.dataclass(kw_only=True)
class Small(LoopState):
    model: torch.nn.Module
    reference: torch.nn.Module | None = frozen(default=None)
    optimizer: torch.optim.Optimizer = optimizer_of("model")
    noise: torch.Generator
    stream: PromptStream
    scale: float = 1.0
    note: str | None = None
    scratch: list = runtime(default_factory=list)

    @property
    def trained_model(self) -> torch.nn.Module:
        return self.model


def small() -> Small:
    model = torch.nn.Linear(2, 2)
    return Small(
        model=model, reference=torch.nn.Linear(2, 2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        noise=torch.Generator().manual_seed(0), stream=PromptStream(["a", "b", "c"], seed=0),
    )


def test_the_contract_defaults():
    state = Bare()
    with pytest.raises(NotImplementedError, match="Bare must define trained_model"):
        state.trained_model  # noqa: B018
    assert state.num_samples is None and state.samples_per_step(object()) == 1 and state.epoch is None
    batch = TensorDict({"action_mask": torch.tensor([[True, False], [True, True]])}, batch_size=[2])
    assert int(state.count_tokens(batch)) == 3
    assert int(state.count_tokens(TensorDict({}, batch_size=[2]))) == 0


@pytest.mark.parametrize(
    "module", [ppo, reinforce, ilql, reward_model], ids=lambda m: m.__name__.split(".")[-1]
)
def test_every_loop_state_names_the_model_it_trains(module):
    assert module.State.trained_model is not LoopState.trained_model
    assert module.State.num_samples is not LoopState.num_samples
    assert module.State.samples_per_step is not LoopState.samples_per_step
    assert module.State.epoch is not LoopState.epoch


def test_online_state_draws_num_prompts_per_step_on_every_rank():
    state = OnlineState(
        policy=torch.nn.Linear(1, 1), sampling_generator=torch.Generator(), minibatch_generator=torch.Generator(),
        stream=PromptStream([f"p{i}" for i in range(10)], seed=0), env=DistEnv(world_size=2),
    )
    cfg = reinforce.ReinforceConfig(num_prompts_per_step=3)
    assert state.num_samples == 10 and state.samples_per_step(cfg) == 6 and state.epoch == 0
    state.stream.next(10)
    assert state.epoch == 1


def test_reward_model_counts_the_tokens_of_its_texts():
    state = reward_model.State.__new__(reward_model.State)
    batch = TensorDict({"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}, batch_size=[2])
    assert int(state.count_tokens(batch)) == 5


def test_fields_are_saved_by_their_type():
    state = small()
    assert list(state.models) == ["model"]  # the frozen reference is not saved
    assert list(state.optimizers) == ["model"] and list(state.generators) == ["noise"]
    counters = state.counters()
    assert counters["stream"] == state.stream.state_dict() and "scratch" not in counters
    assert {"step", "total_valid_tokens", "val_reward", "scale", "note"} <= set(counters)


def test_counters_round_trip_and_a_bad_one_changes_nothing():
    state = small()
    state.stream.next(2)
    state.step, state.scale, state.note = 4, 0.5, "x"
    saved = state.counters()
    fresh = small()
    fresh.load_counters(saved)
    assert (fresh.step, fresh.scale, fresh.note) == (4, 0.5, "x")
    assert fresh.stream.next(1) == state.stream.next(1)
    for bad, message in (
        ({"step": -1}, "int >= 0"),
        ({"step": True}, "int >= 0"),
        ({"scale": float("nan")}, "finite"),
    ):
        other = small()
        with pytest.raises(ValueError, match=message):
            other.load_counters({**saved, **bad})
        assert other.step == 0 and other.stream.consumed_samples == 0


def test_a_field_that_cannot_be_saved_is_named():
    @dataclasses.dataclass(kw_only=True)
    class Odd(LoopState):
        thing: object = dataclasses.field(default_factory=object)

    with pytest.raises(TypeError, match="Odd.thing .* mark it runtime"):
        Odd().counters()
