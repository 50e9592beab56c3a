"""Packed updates and token-budget microbatches under FSDP2 at 2 ranks (gloo on CPU, marked slow): the weights
after one update equal one process's padded update with row microbatches (tests/dist_worker.py; the cases are
``UPDATE_CASES`` in conftest.py). The ranks' token-budget microbatch counts differ; ``pad_microbatches`` keeps
them equal, with no effect on the step."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["ppo-packed", "rloo-packed_budget", "rloo-padded_budget", "ppo-balanced", "rloo-balanced_packed"]
)
def test_packed_update_on_two_fsdp_ranks_equals_one_padded_process(case, fsdp_updates):
    one, two = (torch.load(f, weights_only=True) for f in fsdp_updates[case])
    for model in one:
        for name, a in one[model].items():
            b = two[model][name]
            assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-8, f"{model}.{name}"


@pytest.mark.slow
def test_balance_batch_moves_rows_to_even_out_the_ranks_tokens(fsdp_updates):
    """``balance_batch``: in each of the update's optimizer steps the 2 ranks keep the Karmarkar-Karp split of the
    minibatch's 8 rows by tokens (4 rows each), not the 4 + 4 rows each drew, and their token counts are closer
    than the drawn split's; the logged metrics are the drawn split's (the weights: the test above)."""
    import json

    from test_dist import ZERO_UP_TO_ROUNDING

    from rlbits.functional.packing import balanced_partition

    logged = json.loads(fsdp_updates["ppo-balanced"][1].with_suffix(".json").read_text())
    per_rank = logged.pop("_balanced_rows")  # [rank][optimizer step] -> tokens before and after, rows kept
    assert [len(steps) for steps in per_rank] == [2, 2]  # ppo_epochs=2, one minibatch each: both balanced
    for step in range(2):
        seen = [per_rank[rank][step] for rank in range(2)]
        tokens = seen[0]["before"] + seen[1]["before"]  # the minibatch's rows in rank order
        parts = balanced_partition(tokens, 2, equal_size=True)
        assert [s["rows"] for s in seen] == parts and len(parts[0]) == len(parts[1]) == 4
        assert [s["after"] for s in seen] == [[tokens[i] for i in rows] for rows in parts]
        drawn, kept = ([sum(s[when]) for s in seen] for when in ("before", "after"))
        assert abs(kept[0] - kept[1]) < abs(drawn[0] - drawn[1])  # the fixed batch's drawn split is uneven
    plain = json.loads(fsdp_updates["ppo"][1].with_suffix(".json").read_text())  # 2 ranks, rows as drawn
    assert set(logged) == set(plain)
    differ = {
        name: (a, logged[name])
        for name, a in plain.items()
        if logged[name] != pytest.approx(a, rel=1e-5, abs=ZERO_UP_TO_ROUNDING.get(("ppo", name), 1e-9))
    }
    assert not differ, f"balanced vs drawn rows logged different metrics (drawn, balanced): {differ}"
