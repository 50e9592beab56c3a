"""One rank of a 2-rank PPO run with dynamic sampling, launched by tests/distributed/test_ppo_dynamic_sampling.py.

``python tests/dynsamp_worker.py POLICY OUT`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
set (gloo, a 20 s process-group timeout: ranks that disagree about a collective fail within seconds). Two
scenarios, one after the other, each a 2-step ``ppo.train`` into ``OUT/<scenario>``; each rank writes
``OUT/<scenario>.rank<r>.json`` (``done`` with its metric rows, or ``error`` with the message):

- ``uneven``: every group of rank 0 is informative, only the first of each batch on rank 1: rank 0 is full
  after its first generation batch and joins rank 1's second (with ``reward_subtract_reference``: the
  reference's gathering too);
- ``error``: rank 1's rewards are all equal: every rank raises past ``dynamic_sampling_max_gen_batches``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

RANK = int(os.environ["RANK"])
PROMPTS = ["the plot", "a film", "it was", "my day", "so this", "hello", "we saw", "an end"]


def reward_for(scenario: str):
    def reward(prompts, responses, **_):
        if RANK == 0:
            return [float(i % 2) for i in range(len(responses))]  # every group of 2 informative
        if scenario == "error":
            return [0.0] * len(responses)
        return [float(i == 1) for i in range(len(responses))]  # the first group only: 2 batches per step

    return reward


def main(policy: str, out: str) -> None:
    import torch.distributed as dist

    from rlbits.loops.config import config_from_dict
    from rlbits.loops.ppo import PPOConfig, train
    from rlbits.loops.run import read_metrics

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    for scenario in ("uneven", "error"):
        cfg = config_from_dict(PPOConfig, dict(
            policy=policy, run_dir=str(Path(out) / scenario), device="cpu", max_num_steps=2, num_prompts_per_step=2,
            num_generations_per_prompt=2, max_new_tokens=4, microbatch_size=2, num_minibatches=1, ppo_epochs=1,
            val_period=0, val_at_start=False, val_at_end=False, save_period=0, progress=False, tensorboard=False,
            log_samples=0, seed=0, dynamic_sampling=True, batch_multiplier=1.5, dynamic_sampling_max_gen_batches=6,
            reward_subtract_reference=scenario == "uneven",
        ))
        try:
            train(cfg, reward=reward_for(scenario), prompts=PROMPTS)
            result = {"outcome": "done", "rows": [r for r in read_metrics(cfg.run_dir) if r["step"] > 0]}
        except RuntimeError as e:
            result = {"outcome": "error", "message": str(e)}
        (Path(out) / f"{scenario}.rank{RANK}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
