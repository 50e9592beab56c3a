"""``ilql_standardize_rewards`` against trlx's ILQL ``make_experience`` (accelerate_ilql_trainer.py), re-written."""

import pytest
import torch

import rlbits


def trlx_returns(rewards):
    # trlx: torch.tensor(rewards, dtype=float), centre, divide by std + eps unless the std is NaN
    returns = torch.tensor(rewards, dtype=float)
    returns = returns - returns.mean()
    std_returns = returns.std()
    if not torch.isnan(std_returns):
        returns = returns / (std_returns + torch.finfo(returns.dtype).eps)
    return returns


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_matches_trlx(n):
    rewards = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3 + 1
    got = rlbits.ilql_standardize_rewards(rewards)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, trlx_returns(rewards.tolist()).float(), rtol=1e-6, atol=1e-6)
    same = torch.full((4,), 2.0)  # zero spread: centred to 0, divided by eps
    torch.testing.assert_close(rlbits.ilql_standardize_rewards(same), trlx_returns(same.tolist()).float())


def test_refuses_non_vectors():
    with pytest.raises(ValueError, match="rewards"):
        rlbits.ilql_standardize_rewards(torch.zeros(2, 2))
