"""ILQL: implicit language Q-learning on an offline dataset of ``(prompt, response, reward)`` or of dialogues
whose output segments are the actions (trlx's samples).

Algorithm (Snell et al. 2022; layout of trlx's ``ILQLConfig``). A causal LM carries two Q heads over the
vocabulary, their target copies and a V head (``rlbits.models.ILQLModel``). For every response token t (state
s_t = prompt + response[:t], action a_t = response[t]; the sequence reward sits on the last token):

    targets   = r_t + gamma * V(s_{t+1})        (V detached, 0 after the last token)   ``ilql_targets``
    loss_q    = sum over heads i of mean (Q_i(s_t, a_t) - targets)^2                       ``q_loss``
    loss_v    = mean |tau - 1(u < 0)| u^2,  u = min_i target_Q_i(s_t, a_t) - V(s_t)        ``expectile_loss``
    loss_cql  = sum over heads of mean cross-entropy of a_t under softmax(Q_i(s_t, .))     ``cql_loss``
    loss_awac = mean -log pi(a_t | s_t)  (the LM head: behaviour cloning)                  ``awac_loss``
    loss      = loss_q + loss_v + cql_scale * loss_cql + awac_scale * loss_awac

Every ``steps_for_target_q_sync`` steps ``target = alpha * online + (1 - alpha) * target``. Decoding samples
from ``logits + beta * (min_i target_Q_i(s, .) - V(s))`` (``SteeredPolicy``; ``steered_validate``), under
``logit_mask`` if set. In a dialogue, "response token" above means an action token: prompt segments inside
the response are read but are not actions, and ``V(s_{t+1})`` is the state before the next action.

The offline set (``samples=``, ``dataset_path``, or built from the base model) lives in ``rlbits.data.offline``.
docs/ilql.md: the dataset, how rlbits departs from trlx, the metrics and how to launch a run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

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
from rlbits.functional import (
    awac_loss,
    cql_loss,
    expectile_loss,
    ilql_standardize_rewards,
    ilql_targets,
    masked_sum,
    q_loss,
    token_rewards,
)
from rlbits.loops import phases
from rlbits.loops.config import MAX_ROWS, MIN_TEMPERATURE, ConfigError, LoRAConfig
from rlbits.loops.config_fields import field_docs, ranged
from rlbits.loops.ilql_eval import evaluate_betas, evaluate_run, load_final, load_logit_mask, steered_validate
from rlbits.loops.optim import make_optimizer, run_length, scheduled
from rlbits.loops.run import Run
from rlbits.loops.runtime import (
    Setup,
    disable_dropout,
    load_policy_and_tokenizer,
    policy_path,
    prepare,
    with_lora,
)
from rlbits.loops.state import LoopState, optimizer_of, runtime
from rlbits.loops.update import Denominators, Trained, optimize
from rlbits.models.forward import position_ids_from_mask
from rlbits.models.heads import ILQLModel
from rlbits.models.steered import SteeredPolicy


@dataclasses.dataclass(frozen=True)
class ILQLConfig(LoRAConfig):
    """ILQL on an offline dataset (trlx's ``ILQLConfig`` names where one exists)."""

    loop: str = "ilql"
    """Which loop runs this config; ``ilql`` for this one."""
    pack_sequences: bool = False
    """Off: ILQL's objective runs its own forward passes (Q and V heads), so ``True`` is refused at the first
    update; ``max_tokens_per_microbatch`` works."""
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
    standardize_rewards: bool = False
    """Train on the offline set's rewards standardised over the whole set, ``(r - mean) / (std + eps)``
    (``rlbits.ilql_standardize_rewards``), as trlx's ILQL always does (``make_experience`` in
    ``trlx/trainer/accelerate_ilql_trainer.py``; no config field there). False: the rewards as given. The
    ``dataset/reward_*`` statistics are of what training sees."""
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
    """JSONL file of offline samples, one ``{"prompt", "response", "reward"}`` or ``{"dialogue": [...],
    "reward"}`` object per line (``rlbits.data.offline.normalize_samples``); None builds the set."""
    dataset_max_length: int | None = ranged(None, ge=2)
    """Truncate each offline sample to this many tokens, prompt and response together (trlx's
    ``train.seq_length``, passed as ``max_length`` to ``tokenize_dialogue`` in
    ``trlx/pipeline/offline_pipeline.py``); None: no truncation."""
    dataset_truncation_side: Literal["right", "left"] = "right"
    """Which end ``dataset_max_length`` cuts (trlx's ``tokenizer.truncation_side``): ``right`` drops the end of
    the last segments, ``left`` the start of the first ones (a prompt token is then put back, as trlx)."""
    logit_mask: str | None = None
    """File of a [V, V] mask (``ilql_eval.load_logit_mask``: ``.safetensors`` or a torch file; nonzero = True)
    whose row i forbids the tokens j where it is True right after token i, in every steered decode (validation,
    ``rlbits eval``; trlx's ``generate(logit_mask=...)`` in ``trlx/models/modeling_ilql.py``); None: no mask.
    It holds V^2 bytes in memory."""

    def check(self) -> None:
        """The groups' checks, then ILQL's. Raises ConfigError naming the field."""
        super().check()
        if self.head_layers not in (1, 2):
            raise ConfigError(f"head_layers must be 1 (linear) or 2 (MLP, as trlx), got {self.head_layers}")
        for name in ("dataset_path", "logit_mask"):
            value = getattr(self, name)
            if value is not None and not Path(value).is_file():
                raise ConfigError(f"{name} {value!r} is not a file ({field_docs(type(self))[name]})")


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
    logit_mask: torch.Tensor | None = runtime(default=None, repr=False)
    """``cfg.logit_mask`` read (``load_logit_mask``): [V, V] bool, or None."""

    @property
    def trained_model(self) -> torch.nn.Module:
        """The LM with its heads."""
        return self.model

    def export_replica(self, cfg: ILQLConfig) -> torch.nn.Module:
        """The initial policy with the run's adapters and new heads, unsharded on CPU."""
        return _fresh_model(cfg, path=self.init_path)[0]

    @property
    def epoch(self) -> int:
        """Passes over the offline set completed."""
        return self.sampler.consumed_samples // max(1, self.dataset_len) if self.sampler is not None else 0

    @property
    def num_samples(self) -> int:
        """Rows of the offline set."""
        return self.dataset_len

    def samples_per_step(self, cfg: ILQLConfig) -> int:
        """``batch_size`` rows on every rank."""
        return cfg.batch_size * self.env.world_size

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
    cfg: ILQLConfig, env: DistEnv, *, setup: Setup | None = None, reward: Any = None,
    val_prompts: Sequence[str] | None = None,
) -> State:
    """The ILQL model (the initial policy with new heads seeded by ``cfg.seed``), tokenizer and optimizer.
    The offline set is attached next (``State.attach``); a resumed run then restores the checkpoint into
    the state (``Run.start``). ``setup``: the run's resolved task (default ``Setup.of(cfg)``);
    ``val_prompts`` replaces the task's test split in validation.

    Raises:
        ConfigError: the task's prompts are chat-formatted (offline rows are tokenized as given); a
            ``logit_mask`` file that does not load or does not match the model's vocabulary.
    """
    setup = setup if setup is not None else Setup.of(cfg)
    if setup.chat:  # its offline rows are tokenized as given: chat-formatted validation alone would not match
        raise ConfigError(
            f"the ilql loop does not format prompts as a chat; run task {cfg.task!r} with chat_template=false"
        )
    init_path = setup.initial_policy_path()  # every rank, at set-up
    model, tokenizer = _fresh_model(cfg, env, path=init_path)
    logit_mask = None
    if cfg.logit_mask is not None:
        try:
            logit_mask = SteeredPolicy(model, 0.0, load_logit_mask(cfg.logit_mask)).logit_mask  # checked
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"logit_mask: {e}") from e
    model = prepare(disable_dropout(model).to(env.device).train(), cfg, env)
    return State(
        env=env, tokenizer=tokenizer, model=model, init_path=init_path, make_env=setup.make_env,
        optimizer=make_optimizer(
            model.parameters(), cfg.learning_rate, cfg.weight_decay, cfg.adam_betas, cfg.adam_eps
        ),
        reward=setup.reward(reward), val_prompts=setup.prompts(tokenizer, val_prompts, "test"), logit_mask=logit_mask,
    )


# --------------------------------------------------------------------------------------------------------
# Phases: phase(state, batch, cfg) -> batch
# --------------------------------------------------------------------------------------------------------


def offline_batch(state: State, batch: TensorDictBase | None, cfg: ILQLConfig) -> TensorDictBase:
    """Phase 1: this rank's ``batch_size`` rows of the next ``batch_size * world_size`` of the offline set
    (``rlbits.data.offline.next_batch``); ``batch`` is not read."""
    return next_batch(state.buffer, cfg.batch_size, state.env)


def objective(state: State, micro: TensorDictBase, cfg: ILQLConfig, den: Denominators) -> tuple[torch.Tensor, dict]:
    """ILQL's loss on one microbatch (the module docstring's formulas): ``ILQLModel``'s forward over
    ``input_ids``, read at the response positions (the output at ``P - 1 + t`` is the state before response
    token t). Every term is a token sum over ``den.num_tokens``, the step's global action-token count.

    Stats (shares of the step's token means): ``loss``, ``loss_q``, ``loss_v``, ``loss_cql``, ``loss_awac``,
    ``q_mean`` (the online heads' Q of the taken tokens), ``target_q_mean``, ``v_mean``, ``td_target_mean``
    (r + gamma V(s')), ``advantage_mean`` (target Q - V).
    """
    mb = trim_padding(micro)
    out = state.model(mb["input_ids"], mb["attention_mask"], position_ids_from_mask(mb["attention_mask"]))
    at = slice(mb["prompts"].shape[1] - 1, mb["prompts"].shape[1] - 1 + mb["responses"].shape[1])
    actions, mask, n = mb["responses"], mb["action_mask"], den.num_tokens
    logits, v = out["logits"][:, at].float(), out["v"][:, at].float()
    idx = actions.unsqueeze(-1)
    qs = [out[k][:, at].float() for k in ("q1", "q2") if k in out]
    q_taken = [q.gather(-1, idx).squeeze(-1) for q in qs]
    target_qs = [out[k][:, at].float().gather(-1, idx).squeeze(-1) for k in ("target_q1", "target_q2") if k in out]
    target_q = torch.stack(target_qs).amin(0)
    targets = ilql_targets(token_rewards(mb["rewards"], mask), v.detach(), mask, cfg.gamma)
    loss_q = sum(q_loss(q, targets, mask, n)[0] for q in q_taken)
    loss_v = expectile_loss(v, target_q, mask, cfg.tau, n)[0]
    loss_cql = sum(cql_loss(q, actions, mask, n)[0] for q in qs)
    weights = dict(advantages=(target_q - v).detach(), beta=cfg.awac_beta) if cfg.awac_beta else {}
    loss_awac = awac_loss(logits, actions, mask, n, **weights)[0]
    loss = (
        loss_q  # Bellman error of each Q head: (Q(s_t, a_t) - r_t - gamma V(s_{t+1}))^2
        + loss_v  # expectile regression of V towards the smaller target Q
        + cfg.cql_scale * loss_cql  # conservative Q: cross-entropy of a_t under softmax(Q(s_t, .))
        + cfg.awac_scale * loss_awac  # behaviour cloning of the LM head: -log pi(a_t | s_t)
    )
    terms = {"loss": loss, "loss_q": loss_q, "loss_v": loss_v, "loss_cql": loss_cql, "loss_awac": loss_awac}
    means = {"q_mean": sum(q_taken) / len(q_taken), "target_q_mean": target_q, "v_mean": v, "td_target_mean": targets,
             "advantage_mean": target_q - v}
    stats = {k: x.detach() for k, x in terms.items()}
    return loss, stats | {k: masked_sum(x.detach(), mask) / n for k, x in means.items()}


def update(state: State, batch: TensorDictBase, cfg: ILQLConfig) -> TensorDictBase:
    """Phase 2: one optimizer step on ``objective`` over microbatches of ``batch``
    (``rlbits.loops.update.optimize``; denominators counted over ``action_mask`` on every rank, so N ranks take
    the step one process takes on the whole batch), at the ``lr_scheduler`` rate of this step
    (``rlbits.loops.optim.scheduled``). Adds ``objective``'s stats, ``grad_norm`` (and ``lr`` under a
    schedule), ``rewards`` and ``response_len`` to ``state.metrics``.

    Raises:
        NonFiniteError: a non-finite loss or gradient, naming the step and phase; no update is applied.
    """
    lr = scheduled(cfg, cfg.learning_rate, state.step, 1, run_length(state, cfg))
    optimize(state, batch, cfg, objective, trained=[Trained(state.model, state.optimizer, lr=lr)])
    phases.add_batch_stats(state.metrics, batch)
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
    kw = dict(reward=state.reward, prompts=state.val_prompts, env=state.env, make_env=state.make_env,
              logit_mask=state.logit_mask)
    values, val_batch = steered_validate(state.model, state.tokenizer, cfg, beta=cfg.beta, **kw)
    plain, plain_batch = (
        steered_validate(state.model, state.tokenizer, cfg, beta=0.0, **kw) if cfg.beta != 0 else (values, val_batch)
    )
    if state.step == 0:  # untrained heads: the base is the LM alone
        state.metrics.update({f"{k}_untrained_heads": v for k, v in values.items()})
        values, val_batch = plain, plain_batch
    state.metrics.update({**values, "val_reward_policy": plain["val_reward"]})
    return val_batch


PHASES = (offline_batch, update, sync_targets, validate)
"""The phases of a step, in order (``validate``: the validation phase), each ``phase(state, batch, cfg) -> batch``."""


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------


def train(
    cfg: ILQLConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False, reward: Any = None,
    prompts: Sequence[str] | None = None, samples: Sequence[Any] | None = None, val_prompts: Sequence[str] | None = None,
) -> Path:
    """Train ILQL and return the run directory (``RUN_DIR/final`` holds the LM, tokenizer and heads).

    Args:
        cfg, callbacks, resume, force: as ``rlbits.train`` (``resume``: exact on one process).
        reward: scores the offline set when it is built, and validation; None = the task's reward.
        prompts: prompts to build the offline set from; None = the task's train split.
        samples: the offline set itself: ``(prompt, response, reward)`` triples or dicts, or dialogues
            (``{"dialogue": [prompt, output, ...], "reward": r}`` or ``(dialogue, reward)``: only outputs are
            actions; ``rlbits.data.offline.normalize_samples``).
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
        )
        state = init_state(cfg, run.env, setup=run.setup, reward=reward, val_prompts=val_prompts)
        run.check_lengths(state)
        with run.timed("dataset"):  # 0. the offline set: built from the base policy, or read back on resume
            data = load_or_build_dataset(
                cfg, state, samples=samples, reward=state.reward, prompts=prompts, resume=run.checkpoint is not None,
                write=run.env.is_main,
            )
        if cfg.standardize_rewards:
            data["rewards"] = ilql_standardize_rewards(data["rewards"])
        state.attach(data, cfg.seed)
        run.start(state, validate=validate)
        state.metrics.update({**dataset_stats(data), "time/dataset": run.elapsed("dataset")})
        for _ in run.steps(state):
            with run.step(state):
                with run.phase("data"):  # 1. the next batch of offline rows
                    batch = offline_batch(state, None, cfg)
                with run.phase("update"):  # 2. Q, V, CQL and AWAC losses; one optimizer step
                    batch = update(state, batch, cfg)
                with run.phase("sync"):  # 3. target Q heads towards the online ones
                    batch = sync_targets(state, batch, cfg)
                run.end_step(state, batch)  # 4. log; validate and save when due
        return run.finish(state)


__all__ = [
    "DATASET_DIR",
    "DATASET_FILE",
    "PHASES",
    "ILQLConfig",
    "State",
    "SteeredPolicy",
    "build_offline_dataset",
    "dataset_stats",
    "evaluate_betas",
    "evaluate_run",
    "init_state",
    "load_final",
    "load_logit_mask",
    "load_or_build_dataset",
    "next_batch",
    "normalize_samples",
    "objective",
    "offline_batch",
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
