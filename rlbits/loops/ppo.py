"""Actor-critic PPO for language models: the RLHF loop of Ouyang 2022, on any reward.

Algorithm (Schulman 2017; for language models Ziegler 2019 and Ouyang 2022, eq. 2). Each step:

1. rollout    ``num_generations_per_prompt`` responses for each of ``num_prompts_per_step`` prompts;
2. score      the sequence reward of each response (``reward_subtract_reference``: minus the reference's);
   (2b.)      ``dynamic_sampling``: only the groups whose rewards differ, from more batches if needed;
3. reference  the frozen initial policy's logprobs of the sampled tokens (``ref_logprobs``);
4. values     the critic's V(s_t) before each response token (``values``);
5. advantages scaled reward on the last token minus ``kl_coef * KL`` on every token, GAE(gamma, lam)
              advantages (whitened) and GAE(gamma, critic_lam) returns;
6. update     ``ppo_epochs`` x ``num_minibatches`` steps on the policy loss (``policy_loss``; ``vanilla``: the
              clipped surrogate) and the value loss;
7. kl control the adaptive KL controller (Ziegler 2019, sec. 2.2) moves ``kl_coef`` for the next step;
8. log, validate and save (``rlbits.loops.run.Run``).

Every phase is ``phase(state, batch, cfg) -> batch`` (``PHASES``). docs/ppo.md: how rlbits departs from the
papers and from trlx / NeMo-Aligner / TRL, the metrics and how to launch a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from tensordict import TensorDictBase

from rlbits.batch import collate
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import unsharded
from rlbits.distributed.reduce import all_reduce_sum, masked_var
from rlbits.distributed.reduce import masked_whiten as whiten
from rlbits.functional import (
    POLICY_LOSSES,
    adaptive_kl_coef,
    aggregate_loss,
    gae,
    kl_penalty,
    masked_mean,
    masked_sum,
    positive_example_nll_loss,
    token_rewards,
    value_loss,
)
from rlbits.functional.advantages import length_adaptive_lambda
from rlbits.functional.reward import running_moments_update
from rlbits.loops import phases
from rlbits.loops.config import (
    MAX_ROWS,
    ConfigError,
    EnvConfig,
    LoRAConfig,
    PolicyGradientConfig,
    RewardShapingConfig,
)
from rlbits.loops.config_fields import ranged
from rlbits.loops.critic_client import CriticClient
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.online import initial_policy, online_fields, online_run
from rlbits.loops.optim import make_optimizer, run_length, scheduled
from rlbits.loops.reward_shaping import loss_mask as truncation_mask
from rlbits.loops.reward_shaping import shape_rewards
from rlbits.loops.runtime import Setup, autocast, head_args, kernel, load_critic, prepare, with_lora
from rlbits.loops.staleness import (
    RolloutQueue,
    next_rollouts,
    publish,
    rank_role,
    serve_rollouts,
    stop_rollouts,
)
from rlbits.loops.state import OnlineState, optimizer_of, runtime
from rlbits.loops.update import Denominators, Trained, optimize
from rlbits.models.forward import critic_values, policy_logprobs
from rlbits.models.heads import ValueModel
from rlbits.models.lora import share_frozen_parameters


@dataclasses.dataclass(frozen=True)
class PPOConfig(EnvConfig, LoRAConfig, RewardShapingConfig, PolicyGradientConfig):
    """Actor-critic PPO. Field names follow NeMo-RL / NeMo-Aligner where they have one."""

    loop: str = "ppo"
    """Which loop runs this config; ``ppo`` for this one."""
    num_prompts_per_step: int = 32
    """Prompts sampled per step (each generates ``num_generations_per_prompt`` responses)."""

    # --- PPO update
    ppo_epochs: int = ranged(4, ge=1)
    """Passes over each rollout batch (trlx ``ppo_epochs``)."""
    num_minibatches: int = ranged(2, ge=1, at_most=MAX_ROWS)
    """Optimizer steps per PPO epoch (``PolicyGradientConfig``)."""
    entropy_coef: float = ranged(0.0, ge=0)
    """Entropy bonus: ``- entropy_coef * entropy`` is added to the policy loss (0 = off)."""

    # --- KL to the reference policy
    kl_coef: float = ranged(0.05, ge=0)
    """beta of the KL penalty in the reward (``kl_in_reward``): ``r_t -= kl_coef * KL_t`` on every token; the
    initial value when ``adaptive_kl``."""
    kl_in_reward: bool = True
    """True: KL penalty in the reward (Ziegler/Ouyang, trlx). False: KL term ``kl_loss_coef * KL`` in the policy
    loss (NeMo-RL, GRPO), no KL in the reward."""
    kl_loss_coef: float = ranged(0.01, ge=0)
    """Coefficient of the KL term of the loss when ``kl_in_reward`` is False (NeMo-RL
    ``reference_policy_kl_penalty``)."""
    adaptive_kl: bool = False
    """Adapt the active KL coefficient with the Ziegler 2019 controller towards ``kl_target``."""
    kl_target: float = ranged(6.0, gt=0)
    """KL (nats per sequence, k1) the adaptive controller steers towards."""
    kl_horizon: float = ranged(10000.0, gt=0)
    """Horizon of the adaptive controller in samples: larger = slower changes of the coefficient."""
    skip_reference_policy_logprobs: bool = False
    """No reference forward pass even with a KL term configured: every KL is 0 (a quicker start; no KL control
    at all)."""

    # --- Reward scaling (after RewardShapingConfig's transforms: subtract reference, then whiten and clip, or
    # with scale_reward trlx's order: clip, then divide by the std)
    reward_subtract_reference: bool = False
    """Subtract the reference policy's reward on the same prompts: costs one more generation and scoring per
    step."""
    reward_whiten: bool = False
    """Divide the rewards by their std over the batch (mean kept, as trlx/NeMo); rewards keep their sign."""
    reward_clip: float | None = ranged(None, gt=0)
    """Clip the (scaled) rewards to [-reward_clip, reward_clip]; None = no clipping. With ``scale_reward`` it
    is trlx's ``cliprange_reward``, applied before the division (accelerate_ppo_trainer.py)."""
    scale_reward: Literal["ref", "running"] | None = None
    """trlx ``method.scale_reward`` (accelerate_ppo_trainer.py): divide each reward (after ``reward_clip``) by
    ``ref``: the std of the first step's rewards over every rank, then frozen (``State.reward_ref_std``), or
    ``running``: the running std of every step's rewards so far, this one included (trlx's ``RunningMoments``,
    ``State.reward_running_*``). Both are loop state, saved in checkpoints. None (trlx ``ignored``) = off; not
    with ``reward_whiten``."""
    reward_ref_std: float | None = ranged(None, gt=0)
    """trlx ``method.ref_std``: the divisor of ``scale_reward: ref`` instead of the first step's std. (trlx's
    ``ref_mean`` shifts no reward: given, it only stops the first rollout's statistics being measured.)"""

    # --- Advantages and critic
    gamma: float = ranged(1.0, ge=0, le=1)
    """Discount per response token."""
    lam: float = ranged(0.95, ge=0, le=1)
    """GAE lambda of the policy's advantages. With ``critic_lam`` set it is NeMo-RL's
    ``adv_estimator.gae_lambda_policy`` (nemo_rl/algorithms/ppo.py, advantage_estimator.py), otherwise its
    ``gae_lambda``."""
    critic_lam: float | None = ranged(None, ge=0, le=1)
    """GAE lambda of the critic's return targets (decoupled, VAPO/NeMo style; NeMo-RL
    ``adv_estimator.gae_lambda_value``); None = ``lam``."""
    length_adaptive_alpha: float = ranged(0.0, ge=0)
    """NeMo-RL ``adv_estimator.length_adaptive_alpha`` (advantage_estimator.py; VAPO): > 0 gives each row its
    own policy lambda ``clamp(1 - 1 / max(alpha * len, 1), 0, 1)``, ``len`` its action tokens
    (``length_adaptive_lambda``), in place of ``lam``; the critic's returns keep ``critic_lam`` (None = ``lam``).
    0 = off."""
    whiten_advantages: bool = True
    """Whiten advantages over the batch's action tokens (zero mean, unit variance)."""
    value_clip_eps: float | None = ranged(None, gt=0)
    """PPO2 value clipping range around the rollout values; None = no clipping (Andrychowicz 2021)."""
    vf_coef: float = ranged(1.0, gt=0)
    """Multiplier of the critic loss (its own optimizer, so it only changes the gradient-clipping scale)."""
    critic_learning_rate: float | None = ranged(None, gt=0)
    """AdamW learning rate of the critic; None = ``learning_rate``."""
    critic_weight_decay: float | None = ranged(None, ge=0)
    """AdamW weight decay of the critic (NeMo-RL ``value.optimizer.kwargs.weight_decay``, or
    ``value.megatron_cfg.optimizer.weight_decay`` with Megatron); None = ``weight_decay``."""
    critic_lr_warmup_steps: int | None = ranged(None, ge=0)
    """``lr_warmup_steps`` of the critic's schedule (NeMo-RL ``value.scheduler``'s ``LinearLR`` ``total_iters``,
    or ``value.megatron_cfg.scheduler.lr_warmup_iters``); None = ``lr_warmup_steps``."""
    critic_lr_warmup_start_factor: float | None = ranged(None, ge=0, le=1)
    """``lr_warmup_start_factor`` of the critic's schedule (NeMo-RL ``value.scheduler``'s ``LinearLR``
    ``start_factor``, or ``value.megatron_cfg.scheduler.lr_warmup_init`` divided by its ``optimizer.lr``);
    None = ``lr_warmup_start_factor``."""
    critic_init: str = "policy"
    """Critic initialisation: ``policy`` (the policy's backbone and a fresh head) or a folder (a saved
    ValueModel, or a causal LM)."""
    policy_training_start_step: int = ranged(0, ge=0)
    """Critic warm-up: during the first this-many steps only the critic trains (policy weights unchanged).
    These are training steps (counted in ``max_num_steps``, logged, validated); ``critic_warmup_steps``
    is the warm-up that is not."""
    critic_warmup_steps: int = ranged(0, ge=0)
    """Critic warm-up before step 1, not counted as training steps (NeMo-Aligner ``trainer.ppo.
    critic_warmup_steps``, ``PPOTrainer.fit`` in ``nemo_aligner/algorithms/ppo.py``: at step 0 it runs
    ``critic_warmup_steps + 1`` rollouts, training the critic on each, then the actor once): on a fresh run,
    this many extra rollouts (each through score, reference, values and advantages), each followed by a
    critic-only ``update`` (``critic_warmup``); their prompts are drawn from the stream as a step's are, and
    their means are logged in the step-0 row as ``critic_warmup/...``. 0: none."""
    critic_server: str | None = None
    """URL ``http(s)://host:port`` of an ``rlbits serve-critic`` server that holds the critic and its optimizer
    (NeMo-Aligner's remote critic, ``remote_critic_rm.critic.ip``/``port`` of ``gpt_ppo_actor.yaml``): the
    ``values`` phase asks it for the values, ``update`` sends it the critic's training and trains the policy
    only (``rlbits.loops.critic_client``; docs/critic_server.md). Its bearer token is read from
    ``$RLBITS_CRITIC_TOKEN``. One process only (not under torchrun). None: the critic is local."""
    critic_server_timeout: float = ranged(600.0, gt=0)
    """Seconds the critic client waits for one answer of the critic server, and for an unreachable server to
    come back (a restart from its checkpoint) before it raises naming the URL."""

    # --- Dynamic sampling (NeMo-RL ``use_dynamic_sampling``, ``dynamic_sampling_max_gen_batches``,
    # ``batch_multiplier``: nemo_rl/algorithms/grpo.py and ppo.py)
    dynamic_sampling: bool = False
    """Keep only the groups whose ``num_generations_per_prompt`` (>= 2) rewards are not all equal (the raw
    scores, before any shaping or scaling) and generate more batches until ``num_prompts_per_step`` such
    groups are kept (``dynamic_sampling``; NeMo-RL ``use_dynamic_sampling``). NeMo-RL's ppo.py declares the
    field and a ``dynamic_sampling`` function but its loop never calls it; this is its GRPO loop's
    (grpo.py)."""
    dynamic_sampling_max_gen_batches: int = ranged(4, ge=1, at_most=1024)
    """Most generation batches one step may use with dynamic_sampling, the first included; a step still
    short after them raises (NeMo-RL, which counts the batches after the first: its m is this m + 1)."""
    batch_multiplier: float = ranged(1.0, ge=1, le=1024)
    """With dynamic_sampling, each generation batch draws ``int(num_prompts_per_step * batch_multiplier)``
    prompts per rank, and the informative groups past ``num_prompts_per_step`` are dropped (NeMo-RL
    ``batch_multiplier``). 1 without dynamic_sampling."""

    def check(self) -> None:
        """The groups' checks, then PPO's rules across fields. Raises ConfigError naming the field."""
        super().check()
        if self.adaptive_kl and self.skip_reference_policy_logprobs:
            raise ConfigError(
                "adaptive_kl needs the reference policy's logprobs; it cannot be combined with "
                "skip_reference_policy_logprobs=true (the KL would always be 0)"
            )
        if self.scale_reward is not None and self.reward_whiten:
            raise ConfigError("scale_reward (trlx) and reward_whiten both divide the rewards by a std; set one")
        if self.reward_ref_std is not None and self.scale_reward != "ref":
            raise ConfigError(
                f"reward_ref_std is the divisor of scale_reward: ref; scale_reward is {self.scale_reward}"
            )
        if not self.critic_init:
            raise ConfigError("critic_init must be 'policy' or a folder, got an empty string")
        if self.critic_server is not None and not self.critic_server.startswith(("http://", "https://")):
            raise ConfigError(f"critic_server must be an http(s)://host:port URL, got {self.critic_server!r}")
        if self.critic_server is not None and self.async_mode == "ranks":
            raise ConfigError("critic_server does not run with async_mode: ranks; use async_mode: simulated")
        critic_lr = self.critic_learning_rate
        if self.lr_scheduler in ("cosine", "cosine_annealing") and critic_lr is not None and self.min_lr > critic_lr:
            raise ConfigError(
                f"min_lr ({self.min_lr}) must be <= critic_learning_rate ({critic_lr}): the critic's "
                f"{self.lr_scheduler} schedule decays from it to min_lr"
            )
        phases.check_dynamic_sampling(self)

    @property
    def uses_ref_logprobs(self) -> bool:
        """Whether the reference forward runs: a KL term in the reward or the loss (or ``adaptive_kl``) uses
        ``ref_logprobs``, or ``monitor_init_policy_kl`` asks for the metric; never with
        ``skip_reference_policy_logprobs``."""
        if self.skip_reference_policy_logprobs:
            return False
        kl_term = self.adaptive_kl or (self.kl_coef > 0 if self.kl_in_reward else self.kl_loss_coef > 0)
        return kl_term or self.monitor_init_policy_kl


# --- state --------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class State(OnlineState):
    """Everything a PPO run carries from step to step, saved as a whole (``rlbits.loops.state``): the policy
    (the model ``final/`` exports) and its reference (``OnlineState``, ``reference`` also loaded for
    ``reward_subtract_reference``), the critic, their optimizers and the KL coefficient. With
    ``critic_server`` the critic lives on the server: ``value_model`` is None and ``critic`` talks to it."""

    value_model: ValueModel | None = None
    """The local critic; None with ``critic_server``."""
    policy_optimizer: torch.optim.Optimizer = optimizer_of("policy")
    """AdamW over the policy's trainable parameters (all, or its LoRA adapters)."""
    value_optimizer: torch.optim.Optimizer = optimizer_of("value_model")
    """AdamW over the critic's trainable parameters (all, or its backbone's LoRA adapters and the value head)."""
    rollout_queue: RolloutQueue = dataclasses.field(default_factory=RolloutQueue)
    """The rollouts produced ahead of the trainer (``async_mode: simulated``; ``rlbits.loops.staleness``)."""
    kl_coef: float
    """Current coefficient of the active KL term (changes only with ``adaptive_kl``)."""
    critic: CriticClient | None = runtime(default=None)
    """The critic server's client (``critic_server``), else None."""
    critic_updates: int = 0
    """Critic updates done so far (warm-up ones included); with ``critic_server``, the server's state this run
    expects (``rlbits.loops.critic_client``)."""
    reward_ref_std: float | None = None
    """``scale_reward: ref``: the frozen divisor (the first step's reward std, or ``cfg.reward_ref_std``)."""
    reward_running_mean: float = 0.0
    """``scale_reward``: trlx's ``RunningMoments`` mean of the rewards so far (starts at 0)."""
    reward_running_var: float = 1.0
    """The running (biased) variance of the rewards (starts at 1)."""
    reward_running_count: float = 1e-24
    """The running count of rewards (starts at 1e-24, as trlx's)."""
    reward_running_std: float = 1.0
    """The running unbiased std, ``scale_reward: running``'s divisor (starts at 1)."""


def init_state(
    cfg: PPOConfig, env: DistEnv, *, setup: Setup | None = None, reward: Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None,
) -> State:
    """Load policy, reference, critic and tokenizer from the initial weights; build optimizers, generators
    and the prompt stream (``online_fields``: ``reward``, ``prompts``, ``val_prompts`` replace the task's).
    ``setup``: the run's resolved task (default ``Setup.of(cfg)``). A resumed run then restores the
    checkpoint into it (``Run.start``)."""
    if cfg.critic_server is not None and env.world_size > 1:
        raise ConfigError(
            f"critic_server runs in one process only; this run has {env.world_size} (torchrun): drop "
            "critic_server (the critic then trains locally, sharded) or run one process"
        )
    setup = setup if setup is not None else Setup.of(cfg)
    needs_reference = cfg.uses_ref_logprobs or cfg.reward_subtract_reference
    init_path, policy, tokenizer, reference = initial_policy(cfg, env, setup, reference=needs_reference)
    client = None
    if cfg.critic_server is not None:
        client = CriticClient(cfg.critic_server, timeout=cfg.critic_server_timeout)
        client.check_config(cfg)
    # the local critic, from the policy before its adapters (its own adapters)
    critic = load_critic(cfg, policy, env) if client is None else None
    policy = with_lora(policy, cfg)
    if critic is not None and cfg.lora and env.world_size == 1:  # the critic's frozen base is the policy's
        share_frozen_parameters(critic.backbone, policy.base_model)
    value_model, value_optimizer = critic_with_optimizer(critic, cfg, env) if critic is not None else (None, None)
    policy = prepare(policy.train(), cfg, env)
    return State(
        policy=policy, value_model=value_model, reference=reference, critic=client,
        policy_optimizer=make_optimizer(
            policy.parameters(), cfg.learning_rate, cfg.weight_decay, cfg.adam_betas, cfg.adam_eps
        ),
        value_optimizer=value_optimizer,
        kl_coef=cfg.kl_coef if cfg.kl_in_reward else cfg.kl_loss_coef,
        **online_fields(cfg, env, setup, tokenizer, init_path, reward=reward, prompts=prompts, val_prompts=val_prompts),
    )


# --- phases: phase(state, batch, cfg) -> batch --------------------------------------------------------


rollout = phases.rollout
"""Phase 1: ``num_generations_per_prompt`` responses per prompt at ``temperature`` (``phases.rollout``)."""


def score(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 2: ``rewards`` [B] from ``state.reward`` (an episode batch keeps its envs' rewards); with
    ``reward_subtract_reference`` also ``reference_rewards`` [B], the reward of a response the reference
    policy samples for the same prompt (a second rollout and scoring: on a multi-turn task an episode of the
    reference in a fresh env, rewarded by the env; after ``RewardShapingConfig``'s transforms, its own lengths)."""
    rewards = phases.score_rollout(batch, state.reward)
    if cfg.dynamic_sampling:  # every generation batch's rewards, before dynamic sampling keeps some
        phases.group_reward_stats(state.metrics, rewards, cfg.num_generations_per_prompt)
    if cfg.reward_subtract_reference:
        prompts = phases.prompt_batch(list(batch["prompt_text"])[:: cfg.num_generations_per_prompt])
        with phases.reference_model(state) as ref, autocast(ref, cfg):
            ref_batch = phases.sample(state, prompts, cfg, ref)
        ref_rewards = phases.score_rollout(ref_batch, state.reward).to(batch["rewards"].device)
        if cfg.reward_shaped:
            ref_rewards = shape_rewards(ref_rewards.float(), ref_batch.to(ref_rewards.device), cfg)
        batch["reference_rewards"] = ref_rewards
    return batch


def dynamic_sampling(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 2b (``cfg.dynamic_sampling``; else returns ``batch``): the groups of the scored ``batch`` and of
    more generation batches (``rollout``, ``score``) whose rewards are not all equal, exactly
    ``num_prompts_per_step`` of them per rank, joined by ``collate`` (``phases.keep_informative_groups``:
    the rules under torchrun, the metrics ``gen_batches``, ``kept_groups`` and ``discarded_groups``). A rank
    that generates nothing in a round also joins the reference's gathering of ``score`` with
    ``reward_subtract_reference``.

    Raises:
        RuntimeError: some rank kept fewer than ``num_prompts_per_step`` groups after
            ``dynamic_sampling_max_gen_batches`` generation batches (NeMo-RL), on every rank.
    """
    if not cfg.dynamic_sampling:
        return batch
    kept = phases.keep_informative_groups(
        state, batch, cfg, rollout=rollout, score=score, join=_join_sampling, exhausted="error"
    )
    return collate(kept, pad_token_id=state.tokenizer.pad_token_id) if len(kept) > 1 else kept[0]


def _join_sampling(state: State, cfg: PPOConfig) -> None:
    """Enter the collectives of ``rollout`` and ``score`` without generating: the policy's gathering and,
    with ``reward_subtract_reference``, the reference's."""
    phases.join_rollout(state)
    if cfg.reward_subtract_reference:
        with phases.reference_model(state) as ref:
            phases.join_rollout(state, ref)


reference = phases.reference
"""Phase 3: ``ref_logprobs`` [B, R] under the frozen reference, when a term uses them (``phases.reference``)."""

rollout_correction = phases.rollout_correction
"""Phase 5b (``rollout_correction`` on): ``old_logprobs`` recomputed by the policy, the correction's
``rollout_is_weights`` and ``loss_mask`` (the tokens the policy and critic losses count)
(``phases.rollout_correction``)."""


def critic_lr(cfg: PPOConfig) -> float:
    """The critic's base learning rate: ``critic_learning_rate``, else ``learning_rate``."""
    return cfg.critic_learning_rate if cfg.critic_learning_rate is not None else cfg.learning_rate


def critic_with_optimizer(
    critic: ValueModel, cfg: PPOConfig, env: DistEnv
) -> tuple[ValueModel, torch.optim.Optimizer]:
    """The critic prepared for training (``prepare``: sharding, precision) and its AdamW at ``critic_lr(cfg)``:
    the local critic of ``init_state`` and the critic server's (``rlbits.loops.critic_server``)."""
    value_model = prepare(critic, cfg, env)
    decay = cfg.critic_weight_decay if cfg.critic_weight_decay is not None else cfg.weight_decay
    return value_model, make_optimizer(
        value_model.parameters(), critic_lr(cfg), decay, cfg.adam_betas, cfg.adam_eps
    )


def critic_schedule(cfg: PPOConfig) -> SimpleNamespace:
    """The ``lr_scheduler`` fields of the critic's schedule (what ``rlbits.loops.optim.lr_schedule`` reads):
    the run's, with ``critic_lr_warmup_steps`` / ``critic_lr_warmup_start_factor`` where they are set."""
    names = ("lr_scheduler", "lr_warmup_steps", "lr_warmup_start_factor", "lr_constant_steps", "min_lr")
    sched = SimpleNamespace(**{name: getattr(cfg, name) for name in (*names, "lr_max_steps")})
    if cfg.critic_lr_warmup_steps is not None:
        sched.lr_warmup_steps = cfg.critic_lr_warmup_steps
    if cfg.critic_lr_warmup_start_factor is not None:
        sched.lr_warmup_start_factor = cfg.critic_lr_warmup_start_factor
    return sched


def critic_estimates(value_model: torch.nn.Module, batch: TensorDictBase, cfg: PPOConfig) -> torch.Tensor:
    """The critic's V(s_t) before each response token, [B, R] float32, 0 off ``action_mask``, without
    gradient, under the run's precision, split and packed as the update (``critic_values`` with
    ``phases.scoring_args``)."""
    with torch.no_grad(), unsharded(value_model), autocast(value_model, cfg):
        return critic_values(value_model, batch, **phases.scoring_args(cfg)).float()


def values(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 4: ``values`` [B, R], the critic's V(s_t) before each response token (no gradient): the local
    critic's ``critic_estimates``, or with ``critic_server`` the server's (the same function there)."""
    if state.critic is not None:
        batch["values"] = state.critic.values(batch, state.critic_updates)
    else:
        batch["values"] = critic_estimates(state.value_model, batch, cfg)
    return batch


def scale_rewards(batch: TensorDictBase, cfg: PPOConfig, env: DistEnv, state: State | None = None) -> torch.Tensor:
    """The rewards the optimisation sees, in this order: ``RewardShapingConfig``'s transforms
    (``rlbits.loops.reward_shaping.shape_rewards``: NeMo-Aligner's standardisation, NeMo-RL's linear scaling,
    then its stop-properly or DAPO overlong shaping), minus ``reference_rewards`` if present; then either trlx's
    ``scale_reward`` (clip to +-``reward_clip``, update the statistics in ``state``, divide by the frozen or the
    running std) or, without it, whitened over the batch (mean kept) if ``reward_whiten`` and clipped to
    +-``reward_clip``. Returns [B]; ``rewards`` is untouched.

    Raises:
        ValueError: ``scale_reward`` without ``state`` (it holds the statistics)."""
    scores = shape_rewards(batch["rewards"].float(), batch, cfg) if cfg.reward_shaped else batch["rewards"]
    if cfg.reward_subtract_reference:
        scores = scores - batch["reference_rewards"]
    if cfg.scale_reward is not None:
        if state is None:
            raise ValueError("scale_reward needs the loop state (its reward statistics)")
        return _trlx_scale(scores, cfg, env, state)
    if cfg.reward_whiten:
        scores = whiten(scores, torch.ones_like(scores, dtype=torch.bool), env, shift_mean=False)
    if cfg.reward_clip is not None:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    return scores


def _trlx_scale(scores: torch.Tensor, cfg: PPOConfig, env: DistEnv, state: State) -> torch.Tensor:
    """trlx's ``scale_reward`` (accelerate_ppo_trainer.py): clip to +-``cliprange_reward``, set the frozen std on
    the first call, merge the batch's moments (over every rank) into the running ones, divide."""
    if cfg.reward_clip is not None:
        scores = scores.clamp(-cfg.reward_clip, cfg.reward_clip)
    x = scores.double()
    count = all_reduce_sum(torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), env)
    mean = all_reduce_sum(x.sum(), env) / count
    var = all_reduce_sum(((x - mean) ** 2).sum(), env) / count  # biased, as trlx's get_global_statistics
    if state.reward_ref_std is None:  # the first step's std (unbiased, as torch's .std()), then frozen
        measured = float((var * count / (count - 1)).sqrt())
        state.reward_ref_std = cfg.reward_ref_std if cfg.reward_ref_std is not None else measured
    moments = torch.tensor(
        [state.reward_running_mean, state.reward_running_var, state.reward_running_count, state.reward_running_std],
        dtype=torch.float64,
    )
    moments = running_moments_update(moments, mean.cpu(), var.cpu(), count.cpu())
    mean_, var_, count_, std_ = (float(v) for v in moments)
    state.reward_running_mean, state.reward_running_var = mean_, var_
    state.reward_running_count, state.reward_running_std = count_, std_
    m = state.metrics
    m.same("reward_ref_std", state.reward_ref_std)
    m.same("reward_running_mean", state.reward_running_mean)
    m.same("reward_running_std", state.reward_running_std)
    divisor = state.reward_running_std if cfg.scale_reward == "running" else state.reward_ref_std
    return scores / divisor


def advantages(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 5: ``token_rewards``, ``advantages`` and ``returns`` [B, R].

    ``token_rewards`` = scaled reward on the last action token minus ``kl_coef * kl_penalty(logprobs,
    ref_logprobs, kl_estimator)`` on every action token (no KL when ``kl_in_reward`` is False). Multi-turn
    episodes with ``turn_reward: token``: each turn's reward on that turn's last action token instead
    (``turn_rewards``), plus ``scaled - rewards`` (what whitening/clipping changed in the episode's sum) on the
    last action token, so a row's rewards still sum to its scaled score. Policy
    advantages from ``gae(gamma, lam)`` (per-row lambdas from ``length_adaptive_lambda`` with
    ``length_adaptive_alpha``; whitened over all ranks if ``whiten_advantages``); critic targets
    ``returns`` from ``gae(gamma, critic_lam)``. Adds to ``state.metrics``: ``rewards``, ``rewards_with_kl``,
    ``init_policy_kl``, ``advantages``, ``returns``, ``values``, ``explained_variance``, ``response_len``
    (``rewards_scaled`` when a scaling is on; ``reward_ref_std``, ``reward_running_mean`` and
    ``reward_running_std`` with ``scale_reward``). The scaled reward is ``scale_rewards``' (its docstring gives
    the order of the transforms). With ``overlong_filtering`` writes ``loss_mask`` [B, R]: ``action_mask``
    without the truncated rows, the tokens the policy loss, the value loss and their denominators count
    (NeMo-RL ``loss_multiplier = 0``; ``loss_tokens``); advantages are still whitened over ``action_mask``.
    """
    mask, env, m = batch["action_mask"], state.env, state.metrics
    gae_fn = kernel(gae, cfg)
    kl = None
    if cfg.kl_in_reward and "ref_logprobs" in batch.keys():
        kl = kernel(kl_penalty, cfg)(
            batch["logprobs"], batch["ref_logprobs"], cfg.kl_estimator,
            clamp=cfg.kl_clamp, input_clamp=cfg.kl_input_clamp,
        )
    scores = scale_rewards(batch, cfg, env, state)
    coef = state.kl_coef if cfg.kl_in_reward else 0.0
    if cfg.turn_reward == "token" and "turn_rewards" in batch.keys():
        shift = scores - batch["rewards"]
        batch["token_rewards"] = kernel(token_rewards, cfg)(shift, mask, kl, coef, turn_rewards=batch["turn_rewards"])
    else:
        batch["token_rewards"] = kernel(token_rewards, cfg)(scores, mask, kl, coef)
    critic_lam = cfg.lam if cfg.critic_lam is None else cfg.critic_lam
    if cfg.length_adaptive_alpha > 0:  # NeMo-RL's priority: length_adaptive_alpha > gae_lambda_policy
        policy_lam = length_adaptive_lambda(mask, cfg.length_adaptive_alpha)
        adv, _ = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=policy_lam)
        _, ret = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=critic_lam)
        m.mean("policy_lam", policy_lam.sum(), batch.batch_size[0])
    else:
        adv, ret = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=cfg.lam)
        if critic_lam != cfg.lam:
            _, ret = gae_fn(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=critic_lam)
    rows, tokens = batch.batch_size[0], mask.sum()
    phases.add_batch_stats(m, batch)
    m.mean("rewards_with_kl", batch["token_rewards"].sum(), rows)
    for name, x in (("advantages", adv), ("returns", ret), ("values", batch["values"])):
        m.mean(name, masked_sum(x, mask), tokens)
    m.same("explained_variance", 1.0 - masked_var(ret - batch["values"], mask, env) / masked_var(ret, mask, env).clamp(min=1e-8))
    if cfg.overlong_filtering:  # NeMo-RL's loss_multiplier = 0 for truncated rows: out of both losses' tokens
        batch["loss_mask"] = truncation_mask(batch, cfg)
        m.sum("loss_tokens", batch["loss_mask"].sum().float())
    scaled = cfg.reward_subtract_reference or cfg.reward_whiten or cfg.reward_clip is not None
    if scaled or cfg.reward_shaped or cfg.scale_reward is not None:
        m.mean("rewards_scaled", scores.sum(), rows)
    if cfg.reward_subtract_reference:
        m.mean("reference_rewards", batch["reference_rewards"].sum(), rows)
    batch["advantages"] = whiten(adv, mask, env) if cfg.whiten_advantages else adv
    batch["returns"] = ret
    return batch


def objective(state: State, micro: TensorDictBase, cfg: PPOConfig, den: Denominators) -> tuple[torch.Tensor, dict]:
    """PPO's loss on one microbatch, every term aggregated (``loss_agg``) over the minibatch's global counts.

    The policy loss of the whitened advantages (``cfg.policy_loss`` of ``rlbits.POLICY_LOSSES`` with
    ``cfg.policy_loss_args``; ``vanilla``: the clipped surrogate, Schulman 2017 eq. 7), the entropy bonus and
    the critic's squared error (eq. 9; the critic is a separate model, so ``vf_coef`` scales its gradient
    only), and ``kl_coef * KL(pi || pi_ref)`` when the KL is not in the reward. During the critic warm-up
    (``policy_training_start_step``) the policy is not run and only the critic's term remains.
    Stats: ``critic_loss``, ``value_clipfrac``; with the policy ``actor_loss``, ``entropy`` (+ ``kl_loss``)
    and the loss's metrics (``phases.policy_loss_stats``: ``clipfrac``, ``approx_kl``, ``ratio_mean``, and
    the rest of a loss other than ``vanilla``); shares of the minibatch's values (``rlbits.loops.update``).
    """
    mask = micro["loss_mask"] if "loss_mask" in micro.keys() else micro["action_mask"]  # rollout correction
    agg, share = den.agg(cfg.loss_agg, cfg.loss_scale_factor), den.share(mask)
    pg_loss = entropy = kl = nll = 0.0
    stats: dict[str, torch.Tensor] = {}
    if state.step >= cfg.policy_training_start_step:
        logprobs, token_entropy = (x.float() for x in policy_logprobs(
            state.policy, micro, temperature=cfg.temperature, return_entropy=True,
            entropy_grad=cfg.entropy_coef > 0, **head_args(cfg),
        ))
        # a rollout correction: the trainer's recomputed old policy and the correction's weights (phases)
        old = micro["old_logprobs"] if "old_logprobs" in micro.keys() else micro["logprobs"]
        is_w = {"rollout_is_weights": micro["rollout_is_weights"]} if "rollout_is_weights" in micro.keys() else {}
        pg_loss, ratio = kernel(POLICY_LOSSES[cfg.policy_loss], cfg)(
            logprobs, old, micro["advantages"], mask, **agg, **is_w, **cfg.policy_loss_args
        )
        entropy = aggregate_loss(token_entropy, mask, **agg) if cfg.entropy_coef > 0 else 0.0
        if not cfg.kl_in_reward and state.kl_coef > 0 and "ref_logprobs" in micro.keys():
            token_kl = kl_penalty(
                logprobs, micro["ref_logprobs"], cfg.kl_estimator, clamp=cfg.kl_clamp, input_clamp=cfg.kl_input_clamp
            )
            kl = aggregate_loss(token_kl, mask, **agg)
            stats["kl_loss"] = kl.detach()
        if cfg.positive_example_nll_weight > 0:
            nll, _ = kernel(positive_example_nll_loss, cfg)(logprobs, mask, micro["rewards"])
            stats["positive_nll_loss"] = nll.detach()
        stats |= {"actor_loss": pg_loss.detach(), "entropy": masked_mean(token_entropy.detach(), mask) * share}
        always = ("clipfrac", "approx_kl", "ratio_mean")
        stats |= {name: v * share for name, v in phases.policy_loss_stats(ratio, cfg, always).items()}
    critic_term = 0.0
    if state.value_model is not None:  # with critic_server the server trains the critic
        critic_term, critic_stats = critic_objective(state, micro, cfg, den)
        stats |= critic_stats
    loss = (
        pg_loss  # policy_loss; vanilla: the clipped surrogate -min(r A, clip(r, 1 - eps, 1 + eps_high) A)
        - cfg.entropy_coef * entropy  # entropy bonus
        + state.kl_coef * kl  # KL to the reference, when it is not in the reward
        + cfg.positive_example_nll_weight * nll  # VAPO/NeMo-RL: NLL of the rows with reward > 0
        + critic_term  # critic: vf_coef x (clipped) squared error to the GAE returns
    )
    return loss, stats


def critic_objective(
    state: Any, micro: TensorDictBase, cfg: PPOConfig, den: Denominators
) -> tuple[torch.Tensor, dict]:
    """The critic's term of ``objective``, ``vf_coef * value_loss`` (Schulman 2017 eq. 9, PPO2 clipping with
    ``value_clip_eps``) of ``state.value_model`` on one microbatch over the minibatch's global counts; the
    whole objective of the critic server. Stats: ``critic_loss``, ``value_clipfrac``."""
    mask = micro["loss_mask"] if "loss_mask" in micro.keys() else micro["action_mask"]
    agg, share = den.agg(cfg.loss_agg, cfg.loss_scale_factor), den.share(mask)
    values = critic_values(state.value_model, micro).float()
    v_loss, vstats = kernel(value_loss, cfg)(
        values, micro["values"], micro["returns"], mask, clip_eps=cfg.value_clip_eps, **agg
    )
    return cfg.vf_coef * v_loss, {"critic_loss": v_loss.detach(), "value_clipfrac": vstats["clipfrac"] * share}


def critic_trained(
    value_model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: PPOConfig, step: int, total: int
) -> Trained:
    """The critic in ``optimize``: its gradient norm logged as ``critic_grad_norm``, its rate following
    ``lr_scheduler`` (``critic_schedule(cfg)``) from ``critic_lr(cfg)`` over ``ppo_epochs * num_minibatches``
    optimizer steps per training step (``step``: the training step, 0-based; ``total``: the run's training
    steps)."""
    per_step = cfg.ppo_epochs * cfg.num_minibatches
    return Trained(
        value_model, optimizer, grad_norm="critic_grad_norm", lr_metric="critic_lr",
        lr=scheduled(critic_schedule(cfg), critic_lr(cfg), step, per_step, total),
    )


def update_mask(batch: TensorDictBase) -> str:
    """The mask ``update``'s denominators count: ``loss_mask`` when the batch has one, else ``action_mask``."""
    return "loss_mask" if "loss_mask" in batch.keys() else "action_mask"


def update(state: State, batch: TensorDictBase, cfg: PPOConfig) -> TensorDictBase:
    """Phase 6: ``ppo_epochs`` x ``num_minibatches`` steps of the policy's and the critic's optimizers on
    ``objective`` (``rlbits.loops.update.optimize``: whole prompt groups shuffled with
    ``state.minibatch_generator``, ``microbatch_size``-row microbatches, denominators counted over
    ``loss_mask`` when the batch has one (``overlong_filtering``, a rollout correction), else ``action_mask``).
    During the critic warm-up (``policy_training_start_step``) only the critic trains.

    Learning rates follow ``lr_scheduler`` (``rlbits.loops.optim.scheduled``): the critic's from
    ``critic_learning_rate`` over the run's ``ppo_epochs * num_minibatches`` optimizer steps per step, the
    policy's from ``learning_rate`` counted from ``policy_training_start_step``.

    Adds to ``state.metrics`` (means over the optimizer steps) ``objective``'s stats, ``grad_norm`` and
    ``critic_grad_norm`` (and ``lr`` / ``critic_lr`` under a schedule). Returns ``batch``.

    Raises:
        NonFiniteError: a non-finite loss or gradient norm, on every rank together; neither model steps.
    """
    per_step, total = cfg.ppo_epochs * cfg.num_minibatches, run_length(state, cfg)
    remote = state.critic is not None
    # with critic_server: the critic's training goes to the server first (with the minibatch generator's state,
    # so it shuffles the same minibatches) and runs there while the policy trains here
    pending = state.critic.train_async(batch, cfg, state, total) if remote else None
    trained = [] if remote else [critic_trained(state.value_model, state.value_optimizer, cfg, state.step, total)]
    start = cfg.policy_training_start_step
    if state.step >= start:  # the policy's schedule starts with its training
        lr = scheduled(cfg, cfg.learning_rate, state.step - start, per_step, total - start)
        trained.insert(0, Trained(state.policy, state.policy_optimizer, lr=lr))
    try:
        if trained:
            optimize(
                state, batch, cfg, objective, trained=trained, epochs=cfg.ppo_epochs,
                num_minibatches=cfg.num_minibatches, shuffle=state.minibatch_generator, mask=update_mask(batch),
            )
    except Exception:
        if remote:  # the server's update still counts once it is answered: the next request expects it
            with contextlib.suppress(Exception):
                pending.result()
                state.critic_updates += 1
        raise
    if remote:
        state.critic.finish_train(pending, state, policy_trained=state.step >= start)
    state.critic_updates += 1
    return batch


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

evaluate_run = phases.evaluate_run
"""``rlbits eval RUN_DIR``: the final policy's test-split reward next to the base model's."""

PHASES = (
    rollout, score, dynamic_sampling, reference, values, advantages, rollout_correction, update, kl_control, validate
)
"""The phases of a step, in order (``validate``: the validation phase), each ``phase(state, batch, cfg) -> batch``."""


# --- the loop -----------------------------------------------------------------------------------------


def critic_warmup(run: Any, state: State, cfg: PPOConfig) -> None:
    """NeMo-Aligner's critic warm-up, before step 1 (``cfg.critic_warmup_steps`` times): a rollout through the
    phases of a step up to ``advantages``, then ``update`` with the policy left out (as during
    ``policy_training_start_step``); ``state.step`` stays 0. The warm-up's metrics (means over its rollouts)
    go to the step-0 row under ``critic_warmup/``."""
    critic_only = dataclasses.replace(cfg, policy_training_start_step=state.step + 1)
    logged = state.metrics  # what the loop measured before its first step stays in the step-0 row
    for _ in range(cfg.critic_warmup_steps):
        state.metrics = StepMetrics()
        with run.phase("critic_warmup"):
            batch = rollout(state, state.stream.next_batch(cfg.num_prompts_per_step, run.env), cfg)
            for phase in (score, reference, values, advantages):
                batch = phase(state, batch, critic_only)
            if cfg.rollout_correction_mode != "none":
                batch = rollout_correction(state, batch, critic_only)
            update(state, batch, critic_only)
        for name, value in state.metrics.reduce(run.env).items():
            logged.mean(f"critic_warmup/{name}", value, 1)
    state.metrics = logged


def produce(state: State, cfg: PPOConfig, phase: Callable[[str], Any]) -> TensorDictBase:
    """Phases 1-2b, the rollout side, with the policy as it is now; ``phase(name)``: the context each runs in
    (``Run.phase``; ``contextlib.nullcontext`` on a rollout rank)."""
    with phase("rollout"):  # 1. sample responses
        batch = rollout(state, state.stream.next_batch(phases.generation_batch_size(cfg), state.env), cfg)
    if state.critic is not None and cfg.async_mode == "off" and not cfg.dynamic_sampling:
        state.critic.prefetch_values(batch, state.critic_updates)  # values while the rewards are scored
    with phase("score"):  # 2. rewards (and the reference policy's, if subtracted)
        batch = score(state, batch, cfg)
    if cfg.dynamic_sampling:
        with phase("rollout"):  # 2b. informative groups only, from more batches if needed
            batch = dynamic_sampling(state, batch, cfg)
    return batch


def train(
    cfg: PPOConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False, reward: Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None,
) -> Path:
    """Train with PPO and return the run directory (``cfg.run_dir``).

    ``callbacks``, ``resume``, ``force``, ``reward``, ``prompts``, ``val_prompts``: as ``rlbits.train`` (the
    reward and prompts replace the task's; ``rlbits.loops.online.online_run`` sets the run up).

    Raises:
        ConfigError: ``cfg`` is not a valid ``PPOConfig``; and the errors of ``rlbits.train``.
        NonFiniteError: a loss or gradient became NaN/inf (the message names step and phase).
    """
    if not isinstance(cfg, PPOConfig):
        raise ConfigError(f"cfg must be a PPOConfig, got {type(cfg).__name__}")
    if rank_role(cfg) == "rollout":  # async_mode: ranks: this rank only generates (docs/async.md)
        cfg.check()
        inputs = dict(reward=cfg.resolve_reward(reward), prompts=prompts, val_prompts=val_prompts)
        return serve_rollouts(cfg, init_state, lambda state: produce(state, cfg, contextlib.nullcontext), **inputs)
    with online_run(
        cfg, init_state, validate, reward=reward, prompts=prompts, val_prompts=val_prompts, callbacks=callbacks,
        resume=resume, force=force,
    ) as (run, state):
        if state.step == 0 and cfg.critic_warmup_steps:
            critic_warmup(run, state, cfg)

        for _ in run.steps(state):
            with run.step(state):
                batch = next_rollouts(state, cfg, lambda: produce(state, cfg, run.phase))  # 1-2 (async_mode)
                if state.critic is not None and cfg.async_mode != "off":  # the critic of this step values them
                    state.critic.prefetch_values(batch, state.critic_updates)
                with run.phase("reference"):  # 3. reference logprobs
                    batch = reference(state, batch, cfg)
                with run.phase("values"):  # 4. critic values
                    batch = values(state, batch, cfg)
                with run.phase("advantages"):  # 5. KL-penalised token rewards, GAE advantages and returns
                    batch = advantages(state, batch, cfg)
                if cfg.rollout_correction_mode != "none":
                    with run.phase("rollout_correction"):  # 5b. old logprobs recomputed; IS weights, rejection
                        batch = rollout_correction(state, batch, cfg)
                with run.phase("update"):  # 6. PPO epochs x minibatches
                    batch = update(state, batch, cfg)
                batch = kl_control(state, batch, cfg)  # 7. adaptive KL coefficient
                publish(state, cfg)  # async_mode: ranks: the new weights to the rollout rank
                run.end_step(state, batch)  # 8. log; validate and save when due
        stop_rollouts(state, cfg)
        return run.finish(state)  # RUN_DIR/final/: the policy


__all__ = [
    "PHASES",
    "PPOConfig",
    "State",
    "advantages",
    "critic_estimates",
    "critic_lr",
    "critic_schedule",
    "critic_objective",
    "critic_trained",
    "critic_with_optimizer",
    "dynamic_sampling",
    "evaluate_run",
    "init_state",
    "kl_control",
    "objective",
    "produce",
    "reference",
    "rollout",
    "rollout_correction",
    "scale_rewards",
    "score",
    "train",
    "update",
    "update_mask",
    "validate",
    "values",
]
