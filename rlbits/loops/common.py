"""Set-up and phases shared by the loops: models, rollout, scoring, reference logprobs, validation, timing.

Each is a plain function, so a notebook can call one phase at a time and a new algorithm can reuse them.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from rlbits.batch import decode, tokenize_prompts
from rlbits.distributed.env import DistEnv, init
from rlbits.distributed.parallelize import grad_norm_and_clip, is_sharded, shard, unsharded
from rlbits.distributed.reduce import all_reduce_max, all_reduce_sum, any_rank
from rlbits.functional import kl_penalty, masked_sum
from rlbits.loops.config import RunConfig
from rlbits.models.forward import policy_logprobs
from rlbits.models.load import load_pretrained
from rlbits.rollout.generate import generate
from rlbits.rollout.score import InvalidRewardError, score
from rlbits.tasks import get_task


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (initialisation, dropout); sampling uses its own generator."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup(cfg: RunConfig) -> DistEnv:
    """Process group, CPU threads (``cfg.cpu_threads``), seeds (offset by rank), quiet transformers progress
    bars. Returns the ``DistEnv``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    env = init(cfg.device)
    if env.device.type == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    seed_everything(cfg.seed + env.rank)
    return env


def prepare(model: torch.nn.Module, cfg: RunConfig, env: DistEnv) -> torch.nn.Module:
    """Shard ``model`` for training under torchrun (``rlbits.distributed.parallelize.shard``) with the run's precision,
    activation checkpointing and (on GPU) per-block compile; at world size 1 only the latter two apply."""
    return shard(
        model,
        env,
        mixed_precision=cfg.precision == "bf16",
        activation_checkpointing=cfg.activation_checkpointing,
        compile_blocks=cfg.compile and env.device.type == "cuda",
    )


def autocast(model: torch.nn.Module, cfg: RunConfig) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bf16 when ``cfg.precision == "bf16"`` and ``model`` is not sharded (a sharded
    model casts its parameters itself, by its ``MixedPrecisionPolicy``); else a no-op."""
    if cfg.precision != "bf16" or is_sharded(model):
        return contextlib.nullcontext()
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True)


def kernel(fn: Callable, cfg: RunConfig) -> Callable:
    """``fn`` itself, or its ``torch.compile(dynamic=True)`` version when ``cfg.compile`` (one compiled copy per
    function per process: response lengths and batch sizes change without recompiling)."""
    return _compiled(fn) if cfg.compile else fn


def pad_microbatches(micros: list[TensorDictBase], env: DistEnv) -> list[TensorDictBase]:
    """Make every rank run the same number of microbatches (sharded models run a collective in each forward
    and backward): ranks with fewer append copies of their first microbatch with every mask False, which
    add nothing to the loss or the gradients."""
    if env.world_size == 1:
        return micros
    most = int(all_reduce_max(torch.tensor(len(micros), device=env.device), env).item())
    if most == len(micros):
        return micros
    empty = micros[0].clone()
    if "response_mask" not in empty.keys():  # keep the tokens real: only the loss masks go
        empty["response_mask"] = empty["action_mask"].clone()
    for key in ("action_mask", "loss_mask"):
        if key in empty.keys():
            empty[key] = torch.zeros_like(empty[key])
    return micros + [empty] * (most - len(micros))


@contextlib.contextmanager
def in_phase(step: int, phase: str) -> Iterator[None]:
    """Prefix the message of a ValueError/TypeError/FloatingPointError/RuntimeError raised inside with
    ``step N, phase NAME:`` (the exception keeps its type), so a failed run says where it failed."""
    try:
        yield
    except (ValueError, TypeError, FloatingPointError, RuntimeError) as e:
        if e.args and isinstance(e.args[0], str) and not e.args[0].startswith("step "):
            e.args = (f"step {step}, phase {phase}: {e.args[0]}", *e.args[1:])
        raise


SKIPPABLE = (FloatingPointError, InvalidRewardError)
"""What ``on_nonfinite="skip"`` skips: non-finite losses and gradients, and invalid (e.g. NaN) rewards."""


@contextlib.contextmanager
def agreed(env: DistEnv, enabled: bool = True) -> Iterator[None]:
    """Under torchrun, make a skippable error inside the block raise on every rank (one all-reduce), so
    ranks skip a step together instead of waiting for each other in the next collective."""
    if env.world_size == 1 or not enabled:
        yield
        return
    error = None
    try:
        yield
    except SKIPPABLE as e:
        error = e
    if any_rank(error is not None, env):
        raise error if error is not None else FloatingPointError("another rank hit a non-finite value")


def skipped_step(error: BaseException, step: int) -> dict[str, float]:
    """Warn about a step dropped by ``on_nonfinite="skip"``; the metrics to log for it."""
    warnings.warn(f"skipping step {step}: {error}", stacklevel=2)
    return {"skipped_step": 1.0}


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0: RL needs the sampling and training forward passes to agree."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def policy_path(cfg: RunConfig) -> str:
    """``cfg.policy``, or the task's base model (built on first use)."""
    return cfg.policy if cfg.policy is not None else get_task(cfg.task).base_model()


def load_policy_and_tokenizer(path: str, env: DistEnv) -> tuple[torch.nn.Module, Any]:
    """An HF causal LM and its tokenizer from a local folder, dropout off, on ``env.device``."""
    policy, tokenizer = load_pretrained(path)
    return disable_dropout(policy).to(env.device), tokenizer


def make_optimizer(params: Iterator[torch.nn.Parameter] | Sequence, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=weight_decay)


def clip_and_step(params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_grad_norm: float) -> torch.Tensor:
    """Clip the gradient's global norm (if ``max_grad_norm > 0``; over all ranks' shards), step and zero the
    gradients.

    Returns the norm before clipping (0-dim tensor). A non-finite norm raises FloatingPointError and leaves the
    parameters untouched.
    """
    norm = grad_norm_and_clip(list(params), max_grad_norm)
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"gradient norm is {norm.item()}; the update was skipped")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


def rollout(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    logits_processor: Callable | None = None,
) -> TensorDictBase:
    """Tokenize ``prompts``, sample ``num_samples`` responses each with ``generate``, decode the text.

    Returns the batch of DESIGN.md (``prompts`` ... ``logprobs``, ``group``, ``prompt_text``,
    ``response_text``) with behaviour logprobs at ``temperature`` (greedy when ``temperature == 0``).
    """
    device = next(policy.parameters()).device
    prompts_td = tokenize_prompts(tokenizer, list(prompts)).to(device)
    was_training = policy.training
    policy.eval()
    try:
        # A sharded policy is gathered once for the whole rollout: decoding then runs no collective.
        with torch.no_grad(), unsharded(policy):
            batch = generate(
                policy,
                prompts_td,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                num_samples=num_samples,
                generator=generator,
                logits_processor=logits_processor,
            )
    finally:
        policy.train(was_training)
    return decode(batch, tokenizer)


def score_rollout(batch: TensorDictBase, reward: Any) -> torch.Tensor:
    """Write ``rewards`` [B] from ``reward`` (callable, reward model or server URL; see ``rlbits.score``)."""
    batch["rewards"] = score(batch, reward).to(torch.float32)
    return batch["rewards"]


def reference_logprobs(ref_policy: torch.nn.Module, batch: TensorDictBase, *, temperature: float, microbatch_size: int) -> torch.Tensor:
    """Write ``ref_logprobs`` [B, R]: the frozen reference policy's logprobs of the sampled tokens."""
    with torch.no_grad():
        batch["ref_logprobs"] = policy_logprobs(ref_policy, batch, temperature=temperature, microbatch_size=microbatch_size)
    return batch["ref_logprobs"]


def validate(
    policy: torch.nn.Module,
    tokenizer: Any,
    cfg: RunConfig,
    *,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    logits_processor: Callable | None = None,
    env: DistEnv | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """Mean reward on the task's test split (first ``max_val_samples`` prompts), one response each.

    Uses its own generator seeded from ``cfg.seed`` (and the rank), so validating never shifts the training
    RNG streams (a run with and without validation samples the same training rollouts) and every validation
    of a run sees the same noise. Greedy if ``cfg.val_greedy``. Under torchrun each rank validates every
    ``world_size``-th prompt and the statistics are reduced over ranks (every rank must call it).

    Returns:
        ``({"val_reward", "val_reward_std", "val_response_len"}, batch)`` (this rank's batch).
    """
    env = env or DistEnv()
    task = get_task(cfg.task)
    prompts = list(prompts if prompts is not None else task.prompts("test"))[: cfg.max_val_samples]
    prompts = prompts[env.rank :: env.world_size] or prompts[:1]
    generator = torch.Generator(device=next(policy.parameters()).device).manual_seed(cfg.seed + 7919 + env.rank)
    with autocast(policy, cfg):
        batch = rollout(
            policy,
            tokenizer,
            prompts,
            max_new_tokens=cfg.max_new_tokens,
            temperature=0.0 if cfg.val_greedy else cfg.temperature,
            generator=generator,
            logits_processor=logits_processor,
        )
    rewards = score_rollout(batch, reward if reward is not None else task.reward).double().cpu()
    lengths = batch["action_mask"].sum(-1).double().cpu()
    n, total, squares, length = all_reduce_sum(
        torch.stack([torch.tensor(float(len(rewards)), dtype=torch.float64), rewards.sum(), rewards.square().sum(), lengths.sum()]).to(env.device),
        env,
    ).tolist()
    mean = total / n
    var = (squares - n * mean * mean) / (n - 1) if n > 1 else 0.0
    metrics = {"val_reward": mean, "val_reward_std": max(var, 0.0) ** 0.5, "val_response_len": length / n}
    return metrics, batch


def sample_rows(batch: TensorDictBase, n: int) -> list[dict[str, Any]]:
    """The first ``n`` rollouts as dicts (prompt, response, reward) for ``samples.jsonl``."""
    rows = []
    for i in range(min(n, batch.batch_size[0])):
        row = {"prompt": batch["prompt_text"][i], "response": batch["response_text"][i]}
        if "rewards" in batch.keys():
            row["reward"] = float(batch["rewards"][i])
        rows.append(row)
    return rows


def kl_per_sequence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of the summed k1 KL estimate (nats per sequence): the usual ``init_policy_kl``."""
    return masked_sum(kl_penalty(logprobs, ref_logprobs, "k1"), action_mask, dim=-1).mean()


def response_stats(batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """Response length metrics."""
    lengths = batch["action_mask"].sum(-1).float()
    return {"response_len": lengths.mean(), "response_len_max": lengths.max()}


class PhaseTimer:
    """Wall-clock seconds per phase: ``with timer("rollout"): ...``; ``timer.metrics()`` -> ``time/rollout``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = sum(self.seconds.values())
        return out
