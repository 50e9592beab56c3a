"""Seconds per RL step: rlbits GRPO / RLOO / PPO against TRL's GRPOTrainer, RLOOTrainer (trl 1.16) and
PPOTrainer (trl 1.12, ``trl.experimental.ppo``), side by side, on two workloads (``--workload``):

- ``standard`` (issue 7; ``benchmarks/_workload.py``): GPT-2 architecture, 4 layers, width 256, 4 heads,
  vocabulary 32,000 (11.4M parameters), random init; 8 prompts x 4 generations = 32 rollouts of 16-token
  prompts and 32 new tokens; one microbatch of 32 rows; GRPO, RLOO and PPO.
- ``smollm2``: a random-init model of SmolLM2-135M's exact architecture (Llama, 30 layers, width 576,
  vocabulary 49,152; 134.5M parameters); 4 prompts x 4 generations of 10-word prompts and 24 new tokens;
  microbatch 16; GRPO and RLOO. ``smollm2-large``: the same model at a GPU-sized batch, 32 prompts x 4
  generations, 128 new tokens, microbatch 64.

``--lengths uneven`` (issue 28; default ``uniform``, the workloads above): the same workload with response
lengths of a long tail, the same on every framework. Budget ``--budget`` new tokens (default 128 on every
workload); each rollout's B rows (B = prompts x 4: 32 standard, 16 smollm2) end at
``uneven_generate.uneven_lengths(B, budget, seed=0)``: a tenth of the rows (``round(B / 10)``, at least one)
at the budget, the rest uniform in 1 .. budget / 8, shuffled, the same lengths every step (at 128: standard
mean 20.81 new tokens, 3 rows of 128; smollm2 mean 24.50, 2 rows of 128). The lengths are forced by
one logits processor on both sides (``_workload.ForcedLengths``): EOS only at the row's length, never
before; a row's first token drawn from the ids ``== k (mod 4)`` of its sample ``k`` (its own distribution
restricted, so a row is known by its ids when ``continuous_batching`` drops finished rows); every other
token sampled as before. rlbits: ``rlbits.train`` takes no logits processor, so the worker wraps
``rlbits.loops.phases.generate_rollout`` (the rollout phase's call into ``generate``) to pass it;
TRL (1.16 GRPO/RLOO and 1.12 PPO decode with the model's HF ``generate`` on CPU without vLLM): the worker
wraps the policy's ``generate`` to add it to the ``logits_processor`` list. TRL's PPOTrainer then runs
with ``stop_token="eos"`` (responses truncated after their EOS, as a user sets it); it samples one
response per prompt, so its 32 rows take the same 32 lengths (group size 1). Each worker counts the
lengths its rollouts really generated (up to and including the first EOS, from the ``generate`` output)
and the tables report the mean per step and whether every rollout matched the workload's lengths
exactly. Cost only: TRL's PPO takes its behaviour logprobs from the processed scores, so its forced EOS
has logprob 0 there (rlbits' ``generate`` and TRL's GRPO/RLOO use the raw model's). ``--switches``
chooses rlbits' ``pack_sequences`` and ``continuous_batching``: ``default`` (the config's; workers
``rlbits-X``), ``off`` (``rlbits-X-off``), ``on`` (``rlbits-X-on``) or ``both`` (off and on beside TRL in
one run); ``--rlbits-overrides KEY=VALUE ...`` sets more rlbits config fields (e.g.
``max_tokens_per_microbatch=2304``). Results go to ``results/bench_step[_WORKLOAD]_uneven.json``.

``--device cuda`` runs both frameworks on the GPU (TRL with ``use_cpu=False``; bf16 is autocast on both
sides, rlbits decoding from a bfloat16 copy) and reports each worker's peak GPU memory
(``torch.cuda.max_memory_allocated``); a step's time then ends after a ``torch.cuda.synchronize()``.

Both: fp32 and bf16 (``torch.autocast`` on CPU: rlbits ``precision=bf16``, TRL ``bf16=True``), 2 threads,
temperature 1 with EOS never sampled in practice, reward = fraction of response tokens with an even id,
one optimizer step per rollout batch (PPO: 4 epochs x 1 minibatch, a value model of the same size).

Settings matched on both sides (each framework's defaults otherwise):

- GRPO: group-normalised advantages, token-mean loss, no KL (TRL's default ``beta=0``): neither framework
  loads a reference model (rlbits skips it when no term uses ``ref_logprobs``).
- RLOO: leave-one-out baseline, KL to the reference in the reward with coefficient 0.05 (TRL's default).
- PPO: 4 epochs x 1 minibatch, KL in the reward 0.05, GAE(1, 0.95), separate critic. TRL's PPOTrainer
  samples one response per prompt (32 prompts); rlbits 8 x 4 (the same tokens).
- TRL's PPOTrainer takes a reward *model*; a rule-based one is patched in (``get_reward`` on a marker
  module computes the same even-id fraction from the token ids).

rlbits runs through its real library path: ``rlbits.train`` on a policy folder saved from the random-init
model with a Python reward callable, exactly as a user would (validation, checkpoints, TensorBoard and
progress bars off). TRL runs its trainers' ``train()``. Each framework is one worker process (TRL in its
own venv: ``--trl116-python`` / ``--trl112-python``); a callback in each blocks after every step until the
driver says go. Step time = wall time from "go" to the end of the step (the whole loop iteration: rollout,
scoring, reference, update, logging); the first step of each worker is a warm-up (not timed). Two modes
(``--mode``, default both, one after the other):

- ``standalone``: one framework at a time, its steps back to back (what a user running it sees);
- ``interleaved``: per comparison (rlbits-X and trl-X of one algorithm and precision), both workers alive,
  one step each in turn, the order rotating every round, so a change in machine load hits both alike.

Why the two modes: TRL's step time once depended on how it was run (2.8 s standalone, 3.6-5.4 s in
earlier interleaved runs of all nine workers). Found: (1) after its last step a worker finishes its run
(rlbits writes ``final/``) while the next worker's step runs: the driver now waits for the exit; (2) with
all workers alive, eight SmolLM2-sized workers do not fit in RAM, and idle gaps grow: interleaving is now
per comparison pair; (3) paging is not involved (0 major faults per step, recorded; ``--pin`` locks the
workers' memory as an experiment). Still, with the other worker alive both frameworks' steps run 10-30%
slower than alone (cause not found), so the headline ratios are the standalone ones, with the
interleaved ones beside them.

``--profile-matmuls 1``: each rlbits worker runs one more step after its timed ones, under
``torch.profiler`` (not counted in the medians), and reports its matmul kernels' own time and GFLOP per
loop phase (``_profile.py``). The floor of a phase is its executed matmul GFLOP at the machine's peak
(``--peak``, or measured as ``bench_decode.py`` does), and "kernels / floor" is the best ratio to it those
kernels allow, however little else the step did. The same calls are then replayed in order without the
profiler ("replayed alone": the profiler's own cost cannot inflate it).

    python benchmarks/bench_step.py                           # standard workload, both modes, ~15 min quiet
    python benchmarks/bench_step.py --mode standalone --only rlbits-ppo --no-bf16 --profile-matmuls 1
    python benchmarks/bench_step.py --workload smollm2        # the 135M model, ~25 min quiet
    python benchmarks/bench_step.py --steps 3 --only rlbits-grpo trl-grpo --mode interleaved
    python benchmarks/bench_step.py --lengths uneven --switches both          # uneven, rlbits off/on vs TRL
    python benchmarks/bench_step.py --lengths uneven --steps 2 --mode standalone --no-bf16 \
        --only rlbits-grpo trl-grpo                                           # smoke: both force the same lengths

TRL's venvs (outside the repo, from the repo root; ``-c constraints.txt`` keeps the local CPU torch 2.13.0,
an unpinned torch pulls CUDA packages; bench_step.py finds them at these paths by default)::

    python3 -m venv /work/venv-trl116 && /work/venv-trl116/bin/pip install -c constraints.txt \
        -r benchmarks/requirements-trl116.txt
    python3 -m venv /work/venv-trl112 && /work/venv-trl112/bin/pip install -c constraints.txt \
        -r benchmarks/requirements-trl112.txt

Writes ``benchmarks/results/bench_step.json`` (``bench_step_smollm2.json``) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _workload as W  # noqa: E402
from _profile import matmul_calls, matmul_summary, profiler, replay_seconds  # noqa: E402
from bench_decode import measured_peaks  # noqa: E402
from uneven_generate import uneven_lengths  # noqa: E402

ALGOS = ("grpo", "rloo", "ppo")
UNEVEN_BUDGET = 128  # new tokens of every workload with --lengths uneven
DEFAULT_TRL116 = "/work/venv-trl116/bin/python"
DEFAULT_TRL112 = "/work/venv-trl112/bin/python"
# Seconds the driver waits between handing turns: OpenMP threads of the worker that just finished may
# spin briefly before sleeping; this keeps them off the next worker's cores.
_PAUSE_S = 0.3
# Extra seconds every worker waits before each step (``--idle``): to reproduce the long waits of an
# interleaved run with many workers in a short experiment.
_IDLE_S = 0.0


# --- the worker side ------------------------------------------------------------------------------------


def _send(kind: str, **payload) -> None:
    print("@@" + json.dumps({"kind": kind, **payload}), flush=True)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _cuda() -> bool:
    """True in a worker that runs on a GPU (the torch it imported has initialised CUDA)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


def _peak_cuda_mib() -> float | None:
    """Peak GPU memory allocated by this worker so far (``torch.cuda.max_memory_allocated``), MiB."""
    return sys.modules["torch"].cuda.max_memory_allocated() / 2**20 if _cuda() else None


def _pin_memory() -> str:
    """``mlockall(MCL_CURRENT | MCL_FUTURE)``: keep every page of this worker resident (``--pin``).

    An experiment, off by default. Suspected cause of TRL's unstable interleaved times: this machine's DAMON
    ``pageout`` scheme reclaiming the pages of a worker waiting for its turn. Measured (SmolLM2 GRPO, 3 steps
    each, quiet machine): no major page faults with or without pinning, and pinning made TRL's standalone
    step 8% slower (5.78 s vs 5.35 s: every allocation is populated and locked). Returns ``"ok"`` or why
    pinning failed."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.mlockall(1 | 2) != 0:
            return f"mlockall failed: errno {ctypes.get_errno()}"
        return "ok"
    except OSError as e:
        return f"mlockall unavailable: {e}"


class _Turns:
    """Called at the end of every step: report it, then block until the driver says go."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.t0 = None
        self.count = 0
        self.faults = 0

    def step_done(self, extra: dict | None = None) -> None:
        if _cuda():
            sys.modules["torch"].cuda.synchronize()  # the step's kernels are part of its time
        now = time.perf_counter()
        self.count += 1
        faults = _major_faults() - self.faults
        if self.t0 is None:
            _send("ready", peak_rss_mib=_peak_rss_mib())
        else:
            _send(
                "step", seconds=now - self.t0, peak_rss_mib=_peak_rss_mib(), peak_cuda_mib=_peak_cuda_mib(),
                major_faults=faults, **(extra or {}),
            )
        if self.count < self.total:
            line = sys.stdin.readline()
            if line.strip() != "go":
                raise SystemExit(f"worker: expected 'go' from the driver, got {line!r}")
            self.faults = _major_faults()
            self.t0 = time.perf_counter()


class _Lengths:
    """The uneven workload's forced lengths in a worker (``--lengths uneven``): the rows of every rollout end
    at ``uneven_lengths(rows, budget)`` (``_workload.ForcedLengths``); records the lengths each rollout
    really generated (counted from its output, up to and including the first EOS) for the step's report."""

    def __init__(self, args, rows: int):
        self.lengths = uneven_lengths(rows, args.new_tokens, seed=0)
        self.last: list[int] | None = None

    def processor(self, eos_token_id: int, group_size: int):
        return W.ForcedLengths(self.lengths, eos_token_id, group_size)

    def record_completions(self, completions, eos_token_id: int) -> None:
        """``completions`` [B, R] ids after the prompt (HF ``generate``): each row's length up to its EOS."""
        import torch

        is_eos = completions == eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completions.shape[1])
        self.last = first.tolist()

    def extra(self) -> dict:
        if self.last is None:  # e.g. rlbits' rollout no longer calls phases.generate_rollout
            raise RuntimeError("--lengths uneven: no rollout of this step went through the forced-lengths processor")
        return {
            "gen_len_mean": sum(self.last) / len(self.last),
            "gen_lengths_match": sorted(self.last) == sorted(self.lengths),
        }


def _force_rlbits_lengths(lengths: _Lengths, group_size: int) -> None:
    """Route every rollout of ``rlbits.train`` through ``lengths``' processor: ``rlbits.train`` takes no
    logits processor (a callable has no config field), so the worker wraps ``phases.generate_rollout`` (the
    rollout phase's call into ``generate``, which takes one) and counts each rollout's lengths."""
    from rlbits.loops import phases

    original = phases.generate_rollout

    def generate_rollout(policy, tokenizer, prompts, **kwargs):
        if kwargs.get("logits_processor") is not None:
            raise RuntimeError("bench_step --lengths uneven: the rollout already has a logits_processor")
        kwargs["logits_processor"] = lengths.processor(tokenizer.eos_token_id, group_size)
        out = original(policy, tokenizer, prompts, **kwargs)
        lengths.last = out["action_mask"].sum(1).tolist()
        return out

    phases.generate_rollout = generate_rollout


def _force_hf_lengths(model, lengths: _Lengths, eos_token_id: int, group_size: int) -> None:
    """Route every ``model.generate`` call (TRL's rollouts on CPU without vLLM: GRPOTrainer, RLOOTrainer and
    PPOTrainer call the unwrapped model's ``generate``) through ``lengths``' processor, added to the caller's
    ``logits_processor`` list; counts each call's lengths."""
    from transformers import LogitsProcessorList

    original = model.generate

    def generate(*a, **kwargs):
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(lengths.processor(eos_token_id, group_size))
        out = original(*a, logits_processor=processors, **kwargs)
        ids = out if hasattr(out, "shape") else out.sequences
        prompt = kwargs["input_ids"] if "input_ids" in kwargs else a[0]
        lengths.record_completions(ids[:, prompt.shape[1]:], eos_token_id)
        return out

    model.generate = generate


def _rlbits_overrides(pairs: list[str]) -> dict:
    """``KEY=VALUE`` strings as config overrides, each value read as YAML (``true``, ``512``, ``null``)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--rlbits-overrides: expected KEY=VALUE, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


def _rlbits_worker(args, folder: Path, run_dir: Path) -> None:
    import contextlib

    import torch

    import rlbits
    from rlbits.loops.api import resolve_config

    torch.set_num_threads(args.threads)
    total = 1 + args.steps
    common = dict(
        policy=str(folder),
        run_dir=str(run_dir),
        max_num_steps=total + (1 if args.profile_matmuls else 0),  # + the profiled step, not timed
        max_new_tokens=args.new_tokens,
        temperature=1.0,
        microbatch_size=args.microbatch,
        cpu_threads=args.threads,
        learning_rate=1e-5,
        val_period=0,
        val_at_start=False,
        val_at_end=False,
        save_period=0,
        tensorboard=False,
        progress=False,
        log_samples=0,
        device=args.device,
        compile_generate=bool(args.compile_generate),
        pack_decode_weights=bool(args.pack_decode_weights),
    )
    algo = args.worker.split("-")[1]
    if algo == "ppo":
        cfg = dict(
            loop="ppo",
            num_prompts_per_step=args.num_prompts,
            num_generations_per_prompt=4,
            ppo_epochs=4,
            num_minibatches=1,
            kl_coef=0.05,
            kl_in_reward=True,
            **common,
        )
    else:
        cfg = dict(
            loop="reinforce",
            num_prompts_per_step=args.num_prompts,
            num_generations_per_prompt=4,
            adv_estimator=algo,
            loss_agg="token-mean",
            **common,
        )
        if algo == "rloo":
            cfg.update(kl_in_reward=True, kl_coef=0.05)
    cfg.update(_rlbits_overrides(args.rlbits_overrides or []))
    lengths = None
    if args.lengths == "uneven":
        lengths = _Lengths(args, args.num_prompts * 4)
        _force_rlbits_lengths(lengths, group_size=4)
    resolved = resolve_config(dict(cfg))
    switches = {k: getattr(resolved, k, None) for k in ("pack_sequences", "continuous_batching",
                                                        "max_tokens_per_microbatch")}
    autocast = contextlib.nullcontext()
    if args.precision == "bf16":
        probe = resolve_config(dict(cfg))
        if "precision" in {f for f in probe.__dataclass_fields__}:
            cfg["precision"] = "bf16"  # the loops apply bf16 autocast themselves
        else:  # older loops: wrap the whole run in CPU autocast, what the precision field does
            autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    turns = _Turns(total)
    prof = None

    class Callback:
        def on_metrics(self, step, metrics):
            nonlocal prof
            if "time/step" not in metrics:
                return
            phases = {k: v for k, v in metrics.items() if k.startswith("time/")}
            if prof is not None:  # the extra step after the timed ones, under the profiler
                prof.stop()
                replayed = replay_seconds(matmul_calls(prof))
                _send("profile", seconds=metrics["time/step"], phases=phases, replay_s_by_phase=replayed,
                      **matmul_summary(prof))
                return
            turns.step_done(
                {
                    "loop_time_step": metrics["time/step"],
                    "phases": phases,
                    "response_len": metrics.get("response_len"),
                    "switches": switches,
                    **(lengths.extra() if lengths is not None else {}),
                }
            )
            if args.profile_matmuls and turns.count == total:
                prof = profiler()
                prof.start()

    prompts = W.prompts(args.num_prompts * (total + 2), length=args.prompt_len, vocab=args.vocab, seed=1)
    with autocast:
        rlbits.train(reward_fn=W.rlbits_reward, prompts=prompts, config=cfg, callbacks=[Callback()])


def _trl_callback(turns: _Turns, lengths: _Lengths | None = None):
    from transformers import TrainerCallback

    class Turn(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            turns.step_done(lengths.extra() if lengths is not None else None)

    return Turn()


def _trl_reinforce_worker(args, folder: Path, out_dir: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    algo = args.worker.split("-")[1]
    total = 1 + args.steps
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    prompts = W.prompts(args.num_prompts * (total + 2), length=args.prompt_len, vocab=args.vocab, seed=1)
    dataset = Dataset.from_dict({"prompt": prompts})
    common = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.num_prompts * 4,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        learning_rate=1e-5,
        max_steps=total,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=args.precision == "bf16",  # torch.autocast(bfloat16), as rlbits' precision=bf16
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    if algo == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    lengths = _Lengths(args, args.num_prompts * 4) if args.lengths == "uneven" else None
    trainer = Trainer(
        model=str(folder),
        reward_funcs=W.trl_reward,
        args=Config(**common),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[_trl_callback(_Turns(total), lengths)],
    )
    if lengths is not None:
        _force_hf_lengths(trainer.model, lengths, tokenizer.eos_token_id, group_size=4)
    trainer.train()


def _trl_ppo_worker(args, folder: Path, out_dir: Path) -> None:
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    total = 1 + args.steps
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"

    class RuleReward(torch.nn.Module):
        """Marker for the patched ``get_reward``: the even-id fraction of each response."""

    original = ppo_module.get_reward

    def get_reward(model, query_responses, pad_token_id, context_length):
        if not isinstance(model, RuleReward):
            return original(model, query_responses, pad_token_id, context_length)
        response = query_responses[:, context_length:]
        real = response != pad_token_id
        even = real & (response % 2 == 0)
        score = even.sum(1).float() / real.sum(1).clamp(min=1).float()
        return None, score, real.sum(1) - 1

    ppo_module.get_reward = get_reward
    prompts = W.prompts(32 * (total + 2), length=args.prompt_len, seed=1)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    dataset = Dataset.from_dict({"input_ids": ids})
    policy = AutoModelForCausalLM.from_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder)
    value = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1)
    value.config.pad_token_id = tokenizer.pad_token_id
    config = PPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=4,
        local_rollout_forward_batch_size=32,
        response_length=args.new_tokens,
        temperature=1.0,
        kl_coef=0.05,
        learning_rate=1e-5,
        total_episodes=32 * total,
        num_sample_generations=0,
        # uneven: responses end at their EOS (truncated after it, the rest padding); uniform: EOS never sampled
        stop_token="eos" if args.lengths == "uneven" else None,
        missing_eos_penalty=None,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    lengths = None
    if args.lengths == "uneven":  # one response per prompt: each row its own length, the same 32 lengths
        lengths = _Lengths(args, 32)
        _force_hf_lengths(policy, lengths, tokenizer.eos_token_id, group_size=1)
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=RuleReward(),
        train_dataset=dataset,
        value_model=value,
        callbacks=[_trl_callback(_Turns(total), lengths)],
    )
    trainer.train()


def _worker(args) -> None:
    pinned = _pin_memory() if args.pin_memory else "off"
    if pinned != "ok":
        print(f"worker {args.worker}: memory not pinned ({pinned})", file=sys.stderr)
    folder = Path(args.model_folder)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_step_{args.worker}_"))
    try:
        if args.worker.startswith("rlbits-"):
            _rlbits_worker(args, folder, tmp / "run")
        elif args.worker == "trl-ppo":
            _trl_ppo_worker(args, folder, tmp / "out")
        else:
            _trl_reinforce_worker(args, folder, tmp / "out")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _send("exit", peak_rss_mib=_peak_rss_mib())


# --- the driver -----------------------------------------------------------------------------------------


class Worker:
    def __init__(self, name: str, python: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        self.messages: list[dict] = []
        self.error: str | None = None

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read()
                self.error = err[-3000:]
                raise RuntimeError(f"worker {self.name} died:\n{self.error}")
            if line.startswith("@@"):
                msg = json.loads(line[2:])
                self.messages.append(msg)
                return msg

    def go(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()


def _load() -> float:
    return os.getloadavg()[0]


def _drive(specs, shared, steps, workers, label="step"):
    """Warm up the workers one after the other, then run ``steps`` rounds of one step each, in turn. With one
    spec this is the standalone mode: that framework alone, its steps back to back."""
    loads = [_load()]
    # Start the workers one at a time: each runs its warm-up step alone (18 threads of simultaneous
    # warm-ups on 2 cores thrash), then blocks until its first "go".
    failed = {}
    for name, python, precision, extra, _ in specs:
        worker_name = name.removesuffix("-bf16")
        w = Worker(name, python, [f"--worker={worker_name}", f"--precision={precision}", *extra, *shared])
        workers.append(w)
        try:
            w.read()
            print(f"warm-up done: {name} (load {_load():.2f})", flush=True)
        except RuntimeError as e:
            failed[w.name] = str(e)
            print(e, file=sys.stderr)
    alive = [w for w in workers if w.name not in failed]
    for i in range(steps):
        # Rotate the order every round, so no framework always runs right after the same other one.
        k = i % len(alive) if alive else 0
        for w in alive[k:] + alive[:k]:
            time.sleep(_PAUSE_S + _IDLE_S)
            loads.append(_load())
            msg = w.go()
            print(
                f"{label} {i + 1}/{steps} {w.name:<18} {msg['seconds']:7.3f} s  (load {loads[-1]:.2f})",
                flush=True,
            )
            if i == steps - 1:
                # After its last step a worker finishes its run (rlbits writes final/, TRL ends train()):
                # wait for that before the next worker's step, or it runs beside it (it made TRL's last
                # interleaved SmolLM2 step 2.6x slower).
                try:
                    w.read()  # "exit"
                except RuntimeError as e:
                    print(e, file=sys.stderr)
                w.proc.wait(timeout=300)

    return loads, failed, alive


WORKLOADS = {
    # name: (prompts per step, prompt words, new tokens, microbatch rows, vocabulary, algorithms)
    "standard": (8, 16, 32, 32, 32000, ALGOS),
    "smollm2": (4, 10, 24, 16, 49152, ("grpo", "rloo")),
    # a GPU-sized batch of the same model: 32 prompts x 4, 128 new tokens
    "smollm2-large": (32, 10, 128, 64, 49152, ("grpo", "rloo")),
}


# ``--switches``: rlbits variants (name suffix, config overrides) beside TRL; "default" is the config's own.
SWITCHES = {
    "default": [("", {})],
    "off": [("-off", {"pack_sequences": False, "continuous_batching": False})],
    "on": [("-on", {"pack_sequences": True, "continuous_batching": True})],
}
SWITCHES["both"] = SWITCHES["off"] + SWITCHES["on"]


def _summarise(alive, failed) -> dict:
    results = {}
    for w in alive:
        steps = [m for m in w.messages if m["kind"] == "step"]
        secs = [m["seconds"] for m in steps]
        results[w.name] = {
            "median_s": statistics.median(secs),
            "best_s": min(secs),
            "times_s": secs,
            "major_faults": [m.get("major_faults") for m in steps],
            "peak_rss_mib": steps[-1]["peak_rss_mib"],
            "peak_cuda_mib": steps[-1].get("peak_cuda_mib"),
            "loop_time_step_s": [
                m.get("loop_time_step") for m in steps if m.get("loop_time_step") is not None
            ],
            "response_len": [m.get("response_len") for m in steps if m.get("response_len") is not None],
            "gen_len_mean": [m["gen_len_mean"] for m in steps if m.get("gen_len_mean") is not None],
            "gen_lengths_match": all(m.get("gen_lengths_match", True) for m in steps),
            "rlbits_switches": steps[-1].get("switches"),
            "phases_last_step": steps[-1].get("phases"),
        }
        profiled = [m for m in w.messages if m["kind"] == "profile"]
        if profiled:
            results[w.name]["profiled_step"] = {k: v for k, v in profiled[0].items() if k != "kind"}
    for name, err in failed.items():
        results[name] = {"error": err[-2000:]}
    return results


def _table(results: dict, algos, variants=("",)) -> list[str]:
    """One row per worker: median and best step, memory, faults, TRL's median over this one's; with forced
    lengths (``--lengths uneven``) also the mean generated length per step and whether every rollout
    generated exactly the workload's lengths."""
    rows = []
    uneven = any(r.get("gen_len_mean") for r in results.values())
    for algo in algos:
        for suffix in ("", "-bf16"):
            trl = results.get(f"trl-{algo}{suffix}", {})
            for name in (*(f"rlbits-{algo}{v}{suffix}" for v in variants), f"trl-{algo}{suffix}"):
                r = results.get(name)
                if r is None or "error" in r:
                    continue
                ratio = (
                    trl["median_s"] / r["median_s"]
                    if "median_s" in trl and not name.startswith("trl")
                    else None
                )
                faults = sum(f or 0 for f in r.get("major_faults", []))
                gpu = r.get("peak_cuda_mib")
                gpu = "" if gpu is None else f"{gpu:.0f}"
                lens = r.get("gen_len_mean") or []
                gen = f"{statistics.mean(lens):.2f} ({'exact' if r.get('gen_lengths_match') else 'MISMATCH'})" if lens else ""
                rows.append((name, r["median_s"], r["best_s"], r["peak_rss_mib"], gpu, faults, ratio, gen))
    table = [
        "| framework | median s/step | best s/step | peak RSS MiB | peak GPU MiB | major faults | TRL / this (median) |"
        + (" mean generated tokens |" if uneven else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if uneven else ""),
    ]
    for name, med, best, rss, gpu, faults, ratio, gen in rows:
        ratio = "" if ratio is None else f"{ratio:.2f}x"
        table.append(f"| {name} | {med:.3f} | {best:.3f} | {rss:.0f} | {gpu} | {faults} | {ratio} |"
                     + (f" {gen} |" if uneven else ""))
    return table


def _matmul_rows(by_mode: dict, peak: float) -> list[dict]:
    """Per profiled rlbits worker and phase: matmul kernel seconds and GFLOP, the floor (GFLOP / peak) and
    the best ratio to it those kernels allow (their own seconds / floor), next to the timed median."""
    rows = []
    for results in by_mode.values():
        for name, r in results.items():
            prof = r.get("profiled_step")
            if prof is None:
                continue
            replayed = prof["replay_s_by_phase"]
            phases = {"step": {k: prof[k] for k in ("matmul_s", "matmul_gflop", "matmul_gflops")}}
            phases["step"]["replay_s"] = sum(replayed.values())
            phases.update({ph: {**m, "replay_s": replayed.get(ph)} for ph, m in prof["by_phase"].items()})
            last = r.get("phases_last_step") or {}
            for phase, m in phases.items():
                if m["matmul_gflop"] < 0.01:  # e.g. advantages: no matmul worth a floor
                    continue
                floor = m["matmul_gflop"] / peak
                timed = r["median_s"] if phase == "step" else last.get(f"time/{phase}")
                profiled_s = prof["seconds"] if phase == "step" else prof["phases"].get(f"time/{phase}")
                rows.append({"worker": name, "phase": phase, "timed_s": timed, "profiled_s": profiled_s, **m,
                             "floor_s": floor,
                             "x_floor_timed": timed / floor if timed and floor else None,
                             "x_floor_matmuls_only": m["matmul_s"] / floor if floor else None,
                             "x_floor_replayed": m["replay_s"] / floor if floor and m["replay_s"] else None})
    return rows


def _matmul_table(rows: list[dict], peak: float) -> list[str]:
    table = [
        f"| worker | phase | timed s | floor s at {peak:.0f} GFLOP/s | timed / floor | profiled s | its matmul "
        "kernels s | GFLOP | GFLOP/s | kernels / floor | kernels replayed alone s | replayed / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        table.append(
            f"| {r['worker']} | {r['phase']} | {fmt(r['timed_s'], '.3f')} | {r['floor_s']:.3f} | "
            f"{fmt(r['x_floor_timed'], '.2f')} | {fmt(r['profiled_s'], '.3f')} | {r['matmul_s']:.3f} | "
            f"{r['matmul_gflop']:.1f} | {r['matmul_gflops']:.0f} | {fmt(r['x_floor_matmuls_only'], '.2f')} | "
            f"{fmt(r['replay_s'], '.3f')} | {fmt(r['x_floor_replayed'], '.2f')} |"
        )
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="standard")
    p.add_argument("--mode", choices=("interleaved", "standalone", "both"), default="both",
                   help="interleaved: all workers alive, one step each in turn; standalone: one framework at a time")
    p.add_argument("--steps", type=int, default=5, help="timed steps per framework (after one warm-up step)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (both frameworks; bf16 = autocast on either)")
    p.add_argument("--trl116-python", default=DEFAULT_TRL116)
    p.add_argument("--trl112-python", default=DEFAULT_TRL112)
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 variants")
    p.add_argument("--pin", action="store_true", help="mlockall the workers (an experiment; see _pin_memory)")
    p.add_argument("--idle", type=float, default=0.0, help="extra seconds each worker waits before each step")
    p.add_argument("--only", nargs="+", help="run only these workers (e.g. rlbits-grpo trl-grpo)")
    p.add_argument("--out", type=Path, default=None, help="default: results/bench_step[_WORKLOAD].json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--model-folder", help=argparse.SUPPRESS)
    p.add_argument("--num-prompts", type=int, help=argparse.SUPPRESS)
    p.add_argument("--prompt-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--new-tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--microbatch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pin-memory", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--compile-generate", type=int, default=0,
                   help="1: rlbits decodes with a compiled step (compile_generate; compiled in the warm-up step)")
    p.add_argument("--profile-matmuls", type=int, default=0,
                   help="1: each rlbits worker runs one more step under torch.profiler (not timed) and reports "
                        "its matmul kernels' time and GFLOP per phase, against the arithmetic floor")
    p.add_argument("--peak", type=float, default=None,
                   help="matmul GFLOP/s for --profile-matmuls' floor (default: measured, as bench_decode.py)")
    p.add_argument("--pack-decode-weights", type=int, default=1,
                   help="0: rlbits decodes with F.linear, not oneDNN on packed weights (pack_decode_weights)")
    p.add_argument("--lengths", choices=("uniform", "uneven"), default="uniform",
                   help="uneven: every rollout's rows end at the uneven workload's lengths, on every framework "
                        "(see the module docstring); uniform: the workload's own new tokens, EOS never sampled")
    p.add_argument("--budget", type=int, default=UNEVEN_BUDGET,
                   help=f"with --lengths uneven: the new-token budget (default {UNEVEN_BUDGET})")
    p.add_argument("--switches", choices=tuple(SWITCHES), default="default",
                   help="rlbits' pack_sequences and continuous_batching: the config's defaults (default), both "
                        "off (rlbits-X-off), both on (rlbits-X-on), or both variants beside TRL (both)")
    p.add_argument("--rlbits-overrides", nargs="*", metavar="KEY=VALUE", default=[],
                   help="more rlbits config overrides for every rlbits worker, values read as YAML "
                        "(e.g. max_tokens_per_microbatch=2304); applied after --switches")
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return {}

    global _IDLE_S
    _IDLE_S = args.idle
    num_prompts, prompt_len, new_tokens, microbatch, vocab, algos = WORKLOADS[args.workload]
    if args.lengths == "uneven":
        new_tokens = args.budget
    if args.workload == "standard":
        folder = W.build_model_folder(Path(tempfile.gettempdir()) / "rlbits_bench_standard_model")
    else:
        folder = W.build_smollm2_folder(Path(tempfile.gettempdir()) / "rlbits_bench_smollm2_model")
    stem = "bench_step" if args.workload == "standard" else f"bench_step_{args.workload}"
    out = args.out or HERE / "results" / (stem + ("_uneven" if args.lengths == "uneven" else "") + ".json")
    shared = [f"--steps={args.steps}", f"--threads={args.threads}", f"--prompt-len={prompt_len}",
              f"--new-tokens={new_tokens}", f"--model-folder={folder}", f"--num-prompts={num_prompts}",
              f"--microbatch={microbatch}", f"--vocab={vocab}", f"--pin-memory={1 if args.pin else 0}",
              f"--compile-generate={args.compile_generate}", f"--device={args.device}",
              f"--pack-decode-weights={args.pack_decode_weights}",
              f"--profile-matmuls={args.profile_matmuls}", f"--lengths={args.lengths}"]
    variants = SWITCHES[args.switches]
    specs = []  # (name, python, precision, extra worker argv, comparison)
    for algo in algos:
        trl_python = args.trl112_python if algo == "ppo" else args.trl116_python
        precisions = ("fp32",) if args.no_bf16 else ("fp32", "bf16")
        for precision in precisions:
            suffix = "" if precision == "fp32" else "-bf16"
            for variant, overrides in variants:
                pairs = [f"{k}={str(v).lower()}" for k, v in overrides.items()] + args.rlbits_overrides
                extra = ["--rlbits-overrides", *pairs] if pairs else []
                specs.append((f"rlbits-{algo}{variant}{suffix}", sys.executable, precision, extra, algo + suffix))
            if algo == "ppo" and precision == "bf16":
                continue  # TRL's PPOTrainer is compared in fp32 only
            if Path(trl_python).exists():
                specs.append((f"trl-{algo}{suffix}", trl_python, precision, [], algo + suffix))
            else:
                print(
                    f"skipping trl-{algo}{suffix}: {trl_python} not found (see benchmarks/RESULTS.md to install)"
                )
    if args.only:
        specs = [s for s in specs if s[0] in args.only]
    modes = ("standalone", "interleaved") if args.mode == "both" else (args.mode,)
    by_mode, loads_by_mode = {}, {}
    # Interleaving runs per comparison (rlbits-X and trl-X of one algorithm and precision): two workers alive
    # at a time, so the idle gaps stay short and eight SmolLM2-sized workers never need RAM at once.
    groups: dict[str, list] = {}
    for spec in specs:
        groups.setdefault(spec[4], []).append(spec)
    for mode in modes:
        loads, failed, alive = [], {}, []
        for group in [[spec] for spec in specs] if mode == "standalone" else list(groups.values()):
            workers: list[Worker] = []
            try:
                label = "standalone step" if mode == "standalone" else "step"
                group_loads, group_failed, group_alive = _drive(group, shared, args.steps, workers, label)
            finally:
                for w in workers:  # never leave a worker behind (e.g. on Ctrl-C)
                    if w.proc.poll() is None:
                        w.proc.kill()
            loads += group_loads
            failed.update(group_failed)
            alive += group_alive
        by_mode[mode] = _summarise(alive, failed)
        loads_by_mode[mode] = loads
    tables = {mode: _table(res, algos, [v for v, _ in variants]) for mode, res in by_mode.items()}
    matmul_report = None
    if args.profile_matmuls:
        peak = args.peak or measured_peaks(args.threads, args.device)["matmul_gflops"]
        matmul_report = {"peak_gflops": peak, "rows": _matmul_rows(by_mode, peak)}
        tables["matmuls"] = _matmul_table(matmul_report["rows"], peak)
    for mode, table in tables.items():
        print(f"\n{mode}:\n" + "\n".join(table))
    if len(by_mode) == 2:
        print("\ninterleaved / standalone median step time:")
        for name, r in by_mode["standalone"].items():
            other = by_mode["interleaved"].get(name, {})
            if "median_s" in r and "median_s" in other:
                print(f"  {name:<18} {other['median_s'] / r['median_s']:.2f}")
    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
    for key, python in (("trl_grpo_rloo", args.trl116_python), ("trl_ppo", args.trl112_python)):
        if Path(python).exists():
            proc = subprocess.run(
                [python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
            )
            versions[key] = proc.stdout.strip()
    report = {
        "command": " ".join(
            ["python", "benchmarks/bench_step.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "workload": args.workload,
        "threads": args.threads,
        "steps": args.steps,
        "pinned": bool(args.pin),
        "idle_s": args.idle,
        "rlbits_compile_generate": bool(args.compile_generate),
        "rlbits_pack_decode_weights": bool(args.pack_decode_weights),
        "lengths": args.lengths,
        "new_tokens": new_tokens,
        "uneven_lengths": uneven_lengths(num_prompts * 4, new_tokens, seed=0) if args.lengths == "uneven" else None,
        "rlbits_switches": {v or "default": o for v, o in variants},
        "rlbits_overrides": args.rlbits_overrides,
        "versions": versions,
        "load_average_1min": {
            mode: {"start": ls[0], "per_step": ls[1:]} for mode, ls in loads_by_mode.items()
        },
        "load_end": _load(),
        "results": by_mode,
        "matmuls": matmul_report,
        "tables": {mode: "\n".join(t) for mode, t in tables.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
