"""One PPO or RLOO step's advantages and update on a fixed batch, run by tests/distributed/test_dist.py with or without
torchrun.

``python tests/dist_worker.py {ppo,rloo,reinforce_plus_plus} OUT [FIELD=JSON ...]`` (REINFORCE's
``adv_estimator``: rloo, or reinforce_plus_plus, whose whitening spans the ranks; config fields to override, e.g.
``pack_sequences=true``; several such cases joined by ``+`` run one after another) runs the phases on the whole
batch in one process;
``torchrun --nproc_per_node N tests/dist_worker.py ALGO OUT`` shards the models (FSDP2) and gives each
rank its B/N rows. The phases are the loops' own (``phase(state, batch, cfg) -> batch``): PPO's
``advantages``, ``update`` and ``kl_control``, REINFORCE's ``advantages`` and ``update``. Rank 0 writes the
updated weights (full tensors) to OUT with ``torch.save`` and the step's logged metrics
(``state.metrics.reduce(env)``, reduced over all ranks) to OUT with the suffix ``.json``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rlbits.batch import build_batch
from rlbits.data.stream import PromptStream
from rlbits.distributed.async_ranks import all_gather_json
from rlbits.distributed.env import init
from rlbits.loops import ppo, reinforce
from rlbits.loops import update as update_engine
from rlbits.loops.runtime import disable_dropout, prepare
from rlbits.models.forward import critic_values, policy_logprobs
from rlbits.models.heads import ValueModel
from rlbits.models.tiny import tiny_causal_lm

V, B, P, R = 48, 8, 5, 7
K = 4  # RLOO group size: each of the 2 ranks holds one whole group


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


def main(algo: str, out: str, overrides: dict | None = None) -> None:
    env = init("cpu")
    balanced = []  # per optimizer step: the tokens of this rank's rows before and after balance_rows
    real_balance_rows = update_engine.balance_rows

    def spy(minibatch, *args, **kwargs):
        out = real_balance_rows(minibatch, *args, **kwargs)
        tokens = lambda td: td["attention_mask"].sum(-1).tolist()  # noqa: E731
        balanced.append({"before": tokens(minibatch), "after": tokens(out[0]), "rows": list(out[1].rows)})
        return out

    update_engine.balance_rows = spy
    torch.manual_seed(0)
    policy = disable_dropout(tiny_causal_lm("gpt2", V, seed=0)).train()
    batch = fixed_batch(policy)
    rows = slice(env.rank * B // env.world_size, (env.rank + 1) * B // env.world_size)
    stream = PromptStream(["unused"], seed=0)  # the batch is given: no prompts are drawn
    if algo == "ppo":
        value_model = disable_dropout(ValueModel.from_policy(policy, seed=1)).train()
        with torch.no_grad():
            batch["values"] = critic_values(value_model, batch)
        cfg = ppo.PPOConfig(
            ppo_epochs=2, num_minibatches=1, microbatch_size=3, clip_eps=0.1, value_clip_eps=0.2,
            entropy_coef=0.01, kl_in_reward=False, kl_loss_coef=0.05, learning_rate=0.5, max_grad_norm=0.5,
            pack_sequences=False,  # the padded update: the reference the packed cases are compared with
        )
        cfg = dataclasses.replace(cfg, **(overrides or {}))
        policy, value_model = prepare(policy, cfg, env), prepare(value_model, cfg, env)
        state = ppo.State(
            env=env, policy=policy, value_model=value_model,
            policy_optimizer=torch.optim.SGD(policy.parameters(), lr=cfg.learning_rate),
            value_optimizer=torch.optim.SGD(value_model.parameters(), lr=cfg.learning_rate),
            sampling_generator=torch.Generator(), minibatch_generator=torch.Generator().manual_seed(1),
            stream=stream, kl_coef=cfg.kl_loss_coef,
        )
        local = batch[rows]
        for phase in (ppo.advantages, ppo.update, ppo.kl_control):
            local = phase(state, local, cfg)
        models = {"policy": policy, "value": value_model}
    else:
        cfg = reinforce.ReinforceConfig(
            adv_estimator=algo, num_generations_per_prompt=K, num_prompts_per_step=2, num_iterations=1, num_minibatches=1,
            microbatch_size=3, kl_loss_coef=0.05, learning_rate=0.5, max_grad_norm=0.5, pack_sequences=False,
        )
        cfg = dataclasses.replace(cfg, **(overrides or {}))
        policy = prepare(policy, cfg, env)
        state = reinforce.State(
            env=env, policy=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=cfg.learning_rate),
            sampling_generator=torch.Generator(), minibatch_generator=torch.Generator().manual_seed(1),
            stream=stream,
        )
        local = batch[rows]
        for phase in (reinforce.advantages, reinforce.update):
            local = phase(state, local, cfg)
        models = {"policy": policy}
    logged = state.metrics.reduce(env)  # every rank: one collective
    update_engine.balance_rows = real_balance_rows
    if cfg.balance_batch:  # per optimizer step, every rank's rows in the update
        logged["_balanced_rows"] = all_gather_json(balanced, env)
    full = {
        name: get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for name, m in models.items()
    }
    if env.is_main:
        torch.save(full, out)
        Path(out).with_suffix(".json").write_text(json.dumps(logged, indent=1))


def cases(argv: list[str]) -> list[tuple[str, str, dict]]:
    """``ALGO OUT [FIELD=JSON ...] [+ ALGO OUT [FIELD=JSON ...]] ...``: several updates in one launch, which
    pays the imports and the process-group start once."""
    out, case = [], []
    for arg in [*argv, "+"]:
        if arg != "+":
            case.append(arg)
            continue
        algo, path, *fields = case
        out.append((algo, path, {k: json.loads(v) for k, v in (a.split("=", 1) for a in fields)}))
        case = []
    return out


if __name__ == "__main__":
    for algo, path, overrides in cases(sys.argv[1:]):
        main(algo, path, overrides)
