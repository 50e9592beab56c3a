"""The remote critic (``rlbits serve-critic``, ``critic_server``): PPO with it gives the local critic's numbers
over 3 steps, survives a kill -9 of the server between steps, and refuses bad requests clearly."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlbits.distributed.env import DistEnv
from rlbits.loops.config import ConfigError, config_from_dict, save_config
from rlbits.loops.critic_client import CriticClient, CriticServerError
from rlbits.loops.critic_server import CriticServer
from rlbits.loops.ppo import PPOConfig, init_state, train
from rlbits.loops.run import read_metrics
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["the plot", "a film", "it was", "my day", "so this", "hello", "we saw", "an end"]
TOKEN = "s3cret-critic"


def reward(prompts, responses):
    return [min(r.count("a"), 4) / 4 for r in responses]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("critic") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), path)
    return str(path)


def make_cfg(policy_dir, run_dir, **overrides) -> PPOConfig:
    values = dict(
        policy=policy_dir, run_dir=str(run_dir), max_num_steps=3, num_prompts_per_step=4,
        num_generations_per_prompt=2, max_new_tokens=5, microbatch_size=3, ppo_epochs=2, num_minibatches=2,
        learning_rate=1e-3, critic_learning_rate=2e-3, value_clip_eps=0.2, lr_scheduler="cosine",
        lr_warmup_steps=2, critic_warmup_steps=1, max_val_samples=4, val_period=0, val_at_start=False,
        val_at_end=False, save_period=0, log_samples=0, progress=False, tensorboard=False,
    )
    values.update(overrides)
    return config_from_dict(PPOConfig, values)


def stable(rows):
    return [{k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s") and not k.startswith("time/")} for r in rows]


def final_weights(run_dir) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(Path(run_dir) / "final")
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def assert_same_run(a_dir, b_dir):
    a, b = stable(read_metrics(a_dir)), stable(read_metrics(b_dir))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        assert set(ra) == set(rb), set(ra) ^ set(rb)
        for k in ra:
            assert math.isclose(ra[k], rb[k], rel_tol=1e-5, abs_tol=1e-5), (ra["step"], k, ra[k], rb[k])
    for key in ("critic_loss", "values", "actor_loss", "critic_grad_norm", "critic_lr", "critic_warmup/critic_loss"):
        assert any(key in r for r in a), key
    assert torch.allclose(final_weights(a_dir), final_weights(b_dir), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def local_run(policy_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("local") / "run"
    train(make_cfg(policy_dir, run_dir), reward=reward, prompts=PROMPTS)
    return run_dir


@pytest.mark.slow
def test_remote_critic_gives_the_local_critics_numbers(policy_dir, local_run, tmp_path, monkeypatch):
    monkeypatch.setenv("RLBITS_CRITIC_TOKEN", TOKEN)
    cfg = make_cfg(policy_dir, tmp_path / "run")
    with CriticServer(cfg, tmp_path / "critic", port=0, token=TOKEN) as server:
        remote = make_cfg(policy_dir, tmp_path / "run", critic_server=server.url)
        train(remote, reward=reward, prompts=PROMPTS)
        assert server.update == 4  # one warm-up update and three steps
    assert_same_run(local_run, tmp_path / "run")
    assert "value_model" not in os.listdir(tmp_path / "run")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(config: Path, folder: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CRITIC_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbits", "serve-critic", str(config), "--dir", str(folder), "--port", str(port),
         "--token-env", "CRITIC_TOKEN"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc


@pytest.mark.slow
def test_remote_critic_survives_a_kill_9_between_steps(policy_dir, local_run, tmp_path, monkeypatch):
    """The server writes its checkpoint after every training request, before it answers. Killed after step
    1's log (the warm-up update and step 1's update answered, so saved: update 2), it restarts from that
    checkpoint: the critic's weights, its AdamW moments and step counts and the update counter as they were
    after step 1's training, bit for bit. Step 2's values request (retried by the client while the server is
    down) and everything after see exactly the critic of the uninterrupted run."""
    monkeypatch.setenv("RLBITS_CRITIC_TOKEN", TOKEN)
    port, folder = _free_port(), tmp_path / "critic"
    cfg = make_cfg(policy_dir, tmp_path / "run", critic_server=f"http://127.0.0.1:{port}", critic_server_timeout=120)
    config = tmp_path / "ppo.yaml"
    save_config(cfg, config)
    procs = [_start_server(config, folder, port)]
    restarted = threading.Event()

    class KillAfterStep1:
        def on_metrics(self, step, metrics):
            if step == 1:
                procs[0].send_signal(signal.SIGKILL)
                procs[0].wait()
                assert torch.load(folder / "critic.pt", weights_only=True)["update"] == 2

                def restart():  # a little later: the client sees the server down and waits for it
                    procs.append(_start_server(config, folder, port))
                    restarted.set()

                threading.Timer(0.5, restart).start()

    try:
        train(cfg, reward=reward, prompts=PROMPTS, callbacks=[KillAfterStep1()])
        assert restarted.is_set()
        assert CriticClient(cfg.critic_server).check_config(cfg) == 4
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert_same_run(local_run, tmp_path / "run")


def _post(url, path, body, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_clear_answers(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path / "run")
    with CriticServer(cfg, tmp_path / "critic", port=0, token=TOKEN) as server:
        status, answer = _post(server.url, "/values", b"{}", token="wrong")
        assert status == 401 and "bearer token" in answer["error"]
        status, answer = _post(server.url, "/values", b"[1]")
        assert status == 400 and "JSON object" in answer["error"]
        ids = [[1, 2, 3]]
        good = {"update": 0, "input_ids": ids, "attention_mask": [[True] * 3], "responses": [[3]],
                "action_mask": [[True]]}
        status, answer = _post(server.url, "/values", json.dumps({**good, "attention_mask": None}).encode())
        assert status == 400 and "'attention_mask'" in answer["error"]
        status, answer = _post(server.url, "/values", json.dumps({**good, "action_mask": [[True, True]]}).encode())
        assert status == 400 and "'action_mask' has shape [1, 2]" in answer["error"]
        status, answer = _post(server.url, "/values", json.dumps({k: v for k, v in good.items() if k != "responses"}).encode())
        assert status == 400 and "missing field 'responses'" in answer["error"]
        status, answer = _post(server.url, "/values", json.dumps({**good, "update": 3}).encode())
        assert status == 409 and "holds update 0" in answer["error"]
        status, answer = _post(server.url, "/values", json.dumps(good).encode())
        assert status == 200 and len(answer["values"]) == 1 and len(answer["values"][0]) == 1
        train_fields = {"step": 0, "run_length": 3, "group": [0], "values": [[0.5]], "returns": [[1.0]]}
        status, answer = _post(server.url, "/train", json.dumps({**good, **train_fields}).encode())
        assert status == 400 and "'generator'" in answer["error"]
        with pytest.raises(ConfigError, match="learning_rate: here 0.5"):
            CriticClient(server.url, token=TOKEN).check_config(make_cfg(policy_dir, tmp_path / "x", learning_rate=0.5))
        with pytest.raises(CriticServerError, match=f"critic server {server.url}.*401.*RLBITS_CRITIC_TOKEN"):
            CriticClient(server.url, token="wrong").check_config(cfg)
        url = server.url
    with pytest.raises(CriticServerError, match=f"critic server {url} .*no answer within 1 s"):
        CriticClient(url, token=TOKEN, timeout=1).check_config(cfg)


def test_torchrun_and_bad_urls_are_refused(policy_dir, tmp_path):
    with pytest.raises(ConfigError, match="critic_server must be an http"):
        make_cfg(policy_dir, tmp_path / "run", critic_server="localhost:8001")
    cfg = make_cfg(policy_dir, tmp_path / "run", critic_server="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="critic_server runs in one process only; this run has 2"):
        init_state(cfg, DistEnv(world_size=2))


def test_serve_critic_cli_refuses_clearly(tmp_path, capsys, monkeypatch):
    from rlbits.cli import build_parser

    monkeypatch.delenv("RLBITS_TEST_UNSET_TOKEN", raising=False)
    config = tmp_path / "reinforce.yaml"
    config.write_text("loop: reinforce\n")
    args = build_parser().parse_args(["serve-critic", str(config), "--token-env", "RLBITS_TEST_UNSET_TOKEN"])
    assert args.func(args) == 2
    assert "environment variable RLBITS_TEST_UNSET_TOKEN is unset or empty" in capsys.readouterr().err
    args = build_parser().parse_args(["serve-critic", str(config), "--port", "0"])
    assert args.func(args) == 2
    assert "is a reinforce config; serve-critic serves a ppo run's critic" in capsys.readouterr().err
