"""Per-rank memory of one training update at 1 and 2 ranks (FSDP2) for the same model, on CPU.

    python benchmarks/bench_fsdp_memory.py                 # runs both world sizes, writes the JSON below
    python benchmarks/bench_fsdp_memory.py --layers 6 --width 768      # the 67M model (default)

Each world size runs in its own ``torchrun`` (gloo). Every rank builds the model, shards it with
``rlbits.distributed.parallelize.shard`` (nothing at world size 1), builds AdamW, then takes REINFORCE updates
(forward, backward, optimizer step; the first one creates the optimizer states) on its share of a fixed batch
of ``--rows`` rows. A thread samples the process's resident set (VmRSS) every 2 ms; we report

- ``state_mib``: RSS after the first update minus RSS right after the imports (parameters, gradients,
  optimizer states: what the model costs at rest);
- ``peak_mib``: the highest RSS during the second update minus the same baseline (adds activations and, when
  sharded, the all-gathered parameters of the blocks in flight).

On CPU this is an upper bound (freed memory is not always returned to the OS). The arithmetic of FSDP2 for
comparison: at rest fp32 parameters + two AdamW moments = 12 bytes per parameter (gradients are freed after
each step), divided by the number of ranks; during the update + 4 bytes of gradients, activations and, in
flight, the unsharded parameters of about two blocks. Results:
``benchmarks/results/bench_fsdp_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import PeakSampler, rss_mib  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlbits.batch import build_batch
    from rlbits.data.stream import PromptStream
    from rlbits.distributed.env import init
    from rlbits.loops import reinforce
    from rlbits.loops.metrics import StepMetrics
    from rlbits.loops.optim import make_optimizer
    from rlbits.loops.runtime import disable_dropout, prepare

    baseline = rss_mib()
    env = init("cpu")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.width // 64, vocab_size=32000,
                        n_positions=1024, bos_token_id=0, eos_token_id=0)
    policy = disable_dropout(GPT2LMHeadModel(config)).train()
    n_params = sum(p.numel() for p in policy.parameters())
    cfg = reinforce.ReinforceConfig(num_generations_per_prompt=2, num_prompts_per_step=args.rows // 2,
                                    microbatch_size=args.rows, learning_rate=1e-5)
    policy = prepare(policy, cfg, env)
    optimizer = make_optimizer(policy.parameters(), cfg.learning_rate, 0.0)
    g = torch.Generator().manual_seed(0)
    B, P, R = args.rows, 32, args.response_len
    batch = build_batch(torch.randint(1, 32000, (B, P), generator=g), torch.ones(B, P, dtype=torch.bool),
                        torch.randint(1, 32000, (B, R), generator=g), torch.ones(B, R, dtype=torch.bool))
    batch["logprobs"] = torch.full((B, R), -10.0)
    batch["ref_logprobs"] = torch.full((B, R), -10.0)
    batch["advantages"] = torch.randn(B, R, generator=g)
    batch["loss_mask"] = batch["action_mask"].clone()
    local = batch[env.rank * B // env.world_size : (env.rank + 1) * B // env.world_size]
    state = reinforce.State(
        env=env, policy=policy, optimizer=optimizer, sampling_generator=torch.Generator(),
        minibatch_generator=torch.Generator(), stream=PromptStream(["unused"], seed=0),
    )
    reinforce.update(state, local, cfg)  # creates the optimizer states
    at_rest = rss_mib()
    state.metrics = StepMetrics()
    with PeakSampler() as sampler:
        t0 = time.perf_counter()
        reinforce.update(state, local, cfg)
        seconds = time.perf_counter() - t0
    row = {
        "world_size": env.world_size,
        "rank": env.rank,
        "params": n_params,
        "rows_per_rank": int(local.batch_size[0]),
        "state_mib": round(at_rest - baseline, 1),
        "peak_mib": round(sampler.peak - baseline, 1),
        "update_s": round(seconds, 2),
        "expected_state_mib": round(12 * n_params / env.world_size / 2**20, 1),
    }
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows_file = HERE / "results" / "bench_fsdp_memory.jsonl.tmp"
    rows_file.unlink(missing_ok=True)
    # A fixed mmap threshold makes glibc return every large freed block to the OS at once, so RSS follows the
    # live tensors (by default it raises the threshold after frees and keeps freed blocks in the heap).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    for n in (1, 2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               "--worker", "--out", str(rows_file), "--layers", str(args.layers), "--width", str(args.width),
               "--rows", str(args.rows), "--response-len", str(args.response_len)]
        subprocess.run(cmd, check=True, env=env)
    rows = sorted((json.loads(x) for x in rows_file.read_text().splitlines()), key=lambda r: (r["world_size"], r["rank"]))
    rows_file.unlink()
    out = {"machine": os.uname().machine, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
           "model": f"GPT-2 {args.layers}L width {args.width} vocab 32000", "rows": rows}
    (HERE / "results" / "bench_fsdp_memory.json").write_text(json.dumps(out, indent=2) + "\n")
    print("| world size | rank | params | rows/rank | at rest (MiB) | 12 B/param / N (MiB) | peak in update (MiB) | update (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world_size']} | {r['rank']} | {r['params'] / 1e6:.1f}M | {r['rows_per_rank']} | {r['state_mib']} | "
              f"{r['expected_state_mib']} | {r['peak_mib']} | {r['update_s']} |")


if __name__ == "__main__":
    main()
