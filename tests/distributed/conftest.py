"""The FSDP2 update-parity launches, shared by test_dist.py and test_packed_dist.py.

All the cases run in two launches of tests/dist_worker.py (one process for the references, ``torchrun`` at 2
ranks for the cases), made once per session (``made_once``): each launch pays ~10 s of imports and
process-group start on this 2-core machine, more than the updates themselves.
"""

from __future__ import annotations

import pytest

# case: (algo, the config fields its 2-rank run overrides). The one-process reference is always the padded
# update with row microbatches: packing (rows concatenated; a packed token budget of about two rows), a
# padded token budget and balancing the rows over the ranks must not change the step.
UPDATE_CASES = {
    "ppo": ("ppo", []),
    "rloo": ("rloo", []),
    "reinforce_plus_plus": ("reinforce_plus_plus", []),
    "ppo-packed": ("ppo", ["pack_sequences=true"]),
    "rloo-packed_budget": ("rloo", ["pack_sequences=true", "max_tokens_per_microbatch=16"]),
    "rloo-padded_budget": ("rloo", ["max_tokens_per_microbatch=20"]),
    "ppo-balanced": ("ppo", ["balance_batch=true"]),
    "rloo-balanced_packed": ("rloo", ["balance_batch=true", "pack_sequences=true", "max_tokens_per_microbatch=16"]),
}


@pytest.fixture(scope="session")
def fsdp_updates(made_once):
    """``{case: (one-process output, 2-rank output)}``: paths of tests/dist_worker.py's ``.pt`` files (each
    with its ``.json`` of logged metrics)."""
    from test_dist import ROOT, python, torchrun

    worker = str(ROOT / "tests" / "dist_worker.py")
    algos = sorted({algo for algo, _ in UPDATE_CASES.values()})

    def make(root):
        python(worker, *_joined([[algo, str(root / f"one_{algo}.pt")] for algo in algos]))
        cases = [[algo, str(root / f"two_{case}.pt"), *fields] for case, (algo, fields) in UPDATE_CASES.items()]
        torchrun(worker, *_joined(cases), timeout=480)

    root = made_once("fsdp_updates", make)
    return {case: (root / f"one_{algo}.pt", root / f"two_{case}.pt") for case, (algo, _) in UPDATE_CASES.items()}


def _joined(cases: list[list[str]]) -> list[str]:
    return [arg for i, case in enumerate(cases) for arg in (["+"] if i else []) + case]
