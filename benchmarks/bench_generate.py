"""Benchmark: rlbits ``generate`` vs HF ``model.generate(do_sample=True)`` on one random-init model.

GPT-2 architecture (default: 4 layers, width 256, 4 heads, vocab 32000), 16-token prompts, 32 new tokens,
EOS disabled (every row decodes all tokens), fp32, 2 intra-op threads, temperature 1, no top-k/top-p.
Timing: per batch size, one fresh subprocess builds the model, warms up each implementation once, then
alternates them for ``--runs`` timed calls each (so a change in machine load hits both alike) and takes
the median. Throughput is generated tokens per second (B * new tokens / wall time).

Peak memory: in another fresh subprocess per (implementation, batch size), the peak growth of the
resident set during the first call, sampled every 0.5 ms from ``/proc/self/statm`` (Linux) by a
background thread: the memory the call needs beyond the model and inputs. (tracemalloc would miss it: it
sees Python allocations only, not PyTorch's; ``ru_maxrss`` reads 0 when the imports and model build
already set a higher peak.) The 1-minute load average is recorded: on a shared machine the
timings are only comparable between implementations, not across runs.

    python benchmarks/bench_generate.py                  # batch 8 and 32, prints a table
    python benchmarks/bench_generate.py --batch-sizes 8 --runs 3

Writes ``benchmarks/results/bench_generate.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
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


def _calls(args):
    """``{impl: call}`` for one batch size; each call generates ``new_tokens`` tokens per row."""
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

    def rlbits_call():
        out = generate(
            model,
            td,
            max_new_tokens=args.new_tokens,
            temperature=1.0,
            eos_token_id=None,
            pad_token_id=0,
            generator=sample_gen,
        )
        return out["responses"].shape[1]

    def hf_call():
        with torch.no_grad():
            out = model.generate(
                input_ids=prompts,
                attention_mask=mask.long(),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
            )
        return out.shape[1] - args.prompt_len

    return {"rlbits": rlbits_call, "hf": hf_call}


def _time_worker(args) -> list[dict]:
    """Time the implementations on one batch size in one process, alternating them run by run, so a
    change in machine load hits both alike."""
    calls = {k: v for k, v in _calls(args).items() if k in args.impls}
    for name, call in calls.items():  # warm-up
        n_new = call()
        if n_new != args.new_tokens:
            raise RuntimeError(f"{name} generated {n_new} tokens, expected {args.new_tokens}")
    times = {name: [] for name in calls}
    for _ in range(args.runs):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    out = []
    for name, ts in times.items():
        median = statistics.median(ts)
        out.append(
            {
                "impl": name,
                "batch": args.batch,
                "median_s": median,
                "times_s": ts,
                "tokens_per_s": args.batch * args.new_tokens / median,
            }
        )
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_worker(args) -> float:
    """Peak RSS growth (MiB) during the first call of ``args.impl`` in a fresh process, sampled every
    0.5 ms from ``/proc/self/statm`` by a background thread (PyTorch releases the GIL in its kernels)."""
    call = _calls(args)[args.impl]
    gc.collect()
    base = _rss_bytes()
    peak = base
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        call()
    finally:
        done.set()
        sampler.join()
    return (max(peak, _rss_bytes()) - base) / 2**20


def _run_worker(kind: str, extra: list[str], shared: list[str]):
    cmd = [sys.executable, __file__, f"--worker={kind}", *extra, *shared]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"worker {' '.join(extra)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_generate.json")
    # Internal: run one measurement in this process and print it as JSON.
    p.add_argument("--worker", choices=("time", "memory"), help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")

    if args.worker == "time":
        print(json.dumps(_time_worker(args)))
        return []
    if args.worker == "memory":
        print(json.dumps(_memory_worker(args)))
        return []

    shared = [
        f"--prompt-len={args.prompt_len}",
        f"--new-tokens={args.new_tokens}",
        f"--layers={args.layers}",
        f"--width={args.width}",
        f"--heads={args.heads}",
        f"--vocab={args.vocab}",
        f"--threads={args.threads}",
        f"--runs={args.runs}",
        "--impls",
        *args.impls,
    ]
    load_before = os.getloadavg()
    results = []
    for batch in args.batch_sizes:
        timed = _run_worker("time", [f"--batch={batch}"], shared)
        for r in timed:
            r["peak_rss_growth_mib"] = _run_worker(
                "memory", [f"--batch={batch}", f"--impl={r['impl']}"], shared
            )
        results.extend(timed)
    load_after = os.getloadavg()

    print(f"{'impl':<8} {'batch':>5} {'median s':>9} {'tokens/s':>9} {'peak RSS +MiB':>13}")
    for r in results:
        print(
            f"{r['impl']:<8} {r['batch']:>5} {r['median_s']:>9.4f} {r['tokens_per_s']:>9.0f} {r['peak_rss_growth_mib']:>13.1f}"
        )
    for batch in args.batch_sizes:
        by = {r["impl"]: r for r in results if r["batch"] == batch}
        if len(by) == 2:
            print(
                f"batch {batch}: rlbits / hf throughput = {by['rlbits']['tokens_per_s'] / by['hf']['tokens_per_s']:.2f}x"
            )

    import torch
    import transformers

    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "impl", "batch", "out")},
        "memory": "peak RSS growth during the first call in a fresh process, sampled every 0.5 ms from /proc/self/statm",
        "load_average_1min": [load_before[0], load_after[0]],
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": platform.processor() or platform.machine(),
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
