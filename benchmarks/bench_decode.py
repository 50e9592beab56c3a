"""Benchmark: decoding a 135M-parameter model (SmolLM2-135M's architecture) on the CPU, against its floors.

Implementations, per batch size (default 8, 16, 32): HF ``model.generate(do_sample=True)`` (its default
dynamic cache), rlbits ``generate`` eager, and rlbits ``generate(compile=True)`` (one decode step under
``torch.compile``, static KV cache). 16-token prompts, 24 new tokens (the SmolLM2 RL workload of
``bench_step.py``), EOS never sampled (``eos_token_id=None``), temperature 1, fp32 (``--dtype bf16``
casts the weights), 2 threads. Each implementation is warmed up once, then they alternate for ``--runs``
timed calls each and the median is kept.

Floors, per call: compute = 2 x parameters x (B x prompt tokens + B x new tokens) FLOPs at the machine's
measured matmul rate (a large square fp32 matmul, ``--peak`` to override); memory = every weight read once
per decode step (new tokens - 1 steps) plus the prefill's, at the measured read bandwidth (the sum of a
1 GiB tensor). At batch 16, decoding reads 538 MB of fp32 weights per step for 4.3 GFLOP, so on this
machine it is bound by memory bandwidth, not arithmetic.

Compile cost: the wall time of the first ``compile=True`` call minus a steady call, in this process.
Inductor caches compiled code on disk (``TORCHINDUCTOR_CACHE_DIR``, by default under /tmp), so a second
run of this script shows the warm-cache cost.

    python benchmarks/bench_decode.py                         # random-init SmolLM2 shape, fp32
    python benchmarks/bench_decode.py --model ~/.cache/rlbits/models/smollm2-135m --batch-sizes 16

Writes ``benchmarks/results/bench_decode.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measured_peaks(threads: int) -> dict:
    """Matmul GFLOP/s (fp32, 2048^2 x 2048) and read bandwidth GB/s (sum of 1 GiB), best of 5."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        flops.append(2 * 2048**3 / (time.perf_counter() - t) / 1e9)
    x = torch.ones(2**28)  # 1 GiB of float32
    bw = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        bw.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return {"matmul_gflops": max(flops), "read_gbs": max(bw)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local HF folder (default: random init, SmolLM2-135M shape)")
    p.add_argument("--batch-sizes", default="8,16,32")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--impls", default="hf,rlbits,rlbits_compile")
    p.add_argument("--peak", type=float, default=None, help="matmul GFLOP/s for the compute floor")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_decode.json"))
    args = p.parse_args()

    import torch
    from _workload import smollm2_config
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM

    from rlbits.rollout.generate import generate

    torch.set_num_threads(args.threads)
    peaks = measured_peaks(args.threads)
    if args.peak:
        peaks["matmul_gflops"] = args.peak
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(smollm2_config())
    model = model.eval()
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    impls = args.impls.split(",")
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (B, args.prompt_len), generator=g)
        td = TensorDict(prompts=prompts, prompt_mask=torch.ones_like(prompts, dtype=torch.bool), batch_size=[B])

        def call(impl, B=B, prompts=prompts, td=td):
            gen = torch.Generator().manual_seed(1)
            t = time.perf_counter()
            with torch.no_grad():
                if impl == "hf":
                    model.generate(
                        prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=None, top_p=None,
                        temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                        eos_token_id=None, pad_token_id=0,
                    )  # fmt: skip
                else:
                    out = generate(
                        model, td, max_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0,
                        generator=gen, compile=impl == "rlbits_compile",
                    )  # fmt: skip
                    assert out["responses"].shape == (B, args.new_tokens)
            return time.perf_counter() - t

        first = {impl: call(impl) for impl in impls}
        times = {impl: [] for impl in impls}
        for _ in range(args.runs):
            for impl in impls:
                times[impl].append(call(impl))
        tokens = B * args.new_tokens
        compute_floor = 2 * n_params * B * (args.prompt_len + args.new_tokens) / (peaks["matmul_gflops"] * 1e9)
        memory_floor = weight_bytes * args.new_tokens / (peaks["read_gbs"] * 1e9)  # prefill + (N - 1) steps
        for impl in impls:
            med = statistics.median(times[impl])
            row = {
                "impl": impl, "batch": B, "median_s": med, "times_s": times[impl], "tokens_per_s": tokens / med,
                "first_call_s": first[impl], "compute_floor_s": compute_floor, "memory_floor_s": memory_floor,
                "x_compute_floor": med / compute_floor, "x_memory_floor": med / memory_floor,
            }  # fmt: skip
            if impl == "rlbits_compile":
                row["compile_cost_s"] = first[impl] - med
            rows.append(row)
            extra = f"  compile {row['compile_cost_s']:.1f} s" if "compile_cost_s" in row else ""
            print(
                f"B={B:3d} {impl:15s} {med:7.3f} s  {tokens / med:7.1f} tok/s  "
                f"{med / compute_floor:4.2f}x compute floor ({compute_floor:.3f} s)  "
                f"{med / memory_floor:4.2f}x memory floor ({memory_floor:.3f} s){extra}",
                flush=True,
            )
    result = {
        "command": " ".join(["python", "benchmarks/bench_decode.py", *sys.argv[1:]]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_1min": os.getloadavg()[0],
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads},
        "model": args.model or "random init, SmolLM2-135M config", "dtype": args.dtype, "parameters": n_params,
        "weight_bytes": weight_bytes, "peaks": peaks, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "rows": rows,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"peaks: {peaks['matmul_gflops']:.0f} GFLOP/s, {peaks['read_gbs']:.1f} GB/s; load {result['load_1min']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
