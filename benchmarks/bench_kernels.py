"""Time the functional kernels, eager and compiled, against torchrl's GAE and a naive reference.

    python benchmarks/bench_kernels.py                 # B=256, R=1024; logprobs at B=8, R=1024, V=32000;
                                                       # output layer + logprobs at B=2, R=1024, H=256
    python benchmarks/bench_kernels.py --batch 64 --repeat 5

logprobs cannot run at B=256, R=1024, V=32000 here: the [B, R, V] float32 logits alone would be 33 GB.

Prints a markdown table and writes benchmarks/results/bench_kernels.json. Times are the median (and best)
of --repeat runs after --warmup runs, in milliseconds, forward only unless the row says fwd+bwd.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import rlbits
from rlbits.functional.logprobs import logprobs_from_hidden


def bench(fn, warmup: int, repeat: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def naive_gae(rewards, values, mask, gamma, lam):
    """The usual loop over positions (vectorised over B), with where() to skip non-action tokens."""
    B, R = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(B)
    next_adv = torch.zeros(B)
    for t in reversed(range(R)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    return adv, torch.where(mask, adv + values, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--logprobs-batch", type=int, default=8, help="B for logprobs (B*R*V floats must fit)"
    )
    parser.add_argument("--head-batch", type=int, default=2, help="B of the output-layer + logprobs rows")
    parser.add_argument("--hidden", type=int, default=256, help="H of the output-layer + logprobs rows")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_kernels.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, R, V = args.batch, args.length, args.vocab

    lengths = torch.randint(R // 4, R + 1, (B,))
    mask = torch.arange(R)[None, :] < lengths[:, None]
    rewards, values = torch.randn(B, R), torch.randn(B, R)
    old = torch.randn(B, R)
    logprobs = (old + 0.1 * torch.randn(B, R)).requires_grad_(True)
    advantages = torch.randn(B, R)

    def ppo_fwd_bwd(fn):
        def run():
            loss, _ = fn(logprobs, old, advantages, mask, clip_eps=0.2)
            loss.backward()
            logprobs.grad = None

        return run

    compiled_gae = torch.compile(rlbits.gae, fullgraph=True)
    compiled_ppo = torch.compile(rlbits.ppo_loss, fullgraph=True)
    rows = []

    def add(name, fn, shape, heavy=False):
        median, best = bench(fn, 1 if heavy else args.warmup, min(args.repeat, 3) if heavy else args.repeat)
        rows.append(
            {"kernel": name, "shape": shape, "median_ms": round(median, 3), "best_ms": round(best, 3)}
        )
        print(f"{name:45s} {shape:22s} {median:10.2f} {best:10.2f}", flush=True)

    print(f"{'kernel':45s} {'shape':22s} {'median ms':>10s} {'best ms':>10s}")
    shape = f"B={B} R={R}"
    add("rlbits.gae (eager)", lambda: rlbits.gae(rewards, values, mask, 1.0, 0.95), shape)
    add("rlbits.gae (compiled)", lambda: compiled_gae(rewards, values, mask, 1.0, 0.95), shape)
    add("naive loop over R (eager)", lambda: naive_gae(rewards, values, mask, 1.0, 0.95), shape)
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate

        v = values[..., None]
        nv = torch.cat([values[:, 1:], torch.zeros(B, 1)], 1)[..., None]
        done = (~torch.cat([mask[:, 1:], torch.zeros(B, 1, dtype=torch.bool)], 1))[..., None]
        r = rewards[..., None]
        add(
            "torchrl vec_generalized_advantage_estimate",
            lambda: vec_generalized_advantage_estimate(1.0, 0.95, v, nv, r, done, done),
            shape,
        )
    except ImportError:  # torchrl is a dependency, but keep the script usable without it
        pass
    add("rlbits.ppo_loss fwd+bwd (eager)", ppo_fwd_bwd(rlbits.ppo_loss), shape)
    add("rlbits.ppo_loss fwd+bwd (compiled)", ppo_fwd_bwd(compiled_ppo), shape)

    Bl = args.logprobs_batch
    logits = torch.randn(Bl, R, V, requires_grad=True)
    tokens = torch.randint(0, V, (Bl, R))
    compiled_lp = torch.compile(rlbits.logprobs_from_logits, fullgraph=True)

    def lp_run(fn):
        def run():
            fn(logits, tokens, 0.7).sum().backward()
            logits.grad = None

        return run

    def naive_lp(lg, tok, temperature):
        return torch.log_softmax(lg / temperature, -1).gather(-1, tok[..., None]).squeeze(-1)

    lshape = f"B={Bl} R={R} V={V}"
    add("rlbits.logprobs_from_logits fwd+bwd (eager)", lp_run(rlbits.logprobs_from_logits), lshape)
    add("rlbits.logprobs_from_logits fwd+bwd (compiled)", lp_run(compiled_lp), lshape)
    add("naive log_softmax+gather fwd+bwd (eager)", lp_run(naive_lp), lshape)
    logits = None  # free the 1 GB of logits before the next rows

    # Output layer + logprobs (what a training forward needs): F.linear then logprobs_from_logits, vs the
    # fused logprobs_from_hidden that never holds the [B, R, V] logits.
    Bh, H = args.head_batch, args.hidden
    hidden = torch.randn(Bh, R, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.02).requires_grad_(True)
    htokens = torch.randint(0, V, (Bh, R))

    def head_run(fused):
        def run():
            if fused:
                out = logprobs_from_hidden(hidden, weight, htokens, 0.7)
            else:
                out = rlbits.logprobs_from_logits(torch.nn.functional.linear(hidden, weight), htokens, 0.7)
            out.sum().backward()
            hidden.grad = weight.grad = None

        return run

    hshape = f"B={Bh} R={R} H={H} V={V}"
    add("F.linear + logprobs_from_logits fwd+bwd", head_run(False), hshape, heavy=True)
    add("rlbits logprobs_from_hidden (fused) fwd+bwd", head_run(True), hshape, heavy=True)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "load_average_1min": os.getloadavg()[0],
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
