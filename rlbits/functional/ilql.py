"""Implicit Language Q-Learning (Snell 2022, "Offline RL for natural language generation with implicit
language Q learning"): targets, the Q / V / CQL / AWAC losses, and steered logits.

Per action token t of a response: two Q heads give Q(s_t, .) over the vocabulary, a V head gives V(s_t).
The losses follow the paper's eq. 1-4 and trlx's ``ILQLConfig.loss``; targets skip non-action tokens as
``gae`` does.
"""

from __future__ import annotations

import torch

from rlbits.functional import _checks
from rlbits.functional.advantages import next_action_values
from rlbits.functional.logprobs import logprobs_from_logits
from rlbits.functional.losses import aggregate_loss
from rlbits.functional.masked import masked_mean


def ilql_targets(
    token_rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Bellman targets for the Q heads: ``r_t + gamma V(s_next)``.

    ``s_next`` is the state before the next action token (non-action positions skipped, as in ``gae``);
    after a row's last action token V = 0 (terminal). Usually called with target-free, detached V.

    Args:
        token_rewards: [B, R] per-token rewards.
        values: [B, R] V(s_t) from the V head.
        action_mask: [B, R] bool.
        gamma: discount per action token.

    Returns:
        [B, R] in the promoted input dtype; 0 where ``action_mask`` is False.

    Raises:
        ValueError: inputs are not all [B, R] of one shape.
    """
    for name, t in (("token_rewards", token_rewards), ("values", values), ("action_mask", action_mask)):
        _checks.ndim(name, t, 2, "[B, R]")
    _checks.in_range("gamma", gamma, 0, 1)
    _checks.same_shape(token_rewards=token_rewards, values=values, action_mask=action_mask)
    out_dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    dtype = _checks.compute_dtype(token_rewards, values)
    mask = action_mask.to(torch.bool)
    next_v = next_action_values(values.to(dtype), mask)
    targets = token_rewards.to(dtype) + gamma * next_v
    return torch.where(mask, targets, torch.zeros((), dtype=dtype, device=targets.device)).to(out_dtype)


def _check(action_mask: torch.Tensor, **tensors: torch.Tensor) -> torch.dtype:
    _checks.ndim("action_mask", action_mask, 2, "[B, R]")
    for name, t in tensors.items():
        _checks.floating(name, t)
    _checks.same_shape(action_mask=action_mask, **tensors)
    return _checks.compute_dtype(*tensors.values())


def q_loss(
    q_values: torch.Tensor,
    targets: torch.Tensor,
    action_mask: torch.Tensor,
    num_tokens: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Q regression: masked mean of ``(Q(s_t, a_t) - target_t)^2`` (Snell 2022, eq. 2). ``targets`` detached.

    Args:
        q_values: [B, R] Q of the taken tokens (one head; call once per head).
        targets: [B, R] from ``ilql_targets``.
        action_mask: [B, R] bool.
        num_tokens: global denominator (see ``aggregate_loss``).

    Returns:
        ``(loss, metrics)`` with metrics ``q_mean``, ``target_mean``.

    Raises:
        ValueError: mismatched shapes.
    """
    dtype = _check(action_mask, q_values=q_values, targets=targets)
    mask = action_mask.to(torch.bool)
    q = q_values.to(dtype)
    t = targets.detach().to(dtype)
    loss = aggregate_loss((q - t) ** 2, mask, "token-mean", num_tokens)
    return loss, {"q_mean": masked_mean(q.detach(), mask), "target_mean": masked_mean(t, mask)}


def expectile_loss(
    values: torch.Tensor,
    target_q: torch.Tensor,
    action_mask: torch.Tensor,
    tau: float = 0.7,
    num_tokens: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Expectile regression of V towards the target Q: masked mean of ``|tau - 1(u < 0)| u^2``,
    ``u = target_q - V`` (Kostrikov 2021, IQL, eq. 5; Snell 2022, eq. 3). ``target_q`` detached.

    Args:
        values: [B, R] V(s_t), with grad.
        target_q: [B, R] target-network Q of the taken tokens (min over the two heads).
        action_mask: [B, R] bool.
        tau: expectile in (0, 1); 0.5 is plain regression, larger tracks the upper tail.
        num_tokens: global denominator.

    Returns:
        ``(loss, metrics)`` with metric ``v_mean``.

    Raises:
        ValueError: mismatched shapes, ``tau`` outside (0, 1).
    """
    _checks.in_range("tau", tau, 0, 1, low_open=True, high_open=True)
    dtype = _check(action_mask, values=values, target_q=target_q)
    mask = action_mask.to(torch.bool)
    v = values.to(dtype)
    u = target_q.detach().to(dtype) - v
    weight = (tau - (u < 0).to(dtype)).abs()  # |tau - 1(u < 0)|, in the input's precision
    loss = aggregate_loss(weight * u * u, mask, "token-mean", num_tokens)
    return loss, {"v_mean": masked_mean(v.detach(), mask)}


def _token_nll(logits: torch.Tensor, actions: torch.Tensor, action_mask: torch.Tensor, name: str) -> torch.Tensor:
    """``-log softmax(logits)[action]`` per token, [B, R], after checking the shapes and dtypes."""
    _checks.ndim("action_mask", action_mask, 2, "[B, R]")
    _checks.ndim(name, logits, 3, "[B, R, V]")
    _checks.floating(name, logits)
    _checks.integer("actions", actions)
    if logits.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary dimension (shape {tuple(logits.shape)})")
    if logits.shape[:2] != action_mask.shape or actions.shape != action_mask.shape:
        raise ValueError(
            f"{name} {tuple(logits.shape)}, actions {tuple(actions.shape)} and action_mask "
            f"{tuple(action_mask.shape)} must agree on [B, R]"
        )
    return -logprobs_from_logits(logits, actions)


def _masked_nll(
    logits: torch.Tensor, actions: torch.Tensor, action_mask: torch.Tensor, num_tokens, name: str
) -> torch.Tensor:
    return aggregate_loss(_token_nll(logits, actions, action_mask, name), action_mask, "token-mean", num_tokens)


def cql_loss(
    q_logits: torch.Tensor,
    actions: torch.Tensor,
    action_mask: torch.Tensor,
    num_tokens: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Conservative Q penalty: cross-entropy of the taken token under ``softmax(Q(s_t, .))``.

    ``logsumexp_a Q(s, a) - Q(s, a_t)``, masked mean (Kumar 2020, CQL(H); Snell 2022, eq. 4): pushes down
    Q of tokens the dataset did not take.

    Args:
        q_logits: [B, R, V] Q values over the vocabulary (one head; call once per head).
        actions: [B, R] int64 taken tokens.
        action_mask: [B, R] bool.
        num_tokens: global denominator.

    Returns:
        ``(loss, {})``.

    Raises:
        ValueError: mismatched shapes.
    """
    return _masked_nll(q_logits, actions, action_mask, num_tokens, "q_logits"), {}


def awac_loss(
    logits: torch.Tensor,
    actions: torch.Tensor,
    action_mask: torch.Tensor,
    num_tokens: int | torch.Tensor | None = None,
    *,
    advantages: torch.Tensor | None = None,
    beta: float | torch.Tensor = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantage-weighted NLL of the dataset tokens, masked mean (ILQL's AWAC term; Nair 2020, AWAC).

    Per action token ``w_t * -log pi(a_t | s_t)`` with ``w_t = exp(beta * advantages_t)``, where
    ``advantages_t = Q_target(s_t, a_t) - V(s_t)``. As in trlx's ``ILQLConfig.loss``
    (``trlx/models/modeling_ilql.py`` at CarperAI/trlx main, commit 3340c2f, the same in v0.7.0): the
    weight is computed without gradient (``advantages`` are detached here), is not clipped, and multiplies
    each token's cross-entropy before the masked mean; trlx uses the min over its target Q heads of the taken
    token for ``Q_target`` and its V head for ``V``, and its default ``beta`` is 0 (plain NLL).
    ``beta=0`` (default) is weight 1: the plain NLL, with ``advantages`` not needed. Large
    ``beta * advantages`` overflow ``exp``; the caller picks beta (trlx documents (0, 1)).

    Args:
        logits: [B, R, V] policy logits aligned with ``actions``.
        actions: [B, R] int64.
        action_mask: [B, R] bool.
        num_tokens: global denominator.
        advantages: keyword-only; [B, R] float ``Q_target - V`` of the taken tokens, or None (weight 1;
            then ``beta`` must be 0).
        beta: keyword-only; AWAC temperature, a finite number or 0-dim tensor.

    Returns:
        ``(loss, metrics)``: metrics ``{}`` without ``advantages``; with them ``awac_weight_mean`` and
        ``awac_weight_max`` over action tokens (detached; 0 for an empty mask).

    Raises:
        ValueError: mismatched shapes, non-finite ``beta``, or ``beta != 0`` without ``advantages``.
    """
    _checks.finite("beta", beta)
    if advantages is None:
        if not isinstance(beta, torch.Tensor) and beta != 0:
            raise ValueError(f"awac_loss with beta={beta!r} needs advantages (Q_target - V), got None")
        return _masked_nll(logits, actions, action_mask, num_tokens, "logits"), {}
    nll = _token_nll(logits, actions, action_mask, "logits")
    _checks.floating("advantages", advantages)
    _checks.same_shape(action_mask=action_mask, advantages=advantages)
    mask = action_mask.to(torch.bool)
    dtype = _checks.compute_dtype(logits, advantages)
    zero = torch.zeros((), dtype=dtype, device=logits.device)
    # Masked before exp: padding may hold anything, and exp(inf) * 0 would be NaN.
    adv = torch.where(mask, advantages.detach().to(dtype), zero)
    weight = torch.exp(beta * adv)
    loss = aggregate_loss(weight * nll.to(dtype), mask, "token-mean", num_tokens)
    metrics = {
        "awac_weight_mean": masked_mean(weight, mask),
        "awac_weight_max": torch.where(mask, weight, zero).amax() if weight.numel() else zero,
    }
    return loss, metrics


def ilql_logit_mask(logits: torch.Tensor, prev_tokens: torch.Tensor, logit_mask: torch.Tensor) -> torch.Tensor:
    """trlx's ILQL ``logit_mask``: the logits of the tokens not allowed after the previous token set to -inf.

    ``logit_mask[i, j]`` True forbids token j right after token i, as trlx's
    ``logits[torch.where(logit_mask[input_ids[:, -1]])] = -inf`` in ``AutoModelForCausalLMWithILQLHeads.generate``
    (``trlx/models/modeling_ilql.py``, 3340c2f). The previous token of the logits at position t is the input
    token at t (the logits at t choose token t + 1). A row whose every token is forbidden has no distribution
    (sampling it raises in ``generate``). No host sync: ids outside ``[0, V)`` fail in the indexing.

    Args:
        logits: [..., V] float logits.
        prev_tokens: [...] int64, the token each row of ``logits`` follows.
        logit_mask: [V, V] bool, True = not allowed after the row's token.

    Returns:
        [..., V] in the dtype of ``logits``, a new tensor.

    Raises:
        ValueError: ``logit_mask`` is not a [V, V] bool tensor of the vocabulary of ``logits``, ``prev_tokens``
            not integer or not ``logits.shape[:-1]``.
    """
    _checks.tensor("logits", logits)
    _checks.tensor("logit_mask", logit_mask)
    _checks.integer("prev_tokens", prev_tokens)
    vocab = logits.shape[-1]
    if logit_mask.dtype != torch.bool or tuple(logit_mask.shape) != (vocab, vocab):
        raise ValueError(
            f"logit_mask must be a bool [V, V] tensor with V = {vocab} (the logits' vocabulary), got "
            f"{logit_mask.dtype} {tuple(logit_mask.shape)}"
        )
    if prev_tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"prev_tokens has shape {tuple(prev_tokens.shape)} but must be logits.shape[:-1] = "
            f"{tuple(logits.shape[:-1])}"
        )
    forbidden = logit_mask.to(logits.device)[prev_tokens.to(logits.device)]
    return logits.masked_fill(forbidden, float("-inf"))


def ilql_logits(
    logits: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    beta: float,
    *,
    logit_mask: torch.Tensor | None = None,
    prev_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steered decoding logits ``logits + beta (Q(s, .) - V(s))`` (Snell 2022, eq. 5), with trlx's optional
    ``logit_mask`` (``ilql_logit_mask``): forbidden tokens get -inf.

    trlx (``generate`` in ``trlx/models/modeling_ilql.py``) masks the LM's logits, then samples from
    ``softmax(topk(log_softmax(logits) + beta * (Q - V)) / temperature)``; ``log_softmax`` shifts each row by a
    constant and -inf plus a finite number stays -inf, so these logits followed by ``generate``'s temperature
    and ``top_k`` give the same distribution.

    Args:
        logits: [..., V] policy logits.
        q: [..., V] Q values (typically min of the two target heads).
        v: [...] V(s).
        beta: steering strength (0 = the policy itself).
        logit_mask: keyword-only; [V, V] bool, True = token j not allowed after token i; None: no mask.
        prev_tokens: keyword-only; [...] int64, the token each row follows (needed with ``logit_mask``).

    Returns:
        [..., V] in the dtype of ``logits``.

    Raises:
        ValueError: shapes disagree; ``logit_mask`` without ``prev_tokens``; as ``ilql_logit_mask``.
    """
    _checks.same_shape(logits=logits, q=q)
    _checks.tensor("v", v)
    _checks.finite("beta", beta)
    if v.shape != logits.shape[:-1]:
        raise ValueError(f"v has shape {tuple(v.shape)} but must be logits.shape[:-1] = {tuple(logits.shape[:-1])}")
    steered = (logits + beta * (q - v.unsqueeze(-1))).to(logits.dtype)
    if logit_mask is None:
        return steered
    if prev_tokens is None:
        raise ValueError("ilql_logits with logit_mask needs prev_tokens (the token each row of logits follows)")
    return ilql_logit_mask(steered, prev_tokens, logit_mask)


def ilql_standardize_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """trlx's ILQL returns: ``(r - mean) / (std + eps)`` over the whole offline set, as
    ``make_experience`` in ``trlx/trainer/accelerate_ilql_trainer.py`` (3340c2f) computes them: in float64,
    ``std`` unbiased, ``eps`` float64's machine epsilon; a NaN ``std`` (one sample) leaves the centred values
    undivided.

    Args:
        rewards: [N] sequence rewards, any float dtype.

    Returns:
        [N] in the dtype of ``rewards``.

    Raises:
        ValueError: ``rewards`` is not a 1-D float tensor.
    """
    _checks.tensor("rewards", rewards)
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor, got shape {tuple(rewards.shape)} {rewards.dtype}")
    returns = rewards.to(torch.float64)
    returns = returns - returns.mean()
    std = returns.std() if returns.numel() > 1 else torch.tensor(float("nan"), dtype=torch.float64)
    if not torch.isnan(std):
        returns = returns / (std + torch.finfo(torch.float64).eps)
    return returns.to(rewards.dtype)
