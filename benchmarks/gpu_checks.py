"""CUDA checks of rlbits' GPU paths, for a machine with a GPU (CI has none; the test suite covers the CPU).

Each check compares a GPU path with a reference computed on the same GPU in float32 (TF32 off) and
prints PASS/FAIL with the measured error; the exit code is the number of failures. Model: a random-init
model of SmolLM2-135M's architecture (``_workload.smollm2_config``), 8 prompts x 2 samples, 16-token
prompts, 24 new tokens, temperature 1.

- ``generate_fp32``: ``generate``'s behaviour logprobs equal the teacher-forced ``policy_logprobs`` of the
  sampled tokens (max |diff|).
- ``generate_compile``: ``generate(compile=True)`` (the decode step as a CUDA graph) samples the tokens
  eager decoding samples from the same generator, with the same logprobs; the speed of both is printed.
- ``generate_bf16``: decoding from a bfloat16 copy (``precision: bf16``) against the bf16-autocast
  teacher-forced forward the trainer computes (mean and max |diff|, and the per-sequence k1 KL).
- ``heads``: the fused and unfused output layers of ``policy_logprobs`` give the same values and gradients.
- ``functional_compile``: ``torch.compile(fullgraph=True)`` of the loss and advantage kernels on CUDA
  tensors equals eager, values and gradients.
- ``continuous_batching``, ``..._compiled``, ``max_num_seqs``, ``..._compiled`` (issue 28): a 4-layer model
  of SmolLM2's widths, 16 rows with the uneven workload's forced lengths (``uneven_generate``: budget 64,
  two rows at the budget); decoding with finished rows compacted out, or with 4 slots, eager and as a CUDA
  graph, against the static batch from the same generator (slots: against 16 slots, since slots lay the
  noise out per sample): every row ends at its length; the behaviour logprobs agree within 1e-4 up to each
  row's first differing token; at most a quarter of the rows differ. A random-init model's next-token
  distribution over 49,152 ids is nearly uniform (logprobs about -10.8), so inverse-CDF sampling from
  the same uniform draw picks another token when rounding at another batch size moves a cumulative
  probability across the draw: seen on the H200 once in 16 rows (0.995 of the tokens), and on the CPU
  with the host check every 8 steps, each time with the logprobs before the flip equal to 2e-6. The CPU
  test suite checks token identity on small vocabularies, where this does not happen.
- ``packed_logprobs``, ``packed_budget``: ``policy_logprobs(pack=True)`` (rows concatenated, attention
  confined to each row by their position ids) and packed token-budget microbatches (``max_tokens=160``)
  against the padded forward on those rollouts, fp32: values and gradients (relative) within 1e-5.
- ``loop_*``: ``rlbits.train`` for 2 steps of GRPO, RLOO with KL, PPO and bf16 GRPO with the compiled
  decode, and GRPO and PPO with both issue-28 switches on (``pack_sequences``, ``continuous_batching``, a
  token budget), on a 2-layer random GPT-2 on the device: every logged loss is finite.
- ``fsdp2_world1``: one process, an NCCL group of 1, the model sharded with ``fully_shard`` per block
  and on the root as ``rlbits.distributed.parallelize.shard`` does at world size > 1: the logprobs, loss
  gradient norm and the weights after one SGD step equal the unsharded model's.

    python benchmarks/gpu_checks.py [--only switches loops] [--out results/gpu_checks.json]

``--only`` runs some groups: ``generate`` (generate_fp32, _compile, _bf16), ``heads``, ``functional``,
``fsdp2``, ``switches`` (continuous batching, slots, packing), ``loops``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RESULTS: list[dict] = []
GROUPS = ("generate", "heads", "functional", "fsdp2", "switches", "loops")


def record(name: str, ok: bool, **figures) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), **figures})
    shown = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    print(f"{'PASS' if ok else 'FAIL'}  {name:<20} {shown}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "gpu_checks.json")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    p.add_argument("--only", nargs="+", choices=GROUPS, default=GROUPS, help="the groups of checks to run")
    args = p.parse_args()
    want = set(args.only).__contains__

    import torch
    from _workload import smollm2_config
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM

    from rlbits.models.forward import policy_logprobs
    from rlbits.rollout.generate import generate

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    assert not cuda or torch.cuda.is_available(), "no CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def sync():
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(smollm2_config(positions=2048)).to(dev).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (8, 16), generator=g)
    mask = torch.ones_like(prompts, dtype=torch.bool)
    mask[1, :5] = False  # left padding in two rows
    mask[6, :9] = False
    prompts[~mask] = 0
    td = TensorDict(prompts=prompts, prompt_mask=mask, batch_size=[8]).to(dev)
    kw = dict(max_new_tokens=24, temperature=1.0, eos_token_id=None, pad_token_id=0, num_samples=2)

    # generate_fp32 (its rollouts feed heads and fsdp2 too)
    with torch.no_grad():
        out = generate(model, td, **kw, generator=torch.Generator(dev).manual_seed(1))
        tf = policy_logprobs(model, out)
    diff = (out["logprobs"] - tf)[out["action_mask"]].abs()
    if want("generate"):
        record(
            "generate_fp32",
            diff.max().item() < 1e-3,
            max_abs_diff=diff.max().item(),
            tokens=int(out["action_mask"].sum()),
        )
        generate_checks(model, td, kw, dev, sync)
    if want("switches"):
        switch_checks(dev, g)
    if want("heads"):
        heads_check(model, out, dev)
    if want("functional"):
        functional_check(dev, g)
    if want("fsdp2"):
        fsdp2_check(out, dev, cuda)
    if want("loops"):
        loop_checks(dev)
    return report(args, cuda)


def generate_checks(model, td, kw, dev, sync) -> None:
    import torch

    from rlbits.loops.phases import bf16_copy
    from rlbits.models.forward import policy_logprobs
    from rlbits.rollout.generate import generate

    # generate_compile
    def timed(compile_):
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            o = generate(model, td, **kw, generator=torch.Generator(dev).manual_seed(2), compile=compile_)
        sync()
        return o, time.perf_counter() - t

    eager, _ = timed(False)
    t0 = time.perf_counter()
    compiled, first = timed(True)
    compile_s = time.perf_counter() - t0
    e_times, c_times = [], []
    for _ in range(3):
        eager, te = timed(False)
        compiled, tc = timed(True)
        e_times.append(te)
        c_times.append(tc)
    same = (eager["responses"] == compiled["responses"]).float().mean().item()
    lp = (eager["logprobs"] - compiled["logprobs"]).abs().max().item()
    record(
        "generate_compile", same == 1.0 and lp < 1e-3, same_tokens=same, max_abs_logprob_diff=lp,
        eager_s=min(e_times), compiled_s=min(c_times), speedup=min(e_times) / min(c_times), first_call_s=compile_s,
    )

    # generate_bf16
    copy = bf16_copy(model)
    with torch.no_grad():
        out16 = generate(copy, td, **kw, generator=torch.Generator(dev).manual_seed(3))
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            tf16 = policy_logprobs(model, out16)
    d = (out16["logprobs"] - tf16)[out16["action_mask"]]
    k1 = (d.sum() / out16.batch_size[0]).abs().item()
    record("generate_bf16", d.abs().mean().item() < 0.05 and k1 < 0.5, mean_abs_diff=d.abs().mean().item(),
           max_abs_diff=d.abs().max().item(), k1_per_seq=k1)


def switch_checks(dev, g) -> None:
    """Issue 28's paths on the device: continuous batching and slots against the static batch, packed
    forward passes against padded ones (see the module docstring)."""
    import torch
    from _workload import smollm2_config
    from tensordict import TensorDict
    from transformers import AutoModelForCausalLM
    from uneven_generate import _forced_lengths, uneven_lengths

    from rlbits.models.forward import policy_logprobs
    from rlbits.rollout.generate import generate

    torch.manual_seed(6)
    config = smollm2_config(positions=2048)
    config.num_hidden_layers = 4  # SmolLM2's widths; 4 layers keep each compiled shape's compile short
    model = AutoModelForCausalLM.from_config(config).to(dev).eval()
    B, budget = 16, 64
    eos = config.vocab_size - 1
    lengths = uneven_lengths(B, budget, 0)
    prompts = torch.randint(3 + B, eos, (B, 16), generator=g)
    prompts[:, 0] = torch.arange(B) + 2  # the row id the forced-length processor reads
    td = TensorDict(prompts=prompts, prompt_mask=torch.ones_like(prompts, dtype=torch.bool), batch_size=[B]).to(dev)

    def sample(**kw):
        with torch.no_grad():
            return generate(
                model, td, max_new_tokens=budget, temperature=1.0, eos_token_id=eos, pad_token_id=0,
                generator=torch.Generator(dev).manual_seed(4), logits_processor=_forced_lengths(lengths, eos, dev),
                **kw,
            )

    static = sample(continuous_batching=False)
    # slots lay the noise out per sample (generate's docstring), so their reference is B slots: all at once
    all_slots = sample(max_num_seqs=B)
    for name, kw, ref in (
        ("continuous_batching", dict(continuous_batching=True), static),
        ("continuous_batching_compiled", dict(continuous_batching=True, compile=True), static),
        ("max_num_seqs", dict(max_num_seqs=4), all_slots),
        ("max_num_seqs_compiled", dict(max_num_seqs=4, compile=True), all_slots),
    ):
        try:
            start = time.perf_counter()
            o = sample(**kw)
            first_s = time.perf_counter() - start
            ends = o["action_mask"].sum(1).tolist() == lengths
            both = o["action_mask"] & ref["action_mask"]
            differ = both & (o["responses"] != ref["responses"])
            # each row up to its first differing token (a rounding-level flip, see the module docstring)
            prefix = both & (differ.int().cumsum(1) == 0)
            lp = (o["logprobs"] - ref["logprobs"])[prefix].abs().max().item()
            rows_same = int((~differ.any(1)).sum())
            record(name, ends and lp < 1e-4 and rows_same >= B - B // 4, lengths_match=ends,
                   rows_same=f"{rows_same}/{B}", same_tokens=(~differ)[both].float().mean().item(),
                   max_abs_logprob_diff_before_first_flip=lp, first_call_s=first_s)
        except Exception as exc:
            record(name, False, error=f"{type(exc).__name__}: {exc}"[:300])

    # packed forward passes: values and gradients against the padded forward, on those uneven rollouts
    model.train()
    weights = torch.randn(static["responses"].shape, generator=g).to(dev)

    def logprobs_and_grads(**kw):
        model.zero_grad(set_to_none=True)
        lp = policy_logprobs(model, static, **kw)
        (lp * weights * static["action_mask"]).sum().backward()
        grads = torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])
        return lp.detach() * static["action_mask"], grads

    try:
        ref_lp, ref_grads = logprobs_and_grads(pack=False)
        for name, kw in (("packed_logprobs", dict(pack=True)), ("packed_budget", dict(pack=True, max_tokens=160))):
            lp, grads = logprobs_and_grads(**kw)
            value_rel = ((lp - ref_lp).norm() / ref_lp.norm()).item()
            grad_rel = ((grads - ref_grads).norm() / ref_grads.norm()).item()
            record(name, value_rel < 1e-5 and grad_rel < 1e-5, value_rel_diff=value_rel, grad_rel_diff=grad_rel,
                   max_abs_logprob_diff=(lp - ref_lp).abs().max().item())
    except Exception as exc:
        record("packed_logprobs", False, error=f"{type(exc).__name__}: {exc}"[:300])


def heads_check(model, out, dev) -> None:
    import torch

    from rlbits.models.forward import policy_logprobs

    model.train()
    grads = {}
    vals = {}
    for head in ("fused", "unfused"):
        model.zero_grad(set_to_none=True)
        lp_head = policy_logprobs(model, out, head=head)
        (lp_head * torch.linspace(-1, 1, lp_head.numel(), device=dev).view_as(lp_head)).sum().backward()
        vals[head] = lp_head.detach()
        grads[head] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    gdiff = ((grads["fused"] - grads["unfused"]).norm() / grads["unfused"].norm()).item()
    vdiff = (vals["fused"] - vals["unfused"]).abs().max().item()
    record("heads", vdiff < 1e-4 and gdiff < 1e-4, max_abs_logprob_diff=vdiff, grad_rel_diff=gdiff)
    model.zero_grad(set_to_none=True)



def functional_check(dev, g) -> None:
    import torch

    import rlbits

    B, R = 16, 33
    m = torch.rand(B, R, generator=g) > 0.2
    m[3] = False
    m = m.to(dev)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_(True)

    old = torch.randn(B, R, generator=g).to(dev)
    cases = {
        "gae": (rlbits.gae, (rnd(B, R), rnd(B, R), m), {"gamma": 0.99, "lam": 0.95}),
        "ppo_loss": (rlbits.ppo_loss, ((old + 0.3 * torch.randn(B, R, generator=g).to(dev)).requires_grad_(True), old,
                     rnd(B, R).detach(), m), {"clip_eps": 0.2}),
        "kl_penalty": (rlbits.kl_penalty, (rnd(B, R), old), {"estimator": "k3"}),
        "group_normalize": (rlbits.group_normalize, (rnd(B),), {"group_size": 4}),
        "rloo_baseline": (rlbits.rloo_baseline, (rnd(B),), {"group_size": 4}),
        "value_loss": (rlbits.value_loss, (rnd(B, R), old, old, m), {"clip_eps": 0.2}),
        "logprobs_from_logits": (rlbits.logprobs_from_logits, (rnd(B, R, 1000), torch.randint(0, 1000, (B, R)).to(dev)), {}),
    }
    worst = 0.0
    failed = []
    for name, (fn, fargs, fkw) in cases.items():
        try:
            e = fn(*fargs, **fkw)
            c = torch.compile(fn, fullgraph=True)(*fargs, **fkw)
            e = (
                e
                if isinstance(e, torch.Tensor)
                else (e[0] if isinstance(e, tuple) else next(iter(e.values())))
            )
            c = (
                c
                if isinstance(c, torch.Tensor)
                else (c[0] if isinstance(c, tuple) else next(iter(c.values())))
            )
            leaves = [a for a in fargs if isinstance(a, torch.Tensor) and a.requires_grad]
            ge = torch.autograd.grad(e.sum(), leaves, allow_unused=True)
            gc = torch.autograd.grad(c.sum(), leaves, allow_unused=True)
            err = (e - c).abs().max().item()
            for a, b in zip(ge, gc, strict=True):
                if a is not None:
                    err = max(err, (a - b).abs().max().item())
            worst = max(worst, err)
            if err > 1e-4:
                failed.append(name)
        except Exception as exc:  # report, don't stop the other checks
            failed.append(f"{name}: {type(exc).__name__}: {exc}"[:200])
    record("functional_compile", not failed, kernels=len(cases), worst_abs_diff=worst, failed=failed)



def fsdp2_check(out, dev, cuda) -> None:
    import torch
    from _workload import smollm2_config
    from transformers import AutoModelForCausalLM

    from rlbits.models.forward import policy_logprobs

    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from rlbits.distributed.parallelize import transformer_blocks

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
        torch.manual_seed(5)
        ref = AutoModelForCausalLM.from_config(smollm2_config(positions=2048)).to(dev).train()
        sharded = AutoModelForCausalLM.from_config(smollm2_config(positions=2048)).to(dev).train()
        sharded.load_state_dict(ref.state_dict())
        mesh = init_device_mesh(dev.type, (1,))
        for block in transformer_blocks(sharded):
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        results = {}
        for name, net in (("ref", ref), ("sharded", sharded)):
            # SGD, not AdamW: Adam's first step is ~lr * sign(g), which turns rounding-level gradient
            # differences of near-zero entries into weight differences of order lr.
            opt = torch.optim.SGD(net.parameters(), lr=1e-2)
            lp_net = policy_logprobs(net, out)
            loss = -(lp_net * out["action_mask"]).sum() / out["action_mask"].sum()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
            opt.step()
            w = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float()
                 for k, v in net.state_dict().items()}
            results[name] = (lp_net.detach(), gn.item(), w)
        lp_diff = (results["ref"][0] - results["sharded"][0]).abs().max().item()
        gn_rel = abs(results["ref"][1] - results["sharded"][1]) / results["ref"][1]
        w_diff = max(
            (results["ref"][2][k] - results["sharded"][2][k]).abs().max().item() for k in results["ref"][2]
        )
        record("fsdp2_world1", lp_diff < 1e-4 and gn_rel < 1e-4 and w_diff < 1e-5,
               max_abs_logprob_diff=lp_diff, grad_norm_rel_diff=gn_rel, max_abs_weight_diff=w_diff)
        dist.destroy_process_group()
    except Exception as exc:
        record("fsdp2_world1", False, error=f"{type(exc).__name__}: {exc}"[:300])



def loop_checks(dev) -> None:
    """Each online loop's real path on the device, as a user calls it (a device mismatch between the
    reward and the rollout once failed every rlbits step on CUDA while every CPU test passed)."""
    import math
    import tempfile

    import _workload as W

    import rlbits

    folder = Path(tempfile.gettempdir()) / "rlbits_gpu_checks_model"
    folder = W.build_model_folder(folder, layers=2, width=64, heads=2)
    prompts = W.prompts(64, length=8, seed=1)
    for name, extra in (
        ("grpo", {"loop": "reinforce", "adv_estimator": "grpo"}),
        ("rloo_kl", {"loop": "reinforce", "adv_estimator": "rloo", "kl_in_reward": True, "kl_coef": 0.05}),
        ("ppo", {"loop": "ppo", "kl_in_reward": True, "kl_coef": 0.05, "ppo_epochs": 2}),
        ("grpo_bf16_compiled", {"loop": "reinforce", "precision": "bf16", "compile_generate": True}),
        ("grpo_switches_bf16_compiled", {"loop": "reinforce", "precision": "bf16", "compile_generate": True,
                                         "pack_sequences": True, "continuous_batching": True,
                                         "max_tokens_per_microbatch": 128}),
        ("ppo_switches", {"loop": "ppo", "kl_in_reward": True, "kl_coef": 0.05, "pack_sequences": True,
                          "continuous_batching": True, "max_tokens_per_microbatch": 128}),
    ):
        seen = []

        class Seen:
            def on_metrics(self, step, metrics, seen=seen):
                seen.append(metrics)

        try:
            with tempfile.TemporaryDirectory() as run_dir:
                rlbits.train(
                    reward_fn=W.rlbits_reward, prompts=prompts, callbacks=[Seen()],
                    config=dict(
                        policy=str(folder), run_dir=run_dir, device=dev.type, max_num_steps=2, max_new_tokens=8,
                        num_prompts_per_step=4, num_generations_per_prompt=4, val_period=0, val_at_start=False,
                        val_at_end=False, save_period=0, tensorboard=False, progress=False, log_samples=0, **extra,
                    ),
                )
            losses = [v for m in seen for k, v in m.items() if k.endswith("loss") and isinstance(v, float)]
            record(
                f"loop_{name}",
                bool(losses) and all(map(math.isfinite, losses)),
                steps=len(seen),
                losses=len(losses),
            )
        except Exception as exc:
            record(f"loop_{name}", False, error=f"{type(exc).__name__}: {exc}"[:300])



def report(args, cuda) -> int:
    import torch

    failures = sum(not r["ok"] for r in RESULTS)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python benchmarks/gpu_checks.py" + (
            "" if set(args.only) == set(GROUPS) else " --only " + " ".join(args.only)
        ),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "results": RESULTS,
    }
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"{len(RESULTS) - failures}/{len(RESULTS)} checks passed on {report['device']}")
    return failures


if __name__ == "__main__":
    raise SystemExit(main())
