"""REINFORCE with a group baseline: RLOO, GRPO, Dr. GRPO (and DAPO's dynamic sampling / clip-higher).

Algorithm (one step)::

    1. rollout     K = num_generations_per_prompt responses for each of num_prompts_per_step prompts
    2. score       sequence reward r_i per response
                   (dynamic_sampling: drop groups whose K rewards are all equal, generate more batches until
                   num_prompts_per_step informative groups are kept or dynamic_sampling_max_gen_batches ran)
    3. reference   log pi_ref of the sampled tokens (init_policy_kl; the KL penalty)
    4. advantages  r'_i = r_i - kl_coef * sum_t KL_t          (kl_in_reward; NeMo-Aligner RLOO)
                   A_i  = r'_i - mean_{j != i} r'_j           (rloo; Kool 2019, Ahmadian 2024)
                        = (r'_i - mean_g r') / (std_g r' + eps)  (grpo; Shao 2024)
                        = r'_i - mean_g r'                    (grpo_unscaled; Dr. GRPO, Liu 2025)
                        = r'_i                                (none: plain REINFORCE, Williams 1992)
                   broadcast over the response's action tokens (overlong_filtering: responses cut at
                   max_new_tokens without EOS get no loss tokens; DAPO, Yu 2025)
    5. update      ppo_epochs x num_minibatches optimizer steps (gradient accumulation over microbatches):
                   loss = pg_loss + kl_loss_coef * agg(KL_t(pi_theta || pi_ref))
                   pg_loss = reinforce_loss (-A log pi) when ppo_epochs == num_minibatches == 1, else
                   ppo_loss (clipped ratio, clip_eps / clip_eps_high: DAPO clip-higher)
    6. validate    test-split reward every val_period steps (greedy with val_greedy)
    7. save        checkpoint every save_period steps and at the end; RUN_DIR/final/ HF folder

Papers: Williams 1992 (REINFORCE); Kool 2019 "Buy 4 REINFORCE samples, get a baseline for free" and Ahmadian
2024 "Back to basics: revisiting REINFORCE-style optimization for learning from human feedback in LLMs"
(RLOO); Shao 2024 "DeepSeekMath" (GRPO); Liu 2025 "Understanding R1-Zero-like training" (Dr. GRPO); Yu 2025
"DAPO" (clip-higher, dynamic sampling, token-level loss, overlong filtering).

How rlbits departs from them (details in docs/reinforce.md):

- The sequence advantage is the same on every action token of a response (no per-token reward-to-go): with
  ``kl_in_reward`` the KL summed over the response is taken off the sequence reward *before* the baseline,
  so the penalty is baselined within the group too (NeMo-Aligner's REINFORCE trainer does the same with the
  per-token *mean* KL; TRL's RLOO trainer with the sum, as here).
- ``loss_agg`` defaults to DAPO's ``token-mean`` (GRPO's paper uses ``seq-mean-token-mean``).
- With ``ppo_epochs == num_minibatches == 1`` the importance ratio is 1 and the loss is plain REINFORCE
  (``reinforce_loss``); its gradient equals the clipped PPO loss's at ratio 1.
- Dynamic sampling stops after ``dynamic_sampling_max_gen_batches`` and trains on the informative groups it
  has (DAPO/verl generate until full or raise); if none is informative it trains on the last batch, where
  only the KL loss gives a gradient.

Launch (one process, or N data-parallel FSDP2 ranks with ``torchrun``; docs/scaling.md)::

    rlbits train configs/rloo_arithmetic.yaml
    torchrun --nproc_per_node 2 -m rlbits train configs/rloo_arithmetic.yaml     # or, in a notebook:
    from rlbits.loops.reinforce import ReinforceConfig, train
    train(ReinforceConfig(task="arithmetic", max_num_steps=50, run_dir="runs/rloo"))

Metrics (metrics.jsonl, one line per step; see docs/reinforce.md): ``rewards``, ``rewards_with_kl``,
``gen_rewards``, ``baseline``, ``advantages``, ``init_policy_kl``, ``kl_loss``, ``actor_loss``,
``clipfrac``, ``approx_kl``, ``entropy``, ``grad_norm``, ``response_len``, ``truncated_frac``,
``zero_std_frac``, ``kept_groups``, ``gen_batches``, ``loss_tokens``, ``epoch``, ``consumed_samples``,
``tokens_per_s``, ``time/<phase>``, and ``val_reward`` (+ ``val_reward_std``, ``val_response_len``) on
validation steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDictBase

from rlbits.batch import collate, split_microbatches, split_minibatches
from rlbits.distributed.checkpoint import (
    export_model,
    hf_folder,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import unsharded
from rlbits.distributed.reduce import all_reduce_max, any_rank, global_count, reduce_metrics
from rlbits.functional import (
    KL_ESTIMATORS,
    aggregate_loss,
    group_normalize,
    kl_penalty,
    masked_mean,
    ppo_loss,
    reinforce_loss,
    rloo_baseline,
)
from rlbits.loops import common
from rlbits.loops.config import ConfigError, RunConfig
from rlbits.loops.data import PromptStream
from rlbits.loops.run import Run
from rlbits.models.forward import policy_logprobs
from rlbits.models.load import load_pretrained
from rlbits.tasks import get_task

BASELINES = ("rloo", "grpo", "grpo_unscaled", "none")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclasses.dataclass(frozen=True)
class ReinforceConfig(RunConfig):
    """REINFORCE / RLOO / GRPO: group-baselined policy gradient, optional PPO-style clipping (see module doc)."""

    loop: str = "reinforce"
    """Which loop runs this config (``reinforce``)."""
    num_generations_per_prompt: int = 4
    """K responses per prompt (>= 2 for the rloo/grpo baselines); a prompt's K responses form its group."""
    learning_rate: float = 1e-5
    """Adam learning rate of the policy."""
    baseline: Literal["rloo", "grpo", "grpo_unscaled", "none"] = "rloo"
    """``rloo``: r - mean of the other K-1 rewards; ``grpo``: (r - group mean) / (group std + eps);
    ``grpo_unscaled``: r - group mean (Dr. GRPO); ``none``: r itself (plain REINFORCE)."""
    grpo_eps: float = 1e-6
    """Added to the group std by the ``grpo`` baseline."""
    kl_in_reward: bool = False
    """Subtract ``kl_coef * sum_t KL_t`` from each sequence reward before the baseline (NeMo-Aligner RLOO)."""
    kl_coef: float = 0.0
    """KL coefficient of the reward penalty; must be > 0 with ``kl_in_reward`` and 0 without it."""
    kl_estimator: Literal["k1", "abs", "k2", "k3"] = "k1"
    """Per-token KL estimator of the reward penalty (``rlbits.kl_penalty``)."""
    kl_loss_coef: float = 0.0
    """Weight of a KL(pi_theta || pi_ref) term added to the loss (GRPO: 0.04 with k3); 0 disables it."""
    kl_loss_estimator: Literal["k1", "abs", "k2", "k3"] = "k3"
    """Per-token KL estimator of the loss term (GRPO uses ``k3``)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch; > 1 (or num_minibatches > 1) switches to the clipped PPO loss."""
    num_minibatches: int = 1
    """Optimizer steps per epoch; whole groups are dealt into minibatches after a seeded shuffle."""
    clip_eps: float = 0.2
    """Lower clip range of the importance ratio (and upper, unless clip_eps_high) when clipping is active."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO clip-higher, e.g. 0.28); None = clip_eps."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number: ``token-mean`` (DAPO), ``seq-mean-token-mean`` (GRPO paper),
    ``seq-mean-token-sum``."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no signal) and generate more until num_prompts_per_step
    informative groups are kept (DAPO)."""
    dynamic_sampling_max_gen_batches: int = 4
    """Most generation batches (of num_prompts_per_step prompts each) one step may use with dynamic_sampling."""
    overlong_filtering: bool = False
    """Mask responses that hit max_new_tokens without EOS out of the loss (DAPO overlong filtering)."""

    def validate(self) -> None:
        """Shared checks plus the REINFORCE ones. Raises ConfigError naming the field."""
        super().validate()
        if self.loop != "reinforce":
            raise ConfigError(f"loop must be 'reinforce' for ReinforceConfig, got {self.loop!r}")
        if self.baseline not in BASELINES:
            raise ConfigError(f"baseline must be one of {', '.join(BASELINES)}; got {self.baseline!r}")
        if self.baseline != "none" and self.num_generations_per_prompt < 2:
            raise ConfigError(
                f"num_generations_per_prompt must be >= 2 for baseline={self.baseline!r} (a group needs other "
                f"samples), got {self.num_generations_per_prompt}"
            )
        if self.dynamic_sampling and self.num_generations_per_prompt < 2:
            raise ConfigError(
                "dynamic_sampling needs num_generations_per_prompt >= 2 (a reward spread per group)"
            )
        for name in ("kl_estimator", "kl_loss_estimator"):
            if getattr(self, name) not in KL_ESTIMATORS:
                raise ConfigError(
                    f"{name} must be one of {', '.join(KL_ESTIMATORS)}; got {getattr(self, name)!r}"
                )
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ConfigError(
                f"loss_agg must be one of {', '.join(LOSS_AGGREGATIONS)}; got {self.loss_agg!r}"
            )
        if self.kl_coef < 0 or self.kl_loss_coef < 0:
            raise ConfigError(
                f"kl_coef and kl_loss_coef must be >= 0, got {self.kl_coef} and {self.kl_loss_coef}"
            )
        if self.kl_in_reward and self.kl_coef == 0:
            raise ConfigError(
                "kl_in_reward=true needs kl_coef > 0 (the weight of the KL taken off the reward)"
            )
        if not self.kl_in_reward and self.kl_coef > 0:
            raise ConfigError(
                f"kl_coef={self.kl_coef} has no effect with kl_in_reward=false; set kl_in_reward=true, or use "
                "kl_loss_coef for a KL term in the loss"
            )
        if self.ppo_epochs < 1 or self.num_minibatches < 1 or self.dynamic_sampling_max_gen_batches < 1:
            raise ConfigError(
                "ppo_epochs, num_minibatches and dynamic_sampling_max_gen_batches must be >= 1, got "
                f"{self.ppo_epochs}, {self.num_minibatches}, {self.dynamic_sampling_max_gen_batches}"
            )
        if self.num_minibatches > self.num_prompts_per_step:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must be <= num_prompts_per_step "
                f"({self.num_prompts_per_step}): minibatches hold whole groups"
            )
        if self.clip_eps < 0 or (self.clip_eps_high is not None and self.clip_eps_high < 0):
            raise ConfigError(
                f"clip_eps and clip_eps_high must be >= 0, got {self.clip_eps} and {self.clip_eps_high}"
            )
        if not self.grpo_eps >= 0:
            raise ConfigError(f"grpo_eps must be >= 0, got {self.grpo_eps}")

    @property
    def clipped(self) -> bool:
        """Whether the update uses the clipped PPO loss (the ratio can move off 1 only with several updates)."""
        return self.ppo_epochs > 1 or self.num_minibatches > 1


@dataclasses.dataclass
class State:
    """Everything a step changes or reads besides the config: models, optimizer, RNG streams, counters."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    sampler: torch.Generator
    """Sampling noise of the rollouts (on the policy's device)."""
    shuffler: torch.Generator
    """Minibatch shuffles (CPU)."""
    stream: PromptStream
    step: int = 0
    total_valid_tokens: int = 0
    val_reward: float | None = None


# --- set-up ----------------------------------------------------------------------------------------------


def init_state(
    cfg: ReinforceConfig,
    env: DistEnv,
    *,
    resume_from: str | Path | None = None,
    prompts: Sequence[str] | None = None,
) -> State:
    """Load the policy (from ``resume_from/policy`` when resuming) and a frozen reference, build the optimizer,
    the generators and the prompt stream, and restore optimizer, RNG states and counters from the checkpoint."""
    init_path = common.policy_path(cfg)
    policy, tokenizer = common.load_policy_and_tokenizer(str(hf_folder(resume_from, "policy") or init_path), env)
    reference, _ = common.load_policy_and_tokenizer(init_path, env)
    reference.eval().requires_grad_(False)
    policy.train()
    policy, reference = common.prepare(policy, cfg, env), common.prepare(reference, cfg, env)
    optimizer = common.make_optimizer(policy.parameters(), cfg.learning_rate, cfg.weight_decay)
    sampler = torch.Generator(device=env.device).manual_seed(cfg.seed + 1000 * env.rank)
    shuffler = torch.Generator().manual_seed(cfg.seed + 1)
    train_prompts = list(prompts) if prompts is not None else get_task(cfg.task).prompts("train")
    state = State(
        policy, reference, tokenizer, optimizer, sampler, shuffler, PromptStream(train_prompts, cfg.seed)
    )
    if resume_from is not None:
        saved = load_checkpoint(
            resume_from,
            models={"policy": policy},
            optimizers={"policy": optimizer},
            generators={"sampler": sampler, "shuffler": shuffler},
            env=env,
        )
        state.stream.consumed_samples = saved["consumed_samples"]
        state.step = saved["current_step"]
        state.total_valid_tokens = saved["total_valid_tokens"]
        state.val_reward = saved.get("val_reward")
    return state


# --- 1-2. rollout and score (with dynamic sampling) ------------------------------------------------------


def rollout(state: State, cfg: ReinforceConfig, prompts: Sequence[str]) -> TensorDictBase:
    """Phase 1: K responses per prompt at ``cfg.temperature`` (groups contiguous), behaviour logprobs."""
    with common.autocast(state.policy, cfg):
        return common.rollout(
            state.policy,
            state.tokenizer,
            prompts,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            num_samples=cfg.num_generations_per_prompt,
            generator=state.sampler,
        )


def score(batch: TensorDictBase, reward: Any) -> torch.Tensor:
    """Phase 2: ``rewards`` [B] from ``reward`` (callable, reward model or server URL)."""
    return common.score_rollout(batch, reward)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G] bool: True for groups whose K rewards are not all equal (they carry a learning signal)."""
    groups = rewards.view(-1, group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)


def sample_batch(
    state: State, cfg: ReinforceConfig, reward: Any, env: DistEnv | None = None
) -> tuple[TensorDictBase, dict[str, float]]:
    """Phases 1-2: generate and score one batch; with ``cfg.dynamic_sampling``, keep only informative groups
    and generate more batches until ``num_prompts_per_step`` groups are kept or the batch budget is spent.

    Under torchrun each rank takes its ``num_prompts_per_step`` prompts of every draw of
    ``num_prompts_per_step * world_size`` (whole groups stay on one rank), and every rank draws until no
    rank needs more, so the prompt stream stays in step across ranks.

    Returns:
        ``(batch, stats)``: the training batch (its groups contiguous, ``group`` renumbered) and
        ``gen_batches``, ``kept_groups``, and over every generated response ``zero_std_frac`` (groups),
        ``gen_rewards`` (mean reward) and ``gen_tokens`` (action tokens).
    """
    env = env or DistEnv()
    k, n = cfg.num_generations_per_prompt, cfg.num_prompts_per_step
    max_batches = cfg.dynamic_sampling_max_gen_batches if cfg.dynamic_sampling else 1
    kept: list[TensorDictBase] = []
    n_kept = n_groups = n_zero = n_gen = 0
    reward_sum = 0.0
    gen_tokens = 0
    last = None
    for _ in range(max_batches):
        prompts = state.stream.next(n * env.world_size)[env.rank * n : (env.rank + 1) * n]
        if cfg.dynamic_sampling and n_kept >= n:  # this rank is full; others still draw
            with common.agreed(env, cfg.on_nonfinite == "skip"):  # the collective the others run in score
                pass
            if all_reduce_max(torch.tensor(0, device=env.device), env).item() == 0:
                break
            continue
        batch = rollout(state, cfg, prompts)
        with common.agreed(env, cfg.on_nonfinite == "skip"), common.in_phase(state.step + 1, "score"):
            rewards = score(batch, reward)
        n_gen += 1
        reward_sum += rewards.sum().item()
        gen_tokens += int(batch["action_mask"].sum())
        last = batch
        if k >= 2:
            mask = informative_groups(rewards, k)
            n_groups += mask.numel()
            n_zero += int((~mask).sum())
        if not cfg.dynamic_sampling:
            kept.append(batch)
            n_kept = cfg.num_prompts_per_step
            break
        need = cfg.num_prompts_per_step - n_kept
        keep = mask.nonzero().flatten()[:need]
        if keep.numel():
            rows = (keep[:, None] * k + torch.arange(k, device=keep.device)).flatten()
            kept.append(batch[rows])
            n_kept += keep.numel()
        if all_reduce_max(torch.tensor(n - min(n_kept, n), device=env.device), env).item() == 0:
            break
    if not kept:  # no informative group at all: train on the last batch (only a KL loss can move it)
        kept = [last]
    out = collate(kept, pad_token_id=state.tokenizer.pad_token_id) if len(kept) > 1 else kept[0]
    stats = {
        "gen_batches": float(n_gen),
        "kept_groups": float(n_kept),
        "zero_std_frac": n_zero / n_groups if n_groups else 0.0,
        "gen_rewards": reward_sum / (n_gen * cfg.rollout_batch_size),
        "gen_tokens": float(gen_tokens),
    }
    return out, stats


# --- 3. reference ----------------------------------------------------------------------------------------


def reference(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> torch.Tensor:
    """Phase 3: ``ref_logprobs`` [B, R] of the sampled tokens under the frozen initial policy."""
    with unsharded(state.reference), common.autocast(state.reference, cfg):
        return common.reference_logprobs(
            state.reference, batch, temperature=cfg.temperature, microbatch_size=cfg.microbatch_size
        )


# --- 4. advantages ---------------------------------------------------------------------------------------


def advantages(batch: TensorDictBase, cfg: ReinforceConfig) -> dict[str, torch.Tensor]:
    """Phase 4: ``advantages`` [B, R] and ``loss_mask`` [B, R] from ``rewards``, ``logprobs``, ``ref_logprobs``.

    ``r' = r - kl_coef * sum_t KL_t`` (with ``kl_in_reward``), the sequence advantage ``A = r' - baseline``
    (or the group-normalised ``r'``), broadcast over action tokens; ``loss_mask = action_mask`` without the
    truncated responses when ``overlong_filtering``.

    Returns:
        Metrics: ``rewards``, ``rewards_with_kl``, ``baseline``, ``advantages`` (token mean over the loss mask),
        ``init_policy_kl``, ``truncated_frac``, ``response_len``, ``loss_tokens`` (detached 0-dim tensors).
    """
    action_mask = batch["action_mask"]
    rewards = batch["rewards"].float()
    k = cfg.num_generations_per_prompt
    shaped = rewards
    if cfg.kl_in_reward:
        kl = common.kernel(kl_penalty, cfg)(batch["logprobs"], batch["ref_logprobs"], cfg.kl_estimator)
        shaped = rewards - cfg.kl_coef * torch.where(action_mask, kl, 0.0).sum(-1)
    if cfg.baseline == "rloo":
        baseline = rloo_baseline(shaped, k)
        seq_adv = shaped - baseline
    elif cfg.baseline in ("grpo", "grpo_unscaled"):
        baseline = shaped.view(-1, k).mean(dim=1).repeat_interleave(k)
        seq_adv = group_normalize(shaped, k, scale=cfg.baseline == "grpo", eps=cfg.grpo_eps)
    else:
        baseline = torch.zeros_like(shaped)
        seq_adv = shaped
    truncated = (
        batch["truncated"] if "truncated" in batch.keys() else torch.zeros_like(rewards, dtype=torch.bool)
    )
    loss_mask = action_mask & ~truncated[:, None] if cfg.overlong_filtering else action_mask
    batch["advantages"] = torch.where(action_mask, seq_adv[:, None], 0.0)
    batch["loss_mask"] = loss_mask
    lengths = action_mask.sum(-1).float()
    return {
        "rewards": rewards.mean(),
        "rewards_with_kl": shaped.mean(),
        "baseline": baseline.mean(),
        "advantages": masked_mean(batch["advantages"], loss_mask),
        "init_policy_kl": common.kl_per_sequence(batch["logprobs"], batch["ref_logprobs"], action_mask),
        "truncated_frac": truncated.float().mean(),
        "response_len": lengths.mean(),
        "response_len_max": lengths.max(),
        "loss_tokens": loss_mask.sum().float(),
    }


# --- 5. update -------------------------------------------------------------------------------------------


def policy_gradient_loss(
    logprobs: torch.Tensor,
    micro: TensorDictBase,
    cfg: ReinforceConfig,
    num_tokens: torch.Tensor,
    num_seqs: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient term of one microbatch: ``ppo_loss`` when ``cfg.clipped``, else ``reinforce_loss``
    (plus ``clipfrac`` 0 and the same ``approx_kl`` so both report the same metrics)."""
    mask = micro["loss_mask"]
    agg = dict(agg=cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    if cfg.clipped:
        loss, m = common.kernel(ppo_loss, cfg)(
            logprobs, micro["logprobs"], micro["advantages"], mask, cfg.clip_eps, cfg.clip_eps_high, **agg
        )
        return loss, {"clipfrac": m["clipfrac"], "approx_kl": m["approx_kl"]}
    loss, _ = common.kernel(reinforce_loss, cfg)(logprobs, micro["advantages"], mask, **agg)
    # ppo_loss's approx_kl: the k3 estimate of KL(pi_old || pi_theta) on the sampled tokens.
    approx_kl = masked_mean(kl_penalty(micro["logprobs"], logprobs.detach(), "k3"), mask)
    return loss, {"clipfrac": torch.zeros(()), "approx_kl": approx_kl}


def update(
    state: State, batch: TensorDictBase, cfg: ReinforceConfig, env: DistEnv
) -> dict[str, torch.Tensor]:
    """Phase 5: ``ppo_epochs`` x ``num_minibatches`` optimizer steps, gradients accumulated over microbatches.

    Each minibatch's loss is normalised by its global loss-token (or sequence) count, so microbatching gives
    the gradient of one big batch. Raises FloatingPointError naming the step if a loss or gradient is not
    finite (the update is skipped, nothing is saved).

    Returns:
        ``actor_loss`` and ``kl_loss`` (each minibatch's aggregated loss, averaged over minibatches and
        epochs), token-weighted means over microbatches of ``clipfrac``, ``approx_kl``, ``entropy``, and
        ``grad_norm`` (mean over optimizer steps, before clipping).
    """
    policy = state.policy
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    num_mb = min(cfg.num_minibatches, int(batch.batch_size[0]) // cfg.num_generations_per_prompt or 1)
    num_mb = -int(all_reduce_max(torch.tensor(-num_mb, device=env.device), env).item())  # the same on every rank
    sums: dict[str, torch.Tensor] = {}
    token_total = torch.zeros(())
    losses, kl_losses, norms = [], [], []

    def add(name: str, value: torch.Tensor, weight: torch.Tensor) -> None:
        sums[name] = sums.get(name, torch.zeros(())) + value.detach().float().cpu() * weight

    for _ in range(cfg.ppo_epochs):
        for minibatch in split_minibatches(batch, num_mb, generator=state.shuffler, keep_groups=True):
            num_tokens = global_count(minibatch["loss_mask"], env).clamp(min=1)
            num_seqs = global_count(minibatch["loss_mask"].any(-1), env).clamp(min=1)
            mb_loss, mb_kl = torch.zeros(()), torch.zeros(())
            for micro in common.pad_microbatches(list(split_microbatches(minibatch, cfg.microbatch_size)), env):
                mask = micro["loss_mask"]
                with common.autocast(policy, cfg):
                    logprobs, entropy = policy_logprobs(
                        policy, micro, temperature=cfg.temperature, return_entropy=True
                    )
                logprobs, entropy = logprobs.float(), entropy.float()
                loss, metrics = policy_gradient_loss(logprobs, micro, cfg, num_tokens, num_seqs)
                kl_loss = torch.zeros(())
                if cfg.kl_loss_coef > 0:
                    kl = kl_penalty(logprobs, micro["ref_logprobs"], cfg.kl_loss_estimator)
                    kl_loss = aggregate_loss(kl, mask, cfg.loss_agg, num_tokens, num_seqs)
                    loss = loss + cfg.kl_loss_coef * kl_loss
                if any_rank(~torch.isfinite(loss.detach()), env):  # every rank raises together
                    policy.zero_grad(set_to_none=True)
                    raise FloatingPointError(
                        f"step {state.step + 1}, phase update: the loss is {loss.item()}"
                    )
                loss.backward()
                weight = mask.sum().float().cpu()
                token_total = token_total + weight
                mb_loss = mb_loss + loss.detach().cpu()
                mb_kl = mb_kl + kl_loss.detach().cpu()
                add("clipfrac", metrics["clipfrac"], weight)
                add("approx_kl", metrics["approx_kl"], weight)
                add("entropy", masked_mean(entropy.detach(), mask), weight)
            try:
                norms.append(common.clip_and_step(params, state.optimizer, cfg.max_grad_norm).cpu())
            except FloatingPointError as e:
                raise FloatingPointError(f"step {state.step + 1}, phase update: {e}") from e
            losses.append(mb_loss)
            kl_losses.append(mb_kl)
    out = {name: value / token_total.clamp(min=1) for name, value in sums.items()}
    out["actor_loss"] = torch.stack(losses).mean()
    out["kl_loss"] = torch.stack(kl_losses).mean()
    out["grad_norm"] = torch.stack(norms).float().mean()
    return out


# --- 6-7. validate and save ------------------------------------------------------------------------------


def validate(
    state: State, cfg: ReinforceConfig, reward: Any = None, env: DistEnv | None = None
) -> tuple[dict[str, float], TensorDictBase]:
    """Phase 6: mean test-split reward (``val_reward``) with the validation generator (greedy if val_greedy)."""
    return common.validate(state.policy, state.tokenizer, cfg, reward=reward, env=env)


def save(state: State, cfg: ReinforceConfig, env: DistEnv | None = None) -> Path:
    """Phase 7: checkpoint ``RUN_DIR/checkpoints/step_N`` (policy, optimizer, generators, counters; every rank
    calls it)."""
    path = save_checkpoint(
        cfg.run_dir,
        state.step,
        models={"policy": state.policy},
        optimizers={"policy": state.optimizer},
        generators={"sampler": state.sampler, "shuffler": state.shuffler},
        tokenizer=state.tokenizer,
        keep=cfg.keep_checkpoints,
        env=env,
        state={
            "consumed_samples": state.stream.consumed_samples,
            "current_step": state.step,
            "current_epoch": state.stream.epoch,
            "total_steps": cfg.max_num_steps,
            "total_valid_tokens": state.total_valid_tokens,
            "val_reward": state.val_reward,
        },
    )
    return path


def export(state: State, cfg: ReinforceConfig, env: DistEnv | None = None) -> Path | None:
    """The trained policy and its tokenizer as ``RUN_DIR/final/`` (``from_pretrained`` loads it), written by
    rank 0 (every rank calls it)."""
    return export_model(
        state.policy, Path(cfg.run_dir) / "final", tokenizer=state.tokenizer, env=env,
        build=lambda: load_pretrained(common.policy_path(cfg))[0],
    )  # fmt: skip


# --- one step and the loop ---------------------------------------------------------------------------------


def train_step(
    state: State, cfg: ReinforceConfig, env: DistEnv, reward: Any
) -> tuple[dict[str, float], TensorDictBase]:
    """Phases 1-5 for one step; advances ``state.step``. Returns the step's metrics (floats) and its batch."""
    timer = common.PhaseTimer()
    t0 = time.perf_counter()
    with timer("rollout"):
        batch, sampling = sample_batch(state, cfg, reward, env)
    with timer("reference"):
        reference(state, batch, cfg)
    with timer("advantages"):
        metrics: dict[str, Any] = advantages(batch, cfg)
    with timer("update"):
        metrics.update(update(state, batch, cfg, env))
    state.step += 1
    state.total_valid_tokens += int(global_count(batch["action_mask"], env).item())
    metrics.update(sampling)
    metrics = reduce_metrics(metrics, env)
    metrics.update(timer.metrics())
    metrics["tokens_per_s"] = metrics.pop("gen_tokens") / max(time.perf_counter() - t0, 1e-9)
    metrics["epoch"] = float(state.stream.epoch)
    metrics["consumed_samples"] = float(state.stream.consumed_samples)
    return metrics, batch


def train(
    cfg: ReinforceConfig,
    *,
    callbacks: Sequence[Any] = (),
    resume: bool = False,
    reward: Callable | Any = None,
    prompts: Sequence[str] | None = None,
) -> Path:
    """Run REINFORCE/RLOO/GRPO for ``cfg.max_num_steps`` steps and return the run directory.

    Args:
        cfg: the config (validated again here).
        callbacks: objects with ``on_metrics`` / ``on_samples`` / ``should_stop`` (see ``rlbits.loops.run``).
        resume: continue from ``latest_checkpoint(cfg.run_dir)``; the run then matches the uninterrupted one.
        reward: overrides the task reward (anything ``rlbits.score`` accepts).
        prompts: overrides the task's train prompts.

    Raises:
        ConfigError: an invalid config. FileNotFoundError: ``resume`` without a checkpoint.
        FloatingPointError: a non-finite loss or gradient (names the step and phase).
    """
    if not isinstance(cfg, ReinforceConfig):
        raise TypeError(f"cfg must be a ReinforceConfig, got {type(cfg).__name__}")
    cfg.validate()
    ckpt = resume_checkpoint(cfg.run_dir, missing_ok=True) if resume else None
    env = common.setup(cfg)
    state = init_state(cfg, env, resume_from=ckpt, prompts=prompts)
    task_reward = reward if reward is not None else get_task(cfg.task).reward
    run = Run(
        cfg, env, callbacks=callbacks, resume=resume, total_steps=cfg.max_num_steps, start_step=state.step
    )
    run.install_signal_handlers()
    try:
        if cfg.val_at_start and state.step == 0:
            val, _ = validate(state, cfg, reward, env)
            state.val_reward = val["val_reward"]
            run.log(0, val)
        saved_step = state.step if ckpt is not None else -1
        while state.step < cfg.max_num_steps and state.stream.epoch < cfg.max_num_epochs:
            try:
                metrics, batch = train_step(state, cfg, env, task_reward)
            except common.SKIPPABLE as e:
                if cfg.on_nonfinite != "skip":
                    raise
                state.step += 1
                run.log(state.step, common.skipped_step(e, state.step))
                continue
            stop = run.should_stop
            last = stop or state.step >= cfg.max_num_steps or state.stream.epoch >= cfg.max_num_epochs
            if (cfg.val_period and state.step % cfg.val_period == 0) or (last and cfg.val_at_end):
                t0 = time.perf_counter()
                val, _ = validate(state, cfg, reward, env)
                state.val_reward = val["val_reward"]
                metrics.update(val)
                metrics["time/validate"] = time.perf_counter() - t0
            run.log(state.step, metrics)
            run.log_samples(state.step, common.sample_rows(batch, cfg.log_samples))
            run.progress(state.step, reward=metrics["rewards"], kl=metrics["init_policy_kl"])
            if last:
                break
            if cfg.save_period and state.step % cfg.save_period == 0:
                save(state, cfg, env)
                saved_step = state.step
        if saved_step != state.step:
            save(state, cfg, env)
        export(state, cfg, env)
    finally:
        run.close()
    return Path(cfg.run_dir)


__all__ = [
    "BASELINES",
    "ReinforceConfig",
    "State",
    "advantages",
    "export",
    "informative_groups",
    "init_state",
    "policy_gradient_loss",
    "reference",
    "rollout",
    "sample_batch",
    "save",
    "score",
    "train",
    "train_step",
    "update",
    "validate",
]
