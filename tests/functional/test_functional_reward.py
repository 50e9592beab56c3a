"""Reward-model losses (rlbits.functional.reward) against Python-loop references: values and gradients on
random inputs, hand-computed values, bad shapes and dtypes, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import math

import pytest
import torch

import rlbits

F64 = dict(atol=1e-10, rtol=1e-9)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def ref_bradley_terry(chosen, rejected, margin=None, center_coef=0.0):
    """mean_i -log sigmoid(c_i - r_i - m_i) + center_coef * mean_i (c_i + r_i)^2, one pair at a time."""
    n = chosen.shape[0]
    total, center = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for i in range(n):
        d = chosen[i] - rejected[i] - (margin[i] if margin is not None else 0.0)
        total = total - torch.log(_sigmoid(d))
        center = center + (chosen[i] + rejected[i]) ** 2
    return total / n + center_coef * center / n


def ref_pointwise(rewards, labels):
    """mean_i -(y_i log sigmoid(r_i) + (1 - y_i) log(1 - sigmoid(r_i)))."""
    n = rewards.shape[0]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        p, y = _sigmoid(rewards[i]), float(labels[i])
        total = total - (y * torch.log(p) + (1 - y) * torch.log(1 - p))
    return total / n


def _leaf(gen, n, scale=2.0):
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).requires_grad_(True)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center_coef", [0.0, 0.01, 0.5])
def test_bradley_terry_matches_reference(seed, with_margin, center_coef):
    gen = torch.Generator().manual_seed(seed)
    n = 1 + seed * 3
    chosen, rejected = _leaf(gen, n), _leaf(gen, n)
    margin = torch.rand(n, generator=gen, dtype=torch.float64).requires_grad_(True) if with_margin else None
    got = rlbits.bradley_terry_loss(chosen, rejected, margin=margin, center_coef=center_coef)
    want = ref_bradley_terry(chosen, rejected, margin, center_coef)
    torch.testing.assert_close(got, want, **F64)
    leaves = [chosen, rejected] + ([margin] if with_margin else [])
    for g, w in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves), strict=True):
        torch.testing.assert_close(g, w, **F64)


def test_bradley_terry_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])
    # pair 0: -log sigmoid(1) = log(1 + e^-1); pair 1: log 2; centering: ((1)^2 + 0^2) / 2 = 0.5
    want = (math.log(1 + math.exp(-1)) + math.log(2)) / 2 + 0.1 * 0.5
    assert rlbits.bradley_terry_loss(chosen, rejected, center_coef=0.1).item() == pytest.approx(
        want, rel=1e-6
    )
    # a margin equal to the difference leaves log 2 for that pair
    out = rlbits.bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0]))
    assert out.item() == pytest.approx(math.log(2), rel=1e-6)


def test_bradley_terry_is_stable_for_large_differences():
    chosen, rejected = torch.tensor([-200.0, 200.0], requires_grad=True), torch.tensor([200.0, -200.0])
    loss = rlbits.bradley_terry_loss(chosen, rejected)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(200.0, rel=1e-5)  # (400 + 0) / 2
    (grad,) = torch.autograd.grad(loss, chosen)
    assert torch.isfinite(grad).all()


def test_bradley_terry_half_precision_computes_in_float32():
    c, r = torch.randn(5).bfloat16(), torch.randn(5).bfloat16()
    out = rlbits.bradley_terry_loss(c, r, center_coef=0.01)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rlbits.bradley_terry_loss(c.float(), r.float(), center_coef=0.01))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("labels_kind", ["float", "long", "bool", "soft"])
def test_pointwise_matches_reference(seed, labels_kind):
    gen = torch.Generator().manual_seed(seed)
    n = 1 + seed * 4
    rewards = _leaf(gen, n, scale=3.0)
    hard = torch.randint(0, 2, (n,), generator=gen)
    labels = {
        "float": hard.double(), "long": hard, "bool": hard.bool(),
        "soft": torch.rand(n, generator=gen, dtype=torch.float64),
    }[labels_kind]
    got = rlbits.pointwise_reward_loss(rewards, labels)
    want = ref_pointwise(rewards, labels)
    torch.testing.assert_close(got, want, **F64)
    torch.testing.assert_close(
        torch.autograd.grad(got, rewards)[0], torch.autograd.grad(want, rewards)[0], **F64
    )


def test_pointwise_by_hand():
    # r = 0: log 2 whatever the label; r = log 3 with y = 1: -log(3/4)
    got = rlbits.pointwise_reward_loss(torch.tensor([0.0, math.log(3)]), torch.tensor([1, 1]))
    assert got.item() == pytest.approx((math.log(2) - math.log(0.75)) / 2, rel=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: rlbits.bradley_terry_loss(torch.zeros(3), torch.zeros(4)), "rejected_rewards has shape"),
        (
            lambda: rlbits.bradley_terry_loss(torch.zeros(3, 1), torch.zeros(3, 1)),
            r"chosen_rewards must be \[B\]",
        ),
        (
            lambda: rlbits.bradley_terry_loss(torch.zeros(3), torch.zeros(3, dtype=torch.long)),
            "rejected_rewards must be a floating",
        ),
        (
            lambda: rlbits.bradley_terry_loss(torch.zeros(3), torch.zeros(3), margin=torch.zeros(2)),
            "margin has shape",
        ),
        (
            lambda: rlbits.bradley_terry_loss(torch.zeros(3), torch.zeros(3), center_coef=-0.1),
            "center_coef must be in",
        ),
        (
            lambda: rlbits.bradley_terry_loss(torch.zeros(3), torch.zeros(3), center_coef=float("nan")),
            "center_coef",
        ),
        (lambda: rlbits.bradley_terry_loss(torch.zeros(0), torch.zeros(0)), "empty"),
        (lambda: rlbits.pointwise_reward_loss(torch.zeros(3), torch.zeros(2)), "labels has shape"),
        (
            lambda: rlbits.pointwise_reward_loss(torch.zeros(3, 1), torch.zeros(3, 1)),
            r"rewards must be \[B\]",
        ),
        (
            lambda: rlbits.pointwise_reward_loss(torch.zeros(3, dtype=torch.long), torch.zeros(3)),
            "rewards must be a floating",
        ),
        (
            lambda: rlbits.pointwise_reward_loss(torch.zeros(3), torch.zeros(3, dtype=torch.complex64)),
            "labels must be",
        ),
    ],
)
def test_bad_input_names_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="chosen_rewards must be a torch.Tensor"):
        rlbits.bradley_terry_loss([1.0], torch.zeros(1))


@pytest.mark.slow
def test_compiled_losses_match_eager():
    gen = torch.Generator().manual_seed(0)
    c, r = (
        torch.randn(6, generator=gen, requires_grad=True),
        torch.randn(6, generator=gen, requires_grad=True),
    )
    m, y = torch.rand(6, generator=gen), torch.randint(0, 2, (6,), generator=gen)
    for fn, args, kwargs in (
        (rlbits.bradley_terry_loss, (c, r), {"margin": m, "center_coef": 0.01}),
        (rlbits.pointwise_reward_loss, (c, y), {}),
    ):
        eager = fn(*args, **kwargs)
        compiled = torch.compile(fn, fullgraph=True)(*args, **kwargs)
        torch.testing.assert_close(compiled, eager)
        leaves = [a for a in args if a.requires_grad]
        for g_c, g_e in zip(
            torch.autograd.grad(compiled, leaves), torch.autograd.grad(eager, leaves), strict=True
        ):
            torch.testing.assert_close(g_c, g_e)
