"""Build a task's base model: a BPE tokenizer and a small GPT-2 trained on the task's corpus, in HF format.

``rlbits.tasks`` defines a task (prompts, reward, the corpus generator); this module trains a model on that
corpus, with the per-task settings in ``RECIPES``. ``rlbits.zoo.base_model(task)`` (built on first use) is
how the loops, the CLI and the tutorials reach a base model. The old homes ``rlbits.tasks.pretrain`` and
``rlbits.models.pretrain`` are deprecated aliases of this module.

``pretrain("sentiment")`` trains, on CPU in a few minutes, the model an RL loop starts from: the tokenizer is
trained with the ``tokenizers`` library on the task corpus (byte-level BPE, every digit its own token, ``<pad>``
and ``<eos>`` specials), the model is ``transformers.GPT2LMHeadModel`` (0.6-0.9M parameters, random init) trained
on corpus documents that each end in ``<eos>``. Everything is a function of the seed. The folder holds
``config.json``, ``model.safetensors``, the tokenizer files and ``base_model.json`` (seed, steps,
parameters, build time, final loss), so ``AutoModelForCausalLM.from_pretrained(path)`` and
``AutoTokenizer.from_pretrained(path)`` load it.

Default folder: ``$RLBITS_CACHE/<task>-base``, with ``RLBITS_CACHE`` defaulting to ``~/.cache/rlbits``.
``ensure_base_model(task)`` (what ``rlbits.zoo.base_model(task)`` calls) builds it only if it is missing,
under a file lock so two processes don't build it twice. The folder's name does not depend on the recipe:
after changing ``RECIPES``, rebuild (``rlbits pretrain TASK``).

``evaluate(path, task)`` scores a model on a task's prompts with plain ``model.generate``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from rlbits._io import atomic_folder

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
# Keys a recipe holds and ``pretrain`` accepts as overrides.
SETTINGS = (
    "vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "steps",
    "batch_size",
    "lr",
    "corpus_size",
    "max_new_tokens",
    "loss_after",
)

# The recipe of each built-in task's base model (``pretrain`` documents each key). The settings describe the
# model and its training, not the task, so they live here; they were the task modules' ``PRETRAIN`` dicts
# (same values, same key order: ``base_model.json`` lists them in this order). A task registered outside
# rlbits (``rlbits.tasks.TASKS``) may instead give its module a ``PRETRAIN`` dict.
RECIPES: dict[str, dict] = {
    "sentiment": dict(
        vocab_size=1024,
        n_embd=128,
        n_layer=4,
        n_head=4,
        n_positions=128,
        steps=1000,
        batch_size=32,
        lr=2e-3,
        corpus_size=30_000,
        max_new_tokens=40,
        loss_after=None,  # the whole review
    ),
    "arithmetic": dict(
        vocab_size=300,
        n_embd=128,
        n_layer=3,
        n_head=4,
        n_positions=64,
        steps=1500,
        batch_size=64,
        lr=3e-3,
        corpus_size=60_000,
        max_new_tokens=6,
        loss_after="=",  # the operands are random: train on the answer and <eos> only
    ),
}


def cache_dir() -> Path:
    """``$RLBITS_CACHE`` if set, else ``~/.cache/rlbits``."""
    return Path(os.environ.get("RLBITS_CACHE") or Path.home() / ".cache" / "rlbits").expanduser()


def default_model_dir(task: str) -> Path:
    """Where ``task``'s base model lives: ``cache_dir() / f"{task}-base"``."""
    return cache_dir() / f"{task}-base"


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts``, wrapped as ``PreTrainedTokenizerFast``.

    Digits are split one per token before BPE (``pre_tokenizers.Digits(individual_digits=True)``), so numbers
    are spelled digit by digit. Ids 0 and 1 are ``<pad>`` and ``<eos>`` (also used as BOS, as in GPT-2); then
    the 256 byte symbols, then merges up to ``vocab_size``. Encoding adds no special tokens; ``padding_side``
    is ``"left"`` (prompts are left-padded, see docs/design.md). Deterministic for a given ``texts``.

    Raises:
        ValueError: ``vocab_size`` < 258 (specials plus the byte alphabet).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (2 specials + 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def _recipe(task: str) -> dict:
    # ``RECIPES[task]``, else the ``PRETRAIN`` dict of a task module registered outside rlbits.
    from rlbits.tasks import get_task

    module = get_task(task)  # ValueError naming the valid tasks
    if task in RECIPES:
        return RECIPES[task]
    recipe = getattr(module, "PRETRAIN", None)
    if not isinstance(recipe, dict):
        raise ValueError(
            f"task {task!r} has no base-model recipe: add one to rlbits.zoo.pretrain.RECIPES "
            f"(keys: {', '.join(SETTINGS)})"
        )
    return recipe


def _settings(task: str, overrides: dict) -> dict:
    unknown = sorted(set(overrides) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown pretrain setting(s) {unknown}; valid: {', '.join(SETTINGS)}")
    settings = {**_recipe(task), **{k: v for k, v in overrides.items() if v is not None}}
    for key in ("steps", "batch_size", "corpus_size", "n_embd", "n_layer", "n_head", "n_positions"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise ValueError(f"{key} must be a positive int, got {settings[key]!r}")
    if settings["n_embd"] % settings["n_head"]:
        raise ValueError(f"n_embd ({settings['n_embd']}) must be divisible by n_head ({settings['n_head']})")
    return settings


def _encode(tokenizer, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Right-padded [N, T] token ids, each document followed by <eos>, and the lengths [N].
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    lengths = torch.tensor([len(x) + 1 for x in ids])
    if int(lengths.max()) > max_len:
        raise ValueError(
            f"a corpus document has {int(lengths.max())} tokens, more than n_positions={max_len}"
        )
    width, pad = int(lengths.max()), tokenizer.pad_token_id
    data = torch.tensor([[*x, eos] + [pad] * (width - len(x) - 1) for x in ids], dtype=torch.long)
    return data, lengths


def _loss_starts(tokenizer, data: torch.Tensor, loss_after: str | None) -> torch.Tensor:
    # [N] index of the first position whose token is trained on: after the first ``loss_after`` token.
    if loss_after is None:
        return torch.zeros(len(data), dtype=torch.long)
    ids = tokenizer(loss_after, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"loss_after must be a single token, {loss_after!r} encodes to {len(ids)} tokens")
    hit = data == ids[0]
    if not bool(hit.any(1).all()):
        raise ValueError(f"loss_after={loss_after!r} does not occur in every corpus document")
    return hit.long().argmax(1) + 1


def _lr_at(step: int, steps: int, lr: float) -> float:
    # Linear warm-up over the first 5% of steps, then cosine decay to 10% of lr.
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


@contextlib.contextmanager
def _deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _save_atomically(out: Path, write) -> None:
    # A temporary sibling folder renamed into place: readers never see half a model.
    with atomic_folder(out) as tmp:
        write(tmp)


def pretrain(
    task: str,
    out_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    steps: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    n_embd: int | None = None,
    n_layer: int | None = None,
    n_head: int | None = None,
    n_positions: int | None = None,
    vocab_size: int | None = None,
    corpus_size: int | None = None,
    loss_after: str | None = None,
    progress: bool = True,
) -> str:
    """Train ``task``'s tokenizer and base model and save them as an HF folder; returns its path.

    Settings left as ``None`` come from the task's recipe, ``RECIPES[task]``:

    Args:
        task: a registered task name (``"sentiment"``, ``"arithmetic"``).
        out_dir: target folder (replaced atomically if it exists); default ``default_model_dir(task)``.
        seed: seeds the corpus (``task.corpus(corpus_size, seed)``), the weight init and the batch order.
            The same seed and settings give identical tokenizer and weights.
        steps: optimizer steps (AdamW, betas (0.9, 0.95), weight decay 0.01, gradient clip 1.0).
        batch_size: documents per step, drawn with replacement with a seeded ``torch.Generator``.
        lr: peak learning rate (5% linear warm-up, cosine decay to 10%).
        n_embd, n_layer, n_head, n_positions: the ``GPT2Config`` (dropout 0, tied embeddings).
        vocab_size: most tokens the BPE tokenizer may have (>= 258).
        corpus_size: documents generated for training.
        loss_after: if set (a one-token string, ``"="`` for arithmetic), the loss covers only the tokens after
            its first occurrence in each document (the response and ``<eos>``); else every token.
        progress: show a tqdm progress bar with the running loss.

    Returns:
        The folder's path as a str. It also holds ``base_model.json``: task, seed, settings, ``params``,
        ``build_seconds`` (wall clock), ``build_cpu_seconds`` (CPU time of this process, all threads),
        ``final_loss`` (mean training loss over the last 50 steps, nats per token).

    Raises:
        ValueError: unknown task, or a setting out of range.
    """
    from tqdm.auto import tqdm
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlbits.tasks import get_task

    module = get_task(task)
    cfg = _settings(
        task,
        dict(
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_positions=n_positions,
            vocab_size=vocab_size,
            corpus_size=corpus_size,
            loss_after=loss_after,
        ),
    )
    out = Path(out_dir).expanduser() if out_dir is not None else default_model_dir(task)
    start, start_cpu = time.perf_counter(), time.process_time()

    texts = module.corpus(cfg["corpus_size"], seed)
    tokenizer = train_tokenizer(texts, cfg["vocab_size"])
    data, lengths = _encode(tokenizer, texts, cfg["n_positions"])
    starts = _loss_starts(tokenizer, data, cfg.get("loss_after"))
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=cfg["n_positions"],
        n_embd=cfg["n_embd"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    losses: list[float] = []
    with _deterministic():
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
        params = sum(p.numel() for p in model.parameters())
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg["lr"],
            betas=(0.9, 0.95),
        )
        order = torch.Generator().manual_seed(seed)
        model.train()
        bar = tqdm(range(cfg["steps"]), desc=f"pretrain {task}", disable=not progress, mininterval=1.0)
        for step in bar:
            idx = torch.randint(len(data), (cfg["batch_size"],), generator=order)
            width = int(lengths[idx].max())
            input_ids = data[idx, :width]
            attention_mask = torch.arange(width) < lengths[idx, None]
            labels = input_ids.masked_fill(~attention_mask | (torch.arange(width) < starts[idx, None]), -100)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, cfg["steps"], cfg["lr"])
            loss = model(input_ids=input_ids, attention_mask=attention_mask.long(), labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            if step % 25 == 0:
                bar.set_postfix(loss=f"{statistics.fmean(losses[-25:]):.3f}")
        bar.close()
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.eos_token_id
    info = dict(
        task=task,
        seed=seed,
        **cfg,
        params=params,
        build_seconds=round(time.perf_counter() - start, 1),
        build_cpu_seconds=round(time.process_time() - start_cpu, 1),
        torch_threads=torch.get_num_threads(),
        final_loss=round(statistics.fmean(losses[-50:]), 4),
        torch_version=torch.__version__,
    )

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "base_model.json").write_text(json.dumps(info, indent=2) + "\n")

    _save_atomically(out, write)
    return str(out)


def plateau_check(
    model_path: str | os.PathLike,
    task: str,
    *,
    cpu_seconds: float = 300.0,
    lr: float | None = None,
    seed: int = 1,
    n: int | None = None,
) -> dict:
    """Greedy test score of a base model, then again after ``cpu_seconds`` more supervised training.

    Evidence that a base model sits on a plateau of its corpus, not in the middle of its learning curve
    (an RL gain over a half-trained model could be had by more supervised training too). The model trains
    on a fresh corpus draw (``task.corpus(corpus_size, seed)``) with the build's settings, at ``lr``
    (default: the end of the build's schedule, 10% of its peak) after a 20-step warm-up, with fresh AdamW
    state, until this process has used ``cpu_seconds`` of CPU time (``time.process_time``; with one torch
    thread that is the wall-clock time on an idle core). Nothing is saved; the caller's RNG state is kept.

    Returns:
        ``{"before": evaluate(...) of the model, "after": the same after training, "steps": steps taken,
        "cpu_seconds": CPU time used, "lr": the rate}``; ``evaluate`` runs greedy on ``n`` test prompts.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbits.tasks import get_task

    module = get_task(task)
    info = json.loads((Path(model_path) / "base_model.json").read_text())
    lr = lr if lr is not None else 0.1 * info["lr"]
    before = evaluate(model_path, task, n=n)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True).train()
    texts = module.corpus(info["corpus_size"], seed)
    data, lengths = _encode(tokenizer, texts, info["n_positions"])
    starts = _loss_starts(tokenizer, data, info.get("loss_after"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    steps, start = 0, time.process_time()
    with torch.random.fork_rng(devices=[]):
        order = torch.Generator().manual_seed(seed)
        while time.process_time() - start < cpu_seconds:
            idx = torch.randint(len(data), (info["batch_size"],), generator=order)
            width = int(lengths[idx].max())
            input_ids = data[idx, :width]
            attention_mask = torch.arange(width) < lengths[idx, None]
            labels = input_ids.masked_fill(~attention_mask | (torch.arange(width) < starts[idx, None]), -100)
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, (steps + 1) / 20)
            loss = model(input_ids=input_ids, attention_mask=attention_mask.long(), labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            steps += 1
    used = time.process_time() - start
    with tempfile.TemporaryDirectory() as tmp:
        model.eval().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        after = evaluate(tmp, task, n=n)
    return dict(before=before, after=after, steps=steps, cpu_seconds=round(used, 1), lr=lr)


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): build without a lock
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_base_model(task: str) -> str:
    """Path of ``task``'s base model in ``default_model_dir(task)``, built with ``pretrain(task)`` (seed 0)
    if missing. A lock file beside it makes a second process wait for the first build instead of repeating it.

    Raises:
        ValueError: unknown task.
    """
    from rlbits.tasks import get_task

    get_task(task)
    out = default_model_dir(task)
    if (out / "base_model.json").exists():
        return str(out)
    with _file_lock(out.parent / f".{out.name}.lock"):
        if not (out / "base_model.json").exists():
            print(
                f"rlbits: building the {task} base model in {out} (first use, a few minutes)", file=sys.stderr
            )
            pretrain(task, out)
    return str(out)


def evaluate(
    model_path: str | os.PathLike,
    task: str,
    split: str = "test",
    *,
    greedy: bool = True,
    n: int | None = None,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    batch_size: int = 100,
    seed: int = 0,
) -> dict:
    """Score a causal LM on ``task``'s prompts with plain HF ``model.generate``.

    Prompts of equal token length are batched together, so no padding is needed. Sampling (``greedy=False``)
    is pure temperature sampling (no top-k / top-p) seeded by ``seed``.

    Args:
        model_path: an HF folder with a causal LM and its tokenizer.
        task: a registered task name.
        split: the task's prompt split.
        greedy: greedy decoding, else sampling at ``temperature``.
        n: use the first ``n`` prompts of the split (all if None).
        max_new_tokens: default: the task's ``RECIPES[task]["max_new_tokens"]``.

    Returns:
        ``{"mean": mean reward, "std": population std, "accuracy": fraction of rewards equal to 1.0,
        "n": number of prompts, "samples": the first 8 (prompt, response, reward) triples}``.

    Raises:
        ValueError: unknown task or split.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbits.tasks import get_task

    module = get_task(task)
    prompts = module.prompts(split)[:n]
    model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    max_new_tokens = max_new_tokens or _recipe(task)["max_new_tokens"]
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    responses = [""] * len(prompts)
    sampling = {} if greedy else dict(temperature=temperature, top_k=0, top_p=1.0)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for length in sorted(by_length):
            rows = by_length[length]
            for s in range(0, len(rows), batch_size):
                chunk = rows[s : s + batch_size]
                input_ids = torch.tensor([encoded[i] for i in chunk])
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=not greedy,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                texts = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
                for i, text in zip(chunk, texts, strict=True):
                    responses[i] = text
    rewards = module.reward(prompts, responses)
    return dict(
        mean=statistics.fmean(rewards),
        std=statistics.pstdev(rewards),
        accuracy=sum(r == 1.0 for r in rewards) / len(rewards),
        n=len(prompts),
        samples=list(zip(prompts, responses, rewards, strict=True))[:8],
    )


__all__ = [
    "RECIPES",
    "cache_dir",
    "default_model_dir",
    "train_tokenizer",
    "pretrain",
    "ensure_base_model",
    "evaluate",
    "plateau_check",
]
