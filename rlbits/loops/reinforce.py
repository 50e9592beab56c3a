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
                        = r'_i - mean_g r'                    (dr_grpo; Dr. GRPO, Liu 2025)
                        = r'_i                                (none: plain REINFORCE, Williams 1992)
                   broadcast over the response's action tokens (overlong_filtering: responses cut at
                   max_new_tokens without EOS get no loss tokens; DAPO, Yu 2025)
    5. update      num_iterations x num_minibatches optimizer steps (gradient accumulation over microbatches):
                   loss = pg_loss + kl_loss_coef * agg(KL_t(pi_theta || pi_ref))
                   pg_loss = reinforce_loss (-A log pi) when num_iterations == num_minibatches == 1, else
                   ppo_loss (clipped ratio, clip_eps / clip_eps_high: DAPO clip-higher)
    6. log, validate (test-split reward every val_period steps) and save (rlbits.loops.run.Run)

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
- With ``num_iterations == num_minibatches == 1`` the importance ratio is 1 and the loss is plain REINFORCE
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
``zero_std_frac``, ``kept_groups``, ``gen_batches``, ``loss_tokens``, ``epoch``,
``tokens_per_s``, ``time/<phase>``, and ``val_reward`` (+ ``val_reward_std``, ``val_response_len``) on
validation steps.
"""


from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import einops
import torch
from tensordict import TensorDictBase

from rlbits.batch import collate, split_microbatches, split_minibatches
from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import unsharded
from rlbits.distributed.reduce import all_reduce_max, any_rank, global_count
from rlbits.functional import (
    aggregate_loss,
    group_normalize,
    kl_penalty,
    masked_mean,
    masked_sum,
    ppo_loss,
    reinforce_loss,
    rloo_baseline,
)
from rlbits.loops import phases
from rlbits.loops.config import MAX_ROWS, ConfigError, RunConfig, check_ranges
from rlbits.loops.optim import clip_and_step, make_optimizer, pad_microbatches
from rlbits.loops.run import NonFiniteError, Run, agreed, in_phase
from rlbits.loops.runtime import (
    autocast,
    build_policy,
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
from rlbits.models.forward import policy_logprobs
from rlbits.models.load import freeze
from rlbits.tasks import get_task

BASELINES = ("rloo", "grpo", "dr_grpo", "grpo_unscaled", "none")


@dataclasses.dataclass(frozen=True)
class ReinforceConfig(RunConfig):
    """REINFORCE / RLOO / GRPO: group-baselined policy gradient, optional PPO-style clipping (see module doc)."""

    RENAMED: ClassVar[dict[str, str]] = {"ppo_epochs": "num_iterations"}
    """Config keys of earlier releases, still read (with a DeprecationWarning)."""
    SIZE_LIMITS: ClassVar[dict[str, int]] = {
        "num_minibatches": MAX_ROWS, "dynamic_sampling_max_gen_batches": 1024,
    }  # fmt: skip

    loop: str = "reinforce"
    """Which loop runs this config (``reinforce``)."""
    num_generations_per_prompt: int = 4
    """K responses per prompt (>= 2 for the rloo/grpo baselines); a prompt's K responses form its group."""
    learning_rate: float = 1e-5
    """Adam learning rate of the policy."""
    baseline: Literal["rloo", "grpo", "dr_grpo", "grpo_unscaled", "none"] = "rloo"
    """``rloo``: r - mean of the other K-1 rewards; ``grpo``: (r - group mean) / (group std + eps);
    ``dr_grpo``: r - group mean (Dr. GRPO, Liu 2025; ``grpo_unscaled`` is its earlier name); ``none``: r itself (plain REINFORCE)."""
    grpo_eps: float = 1e-6
    """Added to the group std by the ``grpo`` baseline."""
    kl_in_reward: bool = False
    """Subtract ``kl_coef * sum_t KL_t`` from each sequence reward before the baseline (NeMo-Aligner RLOO)."""
    kl_coef: float = 0.0
    """KL coefficient of the reward penalty; must be > 0 with ``kl_in_reward`` and 0 without it."""
    kl_estimator: Literal["k1", "abs", "k2", "k3", "k1+", "k3+"] = "k1"
    """Per-token KL estimator of the reward penalty (``rlbits.kl_penalty``)."""
    kl_loss_coef: float = 0.0
    """Weight of a KL(pi_theta || pi_ref) term added to the loss (GRPO: 0.04 with k3); 0 disables it."""
    kl_loss_estimator: Literal["k1", "abs", "k2", "k3", "k1+", "k3+"] = "k3"
    """Per-token KL estimator of the loss term (GRPO uses ``k3``)."""
    kl_clamp: float | None = None
    """Clamp each token's KL estimate to [-kl_clamp, kl_clamp] (verl, OpenRLHF and NeMo-RL clamp at 10); None = no clamp."""
    num_iterations: int = 1
    """Passes over each rollout batch (TRL's ``num_iterations``, mu in the GRPO paper); > 1 (or num_minibatches > 1) switches to the clipped PPO loss."""
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
    monitor_init_policy_kl: bool = False
    """Run the reference forward only to log ``init_policy_kl`` when no term uses ``ref_logprobs`` (no ``kl_in_reward``, ``kl_loss_coef`` 0); without it the reference model is then neither loaded nor run (as TRL's GRPO with ``beta=0``)."""

    def check(self) -> None:
        """Shared checks plus the REINFORCE ones. Raises ConfigError naming the field."""
        super().check()
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
        check_ranges(
            self, at_least_one=("num_iterations", "num_minibatches", "dynamic_sampling_max_gen_batches"),
            non_negative=("kl_coef", "kl_loss_coef", "clip_eps", "grpo_eps"), positive_or_none=("clip_eps_high", "kl_clamp"),
        )  # fmt: skip
        if self.kl_in_reward and self.kl_coef == 0:
            raise ConfigError(
                "kl_in_reward=true needs kl_coef > 0 (the weight of the KL taken off the reward)"
            )
        if not self.kl_in_reward and self.kl_coef > 0:
            raise ConfigError(
                f"kl_coef={self.kl_coef} has no effect with kl_in_reward=false; set kl_in_reward=true, or use "
                "kl_loss_coef for a KL term in the loss"
            )
        if self.num_minibatches > self.num_prompts_per_step:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must be <= num_prompts_per_step "
                f"({self.num_prompts_per_step}): minibatches hold whole groups"
            )

    @property
    def uses_ref_logprobs(self) -> bool:
        """Whether the reference model is loaded and run: a KL term in the reward or the loss uses
        ``ref_logprobs``, or ``monitor_init_policy_kl`` asks for the metric."""
        return self.kl_in_reward or self.kl_loss_coef > 0 or self.monitor_init_policy_kl

    @property
    def ppo_epochs(self) -> int:
        """Earlier name of ``num_iterations`` (read-only; as a config key it is still read, renamed)."""
        return self.num_iterations

    @property
    def clipped(self) -> bool:
        """Whether the update uses the clipped PPO loss (the ratio can move off 1 only with several updates)."""
        return self.num_iterations > 1 or self.num_minibatches > 1



@dataclasses.dataclass(kw_only=True)
class State(OnlineState):
    """Everything a REINFORCE run carries from step to step, saved as a whole (``rlbits.loops.state``)."""

    policy: torch.nn.Module
    reference: torch.nn.Module | None = frozen(default=None)
    """Frozen initial policy (``init_policy_kl``, the KL terms); None when no term uses it
    (``cfg.uses_ref_logprobs``) and with LoRA, whose reference is the policy with its adapters disabled
    (``phases.reference_model``)."""
    optimizer: torch.optim.Optimizer = optimizer_of("policy")
    """AdamW over the parameters that train: all of the policy's, or only its LoRA adapters."""


def init_state(
    cfg: ReinforceConfig, env: DistEnv, *, reward: Any = None, prompts: Sequence[str] | None = None,
    val_prompts: Sequence[str] | None = None,
) -> State:
    """Load the policy and a frozen reference from the initial weights (with ``lora_rank > 0``: LoRA
    adapters on the policy and no reference copy), build the optimizer, the generators and the prompt stream.
    A resumed run then restores the checkpoint into it (``Run.start``)."""
    task = get_task(cfg.task)
    make_env = getattr(task, "make_env", None)
    if make_env is not None and cfg.dynamic_sampling:
        raise ConfigError(
            f"dynamic_sampling is not supported for the multi-turn task {cfg.task!r} yet (collate does not re-pad "
            "the episode keys turn_rewards/turn_index of batches with different response lengths)"
        )
    init_path = initial_policy_path(cfg)
    policy, tokenizer = load_policy_and_tokenizer(init_path, env)
    reference = None
    if cfg.uses_ref_logprobs and not cfg.lora:  # with LoRA the reference is the policy, adapters disabled
        reference = prepare(freeze(load_policy_and_tokenizer(init_path, env)[0]), cfg, env)
    policy = prepare(with_lora(policy, cfg).train(), cfg, env)
    return State(
        env=env, tokenizer=tokenizer, policy=policy, reference=reference,
        optimizer=make_optimizer(policy.parameters(), cfg.learning_rate, cfg.weight_decay),
        sampling_generator=generator(cfg.seed, env.rank, "sampling", env.device),
        minibatch_generator=generator(cfg.seed, env.rank, "minibatch"),
        stream=PromptStream(loop_prompts(cfg, tokenizer, prompts, "train"), cfg.seed),
        reward=reward if reward is not None else task.reward, make_env=make_env,
        val_prompts=loop_prompts(cfg, tokenizer, val_prompts, "test"),
    )  # fmt: skip


# --- phases: phase(state, batch, cfg) -> batch --------------------------------------------------------------


def rollout(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 1: K responses per prompt of ``batch["prompt_text"]`` at ``cfg.temperature`` (groups
    contiguous), behaviour logprobs. Returns the new rollout batch. A multi-turn task (``state.make_env``):
    K episodes per prompt (``phases.episodes``), whose ``rewards`` are their summed turn rewards."""
    with phases.decoding(state, cfg) as model:
        if state.make_env is not None:
            return phases.episodes(
                model, state.tokenizer, phases.prompt_texts(batch), state.make_env, cfg,
                temperature=cfg.temperature, num_samples=cfg.num_generations_per_prompt,
                generator=state.sampling_generator, compile=cfg.compile_generate,
                pack_weights=phases.pack_weights(cfg),
            )  # fmt: skip
        return phases.rollout(
            model, state.tokenizer, phases.prompt_texts(batch), max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, num_samples=cfg.num_generations_per_prompt, compile=cfg.compile_generate,
            pack_weights=phases.pack_weights(cfg), generator=state.sampling_generator,
        )  # fmt: skip


def score(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 2: ``rewards`` [B] from ``state.reward`` (callable, reward model or server URL; an episode batch
    keeps its envs' summed rewards); adds
    ``gen_rewards``, ``zero_std_frac`` (groups whose K rewards are all equal) and ``gen_batches`` over every
    batch generated this step (dynamic sampling may generate several)."""
    rewards = phases.score_rollout(batch, state.reward)
    m = state.metrics
    m.mean("gen_rewards", rewards.sum(), rewards.numel())
    if cfg.num_generations_per_prompt >= 2:
        informative = informative_groups(rewards, cfg.num_generations_per_prompt)
        m.mean("zero_std_frac", (~informative).sum(), informative.numel())
    return batch


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G] bool: True for groups whose K rewards are not all equal (they carry a learning signal)."""
    groups = einops.rearrange(rewards, "(g k) -> g k", k=group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)


def dynamic_sampling(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 2b (DAPO dynamic sampling): keep only informative groups of the scored ``batch`` and generate and
    score more batches of prompts from ``state.stream`` until ``num_prompts_per_step`` groups are kept or
    ``dynamic_sampling_max_gen_batches`` batches ran. Without ``cfg.dynamic_sampling`` returns ``batch``.

    Under torchrun the ranks agree before every round whether it is drawn (one all-reduce of "this rank still
    needs groups"), then every rank draws its prompts from the stream, so the stream stays in step across
    ranks. A rank that is already full does not generate: it enters the collectives of the round's rollout
    (``join_rollout``: the all-gather of the sharded policy) and of its scoring (the agreement on a
    non-finite reward) and keeps nothing. Generating and discarding would run the same collectives at the
    cost of a rollout; joining them keeps what each rank keeps, its prompt-stream position and its sampling
    RNG the same as when it generates only what it uses, so a resumed run draws as the uninterrupted one.

    If no group at all is informative, the last batch is trained on (only a KL loss can move it). Adds
    ``kept_groups`` (all ranks) and ``gen_batches`` (the most batches a rank generated).
    """
    if not cfg.dynamic_sampling:
        state.metrics.max("gen_batches", 1.0)
        state.metrics.sum("kept_groups", float(batch.batch_size[0] // cfg.num_generations_per_prompt))
        return batch
    env, k, n = state.env, cfg.num_generations_per_prompt, cfg.num_prompts_per_step
    kept, n_kept, n_gen, last, fresh = [], 0, 1, batch, batch
    for round_ in range(cfg.dynamic_sampling_max_gen_batches):
        if round_ > 0:
            if not any_rank(n_kept < n, env):  # agreed by every rank before any rank draws
                break
            prompts = state.stream.next_batch(n, env)  # every rank draws: the stream stays in step
            fresh = None
            if n_kept >= n:  # full: enter the collectives the other ranks' rollout and scoring run
                join_rollout(state, cfg)
                with agreed(env):
                    pass
            else:
                fresh = rollout(state, prompts, cfg)
                with agreed(env), in_phase(state.step + 1, "score"):
                    fresh = score(state, fresh, cfg)
                n_gen, last = n_gen + 1, fresh
        if fresh is not None:
            keep = informative_groups(fresh["rewards"], k).nonzero().flatten()[: n - n_kept]
            if keep.numel():
                rows = einops.rearrange(keep[:, None] * k + torch.arange(k, device=keep.device), "g k -> (g k)")
                kept.append(fresh[rows])
                n_kept += keep.numel()
    kept = kept or [last]
    state.metrics.max("gen_batches", float(n_gen))
    state.metrics.sum("kept_groups", float(n_kept))
    return collate(kept, pad_token_id=state.tokenizer.pad_token_id) if len(kept) > 1 else kept[0]


def join_rollout(state: State, cfg: ReinforceConfig) -> None:
    """Enter the collectives of a ``rollout`` without generating: a rank that has nothing to generate while
    the others do (dynamic sampling) calls it where they call ``rollout``. Decoding itself runs no collective
    (``rlbits.distributed.parallelize.unsharded``); gathering the sharded policy for it is the rollout's only
    one. A no-op on one process."""
    with unsharded(state.policy):  # under torchrun the policy is sharded: ``rollout`` gathers it so
        pass


def reference(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 3: ``ref_logprobs`` [B, R] of the sampled tokens under the frozen initial policy (with LoRA: the
    policy with its adapters disabled); nothing when no term uses them (``cfg.uses_ref_logprobs`` is False:
    no reference model, no ``init_policy_kl``)."""
    if not cfg.uses_ref_logprobs:
        return batch
    with phases.reference_model(state) as ref, unsharded(ref), autocast(ref, cfg):
        phases.reference_logprobs(ref, batch, temperature=cfg.temperature, microbatch_size=cfg.microbatch_size, **head_args(cfg))
    return batch


def advantages(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 4: ``advantages`` [B, R] and ``loss_mask`` [B, R] from ``rewards``, ``logprobs``, ``ref_logprobs``.

    ``r' = r - kl_coef * sum_t KL_t`` (with ``kl_in_reward``), the sequence advantage ``A = r' - baseline``
    (or the group-normalised ``r'``), broadcast over action tokens; ``loss_mask = action_mask`` without the
    truncated responses when ``overlong_filtering``. Adds ``rewards``, ``rewards_with_kl``, ``baseline``,
    ``advantages`` (token mean over the loss mask), ``init_policy_kl``, ``truncated_frac``, ``response_len``,
    ``loss_tokens`` to ``state.metrics``.
    """
    action_mask, m = batch["action_mask"], state.metrics
    rewards = batch["rewards"].float()
    k, rows = cfg.num_generations_per_prompt, batch.batch_size[0]
    shaped = rewards
    if cfg.kl_in_reward:
        kl = kernel(kl_penalty, cfg)(batch["logprobs"], batch["ref_logprobs"], cfg.kl_estimator, clamp=cfg.kl_clamp)
        shaped = rewards - cfg.kl_coef * torch.where(action_mask, kl, 0.0).sum(-1)
    if cfg.baseline == "rloo":
        baseline = rloo_baseline(shaped, k)
        seq_adv = shaped - baseline
    elif cfg.baseline in ("grpo", "dr_grpo", "grpo_unscaled"):
        baseline = einops.repeat(einops.reduce(shaped, "(g k) -> g", "mean", k=k), "g -> (g k)", k=k)
        seq_adv = group_normalize(shaped, k, scale=cfg.baseline == "grpo", eps=cfg.grpo_eps)
    else:
        baseline = torch.zeros_like(shaped)
        seq_adv = shaped
    truncated = batch["truncated"] if "truncated" in batch.keys() else torch.zeros_like(rewards, dtype=torch.bool)
    loss_mask = action_mask & ~truncated[:, None] if cfg.overlong_filtering else action_mask
    batch["advantages"] = torch.where(action_mask, seq_adv[:, None], 0.0)
    batch["loss_mask"] = loss_mask
    phases.add_batch_stats(m, batch)
    m.mean("rewards_with_kl", shaped.sum(), rows)
    m.mean("baseline", baseline.sum(), rows)
    m.mean("advantages", masked_sum(batch["advantages"], loss_mask), loss_mask.sum())
    m.mean("truncated_frac", truncated.float().sum(), rows)
    m.sum("loss_tokens", loss_mask.sum().float())
    return batch


def policy_gradient_loss(
    logprobs: torch.Tensor, micro: TensorDictBase, cfg: ReinforceConfig, num_tokens: torch.Tensor, num_seqs: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient term of one microbatch: ``ppo_loss`` when ``cfg.clipped``, else ``reinforce_loss``
    (plus ``clipfrac`` 0 and the same ``approx_kl`` so both report the same metrics)."""
    mask = micro["loss_mask"]
    agg = dict(agg=cfg.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    if cfg.clipped:
        loss, m = kernel(ppo_loss, cfg)(logprobs, micro["logprobs"], micro["advantages"], mask, cfg.clip_eps, cfg.clip_eps_high, **agg)
        return loss, {"clipfrac": m["clipfrac"], "approx_kl": m["approx_kl"]}
    loss, _ = kernel(reinforce_loss, cfg)(logprobs, micro["advantages"], mask, **agg)
    # ppo_loss's approx_kl: the k3 estimate of KL(pi_old || pi_theta) on the sampled tokens.
    approx_kl = masked_mean(kl_penalty(micro["logprobs"], logprobs.detach(), "k3"), mask)
    return loss, {"clipfrac": torch.zeros(()), "approx_kl": approx_kl}


def update(state: State, batch: TensorDictBase, cfg: ReinforceConfig) -> TensorDictBase:
    """Phase 5: ``num_iterations`` x ``num_minibatches`` optimizer steps, gradients accumulated over microbatches.

    Each minibatch's loss is normalised by its global loss-token (or sequence) count, so microbatching gives
    the gradient of one big batch. Adds ``actor_loss`` and ``kl_loss`` (each minibatch's aggregated loss,
    averaged over minibatches and epochs), loss-token means of ``clipfrac``, ``approx_kl``, ``entropy``, and
    ``grad_norm`` (mean over optimizer steps, before clipping) to ``state.metrics``.

    Raises:
        NonFiniteError: a loss or gradient is not finite (on every rank; the policy is left untouched).
    """
    env, m, policy = state.env, state.metrics, state.policy
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    num_mb = min(cfg.num_minibatches, int(batch.batch_size[0]) // cfg.num_generations_per_prompt or 1)
    num_mb = -int(all_reduce_max(torch.tensor(-num_mb, device=env.device), env).item())  # the same on every rank
    per_update = 1.0 / (cfg.num_iterations * num_mb)
    for _ in range(cfg.num_iterations):
        for minibatch in split_minibatches(batch, num_mb, generator=state.minibatch_generator, keep_groups=True):
            num_tokens = global_count(minibatch["loss_mask"], env).clamp(min=1)
            num_seqs = global_count(minibatch["loss_mask"].any(-1), env).clamp(min=1)
            for micro in pad_microbatches(list(split_microbatches(minibatch, cfg.microbatch_size)), env):
                mask = micro["loss_mask"]
                with autocast(policy, cfg):
                    logprobs, entropy = policy_logprobs(
                        policy, micro, temperature=cfg.temperature, return_entropy=True, entropy_grad=False,
                        **head_args(cfg),
                    )  # fmt: skip
                logprobs, entropy = logprobs.float(), entropy.float()
                loss, stats = policy_gradient_loss(logprobs, micro, cfg, num_tokens, num_seqs)
                kl_loss = torch.zeros(())
                if cfg.kl_loss_coef > 0:
                    kl = kl_penalty(logprobs, micro["ref_logprobs"], cfg.kl_loss_estimator, clamp=cfg.kl_clamp)
                    kl_loss = aggregate_loss(kl, mask, cfg.loss_agg, num_tokens, num_seqs)
                    loss = loss + cfg.kl_loss_coef * kl_loss
                if any_rank(~torch.isfinite(loss.detach()), env):  # every rank raises together
                    policy.zero_grad(set_to_none=True)
                    raise NonFiniteError(f"step {state.step + 1}, phase update: the loss is {loss.item()}")
                loss.backward()
                weight = mask.sum()
                m.sum("actor_loss", (loss - cfg.kl_loss_coef * kl_loss).detach() * per_update)
                m.sum("kl_loss", kl_loss.detach() * per_update)
                for name, value in (*stats.items(), ("entropy", masked_mean(entropy.detach(), mask))):
                    m.mean(name, value * weight, weight)
            try:
                m.same("grad_norm", clip_and_step(params, state.optimizer, cfg.max_grad_norm) * per_update)
            except FloatingPointError as e:
                raise NonFiniteError(f"step {state.step + 1}, phase update: {e}") from e
    return batch


validate = phases.validate_policy
"""Validation: mean reward of one response per test prompt (``rlbits.loops.phases.validate_policy``)."""


# --- the loop ----------------------------------------------------------------------------------------------


def train(
    cfg: ReinforceConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False, reward: Callable | Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None,
) -> Path:  # fmt: skip
    """Run REINFORCE/RLOO/GRPO for ``cfg.max_num_steps`` steps and return the run directory.

    Args:
        cfg: the config (validated again here).
        callbacks: objects with ``on_metrics`` / ``on_samples`` / ``should_stop`` (see ``rlbits.loops.run``).
        resume: continue from the latest checkpoint of ``cfg.run_dir``; the run then matches the uninterrupted one.
        force: also use a ``run_dir`` that is not empty and not an rlbits run, or start an existing run
            over (``rlbits.loops.run.Run``); a live run's lock is never overridden.
        reward: overrides the task reward (anything ``rlbits.score`` accepts).
        prompts: overrides the task's train prompts (a list of non-empty strings, checked before any model is
            loaded, and for length once the tokenizer is).
        val_prompts: validation prompts instead of the task's test split (default: ``cfg.val_prompts``, a file).
            The reward and prompts are recorded in ``RUN_DIR/provenance.json``; a resume with other ones is
            refused unless ``cfg.allow_changed_inputs``.

    Raises:
        ConfigError: an invalid config. FileNotFoundError: ``resume`` without a checkpoint.
        PromptError: bad prompts or val_prompts (before anything is loaded or written).
        ResumeMismatchError: ``resume`` with another reward or other prompts than the run was started with.
        NonFiniteError: a non-finite loss or gradient (names the step and phase).
    """
    if not isinstance(cfg, ReinforceConfig):
        raise ConfigError(f"cfg must be a ReinforceConfig, got {type(cfg).__name__}")
    reward = cfg.resolve_reward(reward)  # the reward_model key: a reward-model folder instead of the task's reward
    with Run(cfg, callbacks=callbacks, resume=resume, force=force) as run:
        prompts, val_prompts = run.check_inputs(reward=reward, prompts=prompts, val_prompts=val_prompts)
        state = init_state(cfg, run.env, reward=reward, prompts=prompts, val_prompts=val_prompts)
        run.start(state, validate=validate)  # restores a checkpoint into the state; opens the logs
        for _ in run.steps(state):
            with run.step(state):
                with run.phase("rollout"):  # 1. K responses per prompt
                    batch = rollout(state, state.stream.next_batch(cfg.num_prompts_per_step, run.env), cfg)
                with run.phase("score"):  # 2. sequence rewards
                    batch = score(state, batch, cfg)
                with run.phase("rollout"):  # 2b. dynamic sampling: informative groups only, more batches
                    batch = dynamic_sampling(state, batch, cfg)
                with run.phase("reference"):  # 3. reference logprobs
                    batch = reference(state, batch, cfg)
                with run.phase("advantages"):  # 4. group baseline, broadcast over tokens
                    batch = advantages(state, batch, cfg)
                with run.phase("update"):  # 5. policy-gradient (or clipped) steps
                    batch = update(state, batch, cfg)
                run.end_step(state, batch)  # 6. log; validate and save when due
        return run.finish(state, build=lambda: build_policy(cfg))


__all__ = [
    "BASELINES",
    "ReinforceConfig",
    "State",
    "advantages",
    "dynamic_sampling",
    "informative_groups",
    "init_state",
    "join_rollout",
    "policy_gradient_loss",
    "reference",
    "rollout",
    "score",
    "train",
    "update",
    "validate",
]
