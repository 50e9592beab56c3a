"""What a training process sets up once: process group, threads, seeds, precision, compiled kernels, models.

Seeds come from one derivation, ``derive_seed(seed, rank, stream)``: every random stream of a run (sampling,
minibatch shuffles, validation, prompt order, initialisation) is named, so no two streams share a seed by
accident (``seed + 1000 * rank`` would give seed 1000 on rank 0 and seed 0 on rank 1 the same stream).

``Setup`` is what a run resolves from its config once, before it builds its state: the task object, whether
prompts are chat-formatted, the folder of the initial policy; ``init_state`` and ``Run`` read it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import platform
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlbits._seeds import derive_seed, generator  # defined below the loops: rlbits.data uses them too
from rlbits.distributed.env import DistEnv, init, main_rank_first
from rlbits.distributed.parallelize import is_sharded, shard
from rlbits.loops.config import ConfigError, RunConfig
from rlbits.models.frozen_layers import freeze_bottom_layers
from rlbits.models.heads import ValueModel
from rlbits.models.load import load_pretrained
from rlbits.models.lora import apply_lora
from rlbits.text import chat_prompts


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch's global RNGs (initialisation, dropout); rollouts use their own generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def reuse_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from the heap and never hand freed heap memory back to the
    kernel (``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)``): process-wide, from now on.

    By default an allocation above 32 MiB (the most glibc's adaptive threshold reaches) is a fresh ``mmap``
    and its ``free`` an ``munmap``, so each [B, R, V] logits tensor, and its gradient, page-faults and
    zero-fills its pages again at every step: on the 2-core benchmark machine a fresh 131 MB tensor took
    32 ms to fill against 9 ms for a reused one, and a [1024, 256] x [256, 32000] ``mm`` 86 ms against 58 ms.
    Values are unchanged; the process keeps its peak memory until it exits.

    Returns:
        True when applied, False where the C library is not glibc (nothing is changed).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def setup(cfg: RunConfig) -> DistEnv:
    """Process group (its collectives time out after ``cfg.collective_timeout_s``), CPU threads
    (``cfg.cpu_threads``), heap reuse on CPU (``cfg.cpu_reuse_memory``), the
    global seeds (``derive_seed(seed, rank, "global")``), quiet transformers progress bars. Returns the
    ``DistEnv``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    env = init(cfg.device, timeout_s=cfg.collective_timeout_s)
    if env.device.type == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    if env.device.type == "cpu" and cfg.cpu_reuse_memory:
        reuse_freed_memory()
    seed_everything(derive_seed(cfg.seed, env.rank, "global"))
    return env


def prepare(model: torch.nn.Module, cfg: RunConfig, env: DistEnv) -> torch.nn.Module:
    """Shard ``model`` for training under torchrun (``rlbits.distributed.parallelize.shard``) with the run's
    precision, activation checkpointing and (on GPU) per-block compile; at world size 1 only the latter two apply."""
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


def head_args(cfg: RunConfig) -> dict:
    """The output-layer keywords of ``policy_logprobs`` from a config (``logprob_head``, ``head_memory_budget_mb``)."""
    return {"head": cfg.logprob_head, "head_memory_budget_mb": cfg.head_memory_budget_mb}


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0: RL needs the sampling and training forward passes to agree."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def policy_path(cfg: RunConfig) -> str:
    """The folder of the initial policy: ``cfg.policy`` if it is a folder, the zoo model it names
    (``smollm2-135m``: fetched and converted on first use), or, when ``cfg.policy`` is None, the task's base
    model (``rlbits.zoo.base_model``: built on first use, or the zoo model a real-data task names).

    Raises:
        CheckpointNotFoundError (a FileNotFoundError): ``cfg.policy`` is neither a folder nor a zoo name;
            the message lists the zoo names.
    """
    if cfg.policy is not None:
        from rlbits.zoo import resolve_model

        return resolve_model(cfg.policy)
    from rlbits.zoo import base_model

    return base_model(cfg.task)


def initial_policy_path(cfg: RunConfig) -> str:
    """``policy_path(cfg)`` for a run's set-up, where every rank calls it: under torchrun rank 0 resolves it
    first (a base model built or a zoo model fetched on first use is written by rank 0: transformers'
    ``save_pretrained`` writes nothing on other ranks), then the others, which find it ready
    (``rlbits.distributed.env.main_rank_first``; a collective)."""
    return main_rank_first(lambda: policy_path(cfg))


def uses_chat(cfg: RunConfig, task: Any = None) -> bool:
    """Whether prompts are formatted with the chat template: ``cfg.chat_template``, or when it is None
    (the default) the task's ``CHAT`` flag (False for a task without one). ``task``: the task object of
    ``cfg.task`` when the caller holds it (default: looked up)."""
    if cfg.chat_template is not None:
        return cfg.chat_template
    if task is None:
        from rlbits.tasks import get_task

        task = get_task(cfg.task)
    return bool(getattr(task, "CHAT", False))


def loop_prompts(
    cfg: RunConfig, tokenizer: Any, prompts: Sequence[str] | None, split: str, task: Any = None
) -> list[str]:
    """The prompts a loop feeds its stream or its validation: ``prompts``, or the task's ``split`` when
    None, each formatted as one user turn with the tokenizer's chat template when ``uses_chat(cfg)``
    (``rlbits.text.chat_prompts``). The reward then sees the decoded formatted prompt. ``task``: the task
    object of ``cfg.task`` when the caller holds it (default: looked up).

    Raises:
        ValueError: chat formatting is on and the tokenizer has no chat template.
    """
    if task is None:
        from rlbits.tasks import get_task

        task = get_task(cfg.task)
    texts = list(prompts) if prompts is not None else task.prompts(split)
    return chat_prompts(tokenizer, texts) if uses_chat(cfg, task) else texts


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run resolves from its config once, up front (``Setup.of(cfg)``); ``init_state``, ``Run`` and
    evaluation read it instead of looking the task up again."""

    cfg: RunConfig
    task: Any
    """The task object of ``cfg.task`` (``rlbits.tasks.get_task``): its prompts, reward and ``make_env``."""
    chat: bool
    """Prompts are formatted with the tokenizer's chat template (``uses_chat``)."""

    @classmethod
    def of(cls, cfg: RunConfig) -> Setup:
        """Resolve ``cfg``'s task (one ``get_task``). Raises ValueError naming the valid tasks."""
        from rlbits.tasks import get_task

        task = get_task(cfg.task)
        return cls(cfg=cfg, task=task, chat=uses_chat(cfg, task))

    @property
    def make_env(self) -> Callable[..., Any] | None:
        """The task's ``make_env(prompt, **options) -> Env`` (a multi-turn task), else None."""
        return getattr(self.task, "make_env", None)

    def reward(self, reward: Any = None) -> Any:
        """``reward`` when given, else the task's reward."""
        return reward if reward is not None else self.task.reward

    def prompts(self, tokenizer: Any, prompts: Sequence[str] | None, split: str) -> list[str]:
        """``loop_prompts`` of the run: ``prompts`` or the task's ``split``, chat-formatted when ``chat``."""
        texts = list(prompts) if prompts is not None else self.task.prompts(split)
        return chat_prompts(tokenizer, texts) if self.chat else texts

    def initial_policy_path(self) -> str:
        """``initial_policy_path(cfg)`` (every rank calls it: a collective under torchrun)."""
        return initial_policy_path(self.cfg)


def fused_gelu(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``transformers`` ``NewGELUActivation`` (GPT-2's ``gelu_new``) in ``model`` by
    ``GELUTanh``: the same function, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``, as one
    ``F.gelu(approximate="tanh")`` kernel instead of eight elementwise ops (and their backward). Equal to
    float rounding (transformers documents the pair as equivalent); the config still says ``gelu_new``, so a
    saved model loads back unchanged. On the standard benchmark (4-layer GPT-2, 2 CPU threads) it saves
    about 7% of an RLOO step. In place; returns ``model``."""
    from transformers.activations import GELUTanh, NewGELUActivation

    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
    return model


def load_policy_and_tokenizer(path: str, env: DistEnv) -> tuple[torch.nn.Module, Any]:
    """An HF causal LM and its tokenizer from a local folder, dropout off, GELU fused (``fused_gelu``), on
    ``env.device``."""
    policy, tokenizer = load_pretrained(path)
    return fused_gelu(disable_dropout(policy)).to(env.device), tokenizer


def with_lora(model: torch.nn.Module, cfg: RunConfig, name: str = "policy") -> torch.nn.Module:
    """``model`` with LoRA adapters of the config's ``lora_rank``, ``lora_alpha``, ``lora_dropout`` and
    ``lora_target_modules`` (``rlbits.models.lora.apply_lora``, in place), or ``model`` untouched when
    ``lora_rank`` is 0. The adapters' init is seeded by ``derive_seed(seed, 0, "lora/" + name)``: the same on
    every rank (FSDP2 shards one model), different for the policy and the critic. Without LoRA, the policy
    (``name == "policy"``) gets its bottom layers frozen by ``num_layers_unfrozen`` (``freeze_bottom_layers``)."""
    if not cfg.lora_rank:
        unfrozen = getattr(cfg, "num_layers_unfrozen", -1)
        return freeze_bottom_layers(model, unfrozen) if name == "policy" and unfrozen != -1 else model
    return apply_lora(
        model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules, seed=derive_seed(cfg.seed, 0, f"lora/{name}"),
    )


def load_critic(cfg: RunConfig, policy: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """PPO's critic, a ``ValueModel`` in train mode on ``env.device`` (dropout off, GELU fused, LoRA adapters
    on its backbone with ``with_lora(..., "critic")``; the value head trains whole): with ``critic_init:
    policy`` a copy of ``policy``'s backbone (give it before the policy's adapters) and a fresh head, else
    the folder ``critic_init`` (a saved ValueModel, or a causal LM); the head is seeded by ``cfg.seed``.

    Raises:
        ConfigError: ``critic_init`` is neither ``policy`` nor an existing folder.
    """
    if cfg.critic_init == "policy":
        critic = ValueModel.from_policy(policy, seed=cfg.seed)
    else:
        if not Path(cfg.critic_init).is_dir():
            raise ConfigError(f"critic_init must be 'policy' or an existing folder; {cfg.critic_init!r} is neither")
        critic = ValueModel.from_pretrained(cfg.critic_init, seed=cfg.seed)
    critic = fused_gelu(disable_dropout(critic))
    with_lora(critic.backbone, cfg, "critic")  # in place; the value head stays fully trained
    return critic.to(env.device).train()


def build_policy(cfg: RunConfig, path: str | None = None) -> torch.nn.Module:
    """A fresh, unsharded CPU copy of the initial policy (from ``path``, default ``policy_path(cfg)``) with
    the run's adapters (``with_lora``): what ``Run.finish`` loads a sharded policy's full weights into before
    exporting ``final/``."""
    return with_lora(load_pretrained(path if path is not None else policy_path(cfg))[0], cfg)


__all__ = [
    "Setup",
    "autocast",
    "build_policy",
    "initial_policy_path",
    "derive_seed",
    "disable_dropout",
    "fused_gelu",
    "generator",
    "head_args",
    "kernel",
    "load_critic",
    "load_policy_and_tokenizer",
    "loop_prompts",
    "policy_path",
    "prepare",
    "reuse_freed_memory",
    "seed_everything",
    "setup",
    "uses_chat",
    "with_lora",
]
