"""The batch: one TensorDict with ``batch_size [B]`` that every rlbits verb reads and writes.

Prompts are left-padded to a common length P, responses right-padded to a common length R, and every
per-token quantity is aligned with the response (docs/batch.md draws the layout and explains every key).
``SCHEMA`` lists every key with its named-dim shape, dtype, padding value and meaning; ``check`` validates a
batch against it. Verbs: ``build_batch``; ``pad_left`` / ``pad_right`` / ``collate`` / ``trim_padding``;
``split_microbatches`` / ``split_microbatches_by_tokens`` / ``split_minibatches``; ``group_ids`` / ``repeat_interleave_prompts``. Text in and out
of a batch (``tokenize_prompts``, ``chat_prompts``, ``make_prompts``, ``decode``) is ``rlbits.text``. None of
them syncs with the device except where its docstring says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import einops
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, is_non_tensor
from torch.nn.utils.rnn import pad_sequence

from rlbits.functional.packing import token_budget_partitions

__all__ = [
    "PER_TOKEN_KEYS",
    "SCHEMA",
    "TEXT_KEYS",
    "PAD_TOKEN",
    "KeySpec",
    "build_batch",
    "check",
    "collate",
    "group_ids",
    "pad_left",
    "pad_right",
    "repeat_interleave_prompts",
    "response_mask",
    "split_microbatches",
    "split_microbatches_by_tokens",
    "split_minibatches",
    "trim_padding",
]

# --- Schema -------------------------------------------------------------------------------------------------

PAD_TOKEN = "pad_token_id"
"""``KeySpec.pad`` of the token-id keys: padded with the tokenizer's pad id (``collate``'s ``pad_token_id``)."""


class KeySpec(NamedTuple):
    """What one batch key holds.

    ``dims`` names each dimension: ``B`` batch, ``P`` prompt length, ``R`` response length, ``P+R`` their
    sum. ``dtype`` is a ``torch.dtype``, or ``str`` for a non-tensor column of B strings (a
    ``NonTensorStack``). ``pad`` fills the padding positions of a [B, P] / [B, R] / [B, P+R] key (``collate``
    writes it when it re-pads): a number, or ``PAD_TOKEN`` for token ids.
    """

    dims: tuple[str, ...]
    dtype: torch.dtype | type
    meaning: str
    pad: float | int | str = 0

    @property
    def shape(self) -> str:
        """The shape as written in the docs, e.g. ``"[B, P]"``."""
        return "[" + ", ".join(self.dims) + "]"

    def describe(self) -> str:
        """``"[B, P] int64"``-style shape and dtype, as used in error messages."""
        dtype = "str" if self.dtype is str else str(self.dtype).removeprefix("torch.")
        return f"{self.shape} {dtype}"


_BP, _BR, _B = ("B", "P"), ("B", "R"), ("B",)
_F, _I, _M = torch.float32, torch.int64, torch.bool

SCHEMA: dict[str, KeySpec] = {
    # prompt and response tokens, masks
    "prompts": KeySpec(_BP, _I, "prompt token ids, left-padded", PAD_TOKEN),
    "prompt_mask": KeySpec(_BP, _M, "True on real prompt tokens"),
    "responses": KeySpec(
        _BR, _I, "response token ids, right-padded (episodes: turns, observations)", PAD_TOKEN
    ),
    "response_mask": KeySpec(_BR, _M, "True on real (non-pad) response tokens, tool/env tokens included"),
    "action_mask": KeySpec(_BR, _M, "True on the response tokens trained on (not pad, not tool/env tokens)"),
    "loss_mask": KeySpec(_BR, _M, "action tokens the loss sees: action_mask minus filtered rows and rejected tokens"),
    "input_ids": KeySpec(("B", "P+R"), _I, "cat(prompts, responses)", PAD_TOKEN),
    "attention_mask": KeySpec(("B", "P+R"), _M, "cat(prompt_mask, response_mask)"),
    # per-token floats, 0 off action_mask
    "logprobs": KeySpec(_BR, _F, "log pi_old(token) under the behaviour policy at the sampling temperature"),
    "ref_logprobs": KeySpec(_BR, _F, "log pi_ref(token) under the frozen reference policy"),
    "old_logprobs": KeySpec(_BR, _F, "log pi_old(token) recomputed by the trainer before the update (correction)"),
    "rollout_is_weights": KeySpec(_BR, _F, "rollout-correction weight of each action token (loss multiplier)"),
    "entropy": KeySpec(_BR, _F, "entropy of the sampling distribution at each action token"),
    "values": KeySpec(_BR, _F, "critic V(s_t) for the state before response token t"),
    "token_rewards": KeySpec(_BR, _F, "reward on the last action token (or each turn's) minus kl_coef * kl"),
    "advantages": KeySpec(_BR, _F, "advantage of each action token"),
    "returns": KeySpec(_BR, _F, "return (value target) of each action token"),
    "turn_rewards": KeySpec(_BR, _F, "episodes: each turn's reward on that turn's last action token"),
    "turn_index": KeySpec(_BR, _I, "episodes: 0-based turn of a token (an observation: its turn's)", -1),
    "token_version": KeySpec(_BR, _I, "partial rollouts: the policy version that sampled each response token"),
    # one value per row
    "rewards": KeySpec(_B, _F, "sequence-level score (episodes: the sum of the turn rewards)"),
    "reference_rewards": KeySpec(_B, _F, "score of a reference-policy response to the same prompt (PPO)"),
    "reward_baselines": KeySpec(_B, _F, "score of a greedy response to the same prompt (REINFORCE, remax)"),
    "ref_logps": KeySpec(_B, _F, "sum of ref_logprobs over a response's action tokens (preference pair batches)"),
    "truncated": KeySpec(_B, _M, "stopped by the token budget or context, not a stop token (overlong)"),
    "group": KeySpec(_B, _I, "which prompt a sample came from; samples of one prompt are contiguous"),
    "policy_version": KeySpec(_B, _I, "steps the policy that sampled the row had taken (async: its version)"),
    "num_turns": KeySpec(_B, _I, "episodes: policy turns taken"),
    "retokenized": KeySpec(_B, _M, "torchrl episodes: some assistant turn's ids were re-tokenised from text"),
    "prompt_text": KeySpec(_B, str, "decoded prompt (non-tensor)"),
    "response_text": KeySpec(_B, str, "decoded response (non-tensor)"),
    "stop_reason": KeySpec(_B, str, "episodes: why it ended (rlbits.rollout.multiturn.STOP_REASONS)"),
}
"""Every key an rlbits rollout, phase or loop writes: ``key -> KeySpec(dims, dtype, meaning, pad)``."""

PER_TOKEN_KEYS: tuple[str, ...] = tuple(k for k, s in SCHEMA.items() if s.dims == _BR and s.dtype == _F)
"""Float [B, R] keys that hold 0 where ``action_mask`` is False."""

TEXT_KEYS: tuple[str, ...] = ("prompt_text", "response_text")
"""The decoded texts (``rlbits.text.decode``), one ``str`` per row; ``stop_reason`` is a string key too."""


def response_mask(batch: TensorDictBase) -> torch.Tensor:
    """The mask of real response tokens: ``response_mask`` if present, else ``action_mask``. [B, R] bool."""
    if "response_mask" in batch.keys():
        return batch.get("response_mask")
    if "action_mask" in batch.keys():
        return batch.get("action_mask")
    raise ValueError("batch has neither 'response_mask' nor 'action_mask'")


# --- check --------------------------------------------------------------------------------------------------


def check(
    batch: TensorDictBase,
    required: Iterable[str] = ("prompts", "prompt_mask"),
    *,
    check_values: bool = False,
) -> TensorDictBase:
    """Check a batch against ``SCHEMA``; return it unchanged.

    Always checked (no device sync): ``batch`` is a TensorDict with ``batch_size [B]``; every key in
    ``required`` is present; every ``SCHEMA`` key present has its dtype and named-dim shape, with one P and
    one R across all keys; string keys hold one ``str`` per row (a ``NonTensorStack``). Keys outside
    ``SCHEMA`` are allowed and not checked.

    With ``check_values=True`` (reads the contents: syncs with the device): ``PER_TOKEN_KEYS`` are 0 off
    ``action_mask``; ``loss_mask`` within ``action_mask`` within ``response_mask``; ``prompt_mask`` left-
    and ``response_mask`` right-padded; ``turn_index`` -1 exactly off ``response_mask``; ``input_ids ==
    cat(prompts, responses)``, ``attention_mask == cat(prompt_mask, response_mask)``; rows of one ``group``
    contiguous.

    Returns:
        ``batch``, so that ``check`` can be chained.

    Raises:
        ValueError: the first problem found, naming the key and what was expected.
    """
    _check_schema(batch)
    keys = set(batch.keys())
    for key in required:
        if key not in keys:
            raise ValueError(f"batch is missing required key {key!r} ({_expect(key)}); it has {sorted(keys)}")
    if check_values:
        _check_values(batch, keys)
    return batch


def _check_schema(batch: TensorDictBase) -> dict[str, int]:
    """``check`` without ``required`` and value checks; returns the named sizes (``B`` and, where a key
    has them, ``P`` and ``R``)."""
    if not isinstance(batch, TensorDictBase):
        raise ValueError(f"batch must be a TensorDict, got {type(batch).__name__}")
    if batch.batch_dims != 1:
        raise ValueError(f"batch must have batch_size [B] (1-D), got {list(batch.batch_size)}")
    keys = set(batch.keys())
    sizes = {"B": batch.batch_size[0]}
    source = {"B": "batch_size"}
    for key, spec in SCHEMA.items():
        if key not in keys:
            continue
        value = batch.get(key)
        if spec.dtype is str:
            _check_text(key, value, sizes["B"])
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{key} must be a tensor ({spec.describe()}), got {type(value).__name__}")
        if value.dtype != spec.dtype:
            raise ValueError(f"{key} must be {spec.describe()}, got dtype {value.dtype}")
        if value.dim() != len(spec.dims):
            raise ValueError(f"{key} must be {spec.describe()}, got shape {tuple(value.shape)}")
        for dim, (name, size) in enumerate(zip(spec.dims, value.shape, strict=True)):
            if name == "P+R":
                if "P" in sizes and "R" in sizes and size != sizes["P"] + sizes["R"]:
                    raise ValueError(
                        f"{key} must be {spec.describe()} with P+R = {sizes['P']}+{sizes['R']} = "
                        f"{sizes['P'] + sizes['R']} (P from {source['P']}, R from {source['R']}), "
                        f"got shape {tuple(value.shape)}"
                    )
            elif name not in sizes:
                sizes[name], source[name] = size, key
            elif size != sizes[name]:
                raise ValueError(
                    f"{key} must be {spec.describe()} with {name}={sizes[name]} (from {source[name]}), "
                    f"got {size} in dim {dim} (shape {tuple(value.shape)})"
                )
    return sizes


def _expect(key: str) -> str:
    return SCHEMA[key].describe() if key in SCHEMA else "unknown key"


def _check_text(key: str, value: Any, batch_len: int) -> None:
    if not is_non_tensor(value):
        raise ValueError(f"{key} must be a non-tensor column of {batch_len} str, got {type(value).__name__}")
    rows = value.tolist()
    if len(rows) != batch_len or not all(isinstance(r, str) for r in rows):
        raise ValueError(
            f"{key} must hold one str per row ({batch_len} rows); store it with "
            f"NonTensorStack.from_list(texts), not set_non_tensor(key, texts)"
        )


def _check_values(batch: TensorDictBase, keys: set[str]) -> None:
    if "action_mask" in keys:
        action = batch.get("action_mask")
        for key in PER_TOKEN_KEYS:
            if key in keys and bool((batch.get(key) != 0).logical_and(~action).any()):
                raise ValueError(f"{key} must be 0 where action_mask is False")
        if "response_mask" in keys and bool(action.logical_and(~batch.get("response_mask")).any()):
            raise ValueError("action_mask is True where response_mask is False (a pad token is an action)")
        if "loss_mask" in keys and bool(batch.get("loss_mask").logical_and(~action).any()):
            raise ValueError("loss_mask is True where action_mask is False (the loss sees a non-action)")
    if "turn_index" in keys and ("response_mask" in keys or "action_mask" in keys):
        if not torch.equal(batch.get("turn_index") == -1, ~response_mask(batch)):
            raise ValueError("turn_index must be -1 exactly where response_mask is False (on padding)")
    if "prompt_mask" in keys:
        mask = batch.get("prompt_mask")
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("prompt_mask must be left-padded: False entries only before the True ones")
    if "response_mask" in keys:
        mask = batch.get("response_mask")
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("response_mask must be right-padded: False entries only after the True ones")
    if {"input_ids", "prompts", "responses"} <= keys:
        if not torch.equal(
            batch.get("input_ids"), torch.cat([batch.get("prompts"), batch.get("responses")], dim=1)
        ):
            raise ValueError("input_ids must equal cat(prompts, responses)")
    if {"attention_mask", "prompt_mask"} <= keys and ("response_mask" in keys or "action_mask" in keys):
        expected = torch.cat([batch.get("prompt_mask"), response_mask(batch)], dim=1)
        if not torch.equal(batch.get("attention_mask"), expected):
            name = "response_mask" if "response_mask" in keys else "action_mask"
            raise ValueError(f"attention_mask must equal cat(prompt_mask, {name})")
    if "group" in keys:
        group = batch.get("group")
        runs = int((group[1:] != group[:-1]).sum()) + 1 if group.numel() else 0
        if runs != torch.unique(group).numel():
            raise ValueError("group: rows of one group must be contiguous")


# --- Padding ------------------------------------------------------------------------------------------------


def _pad_to(t: torch.Tensor, length: int, value: Any, side: str, dim: int) -> torch.Tensor:
    """Pad ``t`` along ``dim`` up to ``length`` with ``value`` on ``side`` (``"left"``/``"right"``): what
    ``pad_sequence`` does not do (a fixed length; a batch's P or R columns in ``collate``)."""
    extra = length - t.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad a length-{t.shape[dim]} sequence to the shorter length {length}")
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    fill = t.new_full(shape, value)
    return torch.cat([fill, t] if side == "left" else [t, fill], dim=dim)


def _pad_sequences(
    seqs: Sequence[torch.Tensor], pad_value: Any, length: int | None, side: str
) -> torch.Tensor:
    """``pad_left`` / ``pad_right``: check the sequences, stack them with ``pad_sequence``, then pad the
    stack to ``length`` if one is given."""
    if len(seqs) == 0:
        raise ValueError("need at least one sequence to pad")
    for i, s in enumerate(seqs):
        if s.dim() < 1 or s.shape[1:] != seqs[0].shape[1:] or s.dtype != seqs[0].dtype:
            raise ValueError(
                f"sequence {i} has shape {tuple(s.shape)} and dtype {s.dtype}; every sequence must be [L_i, *] "
                f"with the trailing shape {tuple(seqs[0].shape[1:])} and dtype {seqs[0].dtype} of sequence 0"
            )
    longest = max(s.shape[0] for s in seqs)
    if length is not None and length < longest:
        raise ValueError(f"length={length} is shorter than the longest sequence ({longest})")
    out = pad_sequence(list(seqs), batch_first=True, padding_value=pad_value, padding_side=side)
    return out if length is None else _pad_to(out, length, pad_value, side, dim=1)


def pad_right(seqs: Sequence[torch.Tensor], pad_value: Any, length: int | None = None) -> torch.Tensor:
    """Stack N tensors ``[L_i, *]`` (one dtype and trailing shape) into ``[N, L, *]``, padded at the end with
    ``pad_value`` (the response layout): row i holds ``seqs[i]`` in columns ``[0, L_i)``. ``L`` is
    ``length``, else ``max(L_i)``.

    Raises:
        ValueError: empty ``seqs``, mismatched dtypes or trailing shapes, ``length < max(L_i)``.
    """
    return _pad_sequences(seqs, pad_value, length, "right")


def pad_left(seqs: Sequence[torch.Tensor], pad_value: Any, length: int | None = None) -> torch.Tensor:
    """``pad_right`` padded at the start (the prompt layout): row i holds ``seqs[i]`` in ``[L - L_i, L)``.

    Raises:
        ValueError: empty ``seqs``, mismatched dtypes or trailing shapes, ``length < max(L_i)``.
    """
    return _pad_sequences(seqs, pad_value, length, "left")


# --- Groups -------------------------------------------------------------------------------------------------


def group_ids(num_prompts: int, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[num_prompts * group_size] int64: the group id of each sample when every prompt is sampled
    ``group_size`` times in a row. ``group_ids(2, 3) -> tensor([0, 0, 0, 1, 1, 1])``.

    Raises:
        ValueError: ``num_prompts < 0`` or ``group_size < 1``.
    """
    if num_prompts < 0 or group_size < 1:
        raise ValueError(f"need num_prompts >= 0 and group_size >= 1, got {num_prompts} and {group_size}")
    return einops.repeat(torch.arange(num_prompts, device=device), "g -> (g k)", k=group_size)


def repeat_interleave_prompts(td: TensorDictBase, group_size: int) -> TensorDictBase:
    """Repeat each row of ``td`` (batch_size [B]) ``group_size`` K times in a row, for ``num_samples > 1``:
    every key (tensor and text) is repeated, and ``group`` [B * K] int64 is (over)written with
    ``group_ids(B, K)`` (row ``i`` came from prompt ``i // K``). Returns a new TensorDict [B * K].

    Raises:
        ValueError: ``group_size < 1`` or ``td`` is not 1-D.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if td.batch_dims != 1:
        raise ValueError(f"td must have batch_size [B], got {list(td.batch_size)}")
    out = td.repeat_interleave(group_size, dim=0)
    device = td.get("prompts").device if "prompts" in td.keys() else td.device
    out.set("group", group_ids(td.batch_size[0], group_size, device=device))
    return out


# --- Building and combining batches -------------------------------------------------------------------------


def build_batch(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    **columns: torch.Tensor | Sequence[str],
) -> TensorDict:
    """Assemble a batch: ``input_ids = cat(prompts, responses)``, ``attention_mask = cat(prompt_mask,
    response_mask)`` (covering tool/env tokens that are not actions), and ``PER_TOKEN_KEYS`` set to 0 off
    ``action_mask`` (values ``generate`` computed on padding are dropped).

    Args:
        prompts: [B, P] int64, left-padded; ``prompt_mask`` [B, P] bool.
        responses: [B, R] int64, right-padded; ``action_mask`` [B, R] bool.
        response_mask: [B, R] bool, True on real response tokens (a superset of ``action_mask``); None
            reads every real response token as an action (``response_mask = action_mask``).
        **columns: more keys: tensors with leading dim B (``logprobs=..., rewards=..., group=...``; schema
            keys are checked against ``SCHEMA``) or lists of B strings, stored as ``NonTensorStack``.

    Returns:
        ``TensorDict`` with ``batch_size [B]``.

    Raises:
        ValueError: a column whose shape or dtype does not follow ``SCHEMA`` (see ``check``), a list
            of strings whose length is not B, or ``input_ids`` / ``attention_mask`` passed in.
    """
    batch_len = prompts.shape[0] if prompts.dim() else 0
    if response_mask is None:
        response_mask = action_mask
    given: dict[str, Any] = {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "action_mask": action_mask,
    }
    for key, value in columns.items():
        if key in ("input_ids", "attention_mask"):
            raise ValueError(
                f"{key} is computed by build_batch from the prompts and responses; do not pass it"
            )
        if not isinstance(value, torch.Tensor):
            texts = list(value)
            if not all(isinstance(t, str) for t in texts):
                raise ValueError(f"{key} must be a tensor or a list of str, got {type(value).__name__}")
            value = NonTensorStack.from_list(texts)
        given[key] = value
    for key, value in given.items():
        if value.dim() < 1 or value.shape[0] != batch_len:
            raise ValueError(
                f"{key} must have leading dim B={batch_len} (from prompts), got shape {tuple(value.shape)}"
            )
    batch = TensorDict(given, batch_size=[batch_len])
    check(batch, required=("prompts", "prompt_mask", "responses", "action_mask"))
    zero = torch.zeros((), device=action_mask.device)
    per_token = batch.select(*[key for key in PER_TOKEN_KEYS if key in columns])
    batch.update(per_token.apply(lambda t: torch.where(action_mask, t, zero)))
    batch.set("input_ids", torch.cat([prompts, responses], dim=1))
    batch.set("attention_mask", torch.cat([prompt_mask, response_mask], dim=1))
    return batch


def _repad(batch: TensorDictBase, own: dict[str, int], sizes: dict[str, int], pad_token_id: int | None):
    """Pad one batch's [B, P], [B, R] and [B, P+R] keys from its own P and R (``own``) to ``sizes``: prompt
    columns on the left, response columns on the right, each with its ``KeySpec.pad``."""
    out = batch.copy()
    for key, spec in SCHEMA.items():
        if key not in batch.keys() or spec.dtype is str or len(spec.dims) < 2:
            continue
        dims = ["P", "R"] if spec.dims[1] == "P+R" else [spec.dims[1]]
        if all(own.get(dim) == sizes[dim] for dim in dims):
            continue
        if spec.dims[1] == "P+R" and "P" not in own:
            raise ValueError(f"collate needs prompts or prompt_mask to re-pad {key}")
        if spec.pad == PAD_TOKEN and pad_token_id is None:
            raise ValueError(f"collate needs pad_token_id to pad {key} (batches have different lengths)")
        value = pad_token_id if spec.pad == PAD_TOKEN else spec.pad
        t = batch.get(key)
        pieces = [t[:, : own["P"]], t[:, own["P"] :]] if spec.dims[1] == "P+R" else [t]
        padded = [
            _pad_to(x, sizes[dim], value, "left" if dim == "P" else "right", dim=1)
            for x, dim in zip(pieces, dims, strict=True)
        ]
        out.set(key, torch.cat(padded, dim=1))
    return out


def collate(batches: Sequence[TensorDictBase], pad_token_id: int | None = None) -> TensorDictBase:
    """Concatenate batches whose prompt and response lengths differ (rollouts, episode batches).

    Each batch is checked (``check`` without values), then every ``SCHEMA`` key is re-padded with its
    ``KeySpec.pad``: [B, P] keys on the left to the largest P, [B, R] keys (``turn_index`` with -1,
    ``loss_mask``, ``turn_rewards``, ...) on the right to the largest R, and ``input_ids`` /
    ``attention_mask`` on both sides of their prompt/response boundary. Per-row keys, string keys and keys
    outside ``SCHEMA`` are concatenated as they are (their shapes must agree). ``group`` is renumbered
    0..G-1 in order, each batch's groups distinct from the others' (two rollouts that both start at group
    0 do not merge).

    Args:
        batches: TensorDicts with batch_size [B_i] and the same keys.
        pad_token_id: fill for token ids; needed only when some batch must be padded.

    Returns:
        A new TensorDict with batch_size [sum B_i].

    Raises:
        ValueError: no batches, keys that differ between batches, a batch that fails ``check``, a key
            outside ``SCHEMA`` whose shapes differ, or a missing ``pad_token_id``.
    """
    if len(batches) == 0:
        raise ValueError("collate needs at least one batch")
    keys = set(batches[0].keys())
    own = [_check_schema(b) for b in batches]
    for i, b in enumerate(batches):
        if set(b.keys()) != keys:
            raise ValueError(f"batch {i} and batch 0 have different keys: {sorted(keys ^ set(b.keys()))}")
        for key in keys - SCHEMA.keys():
            t, t0 = b.get(key), batches[0].get(key)
            if isinstance(t, torch.Tensor) and t.shape[1:] != t0.shape[1:]:
                raise ValueError(
                    f"collate cannot pad {key!r} (not in SCHEMA): shape {tuple(t.shape)} in batch {i} vs "
                    f"{tuple(t0.shape)} in batch 0"
                )
    sizes = {dim: max((s[dim] for s in own if dim in s), default=0) for dim in ("P", "R")}
    out = torch.cat([_repad(b, o, sizes, pad_token_id) for b, o in zip(batches, own, strict=True)], dim=0)
    if "group" in keys:
        group = out.get("group")
        starts = torch.ones_like(group, dtype=torch.bool)
        starts[1:] = group[1:] != group[:-1]
        offsets = torch.tensor([b.batch_size[0] for b in batches[:-1]], dtype=torch.int64).cumsum(0)
        starts[offsets[offsets < group.numel()].to(group.device)] = True
        out.set("group", starts.cumsum(0) - 1)
    return out


# --- Splitting ----------------------------------------------------------------------------------------------


def split_microbatches(
    batch: TensorDictBase, microbatch_size: int, *, sort_by_length: bool = False
) -> list[TensorDictBase]:
    """Consecutive slices of ``microbatch_size`` rows, for gradient accumulation: views of ``batch`` (no
    copy), the last one maybe smaller, ``torch.cat`` of them ``batch``; an empty batch gives ``[]``.

    ``sort_by_length`` first orders the rows by real length (``attention_mask``; a stable sort), so the
    forward helpers, which cut each microbatch to its longest row, compute almost no padding; the slices
    are then copies, and a loss over a global token count gives the same gradient up to summation order.
    Reads the lengths on the host (one device sync).

    Raises:
        ValueError: ``microbatch_size < 1``, or ``sort_by_length`` without ``attention_mask``.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    if batch.batch_size[0] == 0:
        return []
    if sort_by_length and batch.batch_size[0] > microbatch_size:
        if "attention_mask" not in batch.keys():
            raise ValueError("sort_by_length needs 'attention_mask' in the batch to read row lengths")
        lengths = batch.get("attention_mask").sum(dim=1).cpu()
        order = torch.sort(lengths, stable=True).indices
        batch = batch[order.to(batch.device)]
    return list(batch.split(microbatch_size, dim=0))


def split_microbatches_by_tokens(
    batch: TensorDictBase, max_tokens: int, *, padded: bool = False, min_count: int = 1
) -> tuple[list[TensorDictBase], list[torch.Tensor]]:
    """Microbatches formed by a token budget instead of a row count (verl's ``use_dynamic_bsz`` with
    ``ppo_max_token_len_per_gpu``), the rows balanced by length
    (``rlbits.functional.packing.token_budget_partitions``).

    A row's tokens are the True entries of its ``attention_mask`` (all its texts for a [B, k, T] mask).
    ``padded=False`` (packed forward passes): each microbatch holds at most ``max_tokens`` real tokens, in
    the fewest microbatches (at least ``min_count``) whose token counts Karmarkar-Karp keeps within the
    budget, about equal. ``padded=True``: a microbatch's rows times its longest row is at most
    ``max_tokens``; rows of similar length go together. Deterministic (lengths and row order only); each
    microbatch keeps its rows in batch order. Reads the lengths on the host (one device sync).

    Returns:
        ``(micros, rows)``: the microbatches (copies) and, for each, the [b] int64 indices of its rows in
        ``batch``; together every row once. ``([], [])`` for an empty batch.

    Raises:
        ValueError: no ``attention_mask``, ``max_tokens < 1``, or a row longer than ``max_tokens``.
    """
    if "attention_mask" not in batch.keys():
        raise ValueError("split_microbatches_by_tokens needs 'attention_mask' in the batch to count each row's tokens")
    mask = batch.get("attention_mask")
    lengths = mask.reshape(mask.shape[0], -1).sum(-1).tolist()
    parts = token_budget_partitions(lengths, max_tokens, padded=padded, min_count=min_count)
    rows = [torch.tensor(p, dtype=torch.long, device=mask.device) for p in parts]
    return [batch[r] for r in rows], rows


def split_minibatches(
    batch: TensorDictBase,
    num_minibatches: int | None = None,
    *,
    minibatch_size: int | None = None,
    generator: torch.Generator | None = None,
    keep_groups: bool = True,
) -> list[TensorDictBase]:
    """Shuffle the rows and cut them into minibatches (one PPO epoch's updates).

    With ``keep_groups`` the shuffled units are whole groups (contiguous runs of equal ``group``; no
    ``group`` key: one per row), never split and in their order; otherwise rows. Rows are gathered
    (copied). Give exactly one of ``num_minibatches`` M (units dealt into M minibatches whose unit counts
    differ by at most one) and ``minibatch_size`` S rows (the last may hold fewer; with groups, all of one
    size K dividing S). ``generator``: a CPU ``torch.Generator`` (None: the global RNG). Reads ``group`` on
    the host (one device sync) when grouping.

    Raises:
        ValueError: both or neither size given, a size < 1, more minibatches than units, or (with
            ``minibatch_size`` and groups) unequal group sizes or S not a multiple of K.
    """
    if (num_minibatches is None) == (minibatch_size is None):
        raise ValueError("give exactly one of num_minibatches and minibatch_size")
    batch_len = batch.batch_size[0]
    if keep_groups and "group" in batch.keys():
        lengths = torch.unique_consecutive(batch.get("group").cpu(), return_counts=True)[1].tolist()
    else:
        lengths = [1] * batch_len
    units = torch.arange(batch_len).split(lengths)  # rows of each unit, in order

    if num_minibatches is not None:
        if not 1 <= num_minibatches <= len(units):
            raise ValueError(
                f"num_minibatches must be in [1, {len(units)}] (the number of "
                f"{'groups' if keep_groups else 'rows'}), got {num_minibatches}"
            )
        chunks = torch.randperm(len(units), generator=generator).tensor_split(num_minibatches)
    else:
        if minibatch_size < 1:
            raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
        if len(set(lengths)) > 1:
            raise ValueError(
                f"minibatch_size needs groups of equal size; group has sizes {sorted(set(lengths))}"
            )
        group_size = lengths[0] if lengths else 1
        if minibatch_size % group_size:
            raise ValueError(
                f"minibatch_size={minibatch_size} must be a multiple of the group size {group_size}"
            )
        chunks = torch.randperm(len(units), generator=generator).split(minibatch_size // group_size)
    return [batch[torch.cat([units[u] for u in chunk.tolist()])] for chunk in chunks]


def trim_padding(batch: TensorDictBase) -> TensorDictBase:
    """Drop the prompt columns that are padding in every row (``prompt_mask``; on the left) and the response
    columns that are padding in every row (``response_mask``, else ``action_mask``; on the right): every
    ``SCHEMA`` key is sliced to the new P, R or P+R, keys outside ``SCHEMA`` are left as they are. Returns a
    new TensorDict of views of ``batch``'s tensors. Reads the new lengths on the host (a device sync)."""
    keys = set(batch.keys())
    sizes = _check_schema(batch)
    prompt_len, response_len = sizes.get("P", 0), sizes.get("R", 0)
    first, last = 0, response_len  # keep prompt columns [first, P) and response columns [0, last)
    if "prompt_mask" in keys:
        used = batch.get("prompt_mask").any(dim=0)
        first = int(torch.where(used.any(), used.int().argmax(), prompt_len))
    if "response_mask" in keys or "action_mask" in keys:
        used = response_mask(batch).any(dim=0)
        last = int(torch.where(used.any(), response_len - used.flip(0).int().argmax(), 0))
    out = batch.copy()
    for key, spec in SCHEMA.items():
        if key not in keys or spec.dtype is str or len(spec.dims) < 2:
            continue
        t = batch.get(key)
        if spec.dims[1] == "P":
            out.set(key, t[:, first:])
        elif spec.dims[1] == "R":
            out.set(key, t[:, :last])
        else:
            out.set(key, t[:, first : prompt_len + last])
    return out
