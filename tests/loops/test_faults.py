"""Fault injection through the command line: kill -9 at random moments, corrupted checkpoints, SIGTERM.

Black-box on purpose: each test runs ``python -m rlbits train CONFIG policy=<tiny> run_dir=...`` in a
subprocess, so it keeps working whatever the checkpoint files hold. It only assumes what the user sees:
``RUN_DIR/metrics.jsonl`` (one row per step), ``RUN_DIR/checkpoints/step_N/`` folders, ``RUN_DIR/final/``
(safetensors weights) and ``rlbits train --resume RUN_DIR``.

What each test checks (issue 8, "Faults"):

- kill -9 after a random number of logged steps plus a random delay (so it lands in any phase: rollout,
  update, logging, checkpoint writing), possibly several times per run, then ``--resume``: the finished
  run's metrics rows (time-like fields aside) and ``final/`` weights equal the uninterrupted run's exactly,
  at most the steps since the last checkpoint are redone, and no temporary folder is left behind;
- the newest checkpoint corrupted on disk (truncated file, one flipped byte, manifest deleted) before the
  resume: it is skipped with a warning and the previous one is used, and the run still matches;
- SIGTERM / SIGINT mid-run: the current step finishes, a checkpoint of it is written, the process exits 0,
  and resuming completes the same run.

The policy is a tiny random GPT-2 with the character tokenizer, built in the test (no base model, an
empty RLBITS_CACHE). Each subprocess pays ~5-8 s of imports, which dominates the time of this file.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
COMMON = [
    f"max_num_steps={STEPS}", "max_new_tokens=4", "max_val_samples=2",
    "val_period=3", "val_at_start=false", "val_at_end=false", "save_period=1", "keep_checkpoints=2",
    "progress=false", "tensorboard=false", "log_samples=2", "cpu_threads=1",
    "checkpoint_checksums=all",  # a flipped byte in the weights is caught only with every file hashed
]
LOOPS = {
    "ppo": [
        "configs/ppo_sentiment.yaml",
        *COMMON,
        "num_prompts_per_step=2",
        "microbatch_size=2",
        "ppo_epochs=2",
        "num_minibatches=2",
    ],
    # ILQL steps are ~10x shorter: more of them, so a signal lands mid-run
    "ilql": ["configs/ilql_sentiment.yaml", *COMMON, "max_num_steps=30", "dataset_size=8", "dataset_batch_size=8",
             "batch_size=4", "microbatch_size=4", "val_period=10"],
    "reinforce": [
        "configs/rloo_arithmetic.yaml",
        *COMMON,
        "num_prompts_per_step=2",
        "num_generations_per_prompt=2",
        "microbatch_size=4",
    ],
}
TIME_LIKE = ("time_s", "tokens_per_s")
TIMEOUT = 180  # seconds for one subprocess: far above a normal run, so a hang fails instead of blocking CI


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The subprocess environment and the tiny policy folder (an empty RLBITS_CACHE: nothing is built)."""
    root = tmp_path_factory.mktemp("faults")
    policy = root / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), policy)
    cache = root / "empty_cache"
    cache.mkdir()
    e = dict(os.environ, RLBITS_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return {"env": e, "policy": str(policy)}


def train_args(loop: str, env: dict, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rlbits", "train", *LOOPS[loop][:1], f"policy={env['policy']}",
            f"run_dir={run_dir}", *LOOPS[loop][1:]]


def resume_args(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rlbits", "train", "--resume", str(run_dir)]


def run_to_end(args: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, env=env["env"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def logged_steps(run_dir: Path) -> list[int]:
    """Steps of the complete rows of metrics.jsonl (a row being written is ignored)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def checkpoint_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    names = [p.name for p in root.glob("step_*") if p.is_dir()] if root.is_dir() else []
    return sorted(int(n[5:]) for n in names if n[5:].isdigit())


def resumable_step(run_dir: Path) -> int | None:
    """The step ``--resume`` continues from (the newest checkpoint that verifies)."""
    import warnings

    from rlbits.distributed.checkpoint import latest_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = latest_checkpoint(run_dir)
    return None if path is None else int(path.name[5:])


def comparable_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if k not in TIME_LIKE and not k.startswith("time/")} for r in rows]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    assert files, f"{run_dir / 'final'} holds no safetensors file"
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def leftovers(run_dir: Path) -> list[str]:
    """Temporary folders or files a crash-safe writer must not leave behind (``.tmp*``, ``.*.old-*``)."""
    return sorted(
        str(p.relative_to(run_dir)) for p in run_dir.rglob(".*") if "tmp" in p.name or ".old-" in p.name
    )


def assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = comparable_rows(run_dir), comparable_rows(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want], (
        "the resumed run's rows are not one per step"
    )
    for a, b in zip(got, want, strict=True):
        assert a == b, f"metrics differ at step {b['step']}: " + str(
            {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
        )
    w1, w2 = final_weights(run_dir), final_weights(reference)
    assert w1.keys() == w2.keys()
    for name in w2:
        assert torch.equal(w1[name], w2[name]), f"final/ weight {name} differs from the uninterrupted run's"
    assert leftovers(run_dir) == [], f"temporary files left behind: {leftovers(run_dir)}"


@pytest.fixture(scope="module")
def reference_runs(env, made_once):
    """The uninterrupted run of each loop, built on first use (once for all xdist workers)."""

    def get(loop: str) -> Path:
        def make(folder: Path) -> None:
            run_to_end(train_args(loop, env, folder / "run"), env)
            steps = [r["step"] for r in comparable_rows(folder / "run")]
            assert steps == list(range(steps[0], steps[-1] + 1)) and steps[-1] == last_step(loop)

        return made_once(f"faults_reference_{loop}", make) / "run"

    return get


def last_step(loop: str) -> int:
    return int(next(a for a in reversed(LOOPS[loop]) if a.startswith("max_num_steps="))[len("max_num_steps=") :])


def corrupt_newest(run_dir: Path, how: str) -> int:
    """Damage the newest checkpoint on disk; returns its step."""
    step = checkpoint_steps(run_dir)[-1]
    folder = run_dir / "checkpoints" / f"step_{step}"
    # the largest weight file (dcp/*.distcp), else the largest file of whatever format
    files = list(folder.rglob("*.distcp")) or [p for p in folder.rglob("*") if p.is_file()]
    weights = max(files, key=lambda p: p.stat().st_size)
    if how == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        data = bytearray(weights.read_bytes())
        data[len(data) * 3 // 4] ^= 0x40
        weights.write_bytes(bytes(data))
    elif how == "manifest":
        manifests = list(folder.glob("manifest*"))
        assert manifests, f"no manifest in {folder}: {sorted(p.name for p in folder.iterdir())}"
        for m in manifests:
            m.unlink()
    return step


def _wait_and_signal(proc, run_dir: Path, after_step: int, delay: float, sig: int, started_ns: int):
    """Once this process has logged the row of ``after_step`` (a row written after ``started_ns``), wait
    ``delay`` s and send ``sig``. Returns the last logged step just before and just after sending it (the
    step in flight when it arrived is at most the latter + 1), or None if the process ended first."""
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        if path.is_file() and path.stat().st_mtime_ns > started_ns:
            steps = logged_steps(run_dir)
            if steps and max(steps) >= after_step:
                time.sleep(delay)
                before = max(logged_steps(run_dir))
                proc.send_signal(sig)
                return before, max(logged_steps(run_dir))
        time.sleep(0.02)
    return None


def signal_run(args: list[str], env: dict, run_dir: Path, after_step: int, delay: float, sig: int):
    """Start ``args`` and send ``sig`` ``delay`` s after it logs step ``after_step``.

    Returns ``(returncode, stderr, (last step logged before, after sending) or None)``.
    """
    started = time.time_ns()
    time.sleep(0.01)  # mtime granularity: rows this process writes are stamped after ``started``
    proc = subprocess.Popen(args, env=env["env"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        import threading

        err: list[str] = []
        reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
        reader.start()  # drain stderr so a chatty child never blocks on a full pipe
        sent = _wait_and_signal(proc, run_dir, after_step, delay, sig, started)
        proc.wait(timeout=TIMEOUT)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(err), sent


CORRUPTIONS = {0: ("truncate", "manifest"), 1: ("flip", "truncate")}


# each loop with one of the two damage sequences: every damage kind, and both loops, at half the cost of the
# full product (ILQL: see test_ilql_kill_between_metrics_row_and_checkpoint_loses_no_row)
@pytest.mark.parametrize(("loop", "seed"), [("ppo", 0), ("reinforce", 1)])
def test_kill9_corrupt_resume_matches_the_uninterrupted_run(loop, seed, env, reference_runs, tmp_path):
    """Two kill -9 at random moments, each followed by damage to the newest checkpoint, then resumes."""
    reference = reference_runs(loop)
    run_dir = tmp_path / "run"
    rng = random.Random(1000 * seed + len(loop))
    after = rng.randint(3, STEPS - 3)  # a step whose row follows at least two checkpoints
    args = train_args(loop, env, run_dir)
    report, damaged = [], None
    for kill, how in enumerate(CORRUPTIONS[seed]):
        delay = rng.uniform(0.0, 0.4)  # steps take ~0.1-0.3 s: the kill lands in any phase, saving included
        rc, err, sent = signal_run(args, env, run_dir, after, delay, signal.SIGKILL)
        assert sent is not None, f"the run ended before step {after} was logged (rc {rc}):\n{err[-3000:]}"
        assert rc == -signal.SIGKILL, f"expected death by SIGKILL, got rc {rc}:\n{err[-3000:]}"
        sent_at = sent[1]  # SIGKILL acts at once: no row is written after it
        if kill:
            assert "skipping checkpoint" in err and f"step_{damaged}" in err, err[-3000:]
        newest_ok = resumable_step(run_dir)
        assert newest_ok is not None, f"no usable checkpoint after a kill at step {sent_at}"
        # save_period=1 and the row of step n is logged before its checkpoint is written: at most that one
        # step is lost (its row is dropped on resume and the step redone).
        assert 0 <= sent_at - newest_ok <= 1, f"killed after logging step {sent_at}, resumable: {newest_ok}"
        damaged = corrupt_newest(run_dir, how)
        older = [s for s in checkpoint_steps(run_dir) if s < damaged]
        resume_from = resumable_step(run_dir)
        assert resume_from == (older[-1] if older else None), (
            f"damaged step_{damaged} ({how}) was not skipped"
        )
        report.append(dict(killed_after=sent_at, delay=round(delay, 2), checkpoint=newest_ok,
                           damaged=f"step_{damaged}:{how}", resumed_from=resume_from))
        args = resume_args(run_dir)
        after = min(resume_from + rng.randint(2, 3), STEPS - 1)
    proc = run_to_end(args, env)
    assert "skipping checkpoint" in proc.stderr and f"step_{damaged}" in proc.stderr, proc.stderr[-3000:]
    assert_same_run(run_dir, reference)
    print(f"\n{loop} seed {seed}: {report}")


@pytest.mark.parametrize(
    "loop,sig",
    [("reinforce", signal.SIGTERM), ("ilql", signal.SIGTERM), ("ppo", signal.SIGINT)],
    ids=["reinforce-SIGTERM", "ilql-SIGTERM", "ppo-SIGINT"],  # one handler serves both signals
)
def test_sigterm_sigint_save_the_current_step_and_exit_0(loop, sig, env, reference_runs, tmp_path):
    reference = reference_runs(loop)
    run_dir = tmp_path / "run"
    rc, err, sent = signal_run(train_args(loop, env, run_dir), env, run_dir, 2, 0.1, sig)
    assert sent is not None, err[-3000:]
    assert rc == 0, f"{signal.Signals(sig).name} mid-run: expected exit 0, got {rc}:\n{err[-3000:]}"
    stopped = max(logged_steps(run_dir))
    assert sent[0] <= stopped <= sent[1] + 1 < last_step(loop)  # the step in flight finished, no later one
    assert resumable_step(run_dir) == stopped, "no checkpoint of the step the signal interrupted"
    assert leftovers(run_dir) == []
    run_to_end(resume_args(run_dir), env)
    assert_same_run(run_dir, reference)


# --- faults found by the tests above, fixed in the loops (each was a strict xfail first) ---------------------


def _cli(*args: str) -> int:
    from rlbits.cli import main

    return main(["train", *args])


def test_kill_before_the_first_checkpoint_can_be_resumed(env, tmp_path, monkeypatch):
    monkeypatch.setenv("RLBITS_CACHE", env["env"]["RLBITS_CACHE"])
    run_dir = tmp_path / "run"
    # What a kill during step 1 leaves when val_at_start logged step 0: the marker, config.yaml, one row, no
    # checkpoint.
    from rlbits.loops.api import resolve_config
    from rlbits.loops.config import save_config
    from rlbits.loops.rundir import write_marker

    cfg = resolve_config(LOOPS["ppo"][0], [f"policy={env['policy']}", f"run_dir={run_dir}", *LOOPS["ppo"][1:]])
    run_dir.mkdir()
    write_marker(run_dir, "ppo")
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "time_s": 0.1, "val_reward": 0.0}) + "\n")
    assert _cli("--resume", str(run_dir), "max_num_steps=1") == 0
    assert [r["step"] for r in comparable_rows(run_dir)][-1] == 1


@pytest.fixture
def short_run(env, tmp_path, monkeypatch):
    """A finished 2-step PPO run (in process: no interpreter start-up)."""
    monkeypatch.setenv("RLBITS_CACHE", env["env"]["RLBITS_CACHE"])
    run_dir = tmp_path / "run"
    args = [f"policy={env['policy']}", f"run_dir={run_dir}", *LOOPS["ppo"][1:], "max_num_steps=2"]
    assert _cli(LOOPS["ppo"][0], *args) == 0
    return run_dir


def test_a_metrics_row_torn_by_a_kill_does_not_block_resume(short_run):
    with open(short_run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "time_s": 1.2, "rewa')  # what a kill in the middle of Run.log leaves
    assert _cli("--resume", str(short_run), "max_num_steps=3") == 0
    assert [r["step"] for r in comparable_rows(short_run)] == [1, 2, 3]


def test_temporary_folders_of_a_killed_save_are_cleaned_on_resume(short_run):
    (short_run / ".final.tmp-99999-deadbeef").mkdir()  # a kill during save_pretrained(final/)
    (short_run / ".final.tmp-99999-deadbeef" / "config.json").write_text("{}")
    assert _cli("--resume", str(short_run), "max_num_steps=3") == 0
    assert leftovers(short_run) == []


ILQL = ["configs/ilql_sentiment.yaml", *COMMON, "max_num_steps=3", "dataset_size=8", "dataset_batch_size=8",
        "batch_size=4", "microbatch_size=4", "val_period=0"]


def test_ilql_kill_between_metrics_row_and_checkpoint_loses_no_row(env, tmp_path, monkeypatch):
    """ILQL logs a step's row, then saves its checkpoint (as PPO and REINFORCE do): a kill between the two
    leaves row 3 and checkpoint 2; the resume drops row 3, redoes step 3 and loses no row."""
    monkeypatch.setenv("RLBITS_CACHE", env["env"]["RLBITS_CACHE"])
    run_dir = tmp_path / "run"
    assert _cli(ILQL[0], f"policy={env['policy']}", f"run_dir={run_dir}", *ILQL[1:]) == 0
    assert resumable_step(run_dir) == 3
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step_3")  # the kill came after run.log(step 3), before save
    assert resumable_step(run_dir) == 2
    assert _cli("--resume", str(run_dir), "max_num_steps=4") == 0
    assert [r["step"] for r in comparable_rows(run_dir)] == [0, 1, 2, 3, 4]


# --- a reward that turns bad mid-run ------------------------------------------------------------------------


class _BadAfter:
    """A reward that is fine for ``good`` calls, then returns NaN for the second sample."""

    def __init__(self, good: int):
        self.calls, self.good = 0, good

    def __call__(self, prompts, responses):
        self.calls += 1
        out = [0.5] * len(prompts)
        if self.calls > self.good:
            out[1] = float("nan")
        return out


def _train_with_reward(env, run_dir, reward):
    import rlbits

    args = [f"policy={env['policy']}", f"run_dir={run_dir}", *LOOPS["ppo"][1:], "val_period=0", "max_num_steps=3"]
    return rlbits.train(reward_fn=reward, config=LOOPS["ppo"][0], **parse_args(args))


def parse_args(args):
    from rlbits.loops.config import parse_overrides

    return parse_overrides(args)


def test_nan_reward_mid_run_stops_naming_the_sample_and_keeps_the_last_checkpoint(env, tmp_path, monkeypatch):
    from rlbits.rollout.score import InvalidRewardError

    monkeypatch.setenv("RLBITS_CACHE", env["env"]["RLBITS_CACHE"])
    run_dir = tmp_path / "run"
    with pytest.raises(InvalidRewardError, match=r"returned reward nan for sample 1 \(prompt="):
        _train_with_reward(env, run_dir, _BadAfter(good=1))
    assert resumable_step(run_dir) == 1  # step 1's checkpoint is intact; nothing of step 2 was saved
    assert checkpoint_steps(run_dir) == [1] and leftovers(run_dir) == []


def test_nan_reward_error_names_the_step_and_phase(env, tmp_path, monkeypatch):
    monkeypatch.setenv("RLBITS_CACHE", env["env"]["RLBITS_CACHE"])
    with pytest.raises(ValueError, match=r"step 2.*score|score.*step 2"):
        _train_with_reward(env, tmp_path / "run", _BadAfter(good=1))


def test_every_checkpoint_damaged_or_no_run_gives_a_clear_error(short_run, tmp_path, capsys):
    """Resume when no checkpoint verifies: each is skipped with a warning, then an error naming the run; a
    folder that is not a run: exit 2 naming its config.yaml."""
    for step in checkpoint_steps(short_run):
        (short_run / "checkpoints" / f"step_{step}" / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert _cli("--resume", str(short_run), "max_num_steps=3") == 2  # a user error: one line, exit 2
    assert "has no checkpoint to resume from" in capsys.readouterr().err
    assert _cli("--resume", str(tmp_path / "not_a_run")) == 2
    assert "not a run directory (it has no config.yaml)" in capsys.readouterr().err
