"""generate(continuous_batching=True): finished rows leave the decode batch, and the samples, logprobs and the
generator's state are those without it, with every generation option, both KV caches and multi-turn episodes;
the rows each decode step runs shrink as rows finish."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlbits.envs import Observation, StepResult, StopConditions
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer
from rlbits.rollout import generate as generate_mod
from rlbits.rollout.generate import generate, generate_texts
from rlbits.rollout.multiturn import generate_episodes
from rlbits.text import make_prompts

V = 64
EOS = V - 1
PAD = 0
N = 24  # max_new_tokens


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_causal_lm(arch, V, seed=3) for arch in ("gpt2", "llama", "qwen2")}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return make_prompts([torch.randint(3, EOS, (n,), generator=g).tolist() for n in lengths], PAD)


PROMPTS = _prompts([3, 7, 2, 5, 1, 6, 4, 2])  # left-padded to 7 columns


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _length(ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B] the response length a row's EOS is forced at, from its own tokens only (no row index): a hash of
    its last 4 prompt ids and its first response id (1 where the prompt's hash alone says so); about a tenth
    of the rows never (N + 1), a fifth at 8..23, the rest at 2..7."""

    def hash_(x):
        return (x.long() * torch.tensor([31, 17, 13, 11, 7])[: x.shape[1]]).sum(1) % 997

    prompt = hash_(ids[:, max(prompt_len - 4, 0) : prompt_len])
    if ids.shape[1] == prompt_len:  # no response token yet
        return torch.where(prompt % 9 == 0, 1, N + 1)
    h = hash_(ids[:, max(prompt_len - 4, 0) : prompt_len + 1])
    later = torch.where(h < 100, N + 1, torch.where(h < 300, 8 + h % 16, 2 + h % 6))
    return torch.where(prompt % 9 == 0, 1, later)


def _eos_processor(prompt_len: int):
    """A row-local logits processor: EOS is forced at step ``_length(row)`` of each row and banned before."""

    def process(ids, logits):
        t = ids.shape[1] - prompt_len + 1  # the response length once this step's token is appended
        logits = logits.clone()
        logits[:, EOS] = torch.where(_length(ids, prompt_len) == t, 1e4, float("-inf"))
        return logits

    return process


class _EosBiased(torch.nn.Module):
    """A causal LM (no static-cache support: HF's dynamic cache) whose EOS logit depends on the row's last
    input token and position only, so rows end at very different lengths without a logits processor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None
    ):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        end = (input_ids[:, -1] * 7 + position_ids[:, -1] * 3) % 9 == 0
        out.logits[:, -1, EOS] = torch.where(end, 30.0, -30.0)
        return out


def _assert_same(a: TensorDict, b: TensorDict, exact: bool = False):
    assert a.batch_size == b.batch_size and set(a.keys()) == set(b.keys())
    for key in a.keys():
        if not isinstance(a[key], torch.Tensor):
            assert list(a[key]) == list(b[key]), key
        elif key in ("logprobs", "entropy") and not exact:
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)
        else:
            assert torch.equal(a[key], b[key]), key


def _both(policy, td, seed, **kw):
    """``generate`` off then on from the same generator state; also checks both leave the generator in the
    same state (the same draws)."""
    out = []
    for on in (False, True):
        g = _gen(seed)
        out.append(generate(policy, td, generator=g, continuous_batching=on, **kw))
        out.append(torch.rand(4, generator=g))
    off, g_off, on, g_on = out
    assert torch.equal(g_off, g_on)  # the generator's state after the call
    return off, on


def _kw(**kw):
    return {"max_new_tokens": N, "temperature": 1.0, "eos_token_id": EOS, "pad_token_id": PAD, **kw}


@pytest.mark.parametrize(
    "arch,temperature,num_samples",
    [("gpt2", 1.0, 1), ("llama", 0.7, 3), ("qwen2", 0.0, 2), ("qwen2", 1.0, 2)],
)
def test_same_samples_and_logprobs(models, arch, temperature, num_samples):
    td = PROMPTS
    kw = _kw(
        num_samples=num_samples, return_entropy=True, logits_processor=_eos_processor(td["prompts"].shape[1])
    )
    kw["temperature"] = temperature
    off, on = _both(models[arch], td, 5, **kw)
    _assert_same(off, on)
    lengths = off["action_mask"].sum(1)
    assert lengths.max() - lengths.min() >= 5  # rows end at very different lengths


@pytest.mark.parametrize(
    "options",
    [
        dict(top_k=5),
        dict(top_p=0.8),
        dict(top_k=8, top_p=0.9, temperature=0.8),
        dict(repetition_penalty=1.3),
        dict(min_new_tokens=4),
        dict(stop_token_ids=[5, 6]),
    ],
    ids=lambda o: ",".join(o),
)
def test_every_generation_option(models, options):
    td = PROMPTS
    kw = _kw(num_samples=2, logits_processor=_eos_processor(td["prompts"].shape[1]))
    kw.update(options)
    off, on = _both(models["llama"], td, 7, **kw)
    _assert_same(off, on)
    assert off["action_mask"].sum(1).min() < N


def test_dynamic_cache_model_without_processor(models):
    policy = _EosBiased(models["gpt2"])
    off, on = _both(policy, PROMPTS, 2, **_kw(num_samples=2, return_entropy=True))
    _assert_same(off, on)
    lengths = off["action_mask"].sum(1)
    assert lengths.min() <= 3 and lengths.max() >= 10


def test_stop_strings_and_chunks():
    tok = tiny_tokenizer()
    policy = tiny_causal_lm("qwen2", vocab_size=len(tok), seed=0)
    prompts = ["a cat", "hello there", "x", "the dog", "b", "one two"]
    out = []
    for on in (False, True):
        out.append(
            generate_texts(
                policy,
                tok,
                prompts,
                max_new_tokens=16,
                num_samples=2,
                generator=_gen(4),
                stop_strings=["e", "o "],
                chunk_size=4,
                continuous_batching=on,
            )
        )
    _assert_same(*out)
    assert list(out[0]["response_text"]) == list(out[1]["response_text"])
    lengths = out[0]["action_mask"].sum(1)
    assert lengths.min() < 4 and lengths.max() > 8


def _rows_per_call(policy):
    """A list that records the rows of every forward of ``policy`` (through its input embedding)."""
    rows = []
    policy.get_input_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    return rows


def test_decode_work_shrinks():
    """Each eager decode step runs the rows still decoding, compacted once a sixteenth of them have finished:
    the step sizes follow from the response lengths."""
    policy = tiny_causal_lm("llama", V, seed=3)
    calls = _rows_per_call(policy)
    td = _prompts(list(range(1, 17)), seed=1)  # 16 prompts x 2 samples = 32 rows
    kw = _kw(num_samples=2, logits_processor=_eos_processor(td["prompts"].shape[1]))
    off = generate(policy, td, generator=_gen(3), **kw)
    off_calls, calls[:] = calls[1:], []  # the first call is the prefill (16 prompt rows)
    on = generate(policy, td, generator=_gen(3), continuous_batching=True, **kw)
    _assert_same(off, on)
    assert calls[0] == 16
    on_calls = calls[1:]
    steps = off["responses"].shape[1]
    assert off_calls == [32] * (steps - 1)
    # the expected decode batch of each step, from the lengths: rows unfinished after step t (0-based)
    lengths, truncated = off["action_mask"].sum(1), off["truncated"]
    expected, size = [], 32
    for t in range(steps - 1):
        alive = int(((lengths > t + 1) | truncated).sum())
        size = min(size, generate_mod._compacted_size(alive, size, 1, exact=True))
        expected.append(size)
    assert on_calls == expected
    assert sum(on_calls) < 0.6 * sum(off_calls)
    assert min(on_calls) <= 4


def test_compacted_size():
    assert [generate_mod._compacted_size(n, 32, 1) for n in (32, 17, 16, 9, 5, 2, 1)] == [
        32,
        32,
        16,
        16,
        8,
        2,
        1,
    ]
    assert [generate_mod._compacted_size(n, 48, 8) for n in (40, 30, 3)] == [48, 32, 8]
    assert generate_mod._compacted_size(3, 6, 8) == 6
    # the eager step: the rows still decoding, once a sixteenth of the rows (and at least one) have finished
    assert [generate_mod._compacted_size(n, 32, 1, exact=True) for n in (32, 31, 30, 17, 1)] == [32, 32, 30, 17, 1]
    assert [generate_mod._compacted_size(n, 8, 1, exact=True) for n in (8, 7, 3)] == [8, 7, 3]


def test_continuous_batching_must_be_a_bool(models):
    with pytest.raises(ValueError, match="continuous_batching"):
        generate(models["gpt2"], PROMPTS, continuous_batching="yes", **_kw())


# --- multi-turn episodes -------------------------------------------------------------------------------------


class _Env:
    """A few turns with per-env budgets; the observation is fixed text."""

    def __init__(self, budget: int, turns: int, obs: str):
        self.stop = StopConditions(max_new_tokens=budget, max_turns=4, stop_on_eos=True, stop_strings=("q",))
        self.turns, self.obs, self.k = turns, obs, 0

    def reset(self, prompt):
        return Observation(text=prompt)

    def step(self, action_text, action_ids=None):
        self.k += 1
        return StepResult(Observation(text=self.obs), float(len(action_ids)), self.k >= self.turns)


def test_multi_turn_episodes_are_the_same():
    tok = tiny_tokenizer()
    policy = tiny_causal_lm("gpt2", vocab_size=len(tok), seed=2, max_position_embeddings=256)
    eos = tok.eos_token_id

    def steer(ids, logits):  # EOS at a length hashed from the row's own last ids, never before
        h = (ids[:, -3:].long() * torch.tensor([3, 5, 7])).sum(1) % 10
        logits = logits.clone()
        logits[:, eos] = torch.where(h == 0, 1e4, float("-inf"))
        return logits

    batches = []
    for on in (False, True):
        envs = [_Env(budget=4 + 3 * (i % 5), turns=1 + i % 3, obs=" ok.") for i in range(10)]
        prompts = [f"p{i} " + "ab" * (i % 4) for i in range(10)]
        batches.append(
            generate_episodes(
                policy,
                tok,
                envs,
                prompts,
                temperature=0.9,
                generator=_gen(8),
                logits_processor=steer,
                group_size=2,
                continuous_batching=on,
            )
        )
    off, on = batches
    assert list(off["stop_reason"]) == list(on["stop_reason"])
    for key in off.keys():
        if isinstance(off[key], torch.Tensor):
            assert torch.equal(off[key], on[key]), key
    assert off["num_turns"].max() > 1


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_steered_policy_with_its_own_trunk_cache(shared_trunk):
    """``SteeredPolicy`` with a separate trunk keeps a second KV cache: ``select_cache_rows`` compacts it too."""
    from rlbits.models import ILQLModel
    from rlbits.models.steered import SteeredPolicy

    model = ILQLModel(tiny_causal_lm(vocab_size=V, seed=4), shared_trunk=shared_trunk, seed=2).eval()
    with torch.no_grad():  # make the heads matter
        for p in list(model.target_q1.parameters()) + list(model.target_q2.parameters()):
            p.mul_(30.0)
    kw = _kw(logits_processor=_eos_processor(PROMPTS["prompts"].shape[1]))
    off, on = _both(SteeredPolicy(model, 2.0), PROMPTS, 3, **kw)
    _assert_same(off, on)
    assert off["action_mask"].sum(1).min() < N // 2


def test_the_config_field_reaches_generate(monkeypatch):
    """``continuous_batching`` of an online loop's config goes to every ``generate`` call of a rollout."""
    import types

    from rlbits.loops import phases
    from rlbits.loops.reinforce import ReinforceConfig

    seen = []
    monkeypatch.setattr(phases, "generate_texts", lambda *a, **kw: seen.append(kw["continuous_batching"]))
    batch = TensorDict({"prompt_text": ["a", "b"]}, batch_size=[2])
    state = types.SimpleNamespace(make_env=None, tokenizer=None, sampling_generator=None)
    for flag in (False, True):
        cfg = ReinforceConfig(loop="reinforce", continuous_batching=flag)
        phases.sample(state, batch, cfg, torch.nn.Linear(1, 1))
    assert seen == [False, True]


@pytest.mark.slow
def test_compiled_step_with_compaction(models, monkeypatch):
    """``compile=True``: the compiled step runs at 16 rows, then 8 (``_COMPILED_MIN_ROWS``, never fewer), and
    samples what the eager uncompacted decode samples."""
    from rlbits.rollout import decoder as decoder_mod

    td = _prompts(list(range(1, 9)), seed=1)
    kw = _kw(num_samples=2, logits_processor=_eos_processor(td["prompts"].shape[1]), temperature=0.8)
    eager = generate(models["llama"], td, generator=_gen(3), **kw)
    rows = []
    original = decoder_mod.compiled_decode_step

    def spy(device_type="cpu"):
        step = original(device_type)
        return lambda *args: rows.append(args[2].shape[0]) or step(*args)

    monkeypatch.setattr(decoder_mod, "compiled_decode_step", spy)
    compiled = generate(models["llama"], td, generator=_gen(3), compile=True, continuous_batching=True, **kw)
    assert torch.equal(eager["responses"], compiled["responses"])
    torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], atol=1e-5, rtol=0)
    assert rows[0] == 16 and min(rows) == 8 and set(rows) == {16, 8}
    assert rows == sorted(rows, reverse=True)


@pytest.mark.slow
def test_compiled_step_keeps_its_cache_addresses(models, monkeypatch):
    """``compile=True``: every step of two calls, at 16 rows and after compaction at 8, gets the KV cache at
    the same addresses (a CUDA graph records them; a new address means recording it again), and each call
    samples what the eager decode samples."""
    from rlbits.rollout import decoder as decoder_mod

    td = _prompts(list(range(1, 9)), seed=1)
    kw = _kw(num_samples=2, logits_processor=_eos_processor(td["prompts"].shape[1]), temperature=0.8)
    seen = []  # per compiled step: (rows, keys' and write counters' addresses of every layer)
    original = decoder_mod.compiled_decode_step

    def spy(device_type="cpu"):
        step = original(device_type)

        def run(*args):
            layers = args[5].layers
            keys = tuple(layer.keys.data_ptr() for layer in layers)
            counters = tuple(layer.cumulative_length.data_ptr() for layer in layers)
            seen.append((args[2].shape[0], keys, counters))
            return step(*args)

        return run

    monkeypatch.setattr(decoder_mod, "compiled_decode_step", spy)
    for seed in (3, 4):
        compiled = generate(models["llama"], td, generator=_gen(seed), compile=True, continuous_batching=True, **kw)
        eager = generate(models["llama"], td, generator=_gen(seed), **kw)
        assert torch.equal(eager["responses"], compiled["responses"])
        torch.testing.assert_close(eager["logprobs"], compiled["logprobs"], atol=1e-5, rtol=0)
    assert {rows for rows, _, _ in seen} == {16, 8}
    assert len({(keys, counters) for _, keys, counters in seen}) == 1  # both calls, both row counts


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["ppo", "reinforce"])
def test_a_run_logs_the_same_metrics_with_the_switch_on(loop, tmp_path, monkeypatch):
    """The golden setups of tests/loops/test_golden.py (3 steps, validation) with 48 new tokens, so that rows
    end early: ``continuous_batching: true`` logs the metrics of ``false`` (the golden tolerance: 1e-4
    relative + 1e-6)."""
    import json

    from tests.loops.test_golden import GOLDEN_DIR, mismatches, run_pinned_setup

    compactions = []
    select = generate_mod.select_rows
    monkeypatch.setattr(
        generate_mod, "select_rows", lambda d, rows, *a: compactions.append(len(rows)) or select(d, rows, *a)
    )
    off = run_pinned_setup(loop, tmp_path, "off", max_new_tokens=48, continuous_batching=False)
    on = run_pinned_setup(loop, tmp_path, "on", max_new_tokens=48, continuous_batching=True)
    assert compactions  # rows did end early and leave the decode batch
    assert len(off) == len(on) == len(json.loads((GOLDEN_DIR / f"{loop}.json").read_text())["rows"])
    assert not mismatches(off, on), "\n".join(mismatches(off, on))
