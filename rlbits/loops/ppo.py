"""Actor-critic PPO for language models: the RLHF loop of Ouyang 2022, on any reward.

Algorithm (Schulman 2017, "Proximal Policy Optimization Algorithms"; for language models Ziegler 2019,
"Fine-Tuning Language Models from Human Preferences", and Ouyang 2022, "Training language models to follow
instructions with human feedback", eq. 2). Each step:

1. rollout    sample ``num_generations_per_prompt`` responses for ``num_prompts_per_step`` train prompts
              (behaviour logprobs at ``temperature``);
2. score      the sequence reward of each response (``rewards``), optionally the reference policy's reward
              on the same prompts (``reward_subtract_reference``);
3. reference  the frozen initial policy's logprobs of the sampled tokens (``ref_logprobs``);
4. values     the critic's V(s_t) before each response token (``values``);
5. advantages scaled rewards on the last token minus ``kl_coef * KL`` on every token (``token_rewards``),
              GAE(gamma, lam) advantages for the policy, GAE(gamma, critic_lam) returns for the critic,
              advantages whitened over the batch;
6. update     ``ppo_epochs`` x ``num_minibatches`` Adam steps on the clipped surrogate (policy) and the
              squared value error (critic), each minibatch split into ``microbatch_size`` rows whose
              gradients accumulate; every loss is divided by the minibatch's global action-token count so
              microbatching does not change the update;
7. log        one ``metrics.jsonl`` line; ``log_samples`` decoded rollouts to ``samples.jsonl``;
8. validate   every ``val_period`` steps: mean reward of one sampled response per test prompt;
9. save       a checkpoint every ``save_period`` steps and at the end; the final policy at ``RUN_DIR/final``.

The adaptive KL controller (Ziegler 2019, sec. 2.2) updates ``kl_coef`` after each step from the step's
KL; the new value applies from the next step.

How rlbits departs from the papers and from trlx / NeMo-Aligner / NeMo-RL / TRL (details in docs/ppo.md):

- The critic is a separate model (``ValueModel``: a copy of the policy's backbone plus a scalar head) with its
  own AdamW optimizer and learning rate (``critic_learning_rate``), as NeMo-Aligner and OpenRLHF do; trlx and
  the original lm-human-preferences share one optimizer over a two-headed model. ``vf_coef`` therefore only
  scales the critic's gradient (which matters for gradient clipping, barely for Adam).
- GAE runs over action tokens only (tokens where ``action_mask`` is False are skipped, not treated as
  steps), and the policy and the critic can use different lambdas (``critic_lam``, as VAPO, Yuan 2025).
- The old logprobs are the sampler's (``generate`` computes them with the same forward pass a training step
  uses), not a second forward pass.
- No learning-rate schedule: constant learning rates.

Launch (one process, or N data-parallel FSDP2 ranks with ``torchrun``; docs/scaling.md)::

    rlbits train configs/ppo_sentiment.yaml run_dir=runs/ppo1
    torchrun --nproc_per_node 2 -m rlbits train configs/ppo_sentiment.yaml run_dir=runs/ppo2
    python -c "from rlbits.loops.ppo import PPOConfig, train; from rlbits.loops.config import load_config; \\
        train(load_config(PPOConfig, 'configs/ppo_sentiment.yaml', ['run_dir=runs/ppo1']))"

Metrics (one ``metrics.jsonl`` line per step; docs/ppo.md explains each): ``rewards``, ``rewards_with_kl``,
``init_policy_kl``, ``kl_coef``, ``advantages``, ``returns``, ``values``, ``explained_variance``,
``actor_loss``, ``critic_loss``, ``clipfrac``, ``approx_kl``, ``ratio_mean``, ``entropy``, ``value_clipfrac``,
``grad_norm``, ``critic_grad_norm``, ``response_len``, ``tokens_per_s``, ``time/<phase>``, ``epoch``, and
``val_reward`` (+ ``val_reward_std``, ``val_response_len``) on validation steps (step 0 = before training).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDictBase

from rlbits.batch import split_microbatches, split_minibatches
from rlbits.distributed.checkpoint import (
    export_model,
    hf_folder,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import unsharded
from rlbits.distributed.reduce import all_reduce_sum, any_rank, global_count, reduce_metrics
from rlbits.functional import (
    adaptive_kl_coef,
    aggregate_loss,
    gae,
    kl_penalty,
    masked_mean,
    masked_var,
    ppo_loss,
    token_rewards,
    value_loss,
)
from rlbits.loops import common
from rlbits.loops.config import ConfigError, RunConfig
from rlbits.loops.data import PromptStream
from rlbits.loops.run import Run
from rlbits.models.forward import critic_values, policy_logprobs
from rlbits.models.heads import ValueModel
from rlbits.models.load import freeze, load_pretrained
from rlbits.tasks import get_task

# --------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PPOConfig(RunConfig):
    """Actor-critic PPO. Field names follow NeMo-RL / NeMo-Aligner where they have one."""

    loop: str = "ppo"
    """Which loop runs this config; ``ppo`` for this one."""
    num_prompts_per_step: int = 32
    """Prompts sampled per step (each generates ``num_generations_per_prompt`` responses)."""
    learning_rate: float = 1e-5
    """AdamW learning rate of the policy."""

    # --- PPO update
    ppo_epochs: int = 4
    """Passes over each rollout batch (trlx ``ppo_epochs``)."""
    num_minibatches: int = 2
    """Optimizer steps per PPO epoch: the batch is shuffled (whole prompt groups) and dealt into this many minibatches."""
    clip_eps: float = 0.2
    """PPO ratio clip range: ratios outside [1 - clip_eps, 1 + clip_eps_high] get no gradient."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO clip-higher); None = ``clip_eps``."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (Ye 2020): caps the loss of negative-advantage tokens at -c A; None = off."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses are aggregated (see ``rlbits.aggregate_loss``); the denominator is global over the minibatch."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``- entropy_coef * entropy`` is added to the policy loss (0 = off)."""

    # --- KL to the reference policy
    kl_coef: float = 0.05
    """beta of the KL penalty in the reward (``kl_in_reward``): ``r_t -= kl_coef * KL_t`` on every token; the initial value when ``adaptive_kl``."""
    kl_estimator: Literal["k1", "abs", "k2", "k3"] = "k1"
    """Per-token KL estimator of ``rlbits.kl_penalty`` used in the reward or the loss (k1 = logp - ref_logp)."""
    kl_in_reward: bool = True
    """True: KL penalty in the reward (Ziegler/Ouyang, trlx). False: KL term ``kl_loss_coef * KL`` in the policy loss (NeMo-RL, GRPO), no KL in the reward."""
    kl_loss_coef: float = 0.01
    """Coefficient of the KL term of the loss when ``kl_in_reward`` is False (NeMo-RL ``reference_policy_kl_penalty``)."""
    adaptive_kl: bool = False
    """Adapt the active KL coefficient with the Ziegler 2019 controller towards ``kl_target``."""
    kl_target: float = 6.0
    """KL (nats per sequence, k1) the adaptive controller steers towards."""
    kl_horizon: float = 10000.0
    """Horizon of the adaptive controller in samples: larger = slower changes of the coefficient."""
    skip_reference_policy_logprobs: bool = False
    """No reference forward pass: ref_logprobs = logprobs, so the KL is 0 (a quicker start; no KL control at all)."""

    # --- Reward scaling (applied in this order: subtract reference, whiten, clip)
    reward_subtract_reference: bool = False
    """Subtract the reference policy's reward on the same prompts: costs one more generation and scoring per step."""
    reward_whiten: bool = False
    """Divide the rewards by their std over the batch (mean kept, as trlx/NeMo); rewards keep their sign."""
    reward_clip: float | None = None
    """Clip the (scaled) rewards to [-reward_clip, reward_clip]; None = no clipping."""

    # --- Advantages and critic
    gamma: float = 1.0
    """Discount per response token."""
    lam: float = 0.95
    """GAE lambda of the policy's advantages."""
    critic_lam: float | None = None
    """GAE lambda of the critic's return targets (decoupled, VAPO/NeMo style); None = ``lam``."""
    whiten_advantages: bool = True
    """Whiten advantages over the batch's action tokens (zero mean, unit variance)."""
    value_clip_eps: float | None = None
    """PPO2 value clipping range around the rollout values; None = no clipping (Andrychowicz 2021)."""
    vf_coef: float = 1.0
    """Multiplier of the critic loss (its own optimizer, so it only changes the gradient-clipping scale)."""
    critic_learning_rate: float | None = None
    """AdamW learning rate of the critic; None = ``learning_rate``."""
    critic_init: str = "policy"
    """Critic initialisation: ``policy`` (the policy's backbone and a fresh head) or a folder (a saved ValueModel, or a causal LM)."""
    policy_training_start_step: int = 0
    """Critic warm-up: during the first this-many steps only the critic trains (policy weights unchanged)."""

    def validate(self) -> None:
        """RunConfig's checks plus PPO's ranges. Raises ConfigError naming the field."""
        super().validate()
        if self.loop != "ppo":
            raise ConfigError(f"loop must be 'ppo' for PPOConfig, got {self.loop!r}")
        for name in ("ppo_epochs", "num_minibatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_minibatches > self.num_prompts_per_step:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must be <= num_prompts_per_step "
                f"({self.num_prompts_per_step}): minibatches hold whole prompt groups"
            )
        nonneg = ("clip_eps", "entropy_coef", "kl_coef", "kl_loss_coef", "policy_training_start_step")
        for name in nonneg:
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        optional_pos = ("clip_eps_high", "reward_clip", "value_clip_eps", "critic_learning_rate")
        for name in optional_pos:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 or null, got {value}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ConfigError(f"dual_clip must be > 1 (Ye 2020) or null, got {self.dual_clip}")
        for name in ("kl_target", "kl_horizon", "vf_coef"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("gamma", "lam", "critic_lam"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {value}")
        if self.adaptive_kl and self.skip_reference_policy_logprobs:
            raise ConfigError(
                "adaptive_kl needs the reference policy's logprobs; it cannot be combined with "
                "skip_reference_policy_logprobs=true (the KL would always be 0)"
            )
        if not self.critic_init:
            raise ConfigError("critic_init must be 'policy' or a folder, got an empty string")


# --------------------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class State:
    """Everything a PPO run carries from step to step; ``save`` writes it, ``init_state`` restores it."""

    policy: torch.nn.Module
    tokenizer: Any
    reference: torch.nn.Module | None
    """Frozen initial policy (None when neither reference logprobs nor reference rewards are needed)."""
    value_model: ValueModel
    policy_optimizer: torch.optim.Optimizer
    value_optimizer: torch.optim.Optimizer
    sampling_generator: torch.Generator
    """Draws every rollout token (training and reference-reward rollouts)."""
    minibatch_generator: torch.Generator
    """Shuffles rows into minibatches (CPU)."""
    kl_coef: float
    """Current coefficient of the active KL term (changes only with ``adaptive_kl``)."""
    step: int = 0
    """Steps completed."""
    consumed_samples: int = 0
    """Prompts drawn from the train stream so far (its position)."""
    epoch: int = 0
    """Passes over the train prompts completed."""
    total_valid_tokens: int = 0
    """Action tokens trained on so far."""
    val_reward: float | None = None
    """Latest validation reward."""

    @property
    def generators(self) -> dict[str, torch.Generator]:
        return {"sampling": self.sampling_generator, "minibatch": self.minibatch_generator}

    @property
    def models(self) -> dict[str, torch.nn.Module]:
        return {"policy": self.policy, "value": self.value_model}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"policy": self.policy_optimizer, "value": self.value_optimizer}

    def counters(self, total_steps: int) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "current_step": self.step,
            "current_epoch": self.epoch,
            "total_steps": total_steps,
            "total_valid_tokens": self.total_valid_tokens,
            "val_reward": self.val_reward,
            "kl_coef": self.kl_coef,
        }


def _load_critic(cfg: PPOConfig, policy: torch.nn.Module, env: DistEnv) -> ValueModel:
    if cfg.critic_init == "policy":
        critic = ValueModel.from_policy(policy, seed=cfg.seed)
    else:
        if not Path(cfg.critic_init).is_dir():
            raise ConfigError(
                f"critic_init must be 'policy' or an existing folder; {cfg.critic_init!r} is neither"
            )
        critic = ValueModel.from_pretrained(cfg.critic_init, seed=cfg.seed)
    return common.disable_dropout(critic).to(env.device).train()


def init_state(cfg: PPOConfig, env: DistEnv, *, resume_from: str | Path | None = None) -> State:
    """Load policy, reference, critic and tokenizer; build optimizers and generators.

    Fresh: the policy and the reference from ``policy_path(cfg)``, the critic from ``critic_init``.
    ``resume_from`` (a checkpoint folder): policy and critic from it, the reference again from the initial
    policy, then optimizer states, RNG states and counters from the checkpoint.
    """
    init_path = common.policy_path(cfg)
    src = Path(resume_from) if resume_from is not None else None
    policy, tokenizer = common.load_policy_and_tokenizer(str(hf_folder(src, "policy") or init_path), env)
    policy.train()
    reference = None
    if not cfg.skip_reference_policy_logprobs or cfg.reward_subtract_reference:
        reference = freeze(common.load_policy_and_tokenizer(init_path, env)[0])
    if hf_folder(src, "value") is not None:
        value_model = common.disable_dropout(ValueModel.from_pretrained(src / "value")).to(env.device).train()
    else:  # fresh (a DCP checkpoint fills its weights below)
        value_model = _load_critic(cfg, policy, env)
    policy = common.prepare(policy, cfg, env)
    value_model = common.prepare(value_model, cfg, env)
    if reference is not None:
        reference = common.prepare(reference, cfg, env)
    critic_lr = cfg.critic_learning_rate if cfg.critic_learning_rate is not None else cfg.learning_rate
    state = State(
        policy=policy,
        tokenizer=tokenizer,
        reference=reference,
        value_model=value_model,
        policy_optimizer=common.make_optimizer(policy.parameters(), cfg.learning_rate, cfg.weight_decay),
        value_optimizer=common.make_optimizer(value_model.parameters(), critic_lr, cfg.weight_decay),
        sampling_generator=torch.Generator(device=env.device).manual_seed(cfg.seed * 1000 + env.rank),
        minibatch_generator=torch.Generator().manual_seed(cfg.seed * 1000 + 17 + env.rank),
        kl_coef=cfg.kl_coef if cfg.kl_in_reward else cfg.kl_loss_coef,
    )
    if src is not None:
        saved = load_checkpoint(
            src, models=state.models, optimizers=state.optimizers, generators=state.generators, env=env
        )
        state.step = saved["current_step"]
        state.consumed_samples = saved["consumed_samples"]
        state.epoch = saved["current_epoch"]
        state.total_valid_tokens = saved["total_valid_tokens"]
        state.val_reward = saved["val_reward"]
        state.kl_coef = saved["kl_coef"]
    return state


def total_steps(cfg: RunConfig, num_prompts: int, world_size: int = 1) -> int:
    """Steps the run will take: ``max_num_steps``, or fewer if ``max_num_epochs`` passes end first."""
    per_step = cfg.num_prompts_per_step * world_size
    return max(1, min(cfg.max_num_steps, cfg.max_num_epochs * num_prompts // per_step))


# --------------------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------------------


def rollout(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    cfg: PPOConfig,
    *,
    generator: torch.Generator | None = None,
    logits_processor: Callable | None = None,
) -> TensorDictBase:
    """Phase 1: ``num_generations_per_prompt`` responses per prompt at ``temperature``.

    Adds ``prompts``, ``prompt_mask``, ``responses``, ``action_mask``, ``response_mask``, ``input_ids``,
    ``attention_mask``, ``logprobs``, ``group``, ``truncated``, ``prompt_text``, ``response_text``.
    """
    with common.autocast(policy, cfg):
        return common.rollout(
            policy,
            tokenizer,
            prompts,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            num_samples=cfg.num_generations_per_prompt,
            generator=generator,
            logits_processor=logits_processor,
        )


def score(batch: TensorDictBase, reward: Any) -> torch.Tensor:
    """Phase 2: ``rewards`` [B], the sequence score of each response (any reward ``rlbits.score`` accepts)."""
    return common.score_rollout(batch, reward)


def reference_rewards(
    reference: torch.nn.Module,
    tokenizer: Any,
    batch: TensorDictBase,
    reward: Any,
    cfg: PPOConfig,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Phase 2b (``reward_subtract_reference``): ``reference_rewards`` [B], the reward of a response the
    reference policy samples for the same prompt as each row. Costs a second generation and scoring."""
    prompts = list(batch["prompt_text"])[:: cfg.num_generations_per_prompt]
    ref_batch = rollout(reference, tokenizer, prompts, cfg, generator=generator)
    batch["reference_rewards"] = score(ref_batch, reward).to(batch["rewards"].device)
    return batch["reference_rewards"]


def reference(ref_policy: torch.nn.Module | None, batch: TensorDictBase, cfg: PPOConfig) -> torch.Tensor:
    """Phase 3: ``ref_logprobs`` [B, R] under the frozen reference (a copy of ``logprobs`` when
    ``skip_reference_policy_logprobs``, so every KL is 0)."""
    if cfg.skip_reference_policy_logprobs:
        batch["ref_logprobs"] = batch["logprobs"].clone()
        return batch["ref_logprobs"]
    if ref_policy is None:
        raise ValueError("reference: ref_policy is None but skip_reference_policy_logprobs is False")
    with unsharded(ref_policy), common.autocast(ref_policy, cfg):
        return common.reference_logprobs(
            ref_policy, batch, temperature=cfg.temperature, microbatch_size=cfg.microbatch_size
        )


def values(value_model: torch.nn.Module, batch: TensorDictBase, cfg: PPOConfig) -> torch.Tensor:
    """Phase 4: ``values`` [B, R], the critic's V(s_t) before each response token (no gradient)."""
    with torch.no_grad(), unsharded(value_model), common.autocast(value_model, cfg):
        batch["values"] = critic_values(value_model, batch, microbatch_size=cfg.microbatch_size).float()
    return batch["values"]


def whiten(
    x: torch.Tensor, mask: torch.Tensor, env: DistEnv, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``masked_whiten`` with the mean and (unbiased) variance taken over every rank's masked entries."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    count = global_count(mask, env)
    mean = all_reduce_sum(torch.where(mask, x, zero).sum(), env) / count.clamp(min=1)
    centered = torch.where(mask, x - mean, zero)
    var = all_reduce_sum((centered * centered).sum(), env) / (count - 1).clamp(min=1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, zero)


def scale_rewards(batch: TensorDictBase, cfg: PPOConfig, env: DistEnv) -> torch.Tensor:
    """The rewards the optimisation sees: minus ``reference_rewards`` if present, whitened over the batch
    (mean kept) if ``reward_whiten``, clipped to +-``reward_clip``. Returns [B]; ``rewards`` is untouched."""
    scores = batch["rewards"]
    if cfg.reward_subtract_reference:
        scores = scores - batch["reference_rewards"]
    if cfg.reward_whiten:
        scores = whiten(scores, torch.ones_like(scores, dtype=torch.bool), env, shift_mean=False)
    if cfg.reward_clip is not None:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    return scores


def advantages(
    batch: TensorDictBase, cfg: PPOConfig, env: DistEnv, *, kl_coef: float
) -> dict[str, torch.Tensor]:
    """Phase 5: ``token_rewards``, ``advantages`` and ``returns`` [B, R].

    ``token_rewards`` = scaled reward on the last action token minus ``kl_coef * kl_penalty(logprobs,
    ref_logprobs, kl_estimator)`` on every action token (no KL when ``kl_in_reward`` is False). Policy
    advantages from ``gae(gamma, lam)`` (whitened if ``whiten_advantages``); critic targets ``returns`` from
    ``gae(gamma, critic_lam)``. Returns the step's statistics (0-dim tensors): ``rewards``,
    ``rewards_with_kl``, ``init_policy_kl``, ``advantages``, ``returns``, ``values``, ``explained_variance``.
    """
    mask = batch["action_mask"]
    gae_fn = common.kernel(gae, cfg)
    kl = common.kernel(kl_penalty, cfg)(batch["logprobs"], batch["ref_logprobs"], cfg.kl_estimator) if cfg.kl_in_reward else None
    scores = scale_rewards(batch, cfg, env)
    batch["token_rewards"] = common.kernel(token_rewards, cfg)(scores, mask, kl, kl_coef if cfg.kl_in_reward else 0.0)
    adv, ret = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.critic_lam is not None and cfg.critic_lam != cfg.lam:
        _, ret = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=cfg.critic_lam)
    var_returns = masked_var(ret, mask).clamp(min=1e-8)
    metrics = {
        "rewards": batch["rewards"].mean(),
        "rewards_with_kl": batch["token_rewards"].sum(-1).mean(),
        "init_policy_kl": common.kl_per_sequence(batch["logprobs"], batch["ref_logprobs"], mask),
        "advantages": masked_mean(adv, mask),
        "returns": masked_mean(ret, mask),
        "values": masked_mean(batch["values"], mask),
        "explained_variance": 1.0 - masked_var(ret - batch["values"], mask) / var_returns,
    }
    if cfg.reward_subtract_reference or cfg.reward_whiten or cfg.reward_clip is not None:
        metrics["rewards_scaled"] = scores.mean()
    if cfg.reward_subtract_reference:
        metrics["reference_rewards"] = batch["reference_rewards"].mean()
    batch["advantages"] = whiten(adv, mask, env) if cfg.whiten_advantages else adv
    batch["returns"] = ret
    return metrics


def update_kl_coef(kl_coef: float, kl: float, cfg: PPOConfig, num_samples: int) -> float:
    """The adaptive KL controller (Ziegler 2019) after a step whose mean KL per sequence was ``kl`` over
    ``num_samples`` sequences; ``kl_coef`` unchanged unless ``adaptive_kl``."""
    if not cfg.adaptive_kl:
        return kl_coef
    return float(adaptive_kl_coef(kl_coef, kl, cfg.kl_target, cfg.kl_horizon, num_samples))


def _accumulate(store: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    store[name] = store.get(name, 0.0) + value.detach().float()


class NonFiniteError(FloatingPointError):
    """A loss or gradient became NaN/inf; the message names the step and phase."""


def update(
    policy: torch.nn.Module,
    value_model: torch.nn.Module,
    policy_optimizer: torch.optim.Optimizer,
    value_optimizer: torch.optim.Optimizer,
    batch: TensorDictBase,
    cfg: PPOConfig,
    env: DistEnv,
    *,
    generator: torch.Generator | None = None,
    kl_coef: float = 0.0,
    train_policy: bool = True,
    step: int = 0,
) -> dict[str, torch.Tensor]:
    """Phase 6: ``ppo_epochs`` x ``num_minibatches`` optimizer steps on policy and critic.

    Each minibatch (whole prompt groups, shuffled with ``generator``) is cut into ``microbatch_size``-row
    microbatches whose gradients accumulate; every loss term is aggregated with the minibatch's global
    action-token count (and row count) as denominator, so the update does not depend on
    ``microbatch_size`` or the number of ranks. Policy loss: ``ppo_loss`` on the whitened advantages, minus
    ``entropy_coef * entropy``, plus ``kl_coef * KL(ref)`` when ``kl_in_reward`` is False. Critic loss:
    ``vf_coef * value_loss`` against ``returns``. With ``train_policy=False`` (critic warm-up) only the critic
    is trained and the policy is not run at all.

    Returns:
        Means over minibatches (0-dim tensors): ``critic_loss``, ``value_clipfrac``, ``critic_grad_norm`` and,
        when the policy trains, ``actor_loss``, ``clipfrac``, ``approx_kl``, ``ratio_mean``, ``entropy``,
        ``grad_norm`` (+ ``kl_loss`` with KL in the loss).

    Raises:
        NonFiniteError: a loss is not finite (raised before either model steps), or a gradient norm is not
            finite (raised before that model steps).
    """
    sums: dict[str, torch.Tensor] = {}
    num_updates = 0
    ppo_loss_fn, value_loss_fn = common.kernel(ppo_loss, cfg), common.kernel(value_loss, cfg)
    for epoch in range(cfg.ppo_epochs):
        for index, minibatch in enumerate(split_minibatches(batch, cfg.num_minibatches, generator=generator)):
            where = f"step {step}, phase update (ppo epoch {epoch}, minibatch {index})"
            num_tokens = global_count(minibatch["action_mask"], env).clamp(min=1)
            num_seqs = global_count(minibatch["action_mask"].any(-1), env).clamp(min=1)
            agg = dict(agg=cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
            weighted: dict[str, torch.Tensor] = {}
            losses: dict[str, torch.Tensor] = {}
            for micro in common.pad_microbatches(list(split_microbatches(minibatch, cfg.microbatch_size)), env):
                mask = micro["action_mask"]
                share = mask.sum() / num_tokens  # this microbatch's weight in token-mean statistics
                total = 0.0
                if train_policy:
                    with common.autocast(policy, cfg):
                        logprobs, entropy = policy_logprobs(
                            policy, micro, temperature=cfg.temperature, return_entropy=True
                        )
                    logprobs, entropy = logprobs.float(), entropy.float()
                    actor, stats = ppo_loss_fn(
                        logprobs, micro["logprobs"], micro["advantages"], mask,
                        clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip, **agg,
                    )  # fmt: skip
                    policy_total = actor
                    if cfg.entropy_coef > 0:
                        policy_total = policy_total - cfg.entropy_coef * aggregate_loss(entropy, mask, **agg)
                    if not cfg.kl_in_reward and kl_coef > 0:
                        kl = aggregate_loss(
                            kl_penalty(logprobs, micro["ref_logprobs"], cfg.kl_estimator), mask, **agg
                        )
                        policy_total = policy_total + kl_coef * kl
                        _accumulate(losses, "kl_loss", kl)
                    total = total + policy_total
                    _accumulate(losses, "actor_loss", actor)
                    for name in ("clipfrac", "approx_kl", "ratio_mean"):
                        _accumulate(weighted, name, stats[name] * share)
                    _accumulate(weighted, "entropy", masked_mean(entropy.detach(), mask) * share)
                with common.autocast(value_model, cfg):
                    new_values = critic_values(value_model, micro).float()
                critic, vstats = value_loss_fn(
                    new_values, micro["values"], micro["returns"], mask, clip_eps=cfg.value_clip_eps, **agg
                )
                total = total + cfg.vf_coef * critic
                _accumulate(losses, "critic_loss", critic)
                _accumulate(weighted, "value_clipfrac", vstats["clipfrac"] * share)
                total.backward()
            # every rank raises together (gradient norms are global already)
            if any_rank(not all(torch.isfinite(v) for v in losses.values()), env):
                policy_optimizer.zero_grad(set_to_none=True)
                value_optimizer.zero_grad(set_to_none=True)
                bad = {k: float(v) for k, v in losses.items()}
                raise NonFiniteError(f"non-finite loss at {where}: {bad}")
            try:
                if train_policy:
                    _accumulate(
                        sums,
                        "grad_norm",
                        common.clip_and_step(list(policy.parameters()), policy_optimizer, cfg.max_grad_norm),
                    )
                _accumulate(
                    sums,
                    "critic_grad_norm",
                    common.clip_and_step(list(value_model.parameters()), value_optimizer, cfg.max_grad_norm),
                )
            except FloatingPointError as e:
                policy_optimizer.zero_grad(set_to_none=True)
                value_optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(f"non-finite gradient at {where}: {e}") from e
            for name, value in {**losses, **weighted}.items():
                _accumulate(sums, name, value)
            num_updates += 1
    return {name: value / num_updates for name, value in sums.items()}


def validate(
    policy: torch.nn.Module,
    tokenizer: Any,
    cfg: PPOConfig,
    *,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    env: DistEnv | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """Phase 8: mean reward of one response per test prompt (``rlbits.loops.common.validate``)."""
    return common.validate(policy, tokenizer, cfg, reward=reward, prompts=prompts, env=env)


def save(state: State, cfg: PPOConfig, env: DistEnv, *, total: int) -> Path:
    """Phase 9: ``RUN_DIR/checkpoints/step_N`` with policy (+ tokenizer), critic, both optimizers, the
    sampling and minibatch generators and the counters (every rank calls it; see ``save_checkpoint``)."""
    return save_checkpoint(
        cfg.run_dir,
        state.step,
        models=state.models,
        optimizers=state.optimizers,
        state=state.counters(total),
        generators=state.generators,
        tokenizer=state.tokenizer,
        keep=cfg.keep_checkpoints,
        env=env,
    )


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------


def train(
    cfg: PPOConfig,
    *,
    callbacks: Sequence[Any] = (),
    resume: bool = False,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
) -> Path:
    """Train with PPO; returns the run directory (``cfg.run_dir``).

    Args:
        cfg: the run's ``PPOConfig``.
        callbacks: objects with ``on_metrics(step, metrics)`` / ``on_samples(step, rows)`` / ``should_stop()``.
        resume: continue from ``latest_checkpoint(cfg.run_dir)``, reproducing the uninterrupted run exactly.
        reward: overrides the task's reward (a callable, reward model or server URL; see ``rlbits.score``).
        prompts: overrides the task's train prompts.

    Raises:
        ConfigError: ``cfg`` is not a valid ``PPOConfig``.
        FileNotFoundError: ``resume=True`` and the run has no checkpoint.
        NonFiniteError: a loss or gradient became NaN/inf (the message names step and phase).
    """
    if not isinstance(cfg, PPOConfig):
        raise ConfigError(f"cfg must be a PPOConfig, got {type(cfg).__name__}")
    cfg.validate()
    env = common.setup(cfg)
    task = get_task(cfg.task)
    reward = reward if reward is not None else task.reward
    train_prompts = list(prompts) if prompts is not None else task.prompts("train")
    checkpoint = resume_checkpoint(cfg.run_dir, missing_ok=True) if resume else None
    state = init_state(cfg, env, resume_from=checkpoint)
    stream = PromptStream(train_prompts, cfg.seed, state.consumed_samples)
    total = total_steps(cfg, len(train_prompts), env.world_size)
    run = Run(cfg, env, callbacks=callbacks, resume=resume, total_steps=total, start_step=state.step)
    run.install_signal_handlers()
    try:
        if cfg.val_at_start and state.step == 0:
            val_metrics, val_batch = validate(state.policy, state.tokenizer, cfg, reward=reward, env=env)
            state.val_reward = val_metrics["val_reward"]
            run.log(0, val_metrics)
            run.log_samples(
                0, [{"split": "test", **row} for row in common.sample_rows(val_batch, cfg.log_samples)]
            )
        skip = cfg.on_nonfinite == "skip"
        while state.step < total and not run.should_stop:
            step = state.step + 1
            timer = common.PhaseTimer()
            try:
                # 1. rollout
                with timer("rollout"):
                    n = cfg.num_prompts_per_step
                    step_prompts = stream.next(n * env.world_size)[env.rank * n : (env.rank + 1) * n]
                    batch = rollout(
                        state.policy, state.tokenizer, step_prompts, cfg, generator=state.sampling_generator
                    )
                # 2. score (and the reference policy's reward on the same prompts)
                with timer("score"), common.agreed(env, skip), common.in_phase(step, "score"):
                    score(batch, reward)
                    if cfg.reward_subtract_reference:
                        reference_rewards(
                            state.reference,
                            state.tokenizer,
                            batch,
                            reward,
                            cfg,
                            generator=state.sampling_generator,
                        )
                # 3. reference logprobs
                with timer("reference"):
                    reference(state.reference, batch, cfg)
                # 4. critic values
                with timer("values"):
                    values(state.value_model, batch, cfg)
                # 5. KL-penalised token rewards, GAE advantages and returns
                with timer("advantages"):
                    metrics = advantages(batch, cfg, env, kl_coef=state.kl_coef)
                # 6. PPO epochs x minibatches
                with timer("update"):
                    metrics.update(
                        update(
                            state.policy, state.value_model, state.policy_optimizer, state.value_optimizer, batch, cfg, env,
                            generator=state.minibatch_generator, kl_coef=state.kl_coef,
                            train_policy=state.step >= cfg.policy_training_start_step, step=step,
                        )
                    )  # fmt: skip
            except common.SKIPPABLE as e:
                if not skip:
                    raise
                run.log(step, common.skipped_step(e, step))
                state.step, state.consumed_samples, state.epoch = step, stream.consumed_samples, stream.epoch
                continue
            # 7. log
            num_tokens = global_count(batch["action_mask"], env)
            metrics.update(common.response_stats(batch))
            metrics["kl_coef"] = torch.tensor(state.kl_coef)
            logged = reduce_metrics(metrics, env)
            state.step = step
            state.consumed_samples = stream.consumed_samples
            state.epoch = stream.epoch
            state.total_valid_tokens += int(num_tokens.item())
            state.kl_coef = update_kl_coef(
                state.kl_coef, logged["init_policy_kl"], cfg, cfg.rollout_batch_size * env.world_size
            )
            logged.update(timer.metrics())
            logged["tokens_per_s"] = float(num_tokens) / max(logged["time/step"], 1e-9)
            logged["epoch"] = state.epoch
            # 8. validate
            last = state.step == total or run.should_stop
            if (cfg.val_period and step % cfg.val_period == 0) or (cfg.val_at_end and last):
                with timer("validate"):
                    val_metrics, _ = validate(state.policy, state.tokenizer, cfg, reward=reward, env=env)
                state.val_reward = val_metrics["val_reward"]
                logged.update(val_metrics)
                logged["time/validate"] = timer.seconds["validate"]
            run.log(step, logged)
            run.log_samples(step, common.sample_rows(batch, cfg.log_samples))
            run.progress(step, reward=logged["rewards"], kl=logged["init_policy_kl"])
            # 9. checkpoint (a stop requested by a signal or a callback, even while logging, saves too)
            if (cfg.save_period and step % cfg.save_period == 0) or last or run.should_stop:
                with timer("save"):
                    save(state, cfg, env, total=total)
        export_model(
            state.policy, Path(cfg.run_dir) / "final", tokenizer=state.tokenizer, env=env,
            build=lambda: load_pretrained(common.policy_path(cfg))[0],
        )  # fmt: skip
    finally:
        run.close()
    return Path(cfg.run_dir)


__all__ = [
    "NonFiniteError",
    "PPOConfig",
    "State",
    "advantages",
    "init_state",
    "reference",
    "reference_rewards",
    "rollout",
    "save",
    "scale_rewards",
    "score",
    "total_steps",
    "train",
    "update",
    "update_kl_coef",
    "validate",
    "values",
    "whiten",
]
