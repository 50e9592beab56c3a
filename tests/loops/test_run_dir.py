"""Run directories that cannot eat files (issue 29, item 3): new, empty or an rlbits run, else refused before
anything is written; one live run per folder (flock); --force; a full disk reported in one line."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rlbits.cli import main
from rlbits.distributed.checkpoint import latest_checkpoint, save_checkpoint, verify_checkpoint
from rlbits.loops.config import ConfigError, RunConfig
from rlbits.loops.logger import RunLogger
from rlbits.loops.rundir import (
    LOCK,
    MARKER,
    DiskFullError,
    RunDirError,
    RunDirLockedError,
    check_run_dir,
    claim_run_dir,
    disk_full,
    disk_full_as_error,
)

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "max_num_steps=2", "num_prompts_per_step=2", "num_generations_per_prompt=2", "max_new_tokens=4",
    "microbatch_size=4", "max_val_samples=2", "val_period=0", "val_at_start=false", "val_at_end=false",
    "save_period=1", "progress=false", "tensorboard=false",
]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` (hidden ones too) with its bytes (None for a folder)."""
    return {
        str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(folder.rglob("*"))
    }


def users_folder(tmp_path: Path) -> Path:
    """The folder of the issue: a user's files whose names rlbits also writes or cleans up."""
    folder = tmp_path / "mine"
    (folder / "checkpoints" / "step_1").mkdir(parents=True)
    (folder / "checkpoints" / "step_1" / "x").write_text("user checkpoint")
    (folder / ".cache.tmp-important").mkdir()
    (folder / ".cache.tmp-important" / "data").write_text("precious")
    (folder / "config.yaml").write_text("my: own config\n")
    (folder / "samples.jsonl").write_text('{"mine": 1}\n')
    return folder


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("rlbits train: "), err
    return err[0]


def save(run_dir: Path, step: int, keep: int = 2) -> Path:
    model = nn.Linear(2, 2)
    return save_checkpoint(run_dir, step, models={"policy": model}, state={"step": step}, keep=keep)


# --- what a run directory may be ---------------------------------------------------------------------------


def test_the_issues_folder_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLBITS_DEBUG", raising=False)
    folder = users_folder(tmp_path)
    before = snapshot(folder)
    assert main(["train", f"run_dir={folder}", *SMALL]) == 2
    line = one_error_line(capsys)
    assert (
        "is not empty and is not an rlbits run" in line
        and "--force" in line
        and ".cache.tmp-important" in line
    )
    assert snapshot(folder) == before  # every file byte-identical, nothing added or deleted


@pytest.mark.parametrize("run_dir", ["", "  ", "/", "/.."])
def test_an_empty_or_root_run_dir_is_a_config_error(run_dir, tmp_path, capsys, monkeypatch):
    with pytest.raises(ConfigError, match="run_dir"):
        RunConfig(run_dir=run_dir).check()
    monkeypatch.chdir(tmp_path)  # where an empty run_dir would have written the run
    monkeypatch.delenv("RLBITS_DEBUG", raising=False)
    assert main(["train", str(ROOT / "configs" / "ppo_sentiment.yaml"), f"run_dir={run_dir}", *SMALL]) == 2
    assert "run_dir" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_file_is_no_run_dir(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match="is a file"):
        check_run_dir(tmp_path / "f", force=True)


def test_home_and_current_folder_are_refused_even_with_force_unless_empty(tmp_path, monkeypatch):
    home = tmp_path / "home"
    work = home / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("x")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    for run_dir, place in (
        (".", "the current folder"),
        (str(home), "your home folder"),
        ("..", "your home folder"),
    ):
        with pytest.raises(RunDirError, match=place):
            check_run_dir(run_dir, force=True)
    empty = home / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert check_run_dir(".") == ("empty", False)  # `cd runs/new && rlbits train run_dir=.` is fine


def test_new_and_empty_folders_are_accepted_and_resume_of_nothing_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    assert check_run_dir(tmp_path / "new") == ("new", False)
    assert check_run_dir(tmp_path / "empty") == ("empty", False)
    for name, what in (("new", "does not exist"), ("empty", "is empty")):
        with pytest.raises(FileNotFoundError, match=what):
            check_run_dir(tmp_path / name, resume=True)
    assert list((tmp_path / "empty").iterdir()) == [] and not (tmp_path / "new").exists()


def test_the_marker_is_written_first(tmp_path, monkeypatch):
    import rlbits.loops.rundir as rundir

    def fail(path):
        assert sorted(p.name for p in Path(path).iterdir()) == [MARKER]  # nothing before it
        raise RuntimeError("stop after the marker")

    monkeypatch.setattr(rundir, "lock_run_dir", fail)
    with pytest.raises(RuntimeError, match="stop after the marker"):
        claim_run_dir(tmp_path / "run", loop="reinforce")
    marker = json.loads((tmp_path / "run" / MARKER).read_text())
    assert marker["format"] == 1 and marker["loop"] == "reinforce" and marker["created"]
    # a folder holding only the marker (a run killed before it logged) may be started again
    monkeypatch.undo()
    with claim_run_dir(tmp_path / "run", loop="reinforce") as claim:
        assert claim.kind == "run" and not claim.started_over


def test_an_existing_run_is_refused_without_resume_or_force(tmp_path):
    cfg = RunConfig(run_dir=str(tmp_path / "run"), progress=False)
    logger = RunLogger(cfg)
    logger.log(1, {"rewards": 1.0})
    logger.close()
    with pytest.raises(RunDirError, match=r"already holds a run; resume it .*--force"):
        RunLogger(cfg)
    RunLogger(cfg, resume=True, start_step=1).close()


# --- one live run per folder --------------------------------------------------------------------------------


def test_a_second_run_and_a_resume_of_a_live_run_are_refused_naming_its_pid(tmp_path):
    run_dir = tmp_path / "run"
    first = claim_run_dir(run_dir, loop="ppo")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # the live run has made progress
    pid = f"pid {os.getpid()}"
    with pytest.raises(RunDirLockedError, match=pid):
        claim_run_dir(run_dir, loop="ppo", resume=True)
    with pytest.raises(RunDirLockedError, match=pid):
        claim_run_dir(run_dir, loop="ppo", force=True)  # --force never takes a live run's folder
    first.release()
    with claim_run_dir(run_dir, loop="ppo", resume=True) as again:
        assert again.held and json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()


def test_two_new_runs_started_at_once_one_wins(tmp_path):
    run_dir = tmp_path / "run"
    assert check_run_dir(run_dir) == ("new", False)  # both checked before either wrote
    first = claim_run_dir(run_dir, loop="ppo")
    with pytest.raises(RunDirLockedError):
        claim_run_dir(run_dir, loop="ppo")
    first.release()


def test_the_api_refuses_a_live_run_before_loading_anything(tmp_path):
    import rlbits

    run_dir = tmp_path / "run"
    with claim_run_dir(run_dir, loop="reinforce"):
        (run_dir / "config.yaml").write_text("loop: reinforce\n")
        with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()}"):
            rlbits.train(config={"loop": "reinforce", "run_dir": str(run_dir)}, resume=True)


HOLDER = """
import sys, time
from rlbits.loops.rundir import claim_run_dir
claim = claim_run_dir(sys.argv[1], loop="ppo")
print("locked", flush=True)
time.sleep(60)
"""


def test_a_lock_left_by_kill_9_is_taken_by_the_next_run(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirLockedError, match=f"pid {proc.pid}"):
            claim_run_dir(run_dir, loop="ppo", resume=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    holder = json.loads((run_dir / LOCK).read_text())["pid"]
    assert holder == proc.pid  # the dead holder's record is still there
    with claim_run_dir(run_dir, loop="ppo", resume=True) as claim:  # ...but the kernel released its flock
        assert claim.held and json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()


# --- --force, and deleting only what rlbits wrote -----------------------------------------------------------


def test_force_writes_into_a_foreign_folder_and_deletes_nothing_of_the_users(tmp_path):
    folder = users_folder(tmp_path)
    with pytest.raises(RunDirError):
        claim_run_dir(folder, loop="ppo")
    mine = {k: v for k, v in snapshot(folder).items() if not k.startswith("config.yaml")}
    (folder / ".final.tmp-4242-deadbeef").mkdir()  # what a kill during rlbits' export of final/ leaves
    (folder / "checkpoints" / ".tmp_step_3").mkdir()  # ... and during a checkpoint save
    cfg = RunConfig(run_dir=str(folder), progress=False)
    claim = claim_run_dir(folder, loop="ppo", force=True)
    assert claim.kind == "foreign" and (folder / MARKER).is_file()
    logger = RunLogger(cfg, claim=claim)  # writes config.yaml (a name rlbits writes), removes its temporaries
    for step in (2, 3, 4):  # keep=2: step_2 is pruned, the user's step_1 (no rlbits manifest) is not
        save(folder, step)
    logger.close()
    claim.release()
    after = snapshot(folder)
    assert all(after.get(k) == v for k, v in mine.items()), "a file of the user's changed or went away"
    assert (
        not (folder / ".final.tmp-4242-deadbeef").exists()
        and not (folder / "checkpoints" / ".tmp_step_3").exists()
    )
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["step_1", "step_3", "step_4"]
    with pytest.raises(FileExistsError, match="not an rlbits checkpoint"):
        save(folder, 1)  # a step_N rlbits did not write is never replaced
    assert (folder / "checkpoints" / "step_1" / "x").read_text() == "user checkpoint"


def test_stale_temporary_cleanup_spares_a_users_folders_in_a_run(tmp_path):
    cfg = RunConfig(run_dir=str(tmp_path / "run"), progress=False, tensorboard=False)
    RunLogger(cfg).close()
    (tmp_path / "run" / ".cache.tmp-important").mkdir()
    (tmp_path / "run" / ".notes.old-archive").mkdir()
    (tmp_path / "run" / ".offline_dataset.old-abc_1234").mkdir()  # atomic_folder's moved-aside folder
    RunLogger(cfg, resume=True).close()
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if p.is_dir())
    assert names == [".cache.tmp-important", ".notes.old-archive"]


def test_force_starts_an_existing_run_over(tmp_path):
    run_dir = tmp_path / "run"
    cfg = RunConfig(run_dir=str(run_dir), progress=False)
    logger = RunLogger(cfg)
    logger.log(1, {"rewards": 1.0})
    logger.close()
    save(run_dir, 1)
    (run_dir / "checkpoints" / "step_9").mkdir()  # not rlbits': stays
    claim = claim_run_dir(run_dir, loop="ppo", force=True)
    assert claim.started_over and sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_9"]
    RunLogger(cfg, claim=claim).close()
    claim.release()
    assert (run_dir / "metrics.jsonl").read_text() == ""  # the new run's rows only


def test_a_run_without_the_marker_is_adopted_with_force(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("loop: ppo\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    save(run_dir, 1)
    with pytest.raises(RunDirError, match=r"earlier rlbits.*--resume DIR --force"):
        check_run_dir(run_dir, resume=True)
    assert check_run_dir(run_dir, force=True) == ("legacy", True)
    with claim_run_dir(run_dir, loop="ppo", resume=True, force=True) as claim:
        assert claim.kind == "legacy" and not claim.started_over
    assert (run_dir / MARKER).is_file() and latest_checkpoint(run_dir) is not None
    assert check_run_dir(run_dir, resume=True) == ("run", False)  # adopted: an ordinary run from now on


def test_cli_refuses_with_one_line_and_force_is_in_its_help(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLBITS_DEBUG", raising=False)
    run_dir = tmp_path / "run"
    with claim_run_dir(run_dir, loop="ppo"):
        (run_dir / "config.yaml").write_text("loop: ppo\n")
        assert main(["train", "--resume", str(run_dir)]) == 2
        assert f"in use by a live run (pid {os.getpid()}" in one_error_line(capsys)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--force" in capsys.readouterr().out


# --- a full disk ------------------------------------------------------------------------------------------


def test_a_full_disk_is_found_however_it_is_wrapped(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device", "x.distcp")
    assert disk_full(CheckpointException("save failed", {0: full})) is full
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert disk_full(e) is full
    assert disk_full(OSError(errno.EACCES, "denied")) is None
    with pytest.raises(
        DiskFullError, match=r"disk holding run_dir '.*' is full while writing x.distcp"
    ) as info:
        with disk_full_as_error("runs/x"):
            raise full
    assert info.value.errno == errno.ENOSPC


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    save(tmp_path, 1)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    monkeypatch.setattr(torch, "save", full_disk)  # DCP's shard writes too: it wraps the error
    with pytest.raises((OSError, CheckpointException)) as info:
        save(tmp_path, 2)
    assert disk_full(info.value) is not None
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_1") is None


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from rlbits.models.load import save_pretrained
    from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

    path = tmp_path_factory.mktemp("rundir") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), path)
    return str(path)


@pytest.mark.slow
def test_disk_full_at_a_save_is_one_line_and_the_run_resumes(policy_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLBITS_DEBUG", raising=False)
    run_dir = tmp_path / "run"
    real_save = torch.save

    def full_at_step_2(obj, f, *args, **kwargs):
        if ".tmp_step_2" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_step_2)
    config = str(ROOT / "configs" / "ppo_sentiment.yaml")
    assert main(["train", config, f"policy={policy_dir}", f"run_dir={run_dir}", *SMALL]) == 1
    line = one_error_line(capsys)
    assert f"the disk holding run_dir '{run_dir}' is full" in line and "--resume" in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_1"
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["train", "--resume", str(run_dir)]) == 0  # the lock was released; step 2 is redone
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_a_damaged_rlbits_checkpoint_is_still_rlbits_own(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_2" / "manifest.json").unlink()  # damage: the redo of step 2 replaces it
    save(tmp_path, 2)
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_2") is None
    (tmp_path / "checkpoints" / "step_1" / "manifest.json").unlink()
    save(tmp_path, 3)  # keep=2: the damaged step_1 is pruned like any other of rlbits'
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2", "step_3"]
