"""rlbits as a user installs it: a wheel, outside the source checkout. The default config ships inside the
package (``rlbits/configs/ppo_sentiment.yaml``, package data), so ``rlbits train`` run anywhere trains the main
job, not the dataclasses' built-in defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ROOT / "rlbits" / "configs" / "ppo_sentiment.yaml"


def test_packaged_default_config_is_the_repo_one():
    # configs/ppo_sentiment.yaml is the one users read and edit; the package ships a byte-identical copy
    assert PACKAGED.read_bytes() == (ROOT / "configs" / "ppo_sentiment.yaml").read_bytes(), (
        "configs/ppo_sentiment.yaml and rlbits/configs/ppo_sentiment.yaml differ: copy the first over the second"
    )


def test_default_config_outside_a_checkout_is_the_packaged_one(tmp_path, monkeypatch):
    from rlbits.loops.api import default_config_path, resolve_config

    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert default_config_path().read_bytes() == PACKAGED.read_bytes()
    cfg = resolve_config(None)
    assert (cfg.loop, cfg.task, cfg.run_dir, cfg.learning_rate) == ("ppo", "sentiment", "runs/default", 5.0e-4)


@pytest.mark.slow
def test_wheel_install_trains_the_packaged_default_outside_the_checkout(tmp_path):
    from rlbits.models.load import save_pretrained
    from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

    # build the wheel from a copy of the tracked files (the build writes build/ and *.egg-info next to them)
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file() and not name.startswith(("tutorials/", "notebooks/", "benchmarks/", "tests/")):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)], check=True)
    (wheel,) = dist.glob("rlbits-*.whl")

    # a fresh venv that sees this venv's packages (torch, transformers, ...) through a .pth path line, which
    # does not run this venv's editable-install hook: rlbits itself comes from the wheel only
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    Path(purelib, "outer_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], check=True)

    policy = tmp_path / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), policy)
    work = tmp_path / "work"  # outside the checkout: no configs/ here
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    where = subprocess.run(
        [str(python), "-c", "import rlbits, rlbits.loops.api as a; print(rlbits.__file__); print(a.default_config_path())"],
        cwd=work, env=env, capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert all(line.startswith(purelib) for line in where), where  # rlbits and its config from the wheel
    small = ["max_num_steps=1", "num_prompts_per_step=2", "max_new_tokens=4", "microbatch_size=2",
             "max_val_samples=2", "val_at_start=false", "progress=false", "tensorboard=false"]
    out = subprocess.run(
        [str(venv / "bin" / "rlbits"), "train", f"policy={policy}", *small],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "runs/default"
    saved = yaml.safe_load((work / "runs" / "default" / "config.yaml").read_text())
    packaged = yaml.safe_load(PACKAGED.read_text())
    assert saved["loop"] == "ppo" and saved["task"] == "sentiment"
    for key in ("learning_rate", "critic_learning_rate", "kl_coef", "ppo_epochs", "num_minibatches", "save_period"):
        assert saved[key] == packaged[key], key  # the packaged config's values, not the dataclass defaults
    assert (work / "runs" / "default" / "final" / "config.json").is_file()
