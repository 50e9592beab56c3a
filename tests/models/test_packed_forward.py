"""Packed forward passes (``policy_logprobs`` / ``critic_values`` with ``pack=True`` or in a
``packed_sequences`` block) against a slow, obviously right reference: each row run alone on its own real
tokens (no padding at all). Values and gradients agree to float rounding, for GPT-2 and Llama shapes and both
output-layer paths."""

from __future__ import annotations

import pytest
import torch

from rlbits.batch import build_batch
from rlbits.functional import logprobs_from_logits
from rlbits.models.forward import critic_values, packed_sequences, policy_logprobs
from rlbits.models.heads import ValueModel
from rlbits.models.tiny import tiny_causal_lm

V, B, P, R = 48, 5, 6, 7


def ragged_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, V, (B, P), generator=g)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = torch.arange(P)[None] >= (P - prompt_len)[:, None]
    responses = torch.randint(3, V, (B, R), generator=g)
    response_len = torch.randint(1, R + 1, (B,), generator=g)
    action_mask = torch.arange(R)[None] < response_len[:, None]
    return build_batch(prompts, prompt_mask, responses, action_mask, rewards=torch.zeros(B))


def per_row_logprobs(model, batch) -> torch.Tensor:
    """[B, R]: each row's real tokens alone through the model, positions 0..L-1, logits read by hand."""
    out = torch.zeros(B, R)
    for i in range(B):
        real = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][real][None]
        logits = model(input_ids=ids).logits[0]
        n = int(batch["action_mask"][i].sum())
        start = int(batch["prompt_mask"][i].sum())  # the first response token's index among the real tokens
        lp = logprobs_from_logits(logits[start - 1 : start - 1 + n][None], ids[:, start : start + n])[0]
        out[i, :n] = lp
    return out


def per_row_values(value_model, batch) -> torch.Tensor:
    out = torch.zeros(B, R)
    for i in range(B):
        real = batch["attention_mask"][i].bool()
        values = value_model(batch["input_ids"][i][real][None])[0]
        n, start = int(batch["action_mask"][i].sum()), int(batch["prompt_mask"][i].sum())
        out[i, :n] = values[start - 1 : start - 1 + n]
    return out


def grads(model, loss) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("head", ["unfused", "fused"])
def test_packed_logprobs_equal_per_row_forward(arch, head):
    model = tiny_causal_lm(arch, V, seed=0).eval()
    batch = ragged_batch()
    want = per_row_logprobs(model, batch)
    got = policy_logprobs(model, batch, head=head, pack=True, microbatch_size=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    weights = torch.randn(B, R, generator=torch.Generator().manual_seed(1))
    g_want = grads(model, (per_row_logprobs(model, batch) * weights).sum())
    g_got = grads(model, (policy_logprobs(model, batch, head=head, pack=True) * weights).sum())
    for a, b in zip(g_want, g_got, strict=True):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-7


def test_packed_values_and_entropy_equal_the_padded_pass():
    model = tiny_causal_lm("llama", V, seed=0).eval()
    value_model = ValueModel.from_policy(model, seed=1).eval()
    batch = ragged_batch(1)
    torch.testing.assert_close(critic_values(value_model, batch, pack=True), per_row_values(value_model, batch))
    with packed_sequences() as seen:  # the engine's block: pack=None packs
        lp, ent = policy_logprobs(model, batch, return_entropy=True, entropy_grad=False)
        values = critic_values(value_model, batch)
    assert seen.count == 2
    want_lp, want_ent = policy_logprobs(model, batch, return_entropy=True)
    torch.testing.assert_close(lp, want_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values, critic_values(value_model, batch), rtol=1e-5, atol=1e-6)
    with packed_sequences(False) as seen:
        assert seen is None


def test_packed_forward_refuses_an_action_token_after_padding():
    model = tiny_causal_lm("gpt2", V, seed=0).eval()
    batch = ragged_batch()
    batch["attention_mask"][0, P - 1] = False  # the column predicting the first response token
    with pytest.raises(ValueError, match="an action token follows a padding column"):
        policy_logprobs(model, batch, pack=True)


class AttendsAcrossRows(torch.nn.Module):
    """A causal LM that ignores packed row boundaries: it always passes an all-ones attention mask, so a packed
    bin is one sequence to it (as a model whose attention does not read the position ids would be)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids=None, use_cache=False, **kw):
        mask = kw.pop("attention_mask", None)
        mask = torch.ones_like(input_ids) if mask is None else mask
        return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=use_cache)


def test_a_model_that_attends_across_packed_rows_is_refused():
    """Packing needs attention confined to each row; a model that mixes rows would give wrong logprobs
    silently, so its first packed pass raises (the padded pass still works)."""
    torch.manual_seed(0)
    model = AttendsAcrossRows(tiny_causal_lm("gpt2", V, seed=0))
    batch = ragged_batch(3)
    with torch.no_grad():
        policy_logprobs(model, batch)
        with pytest.raises(ValueError, match="AttendsAcrossRows attends across packed rows.*pack_sequences=False"):
            policy_logprobs(model, batch, pack=True)

    class LeakyCritic(ValueModel):
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            return super().forward(input_ids, mask, position_ids)

    critic = LeakyCritic(ValueModel.from_policy(tiny_causal_lm("gpt2", V, seed=0)).backbone)
    with torch.no_grad():
        critic_values(critic, batch)
        with pytest.raises(ValueError, match="LeakyCritic attends across packed rows"):
            critic_values(critic, batch, pack=True)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_row_check_runs_once_per_model(arch, monkeypatch):
    """Models that confine attention pass the check, once: later packed passes skip it."""
    from rlbits.models import forward

    model = tiny_causal_lm(arch, V, seed=0)
    calls = []
    original = forward._check_confined
    monkeypatch.setattr(forward, "_check_confined", lambda m, call: calls.append(m in forward._CONFINED) or original(m, call))
    with torch.no_grad():
        for _ in range(2):
            policy_logprobs(model, ragged_batch(4), pack=True)
    assert calls == [False, True]
