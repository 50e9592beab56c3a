"""Sampling responses from a policy (``generate``), multi-turn episodes with envs (``generate_episodes``),
scoring them (``score``) and serving a reward over HTTP (``reward_server``, ``reward_client``).

``rlbits.rollout.generate`` and ``rlbits.rollout.score`` are the modules; their main functions are
``rlbits.generate`` and ``rlbits.score`` (exporting them here under the same names would hide the modules).
Names load on first use, so ``import rlbits.rollout`` stays cheap."""

from __future__ import annotations

from rlbits._lazy import lazy_exports

_LAZY = {
    # generate
    "StoppingFn": "rlbits.rollout.generate",
    "generate_texts": "rlbits.rollout.generate",
    "stop_strings_stopping": "rlbits.rollout.generate",
    # decoder: the KV cache, prefill and one decode step
    "Decoder": "rlbits.rollout.decoder",
    "cache_kv": "rlbits.rollout.decoder",
    "compiled_decode_step": "rlbits.rollout.decoder",
    "decode_one_token": "rlbits.rollout.decoder",
    "prefill": "rlbits.rollout.decoder",
    "select_rows": "rlbits.rollout.decoder",
    "set_write_column": "rlbits.rollout.decoder",
    "setup_decoder": "rlbits.rollout.decoder",
    "shift_columns": "rlbits.rollout.decoder",
    "write_kv": "rlbits.rollout.decoder",
    # sampling: the next token from logits
    "LogitsProcessor": "rlbits.rollout.sampling",
    "inverse_cdf_sample": "rlbits.rollout.sampling",
    "next_token": "rlbits.rollout.sampling",
    "repetition_penalty_filter": "rlbits.rollout.sampling",
    "top_k_filter": "rlbits.rollout.sampling",
    "top_p_filter": "rlbits.rollout.sampling",
    # multiturn
    "STOP_REASONS": "rlbits.rollout.multiturn",
    "episode_turns": "rlbits.rollout.multiturn",
    "generate_episodes": "rlbits.rollout.multiturn",
    # score
    "accepted_columns": "rlbits.rollout.score",
    "batch_columns": "rlbits.rollout.score",
    "score_texts": "rlbits.rollout.score",
    "check_rewards": "rlbits.rollout.score",
    # reward_errors
    "InvalidRewardError": "rlbits.rollout.reward_errors",
    "RewardError": "rlbits.rollout.reward_errors",
    "RewardServerError": "rlbits.rollout.reward_errors",
    "describe_sample": "rlbits.rollout.reward_errors",
    # reward_client
    "RewardClient": "rlbits.rollout.reward_client",
    # reward_server
    "DEFAULT_MAX_REQUEST_BYTES": "rlbits.rollout.reward_server",
    "JSONServer": "rlbits.rollout.reward_server",
    "RequestError": "rlbits.rollout.reward_server",
    "RewardServer": "rlbits.rollout.reward_server",
    "load_reward": "rlbits.rollout.reward_server",
    "serve": "rlbits.rollout.reward_server",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
