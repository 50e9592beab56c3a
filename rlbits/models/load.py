"""Hugging Face causal LMs in and out of local folders, and the frozen reference policy.

Only local folders are read: nothing is downloaded (a hub name such as ``"gpt2"`` that is not a folder is an
error). Weights are written and read as safetensors only: a folder holding only pickle weights
(``pytorch_model.bin``, ``*.pt``) is refused, because unpickling can run code. Code shipped in a model folder
runs only with ``trust_remote_code=True``. Every load checks the folder before transformers sees it, so a
wrong path gives an error that names the path and what was found there.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from rlbits._io import atomic_folder  # re-exported: rlbits.models.load.atomic_folder


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """A checkpoint folder, or its ``config.json``, is missing. Both a FileNotFoundError and a ValueError."""


def check_folder(path: str | os.PathLike, what: str = "checkpoint") -> Path:
    """Return ``path`` as a Path if it is a folder holding ``config.json``; else raise.

    Raises:
        CheckpointNotFoundError: the folder does not exist (or is a file), or has no ``config.json``.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointNotFoundError(
            f"{what} folder {str(path)!r} does not exist (rlbits loads local folders only and downloads "
            "nothing; save a model there with save_pretrained first)"
        )
    if not p.is_dir():
        raise CheckpointNotFoundError(f"{what} path {str(path)!r} is a file, not a folder")
    if not (p / "config.json").is_file():
        found = sorted(x.name for x in p.iterdir())[:10]
        raise CheckpointNotFoundError(
            f"{what} folder {str(path)!r} has no config.json (found: {found or 'nothing'}); "
            "it is not a Hugging Face model folder"
        )
    return p


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def check_safetensors(path: str | os.PathLike, what: str = "checkpoint") -> Path:
    """Return ``path`` as a Path if its weights are safetensors (``*.safetensors``, or a sharded index).

    Raises:
        ValueError: the folder has no safetensors weights (pickle weights such as ``pytorch_model.bin`` are
            not loaded: unpickling a file can run arbitrary code). The message says how to convert a trusted
            folder.
    """
    p = Path(path).expanduser()
    if any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file():
        return p
    pickles = sorted(x.name for x in p.iterdir() if x.name.endswith(PICKLE_SUFFIXES))
    found = f"only pickle weights {pickles}" if pickles else "no weight file"
    raise ValueError(
        f"{what} folder {str(path)!r} has no safetensors weights ({found}); rlbits loads safetensors only, "
        "since unpickling a file can run code. If you trust the folder, convert it once: "
        "AutoModelForCausalLM.from_pretrained(path).save_pretrained(path) (transformers writes safetensors)"
    )


def _is_causal_lm(config) -> tuple[bool, str]:
    """Whether ``config`` describes a causal LM, and what it describes instead."""
    if getattr(config, "is_encoder_decoder", False):
        return False, f"an encoder-decoder model (model_type {config.model_type!r})"
    auto_map = getattr(config, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map:
        return True, ""
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return False, f"model_type {config.model_type!r}, which has no causal-LM class in transformers"
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a in causal for a in archs):
        return False, f"architectures {archs} (no language-modelling head for next-token prediction)"
    return True, ""


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype must be a torch.dtype, a name such as 'bfloat16', 'auto' or None; got {dtype!r}")


def load_policy(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load any ``AutoModelForCausalLM`` from a local folder.

    Args:
        path: folder written by ``save_pretrained`` (ours or transformers').
        dtype: parameter dtype; None gives float32, ``"auto"`` the checkpoint's own dtype.
        device: where to put the model; None leaves it on CPU.
        attn_implementation: ``"eager"``, ``"sdpa"``, ...; None takes transformers' default (``"sdpa"``
            where supported). Both give left-padded rows the logits of unpadded ones up to rounding.
        trust_remote_code: run model code shipped in the folder (only for folders you trust).

    Returns:
        The model in eval mode (dropout off); call ``.train()`` before training if it has dropout.

    Raises:
        CheckpointNotFoundError: the folder or its ``config.json`` is missing.
        ValueError: the config is not a causal LM (e.g. a BERT classifier or a ValueModel backbone), or the
            folder has no safetensors weights; the message names the path and what was found.
    """
    p = check_folder(path, "policy")
    config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code, local_files_only=True)
    ok, found = _is_causal_lm(config)
    if not ok:
        raise ValueError(
            f"config.json in {str(path)!r} describes {found}; load_policy needs a causal LM "
            "(an AutoModelForCausalLM such as GPT2LMHeadModel or LlamaForCausalLM)"
        )
    check_safetensors(p, "policy")
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(
        p,
        config=config,
        dtype=_dtype(dtype),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
        local_files_only=True,
        **extra,
    )
    if device is not None:
        model = model.to(device)
    return model.eval()


def load_tokenizer(
    path: str | os.PathLike,
    *,
    padding_side: str = "left",
    eos_token: str | None = None,
    trust_remote_code: bool = False,
):
    """Load the tokenizer of a local model folder and make it ready for batched RL.

    - ``padding_side`` defaults to ``"left"``: prompts are left-padded (docs/design.md, "The batch").
    - Without a pad token, the EOS token is used as pad. This is safe in rlbits because padding is always
      identified by ``attention_mask`` / ``action_mask``, never by comparing ids with ``pad_token_id``; code
      that finds padding by id would also drop real EOS tokens.
    - Without an EOS token generation cannot stop, so that is an error unless ``eos_token`` names one.

    Args:
        path: folder holding the tokenizer files (``tokenizer.json`` or the model's own format).
        padding_side: ``"left"`` or ``"right"``.
        eos_token: set this token (which must already be in the vocabulary) as EOS.
        trust_remote_code: run tokenizer code shipped in the folder.

    Raises:
        CheckpointNotFoundError: the folder is missing.
        ValueError: no tokenizer files, an unknown ``padding_side``, ``eos_token`` not in the vocabulary, or
            no EOS token at all.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointNotFoundError(f"tokenizer folder {str(path)!r} does not exist or is not a folder")
    try:
        tok = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"no loadable tokenizer in {str(path)!r} ({type(e).__name__}: {e})") from e
    if isinstance(tok, bool) or not hasattr(tok, "convert_tokens_to_ids"):
        raise ValueError(f"no loadable tokenizer in {str(path)!r}")
    tok.padding_side = padding_side
    return prepare_tokenizer(tok, eos_token=eos_token, where=str(path))


def prepare_tokenizer(tokenizer, *, eos_token: str | None = None, where: str = "the tokenizer"):
    """Apply ``load_tokenizer``'s EOS check and pad = EOS fix to an in-memory tokenizer (in place, returned).

    Raises:
        ValueError: ``eos_token`` is not in the vocabulary, or there is no EOS token.
    """
    if eos_token is not None:
        if tokenizer.convert_tokens_to_ids(eos_token) in (None, tokenizer.unk_token_id):
            raise ValueError(f"eos_token {eos_token!r} is not in the vocabulary of {where}")
        tokenizer.eos_token = eos_token
    if tokenizer.eos_token is None:
        raise ValueError(
            f"{where} has no EOS token, so generation could never stop; pass eos_token='<token>' "
            "(a token in its vocabulary) to load_tokenizer, or set tokenizer.eos_token and save it again"
        )
    return pad_with_eos(tokenizer, where)


def pad_with_eos(tokenizer, where: str = "the tokenizer"):
    """Make the EOS token ``tokenizer``'s pad token if it has none (in place; returned).

    Safe in rlbits because padding is always found by ``attention_mask`` / ``action_mask``, never by comparing
    ids with ``pad_token_id`` (code that did would also drop real EOS tokens). ``where`` names the tokenizer in
    the error.

    Raises:
        ValueError: the tokenizer has neither a pad token nor an EOS token.
    """
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"{where} has neither a pad token nor an eos token to pad with; set pad_token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _vocab_mismatch(path, tok, vocab: int) -> str:
    # What ``load_pretrained`` says when the tokenizer has ids past the embedding: which tokens, where they
    # come from, and the two ways to make the folder consistent.
    fields: dict[str, list[str]] = {}
    for field, value in tok.special_tokens_map.items():
        for token in value if isinstance(value, list) else [value]:
            fields.setdefault(str(token), []).append(field)
    added = {i: str(t) for i, t in tok.added_tokens_decoder.items() if i >= vocab}
    parts = []
    if added:
        listed = ", ".join(
            f"id {i} {t!r}" + (f" (its {' / '.join(fields[t])})" if t in fields else "")
            for i, t in sorted(added.items())[:5]
        ) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
        parts.append(
            f"tokens the tokenizer adds to its vocabulary on load: {listed}, from tokenizer_config.json "
            "(its 'added_tokens_decoder' and special-token fields such as 'pad_token') or special_tokens_map.json"
        )
    if len(tok) - vocab > len(added):
        parts.append(
            f"{len(tok) - vocab - len(added)} ids of the tokenizer's own vocabulary (was the model trained with it?)"
        )
    origin = "; and ".join(parts) + ". "
    return (
        f"tokenizer in {str(path)!r} has {len(tok)} tokens but the model's embedding has {vocab} rows: "
        f"ids {vocab} and above would index past the embedding. They are {origin}"
        "To fix the folder, either grow the model to the tokenizer before saving (model = "
        "AutoModelForCausalLM.from_pretrained(path); model.resize_token_embeddings(len(tokenizer)); "
        "model.save_pretrained(path)), or remove the extra tokens from the tokenizer (e.g. set pad_token to an "
        "existing token such as the EOS token, which rlbits does itself when there is none) and save it again."
    )


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    padding_side: str = "left",
):
    """``(load_policy(path, ...), load_tokenizer(path, ...))``, made consistent.

    The model's ``config.pad_token_id`` / ``eos_token_id`` (and its generation config's) are set from the
    tokenizer where the model has none.

    Raises:
        As ``load_policy`` and ``load_tokenizer``; also ValueError if the tokenizer has more ids than the
        model's vocabulary (the embedding would be indexed out of range).
    """
    model = load_policy(
        path,
        dtype=dtype,
        device=device,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )
    tok = load_tokenizer(path, padding_side=padding_side, trust_remote_code=trust_remote_code)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tok) > vocab:
        raise ValueError(_vocab_mismatch(path, tok, vocab))
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = tok.pad_token_id
        if getattr(cfg, "eos_token_id", None) is None:
            cfg.eos_token_id = tok.eos_token_id
    return model, tok


def save_pretrained(model: PreTrainedModel, tokenizer, path: str | os.PathLike) -> Path:
    """Save ``model`` (and ``tokenizer``, unless None) to ``path`` in HF format with safetensors weights.

    The folder is written atomically (see ``atomic_folder``); ``load_pretrained(path)`` or
    ``AutoModelForCausalLM.from_pretrained(path)`` reads it back.

    Returns:
        ``Path(path)``.

    Raises:
        TypeError: ``model`` has no ``save_pretrained`` (not a transformers model).
        ValueError: as ``atomic_folder``.
    """
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    with atomic_folder(path) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if not any(tmp.glob("*.safetensors")):
            raise RuntimeError(f"{type(model).__name__}.save_pretrained wrote no safetensors file")
    return Path(path)


def freeze(model: nn.Module) -> nn.Module:
    """Turn off gradients for every parameter and switch to eval mode; returns ``model`` (in place)."""
    model.requires_grad_(False)
    return model.eval()


def reference_policy(policy: nn.Module) -> nn.Module:
    """A frozen deep copy of ``policy``: the reference policy of the KL penalty.

    It shares no storage with ``policy``, so training the policy leaves it unchanged. Make it before
    sharding or compiling the policy (a deep copy of an FSDP-sharded module is not a plain model).
    """
    ref = copy.deepcopy(policy)
    for p in ref.parameters():
        p.grad = None
    return freeze(ref)


def read_json(path: Path, what: str) -> dict:
    """Read a small json side file, with an error that names it."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{what}: {str(path)!r} is missing") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {str(path)!r} is not valid json ({e})") from e


__all__ = [
    "PICKLE_SUFFIXES",
    "CheckpointNotFoundError",
    "check_folder",
    "check_safetensors",
    "freeze",
    "load_policy",
    "load_pretrained",
    "load_tokenizer",
    "prepare_tokenizer",
    "read_json",
    "reference_policy",
    "save_pretrained",
]
