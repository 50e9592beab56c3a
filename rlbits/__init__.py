"""rlbits: small composable pieces for reinforcement learning on language models.

- ``rlbits.functional`` (re-exported here): pure tensor kernels - masked statistics, KL estimators,
  GAE, RLOO/GRPO baselines, PPO/REINFORCE/value losses, ILQL pieces.
- ``rlbits.batch``: the TensorDict batch schema and its helpers.
- ``rlbits.text``: prompt strings into the batch's token ids and back (``tokenize_prompts``, ``decode``).
- ``rlbits.rollout``: ``generate`` (sampling with a KV cache), ``generate_episodes`` (token-exact multi-turn
  episodes with ``rlbits.envs``) and ``score`` (rewards).
- ``rlbits.models``: HF checkpoints in and out, value and ILQL heads, LoRA, tiny configs.
- ``rlbits.envs``: environments and tools for multi-turn episodes.
- ``rlbits.data``: the seeded prompt stream and ILQL's offline dataset.
- ``rlbits.distributed``: ranks, reductions, FSDP2 sharding, checkpoints.
- ``rlbits.tasks``: built-in tasks (``sentiment``, ``arithmetic``): prompts, rewards, pretraining corpora.
- ``rlbits.zoo``: the tasks' base models (``rlbits.zoo.base_model("sentiment")``, built on first use).
- ``rlbits.viz``: plots, the notebook dashboard, the rollout browser (``rlbits.viz.Dashboard()``; loaded on first use).

Each subpackage exports its public names (``from rlbits.models import ILQLModel``). The subpackages and the
names from the rollout and model layers load lazily (on first use), so ``import rlbits`` stays fast for
someone who only wants the kernels.
"""

from __future__ import annotations

from rlbits._lazy import lazy_exports
from rlbits.functional import *  # noqa: F403
from rlbits.functional import __all__ as _functional_all

__version__ = "0.1.0"

_LAZY = {
    # rollout
    "generate": "rlbits.rollout.generate",
    "generate_texts": "rlbits.rollout.generate",
    "generate_episodes": "rlbits.rollout.multiturn",
    "score": "rlbits.rollout.score",
    "RewardModel": "rlbits.models.reward",
    "RewardError": "rlbits.rollout.score",
    "score_texts": "rlbits.rollout.score",
    "InvalidRewardError": "rlbits.rollout.score",
    "RewardServerError": "rlbits.rollout.score",
    "RewardClient": "rlbits.rollout.reward_server",
    "RewardServer": "rlbits.rollout.reward_server",
    "serve": "rlbits.rollout.reward_server",
    "policy_logprobs": "rlbits.models.forward",
    "critic_values": "rlbits.models.forward",
    "position_ids_from_mask": "rlbits.models.forward",
    # models
    "load_policy": "rlbits.models.load",
    "load_tokenizer": "rlbits.models.load",
    "load_pretrained": "rlbits.models.load",
    "save_pretrained": "rlbits.models.load",
    "reference_policy": "rlbits.models.load",
    "freeze": "rlbits.models.load",
    "CheckpointNotFoundError": "rlbits.models.load",
    "ValueModel": "rlbits.models.heads",
    "ILQLModel": "rlbits.models.heads",
    "apply_lora": "rlbits.models.lora",
    "adapters_disabled": "rlbits.models.lora",
    "merge_lora": "rlbits.models.lora",
    "is_lora": "rlbits.models.lora",
    "tiny_config": "rlbits.models.tiny",
    "tiny_causal_lm": "rlbits.models.tiny",
    "tiny_tokenizer": "rlbits.models.tiny",
    # tasks
    "get_task": "rlbits.tasks",
    # loops
    "train": "rlbits.loops.api",
    "evaluate": "rlbits.loops.evaluate",
    "sweep": "rlbits.loops.sweep",
}
# The subpackages are attributes too, each imported on first use: ``rlbits.viz.Dashboard()`` works after
# ``import rlbits`` while ``import rlbits`` stays free of matplotlib.
_SUBPACKAGES = (
    "batch", "data", "distributed", "envs", "functional", "loops", "models", "rollout", "tasks", "text", "viz", "zoo",
)
_LAZY.update({name: f"rlbits.{name}" for name in _SUBPACKAGES})

__all__ = [*_functional_all, *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
