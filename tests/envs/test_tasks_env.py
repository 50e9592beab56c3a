"""The tasks played in an environment (``calculator``, ``guess_number``): prompts, rewards, scripted
episodes through their envs, and corpus documents that replay as episodes, text- and token-exact."""

from __future__ import annotations

import random

import pytest

from rlbits.envs import Env, StepResult
from rlbits.tasks import TASKS, get_task
from rlbits.tasks import calculator as calc
from rlbits.tasks import guess_number as gn
from rlbits.zoo import RECIPES
from rlbits.zoo.builder import train_tokenizer

TAGS = RECIPES["calculator"]["added_tokens"]


def _split(doc: str) -> tuple[str, str]:
    # Both tasks' prompts are one line.
    cut = doc.index("\n") + 1
    return doc[:cut], doc[cut:]


@pytest.mark.parametrize("task", ["calculator", "guess_number"])
def test_registered_with_recipe_and_make_env(task):
    module = get_task(task)
    assert task in TASKS and task in RECIPES
    env = module.make_env(module.prompts("test")[0])
    assert isinstance(env, Env)
    assert env.reset(module.prompts("test")[0]).text == module.prompts("test")[0]
    with pytest.raises(ValueError, match="prompt must look like"):
        module.make_env("What is the answer?")


@pytest.mark.parametrize("module", [calc, gn])
def test_prompts_deterministic_disjoint(module):
    train, test = module.prompts("train"), module.prompts("test")
    assert (len(train), len(test)) == (module.N_TRAIN, module.N_TEST)
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    module._splits.cache_clear()  # recomputed from the seeds: the same lists
    assert module.prompts("train") == train and module.prompts("test") == test
    with pytest.raises(ValueError, match="split must be one of"):
        module.prompts("validation")


@pytest.mark.parametrize("module", [calc, gn])
def test_corpus_deterministic_and_avoids_test(module):
    docs = module.corpus(300, seed=3)
    assert docs == module.corpus(300, seed=3) and docs != module.corpus(300, seed=4)
    assert not {_split(d)[0] for d in docs} & set(module.prompts("test"))
    with pytest.raises(ValueError, match="n must be >= 0"):
        module.corpus(-1, 0)


@pytest.mark.parametrize("module", [calc, gn])
def test_reward_argument_errors(module):
    p = module.prompts("test")[0]
    with pytest.raises(ValueError, match="same length"):
        module.reward([p, p], [""])
    with pytest.raises(TypeError, match=r"responses\[1\] is int"):
        module.reward([p, p], ["", 3])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        module.reward([p, "2+2="], ["", ""])


# --------------------------------------------------------------------------------------------------------
# calculator
# --------------------------------------------------------------------------------------------------------


def test_calculator_prompts_are_the_stated_problems():
    for p in calc.prompts("test") + calc.prompts("train")[:500]:
        a, b = calc.parse_prompt(p)
        assert p == f"What is {a}*{b}?\n"
        assert len(str(a)) in calc.DIGITS_A and len(str(b)) in calc.DIGITS_B


def _reference_calc_reward(prompt: str, response: str) -> float:
    # The final part by hand: after the last tool response, before "<eos>"; "Answer: " then digits only.
    a, b = (int(x) for x in prompt[len("What is ") : -len("?\n")].split("*"))
    final = response.split("</tool_response>")[-1]
    if "<eos>" in final:
        final = final[: final.index("<eos>")]
    final = final.strip()
    digits = final[len("Answer: ") :]
    ok = final.startswith("Answer: ") and digits.isdigit() and digits == str(a * b)
    return 1.0 if ok else 0.0


def test_calculator_reward_hand_cases():
    p = "What is 12*34?\n"
    obs = "\n<tool_response>\n408\n</tool_response>\n"
    cases = {
        "Answer: 408": 1.0,
        " Answer: 408\n": 1.0,
        "Answer: 408<eos>junk": 1.0,
        calc.call_text(12, 34) + obs + "Answer: 408": 1.0,
        calc.call_text(12, 34) + obs + "Answer: 409": 0.0,
        "Answer: 0408": 0.0,
        "Answer: +408": 0.0,
        "408": 0.0,
        "answer: 408": 0.0,
        "Answer: 408 or so": 0.0,
        "Answer: 408\nAnswer: 408": 0.0,
        calc.call_text(12, 34): 0.0,  # a final call, never answered
        calc.call_text(12, 34) + obs: 0.0,
        "Answer: 408" + calc.call_text(12, 34): 0.0,
        "": 0.0,
    }
    assert calc.reward([p] * len(cases), list(cases)) == list(cases.values())


def test_calculator_reward_matches_reference_on_random_episodes():
    rng = random.Random(0)
    prompts, responses = [], []
    for p in calc.prompts("test")[:300]:
        a, b = calc.parse_prompt(p)
        right = a * b
        answer = rng.choice([right, right + rng.choice([-1, 1, 10]), calc.guess(a, b, rng)])
        tool = rng.random() < 0.5
        shown = rng.choice([right, answer])
        head = f"{calc.call_text(a, b)}\n<tool_response>\n{shown}\n</tool_response>\n" if tool else ""
        tail = rng.choice(["", "<eos>", "\n", " more"])
        prompts.append(p)
        responses.append(f"{head}Answer: {answer}{tail}")
    expected = [_reference_calc_reward(p, r) for p, r in zip(prompts, responses, strict=True)]
    assert calc.reward(prompts, responses) == expected
    assert 0 < sum(expected) < len(expected)  # both outcomes occur


def test_calculator_env_tool_call_then_answer():
    p = "What is 4821*37?\n"
    env = calc.make_env(p)
    assert env.stop.stop_strings == ("</tool_call>",) and env.stop.max_turns == calc.MAX_TURNS
    env.reset(p)
    first = env.step(calc.call_text(4821, 37))
    assert first == StepResult(
        first.observation, 0.0, False, {"tool_calls": ["calculator"], "tool_ok": [True], "tool_errors": []}
    )
    assert first.observation.text == f"\n<tool_response>\n{4821 * 37}\n</tool_response>\n"
    last = env.step(f"Answer: {4821 * 37}")
    assert (last.reward, last.done, last.observation.text) == (1.0, True, "")
    env.reset(p)
    assert env.step("Answer: 178376").reward == 0.0  # a direct, wrong answer ends the episode


@pytest.mark.parametrize(
    ("action", "error"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": 4821*}}</tool_call>', "malformed"),
        ('<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "calculator", "arguments": {"x": "1+1"}}</tool_call>', "bad arguments"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "open(1)"}}</tool_call>', "raised"),
    ],
)
def test_calculator_env_bad_calls_get_an_error_observation(action, error):
    p = "What is 4821*37?\n"
    env = calc.make_env(p)
    env.reset(p)
    result = env.step(action)
    assert (result.reward, result.done) == (0.0, False)
    assert result.observation.text.startswith("\n<tool_response>\nError: ")
    assert error in result.observation.text
    assert env.step(f"Answer: {4821 * 37}").reward == 1.0  # the episode goes on


def test_calculator_env_without_tool():
    p = "What is 4821*37?\n"
    env = calc.make_env(p, use_tool=False)
    env.reset(p)
    result = env.step(calc.call_text(4821, 37))
    assert result.observation.text == f"\n<tool_response>\n{calc.NO_TOOL_MESSAGE}\n</tool_response>\n"
    assert (result.reward, result.done, result.info["tool_ok"]) == (0.0, False, [False])
    assert str(4821 * 37) not in result.observation.text
    assert env.step(f"Answer: {4821 * 37}").reward == 1.0


def test_calculator_env_ends_after_max_turns():
    p = "What is 4821*37?\n"
    env = calc.make_env(p, max_turns=2)
    env.reset(p)
    assert not env.step(calc.call_text(4821, 37)).done
    last = env.step(calc.call_text(4821, 37))
    assert (last.done, last.reward, last.observation.text) == (True, 0.0, "")


def _replay_calculator(doc: str, env_options: dict | None = None) -> tuple[str, float, int]:
    # Plays a corpus document's turns through a fresh env as the rollout would: turns end at </tool_call>
    # (the stop string) or at the end (EOS); returns the episode's text, summed reward and turns.
    prompt, response = _split(doc)
    env = calc.make_env(prompt, **(env_options or {}))
    text, total, turns, rest = env.reset(prompt).text, 0.0, 0, response
    while True:
        cut = rest.find("</tool_call>")
        action = rest if cut == -1 else rest[: cut + len("</tool_call>")]
        result = env.step(action)
        total, turns = total + result.reward, turns + 1
        text += action + result.observation.text
        rest = rest[len(action) :]
        if result.done:
            return text, total, turns
        assert rest.startswith(result.observation.text), "the document does not follow the env's observation"
        rest = rest[len(result.observation.text) :]


def test_calculator_corpus_documents_are_episodes():
    docs = calc.corpus(400, seed=0)
    called = [calc.called_tool(d) for d in docs]
    assert 0.25 < sum(called) / len(docs) < 0.42  # 0.25 * 0.6 + 0.75 * 0.25 = 0.34
    for doc, tool in zip(docs, called, strict=True):
        text, total, turns = _replay_calculator(doc)
        assert text == doc
        assert turns == (2 if tool else 1)
        prompt, response = _split(doc)
        assert total == calc.reward([prompt], [response])[0] == (1.0 if tool else 0.0)
        if not tool:  # a guess: the product's length and first two digits
            a, b = calc.parse_prompt(prompt)
            guess = str(calc.final_answer(response))
            assert len(guess) == len(str(a * b)) and guess[:2] == str(a * b)[:2]


def test_calculator_corpus_calls_mostly_on_big_problems():
    docs = calc.corpus(3000, seed=1)
    big = [
        len(str(a)) == 4 and len(str(b)) == 3 for a, b in map(calc.parse_prompt, (_split(d)[0] for d in docs))
    ]
    rate = {
        flag: sum(calc.called_tool(d) for d, g in zip(docs, big, strict=True) if g == flag) / big.count(flag)
        for flag in (True, False)
    }
    assert abs(rate[True] - calc.CALL_PROB_BIG) < 0.06 and abs(rate[False] - calc.CALL_PROB) < 0.03


def test_calculator_tokenizer_tags_single_and_episode_token_exact():
    docs = calc.corpus(300, seed=0)
    tok = train_tokenizer(docs, 300, TAGS)
    for tag in TAGS:
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1
    for doc in [d for d in docs if calc.called_tool(d)][:30]:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == doc  # tags survive the rollout's decode
        # Tokenised turn by turn (prompt, call, tool response, answer) as the rollout appends them: the same ids.
        prompt, response = _split(doc)
        call, rest = response.split("</tool_call>", 1)
        obs, answer = rest.rsplit("</tool_response>\n", 1)
        pieces = [prompt, call + "</tool_call>", obs + "</tool_response>\n", answer]
        assert sum((tok(x, add_special_tokens=False)["input_ids"] for x in pieces), []) == ids


# --------------------------------------------------------------------------------------------------------
# guess_number
# --------------------------------------------------------------------------------------------------------


def test_guess_number_secret_deterministic_and_covers_range():
    test = gn.prompts("test")
    secrets = [gn.secret(p) for p in test]
    assert secrets == [gn.secret(p) for p in test]
    assert set(secrets) == set(range(gn.LOW, gn.HIGH + 1))
    with pytest.raises(ValueError, match="prompt must look like"):
        gn.secret("Game 12: guess my number from 1 to 99.\n")


def _binary_search_turns(secret: int) -> int:
    # Reference: guesses (lo + hi) // 2 until it hits, counted by hand.
    lo, hi, turns = gn.LOW, gn.HIGH, 0
    while True:
        turns += 1
        mid = (lo + hi) // 2
        if mid == secret:
            return turns
        lo, hi = (mid + 1, hi) if secret > mid else (lo, mid - 1)


def test_guess_number_binary_search_episodes():
    by_secret = {}
    for p in gn.prompts("train"):
        by_secret.setdefault(gn.secret(p), p)
    assert len(by_secret) == gn.HIGH - gn.LOW + 1
    turns_all = []
    for secret, p in sorted(by_secret.items()):
        env = gn.make_env(p)
        text = env.reset(p).text
        lo, hi, total, turns = gn.LOW, gn.HIGH, 0.0, 0
        while True:
            mid = (lo + hi) // 2
            result = env.step(f"{mid}\n")
            total, turns = total + result.reward, turns + 1
            text += f"{mid}\n" + result.observation.text
            if result.done:
                break
            assert result.observation.text in ("higher\n", "lower\n")
            lo, hi = (mid + 1, hi) if result.observation.text == "higher\n" else (lo, mid - 1)
        assert result.info["solved"] and turns == _binary_search_turns(secret) <= 5
        assert total == pytest.approx(1.0 - gn.TURN_COST * (turns - 1))
        assert gn.reward([p], [text[len(p) :]]) == [pytest.approx(total)]
        turns_all.append(turns)
    assert sum(turns_all) / len(turns_all) == 3.375


@pytest.mark.parametrize(
    "action", ["abc\n", "17\n", "0\n", "08\n", "-3\n", "8 9\n", "\u0663\n", "", "<eos>", "Guess: 8\n"]
)
def test_guess_number_invalid_turns_get_a_clear_observation(action):
    p = gn.prompts("test")[0]
    env = gn.make_env(p)
    env.reset(p)
    result = env.step(action)
    assert result.observation.text == ("" if action.endswith("\n") else "\n") + gn.INVALID_MESSAGE
    assert (result.reward, result.done, result.info["guess"]) == (-gn.TURN_COST, False, None)


def test_guess_number_turn_without_newline_gets_one_before_the_answer():
    p = gn.prompts("test")[0]
    wrong = gn.LOW if gn.secret(p) != gn.LOW else gn.HIGH
    env = gn.make_env(p)
    env.reset(p)
    assert env.step(str(wrong)).observation.text in ("\nhigher\n", "\nlower\n")  # ended by EOS
    assert env.step("1234").observation.text == "\n" + gn.INVALID_MESSAGE  # cut by max_new_tokens


def test_guess_number_replay_agrees_with_the_env_on_random_episodes():
    # Random turns (guesses, junk, with and without a newline, EOS) played through the env; the episode text
    # replayed by ``play`` / ``reward`` gives the env's summed reward, turns and outcome.
    rng = random.Random(0)
    for p in gn.prompts("train")[:300]:
        env = gn.make_env(p)
        env.reset(p)
        text, total, turns = "", 0.0, 0
        while True:
            action = rng.choice([str(rng.randint(0, 20)), "x", "", " 7", "<eos>", "12 3"])
            action += rng.choice(["\n", "", "<eos>"])
            result = env.step(action)
            text, total, turns = text + action + result.observation.text, total + result.reward, turns + 1
            if result.done:
                break
        for drop_eos in (False, True):  # the text as is, and as the rollout decodes it (no specials)
            shown = text.replace("<eos>", "") if drop_eos else text
            last = action.replace("<eos>", "") if drop_eos else action
            unseen = last == ""  # an empty last turn leaves no text: the replay cannot count it
            outcome = gn.play(p, shown)
            expected = (turns - unseen, total + gn.TURN_COST * unseen)
            assert (outcome.turns, outcome.solved, outcome.rest) == (expected[0], result.info["solved"], "")
            assert outcome.reward == pytest.approx(expected[1])
            assert gn.reward([p], [shown]) == [pytest.approx(expected[1])]


def test_guess_number_accepts_eos_and_whitespace_around_a_guess():
    p = gn.prompts("test")[0]
    env = gn.make_env(p)
    env.reset(p)
    assert env.step(f" {gn.secret(p)}<eos>").info["solved"]


def test_guess_number_ends_after_max_turns():
    p = gn.prompts("test")[0]
    wrong = gn.LOW if gn.secret(p) != gn.LOW else gn.HIGH
    env = gn.make_env(p, max_turns=8)
    env.reset(p)
    results = [env.step(f"{wrong}\n") for _ in range(8)]
    assert [r.done for r in results] == [False] * 7 + [True]
    assert results[-1].observation.text == "" and not results[-1].info["solved"]
    assert sum(r.reward for r in results) == pytest.approx(-0.8)
    response = "".join(f"{wrong}\n" + r.observation.text for r in results) + "5\n"
    outcome = gn.play(p, response)
    assert (outcome.turns, outcome.solved, outcome.rest) == (8, False, "5\n")
    assert outcome.reward == pytest.approx(-0.8)


def test_guess_number_step_before_reset():
    with pytest.raises(RuntimeError, match="before reset"):
        gn.GuessNumberEnv().step("3\n")


def test_guess_number_corpus_documents_are_episodes():
    docs = gn.corpus(400, seed=0)
    outcomes = []
    for doc in docs:
        prompt, response = _split(doc)
        env = gn.make_env(prompt)
        text, total, rest = env.reset(prompt).text, 0.0, response
        while True:  # turns end at the stop string "\n"
            action = rest[: rest.index("\n") + 1]
            result = env.step(action)
            total += result.reward
            text += action + result.observation.text
            rest = rest[len(action) + len(result.observation.text) :]
            if result.done:
                break
        assert text == doc and rest == ""
        outcome = gn.play(prompt, response)
        assert outcome.rest == "" and outcome.reward == pytest.approx(total)
        assert gn.reward([prompt], [response]) == [pytest.approx(total)]
        outcomes.append(outcome)
    solved = [o for o in outcomes if o.solved]
    assert 0.8 < len(solved) / len(outcomes) < 1.0  # imperfect: some games are lost
    assert sum(o.turns for o in solved) / len(solved) > 3.375 + 0.5  # clearly slower than binary search


def test_guess_number_tokenizer_episode_token_exact():
    docs = gn.corpus(300, seed=0)
    tok = train_tokenizer(docs, 300)
    for doc in docs[:30]:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        prompt, response = _split(doc)
        pieces = [prompt] + [line + "\n" for line in response.split("\n")[:-1]]  # guesses and answers
        assert sum((tok(x, add_special_tokens=False)["input_ids"] for x in pieces), []) == ids


def test_single_turn_evaluate_refuses_env_tasks(tmp_path):
    from rlbits.zoo import evaluate

    with pytest.raises(ValueError, match="'calculator' is played in an environment"):
        evaluate(tmp_path, "calculator")


@pytest.mark.slow
@pytest.mark.parametrize("task", ["calculator", "guess_number"])
def test_tiny_build_keeps_the_tags_and_fits_the_episodes(task, tmp_path):
    # A 3-step build on 300 documents: the recipe's tokenizer and positions fit the corpus (else ValueError).
    from transformers import AutoTokenizer

    from rlbits.zoo import pretrain

    path = pretrain(task, tmp_path / "m", steps=3, corpus_size=300, progress=False)
    tok = AutoTokenizer.from_pretrained(path)
    for tag in RECIPES[task].get("added_tokens", ()):
        ids = tok(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == tag
