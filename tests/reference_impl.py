"""Slow, obviously-right reference implementations of the functional kernels.

Python loops over rows and tokens on float64 torch scalars (so autograd gives reference gradients too).
Each mirrors the formula in the kernel's docstring, written as plainly as possible.
"""

from __future__ import annotations

import math

import torch


def _cells(x):
    return x.reshape(-1)


def masked_mean(x, mask):
    vals = [v for v, m in zip(_cells(x), _cells(mask), strict=False) if m]
    return sum(vals) / len(vals) if vals else torch.zeros((), dtype=torch.float64)


def masked_sum(x, mask):
    return sum((v for v, m in zip(_cells(x), _cells(mask), strict=False) if m), torch.zeros((), dtype=torch.float64))


def masked_var(x, mask, unbiased=True):
    vals = [v for v, m in zip(_cells(x), _cells(mask), strict=False) if m]
    n = len(vals)
    if n == 0:
        return torch.zeros((), dtype=torch.float64)
    mean = sum(vals) / n
    ss = sum((v - mean) ** 2 for v in vals)
    return ss / max(n - 1 if unbiased else n, 1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = torch.zeros_like(x)
    for idx in range(x.numel()):
        if _cells(mask)[idx]:
            val = (_cells(x)[idx] - mean) / torch.sqrt(var + eps)
            if not shift_mean:
                val = val + mean
            out.view(-1)[idx] = val
    return out


def logprobs(logits, tokens, temperature=1.0):
    B, R, V = logits.shape
    rows = []
    for b in range(B):
        row = []
        for t in range(R):
            z = [logits[b, t, v] / temperature for v in range(V)]
            lse = torch.log(sum(torch.exp(zv) for zv in z))
            row.append(z[int(tokens[b, t])] - lse)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def entropy(logits, temperature=1.0):
    B, R, V = logits.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        for t in range(R):
            z = logits[b, t].detach() / temperature
            p = [math.exp(float(z[v])) for v in range(V)]
            s = sum(p)
            out[b, t] = -sum((pv / s) * math.log(pv / s) for pv in p)
    return out


def _kl_value(d, estimator):
    base = estimator.rstrip("+")
    if base == "k1":
        return d
    if base == "abs":
        return abs(d)
    if base == "k2":
        return 0.5 * d * d
    return math.exp(-d) - (-d) - 1


def kl(logprobs, ref_logprobs, estimator, clamp=None):
    """Per-token value; ``k1+`` / ``k3+`` have the value of ``k1`` / ``k3``; ``clamp`` clips it to [-c, c]."""
    out = torch.zeros(logprobs.shape, dtype=torch.float64)
    for idx in range(logprobs.numel()):
        d = float(_cells(logprobs.detach())[idx]) - float(_cells(ref_logprobs.detach())[idx])
        v = _kl_value(d, estimator)
        if clamp is not None:
            v = min(max(v, -clamp), clamp)
        out.view(-1)[idx] = v
    return out


def kl_grad(logprobs, ref_logprobs, estimator, clamp=None):
    """Per-token d(estimate)/d(logprobs) (the gradient w.r.t. ref_logprobs is its negative).

    k1 -> 1, abs -> sign(d), k2 -> d, k3 -> 1 - exp(-d); 0 where the clamp is active. The straight-through
    ``k1+`` / ``k3+`` have the gradient of k2, d, whatever the clamp.
    """
    out = torch.zeros(logprobs.shape, dtype=torch.float64)
    for idx in range(logprobs.numel()):
        d = float(_cells(logprobs.detach())[idx]) - float(_cells(ref_logprobs.detach())[idx])
        if estimator.endswith("+"):
            g = d
        elif clamp is not None and abs(_kl_value(d, estimator)) > clamp:
            g = 0.0
        else:
            g = {"k1": 1.0, "abs": math.copysign(1.0, d) if d != 0 else 0.0, "k2": d, "k3": 1 - math.exp(-d)}[estimator]
        out.view(-1)[idx] = g
    return out


def token_rewards(rewards, mask, kl=None, kl_coef=0.0):
    B, R = mask.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        last = None
        for t in range(R):
            if mask[b, t]:
                last = t
                if kl is not None:
                    out[b, t] -= kl_coef * float(kl[b, t])
        if last is not None:
            out[b, last] += float(rewards[b])
    return out


def gae(rewards, values, mask, gamma, lam):
    """Per row: walk backwards over action tokens only, terminal after the last one."""
    B, R = mask.shape
    adv = [[torch.zeros((), dtype=torch.float64) for _ in range(R)] for _ in range(B)]
    for b in range(B):
        next_value = torch.zeros((), dtype=torch.float64)
        next_adv = torch.zeros((), dtype=torch.float64)
        for t in reversed(range(R)):
            if not mask[b, t]:
                continue
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            a = delta + gamma * lam * next_adv
            adv[b][t] = a
            next_value, next_adv = values[b, t], a
    advantages = torch.stack([torch.stack(r) for r in adv])
    returns = torch.where(mask, advantages + values, torch.zeros((), dtype=torch.float64))
    return advantages, returns


def rloo_baseline(rewards, k):
    out = []
    for i in range(len(rewards)):
        g = i // k
        others = [rewards[j] for j in range(g * k, g * k + k) if j != i]
        out.append(sum(others) / (k - 1))
    return torch.stack(out)


def _std(values):
    mean = sum(values) / len(values)
    return torch.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def group_normalize(rewards, k, scale=True, eps=1e-6, std="group"):
    """``group``: (r - mean of the group) / (unbiased std of the group + eps).
    ``leave_one_out`` (NeMo-RL): (r - mean of the *other* K - 1) / (unbiased std of the others + eps), not
    divided when the others are all equal."""
    out = []
    for i in range(len(rewards)):
        g = i // k
        members = [rewards[j] for j in range(g * k, g * k + k)]
        if std == "group":
            centre = sum(members) / k
            spread = _std(members) + eps
        else:
            others = [rewards[j] for j in range(g * k, g * k + k) if j != i]
            centre = sum(others) / (k - 1)
            equal = all(float(o.detach()) == float(others[0].detach()) for o in others)
            spread = None if (equal or not scale) else _std(others) + eps
        if not scale or spread is None:
            out.append(rewards[i] - centre)
        else:
            out.append((rewards[i] - centre) / spread)
    return torch.stack(out)


def awac_per_token(logits, actions, mask, advantages=None, beta=0.0):
    """exp(beta * advantage) (a constant) times the NLL of the taken token; 0 off the mask."""
    nll = -logprobs(logits, actions)
    B, R = mask.shape
    rows = []
    for b in range(B):
        row = []
        for t in range(R):
            w = 1.0 if advantages is None else math.exp(beta * float(advantages[b, t].detach()))
            row.append(w * nll[b, t] if mask[b, t] else torch.zeros((), dtype=torch.float64))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def aggregate(per_token, mask, agg, num_tokens=None, num_seqs=None):
    B, R = mask.shape
    zero = torch.zeros((), dtype=torch.float64)
    if agg == "token-mean":
        terms = [per_token[b, t] for b in range(B) for t in range(R) if mask[b, t]]
        n = num_tokens if num_tokens is not None else max(len(terms), 1)
        return sum(terms, zero) / n
    rows = []
    for b in range(B):
        terms = [per_token[b, t] for t in range(R) if mask[b, t]]
        if not terms:
            continue
        s = sum(terms, zero)
        rows.append(s / len(terms) if agg == "seq-mean-token-mean" else s)
    n = num_seqs if num_seqs is not None else max(len(rows), 1)
    return sum(rows, zero) / n


def ppo_per_token(logprobs, old, adv, mask, clip_eps, clip_eps_high=None, dual_clip=None):
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    B, R = mask.shape
    rows = []
    for b in range(B):
        row = []
        for t in range(R):
            if not mask[b, t]:
                row.append(torch.zeros((), dtype=torch.float64))
                continue
            ratio = torch.exp(logprobs[b, t] - old[b, t])
            a = float(adv[b, t])
            l1 = -a * ratio
            l2 = -a * torch.clamp(ratio, 1 - clip_eps, 1 + hi)
            loss = torch.maximum(l1, l2)
            if dual_clip is not None and a < 0:
                loss = torch.minimum(loss, torch.tensor(-dual_clip * a, dtype=torch.float64))
            row.append(loss)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def value_per_token(values, old_values, returns, mask, clip_eps=None):
    B, R = mask.shape
    rows = []
    for b in range(B):
        row = []
        for t in range(R):
            v, ret = values[b, t], float(returns[b, t])
            err = (v - ret) ** 2
            if clip_eps is not None:
                old = float(old_values[b, t])
                vc = old + torch.clamp(v - old, -clip_eps, clip_eps)
                err = torch.maximum(err, (vc - ret) ** 2)
            row.append(0.5 * err if mask[b, t] else torch.zeros((), dtype=torch.float64))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def ilql_targets(rewards, values, mask, gamma):
    B, R = mask.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        for t in range(R):
            if not mask[b, t]:
                continue
            nxt = next((s for s in range(t + 1, R) if mask[b, s]), None)
            v_next = float(values[b, nxt]) if nxt is not None else 0.0
            out[b, t] = float(rewards[b, t]) + gamma * v_next
    return out


def expectile_per_token(values, target_q, mask, tau):
    B, R = mask.shape
    rows = []
    for b in range(B):
        row = []
        for t in range(R):
            u = float(target_q[b, t]) - values[b, t]
            w = (1 - tau) if float(u.detach()) < 0 else tau
            row.append(w * u * u if mask[b, t] else torch.zeros((), dtype=torch.float64))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def gae_nemo_rl(rewards, values, mask, gamma, lam):
    """NeMo-RL ``GAEAdvantageEstimator._compute_gae`` (advantage_estimator.py) re-written: one backward walk
    over every position, the accumulators carried forward over masked positions; ``lam`` a float or [B]."""
    B, R = mask.shape
    m = mask.to(torch.float64)
    next_values = torch.zeros(B, dtype=torch.float64)
    last_gae_lam = torch.zeros(B, dtype=torch.float64)
    out = []
    for t in reversed(range(R)):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        new_gae_lam = delta + gamma * lam * last_gae_lam
        next_values = values[:, t] * m[:, t] + (1 - m[:, t]) * next_values
        last_gae_lam = new_gae_lam * m[:, t] + (1 - m[:, t]) * last_gae_lam
        out.append(last_gae_lam)
    advantages = torch.stack(out[::-1], dim=1) if out else torch.zeros(B, 0, dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(mask, advantages, zero), torch.where(mask, advantages + values, zero)


def length_adaptive_lambda(mask, alpha):
    """NeMo-RL ``_resolve_lambda_policy`` with ``length_adaptive_alpha > 0``, per row in Python."""
    out = []
    for b in range(mask.shape[0]):
        n = float(sum(bool(x) for x in mask[b]))
        lam = 1.0 - 1.0 / max(alpha * n, 1.0)
        out.append(min(max(lam, 0.0), 1.0))
    return torch.tensor(out, dtype=torch.float64)


def aligner_rloo_baseline(prompts, reward, mask):
    """NeMo-Aligner ``calculate_rloo_baseline`` (nemo_aligner/utils/ppo_utils.py, af2b3bd) re-written: per
    unique prompt, the leave-one-out matrix times ``reward * mask`` over ``mask.sum() - 1``; the reward itself
    when at most one sample of the prompt is unmasked."""
    baseline = torch.zeros_like(reward)
    for p in torch.unique(prompts):
        idx = torch.arange(len(prompts))[prompts == p]
        rloo_mat = 1 - torch.eye(len(idx), dtype=reward.dtype)
        if mask[idx].sum() <= 1:
            baseline[idx] = reward[idx]
        else:
            baseline[idx] = rloo_mat @ (reward[idx] * mask[idx]) / (mask[idx].sum() - 1)
    return baseline


def nemo_rl_std_per_row(rewards, k):
    """NeMo-RL's ``calculate_baseline_and_std_per_prompt`` std (nemo_rl/algorithms/utils.py, without the
    leave-one-out baseline, every sample valid), for groups of ``k`` contiguous rows (one prompt each):
    sqrt((mean(x^2) - mean(x)^2) * n / (n - 1)), NaN -> 0, the same value on every row of a group."""
    out = []
    for g in range(len(rewards) // k):
        xs = [float(r) for r in rewards[g * k : (g + 1) * k]]
        baseline = sum(xs) / k
        square = sum(x * x for x in xs) / k
        var = (square - baseline**2) * (k / (k - 1))
        std = math.sqrt(var) if var >= 0 else 0.0  # torch: sqrt of a negative is NaN, nan_to_num(0)
        out += [std] * k
    return out


def nemo_rl_dynamic_sampling(repeated_batch, std, num_gen_batches, num_prompts_per_step, k, max_gen_batches,
                             batch_cache=None):
    """NeMo-RL's ``dynamic_sampling`` (nemo_rl/algorithms/grpo.py at 7ea279a) on a dict of per-row lists:
    keep the rows whose std != 0, append them to ``batch_cache``; short of ``num_prompts_per_step * k`` rows,
    go on (``is_batch_complete`` False) while ``num_gen_batches <= max_gen_batches``, else raise; full, slice
    to ``num_prompts_per_step * k`` rows. Returns ``(batch, is_batch_complete, batch_cache, metrics)``."""
    is_batch_complete = True
    train_prompts_size = num_prompts_per_step * k
    metrics = {}
    non_zero_std_mask = [s != 0.0 for s in std]
    keep_prompt_indices = [i for i, keep in enumerate(non_zero_std_mask) if keep]
    filtered = {key: [rows[i] for i in keep_prompt_indices] for key, rows in repeated_batch.items()}
    if len(keep_prompt_indices) > 0:
        batch_cache = filtered if batch_cache is None else {key: batch_cache[key] + filtered[key] for key in filtered}
        filtered = batch_cache
    filtered_prompts_size = len(filtered["rewards"])
    if filtered_prompts_size < train_prompts_size:
        if num_gen_batches <= max_gen_batches:
            is_batch_complete = False
        else:
            raise ValueError(f"Dynamic sampling has reached the maximum allowed number of batches ({max_gen_batches})")
    else:
        metrics["dynamic_sampling_num_discarded_valid_samples"] = filtered_prompts_size - train_prompts_size
        filtered = {key: rows[:train_prompts_size] for key, rows in filtered.items()}
    return filtered, is_batch_complete, batch_cache, metrics


def nemo_rl_dynamic_sampling_step(generation_batches, num_prompts_per_step, k, max_gen_batches):
    """One step of NeMo-RL's GRPO loop around ``dynamic_sampling`` (grpo.py ``grpo_train``): for each
    generation batch of ``generation_batches`` (an iterator of dicts with ``rewards``, drawn lazily),
    ``num_gen_batches += 1``, the std, ``dynamic_sampling``; ``continue`` while incomplete. Returns the batch
    and the metrics (``dynamic_sampling_num_gen_batches`` added)."""
    batch_cache, num_gen_batches = None, 0
    for repeated_batch in generation_batches:
        num_gen_batches += 1
        std = nemo_rl_std_per_row(repeated_batch["rewards"], k)
        batch, complete, batch_cache, metrics = nemo_rl_dynamic_sampling(
            repeated_batch, std, num_gen_batches, num_prompts_per_step, k, max_gen_batches, batch_cache
        )
        if metrics:
            metrics["dynamic_sampling_num_gen_batches"] = num_gen_batches
        if not complete:
            continue
        return batch, metrics
    raise AssertionError("the generation batches ran out")
