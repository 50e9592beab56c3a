"""Build a task's base model: a BPE tokenizer and a small GPT-2 trained on the task's corpus, in HF format.

``rlbits.tasks`` defines a task (prompts, reward, the corpus generator); this module trains a model on that
corpus, with the per-task settings in ``RECIPES``. ``rlbits.zoo.base_model(task)`` (built on first use through
``ensure_base_model``) is how the loops, the CLI and the tutorials reach a base model.

``pretrain("sentiment")`` trains, on CPU in a few minutes, the model an RL loop starts from: the tokenizer is
trained with the ``tokenizers`` library on the task corpus (byte-level BPE, every digit its own token, ``<pad>``
and ``<eos>`` specials), the model is ``transformers.GPT2LMHeadModel`` (0.6-0.9M parameters, random init) trained
on corpus documents that each end in ``<eos>``. Everything is a function of the seed. The folder holds
``config.json``, ``model.safetensors``, the tokenizer files and ``base_model.json`` (seed, steps,
parameters, build time, final loss), so ``AutoModelForCausalLM.from_pretrained(path)`` and
``AutoTokenizer.from_pretrained(path)`` load it.

Default folder: ``rlbits.zoo.cache.default_model_dir(task)``, ``$RLBITS_CACHE/<task>-base``.
``ensure_base_model(task)`` builds it only if it is missing, under the cache's file lock so two processes
don't build it twice. The folder's name does not depend on the recipe: after changing ``RECIPES``, rebuild
(``rlbits pretrain TASK``).

**Determinism.** CPU kernels sum in an order that depends on the number of torch threads, and 1,000 steps
of training amplify the last-bit differences into a different model (a sentiment base model built by a
2-thread process gave a PPO tutorial an ``approx_kl`` of 1.38 at its first update instead of 0.013). So the
build runs with its own settings, whatever the caller's: ``BUILD_THREADS`` (1) torch threads and
``torch.use_deterministic_algorithms(True)``, the caller's settings restored after. ``base_model.json``
records them (``torch_threads``, ``deterministic_algorithms``, ``torch_version``). ``ensure_base_model``
rebuilds a cached model whose recorded thread count is not ``BUILD_THREADS`` (or missing), and warns, without
rebuilding, about one built by another torch version (its kernels may round differently; a rebuild takes
minutes, so it is left to ``rlbits pretrain TASK``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from rlbits._io import atomic_folder
from rlbits.zoo.cache import default_model_dir, file_lock

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
# Torch intra-op threads of every build, whatever the calling process uses: the weights depend on it.
BUILD_THREADS = 1

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
# Keys a recipe may hold after ``SETTINGS``, not overridable: ``added_tokens``, strings the tokenizer keeps
# as one token each (``train_tokenizer``).
OPTIONAL_SETTINGS = ("added_tokens",)

# The recipe of each built-in task's base model (``pretrain`` documents each key). The settings describe the
# model and its training, not the task, so they live here (``base_model.json`` lists them in this key order).
# A task registered outside rlbits (``rlbits.tasks.TASKS``) may instead give its module a ``PRETRAIN`` dict.
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
    # Tasks played in an environment (rlbits.tasks.calculator / guess_number, docs/tasks.md). To be tuned
    # against the base rates docs/tasks.md reports.
    "calculator": dict(
        vocab_size=320,
        n_embd=128,
        n_layer=3,
        n_head=4,
        n_positions=96,
        steps=2400,  # 1200 steps: it calls the tool but copies the result right only 6% of the time
        batch_size=32,
        lr=3e-3,
        corpus_size=60_000,
        max_new_tokens=32,  # per turn: the longest call is 26 tokens
        loss_after="?",  # the operands are random: train on the episode after the question
        added_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    "guess_number": dict(
        vocab_size=300,
        n_embd=128,
        n_layer=3,
        n_head=4,
        n_positions=128,
        steps=1200,
        batch_size=32,
        lr=3e-3,
        corpus_size=60_000,
        max_new_tokens=4,  # per turn: "16\n" is 3 tokens
        loss_after=".",  # the game id is random: train on the guesses (and the feedback) only
    ),
}


def train_tokenizer(texts: list[str], vocab_size: int, added_tokens: tuple[str, ...] | list[str] = ()):
    """A byte-level BPE tokenizer trained on ``texts``, wrapped as ``PreTrainedTokenizerFast``.

    Digits are split one per token before BPE (``pre_tokenizers.Digits(individual_digits=True)``), so numbers
    are spelled digit by digit. Ids 0 and 1 are ``<pad>`` and ``<eos>`` (also used as BOS, as in GPT-2); then
    the 256 byte symbols, then merges up to ``vocab_size``. Encoding adds no special tokens; ``padding_side``
    is ``"left"`` (prompts are left-padded, see docs/design.md). Deterministic for a given ``texts``.

    ``added_tokens`` (e.g. ``"<tool_call>"``) become one token each, after the merges (so the tokenizer may
    have ``vocab_size + len(added_tokens)`` tokens). They are ordinary added tokens, not special ones: decoding
    with ``skip_special_tokens=True`` keeps them, so a tool call survives the rollout's decode. BPE is trained
    with them cut out of ``texts``, so no merge is spent on their characters.

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
    added = list(added_tokens)
    if any(not isinstance(t, str) or not t for t in added):
        raise ValueError(f"added_tokens must be non-empty strings, got {added_tokens!r}")
    for t in sorted(added, key=len, reverse=True):  # longest first: a tag that contains another is cut whole
        texts = [x.replace(t, " ") for x in texts]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if added:
        fast.add_tokens(added)
    return fast


def recipe(task: str) -> dict:
    """The recipe of ``task``'s base model: ``RECIPES[task]``, else the ``PRETRAIN`` dict of a task module
    registered outside rlbits.

    Raises:
        ValueError: unknown task, a task on real data (its base model is a zoo model, ``BASE_MODEL``), or a
            task without a recipe.
    """
    from rlbits.tasks import get_task

    module = get_task(task)  # ValueError naming the valid tasks
    if task in RECIPES:
        return RECIPES[task]
    zoo_name = getattr(module, "BASE_MODEL", None)
    if zoo_name is not None:
        raise ValueError(
            f"task {task!r} has no corpus to pretrain a model on: its base model is the real model {zoo_name!r} "
            f"(`rlbits model get {zoo_name}`; rlbits.zoo.base_model({task!r}) returns it)"
        )
    recipe = getattr(module, "PRETRAIN", None)
    if not isinstance(recipe, dict):
        raise ValueError(
            f"task {task!r} has no base-model recipe: add one to rlbits.zoo.builder.RECIPES "
            f"(keys: {', '.join(SETTINGS)})"
        )
    return recipe


def _settings(task: str, overrides: dict) -> dict:
    unknown = sorted(set(overrides) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown pretrain setting(s) {unknown}; valid: {', '.join(SETTINGS)}")
    settings = {**recipe(task), **{k: v for k, v in overrides.items() if v is not None}}
    for key in ("steps", "batch_size", "corpus_size", "n_embd", "n_layer", "n_head", "n_positions"):
        if not isinstance(settings[key], int) or settings[key] < 1:
            raise ValueError(f"{key} must be a positive int, got {settings[key]!r}")
    if settings["n_embd"] % settings["n_head"]:
        raise ValueError(f"n_embd ({settings['n_embd']}) must be divisible by n_head ({settings['n_head']})")
    return settings


def encode_corpus(tokenizer, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [N, T] int64, lengths [N] int64)``: each document's token ids followed by ``<eos>``, right-padded
    with the pad id, and its length with the ``<eos>``.

    Raises:
        ValueError: a document (with its ``<eos>``) has more than ``max_len`` tokens.
    """
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


def loss_starts(tokenizer, data: torch.Tensor, loss_after: str | None) -> torch.Tensor:
    """[N] int64 index of the first position of each row of ``data`` [N, T] whose token is trained on: just
    after the first ``loss_after`` token (0 for every row when ``loss_after`` is None).

    Raises:
        ValueError: ``loss_after`` is not one token, or a row does not contain it.
    """
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


def build_settings() -> dict:
    """What besides the seed and the recipe decides a build's weights, as ``base_model.json`` records it."""
    return dict(torch_threads=BUILD_THREADS, deterministic_algorithms=True, torch_version=torch.__version__)


@contextlib.contextmanager
def _deterministic():
    # The build's own thread count and deterministic kernels; the caller's settings and RNG state restored.
    previous, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(BUILD_THREADS)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(previous)


def _save_atomically(out: Path, write) -> None:
    # A temporary sibling folder renamed into place: readers never see half a model.
    with atomic_folder(out) as tmp:
        write(tmp)


def train_step(model, optimizer, data, lengths, starts, idx: torch.Tensor, lr: float) -> torch.Tensor:
    """One supervised step of ``model`` on the documents ``idx`` [b] of ``data`` (``encode_corpus``) at ``lr``.

    The batch is cut to its longest document; the loss (next-token cross-entropy, mean over the tokens from
    each row's ``starts`` on, padding excluded) is backpropagated, the gradient norm clipped to 1.0, and the
    optimizer stepped. Returns the loss (0-dim, with its graph).
    """
    width = int(lengths[idx].max())
    input_ids = data[idx, :width]
    attention_mask = torch.arange(width) < lengths[idx, None]
    labels = input_ids.masked_fill(~attention_mask | (torch.arange(width) < starts[idx, None]), -100)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=input_ids, attention_mask=attention_mask.long(), labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


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

    The model trains with ``BUILD_THREADS`` torch threads and deterministic algorithms, whatever the
    caller's settings (restored after): the same seed and settings give byte-identical weights in a
    1-thread and a 16-thread process.

    Returns:
        The folder's path as a str. It also holds ``base_model.json``: task, seed, settings, ``params``,
        ``build_seconds`` (wall clock), ``build_cpu_seconds`` (CPU time of this process, all threads),
        ``final_loss`` (mean training loss over the last 50 steps, nats per token) and ``build_settings()``
        (``torch_threads``, ``deterministic_algorithms``, ``torch_version``).

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
    tokenizer = train_tokenizer(texts, cfg["vocab_size"], cfg.get("added_tokens") or ())
    data, lengths = encode_corpus(tokenizer, texts, cfg["n_positions"])
    starts = loss_starts(tokenizer, data, cfg.get("loss_after"))
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
            loss = train_step(
                model, optimizer, data, lengths, starts, idx, _lr_at(step, cfg["steps"], cfg["lr"])
            )
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
        final_loss=round(statistics.fmean(losses[-50:]), 4),
        **build_settings(),
    )

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "base_model.json").write_text(json.dumps(info, indent=2) + "\n")

    _save_atomically(out, write)
    return str(out)


def _stale(out: Path, task: str) -> str | None:
    # Why the cached model in ``out`` must be built (again), or None if it is usable. Warns about a build by
    # another torch version (kept: see the module docstring).
    try:
        info = json.loads((out / "base_model.json").read_text())
    except FileNotFoundError:
        return "first use"
    except (OSError, ValueError) as e:
        return f"its base_model.json is unreadable ({e})"
    threads = info.get("torch_threads")
    if threads != BUILD_THREADS:
        return (
            f"it was built with {threads if threads is not None else 'an unrecorded number of'} torch "
            f"threads, and builds now use {BUILD_THREADS} (the weights depend on it)"
        )
    if info.get("torch_version") != torch.__version__:
        warnings.warn(
            f"the {task} base model in {out} was built with torch {info.get('torch_version')}, this is torch "
            f"{torch.__version__}: its weights may differ in the last bits from a build with this version "
            f"(`rlbits pretrain {task}` rebuilds it)",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def ensure_base_model(task: str, *, lock_timeout: float | None = None) -> str:
    """Path of ``task``'s base model in ``default_model_dir(task)``, built with ``pretrain(task)`` (seed 0)
    if missing, or rebuilt if its ``base_model.json`` records another thread count than ``BUILD_THREADS``
    (warns if it records another torch version; see the module docstring).

    A lock file beside it (``.<task>-base.lock``) makes a second process wait for the first build instead of
    repeating it; the waiting process prints what it waits for on stderr (at once, then every 30 s).

    Args:
        lock_timeout: seconds to wait for another process's build; default ``$RLBITS_LOCK_TIMEOUT``, else
            ``rlbits.zoo.cache.LOCK_TIMEOUT_S`` (an hour; a build takes minutes).

    Raises:
        ValueError: unknown task.
        TimeoutError: another process held the lock longer than ``lock_timeout`` (the message names the lock
            file and its holder's pid).
    """
    from rlbits.tasks import get_task

    get_task(task)
    out = default_model_dir(task)
    if _stale(out, task) is None:
        return str(out)
    with file_lock(out.parent / f".{out.name}.lock", what=str(out), timeout=lock_timeout):
        reason = _stale(out, task)  # another process may have built it while this one waited
        if reason is not None:
            print(
                f"rlbits: building the {task} base model in {out} ({reason}; a few minutes)", file=sys.stderr
            )
            pretrain(task, out)
    return str(out)


__all__ = [
    "RECIPES",
    "SETTINGS",
    "OPTIONAL_SETTINGS",
    "BUILD_THREADS",
    "build_settings",
    "train_tokenizer",
    "recipe",
    "encode_corpus",
    "loss_starts",
    "train_step",
    "pretrain",
    "ensure_base_model",
]
