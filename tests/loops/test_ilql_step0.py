"""ILQL's step-0 validation is the base model's: the LM alone (beta 0), not steering with untrained heads.

Issue 13, item 13: step 0 used to log steering with randomly initialised heads as ``val_reward`` (e.g. -0.23
at beta 8 where the base model scores about 0.00), and plots and docs called that the base.
"""

from __future__ import annotations

import pytest

from rlbits.loops import ilql
from rlbits.loops.config import config_from_dict
from rlbits.loops.run import read_metrics
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

PROMPTS = ["hello there", "abc", "the cat sat", "x y z", "a dog", "on a mat"]


def reward(prompts, responses, **_):
    return [len(r) / 10 + r.count("a") for r in responses]


@pytest.mark.slow
def test_step_zero_logs_the_lm_alone_as_val_reward_and_the_untrained_heads_apart(tmp_path):
    path = tmp_path / "model"
    save_pretrained(tiny_causal_lm(vocab_size=64, seed=0), tiny_tokenizer(64), path)
    cfg = config_from_dict(ilql.ILQLConfig, dict(
        policy=str(path), run_dir=str(tmp_path / "run"), max_num_steps=2, batch_size=8, microbatch_size=4,
        dataset_size=16, dataset_batch_size=8, max_new_tokens=6, val_period=2, max_val_samples=6, beta=8.0,
        progress=False, tensorboard=False, device="cpu", val_at_start=True,
    ))
    rows = read_metrics(ilql.train(cfg, reward=reward, prompts=PROMPTS))
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and last["step"] == 2
    # Step 0: val_reward is the base (the LM alone), the untrained heads' steering is named as such.
    assert first["val_reward"] == first["val_reward_policy"]
    for key in ("val_reward", "val_reward_std", "val_response_len"):
        assert f"{key}_untrained_heads" in first
    keys = ("val_reward", "val_reward_std", "val_response_len")
    assert [first[f"{k}_untrained_heads"] for k in keys] != [first[k] for k in keys]  # random steering differs
    # Later validations: steered at beta, the LM alone apart; no untrained-heads keys.
    assert "val_reward" in last and "val_reward_policy" in last
    assert not any(k.endswith("_untrained_heads") for k in last)
