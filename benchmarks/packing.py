"""Seconds per update on an uneven workload: the GRPO and PPO update phases with ``pack_sequences`` and
``max_tokens_per_microbatch`` off and on, beside a uniform workload with the same real tokens (issue 28).

Workload (fixed, shared): ``--rows`` rollouts of 16-token prompts; response lengths drawn per row from
``random.Random(seed)``: with probability 0.1 the budget ``--budget`` (a row that ran to the end), else
uniform in ``[1, budget // 8]`` (most rows short). Tokens are random ids; logprobs are the policy's own
(ratio 1), advantages standard normal per row. The uniform control gives every row the mean length of the
uneven one (the same real tokens, rounded). Models (``--model``): ``standard`` (benchmarks/_workload.py: GPT-2,
4 layers, width 256, vocabulary 32,000) or ``smollm2`` (SmolLM2-135M's shape, random init); fp32, or bf16
under CPU autocast (``--precision``).

Variants, each the loop's own ``update`` phase (``rlbits.loops.reinforce.update`` for GRPO,
``rlbits.loops.ppo.update`` for PPO: 4 epochs, a critic of the same shape):

- ``padded``: ``microbatch_size`` rows (``--microbatch``), each microbatch padded to its longest row;
- ``packed``: ``pack_sequences=True``, the same rows per microbatch (bins as long as the longest row);
- ``packed_one_row``: the same, with each microbatch's real tokens in one row [1, N] (``pack_index`` with a
  capacity of all N tokens: the layout before bins, whose dense [N, N] mask made a uniform update slower);
- ``budget``: ``max_tokens_per_microbatch`` (``--tokens``; default the padded microbatch's worst case
  ``microbatch x (16 + budget)``), padded;
- ``packed_budget``: both switches.

Each variant is timed ``--repeats`` times after one warm-up (median reported, seconds, one JSON line per
row of the table). ``--smoke`` runs a tiny model (GPT-2, 2 layers, width 64, vocabulary 512) on 8 rows once: a check that the
script works, not a measurement.
Run it on a quiet machine: ``python benchmarks/packing.py --model standard --rows 64 --budget 256``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workload  # noqa: E402

from rlbits.batch import build_batch  # noqa: E402
from rlbits.data.stream import PromptStream  # noqa: E402
from rlbits.distributed.env import DistEnv  # noqa: E402
from rlbits.loops import ppo, reinforce  # noqa: E402
from rlbits.loops.runtime import disable_dropout  # noqa: E402
from rlbits.models.forward import critic_values, policy_logprobs  # noqa: E402
from rlbits.models.heads import ValueModel  # noqa: E402

PROMPT = 16
GROUP = 4


def lengths(rows: int, budget: int, seed: int, uniform: bool) -> list[int]:
    """The response lengths (above); ``uniform``: every row the uneven workload's mean."""
    rng = random.Random(seed)
    uneven = [budget if rng.random() < 0.1 else rng.randint(1, max(1, budget // 8)) for _ in range(rows)]
    return [round(sum(uneven) / rows)] * rows if uniform else uneven


def make_batch(policy, vocab: int, response_lengths: list[int], seed: int):
    rows, r = len(response_lengths), max(response_lengths)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab - 1, (rows, PROMPT), generator=g)
    responses = torch.randint(2, vocab - 1, (rows, r), generator=g)
    action_mask = torch.arange(r)[None] < torch.tensor(response_lengths)[:, None]
    batch = build_batch(prompts, torch.ones_like(prompts, dtype=torch.bool), responses, action_mask,
                        rewards=torch.randn(rows, generator=g))
    with torch.no_grad():
        batch["logprobs"] = policy_logprobs(policy, batch, microbatch_size=16)
    batch["ref_logprobs"] = batch["logprobs"].clone()
    batch["advantages"] = torch.where(action_mask, torch.randn(rows, 1, generator=g), 0.0)
    batch["returns"] = batch["advantages"].clone()
    batch["loss_mask"] = action_mask.clone()
    return batch


def build_model(name: str, smoke: bool):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "smollm2" and not smoke:
        config = _workload.smollm2_config(positions=4096)
        return disable_dropout(LlamaForCausalLM(config)).train(), config.vocab_size
    arch = dict(vocab=512, width=64, layers=2, heads=2) if smoke else {}
    config = _workload.model_config(positions=4096, **arch)
    return disable_dropout(GPT2LMHeadModel(config)).train(), config.vocab_size


@contextlib.contextmanager
def one_row_packing():
    """Packing as one row [1, N] per microbatch: ``pack_index`` with a capacity of all the real tokens."""
    from rlbits.models import forward

    original = forward.pack_index
    forward.pack_index = lambda mask, capacity=None: original(mask, capacity=max(int(mask.sum()), 1))
    try:
        yield
    finally:
        forward.pack_index = original


def update_seconds(algo: str, policy, batch, switches: dict, args) -> float:
    """Seconds of one update phase of ``algo`` (learning rate 0: the same weights, the same work, every repeat)."""
    switches = dict(switches)
    layout = one_row_packing() if switches.pop("one_row", False) else contextlib.nullcontext()
    common = dict(microbatch_size=args.microbatch, precision=args.precision, **switches)
    gens = dict(sampling_generator=torch.Generator(), minibatch_generator=torch.Generator().manual_seed(1),
                stream=PromptStream(["unused"], seed=0))
    if algo == "grpo":
        cfg = reinforce.ReinforceConfig(num_generations_per_prompt=GROUP, adv_estimator="grpo", **common)
        state = reinforce.State(env=DistEnv(), policy=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=0.0),
                                **gens)
        phase = reinforce.update
    else:
        value_model = args.value_model
        cfg = ppo.PPOConfig(ppo_epochs=4, **common)
        state = ppo.State(env=DistEnv(), policy=policy, value_model=value_model,
                          policy_optimizer=torch.optim.SGD(policy.parameters(), lr=0.0),
                          value_optimizer=torch.optim.SGD(value_model.parameters(), lr=0.0), kl_coef=0.0, **gens)
        phase = ppo.update
    with layout:
        start = time.perf_counter()
        phase(state, batch, cfg)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["standard", "smollm2"], default="standard")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--budget", type=int, default=256, help="the longest response (a tenth of the rows)")
    parser.add_argument("--microbatch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=None, help="max_tokens_per_microbatch (default above)")
    parser.add_argument("--algos", default="grpo,ppo")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny size, once: does the script run")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.budget, args.microbatch, args.repeats = 8, 16, 4, 0
    torch.set_num_threads(args.threads)
    tokens = args.tokens or args.microbatch * (PROMPT + args.budget)
    policy, vocab = build_model(args.model, args.smoke)
    args.value_model = disable_dropout(ValueModel.from_policy(policy, seed=1)).train()
    variants = {
        "padded": {"pack_sequences": False},
        "packed": {"pack_sequences": True},
        "packed_one_row": {"pack_sequences": True, "one_row": True},
        "budget": {"pack_sequences": False, "max_tokens_per_microbatch": tokens},
        "packed_budget": {"pack_sequences": True, "max_tokens_per_microbatch": tokens},
    }
    for workload in ("uneven", "uniform"):
        resp = lengths(args.rows, args.budget, args.seed, uniform=workload == "uniform")
        batch = make_batch(policy, vocab, resp, args.seed)
        if "ppo" in args.algos:
            with torch.no_grad():
                batch["values"] = critic_values(args.value_model, batch, microbatch_size=16)
        for algo in args.algos.split(","):
            for name, switches in variants.items():
                times = [update_seconds(algo, policy, batch, switches, args) for _ in range(args.repeats + 1)]
                timed = times[1:] or times
                print(json.dumps({
                    "workload": workload, "model": "smoke" if args.smoke else args.model, "algo": algo, "variant": name,
                    "precision": args.precision, "rows": args.rows, "real_tokens": sum(resp) + PROMPT * args.rows,
                    "padded_tokens": args.rows * (PROMPT + max(resp)), "seconds": statistics.median(timed),
                    "all_seconds": times,
                }), flush=True)


if __name__ == "__main__":
    main()
