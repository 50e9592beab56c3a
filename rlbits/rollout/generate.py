"""Sampling responses from a causal LM with a KV cache: ``generate``.

``generate`` is a chain of small functions, after gpt-fast's ``generate.py``: set-up (``_check_args``,
``_setup_decoder``: small-batch head, KV cache, compiled step) -> ``prefill`` (the left-padded prompts once,
shared by the K samples of each) -> ``decode_n_tokens`` (per step ``_next_token``: logits processor,
temperature, top-k, top-p, sample, logprob; then ``decode_one_token`` from the cache) -> ``_to_batch``.
``_sample`` draws by inverse-CDF sampling on one uniform per row from the caller's generator (no
``torch.multinomial``). Nothing in the loop reads a value on the host except one "have all rows finished?"
check per step on CPU (every ``_EOS_CHECK_EVERY`` steps on an accelerator, where a sync per step would stall
the launch queue). A step whose distribution holds NaN
(NaN/inf logits, or ``logits / temperature`` overflowing float32) cannot yield a token id outside the
vocabulary: the id is clamped, its logprob set to NaN, and ``generate`` raises ``FloatingPointError`` once
after the loop.

KV cache: a ``transformers.StaticCache`` allocated up front for ``P + max_new_tokens`` positions when the
model supports it (``_can_compile_fullgraph``), with the attention mask kept as a [B, P + max_new_tokens]
buffer whose future columns are 0. Left padding works with it for GPT-2, Llama and Qwen2 in transformers
5.x (tested against HF ``generate`` and the ``DynamicCache`` path): padding is masked at every step and
positions come from ``position_ids``, not from the cache index. Fixed shapes make the memory predictable
and the step compilable; on CPU the speed is the same as ``DynamicCache`` within 2% (4-layer GPT-2, V =
32k, B = 8 and 32, 32 and 200 new tokens: the LM head dominates). Models without static-cache support use
HF's ``DynamicCache``. The cache goes to the model under the keyword its forward names
(``rlbits.models.forward.cache_argument``: ``cache`` in transformers 5.2x, whose ``past_key_values`` prints a
FutureWarning on every call).

On CPU with at most 64 rows, the decode step of GPT-2/Llama/Mistral/Qwen2/Qwen3 models runs the backbone
and applies the LM head itself to the last position only (see ``_small_batch_head``): the head's own forward
in the eager step, ``(W @ h.T).T`` in the compiled one; the logits agree to float rounding. On CPU the eager
steps run every linear layer through oneDNN on weights reordered once per call (``pack_weights``,
``rlbits.models.packed.packed_linears``): at 16 rows MKL's ``F.linear`` ran SmolLM2-135M's shapes at 50-73
GFLOP/s and oneDNN on packed weights at 68-151 (2 AVX-512 cores, float32; ``benchmarks/RESULTS.md`` 1c).

The ``logprobs`` returned are the log-probabilities of the sampled tokens under
``softmax(raw_logits / temperature)``: the untruncated policy distribution, which is what a
teacher-forced training forward at the same temperature computes (``rlbits.models.forward.policy_logprobs``).
``top_k``, ``top_p`` and ``logits_processor`` change which tokens are *sampled* but not these logprobs,
so with them the samples come from a different distribution than the logprobs describe (as in TRL,
OpenRLHF and verl). Greedy decoding (``temperature=0``) reports logprobs at temperature 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from rlbits.batch import build_batch, decode, group_ids, tokenize_prompts
from rlbits.functional import entropy_from_logits
from rlbits.models.forward import (
    accepts_logits_to_keep,
    cache_argument,
    context_length,
    output_cache,
    position_ids_from_mask,
    split_head,
)
from rlbits.models.packed import packed_linears

# Steps between host-side "all rows finished?" checks. On an accelerator each check stalls the launch
# queue, so it runs every few steps (the extra steps it may decode are trimmed from the output); on CPU
# the check is free.
_EOS_CHECK_EVERY = 8
_EOS_CHECK_EVERY_CPU = 1
# Block size of the two-level inverse-CDF sampler (see ``_sample``).
_SAMPLE_BLOCK = 256
# Most rows for which the decode step applies the LM head itself (see ``_small_batch_head``).
_SMALL_BATCH_HEAD_ROWS = 64
# Fewest new tokens for which ``pack_weights=None`` packs the weights (see ``generate``).
_PACK_MIN_NEW_TOKENS = 4
# With ``compile=True`` the static cache's length is rounded up to a multiple of this, so prompt batches of
# different lengths reuse one compiled decode step.
_COMPILE_CACHE_BUCKET = 64

LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# ``stopping(responses [B, t]) -> [B] bool``: rows that end after their latest token (see ``generate``).
StoppingFn = Callable[[torch.Tensor], torch.Tensor]


# --- sampling -------------------------------------------------------------------------------------------


def _top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties with the k-th are kept, as HF)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter as HF's ``TopPLogitsWarper``: keep the smallest set of most likely tokens whose
    probability sums to >= p (at least one token); the rest get -inf (Holtzman 2020)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p)
    remove[..., -1] = False
    return logits.masked_fill(remove.scatter(-1, sorted_idx, remove), float("-inf"))


def _sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
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


def _next_token(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    logits_processor: LogitsProcessor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of each row and its logprob under the raw policy at ``temperature``.

    Args:
        logits: [B, V] float32 raw logits of the last position.
        input_ids: [B, T] the ids so far (prompt and response), for ``logits_processor``.

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
    if temperature == 0:
        z = _process(logits_processor, input_ids, logits) if logits_processor is not None else logits
        tokens = z.argmax(dim=-1)
        if logits_processor is not None:
            invalid = z.gather(1, tokens[:, None]).squeeze(1).isnan()  # argmax picks a NaN where there is one
    else:
        weights = unnormalised
        if logits_processor is not None or top_k is not None or (top_p is not None and top_p < 1):
            z = (
                scaled
                if logits_processor is None
                else _process(logits_processor, input_ids, logits) / temperature
            )
            if top_k is not None:
                z = _top_k_filter(z, top_k)
            if top_p is not None and top_p < 1:
                z = _top_p_filter(z, top_p)
            weights = torch.exp(z - z.amax(dim=-1, keepdim=True))
        u = 1 - torch.rand(logits.shape[0], 1, generator=generator, device=logits.device)
        tokens = _sample(weights, u)
        vocab = logits.shape[-1]
        if weights is not unnormalised:
            invalid = tokens >= vocab  # NaN weights send the inverse-CDF search past the last token
        tokens = tokens.clamp(max=vocab - 1)
    logprobs = scaled.gather(1, tokens[:, None]).squeeze(1) - log_partition.squeeze(1)
    return tokens, logprobs if invalid is None else torch.where(invalid, torch.nan, logprobs)


# --- model calls ----------------------------------------------------------------------------------------


def _make_cache(policy: torch.nn.Module, max_len: int):
    """A StaticCache for ``max_len`` positions, or None (the model then builds a DynamicCache).

    None under autocast: a static layer allocates keys and values in the dtype of the first keys it sees,
    and a RoPE model's keys come out of autocast in float32 while its values are bfloat16, so the values'
    in-place copy would fail; the dynamic cache stores each as it comes.
    """
    from transformers import StaticCache

    config = getattr(policy, "config", None)
    if config is None or not getattr(policy, "_can_compile_fullgraph", False):
        return None
    device = next(policy.parameters()).device
    if torch.is_autocast_enabled(device.type):
        return None
    try:
        return StaticCache(config=config, max_cache_len=max_len)
    except Exception:  # a config the static layers do not understand: use the dynamic cache
        return None


def _repeat_rows(cache, k: int) -> None:
    """Repeat every row of a prefilled KV cache ``k`` times in place (row i -> rows i*k .. i*k+k-1), so
    the K samples of a prompt share one prefill."""
    from transformers.cache_utils import StaticLayer

    for layer in cache.layers:
        if isinstance(layer, StaticLayer):
            layer.keys = layer.keys.repeat_interleave(k, dim=0)
            layer.values = layer.values.repeat_interleave(k, dim=0)
            layer.batch_size = layer.keys.shape[0]
            torch._dynamo.mark_static_address(layer.keys)  # the compiled step updates them in place
            torch._dynamo.mark_static_address(layer.values)
        else:
            layer.batch_repeat_interleave(k)


def _small_batch_head(policy: torch.nn.Module, batch_size: int, device: torch.device):
    """``(backbone, lm_head)`` when the decode step should apply the LM head itself, to the last position.

    The compiled step (``_decode_step``) applies it as ``(W @ h.T).T``: measured alone, repeated on the
    2-core benchmark machine (V = 32k, H = 256, float32, 2 threads; ``benchmarks/RESULTS.md``), ``W @ h.T``
    took 0.6-0.75x the time of ``F.linear(h, W)`` at 8-64 rows and about the same at 128. The eager step
    (``_forward_last``) calls the head module (``F.linear``, or oneDNN under ``packed_linears``): inside the
    decode loop, where the 32 MB head weight has left the cache between steps, ``F.linear`` was the faster
    one (rollout 0.35 -> 0.31 s at 32 rows, 0.20 -> 0.18 at 8).
    Up to ``_SMALL_BATCH_HEAD_ROWS`` = 64 rows. Only for models whose logits are exactly
    ``lm_head(last_hidden_state)`` (``rlbits.models.forward.split_head``). Returns None to call the policy
    as is.
    """
    if device.type != "cpu" or batch_size > _SMALL_BATCH_HEAD_ROWS:
        return None
    return split_head(policy)


@dataclasses.dataclass
class _Decoder:
    """The policy as the decode loop calls it, and its KV cache (``_setup_decoder`` builds it).

    ``split``: ``(backbone, lm_head)`` when the eager step applies the head itself (``_small_batch_head``),
    else None. ``keep_last``: the policy takes ``logits_to_keep``. ``cache_arg``: the keyword its forward
    takes the cache under (``rlbits.models.forward.cache_argument``). ``cache``: the KV cache, a
    ``StaticCache`` of ``cache_len`` positions when ``static``, else None until the prefill returns HF's
    ``DynamicCache``. ``compiled``: ``(step, backbone, head weight, cache keyword)`` of the compiled decode
    step, or None (eager).
    """

    policy: torch.nn.Module
    split: tuple[torch.nn.Module, torch.nn.Module] | None
    keep_last: bool
    cache_arg: str
    cache: Any
    cache_len: int
    static: bool
    compiled: tuple[Callable, torch.nn.Module, torch.Tensor, str] | None


def _forward_last(decoder: _Decoder, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Logits of the last position, [B, V] float32, through the eager policy; ``decoder.cache`` updated."""
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        decoder.cache_arg: decoder.cache,
        "use_cache": True,
    }
    if decoder.split is not None:
        backbone, head = decoder.split
        out = backbone(**kwargs)
        # The head's own forward (F.linear, or oneDNN under packed_linears), not _head_last's (W @ h.T).T:
        # inside the decode loop (weights out of cache between steps) F.linear took 0.88x the rollout time
        # at 8, 32 and 64 rows (4-layer GPT-2, V = 32k, 2 CPU threads).
        logits = head(out.last_hidden_state[:, -1])
    else:
        policy = decoder.policy
        out = policy(**kwargs, logits_to_keep=1) if decoder.keep_last else policy(**kwargs)
        logits = out.logits[:, -1]
    decoder.cache = output_cache(out)
    return logits.float()


def _head_last(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 logits of the last position from [B, T, H] hidden states, as ``(W @ h.T).T`` made
    contiguous (the sampler's row reductions on the transposed view run several times slower)."""
    return (weight @ hidden[:, -1].T).T.float().contiguous()


def _decode_step(backbone, weight, input_ids, attention_mask, position_ids, cache, cache_arg="cache"):
    """One decode step for ``torch.compile``: the backbone on [B, 1] new tokens with the static cache
    (passed as ``cache_arg``), then the head on the last position. Returns [B, V] float32 logits."""
    kwargs = {cache_arg: cache}
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **kwargs,
    )
    return _head_last(weight, out.last_hidden_state)


_compiled_decode_steps: dict[str, Callable] = {}


def compiled_decode_step(device_type: str = "cpu"):
    """``_decode_step`` under ``torch.compile(dynamic=False)``, built once per process and device type.
    Parameters are graph inputs (not constants), so optimizer steps need no recompilation; a new batch size
    or cache length does (``generate`` rounds the cache length up to a multiple of ``_COMPILE_CACHE_BUCKET``).
    On CUDA it is compiled with ``mode="reduce-overhead"``: the step is captured as a CUDA graph and
    replayed, one launch per token instead of hundreds of small kernels (gpt-fast, HF's static-cache
    ``generate``); the KV cache is updated in place at its static address. Inductor's on-disk cache makes
    later processes compile faster."""
    if device_type not in _compiled_decode_steps:
        mode = "reduce-overhead" if device_type == "cuda" else None
        _compiled_decode_steps[device_type] = torch.compile(_decode_step, dynamic=False, mode=mode)
    return _compiled_decode_steps[device_type]


# --- generate: set-up, prefill, decode -------------------------------------------------------------------


def _check_args(
    prompts_td, max_new_tokens, temperature, top_k, top_p, num_samples, eos_token_id, pad_token_id
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
    """Raise if a sampled token's logprob is NaN (``_next_token`` marks a distribution that held NaN so):
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


def _setup_decoder(
    policy: torch.nn.Module, rows: int, total: int, device: torch.device, compile: bool
) -> _Decoder:
    """How the decode loop calls ``policy`` for ``rows`` rows and ``total`` = P + max_new_tokens positions:
    the small-batch head, the KV cache (static where the model supports it), and with ``compile`` the
    compiled step, whose static cache is rounded up to a multiple of ``_COMPILE_CACHE_BUCKET`` (at most the
    model's context) so prompt batches of different lengths reuse one compiled graph."""
    split = _small_batch_head(policy, rows, device)
    compiled = None
    cache_len = total
    # The compiled step applies the head itself, wherever the static cache applies (any row count).
    step_split = split_head(policy) if compile and _make_cache(policy, total) is not None else None
    if step_split is not None:
        cache_len = -(-total // _COMPILE_CACHE_BUCKET) * _COMPILE_CACHE_BUCKET
        limit = context_length(policy)
        cache_len = min(cache_len, limit[1]) if limit is not None else cache_len
        backbone, head = step_split
        compiled = (compiled_decode_step(device.type), backbone, head.weight, cache_argument(backbone))
    cache = _make_cache(policy, cache_len)
    return _Decoder(
        policy=policy,
        split=split,
        keep_last=accepts_logits_to_keep(policy),
        cache_arg=cache_argument(split[0] if split is not None else policy),
        cache=cache,
        cache_len=cache_len,
        static=cache is not None,
        compiled=compiled,
    )


def prefill(
    decoder: _Decoder, prompts: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """Run the left-padded prompts through the policy once, filling ``decoder.cache``.

    Position ids are ``cumsum(prompt_mask) - 1`` clamped at 0 (``position_ids_from_mask``), so padding
    shifts no position. The K samples of a prompt share its prefill: the logits and the cache rows are
    repeated K times (rows ``i*K .. i*K+K-1`` belong to prompt i).

    Args:
        decoder: from ``_setup_decoder``.
        prompts: [B, P] int64, left-padded. prompt_mask: [B, P] bool.
        num_samples: K.

    Returns:
        [B*K, V] float32 logits of each prompt's last position.
    """
    B, P = prompts.shape
    prefill_mask = torch.zeros(
        (B, decoder.cache_len if decoder.static else P), dtype=torch.bool, device=prompts.device
    )
    prefill_mask[:, :P] = prompt_mask
    logits = _forward_last(decoder, prompts, prefill_mask, position_ids_from_mask(prompt_mask))
    if num_samples > 1:
        logits = logits.repeat_interleave(num_samples, dim=0)
        _repeat_rows(decoder.cache, num_samples)
    return logits


def decode_one_token(
    decoder: _Decoder,
    new_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """Feed one new token per row, ``new_ids`` [B, 1] at ``position_ids`` [B, 1], through the policy and its
    cache; returns the next [B, V] float32 logits. ``attention_mask`` [B, cache_len] covers the cache (of
    which the dynamic cache reads the first ``length`` columns)."""
    if decoder.compiled is not None:
        step, backbone, weight, cache_arg = decoder.compiled
        if new_ids.device.type == "cuda":
            # A new replay of the CUDA graph; the last step's logits are no longer read.
            torch.compiler.cudagraph_mark_step_begin()
        # contiguous: the slice's stride is P + max_new_tokens, a new graph for every prompt length
        return step(
            backbone, weight, new_ids.contiguous(), attention_mask, position_ids, decoder.cache, cache_arg
        )
    mask = attention_mask if decoder.static else attention_mask[:, :length]
    return _forward_last(decoder, new_ids, mask, position_ids)


def decode_n_tokens(
    decoder: _Decoder,
    logits: torch.Tensor,
    out: _Samples,
    max_new_tokens: int,
    *,
    stop: torch.Tensor,
    stopping: StoppingFn | None,
    pad_token_id: int,
    **sampling: Any,
) -> int:
    """Sample up to ``max_new_tokens`` tokens per row from the prefill's ``logits`` on, writing ``out``.

    Each step: ``_next_token(logits, ids so far, **sampling)`` (``sampling``: ``temperature``, ``top_k``,
    ``top_p``, ``logits_processor``, ``generator``), then the next logits from ``decode_one_token``. A row
    finishes on a ``stop`` id [S] int64 or where ``stopping`` says so; finished rows keep decoding, their new
    tokens masked out and set to ``pad_token_id``. The loop ends after ``max_new_tokens`` steps, or once every
    row has finished (checked on the host every ``_EOS_CHECK_EVERY`` steps on an accelerator, every step on
    CPU). Returns the number of steps taken.
    """
    P, temperature = out.prompt_len, sampling["temperature"]
    check_every = _EOS_CHECK_EVERY_CPU if logits.device.type == "cpu" else _EOS_CHECK_EVERY
    steps = 0
    for t in range(max_new_tokens):
        tokens, lp = _next_token(logits, out.input_ids[:, : P + t], **sampling)
        alive = ~out.finished
        out.input_ids[:, P + t] = torch.where(alive, tokens, pad_token_id)
        out.attention_mask[:, P + t] = alive
        out.logprobs[:, t] = torch.where(alive, lp, 0.0)
        if out.entropy is not None:
            ent = entropy_from_logits(logits, temperature if temperature > 0 else 1.0)
            out.entropy[:, t] = torch.where(alive, ent, 0.0)
        if stop.numel():
            out.finished = out.finished | torch.isin(tokens, stop)
        if stopping is not None:
            out.finished = out.finished | (alive & stopping(out.input_ids[:, P : P + t + 1]).to(alive.device))
        steps = t + 1
        if t + 1 == max_new_tokens or (
            (stop.numel() or stopping is not None) and steps % check_every == 0 and bool(out.finished.all())
        ):
            break
        new_ids = out.input_ids[:, P + t : P + t + 1]
        logits = decode_one_token(decoder, new_ids, out.attention_mask, out.position + t, P + t + 1)
    return steps


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
) -> TensorDict:
    """Sample ``num_samples`` responses per prompt with a KV cache.

    Prefills the left-padded prompts with position ids ``cumsum(mask) - 1`` (clamped at 0), then decodes
    one token per step from the cache, growing the attention mask. Each step: raw logits ->
    ``logits_processor`` -> ``/ temperature`` -> top-k -> top-p -> sample (the order of HF's warpers).
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
            ``torch.rand(B, 1)`` draw per step, on the policy's device).
        stop_token_ids: more ids that end a response like ``eos_token_id``.
        stopping: optional per-row stop rule, ``f(responses [B, t] int64) -> [B] bool``, called after each
            step with the response tokens so far (finished rows hold ``pad_token_id`` after their end); True
            ends that row after its latest token, which is kept as its last action (like a stop token). For
            stop strings and per-row token budgets (``rlbits.rollout.multiturn``). It reads the tokens on
            the host, so it costs one device sync per step; None (the default) adds nothing.
        return_entropy: also return ``entropy`` [B, R]: entropy of ``softmax(raw_logits / T)`` per step.
        compile: run each decode step through ``torch.compile`` (``compiled_decode_step``; gpt-fast's
            approach: static shapes, static KV cache; on CUDA replayed as a CUDA graph). Only where the
            static cache and the split head apply (GPT-2/Llama/Mistral/Qwen2/Qwen3 families, no autocast);
            else ignored. The first call per batch size and cache length compiles (tens of seconds); the
            samples equal the eager ones up to float rounding of the logits.
        pack_weights: run the eager decode's linear layers through oneDNN on weights reordered once per
            call (``rlbits.models.packed.packed_linears``): on CPU several times faster matmuls at decode
            batch sizes, the same logits to float rounding, one extra copy of the weights in memory during
            the call. None (default): on for a CPU policy without ``compile`` or autocast, for at least 4
            new tokens; False: never; True: wherever it applies (CPU, float32 or bfloat16 weights, no
            ``compile``).

    Returns:
        TensorDict with batch size [B * K]:
        ``prompts`` [B*K, P], ``prompt_mask`` [B*K, P], ``responses`` [B*K, R] int64 right-padded with
        ``pad_token_id``, ``action_mask`` [B*K, R] bool (True up to and including the stop token),
        ``response_mask`` (= ``action_mask``: every generated token is an action),
        ``input_ids`` = cat(prompts, responses), ``attention_mask`` = cat(prompt_mask, response_mask),
        ``logprobs`` [B*K, R] float32 (0 where ``action_mask`` is False), ``group`` [B*K] int64,
        ``truncated`` [B*K] bool (True when the response hit ``max_new_tokens`` without a stop token; for
        overlong filtering), and ``entropy`` with ``return_entropy``. R <= ``max_new_tokens``.

    Raises:
        ValueError: missing keys, mismatched shapes, an empty batch, a row without prompt tokens, a prompt
            or pad id outside the vocabulary, bad sampling arguments, or ``P + max_new_tokens`` beyond the
            model's context.
        FloatingPointError: a step's distribution held NaN (NaN/inf logits, or a temperature so small that
            ``logits / temperature`` overflows): checked once after decoding, the message names the row.
    """
    _check_args(
        prompts_td, max_new_tokens, temperature, top_k, top_p, num_samples, eos_token_id, pad_token_id
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
    try:
        if pack_weights and not compile:  # the compiled step traces F.linear, not the packed op
            packing.enter_context(packed_linears(policy, batch_size=B))
        decoder = _setup_decoder(policy, B, prompts.shape[1] + max_new_tokens, device, compile)
        out = _new_samples(
            prompt_rows, mask_rows, max_new_tokens, decoder.cache_len, pad_token_id, return_entropy
        )
        logits = prefill(decoder, prompts, prompt_mask, K)
        sampling = dict(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            logits_processor=logits_processor,
            generator=generator,
        )
        steps = decode_n_tokens(
            decoder,
            logits,
            out,
            max_new_tokens,
            stop=stop,
            stopping=stopping,
            pad_token_id=pad_token_id,
            **sampling,
        )
    finally:
        packing.close()
        policy.train(was_training)
    return _to_batch(out, prompt_rows, mask_rows, steps, num_samples, max_new_tokens, temperature)


def generate_texts(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    logits_processor: Callable | None = None,
    compile: bool = False,
    pack_weights: bool | None = None,
) -> TensorDict:
    """``generate`` from prompt strings: tokenize them (``tokenize_prompts``), sample ``num_samples``
    responses each with the policy in eval mode and no gradient, decode the texts (``decode``).

    Returns the batch ``generate`` returns plus ``prompt_text`` and ``response_text``. A sharded (FSDP2)
    policy should be gathered around the call (``rlbits.distributed.parallelize.unsharded``), so decoding
    runs no collective per token.
    """
    device = next(policy.parameters()).device
    prompts_td = tokenize_prompts(tokenizer, list(prompts)).to(device)
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            batch = generate(
                policy,
                prompts_td,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                num_samples=num_samples,
                generator=generator,
                logits_processor=logits_processor,
                compile=compile,
                pack_weights=pack_weights,
            )
    finally:
        policy.train(was_training)
    return decode(batch, tokenizer)
