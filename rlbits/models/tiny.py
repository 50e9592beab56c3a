"""Tiny randomly initialised causal LMs (GPT-2, Llama, Qwen2) and a character tokenizer for tests and demos.

Nothing here downloads anything: configs are built in code and weights are random (seeded). The token ids
follow one convention across architectures and the tokenizer, so a tiny model and ``tiny_tokenizer`` of the
same ``vocab_size`` fit together:

- ``pad_token_id = 0`` (``PAD_ID``)
- ``bos_token_id = 1`` (``BOS_ID``)
- ``unk_token_id = 2`` (tokenizer only)
- ``eos_token_id = vocab_size - 1``

Attention is ``"eager"`` (the plain reference implementation; override with ``attn_implementation=``). With
left padding and matching ``position_ids``, the real tokens of a padded row give the logits of the unpadded
row up to float rounding (< 2e-6) for all three architectures, with ``"eager"`` and ``"sdpa"`` alike; fully
masked pad rows give no NaN (checked by tests/models/test_models.py).
"""

from __future__ import annotations

import string

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

ARCHS = ("gpt2", "llama", "qwen2")
PAD_ID = 0
BOS_ID = 1
UNK_ID = 2
ATTN_IMPLEMENTATION = "eager"

# Characters of ``tiny_tokenizer`` in id order after the 3 leading specials: digits and arithmetic first (a
# vocabulary of 32 covers the arithmetic task), then lowercase text and punctuation (64 covers those).
CHARS = string.digits + "+-=*/ .\n" + string.ascii_lowercase + ",!?'\":;()" + string.ascii_uppercase


def tiny_config(
    arch: str = "gpt2",
    vocab_size: int = 64,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 128,
    **overrides,
) -> PretrainedConfig:
    """A small config for ``arch`` with the token-id convention of this module.

    Args:
        arch: one of ``"gpt2"``, ``"llama"``, ``"qwen2"``.
        vocab_size: V; must be >= 4 (pad, bos, unk, eos). eos is ``vocab_size - 1``.
        hidden_size: model width; divisible by ``num_heads``.
        num_layers: transformer blocks.
        num_heads: attention heads (Llama/Qwen2 use as many key/value heads: no grouped-query attention
            unless ``num_key_value_heads`` is overridden).
        max_position_embeddings: longest sequence (prompt + response).
        **overrides: any config field, applied last (e.g. ``tie_word_embeddings=False``).

    Returns:
        A ``GPT2Config`` / ``LlamaConfig`` / ``Qwen2Config`` with ``attn_implementation="eager"``, dropout 0
        and ``use_cache=True``.

    Raises:
        ValueError: unknown ``arch``, ``vocab_size < 4``, or ``hidden_size`` not divisible by ``num_heads``.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(map(repr, ARCHS))}, got {arch!r}")
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4 (pad, bos, unk and eos ids), got {vocab_size}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    ids = dict(pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=vocab_size - 1)
    if arch == "gpt2":
        kwargs = dict(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_positions=max_position_embeddings,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
        cls = GPT2Config
    else:
        kwargs = dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=4 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=max_position_embeddings,
            attention_dropout=0.0,
            tie_word_embeddings=True,
            **ids,
        )
        cls = LlamaConfig if arch == "llama" else Qwen2Config
    kwargs["use_cache"] = True
    kwargs.update(overrides)
    config = cls(**kwargs)
    config._attn_implementation = overrides.get("attn_implementation", ATTN_IMPLEMENTATION)
    return config


def tiny_causal_lm(arch: str = "gpt2", vocab_size: int = 64, seed: int = 0, **overrides) -> PreTrainedModel:
    """A randomly initialised causal LM from ``tiny_config(arch, vocab_size, **overrides)``, in eval mode.

    The weights depend only on ``seed`` and the config (the global RNG state is saved and restored, so
    building a model does not disturb the caller's randomness). float32, on CPU.

    Raises:
        ValueError: as ``tiny_config``.
    """
    config = tiny_config(arch, vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    return model.eval()


def tiny_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with ``vocab_size`` ids and the module's special-token convention.

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<unk>``, then the first ``vocab_size - 4`` characters of ``CHARS``
    (digits, ``+-=*/ .``, newline, lowercase,
    punctuation, uppercase), then ``<eos>`` at ``vocab_size - 1``. Characters
    outside the vocabulary map to ``<unk>``. No BOS/EOS is added on encode; ``padding_side`` is ``"left"``
    (prompts are left-padded, see docs/design.md). Built with the ``tokenizers`` library; nothing is downloaded.

    Raises:
        ValueError: ``vocab_size`` < 5 or > ``len(CHARS) + 4``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if not 5 <= vocab_size <= len(CHARS) + 4:
        raise ValueError(f"vocab_size must be in [5, {len(CHARS) + 4}] for tiny_tokenizer, got {vocab_size}")
    tokens = ["<pad>", "<bos>", "<unk>", *CHARS[: vocab_size - 4], "<eos>"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Every character is its own word; the decoder joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        unk_token="<unk>",
        eos_token="<eos>",
        padding_side="left",
    )


__all__ = [
    "ARCHS",
    "ATTN_IMPLEMENTATION",
    "BOS_ID",
    "CHARS",
    "PAD_ID",
    "UNK_ID",
    "tiny_causal_lm",
    "tiny_config",
    "tiny_tokenizer",
]
