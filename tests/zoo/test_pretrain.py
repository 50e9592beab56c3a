"""Base-model builder: tokenizer, a few-step pretrain into a temp dir, loading, determinism, cache, evaluate."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlbits.zoo.builder as builder
import rlbits.zoo.cache as zoo_cache
import rlbits.zoo.evaluator as zoo_eval
from rlbits import zoo
from rlbits.tasks import TASKS, arithmetic, get_task, sentiment

TINY = dict(steps=3, batch_size=8, n_embd=16, n_layer=1, n_head=2, corpus_size=300, progress=False)


@pytest.fixture(scope="module")
def tiny_arith(tmp_path_factory):
    return builder.pretrain("arithmetic", tmp_path_factory.mktemp("a") / "model", seed=0, **TINY)


def test_tokenizer_digits_single_tokens_and_specials():
    tok = builder.train_tokenizer(arithmetic.corpus(500, seed=0) + ["1111111111 2222222222 12341234"] * 50, 300)
    assert tok.tokenize("123+45=168") == ["1", "2", "3", "+", "4", "5", "=", "1", "6", "8"]
    # Even digit runs repeated many times are never merged.
    assert all(len(t.lstrip("Ġ")) <= 1 for t in tok.tokenize("1111111111 2222222222 12341234"))
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id) == ("<pad>", 0, "<eos>", 1)
    assert tok("7+8=")["input_ids"] == tok.convert_tokens_to_ids(["7", "+", "8", "="])  # no specials added
    assert tok.padding_side == "left"


def test_tokenizer_round_trips_text():
    docs = sentiment.corpus(200, seed=0)
    tok = builder.train_tokenizer(docs, 400)
    for doc in docs[:20]:
        assert tok.decode(tok(doc)["input_ids"]) == doc
    assert len(tok("I watched it last weekend, and the editing")["input_ids"]) < 20  # merges happened
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        builder.train_tokenizer(docs, 100)


@pytest.mark.slow
def test_pretrain_folder_loads(tiny_arith):
    model = AutoModelForCausalLM.from_pretrained(tiny_arith)
    tok = AutoTokenizer.from_pretrained(tiny_arith)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert (
        model.config.eos_token_id == tok.eos_token_id == 1
        and model.config.pad_token_id == tok.pad_token_id == 0
    )
    assert tok.tokenize("12+3=") == ["1", "2", "+", "3", "="]
    info = json.loads((Path(tiny_arith) / "base_model.json").read_text())
    assert info["task"] == "arithmetic" and info["seed"] == 0 and info["steps"] == 3
    assert info["params"] == sum(p.numel() for p in model.parameters())
    assert info["final_loss"] > 0 and info["build_seconds"] >= 0
    assert (Path(tiny_arith) / "model.safetensors").exists()
    # No temporary folders left beside it.
    assert [p.name for p in Path(tiny_arith).parent.iterdir()] == ["model"]


@pytest.mark.slow
def test_pretrain_deterministic(tiny_arith, tmp_path):
    again = builder.pretrain("arithmetic", tmp_path / "again", seed=0, **TINY)
    other = builder.pretrain("arithmetic", tmp_path / "other", seed=1, **TINY)
    w0 = load_file(Path(tiny_arith) / "model.safetensors")
    w1 = load_file(Path(again) / "model.safetensors")
    w2 = load_file(Path(other) / "model.safetensors")
    assert w0.keys() == w1.keys()
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert not all(torch.equal(w0[k], w2[k]) for k in w0 if w0[k].shape == w2[k].shape)
    assert (Path(tiny_arith) / "tokenizer.json").read_text() == (
        Path(again) / "tokenizer.json"
    ).read_text()


@pytest.mark.slow
def test_pretrain_restores_global_state(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    builder.pretrain("sentiment", tmp_path / "s", seed=0, **TINY)
    assert torch.equal(torch.rand(3), expected)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.slow
def test_pretrain_replaces_existing_folder(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an old model folder is replaced whole
    (out / "stale.txt").write_text("old")
    assert builder.pretrain("arithmetic", out, seed=0, **TINY) == str(out)
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.slow
def test_pretrain_refuses_to_overwrite_a_folder_that_is_not_a_model(tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        builder.pretrain("arithmetic", out, seed=0, **TINY)
    assert (out / "mine.txt").read_text() == "keep me"


@pytest.mark.slow
def test_pretrain_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        builder.pretrain("chess", tmp_path / "x")
    with pytest.raises(ValueError, match=r"n_embd \(30\) must be divisible by n_head \(4\)"):
        builder.pretrain("arithmetic", tmp_path / "x", n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        builder.pretrain("arithmetic", tmp_path / "x", steps=0)
    with pytest.raises(ValueError, match="more than n_positions=4"):
        builder.pretrain("arithmetic", tmp_path / "x", n_positions=4, **TINY)
    assert not (tmp_path / "x").exists()


def _reference_greedy(model, tok, prompt: str, max_new_tokens: int) -> str:
    # Slow reference: argmax one token at a time, no cache, stop at EOS.
    ids = tok(prompt)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            out.append(nxt)
    return tok.decode(out, skip_special_tokens=True)


@pytest.mark.slow
def test_evaluate_greedy_matches_reference(tiny_arith):
    res = zoo_eval.evaluate(tiny_arith, "arithmetic", n=12, max_new_tokens=4)
    assert res["n"] == 12 and set(res) == {"mean", "std", "accuracy", "n", "samples"}
    model = AutoModelForCausalLM.from_pretrained(tiny_arith).eval()
    tok = AutoTokenizer.from_pretrained(tiny_arith)
    prompts = arithmetic.prompts("test")[:8]
    assert [s[0] for s in res["samples"]] == prompts
    assert [s[1] for s in res["samples"]] == [_reference_greedy(model, tok, p, 4) for p in prompts]
    rewards = arithmetic.reward(prompts, [s[1] for s in res["samples"]])
    assert [s[2] for s in res["samples"]] == rewards


@pytest.mark.slow
def test_evaluate_sampling_seeded(tiny_arith):
    a = zoo_eval.evaluate(tiny_arith, "arithmetic", greedy=False, n=10, max_new_tokens=3, seed=5)
    b = zoo_eval.evaluate(tiny_arith, "arithmetic", greedy=False, n=10, max_new_tokens=3, seed=5)
    assert a == b
    with pytest.raises(ValueError, match="split must be one of"):
        zoo_eval.evaluate(tiny_arith, "arithmetic", split="dev")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path))
    assert zoo_cache.default_model_dir("sentiment") == tmp_path / "sentiment-base"
    monkeypatch.delenv("RLBITS_CACHE")
    assert zoo_cache.cache_dir() == Path.home() / ".cache" / "rlbits"


def test_base_model_builds_once(monkeypatch, tmp_path):
    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path))
    calls = []

    def fake_pretrain(task, out_dir=None, **kwargs):
        calls.append((task, out_dir))
        out_dir.mkdir(parents=True)
        (out_dir / "base_model.json").write_text(json.dumps(builder.build_settings()))
        return str(out_dir)

    monkeypatch.setattr(builder, "pretrain", fake_pretrain)
    path = zoo.base_model("arithmetic")
    assert path == str(tmp_path / "arithmetic-base")
    assert zoo.base_model("arithmetic") == path
    assert calls == [("arithmetic", tmp_path / "arithmetic-base")]
    with pytest.raises(ValueError, match="unknown task"):
        zoo.base_model("chess")
    with pytest.raises(ValueError, match="unknown task"):
        builder.ensure_base_model("chess")


def _fake_build(calls, threads=None):
    def fake_pretrain(task, out_dir=None, **kwargs):
        calls.append((task, out_dir))
        out_dir.mkdir(parents=True, exist_ok=True)
        info = {**builder.build_settings(), **({} if threads is None else {"torch_threads": threads})}
        (out_dir / "base_model.json").write_text(json.dumps(info))
        return str(out_dir)

    return fake_pretrain


def test_base_model_rebuilds_a_cached_model_built_with_other_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(builder, "pretrain", _fake_build(calls, threads=2))
    zoo.base_model("arithmetic")  # an old build at the caller's 2 threads
    monkeypatch.setattr(builder, "pretrain", _fake_build(calls))
    path = Path(zoo.base_model("arithmetic"))  # rebuilt with BUILD_THREADS
    assert len(calls) == 2 and json.loads((path / "base_model.json").read_text())["torch_threads"] == 1
    assert zoo.base_model("arithmetic") == str(path) and len(calls) == 2  # now current: kept
    info = json.loads((path / "base_model.json").read_text())
    (path / "base_model.json").write_text(json.dumps({**info, "torch_version": "1.0.0"}))
    with pytest.warns(RuntimeWarning, match=r"built with torch 1\.0\.0, this is torch .*rlbits pretrain arithmetic"):
        zoo.base_model("arithmetic")  # another torch version: a warning, no rebuild
    assert len(calls) == 2
    del info["torch_threads"]
    (path / "base_model.json").write_text(json.dumps(info))  # unrecorded thread count: rebuilt
    zoo.base_model("arithmetic")
    assert len(calls) == 3


def test_base_model_waiting_for_a_held_lock_says_so_and_times_out(monkeypatch, tmp_path, capsys):
    import fcntl
    import os
    import threading

    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path))
    monkeypatch.setattr(zoo_cache, "LOCK_REPORT_EVERY_S", 0.2)
    lock = tmp_path / ".arithmetic-base.lock"
    folder = tmp_path / "arithmetic-base"
    with open(lock, "a+") as held:  # another process's build (flock: another open file conflicts)
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        with pytest.raises(TimeoutError, match=r"gave up after 1 s waiting for another process \(pid 4242\)") as e:
            zoo.base_model("arithmetic", lock_timeout=0.7)
        assert f"remove {lock}" in str(e.value) and "RLBITS_LOCK_TIMEOUT" in str(e.value)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "waiting for another process" in line]
        assert len(lines) >= 3  # at once, then every LOCK_REPORT_EVERY_S
        assert f"(pid 4242) building {folder}" in lines[0] and f"Lock file: {lock}" in lines[0]
        assert f"remove {lock} and retry" in lines[0]
        monkeypatch.setenv("RLBITS_LOCK_TIMEOUT", "0.3")  # the environment's bound
        with pytest.raises(TimeoutError, match="now 0.3"):
            zoo.base_model("arithmetic")
        monkeypatch.setenv("RLBITS_LOCK_TIMEOUT", "soon")
        with pytest.raises(ValueError, match="RLBITS_LOCK_TIMEOUT must be a number of seconds, got 'soon'"):
            zoo.base_model("arithmetic")
        monkeypatch.delenv("RLBITS_LOCK_TIMEOUT")
        # The other process finishes its build and lets go: the waiter uses that build, builds nothing.
        calls = []
        monkeypatch.setattr(builder, "pretrain", _fake_build(calls))

        def finish():
            _fake_build([])("arithmetic", folder)
            fcntl.flock(held, fcntl.LOCK_UN)

        timer = threading.Timer(0.5, finish)
        timer.start()
        assert zoo.base_model("arithmetic", lock_timeout=30) == str(folder)
        timer.join()
    assert calls == [] and lock.read_text() == f"{os.getpid()}\n"  # the last holder wrote its pid


@pytest.mark.slow
def test_pretrain_weights_do_not_depend_on_the_callers_threads(tmp_path):
    # Before the build used its own thread count these differed (1 vs 2 threads, even this tiny recipe).
    before = torch.get_num_threads()
    paths = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            paths.append(Path(builder.pretrain("arithmetic", tmp_path / f"t{threads}", seed=0, **TINY)))
            assert torch.get_num_threads() == threads  # the caller's count is restored
    finally:
        torch.set_num_threads(before)
    one, two = ((p / "model.safetensors").read_bytes() for p in paths)
    assert one == two
    info = json.loads((paths[1] / "base_model.json").read_text())
    assert info["torch_threads"] == builder.BUILD_THREADS == 1 and info["deterministic_algorithms"] is True
    assert info["torch_version"] == torch.__version__


def test_cli_pretrain_prints_path_last(monkeypatch, tmp_path, capsys):
    from rlbits import cli

    seen = {}

    def fake_pretrain(task, out_dir=None, *, seed=0, steps=None, progress=True):
        seen.update(task=task, out_dir=out_dir, seed=seed, steps=steps)
        print("training...")
        return str(tmp_path / "built")

    monkeypatch.setattr(builder, "pretrain", fake_pretrain)
    assert (
        cli.main(["pretrain", "arithmetic", "--out", str(tmp_path / "o"), "--seed", "3", "--steps", "7"]) == 0
    )
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "built")
    assert seen == dict(task="arithmetic", out_dir=str(tmp_path / "o"), seed=3, steps=7)
    with pytest.raises(SystemExit):
        cli.main(["pretrain", "chess"])
    assert "invalid choice: 'chess'" in capsys.readouterr().err


def test_loss_starts_after_separator():
    tok = builder.train_tokenizer(["12+34=46", "5+6=11"], 260)
    data, lengths = builder.encode_corpus(tok, ["12+34=46", "5+6=11"], 16)
    assert lengths.tolist() == [9, 7]  # digits, +, =, answer digits, <eos>
    assert builder.loss_starts(tok, data, "=").tolist() == [6, 4]
    assert builder.loss_starts(tok, data, None).tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"loss_after='\*' does not occur in every corpus document"):
        builder.loss_starts(tok, data, "*")
    with pytest.raises(ValueError, match="loss_after must be a single token"):
        builder.loss_starts(tok, data, "+=")


@pytest.mark.slow
def test_plateau_check_runs_and_keeps_model(tiny_arith):
    before = (Path(tiny_arith) / "model.safetensors").read_bytes()
    res = zoo_eval.plateau_check(tiny_arith, "arithmetic", cpu_seconds=0.5, n=6)
    assert res["steps"] >= 1 and res["cpu_seconds"] >= 0.5
    assert res["lr"] == pytest.approx(0.1 * builder.RECIPES["arithmetic"]["lr"])
    assert res["before"]["n"] == res["after"]["n"] == 6
    assert (Path(tiny_arith) / "model.safetensors").read_bytes() == before


def test_recipes_are_those_of_the_cached_builds():
    # Pinned: these settings (and their order, which base_model.json keeps) define what a cached
    # ``<task>-base`` folder holds; they moved from the task modules' ``PRETRAIN`` dicts unchanged.
    assert list(builder.RECIPES["sentiment"].items()) == [
        ("vocab_size", 1024), ("n_embd", 128), ("n_layer", 4), ("n_head", 4), ("n_positions", 128),
        ("steps", 1000), ("batch_size", 32), ("lr", 2e-3), ("corpus_size", 30_000), ("max_new_tokens", 40),
        ("loss_after", None),
    ]
    assert list(builder.RECIPES["arithmetic"].items()) == [
        ("vocab_size", 300), ("n_embd", 128), ("n_layer", 3), ("n_head", 4), ("n_positions", 64),
        ("steps", 1500), ("batch_size", 64), ("lr", 3e-3), ("corpus_size", 60_000), ("max_new_tokens", 6),
        ("loss_after", "="),
    ]
    synthetic = [t for t in TASKS if getattr(get_task(t), "BASE_MODEL", None) is None]  # imdb, math: zoo models
    assert sorted(builder.RECIPES) == sorted(synthetic)
    assert all(tuple(k for k in r if k not in builder.OPTIONAL_SETTINGS) == builder.SETTINGS for r in builder.RECIPES.values())


@pytest.mark.slow
def test_task_registered_outside_rlbits_brings_its_recipe(monkeypatch, tmp_path):
    import sys
    import types

    mod = types.ModuleType("my_task")
    mod.corpus = arithmetic.corpus
    monkeypatch.setitem(sys.modules, "my_task", mod)
    monkeypatch.setitem(TASKS, "mine", "my_task")
    with pytest.raises(ValueError, match=r"task 'mine' has no base-model recipe: add one to rlbits\.zoo"):
        builder.pretrain("mine", tmp_path / "x", **TINY)
    mod.PRETRAIN = {**builder.RECIPES["arithmetic"], "steps": 2}
    info = json.loads((Path(builder.pretrain("mine", tmp_path / "m", **TINY)) / "base_model.json").read_text())
    assert info["task"] == "mine" and info["steps"] == 3 and info["n_positions"] == 64  # TINY overrides
