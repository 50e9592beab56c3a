"""``freeze_bottom_layers`` (trlx's ``num_layers_unfrozen``) and the loops' ``num_layers_unfrozen``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlbits.distributed.env import DistEnv
from rlbits.loops import reinforce
from rlbits.loops.config import ConfigError
from rlbits.models.frozen_layers import decoder_blocks, freeze_bottom_layers
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

V = 32


def trainable(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_freeze_follows_trlx_freeze_bottom_causal_layers():
    model = tiny_causal_lm("gpt2", V, seed=0)
    everything = trainable(model)
    blocks = decoder_blocks(model)
    assert len(blocks) >= 2 and trainable(freeze_bottom_layers(model, -1)) == everything
    freeze_bottom_layers(model, 1)
    top = len(blocks) - 1
    # trlx: blocks[:-1] and the input embeddings (tied: the output layer is that same weight); wpe, ln_f train
    want = {n for n in everything if n.startswith(f"transformer.h.{top}.") or n.startswith(("transformer.wpe",
            "transformer.ln_f"))}
    assert trainable(model) == want
    model = freeze_bottom_layers(tiny_causal_lm("gpt2", V, seed=0), 0)
    assert not any(n.startswith("transformer.h.") or "wte" in n for n in trainable(model))
    for bad in (-2, 1.5, True, len(blocks) + 1):
        with pytest.raises(ValueError, match="num_layers_unfrozen"):
            freeze_bottom_layers(tiny_causal_lm("gpt2", V, seed=0), bad)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_a_run_trains_only_the_unfrozen_layers(tiny_path, tmp_path):
    cfg = reinforce.ReinforceConfig(
        task="arithmetic", policy=tiny_path, run_dir=str(tmp_path / "run"), max_num_steps=1, num_prompts_per_step=2,
        num_generations_per_prompt=2, max_new_tokens=4, microbatch_size=4, learning_rate=1e-2, max_val_samples=2,
        progress=False, tensorboard=False, val_at_start=False, val_at_end=False, num_layers_unfrozen=1,
        adv_estimator="grpo",
    )
    state = reinforce.init_state(cfg, DistEnv())
    held = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in state.policy.parameters() if p.requires_grad}
    assert any(not p.requires_grad for p in state.policy.parameters())

    def reward(prompts, responses):
        return [float(len(r) % 3) for r in responses]

    run_dir = reinforce.train(cfg, reward=reward)
    before = dict(AutoModelForCausalLM.from_pretrained(tiny_path).named_parameters())
    after = dict(AutoModelForCausalLM.from_pretrained(run_dir / "final").named_parameters())
    top = len(decoder_blocks(AutoModelForCausalLM.from_pretrained(tiny_path))) - 1
    for name, p in after.items():
        if name.startswith("transformer.h.") and not name.startswith(f"transformer.h.{top}."):
            assert torch.equal(p, before[name]), name
    assert not all(torch.equal(after[n], before[n]) for n in after if n.startswith(f"transformer.h.{top}."))
    with pytest.raises(ConfigError, match="num_layers_unfrozen"):
        reinforce.ReinforceConfig(num_layers_unfrozen=1, lora_rank=4)
