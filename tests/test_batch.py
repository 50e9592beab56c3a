"""rlbits.batch: schema, check, padding, collate (episode batches too), splits, groups, trim. Hand-made tiny batches."""

import ast
import re
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlbits import batch as rb
from rlbits.text import make_prompts

PAD = 0


def texts(td, key):
    return td.get(key).tolist()


def assert_same_batch(a, b):
    assert a.batch_size == b.batch_size
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
        if key in rb.SCHEMA and rb.SCHEMA[key].dtype is str:
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


BATCH_NAMES = {"batch", "micro", "minibatch", "mb", "columns"}


def _keys_written(path):
    """Batch keys a module writes: ``batch["k"] = ...``, ``batch.set("k", ...)``, ``build_batch(..., k=...)``
    and ``columns = {"k": ...}`` (module-level string constants resolved)."""
    tree = ast.parse(path.read_text())
    consts = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }

    def name(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return consts.get(node.id) if isinstance(node, ast.Name) else None

    def is_batch(node):
        return isinstance(node, ast.Name) and node.id in BATCH_NAMES

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and is_batch(target.value):
                    yield name(target.slice)
                if (
                    isinstance(target, ast.Name)
                    and target.id == "columns"
                    and isinstance(node.value, ast.Dict)
                ):
                    yield from (name(k) for k in node.value.keys)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "set" and is_batch(func.value) and node.args:
                yield name(node.args[0])
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == "build_batch":
                yield from (kw.arg for kw in node.keywords if kw.arg is not None)


def test_schema_holds_every_key_rlbits_writes():
    package = Path(rb.__file__).parent
    written = {}
    for path in sorted(package.rglob("*.py")):
        for key in _keys_written(path):
            if key is not None:
                written.setdefault(key, str(path.relative_to(package)))
    assert {
        "loss_mask",
        "turn_rewards",
        "turn_index",
        "num_turns",
        "stop_reason",
        "reference_rewards",
    } <= set(written)  # the scan sees the loops and generate_episodes
    missing = {k: where for k, where in written.items() if k not in rb.SCHEMA}
    assert not missing, f"keys written but not in rlbits.batch.SCHEMA: {missing}"


def test_docs_list_every_schema_key():
    doc = (Path(rb.__file__).parents[1] / "docs" / "batch.md").read_text()
    rows = {
        k
        for line in doc.splitlines()
        if line.startswith("| `")
        for k in re.findall(r"`(\w+)`", line.split("|")[1])
    }
    assert set(rb.SCHEMA) <= rows, sorted(set(rb.SCHEMA) - rows)


def test_schema_entries():
    assert rb.SCHEMA["prompts"].describe() == "[B, P] int64"
    assert rb.SCHEMA["input_ids"].shape == "[B, P+R]"
    assert rb.SCHEMA["prompt_text"].describe() == "[B] str"
    assert rb.SCHEMA["turn_index"].pad == -1 and rb.SCHEMA["responses"].pad == rb.PAD_TOKEN
    assert set(rb.PER_TOKEN_KEYS) == {
        "logprobs", "ref_logprobs", "values", "token_rewards", "advantages", "returns", "entropy", "turn_rewards",
        "old_logprobs", "rollout_is_weights",
    }
    assert set(rb.TEXT_KEYS) == {"prompt_text", "response_text"}
    assert {k for k, s in rb.SCHEMA.items() if s.dtype is str} == {
        "prompt_text",
        "response_text",
        "stop_reason",
    }


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


# ------------------------------------------------------------------------------------------ build_batch


def test_build_batch_fills_input_ids_and_masks(batch):
    assert batch.batch_size == (3,)
    assert torch.equal(
        batch["input_ids"],
        torch.tensor([[0, 11, 12, 21, 22, 0, 0], [13, 14, 15, 23, 9, 24, 0], [0, 0, 16, 25, 0, 0, 0]]),
    )
    # the tool token (row 1, response column 1) is attended to but not an action
    assert batch["attention_mask"].tolist() == [
        [False, True, True, True, True, False, False],
        [True, True, True, True, True, True, False],
        [False, False, True, True, False, False, False],
    ]
    assert batch["action_mask"][1].tolist() == [True, False, True, False]
    # per-token keys are zeroed off the action mask
    assert torch.equal(batch["logprobs"], torch.tensor([[-1.0, -1, 0, 0], [-1, 0, -1, 0], [-1, 0, 0, 0]]))
    assert texts(batch, "response_text") == ["r0", "r1", "r2"]
    rb.check(batch, check_values=True)


def test_build_batch_default_response_mask_is_action_mask():
    td = rb.build_batch(
        torch.tensor([[1]]), torch.tensor([[True]]), torch.tensor([[2, 0]]), torch.tensor([[True, False]])
    )
    assert torch.equal(td["response_mask"], td["action_mask"])
    assert td["attention_mask"].tolist() == [[True, True, False]]


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


# ------------------------------------------------------------------------------------------------ check


def _break(batch, key, value):
    batch = batch.clone()
    batch.set(key, value)  # TensorDict allows any trailing shape; check is what catches it
    return batch


BAD_BATCHES = {
    "missing key": (lambda b: b.exclude("prompt_mask"), "prompt_mask"),
    "wrong dtype": (lambda b: _break(b, "logprobs", b["logprobs"].double()), "logprobs must be .B, R. float32"),
    "wrong ndim": (lambda b: _break(b, "rewards", b["rewards"][:, None]), "rewards must be .B. float32"),
    "mask not bool": (lambda b: _break(b, "action_mask", b["action_mask"].long()), "action_mask must be .B, R. bool"),
    "P disagrees": (lambda b: _break(b, "prompt_mask", b["prompt_mask"][:, 1:]), "prompt_mask .* P=3 .from prompts"),
    "R disagrees": (lambda b: _break(b, "values", torch.zeros(3, 5)), "values .* R=4 .from responses"),
    "P+R disagrees": (lambda b: _break(b, "input_ids", b["input_ids"][:, 1:]), "input_ids .* P\\+R = 3\\+4"),
    "text as one list": (lambda b: _text_as_one_value(b), "response_text must hold one str per row"),
    "text as tensor": (lambda b: _break(b.exclude("prompt_text"), "prompt_text", torch.zeros(3)), "prompt_text must be a non-tensor"),
}


def _text_as_one_value(b):
    b = b.exclude("response_text")
    # a common mistake: set_non_tensor stores the whole list as one value broadcast to every row
    b.set_non_tensor("response_text", ["r0", "r1", "r2"])
    return b


@pytest.mark.parametrize("name", BAD_BATCHES)
def test_check_catches_shape_and_dtype_errors(batch, name):
    make, match = BAD_BATCHES[name]
    with pytest.raises(ValueError, match=match):
        rb.check(make(batch))


def test_check_batch_size_and_required(batch):
    with pytest.raises(ValueError, match="batch_size .B."):
        rb.check(TensorDict({"prompts": torch.zeros(2, 2, 3, dtype=torch.long)}, batch_size=[2, 2]))
    with pytest.raises(ValueError, match="missing required key 'advantages'"):
        rb.check(batch, required=("advantages",))
    with pytest.raises(ValueError, match="must be a TensorDict"):
        rb.check({"prompts": torch.zeros(1, 1)})
    # unknown keys are allowed
    rb.check(_break(batch, "old_values", torch.zeros(3, 9)), check_values=True)


def _set_at(batch, key, index, value):
    batch = batch.clone()
    batch.get(key)[index] = value
    return batch


BAD_VALUES = {
    "per-token nonzero off actions": (lambda b: _set_at(b, "logprobs", (1, 1), -0.5), "logprobs must be 0 where action_mask"),
    "action on padding": (lambda b: _set_at(b, "action_mask", (0, 3), True), "action_mask is True where response_mask"),
    "prompt right-padded": (lambda b: _set_at(b, "prompt_mask", (0, slice(None)), torch.tensor([True, True, False])), "prompt_mask must be left-padded"),
    "response left-padded": (lambda b: _set_at(b, "response_mask", (0, 3), True), "response_mask must be right-padded"),
    "input_ids stale": (lambda b: _set_at(b, "input_ids", (0, 3), 99), "input_ids must equal cat"),
    "attention_mask stale": (lambda b: _set_at(b, "attention_mask", (1, 4), False), "attention_mask must equal cat"),
    "group not contiguous": (lambda b: _break(b, "group", torch.tensor([0, 1, 0])), "group: rows of one group"),
    "loss on a tool token": (lambda b: _break(b, "loss_mask", b["response_mask"]), "loss_mask is True where action_mask"),
    "turn_index on padding": (lambda b: _break(b, "turn_index", torch.zeros(3, 4, dtype=torch.long)), "turn_index must be -1"),
    "turn_index -1 on a token": (lambda b: _break(b, "turn_index", torch.full((3, 4), -1)), "turn_index must be -1"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_check_values(batch, name):
    make, match = BAD_VALUES[name]
    bad = make(batch)
    rb.check(bad)  # shapes and dtypes are fine
    with pytest.raises(ValueError, match=match):
        rb.check(bad, check_values=True)


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
    assert out["prompts"].tolist() == [[1, 2], [0, 3], [0, 6]]
    assert out["prompt_mask"].tolist() == [[True, True], [False, True], [False, True]]
    assert out["responses"].tolist() == [[4, 0, 0], [5, 0, 0], [7, 8, 0]]
    assert out["action_mask"].tolist() == [[True, False, False], [True, False, False], [True, True, False]]
    assert torch.equal(out["response_mask"], out["action_mask"])
    assert torch.equal(out["logprobs"], torch.tensor([[-0.1, 0, 0], [-0.2, 0, 0], [-0.3, -0.4, 0]]))
    assert out["input_ids"].tolist() == [[1, 2, 4, 0, 0], [0, 3, 5, 0, 0], [0, 6, 7, 8, 0]]
    assert out["attention_mask"].tolist() == [
        [True, True, True, False, False],
        [False, True, True, False, False],
        [False, True, True, True, False],
    ]
    assert out["group"].tolist() == [0, 0, 1]  # b's group 0 is a different prompt from a's group 0
    assert texts(out, "response_text") == ["a0", "a1", "b0"]
    rb.check(out, required=rb.SCHEMA.keys() & out.keys(), check_values=True)


def episode_batch(gen, rows, prompt_len, response_len, group_size=2):
    """A random episode-like batch: per row a prompt of 1..P tokens and turns of action and observation
    tokens filling 1..R response tokens, with every per-token episode key (``turn_*``, ``loss_mask``)."""
    prompts, responses, actions, turns, lps, turn_rewards = [], [], [], [], [], []
    for _ in range(rows):
        n_p = int(torch.randint(1, prompt_len + 1, (), generator=gen))
        n_r = int(torch.randint(1, response_len + 1, (), generator=gen))
        prompts.append(torch.randint(3, 30, (n_p,), generator=gen))
        responses.append(torch.randint(3, 30, (n_r,), generator=gen))
        act = torch.rand(n_r, generator=gen) < 0.7
        act[0] = True  # a turn starts with an action token
        actions.append(act)
        turns.append(
            (act & ~torch.cat([torch.tensor([True]), act[:-1]])).cumsum(0)
        )  # new turn after an observation
        lps.append(torch.where(act, -torch.rand(n_r, generator=gen), 0.0))
        turn_rewards.append(torch.where(act, torch.randn(n_r, generator=gen).round(), 0.0))
    real = rb.pad_right([torch.ones(len(r), dtype=torch.bool) for r in responses], False, response_len)
    action_mask = rb.pad_right(actions, False, response_len)
    truncated = torch.rand(rows, generator=gen) < 0.3
    return rb.build_batch(
        rb.pad_left(prompts, PAD, prompt_len),
        rb.pad_left([torch.ones(len(p), dtype=torch.bool) for p in prompts], False, prompt_len),
        rb.pad_right(responses, PAD, response_len),
        action_mask,
        response_mask=real,
        loss_mask=action_mask & ~truncated[:, None],
        logprobs=rb.pad_right(lps, 0.0, response_len),
        turn_rewards=rb.pad_right(turn_rewards, 0.0, response_len),
        turn_index=rb.pad_right(turns, -1, response_len),
        rewards=torch.stack([t.sum() for t in turn_rewards]),
        num_turns=torch.tensor([int(t.max()) + 1 for t in turns]),
        truncated=truncated,
        group=rb.group_ids(rows // group_size, group_size),
        stop_reason=["done" if i % 2 else "max_turns" for i in range(rows)],
        prompt_text=[f"p{i}" for i in range(rows)],
        response_text=[f"r{i}" for i in range(rows)],
        extra=torch.arange(rows),  # a per-row key outside SCHEMA
    )


def collate_reference(batches, pad_token_id):
    """``collate`` with Python lists, row by row: prompt-side lists left-padded, response-side lists
    right-padded with each key's fill, groups renumbered per batch."""
    P = max(b["prompts"].shape[1] for b in batches)
    R = max(b["responses"].shape[1] for b in batches)
    fill = {"prompts": pad_token_id, "responses": pad_token_id, "turn_index": -1}
    out, next_group = {}, 0
    for b in batches:
        p = b["prompts"].shape[1]
        for i in range(b.batch_size[0]):
            for key in b.keys():
                value = b.get(key)
                if key in rb.SCHEMA and rb.SCHEMA[key].dtype is str:
                    row = value.tolist()[i]
                elif key in ("input_ids", "attention_mask"):
                    head, tail = value[i, :p].tolist(), value[i, p:].tolist()
                    pad = pad_token_id if key == "input_ids" else False
                    row = [pad] * (P - len(head)) + head + tail + [pad] * (R - len(tail))
                elif value.dim() == 2 and value.shape[1] == p and key.startswith("prompt"):
                    row = [fill.get(key, False)] * (P - p) + value[i].tolist()
                elif value.dim() == 2:
                    row = value[i].tolist()
                    row = row + [fill.get(key, 0)] * (R - len(row))
                else:
                    row = value[i].item()
                out.setdefault(key, []).append(row)
        groups = b["group"].tolist()
        out["group"][-len(groups) :] = [next_group + g - groups[0] for g in groups]  # contiguous, from 0
        next_group += groups[-1] - groups[0] + 1
    return out


@pytest.mark.parametrize("seed", range(4))
def test_collate_repads_episode_batches_like_a_row_by_row_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 3, 5), (2, 5, 2), (6, 1, 7), (2, 2, 1)][: 2 + seed % 3]
    batches = [episode_batch(gen, *shape) for shape in shapes]
    out = rb.collate(batches, pad_token_id=PAD)
    rb.check(out, required=rb.SCHEMA.keys() - {"ref_logprobs", "entropy", "values", "token_rewards",
             "advantages", "returns", "reference_rewards", "retokenized", "old_logprobs",
             "rollout_is_weights", "reward_baselines", "ref_logps", "policy_version", "token_version"}, check_values=True)
    expected = collate_reference(batches, PAD)
    assert set(out.keys()) == set(expected)
    for key, rows in expected.items():
        got = out.get(key).tolist()
        assert got == rows, key
    assert out["turn_index"].dtype == torch.int64 and out["loss_mask"].dtype == torch.bool
    assert_same_batch(rb.trim_padding(out[: batches[0].batch_size[0]]), rb.trim_padding(batches[0]))


def test_collate_renumbers_groups_and_undoes_split(batch):
    parts = rb.split_microbatches(batch, 2)
    assert_same_batch(rb.collate(parts), batch)  # same lengths: no pad_token_id needed
    g = rb.collate([batch, batch])["group"]
    assert g.tolist() == [0, 0, 1, 2, 2, 3]


def test_collate_errors(batch):
    short = rb.trim_padding(batch)  # R shrinks from 4 to 3
    with pytest.raises(ValueError, match="needs pad_token_id to pad responses"):
        rb.collate([batch, short])
    with pytest.raises(ValueError, match="different keys: \\['rewards'\\]"):
        rb.collate([batch, batch.exclude("rewards")])
    with pytest.raises(ValueError, match="cannot pad 'extra'"):
        rb.collate([_break(batch, "extra", torch.zeros(3, 2)), _break(batch, "extra", torch.zeros(3, 1))])
    with pytest.raises(ValueError, match="at least one batch"):
        rb.collate([])


# ----------------------------------------------------------------------------------------------- splits


def test_split_microbatches_round_trip_and_views(batch):
    parts = rb.split_microbatches(batch, 2)
    assert [p.batch_size[0] for p in parts] == [2, 1]
    assert_same_batch(torch.cat(parts), batch)
    assert texts(parts[1], "response_text") == ["r2"]
    parts[1]["rewards"][0] = 7.0  # a view: writes reach the batch
    assert batch["rewards"][2] == 7.0
    assert len(rb.split_microbatches(batch, 10)) == 1
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        rb.split_microbatches(batch, 0)


def test_split_microbatches_sort_by_length_groups_similar_rows():
    # rows of real lengths (prompt + response) 5, 2, 4, 2, 3: sorted (stable) -> rows 1, 3, 4, 2, 0
    prompts = make_prompts([[1, 2], [3], [4, 5, 6], [7], [8]], pad_token_id=PAD)
    responses = torch.tensor([[9, 9, 9], [9, 0, 0], [9, 0, 0], [9, 0, 0], [9, 9, 0]])
    mask = responses != 0
    td = rb.build_batch(
        prompts["prompts"], prompts["prompt_mask"], responses, mask, rewards=torch.arange(5.0)
    )
    parts = rb.split_microbatches(td, 2, sort_by_length=True)
    assert [p["rewards"].tolist() for p in parts] == [[1.0, 3.0], [4.0, 2.0], [0.0]]
    assert [p["attention_mask"].sum(1).tolist() for p in parts] == [[2, 2], [3, 4], [5]]
    # one microbatch: nothing to sort, still the views of the batch
    assert_same_batch(rb.split_microbatches(td, 5, sort_by_length=True)[0], td)
    with pytest.raises(ValueError, match="sort_by_length needs 'attention_mask'"):
        rb.split_microbatches(TensorDict(x=torch.zeros(3), batch_size=[3]), 1, sort_by_length=True)


def _grouped(num_groups, group_size):
    prompts = make_prompts([[i + 1] for i in range(num_groups)], pad_token_id=PAD)
    prompts.set("prompt_text", NonTensorStack.from_list([f"p{i}" for i in range(num_groups)]))
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
            g = m["group"][start].item()
            assert m["row"][start : start + 3].tolist() == [3 * g, 3 * g + 1, 3 * g + 2]
            assert m["prompts"][start : start + 3, 0].tolist() == [g + 1] * 3
            assert texts(m, "prompt_text")[start : start + 3] == [f"p{g}"] * 3
    again = rb.split_minibatches(td, 2, generator=torch.Generator().manual_seed(1))
    assert [m["row"].tolist() for m in again] == [m["row"].tolist() for m in mbs]
    orders = {
        tuple(torch.cat([m["row"] for m in rb.split_minibatches(td, 2, generator=torch.Generator().manual_seed(s))]).tolist())
        for s in range(5)
    }
    assert len(orders) > 1  # the seed matters


def test_split_minibatches_by_size_and_by_rows():
    td = _grouped(num_groups=4, group_size=2)
    gen = torch.Generator().manual_seed(0)
    mbs = rb.split_minibatches(td, minibatch_size=6, generator=gen)
    assert [m.batch_size[0] for m in mbs] == [6, 2]
    for m in mbs:
        assert (m["group"][0::2] == m["group"][1::2]).all()
    rows = rb.split_minibatches(td, minibatch_size=3, generator=gen, keep_groups=False)
    assert [m.batch_size[0] for m in rows] == [3, 3, 2]
    assert sorted(torch.cat([m["row"] for m in rows]).tolist()) == list(range(8))
    # no group key: one unit per row
    assert len(rb.split_minibatches(td.exclude("group"), 8, generator=gen)) == 8


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
    td = make_prompts([[5, 6], [7]], pad_token_id=PAD)
    td.set("prompt_text", NonTensorStack.from_list(["a", "b"]))
    out = rb.repeat_interleave_prompts(td, 2)
    assert out.batch_size == (4,)
    assert out["prompts"].tolist() == [[5, 6], [5, 6], [0, 7], [0, 7]]
    assert out["prompt_mask"].tolist() == [[True, True]] * 2 + [[False, True]] * 2
    assert out["group"].tolist() == [0, 0, 1, 1]
    assert texts(out, "prompt_text") == ["a", "a", "b", "b"]
    rb.check(out, check_values=True)
    with pytest.raises(ValueError, match="group_size"):
        rb.repeat_interleave_prompts(td, 0)


# ------------------------------------------------------------------------------------------------- trim


def test_trim_padding(batch):
    # the fixture's last response column is padding in every row; prompts use all 3 columns in row 1
    out = rb.trim_padding(batch)
    assert out["prompts"].shape == (3, 3) and out["responses"].shape == (3, 3)
    assert out["responses"].tolist() == [[21, 22, 0], [23, 9, 24], [25, 0, 0]]
    assert out["input_ids"].tolist() == [
        [0, 11, 12, 21, 22, 0],
        [13, 14, 15, 23, 9, 24],
        [0, 0, 16, 25, 0, 0],
    ]
    for key in ("action_mask", "response_mask", "logprobs"):
        assert torch.equal(out[key], batch[key][:, :3]), key
    assert torch.equal(out["attention_mask"], batch["attention_mask"][:, :6])
    assert torch.equal(out["rewards"], batch["rewards"])
    assert texts(out, "response_text") == ["r0", "r1", "r2"]
    assert out["prompts"]._base is not None  # a view, no copy
    rb.check(out, check_values=True)

    # rows 0 and 2 alone: P 3 -> 2 (column 0 is padding in both), R 4 -> 2
    two = rb.trim_padding(batch[torch.tensor([0, 2])])
    assert two["prompts"].tolist() == [[11, 12], [0, 16]]
    assert two["prompt_mask"].tolist() == [[True, True], [False, True]]
    assert two["responses"].tolist() == [[21, 22], [25, 0]]
    assert two["logprobs"].tolist() == [[-1.0, -1.0], [-1.0, 0.0]]
    assert two["input_ids"].tolist() == [[11, 12, 21, 22], [0, 16, 25, 0]]
    assert two["attention_mask"].tolist() == [[True, True, True, True], [False, True, True, False]]
    assert texts(two, "response_text") == ["r0", "r2"]
    rb.check(two, check_values=True)


def test_trim_padding_undoes_collate_padding(batch):
    trimmed = rb.trim_padding(batch)
    wider = rb.build_batch(
        torch.tensor([[0, 0, 0, 1]]), torch.tensor([[False, False, False, True]]),
        torch.tensor([[2, 0, 0, 0, 0]]), torch.tensor([[True, False, False, False, False]]),
        logprobs=torch.zeros(1, 5), rewards=torch.zeros(1), group=torch.tensor([0]),
        prompt_text=["x"], response_text=["y"],
    )
    padded = rb.collate([trimmed, wider], pad_token_id=PAD)[:3]
    assert padded["prompts"].shape == (3, 4) and padded["responses"].shape == (3, 5)
    assert_same_batch(rb.trim_padding(padded), trimmed)
