"""Hand-computed tiny examples: each expected number is worked out in the comment beside it."""

from __future__ import annotations

import math

import pytest
import torch

import rlbits

T, F = True, False


def t(*rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def close(a, b):
    expected = torch.as_tensor(b, dtype=a.dtype)
    if expected.dim() == 0 and a.numel() == 1:
        expected = expected.reshape(a.shape)
    torch.testing.assert_close(a, expected, atol=1e-9, rtol=1e-9)


def test_masked_statistics():
    x = t(1.0, 2.0, 3.0, 100.0)
    m = torch.tensor([T, T, T, F])
    close(rlbits.masked_sum(x, m), 6.0)
    close(rlbits.masked_mean(x, m), 2.0)
    close(rlbits.masked_var(x, m), 1.0)  # ((-1)^2 + 0 + 1^2) / (3 - 1)
    close(rlbits.masked_var(x, m, unbiased=False), 2 / 3)
    close(rlbits.masked_whiten(x, m, eps=0.0), [-1.0, 0.0, 1.0, 0.0])
    close(rlbits.masked_whiten(x, m, shift_mean=False, eps=0.0), [1.0, 2.0, 3.0, 0.0])  # std 1: scale kept
    close(rlbits.masked_mean(t([1.0, 5.0], [2.0, 4.0]), torch.tensor([[T, F], [T, T]]), dim=1), [1.0, 3.0])
    close(rlbits.masked_mean(x, torch.zeros(4, dtype=torch.bool)), 0.0)  # empty mask: 0, not NaN


def test_logprobs_and_entropy():
    logits = t([[0.0, math.log(3.0)]])  # probabilities 1/4, 3/4
    close(rlbits.logprobs_from_logits(logits, torch.tensor([[1]])), [[math.log(0.75)]])
    # temperature 0.5 doubles the logits: probabilities 1/10, 9/10
    close(rlbits.logprobs_from_logits(logits, torch.tensor([[0]]), temperature=0.5), [[math.log(0.1)]])
    close(rlbits.entropy_from_logits(logits), [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])


def test_kl_estimators():
    logp, ref = t(0.0), t(math.log(0.5))  # d = log 2
    d = math.log(2.0)
    close(rlbits.kl_penalty(logp, ref, "k1"), d)
    close(rlbits.kl_penalty(logp, ref, "abs"), d)
    close(rlbits.kl_penalty(ref, logp, "abs"), d)
    close(rlbits.kl_penalty(logp, ref, "k2"), 0.5 * d * d)
    close(rlbits.kl_penalty(logp, ref, "k3"), 0.5 + d - 1)  # exp(-d) = 1/2
    close(rlbits.kl_penalty(t(0.3), t(0.3), "k3"), 0.0)
    close(rlbits.kl_penalty(logp, ref, "k1", clamp=0.5), 0.5)  # log 2 = 0.69 clipped
    close(rlbits.kl_penalty(ref, logp, "k1", clamp=0.5), -0.5)
    close(rlbits.kl_penalty(logp, ref, "k3+"), 0.5 + d - 1)  # the value of k3
    close(rlbits.kl_penalty(logp, ref, "k1+", clamp=0.5), 0.5)


def test_adaptive_kl_controller():
    # KL 1.5x the target: error clipped to +0.2; 100 of 1000 horizon samples -> beta * 1.02
    close(torch.as_tensor(rlbits.adaptive_kl_coef(0.1, 9.0, 6.0, 1000, 100), dtype=torch.float64), 0.1 * 1.02)
    close(torch.as_tensor(rlbits.adaptive_kl_coef(0.1, 5.4, 6.0, 1000, 100), dtype=torch.float64), 0.1 * 0.99)
    with pytest.raises(ValueError, match="target and horizon"):
        rlbits.adaptive_kl_coef(0.1, 1.0, 0.0, 1000, 1)


def test_token_rewards():
    mask = torch.tensor([[T, T, F], [F, T, T], [F, F, F]])
    rewards = t(1.0, 2.0, 3.0)
    close(rlbits.token_rewards(rewards, mask), [[0, 1, 0], [0, 0, 2], [0, 0, 0]])  # row 3: no action token
    kl = t([0.5, 1.0, 9.0], [9.0, 2.0, 4.0], [9.0, 9.0, 9.0])
    close(
        rlbits.token_rewards(rewards, mask, kl=kl, kl_coef=0.1),
        [[-0.05, 1 - 0.1, 0], [0, -0.2, 2 - 0.4], [0, 0, 0]],
    )


def test_gae_skips_non_action_tokens():
    # Row: action, tool-output (masked, reward 5 and value 7 ignored), action. gamma = lam = 1:
    # A_2 = 1 - 0.9 = 0.1; delta_0 = 0 + V_2 - V_0 = 0.4; A_0 = 0.4 + A_2 = 0.5 (= return 1 - V_0).
    adv, ret = rlbits.gae(t([0.0, 5.0, 1.0]), t([0.5, 7.0, 0.9]), torch.tensor([[T, F, T]]), gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.0, 0.1]])
    close(ret, [[1.0, 0.0, 1.0]])


def test_gae_with_discounts():
    # gamma = lam = 0.5, r = [1, 0, 2], V = [0, 1, 0]:
    # A_2 = 2 - 0 = 2; A_1 = (0 + 0.5*0 - 1) + 0.25*2 = -0.5; A_0 = (1 + 0.5*1 - 0) + 0.25*(-0.5) = 1.375
    adv, ret = rlbits.gae(t([1.0, 0.0, 2.0]), t([0.0, 1.0, 0.0]), torch.ones(1, 3, dtype=torch.bool), 0.5, 0.5)
    close(adv, [[1.375, -0.5, 2.0]])
    close(ret, [[1.375, 0.5, 2.0]])
    # lam = 0 is one-step TD: A_0 = 1 + 0.5*1 - 0 = 1.5
    adv, _ = rlbits.gae(t([1.0, 0.0, 2.0]), t([0.0, 1.0, 0.0]), torch.ones(1, 3, dtype=torch.bool), 0.5, 0.0)
    close(adv, [[1.5, -1.0, 2.0]])


def test_group_baselines():
    r = t(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    close(rlbits.rloo_baseline(r, 3), [2.5, 2.0, 1.5, 5.5, 5.0, 4.5])
    close(rlbits.group_normalize(r, 3, eps=0.0), [-1.0, 0.0, 1.0, -1.0, 0.0, 1.0])  # std of (1,2,3) is 1
    close(rlbits.group_normalize(r, 3, scale=False), [-1.0, 0.0, 1.0, -1.0, 0.0, 1.0])
    close(rlbits.group_normalize(t(2.0, 2.0), 2), [0.0, 0.0])  # no spread -> no signal, not NaN
    # leave-one-out (NeMo-RL): sample 0 of [1, 0, 0] has others (0, 0), std 0: 1 - 0, not divided;
    # samples 1, 2 have others (1, 0): mean 0.5, std sqrt(0.5). In [1, 2, 4], sample 0: (1 - 3) / sqrt(2).
    s = math.sqrt(0.5)
    close(rlbits.group_normalize(t(1.0, 0.0, 0.0), 3, eps=0.0, std="leave_one_out"), [1.0, -0.5 / s, -0.5 / s])
    close(rlbits.group_normalize(t(1.0, 2.0, 4.0), 3, eps=0.0, std="leave_one_out")[0], -2.0 / math.sqrt(2.0))
    close(rlbits.group_normalize(t(1.0, 0.0, 0.0), 3, scale=False, std="leave_one_out"), [1.0, -0.5, -0.5])
    close(rlbits.group_normalize(t(3.0, 3.0, 3.0), 3, std="leave_one_out"), [0.0, 0.0, 0.0])


def test_aggregation_modes():
    per_token = t([1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [7.0, 7.0, 7.0])
    mask = torch.tensor([[T, T, F], [T, F, F], [F, F, F]])  # last row: filtered out entirely
    close(rlbits.aggregate_loss(per_token, mask, "token-mean"), 2.0)  # (1 + 2 + 3) / 3
    close(rlbits.aggregate_loss(per_token, mask, "seq-mean-token-mean"), 2.25)  # (1.5 + 3) / 2
    close(rlbits.aggregate_loss(per_token, mask, "seq-mean-token-sum"), 3.0)  # (3 + 3) / 2
    close(rlbits.aggregate_loss(per_token, mask, "token-mean", num_tokens=12), 0.5)
    close(rlbits.aggregate_loss(per_token, mask, "seq-mean-token-sum", num_seqs=4), 1.5)


def test_ppo_loss_clipping():
    ones = torch.ones(1, 1, dtype=torch.bool)

    def loss(ratio, adv, **kw):
        out, metrics = rlbits.ppo_loss(t([math.log(ratio)]), t([0.0]), t([adv]), ones, **kw)
        return out, metrics

    close(loss(1.1, 1.0)[0], -1.1)  # inside the clip range
    out, m = loss(1.5, 1.0)
    close(out, -1.2)  # max(-1.5, -1.2)
    close(m["clipfrac"], 1.0)
    close(loss(1.5, 1.0, clip_eps_high=0.28)[0], -1.28)  # clip-higher
    close(loss(0.5, -1.0)[0], 0.8)  # max(0.5, 0.8): clipped at 1 - eps
    close(loss(5.0, -1.0)[0], 5.0)  # ratio far above 1 with A < 0: unbounded ...
    out, m = loss(5.0, -1.0, dual_clip=3.0)
    close(out, 3.0)  # ... unless dual clip caps it at -c A = 3
    close(m["dual_clipfrac"], 1.0)
    close(loss(5.0, 1.0, dual_clip=3.0)[0], -1.2)  # dual clip leaves A > 0 alone


def test_value_loss_clipping():
    ones = torch.ones(1, 1, dtype=torch.bool)
    close(rlbits.value_loss(t([2.0]), t([1.0]), t([0.0]), ones)[0], 2.0)  # 0.5 * 2^2
    close(rlbits.value_loss(t([2.0]), t([1.0]), t([0.0]), ones, clip_eps=0.5)[0], 2.0)  # max(4, 1.5^2) / 2
    out, m = rlbits.value_loss(t([0.2]), t([1.0]), t([0.0]), ones, clip_eps=0.5)
    close(out, 0.125)  # max(0.04, 0.5^2) / 2: the clipped error is larger
    close(m["clipfrac"], 1.0)


def test_reinforce_loss():
    mask = torch.tensor([[T, T, F]])
    out, _ = rlbits.reinforce_loss(t([-1.0, -2.0, -9.0]), t([2.0, 2.0, 2.0]), mask)
    close(out, 3.0)  # -(2 * -1 + 2 * -2) / 2


def test_ilql_pieces():
    mask = torch.tensor([[T, F, T]])
    close(rlbits.ilql_targets(t([0.0, 9.0, 1.0]), t([1.0, 2.0, 3.0]), mask), [[3.0, 0.0, 1.0]])  # 0 + V_2; 1 + 0
    close(rlbits.ilql_targets(t([0.0, 9.0, 1.0]), t([1.0, 2.0, 3.0]), mask, gamma=0.5), [[1.5, 0.0, 1.0]])
    ones = torch.ones(1, 2, dtype=torch.bool)
    close(rlbits.q_loss(t([1.0, 0.0]), t([0.0, 2.0]), ones)[0], 2.5)  # (1 + 4) / 2
    # u = target - v = [1, -1]: weights tau = 0.7 and 1 - tau = 0.3
    close(rlbits.expectile_loss(t([0.0, 1.0]), t([1.0, 0.0]), ones, tau=0.7)[0], 0.5)
    q = t([[0.0, math.log(3.0)]])  # [1, 1, 2]: probabilities 1/4, 3/4
    close(rlbits.cql_loss(q, torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool))[0], -math.log(0.25))
    close(rlbits.awac_loss(q, torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool))[0], -math.log(0.75))
    # trlx's AWAC weight exp(beta (Q - V)): Q - V = log 2, beta = 1 -> weight 2
    weighted, m = rlbits.awac_loss(q, torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.bool), advantages=t([math.log(2.0)]), beta=1.0)
    close(weighted, -2.0 * math.log(0.75))
    close(m["awac_weight_mean"], 2.0)
    logits, qv, v = t([[1.0, 2.0]]), t([[3.0, 1.0]]), t([2.0])
    close(rlbits.ilql_logits(logits, qv, v, beta=2.0), [[[3.0, 0.0]]])  # logits + 2 (q - v)


# --- bad input --------------------------------------------------------------------------------------------

BAD = [
    (lambda: rlbits.masked_mean(torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool)), "mask has shape"),
    (lambda: rlbits.masked_mean(torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool)), "floating-point"),
    (lambda: rlbits.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "k4"), "unknown KL estimator 'k4'"),
    (lambda: rlbits.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4)), "ref_logprobs has shape"),
    (lambda: rlbits.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "k2+"), "unknown KL estimator 'k2\\+'"),
    (lambda: rlbits.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), clamp=0.0), r"clamp must be in \(0, inf\)"),
    (lambda: rlbits.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), clamp=-10.0), r"clamp must be in \(0, inf\), got -10"),
    (lambda: rlbits.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), clamp=math.inf), "clamp must be in"),
    (lambda: rlbits.logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)), "tokens has shape"),
    (lambda: rlbits.logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 3)), "integer"),
    (lambda: rlbits.logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), 0.0), "temperature"),
    (lambda: rlbits.token_rewards(torch.zeros(3), torch.ones(2, 4, dtype=torch.bool)), "rewards has 3 rows"),
    (lambda: rlbits.token_rewards(torch.zeros(2, 1), torch.ones(2, 4, dtype=torch.bool)), r"rewards must be \[B\]"),
    (lambda: rlbits.gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool)), "values has shape"),
    (lambda: rlbits.gae(torch.zeros(6), torch.zeros(6), torch.ones(6, dtype=torch.bool)), r"\[B, R\]"),
    (lambda: rlbits.rloo_baseline(torch.zeros(7), 2), "not divisible by group_size 2"),
    (lambda: rlbits.rloo_baseline(torch.zeros(4), 1), "group_size must be >= 2"),
    (lambda: rlbits.group_normalize(torch.zeros(6), 4), "not divisible"),
    (lambda: rlbits.group_normalize(torch.zeros(6), 2.0), "must be an int"),
    (lambda: rlbits.group_normalize(torch.zeros(6), 3, std="loo"), "unknown std 'loo'"),
    (lambda: rlbits.group_normalize(torch.zeros(6), 2, std="leave_one_out"), "leave_one_out\" needs group_size >= 3"),
    (lambda: rlbits.ppo_loss(*[torch.zeros(2, 3)] * 3, torch.ones(2, 3, dtype=torch.bool), agg="mean"), "unknown agg 'mean'"),
    (lambda: rlbits.ppo_loss(*[torch.zeros(2, 3)] * 3, torch.ones(2, 3, dtype=torch.bool), dual_clip=1.0), "dual_clip must be > 1"),
    (lambda: rlbits.ppo_loss(*[torch.zeros(2, 3)] * 3, torch.ones(2, 3, dtype=torch.bool), clip_eps=-0.1), "clip_eps"),
    (lambda: rlbits.ppo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool)), "advantages has shape"),
    (lambda: rlbits.value_loss(*[torch.zeros(2, 3)] * 3, torch.ones(2, 3, dtype=torch.bool), clip_eps=0.0), r"clip_eps must be in \(0, inf\)"),
    (lambda: rlbits.reinforce_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), agg="sum"), "unknown agg"),
    (lambda: rlbits.expectile_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), tau=1.0), "tau must be in"),
    (lambda: rlbits.cql_loss(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)), "must agree"),
    (lambda: rlbits.awac_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), beta=0.5), "needs advantages"),
    (lambda: rlbits.awac_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), advantages=torch.zeros(2, 4), beta=0.5), "advantages has shape"),
    (lambda: rlbits.awac_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), advantages=torch.zeros(2, 3), beta=math.nan), "beta must be"),
    (lambda: rlbits.ilql_logits(torch.zeros(2, 5), torch.zeros(2, 5), torch.zeros(5), 1.0), "v has shape"),
    (lambda: rlbits.ilql_targets(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool)), "action_mask has shape"),
]


@pytest.mark.parametrize("call,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_raises_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
