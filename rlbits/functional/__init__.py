"""Pure tensor math for RL on language models. Imports torch and einops only (no tensordict, no
torch.distributed)."""

from rlbits.functional.advantages import (
    gae,
    group_normalize,
    next_action_values,
    rloo_baseline,
    token_rewards,
)
from rlbits.functional.ilql import (
    awac_loss,
    cql_loss,
    expectile_loss,
    ilql_logits,
    ilql_targets,
    q_loss,
)
from rlbits.functional.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_penalty
from rlbits.functional.logprobs import entropy_from_logits, logprobs_from_logits
from rlbits.functional.losses import aggregate_loss, ppo_loss, reinforce_loss, value_loss
from rlbits.functional.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlbits.functional.policy_losses import (
    POLICY_LOSSES,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    geo_mean_loss,
    gpg_loss,
    gspo_loss,
    kl_cov_loss,
    sapo_loss,
    vanilla_loss,
)
from rlbits.functional.preference import DPO_LOSS_TYPES, dpo_loss, sequence_logprobs
from rlbits.functional.reward import bradley_terry_loss, pointwise_reward_loss

__all__ = [
    "clip_cov_loss",
    "kl_cov_loss",
    "dro_loss",
    "vanilla_loss",
    "sapo_loss",
    "gspo_loss",
    "gpg_loss",
    "geo_mean_loss",
    "dppo_tv_loss",
    "dppo_kl_loss",
    "cispo_loss",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "adaptive_kl_coef",
    "aggregate_loss",
    "awac_loss",
    "bradley_terry_loss",
    "cql_loss",
    "dpo_loss",
    "entropy_from_logits",
    "expectile_loss",
    "gae",
    "group_normalize",
    "ilql_logits",
    "ilql_targets",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "next_action_values",
    "pointwise_reward_loss",
    "ppo_loss",
    "q_loss",
    "reinforce_loss",
    "rloo_baseline",
    "sequence_logprobs",
    "token_rewards",
    "value_loss",
]
