"""Every collective entered by every rank: 2-rank REINFORCE runs whose ranks see different data.

Each 2-rank test starts the ranks of tests/collective_worker.py itself (gloo on CPU, no torchrun agent) with a
process-group timeout of seconds, so ranks that disagree about a collective fail the test quickly instead of
hanging CI. The data-dependent loop options share one launch (their scenarios run one after the other in the
same process group); the timeout and SIGTERM tests each have their own, since they end the processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbits.loops.config import ConfigError
from rlbits.loops.reinforce import ReinforceConfig
from rlbits.loops.run import CollectiveError, collective_errors
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "collective_worker.py")
AGREEING = ["dynamic_sampling", "overlong", "nonfinite_skip", "multiturn", "validation"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", 32, seed=0).save_pretrained(path)
    tiny_tokenizer(32).save_pretrained(path)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenarios: list[str], policy: str, out: Path, **env: str) -> list[subprocess.Popen]:
    """Start ranks 0 and 1 of ``collective_worker.py``; each writes its output to ``out/rank{r}.log``."""
    out.mkdir(parents=True, exist_ok=True)
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", **env}
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, ",".join(scenarios), policy, str(out)], stdout=log, stderr=subprocess.STDOUT,
            env=environ, cwd=ROOT,
        ))
        log.close()
    return procs


def wait(procs: list[subprocess.Popen], out: Path, timeout: float) -> tuple[list[int | None], str]:
    """Wait up to ``timeout`` seconds for both ranks (killing what is left); return their exit codes and
    the tails of their logs."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    logs = "\n".join(f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-4000:] for r in (0, 1))
    return codes, logs


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# --- in process ---------------------------------------------------------------------------------------------


def test_a_failed_gloo_collective_becomes_a_collective_error_naming_step_and_phase():
    gloo = "[/x/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv"
    with pytest.raises(
        CollectiveError, match=r"^step 7, phase rollout: a collective timed out after 3 s"
    ) as e:
        with collective_errors(7, "rollout", 3.0):
            raise RuntimeError(f"step 7, phase rollout: {gloo}")  # in_phase's prefix is not repeated
    assert e.value.args[0].count("step 7") == 1 and "Timed out waiting 3000ms" in e.value.args[0]
    with pytest.raises(
        CollectiveError, match=r"^step 2, phase update: a collective failed; another rank died"
    ):
        with collective_errors(2, "update", 3.0):
            raise RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    with pytest.raises(RuntimeError, match="^plain$"):  # not a collective's error: untouched
        with collective_errors(2, "update", 3.0):
            raise RuntimeError("plain")


@pytest.mark.parametrize("field, value", [("collective_timeout_s", 0.0), ("stop_grace_s", -1.0)])
def test_collective_timeout_and_stop_grace_are_checked(field, value):
    with pytest.raises(ConfigError, match=field):
        ReinforceConfig(**{field: value}).check()


# --- 2 ranks ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agreeing_runs(tiny_path, tmp_path_factory):
    """One launch running every data-dependent scenario; their tests check what each logged."""
    out = tmp_path_factory.mktemp("agreeing")
    codes, logs = wait(launch(AGREEING, tiny_path, out, RLBITS_TEST_PG_TIMEOUT="10"), out, timeout=300)
    return out, codes, logs


@pytest.mark.slow
@pytest.mark.parametrize("scenario", AGREEING)
def test_two_ranks_with_different_data_enter_the_same_collectives(scenario, agreeing_runs):
    out, codes, logs = agreeing_runs
    assert (out / f"{scenario}.done").is_file(), f"exit codes {codes}\n{logs}"
    rows = metrics(out / scenario)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    if scenario == "dynamic_sampling":  # rank 0 full after round 1, rank 1 drew all 3 rounds, kept none
        assert all(r["gen_batches"] == 3 and r["kept_groups"] == 2 for r in steps), steps
    elif scenario == "overlong":  # rank 1's batch is all filtered out; rank 0's trains
        assert all(r["truncated_frac"] == 0.5 and r["loss_tokens"] > 0 for r in steps), steps
    elif scenario == "nonfinite_skip":  # the NaN on rank 1 skipped step 2 on both ranks
        assert steps[1] == {"step": 2, "skipped_step": 1.0, "time_s": steps[1]["time_s"]}
        assert "skipped_step" not in steps[0] and "skipped_step" not in steps[2]
    elif scenario == "multiturn":  # 1-turn episodes on rank 0, up to 3 turns on rank 1
        assert all(1 < r["num_turns"] < 3 for r in steps), steps
    elif scenario == "validation":  # 2 validation prompts on rank 0, 1 on rank 1, each step
        assert [r["step"] for r in rows if "val_reward" in r] == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_collective_one_rank_does_not_reach_times_out_naming_the_step_and_phase(tiny_path, tmp_path):
    """Rank 1's reward sleeps past collective_timeout_s=3 at step 2: rank 0, waiting for it in the score
    phase's agreement, fails with a CollectiveError naming step and phase; rank 1 then finds rank 0 gone."""
    procs = launch(["timeout"], tiny_path, tmp_path, RLBITS_TEST_SLEEP="6")
    codes, logs = wait(procs, tmp_path, timeout=120)
    assert codes[0] not in (None, 0) and codes[1] not in (None, 0), f"exit codes {codes}\n{logs}"
    rank0, rank1 = ((tmp_path / f"rank{r}.log").read_text() for r in (0, 1))
    assert "CollectiveError: step 2, phase score: a collective timed out after 3 s" in rank0, logs
    assert "CollectiveError: step 2, phase score: a collective" in rank1, logs


@pytest.mark.slow
def test_sigterm_ends_ranks_blocked_in_a_collective_within_seconds(tiny_path, tmp_path):
    """Rank 1 sleeps inside step 2 (its reward), rank 0 waits for it in a collective (collective_timeout_s
    120): SIGTERM to both ends both within stop_grace_s=2 plus a few seconds, each saying where it was."""
    procs = launch(["hang"], tiny_path, tmp_path, RLBITS_TEST_SLEEP="120")
    marker = tmp_path / "hang.marker"
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.1)
    if not marker.exists():
        codes, logs = wait(procs, tmp_path, timeout=1)
        pytest.fail(f"rank 1 never reached step 2's reward; exit codes {codes}\n{logs}")
    time.sleep(1.0)  # rank 0 is now waiting in the score phase's all-reduce
    t0 = time.monotonic()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    codes, logs = wait(procs, tmp_path, timeout=15)
    elapsed = time.monotonic() - t0
    assert codes == [128 + signal.SIGTERM] * 2, f"exit codes {codes} after {elapsed:.1f} s\n{logs}"
    assert elapsed < 12, elapsed
    for r in (0, 1):
        text = (tmp_path / f"rank{r}.log").read_text()
        assert "rlbits: SIGTERM received; step 2, phase score did not end within stop_grace_s=2 s" in text, (
            logs
        )
    assert not (tmp_path / "hang" / "checkpoints" / "step_2").exists()
