"""Freezing the bottom of a causal LM: trlx's ``num_layers_unfrozen``."""

from __future__ import annotations

from torch import nn


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks of a transformers causal LM, bottom first: its submodules whose class is in
    some ``_no_split_modules``.

    Raises:
        ValueError: ``model`` declares no ``_no_split_modules`` block.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}: no _no_split_modules")
    return blocks


def freeze_bottom_layers(model: nn.Module, num_layers_unfrozen: int) -> nn.Module:
    """Freeze (``requires_grad_(False)``) all but the top ``num_layers_unfrozen`` decoder blocks of ``model``,
    in place, as trlx's ``freeze_bottom_causal_layers`` (``trlx/utils/modeling.py``, 3340c2f) does:

    - ``-1``: nothing is frozen;
    - ``0``: every block, the input embeddings and the output layer;
    - ``n > 0``: the blocks below the top ``n`` and the input embeddings (the output layer too when it is
      tied to them). What lies outside the blocks and embeddings (GPT-2's position embeddings, the final
      norm) stays trainable, as in trlx.

    Returns:
        ``model``.

    Raises:
        ValueError: ``num_layers_unfrozen`` is not an int >= -1, or more than the model's blocks; no blocks.
    """
    if isinstance(num_layers_unfrozen, bool) or not isinstance(num_layers_unfrozen, int) or num_layers_unfrozen < -1:
        raise ValueError(f"num_layers_unfrozen must be an int >= -1, got {num_layers_unfrozen!r}")
    if num_layers_unfrozen == -1:
        return model
    blocks = decoder_blocks(model)
    if num_layers_unfrozen > len(blocks):
        raise ValueError(f"num_layers_unfrozen ({num_layers_unfrozen}) is more than the model's {len(blocks)} blocks")
    frozen: list[nn.Module | None] = [*blocks[: len(blocks) - num_layers_unfrozen], model.get_input_embeddings()]
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if num_layers_unfrozen == 0 or tied:
        frozen.append(model.get_output_embeddings())
    for module in frozen:
        if module is not None:
            module.requires_grad_(False)
    return model


__all__ = ["decoder_blocks", "freeze_bottom_layers"]
