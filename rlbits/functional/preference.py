"""Preference optimisation: per-sequence log-probabilities and the DPO family of pairwise losses, keyed by
TRL's ``DPOTrainer`` ``loss_type`` names.

A pair is a prompt with a preferred (chosen) and a dispreferred (rejected) response. Every DPO-style loss is a
function of the two sequences' **log-ratios** ``h = log pi_theta(y | x) - log pi_ref(y | x)`` (summed over
the response tokens: ``sequence_logprobs`` of the policy minus that of the frozen reference)::

    loss, metrics = dpo_loss(chosen_logratios, rejected_logratios, beta, loss_type="sigmoid")

``DPO_LOSS_TYPES`` maps each name to its per-pair loss ``fn(h_c, h_r, beta, *, label_smoothing,
chosen_lengths, rejected_lengths, simpo_gamma) -> [B]``; ``dpo_loss`` checks the inputs, averages it over
the pairs (or divides by a global ``num_pairs``) and adds TRL's logged metrics.

Source of truth: TRL v1.9.0 (commit 35def3e), ``trl/trainer/dpo_trainer.py`` ``DPOTrainer._compute_loss``
(with its default ``f_divergence_type="reverse_kl"``, under which TRL's "scores" are the log-ratios) and, for
``simpo``, ``trl/experimental/cpo/cpo_trainer.py`` ``CPOTrainer.cpo_loss``. Conventions that differ from TRL:

- ``sigmoid`` takes ``label_smoothing`` (conservative DPO, Mitchell 2023; TRL up to v0.28.0 and OpenRLHF's
  ``DPOLoss``): ``-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)``; TRL v1.9's ``sigmoid`` has
  none (eps = 0 is TRL's value).
- ``ipo`` divides each log-ratio by its response length, as TRL does, when ``chosen_lengths`` /
  ``rejected_lengths`` are given; without them it is the paper's Eq. 17 on summed log-ratios (OpenRLHF).
- a loss type that has no label smoothing refuses a non-zero ``label_smoothing`` (TRL ignores it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlbits.functional import _checks

__all__ = ["DPO_LOSS_TYPES", "dpo_loss", "sequence_logprobs"]


def sequence_logprobs(
    logprobs: torch.Tensor, action_mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Log-probability of each response: the sum (or with ``average`` the mean) of its tokens' logprobs.

    Padding never reaches the sum (its entries are replaced by 0 first), so padding holding any value, even
    ``inf`` or NaN, leaves the result and its gradient finite. A row without action tokens sums to 0 and
    averages to 0 (its length is clamped to 1, as TRL's ``clamp(min=1)``).

    Args:
        logprobs: [B, R] float, ``log pi(a_t | s_t)`` of the response tokens (nats).
        action_mask: [B, R] bool (or 0/1), True on the response's real tokens.
        average: divide by the number of action tokens (SimPO's length-normalised log-likelihood).

    Returns:
        [B] tensor: float32 for half-precision inputs, else ``logprobs``'s dtype.

    Raises:
        TypeError: an argument is not a tensor. ValueError: not 2-D, shapes differ, or ``logprobs`` is not
        floating point.
    """
    _checks.ndim("logprobs", logprobs, 2, "[B, R]")
    _checks.floating("logprobs", logprobs)
    _checks.same_shape(logprobs=logprobs, action_mask=action_mask)
    dtype = _checks.compute_dtype(logprobs)
    mask = action_mask.to(torch.bool)
    total = torch.where(mask, logprobs.to(dtype), torch.zeros((), dtype=dtype, device=logprobs.device)).sum(
        -1
    )
    if average:
        return total / mask.sum(-1).clamp(min=1).to(dtype)
    return total


# --- the per-pair losses: fn(h_c, h_r, beta, *, label_smoothing, chosen_lengths, rejected_lengths,
# simpo_gamma) -> [B]. d = h_c - h_r. ----------------------------------------------------------------------


def _sigmoid(h_c, h_r, beta, *, label_smoothing, **_):
    """DPO (Rafailov 2023, Eq. 7), conservative with ``label_smoothing`` (cDPO, Mitchell 2023):
    ``-(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)``."""
    logits = beta * (h_c - h_r)
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _hinge(h_c, h_r, beta, **_):
    """SLiC (Zhao 2023, Eq. 3 with the margin 1): ``relu(1 - beta d)``."""
    return torch.relu(1 - beta * (h_c - h_r))


def _ipo(h_c, h_r, beta, *, chosen_lengths, rejected_lengths, **_):
    """IPO (Azar 2023, Eq. 17; tau = beta): ``(d - 1 / (2 beta))^2``, with TRL's per-token log-ratios
    ``h / max(length, 1)`` when the lengths are given."""
    if chosen_lengths is not None:
        h_c = h_c / chosen_lengths.clamp(min=1)
        h_r = h_r / rejected_lengths.clamp(min=1)
    return (h_c - h_r - 1 / (2 * beta)) ** 2


def _robust(h_c, h_r, beta, *, label_smoothing, **_):
    """Robust DPO (Chowdhury 2024, Eq. 7), unbiased under a label-flip rate eps = ``label_smoothing`` < 1/2:
    ``(-(1 - eps) log sigmoid(beta d) + eps log sigmoid(-beta d)) / (1 - 2 eps)``."""
    logits = beta * (h_c - h_r)
    clean = -(1 - label_smoothing) * F.logsigmoid(logits)
    flipped = -label_smoothing * F.logsigmoid(-logits)
    return (clean - flipped) / (1 - 2 * label_smoothing)


def _bco_pair(h_c, h_r, beta, **_):
    """BCO on pairs (Jung 2024), TRL's form without the running reward shift:
    ``-log sigmoid(beta h_c) - log sigmoid(-beta h_r)``."""
    return -F.logsigmoid(beta * h_c) - F.logsigmoid(-beta * h_r)


def _sppo_hard(h_c, h_r, beta, **_):
    """SPPO (Wu 2024, Eq. 4.7) with hard probabilities (1 for the winner, 0 for the loser):
    ``(h_c - 1 / (2 beta))^2 + (h_r + 1 / (2 beta))^2``."""
    return (h_c - 0.5 / beta) ** 2 + (h_r + 0.5 / beta) ** 2


def _nca_pair(h_c, h_r, beta, **_):
    """NCA (Chen 2024, Eq. 11 for K = 2):
    ``-log sigmoid(beta h_c) - 1/2 log sigmoid(-beta h_c) - 1/2 log sigmoid(-beta h_r)``."""
    chosen, rejected = beta * h_c, beta * h_r
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _apo_zero(h_c, h_r, beta, **_):
    """APO-zero (D'Oosterlinck 2024, Eq. 7): ``1 - sigmoid(beta h_c) + sigmoid(beta h_r)``: the chosen
    likelihood rises, the rejected falls."""
    return (1 - torch.sigmoid(beta * h_c)) + torch.sigmoid(beta * h_r)


def _apo_down(h_c, h_r, beta, **_):
    """APO-down (D'Oosterlinck 2024, Eq. 8): ``sigmoid(beta h_c) + 1 - sigmoid(beta d)``: both likelihoods
    fall, the rejected one more."""
    return torch.sigmoid(beta * h_c) + (1 - torch.sigmoid(beta * (h_c - h_r)))


def _sigmoid_norm(h_c, h_r, beta, *, chosen_lengths, rejected_lengths, **_):
    """DPO on per-token log-ratios (TRL's ``sigmoid_norm``): ``-log sigmoid(beta (h_c / |y_c| - h_r / |y_r|))``,
    lengths clamped to >= 1."""
    d = h_c / chosen_lengths.clamp(min=1) - h_r / rejected_lengths.clamp(min=1)
    return -F.logsigmoid(beta * d)


def _simpo(h_c, h_r, beta, *, label_smoothing, simpo_gamma, **_):
    """SimPO (Meng 2024, Eq. 6), TRL ``CPOTrainer`` ``loss_type="simpo"``: no reference; ``h`` is the policy's
    length-normalised log-likelihood (``sequence_logprobs(average=True)``);
    ``-(1 - eps) log sigmoid(beta d - gamma) - eps log sigmoid(gamma - beta d)``."""
    logits = beta * (h_c - h_r - simpo_gamma / beta)
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


PairLoss = Callable[..., torch.Tensor]

DPO_LOSS_TYPES: dict[str, PairLoss] = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "robust": _robust,
    "bco_pair": _bco_pair,
    "sppo_hard": _sppo_hard,
    "nca_pair": _nca_pair,
    "apo_zero": _apo_zero,
    "apo_down": _apo_down,
    "sigmoid_norm": _sigmoid_norm,
    "simpo": _simpo,
}
"""TRL's ``loss_type`` name -> the per-pair loss ``fn(h_c, h_r, beta, *, label_smoothing, chosen_lengths,
rejected_lengths, simpo_gamma) -> [B]`` (``dpo_loss`` calls it; docs/preference.md has the table)."""

LABEL_SMOOTHING = frozenset({"sigmoid", "robust", "simpo"})
"""The loss types that take a ``label_smoothing``."""
NEEDS_LENGTHS = frozenset({"sigmoid_norm"})
"""The loss types that need ``chosen_lengths`` / ``rejected_lengths`` (``ipo`` uses them when given)."""
REFERENCE_FREE = frozenset({"simpo"})
"""The loss types whose inputs are the policy's own (length-normalised) log-likelihoods, not log-ratios."""


def dpo_loss(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    *,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    simpo_gamma: float = 0.5,
    num_pairs: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A DPO-family loss of preference pairs, as TRL's ``DPOTrainer`` computes it for ``loss_type``.

    With ``h_c``, ``h_r`` the chosen and rejected log-ratios and ``d = h_c - h_r``, ``sigmoid`` is DPO's
    ``-log sigmoid(beta d)`` (Rafailov 2023, Eq. 7); ``DPO_LOSS_TYPES``'s functions (and docs/preference.md)
    give every other type's formula and paper. ``simpo`` (Meng 2024) has no reference: pass the policy's
    length-normalised log-likelihoods (``sequence_logprobs(logprobs, mask, average=True)``) as the two
    "log-ratios"; its margin is ``simpo_gamma``.

    Args:
        chosen_logratios: [B] float, ``log pi_theta(y_c|x) - log pi_ref(y_c|x)`` summed over the response
            (``sequence_logprobs`` of the policy minus that of the reference), with gradient.
        rejected_logratios: [B] float, the same for the rejected response.
        beta: > 0, the inverse temperature (KL weight) of DPO; IPO's ``tau``, SPPO's ``1 / eta``.
        loss_type: a key of ``DPO_LOSS_TYPES``.
        label_smoothing: in [0, 1/2): the assumed rate of flipped labels (``sigmoid``: cDPO, ``robust``,
            ``simpo``); must be 0 for the other types.
        chosen_lengths, rejected_lengths: [B] response lengths in tokens (``ipo``: per-token log-ratios, as
            TRL; ``sigmoid_norm``: required); both or neither.
        simpo_gamma: SimPO's target reward margin gamma (TRL's ``simpo_gamma``).
        num_pairs: divide the summed per-pair loss by this (a global pair count, so microbatches add up to the
            batch's mean); None = the mean over the B pairs.

    Returns:
        ``(loss, metrics)``: ``loss`` 0-dim (float32 for half-precision inputs); ``metrics`` detached 0-dim
        means over the B pairs, as TRL logs them: ``rewards/chosen`` (``beta h_c``), ``rewards/rejected``
        (``beta h_r``), ``rewards/accuracies`` (the fraction with ``beta h_c > beta h_r``), ``rewards/margins``
        (``beta d``).

    Raises:
        TypeError: a log-ratio is not a tensor. ValueError: not 1-D, shapes differ, no pairs, an unknown
        ``loss_type``, ``beta`` <= 0, ``label_smoothing`` out of range or given to a type without it, lengths
        missing for ``sigmoid_norm`` or given for only one side.
    """
    for name, t in (("chosen_logratios", chosen_logratios), ("rejected_logratios", rejected_logratios)):
        _checks.ndim(name, t, 1, "[B]")
        _checks.floating(name, t)
    _checks.same_shape(chosen_logratios=chosen_logratios, rejected_logratios=rejected_logratios)
    if chosen_logratios.shape[0] == 0:
        raise ValueError("chosen_logratios is empty (B = 0); the loss is a mean over at least one pair")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}; got {loss_type!r}")
    _checks.in_range("beta", beta, 0.0, float("inf"), low_open=True, high_open=True)
    _checks.in_range("label_smoothing", label_smoothing, 0.0, 0.5, high_open=True)
    if label_smoothing != 0 and loss_type not in LABEL_SMOOTHING:
        raise ValueError(
            f"label_smoothing={label_smoothing!r} has no effect for loss_type={loss_type!r}; it is taken by "
            f"{', '.join(sorted(LABEL_SMOOTHING))}"
        )
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("chosen_lengths and rejected_lengths must be given together")
    if chosen_lengths is None and loss_type in NEEDS_LENGTHS:
        raise ValueError(
            f"loss_type={loss_type!r} needs chosen_lengths and rejected_lengths (response tokens)"
        )
    dtype = _checks.compute_dtype(chosen_logratios, rejected_logratios)
    h_c, h_r = chosen_logratios.to(dtype), rejected_logratios.to(dtype)
    if chosen_lengths is not None:
        _checks.same_shape(chosen_logratios=chosen_logratios, chosen_lengths=chosen_lengths)
        _checks.same_shape(chosen_logratios=chosen_logratios, rejected_lengths=rejected_lengths)
        chosen_lengths, rejected_lengths = chosen_lengths.to(dtype), rejected_lengths.to(dtype)
    per_pair = DPO_LOSS_TYPES[loss_type](
        h_c,
        h_r,
        beta,
        label_smoothing=label_smoothing,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        simpo_gamma=simpo_gamma,
    )
    loss = per_pair.mean() if num_pairs is None else per_pair.sum() / num_pairs
    chosen_rewards, rejected_rewards = beta * h_c.detach(), beta * h_r.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).to(dtype).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }
    return loss, metrics
