"""Dialogue samples as trlx's ILQL tokenizes them (``trlx/pipeline/offline_pipeline.py``, 3340c2f): a sample is
a list of segments alternating prompt (not actions) and output (actions); ``tokenize_dialogue`` tokenizes each
segment alone and ``truncate_dialogue`` cuts the sample to a token budget from either side. Used by
``rlbits.data.offline.tensorize_dataset`` for ILQL's offline set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class DialogSegment(NamedTuple):
    """One segment of a tokenized sample (trlx's ``DialogMessage``): ``tokens`` are actions when
    ``is_output``."""

    is_output: bool
    tokens: tuple[int, ...]


def dialogue_start_token(tokenizer: Any) -> int:
    """The id trlx puts before a sample that starts with an output (``tokenizer.bos_token_id``; EOS where the
    tokenizer has no BOS, as trlx's str shorthand does)."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise ValueError("a sample starting with an output needs a BOS or EOS token before it; the tokenizer has none")
    return token


def truncate_dialogue(
    segments: Sequence[DialogSegment], max_length: int | None, truncation_side: str, start_token: int
) -> list[DialogSegment]:
    """trlx's truncation of a tokenized sample (``tokenize_dialogue`` in ``trlx/pipeline/offline_pipeline.py``,
    3340c2f): keep the first ``max_length`` tokens (``truncation_side="left"``: the last), drop the segments
    left empty, and if the sample then starts with an output put ``start_token`` before it as a prompt
    segment, after dropping one more token (the first of a left-truncated sample, the last of a
    right-truncated one) when the sample fills ``max_length``.

    Args:
        segments: the sample's segments in order.
        max_length: the most tokens kept; None: no truncation (empty segments still dropped, the start token
            still put before a leading output).
        truncation_side: ``"right"`` or ``"left"``.
        start_token: the prompt token put before a leading output (trlx: ``bos_token_id``).

    Returns:
        The segments, each a new ``DialogSegment``.

    Raises:
        ValueError: ``truncation_side`` is neither side, or ``max_length < 1``.
    """
    if truncation_side not in ("right", "left"):
        raise ValueError(f"truncation_side must be 'right' or 'left', got {truncation_side!r}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    left = truncation_side == "left"
    segs = [DialogSegment(s.is_output, tuple(s.tokens)) for s in segments]
    if max_length is not None:
        if left:  # cut from the far end of the reversed sample
            segs = [DialogSegment(s.is_output, s.tokens[::-1]) for s in segs[::-1]]
        kept, budget = [], max_length
        for s in segs:
            kept.append(DialogSegment(s.is_output, s.tokens[: max(budget, 0)]))
            budget -= len(s.tokens)
        segs = [DialogSegment(s.is_output, s.tokens[::-1]) for s in kept[::-1]] if left else kept
    segs = [s for s in segs if s.tokens]
    if segs and segs[0].is_output:
        if max_length is not None and sum(len(s.tokens) for s in segs) == max_length:  # room for the start token
            if left:
                segs[0] = DialogSegment(True, segs[0].tokens[1:])
            else:
                segs[-1] = DialogSegment(segs[-1].is_output, segs[-1].tokens[:-1])
        segs.insert(0, DialogSegment(False, (start_token,)))
    return segs


def tokenize_dialogue(
    dialogue: str | Sequence[str], tokenizer: Any, max_length: int | None = None, truncation_side: str = "right"
) -> list[DialogSegment]:
    """A dialogue sample tokenized as trlx's ``tokenize_dialogue`` (``trlx/pipeline/offline_pipeline.py``,
    3340c2f): a str is ``(bos_token or eos_token, text)``; the tokenizer's EOS text is appended to the last
    segment unless it ends with it; each segment is tokenized alone, without special tokens; segments
    alternate prompt (even index) and output (odd index); then ``truncate_dialogue``.

    Args:
        dialogue: a str, or an even number of str segments, prompt first.
        tokenizer: an HF tokenizer with an EOS token.
        max_length: tokens kept (trlx's ``train.seq_length``); None: all.
        truncation_side: ``"right"`` or ``"left"`` (trlx: ``tokenizer.truncation_side``).

    Returns:
        The ``DialogSegment`` list: a prompt segment first, empty segments dropped.

    Raises:
        ValueError: an odd number of segments; a tokenizer without EOS; as ``truncate_dialogue``.
    """
    if tokenizer.eos_token is None:
        raise ValueError("tokenize_dialogue needs a tokenizer with an EOS token (it ends the last segment)")
    if isinstance(dialogue, str):
        dialogue = [tokenizer.bos_token or tokenizer.eos_token, dialogue]
    dialogue = list(dialogue)
    if len(dialogue) % 2 != 0:
        raise ValueError(f"a dialogue must have an even number of segments, alternating prompt and output; got "
                         f"{len(dialogue)}")
    if not dialogue[-1].endswith(tokenizer.eos_token):
        dialogue[-1] = dialogue[-1] + tokenizer.eos_token
    segments = [
        DialogSegment(i % 2 == 1, tuple(tokenizer(text, add_special_tokens=False)["input_ids"]))
        for i, text in enumerate(dialogue)
    ]
    return truncate_dialogue(segments, max_length, truncation_side, dialogue_start_token(tokenizer))


__all__ = ["DialogSegment", "dialogue_start_token", "tokenize_dialogue", "truncate_dialogue"]
