"""``rlbits convert-config``: a seed's config (NeMo-RL, NeMo-Aligner, trlx) read as it is -> an rlbits config.

Every field of the seed's file is matched by one ``Rule`` of ``RULES[seed]`` (the first whose pattern
matches): it sets rlbits fields (``field``), is what rlbits always does (``builtin``, its value checked), is
infrastructure with no rlbits equivalent (``infrastructure``: cluster, Megatron and vLLM settings, Ray,
logging back-ends, checkpoint paths), or an algorithm rlbits does not have (``unsupported``). A rule may
refuse a value it cannot represent (``Unsupported``). A field no rule matches is refused as an unknown field,
never dropped. The same rules generate the per-seed tables of docs/seeds.md (``seed_tables``), so the page
and the converter cannot disagree. docs/convert_config.md shows the command.

The seed's model name (an HF id, a ``.nemo`` path) is copied to ``policy`` as given: rlbits does not
download it, and a run with it fails at load time with rlbits' own error unless it names a local folder or a
zoo model; ``rlbits train OUT.yaml policy=...`` replaces it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbits.loops.config import MAX_ROWS
from rlbits.loops.config_yaml import ConfigError, show
from rlbits.loops.convert_read import leaves, read_seed_config

SEEDS = ("nemo-rl", "nemo-aligner", "trlx")
"""The seeds ``convert-config --from`` reads."""


class Unsupported(Exception):
    """A seed field's value rlbits cannot represent; the message says why."""


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What a rule's conversion sees: the whole resolved seed config and the loop it converts to."""

    tree: dict[str, Any]
    loop: str
    field: str = ""
    """The dotted path of the field being converted."""

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.tree
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


Convert = Callable[[Any, Ctx], "dict[str, Any] | str"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one seed field (or a family of them) maps to rlbits.

    ``path``: dotted, ``{a,b}`` for alternatives, ``*`` for one key, a trailing ``.**`` for a whole subtree.
    ``kind``: ``field`` | ``builtin`` | ``infrastructure`` | ``unsupported``. ``rlbits``: the rlbits field(s)
    or behaviour, as the docs table shows it. ``why``: the reason (infrastructure, unsupported) or a note.
    ``convert(value, ctx)``: the rlbits fields it sets (a dict), or a note (a string) when it sets none;
    raises ``Unsupported`` for a value it cannot represent."""

    path: str
    kind: str
    rlbits: str = ""
    why: str = ""
    convert: Convert | None = None

    def matches(self, field: str) -> bool:
        return _regex(self.path).fullmatch(field) is not None


def _regex(pattern: str) -> re.Pattern[str]:
    out = re.escape(pattern)
    out = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(?:" + m.group(1).replace(",", "|") + ")", out)
    out = out.replace(r"\.\*\*", r"(?:\..+)?").replace(r"\*", r"[^.]+")
    return re.compile(out)


# --------------------------------------------------------------------------------------------------------
# Rule builders and value helpers
# --------------------------------------------------------------------------------------------------------


def _refuse(why: str) -> Any:
    """Raise ``Unsupported(why)`` (inside a rule's one-line conversion)."""
    raise Unsupported(why)


def num(value: Any) -> float:
    """A number from a YAML value (PyYAML reads ``1e-8`` without a dot as a string)."""
    if isinstance(value, bool):
        raise Unsupported(f"expected a number, got {show(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise Unsupported(f"expected a number, got {show(value)}") from None


def integer(value: Any) -> int:
    x = num(value)
    if x != int(x):
        raise Unsupported(f"expected a whole number, got {show(value)}")
    return int(x)


def F(path: str, field: str, convert: Convert | None = None, why: str = "") -> Rule:
    """A field that sets ``field`` (to the value, or to ``convert``'s result)."""
    return Rule(path, "field", field, why, convert or (lambda v, c: {field: v}))


def N(path: str, field: str, why: str = "") -> Rule:
    """A number that sets ``field``; null leaves rlbits' default, which is the seeds' null (off, or the other
    bound) wherever both have one."""
    return Rule(path, "field", field, why, lambda v, c: "(null: rlbits' default)" if v is None else {field: num(v)})


def INT(path: str, field: str, why: str = "") -> Rule:
    return Rule(path, "field", field, why, lambda v, c: "(null: rlbits' default)" if v is None else {field: integer(v)})


def B(path: str, behaviour: str, accepted: Any = None, why: str = "", *, check: Callable[[Any], bool] | None = None) -> Rule:
    """What rlbits always does: the value must be ``accepted`` (one value, or a tuple of them) or pass
    ``check``; otherwise it is refused with ``why``."""

    def convert(v: Any, c: Ctx) -> str:
        ok = check(v) if check is not None else v in (accepted if isinstance(accepted, tuple) else (accepted,))
        if not ok:
            raise Unsupported(why or f"rlbits: {behaviour}")
        return behaviour

    return Rule(path, "builtin", behaviour, why, convert)


def OFF(path: str, feature: str, off_when: Callable[[Ctx], bool], convert: Convert, rlbits: str, why: str) -> Rule:
    """A sub-option of ``feature``: no effect while ``off_when(ctx)``, else ``convert``."""

    def conv(v: Any, c: Ctx) -> dict[str, Any] | str:
        return f"(no effect: {feature})" if off_when(c) else convert(v, c)

    return Rule(path, "field", rlbits, why, conv)


def I(path: str, why: str) -> Rule:  # noqa: E743 (I for infrastructure, as the tables' column)
    """Infrastructure with no rlbits equivalent."""
    return Rule(path, "infrastructure", "", why)


def U(path: str, why: str) -> Rule:
    """An algorithm rlbits does not have."""
    return Rule(path, "unsupported", "", why)


def _refuse_unless(pred: Callable[[Any], bool], why: str, note: str = "(off)") -> Convert:
    def conv(v: Any, c: Ctx) -> str:
        if not pred(v):
            raise Unsupported(why)
        return note

    return conv


def _is_off(v: Any) -> bool:
    return v in (None, False, 0, 0.0, "none", "None", [], {})


# --------------------------------------------------------------------------------------------------------
# NeMo-RL (examples/configs/ppo*.yaml, grpo_math_1B.yaml)
# --------------------------------------------------------------------------------------------------------

A = "{ppo,grpo}"  # the algorithm section: ppo -> the ppo loop, grpo -> the reinforce loop
MEGATRON = "Megatron-Core training backend (parallel sizes, fusions, MoE, CUDA graphs); rlbits trains with FSDP2"
VLLM = "vLLM/Megatron generation engine settings; rlbits generates with its own decoder"
LOGGER = "logging back-end (W&B, TensorBoard, MLflow, SwanLab, GPU monitor); rlbits logs metrics.jsonl + TensorBoard"
DATA = "data set and its processing; rlbits trains on a built-in task (task=...) or its prompt/val files"


def _number_of(field: str) -> Convert:
    return lambda v, c: {field: num(v)}


def _nemo_rl_val_generation(key: str) -> Convert:
    """``val_temperature`` / ``val_top_p`` / ``val_top_k``: a ``val_generation`` entry where it differs from
    the rollouts' value."""

    def conv(v: Any, c: Ctx) -> dict[str, Any]:
        if v == c.get(f"policy.generation.{key}"):
            return {}
        return {"val_generation": {key: None if key == "top_k" and v in (None, 0, -1) else v}}

    return conv


def _nemo_rl_megatron(c: Ctx) -> bool:
    return bool(c.get("policy.megatron_cfg.enabled"))


def _nemo_rl_lora_on(c: Ctx) -> bool:
    return bool(c.get("policy.dtensor_cfg.lora_cfg.enabled")) and not _nemo_rl_megatron(c)


def _nemo_rl_minibatches(v: Any, c: Ctx) -> dict[str, Any]:
    sec = c.get("ppo") or c.get("grpo") or {}
    samples = integer(sec.get("num_prompts_per_step", 1)) * integer(sec.get("num_generations_per_prompt", 1))
    gbs = integer(v)
    if samples % gbs or gbs % integer(sec.get("num_generations_per_prompt", 1)):
        raise Unsupported(
            f"{samples} samples per step are not whole minibatches of {gbs} whole prompt groups; rlbits deals "
            "the step's samples into num_minibatches minibatches of whole groups"
        )
    return {"num_minibatches": samples // gbs}


def _nemo_rl_scheduler(v: Any, c: Ctx) -> dict[str, Any] | str:
    if v is None:
        return {"lr_scheduler": "constant"}
    items = v if isinstance(v, list) else []
    scheds = [s for s in items if isinstance(s, dict) and "name" in s]
    miles = [s.get("milestones") for s in items if isinstance(s, dict) and "milestones" in s]
    names = [str(s["name"]).rsplit(".", 1)[-1] for s in scheds]
    kw = [s.get("kwargs") or {} for s in scheds]
    if names == ["ConstantLR"] and num(kw[0].get("factor", 1.0)) == 1.0:
        return {"lr_scheduler": "constant"}
    if names == ["LinearLR", "ConstantLR"] and num(kw[0].get("end_factor", 1.0)) == 1.0:
        total = integer(kw[0].get("total_iters", 5))
        if miles and miles[0] not in ([total], None):
            raise Unsupported(f"milestones {miles[0]} differ from LinearLR's total_iters {total}")
        return {
            "lr_scheduler": "linear_warmup",
            "lr_warmup_steps": total,
            "lr_warmup_start_factor": num(kw[0].get("start_factor", 1 / 3)),
        }
    raise Unsupported(
        f"scheduler list {show(names)}: rlbits has ConstantLR and LinearLR->ConstantLR (linear_warmup), "
        "NeMo's CosineAnnealing (cosine) and torch's CosineAnnealingLR (cosine_annealing)"
    )


_CRITIC_WARMUP = {"lr_warmup_steps": "critic_lr_warmup_steps", "lr_warmup_start_factor": "critic_lr_warmup_start_factor"}


def _critic_schedule(mine: dict[str, Any] | str, theirs: dict[str, Any] | str) -> dict[str, Any] | str:
    """The critic's schedule ``mine`` against the policy's ``theirs`` (both as ``lr_scheduler`` fields): the
    same kind, its own warm-up as ``critic_lr_warmup_*`` where it differs."""
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return "(the critic follows the policy's schedule from critic_learning_rate)"
    if mine.get("lr_scheduler") != theirs.get("lr_scheduler") or any(
        mine.get(k) != theirs.get(k) for k in set(mine) | set(theirs) if k not in _CRITIC_WARMUP
    ):
        raise Unsupported(
            f"the value model's schedule ({_fmt(mine)}) is not the policy's ({_fmt(theirs)}) with its own "
            "warm-up: rlbits' critic follows lr_scheduler, with critic_lr_warmup_steps / _start_factor"
        )
    out = {_CRITIC_WARMUP[k]: mine[k] for k in _CRITIC_WARMUP if k in mine and mine[k] != theirs.get(k)}
    return out or "(the critic follows the policy's schedule from critic_learning_rate)"


def _nemo_rl_value_scheduler(v: Any, c: Ctx) -> dict[str, Any] | str:
    if c.get("value.megatron_cfg.enabled"):
        return "(no effect: value.megatron_cfg.enabled)"
    return _critic_schedule(_nemo_rl_scheduler(v, c), _nemo_rl_scheduler(c.get("policy.scheduler"), c))


def _same_as_policy(key: str, what: str) -> Convert:
    def conv(v: Any, c: Ctx) -> str:
        if v != c.get(f"policy.{key}"):
            raise Unsupported(f"value.{key} ({show(v)}) differs from policy.{key}: rlbits' critic {what}")
        return f"(rlbits' critic {what})"

    return conv


def _nemo_rl_adv_name(v: Any, c: Ctx) -> dict[str, Any] | str:
    if c.loop == "ppo":
        if v != "gae":
            raise Unsupported(f"adv_estimator {show(v)} in PPO: rlbits' PPO uses GAE with its critic")
        return "(GAE: the ppo loop)"
    est = c.get("grpo.adv_estimator", {})
    if v == "grpo":
        norm, loo = bool(est.get("normalize_rewards", True)), bool(est.get("use_leave_one_out_baseline", True))
        return {"adv_estimator": _NEMO_RL_GRPO[(norm, loo)]}
    if v == "reinforce_plus_plus":
        base = bool(est.get("minus_baseline", True))
        return {"adv_estimator": "reinforce_plus_plus_baseline" if base else "reinforce_plus_plus"}
    if v == "raw_reward":
        return {"adv_estimator": "raw_reward" if est.get("normalize_advantages", True) else "none"}
    raise Unsupported(f"adv_estimator {show(v)}: rlbits has grpo, rloo, reinforce_plus_plus(_baseline), raw_reward")


_NEMO_RL_GRPO = {(True, True): "grpo_loo", (True, False): "grpo", (False, True): "rloo", (False, False): "dr_grpo"}
"""NeMo-RL's GRPO advantage by (``normalize_rewards``, ``use_leave_one_out_baseline``) -> rlbits' estimator."""


def _nemo_rl_grpo_flags(v: Any, c: Ctx) -> dict[str, Any] | str:
    """``grpo.normalize_rewards`` / ``use_leave_one_out_baseline`` of a config without ``grpo.adv_estimator``
    (NeMo-RL before it: grpo.py read them directly); with it they only feed its fields."""
    if c.get("grpo.adv_estimator") is not None:
        return "(part of adv_estimator)"
    norm = bool(c.get("grpo.normalize_rewards", True))
    return {"adv_estimator": _NEMO_RL_GRPO[(norm, bool(c.get("grpo.use_leave_one_out_baseline", True)))]}


def _nemo_rl_gae_lambda(v: Any, c: Ctx) -> dict[str, Any] | str:
    est = c.get("ppo.adv_estimator", {})
    if est.get("gae_lambda_policy") is None:
        return {"lam": num(v)}
    if est.get("gae_lambda_value") is None:
        return {"critic_lam": num(v)}
    return "(no effect: gae_lambda_policy and gae_lambda_value are set)"


def _value_weight_decay(v: Any, c: Ctx) -> dict[str, Any] | str:
    if c.get("value.megatron_cfg.enabled"):
        return "(no effect: value.megatron_cfg.enabled)"
    if num(v) != num(c.get("policy.optimizer.kwargs.weight_decay", v)):
        return {"critic_weight_decay": num(v)}
    return "(the critic uses weight_decay)"


def _value_megatron_weight_decay(v: Any, c: Ctx) -> dict[str, Any] | str:
    """The value model's Megatron weight decay: Megatron's ``OptimizerParamScheduler`` sets every parameter
    group's weight decay from ``start_weight_decay`` / ``end_weight_decay`` at each step, so those (constant)
    are the critic's, and ``optimizer.weight_decay`` is the value they default to."""
    if not c.get("value.megatron_cfg.enabled"):
        return "(no effect: value.megatron_cfg.enabled is false)"
    sched = c.get("value.megatron_cfg.scheduler") or {}
    if c.field.endswith("incr_style"):
        if v != "constant":
            raise Unsupported("a weight decay that changes over the run is not supported: rlbits' is constant")
        return "(critic_weight_decay, constant)"
    start, end = sched.get("start_weight_decay"), sched.get("end_weight_decay")
    if c.field.endswith("optimizer.weight_decay") and (start is not None or end is not None):
        return "(the scheduler's start_weight_decay / end_weight_decay set it)"
    if start is not None and end is not None and num(start) != num(end):
        raise Unsupported(f"weight decay from {show(start)} to {show(end)}: rlbits' critic_weight_decay is constant")
    if c.field.endswith("start_weight_decay") and end is not None:
        return "(critic_weight_decay, with end_weight_decay)"
    policy = c.get("policy.megatron_cfg.optimizer.weight_decay")
    if policy is not None and num(v) == num(policy):
        return "(the critic uses weight_decay)"
    return {"critic_weight_decay": num(v)}


def _value_megatron_schedule(v: Any, c: Ctx) -> dict[str, Any] | str:
    """The value model's Megatron warm-up (``lr_warmup_iters``, ``lr_warmup_init``) against the policy's."""
    if not c.get("value.megatron_cfg.enabled"):
        return "(no effect: value.megatron_cfg.enabled is false)"
    if c.field.endswith("lr_warmup_init"):
        return "(with lr_warmup_iters)"

    def sched(side: str) -> dict[str, Any] | str:
        style = c.get(f"{side}.megatron_cfg.scheduler.lr_decay_style")
        warm = integer(c.get(f"{side}.megatron_cfg.scheduler.lr_warmup_iters") or 0)
        if style == "constant" and warm:
            init = num(c.get(f"{side}.megatron_cfg.scheduler.lr_warmup_init") or 0.0)
            factor = init / num(c.get(f"{side}.megatron_cfg.optimizer.lr"))
            return {"lr_scheduler": "linear_warmup", "lr_warmup_steps": warm, "lr_warmup_start_factor": factor}
        if style == "constant":
            return {"lr_scheduler": "constant"}
        return {"lr_scheduler": str(style), "lr_warmup_steps": warm}

    mine, theirs = sched("value"), sched("policy")
    if isinstance(mine, dict) and isinstance(theirs, dict):  # factors compared to float rounding
        a, b = mine.get("lr_warmup_start_factor"), theirs.get("lr_warmup_start_factor")
        if a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9):
            mine["lr_warmup_start_factor"] = b
    return _critic_schedule(mine, theirs)


def _like_policy(v: Any, c: Ctx) -> str:
    """A value-model field that rlbits takes from the policy's settings: it must equal the policy's."""
    mine = c.field.replace("value.", "policy.", 1)
    theirs = c.get(mine, v)
    if c.field.endswith("lr_warmup_init"):  # rlbits' warm-up starts at a fraction of each rate
        v = num(v) / num(c.get("value.megatron_cfg.optimizer.lr"))
        theirs = num(theirs) / num(c.get("policy.megatron_cfg.optimizer.lr"))
    if c.field.endswith("min_lr") and c.get("value.megatron_cfg.scheduler.lr_decay_style") == "constant":
        return "(no effect: lr_decay_style constant)"
    try:
        same = v == theirs or math.isclose(num(v), num(theirs), rel_tol=1e-9)
    except Unsupported:
        same = False
    if not same:
        raise Unsupported(f"differs from {mine} ({show(theirs)} against {show(v)}); rlbits' critic uses the policy's setting")
    return f"(the critic uses {mine})"


def _value_megatron(v: Any, c: Ctx) -> str:
    if not c.get("value.megatron_cfg.enabled"):
        return "(no effect: value.megatron_cfg.enabled is false)"
    return _like_policy(v, c)


def _value_dtensor(v: Any, c: Ctx) -> str:
    if c.get("value.megatron_cfg.enabled"):
        return "(no effect: value.megatron_cfg.enabled)"
    return _like_policy(v, c)


def _nemo_rl_kl_coef(v: Any, c: Ctx) -> dict[str, Any]:
    coef = num(v)
    if c.get("loss_fn.use_kl_in_reward"):
        return {"kl_in_reward": True, "kl_coef": coef}
    if c.loop == "ppo":
        return {"kl_in_reward": False, "kl_loss_coef": coef, "kl_coef": 0.0}
    return {"kl_loss_coef": coef}


def _nemo_rl_kl_type(v: Any, c: Ctx) -> dict[str, Any]:
    if v not in ("k1", "k2", "k3"):
        raise Unsupported(f"reference_policy_kl_type {show(v)}: rlbits' estimators are k1, k2, k3, abs")
    if c.loop == "reinforce" and not c.get("loss_fn.use_kl_in_reward"):
        return {"kl_loss_estimator": v}
    return {"kl_estimator": v}


def _nemo_rl_is_correction(v: Any, c: Ctx) -> dict[str, Any]:
    if not v:
        return {"rollout_correction": {"mode": "none"}}
    kind = c.get("loss_fn.truncated_importance_sampling_type")
    ratio, low = c.get("loss_fn.truncated_importance_sampling_ratio"), c.get(
        "loss_fn.truncated_importance_sampling_ratio_min"
    )
    modes = {"tis": "tis", "icepop": "icepop", "seq-mask-tis": "seq_mask_tis", "seq_mask_tis": "seq_mask_tis"}
    if ratio is None:
        raise Unsupported("untruncated importance weights (no truncated_importance_sampling_ratio): rlbits' "
                          "rollout_correction modes bound the weights with a threshold")
    if kind not in modes:
        raise Unsupported(
            f"importance sampling correction of type {show(kind)} with ratio {show(ratio)}: rlbits' "
            "rollout_correction has tis, icepop and seq_mask_tis with a threshold"
        )
    corr: dict[str, Any] = {"mode": modes[kind], "threshold": num(ratio)}
    if low is not None:
        corr["threshold_low"] = num(low)
    return {"rollout_correction": corr}


def _nemo_rl_tis_sub(v: Any, c: Ctx) -> str:
    if not c.get("loss_fn.use_importance_sampling_correction"):
        return "(no effect: use_importance_sampling_correction is false)"
    return "(rollout_correction, with use_importance_sampling_correction)"


def _nemo_rl_metric(v: Any, c: Ctx) -> dict[str, Any]:
    kind, _, name = str(v).partition(":")
    if not name or kind not in ("val", "train"):
        raise Unsupported(f"metric_name {show(v)} is not val:NAME or train:NAME")
    if kind == "train":
        raise Unsupported("rlbits ranks checkpoints by a metric logged at validation (val:NAME)")
    return {"metric_name": "val_reward" if name in ("accuracy", "reward", "rewards") else f"val_{name}"}


def _dyn_off(c: Ctx) -> bool:
    return not (c.get("ppo.use_dynamic_sampling") or c.get("grpo.use_dynamic_sampling"))


def _async_off(c: Ctx) -> bool:
    return not (c.get("ppo.async_ppo.enabled") or c.get("grpo.async_grpo.enabled"))


def _shaping_off(c: Ctx) -> bool:
    return not (c.get("ppo.reward_shaping.enabled") or c.get("grpo.reward_shaping.enabled"))


def _scaling_off(c: Ctx) -> bool:
    return not (c.get("ppo.reward_scaling.enabled") or c.get("grpo.reward_scaling.enabled"))


def _lora_conv(field: str, fn: Callable[[Any], Any] = lambda v: v) -> Convert:
    def conv(v: Any, c: Ctx) -> dict[str, Any] | str:
        return {field: fn(v)} if _nemo_rl_lora_on(c) else "(no effect: dtensor_cfg.lora_cfg.enabled is false)"

    return conv


def _megatron_conv(convert: Convert) -> Convert:
    def conv(v: Any, c: Ctx) -> dict[str, Any] | str:
        return convert(v, c) if _nemo_rl_megatron(c) else "(no effect: megatron_cfg.enabled is false)"

    return conv


def _torch_opt_conv(convert: Convert) -> Convert:
    def conv(v: Any, c: Ctx) -> dict[str, Any] | str:
        return "(no effect: megatron_cfg.enabled)" if _nemo_rl_megatron(c) else convert(v, c)

    return conv


def _betas(v: Any, c: Ctx) -> dict[str, Any]:
    betas = [num(x) for x in (v if isinstance(v, (list, tuple)) else [])]
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise Unsupported(f"Adam betas {show(v)}: adam_betas takes two numbers in [0, 1)")
    return {"adam_betas": betas}


def _adam_eps(v: Any, c: Ctx) -> dict[str, Any]:
    return {"adam_eps": num(v)}


def _megatron_weight_decay(v: Any, c: Ctx) -> str:
    if c.field.endswith("incr_style"):
        ok = v == "constant"
    else:
        ok = num(v) == num(c.get("policy.megatron_cfg.optimizer.weight_decay"))
    if not ok:
        raise Unsupported("a weight decay that changes over the run is not supported: rlbits' weight_decay is constant")
    return "(weight_decay, constant)"


def _megatron_sched(v: Any, c: Ctx) -> dict[str, Any] | str:
    style = c.get("policy.megatron_cfg.scheduler.lr_decay_style")
    warm = integer(c.get("policy.megatron_cfg.scheduler.lr_warmup_iters") or 0)
    if style == "constant":
        if warm:
            lr = num(c.get("policy.megatron_cfg.optimizer.lr"))
            init = num(c.get("policy.megatron_cfg.scheduler.lr_warmup_init") or 0.0)
            return {"lr_scheduler": "linear_warmup", "lr_warmup_steps": warm, "lr_warmup_start_factor": init / lr}
        return {"lr_scheduler": "constant"}
    if style == "cosine":
        return {"lr_scheduler": "cosine", "lr_warmup_steps": warm}
    raise Unsupported(f"lr_decay_style {show(style)}: rlbits has constant (with linear warm-up) and cosine")


NEMO_RL: tuple[Rule, ...] = (
    I("defaults", "NeMo-RL's include of a base file: merged before converting (its fields are converted)"),
    # --- the algorithm section
    INT(f"{A}.num_prompts_per_step", "num_prompts_per_step"),
    INT(f"{A}.num_generations_per_prompt", "num_generations_per_prompt"),
    INT(f"{A}.max_rollout_turns", "max_rollout_turns"),
    INT(f"{A}.max_num_epochs", "max_num_epochs"),
    INT(f"{A}.max_num_steps", "max_num_steps"),
    INT("ppo.ppo_epochs", "ppo_epochs"),
    B("ppo.critic_ppo_epochs", "the critic trains ppo_epochs passes, as the policy", None,
      "a separate number of critic epochs is not supported: the critic trains ppo_epochs passes"),
    INT("ppo.policy_training_start_step", "policy_training_start_step"),
    B("ppo.policy_training_start_epoch", "critic warm-up counted in steps (policy_training_start_step)", (0, None),
      "a critic warm-up counted in epochs is not supported: use policy_training_start_step"),
    B("ppo.steps_per_epoch", "an epoch is one pass over the prompts", (None, 1),
      "steps_per_epoch > 1 is not supported: an rlbits epoch is one pass over the prompts"),
    INT(f"{A}.val_period", "val_period"),
    F(f"{A}.val_at_start", "val_at_start"),
    F(f"{A}.val_at_end", "val_at_end"),
    B("grpo.val_start_at", "validation from the first step", (None, -1, 0), "a validation start step is not supported"),
    F(f"{A}.overlong_filtering", "overlong_filtering"),
    F(f"{A}.max_val_samples", "max_val_samples", lambda v, c: {"max_val_samples": MAX_ROWS if v is None else integer(v)},
      "null (all) -> MAX_ROWS"),
    INT(f"{A}.val_batch_size", "val_batch_size"),
    B("grpo.val_num_generations_per_prompt", "one validation response per prompt", (None, 1),
      "several validation responses per prompt are not supported"),
    B("grpo.advantage_clip_{low,high}", "advantages unclipped", None, "advantage clipping is not supported"),
    B("grpo.stop_at_validation_{metric,threshold}", "no early stop on a validation metric", None,
      "stopping at a validation threshold is not supported"),
    B("grpo.{invalid_tool_call_advantage,malformed_thinking_advantage}", "no fixed advantage for malformed turns",
      None, "fixed advantages for invalid tool calls / malformed thinking are not supported"),
    INT(f"{A}.seed", "seed"),
    F(f"{A}.use_dynamic_sampling", "dynamic_sampling"),
    OFF(f"{A}.dynamic_sampling_max_gen_batches", "use_dynamic_sampling is false", _dyn_off,
        lambda v, c: {"dynamic_sampling_max_gen_batches": integer(v)}, "dynamic_sampling_max_gen_batches", ""),
    OFF(f"{A}.batch_multiplier", "use_dynamic_sampling is false", _dyn_off,
        lambda v, c: {"batch_multiplier": num(v)}, "batch_multiplier", ""),
    Rule("ppo.skip_reference_policy_logprobs_calculation", "field", "skip_reference_policy_logprobs", "",
         lambda v, c: {"skip_reference_policy_logprobs": bool(v)}),
    B("grpo.skip_reference_policy_logprobs_calculation", "the reference runs only when a term uses it",
      check=lambda v: True),
    F(f"{A}.async_{{ppo,grpo}}.enabled", "(synchronous)",
      _refuse_unless(_is_off, "asynchronous (off-policy) rollouts are not supported: rlbits is synchronous",
                     "(synchronous)")),
    OFF(f"{A}.async_{{ppo,grpo}}.*", "async is off", _async_off, lambda v, c: "(async)", "",
        "sub-options of the asynchronous mode"),
    # reward shaping and scaling
    B(f"{A}.reward_shaping.enabled", "on when overlong_buffer_length/penalty or stop_properly_penalty_coef are set",
      check=lambda v: True),
    OFF(f"{A}.reward_shaping.overlong_buffer_length", "reward_shaping.enabled is false", _shaping_off,
        lambda v, c: {} if c.get(f"{c.loop}.reward_shaping.stop_properly_penalty_coef") is not None
        else {"overlong_buffer_length": integer(v)}, "overlong_buffer_length", ""),
    OFF(f"{A}.reward_shaping.overlong_buffer_penalty", "reward_shaping.enabled is false", _shaping_off,
        lambda v, c: {} if c.get(f"{c.loop}.reward_shaping.stop_properly_penalty_coef") is not None
        else {"overlong_buffer_penalty": num(v)}, "overlong_buffer_penalty", ""),
    OFF(f"{A}.reward_shaping.max_response_length", "reward_shaping.enabled is false", _shaping_off,
        lambda v, c: {"max_response_length": integer(v)}, "max_response_length", ""),
    OFF(f"{A}.reward_shaping.stop_properly_penalty_coef", "reward_shaping.enabled is false", _shaping_off,
        lambda v, c: {"stop_properly_penalty_coef": None if v is None else num(v)}, "stop_properly_penalty_coef", ""),
    F(f"{A}.reward_scaling.enabled", "reward_scaling", lambda v, c: {"reward_scaling": bool(v)}),
    *(
        OFF(f"{A}.reward_scaling.{k}", "reward_scaling.enabled is false", _scaling_off,
            _number_of(f"reward_scaling_{k}"), f"reward_scaling_{k}", "")
        for k in ("source_min", "source_max", "target_min", "target_max")
    ),
    B(f"{A}.seq_logprob_error_threshold", "no sequence mask on the logprob error (metrics only)", None,
      "masking sequences by the train/generation logprob error is not supported; see rollout_correction"),
    # advantage estimator
    F(f"{A}.adv_estimator.name", "adv_estimator (reinforce; ppo: GAE)", _nemo_rl_adv_name),
    F("ppo.adv_estimator.gae_lambda", "lam / critic_lam", _nemo_rl_gae_lambda,
      "critic_lam when gae_lambda_policy is set (NeMo-RL's gae_lambda is then the value lambda)"),
    N("ppo.adv_estimator.gae_gamma", "gamma"),
    F("ppo.adv_estimator.normalize_advantages", "whiten_advantages"),
    B("grpo.adv_estimator.normalize_advantages", "part of adv_estimator (raw_reward whitened)", check=lambda v: True),
    F("ppo.adv_estimator.gae_lambda_value", "critic_lam",
      lambda v, c: "(= gae_lambda)" if v is None else {"critic_lam": num(v)}),
    F("ppo.adv_estimator.gae_lambda_policy", "lam",
      lambda v, c: "(= gae_lambda)" if v is None else {"lam": num(v)}),
    N("ppo.adv_estimator.length_adaptive_alpha", "length_adaptive_alpha"),
    B("ppo.adv_estimator.residual_baseline", "GAE on the critic's values", (False, None),
      "a residual baseline is not supported"),
    B("ppo.adv_estimator.turn_gae_{gamma,lambda_value,lambda_policy}", "GAE over tokens (turn_reward: token)",
      (1, 1.0, None), "turn-level GAE with lambda/gamma < 1 is not supported: rlbits' GAE runs over tokens"),
    B(f"{A}.adv_estimator.{{normalize_rewards,use_leave_one_out_baseline,minus_baseline}}",
      "part of adv_estimator", check=lambda v: True),
    B("ppo.{normalize_rewards,use_leave_one_out_baseline}", "no effect in PPO (GAE)", check=lambda v: True),
    B("ppo.adv_estimator.{normalize_rewards,use_leave_one_out_baseline,minus_baseline}", "no effect with GAE",
      check=lambda v: True),
    F("grpo.{normalize_rewards,use_leave_one_out_baseline}", "adv_estimator (without grpo.adv_estimator)",
      _nemo_rl_grpo_flags),
    I("ppo.{log_post_update_critic_metrics,log_rollout_dump,rollout_dump_period}", LOGGER),
    # --- the loss
    B("loss_fn.disable_ppo_ratio", "the clipped ratio loss", (False, None), "disable_ppo_ratio is not supported"),
    F("loss_fn.reference_policy_kl_penalty", "kl_loss_coef (kl_coef with use_kl_in_reward)", _nemo_rl_kl_coef),
    F("loss_fn.reference_policy_kl_type", "kl_estimator / kl_loss_estimator", _nemo_rl_kl_type),
    N("loss_fn.kl_input_clamp_value", "kl_input_clamp"),
    N("loss_fn.kl_output_clamp_value", "kl_clamp"),
    N("loss_fn.ratio_clip_min", "clip_eps"),
    N("loss_fn.ratio_clip_max", "clip_eps_high"),
    F("loss_fn.ratio_clip_c", "policy_loss_kwargs.clip_ratio_c",
      lambda v, c: {} if v is None else {"policy_loss_kwargs": {"clip_ratio_c": num(v)}}),
    B("loss_fn.use_on_policy_kl_approximation", "the KL of the sampled tokens", (False, None),
      "the importance-weighted (on-policy) KL approximation is not supported"),
    F("loss_fn.use_importance_sampling_correction", "rollout_correction", _nemo_rl_is_correction),
    Rule("loss_fn.truncated_importance_sampling_{type,ratio,ratio_min}", "field", "rollout_correction", "",
         _nemo_rl_tis_sub),
    F("loss_fn.sequence_level_importance_ratios", "policy_loss: gspo",
      lambda v, c: {"policy_loss": "gspo"} if v else "(token-level ratios)"),
    F("loss_fn.token_level_loss", "loss_agg",
      lambda v, c: {"loss_agg": "token-mean" if v else "seq-mean-token-mean"}),
    B("loss_fn.force_on_policy_ratio", "the ratio of the current policy", (False, None),
      "force_on_policy_ratio is not supported"),
    F("loss_fn.use_kl_in_reward", "kl_in_reward", lambda v, c: {"kl_in_reward": bool(v)}),
    F("loss_fn.use_cispo", "policy_loss: cispo", lambda v, c: {"policy_loss": "cispo"} if v else "(off)"),
    N("loss_fn.positive_example_nll_weight", "positive_example_nll_weight"),
    N("{value_loss_fn.scale,loss_fn.value_loss_scale}", "vf_coef"),
    N("{value_loss_fn.cliprange,loss_fn.value_clip_range,loss_fn.value_cliprange}", "value_clip_eps"),
    B("value_loss_fn.homogeneous_group_weight", "every sample weighs 1 in the value loss", (1, 1.0, None),
      "a weight for groups of equal rewards in the value loss is not supported"),
    # --- checkpoints
    B("checkpointing.enabled", "checkpoints under run_dir/checkpoints", (True,),
      "rlbits always checkpoints (save_period 0: only at the end)"),
    I("checkpointing.{checkpoint_dir,model_save_format,save_consolidated,save_optimizer,ft_keep_latest_k,ft_save_period}",
      "checkpoint path and format; rlbits writes run_dir/checkpoints (model, optimizer, loop state)"),
    F("checkpointing.metric_name", "metric_name", _nemo_rl_metric),
    F("checkpointing.higher_is_better", "higher_is_better"),
    INT("checkpointing.keep_top_k", "keep_top_k"),
    INT("checkpointing.save_period", "save_period"),
    F("checkpointing.checkpoint_must_save_by", "max_time"),
    # --- the policy
    F("policy.model_name", "policy", why="copied as given: a local folder or an rlbits zoo name runs"),
    B("policy.tokenizer.name", "the policy folder's tokenizer", check=lambda v: True),
    B("policy.tokenizer.chat_template_kwargs", "the tokenizer's chat template as is", None,
      "chat template keyword arguments are not supported"),
    B("policy.tokenizer.chat_template", "the tokenizer's chat template (chat_template: true/false)",
      (None, "default"), "a custom chat template is not supported"),
    I("policy.tokenizer.use_fastokens", "tokenizer implementation"),
    B("policy.hf_config_overrides", "the model's own config", ({}, None), "HF config overrides are not supported"),
    F("policy.train_global_batch_size", "num_minibatches", _nemo_rl_minibatches,
      "num_prompts_per_step * num_generations_per_prompt / train_global_batch_size"),
    INT("policy.train_micro_batch_size", "microbatch_size"),
    I("policy.{generation_batch_size,logprob_batch_size,logprob_chunk_size,offload_optimizer_for_logprob}",
      "batching and offloading of the inference forwards (memory, speed)"),
    I("policy.max_total_sequence_length", "the backends' buffer length; rlbits' lengths are the prompt's and "
      "max_new_tokens"),
    F("policy.precision", "precision",
      lambda v, c: {"precision": {"bfloat16": "bf16", "float32": "fp32"}[v]}
      if v in ("bfloat16", "float32") else _refuse(f"precision {show(v)}")),
    F("policy.dtensor_cfg.activation_checkpointing", "activation_checkpointing",
      _torch_opt_conv(lambda v, c: {"activation_checkpointing": bool(v)})),
    F("policy.dtensor_cfg.lora_cfg.enabled", "lora_rank (0: off)",
      lambda v, c: "(LoRA: dim)" if _nemo_rl_lora_on(c) else {"lora_rank": 0}),
    F("policy.dtensor_cfg.lora_cfg.dim", "lora_rank", _lora_conv("lora_rank", integer)),
    F("policy.dtensor_cfg.lora_cfg.alpha", "lora_alpha", _lora_conv("lora_alpha", num)),
    F("policy.dtensor_cfg.lora_cfg.dropout", "lora_dropout", _lora_conv("lora_dropout", num)),
    F("policy.dtensor_cfg.lora_cfg.target_modules", "lora_target_modules",
      _lora_conv("lora_target_modules", lambda v: list(v) or None)),
    F("policy.dtensor_cfg.lora_cfg.match_all_linear", "lora_target_modules: null (all-linear)",
      lambda v, c: "(all-linear when no target_modules)"),
    B("policy.dtensor_cfg.lora_cfg.exclude_modules", "no excluded modules", ([], None),
      "excluded LoRA modules are not supported"),
    B("policy.dtensor_cfg.lora_cfg.{dropout_position,lora_A_init}", "peft's LoRA (dropout before A, Kaiming A)",
      check=lambda v: True),
    I("policy.dtensor_cfg.lora_cfg.use_triton", "kernel implementation"),
    I("policy.dtensor_cfg.**", "DTensor backend settings (parallel sizes, offload, plans); rlbits shards with FSDP2"),
    # Megatron: its optimizer and schedule are the algorithm's when it is the backend
    F("policy.megatron_cfg.optimizer.lr", "learning_rate", _megatron_conv(lambda v, c: {"learning_rate": num(v)})),
    F("policy.megatron_cfg.optimizer.weight_decay", "weight_decay",
      _megatron_conv(lambda v, c: {"weight_decay": num(v)})),
    F("policy.megatron_cfg.optimizer.min_lr", "min_lr", _megatron_conv(lambda v, c: {"min_lr": num(v)})),
    F("policy.megatron_cfg.optimizer.clip_grad", "max_grad_norm", _megatron_conv(lambda v, c: {"max_grad_norm": num(v)})),
    F("policy.megatron_cfg.optimizer.{adam_beta1,adam_beta2}", "adam_betas", _megatron_conv(
        lambda v, c: _betas([c.get("policy.megatron_cfg.optimizer.adam_beta1"),
                             c.get("policy.megatron_cfg.optimizer.adam_beta2")], c))),
    F("policy.megatron_cfg.optimizer.adam_eps", "adam_eps", _megatron_conv(_adam_eps)),
    F("policy.megatron_cfg.optimizer.optimizer", "(AdamW)", _megatron_conv(
        _refuse_unless(lambda v: v == "adam", "only Adam(W) is supported", "(AdamW)"))),
    F("policy.megatron_cfg.scheduler.lr_decay_style", "lr_scheduler", _megatron_conv(_megatron_sched)),
    F("policy.megatron_cfg.scheduler.{lr_warmup_iters,lr_warmup_init}", "lr_warmup_steps, lr_warmup_start_factor",
      _megatron_conv(lambda v, c: "(with lr_decay_style)")),
    F("policy.megatron_cfg.scheduler.lr_decay_iters", "lr_max_steps",
      _megatron_conv(lambda v, c: {"lr_max_steps": integer(v)}
                     if c.get("policy.megatron_cfg.scheduler.lr_decay_style") == "cosine" else "(constant)")),
    F("policy.megatron_cfg.scheduler.{start_weight_decay,end_weight_decay,weight_decay_incr_style}",
      "weight_decay (constant)", _megatron_conv(_megatron_weight_decay)),
    F("policy.megatron_cfg.activation_checkpointing", "activation_checkpointing",
      _megatron_conv(lambda v, c: {"activation_checkpointing": bool(v)})),
    F("policy.megatron_cfg.enabled", "(the training backend)", lambda v, c: "(FSDP2 in rlbits)"),
    I("policy.megatron_cfg.**", MEGATRON),
    I("policy.{dynamic_batching,sequence_packing}.**", "token-budget micro-batching and sequence packing (speed)"),
    I("policy.make_sequence_length_divisible_by", "padding for tensor parallelism"),
    N("policy.max_grad_norm", "max_grad_norm"),
    B("policy.optimizer", "AdamW (the Megatron optimizer's fields)", None, "a null optimizer needs Megatron"),
    F("policy.optimizer.name", "(AdamW)", _torch_opt_conv(_refuse_unless(
        lambda v: str(v).endswith("AdamW"), "only torch.optim.AdamW is supported", "(AdamW)"))),
    F("policy.optimizer.kwargs.lr", "learning_rate", _torch_opt_conv(lambda v, c: {"learning_rate": num(v)})),
    F("policy.optimizer.kwargs.weight_decay", "weight_decay", _torch_opt_conv(lambda v, c: {"weight_decay": num(v)})),
    F("policy.optimizer.kwargs.betas", "adam_betas", _torch_opt_conv(_betas)),
    F("policy.optimizer.kwargs.eps", "adam_eps", _torch_opt_conv(_adam_eps)),
    I("policy.optimizer.kwargs.{foreach,fused}", "optimizer kernel implementation"),
    F("policy.scheduler", "lr_scheduler, lr_warmup_steps, lr_warmup_start_factor",
      _torch_opt_conv(_nemo_rl_scheduler)),
    # generation
    I("policy.generation.backend", VLLM),
    INT("policy.generation.max_new_tokens", "max_new_tokens"),
    N("policy.generation.temperature", "temperature"),
    N("policy.generation.top_p", "top_p"),
    F("policy.generation.top_k", "top_k", lambda v, c: {"top_k": None if v in (None, 0, -1) else integer(v)}),
    *(
        F(f"policy.generation.val_{k}", f"val_generation.{k}", _nemo_rl_val_generation(k))
        for k in ("temperature", "top_p", "top_k")
    ),
    B("policy.generation.stop_token_ids", "EOS ends a response", None,
      "stop_token_ids are not a config field (generate(stop_token_ids=...) takes them)"),
    F("policy.generation.stop_strings", "stop_strings", lambda v, c: {"stop_strings": list(v or [])}),
    I("policy.generation.**", VLLM),
    B("policy.draft.enabled", "no draft model", (False, None), "speculative decoding with a draft model"),
    I("policy.draft.**", "speculative-decoding draft model (generation speed)"),
    # --- the value model
    F("value.model_name", "critic_init",
      lambda v, c: {"critic_init": "policy"} if v == c.get("policy.model_name") else {"critic_init": v}),
    B("value.tokenizer.**", "the policy's tokenizer", check=lambda v: True),
    F("value.train_global_batch_size", "(the policy's minibatches)",
      _same_as_policy("train_global_batch_size", "trains on the policy's minibatches")),
    F("value.train_micro_batch_size", "(microbatch_size)",
      _same_as_policy("train_micro_batch_size", "uses microbatch_size")),
    F("value.precision", "(precision)", _same_as_policy("precision", "runs at the run's precision")),
    B("value.reward_model_cfg.{enabled,reward_model_type}", "a scalar value head", check=lambda v: True),
    B("value.load_value_head_from_model", "a fresh value head on the policy's backbone (critic_init: policy)",
      (False, None), "a value head loaded from the model: set critic_init to a saved ValueModel folder"),
    B("value.seed", "the run's seed", check=lambda v: True),
    B("value.reward_model_cfg.only_head_unfreeze", "the whole critic trains", (False, None),
      "training only the value head is not supported"),
    B("value.swe_privileged_critic.enabled", "the critic sees what the policy sees", (False, None),
      "a privileged critic is not supported"),
    OFF("value.swe_privileged_critic.*", "swe_privileged_critic.enabled is false",
        lambda c: not c.get("value.swe_privileged_critic.enabled"), lambda v, c: "", "", ""),
    F("value.max_grad_norm", "(max_grad_norm)", _same_as_policy("max_grad_norm", "clips at max_grad_norm")),
    F("value.optimizer.kwargs.lr", "critic_learning_rate",
      lambda v, c: "(no effect: megatron_cfg.enabled)" if c.get("value.megatron_cfg.enabled")
      else {"critic_learning_rate": num(v)}),
    F("value.megatron_cfg.optimizer.lr", "critic_learning_rate",
      lambda v, c: {"critic_learning_rate": num(v)} if c.get("value.megatron_cfg.enabled")
      else "(no effect: value.megatron_cfg.enabled is false)"),
    F("value.optimizer.kwargs.weight_decay", "critic_weight_decay", _value_weight_decay),
    F("value.optimizer.kwargs.betas", "adam_betas", _betas),
    F("value.optimizer.kwargs.eps", "adam_eps", _adam_eps),
    B("value.optimizer.name", "AdamW", check=lambda v: str(v).endswith("AdamW")),
    B("value.optimizer", "AdamW (the Megatron optimizer's fields)", None, "a null optimizer needs Megatron"),
    I("value.optimizer.kwargs.{foreach,fused}", "optimizer kernel implementation"),
    F("value.scheduler", "(the policy's schedule; critic_lr_warmup_steps, critic_lr_warmup_start_factor)",
      _nemo_rl_value_scheduler),
    F("value.megatron_cfg.optimizer.{min_lr,clip_grad,adam_beta1,adam_beta2,adam_eps,optimizer}",
      "(the policy's: min_lr, max_grad_norm, AdamW betas and eps)", _value_megatron),
    F("value.megatron_cfg.{optimizer.weight_decay,scheduler.start_weight_decay,scheduler.end_weight_decay,"
      "scheduler.weight_decay_incr_style}", "critic_weight_decay", _value_megatron_weight_decay),
    F("value.megatron_cfg.scheduler.{lr_decay_style,lr_decay_iters}", "(the policy's schedule)", _value_megatron),
    F("value.megatron_cfg.scheduler.{lr_warmup_iters,lr_warmup_init}",
      "critic_lr_warmup_steps, critic_lr_warmup_start_factor", _value_megatron_schedule),
    F("value.megatron_cfg.activation_checkpointing", "(activation_checkpointing)", _value_megatron),
    I("value.megatron_cfg.**", MEGATRON),
    F("value.dtensor_cfg.{activation_checkpointing,lora_cfg.enabled,lora_cfg.dim,lora_cfg.alpha,lora_cfg.dropout,"
      "lora_cfg.target_modules,lora_cfg.match_all_linear,lora_cfg.exclude_modules}",
      "(the policy's activation_checkpointing and LoRA)", _value_dtensor),
    I("value.dtensor_cfg.**", "DTensor backend settings of the value model"),
    I("value.{dynamic_batching,sequence_packing}.**", "token-budget micro-batching and sequence packing (speed)"),
    I("value.{make_sequence_length_divisible_by,max_total_sequence_length,logprob_batch_size,hf_config_overrides}",
      "value-model backend buffers and batching"),
    # --- data, environments, logging, cluster
    B("data.shuffle", "prompts shuffled (seeded)", (True, None), "unshuffled prompts are not supported"),
    I("data.**", DATA),
    I("env.**", "environment workers and their servers (NeMo-Gym, math verifiers); rlbits: the task's reward/env"),
    B("reward_penalties.**", "no extra reward penalties", check=_is_off,
      why="Nemotron's reward penalties (duplicated reasoning, empty answers, unwanted tokens) are not supported"),
    U("effort_levels.**", "reasoning-effort prompt variants with their length penalties are not supported"),
    B("on_policy_distillation", "no distillation", None, "on-policy distillation is not supported"),
    I("data_plane.**", "data transfer service between workers"),
    I("logger.**", LOGGER),
    I("cluster.**", "cluster (nodes, GPUs, ports); rlbits runs on one process or under torchrun"),
)


# --------------------------------------------------------------------------------------------------------
# NeMo-Aligner (examples/nlp/gpt/conf/gpt_ppo_actor.yaml, gpt_reinforce_actor.yaml, gpt_ppo_critic.yaml)
# --------------------------------------------------------------------------------------------------------

AL = "{ppo,reinforce}"
TRT = "TensorRT-LLM generation engine; rlbits generates with its own decoder"


def _aligner_kl(v: Any, c: Ctx) -> dict[str, Any]:
    if c.loop == "ppo":
        return {"kl_in_reward": True, "kl_coef": num(v)}
    return {"kl_in_reward": num(v) > 0, "kl_coef": num(v), "kl_reward_reduction": "mean"}


def _aligner_steps(v: Any, c: Ctx) -> dict[str, Any] | str:
    if integer(v) < 0:
        return "(the whole train set: max_num_epochs decides; set max_num_steps for a fixed length)"
    return {"max_num_steps": integer(v)}


def _aligner_gbs(v: Any, c: Ctx) -> dict[str, Any] | str:
    if c.get("model.ppo") is None and c.get("model.reinforce") is None:
        return "(the critic trains on the policy's minibatches)"
    alg = c.get(f"model.{c.loop}") or {}
    samples = integer(alg.get("num_rollout_samples", 1)) * integer(c.get("trainer.reinforce.num_rollouts_per_prompt") or 1)
    if samples % integer(v):
        raise Unsupported(f"{samples} rollout samples are not whole minibatches of {v}")
    return {"num_minibatches": samples // integer(v)}


def _aligner_sched(v: Any, c: Ctx) -> dict[str, Any]:
    if v != "CosineAnnealing":
        raise Unsupported(f"scheduler {show(v)}: rlbits has NeMo's CosineAnnealing (cosine)")
    return {"lr_scheduler": "cosine"}


def _is_critic(c: Ctx) -> bool:
    return c.get("model.ppo") is None and c.get("model.reinforce") is None


def _actor(field: str, fn: Callable[[Any], Any] = lambda v: v, critic_note: str = "") -> Convert:
    """An actor field; in the critic's config it maps to the critic's field, or is a note."""

    def conv(v: Any, c: Ctx) -> dict[str, Any] | str:
        if _is_critic(c):
            return critic_note or f"(the critic follows the policy's {field})"
        return {field: fn(v)}

    return conv


def _end_strings(v: Any, c: Ctx) -> dict[str, Any]:
    eos = {"<|endoftext|>", "</s>", "<|eot_id|>", "<|im_end|>", "<eos>"}
    return {"stop_strings": [s for s in (v or []) if s not in eos]}


def _aligner_lora(field: str, fn: Callable[[Any], Any]) -> Convert:
    def conv(v: Any, c: Ctx) -> dict[str, Any] | str:
        if c.get("model.peft.peft_scheme") != "lora":
            return "(no effect: peft_scheme is none)"
        return {field: fn(v)}

    return conv


def _aligner_targets(v: Any, c: Ctx) -> dict[str, Any] | str:
    if c.get("model.peft.peft_scheme") != "lora":
        return "(no effect: peft_scheme is none)"
    if v in ("all", ["all"]):
        return {"lora_target_modules": None}
    raise Unsupported(f"NeMo module names {show(v)} have no HF equivalent here; lora_target_modules names HF modules")


NEMO_ALIGNER: tuple[Rule, ...] = (
    I("defaults", "Hydra config group (tp_overlap: Megatron tensor-parallel communication overlap)"),
    I("trainer.{num_nodes,devices,accelerator,logger,enable_checkpointing,use_distributed_sampler}",
      "PyTorch Lightning trainer / cluster settings; rlbits runs on one process or under torchrun"),
    F("{trainer,model}.precision", "precision",
      lambda v, c: {"precision": "bf16" if str(v).startswith("bf16") else "fp32"}
      if str(v) in ("bf16", "bf16-mixed", "32", "32-true", "fp32")
      else _refuse(f"precision {show(v)}: rlbits has fp32 and bf16")),
    INT("trainer.ppo.critic_warmup_steps", "critic_warmup_steps"),
    INT(f"trainer.{AL}.max_epochs", "max_num_epochs"),
    F(f"trainer.{AL}.max_steps", "max_num_steps (lr_max_steps in the critic's)",
      lambda v, c: {"lr_max_steps": integer(v)} if _is_critic(c) and integer(v) > 0 else _aligner_steps(v, c)),
    B("trainer.{max_epochs,max_steps}", "copies of trainer.ppo/reinforce's", check=lambda v: True),
    INT(f"trainer.{AL}.val_check_interval", "val_period"),
    INT(f"trainer.{AL}.save_interval", "save_period"),
    F(f"trainer.{AL}.gradient_clip_val", "max_grad_norm", lambda v, c: {"max_grad_norm": num(v)}),
    F(f"trainer.{AL}.initial_policy_kl_penalty", "kl_coef (kl_in_reward; reinforce: kl_reward_reduction mean)",
      _aligner_kl),
    F(f"trainer.{AL}.use_absolute_kl", "kl_estimator", lambda v, c: {"kl_estimator": "abs" if v else "k1"}),
    N("trainer.ppo.discount_factor", "gamma"),
    N("trainer.ppo.gae_lambda", "lam"),
    F("trainer.ppo.normalize_advantages", "whiten_advantages"),
    F("trainer.reinforce.num_rollouts_per_prompt", "num_generations_per_prompt, adv_estimator: rloo, "
      "rloo_exclude_truncated", lambda v, c: {"num_generations_per_prompt": integer(v), "adv_estimator": "rloo",
                                              "rloo_exclude_truncated": True}),
    F("trainer.max_time", "max_time"),
    I(f"trainer.{AL}.rollout_batch_seq_length", "padding of the rollout batch (memory)"),
    I(f"trainer.{AL}.trt_model_dir", TRT),
    I(f"trainer.{AL}.trt_llm.**", TRT),
    I(f"trainer.{AL}.batch_iterator.**", "flask server balancing rollouts over data-parallel ranks"),
    B(f"trainer.{AL}.{{model_gbs,model_mbs}}", "copies of model.global_batch_size / micro_batch_size",
      check=lambda v: True),
    # the critic server's own trainer section (gpt_ppo_critic.yaml)
    I("trainer.ppo.{port,combine_rm_and_critic_server,max_queue_delay_microseconds,strip_sequence_length_to_multiple,"
      "inference_micro_batch_size}",
      "the critic/reward server (PyTriton); rlbits trains the critic in-process (or serves it: rlbits serve-critic "
      "and PPO's critic_server: http://HOST:PORT)"),
    I("{remote_critic_rm,remote_rm}.**",
      "addresses of the reward and critic servers; rlbits: reward_model (a folder) or rlbits serve-reward, and "
      "the critic in-process or rlbits serve-critic with PPO's critic_server: http://HOST:PORT"),
    # checkpoints and the run's folder
    F("exp_manager.checkpoint_callback_params.monitor", "metric_name",
      lambda v, c: "(critic checkpoints: saved with the policy)" if _is_critic(c)
      else {"metric_name": "val_reward" if v in ("val_rewards", "val_reward") else f"val_{v}".replace("val_val_", "val_")}),
    F("exp_manager.checkpoint_callback_params.save_top_k", "keep_top_k",
      lambda v, c: "(critic checkpoints: saved with the policy)" if _is_critic(c)
      else {"keep_top_k": integer(v) if integer(v) > 0 else None}),
    F("exp_manager.checkpoint_callback_params.mode", "higher_is_better",
      lambda v, c: "(critic)" if _is_critic(c) else {"higher_is_better": v == "max"}),
    F("exp_manager.max_time_per_run", "max_time"),
    I("exp_manager.**", "experiment folder, loggers, resume and checkpoint file options; rlbits writes run_dir"),
    F("pretrained_checkpoint.restore_from_path", "policy (the critic's: critic_init)",
      lambda v, c: {} if v is None else {"critic_init" if _is_critic(c) else "policy": v},
      "a .nemo checkpoint is copied as given: rlbits loads HF folders"),
    # the actor's algorithm section
    INT(f"model.{AL}.rollout_micro_batch_size", "chunk_size"),
    INT(f"model.{AL}.num_rollout_samples", "num_prompts_per_step"),
    I(f"model.{AL}.forward_micro_batch_size", "micro-batch of the logprob forwards (memory)"),
    INT(f"model.{AL}.val_rollout_micro_batch_size", "val_batch_size"),
    INT(f"model.{AL}.num_val_samples", "max_val_samples"),
    I(f"model.{AL}.offload_adam_states", "optimizer-state offload during generation (memory)"),
    N("model.ppo.entropy_bonus", "entropy_coef"),
    N("model.ppo.ratio_eps", "clip_eps"),
    F(f"model.{AL}.sampling_params.use_greedy", "val_greedy", lambda v, c: {"val_greedy": bool(v)},
      "rollouts sample (temperature); greedy decoding is validation's"),
    N(f"model.{AL}.sampling_params.temperature", "temperature"),
    F(f"model.{AL}.sampling_params.top_k", "top_k", lambda v, c: {"top_k": None if v in (None, 0) else integer(v)}),
    N(f"model.{AL}.sampling_params.top_p", "top_p"),
    N(f"model.{AL}.sampling_params.repetition_penalty", "repetition_penalty"),
    B(f"model.{AL}.sampling_params.add_BOS", "prompts as the task tokenizes them", (False, None),
      "prepending BOS to the prompts is not supported"),
    I(f"model.{AL}.sampling_params.{{all_probs,compute_logprob}}", "outputs NeMo's generate returns"),
    F(f"model.{AL}.sampling_params.end_strings", "stop_strings (EOS strings: eos_token_id)", _end_strings),
    INT(f"model.{AL}.length_params.max_length", "max_new_tokens"),
    INT(f"model.{AL}.length_params.min_length", "min_new_tokens"),
    I(f"model.{AL}.trt_llm.**", TRT),
    F("model.peft.peft_scheme", "lora_rank (none: 0)",
      lambda v, c: {"lora_rank": 0} if v in ("none", None) else "(LoRA: adapter_dim)" if v == "lora"
      else _refuse(f"peft_scheme {show(v)}: rlbits has LoRA")),
    F("model.peft.lora_tuning.adapter_dim", "lora_rank", _aligner_lora("lora_rank", integer)),
    F("model.peft.lora_tuning.adapter_dropout", "lora_dropout", _aligner_lora("lora_dropout", num)),
    F("model.peft.lora_tuning.target_modules", "lora_target_modules", _aligner_targets),
    F("model.peft.lora_tuning.{column_init_method,row_init_method,layer_selection,weight_tying,"
      "position_embedding_strategy}", "(peft's LoRA on every layer)",
      lambda v, c: "(no effect: peft_scheme is none)" if c.get("model.peft.peft_scheme") != "lora"
      else "(peft's initialisation)" if v in (None, False, "xavier", "zero", "normal")
      else _refuse(f"LoRA option {show(v)} is not supported")),
    I("model.peft.{restore_from_path,restore_from_ckpt}.**", "adapter checkpoint paths"),
    I("model.{mcore_gpt,megatron_amp_O2,sequence_parallel,encoder_seq_length,max_position_embeddings,"
      "use_tp_pp_dp_mapping,overwrite_base_config}.**",
      "Megatron model architecture and parallelism; rlbits reads the model folder's own config"),
    F("model.micro_batch_size", "microbatch_size", _actor("microbatch_size", integer, "(microbatch_size)")),
    F("model.global_batch_size", "num_minibatches", _aligner_gbs),
    F("model.seed", "seed", _actor("seed", integer, "(the run's seed)")),
    B("model.optim.name", "AdamW", ("distributed_fused_adam", "fused_adam", "adamw", "adam"),
      "only Adam(W) is supported"),
    I("model.optim.{bucket_cap_mb,overlap_grad_sync,contiguous_grad_buffer}", "distributed optimizer buffers"),
    F("model.optim.lr", "learning_rate (the critic's: critic_learning_rate)",
      lambda v, c: {"critic_learning_rate" if _is_critic(c) else "learning_rate": num(v)}),
    F("model.optim.weight_decay", "weight_decay (the critic's: critic_weight_decay)",
      lambda v, c: {"critic_weight_decay" if _is_critic(c) else "weight_decay": num(v)}),
    F("model.optim.betas", "adam_betas", _betas),
    F("model.optim.eps", "adam_eps", _adam_eps),
    F("model.optim.sched.name", "lr_scheduler: cosine", _aligner_sched),
    F("model.optim.sched.warmup_steps", "lr_warmup_steps", _actor("lr_warmup_steps", integer)),
    F("model.optim.sched.constant_steps", "lr_constant_steps", _actor("lr_constant_steps", integer)),
    F("model.optim.sched.min_lr", "min_lr", _actor(
        "min_lr", num, "(the critic decays to the policy's min_lr: rlbits has one min_lr)")),
    F("model.optim.sched.max_steps", "lr_max_steps", _actor("lr_max_steps", integer)),
    I("model.data.**", DATA),
    # the critic's model section (gpt_ppo_critic.yaml)
    N("model.loss_clip_val", "value_clip_eps"),
    I("model.offload_adam_states", "optimizer-state offload (memory)"),
    B("model.output_sequence", "a value per token", (True,), "a single value per sequence is not supported"),
    F("model.reward_standardization.enable", "reward_standardization_mean/std (on when set)",
      lambda v, c: "(on: mean and std)" if v else "(off)"),
    F("model.reward_standardization.{mean,std}", "reward_standardization_mean / _std",
      lambda v, c: "(no effect: reward_standardization.enable is false)"
      if not c.get("model.reward_standardization.enable")
      else {f"reward_standardization_{'mean' if v == c.get('model.reward_standardization.mean') else 'std'}":
            num(v)}),
    I("model.forward_micro_batch_size", "micro-batch of the critic's inference (memory)"),
    I("model.{use_avg_pool,force_head_dtype,reward_model_type,regression}.**",
      "the reward model served with the critic; rlbits: reward_model (an HF sequence classifier folder)"),
)


# --------------------------------------------------------------------------------------------------------
# trlx (trlx/data/default_configs.py: a TRLConfig dumped to YAML/JSON with train, model, tokenizer, optimizer,
# scheduler and method sections, as TRLConfig.to_dict writes it)
# --------------------------------------------------------------------------------------------------------


def _trlx_updates(c: Ctx) -> int:
    """trlx PPO counts optimizer steps: ppo_epochs * (num_rollouts / batch_size) per rollout batch."""
    if c.loop != "ppo":
        return 1
    rollouts, batch = integer(c.get("method.num_rollouts", 1)), integer(c.get("train.batch_size", 1))
    return integer(c.get("method.ppo_epochs", 1)) * max(1, rollouts // batch)


def _trlx_steps(field: str) -> Convert:
    def conv(v: Any, c: Ctx) -> dict[str, Any]:
        return {field: max(1, math.ceil(integer(v) / _trlx_updates(c)))}

    return conv


def _trlx_batch(v: Any, c: Ctx) -> dict[str, Any]:
    if c.loop == "ilql":
        return {"batch_size": integer(v)}
    rollouts = integer(c.get("method.num_rollouts", 1))
    if rollouts % integer(v):
        raise Unsupported(f"num_rollouts {rollouts} is not whole minibatches of batch_size {v}")
    return {"num_minibatches": rollouts // integer(v)}


def _trlx_gen(key: str, *, experience: bool) -> Convert:
    """One ``gen_kwargs`` / ``gen_experience_kwargs`` entry: experience (the rollouts) sets the top-level
    fields, ``gen_kwargs`` sets them too unless ``gen_experience_kwargs`` overrides it, then only
    ``val_generation``."""

    def value(v: Any) -> Any:
        if key == "top_k":
            return None if v in (None, 0) else integer(v)
        if key in ("max_new_tokens", "min_new_tokens"):
            return integer(v)
        return num(v)

    field = {"max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "top_k": "top_k",
             "top_p": "top_p", "temperature": "temperature", "repetition_penalty": "repetition_penalty"}[key]

    def conv(v: Any, c: Ctx) -> dict[str, Any]:
        if experience:
            return {field: value(v)}
        exp = c.get("method.gen_experience_kwargs") or {}
        if key in exp and exp[key] != v:
            return {"val_generation": {field: value(v)}}
        return {field: value(v)}

    return conv


def _trlx_peft(v: Any, c: Ctx) -> dict[str, Any] | str:
    if v is None:
        return {"lora_rank": 0}
    if not isinstance(v, dict) or str(v.get("peft_type", "LORA")).upper() != "LORA":
        raise Unsupported(f"peft_config {show(v)}: rlbits has LoRA")
    out: dict[str, Any] = {"lora_rank": integer(v.get("r", 8))}
    if "lora_alpha" in v:
        out["lora_alpha"] = num(v["lora_alpha"])
    if "lora_dropout" in v:
        out["lora_dropout"] = num(v["lora_dropout"])
    if v.get("target_modules"):
        out["lora_target_modules"] = v["target_modules"]
    return out


def _trlx_method(v: Any, c: Ctx) -> dict[str, Any] | str:
    if c.loop == "ilql":
        return {"standardize_rewards": True}  # trlx's ILQL always standardises (accelerate_ilql_trainer.py)
    return {"kl_in_reward": True}


def _trlx_scheduler(v: Any, c: Ctx) -> dict[str, Any]:
    if v != "cosine_annealing":
        raise Unsupported(f"scheduler {show(v)}: rlbits has cosine_annealing")
    return {"lr_scheduler": "cosine_annealing"}


TRLX: tuple[Rule, ...] = (
    F("train.total_steps", "max_num_steps", _trlx_steps("max_num_steps"),
        "trlx counts optimizer steps: PPO's divided by ppo_epochs * num_rollouts / batch_size"),
    I("train.seq_length", "tokenizer truncation length; rlbits' prompts come from the task, responses are "
      "max_new_tokens long"),
    INT("train.epochs", "max_num_epochs"),
    F("train.batch_size", "num_minibatches (PPO: num_rollouts / batch_size); ILQL batch_size", _trlx_batch),
    F("train.minibatch_size", "microbatch_size", lambda v, c: {"microbatch_size": integer(v)} if v is not None
      else {"microbatch_size": integer(c.get("train.batch_size", 1))}),
    F("train.checkpoint_interval", "save_period", _trlx_steps("save_period")),
    F("train.eval_interval", "val_period", _trlx_steps("val_period")),
    B("train.pipeline", "prompts from the task", check=lambda v: True),
    B("train.trainer", "the loop (ppo or ilql)", ("AcceleratePPOTrainer", "AccelerateILQLTrainer", "NeMoPPOTrainer",
      "NeMoILQLTrainer"), "only trlx's PPO and ILQL trainers convert"),
    I("train.trainer_kwargs.**", "trainer construction arguments"),
    I("train.{project_name,run_name,entity_name,group_name,tracker,logging_dir,tags}", LOGGER),
    I("train.{checkpoint_dir,rollout_logging_dir,save_optimizer,resume_from_checkpoint}",
      "checkpoint and log paths; rlbits writes run_dir (rlbits train --resume RUN_DIR resumes)"),
    F("train.save_best", "keep_top_k: 1, metric_name: val_reward",
      lambda v, c: {"keep_top_k": 1, "metric_name": "val_reward"} if v else {"keep_top_k": None}),
    INT("train.seed", "seed"),
    F("model.model_path", "policy", why="copied as given: a local folder or an rlbits zoo name runs"),
    B("model.model_arch_type", "causal LMs", ("causal",), "seq2seq models are not supported"),
    INT("model.num_layers_unfrozen", "num_layers_unfrozen"),
    F("model.peft_config", "lora_rank, lora_alpha, lora_dropout, lora_target_modules", _trlx_peft),
    F("model.peft_config.*", "lora_*", lambda v, c: "(with peft_config)"),
    I("model.model_extra_configs.**", "extra from_pretrained arguments"),
    B("tokenizer.tokenizer_path", "the policy folder's tokenizer", check=lambda v: True),
    I("tokenizer.{padding_side,truncation_side}", "tokenizer padding; rlbits pads its batches itself"),
    I("tokenizer.tokenizer_extra_configs.**", "extra tokenizer arguments"),
    B("optimizer.name", "AdamW", ("adamw", "adam"), "only AdamW is supported"),
    N("optimizer.kwargs.lr", "learning_rate"),
    N("optimizer.kwargs.weight_decay", "weight_decay"),
    F("optimizer.kwargs.betas", "adam_betas", _betas),
    F("optimizer.kwargs.eps", "adam_eps", _adam_eps),
    F("scheduler.name", "lr_scheduler: cosine_annealing", _trlx_scheduler),
    INT("scheduler.kwargs.T_max", "lr_max_steps"),
    N("scheduler.kwargs.eta_min", "min_lr"),
    F("method.name", "the loop (PPOConfig: ppo, kl_in_reward; ILQLConfig: ilql, standardize_rewards)", _trlx_method),
    # PPO
    INT("method.num_rollouts", "num_prompts_per_step"),
    INT("method.chunk_size", "chunk_size"),
    INT("method.ppo_epochs", "ppo_epochs"),
    N("method.init_kl_coef", "kl_coef"),
    F("method.target", "adaptive_kl, kl_target",
      lambda v, c: {"adaptive_kl": False} if v is None else {"adaptive_kl": True, "kl_target": num(v)}),
    N("method.horizon", "kl_horizon"),
    N("method.gamma", "gamma"),
    N("method.lam", "lam"),
    N("method.cliprange", "clip_eps"),
    N("method.cliprange_value", "value_clip_eps"),
    N("method.vf_coef", "vf_coef"),
    F("method.scale_reward", "scale_reward",
      lambda v, c: {"scale_reward": None} if v in (None, "ignored", False) else {"scale_reward": v}
      if v in ("ref", "running") else _refuse(f"scale_reward {show(v)}")),
    F("method.ref_mean", "(none)", lambda v, c: "(trlx's ref_mean shifts no reward)"),
    N("method.ref_std", "reward_ref_std"),
    N("method.cliprange_reward", "reward_clip"),
    B("method.num_value_layers_unfrozen", "a separate critic (critic_init: policy), every layer trained",
      (0, None), "a value branch sharing the policy's trunk is not supported"),
    *(F(f"method.gen_kwargs.{k}", f"{k} (val_generation.{k} where gen_experience_kwargs differ)",
        _trlx_gen(k, experience=False)) for k in
      ("max_new_tokens", "min_new_tokens", "top_k", "top_p", "temperature", "repetition_penalty")),
    *(F(f"method.gen_experience_kwargs.{k}", k, _trlx_gen(k, experience=True)) for k in
      ("max_new_tokens", "min_new_tokens", "top_k", "top_p", "temperature", "repetition_penalty")),
    F("method.gen_{kwargs,experience_kwargs}.do_sample", "val_greedy",
      lambda v, c: "(sampling)" if v in (True, None) else {"val_greedy": True}),
    F("method.gen_kwargs.beta", "beta (ILQL's steering)", lambda v, c: {"beta": num(v)}),
    I("method.gen_{kwargs,experience_kwargs}.{eos_token_id,pad_token_id,use_cache}", "token ids of the tokenizer"),
    B("method.gen_experience_kwargs", "the rollouts use gen_kwargs", None, check=None),
    # ILQL
    N("method.tau", "tau"),
    N("method.cql_scale", "cql_scale"),
    N("method.awac_scale", "awac_scale"),
    N("method.alpha", "alpha"),
    N("method.beta", "awac_beta"),
    INT("method.steps_for_target_q_sync", "steps_for_target_q_sync"),
    F("method.two_qs", "two_qs"),
    F("method.logit_mask", "logit_mask"),
)

RULES: dict[str, tuple[Rule, ...]] = {"nemo-rl": NEMO_RL, "nemo-aligner": NEMO_ALIGNER, "trlx": TRLX}
"""Each seed's rules, first match wins."""

SOURCES = {
    "nemo-rl": "NVIDIA-NeMo/RL `examples/configs/ppo*.yaml`, `grpo_math_1B.yaml`",
    "nemo-aligner": "NVIDIA/NeMo-Aligner `examples/nlp/gpt/conf/gpt_ppo_actor.yaml`, `gpt_reinforce_actor.yaml`, "
    "`gpt_ppo_critic.yaml`",
    "trlx": "CarperAI/trlx `trlx/data/default_configs.py` (`default_ppo_config`, `default_ilql_config`) as a "
    "YAML/JSON dump of `TRLConfig`",
}

PENDING_DEFAULTS = {"batch_multiplier": 1, "dynamic_sampling": False, "logit_mask": None}
"""rlbits fields a loop may not have yet, with the value that needs no field: a converted config leaves
them out at that value."""


# --------------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Conversion:
    """The result of ``convert``: the rlbits config values and a line per seed field."""

    seed: str
    loop: str
    values: dict[str, Any]
    mapped: list[str]
    refused: list[str]

    @property
    def ok(self) -> bool:
        """Whether every refusal is infrastructure (the algorithm converted whole)."""
        return all(": infrastructure:" in line for line in self.refused)


def detect_loop(seed: str, tree: dict[str, Any]) -> str:
    """The rlbits loop a seed config converts to (its algorithm section).

    Raises:
        ConfigError: no section this seed's PPO, REINFORCE/GRPO or ILQL configs have.
    """
    if seed == "nemo-rl":
        if "ppo" in tree:
            return "ppo"
        if "grpo" in tree:
            return "reinforce"
        raise ConfigError("a NeMo-RL config with neither a ppo: nor a grpo: section; convert-config reads PPO and GRPO")
    if seed == "nemo-aligner":
        trainer = tree.get("trainer") or {}
        if "reinforce" in trainer:
            return "reinforce"
        if "ppo" in trainer:
            return "ppo"
        raise ConfigError("a NeMo-Aligner config with no trainer.ppo or trainer.reinforce section")
    if seed == "trlx":
        method = tree.get("method") or {}
        name = str(method.get("name", "")).lower()
        if name == "ppoconfig" or "ppo" in str((tree.get("train") or {}).get("trainer", "")).lower():
            return "ppo"
        if name == "ilqlconfig" or "ilql" in str((tree.get("train") or {}).get("trainer", "")).lower():
            return "ilql"
        raise ConfigError(f"a trlx config whose method.name is {show(method.get('name'))}; convert-config reads "
                          "PPOConfig and ILQLConfig")
    raise ConfigError(f"--from must be one of {', '.join(SEEDS)}; got {show(seed)}")


def _deep_update(out: dict[str, Any], new: dict[str, Any], source: str, owners: dict[str, str]) -> list[str]:
    conflicts = []
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "rollout_correction":
            out[key] = {**out[key], **value}
        elif key in out and out[key] != value:
            conflicts.append(f"{source}: not supported: sets {key} = {show(value)}, but {owners[key]} set it to "
                             f"{show(out[key])}")
            continue
        else:
            out[key] = value
        owners[key] = source
    return conflicts


def _fmt(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {show(v)}" for k, v in values.items())


def convert(seed: str, paths: list[str | Path] | str | Path) -> Conversion:
    """Read ``paths`` (one config, or NeMo-Aligner's actor config and its critic's) of ``seed`` and map each
    field by ``RULES[seed]``.

    Raises:
        ConfigError: an unknown seed, an unreadable file, or a config with no algorithm section.
    """
    if seed not in RULES:
        raise ConfigError(f"--from must be one of {', '.join(SEEDS)}; got {show(seed)}")
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    loops, values, owners = [], {}, {}
    mapped: list[str] = []
    refused: list[str] = []
    for path in paths:
        tree, unresolved = read_seed_config(path)
        loop = detect_loop(seed, tree)
        loops.append(loop)
        ctx = Ctx(tree, loop)
        prefix = f"{Path(path).name}: " if len(paths) > 1 else ""
        for name, value in leaves(tree).items():
            where = prefix + name
            rule = next((r for r in RULES[seed] if r.matches(name)), None)
            if name in unresolved and (rule is None or rule.kind != "infrastructure"):
                refused.append(f"{where}: not supported: unresolvable interpolation {show(value)} ({unresolved[name]})")
                continue
            if rule is None:
                refused.append(f"{where}: unknown field (not an algorithm field or known infrastructure of {seed}) "
                               f"= {show(value)}")
                continue
            if rule.kind == "infrastructure":
                refused.append(f"{where}: infrastructure: {rule.why}")
                continue
            if rule.kind == "unsupported":
                refused.append(f"{where}: not supported: {rule.why}")
                continue
            try:
                out = rule.convert(value, dataclasses.replace(ctx, field=name)) if rule.convert else rule.rlbits
            except Unsupported as e:
                refused.append(f"{where}: not supported: {e} (value {show(value)})")
                continue
            except (KeyError, TypeError, ValueError) as e:
                refused.append(f"{where}: not supported: {show(value)} ({e})")
                continue
            if isinstance(out, dict):
                refused += _deep_update(values, out, where, owners)
                mapped.append(f"{where} -> {_fmt(out) if out else '(nothing to set)'}")
            else:
                mapped.append(f"{where} -> {out} = {show(value)}")
    if len(set(loops)) > 1:
        raise ConfigError(f"the files convert to different loops: {', '.join(loops)}")
    loop = loops[0]
    return Conversion(seed, loop, {"loop": loop, **values}, mapped, refused)


def finish(conv: Conversion) -> dict[str, Any]:
    """The values of ``conv`` as an rlbits config dict, checked by building the loop's config; a field a loop
    does not have yet is left out at its neutral value (``PENDING_DEFAULTS``).

    Raises:
        ConfigError: the values do not make a valid rlbits config (the message names the field).
    """
    from rlbits.loops.api import config_class

    cls = config_class(conv.loop)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(conv.values)
    for key, neutral in PENDING_DEFAULTS.items():
        if key in values and key not in fields and values[key] == neutral:
            del values[key]
    from rlbits.loops.config import config_from_dict

    config_from_dict(cls, values)
    return values




# --------------------------------------------------------------------------------------------------------
# The docs tables (docs/seeds.md, "Every field of the seeds' configs"; a test checks the page equals this)
# --------------------------------------------------------------------------------------------------------

STATUS = {
    "field": "implemented",
    "builtin": "implemented (built in)",
    "infrastructure": "not applicable: infrastructure",
    "unsupported": "not supported",
}
"""How the tables name each kind of rule."""

TOTALS_BEGIN = "<!-- convert-config totals: generated by rlbits.loops.convert.seed_totals_table; do not edit -->"
TABLES_BEGIN = "<!-- convert-config tables: generated by rlbits.loops.convert.seed_tables; do not edit -->"
TABLES_END = "<!-- end of the generated block -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def seed_totals() -> dict[str, dict[str, int]]:
    """Per seed, the number of rules of each status (``STATUS`` values)."""
    out: dict[str, dict[str, int]] = {}
    for seed, rules in RULES.items():
        counts = dict.fromkeys(STATUS.values(), 0)
        for rule in rules:
            counts[STATUS[rule.kind]] += 1
        out[seed] = counts
    return out


def seed_totals_table() -> str:
    """The markdown of docs/seeds.md's totals: per seed, its rules by status."""
    lines = [TOTALS_BEGIN, "", "| seed | implemented | of which built in | not applicable (infrastructure) | "
             "not supported |", "|---|---|---|---|---|"]
    for seed, counts in seed_totals().items():
        implemented = counts["implemented"] + counts["implemented (built in)"]
        lines.append(
            f"| {seed} | {implemented} | {counts['implemented (built in)']} | "
            f"{counts['not applicable: infrastructure']} | {counts['not supported']} |"
        )
    return "\n".join([*lines, "", TABLES_END])


def seed_tables() -> str:
    """The markdown of docs/seeds.md's per-seed field tables, from ``RULES``: one table per seed with each
    rule's seed field, rlbits field or behaviour, and status."""
    lines = [TABLES_BEGIN]
    for seed, rules in RULES.items():
        lines += ["", f"### {seed}: {SOURCES[seed]}", "", "| seed field | rlbits | status |", "|---|---|---|"]
        for rule in rules:
            status = STATUS[rule.kind] + (f": {rule.why}" if rule.why else "")
            target = f"`{_cell(rule.rlbits)}`" if rule.kind == "field" and rule.rlbits else _cell(rule.rlbits) or "—"
            lines.append(f"| `{_cell(rule.path)}` | {target} | {_cell(status)} |")
    lines += ["", TABLES_END]
    return "\n".join(lines)


__all__ = [
    "RULES",
    "SEEDS",
    "Conversion",
    "Rule",
    "Unsupported",
    "convert",
    "detect_loop",
    "finish",
    "seed_tables",
    "seed_totals",
    "seed_totals_table",
]
