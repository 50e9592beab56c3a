"""One RLOO update with LoRA adapters on a fixed batch, run by tests/models/test_lora.py with or without torchrun.

``python tests/lora_worker.py OUT`` runs REINFORCE's ``advantages`` and ``update`` on the whole batch of
``dist_worker.fixed_batch`` in one process; ``torchrun --nproc_per_node 2 tests/lora_worker.py OUT`` shards
the LoRA policy with FSDP2 (frozen base weights and trainable adapters in the same blocks) and gives each rank
its half of the rows. The adapters start from random B (not 0), so the adapted policy differs from its base.
Rank 0 writes the updated weights (full tensors) to OUT, and the reference logprobs (the policy with its
adapters disabled) and the base model's logprobs of its rows to OUT with the suffix ``.ref.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from dist_worker import B, K, V, fixed_batch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rlbits.data.stream import PromptStream
from rlbits.distributed.env import init
from rlbits.distributed.parallelize import unsharded
from rlbits.loops import phases, reinforce
from rlbits.loops.optim import make_optimizer
from rlbits.loops.runtime import disable_dropout, prepare, with_lora
from rlbits.models.forward import policy_logprobs
from rlbits.models.tiny import tiny_causal_lm


def main(out: str) -> None:
    env = init("cpu")
    cfg = reinforce.ReinforceConfig(
        num_generations_per_prompt=K, num_prompts_per_step=2, microbatch_size=3, kl_loss_coef=0.05,
        learning_rate=0.05, max_grad_norm=0.5, lora_rank=4,
    )
    policy = disable_dropout(tiny_causal_lm("gpt2", V, seed=0)).train()
    batch = fixed_batch(policy)
    rows = slice(env.rank * B // env.world_size, (env.rank + 1) * B // env.world_size)
    with torch.no_grad():
        base_logprobs = policy_logprobs(policy, batch[rows])
    policy = with_lora(policy, cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # adapters that change the model, so that disabling them shows
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    policy = prepare(policy, cfg, env)
    state = reinforce.State(
        env=env, policy=policy, optimizer=make_optimizer(policy.parameters(), cfg.learning_rate, 0.0),
        sampling_generator=torch.Generator(), minibatch_generator=torch.Generator().manual_seed(1),
        stream=PromptStream(["unused"], seed=0),
    )
    local = batch[rows]
    with phases.reference_model(state) as ref, unsharded(ref), torch.no_grad():
        ref_logprobs = policy_logprobs(ref, local)
    for phase in (reinforce.advantages, reinforce.update):
        local = phase(state, local, cfg)
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        torch.save(full, out)
        torch.save({"ref": ref_logprobs, "base": base_logprobs}, Path(out).with_suffix(".ref.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
