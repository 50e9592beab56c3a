"""The shared loop infrastructure: checkpoints, the prompt stream, run logging, plots, the API."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rlbits.data.stream import PromptStream
from rlbits.distributed.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from rlbits.loops.config import ConfigError, RunConfig
from rlbits.models.tiny import tiny_causal_lm

# --- checkpoints -----------------------------------------------------------------------------------------


def _model_and_optimizer(seed: int = 0):
    model = tiny_causal_lm("gpt2", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (2, 5))).logits.square().mean().backward()
    optimizer.step()
    return model, optimizer


def test_checkpoint_round_trip_restores_weights_optimizer_and_every_rng(tmp_path):
    model, optimizer = _model_and_optimizer()
    gen = torch.Generator().manual_seed(11)
    torch.rand(3, generator=gen)
    path = save_checkpoint(tmp_path, 5, models={"policy": model}, optimizers={"policy": optimizer},
                           state={"consumed_samples": 40}, generators={"sampling": gen})
    expected = (torch.rand(4, generator=gen), torch.rand(4), random.random(), np.random.rand())
    assert not (path / "policy").exists() and (path / "dcp" / ".metadata").is_file()  # weights live in dcp/
    restored, _ = _model_and_optimizer(seed=1)  # other weights: the checkpoint must overwrite them
    assert not torch.equal(next(restored.parameters()), next(model.parameters()))
    optimizer2 = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    state = load_checkpoint(latest_checkpoint(tmp_path), models={"policy": restored},
                            optimizers={"policy": optimizer2}, generators={"sampling": gen})
    assert state == {"step": 5, "consumed_samples": 40, "world_size": 1}
    got = (torch.rand(4, generator=gen), torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2:] == expected[2:]
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values(), strict=False):
        assert torch.equal(a, b), name
    s1, s2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)


@pytest.mark.parametrize("checksums", ["small", "all"])
def test_torn_or_corrupted_checkpoint_falls_back_to_the_previous_one(tmp_path, checksums, monkeypatch):
    import rlbits.distributed.checkpoint.manifest as checkpoint_files

    monkeypatch.setattr(checkpoint_files, "SMALL_FILE", 100_000)  # the tiny model's weights (580 kB) count as large
    model, optimizer = _model_and_optimizer()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, models={"policy": model}, optimizers={"policy": optimizer}, keep=3,
                        checksums=checksums)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_4", "step_6"]
    weights = max((tmp_path / "checkpoints" / "step_6" / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    manifest = json.loads((tmp_path / "checkpoints" / "step_6" / "manifest.json").read_text())
    hashed = {rel for rel, meta in manifest["files"].items() if "sha256" in meta}
    assert ("dcp/" + weights.name in hashed) == (checksums == "all")  # the weights are hashed only on request
    assert {"state.json", "dcp/.metadata"} <= hashed  # the small files always
    if checksums == "small":  # a flipped byte in the weights goes unseen; a truncated file does not
        weights.write_bytes(weights.read_bytes()[:-1])
        assert "bytes" in verify_checkpoint(tmp_path / "checkpoints" / "step_6")
        return
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    weights.write_bytes(bytes(data))
    (tmp_path / "checkpoints" / "step_4" / "state.json").unlink()  # a torn one
    assert "checksum" in verify_checkpoint(tmp_path / "checkpoints" / "step_6")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        assert latest_checkpoint(tmp_path).name == "step_2"
    with pytest.raises(ValueError, match="is damaged"):
        load_checkpoint(tmp_path / "checkpoints" / "step_6")


def test_checkpoint_keeps_only_the_newest_and_leaves_no_temp_folder(tmp_path):
    model, _ = _model_and_optimizer()
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, models={"policy": model}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_3", "step_4"]


def test_checkpoint_refuses_non_finite_state(tmp_path):
    model, _ = _model_and_optimizer()
    with pytest.raises(ValueError, match="not finite JSON"):
        save_checkpoint(tmp_path, 1, models={"policy": model}, state={"val_reward": float("nan")})
    assert list_checkpoints(tmp_path) == [] and not (tmp_path / "checkpoints").exists()


# --- prompt stream ---------------------------------------------------------------------------------------


def test_prompt_stream_epochs_and_exact_resume():
    prompts = [f"p{i}" for i in range(5)]
    stream = PromptStream(prompts, seed=1)
    taken = [stream.next(3) for _ in range(4)]  # 12 prompts: epochs 0, 1 and part of 2
    flat = [p for chunk in taken for p in chunk]
    assert sorted(flat[:5]) == prompts and sorted(flat[5:10]) == prompts  # each epoch is a permutation
    assert flat[:5] != flat[5:10]  # reshuffled per epoch
    assert stream.epoch == 2 and stream.consumed_samples == 12
    resumed = PromptStream(prompts, seed=1, consumed_samples=6)
    assert resumed.next(6) == flat[6:12]
    with pytest.raises(ValueError, match="prompt list is empty"):
        PromptStream([], seed=0)


# --- run logging, plots, API -----------------------------------------------------------------------------


def test_run_writes_metrics_samples_and_truncates_on_resume(tmp_path):
    from rlbits.loops.logger import RunLogger as Run
    from rlbits.loops.run import read_metrics

    cfg = RunConfig(run_dir=str(tmp_path / "run"), tensorboard=True, progress=False)
    run = Run(cfg)
    for step in (1, 2, 3):
        run.log(step, {"rewards": torch.tensor(0.5 * step), "actor_loss": 1.0 / step})
        run.log_samples(step, [{"prompt": "a", "response": "b", "reward": 1.0}])
    run.close()
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["rewards"] == 1.5
    assert (tmp_path / "run" / "config.yaml").is_file() and any((tmp_path / "run" / "tensorboard").iterdir())
    with pytest.raises(FileExistsError, match="already holds a run"):
        Run(cfg)
    Run(cfg, resume=True, start_step=2).close()  # resuming from step 2 drops step 3's lines
    assert [r["step"] for r in read_metrics(cfg.run_dir)] == [1, 2]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2]


def test_wandb_offline_logging(tmp_path, monkeypatch):
    """wandb=true works without a network in offline mode: the run lands under run_dir/wandb."""
    pytest.importorskip("wandb")  # in the dev extra, so CI runs this
    from rlbits.loops.logger import RunLogger as Run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = RunConfig(run_dir=str(tmp_path / "run"), wandb=True, tensorboard=False, progress=False)
    run = Run(cfg)
    run.log(1, {"rewards": 0.25})
    run.close()
    offline = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and any(offline[0].rglob("*.wandb"))


def test_plot_run_draws_the_logged_values(tmp_path):
    from rlbits.viz.plots import plot_run

    for name, scale in (("a", 1.0), ("b", 2.0)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": s, "rewards": scale * s, "init_policy_kl": 0.1 * s} for s in (1, 2, 3)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plot_run([tmp_path / "a", tmp_path / "b"], out=tmp_path / "p.png")
    lines = {ln.get_label(): list(ln.get_ydata()) for ax in fig.axes for ln in ax.get_lines()}
    assert lines["a: rewards"] == [1.0, 2.0, 3.0] and lines["b: rewards"] == [2.0, 4.0, 6.0]
    assert lines["b: init_policy_kl"] == pytest.approx([0.1, 0.2, 0.3])
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_api_picks_the_loop_from_the_config_and_rejects_bad_ones():
    from rlbits.loops.api import resolve_config

    assert type(resolve_config({"loop": "reinforce", "num_generations_per_prompt": 4})).__name__ == "ReinforceConfig"
    assert type(resolve_config({"loop": "ilql"})).__name__ == "ILQLConfig"
    assert type(resolve_config({}, ["seed=5"])).__name__ == "PPOConfig"
    with pytest.raises(ConfigError, match="loop must be one of"):
        resolve_config({"loop": "dpo"})
    with pytest.raises(ConfigError, match="unknown config key"):
        resolve_config({"loop": "ppo", "not_a_field": 1})


# --- on_nonfinite (Run's handling of a skipped step: tests/loops/test_run.py) --------------------------------------


def test_checkpoint_refuses_nan_weights_and_keeps_the_previous_one(tmp_path):
    model, optimizer = _model_and_optimizer()
    save_checkpoint(tmp_path, 1, models={"policy": model}, optimizers={"policy": optimizer})
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"step 2: policy.transformer.h.0.mlp.c_fc.weight holds NaN"):
        save_checkpoint(tmp_path, 2, models={"policy": model}, optimizers={"policy": optimizer})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_1"] and latest_checkpoint(tmp_path).name == "step_1"


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """Re-saving a step (after a resume) or pruning deletes a checkpoint: it is renamed aside first, so a kill
    during the deletion leaves no half-deleted ``step_N`` that looks like the newest checkpoint."""
    import shutil

    model, optimizer = _model_and_optimizer()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, models={"policy": model}, optimizers={"policy": optimizer})
    real_rmtree = shutil.rmtree

    def killed_midway(path, *a, **k):
        if str(path).endswith(".discarded"):
            (next(p for p in sorted(path.rglob("*")) if p.is_file())).unlink()  # deletion under way ...
            raise KeyboardInterrupt  # ... when the process dies
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, models={"policy": model}, optimizers={"policy": optimizer})
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_1"]
    assert verify_checkpoint(latest_checkpoint(tmp_path)) is None


def test_reuse_freed_memory_serves_large_tensors_from_the_heap(monkeypatch):
    """After ``reuse_freed_memory`` a 64 MiB tensor is a heap block, not a fresh mmap (glibc's ``mallinfo2``
    counts mmapped blocks in ``hblks``), and a freed one stays in the heap; ``setup`` applies it on CPU only
    when ``cpu_reuse_memory`` is on."""
    import ctypes
    import platform

    import rlbits.loops.runtime as runtime
    from rlbits.loops.reinforce import ReinforceConfig

    if platform.libc_ver()[0] != "glibc":
        assert runtime.reuse_freed_memory() is False
        return

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    assert runtime.reuse_freed_memory() is True
    before = libc.mallinfo2()
    x = torch.ones(16 * 2**20)  # 64 MiB: above glibc's largest mmap threshold
    during = libc.mallinfo2()
    assert during.hblks == before.hblks and during.uordblks >= before.uordblks + x.numel() * 4
    del x
    after = libc.mallinfo2()
    assert after.uordblks < during.uordblks and after.arena == during.arena  # freed, not trimmed back

    calls = []
    monkeypatch.setattr(runtime, "reuse_freed_memory", lambda: calls.append(1) or True)
    runtime.setup(ReinforceConfig(device="cpu", cpu_reuse_memory=False, cpu_threads=0))
    assert calls == []
    runtime.setup(ReinforceConfig(device="cpu", cpu_threads=0))
    assert calls == [1]
