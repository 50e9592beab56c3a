"""The batch: one TensorDict with ``batch_size [B]`` that every rlbits verb reads and writes.

Layout (as in verl and OpenRLHF): prompts are **left**-padded to a common length P, responses are
**right**-padded to a common length R, and every per-token quantity is aligned with the response only::

    prompts      [B, P]   . . a b c        prompt_mask    [B, P]   F F T T T
    responses    [B, R]   x y z . .        response_mask  [B, R]   T T T F F
    input_ids    [B, P+R] cat(prompts, responses)     attention_mask  cat(prompt_mask, response_mask)

``SCHEMA`` lists every key with its named-dim shape, dtype and meaning; the constants below (``PROMPTS``,
``ACTION_MASK``, ...) are the key names. Two masks live on the response side:

- ``response_mask``: True on every real (non-pad) response token, including tokens that are not trained on
  (tool or environment output spliced into the response). The attention mask covers these.
- ``action_mask``: True on the response tokens that are trained on; always a subset of ``response_mask``.
  Where it is False, per-token tensors (``PER_TOKEN_KEYS``) hold 0 and no loss or statistic sees them.

A batch without ``response_mask`` is read as if ``response_mask == action_mask`` (every real response token
is an action); ``build_batch`` always writes both.

Helpers: ``check`` (``validate``, its earlier name); ``make_prompts`` / ``tokenize_prompts``; ``build_batch``; ``pad_left`` /
``pad_right`` / ``collate``; ``split_microbatches`` / ``split_minibatches``; ``group_ids`` /
``repeat_interleave_prompts``; ``decode``; ``trim_padding``. None of them syncs with the device except
where its docstring says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import einops
import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, is_non_tensor
from torch.nn.utils.rnn import pad_sequence

__all__ = [
    "ACTION_MASK",
    "ADVANTAGES",
    "ATTENTION_MASK",
    "ENTROPY",
    "TRUNCATED",
    "GROUP",
    "INPUT_IDS",
    "LOGPROBS",
    "PER_TOKEN_KEYS",
    "PROMPTS",
    "PROMPT_MASK",
    "PROMPT_TEXT",
    "REF_LOGPROBS",
    "RESPONSES",
    "RESPONSE_MASK",
    "RESPONSE_TEXT",
    "RETURNS",
    "REWARDS",
    "SCHEMA",
    "TEXT_KEYS",
    "TOKEN_REWARDS",
    "VALUES",
    "KeySpec",
    "build_batch",
    "chat_prompts",
    "collate",
    "decode",
    "group_ids",
    "make_prompts",
    "pad_left",
    "pad_right",
    "repeat_interleave_prompts",
    "response_mask",
    "split_microbatches",
    "split_minibatches",
    "tokenize_prompts",
    "trim_padding",
    "check",
    "validate",
]

# --------------------------------------------------------------------------------------------------------
# Key names and schema
# --------------------------------------------------------------------------------------------------------

PROMPTS = "prompts"
PROMPT_MASK = "prompt_mask"
RESPONSES = "responses"
RESPONSE_MASK = "response_mask"
ACTION_MASK = "action_mask"
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LOGPROBS = "logprobs"
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
REWARDS = "rewards"
TOKEN_REWARDS = "token_rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"
ENTROPY = "entropy"
TRUNCATED = "truncated"
GROUP = "group"
PROMPT_TEXT = "prompt_text"
RESPONSE_TEXT = "response_text"


class KeySpec(NamedTuple):
    """What one batch key holds.

    ``dims`` names each dimension: ``B`` batch, ``P`` prompt length, ``R`` response length, ``P+R`` their
    sum. ``dtype`` is a ``torch.dtype``, or ``str`` for a non-tensor column of B strings (a
    ``NonTensorStack``).
    """

    dims: tuple[str, ...]
    dtype: torch.dtype | type
    meaning: str

    @property
    def shape(self) -> str:
        """The shape as written in the docs, e.g. ``"[B, P]"``."""
        return "[" + ", ".join(self.dims) + "]"

    def describe(self) -> str:
        """``"[B, P] int64"``-style shape and dtype, as used in error messages."""
        dtype = "str" if self.dtype is str else str(self.dtype).removeprefix("torch.")
        return f"{self.shape} {dtype}"


SCHEMA: dict[str, KeySpec] = {
    PROMPTS: KeySpec(("B", "P"), torch.int64, "prompt token ids, left-padded"),
    PROMPT_MASK: KeySpec(("B", "P"), torch.bool, "True on real prompt tokens"),
    RESPONSES: KeySpec(("B", "R"), torch.int64, "generated token ids, right-padded"),
    RESPONSE_MASK: KeySpec(
        ("B", "R"), torch.bool, "True on real (non-pad) response tokens, tool/env tokens included"
    ),
    ACTION_MASK: KeySpec(
        ("B", "R"), torch.bool, "True where a response token is trained on (not padding, not tool/env tokens)"
    ),
    INPUT_IDS: KeySpec(("B", "P+R"), torch.int64, "cat(prompts, responses)"),
    ATTENTION_MASK: KeySpec(("B", "P+R"), torch.bool, "cat(prompt_mask, response_mask)"),
    LOGPROBS: KeySpec(("B", "R"), torch.float32, "log pi_old(token) under the behaviour policy"),
    REF_LOGPROBS: KeySpec(("B", "R"), torch.float32, "log pi_ref(token) under the frozen reference policy"),
    VALUES: KeySpec(("B", "R"), torch.float32, "critic V(s_t) for the state before response token t"),
    REWARDS: KeySpec(("B",), torch.float32, "sequence-level score"),
    TOKEN_REWARDS: KeySpec(("B", "R"), torch.float32, "score on the last action token minus kl_coef * kl"),
    ADVANTAGES: KeySpec(("B", "R"), torch.float32, "advantage of each action token"),
    RETURNS: KeySpec(("B", "R"), torch.float32, "return (value target) of each action token"),
    ENTROPY: KeySpec(("B", "R"), torch.float32, "entropy of the sampling distribution at each action token"),
    TRUNCATED: KeySpec(("B",), torch.bool, "the response hit max_new_tokens without a stop token (overlong)"),
    GROUP: KeySpec(
        ("B",), torch.int64, "which prompt a sample came from; samples of one prompt are contiguous"
    ),
    PROMPT_TEXT: KeySpec(("B",), str, "decoded prompt (non-tensor)"),
    RESPONSE_TEXT: KeySpec(("B",), str, "decoded response (non-tensor)"),
}
"""Every key of the batch: ``key -> KeySpec(dims, dtype, meaning)``. docs/design.md's table ("The batch") plus
``response_mask`` (see the module docstring) and ``entropy`` (written by ``generate(return_entropy=True)``)."""

PER_TOKEN_KEYS: tuple[str, ...] = tuple(
    k for k, s in SCHEMA.items() if s.dims == ("B", "R") and s.dtype == torch.float32
)
"""Float [B, R] keys that hold 0 where ``action_mask`` is False."""

TEXT_KEYS: tuple[str, ...] = tuple(k for k, s in SCHEMA.items() if s.dtype is str)
"""Non-tensor string keys (one ``str`` per row)."""


def response_mask(batch: TensorDictBase) -> torch.Tensor:
    """The mask of real response tokens: ``response_mask`` if present, else ``action_mask``. [B, R] bool."""
    if RESPONSE_MASK in batch.keys():
        return batch.get(RESPONSE_MASK)
    if ACTION_MASK in batch.keys():
        return batch.get(ACTION_MASK)
    raise ValueError(f"batch has neither {RESPONSE_MASK!r} nor {ACTION_MASK!r}")


# --------------------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------------------


def check(
    batch: TensorDictBase,
    required: Iterable[str] = (PROMPTS, PROMPT_MASK),
    *,
    check_values: bool = False,
) -> TensorDictBase:
    """Check a batch against ``SCHEMA``; return it unchanged.

    Always checked (shapes and dtypes only, no device sync):

    - the batch is a TensorDict with ``batch_size [B]``;
    - every key in ``required`` is present;
    - every ``SCHEMA`` key that is present has its dtype and named-dim shape, with one P and one R across
      all keys (``input_ids`` and ``attention_mask`` are [B, P+R]);
    - text keys hold one ``str`` per row (a ``NonTensorStack``, not one ``NonTensorData`` holding a list).

    Keys not in ``SCHEMA`` are allowed and not checked.

    With ``check_values=True`` (reads tensor contents, so it syncs with the device):

    - per-token keys (``PER_TOKEN_KEYS``) are 0 where ``action_mask`` is False;
    - ``action_mask`` is True only where ``response_mask`` is;
    - ``prompt_mask`` is left-padded (each row's True entries are a suffix) and ``response_mask`` is
      right-padded (a prefix);
    - ``input_ids == cat(prompts, responses)`` and ``attention_mask == cat(prompt_mask, response_mask)``;
    - rows of one ``group`` are contiguous.

    Args:
        batch: the TensorDict to check.
        required: keys that must be present.
        check_values: also run the content checks above.

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



validate = check
"""Earlier name of ``check`` (in rlbits "validate" means the reward on held-out prompts)."""

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
    if ACTION_MASK in keys:
        action = batch.get(ACTION_MASK)
        for key in PER_TOKEN_KEYS:
            if key in keys and bool((batch.get(key) != 0).logical_and(~action).any()):
                raise ValueError(f"{key} must be 0 where {ACTION_MASK} is False")
        if RESPONSE_MASK in keys and bool(action.logical_and(~batch.get(RESPONSE_MASK)).any()):
            raise ValueError(
                f"{ACTION_MASK} is True where {RESPONSE_MASK} is False (a pad token is an action)"
            )
    if PROMPT_MASK in keys:
        mask = batch.get(PROMPT_MASK)
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError(f"{PROMPT_MASK} must be left-padded: False entries only before the True ones")
    if RESPONSE_MASK in keys:
        mask = batch.get(RESPONSE_MASK)
        if bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(f"{RESPONSE_MASK} must be right-padded: False entries only after the True ones")
    if {INPUT_IDS, PROMPTS, RESPONSES} <= keys:
        if not torch.equal(
            batch.get(INPUT_IDS), torch.cat([batch.get(PROMPTS), batch.get(RESPONSES)], dim=1)
        ):
            raise ValueError(f"{INPUT_IDS} must equal cat({PROMPTS}, {RESPONSES})")
    if {ATTENTION_MASK, PROMPT_MASK} <= keys and (RESPONSE_MASK in keys or ACTION_MASK in keys):
        expected = torch.cat([batch.get(PROMPT_MASK), response_mask(batch)], dim=1)
        if not torch.equal(batch.get(ATTENTION_MASK), expected):
            name = RESPONSE_MASK if RESPONSE_MASK in keys else ACTION_MASK
            raise ValueError(f"{ATTENTION_MASK} must equal cat({PROMPT_MASK}, {name})")
    if GROUP in keys:
        group = batch.get(GROUP)
        runs = int((group[1:] != group[:-1]).sum()) + 1 if group.numel() else 0
        if runs != torch.unique(group).numel():
            raise ValueError(f"{GROUP}: rows of one group must be contiguous")


# --------------------------------------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------------------------------------


def _pad_to(t: torch.Tensor, length: int, value: Any, side: str, dim: int) -> torch.Tensor:
    """Pad ``t`` along ``dim`` up to ``length`` with ``value``, on ``side`` (``"left"`` or ``"right"``).

    The one hand-written pad, for what ``torch.nn.utils.rnn.pad_sequence`` does not do: a fixed target
    length (``pad_left(..., length=L)``) and a dim other than the sequence dim of a list (``collate``
    re-pads the P and R columns of a whole batch).
    """
    extra = length - t.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad a length-{t.shape[dim]} sequence to the shorter length {length}")
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    fill = t.new_full(shape, value)
    return torch.cat([fill, t] if side == "left" else [t, fill], dim=dim)


def _pad_sequences(seqs: Sequence[torch.Tensor], pad_value: Any, length: int | None, side: str) -> torch.Tensor:
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
    """Stack sequences of different lengths, padding at the end (the response layout).

    Args:
        seqs: N tensors ``[L_i, *]`` of one dtype and trailing shape.
        pad_value: fill value (a pad token id, 0, False).
        length: pad to this length instead of ``max(L_i)``.

    Returns:
        ``[N, L, *]`` in the input dtype; row i holds ``seqs[i]`` in columns ``[0, L_i)``.

    Raises:
        ValueError: empty ``seqs``, mismatched dtypes or trailing shapes, ``length < max(L_i)``.
    """
    return _pad_sequences(seqs, pad_value, length, "right")


def pad_left(seqs: Sequence[torch.Tensor], pad_value: Any, length: int | None = None) -> torch.Tensor:
    """Stack sequences of different lengths, padding at the start (the prompt layout).

    Args:
        seqs: N tensors ``[L_i, *]`` of one dtype and trailing shape.
        pad_value: fill value (a pad token id, 0, False).
        length: pad to this length instead of ``max(L_i)``.

    Returns:
        ``[N, L, *]`` in the input dtype; row i holds ``seqs[i]`` in columns ``[L - L_i, L)``.

    Raises:
        ValueError: empty ``seqs``, mismatched dtypes or trailing shapes, ``length < max(L_i)``.
    """
    return _pad_sequences(seqs, pad_value, length, "left")


# --------------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------------


def make_prompts(
    token_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    max_prompt_len: int | None = None,
    truncation: str = "left",
) -> TensorDict:
    """Left-pad lists of token ids into the input of ``generate``.

    Args:
        token_ids: B non-empty lists of token ids.
        pad_token_id: id written in padding positions (masked out, so any valid id works).
        max_prompt_len: longest prompt kept; None keeps every prompt whole.
        truncation: for prompts longer than ``max_prompt_len``: ``"left"`` drops their first tokens (the
            end of a prompt, next to the response, is kept); ``"error"`` raises.

    Returns:
        ``TensorDict(prompts [B, P] int64, prompt_mask [B, P] bool, batch_size=[B])`` on the CPU, with P the
        longest (truncated) prompt.

    Raises:
        ValueError: no prompts, an empty prompt, a bad ``max_prompt_len`` or ``truncation``, or (with
            ``truncation="error"``) a prompt longer than ``max_prompt_len``.
    """
    if truncation not in ("left", "error"):
        raise ValueError(f"truncation must be 'left' or 'error', got {truncation!r}")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be >= 1 or None, got {max_prompt_len}")
    if len(token_ids) == 0:
        raise ValueError("make_prompts needs at least one prompt, got an empty list")
    rows = []
    for i, ids in enumerate(token_ids):
        row = torch.as_tensor(ids, dtype=torch.int64)
        if row.dim() != 1 or row.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {ids!r}")
        if max_prompt_len is not None and row.numel() > max_prompt_len:
            if truncation == "error":
                raise ValueError(
                    f"prompt {i} has {row.numel()} tokens, more than max_prompt_len={max_prompt_len}"
                )
            row = row[-max_prompt_len:]
        rows.append(row)
    prompts = pad_left(rows, pad_token_id)
    mask = pad_left([torch.ones(len(r), dtype=torch.bool) for r in rows], False)
    return TensorDict({PROMPTS: prompts, PROMPT_MASK: mask}, batch_size=[len(rows)])


def tokenize_prompts(
    tokenizer: Any,
    texts: Sequence[str],
    max_prompt_len: int | None = None,
    *,
    truncation: str = "left",
    add_special_tokens: bool = False,
) -> TensorDict:
    """Tokenize prompt strings with a Hugging Face tokenizer and left-pad them with ``make_prompts``.

    The tokenizer's own padding, truncation and padding side are not used (so its ``padding_side`` cannot
    turn prompts right-padded), and special tokens are not added unless asked: a BERT-style ``[SEP]`` or an
    EOS appended to a prompt would end generation before it starts. Pass ``add_special_tokens=True`` for
    models that expect the tokenizer's BOS (e.g. Llama).

    Args:
        tokenizer: a ``transformers`` tokenizer (``PreTrainedTokenizerBase``).
        texts: B prompt strings.
        max_prompt_len, truncation: as in ``make_prompts``.
        add_special_tokens: passed to the tokenizer.

    Returns:
        ``TensorDict(prompts [B, P] int64, prompt_mask [B, P] bool)``; padding uses the tokenizer's pad
        token, or its EOS token when it has no pad token.

    Raises:
        ValueError: ``texts`` is a single string or empty, the tokenizer has neither a pad nor an EOS token,
            or anything ``make_prompts`` raises (e.g. a text that tokenizes to nothing).
    """
    if isinstance(texts, str):
        raise ValueError("texts must be a list of strings, got a single str (wrap it in a list)")
    texts = list(texts)
    if len(texts) == 0:
        raise ValueError("tokenize_prompts needs at least one text, got an empty list")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad_token_id nor an eos_token_id to pad prompts with")
    ids = tokenizer(
        texts,
        add_special_tokens=add_special_tokens,
        padding=False,
        truncation=False,
        return_attention_mask=False,
    )["input_ids"]
    return make_prompts(ids, pad, max_prompt_len=max_prompt_len, truncation=truncation)


def chat_prompts(tokenizer: Any, texts: Sequence[str], *, system: str | None = None) -> list[str]:
    """Each text as one user turn of a chat, rendered by the tokenizer's chat template as a string that ends
    where the assistant's answer begins (``apply_chat_template(..., tokenize=False, add_generation_prompt=True)``).

    The strings hold the template's special tokens as text (``<|im_start|>user...``); tokenizing them
    without adding special tokens (what ``tokenize_prompts`` does) gives the ids ``apply_chat_template(...,
    tokenize=True)`` gives. ``system`` adds a system turn first; without it the template's own default
    applies (SmolLM2's names the assistant "SmolLM").

    Raises:
        ValueError: ``texts`` is a single string, or the tokenizer has no chat template (a base model such
            as GPT-2: run with ``chat_template: false``).
    """
    if isinstance(texts, str):
        raise ValueError("texts must be a list of strings, got a single str (wrap it in a list)")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '')!r}) has no chat "
            "template, so prompts cannot be formatted as a chat; use a chat model (e.g. policy=smollm2-135m) or "
            "set chat_template=false"
        )
    head = [{"role": "system", "content": system}] if system is not None else []
    return [
        tokenizer.apply_chat_template(
            [*head, {"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in texts
    ]


def group_ids(num_prompts: int, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Group id of each sample when every prompt is sampled ``group_size`` times in a row.

    Example: ``group_ids(2, 3) -> tensor([0, 0, 0, 1, 1, 1])``.

    Returns:
        ``[num_prompts * group_size]`` int64.

    Raises:
        ValueError: ``num_prompts < 0`` or ``group_size < 1``.
    """
    if num_prompts < 0 or group_size < 1:
        raise ValueError(f"need num_prompts >= 0 and group_size >= 1, got {num_prompts} and {group_size}")
    return einops.repeat(torch.arange(num_prompts, device=device), "g -> (g k)", k=group_size)


def repeat_interleave_prompts(td: TensorDictBase, group_size: int) -> TensorDictBase:
    """Repeat each row ``group_size`` times in a row, for ``num_samples > 1``.

    Every key (tensor and text) is repeated, so the samples of one prompt are contiguous, and ``group``
    [B * K] int64 is (over)written with ``group_ids(B, K)``: row ``i`` of the result came from prompt
    ``i // K``.

    Args:
        td: batch_size [B], e.g. the output of ``make_prompts``.
        group_size: K >= 1.

    Returns:
        A new TensorDict with batch_size [B * K].

    Raises:
        ValueError: ``group_size < 1`` or ``td`` is not 1-D.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if td.batch_dims != 1:
        raise ValueError(f"td must have batch_size [B], got {list(td.batch_size)}")
    out = td.repeat_interleave(group_size, dim=0)
    device = td.get(PROMPTS).device if PROMPTS in td.keys() else td.device
    out.set(GROUP, group_ids(td.batch_size[0], group_size, device=device))
    return out


# --------------------------------------------------------------------------------------------------------
# Building and combining batches
# --------------------------------------------------------------------------------------------------------


def build_batch(
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    **columns: torch.Tensor | Sequence[str],
) -> TensorDict:
    """Assemble a batch and fill ``input_ids``, ``attention_mask`` and ``response_mask``.

    ``input_ids = cat(prompts, responses)`` and ``attention_mask = cat(prompt_mask, response_mask)``:
    the attention mask covers every real response token, including tool/env tokens that are not actions.
    When ``response_mask`` is None, every real response token is taken to be an action
    (``response_mask = action_mask``); pass it whenever ``action_mask`` has False entries between real
    tokens. Per-token keys (``PER_TOKEN_KEYS``) are set to 0 where ``action_mask`` is False (values that
    ``generate`` computed on padding are dropped), so the batch obeys the layout.

    Args:
        prompts: [B, P] int64, left-padded.
        prompt_mask: [B, P] bool.
        responses: [B, R] int64, right-padded.
        action_mask: [B, R] bool.
        response_mask: [B, R] bool, True on real response tokens; a superset of ``action_mask``.
        **columns: more keys: tensors with leading dim B (``logprobs=..., rewards=..., group=...``; schema
            keys are checked against ``SCHEMA``, others are stored as given) or lists of B strings
            (``prompt_text``, ``response_text``), stored as ``NonTensorStack``.

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
        PROMPTS: prompts,
        PROMPT_MASK: prompt_mask,
        RESPONSES: responses,
        RESPONSE_MASK: response_mask,
        ACTION_MASK: action_mask,
    }
    for key, value in columns.items():
        if key in (INPUT_IDS, ATTENTION_MASK):
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
    check(batch, required=(PROMPTS, PROMPT_MASK, RESPONSES, ACTION_MASK))
    zero = torch.zeros((), device=action_mask.device)
    per_token = batch.select(*[key for key in PER_TOKEN_KEYS if key in columns])
    batch.update(per_token.apply(lambda t: torch.where(action_mask, t, zero)))
    batch.set(INPUT_IDS, torch.cat([prompts, responses], dim=1))
    batch.set(ATTENTION_MASK, torch.cat([prompt_mask, response_mask], dim=1))
    return batch


def _pad_value(key: str, dtype: torch.dtype, pad_token_id: int | None) -> Any:
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return 0.0
    if pad_token_id is None:
        raise ValueError(f"collate needs pad_token_id to pad {key} (batches have different lengths)")
    return pad_token_id


def _repad(
    batch: TensorDictBase, own: dict[str, int], prompt_len: int, response_len: int, pad_token_id: int | None
) -> TensorDictBase:
    """Pad one batch's schema keys from its own sizes ``own`` to P=prompt_len (left), R=response_len (right)."""
    out = batch.copy()
    for key, spec in SCHEMA.items():
        if key not in batch.keys() or spec.dtype is str or len(spec.dims) < 2:
            continue
        t = batch.get(key)
        side = spec.dims[1]
        if side == "P" and own["P"] != prompt_len:
            out.set(key, _pad_to(t, prompt_len, _pad_value(key, t.dtype, pad_token_id), "left", dim=1))
        elif side == "R" and own["R"] != response_len:
            out.set(key, _pad_to(t, response_len, _pad_value(key, t.dtype, pad_token_id), "right", dim=1))
        elif side == "P+R" and (own.get("P"), own.get("R")) != (prompt_len, response_len):
            if "P" not in own:
                raise ValueError(f"collate needs {PROMPTS} or {PROMPT_MASK} to re-pad {key}")
            value = _pad_value(key, t.dtype, pad_token_id)
            head = _pad_to(t[:, : own["P"]], prompt_len, value, "left", dim=1)
            tail = _pad_to(t[:, own["P"] :], response_len, value, "right", dim=1)
            out.set(key, torch.cat([head, tail], dim=1))
    return out


def collate(batches: Sequence[TensorDictBase], pad_token_id: int | None = None) -> TensorDictBase:
    """Concatenate batches whose prompt and response lengths differ.

    Each batch is checked, then prompt-side keys are left-padded to the largest P, response-side keys
    right-padded to the largest R (0 for floats, False for masks, ``pad_token_id`` for token ids), and
    ``input_ids`` / ``attention_mask`` re-padded on both sides of their prompt/response boundary. Text keys
    and keys outside ``SCHEMA`` are concatenated as they are (their shapes must already agree).
    ``group`` is renumbered 0..G-1 in order, each batch's groups distinct from the others' (two rollouts
    that both start at group 0 do not merge).

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
    sizes = [_check_schema(b) for b in batches]
    for i, b in enumerate(batches):
        if set(b.keys()) != keys:
            diff = sorted(keys.symmetric_difference(b.keys()))
            raise ValueError(f"batch {i} and batch 0 have different keys: {diff}")
        for key in keys - SCHEMA.keys():
            t, t0 = b.get(key), batches[0].get(key)
            if isinstance(t, torch.Tensor) and t.shape[1:] != t0.shape[1:]:
                raise ValueError(
                    f"collate cannot pad {key!r} (not in SCHEMA): shape {tuple(t.shape)} in batch {i} vs "
                    f"{tuple(t0.shape)} in batch 0"
                )
    prompt_len = max((s["P"] for s in sizes if "P" in s), default=0)
    response_len = max((s["R"] for s in sizes if "R" in s), default=0)
    padded = [
        _repad(b, own, prompt_len, response_len, pad_token_id) for b, own in zip(batches, sizes, strict=True)
    ]
    out = torch.cat(padded, dim=0)
    if GROUP in keys:
        group = out.get(GROUP)
        starts = torch.ones_like(group, dtype=torch.bool)
        starts[1:] = group[1:] != group[:-1]
        offsets = torch.tensor([b.batch_size[0] for b in batches[:-1]], dtype=torch.int64).cumsum(0)
        starts[offsets[offsets < group.numel()].to(group.device)] = True
        out.set(GROUP, starts.cumsum(0) - 1)
    return out


# --------------------------------------------------------------------------------------------------------
# Splitting
# --------------------------------------------------------------------------------------------------------


def split_microbatches(
    batch: TensorDictBase, microbatch_size: int, *, sort_by_length: bool = False
) -> list[TensorDictBase]:
    """Consecutive slices of ``microbatch_size`` rows, for gradient accumulation.

    The slices are views of ``batch`` (no copy); the last one may be smaller; text keys stay aligned.
    ``torch.cat(split_microbatches(b, n))`` equals ``b``. An empty batch gives an empty list.

    With ``sort_by_length`` the rows are first ordered by their real length (prompt plus response tokens,
    from ``attention_mask``; a stable sort), so each microbatch holds rows of similar length and the forward
    helpers (``rlbits.models.forward``), which cut every microbatch to its longest row, compute almost no
    padding. The slices are then copies, and their concatenation is ``b`` in that order. Losses aggregated
    with a global token count (``num_tokens``) give the same gradient either way (up to float summation
    order). Reads the lengths on the host (one device sync).

    Raises:
        ValueError: ``microbatch_size < 1``, or ``sort_by_length`` without ``attention_mask``.
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
    if batch.batch_size[0] == 0:
        return []
    if sort_by_length and batch.batch_size[0] > microbatch_size:
        if ATTENTION_MASK not in batch.keys():
            raise ValueError(f"sort_by_length needs {ATTENTION_MASK!r} in the batch to read row lengths")
        lengths = batch.get(ATTENTION_MASK).sum(dim=1).cpu()
        order = torch.sort(lengths, stable=True).indices
        batch = batch[order.to(batch.device)]
    return list(batch.split(microbatch_size, dim=0))


def split_minibatches(
    batch: TensorDictBase,
    num_minibatches: int | None = None,
    *,
    minibatch_size: int | None = None,
    generator: torch.Generator | None = None,
    keep_groups: bool = True,
) -> list[TensorDictBase]:
    """Shuffle the rows and cut them into minibatches (one PPO epoch's updates).

    With ``keep_groups`` the shuffled units are whole groups (contiguous runs of equal ``group``; a batch
    without a ``group`` key is read as one group per row): a group is never split across minibatches and
    its rows keep their order. Otherwise single rows are shuffled. Rows are gathered (copied), not viewed.

    Give exactly one of:

    - ``num_minibatches`` M: the units are dealt into M minibatches whose unit counts differ by at most one;
    - ``minibatch_size`` S rows: each minibatch holds S rows (the last may hold fewer); with groups, every
      group must have the same size K and S must be a multiple of K.

    Args:
        batch: batch_size [B].
        num_minibatches, minibatch_size: see above.
        generator: CPU ``torch.Generator`` for a reproducible shuffle; None uses the global RNG.
        keep_groups: shuffle whole groups (True) or rows (False).

    Returns:
        List of TensorDicts.

    Raises:
        ValueError: both or neither size given, a size < 1, more minibatches than units, or (with
            ``minibatch_size`` and groups) unequal group sizes or S not a multiple of K.

    Reads ``group`` on the host (one device sync) when grouping.
    """
    if (num_minibatches is None) == (minibatch_size is None):
        raise ValueError("give exactly one of num_minibatches and minibatch_size")
    batch_len = batch.batch_size[0]
    if keep_groups and GROUP in batch.keys():
        lengths = torch.unique_consecutive(batch.get(GROUP).cpu(), return_counts=True)[1].tolist()
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
                f"minibatch_size needs groups of equal size; {GROUP} has sizes {sorted(set(lengths))}"
            )
        group_size = lengths[0] if lengths else 1
        if minibatch_size % group_size:
            raise ValueError(
                f"minibatch_size={minibatch_size} must be a multiple of the group size {group_size}"
            )
        chunks = torch.randperm(len(units), generator=generator).split(minibatch_size // group_size)
    return [batch[torch.cat([units[u] for u in chunk.tolist()])] for chunk in chunks]


# --------------------------------------------------------------------------------------------------------
# Text and trimming
# --------------------------------------------------------------------------------------------------------


def _masked_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [
        [t for t, m in zip(row, mrow, strict=True) if m]
        for row, mrow in zip(ids.tolist(), mask.tolist(), strict=True)
    ]


def decode(batch: TensorDictBase, tokenizer: Any) -> TensorDictBase:
    """Write ``prompt_text`` and ``response_text``: the real tokens of each row, decoded.

    Only tokens under ``prompt_mask`` / the response mask (``response_mask``, else ``action_mask``) are
    decoded, with ``skip_special_tokens=True``; a batch with prompts only gets ``prompt_text`` only. The
    texts are stored as ``NonTensorStack`` (one ``str`` per row), so indexing, splitting and concatenating
    the batch keeps them aligned with the tensors. Copies the tokens to the host (one device sync).

    Args:
        batch: batch_size [B] with ``prompts``/``prompt_mask`` and/or ``responses`` and a response mask.
        tokenizer: anything with ``batch_decode(list[list[int]], skip_special_tokens=...)`` (HF tokenizers).

    Returns:
        ``batch``, modified in place.

    Raises:
        ValueError: the batch has neither ``prompts`` nor ``responses``.
    """
    keys = set(batch.keys())
    if PROMPTS not in keys and RESPONSES not in keys:
        raise ValueError(f"decode needs {PROMPTS!r} or {RESPONSES!r}; the batch has {sorted(keys)}")
    if PROMPTS in keys:
        rows = _masked_rows(batch.get(PROMPTS), batch.get(PROMPT_MASK))
        batch.set(
            PROMPT_TEXT, NonTensorStack.from_list(tokenizer.batch_decode(rows, skip_special_tokens=True))
        )
    if RESPONSES in keys:
        rows = _masked_rows(batch.get(RESPONSES), response_mask(batch))
        batch.set(
            RESPONSE_TEXT, NonTensorStack.from_list(tokenizer.batch_decode(rows, skip_special_tokens=True))
        )
    return batch


def trim_padding(batch: TensorDictBase) -> TensorDictBase:
    """Drop prompt columns that are padding in every row (on the left) and response columns that are
    padding in every row (on the right).

    Prompt columns are judged by ``prompt_mask``, response columns by ``response_mask`` (else
    ``action_mask``). Every ``SCHEMA`` key is sliced to the new P and R (``input_ids`` and
    ``attention_mask`` to the new P+R); keys outside ``SCHEMA`` are left as they are. Reads the new
    lengths on the host (a device sync).

    Returns:
        A new TensorDict whose tensors are views of ``batch``'s.
    """
    keys = set(batch.keys())
    sizes = _check_schema(batch)
    prompt_len, response_len = sizes.get("P", 0), sizes.get("R", 0)
    first, last = 0, response_len  # keep prompt columns [first, P) and response columns [0, last)
    if PROMPT_MASK in keys:
        used = batch.get(PROMPT_MASK).any(dim=0)
        first = int(torch.where(used.any(), used.int().argmax(), prompt_len))
    if RESPONSE_MASK in keys or ACTION_MASK in keys:
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
