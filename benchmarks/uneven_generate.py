"""Benchmark: ``generate`` on an uneven workload, static batch vs ``continuous_batching`` (compaction) vs
``max_num_seqs`` slots, against a uniform workload with the same total generated tokens (issue 28).

The workload: B prompts of 16 random tokens, one sample each, temperature 1, a budget of ``--budget`` new
tokens. Each row's response length is drawn from a fixed seed (``uneven_lengths``): 90% of the rows uniform in
1 .. budget / 8, 10% at the budget (they never end). The length is forced by a logits processor: EOS gets a
huge logit at the row's length and -inf before it, so a row ends exactly there (the sampled tokens before it
are the model's own). The row's length is read from its first prompt token (a row id), so the processor
treats each row on its own, as ``continuous_batching`` requires. The uniform workload gives every row
``ceil(total / B)`` tokens (the same total, spread evenly).

Configurations: ``uneven_off`` (one static batch of B rows), ``uneven_on`` (``continuous_batching``: finished
rows compacted out), ``uniform_off``; with ``--max-num-seqs S`` also ``uneven_slots`` and ``uniform_slots``
(``generate(max_num_seqs=S)``: S slots that the B samples take in turn; pays when B is several times S, e.g.
``--batch 256 --max-num-seqs 32``). The ratios: each uneven configuration over the uniform one of the same
engine (static for off and on, slots for slots).

``--hf``: also HF ``model.generate`` on the uneven workload with the same forced lengths (``hf_uneven``);
``--hf-static``: the same with ``cache_implementation="static"``, which transformers compiles on CUDA
(``hf_static_uneven``).

Floors and memory: with ``--floor`` the script measures the device's read bandwidth (``bench_decode.
measured_peaks``: on CUDA a 2 GiB device-to-device copy, bytes read + written) and reports each
configuration's time over the **memory floor** of the uneven workload: its longest row needs ``budget``
sequential forward passes (the prefill and budget - 1 decode steps), each reading every weight once, plus
each generated token reading its row's KV cache once (prompt + tokens so far). That floor holds for any
batching: continuous batching cannot shorten the longest row. It also reports the **roofline** time of both
workloads (``roofline_seconds``: each forward pass costs the larger of its bytes over the bandwidth and its
FLOPs over the measured matmul peak, rows leaving as they end) and their ratio: the best uneven / uniform ratio
any engine can reach on the machine, beside the measured one; and the same roofline at the rate of reading the
weights one matrix at a time (``matrix_read_gbs``), which is what a decode step's one kernel per weight can
reach. On CUDA each configuration's peak memory
(``torch.cuda.max_memory_allocated`` over its timed calls) is reported.

Models (random weights, fp32 unless ``--dtype bf16``): ``gpt2`` (the shared tiny GPT-2 of
``benchmarks/_workload.py``: 4 layers, width 256, V = 32k), ``smollm2`` (SmolLM2-135M's shape), ``tiny``
(``rlbits.models.tiny``, for a smoke run). Timing: one process, each configuration warmed up once, then the
configurations alternated for ``--runs`` timed calls each (so load changes hit all alike), the median kept;
tokens/s = generated tokens / wall time. The 1-minute load average is recorded.

    python benchmarks/uneven_generate.py --model gpt2 --batch 32 --budget 128
    python benchmarks/uneven_generate.py --model smollm2 --batch 16 --budget 256 --runs 3
    python benchmarks/uneven_generate.py --model gpt2 --batch 256 --budget 128 --max-num-seqs 32
    python benchmarks/uneven_generate.py --model tiny --batch 8 --budget 16 --runs 1   # smoke
    python benchmarks/uneven_generate.py --model smollm2 --device cuda --dtype bf16 --compile --batch 16 \
        --budget 256 --hf-static --floor --runs 3                                         # on a GPU

Writes ``benchmarks/results/uneven_generate_{model}.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def uneven_lengths(batch: int, budget: int, seed: int = 0) -> list[int]:
    """Response lengths of the uneven workload: 90% of the rows uniform in 1 .. max(1, budget // 8), a tenth
    (at least one row) at ``budget``, in a shuffled order; drawn from ``seed``."""
    import random

    rng = random.Random(seed)
    long_rows = max(1, round(batch / 10))
    lengths = [budget] * long_rows + [rng.randint(1, max(1, budget // 8)) for _ in range(batch - long_rows)]
    rng.shuffle(lengths)
    return lengths


def roofline_seconds(
    lengths: list[int],
    prompt_len: int,
    *,
    weight_bytes: float,
    matmul_params: float,
    layers: int,
    heads: int,
    head_dim: int,
    kv_token_bytes: float,
    read_gbs: float,
    peak_gflops: float,
) -> float:
    """Seconds to generate ``lengths`` (one row each, ``prompt_len``-token prompts) at the roofline, with every
    row leaving the batch as soon as it ends (what ``continuous_batching`` aims at).

    Pass 0 is the prefill (every row's prompt); pass s >= 1 feeds token s of every row longer than s. Each pass
    costs ``max(bytes / read_gbs, flops / peak_gflops)`` (Williams et al. 2009, "Roofline"): bytes = every weight
    once plus each fed token's KV cache (prompt and tokens so far, ``kv_token_bytes`` per position); flops =
    ``2 * matmul_params`` per fed token plus attention, ``4 * layers * heads * head_dim`` per attended position.
    No engine can do better on a machine with that bandwidth and peak, so the ratio of two workloads' roofline
    times is the best uneven / uniform ratio any batching can reach there.
    """
    attn = 4 * layers * heads * head_dim

    def cost(rows: int, context: int, fed: int) -> float:  # ``rows`` rows feed ``fed`` tokens each
        flops = rows * fed * 2 * matmul_params + rows * attn * sum(range(context - fed + 1, context + 1))
        read = weight_bytes + rows * context * kv_token_bytes
        return max(read / (read_gbs * 1e9), flops / (peak_gflops * 1e9))

    total = cost(len(lengths), prompt_len, prompt_len)
    for s in range(1, max(lengths)):
        live = sum(n > s for n in lengths)
        total += cost(live, prompt_len + s, 1)
    return total


def _matmul_weights(model) -> list:
    """The weights every fed token multiplies: the linear (and GPT-2 ``Conv1D``) layers', the LM head included
    (a tied head counts once, as the head; the embedding lookup itself is free)."""
    import torch

    return [
        m.weight.detach()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"
    ]


def _floors(model, dtype, uneven: list[int], uniform: list[int], prompt_len: int, budget: int, peaks: dict):
    """The uneven workload's memory floor in seconds, and both workloads' ``roofline_seconds`` and their ratio,
    for ``peaks`` = ``{"read_gbs", "matmul_gflops"}``."""
    import torch

    read_gbs = peaks["read_gbs"]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_token_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    kv_reads = sum(prompt_len + t for n in uneven for t in range(1, n + 1))  # cached columns each new token reads
    floor_s = (budget * weight_bytes + kv_reads * kv_token_bytes) / (read_gbs * 1e9)
    shape = {
        "weight_bytes": weight_bytes, "matmul_params": sum(w.numel() for w in _matmul_weights(model)), "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads, "head_dim": head_dim, "kv_token_bytes": kv_token_bytes,
        "read_gbs": read_gbs, "peak_gflops": peaks["matmul_gflops"],
    }
    roofline = {
        "uneven_s": roofline_seconds(uneven, prompt_len, **shape),
        "uniform_s": roofline_seconds(uniform, prompt_len, **shape),
        "shape": shape,
    }
    roofline["uneven_over_uniform"] = roofline["uneven_s"] / roofline["uniform_s"]
    return floor_s, roofline


def matrix_read_gbs(model, device: str) -> float:
    """GB/s of reading the model's matmul weights one matrix at a time (a sum each, best of 5 after a warm-up):
    what a decode step, one kernel per weight, can read at best. On the 2-core CPU of ``benchmarks/RESULTS.md``
    SmolLM2's 211 matrices read at 0.6-0.95x the rate of one 1 GiB stream (``bench_decode.measured_peaks``),
    so the roofline at the stream's rate is a bound no per-layer decode reaches when few rows make every step
    memory-bound."""
    import torch

    weights = _matmul_weights(model)
    total = sum(w.numel() * w.element_size() for w in weights)
    seconds = []
    for _ in range(6):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for w in weights:
            w.sum()
        if device != "cpu":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return total / min(seconds[1:]) / 1e9  # the first call warms up


def _roofline_line(roofline: dict, rows: int) -> str:
    shape = roofline["shape"]
    return (
        f"roofline ({shape['read_gbs']:.0f} GB/s, {shape['peak_gflops']:.0f} GFLOP/s), {rows} rows: uneven "
        f"{roofline['uneven_s'] * 1e3:.1f} ms, uniform {roofline['uniform_s'] * 1e3:.1f} ms, uneven / uniform "
        f"{roofline['uneven_over_uniform']:.2f}x"
    )


def _cuda_graph_counts() -> dict | None:
    """The current device's CUDA graph tree: recorded root graphs and recordings made because no recorded
    graph matched (inductor's private ``debug_fail_counter``); None before any graph, ``{"unavailable": ...}``
    where this torch lacks the private API."""
    import torch

    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None:
            return None
        return {"roots": sum(len(v) for v in manager.roots.values()), "rerecords": manager.debug_fail_counter}
    except (ImportError, AttributeError) as error:
        return {"unavailable": repr(error)}


def _profile_call(call, cuda: bool, steps: int, path: Path) -> None:
    """Profile one ``call`` (a generate of ``steps`` decode steps) and write to ``path`` the ops by self time
    (host, and device on CUDA) and, per decode step, the kernel launches, CUDA graph replays and host syncs:
    where a compiled decode step's time goes beyond its graph."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    before = _cuda_graph_counts() if cuda else None
    with profile(activities=activities) as prof:
        call()
    after = _cuda_graph_counts() if cuda else None
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    per_step = {
        name: count.get(name, 0) / steps
        for name in ("cudaLaunchKernel", "cudaGraphLaunch", "cudaStreamSynchronize", "cudaMemcpyAsync",
                     "cudaDeviceSynchronize", "aten::item", "aten::_local_scalar_dense")
    }
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    text = [f"one uneven_on call, {steps} decode steps; per step: " + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items())]
    # Compiles, graph breaks and CUDA graph skips over the whole process (warm-up and timed calls included):
    # a count that grows with the calls means a re-compile or re-record per rollout.
    from torch._dynamo.utils import counters

    text.append("torch._dynamo counters: " + repr({k: dict(v) for k, v in counters.items() if v}))
    if cuda:  # a rollout that records CUDA graphs anew (e.g. its KV cache at new addresses) pays for it each time
        text.append(f"CUDA graph trees before / after the profiled call: {before} / {after}")
    text.append(events.table(sort_by="self_cpu_time_total", row_limit=40))
    if cuda:
        text.append(events.table(sort_by=sort, row_limit=25))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(text) + "\n")
    print(text[0])


def _model(name: str, dtype):
    import torch

    if name == "tiny":
        from rlbits.models.tiny import tiny_causal_lm

        return tiny_causal_lm("llama", 256, seed=0, max_position_embeddings=1024).to(dtype), 256
    import _workload
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        config, cls = _workload.model_config(positions=2048), GPT2LMHeadModel
    else:
        config, cls = _workload.smollm2_config(positions=2048), LlamaForCausalLM
    return cls(config).eval().to(dtype), config.vocab_size


def _forced_lengths(lengths: list[int], eos: int, device):
    """A logits processor: row r (its first prompt token is ``2 + r``) ends with EOS at ``lengths[r]``."""
    import torch

    table = torch.tensor(lengths, device=device)
    prompt_len = None

    def process(ids, logits):
        nonlocal prompt_len
        if prompt_len is None:
            prompt_len = ids.shape[1]
        t = ids.shape[1] - prompt_len + 1  # the length once this step's token is appended
        at = table[ids[:, 0] - 2] == t
        logits = logits.clone()
        logits[:, eos] = torch.where(at, 1e4, float("-inf"))
        return logits

    return process


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt2", "smollm2", "tiny"), default="gpt2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="generate(compile=True)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="also time generate(max_num_seqs=S) on both workloads"
    )
    parser.add_argument("--hf", action="store_true", help="also HF model.generate on the uneven workload")
    parser.add_argument("--hf-static", action="store_true", help="also HF model.generate with its static cache")
    parser.add_argument(
        "--floor", action="store_true",
        help="measure the read bandwidth and matmul peak; report x memory floor and the roofline ratio",
    )
    parser.add_argument(
        "--roofline-only", nargs=2, type=float, metavar=("READ_GBS", "PEAK_GFLOPS"),
        help="print the roofline times of both workloads for this bandwidth and peak (e.g. a GPU's, measured "
        "there) and exit: nothing is timed",
    )
    parser.add_argument(
        "--skip-off", action="store_true",
        help="leave out uneven_off (the static batch: at 256 rows of SmolLM2's shape on a CPU, minutes a call)",
    )
    parser.add_argument(
        "--profile", type=Path, metavar="TXT",
        help="after timing, profile one uneven_on call (torch.profiler, CPU and CUDA) and write its op table and "
        "per-step launch and sync counts here",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    from rlbits.rollout.generate import generate

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, vocab = _model(args.model, dtype)
    model = model.to(args.device)
    eos, B, P = vocab - 1, args.batch, args.prompt_len
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3 + B, eos, (B, P), generator=g)
    prompts[:, 0] = torch.arange(B) + 2  # the row id the processor reads
    td = {
        "prompts": prompts.to(args.device),
        "prompt_mask": torch.ones(B, P, dtype=torch.bool, device=args.device),
    }
    from tensordict import TensorDict

    td = TensorDict(td, batch_size=[B])
    uneven = uneven_lengths(B, args.budget, args.seed)
    total = sum(uneven)
    uniform = [math.ceil(total / B)] * B
    S = args.max_num_seqs
    configs = {
        "uneven_off": (uneven, False, None),
        "uneven_on": (uneven, True, None),
        "uniform_off": (uniform, False, None),
    }
    if args.skip_off:
        del configs["uneven_off"]
    if S is not None:
        configs.update(uneven_slots=(uneven, False, S), uniform_slots=(uniform, False, S))
    if args.hf:
        configs["hf_uneven"] = (uneven, "hf", None)
    if args.hf_static:
        configs["hf_static_uneven"] = (uneven, "hf_static", None)
    cuda = torch.device(args.device).type == "cuda"

    def run_hf(lengths, static):
        from transformers import LogitsProcessorList

        with torch.no_grad():
            ids = model.generate(
                td["prompts"], attention_mask=td["prompt_mask"].long(), do_sample=True, top_k=None, top_p=None,
                temperature=1.0, max_new_tokens=args.budget, eos_token_id=eos, pad_token_id=0,
                logits_processor=LogitsProcessorList([_forced_lengths(lengths, eos, args.device)]),
                **({"cache_implementation": "static"} if static else {}),
            )
        if cuda:
            torch.cuda.synchronize()
        responses = ids[:, P:]
        ended = responses == eos
        # generated tokens per row: up to and including the first EOS (the budget if none)
        budget = torch.full((ids.shape[0],), responses.shape[1], device=ids.device)
        count = torch.where(ended.any(1), ended.int().argmax(1) + 1, budget)
        return {"action_mask": torch.arange(responses.shape[1], device=ids.device)[None] < count[:, None]}

    def run(lengths, on, slots):
        if on in ("hf", "hf_static"):
            return run_hf(lengths, on == "hf_static")
        out = generate(
            model,
            td,
            max_new_tokens=args.budget,
            temperature=1.0,
            eos_token_id=eos,
            pad_token_id=0,
            generator=torch.Generator(args.device).manual_seed(1),
            logits_processor=_forced_lengths(lengths, eos, args.device),
            compile=args.compile,
            continuous_batching=on,
            max_num_seqs=slots,
        )
        if args.device != "cpu":
            torch.cuda.synchronize()
        return out

    if args.roofline_only:
        _, roofline = _floors(model, dtype, uneven, uniform, P, args.budget, dict(
            read_gbs=args.roofline_only[0], matmul_gflops=args.roofline_only[1]
        ))
        print(_roofline_line(roofline, B))
        return {"roofline": roofline, "batch": B, "budget": args.budget, "lengths": uneven}
    times: dict[str, list[float]] = {name: [] for name in configs}
    tokens, first, peak_mib = {}, {}, {}
    for name, (lengths, on, slots) in configs.items():  # warm-up (and compile)
        start = time.perf_counter()
        out = run(lengths, on, slots)
        first[name] = time.perf_counter() - start
        tokens[name] = int(out["action_mask"].sum())
        assert out["action_mask"].sum(1).tolist() == [min(n, args.budget) for n in lengths], name
    for _ in range(args.runs):
        for name, (lengths, on, slots) in configs.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            run(lengths, on, slots)
            times[name].append(time.perf_counter() - start)
            if cuda:
                peak_mib[name] = max(peak_mib.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**20)
    if args.profile:
        _profile_call(lambda: run(*configs["uneven_on"]), cuda, max(uneven), args.profile)
    floor_s, read_gbs, peak_gflops, roofline, roofline_matrix = None, None, None, None, None
    if args.floor:
        from bench_decode import measured_peaks

        peaks = measured_peaks(args.threads, args.device, args.dtype)
        floor_s, roofline = _floors(model, dtype, uneven, uniform, P, args.budget, peaks)
        read_gbs, peak_gflops = peaks["read_gbs"], peaks["matmul_gflops"]
        by_matrix = dict(peaks, read_gbs=matrix_read_gbs(model, args.device))
        roofline_matrix = _floors(model, dtype, uneven, uniform, P, args.budget, by_matrix)[1]
    rows = {
        name: {
            "seconds": statistics.median(t),
            "tokens": tokens[name],
            "tokens_per_s": tokens[name] / statistics.median(t),
            "first_call_s": first[name],
            "peak_mib": peak_mib.get(name),
            "x_memory_floor": statistics.median(t) / floor_s if floor_s else None,
        }
        for name, t in times.items()
    }
    result = {
        "model": args.model,
        "batch": B,
        "budget": args.budget,
        "prompt_len": P,
        "dtype": args.dtype,
        "device": args.device,
        "compile": args.compile,
        "threads": args.threads,
        "runs": args.runs,
        "lengths": uneven,
        "distribution": "90% uniform in 1..budget/8, 10% at the budget (seeded)",
        "load_avg_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "results": rows,
        "uneven_on_over_uniform": rows["uneven_on"]["seconds"] / rows["uniform_off"]["seconds"],
        "uneven_off_over_uniform": (
            rows["uneven_off"]["seconds"] / rows["uniform_off"]["seconds"] if "uneven_off" in rows else None
        ),
        "max_num_seqs": S,
        "memory_floor_s": floor_s,
        "read_gbs": read_gbs,
        "matmul_gflops": peak_gflops,
        "roofline": roofline,
        "roofline_matrix_reads": roofline_matrix,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor(),
        "command": "python benchmarks/uneven_generate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if S is not None:
        result["uneven_slots_over_uniform_slots"] = (
            rows["uneven_slots"]["seconds"] / rows["uniform_slots"]["seconds"]
        )
        result["uneven_slots_over_uniform"] = rows["uneven_slots"]["seconds"] / rows["uniform_off"]["seconds"]
    for name, row in rows.items():
        extra = f"  {row['x_memory_floor']:6.1f}x floor" if floor_s else ""
        extra += f"  peak {row['peak_mib']:8.0f} MiB" if row["peak_mib"] is not None else ""
        print(
            f"{name:16s} {row['seconds']:8.3f} s  {row['tokens']:7d} tokens  {row['tokens_per_s']:9.1f} tok/s"
            f"  first {row['first_call_s']:6.1f} s{extra}"
        )
    if floor_s:
        print(f"memory floor {floor_s * 1e3:.2f} ms ({read_gbs:.0f} GB/s)")
        print(_roofline_line(roofline, B) + " (the best any batching reaches on this machine)")
        print(_roofline_line(roofline_matrix, B) + " (at the rate of reading the weights one matrix at a time)")
    off = result["uneven_off_over_uniform"]
    print(
        "uneven / uniform (same tokens): " + (f"off {off:.2f}x, " if off is not None else "")
        + f"on {result['uneven_on_over_uniform']:.2f}x"
        + (
            f", slots {result['uneven_slots_over_uniform_slots']:.2f}x over uniform slots "
            f"({result['uneven_slots_over_uniform']:.2f}x over uniform off)"
            if S is not None
            else ""
        )
    )
    out_path = Path(args.out or Path(__file__).parent / "results" / f"uneven_generate_{args.model}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
