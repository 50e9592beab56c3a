"""Checkpoints for exact resume: models, optimizers, RNG states, counters; at any world size.

One format at every world size (docs/design.md, "Checkpoints"). Layout of ``RUN_DIR/checkpoints/step_N/``::

    dcp/               torch.distributed.checkpoint: every model's weights and every optimizer's state,
                       sharded as trained; loadable at any world size (DCP reshards), also without a process
                       group (a notebook)
    tokenizer/         the policy's tokenizer
    rng/rank_R.pt      each rank's python, numpy, torch (CPU and CUDA) RNG states and the loop's generators
    state.json         the loop state's counters and data positions (step, total_valid_tokens,
                       stream/sampler: consumed_samples, ...), total_steps, world_size
    manifest.json      every file's size and sha256 (``checksums="all"``, ``save_checkpoint``'s default;
                       files of 16 MiB and more as one sha256 per 16 MiB chunk, hashed in parallel), or the
                       sha256 of the files under 1 MiB only (``checksums="small"``, the loops' default
                       ``checkpoint_checksums``); written last
    policy/ value/ ... HF folders (``from_pretrained``), only on request (``hf_folders=True``, world size 1);
                       HF folders are otherwise written at export (``RUN_DIR/final``)

A checkpoint is written into a temporary folder and renamed into place, so a crash leaves either the whole
checkpoint or none. Resuming (``resume_checkpoint``, then ``restore_checkpoint``) tries the checkpoints newest
first and falls back to the previous one, with a warning naming the skipped checkpoint and why, on any
failure to load it: a file missing, torn or failing its checksum, a ``state.json`` field of the wrong type or
range, metadata that is not DCP's, weights of other shapes or dtypes than the models', NaN/inf weights or
optimizer states. Optimizer state dicts are keyed by parameter names (``get_optimizer_state_dict``), so a
checkpoint saved at N ranks resumes at M: weights and optimizer states are resharded; the RNG streams
restart from the seeds when N != M (the run continues, not bit-exactly).

Nothing is unpickled beyond plain data (``safe_read``): DCP's ``.metadata`` is read with an unpickler that
builds only DCP's own metadata classes, its non-tensor items and the RNG states with
``torch.load(weights_only=True)``, JSON with ``json``. The manifest is for integrity, not authenticity (no
key): whoever can write a run directory can still give it other well-formed weights (docs/reliability.md,
"Checkpoints and run files: threat model").

Modules: ``save`` (writing, pruning), ``load`` (loading, falling back), ``manifest`` (the files, their
checksums, finding the newest checkpoint that verifies), ``safe_read`` (the restricted unpickler), ``export``
(HF folders).
"""

from __future__ import annotations

from rlbits.distributed.checkpoint.export import export_model
from rlbits.distributed.checkpoint.load import load_checkpoint, restore_checkpoint
from rlbits.distributed.checkpoint.manifest import (
    CHECKPOINTS,
    CHUNK,
    MANIFEST,
    SMALL_FILE,
    CheckpointError,
    is_rlbits_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resume_checkpoint,
    verify_checkpoint,
)
from rlbits.distributed.checkpoint.safe_read import read_dcp_metadata
from rlbits.distributed.checkpoint.save import discard_checkpoints, save_checkpoint

__all__ = [
    "CHECKPOINTS",
    "CHUNK",
    "MANIFEST",
    "SMALL_FILE",
    "CheckpointError",
    "discard_checkpoints",
    "export_model",
    "is_rlbits_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_dcp_metadata",
    "restore_checkpoint",
    "resume_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
