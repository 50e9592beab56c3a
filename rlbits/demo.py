"""A functional smoke demo: one PPO loss computation, step by step, on a random batch.

Stands in for the main job until the loops land (``rlbits demo``). It needs no download and no GPU.
"""

from __future__ import annotations

import torch

import rlbits


def run_demo(seed: int = 0, batch: int = 4, response_len: int = 6, vocab: int = 11) -> dict[str, float]:
    """Run kl_penalty -> token_rewards -> gae -> ppo_loss + value_loss on random tensors and print each step.

    Returns the scalar results (for tests).
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, response_len, vocab, generator=g, requires_grad=True)
    responses = torch.randint(0, vocab, (batch, response_len), generator=g)
    lengths = torch.randint(1, response_len + 1, (batch,), generator=g)
    action_mask = torch.arange(response_len)[None, :] < lengths[:, None]  # right-padded responses
    logprobs = rlbits.logprobs_from_logits(logits, responses)
    old_logprobs = torch.where(action_mask, logprobs.detach() + 0.05 * torch.randn(logprobs.shape, generator=g), 0)
    ref_logprobs = torch.where(action_mask, logprobs.detach() + 0.1 * torch.randn(logprobs.shape, generator=g), 0)
    values = torch.where(action_mask, torch.randn(batch, response_len, generator=g), 0)
    rewards = torch.randn(batch, generator=g)

    kl = rlbits.kl_penalty(old_logprobs, ref_logprobs, "k3")
    per_token = rlbits.token_rewards(rewards, action_mask, kl=kl, kl_coef=0.05)
    advantages, returns = rlbits.gae(per_token, values, action_mask, gamma=1.0, lam=0.95)
    advantages = rlbits.masked_whiten(advantages, action_mask)
    policy_loss, metrics = rlbits.ppo_loss(logprobs, old_logprobs, advantages, action_mask, clip_eps=0.2)
    critic_loss, _ = rlbits.value_loss(values, values, returns, action_mask)
    policy_loss.backward()

    out = {
        "rewards": rewards.mean().item(),
        "init_policy_kl": rlbits.masked_mean(kl, action_mask).item(),
        "actor_loss": policy_loss.item(),
        "critic_loss": critic_loss.item(),
        "clipfrac": metrics["clipfrac"].item(),
        "grad_norm": logits.grad.norm().item(),
    }
    print(f"batch: {batch} responses of up to {response_len} tokens, lengths {lengths.tolist()}")
    for name, value in out.items():
        print(f"  {name:>15s} = {value:+.4f}")
    return out
