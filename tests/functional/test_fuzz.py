"""Property-based bad-input tests (hypothesis): malformed configs, tensors, batches and reward outputs.

Every test throws generated inputs at a public entry point and accepts exactly two outcomes: a correct
result, or a clear error (``ValueError``/``TypeError`` and their subclasses ``ConfigError``,
``InvalidRewardError``; ``RewardError`` for a failing reward source) whose message names the offending
argument, field or sample. Anything else (IndexError, KeyError, AttributeError, an aten RuntimeError, a
silently wrong result) fails the test. ``python -m pytest tests/functional/test_fuzz.py --hypothesis-show-statistics``
prints how many inputs each test tried (60 per test under the CI profile of conftest.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import types
import typing

import numpy as np
import pytest
import torch
from http_support import fake_server
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import rlbits
from rlbits.loops.api import LOOPS, config_class, resolve_config
from rlbits.loops.config import ConfigError, config_from_dict, parse_overrides
from rlbits.rollout.score import InvalidRewardError, RewardError, check_rewards, score, score_texts

CLEAR = (ValueError, TypeError)

# --------------------------------------------------------------------------------------------------------
# (a) configs
# --------------------------------------------------------------------------------------------------------

CONFIG_CLASSES = {name: config_class(name) for name in LOOPS}
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.5, 0.5, 1.0, 1.5, float("nan"), float("inf")]),
    st.text(max_size=12),
    st.sampled_from(["ppo", "k3", "token-mean", "rloo", "cpu", "auto", "1e-5", "", "policy"]),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _fields(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


@st.composite
def config_dicts(draw, loop: str):
    """A dict of known keys (mostly) and unknown keys with values of any type."""
    fields = list(_fields(CONFIG_CLASSES[loop]))
    keys = draw(st.lists(st.one_of(st.sampled_from(fields), st.text(min_size=1, max_size=10)), max_size=5))
    values = {k: draw(JUNK) for k in keys}
    values["loop"] = loop
    return values


def _field_ok(value, tp) -> bool:
    """Whether a config may hold ``value`` for a field annotated ``tp`` (finite numbers, exact types)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_field_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is float:
        return isinstance(value, float) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):  # list[str] (lora_target_modules): the container, then each element
        return isinstance(value, origin) and all(_field_ok(v, typing.get_args(tp)[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


@pytest.mark.parametrize("loop", sorted(LOOPS))
@settings(max_examples=150)
@given(data=st.data())
def test_config_dicts_give_a_valid_config_or_a_clear_error(loop, data):
    values = data.draw(config_dicts(loop))
    cls = CONFIG_CLASSES[loop]
    try:
        cfg = config_from_dict(cls, values)
    except ConfigError as e:
        named = [k for k in values if k in str(e)]
        assert named, f"ConfigError names no key of {values}: {e}"
        return
    hints = _fields(cls)
    for key, value in values.items():
        got = getattr(cfg, key)
        assert got == value or (isinstance(value, float) and math.isnan(value) and math.isnan(got)) or (
            isinstance(value, (str, int)) and not isinstance(value, bool) and got == float(value)
        ), f"{key}: given {value!r}, config holds {got!r}"
    bad = {f: getattr(cfg, f) for f in hints if f in values and not _field_ok(getattr(cfg, f), hints[f])}
    assert not bad, f"config accepted out-of-type or non-finite values {bad}"


# Every float field: NaN and inf (max_grad_norm may be inf) and negative coefficients are ConfigErrors.
BAD_FLOAT_CASES = [
    (loop, name, text)
    for loop in sorted(LOOPS)
    for name in ("temperature", "learning_rate", "weight_decay", "max_grad_norm", "clip_eps", "kl_coef",
                 "kl_loss_coef", "critic_learning_rate", "dataset_temperature")
    if name in _fields(CONFIG_CLASSES[loop])
    for text in ("nan", "inf", "-1")
    if not (name == "max_grad_norm" and text in ("-1", "inf"))  # documented: <= 0 disables clipping
]


@pytest.mark.parametrize("loop,name,text", BAD_FLOAT_CASES)
def test_non_finite_or_negative_float_fields_are_rejected(loop, name, text):
    with pytest.raises(ConfigError, match=name):
        config_from_dict(CONFIG_CLASSES[loop], {"loop": loop, name: float(text)})


@pytest.mark.parametrize("key", [1, None, 2.5], ids=["int", "null", "float"])
def test_non_string_yaml_keys_are_a_config_error(key, tmp_path):
    """A YAML file such as ``1: 2`` or ``null: 3`` holds non-str keys; they must be a ConfigError."""
    with pytest.raises(ConfigError, match="key"):
        resolve_config({"loop": "ppo", key: 2})


def test_an_int_too_large_for_a_float_field_is_a_config_error():
    with pytest.raises(ConfigError, match="kl_coef"):
        resolve_config({"loop": "ppo", "kl_coef": 10**400})  # YAML reads a 400-digit number as an int


def test_a_seed_torch_cannot_take_is_a_config_error():
    with pytest.raises(ConfigError, match="seed"):
        resolve_config({"loop": "ppo", "seed": 2**70})


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_impossible_sizes_are_config_errors(loop):
    cls = CONFIG_CLASSES[loop]
    cases = [({"num_prompts_per_step": 0}, "num_prompts_per_step"), ({"microbatch_size": 0}, "microbatch_size"),
             ({"max_new_tokens": 0}, "max_new_tokens"), ({"num_generations_per_prompt": 0}, "num_generations_per_prompt")]
    if "num_minibatches" in _fields(cls):
        cases.append(({"num_prompts_per_step": 2, "num_minibatches": 3}, "num_minibatches"))
    if loop == "reinforce":
        cases.append(({"num_generations_per_prompt": 1, "adv_estimator": "rloo"}, "num_generations_per_prompt"))
    for values, field in cases:
        with pytest.raises(ConfigError, match=field):
            config_from_dict(cls, {"loop": loop, **values})


OVERRIDE_VALUES = st.one_of(
    st.sampled_from(["1", "-3", "0", "1e-5", "1.5", ".nan", ".inf", "nan", "true", "no", "null", "~", "[1, 2]",
                     "{a: 1}", "'x'", "\"", "[1", "{", "!!python/name:os.system", "!!binary aGk=", "a: b",
                     "k3", "token-mean", "ppo", "ilql", "-", "=", "", " "]),
    st.text(max_size=8),
)


@settings(max_examples=100)
@given(
    pairs=st.lists(
        st.tuples(st.one_of(st.sampled_from(sorted(_fields(CONFIG_CLASSES["ppo"]))), st.text(max_size=6)),
                  OVERRIDE_VALUES),
        min_size=1, max_size=4,
    )
)
def test_cli_overrides_give_exit_2_naming_the_key_or_a_valid_config(pairs):
    """``rlbits train k=v ...``: exit 2 and a message naming a key, or a config whose values are the YAML
    of each override (training itself is replaced by a stub)."""
    import io

    import rlbits.loops.api as api
    from rlbits.cli import main

    seen = []
    args = [f"{k}={v}" for k, v in pairs]
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(api, "train", lambda config, resume, force=False: seen.append(config) or "stub")
        try:
            rc = main(["train", *args])
        except SystemExit as e:  # argparse: an argument it cannot parse (e.g. one starting with '-')
            assert e.code == 2
            return
    err = err.getvalue()
    if rc == 2:
        assert err.startswith("rlbits train: "), err
        named = any(repr(k.strip()) in err or (k.strip() and k.strip() in err) for k, _ in pairs) or any(
            repr(a) in err for a in args
        )
        assert named or "not of the form key=value" in err or "loop must be" in err, err
        return
    assert rc == 0 and len(seen) == 1
    for key, value in parse_overrides(args).items():
        got = getattr(seen[0], key)
        assert _same(got, value), (key, value, got)


def _same(got, value) -> bool:
    """A config field holds the override's value (a float field holds float(value); NaN equals NaN)."""
    if got == value:
        return True
    if isinstance(got, float):
        f = float(value)
        return got == f or (math.isnan(got) and math.isnan(f))
    return False


# --------------------------------------------------------------------------------------------------------
# (b) tensors into the functional API
# --------------------------------------------------------------------------------------------------------

# name -> (function, [(arg, kind)], extra kwargs). kinds: f = float [B, R], m = bool mask [B, R], r = float
# [B], l = float logits [B, R, V], t = int64 tokens [B, R].
KERNELS = {
    "masked_mean": (rlbits.masked_mean, [("x", "f"), ("mask", "m")], {}),
    "masked_sum": (rlbits.masked_sum, [("x", "f"), ("mask", "m")], {}),
    "masked_var": (rlbits.masked_var, [("x", "f"), ("mask", "m")], {}),
    "masked_whiten": (rlbits.masked_whiten, [("x", "f"), ("mask", "m")], {}),
    "kl_penalty": (rlbits.kl_penalty, [("logprobs", "f"), ("ref_logprobs", "f")], {"estimator": "k3"}),
    "token_rewards": (rlbits.token_rewards, [("rewards", "r"), ("action_mask", "m"), ("kl", "f")], {"kl_coef": 0.1}),
    "gae": (rlbits.gae, [("token_rewards", "f"), ("values", "f"), ("action_mask", "m")], {"gamma": 0.9, "lam": 0.8}),
    "ppo_loss": (rlbits.ppo_loss, [("logprobs", "f"), ("old_logprobs", "f"), ("advantages", "f"), ("action_mask", "m")], {}),
    "reinforce_loss": (rlbits.reinforce_loss, [("logprobs", "f"), ("advantages", "f"), ("action_mask", "m")], {}),
    "value_loss": (rlbits.value_loss, [("values", "f"), ("old_values", "f"), ("returns", "f"), ("action_mask", "m")], {"clip_eps": 0.2}),
    "aggregate_loss": (rlbits.aggregate_loss, [("per_token", "f"), ("action_mask", "m")], {"agg": "seq-mean-token-mean"}),
    "ilql_targets": (rlbits.ilql_targets, [("token_rewards", "f"), ("values", "f"), ("action_mask", "m")], {"gamma": 0.9}),
    "q_loss": (rlbits.q_loss, [("q_values", "f"), ("targets", "f"), ("action_mask", "m")], {}),
    "expectile_loss": (rlbits.expectile_loss, [("values", "f"), ("target_q", "f"), ("action_mask", "m")], {"tau": 0.7}),
    "cql_loss": (rlbits.cql_loss, [("q_logits", "l"), ("actions", "t"), ("action_mask", "m")], {}),
    "awac_loss": (rlbits.awac_loss, [("logits", "l"), ("actions", "t"), ("action_mask", "m")], {}),
}
PER_TOKEN = {"masked_whiten", "kl_penalty", "token_rewards", "gae", "ilql_targets"}  # [B, R] outputs; others 0-dim
DEFECTS = ("none", "ndim", "size", "int", "bool", "list", "none_value", "nan")


def _make(kind: str, b: int, r: int, v: int, gen: torch.Generator, dtype) -> torch.Tensor:
    if kind == "f":
        return torch.randn(b, r, generator=gen).to(dtype)
    if kind == "r":
        return torch.randn(b, generator=gen).to(dtype)
    if kind == "m":
        return torch.rand(b, r, generator=gen) > 0.3
    if kind == "l":
        return torch.randn(b, r, v, generator=gen).to(dtype)
    return torch.randint(0, v, (b, r), generator=gen)


def _spoil(t: torch.Tensor, kind: str, defect: str):
    if defect == "ndim":
        return t[..., None] if t.dim() < 3 else t[..., 0]
    if defect == "size":
        return torch.cat([t, t[:1]], dim=0) if t.shape[0] else torch.zeros((1, *t.shape[1:]), dtype=t.dtype)
    if defect == "int":
        return t.round().long() if t.is_floating_point() else t.long()
    if defect == "bool":
        return t > 0 if t.is_floating_point() else t.bool()
    if defect == "list":
        return t.tolist()
    if defect == "none_value":
        return None
    if defect == "nan" and t.is_floating_point() and t.numel():
        t = t.clone()
        t.view(-1)[0] = float("nan")
    return t


@settings(max_examples=500)  # ~2 ms each: 16 kernels x 8 defects x shapes x dtypes
@given(
    name=st.sampled_from(sorted(KERNELS)),
    b=st.integers(0, 4),
    r=st.integers(0, 5),
    v=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    spoiled=st.integers(0, 3),
    defect=st.sampled_from(DEFECTS),
    seed=st.integers(0, 2**16),
)
def test_kernels_give_a_correct_shape_or_a_clear_error(name, b, r, v, dtype, spoiled, defect, seed):
    fn, spec, kwargs = KERNELS[name]
    gen = torch.Generator().manual_seed(seed)
    args = {arg: _make(kind, b, r, v, gen, dtype) for arg, kind in spec}
    arg, kind = spec[spoiled % len(spec)]
    args[arg] = _spoil(args[arg], kind, defect)
    try:
        out = fn(**args, **kwargs)
    except CLEAR as e:
        assert defect not in ("none", "nan"), f"{name} rejected valid input: {e}"
        assert any(a in str(e) for a, _ in spec), f"{name}: the error names no argument: {e}"
        return
    assert defect not in ("ndim", "size", "list", "none_value") or (defect == "none_value" and arg == "kl"), (
        f"{name} accepted {arg} with defect {defect!r}"
    )
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        if isinstance(o, dict):
            for k, m in o.items():
                assert isinstance(m, torch.Tensor) and m.dim() == 0, k
            continue
        assert isinstance(o, torch.Tensor) and o.is_floating_point(), f"{name} returned {type(o)} {getattr(o, 'dtype', '')}"
        if defect == "none":
            assert tuple(o.shape) == ((b, r) if name in PER_TOKEN else ()), f"{name}: shape {tuple(o.shape)}"
            finite = torch.isfinite(o.float()).all()
            assert finite or name == "masked_var", f"{name} returned non-finite values on finite input"


@given(
    b=st.integers(0, 9),
    k=st.one_of(st.integers(-2, 5), st.sampled_from([True, 2.0, "2", None, np.int64(2)])),
    fn=st.sampled_from(["rloo_baseline", "group_normalize"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
)
def test_group_sizes_that_do_not_divide_b_are_clear_errors(b, k, fn, dtype):
    rewards = torch.arange(b).to(dtype)
    valid = isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 2 and b % k == 0
    try:
        out = getattr(rlbits, fn)(rewards, group_size=k)
    except CLEAR as e:
        assert not valid or dtype == torch.int64, f"{fn}(B={b}, K={k}) rejected valid input: {e}"
        assert "group_size" in str(e) or "rewards" in str(e), e
        return
    assert valid, f"{fn} accepted B={b}, group_size={k!r}"
    assert out.shape == (b,) and out.is_floating_point(), (out.shape, out.dtype)


@settings(max_examples=150)
@given(
    fn=st.sampled_from(["gae", "ilql_targets", "ppo_loss", "value_loss", "expectile_loss", "kl_penalty",
                        "aggregate_loss", "token_rewards", "ilql_logits"]),
    value=st.sampled_from([float("nan"), float("inf"), -1.0, -0.1, 1.5, 0.0, "0.5", None]),
)
def test_bad_hyperparameters_are_clear_errors(fn, value):
    """gamma/lam/tau/clip ranges/estimator/agg/beta/kl_coef that make no sense raise a ValueError naming it."""
    x = torch.randn(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    calls = {
        "gae": lambda: [("gamma", lambda: rlbits.gae(x, x, m, gamma=value)), ("lam", lambda: rlbits.gae(x, x, m, lam=value))],
        "ilql_targets": lambda: [("gamma", lambda: rlbits.ilql_targets(x, x, m, gamma=value))],
        "ppo_loss": lambda: [("clip_eps", lambda: rlbits.ppo_loss(x, x, x, m, clip_eps=value)),
                             ("dual_clip", lambda: rlbits.ppo_loss(x, x, x, m, dual_clip=value))],
        "value_loss": lambda: [("clip_eps", lambda: rlbits.value_loss(x, x, x, m, clip_eps=value))],
        "expectile_loss": lambda: [("tau", lambda: rlbits.expectile_loss(x, x, m, tau=value))],
        "kl_penalty": lambda: [("estimator", lambda: rlbits.kl_penalty(x, x, estimator=value))],
        "aggregate_loss": lambda: [("agg", lambda: rlbits.aggregate_loss(x, m, agg=value))],
        "token_rewards": lambda: [("kl_coef", lambda: rlbits.token_rewards(x[:, 0], m, x, kl_coef=value))],
        "ilql_logits": lambda: [("beta", lambda: rlbits.ilql_logits(torch.randn(2, 3, 4), torch.randn(2, 3, 4), x, beta=value))],
    }[fn]()
    ranges = {"gamma": (0, 1), "lam": (0, 1), "tau": (0, 1), "clip_eps": (0, math.inf), "dual_clip": (1, math.inf),
              "kl_coef": (-math.inf, math.inf), "beta": (-math.inf, math.inf)}
    for param, call in calls:
        if param in ("estimator", "agg"):
            valid = False
        elif value is None:
            valid = param in ("dual_clip", "clip_eps") and fn in ("ppo_loss", "value_loss") and not (
                fn == "ppo_loss" and param == "clip_eps"
            )
        elif isinstance(value, str):
            valid = False
        else:
            lo, hi = ranges[param]
            valid = math.isfinite(value) and lo <= value <= hi
            if param == "tau":
                valid = valid and 0 < value < 1
            if param == "dual_clip":
                valid = valid and value > 1
            if param == "clip_eps" and fn == "value_loss":
                valid = valid and value > 0
        try:
            out = call()
        except CLEAR as e:
            assert not valid, f"{fn}({param}={value!r}) rejected a valid value: {e}"
            assert param in str(e), f"{fn}({param}={value!r}): the error does not name {param}: {e}"
            continue
        assert valid, f"{fn} accepted {param}={value!r}"
        del out


# --------------------------------------------------------------------------------------------------------
# (c) reward outputs and batches into score
# --------------------------------------------------------------------------------------------------------

NUMBER = st.one_of(
    st.floats(-1e6, 1e6),
    st.integers(-5, 5),
    st.booleans(),
)
BAD_VALUE = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e39, 10**400, None, "0.5", "", b"1",
                     [0.5], [[1.0]], {"r": 1}, complex(1, 1), object(), np.float64("nan"), torch.tensor([1.0]),
                     torch.tensor(float("inf")), np.array([1.0, 2.0])]),
    st.text(max_size=4),
)


@st.composite
def reward_outputs(draw, n: int):
    """(output, why it is bad or None, index of the first bad sample or None)."""
    kind = draw(st.sampled_from(["ok", "bad_value", "length", "container", "tensor_shape", "raise"]))
    values = draw(st.lists(NUMBER, min_size=n, max_size=n))
    if kind == "ok":
        wrap = draw(st.sampled_from([list, tuple, "tensor", "numpy"]))
        if wrap == "tensor":
            return torch.tensor([float(v) for v in values]), None, None
        if wrap == "numpy":
            return np.array([float(v) for v in values]), None, None
        return wrap(values), None, None
    if kind == "bad_value" and n:
        i = draw(st.integers(0, n - 1))
        values[i] = draw(BAD_VALUE)
        return values, "value", i
    if kind == "length":
        extra = draw(st.sampled_from([-1, 1, 3])) if n else draw(st.sampled_from([1, 2]))
        m = max(0, n + extra)
        assume(m != n)
        return draw(st.lists(NUMBER, min_size=m, max_size=m)), "length", None
    if kind == "container":
        return draw(st.sampled_from([None, 0.5, "0.5", {"rewards": values}, set(), iter(values)])), "container", None
    if kind == "tensor_shape":
        return torch.zeros(n, 1) if draw(st.booleans()) else torch.zeros(()), "shape", None
    return draw(st.sampled_from([ValueError("bad"), KeyError("answer"), ZeroDivisionError(), RuntimeError("x")])), "raise", None


@settings(max_examples=200)
@given(data=st.data(), n=st.integers(0, 5))
def test_reward_outputs_are_validated_and_the_sample_is_named(data, n):
    prompts = [f"p{i}" for i in range(n)]
    responses = [f"r{i}" for i in range(n)]
    out, bad, index = data.draw(reward_outputs(n))

    def reward(p, r):
        if isinstance(out, Exception):
            raise out
        return out

    try:
        got = score_texts(prompts, responses, reward)
    except RewardError as e:
        assert n > 0, f"an empty batch must call nothing and score nothing: {e}"
        assert bad is not None, f"valid output {out!r} rejected: {e}"
        if bad == "raise":
            assert "sample" in str(e) and e.__cause__ is out, e
        elif bad == "value":
            assert f"sample {index} (prompt='p{index}', response='r{index}')" in str(e), e
        elif bad == "length":
            assert f"expected {n}" in str(e), e
        else:
            assert "expected" in str(e), e
        return
    if n == 0:  # nothing to score: the reward is not called
        assert got.shape == (0,)
        return
    assert bad is None or (bad == "value" and _numeric_ok(out[index])), f"accepted bad output {out!r} ({bad})"
    assert got.dtype == torch.float32 and got.shape == (n,)
    expected = torch.tensor([float(v) for v in (out.tolist() if hasattr(out, "tolist") else out)], dtype=torch.float32)
    assert torch.equal(got, expected)


def _numeric_ok(v) -> bool:
    try:
        return math.isfinite(float(v)) and abs(float(v)) < 3.4e38 and not isinstance(v, (str, bytes))
    except (TypeError, ValueError, OverflowError):
        return False


@settings(max_examples=150)
@given(
    n=st.integers(0, 4),
    texts=st.sampled_from(["ok", "missing", "short", "not_str", "nested"]),
    columns=st.sampled_from([None, "ok", "short", "scalar", "reserved", "not_mapping"]),
)
def test_score_rejects_malformed_batches_with_the_key_named(n, texts, columns):
    prompts = [f"p{i}" for i in range(n)]
    td = TensorDict({"x": torch.zeros(n)}, batch_size=[n])
    if texts != "missing":
        td["prompt_text"] = prompts  # one str per row (a NonTensorStack), as rlbits.text.decode writes them
        if texts == "ok":
            td["response_text"] = [f"r{i}" for i in range(n)]
        else:  # set_non_tensor stores ONE object for the whole batch: a plausible misuse
            bad = {"short": prompts[:-1] if n else ["x"], "not_str": list(range(n)),
                   "nested": [[p] for p in prompts]}[texts]
            td.set_non_tensor("response_text", bad)
    cols = {None: None, "ok": {"answer": list(range(n))}, "short": {"answer": list(range(n + 1))},
            "scalar": {"answer": 3}, "reserved": {"prompts": list(range(n))}, "not_mapping": [1]}[columns]
    try:
        got = score(td, lambda p, r, **kw: [len(x) for x in r], columns=cols)
    except CLEAR as e:
        assert texts != "ok" or columns not in (None, "ok"), f"valid batch rejected: {e}"
        assert any(w in str(e) for w in ("prompt_text", "response_text", "columns", "answer", "prompts")), e
        return
    assert got.shape == (n,)
    assert n == 0 or (texts == "ok" and columns in (None, "ok")), f"accepted texts={texts} columns={columns} (n={n})"


def test_check_rewards_overflowing_ints_are_named():
    with pytest.raises(InvalidRewardError, match=r"sample 1 \(prompt='b'"):
        check_rewards([0.5, 10**400], ["a", "b"], ["c", "d"])


# --------------------------------------------------------------------------------------------------------
# (c) reward-server answers
# --------------------------------------------------------------------------------------------------------


ANSWERS = st.one_of(
    st.tuples(st.sampled_from([200]), st.sampled_from([
        b"", b"null", b"[]", b"{}", b"not json", b"\xff\xfe", b'{"rewards": null}', b'{"rewards": {}}',
        b'{"rewards": [1]}', b'{"rewards": [1, 2, 3]}', b'{"rewards": [1, "2"]}', b'{"rewards": [1, [2]]}',
        b'{"rewards": [1, NaN]}', b'{"rewards": [1, Infinity]}', b'{"rewards": [1, 1e999]}',
        b'{"rewards": [1, 1' + b"0" * 400 + b"]}", b'{"rewards": [true, 1]}', b'{"rewards": [1, null]}',
        b'{"rewards": [0.25, -3]}', b'{"rewards": [0.25, -3], "extra": 1}',
    ])),
    st.tuples(st.sampled_from([200]), st.binary(max_size=20)),
    st.tuples(st.sampled_from([400, 401, 404, 413, 500, 502, 503]),
              st.sampled_from([b'{"error": "nope"}', b"", b"<html>", b'{"error": 3}'])),
)


@settings(max_examples=40)
@given(answer=ANSWERS)
def test_malformed_server_answers_are_rejected_clearly(answer):
    from rlbits.rollout.reward_server import RewardClient
    from rlbits.rollout.score import RewardServerError

    status, body = answer
    with fake_server(lambda state: (status, body), poll_interval=0.02) as (url, state):
        client = RewardClient(url, retries=1, backoff=0.0, timeout=5)
        try:
            got = score_texts(["a", "b"], ["c", "d"], client)
        except RewardServerError as e:
            assert url in str(e), e
            if status >= 500:
                assert state["count"] == 2  # retried once
            else:
                assert state["count"] == 1
            return
        except InvalidRewardError as e:  # non-finite numbers: named by score
            assert "sample 1 (prompt='b', response='d')" in str(e), e
            return
    assert status == 200, f"HTTP {status} accepted"
    data = json.loads(body)
    assert got.tolist() == [float(x) for x in data["rewards"]]


def test_slow_server_times_out_quickly_and_names_the_url():
    import time

    from rlbits.rollout.reward_server import RewardClient
    from rlbits.rollout.score import RewardServerError

    def slow(state):
        state["release"].wait(5)
        return 200, b'{"rewards": [1, 2]}'

    with fake_server(slow, poll_interval=0.02) as (url, _):
        t0 = time.perf_counter()
        with pytest.raises(RewardServerError, match=rf"{url}.*timed out"):
            score_texts(["a", "b"], ["c", "d"], RewardClient(url, timeout=0.3, retries=2))
        assert time.perf_counter() - t0 < 2.0  # a timeout is not retried


def test_oversized_answer_is_rejected(monkeypatch):
    import rlbits.rollout.reward_client as rc
    from rlbits.rollout.score import RewardServerError

    monkeypatch.setattr(rc, "_MAX_RESPONSE_BYTES", 1000)
    body = json.dumps({"rewards": [0.5, 0.5], "pad": "x" * 5000}).encode()
    with fake_server(lambda state: (200, body), poll_interval=0.02) as (url, _):
        with pytest.raises(RewardServerError, match="more than 1000 bytes"):
            score_texts(["a", "b"], ["c", "d"], rc.RewardClient(url, retries=0))


def test_dataclass_configs_are_frozen_after_fuzzing():  # the fuzz never mutates a shared default
    for cls in CONFIG_CLASSES.values():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


# --------------------------------------------------------------------------------------------------------
# (c) random requests to the built-in reward server
# --------------------------------------------------------------------------------------------------------

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=4))
JSON = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                    max_leaves=8)


@st.composite
def score_requests(draw):
    """Request bodies: mostly near-valid /score payloads with one part broken, sometimes arbitrary JSON/bytes."""
    kind = draw(st.sampled_from(["near", "near", "near", "json", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "json":
        return json.dumps(draw(JSON)).encode()
    n = draw(st.integers(0, 3))
    body = {"prompts": [f"p{i}" for i in range(n)], "responses": [f"r{i}" for i in range(n)]}
    if draw(st.booleans()):
        body["columns"] = {"answer": list(range(n))}
    field = draw(st.sampled_from(["prompts", "responses", "columns", "extra", "none"]))
    if field != "none":
        body[field] = draw(JSON)
    return json.dumps(body).encode()


@settings(max_examples=60)
@given(body=score_requests())
def test_reward_server_answers_any_request_with_json_and_a_status(body):
    """Any body gets a JSON answer: 200 with one finite reward per sample, or 400/500 with ``error``; the
    server never drops the connection or answers with a traceback."""
    import http.client

    from rlbits.rollout.reward_server import RewardServer

    def reward(prompts, responses, answer=None):
        return [float(len(r)) for r in responses]

    server = _SERVER.get("server")
    if server is None:
        server = _SERVER["server"] = RewardServer(reward, port=0, max_request_bytes=4096).start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        status, raw = response.status, response.read()
    finally:
        conn.close()
    answer = json.loads(raw)
    assert isinstance(answer, dict)
    if status == 200:
        request = json.loads(body)
        assert answer == {"rewards": [float(len(r)) for r in request["responses"]]}
    else:
        assert status in (400, 500) and set(answer) == {"error"} and answer["error"], (status, answer)


_SERVER: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _stop_shared_server():
    yield
    if "server" in _SERVER:
        _SERVER.pop("server").stop()


# --------------------------------------------------------------------------------------------------------
# (c) built-in task rewards
# --------------------------------------------------------------------------------------------------------

TEXTS = st.lists(st.text(max_size=12), max_size=4)
TASK_ARGS = st.one_of(TEXTS, TEXTS, st.none(), st.text(max_size=5), st.integers(), st.lists(st.integers(), min_size=1, max_size=2),
                      st.lists(st.none(), min_size=1, max_size=2))


@settings(max_examples=150)
@given(
    task=st.sampled_from(["sentiment", "arithmetic"]),
    prompts=TASK_ARGS,
    responses=TASK_ARGS,
    arithmetic_prompts=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_task_rewards_are_in_range_or_a_clear_error(task, prompts, responses, arithmetic_prompts, seed):
    from rlbits.tasks import get_task

    module = get_task(task)
    if arithmetic_prompts and isinstance(prompts, list) and task == "arithmetic":
        import random

        rng = random.Random(seed)
        prompts = [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in prompts]
    valid_lists = all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in (prompts, responses))
    try:
        out = module.reward(prompts, responses)
    except CLEAR as e:
        assert not valid_lists or len(prompts) != len(responses) or task == "arithmetic", e
        assert any(w in str(e) for w in ("prompts", "responses")), e
        return
    assert valid_lists and len(out) == len(prompts) == len(responses), (prompts, responses, out)
    assert all(isinstance(x, float) for x in out)
    low = -1.0 if task == "sentiment" else 0.0
    assert all(low <= x <= 1.0 for x in out), out


@pytest.mark.parametrize("name", ["ppo", "", None, ["sentiment"], 3])
def test_unknown_task_names_are_a_clear_error(name):
    from rlbits.tasks import get_task

    with pytest.raises(ValueError, match="valid tasks: 'arithmetic', 'calculator', 'guess_number', 'imdb', 'math', 'sentiment'"):
        get_task(name)


@pytest.mark.parametrize("fn", ["cql_loss", "awac_loss"])
def test_empty_vocabulary_is_a_clear_error(fn):
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="empty vocabulary"):
        getattr(rlbits, fn)(torch.randn(2, 3, 0), torch.zeros(2, 3, dtype=torch.long), m)


@pytest.mark.parametrize("fn", ["logprobs_from_logits", "entropy_from_logits"])
def test_logprob_kernels_reject_an_empty_vocabulary(fn):
    args = (torch.randn(2, 3, 0),) + ((torch.zeros(2, 3, dtype=torch.long),) if fn == "logprobs_from_logits" else ())
    with pytest.raises(ValueError, match="logits"):
        getattr(rlbits, fn)(*args)


# --------------------------------------------------------------------------------------------------------
# (a) config files
# --------------------------------------------------------------------------------------------------------

YAML_TOKENS = ["seed", "loop", "ppo", "reinforce", "max_num_steps", "a", ":", ": ", " ", "\n", "\n  ", "- ", "[",
               "]", "{", "}", ",", "1", "-3", "1e-5", ".nan", "null", "true", "'", '"', "#", "? ", "&x ", "*x",
               "!!str ", "!!int ", "!!float ", "!!python/none ", "\t", "|", ">"]


@settings(max_examples=300)
@given(tokens=st.lists(st.sampled_from(YAML_TOKENS), max_size=24))
def test_config_files_give_a_config_or_a_config_error_naming_the_file(tokens, tmp_path_factory):
    from rlbits.loops.config import load_config

    path = tmp_path_factory.getbasetemp() / "fuzz_config.yaml"
    path.write_text("".join(tokens))
    try:
        cfg = load_config(CONFIG_CLASSES["ppo"], path)
    except ConfigError as e:
        assert str(path) in str(e) or any(k in str(e) for k in _fields(CONFIG_CLASSES["ppo"])), e
        return
    assert cfg.loop == "ppo"


@pytest.mark.parametrize(
    "text",
    ["[" * 5000, "{a: " * 3000, "seed: !!timestamp x", "!!int ", "seed: !!int x", "seed: !!float 1x"],
    ids=["deep-list", "deep-map", "timestamp-tag", "empty-int-tag", "int-tag", "float-tag"],
)
def test_pathological_yaml_is_a_config_error(text, tmp_path):
    from rlbits.loops.config import read_yaml

    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match="c.yaml"):
        read_yaml(tmp_path / "c.yaml")


def test_a_key_given_twice_in_a_config_file_is_a_config_error(tmp_path):
    from rlbits.loops.config import read_yaml

    (tmp_path / "c.yaml").write_text("seed: 1\nmax_num_steps: 5\nseed: 2\n")
    with pytest.raises(ConfigError, match="seed"):
        read_yaml(tmp_path / "c.yaml")


@pytest.mark.parametrize("override", ["seed=!!int x", "seed=!!int ", "seed=" + "[" * 5000])
def test_pathological_override_is_exit_2(override):
    import io

    from rlbits.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", override]) == 2
    assert "seed" in err.getvalue()
