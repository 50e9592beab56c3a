"""Sequence-level rewards: ``score(batch, reward) -> [B]`` float32, one reward per (prompt, response).

``reward`` is one of:

- a callable ``fn(prompts: list[str], responses: list[str], **columns) -> list[float] | Tensor``;
- a ``RewardModel`` (``rlbits.models.reward``: a sequence-classification model with ``num_labels=1`` and its
  tokenizer), or the path of a local folder that holds one (``load_reward_model``: cached for the next call);
- a reward server URL starting with ``http://`` or ``https://`` (sent through ``RewardClient``; the
  protocol is in ``rlbits.rollout.reward_server`` and ``docs/reward_server.md``; the bearer token, if any,
  is read from the environment variable ``RLBITS_REWARD_TOKEN``), or a ``RewardClient``.

The texts come from the batch's non-tensor keys ``prompt_text`` and ``response_text`` (filled by
``rlbits.text.decode(batch, tokenizer)``). ``score_texts(prompts, responses, reward)`` does the same on
plain lists.

Columns: every other top-level non-tensor key of the batch (say ``answer``, a ground truth per sample) is a
column, and ``columns={"name": [...]}`` adds or overrides columns (lists, tuples or tensors of length B).
A function receives, as keyword arguments, the columns its signature accepts: all of them if it takes
``**columns``, else those named by its keyword parameters. So ``task.reward(prompts, responses)`` works on a
batch that carries extra columns, and a function that needs ``answer`` fails loudly if it is missing. A
reward model reads text only; a reward server receives every column.

Output rules: one value per sample, as a list/tuple of numbers, a 1-D tensor or a 1-D numpy array. bools and
ints become floats. A ``[B, 1]`` tensor is rejected, not squeezed: a 2-D output is as likely to be
``[B, num_labels]`` logits as a column vector, so the caller says which (``out.squeeze(-1)``). Every value
must be finite in float32.

Errors: ``RewardError`` (a ``RuntimeError``) when the reward source fails: the function raised (chained with
``raise ... from``), the server is unreachable or answered an error (``RewardServerError``).
``InvalidRewardError`` (a ``RewardError`` and a ``ValueError``) when it returned something unusable: wrong
length (says expected and got), a non-number or a non-finite value (names the sample index, its prompt and
its response, each cut to 80 characters). When a function or reward model raises on a call over several samples, it
is called again on each of those samples alone, up to the first one that raises, to name that sample
(not for a reward server: the server does that on its side).
Malformed arguments (missing text keys, a bad ``columns``) raise plain ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from rlbits.batch import TEXT_KEYS
from rlbits.models.reward import RewardModel, load_reward_model
from rlbits.rollout.reward_client import RewardClient

# The error classes live in reward_errors, below both this module and reward_client (which raises them);
# they are re-exported here, their documented home.
from rlbits.rollout.reward_errors import (
    InvalidRewardError,
    RewardError,
    RewardServerError,
    _cut,
    describe_sample,
)

TOKEN_ENV = "RLBITS_REWARD_TOKEN"  # bearer token for a reward server given to ``score`` as a URL


# ----------------------------------------------------------------------------------------------- helpers


def _span(start: int, stop: int, total: int) -> str:
    if stop - start == 1:
        return f"sample {start} of {total}"
    return f"samples {start}..{stop - 1} of {total}"


def _source_name(fn: Any) -> str:
    if isinstance(fn, RewardModel):
        return f"reward model {fn.name!r}"
    if isinstance(fn, RewardClient):
        return f"reward server {fn.url}"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"reward function {name}"


def _as_float(v: Any) -> float | None:
    """``v`` as a Python float, or None if it is not a real number (0-dim tensors and numpy scalars count)."""
    if isinstance(v, numbers.Real):  # bool, int, float, Fraction, numpy integer/floating
        return float(v)
    if getattr(v, "shape", None) == () and hasattr(v, "item"):
        item = v.item()  # 0-dim tensor or numpy scalar (np.bool_ is not a numbers.Real)
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def check_rewards(
    out: Any,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    offset: int = 0,
    total: int | None = None,
    source: str = "reward function",
) -> torch.Tensor:
    """Check one call's output and return it as a float32 CPU tensor [N] (N = ``len(prompts)``).

    Args:
        out: what the reward source returned for ``prompts``/``responses``.
        prompts, responses: the N texts of that call (quoted in errors).
        offset: index of the call's first sample in the whole batch (so errors name batch indices).
        total: size of the whole batch (for messages); defaults to N.
        source: who produced ``out``, e.g. ``"reward function my_fn"``.

    Raises:
        InvalidRewardError: wrong type, wrong length or shape, a non-number, or a value not finite in float32.
    """
    n = len(prompts)
    total = n if total is None else total
    where = _span(offset, offset + n, total) if n else f"an empty call (batch of {total})"

    def sample(i: int) -> str:
        return describe_sample(offset + i, prompts[i], responses[i])

    if isinstance(out, torch.Tensor) or (hasattr(out, "__array__") and hasattr(out, "ndim")):
        if (
            not isinstance(out, torch.Tensor)
            and getattr(getattr(out, "dtype", None), "kind", "") not in "biufc"
        ):
            out = out.tolist()  # numpy array of objects or strings: checked element by element below
        else:
            t = out.detach() if isinstance(out, torch.Tensor) else torch.as_tensor(out)
            if t.dim() != 1:
                hint = (
                    " (squeeze a [B, 1] output with .squeeze(-1))"
                    if t.dim() == 2 and t.shape[-1] == 1
                    else ""
                )
                raise InvalidRewardError(
                    f"{source} returned a {type(out).__name__} of shape {tuple(t.shape)} for {where}; "
                    f"expected shape ({n},), one reward per sample{hint}"
                )
            if t.is_complex():
                raise InvalidRewardError(f"{source} returned complex rewards ({t.dtype}) for {where}")
            out = t.to("cpu", torch.float64).tolist()
    if not isinstance(out, (list, tuple)):
        raise InvalidRewardError(
            f"{source} returned {type(out).__name__} for {where}; expected a list of {n} numbers or a "
            "1-D tensor/array of that length"
        )
    if len(out) != n:
        raise InvalidRewardError(
            f"{source} returned {len(out)} rewards for {where}; expected {n}, got {len(out)}"
        )
    values = []
    for i, v in enumerate(out):
        try:
            f = _as_float(v)
        except OverflowError:  # an int (or Fraction) beyond float64
            raise InvalidRewardError(
                f"{source} returned {type(v).__name__} {_cut(v)} for {sample(i)}; it overflows float32"
            ) from None
        if f is None:
            raise InvalidRewardError(
                f"{source} returned {type(v).__name__} {_cut(v)} for {sample(i)}; rewards must be numbers"
            )
        values.append(f)
    rewards = torch.tensor(values, dtype=torch.float32)
    bad = (~torch.isfinite(rewards)).nonzero()
    if len(bad):
        i = int(bad[0])
        why = "overflows float32" if math.isfinite(values[i]) else "is not finite"
        raise InvalidRewardError(f"{source} returned reward {values[i]!r} for {sample(i)}; it {why}")
    return rewards


def accepted_columns(fn: Callable, names: Sequence[str]) -> list[str]:
    """The column names that ``fn`` can take as keyword arguments (all if it has ``**kwargs``).

    The first two positional parameters are the prompts and the responses, never a column. A callable whose
    signature cannot be read (some builtins) is offered every column.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return list(names)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return list(names)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    keywords -= {p.name for p in positional}
    return [name for name in names if name in keywords]


def _check_columns(columns: Mapping[str, Any], n: int) -> dict[str, Any]:
    if not isinstance(columns, Mapping):
        raise TypeError(
            f"columns must be a mapping of column name to per-sample values, got {type(columns).__name__}"
        )
    out = {}
    for name, values in columns.items():
        if not isinstance(name, str):
            raise TypeError(f"columns keys must be str, got {type(name).__name__} {name!r}")
        if name in ("prompts", "responses"):
            raise ValueError(f"column name {name!r} is reserved for the texts; rename the column")
        if isinstance(values, str) or not hasattr(values, "__len__") or not hasattr(values, "__getitem__"):
            raise TypeError(
                f"column {name!r} must be a list, tuple or tensor with one value per sample, "
                f"got {type(values).__name__}"
            )
        if isinstance(values, torch.Tensor) and values.dim() == 0:
            raise ValueError(f"column {name!r} is a 0-dim tensor; it needs one value per sample ({n})")
        if len(values) != n:
            raise ValueError(f"column {name!r} has {len(values)} values; expected {n}, one per sample")
        out[name] = values
    return out


# ----------------------------------------------------------------------------------------------- scoring


def _resolve(reward: Any) -> tuple[Callable, bool]:
    """The callable behind ``reward`` and whether to locate a failing sample by calling it per sample."""
    if isinstance(reward, (str, os.PathLike)):
        spec = os.fspath(reward)
        if spec.lower().startswith(("http://", "https://")):
            return RewardClient(spec, token=os.environ.get(TOKEN_ENV) or None), False
        if os.path.isdir(spec):
            return load_reward_model(spec), True
        raise ValueError(
            f"reward {spec!r} is neither an http(s):// URL of a reward server nor a folder holding a "
            "reward model"
        )
    if isinstance(reward, RewardClient):
        return reward, False  # per-sample calls would be one request (with retries) per sample
    if isinstance(reward, torch.nn.Module):
        raise TypeError(
            f"reward is a bare {type(reward).__name__}; wrap it with its tokenizer: "
            "RewardModel(model, tokenizer)"
        )
    if callable(reward):  # a function or a RewardModel
        return reward, True
    raise TypeError(
        "reward must be a callable (prompts, responses, **columns) -> rewards, a RewardModel, a reward-model "
        f"folder or an http(s):// reward server URL; got {type(reward).__name__}"
    )


def score_texts(
    prompts: Sequence[str],
    responses: Sequence[str],
    reward: Any,
    *,
    columns: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Rewards for ``prompts[i] + responses[i]``: ``score`` on plain lists of texts.

    Args:
        prompts, responses: N strings each.
        reward: a callable, ``RewardModel``, reward-model folder, server URL or ``RewardClient`` (see module).
        columns: extra per-sample values, ``{name: [N values]}``, passed as keyword arguments.
        batch_size: at most this many samples per call of the reward (None: one call for all N).

    Returns:
        [N] float32 on CPU.

    Raises:
        InvalidRewardError, RewardError: as described in the module docstring.
        ValueError, TypeError: texts not lists of str of equal length, bad ``columns`` or ``batch_size``.
    """
    for name, texts in (("prompts", prompts), ("responses", responses)):
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise TypeError(f"{name} must be a list of str, got {type(texts).__name__}")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"{name}[{i}] must be str, got {type(t).__name__}")
    n = len(prompts)
    if len(responses) != n:
        raise ValueError(f"got {n} prompts but {len(responses)} responses; they must pair up")
    if batch_size is not None and (
        not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    columns = _check_columns(columns or {}, n)
    fn, locate = _resolve(reward)
    names = accepted_columns(fn, list(columns))
    source = _source_name(fn)
    prompts, responses = list(prompts), list(responses)
    step = batch_size or max(n, 1)
    chunks = []
    for start in range(0, n, step):
        stop = min(start + step, n)
        p, r = prompts[start:stop], responses[start:stop]
        kw = {name: columns[name][start:stop] for name in names}
        try:
            out = fn(p, r, **kw)
        except RewardError:
            raise
        except Exception as e:
            _raise_located(fn, e, source, prompts, responses, columns, names, start, stop, n, locate)
        chunks.append(check_rewards(out, p, r, offset=start, total=n, source=source))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.float32)


def _raise_located(fn, error, source, prompts, responses, columns, names, start, stop, n, locate):
    """Raise a RewardError for a failed call over samples start..stop-1, naming the failing sample."""
    what = f"{type(error).__name__}: {error}"
    if stop - start == 1:
        raise RewardError(
            f"{source} raised {what} on {describe_sample(start, prompts[start], responses[start])}"
        ) from error
    if locate:
        for i in range(start, stop):
            try:
                fn([prompts[i]], [responses[i]], **{name: columns[name][i : i + 1] for name in names})
            except Exception as e:
                raise RewardError(
                    f"{source} raised {type(e).__name__}: {e} on {describe_sample(i, prompts[i], responses[i])} "
                    f"(found by calling it per sample after the call on {_span(start, stop, n)} raised {what})"
                ) from e
        raise RewardError(
            f"{source} raised {what} on the call for {_span(start, stop, n)}; each of these samples scored "
            "alone succeeded"
        ) from error
    raise RewardError(f"{source} raised {what} on the call for {_span(start, stop, n)}") from error


def batch_columns(batch: TensorDictBase) -> dict[str, list]:
    """The batch's top-level non-tensor keys other than ``prompt_text``/``response_text``, as lists of B values."""
    return {
        key: batch.get(key).tolist()
        for key in batch.keys()
        if key not in TEXT_KEYS and batch.is_non_tensor(key)
    }


def score(
    batch: TensorDictBase,
    reward: Any,
    *,
    columns: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
) -> torch.Tensor:
    """One sequence-level reward per sample of ``batch``.

    Args:
        batch: TensorDict with batch_size [B] and the non-tensor keys ``prompt_text`` and ``response_text``
            (B strings each; ``rlbits.text.decode`` writes them).
        reward: a callable ``(prompts, responses, **columns) -> list[float] | Tensor``, a ``RewardModel``,
            the path of a local reward-model folder, an ``http(s)://`` reward server URL or a ``RewardClient``.
        columns: per-sample values passed to the reward by keyword, ``{name: [B values]}``; they add to (and
            override) the batch's other non-tensor keys. A function gets the columns its signature accepts.
        batch_size: at most this many samples per call (None: the whole batch in one call).

    Returns:
        rewards: [B] float32, on ``batch.device`` (CPU when the batch has no device).

    Raises:
        ValueError: the batch lacks ``prompt_text``/``response_text`` (call ``rlbits.text.decode`` first), is
            not 1-D, or its texts or columns do not have B entries.
        TypeError: ``batch`` is not a TensorDict, or ``reward`` is of no supported kind.
        InvalidRewardError: wrong length, a non-number or a non-finite reward (names the sample).
        RewardError: the reward function raised (chained, names the sample) or the server failed.
    """
    if not isinstance(batch, TensorDictBase):
        raise TypeError(f"batch must be a TensorDict, got {type(batch).__name__}")
    missing = [key for key in TEXT_KEYS if key not in batch.keys()]
    if missing:
        raise ValueError(
            f"batch has no {' or '.join(map(repr, missing))}; call rlbits.text.decode(batch, tokenizer) first "
            "to decode the prompt and response token ids into text"
        )
    if batch.batch_dims != 1:
        raise ValueError(f"batch must have one batch dimension [B], got batch_size {tuple(batch.batch_size)}")
    n = batch.batch_size[0]
    texts = {}
    for key in TEXT_KEYS:
        value = batch.get(key)
        texts[key] = value.tolist() if hasattr(value, "tolist") else value
        if not isinstance(texts[key], list) or len(texts[key]) != n:
            raise ValueError(f"batch[{key!r}] must hold {n} strings, one per sample")
        for i, t in enumerate(texts[key]):
            if not isinstance(t, str):
                raise TypeError(f"batch[{key!r}][{i}] must be str, got {type(t).__name__}")
    if columns is not None and not isinstance(columns, Mapping):
        raise TypeError(
            f"columns must be a mapping of column name to per-sample values, got {type(columns).__name__}"
        )
    merged = {**batch_columns(batch), **(columns or {})}
    rewards = score_texts(*texts.values(), reward, columns=merged, batch_size=batch_size)
    return rewards.to(batch.device) if batch.device is not None else rewards


__all__ = [
    "InvalidRewardError",
    "RewardError",
    "RewardServerError",
    "accepted_columns",
    "batch_columns",
    "describe_sample",
    "score",
    "score_texts",
    "check_rewards",
]
