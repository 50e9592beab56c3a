"""Loop configs: field groups, checks at construction, one range mechanism, the loop registry, YAML files and
overrides. (Hostile YAML and size bounds: tests/loops/test_hostile_inputs.py.)"""

from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from pathlib import Path

import pytest

from rlbits.loops.config import (
    GROUPS,
    LOOPS,
    ConfigError,
    EnvConfig,
    LoRAConfig,
    OnlineConfig,
    PolicyConfig,
    RunConfig,
    config_from_dict,
    load_config,
    loop_of,
    parse_overrides,
    read_yaml,
    save_config,
)
from rlbits.loops.config_fields import Range, field_docs, field_ranges
from rlbits.loops.ilql import ILQLConfig
from rlbits.loops.ppo import PPOConfig
from rlbits.loops.preference import PreferenceConfig
from rlbits.loops.reinforce import ADV_ESTIMATORS, ReinforceConfig
from rlbits.loops.reward_model import RewardModelConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [RunConfig, *GROUPS[1:], PPOConfig, ReinforceConfig, ILQLConfig, RewardModelConfig, PreferenceConfig]
LOOP_CONFIGS = {
    "ppo": PPOConfig,
    "reinforce": ReinforceConfig,
    "ilql": ILQLConfig,
    "reward_model": RewardModelConfig,
    "preference": PreferenceConfig,
}

# --- groups and the loop registry ------------------------------------------------------------------------


def test_each_loop_has_the_groups_it_reads():
    groups = {name: {g.__name__ for g in GROUPS if issubclass(cls, g)} for name, cls in LOOP_CONFIGS.items()}
    online = {"RunConfig", "PolicyConfig", "OnlineConfig", "PolicyGradientConfig", "LoRAConfig", "EnvConfig"}
    online |= {"RewardShapingConfig"}
    assert groups == {
        "ppo": online,
        "reinforce": online,
        "ilql": {"RunConfig", "PolicyConfig", "LoRAConfig"},
        "reward_model": {"RunConfig"},
        "preference": {"RunConfig", "PolicyConfig", "OnlineConfig", "LoRAConfig"},
    }
    names = {f.name for f in dataclasses.fields(RewardModelConfig)}
    assert not {"lora_rank", "compile", "activation_checkpointing", "policy", "task", "temperature"} & names
    assert not {"num_prompts_per_step", "env_options", "sandbox", "compile_generate"} & {
        f.name for f in dataclasses.fields(ILQLConfig)
    }


def test_the_loop_registry_is_the_one_list_of_loops():
    from rlbits.cli import config_help
    from rlbits.loops import api

    assert api.LOOPS is LOOPS and list(LOOPS) == ["ppo", "reinforce", "ilql", "reward_model", "preference"]
    for name, (module, class_name) in LOOPS.items():
        cls = getattr(importlib.import_module(module), class_name)
        assert cls is LOOP_CONFIGS[name] and loop_of(cls) == name and cls().loop == name
        assert api.config_class(name) is cls and f"The {name} loop ({class_name}):" in config_help(name)
    assert all(loop_of(g) is None for g in GROUPS)


def test_every_config_field_has_a_docstring_and_no_long_line():
    for cls in CONFIGS:
        docs = field_docs(cls)
        assert not [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)], cls
    for path in (ROOT / "rlbits" / "loops").glob("config*.py"):
        long = [i for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
        assert not long, f"{path.name}: lines {long} are over 120 characters"


def test_the_adv_estimator_literal_is_ADV_ESTIMATORS():
    assert typing.get_args(typing.get_type_hints(ReinforceConfig)["adv_estimator"]) == ADV_ESTIMATORS


# --- checked at construction -----------------------------------------------------------------------------


def test_a_config_is_checked_when_built_and_when_replaced():
    with pytest.raises(ConfigError, match="clip_eps must be >= 0, got -1"):
        PPOConfig(clip_eps=-1)
    cfg = PPOConfig(clip_eps=1)
    assert isinstance(cfg.clip_eps, float)  # an int for a float field is stored as a float
    with pytest.raises(ConfigError, match="lam must be in"):
        dataclasses.replace(cfg, lam=2.0)
    with pytest.raises(ConfigError, match="kl_coef must be float, got 'big'"):
        dataclasses.replace(cfg, kl_coef="big")
    with pytest.raises(ConfigError, match="sandbox must be one of 'bwrap', 'unsafe_local'; got 'docker'"):
        ReinforceConfig(sandbox="docker")
    with pytest.raises(ConfigError, match="loop must be 'ilql' for ILQLConfig"):
        ILQLConfig(loop="ppo")
    cfg.check()  # callable again: it checks the same things
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 4  # type: ignore[misc]
    # a path for a str field (run_dir=Path(...) in a notebook) is stored as its string; other types are not
    from pathlib import Path

    assert PPOConfig(run_dir=Path("runs") / "x", policy=Path("pol")).run_dir == str(Path("runs") / "x")
    with pytest.raises(ConfigError, match="run_dir must be str, got 3"):
        PPOConfig(run_dir=3)


@pytest.mark.parametrize("loop", list(LOOPS))
def test_defaults_are_valid(loop):
    cfg = LOOP_CONFIGS[loop]()
    assert config_from_dict(type(cfg), dataclasses.asdict(cfg)) == cfg


# --- a field a loop does not use is refused, naming the loop ---------------------------------------------


@pytest.mark.parametrize(
    "cls, key, group",
    [
        (RewardModelConfig, "lora_rank", "LoRAConfig"),
        (RewardModelConfig, "compile", "PolicyConfig"),
        (RewardModelConfig, "activation_checkpointing", "PolicyConfig"),
        (RewardModelConfig, "policy", "PolicyConfig"),
        (RewardModelConfig, "num_prompts_per_step", "OnlineConfig"),
        (ILQLConfig, "num_generations_per_prompt", "OnlineConfig"),
        (ILQLConfig, "env_options", "EnvConfig"),
        (ILQLConfig, "compile_generate", "OnlineConfig"),
    ],
)
def test_a_field_of_a_group_the_loop_does_not_use_is_refused(cls, key, group):
    loop = loop_of(cls)
    with pytest.raises(
        ConfigError,
        match=rf"^{key} is not a field of the {loop} loop \({cls.__name__}\), which does not use {group}",
    ):
        config_from_dict(cls, {key: 1})
    from rlbits.loops.api import resolve_config

    with pytest.raises(ConfigError, match=f"is not a field of the {loop} loop"):
        resolve_config({"loop": loop, key: 1})
    with pytest.raises(TypeError):
        cls(**{key: 1})


def test_an_unknown_key_names_the_loop_and_the_nearest_fields():
    with pytest.raises(ConfigError, match=r"unknown config key 'entropy_coef' for the ilql loop \(ILQLConfig\)"):
        config_from_dict(ILQLConfig, {"entropy_coef": 0.1})
    with pytest.raises(ConfigError, match=r"clip_eps is not a field of the ilql loop .* PolicyGradientConfig"):
        config_from_dict(ILQLConfig, {"clip_eps": 0.2})
    with pytest.raises(ConfigError, match=r"unknown config key 'ppo_epochs' for the reinforce loop"):
        config_from_dict(ReinforceConfig, {"ppo_epochs": 2})
    with pytest.raises(ConfigError, match="unknown config key 'sede' for RunConfig; did you mean seed"):
        config_from_dict(RunConfig, {"sede": 1})
    with pytest.raises(ConfigError, match="keys are field names"):
        config_from_dict(PPOConfig, {1: 2})


def test_resolve_reward_prefers_one_source(tmp_path):
    cfg = PolicyConfig(reward_model=str(tmp_path))
    assert cfg.resolve_reward(None) == str(tmp_path)
    with pytest.raises(ConfigError, match="give one of them"):
        cfg.resolve_reward(lambda p, r: [0.0] * len(p))
    assert PolicyConfig().resolve_reward("x") == "x"


def test_removed_names_are_gone():
    assert not hasattr(RunConfig, "validate") and not hasattr(OnlineConfig, "rollout_batch_size")
    assert not hasattr(ReinforceConfig, "ppo_epochs") and not hasattr(ReinforceConfig, "RENAMED")
    with pytest.raises(ConfigError, match="adv_estimator must be one of"):
        ReinforceConfig(adv_estimator="grpo_unscaled")


# --- YAML files and overrides ----------------------------------------------------------------------------


def test_config_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\nmax_num_steps: 7\ntemperature: 1\n")
    cfg = load_config(
        PPOConfig, path, ["max_num_steps=9", "val_greedy=true", "policy=null", "run_dir=runs/x"]
    )
    assert (cfg.seed, cfg.max_num_steps, cfg.val_greedy, cfg.policy, cfg.run_dir) == (
        3,
        9,
        True,
        None,
        "runs/x",
    )
    assert isinstance(cfg.temperature, float)  # an int in YAML is accepted for a float field
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(PPOConfig, tmp_path / "saved.yaml") == cfg


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (RunConfig, {"seed": 1.5}, "seed must be int, got 1.5"),
        (RunConfig, {"seed": True}, "seed must be int, got True"),
        (RunConfig, {"seed": -1}, r"seed must be in \[0, 9007199254740992\), got -1"),
        (PPOConfig, {"val_greedy": "yes"}, "val_greedy must be bool"),
        (RunConfig, {"max_num_steps": 0}, "max_num_steps must be >= 1"),
        (PPOConfig, {"temperature": 0.0}, "temperature must be >= 0.0001"),
        (RunConfig, {"loop": "dpo"}, "loop must be one of ppo, reinforce, ilql, reward_model"),
        (PPOConfig, {"policy": 3}, "policy must be str"),
        (RunConfig, {"device": "tpu"}, "device must be auto, cpu, cuda"),
        (RunConfig, {"on_nonfinite": "ignore"}, "on_nonfinite must be one of 'stop', 'skip'"),
        (RunConfig, {"learning_rate": 0.0}, r"learning_rate must be > 0, got 0.0 \(AdamW learning rate"),
        (RunConfig, {"learning_rate": math.nan}, "learning_rate must be a finite number, got nan"),
        (PPOConfig, {"reward_clip": 0.0}, r"reward_clip must be > 0 or null, got 0.0 \(Clip the"),
        (PPOConfig, {"lora_dropout": 1.0}, r"lora_dropout must be in \[0, 1\), got 1.0"),
        (PPOConfig, {"max_episode_tokens": 1}, "max_episode_tokens must be >= 2 or null"),
        (PPOConfig, {"env_options": {"sandbox": "unsafe_local"}}, "env_options must not set sandbox"),
        (PPOConfig, {"lora_target_modules": []}, "lora_target_modules must be a non-empty list"),
        (PPOConfig, {"reward_model": "/no/such/folder"}, "reward_model must be a folder"),
    ],
)
def test_bad_config_values_are_rejected_with_the_field_named(cls, values, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cls, values)


# --- the policy loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [PPOConfig, ReinforceConfig])
def test_policy_loss_from_yaml_and_overrides(cls, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("policy_loss: clip_cov\npolicy_loss_kwargs:\n  clip_cov_ratio: 0.001\n")
    cfg = load_config(cls, path)
    assert (cfg.policy_loss, cfg.policy_loss_kwargs) == ("clip_cov", {"clip_cov_ratio": 0.001})
    cfg = load_config(cls, path, ["policy_loss=vanilla", "policy_loss_kwargs={clip_ratio_c: 3.0}"])
    assert cfg.policy_loss_args == {"clip_eps": 0.2, "clip_eps_high": None, "clip_ratio_c": 3.0}
    assert cls().policy_loss_args["clip_ratio_c"] is None  # vanilla runs without dual clip unless asked
    cfg = load_config(cls, None, ["policy_loss=sapo", "loss_agg=seq-mean-token-sum-norm", "loss_scale_factor=24"])
    assert cfg.policy_loss_args == {} and cfg.loss_scale_factor == 24.0  # sapo has no clip range
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(cls, tmp_path / "saved.yaml") == cfg


@pytest.mark.parametrize(
    "values, message",
    [
        ({"policy_loss": "gspo2"}, "policy_loss must be one of vanilla, gspo, cispo, .*got 'gspo2'"),
        (
            {"policy_loss": "gspo", "policy_loss_kwargs": {"clip_ratio_c": 3.0}},
            r"'clip_ratio_c' is not a hyperparameter of policy_loss 'gspo' \(gspo_loss\); it takes none",
        ),
        (
            {"policy_loss": "clip_cov", "policy_loss_kwargs": {"clip_cov_rate": 0.1}},
            "'clip_cov_rate' is not a hyperparameter of policy_loss 'clip_cov'.*did you mean clip_cov_ratio"
            ".*it takes clip_cov_ratio, clip_cov_lb, clip_cov_ub",
        ),
        ({"policy_loss_kwargs": {"clip_eps": 0.1}}, "policy_loss_kwargs must not set clip_eps: it is the config"),
        ({"policy_loss_kwargs": {"agg": "token-mean"}}, "must not set agg: the config field loss_agg sets it"),
        ({"policy_loss_kwargs": {"num_tokens": 3}}, "must not set num_tokens: the loop sets it"),
        ({"policy_loss": "dro"}, "policy_loss 'dro' with policy_loss_kwargs={}: dro_loss needs dro_beta > 0"),
        ({"policy_loss": "sapo", "policy_loss_kwargs": {"tau_pos": 0.0}}, "policy_loss 'sapo' .*tau_pos"),
        ({"policy_loss_kwargs": {1: 2}}, "policy_loss_kwargs must map hyperparameter names to values"),
        ({"policy_loss_kwargs": [1]}, "policy_loss_kwargs must be dict"),
        ({"loss_agg": "token-sum-norm"}, "loss_agg must be one of 'token-mean', 'token-sum', "),
        ({"loss_scale_factor": 24.0}, "loss_scale_factor=24.0 has no effect with loss_agg='token-mean'"),
        ({"loss_agg": "seq-mean-token-sum-norm", "loss_scale_factor": 0.0}, "loss_scale_factor must be > 0"),
    ],
)
@pytest.mark.parametrize("cls", [PPOConfig, ReinforceConfig])
def test_policy_loss_errors_name_the_problem(cls, values, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(cls, values)


def test_every_policy_loss_has_a_valid_config():
    from rlbits.functional import POLICY_LOSSES

    for name in POLICY_LOSSES:
        kwargs = {"dro_beta": 0.1} if name == "dro" else {}
        cfg = ReinforceConfig(policy_loss=name, policy_loss_kwargs=kwargs)
        assert not set(cfg.policy_loss_args) & {"agg", "num_tokens", "num_seqs", "generator"}


def test_bad_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="not of the form key=value"):
        parse_overrides(["seed"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RunConfig, tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(RunConfig, tmp_path / "list.yaml")


YAMLS = sorted([*ROOT.glob("configs/**/*.yaml"), *ROOT.glob("rlbits/configs/*.yaml")])


@pytest.mark.parametrize("path", YAMLS, ids=[str(p.relative_to(ROOT)) for p in YAMLS])
def test_every_shipped_yaml_config_loads(path):
    from rlbits.loops.api import resolve_config

    values = read_yaml(path)
    if values.get("reward_model") is not None:  # a folder an earlier run of a pipeline writes
        values["reward_model"] = None
    cfg = resolve_config(values)
    assert type(cfg) is LOOP_CONFIGS[values.get("loop", "ppo")]
    assert all(getattr(cfg, k) == v or isinstance(v, int) for k, v in values.items())


# --- one range mechanism ---------------------------------------------------------------------------------


def test_range_descriptions():
    assert Range(ge=1).describe() == ">= 1" and Range(gt=0).describe(none_ok=True) == "> 0 or null"
    assert Range(ge=0, le=1).describe() == "in [0, 1]" and Range(gt=0, lt=1).describe() == "in (0, 1)"
    assert Range(ge=0, lt=1).describe() == "in [0, 1)" and Range(ge=1e-4).describe() == ">= 0.0001"
    assert Range(at_most=8).problem(9) == "must be <= 8" and Range(ge=1).problem(1) is None
    assert (
        Range(finite=False).problem(math.inf) is None
        and Range().problem(math.inf) == "must be a finite number"
    )


def _outside(r: Range, is_int: bool) -> list:
    """Values just outside each bound of ``r``."""
    step = 1 if is_int else 0.5
    out = []
    if r.ge is not None:
        out.append(r.ge - step)
    if r.gt is not None:
        out.append(r.gt)
    if r.le is not None:
        out.append(r.le + step)
    if r.lt is not None:
        out.append(r.lt)
    if r.at_most is not None:
        out.append(r.at_most + 1)
    return [int(v) if is_int else float(v) for v in out]


CASES = [
    (cls, name, value)
    for cls in LOOP_CONFIGS.values()
    for name, r in field_ranges(cls).items()
    for value in _outside(r, typing.get_type_hints(cls)[name] in (int, int | None))
]


@pytest.mark.parametrize("cls, name, value", CASES, ids=[f"{c.__name__}-{n}-{v}" for c, n, v in CASES])
def test_each_range_rule_can_fail(cls, name, value):
    with pytest.raises(ConfigError, match=rf"^{name} must be .*, got {value}(?: \(.+\))?$") as info:
        cls(**{name: value})
    assert field_docs(cls)[name] in str(info.value)  # the field's docstring is quoted


def test_every_float_field_refuses_nan_and_inf_but_max_grad_norm_may_be_inf():
    for cls in LOOP_CONFIGS.values():
        hints = typing.get_type_hints(cls)
        for name in [f.name for f in dataclasses.fields(cls) if hints[f.name] in (float, float | None)]:
            with pytest.raises(ConfigError, match=f"^{name} must be a finite number, got nan"):
                cls(**{name: math.nan})
            if name != "max_grad_norm":
                with pytest.raises(ConfigError, match=f"^{name} must be a finite number, got inf"):
                    cls(**{name: math.inf})
        assert cls(max_grad_norm=math.inf).max_grad_norm == math.inf


def test_a_subclass_default_keeps_the_range():
    assert (
        field_ranges(PPOConfig)["num_prompts_per_step"] == field_ranges(OnlineConfig)["num_prompts_per_step"]
    )
    assert field_ranges(ILQLConfig)["max_new_tokens"].at_most == 2**20
    with pytest.raises(ConfigError, match="num_prompts_per_step must be >= 1"):
        PPOConfig(num_prompts_per_step=0)


def test_cross_field_rules():
    with pytest.raises(
        ConfigError, match="num_prompts_per_step \\* num_generations_per_prompt must be <= 1048576"
    ):
        EnvConfig(num_prompts_per_step=2**19, num_generations_per_prompt=4)
    with pytest.raises(ConfigError, match="num_minibatches .* must be <= num_prompts_per_step"):
        PPOConfig(num_minibatches=64, num_prompts_per_step=8)
    with pytest.raises(ConfigError, match="truncate_min_words"):
        RewardModelConfig(truncate_min_words=9, truncate_max_words=8)
    with pytest.raises(ConfigError, match="head_layers must be 1"):
        ILQLConfig(head_layers=3)
    assert LoRAConfig(lora_rank=4).lora and not PolicyConfig().compile
