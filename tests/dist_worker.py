"""One PPO or RLOO update on a fixed batch, run by tests/test_dist.py with or without torchrun.

``python tests/dist_worker.py {ppo,rloo} OUT`` takes the update on the whole batch in one process;
``torchrun --nproc_per_node N tests/dist_worker.py {ppo,rloo} OUT`` shards the models (FSDP2) and gives each
rank its B/N rows. Rank 0 writes the updated weights (full tensors) to OUT with ``torch.save``.
"""

from __future__ import annotations

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rlbits.batch import build_batch
from rlbits.distributed.env import init
from rlbits.loops import common, ppo, reinforce
from rlbits.models.forward import critic_values, policy_logprobs
from rlbits.models.heads import ValueModel
from rlbits.models.tiny import tiny_causal_lm

V, B, P, R = 48, 8, 5, 7


def fixed_batch(policy: torch.nn.Module) -> torch.Tensor:
    """B rows with left-padded prompts and ragged responses; logprobs from the policy itself."""
    g = torch.Generator().manual_seed(123)
    prompts = torch.randint(3, V, (B, P), generator=g)
    prompt_len = torch.randint(2, P + 1, (B,), generator=g)
    prompt_mask = torch.arange(P)[None, :] >= (P - prompt_len)[:, None]
    responses = torch.randint(3, V, (B, R), generator=g)
    response_len = torch.randint(1, R + 1, (B,), generator=g)
    action_mask = torch.arange(R)[None, :] < response_len[:, None]
    batch = build_batch(prompts, prompt_mask, responses, action_mask, rewards=torch.randn(B, generator=g))
    with torch.no_grad():
        batch["logprobs"] = policy_logprobs(policy, batch) + 0.05 * torch.randn(B, R, generator=g)
        batch["ref_logprobs"] = batch["logprobs"] - 0.1 * torch.randn(B, R, generator=g).abs()
    batch["advantages"] = torch.where(action_mask, torch.randn(B, R, generator=g), 0.0)
    batch["returns"] = torch.where(action_mask, torch.randn(B, R, generator=g), 0.0)
    batch["loss_mask"] = action_mask.clone()
    return batch


def main(algo: str, out: str) -> None:
    env = init("cpu")
    torch.manual_seed(0)
    policy = common.disable_dropout(tiny_causal_lm("gpt2", V, seed=0)).train()
    batch = fixed_batch(policy)
    rows = slice(env.rank * B // env.world_size, (env.rank + 1) * B // env.world_size)
    if algo == "ppo":
        value_model = common.disable_dropout(ValueModel.from_policy(policy, seed=1)).train()
        with torch.no_grad():
            batch["values"] = critic_values(value_model, batch)
        local = batch[rows]
        cfg = ppo.PPOConfig(
            ppo_epochs=2, num_minibatches=1, microbatch_size=3, clip_eps=0.1, value_clip_eps=0.2,
            entropy_coef=0.01, kl_in_reward=False, kl_loss_coef=0.05, learning_rate=0.5, max_grad_norm=0.5,
        )  # fmt: skip
        policy, value_model = common.prepare(policy, cfg, env), common.prepare(value_model, cfg, env)
        opt_p = torch.optim.SGD(policy.parameters(), lr=cfg.learning_rate)
        opt_v = torch.optim.SGD(value_model.parameters(), lr=cfg.learning_rate)
        ppo.update(policy, value_model, opt_p, opt_v, local, cfg, env, kl_coef=cfg.kl_loss_coef)
        models = {"policy": policy, "value": value_model}
    else:
        cfg = reinforce.ReinforceConfig(
            num_generations_per_prompt=4, num_prompts_per_step=2, ppo_epochs=1, num_minibatches=1,
            microbatch_size=3, kl_loss_coef=0.05, learning_rate=0.5, max_grad_norm=0.5,
        )  # fmt: skip
        policy = common.prepare(policy, cfg, env)
        opt = torch.optim.SGD(policy.parameters(), lr=cfg.learning_rate)
        state = reinforce.State(policy, None, None, opt, torch.Generator(), torch.Generator().manual_seed(1), None)
        reinforce.update(state, batch[rows], cfg, env)
        models = {"policy": policy}
    full = {
        name: get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for name, m in models.items()
    }
    if env.is_main:
        torch.save(full, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
