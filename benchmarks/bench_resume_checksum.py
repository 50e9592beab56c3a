"""Benchmark: what verifying every checkpoint file's sha256 costs a resume (``checkpoint_checksums=all``).

For each workload a checkpoint is saved (models + AdamW states, as a loop saves it), then a resume is timed
the way ``Run`` does it: build the models from their HF folder and the optimizers (``build``), then
``load_checkpoint`` with ``verify=True`` (the default: sizes and the small files' sha256 first, then the
large files' chunked sha256 in threads while DCP reads them) and with ``verify=False``. The cost is the
difference, as a share of the resume without it (build + load). The hashing alone (``verify_checkpoint``,
not overlapped) is reported too. Process start-up and imports (seconds) are not counted, so the share is an
upper bound. Save times with ``checksums="all"`` and ``"small"`` are reported as well. The page cache is
warm (the checkpoint was just written), as after a crash of the training process.

Workloads (random init, no download; ``benchmarks/_workload.py``):
    gpt2-11m-ppo   the standard workload (GPT-2, 4 layers, width 256, vocabulary 32,000): policy + value model
    smollm2-135m   SmolLM2-135M's architecture (Llama, 30 layers, width 576, 134.5M parameters): policy

Usage:
    python benchmarks/bench_resume_checksum.py [--repeats 3] [--workloads gpt2-11m-ppo smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workload  # noqa: E402
import torch  # noqa: E402

from rlbits.distributed import checkpoint as ckpt  # noqa: E402
from rlbits.models.heads import ValueModel  # noqa: E402
from rlbits.models.load import load_policy  # noqa: E402


def _folder(name: str, root: Path) -> Path:
    if name == "smollm2-135m":
        return _workload.build_smollm2_folder(root / "smollm2")
    return _workload.build_model_folder(root / "gpt2")


def _build(name: str, folder: Path) -> tuple[dict, dict]:
    """The models and optimizers a resume builds before it loads the checkpoint."""
    models = {"policy": load_policy(folder)}
    if name == "gpt2-11m-ppo":
        models["value_model"] = ValueModel.from_policy(load_policy(folder), seed=0)
    return models, {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in models.items()}


def _step(models: dict, optimizers: dict) -> None:
    """One optimizer step, so the checkpoint holds AdamW's moment estimates."""
    for name, model in models.items():
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizers[name].step()


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(name: str, root: Path, repeats: int) -> dict:
    folder = _folder(name, root)
    models, optimizers = _build(name, folder)
    _step(models, optimizers)
    save = {}
    for checksums in ("small", "all"):
        times = [_timed(lambda c=checksums: ckpt.save_checkpoint(root / f"run_{name}_{c}", 1, models=models,
                                                                  optimizers=optimizers, checksums=c))[0]
                 for _ in range(repeats)]
        save[checksums] = statistics.median(times)
    path = ckpt.list_checkpoints(root / f"run_{name}_all")[-1]
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    rows = []
    for _ in range(repeats):
        row = {"hash_alone": _timed(lambda: ckpt.verify_checkpoint(path, full=True))[0]}
        for verify in (False, True):
            build, (fresh, fresh_opts) = _timed(lambda: _build(name, folder))
            load, _ = _timed(
                lambda m=fresh, o=fresh_opts, v=verify: ckpt.load_checkpoint(
                    path, models=m, optimizers=o, verify=v
                )
            )
            row[f"build_{verify}"], row[f"load_{verify}"] = build, load
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    without = med["build_False"] + med["load_False"]
    cost = med["load_True"] - med["load_False"]
    return {
        "workload": name,
        "parameters": sum(p.numel() for m in models.values() for p in m.parameters()),
        "checkpoint_mb": round(size / 2**20, 1),
        "hash_threads": ckpt.manifest._workers(),
        "hash_alone_s": round(med["hash_alone"], 3),
        "resume_without_verify_s": round(without, 3),
        "of_which_load_checkpoint_s": round(med["load_False"], 3),
        "verify_cost_s": round(cost, 3),
        "verify_share_of_resume": round(cost / without, 4),
        "save_small_s": round(save["small"], 3),
        "save_all_s": round(save["all"], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=["gpt2-11m-ppo", "smollm2-135m"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            print(json.dumps(run(name, Path(tmp), args.repeats)), flush=True)


if __name__ == "__main__":
    main()
