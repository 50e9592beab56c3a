"""``async_mode: ranks`` under torchrun (2 CPU ranks: one trainer, one rollout rank; rlbits.loops.staleness):
with the deterministic schedule it trains on the same rows, versions and statistics, to the same weights and
the same checkpointed queue as the 1-process ``async_mode: simulated`` run with the same seeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlbits.distributed.async_ranks import RankRoles, owned_shards
from rlbits.distributed.env import DistEnv
from rlbits.loops import ppo, reinforce
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.staleness import decode_batch, encode_batch, rank_role
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer
from tests.distributed.test_dist import ROOT, _env, metrics, torchrun
from tests.metrics_compare import untimed_by_step

SCRIPT = """
import json, sys
from rlbits.loops import ppo, reinforce
from rlbits.loops.config import config_from_dict


def length_reward(prompts, responses):
    return [float(len(r) % 3) for r in responses]


values = json.loads(sys.argv[1])
resume = values.pop("resume", False)
loop = {"reinforce": (reinforce, reinforce.ReinforceConfig), "ppo": (ppo, ppo.PPOConfig)}[values["loop"]]
loop[0].train(config_from_dict(loop[1], values), reward=length_reward, resume=resume)
"""
LOOPS = {"reinforce": (reinforce, reinforce.ReinforceConfig), "ppo": (ppo, ppo.PPOConfig)}


def length_reward(prompts, responses):
    return [float(len(r) % 3) for r in responses]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", 32, seed=0).save_pretrained(path)
    tiny_tokenizer(32).save_pretrained(path)
    return str(path)


def values(tiny_path, run_dir, loop="reinforce", **overrides):
    out = dict(
        loop=loop, task="arithmetic", policy=tiny_path, run_dir=str(run_dir), max_num_steps=4, num_prompts_per_step=2,
        num_generations_per_prompt=2, max_new_tokens=4, microbatch_size=4, learning_rate=1e-2, max_val_samples=2,
        val_period=0, val_at_start=False, val_at_end=False, save_period=0, progress=False, tensorboard=False,
        cpu_threads=1, log_samples=4, max_staleness=1, device="cpu",
    )
    if loop == "reinforce":
        out["adv_estimator"] = "grpo"
    out.update(overrides)
    return out


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        out.update(load_file(f))
    assert out, list((run_dir / "final").iterdir())
    return out


def _assert_trained_alike(got: Path, want: Path) -> None:
    """The two runs' ``final/`` weights are equal within 1e-5, and moved away from the initial policy."""
    a, b = _weights(got), _weights(want)
    assert a.keys() == b.keys()
    init = tiny_causal_lm("gpt2", 32, seed=0).state_dict()
    assert any(not torch.equal(a[n], init[n]) for n in a if n in init)  # the weights moved
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5)


def _samples(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]


def _queue(run_dir: Path) -> dict:
    step = max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    state = json.loads((run_dir / "checkpoints" / f"step_{step}" / "state.json").read_text())
    return {"rollout_queue": state["rollout_queue"], "stream": state["stream"]}


@pytest.mark.slow
# k = 0 (the turn-taking schedule) is the same code with nothing produced ahead; k = 2 holds two batches ahead
@pytest.mark.parametrize(("loop", "k"), [("reinforce", 1), ("ppo", 1), ("reinforce", 2)])
def test_ranks_mode_equals_the_simulated_run(tiny_path, tmp_path, loop, k):
    sim = tmp_path / "simulated"
    module, cls = LOOPS[loop]
    cfg = values(tiny_path, sim, loop, async_mode="simulated", max_staleness=k)
    module.train(config_from_dict(cls, cfg), reward=length_reward)
    ranks = tmp_path / "ranks"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    cfg = values(tiny_path, ranks, loop, async_mode="ranks", rollout_ranks=1, max_staleness=k)
    torchrun(str(script), json.dumps(cfg), timeout=120)
    got, want = untimed_by_step(metrics(ranks)), untimed_by_step(metrics(sim))
    assert got.keys() == want.keys()
    for step in want:
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert [m["staleness/max"] for m in metrics(ranks) if "staleness/max" in m] == [min(t, k) for t in range(4)]
    trained = [m for m in metrics(ranks) if "staleness/max" in m]
    assert all(m["time/trainer_idle"] >= 0 and m["time/rollout_idle"] >= 0 for m in trained)
    assert [r["policy_version"] for r in _samples(ranks)][-1] == 3 - k  # step 4 (t = 3) trains version 3 - k
    assert _samples(ranks) == _samples(sim)
    assert _queue(ranks) == _queue(sim)
    _assert_trained_alike(ranks, sim)


@pytest.fixture(scope="module")
def simulated_6(tiny_path, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("simulated_6")
    cfg = values(tiny_path, run_dir, async_mode="simulated", max_num_steps=6, save_period=2)
    reinforce.train(config_from_dict(reinforce.ReinforceConfig, cfg), reward=length_reward)
    return run_dir


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1], ids=["trainer", "rollout"])
def test_kill_9_of_either_rank_resumes_to_the_uninterrupted_run(tiny_path, tmp_path, simulated_6, victim):
    """kill -9 the trainer or the rollout rank after the step-2 checkpoint: torchrun --max-restarts restarts
    both, the trainer resumes from the checkpoint and sends the rollout rank the weights and its position;
    the run logs, trains on and ends with what the uninterrupted simulated run does (no row lost or
    trained twice)."""
    run_dir = tmp_path / "ranks"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    cfg = values(tiny_path, run_dir, async_mode="ranks", rollout_ranks=1, max_num_steps=6, save_period=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           str(script), json.dumps(cfg)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
    killed = None
    try:
        deadline = time.time() + 120
        while killed is None and time.time() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "step_2").is_dir():
                children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
                victims = [int(c) for c in children if _rank_of(int(c)) == victim]
                if victims:
                    os.kill(victims[0], signal.SIGKILL)
                    killed = victims[0]
            time.sleep(0.05)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "never saw the step-2 checkpoint and the rank to kill"
    assert proc.returncode == 0, output[-6000:]
    assert "SIGKILL" in output or "-9" in output, output[-3000:]  # torchrun saw the kill and restarted
    got, want = untimed_by_step(metrics(run_dir)), untimed_by_step(metrics(simulated_6))
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert _samples(run_dir) == _samples(simulated_6)
    assert _queue(run_dir) == _queue(simulated_6)
    a, b = _weights(run_dir), _weights(simulated_6)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5)


def test_ranks_mode_refuses_what_is_not_built(tiny_path, tmp_path):
    def cfg(**o):
        return config_from_dict(reinforce.ReinforceConfig, values(tiny_path, tmp_path, **o))

    with pytest.raises(ConfigError, match="rollout_ranks"):
        cfg(async_mode="ranks")
    with pytest.raises(ConfigError, match="rollout_ranks"):
        cfg(async_mode="simulated", rollout_ranks=1)
    with pytest.raises(ConfigError, match=r"rollout_ranks >= 1 \(the ranks that only generate; at most the trainer"):
        cfg(async_mode="ranks", rollout_ranks=0)
    # rollout_ranks: 2 is checked against the world size at launch
    assert cfg(async_mode="ranks", rollout_ranks=2).rollout_ranks == 2
    with pytest.raises(ConfigError, match="torchrun"):  # one process: no rollout rank (train's first call)
        rank_role(cfg(async_mode="ranks", rollout_ranks=1))
    assert rank_role(cfg(async_mode="simulated")) == "off"
    with pytest.raises(ConfigError, match="critic_server"):
        ppo_values = values(tiny_path, tmp_path, "ppo", async_mode="ranks", rollout_ranks=1)
        config_from_dict(ppo.PPOConfig, {**ppo_values, "critic_server": "http://localhost:1"})


@pytest.fixture(scope="module")
def colocated_3(tiny_path, made_once):
    """A colocated 2-rank ``async_mode: simulated`` run (k = 1) of 3 steps."""

    def make(folder: Path) -> None:
        (folder / "run.py").write_text(SCRIPT)
        cfg = values(tiny_path, folder / "run", async_mode="simulated", max_num_steps=3)
        torchrun(str(folder / "run.py"), json.dumps(cfg), timeout=120)

    return made_once("async_colocated_3", make) / "run"


@pytest.mark.slow
def test_two_trainer_ranks_equal_the_colocated_two_rank_simulated_run(tiny_path, tmp_path, colocated_3):
    """World size 3: two trainer ranks (FSDP2 over their own group) and the rollout rank, which produces
    each batch as two shards, shard r as rank r of a colocated 2-rank run would (its slice of the same
    prompt draw, its own sampling generator). So the run equals the colocated 2-rank ``async_mode: simulated``
    run with the same seeds (not a 1-process run: rank 1 samples with its own generator): the same metrics,
    rows (rank 0's, which the samples log shows), versions, queue and weights."""
    ranks = _two_trainer_run(tiny_path, tmp_path, colocated_3, rollout_ranks=1, timeout=120)
    assert [r["policy_version"] for r in _samples(ranks)][-1] == 1


def _two_trainer_run(tiny_path, tmp_path, colocated, rollout_ranks: int, timeout: int):
    """Run 2 trainer ranks and ``rollout_ranks`` rollout ranks for 3 steps (reinforce, k = 1) and check the run
    against the colocated 2-rank simulated run ``colocated``: metrics within 1e-5, staleness, samples, the
    checkpointed queue and the weights. Returns its run folder."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    ranks = tmp_path / "ranks"
    cfg = values(tiny_path, ranks, async_mode="ranks", rollout_ranks=rollout_ranks, max_num_steps=3)
    torchrun(str(script), json.dumps(cfg), nproc=2 + rollout_ranks, timeout=timeout)
    got, want = untimed_by_step(metrics(ranks)), untimed_by_step(metrics(colocated))
    assert got.keys() == want.keys() == {1, 2, 3}
    for step in want:
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert [m["staleness/max"] for m in metrics(ranks)] == [0, 1, 1]
    assert _samples(ranks) == _samples(colocated)
    _assert_same_queue(_queue(ranks), _queue(colocated))
    _assert_trained_alike(ranks, colocated)
    return ranks


def _assert_same_queue(queue: dict, colocated: dict) -> None:
    """The final checkpoint (step 3; DCP over the trainers' group): every trainer's queue holds both shards of
    B_3, as every colocated rank's does. The sampler's logprobs agree to rounding only: a rollout rank samples
    with an unsharded copy, colocated rank 1 with its FSDP-gathered policy."""
    assert queue["rollout_queue"]["produced"] == 4 and queue["rollout_queue"]["shards"] == 2
    assert len(queue["rollout_queue"]["pending"]) == 2
    for mine, theirs in zip(queue["rollout_queue"].pop("pending"), colocated["rollout_queue"].pop("pending"), strict=True):
        a, b = decode_batch(mine.pop("batch")), decode_batch(theirs.pop("batch"))
        torch.testing.assert_close(a.pop("logprobs"), b.pop("logprobs"), rtol=1e-5, atol=1e-6)
        assert mine == theirs and encode_batch(a) == encode_batch(b)
    assert queue == colocated


@pytest.mark.slow
def test_a_colocated_two_rank_simulated_run_resumes_exactly(tiny_path, tmp_path, colocated_3):
    """Each rank trains on its own shard of a batch sampled k steps earlier; the checkpoint (rank 0's
    state.json) holds every rank's shard, so after a resume rank 1 trains on its own rows, not rank 0's."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    cfg = values(tiny_path, run_dir, async_mode="simulated", max_num_steps=2)
    torchrun(str(script), json.dumps(cfg), timeout=120)
    assert _queue(run_dir)["rollout_queue"]["shards"] == 2
    torchrun(str(script), json.dumps({**cfg, "max_num_steps": 3, "resume": True}), timeout=120)
    got, want = untimed_by_step(metrics(run_dir), 3), untimed_by_step(metrics(colocated_3), 3)
    assert sorted(got) == [3] and got == want
    a, b = _weights(run_dir), _weights(colocated_3)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_several_trainer_ranks_refuse_dynamic_sampling(tiny_path, tmp_path, monkeypatch):
    """The colocated ranks agree on each extra draw of dynamic sampling; one rollout rank producing their
    shards in turn cannot, so it is refused (before any process group is made) with several trainer ranks."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = values(tiny_path, tmp_path, async_mode="ranks", rollout_ranks=1, dynamic_sampling=True)
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        rank_role(config_from_dict(reinforce.ReinforceConfig, cfg))


def test_rollout_rank_j_owns_the_shards_r_with_r_mod_R_equal_to_j():
    assert owned_shards(0, 1, 1) == (0,)
    assert owned_shards(0, 3, 1) == (0, 1, 2)
    assert [owned_shards(j, 5, 2) for j in range(2)] == [(0, 2, 4), (1, 3)]
    assert [owned_shards(j, 3, 3) for j in range(3)] == [(0,), (1,), (2,)]
    for trainers in range(1, 6):  # every shard has exactly one owner
        for rollouts in range(1, trainers + 1):
            owned = [r for j in range(rollouts) for r in owned_shards(j, trainers, rollouts)]
            assert sorted(owned) == list(range(trainers)), (trainers, rollouts)
    with pytest.raises(ValueError, match="3 rollout ranks for 2 trainer ranks.*cannot be split"):
        owned_shards(0, 2, 3)
    with pytest.raises(ValueError, match="rollout_index"):
        owned_shards(2, 4, 2)
    # world 5 = 3 trainer ranks + 2 rollout ranks (world ranks 3 and 4): both sides read the same ownership
    roles = RankRoles(0, 5, (3, 4), None, (0, 1, 2), DistEnv(0, 3, 0, torch.device("cpu")))
    assert [roles.shards_of(r) for r in roles.rollout_ranks] == [(0, 2), (1,)]
    assert [roles.owner_of(r) for r in roles.trainer_ranks] == [3, 4, 3]


def test_ranks_mode_on_cuda_sends_host_messages_over_gloo_and_device_weights_over_nccl(monkeypatch):
    """On CUDA the ranks mode's process group carries both kinds of tensor: its messages are host bytes
    (gloo) and its weights device tensors (NCCL); a colocated run keeps plain NCCL, and CPU runs gloo. The
    GPU path itself is not run here (no GPU in CI)."""
    from rlbits.distributed import async_ranks
    from rlbits.distributed.env import _backend

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _backend(cuda, cpu_collectives=True) == "cpu:gloo,cuda:nccl"
    assert _backend(cuda) == "nccl"
    assert _backend(cpu, cpu_collectives=True) == _backend(cpu) == "gloo"
    seen = {}

    def fake_init(device, timeout_s=None, cpu_collectives=False):
        seen.update(device=device, cpu_collectives=cpu_collectives)
        raise RuntimeError("stop before any process group")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(async_ranks, "init", fake_init)
    with pytest.raises(RuntimeError, match="stop before"):
        async_ranks.split_ranks(1, "cuda")
    assert seen == {"device": "cuda", "cpu_collectives": True}


def test_more_rollout_ranks_than_trainer_ranks_are_refused(tiny_path, tmp_path, monkeypatch):
    """A shard is one colocated trainer rank's draw: with R > T some rollout rank would have no whole shard,
    so it is refused (before any process group is made), naming both numbers."""
    monkeypatch.setenv("WORLD_SIZE", "5")
    cfg = values(tiny_path, tmp_path, async_mode="ranks", rollout_ranks=3)
    with pytest.raises(ConfigError, match=r"rollout_ranks: 3 with 2 trainer ranks \(world size 5\).*cannot be split"):
        rank_role(config_from_dict(reinforce.ReinforceConfig, cfg))


def test_partial_rollouts_of_a_multi_turn_task_are_refused_before_the_ranks_split(tiny_path, tmp_path):
    """A multi-turn task's episodes are not one generate call: ``partial_rollouts`` is refused on every rank
    before any of them waits on another (not at the rollout rank's first batch)."""
    cfg = values(tiny_path, tmp_path, task="calculator", async_mode="ranks", rollout_ranks=1,
                 async_schedule="eager", partial_rollouts=True)
    with pytest.raises(ConfigError, match="task 'calculator' is multi-turn"):
        rank_role(config_from_dict(reinforce.ReinforceConfig, cfg))


@pytest.mark.slow
def test_two_rollout_ranks_equal_the_colocated_two_rank_simulated_run(tiny_path, tmp_path, colocated_3):
    """World size 4: two trainer ranks and two rollout ranks, rollout rank j producing shard j of every batch
    (one message per rollout rank and batch; every trainer merges them in trainer-rank order). The run equals
    the colocated 2-rank ``async_mode: simulated`` run, as the one-rollout-rank run does."""
    ranks = _two_trainer_run(tiny_path, tmp_path, colocated_3, rollout_ranks=2, timeout=180)
    assert all(m["time/rollout_idle"] >= 0 for m in metrics(ranks))
    assert sorted(p.name for p in ranks.iterdir()) == sorted(p.name for p in colocated_3.iterdir())  # rank 0's only


@pytest.mark.slow
def test_eager_schedule_with_partial_rollouts_trains_every_row_once_within_the_bound(tiny_path, tmp_path, simulated_6):
    """``async_schedule: eager`` with ``partial_rollouts`` (1 + 1 ranks, k = 1): which version samples which
    batch depends on timing, but batches are produced in index order from the same prompt stream, so the run
    trains on the prompts of the deterministic run, in the same order (no row lost or trained twice); every
    trained row is at most k versions old (nothing dropped: the rollout rank holding version v produces batches
    up to v + k only)."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "eager"
    # longer responses than the simulated run's (the prompts do not change): the rollout rank is the slower side,
    # so new weights arrive while it decodes
    cfg = values(tiny_path, run_dir, async_mode="ranks", rollout_ranks=1, max_num_steps=6,
                 async_schedule="eager", partial_rollouts=True, max_new_tokens=24)
    torchrun(str(script), json.dumps(cfg), timeout=120)
    trained = [m for m in metrics(run_dir) if "staleness/max" in m]
    assert [m["step"] for m in trained] == list(range(1, 7))
    assert all(m["staleness/max"] <= 1 and m["staleness/dropped_frac"] == 0 for m in trained)
    # tokens sampled after an update are newer than their row's (oldest) version
    assert all(m["staleness/token_mean"] <= m["staleness/mean"] + 1e-6 for m in trained)
    # the rollout rank, never idle here, takes each new version mid-decode (1 per step on this machine)
    assert sum(m.get("staleness/partial_updates", 0) for m in trained) >= 1
    assert all(m["time/trainer_idle"] >= 0 and m["time/rollout_idle"] >= 0 for m in trained)
    got, want = _samples(run_dir), _samples(simulated_6)
    # every row of every step is logged (log_samples = the 4 rows of a step): the prompts trained, in order, are
    # the stream's, each batch once (a lost batch would shift them, a duplicated one repeat a step's prompts)
    assert len(got) == 6 * 4
    assert [(r["step"], r["prompt"]) for r in got] == [(r["step"], r["prompt"]) for r in want]
    assert all(r["step"] - 1 - r["policy_version"] <= 1 for r in got)
    _weights(run_dir)  # the run saved its final weights


def test_eager_schedule_and_partial_rollouts_refuse_other_modes(tiny_path, tmp_path):
    def cfg(**o):
        return config_from_dict(reinforce.ReinforceConfig, values(tiny_path, tmp_path, **o))

    with pytest.raises(ConfigError, match="async_schedule: eager"):
        cfg(async_mode="simulated", async_schedule="eager")
    with pytest.raises(ConfigError, match="partial_rollouts"):
        cfg(async_mode="ranks", rollout_ranks=1, partial_rollouts=True)
    with pytest.raises(ConfigError, match="partial_rollouts"):
        cfg(async_mode="simulated", partial_rollouts=True)
    assert cfg(async_mode="ranks", rollout_ranks=1, async_schedule="eager", partial_rollouts=True).partial_rollouts
