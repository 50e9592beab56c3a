"""Packed updates and token-budget microbatches under FSDP2 at 2 ranks (gloo on CPU, marked slow): the weights
after one update equal one process's padded update with row microbatches (tests/dist_worker.py). The ranks'
token-budget microbatch counts differ; ``pad_microbatches`` keeps them equal, with no effect on the step."""

from __future__ import annotations

import pytest
import torch
from test_dist import ROOT, python, torchrun

# the fields each 2-rank run overrides in tests/dist_worker.py (packed rows; a packed token budget of about
# two rows; a padded token budget)
CASES = {
    ("ppo", "packed"): ["pack_sequences=true"],
    ("rloo", "packed_budget"): ["pack_sequences=true", "max_tokens_per_microbatch=16"],
    ("rloo", "padded_budget"): ["max_tokens_per_microbatch=20"],
}


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "case"), list(CASES))
def test_packed_update_on_two_fsdp_ranks_equals_one_padded_process(algo, case, tmp_path):
    worker = str(ROOT / "tests" / "dist_worker.py")
    python(worker, algo, str(tmp_path / "one.pt"))
    torchrun(worker, algo, str(tmp_path / "two.pt"), *CASES[algo, case])
    one, two = (torch.load(tmp_path / f, weights_only=True) for f in ("one.pt", "two.pt"))
    for model in one:
        for name, a in one[model].items():
            b = two[model][name]
            assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-8, f"{model}.{name}"
