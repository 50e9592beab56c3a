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
``dataset_temperature`` for the task's train prompts and scored with the task's reward. It is written to
``RUN_DIR/offline_dataset.jsonl`` (text and token ids) and a resumed run reads it back from there. Each
step takes the next ``batch_size`` samples of a seeded per-epoch permutation of the set.

Where the rest lives: ``SteeredPolicy`` in ``rlbits.models.steered``; ``steered_validate``, ``load_final``,
``evaluate_betas`` and ``evaluate_run`` in ``rlbits.loops.evaluate``. They are importable from here too.

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
``loss_cql``, ``loss_awac``, ``q_mean``, ``target_q_mean``, ``v_mean``, ``q_target_mean``,
``advantage_mean``, ``rewards``, ``response_len``, ``grad_norm``, ``epoch``, ``tokens_per_s``, ``time/*``;
at validation ``val_reward``, ``val_reward_std``, ``val_response_len`` (steered at ``beta``) and
``val_reward_policy`` (the trained LM head alone, beta = 0).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rlbits.batch import build_batch, make_prompts, pad_right, trim_padding
from rlbits.distributed.checkpoint import (
    export_model,
    hf_folder,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    tokenizer_folder,
)
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import unsharded
from rlbits.distributed.reduce import any_rank, global_count, reduce_metrics
from rlbits.functional import (
    awac_loss,
    cql_loss,
    expectile_loss,
    ilql_targets,
    q_loss,
    token_rewards,
)
from rlbits.loops.common import (
    PhaseTimer,
    autocast,
    clip_and_step,
    disable_dropout,
    load_policy_and_tokenizer,
    make_optimizer,
    policy_path,
    prepare,
    rollout,
    sample_rows,
    score_rollout,
    setup,
    skipped_step,
)
from rlbits.loops.config import ConfigError, RunConfig, field_docs
from rlbits.loops.data import PromptStream
from rlbits.loops.evaluate import evaluate_betas, steered_validate
from rlbits.loops.evaluate import evaluate_ilql_run as evaluate_run
from rlbits.loops.evaluate import load_ilql_final as load_final
from rlbits.loops.run import Run
from rlbits.models.forward import position_ids_from_mask
from rlbits.models.heads import ILQLModel
from rlbits.models.load import load_tokenizer
from rlbits.models.steered import SteeredPolicy
from rlbits.tasks import get_task

DATASET_FILE = "offline_dataset.jsonl"
MODEL_NAME = "policy"  # the ILQL model is checkpointed under this name: an HF policy folder plus the heads


@dataclasses.dataclass(frozen=True)
class ILQLConfig(RunConfig):
    """ILQL on an offline dataset (trlx's ``ILQLConfig`` names where one exists)."""

    loop: str = "ilql"
    """Which loop runs this config: ``ilql`` here."""
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
    batch_size: int = 32
    """Offline samples per optimizer step (trlx ``batch_size``)."""
    tau: float = 0.7
    """Expectile of the V regression in (0, 1): 0.5 is plain regression, larger tracks the best actions."""
    gamma: float = 0.99
    """Discount per response token in the Bellman targets."""
    cql_scale: float = 0.1
    """Weight of the conservative (CQL) term, summed over the Q heads."""
    awac_scale: float = 1.0
    """Weight of the LM's negative log-likelihood of the dataset tokens (keeps the trunk a language model)."""
    alpha: float = 0.1
    """Target-head update ``target = alpha * online + (1 - alpha) * target`` (1 = hard copy)."""
    steps_for_target_q_sync: int = 1
    """Apply that update every this many optimizer steps."""
    beta: float = 4.0
    """Steering strength at decoding: logits + beta * (Q - V); 0 samples the trained LM itself."""
    two_qs: bool = True
    """Two Q heads (clipped double Q: targets use the minimum of the two target heads)."""
    head_layers: int = 2
    """2: trlx's MLP heads (hidden -> 2 hidden -> out); 1: linear heads."""
    shared_trunk: bool = True
    """Heads read the LM's own hidden states (True, trlx) or a trainable copy of its trunk (False, 2x cost)."""
    dataset_size: int = 2048
    """Responses sampled from the base model for the offline set (ignored with ``samples=`` or ``dataset_path``)."""
    dataset_temperature: float = 1.0
    """Sampling temperature of the offline set's responses."""
    dataset_batch_size: int = 256
    """Prompts per ``generate`` call while building the offline set."""
    dataset_path: str | None = None
    """JSONL file of offline samples, one ``{"prompt", "response", "reward"}`` object per line; None builds the set."""

    def validate(self) -> None:
        """RunConfig's checks plus ILQL's ranges. Raises ConfigError naming the field."""
        super().validate()
        docs = field_docs(type(self))
        if self.loop != "ilql":
            raise ConfigError(f"loop must be 'ilql' for ILQLConfig, got {self.loop!r}")
        for name in ("batch_size", "steps_for_target_q_sync", "dataset_size", "dataset_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)} ({docs[name]})")
        if not 0 < self.tau < 1:
            raise ConfigError(f"tau must be in (0, 1), got {self.tau} ({docs['tau']})")
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"gamma must be in [0, 1], got {self.gamma} ({docs['gamma']})")
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"alpha must be in [0, 1] (1 = hard copy), got {self.alpha} ({docs['alpha']})")
        for name in ("cql_scale", "awac_scale", "beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value} ({docs[name]})")
        if not self.dataset_temperature > 0:
            raise ConfigError(f"dataset_temperature must be > 0, got {self.dataset_temperature}")
        if self.head_layers not in (1, 2):
            raise ConfigError(f"head_layers must be 1 (linear) or 2 (MLP, as trlx), got {self.head_layers}")
        if self.dataset_path is not None and not Path(self.dataset_path).is_file():
            raise ConfigError(f"dataset_path {self.dataset_path!r} is not a file ({docs['dataset_path']})")


# --------------------------------------------------------------------------------------------------------
# The offline dataset
# --------------------------------------------------------------------------------------------------------


def _as_row(i: int, sample: Any) -> dict[str, Any]:
    if isinstance(sample, dict):
        missing = [k for k in ("prompt", "response", "reward") if k not in sample]
        if missing:
            raise ValueError(
                f"samples[{i}] lacks key(s) {missing}; each sample needs prompt, response, reward"
            )
        row = dict(sample)
    elif isinstance(sample, (tuple, list)) and len(sample) == 3:
        row = {"prompt": sample[0], "response": sample[1], "reward": sample[2]}
    else:
        raise ValueError(
            f"samples[{i}] must be a (prompt, response, reward) triple or a dict with those keys, got {sample!r:.80}"
        )
    if not isinstance(row["prompt"], str) or not row["prompt"]:
        raise ValueError(f"samples[{i}]: prompt must be a non-empty str, got {row['prompt']!r:.80}")
    if not isinstance(row["response"], str):
        raise ValueError(f"samples[{i}]: response must be a str, got {row['response']!r:.80}")
    try:
        row["reward"] = float(row["reward"])
    except (TypeError, ValueError):
        raise ValueError(f"samples[{i}]: reward must be a number, got {row['reward']!r:.80}") from None
    if not math.isfinite(row["reward"]):
        raise ValueError(f"samples[{i}]: reward must be finite, got {row['reward']}")
    return row


def normalize_samples(samples: Sequence[Any]) -> list[dict[str, Any]]:
    """Check an offline dataset and turn it into dicts ``{prompt, response, reward}`` (extra keys kept).

    Raises:
        ValueError: an empty dataset, or a sample that is not a triple/dict of (non-empty str, str, finite
            number); the message names the sample's index.
    """
    if isinstance(samples, (str, bytes)) or len(samples) == 0:
        raise ValueError("samples must be a non-empty list of (prompt, response, reward) triples or dicts")
    return [_as_row(i, s) for i, s in enumerate(samples)]


def build_offline_dataset(
    task_or_reward: str | Any,
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    n: int,
    *,
    seed: int,
    temperature: float = 1.0,
    max_new_tokens: int = 24,
    batch_size: int = 256,
) -> list[dict[str, Any]]:
    """Sample ``n`` responses from ``policy`` and score them: the offline set ILQL learns from.

    Prompts are taken in a seeded order (a fresh permutation per pass, as ``PromptStream``), one response
    each; sampling noise comes from a generator seeded with ``seed``, so the same arguments give the same
    set. The rows keep the exact sampled token ids (``prompt_ids``, ``response_ids``, EOS included when it
    was sampled), so training sees the tokens the policy produced.

    Args:
        task_or_reward: a task name (its ``reward`` scores) or a reward (callable, reward model, URL).
        policy: the behaviour policy (usually the base model).
        tokenizer: its tokenizer.
        prompts: prompt strings to draw from.
        n: number of samples.
        seed: seeds the prompt order and the sampling noise.
        temperature: sampling temperature (> 0).
        max_new_tokens: longest response.
        batch_size: prompts per ``generate`` call.

    Returns:
        ``n`` dicts with ``prompt``, ``response``, ``reward``, ``prompt_ids``, ``response_ids``.

    Raises:
        ValueError: ``n < 1``, no prompts, ``temperature <= 0``; as ``score`` for bad rewards.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample an offline set, got {temperature}")
    reward = get_task(task_or_reward).reward if isinstance(task_or_reward, str) else task_or_reward
    stream = PromptStream(list(prompts), seed)
    device = next(policy.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed + 104_729)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        chunk = stream.next(min(batch_size, n - len(rows)))
        batch = rollout(
            policy,
            tokenizer,
            chunk,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=generator,
        )
        rewards = score_rollout(batch, reward).tolist()
        p_mask, a_mask = batch["prompt_mask"].tolist(), batch["action_mask"].tolist()
        for i, (p_ids, r_ids) in enumerate(
            zip(batch["prompts"].tolist(), batch["responses"].tolist(), strict=True)
        ):
            rows.append(
                {
                    "prompt": batch["prompt_text"][i],
                    "response": batch["response_text"][i],
                    "reward": float(rewards[i]),
                    "prompt_ids": [t for t, m in zip(p_ids, p_mask[i], strict=True) if m],
                    "response_ids": [t for t, m in zip(r_ids, a_mask[i], strict=True) if m],
                }
            )
    return rows


def save_dataset(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write rows as JSONL (atomically: a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(path)
    return path


def read_dataset(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL offline set, checked by ``normalize_samples``.

    Raises:
        ValueError: a line that is not JSON (named by line number), or a bad sample.
    """
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {i} is not valid JSON ({e})") from e
    return normalize_samples(rows)


def tensorize_dataset(rows: Sequence[dict[str, Any]], tokenizer: Any) -> TensorDict:
    """The offline set as one batch TensorDict [N] (``build_batch``): ``prompts``/``prompt_mask``
    (left-padded), ``responses``/``action_mask`` (right-padded), ``input_ids``/``attention_mask``,
    ``rewards`` [N] float32.

    Rows with ``prompt_ids``/``response_ids`` use them as they are; text-only rows are tokenized without
    special tokens and the tokenizer's EOS is appended to the response (the end of a sample is terminal).

    Raises:
        ValueError: a prompt that tokenizes to nothing.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompt_ids, response_ids = [], []
    for i, row in enumerate(rows):
        p = row.get("prompt_ids") or tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        if "response_ids" in row:
            r = list(row["response_ids"])
        else:
            r = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + (
                [eos] if eos is not None else []
            )
        if not p:
            raise ValueError(f"sample {i}: prompt {row['prompt']!r:.60} tokenizes to no tokens")
        if not r:
            raise ValueError(f"sample {i}: response is empty and the tokenizer has no EOS to stand for it")
        prompt_ids.append(p)
        response_ids.append(r)
    prompts = make_prompts(prompt_ids, pad)
    responses = pad_right([torch.tensor(r, dtype=torch.int64) for r in response_ids], pad)
    action_mask = pad_right([torch.ones(len(r), dtype=torch.bool) for r in response_ids], False)
    rewards = torch.tensor([float(r["reward"]) for r in rows], dtype=torch.float32)
    return build_batch(prompts["prompts"], prompts["prompt_mask"], responses, action_mask, rewards=rewards)


# --------------------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class State:
    """Everything a step reads and writes. ``step`` counts completed optimizer steps."""

    model: ILQLModel
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    step: int = 0
    total_steps: int = 0
    consumed_samples: int = 0
    total_valid_tokens: int = 0
    val_reward: float | None = None
    dataset_len: int = 0
    checkpoint: Path | None = None


def _fresh_model(cfg: ILQLConfig, env: DistEnv | None = None) -> tuple[ILQLModel, Any]:
    """The initial policy with new Q/V heads (seeded by ``cfg.seed``) and its tokenizer."""
    policy, tokenizer = load_policy_and_tokenizer(policy_path(cfg), env or DistEnv())
    model = ILQLModel(
        policy, two_qs=cfg.two_qs, head_layers=cfg.head_layers, shared_trunk=cfg.shared_trunk, seed=cfg.seed
    )
    return model, tokenizer


def init_state(cfg: ILQLConfig, env: DistEnv, *, resume_from: str | Path | None = None) -> State:
    """The ILQL model, tokenizer, optimizer and counters: fresh from the policy, or from a checkpoint.

    Fresh: the policy of ``cfg.policy`` (or the task's base model) with new heads seeded by ``cfg.seed``.
    Resumed: model (heads and target heads included), optimizer, RNG states and counters of
    ``resume_from``. ``total_steps`` is set by ``train`` once the dataset size is known.
    """
    folder = hf_folder(resume_from, MODEL_NAME)
    if folder is not None:  # saved at world size 1: the ILQL model's own folder
        model = ILQLModel.from_pretrained(folder)
        tokenizer = load_tokenizer(folder)
    else:  # fresh, or its weights come from the checkpoint's dcp/ below
        model, tokenizer = _fresh_model(cfg, env)
        if resume_from is not None:
            tokenizer = load_tokenizer(tokenizer_folder(resume_from))
    model = prepare(disable_dropout(model).to(env.device).train(), cfg, env)
    optimizer = make_optimizer(model.parameters(), cfg.learning_rate, cfg.weight_decay)
    state = State(model=model, tokenizer=tokenizer, optimizer=optimizer)
    if resume_from is not None:
        saved = load_checkpoint(
            resume_from, models={MODEL_NAME: model}, optimizers={MODEL_NAME: optimizer}, env=env
        )
        state.step = saved["current_step"]
        state.consumed_samples = saved["consumed_samples"]
        state.total_valid_tokens = saved["total_valid_tokens"]
        state.val_reward = saved.get("val_reward")
        state.checkpoint = Path(resume_from)
    return state


def load_or_build_dataset(
    cfg: ILQLConfig,
    state: State,
    *,
    samples: Sequence[Any] | None = None,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    resume: bool = False,
    write: bool = True,
) -> list[dict[str, Any]]:
    """Phase 0: the offline set, also written to ``RUN_DIR/offline_dataset.jsonl`` (if ``write``).

    A resumed run reads that file back (the policy has trained since, so it cannot rebuild the set).
    Otherwise: ``samples`` if given, else ``cfg.dataset_path``, else ``build_offline_dataset`` with the
    current (base) policy on ``prompts`` (default: the task's train split) scored by ``reward`` (default:
    the task's).

    Raises:
        FileNotFoundError: resuming a run that has no dataset file.
    """
    path = Path(cfg.run_dir) / DATASET_FILE
    if resume:
        if not path.is_file():
            raise FileNotFoundError(
                f"cannot resume {cfg.run_dir!r}: its offline dataset {str(path)!r} is missing"
            )
        return read_dataset(path)
    if samples is not None:
        rows = normalize_samples(samples)
    elif cfg.dataset_path is not None:
        rows = read_dataset(cfg.dataset_path)
    else:
        task = get_task(cfg.task)
        with unsharded(state.model):  # a sharded model's root holds the embeddings: gather all of it
            rows = build_offline_dataset(
                reward if reward is not None else cfg.task,
                state.model.policy,
                state.tokenizer,
                list(prompts) if prompts is not None else task.prompts("train"),
                cfg.dataset_size,
                seed=cfg.seed,
                temperature=cfg.dataset_temperature,
                max_new_tokens=cfg.max_new_tokens,
                batch_size=cfg.dataset_batch_size,
            )
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_dataset(rows, path)
    return rows


def dataset_stats(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Size and reward statistics of the offline set (logged at step 0 as ``dataset/*``)."""
    r = torch.tensor([row["reward"] for row in rows], dtype=torch.float64)
    return {
        "dataset/size": float(len(rows)),
        "dataset/reward_mean": r.mean().item(),
        "dataset/reward_std": r.std().item() if len(rows) > 1 else 0.0,
        "dataset/reward_max": r.max().item(),
        "dataset/reward_min": r.min().item(),
    }


# --------------------------------------------------------------------------------------------------------
# Phases of a step
# --------------------------------------------------------------------------------------------------------


def next_batch(
    data: TensorDict, stream: PromptStream, batch_size: int, env: DistEnv | None = None
) -> TensorDictBase:
    """Phase 1: the next ``batch_size`` rows of the per-epoch shuffled order, padding trimmed (under torchrun:
    this rank's ``batch_size`` rows of the next ``batch_size * world_size``)."""
    env = env or DistEnv()
    rows = stream.next(batch_size * env.world_size)[env.rank * batch_size : (env.rank + 1) * batch_size]
    index = torch.tensor(rows, dtype=torch.int64)
    return trim_padding(data[index])


def ilql_loss(
    out: dict[str, torch.Tensor],
    batch: TensorDictBase,
    cfg: ILQLConfig,
    num_tokens: int | torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ILQL loss of one (micro)batch from ``ILQLModel.forward``'s outputs over ``input_ids``.

    Reads the response positions: the output at ``P - 1 + t`` is the state before response token t. Each
    term is a token sum divided by ``num_tokens`` (the step's action-token count), so microbatch losses add
    up to the step's token mean.

    Returns:
        ``(loss, metrics)`` with ``loss_q``, ``loss_v``, ``loss_cql``, ``loss_awac``, ``q_mean``,
        ``target_q_mean``, ``v_mean``, ``q_target_mean``, ``advantage_mean`` (token-sum weighted, detached).
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
        "q_target_mean": share(targets),
        "advantage_mean": share(target_q - v),
    }
    return loss, metrics


def update(
    state: State, batch: TensorDictBase, cfg: ILQLConfig, step: int, env: DistEnv | None = None
) -> dict[str, torch.Tensor]:
    """Phase 2: forward/backward over microbatches of ``batch``, clip, one optimizer step. Every loss term is
    divided by the global action-token count, so N ranks take the step one process takes on the whole batch.

    Raises:
        FloatingPointError: a non-finite loss or gradient, naming the step and phase; no update is applied.
    """
    model = state.model
    mask = batch["action_mask"]
    env = env or DistEnv()
    num_tokens = global_count(mask, env).clamp(min=1)
    sums: dict[str, torch.Tensor] = {}
    for mb in batch.split(cfg.microbatch_size, dim=0):
        mb = trim_padding(mb)
        with autocast(model, cfg):
            out = model(mb["input_ids"], mb["attention_mask"], position_ids_from_mask(mb["attention_mask"]))
        out = {k: v.float() for k, v in out.items()}
        loss, metrics = ilql_loss(out, mb, cfg, num_tokens)
        if any_rank(~torch.isfinite(loss.detach()), env):  # every rank raises together
            state.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"step {step}, phase update: the ILQL loss is {loss.item()} ({metrics})")
        loss.backward()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        grad_norm = clip_and_step(params, state.optimizer, cfg.max_grad_norm)
    except FloatingPointError as e:
        raise FloatingPointError(f"step {step}, phase update: {e}") from e
    sums["grad_norm"] = grad_norm
    sums["rewards"] = batch["rewards"].mean()
    sums["response_len"] = mask.sum(-1).float().mean()
    return sums


def sync_targets(model: ILQLModel, cfg: ILQLConfig, step: int) -> bool:
    """Phase 3: every ``steps_for_target_q_sync`` steps, ``target = alpha * online + (1 - alpha) * target``.

    Returns whether the targets were updated at this ``step`` (1-based count of completed steps).
    """
    if step % cfg.steps_for_target_q_sync == 0:
        model.sync_target_q_heads(cfg.alpha)
        return True
    return False


def validate(
    state: State,
    cfg: ILQLConfig,
    *,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    env: DistEnv | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """Phase 4: steered decoding at ``cfg.beta`` (``val_reward``, ...) and the LM alone (``val_reward_policy``)."""
    metrics, batch = steered_validate(
        state.model, state.tokenizer, cfg, beta=cfg.beta, reward=reward, prompts=prompts, env=env
    )
    if cfg.beta != 0:
        plain, _ = steered_validate(
            state.model, state.tokenizer, cfg, beta=0.0, reward=reward, prompts=prompts, env=env
        )
        metrics["val_reward_policy"] = plain["val_reward"]
    else:
        metrics["val_reward_policy"] = metrics["val_reward"]
    return metrics, batch


def save(state: State, cfg: ILQLConfig, *, total_steps: int, env: DistEnv | None = None) -> Path:
    """Phase 5: checkpoint ``RUN_DIR/checkpoints/step_N`` (the ILQL model as ``policy/``, optimizer, counters;
    every rank calls it)."""
    return save_checkpoint(
        cfg.run_dir,
        state.step,
        models={MODEL_NAME: state.model},
        optimizers={MODEL_NAME: state.optimizer},
        state={
            "consumed_samples": state.consumed_samples,
            "current_step": state.step,
            "current_epoch": state.consumed_samples // max(1, state.dataset_len),
            "total_steps": total_steps,
            "total_valid_tokens": state.total_valid_tokens,
            "val_reward": state.val_reward,
        },
        tokenizer=state.tokenizer,
        keep=cfg.keep_checkpoints,
        env=env,
    )


def num_steps(cfg: ILQLConfig, dataset_len: int) -> int:
    """Steps of the run: ``max_num_steps``, or fewer if ``max_num_epochs`` passes over the set end first."""
    return min(cfg.max_num_steps, math.ceil(cfg.max_num_epochs * dataset_len / cfg.batch_size))


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------


def train(
    cfg: ILQLConfig,
    *,
    callbacks: Sequence[Any] = (),
    resume: bool = False,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    samples: Sequence[Any] | None = None,
) -> Path:
    """Train ILQL and return the run directory (``RUN_DIR/final`` holds the LM, tokenizer and heads).

    Args:
        cfg: the config (validated again here).
        callbacks: objects with ``on_metrics``/``on_samples``/``should_stop``.
        resume: continue from the newest checkpoint of ``cfg.run_dir`` (exactly reproducing the
            uninterrupted run on one process).
        reward: scores the offline set when it is built, and validation; None = the task's reward.
        prompts: prompts to build the offline set from; None = the task's train split.
        samples: the offline set itself: ``(prompt, response, reward)`` triples or dicts.

    Raises:
        ConfigError: an invalid config. FileNotFoundError: ``resume`` without a checkpoint.
        FloatingPointError: a non-finite loss or gradient (names the step; nothing is saved).
    """
    if not isinstance(cfg, ILQLConfig):
        raise ConfigError(f"cfg must be an ILQLConfig, got {type(cfg).__name__}")
    cfg.validate()
    env = setup(cfg)
    resume_from = resume_checkpoint(cfg.run_dir, missing_ok=True) if resume else None
    state = init_state(cfg, env, resume_from=resume_from)
    timer = PhaseTimer()
    with timer("dataset"):
        rows = load_or_build_dataset(
            cfg, state, samples=samples, reward=reward, prompts=prompts, resume=resume_from is not None,
            write=env.is_main,
        )
    data = tensorize_dataset(rows, state.tokenizer).to(env.device)
    state.dataset_len = len(rows)
    state.total_steps = num_steps(cfg, len(rows))
    stream = PromptStream(list(range(len(rows))), cfg.seed, consumed_samples=state.consumed_samples)

    run = Run(
        cfg, env, callbacks=callbacks, resume=resume, total_steps=state.total_steps, start_step=state.step
    )
    run.install_signal_handlers()
    try:
        if state.step == 0:
            start = {**dataset_stats(rows), "time/dataset": timer.seconds["dataset"]}
            if cfg.val_at_start:
                val, batch = validate(state, cfg, reward=reward, env=env)
                state.val_reward = val["val_reward"]
                start.update(val)
                run.log_samples(0, sample_rows(batch, cfg.log_samples))
            run.log(0, start)
        last_val = 0
        while state.step < state.total_steps and not run.should_stop:
            timer = PhaseTimer()
            t0 = time.perf_counter()
            step = state.step + 1
            with timer("data"):
                batch = next_batch(data, stream, cfg.batch_size, env)
            try:
                with timer("update"):
                    metrics = update(state, batch, cfg, step, env)
            except FloatingPointError as e:
                if cfg.on_nonfinite != "skip":
                    raise
                state.step, state.consumed_samples = step, stream.consumed_samples
                run.log(step, skipped_step(e, step))
                continue
            with timer("sync"):
                sync_targets(state.model, cfg, step)
            state.step = step
            state.consumed_samples = stream.consumed_samples
            n_tokens = int(global_count(batch["action_mask"], env).item())
            state.total_valid_tokens += n_tokens
            metrics = reduce_metrics(metrics, env)
            metrics["epoch"] = stream.epoch
            metrics["tokens_per_s"] = n_tokens / max(time.perf_counter() - t0, 1e-9)
            is_last = step == state.total_steps
            if (cfg.val_period and step % cfg.val_period == 0) or (is_last and cfg.val_at_end):
                with timer("validate"):
                    val, vbatch = validate(state, cfg, reward=reward, env=env)
                state.val_reward = val["val_reward"]
                metrics.update(val)
                run.log_samples(step, sample_rows(vbatch, cfg.log_samples))
                last_val = step
            metrics.update(timer.metrics())
            run.log(step, metrics)  # before the checkpoint: a resume drops rows past it, never misses one
            run.progress(
                step, loss=metrics["loss"], **({"val_reward": state.val_reward} if last_val == step else {})
            )
            if (cfg.save_period and step % cfg.save_period == 0) or is_last or run.should_stop:
                save(state, cfg, total_steps=state.total_steps, env=env)
        if state.step == state.total_steps:  # a stopped run has its checkpoint, not final/
            export_model(
                state.model, Path(cfg.run_dir) / "final", tokenizer=state.tokenizer, env=env,
                build=lambda: _fresh_model(cfg)[0],
            )  # fmt: skip
    finally:
        run.close()
    return Path(cfg.run_dir)


__all__ = [
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
    "read_dataset",
    "save",
    "save_dataset",
    "steered_validate",
    "sync_targets",
    "train",
    "tensorize_dataset",
    "update",
    "validate",
]
