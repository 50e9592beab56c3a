"""One rank of a 2-rank REINFORCE run whose ranks see different data, launched by tests/distributed/test_collectives.py.

``python tests/collective_worker.py SCENARIOS POLICY OUT`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (the test starts both ranks itself, on gloo). ``SCENARIOS`` is a comma-separated list run
one after the other in the same process group, each a short ``reinforce.train`` into ``OUT/<scenario>``;
rank 0 writes ``OUT/<scenario>.done`` after each that finished on every rank. The data differ by rank
wherever a loop branches on them: response lengths always (rank r decodes ``max_new_tokens + 3 r`` tokens),
and per scenario:

- ``dynamic_sampling``: rank 0's groups are all informative, rank 1's never are (issue 29's hang: rank 0 is
  full after the first round, rank 1 draws every round, and trains on its last batch);
- ``overlong``: every response of rank 1 is truncated, none of rank 0's (rank 1's batch is all filtered out);
- ``nonfinite_skip``: a NaN reward on rank 1 only, at step 2, with ``on_nonfinite: skip``;
- ``multiturn``: episodes that end after 1 turn on rank 0 and after 3 on rank 1;
- ``validation``: 3 validation prompts (2 on rank 0, 1 on rank 1), every step;
- ``timeout``: rank 1's reward sleeps past ``collective_timeout_s`` at step 2 (the run must fail, naming the
  step and phase);
- ``hang``: rank 1's reward writes ``OUT/hang.marker`` at step 2 and sleeps (the test sends SIGTERM).

Every scenario but ``timeout`` and ``hang`` initialises the process group itself with a 10 s timeout
(``RLBITS_TEST_PG_TIMEOUT``), so a collective one rank enters alone fails the run within seconds on any
version of the loops, instead of hanging the test.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import sys
import time
import types
from pathlib import Path

RANK = int(os.environ["RANK"])


def reward_for(scenario: str, out: Path):
    calls = {"n": 0}

    def reward(prompts, responses, **_):
        calls["n"] += 1
        n = len(responses)
        if scenario == "dynamic_sampling":  # rank 0: every group of 2 informative; rank 1: none
            return [float(i % 2) if RANK == 0 else 0.0 for i in range(n)]
        if scenario == "nonfinite_skip" and RANK == 1 and calls["n"] == 2:
            return [math.nan] * n
        if scenario in ("timeout", "hang") and RANK == 1 and calls["n"] == 2:
            if scenario == "hang":
                (out / "hang.marker").write_text(str(os.getpid()))
            time.sleep(float(os.environ.get("RLBITS_TEST_SLEEP", "60")))
        return [float(len(r) % 3) for r in responses]

    return reward


class TurnsEnv:
    """An env whose episodes end after ``turns`` policy turns (``done``), each turn rewarded 1."""

    def __init__(self, prompt: str, turns: int) -> None:
        from rlbits.envs.base import StopConditions

        self.turns, self.taken = turns, 0
        self.stop = StopConditions(max_new_tokens=3, max_turns=8)

    def reset(self, prompt):
        from rlbits.envs.base import Observation

        return Observation(text=str(prompt))

    def step(self, action_text, action_ids=None):
        from rlbits.envs.base import Observation, StepResult

        self.taken += 1
        return StepResult(Observation(text=" ok"), reward=1.0, done=self.taken >= self.turns)


def main(scenarios: str, policy: str, out: str) -> None:
    import torch.distributed as dist

    import rlbits.tasks
    from rlbits.loops import phases, reinforce

    out_dir = Path(out)
    plain_rollout = phases.generate_rollout
    plain_get_task = rlbits.tasks.get_task

    def rollout(*args, max_new_tokens, **kw):  # response lengths differ by rank
        return plain_rollout(*args, max_new_tokens=max_new_tokens + 3 * RANK, **kw)

    phases.generate_rollout = rollout
    plain_reinforce_rollout = reinforce.rollout
    for scenario in scenarios.split(","):
        if scenario not in ("timeout", "hang") and not dist.is_initialized():
            timeout = float(os.environ.get("RLBITS_TEST_PG_TIMEOUT", "10"))
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        cfg = reinforce.ReinforceConfig(
            task="arithmetic", policy=policy, run_dir=str(out_dir / scenario), device="cpu", max_num_steps=3,
            num_prompts_per_step=2, num_generations_per_prompt=2, max_new_tokens=3, microbatch_size=2,
            val_period=0, val_at_start=False, val_at_end=False, max_val_samples=2, save_period=0, progress=False,
            tensorboard=False, log_samples=0, seed=0,
        )
        extra: dict = {}
        reinforce.rollout = plain_reinforce_rollout
        rlbits.tasks.get_task = plain_get_task
        if scenario == "dynamic_sampling":
            extra = dict(dynamic_sampling=True, dynamic_sampling_max_gen_batches=3)
        elif scenario == "overlong":
            extra = dict(overlong_filtering=True)

            def truncating(state, batch, cfg):
                out_batch = plain_reinforce_rollout(state, batch, cfg)
                out_batch["truncated"] = out_batch["truncated"].new_full(
                    out_batch["truncated"].shape, RANK == 1
                )
                return out_batch

            reinforce.rollout = truncating
        elif scenario == "nonfinite_skip":
            extra = dict(on_nonfinite="skip")
        elif scenario == "multiturn":
            task = types.SimpleNamespace(
                reward=plain_get_task("arithmetic").reward, prompts=plain_get_task("arithmetic").prompts,
                make_env=lambda prompt, **_: TurnsEnv(prompt, turns=1 + 2 * RANK),
            )
            rlbits.tasks.get_task = lambda name, task=task: task  # Setup.of looks the task up here
        elif scenario == "validation":
            extra = dict(val_period=1, val_at_start=True, val_at_end=True, max_val_samples=3)
        elif scenario == "timeout":
            extra = dict(collective_timeout_s=3.0)
        elif scenario == "hang":
            extra = dict(collective_timeout_s=120.0, stop_grace_s=2.0)
        cfg = dataclasses.replace(cfg, **extra)
        reinforce.train(cfg, reward=reward_for(scenario, out_dir))
        dist.barrier()
        if RANK == 0:
            (out_dir / f"{scenario}.done").write_text("ok\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
