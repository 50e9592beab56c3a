"""generate: KV-cache decoding vs teacher forcing and HF generate; sampling, EOS, groups, errors."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rlbits.batch import check
from rlbits.models.forward import cache_argument, policy_logprobs
from rlbits.models.tiny import tiny_causal_lm
from rlbits.rollout import decoder as decoder_mod
from rlbits.rollout import generate as generate_mod
from rlbits.rollout import sampling as sampling_mod
from rlbits.rollout.generate import generate
from rlbits.rollout.sampling import inverse_cdf_sample, top_k_filter, top_p_filter
from rlbits.text import make_prompts

ARCHS = ("gpt2", "llama", "qwen2")
V = 64
EOS = V - 1
PAD = 0


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_causal_lm(arch, V, seed=3) for arch in ARCHS}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return make_prompts([torch.randint(3, EOS, (n,), generator=g).tolist() for n in lengths], PAD)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _reference_logprobs(model, prompt, response, temperature):
    """Slow reference: one unpadded full forward (no cache) per row, log_softmax in float64."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    out = []
    for t, tok in enumerate(response):
        out.append(torch.log_softmax(logits[len(prompt) - 1 + t] / temperature, -1)[tok].item())
    return out


def _rows(out):
    """(prompt tokens, response tokens) per row, from the masks."""
    rows = []
    for i in range(out.batch_size[0]):
        p = out["prompts"][i][out["prompt_mask"][i]].tolist()
        r = out["responses"][i][out["action_mask"][i]].tolist()
        rows.append((p, r))
    return rows


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_teacher_forced_forward(models, arch, temperature):
    model = models[arch]
    td = _prompts([5, 2, 9, 1])
    out = generate(
        model,
        td,
        max_new_tokens=12,
        temperature=temperature,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_samples=2,
        generator=_gen(1),
        logits_processor=lambda ids, logits: logits,  # also exercises the processor path
    )
    check(out, check_values=True)
    tf = policy_logprobs(model, out, temperature=temperature)
    assert (tf - out["logprobs"]).abs().max().item() <= 1e-4
    # and against an unpadded, uncached float64 reference, row by row
    for i, (p, r) in enumerate(_rows(out)):
        ref = torch.tensor(_reference_logprobs(model, p, r, temperature))
        got = out["logprobs"][i, : len(r)].double()
        assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_left_padding_invariance(models, arch):
    model = models[arch]
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]
    batch = generate(
        model,
        make_prompts(prompts, PAD),
        max_new_tokens=10,
        temperature=0,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    for i, p in enumerate(prompts):
        alone = generate(
            model,
            make_prompts([p], PAD),
            max_new_tokens=10,
            temperature=0,
            eos_token_id=None,
            pad_token_id=PAD,
        )
        assert alone["responses"][0].tolist() == batch["responses"][i].tolist()
        assert torch.allclose(alone["logprobs"][0], batch["logprobs"][i], atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate(models, arch):
    model = models[arch]
    td = _prompts([4, 8, 1, 6], seed=2)
    P = td["prompts"].shape[1]
    # pick as EOS a token that greedy emits mid-way in row 0, so rows stop at different steps
    free = generate(model, td, max_new_tokens=16, temperature=0, eos_token_id=None, pad_token_id=PAD)
    eos = int(free["responses"][0, 5])
    ours = generate(model, td, max_new_tokens=16, temperature=0, eos_token_id=eos, pad_token_id=PAD)
    hf = model.generate(
        input_ids=td["prompts"],
        attention_mask=td["prompt_mask"].long(),
        do_sample=False,
        max_new_tokens=16,
        eos_token_id=eos,
        pad_token_id=PAD,
    )[:, P:]
    R = ours["responses"].shape[1]
    assert ours["action_mask"][0].sum().item() <= 6  # row 0 really stopped early
    assert hf.shape[1] == R
    assert ours["responses"].tolist() == hf.tolist()


def test_static_and_dynamic_cache_agree(models, monkeypatch):
    model = models["llama"]
    td = _prompts([3, 7, 2])
    kw = dict(max_new_tokens=10, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD)
    static = generate(model, td, generator=_gen(4), **kw)
    monkeypatch.setattr(decoder_mod, "_make_cache", lambda policy, n: None)
    dynamic = generate(model, td, generator=_gen(4), **kw)
    assert static["responses"].tolist() == dynamic["responses"].tolist()
    assert torch.allclose(static["logprobs"], dynamic["logprobs"], atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("options", [{}, {"num_samples": 2, "continuous_batching": True}, {"max_num_seqs": 2}])
def test_eager_steps_read_only_the_written_columns(models, arch, options, monkeypatch):
    """The eager decode hands attention the P + t columns written so far (``DecodeLayer``), not the
    whole static cache: the same tokens and logprobs (to float rounding) as reading every column, masked."""
    model = models[arch]
    td = _prompts([3, 7, 2, 5])
    kw = dict(max_new_tokens=12, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD, **options)
    layer = decoder_mod._decode_layer()
    seen = []  # the key columns each forward's first layer hands attention
    update = layer.update

    def recording(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        if self is self._first:
            seen.append(keys.shape[2])
        return keys, values

    monkeypatch.setattr(layer, "update", recording)
    view = decoder_mod._decode_layers

    def first_layer(cache, rows):
        done = view(cache, rows)
        for lay in cache.layers:
            lay._first = cache.layers[0]
        return done

    monkeypatch.setattr(decoder_mod, "_decode_layers", first_layer)
    written = generate(model, td, generator=_gen(5), **kw)
    P = td["prompts"].shape[1]
    assert seen[0] == P  # the prefill
    if "max_num_seqs" not in options:  # one cache: the write column is P + t at step t
        assert seen[1:] == list(range(P + 1, P + len(seen)))
    else:  # slots: each prompt's prefill, then the live columns, fewer than the cache's
        width = generate_mod._SLOT_CACHE_SPANS * (P + kw["max_new_tokens"])
        decode = [n for n in seen if n != P]
        assert decode[:3] == [P + 1, P + 2, P + 3] and max(decode) < width
    monkeypatch.setattr(decoder_mod, "_decode_layers", lambda cache, rows: False)
    every = generate(model, td, generator=_gen(5), **kw)
    assert written["responses"].tolist() == every["responses"].tolist()
    torch.testing.assert_close(written["logprobs"], every["logprobs"], atol=1e-5, rtol=0)


class _NoLogitsToKeep(torch.nn.Module):
    """A causal LM wrapper whose forward lacks ``logits_to_keep`` (and any static-cache flag)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None
    ):
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **{cache_argument(self.model): past_key_values},
        )


def test_plain_module_without_logits_to_keep(models):
    model = models["gpt2"]
    td = _prompts([3, 6])
    kw = dict(max_new_tokens=8, temperature=0.9, eos_token_id=EOS, pad_token_id=PAD)
    a = generate(model, td, generator=_gen(5), **kw)
    b = generate(_NoLogitsToKeep(model), td, generator=_gen(5), **kw)
    assert a["responses"].tolist() == b["responses"].tolist()
    assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    assert torch.allclose(
        policy_logprobs(_NoLogitsToKeep(model), b, temperature=0.9), b["logprobs"], atol=1e-4
    )


def test_sdpa_attention_left_padding():
    model = tiny_causal_lm("gpt2", V, seed=3, attn_implementation="sdpa")
    td = _prompts([2, 7, 4])
    out = generate(
        model, td, max_new_tokens=8, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD, generator=_gen(0)
    )
    assert torch.isfinite(out["logprobs"]).all()
    assert (policy_logprobs(model, out) - out["logprobs"]).abs().max().item() <= 1e-4


def _force_eos_at(schedule):
    """logits_processor that forces EOS in row i at response step schedule[i] (None: never)."""

    def processor(ids, logits):
        step = ids.shape[1] - P_FORCE
        out = logits.clone()
        for row, at in enumerate(schedule):
            if at == step:
                out[row] = float("-inf")
                out[row, EOS] = 0.0
            else:
                out[row, EOS] = float("-inf")
        return out

    return processor


P_FORCE = 4


def test_eos_forced_by_processor(models):
    model = models["qwen2"]
    td = _prompts([4, 2, 3])
    assert td["prompts"].shape[1] == P_FORCE
    out = generate(
        model,
        td,
        max_new_tokens=9,
        temperature=1.0,
        eos_token_id=EOS,
        pad_token_id=PAD,
        generator=_gen(2),
        logits_processor=_force_eos_at([2, None, 0]),
    )
    check(out, check_values=True)
    assert out["responses"].shape == (3, 9)
    expected_len = [3, 9, 1]
    assert out["action_mask"].sum(1).tolist() == expected_len
    for i, n in enumerate(expected_len):
        row = out["responses"][i]
        if n < 9:
            assert row[n - 1].item() == EOS  # the EOS itself is an action token
            assert (row[n:] == PAD).all()
        assert (row[: n - 1] != EOS).all()
        assert (out["logprobs"][i, n:] == 0).all()
        assert (out["logprobs"][i, :n] < 0).all()
    assert out["truncated"].tolist() == [False, True, False]
    assert out["attention_mask"][:, P_FORCE:].tolist() == out["action_mask"].tolist()
    assert out["input_ids"].tolist() == torch.cat([out["prompts"], out["responses"]], 1).tolist()
    # the forced EOS has a (low) logprob under the raw policy: the processor does not change logprobs
    tf = policy_logprobs(model, out, temperature=1.0)
    assert (tf - out["logprobs"]).abs().max().item() <= 1e-4


def test_early_stop_trims_to_longest(models):
    model = models["gpt2"]
    td = _prompts([4, 4])
    out = generate(
        model,
        td,
        max_new_tokens=20,
        temperature=1.0,
        eos_token_id=EOS,
        pad_token_id=PAD,
        generator=_gen(0),
        logits_processor=_force_eos_at([1, 3]),
    )
    assert out["responses"].shape == (2, 4)
    assert out["action_mask"].sum(1).tolist() == [2, 4]
    assert not out["truncated"].any()


def test_stop_token_ids(models):
    model = models["gpt2"]
    td = _prompts([4])
    free = generate(model, td, max_new_tokens=10, temperature=0, eos_token_id=None, pad_token_id=PAD)
    stop = int(free["responses"][0, 3])
    first = free["responses"][0].tolist().index(stop)
    out = generate(
        model, td, max_new_tokens=10, temperature=0, eos_token_id=EOS, pad_token_id=PAD, stop_token_ids=[stop]
    )
    assert out["responses"][0].tolist() == free["responses"][0, : first + 1].tolist()


def test_num_samples_groups(models):
    model = models["llama"]
    td = _prompts([3, 5, 2])
    out = generate(
        model,
        td,
        max_new_tokens=6,
        temperature=1.0,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_samples=4,
        generator=_gen(3),
    )
    assert out.batch_size == torch.Size([12])
    assert out["group"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for i in range(12):
        assert out["prompts"][i].tolist() == td["prompts"][i // 4].tolist()
        assert out["prompt_mask"][i].tolist() == td["prompt_mask"][i // 4].tolist()
    # samples of one prompt differ (random), greedy samples are identical
    assert len({tuple(r) for r in out["responses"][:4].tolist()}) > 1
    greedy = generate(
        model, td, max_new_tokens=6, temperature=0, eos_token_id=EOS, pad_token_id=PAD, num_samples=3
    )
    for g in range(3):
        rows = greedy["responses"][3 * g : 3 * g + 3].tolist()
        assert rows[0] == rows[1] == rows[2]


def test_top_k_1_equals_greedy(models):
    model = models["qwen2"]
    td = _prompts([3, 6, 1])
    kw = dict(max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    greedy = generate(model, td, temperature=0, **kw)
    top1 = generate(model, td, temperature=1.0, top_k=1, generator=_gen(9), **kw)
    assert greedy["responses"].tolist() == top1["responses"].tolist()
    # logprobs are those of the raw policy at temperature 1, in both
    assert torch.allclose(greedy["logprobs"], top1["logprobs"], atol=1e-6)


def test_reproducible_with_seeded_generator(models):
    model = models["gpt2"]
    td = _prompts([3, 5])
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, eos_token_id=EOS, pad_token_id=PAD)
    a = generate(model, td, generator=_gen(7), **kw)
    b = generate(model, td, generator=_gen(7), **kw)
    c = generate(model, td, generator=_gen(8), **kw)
    assert a["responses"].tolist() == b["responses"].tolist()
    assert torch.equal(a["logprobs"], b["logprobs"])
    assert a["responses"].tolist() != c["responses"].tolist()
    # the generator state carries on: a second call continues the stream (for exact resume)
    g = _gen(7)
    generate(model, td, generator=g, **kw)
    state = g.get_state()
    d1 = generate(model, td, generator=g, **kw)
    d2 = generate(model, td, generator=torch.Generator().set_state(state), **kw)
    assert d1["responses"].tolist() == d2["responses"].tolist()


def test_training_mode_restored(models):
    model = tiny_causal_lm("gpt2", V, seed=3).train()
    generate(model, _prompts([3]), max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD)
    assert model.training


def test_return_entropy_matches_forward(models):
    model = models["llama"]
    out = generate(
        model,
        _prompts([2, 5]),
        max_new_tokens=6,
        temperature=0.8,
        eos_token_id=EOS,
        pad_token_id=PAD,
        generator=_gen(1),
        return_entropy=True,
    )
    _, ent = policy_logprobs(model, out, temperature=0.8, return_entropy=True)
    assert torch.allclose(out["entropy"], ent, atol=1e-4)
    assert (out["entropy"][~out["action_mask"]] == 0).all()


# --- the sampler and the filters, on fixed logits ------------------------------------------------------


class _Uniform(torch.nn.Module):
    """A 'model' with constant logits; the logits processor supplies the distribution to sample from."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None
    ):
        from types import SimpleNamespace

        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab), past_key_values=None)


def test_top_p_never_samples_outside_nucleus():
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01])
    logits = probs.log()
    n = 4000
    td = make_prompts([[1]] * n, PAD)
    out = generate(
        _Uniform(8),
        td,
        max_new_tokens=1,
        temperature=1.0,
        top_p=0.7,
        eos_token_id=None,
        pad_token_id=PAD,
        generator=_gen(0),
        logits_processor=lambda ids, lg: logits.expand_as(lg),
    )
    counts = torch.bincount(out["responses"][:, 0], minlength=8).double()
    # nucleus at p = 0.7: 0.35 + 0.25 + 0.15 = 0.75 >= 0.7, so tokens 0, 1, 2
    assert counts[3:].sum() == 0
    expected = probs[:3].double() / probs[:3].sum() * n
    assert ((counts[:3] - expected).abs() / expected.sqrt()).max() < 4  # within 4 sigma
    # logprobs are those of the (constant) raw policy: uniform over 8
    assert torch.allclose(out["logprobs"], torch.full((n, 1), -torch.log(torch.tensor(8.0))))


def test_top_p_and_top_k_filters_match_hf():
    g = _gen(0)
    logits = torch.randn(50, 40, generator=g) * 3
    # a row whose cumulative probabilities hit 1 - p exactly (dyadic): the boundary token is dropped
    dyadic = torch.full((1, 40), -1e4)
    dyadic[0, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    logits = torch.cat([logits, dyadic])
    assert top_p_filter(dyadic, 0.75).isfinite().sum() == 2
    for p in (0.1, 0.5, 0.75, 0.9, 0.99):
        ours = top_p_filter(logits, p)
        hf = TopPLogitsWarper(p)(None, logits.clone())
        assert torch.equal(ours.isinf(), hf.isinf())
    for k in (1, 5, 40, 100):
        assert torch.equal(top_k_filter(logits, k), TopKLogitsWarper(k)(None, logits.clone()))


def test_sampler_distribution_matches_weights():
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0])
    n = 20000
    u = 1 - torch.rand(n, 1, generator=_gen(1))
    draws = inverse_cdf_sample(weights.expand(n, -1).contiguous(), u)
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0  # zero weight: never drawn
    expected = weights.double() / weights.sum() * n
    nz = weights > 0
    assert ((counts[nz] - expected[nz]).abs() / expected[nz].sqrt()).max() < 4


def test_sampler_edges_and_blocks(monkeypatch):
    # u = 1 hits the last token with weight, u -> 0 the first; across several blocks
    monkeypatch.setattr(sampling_mod, "_SAMPLE_BLOCK", 4)
    weights = torch.zeros(3, 11)
    weights[:, [2, 5, 9]] = torch.tensor([1.0, 2.0, 1.0])
    u = torch.tensor([[1.0], [1e-30], [0.5]])
    assert inverse_cdf_sample(weights, u).tolist() == [9, 2, 5]
    # exhaustive: inverse CDF on a grid of u against a Python loop
    w = torch.rand(2, 11, generator=_gen(3)) * (torch.rand(2, 11, generator=_gen(4)) > 0.4)
    for q in torch.linspace(0.01, 1.0, 37):
        got = inverse_cdf_sample(w, torch.full((2, 1), q.item()))
        for r in range(2):
            target, acc = q.item() * w[r].sum().item(), 0.0
            for j in range(11):
                acc += w[r, j].item()
                if acc >= target - 1e-6 and w[r, j] > 0:
                    break
            assert got[r].item() == j


# --- errors ---------------------------------------------------------------------------------------------


def test_errors(models):
    model = models["gpt2"]
    td = _prompts([3, 2])
    kw = dict(max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
    empty = TensorDict(
        prompts=torch.zeros(0, 3, dtype=torch.long),
        prompt_mask=torch.zeros(0, 3, dtype=torch.bool),
        batch_size=[0],
    )
    with pytest.raises(ValueError, match="empty"):
        generate(model, empty, **kw)
    bad = TensorDict(prompts=td["prompts"], prompt_mask=td["prompt_mask"][:, :2], batch_size=[2])
    with pytest.raises(ValueError, match="prompt_mask has shape"):
        generate(model, bad, **kw)
    with pytest.raises(ValueError, match="'prompt_mask' is missing"):
        generate(model, TensorDict(prompts=td["prompts"], batch_size=[2]), **kw)
    with pytest.raises(
        ValueError, match=r"P = 3 plus max_new_tokens = 126 = 129 .*max_position_embeddings = 128"
    ):
        generate(model, td, max_new_tokens=126, eos_token_id=EOS, pad_token_id=PAD)
    no_tokens = TensorDict(
        prompts=td["prompts"], prompt_mask=torch.tensor([[True] * 3, [False] * 3]), batch_size=[2]
    )
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] have no real token"):
        generate(model, no_tokens, **kw)
    for bad_kw, match in [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(num_samples=0), "num_samples"),
    ]:
        with pytest.raises(ValueError, match=match):
            generate(model, td, **kw, **bad_kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, td, max_new_tokens=0, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="pad_token_id"):
        generate(model, td, max_new_tokens=2, eos_token_id=EOS, pad_token_id=None)
    with pytest.raises(ValueError, match=r"prompts\[1, 2\] = 64 is outside the model's vocabulary \[0, 64\)"):
        ids = td["prompts"].clone()
        ids[1, 2] = V
        generate(model, TensorDict(prompts=ids, prompt_mask=td["prompt_mask"], batch_size=[2]), **kw)
    with pytest.raises(ValueError, match="pad_token_id = 99 is outside"):
        generate(model, td, max_new_tokens=2, eos_token_id=EOS, pad_token_id=99)
    with pytest.raises(ValueError, match="integer token ids"):
        generate(
            model,
            TensorDict(prompts=td["prompts"].float(), prompt_mask=td["prompt_mask"], batch_size=[2]),
            **kw,
        )


def test_small_batch_head_path_equals_policy_call(models, monkeypatch):
    # the split-head decode path (B <= 64 on CPU: backbone, then F.linear on the last position) against
    # calling the policy with logits_to_keep
    for arch in ARCHS:
        model = models[arch]
        td = _prompts([3, 6, 2])
        assert decoder_mod._small_batch_head(model, 6, torch.device("cpu")) is not None
        kw = dict(max_new_tokens=8, temperature=0.8, eos_token_id=EOS, pad_token_id=PAD, num_samples=2)
        fast = generate(model, td, generator=_gen(6), **kw)
        with monkeypatch.context() as m:
            m.setattr(decoder_mod, "_SMALL_BATCH_HEAD_ROWS", 0)
            assert decoder_mod._small_batch_head(model, 6, torch.device("cpu")) is None
            plain = generate(model, td, generator=_gen(6), **kw)
        assert fast["responses"].tolist() == plain["responses"].tolist()
        assert torch.allclose(fast["logprobs"], plain["logprobs"], atol=1e-5)
    assert decoder_mod._small_batch_head(_Uniform(8), 1, torch.device("cpu")) is None


def test_sparse_eos_checks_give_the_same_batch(models, monkeypatch):
    # the accelerator schedule (check "all finished?" every 8 steps) decodes a few extra steps, trimmed
    model = models["gpt2"]
    td = _prompts([4, 4, 4])
    kw = dict(max_new_tokens=20, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD)
    proc = _force_eos_at([1, 3, 2])
    every = generate(model, td, generator=_gen(0), logits_processor=proc, **kw)
    monkeypatch.setattr(generate_mod, "_EOS_CHECK_EVERY_CPU", 8)
    sparse = generate(model, td, generator=_gen(0), logits_processor=proc, **kw)
    assert sparse["responses"].shape == (3, 4)
    for key in ("responses", "action_mask", "logprobs", "input_ids", "attention_mask", "truncated"):
        assert torch.equal(every[key], sparse[key]), key


def test_in_place_processor_does_not_touch_logprobs(models):
    model = models["llama"]
    td = _prompts([3, 5])

    def in_place(ids, logits):
        logits[:, 5:] = float("-inf")  # sample from tokens 0..4 only
        return logits

    out = generate(
        model,
        td,
        max_new_tokens=6,
        temperature=1.0,
        eos_token_id=None,
        pad_token_id=PAD,
        generator=_gen(1),
        logits_processor=in_place,
    )
    assert (out["responses"] < 5).all()
    assert (policy_logprobs(model, out) - out["logprobs"]).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match=r"logits_processor must return logits of shape \(2, 64\)"):
        generate(
            model,
            td,
            max_new_tokens=2,
            eos_token_id=EOS,
            pad_token_id=PAD,
            logits_processor=lambda i, lg: lg[:, :3],
        )


def test_bf16_policy_runs_and_returns_float32():
    model = tiny_causal_lm("qwen2", V, seed=3).to(torch.bfloat16)
    td = _prompts([3, 6])
    out = generate(
        model, td, max_new_tokens=5, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD, generator=_gen(0)
    )
    assert out["logprobs"].dtype == torch.float32
    tf = policy_logprobs(model, out)
    assert tf.dtype == torch.float32
    assert (tf - out["logprobs"]).abs().max().item() < 0.1  # bf16 cache vs full forward: loose


def test_generate_texts_is_generate_on_tokenized_prompts_then_decode():
    """``generate_texts`` = ``tokenize_prompts`` + ``generate`` (eval mode, no grad) + ``decode``, and leaves
    the policy's mode as it was."""
    from rlbits.models.tiny import tiny_tokenizer
    from rlbits.rollout.generate import generate_texts
    from rlbits.text import decode, tokenize_prompts

    tok = tiny_tokenizer()
    policy = tiny_causal_lm("gpt2", vocab_size=len(tok), seed=0).train()
    prompts = ["a cat", "hello there", "x"]
    out = generate_texts(policy, tok, prompts, max_new_tokens=5, num_samples=2, generator=torch.Generator().manual_seed(3))
    assert policy.training and not out["logprobs"].requires_grad
    assert list(out["prompt_text"]) == [p for p in prompts for _ in range(2)]
    policy.eval()
    with torch.no_grad():
        ref = generate(policy, tokenize_prompts(tok, prompts), max_new_tokens=5, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, num_samples=2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out["responses"], ref["responses"]) and torch.equal(out["logprobs"], ref["logprobs"])
    assert list(out["response_text"]) == list(decode(ref, tok)["response_text"])


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefill_equals_repeated_prompts(models, arch):
    """K samples per prompt prefill each prompt once and repeat its cache rows: the same tokens and
    logprobs as K copies of the prompt decoded as separate rows."""
    td = _prompts([3, 6, 1], seed=4)
    K = 3
    shared = generate(
        models[arch], td, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, num_samples=K, generator=_gen(5)
    )
    repeated = TensorDict(
        prompts=td["prompts"].repeat_interleave(K, 0), prompt_mask=td["prompt_mask"].repeat_interleave(K, 0),
        batch_size=[td.batch_size[0] * K],
    )
    rows = generate(models[arch], repeated, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD, generator=_gen(5))
    assert torch.equal(shared["responses"], rows["responses"])
    assert torch.equal(shared["prompts"], rows["prompts"])
    torch.testing.assert_close(shared["logprobs"], rows["logprobs"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_emits_no_future_warning(models, arch):
    """The KV cache goes to the model under the keyword its forward names (``cache`` in transformers 5.2x,
    where ``past_key_values`` prints a FutureWarning on every call): no warning on the static-cache path, nor
    on the dynamic one (under autocast), with K samples sharing a prefill."""
    import warnings

    td = _prompts([3, 5])
    kw = dict(max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD, num_samples=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(models[arch], td, **kw, generator=_gen(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            generate(models[arch], td, **kw, generator=_gen(2))
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_autocast_generate_matches_autocast_forward(models, arch):
    """Under bf16 autocast (``precision: bf16``) decoding works for GPT-2, Llama and Qwen2 (RoPE models
    used to fail: fp32 keys and bf16 values in one static cache) and its logprobs are those of the
    autocast teacher-forced forward the trainer computes, to bf16 rounding: the step-1 KL is bounded."""
    td = _prompts([4, 7, 2, 5], seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(
            models[arch], td, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, num_samples=2, generator=_gen(7)
        )
        with torch.no_grad():
            tf = policy_logprobs(models[arch], out)
    mask = out["action_mask"]
    diff = (out["logprobs"] - tf)[mask]
    assert out["logprobs"].dtype == torch.float32 and mask.any()
    assert diff.abs().max().item() < 0.05  # bf16 rounding of cached vs recomputed activations
    # the k1 KL estimate between sampler and trainer per sequence, what init_policy_kl shows at step 1
    assert abs((diff.sum() / out.batch_size[0]).item()) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_decode_step_equals_eager(models, arch):
    """``compile=True`` (the decode step under torch.compile, static cache rounded up to a bucket)
    samples the same tokens with the same logprobs as eager decoding, and a second call with another
    prompt length reuses the compiled step."""
    td = _prompts([3, 6, 2], seed=8)
    kw = dict(max_new_tokens=7, temperature=0.7, eos_token_id=EOS, pad_token_id=PAD, num_samples=2)
    eager = generate(models[arch], td, **kw, generator=_gen(9))
    compiled = generate(models[arch], td, **kw, generator=_gen(9), compile=True)
    assert torch.equal(eager["responses"], compiled["responses"])
    torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], atol=1e-5, rtol=0)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    td2 = _prompts([5, 9, 4], seed=10)  # another P, the same cache bucket and batch size
    eager2 = generate(models[arch], td2, **kw, generator=_gen(11))
    compiled2 = generate(models[arch], td2, **kw, generator=_gen(11), compile=True)
    assert torch.equal(eager2["responses"], compiled2["responses"])
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation


@pytest.mark.slow
def test_compiled_decode_step_without_small_batch_head(models, monkeypatch):
    """Where the eager decode step calls the policy as is (on CUDA, or above ``_SMALL_BATCH_HEAD_ROWS``
    rows on CPU), ``compile=True`` still compiles the step with the split head, and samples what eager
    decoding samples."""
    monkeypatch.setattr(decoder_mod, "_SMALL_BATCH_HEAD_ROWS", 1)
    td = _prompts([3, 6, 2], seed=12)
    kw = dict(max_new_tokens=6, temperature=0.9, eos_token_id=EOS, pad_token_id=PAD, num_samples=2)
    assert decoder_mod._small_batch_head(models["llama"], 6, torch.device("cpu")) is None
    eager = generate(models["llama"], td, **kw, generator=_gen(13))
    steps = []
    original = decoder_mod.compiled_decode_step

    def spy(device_type="cpu"):
        step = original(device_type)
        return lambda *args: steps.append(args) or step(*args)

    monkeypatch.setattr(decoder_mod, "compiled_decode_step", spy)
    compiled = generate(models["llama"], td, **kw, generator=_gen(13), compile=True)
    assert len(steps) == kw["max_new_tokens"] - 1  # every decode step went through the compiled step
    assert torch.equal(eager["responses"], compiled["responses"])
    torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("continuous_batching", [False, True])
def test_on_step_swaps_weights_mid_decode(continuous_batching):
    """Partial rollouts: new weights loaded in place at token 3 sample tokens 3.. with their own logprobs (the
    cache recomputed), the first tokens keep the old weights'; ``token_version`` says which."""
    old, new = tiny_causal_lm("llama", V, seed=3), tiny_causal_lm("llama", V, seed=4)
    model = tiny_causal_lm("llama", V, seed=3)
    calls = []

    def on_step(t):
        calls.append(t)
        if t == 3:
            with torch.no_grad():
                for dst, src in zip(model.parameters(), new.parameters(), strict=True):
                    dst.copy_(src)
        return 7 if t < 3 else 8

    out = generate(
        model, _prompts([5, 2, 9]), max_new_tokens=8, temperature=0.9, eos_token_id=EOS, pad_token_id=PAD,
        num_samples=2, generator=_gen(1), on_step=on_step, continuous_batching=continuous_batching,
        pack_weights=True,
    )
    check(out, check_values=True)
    R = out["responses"].shape[1]
    assert calls[0] == 0 and calls == list(range(len(calls)))
    assert out["token_version"].tolist() == [[7 if t < 3 else 8 for t in range(R)]] * 6
    for i, (prompt, response) in enumerate(_rows(out)):
        # the reference: per token, a full forward of the weights that sampled it over the prompt and tokens so far
        ref = [
            _reference_logprobs(old if t < 3 else new, prompt, response[: t + 1], 0.9)[t]
            for t in range(len(response))
        ]
        got = out["logprobs"][i, : len(response)].double()
        assert (got - torch.tensor(ref, dtype=torch.float64)).abs().max().item() <= 1e-5


def test_on_step_must_return_an_int(models):
    with pytest.raises(ValueError, match="on_step"):
        generate(models["gpt2"], _prompts([3]), max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD,
                 generator=_gen(0), on_step=lambda t: None)
