"""Memory and step time of full fine-tuning vs LoRA (rank 8 and 16) on SmolLM2-135M's architecture, on CPU.

    python benchmarks/bench_lora.py                        # full, lora r=8, lora r=16; writes the JSON below
    python benchmarks/bench_lora.py --ranks 8 --steps 5 --repeats 2
    python benchmarks/bench_lora.py --tiny                 # a 2-layer model: checks the script in seconds

The model is a random-init ``LlamaForCausalLM`` with SmolLM2-135M's exact config (134.5M parameters, tied
embeddings; nothing is downloaded), fp32, ``--threads`` intra-op threads (2). Each variant runs in its own
process (so its peak RSS is its own), one after the other, and holds what the RLOO loop holds
(``rlbits.loops.reinforce.init_state``): full fine-tuning a policy and a frozen reference copy, LoRA the
policy with adapters (``lora_target_modules`` None = all linear layers of attention and MLP) and no
reference copy (the reference is the policy with its adapters disabled). The workload is one RLOO step's
model work on a fixed batch of ``--rows`` sequences of ``--prompt-tokens`` + ``--response-tokens`` tokens
(16 x (32 + 32) by default): the reference forward (``reinforce.reference``, no grad) and one update
(``reinforce.update``: forward, backward, AdamW step, in one microbatch), with RLOO advantages of random
rewards (K = 4) and a k3 KL term in the loss. The first step is a warm-up (it also creates the AdamW
states); the next ``--steps`` are timed.

Reported per variant:

- ``params`` / ``trainable``: parameter counts (the reference copy included in ``held_params``);
- ``counted_mib``: bytes by counting, fp32: every parameter held (policy, adapters, reference copy),
  gradients of the trainable parameters, AdamW's two moments of the trainable parameters (read from the
  optimizer's state after a step);
- ``rss_state_mib``: resident set (VmRSS) after the warm-up step minus after the imports;
  ``rss_peak_mib``: the highest VmRSS during the timed steps (sampled every 2 ms) minus after the imports
  (adds the activations);
- ``reference_s``, ``update_s``, ``step_s`` (their sum): median seconds over the timed steps.

The machine the figures come from is recorded (cores, 1-minute load before and after): on a shared machine
they are indicative only. Results: ``benchmarks/results/bench_lora.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import PeakSampler, rss_mib  # noqa: E402

ROOT = HERE.parent

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
MIB = 1 << 20


def worker(args: argparse.Namespace) -> None:
    """One variant (``args.rank`` 0 = full fine-tuning); prints one ``@@{json}`` line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlbits.batch import build_batch
    from rlbits.data.stream import PromptStream
    from rlbits.distributed.env import DistEnv
    from rlbits.loops import reinforce
    from rlbits.loops.metrics import StepMetrics
    from rlbits.loops.optim import make_optimizer
    from rlbits.loops.runtime import disable_dropout, with_lora
    from rlbits.models.forward import policy_logprobs
    from rlbits.models.load import reference_policy

    torch.set_num_threads(args.threads)
    baseline = rss_mib()
    env = DistEnv()
    cfg = reinforce.ReinforceConfig(
        num_generations_per_prompt=4, num_prompts_per_step=args.rows // 4, microbatch_size=args.rows,
        kl_loss_coef=0.01, learning_rate=1e-5, lora_rank=args.rank, max_new_tokens=args.response_tokens,
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(
        LlamaConfig(**(TINY if args.tiny else SMOLLM2_135M), attn_implementation="sdpa")
    )
    policy = disable_dropout(policy).train()
    reference = None if cfg.lora else reference_policy(policy)  # what init_state holds
    policy = with_lora(policy, cfg)
    state = reinforce.State(
        env=env, policy=policy, reference=reference,
        optimizer=make_optimizer(policy.parameters(), cfg.learning_rate, cfg.weight_decay),
        sampling_generator=torch.Generator(), minibatch_generator=torch.Generator().manual_seed(1),
        stream=PromptStream(["unused"], seed=0),
    )

    g = torch.Generator().manual_seed(123)
    vocab, p, r, b = policy.config.vocab_size, args.prompt_tokens, args.response_tokens, args.rows
    prompts = torch.randint(3, vocab - 1, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.bool)
    responses = torch.randint(3, vocab - 1, (b, r), generator=g)
    action_mask = torch.ones(b, r, dtype=torch.bool)
    batch = build_batch(prompts, prompt_mask, responses, action_mask, rewards=torch.rand(b, generator=g))
    with torch.no_grad():
        batch["logprobs"] = policy_logprobs(policy, batch)  # the sampler's: the policy itself

    def one_step() -> tuple[float, float]:
        state.metrics = StepMetrics()
        t0 = time.perf_counter()
        step = reinforce.reference(state, batch.clone(), cfg)
        t1 = time.perf_counter()
        step = reinforce.advantages(state, step, cfg)
        reinforce.update(state, step, cfg)
        return t1 - t0, time.perf_counter() - t1

    one_step()  # warm-up; creates the AdamW states
    rss_state = rss_mib() - baseline
    times = []
    with PeakSampler() as peak:
        for _ in range(args.steps):
            times.append(one_step())

    trainable = [q for q in policy.parameters() if q.requires_grad]
    held = {}
    for model in (policy, reference):
        for q in model.parameters() if model is not None else ():
            held[q.untyped_storage().data_ptr()] = q.untyped_storage().nbytes()
    optimizer_bytes = sum(
        v.nbytes
        for s in state.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    params_bytes, grads_bytes = sum(held.values()), sum(q.numel() * q.element_size() for q in trainable)
    ref_s, upd_s = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
    result = {
        "variant": "full" if not args.rank else f"lora_r{args.rank}",
        "lora_rank": args.rank,
        "params": sum(q.numel() for n, q in policy.named_parameters() if "lora_" not in n),
        "trainable": sum(q.numel() for q in trainable),
        "held_params": sum(held.values()) // 4,
        "reference_copy": reference is not None,
        "counted_mib": {
            "params": params_bytes / MIB,
            "grads": grads_bytes / MIB,
            "optimizer": optimizer_bytes / MIB,
            "total": (params_bytes + grads_bytes + optimizer_bytes) / MIB,
        },
        "rss_state_mib": rss_state,
        "rss_peak_mib": peak.peak - baseline,
        "reference_s": ref_s,
        "update_s": upd_s,
        "step_s": ref_s + upd_s,
        "times_s": [list(t) for t in times],
        "grad_norm": state.metrics.reduce(env).get("grad_norm"),
    }
    print("@@" + json.dumps(result), flush=True)


def load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--ranks", default="8,16", help="LoRA ranks to compare with full fine-tuning (comma-separated)"
    )
    p.add_argument(
        "--rows", type=int, default=16, help="sequences per step (a multiple of 4: RLOO groups of 4)"
    )
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--response-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    p.add_argument("--repeats", type=int, default=1, help="runs of every variant, interleaved")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model instead of SmolLM2-135M's config")
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench_lora.json")
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_rank is not None:
        args.rank = args.worker_rank
        worker(args)
        return
    ranks = [0] + [int(r) for r in args.ranks.split(",") if r.strip()]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    forwarded = [f"--rows={args.rows}", f"--prompt-tokens={args.prompt_tokens}", f"--response-tokens={args.response_tokens}",
                 f"--steps={args.steps}", f"--threads={args.threads}"] + (["--tiny"] if args.tiny else [])
    load_before, runs = load(), {}
    for repeat in range(args.repeats):
        for rank in ranks:
            cmd = [sys.executable, __file__, f"--worker-rank={rank}", *forwarded]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
            if out.returncode != 0 or not lines:
                raise SystemExit(f"variant rank={rank} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            result = json.loads(lines[-1][2:])
            runs.setdefault(result["variant"], []).append(result)
            print(
                f"repeat {repeat} {result['variant']:>9}: step {result['step_s']:.2f} s (reference "
                f"{result['reference_s']:.2f} + update {result['update_s']:.2f}), counted "
                f"{result['counted_mib']['total']:.0f} MiB, RSS peak {result['rss_peak_mib']:.0f} MiB",
                flush=True,
            )
    summary = {}
    for variant, rs in runs.items():
        best = min(rs, key=lambda r: r["step_s"])
        summary[variant] = {k: best[k] for k in ("params", "trainable", "held_params", "counted_mib")} | {
            "rss_state_mib": min(r["rss_state_mib"] for r in rs),
            "rss_peak_mib": min(r["rss_peak_mib"] for r in rs),
            "step_s": statistics.median(r["step_s"] for r in rs),
            "reference_s": statistics.median(r["reference_s"] for r in rs),
            "update_s": statistics.median(r["update_s"] for r in rs),
        }
    full = summary["full"]
    lines = ["| variant | trainable | counted MiB (params + grads + AdamW) | RSS peak MiB | step s (ref + update) | vs full |",
             "|---|---|---|---|---|---|"]
    for variant, s in summary.items():
        c = s["counted_mib"]
        lines.append(
            f"| {variant} | {s['trainable'] / 1e6:.2f}M | {c['total']:.0f} ({c['params']:.0f} + {c['grads']:.0f} + "
            f"{c['optimizer']:.0f}) | {s['rss_peak_mib']:.0f} | {s['step_s']:.2f} ({s['reference_s']:.2f} + "
            f"{s['update_s']:.2f}) | memory {c['total'] / full['counted_mib']['total']:.2f}x, time "
            f"{s['step_s'] / full['step_s']:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "what": "one RLOO step's model work (reference forward + update) on SmolLM2-135M's config: full fine-tuning vs LoRA",
        "model": "tiny" if args.tiny else "SmolLM2-135M config (LlamaConfig), random init, fp32",
        "rows": args.rows, "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
        "threads": args.threads, "steps": args.steps, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "load_1min_before": load_before, "load_1min_after": load(),
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                    "note": "shared 2-core machine: figures indicative only"},
        "summary": summary, "table": table, "runs": runs,
    }, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
