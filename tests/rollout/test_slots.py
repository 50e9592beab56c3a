"""generate(max_num_seqs=S): a fixed number of slots that waiting samples take as samples finish. Checked against
a slow reference that decodes each sample alone (one row, no cache, a full forward per token, the same noise
entry per token), for every S, every generation option and the cache's move to the front; the logprobs against
a teacher-forced forward; the prefill count; the errors."""

from __future__ import annotations

import pytest
import torch

from rlbits.models.forward import policy_logprobs, position_ids_from_mask
from rlbits.models.heads import ILQLModel
from rlbits.models.steered import SteeredPolicy
from rlbits.models.tiny import tiny_causal_lm
from rlbits.rollout import decoder as decoder_mod
from rlbits.rollout import generate as generate_mod
from rlbits.rollout.generate import generate, generate_texts
from rlbits.rollout.sampling import next_token
from rlbits.text import make_prompts

V = 64
EOS = V - 1
PAD = 0
N = 10  # max_new_tokens


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_causal_lm(arch, V, seed=3) for arch in ("gpt2", "llama", "qwen2")}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return make_prompts([torch.randint(3, EOS, (n,), generator=g).tolist() for n in lengths], PAD)


PROMPTS = _prompts([3, 6, 1, 4])  # left-padded to 6 columns


def _eos_at(prompt_len: int):
    """A row-local logits processor: EOS forced at a response length read from the row's own prompt and first
    response token (2..N-2, or never for about a fifth of the rows) and banned before it."""

    def process(ids, logits):
        t = ids.shape[1] - prompt_len + 1  # the response length once this step's token is appended
        key = (
            ids[:, prompt_len - 2 : prompt_len + 1].long()
            * torch.tensor([31, 17, 7])[: ids.shape[1] - prompt_len + 2]
        )
        h = key.sum(1) % 101
        at = torch.where(h < 20, N + 1, 2 + h % (N - 3))
        logits = logits.clone()
        logits[:, EOS] = torch.where(at == t, 1e4, float("-inf"))
        return logits

    return process


def _alone(
    model, td, *, num_samples, seed, max_new_tokens=N, stop=(EOS,), stopping=None, min_new_tokens=0, **kw
):
    """The reference: each sample decoded on its own from its left-padded prompt row, one full forward of the
    whole sequence per token, sampling with ``next_token`` on ``u[i, t]`` of ``u = torch.rand(B, N)``.
    Returns per sample (tokens, logprobs, entropies, finished)."""
    temperature = kw["temperature"]
    n, P = td["prompts"].shape
    B = n * num_samples
    u = (
        torch.rand(B, max_new_tokens, generator=torch.Generator().manual_seed(seed))
        if temperature > 0
        else None
    )
    stop_t = torch.tensor(list(stop), dtype=torch.long)
    rows = []
    for i in range(B):
        ids = td["prompts"][i // num_samples][None].long()
        mask = td["prompt_mask"][i // num_samples][None].bool()
        tokens, lps, ents, finished = [], [], [], False
        for t in range(max_new_tokens):
            with torch.no_grad():
                logits = (
                    model(
                        input_ids=ids,
                        attention_mask=mask,
                        position_ids=position_ids_from_mask(mask),
                        use_cache=False,
                    )
                    .logits[:, -1]
                    .float()
                )
            tok, lp = next_token(
                logits,
                ids,
                input_mask=mask,
                banned=stop_t if t < min_new_tokens and len(stop) else None,
                uniforms=None if u is None else u[i, t].view(1, 1),
                generator=None,
                top_k=kw.get("top_k"),
                top_p=kw.get("top_p"),
                temperature=temperature,
                logits_processor=kw.get("logits_processor"),
                repetition_penalty=kw.get("repetition_penalty", 1.0),
            )
            p = torch.softmax(logits / (temperature or 1.0), -1)
            ents.append(float(-(p * torch.log_softmax(logits / (temperature or 1.0), -1)).sum()))
            tokens.append(int(tok))
            lps.append(float(lp))
            ids = torch.cat([ids, tok[:, None]], 1)
            mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.bool)], 1)
            if int(tok) in stop or (
                stopping is not None and t + 1 >= min_new_tokens and bool(stopping(ids[:, P:])[0])
            ):
                finished = True
                break
        rows.append((tokens, lps, ents, finished))
    return rows


def _check_against(out, reference, entropy=False):
    assert out.batch_size[0] == len(reference)
    R = max(len(r[0]) for r in reference)
    assert out["responses"].shape[1] == R
    for i, (tokens, lps, ents, finished) in enumerate(reference):
        n = len(tokens)
        assert out["action_mask"][i].tolist() == [True] * n + [False] * (R - n), i
        assert out["responses"][i, :n].tolist() == tokens, i
        assert (out["responses"][i, n:] == PAD).all()
        torch.testing.assert_close(out["logprobs"][i, :n], torch.tensor(lps), atol=1e-5, rtol=0)
        assert (out["logprobs"][i, n:] == 0).all()
        assert bool(out["truncated"][i]) == (not finished and n == N), i
        if entropy:
            torch.testing.assert_close(out["entropy"][i, :n], torch.tensor(ents), atol=1e-4, rtol=0)


def _kw(**kw):
    return {"max_new_tokens": N, "temperature": 1.0, "eos_token_id": EOS, "pad_token_id": PAD, **kw}


def _run(model, td, seed, **kw):
    return generate(model, td, generator=torch.Generator().manual_seed(seed), **_kw(**kw))


@pytest.mark.parametrize("arch,temperature,k", [("gpt2", 1.0, 2), ("llama", 0.7, 3), ("qwen2", 0.0, 2)])
def test_every_slot_count_equals_the_alone_reference(models, arch, temperature, k):
    """S = 1, 2, 3 and B (every sample in one batch): the reference's tokens and logprobs."""
    model, td = models[arch], PROMPTS
    process = _eos_at(td["prompts"].shape[1])
    reference = _alone(model, td, num_samples=k, seed=5, temperature=temperature, logits_processor=process)
    lengths = [len(r[0]) for r in reference]
    assert max(lengths) - min(lengths) >= 5  # uneven
    B = td.batch_size[0] * k
    for slots in (1, 2, 3, B):
        out = _run(
            model, td, 5, num_samples=k, temperature=temperature, logits_processor=process, max_num_seqs=slots
        )
        _check_against(out, reference)
        assert out["group"].tolist() == [i // k for i in range(B)]
        assert torch.equal(out["prompts"], td["prompts"].repeat_interleave(k, 0))


def test_without_a_processor_and_natural_stops(models):
    """No logits processor (one sampling call for all slots): rows end on many stop ids at random steps."""
    model, td = models["llama"], PROMPTS
    stops = [EOS, *range(5, 12)]
    reference = _alone(model, td, num_samples=2, seed=9, temperature=1.0, stop=stops)
    assert len({len(r[0]) for r in reference}) >= 3
    for slots in (1, 3):
        out = _run(model, td, 9, num_samples=2, stop_token_ids=stops[1:], max_num_seqs=slots)
        _check_against(out, reference)


@pytest.mark.parametrize(
    "options",
    [
        dict(top_k=5),
        dict(top_p=0.8),
        dict(top_k=8, top_p=0.9, temperature=0.8),
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=1.3, processor=False),
        dict(min_new_tokens=4),
        dict(min_new_tokens=4, processor=False),
        dict(stopping=True),
        dict(return_entropy=True),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_every_option_equals_the_alone_reference(models, options):
    model, td = models["qwen2"], PROMPTS
    options = dict(options)
    kw = {"temperature": options.pop("temperature", 1.0)}
    stops = [EOS]
    if options.pop("processor", True):
        kw["logits_processor"] = _eos_at(td["prompts"].shape[1])
    else:
        stops = [EOS, *range(5, 10)]
    if options.pop("stopping", False):  # a row ends after a response token id divisible by 7
        options["stopping"] = lambda responses: responses[:, -1] % 7 == 0
    entropy = options.pop("return_entropy", False)
    reference = _alone(model, td, num_samples=2, seed=2, stop=stops, **kw, **options)
    out = _run(
        model,
        td,
        2,
        num_samples=2,
        max_num_seqs=3,
        stop_token_ids=stops[1:],
        return_entropy=entropy,
        **kw,
        **options,
    )
    _check_against(out, reference, entropy=entropy)


def test_cache_moves_to_the_front(models, monkeypatch):
    """A cache of 1.25 live spans: the live columns move to the front every few steps; still the reference."""
    calls = []
    shift = decoder_mod.shift_columns
    monkeypatch.setattr(generate_mod, "_SLOT_CACHE_SPANS", 1.25)
    monkeypatch.setattr(generate_mod, "shift_columns", lambda *a: calls.append(a) or shift(*a))
    model, td = models["gpt2"], PROMPTS
    process = _eos_at(td["prompts"].shape[1])
    reference = _alone(model, td, num_samples=3, seed=4, temperature=1.0, logits_processor=process)
    out = _run(model, td, 4, num_samples=3, logits_processor=process, max_num_seqs=2)
    _check_against(out, reference)
    assert len(calls) >= 3


def test_logprobs_equal_teacher_forcing_on_late_rows(models):
    model, td = models["llama"], PROMPTS
    out = _run(model, td, 7, num_samples=3, logits_processor=_eos_at(td["prompts"].shape[1]), max_num_seqs=2)
    forced = policy_logprobs(model, out)
    mask = out["action_mask"]
    torch.testing.assert_close(out["logprobs"][mask], forced[mask], atol=1e-5, rtol=0)
    assert mask[-4:].any(dim=1).all()  # the last samples (which entered late) have tokens


def test_the_samples_of_a_prompt_share_one_prefill(models, monkeypatch):
    calls = []
    prefill = generate_mod.prefill
    monkeypatch.setattr(generate_mod, "prefill", lambda *a: calls.append(a[1].shape[0]) or prefill(*a))
    td = _prompts([2, 3, 1, 4, 2, 3, 5])  # 7 prompts, K = 3: 21 samples, chunks of S = 3 prompts
    _run(models["gpt2"], td, 1, num_samples=3, max_num_seqs=3)
    assert calls == [3, 3, 1]


def test_generate_texts_passes_it_on(models):
    from rlbits.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(V)
    kw = dict(max_new_tokens=6, num_samples=2, stop_strings=["a"])
    a = generate_texts(
        models["gpt2"],
        tokenizer,
        ["hi", "a longer one"],
        generator=torch.Generator().manual_seed(0),
        max_num_seqs=1,
        **kw,
    )
    b = generate_texts(
        models["gpt2"],
        tokenizer,
        ["hi", "a longer one"],
        generator=torch.Generator().manual_seed(0),
        max_num_seqs=4,
        **kw,
    )
    assert torch.equal(a["responses"], b["responses"]) and a["response_text"] == b["response_text"]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "2"])
def test_bad_max_num_seqs(models, bad):
    with pytest.raises(ValueError, match="max_num_seqs must be None or an int >= 1"):
        _run(models["gpt2"], PROMPTS, 0, max_num_seqs=bad)


class _NoStaticCache(torch.nn.Module):
    """A causal LM without static-cache support (HF's dynamic cache)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, **kw):
        return self.model(**kw)


def test_refused_models(models):
    with pytest.raises(ValueError, match="_NoStaticCache does not support"):
        _run(_NoStaticCache(models["gpt2"]), PROMPTS, 0, max_num_seqs=2)
    steered = SteeredPolicy(ILQLModel(tiny_causal_lm(vocab_size=V), seed=0), 1.0)
    with pytest.raises(ValueError, match="does not support SteeredPolicy"):
        _run(steered, PROMPTS, 0, max_num_seqs=2)


def test_partial_rollouts_are_refused_with_slots(models):
    """A weight swap mid-decode (``on_step``, partial rollouts) recomputes the whole batch's cache, which slots at
    different steps do not share: refused in ``generate`` and in the config."""
    from rlbits.loops import reinforce
    from rlbits.loops.config_fields import ConfigError

    with pytest.raises(ValueError, match="does not take on_step"):
        _run(models["gpt2"], PROMPTS, 0, max_num_seqs=2, on_step=lambda t: 0)
    with pytest.raises(ConfigError, match="partial_rollouts: true recomputes"):
        reinforce.ReinforceConfig(
            async_mode="ranks", rollout_ranks=1, async_schedule="eager", partial_rollouts=True, max_num_seqs=4
        )


def test_generate_episodes_refuses_it(models):
    from rlbits.models.tiny import tiny_tokenizer
    from rlbits.rollout.multiturn import generate_episodes

    with pytest.raises(ValueError, match="generate_episodes does not support max_num_seqs"):
        generate_episodes(models["gpt2"], tiny_tokenizer(V), [], [], temperature=1.0, max_num_seqs=2)


def test_the_loops_pass_it_on(monkeypatch):
    """The config field: checked, and passed to ReMax's greedy baseline and the preference loop's offline
    pairs (the rollouts: the slow run below)."""
    from types import SimpleNamespace

    from tensordict import TensorDict

    from rlbits.loops import phases, preference, reinforce
    from rlbits.loops.config_fields import ConfigError
    from rlbits.loops.metrics import StepMetrics

    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="max_num_seqs"):
            reinforce.ReinforceConfig(max_num_seqs=bad)
    seen = []

    def fake(*args, **kw):
        seen.append(kw["max_num_seqs"])
        n = len(args[2]) * kw.get("num_samples", 1)
        ones = torch.ones(n, 2, dtype=torch.long)
        keys = {"prompts": ones, "prompt_mask": ones, "responses": ones, "action_mask": ones.bool()}
        return TensorDict({**keys, "rewards": torch.zeros(n)}, batch_size=[n])

    with monkeypatch.context() as m:
        m.setattr(phases, "generate_rollout", fake)
        m.setattr(phases, "score_rollout", lambda batch, reward: batch["rewards"])
        batch = TensorDict(
            {"prompt_text": ["a", "a", "b", "b"], "action_mask": torch.ones(4, 2)}, batch_size=[4]
        )
        cfg = reinforce.ReinforceConfig(adv_estimator="remax", num_generations_per_prompt=2, max_num_seqs=3)
        state = SimpleNamespace(
            policy=torch.nn.Linear(1, 1), make_env=None, tokenizer=None, reward=None, metrics=StepMetrics()
        )
        reinforce.greedy_baseline(state, batch, cfg)
        pcfg = preference.PreferenceConfig(num_generations_per_prompt=2, max_num_seqs=3)
        preference.sample_pairs(None, None, ["a", "b"], None, pcfg, torch.Generator())
    assert seen == [3, 3]


@pytest.mark.slow
def test_a_grpo_run_with_slots_trains(monkeypatch, tmp_path):
    """The pinned GRPO setup of tests/loops/test_golden.py, 2 steps, 4 slots for its 8 samples per step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loops"))
    from test_golden import run_pinned_setup

    calls = []
    original = generate_mod.decode_with_slots
    monkeypatch.setattr(
        generate_mod, "decode_with_slots", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    rows = run_pinned_setup("reinforce", tmp_path, "slots", max_num_seqs=4, max_num_steps=2, val_at_end=False)
    assert len(calls) == 2 and len(rows) == 2
    for row in rows:
        assert all(row[k] is not None and abs(row[k]) < 1e6 for k in ("actor_loss", "grad_norm", "rewards"))
        assert row["grad_norm"] > 0 and row["response_len"] > 0


@pytest.mark.slow
def test_compiled_step(models):
    """``compile=True`` with slots: one compiled graph for the S rows; the tokens of the eager run, the logprobs
    to 1e-5, and a second call with another seed does not compile again (fast)."""
    import time

    model, td = models["llama"], PROMPTS
    kw = dict(num_samples=3, logits_processor=_eos_at(td["prompts"].shape[1]), max_num_seqs=3)
    eager = _run(model, td, 5, **kw)
    compiled = _run(model, td, 5, compile=True, **kw)
    assert torch.equal(eager["responses"], compiled["responses"])
    torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], atol=1e-5, rtol=0)
    start = time.perf_counter()
    _run(model, td, 6, compile=True, **kw)
    assert time.perf_counter() - start < 30


def test_a_nan_distribution_raises_once_after_decoding(models):
    def nan_late(ids, logits):  # the samples of prompt 2 (one real token) get NaN logits at their 3rd token
        logits = logits.clone()
        logits[(ids[:, 4] == PAD) & (ids.shape[1] - 6 == 2)] = float(
            "nan"
        )  # column 4: padding in prompt 2 only
        return logits

    with pytest.raises(FloatingPointError, match="non-finite probabilities"):
        _run(models["gpt2"], PROMPTS, 0, num_samples=2, logits_processor=nan_late, max_num_seqs=3)
