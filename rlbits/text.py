"""Text in and out of the batch: prompt strings into left-padded token ids, token ids back into strings.

``chat_prompts`` renders each prompt as a user turn of the tokenizer's chat template; ``tokenize_prompts``
tokenizes strings (no special tokens, no tokenizer padding side) and ``make_prompts`` left-pads lists of ids
into ``prompts`` / ``prompt_mask`` (the input of ``generate``); ``decode`` writes ``prompt_text`` and
``response_text`` from the masked tokens of a batch. The batch layout is ``rlbits.batch``'s (docs/batch.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase

from rlbits.batch import pad_left, response_mask

__all__ = ["chat_prompts", "decode", "make_prompts", "tokenize_prompts"]


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
    return TensorDict({"prompts": prompts, "prompt_mask": mask}, batch_size=[len(rows)])


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
    if "prompts" not in keys and "responses" not in keys:
        raise ValueError(f"decode needs 'prompts' or 'responses'; the batch has {sorted(keys)}")
    if "prompts" in keys:
        rows = _masked_rows(batch.get("prompts"), batch.get("prompt_mask"))
        batch.set(
            "prompt_text", NonTensorStack.from_list(tokenizer.batch_decode(rows, skip_special_tokens=True))
        )
    if "responses" in keys:
        rows = _masked_rows(batch.get("responses"), response_mask(batch))
        batch.set(
            "response_text", NonTensorStack.from_list(tokenizer.batch_decode(rows, skip_special_tokens=True))
        )
    return batch
