"""A trained reward model seen as a reward function: ``RewardModel(model, tokenizer)(prompts, responses)``.

A sequence-classification model with one label scores the text ``prompt + response``; ``encode_texts`` is how
that text is tokenized, both here and where ``rlbits.loops.reward_model`` trains such a model.
``load_reward_model(folder)`` is what ``rlbits.rollout.score`` uses for a reward given as a folder;
``load_classifier(folder)`` loads a backbone with a new score head to train.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from rlbits.batch import pad_right
from rlbits.models.load import CheckpointNotFoundError, check_safetensors, pad_with_eos


class RewardModel:
    """A sequence-classification model with one label and its tokenizer, called like a reward function.

    ``rm(prompts, responses)`` scores each text ``prompt + response`` (concatenated as is, no separator,
    with the tokenizer's special tokens: ``encode_texts``) and returns the model's logit, float32 [N] on CPU.
    Texts are sorted by length, tokenized and right-padded in microbatches of ``batch_size``, and run without
    gradients; a sample scores the same alone as in any batch (up to float rounding). Where the score is
    read is the model's own convention: a decoder (GPT-2, Llama, Qwen2) reads it at the last token that is
    not ``pad_token_id``, so a pad token inside the decoded text would be misread; an encoder (BERT, MiniLM)
    reads it from its ``[CLS]`` token through its pooler. ``rlbits.loops.reward_model`` trains such models
    on exactly these texts (``prompt + chosen``, or a labelled text) and writes ``RUN_DIR/final/``, a folder
    ``from_pretrained`` loads.

    Args:
        model: e.g. ``AutoModelForSequenceClassification`` with ``config.num_labels == 1``; put into eval mode.
        tokenizer: its tokenizer. If it has no pad token, its eos token is used as pad (set on the tokenizer),
            and the model's ``config.pad_token_id`` is set to the tokenizer's when missing.
        batch_size: texts per forward pass.
        max_length: a longer text keeps its last tokens (the end of the response), so that with its special
            tokens (an encoder's ``[CLS]``/``[SEP]``, a decoder's BOS) it has ``max_length`` tokens; None keeps
            every token.

    Raises:
        ValueError: ``num_labels != 1``, no pad or eos token, the model's and tokenizer's pad ids differ, or a
            bad ``batch_size``/``max_length``.
    """

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int = 8, max_length: int | None = None
    ):
        config = getattr(model, "config", None)
        num_labels = getattr(config, "num_labels", None)
        if num_labels != 1:
            raise ValueError(
                f"model must be a sequence-classification model with num_labels=1 (one score per text), "
                f"got num_labels={num_labels}"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        pad_with_eos(tokenizer)
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
        elif config.pad_token_id != tokenizer.pad_token_id:
            raise ValueError(
                f"model.config.pad_token_id ({config.pad_token_id}) differs from tokenizer.pad_token_id "
                f"({tokenizer.pad_token_id}); the model would read the score at the wrong token"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.name = getattr(config, "_name_or_path", "") or type(model).__name__

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
    ) -> RewardModel:
        """Load model and tokenizer from a local HF folder (``AutoModelForSequenceClassification`` with
        ``num_labels=1`` in its config, ``AutoTokenizer``); nothing is downloaded.

        Raises:
            ValueError: ``path`` is not a folder, has no safetensors weights, or as ``RewardModel``.
        """
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"reward model path {path!r} is not a folder (expected a saved HF model folder)")
        check_safetensors(path, "reward model")
        kwargs = dict(local_files_only=True, trust_remote_code=trust_remote_code)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, use_safetensors=True, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if device is not None:
            model = model.to(device)
        return cls(model, tokenizer, batch_size=batch_size, max_length=max_length)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Save model (safetensors) and tokenizer to ``path`` so ``from_pretrained(path)`` loads them."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        ids = encode_texts(self.tokenizer, texts, self.max_length)
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"text {i} of the call has no tokens to score (empty prompt and response)")
        # Longest first, so a microbatch holds texts of similar length (little padding).
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        rewards = torch.zeros(len(ids), dtype=torch.float32)
        pad = self.tokenizer.pad_token_id
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                input_ids = pad_right([torch.tensor(ids[i], dtype=torch.long) for i in rows], pad)
                attention_mask = pad_right([torch.ones(len(ids[i]), dtype=torch.long) for i in rows], 0)
                logits = self.model(
                    input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
                ).logits
                rewards[rows] = logits[:, 0].float().cpu()
        return rewards


def encode_texts(tokenizer: Any, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text with the tokenizer's special tokens, as a reward model reads it.

    A text longer than ``max_length`` (special tokens included) loses tokens at its start: the end of a
    response decides its score, and an encoder keeps its ``[CLS]`` (the tokenizer truncates on the left,
    then adds the special tokens). ``RewardModel`` scores and ``rlbits.loops.reward_model`` trains through
    this one function, so a trained model sees its texts the same way in both.
    """
    if max_length is None:
        return tokenizer(list(texts))["input_ids"]
    side = tokenizer.truncation_side
    tokenizer.truncation_side = "left"
    try:
        return tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    finally:
        tokenizer.truncation_side = side


def load_classifier(path: str | os.PathLike, device: str | torch.device | None = None) -> tuple[torch.nn.Module, Any]:
    """A reward model to train: ``AutoModelForSequenceClassification(num_labels=1)`` (a new score head from
    the global RNG, in train mode) and its tokenizer from a local folder, on ``device``. A tokenizer without a
    pad token pads with EOS, and the model's ``pad_token_id`` is set to the tokenizer's (decoders read the
    score at the last non-pad token).

    Raises:
        CheckpointNotFoundError: ``path`` is not an HF model folder. ValueError: no safetensors weights.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointNotFoundError(f"model {path!r} is not an HF model folder (no config.json)")
    check_safetensors(path, "reward-model backbone")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    pad_with_eos(tokenizer, f"the tokenizer of {path!r}")
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, local_files_only=True, use_safetensors=True, pad_token_id=tokenizer.pad_token_id
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    if device is not None:
        model = model.to(device)
    return model.train(), tokenizer


@functools.lru_cache(maxsize=1)
def _cached_reward_model(path: str, stamp: tuple) -> RewardModel:
    return RewardModel.from_pretrained(path)


def load_reward_model(path: str | os.PathLike) -> RewardModel:
    """``RewardModel.from_pretrained(path)``, kept for the next call with the same folder until a file in it
    changes (e.g. the reward model was retrained in place); one folder is kept at a time.

    Raises:
        ValueError: as ``RewardModel.from_pretrained``.
    """
    path = os.path.realpath(path)
    stamp = tuple(
        sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in os.scandir(path) if e.is_file())
    )
    return _cached_reward_model(path, stamp)


__all__ = ["RewardModel", "encode_texts", "load_classifier", "load_reward_model"]
