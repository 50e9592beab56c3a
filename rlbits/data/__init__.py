"""Training data that does not come from a rollout: the seeded prompt stream (``stream``), the reward
model's labelled texts and preference pairs (``preferences``), the offline dataset of ILQL (``offline``:
build, store memory-mapped in the run directory, draw batches through a torchrl ``ReplayBuffer``; its
dialogue samples tokenized as trlx's in ``dialogue``) and
torchrl's episodes and conversations as batches (``torchrl_adapter``).

Names load on first use, so ``import rlbits.data`` does not import torchrl until an offline name is used."""

from __future__ import annotations

from rlbits._lazy import lazy_exports

_LAZY = {
    # stream
    "PromptError": "rlbits.data.stream",
    "PromptStream": "rlbits.data.stream",
    "check_prompt_lengths": "rlbits.data.stream",
    "check_prompts": "rlbits.data.stream",
    "read_prompts": "rlbits.data.stream",
    # preferences
    "TEXTS": "rlbits.data.preferences",
    "VAL_SEED": "rlbits.data.preferences",
    "Labelled": "rlbits.data.preferences",
    "Pair": "rlbits.data.preferences",
    "load_reward_data": "rlbits.data.preferences",
    "read_reward_dataset": "rlbits.data.preferences",
    "row_texts": "rlbits.data.preferences",
    "targets": "rlbits.data.preferences",
    "truncate_words": "rlbits.data.preferences",
    # dialogue
    "DialogSegment": "rlbits.data.dialogue",
    "dialogue_start_token": "rlbits.data.dialogue",
    "tokenize_dialogue": "rlbits.data.dialogue",
    "truncate_dialogue": "rlbits.data.dialogue",
    # offline
    "DATASET_DIR": "rlbits.data.offline",
    "DATASET_FILE": "rlbits.data.offline",
    "EpochSampler": "rlbits.data.offline",
    "build_offline_dataset": "rlbits.data.offline",
    "dataset_stats": "rlbits.data.offline",
    "load_or_build_dataset": "rlbits.data.offline",
    "load_tensors": "rlbits.data.offline",
    "next_batch": "rlbits.data.offline",
    "normalize_samples": "rlbits.data.offline",
    "offline_buffer": "rlbits.data.offline",
    "read_dataset": "rlbits.data.offline",
    "save_dataset": "rlbits.data.offline",
    "save_tensors": "rlbits.data.offline",
    "tensorize_dataset": "rlbits.data.offline",
    # torchrl_adapter
    "episode_buffer": "rlbits.data.torchrl_adapter",
    "episode_to_batch": "rlbits.data.torchrl_adapter",
    "history_to_batch": "rlbits.data.torchrl_adapter",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
