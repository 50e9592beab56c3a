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
7. kl control the adaptive KL controller (Ziegler 2019, sec. 2.2) updates ``kl_coef`` from the step's KL;
              the new value applies from the next step;
8. log, validate every ``val_period`` steps, save every ``save_period`` steps (``rlbits.loops.run.Run``).

Every phase is ``phase(state, batch, cfg) -> batch`` (docs/design.md, "Phases"): a notebook can run one
step phase by phase (tutorials/04), a new algorithm can reuse any of them.

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

Metrics (one ``metrics.jsonl`` line per step; docs/ppo.md explains each): ``rewards``, ``rewards_with_kl``,
``init_policy_kl``, ``kl_coef`` (``kl_loss_coef`` with the KL in the loss), ``advantages``, ``returns``,
``values``, ``explained_variance``, ``actor_loss``, ``critic_loss``, ``clipfrac``, ``approx_kl``,
``ratio_mean``, ``entropy``, ``value_clipfrac``, ``grad_norm``, ``critic_grad_norm``, ``response_len``,
``tokens_per_s``, ``time/<phase>``, ``epoch``, and ``val_reward`` (+ ``val_reward_std``,
``val_response_len``) on validation steps (step 0 = before training).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from tensordict import TensorDictBase

from rlbits.batch import split_microbatches, split_minibatches
from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import unsharded
from rlbits.distributed.reduce import all_reduce_sum, any_rank, global_count, masked_var
from rlbits.distributed.reduce import masked_whiten as whiten
from rlbits.functional import (
    adaptive_kl_coef,
    aggregate_loss,
    gae,
    kl_penalty,
    masked_mean,
    masked_sum,
    ppo_loss,
    token_rewards,
    value_loss,
)
from rlbits.loops import phases
from rlbits.loops.config import MAX_ROWS, ConfigError, RunConfig, check_ranges
from rlbits.loops.optim import clip_and_step, make_optimizer, pad_microbatches
from rlbits.loops.run import NonFiniteError, Run, total_steps
from rlbits.loops.runtime import (
    autocast,
    build_policy,
    disable_dropout,
    fused_gelu,
    generator,
    head_args,
    initial_policy_path,
    kernel,
    load_policy_and_tokenizer,
    loop_prompts,
    prepare,
    with_lora,
)
from rlbits.loops.state import OnlineState, frozen, optimizer_of
from rlbits.models.forward import critic_values, policy_logprobs
from rlbits.models.heads import ValueModel
from rlbits.models.load import freeze
from rlbits.models.lora import share_frozen_parameters
from rlbits.tasks import get_task


@dataclasses.dataclass(frozen=True)
class PPOConfig(RunConfig):
    """Actor-critic PPO. Field names follow NeMo-RL / NeMo-Aligner where they have one."""

    SIZE_LIMITS: ClassVar[dict[str, int]] = {"num_minibatches": MAX_ROWS}

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
    kl_estimator: Literal["k1", "abs", "k2", "k3", "k1+", "k3+"] = "k1"
    """Per-token KL estimator of ``rlbits.kl_penalty`` used in the reward or the loss (k1 = logp - ref_logp; ``k1+``/``k3+``: k1/k3's value with k2's gradient, verl's straight-through variants)."""
    kl_clamp: float | None = None
    """Clamp each token's KL estimate to [-kl_clamp, kl_clamp] (verl, OpenRLHF and NeMo-RL clamp at 10); None = no clamp."""
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
    """No reference forward pass even with a KL term configured: every KL is 0 (a quicker start; no KL control at all)."""
    monitor_init_policy_kl: bool = False
    """Run the reference forward only to log ``init_policy_kl`` when no term uses ``ref_logprobs`` (``kl_coef`` 0 in the reward, ``kl_loss_coef`` 0 in the loss, no ``adaptive_kl``); without it the reference model is then neither loaded nor run."""

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

    def check(self) -> None:
        """RunConfig's checks plus PPO's ranges. Raises ConfigError naming the field."""
        super().check()
        if self.loop != "ppo":
            raise ConfigError(f"loop must be 'ppo' for PPOConfig, got {self.loop!r}")
        check_ranges(
            self, at_least_one=("ppo_epochs", "num_minibatches"),
            non_negative=("clip_eps", "entropy_coef", "kl_coef", "kl_loss_coef", "policy_training_start_step"),
            positive=("kl_target", "kl_horizon", "vf_coef"), unit_interval=("gamma", "lam", "critic_lam"),
            positive_or_none=("clip_eps_high", "reward_clip", "value_clip_eps", "critic_learning_rate", "kl_clamp"),
        )  # fmt: skip
        if self.num_minibatches > self.num_prompts_per_step:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must be <= num_prompts_per_step "
                f"({self.num_prompts_per_step}): minibatches hold whole prompt groups"
            )
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ConfigError(f"dual_clip must be > 1 (Ye 2020) or null, got {self.dual_clip}")
        if self.adaptive_kl and self.skip_reference_policy_logprobs:
            raise ConfigError(
                "adaptive_kl needs the reference policy's logprobs; it cannot be combined with "
                "skip_reference_policy_logprobs=true (the KL would always be 0)"
            )
        if not self.critic_init:
            raise ConfigError("critic_init must be 'policy' or a folder, got an empty string")

    @property
    def uses_ref_logprobs(self) -> bool:
        """Whether the reference forward runs: a KL term in the reward or the loss (or ``adaptive_kl``) uses
        ``ref_logprobs``, or ``monitor_init_policy_kl`` asks for the metric; never with
        ``skip_reference_policy_logprobs``."""
        if self.skip_reference_policy_logprobs:
            return False
        kl_term = self.adaptive_kl or (self.kl_coef > 0 if self.kl_in_reward else self.kl_loss_coef > 0)
        return kl_term or self.monitor_init_policy_kl



# --------------------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class State(OnlineState):
    """Everything a PPO run carries from step to step, saved as a whole (``rlbits.loops.state``)."""

    policy: torch.nn.Module
    value_model: ValueModel
    reference: torch.nn.Module | None = frozen(default=None)
    """Frozen initial policy (None when neither reference logprobs nor reference rewards are needed, and with
    LoRA, whose reference is the policy with its adapters disabled: ``phases.reference_model``)."""
    policy_optimizer: torch.optim.Optimizer = optimizer_of("policy")
    """AdamW over the policy's trainable parameters (all, or its LoRA adapters)."""
    value_optimizer: torch.optim.Optimizer = optimizer_of("value_model")
    """AdamW over the critic's trainable parameters (all, or its backbone's LoRA adapters and the value head)."""
    kl_coef: float
    """Current coefficient of the active KL term (changes only with ``adaptive_kl``)."""


def _load_critic(cfg: PPOConfig, policy: torch.nn.Module, env: DistEnv) -> ValueModel:
    if cfg.critic_init == "policy":
        critic = ValueModel.from_policy(policy, seed=cfg.seed)
    else:
        if not Path(cfg.critic_init).is_dir():
            raise ConfigError(f"critic_init must be 'policy' or an existing folder; {cfg.critic_init!r} is neither")
        critic = ValueModel.from_pretrained(cfg.critic_init, seed=cfg.seed)
    critic = fused_gelu(disable_dropout(critic))
    with_lora(critic.backbone, cfg, "critic")  # in place; the value head stays fully trained
    return critic.to(env.device).train()


def init_state(
    cfg: PPOConfig, env: DistEnv, *, reward: Any = None, prompts: Sequence[str] | None = None,
    val_prompts: Sequence[str] | None = None,
) -> State:
    """Load policy, reference, critic and tokenizer from the initial weights; build optimizers, generators
    and the prompt stream. A resumed run then restores the checkpoint into it (``Run.start``).

    Args:
        reward, prompts: override the task's reward and train prompts.
        val_prompts: override the task's test split as validation prompts.
    """
    task = get_task(cfg.task)
    make_env = getattr(task, "make_env", None)
    if make_env is not None and cfg.reward_subtract_reference:
        raise ConfigError(
            f"reward_subtract_reference is not supported for the multi-turn task {cfg.task!r} (its rewards come "
            "from its envs, not from a reward function of a reference response)"
        )
    init_path = initial_policy_path(cfg)
    policy, tokenizer = load_policy_and_tokenizer(init_path, env)
    reference = None
    needs_reference = cfg.uses_ref_logprobs or cfg.reward_subtract_reference
    if needs_reference and not cfg.lora:  # with LoRA the reference is the policy with its adapters disabled
        reference = prepare(freeze(load_policy_and_tokenizer(init_path, env)[0]), cfg, env)
    critic = _load_critic(cfg, policy, env)  # from the policy before its adapters: its own adapters
    policy = with_lora(policy, cfg)
    if cfg.lora and env.world_size == 1:  # the critic's frozen base is the policy's: one copy (unsharded only)
        share_frozen_parameters(critic.backbone, policy.base_model)
    value_model = prepare(critic, cfg, env)
    policy = prepare(policy.train(), cfg, env)
    critic_lr = cfg.critic_learning_rate if cfg.critic_learning_rate is not None else cfg.learning_rate
    return State(
        env=env, tokenizer=tokenizer, policy=policy, value_model=value_model, reference=reference,
        policy_optimizer=make_optimizer(policy.parameters(), cfg.learning_rate, cfg.weight_decay),
        value_optimizer=make_optimizer(value_model.parameters(), critic_lr, cfg.weight_decay),
        sampling_generator=generator(cfg.seed, env.rank, "sampling", env.device),
        minibatch_generator=generator(cfg.seed, env.rank, "minibatch"),
        stream=PromptStream(loop_prompts(cfg, tokenizer, prompts, "train"), cfg.seed),
        kl_coef=cfg.kl_coef if cfg.kl_in_reward else cfg.kl_loss_coef,
        reward=reward if reward is not None else task.reward, make_env=make_env,
        val_prompts=loop_prompts(cfg, tokenizer, val_prompts, "test"),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# Phases: phase(state, batch, cfg) -> batch
# --------------------------------------------------------------------------------------------------------


def rollout(state: State, batch: TensorDictBase, cfg: PPOConfig, *, policy: torch.nn.Module | None = None) -> TensorDictBase:
    """Phase 1: ``num_generations_per_prompt`` responses per prompt of ``batch["prompt_text"]`` at
    ``temperature``, sampled with ``state.sampling_generator`` (``policy``: default ``state.policy``).

    Returns a new batch with ``prompts``, ``prompt_mask``, ``responses``, ``action_mask``, ``response_mask``,
    ``input_ids``, ``attention_mask``, ``logprobs``, ``group``, ``truncated``, ``prompt_text``,
    ``response_text``. A multi-turn task (``state.make_env``): one episode per sample (``phases.episodes``),
    with ``rewards``, ``turn_rewards``, ``turn_index``, ``num_turns`` and ``stop_reason`` as well.
    """
    context = phases.decoding(state, cfg) if policy is None else autocast(policy, cfg)
    with context as model:
        if state.make_env is not None:
            return phases.episodes(
                policy if policy is not None else model, state.tokenizer, phases.prompt_texts(batch),
                state.make_env, cfg, temperature=cfg.temperature, num_samples=cfg.num_generations_per_prompt,
                generator=state.sampling_generator, compile=cfg.compile_generate,
                pack_weights=phases.pack_weights(cfg),
            )  # fmt: skip
        return phases.rollout(
            policy if policy is not None else model, state.tokenizer, phases.prompt_texts(batch),
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
            num_samples=cfg.num_generations_per_prompt, compile=cfg.compile_generate,
            pack_weights=phases.pack_weights(cfg), generator=state.sampling_generator,
        )  # fmt: skip


def score(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 2: ``rewards`` [B] from ``state.reward`` (an episode batch keeps its envs' rewards); with
    ``reward_subtract_reference`` also
    ``reference_rewards`` [B], the reward of a response the reference policy samples for the same prompt
    (a second generation and scoring)."""
    phases.score_rollout(batch, state.reward)
    if cfg.reward_subtract_reference:
        prompts = phases.prompt_batch(list(batch["prompt_text"])[:: cfg.num_generations_per_prompt])
        with phases.reference_model(state) as ref:
            ref_batch = rollout(state, prompts, cfg, policy=ref)
        batch["reference_rewards"] = phases.score_rollout(ref_batch, state.reward).to(batch["rewards"].device)
    return batch


def reference(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 3: ``ref_logprobs`` [B, R] under the frozen reference. Nothing when no term uses them
    (``cfg.uses_ref_logprobs`` is False): the batch then has no ``ref_logprobs``, every KL is 0 and
    ``init_policy_kl`` is not logged."""
    if not cfg.uses_ref_logprobs:
        return batch
    with phases.reference_model(state) as ref, unsharded(ref), autocast(ref, cfg):
        phases.reference_logprobs(ref, batch, temperature=cfg.temperature, microbatch_size=cfg.microbatch_size, **head_args(cfg))
    return batch


def values(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 4: ``values`` [B, R], the critic's V(s_t) before each response token (no gradient)."""
    with torch.no_grad(), unsharded(state.value_model), autocast(state.value_model, cfg):
        batch["values"] = critic_values(state.value_model, batch, microbatch_size=cfg.microbatch_size).float()
    return batch


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


def advantages(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 5: ``token_rewards``, ``advantages`` and ``returns`` [B, R].

    ``token_rewards`` = scaled reward on the last action token minus ``kl_coef * kl_penalty(logprobs,
    ref_logprobs, kl_estimator)`` on every action token (no KL when ``kl_in_reward`` is False). Multi-turn
    episodes with ``turn_reward: token``: each turn's reward on that turn's last action token instead
    (``turn_rewards``), plus ``scaled - rewards`` (what whitening/clipping changed in the episode's sum) on the
    last action token, so a row's rewards still sum to its scaled score. Policy
    advantages from ``gae(gamma, lam)`` (whitened over all ranks if ``whiten_advantages``); critic targets
    ``returns`` from ``gae(gamma, critic_lam)``. Adds to ``state.metrics``: ``rewards``, ``rewards_with_kl``,
    ``init_policy_kl``, ``advantages``, ``returns``, ``values``, ``explained_variance``, ``response_len``.
    """
    mask, env, m = batch["action_mask"], state.env, state.metrics
    gae_fn = kernel(gae, cfg)
    kl = None
    if cfg.kl_in_reward and "ref_logprobs" in batch.keys():
        kl = kernel(kl_penalty, cfg)(batch["logprobs"], batch["ref_logprobs"], cfg.kl_estimator, clamp=cfg.kl_clamp)
    scores = scale_rewards(batch, cfg, env)
    coef = state.kl_coef if cfg.kl_in_reward else 0.0
    if cfg.turn_reward == "token" and "turn_rewards" in batch.keys():
        shift = scores - batch["rewards"]
        batch["token_rewards"] = kernel(token_rewards, cfg)(shift, mask, kl, coef, turn_rewards=batch["turn_rewards"])
    else:
        batch["token_rewards"] = kernel(token_rewards, cfg)(scores, mask, kl, coef)
    adv, ret = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.critic_lam is not None and cfg.critic_lam != cfg.lam:
        _, ret = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=cfg.critic_lam)
    rows, tokens = batch.batch_size[0], mask.sum()
    phases.add_batch_stats(m, batch)
    m.mean("rewards_with_kl", batch["token_rewards"].sum(), rows)
    for name, x in (("advantages", adv), ("returns", ret), ("values", batch["values"])):
        m.mean(name, masked_sum(x, mask), tokens)
    m.same("explained_variance", 1.0 - masked_var(ret - batch["values"], mask, env) / masked_var(ret, mask, env).clamp(min=1e-8))
    if cfg.reward_subtract_reference or cfg.reward_whiten or cfg.reward_clip is not None:
        m.mean("rewards_scaled", scores.sum(), rows)
    if cfg.reward_subtract_reference:
        m.mean("reference_rewards", batch["reference_rewards"].sum(), rows)
    batch["advantages"] = whiten(adv, mask, env) if cfg.whiten_advantages else adv
    batch["returns"] = ret
    return batch


def update(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 6: ``ppo_epochs`` x ``num_minibatches`` optimizer steps on policy and critic.

    Each minibatch (whole prompt groups, shuffled with ``state.minibatch_generator``) is cut into
    ``microbatch_size``-row microbatches whose gradients accumulate; every loss term is aggregated with the
    minibatch's global action-token count (and row count) as denominator, so the update does not depend on
    ``microbatch_size`` or the number of ranks. Policy loss: ``ppo_loss`` on the whitened advantages, minus
    ``entropy_coef * entropy``, plus ``kl_coef * KL(ref)`` when ``kl_in_reward`` is False. Critic loss:
    ``vf_coef * value_loss`` against ``returns``. During the critic warm-up (``policy_training_start_step``)
    only the critic is trained and the policy is not run at all.

    Adds to ``state.metrics`` (means over minibatches): ``critic_loss``, ``value_clipfrac``,
    ``critic_grad_norm`` and, when the policy trains, ``actor_loss``, ``clipfrac``, ``approx_kl``,
    ``ratio_mean``, ``entropy``, ``grad_norm`` (+ ``kl_loss`` with KL in the loss). Returns ``batch``.

    Raises:
        NonFiniteError: a loss is not finite (raised before either model steps), or a gradient norm is not
            finite (raised before that model steps); on every rank together.
    """
    env, m = state.env, state.metrics
    train_policy = state.step >= cfg.policy_training_start_step
    ppo_loss_fn, value_loss_fn = kernel(ppo_loss, cfg), kernel(value_loss, cfg)
    share_of_updates = 1.0 / (cfg.ppo_epochs * cfg.num_minibatches)
    for epoch in range(cfg.ppo_epochs):
        for index, minibatch in enumerate(split_minibatches(batch, cfg.num_minibatches, generator=state.minibatch_generator)):
            num_tokens = global_count(minibatch["action_mask"], env).clamp(min=1)
            num_seqs = global_count(minibatch["action_mask"].any(-1), env).clamp(min=1)
            agg = dict(agg=cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
            losses: dict[str, torch.Tensor] = {}
            for micro in pad_microbatches(list(split_microbatches(minibatch, cfg.microbatch_size)), env):
                mask = micro["action_mask"]
                share = mask.sum() / num_tokens * share_of_updates  # weight of this microbatch's token means
                total = 0.0
                if train_policy:
                    with autocast(state.policy, cfg):
                        logprobs, entropy = policy_logprobs(
                            state.policy, micro, temperature=cfg.temperature, return_entropy=True,
                            entropy_grad=cfg.entropy_coef > 0, **head_args(cfg),
                        )  # fmt: skip
                    logprobs, entropy = logprobs.float(), entropy.float()
                    actor, stats = ppo_loss_fn(
                        logprobs, micro["logprobs"], micro["advantages"], mask,
                        clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, dual_clip=cfg.dual_clip, **agg,
                    )  # fmt: skip
                    total = actor
                    if cfg.entropy_coef > 0:
                        total = total - cfg.entropy_coef * aggregate_loss(entropy, mask, **agg)
                    if not cfg.kl_in_reward and state.kl_coef > 0 and "ref_logprobs" in micro.keys():
                        kl = aggregate_loss(kl_penalty(logprobs, micro["ref_logprobs"], cfg.kl_estimator, clamp=cfg.kl_clamp), mask, **agg)
                        total = total + state.kl_coef * kl
                        losses["kl_loss"] = losses.get("kl_loss", 0.0) + kl.detach()
                    losses["actor_loss"] = losses.get("actor_loss", 0.0) + actor.detach()
                    for name in ("clipfrac", "approx_kl", "ratio_mean"):
                        m.sum(name, stats[name] * share)
                    m.sum("entropy", masked_mean(entropy.detach(), mask) * share)
                with autocast(state.value_model, cfg):
                    new_values = critic_values(state.value_model, micro).float()
                critic, vstats = value_loss_fn(new_values, micro["values"], micro["returns"], mask, clip_eps=cfg.value_clip_eps, **agg)
                total = total + cfg.vf_coef * critic
                losses["critic_loss"] = losses.get("critic_loss", 0.0) + critic.detach()
                m.sum("value_clipfrac", vstats["clipfrac"] * share)
                total.backward()
            _step_optimizers(state, cfg, losses, train_policy, where=f"ppo epoch {epoch}, minibatch {index}")
            for name, value in losses.items():
                m.sum(name, value * share_of_updates)
    return batch


def _step_optimizers(state: State, cfg: PPOConfig, losses: dict, train_policy: bool, *, where: str) -> None:
    """Clip and step both optimizers after a minibatch, unless a loss or gradient is not finite."""
    optimizers = (state.policy_optimizer, state.value_optimizer)
    if any_rank(not all(torch.isfinite(v) for v in losses.values()), state.env):  # every rank raises together
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        raise NonFiniteError(f"non-finite loss at {where}: { {k: float(v) for k, v in losses.items()} }")
    share = 1.0 / (cfg.ppo_epochs * cfg.num_minibatches)
    try:
        if train_policy:
            state.metrics.same("grad_norm", clip_and_step(list(state.policy.parameters()), state.policy_optimizer, cfg.max_grad_norm) * share)
        norm = clip_and_step(list(state.value_model.parameters()), state.value_optimizer, cfg.max_grad_norm)
        state.metrics.same("critic_grad_norm", norm * share)
    except FloatingPointError as e:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        raise NonFiniteError(f"non-finite gradient at {where}: {e}") from e


def kl_control(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 7: log the KL coefficient this step used (``kl_coef``, or ``kl_loss_coef`` with the KL in the
    loss) and, with ``adaptive_kl``, move it by the Ziegler 2019 controller from the step's mean KL per
    sequence over all ranks (``adaptive_kl_coef``)."""
    state.metrics.same("kl_coef" if cfg.kl_in_reward else "kl_loss_coef", state.kl_coef)
    if cfg.adaptive_kl:
        kl = phases.kl_per_sequence(batch["logprobs"], batch["ref_logprobs"], batch["action_mask"])
        total, rows = all_reduce_sum(torch.stack([kl.sum().double(), torch.tensor(float(kl.numel()), dtype=torch.float64, device=kl.device)]), state.env)
        state.kl_coef = float(adaptive_kl_coef(state.kl_coef, float(total / rows), cfg.kl_target, cfg.kl_horizon, int(rows)))
    return batch


validate = phases.validate_policy
"""Validation: mean reward of one response per test prompt (``rlbits.loops.phases.validate_policy``)."""


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------


def train(
    cfg: PPOConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False, reward: Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None,
) -> Path:  # fmt: skip
    """Train with PPO; returns the run directory (``cfg.run_dir``).

    Args:
        cfg: the run's ``PPOConfig``.
        callbacks: objects with ``on_metrics(step, metrics)`` / ``on_samples(step, rows)`` / ``should_stop()``.
        resume: continue from the latest checkpoint of ``cfg.run_dir``, reproducing the uninterrupted run exactly.
        force: also use a ``run_dir`` that is not empty and not an rlbits run, or start an existing run
            over (``rlbits.loops.run.Run``); a live run's lock is never overridden.
        reward: overrides the task's reward (a callable, reward model or server URL; see ``rlbits.score``).
        prompts: overrides the task's train prompts (a list of non-empty strings, checked before any model is
            loaded, and for length once the tokenizer is).
        val_prompts: validation prompts instead of the task's test split (default: ``cfg.val_prompts``, a file).
            The reward and prompts are recorded in ``RUN_DIR/provenance.json``; a resume with other ones is
            refused unless ``cfg.allow_changed_inputs``.

    Raises:
        ConfigError: ``cfg`` is not a valid ``PPOConfig``.
        PromptError: bad prompts or val_prompts (before anything is loaded or written).
        ResumeMismatchError: ``resume`` with another reward or other prompts than the run was started with.
        FileNotFoundError: ``resume=True`` and the run has no checkpoint.
        NonFiniteError: a loss or gradient became NaN/inf (the message names step and phase).
    """
    if not isinstance(cfg, PPOConfig):
        raise ConfigError(f"cfg must be a PPOConfig, got {type(cfg).__name__}")
    reward = cfg.resolve_reward(reward)  # the reward_model key: a reward-model folder instead of the task's reward
    with Run(cfg, callbacks=callbacks, resume=resume, force=force) as run:
        prompts, val_prompts = run.check_inputs(reward=reward, prompts=prompts, val_prompts=val_prompts)
        state = init_state(cfg, run.env, reward=reward, prompts=prompts, val_prompts=val_prompts)
        run.start(state, validate=validate)  # restores a checkpoint into the state; opens the logs
        for _ in run.steps(state):
            with run.step(state):
                with run.phase("rollout"):  # 1. sample responses
                    batch = rollout(state, state.stream.next_batch(cfg.num_prompts_per_step, run.env), cfg)
                with run.phase("score"):  # 2. rewards (and the reference policy's, if subtracted)
                    batch = score(state, batch, cfg)
                with run.phase("reference"):  # 3. reference logprobs
                    batch = reference(state, batch, cfg)
                with run.phase("values"):  # 4. critic values
                    batch = values(state, batch, cfg)
                with run.phase("advantages"):  # 5. KL-penalised token rewards, GAE advantages and returns
                    batch = advantages(state, batch, cfg)
                with run.phase("update"):  # 6. PPO epochs x minibatches
                    batch = update(state, batch, cfg)
                batch = kl_control(state, batch, cfg)  # 7. adaptive KL coefficient
                run.end_step(state, batch)  # 8. log; validate and save when due
        return run.finish(state, build=lambda: build_policy(cfg))


__all__ = [
    "NonFiniteError",
    "PPOConfig",
    "State",
    "advantages",
    "init_state",
    "kl_control",
    "reference",
    "rollout",
    "scale_rewards",
    "score",
    "total_steps",
    "train",
    "update",
    "validate",
    "values",
    "whiten",
]
