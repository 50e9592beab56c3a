"""Token-exact multi-turn rollout: ``generate_episodes`` runs a batch of env episodes (``rlbits.envs``).

Token in, token out: the policy's tokens are the ids ``generate`` sampled, never re-tokenised from text; the
env's observations are appended as tokens (its ``token_ids`` verbatim, or its ``text`` tokenised without
special tokens) with ``action_mask`` False and ``response_mask`` True. So a teacher-forced forward of the
returned ``input_ids`` gives back the behaviour ``logprobs`` of every action token (tests/rollout/test_multiturn.py),
a stop token or stop string the policy sampled is an action, and a turn cut at its token budget keeps its
tokens. Each turn, the unfinished episodes are decoded together by ``generate`` from their whole context
(prompt + every turn and observation so far): the context is prefilled again every turn (simple and exact;
no KV cache is carried between turns, which costs one prefill of the context per turn). Then the envs of
those episodes are stepped on a bounded pool of threads, each step under a wall-clock bound.

The returned layout is docs/batch.md's, plus the multi-turn keys (docs/envs.md, "Multi-turn rollout").
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict

from rlbits.batch import build_batch, group_ids, pad_left, pad_right
from rlbits.envs.base import Env, Observation, StepResult
from rlbits.models.forward import context_length
from rlbits.rollout.generate import generate
from rlbits.rollout.sampling import LogitsProcessor
from rlbits.text import decode, make_prompts

STOP_REASONS = ("done", "eos", "max_turns", "context", "env_timeout", "env_error")
"""Why an episode ended (``stop_reason``): the env said done; the policy sampled EOS (``stop.stop_on_eos``);
``stop.max_turns`` turns were taken; the next turn or observation would not fit ``max_episode_tokens`` or
the model's context; an env step ran past ``env_timeout_s``; an env step raised."""


def _tokenize(tokenizer: Any, obs: Observation, what: str) -> list[int]:
    """The token ids of an observation: ``token_ids`` verbatim, else ``text`` without special tokens (as
    ``tokenize_prompts`` tokenises a prompt)."""
    if not isinstance(obs, Observation):
        raise TypeError(f"{what} must be an rlbits.envs.Observation, got {type(obs).__name__}")
    if obs.token_ids is not None:
        ids = list(obs.token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError(f"{what}.token_ids must be ints, got {obs.token_ids!r}")
        return ids
    return list(tokenizer(obs.text, add_special_tokens=False)["input_ids"]) if obs.text else []


def _step_guarded(
    envs: Sequence[Env],
    rows: Sequence[int],
    texts: Sequence[str],
    ids: Sequence[list[int]],
    *,
    max_workers: int,
    timeout_s: float,
) -> dict[int, StepResult | tuple[str, str]]:
    """Step ``envs[rows[k]]`` with ``(texts[k], ids[k])``, at most ``max_workers`` at a time, each step under a
    wall-clock bound of ``timeout_s`` seconds from its own start.

    Like ``rlbits.envs.step_all`` but an env that raises or does not return in time ends only its own
    episode: its entry is ``("env_error" | "env_timeout", message)`` instead of a ``StepResult``. Python
    cannot stop a thread, so a step that timed out keeps running in its (daemon) thread, abandoned: its
    result is ignored and its slot is given to the next step.
    """
    done: queue.Queue = queue.Queue()
    results: dict[int, StepResult | tuple[str, str]] = {}

    def work(k: int) -> None:
        try:
            result = envs[rows[k]].step(texts[k], ids[k])
            if not isinstance(result, StepResult):
                raise TypeError(
                    f"env.step must return an rlbits.envs.StepResult, got {type(result).__name__}"
                )
            if not isinstance(result.observation, Observation):
                raise TypeError(f"StepResult.observation must be an Observation, got {result.observation!r}")
            float(result.reward)  # a reward that is not a number is this env's error, not the batch's
            done.put((k, result))
        except BaseException as e:  # noqa: BLE001 - any failure of the env ends its episode, not the batch
            done.put((k, ("env_error", f"{type(e).__name__}: {e}")))

    waiting = list(range(len(rows)))[::-1]
    running: dict[int, float] = {}  # k -> start time
    while waiting or running:
        while waiting and len(running) < max_workers:
            k = waiting.pop()
            running[k] = time.monotonic()
            threading.Thread(target=work, args=(k,), daemon=True, name=f"rlbits-env-{rows[k]}").start()
        first_deadline = min(running.values()) + timeout_s
        try:
            k, result = done.get(timeout=max(first_deadline - time.monotonic(), 0.0))
            if k in running:  # else it had timed out already: ignore the late result
                del running[k]
                results[rows[k]] = result
        except queue.Empty:
            pass
        now = time.monotonic()
        for k, start in list(running.items()):
            if now - start >= timeout_s:
                del running[k]
                results[rows[k]] = (
                    "env_timeout",
                    f"env.step did not return within env_timeout_s={timeout_s}",
                )
    return results


def _stopping(rows: list[int], envs: Sequence[Env], budgets: list[int], eos: int | None, tokenizer: Any):
    """The per-row stop rule for ``generate(stopping=...)`` of one turn: budget reached, EOS (when the env
    stops on EOS), or a stop string in the decoded text of the turn (special tokens kept)."""
    stops = [envs[i].stop.stop_strings for i in rows]
    on_eos = [envs[i].stop.stop_on_eos and eos is not None for i in rows]

    def stopping(responses: torch.Tensor) -> torch.Tensor:
        t = responses.shape[1]
        out = []
        ids = responses.tolist()
        for j, row in enumerate(ids):
            stop = t >= budgets[j] or (on_eos[j] and row[-1] == eos)
            out.append(stop or _ends_with_stop(row, stops[j], tokenizer))
        return torch.tensor(out, dtype=torch.bool)

    return stopping


def _chunks(lengths: list[int], budgets: list[int], model_limit: int | None) -> list[list[int]]:
    """Rows (indices into ``lengths``) decoded together in one ``generate`` call: all of them when their
    longest context plus their largest token budget fits the model's positions, else groups of rows of
    similar context length that each fit, so that no row's turn is cut to fit a longer row's context (each
    row fits on its own: ``lengths[j] + budgets[j] <= model_limit``). Deterministic (sorted by length, then
    index), so a run's RNG stream does not depend on timing."""
    everything = list(range(len(lengths)))
    if model_limit is None or max(lengths) + max(budgets) <= model_limit:
        return [everything]
    chunks: list[list[int]] = []
    for j in sorted(everything, key=lambda j: (-lengths[j], j)):
        if chunks:
            chunk = chunks[-1]
            longest = lengths[chunk[0]]  # sorted: the first row of a chunk is its longest
            if longest + max(budgets[j], *(budgets[k] for k in chunk)) <= model_limit:
                chunk.append(j)
                continue
        chunks.append([j])
    return [sorted(chunk) for chunk in chunks]


def _ends_with_stop(ids: list[int], stop_strings: Sequence[str], tokenizer: Any) -> bool:
    """Whether a stop string is in the decoded tail of a turn that could hold one just completed."""
    if not stop_strings:
        return False
    tail = 4 * max(len(s) for s in stop_strings) + 4  # a character may take 4 byte tokens
    text = tokenizer.decode(ids[-tail:], skip_special_tokens=False)
    return any(s in text for s in stop_strings)


def generate_episodes(
    policy: torch.nn.Module,
    tokenizer: Any,
    envs: Sequence[Env],
    prompts: Sequence[str | Mapping],
    *,
    temperature: float,
    generator: torch.Generator | None = None,
    max_episode_tokens: int | None = None,
    reward_placement: Literal["token", "sequence"] = "token",
    max_env_workers: int = 8,
    env_timeout_s: float = 60.0,
    compile: bool = False,
    logits_processor: LogitsProcessor | None = None,
    group_size: int = 1,
    pack_weights: bool | None = None,
    max_turns: int | None = None,
    continuous_batching: bool = False,
    max_num_seqs: int | None = None,
) -> TensorDict:
    """Run one episode per env, all turns of the batch decoded together; return one batch row per episode.

    ``envs[i].reset(prompts[i])`` gives the prompt: its ``token_ids`` verbatim, or its ``text`` tokenised without
    special tokens (as ``tokenize_prompts``, which ``generate_texts`` uses). Then, until every episode ended:

    1. The unfinished episodes are decoded together by ``generate`` from their whole context (left-padded,
       prefilled again each turn; no cache is carried between turns). A row's turn ends after a token that is
       EOS (``env.stop.stop_on_eos``), after a token that completes one of ``env.stop.stop_strings`` in the
       decoded text of the turn (special tokens kept; the token holding the end of the stop string is the
       turn's last action), or at its budget: ``env.stop.max_new_tokens``, less when the context has no room
       for it. A finished row samples nothing more; its tokens and their ``logprobs`` at ``temperature`` are
       the sampled ones.
    2. Every env of those episodes is stepped with the turn's text (decoded with special tokens kept, so an env
       sees the EOS or stop string the turn ended on) and its sampled ids, at most ``max_env_workers`` at a
       time, each step bounded by ``env_timeout_s`` seconds of wall clock.
    3. The turn's reward goes on its last action token (``turn_rewards``). The episode ends, by the first of:
       the step raised (``"env_error"``) or timed out (``"env_timeout"``); the env said done (``"done"``); the
       turn ended with EOS (``"eos"``); the turn was cut by the context (``"context"``); this was turn
       ``env.stop.max_turns``, or ``max_turns`` when that is smaller (``"max_turns"``). Else the observation's tokens are appended (not actions); if
       they do not all fit, the part that fits is appended and the episode ends with ``"context"``. An
       episode whose next turn would have no room for a single token ends with ``"context"`` too.

    The context of an episode (prompt + response) never exceeds ``max_episode_tokens`` nor the model's
    ``max_position_embeddings``. The unfinished episodes of a turn are decoded in one ``generate`` call
    when the longest context plus the largest budget fits the model's positions, else in groups of
    similar context length that do, so one long episode never shortens another's turn.

    Args:
        policy: an HF causal LM, as for ``generate``.
        tokenizer: a ``transformers`` tokenizer (``__call__``, ``decode``, ``batch_decode``, ``eos_token_id``,
            ``pad_token_id``; pad may equal EOS).
        envs: one env per episode (``rlbits.envs.Env``); each is used for this episode only.
        prompts: what ``envs[i].reset`` gets: a string or a dataset row.
        temperature: the sampling temperature (0: greedy, logprobs at temperature 1, as ``generate``).
        generator: sampling noise, as ``generate`` (one draw per decoding step of each turn).
        max_episode_tokens: most tokens an episode (prompt + response) may hold; None: the model's context.
        reward_placement: ``"token"`` or ``"sequence"``; recorded for the loops, which put the turn rewards
            on the turns' last action tokens (``turn_rewards``) or use their sum (``rewards``). Both keys are
            always returned.
        max_env_workers: most env steps running at once.
        env_timeout_s: wall-clock bound of one env step, in seconds.
        compile: ``generate(compile=True)`` for each turn's decoding.
        logits_processor: as ``generate`` (changes sampling, not ``logprobs``).
        group_size: rows ``i*K .. i*K+K-1`` (K = ``group_size``) are samples of one prompt: ``group`` = i.
        pack_weights: as ``generate`` (None: oneDNN on packed weights for a CPU policy without ``compile``).
        max_turns: a cap on every episode's turns over its env's ``stop.max_turns`` (NeMo-RL's
            ``max_rollout_turns``); None: the envs' own.
        continuous_batching: as ``generate``: a turn's finished rows leave the decode batch (the same samples).
        max_num_seqs: must be None: ``generate``'s slots call ``stopping`` on subsets of the rows, and a
            turn's stop rule is per episode row.

    Returns:
        TensorDict, batch size [B] (B = ``len(envs)``), on the policy's device, with the keys of
        docs/batch.md: ``prompts`` [B, P] (left-padded), ``prompt_mask``, ``responses`` [B, R] (every turn and
        observation, right-padded with the pad id), ``response_mask`` (True on action and observation tokens),
        ``action_mask`` (True on sampled tokens only), ``input_ids``, ``attention_mask``, ``logprobs`` [B, R]
        float32 (0 off actions), ``rewards`` [B] float32 (the sum of the turn rewards), ``truncated`` [B]
        bool (the episode ended by ``"context"``, or its last turn hit its budget without a stop and the env
        did not say done), ``group`` [B] int64, ``prompt_text`` and ``response_text`` (decoded, special
        tokens skipped, as ``decode``); and ``turn_rewards`` [B, R] float32 (each turn's reward on that turn's
        last action token, 0 elsewhere), ``turn_index`` [B, R] int64 (the 0-based turn of each token: a
        turn's action tokens and the observation after it share its index; -1 on padding), ``num_turns`` [B]
        int64 (policy turns taken), ``stop_reason`` (one of ``STOP_REASONS`` per row, non-tensor).

    Raises:
        ValueError: ``envs`` and ``prompts`` differ in length or are empty, ``B`` is not a multiple of
            ``group_size``, a bad ``reward_placement`` / ``max_env_workers`` / ``env_timeout_s`` /
            ``max_episode_tokens``, a ``max_num_seqs`` other than None, a prompt that is empty or longer than
            the model's context, or a tokenizer without a pad or EOS id.
        TypeError: an env's ``reset`` returns something other than an ``Observation``.
        Exception: whatever an env's ``reset`` raises (a broken prompt is not an episode). A ``step`` that
            raises, or returns something other than a ``StepResult`` with an ``Observation`` and a numeric
            reward, ends its episode with ``"env_error"`` instead.
    """
    if max_num_seqs is not None:
        raise ValueError(
            f"generate_episodes does not support max_num_seqs (got {max_num_seqs!r}): generate's slots call the "
            "stop rule on subsets of the rows, and a turn's stop rule is per episode row; use "
            "continuous_batching=True instead"
        )
    B = len(envs)
    if B == 0 or len(prompts) != B:
        raise ValueError(
            f"generate_episodes: need one prompt per env and at least one, got {B} envs, {len(prompts)} prompts"
        )
    if reward_placement not in ("token", "sequence"):
        raise ValueError(f"reward_placement must be 'token' or 'sequence', got {reward_placement!r}")
    if isinstance(max_env_workers, bool) or not isinstance(max_env_workers, int) or max_env_workers < 1:
        raise ValueError(f"max_env_workers must be an int >= 1, got {max_env_workers!r}")
    if not (isinstance(env_timeout_s, (int, float)) and env_timeout_s > 0 and math.isfinite(env_timeout_s)):
        raise ValueError(f"env_timeout_s must be a finite number of seconds > 0, got {env_timeout_s!r}")
    if max_episode_tokens is not None and (
        isinstance(max_episode_tokens, bool)
        or not isinstance(max_episode_tokens, int)
        or max_episode_tokens < 2
    ):
        raise ValueError(f"max_episode_tokens must be None or an int >= 2, got {max_episode_tokens!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or B % group_size:
        raise ValueError(f"group_size must be an int >= 1 dividing the {B} episodes, got {group_size!r}")
    if max_turns is not None and (not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1):
        raise ValueError(f"max_turns must be None or an int >= 1, got {max_turns!r}")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if pad is None:
        raise ValueError("the tokenizer has neither a pad_token_id nor an eos_token_id")
    limit = context_length(policy)
    model_limit = limit[1] if limit is not None else None
    room = min(x for x in (max_episode_tokens, model_limit, math.inf) if x is not None)
    device = next(policy.parameters()).device

    prompt_ids = [
        _tokenize(tokenizer, env.reset(p), f"envs[{i}].reset(...)")
        for i, (env, p) in enumerate(zip(envs, prompts, strict=True))
    ]
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"envs[{i}].reset gave an empty prompt (no tokens)")
        if model_limit is not None and len(ids) > model_limit:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, more than the model's context ({limit[0]} = {model_limit})"
            )
    response: list[list[int]] = [[] for _ in range(B)]
    actions: list[list[bool]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    turn_of: list[list[int]] = [[] for _ in range(B)]
    rewards_at: list[dict[int, float]] = [{} for _ in range(B)]
    num_turns = [0] * B
    reason: list[str | None] = [None] * B
    truncated = [False] * B

    while True:
        rows, budgets = [], []
        for i in range(B):
            if reason[i] is not None:
                continue
            budget = min(envs[i].stop.max_new_tokens, room - len(prompt_ids[i]) - len(response[i]))
            if budget < 1:
                reason[i], truncated[i] = "context", True
                continue
            rows.append(i)
            budgets.append(int(budget))
        if not rows:
            break
        contexts = [prompt_ids[i] + response[i] for i in rows]
        lengths, sampled, sampled_lp = [0] * len(rows), [[]] * len(rows), [[]] * len(rows)
        for chunk in _chunks([len(c) for c in contexts], budgets, model_limit):
            out = generate(
                policy,
                make_prompts([contexts[j] for j in chunk], pad).to(device),
                max_new_tokens=max(budgets[j] for j in chunk),
                temperature=temperature,
                eos_token_id=None,  # per row, in ``stopping``: an env may keep going past EOS
                pad_token_id=pad,
                logits_processor=logits_processor,
                generator=generator,
                stopping=_stopping([rows[j] for j in chunk], envs, [budgets[j] for j in chunk], eos, tokenizer),
                compile=compile,
                pack_weights=pack_weights,
                continuous_batching=continuous_batching,
            )
            for j, n, ids, lp in zip(
                chunk, out["action_mask"].sum(-1).tolist(), out["responses"].tolist(), out["logprobs"].tolist(),
                strict=True,
            ):
                lengths[j], sampled[j], sampled_lp[j] = n, ids, lp
        texts, turn_ids, ended = [], [], {}
        for j, i in enumerate(rows):
            ids, n = sampled[j][: lengths[j]], lengths[j]
            turn = num_turns[i]
            response[i] += ids
            actions[i] += [True] * n
            logprobs[i] += sampled_lp[j][:n]
            turn_of[i] += [turn] * n
            num_turns[i] += 1
            at_eos = envs[i].stop.stop_on_eos and eos is not None and n > 0 and ids[-1] == eos
            stopped = at_eos or _ends_with_stop(ids, envs[i].stop.stop_strings, tokenizer)
            # Cut at a budget the context imposed (below the env's own ``max_new_tokens``).
            ended[i] = (at_eos, not stopped and n >= budgets[j] and budgets[j] < envs[i].stop.max_new_tokens)
            truncated[i] = not stopped and n >= budgets[j]
            texts.append(tokenizer.decode(ids, skip_special_tokens=False))
            turn_ids.append(ids)
        results = _step_guarded(
            envs, rows, texts, turn_ids, max_workers=max_env_workers, timeout_s=env_timeout_s
        )
        for i in rows:
            result = results[i]
            if isinstance(result, tuple):
                reason[i] = result[0]
                continue
            last = len(response[i]) - 1
            if last >= 0:
                rewards_at[i][last] = rewards_at[i].get(last, 0.0) + float(result.reward)
            at_eos, cut = ended[i]
            if result.done:
                reason[i], truncated[i] = "done", False
            elif at_eos:
                reason[i] = "eos"
            elif cut:
                reason[i] = "context"
            elif num_turns[i] >= min(envs[i].stop.max_turns, max_turns or envs[i].stop.max_turns):
                reason[i] = "max_turns"
            else:
                obs = _tokenize(tokenizer, result.observation, f"envs[{i}].step(...).observation")
                fits = max(int(min(len(obs), room - len(prompt_ids[i]) - len(response[i]))), 0)
                response[i] += obs[:fits]
                actions[i] += [False] * fits
                logprobs[i] += [0.0] * fits
                turn_of[i] += [num_turns[i] - 1] * fits
                if fits < len(obs):
                    reason[i], truncated[i] = "context", True

    turn_rewards = [[0.0] * len(r) for r in response]
    for i in range(B):
        for pos, r in rewards_at[i].items():
            turn_rewards[i][pos] = r
    R = max(1, max(len(r) for r in response))
    as_rows = lambda xs, dtype: [torch.tensor(x, dtype=dtype) for x in xs]  # noqa: E731
    prompt_mask = pad_left([torch.ones(len(p), dtype=torch.bool) for p in prompt_ids], False)
    batch = build_batch(
        pad_left(as_rows(prompt_ids, torch.int64), pad),
        prompt_mask,
        pad_right(as_rows(response, torch.int64), pad, R),
        pad_right(as_rows(actions, torch.bool), False, R),
        response_mask=pad_right([torch.ones(len(r), dtype=torch.bool) for r in response], False, R),
        logprobs=pad_right(as_rows(logprobs, torch.float32), 0.0, R),
        rewards=torch.tensor([sum(r.values()) for r in rewards_at], dtype=torch.float32),
        turn_rewards=pad_right(as_rows(turn_rewards, torch.float32), 0.0, R),
        turn_index=pad_right(as_rows(turn_of, torch.int64), -1, R),
        num_turns=torch.tensor(num_turns, dtype=torch.int64),
        truncated=torch.tensor(truncated, dtype=torch.bool),
        group=group_ids(B // group_size, group_size),
        stop_reason=[str(r) for r in reason],
    ).to(device)
    return decode(batch, tokenizer)


def episode_turns(batch: TensorDict, row: int, tokenizer: Any = None) -> list[dict[str, Any]]:
    """The turns of episode ``row`` of a ``generate_episodes`` batch, in order, for reading and logging.

    Each turn is a dict: ``turn`` (0-based), ``action`` and ``observation`` (the turn's action tokens and the
    observation tokens after it, decoded with special tokens kept; ``""`` for no observation; the token ids
    as lists when ``tokenizer`` is None), ``action_tokens`` and ``observation_tokens`` (counts) and ``reward``
    (the turn's reward: the sum of ``turn_rewards`` over the turn). Tokens are grouped by ``turn_index``
    (-1: padding, skipped) and split by ``action_mask``.

    Raises:
        KeyError: the batch lacks ``turn_index`` (not an episode batch), ``responses``, ``action_mask`` or
            ``turn_rewards``.
        IndexError: ``row`` is out of range.
    """
    missing = [k for k in ("responses", "action_mask", "turn_index", "turn_rewards") if k not in batch.keys()]
    if missing:
        raise KeyError(f"episode_turns needs an episode batch (generate_episodes); it lacks {missing}")
    num_rows = batch.batch_size[0]
    if not -num_rows <= row < num_rows:
        raise IndexError(f"row {row} is out of range for a batch of {num_rows} rows")
    ids = batch["responses"][row].tolist()
    acts = batch["action_mask"][row].tolist()
    turn_of = batch["turn_index"][row].tolist()
    rewards = batch["turn_rewards"][row].tolist()
    parts: dict[int, dict[str, Any]] = {}
    for tok, is_action, turn, r in zip(ids, acts, turn_of, rewards, strict=True):
        if turn < 0:
            continue
        part = parts.setdefault(turn, {"action": [], "observation": [], "reward": 0.0})
        part["action" if is_action else "observation"].append(tok)
        part["reward"] += r
    text = (lambda t: tokenizer.decode(t, skip_special_tokens=False)) if tokenizer is not None else list
    return [
        {
            "turn": turn,
            "action": text(p["action"]),
            "observation": text(p["observation"]),
            "action_tokens": len(p["action"]),
            "observation_tokens": len(p["observation"]),
            "reward": p["reward"],
        }
        for turn, p in sorted(parts.items())
    ]


__all__ = ["STOP_REASONS", "episode_turns", "generate_episodes"]
