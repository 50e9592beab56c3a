"""ILQL: implicit language Q-learning on an offline dataset of ``(prompt, response, reward)``.

Algorithm (Snell et al. 2022, "Offline RL for natural language generation with implicit language Q
learning"; layout of trlx's ``ILQLConfig`` / ``AccelerateILQLTrainer``). A causal LM carries two Q heads
over the vocabulary, their target copies and a V head (``rlbits.models.ILQLModel``), all reading the LM's
last hidden state. For every response token t of a dataset sample (state s_t = prompt + response[:t],
action a_t = response[t]; the sequence reward sits on the last token):

    targets   = r_t + gamma * V(s_{t+1})        (V detached, 0 after the last token)   ``ilql_targets``
    loss_q    = sum over heads i of mean (Q_i(s_t, a_t) - targets)^2                       ``q_loss``
    loss_v    = mean |tau - 1(u < 0)| u^2,  u = min_i target_Q_i(s_t, a_t) - V(s_t)        ``expectile_loss``
    loss_cql  = sum over heads of mean cross-entropy of a_t under softmax(Q_i(s_t, .))     ``cql_loss``
    loss_awac = mean -log pi(a_t | s_t)  (the LM head: behaviour cloning)                  ``awac_loss``
    loss      = loss_q + loss_v + cql_scale * loss_cql + awac_scale * loss_awac

After every ``steps_for_target_q_sync`` optimizer steps the target heads move towards the online ones:
``target = alpha * online + (1 - alpha) * target`` (``alpha=1``: hard copy; ``steps_for_target_q_sync=1``
with small ``alpha``: Polyak averaging every step). Decoding samples from
``logits + beta * (min_i target_Q_i(s, .) - V(s))`` (``ilql_logits``; ``SteeredPolicy`` wraps the model so
plain ``generate`` decodes steered, KV cache included).

The offline set comes from ``samples=`` (triples or dicts), from ``dataset_path`` (a JSONL file), or is
built by ``build_offline_dataset``: ``dataset_size`` responses sampled from the base model at
``dataset_temperature`` for the task's train prompts and scored with the task's reward. It is padded into
one TensorDict memory-mapped in ``RUN_DIR/offline_dataset/`` (with a human-readable copy of the rows in
``RUN_DIR/offline_dataset.jsonl``), and a resumed run reads the folder back. Each step draws the next
``batch_size`` samples of a seeded per-epoch permutation from a torchrl ``ReplayBuffer`` over that
TensorDict (``rlbits.data.offline``).

Where the rest lives: ``SteeredPolicy`` in ``rlbits.models.steered``; the dataset (rows, tensors, replay
buffer, ``next_batch``) in ``rlbits.data.offline``; ``steered_validate``, ``load_final``, ``evaluate_betas``
and ``evaluate_run`` in ``rlbits.loops.evaluate``. They are all importable from here too.

How rlbits departs from trlx:
  - Targets and losses skip non-action tokens exactly (``action_mask``); the last response token is
    terminal whether it is EOS or the response was cut at ``max_new_tokens``.
  - The losses are token means over the whole step batch (global token count over microbatches), and
    ``q_loss``/``cql_loss`` are summed over the two heads, as trlx does.
  - Samples given as text get the tokenizer's EOS appended to the response (trlx does the same); samples
    built here keep the exact sampled token ids (no decode/re-encode round trip).
  - trlx's ``top_k`` at decoding is not applied: validation samples the full steered distribution at
    ``temperature`` so its reward compares directly with the base model's.
  - trlx's default ``alpha=0.001`` every 5 steps suits tens of thousands of steps; the short CPU runs
    here sync faster (see ``configs/ilql_sentiment.yaml``).

Launch::

    rlbits train configs/ilql_sentiment.yaml                      # one process (the CLI)
    torchrun --nproc_per_node 2 -m rlbits train configs/ilql_sentiment.yaml      # 2 FSDP2 ranks
    python -c "from rlbits.loops import ilql; ilql.train(ilql.ILQLConfig(run_dir='runs/ilql'))"

Under ``torchrun`` the model (LM, Q/V heads, target heads) is sharded with FSDP2; each rank trains on its
``batch_size`` rows of every ``batch_size * world_size`` drawn, with losses divided by the global token count
(docs/scaling.md); rank 0 writes the logs and ``final/``.

Logged metrics (``metrics.jsonl``, per step; docs/ilql.md explains each): ``loss``, ``loss_q``, ``loss_v``,
``loss_cql``, ``loss_awac``, ``q_mean``, ``target_q_mean``, ``v_mean``, ``td_target_mean``,
``advantage_mean``, ``rewards``, ``response_len``, ``grad_norm``, ``epoch``, ``tokens_per_s``, ``time/*``;
at validation ``val_reward``, ``val_reward_std``, ``val_response_len`` (steered at ``beta``) and
``val_reward_policy`` (the trained LM head alone, beta = 0). At step 0 the heads are untrained, so
``val_reward`` (and its std and length) is the base model's (beta 0, equal to ``val_reward_policy``), and
steering with the untrained heads goes to ``val_reward_untrained_heads``, ``val_reward_std_untrained_heads``
and ``val_response_len_untrained_heads``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data import ReplayBuffer

from rlbits.batch import trim_padding
from rlbits.data.offline import (
    DATASET_DIR,
    DATASET_FILE,
    EpochSampler,
    build_offline_dataset,
    dataset_stats,
    load_or_build_dataset,
    next_batch,
    normalize_samples,
    offline_buffer,
    read_dataset,
    save_dataset,
    tensorize_dataset,
)
from rlbits.distributed.env import DistEnv
from rlbits.distributed.reduce import any_rank, global_count
from rlbits.functional import awac_loss, cql_loss, expectile_loss, ilql_targets, q_loss, token_rewards
from rlbits.loops import phases
from rlbits.loops.config import MAX_ROWS, MIN_TEMPERATURE, ConfigError, LoRAConfig
from rlbits.loops.config_fields import field_docs, ranged
from rlbits.loops.evaluate import evaluate_betas, steered_validate
from rlbits.loops.evaluate import evaluate_ilql_run as evaluate_run
from rlbits.loops.evaluate import load_ilql_final as load_final
from rlbits.loops.optim import clip_and_step, make_optimizer
from rlbits.loops.run import NonFiniteError, Run
from rlbits.loops.runtime import (
    autocast,
    disable_dropout,
    initial_policy_path,
    load_policy_and_tokenizer,
    policy_path,
    prepare,
    uses_chat,
    with_lora,
)
from rlbits.loops.state import LoopState, optimizer_of, runtime
from rlbits.models.forward import position_ids_from_mask
from rlbits.models.heads import ILQLModel
from rlbits.models.steered import SteeredPolicy
from rlbits.tasks import get_task


@dataclasses.dataclass(frozen=True)
class ILQLConfig(LoRAConfig):
    """ILQL on an offline dataset (trlx's ``ILQLConfig`` names where one exists)."""

    loop: str = "ilql"
    """Which loop runs this config; ``ilql`` for this one."""
    max_num_steps: int = 400
    """Optimizer steps (one batch of ``batch_size`` offline samples each)."""
    learning_rate: float = 3e-4
    """AdamW learning rate of the LM and the heads."""
    max_new_tokens: int = 24
    """Longest response when building the offline set and at validation."""
    microbatch_size: int = 32
    """Rows per forward/backward pass; gradients accumulate over microbatches up to ``batch_size``."""
    val_period: int = 100
    """Validate (steered decoding on the test split) every this many steps (0: only at start/end)."""
    save_period: int = 200
    """Write a checkpoint every this many steps (0: only at the end)."""
    batch_size: int = ranged(32, ge=1, at_most=MAX_ROWS)
    """Offline samples per optimizer step (trlx ``batch_size``)."""
    tau: float = ranged(0.7, gt=0, lt=1)
    """Expectile of the V regression in (0, 1): 0.5 is plain regression, larger tracks the best actions."""
    gamma: float = ranged(0.99, ge=0, le=1)
    """Discount per response token in the Bellman targets."""
    cql_scale: float = ranged(0.1, ge=0)
    """Weight of the conservative (CQL) term, summed over the Q heads."""
    awac_scale: float = ranged(1.0, ge=0)
    """Weight of the LM's negative log-likelihood of the dataset tokens (keeps the trunk a language model)."""
    awac_beta: float = ranged(0.0, ge=0)
    """trlx's AWAC weight: each dataset token's NLL is weighted by ``exp(awac_beta * (target Q - V))``
    (detached); 0 = plain behaviour cloning (trlx's default)."""
    alpha: float = ranged(0.1, ge=0, le=1)
    """Target-head update ``target = alpha * online + (1 - alpha) * target`` (1 = hard copy)."""
    steps_for_target_q_sync: int = ranged(1, ge=1)
    """Apply that update every this many optimizer steps."""
    beta: float = ranged(4.0, ge=0)
    """Steering strength at decoding: logits + beta * (Q - V); 0 samples the trained LM itself."""
    two_qs: bool = True
    """Two Q heads (clipped double Q: targets use the minimum of the two target heads)."""
    head_layers: int = 2
    """2: trlx's MLP heads (hidden -> 2 hidden -> out); 1: linear heads."""
    shared_trunk: bool = True
    """Heads read the LM's own hidden states (True, trlx) or a trainable copy of its trunk (False, 2x cost)."""
    dataset_size: int = ranged(2048, ge=1, at_most=MAX_ROWS)
    """Responses sampled from the base model for the offline set (ignored with ``samples=`` or
    ``dataset_path``)."""
    dataset_temperature: float = ranged(1.0, ge=MIN_TEMPERATURE)
    """Sampling temperature of the offline set's responses, at least ``MIN_TEMPERATURE`` (1e-4, as
    ``temperature``)."""
    dataset_batch_size: int = ranged(256, ge=1, at_most=MAX_ROWS)
    """Prompts per ``generate`` call while building the offline set."""
    dataset_path: str | None = None
    """JSONL file of offline samples, one ``{"prompt", "response", "reward"}`` object per line; None builds the
    set."""

    def check(self) -> None:
        """The groups' checks, then ILQL's. Raises ConfigError naming the field."""
        super().check()
        if self.head_layers not in (1, 2):
            raise ConfigError(f"head_layers must be 1 (linear) or 2 (MLP, as trlx), got {self.head_layers}")
        if self.dataset_path is not None and not Path(self.dataset_path).is_file():
            doc = field_docs(type(self))["dataset_path"]
            raise ConfigError(f"dataset_path {self.dataset_path!r} is not a file ({doc})")


# --------------------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class State(LoopState):
    """Everything an ILQL run carries from step to step, saved as a whole (``rlbits.loops.state``)."""

    model: ILQLModel
    """The LM with its Q, target Q and V heads."""
    optimizer: torch.optim.Optimizer = optimizer_of("model")
    sampler: EpochSampler | None = None
    """The offline set's sampler (its position, ``consumed_samples``, is saved); set with ``attach``."""
    buffer: ReplayBuffer | None = runtime(default=None, repr=False)
    """The offline set in a torchrl ``ReplayBuffer`` (``rlbits.data.offline.offline_buffer``)."""
    dataset_len: int = runtime(default=0)
    reward: Any = runtime(default=None)
    val_prompts: list[str] = runtime(default_factory=list)

    @property
    def epoch(self) -> int:
        """Passes over the offline set completed."""
        return self.sampler.consumed_samples // max(1, self.dataset_len) if self.sampler is not None else 0

    def attach(self, data: TensorDictBase, seed: int) -> None:
        """Draw batches from the offline set ``data`` (a fresh sampler; ``Run.start`` restores its position)."""
        self.buffer = offline_buffer(data, seed=seed)
        self.sampler, self.dataset_len = self.buffer.sampler, len(data)


def _fresh_model(cfg: ILQLConfig, env: DistEnv | None = None, *, path: str | None = None) -> tuple[ILQLModel, Any]:
    """The initial policy (from ``path``, default ``policy_path(cfg)``; with LoRA adapters when
    ``lora_rank > 0``) with new, fully trained Q/V heads (seeded by ``cfg.seed``) and its tokenizer."""
    policy, tokenizer = load_policy_and_tokenizer(path or policy_path(cfg), env or DistEnv())
    policy = with_lora(policy, cfg)  # before the heads: they are not adapted, they train whole
    model = ILQLModel(
        policy, two_qs=cfg.two_qs, head_layers=cfg.head_layers, shared_trunk=cfg.shared_trunk, seed=cfg.seed
    )
    return model, tokenizer


def init_state(
    cfg: ILQLConfig, env: DistEnv, *, reward: Any = None, val_prompts: Sequence[str] | None = None
) -> State:
    """The ILQL model (the initial policy with new heads seeded by ``cfg.seed``), tokenizer and optimizer.
    The offline set is attached next (``State.attach``); a resumed run then restores the checkpoint into
    the state (``Run.start``). ``val_prompts`` replaces the task's test split in validation."""
    task = get_task(cfg.task)
    if uses_chat(cfg):  # its offline rows are tokenized as given: chat-formatted validation alone would not match
        raise ConfigError(
            f"the ilql loop does not format prompts as a chat; run task {cfg.task!r} with chat_template=false"
        )
    model, tokenizer = _fresh_model(cfg, env, path=initial_policy_path(cfg))  # every rank, at set-up
    model = prepare(disable_dropout(model).to(env.device).train(), cfg, env)
    return State(
        env=env, tokenizer=tokenizer, model=model,
        optimizer=make_optimizer(model.parameters(), cfg.learning_rate, cfg.weight_decay),
        reward=reward if reward is not None else task.reward,
        val_prompts=list(val_prompts) if val_prompts is not None else task.prompts("test"),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# Phases: phase(state, batch, cfg) -> batch
# --------------------------------------------------------------------------------------------------------


def ilql_loss(
    out: dict[str, torch.Tensor],
    batch: TensorDictBase,
    cfg: ILQLConfig,
    num_tokens: int | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ILQL loss of one (micro)batch from ``ILQLModel.forward``'s outputs over ``input_ids``.

    Reads the response positions: the output at ``P - 1 + t`` is the state before response token t. Each
    term is a token sum divided by ``num_tokens`` (the step's global action-token count), so microbatch
    (and rank) losses add up to the step's token mean.

    Returns:
        ``(loss, metrics)`` with ``loss_q``, ``loss_v``, ``loss_cql``, ``loss_awac``, ``q_mean`` (the online
        heads' Q of the taken tokens), ``target_q_mean`` (the target heads'), ``v_mean``, ``td_target_mean``
        (the Bellman targets r + gamma V(s')), ``advantage_mean`` (target Q - V): token sums over
        ``num_tokens``, detached.
    """
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    actions, mask = batch["responses"], batch["action_mask"]
    at = slice(P - 1, P - 1 + R)
    logits = out["logits"][:, at]
    v = out["v"][:, at]
    qs = [out["q1"][:, at]] + ([out["q2"][:, at]] if "q2" in out else [])
    target_qs = [out["target_q1"][:, at]] + ([out["target_q2"][:, at]] if "target_q2" in out else [])
    idx = actions.unsqueeze(-1)
    q_taken = [q.gather(-1, idx).squeeze(-1) for q in qs]
    target_q = torch.stack([q.gather(-1, idx).squeeze(-1) for q in target_qs]).amin(0)

    targets = ilql_targets(token_rewards(batch["rewards"], mask), v.detach(), mask, cfg.gamma)
    loss_q = sum(q_loss(q, targets, mask, num_tokens)[0] for q in q_taken)
    loss_v, _ = expectile_loss(v, target_q, mask, cfg.tau, num_tokens)
    loss_cql = sum(cql_loss(q, actions, mask, num_tokens)[0] for q in qs)
    if cfg.awac_beta:
        loss_awac, _ = awac_loss(logits, actions, mask, num_tokens, advantages=(target_q - v).detach(), beta=cfg.awac_beta)
    else:
        loss_awac, _ = awac_loss(logits, actions, mask, num_tokens)
    loss = loss_q + loss_v + cfg.cql_scale * loss_cql + cfg.awac_scale * loss_awac

    def share(x: torch.Tensor) -> torch.Tensor:  # token sum / num_tokens: adds up over microbatches
        return torch.where(mask, x.detach(), 0.0).sum() / num_tokens

    metrics = {
        "loss": loss.detach(),
        "loss_q": loss_q.detach(),
        "loss_v": loss_v.detach(),
        "loss_cql": loss_cql.detach(),
        "loss_awac": loss_awac.detach(),
        "q_mean": share(sum(q_taken) / len(q_taken)),
        "target_q_mean": share(target_q),
        "v_mean": share(v),
        "td_target_mean": share(targets),
        "advantage_mean": share(target_q - v),
    }
    return loss, metrics


def update(state: State, batch: TensorDictBase, cfg: ILQLConfig) -> TensorDictBase:
    """Phase 2: forward/backward over microbatches of ``batch``, clip, one optimizer step. Every loss term is
    divided by the global action-token count, so N ranks take the step one process takes on the whole batch.
    Adds the terms of ``ilql_loss``, ``grad_norm``, ``rewards`` and ``response_len`` to ``state.metrics``.

    Raises:
        NonFiniteError: a non-finite loss or gradient, naming the step and phase; no update is applied.
    """
    model, env, m = state.model, state.env, state.metrics
    step = state.step + 1
    num_tokens = global_count(batch["action_mask"], env).clamp(min=1)
    for mb in batch.split(cfg.microbatch_size, dim=0):
        mb = trim_padding(mb)
        with autocast(model, cfg):
            out = model(mb["input_ids"], mb["attention_mask"], position_ids_from_mask(mb["attention_mask"]))
        out = {k: v.float() for k, v in out.items()}
        loss, metrics = ilql_loss(out, mb, cfg, num_tokens)
        if any_rank(~torch.isfinite(loss.detach()), env):  # every rank raises together
            state.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"step {step}, phase update: the ILQL loss is {loss.item()} ({metrics})")
        loss.backward()
        for name, value in metrics.items():
            m.sum(name, value)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        m.same("grad_norm", clip_and_step(params, state.optimizer, cfg.max_grad_norm))
    except FloatingPointError as e:
        raise NonFiniteError(f"step {step}, phase update: {e}") from e
    phases.add_batch_stats(m, batch)
    return batch


def sync_targets(state: State, batch: TensorDictBase, cfg: ILQLConfig) -> TensorDictBase:
    """Phase 3: after every ``steps_for_target_q_sync``-th step, ``target = alpha * online + (1 - alpha) *
    target`` for the target Q heads."""
    if (state.step + 1) % cfg.steps_for_target_q_sync == 0:
        state.model.sync_target_q_heads(cfg.alpha)
    return batch


def validate(state: State, batch: TensorDictBase | None, cfg: ILQLConfig) -> TensorDictBase:
    """Validation: steered decoding at ``cfg.beta`` (``val_reward``, ``val_reward_std``, ``val_response_len``)
    and the LM alone (``val_reward_policy``), added to ``state.metrics``. Returns the steered batch.

    Step 0 (before training) is the base model's validation, as in every loop: ``val_reward``,
    ``val_reward_std``, ``val_response_len`` and ``val_reward_policy`` are the LM alone (beta 0, the base
    model), and the batch returned is its decodes. Steering with the untrained heads (random Q - V, not the
    base) is logged under ``val_reward_untrained_heads``, ``val_reward_std_untrained_heads``,
    ``val_response_len_untrained_heads``."""
    kw = dict(reward=state.reward, prompts=state.val_prompts, env=state.env)
    values, val_batch = steered_validate(state.model, state.tokenizer, cfg, beta=cfg.beta, **kw)
    plain, plain_batch = (
        steered_validate(state.model, state.tokenizer, cfg, beta=0.0, **kw) if cfg.beta != 0 else (values, val_batch)
    )
    if state.step == 0:  # untrained heads: the base is the LM alone
        state.metrics.update({f"{k}_untrained_heads": v for k, v in values.items()})
        values, val_batch = plain, plain_batch
    state.metrics.update({**values, "val_reward_policy": plain["val_reward"]})
    return val_batch


def num_steps(cfg: ILQLConfig, dataset_len: int) -> int:
    """Steps of the run: ``max_num_steps``, or fewer if ``max_num_epochs`` passes over the set end first."""
    return min(cfg.max_num_steps, math.ceil(cfg.max_num_epochs * dataset_len / cfg.batch_size))


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------


def train(
    cfg: ILQLConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False, reward: Any = None,
    prompts: Sequence[str] | None = None, samples: Sequence[Any] | None = None,
    val_prompts: Sequence[str] | None = None,
) -> Path:  # fmt: skip
    """Train ILQL and return the run directory (``RUN_DIR/final`` holds the LM, tokenizer and heads).

    Args:
        cfg: the config (validated again here).
        callbacks: objects with ``on_metrics``/``on_samples``/``should_stop``.
        resume: continue from the newest checkpoint of ``cfg.run_dir`` (exactly reproducing the
            uninterrupted run on one process).
        force: also use a ``run_dir`` that is not empty and not an rlbits run, or start an existing run
            over (``rlbits.loops.run.Run``); a live run's lock is never overridden.
        reward: scores the offline set when it is built, and validation; None = the task's reward.
        prompts: prompts to build the offline set from; None = the task's train split.
        samples: the offline set itself: ``(prompt, response, reward)`` triples or dicts.
        val_prompts: validation prompts instead of the task's test split (default: ``cfg.val_prompts``, a file).
            The reward, prompts and samples are recorded in ``RUN_DIR/provenance.json``; a resume with other
            ones is refused unless ``cfg.allow_changed_inputs`` (a resumed call may leave ``prompts`` and
            ``samples`` out: the offline set is read back from the run directory).

    Raises:
        ConfigError: an invalid config. FileNotFoundError: ``resume`` without a checkpoint.
        PromptError: bad prompts or val_prompts (before anything is loaded or written).
        ResumeMismatchError: ``resume`` with another reward, prompts or samples than the run was started with.
        NonFiniteError: a non-finite loss or gradient (names the step; nothing is saved).
    """
    if not isinstance(cfg, ILQLConfig):
        raise ConfigError(f"cfg must be an ILQLConfig, got {type(cfg).__name__}")
    reward = cfg.resolve_reward(reward)  # the reward_model key: a reward-model folder instead of the task's reward
    with Run(cfg, callbacks=callbacks, resume=resume, force=force) as run:
        prompts, val_prompts = run.check_inputs(
            reward=reward, prompts=prompts, val_prompts=val_prompts, samples=samples, optional=("prompts", "samples")
        )  # fmt: skip
        state = init_state(cfg, run.env, reward=reward, val_prompts=val_prompts)
        run.check_lengths(state)
        with run.timer("dataset"):  # 0. the offline set: built from the base policy, or read back on resume
            data = load_or_build_dataset(cfg, state, samples=samples, reward=reward, prompts=prompts,
                                         resume=run.checkpoint is not None, write=run.env.is_main)  # fmt: skip
        state.attach(data, cfg.seed)
        run.start(state, validate=validate, total_steps=num_steps(cfg, len(data)))
        state.metrics.update({**dataset_stats(data), "time/dataset": run.timer.seconds["dataset"]})
        for _ in run.steps(state):
            with run.step(state):
                with run.phase("data"):  # 1. the next batch of offline rows
                    batch = next_batch(state.buffer, cfg.batch_size, run.env)
                with run.phase("update"):  # 2. Q, V, CQL and AWAC losses; one optimizer step
                    batch = update(state, batch, cfg)
                with run.phase("sync"):  # 3. target Q heads towards the online ones
                    batch = sync_targets(state, batch, cfg)
                run.end_step(state, batch)  # 4. log; validate and save when due
        return run.finish(state, model=state.model, build=lambda: _fresh_model(cfg)[0])


__all__ = [
    "DATASET_DIR",
    "DATASET_FILE",
    "ILQLConfig",
    "State",
    "SteeredPolicy",
    "build_offline_dataset",
    "dataset_stats",
    "evaluate_betas",
    "evaluate_run",
    "ilql_loss",
    "init_state",
    "load_final",
    "load_or_build_dataset",
    "next_batch",
    "normalize_samples",
    "num_steps",
    "offline_buffer",
    "read_dataset",
    "save_dataset",
    "steered_validate",
    "sync_targets",
    "train",
    "tensorize_dataset",
    "update",
    "validate",
]
