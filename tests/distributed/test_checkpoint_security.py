"""Checkpoints and run files as an attacker or a failing disk leaves them (issue 29, items 2 and 6).

Nothing of a run directory is unpickled beyond plain data (DCP's ``.metadata``, its non-tensor items, the
ILQL dataset's ``pickle.pkl``): a payload that would create a marker file never runs. A flipped byte in any
file of a checkpoint, a bad ``state.json`` field, NaN weights: a warning naming the checkpoint and the file,
and the previous checkpoint is loaded; none loads: one clear error.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
import warnings
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlbits.data.offline import EpochSampler, load_tensors, save_tensors
from rlbits.data.stream import PromptStream
from rlbits.distributed.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_dcp_metadata,
    restore_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from rlbits.distributed.checkpoint import manifest as files_manifest
from rlbits.loops.state import LoopState
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

MARK = 1234.5678  # a weight value whose 4 bytes the tests find in the shard file


class Payload:
    """Unpickled, creates ``path``: what an attacker's pickle would do (here: open a file for writing)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@dataclasses.dataclass(kw_only=True)
class _State(LoopState):
    policy: torch.nn.Module
    stream: PromptStream
    kl_coef: float = 0.1


def _model(seed: int = 0):
    model = tiny_causal_lm("gpt2", seed=seed)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = MARK
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (2, 5))).logits.square().mean().backward()
    optimizer.step()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = MARK
    return model, optimizer


def _state(seed: int = 1) -> _State:
    model, _ = _model(seed)
    return _State(policy=model, stream=PromptStream(["a", "b", "c"], seed=0))


def _save(run_dir: Path, **kw) -> Path:
    """Checkpoints step_1 and step_2 of one model, as a loop's ``Run.save`` writes them."""
    model, optimizer = _model()
    for step in (1, 2):
        save_checkpoint(run_dir, step, models={"policy": model}, optimizers={"policy": optimizer},
                        state={"stream": {"consumed_samples": 2 * step}, "kl_coef": 0.1},
                        generators={"g": torch.Generator().manual_seed(step)}, **kw)
    return run_dir


@pytest.fixture
def run(tmp_path):
    """A run dir with checkpoints step_1 and step_2 (default checksums), tokenizer included."""
    return _save(tmp_path, tokenizer=tiny_tokenizer())


def _reseal(folder: Path) -> None:
    """Rewrite the manifest as an attacker who can write the run dir would (the manifest has no key)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = files_manifest._digest_entries(files, folder, manifest["checksums"])
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _restore(run_dir: Path, state: _State | None = None) -> tuple[Path, dict, list[str]]:
    state = state or _state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, saved = restore_checkpoint(run_dir, models=state.models, check_state=state.check_counters,
                                         generators={"g": torch.Generator()})
    return path, saved, [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]


def _flip(path: Path, offset: int, n: int = 1) -> None:
    data = bytearray(path.read_bytes())
    for i in range(n):
        data[offset + i] ^= 0xFF
    path.write_bytes(bytes(data))


# --- no pickle from the run directory ------------------------------------------------------------------------


def test_a_malicious_dcp_metadata_never_runs_and_resume_falls_back(run, tmp_path_factory):
    marker = tmp_path_factory.mktemp("m") / "pwned"
    metadata = run / "checkpoints" / "step_2" / "dcp" / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload(marker)))
    _reseal(metadata.parents[1])  # the checksums match: only the unpickler stands between it and the code
    with pytest.raises(
        CheckpointError, match=r"\.metadata' is not DCP metadata: UnpicklingError: it names io\.open"
    ):
        read_dcp_metadata(metadata)
    path, saved, skipped = _restore(run)
    assert not marker.exists()
    assert path.name == "step_1" and saved["step"] == 1
    assert len(skipped) == 1 and "step_2" in skipped[0] and ".metadata" in skipped[0], skipped


def test_a_malicious_non_tensor_item_in_a_shard_never_runs(run, tmp_path_factory):
    """DCP reads its non-tensor items (optimizer hyperparameters) with torch.load(weights_only=False)."""
    marker = tmp_path_factory.mktemp("m") / "pwned"
    folder = run / "checkpoints" / "step_2"
    metadata = read_dcp_metadata(folder / "dcp" / ".metadata")
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    info = metadata.storage_data[index]
    shard = folder / "dcp" / info.relative_path
    evil = pickle.dumps(Payload(marker))  # torch.load's legacy format unpickles its first record
    info.offset, info.length = shard.stat().st_size, len(evil)
    shard.write_bytes(shard.read_bytes() + evil)
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(folder)
    model, optimizer = _model(seed=1)
    with pytest.raises(CheckpointError, match="cannot restore"):
        load_checkpoint(folder, models={"policy": model}, optimizers={"policy": optimizer})
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(run):
    folder = run / "checkpoints" / "step_2"
    metadata = read_dcp_metadata(folder / "dcp" / ".metadata")
    next(iter(metadata.storage_data.values())).relative_path = "../../../../etc/passwd"
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(folder)
    with pytest.raises(CheckpointError, match="points at '../../../../etc/passwd'"):
        load_checkpoint(folder, models={"policy": _model(seed=1)[0]})


def test_the_ilql_dataset_refuses_a_pickled_field(tmp_path, tmp_path_factory):
    marker = tmp_path_factory.mktemp("m") / "pwned"
    folder = tmp_path / "offline_dataset"
    save_tensors(TensorDict({"rewards": torch.zeros(2)}, batch_size=[2]), folder)
    # what tensordict writes for a non-JSON field, with the attacker's pickle in it
    tags = TensorDict({"rewards": torch.zeros(2), "tags": NonTensorStack(object(), object())}, batch_size=[2])
    tags.memmap(tmp_path / "with_tags")
    (tmp_path / "with_tags" / "tags" / "pickle.pkl").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match=r"refusing to load .*tags/pickle\.pkl.*pickled field"):
        load_tensors(tmp_path / "with_tags")
    assert not marker.exists()
    assert load_tensors(folder)["rewards"].tolist() == [0.0, 0.0]  # a saved dataset holds no pickle


# --- corruption: found where it is cheap, and the previous checkpoint loaded ----------------------------------


def _shard(run: Path) -> Path:
    return run / "checkpoints" / "step_2" / "dcp" / "__0_0.distcp"


def _mark_offset(path: Path) -> int:
    data = path.read_bytes()
    offset = data.find(struct.pack("<f", MARK))
    assert offset > 0 and data.count(struct.pack("<f", MARK)) == 1
    return offset


@pytest.mark.parametrize(
    "target",
    [
        "weights",
        "shard zip trailer",
        "rng zip trailer",
        "state.json",
        ".metadata",
        "tokenizer json",
        "manifest",
    ],
)
def test_a_flipped_byte_anywhere_is_named_and_the_previous_checkpoint_loads(run, target):
    folder = run / "checkpoints" / "step_2"
    file = {
        "weights": _shard(run), "shard zip trailer": _shard(run), "rng zip trailer": folder / "rng" / "rank_0.pt",
        "state.json": folder / "state.json", ".metadata": folder / "dcp" / ".metadata",
        "tokenizer json": folder / "tokenizer" / "tokenizer.json", "manifest": folder / "manifest.json",
    }[target]
    size = file.stat().st_size
    offset = {
        "weights": _mark_offset(file) if target == "weights" else 0,
        "state.json": 10,
        "manifest": 20,
    }.get(target, size - 22 if "trailer" in target else size // 2)
    _flip(file, offset, 4 if target == "weights" else 1)
    path, saved, skipped = _restore(run)
    assert path.name == "step_1" and saved["step"] == 1
    assert len(skipped) == 1 and "step_2" in skipped[0] and "does not fit" not in skipped[0], skipped
    if target != "manifest":
        assert str(file.relative_to(folder)) in skipped[0], skipped


def test_nan_weights_are_caught_without_weight_checksums(tmp_path, monkeypatch):
    """checksums="small" hashes no weight file: a flip that makes a weight NaN is still caught at load."""
    monkeypatch.setattr(files_manifest, "SMALL_FILE", 100_000)  # the tiny model's shard (580 kB) counts as large
    _save(tmp_path, checksums="small")
    shard = _shard(tmp_path)
    data = bytearray(shard.read_bytes())
    offset = _mark_offset(shard)
    data[offset : offset + 4] = struct.pack("<f", float("nan"))
    shard.write_bytes(bytes(data))
    assert verify_checkpoint(shard.parents[1]) is None  # nothing records the weights' checksum
    with pytest.raises(
        CheckpointError, match=r"is damaged: dcp/ holds NaN/inf in models\.policy\.transformer\.h\.0\.mlp"
    ):
        load_checkpoint(shard.parents[1], models={"policy": _model(seed=1)[0]})
    path, _, skipped = _restore(tmp_path)
    assert path.name == "step_1" and len(skipped) == 1


def test_a_torn_zip_trailer_without_weight_checksums_falls_back_not_a_mismatch(tmp_path, monkeypatch):
    monkeypatch.setattr(files_manifest, "SMALL_FILE", 100_000)
    _save(tmp_path, checksums="small")
    shard = _shard(tmp_path)
    _flip(shard, shard.stat().st_size - 22)  # the end-of-central-directory signature of its last zip
    state = _state()
    opt = torch.optim.AdamW(state.policy.parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_2"):
        path, _ = restore_checkpoint(tmp_path, models=state.models, optimizers={"policy": opt})
    assert path.name == "step_1"
    _flip(tmp_path / "checkpoints" / "step_1" / "dcp" / "__0_0.distcp", shard.stat().st_size - 22)
    with (
        pytest.warns(UserWarning),
        pytest.raises(
            CheckpointError, match=r"no checkpoint of run .* can be loaded \(step_2: .*; step_1: "
        ) as e,
    ):
        restore_checkpoint(tmp_path, models=state.models, optimizers={"policy": opt})
    assert not e.value.mismatch


def test_weights_of_another_shape_or_dtype_are_a_mismatch(run):
    with pytest.raises(CheckpointError, match="Size mismatch") as e:
        load_checkpoint(
            run / "checkpoints" / "step_2", models={"policy": tiny_causal_lm("gpt2", hidden_size=64)}
        )
    assert e.value.mismatch
    with pytest.raises(
        CheckpointError, match="dtype mismatch.*torch.float32, the model .* torch.bfloat16"
    ) as e:
        load_checkpoint(run / "checkpoints" / "step_2", models={"policy": _model()[0].to(torch.bfloat16)})
    assert e.value.mismatch


# --- state.json ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("step", -5, "field 'step' is -5; its folder step_2 says 2"),
        ("step", 7, "field 'step' is 7"),
        ("step", "2", "field 'step' is '2'"),
        ("world_size", 0, "field 'world_size' must be an int >= 1"),
        ("total_valid_tokens", -3, "field 'total_valid_tokens' must be an int >= 0, got -3"),
        ("total_valid_tokens", True, "field 'total_valid_tokens' must be an int >= 0, got True"),
        ("kl_coef", "NaN", "field 'kl_coef' must be a finite float"),
        ("kl_coef", "inf", "field 'kl_coef' must be a finite float"),
        ("val_reward", "x", "field 'val_reward' must be a finite float or null, got 'x'"),
        ("stream", {"consumed_samples": -1}, "field 'consumed_samples' must be an int >= 0, got -1"),
        ("stream", {"consumed_samples": 1.5}, "field 'consumed_samples' must be an int >= 0, got 1.5"),
        ("stream", [], "field 'stream' must be a JSON object"),
    ],
)
def test_bad_state_json_fields_are_named_and_the_previous_checkpoint_loads(run, field, value, message):
    file = run / "checkpoints" / "step_2" / "state.json"
    text = json.loads(file.read_text())
    text[field] = value
    raw = json.dumps(text)
    if value in ("NaN", "inf"):  # Python's json reads the NaN and Infinity literals
        raw = raw.replace(f'"{value}"', "NaN" if value == "NaN" else "Infinity")
    file.write_text(raw)
    _reseal(file.parent)  # well-formed as far as the checksums go
    state = _state()
    path, saved, skipped = _restore(run, state)
    assert path.name == "step_1" and saved["step"] == 1
    assert len(skipped) == 1 and "state.json" in skipped[0] and message in skipped[0], skipped
    state.load_counters(saved)
    assert (state.step, state.stream.consumed_samples) == (1, 2)


def test_load_counters_changes_nothing_when_a_field_is_bad():
    state = _state()
    with pytest.raises(ValueError, match="'consumed_samples' must be an int >= 0"):
        state.load_counters({"step": 4, "stream": {"consumed_samples": -2}})
    assert (state.step, state.stream.consumed_samples) == (0, 0)
    sampler = EpochSampler(seed=0)
    with pytest.raises(ValueError, match="'seed' must be an int >= 0"):
        sampler.load_state_dict({"seed": "0", "consumed_samples": 3})
    assert sampler.consumed_samples == 0


def test_resume_picks_by_sizes_then_hashes_the_weights_once(tmp_path, monkeypatch):
    """resume_checkpoint checks sizes and the small files; the weights are hashed once, at load."""
    monkeypatch.setattr(files_manifest, "CHUNK", 64 << 10)  # the shard is hashed in chunks, as a large one
    run = _save(tmp_path)
    _flip(_shard(run), _mark_offset(_shard(run)), 4)
    hashed = []
    real = files_manifest.sha256_file
    monkeypatch.setattr(files_manifest, "sha256_file", lambda p, *a, **k: hashed.append(p.name) or real(p, *a, **k))
    assert resume_checkpoint(run).name == "step_2"
    assert "__0_0.distcp" not in hashed
    path, _, skipped = _restore(run)
    assert path.name == "step_1" and "dcp/__0_0.distcp does not match its checksum" in skipped[0]


def test_the_restricted_unpickler_reads_every_rlbits_checkpoint(tmp_path):
    """The allowed globals cover what DCP writes for fp32 and bf16 models with AdamW states."""
    for i, dtype in enumerate((torch.float32, torch.bfloat16)):
        model = tiny_causal_lm("llama").to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randint(0, 64, (2, 5))).logits.float().square().mean().backward()
        optimizer.step()
        path = save_checkpoint(
            tmp_path / str(i), 3, models={"policy": model}, optimizers={"policy": optimizer}
        )
        restored = tiny_causal_lm("llama", seed=1).to(dtype)
        opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-3)
        load_checkpoint(path, models={"policy": restored}, optimizers={"policy": opt2})
        assert all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), restored.state_dict().values(), strict=True)
        )
        assert opt2.param_groups[0]["lr"] == 1e-3 and opt2.param_groups[0]["betas"] == (0.9, 0.999)


def test_large_files_are_hashed_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(files_manifest, "CHUNK", 64 << 10)
    model, optimizer = _model()
    path = save_checkpoint(tmp_path, 1, models={"policy": model}, optimizers={"policy": optimizer})
    entry = json.loads((path / "manifest.json").read_text())["files"]["dcp/__0_0.distcp"]
    assert len(entry["sha256_chunks"]) == -(-entry["bytes"] // (64 << 10)) > 1
    assert verify_checkpoint(path) is None
    _flip(path / "dcp" / "__0_0.distcp", entry["bytes"] - 1)
    assert verify_checkpoint(path).startswith("dcp/__0_0.distcp does not match its checksum (bytes ")
    assert verify_checkpoint(path, full=False) is None
