"""The offline dataset of ILQL: samples in, a memory-mapped TensorDict in the run directory, batches out of a
torchrl ``ReplayBuffer``.

1. Rows: ``(prompt, response, reward)`` triples or dicts, or trlx's dialogues (``{"dialogue": [prompt_1,
   output_1, prompt_2, output_2, ...], "reward"}``: only the outputs are actions), checked by
   ``normalize_samples``, read from a JSONL file (``read_dataset``), or sampled from a policy and scored
   (``build_offline_dataset``, which keeps the exact sampled token ids).
2. Tensors: ``tensorize_dataset`` tokenizes (dialogues with ``rlbits.data.dialogue.tokenize_dialogue``, trlx's)
   and pads every row into one batch TensorDict [N] (the layout of
   ``rlbits.batch``); ``save_tensors`` memory-maps it into ``RUN_DIR/offline_dataset/`` (``TensorDict.memmap``:
   one raw file per key and a ``meta.json``), ``load_tensors`` reads it back without a tokenizer.
   ``RUN_DIR/offline_dataset.jsonl`` (``save_dataset``) is a human-readable copy of the rows (text, reward,
   token ids); training never reads it (only an old run directory that has nothing else is converted).
3. Batches: ``offline_buffer`` wraps the TensorDict in a torchrl ``ReplayBuffer`` (a ``TensorStorage`` around
   it) whose ``EpochSampler`` draws rows without replacement, epoch after epoch, each epoch's order a
   permutation seeded by ``(seed, epoch)`` (``PromptStream``'s). Its whole position is ``consumed_samples``,
   which the checkpoint stores: a resumed run draws exactly the batches of the uninterrupted one.
   ``next_batch`` takes one rank's share of a draw.

``load_or_build_dataset`` runs 1-2 for the loop (and reads the folder back on resume).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data import ReplayBuffer, TensorStorage
from torchrl.data.replay_buffers import Sampler

from rlbits._io import atomic_folder
from rlbits._seeds import generator
from rlbits.batch import build_batch, pad_right, trim_padding
from rlbits.data.dialogue import DialogSegment, dialogue_start_token, tokenize_dialogue, truncate_dialogue
from rlbits.data.stream import PromptStream, checked_count
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import unsharded
from rlbits.rollout.generate import generate_texts
from rlbits.rollout.score import score
from rlbits.tasks import get_task
from rlbits.text import make_prompts

DATASET_DIR = "offline_dataset"  # RUN_DIR/offline_dataset/: the memory-mapped TensorDict training reads
DATASET_FILE = "offline_dataset.jsonl"  # RUN_DIR/offline_dataset.jsonl: the rows, human-readable


# --------------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------------


def _sample_responses(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> TensorDictBase:
    """One sampled response per prompt, decoded (``generate_texts``); a sharded policy is gathered for the
    whole call, so decoding runs no collective."""
    with unsharded(policy):
        return generate_texts(
            policy, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature, generator=generator
        )


_FORMS = (
    "a (prompt, response, reward) triple, a dict with those keys, or a dialogue: {'dialogue': [prompt, output, "
    "...], 'reward': r} or (dialogue, reward)"
)


def _reward(i: int, value: Any) -> float:
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"samples[{i}]: reward must be a number, got {value!r:.80}") from None
    if not math.isfinite(reward):
        raise ValueError(f"samples[{i}]: reward must be finite, got {reward}")
    return reward


def _dialogue_row(i: int, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its ``dialogue`` checked: a str (trlx's shorthand for ``(bos, text)``) or an even number
    (>= 2) of str segments, prompt first."""
    if "prompt" in row or "response" in row:
        raise ValueError(f"samples[{i}] has a dialogue and a prompt/response; give one or the other")
    dialogue = row["dialogue"]
    if isinstance(dialogue, str):
        return row
    if not isinstance(dialogue, (list, tuple)) or not all(isinstance(x, str) for x in dialogue):
        raise ValueError(f"samples[{i}]: dialogue must be a str or a list of str, got {dialogue!r:.80}")
    if len(dialogue) < 2 or len(dialogue) % 2:
        raise ValueError(
            f"samples[{i}]: dialogue must have an even number (>= 2) of segments, alternating prompt and output "
            f"(trlx's form), got {len(dialogue)}"
        )
    return {**row, "dialogue": list(dialogue)}


def _as_row(i: int, sample: Any) -> dict[str, Any]:
    if isinstance(sample, dict):
        keys = ("dialogue", "reward") if "dialogue" in sample else ("prompt", "response", "reward")
        missing = [k for k in keys if k not in sample]
        if missing:
            raise ValueError(f"samples[{i}] lacks key(s) {missing}; each sample needs {', '.join(keys)}")
        row = dict(sample)
    elif isinstance(sample, (tuple, list)) and len(sample) == 3:
        row = {"prompt": sample[0], "response": sample[1], "reward": sample[2]}
    elif isinstance(sample, (tuple, list)) and len(sample) == 2 and isinstance(sample[0], (list, tuple)):
        row = {"dialogue": sample[0], "reward": sample[1]}
    else:
        raise ValueError(f"samples[{i}] must be {_FORMS}, got {sample!r:.80}")
    row["reward"] = _reward(i, row["reward"])
    if "dialogue" in row:
        return _dialogue_row(i, row)
    if not isinstance(row["prompt"], str) or not row["prompt"]:
        raise ValueError(f"samples[{i}]: prompt must be a non-empty str, got {row['prompt']!r:.80}")
    if not isinstance(row["response"], str):
        raise ValueError(f"samples[{i}]: response must be a str, got {row['response']!r:.80}")
    return row


def normalize_samples(samples: Sequence[Any]) -> list[dict[str, Any]]:
    """Check an offline dataset and turn it into dicts ``{prompt, response, reward}`` or ``{dialogue,
    reward}`` (extra keys kept).

    A sample is a ``(prompt, response, reward)`` triple or a dict with those keys, or a dialogue as trlx's
    ILQL takes it (``samples`` of ``trlx.train``): ``{"dialogue": [prompt_1, output_1, ..., prompt_n,
    output_n], "reward": r}`` or ``(dialogue, reward)``, segments alternating prompt (user, environment: not
    actions) and output (the model's turns: the actions), or a single str (trlx's shorthand for
    ``(bos_token, text)``).

    Raises:
        ValueError: an empty dataset, or a sample that is none of these (a non-empty str prompt, a str response,
            a finite number, an even number of str segments); the message names the sample's index.
    """
    if isinstance(samples, (str, bytes)) or len(samples) == 0:
        raise ValueError("samples must be a non-empty list of (prompt, response, reward) triples, dicts or dialogues")
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
    gen = generator(seed, 0, "offline_dataset", device)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        chunk = stream.next(min(batch_size, n - len(rows)))
        batch = _sample_responses(
            policy,
            tokenizer,
            chunk,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=gen,
        )
        rewards = score(batch, reward).to(torch.float32).tolist()
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
    """Write rows as JSONL (atomically: a temporary file renamed into place): the human-readable export of an
    offline set, and the format ``dataset_path`` and ``read_dataset`` read."""
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


def _segments(
    i: int, row: dict[str, Any], tokenizer: Any, max_length: int | None, truncation_side: str
) -> list[DialogSegment]:
    """Row ``i``'s segments: its dialogue's, or its prompt and response (the response ending in EOS)."""
    if "dialogue" in row:
        return tokenize_dialogue(row["dialogue"], tokenizer, max_length, truncation_side)
    eos = tokenizer.eos_token_id
    p = row.get("prompt_ids") or tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    if "response_ids" in row:
        r = list(row["response_ids"])
    else:
        r = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
    if not p:
        raise ValueError(f"sample {i}: prompt {row['prompt']!r:.60} tokenizes to no tokens")
    if not r:
        raise ValueError(f"sample {i}: response is empty and the tokenizer has no EOS to stand for it")
    segments = [DialogSegment(False, tuple(p)), DialogSegment(True, tuple(r))]
    if max_length is None:
        return segments
    return truncate_dialogue(segments, max_length, truncation_side, dialogue_start_token(tokenizer))


def tensorize_dataset(
    rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_length: int | None = None, truncation_side: str = "right"
) -> TensorDict:
    """The offline set as one batch TensorDict [N] (``build_batch``): ``prompts``/``prompt_mask``
    (left-padded), ``responses`` (right-padded) with ``response_mask`` (its real tokens) and ``action_mask``
    (the actions), ``input_ids``/``attention_mask``, ``rewards`` [N] float32.

    Rows with ``prompt_ids``/``response_ids`` use them as they are; text-only rows are tokenized without
    special tokens and the tokenizer's EOS is appended to the response (the end of a sample is terminal); the
    whole response is actions. A dialogue row is tokenized by ``tokenize_dialogue``: its first segment is the
    prompt, every later segment goes into the response, and only output segments are actions. This is trlx's
    ``make_experience`` (``trlx/trainer/accelerate_ilql_trainer.py``): the state before action token t is
    position t - 1 of the sample (trlx's ``actions_ixs``), the next state of an output's last token is the
    state before the next output's first (``ilql_targets`` skips the prompt tokens between), and the
    sample's reward sits on its last action token.

    Args:
        rows: ``normalize_samples`` rows.
        tokenizer: the model's tokenizer.
        max_length: keyword-only; truncate every sample to this many tokens (``truncate_dialogue``); None:
            no truncation.
        truncation_side: keyword-only; ``"right"`` or ``"left"``.

    Raises:
        ValueError: a prompt that tokenizes to nothing, or a sample with no action token (after truncation);
            the message names the sample.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_ids, response_ids, actions = [], [], []
    for i, row in enumerate(rows):
        segments = _segments(i, row, tokenizer, max_length, truncation_side)
        rest = segments[1:]
        if not any(s.is_output for s in rest):
            raise ValueError(f"sample {i} has no output tokens (after truncation to {max_length} tokens)")
        prompt_ids.append(list(segments[0].tokens))
        response_ids.append([t for s in rest for t in s.tokens])
        actions.append([s.is_output for s in rest for _ in s.tokens])
    prompts = make_prompts(prompt_ids, pad)
    responses = pad_right([torch.tensor(r, dtype=torch.int64) for r in response_ids], pad)
    action_mask = pad_right([torch.tensor(a, dtype=torch.bool) for a in actions], False)
    response_mask = pad_right([torch.ones(len(r), dtype=torch.bool) for r in response_ids], False)
    rewards = torch.tensor([float(r["reward"]) for r in rows], dtype=torch.float32)
    return build_batch(
        prompts["prompts"], prompts["prompt_mask"], responses, action_mask, response_mask=response_mask,
        rewards=rewards,
    )


# --------------------------------------------------------------------------------------------------------
# The memory-mapped TensorDict
# --------------------------------------------------------------------------------------------------------


def save_tensors(data: TensorDictBase, path: str | Path) -> TensorDict:
    """Write ``data`` as a memory-mapped TensorDict folder (``TensorDict.memmap``), atomically: it is written to
    a hidden sibling (``.NAME.tmp-*``) and renamed into place; a previous ``path`` is moved aside
    (``.NAME.old-*``) and deleted after. A killed write leaves only the hidden folders, which ``Run`` removes.

    Returns:
        The TensorDict read back from ``path`` (``load_tensors``): memory-mapped, on the CPU.
    """
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(dst, marker="meta.json") as tmp:
        data.detach().to("cpu").memmap(tmp)
    return load_tensors(dst)


def load_tensors(path: str | Path) -> TensorDict:
    """The memory-mapped TensorDict of a ``save_tensors`` folder (rows are read from disk when indexed).

    Only tensors and JSON are read: a folder holding a pickled field (tensordict's ``pickle.pkl``, which
    ``save_tensors`` never writes) is refused, since unpickling it could run code.

    Raises:
        FileNotFoundError: ``path`` is not such a folder (no ``meta.json``).
        ValueError: the folder holds a pickled field, or tensordict cannot read it; the message names the file.
    """
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a memory-mapped TensorDict folder (no meta.json)")
    pickled = sorted(p for p in path.rglob("*") if p.suffix in (".pkl", ".pickle"))
    if pickled:
        raise ValueError(
            f"refusing to load {str(pickled[0])!r}: a pickled field (a saved dataset holds tensors only, and "
            "unpickling a file can run code)"
        )
    try:
        return TensorDict.load_memmap(path, allow_pickle=False)
    except (RuntimeError, ValueError, KeyError, OSError) as e:
        raise ValueError(f"{str(path)!r} cannot be read as a memory-mapped TensorDict: {e}") from e


# --------------------------------------------------------------------------------------------------------
# The replay buffer
# --------------------------------------------------------------------------------------------------------


class EpochSampler(Sampler):
    """A torchrl sampler drawing every row once per epoch, each epoch in a seeded order: the order of
    ``PromptStream(range(len(storage)), seed)`` (``rlbits.data.stream``), which every loop's prompts follow.

    A draw that crosses the end of an epoch continues with the next epoch's order, so every batch is full
    (torchrl's ``SamplerWithoutReplacement`` returns a short batch there, and its position is a tensor of the
    remaining indices plus the buffer's generator state). Each epoch's permutation is a function of
    ``(seed, epoch)`` alone, so the sampler keeps no random state: its whole position is ``consumed_samples``,
    the number of rows drawn so far. A sampler built with the same ``seed`` and the ``consumed_samples`` of an
    interrupted one (the checkpoint's count, or its ``state_dict``) draws exactly the batches the
    uninterrupted one would have drawn.

    Args:
        seed: seeds every epoch's permutation.
        consumed_samples: rows already drawn (0 for a fresh run; the checkpoint's count on resume).
    """

    def __init__(self, seed: int, consumed_samples: int = 0) -> None:
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.seed = int(seed)
        self.consumed_samples = int(consumed_samples)

    def sample(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict]:
        """The next ``batch_size`` row indices (int64 [batch_size]) and an empty info dict."""
        n = len(storage)
        if n == 0:
            raise RuntimeError("cannot sample from an empty storage")
        stream = PromptStream(list(range(n)), self.seed, self.consumed_samples)
        index = torch.tensor(stream.next(int(batch_size)), dtype=torch.int64)
        self.consumed_samples = stream.consumed_samples
        return index, {}

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position ``state_dict`` wrote.

        Raises:
            ValueError: ``seed`` or ``consumed_samples`` is missing or not an int >= 0.
        """
        seed, consumed = checked_count(state_dict, "seed"), checked_count(state_dict, "consumed_samples")
        self.seed, self.consumed_samples = seed, consumed

    def _empty(self) -> None:
        self.consumed_samples = 0

    def dumps(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "sampler.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path: str | Path) -> None:
        self.load_state_dict(json.loads((Path(path) / "sampler.json").read_text()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed}, consumed_samples={self.consumed_samples})"


def offline_buffer(data: TensorDictBase, *, seed: int, consumed_samples: int = 0) -> ReplayBuffer:
    """A torchrl ``ReplayBuffer`` over the offline set ``data`` (a ``TensorStorage`` around it: a memory-mapped
    set stays on disk and only the sampled rows are read) drawing with ``EpochSampler(seed, consumed_samples)``.

    ``buffer.sample(n)`` returns the next ``n`` rows as a TensorDict [n] (padded to the whole set's lengths);
    ``buffer.sampler.consumed_samples`` is the position a checkpoint stores.
    """
    return ReplayBuffer(storage=TensorStorage(data), sampler=EpochSampler(seed, consumed_samples))


def next_batch(buffer: ReplayBuffer, batch_size: int, env: DistEnv | None = None) -> TensorDictBase:
    """Phase 1 of ILQL: the next ``batch_size`` rows of the per-epoch shuffled order, padding trimmed, on
    ``env.device``. Under torchrun every rank draws the same ``batch_size * world_size`` rows (the samplers
    move in step) and keeps its own ``batch_size`` of them."""
    env = env or DistEnv()
    rows = buffer.sample(batch_size * env.world_size)[env.rank * batch_size : (env.rank + 1) * batch_size]
    return trim_padding(rows).to(env.device)


# --------------------------------------------------------------------------------------------------------
# For the loop
# --------------------------------------------------------------------------------------------------------


def load_or_build_dataset(
    cfg: Any,
    state: Any,
    *,
    samples: Sequence[Any] | None = None,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    resume: bool = False,
    write: bool = True,
) -> TensorDict:
    """Phase 0 of ILQL: the offline set as one padded TensorDict [N] (``tensorize_dataset``), memory-mapped
    into ``RUN_DIR/offline_dataset/`` with the rows in ``RUN_DIR/offline_dataset.jsonl`` (if ``write``).

    A resumed run reads ``RUN_DIR/offline_dataset/`` back (the policy has trained since, so it cannot rebuild
    the set). A run directory from before that folder existed holds only ``offline_dataset.jsonl``: it is
    converted (tokenized with the run's tokenizer, as it was then) and the folder written (if ``write``).
    Otherwise: ``samples`` if given, else ``cfg.dataset_path``, else ``build_offline_dataset`` with the
    current (base) policy on ``prompts`` (default: the task's train split) scored by ``reward`` (default:
    the task's).

    Args:
        cfg: the ILQL config (``run_dir``, ``dataset_path``, ``task``, ``seed``, ``dataset_size``,
            ``dataset_temperature``, ``dataset_batch_size``, ``max_new_tokens``, ``dataset_max_length``,
            ``dataset_truncation_side``).
        state: the loop's state (``model``, an ``ILQLModel``; ``tokenizer``).
        write: write the run directory's files (rank 0 under torchrun).

    Returns:
        The TensorDict training reads: memory-mapped from ``RUN_DIR/offline_dataset/`` when this process
        wrote or read it there, else in memory (the other ranks of a fresh torchrun run: the same rows).

    Raises:
        FileNotFoundError: resuming a run that has neither file.
    """
    run_dir = Path(cfg.run_dir)
    folder, export = run_dir / DATASET_DIR, run_dir / DATASET_FILE
    lengths = dict(max_length=cfg.dataset_max_length, truncation_side=cfg.dataset_truncation_side)
    if resume:
        if (folder / "meta.json").is_file():
            return load_tensors(folder)
        if not export.is_file():
            raise FileNotFoundError(
                f"cannot resume {cfg.run_dir!r}: its offline dataset {str(folder)!r} is missing"
            )
        data = tensorize_dataset(read_dataset(export), state.tokenizer, **lengths)  # an old run directory: convert
        return save_tensors(data, folder) if write else data
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
    data = tensorize_dataset(rows, state.tokenizer, **lengths)
    if write:
        data = save_tensors(data, folder)
        save_dataset(rows, export)
    return data


def dataset_stats(data: TensorDictBase | Sequence[dict[str, Any]]) -> dict[str, float]:
    """Size and reward statistics of the offline set (logged at step 0 as ``dataset/*``), from the TensorDict's
    ``rewards`` (float32, what training sees) or from rows' ``reward``."""
    if isinstance(data, TensorDictBase):
        r = data["rewards"].to(torch.float64)
    else:
        r = torch.tensor([row["reward"] for row in data], dtype=torch.float64)
    n = r.numel()
    return {
        "dataset/size": float(n),
        "dataset/reward_mean": r.mean().item(),
        "dataset/reward_std": r.std().item() if n > 1 else 0.0,
        "dataset/reward_max": r.max().item(),
        "dataset/reward_min": r.min().item(),
    }


__all__ = [
    "DATASET_DIR",
    "DATASET_FILE",
    "EpochSampler",
    "build_offline_dataset",
    "dataset_stats",
    "load_or_build_dataset",
    "load_tensors",
    "next_batch",
    "normalize_samples",
    "offline_buffer",
    "read_dataset",
    "save_dataset",
    "save_tensors",
    "tensorize_dataset",
]
