"""REINFORCE with a group baseline: RLOO, GRPO, Dr. GRPO, verl's other critic-free advantage estimators (and DAPO's
dynamic sampling / clip-higher).

Algorithm (one step)::

    1. rollout     K = num_generations_per_prompt responses for each of num_prompts_per_step prompts
    2. score       sequence reward r_i per response (dynamic_sampling: keep informative groups only)
       greedy      (remax only) one greedy response per prompt, scored: its reward is the baseline
    3. reference   log pi_ref of the sampled tokens (init_policy_kl; the KL terms)
    4. advantages  r'_i = r_i - kl_coef * sum_t KL_t                        (kl_in_reward)
                   A_i  = r'_i - mean_{j != i} r'_j                         (rloo; Kool 2019, Ahmadian 2024)
                        = (r'_i - mean_g r') / (std_g r' + eps)              (grpo; Shao 2024)
                        = r'_i - mean_g r'                                  (dr_grpo; Liu 2025)
                        = (r'_i - mean_{-i} r') / (std_{-i} r' + eps)      (grpo_loo; NeMo-RL's grpo)
                        = r'_i                                              (none; Williams 1992)
                   or another of ADV_ESTIMATORS (rlbits.ADVANTAGE_ESTIMATORS, verl's adv_estimator names:
                   reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk)
    5. update      loss = pg_loss + kl_loss_coef * agg(KL_t(pi_theta || pi_ref)); pg_loss is policy_loss
                   (rlbits.POLICY_LOSSES: vanilla = the clipped PPO loss, DAPO clip-higher; gspo, cispo, ...),
                   and -A log pi for vanilla with one iteration and one minibatch (the ratio is 1)
    6. log, validate and save (rlbits.loops.run.Run)

docs/reinforce.md: the papers, how rlbits departs from them, the metrics and how to launch a run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import einops
import torch
from tensordict import TensorDictBase

from rlbits.batch import collate
from rlbits.distributed.env import DistEnv
from rlbits.distributed.reduce import all_reduce_max, all_reduce_sum
from rlbits.functional import (
    POLICY_LOSSES,
    aggregate_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    positive_example_nll_loss,
    reinforce_loss,
    rloo_baseline,
    token_rewards,
)
from rlbits.functional.advantages import rloo_baseline_ended
from rlbits.functional.estimators import ADVANTAGE_ESTIMATORS
from rlbits.loops import phases
from rlbits.loops.config import ConfigError, EnvConfig, LoRAConfig, PolicyGradientConfig, RewardShapingConfig
from rlbits.loops.config_fields import ranged
from rlbits.loops.online import initial_policy, online_fields, online_run
from rlbits.loops.optim import make_optimizer, run_length, scheduled
from rlbits.loops.reward_shaping import loss_mask as truncation_mask
from rlbits.loops.reward_shaping import shape_rewards, truncated_rows
from rlbits.loops.runtime import Setup, head_args, kernel, prepare, with_lora
from rlbits.loops.staleness import (
    RolloutQueue,
    next_rollouts,
    publish,
    rank_role,
    serve_rollouts,
    stop_rollouts,
)
from rlbits.loops.state import OnlineState, optimizer_of
from rlbits.loops.update import Denominators, Trained, optimize
from rlbits.models.forward import policy_logprobs

ADV_ESTIMATORS = (
    "rloo",
    "grpo",
    "grpo_loo",
    "dr_grpo",
    "none",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
    "raw_reward",
)
"""The ``ADVANTAGE_ESTIMATORS`` this loop runs. Not here: ``gae`` (a critic: the PPO loop),
``optimal_token_baseline`` (needs sum_v pi(v)^2 per token, which the rollout does not record) and ``gdpo``
(needs several reward components; rlbits' rewards are one score)."""
GROUPED = ("rloo", "grpo", "grpo_loo", "dr_grpo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk")
"""The estimators that compare a prompt's responses: they need num_generations_per_prompt >= 2."""
PER_TOKEN_REWARDS = ("reinforce_plus_plus", "remax")
"""The estimators that use the rewards per token (returns to go): with ``kl_in_reward`` each action token carries
its KL penalty, as verl's ``token_level_rewards``; the others use only the sequence sum."""


@dataclasses.dataclass(frozen=True)
class ReinforceConfig(EnvConfig, LoRAConfig, RewardShapingConfig, PolicyGradientConfig):
    """REINFORCE / RLOO / GRPO: group-baselined policy gradient, optional PPO-style clipping (see module doc)."""

    loop: str = "reinforce"
    """Which loop runs this config; ``reinforce`` for this one."""
    num_generations_per_prompt: int = 4
    """K responses per prompt (>= 2 for the estimators of ``GROUPED``); a prompt's K responses form its group."""
    adv_estimator: Literal[
        "rloo", "grpo", "grpo_loo", "dr_grpo", "none", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
        "remax", "opo", "gpg", "grpo_passk", "raw_reward",
    ] = "rloo"
    """The advantage estimator (verl's name; ``rlbits.ADVANTAGE_ESTIMATORS``): ``rloo``: r - mean of the other K-1
    rewards; ``grpo``: (r - group mean) / (group std + eps); ``grpo_loo``: (r - mean of the other K-1) / (their
    std + eps), not divided where they are all equal (NeMo-RL's default ``grpo``: ``normalize_rewards`` and
    ``use_leave_one_out_baseline``); ``dr_grpo``: r - group mean (Dr. GRPO, Liu 2025);
    ``none``: r itself (plain REINFORCE); ``reinforce_plus_plus``: the discounted return to go, whitened over the
    batch; ``reinforce_plus_plus_baseline``: r - group mean, whitened; ``remax``: the return to go minus the
    reward of a greedy response; ``opo``: r - length-weighted group mean; ``gpg``: (r - group mean) * B / (rewards
    != 0); ``grpo_passk``: only each group's best response, (r_max - r_second) / (std + eps); ``raw_reward``
    (NeMo-RL's ``adv_estimator.name: raw_reward``, advantage_estimator.py): r whitened over the batch's tokens
    (its ``normalize_advantages: true``; ``none`` is the unwhitened form)."""
    grpo_eps: float = ranged(1e-6, ge=0)
    """Added to the group std by ``grpo``, ``grpo_loo`` and ``grpo_passk`` (verl's ``epsilon``; NeMo-RL fixes
    1e-6)."""
    gamma: float = ranged(1.0, ge=0, le=1)
    """Discount per action token of ``reinforce_plus_plus``'s return to go (verl's ``algorithm.gamma``)."""
    kl_in_reward: bool = False
    """Subtract ``kl_coef * sum_t KL_t`` from each sequence reward before the baseline (NeMo-Aligner RLOO)."""
    kl_coef: float = ranged(0.0, ge=0)
    """KL coefficient of the reward penalty; must be > 0 with ``kl_in_reward`` and 0 without it."""
    kl_reward_reduction: Literal["sum", "mean"] = "sum"
    """How ``kl_in_reward`` reduces a response's per-token KL: ``sum`` (``r - kl_coef * sum_t KL_t``) or
    ``mean`` over its action tokens, NeMo-Aligner's ``rewards - initial_policy_kl_penalty *
    masked_mean(init_policy_kl)`` (nemo_aligner/algorithms/reinforce.py at af2b3bd; its
    ``initial_policy_kl_penalty`` is ``kl_coef``, ``use_absolute_kl`` is ``kl_estimator: abs``). Not with the
    per-token estimators (``reinforce_plus_plus``, ``remax``), whose KL stays on each token."""
    rloo_exclude_truncated: bool = False
    """``rloo`` as NeMo-Aligner's ``calculate_rloo_baseline`` (nemo_aligner/utils/ppo_utils.py at af2b3bd,
    called with ``mask=is_end``): truncated responses are left out of the others' baselines, the divisor is
    (ended - 1), and a group with at most one ended response gets baseline = reward (advantages 0)
    (``rlbits.functional.advantages.rloo_baseline_ended``). Only with ``adv_estimator: rloo``."""
    kl_loss_coef: float = ranged(0.0, ge=0)
    """Weight of a KL(pi_theta || pi_ref) term added to the loss (GRPO: 0.04 with k3); 0 disables it."""
    kl_loss_estimator: Literal["k1", "abs", "k2", "k3", "k1+", "k3+"] = "k3"
    """Per-token KL estimator of the loss term (GRPO uses ``k3``)."""
    num_iterations: int = ranged(1, ge=1)
    """Passes over each rollout batch (TRL's ``num_iterations``, mu in the GRPO paper); > 1 (or num_minibatches
    > 1) switches to the clipped PPO loss."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no signal) and generate more until num_prompts_per_step
    informative groups are kept (DAPO; NeMo-RL ``use_dynamic_sampling``, nemo_rl/algorithms/grpo.py). When
    ``dynamic_sampling_max_gen_batches`` run out, the step trains on the groups kept (NeMo-RL raises; the PPO
    loop does)."""
    dynamic_sampling_max_gen_batches: int = ranged(4, ge=1, at_most=1024)
    """Most generation batches one step may use with dynamic_sampling, the first included (NeMo-RL's
    ``dynamic_sampling_max_gen_batches`` counts those after the first: its m is this m + 1)."""
    batch_multiplier: float = ranged(1.0, ge=1, le=1024)
    """With dynamic_sampling, each generation batch draws ``int(num_prompts_per_step * batch_multiplier)``
    prompts per rank, and the informative groups past ``num_prompts_per_step`` are dropped (NeMo-RL
    ``batch_multiplier``, grpo.py). 1 without dynamic_sampling."""

    def check(self) -> None:
        """The groups' checks, then REINFORCE's rules across fields. Raises ConfigError naming the field."""
        super().check()
        if self.adv_estimator in GROUPED and self.num_generations_per_prompt < 2:
            raise ConfigError(
                f"num_generations_per_prompt must be >= 2 for adv_estimator={self.adv_estimator!r} (a group needs "
                f"other samples), got {self.num_generations_per_prompt}"
            )
        if self.gamma != 1.0 and self.adv_estimator != "reinforce_plus_plus":
            raise ConfigError(
                f"gamma={self.gamma} has no effect with adv_estimator={self.adv_estimator!r}; it discounts "
                "reinforce_plus_plus's return to go"
            )
        phases.check_dynamic_sampling(self)
        if self.kl_reward_reduction == "mean" and self.adv_estimator in PER_TOKEN_REWARDS:
            raise ConfigError(
                f"kl_reward_reduction='mean' does not apply to adv_estimator={self.adv_estimator!r}: its KL stays on "
                "each token"
            )
        if self.rloo_exclude_truncated and self.adv_estimator != "rloo":
            raise ConfigError(f"rloo_exclude_truncated needs adv_estimator='rloo', got {self.adv_estimator!r}")
        if self.kl_in_reward and self.kl_coef == 0:
            raise ConfigError("kl_in_reward=true needs kl_coef > 0 (the weight of the KL taken off the reward)")
        if not self.kl_in_reward and self.kl_coef > 0:
            raise ConfigError(
                f"kl_coef={self.kl_coef} has no effect with kl_in_reward=false; set kl_in_reward=true, or use "
                "kl_loss_coef for a KL term in the loss"
            )

    @property
    def uses_ref_logprobs(self) -> bool:
        """Whether the reference model is loaded and run: a KL term in the reward or the loss uses
        ``ref_logprobs``, or ``monitor_init_policy_kl`` asks for the metric."""
        return self.kl_in_reward or self.kl_loss_coef > 0 or self.monitor_init_policy_kl

    @property
    def clipped(self) -> bool:
        """Whether the update uses the clipped PPO loss (the ratio can move off 1 only with several updates)."""
        return self.num_iterations > 1 or self.num_minibatches > 1


@dataclasses.dataclass(kw_only=True)
class State(OnlineState):
    """Everything a REINFORCE run carries from step to step, saved as a whole (``rlbits.loops.state``): the
    policy and its reference (``OnlineState``) and the policy's optimizer."""

    optimizer: torch.optim.Optimizer = optimizer_of("policy")
    """AdamW over the parameters that train: all of the policy's, or only its LoRA adapters."""
    rollout_queue: RolloutQueue = dataclasses.field(default_factory=RolloutQueue)
    """The rollouts produced ahead of the trainer (``async_mode: simulated``; ``rlbits.loops.staleness``)."""


def init_state(
    cfg: ReinforceConfig, env: DistEnv, *, setup: Setup | None = None, reward: Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None,
) -> State:
    """Load the policy and a frozen reference from the initial weights (with ``lora_rank > 0``: LoRA
    adapters on the policy and no reference copy), build the optimizer, the generators and the prompt stream
    (``online_fields``: ``reward``, ``prompts``, ``val_prompts`` replace the task's). ``setup``: the run's
    resolved task (default ``Setup.of(cfg)``). A resumed run then restores the checkpoint into it
    (``Run.start``)."""
    setup = setup if setup is not None else Setup.of(cfg)
    init_path, policy, tokenizer, reference = initial_policy(cfg, env, setup, reference=cfg.uses_ref_logprobs)
    policy = prepare(with_lora(policy, cfg).train(), cfg, env)
    return State(
        policy=policy, reference=reference,
        optimizer=make_optimizer(
            policy.parameters(), cfg.learning_rate, cfg.weight_decay, cfg.adam_betas, cfg.adam_eps
        ),
        **online_fields(cfg, env, setup, tokenizer, init_path, reward=reward, prompts=prompts, val_prompts=val_prompts),
    )


# --- phases: phase(state, batch, cfg) -> batch --------------------------------------------------------------


rollout = phases.rollout
"""Phase 1: K responses per prompt at ``cfg.temperature``, groups contiguous (``phases.rollout``)."""


def score(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 2: ``rewards`` [B] from ``state.reward`` (callable, reward model or server URL; an episode batch
    keeps its envs' summed rewards); adds
    ``gen_rewards``, ``zero_std_frac`` (groups whose K rewards are all equal) and ``gen_batches`` over every
    batch generated this step (dynamic sampling may generate several)."""
    rewards = phases.score_rollout(batch, state.reward)
    phases.group_reward_stats(state.metrics, rewards, cfg.num_generations_per_prompt)
    return batch


def dynamic_sampling(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 2b (DAPO dynamic sampling): the informative groups of the scored ``batch`` and of more
    generation batches (``rollout``, ``score``) until ``num_prompts_per_step`` groups are kept or
    ``dynamic_sampling_max_gen_batches`` batches ran (``phases.keep_informative_groups``: the rules under
    torchrun, the metrics ``gen_batches``, ``kept_groups`` and ``discarded_groups``), joined by ``collate``.
    When the batches run out, trains on what each rank kept (on the first ``num_prompts_per_step`` groups of
    the last batch if it kept none: only a KL loss can move them). Without ``cfg.dynamic_sampling`` returns
    ``batch`` and logs ``gen_batches`` 1 and ``kept_groups``."""
    if not cfg.dynamic_sampling:
        state.metrics.max("gen_batches", 1.0)
        state.metrics.sum("kept_groups", float(batch.batch_size[0] // cfg.num_generations_per_prompt))
        return batch
    kept = phases.keep_informative_groups(state, batch, cfg, rollout=rollout, score=score, exhausted="train")
    return collate(kept, pad_token_id=state.tokenizer.pad_token_id) if len(kept) > 1 else kept[0]


reference = phases.reference
"""Phase 3: ``ref_logprobs`` [B, R] under the frozen reference, when a term uses them (``phases.reference``)."""

rollout_correction = phases.rollout_correction
"""Phase 4b (``rollout_correction`` on): ``old_logprobs`` recomputed by the policy, the correction's
``rollout_is_weights`` and ``loss_mask`` (``phases.rollout_correction``)."""


def greedy_baseline(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 2c (``adv_estimator: remax``): one greedy response to each prompt of ``batch`` by ``state.policy``
    (through ``phases.decoding``, with the rollouts' repetition penalty, ``min_new_tokens`` and stop strings;
    an episode with ``temperature`` 0 for a multi-turn task), scored by
    ``state.reward``; writes ``reward_baselines`` [B], each row the greedy reward of its prompt (ReMax, Li 2024).
    Greedy decoding draws no random numbers, so the sampling stream is that of a run without this phase. Under
    torchrun each rank decodes its own prompts (the collectives of a rollout: gathering a sharded policy).
    Without ``remax`` returns ``batch`` unchanged. Adds ``greedy_rewards`` (their mean) to ``state.metrics``."""
    if cfg.adv_estimator != "remax":
        return batch
    k = cfg.num_generations_per_prompt
    prompts = phases.prompt_texts(batch)[::k]
    common = dict(
        temperature=0.0, compile=cfg.compile_generate, pack_weights=phases.pack_weights(cfg),
        continuous_batching=cfg.continuous_batching, max_num_seqs=cfg.max_num_seqs,
    )
    with phases.decoding(state, cfg) as model:
        if state.make_env is not None:
            greedy = phases.run_episodes(model, state.tokenizer, prompts, state.make_env, cfg, **common)
        else:
            options = {**phases.generation_options(cfg), **common}  # greedy, with the rollouts' stop rules
            greedy = phases.generate_rollout(model, state.tokenizer, prompts, **options)
    rewards = phases.score_rollout(greedy, state.reward).to(batch["action_mask"].device)
    if cfg.reward_shaped:  # compared with the samples' shaped rewards: the same transforms (its own length)
        rewards = shape_rewards(rewards.float(), greedy.to(rewards.device), cfg)
    batch["reward_baselines"] = einops.repeat(rewards, "g -> (g k)", k=k)
    state.metrics.mean("greedy_rewards", rewards.sum(), rewards.numel())
    return batch


def _baseline(shaped: torch.Tensor, batch: TensorDictBase, cfg: ReinforceConfig) -> torch.Tensor:
    """[B] the value each reward is compared with, for the ``baseline`` metric: the others' mean (``rloo``,
    ``grpo_loo``), the greedy reward (``remax``), 0 (``none``, ``reinforce_plus_plus``), else the group mean."""
    k = cfg.num_generations_per_prompt
    if cfg.adv_estimator in ("rloo", "grpo_loo"):
        return rloo_baseline(shaped, k)
    if cfg.adv_estimator == "remax":
        return batch["reward_baselines"]
    if cfg.adv_estimator in GROUPED:
        return einops.repeat(einops.reduce(shaped, "(g k) -> g", "mean", k=k), "g -> (g k)", k=k)
    return torch.zeros_like(shaped)


def _estimator_kwargs(cfg: ReinforceConfig) -> dict[str, Any]:
    """The config's hyperparameters of ``cfg.adv_estimator``, under the estimator's (verl's) names."""
    if cfg.adv_estimator in ("grpo", "grpo_loo", "grpo_passk"):
        return {"epsilon": cfg.grpo_eps}
    if cfg.adv_estimator == "reinforce_plus_plus":
        return {"gamma": cfg.gamma}
    return {}


def advantages(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 4: ``advantages`` [B, R] and ``loss_mask`` [B, R] from ``rewards``, ``logprobs``, ``ref_logprobs``
    (and ``reward_baselines`` for ``remax``) by ``rlbits.ADVANTAGE_ESTIMATORS[cfg.adv_estimator]``.

    ``r`` is the reward after ``RewardShapingConfig``'s transforms (``shape_rewards``: NeMo-Aligner's
    standardisation, NeMo-RL's linear scaling, then its stop-properly or DAPO overlong shaping; all off by
    default); ``r' = r - kl_coef * sum_t KL_t`` (with ``kl_in_reward``; the mean over the action tokens with
    ``kl_reward_reduction: mean``) on the last action token, or for the
    per-token estimators (``reinforce_plus_plus``, ``remax``) ``r`` there and ``-kl_coef * KL_t`` on every
    action token (verl's ``token_level_rewards``); the estimator's advantages (e.g. the sequence advantage ``A
    = r' - baseline`` broadcast over action tokens); ``loss_mask = action_mask`` without the truncated responses
    when ``overlong_filtering`` (NeMo-RL's ``loss_multiplier = 0``). With ``rloo_exclude_truncated`` the
    baseline is ``rloo_baseline_ended`` (NeMo-Aligner). Statistics over the whole batch
    (whitening, gpg's alpha) are summed over every rank.
    Adds ``rewards``, ``rewards_with_kl``, ``baseline`` (see ``_baseline``), ``advantages`` (token mean over
    the loss mask), ``init_policy_kl``, ``truncated_frac``, ``response_len``, ``loss_tokens`` (and
    ``rewards_scaled``, the mean of ``r``, when a transform is on) to ``state.metrics``.
    """
    action_mask, m = batch["action_mask"], state.metrics
    rewards = batch["rewards"].float()
    if cfg.reward_shaped:
        rewards = shape_rewards(rewards, batch, cfg)
    k, rows = cfg.num_generations_per_prompt, batch.batch_size[0]
    shaped, kl = rewards, None
    if cfg.kl_in_reward:
        kl = kernel(kl_penalty, cfg)(
            batch["logprobs"], batch["ref_logprobs"], cfg.kl_estimator,
            clamp=cfg.kl_clamp, input_clamp=cfg.kl_input_clamp,
        )
        seq_kl = torch.where(action_mask, kl, 0.0).sum(-1)
        if cfg.kl_reward_reduction == "mean":  # NeMo-Aligner: masked_mean over the response's tokens
            seq_kl = seq_kl / action_mask.sum(-1).clamp(min=1)
        shaped = rewards - cfg.kl_coef * seq_kl
    if kl is not None and cfg.adv_estimator in PER_TOKEN_REWARDS:
        token_level = token_rewards(rewards, action_mask, kl, cfg.kl_coef)
    else:  # the outcome estimators use the row sum only: r' on the last action token
        token_level = token_rewards(shaped, action_mask)
    inputs = {"reward_baselines": batch["reward_baselines"]} if cfg.adv_estimator == "remax" else {}
    adv, _ = ADVANTAGE_ESTIMATORS[cfg.adv_estimator](
        token_level, action_mask, group_size=k, global_sum=lambda t: all_reduce_sum(t, state.env),
        **inputs, **_estimator_kwargs(cfg),
    )
    truncated, loss_mask = truncated_rows(batch), truncation_mask(batch, cfg)
    if cfg.rloo_exclude_truncated:  # NeMo-Aligner: truncated rows out of the others' baselines
        baseline = rloo_baseline_ended(shaped, ~truncated, k)
        adv = torch.where(action_mask, (shaped - baseline)[:, None], 0.0).to(adv.dtype)
    else:
        baseline = _baseline(shaped, batch, cfg)
    batch["advantages"] = adv
    batch["loss_mask"] = loss_mask
    phases.add_batch_stats(m, batch)
    m.mean("rewards_with_kl", shaped.sum(), rows)
    m.mean("baseline", baseline.sum(), rows)
    m.mean("advantages", masked_sum(batch["advantages"], loss_mask), loss_mask.sum())
    m.mean("truncated_frac", truncated.float().sum(), rows)
    m.sum("loss_tokens", loss_mask.sum().float())
    if cfg.reward_shaped:
        m.mean("rewards_scaled", rewards.sum(), rows)
    return batch


def objective(
    state: State, micro: TensorDictBase, cfg: ReinforceConfig, den: Denominators
) -> tuple[torch.Tensor, dict]:
    """REINFORCE's loss on one microbatch, aggregated (``loss_agg``) over the minibatch's global counts of
    ``loss_mask``: the policy gradient of the group-baselined advantages, plus ``kl_loss_coef * KL(pi ||
    pi_ref)`` (GRPO). The policy gradient is ``cfg.policy_loss`` (``rlbits.POLICY_LOSSES``, called with
    ``cfg.policy_loss_args``); for ``vanilla`` (PPO's clipped surrogate) only when ``cfg.clipped``, and
    ``-A log pi`` (Williams 1992; the same gradient at ratio 1) otherwise. Any other loss runs on every pass:
    on the first pass over on-policy data its ratio is 1, so it moves off 1 only with ``num_iterations`` or
    ``num_minibatches`` > 1.

    Stats: ``actor_loss``, ``kl_loss`` (shares of the minibatch's values) and the loss-token means over the
    step of ``entropy`` and the loss's metrics (``phases.policy_loss_stats``): ``clipfrac`` (0 unclipped),
    ``approx_kl`` (k3 of KL(pi_old || pi) on the sampled tokens), and with a loss other than ``vanilla``
    the rest of its metrics (``ratio_mean``, ...).
    """
    mask, agg = micro["loss_mask"], den.agg(cfg.loss_agg, cfg.loss_scale_factor)
    logprobs, entropy = (x.float() for x in policy_logprobs(
        state.policy, micro, temperature=cfg.temperature, return_entropy=True, entropy_grad=False, **head_args(cfg)
    ))
    # a rollout correction: the trainer's recomputed old policy and the correction's weights (phases)
    old = micro["old_logprobs"] if "old_logprobs" in micro.keys() else micro["logprobs"]
    is_w = {"rollout_is_weights": micro["rollout_is_weights"]} if "rollout_is_weights" in micro.keys() else {}
    if cfg.clipped or cfg.policy_loss != "vanilla":
        pg_loss, ratio = kernel(POLICY_LOSSES[cfg.policy_loss], cfg)(
            logprobs, old, micro["advantages"], mask, **agg, **is_w, **cfg.policy_loss_args
        )
    else:  # the ratio is 1: clipfrac 0; approx_kl as ppo_loss's, the k3 estimate of KL(pi_old || pi)
        pg_loss, _ = kernel(reinforce_loss, cfg)(logprobs, micro["advantages"], mask, **agg, **is_w)
        ratio = {"approx_kl": masked_mean(kl_penalty(old, logprobs.detach(), "k3"), mask)}
    kl = torch.zeros(())
    if cfg.kl_loss_coef > 0:
        token_kl = kl_penalty(
            logprobs, micro["ref_logprobs"], cfg.kl_loss_estimator, clamp=cfg.kl_clamp, input_clamp=cfg.kl_input_clamp
        )
        kl = aggregate_loss(token_kl, mask, **agg)
    nll = torch.zeros(())
    if cfg.positive_example_nll_weight > 0:
        nll, _ = kernel(positive_example_nll_loss, cfg)(logprobs, mask, micro["rewards"])
    loss = (
        pg_loss  # policy_loss; vanilla: -A log pi, or -min(r A, clip(r) A) when clipped
        + cfg.kl_loss_coef * kl  # KL to the reference policy
        + cfg.positive_example_nll_weight * nll  # VAPO/NeMo-RL: NLL of the rows with reward > 0
    )
    w = mask.sum()
    means = {**phases.policy_loss_stats(ratio, cfg), "entropy": masked_mean(entropy, mask)}
    stats = {"actor_loss": pg_loss.detach(), "kl_loss": kl.detach(), **{k: (v * w, w) for k, v in means.items()}}
    if cfg.positive_example_nll_weight > 0:
        stats["positive_nll_loss"] = nll.detach()
    return loss, stats


def update(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 5: ``num_iterations`` x ``num_minibatches`` optimizer steps on ``objective``
    (``rlbits.loops.update.optimize``: whole groups shuffled with ``state.minibatch_generator``,
    ``microbatch_size``-row microbatches, denominators counted over ``loss_mask``). A batch with fewer
    groups than ``num_minibatches`` (dynamic sampling) has one minibatch per group; the count is agreed over
    ranks. The learning rate follows ``lr_scheduler`` over ``num_iterations * num_minibatches`` optimizer
    steps per step (``rlbits.loops.optim.scheduled``). Adds ``objective``'s stats and ``grad_norm`` (and ``lr``
    under a schedule; means over optimizer steps) to ``state.metrics``.

    Raises:
        NonFiniteError: a loss or gradient is not finite (on every rank; the policy is left untouched).
    """
    env = state.env
    state.policy.train()
    num_mb = min(cfg.num_minibatches, int(batch.batch_size[0]) // cfg.num_generations_per_prompt or 1)
    num_mb = -int(all_reduce_max(torch.tensor(-num_mb, device=env.device), env).item())  # the same on every rank
    per_step = cfg.num_iterations * cfg.num_minibatches
    lr = scheduled(cfg, cfg.learning_rate, state.step, per_step, run_length(state, cfg))
    optimize(
        state, batch, cfg, objective, trained=[Trained(state.policy, state.optimizer, lr=lr)], mask="loss_mask",
        epochs=cfg.num_iterations, num_minibatches=num_mb, shuffle=state.minibatch_generator,
    )
    return batch


validate = phases.validate_policy
"""Validation: mean reward of one response per test prompt (``rlbits.loops.phases.validate_policy``)."""

evaluate_run = phases.evaluate_run
"""``rlbits eval RUN_DIR``: the final policy's test-split reward next to the base model's."""

PHASES = (
    rollout, score, dynamic_sampling, greedy_baseline, reference, advantages, rollout_correction, update, validate
)
"""The phases of a step, in order (``validate``: the validation phase), each ``phase(state, batch, cfg) -> batch``."""


# --- the loop ----------------------------------------------------------------------------------------------


def produce(state: State, cfg: ReinforceConfig, phase: Callable[[str], Any]) -> TensorDictBase:
    """Phases 1-2c, the rollout side, with the policy as it is now; ``phase(name)``: the context each runs in
    (``Run.phase``; ``contextlib.nullcontext`` on a rollout rank)."""
    with phase("rollout"):  # 1. K responses per prompt
        batch = rollout(state, state.stream.next_batch(phases.generation_batch_size(cfg), state.env), cfg)
    with phase("score"):  # 2. sequence rewards
        batch = score(state, batch, cfg)
    with phase("rollout"):  # 2b. dynamic sampling: informative groups only, more batches
        batch = dynamic_sampling(state, batch, cfg)
    if cfg.adv_estimator == "remax":
        with phase("greedy"):  # 2c. ReMax: a greedy response per prompt, its reward the baseline
            batch = greedy_baseline(state, batch, cfg)
    return batch


def train(
    cfg: ReinforceConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False, reward: Callable | Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None,
) -> Path:
    """Run REINFORCE/RLOO/GRPO for ``cfg.max_num_steps`` steps and return the run directory.

    ``callbacks``, ``resume``, ``force``, ``reward``, ``prompts``, ``val_prompts``: as ``rlbits.train``
    (``rlbits.loops.online.online_run`` checks them and sets the run up).

    Raises:
        ConfigError: ``cfg`` is not a ``ReinforceConfig``, or not a valid one; as ``rlbits.train`` otherwise.
        NonFiniteError: a non-finite loss or gradient (names the step and phase).
    """
    if not isinstance(cfg, ReinforceConfig):
        raise ConfigError(f"cfg must be a ReinforceConfig, got {type(cfg).__name__}")
    if rank_role(cfg) == "rollout":  # async_mode: ranks: this rank only generates (docs/async.md)
        cfg.check()
        inputs = dict(reward=cfg.resolve_reward(reward), prompts=prompts, val_prompts=val_prompts)
        return serve_rollouts(cfg, init_state, lambda state: produce(state, cfg, contextlib.nullcontext), **inputs)
    with online_run(
        cfg, init_state, validate, reward=reward, prompts=prompts, val_prompts=val_prompts, callbacks=callbacks,
        resume=resume, force=force,
    ) as (run, state):

        for _ in run.steps(state):
            with run.step(state):
                batch = next_rollouts(state, cfg, lambda: produce(state, cfg, run.phase))  # 1-2c (async_mode)
                with run.phase("reference"):  # 3. reference logprobs
                    batch = reference(state, batch, cfg)
                with run.phase("advantages"):  # 4. the advantage estimator (group baseline, broadcast over tokens)
                    batch = advantages(state, batch, cfg)
                if cfg.rollout_correction_mode != "none":
                    with run.phase("rollout_correction"):  # 4b. old logprobs recomputed; IS weights, rejection
                        batch = rollout_correction(state, batch, cfg)
                with run.phase("update"):  # 5. policy-gradient (or clipped) steps
                    batch = update(state, batch, cfg)
                publish(state, cfg)  # async_mode: ranks: the new weights to the rollout rank
                run.end_step(state, batch)  # 6. log; validate and save when due
        stop_rollouts(state, cfg)
        return run.finish(state)  # RUN_DIR/final/: the policy


__all__ = [
    "ADV_ESTIMATORS",
    "GROUPED",
    "PER_TOKEN_REWARDS",
    "PHASES",
    "ReinforceConfig",
    "State",
    "advantages",
    "dynamic_sampling",
    "evaluate_run",
    "greedy_baseline",
    "init_state",
    "objective",
    "produce",
    "reference",
    "rollout",
    "rollout_correction",
    "score",
    "train",
    "update",
    "validate",
]
