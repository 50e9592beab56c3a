"""The policy side of decoding: ``setup_decoder`` (small-batch head, KV cache, compiled step), ``prefill``
(the prompts once) and ``decode_one_token`` (one token per row from the cache), for ``rlbits.rollout.generate``.

KV cache: a ``transformers.StaticCache`` allocated up front for ``P + max_new_tokens`` positions when the
model supports it (``_can_compile_fullgraph``), with the attention mask kept as a [B, P + max_new_tokens]
buffer whose future columns are 0. Its layers are ``DecodeLayer``s: rows are views of buffers allocated once
(repeating and dropping rows copy within them, so the tensors keep their addresses), and the eager step's
attention reads only the columns written so far. The compiled step's cache is kept between calls, one per
policy (``_compiled_cache``): its CUDA graphs are recorded on the cache's addresses. Left padding works with
it for GPT-2, Llama and Qwen2 in transformers 5.x (tested against HF ``generate`` and the ``DynamicCache``
path): padding is masked at every step and
positions come from ``position_ids``, not from the cache index. Fixed shapes make the memory predictable
and the step compilable; on CPU the speed is the same as ``DynamicCache`` within 2% (4-layer GPT-2, V =
32k, B = 8 and 32, 32 and 200 new tokens: the LM head dominates). Models without static-cache support use
HF's ``DynamicCache``. The cache goes to the model under the keyword its forward names
(``rlbits.models.forward.cache_argument``: ``cache`` in transformers 5.2x, whose ``past_key_values`` prints a
FutureWarning on every call).

On CPU with at most 64 rows, the decode step of GPT-2/Llama/Mistral/Qwen2/Qwen3 models runs the backbone
and applies the LM head itself to the last position only (see ``_small_batch_head``): the head's own forward
in the eager step, ``(W @ h.T).T`` in the compiled one; the logits agree to float rounding.

For ``generate``'s slots (``max_num_seqs``), the static cache's columns are not positions: ``cache_kv`` reads a
prefill's keys and values, ``write_kv`` copies a prompt's into any cache row before the shared write column,
``shift_columns`` moves the live columns to the front, ``set_write_column`` sets that column.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from rlbits.models.forward import (
    accepts_logits_to_keep,
    cache_argument,
    context_length,
    output_cache,
    position_ids_from_mask,
    split_head,
)

# Most rows for which the decode step applies the LM head itself (see ``_small_batch_head``).
_SMALL_BATCH_HEAD_ROWS = 64
# With ``compile=True`` the static cache's length is rounded up to a multiple of this, so prompt batches of
# different lengths reuse one compiled decode step.
_COMPILE_CACHE_BUCKET = 64


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


@functools.cache
def _decode_layer() -> type:
    """``DecodeLayer``, built once (transformers is imported lazily)."""
    from transformers.cache_utils import StaticLayer

    class DecodeLayer(StaticLayer):
        """A ``StaticLayer`` for ``generate``'s decode loop.

        Rows: ``keys``/``values`` are views of the first rows of buffers allocated once for ``capacity`` rows
        (``full``), so repeating rows for the K samples of a prompt and dropping finished rows
        (``repeat_rows``, ``select_rows``) copy within the buffers instead of allocating new tensors: the
        tensors keep their addresses, which a CUDA graph of the compiled step records (a new address means
        recording it again). A forward of another row count (the prefill) takes that many rows.

        Columns: with ``columns`` set, attention gets the first ``columns`` columns and a mask sized to
        match. The eager decode sets it to the context length before each forward, so a step reads the
        P + t columns written so far, not all P + max_new_tokens: the rest are masked out anyway, and reading
        them cost a long-budget rollout most of its attention time (``benchmarks/RESULTS.md``). The compiled
        step keeps ``columns`` None: one shape for its graph.
        """

        columns: int | None = None
        capacity: int = 0
        full: tuple[torch.Tensor, torch.Tensor] | None = None

        def lazy_initialization(self, key_states, value_states):
            rows = key_states.shape[0]
            self.capacity = max(self.capacity, rows)
            super().lazy_initialization(
                key_states.new_empty((self.capacity, *key_states.shape[1:])),
                value_states.new_empty((self.capacity, *value_states.shape[1:])),
            )
            self.full = (self.keys, self.values)
            self.use_rows(rows)

        def use_rows(self, rows: int) -> None:
            """Views of the buffers' first ``rows`` rows (contents as they are)."""
            keys, values = self.full
            self.keys, self.values, self.batch_size = keys[:rows], values[:rows], rows
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.keys)  # the compiled step updates them in place
                torch._dynamo.mark_static_address(self.values)

        def _put_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Make the first rows ``keys``/``values`` [n, heads, c, head_dim] in their first c columns."""
            n, c = keys.shape[0], keys.shape[2]
            if n > self.capacity:  # more rows than the buffers hold: new, larger ones (zeros: the compiled
                self.capacity = n  # step reads every column, masked, and 0 * NaN would be NaN)
                shape = (n, *self.keys.shape[1:])
                self.full = (self.keys.new_zeros(shape), self.values.new_zeros(shape))
            self.use_rows(n)
            self.keys[:, :, :c].copy_(keys)
            self.values[:, :, :c].copy_(values)

        def repeat_rows(self, k: int, columns: int | None = None) -> None:
            """Row i -> rows i*k .. i*k+k-1, in place; only the first ``columns`` columns (None: all) are
            copied, the written ones."""
            keys, values = self.keys[:, :, :columns], self.values[:, :, :columns]
            self._put_rows(keys.repeat_interleave(k, dim=0), values.repeat_interleave(k, dim=0))

        def select_rows(self, rows: torch.Tensor, columns: int | None = None) -> None:
            """Keep ``rows`` [A] int64, in that order, in place; only the first ``columns`` columns (None: all)
            are copied: a compaction early in a long budget moves a fraction of the cache."""
            keys, values = self.keys[:, :, :columns], self.values[:, :, :columns]
            self._put_rows(keys.index_select(0, rows), values.index_select(0, rows))

        def update(self, key_states, value_states, *args, **kwargs):
            if self.is_initialized and key_states.shape[0] != self.keys.shape[0]:
                if key_states.shape[0] <= self.capacity:
                    self.use_rows(key_states.shape[0])
                else:
                    self.is_initialized = False  # the update below allocates buffers for these rows
            made = (self.keys.dtype, self.keys.device) if self.is_initialized else None
            if made is not None and (key_states.dtype, key_states.device) != made:
                self.is_initialized = False  # the policy changed dtype or device since these buffers were made
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if self.columns is None:
                return keys, values
            return keys[:, :, : self.columns], values[:, :, : self.columns]

        def get_mask_sizes(self, *args, **kwargs):
            kv_length, kv_offset = super().get_mask_sizes(*args, **kwargs)
            return (kv_length if self.columns is None else self.columns), kv_offset

    return DecodeLayer


def _decode_layers(cache, rows: int) -> bool:
    """Make every layer of a ``StaticCache`` a ``DecodeLayer`` for ``rows`` rows (in place), if every layer is
    a plain ``StaticLayer`` (sliding-window and other layers keep their own rows and masks); returns whether
    it did."""
    from transformers.cache_utils import StaticLayer

    layers = list(getattr(cache, "layers", None) or [])
    if not layers or any(type(layer) is not StaticLayer or layer.is_initialized for layer in layers):
        return False
    for layer in layers:
        layer.__class__ = _decode_layer()  # adds no state of its own until its lazy initialization
        # instance attributes from the start: the compiled step's guards check the layer's attribute names
        layer.capacity, layer.columns, layer.full = rows, None, None
    return True


# The compiled step's KV cache, one per policy (dropped with it), kept between ``generate`` calls: its
# CUDA graph records the cache tensors' addresses, and a new cache each rollout would be recorded again.
_compiled_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_cache(policy: torch.nn.Module, cache_len: int, rows: int):
    """The policy's kept cache when it has ``cache_len`` columns and room for ``rows`` rows (reset: nothing
    written), else a new one, kept in its place; None where the model has no static cache."""
    cache = _compiled_caches.get(policy)
    layers = list(getattr(cache, "layers", None) or [])
    if layers and all(layer.max_cache_len == cache_len and layer.capacity >= rows for layer in layers):
        for layer in layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()  # in place: the graph reads it at its address
        return cache
    cache = _make_cache(policy, cache_len)
    if cache is not None and _decode_layers(cache, rows):
        _compiled_caches[policy] = cache
    return cache


def _set_columns(cache, columns: int) -> None:
    """The next forward's attention reads the first ``columns`` columns of every layer."""
    for layer in cache.layers:
        layer.columns = columns


def _repeat_rows(cache, k: int, columns: int | None = None) -> None:
    """Repeat every row of a prefilled KV cache ``k`` times in place (row i -> rows i*k .. i*k+k-1), so
    the K samples of a prompt share one prefill; a ``DecodeLayer`` copies the first ``columns`` columns."""
    from transformers.cache_utils import StaticLayer

    for layer in cache.layers:
        if isinstance(layer, _decode_layer()):
            layer.repeat_rows(k, columns)
        elif isinstance(layer, StaticLayer):
            layer.keys = layer.keys.repeat_interleave(k, dim=0)
            layer.values = layer.values.repeat_interleave(k, dim=0)
            layer.batch_size = layer.keys.shape[0]
            torch._dynamo.mark_static_address(layer.keys)  # the compiled step updates them in place
            torch._dynamo.mark_static_address(layer.values)
        else:
            layer.batch_repeat_interleave(k)


def _select_cache_rows(cache, rows: torch.Tensor, columns: int | None = None) -> None:
    """Keep only ``rows`` [A] int64 of a KV cache, in that order, in place; a ``DecodeLayer`` copies the first
    ``columns`` columns (None: all)."""
    from transformers.cache_utils import StaticLayer

    for layer in cache.layers:
        if isinstance(layer, StaticLayer):
            if not getattr(layer, "is_initialized", True):
                continue
            if isinstance(layer, _decode_layer()):
                layer.select_rows(rows, columns)
                continue
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
            layer.batch_size = layer.keys.shape[0]
            torch._dynamo.mark_static_address(layer.keys)  # the compiled step updates them in place
            torch._dynamo.mark_static_address(layer.values)
        else:
            layer.batch_select_indices(rows)


def select_rows(decoder: Decoder, rows: torch.Tensor, columns: int | None = None) -> None:
    """Keep only ``rows`` [A] int64 (indices into the current rows, ascending) of the decoder's KV cache, so
    the next ``decode_one_token`` runs on A rows (``generate``'s ``continuous_batching`` drops finished rows
    so). ``columns``: how many cache columns hold keys and values (the rest are not copied); None: all. A
    policy that holds a cache of its own besides the one it is passed (``SteeredPolicy`` with a separate
    trunk) has its ``select_cache_rows(rows)`` called too."""
    _select_cache_rows(decoder.cache, rows, columns)
    hook = getattr(decoder.policy, "select_cache_rows", None)
    if hook is not None:
        hook(rows)


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
class Decoder:
    """The policy as the decode loop calls it, and its KV cache (``setup_decoder`` builds it).

    ``split``: ``(backbone, lm_head)`` when the eager step applies the head itself (``_small_batch_head``),
    else None. ``keep_last``: the policy takes ``logits_to_keep``. ``cache_arg``: the keyword its forward
    takes the cache under (``rlbits.models.forward.cache_argument``). ``cache``: the KV cache, a
    ``StaticCache`` of ``cache_len`` positions when ``static``, else None until the prefill returns HF's
    ``DynamicCache``. ``compiled``: ``(step, backbone, head weight, cache keyword)`` of the compiled decode
    step, or None (eager). ``written_columns``: the eager steps' attention reads only the columns written so
    far (``DecodeLayer``).
    """

    policy: torch.nn.Module
    split: tuple[torch.nn.Module, torch.nn.Module] | None
    keep_last: bool
    cache_arg: str
    cache: Any
    cache_len: int
    static: bool
    compiled: tuple[Callable, torch.nn.Module, torch.Tensor, str] | None
    written_columns: bool = False


def _forward_last(decoder: Decoder, input_ids, attention_mask, position_ids) -> torch.Tensor:
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


def setup_decoder(
    policy: torch.nn.Module,
    rows: int,
    total: int,
    device: torch.device,
    compile: bool,
    within_context: bool = True,
) -> Decoder:
    """How the decode loop calls ``policy`` for ``rows`` rows and ``total`` = P + max_new_tokens positions:
    the small-batch head, the KV cache (static where the model supports it), and with ``compile`` the
    compiled step, whose static cache is rounded up to a multiple of ``_COMPILE_CACHE_BUCKET`` (at most the
    model's context unless ``within_context`` is False: the slot decoder's columns are not positions) so
    prompt batches of different lengths reuse one compiled graph."""
    split = _small_batch_head(policy, rows, device)
    compiled = None
    cache_len = total
    # The compiled step applies the head itself, wherever the static cache applies (any row count).
    step_split = split_head(policy) if compile and _make_cache(policy, total) is not None else None
    if step_split is not None:
        cache_len = -(-total // _COMPILE_CACHE_BUCKET) * _COMPILE_CACHE_BUCKET
        limit = context_length(policy) if within_context else None
        cache_len = min(cache_len, limit[1]) if limit is not None else cache_len
        backbone, head = step_split
        compiled = (compiled_decode_step(device.type), backbone, head.weight, cache_argument(backbone))
    if compiled is not None:
        cache = _compiled_cache(policy, cache_len, rows)
        written_columns = False  # one shape for the compiled step's graph
    else:  # the eager steps read only the written columns
        cache = _make_cache(policy, cache_len)
        written_columns = cache is not None and _decode_layers(cache, rows)
    return Decoder(
        policy=policy,
        split=split,
        keep_last=accepts_logits_to_keep(policy),
        cache_arg=cache_argument(split[0] if split is not None else policy),
        cache=cache,
        cache_len=cache_len,
        static=cache is not None,
        compiled=compiled,
        written_columns=written_columns,
    )


def prefill(
    decoder: Decoder, prompts: torch.Tensor, prompt_mask: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """Run the left-padded prompts through the policy once, filling ``decoder.cache``.

    Position ids are ``cumsum(prompt_mask) - 1`` clamped at 0 (``position_ids_from_mask``), so padding
    shifts no position. The K samples of a prompt share its prefill: the logits and the cache rows are
    repeated K times (rows ``i*K .. i*K+K-1`` belong to prompt i).

    Args:
        decoder: from ``setup_decoder``.
        prompts: [B, P] int64, left-padded. prompt_mask: [B, P] bool.
        num_samples: K.

    Returns:
        [B*K, V] float32 logits of each prompt's last position.
    """
    B, P = prompts.shape
    width = decoder.cache_len if decoder.static and not decoder.written_columns else P
    prefill_mask = torch.zeros((B, width), dtype=torch.bool, device=prompts.device)
    prefill_mask[:, :P] = prompt_mask
    if decoder.written_columns:
        _set_columns(decoder.cache, P)
    logits = _forward_last(decoder, prompts, prefill_mask, position_ids_from_mask(prompt_mask))
    if num_samples > 1:
        logits = logits.repeat_interleave(num_samples, dim=0)
        _repeat_rows(decoder.cache, num_samples, P)
    return logits


def decode_one_token(
    decoder: Decoder,
    new_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """Feed one new token per row, ``new_ids`` [B, 1] at ``position_ids`` [B, 1], through the policy and its
    cache; returns the next [B, V] float32 logits. ``attention_mask`` [B, cache_len] covers the cache, of
    which the eager step reads the first ``length`` columns (the written ones; the compiled step reads all)."""
    if decoder.compiled is not None:
        step, backbone, weight, cache_arg = decoder.compiled
        if new_ids.device.type == "cuda":
            # A new replay of the CUDA graph; the last step's logits are no longer read.
            torch.compiler.cudagraph_mark_step_begin()
        # contiguous: the slice's stride is P + max_new_tokens, a new graph for every prompt length
        return step(
            backbone, weight, new_ids.contiguous(), attention_mask, position_ids, decoder.cache, cache_arg
        )
    if decoder.written_columns:
        _set_columns(decoder.cache, length)
    mask = attention_mask if decoder.static and not decoder.written_columns else attention_mask[:, :length]
    return _forward_last(decoder, new_ids, mask, position_ids)


def _static_layers(decoder: Decoder) -> list:
    """The layers of the decoder's ``StaticCache``; ValueError if it has none or a layer of another kind
    (a sliding-window layer keeps a rolling window, which the slot copies below do not handle)."""
    from transformers.cache_utils import StaticLayer

    plain = (StaticLayer, _decode_layer())
    layers = list(getattr(decoder.cache, "layers", None) or []) if decoder.static else []
    if not layers or any(type(layer) not in plain for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers}) or ["none"]
        raise ValueError(
            f"generate(max_num_seqs=...) needs a static KV cache of plain StaticLayer layers; "
            f"{type(decoder.policy).__name__} gives {kinds}"
        )
    return layers


def cache_kv(decoder: Decoder) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the ``(keys, values)`` [rows, heads, cache_len, head_dim] of the decoder's static cache after
    a ``prefill`` (for ``write_kv``)."""
    return [(layer.keys, layer.values) for layer in _static_layers(decoder)]


def write_kv(
    decoder: Decoder,
    rows: torch.Tensor,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    src_rows: torch.Tensor,
    column: int,
    cache_rows: int,
) -> None:
    """Copy the prefilled prompts ``kv`` (per layer ``(keys, values)`` [n, heads, P, head_dim], from
    ``cache_kv``) rows ``src_rows`` [A] int64 into the decoder's cache rows ``rows`` [A] int64 at columns
    ``[column - P, column)``, in place (``generate``'s slots: a new sample takes a slot). The first call
    allocates the cache's tensors, ``cache_rows`` rows. Keys are stored as the model computed them
    (RoPE already applied from ``position_ids``), so they hold at any column."""
    layers = _static_layers(decoder)
    P = kv[0][0].shape[2]
    for layer, (keys, values) in zip(layers, kv, strict=True):
        if not layer.is_initialized:
            batch = cache_rows
            layer.lazy_initialization(
                keys.new_empty((batch, *keys.shape[1:])), values.new_empty((batch, *values.shape[1:]))
            )
        layer.keys[rows, :, column - P : column] = keys.index_select(0, src_rows)
        layer.values[rows, :, column - P : column] = values.index_select(0, src_rows)


def set_write_column(decoder: Decoder, column: int) -> None:
    """Make ``column`` the cache column the next ``decode_one_token`` writes (in place: the compiled step reads
    the static cache's counter at its address)."""
    for layer in _static_layers(decoder):
        layer.cumulative_length.fill_(column)


def shift_columns(decoder: Decoder, start: int, length: int) -> None:
    """Move the cache columns ``[start, start + length)`` of every row to ``[0, length)``, in place, and make
    ``length`` the next write column (``generate``'s slots reuse the front of the cache so)."""
    for layer in _static_layers(decoder):
        layer.keys[:, :, :length] = layer.keys[:, :, start : start + length].clone()
        layer.values[:, :, :length] = layer.values[:, :, start : start + length].clone()
    set_write_column(decoder, length)


__all__ = [
    "Decoder",
    "cache_kv",
    "compiled_decode_step",
    "decode_one_token",
    "prefill",
    "select_rows",
    "set_write_column",
    "setup_decoder",
    "shift_columns",
    "write_kv",
]
