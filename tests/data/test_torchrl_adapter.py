"""The torchrl adapter (rlbits.data.torchrl_adapter): what round-trips exactly and what does not.

A tiny byte-level BPE tokenizer is trained here from a few sentences (nothing downloaded). The reference for
the masks is character-level: a token is an action when its characters lie inside an assistant message's
content or its ``<|im_end|>`` (found in the rendered text), computed with the tokenizer's offsets.
"""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import rlbits.batch as rb
from rlbits.data.torchrl_adapter import episode_buffer, episode_to_batch, history_to_batch

pytest.importorskip("torchrl")

from torchrl.data import LazyTensorStorage, ReplayBuffer  # noqa: E402
from torchrl.data.llm import History  # noqa: E402

END = "<|im_end|>"
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
WORDS = [
    "we",
    "have",
    "leisure",
    "time",
    "for",
    "pleasure",
    "the",
    "answer",
    "is",
    "5",
    "tool",
    "says",
    "2+3?",
]


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", END, "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(
        ["we have leisure time for leisure and pleasure", "the answer is 5 says the tool"] * 20, trainer
    )
    t = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        eos_token=END,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    t.chat_template = CHATML_GENERATION
    return t


def random_episode(rng: random.Random) -> list[dict]:
    """system?, user, then 1-3 rounds of assistant [+ tool]; the last assistant message may be cut."""

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))

    messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": text()})
    for turn in range(rng.randint(1, 3)):
        if turn:
            messages.append({"role": rng.choice(["tool", "user"]), "content": text()})
        messages.append({"role": "assistant", "content": text(), "is_complete": True})
    if rng.random() < 0.3:
        messages[-1]["is_complete"] = False
    return messages


def reference_action_chars(tok, messages: list[dict], template: str) -> tuple[str, list[bool]]:
    """The rendered text and, per character, whether the policy produced it: an assistant message's content
    and, for a complete message, the <|im_end|> right after it. Found by searching the rendered text."""
    rendered = tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        chat_template=template,
        tokenize=False,
    )
    chars = [False] * len(rendered)
    cursor = 0
    for m in messages:
        header = f"<|im_start|>{m['role']}\n"
        start = rendered.index(header, cursor) + len(header)
        end = start + len(m["content"])
        assert rendered[start:end] == m["content"] and rendered[end:].startswith(END)
        if m["role"] == "assistant":
            stop = end + len(END) if m.get("is_complete", True) else end
            for c in range(start, stop):
                chars[c] = True
        cursor = end + len(END)
    return rendered, chars


def reference_row(tok, messages: list[dict], template: str):
    """Token ids, the prompt length and the per-token action flags, token by token from the offsets."""
    rendered, chars = reference_action_chars(tok, messages, template)
    enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages[:first]],
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    flags = []
    for s, e in enc["offset_mapping"]:
        inside = [chars[c] for c in range(s, e)]
        assert all(inside) or not any(inside), "a token straddles an action boundary"
        flags.append(bool(inside) and all(inside))
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    return enc["input_ids"], prompt_len, flags


def real_rows(batch: TensorDict, row: int):
    """Row ``row``'s real prompt ids, real response ids and the action flags of its response."""
    real = batch["response_mask"][row]
    return (
        batch["prompts"][row][batch["prompt_mask"][row]].tolist(),
        batch["responses"][row][real].tolist(),
        batch["action_mask"][row][real].tolist(),
    )


# --------------------------------------------------------------------------------------------------------
# (a) text-level History: the tokens are the chat template's, the masks are right
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "method"),
    [(CHATML_GENERATION, "generation"), (CHATML_GENERATION, "prefix"), (CHATML, "auto")],
)
def test_text_history_matches_the_template_tokens_and_the_reference_masks(tok, template, method):
    rng = random.Random(0)
    episodes = [random_episode(rng) for _ in range(12)]
    batch = history_to_batch(episodes, tok, chat_template=template, method=method)
    rb.check(batch, required=("prompts", "responses", "action_mask", "response_mask"), check_values=True)
    assert "logprobs" not in batch.keys()  # none given: absent, not zeros pretending to be logprobs
    for row, messages in enumerate(episodes):
        ids, prompt_len, flags = reference_row(tok, messages, template)
        prompt, response, action = real_rows(batch, row)
        assert prompt + response == ids
        assert len(prompt) == prompt_len
        assert action == flags[prompt_len:]
        assert not any(flags[:prompt_len])
        assert int(batch["num_turns"][row]) == sum(m["role"] == "assistant" for m in messages)
    assert batch["retokenized"].all()


def test_torchrl_history_objects_give_the_same_batch_as_message_lists(tok):
    rng = random.Random(1)
    episodes = [random_episode(rng) for _ in range(4)]
    from_dicts = history_to_batch(episodes, tok)
    stacked = History.from_chats(episodes)  # [B, T], ragged
    assert stacked.batch_dims == 2
    for histories in (stacked, [History.from_chats(e) for e in episodes]):
        batch = history_to_batch(histories, tok)
        for key in ("input_ids", "attention_mask", "action_mask", "turn_index"):
            assert torch.equal(batch[key], from_dicts[key]), key
    one = history_to_batch(History.from_chats(episodes[0]), tok)  # a 1-D History is one episode
    assert torch.equal(
        one["responses"][0][one["response_mask"][0]],
        from_dicts["responses"][0][from_dicts["response_mask"][0]],
    )


def test_cut_turn_is_not_an_end_of_turn_action(tok):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "we have leisure", "is_complete": False},
    ]
    for method in ("generation", "prefix"):
        batch = history_to_batch([messages], tok, method=method)
        _, response, action = real_rows(batch, 0)
        assert (
            response[-1] == tok.eos_token_id and action[-1] is False
        )  # rendered by the template, not sampled
        assert all(action[:-1])
    empty = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "is_complete": False}]
    for method in ("generation", "prefix"):
        batch = history_to_batch([empty], tok, method=method)
        assert not batch["action_mask"].any() and batch["response_mask"].any()


def test_pad_equal_to_eos_keeps_every_end_of_turn(tok):
    # SmolLM2's tokenizer pads with its EOS, <|im_end|>: the masks, not the ids, say which tokens are real.
    import copy

    same = copy.deepcopy(tok)
    same.pad_token = END
    assert same.pad_token_id == same.eos_token_id
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "the tool"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "the answer is 5"},
    ]
    batch = history_to_batch([messages, messages[:2]], same)
    ends = (batch["responses"] == same.eos_token_id) & batch["action_mask"]
    assert ends.sum(dim=1).tolist() == [2, 1]  # each assistant turn's sampled <|im_end|> is an action
    assert (batch["responses"][~batch["response_mask"]] == same.eos_token_id).all()  # padding
    other = history_to_batch([messages, messages[:2]], tok)  # pad <pad>: only the padding differs
    real = batch["attention_mask"]
    assert torch.equal(real, other["attention_mask"]) and torch.equal(
        batch["action_mask"], other["action_mask"]
    )
    assert torch.equal(batch["input_ids"][real], other["input_ids"][real])


def test_turn_index_follows_the_assistant_turns(tok):
    messages = [
        {"role": "user", "content": "what is 2+3?"},
        {"role": "assistant", "content": "the tool"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "the answer is 5"},
    ]
    batch = history_to_batch([messages, messages[:2]], tok)
    turn, action, real = batch["turn_index"], batch["action_mask"], batch["response_mask"]
    assert (turn[~real] == -1).all() and (turn[real] >= 0).all()
    for row in range(2):
        seen = turn[row][real[row]].tolist()
        assert seen == sorted(seen)  # turns in order, observation tokens with the turn before them
        runs = torch.unique_consecutive(turn[row][action[row]]).tolist()
        assert runs == list(range(int(batch["num_turns"][row])))


# --------------------------------------------------------------------------------------------------------
# (b) what the policy sampled vs what re-tokenising the text gives
# --------------------------------------------------------------------------------------------------------


def split_ids(tok, text: str) -> list[int]:
    """``text`` as one token per byte-level character: decodes to ``text``, but re-encoding merges it."""
    return tok.convert_tokens_to_ids(list(tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)[0][0]))


def test_sampled_ids_are_used_verbatim_where_retokenising_differs(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "leisure"}]
    sampled = [*split_ids(tok, "leisure"), tok.eos_token_id]
    retok = tok("leisure", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.decode(sampled) == tok.decode(retok) and sampled != retok  # the round trip changes the ids
    logprobs = -torch.rand(len(sampled), generator=torch.Generator().manual_seed(0)) - 0.1

    plain = history_to_batch([messages], tok)
    exact = history_to_batch([messages], tok, sampled_ids=[[sampled]], assistant_logprobs=[[logprobs]])
    _, response, action = real_rows(plain, 0)
    assert [t for t, a in zip(response, action, strict=True) if a] == retok and bool(plain["retokenized"][0])
    _, response, action = real_rows(exact, 0)
    assert [t for t, a in zip(response, action, strict=True) if a] == sampled
    assert not bool(exact["retokenized"][0])
    rb.check(exact, check_values=True)
    # logprobs sit on the action tokens in order (reference: walk the row token by token)
    lp, am = exact["logprobs"][0].tolist(), exact["action_mask"][0].tolist()
    expected, k = [], 0
    for a in am:
        expected.append(float(logprobs[k]) if a else 0.0)
        k += a
    assert lp == pytest.approx(expected)
    with pytest.raises(ValueError, match="has 8 action tokens"):
        history_to_batch([messages], tok, sampled_ids=[[sampled]], assistant_logprobs=[[logprobs[:-1]]])


def test_sampled_ids_that_are_not_the_message_are_refused(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "leisure"}]
    no_eos = split_ids(tok, "leisure")  # the policy never sampled <|im_end|> but the message says complete
    with pytest.raises(
        ValueError,
        match=r"message 1: sampled_ids decode to 'leisure' but the message renders as 'leisure<\|im_end\|>'",
    ):
        history_to_batch([messages], tok, sampled_ids=[[no_eos]])
    with pytest.raises(ValueError, match="1 assistant messages in its response but 2 entries"):
        history_to_batch([messages], tok, sampled_ids=[[no_eos, no_eos]])
    cut = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "leisure", "is_complete": False},
    ]
    batch = history_to_batch([cut], tok, sampled_ids=[[no_eos]])  # cut at max_new_tokens: no EOS, accepted
    assert batch["action_mask"].sum() == len(no_eos)


# --------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------


def test_a_template_that_breaks_the_prefix_property_is_named(tok):
    # Renders a last user/tool message differently from an earlier one (as templates that strip reasoning from
    # earlier turns do): the conversation before message 3 is not a token prefix of the whole.
    unstable = CHATML.replace(
        "{{ m['content'] }}<|im_end|>{% endif %}",
        "{{ m['content'] }}{% if loop.last and loop.index > 1 %} (last){% endif %}<|im_end|>{% endif %}",
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "we"},
        {"role": "user", "content": "the tool"},
        {"role": "assistant", "content": "5"},
    ]
    with pytest.raises(ValueError, match="episode 0, message 3: the conversation before it"):
        history_to_batch([messages], tok, chat_template=unstable, method="prefix")


def test_bad_input_is_named(tok):
    with pytest.raises(ValueError, match="episode 1 has no assistant message"):
        history_to_batch(
            [
                [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                [{"role": "user", "content": "a"}],
            ],
            tok,
        )
    with pytest.raises(ValueError, match="method must be"):
        history_to_batch(
            [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]], tok, method="diff"
        )
    with pytest.raises(ValueError, match="message 0: needs 'role' and 'content'"):
        history_to_batch([[{"content": "a"}]], tok)
    with pytest.raises(ValueError, match="no end-of-turn token"):
        history_to_batch(
            [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]],
            tok,
            chat_template=CHATML.replace("<|im_end|>", ""),
        )


# --------------------------------------------------------------------------------------------------------
# A ChatEnv rollout
# --------------------------------------------------------------------------------------------------------


def test_chat_env_rollout_to_batch(tok):
    from torchrl.envs.llm import ChatEnv
    from torchrl.modules.llm.policies import ChatHistory

    env = ChatEnv(batch_size=(1,), tokenizer=tok, system_prompt="be nice", input_mode="history")
    replies = iter(["the tool", "the answer is 5"])

    def policy(td):  # appends one assistant message per step, as an LLM wrapper in history mode does
        chat = td["history"]
        msg = History(role="assistant", content=next(replies), batch_size=()).unsqueeze(0).unsqueeze(0)
        full = chat.prompt.extend(msg, inplace=False, dim=-1)
        td["history"] = ChatHistory(prompt=chat.prompt, response=msg, full=full, batch_size=chat.batch_size)
        return td

    start = env.reset(TensorDict({"query": ["what is 2+3?"]}, batch_size=(1,)))
    rollout = env.rollout(2, policy=policy, tensordict=start, auto_reset=False)
    batch = episode_to_batch(rollout, tok)
    expected = history_to_batch(
        [
            [
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": "what is 2+3?"},
                {"role": "assistant", "content": "the tool"},
                {"role": "assistant", "content": "the answer is 5"},
            ]
        ],
        tok,
    )
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    assert torch.equal(batch["action_mask"], expected["action_mask"])
    assert "rewards" not in batch.keys()  # ChatEnv alone gives no reward
    rollout.set(("next", "reward"), torch.tensor([[[0.5], [2.0]]]))  # what a reward transform writes per step
    assert episode_to_batch(rollout, tok)["rewards"].tolist() == [2.5]
    with pytest.raises(ValueError, match="input_mode='history'"):
        episode_to_batch(TensorDict({"x": torch.zeros(1, 2)}, batch_size=(1, 2)), tok)


# --------------------------------------------------------------------------------------------------------
# (c) torchrl replay buffers
# --------------------------------------------------------------------------------------------------------


def episodes_batch(tok, seed: int, n: int) -> TensorDict:
    rng = random.Random(seed)
    episodes = [random_episode(rng) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    first = history_to_batch(episodes, tok)
    logprobs = [[-torch.rand(len(t), generator=gen) for t in per_turn_ids(first, row)] for row in range(n)]
    return history_to_batch(episodes, tok, assistant_logprobs=logprobs, rewards=torch.rand(n, generator=gen))


def per_turn_ids(batch: TensorDict, row: int) -> list[list[int]]:
    turn, action = batch["turn_index"][row], batch["action_mask"][row]
    return [
        batch["responses"][row][action & (turn == k)].tolist() for k in range(int(batch["num_turns"][row]))
    ]


def same_row(a: TensorDict, b: TensorDict) -> None:
    """Two rows hold the same real tokens, masks, per-token values and text (padding width aside)."""
    assert a["prompts"][a["prompt_mask"]].tolist() == b["prompts"][b["prompt_mask"]].tolist()
    for key in ("responses", "action_mask", "logprobs", "turn_index"):
        assert a[key][a["response_mask"]].tolist() == b[key][b["response_mask"]].tolist(), key
    assert float(a["rewards"]) == float(b["rewards"])
    assert a["response_text"] == b["response_text"] and a["prompt_text"] == b["prompt_text"]


def test_lazy_tensor_storage_round_trips_one_shape_and_refuses_another(tok):
    batch = episodes_batch(tok, seed=2, n=5)
    buffer = ReplayBuffer(storage=LazyTensorStorage(16))
    buffer.extend(batch)
    back = buffer[:5]
    assert isinstance(back.get("response_text"), NonTensorStack)
    for key in batch.keys():
        if key in rb.TEXT_KEYS:
            assert back.get(key).tolist() == batch.get(key).tolist()
        else:
            assert torch.equal(back[key], batch[key]), key
    other = episodes_batch(tok, seed=3, n=2)
    assert other["responses"].shape[1] != batch["responses"].shape[1]
    with pytest.raises(RuntimeError):  # P and R were fixed by the first extend
        buffer.extend(other)


def test_episode_buffer_keeps_rows_of_different_lengths(tok):
    a, b = episodes_batch(tok, seed=4, n=3), episodes_batch(tok, seed=5, n=2)
    assert a["responses"].shape[1] != b["responses"].shape[1]
    buffer = episode_buffer(8, pad_token_id=tok.pad_token_id)
    buffer.extend(a)
    buffer.extend(b)
    assert len(buffer) == 5
    back = buffer[torch.arange(5)]
    rb.check(back, check_values=True)
    rows = [a[i] for i in range(3)] + [b[i] for i in range(2)]
    for i, row in enumerate(rows):
        same_row(back[i], row)
    sample = buffer.sample(4)
    assert sample.batch_size == (4,)
    rb.check(sample, check_values=True)
