"""rlbits.batch: schema, validation, padding, collate, splits, groups, decode, trim. Hand-made tiny batches."""

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from rlbits import batch as rb

PAD = 0


def texts(td, key):
    return td.get(key).tolist()


def assert_same_batch(a, b):
    assert a.batch_size == b.batch_size
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
        if key in rb.TEXT_KEYS:
            assert texts(a, key) == texts(b, key), key
        else:
            assert torch.equal(a.get(key), b.get(key)), key


@pytest.fixture
def batch():
    """B=3, P=3, R=4. Row 1 has a tool token (id 9) that is a real response token but not an action."""
    prompts = torch.tensor([[PAD, 11, 12], [13, 14, 15], [PAD, PAD, 16]])
    prompt_mask = prompts != PAD
    responses = torch.tensor([[21, 22, PAD, PAD], [23, 9, 24, PAD], [25, PAD, PAD, PAD]])
    response_mask = responses != PAD
    action_mask = response_mask & (responses != 9)
    return rb.build_batch(
        prompts,
        prompt_mask,
        responses,
        action_mask,
        response_mask=response_mask,
        logprobs=torch.full((3, 4), -1.0),
        rewards=torch.tensor([1.0, 0.0, 0.5]),
        group=torch.tensor([0, 0, 1]),
        prompt_text=["p0", "p1", "p2"],
        response_text=["r0", "r1", "r2"],
    )


# ---------------------------------------------------------------------------------------------- schema


def test_schema_covers_design_table():
    design_keys = {
        "prompts", "prompt_mask", "responses", "input_ids", "attention_mask", "action_mask", "logprobs",
        "ref_logprobs", "values", "rewards", "token_rewards", "advantages", "returns", "group",
        "prompt_text", "response_text",
    }  # fmt: skip
    assert set(rb.SCHEMA) == design_keys | {"response_mask", "entropy", "truncated"}
    assert rb.SCHEMA[rb.PROMPTS].describe() == "[B, P] int64"
    assert rb.SCHEMA[rb.INPUT_IDS].shape == "[B, P+R]"
    assert rb.SCHEMA[rb.PROMPT_TEXT].describe() == "[B] str"
    assert set(rb.PER_TOKEN_KEYS) == {
        "logprobs",
        "ref_logprobs",
        "values",
        "token_rewards",
        "advantages",
        "returns",
        "entropy",
    }
    assert set(rb.TEXT_KEYS) == {"prompt_text", "response_text"}


# --------------------------------------------------------------------------------------------- padding


def test_pad_right_and_left_exact():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    assert torch.equal(rb.pad_right(seqs, 0), torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]]))
    assert torch.equal(rb.pad_left(seqs, -1), torch.tensor([[1, 2, 3], [-1, -1, 4], [-1, 5, 6]]))
    assert torch.equal(rb.pad_right(seqs[1:], 7, length=3), torch.tensor([[4, 7, 7], [5, 6, 7]]))
    masks = [torch.tensor([True]), torch.tensor([True, True])]
    assert torch.equal(rb.pad_left(masks, False), torch.tensor([[False, True], [True, True]]))


def test_pad_keeps_trailing_dims_and_dtype():
    out = rb.pad_right([torch.ones(1, 2), torch.ones(2, 2)], 0.0)
    assert out.shape == (2, 2, 2) and out.dtype == torch.float32
    assert torch.equal(out[0], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


@pytest.mark.parametrize(
    "seqs, kwargs, match",
    [
        ([], {}, "at least one"),
        ([torch.tensor([1]), torch.tensor([1.0])], {}, "dtype"),
        ([torch.ones(1, 2), torch.ones(1, 3)], {}, "trailing shape"),
        ([torch.tensor([1, 2])], {"length": 1}, "shorter"),
    ],
)
def test_pad_errors(seqs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rb.pad_right(seqs, 0, **kwargs)


# --------------------------------------------------------------------------------------------- prompts


def test_make_prompts_left_pads():
    td = rb.make_prompts([[5, 6, 7], [8], [9, 10]], pad_token_id=PAD)
    assert td.batch_size == (3,)
    assert torch.equal(td[rb.PROMPTS], torch.tensor([[5, 6, 7], [0, 0, 8], [0, 9, 10]]))
    assert torch.equal(td[rb.PROMPT_MASK], torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]], dtype=torch.bool))
    assert td[rb.PROMPTS].dtype == torch.int64
    rb.validate(td, check_values=True)


def test_make_prompts_truncation():
    td = rb.make_prompts([[1, 2, 3, 4], [5]], pad_token_id=PAD, max_prompt_len=2)
    assert torch.equal(td[rb.PROMPTS], torch.tensor([[3, 4], [0, 5]]))
    with pytest.raises(ValueError, match="prompt 0 has 4 tokens"):
        rb.make_prompts([[1, 2, 3, 4]], pad_token_id=PAD, max_prompt_len=2, truncation="error")
    # P is the longest prompt, not max_prompt_len
    assert rb.make_prompts([[1]], pad_token_id=PAD, max_prompt_len=8)[rb.PROMPTS].shape == (1, 1)


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
        rb.make_prompts(ids, pad_token_id=PAD, **kwargs)


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
    td = rb.tokenize_prompts(tokenizer, ["the movie was", "great"])
    ids = [tokenizer.convert_tokens_to_ids(w) for w in ["the", "movie", "was", "great"]]
    pad = tokenizer.pad_token_id
    assert torch.equal(td[rb.PROMPTS], torch.tensor([ids[:3], [pad, pad, ids[3]]]))
    assert torch.equal(td[rb.PROMPT_MASK], torch.tensor([[True, True, True], [False, False, True]]))
    with_eos = rb.tokenize_prompts(tokenizer, ["great"], add_special_tokens=True)
    assert with_eos[rb.PROMPTS].tolist() == [[ids[3], tokenizer.eos_token_id]]


def test_tokenize_prompts_left_pads_whatever_the_tokenizer_padding_side(tokenizer):
    tokenizer.padding_side = "right"
    try:
        td = rb.tokenize_prompts(tokenizer, ["the movie was", "great"], max_prompt_len=2)
    finally:
        tokenizer.padding_side = "left"
    assert td[rb.PROMPT_MASK].tolist() == [[True, True], [False, True]]
    assert td[rb.PROMPTS][0].tolist() == [tokenizer.convert_tokens_to_ids(w) for w in ["movie", "was"]]


def test_tokenize_prompts_errors(tokenizer):
    with pytest.raises(ValueError, match="single str"):
        rb.tokenize_prompts(tokenizer, "the movie")
    with pytest.raises(ValueError, match="at least one"):
        rb.tokenize_prompts(tokenizer, [])


# ------------------------------------------------------------------------------------------ build_batch


def test_build_batch_fills_input_ids_and_masks(batch):
    assert batch.batch_size == (3,)
    assert torch.equal(
        batch[rb.INPUT_IDS],
        torch.tensor([[0, 11, 12, 21, 22, 0, 0], [13, 14, 15, 23, 9, 24, 0], [0, 0, 16, 25, 0, 0, 0]]),
    )
    # the tool token (row 1, response column 1) is attended to but not an action
    assert batch[rb.ATTENTION_MASK].tolist() == [
        [False, True, True, True, True, False, False],
        [True, True, True, True, True, True, False],
        [False, False, True, True, False, False, False],
    ]
    assert batch[rb.ACTION_MASK][1].tolist() == [True, False, True, False]
    # per-token keys are zeroed off the action mask
    assert torch.equal(batch[rb.LOGPROBS], torch.tensor([[-1.0, -1, 0, 0], [-1, 0, -1, 0], [-1, 0, 0, 0]]))
    assert texts(batch, rb.RESPONSE_TEXT) == ["r0", "r1", "r2"]
    rb.validate(batch, check_values=True)


def test_build_batch_default_response_mask_is_action_mask():
    td = rb.build_batch(
        torch.tensor([[1]]), torch.tensor([[True]]), torch.tensor([[2, 0]]), torch.tensor([[True, False]])
    )
    assert torch.equal(td[rb.RESPONSE_MASK], td[rb.ACTION_MASK])
    assert td[rb.ATTENTION_MASK].tolist() == [[True, True, False]]


def test_build_batch_errors_name_the_key():
    p, pm = torch.tensor([[1], [2]]), torch.tensor([[True], [True]])
    r, am = torch.tensor([[3], [4]]), torch.tensor([[True], [True]])
    with pytest.raises(ValueError, match="rewards must have leading dim B=2"):
        rb.build_batch(p, pm, r, am, rewards=torch.zeros(3))
    with pytest.raises(ValueError, match="logprobs must be .B, R. float32 with R=1"):
        rb.build_batch(p, pm, r, am, logprobs=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="responses must be .B, R. int64"):
        rb.build_batch(p, pm, r.float(), am)
    with pytest.raises(ValueError, match="prompt_text must have leading dim B=2"):
        rb.build_batch(p, pm, r, am, prompt_text=["only one"])
    with pytest.raises(ValueError, match="input_ids is computed by build_batch"):
        rb.build_batch(p, pm, r, am, input_ids=torch.cat([p, r], dim=1))


# --------------------------------------------------------------------------------------------- validate


def _break(batch, key, value):
    batch = batch.clone()
    batch.set(key, value)  # TensorDict allows any trailing shape; validate is what catches it
    return batch


BAD_BATCHES = {
    "missing key": (lambda b: b.exclude(rb.PROMPT_MASK), "prompt_mask"),
    "wrong dtype": (lambda b: _break(b, rb.LOGPROBS, b[rb.LOGPROBS].double()), "logprobs must be .B, R. float32"),
    "wrong ndim": (lambda b: _break(b, rb.REWARDS, b[rb.REWARDS][:, None]), "rewards must be .B. float32"),
    "mask not bool": (lambda b: _break(b, rb.ACTION_MASK, b[rb.ACTION_MASK].long()), "action_mask must be .B, R. bool"),
    "P disagrees": (lambda b: _break(b, rb.PROMPT_MASK, b[rb.PROMPT_MASK][:, 1:]), "prompt_mask .* P=3 .from prompts"),
    "R disagrees": (lambda b: _break(b, rb.VALUES, torch.zeros(3, 5)), "values .* R=4 .from responses"),
    "P+R disagrees": (lambda b: _break(b, rb.INPUT_IDS, b[rb.INPUT_IDS][:, 1:]), "input_ids .* P\\+R = 3\\+4"),
    "text as one list": (lambda b: _text_as_one_value(b), "response_text must hold one str per row"),
    "text as tensor": (lambda b: _break(b.exclude(rb.PROMPT_TEXT), rb.PROMPT_TEXT, torch.zeros(3)), "prompt_text must be a non-tensor"),
}  # fmt: skip


def _text_as_one_value(b):
    b = b.exclude(rb.RESPONSE_TEXT)
    # a common mistake: set_non_tensor stores the whole list as one value broadcast to every row
    b.set_non_tensor(rb.RESPONSE_TEXT, ["r0", "r1", "r2"])
    return b


@pytest.mark.parametrize("name", BAD_BATCHES)
def test_validate_catches_shape_and_dtype_errors(batch, name):
    make, match = BAD_BATCHES[name]
    with pytest.raises(ValueError, match=match):
        rb.validate(make(batch))


def test_validate_batch_size_and_required(batch):
    with pytest.raises(ValueError, match="batch_size .B."):
        rb.validate(TensorDict({rb.PROMPTS: torch.zeros(2, 2, 3, dtype=torch.long)}, batch_size=[2, 2]))
    with pytest.raises(ValueError, match="missing required key 'advantages'"):
        rb.validate(batch, required=(rb.ADVANTAGES,))
    with pytest.raises(ValueError, match="must be a TensorDict"):
        rb.validate({rb.PROMPTS: torch.zeros(1, 1)})
    # unknown keys are allowed
    rb.validate(_break(batch, "old_values", torch.zeros(3, 9)), check_values=True)


def _set_at(batch, key, index, value):
    batch = batch.clone()
    batch.get(key)[index] = value
    return batch


BAD_VALUES = {
    "per-token nonzero off actions": (lambda b: _set_at(b, rb.LOGPROBS, (1, 1), -0.5), "logprobs must be 0 where action_mask"),
    "action on padding": (lambda b: _set_at(b, rb.ACTION_MASK, (0, 3), True), "action_mask is True where response_mask"),
    "prompt right-padded": (lambda b: _set_at(b, rb.PROMPT_MASK, (0, slice(None)), torch.tensor([True, True, False])), "prompt_mask must be left-padded"),
    "response left-padded": (lambda b: _set_at(b, rb.RESPONSE_MASK, (0, 3), True), "response_mask must be right-padded"),
    "input_ids stale": (lambda b: _set_at(b, rb.INPUT_IDS, (0, 3), 99), "input_ids must equal cat"),
    "attention_mask stale": (lambda b: _set_at(b, rb.ATTENTION_MASK, (1, 4), False), "attention_mask must equal cat"),
    "group not contiguous": (lambda b: _break(b, rb.GROUP, torch.tensor([0, 1, 0])), "group: rows of one group"),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD_VALUES)
def test_validate_check_values(batch, name):
    make, match = BAD_VALUES[name]
    bad = make(batch)
    rb.validate(bad)  # shapes and dtypes are fine
    with pytest.raises(ValueError, match=match):
        rb.validate(bad, check_values=True)


# ---------------------------------------------------------------------------------------------- collate


def test_collate_repads_different_lengths():
    # batch a: P=2, R=1; batch b: P=1, R=3
    a = rb.build_batch(
        torch.tensor([[1, 2], [0, 3]]),
        torch.tensor([[True, True], [False, True]]),
        torch.tensor([[4], [5]]),
        torch.tensor([[True], [True]]),
        logprobs=torch.tensor([[-0.1], [-0.2]]),
        group=torch.tensor([0, 0]),
        response_text=["a0", "a1"],
    )
    b = rb.build_batch(
        torch.tensor([[6]]),
        torch.tensor([[True]]),
        torch.tensor([[7, 8, 0]]),
        torch.tensor([[True, True, False]]),
        logprobs=torch.tensor([[-0.3, -0.4, 0.0]]),
        group=torch.tensor([0]),
        response_text=["b0"],
    )
    out = rb.collate([a, b], pad_token_id=PAD)
    assert out.batch_size == (3,)
    assert out[rb.PROMPTS].tolist() == [[1, 2], [0, 3], [0, 6]]
    assert out[rb.PROMPT_MASK].tolist() == [[True, True], [False, True], [False, True]]
    assert out[rb.RESPONSES].tolist() == [[4, 0, 0], [5, 0, 0], [7, 8, 0]]
    assert out[rb.ACTION_MASK].tolist() == [[True, False, False], [True, False, False], [True, True, False]]
    assert torch.equal(out[rb.RESPONSE_MASK], out[rb.ACTION_MASK])
    assert torch.equal(out[rb.LOGPROBS], torch.tensor([[-0.1, 0, 0], [-0.2, 0, 0], [-0.3, -0.4, 0]]))
    assert out[rb.INPUT_IDS].tolist() == [[1, 2, 4, 0, 0], [0, 3, 5, 0, 0], [0, 6, 7, 8, 0]]
    assert out[rb.ATTENTION_MASK].tolist() == [
        [True, True, True, False, False],
        [False, True, True, False, False],
        [False, True, True, True, False],
    ]
    assert out[rb.GROUP].tolist() == [0, 0, 1]  # b's group 0 is a different prompt from a's group 0
    assert texts(out, rb.RESPONSE_TEXT) == ["a0", "a1", "b0"]
    rb.validate(out, required=rb.SCHEMA.keys() & out.keys(), check_values=True)


def test_collate_renumbers_groups_and_undoes_split(batch):
    parts = rb.split_microbatches(batch, 2)
    assert_same_batch(rb.collate(parts), batch)  # same lengths: no pad_token_id needed
    g = rb.collate([batch, batch])[rb.GROUP]
    assert g.tolist() == [0, 0, 1, 2, 2, 3]


def test_collate_errors(batch):
    short = rb.trim_padding(batch)  # R shrinks from 4 to 3
    with pytest.raises(ValueError, match="needs pad_token_id to pad responses"):
        rb.collate([batch, short])
    with pytest.raises(ValueError, match="different keys: \\['rewards'\\]"):
        rb.collate([batch, batch.exclude(rb.REWARDS)])
    with pytest.raises(ValueError, match="cannot pad 'extra'"):
        rb.collate([_break(batch, "extra", torch.zeros(3, 2)), _break(batch, "extra", torch.zeros(3, 1))])
    with pytest.raises(ValueError, match="at least one batch"):
        rb.collate([])


# ----------------------------------------------------------------------------------------------- splits


def test_split_microbatches_round_trip_and_views(batch):
    parts = rb.split_microbatches(batch, 2)
    assert [p.batch_size[0] for p in parts] == [2, 1]
    assert_same_batch(torch.cat(parts), batch)
    assert texts(parts[1], rb.RESPONSE_TEXT) == ["r2"]
    parts[1][rb.REWARDS][0] = 7.0  # a view: writes reach the batch
    assert batch[rb.REWARDS][2] == 7.0
    assert len(rb.split_microbatches(batch, 10)) == 1
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        rb.split_microbatches(batch, 0)


def test_split_microbatches_sort_by_length_groups_similar_rows():
    # rows of real lengths (prompt + response) 5, 2, 4, 2, 3: sorted (stable) -> rows 1, 3, 4, 2, 0
    prompts = rb.make_prompts([[1, 2], [3], [4, 5, 6], [7], [8]], pad_token_id=PAD)
    responses = torch.tensor([[9, 9, 9], [9, 0, 0], [9, 0, 0], [9, 0, 0], [9, 9, 0]])
    mask = responses != 0
    td = rb.build_batch(
        prompts[rb.PROMPTS], prompts[rb.PROMPT_MASK], responses, mask, rewards=torch.arange(5.0)
    )
    parts = rb.split_microbatches(td, 2, sort_by_length=True)
    assert [p[rb.REWARDS].tolist() for p in parts] == [[1.0, 3.0], [4.0, 2.0], [0.0]]
    assert [p[rb.ATTENTION_MASK].sum(1).tolist() for p in parts] == [[2, 2], [3, 4], [5]]
    # one microbatch: nothing to sort, still the views of the batch
    assert_same_batch(rb.split_microbatches(td, 5, sort_by_length=True)[0], td)
    with pytest.raises(ValueError, match="sort_by_length needs 'attention_mask'"):
        rb.split_microbatches(TensorDict(x=torch.zeros(3), batch_size=[3]), 1, sort_by_length=True)


def _grouped(num_groups, group_size):
    prompts = rb.make_prompts([[i + 1] for i in range(num_groups)], pad_token_id=PAD)
    prompts.set(rb.PROMPT_TEXT, NonTensorStack.from_list([f"p{i}" for i in range(num_groups)]))
    td = rb.repeat_interleave_prompts(prompts, group_size)
    td.set("row", torch.arange(td.batch_size[0]))
    return td


def test_split_minibatches_keeps_groups_and_is_deterministic():
    td = _grouped(num_groups=5, group_size=3)
    mbs = rb.split_minibatches(td, 2, generator=torch.Generator().manual_seed(1))
    assert [m.batch_size[0] for m in mbs] == [9, 6]  # 5 groups dealt 3 + 2
    rows = torch.cat([m["row"] for m in mbs])
    assert sorted(rows.tolist()) == list(range(15))
    for m in mbs:
        for start in range(0, m.batch_size[0], 3):  # each minibatch is whole groups, rows in order
            g = m[rb.GROUP][start].item()
            assert m["row"][start : start + 3].tolist() == [3 * g, 3 * g + 1, 3 * g + 2]
            assert m[rb.PROMPTS][start : start + 3, 0].tolist() == [g + 1] * 3
            assert texts(m, rb.PROMPT_TEXT)[start : start + 3] == [f"p{g}"] * 3
    again = rb.split_minibatches(td, 2, generator=torch.Generator().manual_seed(1))
    assert [m["row"].tolist() for m in again] == [m["row"].tolist() for m in mbs]
    orders = {
        tuple(torch.cat([m["row"] for m in rb.split_minibatches(td, 2, generator=torch.Generator().manual_seed(s))]).tolist())
        for s in range(5)
    }  # fmt: skip
    assert len(orders) > 1  # the seed matters


def test_split_minibatches_by_size_and_by_rows():
    td = _grouped(num_groups=4, group_size=2)
    gen = torch.Generator().manual_seed(0)
    mbs = rb.split_minibatches(td, minibatch_size=6, generator=gen)
    assert [m.batch_size[0] for m in mbs] == [6, 2]
    for m in mbs:
        assert (m[rb.GROUP][0::2] == m[rb.GROUP][1::2]).all()
    rows = rb.split_minibatches(td, minibatch_size=3, generator=gen, keep_groups=False)
    assert [m.batch_size[0] for m in rows] == [3, 3, 2]
    assert sorted(torch.cat([m["row"] for m in rows]).tolist()) == list(range(8))
    # no group key: one unit per row
    assert len(rb.split_minibatches(td.exclude(rb.GROUP), 8, generator=gen)) == 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one"),
        ({"num_minibatches": 2, "minibatch_size": 2}, "exactly one"),
        ({"num_minibatches": 5}, "num_minibatches must be in \\[1, 4\\]"),
        ({"num_minibatches": 0}, "num_minibatches must be in"),
        ({"minibatch_size": 0}, "minibatch_size must be >= 1"),
        ({"minibatch_size": 3}, "multiple of the group size 2"),
    ],
)
def test_split_minibatches_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rb.split_minibatches(_grouped(4, 2), **kwargs)


def test_split_minibatches_unequal_groups_by_count_only(batch):
    # groups of sizes 2 and 1: dealt by count fine, by row count refused
    assert len(rb.split_minibatches(batch, 2)) == 2
    with pytest.raises(ValueError, match="groups of equal size"):
        rb.split_minibatches(batch, minibatch_size=2)


# ----------------------------------------------------------------------------------------------- groups


def test_group_ids():
    assert rb.group_ids(2, 3).tolist() == [0, 0, 0, 1, 1, 1]
    assert rb.group_ids(3, 1).tolist() == [0, 1, 2]
    assert rb.group_ids(2, 3).dtype == torch.int64
    with pytest.raises(ValueError, match="group_size"):
        rb.group_ids(2, 0)


def test_repeat_interleave_prompts():
    td = rb.make_prompts([[5, 6], [7]], pad_token_id=PAD)
    td.set(rb.PROMPT_TEXT, NonTensorStack.from_list(["a", "b"]))
    out = rb.repeat_interleave_prompts(td, 2)
    assert out.batch_size == (4,)
    assert out[rb.PROMPTS].tolist() == [[5, 6], [5, 6], [0, 7], [0, 7]]
    assert out[rb.PROMPT_MASK].tolist() == [[True, True]] * 2 + [[False, True]] * 2
    assert out[rb.GROUP].tolist() == [0, 0, 1, 1]
    assert texts(out, rb.PROMPT_TEXT) == ["a", "a", "b", "b"]
    rb.validate(out, check_values=True)
    with pytest.raises(ValueError, match="group_size"):
        rb.repeat_interleave_prompts(td, 0)


# ------------------------------------------------------------------------------------------------ decode


def test_decode_reads_masked_tokens_only_and_stays_aligned(tokenizer):
    ids = tokenizer.convert_tokens_to_ids
    great, movie, bad, eos = ids("great"), ids("movie"), ids("bad"), tokenizer.eos_token_id
    # padding positions hold a real word id ("bad"): only the masks say they are padding
    prompts = torch.tensor([[bad, ids("the"), movie], [bad, bad, ids("plot")]])
    prompt_mask = torch.tensor([[False, True, True], [False, False, True]])
    responses = torch.tensor([[ids("was"), great, eos], [ids("was"), bad, bad]])
    action_mask = torch.tensor([[True, True, True], [True, False, False]])
    td = rb.decode(rb.build_batch(prompts, prompt_mask, responses, action_mask), tokenizer)
    assert texts(td, rb.PROMPT_TEXT) == ["the movie", "plot"]
    assert texts(td, rb.RESPONSE_TEXT) == ["was great", "was"]  # [EOS] skipped as a special token
    # indexing, slicing, splitting and concatenating keep strings on their rows
    assert td[1][rb.RESPONSE_TEXT] == "was"
    assert texts(td[torch.tensor([1, 0])], rb.PROMPT_TEXT) == ["plot", "the movie"]
    first, second = rb.split_microbatches(td, 1)
    assert texts(second, rb.RESPONSE_TEXT) == ["was"]
    assert texts(torch.cat([second, first]), rb.RESPONSE_TEXT) == ["was", "was great"]
    assert texts(rb.repeat_interleave_prompts(td, 2), rb.PROMPT_TEXT) == ["the movie"] * 2 + ["plot"] * 2
    rb.validate(td)


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
    assert texts(rb.decode(td, tokenizer), rb.RESPONSE_TEXT) == ["great fun"]


def test_decode_prompts_only(tokenizer):
    td = rb.decode(rb.tokenize_prompts(tokenizer, ["great fun"]), tokenizer)
    assert texts(td, rb.PROMPT_TEXT) == ["great fun"]
    assert rb.RESPONSE_TEXT not in td.keys()


# ------------------------------------------------------------------------------------------------- trim


def test_trim_padding(batch):
    # the fixture's last response column is padding in every row; prompts use all 3 columns in row 1
    out = rb.trim_padding(batch)
    assert out[rb.PROMPTS].shape == (3, 3) and out[rb.RESPONSES].shape == (3, 3)
    assert out[rb.RESPONSES].tolist() == [[21, 22, 0], [23, 9, 24], [25, 0, 0]]
    assert out[rb.INPUT_IDS].tolist() == [
        [0, 11, 12, 21, 22, 0],
        [13, 14, 15, 23, 9, 24],
        [0, 0, 16, 25, 0, 0],
    ]
    for key in (rb.ACTION_MASK, rb.RESPONSE_MASK, rb.LOGPROBS):
        assert torch.equal(out[key], batch[key][:, :3]), key
    assert torch.equal(out[rb.ATTENTION_MASK], batch[rb.ATTENTION_MASK][:, :6])
    assert torch.equal(out[rb.REWARDS], batch[rb.REWARDS])
    assert texts(out, rb.RESPONSE_TEXT) == ["r0", "r1", "r2"]
    assert out[rb.PROMPTS]._base is not None  # a view, no copy
    rb.validate(out, check_values=True)

    # rows 0 and 2 alone: P 3 -> 2 (column 0 is padding in both), R 4 -> 2
    two = rb.trim_padding(batch[torch.tensor([0, 2])])
    assert two[rb.PROMPTS].tolist() == [[11, 12], [0, 16]]
    assert two[rb.PROMPT_MASK].tolist() == [[True, True], [False, True]]
    assert two[rb.RESPONSES].tolist() == [[21, 22], [25, 0]]
    assert two[rb.LOGPROBS].tolist() == [[-1.0, -1.0], [-1.0, 0.0]]
    assert two[rb.INPUT_IDS].tolist() == [[11, 12, 21, 22], [0, 16, 25, 0]]
    assert two[rb.ATTENTION_MASK].tolist() == [[True, True, True, True], [False, True, True, False]]
    assert texts(two, rb.RESPONSE_TEXT) == ["r0", "r2"]
    rb.validate(two, check_values=True)


def test_trim_padding_undoes_collate_padding(batch):
    trimmed = rb.trim_padding(batch)
    wider = rb.build_batch(
        torch.tensor([[0, 0, 0, 1]]), torch.tensor([[False, False, False, True]]),
        torch.tensor([[2, 0, 0, 0, 0]]), torch.tensor([[True, False, False, False, False]]),
        logprobs=torch.zeros(1, 5), rewards=torch.zeros(1), group=torch.tensor([0]),
        prompt_text=["x"], response_text=["y"],
    )  # fmt: skip
    padded = rb.collate([trimmed, wider], pad_token_id=PAD)[:3]
    assert padded[rb.PROMPTS].shape == (3, 4) and padded[rb.RESPONSES].shape == (3, 5)
    assert_same_batch(rb.trim_padding(padded), trimmed)
