"""Sampling responses from a causal LM with a KV cache: ``generate``.

``generate`` is a chain of small functions, after gpt-fast's ``generate.py``: set-up (``_check_args``,
``_check_prompts``, ``rlbits.rollout.decoder.setup_decoder``: small-batch head, KV cache, compiled step) ->
``prefill`` (the left-padded prompts once, shared by the K samples of each) -> ``decode_n_tokens`` (per step
``rlbits.rollout.sampling.next_token``: logits processor, temperature, top-k, top-p, inverse-CDF sample on
the caller's generator, logprob; then ``decode_one_token`` from the cache) -> ``_to_batch``. Nothing in the
loop reads a value on the host except one "have all rows finished?" check per step on CPU (every
``_EOS_CHECK_EVERY`` steps on an accelerator, where a sync per step would stall the launch queue). A step
whose distribution holds NaN gets a NaN logprob, and ``generate`` raises ``FloatingPointError`` once after
the loop. With ``continuous_batching`` the finished rows leave the decode batch at those checks (the
rows still decoding, compacted with their KV cache rows, to a power of two for the compiled step; the same
noise per row). With
``max_num_seqs`` the decode batch is a fixed number of slots that the samples take in turn as samples finish
(``decode_with_slots``; one noise table per call, so other samples than without it).

On CPU the eager steps run every linear layer through oneDNN on weights reordered once per call
(``pack_weights``, ``rlbits.models.packed.packed_linears``): at 16 rows MKL's ``F.linear`` ran SmolLM2-135M's
shapes at 50-73 GFLOP/s and oneDNN on packed weights at 68-151 (2 AVX-512 cores, float32;
``benchmarks/RESULTS.md`` 1c). The KV cache and the small-batch head: ``rlbits.rollout.decoder``.

The ``logprobs`` returned are the log-probabilities of the sampled tokens under
``softmax(raw_logits / temperature)``: the untruncated policy distribution, which is what a
teacher-forced training forward at the same temperature computes (``rlbits.models.forward.policy_logprobs``).
``top_k``, ``top_p``, ``repetition_penalty``, the ``min_new_tokens`` ban and ``logits_processor`` change which
tokens are *sampled* but not these logprobs, so with them the samples come from a different distribution than
the logprobs describe (as in TRL, OpenRLHF and verl, and as the seeds' trainers, which recompute the old
logprobs with an unfiltered forward; docs/generation.md). Greedy decoding (``temperature=0``) reports
logprobs at temperature 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rlbits.batch import build_batch, group_ids
from rlbits.functional import entropy_from_logits
from rlbits.models.forward import context_length
from rlbits.models.packed import packed_linears
from rlbits.rollout.decoder import (
    Decoder,
    cache_kv,
    decode_one_token,
    prefill,
    select_rows,
    set_write_column,
    setup_decoder,
    shift_columns,
    write_kv,
)
from rlbits.rollout.sampling import LogitsProcessor, next_token
from rlbits.text import decode, tokenize_prompts

# Steps between host-side "all rows finished?" checks. On an accelerator each check stalls the launch
# queue, so it runs every few steps (the extra steps it may decode are trimmed from the output); on CPU
# the check is free.
_EOS_CHECK_EVERY = 8
_EOS_CHECK_EVERY_CPU = 1
# Fewest rows ``continuous_batching`` compacts the compiled step's batch to: each row count is one more
# compiled graph (and CUDA graph), so the counts are the powers of two from here up.
_COMPILED_MIN_ROWS = 8
# ``max_num_seqs``: the slot decoder's KV cache holds this many live spans (P + max_new_tokens columns) of
# columns; when the shared write column reaches its end the last span moves to the front (``decode_with_slots``),
# one copy every (spans - 1) * (P + max_new_tokens) steps.
_SLOT_CACHE_SPANS = 2.0
# Fewest new tokens for which ``pack_weights=None`` packs the weights (see ``generate``).
_PACK_MIN_NEW_TOKENS = 4

# ``stopping(responses [B, t]) -> [B] bool``: rows that end after their latest token (see ``generate``).
StoppingFn = Callable[[torch.Tensor], torch.Tensor]


def _check_args(
    prompts_td,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    num_samples,
    eos_token_id,
    pad_token_id,
    repetition_penalty=1.0,
    min_new_tokens=0,
):
    for key in ("prompts", "prompt_mask"):
        if key not in prompts_td.keys():
            raise ValueError(f"prompts_td must have keys 'prompts' and 'prompt_mask'; {key!r} is missing")
    prompts, mask = prompts_td["prompts"], prompts_td["prompt_mask"]
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be [B, P] (2-D) but has shape {tuple(prompts.shape)}")
    if mask.shape != prompts.shape:
        raise ValueError(
            f"prompt_mask has shape {tuple(mask.shape)} but prompts has shape {tuple(prompts.shape)}; they must match"
        )
    if prompts.is_floating_point() or prompts.dtype == torch.bool:
        raise ValueError(f"prompts must be integer token ids, got dtype {prompts.dtype}")
    if prompts.shape[0] == 0:
        raise ValueError("prompts is empty (B = 0); pass at least one prompt")
    if prompts.shape[1] == 0:
        raise ValueError("prompts has no columns (P = 0); every prompt needs at least one token")
    for name, v, lo in (("max_new_tokens", max_new_tokens, 1), ("num_samples", num_samples, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p}")
    if not repetition_penalty > 0 or repetition_penalty == float("inf"):
        raise ValueError(f"repetition_penalty must be a finite float > 0 (1 = off), got {repetition_penalty}")
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
    for name, v in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{name} must be an int token id or None, got {v!r}")
    if pad_token_id is None:
        raise ValueError("pad_token_id must be an int token id (it fills responses after EOS)")


def _check_prompts(
    policy, prompts: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int, pad_token_id: int
):
    """Raise ValueError if ``P + max_new_tokens`` exceeds the model's context, a row has no real token, or the
    pad id or a real prompt token is outside the vocabulary."""
    P = prompts.shape[1]
    limit = context_length(policy)
    if limit is not None and P + max_new_tokens > limit[1]:
        raise ValueError(
            f"prompt length P = {P} plus max_new_tokens = {max_new_tokens} = {P + max_new_tokens} exceeds the "
            f"model's context ({limit[0]} = {limit[1]}); lower max_new_tokens or truncate the prompts"
        )
    empty = (~prompt_mask.any(dim=1)).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"prompt row(s) {empty.tolist()[:10]} have no real token (prompt_mask all False)")
    vocab = getattr(getattr(policy, "config", None), "vocab_size", None)
    if vocab is not None:
        if not 0 <= pad_token_id < vocab:
            raise ValueError(f"pad_token_id = {pad_token_id} is outside the model's vocabulary [0, {vocab})")
        outside = prompt_mask & ((prompts < 0) | (prompts >= vocab))
        if outside.any():
            i, j = outside.nonzero()[0].tolist()
            raise ValueError(
                f"prompts[{i}, {j}] = {int(prompts[i, j])} is outside the model's vocabulary [0, {vocab})"
            )


def _check_finite(logprobs: torch.Tensor, temperature: float) -> None:
    """Raise if a sampled token's logprob is NaN (``next_token`` marks a distribution that held NaN so):
    one reduction and one sync per ``generate`` call, none per token.

    Raises:
        FloatingPointError: naming the first row and step and the likely causes.
    """
    bad = logprobs.isnan()
    if not bool(bad.any()):
        return
    row, step = bad.nonzero()[0].tolist()
    rows = int(bad.any(dim=1).sum())
    raise FloatingPointError(
        f"sampling produced non-finite probabilities in {rows} of {logprobs.shape[0]} rows (first: row {row}, "
        f"new token {step}) at temperature {temperature:g}: the logits divided by the temperature hold NaN or "
        "inf (a temperature too small for float32, or NaN/inf logits from the model or the logits processor)"
    )


@dataclasses.dataclass
class _Samples:
    """What decoding writes, in place: ``input_ids`` [B, P + N] (the prompt rows, then one column per step),
    ``attention_mask`` [B, cache_len] bool (the prompt mask, then True where a step's token is real),
    ``logprobs`` [B, N] float32 and ``entropy`` [B, N] float32 or None (0 after a row's end), ``finished``
    [B] bool; ``position`` [B, 1] is each row's position of its first response token."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    finished: torch.Tensor
    position: torch.Tensor
    prompt_len: int


def _new_samples(
    prompt_rows, mask_rows, max_new_tokens: int, cache_len: int, pad_token_id: int, entropy: bool
):
    """Empty ``_Samples`` for the [B, P] prompt rows; the mask spans the whole static cache (future columns
    0), or the columns the dynamic one grows to."""
    (B, P), device = prompt_rows.shape, prompt_rows.device
    input_ids = torch.full((B, P + max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    input_ids[:, :P] = prompt_rows
    attention_mask = torch.zeros((B, cache_len), dtype=torch.bool, device=device)
    attention_mask[:, :P] = mask_rows
    logprobs = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
    return _Samples(
        input_ids=input_ids,
        attention_mask=attention_mask,
        logprobs=logprobs,
        entropy=torch.zeros_like(logprobs) if entropy else None,
        finished=torch.zeros(B, dtype=torch.bool, device=device),
        position=mask_rows.long().sum(dim=1, keepdim=True),
        prompt_len=P,
    )


def _map_rows(part: _Samples, fn: Callable[[torch.Tensor], torch.Tensor]) -> _Samples:
    """A new ``_Samples`` with ``fn`` applied to each per-row tensor of ``part`` (None stays None)."""
    take = lambda x: None if x is None else fn(x)  # noqa: E731
    return dataclasses.replace(
        part,
        input_ids=take(part.input_ids),
        attention_mask=take(part.attention_mask),
        logprobs=take(part.logprobs),
        entropy=take(part.entropy),
        finished=take(part.finished),
        position=take(part.position),
    )


def _take(part: _Samples, keep: torch.Tensor) -> _Samples:
    """The rows ``keep`` [A] int64 of ``part``, as a new ``_Samples``."""
    return _map_rows(part, lambda x: x.index_select(0, keep))


def _put(out: _Samples, part: _Samples, rows: torch.Tensor) -> None:
    """Write ``part`` (the rows ``rows`` [A] int64 of ``out``) back into ``out``, in place."""
    out.input_ids.index_copy_(0, rows, part.input_ids)
    out.attention_mask.index_copy_(0, rows, part.attention_mask)
    out.logprobs.index_copy_(0, rows, part.logprobs)
    if out.entropy is not None:
        out.entropy.index_copy_(0, rows, part.entropy)
    out.finished = out.finished.index_copy(0, rows, part.finished)


def _compacted_size(alive: int, rows: int, minimum: int, exact: bool = False) -> int:
    """Rows the decode batch keeps when ``alive`` of its ``rows`` rows still decode.

    For the compiled step: the smallest power of two >= ``alive``, at least ``minimum``, at most ``rows`` (few
    distinct shapes, one graph each). With ``exact`` (the eager step, which any shape suits): ``alive`` itself
    once at least a sixteenth of the rows (and at least one) have finished, else ``rows``: a compaction copies
    the live rows' KV cache, so it waits until it saves enough work. On the uneven workload of 256 rows and a
    256-token budget (``benchmarks/uneven_generate.py``, 10,260 generated tokens) the decode steps then run
    10,579 rows in 21 compactions, powers of two 13,344 in 3 (counted from the lengths)."""
    if exact:
        return alive if rows - alive >= max(1, rows // 16) else rows
    return min(rows, max(minimum, 1 << max(alive - 1, 0).bit_length()))


def decode_n_tokens(
    decoder: Decoder,
    logits: torch.Tensor,
    out: _Samples,
    max_new_tokens: int,
    *,
    stop: torch.Tensor,
    stopping: StoppingFn | None,
    pad_token_id: int,
    min_new_tokens: int = 0,
    compact: bool = False,
    swap: Callable[[int, _Samples], tuple[Decoder, torch.Tensor] | None] | None = None,
    **sampling: Any,
) -> int:
    """Sample up to ``max_new_tokens`` tokens per row from the prefill's ``logits`` on, writing ``out``.

    Each step: ``next_token(logits, ids so far, **sampling)`` (``sampling``: ``temperature``, ``top_k``,
    ``top_p``, ``logits_processor``, ``generator``, ``repetition_penalty``), then the next logits from
    ``decode_one_token``. A row finishes on a ``stop`` id [S] int64 or where ``stopping`` says so; finished
    rows keep decoding, their new tokens masked out and set to ``pad_token_id``. For the first
    ``min_new_tokens`` steps the ``stop`` ids cannot be sampled and ``stopping`` is not asked. The loop ends
    after ``max_new_tokens`` steps, or once every row has finished (checked on the host every
    ``_EOS_CHECK_EVERY`` steps on an accelerator, every step on CPU). Returns the number of steps taken.

    With ``compact``, at each of those checks the rows still decoding are kept and the finished ones dropped
    from the decode batch (its KV cache rows included: ``rlbits.rollout.decoder.select_rows``): for the eager
    step once a sixteenth of its rows have finished, for the compiled step once they fit the next power of
    two, at least ``_COMPILED_MIN_ROWS`` (finished rows fill the rest; ``_compacted_size``). The noise stays
    the same: every step draws ``torch.rand(B, 1)`` for the whole batch, as without ``compact``, and the rows
    still in the batch sample with their own draws. ``stopping`` sees the whole batch as without ``compact``; ``logits_processor`` sees the rows in the
    decode batch only.

    ``swap(t, part)``, before each step t >= 1 (``part``: the decode batch): None to go on, or a new
    ``(decoder, logits)`` to continue from (``generate``'s ``on_step``: new weights, their cache and logits).
    """
    P, temperature = out.prompt_len, sampling["temperature"]
    device, B = logits.device, logits.shape[0]
    check_every = _EOS_CHECK_EVERY_CPU if device.type == "cpu" else _EOS_CHECK_EVERY
    min_rows = _COMPILED_MIN_ROWS if decoder.compiled is not None else 1
    # The decode batch: ``part``, the rows ``rows`` of ``out`` (None: all of them, ``part`` is ``out``).
    part, rows = out, None
    steps = 0
    for t in range(max_new_tokens):
        if swap is not None and t > 0 and (swapped := swap(t, part)) is not None:
            decoder, logits = swapped
        banned = stop if t < min_new_tokens and stop.numel() else None
        uniforms = None
        if rows is not None and temperature > 0:
            uniforms = torch.rand(B, 1, generator=sampling["generator"], device=device).index_select(0, rows)
        tokens, lp = next_token(
            logits,
            part.input_ids[:, : P + t],
            input_mask=part.attention_mask[:, : P + t],
            banned=banned,
            uniforms=uniforms,
            **sampling,
        )
        alive = ~part.finished
        part.input_ids[:, P + t] = torch.where(alive, tokens, pad_token_id)
        part.attention_mask[:, P + t] = alive
        part.logprobs[:, t] = torch.where(alive, lp, 0.0)
        if part.entropy is not None:
            ent = entropy_from_logits(logits, temperature if temperature > 0 else 1.0)
            part.entropy[:, t] = torch.where(alive, ent, 0.0)
        if stop.numel():
            part.finished = part.finished | torch.isin(tokens, stop)
        if stopping is not None and t + 1 >= min_new_tokens:
            if rows is None:
                stopped = stopping(part.input_ids[:, P : P + t + 1]).to(device)
            else:  # the rule sees every row, as without compaction
                out.input_ids[rows, P + t] = part.input_ids[:, P + t]
                stopped = stopping(out.input_ids[:, P : P + t + 1]).to(device).index_select(0, rows)
            part.finished = part.finished | (alive & stopped)
        steps = t + 1
        if t + 1 == max_new_tokens:
            break
        if (stop.numel() or stopping is not None) and steps % check_every == 0:
            if not compact:
                if bool(part.finished.all()):
                    break
            else:
                n, size = int((~part.finished).sum()), part.finished.shape[0]
                if n == 0:
                    break
                new_size = _compacted_size(n, size, min_rows, exact=decoder.compiled is None)
                if new_size < size:  # the rows still decoding, then finished ones up to new_size, in order
                    keep = torch.argsort(part.finished.to(torch.uint8), stable=True)[:new_size].sort().values
                    if rows is not None:
                        _put(out, part, rows)
                    rows = keep if rows is None else rows.index_select(0, keep)
                    part = _take(part, keep)
                    select_rows(decoder, keep, P + t)  # the columns written so far
        new_ids = part.input_ids[:, P + t : P + t + 1]
        logits = decode_one_token(decoder, new_ids, part.attention_mask, part.position + t, P + t + 1)
    if rows is not None:
        _put(out, part, rows)
    return steps


def _by_length(slots: list[int], lengths: list[int]) -> dict[int, list[int]]:
    """``slots`` grouped by their response length so far, ``{t: [slot, ...]}``, slots ascending in each."""
    groups: dict[int, list[int]] = {}
    for s in slots:
        groups.setdefault(lengths[s], []).append(s)
    return groups


def _process_slots(
    logits_processor: LogitsProcessor | None,
    groups: dict[int, list[int]],
    input_ids: torch.Tensor,
    sid: torch.Tensor,
    prompt_len: int,
    ban: torch.Tensor | None,
    _ids: torch.Tensor,
    logits: torch.Tensor,
    *,
    device: torch.device,
) -> torch.Tensor:
    """The slots' logits processor for ``next_token``: the caller's ``logits_processor`` once per response length
    t in ``groups`` (``{t: [slot, ...]}``), on those slots' ids ``input_ids[sid[slots], :P + t]`` and logits
    (what ``generate`` without slots passes for those rows); then the stop ids ``ban`` [S, V] bool set to -inf
    (before ``min_new_tokens``; before the repetition penalty, which leaves -inf as it is, so the order of
    ``generate`` holds). ``logits`` [S, V] is ``next_token``'s copy: edited in place."""
    if logits_processor is not None:
        for t, group in groups.items():
            g = torch.tensor(group, device=device)
            rows = sid.index_select(0, g)
            part = logits.index_select(0, g)
            done = logits_processor(input_ids[rows, : prompt_len + t], part)
            if not isinstance(done, torch.Tensor) or done.shape != part.shape:
                got = tuple(done.shape) if isinstance(done, torch.Tensor) else type(done).__name__
                raise ValueError(
                    f"logits_processor must return logits of shape {tuple(part.shape)} [B, V], got {got}"
                )
            logits.index_copy_(0, g, done.to(logits.dtype))
    return logits if ban is None else logits.masked_fill(ban, float("-inf"))


def decode_with_slots(
    policy: torch.nn.Module,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    *,
    num_samples: int,
    max_num_seqs: int,
    compile: bool,
    stop: torch.Tensor,
    stopping: StoppingFn | None,
    pad_token_id: int,
    min_new_tokens: int = 0,
    return_entropy: bool = False,
    **sampling: Any,
) -> _Samples:
    """Sample ``num_samples`` responses per prompt, at most ``max_num_seqs`` rows decoding at once (``generate``'s
    ``max_num_seqs``): the decode batch has S = min(max_num_seqs, B) slots; the B samples (sample i of prompt
    i // K) wait in order, and whenever the host sees a slot's sample finished (a stop id, ``stopping``, or
    ``max_new_tokens`` tokens) the next waiting sample takes the slot. Returns ``_Samples`` of the B samples
    (``input_ids`` [B, P + N]).

    The KV cache (``setup_decoder``, ``S`` rows, ``_SLOT_CACHE_SPANS * (P + N)`` columns) has one write
    column shared by all slots; positions come from ``position_ids`` and each row attends only where its
    [S, cache_len] mask is True. A sample taking a slot gets its prompt's prefilled KV copied to the columns
    ``[c - P, c)`` before the write column c (``write_kv``), its mask set there (on the prompt's real tokens)
    and cleared everywhere else, and samples its first token from the prompt's logits. When c reaches the
    cache's end, the last ``P + N`` columns (every live sample's span) move to the front (``shift_columns``).
    The prompts are prefilled S at a time, when their first sample enters (``prefill``; the K samples of a
    prompt share it).

    Noise: one table ``u = torch.rand(B, N, generator=generator)`` drawn up front (none at temperature 0);
    sample i's t-th token samples with ``u[i, t]``. So the tokens depend neither on S nor on when a sample
    entered its slot (float rounding of the batched matmuls aside). One ``next_token`` call samples every
    slot; ``logits_processor`` and ``stopping`` are called once per distinct response length t among the
    occupied slots, on those slots' rows only: ids [A, P + t] and responses [A, t + 1], as ``generate``
    without slots would pass them for those samples (``_process_slots``).
    """
    (n, P), device = prompts.shape, prompts.device
    N, K = max_new_tokens, num_samples
    B = n * K
    S = min(max_num_seqs, B)
    temperature = sampling["temperature"]
    logits_processor = sampling.pop("logits_processor")
    generator = sampling.pop("generator")
    noise = torch.rand(B, N, generator=generator, device=device) if temperature > 0 else None
    trash = B  # the extra row of ``out`` that empty slots write to
    rows_of = torch.arange(B + 1, device=device).clamp(max=B - 1) // K
    out = _new_samples(
        prompts.index_select(0, rows_of),
        prompt_mask.index_select(0, rows_of),
        N,
        P + N,
        pad_token_id,
        return_entropy,
    )
    decoder = setup_decoder(
        policy, S, int(_SLOT_CACHE_SPANS * (P + N)), device, compile, within_context=False
    )
    if not decoder.static:
        raise ValueError(
            f"generate(max_num_seqs=...) needs a static KV cache, which {type(policy).__name__} does not support "
            "here (transformers' StaticCache; not under autocast); use continuous_batching=True instead"
        )
    span, width = P + N, decoder.cache_len  # a live sample's columns at most; the cache's columns
    chunk: dict[str, Any] = {"index": -1}

    def load(j: int) -> None:  # prefill prompts [j*S, (j+1)*S)
        part = slice(j * S, (j + 1) * S)
        pre = setup_decoder(policy, prompts[part].shape[0], P, device, False)
        chunk.update(index=j, logits=prefill(pre, prompts[part], prompt_mask[part], 1), kv=cache_kv(pre))

    sid = torch.full((S,), trash, dtype=torch.long, device=device)  # each slot's sample (trash: empty)
    tpos = torch.zeros(S, dtype=torch.long, device=device)  # each slot's response length so far
    fin = torch.ones(S, dtype=torch.bool, device=device)  # finished or empty
    cache_mask = torch.zeros((S, width), dtype=torch.bool, device=device)
    host_sid: list[int | None] = [None] * S
    host_t = [0] * S
    state = {"column": P, "logits": None, "entered": 0}

    def enter(free: list[int]) -> None:  # the next waiting samples take the slots ``free``
        column = state["column"]
        pairs = list(zip(free, range(state["entered"], B), strict=False))
        state["entered"] += len(pairs)
        while pairs:
            j = pairs[0][1] // K // S
            group = [(s, i) for s, i in pairs if i // K // S == j]
            pairs = pairs[len(group) :]
            if chunk["index"] != j:
                load(j)
            slots = torch.tensor([s for s, _ in group], device=device)
            samples = torch.tensor([i for _, i in group], device=device)
            src = samples // K - j * S
            write_kv(decoder, slots, chunk["kv"], src, column, S)
            cache_mask[slots] = False
            cache_mask[slots, column - P : column] = prompt_mask.index_select(0, samples // K)
            logits = state["logits"]
            if logits is None:
                logits = chunk["logits"].new_zeros((S, chunk["logits"].shape[1]))
            state["logits"] = logits.index_copy(0, slots, chunk["logits"].index_select(0, src))
            sid[slots], tpos[slots], fin[slots] = samples, 0, False
            for s, i in group:
                host_sid[s], host_t[s] = i, 0

    check_every = _EOS_CHECK_EVERY_CPU if device.type == "cpu" else _EOS_CHECK_EVERY
    checks = stop.numel() > 0 or stopping is not None
    enter(list(range(S)))
    set_write_column(decoder, P)
    banned_ids = None  # [1, V] the stop ids, banned per row before ``min_new_tokens``
    if stop.numel() and min_new_tokens:
        banned_ids = torch.zeros(1, state["logits"].shape[1], dtype=torch.bool, device=device)
        banned_ids[0, stop] = True
    steps = 0
    while True:
        occupied = [s for s in range(S) if host_sid[s] is not None]
        if not occupied:
            break
        logits, alive = state["logits"], ~fin
        t_idx = tpos.clamp(max=N - 1)
        groups = _by_length(occupied, host_t)
        ban = None
        if banned_ids is not None and any(host_t[s] < min_new_tokens for s in occupied):
            ban = (tpos < min_new_tokens)[:, None] & banned_ids
        process = None
        if logits_processor is not None or ban is not None:
            process = functools.partial(
                _process_slots, logits_processor, groups, out.input_ids, sid, P, ban, device=device
            )
        penalised = sampling["repetition_penalty"] != 1
        tokens, lp = next_token(
            logits,
            out.input_ids.index_select(0, sid) if penalised else sid[:, None],
            input_mask=out.attention_mask.index_select(0, sid) if penalised else None,
            logits_processor=process,
            generator=None,
            uniforms=None if noise is None else noise[sid.clamp(max=B - 1), t_idx][:, None],
            **sampling,
        )
        columns = P + t_idx
        out.input_ids[sid, columns] = torch.where(alive, tokens, pad_token_id)
        out.attention_mask[sid, columns] = alive
        out.logprobs[sid, t_idx] = torch.where(alive, lp, 0.0)
        if out.entropy is not None:
            ent = entropy_from_logits(logits, temperature if temperature > 0 else 1.0)
            out.entropy[sid, t_idx] = torch.where(alive, ent, 0.0)
        ended = torch.isin(tokens, stop) if stop.numel() else torch.zeros_like(fin)
        if stopping is not None:
            for t, group in groups.items():
                if t + 1 >= min_new_tokens:
                    g = torch.tensor(group, device=device)
                    said = stopping(out.input_ids[sid.index_select(0, g), P : P + t + 1]).to(device)
                    ended = ended.index_copy(0, g, ended.index_select(0, g) | said)
        fin |= alive & ended
        out.finished[sid] = fin
        tpos += 1
        for s in occupied:
            host_t[s] += 1
        steps += 1
        finished = fin.tolist() if checks and steps % check_every == 0 else None
        done = [s for s in occupied if host_t[s] == N or (finished is not None and finished[s])]
        if len(done) == len(occupied) and state["entered"] == B:
            break
        if len(done) < len(occupied):  # else every slot takes a new sample: no step needed
            column = state["column"]
            if column == width:  # every live span to the front of the cache
                shift_columns(decoder, column - span, span)
                cache_mask[:, :span] = cache_mask[:, column - span : column].clone()
                cache_mask[:, span:] = False
                column = span
            cache_mask[:, column] = True  # a slot's own new token (empty slots attend to something)
            position = (out.position.index_select(0, sid) + tpos[:, None] - 1).clamp(max=P + N - 1)
            state["logits"] = decode_one_token(decoder, tokens[:, None], cache_mask, position, column + 1)
            state["column"] = column + 1
        if done:
            gone = torch.tensor(done, device=device)
            sid[gone], fin[gone] = trash, True
            for s in done:
                host_sid[s] = None
            enter(done)
    return _map_rows(out, lambda x: x[:B])


def _to_batch(
    out: _Samples,
    prompt_rows,
    mask_rows,
    steps: int,
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
) -> TensorDict:
    """The batch ``generate`` returns: responses trimmed to the longest one. Raises FloatingPointError
    (``_check_finite``) if a step's distribution held NaN."""
    P = out.prompt_len
    action_mask = out.attention_mask[:, P : P + steps]
    _check_finite(out.logprobs[:, :steps], temperature)
    R = int(action_mask.sum(dim=1).max())  # the other sync: trim to the longest response
    action_mask = action_mask[:, :R].contiguous()
    B, finished = action_mask.shape[0], out.finished
    columns = {
        "logprobs": out.logprobs[:, :R].contiguous(),
        "group": group_ids(B // num_samples, num_samples, device=action_mask.device),
        "truncated": action_mask[:, -1] & ~finished if R == max_new_tokens else torch.zeros_like(finished),
    }
    if out.entropy is not None:
        columns["entropy"] = out.entropy[:, :R].contiguous()
    return build_batch(
        prompt_rows, mask_rows, out.input_ids[:, P : P + R].contiguous(), action_mask, **columns
    )


@torch.no_grad()
def generate(
    policy: torch.nn.Module,
    prompts_td: TensorDict,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None,
    pad_token_id: int,
    num_samples: int = 1,
    logits_processor: LogitsProcessor | None = None,
    generator: torch.Generator | None = None,
    stop_token_ids: list[int] | tuple[int, ...] | None = None,
    stopping: StoppingFn | None = None,
    return_entropy: bool = False,
    compile: bool = False,
    pack_weights: bool | None = None,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    continuous_batching: bool = False,
    max_num_seqs: int | None = None,
    on_step: Callable[[int], int] | None = None,
) -> TensorDict:
    """Sample ``num_samples`` responses per prompt with a KV cache.

    Prefills the left-padded prompts with position ids ``cumsum(mask) - 1`` (clamped at 0), then decodes
    one token per step from the cache, growing the attention mask. Each step: raw logits ->
    ``logits_processor`` -> repetition penalty -> stop ids banned before ``min_new_tokens`` ->
    ``/ temperature`` -> top-k -> top-p -> sample (the order of HF's processors and warpers).
    Decoding stops after ``max_new_tokens`` or once every row has emitted a stop token; the response
    columns are trimmed to the longest response. Runs under ``torch.no_grad()`` with the policy switched to
    eval mode (restored after), so dropout never perturbs sampling.

    Args:
        policy: an HF causal LM (``.logits``; accepts ``input_ids, attention_mask, position_ids,
            past_key_values, use_cache``).
        prompts_td: TensorDict with ``prompts`` [B, P] int64 left-padded and ``prompt_mask`` [B, P] bool.
            Every row needs at least one real token.
        max_new_tokens: most tokens per response; ``P + max_new_tokens`` must fit the model's
            ``max_position_embeddings``.
        temperature: > 0 samples from ``softmax(logits / temperature)``; 0 is greedy (argmax of the
            processed logits; ``top_k``/``top_p`` have no effect, logprobs are reported at temperature 1).
        top_k: sample among the k most likely tokens only (ties at the k-th are kept).
        top_p: nucleus sampling as HF's ``TopPLogitsWarper``: the smallest set of most likely tokens with
            cumulative probability >= top_p, always at least one.
        eos_token_id: ends a response (kept as its last action token); None never stops early.
        pad_token_id: fills responses after their end.
        num_samples: K responses per prompt; rows ``i*K .. i*K+K-1`` belong to prompt i (``group`` = i).
        logits_processor: ``f(input_ids [B, P + t], logits [B, V]) -> logits`` applied to the raw logits
            before temperature/top-k/top-p (e.g. ILQL steering). It changes sampling only, not ``logprobs``.
            It must leave at least one finite logit per row.
        generator: source of the sampling noise; the same generator state gives the same samples (one
            ``torch.rand(B, 1)`` draw per step, on the policy's device; with ``max_num_seqs`` one
            ``torch.rand(B, max_new_tokens)`` table before decoding).
        stop_token_ids: more ids that end a response like ``eos_token_id``.
        stopping: optional per-row stop rule, ``f(responses [B, t] int64) -> [B] bool``, called after each
            step with the response tokens so far (finished rows hold ``pad_token_id`` after their end); True
            ends that row after its latest token, which is kept as its last action (like a stop token). For
            stop strings and per-row token budgets (``rlbits.rollout.multiturn``). It reads the tokens on
            the host, so it costs one device sync per step; None (the default) adds nothing.
        return_entropy: also return ``entropy`` [B, R]: entropy of ``softmax(raw_logits / T)`` per step.
        compile: run each decode step through ``torch.compile`` (``decoder.compiled_decode_step``; gpt-fast's
            approach: static shapes, static KV cache; on CUDA replayed as a CUDA graph). Only where the
            static cache and the split head apply (GPT-2/Llama/Mistral/Qwen2/Qwen3 families, no autocast);
            else ignored. The first call per batch size and cache length compiles (tens of seconds); the
            samples equal the eager ones up to float rounding of the logits. The compiled step's KV cache
            stays allocated between calls (one per policy, freed with it), so the CUDA graphs recorded
            on its addresses replay in later rollouts instead of being recorded again.
        pack_weights: run the eager decode's linear layers through oneDNN on weights reordered once per
            call (``rlbits.models.packed.packed_linears``): on CPU several times faster matmuls at decode
            batch sizes, the same logits to float rounding, one extra copy of the weights in memory during
            the call. None (default): on for a CPU policy without ``compile`` or autocast, for at least 4
            new tokens; False: never; True: wherever it applies (CPU, float32 or bfloat16 weights, no
            ``compile``).
        repetition_penalty: HF's ``RepetitionPenaltyLogitsProcessor`` over the real tokens so far (prompt
            and response; padding is not penalised): a present id's logit divided by it if positive,
            multiplied if negative (``rlbits.rollout.sampling.repetition_penalty_filter``). 1: off.
        min_new_tokens: for the first this-many tokens of each response ``eos_token_id`` and
            ``stop_token_ids`` get -inf (HF's ``MinNewTokensLengthLogitsProcessor``) and ``stopping`` is not
            called (vLLM's ``min_tokens`` holds stop strings back too). 0: off.
        continuous_batching: finished rows leave the decode step's work: at each "all rows finished?" check
            (every step on CPU, every ``_EOS_CHECK_EVERY`` on an accelerator) the rows still decoding are
            kept, with their KV cache rows, once a sixteenth of the batch's rows have finished; with
            ``compile`` once they fit the next power of two below the batch's rows, at least 8 rows (so the
            compiled step sees few shapes), finished rows filling the rest.
            The samples are those without it: every step still draws ``torch.rand(B, 1)`` for all B rows and
            a row samples with its own draw, so the same generator state gives the same tokens, and the
            same logprobs, up to float rounding of the logits at another batch size (tested equal to 1e-5).
            ``stopping`` still gets all B rows; ``logits_processor`` gets the ``[A, P + t]`` ids and
            ``[A, V]`` logits of the A rows in the decode batch, so it must treat each row on its own. False:
            every row decodes until the last one ends.
        max_num_seqs: decode with this many slots (vLLM's and verl's name: the most rows decoded at once;
            ``decode_with_slots``): the B = prompts * K samples wait in order and each takes a slot as one
            finishes (seen at the "all rows finished?" checks), so a few long responses no longer hold the
            whole batch: the rollout costs about its generated tokens / S steps. The noise is laid out per
            sample, not per step: one table ``torch.rand(B, max_new_tokens)`` drawn up front (none when
            greedy), the t-th token of sample i sampled with entry [i, t]; so the samples differ from those
            of ``max_num_seqs=None`` for the same generator state, and are the same for every S (float
            rounding of the logits at another batch size aside). ``logits_processor`` and ``stopping`` are
            called once per distinct response length among the slots, on those slots' rows (ids
            [A, P + t], responses [A, t]: what they get for those rows without slots), so both must treat each
            row on its own. Needs a static KV cache (GPT-2/Llama/Mistral/Qwen2/Qwen3 families, no autocast);
            ``continuous_batching`` has no effect with it. None (default): every row has its own place in
            one batch of B rows.
        on_step: partial rollouts (``async_mode: ranks`` with ``partial_rollouts``, docs/async.md):
            ``on_step(t) -> version``, called before the prefill (t = 0) and before each later token t, returns
            the version of ``policy``'s weights for token t; the callback may first load new weights into
            ``policy`` in place. When the version changes, the weights are re-read (re-packed with
            ``pack_weights``) and the KV cache is recomputed with them over the prompt and the t tokens so far
            (one prefill of P + t positions), so token t on is sampled from, and its ``logprobs`` are, exactly
            the new policy's (a teacher-forced forward of the new weights; tested to 1e-5). Adds
            ``token_version``. None: nothing is called.

    Returns:
        TensorDict with batch size [B * K]:
        ``prompts`` [B*K, P], ``prompt_mask`` [B*K, P], ``responses`` [B*K, R] int64 right-padded with
        ``pad_token_id``, ``action_mask`` [B*K, R] bool (True up to and including the stop token),
        ``response_mask`` (= ``action_mask``: every generated token is an action),
        ``input_ids`` = cat(prompts, responses), ``attention_mask`` = cat(prompt_mask, response_mask),
        ``logprobs`` [B*K, R] float32 (0 where ``action_mask`` is False), ``group`` [B*K] int64,
        ``truncated`` [B*K] bool (True when the response hit ``max_new_tokens`` without a stop token; for
        overlong filtering), ``entropy`` with ``return_entropy``, and with ``on_step`` ``token_version``
        [B*K, R] int64: the version ``on_step`` returned for each column (the same in every row,
        nondecreasing). R <= ``max_new_tokens``.

    Raises:
        ValueError: missing keys, mismatched shapes, an empty batch, a row without prompt tokens, a prompt
            or pad id outside the vocabulary, bad sampling arguments, a ``continuous_batching`` not a bool,
            ``max_num_seqs`` not None nor an int >= 1, ``max_num_seqs`` with a model without a static cache or
            one holding a cache of its own (``select_cache_rows``: ``SteeredPolicy``) or with ``on_step``, or
            ``P + max_new_tokens`` beyond the model's context; ``on_step`` returning something other than an int.
        FloatingPointError: a step's distribution held NaN (NaN/inf logits, or a temperature so small that
            ``logits / temperature`` overflows): checked once after decoding, the message names the row.
    """
    _check_args(
        prompts_td,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        num_samples,
        eos_token_id,
        pad_token_id,
        repetition_penalty,
        min_new_tokens,
    )
    if not isinstance(continuous_batching, bool):
        raise ValueError(f"continuous_batching must be a bool, got {continuous_batching!r}")
    if max_num_seqs is not None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be None or an int >= 1, got {max_num_seqs!r}")
        if getattr(policy, "select_cache_rows", None) is not None:
            raise ValueError(
                f"generate(max_num_seqs=...) does not support {type(policy).__name__}: it keeps a KV cache of its "
                "own (select_cache_rows) that slots cannot refill; use continuous_batching=True instead"
            )
        if on_step is not None:
            raise ValueError(
                "generate(max_num_seqs=...) does not take on_step (partial rollouts): a weight swap recomputes the "
                "whole batch's cache, which slots at different steps do not share; use max_num_seqs=None"
            )
    prompts = prompts_td["prompts"].long()
    prompt_mask = prompts_td["prompt_mask"].bool()
    _check_prompts(policy, prompts, prompt_mask, max_new_tokens, pad_token_id)
    stop_ids = [eos_token_id] if eos_token_id is not None else []
    stop_ids += list(stop_token_ids or [])
    device, K = prompts.device, num_samples
    B = prompts.shape[0] * K
    # Rows i*K .. i*K+K-1 sample prompt i; the prompts are prefilled once and the cache rows repeated.
    prompt_rows = prompts.repeat_interleave(K, dim=0) if K > 1 else prompts
    mask_rows = prompt_mask.repeat_interleave(K, dim=0) if K > 1 else prompt_mask
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    if pack_weights is None:
        # Packing costs about two decode steps' matmuls (SmolLM2-135M, 16 rows: 0.09-0.19 s against 45 ms
        # saved per step), so a call of a few tokens runs unpacked.
        pack_weights = (
            device.type == "cpu"
            and not torch.is_autocast_enabled("cpu")
            and max_new_tokens >= _PACK_MIN_NEW_TOKENS
        )
    was_training = policy.training
    policy.eval()
    packing = contextlib.ExitStack()
    versions: list[int] = []
    try:
        if on_step is not None:
            versions.append(_step_version(on_step, 0))
        if pack_weights and not compile:  # the compiled step traces F.linear, not the packed op
            rows = B if max_num_seqs is None else min(B, max_num_seqs)
            packing.enter_context(packed_linears(policy, batch_size=rows))

        def swap(t: int, part: _Samples) -> tuple[Decoder, torch.Tensor] | None:
            versions.append(_step_version(on_step, t))
            if versions[-1] == versions[-2]:
                return None
            # New weights: re-pack them, and recompute the cache of the prompt and the t tokens so far with them.
            packing.close()
            if pack_weights and not compile:
                packing.enter_context(packed_linears(policy, batch_size=B))
            fresh = setup_decoder(policy, part.input_ids.shape[0], prompts.shape[1] + max_new_tokens, device, compile)
            length = part.prompt_len + t
            return fresh, prefill(fresh, part.input_ids[:, :length], part.attention_mask[:, :length], 1)

        sampling = dict(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            logits_processor=logits_processor,
            generator=generator,
            repetition_penalty=repetition_penalty,
        )
        if max_num_seqs is not None:
            out = decode_with_slots(
                policy,
                prompts,
                prompt_mask,
                max_new_tokens,
                num_samples=K,
                max_num_seqs=max_num_seqs,
                compile=compile,
                stop=stop,
                stopping=stopping,
                pad_token_id=pad_token_id,
                min_new_tokens=min_new_tokens,
                return_entropy=return_entropy,
                **sampling,
            )
            return _to_batch(out, prompt_rows, mask_rows, max_new_tokens, K, max_new_tokens, temperature)
        decoder = setup_decoder(policy, B, prompts.shape[1] + max_new_tokens, device, compile)
        out = _new_samples(
            prompt_rows, mask_rows, max_new_tokens, decoder.cache_len, pad_token_id, return_entropy
        )
        logits = prefill(decoder, prompts, prompt_mask, K)
        steps = decode_n_tokens(
            decoder,
            logits,
            out,
            max_new_tokens,
            stop=stop,
            stopping=stopping,
            pad_token_id=pad_token_id,
            min_new_tokens=min_new_tokens,
            compact=continuous_batching,
            swap=None if on_step is None else swap,
            **sampling,
        )
    finally:
        packing.close()
        policy.train(was_training)
    batch = _to_batch(out, prompt_rows, mask_rows, steps, num_samples, max_new_tokens, temperature)
    if on_step is not None:
        R = batch["responses"].shape[1]
        batch["token_version"] = torch.tensor(versions[:R], dtype=torch.int64, device=device).expand(B, R).clone()
    return batch


def _step_version(on_step: Callable[[int], int], t: int) -> int:
    version = on_step(t)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"on_step({t}) must return the weights' version as an int, got {version!r:.80}")
    return version


def stop_strings_stopping(tokenizer: Any, stop_strings: Sequence[str]) -> StoppingFn:
    """A ``generate`` ``stopping`` rule that ends a row once the decoded text of its response holds one of
    ``stop_strings``: the row ends after the token that completes the string (the string's last character
    lies in that token's text), which stays in the response as its last action, the stop string with it
    (the text decoded with special tokens kept). Decodes a tail of each row on the host at every step.

    Raises:
        ValueError: a stop string is empty.
    """
    stops = tuple(stop_strings)
    if any(not isinstance(x, str) or not x for x in stops):
        raise ValueError(f"stop_strings must be non-empty strings, got {list(stops)!r}")
    tail = 4 * max(len(x) for x in stops) + 4  # a character may take 4 byte-level tokens

    def stopping(responses: torch.Tensor) -> torch.Tensor:
        rows = responses[:, -tail:].tolist()
        texts = tokenizer.batch_decode(rows, skip_special_tokens=False)
        return torch.tensor([any(x in text for x in stops) for text in texts], dtype=torch.bool)

    return stopping


def _pad_columns(batch: TensorDictBase, length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The per-token response columns of a ``generate`` batch right-padded to ``length``: ``responses`` with
    ``pad_token_id``, the masks with False, ``logprobs``/``entropy``/``token_version`` with 0."""
    pad = length - batch["responses"].shape[1]
    out = {}
    for key, value in (
        ("responses", pad_token_id),
        ("action_mask", False),
        ("logprobs", 0.0),
        ("entropy", 0.0),
        ("token_version", 0),
    ):
        if key in batch.keys():
            out[key] = torch.nn.functional.pad(batch[key], (0, pad), value=value)
    return out


def generate_texts(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    stop_strings: Sequence[str] = (),
    chunk_size: int | None = None,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    logits_processor: Callable | None = None,
    compile: bool = False,
    pack_weights: bool | None = None,
    continuous_batching: bool = False,
    max_num_seqs: int | None = None,
    on_step: Callable[[int], int] | None = None,
) -> TensorDict:
    """``generate`` from prompt strings: tokenize them (``tokenize_prompts``), sample ``num_samples``
    responses each with the policy in eval mode and no gradient, decode the texts (``decode``).

    ``top_k``, ``top_p``, ``repetition_penalty``, ``min_new_tokens``, ``continuous_batching``, ``max_num_seqs``,
    ``on_step``: as ``generate`` (with ``chunk_size``, each chunk has its own slots; ``on_step`` is called by
    each chunk's call, from t = 0).
    ``stop_strings``: a
    response ends after the token that completes one of them (``stop_strings_stopping``; one host sync per
    step). ``chunk_size``: generate the prompts ``chunk_size`` at a time (trlx ``method.chunk_size``; None:
    all in one call), all tokenized together (one prompt width) and the chunks' responses right-padded to
    the longest; ``group`` numbers the prompts across chunks. Each chunk draws its own noise from
    ``generator`` in turn (one ``torch.rand(rows, 1)`` per step of each chunk), so the samples are not those
    of one call with the same generator state, though as reproducible.

    Returns the batch ``generate`` returns plus ``prompt_text`` and ``response_text``. A sharded (FSDP2)
    policy should be gathered around the call (``rlbits.distributed.parallelize.unsharded``), so decoding
    runs no collective per token.

    Raises:
        ValueError: ``chunk_size`` < 1, an empty stop string, and what ``generate`` raises.
    """
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    device = next(policy.parameters()).device
    prompts_td = tokenize_prompts(tokenizer, list(prompts)).to(device)
    stopping = stop_strings_stopping(tokenizer, stop_strings) if stop_strings else None
    n = prompts_td.batch_size[0]
    size = n if chunk_size is None else chunk_size
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            chunks = [
                generate(
                    policy,
                    prompts_td[start : start + size],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    repetition_penalty=repetition_penalty,
                    min_new_tokens=min_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    num_samples=num_samples,
                    generator=generator,
                    logits_processor=logits_processor,
                    stopping=stopping,
                    compile=compile,
                    pack_weights=pack_weights,
                    continuous_batching=continuous_batching,
                    max_num_seqs=max_num_seqs,
                    on_step=on_step,
                )
                for start in range(0, n, size)
            ]
    finally:
        policy.train(was_training)
    batch = chunks[0] if len(chunks) == 1 else _concat_chunks(chunks, tokenizer.pad_token_id, size)
    return decode(batch, tokenizer)


def _concat_chunks(chunks: list[TensorDict], pad_token_id: int, chunk_size: int) -> TensorDict:
    """One batch from the batches of consecutive prompt chunks (same prompt width): responses right-padded to
    the longest, ``group`` offset by the prompts before each chunk."""
    length = max(c["responses"].shape[1] for c in chunks)
    padded = [_pad_columns(c, length, pad_token_id) for c in chunks]
    columns = {
        k: torch.cat([p[k] for p in padded]) for k in padded[0] if k not in ("responses", "action_mask")
    }
    columns["group"] = torch.cat([c["group"] + i * chunk_size for i, c in enumerate(chunks)])
    columns["truncated"] = torch.cat([c["truncated"] for c in chunks])
    return build_batch(
        torch.cat([c["prompts"] for c in chunks]),
        torch.cat([c["prompt_mask"] for c in chunks]),
        torch.cat([p["responses"] for p in padded]),
        torch.cat([p["action_mask"] for p in padded]),
        **columns,
    )
