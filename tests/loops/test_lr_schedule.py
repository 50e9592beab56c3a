"""Learning-rate schedules: each against a reference written from its seed's formula at every step, the rates
the loops log, and a resume in the middle of a schedule."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from metrics_compare import untimed_by_step

from rlbits.loops import ilql, ppo, reinforce
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.optim import cosine_annealing_lr, linear_warmup_lr, warmup_cosine_lr
from rlbits.loops.run import read_metrics
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

V = 32


# --- references ---------------------------------------------------------------------------------------------


def nemo_cosine_annealing(step, base_lr, max_steps, warmup_steps, constant_steps, min_lr):
    """NeMo's CosineAnnealing (nemo/core/optim/lr_scheduler.py) at scheduler step ``step`` (its
    ``last_epoch``: 0 for the first optimizer step), following WarmupAnnealHoldPolicy.get_lr's branches."""
    decay_steps = max_steps - (constant_steps + warmup_steps)

    def megatron(s):  # _linear_warmup_with_cosine_annealing
        if warmup_steps > 0 and s <= warmup_steps:
            return base_lr * float(s) / float(warmup_steps)
        if s > warmup_steps + decay_steps:
            return min_lr
        ratio = float(s - warmup_steps) / float(decay_steps)
        assert 0.0 <= ratio <= 1.0
        return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (base_lr - min_lr)

    if warmup_steps > 0 and step <= warmup_steps:  # _get_warmup_lr
        return base_lr * (step + 1) / (warmup_steps + 1) if constant_steps == 0 else megatron(step)
    if constant_steps > 0 and warmup_steps + decay_steps < step <= max_steps:  # _get_constant_lr
        return megatron(step)
    if step > max_steps:
        return min_lr
    if (
        constant_steps == 0
    ):  # _get_lr: _cosine_annealing(initial_lr, step - warmup, max_steps - warmup, min_lr)
        mult = 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / (max_steps - warmup_steps)))
        return (base_lr - min_lr) * mult + min_lr
    return megatron(step)


def torch_rates(make_scheduler, base_lr, steps):
    """The rate of each of ``steps`` optimizer steps under a torch scheduler stepped after each (trlx, NeMo-RL)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = make_scheduler(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


# --- the schedules ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_steps, warmup, constant, min_lr",
    [
        (20, 0, 0, 0.0),
        (20, 5, 0, 1e-4),
        (20, 3, 6, 9e-5),
        (10, 0, 4, 0.0),
        (7, 6, 0, 2e-4),
        (30, 10, 19, 1e-5),
    ],
)
def test_cosine_is_nemo_cosine_annealing_at_every_step(max_steps, warmup, constant, min_lr):
    for step in range(max_steps + 5):
        want = nemo_cosine_annealing(step, 1e-3, max_steps, warmup, constant, min_lr)
        got = warmup_cosine_lr(
            step, lr=1e-3, max_steps=max_steps, warmup_steps=warmup, constant_steps=constant, min_lr=min_lr
        )
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), step


@pytest.mark.parametrize("t_max, min_lr", [(1, 0.0), (7, 3e-5), (20, 0.0)])
def test_cosine_annealing_is_torch_cosine_annealing_lr_at_every_step(t_max, min_lr):
    def sched(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max, eta_min=min_lr)

    want = torch_rates(sched, 1e-3, 3 * t_max + 2)  # past T_max the cosine rises again, in both
    got = [cosine_annealing_lr(s, lr=1e-3, t_max=t_max, min_lr=min_lr) for s in range(len(want))]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("warmup, start_factor", [(5, 0.1), (1, 0.5), (12, 0.0)])
def test_linear_warmup_is_nemo_rl_linear_then_constant_at_every_step(warmup, start_factor):
    def sched(opt):  # NeMo-RL's policy.scheduler list: LinearLR, ConstantLR, milestones [warmup]
        lin = torch.optim.lr_scheduler.LinearLR(
            opt, start_factor=start_factor, end_factor=1.0, total_iters=warmup
        )
        const = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=10**10)
        return torch.optim.lr_scheduler.SequentialLR(opt, [lin, const], milestones=[warmup])

    if start_factor == 0.0:  # torch's LinearLR refuses 0; the formula's line starts at 0
        want = [1e-3 * min(s, warmup) / warmup for s in range(2 * warmup + 3)]
    else:
        want = torch_rates(sched, 1e-3, 2 * warmup + 3)
    got = [
        linear_warmup_lr(s, lr=1e-3, warmup_steps=warmup, start_factor=start_factor) for s in range(len(want))
    ]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_schedule_errors():
    with pytest.raises(ValueError, match="no step left to decay"):
        warmup_cosine_lr(0, lr=1e-3, max_steps=5, warmup_steps=3, constant_steps=2)
    with pytest.raises(ValueError, match="min_lr"):
        warmup_cosine_lr(0, lr=1e-3, max_steps=5, min_lr=1e-2)
    with pytest.raises(ValueError, match="t_max"):
        cosine_annealing_lr(0, lr=1e-3, t_max=0)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"lr_scheduler": "cosine", "min_lr": 1.0}, "min_lr .* must be <= learning_rate"),
        (
            {"lr_scheduler": "cosine", "lr_max_steps": 5, "lr_warmup_steps": 3, "lr_constant_steps": 2},
            "lr_max_steps",
        ),
        ({"lr_scheduler": "linear"}, "lr_scheduler"),
    ],
)
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(reinforce.ReinforceConfig, values)


def test_ppo_critic_rate_is_checked_against_min_lr():
    with pytest.raises(ConfigError, match="critic_learning_rate"):
        config_from_dict(
            ppo.PPOConfig,
            {"lr_scheduler": "cosine", "min_lr": 1e-4, "critic_learning_rate": 1e-5, "learning_rate": 1e-3},
        )


# --- the loops ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def length_reward(prompts, responses, **_):
    return [float(len(r) % 3) for r in responses]


COMMON = dict(
    task="arithmetic",
    max_num_steps=3,
    num_prompts_per_step=4,
    num_generations_per_prompt=2,
    max_new_tokens=4,
    microbatch_size=8,
    learning_rate=1e-3,
    max_val_samples=4,
    val_at_start=False,
    val_period=0,
    val_at_end=False,
    save_period=0,
    log_samples=0,
    progress=False,
    tensorboard=False,
)


def rates_logged(run_dir, key):
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


@pytest.mark.slow
def test_reinforce_logs_the_cosine_rate_of_its_optimizer_steps(tiny_path, tmp_path):
    cfg = config_from_dict(
        reinforce.ReinforceConfig,
        {
            **COMMON,
            "policy": tiny_path,
            "run_dir": str(tmp_path / "run"),
            "num_minibatches": 2,
            "lr_scheduler": "cosine",
            "lr_warmup_steps": 2,
            "min_lr": 1e-4,
        },
    )
    logged = rates_logged(reinforce.train(cfg, reward=length_reward), "lr")
    per_step, length = 2, 3 * 2  # num_iterations * num_minibatches optimizer steps per step, over 3 steps
    for step in (1, 2, 3):
        want = [
            nemo_cosine_annealing(per_step * (step - 1) + u, 1e-3, length, 2, 0, 1e-4)
            for u in range(per_step)
        ]
        assert logged[step] == pytest.approx(sum(want) / per_step, rel=1e-9)


@pytest.mark.slow
def test_ppo_schedules_policy_and_critic_from_their_own_start(tiny_path, tmp_path):
    cfg = config_from_dict(
        ppo.PPOConfig,
        {
            **COMMON,
            "policy": tiny_path,
            "run_dir": str(tmp_path / "run"),
            "ppo_epochs": 2,
            "num_minibatches": 2,
            "policy_training_start_step": 1,
            "critic_learning_rate": 5e-4,
            "lr_scheduler": "cosine_annealing",
            "min_lr": 1e-5,
        },
    )
    run_dir = ppo.train(cfg, reward=length_reward)
    lr, critic_lr = rates_logged(run_dir, "lr"), rates_logged(run_dir, "critic_lr")
    k = 4  # ppo_epochs * num_minibatches

    def mean(base, first, t_max):
        return sum(cosine_annealing_lr(first + u, lr=base, t_max=t_max, min_lr=1e-5) for u in range(k)) / k

    assert sorted(critic_lr) == [1, 2, 3] and sorted(lr) == [2, 3]  # the policy trains from step 2
    for step in (1, 2, 3):
        assert critic_lr[step] == pytest.approx(mean(5e-4, k * (step - 1), 3 * k), rel=1e-9)
    for step in (2, 3):
        assert lr[step] == pytest.approx(mean(1e-3, k * (step - 2), 2 * k), rel=1e-9)


@pytest.mark.slow
def test_constant_schedule_logs_no_rate(tiny_path, tmp_path):
    cfg = config_from_dict(
        reinforce.ReinforceConfig,
        {
            **COMMON,
            "policy": tiny_path,
            "run_dir": str(tmp_path / "run"),
            "max_num_steps": 1,
        },
    )
    assert not rates_logged(reinforce.train(cfg, reward=length_reward), "lr")


@pytest.mark.slow
def test_ilql_logs_the_linear_warmup_rate(tiny_path, tmp_path):
    cfg = config_from_dict(
        ilql.ILQLConfig,
        {
            "policy": tiny_path,
            "run_dir": str(tmp_path / "run"),
            "task": "arithmetic",
            "max_num_steps": 3,
            "batch_size": 8,
            "microbatch_size": 8,
            "dataset_size": 8,
            "dataset_batch_size": 8,
            "max_new_tokens": 4,
            "val_at_start": False,
            "val_period": 0,
            "val_at_end": False,
            "save_period": 0,
            "max_val_samples": 4,
            "log_samples": 0,
            "learning_rate": 1e-3,
            "progress": False,
            "tensorboard": False,
            "device": "cpu",
            "lr_scheduler": "linear_warmup",
            "lr_warmup_steps": 2,
            "lr_warmup_start_factor": 0.25,
        },
    )
    logged = rates_logged(ilql.train(cfg, reward=length_reward), "lr")
    assert logged == pytest.approx({1: 0.25e-3, 2: 0.625e-3, 3: 1e-3}, rel=1e-9)


@pytest.mark.slow
def test_resume_mid_schedule_gives_the_uninterrupted_rates_and_numbers(tiny_path, tmp_path):
    class StopAfterTwo:
        def __init__(self):
            self.steps = []

        def on_metrics(self, step, metrics):
            self.steps.append(step)

        def should_stop(self):
            return bool(self.steps) and self.steps[-1] >= 2

    values = {
        **COMMON,
        "policy": tiny_path,
        "max_num_steps": 4,
        "num_minibatches": 2,
        "lr_scheduler": "cosine",
        "lr_warmup_steps": 3,
        "lr_constant_steps": 1,
        "min_lr": 1e-4,
    }
    full = reinforce.train(
        config_from_dict(reinforce.ReinforceConfig, {**values, "run_dir": str(tmp_path / "a")}),
        reward=length_reward,
    )
    part = config_from_dict(reinforce.ReinforceConfig, {**values, "run_dir": str(tmp_path / "b")})
    reinforce.train(part, reward=length_reward, callbacks=[StopAfterTwo()])
    assert [r["step"] for r in read_metrics(part.run_dir)] == [1, 2]
    resumed = reinforce.train(dataclasses.replace(part), reward=length_reward, resume=True)
    a, b = untimed_by_step(read_metrics(full), 3), untimed_by_step(read_metrics(resumed), 3)
    assert sorted(a) == [3, 4] and a == b and "lr" in a[4]


# --- the critic's own optimizer settings and Adam's betas / eps -----------------------------------------------


def test_ppo_critic_warmup_fields_shape_only_the_critic_schedule():
    """``critic_lr_warmup_steps`` / ``critic_lr_warmup_start_factor`` (NeMo-RL ``value.scheduler``) give the
    critic its own linear warm-up; the policy keeps ``lr_warmup_steps`` / ``lr_warmup_start_factor``."""
    base = dict(lr_scheduler="linear_warmup", lr_warmup_steps=3, lr_warmup_start_factor=0.1, learning_rate=1e-4)
    cfg = ppo.PPOConfig(**base, critic_learning_rate=2e-4, critic_lr_warmup_steps=5, critic_lr_warmup_start_factor=0.05)
    same = ppo.PPOConfig(**base, critic_learning_rate=2e-4)
    k = cfg.ppo_epochs * cfg.num_minibatches
    layer = torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(layer.parameters())
    for step in range(4):
        got = ppo.critic_trained(layer, opt, cfg, step, 10).lr
        default = ppo.critic_trained(layer, opt, same, step, 10).lr
        for u in range(k):
            t = step * k + u
            assert got(u) == pytest.approx(linear_warmup_lr(t, lr=2e-4, warmup_steps=5, start_factor=0.05), rel=1e-12)
            assert default(u) == pytest.approx(linear_warmup_lr(t, lr=2e-4, warmup_steps=3, start_factor=0.1), rel=1e-12)
    sched = ppo.critic_schedule(cfg)
    assert (sched.lr_warmup_steps, sched.lr_warmup_start_factor, sched.lr_scheduler) == (5, 0.05, "linear_warmup")


@pytest.mark.parametrize("loop", ["ppo", "reinforce"])
def test_adam_betas_eps_and_critic_weight_decay_reach_the_optimizers(loop, tiny_path, tmp_path):
    from rlbits.distributed.env import DistEnv

    module = {"ppo": ppo, "reinforce": reinforce}[loop]
    values = {**COMMON, "policy": tiny_path, "run_dir": str(tmp_path / "run"), "adam_betas": [0.9, 0.95],
              "adam_eps": 1e-6, "weight_decay": 0.01}
    if loop == "ppo":
        values["critic_weight_decay"] = 0.1
    cfg = config_from_dict(module.PPOConfig if loop == "ppo" else module.ReinforceConfig, values)
    assert cfg.adam_betas == (0.9, 0.95)
    state = module.init_state(cfg, DistEnv(), reward=length_reward)
    optimizers = {"policy": state.policy_optimizer, "critic": state.value_optimizer} if loop == "ppo" else {
        "policy": state.optimizer}
    for name, opt in optimizers.items():
        for group in opt.param_groups:
            assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-6, name
            assert group["weight_decay"] == (0.1 if name == "critic" else 0.01), name


def test_adam_betas_are_checked():
    with pytest.raises(ConfigError, match="adam_betas must be two numbers in"):
        ppo.PPOConfig(adam_betas=[0.9])
    with pytest.raises(ConfigError, match="adam_betas must be two numbers in"):
        ppo.PPOConfig(adam_betas=[0.9, 1.0])
    assert ppo.PPOConfig().adam_betas == (0.9, 0.999) and ppo.PPOConfig().adam_eps == 1e-8
