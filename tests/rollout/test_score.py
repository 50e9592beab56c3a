"""score(): callables, reward models and the reward server/client (all on 127.0.0.1, port 0)."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from http_support import fake_server
from tensordict import TensorDict

from rlbits.cli import build_parser
from rlbits.models.reward import RewardModel
from rlbits.models.tiny import tiny_config, tiny_tokenizer
from rlbits.rollout.reward_server import RewardClient, RewardServer, load_reward, serve
from rlbits.rollout.score import (
    InvalidRewardError,
    RewardError,
    RewardServerError,
    score,
    score_texts,
)

PROMPTS = ["1+2=", "the film was", "hello there", "x"]
RESPONSES = ["3", " great fun", " friend", "yz"]
ANSWERS = ["3", "?", "!", "q"]


def make_batch(prompts=PROMPTS, responses=RESPONSES, **columns) -> TensorDict:
    n = len(prompts)
    td = TensorDict({"prompts": torch.zeros(n, 2, dtype=torch.long)}, batch_size=[n])
    td["prompt_text"] = list(prompts)
    td["response_text"] = list(responses)
    for key, values in columns.items():
        td[key] = values
    return td


def length_reward(prompts, responses):
    return [len(p) + 10 * len(r) for p, r in zip(prompts, responses, strict=True)]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every server thread started by a test is gone when it ends."""

    def new_threads():
        # transformers' progress bars start tqdm's own monitor thread; it is not ours to stop.
        return {t for t in threading.enumerate() if t.name != "tqdm_monitor"} - before

    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    while new_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not new_threads()


# ------------------------------------------------------------------------------------------------ callables


def test_callable_exact_values_and_dtype():
    rewards = score(make_batch(), length_reward)
    expected = [len(p) + 10 * len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert rewards.dtype == torch.float32 and rewards.shape == (4,)
    assert rewards.tolist() == expected


@pytest.mark.parametrize(
    "out",
    [
        [1, 0, 2, -3],
        (1.0, 0.0, 2.0, -3.0),
        [True, False, 2, -3],
        torch.tensor([1, 0, 2, -3]),
        torch.tensor([1.0, 0.0, 2.0, -3.0], dtype=torch.float64, requires_grad=True),
        np.array([1, 0, 2, -3], dtype=np.int64),
        np.array([1.0, 0.0, 2.0, -3.0]),
        [np.float64(1), np.int32(0), np.bool_(True) * 2, torch.tensor(-3.0)],
    ],
    ids=["ints", "tuple", "bools", "int-tensor", "f64-grad-tensor", "np-int", "np-float", "scalars"],
)
def test_output_kinds_convert_to_float32(out):
    rewards = score(make_batch(), lambda p, r: out)
    assert rewards.dtype == torch.float32 and not rewards.requires_grad
    assert rewards.tolist() == [1.0, 0.0, 2.0, -3.0]


def test_bool_outputs_become_floats():
    assert score(make_batch(), lambda p, r: [True, False, True, False]).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert score(make_batch(), lambda p, r: np.array([False, True, True, False])).tolist() == [0, 1, 1, 0]


def test_wrong_length_says_expected_and_got():
    with pytest.raises(
        InvalidRewardError, match=r"returned 3 rewards for samples 0\.\.3 of 4; expected 4, got 3"
    ):
        score(make_batch(), lambda p, r: [0.0, 1.0, 2.0])
    with pytest.raises(InvalidRewardError, match="expected 4, got 5"):
        score(make_batch(), lambda p, r: torch.zeros(5))


def test_column_vector_is_rejected_not_squeezed():
    with pytest.raises(InvalidRewardError, match=r"shape \(4, 1\).*expected shape \(4,\).*squeeze"):
        score(make_batch(), lambda p, r: torch.zeros(4, 1))
    with pytest.raises(InvalidRewardError, match=r"shape \(\)"):
        score(make_batch(), lambda p, r: torch.tensor(1.0))


@pytest.mark.parametrize(
    "bad, shown",
    [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"), (1e39, r"1e\+39")],
)
def test_non_finite_names_the_sample(bad, shown):
    out = [0.0, 1.0, bad, 2.0]
    with pytest.raises(
        InvalidRewardError, match=rf"reward {shown} for sample 2 \(prompt='hello there', response=' friend'\)"
    ):
        score(make_batch(), lambda p, r: out)
    with pytest.raises(ValueError, match="sample 2"):  # InvalidRewardError is a ValueError too
        score(make_batch(), lambda p, r: torch.tensor(out, dtype=torch.float64))


@pytest.mark.parametrize(
    "out, match",
    [
        ([0.0, "1.0", 2.0, 3.0], r"str '1\.0' for sample 1 \(prompt='the film was', response=' great fun'\)"),
        (
            [0.0, 1.0, 2.0, None],
            r"NoneType 'None' for sample 3 \(prompt='x', response='yz'\); rewards must be numbers",
        ),
        ([0.0, 1.0, [2.0], 3.0], r"list '\[2\.0\]' for sample 2"),
        ([0.0, 1j, 2.0, 3.0], r"complex '1j' for sample 1"),
        (None, r"returned NoneType for samples 0\.\.3 of 4; expected a list of 4 numbers"),
        (0.5, r"returned float for samples 0\.\.3 of 4"),
        ({"a": 1}, r"returned dict"),
        ("1234", r"returned str"),
        (torch.zeros(4, dtype=torch.complex64), r"complex rewards"),
        (np.array(["1", "2", "3", "4"]), r"str '1' for sample 0 \(prompt='1\+2='"),
        (np.array([1.0, None, 2.0, 3.0], dtype=object), r"NoneType 'None' for sample 1"),
    ],
    ids=[
        "str",
        "none-item",
        "nested",
        "complex-item",
        "none",
        "scalar",
        "dict",
        "str-out",
        "complex-tensor",
        "np-str",
        "np-object",
    ],
)
def test_wrong_types_are_named(out, match):
    with pytest.raises(InvalidRewardError, match=match):
        score(make_batch(), lambda p, r: out)


def test_long_texts_are_cut_in_messages():
    prompt, response = "p" * 500, "r" * 300
    with pytest.raises(InvalidRewardError) as info:
        score(make_batch([prompt], [response]), lambda p, r: [float("nan")])
    message = str(info.value)
    assert "p" * 77 + "..." in message and "p" * 78 not in message
    assert "r" * 77 + "..." in message and "r" * 78 not in message


def test_exception_is_wrapped_chained_and_located():
    calls = []

    def fails_on_film(prompts, responses):
        calls.append(len(prompts))
        if any("film" in p for p in prompts):
            raise ZeroDivisionError("division by zero in my reward")
        return [0.0] * len(prompts)

    with pytest.raises(
        RewardError,
        match=r"fails_on_film raised ZeroDivisionError: division by zero in my reward on sample 1 \(prompt='the film was'",
    ) as info:
        score(make_batch(), fails_on_film)
    assert isinstance(info.value, RuntimeError) and not isinstance(info.value, ValueError)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert "samples 0..3 of 4" in str(info.value)  # the failed call
    assert calls == [4, 1, 1]  # one batched call, then per sample up to the failing one


def test_exception_only_in_batch_says_so():
    def needs_one(prompts, responses):
        if len(prompts) > 1:
            raise RuntimeError("batch too big")
        return [1.0]

    with pytest.raises(
        RewardError,
        match=r"RuntimeError: batch too big on the call for samples 0\.\.3 of 4; each of these samples scored alone succeeded",
    ) as info:
        score(make_batch(), needs_one)
    assert str(info.value.__cause__) == "batch too big"


def test_batch_size_chunks_calls_and_keeps_global_indices():
    calls = []

    def fn(prompts, responses):
        calls.append(list(prompts))
        return [len(p) for p in prompts]

    td = make_batch(PROMPTS + ["abc"], RESPONSES + ["d"])
    assert score(td, fn, batch_size=2).tolist() == [len(p) for p in PROMPTS + ["abc"]]
    assert calls == [PROMPTS[:2], PROMPTS[2:4], ["abc"]]
    with pytest.raises(InvalidRewardError, match=r"for sample 3 \(prompt='x'"):
        score(
            td,
            lambda p, r: [0.0] * (len(p) - 1) + [float("nan")] if "x" in p else [0.0] * len(p),
            batch_size=2,
        )
    with pytest.raises(InvalidRewardError, match=r"for samples 2\.\.3 of 5; expected 2, got 1"):
        score(td, lambda p, r: [0.0] if "x" in p else [0.0] * len(p), batch_size=2)
    with pytest.raises(RewardError, match=r"raised KeyError: 'no' on sample 4 \(prompt='abc'"):
        score(td, lambda p, r: {}["no"] if "abc" in p else [0.0] * len(p), batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        score(td, fn, batch_size=0)


def test_columns_from_batch_and_keyword():
    seen = {}

    def with_answer(prompts, responses, answer):
        seen["answer"] = answer
        return [float(r.strip() == a) for r, a in zip(responses, answer, strict=True)]

    td = make_batch(answer=ANSWERS, source=["a", "b", "c", "d"])
    assert score(td, with_answer).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert seen["answer"] == ANSWERS
    assert score(td, with_answer, columns={"answer": ["?", "great fun", "?", "?"]}).tolist() == [
        0,
        1,
        0,
        0,
    ]  # keyword wins

    got = {}

    def takes_all(prompts, responses, **columns):
        got.update(columns)
        return [0.0] * len(prompts)

    score(td, takes_all, columns={"weight": torch.arange(4)})
    assert set(got) == {"answer", "source", "weight"}  # tensor keys of the batch (prompts) are not columns
    assert got["source"] == ["a", "b", "c", "d"] and got["weight"].tolist() == [0, 1, 2, 3]
    # A function that takes no columns is not offered the batch's.
    assert score(td, length_reward).tolist() == score(make_batch(), length_reward).tolist()


def test_columns_are_sliced_with_batch_size():
    seen = []

    def fn(prompts, responses, answer):
        seen.append(answer)
        return [0.0] * len(prompts)

    score(make_batch(answer=ANSWERS), fn, batch_size=3)
    assert seen == [ANSWERS[:3], ANSWERS[3:]]


def test_missing_column_fails_loudly():
    def needs_answer(prompts, responses, answer):
        return [0.0] * len(prompts)

    with pytest.raises(RewardError, match=r"needs_answer raised TypeError: .*answer"):
        score(make_batch(), needs_answer)


def test_bad_columns():
    with pytest.raises(ValueError, match=r"column 'answer' has 2 values; expected 4"):
        score(make_batch(), length_reward, columns={"answer": ["a", "b"]})
    with pytest.raises(ValueError, match="column name 'prompts' is reserved"):
        score(make_batch(), length_reward, columns={"prompts": PROMPTS})
    with pytest.raises(TypeError, match="column 'answer' must be a list, tuple or tensor"):
        score(make_batch(), length_reward, columns={"answer": "abcd"})
    with pytest.raises(TypeError, match="columns must be a mapping"):
        score(make_batch(), length_reward, columns=[("answer", ANSWERS)])


def test_batch_without_text_says_to_decode():
    td = TensorDict({"prompts": torch.zeros(2, 3, dtype=torch.long)}, batch_size=[2])
    with pytest.raises(
        ValueError,
        match=r"no 'prompt_text' or 'response_text'; call rlbits\.text\.decode\(batch, tokenizer\) first",
    ):
        score(td, length_reward)
    td["prompt_text"] = ["a", "b"]
    with pytest.raises(ValueError, match=r"no 'response_text'; call rlbits\.text\.decode"):
        score(td, length_reward)


def test_bad_arguments():
    with pytest.raises(TypeError, match="batch must be a TensorDict, got dict"):
        score({"prompt_text": ["a"], "response_text": ["b"]}, length_reward)
    with pytest.raises(TypeError, match="reward must be a callable.*got int"):
        score(make_batch(), 3)
    with pytest.raises(ValueError, match="neither an http.* URL .* nor a folder"):
        score(make_batch(), "/no/such/reward/model")
    with pytest.raises(
        TypeError, match=r"bare Linear; wrap it with its tokenizer: RewardModel\(model, tokenizer\)"
    ):
        score(make_batch(), torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match="got 2 prompts but 1 responses"):
        score_texts(["a", "b"], ["c"], length_reward)
    with pytest.raises(TypeError, match=r"responses\[1\] must be str, got int"):
        score_texts(["a", "b"], ["c", 3], length_reward)


def test_empty_input_calls_nothing():
    out = score_texts([], [], lambda p, r: pytest.fail("called"))
    assert out.shape == (0,) and out.dtype == torch.float32


# ------------------------------------------------------------------------------------------- reward model


def tiny_reward_model(arch="gpt2", num_labels=1, **kwargs) -> RewardModel:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config(arch, num_labels=num_labels))
    return RewardModel(model, tiny_tokenizer(), **kwargs)


def reference_reward(rm: RewardModel, text: str) -> float:
    """Unpadded single sequence: the score head applied to the base model's last hidden state."""
    ids = rm.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        hidden = rm.model.base_model(input_ids=ids).last_hidden_state
        return rm.model.score(hidden[0, -1]).item()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_reward_model_matches_unpadded_reference(arch):
    rm = tiny_reward_model(arch, batch_size=3)
    prompts = PROMPTS + ["a much longer prompt than the others", "7"]
    responses = RESPONSES + ["!", "8 is the answer"]
    rewards = score(make_batch(prompts, responses), rm)
    expected = [reference_reward(rm, p + r) for p, r in zip(prompts, responses, strict=True)]
    assert rewards.dtype == torch.float32
    torch.testing.assert_close(rewards, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    # Padding invariance: each sample alone scores as in the padded batch.
    alone = torch.cat([rm([p], [r]) for p, r in zip(prompts, responses, strict=True)])
    torch.testing.assert_close(rewards, alone, atol=1e-5, rtol=1e-5)
    assert len(set(rewards.tolist())) == len(prompts)  # not a constant


def test_reward_model_folder_round_trip(tmp_path):
    rm = tiny_reward_model()
    rm.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    direct = score(make_batch(), rm)
    from_folder = score(make_batch(), str(tmp_path))
    torch.testing.assert_close(from_folder, direct)
    torch.testing.assert_close(score(make_batch(), tmp_path), direct)  # PathLike too
    loaded = RewardModel.from_pretrained(tmp_path, batch_size=2)
    torch.testing.assert_close(loaded(PROMPTS, RESPONSES), direct)
    torch.testing.assert_close(load_reward(str(tmp_path))(PROMPTS, RESPONSES), direct)


def test_reward_model_max_length_keeps_the_end():
    rm = tiny_reward_model(max_length=4)
    text_p, text_r = "a long prompt", " ending"
    expected = reference_reward(rm, (text_p + text_r)[-4:])  # one token per character
    assert rm([text_p], [text_r]).item() == pytest.approx(expected, abs=1e-5)


def test_reward_model_rejects_bad_models():
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(tiny_config("gpt2", num_labels=2))
    with pytest.raises(ValueError, match="num_labels=1 .*got num_labels=2"):
        RewardModel(model, tiny_tokenizer())
    model = AutoModelForSequenceClassification.from_config(tiny_config("gpt2", num_labels=1, pad_token_id=5))
    with pytest.raises(ValueError, match=r"pad_token_id \(5\) differs from tokenizer.pad_token_id \(0\)"):
        RewardModel(model, tiny_tokenizer())
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        tiny_reward_model(batch_size=0)
    with pytest.raises(ValueError, match="is not a folder"):
        RewardModel.from_pretrained("/no/such/folder")


def test_reward_model_empty_text_is_named():
    with pytest.raises(
        RewardError,
        match=r"ValueError: text 0 of the call has no tokens to score .* on sample 1 \(prompt='', response=''\)",
    ):
        score_texts(["a", ""], ["b", ""], tiny_reward_model())


# ------------------------------------------------------------------------------------------ server + client


def answer_reward(prompts, responses, answer=None):
    answer = answer or [""] * len(prompts)
    return [
        len(p) - 0.5 * len(r) + (r.strip() == a) for p, r, a in zip(prompts, responses, answer, strict=True)
    ]


def raw_request(url, method, path, body=b"", headers=None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_round_trip_equals_direct_call():
    td = make_batch(answer=ANSWERS)
    direct = score(td, answer_reward)
    with RewardServer(answer_reward, port=0) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.port != 0
        assert RewardClient(server.url).health() == {"status": "ok"}
        assert torch.equal(score(td, server.url), direct)
        assert torch.equal(score(td, server.url + "/score/", batch_size=3), direct)
        assert RewardClient(server.url)(PROMPTS, RESPONSES, answer=ANSWERS) == direct.tolist()
    assert direct.tolist() == answer_reward(PROMPTS, RESPONSES, ANSWERS)


def test_bearer_token_required(monkeypatch):
    monkeypatch.delenv("RLBITS_REWARD_TOKEN", raising=False)
    with RewardServer(length_reward, port=0, token="s3cret") as server:
        with pytest.raises(
            RewardServerError, match="answered HTTP 401 Unauthorized: missing or wrong bearer token"
        ) as info:
            score(make_batch(), server.url)
        assert info.value.status == 401
        with pytest.raises(RewardServerError, match="401"):
            RewardClient(server.url, token="wrong", retries=0)(PROMPTS, RESPONSES)
        client = RewardClient(server.url, token="s3cret")
        assert "s3cret" not in repr(client)
        assert client(PROMPTS, RESPONSES) == length_reward(PROMPTS, RESPONSES)
        assert client.health() == {"status": "ok"}
        assert RewardClient(server.url).health() == {"status": "ok"}  # health needs no token
        monkeypatch.setenv("RLBITS_REWARD_TOKEN", "s3cret")
        assert score(make_batch(), server.url).tolist() == length_reward(PROMPTS, RESPONSES)


def test_oversized_request_gets_413_and_batch_size_fixes_it():
    with RewardServer(length_reward, port=0, max_request_bytes=200) as server:
        prompts, responses = ["p" * 40] * 6, ["r" * 40] * 6
        with pytest.raises(
            RewardServerError, match=r"413 \(request of \d+ bytes too large.*cap of 200 bytes.*batch_size"
        ) as info:
            score_texts(prompts, responses, server.url)
        assert info.value.status == 413
        assert score_texts(prompts, responses, server.url, batch_size=1).tolist() == [400.0 + 40] * 6
        big = json.dumps({"prompts": ["p" * 300_000], "responses": ["r"]}).encode()
        status, body = raw_request(server.url, "POST", "/score", big)
        assert status == 413 and "over the server's cap of 200 bytes" in body["error"]


@pytest.mark.parametrize(
    "body, match",
    [
        (b"{not json", "request body is not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'{"prompts": ["a"]}', "missing field 'responses'"),
        (b'{"prompts": ["a"], "responses": ["b"], "respones": []}', r"unknown field\(s\) 'respones'"),
        (b'{"prompts": "a", "responses": ["b"]}', "field 'prompts' must be a list of strings, got str"),
        (b'{"prompts": [1], "responses": ["b"]}', r"prompts\[0\] must be a string, got int"),
        (b'{"prompts": ["a", "b"], "responses": ["b"]}', "got 2 prompts but 1 responses"),
        (
            b'{"prompts": ["a"], "responses": ["b"], "columns": {"k": [1, 2]}}',
            "column 'k' must be a list of 1 values",
        ),
        (b'{"prompts": ["a"], "responses": ["b"], "columns": []}', "field 'columns' must be an object"),
        (
            b'{"prompts": ["a"], "responses": ["b"], "columns": {"prompts": [1]}}',
            "column name 'prompts' is reserved",
        ),
    ],
    ids=["json", "list", "missing", "unknown", "str", "int", "pairs", "col-len", "col-type", "col-name"],
)
def test_server_rejects_malformed_requests_with_400(body, match):
    with RewardServer(length_reward, port=0) as server:
        status, answer = raw_request(server.url, "POST", "/score", body)
    assert status == 400
    assert set(answer) == {"error"}
    assert re.search(match, answer["error"]), answer


def test_server_paths_methods_and_reward_failures():
    def flaky(prompts, responses):
        if "boom" in responses:
            raise KeyError("boom key")
        return [float("nan") if r == "nan" else 1.0 for r in responses]

    with RewardServer(flaky, port=0) as server:
        assert raw_request(server.url, "GET", "/score")[0] == 405
        assert raw_request(server.url, "POST", "/health")[0] == 405
        status, answer = raw_request(server.url, "GET", "/nope")
        assert status == 404 and "POST /score and GET /health" in answer["error"]
        assert raw_request(server.url, "PUT", "/score")[0] == 501  # http.server's own errors are JSON too
        client = RewardClient(server.url, retries=0)
        with pytest.raises(
            RewardServerError,
            match=r"HTTP 500 .*flaky raised KeyError: 'boom key' on sample 1 \(prompt='b', response='boom'\)",
        ):
            client(["a", "b"], ["ok", "boom"])
        with pytest.raises(
            RewardServerError,
            match=r"HTTP 500 .*returned reward nan for sample 2 \(prompt='c', response='nan'\)",
        ):
            client(["a", "b", "c"], ["ok", "ok", "nan"])
        assert client([], []) == []


@pytest.mark.parametrize(
    "body, match",
    [
        (b"<html>oops</html>", "answered a body that is not JSON: b'<html>oops</html>'"),
        (b"[0.5, 0.5]", r"answered \[0\.5, 0\.5\]; expected a JSON object with 'rewards'"),
        (b'{"reward": [0.5, 0.5]}', "expected a JSON object with 'rewards'"),
        (b'{"rewards": 0.5}', "'rewards' of type float; expected a list"),
        (b'{"rewards": [0.5]}', "answered 1 rewards for 2 samples; expected 2"),
        (b'{"rewards": [0.5, "0.5"]}', r"answered reward '0.5' for sample 1 \(prompt='b', response='d'\); expected a number"),
        (b'{"rewards": [true, 0.5]}', r"answered reward True for sample 0 \(prompt='a', response='c'\); expected a number"),
        (b'{"rewards": [0.5, null]}', "answered reward None for sample 1"),
        (b"", "not JSON"),
    ],
    ids=["html", "list", "no-rewards", "scalar", "length", "string", "bool", "null", "empty"],
)
def test_client_rejects_malformed_answers(body, match):
    with fake_server(lambda state: (200, body)) as (url, state):
        with pytest.raises(RewardServerError, match=match):
            score_texts(["a", "b"], ["c", "d"], url)
        assert state["count"] == 1  # a malformed answer is not retried


def test_non_finite_server_reward_names_the_sample():
    with fake_server(lambda state: (200, b'{"rewards": [0.5, NaN]}')) as (url, _):
        with pytest.raises(
            InvalidRewardError, match=rf"reward server {url} returned reward nan for sample 1 \(prompt='b'"
        ):
            score_texts(["a", "b"], ["c", "d"], url)


def test_client_retries_5xx_then_succeeds():
    def respond(state):
        if state["count"] <= 2:
            return 503, b'{"error": "warming up"}'
        return 200, b'{"rewards": [1.5, -2]}'

    with fake_server(respond) as (url, state):
        client = RewardClient(url, retries=3, backoff=0.01)
        assert client(["a", "b"], ["c", "d"]) == [1.5, -2.0]
        assert state["count"] == 3


def test_client_gives_up_after_retries_and_never_retries_4xx():
    with fake_server(lambda state: (500, b'{"error": "model crashed"}')) as (url, state):
        with pytest.raises(
            RewardServerError, match=r"failed after 3 attempts; last error: HTTP 500 .*: model crashed"
        ) as info:
            RewardClient(url, retries=2, backoff=0.01)(["a"], ["b"])
        assert state["count"] == 3 and info.value.status == 500
    with fake_server(lambda state: (400, b"plain text")) as (url, state):
        with pytest.raises(RewardServerError, match=r"answered HTTP 400 Bad Request: b'plain text'"):
            RewardClient(url, retries=3, backoff=0.01)(["a"], ["b"])
        assert state["count"] == 1


def test_client_retries_connection_errors():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(
        RewardServerError,
        match=r"failed after 3 attempts; last error: connection failed: .*Connection refused",
    ) as info:
        RewardClient(f"http://127.0.0.1:{port}", retries=2, backoff=0.05)(["a"], ["b"])
    assert info.value.status is None
    assert 0.15 <= time.monotonic() - start < 3  # waited 0.05 + 0.1 between attempts


def test_client_timeout_is_quick_and_not_retried():
    def slow(state):
        state["release"].wait(10)
        return 200, b'{"rewards": [1.0]}'

    with fake_server(slow) as (url, state):
        start = time.monotonic()
        with pytest.raises(RewardServerError, match=r"timed out: no answer within 0\.2 s"):
            RewardClient(url, timeout=0.2, retries=3, backoff=0.01)(["a"], ["b"])
        assert time.monotonic() - start < 2
        assert state["count"] == 1


def test_client_and_server_argument_errors():
    with pytest.raises(ValueError, match="url must look like http://host:port"):
        RewardClient("ftp://127.0.0.1:1")
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        RewardClient("http://127.0.0.1:1", retries=-1)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        RewardClient("http://127.0.0.1:1", timeout=0)
    with pytest.raises(TypeError, match="column 'obj' cannot be sent to the reward server as JSON"):
        RewardClient("http://127.0.0.1:1")(["a"], ["b"], obj=[object()])
    with pytest.raises(ValueError, match="to listen on every interface, '0.0.0.0' explicitly"):
        RewardServer(length_reward, "", 0)
    with pytest.raises(TypeError, match="reward must be a callable"):
        RewardServer(42, port=0)
    with pytest.raises(ValueError, match="neither a task .*arithmetic.* nor a folder"):
        load_reward("no-such-task")


def test_serve_in_background_then_stop_frees_the_port():
    server = serve(length_reward, port=0, block=False, concurrent=True)
    try:
        assert score_texts(PROMPTS, RESPONSES, server.url).tolist() == length_reward(PROMPTS, RESPONSES)
    finally:
        server.stop()
        server.stop()  # twice is fine
    with pytest.raises(RewardServerError, match="Connection refused"):
        RewardClient(server.url, retries=0).health()


def test_server_serves_a_reward_model():
    rm = tiny_reward_model()
    with RewardServer(rm, port=0, batch_size=2) as server:
        torch.testing.assert_close(score(make_batch(), server.url), rm(PROMPTS, RESPONSES))


# ------------------------------------------------------------------------------------------------------ CLI


def test_cli_parses_serve_reward():
    args = build_parser().parse_args(["serve-reward", "arithmetic", "--port", "0", "--token-env", "TOK"])
    assert (args.target, args.host, args.port, args.token_env) == ("arithmetic", "127.0.0.1", 0, "TOK")


def test_cli_refuses_missing_token_env(monkeypatch, capsys):
    monkeypatch.delenv("RLBITS_TEST_UNSET_TOKEN", raising=False)
    args = build_parser().parse_args(["serve-reward", "arithmetic", "--token-env", "RLBITS_TEST_UNSET_TOKEN"])
    assert args.func(args) == 2
    assert "environment variable RLBITS_TEST_UNSET_TOKEN is unset or empty" in capsys.readouterr().err
    args = build_parser().parse_args(["serve-reward", "nope", "--port", "0"])
    assert args.func(args) == 2
    assert "'nope' is neither a task" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter imports torch and tensordict: several seconds on a busy CPU
def test_cli_serves_a_task_end_to_end():
    env = {**os.environ, "RLBITS_TEST_TOKEN": "tok123"}
    cmd = [
        sys.executable,
        "-m",
        "rlbits",
        "serve-reward",
        "arithmetic",
        "--port",
        "0",
        "--token-env",
        "RLBITS_TEST_TOKEN",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, (
            line,
            proc.stderr.read() if proc.poll() is not None else "",
        )
        url = line.split(" listening on ")[1].split()[0]
        assert "tok123" not in line
        client = RewardClient(url, token="tok123", retries=0)
        prompts, responses = ["37+48=", "2+2="], ["85", "5"]
        assert client(prompts, responses) == [1.0, 0.0]
        with pytest.raises(RewardServerError, match="401"):
            RewardClient(url, retries=0)(prompts, responses)
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
