"""Generation options (issue 25): top-k, top-p and the repetition penalty against Python loops over the
vocabulary, ``min_new_tokens``, stop strings, chunked rollouts, the behaviour logprobs they leave raw, and the
config fields (``generation_options``, ``val_generation``)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from rlbits.batch import check
from rlbits.loops.config_yaml import ConfigError
from rlbits.loops.phases import generation_options
from rlbits.loops.ppo import PPOConfig
from rlbits.models.forward import policy_logprobs
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer
from rlbits.rollout.generate import generate, generate_texts, stop_strings_stopping
from rlbits.rollout.sampling import next_token, repetition_penalty_filter, top_k_filter, top_p_filter
from rlbits.text import make_prompts

V = 64
EOS = V - 1
PAD = 0


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------
# References: one row at a time, a Python loop over the vocabulary
# ---------------------------------------------------------------------------------------------------------


def ref_top_k(row: list[float], k: int) -> list[bool]:
    """Kept tokens: those not below the k-th largest logit (ties with it kept, as HF's TopKLogitsWarper)."""
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [x >= kth for x in row]


def ref_top_p(row: list[float], p: float) -> list[bool]:
    """Kept tokens as HF's TopPLogitsWarper: sort ascending, drop tokens while the cumulative probability
    is <= 1 - p, never the most likely one."""
    m = max(row)
    probs = [math.exp(x - m) for x in row]
    total = sum(probs)
    order = sorted(range(len(row)), key=lambda i: row[i])  # ascending
    keep = [True] * len(row)
    cum = 0.0
    for n, i in enumerate(order):
        cum += probs[i] / total
        if cum <= 1 - p and n < len(row) - 1:
            keep[i] = False
    return keep


def ref_repetition_penalty(row: list[float], ids: list[int], penalty: float) -> list[float]:
    """HF's RepetitionPenaltyLogitsProcessor on one row: each id present once penalised."""
    out = list(row)
    for v in set(ids):
        out[v] = row[v] * penalty if row[v] < 0 else row[v] / penalty
    return out


def test_top_k_against_loop():
    logits = torch.randn(20, 33, generator=_gen(0)) * 2
    logits[3, :5] = 1.5  # ties at the k-th
    for k in (1, 3, 5, 33, 50):
        ours = top_k_filter(logits, k).isfinite()
        for b in range(logits.shape[0]):
            assert ours[b].tolist() == ref_top_k(logits[b].tolist(), k)


def test_top_p_against_loop():
    logits = (torch.randn(30, 40, generator=_gen(1)) * 3).double()
    for p in (0.05, 0.3, 0.75, 0.9, 0.999):
        ours = top_p_filter(logits, p).isfinite()
        for b in range(logits.shape[0]):
            assert ours[b].tolist() == ref_top_p(logits[b].tolist(), p)


@pytest.mark.parametrize("penalty", [0.7, 1.2, 2.0])
def test_repetition_penalty_against_loop_and_hf(penalty):
    g = _gen(2)
    logits = torch.randn(6, V, generator=g) * 3
    ids = torch.randint(0, V, (6, 9), generator=g)
    ours = repetition_penalty_filter(logits, ids, penalty)
    for b in range(6):
        ref = ref_repetition_penalty(logits[b].tolist(), ids[b].tolist(), penalty)
        assert torch.allclose(ours[b], torch.tensor(ref), rtol=0, atol=1e-6)
    assert torch.allclose(ours, RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone()), atol=1e-6)
    # padding (mask False) is not penalised
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :3] = False
    masked = repetition_penalty_filter(logits, ids, penalty, mask)
    for b in range(6):
        ref = ref_repetition_penalty(logits[b].tolist(), ids[b, 3:].tolist(), penalty)
        assert torch.allclose(masked[b], torch.tensor(ref), atol=1e-6)


def test_next_token_samples_the_processed_distribution_and_reports_raw_logprobs():
    """Tokens come from the processed distribution (penalty, ban, temperature, top-k, top-p); the logprob is
    of softmax(raw / T)."""
    g = _gen(3)
    logits = torch.randn(4, V, generator=g) * 2
    ids = torch.randint(0, V, (4, 5), generator=g)
    banned = torch.tensor([EOS, 5])
    T, k, p, pen = 0.8, 10, 0.9, 1.3
    n = 4000
    counts = torch.zeros(4, V)
    gen = _gen(4)
    for _ in range(n // 100):
        tok, lp = next_token(
            logits.repeat(100, 1),
            ids.repeat(100, 1),
            temperature=T,
            top_k=k,
            top_p=p,
            logits_processor=None,
            generator=gen,
            repetition_penalty=pen,
            banned=banned,
        )
        raw = torch.log_softmax(logits.repeat(100, 1) / T, -1).gather(1, tok[:, None]).squeeze(1)
        assert torch.allclose(lp, raw, atol=1e-5)
        counts += torch.nn.functional.one_hot(tok, V).view(100, 4, V).sum(0).float()
    for b in range(4):
        z = ref_repetition_penalty(logits[b].tolist(), ids[b].tolist(), pen)
        z = [-math.inf if v in (EOS, 5) else x / T for v, x in enumerate(z)]
        keep = ref_top_k(z, k)
        z = [x if kept else -math.inf for x, kept in zip(z, keep, strict=True)]
        keep = ref_top_p(z, p)
        z = [x if kept else -math.inf for x, kept in zip(z, keep, strict=True)]
        m = max(z)
        probs = torch.tensor([math.exp(x - m) for x in z], dtype=torch.float64)
        probs /= probs.sum()
        assert counts[b][probs == 0].sum() == 0  # filtered tokens are never drawn
        nz = probs > 0.02
        expected = probs[nz] * n
        assert ((counts[b][nz].double() - expected).abs() / expected.sqrt()).max() < 4.5


# ---------------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("qwen2", V, seed=3)


def _prompts(lengths, seed=0):
    g = _gen(seed)
    return make_prompts([torch.randint(3, EOS, (n,), generator=g).tolist() for n in lengths], PAD)


def _eos_forcing(ids, logits):
    out = torch.full_like(logits, -30.0)
    out[:, EOS] = 0.0
    out[:, 7] = -1.0
    return out


def test_min_new_tokens_masks_eos_before(model):
    td = _prompts([4, 2, 3])
    for m in (0, 1, 3):
        out = generate(
            model,
            td,
            max_new_tokens=8,
            temperature=1.0,
            eos_token_id=EOS,
            pad_token_id=PAD,
            generator=_gen(2),
            logits_processor=_eos_forcing,
            min_new_tokens=m,
        )
        check(out, check_values=True)
        n = m + 1  # m tokens, then EOS (all but certain as soon as it is allowed), as HF and vLLM
        assert out["action_mask"].sum(1).tolist() == [n] * 3
        assert (out["responses"][:, n - 1] == EOS).all() and (out["responses"][:, : n - 1] == 7).all()
        # the logprobs stay the raw policy's
        assert (policy_logprobs(model, out, temperature=1.0) - out["logprobs"]).abs().max() <= 1e-4


def test_greedy_repetition_penalty_equals_hf_generate(model):
    td = _prompts([6, 6, 6], seed=5)  # no padding: HF would penalise the pad id too
    ours = generate(
        model,
        td,
        max_new_tokens=12,
        temperature=0,
        eos_token_id=None,
        pad_token_id=PAD,
        repetition_penalty=30.0,
    )
    hf = model.generate(
        input_ids=td["prompts"],
        attention_mask=td["prompt_mask"].long(),
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=PAD,
        eos_token_id=None,
        repetition_penalty=30.0,
    )[:, 6:]
    assert ours["responses"].tolist() == hf.tolist()
    plain = generate(model, td, max_new_tokens=12, temperature=0, eos_token_id=None, pad_token_id=PAD)
    assert not torch.equal(plain["responses"], ours["responses"])  # the penalty changed something


def test_sampled_options_keep_raw_logprobs(model):
    td = _prompts([5, 2, 7, 1])
    out = generate(
        model,
        td,
        max_new_tokens=10,
        temperature=0.7,
        top_k=5,
        top_p=0.8,
        repetition_penalty=1.3,
        min_new_tokens=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_samples=2,
        generator=_gen(1),
    )
    check(out, check_values=True)
    assert (policy_logprobs(model, out, temperature=0.7) - out["logprobs"]).abs().max() <= 1e-4


def test_generate_rejects_bad_options(model):
    td = _prompts([3])
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(model, td, max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="min_new_tokens"):
        generate(model, td, max_new_tokens=2, eos_token_id=EOS, pad_token_id=PAD, min_new_tokens=-1)


# ---------------------------------------------------------------------------------------------------------
# generate_texts: stop strings, chunks
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok_policy():
    tok = tiny_tokenizer()
    return tok, tiny_causal_lm("gpt2", vocab_size=len(tok), seed=0)


def test_stop_strings_end_the_response_at_the_completing_token(tok_policy):
    tok, policy = tok_policy
    prompts = ["a cat", "hello there", "x"]
    free = generate_texts(policy, tok, prompts, max_new_tokens=12, generator=_gen(3))
    r = int(free["action_mask"].sum(1).argmax())
    ids = free["responses"][r][free["action_mask"][r]].tolist()
    assert len(ids) >= 4
    text = tok.decode(ids[: len(ids) // 2 + 1], skip_special_tokens=False)
    stop = text[-2:] if len(text) >= 2 else text
    # the first token whose text so far holds the stop string
    end = next(j for j in range(len(ids)) if stop in tok.decode(ids[: j + 1], skip_special_tokens=False))
    out = generate_texts(policy, tok, prompts, max_new_tokens=12, generator=_gen(3), stop_strings=[stop])
    check(out, check_values=True)
    n = int(out["action_mask"][r].sum())
    assert n == end + 1 and out["responses"][r, :n].tolist() == ids[:n]
    assert stop in tok.decode(ids[:n], skip_special_tokens=False)
    assert stop in out["response_text"][r] or not tok.decode(ids[:n], skip_special_tokens=True).strip()
    assert torch.equal(out["logprobs"][r, :n], free["logprobs"][r, :n])
    assert not out["truncated"][r] or n == 12
    # no row outlives its first stop string
    for i in range(out.batch_size[0]):
        row = out["responses"][i][out["action_mask"][i]].tolist()
        assert not any(
            stop in tok.decode(row[: j + 1], skip_special_tokens=False) for j in range(len(row) - 1)
        )
    with pytest.raises(ValueError, match="non-empty"):
        stop_strings_stopping(tok, [""])


def test_chunks_are_separate_calls_on_the_same_generator(tok_policy):
    tok, policy = tok_policy
    prompts = ["a cat", "hello there", "x", "the dog", "b"]
    whole = generate_texts(policy, tok, prompts, max_new_tokens=6, num_samples=2, generator=_gen(4))
    same = generate_texts(
        policy, tok, prompts, max_new_tokens=6, num_samples=2, generator=_gen(4), chunk_size=5
    )
    for key in ("responses", "logprobs", "action_mask", "group", "prompts"):
        assert torch.equal(whole[key], same[key])
    chunked = generate_texts(
        policy, tok, prompts, max_new_tokens=6, num_samples=2, generator=_gen(4), chunk_size=2
    )
    check(chunked, check_values=True)
    assert chunked["group"].tolist() == [i for i in range(5) for _ in range(2)]
    assert list(chunked["prompt_text"]) == [p for p in prompts for _ in range(2)]
    # each chunk equals its own call, the generator going on from the previous chunk: the same tokens, and the
    # same logprobs to float rounding (a chunk's prompts keep the whole call's left padding, 11 columns where
    # its own call has 7, and some CPUs' kernels round those shapes differently: 4.8e-7 on an AVX-512 EPYC)
    g = _gen(4)
    rows = 0
    for start in range(0, 5, 2):
        part = generate_texts(
            policy, tok, prompts[start : start + 2], max_new_tokens=6, num_samples=2, generator=g
        )
        n, r = part.batch_size[0], part["responses"].shape[1]
        assert torch.equal(chunked["responses"][rows : rows + n, :r], part["responses"])
        torch.testing.assert_close(chunked["logprobs"][rows : rows + n, :r], part["logprobs"], rtol=0, atol=1e-5)
        assert not chunked["action_mask"][rows : rows + n, r:].any()
        assert list(chunked["response_text"])[rows : rows + n] == list(part["response_text"])
        rows += n
    with pytest.raises(ValueError, match="chunk_size"):
        generate_texts(policy, tok, prompts, max_new_tokens=2, chunk_size=0)


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


def test_config_generation_fields_and_val_overrides(tmp_path):
    cfg = PPOConfig(run_dir=str(tmp_path / "r"))
    assert generation_options(cfg) == dict(
        max_new_tokens=cfg.max_new_tokens,
        temperature=1.0,
        top_k=None,
        top_p=None,
        repetition_penalty=1.0,
        min_new_tokens=0,
        stop_strings=[],
    )
    cfg = PPOConfig(
        run_dir=str(tmp_path / "r"),
        top_k=20,
        top_p=0.9,
        repetition_penalty=1.2,
        stop_strings=["\n"],
        val_generation={"top_k": None, "temperature": 0.5, "max_new_tokens": 8},
        chunk_size=4,
        val_batch_size=3,
    )
    train, val = generation_options(cfg), generation_options(cfg, validation=True)
    assert (train["top_k"], train["top_p"], train["temperature"]) == (20, 0.9, 1.0)
    assert (val["top_k"], val["top_p"], val["temperature"], val["max_new_tokens"]) == (None, 0.9, 0.5, 8)
    greedy = PPOConfig(run_dir=str(tmp_path / "r"), val_greedy=True, val_generation={"temperature": 0.5})
    assert generation_options(greedy, validation=True)["temperature"] == 0.0
    for bad, match in (
        (dict(val_generation={"beta": 1}), "unknown key"),
        (dict(val_generation={"top_p": 2.0}), "val_generation: top_p"),
        (dict(min_new_tokens=30, max_new_tokens=10), "min_new_tokens"),
        (dict(stop_strings=[""]), "stop_strings"),
        (dict(top_k=0), "top_k"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(chunk_size=0), "chunk_size"),
    ):
        with pytest.raises(ConfigError, match=match):
            PPOConfig(run_dir=str(tmp_path / "r"), **bad)


def test_multi_turn_refuses_single_turn_options(tmp_path):
    from rlbits.loops.phases import _check_single_turn

    _check_single_turn(PPOConfig(run_dir=str(tmp_path / "r")))
    with pytest.raises(ValueError, match="stop_strings, top_k apply"):
        _check_single_turn(PPOConfig(run_dir=str(tmp_path / "r"), top_k=3, stop_strings=["x"]))
    with pytest.raises(ValueError, match="chunk_size"):
        _check_single_turn(PPOConfig(run_dir=str(tmp_path / "r"), chunk_size=2))


@pytest.mark.slow
def test_reinforce_loop_with_every_option(tmp_path):
    """Two REINFORCE steps (ReMax: its greedy phase too) with every generation option set: the trainer's
    logprobs equal the sampler's (approx_kl 0 on the first pass), validation uses its overrides."""
    from rlbits.loops.reinforce import ReinforceConfig, train
    from rlbits.loops.run import read_metrics

    path = tmp_path / "tiny"
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    cfg = ReinforceConfig(
        task="arithmetic",
        policy=str(path),
        run_dir=str(tmp_path / "run"),
        max_num_steps=2,
        num_prompts_per_step=4,
        num_generations_per_prompt=2,
        max_new_tokens=6,
        microbatch_size=8,
        learning_rate=1e-3,
        max_val_samples=5,
        progress=False,
        tensorboard=False,
        log_samples=0,
        save_period=0,
        adv_estimator="remax",
        top_k=8,
        top_p=0.95,
        repetition_penalty=1.1,
        min_new_tokens=2,
        stop_strings=["1"],
        chunk_size=3,
        val_batch_size=2,
        val_generation={"top_k": None, "max_new_tokens": 3},
    )
    rows = read_metrics(train(cfg, reward=lambda prompts, responses: [float(len(r) % 3) for r in responses]))
    train_rows = [r for r in rows if "approx_kl" in r]
    assert train_rows and all(abs(r["approx_kl"]) < 1e-5 for r in train_rows)
    assert all(2 <= r["response_len"] <= 6 for r in train_rows)
    val = [r["val_response_len"] for r in rows if "val_response_len" in r]
    assert val and all(v <= 3 for v in val)
