"""Scaling out: sharding helpers, 1-process vs 2-rank FSDP2 parity, torchrun launches of every loop,
checkpoints that move between world sizes, compile without per-step recompilation, bf16.

The torchrun tests run 2 CPU processes on gloo (marked slow; they still run in CI).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import shard, transformer_blocks, unsharded
from rlbits.models.heads import ILQLModel, ValueModel
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
V = 32


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


# Failures of the launch itself (a port taken by a concurrent test between torchrun's pick and its bind),
# not of rlbits: retried once.
LAUNCH_ERRORS = ("Address already in use", "EADDRINUSE", "connectFullMesh")


def torchrun(*args: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    for attempt in range(2):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
        if out.returncode == 0 or attempt or not any(e in out.stdout + out.stderr for e in LAUNCH_ERRORS):
            break
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def python(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _consumed_samples(run_dir: Path, step: int) -> int:
    """The data position (train prompts drawn, all ranks together) a run's step-``step`` checkpoint saved."""
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "state.json").read_text())["stream"]["consumed_samples"]


# --- sharding helpers, in process ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_transformer_blocks_are_found_in_lms_and_in_the_models_holding_them(arch):
    policy = tiny_causal_lm(arch, V, seed=0)
    n = policy.config.num_hidden_layers
    assert len(transformer_blocks(policy)) == n
    assert len(transformer_blocks(ValueModel.from_policy(policy))) == n
    assert len(transformer_blocks(ILQLModel(policy, shared_trunk=False))) == 2 * n  # policy + its own trunk
    with pytest.raises(ValueError, match="transformer blocks"):
        transformer_blocks(torch.nn.Linear(2, 2))


def test_shard_at_world_size_one_keeps_names_and_gradients_with_activation_checkpointing():
    plain, checkpointed = tiny_causal_lm("gpt2", V, seed=0), tiny_causal_lm("gpt2", V, seed=0)
    shard(checkpointed, DistEnv(), activation_checkpointing=True)
    assert list(plain.state_dict()) == list(checkpointed.state_dict())
    x = torch.randint(0, V, (3, 9))
    for model in (plain, checkpointed):
        model.train()
        model(input_ids=x).logits.square().mean().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad(), unsharded(checkpointed):  # a no-op for an unsharded model
        assert checkpointed(input_ids=x).logits.shape == (3, 9, V)


# --- 1 process with B rows vs 2 FSDP2 ranks with B/2 each ------------------------------------------------

# What each worker's step logs (tests/dist_worker.py runs advantages and update, and PPO's kl_control).
LOGGED = {
    "ppo": {"actor_loss", "advantages", "approx_kl", "clipfrac", "critic_grad_norm", "critic_loss", "entropy",
            "explained_variance", "grad_norm", "init_policy_kl", "kl_loss", "kl_loss_coef", "ratio_mean",
            "response_len", "response_len_max", "returns", "rewards", "rewards_with_kl", "value_clipfrac", "values"},
    "rloo": {"actor_loss", "advantages", "approx_kl", "baseline", "clipfrac", "entropy", "grad_norm",
             "init_policy_kl", "kl_loss", "loss_tokens", "response_len", "response_len_max", "rewards",
             "rewards_with_kl", "truncated_frac"},
}
LOGGED["reinforce_plus_plus"] = LOGGED["rloo"]  # REINFORCE++: the whitening of the returns spans the ranks
ZERO_UP_TO_ROUNDING = {("reinforce_plus_plus", "advantages"): 1e-6}  # the mean of whitened advantages


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "rloo", "reinforce_plus_plus"])
def test_one_update_on_two_fsdp_ranks_equals_one_process(algo, fsdp_updates):
    """The same weights after the update, and the same logged metrics: N ranks log what one process would."""
    one_pt, two_pt = fsdp_updates[algo]
    one, two = (torch.load(f, weights_only=True) for f in (one_pt, two_pt))
    init = tiny_causal_lm("gpt2", 48, seed=0).state_dict()
    moved = max((one["policy"][k] - init[k]).abs().max().item() for k in init)
    assert moved > 1e-3  # the update is large enough for a wrong gradient to show
    for model in one:
        for name, a in one[model].items():
            b = two[model][name]
            assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-8, f"{model}.{name}"
    logged_one, logged_two = (json.loads(f.with_suffix(".json").read_text()) for f in (one_pt, two_pt))
    assert set(logged_one) == set(logged_two) == LOGGED[algo]
    differ = {
        name: (a, logged_two[name])
        for name, a in logged_one.items()
        if logged_two[name] != pytest.approx(a, rel=1e-5, abs=ZERO_UP_TO_ROUNDING.get((algo, name), 1e-9))
    }
    assert not differ, f"1 process vs 2 ranks logged different metrics (one, two): {differ}"


# --- torchrun launches ------------------------------------------------------------------------------------

CONFIGS = {"ppo": "configs/ppo_sentiment.yaml", "reinforce": "configs/rloo_arithmetic.yaml", "ilql": "configs/ilql_sentiment.yaml"}
COMMON = ["max_num_steps=2", "max_new_tokens=5", "max_val_samples=4", "progress=false", "tensorboard=false",
          "save_period=1", "val_period=0", "task=arithmetic"]
LOOPS = {
    "ppo": ["num_prompts_per_step=4", "num_generations_per_prompt=2", "microbatch_size=4",
            "num_minibatches=2"],
    "reinforce": ["num_prompts_per_step=2", "num_generations_per_prompt=4", "microbatch_size=4"],
    "ilql": ["batch_size=4", "microbatch_size=2", "dataset_size=16", "dataset_batch_size=8"],
}


@pytest.fixture(scope="module")
def two_rank_run(tiny_path, made_once):
    """``two_rank_run(loop)``: the folder of a 2-step ``torchrun`` run of ``loop`` at 2 ranks, made once per
    session (read by the test below; test_checkpoint_moves_between_two_ranks_and_one resumes a copy)."""

    def get(loop: str) -> Path:
        def make(folder: Path) -> None:
            torchrun("-m", "rlbits", "train", CONFIGS[loop], f"policy={tiny_path}", f"run_dir={folder / 'run'}",
                     *COMMON, *LOOPS[loop])

        return made_once(f"two_rank_run_{loop}", make) / "run"

    return get


@pytest.mark.slow
@pytest.mark.parametrize("loop", list(LOOPS))
def test_torchrun_two_ranks_runs_each_loop(loop, two_rank_run):
    run_dir = two_rank_run(loop)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(v is None or v == v for r in rows for v in r.values())  # nothing NaN
    ckpt = run_dir / "checkpoints" / "step_2"
    assert (ckpt / "dcp" / ".metadata").is_file() and sorted(p.name for p in (ckpt / "rng").iterdir()) == [
        "rank_0.pt",
        "rank_1.pt",
    ]
    assert json.loads((ckpt / "state.json").read_text())["world_size"] == 2
    assert (run_dir / "final" / "config.json").is_file()


@pytest.mark.slow
def test_checkpoint_moves_between_two_ranks_and_one(tiny_path, tmp_path, two_rank_run):
    import shutil

    from rlbits.distributed.checkpoint import load_checkpoint
    from rlbits.models.load import load_pretrained

    run_dir = tmp_path / "run"
    shutil.copytree(two_rank_run("reinforce"), run_dir)  # steps 1-2 on 2 ranks
    consumed = [_consumed_samples(run_dir, 2)]
    # The sharded DCP weights of step 2, loaded in one process, are the policy rank 0 exported at step 2.
    exported, _ = load_pretrained(run_dir / "final")
    fresh, _ = load_pretrained(tiny_path)
    load_checkpoint(run_dir / "checkpoints" / "step_2", models={"policy": fresh})
    for (name, a), b in zip(exported.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    python("-m", "rlbits", "train", "--resume", str(run_dir), "max_num_steps=3")  # step 3 on 1 rank
    step3 = run_dir / "checkpoints" / "step_3"
    assert json.loads((step3 / "state.json").read_text())["world_size"] == 1 and (step3 / "dcp" / ".metadata").is_file()
    consumed.append(_consumed_samples(run_dir, 3))
    torchrun("-m", "rlbits", "train", "--resume", str(run_dir), "max_num_steps=4")  # step 4 on 2 ranks again
    consumed.append(_consumed_samples(run_dir, 4))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    # 2 prompts per rank per step: 2 steps at 2 ranks, 1 at 1 rank, 1 at 2 ranks
    assert consumed == [8, 10, 14]
    after, _ = load_pretrained(run_dir / "final")  # exported at step 4 from 2 ranks again
    fresh, _ = load_pretrained(tiny_path)
    load_checkpoint(run_dir / "checkpoints" / "step_4", models={"policy": fresh})
    for (name, a), b in zip(after.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_after_a_rank_is_killed(tiny_path, tmp_path):
    """kill -9 one rank after the step-2 checkpoint: torchrun restarts the job, which resumes by itself and
    finishes; metrics.jsonl reads as one run."""
    import signal
    import time

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "rlbits", "train", CONFIGS["reinforce"], f"policy={tiny_path}", f"run_dir={run_dir}", *COMMON,
           *LOOPS["reinforce"], "max_num_steps=8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
    killed = None
    try:
        deadline = time.time() + 180
        while killed is None and time.time() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "step_2").is_dir():
                children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
                victims = [int(c) for c in children if _rank_of(int(c)) == 1]
                if victims:
                    os.kill(victims[0], signal.SIGKILL)
                    killed = victims[0]
            time.sleep(0.05)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed is not None, "never saw the step-2 checkpoint and a rank-1 worker"
    assert proc.returncode == 0, output[-6000:]
    assert "SIGKILL" in output or "Signals.SIGKILL" in output or "-9" in output, output[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(9))
    assert _consumed_samples(run_dir, 8) == 8 * 2 * 2  # the data position survived the restart


# --- compile and precision in one process ----------------------------------------------------------------


def _ppo_batch(policy, value_model, R: int, seed: int):
    from rlbits.batch import build_batch
    from rlbits.models.forward import critic_values, policy_logprobs

    g = torch.Generator().manual_seed(seed)
    B, P = 6, 4
    prompts = torch.randint(3, V - 1, (B, P), generator=g)
    responses = torch.randint(3, V - 1, (B, R), generator=g)
    action_mask = torch.arange(R)[None, :] < torch.randint(1, R + 1, (B,), generator=g)[:, None]
    action_mask[0] = True  # the longest row has R tokens
    batch = build_batch(prompts, torch.ones(B, P, dtype=torch.bool), responses, action_mask, rewards=torch.randn(B, generator=g))
    with torch.no_grad():
        batch["logprobs"] = policy_logprobs(policy, batch)
        batch["ref_logprobs"] = batch["logprobs"] + 0.1 * torch.randn(B, R, generator=g)
        batch["values"] = critic_values(value_model, batch)
    return batch


@pytest.mark.slow
def test_compile_does_not_recompile_as_response_lengths_change():
    """PPO's advantage and update phases with ``compile=True`` over steps whose responses are 5, 9, 7, 12, 6
    tokens long: the kernels compile in the first steps, then never again."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from rlbits.data.stream import PromptStream
    from rlbits.loops import ppo
    from rlbits.loops.metrics import StepMetrics
    from rlbits.loops.runtime import disable_dropout

    torch._dynamo.reset()
    counters.clear()
    cfg = ppo.PPOConfig(compile=True, ppo_epochs=1, num_minibatches=1, microbatch_size=6, kl_in_reward=True)
    policy = disable_dropout(tiny_causal_lm("gpt2", V, seed=0)).train()
    value_model = disable_dropout(ValueModel.from_policy(policy)).train()
    state = ppo.State(
        policy=policy, value_model=value_model,
        policy_optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-3),
        value_optimizer=torch.optim.AdamW(value_model.parameters(), lr=1e-3),
        sampling_generator=torch.Generator(), minibatch_generator=torch.Generator().manual_seed(0),
        stream=PromptStream(["unused"], seed=0), kl_coef=0.05,
    )
    graphs = []
    for step, R in enumerate([5, 9, 7, 12, 6]):
        batch = _ppo_batch(policy, value_model, R, seed=step)
        state.metrics, state.kl_coef = StepMetrics(), 0.05 + 0.01 * step  # the adaptive coefficient changes too
        for phase in (ppo.advantages, ppo.update):
            batch = phase(state, batch, cfg)
        logged = state.metrics.reduce(state.env)
        assert math.isfinite(logged["actor_loss"]) and math.isfinite(logged["critic_loss"])
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[-1] == graphs[0], f"recompiled as shapes changed: graphs after each step {graphs}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_bf16_precision_runs_each_loop_in_one_process(arch, tmp_path):
    """precision=bf16 runs PPO, REINFORCE and ILQL on GPT-2, Llama and Qwen2 (RoPE models once failed in
    bf16 decoding: fp32 keys and bf16 values in one static cache)."""
    from rlbits.loops.api import train

    path = tmp_path / "policy"
    tiny_causal_lm(arch, V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    for loop, extra in LOOPS.items():
        overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in COMMON + extra)}
        overrides.update(policy=str(path), run_dir=str(tmp_path / loop), precision="bf16", max_num_steps=1)
        train(config=ROOT / CONFIGS[loop], **overrides)
        row = metrics(tmp_path / loop)[-1]
        assert row["step"] == 1 and all(v is None or v == v for v in row.values()), (loop, row)
