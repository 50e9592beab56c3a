"""Choosing the next token: ``next_token(logits, ...)`` applies the logits processor, the repetition penalty,
the ban on stop tokens before ``min_new_tokens``, temperature, top-k and top-p (the order of HF's processors
and warpers), draws one token per row with ``inverse_cdf_sample`` and returns its logprob under the raw policy
at the temperature. Pure tensor functions: no model, no host sync.

``inverse_cdf_sample`` uses one uniform per row from the caller's generator (no ``torch.multinomial``), so the
same generator state gives the same tokens. A step whose distribution holds NaN (NaN/inf logits, or
``logits / temperature`` overflowing float32) cannot yield a token id outside the vocabulary: the id is
clamped and its logprob set to NaN, for ``rlbits.rollout.generate`` to raise once after decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Block size of the two-level inverse-CDF sampler (see ``inverse_cdf_sample``).
_SAMPLE_BLOCK = 256

# ``f(input_ids [B, T], logits [B, V]) -> logits [B, V]``, applied to the raw logits before the temperature.
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th are kept, as HF)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter as HF's ``TopPLogitsWarper``: keep the smallest set of most likely tokens whose
    probability sums to >= p (at least one token); the rest get -inf (Holtzman 2020)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p)
    remove[..., -1] = False
    return logits.masked_fill(remove.scatter(-1, sorted_idx, remove), float("-inf"))


def repetition_penalty_filter(
    logits: torch.Tensor, input_ids: torch.Tensor, penalty: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Repetition penalty as HF's ``RepetitionPenaltyLogitsProcessor`` (Keskar et al. 2019, CTRL): the logit of
    every token id present in a row's ``input_ids`` is divided by ``penalty`` where it is positive and
    multiplied by it where it is negative (> 1 discourages repeats, < 1 encourages them).

    Args:
        logits: [B, V] float.
        input_ids: [B, T] int64, the ids so far (prompt and response).
        penalty: > 0; 1 changes nothing.
        mask: [B, T] bool, the real tokens of ``input_ids``; ids under False (padding) are not penalised
            (HF penalises every id of ``input_ids``, its pad id included). None: every id counts.

    Returns:
        [B, V] float, a new tensor.
    """
    present = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    ids = input_ids.clamp(0, logits.shape[-1] - 1)
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    present.scatter_reduce_(1, ids, real & (input_ids >= 0) & (input_ids < logits.shape[-1]), "amax")
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(present, penalised, logits)


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to ``weights``, by inverting the CDF at ``u``.

    Two levels: pick a block of ``_SAMPLE_BLOCK`` tokens from the cumulative block masses, then the token
    inside it from the block's own cumulative sum. A one-level float32 cumsum over V = 32k tokens rounds
    each token's mass to ~6e-8 of the total (a total-variation error up to V * 3e-8 ~ 1e-3); two levels
    bound it near ``(_SAMPLE_BLOCK + V / _SAMPLE_BLOCK) * 3e-8``. Tokens of weight 0 are never drawn.
    Unlike ``torch.multinomial`` it needs only one uniform per row (from the caller's generator) and no
    host sync.

    Args:
        weights: [B, V] float, >= 0, each row with a positive entry (e.g. ``exp(logits - max)``).
        u: [B, 1] uniform in (0, 1].

    Returns:
        [B] int64 in ``[0, V)``.
    """
    batch, vocab = weights.shape
    block = min(_SAMPLE_BLOCK, vocab)
    n_blocks = -(-vocab // block)
    if n_blocks * block != vocab:
        weights = torch.nn.functional.pad(weights, (0, n_blocks * block - vocab))
    w = weights.view(batch, n_blocks, block)
    block_cdf = w.sum(-1).cumsum(-1)  # [B, n_blocks]
    x = u * block_cdf[:, -1:]  # in (0, total]: > 0, so a leading zero-weight token is never hit
    b = torch.searchsorted(block_cdf, x).clamp(max=n_blocks - 1)  # first block whose cdf >= x
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(x))
    inner_cdf = w.gather(1, b[:, :, None].expand(batch, 1, block)).squeeze(1).cumsum(-1)  # [B, block]
    # x - before > 0; rounding may push it past the block's own total, so cap it there.
    rest = torch.minimum(x - before, inner_cdf[:, -1:])
    i = torch.searchsorted(inner_cdf, rest)
    return (b * block + i).squeeze(1)


def _process(
    logits_processor: LogitsProcessor, input_ids: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Apply the caller's processor to a copy (processors may edit in place; the raw logits give the
    logprobs) and check its output shape (shapes only: no sync)."""
    out = logits_processor(input_ids, logits.clone())
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"logits_processor must return logits of shape {tuple(logits.shape)} [B, V], got {got}"
        )
    return out.float()


def next_token(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    logits_processor: LogitsProcessor | None,
    generator: torch.Generator | None,
    repetition_penalty: float = 1.0,
    input_mask: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of each row and its logprob under the raw policy at ``temperature``.

    The sampled distribution: raw logits -> ``logits_processor`` -> ``repetition_penalty_filter`` ->
    ``banned`` ids set to -inf -> ``/ temperature`` -> ``top_k_filter`` -> ``top_p_filter``. The logprob is
    of ``softmax(raw_logits / temperature)``, none of these transforms applied (see ``rlbits.rollout.generate``).

    Args:
        logits: [B, V] float32 raw logits of the last position.
        input_ids: [B, T] the ids so far (prompt and response), for ``logits_processor`` and the penalty.
        repetition_penalty: HF's repetition penalty over the ids of ``input_ids`` under ``input_mask``; 1: off.
        input_mask: [B, T] bool, the real tokens of ``input_ids`` (None: all).
        banned: [S] int64 ids that may not be sampled this step (stop ids before ``min_new_tokens``), or None.
        uniforms: [B, 1] float32 draws of ``torch.rand`` in [0, 1) to sample with instead of drawing
            ``torch.rand(B, 1, generator=generator)`` here (``generate`` with ``continuous_batching`` draws
            for every row of the batch and passes those of the rows still decoding); None: draw them.

    Returns:
        ``(tokens [B] int64, logprobs [B] float32)``. A row whose distribution holds NaN (from NaN or inf
        logits, or a temperature so small that ``logits / temperature`` overflows) gets a NaN logprob and a
        token id clamped into ``[0, V)``, so the decode loop goes on without a sync and ``generate`` raises
        once after it.
    """
    scaled = logits if temperature in (0, 1) else logits / temperature
    peak = scaled.amax(dim=-1, keepdim=True)
    unnormalised = torch.exp(scaled - peak)  # doubles as the sampling weights when nothing is filtered
    # NaN wherever ``scaled`` holds a NaN or an inf (inf - inf), so is every logprob of such a row.
    log_partition = peak + unnormalised.sum(dim=-1, keepdim=True).log()
    invalid = None  # rows whose *processed* distribution held NaN while the raw one did not
    processing = logits_processor is not None or repetition_penalty != 1 or banned is not None
    if processing:
        z = _process(logits_processor, input_ids, logits) if logits_processor is not None else logits
        if repetition_penalty != 1:
            z = repetition_penalty_filter(z, input_ids, repetition_penalty, input_mask)
        if banned is not None:
            z = z.index_fill(-1, banned, float("-inf"))
    if temperature == 0:
        z = z if processing else logits
        tokens = z.argmax(dim=-1)
        if processing:
            invalid = z.gather(1, tokens[:, None]).squeeze(1).isnan()  # argmax picks a NaN where there is one
    else:
        weights = unnormalised
        if processing or top_k is not None or (top_p is not None and top_p < 1):
            z = scaled if not processing else (z if temperature == 1 else z / temperature)
            if top_k is not None:
                z = top_k_filter(z, top_k)
            if top_p is not None and top_p < 1:
                z = top_p_filter(z, top_p)
            weights = torch.exp(z - z.amax(dim=-1, keepdim=True))
        if uniforms is None:
            uniforms = torch.rand(logits.shape[0], 1, generator=generator, device=logits.device)
        u = 1 - uniforms
        tokens = inverse_cdf_sample(weights, u)
        vocab = logits.shape[-1]
        if weights is not unnormalised:
            invalid = tokens >= vocab  # NaN weights send the inverse-CDF search past the last token
        tokens = tokens.clamp(max=vocab - 1)
    logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - log_partition.squeeze(1)
    return tokens, logprobs if invalid is None else torch.where(invalid, torch.nan, logprobs)


__all__ = [
    "LogitsProcessor",
    "inverse_cdf_sample",
    "next_token",
    "repetition_penalty_filter",
    "top_k_filter",
    "top_p_filter",
]
