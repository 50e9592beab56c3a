"""rlbits.text: make_prompts, tokenize_prompts, decode (chat_prompts: tests/tasks/test_real_tasks.py). Tiny tokenizers."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from rlbits import batch as rb
from rlbits import text as rt

PAD = 0


def texts(td, key):
    return td.get(key).tolist()


# --------------------------------------------------------------------------------------------- prompts


def test_make_prompts_left_pads():
    td = rt.make_prompts([[5, 6, 7], [8], [9, 10]], pad_token_id=PAD)
    assert td.batch_size == (3,)
    assert torch.equal(td["prompts"], torch.tensor([[5, 6, 7], [0, 0, 8], [0, 9, 10]]))
    assert torch.equal(td["prompt_mask"], torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]], dtype=torch.bool))
    assert td["prompts"].dtype == torch.int64
    rb.check(td, check_values=True)


def test_make_prompts_truncation():
    td = rt.make_prompts([[1, 2, 3, 4], [5]], pad_token_id=PAD, max_prompt_len=2)
    assert torch.equal(td["prompts"], torch.tensor([[3, 4], [0, 5]]))
    with pytest.raises(ValueError, match="prompt 0 has 4 tokens"):
        rt.make_prompts([[1, 2, 3, 4]], pad_token_id=PAD, max_prompt_len=2, truncation="error")
    # P is the longest prompt, not max_prompt_len
    assert rt.make_prompts([[1]], pad_token_id=PAD, max_prompt_len=8)["prompts"].shape == (1, 1)


@pytest.mark.parametrize(
    "ids, kwargs, match",
    [
        ([], {}, "at least one prompt"),
        ([[1], []], {}, "prompt 1 must be a non-empty"),
        ([[1]], {"truncation": "right"}, "truncation"),
        ([[1]], {"max_prompt_len": 0}, "max_prompt_len"),
    ],
)
def test_make_prompts_errors(ids, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rt.make_prompts(ids, pad_token_id=PAD, **kwargs)


# ------------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """WordLevel tokenizer trained on a few strings; its post-processor appends [EOS] by default."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    tok.train_from_iterator(["the movie was great", "the plot was bad", "great fun"], trainer=trainer)
    eos = tok.token_to_id("[EOS]")
    tok.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", eos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )


def test_tokenize_prompts_adds_no_special_tokens(tokenizer):
    td = rt.tokenize_prompts(tokenizer, ["the movie was", "great"])
    ids = [tokenizer.convert_tokens_to_ids(w) for w in ["the", "movie", "was", "great"]]
    pad = tokenizer.pad_token_id
    assert torch.equal(td["prompts"], torch.tensor([ids[:3], [pad, pad, ids[3]]]))
    assert torch.equal(td["prompt_mask"], torch.tensor([[True, True, True], [False, False, True]]))
    with_eos = rt.tokenize_prompts(tokenizer, ["great"], add_special_tokens=True)
    assert with_eos["prompts"].tolist() == [[ids[3], tokenizer.eos_token_id]]


def test_tokenize_prompts_left_pads_whatever_the_tokenizer_padding_side(tokenizer):
    tokenizer.padding_side = "right"
    try:
        td = rt.tokenize_prompts(tokenizer, ["the movie was", "great"], max_prompt_len=2)
    finally:
        tokenizer.padding_side = "left"
    assert td["prompt_mask"].tolist() == [[True, True], [False, True]]
    assert td["prompts"][0].tolist() == [tokenizer.convert_tokens_to_ids(w) for w in ["movie", "was"]]


def test_tokenize_prompts_errors(tokenizer):
    with pytest.raises(ValueError, match="single str"):
        rt.tokenize_prompts(tokenizer, "the movie")
    with pytest.raises(ValueError, match="at least one"):
        rt.tokenize_prompts(tokenizer, [])


# ------------------------------------------------------------------------------------------------ decode


def test_decode_reads_masked_tokens_only_and_stays_aligned(tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    great, movie, bad, eos = ids("great"), ids("movie"), ids("bad"), tokenizer.eos_token_id
    # padding positions hold a real word id ("bad"): only the masks say they are padding
    prompts = torch.tensor([[bad, ids("the"), movie], [bad, bad, ids("plot")]])
    prompt_mask = torch.tensor([[False, True, True], [False, False, True]])
    responses = torch.tensor([[ids("was"), great, eos], [ids("was"), bad, bad]])
    action_mask = torch.tensor([[True, True, True], [True, False, False]])
    td = rt.decode(rb.build_batch(prompts, prompt_mask, responses, action_mask), tokenizer)
    assert texts(td, "prompt_text") == ["the movie", "plot"]
    assert texts(td, "response_text") == ["was great", "was"]  # [EOS] skipped as a special token
    # indexing, slicing, splitting and concatenating keep strings on their rows
    assert td[1]["response_text"] == "was"
    assert texts(td[torch.tensor([1, 0])], "prompt_text") == ["plot", "the movie"]
    first, second = rb.split_microbatches(td, 1)
    assert texts(second, "response_text") == ["was"]
    assert texts(torch.cat([second, first]), "response_text") == ["was", "was great"]
    assert texts(rb.repeat_interleave_prompts(td, 2), "prompt_text") == ["the movie"] * 2 + ["plot"] * 2
    rb.check(td)


def test_decode_uses_response_mask_for_tool_tokens(tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    responses = torch.tensor([[ids("great"), ids("fun"), ids("bad")]])
    td = rb.build_batch(
        torch.tensor([[ids("the")]]),
        torch.tensor([[True]]),
        responses,
        torch.tensor([[True, False, False]]),  # "fun" is tool output: real, not an action
        response_mask=torch.tensor([[True, True, False]]),
    )
    assert texts(rt.decode(td, tokenizer), "response_text") == ["great fun"]


def test_decode_prompts_only(tokenizer):
    td = rt.decode(rt.tokenize_prompts(tokenizer, ["great fun"]), tokenizer)
    assert texts(td, "prompt_text") == ["great fun"]
    assert "response_text" not in td.keys()
