"""``rlbits.sequence_logprobs`` and ``rlbits.dpo_loss`` against references written from TRL's code: every
``DPO_LOSS_TYPES`` entry follows TRL v1.9.0 (commit 35def3e of huggingface/trl) ``DPOTrainer._compute_loss``
line by line (``simpo``: ``CPOTrainer.cpo_loss``; ``sigmoid`` with label smoothing: TRL v0.28.0's
``dpo_loss``), in float64 from per-token logprobs through masked sums: values and gradients. DPO and IPO are
also checked against OpenRLHF v0.11.0's ``DPOLoss``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rlbits
from rlbits.functional.preference import LABEL_SMOOTHING

B, R = 6, 8
BETA = 0.3


def _tokens(seed):
    """Per-token logprobs [2B, R] (chosen rows then rejected, as TRL's concatenated batch) of the policy and
    the reference, and the completion mask with right padding, holes and one empty row per side."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(2 * B, R, generator=gen) > 0.25
    mask[1] = False  # an empty chosen response
    mask[B + 3] = False  # an empty rejected response
    mask[4, 5:] = False  # right padding
    ref = -3.0 * torch.rand(2 * B, R, generator=gen, dtype=torch.float64) - 0.01
    policy = (ref + 0.5 * torch.randn(2 * B, R, generator=gen, dtype=torch.float64)).clamp(max=-1e-3)
    policy = torch.where(mask, policy, torch.full_like(policy, float("nan")))  # padding never reaches the sum
    return policy.requires_grad_(True), ref, mask


def _trl_logps(per_token_logps, completion_mask):
    """TRL: ``per_token_logps[mask == 0] = 0; logps = per_token_logps.sum(dim=1)``, written as a loop."""
    out = []
    for i in range(per_token_logps.shape[0]):
        total = per_token_logps.new_zeros(())
        for t in range(per_token_logps.shape[1]):
            if completion_mask[i, t]:
                total = total + per_token_logps[i, t]
        out.append(total)
    return torch.stack(out)


def _trl_dpo(policy, ref, mask, loss_type, beta, label_smoothing):
    """TRL v1.9.0 ``_compute_loss`` from the per-token logprobs on, f_divergence_type reverse_kl, one loss type;
    returns (loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins)."""
    logps = _trl_logps(policy, mask)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    ref_logps = _trl_logps(ref, mask)
    ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = chosen_logratios
    rejected_scores = rejected_logratios
    delta_score = chosen_scores - rejected_scores
    completion_mask = mask.to(torch.float64)
    # sigmoid: v0.28.0's form; with label_smoothing 0 it is v1.9.0's -logsigmoid(beta * delta)
    if loss_type == "sigmoid":
        per_sequence_loss = (
            -F.logsigmoid(beta * delta_score) * (1 - label_smoothing)
            - F.logsigmoid(-beta * delta_score) * label_smoothing
        )
    elif loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - beta * delta_score)
    elif loss_type == "ipo":
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
        ipo_delta = chosen_avg_score - rejected_avg_score
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    elif loss_type == "nca_pair":
        chosen_rewards = beta * chosen_scores
        rejected_rewards = beta * rejected_scores
        per_sequence_loss = (
            -F.logsigmoid(chosen_rewards)
            - 0.5 * F.logsigmoid(-chosen_rewards)
            - 0.5 * F.logsigmoid(-rejected_rewards)
        )
    elif loss_type == "robust":
        clean_loss_term = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
        flipped_loss_term = -label_smoothing * F.logsigmoid(-beta * delta_score)
        per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
    elif loss_type == "bco_pair":
        chosen_rewards = beta * chosen_scores
        rejected_rewards = beta * rejected_scores
        per_sequence_loss = -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)
    elif loss_type == "sppo_hard":
        winner_margin_error = (chosen_scores - 0.5 / beta) ** 2
        loser_margin_error = (rejected_scores + 0.5 / beta) ** 2
        per_sequence_loss = winner_margin_error + loser_margin_error
    elif loss_type == "apo_zero":
        losses_chosen = 1 - torch.sigmoid(beta * chosen_logratios)
        losses_rejected = torch.sigmoid(beta * rejected_logratios)
        per_sequence_loss = losses_chosen + losses_rejected
    elif loss_type == "apo_down":
        losses_chosen = torch.sigmoid(beta * chosen_logratios)
        losses_rejected = 1 - torch.sigmoid(beta * delta_score)
        per_sequence_loss = losses_chosen + losses_rejected
    elif loss_type == "sigmoid_norm":
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
        delta = chosen_avg_score - rejected_avg_score
        per_sequence_loss = -F.logsigmoid(beta * delta)
    else:
        raise AssertionError(loss_type)
    loss = per_sequence_loss.mean()
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    accuracies = (chosen_rewards > rejected_rewards).float().mean()
    margins = (chosen_rewards - rejected_rewards).mean()
    return loss, chosen_rewards.mean(), rejected_rewards.mean(), accuracies, margins


def _trl_simpo(policy, mask, beta, label_smoothing, simpo_gamma):
    """TRL v1.9.0 ``CPOTrainer``: ``get_batch_logps(average_log_prob=True)`` then ``cpo_loss`` (alpha 0)."""
    lengths = mask.sum(-1)
    logps = _trl_logps(policy, mask) / lengths.clamp(min=1)  # TRL divides by the mask sum; empty rows: 0 / 1
    policy_chosen_logps, policy_rejected_logps = logps.chunk(2, dim=0)
    logits = policy_chosen_logps - policy_rejected_logps
    gamma_logratios = simpo_gamma / beta
    logits = logits - gamma_logratios
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    )
    chosen_rewards = beta * policy_chosen_logps.detach()
    rejected_rewards = beta * policy_rejected_logps.detach()
    return (
        losses.mean(),
        chosen_rewards.mean(),
        rejected_rewards.mean(),
        (chosen_rewards > rejected_rewards).float().mean(),
        (chosen_rewards - rejected_rewards).mean(),
    )


def _rlbits(policy, ref, mask, loss_type, beta, label_smoothing, simpo_gamma=0.5, dtype=torch.float64):
    lengths = mask.sum(-1)
    if loss_type == "simpo":
        h = rlbits.sequence_logprobs(policy.to(dtype), mask, average=True)
    else:
        h = rlbits.sequence_logprobs(policy.to(dtype), mask) - rlbits.sequence_logprobs(ref.to(dtype), mask)
    h_c, h_r = h.chunk(2)
    len_c, len_r = lengths.chunk(2)
    loss, m = rlbits.dpo_loss(
        h_c,
        h_r,
        beta,
        loss_type,
        label_smoothing=label_smoothing,
        chosen_lengths=len_c,
        rejected_lengths=len_r,
        simpo_gamma=simpo_gamma,
    )
    return loss, m["rewards/chosen"], m["rewards/rejected"], m["rewards/accuracies"], m["rewards/margins"]


def _smoothing(loss_type):
    return 0.15 if loss_type in LABEL_SMOOTHING else 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss_type", sorted(rlbits.DPO_LOSS_TYPES))
def test_dpo_loss_equals_trl(loss_type, seed):
    policy, ref, mask = _tokens(seed)
    ls = _smoothing(loss_type)
    if loss_type == "simpo":
        want = _trl_simpo(policy, mask, BETA, ls, 0.5)
    else:
        want = _trl_dpo(policy, ref, mask, loss_type, BETA, ls)
    got = _rlbits(policy, ref, mask, loss_type, BETA, ls)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-5, atol=1e-7)
    (g_got,) = torch.autograd.grad(got[0], policy)
    (g_want,) = torch.autograd.grad(want[0], policy)
    # padding: TRL zeroes the NaN entries, so their gradient is 0 in both
    g_got, g_want = torch.where(mask, g_got, 0.0), torch.where(mask, g_want, 0.0)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-9)
    assert torch.isfinite(
        torch.autograd.grad(_rlbits(policy, ref, mask, loss_type, BETA, ls)[0], policy)[0]
    ).all()


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust"])
def test_label_smoothing_zero_is_trl_v1(loss_type):
    """With label_smoothing 0, ``sigmoid`` and ``robust`` are TRL v1.9.0's ``-logsigmoid(beta * delta)``."""
    policy, ref, mask = _tokens(3)
    got = _rlbits(policy, ref, mask, loss_type, BETA, 0.0)[0]
    h = _trl_logps(policy, mask) - _trl_logps(ref, mask)
    h_c, h_r = h.chunk(2)
    torch.testing.assert_close(got, (-F.logsigmoid(BETA * (h_c - h_r))).mean(), rtol=1e-5, atol=0)


def test_ipo_without_lengths_is_the_paper():
    """``ipo`` without lengths: Azar 2023 Eq. 17 on summed log-ratios (OpenRLHF's IPO)."""
    h_c, h_r = (
        torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64),
        torch.tensor([0.1, 0.5, -0.7], dtype=torch.float64),
    )
    loss, _ = rlbits.dpo_loss(h_c, h_r, 0.5, "ipo")
    torch.testing.assert_close(loss, ((h_c - h_r - 1.0) ** 2).mean())


def test_num_pairs_adds_microbatches_up():
    policy, ref, mask = _tokens(4)
    h = (rlbits.sequence_logprobs(policy, mask) - rlbits.sequence_logprobs(ref, mask)).detach()
    h_c, h_r = h.chunk(2)
    whole, _ = rlbits.dpo_loss(h_c, h_r, BETA)
    parts = sum(rlbits.dpo_loss(h_c[i : i + 2], h_r[i : i + 2], BETA, num_pairs=B)[0] for i in range(0, B, 2))
    torch.testing.assert_close(parts, whole)


def test_half_precision_computes_in_float32():
    h_c, h_r = torch.randn(4, dtype=torch.bfloat16), torch.randn(4, dtype=torch.bfloat16)
    loss, metrics = rlbits.dpo_loss(h_c, h_r, 0.1)
    assert loss.dtype == torch.float32 and metrics["rewards/margins"].dtype == torch.float32
    lp = torch.randn(2, 3, dtype=torch.float16)
    assert rlbits.sequence_logprobs(lp, torch.ones(2, 3, dtype=torch.bool)).dtype == torch.float32


@pytest.mark.parametrize("average", [False, True])
def test_sequence_logprobs_equals_a_loop(average):
    policy, _, mask = _tokens(5)
    got = rlbits.sequence_logprobs(policy, mask, average=average)
    want = _trl_logps(policy, mask)
    if average:
        want = want / mask.sum(-1).clamp(min=1)
    torch.testing.assert_close(got, want)
    assert got[1] == 0 and got[B + 3] == 0  # the empty rows
    (grad,) = torch.autograd.grad(got.sum(), policy)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()


def test_hand_computed_sigmoid():
    """One pair: h_c = 1, h_r = -1, beta = 0.5: loss = -log sigmoid(1) = log(1 + e^-1)."""
    loss, m = rlbits.dpo_loss(torch.tensor([1.0]), torch.tensor([-1.0]), 0.5)
    assert loss.item() == pytest.approx(0.31326168751822286)
    assert m["rewards/chosen"].item() == 0.5 and m["rewards/rejected"].item() == -0.5
    assert m["rewards/accuracies"].item() == 1.0 and m["rewards/margins"].item() == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "dpo"}, "loss_type must be one of"),
        ({"beta": 0.0}, "beta must be in"),
        ({"label_smoothing": 0.5, "loss_type": "robust"}, "label_smoothing must be in"),
        ({"label_smoothing": 0.1, "loss_type": "hinge"}, "no effect for loss_type='hinge'"),
        ({"loss_type": "sigmoid_norm"}, "needs chosen_lengths"),
        ({"chosen_lengths": torch.ones(3)}, "must be given together"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"beta": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        rlbits.dpo_loss(torch.zeros(3), torch.zeros(3), **args)


def test_bad_shapes():
    with pytest.raises(ValueError, match="shape"):
        rlbits.dpo_loss(torch.zeros(3), torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="empty"):
        rlbits.dpo_loss(torch.zeros(0), torch.zeros(0), 0.1)
    with pytest.raises(ValueError, match=r"\[B\]"):
        rlbits.dpo_loss(torch.zeros(3, 1), torch.zeros(3, 1), 0.1)
    with pytest.raises(ValueError, match="floating"):
        rlbits.sequence_logprobs(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))


def _openrlhf_dpo(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing, ipo):
    """OpenRLHF v0.11.0 (commit 3c3be62) ``openrlhf/models/loss.py`` ``DPOLoss.forward`` on summed logps."""
    pi_logratios = policy_chosen - policy_rejected
    ref_logratios = ref_chosen - ref_rejected
    logits = pi_logratios - ref_logratios
    if ipo:
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses.mean(), chosen_rewards, rejected_rewards


@pytest.mark.parametrize(("loss_type", "label_smoothing"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_and_ipo_equal_openrlhf(loss_type, label_smoothing):
    """OpenRLHF's DPO (cDPO with label smoothing) and IPO; its IPO is on summed log-ratios: no lengths given."""
    policy, ref, mask = _tokens(6)
    logps, ref_logps = rlbits.sequence_logprobs(policy, mask), rlbits.sequence_logprobs(ref, mask)
    (p_c, p_r), (r_c, r_r) = logps.chunk(2), ref_logps.chunk(2)
    want, want_c, want_r = _openrlhf_dpo(p_c, p_r, r_c, r_r, BETA, label_smoothing, loss_type == "ipo")
    got, m = rlbits.dpo_loss(p_c - r_c, p_r - r_r, BETA, loss_type, label_smoothing=label_smoothing)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(m["rewards/chosen"], want_c.mean())
    torch.testing.assert_close(m["rewards/rejected"], want_r.mean())
    g_got, g_want = (torch.autograd.grad(x, policy, retain_graph=True)[0] for x in (got, want))
    torch.testing.assert_close(
        torch.where(mask, g_got, 0.0), torch.where(mask, g_want, 0.0), rtol=1e-5, atol=1e-9
    )
