"""The advantage estimators of ``rlbits.ADVANTAGE_ESTIMATORS`` against slow references that follow verl's
``core_algos.py`` (verl v0.9.0, commit 483b8a0 of verl-project/verl: the ``compute_*_advantage`` functions)
line by line, in Python loops over prompt ids and tokens on float64 tensors.

verl groups rows by an ``index`` array of prompt ids; rlbits by contiguous rows of ``group_size``. Every
reference here takes verl's ``index``, built from the contiguous groups (``index[i] = i // K``), and groups
through it as verl does. Values are compared within 1e-5 relative on the action tokens (verl leaves values
on some masked positions; rlbits writes 0 there, checked separately). Gradients are not compared: the
estimators are not differentiated (verl computes them under ``torch.no_grad``; rlbits detaches the inputs),
which ``test_outputs_carry_no_gradient`` checks.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import pytest
import torch

import rlbits
from rlbits.functional import estimators

G, K, R = 4, 4, 7
B = G * K
TOL = dict(rtol=1e-5, atol=1e-8)

VERL_REGISTERED = {  # verl's AdvantageEstimator names
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "rloo_vectorized",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
}
NOT_REGISTERED = {"rloo_vectorized", "grpo_vectorized", "tir_optimal_token_baseline"}  # module docstring: why
RLBITS_ONLY = {"dr_grpo", "none"}
NEMO_RL = {"raw_reward", "grpo_loo"}  # NeMo-RL's estimators (nemo_rl/algorithms/advantage_estimator.py)


def _index():
    """verl's ``uid`` array for contiguous groups of K."""
    return [f"prompt-{i // K}" for i in range(B)]


def _inputs(seed=0, holes=False, token_noise=False):
    """(token_level_rewards, action_mask) [B, R] float64 / bool: right padding (or holes), an empty row,
    an outcome reward on the last action token, group 1 with all-equal rewards, group 2 with ties."""
    gen = torch.Generator().manual_seed(seed)
    if holes:
        mask = torch.rand(B, R, generator=gen) > 0.35
    else:
        lengths = torch.randint(1, R + 1, (B,), generator=gen)
        mask = torch.arange(R)[None, :] < lengths[:, None]
    mask[3] = False  # an empty row
    mask[5, :] = True  # a full row
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    scores[K : 2 * K] = 0.7  # all equal
    scores[2 * K : 3 * K] = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)  # 0/1 with ties
    scores[3] = 0.0  # the empty row
    tlr = rlbits.token_rewards(scores, mask)
    if token_noise:  # a KL penalty in the reward: every action token carries a reward
        tlr = tlr + torch.where(mask, 0.1 * torch.randn(B, R, generator=gen, dtype=torch.float64), 0.0)
    return tlr, mask


# --- references (verl's code, written out) ----------------------------------------------------------------


def ref_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def ref_masked_whiten(values, mask):
    mean = ref_masked_mean(values, mask)
    var = ref_masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    var = var * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def ref_gae(token_level_rewards, values, response_mask, gamma, lam):
    mask = response_mask.double()
    nextvalues, lastgaelam, reversed_ = 0.0, 0.0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        new_lastgaelam = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = new_lastgaelam * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    return ref_masked_whiten(advantages, mask), returns


def ref_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        if len(group) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(group)), torch.std(torch.stack(group))
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def ref_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def ref_nemo_rl_grpo(token_level_rewards, response_mask, index, leave_one_out=True, normalize=True):
    """NeMo-RL's ``GRPOAdvantageEstimator.compute_advantage`` with ``calculate_baseline_and_std_per_prompt``
    (nemo_rl/algorithms/advantage_estimator.py and utils.py, NVIDIA-NeMo/RL main) re-written: per prompt a
    mask matrix (1 - eye for leave-one-out), baseline and mean square by matmul over ``num_valid`` (every
    sample valid, minus one when leaving one out), std ``sqrt((E[r^2] - E[r]^2) n / (n - 1))`` with NaN (and
    inf) as 0, ``(r - baseline) / (std + 1e-6)`` only where ``std > 0``."""
    rewards = token_level_rewards.sum(dim=-1)
    prompts = torch.tensor([int(str(i).split("-")[-1]) for i in index])[:, None]
    valid = torch.ones_like(rewards)
    baseline, std = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for prompt in torch.unique(prompts, dim=0):
        idx = torch.arange(len(prompts))[(prompts == prompt).all(1)]
        n = len(idx)
        matrix = (1 - torch.eye(n)) if leave_one_out else torch.ones((n, n))
        matrix = matrix.to(rewards.dtype)
        if valid[idx].sum() <= 1:
            baseline[idx] = rewards[idx]
            continue
        num_valid = valid[idx].sum() - int(leave_one_out)
        base = torch.matmul(matrix, rewards[idx] * valid[idx]) / num_valid
        square = torch.matmul(matrix, torch.pow(rewards[idx], 2) * valid[idx]) / num_valid
        baseline[idx] = base
        std[idx] = ((square - base.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0)
    adv = (rewards - baseline).unsqueeze(-1)
    if normalize:
        nonzero = std > 0
        adv[nonzero] = adv[nonzero] / (std.unsqueeze(-1)[nonzero] + 1e-6)
    adv = adv.expand(response_mask.shape) * response_mask
    return adv, adv


def ref_grpo_passk(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2scores, id2indices = defaultdict(list), defaultdict(list)
    for i in range(scores.shape[0]):
        id2scores[index[i]].append(scores[i])
        id2indices[index[i]].append(i)
    for idx, group in id2scores.items():
        rewards = torch.stack(group)
        topk, topk_idx = torch.topk(rewards, 2)
        advantage = topk[0] - topk[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (torch.std(rewards) + epsilon)
        advantages[id2indices[idx][topk_idx[0].item()]] = advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def ref_reinforce_plus_plus_baseline(token_level_rewards, response_mask, index):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
    scores = ref_masked_whiten(scores, response_mask) * response_mask
    return scores, scores


def ref_opo(token_level_rewards, response_mask, index):
    response_length = response_mask.sum(dim=-1).double()
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score, id2len, id2bsl = defaultdict(list), defaultdict(list), {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
        id2len[index[i]].append(response_length[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2bsl[idx] = torch.tensor(0.0)
        else:
            score_tensor, len_tensor = torch.stack(id2score[idx]), torch.stack(id2len[idx])
            id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2bsl[index[i]]
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def ref_reinforce_plus_plus(token_level_rewards, response_mask, gamma):
    mask = response_mask.double()
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0.0
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = new_running_return * mask[:, t]
        running_return = new_running_return * mask[:, t] + running_return * (1 - mask[:, t])
    advantages = ref_masked_whiten(returns, mask) * mask
    return advantages, returns


def ref_remax(token_level_rewards, reward_baselines, response_mask):
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def ref_gpg(token_level_rewards, response_mask, index, f_norm=1.0):
    scores = token_level_rewards.sum(dim=-1).clone()
    bsz = scores.shape[0]
    alpha = bsz / torch.count_nonzero(scores).clamp(min=1)
    id2score, id2mean = defaultdict(list), {}
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx, group in id2score.items():
        id2mean[idx] = torch.tensor(0.0) if len(group) == 1 else torch.mean(torch.stack(group))
    for i in range(bsz):
        scores[i] = alpha * (scores[i] - id2mean[index[i]]) / f_norm
    scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def ref_optimal_token_baseline(
    token_level_rewards,
    response_mask,
    index,
    old_log_probs,
    sum_pi_squared,
    rollout_is_weights=None,
    handle_zero_tail=True,
    epsilon=1e-8,
):
    mask = response_mask.double()
    returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_per_timestep = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w_per_timestep = w_per_timestep * rollout_is_weights**2
    w_cumulative = (w_per_timestep * mask).cumsum(dim=-1)
    prompt_groups = defaultdict(list)
    for i in range(token_level_rewards.shape[0]):
        prompt_groups[index[i]].append(i)
    baselines = torch.zeros_like(returns)
    for trajectory_indices in prompt_groups.values():
        n = len(trajectory_indices)
        if n == 1:
            continue
        traj_idx = torch.tensor(trajectory_indices)
        returns_group, w_group, mask_group = returns[traj_idx], w_cumulative[traj_idx], mask[traj_idx]
        numerator = (returns_group * w_group * mask_group).sum(dim=0)
        denominator = (w_group * mask_group).sum(dim=0) + epsilon
        baselines[traj_idx] = (numerator / denominator).unsqueeze(0).expand(n, -1)
        if handle_zero_tail:
            lengths = mask_group.sum(dim=-1)
            sorted_lengths, _ = torch.sort(lengths)
            max_length, second_max_length = int(sorted_lengths[-1].item()), int(sorted_lengths[-2].item())
            max_length_idx = (lengths == max_length).nonzero(as_tuple=True)[0]
            if max_length_idx.numel() == 1 and max_length > second_max_length:
                baselines[trajectory_indices[int(max_length_idx[0])], second_max_length:] = 0.0
    advantages = (returns - baselines) * mask
    return advantages, returns


def ref_gdpo(token_level_rewards, response_mask, index, components, weights, epsilon=1e-6, norm=True):
    """verl's gdpo with ``gdpo_reward_keys``: each component placed at the response length - 1 (verl takes
    the length from the attention mask; an empty response's goes to position -1) and GRPO-normalised."""
    score_list = []
    last = response_mask.sum(-1).long() - 1
    for c in range(components.shape[1]):
        rm_scores = torch.zeros_like(token_level_rewards)
        rm_scores[torch.arange(rm_scores.shape[0]), last] = components[:, c]  # an empty row: index -1
        score_list.append(rm_scores)
    new_advantage = None
    for i, score in enumerate(score_list):
        normalized, _ = ref_grpo(score, response_mask, index, epsilon, norm)
        term = weights[i] * normalized
        new_advantage = term if new_advantage is None else new_advantage + term
    advantages = ref_masked_whiten(new_advantage, response_mask) * response_mask
    return advantages, advantages


# --- the comparisons ------------------------------------------------------------------------------------------


def _close(got, want, mask):
    """Equal on the action tokens; 0 elsewhere."""
    zero = torch.zeros((), dtype=want.dtype)
    torch.testing.assert_close(got, torch.where(mask, want, zero), **TOL)


def _cases(seed, holes, token_noise):
    tlr, mask = _inputs(seed, holes, token_noise)
    gen = torch.Generator().manual_seed(seed + 100)
    index = _index()
    values = torch.randn(B, R, generator=gen, dtype=torch.float64)
    baselines = torch.randn(B, generator=gen, dtype=torch.float64)
    old_lp = -3 * torch.rand(B, R, generator=gen, dtype=torch.float64)
    sum_pi2 = torch.rand(B, R, generator=gen, dtype=torch.float64) * torch.exp(old_lp)
    is_w = 0.5 + torch.rand(B, R, generator=gen, dtype=torch.float64)
    fm = mask.double()
    return (
        tlr,
        mask,
        {
            "grpo": ({"epsilon": 1e-6}, ref_grpo(tlr, fm, index)),
            "grpo_std_off": (
                {"norm_adv_by_std_in_grpo": False},
                ref_grpo(tlr, fm, index, norm_adv_by_std_in_grpo=False),
            ),
            "dr_grpo": ({}, ref_grpo(tlr, fm, index, norm_adv_by_std_in_grpo=False)),
            "rloo": ({}, ref_rloo(tlr, fm, index)),
            "grpo_loo": ({}, ref_nemo_rl_grpo(tlr, fm, index)),
            "none": ({}, (tlr.sum(-1, keepdim=True) * fm,) * 2),
            "gae": ({"values": values, "gamma": 0.9, "lam": 0.8}, ref_gae(tlr, values, mask, 0.9, 0.8)),
            "reinforce_plus_plus": ({"gamma": 0.9}, ref_reinforce_plus_plus(tlr, mask, 0.9)),
            "reinforce_plus_plus_baseline": ({}, ref_reinforce_plus_plus_baseline(tlr, fm, index)),
            "remax": ({"reward_baselines": baselines}, ref_remax(tlr, baselines, fm)),
            "opo": ({}, ref_opo(tlr, fm, index)),
            "gpg": ({"f_norm": 2.0}, ref_gpg(tlr, fm, index, f_norm=2.0)),
            "grpo_passk": ({}, ref_grpo_passk(tlr, fm, index)),
            "grpo_passk_std_off": (
                {"norm_adv_by_std_in_grpo": False},
                ref_grpo_passk(tlr, fm, index, norm_adv_by_std_in_grpo=False),
            ),
            "optimal_token_baseline": (
                {"old_logprobs": old_lp, "sum_pi_squared": sum_pi2},
                ref_optimal_token_baseline(tlr, mask, index, old_lp, sum_pi2),
            ),
            "optimal_token_baseline_is": (
                {
                    "old_logprobs": old_lp,
                    "sum_pi_squared": sum_pi2,
                    "rollout_is_weights": is_w,
                    "handle_zero_tail": False,
                },
                ref_optimal_token_baseline(tlr, mask, index, old_lp, sum_pi2, is_w, handle_zero_tail=False),
            ),
            "gdpo": ({}, ref_gdpo(tlr, fm, index, tlr.sum(-1, keepdim=True), [1.0])),
        },
    )


CASE_NAMES = list(_cases(0, False, False)[2])


@pytest.mark.parametrize("holes", [False, True], ids=["right_padded", "holes"])
@pytest.mark.parametrize("token_noise", [False, True], ids=["outcome", "per_token"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_estimator_matches_verl_reference(case, seed, token_noise, holes):
    tlr, mask, cases = _cases(seed, holes, token_noise)
    kwargs, (want_adv, want_ret) = cases[case]
    name = case.removesuffix("_std_off").removesuffix("_is")
    adv, ret = rlbits.ADVANTAGE_ESTIMATORS[name](tlr, mask, group_size=K, **kwargs)
    assert adv.dtype == ret.dtype == torch.float64
    _close(adv, want_adv, mask)
    _close(ret, want_ret, mask)


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_loo_matches_nemo_rl_on_groups_of_any_size(k, seed):
    """NeMo-RL's default GRPO advantage (leave-one-out baseline and std) for K = 2 (no division: one other
    reward has std 0 there), 3 and 5, with 0/1 groups (all equal, one differing) and random rewards."""
    gen = torch.Generator().manual_seed(seed)
    groups = 6
    scores = torch.randn(groups * k, generator=gen, dtype=torch.float64)
    scores[:k] = 1.0  # all equal
    scores[k : 2 * k] = 0.0
    scores[k] = 1.0  # one differs: its others are all equal (not divided), the rest are divided
    scores[2 * k : 3 * k] = torch.randint(0, 2, (k,), generator=gen).to(torch.float64)
    lengths = torch.randint(0, R + 1, (groups * k,), generator=gen)
    mask = torch.arange(R)[None, :] < lengths[:, None]  # right padding, empty rows included
    tlr = rlbits.token_rewards(scores, mask)
    index = [f"prompt-{i // k}" for i in range(groups * k)]
    adv, ret = rlbits.grpo_loo_advantage(tlr, mask, group_size=k)
    want, _ = ref_nemo_rl_grpo(tlr, mask.to(torch.float64), index)
    _close(adv, want, mask)
    assert ret is adv
    if k == 2:
        _close(adv, ref_rloo(tlr, mask.to(torch.float64), index)[0], mask)


def test_gdpo_components_and_weights_match_verl_reference():
    tlr, mask = _inputs(3)
    gen = torch.Generator().manual_seed(7)
    components = torch.randn(B, 3, generator=gen, dtype=torch.float64)
    components[:K, 1] = 1.0  # a component equal across group 0
    weights = [1.0, 0.5, 2.0]
    want, _ = ref_gdpo(tlr, mask.double(), _index(), components, weights)
    got, _ = rlbits.gdpo_advantage(
        tlr, mask, group_size=K, reward_components=components, gdpo_reward_weights=weights
    )
    _close(got, want, mask)


def test_global_sum_makes_a_part_compute_as_the_whole_batch():
    """A batch made of two copies of X: the estimators with batch statistics on X alone, with a ``global_sum``
    that doubles each sum (the other "rank" holds the same rows), give the whole batch's advantages, as the
    REINFORCE loop's all-reduce does under torchrun."""
    tlr, mask = _inputs(0, token_noise=True)
    values = torch.linspace(-1, 1, B * R, dtype=torch.float64).view(B, R)
    for name in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "gdpo", "raw_reward"):
        fn = rlbits.ADVANTAGE_ESTIMATORS[name]
        extra = {"values": values} if name == "gae" else {}
        double = {k: torch.cat([v, v]) for k, v in extra.items()}
        whole, _ = fn(torch.cat([tlr, tlr]), torch.cat([mask, mask]), group_size=K, **double)
        part, _ = fn(tlr, mask, group_size=K, global_sum=lambda t: 2 * t, **extra)
        torch.testing.assert_close(part, whole[:B], **TOL)
        alone, _ = fn(tlr, mask, group_size=K, **extra)
        if name not in ("gpg", "raw_reward"):  # ratios of sums that doubling leaves (raw_reward: biased var)
            assert not torch.allclose(alone, part), name  # the whitening's variance uses n - 1


def test_registry_holds_verl_names_and_rlbits_own():
    assert set(rlbits.ADVANTAGE_ESTIMATORS) == (VERL_REGISTERED - NOT_REGISTERED) | RLBITS_ONLY | NEMO_RL
    assert rlbits.ADVANTAGE_ESTIMATORS is estimators.ADVANTAGE_ESTIMATORS
    assert rlbits.functional.ADVANTAGE_ESTIMATORS is estimators.ADVANTAGE_ESTIMATORS
    for name, fn in rlbits.ADVANTAGE_ESTIMATORS.items():
        assert fn.__doc__ and len(fn.__doc__) > 150, name
        params = list(inspect.signature(fn).parameters)
        assert params[:2] == ["token_level_rewards", "action_mask"], name
        assert {"group_size", "global_sum"} <= set(params), name


def test_outputs_are_zero_off_the_mask_and_carry_no_gradient():
    tlr, mask = _inputs(1, holes=True, token_noise=True)
    tlr = (tlr + torch.where(mask, 0.0, 5.0)).requires_grad_(True)  # garbage on padding is ignored
    clean = torch.where(mask, tlr.detach(), 0.0)
    _, _, cases = _cases(1, True, True)
    for case, (kwargs, _) in cases.items():
        name = case.removesuffix("_std_off").removesuffix("_is")
        fn = rlbits.ADVANTAGE_ESTIMATORS[name]
        adv, ret = fn(tlr, mask, group_size=K, **kwargs)
        assert not adv.requires_grad and not ret.requires_grad, case
        assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask])), case
        want, _ = fn(clean, mask, group_size=K, **kwargs)
        torch.testing.assert_close(adv, want, rtol=0, atol=0)


def test_half_precision_rewards_compute_in_float32():
    tlr, mask = _inputs(0)
    adv, _ = rlbits.grpo_advantage(tlr.to(torch.bfloat16), mask, group_size=K)
    assert adv.dtype == torch.bfloat16
    adv, _ = rlbits.rloo_advantage(tlr.to(torch.int64), mask, group_size=K)  # integer rewards: float32 out
    assert adv.dtype == torch.float32


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t, m: rlbits.grpo_advantage(t, m, group_size=3), "not divisible by group_size 3"),
        (lambda t, m: rlbits.opo_advantage(t, m, group_size=1), "group_size must be >= 2"),
        (lambda t, m: rlbits.grpo_passk_advantage(t, m, group_size=K, epsilon=-1.0), "epsilon"),
        (lambda t, m: rlbits.gpg_advantage(t, m, group_size=K, f_norm=0.0), "f_norm"),
        (lambda t, m: rlbits.remax_advantage(t, m, reward_baselines=torch.zeros(3)), "reward_baselines"),
        (lambda t, m: rlbits.gae_advantage(t, m, values=torch.zeros(B, R + 1)), "values"),
        (lambda t, m: rlbits.reinforce_plus_plus_advantage(t, m, gamma=1.5), "gamma"),
        (lambda t, m: rlbits.grpo_advantage(t[0], m[0], group_size=K), r"\[B, R\]"),
        (
            lambda t, m: rlbits.gdpo_advantage(
                t, m, group_size=K, reward_components=torch.zeros(B, 2), gdpo_reward_weights=[1.0]
            ),
            "gdpo_reward_weights",
        ),
        (
            lambda t, m: rlbits.optimal_token_baseline_advantage(
                t, m, group_size=K, old_logprobs=torch.zeros(B, R), sum_pi_squared=torch.zeros(B, 2)
            ),
            "sum_pi_squared",
        ),
    ],
)
def test_bad_input_names_the_problem(call, match):
    tlr, mask = _inputs(0)
    with pytest.raises(ValueError, match=match):
        call(tlr, mask)


def ref_raw_reward(rewards, mask, normalize_advantages):
    """NeMo-RL ``RawRewardAdvantageEstimator.compute_advantage`` re-written: the reward expanded over the mask's
    shape, then mean and biased variance over the mask's tokens, ``rsqrt(clamp(var, 1e-8))``."""
    m = mask.to(torch.float64)
    adv = rewards.unsqueeze(-1).expand(mask.shape)
    if normalize_advantages:
        mean = (adv * m).sum() / m.sum().clamp(min=1)
        var = ((adv - mean).pow(2) * m).sum() / m.sum().clamp(min=1)
        adv = (adv - mean) * var.clamp(min=1e-8).rsqrt()
    return adv


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
def test_raw_reward_matches_nemo_rl_reference(holes, normalize):
    tlr, mask = _inputs(2, holes=holes)
    scores = tlr.sum(-1)
    adv, ret = rlbits.raw_reward_advantage(tlr, mask, group_size=K, normalize_advantages=normalize)
    want = ref_raw_reward(scores, mask, normalize)
    torch.testing.assert_close(adv[mask], want[mask], **TOL)  # NeMo-RL leaves values on padding; rlbits 0
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask])) and ret is adv
    if not normalize:
        torch.testing.assert_close(adv, rlbits.no_baseline_advantage(tlr, mask, group_size=K)[0], rtol=0, atol=0)
    one = torch.full_like(scores, 0.5)  # one reward everywhere: variance 0, clamped, advantages 0
    flat, _ = rlbits.raw_reward_advantage(rlbits.token_rewards(one, mask), mask)
    assert torch.equal(flat, torch.zeros_like(flat))
