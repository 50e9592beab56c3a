"""ILQL's ``logit_mask`` with ``top_k`` and temperature against trlx's ``generate``
(``trlx/models/modeling_ilql.py``, 3340c2f), re-written line by line: the pure function, the sampler on the
same uniforms, and steered decoding of a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlbits.functional import ilql_logit_mask, ilql_logits
from rlbits.loops import ilql
from rlbits.models.forward import position_ids_from_mask
from rlbits.models.heads import ILQLModel
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer
from rlbits.rollout.generate import generate
from rlbits.rollout.sampling import inverse_cdf_sample, next_token, top_k_filter
from rlbits.text import tokenize_prompts


def trlx_topk_mask(xs, k):
    # trlx topk_mask: every entry below the row's k-th largest becomes -inf (ties kept); k > V: unchanged
    if k > xs.shape[-1]:
        return xs
    mintop = torch.topk(xs, k)[0][:, -1].unsqueeze(-1)
    return torch.where(xs < mintop, -np.inf * torch.ones_like(xs, dtype=xs.dtype), xs)


def trlx_step(logits, target_qs, vs, input_ids, beta, top_k, temperature, logit_mask):
    """One step of trlx's ILQL ``generate`` after the forward: the distribution it samples from (one-hot of
    the argmax at temperature 0). ``logits`` [B, V] of the last position, ``target_qs`` a pair of [B, V],
    ``vs`` [B, 1], ``input_ids`` [B, T] (B > 1: trlx's ``squeeze`` would drop the batch dim of one row)."""
    logits = logits.clone()
    qs = torch.minimum(target_qs[0], target_qs[1])
    if logit_mask is not None:
        mask = logit_mask[input_ids[:, -1].squeeze().to(logit_mask.device)]
        logits[torch.where(mask)] = -np.inf
    adv = qs - vs
    pi_beta = F.log_softmax(logits, -1)
    pi_top_k = trlx_topk_mask(pi_beta + beta * adv, top_k)
    if temperature == 0.0:
        return F.one_hot(pi_top_k.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    return F.softmax(pi_top_k / temperature, -1)


def _inputs(seed, B=5, V=32, T=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g, dtype=torch.float64) * 2
    q1, q2 = (torch.randn(B, V, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, 1, generator=g, dtype=torch.float64)
    mask = torch.rand(V, V, generator=g) < 0.6  # True: not allowed after the row's token
    mask[torch.arange(V), torch.randint(0, V, (V,), generator=g)] = False  # every token allows one next
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, (q1, q2), v, mask, ids


def _rlbits_probs(logits, qs, v, mask, ids, beta, k, temperature):
    """rlbits' sampled distribution: ``ilql_logits`` with the mask, then ``generate``'s temperature and top-k."""
    steered = ilql_logits(logits, torch.minimum(*qs), v.squeeze(-1), beta, logit_mask=mask, prev_tokens=ids[:, -1])
    if temperature == 0:
        return F.one_hot(steered.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return top_k_filter(steered / temperature, k).softmax(-1)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k,temperature", [(1, 1.0), (3, 0.7), (8, 1.3), (31, 2.0), (40, 0.5), (5, 0.0)])
@pytest.mark.parametrize("beta", [0.0, 1.0, 4.0])
def test_steered_masked_top_k_distribution_equals_trlx(seed, k, temperature, beta):
    logits, qs, v, mask, ids = _inputs(seed)
    want = trlx_step(logits, qs, v, ids, beta, k, temperature, mask)
    got = _rlbits_probs(logits, qs, v, mask, ids, beta, k, temperature)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (got[mask[ids[:, -1]]] == 0).all()  # nothing forbidden keeps any mass


@pytest.mark.parametrize("k,temperature", [(4, 0.8), (None, 1.0), (2, 1.5)])
def test_sampler_draws_trlx_tokens_on_the_same_uniforms(k, temperature):
    """``next_token`` (rlbits' sampler) on the masked steered logits draws, for the same uniform per row, the
    token the inverse CDF of trlx's distribution gives."""
    logits, qs, v, mask, ids = _inputs(7, B=64)
    logits, qs, v = logits.float(), tuple(q.float() for q in qs), v.float()
    steered = ilql_logits(logits, torch.minimum(*qs), v.squeeze(-1), 2.0, logit_mask=mask, prev_tokens=ids[:, -1])
    tokens, _ = next_token(steered, ids, temperature=temperature, top_k=k, top_p=None, logits_processor=None,
                           generator=torch.Generator().manual_seed(11))
    u = 1 - torch.rand(64, 1, generator=torch.Generator().manual_seed(11))
    want = trlx_step(logits.double(), tuple(q.double() for q in qs), v.double(), ids, 2.0, k or 10**9, temperature,
                     mask)
    assert torch.equal(tokens, inverse_cdf_sample(want.float(), u))
    assert not mask[ids[:, -1], tokens].any()


def test_mask_reads_each_position_s_own_token():
    """Over a sequence, the logits at position t are masked after input token t (what a full forward needs)."""
    logits, _, _, mask, ids = _inputs(3, B=2, V=16, T=6)
    full = torch.randn(2, 6, 16, dtype=torch.float64)
    out = ilql_logit_mask(full, ids, mask)
    for t in range(6):
        torch.testing.assert_close(out[:, t], ilql_logit_mask(full[:, t], ids[:, t], mask))
        assert torch.isinf(out[:, t][mask[ids[:, t]]]).all()


def test_bad_masks_are_named():
    logits, qs, v, mask, ids = _inputs(0, V=8)
    with pytest.raises(ValueError, match="prev_tokens"):
        ilql_logits(logits, qs[0], v.squeeze(-1), 1.0, logit_mask=mask)
    with pytest.raises(ValueError, match=r"bool \[V, V\].*V = 8"):
        ilql_logit_mask(logits, ids[:, -1], mask.float())
    with pytest.raises(ValueError, match=r"bool \[V, V\].*V = 8"):
        ilql_logit_mask(logits, ids[:, -1], mask[:4, :4])
    with pytest.raises(ValueError, match="prev_tokens has shape"):
        ilql_logit_mask(logits, ids, mask)
    model = ILQLModel(tiny_causal_lm(vocab_size=64), seed=0)
    with pytest.raises(ValueError, match="V = 64"):
        ilql.SteeredPolicy(model, 1.0, torch.zeros(8, 8, dtype=torch.bool))


def _decode_mask(V=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(V, V, generator=g) < 0.7
    mask[:, V - 1] = False  # EOS always allowed
    return mask


@pytest.mark.parametrize("shared_trunk", [True, False])
@pytest.mark.parametrize("temperature,k", [(0.0, None), (0.9, 5), (1.0, None)])
def test_steered_decode_under_the_mask_follows_trlx(shared_trunk, temperature, k):
    """``generate(SteeredPolicy(model, beta, mask))`` with the KV cache: every token has mass under trlx's
    distribution recomputed from a full forward at each step (greedy: it is trlx's argmax)."""
    tok = tiny_tokenizer(64)
    model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=4), shared_trunk=shared_trunk, seed=2).eval()
    with torch.no_grad():  # make the heads matter
        for p in list(model.target_q1.parameters()) + list(model.target_q2.parameters()):
            p.mul_(30.0)
    beta, mask = 2.0, _decode_mask()
    prompts = tokenize_prompts(tok, ["hello", "a cat sat", "x"])
    kw = dict(max_new_tokens=6, temperature=temperature, top_k=k, eos_token_id=None, pad_token_id=tok.pad_token_id)
    out = generate(ilql.SteeredPolicy(model, beta, mask), prompts, generator=torch.Generator().manual_seed(0), **kw)
    unmasked = generate(ilql.SteeredPolicy(model, beta), prompts, generator=torch.Generator().manual_seed(0), **kw)
    assert not torch.equal(out["responses"], unmasked["responses"])  # the mask changed the decode
    ids, attn = out["prompts"], out["prompt_mask"]
    with torch.no_grad():
        for t in range(out["responses"].shape[1]):
            o = model(ids, attn, position_ids_from_mask(attn))
            probs = trlx_step(o["logits"][:, -1].double(), (o["target_q1"][:, -1].double(),
                              o["target_q2"][:, -1].double()), o["v"][:, -1:].double(), ids, beta,
                              k or 10**9, temperature, mask)
            tokens = out["responses"][:, t : t + 1]
            assert (probs.gather(-1, tokens) > 0).all(), t
            if temperature == 0:
                assert torch.equal(tokens.squeeze(1), probs.argmax(-1))
            ids = torch.cat([ids, tokens], dim=1)
            attn = torch.cat([attn, torch.ones_like(tokens, dtype=attn.dtype)], dim=1)


def test_beta_zero_is_the_masked_lm():
    tok = tiny_tokenizer(64)
    model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=1), seed=0).eval()
    mask = _decode_mask(seed=1)
    prompts = tokenize_prompts(tok, ["ab", "c"])
    kw = dict(max_new_tokens=5, temperature=0.0, eos_token_id=None, pad_token_id=tok.pad_token_id)
    out = generate(ilql.SteeredPolicy(model, 0.0, mask), prompts, **kw)
    plain = generate(model.policy, prompts, logits_processor=lambda ids, x: ilql_logit_mask(x, ids[:, -1], mask), **kw)
    assert torch.equal(out["responses"], plain["responses"])


def test_load_logit_mask_reads_safetensors_and_torch_files(tmp_path):
    from safetensors.torch import save_file

    mask = _decode_mask(V=8)
    save_file({"logit_mask": mask}, tmp_path / "m.safetensors")
    save_file({"anything": mask.to(torch.uint8)}, tmp_path / "one.safetensors")
    torch.save(mask.int(), tmp_path / "m.pt")
    torch.save({"logit_mask": mask, "other": torch.zeros(2)}, tmp_path / "d.pt")
    for name in ("m.safetensors", "one.safetensors", "m.pt", "d.pt"):
        got = ilql.load_logit_mask(tmp_path / name)
        assert got.dtype == torch.bool and torch.equal(got, mask), name
    torch.save(torch.zeros(3, 4), tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"must be \[V, V\]"):
        ilql.load_logit_mask(tmp_path / "bad.pt")
    torch.save({"a": mask, "b": mask}, tmp_path / "two.pt")
    with pytest.raises(ValueError, match="under the key 'logit_mask'"):
        ilql.load_logit_mask(tmp_path / "two.pt")
    (tmp_path / "junk.safetensors").write_text("not a tensor file")
    with pytest.raises(ValueError, match="not a safetensors or torch tensor file"):
        ilql.load_logit_mask(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        ilql.load_logit_mask(tmp_path / "missing.pt")
