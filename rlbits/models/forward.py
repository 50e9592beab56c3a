"""Teacher-forced forward passes over a generated batch: per-token logprobs and critic values.

Both read the batch layout of docs/design.md (``input_ids = cat(prompts, responses)``: prompts left-padded to
P, responses right-padded to R) and use the position ids ``generate`` used, so that
``policy_logprobs(policy, generate(policy, ...))`` reproduces the sampler's ``logprobs``. The logits at
position ``P - 1 + t`` predict response token ``t``; only those R positions go through the LM head
(``logits_to_keep``), which at R << P saves most of the [B, P + R, V] logits. With ``pack=True`` (or inside
``packed_sequences``) each microbatch runs as bins of its real tokens instead (``policy_logprobs``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from rlbits.functional import entropy_from_logits, logprobs_from_logits
from rlbits.functional.logprobs import logprobs_from_hidden
from rlbits.functional.packing import pack_index, token_budget_partitions

_BATCH_KEYS = ("input_ids", "attention_mask", "responses", "action_mask")
# Model types whose causal-LM logits are exactly ``lm_head(backbone(...).last_hidden_state)`` (no logit
# scaling or soft-capping), so rlbits may apply the output layer itself (``split_head``).
PLAIN_HEAD_MODEL_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3"})


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row: ``cumsum(mask) - 1``, clamped at 0.

    The same rule as HF ``generate`` for left-padded batches, so a padded row gets the positions it would
    have unpadded. Padding positions get 0 (they are masked out anyway).

    Args:
        attention_mask: [B, T] bool or integer, True / 1 on real tokens.

    Returns:
        [B, T] int64.

    Raises:
        ValueError: ``attention_mask`` is not 2-D.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, T] (2-D) but has shape {tuple(attention_mask.shape)}")
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` takes HF's ``logits_to_keep`` (apply the LM head to the last positions only)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` takes its KV cache: ``"cache"`` where the signature has it
    (transformers 5.2x, whose ``past_key_values`` is a deprecated spelling that prints a FutureWarning on
    every call), else ``"past_key_values"`` (earlier transformers, wrappers such as ``SteeredPolicy``)."""
    forward = getattr(getattr(model, "_orig_mod", model), "forward", None)  # a torch.compile'd module's own
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned: ``out.cache`` where the output has that field,
    else ``out.past_key_values`` (read only then: transformers 5.2x logs a deprecation for it)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def context_length(model: torch.nn.Module) -> tuple[str, int] | None:
    """``(config field, n)``: the most positions (prompt plus response tokens) ``model`` takes, or None.

    ``n`` is the first int among the config's ``max_position_embeddings``, ``n_positions`` and ``n_ctx``; the
    config is ``model.config``, else that of ``model.policy`` (a ``ValueModel`` or ``ILQLModel``). None when the
    config names no context length (e.g. a model with relative positions only).
    """
    config = getattr(model, "config", None) or getattr(getattr(model, "policy", None), "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def _is_sharded(module: torch.nn.Module) -> bool:
    """FSDP2 (``fully_shard``) renames the class ``FSDP<Name>`` and turns parameters into DTensors; calling
    a submodule directly would skip the root's unshard hooks."""
    if type(module).__name__.startswith("FSDP"):
        return True
    return any(type(p).__name__ == "DTensor" for p in module.parameters(recurse=False))


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``(backbone, lm_head)`` when ``model``'s logits are exactly ``lm_head(backbone(...).last_hidden_state)``
    and rlbits may apply the output layer itself; else None.

    True for the HF GPT-2 / Llama / Mistral / Qwen2 / Qwen3 causal LMs with a bias-free ``nn.Linear`` head,
    unsharded (under FSDP2 the model's own forward must run).
    """
    if getattr(getattr(model, "config", None), "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = getattr(model, "base_model", model)
    if type(head) is not torch.nn.Linear or head.bias is not None or backbone is model:
        return None
    if _is_sharded(model) or _is_sharded(head) or _is_sharded(backbone):
        return None
    return backbone, head


@contextlib.contextmanager
def sparse_tied_embedding_grad(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block, forward passes through ``model`` give its input embedding a sparse gradient when
    the embedding is tied to the output layer (GPT-2, SmolLM2 and most small LMs); yields whether it did.

    A dense ``nn.Embedding`` backward zero-fills a [V, H] gradient, adds the looked-up rows into it, and
    autograd then adds that to the output layer's dense [V, H] gradient of the same tied weight: one [V, H]
    fill and one [V, H] add per backward, for a gradient that is non-zero in at most B x T rows. With
    ``sparse=True`` the embedding's part is a sparse tensor added onto the output layer's dense gradient,
    so the accumulated ``.grad`` is dense and equal to float rounding (the same sum in another order). On
    SmolLM2-135M (V = 49,152, H = 576: 113 MB per [V, H] tensor) it took a sixth off a backward on one CPU
    thread with glibc's default allocator; with the loops' heap reuse (``cpu_reuse_memory``), where the
    fill no longer page-faults, the GRPO update on 2 threads moved within noise (1.89-1.93 s -> 1.83-1.89
    s), and what stays is one [V, H] temporary fewer. Only for an unsharded model whose tied weight requires
    grad (else nothing changes); the flag is read at forward time, so the block need not cover
    ``backward()``.
    """
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = (
        isinstance(emb, torch.nn.Embedding)
        and head is not None
        and getattr(head, "weight", None) is emb.weight
        and emb.weight.requires_grad
        and not emb.sparse
        and not _is_sharded(model)
    )
    if not (tied and torch.is_grad_enabled()):
        yield False
        return
    emb.sparse = True
    try:
        yield True
    finally:
        emb.sparse = False


@dataclasses.dataclass
class PackedForwards:
    """What a ``packed_sequences`` block saw: ``count`` packed forward passes ran in it."""

    count: int = 0


_PACKING: contextvars.ContextVar[PackedForwards | None] = contextvars.ContextVar("rlbits_packing", default=None)


@contextlib.contextmanager
def packed_sequences(enabled: bool = True) -> Iterator[PackedForwards | None]:
    """Within the block, ``policy_logprobs`` and ``critic_values`` called without ``pack`` run each
    microbatch packed (``pack=True``); yields the block's ``PackedForwards`` (None when not ``enabled``:
    the block changes nothing). The update engine wraps each objective in it (``pack_sequences``)."""
    if not enabled:
        yield None
        return
    seen = PackedForwards()
    token = _PACKING.set(seen)
    try:
        yield seen
    finally:
        _PACKING.reset(token)


def _packing(pack: bool | None) -> bool:
    """Whether to pack: ``pack`` itself, or (None) whether a ``packed_sequences`` block is active; counts
    a packed pass in the block's ``PackedForwards``."""
    seen = _PACKING.get()
    on = seen is not None if pack is None else pack
    if on and seen is not None:
        seen.count += 1
    return on


@functools.cache
def _check_packed_attention() -> None:
    """Packed rows rely on transformers confining attention to each row from restarting position ids
    (``masking_utils.find_packed_sequence_indices``); without it attention would cross rows silently.

    Raises:
        RuntimeError: the installed transformers has no ``find_packed_sequence_indices``.
    """
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "packed forward passes (pack_sequences) need a transformers whose masking_utils has "
            "find_packed_sequence_indices (it reads row boundaries off the position ids); upgrade transformers "
            "or set pack_sequences=False"
        ) from e


# Modules whose packed forward was seen to confine attention to each packed row (``_check_confined``).
_CONFINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_confined(module: torch.nn.Module, call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Once per module: its packed forward ``call(ids [1, 4], position_ids [1, 4]) -> [1, 4, ...]`` keeps each
    packed row to itself. Two bins ``[a, b | c, c]`` and ``[b, a | c, c]`` (positions ``0, 1, 0, 1``) must give
    the second row the same outputs: it cannot see the first. A model whose attention ignores the row
    boundaries (its code does not read them off the position ids) would mix rows silently; this refuses it.
    Under ``torch.no_grad()``, with the same random state for both calls (dropout).

    Raises:
        ValueError: the second row's outputs depend on the first row's tokens.
    """
    if module in _CONFINED:
        return
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    positions = torch.tensor([[0, 1, 0, 1]], device=device)
    outputs = []
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for first in ([1, 2], [2, 1]):
            torch.manual_seed(0)
            ids = torch.tensor([[*first, 3, 3]], device=device)
            outputs.append(call(ids, positions)[:, 2:].float())
    a, b = outputs
    if (a - b).abs().max() > 1e-3 * a.abs().max().clamp(min=1e-6):
        raise ValueError(
            f"{type(module).__name__} attends across packed rows: its outputs for one row change with the tokens "
            "of the row packed before it (its attention does not read row boundaries off the position ids, as "
            "transformers' create_causal_mask does for GPT-2, Llama, Mistral and Qwen2/3); set "
            "pack_sequences=False for this model"
        )
    _CONFINED[module] = True


def _packed_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, action_mask: torch.Tensor, response_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One microbatch packed into bins: ``(ids [n, L], position_ids [n, L], at [M], where [b, R])``.

    The real tokens of the rows (``attention_mask``) go into n bins of L = the longest row's real tokens
    (``rlbits.functional.packing.pack_index``: first-fit decreasing, no padding inside a bin, position ids
    restarting at 0 on each row, filler at a bin's end); ``where`` is ``action_mask`` and ``at`` the index,
    into the flattened [n * L] outputs, of the output that predicts each of its M True entries (the token
    before it, as column ``P - 1 + t`` in the padded layout). Reads the mask on the host (one sync).

    Raises:
        ValueError: an action token whose predicting column (``P - 1 + t``) is padding.
        RuntimeError: transformers cannot confine attention to packed rows (``_check_packed_attention``).
    """
    _check_packed_attention()
    b, t = input_ids.shape
    src, positions, packed_at = pack_index(attention_mask)
    p = t - response_len
    predictor = packed_at[:, p - 1 : p - 1 + response_len]
    where = action_mask.bool()
    if bool((where & (predictor < 0)).any()):
        raise ValueError(
            "an action token follows a padding column (attention_mask False at column P - 1 + t): a packed "
            "forward needs each row's real tokens contiguous up to its last action token"
        )
    ids = torch.where(src >= 0, input_ids.flatten()[src.clamp(min=0)], 0)  # filler: id 0, never read
    return ids, positions, predictor[where], where


def _scatter(where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[b, R]: ``values`` [M] at the True entries of ``where`` [b, R], 0 elsewhere (differentiable)."""
    return torch.zeros(where.shape, dtype=values.dtype, device=values.device).masked_scatter(where, values)


def _packed_logprobs(
    model, split, input_ids, attention_mask, responses, action_mask, r, temperature, head, budget_mb,
    return_entropy, entropy_grad,
):
    """``(logprobs [b, R], entropy [b, R] or None)`` of one microbatch from one packed forward pass: the
    output layer runs on the action tokens only; 0 elsewhere."""
    ids, positions, at, where = _packed_rows(input_ids, attention_mask, action_mask, r)
    tokens = responses[where][None]  # [1, M]
    net = model if split is None else split[0]

    def run(i, p):  # no attention mask: packed; the policy's logits, or the backbone's hidden states
        out = net(input_ids=i, position_ids=p, use_cache=False)
        return out.logits if split is None else out.last_hidden_state

    _check_confined(net, run)
    outputs = run(ids, positions).flatten(0, 1)[at][None]  # [1, M, V] logits or [1, M, H] hidden states
    if split is None:
        lp, ent = _logprobs_and_entropy(outputs, tokens, temperature, return_entropy, entropy_grad)
    else:
        hidden, lm_head = outputs, split[1]
        if choose_head(head, 1, hidden.shape[1], lm_head.weight.shape[0], budget_mb) == "fused":
            lp, ent = logprobs_from_hidden(hidden, lm_head.weight, tokens, temperature, return_entropy=True)
        else:
            logits = torch.nn.functional.linear(hidden[0], lm_head.weight)[None]
            lp, ent = _logprobs_and_entropy(logits, tokens, temperature, return_entropy, entropy_grad)
    return _scatter(where, lp[0]), (_scatter(where, ent[0]) if return_entropy else None)


def _read_batch(batch: Mapping) -> tuple[torch.Tensor, ...]:
    missing = [k for k in _BATCH_KEYS if k not in batch.keys()]
    if missing:
        raise ValueError(f"batch is missing key(s) {', '.join(missing)}; it needs {', '.join(_BATCH_KEYS)}")
    input_ids, attention_mask, responses, action_mask = (batch[k] for k in _BATCH_KEYS)
    if input_ids.dim() != 2 or responses.dim() != 2:
        raise ValueError(
            f"input_ids and responses must be 2-D, got {tuple(input_ids.shape)} and {tuple(responses.shape)}"
        )
    b, t = input_ids.shape
    r = responses.shape[1]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape {tuple(input_ids.shape)}"
        )
    if responses.shape[0] != b or action_mask.shape != responses.shape:
        raise ValueError(
            f"responses {tuple(responses.shape)} and action_mask {tuple(action_mask.shape)} must both be "
            f"[B, R] with B = {b} (the rows of input_ids)"
        )
    if r >= t:
        raise ValueError(
            f"responses has R = {r} columns but input_ids has only {t}; input_ids must be cat(prompts, "
            "responses) with at least one prompt column"
        )
    return input_ids, attention_mask, responses, action_mask


def _microbatches(
    attention_mask: torch.Tensor, microbatch_size: int | None, max_tokens: int | None = None, packed: bool = False
) -> list[slice] | list[torch.Tensor]:
    """The rows of each forward pass: consecutive slices of ``microbatch_size`` rows (None: one pass), or with
    ``max_tokens`` the [b] int64 row indices of each microbatch of ``token_budget_partitions`` over the rows'
    real tokens (``packed``: at most ``max_tokens`` real tokens a pass; padded: rows x longest row). Reads
    the lengths on the host with a budget (one sync).

    Raises:
        ValueError: a bad ``microbatch_size`` or ``max_tokens``, both given, or a row over ``max_tokens``.
    """
    n = attention_mask.shape[0]
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        if microbatch_size is not None:
            raise ValueError(
                f"give microbatch_size ({microbatch_size}) or max_tokens ({max_tokens}), not both: each sets "
                "the rows of a forward pass"
            )
        lengths = attention_mask.bool().sum(-1).tolist()
        parts = token_budget_partitions(lengths, max_tokens, padded=not packed)
        return [torch.tensor(p, dtype=torch.long, device=attention_mask.device) for p in parts]
    if microbatch_size is None:
        return [slice(0, n)]
    if isinstance(microbatch_size, bool) or not isinstance(microbatch_size, int) or microbatch_size < 1:
        raise ValueError(f"microbatch_size must be a positive int or None, got {microbatch_size!r}")
    return [slice(s, s + microbatch_size) for s in range(0, n, microbatch_size)]


def _in_row_order(parts: list[torch.Tensor], microbatches: list[slice] | list[torch.Tensor]) -> torch.Tensor:
    """The microbatches' [b, ...] outputs concatenated back into the batch's row order (differentiable)."""
    out = torch.cat(parts)
    if all(isinstance(mb, slice) for mb in microbatches):
        return out
    return out[torch.argsort(torch.cat(microbatches).to(out.device))]


def _trim(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> tuple[slice, int]:
    """The columns of one microbatch that hold a real token in some row: ``(columns, kept_response_len)``.

    Prompt columns that are padding in every row (on the left) and response columns past the longest
    response (on the right) change nothing for the real tokens (they are masked out, positions come from
    the mask, attention is causal), so they are cut before the forward pass: padding costs nothing.
    The prompt keeps at least its last column (it predicts the first response token). Reads the mask on
    the host (one sync per microbatch).
    """
    t = input_ids.shape[1]
    p = t - response_len
    used = attention_mask.bool().any(dim=0)
    prompt_used = used[: p - 1]
    first = int(prompt_used.int().argmax()) if bool(prompt_used.any()) else p - 1
    resp_used = used[p:]
    kept = response_len - int(resp_used.flip(0).int().argmax()) if bool(resp_used.any()) else 0
    return slice(first, p + kept), kept


def _pad_right(x: torch.Tensor, length: int) -> torch.Tensor:
    return x if x.shape[1] == length else torch.nn.functional.pad(x, (0, length - x.shape[1]))


HEADS = ("auto", "fused", "unfused")
# Default MiB the unfused output layer may use per microbatch under ``head="auto"`` (``choose_head``).
HEAD_MEMORY_BUDGET_MB = 1024.0


def choose_head(head: str, rows: int, response_len: int, vocab: int, budget_mb: float) -> str:
    """``"fused"`` or ``"unfused"``: ``head`` itself unless it is ``"auto"``; then ``"unfused"`` when
    3 x rows x response_len x vocab float32 values (the logits, their log-softmax and their gradient) fit
    ``budget_mb`` MiB. The unfused path is faster where it fits (one matmul fewer in backward; at the
    standard benchmark's size the fused head cost 1.3x, benchmarks/RESULTS.md)."""
    if head != "auto":
        return head
    return "unfused" if 3 * rows * response_len * vocab * 4 <= budget_mb * 2**20 else "fused"


def response_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int
) -> torch.Tensor:
    """Logits that predict the last ``response_len`` tokens of ``input_ids`` in one teacher-forced forward.

    Args:
        model: HF causal LM (returns ``.logits``; takes ``input_ids, attention_mask, position_ids, use_cache``).
        input_ids: [B, P + R] int64, prompts left-padded, responses right-padded.
        attention_mask: [B, P + R] bool.
        response_len: R.

    Returns:
        [B, R, V] logits in the model's dtype; ``[:, t]`` predicts ``input_ids[:, P + t]``.
    """
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    # Positions P-1 .. P+R-1 through the head; the last one predicts past the end and is dropped.
    if accepts_logits_to_keep(model):
        logits = model(**kwargs, logits_to_keep=response_len + 1).logits
    else:
        logits = model(**kwargs).logits[:, -(response_len + 1) :]
    return logits[:, :-1]


def response_hidden(
    backbone: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int
) -> torch.Tensor:
    """Final hidden states that predict the last ``response_len`` tokens: [B, R, H] (positions P-1 .. P+R-2).

    ``backbone`` is the model without its output layer (``split_head``); same positions and mask as
    ``response_logits``.
    """
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    t = input_ids.shape[1]
    return hidden[:, t - response_len - 1 : t - 1]


def _logprobs_and_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, return_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs, entropy or None)`` of [b, R, V] logits. A metric-only entropy comes from the logprobs'
    own chunked pass; one with a gradient from ``entropy_from_logits``, which under grad keeps several
    [b, R, V] float32 copies for backward."""
    if return_entropy and not entropy_grad:
        return logprobs_from_logits(logits, tokens, temperature, return_entropy=True)
    lp = logprobs_from_logits(logits, tokens, temperature)
    return lp, entropy_from_logits(logits, temperature) if return_entropy else None


def _microbatch_logprobs(
    model, split, input_ids, attention_mask, responses, r, temperature, head, budget_mb, return_entropy,
    entropy_grad,
):
    """``(logprobs [b, kept], entropy [b, kept] or None)`` of one microbatch, cut to its real columns."""
    cols, kept = _trim(input_ids, attention_mask, r)
    ids, att, resp = input_ids[:, cols], attention_mask[:, cols], responses[:, :kept]
    if split is None:
        logits = response_logits(model, ids, att, kept)
        return _logprobs_and_entropy(logits, resp, temperature, return_entropy, entropy_grad)
    backbone, lm_head = split
    hidden = response_hidden(backbone, ids, att, kept)
    if choose_head(head, hidden.shape[0], kept, lm_head.weight.shape[0], budget_mb) == "fused":
        # The [b, R, V] logits never exist (see ``logprobs_from_hidden``).
        return logprobs_from_hidden(hidden, lm_head.weight, resp, temperature, return_entropy=True)
    # On 2-D rows: a strided [b, R, H] slice goes to ``bmm`` against a broadcast weight under no_grad
    # (1.35x the time of one ``mm`` at the standard benchmark's size).
    rows = hidden.reshape(-1, hidden.shape[-1])
    logits = torch.nn.functional.linear(rows, lm_head.weight).view(*hidden.shape[:-1], -1)
    return _logprobs_and_entropy(logits, resp, temperature, return_entropy, entropy_grad)


def policy_logprobs(
    model: torch.nn.Module,
    batch: Mapping,
    *,
    temperature: float = 1.0,
    microbatch_size: int | None = None,
    max_tokens: int | None = None,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    head: str = "auto",
    head_memory_budget_mb: float = HEAD_MEMORY_BUDGET_MB,
    pack: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each response token under ``model`` at ``temperature``, teacher-forced.

    ``log softmax(logits_{P-1+t} / T)[responses_t]`` for each response token t, from one forward pass over
    ``input_ids`` with ``attention_mask`` and ``position_ids_from_mask(attention_mask)`` (the positions
    ``generate`` decodes with). Use it for the current policy in the update (differentiable), the old
    policy, or the reference policy (under ``torch.no_grad()``). Dropout follows ``model.training``.

    The output layer, for GPT-2 / Llama / Mistral / Qwen2 / Qwen3 models (``split_head``), by ``head``:
    ``"fused"`` applies it with ``logprobs_from_hidden``, chunk by chunk, so the [b, R, V] logits of a
    microbatch never exist (forward or backward), for one more matmul (the logits are recomputed in
    backward: 1.3x the time of the unfused path at B = 2, R = 1024, V = 32k on 2 CPU threads);
    ``"unfused"`` computes the logits with ``F.linear`` and takes ``logprobs_from_logits``; ``"auto"``
    (default) picks the unfused path when a microbatch's logits, counted three times (logits, their
    log-softmax, their gradient) in float32, fit ``head_memory_budget_mb``, else the fused one
    (``choose_head``). Both give the same values and gradients to float rounding. Other models go
    through their own forward and ``logprobs_from_logits``.

    Each microbatch is cut to its own real columns first (``_trim``): prompt columns that are padding in
    all its rows and response columns past its longest response cost nothing. Sort rows by length
    (``rlbits.batch.split_microbatches(..., sort_by_length=True)``) to make microbatches of similar lengths.

    With gradients, a tied input embedding's gradient is built sparse and added onto the output layer's
    dense one (``sparse_tied_embedding_grad``): no [V, H] zero-fill and add per backward.

    Packed (``pack``): each microbatch's rows are packed without padding into bins as long as its longest row
    (first-fit decreasing, ``rlbits.functional.pack_index``), the position ids restarting at 0 on each row,
    and the model runs with no attention mask, so transformers confines attention to each row (it reads the
    row boundaries off the position ids: a block-diagonal causal mask under ``sdpa``/``eager``, variable-length kernels under ``flash_attention_2``: transformers'
    ``masking_utils.find_packed_sequence_indices``, in the models whose code builds its mask with
    ``create_causal_mask``, as GPT-2, Llama, Mistral and Qwen2/3 do in transformers 5);
    the output layer then runs on the action tokens only. Values and gradients equal the padded pass's to
    float rounding. The matmuls see about the real tokens (plus each bin's unused tail); attention over a bin
    costs at most what one padded row costs, so uniform lengths give the padded layout itself (one row a bin,
    no mask) and a dense block-diagonal mask never grows past [L, L] per bin.

    Microbatching bounds the peak memory of the forward pass under ``torch.no_grad()``. With gradients it
    saves nothing (every microbatch's graph is kept until backward): split the batch yourself and
    accumulate gradients instead.

    Args:
        model: HF causal LM.
        batch: TensorDict (or dict) with ``input_ids`` [B, P + R], ``attention_mask`` [B, P + R],
            ``responses`` [B, R], ``action_mask`` [B, R] (the layout ``generate`` returns).
        temperature: > 0; the temperature the responses were sampled at (1.0 for greedy decoding).
        microbatch_size: rows per forward pass; None for one pass (or ``max_tokens``' passes).
        max_tokens: instead of ``microbatch_size``, microbatches formed by a token budget (verl's
            ``log_prob_max_token_len_per_gpu``): rows balanced by length
            (``rlbits.functional.packing.token_budget_partitions``) into passes of at most this many real
            tokens packed, of at most this many rows x longest row padded; the results in row order.
        return_entropy: also return the entropy of ``softmax(logits / T)`` at each response position.
        entropy_grad: whether that entropy is differentiable (an entropy bonus). False when it is only a
            metric: on the unfused path it then comes out of the logprobs' own chunked pass
            (``logprobs_from_logits(return_entropy=True)``) instead of a differentiable entropy over the whole
            [b, R, V] logits (at the standard benchmark's size 0.11 s of a 0.6 s GRPO update on 2 CPU
            threads); the values agree to float rounding. The fused head's entropy is differentiable either way.
        head: ``"auto"``, ``"fused"`` or ``"unfused"`` (see above).
        head_memory_budget_mb: MiB the unfused head may use per microbatch under ``"auto"``.
        pack: run each microbatch packed (above); None: packed inside a ``packed_sequences`` block.

    Returns:
        logprobs [B, R] float32, 0 where ``action_mask`` is False; with ``return_entropy``,
        ``(logprobs, entropy)``, entropy [B, R] float32 and 0 where ``action_mask`` is False.

    Raises:
        ValueError: a key is missing, shapes disagree, ``temperature <= 0``, a bad ``microbatch_size`` or
            ``max_tokens`` (or both given), a row over ``max_tokens``, an unknown ``head``, or (packed) an
            action token after a padding column.
    """
    input_ids, attention_mask, responses, action_mask = _read_batch(batch)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}; got {head!r}")
    r = responses.shape[1]
    mask = action_mask.bool()
    split = split_head(model)
    packed = _packing(pack)
    microbatches = _microbatches(attention_mask, microbatch_size, max_tokens, packed)
    logps, ents = [], []
    with sparse_tied_embedding_grad(model):
        for mb in microbatches:
            if packed:
                args = (input_ids[mb], attention_mask[mb], responses[mb], action_mask[mb], r, temperature)
                lp, ent = _packed_logprobs(
                    model, split, *args, head, head_memory_budget_mb, return_entropy, entropy_grad
                )
            else:
                args = (input_ids[mb], attention_mask[mb], responses[mb], r, temperature)
                lp, ent = _microbatch_logprobs(
                    model, split, *args, head, head_memory_budget_mb, return_entropy, entropy_grad
                )
            logps.append(_pad_right(lp, r))
            if return_entropy:
                ents.append(_pad_right(ent, r))
    zero = torch.zeros((), device=input_ids.device)
    logprobs = torch.where(mask, _in_row_order(logps, microbatches), zero)
    if return_entropy:
        return logprobs, torch.where(mask, _in_row_order(ents, microbatches), zero)
    return logprobs


def critic_values(
    value_model: torch.nn.Module,
    batch: Mapping,
    *,
    microbatch_size: int | None = None,
    max_tokens: int | None = None,
    pack: bool | None = None,
) -> torch.Tensor:
    """Critic values V(s_t) of the state before each response token t: the value output at ``P - 1 + t``.

    Args:
        value_model: called as ``value_model(input_ids, attention_mask=..., position_ids=...)`` and
            returning [B, P + R] values, one per position (``rlbits.models.heads.ValueModel``).
        batch: TensorDict (or dict) with ``input_ids``, ``attention_mask``, ``responses``, ``action_mask``.
        microbatch_size: rows per forward pass; None for one pass (see ``policy_logprobs`` on gradients).
        max_tokens: instead of ``microbatch_size``, passes formed by a token budget (``policy_logprobs``).
        pack: run each microbatch packed into bins (``policy_logprobs``), ``value_model`` called with
            ``attention_mask=None``; None: packed inside a ``packed_sequences`` block.

    Returns:
        [B, R] float32, 0 where ``action_mask`` is False; differentiable.

    Raises:
        ValueError: a key is missing, shapes disagree, the model returns a tensor that is not [B, P + R]
            ([n, L] packed), a bad ``microbatch_size`` or ``max_tokens`` (or both given), a row over
            ``max_tokens``, or (packed) an action token after a padding column.
    """
    input_ids, attention_mask, responses, action_mask = _read_batch(batch)
    r = responses.shape[1]
    parts = []
    packed = _packing(pack)
    microbatches = _microbatches(attention_mask, microbatch_size, max_tokens, packed)
    if packed:

        def run(i, p):  # no attention mask: packed
            return value_model(i, attention_mask=None, position_ids=p)

        for mb in microbatches:
            ids, positions, at, where = _packed_rows(input_ids[mb], attention_mask[mb], action_mask[mb], r)
            _check_confined(value_model, run)
            values = run(ids, positions)
            if values.shape != ids.shape:
                raise ValueError(
                    f"value_model returned shape {tuple(values.shape)}; expected [n, L] = {tuple(ids.shape)}"
                )
            parts.append(_scatter(where, values.flatten()[at].float()))
        return _in_row_order(parts, microbatches)
    for mb in microbatches:
        cols, kept = _trim(input_ids[mb], attention_mask[mb], r)
        ids, att = input_ids[mb, cols], attention_mask[mb, cols]
        values = value_model(ids, attention_mask=att.long(), position_ids=position_ids_from_mask(att))
        if values.shape != ids.shape:
            raise ValueError(
                f"value_model returned shape {tuple(values.shape)}; expected [B, P + R] = {tuple(ids.shape)}"
            )
        n = ids.shape[1]
        parts.append(_pad_right(values[:, n - kept - 1 : n - 1].float(), r))
    zero = torch.zeros((), device=input_ids.device)
    return torch.where(action_mask.bool(), _in_row_order(parts, microbatches), zero)


__all__ = [
    "HEADS",
    "HEAD_MEMORY_BUDGET_MB",
    "PLAIN_HEAD_MODEL_TYPES",
    "PackedForwards",
    "accepts_logits_to_keep",
    "choose_head",
    "critic_values",
    "packed_sequences",
    "policy_logprobs",
    "position_ids_from_mask",
    "response_hidden",
    "response_logits",
    "sparse_tied_embedding_grad",
    "split_head",
]
