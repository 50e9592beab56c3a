"""Teacher-forced forward helpers: position ids, policy_logprobs, critic_values."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import rlbits.functional.logprobs as logprobs_mod
import rlbits.models.forward as forward_mod
from rlbits.batch import build_batch
from rlbits.functional.logprobs import logprobs_from_hidden
from rlbits.models.forward import (
    choose_head,
    critic_values,
    policy_logprobs,
    position_ids_from_mask,
    split_head,
)
from rlbits.models.heads import ValueModel
from rlbits.models.tiny import tiny_causal_lm

V = 64
PAD = 0
ARCHS = ("gpt2", "llama", "qwen2")


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_causal_lm(arch, V, seed=5) for arch in ARCHS}


# Rows as (prompt tokens, response tokens, action flags); a False flag inside a response is a tool token:
# attended to (response_mask) but not trained on (action_mask).
ROWS = [
    ([5, 6, 7, 8], [10, 11, 12], [True, True, True]),
    ([9], [13, 14, 15, 16, 17], [True, False, False, True, True]),
    ([20, 21], [22], [True]),
]


def _batch(rows=ROWS):
    P = max(len(p) for p, _, _ in rows)
    R = max(len(r) for _, r, _ in rows)
    B = len(rows)
    prompts = torch.full((B, P), PAD)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    responses = torch.full((B, R), PAD)
    response_mask = torch.zeros(B, R, dtype=torch.bool)
    action_mask = torch.zeros(B, R, dtype=torch.bool)
    for i, (p, r, a) in enumerate(rows):
        prompts[i, P - len(p) :] = torch.tensor(p)
        prompt_mask[i, P - len(p) :] = True
        responses[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = True
        action_mask[i, : len(r)] = torch.tensor(a)
    return build_batch(prompts, prompt_mask, responses, action_mask, response_mask=response_mask)


def _reference(model, rows, temperature):
    """Per row, unpadded: log_softmax(logits / T) of each response token and the entropy, in float64."""
    lps, ents = [], []
    for p, r, a in rows:
        logits = model(input_ids=torch.tensor([p + r])).logits[0].double() / temperature
        logp = torch.log_softmax(logits[len(p) - 1 : len(p) - 1 + len(r)], -1)
        lp = logp.gather(1, torch.tensor(r)[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1)
        keep = torch.tensor(a, dtype=torch.double)
        lps.append(lp * keep)
        ents.append(ent * keep)
    return lps, ents


def test_position_ids_from_mask_exact():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert position_ids_from_mask(mask).tolist() == [
        [0, 0, 0, 1, 2, 2],
        [0, 1, 2, 3, 4, 5],
        [0, 0, 0, 0, 0, 0],
    ]
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, T\]"):
        position_ids_from_mask(mask[0])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_policy_logprobs_match_unpadded_reference(models, arch, temperature):
    model = models[arch]
    batch = _batch()
    with torch.no_grad():
        lp, ent = policy_logprobs(model, batch, temperature=temperature, return_entropy=True)
        ref_lp, ref_ent = _reference(model, ROWS, temperature)
    assert lp.dtype == torch.float32 and lp.shape == batch["responses"].shape
    for i, (_, r, _) in enumerate(ROWS):
        assert (lp[i, : len(r)].double() - ref_lp[i]).abs().max() <= 1e-5
        assert (ent[i, : len(r)].double() - ref_ent[i]).abs().max() <= 1e-5
    assert (lp[~batch["action_mask"]] == 0).all() and (ent[~batch["action_mask"]] == 0).all()


def test_microbatches_equal_one_pass(models):
    model = models["llama"]
    batch = _batch()
    with torch.no_grad():
        full = policy_logprobs(model, batch)
        for mb in (1, 2, 5):
            assert torch.allclose(policy_logprobs(model, batch, microbatch_size=mb), full, atol=1e-6)


def _plain_logprobs(model, batch, temperature):
    """The obviously-right path: the model's full logits, log_softmax, gather, 0 off the action mask."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids_from_mask(batch["attention_mask"]),
    ).logits
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    plain = torch.log_softmax(out[:, P - 1 : P - 1 + R] / temperature, -1).gather(2, batch["responses"][..., None])
    return torch.where(batch["action_mask"], plain.squeeze(-1), 0.0)


def test_policy_logprobs_gradient_matches_plain_forward(models):
    model = models["gpt2"]
    batch = _batch()
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    lp = policy_logprobs(model, batch, temperature=0.9, microbatch_size=2)
    ours = torch.autograd.grad((lp * weights).sum(), params)
    ref = torch.autograd.grad((_plain_logprobs(model, batch, 0.9) * weights).sum(), params)
    for a, b in zip(ours, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_lm_head_sees_response_positions_only(models, monkeypatch):
    # The logits path (models without split_head): the head gets R + 1 positions, not P + R.
    model = models["qwen2"]
    batch = _batch()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[1]))
    try:
        with torch.no_grad():
            policy_logprobs(model, batch)
            assert seen == []  # fused path: the head module never runs, no [B, R, V] logits
            monkeypatch.setattr(forward_mod, "split_head", lambda m: None)
            policy_logprobs(model, batch)
    finally:
        handle.remove()
    assert seen == [batch["responses"].shape[1] + 1]


def _pad_columns(batch, left: int, right: int):
    """The same rows with ``left`` extra all-padding prompt columns and ``right`` response columns."""
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    pad = torch.nn.functional.pad
    return build_batch(
        pad(batch["prompts"], (left, 0), value=PAD),
        pad(batch["prompt_mask"], (left, 0), value=False),
        pad(batch["responses"], (0, right), value=PAD),
        pad(batch["action_mask"], (0, right), value=False),
        response_mask=pad(batch["response_mask"], (0, right), value=False),
    ), (P, R)


@pytest.mark.parametrize("fused", [True, False])
def test_padding_columns_cost_nothing_and_change_nothing(models, monkeypatch, fused):
    model = models["gpt2"]
    if not fused:
        monkeypatch.setattr(forward_mod, "split_head", lambda m: None)
    head = "fused" if fused else "auto"
    batch = _batch()
    padded, (P, R) = _pad_columns(batch, left=3, right=4)
    seen = []
    handle = model.transformer.register_forward_hook(lambda m, inp, out: seen.append(out[0].shape[1]))
    try:
        lp, ent = policy_logprobs(model, batch, return_entropy=True, head=head)
        lp2, ent2 = policy_logprobs(model, padded, return_entropy=True, head=head)
    finally:
        handle.remove()
    assert seen == [P + R, P + R]  # the extra columns never reach the model
    assert lp2.shape == (3, R + 4) and (lp2[:, R:] == 0).all() and (ent2[:, R:] == 0).all()
    assert torch.allclose(lp2[:, :R], lp, atol=1e-6) and torch.allclose(ent2[:, :R], ent, atol=1e-6)
    # one microbatch per row: each cut to its own length, same result
    lp3 = policy_logprobs(model, padded, microbatch_size=1, head=head)
    assert torch.allclose(lp3, lp2, atol=1e-5)
    # gradients are those of the untrimmed batch
    params = [p for p in model.parameters() if p.requires_grad]
    g1 = torch.autograd.grad(lp.sum(), params)
    g2 = torch.autograd.grad(lp3.sum(), params)
    for x, y in zip(g1, g2, strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)


def test_critic_values_trimmed_columns():
    torch.manual_seed(0)
    model = tiny_causal_lm("gpt2", V, seed=5)
    critic = ValueModel.from_policy(model, seed=0)
    batch = _batch()
    padded, (P, R) = _pad_columns(batch, left=2, right=3)
    with torch.no_grad():
        v = critic_values(critic, batch)
        v2 = critic_values(critic, padded, microbatch_size=2)
    assert v2.shape == (3, R + 3) and (v2[:, R:] == 0).all()
    assert torch.allclose(v2[:, :R], v, atol=1e-5)


def _hidden_reference(hidden, weight, tokens, temperature):
    z = (hidden.double() @ weight.double().T) / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_logprobs_from_hidden_values_and_gradients(monkeypatch, temperature, chunk_rows):
    V_, H = 50, 8
    monkeypatch.setattr(logprobs_mod, "_HEAD_CHUNK_ELEMENTS", chunk_rows * V_)  # chunk edges inside rows
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 5, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V_, H, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V_, (3, 5), generator=g)
    a, b = (
        torch.randn(3, 5, generator=g, dtype=torch.float64),
        torch.randn(3, 5, generator=g, dtype=torch.float64),
    )
    lp, ent = logprobs_from_hidden(hidden, weight, tokens, temperature, return_entropy=True)
    ref_lp, ref_ent = _hidden_reference(hidden, weight, tokens, temperature)
    assert lp.dtype == torch.float64 and lp.shape == (3, 5)
    assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    # logprob and entropy gradients, together and each alone
    for loss, ref_loss in (
        ((lp * a + ent * b).sum(), (ref_lp * a + ref_ent * b).sum()),
        ((lp * a).sum(), (ref_lp * a).sum()),
        ((ent * b).sum(), (ref_ent * b).sum()),
    ):
        ours = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
        ref = torch.autograd.grad(ref_loss, (hidden, weight), retain_graph=True)
        for x, y in zip(ours, ref, strict=True):
            assert torch.allclose(x, y, atol=1e-10)
    assert torch.autograd.gradcheck(
        lambda h, w: logprobs_from_hidden(h, w, tokens[:1, :2], temperature, return_entropy=True),
        (hidden[:1, :2].detach().requires_grad_(), weight.detach().requires_grad_()),
    )


def test_logprobs_from_hidden_float32_and_bf16_autocast():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(4, 6, 16, generator=g)
    weight = torch.randn(300, 16, generator=g) * 0.3
    tokens = torch.randint(0, 300, (4, 6), generator=g)
    ref_lp, _ = _hidden_reference(hidden, weight, tokens, 1.0)
    lp = logprobs_from_hidden(hidden, weight, tokens)
    assert lp.dtype == torch.float32 and (lp.double() - ref_lp).abs().max() < 1e-5
    w = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp16 = logprobs_from_hidden(hidden, w, tokens)
    assert lp16.dtype == torch.float32  # softmax in float32, matmul in bf16
    assert (lp16.double() - ref_lp).abs().max() < 0.1
    lp16.sum().backward()
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


def test_logprobs_from_hidden_errors():
    h, w, t = torch.randn(2, 3, 4), torch.randn(10, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="weight must be"):
        logprobs_from_hidden(h, torch.randn(10, 5), t)
    with pytest.raises(ValueError, match="tokens has shape"):
        logprobs_from_hidden(h, w, t[:, :2])
    with pytest.raises(ValueError, match="integer"):
        logprobs_from_hidden(h, w, t.float())
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(h, w, t, 0.0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head", ["fused", "unfused", "auto"])
def test_head_paths_equal_logits_path(models, arch, monkeypatch, head):
    """Each output-layer path of a split-head model gives the model's own logits path's values and
    gradients (the fused one never holds the logits; ``auto`` picks one by size)."""
    model = models[arch]
    batch = _batch()
    assert split_head(model) is not None
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    used = []
    real = logprobs_mod.logprobs_from_hidden
    monkeypatch.setattr(forward_mod, "logprobs_from_hidden", lambda *a, **k: used.append(1) or real(*a, **k))
    lp, ent = policy_logprobs(model, batch, temperature=0.8, return_entropy=True, head=head)
    assert bool(used) == (head == "fused")  # auto: these tiny logits fit the default budget
    fused = torch.autograd.grad((lp * weights).sum() + ent.sum(), params)
    monkeypatch.setattr(forward_mod, "split_head", lambda m: None)
    lp2, ent2 = policy_logprobs(model, batch, temperature=0.8, return_entropy=True)
    plain = torch.autograd.grad((lp2 * weights).sum() + ent2.sum(), params)
    assert torch.allclose(lp, lp2, atol=1e-5) and torch.allclose(ent, ent2, atol=1e-5)
    for x, y in zip(fused, plain, strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("head", ["fused", "unfused"])
def test_metric_entropy_equals_differentiable_entropy(models, head):
    """``entropy_grad=False`` (entropy as a metric only) gives the same logprobs, gradients and entropy
    values as the differentiable entropy, and on the unfused path an entropy without a graph."""
    model = models["gpt2"]
    batch = _batch()
    params = [p for p in model.parameters() if p.requires_grad]
    lp, ent = policy_logprobs(model, batch, temperature=0.8, return_entropy=True, head=head)
    lp2, ent2 = policy_logprobs(
        model, batch, temperature=0.8, return_entropy=True, entropy_grad=False, head=head
    )
    assert torch.allclose(lp, lp2, atol=1e-6) and torch.allclose(ent, ent2, atol=1e-5)
    assert (ent2[~batch["action_mask"]] == 0).all() and ent2.abs().sum() > 0
    if head == "unfused":
        assert ent.requires_grad and not ent2.requires_grad
    for x, y in zip(
        torch.autograd.grad(lp.sum(), params), torch.autograd.grad(lp2.sum(), params), strict=True
    ):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-5)


def test_choose_head_by_memory_budget(models):
    # 3 copies of float32 logits: 3 * 4 * rows * R * V bytes against the budget in MiB.
    assert choose_head("auto", 4, 8, 1024, budget_mb=3 * 4 * 4 * 8 * 1024 / 2**20) == "unfused"
    assert choose_head("auto", 4, 8, 1024, budget_mb=3 * 4 * 4 * 8 * 1024 / 2**20 - 1e-3) == "fused"
    assert choose_head("fused", 1, 1, 2, budget_mb=1e9) == "fused"
    assert choose_head("unfused", 10**4, 10**4, 10**5, budget_mb=0) == "unfused"
    # policy_logprobs with a zero budget takes the fused path, with a large one the unfused: same values
    batch = _batch()
    small = policy_logprobs(models["llama"], batch, head="auto", head_memory_budget_mb=0)
    large = policy_logprobs(models["llama"], batch, head="auto", head_memory_budget_mb=1e6)
    assert torch.allclose(small, large, atol=1e-5)
    with pytest.raises(ValueError, match="head must be one of auto, fused, unfused; got 'chunked'"):
        policy_logprobs(models["llama"], batch, head="chunked")


def test_split_head_only_for_plain_bias_free_heads(models):
    model = models["gpt2"]
    backbone, head = split_head(model)
    assert head is model.lm_head and backbone is model.base_model

    class Other(torch.nn.Module):
        config = type("C", (), {"model_type": "gemma2"})()

    assert split_head(Other()) is None
    biased = tiny_causal_lm("llama", V, seed=5)
    biased.lm_head = torch.nn.Linear(biased.lm_head.in_features, V, bias=True)
    assert split_head(biased) is None


class _PositionValue(torch.nn.Module):
    """values[b, t] = 1000 * b + 10 * t + position_ids[b, t]: the critic slice is checkable by hand."""

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        B, T = input_ids.shape
        rows = torch.arange(B)[:, None] * 1000 + torch.arange(T)[None] * 10
        return (rows + position_ids).float()


def test_critic_values_slice_by_hand():
    batch = _batch()  # P = 4, R = 5
    values = critic_values(_PositionValue(), batch)
    # row 0: prompt fills 4 columns; response token t is predicted at column 3 + t with position 3 + t
    assert values[0].tolist() == [33.0, 44.0, 55.0, 0.0, 0.0]
    # row 1: one prompt token (position 0 at column 3), action mask [T, F, F, T, T]
    assert values[1].tolist() == [1030.0, 0.0, 0.0, 1063.0, 1074.0]
    assert values[2].tolist() == [2031.0, 0.0, 0.0, 0.0, 0.0]
    # microbatching slices each microbatch by itself (row offsets restart at 0 in each), and cuts it to its
    # real columns: row 2 alone has 2 prompt columns and 1 response column, so its prompt's last token
    # sits at column 1 (position 1)
    mb = critic_values(_PositionValue(), batch, microbatch_size=2)
    assert mb[2].tolist() == [11.0, 0.0, 0.0, 0.0, 0.0]


def test_critic_values_value_model_reference(models):
    critic = ValueModel.from_policy(models["llama"])
    batch = _batch()
    values = critic_values(critic, batch, microbatch_size=2)
    assert values.requires_grad
    with torch.no_grad():
        for i, (p, r, a) in enumerate(ROWS):
            alone = critic(torch.tensor([p + r]))[0]
            ref = alone[len(p) - 1 : len(p) - 1 + len(r)] * torch.tensor(a)
            assert torch.allclose(values[i, : len(r)], ref, atol=1e-5)


def test_errors(models):
    model = models["gpt2"]
    batch = _batch()
    with pytest.raises(ValueError, match="missing key"):
        policy_logprobs(model, batch.exclude("responses"))
    bad = batch.clone()
    bad.batch_size = []
    bad["attention_mask"] = bad["attention_mask"][:, 1:]
    with pytest.raises(ValueError, match="attention_mask has shape"):
        policy_logprobs(model, bad)
    with pytest.raises(ValueError, match="temperature"):
        policy_logprobs(model, batch, temperature=0.0)
    with pytest.raises(ValueError, match="microbatch_size"):
        policy_logprobs(model, batch, microbatch_size=0)
    only_response = TensorDict(
        input_ids=batch["responses"],
        attention_mask=batch["action_mask"],
        responses=batch["responses"],
        action_mask=batch["action_mask"],
        batch_size=[3],
    )
    with pytest.raises(ValueError, match="at least one prompt column"):
        policy_logprobs(model, only_response)
    with pytest.raises(ValueError, match="value_model returned shape"):
        critic_values(lambda ids, **kw: torch.zeros(ids.shape[0]), batch)


def test_sparse_tied_embedding_grad_equals_dense_and_restores(models):
    """A tied input embedding gets a sparse gradient inside ``policy_logprobs`` (no [V, H] fill and add per
    backward); the accumulated ``.grad`` is dense and equals the plain dense computation; the flag is
    restored; untied, frozen or no-grad models are left alone."""
    model = models["llama"]
    emb = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is emb.weight  # tiny models tie their embeddings
    batch = _batch()
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    (policy_logprobs(model, batch, temperature=0.8) * weights).sum().backward()
    assert emb.sparse is False and not emb.weight.grad.is_sparse
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (_plain_logprobs(model, batch, 0.8) * weights).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    model.zero_grad(set_to_none=True)
    with forward_mod.sparse_tied_embedding_grad(model) as applied:
        assert applied and emb.sparse
    assert emb.sparse is False
    with torch.no_grad(), forward_mod.sparse_tied_embedding_grad(model) as applied:
        assert not applied and not emb.sparse
    untied = tiny_causal_lm("llama", V, seed=5, tie_word_embeddings=False)
    with forward_mod.sparse_tied_embedding_grad(untied) as applied:
        assert not applied and not untied.get_input_embeddings().sparse
    emb.weight.requires_grad_(False)
    try:
        with forward_mod.sparse_tied_embedding_grad(model) as applied:
            assert not applied
    finally:
        emb.weight.requires_grad_(True)
