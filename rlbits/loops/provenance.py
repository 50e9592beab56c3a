"""What a run was started with, recorded in ``RUN_DIR/provenance.json`` and checked when it is resumed.

A fresh run (rank 0) writes the reward (a callable's qualified name and a sha256 of its source where
``inspect`` can read it; a reward server's URL; a reward model's class; or the task's reward), the train and
validation prompts (count and sha256 of their text, and where they came from) and, for ILQL, the offline
samples. A resumed call describes its own inputs (or the task defaults it falls back to) the same way and
``check_resume`` compares: the same -> the run goes on; different -> ``ResumeMismatchError`` naming what
differs and how to resume, unless ``allow_changed_inputs`` (config key, or ``rlbits.train(...,
allow_changed_inputs=True)``). docs/design.md, "The run lifecycle".
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbits.loops.config import ConfigError

PROVENANCE_FILE = "provenance.json"


class ResumeMismatchError(ConfigError):
    """A resumed call gives other inputs (reward, prompts, offline samples) than the run was started with;
    the one-line message names what differs and how to resume correctly. A ``ConfigError`` (so a
    ``ValueError``): ``rlbits train --resume`` prints it as one line."""


HINTS = {"reward": "reward_fn=", "prompts": "prompts=", "val_prompts": "val_prompts= (or config key)", "samples": "samples="}
"""How a resumed call gives each input again (``rlbits.train``'s argument names)."""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_reward(reward: Any, task: str) -> dict[str, Any]:
    """``{"kind", "name", "sha256"?}`` of a reward: ``task`` (None: the task's reward), ``url`` (a reward
    server), ``callable`` (module-qualified name, sha256 of the source when it can be read) or ``model``."""
    if reward is None:
        return {"kind": "task", "name": task}
    if isinstance(reward, (str, os.PathLike)):
        text = str(reward)
        return {"kind": "url" if text.startswith(("http://", "https://")) else "path", "name": text}
    import torch  # a reward model: its class (weights are not hashed)

    if isinstance(reward, torch.nn.Module):
        cls = type(reward)
        name_or_path = getattr(getattr(reward, "config", None), "_name_or_path", "") or ""
        return {"kind": "model", "name": f"{cls.__module__}.{cls.__qualname__}", "path": str(name_or_path)}
    if isinstance(reward, functools.partial):  # the wrapped function, and its bound arguments
        inner = describe_reward(reward.func, task)
        bound = repr((reward.args, sorted(reward.keywords.items())))
        return {**inner, "name": f"functools.partial({inner['name']}, ...)", "sha256": _sha256(inner.get("sha256", "") + bound)}
    target = reward if inspect.isfunction(reward) or inspect.ismethod(reward) else type(reward)
    target = getattr(target, "__func__", target)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(reward).__name__)}"
    out: dict[str, Any] = {"kind": "callable", "name": name}
    try:
        out["sha256"] = _sha256(inspect.getsource(target))
    except (OSError, TypeError):
        pass
    return out


def describe_prompts(prompts: Sequence[str], source: str) -> dict[str, Any]:
    """``{"source", "count", "sha256"}``: the sha256 covers every prompt's text and the order."""
    return {"source": source, "count": len(prompts), "sha256": _sha256(json.dumps(list(prompts), ensure_ascii=False))}


def describe_samples(samples: Sequence[Any]) -> dict[str, Any]:
    """``{"count", "sha256"}`` of ILQL's offline samples (triples or dicts, hashed as JSON)."""
    rows = [s if isinstance(s, dict) else list(s) for s in samples]
    text = json.dumps(rows, ensure_ascii=False, sort_keys=True, default=str)
    return {"source": "samples=", "count": len(rows), "sha256": _sha256(text)}


def _say(entry: dict[str, Any], what: str) -> str:
    if what == "reward":
        return {"task": f"task {entry.get('name')}'s reward", "callable": f"reward {entry.get('name')}",
                "url": f"reward server {entry.get('name')}", "path": f"reward {entry.get('name')}",
                "model": f"reward model {entry.get('name')}"}.get(entry.get("kind"), "reward ?")
    source = entry.get("source", "")
    kind = f"{source} " if source.startswith("task") else ("custom " if what != "samples" else "")
    noun = {"prompts": "prompts", "val_prompts": "validation prompts", "samples": "offline samples"}[what]
    return f"{entry.get('count')} {kind.replace('task:', 'task ')}{noun}"


def _same(a: dict[str, Any], b: dict[str, Any], what: str) -> bool:
    if what == "reward":
        return {k: a.get(k) for k in ("kind", "name", "sha256")} == {k: b.get(k) for k in ("kind", "name", "sha256")}
    return (a.get("count"), a.get("sha256")) == (b.get("count"), b.get("sha256"))


def write_provenance(run_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` to ``RUN_DIR/provenance.json`` (atomically; call on rank 0)."""
    path = Path(run_dir) / PROVENANCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{PROVENANCE_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_provenance(run_dir: str | Path) -> dict[str, Any] | None:
    """The record of ``run_dir``, or None when it has no ``provenance.json``."""
    path = Path(run_dir) / PROVENANCE_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def check_resume(run_dir: str | Path, record: dict[str, Any], *, allow_changed: bool = False, optional: Sequence[str] = ()) -> None:
    """Compare a resumed call's ``record`` with the one the run was started with.

    Args:
        optional: entries the resumed call may leave out (None in ``record``) and still continue (ILQL's train
            prompts and samples: a resumed run reads its offline set back from the run directory).

    Raises:
        ResumeMismatchError: an entry differs (unless ``allow_changed``: then a warning).
    """
    saved = read_provenance(run_dir)
    if saved is None:
        warnings.warn(f"{run_dir}: no {PROVENANCE_FILE}; the run's inputs are not checked", stacklevel=3)
        return
    differs, started, now = [], [], []
    for what in ("reward", "prompts", "val_prompts", "samples"):
        old, new = saved.get(what), record.get(what)
        if old is None and new is None or (what in optional and new is None):
            continue
        if old is None or new is None or not _same(old, new, what):
            differs.append(what)
            started.append(_say(old, what) if old else f"no {what}")
            now.append(_say(new, what) if new else f"no {what}")
    if not differs:
        return
    message = (
        f"cannot resume {str(run_dir)!r}: run was started with {' and '.join(started)}, this call gives "
        f"{' and '.join(now)}; resume it from Python with the same "
        + ", ".join(HINTS[w] for w in differs)
        + ", or pass allow_changed_inputs=True (config key allow_changed_inputs=true) to go on with the new inputs"
    )
    if allow_changed:
        warnings.warn(message.replace("cannot resume", "resuming with changed inputs:", 1), stacklevel=3)
        return
    raise ResumeMismatchError(message)


def user_prompts(cfg: Any, prompts: Any, val_prompts: Any) -> tuple[list[str] | None, list[str] | None]:
    """Check the user's train and validation prompts before any model is loaded (``check_prompts``): the
    ``val_prompts`` argument, else the config's ``val_prompts`` (a file, ``read_prompts``, or ``split:NAME``, a
    split of the task, ``task_split``), else None (the task's test split). Returns ``(prompts, val_prompts)`` as lists or None.

    Raises:
        PromptError: a bad prompt list (names the prompt). FileNotFoundError: a missing val_prompts file.
    """
    from rlbits.data.stream import check_prompts, read_prompts

    prompts = check_prompts(prompts, "prompts") if prompts is not None else None
    if val_prompts is not None:
        val_prompts = check_prompts(val_prompts, "val_prompts")
    elif getattr(cfg, "val_prompts", None) and cfg.val_prompts.startswith(SPLIT_PREFIX):
        val_prompts = task_split(cfg.task, cfg.val_prompts[len(SPLIT_PREFIX) :])
    elif getattr(cfg, "val_prompts", None):
        val_prompts = read_prompts(cfg.val_prompts, "val_prompts")
    return prompts, val_prompts


SPLIT_PREFIX = "split:"
"""``val_prompts: split:NAME`` names a split of the run's task (``split:ood``: imdb's Rotten Tomatoes prompts)."""


def task_split(task: str, split: str) -> list[str]:
    """The prompts of ``task``'s ``split``, for ``val_prompts: split:NAME``. Raises ConfigError for an unknown split."""
    from rlbits.loops.config import ConfigError
    from rlbits.tasks import get_task

    try:
        return get_task(task).prompts(split)
    except ValueError as e:
        raise ConfigError(f"val_prompts=split:{split}: {e}") from None


def check_lengths(
    model: Any, tokenizer: Any, cfg: Any, prompts: Sequence[str] | None, val_prompts: Sequence[str] | None,
    task: Any = None,
) -> None:
    """Once the model and tokenizer are loaded (before the first step): every user prompt plus
    ``cfg.max_new_tokens`` fits the model's context (``max_position_embeddings`` / ``n_positions`` /
    ``n_ctx`` of its config, or of ``model.policy``'s). ``task``: the task object of ``cfg.task`` (default:
    looked up). Raises PromptError naming the prompt."""
    from rlbits.data.stream import check_prompt_lengths
    from rlbits.models.forward import context_length

    limit = (context_length(model) or (None, None))[1]
    from rlbits.loops.runtime import loop_prompts

    for what, texts in (("prompts", prompts), ("val_prompts", val_prompts)):
        if texts:
            texts = loop_prompts(cfg, tokenizer, texts, "test", task)  # as the loop tokenizes them (chat or not)
            check_prompt_lengths(texts, tokenizer, max_new_tokens=cfg.max_new_tokens, max_positions=limit, what=what)


def describe_inputs(
    cfg: Any, *, reward: Any, prompts: Sequence[str] | None, val_prompts: Sequence[str] | None,
    samples: Sequence[Any] | None = None, task: Any = None,
) -> dict[str, Any]:
    """The provenance record of a run's inputs: the reward, the train and validation prompts (None: the
    task's, named ``task:NAME/train`` / ``/test`` and hashed too) and the offline ``samples``. ``task``: the
    run's task object (default ``get_task(cfg.task)``). ``Run.record_provenance`` records and checks it."""
    if task is None:
        from rlbits.tasks import get_task

        task = get_task(cfg.task)
    train_prompts = list(prompts) if prompts is not None else task.prompts("train")
    record: dict[str, Any] = {
        "loop": cfg.loop,
        "task": cfg.task,
        "reward": describe_reward(reward, cfg.task),
        "prompts": describe_prompts(train_prompts, "custom" if prompts is not None else f"task:{cfg.task}/train"),
    }
    if val_prompts is not None:
        record["val_prompts"] = describe_prompts(val_prompts, getattr(cfg, "val_prompts", None) or "custom")
    else:
        record["val_prompts"] = describe_prompts(task.prompts("test"), f"task:{cfg.task}/test")
    if samples is not None:
        record["samples"] = describe_samples(samples)
    return record


__all__ = [
    "PROVENANCE_FILE",
    "ResumeMismatchError",
    "check_lengths",
    "check_resume",
    "describe_prompts",
    "describe_reward",
    "describe_inputs",
    "describe_samples",
    "read_provenance",
    "task_split",
    "user_prompts",
    "write_provenance",
]
