"""PPO's dynamic sampling on 2 ranks whose groups differ (tests/dynsamp_worker.py; gloo on CPU, no torchrun
agent): a rank full after its first generation batch joins the others' rounds, and the error past
``dynamic_sampling_max_gen_batches`` is raised on every rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "dynsamp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ppo_dynamic_sampling_on_two_ranks(tmp_path):
    policy = tmp_path / "policy"
    tiny_causal_lm("gpt2", 32, seed=0).save_pretrained(policy)
    tiny_tokenizer(32).save_pretrained(policy)
    port, procs = str(_free_port()), []
    for rank in (0, 1):
        environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, WORKER, str(policy), str(tmp_path)], stdout=log,
                                          stderr=subprocess.STDOUT, env=environ, cwd=ROOT))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in (0, 1))
    assert codes == [0, 0], logs
    uneven = [json.loads((tmp_path / f"uneven.rank{r}.json").read_text()) for r in (0, 1)]
    assert [u["outcome"] for u in uneven] == ["done", "done"], logs
    rows = uneven[0]["rows"]
    assert [r["step"] for r in rows] == [1, 2] and all(r["kept_groups"] == 4 for r in rows), rows
    assert all(r["gen_batches"] == 2 and r["discarded_groups"] == 1 for r in rows), rows  # rank 0: 3 kept 2
    assert uneven[1]["rows"] == rows  # rank 0 logs; both read the same metrics.jsonl
    for rank in (0, 1):
        error = json.loads((tmp_path / f"error.rank{rank}.json").read_text())
        assert error["outcome"] == "error", error
        assert error["message"].startswith("step 1, phase rollout: dynamic sampling: after "
                                           "dynamic_sampling_max_gen_batches=6 generation batches of 3 prompts")
        assert f"(this rank: {2 if rank == 0 else 0})" in error["message"]
