"""rlbits.models: tiny configs, loading/saving, reference policy, ValueModel and ILQLModel heads."""

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from rlbits.models.heads import ILQLModel, ValueModel, make_head
from rlbits.models.load import (
    CheckpointNotFoundError,
    atomic_folder,
    freeze,
    load_policy,
    load_pretrained,
    load_tokenizer,
    reference_policy,
    save_pretrained,
)
from rlbits.models.tiny import ARCHS, BOS_ID, PAD_ID, tiny_causal_lm, tiny_config, tiny_tokenizer

V = 64


def _ids(b=2, t=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V - 1, (b, t), generator=g)


def _left_pad(ids, n_pad):
    """Left-pad every row of ``ids`` with ``n_pad`` pad tokens; returns ids, mask, position ids."""
    b = ids.shape[0]
    padded = torch.cat([torch.full((b, n_pad), PAD_ID), ids], 1)
    mask = torch.cat([torch.zeros(b, n_pad, dtype=torch.long), torch.ones_like(ids)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return padded, mask, pos


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def _storages(module):
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


# ---------------------------------------------------------------- tiny


@pytest.mark.parametrize("arch,cls", [("gpt2", GPT2Config), ("llama", LlamaConfig), ("qwen2", Qwen2Config)])
def test_tiny_config_archs_and_token_ids(arch, cls):
    c = tiny_config(arch, vocab_size=48, hidden_size=16, num_layers=3, num_heads=2)
    assert type(c) is cls
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (0, 1, 47)
    assert c.get_text_config().hidden_size == 16 and c.num_hidden_layers == 3
    assert c.num_attention_heads == 2 and c.vocab_size == 48
    assert c._attn_implementation == "eager"
    assert tiny_config(arch, tie_word_embeddings=False).tie_word_embeddings is False


def test_tiny_config_errors():
    with pytest.raises(ValueError, match="arch must be one of 'gpt2', 'llama', 'qwen2', got 'bert'"):
        tiny_config("bert")
    with pytest.raises(ValueError, match="vocab_size must be >= 4"):
        tiny_config("gpt2", vocab_size=3)
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be divisible by num_heads \(4\)"):
        tiny_config("llama", hidden_size=30)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_causal_lm_seeded_eval_and_rng_untouched(arch):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_causal_lm(arch, seed=5)
    assert torch.equal(torch.rand(3), expected_next)  # global RNG not consumed
    b = tiny_causal_lm(arch, seed=5)
    c = tiny_causal_lm(arch, seed=6)
    assert not a.training
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    logits = a(_ids()).logits
    assert logits.shape == (2, 6, V) and logits.dtype == torch.float32


def test_tiny_tokenizer_round_trip_and_convention():
    tok = tiny_tokenizer()
    assert len(tok) == V
    assert (tok.pad_token_id, tok.bos_token_id, tok.unk_token_id, tok.eos_token_id) == (0, 1, 2, 63)
    text = "12+30=42\nthe cat, sat!"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and 2 not in ids  # one id per char, none unknown
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids[:3]) == ["1", "2", "+"]
    assert tok("~")["input_ids"] == [2]  # outside the vocabulary -> <unk>
    batch = tok(["1+1=", "12+13="], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    # 32 ids still cover the arithmetic alphabet
    small = tiny_tokenizer(32)
    assert small.eos_token_id == 31 and 2 not in small("987+65=1")["input_ids"]
    with pytest.raises(ValueError, match="vocab_size must be in"):
        tiny_tokenizer(4)


# ---------------------------------------------------------------- save / load


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_round_trip(arch, tmp_path):
    model, tok = tiny_causal_lm(arch, seed=1), tiny_tokenizer()
    out = tmp_path / "ckpt"
    save_pretrained(model, tok, out)
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files
    assert not any(f.endswith((".bin", ".pt", ".pth")) for f in files)
    assert os.listdir(tmp_path) == ["ckpt"]  # no temp folder left behind

    loaded, tok2 = load_pretrained(out, attn_implementation="eager")
    ids = _ids()
    assert not loaded.training and loaded.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert tok2.padding_side == "left" and tok2.pad_token_id == 0 and tok2.eos_token_id == V - 1
    assert tok2("12+3")["input_ids"] == tok("12+3")["input_ids"]

    plain = AutoModelForCausalLM.from_pretrained(out)  # plain transformers reads it too
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=1e-5)

    half = load_policy(out, dtype="bfloat16")
    assert half.dtype == torch.bfloat16


def test_save_overwrites_checkpoint_atomically(tmp_path):
    out = tmp_path / "ckpt"
    save_pretrained(tiny_causal_lm(seed=0), None, out)
    save_pretrained(tiny_causal_lm(seed=1), None, out)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    again = load_policy(out)
    assert torch.equal(again.lm_head.weight, tiny_causal_lm(seed=1).lm_head.weight)

    # A failure while writing leaves the old checkpoint as it was and removes the temp folder.
    with pytest.raises(RuntimeError, match="boom"), atomic_folder(out) as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.equal(load_policy(out).lm_head.weight, again.lm_head.weight)


def test_save_refuses_unrelated_folder_and_files(tmp_path):
    (tmp_path / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="refusing to overwrite .* without config.json"):
        save_pretrained(tiny_causal_lm(), None, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "precious"
    with pytest.raises(ValueError, match="it is a file"):
        save_pretrained(tiny_causal_lm(), None, tmp_path / "notes.txt")
    with pytest.raises(TypeError, match="PreTrainedModel, got Linear"):
        save_pretrained(torch.nn.Linear(2, 2), None, tmp_path / "x")


def test_load_bad_folders(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointNotFoundError, match="'.*nope' does not exist") as e:
        load_policy(missing)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "weights.bin").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match=r"has no config.json \(found: \['weights.bin'\]\)"):
        load_policy(empty)

    bert = tmp_path / "bert"
    BertForSequenceClassification(
        BertConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    ).save_pretrained(bert)
    with pytest.raises(
        ValueError, match=r"'.*bert' describes architectures \['BertForSequenceClassification'\]"
    ):
        load_policy(bert)

    backbone = tmp_path / "backbone"
    tiny_causal_lm().base_model.save_pretrained(backbone)
    with pytest.raises(ValueError, match=r"\['GPT2Model'\].*needs a causal LM"):
        load_policy(backbone)

    save_pretrained(tiny_causal_lm(), None, tmp_path / "ok")
    assert (tmp_path / "ok").stat().st_mode & 0o777 == 0o777 & ~_umask()
    with pytest.raises(ValueError, match="dtype must be a torch.dtype, a name such as 'bfloat16'"):
        load_policy(tmp_path / "ok", dtype="float33")


def _word_tokenizer(**specials) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "</s>": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **specials)


def test_load_tokenizer_pad_and_eos(tmp_path):
    with_eos = tmp_path / "eos"
    _word_tokenizer(eos_token="</s>").save_pretrained(with_eos)
    tok = load_tokenizer(with_eos)
    assert tok.pad_token == "</s>" and tok.pad_token_id == tok.eos_token_id == 3
    assert tok.padding_side == "left"
    assert tok(["a", "a b"], padding=True)["input_ids"][0] == [3, 1]
    assert load_tokenizer(with_eos, padding_side="right").padding_side == "right"
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right'"):
        load_tokenizer(with_eos, padding_side="middle")

    no_eos = tmp_path / "noeos"
    _word_tokenizer().save_pretrained(no_eos)
    with pytest.raises(ValueError, match="has no EOS token.*pass eos_token="):
        load_tokenizer(no_eos)
    fixed = load_tokenizer(no_eos, eos_token="</s>")
    assert fixed.eos_token_id == 3 and fixed.pad_token_id == 3
    with pytest.raises(ValueError, match="eos_token '<end>' is not in the vocabulary"):
        load_tokenizer(no_eos, eos_token="<end>")

    with pytest.raises(CheckpointNotFoundError, match="tokenizer folder"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "bare").mkdir()
    with pytest.raises(ValueError, match="no loadable tokenizer in"):
        load_tokenizer(tmp_path / "bare")


def test_load_pretrained_sets_model_pad_and_checks_vocab(tmp_path):
    model = tiny_causal_lm(vocab_size=V)
    model.config.pad_token_id = None
    model.generation_config.pad_token_id = None
    save_pretrained(model, tiny_tokenizer(V), tmp_path / "a")
    loaded, tok = load_pretrained(tmp_path / "a")
    assert loaded.config.pad_token_id == tok.pad_token_id == 0
    assert loaded.generation_config.pad_token_id == 0

    save_pretrained(tiny_causal_lm(vocab_size=32), tiny_tokenizer(V), tmp_path / "b")
    with pytest.raises(ValueError, match="has 64 tokens but the model's embedding has 32 rows") as e:
        load_pretrained(tmp_path / "b")
    assert "id 63 '<eos>' (its eos_token)" in str(e.value)  # an added special token, past the 32 rows
    assert "31 ids of the tokenizer's own vocabulary" in str(e.value)


def test_load_pretrained_says_how_to_fix_a_token_the_tokenizer_adds(tmp_path):
    # As a Qwen2 folder whose tokenizer_config.json names a pad token the vocabulary lacks: reloading adds it.
    tok = tiny_tokenizer(V)
    tok.add_special_tokens({"pad_token": "<|mypad|>"})
    save_pretrained(tiny_causal_lm(vocab_size=V), tok, tmp_path / "m")
    with pytest.raises(ValueError, match=f"has {V + 1} tokens but the model's embedding has {V} rows") as e:
        load_pretrained(tmp_path / "m")
    message = str(e.value)
    assert f"id {V} '<|mypad|>' (its pad_token)" in message and "added_tokens_decoder" in message
    assert "model.resize_token_embeddings(len(tokenizer))" in message
    # The first fix the message names works.
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(tmp_path / "m")
    loaded, loaded_tok = load_pretrained(tmp_path / "m")
    assert loaded.get_input_embeddings().num_embeddings == len(loaded_tok) == V + 1


# ---------------------------------------------------------------- reference policy


def test_reference_policy_frozen_and_unchanged_by_policy_step():
    policy = tiny_causal_lm("llama").train()
    ref = reference_policy(policy)
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters()) and policy.training
    assert not (_storages(ref) & _storages(policy))
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    policy_before = {k: v.clone() for k, v in policy.state_dict().items()}

    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    ids = _ids()
    policy(ids, labels=ids).loss.backward()
    opt.step()
    assert any(not torch.equal(policy.state_dict()[k], policy_before[k]) for k in policy_before)
    assert all(torch.equal(ref.state_dict()[k], before[k]) for k in before)
    assert all(p.grad is None for p in ref.parameters())

    lin = torch.nn.Linear(2, 2).train()
    assert freeze(lin) is lin and not lin.training and not lin.weight.requires_grad


# ---------------------------------------------------------------- ValueModel


@pytest.mark.parametrize("arch", ARCHS)
def test_value_model_shapes_matches_reference_and_shares_no_storage(arch):
    policy = tiny_causal_lm(arch)
    critic = ValueModel.from_policy(policy)
    ids = _ids(3, 5)
    values = critic(ids)
    assert values.shape == (3, 5) and values.dtype == torch.float32
    assert not (_storages(critic) & _storages(policy))
    # Independent reference: the policy's own last hidden state through the head.
    hidden = policy(ids, output_hidden_states=True).hidden_states[-1]
    expected = hidden @ critic.head.weight[0] + critic.head.bias[0]
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-6)
    assert critic.head.weight.std() < 2.0 / (critic.head.in_features + 1)
    assert critic.head.bias.item() == 0.0
    assert critic.config is critic.backbone.config
    # Storage independence in practice: changing the critic leaves the policy alone.
    with torch.no_grad():
        critic.backbone.get_input_embeddings().weight.add_(1.0)
    torch.testing.assert_close(policy(ids, output_hidden_states=True).hidden_states[-1], hidden)


def test_value_model_gradient_reaches_head_and_backbone():
    critic = ValueModel.from_policy(tiny_causal_lm("qwen2")).train()
    critic(_ids()).pow(2).sum().backward()
    grads = {n: p.grad for n, p in critic.named_parameters()}
    assert all(g is not None for g in grads.values())
    assert grads["head.weight"].abs().sum() > 0 and grads["head.bias"].abs().sum() > 0
    assert critic.backbone.get_input_embeddings().weight.grad.abs().sum() > 0
    assert grads["backbone.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_value_model_save_load_exact(tmp_path):
    critic = ValueModel.from_policy(tiny_causal_lm("gpt2"), seed=3)
    with torch.no_grad():
        critic.head.bias.fill_(0.25)  # a trained-looking head
    critic.save_pretrained(tmp_path / "v")
    assert {"value_head.safetensors", "value_head.json", "model.safetensors"} <= set(
        os.listdir(tmp_path / "v")
    )
    meta = json.loads((tmp_path / "v" / "value_head.json").read_text())
    assert meta["format"] == "rlbits.ValueModel" and meta["attn_implementation"] == "eager"
    loaded = ValueModel.from_pretrained(tmp_path / "v")
    ids, mask = _ids(), torch.ones(2, 6, dtype=torch.long)
    assert torch.equal(loaded(ids, mask), critic(ids, mask))

    # From a causal-LM folder: that backbone plus a fresh (seeded) head.
    policy = tiny_causal_lm("llama", seed=2)
    save_pretrained(policy, None, tmp_path / "p")
    fresh = ValueModel.from_pretrained(tmp_path / "p", seed=3)
    ref = ValueModel.from_policy(policy, seed=3)
    assert torch.equal(fresh.head.weight, ref.head.weight)
    torch.testing.assert_close(fresh(ids), ref(ids), rtol=0, atol=1e-6)


def test_value_model_bad_inputs(tmp_path):
    with pytest.raises(TypeError, match="policy must be a transformers causal LM"):
        ValueModel.from_policy(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="backbone must be a transformers PreTrainedModel"):
        ValueModel(torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointNotFoundError, match="value model folder"):
        ValueModel.from_pretrained(tmp_path / "none")
    critic = ValueModel.from_policy(tiny_causal_lm())
    critic.save_pretrained(tmp_path / "v")
    (tmp_path / "v" / "value_head.safetensors").unlink()
    with pytest.raises(ValueError, match="value_head.safetensors' is missing"):
        ValueModel.from_pretrained(tmp_path / "v")


@pytest.mark.parametrize("arch", ARCHS)
def test_value_model_position_ids(arch):
    # Larger init than the default 0.02: sharper attention, so position effects are well above rounding.
    critic = ValueModel.from_policy(tiny_causal_lm(arch, initializer_range=0.2))
    ids = _ids(2, 5)
    plain = critic(ids)
    ones = torch.ones_like(ids)
    assert torch.equal(critic(ids, ones, torch.arange(5).expand(2, 5)), plain)
    padded, mask, pos = _left_pad(ids, 3)
    torch.testing.assert_close(critic(padded, mask, pos)[:, 3:], plain, rtol=0, atol=1e-5)
    # Rotary embeddings ignore a constant shift, so change the relative distances to see positions matter.
    stretched = critic(padded, mask, pos * 2)[:, 3:]
    assert (stretched - plain).abs().max() > 1e-3
    if arch == "gpt2":  # absolute positions: without position_ids a left-padded row is off
        assert (critic(padded, mask)[:, 3:] - plain).abs().max() > 1e-3


# ---------------------------------------------------------------- ILQLModel


def test_ilql_shapes_wiring_and_target_grads():
    policy = tiny_causal_lm("gpt2").train()
    model = ILQLModel(policy)
    ids = _ids(3, 4)
    out = model(ids)
    assert set(out) == {"logits", "q1", "q2", "target_q1", "target_q2", "v"}
    for k in ("logits", "q1", "q2", "target_q1", "target_q2"):
        assert out[k].shape == (3, 4, V) and out[k].dtype == torch.float32
    assert out["v"].shape == (3, 4)
    assert out["q1"].requires_grad and out["v"].requires_grad
    assert not out["target_q1"].requires_grad and not out["target_q2"].requires_grad
    # Targets start as exact copies; trlx's MLP layout hidden -> 2 hidden -> vocab.
    assert torch.equal(out["target_q1"], out["q1"]) and torch.equal(out["target_q2"], out["q2"])
    assert not torch.equal(out["q1"], out["q2"])
    assert [tuple(m.weight.shape) for m in model.q1 if isinstance(m, torch.nn.Linear)] == [(64, 32), (V, 64)]
    # Independent reference: the policy's own logits and hidden state through the heads.
    ref = policy(ids, output_hidden_states=True)
    assert torch.equal(out["logits"], ref.logits)
    torch.testing.assert_close(out["v"], model.v(ref.hidden_states[-1]).squeeze(-1), rtol=0, atol=0)
    # Even if someone unfreezes everything, the targets get no gradient.
    model.requires_grad_(True)
    out = model(ids)
    assert not out["target_q1"].requires_grad
    (out["q1"].sum() + out["q2"].sum() + out["v"].sum() + out["logits"].sum()).backward()
    assert all(p.grad is None for p in model.target_q1.parameters())
    assert all(p.grad is not None for p in model.q1.parameters())
    assert policy.get_input_embeddings().weight.grad.abs().sum() > 0  # shared trunk trains


def test_ilql_sync_target_heads():
    model = ILQLModel(tiny_causal_lm("llama"), head_layers=1)
    with torch.no_grad():
        for p in list(model.q1.parameters()) + list(model.q2.parameters()):
            p.add_(torch.randn_like(p))
    online = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(("q1.", "q2."))}
    target = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("target_")}
    assert all(not torch.equal(target["target_" + k], v) for k, v in online.items())

    model.sync_target_q_heads(0.5)  # trlx: target = alpha * online + (1 - alpha) * target
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in online.items():
        expected = 0.5 * v + 0.5 * target["target_" + k]
        assert torch.equal(state["target_" + k], expected)
    # alpha=0.5 is symmetric; 0.25 pins the convention (alpha weights the online head, as trlx).
    model.sync_target_q_heads(0.25)
    for k, v in online.items():
        expected = 0.25 * v + 0.75 * state["target_" + k]
        torch.testing.assert_close(model.state_dict()["target_" + k], expected, rtol=1e-6, atol=1e-7)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.sync_target_q_heads(0.0)
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in target)
    model.sync_target_q_heads(1.0)
    assert all(torch.equal(model.state_dict()["target_" + k], v) for k, v in online.items())
    assert all(not p.requires_grad for p in model.target_q1.parameters())
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        model.sync_target_q_heads(1.5)


@pytest.mark.parametrize("kwargs", [{}, {"two_qs": False, "head_layers": 1, "shared_trunk": False}])
def test_ilql_save_load_exact(tmp_path, kwargs):
    model = ILQLModel(tiny_causal_lm("qwen2"), **kwargs)
    with torch.no_grad():
        model.sync_target_q_heads(1.0)
        for p in model.q1.parameters():
            p.mul_(1.5)  # online and target now differ
    ids = _ids()
    out = model(ids)
    model.save_pretrained(tmp_path / "m", tokenizer=tiny_tokenizer())
    loaded = ILQLModel.from_pretrained(tmp_path / "m")
    out2 = loaded(ids)
    assert out.keys() == out2.keys() and all(torch.equal(out[k], out2[k]) for k in out)
    assert (loaded.two_qs, loaded.head_layers, loaded.trunk is None) == (
        kwargs.get("two_qs", True),
        kwargs.get("head_layers", 2),
        kwargs.get("shared_trunk", True),
    )
    # The folder is also a plain policy checkpoint.
    policy = load_policy(tmp_path / "m", attn_implementation="eager")
    assert torch.equal(policy(ids).logits, out["logits"])


def test_ilql_separate_trunk_keeps_policy_out_of_head_losses():
    model = ILQLModel(tiny_causal_lm("gpt2"), shared_trunk=False)
    assert not (_storages(model.trunk) & _storages(model.policy))
    out = model(_ids())
    (out["q1"].sum() + out["v"].sum()).backward()
    assert all(p.grad is None for p in model.policy.parameters())
    assert model.trunk.get_input_embeddings().weight.grad.abs().sum() > 0


def test_ilql_bad_inputs():
    with pytest.raises(ValueError, match="head_layers must be 1 .* or 2"):
        ILQLModel(tiny_causal_lm(), head_layers=3)
    with pytest.raises(ValueError, match="head_layers must be"):
        make_head(4, 4, 0)
    with pytest.raises(TypeError, match="policy must be a transformers causal LM"):
        ILQLModel(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("arch", ARCHS)
def test_ilql_position_ids(arch):
    model = ILQLModel(tiny_causal_lm(arch, initializer_range=0.2), two_qs=False)
    ids = _ids(2, 5)
    plain = model(ids)
    explicit = model(ids, torch.ones_like(ids), torch.arange(5).expand(2, 5))
    assert all(torch.equal(plain[k], explicit[k]) for k in plain)
    padded, mask, pos = _left_pad(ids, 2)
    out = model(padded, mask, pos)
    for k in plain:
        torch.testing.assert_close(out[k][:, 2:], plain[k], rtol=0, atol=1e-5)
    wrong = model(padded, mask, pos * 2)
    assert (wrong["v"][:, 2:] - plain["v"]).abs().max() > 1e-3
    assert BOS_ID == 1  # the convention the docstrings promise


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_left_padding_matches_unpadded(arch, impl):
    model = tiny_causal_lm(arch, attn_implementation=impl, initializer_range=0.2)
    assert model.config._attn_implementation == impl
    ids = _ids(2, 6)
    padded, mask, pos = _left_pad(ids, 3)
    with torch.no_grad():
        plain = model(ids).logits
        out = model(padded, attention_mask=mask, position_ids=pos).logits
    assert not out.isnan().any()  # fully masked pad rows stay finite
    # float32 summation order differs with padding (measured up to 2.2e-6 on logits ~1); a padding bug is O(0.1)
    torch.testing.assert_close(out[:, 3:], plain, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- safe loading (issue 8)


def _pickle_only_folder(path, model):
    """A folder with config.json and only a pickled state dict (the pre-safetensors HF format)."""
    path.mkdir()
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


def test_pickle_weights_are_refused_everywhere(tmp_path):
    """load_policy / ValueModel / ILQLModel / RewardModel read safetensors only; the error says how to convert."""
    from transformers import GPT2ForSequenceClassification

    from rlbits.models.reward import RewardModel

    folder = _pickle_only_folder(tmp_path / "bin", tiny_causal_lm())
    tiny_tokenizer(V).save_pretrained(folder)
    match = r"'.*bin' has no safetensors weights \(only pickle weights \['pytorch_model.bin'\]\).*convert"
    for load in (load_policy, load_pretrained, ValueModel.from_pretrained, ILQLModel.from_pretrained):
        with pytest.raises(ValueError, match=match):
            load(folder)
    rm = GPT2ForSequenceClassification(tiny_config("gpt2", V, num_labels=1))
    rm_folder = _pickle_only_folder(tmp_path / "rm_bin", rm)
    tiny_tokenizer(V).save_pretrained(rm_folder)
    with pytest.raises(ValueError, match="reward model folder .* has no safetensors weights"):
        RewardModel.from_pretrained(rm_folder)
    # the same weights as safetensors load (the check is not over-eager)
    save_pretrained(tiny_causal_lm(), tiny_tokenizer(V), tmp_path / "st")
    assert isinstance(load_policy(tmp_path / "st"), torch.nn.Module)


CUSTOM_CODE = '''
import pathlib
pathlib.Path(__file__).with_name("CODE_RAN").write_text("yes")  # the side effect the test looks for
from transformers import GPT2Config, GPT2LMHeadModel


class CustomConfig(GPT2Config):
    model_type = "rlbits-custom-gpt2"


class CustomModel(GPT2LMHeadModel):
    config_class = CustomConfig
'''


def test_remote_code_runs_only_when_asked(tmp_path):
    """A folder whose config points at its own Python code: refused (and the code not run) by default."""
    folder = tmp_path / "custom"
    save_pretrained(tiny_causal_lm(), tiny_tokenizer(V), folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "rlbits-custom-gpt2"
    config["auto_map"] = {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(CUSTOM_CODE)
    for load in (load_policy, load_pretrained):
        with pytest.raises(ValueError, match="trust_remote_code"):
            load(folder)
    assert not (folder / "CODE_RAN").exists()
    try:
        load_policy(folder, trust_remote_code=True)
    except Exception:  # noqa: BLE001 (whether transformers then loads it is not the point)
        pass
    # transformers copies the code into its modules cache and imports it from there
    from transformers.utils import HF_MODULES_CACHE

    assert any(Path(HF_MODULES_CACHE).rglob("CODE_RAN")), "trust_remote_code=True did not run the folder's code"


def _calls(tree, attr: str):
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == attr:
                yield node


def _unsafe_loads(source: str, name: str, in_tests: bool = False) -> list[str]:
    """What in ``source`` could unpickle untrusted data or run a model folder's code."""
    import ast

    tree = ast.parse(source, filename=name)
    bad = []
    for node in _calls(tree, "load"):
        f = node.func
        owner = getattr(f.value, "id", None) if isinstance(f, ast.Attribute) else None
        if owner == "torch":
            kw = {k.arg: k.value for k in node.keywords}
            if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                bad.append(f"{name}:{node.lineno}: torch.load without weights_only=True")
        if owner in ("pickle", "dill", "cloudpickle", "joblib"):
            bad.append(f"{name}:{node.lineno}: {owner}.load")
    for node in _calls(tree, "loads"):
        if isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) == "pickle":
            bad.append(f"{name}:{node.lineno}: pickle.loads")
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and not in_tests:
            if isinstance(node.value, ast.Constant) and node.value.value is True:
                bad.append(f"{name}:{node.value.lineno}: trust_remote_code=True")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            positional = node.args.posonlyargs + node.args.args
            defaults = [None] * (len(positional) - len(node.args.defaults)) + node.args.defaults
            defaults += node.args.kw_defaults
            for a, d in zip(args, defaults, strict=True):
                if a.arg == "trust_remote_code" and not (isinstance(d, ast.Constant) and d.value is False):
                    bad.append(f"{name}:{node.lineno}: {node.name}(trust_remote_code=...) does not default to False")
    return bad


def test_source_loads_no_pickle_and_trusts_no_remote_code():
    """Every ``torch.load`` in the project passes ``weights_only=True``; nothing calls ``pickle.load(s)``,
    passes ``trust_remote_code=True`` literally, or defaults a ``trust_remote_code`` parameter to anything
    but False."""
    unsafe = (
        "import torch, pickle\n"
        "a = torch.load('x')\nb = torch.load('x', weights_only=False)\nc = pickle.loads(b'')\n"
        "m = f(p, trust_remote_code=True)\ndef g(p, *, trust_remote_code=True): pass\n"
        "ok = torch.load('x', weights_only=True)\n"
    )
    assert len(_unsafe_loads(unsafe, "snippet")) == 5  # the scan itself finds each kind
    bad = _scan("rlbits", "benchmarks", "tutorials")
    assert not bad, "\n".join(bad)


def _scan(*folders: str) -> list[str]:
    root = Path(__file__).resolve().parents[2]
    files = [p for d in folders for p in (root / d).rglob("*.py")]
    assert files
    bad = []
    for path in files:
        rel = path.relative_to(root)
        bad += _unsafe_loads(path.read_text(), str(rel), in_tests=rel.parts[0] == "tests")
    return bad


def test_test_files_load_no_pickle_either():
    bad = _scan("tests")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- FSDP2: heads return no views

_FSDP_WORKER = """
import torch
from rlbits.distributed.env import init
from rlbits.distributed.parallelize import shard
from rlbits.models.heads import ILQLModel, ValueModel
from rlbits.models.tiny import tiny_causal_lm

env = init("cpu")
ids = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(0))
for name, model in (("value", ValueModel.from_policy(tiny_causal_lm("gpt2", 32, seed=0), seed=1)),
                    ("ilql", ILQLModel(tiny_causal_lm("gpt2", 32, seed=0)))):
    with torch.no_grad():
        expected = model(ids)
    out = shard(model, env)(ids)
    got = out if name == "value" else out["v"] + out["q1"].mean(-1) + out["q2"].mean(-1)
    got.sum().backward()
    if name == "value":
        assert torch.equal(out.detach(), expected)
    else:
        assert all(torch.equal(out[k].detach(), expected[k]) for k in expected)
print("ranks done", env.rank)
"""


@pytest.mark.slow
def test_sharded_heads_return_no_view_on_two_ranks(tmp_path):
    """FSDP2 warned "returned a view tensor ... wrong gradients" on every rank from ValueModel.forward (the
    ``squeeze(-1)`` of the head) and ILQLModel.forward (the Q heads' 3-d Linear): the outputs are tensors of
    their own now, with the same values."""
    import subprocess
    import sys

    worker = tmp_path / "worker.py"
    worker.write_text(_FSDP_WORKER)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert out.stdout.count("ranks done") == 2
    assert "view tensor" not in out.stdout + out.stderr


def test_heads_return_float32_tensors_that_are_not_views():
    policy = tiny_causal_lm(vocab_size=V)
    assert ValueModel.from_policy(policy)(_ids())._base is None
    out = ILQLModel(policy)(_ids())
    assert all(out[k]._base is None and out[k].dtype == torch.float32 for k in ("q1", "q2", "v"))


def test_fused_gelu_same_function_values_and_gradients(tmp_path):
    """``fused_gelu`` swaps GPT-2's eight-op ``gelu_new`` for one ``F.gelu(approximate="tanh")`` kernel: the
    formula written out here, and the model's logits and gradients, agree to float rounding; models
    without ``gelu_new`` are left alone; the loops' loader applies it; a saved model still says ``gelu_new``."""
    import math

    from transformers.activations import GELUTanh, NewGELUActivation

    from rlbits.distributed.env import DistEnv
    from rlbits.loops.runtime import fused_gelu, load_policy_and_tokenizer

    x = torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 4
    formula = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    torch.testing.assert_close(GELUTanh()(x), formula, rtol=1e-12, atol=1e-12)

    model = tiny_causal_lm("gpt2", seed=3).train()
    fused = fused_gelu(tiny_causal_lm("gpt2", seed=3).train())
    acts = [type(m) for m in fused.modules() if isinstance(m, (GELUTanh, NewGELUActivation))]
    assert acts == [GELUTanh] * model.config.n_layer
    ids = _ids()
    out, out2 = model(ids).logits, fused(ids).logits
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    g = torch.autograd.grad(out.square().mean(), list(model.parameters()))
    g2 = torch.autograd.grad(out2.square().mean(), list(fused.parameters()))
    for a, b in zip(g, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)

    llama = tiny_causal_lm("llama", seed=3)
    before = [type(m) for m in llama.modules()]
    assert [type(m) for m in fused_gelu(llama).modules()] == before

    save_pretrained(model, tiny_tokenizer(), tmp_path / "m")
    loaded, _ = load_policy_and_tokenizer(str(tmp_path / "m"), DistEnv())
    assert not any(isinstance(m, NewGELUActivation) for m in loaded.modules())
    save_pretrained(loaded, None, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["activation_function"] == "gelu_new"
