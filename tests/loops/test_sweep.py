"""rlbits.sweep / rlbits sweep: a grid of `rlbits train` runs, one process each, resumable, with a summary."""

from __future__ import annotations

import json
import os

import pytest

from rlbits.cli import main
from rlbits.loops import sweep as sweep_module
from rlbits.loops.config import ConfigError
from rlbits.loops.sweep import grid_points, parse_grid, read_summary, run_name, split_values, sweep
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

TINY = dict(
    loop="reinforce", task="arithmetic", max_num_steps=1, num_prompts_per_step=2, num_generations_per_prompt=2,
    max_new_tokens=3, microbatch_size=4, max_val_samples=2, val_period=0, val_at_start=False, save_period=0,
    progress=False, tensorboard=False, log_samples=0,
)


# --- the grid on the command line ----------------------------------------------------------------------


def test_split_values_keeps_brackets_and_quotes_whole():
    assert split_values("vanilla,gspo,cispo") == ["vanilla", "gspo", "cispo"]
    assert split_values("[1,2],[3]") == ["[1,2]", "[3]"]
    assert split_values("{a: 1, b: 2}") == ["{a: 1, b: 2}"]
    assert split_values("'a,b',c") == ["'a,b'", "c"]
    assert split_values("0.1") == ["0.1"]
    for bad in ("a,,b", "[1,2", "a]", "'a,b"):
        with pytest.raises(ConfigError):
            split_values(bad)


def test_parse_grid_axes_and_fixed_overrides():
    grid, fixed = parse_grid(
        ["policy_loss=vanilla,gspo", "seed=0,1,2", "max_num_steps=20", "stop=[a,b]", "x=[1,2],[3]", "s='a,b'"]
    )
    assert grid == {"policy_loss": ["vanilla", "gspo"], "seed": [0, 1, 2], "x": [[1, 2], [3]]}
    assert fixed == {"max_num_steps": 20, "stop": ["a", "b"], "s": "a,b"}
    with pytest.raises(ConfigError, match="twice"):
        parse_grid(["seed=0,1", "seed=2"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_grid(["seed"])


def test_grid_points_and_names():
    points = grid_points({"policy_loss": ["vanilla", "gspo"], "seed": [0, 1]})
    assert points == [
        {"policy_loss": "vanilla", "seed": 0}, {"policy_loss": "vanilla", "seed": 1},
        {"policy_loss": "gspo", "seed": 0}, {"policy_loss": "gspo", "seed": 1},
    ]
    assert [run_name(p) for p in points][1] == "policy_loss=vanilla,seed=1"
    assert run_name({"policy": "/a/b c", "lr": 1e-3, "stop": ["x", "y"]}) == "policy=_a_b_c,lr=0.001,stop=__x___y__"
    for bad in ({"seed": []}, {"seed": "012"}, {"seed": [0, 0]}):
        with pytest.raises(ConfigError):
            grid_points(bad)


def test_a_run_imports_this_rlbits(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    root = os.path.dirname(os.path.dirname(os.path.abspath(sweep_module.__file__)))
    assert sweep_module._child_env()["PYTHONPATH"].split(os.pathsep) == [os.path.dirname(root), "/elsewhere"]


def test_a_bad_grid_fails_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="clip_epz"):
        sweep(None, {"clip_epz": [0.1, 0.2]}, out_dir=tmp_path / "out", **TINY)
    with pytest.raises(ConfigError, match="folder name"):
        sweep(None, {"stop": [["a b"], ["a_b"]]}, out_dir=tmp_path / "out", **TINY)
    assert not (tmp_path / "out").exists()


def _fake_sweep(rows, calls):
    def fake(config, grid, *, out_dir, processes, **fixed):
        calls.append((config, grid, str(out_dir), processes, fixed))
        return rows

    return fake


def test_cli_passes_the_grid_and_exits_1_if_a_run_failed(monkeypatch, capsys):
    calls = []
    rows = [
        {"name": "seed=0", "status": "finished", "final/val_reward": 0.25},
        {"name": "seed=1", "status": "failed"},
    ]
    monkeypatch.setattr(sweep_module, "sweep", _fake_sweep(rows, calls))
    code = main(["sweep", "configs/rloo_arithmetic.yaml", "seed=0,1", "max_num_steps=3", "--processes", "2"])
    assert code == 1
    assert calls == [("configs/rloo_arithmetic.yaml", {"seed": [0, 1]}, "runs/sweep_rloo_arithmetic", 2,
                      {"max_num_steps": 3})]
    out, err = capsys.readouterr()
    assert "val_reward=0.2500" in out and "1 of 2 runs failed" in err
    assert out.strip().splitlines()[-1] == os.path.join("runs/sweep_rloo_arithmetic", "summary.jsonl")
    monkeypatch.setattr(sweep_module, "sweep", _fake_sweep(rows[:1], calls))
    assert main(["sweep", "loop=reinforce", "seed=0,1", "--out", "x"]) == 0
    assert calls[-1][:3] == (None, {"seed": [0, 1]}, "x") and calls[-1][4] == {"loop": "reinforce"}


def test_cli_bad_grid_is_one_line_exit_2(capsys):
    assert main(["sweep", "seed=0,,1"]) == 2
    assert "empty value" in capsys.readouterr().err


# --- real runs --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_grid_runs_in_parallel_reports_a_failure_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_causal_lm("gpt2", 32, seed=0).save_pretrained("pol")
    tiny_tokenizer(32).save_pretrained("pol")
    grid = {"policy": ["pol", "missing"], "seed": [0, 1]}  # 2 x 2: the missing policy's runs fail
    rows = sweep(None, grid, out_dir="out", processes=2, verbose=False, **TINY)
    assert [r["name"] for r in rows] == [
        "policy=pol,seed=0", "policy=pol,seed=1", "policy=missing,seed=0", "policy=missing,seed=1"
    ]
    assert [r["status"] for r in rows] == ["finished", "finished", "failed", "failed"]
    assert [r["seed"] for r in rows] == [0, 1, 0, 1] and rows[3]["returncode"] != 0
    for r in rows[:2]:
        assert r["run_dir"] == os.path.join("out", r["name"]) and r["final/step"] == 1
        assert "final/rewards" in r and os.path.isdir(os.path.join(r["run_dir"], "final"))
    assert "missing" in open(rows[2]["log"]).read()  # the run's own error is in its log
    assert read_summary("out") == json.loads(json.dumps(rows))
    # a second sweep skips what finished (the grid of the runs that finished: nothing runs)
    stamps = [os.stat(os.path.join(r["run_dir"], "metrics.jsonl")).st_mtime_ns for r in rows[:2]]
    again = sweep(None, {"policy": ["pol"], "seed": [0, 1]}, out_dir="out", processes=2, verbose=False, **TINY)
    assert again == rows[:2] and read_summary("out") == json.loads(json.dumps(again))
    assert stamps == [os.stat(os.path.join(r["run_dir"], "metrics.jsonl")).st_mtime_ns for r in again]


def test_an_interrupt_stops_the_running_runs_and_records_them(tmp_path, monkeypatch):
    """Ctrl-C in the sweep: each running process gets SIGINT, no more start, the rows say ``interrupted``."""
    import subprocess
    import sys
    import time

    started = []

    def fake_start(config_path, log, force):  # a run that waits to be stopped, in place of `rlbits train`
        started.append(config_path.stem)
        # SIGINT's default handler set again: a child of an xdist worker starts with SIGINT ignored
        code = "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(60)"
        return subprocess.Popen([sys.executable, "-c", code], stdout=log)

    monkeypatch.setattr(sweep_module, "_start", fake_start)

    class CtrlCOnceTwoRun(sweep_module.ThreadPoolExecutor):
        """The pool whose ``map`` is interrupted (KeyboardInterrupt in the waiting thread, as Ctrl-C raises it
        in the main thread) once two runs have started. A real SIGINT would reach the interpreter's main
        thread, which under pytest-xdist is not always the one running the test."""

        def map(self, fn, *iterables):
            futures = [self.submit(fn, *args) for args in zip(*iterables, strict=False)]
            while len(started) < 2:
                time.sleep(0.05)
            time.sleep(0.2)
            raise KeyboardInterrupt
            yield from futures  # a generator, as Executor.map returns

    monkeypatch.setattr(sweep_module, "ThreadPoolExecutor", CtrlCOnceTwoRun)
    with pytest.raises(KeyboardInterrupt):
        sweep(None, {"seed": [0, 1, 2]}, out_dir=tmp_path / "out", processes=2, verbose=False, **TINY)
    rows = read_summary(tmp_path / "out")
    # the two pool threads start (and the summary records) their runs in either order
    assert sorted(started) == ["seed=0", "seed=1"] and sorted(r["name"] for r in rows) == sorted(started)
    assert [r["status"] for r in rows] == ["interrupted", "interrupted"]
