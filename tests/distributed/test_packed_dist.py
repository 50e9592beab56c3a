"""Packed updates and token-budget microbatches under FSDP2 at 2 ranks (gloo on CPU, marked slow): the weights
after one update equal one process's padded update with row microbatches (tests/dist_worker.py; the cases are
``UPDATE_CASES`` in conftest.py). The ranks' token-budget microbatch counts differ; ``pad_microbatches`` keeps
them equal, with no effect on the step."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ppo-packed", "rloo-packed_budget", "rloo-padded_budget"])
def test_packed_update_on_two_fsdp_ranks_equals_one_padded_process(case, fsdp_updates):
    one, two = (torch.load(f, weights_only=True) for f in fsdp_updates[case])
    for model in one:
        for name, a in one[model].items():
            b = two[model][name]
            assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-8, f"{model}.{name}"
