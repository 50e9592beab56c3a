"""torchrl LLM conversations into rlbits batches: ``history_to_batch``, ``episode_to_batch``, ``episode_buffer``.

torchrl 0.14 keeps an LLM episode as a ``torchrl.data.llm.History`` (role / content messages) and rebuilds
the tokens of every turn from text. rlbits trains on token ids, so this module renders each conversation
with the tokenizer's chat template and marks which tokens are the policy's:

- **prompt**: every message before the first ``assistant`` one, rendered with the generation prompt;
- **response**: the rest of the rendered conversation; ``response_mask`` True on all of it;
- **action_mask**: True on the tokens of each assistant message *and* its end-of-turn token (the policy
  sampled it), False on tool / user messages and on template glue (role headers, newlines). A message with
  ``is_complete=False`` (cut at ``max_new_tokens``) has no end-of-turn token among its actions.

Which tokens are an assistant message's comes from one of two methods (``method=``):

- ``"generation"``: the template's ``{% generation %}`` blocks, through
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` (Hugging Face's assistant mask).
- ``"prefix"``: render the conversation up to each assistant message with the generation prompt, and up to
  and including it, and take the token ids in between (up to the first end-of-turn token). It needs the
  *prefix property*: the ids of a shorter rendering are a prefix of the ids of a longer one. This is checked,
  and a ``ValueError`` names the message where it fails.

**Exactness.** Text is not tokens: re-tokenising a message's text can give other ids than the policy sampled
(``' le' 'isure'`` sampled, ``' leisure'`` re-encoded), and then ``logprobs`` of those ids are not the
behaviour policy's. Pass ``sampled_ids`` (per assistant message, the ids the policy sampled) to use them
verbatim; their decoding is checked against the message text. Rows whose assistant tokens came from
re-tokenising text have ``retokenized`` True. See docs/envs.md ("torchrl").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

import rlbits.batch as rb
from rlbits.text import decode, make_prompts

__all__ = ["episode_buffer", "episode_to_batch", "history_to_batch"]

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


# --------------------------------------------------------------------------------------------------------
# Conversations from torchrl History objects
# --------------------------------------------------------------------------------------------------------


def _messages(history: Any, episode: int) -> list[dict]:
    """One episode as a list of ``{"role", "content", "is_complete"}`` dicts (torchrl's ``<none>`` padding
    dropped). Accepts a 1-D ``History`` or a list of message dicts."""
    if isinstance(history, Sequence) and not isinstance(history, str):
        rows = [dict(m) for m in history]
    elif hasattr(history, "tolist") and hasattr(history, "role"):
        if history.batch_dims != 1:
            raise ValueError(
                f"episode {episode}: expected a 1-D History (one conversation), got batch_size "
                f"{list(history.batch_size)}"
            )
        rows = history.tolist()
    else:
        raise ValueError(
            f"episode {episode}: expected a torchrl History or a list of message dicts, got {type(history).__name__}"
        )
    out = []
    for j, m in enumerate(rows):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"episode {episode}, message {j}: needs 'role' and 'content', got {m!r}")
        if m["role"] == "<none>":
            continue
        if not isinstance(m["content"], str):
            raise ValueError(
                f"episode {episode}, message {j}: content must be a str (multimodal content is not supported), "
                f"got {type(m['content']).__name__}"
            )
        is_complete = m.get("is_complete", True)
        out.append({"role": m["role"], "content": m["content"], "is_complete": bool(is_complete)})
    return out


def _episodes(histories: Any) -> list[list[dict]]:
    """``histories`` as B lists of messages: a ``History`` [B, T] (one row per episode), a ``History`` [T]
    (one episode), or a sequence of 1-D ``History`` / message lists."""
    if hasattr(histories, "batch_dims") and hasattr(histories, "role"):
        if histories.batch_dims == 1:
            return [_messages(histories, 0)]
        if histories.batch_dims == 2:
            return [_messages(histories[i], i) for i in range(histories.batch_size[0])]
        raise ValueError(f"histories must be a History [B, T] or [T], got {list(histories.batch_size)}")
    if isinstance(histories, Sequence) and not isinstance(histories, str):
        if len(histories) == 0:
            raise ValueError("histories is empty: need at least one episode")
        return [_messages(h, i) for i, h in enumerate(histories)]
    raise ValueError(
        f"histories must be a torchrl History or a list of episodes, got {type(histories).__name__}"
    )


# --------------------------------------------------------------------------------------------------------
# Rendering one episode
# --------------------------------------------------------------------------------------------------------


class _Renderer:
    """``apply_chat_template`` then encode without special tokens (as ``rlbits.text.chat_prompts`` +
    ``tokenize_prompts`` do), with a fixed template and ``tools``."""

    def __init__(self, tokenizer: Any, chat_template: str | None, tools: list[dict] | None):
        self.tokenizer, self.chat_template, self.tools = tokenizer, chat_template, tools

    def text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
        return self.tokenizer.apply_chat_template(
            conversation,
            tools=self.tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.text(messages, add_generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def assistant_mask(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        conversation = [{"role": m["role"], "content": m["content"]} for m in messages]
        out = self.tokenizer.apply_chat_template(
            conversation,
            tools=self.tools,
            chat_template=self.chat_template,
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return list(out["input_ids"]), list(out["assistant_masks"])


def _is_prefix(short: list[int], long: list[int]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def _prefix_failure(episode: int, index: int, what: str, short: list[int], long: list[int]) -> ValueError:
    at = next(
        (k for k, (a, b) in enumerate(zip(short, long, strict=False)) if a != b), min(len(short), len(long))
    )
    return ValueError(
        f"episode {episode}, message {index}: {what} is not a token prefix of the whole conversation (they "
        f"differ at token {at}: {short[at : at + 3]} vs {long[at : at + 3]}); the chat template re-renders or "
        f"re-merges earlier text, so the prefix method cannot place this message's tokens. Use a template with "
        f"{{% generation %}} blocks (method='generation') or pass chat_template="
    )


def _spans_by_prefix(
    r: _Renderer, messages: list[dict], full: list[int], first: int, end_of_turn: int | None, episode: int
) -> list[tuple[int, int]]:
    """[start, end) in ``full`` of each assistant message's action tokens, by rendering prefixes."""
    spans = []
    for i in range(first, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = r.ids(messages[:i], add_generation_prompt=True)
        upto = r.ids(messages[: i + 1], add_generation_prompt=False)
        if not _is_prefix(before, full):
            raise _prefix_failure(
                episode, i, "the conversation before it with the generation prompt", before, full
            )
        if not _is_prefix(upto, full):
            raise _prefix_failure(episode, i, "the conversation up to and including it", upto, full)
        turn = full[len(before) : len(upto)]
        stop = turn.index(end_of_turn) if end_of_turn is not None and end_of_turn in turn else None
        if stop is None:
            if messages[i]["is_complete"]:
                raise ValueError(
                    f"episode {episode}, message {i}: the template renders no end-of-turn token (id "
                    f"{end_of_turn}) after this complete assistant message, so where the policy's tokens end "
                    f"is unknown; pass end_of_turn= (the token the policy samples to end a turn)"
                )
            length = len(turn)  # cut at max_new_tokens: all of the rendered turn, no end-of-turn token
        else:
            length = stop + 1 if messages[i]["is_complete"] else stop
        spans.append((len(before), len(before) + length))
    return spans


def _spans_by_generation(
    r: _Renderer, messages: list[dict], full: list[int], first: int, end_of_turn: int | None, episode: int
) -> list[tuple[int, int]]:
    """[start, end) in ``full`` of each assistant message's action tokens, from the template's
    ``{% generation %}`` mask (runs of True, one per non-empty assistant message, in order)."""
    ids, mask = r.assistant_mask(messages)
    if ids != full:
        raise ValueError(
            f"episode {episode}: apply_chat_template(tokenize=True) gives other ids than encoding the rendered "
            f"text; the generation mask cannot be aligned"
        )
    runs, start = [], None
    for k, m in enumerate([*mask, 0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append((start, k))
            start = None
    assistants = [i for i in range(first, len(messages)) if messages[i]["role"] == "assistant"]
    with_text = [i for i in assistants if messages[i]["content"]]
    # One run per assistant message; an empty message may render no generation tokens at all.
    owners = assistants if len(runs) == len(assistants) else with_text
    if len(runs) != len(owners):
        raise ValueError(
            f"episode {episode}: the template's generation mask has {len(runs)} runs of assistant tokens but the "
            f"conversation has {len(assistants)} assistant messages ({len(with_text)} with text); use "
            f"method='prefix'"
        )
    by_message = dict(zip(owners, runs, strict=True))
    spans = []
    for i in assistants:
        if i not in by_message:  # empty and cut: no tokens; place it before the next rendered token
            before = r.ids(messages[:i], add_generation_prompt=True)
            spans.append((len(before), len(before)))
            continue
        s, e = by_message[i]
        if (
            not messages[i]["is_complete"]
            and end_of_turn is not None
            and e > s
            and full[e - 1] == end_of_turn
        ):
            e -= 1  # the template closes the turn, but the policy never sampled the end-of-turn token
        spans.append((s, e))
    return spans


def _end_of_turn(tokenizer: Any, end_of_turn: int | str | None) -> int | None:
    if end_of_turn is None:
        return tokenizer.eos_token_id
    if isinstance(end_of_turn, str):
        ids = tokenizer.convert_tokens_to_ids([end_of_turn])
        if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"end_of_turn={end_of_turn!r} is not a single token of the tokenizer")
        return ids[0]
    return int(end_of_turn)


# --------------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------------


def history_to_batch(
    histories: Any,
    tokenizer: Any,
    *,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    method: str = "auto",
    end_of_turn: int | str | None = None,
    sampled_ids: Sequence[Sequence[Sequence[int] | None]] | None = None,
    assistant_logprobs: Sequence[Sequence[torch.Tensor]] | None = None,
    rewards: torch.Tensor | Sequence[float] | None = None,
) -> TensorDict:
    """Turn torchrl conversations (one ``History`` per episode) into an rlbits batch.

    Per episode: the prompt is every message before the first assistant message, rendered with the generation
    prompt; the response is the rest of the conversation rendered (``add_generation_prompt=False``). Tokens
    are the tokenizer's encoding of the rendered text without added special tokens, so for text-level input
    ``cat(prompt, response)`` equals ``tokenizer(apply_chat_template(messages, tokenize=False),
    add_special_tokens=False)``. The template is the tokenizer's own unless ``chat_template`` is given
    (torchrl's ``History.apply_chat_template`` may swap in its own template by model name; this does not).

    Args:
        histories: B episodes: a ``torchrl.data.llm.History`` with batch_size [B, T] (``<none>`` padding
            messages are dropped) or [T] (one episode), or a list of 1-D ``History`` or of lists of
            ``{"role", "content"[, "is_complete"]}`` dicts. Each needs an assistant message.
        tokenizer: a Hugging Face tokenizer with a chat template (a fast one for ``method="generation"``).
        chat_template: a Jinja template to use instead of the tokenizer's.
        tools: tool schemas passed to the template (``ToolRegistry.schemas()``).
        method: ``"generation"`` (the template's ``{% generation %}`` mask), ``"prefix"`` (diff rendered
            prefixes) or ``"auto"`` (``"generation"`` when the template contains ``{% generation %}``).
        end_of_turn: the token (id or str) that ends an assistant turn; default the tokenizer's EOS. It is an
            action of a complete assistant message and not of one with ``is_complete=False``.
        sampled_ids: per episode, per assistant message of the response (in order), the ids the policy
            sampled, or None for a message without them. Used verbatim in place of the re-tokenised ones; the
            end-of-turn token belongs in them when it was sampled.
        assistant_logprobs: per episode, per assistant message, a 1-D float tensor with one log-prob per action
            token (the same count as the message's action tokens). Without it the batch has no ``logprobs``.
        rewards: [B] sequence-level scores, written as ``rewards`` float32.

    Returns:
        ``TensorDict`` [B] checked by ``rb.check``: ``prompts`` [B, P] int64 (left-padded), ``prompt_mask``,
        ``responses`` [B, R] int64 (right-padded with the pad token, else EOS), ``response_mask``,
        ``action_mask``, ``input_ids``, ``attention_mask``, optional ``logprobs`` [B, R] float32 (0 off
        actions) and ``rewards`` [B] float32, ``prompt_text`` / ``response_text`` (``rlbits.text.decode``),
        ``retokenized`` [B] bool (some assistant message's ids came from re-tokenising its text, so they may
        differ from what the policy sampled), ``num_turns`` [B] int64 (assistant messages in the response)
        and ``turn_index`` [B, R] int64 (the assistant turn a token belongs to, its observation included; -1
        on padding).

    Raises:
        ValueError: an episode without an assistant message or with non-string content; the prefix property
            failing (naming the episode and message); a complete assistant message with no end-of-turn token
            after it (``method="prefix"``); a generation mask that does not match the assistant messages;
            ``sampled_ids`` whose decoding differs from the message text (naming both); logprobs whose length
            is not the message's action-token count; per-episode lists of the wrong length; an unknown
            ``method``.
    """
    episodes = _episodes(histories)
    batch_len = len(episodes)
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    if method == "auto":
        method = "generation" if _GENERATION_TAG.search(template) else "prefix"
    if method not in ("generation", "prefix"):
        raise ValueError(f"method must be 'auto', 'generation' or 'prefix', got {method!r}")
    for name, given in (("sampled_ids", sampled_ids), ("assistant_logprobs", assistant_logprobs)):
        if given is not None and len(given) != batch_len:
            raise ValueError(f"{name} has {len(given)} episodes, histories has {batch_len}")
    eot = _end_of_turn(tokenizer, end_of_turn)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    r = _Renderer(tokenizer, chat_template, tools)
    find_spans = _spans_by_generation if method == "generation" else _spans_by_prefix

    prompts, responses, actions, turn_ids, logprob_rows, retokenized, num_turns = [], [], [], [], [], [], []
    for b, messages in enumerate(episodes):
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError(f"episode {b} has no assistant message: nothing for the policy to be trained on")
        prompt = r.ids(messages[:first], add_generation_prompt=True)
        full = r.ids(messages, add_generation_prompt=False)
        if not _is_prefix(prompt, full):
            raise _prefix_failure(
                b, first, "the prompt (messages before it, generation prompt)", prompt, full
            )
        spans = find_spans(r, messages, full, first, eot, b)
        turns_ids = _assistant_ids(full, spans, messages, first, sampled_ids, b, tokenizer)
        retokenized.append(any(s is None for s in _per_episode(sampled_ids, b, len(spans))))
        lp_given = _per_episode(assistant_logprobs, b, len(spans))
        response, action, turn, lps = _response_row(full, len(prompt), spans, turns_ids, lp_given, b)
        if not response:
            raise ValueError(f"episode {b}: the response renders to no tokens")
        prompts.append(prompt)
        responses.append(torch.tensor(response, dtype=torch.int64))
        actions.append(torch.tensor(action, dtype=torch.bool))
        turn_ids.append(torch.tensor(turn, dtype=torch.int64))
        logprob_rows.append(torch.tensor(lps, dtype=torch.float32))
        num_turns.append(len(spans))

    prompt_td = make_prompts(prompts, pad_token_id=pad)
    real = rb.pad_right([torch.ones(len(t), dtype=torch.bool) for t in responses], False)
    columns: dict[str, Any] = {
        "retokenized": torch.tensor(retokenized, dtype=torch.bool),
        "num_turns": torch.tensor(num_turns, dtype=torch.int64),
        "turn_index": rb.pad_right(turn_ids, -1),
    }
    if assistant_logprobs is not None:
        columns["logprobs"] = rb.pad_right(logprob_rows, 0.0)
    if rewards is not None:
        columns["rewards"] = torch.as_tensor(rewards, dtype=torch.float32)
    batch = rb.build_batch(
        prompt_td.get("prompts"),
        prompt_td.get("prompt_mask"),
        rb.pad_right(responses, pad),
        rb.pad_right(actions, False),
        response_mask=real,
        **columns,
    )
    return decode(batch, tokenizer)


def _response_row(
    full: list[int],
    prompt_len: int,
    spans: list[tuple[int, int]],
    turns_ids: list[list[int]],
    logprobs: list[torch.Tensor | None],
    episode: int,
) -> tuple[list[int], list[bool], list[int], list[float]]:
    """One row's response ids, action flags, turn indices and log-probs: the template's tokens of ``full``
    after the prompt, with each assistant span ``[s, e)`` replaced by that turn's ids (maybe sampled)."""
    response, action, turn, lps = [], [], [], []
    cursor = prompt_len
    for k, ((s, e), ids) in enumerate(zip(spans, turns_ids, strict=True)):
        glue = full[cursor:s]  # the previous turn's observation and this turn's role header
        response += glue + ids
        action += [False] * len(glue) + [True] * len(ids)
        turn += [max(k - 1, 0)] * len(glue) + [k] * len(ids)
        lps += [0.0] * len(glue) + _logprobs_for(logprobs[k], len(ids), episode, k)
        cursor = e
    tail = full[cursor:]
    response += tail
    action += [False] * len(tail)
    turn += [len(spans) - 1] * len(tail)
    lps += [0.0] * len(tail)
    return response, action, turn, lps


def _per_episode(given: Sequence | None, episode: int, num_assistant: int) -> list:
    if given is None:
        return [None] * num_assistant
    row = list(given[episode])
    if len(row) != num_assistant:
        raise ValueError(
            f"episode {episode} has {num_assistant} assistant messages in its response but {len(row)} entries "
            f"were given for it (one per assistant message, None where there are none)"
        )
    return row


def _assistant_ids(
    full: list[int],
    spans: list[tuple[int, int]],
    messages: list[dict],
    first: int,
    sampled_ids: Sequence | None,
    episode: int,
    tokenizer: Any,
) -> list[list[int]]:
    """Each assistant message's action ids: ``sampled_ids`` verbatim where given (checked against the
    text the template renders for those tokens), else the template's."""
    assistants = [i for i in range(first, len(messages)) if messages[i]["role"] == "assistant"]
    out = []
    for (s, e), given, i in zip(
        spans, _per_episode(sampled_ids, episode, len(spans)), assistants, strict=True
    ):
        rendered = full[s:e]
        if given is None:
            out.append(rendered)
            continue
        given = [int(t) for t in given]
        want = tokenizer.decode(rendered, skip_special_tokens=False)
        got = tokenizer.decode(given, skip_special_tokens=False)
        if got != want:
            raise ValueError(
                f"episode {episode}, message {i}: sampled_ids decode to {got!r} but the message renders as "
                f"{want!r} (is_complete={messages[i]['is_complete']}); they are not this message's tokens"
            )
        out.append(given)
    return out


def _logprobs_for(given: torch.Tensor | None, length: int, episode: int, turn: int) -> list[float]:
    if given is None:
        return [0.0] * length
    t = torch.as_tensor(given, dtype=torch.float32).detach().cpu()
    if t.dim() != 1 or t.numel() != length:
        raise ValueError(
            f"episode {episode}, assistant message {turn}: assistant_logprobs has shape {tuple(t.shape)} but the "
            f"message has {length} action tokens (end-of-turn token included when sampled); logprobs that "
            f"are not aligned with the tokens cannot be used"
        )
    return t.tolist()


def episode_to_batch(rollout: TensorDictBase, tokenizer: Any, **kwargs: Any) -> TensorDict:
    """An rlbits batch from a torchrl ``ChatEnv`` rollout in history mode.

    The conversation of each episode is read from its last step: ``("next", "history")``'s ``prompt`` (what
    ``ChatEnv`` writes after a step: the whole conversation so far), else ``("history")``'s ``full``. The
    episode's reward is the sum over steps of ``("next", "reward")`` when that key exists. torchrl's
    ``log_probs`` are not read: they belong to tokens torchrl rebuilt from text, which need not be the
    rendered ones (docs/envs.md, "torchrl"); pass ``assistant_logprobs`` to ``history_to_batch`` yourself if
    you have aligned ones.

    Args:
        rollout: ``env.rollout(...)`` output with batch_size [B, T] or [T] (one env).
        tokenizer: as in ``history_to_batch``.
        **kwargs: passed to ``history_to_batch`` (``chat_template``, ``method``, ``sampled_ids``, ...).

    Returns:
        The batch of ``history_to_batch``, with ``rewards`` [B] float32 from the rollout when present.

    Raises:
        ValueError: a rollout without a history (not history mode), or with more than two batch dims; and
            what ``history_to_batch`` raises.
    """
    if rollout.batch_dims == 1:
        rollout = rollout.unsqueeze(0)
    if rollout.batch_dims != 2:
        raise ValueError(f"rollout must have batch_size [B, T] or [T], got {list(rollout.batch_size)}")
    last = rollout[:, -1]
    keys = set(last.keys(include_nested=True))
    if ("next", "history", "prompt") in keys:
        history = last.get(("next", "history")).prompt
    elif ("history", "full") in keys:
        history = last.get("history").full
    else:
        raise ValueError(
            "rollout has neither ('next', 'history', 'prompt') nor ('history', 'full'): run ChatEnv with "
            "input_mode='history'"
        )
    if ("next", "reward") in set(rollout.keys(include_nested=True)) and "rewards" not in kwargs:
        reward = rollout.get(("next", "reward")).float()
        kwargs["rewards"] = reward.reshape(rollout.batch_size[0], rollout.batch_size[1], -1).sum(dim=(1, 2))
    return history_to_batch(history, tokenizer, **kwargs)


def episode_buffer(capacity: int, pad_token_id: int, **kwargs: Any):
    """A ``torchrl.data.ReplayBuffer`` of rlbits episode rows whose prompt and response lengths may differ.

    ``LazyTensorStorage`` fixes P and R at the first ``extend`` and refuses a batch of other lengths, so this
    stores rows in a ``ListStorage`` and collates a sample with ``rb.collate`` (prompts left-padded, responses
    right-padded) then ``rb.trim_padding``: each sampled row holds the same real tokens, masks, per-token
    values and text as when it was added, padded to the widest row of the sample. ``group`` ids are
    renumbered one per row (a sample is not a set of groups).

    Args:
        capacity: rows kept (the oldest are overwritten).
        pad_token_id: fill for token ids when collating rows of different lengths.
        **kwargs: passed to ``ReplayBuffer`` (``sampler=``, ``batch_size=``, ...).

    Returns:
        ``ReplayBuffer``: ``buf.extend(batch)`` adds the B rows of a batch; ``buf.sample(n)`` returns a batch.
    """
    from torchrl.data import ListStorage, ReplayBuffer

    def collate(rows: list[TensorDictBase]) -> TensorDictBase:
        return rb.trim_padding(rb.collate([row.unsqueeze(0) for row in rows], pad_token_id=pad_token_id))

    return ReplayBuffer(storage=ListStorage(capacity), collate_fn=collate, **kwargs)
