"""Reading a checkpoint without unpickling anything but plain data.

DCP's ``.metadata`` is read with an unpickler that builds only DCP's own metadata classes (``torch.Size``,
dtypes, paths); its non-tensor items (optimizer hyperparameters) with ``torch.load(weights_only=True)``.
``_SafeReader`` and ``_SafePlanner`` plug both into ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from rlbits.distributed.checkpoint.manifest import CheckpointError

_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout (torch.strided) by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
"""What DCP's ``.metadata`` may name besides the classes of ``torch.distributed.checkpoint.metadata`` and the
torch dtypes: recorded from checkpoints of every rlbits model (fp32 and bf16, with AdamW states)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``: builds only the classes it is made of, so a crafted file cannot name a
    function to call (``os.system``) or a class to build."""

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP's metadata")


def read_dcp_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """DCP's metadata file (``.metadata``), unpickled with only DCP's metadata classes allowed.

    Raises:
        CheckpointError: the file is missing, is not a pickle, names anything else (a function, another
            class), or does not hold a ``Metadata``; the message names the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # UnpicklingError, EOFError, ValueError, RecursionError, MemoryError, ...
        raise CheckpointError(f"{str(path)!r} is not DCP metadata: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{str(path)!r} is not DCP metadata: it holds a {type(metadata).__name__}")
    return metadata


class _SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with ``read_metadata`` through ``read_dcp_metadata`` (DCP's own uses
    ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with its non-tensor items (optimizer hyperparameters) read by
    ``torch.load(weights_only=True)`` (DCP's own passes ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

