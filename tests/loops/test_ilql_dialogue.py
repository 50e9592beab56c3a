"""ILQL on dialogue samples against trlx (3340c2f), re-written line by line: ``tokenize_dialogue``
(``trlx/pipeline/offline_pipeline.py``), ``make_experience`` (``trlx/trainer/accelerate_ilql_trainer.py``) and
``ILQLConfig.loss`` (``trlx/models/modeling_ilql.py``); then the loop on a small dialogue set."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from functools import reduce
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from rlbits.batch import trim_padding
from rlbits.data import dialogue, offline
from rlbits.functional import ilql_standardize_rewards, token_rewards
from rlbits.loops import ilql
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.run import read_metrics
from rlbits.loops.update import Denominators
from rlbits.models.heads import ILQLModel
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

# --- trlx, re-written ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class DialogMessage:
    is_output: bool
    tokens: tuple


def trlx_tokenize_dialogue(dialogue, tokenizer, max_length=2048):
    if isinstance(dialogue, str):
        bos_token = tokenizer.bos_token or tokenizer.eos_token
        dialogue = [bos_token, dialogue]
    else:
        if len(dialogue) % 2 != 0:
            raise ValueError("Dialogue must have an even number of phrases, alternating prompt and output")
        dialogue = list(dialogue)
    if not dialogue[-1].endswith(tokenizer.eos_token):
        dialogue[-1] = dialogue[-1] + tokenizer.eos_token
    tokenized = [
        DialogMessage(is_output=i % 2 == 1, tokens=tuple(tokenizer(dialogue[i], add_special_tokens=False).input_ids))
        for i in range(len(dialogue))
    ]
    if tokenizer.truncation_side == "left":
        tokenized = [DialogMessage(is_output=m.is_output, tokens=m.tokens[::-1]) for m in tokenized[::-1]]
    lengths = [len(t.tokens) for t in tokenized]
    cumsum_lengths = [sum(lengths[:i]) for i in range(len(lengths))]
    truncated = [
        DialogMessage(is_output=t.is_output, tokens=t.tokens[: max(max_length - cl, 0)])
        for t, cl in zip(tokenized, cumsum_lengths, strict=True)
    ]
    if tokenizer.truncation_side == "left":
        truncated = [DialogMessage(is_output=m.is_output, tokens=m.tokens[::-1]) for m in truncated[::-1]]
    out = [t for t in truncated if len(t.tokens) > 0]
    if out[0].is_output:
        if sum(len(msg.tokens) for msg in out) == max_length:
            if tokenizer.truncation_side == "left":
                out[0].tokens = out[0].tokens[1:]
            else:
                out[-1].tokens = out[-1].tokens[:-1]
        out.insert(0, DialogMessage(False, (tokenizer.bos_token_id,)))
    return out


def trlx_make_experience(samples, rewards, tokenizer, max_length=2048):
    """trlx's ``make_experience`` without its logging: per sample ``input_ids``, ``actions_ixs``, ``states_ixs``,
    ``dones`` and ``rewards`` (the standardised return on the last action)."""
    samples = [trlx_tokenize_dialogue(s, tokenizer, max_length) for s in samples]
    all_input_ids, all_actions_ixs, all_states_ixs, all_dones = [], [], [], []
    for sample in samples:
        length = 0
        all_input_ids.append(torch.tensor(sum((s.tokens for s in sample), ())))
        actions_ixs = []
        for dm in sample:
            if dm.is_output:
                actions_ixs.append(torch.arange(length - 1, length + len(dm.tokens) - 1))
            length += len(dm.tokens)
        states_ixs = torch.hstack((*actions_ixs, torch.tensor(length - 1)))
        all_dones.append(torch.tensor([1] * (len(states_ixs) - 1) + [0], dtype=int))
        all_actions_ixs.append(torch.hstack(actions_ixs))
        all_states_ixs.append(states_ixs)
    returns = torch.tensor(rewards, dtype=float)
    returns = returns - returns.mean()
    std_returns = returns.std()
    if not torch.isnan(std_returns):
        returns = returns / (std_returns + torch.finfo(returns.dtype).eps)
    out_rewards = [torch.zeros(len(x)) for x in all_actions_ixs]
    for rs, ret in zip(out_rewards, returns, strict=True):
        rs[-1] = ret
    return SimpleNamespace(input_ids=all_input_ids, actions_ixs=all_actions_ixs, states_ixs=all_states_ixs,
                           dones=all_dones, rewards=out_rewards)


def trlx_loss(logits, qs, target_qs, vs, batch, *, gamma, tau, cql_scale, awac_scale, beta):
    """``ILQLConfig.loss`` of trlx on a padded batch (``ilql_collate_fn``: right padding with 0)."""
    terminal_mask = batch.dones[:, :-1]
    n_nonterminal = max(1, terminal_mask.sum())
    actions = batch.input_ids[:, 1:].gather(dim=1, index=batch.actions_ixs).unsqueeze(-1)
    nactions = actions.shape[1]
    bsize, _, dsize = logits.shape
    Q = [q.gather(-1, actions).squeeze(-1) for q in qs]
    targetQs = [q.gather(-1, actions).squeeze(-1).detach() for q in target_qs]
    targetQ = reduce(torch.minimum, targetQs)
    V = vs[:, :-1, 0]
    Vnext = vs[:, 1:, 0] * batch.dones[:, 1:].to(vs.dtype)
    Q_ = batch.rewards + gamma * Vnext.detach()
    loss_q = sum(((Qi - Q_) * terminal_mask).pow(2).sum() / n_nonterminal for Qi in Q)
    targetQ = targetQ.detach()
    loss_v = (
        (
            (targetQ >= V).int() * tau * (targetQ - V).pow(2)
            + (targetQ < V).int() * (1 - tau) * (targetQ - V).pow(2)
        )
        * terminal_mask
    ).sum() / n_nonterminal

    def cql_loss(q):
        loss = F.cross_entropy(q.reshape(-1, dsize), actions.reshape(-1), reduction="none")
        return (loss.reshape(bsize, nactions) * terminal_mask).sum() / n_nonterminal

    loss_cql = sum(cql_loss(q) for q in qs)
    idx = batch.actions_ixs.unsqueeze(-1).expand(bsize, nactions, dsize)
    action_logits = logits.gather(dim=1, index=idx)
    cross_entropy = F.cross_entropy(action_logits.reshape(-1, dsize), actions.reshape(-1), reduction="none")
    awac_weight = torch.exp(beta * (targetQ - V))
    loss_awac = torch.sum(cross_entropy.reshape(bsize, nactions) * awac_weight * terminal_mask) / n_nonterminal
    loss = loss_q + loss_v + cql_scale * loss_cql + awac_scale * loss_awac
    return dict(loss=loss, loss_q=loss_q, loss_v=loss_v, loss_cql=loss_cql, loss_awac=loss_awac)


# --- random dialogues ---------------------------------------------------------------------------------------

WORDS = ["hi", "ok", "the cat", "a dog sat", "yes", "no way", "why?", "", "x", "tell me more"]


def random_dialogue(rng):
    if rng.random() < 0.1:
        return rng.choice(WORDS[:-1]) + " end"  # trlx's str shorthand: (bos, text)
    turns = rng.randint(1, 4)
    segs = [rng.choice(WORDS) for _ in range(2 * turns)]
    if rng.random() < 0.2:
        segs[-1] += "<eos>"  # already ends with EOS: nothing appended
    return segs


def tokenizer_for(side):
    tok = tiny_tokenizer(64)
    tok.truncation_side = side
    return tok


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("max_length", [None, 3, 6, 11, 40])
def test_segments_and_indices_equal_trlx(seed, side, max_length):
    rng = random.Random(seed * 100 + (max_length or 0))
    tok = tokenizer_for(side)
    dialogues = [random_dialogue(rng) for _ in range(12)]
    trlx_max = max_length if max_length is not None else 2048
    ref_segments = []
    for d in dialogues:
        got = dialogue.tokenize_dialogue(d, tok, max_length, side)
        ref = trlx_tokenize_dialogue(d, tok, trlx_max)
        assert [(s.is_output, tuple(s.tokens)) for s in got] == [(m.is_output, tuple(m.tokens)) for m in ref], d
        ref_segments.append(ref)
    # samples left with no output token: trlx's hstack of no actions fails; rlbits names the sample
    usable = [i for i, ref in enumerate(ref_segments) if any(m.is_output and m.tokens for m in ref)]
    if len(usable) < len(dialogues):
        bad = next(i for i in range(len(dialogues)) if i not in usable)
        rows = offline.normalize_samples([{"dialogue": dialogues[bad], "reward": 0.0}])
        with pytest.raises(ValueError, match="sample 0 has no output tokens"):
            offline.tensorize_dataset(rows, tok, max_length=max_length, truncation_side=side)
    dialogues = [dialogues[i] for i in usable]
    rewards = [rng.uniform(-2, 3) for _ in dialogues]
    rows = offline.normalize_samples([{"dialogue": d, "reward": r} for d, r in zip(dialogues, rewards, strict=True)])
    td = offline.tensorize_dataset(rows, tok, max_length=max_length, truncation_side=side)
    ref = trlx_make_experience(dialogues, rewards, tok, trlx_max)
    placed = token_rewards(ilql_standardize_rewards(td["rewards"]), td["action_mask"])
    P = td["prompts"].shape[1]
    for i in range(len(dialogues)):
        p_len = int(td["prompt_mask"][i].sum())
        ids = torch.cat([td["prompts"][i][td["prompt_mask"][i]], td["responses"][i][td["response_mask"][i]]])
        assert torch.equal(ids, ref.input_ids[i])
        actions = td["action_mask"][i].nonzero().squeeze(-1)
        assert torch.equal(p_len + actions - 1, ref.actions_ixs[i])  # the state before each action token
        assert torch.equal(torch.cat([p_len + actions - 1, torch.tensor([len(ids) - 1])]), ref.states_ixs[i])
        assert ref.dones[i].tolist() == [1] * len(actions) + [0]
        torch.testing.assert_close(placed[i][actions], ref.rewards[i])
        # the padded batch: the objective reads position P - 1 + t for response token t
        assert torch.equal(td["input_ids"][i, P + actions], ref.input_ids[i][ref.actions_ixs[i] + 1])


def _trlx_batch(ref, idx):
    pad = torch.nn.utils.rnn.pad_sequence
    return SimpleNamespace(
        input_ids=pad([ref.input_ids[i] for i in idx], batch_first=True, padding_value=0),
        rewards=pad([ref.rewards[i] for i in idx], batch_first=True, padding_value=0.0),
        states_ixs=pad([ref.states_ixs[i] for i in idx], batch_first=True, padding_value=0),
        actions_ixs=pad([ref.actions_ixs[i] for i in idx], batch_first=True, padding_value=0),
        dones=pad([ref.dones[i] for i in idx], batch_first=True, padding_value=0),
    )


@pytest.mark.parametrize("seed", range(3))
def test_loss_on_dialogues_equals_trlx(seed):
    """rlbits' ``objective`` on the tensorized dialogues equals trlx's ``ILQLConfig.loss`` on trlx's batch of the
    same samples, both read from one model (trlx gathers the heads at ``actions_ixs``/``states_ixs``)."""
    rng = random.Random(seed)
    tok = tokenizer_for("right")
    dialogues = [d for d in (random_dialogue(rng) for _ in range(20)) if not isinstance(d, str)][:6]
    rewards = [rng.uniform(-1, 1) for _ in dialogues]
    ref = trlx_make_experience(dialogues, rewards, tok, 30)
    rows = offline.normalize_samples([{"dialogue": d, "reward": r} for d, r in zip(dialogues, rewards, strict=True)])
    td = offline.tensorize_dataset(rows, tok, max_length=30)
    td["rewards"] = ilql_standardize_rewards(td["rewards"])
    model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=seed), head_layers=2, seed=seed)
    with torch.no_grad():  # move the heads off their init so every term matters
        for p in [*model.target_q1.parameters(), *model.target_q2.parameters(), *model.v.parameters()]:
            p.add_(0.2 * torch.randn_like(p))
    hp = dict(gamma=0.9, tau=0.7, cql_scale=0.3, awac_scale=0.5)
    cfg = ilql.ILQLConfig(**hp, awac_beta=0.4)
    n = td["action_mask"].sum()
    state, den = SimpleNamespace(model=model), Denominators(num_tokens=n, num_seqs=n, num_rows=n)
    got = ilql.objective(state, trim_padding(td), cfg, den)[1]
    # trlx: one forward per unpadded sample (its right padding with position ids from the mask is the same)
    outs = []
    for i in range(len(dialogues)):
        ids = ref.input_ids[i][None]
        o = model(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(ids.shape[1])[None])
        a, s = ref.actions_ixs[i], ref.states_ixs[i]
        outs.append(dict(logits=o["logits"][0], q1=o["q1"][0, a], q2=o["q2"][0, a], t1=o["target_q1"][0, a],
                         t2=o["target_q2"][0, a], v=o["v"][0, s, None]))
    pad = lambda k: torch.nn.utils.rnn.pad_sequence([o[k] for o in outs], batch_first=True)  # noqa: E731
    want = trlx_loss(pad("logits"), (pad("q1"), pad("q2")), (pad("t1"), pad("t2")), pad("v"),
                     _trlx_batch(ref, range(len(dialogues))), **hp, beta=0.4)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value.detach().float(), rtol=2e-5, atol=2e-5, msg=key)


def test_dialogue_samples_are_checked():
    rows = offline.normalize_samples([(["p", "o", "p2", "o2"], 1), {"dialogue": "text", "reward": 2, "id": 3}])
    assert rows == [{"dialogue": ["p", "o", "p2", "o2"], "reward": 1.0}, {"dialogue": "text", "reward": 2.0, "id": 3}]
    for sample, match in [
        ({"dialogue": ["a", "b", "c"], "reward": 1}, r"samples\[0\]: dialogue must have an even number"),
        ({"dialogue": [], "reward": 1}, r"samples\[0\]: dialogue must have an even number"),
        ({"dialogue": ["a", 3], "reward": 1}, r"samples\[0\]: dialogue must be a str or a list of str"),
        ({"dialogue": ["a", "b"]}, r"samples\[0\] lacks key\(s\) \['reward'\]"),
        ({"dialogue": ["a", "b"], "prompt": "a", "reward": 1}, "a dialogue and a prompt/response"),
        ((["a", "b"], float("inf")), r"samples\[0\]: reward must be finite"),
        (("a", "b"), r"samples\[0\] must be a \(prompt, response, reward\) triple"),
    ]:
        with pytest.raises(ValueError, match=match):
            offline.normalize_samples([sample])


def test_single_turn_rows_are_one_prompt_and_one_output():
    """A (prompt, response) row is the dialogue [prompt, response]: the same tensors, truncated the same way."""
    tok = tiny_tokenizer(64)
    pairs = [("hello there", " a cat"), ("x", " yes"), ("abc", "")]
    single = offline.normalize_samples([(p, r, 1.0) for p, r in pairs])
    dialog = offline.normalize_samples([([p, r], 1.0) for p, r in pairs])
    for kw in ({}, dict(max_length=14), dict(max_length=4, truncation_side="left")):
        a, b = offline.tensorize_dataset(single, tok, **kw), offline.tensorize_dataset(dialog, tok, **kw)
        for key in ("input_ids", "attention_mask", "action_mask", "response_mask", "rewards"):
            assert torch.equal(a[key], b[key]), (kw, key)
    assert torch.equal(a["action_mask"], a["response_mask"])


# --- the loop ---------------------------------------------------------------------------------------------


def reward(prompts, responses, **_):
    return [r.count("a") / max(1, len(r)) for r in responses]


def dialogue_samples():
    rng = random.Random(0)
    out = []
    for i in range(16):
        turns = 1 + i % 3
        segs = [w for _ in range(turns) for w in (rng.choice(["hi", "and?", "the cat"]), rng.choice([" a a", " b", " dog"]))]
        out.append({"dialogue": segs, "reward": float(sum(s.count("a") for s in segs[1::2]))})
    return out


@pytest.mark.slow
def test_loop_trains_on_dialogues_under_a_logit_mask(tmp_path):
    """Two steps on 16 dialogues of 1-3 turns, truncated to 12 tokens, validated steered under a logit mask
    that forbids "a" after any token: finite losses, the rows kept as dialogues, no "a" in the decodes."""
    from safetensors.torch import save_file

    path = tmp_path / "model"
    tok = tiny_tokenizer(64)
    save_pretrained(tiny_causal_lm(vocab_size=64, seed=0), tok, path)
    mask = torch.zeros(64, 64, dtype=torch.bool)
    a = tok.convert_tokens_to_ids("a")
    mask[:, a] = True
    save_file({"logit_mask": mask}, tmp_path / "mask.safetensors")
    cfg = config_from_dict(ilql.ILQLConfig, dict(
        policy=str(path), run_dir=str(tmp_path / "run"), max_num_steps=2, batch_size=8, microbatch_size=4,
        max_new_tokens=8, val_period=2, max_val_samples=4, log_samples=4, learning_rate=1e-3, progress=False,
        tensorboard=False, device="cpu", dataset_max_length=12, logit_mask=str(tmp_path / "mask.safetensors"),
        beta=2.0,
    ))
    samples = dialogue_samples()
    out = ilql.train(cfg, reward=reward, samples=samples, prompts=["the cat", "hi", "and?", "a dog"],
                     val_prompts=["the cat", "hi", "and?", "x y"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("loss", "loss_q", "loss_v", "loss_cql", "loss_awac", "q_mean", "v_mean", "response_len"):
        assert math.isfinite(rows[1][key]), key
    data = [json.loads(ln) for ln in (out / "offline_dataset.jsonl").read_text().splitlines()]
    assert data == samples
    tensors = offline.load_tensors(out / "offline_dataset")
    assert tensors["attention_mask"].sum(-1).max() == 12 and (tensors["action_mask"] <= tensors["response_mask"]).all()
    assert (tensors["action_mask"] != tensors["response_mask"]).any()  # prompt segments inside responses
    decoded = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert decoded and all("a" not in d["response"] for d in decoded)


def test_config_fields_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="logit_mask"):
        config_from_dict(ilql.ILQLConfig, dict(logit_mask=str(tmp_path / "missing.pt")))
    with pytest.raises(ConfigError, match="dataset_truncation_side"):
        config_from_dict(ilql.ILQLConfig, dict(dataset_truncation_side="middle"))
    with pytest.raises(ConfigError, match="dataset_max_length"):
        config_from_dict(ilql.ILQLConfig, dict(dataset_max_length=1))
