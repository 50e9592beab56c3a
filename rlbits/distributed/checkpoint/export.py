"""Models out of training as HF folders: ``export_model`` (gathering a sharded model to rank 0) and the
folder writer that checkpoints with ``hf_folders=True`` use."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedModel

from rlbits.distributed.env import DistEnv, barrier
from rlbits.distributed.parallelize import is_sharded
from rlbits.models.load import save_pretrained
from rlbits.models.lora import is_lora, merge_lora


def save_hf_folder(model: nn.Module, path: Path, tokenizer: Any = None, *, owned: bool = False) -> None:
    """Write ``model`` as an HF folder; LoRA adapters are merged first, into a copy unless ``owned`` (the
    caller's throwaway replica), so the folder loads with plain ``from_pretrained``."""
    if is_lora(model):
        model = merge_lora(model if owned else copy.deepcopy(model))
    if isinstance(model, PreTrainedModel):
        save_pretrained(model, tokenizer, path)
    elif hasattr(model, "save_pretrained"):
        model.save_pretrained(str(path), tokenizer=tokenizer)  # ValueModel, ILQLModel
    else:
        raise TypeError(f"cannot checkpoint {type(model).__name__}: it has no save_pretrained method")


def export_model(
    model: nn.Module,
    path: str | Path,
    *,
    tokenizer: Any = None,
    env: DistEnv | None = None,
    build: Callable[[], nn.Module] | None = None,
) -> Path | None:
    """Save ``model`` as an HF folder at ``path`` from rank 0 (collective at world size > 1).

    A model with LoRA adapters (``rlbits.models.lora``) is saved with them merged into its weights (a copy
    is merged; ``model`` keeps its adapters), so the folder is an ordinary HF folder.

    A sharded model's full weights are gathered to rank 0's CPU (``get_model_state_dict(full_state_dict,
    cpu_offload)``) and loaded into ``build()``, an unsharded model of the same architecture on CPU, whose
    ``save_pretrained`` writes the folder.

    Returns:
        ``Path(path)`` on rank 0, None elsewhere.

    Raises:
        ValueError: ``model`` is sharded and no ``build`` was given.
    """
    env = env or DistEnv()
    path = Path(path)
    if is_sharded(model):
        if build is None:
            raise ValueError("export_model of a sharded model needs build=, a factory of an unsharded replica")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.is_main:
            replica = build()
            replica.load_state_dict(full)
            save_hf_folder(replica, path, tokenizer, owned=True)
        barrier(env)
        return path if env.is_main else None
    if env.is_main:
        save_hf_folder(model, path, tokenizer)
    barrier(env)
    return path if env.is_main else None

