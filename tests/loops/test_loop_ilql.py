"""ILQL loop: smoke run, exact resume, target-head sync, steered decoding, dataset and config errors."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from metrics_compare import untimed
from tensordict import MemoryMappedTensor

from rlbits.batch import trim_padding
from rlbits.data import offline
from rlbits.distributed.env import DistEnv
from rlbits.functional import ilql_logits
from rlbits.loops import ilql
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.run import read_metrics, total_steps
from rlbits.loops.update import Denominators
from rlbits.models.forward import position_ids_from_mask
from rlbits.models.heads import ILQLModel
from rlbits.models.load import load_pretrained, save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer
from rlbits.rollout.generate import generate
from rlbits.text import tokenize_prompts

PROMPTS = ["hello there", "abc", "the cat sat", "x y z", "a dog", "on a mat"]
SAMPLES = [(p, r, float(r.count("a")) - 1.0) for p in PROMPTS for r in (" a a", " bc", " aaa", " dog")]


def reward(prompts, responses, **_):
    return [r.count("a") / max(1, len(r)) for r in responses]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("ilql") / "model"
    save_pretrained(tiny_causal_lm(vocab_size=64, seed=0), tiny_tokenizer(64), path)
    return str(path)


def make_cfg(tiny_path, run_dir, **kw):
    values = dict(
        policy=tiny_path,
        run_dir=str(run_dir),
        max_num_steps=2,
        batch_size=8,
        microbatch_size=4,
        dataset_size=16,
        dataset_batch_size=8,
        max_new_tokens=6,
        val_period=2,
        save_period=2,
        max_val_samples=4,
        log_samples=2,
        learning_rate=1e-3,
        progress=False,
        tensorboard=False,
        device="cpu",
    )
    values.update(kw)
    return config_from_dict(ilql.ILQLConfig, values)


# --- the loop ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_step_smoke_run_builds_dataset_and_writes_the_run(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path / "run", alpha=1.0, steps_for_target_q_sync=1, tensorboard=True)
    out = ilql.train(cfg, reward=reward, prompts=PROMPTS)
    assert out == tmp_path / "run"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["dataset/size"] == 16 and "val_reward" in rows[0] and "val_reward_policy" in rows[0]
    for key in (
        "loss",
        "loss_q",
        "loss_v",
        "loss_cql",
        "loss_awac",
        "q_mean",
        "target_q_mean",
        "v_mean",
        "td_target_mean",
        "advantage_mean",
        "rewards",
        "grad_norm",
        "epoch",
        "tokens_per_s",
    ):
        assert math.isfinite(rows[1][key]), key
    assert "val_reward" in rows[2]
    # the offline set: 16 scored samples with their exact token ids, memory-mapped for training and as JSONL
    data = [json.loads(ln) for ln in (out / "offline_dataset.jsonl").read_text().splitlines()]
    assert len(data) == 16 and {"prompt", "response", "reward", "prompt_ids", "response_ids"} <= set(data[0])
    assert data[0]["reward"] == pytest.approx(reward([data[0]["prompt"]], [data[0]["response"]])[0])
    tensors = offline.load_tensors(out / "offline_dataset")
    assert tensors.batch_size == (16,) and tensors["rewards"].tolist() == pytest.approx([r["reward"] for r in data])
    assert tensors["responses"][0, : len(data[0]["response_ids"])].tolist() == data[0]["response_ids"]
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert sorted(hidden) == [".rlbits-run", ".rlbits-run.lock"]  # the run's marker and lock; no temporary folder
    for name in ("config.yaml", "samples.jsonl", "tensorboard", "checkpoints/step_2/dcp/.metadata"):
        assert (out / name).exists(), name
    state = json.loads((out / "checkpoints/step_2/state.json").read_text())
    assert state["step"] == 2 and state["sampler"]["consumed_samples"] == 16 and state["total_steps"] == 2
    assert rows[2]["epoch"] == 1 and state["total_valid_tokens"] > 0
    # final/: an HF policy folder plus the heads; alpha=1 every step leaves targets equal to online heads
    policy, tok = load_pretrained(out / "final")
    assert tok.eos_token_id == 63
    model = ILQLModel.from_pretrained(out / "final")
    for a, b in zip(model.q1.parameters(), model.target_q1.parameters(), strict=True):
        assert torch.equal(a, b)
    fresh = tiny_causal_lm(vocab_size=64, seed=0)
    assert not torch.equal(policy.lm_head.weight, fresh.lm_head.weight)  # the trunk trained


RESUME_KW = dict(max_num_steps=4, batch_size=4, microbatch_size=3, alpha=0.3, steps_for_target_q_sync=1)


class StopAfter2:
    def __init__(self):
        self.step = 0

    def on_metrics(self, step, metrics):
        self.step = step

    def should_stop(self):
        return self.step >= 2


@pytest.fixture(scope="module")
def full_run(tiny_path, tmp_path_factory):
    """The uninterrupted 4-step run the resumed ones must reproduce."""
    cfg = make_cfg(tiny_path, tmp_path_factory.mktemp("ilql_full") / "full", **RESUME_KW)
    return ilql.train(cfg, samples=SAMPLES, reward=reward)


def _cut_run(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path / "cut", **RESUME_KW)
    ilql.train(cfg, samples=SAMPLES, reward=reward, callbacks=[StopAfter2()])
    assert [r["step"] for r in read_metrics(cfg.run_dir)] == [0, 1, 2]
    assert (tmp_path / "cut" / "final").is_dir()  # every loop exports final/ at its end, stopped or not
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("holds", ["memmap", "jsonl"])
def test_resume_reproduces_the_uninterrupted_run(holds, full_run, tiny_path, tmp_path):
    """Resumed from its step-2 checkpoint, the run logs the uninterrupted run's steps 3-4 and ends with its
    weights, bit for bit: the replay buffer draws the same batches from the checkpoint's ``consumed_samples``.
    ``memmap``: the dataset comes back from RUN_DIR/offline_dataset/ alone (the JSONL export is deleted, so
    training cannot be reading it). ``jsonl``: a run directory from before the memory-mapped folder holds
    only offline_dataset.jsonl; it is converted on resume."""
    cfg = _cut_run(tiny_path, tmp_path)
    run_dir = tmp_path / "cut"
    if holds == "memmap":
        (run_dir / "offline_dataset.jsonl").unlink()
    else:
        shutil.rmtree(run_dir / "offline_dataset")
    ilql.train(cfg, resume=True, reward=reward)  # no samples=: the dataset comes back from the run directory
    assert (run_dir / "offline_dataset" / "meta.json").is_file()
    a, b = read_metrics(full_run), read_metrics(cfg.run_dir)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a[3:], b[3:], strict=True):
        assert untimed(ra) == untimed(rb)
    assert "val_reward" in b[4]
    m1, m2 = ILQLModel.from_pretrained(full_run / "final"), ILQLModel.from_pretrained(cfg.run_dir + "/final")
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


@pytest.mark.slow
def test_resume_without_the_dataset_is_an_error(tiny_path, tmp_path):
    cfg = _cut_run(tiny_path, tmp_path)
    shutil.rmtree(tmp_path / "cut" / "offline_dataset")
    (tmp_path / "cut" / "offline_dataset.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="offline dataset"):
        ilql.train(cfg, resume=True, reward=reward)


@pytest.mark.slow
def test_resume_without_checkpoint_is_an_error(tiny_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ilql.train(make_cfg(tiny_path, tmp_path / "none"), resume=True, samples=SAMPLES)


@pytest.mark.slow
def test_non_finite_loss_names_the_step_and_saves_nothing(tiny_path, tmp_path):
    bad = [(p, r, 1e39) for p, r, _ in SAMPLES]  # finite in float64, inf in float32
    cfg = make_cfg(tiny_path, tmp_path / "nan", val_at_start=False)
    with pytest.raises(FloatingPointError, match="step 1, phase update"):
        ilql.train(cfg, samples=bad)
    assert not (tmp_path / "nan" / "checkpoints").exists()


def test_epochs_cycle_with_a_fresh_shuffle(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path / "ep", max_num_steps=100, max_num_epochs=2, batch_size=16)
    assert total_steps(cfg, len(SAMPLES), cfg.batch_size) == 3  # ceil(2 * 24 / 16)
    from rlbits.data.stream import PromptStream

    stream = PromptStream(list(range(24)), 0)
    first, second = stream.next(24), stream.next(24)
    assert sorted(first) == sorted(second) == list(range(24)) and first != second


# --- target heads -----------------------------------------------------------------------------------


def _heads(model):
    return [p.detach().clone() for p in model.q1.parameters()], [
        p.detach().clone() for p in model.target_q1.parameters()
    ]


@pytest.mark.parametrize("alpha,period", [(0.25, 1), (1.0, 3), (0.5, 2)])
def test_target_sync_polyak_and_periodic(alpha, period):
    model = ILQLModel(tiny_causal_lm(vocab_size=64), head_layers=1, seed=0)
    cfg = ilql.ILQLConfig(alpha=alpha, steps_for_target_q_sync=period)
    for step in range(1, 7):
        with torch.no_grad():
            for p in list(model.q1.parameters()) + list(model.q2.parameters()):
                p.add_(0.1 * step)
        online, before = _heads(model)
        state = SimpleNamespace(model=model, step=step - 1)  # the phase runs before the step is counted
        assert ilql.sync_targets(state, None, cfg) is None
        synced = step % period == 0
        _, after = _heads(model)
        for o, b, a in zip(online, before, after, strict=True):
            expected = alpha * o + (1 - alpha) * b if synced else b
            torch.testing.assert_close(a, expected)


# --- steered decoding -------------------------------------------------------------------------------


def _prompts(tok):
    return tokenize_prompts(tok, ["hello", "a cat sat", "x"])


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_steered_beta0_equals_the_policy_greedy_decode(shared_trunk):
    tok = tiny_tokenizer(64)
    model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=3), shared_trunk=shared_trunk, seed=1).eval()
    kw = dict(max_new_tokens=8, temperature=0.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    plain = generate(model.policy, _prompts(tok), **kw)
    steered = generate(ilql.SteeredPolicy(model, 0.0), _prompts(tok), **kw)
    assert torch.equal(plain["responses"], steered["responses"])
    assert torch.equal(plain["action_mask"], steered["action_mask"])


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_steered_decode_with_cache_matches_full_forward_argmax(shared_trunk):
    """Greedy steered decoding (KV cache) picks argmax of ilql_logits from a full forward each step."""
    tok = tiny_tokenizer(64)
    model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=4), shared_trunk=shared_trunk, seed=2).eval()
    with torch.no_grad():  # make the heads matter
        for p in list(model.target_q1.parameters()) + list(model.target_q2.parameters()):
            p.mul_(30.0)
    beta = 2.0
    kw = dict(max_new_tokens=6, temperature=0.0, eos_token_id=None, pad_token_id=tok.pad_token_id)
    steered = generate(ilql.SteeredPolicy(model, beta), _prompts(tok), **kw)
    plain = generate(model.policy, _prompts(tok), **kw)
    assert not torch.equal(steered["responses"], plain["responses"])  # steering changed something
    ids, mask = steered["prompts"], steered["prompt_mask"]
    with torch.no_grad():
        for t in range(steered["responses"].shape[1]):
            out = model(ids, mask, position_ids_from_mask(mask))
            q = torch.minimum(out["target_q1"][:, -1], out["target_q2"][:, -1])
            nxt = ilql_logits(out["logits"][:, -1].float(), q, out["v"][:, -1], beta).argmax(-1)
            assert torch.equal(nxt, steered["responses"][:, t])
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)


def test_steered_policy_rejects_bad_arguments():
    with pytest.raises(TypeError, match="ILQLModel"):
        ilql.SteeredPolicy(tiny_causal_lm(vocab_size=64), 1.0)
    model = ILQLModel(tiny_causal_lm(vocab_size=64))
    with pytest.raises(ValueError, match="beta"):
        ilql.SteeredPolicy(model, -1.0)


# --- dataset ----------------------------------------------------------------------------------------


def test_samples_are_checked_and_tokenized_with_eos():
    rows = ilql.normalize_samples([("ab", " c", 1), {"prompt": "x", "response": "", "reward": 0.5, "id": 7}])
    assert rows[0] == {"prompt": "ab", "response": " c", "reward": 1.0} and rows[1]["id"] == 7
    tok = tiny_tokenizer(64)
    td = ilql.tensorize_dataset(rows, tok)
    assert td["responses"][0].tolist() == tok(" c")["input_ids"] + [tok.eos_token_id]
    assert td["action_mask"].sum(-1).tolist() == [3, 1]  # " c" + eos, and eos alone
    assert td["rewards"].tolist() == [1.0, 0.5]
    assert td["input_ids"].shape == (2, td["prompts"].shape[1] + td["responses"].shape[1])


@pytest.mark.parametrize(
    "samples,match",
    [
        ([], "non-empty"),
        ([("a", "b")], r"samples\[0\].*triple"),
        ([("a", "b", 1.0), ("", "b", 1.0)], r"samples\[1\]: prompt"),
        ([("a", 3, 1.0)], r"samples\[0\]: response"),
        ([("a", "b", "high")], r"samples\[0\]: reward must be a number"),
        ([("a", "b", float("nan"))], r"samples\[0\]: reward must be finite"),
        ([{"prompt": "a", "reward": 1}], r"samples\[0\] lacks.*response"),
    ],
)
def test_bad_samples_name_the_sample(samples, match):
    with pytest.raises(ValueError, match=match):
        ilql.normalize_samples(samples)


def test_dataset_file_round_trip_and_bad_json(tmp_path):
    rows = ilql.normalize_samples(SAMPLES[:3])
    path = ilql.save_dataset(rows, tmp_path / "d.jsonl")
    assert ilql.read_dataset(path) == rows
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "response": "b", "reward": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        ilql.read_dataset(tmp_path / "bad.jsonl")


def test_build_offline_dataset_is_seeded(tiny_path):
    policy, tok = load_pretrained(tiny_path)
    kw = dict(seed=3, temperature=1.0, max_new_tokens=5, batch_size=4)
    a = ilql.build_offline_dataset(reward, policy, tok, PROMPTS, 6, **kw)
    b = ilql.build_offline_dataset(reward, policy, tok, PROMPTS, 6, **kw)
    assert a == b and len(a) == 6 and len({r["prompt"] for r in a}) == 6
    with pytest.raises(ValueError, match="n must be >= 1"):
        ilql.build_offline_dataset(reward, policy, tok, PROMPTS, 0, **kw)


def _dataset(n=10):
    rows = ilql.normalize_samples([(f"p{i}", " a" * (i % 4), float(i)) for i in range(n)])
    return ilql.tensorize_dataset(rows, tiny_tokenizer(64))


def test_replay_buffer_draws_each_epoch_in_the_prompt_stream_order():
    """The sampler's draws are ``PromptStream(range(N), seed)``'s: every row once per epoch, a fresh seeded
    order each epoch, batches crossing an epoch's end continue into the next (and may be larger than N)."""
    from rlbits.data.stream import PromptStream

    buffer = offline.offline_buffer(_dataset(10), seed=3)
    stream = PromptStream(list(range(10)), 3)
    for size in (4, 4, 4, 13, 1, 7):
        assert buffer.sample(size)["rewards"].long().tolist() == stream.next(size)  # reward i marks row i
    assert buffer.sampler.consumed_samples == stream.consumed_samples == 33
    fresh = offline.offline_buffer(_dataset(10), seed=3)
    epoch0, epoch1 = (fresh.sample(10)["rewards"].long().tolist() for _ in range(2))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1


def test_replay_buffer_resumes_from_the_sample_count():
    """A buffer built with the consumed_samples a checkpoint stores (or given the sampler's state_dict) draws
    the batches the uninterrupted buffer draws next, and next_batch is the rows padding-trimmed."""
    data = _dataset(10)
    full = offline.offline_buffer(data, seed=5)
    drawn = [full.sample(4) for _ in range(2)]
    resumed = offline.offline_buffer(data, seed=5, consumed_samples=full.sampler.consumed_samples)
    restored = offline.offline_buffer(data, seed=0)
    restored.sampler.load_state_dict(full.sampler.state_dict())
    for _ in range(4):  # crosses into epochs 1 and 2
        want = full.sample(4)
        assert (resumed.sample(4) == want).all() and (restored.sample(4) == want).all()
    assert drawn[0]["rewards"].tolist() != drawn[1]["rewards"].tolist()
    again = offline.offline_buffer(data, seed=5)
    batch = offline.next_batch(again, 4)
    index, _ = offline.EpochSampler(5).sample(range(10), 4)
    expected = trim_padding(data[index])
    assert batch.batch_size == expected.batch_size and (batch == expected).all()
    assert batch["responses"].shape[1] <= data["responses"].shape[1]


def test_next_batch_gives_each_rank_its_slice_of_one_draw():
    data = _dataset(10)
    whole = offline.offline_buffer(data, seed=1).sample(6)["rewards"].tolist()
    parts = []
    for rank in range(3):
        buffer = offline.offline_buffer(data, seed=1)
        parts += offline.next_batch(buffer, 2, DistEnv(rank=rank, world_size=3))["rewards"].tolist()
        assert buffer.sampler.consumed_samples == 6  # every rank moves by the global batch
    assert parts == whole


def test_memmapped_dataset_round_trip_and_atomic_replace(tmp_path):
    data = _dataset(6)
    saved = offline.save_tensors(data, tmp_path / "offline_dataset")
    assert all(isinstance(v, MemoryMappedTensor) for v in saved.values()) and (saved == data).all()
    assert (offline.load_tensors(tmp_path / "offline_dataset") == data).all()
    offline.save_tensors(_dataset(3), tmp_path / "offline_dataset")  # a rebuilt set replaces the folder
    assert offline.load_tensors(tmp_path / "offline_dataset").batch_size == (3,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offline_dataset"]  # no .tmp-/.old- folder left
    with pytest.raises(FileNotFoundError, match="meta.json"):
        offline.load_tensors(tmp_path / "nothing")
    assert offline.dataset_stats(data)["dataset/size"] == 6.0
    assert offline.dataset_stats(data) == offline.dataset_stats([{"reward": float(i)} for i in range(6)])


def test_moved_names_stay_importable_from_the_loop():
    from rlbits.models.steered import SteeredPolicy

    assert ilql.SteeredPolicy is SteeredPolicy
    for name in ("build_offline_dataset", "normalize_samples", "save_dataset", "read_dataset", "tensorize_dataset",
                 "load_or_build_dataset", "dataset_stats", "next_batch"):
        assert getattr(ilql, name) is getattr(offline, name), name
    assert set(ilql.__all__) <= set(dir(ilql))


# --- config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("tau", 1.0, "tau must be in"),
        ("gamma", 1.5, "gamma must be in"),
        ("alpha", 2.0, "alpha must be in"),
        ("beta", -1.0, "beta must be"),
        ("cql_scale", float("inf"), "cql_scale must be"),
        ("batch_size", 0, "batch_size must be >= 1"),
        ("steps_for_target_q_sync", 0, "steps_for_target_q_sync must be >= 1"),
        ("dataset_size", 0, "dataset_size must be >= 1"),
        ("head_layers", 3, "head_layers must be 1"),
        ("loop", "ppo", "loop must be 'ilql'"),
        ("dataset_temperature", 0.0, "dataset_temperature must be >= 0.0001"),
        ("dataset_path", "/no/such/file.jsonl", "dataset_path"),
        ("batch_size", "big", "batch_size must be int"),
        ("betta", 1.0, "did you mean beta"),
    ],
)
def test_config_errors_name_the_field(key, value, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(ilql.ILQLConfig, {key: value})


def test_config_defaults_are_valid_and_frozen():
    cfg = ilql.ILQLConfig()
    assert cfg.loop == "ilql"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.beta = 2.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="ILQLConfig"):
        ilql.train(object())  # type: ignore[arg-type]


def test_yaml_config_loads():
    from pathlib import Path

    from rlbits.loops.config import load_config

    path = Path(__file__).resolve().parents[2] / "configs" / "ilql_sentiment.yaml"
    cfg = load_config(ilql.ILQLConfig, path)
    assert cfg.loop == "ilql" and cfg.task == "sentiment"


def test_awac_beta_weights_the_behaviour_cloning_term_as_trlx():
    """``awac_beta`` reaches ``awac_loss``: the LM's NLL of each dataset token weighted by exp(beta (target Q - V)),
    detached; 0 (the default) is the plain NLL."""
    from rlbits.functional import awac_loss

    data = trim_padding(_dataset())
    model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=0), head_layers=1, seed=0)
    with torch.no_grad():  # move the heads off their init so Q - V is not ~0
        for p in [*model.target_q1.parameters(), *model.v.parameters()]:
            p.add_(0.3 * torch.randn_like(p))
    out = model(data["input_ids"], data["attention_mask"], position_ids_from_mask(data["attention_mask"]))
    n = data["action_mask"].sum()
    state, den = SimpleNamespace(model=model), Denominators(num_tokens=n, num_seqs=n, num_rows=n)
    plain = ilql.objective(state, data, ilql.ILQLConfig(), den)[1]["loss_awac"]
    weighted = ilql.objective(state, data, ilql.ILQLConfig(awac_beta=2.0), den)[1]["loss_awac"]
    P, R = data["prompts"].shape[1], data["responses"].shape[1]
    at = slice(P - 1, P - 1 + R)
    idx = data["responses"].unsqueeze(-1)
    target_q = torch.stack([out[k][:, at].gather(-1, idx).squeeze(-1) for k in ("target_q1", "target_q2")]).amin(0)
    expected, _ = awac_loss(out["logits"][:, at], data["responses"], data["action_mask"], n,
                            advantages=(target_q - out["v"][:, at]).detach(), beta=2.0)
    torch.testing.assert_close(weighted, expected.detach())
    assert not torch.allclose(weighted, plain)


@pytest.mark.slow
def test_standardize_rewards_trains_on_trlx_returns(tiny_path, tmp_path):
    """``standardize_rewards``: the set's rewards become trlx's ``(r - mean) / (std + eps)`` before training."""
    cfg = make_cfg(tiny_path, tmp_path / "run", max_num_steps=1, val_at_start=False, val_period=0,
                   val_at_end=False, standardize_rewards=True)
    row = read_metrics(ilql.train(cfg, reward=reward, samples=SAMPLES))[0]
    assert row["step"] == 0 and abs(row["dataset/reward_mean"]) < 1e-6
    assert row["dataset/reward_std"] == pytest.approx(1.0, abs=1e-5)


def test_top_k_filters_the_steered_logits():
    """trlx's ILQL ``top_k`` masks ``pi_beta + beta * adv``: rlbits' ``top_k`` reaches the steered logits (every
    sampled token is among the k best of ``ilql_logits``, not of the LM's own)."""
    tok = tiny_tokenizer(64)
    model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=4), seed=2).eval()
    with torch.no_grad():
        for p in list(model.target_q1.parameters()) + list(model.target_q2.parameters()):
            p.mul_(30.0)
    beta, k = 2.0, 3
    kw = dict(max_new_tokens=5, temperature=1.0, top_k=k, eos_token_id=None, pad_token_id=tok.pad_token_id)
    steered = generate(ilql.SteeredPolicy(model, beta), _prompts(tok), generator=torch.Generator().manual_seed(0), **kw)
    ids, mask = steered["prompts"], steered["prompt_mask"]
    with torch.no_grad():
        for t in range(steered["responses"].shape[1]):
            out = model(ids, mask, position_ids_from_mask(mask))
            q = torch.minimum(out["target_q1"][:, -1], out["target_q2"][:, -1])
            logits = ilql_logits(out["logits"][:, -1].float(), q, out["v"][:, -1], beta)
            kth = logits.topk(k, dim=-1).values[:, -1:]
            tokens = steered["responses"][:, t : t + 1]
            assert (logits.gather(-1, tokens) >= kth).all()
            ids = torch.cat([ids, tokens], dim=1)
            mask = torch.cat([mask, torch.ones_like(tokens, dtype=mask.dtype)], dim=1)
