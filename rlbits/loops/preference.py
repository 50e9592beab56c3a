"""Preference optimisation: offline DPO (and the rest of ``rlbits.DPO_LOSS_TYPES``) on preference pairs, and
online DPO on pairs the policy samples and the task's reward ranks.

Algorithm (one step)::

    offline   1. data       the next num_prompts_per_step pairs (prompt, chosen, rejected) of a seeded order
    online    1. rollout    K = num_generations_per_prompt responses per prompt from the current policy
              2. score      the reward of each response
              3. pairs      per prompt: chosen = the best response, rejected = the worst; a prompt whose K
                            rewards are all equal gives no pair (counted: tie_frac)
    both      4. reference  log pi_ref(y|x) of both responses, summed over tokens (not for simpo)
              5. update     one optimizer step on dpo_loss(h_c, h_r, beta, loss_type), h = log pi_theta(y|x) -
                            log pi_ref(y|x) (Rafailov 2023; simpo: length-normalised log pi_theta, no reference)
              6. log, validate and save (rlbits.loops.run.Run)

Offline pairs come from a ``.jsonl``/``.csv`` file of ``prompt``, ``chosen``, ``rejected``
(``rlbits.data.preferences``; every tenth row held out for validation, or ``val_dataset``), or, with
``dataset: null``, from the task: ``num_generations_per_prompt`` samples of the initial policy for each of
``num_pair_prompts`` train prompts at ``temperature``, ranked by the task's reward, best vs worst, ties
dropped (validation pairs likewise from the first ``max_val_samples`` test prompts). Online DPO follows TRL's
``OnlineDPOTrainer`` with a reward function (two samples per prompt, the higher-scored one chosen), except
that ties give no pair (TRL makes the first sample the chosen one).

The reference is a frozen copy of the initial policy, or with ``lora_rank > 0`` the policy with its
adapters disabled. Log-probabilities are taken at temperature 1 (the models' own distributions, as TRL's
``DPOTrainer``). One process (no torchrun). docs/preference.md: the losses, the metrics, offline vs online.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rlbits.data.offline import tensorize_dataset
from rlbits.data.preferences import Pair, load_reward_data
from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.functional import DPO_LOSS_TYPES, dpo_loss, sequence_logprobs
from rlbits.functional.preference import LABEL_SMOOTHING, REFERENCE_FREE
from rlbits.loops import phases
from rlbits.loops.config import MAX_ROWS, ConfigError, LoRAConfig, OnlineConfig
from rlbits.loops.config_fields import ranged
from rlbits.loops.online import initial_policy, online_fields
from rlbits.loops.optim import make_optimizer, run_length, scheduled
from rlbits.loops.provenance import describe_samples
from rlbits.loops.run import Run
from rlbits.loops.runtime import Setup, autocast, generator, head_args, prepare, with_lora
from rlbits.loops.state import OnlineState, optimizer_of, runtime
from rlbits.loops.update import Denominators, Trained, optimize
from rlbits.models.forward import policy_logprobs

PAIR_KEYS = (
    "prompts",
    "prompt_mask",
    "responses",
    "action_mask",
    "response_mask",
    "input_ids",
    "attention_mask",
)
"""The keys of a pair batch [n, 2] (index 0 the chosen response, 1 the rejected one), as ``docs/batch.md``."""


@dataclasses.dataclass(frozen=True)
class PreferenceConfig(LoRAConfig, OnlineConfig):
    """DPO and its variants, offline on preference pairs or online on the policy's ranked samples."""

    loop: str = "preference"
    """Which loop runs this config; ``preference`` for this one."""
    learning_rate: float = 1e-6
    """AdamW learning rate of the policy (TRL's DPO default)."""
    loss_type: str = "sigmoid"
    """The pairwise loss: a key of ``rlbits.DPO_LOSS_TYPES`` (TRL's ``loss_type`` names: ``sigmoid`` is DPO,
    ``ipo``, ``hinge``, ``robust``, ``bco_pair``, ``sppo_hard``, ``nca_pair``, ``apo_zero``, ``apo_down``,
    ``sigmoid_norm``; ``simpo`` needs no reference)."""
    beta: float = ranged(0.1, gt=0)
    """DPO's beta (inverse temperature of the implicit reward; IPO's tau)."""
    label_smoothing: float = ranged(0.0, ge=0, lt=0.5)
    """Assumed rate of flipped preference labels (cDPO with ``sigmoid``, ``robust``, ``simpo``); 0 otherwise."""
    simpo_gamma: float = ranged(0.5, ge=0)
    """SimPO's target reward margin gamma (``loss_type: simpo``)."""
    online: bool = False
    """Online DPO: each step samples ``num_generations_per_prompt`` responses per prompt from the current
    policy and trains on best vs worst by the reward; False: offline pairs (``dataset``)."""
    num_generations_per_prompt: int = ranged(2, ge=1, at_most=MAX_ROWS)
    """Responses per prompt, online and when building offline pairs from the task (>= 2: best vs worst)."""
    num_prompts_per_step: int = ranged(16, ge=1, at_most=MAX_ROWS)
    """Pairs per step (offline) or prompts sampled per step (online)."""
    dataset: str | None = None
    """Offline pairs: a ``.jsonl``/``.csv`` file of ``prompt``, ``chosen``, ``rejected`` rows
    (``rlbits.data.preferences``); None = built from the task (see ``num_pair_prompts``)."""
    val_dataset: str | None = None
    """Validation pairs for ``dataset`` (a file of the same kind); None = every tenth row of ``dataset``."""
    num_pair_prompts: int = ranged(512, ge=1, at_most=2**20)
    """``dataset: null``: train prompts (a seeded subset) whose samples make the offline pairs."""
    pair_batch_size: int = ranged(128, ge=1, at_most=MAX_ROWS)
    """Prompts per ``generate`` call while building the offline pairs."""

    def check(self) -> None:
        """The groups' checks, then the preference rules. Raises ConfigError naming the field."""
        super().check()
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ConfigError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}; got {self.loss_type!r}")
        if self.label_smoothing > 0 and self.loss_type not in LABEL_SMOOTHING:
            raise ConfigError(
                f"label_smoothing={self.label_smoothing} has no effect with loss_type={self.loss_type!r}; it is "
                f"taken by {', '.join(sorted(LABEL_SMOOTHING))}"
            )
        if (self.online or self.dataset is None) and self.num_generations_per_prompt < 2:
            raise ConfigError(
                f"num_generations_per_prompt must be >= 2 to rank samples into pairs (online, or dataset: null), "
                f"got {self.num_generations_per_prompt}"
            )
        if self.online and self.dataset is not None:
            raise ConfigError(
                "online: true trains on the policy's own samples; remove dataset (or set online: false)"
            )
        if self.val_dataset is not None and self.dataset is None:
            raise ConfigError(
                "val_dataset needs a dataset file (pairs built from the task validate on its test split)"
            )
        for name in ("dataset", "val_dataset"):
            value = getattr(self, name)
            if value is not None and Path(value).suffix not in (".jsonl", ".csv"):
                raise ConfigError(f"{name} must be a .jsonl or .csv file of preference pairs, got {value!r}")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads reference log-probabilities (every type but ``simpo``)."""
        return self.loss_type not in REFERENCE_FREE

    @property
    def generates(self) -> bool:
        """Whether the run samples from its task (online, or offline pairs built from it): validation then
        also reports the policy's task reward (``val_reward``)."""
        return self.online or self.dataset is None


# --- pairs -------------------------------------------------------------------------------------------------


def pair_rows(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` row indices [m] of a rollout's ``rewards`` [B] in contiguous groups of
    ``group_size``: per group the first best and the first worst response; groups whose rewards are all equal
    give none."""
    groups = rewards.view(-1, group_size)
    keep = (groups.amax(1) > groups.amin(1)).nonzero().flatten()
    base = keep * group_size
    return base + groups.argmax(1)[keep], base + groups.argmin(1)[keep]


def stack_pairs(batch: TensorDictBase, chosen: torch.Tensor, rejected: torch.Tensor) -> TensorDict:
    """The pair batch [m, 2] (``PAIR_KEYS``; 0 chosen, 1 rejected) of rows ``chosen`` and ``rejected`` of
    ``batch`` (one rollout: the same widths)."""
    keys = [k for k in PAIR_KEYS if k in batch.keys()]
    flat = batch.select(*keys)
    return torch.stack([flat[chosen], flat[rejected]], dim=1)


def tensorize_pairs(rows: Sequence[dict[str, Any]], tokenizer: Any) -> TensorDict:
    """Pair rows ``{prompt, chosen, rejected}`` (with ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` when
    sampled: used as they are; else tokenized, EOS appended, by ``tensorize_dataset``) as a pair batch [N, 2].

    Raises:
        ValueError: a prompt that tokenizes to nothing.
    """
    flat = []
    for side in ("chosen", "rejected"):
        for r in rows:
            row = {"prompt": r["prompt"], "response": r[side], "reward": 0.0}
            if f"{side}_ids" in r:
                row.update(prompt_ids=r["prompt_ids"], response_ids=r[f"{side}_ids"])
            flat.append(row)
    data = tensorize_dataset(flat, tokenizer)
    n = len(rows)
    return torch.stack([data[:n].select(*PAIR_KEYS), data[n:].select(*PAIR_KEYS)], dim=1)


def sample_pairs(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    reward: Any,
    cfg: PreferenceConfig,
    gen: torch.Generator,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Offline pairs from the task: ``num_generations_per_prompt`` samples of ``policy`` per prompt at
    ``cfg.temperature`` (``pair_batch_size`` prompts per call, noise from ``gen``), scored by ``reward``, the
    best vs the worst of each prompt (ties dropped). Returns the rows (texts, token ids, rewards) and
    ``{"dataset/pairs", "dataset/tie_frac", "dataset/sample_reward"}`` (logged at the first step)."""
    k, rows, ties, total = cfg.num_generations_per_prompt, [], 0, 0.0
    for start in range(0, len(prompts), cfg.pair_batch_size):
        chunk = list(prompts[start : start + cfg.pair_batch_size])
        batch = phases.generate_rollout(
            policy,
            tokenizer,
            chunk,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            num_samples=k,
            generator=gen,
            pack_weights=phases.pack_weights(cfg),
            continuous_batching=cfg.continuous_batching,
            max_num_seqs=cfg.max_num_seqs,
        )
        rewards = phases.score_rollout(batch, reward).float().cpu()
        total += rewards.sum().item()
        chosen, rejected = pair_rows(rewards, k)
        ties += len(chunk) - len(chosen)
        p_ids, p_mask = batch["prompts"].tolist(), batch["prompt_mask"].tolist()
        r_ids, a_mask = batch["responses"].tolist(), batch["action_mask"].tolist()
        for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True):
            rows.append(
                {
                    "prompt": batch["prompt_text"][c],
                    "chosen": batch["response_text"][c],
                    "rejected": batch["response_text"][r],
                    "chosen_reward": float(rewards[c]),
                    "rejected_reward": float(rewards[r]),
                    "prompt_ids": [t for t, m in zip(p_ids[c], p_mask[c], strict=True) if m],
                    "chosen_ids": [t for t, m in zip(r_ids[c], a_mask[c], strict=True) if m],
                    "rejected_ids": [t for t, m in zip(r_ids[r], a_mask[r], strict=True) if m],
                }
            )
    stats = {
        "dataset/pairs": float(len(rows)),
        "dataset/tie_frac": ties / max(len(prompts), 1),
        "dataset/sample_reward": total / max(len(prompts) * k, 1),
    }
    return rows, stats


def load_pairs(cfg: PreferenceConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train rows, validation rows)`` of ``cfg.dataset`` (``load_reward_data``: every tenth row held out,
    or ``val_dataset``; at most ``max_val_samples`` validation pairs).

    Raises:
        ConfigError: a bad file, or one of labelled texts instead of pairs. FileNotFoundError: a missing one.
    """
    try:
        train, val = load_reward_data(
            cfg.dataset,
            val_dataset=cfg.val_dataset,
            max_val_samples=cfg.max_val_samples,
            val_prefix_words=0,
            seed=cfg.seed,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(train[0], Pair):
        raise ConfigError(
            f"dataset {cfg.dataset!r} holds labelled texts; the preference loop needs pairs "
            "(prompt, chosen, rejected)"
        )
    return [dataclasses.asdict(p) for p in train], [dataclasses.asdict(p) for p in val["val"]]


# --- state -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class State(OnlineState):
    """Everything a preference run carries from step to step (``OnlineState``: the policy, its frozen
    reference, the reward, the random streams; ``stream``: the prompts online, the pair indices offline)."""

    optimizer: torch.optim.Optimizer = optimizer_of("policy")
    """AdamW over the parameters that train: all of the policy's, or only its LoRA adapters."""
    pairs: TensorDictBase | None = runtime(default=None)
    """Offline: the train pairs [N, 2] (rebuilt identically on resume); None online."""
    val_pairs: TensorDictBase | None = runtime(default=None)
    """Offline: the validation pairs [M, 2]; None online."""
    pair_rows: list[dict[str, Any]] = runtime(default_factory=list)
    """Offline: the train pairs as rows (texts; provenance and ``RUN_DIR/pairs.jsonl``)."""
    pair_stats: dict[str, float] = runtime(default_factory=dict)
    """Offline pairs built from the task: their count, tie fraction and mean sample reward."""
    val_ref_logps: torch.Tensor | None = runtime(default=None)
    """The reference's sequence log-probabilities of ``val_pairs`` [M, 2], computed at the first validation."""


def init_state(
    cfg: PreferenceConfig,
    env: DistEnv,
    *,
    setup: Setup | None = None,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    val_prompts: Sequence[str] | None = None,
) -> State:
    """Load the policy and (unless ``simpo``) a frozen reference (with LoRA: the adapters disabled), the
    optimizer and the generators; offline, the pairs (read from ``dataset`` or sampled from the initial
    policy with a generator of their own, so a resumed run rebuilds the same ones) and a stream over them.
    A resumed run then restores the checkpoint into it (``Run.start``)."""
    setup = setup if setup is not None else Setup.of(cfg)
    init_path, policy, tokenizer, reference = initial_policy(cfg, env, setup, reference=cfg.uses_reference)
    policy = prepare(with_lora(policy, cfg).train(), cfg, env)
    fields = online_fields(
        cfg, env, setup, tokenizer, init_path, reward=reward, prompts=prompts, val_prompts=val_prompts
    )
    extra: dict[str, Any] = {}
    if not cfg.online:
        if cfg.dataset is not None:
            rows, val_rows = load_pairs(cfg)
        else:
            gen = generator(cfg.seed, 0, "pairs", env.device)
            train_prompts = PromptStream(fields["stream"].prompts, cfg.seed).next(
                min(cfg.num_pair_prompts, len(fields["stream"]))
            )  # a seeded subset of the train prompts
            with torch.no_grad(), autocast(policy, cfg):
                rows, extra["pair_stats"] = sample_pairs(
                    policy, tokenizer, train_prompts, fields["reward"], cfg, gen
                )
                val_rows, _ = sample_pairs(
                    policy,
                    tokenizer,
                    fields["val_prompts"][: cfg.max_val_samples],
                    fields["reward"],
                    cfg,
                    gen,
                )
        if not rows:
            raise ConfigError("no preference pairs: every prompt's samples got the same reward (all ties)")
        extra.update(
            pair_rows=rows,
            pairs=tensorize_pairs(rows, tokenizer).to(env.device),
            val_pairs=tensorize_pairs(val_rows, tokenizer).to(env.device) if val_rows else None,
        )
        fields["stream"] = PromptStream(list(range(len(rows))), cfg.seed)
    return State(
        policy=policy,
        reference=reference,
        optimizer=make_optimizer(
            policy.parameters(), cfg.learning_rate, cfg.weight_decay, cfg.adam_betas, cfg.adam_eps
        ),
        **fields,
        **extra,
    )


# --- phases: phase(state, batch, cfg) -> batch --------------------------------------------------------------


def data(state: State, batch: Any, cfg: PreferenceConfig) -> TensorDictBase:
    """Phase 1 (offline): the next ``num_prompts_per_step`` pairs of ``state.stream`` as a pair batch [n, 2].
    ``batch`` is not read."""
    index = torch.tensor(state.stream.next(cfg.num_prompts_per_step), device=state.pairs.device)
    return state.pairs[index]


rollout = phases.rollout
"""Phase 1 (online): K responses per prompt from the current policy, groups contiguous (``phases.rollout``)."""


def score(state: State, batch: TensorDictBase, cfg: PreferenceConfig) -> TensorDictBase:
    """Phase 2 (online): ``rewards`` [B] from ``state.reward``; adds ``gen_rewards`` (their mean) and
    ``response_len``."""
    rewards = phases.score_rollout(batch, state.reward)
    state.metrics.mean("gen_rewards", rewards.sum(), rewards.numel())
    state.metrics.mean("response_len", batch["action_mask"].sum().float(), rewards.numel())
    return batch


def pairs(state: State, batch: TensorDictBase, cfg: PreferenceConfig) -> TensorDictBase:
    """Phase 3 (online): the pair batch [m, 2] of the scored rollout: per prompt its best response (chosen)
    and its worst (rejected); prompts whose responses all scored the same give none. Adds ``pairs`` (m) and
    ``tie_frac``."""
    k = cfg.num_generations_per_prompt
    chosen, rejected = pair_rows(batch["rewards"], k)
    groups = batch.batch_size[0] // k
    state.metrics.sum("pairs", float(len(chosen)))
    state.metrics.mean("tie_frac", float(groups - len(chosen)), groups)
    return stack_pairs(batch, chosen, rejected)


def _sequence_logps(
    model: torch.nn.Module, pair_batch: TensorDictBase, cfg: PreferenceConfig
) -> torch.Tensor:
    """[n, 2]: the summed (``simpo``: averaged) log-probabilities of both responses of each pair under ``model``
    at temperature 1, float32."""
    flat = pair_batch.reshape(-1)
    logprobs = policy_logprobs(model, flat, temperature=1.0, **phases.scoring_args(cfg), **head_args(cfg))
    seq = sequence_logprobs(logprobs.float(), flat["action_mask"], average=not cfg.uses_reference)
    return seq.view(-1, 2)


def reference(state: State, batch: TensorDictBase, cfg: PreferenceConfig) -> TensorDictBase:
    """Phase 4: ``ref_logps`` [n, 2], the reference's sequence log-probabilities of both responses
    (``phases.reference_model``: the frozen copy, or the policy with its adapters disabled). Nothing for
    ``simpo`` (no reference) or an empty batch."""
    if cfg.uses_reference and batch.batch_size[0] > 0:
        with torch.no_grad(), phases.reference_model(state) as ref, autocast(ref, cfg):
            batch["ref_logps"] = _sequence_logps(ref, batch, cfg)
    return batch


def loss_of(
    logps: torch.Tensor, batch: TensorDictBase, cfg: PreferenceConfig, num_pairs: Any = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``dpo_loss`` of the pairs of ``batch`` given the policy's sequence log-probabilities ``logps`` [n, 2]
    (log-ratios against ``batch["ref_logps"]``; ``simpo``: the averaged log-probabilities themselves), with the
    responses' lengths. Adds ``logps/chosen`` and ``logps/rejected`` to TRL's metrics."""
    h = logps - batch["ref_logps"] if cfg.uses_reference else logps
    lengths = batch["action_mask"].sum(-1)
    loss, metrics = dpo_loss(
        h[:, 0],
        h[:, 1],
        cfg.beta,
        cfg.loss_type,
        label_smoothing=cfg.label_smoothing,
        chosen_lengths=lengths[:, 0],
        rejected_lengths=lengths[:, 1],
        simpo_gamma=cfg.simpo_gamma,
        num_pairs=num_pairs,
    )
    detached = logps.detach()
    return loss, {**metrics, "logps/chosen": detached[:, 0].mean(), "logps/rejected": detached[:, 1].mean()}


def objective(
    state: State, micro: TensorDictBase, cfg: PreferenceConfig, den: Denominators
) -> tuple[torch.Tensor, dict]:
    """The loss of one microbatch of pairs over the step's pair count (so the microbatches' gradients add up
    to the batch's mean loss). Stats: ``loss`` and the pair means over the step of ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``."""
    n = micro.batch_size[0]
    loss, metrics = loss_of(_sequence_logps(state.policy, micro, cfg), micro, cfg, num_pairs=den.num_rows)
    return loss, {"loss": loss.detach(), **{k: (v * n, n) for k, v in metrics.items()}}


def update(state: State, batch: TensorDictBase, cfg: PreferenceConfig) -> TensorDictBase:
    """Phase 5: one optimizer step on ``objective`` over microbatches of ``microbatch_size`` pairs
    (``rlbits.loops.update.optimize``); an empty batch (every online prompt a tie) trains nothing. The
    learning rate follows ``lr_scheduler`` (``rlbits.loops.optim.scheduled``, one optimizer step per step).
    Adds ``objective``'s stats and ``grad_norm`` (and ``lr`` under a schedule).

    Raises:
        NonFiniteError: a non-finite loss or gradient (the policy is left untouched).
    """
    if batch.batch_size[0] == 0:
        return batch
    state.policy.train()
    lr = scheduled(cfg, cfg.learning_rate, state.step, 1, run_length(state, cfg))
    optimize(state, batch, cfg, objective, trained=[Trained(state.policy, state.optimizer, lr=lr)], mask=None)
    return batch


def validate(state: State, batch: Any, cfg: PreferenceConfig) -> Any:
    """Validation: on the held-out pairs (offline) ``val_loss`` and ``val_rewards/accuracies``,
    ``val_rewards/margins``, ``val_rewards/chosen``, ``val_rewards/rejected`` (TRL's eval metrics); and when
    the run samples from its task (online, or pairs built from it) the policy's mean task reward on the test
    prompts (``phases.validate_policy``: ``val_reward``, ...). Returns the validation rollout (or ``batch``)."""
    if state.val_pairs is not None:
        with torch.no_grad():
            if cfg.uses_reference and state.val_ref_logps is None:
                with phases.reference_model(state) as ref, autocast(ref, cfg):
                    state.val_ref_logps = _sequence_logps(ref, state.val_pairs, cfg)
            state.policy.eval()
            with autocast(state.policy, cfg):
                logps = _sequence_logps(state.policy, state.val_pairs, cfg)
            val = state.val_pairs.select("action_mask")
            if state.val_ref_logps is not None:
                val["ref_logps"] = state.val_ref_logps
            loss, metrics = loss_of(logps, val, cfg)
        state.metrics.update({"val_loss": loss.item(), **{f"val_{k}": v.item() for k, v in metrics.items()}})
        state.policy.train()
    if cfg.generates:
        batch = phases.validate_policy(state, batch, cfg)
        state.policy.train()
    return batch


PHASES = (data, rollout, score, pairs, reference, update, validate)
"""The phases of a step, in order (``data``: offline; ``rollout``, ``score``, ``pairs``: online; ``validate``:
the validation phase), each ``phase(state, batch, cfg) -> batch``."""

evaluate_run = phases.evaluate_run
"""``rlbits eval RUN_DIR``: the final policy's test-split reward next to the base model's."""


# --- the loop ----------------------------------------------------------------------------------------------


def train(
    cfg: PreferenceConfig,
    *,
    callbacks: Sequence[Any] = (),
    resume: bool = False,
    force: bool = False,
    reward: Callable | Any = None,
    prompts: Sequence[str] | None = None,
    val_prompts: Sequence[str] | None = None,
) -> Path:
    """Run offline or online preference optimisation for ``cfg.max_num_steps`` steps (or ``max_num_epochs``
    passes over the offline pairs) and return the run directory (``RUN_DIR/final/``: the policy;
    ``RUN_DIR/pairs.jsonl``: the offline train pairs).

    ``callbacks``, ``resume``, ``force``, ``reward``, ``prompts``, ``val_prompts``: as ``rlbits.train``
    (``reward``, ``prompts``: the reward and prompts the pairs are sampled and ranked with).

    Raises:
        ConfigError: ``cfg`` is not a valid ``PreferenceConfig``; a bad pairs file; no pairs; torchrun.
        ResumeMismatchError: a resume with other inputs or other pairs than the run was started with.
        NonFiniteError: a non-finite loss or gradient (names the step and phase).
    """
    if not isinstance(cfg, PreferenceConfig):
        raise ConfigError(f"cfg must be a PreferenceConfig, got {type(cfg).__name__}")
    reward = cfg.resolve_reward(reward)
    with Run(cfg, callbacks=callbacks, resume=resume, force=force) as run:
        if run.env.world_size > 1:
            raise ConfigError("the preference loop runs on one process; start it without torchrun")
        prompts, val_prompts = run.check_inputs(reward=reward, prompts=prompts, val_prompts=val_prompts)
        with run.timed("pairs"):  # 0. offline pairs: read, or sampled from the initial policy and ranked
            state = init_state(
                cfg, run.env, setup=run.setup, reward=reward, prompts=prompts, val_prompts=val_prompts
            )
        if state.pair_rows:
            run.record_provenance({**run.provenance, "pairs": describe_samples(state.pair_rows)})
            if run.env.is_main and not resume:
                text = "".join(json.dumps(r) + "\n" for r in state.pair_rows)
                (run.dir / "pairs.jsonl").write_text(text)
        run.start(state, validate=validate)
        for _ in run.steps(state):
            with run.step(state):
                if cfg.online:
                    with run.phase("rollout"):  # 1. K responses per prompt from the current policy
                        batch = rollout(
                            state, state.stream.next_batch(cfg.num_prompts_per_step, run.env), cfg
                        )
                    with run.phase("score"):  # 2. their rewards
                        batch = score(state, batch, cfg)
                    with run.phase("pairs"):  # 3. best vs worst per prompt
                        batch = pairs(state, batch, cfg)
                else:
                    with run.phase("data"):  # 1. the next offline pairs
                        batch = data(state, None, cfg)
                    if state.step == 0:  # what the pairs were built from, logged once
                        state.metrics.update(state.pair_stats)
                with run.phase("reference"):  # 4. the reference's sequence log-probabilities
                    batch = reference(state, batch, cfg)
                with run.phase("update"):  # 5. one DPO step
                    batch = update(state, batch, cfg)
                run.end_step(state, batch)  # 6. log; validate and save when due
        return run.finish(state)  # RUN_DIR/final/: the policy


__all__ = [
    "PAIR_KEYS",
    "PHASES",
    "PreferenceConfig",
    "State",
    "data",
    "evaluate_run",
    "init_state",
    "load_pairs",
    "loss_of",
    "objective",
    "pair_rows",
    "pairs",
    "reference",
    "rollout",
    "sample_pairs",
    "score",
    "stack_pairs",
    "tensorize_pairs",
    "train",
    "update",
    "validate",
]
