"""Benchmark: rlbits ``generate`` vs HF ``model.generate(do_sample=True)`` on one random-init model.

GPT-2 architecture (default: 4 layers, width 256, 4 heads, vocab 32000), 16-token prompts, 32 new tokens,
EOS disabled (every row decodes all tokens), fp32, 2 intra-op threads, temperature 1, no top-k/top-p.
Each (implementation, batch size) runs in a fresh subprocess: one warm-up call, then the median of
``--runs`` timed calls. Throughput is generated tokens per second (B * new tokens / wall time).

Peak memory is the growth of the process's peak resident set (``resource.getrusage(RUSAGE_SELF).ru_maxrss``)
from just before the warm-up to after the last run: memory the calls needed beyond the model and inputs.
(tracemalloc would miss it: it sees Python allocations only, not PyTorch's.)

    python benchmarks/bench_generate.py                  # batch 8 and 32, prints a table
    python benchmarks/bench_generate.py --batch-sizes 8 --runs 3

Writes ``bench_generate.json`` next to this file (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

IMPLS = ("rlbits", "hf")


def _build(args):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(args.threads)
    config = GPT2Config(
        vocab_size=args.vocab,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=args.prompt_len + args.new_tokens,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _worker(args) -> dict:
    import torch
    from tensordict import TensorDict

    from rlbits.rollout.generate import generate

    model = _build(args)
    B = args.batch
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (B, args.prompt_len), generator=g)
    mask = torch.ones_like(prompts, dtype=torch.bool)
    td = TensorDict(prompts=prompts, prompt_mask=mask, batch_size=[B])
    sample_gen = torch.Generator().manual_seed(2)

    if args.impl == "rlbits":

        def call():
            out = generate(
                model, td, max_new_tokens=args.new_tokens, temperature=1.0,
                eos_token_id=None, pad_token_id=0, generator=sample_gen,
            )
            return out["responses"].shape[1]
    else:

        def call():
            with torch.no_grad():
                out = model.generate(
                    input_ids=prompts, attention_mask=mask.long(), do_sample=True, temperature=1.0,
                    top_k=0, top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                    pad_token_id=0,
                )
            return out.shape[1] - args.prompt_len

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n_new = call()  # warm-up
    if n_new != args.new_tokens:
        raise RuntimeError(f"{args.impl} generated {n_new} tokens, expected {args.new_tokens}")
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    median = statistics.median(times)
    return {
        "impl": args.impl,
        "batch": B,
        "median_s": median,
        "times_s": times,
        "tokens_per_s": B * args.new_tokens / median,
        "peak_rss_delta_mib": (rss_after - rss_before) / 1024,  # ru_maxrss is in KiB on Linux
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    # Internal: run one measurement in this process and print it as JSON.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")

    if args.worker:
        print(json.dumps(_worker(args)))
        return []

    shared = [
        f"--prompt-len={args.prompt_len}", f"--new-tokens={args.new_tokens}", f"--layers={args.layers}",
        f"--width={args.width}", f"--heads={args.heads}", f"--vocab={args.vocab}",
        f"--threads={args.threads}", f"--runs={args.runs}",
    ]
    results = []
    for batch in args.batch_sizes:
        for impl in args.impls:
            cmd = [sys.executable, __file__, "--worker", f"--impl={impl}", f"--batch={batch}", *shared]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{impl} at batch {batch} failed:\n{proc.stderr}")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    print(f"{'impl':<8} {'batch':>5} {'median s':>9} {'tokens/s':>9} {'peak RSS +MiB':>13}")
    for r in results:
        print(f"{r['impl']:<8} {r['batch']:>5} {r['median_s']:>9.4f} {r['tokens_per_s']:>9.0f} {r['peak_rss_delta_mib']:>13.1f}")
    for batch in args.batch_sizes:
        by = {r["impl"]: r for r in results if r["batch"] == batch}
        if len(by) == 2:
            print(f"batch {batch}: rlbits / hf throughput = {by['rlbits']['tokens_per_s'] / by['hf']['tokens_per_s']:.2f}x")

    import torch
    import transformers

    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "impl", "batch", "out")},
        "memory": "growth of ru_maxrss (peak RSS) from before the warm-up to after the timed runs",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "machine": platform.processor() or platform.machine(),
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
