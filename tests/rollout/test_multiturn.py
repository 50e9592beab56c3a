"""generate_episodes: token-exact multi-turn rollout (actions = sampled ids, logprobs = teacher forcing, masks,
gae over action tokens only) and its failure paths (env timeout/error, max_turns, context, bounded pool)."""

from __future__ import annotations

import dataclasses
import random
import threading
import zlib

import pytest
import torch

from rlbits.batch import check
from rlbits.envs import Observation, StepResult, StopConditions
from rlbits.functional import gae
from rlbits.models.forward import policy_logprobs, position_ids_from_mask
from rlbits.models.tiny import CHARS, tiny_causal_lm, tiny_tokenizer
from rlbits.rollout.multiturn import STOP_REASONS, generate_episodes

ARCHS = ("gpt2", "llama", "qwen2")
V = len(CHARS) + 4
TEMPLATE = (
    "{% for m in messages %}({{ m['role'] }}): {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}(assistant): {% endif %}"
)
# Markers the logits processor reacts to (in no prompt, never sampled: they come from the envs' observations).
EOS_MARK, STOP_MARK = "E", "S"


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_causal_lm(arch, V, seed=3, max_position_embeddings=256) for arch in ARCHS}


def _tokenizer(template: bool, pad_is_eos: bool):
    tok = tiny_tokenizer(V)
    if template:
        tok.chat_template = TEMPLATE
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    return tok


class RandomEnv:
    """A toy env with a random number of turns and random observations (text or token ids, chat-rendered
    with a template); records the ids and text of every action it is given."""

    def __init__(self, tok, rng: random.Random, *, as_ids: bool, stop: StopConditions, turns: int, marks=""):
        self.tok, self.rng, self.as_ids, self.stop, self.turns, self.marks = (
            tok,
            rng,
            as_ids,
            stop,
            turns,
            marks,
        )
        self.actions: list[list[int]] = []
        self.texts: list[str] = []
        self.rewards: list[float] = []

    def _obs(self, content: str) -> Observation:
        if self.tok.chat_template:
            content = self.tok.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
        if self.as_ids:
            return Observation(token_ids=tuple(self.tok(content, add_special_tokens=False)["input_ids"]))
        return Observation(text=content)

    def reset(self, prompt):
        return self._obs(prompt)

    def step(self, action_text, action_ids=None):
        self.actions.append(list(action_ids))
        self.texts.append(action_text)
        reward = round(self.rng.uniform(-1, 1), 3)
        self.rewards.append(reward)
        content = "".join(self.rng.choice("abcdefgh xyz") for _ in range(self.rng.randint(1, 6)))
        # After the first turn the marked envs put their marker in the observation (see ``_steer``).
        return StepResult(self._obs(self.marks + content), reward, len(self.actions) >= self.turns)


def _steer(tok):
    """A logits processor that makes a row whose context holds ``EOS_MARK`` sample EOS, one that holds
    ``STOP_MARK`` sample the stop string ``"!?"`` (two tokens), and no row sample EOS or a marker else. It changes
    sampling only, not logprobs."""
    eos_mark, stop_mark = tok.convert_tokens_to_ids([EOS_MARK, STOP_MARK])
    bang, question = tok.convert_tokens_to_ids(["!", "?"])

    def process(input_ids, logits):
        for r in range(input_ids.shape[0]):
            row = input_ids[r]
            force = None
            if (row == eos_mark).any():
                force = tok.eos_token_id
            elif (row == stop_mark).any():
                force = question if row[-1] == bang else bang
            if force is not None:
                logits[r] = float("-inf")
                logits[r, force] = 0.0
            else:  # EOS and the markers never sampled, so the scripted endings are the only ones
                logits[r, [tok.eos_token_id, eos_mark, stop_mark]] = float("-inf")
        return logits

    return process


def _episodes(tok, seed: int):
    """Six envs: random turns, observations as text (even rows) or ids (odd rows); row 0 ends by EOS on its
    second turn, row 1 by the stop string, row 2 cuts every turn at max_new_tokens (EOS does not stop it)."""
    rng = random.Random(seed)
    envs = []
    for i in range(6):
        stop = StopConditions(
            stop_strings=("!?",) if i == 1 else (),
            stop_on_eos=i != 2,
            max_new_tokens=rng.randint(2, 6),
            max_turns=4,
        )
        marks = {0: EOS_MARK, 1: STOP_MARK}.get(i, "")
        turns = 2 if i in (0, 1) else rng.randint(1, 3)
        envs.append(
            RandomEnv(
                tok,
                random.Random(seed * 10 + i),
                as_ids=i % 2 == 1,
                stop=stop,
                turns=turns + (i < 2),
                marks=marks,
            )
        )
    prompts = ["".join(rng.choice("abc xyz.") for _ in range(rng.randint(1, 7))) for _ in envs]
    return envs, prompts


def _teacher_forced(model, batch, temperature):
    """log softmax(logits / T) of each response token from one forward of the whole episode [B, R]."""
    with torch.no_grad():
        mask = batch["attention_mask"]
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=mask.long(),
            position_ids=position_ids_from_mask(mask),
        ).logits.double()
    P, R = batch["prompts"].shape[1], batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, P - 1 : P + R - 1] / temperature, -1)
    return logp.gather(-1, batch["responses"][..., None]).squeeze(-1)


def _gae_reference(rewards, values, mask, gamma, lam):
    """Walk only the action tokens of each row, back to front (V = 0 after the last)."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[b, t]]
        nxt_v, nxt_a = 0.0, 0.0
        for t in reversed(pos):
            delta = float(rewards[b, t]) + gamma * nxt_v - float(values[b, t])
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(values[b, t])
            adv[b, t] = nxt_a
    return adv


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("template,pad_is_eos", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("arch", ARCHS)
def test_episodes_are_token_exact(models, arch, template, pad_is_eos, temperature):
    tok = _tokenizer(template, pad_is_eos)
    model = models[arch]
    seed = zlib.crc32(repr((arch, template, pad_is_eos, temperature)).encode()) % 1000  # fixed per case
    envs, prompts = _episodes(tok, seed)
    batch = generate_episodes(
        model, tok, envs, prompts, temperature=temperature, generator=torch.Generator().manual_seed(seed),
        logits_processor=_steer(tok),
    )
    check(batch)
    B = len(envs)
    act, resp = batch["action_mask"], batch["response_mask"]
    reasons = list(batch["stop_reason"])
    assert set(reasons) <= set(STOP_REASONS)
    for i, env in enumerate(envs):
        ids = batch["responses"][i][act[i]].tolist()
        # (a) the action tokens are the ids the env was given, turn by turn, in order
        assert ids == [t for turn in env.actions for t in turn]
        assert int(batch["num_turns"][i]) == len(env.actions)
        turn_idx = batch["turn_index"][i]
        for k, turn in enumerate(env.actions):
            assert batch["responses"][i][act[i] & (turn_idx == k)].tolist() == turn
            assert env.texts[k] == tok.decode(turn, skip_special_tokens=False)
        # (c) observation tokens: response_mask True, action_mask False; padding: both False, turn index -1
        n = int(resp[i].sum())
        assert resp[i, :n].all() and not resp[i, n:].any() and not act[i, n:].any()
        assert (turn_idx[:n] >= 0).all() and (turn_idx[n:] == -1).all()
        # turn rewards on the last action token of each turn, summed into ``rewards``
        tr = batch["turn_rewards"][i]
        for k, r in enumerate(env.rewards):
            last = int(torch.nonzero(act[i] & (turn_idx == k)).max())
            assert tr[last].item() == pytest.approx(r)
        assert int((tr != 0).sum()) <= len(env.rewards)
        assert batch["rewards"][i].item() == pytest.approx(sum(env.rewards), abs=1e-5)
    # (e) the forced endings: EOS and the two-token stop string are the turn's last actions
    eos = tok.eos_token_id
    assert reasons[0] == "eos" and envs[0].actions[-1][-1] == eos and len(envs[0].actions) == 2
    assert envs[1].texts[1].endswith("!?") and envs[1].actions[1][-2:] == tok.convert_tokens_to_ids(
        ["!", "?"]
    )
    assert all(len(a) == envs[2].stop.max_new_tokens for a in envs[2].actions)
    assert reasons[2] == "done" and reasons[1] == "done"
    # the observation after each turn is exactly what the env returned
    for i in (3, 4, 5):
        if len(envs[i].actions) > 1:
            obs = batch["responses"][i][~act[i] & resp[i] & (batch["turn_index"][i] == 0)].tolist()
            assert len(obs) > 0
    # (b) behaviour logprobs = teacher-forced forward of the whole episode at T
    tf = _teacher_forced(model, batch, temperature)
    assert (tf - batch["logprobs"].double())[act].abs().max().item() < 1e-4
    assert (batch["logprobs"][~act] == 0).all()
    # ... and the trainer's forward (``policy_logprobs``, as the loops compute the ratio's numerator)
    trainer = policy_logprobs(model, batch, temperature=temperature)
    assert (trainer - batch["logprobs"])[act].abs().max().item() < 1e-4
    # (d) gae over the episode = the reference that walks only the action tokens
    values = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(seed))
    adv, ret = gae(batch["turn_rewards"], values, act, gamma=0.9, lam=0.8)
    ref = _gae_reference(batch["turn_rewards"], values, act, 0.9, 0.8)
    torch.testing.assert_close(adv.double(), ref, atol=1e-5, rtol=1e-5)
    assert B == batch.batch_size[0]


# --- failure paths ----------------------------------------------------------------------------------------


class ScriptedEnv:
    """A fixed number of turns; ``step`` may block on an event, wait at a barrier, raise, or return a fixed
    observation; ``log`` counts the steps running at once."""

    def __init__(
        self,
        *,
        turns=2,
        block=None,
        barrier=None,
        fail=False,
        obs="ok ",
        max_turns=4,
        max_new_tokens=3,
        log=None,
    ):
        self.stop = StopConditions(max_new_tokens=max_new_tokens, max_turns=max_turns, stop_on_eos=False)
        self.turns, self.block, self.barrier, self.fail, self.obs, self.log = (
            turns,
            block,
            barrier,
            fail,
            obs,
            log,
        )
        self.k, self.finished = 0, False

    def reset(self, prompt):
        return Observation(text=prompt)

    def step(self, action_text, action_ids=None):
        if self.log is not None:
            with self.log["lock"]:
                self.log["now"] += 1
                self.log["max"] = max(self.log["max"], self.log["now"])
        try:
            if self.block is not None:
                self.block.wait(timeout=60)
                self.finished = True
            if self.barrier is not None:
                self.barrier.wait(
                    timeout=30
                )  # BrokenBarrierError (env_error) unless enough steps run at once
            if self.fail:
                raise RuntimeError("tool crashed")
            self.k += 1
            return StepResult(Observation(text=self.obs), 1.0, self.k >= self.turns)
        finally:
            if self.log is not None:
                with self.log["lock"]:
                    self.log["now"] -= 1


@pytest.fixture(scope="module")
def gpt2():
    tok = tiny_tokenizer(V)
    return tiny_causal_lm("gpt2", V, seed=1), tok


def _run(gpt2, envs, **kw):
    model, tok = gpt2
    kw.setdefault("temperature", 1.0)
    return generate_episodes(
        model, tok, envs, ["hello"] * len(envs), generator=torch.Generator().manual_seed(0), **kw
    )


def test_timeout_and_error_end_only_their_episode(gpt2):
    release = threading.Event()
    envs = [ScriptedEnv(block=release), ScriptedEnv(fail=True), ScriptedEnv(turns=2)]
    try:
        batch = _run(gpt2, envs, env_timeout_s=0.3)
        assert not envs[0].finished  # the blocked step was abandoned, not waited for
    finally:
        release.set()
    assert list(batch["stop_reason"]) == ["env_timeout", "env_error", "done"]
    assert batch["num_turns"].tolist() == [1, 1, 2]
    # no reward for a failed step; the healthy row got both turns' rewards
    assert batch["rewards"].tolist() == [0.0, 0.0, 2.0]


class BadResultEnv(ScriptedEnv):
    """``step`` returns a reward that is not a number, or a bare string instead of a StepResult."""

    def __init__(self, what):
        super().__init__()
        self.what = what

    def step(self, action_text, action_ids=None):
        return StepResult(Observation(text="x"), "high") if self.what == "reward" else "ok"


def test_malformed_step_results_are_env_errors(gpt2):
    batch = _run(gpt2, [BadResultEnv("reward"), BadResultEnv("type"), ScriptedEnv(turns=1)])
    assert list(batch["stop_reason"]) == ["env_error", "env_error", "done"]


def test_never_done_ends_at_max_turns(gpt2):
    batch = _run(gpt2, [ScriptedEnv(turns=10, max_turns=3), ScriptedEnv(turns=1)])
    assert list(batch["stop_reason"]) == ["max_turns", "done"]
    assert batch["num_turns"].tolist() == [3, 1]
    assert batch["turn_index"][0].max().item() == 2


def test_max_turns_caps_every_env_below_its_own_limit(gpt2):
    """NeMo-RL's max_rollout_turns: the global cap wins where it is smaller, the env's own limit elsewhere."""
    envs = [ScriptedEnv(turns=10, max_turns=5), ScriptedEnv(turns=10, max_turns=1), ScriptedEnv(turns=1)]
    batch = _run(gpt2, envs, max_turns=2)
    assert list(batch["stop_reason"]) == ["max_turns", "max_turns", "done"]
    assert batch["num_turns"].tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="max_turns"):
        _run(gpt2, [ScriptedEnv()], max_turns=0)


@pytest.mark.parametrize("max_episode_tokens", [12, 20, 31])
def test_long_observation_ends_by_context_within_the_limit(gpt2, max_episode_tokens):
    envs = [ScriptedEnv(turns=10, max_turns=10, obs="a long observation " * 3), ScriptedEnv(turns=1)]
    batch = _run(gpt2, envs, max_episode_tokens=max_episode_tokens)
    assert list(batch["stop_reason"]) == ["context", "done"]
    lengths = batch["attention_mask"].sum(-1)
    assert (lengths <= max_episode_tokens).all()
    assert batch["truncated"].tolist() == [True, False]


def test_model_context_is_never_exceeded():
    tok = tiny_tokenizer(V)
    model = tiny_causal_lm("llama", V, seed=1, max_position_embeddings=24)
    envs = [ScriptedEnv(turns=50, max_turns=50, obs="ab"), ScriptedEnv(turns=50, max_turns=50, obs="abcdefg")]
    batch = generate_episodes(
        model, tok, envs, ["hi", "hello there"], temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert list(batch["stop_reason"]) == ["context", "context"]
    assert (batch["attention_mask"].sum(-1) <= 24).all()


def test_a_long_episode_does_not_shorten_another_episodes_turn():
    """The model's positions cap each episode by its own context, not by the longest one of the batch: next
    to a prompt that leaves 4 positions, a short prompt still gets its whole 8-token turn (stop_on_eos is
    off, so a turn ends only at its budget)."""
    tok = tiny_tokenizer(V)
    model = tiny_causal_lm("llama", V, seed=1, max_position_embeddings=32)
    long_prompt = "hello there, " * 3
    while len(tok(long_prompt, add_special_tokens=False)["input_ids"]) > 28:
        long_prompt = long_prompt[:-1]
    n_long = len(tok(long_prompt, add_special_tokens=False)["input_ids"])
    assert 24 < n_long <= 28, n_long  # leaves fewer than 8 positions
    envs = [ScriptedEnv(turns=1, max_new_tokens=8), ScriptedEnv(turns=1, max_new_tokens=8)]
    batch = generate_episodes(
        model, tok, envs, [long_prompt, "hi"], temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert batch["action_mask"].sum(-1).tolist() == [32 - n_long, 8]


@pytest.mark.parametrize("seed", range(20))
def test_chunks_cover_every_row_once_and_each_fits(seed):
    from rlbits.rollout.multiturn import _chunks

    rng = random.Random(seed)
    limit = rng.randint(8, 64)
    lengths = [rng.randint(1, limit - 1) for _ in range(rng.randint(1, 12))]
    budgets = [rng.randint(1, limit - n) for n in lengths]
    chunks = _chunks(lengths, budgets, limit)
    assert sorted(j for c in chunks for j in c) == list(range(len(lengths)))
    for c in chunks:
        assert max(lengths[j] for j in c) + max(budgets[j] for j in c) <= limit
    if max(lengths) + max(budgets) <= limit:
        assert len(chunks) == 1
    assert _chunks(lengths, budgets, None) == [list(range(len(lengths)))]


def test_env_steps_run_concurrently_within_the_bound(gpt2):
    log = {"lock": threading.Lock(), "now": 0, "max": 0}
    barrier = threading.Barrier(3)  # passes only when 3 steps run at once
    envs = [ScriptedEnv(barrier=barrier, turns=2, log=log) for _ in range(6)]
    batch = _run(gpt2, envs, max_env_workers=3)
    assert list(batch["stop_reason"]) == ["done"] * 6  # every step met two others at the barrier
    assert log["max"] == 3  # and never more than the bound ran at once


def test_bad_arguments_are_named(gpt2):
    with pytest.raises(ValueError, match="reward_placement"):
        _run(gpt2, [ScriptedEnv()], reward_placement="turn")
    with pytest.raises(ValueError, match="one prompt per env"):
        generate_episodes(gpt2[0], gpt2[1], [ScriptedEnv()], ["a", "b"], temperature=1.0)
    with pytest.raises(ValueError, match="env_timeout_s"):
        _run(gpt2, [ScriptedEnv()], env_timeout_s=0)
    with pytest.raises(ValueError, match="group_size"):
        _run(gpt2, [ScriptedEnv()] * 3, group_size=2)


def test_stopping_rule_leaves_generate_exact():
    """``generate(stopping=...)``: a row the rule stops samples nothing more; every row's tokens and logprobs
    equal the run without the rule up to its stop (the same noise is drawn for every row each step)."""
    from rlbits.rollout.generate import generate
    from rlbits.text import make_prompts

    model = tiny_causal_lm("qwen2", V, seed=2)
    td = make_prompts([[5, 6, 7], [8], [9, 10]], 0)
    stops = [2, 4, 6]
    free = generate(
        model,
        td,
        max_new_tokens=6,
        temperature=0.7,
        eos_token_id=None,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(1),
    )
    ruled = generate(
        model, td, max_new_tokens=6, temperature=0.7, eos_token_id=None, pad_token_id=0,
        generator=torch.Generator().manual_seed(1),
        stopping=lambda r: torch.tensor([r.shape[1] >= s for s in stops]),
    )
    assert ruled["action_mask"].sum(-1).tolist() == stops
    for i, s in enumerate(stops):
        assert torch.equal(ruled["responses"][i, :s], free["responses"][i, :s])
        assert torch.equal(ruled["logprobs"][i, :s], free["logprobs"][i, :s])
        assert (ruled["responses"][i, s:] == 0).all()


# --- loops: token rewards of turns, PPO and GRPO on a toy multi-turn task ----------------------------------


def test_token_rewards_with_turn_rewards_equals_a_reference_loop():
    """``token_rewards(..., turn_rewards=...)``: each placed reward kept on action tokens, the score on the last
    action token, minus ``kl_coef * kl`` on action tokens; 0 off actions (random masks with holes)."""
    from rlbits.functional import token_rewards

    g = torch.Generator().manual_seed(0)
    B, R = 5, 9
    mask = torch.rand(B, R, generator=g) < 0.6
    mask[0] = False  # a row without actions
    scores, kl, placed = (
        torch.randn(B, generator=g),
        torch.randn(B, R, generator=g),
        torch.randn(B, R, generator=g),
    )
    out = token_rewards(scores, mask, kl, 0.3, turn_rewards=placed)
    ref = torch.zeros(B, R)
    for b in range(B):
        actions = [t for t in range(R) if mask[b, t]]
        for t in actions:
            ref[b, t] = placed[b, t] - 0.3 * kl[b, t] + (scores[b] if t == actions[-1] else 0.0)
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="turn_rewards"):
        token_rewards(scores, mask, turn_rewards=placed[:, :3])


class CountEnv:
    """The toy multi-turn task: ``turns`` turns; each turn scores 1 if the action holds a digit."""

    def __init__(self, prompt, turns=2):
        self.stop = StopConditions(max_new_tokens=4, max_turns=3, stop_on_eos=False)
        self.turns, self.k = turns, 0

    def reset(self, prompt):
        return Observation(text=prompt)

    def step(self, action_text, action_ids=None):
        self.k += 1
        reward = float(any(c.isdigit() for c in action_text))
        return StepResult(Observation(text=f" {self.k}:"), reward, self.k >= self.turns)


class SpreadEnv(CountEnv):
    """A toy env whose groups differ: after a prompt starting with "a" (one turn) or "e" (three turns) each
    turn scores the parity of its first action id, so the K episodes of a prompt disagree; any other prompt
    scores 0 in one turn (an uninformative group for dynamic sampling)."""

    def __init__(self, prompt, **options):
        super().__init__(prompt, turns=3 if prompt[:1] == "e" else 1)
        self.informative = prompt[:1] in ("a", "e")

    def step(self, action_text, action_ids=None):
        self.k += 1
        reward = float(action_ids[0] % 2) if self.informative and len(action_ids) else 0.0
        return StepResult(Observation(text=f" {self.k}:"), reward, self.k >= self.turns)


def make_env(prompt, env="count", **options):
    """This module as a task (registered in ``rlbits.tasks.TASKS`` by the tests below); ``env_options``
    ``{"env": "spread"}`` plays ``SpreadEnv``."""
    return (SpreadEnv if env == "spread" else CountEnv)(prompt, **options)


def reward(prompts, responses):  # a task module's reward; multi-turn loops must not call it
    raise AssertionError("the reward function of a multi-turn task is not called")


def prompts(split):  # the task's test split, which ``rlbits eval`` (evaluate_run) validates on
    return ["gh", "ij"]


@pytest.fixture
def toy_task(monkeypatch, tmp_path):
    from rlbits import tasks

    monkeypatch.setitem(tasks.TASKS, "toy_count", __name__)
    path = tmp_path / "policy"
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def _loop_cfg(cls, policy, run_dir, **kw):
    from rlbits.loops.config import config_from_dict

    values = dict(
        task="toy_count", policy=policy, run_dir=str(run_dir), max_num_steps=1, num_prompts_per_step=2,
        num_generations_per_prompt=2, microbatch_size=4, learning_rate=1e-3, max_val_samples=2,
        val_at_start=True, val_at_end=False, save_period=1, progress=False, tensorboard=False, log_samples=1,
        env_options={"turns": 2}, max_episode_tokens=40,
    )
    values.update(kw)
    return config_from_dict(cls, values)


def test_ppo_advantages_put_each_turn_reward_on_its_turn(toy_task, tmp_path):
    """PPO's advantages phase on an episode batch: ``turn_reward: token`` gives token rewards = turn rewards -
    kl_coef * KL (a reference loop over tokens); ``sequence`` gives the summed reward on the last action."""
    from types import SimpleNamespace

    from rlbits.distributed.env import DistEnv
    from rlbits.loops import ppo
    from rlbits.loops.metrics import StepMetrics

    tok = tiny_tokenizer(V)
    model = tiny_causal_lm("gpt2", V, seed=0)
    envs = [CountEnv("a", turns=2) for _ in range(4)]
    batch = generate_episodes(
        model, tok, envs, ["ab", "c", "ab", "c"], temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    g = torch.Generator().manual_seed(1)
    batch["ref_logprobs"] = torch.where(
        batch["action_mask"], batch["logprobs"] + 0.1 * torch.randn(batch["logprobs"].shape, generator=g), 0.0
    )
    batch["values"] = torch.randn(batch["logprobs"].shape, generator=g)
    for placement in ("token", "sequence"):
        cfg = _loop_cfg(ppo.PPOConfig, toy_task, tmp_path, turn_reward=placement, kl_coef=0.2)
        state = SimpleNamespace(env=DistEnv(), metrics=StepMetrics(), kl_coef=0.2)
        out = ppo.advantages(state, batch.clone(), cfg)
        act = batch["action_mask"]
        ref = torch.zeros(act.shape)
        for b in range(act.shape[0]):
            actions = [t for t in range(act.shape[1]) if act[b, t]]
            for t in actions:
                kl = float(batch["logprobs"][b, t] - batch["ref_logprobs"][b, t])
                placed = float(batch["turn_rewards"][b, t]) if placement == "token" else 0.0
                last = float(batch["rewards"][b]) if placement == "sequence" and t == actions[-1] else 0.0
                ref[b, t] = placed + last - 0.2 * kl
        torch.testing.assert_close(out["token_rewards"], ref, atol=1e-6, rtol=1e-5)
    assert (batch["turn_rewards"] != 0).any()  # the check above saw turn rewards


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["ppo", "grpo"])
def test_one_step_on_a_multi_turn_task(toy_task, tmp_path, loop):
    import json

    from rlbits.loops import ppo, reinforce
    from rlbits.loops.run import read_metrics

    if loop == "ppo":
        cfg = _loop_cfg(ppo.PPOConfig, toy_task, tmp_path / "run", ppo_epochs=1, num_minibatches=1)
        run_dir = ppo.train(cfg, prompts=["ab", "cd", "ef"], val_prompts=["gh", "ij"])
    else:
        cfg = _loop_cfg(
            reinforce.ReinforceConfig, toy_task, tmp_path / "run", loop="reinforce", adv_estimator="grpo"
        )
        run_dir = reinforce.train(cfg, prompts=["ab", "cd", "ef"], val_prompts=["gh", "ij"])
    rows = read_metrics(run_dir)
    assert rows[0]["val_num_turns"] == pytest.approx(2.0)  # every toy episode takes its 2 turns
    step = rows[-1]
    assert step["num_turns"] == pytest.approx(2.0) and step["stop/done"] == pytest.approx(1.0)
    assert 0.0 <= step["rewards"] <= 2.0
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any(" 1:" in s["response"] for s in samples)  # the observation is part of the logged response
    # each logged episode holds its turns (what the rollout browser draws; special tokens kept in their texts)
    for s in samples:
        assert s["num_turns"] == len(s["turns"]) == 2 and s["stop_reason"] == "done"
        assert " 1:" in s["turns"][0]["observation"] and s["turns"][0]["observation"] in s["response"]
        assert sum(t["reward"] for t in s["turns"]) == pytest.approx(s["reward"])
    assert (run_dir / "checkpoints" / "step_1").exists()
    # ``rlbits eval`` plays episodes too (the task's reward function, which raises, is never called)
    from rlbits.loops.evaluate import evaluate_run

    scores = evaluate_run(run_dir)
    assert scores["base"]["val_num_turns"] == scores["final"]["val_num_turns"] == pytest.approx(2.0)


@pytest.mark.slow
def test_resume_on_a_multi_turn_task_reproduces_the_run(toy_task, tmp_path):
    """A GRPO run on the toy env task stopped after step 1 and resumed logs the same step 2 as the run that
    went straight through (episodes sampled from the restored generator, rewards from the envs)."""
    import dataclasses

    from metrics_compare import untimed_by_step

    from rlbits.loops import reinforce
    from rlbits.loops.run import read_metrics

    def cfg(run_dir, steps):
        return _loop_cfg(
            reinforce.ReinforceConfig, toy_task, run_dir, loop="reinforce", adv_estimator="grpo", max_num_steps=steps,
            val_at_start=False,
        )

    prompts = ["ab", "cd", "ef", "gh"]
    full = reinforce.train(cfg(tmp_path / "a", 2), prompts=prompts, val_prompts=["ij"])
    part = cfg(tmp_path / "b", 1)
    reinforce.train(part, prompts=prompts, val_prompts=["ij"])
    resumed = reinforce.train(
        dataclasses.replace(part, max_num_steps=2), prompts=prompts, val_prompts=["ij"], resume=True
    )
    a, b = untimed_by_step(read_metrics(full), 2), untimed_by_step(read_metrics(resumed), 2)
    assert sorted(a) == [2] and a == b and "num_turns" in a[2]


@pytest.mark.slow
def test_dynamic_sampling_on_a_multi_turn_task(toy_task, tmp_path, monkeypatch):
    """REINFORCE's dynamic sampling on episode batches: the informative groups of several rounds, whose
    response lengths differ, are joined by ``collate`` (turn_index padded with -1, the other episode keys
    with 0/False); a one-step run trains on them."""
    from rlbits import batch as rb
    from rlbits.distributed.env import DistEnv
    from rlbits.loops import phases, reinforce
    from rlbits.loops.metrics import StepMetrics
    from rlbits.loops.run import read_metrics

    joined = []
    monkeypatch.setattr(reinforce, "collate", lambda bs, **kw: joined.append(bs) or rb.collate(bs, **kw))
    prompts = ["ab", "cd", "gh", "ef"]  # the seeded stream draws "cd", "ef", then "ab", "gh"
    cfg = _loop_cfg(
        reinforce.ReinforceConfig, toy_task, tmp_path / "run", loop="reinforce", adv_estimator="grpo",
        dynamic_sampling=True, dynamic_sampling_max_gen_batches=6, env_options={"env": "spread"},
        num_prompts_per_step=2, num_generations_per_prompt=4, max_episode_tokens=48,
    )
    state = reinforce.init_state(cfg, DistEnv(), prompts=prompts, val_prompts=["ij"])
    state.metrics = StepMetrics()
    batch = reinforce.rollout(state, state.stream.next_batch(cfg.num_prompts_per_step), cfg)
    batch = reinforce.dynamic_sampling(state, reinforce.score(state, batch, cfg), cfg)
    stats = state.metrics.reduce(DistEnv())
    assert stats["gen_batches"] >= 2 and stats["kept_groups"] == 2
    assert len(joined) == 1 and len({b["responses"].shape[1] for b in joined[0]}) == 2  # R differs: re-padded
    rb.check(batch, required=("turn_index", "turn_rewards", "num_turns", "stop_reason"), check_values=True)
    assert phases.informative_groups(batch["rewards"], 4).all()
    assert {t[0] for t in batch.get("prompt_text").tolist()} == {"a", "e"}
    assert batch["group"].tolist() == [0] * 4 + [1] * 4
    for part, rows in zip(joined[0], batch.split([len(b) for b in joined[0]]), strict=True):
        for key in ("turn_index", "turn_rewards", "action_mask", "responses", "logprobs"):
            r = part[key].shape[1]
            assert torch.equal(rows[key][:, :r], part[key]), key
            pad = rb.SCHEMA[key].pad
            assert (
                rows[key][:, r:] == (state.tokenizer.pad_token_id if pad == rb.PAD_TOKEN else pad)
            ).all(), key
        torch.testing.assert_close(rows["turn_rewards"].sum(-1), rows["rewards"])

    run_dir = reinforce.train(
        dataclasses.replace(cfg, run_dir=str(tmp_path / "train")), prompts=prompts, val_prompts=["ij"]
    )
    step = read_metrics(run_dir)[-1]
    assert step["kept_groups"] >= 1 and step["gen_batches"] >= 1 and "num_turns" in step


@pytest.mark.slow
def test_reward_subtract_reference_on_a_multi_turn_task(toy_task, tmp_path):
    """PPO's reward_subtract_reference on an env task: the reference plays its own episodes of the same
    prompts, their env rewards are ``reference_rewards``, and the scaled reward subtracts them."""
    from rlbits.distributed.env import DistEnv
    from rlbits.loops import ppo
    from rlbits.loops.metrics import StepMetrics
    from rlbits.loops.run import read_metrics

    prompts = ["ab", "cd", "ef", "gh"]
    cfg = _loop_cfg(
        ppo.PPOConfig, toy_task, tmp_path / "run", reward_subtract_reference=True, env_options={"env": "spread"},
        ppo_epochs=1, num_minibatches=1,
    )
    state = ppo.init_state(cfg, DistEnv(), prompts=prompts, val_prompts=["ij"])
    assert state.reference is not None
    state.metrics = StepMetrics()
    batch = ppo.score(state, ppo.rollout(state, state.stream.next_batch(2), cfg), cfg)
    ref = batch["reference_rewards"]
    assert ref.shape == batch["rewards"].shape == (4,) and ref.dtype == torch.float32
    first = [t[0] for t in batch.get("prompt_text").tolist()]
    for r, f in zip(ref.tolist(), first, strict=True):  # the reference's episodes, scored by SpreadEnv
        assert r in ((0.0,) if f not in "ae" else (0.0, 1.0, 2.0, 3.0))
    torch.testing.assert_close(ppo.scale_rewards(batch, cfg, DistEnv()), batch["rewards"] - ref)

    run_dir = ppo.train(
        dataclasses.replace(cfg, run_dir=str(tmp_path / "train")), prompts=prompts, val_prompts=["ij"]
    )
    assert {"reference_rewards", "rewards_scaled"} <= set(read_metrics(run_dir)[-1])


def test_the_loops_pass_max_rollout_turns(gpt2):
    from rlbits.loops import phases
    from rlbits.loops.reinforce import ReinforceConfig

    model, tok = gpt2
    cfg = ReinforceConfig(max_rollout_turns=2)
    batch = phases.run_episodes(
        model, tok, ["hello"], lambda p: ScriptedEnv(turns=10, max_turns=5), cfg, temperature=1.0, num_samples=2,
        generator=torch.Generator().manual_seed(0),
    )
    assert batch["num_turns"].tolist() == [2, 2] and list(batch["stop_reason"]) == ["max_turns"] * 2
