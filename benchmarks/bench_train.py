"""Update throughput and MFU of the rlbits policy update on the standard model and a 67M one.

One update = the compute of the loops' update phase on one microbatch: ``policy_logprobs`` (teacher-forced
forward with entropy, the fused output layer), ``ppo_loss``, backward, gradient clipping and an AdamW step.
Batch: 32 rows of 16 prompt + 32 response tokens (the standard workload's rollout batch).

- tokens/s = B * (P + R) / seconds per update.
- MFU = 6 * params * tokens / seconds / peak, with ``peak`` the measured float32 (or bf16) matmul rate of
  this machine at the same thread count (best of ``--repeat`` 2048^3 matmuls, measured right before each
  row so that machine load affects both). ``params`` counts every
  parameter (the tied embedding included, as is usual); since the output layer only runs on the R
  response positions, the matmul work actually needed is lower, and the table also gives that
  ("needed" MFU = (6 * non-embedding params * tokens + 6 * V * H * B * R) / seconds / peak).

    python benchmarks/bench_train.py                     # standard + 67M, fp32 and bf16, ~3 min
    python benchmarks/bench_train.py --models standard --repeat 3

Writes ``benchmarks/results/bench_train.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _workload as W  # noqa: E402

MODELS = {"standard": dict(layers=4, width=256, heads=4), "67M": dict(layers=6, width=768, heads=12)}


def matmul_peak(dtype: torch.dtype, repeat: int, n: int = 2048) -> float:
    """Best measured FLOP/s of an n^3 matmul in ``dtype``."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def bench_update(name: str, precision: str, args) -> dict:
    from transformers import GPT2LMHeadModel

    from rlbits.batch import build_batch
    from rlbits.functional import masked_mean, ppo_loss
    from rlbits.models.forward import policy_logprobs

    torch.manual_seed(0)
    arch = MODELS[name]
    model = GPT2LMHeadModel(W.model_config(**arch)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    B, P, R = args.batch, args.prompt_len, args.response_len
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, 31999, (B, P), generator=g)
    responses = torch.randint(2, 31999, (B, R), generator=g)
    ones = torch.ones(B, R, dtype=torch.bool)
    batch = build_batch(prompts, torch.ones(B, P, dtype=torch.bool), responses, ones)
    old = -torch.rand(B, R, generator=g) * 10
    adv = torch.randn(B, R, generator=g)
    params = [p for p in model.parameters()]

    def update():
        ctx = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if precision == "bf16"
            else torch.autocast("cpu", enabled=False)
        )
        with ctx:
            logprobs, entropy = policy_logprobs(model, batch, return_entropy=True)
            loss, _ = ppo_loss(logprobs, old, adv, ones)
        loss.backward()
        masked_mean(entropy.detach(), ones)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    update()  # warm-up
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        update()
        times.append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in model.parameters())
    vocab, width = model.config.vocab_size, model.config.n_embd
    non_embed = n_params - vocab * width - model.config.n_positions * width
    tokens = B * (P + R)
    median = statistics.median(times)
    return {
        "model": name,
        "precision": precision,
        "params": n_params,
        "tokens": tokens,
        "median_s": median,
        "best_s": min(times),
        "times_s": times,
        "tokens_per_s": tokens / median,
        "flops_6nt": 6 * n_params * tokens,
        "flops_needed": 6 * non_embed * tokens + 6 * vocab * width * B * R,
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench_train.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]
    rows = []
    for name in args.models:
        for prec in args.precisions:
            # The peak is measured right before each row, so a loaded machine slows both alike.
            peak = matmul_peak(torch.float32 if prec == "fp32" else torch.bfloat16, max(args.repeat, 5))
            r = bench_update(name, prec, args)
            r["matmul_peak_flops"] = peak
            r["mfu"] = r["flops_6nt"] / r["median_s"] / peak
            r["mfu_needed"] = r["flops_needed"] / r["median_s"] / peak
            r["load_1min"] = os.getloadavg()[0]
            rows.append(r)
            print(
                f"{name} {prec}: {r['median_s']:.3f} s/update, {r['tokens_per_s']:.0f} tok/s, MFU {r['mfu']:.1%}",
                flush=True,
            )
    load.append(os.getloadavg()[0])
    table = [
        "| model | params | precision | median s/update | tokens/s | MFU (6NT) | MFU (needed FLOPs) | matmul peak GFLOP/s | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['precision']} | {r['median_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {r['mfu_needed']:.1%} | "
            f"{r['matmul_peak_flops'] / 1e9:.0f} | {r['load_1min']:.1f} |"
        )
    print("\n".join(table))
    import transformers

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "load_average_1min": load,
        "rows": rows,
        "table": "\n".join(table),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
