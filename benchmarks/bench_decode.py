"""Benchmark: decoding a 135M-parameter model (SmolLM2-135M's architecture) on the CPU, against its floors.

Implementations, per batch size (default 8, 16, 32): HF ``model.generate(do_sample=True)`` (its default
dynamic cache), rlbits ``generate`` eager (on CPU its default: linear layers through oneDNN on packed
weights), ``rlbits_unpacked`` (eager with ``pack_weights=False``: MKL's ``F.linear``), and rlbits
``generate(compile=True)`` (one decode step under ``torch.compile``, static KV cache). 16-token prompts, 24 new tokens (the SmolLM2 RL workload of
``bench_step.py``), EOS never sampled (``eos_token_id=None``), temperature 1, fp32 (``--dtype bf16``
casts the weights), 2 threads. Each implementation is warmed up once, then they alternate for ``--runs``
timed calls each and the median is kept.

``--num-samples K`` samples K responses per prompt from B / K distinct prompts, as the GRPO step's rollout
does (``--batch-sizes 16 --num-samples 4 --prompt-len 10``): rlbits prefills each prompt once, HF's
``num_return_sequences`` every row.

Floors, per call: compute = 2 x parameters x (B / K x prompt tokens + B x new tokens) FLOPs at the
machine's measured matmul rate (a large square fp32 matmul, the faster of MKL and oneDNN; ``--peak`` to override);
memory = every weight read once per decode step (new tokens - 1 steps) plus the prefill's, at the measured
read bandwidth (the sum of a 1 GiB tensor). At batch 16, decoding reads 538 MB of fp32 weights per step for
4.3 GFLOP: about balanced on the 2-core machines this was measured on (24-36 GB/s, 220-364 GFLOP/s), so
whichever floor is higher binds.

``--profile`` runs one more call per implementation under ``torch.profiler`` and reports its matmul
kernels' own time and FLOPs (``_profile.py``): that time over the compute floor is the best ratio those
kernels allow, whatever else is removed. The same calls are also replayed in order without the profiler.

Compile cost: the wall time of the first ``compile=True`` call minus a steady call, in this process.
Inductor caches compiled code on disk (``TORCHINDUCTOR_CACHE_DIR``, by default under /tmp), so a second
run of this script shows the warm-cache cost.

    python benchmarks/bench_decode.py                         # random-init SmolLM2 shape, fp32
    python benchmarks/bench_decode.py --model ~/.cache/rlbits/models/smollm2-135m --batch-sizes 16
    python benchmarks/bench_decode.py --matmuls               # the step's matmuls alone: MKL vs oneDNN packed
    python benchmarks/bench_decode.py --batch-sizes 16 --num-samples 4 --prompt-len 10 --profile  # GRPO's rollout

Writes ``benchmarks/results/bench_decode.json`` (``--out`` to change; ``--matmuls``: ``..._matmuls.json``).
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


def measured_peaks(threads: int, device: str = "cpu", dtype: str = "fp32") -> dict:
    """Matmul GFLOP/s and memory GB/s of this machine, best of 5.

    CPU: an fp32 2048^3 matmul, and the read bandwidth of summing 1 GiB. CUDA: an 8192^3 matmul in the
    benchmark's dtype (timed with CUDA events), and a 2 GiB device-to-device copy counting bytes read plus
    written."""
    import torch

    torch.set_num_threads(threads)
    if device == "cpu":
        from rlbits.models.packed import packing_available

        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        # Both of PyTorch's CPU matmul libraries (MKL for a @ b, oneDNN for the packed decode); the faster
        # one sets the floor.
        matmuls = [lambda: a @ b]
        if packing_available():
            matmuls.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
        flops = []
        for matmul in matmuls:
            matmul()
            for _ in range(5):
                t = time.perf_counter()
                matmul()
                flops.append(2 * 2048**3 / (time.perf_counter() - t) / 1e9)
        x = torch.ones(2**28)  # 1 GiB of float32
        bw = []
        for _ in range(5):
            t = time.perf_counter()
            x.sum()
            bw.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
        return {"matmul_gflops": max(flops), "read_gbs": max(bw)}
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch_dtype)
    b = torch.randn(n, n, device=device, dtype=torch_dtype)

    def timed(fn) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # warm-up
        best = float("inf")
        for _ in range(5):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return best

    flops = 2 * n**3 / timed(lambda: a @ b) / 1e9
    src = torch.randn(2**29, device=device)  # 2 GiB of float32
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src)) / 1e9
    return {"matmul_gflops": flops, "read_gbs": gbs}


def _best_of_5(fn, *args) -> float:
    fn(*args)  # warm-up
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


def _mkl_linears(x, weights) -> list:
    import torch.nn.functional as F

    return [F.linear(x, w) for w in weights]


def _onednn_linears(x, packed) -> list:
    import torch

    return [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed]


def matmul_rates(batch_sizes: list[int], threads: int) -> list[dict]:
    """GFLOP/s of one decode step's matmuls, per SmolLM2-135M weight shape and row count: MKL's ``F.linear``
    against oneDNN on packed weights (what ``generate(pack_weights=...)`` runs). Each shape is a list of
    distinct weights totalling about 400 MB, so that they come from memory as in a decode loop; best of 5."""
    import torch

    torch.set_num_threads(threads)
    rows = []
    for n_out, n_in in ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)):
        weights = [torch.randn(n_out, n_in) for _ in range(max(1, int(400e6 / (n_out * n_in * 4))))]
        for B in batch_sizes:
            x = torch.randn(B, n_in)
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, B) for w in weights]
            flops = 2 * B * n_out * n_in * len(weights)
            rate = {
                "mkl_f_linear": flops / _best_of_5(_mkl_linears, x, weights) / 1e9,
                "onednn_packed": flops / _best_of_5(_onednn_linears, x, packed) / 1e9,
            }
            rows.append({"shape": [n_out, n_in], "rows": B, **rate})
            print(f"[{n_out:5d}, {n_in:4d}] x {B:3d} rows: MKL F.linear {rate['mkl_f_linear']:6.1f} GFLOP/s, "
                  f"oneDNN packed {rate['onednn_packed']:6.1f}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local HF folder (default: random init, SmolLM2-135M shape)")
    p.add_argument("--batch-sizes", default="8,16,32")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--num-samples", type=int, default=1,
                   help="K samples per prompt (B / K distinct prompts; the GRPO step's rollout: 4)")
    p.add_argument("--profile", action="store_true",
                   help="profile one more call per implementation: time and GFLOP of its matmul kernels")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--impls", default="hf,rlbits,rlbits_compile",
                   help="hf, hf_static (HF generate with its static cache, compiled by transformers), rlbits, "
                        "rlbits_unpacked (pack_weights=False: MKL's F.linear), rlbits_compile")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--peak", type=float, default=None, help="matmul GFLOP/s for the compute floor")
    p.add_argument("--no-reuse-memory", action="store_true",
                   help="keep glibc's default malloc (the loops' cpu_reuse_memory: false)")
    p.add_argument("--matmuls", action="store_true",
                   help="only the decode step's matmuls: MKL F.linear vs oneDNN packed, per weight shape")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_decode.json"))
    args = p.parse_args()
    if args.matmuls:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        result = {
            "command": " ".join(["python", "benchmarks/bench_decode.py", *sys.argv[1:]]),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_1min": os.getloadavg()[0],
            "threads": args.threads, "rows": matmul_rates(sizes, args.threads),
        }
        out = Path(args.out).with_name(Path(args.out).stem + "_matmuls.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        return 0

    import torch
    from _profile import matmul_calls, matmul_summary, profiler, replay_seconds
    from _workload import smollm2_config
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM

    from rlbits.loops.runtime import reuse_freed_memory
    from rlbits.rollout.generate import generate

    torch.set_num_threads(args.threads)
    # As the loops do by default on CPU (cpu_reuse_memory): the packed weights and the [B, V] logits reuse
    # heap pages instead of page-faulting fresh ones at every call.
    reused = args.device == "cpu" and not args.no_reuse_memory and reuse_freed_memory()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    peaks = measured_peaks(args.threads, args.device, args.dtype)
    if cuda:
        torch.cuda.empty_cache()
    if args.peak:
        peaks["matmul_gflops"] = args.peak
    torch.manual_seed(0)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(smollm2_config())
    model = model.eval().to(device)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    impls = args.impls.split(",")
    rows = []
    K = args.num_samples
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        if B % K:
            raise SystemExit(f"--batch-sizes {B} is not a multiple of --num-samples {K}")
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (B // K, args.prompt_len), generator=g).to(device)
        td = TensorDict(
            prompts=prompts, prompt_mask=torch.ones_like(prompts, dtype=torch.bool), batch_size=[B // K]
        )

        def call(impl, B=B, prompts=prompts, td=td):
            gen = torch.Generator(device).manual_seed(1)
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                if impl in ("hf", "hf_static"):
                    static = {"cache_implementation": "static"} if impl == "hf_static" else {}
                    model.generate(
                        prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=None, top_p=None,
                        temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                        eos_token_id=None, pad_token_id=0, num_return_sequences=K, **static,
                    )
                else:
                    out = generate(
                        model, td, max_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0,
                        generator=gen, compile=impl == "rlbits_compile", num_samples=K,
                        pack_weights=False if impl == "rlbits_unpacked" else None,
                    )
                    assert out["responses"].shape == (B, args.new_tokens)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t

        first, peak_mib = {}, {}
        for impl in impls:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            first[impl] = call(impl)
            peak_mib[impl] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        times = {impl: [] for impl in impls}
        for _ in range(args.runs):
            for impl in impls:
                times[impl].append(call(impl))
        tokens = B * args.new_tokens
        # Each distinct prompt is prefilled once (HF generate prefills every row; rlbits once per prompt).
        compute_floor = (
            2 * n_params * (B // K * args.prompt_len + B * args.new_tokens) / (peaks["matmul_gflops"] * 1e9)
        )
        matmuls = {}
        if args.profile:
            for impl in impls:
                with profiler() as prof:
                    seconds = call(impl)
                replayed = replay_seconds(matmul_calls(prof))
                replay_s = sum(replayed.values())
                matmuls[impl] = {"profiled_call_s": seconds, "replay_s": replay_s, **matmul_summary(prof)}
        memory_floor = weight_bytes * args.new_tokens / (peaks["read_gbs"] * 1e9)  # prefill + (N - 1) steps
        for impl in impls:
            med = statistics.median(times[impl])
            row = {
                "impl": impl, "batch": B, "median_s": med, "times_s": times[impl], "tokens_per_s": tokens / med,
                "first_call_s": first[impl], "compute_floor_s": compute_floor, "memory_floor_s": memory_floor,
                "x_compute_floor": med / compute_floor, "x_memory_floor": med / memory_floor,
                "peak_memory_mib": peak_mib[impl],
            }
            if impl == "rlbits_compile":
                row["compile_cost_s"] = first[impl] - med
            if impl in matmuls:
                row["matmuls"] = matmuls[impl]
                # No overhead removal beats the matmul kernels' own time: the best ratio these kernels allow.
                row["x_compute_floor_matmuls_only"] = matmuls[impl]["matmul_s"] / compute_floor
                row["x_compute_floor_matmuls_replayed"] = matmuls[impl]["replay_s"] / compute_floor
            rows.append(row)
            extra = f"  compile {row['compile_cost_s']:.1f} s" if "compile_cost_s" in row else ""
            extra += f"  peak {peak_mib[impl]:.0f} MiB" if cuda else ""
            if impl in matmuls:
                mm = matmuls[impl]
                extra += (
                    f"\n      profiled call {mm['profiled_call_s']:.3f} s: matmul kernels {mm['matmul_s']:.3f} s "
                    f"({mm['matmul_gflop']:.0f} GFLOP at {mm['matmul_gflops']:.0f} GFLOP/s) = "
                    f"{row['x_compute_floor_matmuls_only']:.2f}x compute floor by themselves; replayed alone "
                    f"{mm['replay_s']:.3f} s = {row['x_compute_floor_matmuls_replayed']:.2f}x"
                )
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
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
                    "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"},
        "model": args.model or "random init, SmolLM2-135M config", "dtype": args.dtype, "parameters": n_params,
        "weight_bytes": weight_bytes, "peaks": peaks, "reuse_freed_memory": reused, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "num_samples": K,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"peaks: {peaks['matmul_gflops']:.0f} GFLOP/s, {peaks['read_gbs']:.1f} GB/s; load {result['load_1min']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
