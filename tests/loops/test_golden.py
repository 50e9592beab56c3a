"""Golden pins: the first 3 steps of each loop on a fixed tiny setup log exactly the pinned metrics.

A resume test compares a run with itself, so an algorithm change that both halves share (a new advantage
normalisation, a KL sign, another seed derivation, a changed loss aggregation) passes it. These tests do what
torchtune's recipe tests do: train a fixed tiny setup for 3 steps through the public entry point
(``rlbits.train(config=..., ...)``) and compare every numeric metric of ``metrics.jsonl`` (losses, rewards,
KL, advantages, grad norms, entropy, clip fractions, counters, validation) with the values pinned in
``tests/loops/golden/<loop>.json``. Only wall-clock values are left out: ``time_s``, ``tokens_per_s`` and
``time/*``.

The setups (``LOOPS`` and ``REWARD_MODEL`` below; each runs in about a second):

- ``ppo``: critic, GAE, KL in the reward with the adaptive controller, value clipping, 2 epochs x 2
  minibatches, validation after step 3;
- ``reinforce``: GRPO, groups of 4, k3 KL in the loss, clipped with 2 iterations x 2 minibatches, validation;
- ``ilql``: an offline set of 16 sampled and scored responses, Q/V/CQL/AWAC losses with microbatch
  accumulation, a target-head sync at step 2, an epoch boundary at step 3, steered validation;
- ``preference``: online DPO, groups of 3 ranked best vs worst (ties dropped), microbatches of 3 pairs
  with a remainder, validation;
- ``reward_model``: a tiny GPT-2 with dropout 0.1 and a new score head on 40 preference pairs written by the
  test (some with a margin), Bradley-Terry with reward centering, uneven microbatches (3 + 3 + 2 rows),
  texts cut by ``truncate_prob`` and by ``max_length``, the warm-up/decay learning rate, validation on the
  held-out tenth.

The loops but the reward model share ``COMMON``; the reward model takes its dataset file and backbone folder at call
time (their paths are not part of the pinned config). All run on CPU in float32 with one intra-op thread
(``cpu_threads=1`` in the config and ``torch.set_num_threads(1)`` here), so a plain run and an xdist worker
compute the same numbers.

Tolerance: ``|got - pinned| <= ATOL + RTOL * |pinned|`` with ``RTOL = 1e-4``, ``ATOL = 1e-6``. Measured on the
2-core dev machine (torch 2.13 CPU): two runs, in one process or in two, plain or under xdist, agree
bit for bit (spread 0). Re-ordering the float reductions on purpose (two intra-op threads instead of one,
a stand-in for another CPU's kernels) moves the continuous metrics by at most 4.7e-5 relative (a KL near
zero) and 9.5e-7 absolute over the 3 steps; the tolerance sits just above that, while a change to the
algorithm moves them by 1e-3 or more (a biased GRPO std, a swapped Polyak weight, another minibatch seed:
checked). ``ATOL`` covers values that are zero up to rounding (whitened advantage means, the KL at step 1).
Clip fractions (``*clipfrac``) count tokens past a threshold, and the same perturbation once moved one
value exactly on PPO's value-clip boundary across it (value_clipfrac 0.180 -> 0.191, one token of 92):
they get ``CLIPFRAC_ATOL = 0.025`` (about two tokens) instead; a real change of the clipping moves the losses.

Regenerating: when a change is meant to alter the numbers (a new seed derivation, a fixed bug), run::

    RLBITS_UPDATE_GOLDEN=1 python -m pytest tests/loops/test_golden.py

which rewrites ``tests/loops/golden/*.json`` (the tests then pass); review the diff of those files and commit
them with the change, saying why the numbers moved. Without the variable a mismatch fails with one line per
metric and step (pinned value, value got, relative difference) and this instruction. A change of the setup
below (config, reward, prompts) also needs a regeneration: the pinned files hold the config they came from.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
from pathlib import Path

import pytest
import torch
import transformers

import rlbits
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

pytestmark = pytest.mark.slow

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
UPDATE_ENV = "RLBITS_UPDATE_GOLDEN"
REGENERATE = f"{UPDATE_ENV}=1 python -m pytest tests/loops/test_golden.py"
RTOL = 1e-4
ATOL = 1e-6
CLIPFRAC_ATOL = 0.025  # clip fractions count tokens past a threshold: one token may sit on it (see above)
VOCAB = 64

PROMPTS = ["the plot", "a film", "it was", "my day", "so this", "hello", "we saw", "an end"]


def reward(prompts, responses, **_):
    """A deterministic reward with spread inside every group (the tiny policy is random: any text goes)."""
    return [(sum(map(ord, r)) % 7) / 6 for r in responses]


# Shared by the setups: 3 steps on CPU, one thread, no wall-clock-dependent behaviour, validation after
# the last step only, nothing written but metrics, the final checkpoint and final/.
BASE = dict(
    seed=0,
    device="cpu",
    cpu_threads=1,
    precision="fp32",
    max_num_steps=3,
    learning_rate=1e-3,
    val_at_start=False,
    val_at_end=True,
    val_period=0,
    max_val_samples=4,
    save_period=0,
    progress=False,
    tensorboard=False,
)
COMMON = dict(BASE, max_new_tokens=6, temperature=1.0, log_samples=0)  # every loop but the reward model
LOOPS = {
    "ppo": dict(
        loop="ppo",
        num_prompts_per_step=4,
        num_generations_per_prompt=2,
        microbatch_size=4,
        ppo_epochs=2,
        num_minibatches=2,
        kl_coef=0.05,
        kl_in_reward=True,
        adaptive_kl=True,
        kl_target=0.01,
        kl_horizon=20.0,
        value_clip_eps=0.2,
    ),
    "reinforce": dict(
        loop="reinforce",
        adv_estimator="grpo",
        num_prompts_per_step=2,
        num_generations_per_prompt=4,
        microbatch_size=4,
        num_iterations=2,
        num_minibatches=2,
        kl_loss_coef=0.05,
        kl_estimator="k3",
    ),
    "ilql": dict(
        loop="ilql",
        batch_size=8,
        microbatch_size=4,
        dataset_size=16,
        dataset_batch_size=8,
        alpha=0.3,
        steps_for_target_q_sync=2,
    ),
    "preference": dict(
        loop="preference",
        online=True,
        num_prompts_per_step=4,
        num_generations_per_prompt=3,
        microbatch_size=3,
        beta=0.2,
    ),
}
REWARD_MODEL = dict(
    BASE,
    loop="reward_model",
    batch_size=8,
    microbatch_size=3,
    max_length=24,
    warmup_ratio=0.5,
    center_coef=0.01,
    truncate_prob=0.5,
    truncate_min_words=2,
    truncate_max_words=4,
)
WORDS = {
    True: ["great", "fun", "superb", "lovely"],
    False: ["awful", "dull", "boring", "weak"],
    None: ["the", "film", "was", "a", "story", "and", "plot", "cast"],
}


def write_pairs(path: Path, n: int = 40) -> Path:
    """``n`` preference pairs (a sentence with a good word over one with a bad word), a margin on every
    third row."""
    gen = random.Random(0)

    def sentence(good: bool) -> str:
        words = [gen.choice(WORDS[None]) for _ in range(gen.randint(3, 7))]
        words.insert(gen.randint(0, len(words)), gen.choice(WORDS[good]))
        return " ".join(words)

    rows = []
    for i in range(n):
        row = {"prompt": "review: ", "chosen": sentence(True), "rejected": sentence(False)}
        if i % 3 == 0:
            row["margin"] = gen.choice([0.5, 1.0])
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def comparable(row: dict) -> dict:
    """A metrics.jsonl row without its wall-clock values."""
    return {k: v for k, v in row.items() if k not in ("time_s", "tokens_per_s") and not k.startswith("time/")}


def close(key: str, got, pinned) -> bool:
    if got is None or pinned is None:  # non-finite values are logged as null
        return got is None and pinned is None
    atol = CLIPFRAC_ATOL if key.endswith("clipfrac") else ATOL
    return math.isfinite(got) and abs(got - pinned) <= atol + RTOL * abs(pinned)


def mismatches(pinned_rows: list[dict], got_rows: list[dict]) -> list[str]:
    """One line per metric and step that differs (or is missing, or new)."""
    pinned = {r["step"]: r for r in pinned_rows}
    got = {r["step"]: r for r in got_rows}
    lines = []
    if sorted(pinned) != sorted(got):
        lines.append(f"logged steps: pinned {sorted(pinned)}, got {sorted(got)}")
    for step in sorted(set(pinned) & set(got)):
        p, g = pinned[step], got[step]
        for key in sorted(set(p) | set(g)):
            if key not in g:
                lines.append(f"{key:<24} step {step}: pinned {p[key]!r}, not logged any more")
            elif key not in p:
                lines.append(f"{key:<24} step {step}: not pinned, got {g[key]!r} (a new metric)")
            elif not close(key, g[key], p[key]):
                a, b = g[key], p[key]
                rel = f"{abs(a - b) / abs(b):.2e}" if a is not None and b is not None and b != 0 else "n/a"
                lines.append(f"{key:<24} step {step}: pinned {b!r}, got {a!r} (rel diff {rel})")
    return lines


def run_pinned_setup(loop: str, tmp_path: Path, name: str, **overrides) -> list[dict]:
    """The pinned setup of ``loop`` (the config in ``golden/LOOP.json``, this file's reward and prompts, a
    fresh tiny policy) with ``overrides``, at one intra-op thread: its ``comparable`` metrics rows. For the
    tests that a switch keeps the numbers: compare two such runs with ``mismatches``."""
    config = json.loads((GOLDEN_DIR / f"{loop}.json").read_text())["config"]
    policy = tmp_path / "policy"
    if not policy.is_dir():
        tiny_causal_lm("gpt2", VOCAB, seed=0).save_pretrained(policy)
        tiny_tokenizer(VOCAB).save_pretrained(policy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_dir = rlbits.train(reward_fn=reward, prompts=PROMPTS, config={
            **config, "policy": str(policy), "run_dir": str(tmp_path / name), **overrides,
        })
    finally:
        torch.set_num_threads(threads)
    return [comparable(json.loads(line)) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    """A random tiny GPT-2 (seed 0) and the character tokenizer, saved as an HF folder."""
    path = tmp_path_factory.mktemp("golden") / "policy"
    tiny_causal_lm("gpt2", VOCAB, seed=0).save_pretrained(path)
    tiny_tokenizer(VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory) -> str:
    """The reward model's backbone: a random tiny GPT-2 (seed 0) with dropout 0.1, and the tokenizer."""
    path = tmp_path_factory.mktemp("golden") / "backbone"
    dropout = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    tiny_causal_lm("gpt2", VOCAB, seed=0, **dropout).save_pretrained(path)
    tiny_tokenizer(VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("loop", sorted([*LOOPS, "reward_model"]))
def test_first_three_steps_match_the_pinned_metrics(loop, policy_dir, backbone_dir, tmp_path, one_thread):
    run = {"run_dir": str(tmp_path / "run")}
    if loop == "reward_model":
        config = REWARD_MODEL
        data = {"model": backbone_dir, "dataset": str(write_pairs(tmp_path / "pairs.jsonl"))}
        run_dir = rlbits.train(config={**config, **data, **run})
    else:
        config = {**COMMON, **LOOPS[loop]}
        inputs = {"reward_fn": reward, "prompts": PROMPTS}
        run_dir = rlbits.train(**inputs, config={**config, "policy": policy_dir, **run})
    rows = [
        comparable(json.loads(line)) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    path = GOLDEN_DIR / f"{loop}.json"

    if os.environ.get(UPDATE_ENV):
        GOLDEN_DIR.mkdir(exist_ok=True)
        golden = {
            "about": f"Pinned metrics of tests/loops/test_golden.py ({loop}); regenerate with: {REGENERATE}",
            "generated_with": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "machine": platform.machine(),
            },
            "config": config,
            "rows": rows,
        }
        path.write_text(json.dumps(golden, indent=1) + "\n")
        return

    if not path.is_file():
        pytest.fail(f"{path} does not exist: create it with `{REGENERATE}` and commit it", pytrace=False)
    golden = json.loads(path.read_text())
    if golden["config"] != config:
        changed = sorted(
            k for k in set(golden["config"]) | set(config) if golden["config"].get(k) != config.get(k)
        )
        pytest.fail(
            f"the {loop} setup of tests/loops/test_golden.py changed ({', '.join(changed)}) since {path.name} was "
            f"pinned: regenerate with `{REGENERATE}` and commit tests/loops/golden/",
            pytrace=False,
        )
    lines = mismatches(golden["rows"], rows)
    if lines:
        pytest.fail(
            f"{loop}: {len(lines)} metric(s) differ from {path.relative_to(GOLDEN_DIR.parent.parent)} "
            f"(rtol {RTOL}, atol {ATOL}; pinned with {golden.get('generated_with')}):\n  "
            + "\n  ".join(lines)
            + f"\nIf the change is intended (e.g. a new seed derivation), regenerate with `{REGENERATE}`, "
            "check the diff of tests/loops/golden/ and commit it with the change.",
            pytrace=False,
        )
