"""Hostile and careless inputs (issue 29): config YAML, config sizes, prompts, sampling, the reward client and
server, ``rlbits serve-reward``. Each case fails fast with a clear error naming the problem: no hang, no
huge message, no traceback, no token sent where it should not go."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlbits.cli import build_parser, config_help
from rlbits.data.stream import PromptError, check_prompts, read_prompts
from rlbits.loops.config import MIN_TEMPERATURE, ConfigError, config_from_dict, load_config, read_yaml
from rlbits.loops.config_yaml import MAX_ALIAS_NODES
from rlbits.loops.ilql import ILQLConfig
from rlbits.loops.ppo import PPOConfig
from rlbits.loops.reinforce import ReinforceConfig
from rlbits.loops.run import in_phase
from rlbits.models.tiny import tiny_causal_lm
from rlbits.rollout.generate import generate
from rlbits.rollout.reward_server import RewardClient, RewardServer
from rlbits.rollout.score import RewardServerError
from rlbits.text import make_prompts

# --------------------------------------------------------------------------------------------------------
# config YAML
# --------------------------------------------------------------------------------------------------------


def billion_laughs(levels: int = 9) -> str:
    """A flow mapping of ``levels`` anchors, each a list of 9 aliases of the one before: ~400 bytes that
    stand for 9**levels strings."""
    names = "abcdefghijklmnopqrstuvwxyz"[:levels]
    items = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    items += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip(names, names[1:], strict=False)]
    return "{" + ", ".join(items) + "}"


def assert_fast_config_error(fn, match: str) -> ConfigError:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=match) as info:
        fn()
    assert time.monotonic() - start < 1.0
    assert len(str(info.value)) < 1000
    return info.value


@pytest.mark.parametrize("field", ["temperature", "env_options", "policy"])
def test_an_alias_bomb_in_a_config_file_is_refused_at_once(tmp_path, field):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"{field}: {billion_laughs()}\n")
    assert len(path.read_bytes()) < 450
    error = assert_fast_config_error(
        lambda: load_config(PPOConfig, path), f"aliases expand to more than {MAX_ALIAS_NODES}"
    )
    assert "bomb.yaml" in str(error)


@pytest.mark.parametrize("field", ["temperature", "env_options"])
def test_an_alias_bomb_in_an_override_is_refused_at_once(field):
    assert_fast_config_error(
        lambda: load_config(PPOConfig, None, [f"{field}={billion_laughs()}"]),
        f"override '{field}': aliases expand",
    )


def test_aliases_that_stay_small_still_work_and_recursive_ones_do_not(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "env_options: &opts {max_turns: 4, hint: [a, b]}\nlora_target_modules: &t [q_proj, v_proj]\n"
    )
    cfg = load_config(ReinforceConfig, path)
    assert cfg.env_options == {"max_turns": 4, "hint": ["a", "b"]} and cfg.lora_target_modules == [
        "q_proj",
        "v_proj",
    ]
    path.write_text("env_options: &e {self: *e}\n")
    assert_fast_config_error(lambda: read_yaml(path), r"alias \*e on line 1 is inside the node it names")


def test_merge_keys_are_read_and_real_duplicates_still_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("<<: {seed: 3, max_num_steps: 5}\nmax_num_steps: 7\n")
    cfg = load_config(PPOConfig, path)
    assert (cfg.seed, cfg.max_num_steps) == (3, 7)
    path.write_text("env_options: {a: &base {turns: 2, hint: x}, b: {<<: *base, hint: y}}\n")
    assert read_yaml(path)["env_options"]["b"] == {"turns": 2, "hint": "y"}
    path.write_text("env_options: {a: &a {x: 1}, b: &b {<<: *a, y: 2}, c: {<<: [*b, *a], z: 3}}\n")
    assert read_yaml(path)["env_options"]["c"] == {"x": 1, "y": 2, "z": 3}
    path.write_text("seed: 1\n<<: {seed: 2}\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"key 'seed' is given twice \(line 3\)"):
        read_yaml(path)
    assert load_config(PPOConfig, None, ["env_options={<<: {a: 1}, b: 2}"]).env_options == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    "values, match",
    [
        ({"temperature": list(range(10**6))}, "temperature must be float"),
        ({"env_options": list(range(10**6))}, "env_options must be dict"),
        ({"policy": ["x" * 10**6]}, "policy must be"),
        ({"x" * 10**6: 1}, "unknown config key"),
        ({"loop": "p" * 10**6}, "loop must be"),
        ({"max_num_steps": 10**4000}, None),
    ],
    ids=["list-for-float", "list-for-dict", "long-str", "long-key", "long-literal", "huge-int"],
)
def test_config_errors_show_values_in_bounded_size(values, match):
    start = time.monotonic()
    try:
        config_from_dict(PPOConfig, values)
    except ConfigError as e:
        if match is not None:
            assert match in str(e), str(e)[:300]
        assert len(str(e)) <= 4100, len(str(e))
    assert time.monotonic() - start < 1.0


# --------------------------------------------------------------------------------------------------------
# config sizes
# --------------------------------------------------------------------------------------------------------


def test_cpu_threads_is_bounded_by_this_machines_cpus():
    cpus = os.cpu_count() or 1
    assert config_from_dict(PPOConfig, {"cpu_threads": cpus}).cpu_threads == cpus
    assert_fast_config_error(
        lambda: config_from_dict(PPOConfig, {"cpu_threads": 1_000_000}),
        rf"cpu_threads must be <= {cpus} \(this machine's CPU count\), got 1000000",
    )


@pytest.mark.parametrize(
    "cls, field, value, bound",
    [
        (PPOConfig, "num_prompts_per_step", 10**9, 2**20),
        (PPOConfig, "max_new_tokens", 10**12, 2**20),
        (PPOConfig, "microbatch_size", 10**9, 2**20),
        (PPOConfig, "num_generations_per_prompt", 10**7, 2**20),
        (PPOConfig, "num_minibatches", 10**9, 2**20),
        (PPOConfig, "max_env_workers", 10**6, 1024),
        (PPOConfig, "lora_rank", 10**7, 2**16),
        (PPOConfig, "max_episode_tokens", 10**9, 2**20),
        (ReinforceConfig, "dynamic_sampling_max_gen_batches", 10**6, 1024),
        (ILQLConfig, "batch_size", 10**9, 2**20),
        (ILQLConfig, "dataset_size", 10**9, 2**20),
    ],
)
def test_sizes_that_allocate_are_bounded_with_the_field_named(cls, field, value, bound):
    assert_fast_config_error(
        lambda: config_from_dict(cls, {field: value}), rf"{field} must be <= {bound}, got {value}"
    )


def test_responses_per_step_are_bounded_and_help_config_lists_the_bounds():
    with pytest.raises(
        ConfigError, match=r"num_prompts_per_step \* num_generations_per_prompt must be <= 1048576"
    ):
        config_from_dict(ReinforceConfig, {"num_prompts_per_step": 2**19, "num_generations_per_prompt": 4})
    assert "max_new_tokens: int = 24 (at most 1048576)" in config_help("reinforce")


def test_a_temperature_that_overflows_sampling_is_refused():
    assert config_from_dict(PPOConfig, {"temperature": MIN_TEMPERATURE}).temperature == MIN_TEMPERATURE
    assert_fast_config_error(
        lambda: config_from_dict(PPOConfig, {"temperature": 1e-45}), "temperature must be >= 0.0001"
    )
    assert_fast_config_error(
        lambda: config_from_dict(ILQLConfig, {"dataset_temperature": 1e-45}),
        "dataset_temperature must be >= 0.0001",
    )


# --------------------------------------------------------------------------------------------------------
# NaN/inf in sampling
# --------------------------------------------------------------------------------------------------------

V = 64


@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_causal_lm("gpt2", V, seed=3)


def _generate(model, **kw):
    prompts = make_prompts([[5, 6, 7], [8, 9]], 0)
    return generate(
        model,
        prompts,
        max_new_tokens=6,
        eos_token_id=V - 1,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )


def nan_after(n_ids: int):
    """A logits processor that turns the logits NaN once the ids reach ``n_ids`` columns."""
    return lambda ids, logits: logits * float("nan") if ids.shape[1] >= n_ids else logits


@pytest.mark.parametrize(
    "kwargs, step",
    [
        ({"temperature": 1e-45}, 0),  # logits / temperature overflows to inf: inf - inf = NaN
        ({"temperature": 1.0, "top_k": 5, "logits_processor": nan_after(5)}, 2),
        ({"temperature": 0.0, "logits_processor": nan_after(3)}, 0),  # greedy: argmax of NaN logits
    ],
    ids=["tiny-temperature", "sampling-nan", "greedy-nan"],
)
def test_nan_in_sampling_is_a_clear_error_in_the_rollout_phase(tiny_lm, kwargs, step):
    with pytest.raises(
        FloatingPointError,
        match=rf"step 7, phase rollout: sampling produced non-finite probabilities in 2 of 2 rows \(first: row 0, "
        rf"new token {step}\)",
    ):
        with in_phase(7, "rollout"):
            _generate(tiny_lm, **kwargs)


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampling", "greedy"])
def test_nan_weights_are_caught_in_sampling_too(temperature):
    model = tiny_causal_lm("gpt2", V, seed=3)
    with torch.no_grad():
        model.lm_head.weight[7] = float("nan")  # one token's logit NaN: every row's distribution is NaN
    with pytest.raises(FloatingPointError, match="in 2 of 2 rows"):
        _generate(model, temperature=temperature)


def test_sampling_at_the_smallest_temperature_is_finite(tiny_lm):
    out = _generate(tiny_lm, temperature=MIN_TEMPERATURE)
    assert torch.isfinite(out["logprobs"]).all() and (out["responses"] < V).all()


# --------------------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------------------


def test_a_lone_surrogate_prompt_is_a_prompt_error(tmp_path):
    with pytest.raises(
        PromptError,
        match=r"prompt 2 of your prompts is not valid Unicode: surrogates not allowed at character 3",
    ):
        check_prompts(["fine", "abc\ud800def"])
    path = tmp_path / "val.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "\\udc00 tail"}\n')
    with pytest.raises(
        PromptError, match=r"prompt 2 of your val_prompts \(from val.jsonl\) is not valid Unicode"
    ):
        read_prompts(path)
    path = tmp_path / "val.txt"
    path.write_bytes(b"ok\n\xff\xfe bad\n")
    with pytest.raises(PromptError, match=r"val.txt' is not UTF-8 text: invalid start byte at byte 3"):
        read_prompts(path)
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "\n")
    with pytest.raises(PromptError, match="line 1: not JSON"):
        read_prompts(path)


# --------------------------------------------------------------------------------------------------------
# reward client
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def http_server(handler_cls):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_the_client_refuses_redirects_and_never_sends_the_token_elsewhere():
    seen = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"rewards": [99.0]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http_server(Elsewhere) as other:
        count = []

        class Redirect(BaseHTTPRequestHandler):
            def do_POST(self):
                count.append(1)
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(307)
                self.send_header("Location", other + "/score")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        with http_server(Redirect) as url:
            client = RewardClient(url, token="s3cret", retries=3, backoff=0.01)
            with pytest.raises(
                RewardServerError,
                match=rf"answered 307 .*a redirect to '{other}/score'; redirects are not followed",
            ) as info:
                client(["a"], ["b"])
    assert info.value.status == 307 and "s3cret" not in str(info.value)
    assert seen == [] and count == [1]  # nothing reached the other host; a redirect is not retried


@contextlib.contextmanager
def trickling_server(header_first: bool):
    """A raw TCP server that reads a request, then sends its answer one byte every 0.3 s (``header_first``:
    the status line and headers at once, then the body slowly; else everything slowly)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()
    body = b'{"rewards": [1.0]}'
    head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            slow = body if header_first else head + body
            if header_first:
                conn.sendall(head)
            for i in range(len(slow)):
                if stop.wait(0.3):
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(slow[i : i + 1])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.mark.parametrize("header_first", [True, False], ids=["slow-body", "slow-headers"])
def test_the_client_timeout_bounds_the_whole_answer(header_first):
    with trickling_server(header_first) as url:
        start = time.monotonic()
        with pytest.raises(RewardServerError, match=r"timed out: no answer within 1 s") as info:
            RewardClient(url, timeout=1, retries=3, backoff=0.01)(["a"], ["b"])
        elapsed = time.monotonic() - start
    assert info.value.status is None
    assert 0.9 < elapsed < 3, elapsed


# --------------------------------------------------------------------------------------------------------
# reward server
# --------------------------------------------------------------------------------------------------------


def length_reward(prompts, responses):
    return [float(len(p) + len(r)) for p, r in zip(prompts, responses, strict=True)]


def raw_exchange(url: str, data: bytes, *, shut_write: bool = False, timeout: float = 5) -> tuple[int, dict]:
    """Send raw bytes, read the whole answer; ``(status, JSON body)``."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.0", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize(
    "body, headers, status, match",
    [
        (b"[" * 100_000, None, 400, "nests too deeply"),
        (b'{"prompts": [' * 30_000, None, 400, "nests too deeply|not valid JSON"),
        (b"\xff\xfe\xfd", None, 400, "not valid JSON"),
        (b'{"prompts": ["\\ud800"], "responses": ["b"]}', None, 400, "prompts[0] is not valid Unicode"),
        (b"[1, 2]", None, 400, "must be a JSON object"),
        (b"{}", {"Content-Length": "-5"}, 400, "bad Content-Length '-5'"),
        (b"{}", {"Content-Length": "+2"}, 400, "bad Content-Length"),
        (b"{}", {"Content-Length": "1_0"}, 400, "bad Content-Length"),
        (b"{}", {"Content-Length": "x"}, 400, "bad Content-Length"),
        (b"{}", {"Content-Length": "9" * 40}, 400, "bad Content-Length"),
        (b"{}", {}, 411, "needs a Content-Length"),
    ],
    ids=[
        "deep-list",
        "deep-object",
        "not-utf8",
        "surrogate",
        "not-object",
        "negative",
        "plus",
        "underscore",
        "word",
        "huge",
        "missing",
    ],
)
def test_the_server_answers_malformed_requests_with_json(capfd, body, headers, status, match):
    headers = {"Content-Length": str(len(body))} if headers is None else headers
    with RewardServer(length_reward, port=0) as server:
        got, answer = raw_exchange(server.url, post("/score", body, headers), shut_write=True)
        assert RewardClient(server.url)(["a"], ["bc"]) == [3.0]  # the server still serves
    assert got == status and set(answer) == {"error"}
    assert any(part in answer["error"] for part in match.split("|")), answer
    assert "Traceback" not in capfd.readouterr().err


def test_the_server_answers_a_short_or_stalled_body():
    with RewardServer(length_reward, port=0, request_timeout=0.3) as server:
        got, answer = raw_exchange(
            server.url, post("/score", b'{"pro', {"Content-Length": "100"}), shut_write=True
        )
        assert got == 400 and "ended after 5 of 100 bytes" in answer["error"]
        start = time.monotonic()
        got, answer = raw_exchange(server.url, post("/score", b'{"pro', {"Content-Length": "100"}))
        assert got == 408 and "did not arrive within 0.3 s" in answer["error"]
        assert time.monotonic() - start < 3


def test_a_wrong_token_with_a_large_body_gets_401_at_once_without_retries():
    with RewardServer(length_reward, port=0, token="s3cret") as server:
        client = RewardClient(server.url, token="wrong", retries=3, backoff=1.0)
        start = time.monotonic()
        with pytest.raises(
            RewardServerError, match="HTTP 401 Unauthorized: missing or wrong bearer token"
        ) as info:
            client(["p" * (8 * 2**20)], ["r"])
        assert info.value.status == 401
        assert time.monotonic() - start < 1.0  # no retry (the first would wait backoff = 1 s)
        # The token is checked before the body is parsed: a hostile body without the token gets 401.
        got, answer = raw_exchange(server.url, post("/score", b"[" * 100_000, {"Content-Length": "100000"}))
        assert got == 401 and answer == {"error": "missing or wrong bearer token"}


# --------------------------------------------------------------------------------------------------------
# rlbits serve-reward
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["in-use", 70000, -1])
def test_serve_reward_reports_port_errors_in_one_line(capsys, port):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        in_use = port == "in-use"
        port = busy.getsockname()[1] if in_use else port
        args = build_parser().parse_args(["serve-reward", "arithmetic", "--port", str(port)])
        assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rlbits serve-reward: cannot listen on 127.0.0.1 port {port}: ")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ("Address already in use" if in_use else "[0, 65535]") in err
