"""Loop configs: one flat, frozen dataclass per loop, loaded from YAML with ``key=value`` overrides.

Every field has a docstring (a string literal right under it, as in cleanrl); ``field_docs(cls)`` reads them
from the source so that errors and ``rlbits train --help-config`` can quote them. Unknown keys and values of
the wrong type are rejected with a message naming the field, what it is, and what is allowed; each loop's
``validate()`` adds its range checks. Field names follow NeMo-RL where one exists.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import reprlib
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml

C = TypeVar("C", bound="RunConfig")


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the field and what is allowed.

    The message is cut at ``MAX_MESSAGE`` characters (values in it are shown by ``show``, at most
    ``MAX_VALUE`` characters each), so a huge or deeply shared value cannot make the error itself costly."""

    MAX_MESSAGE = 4000

    def __init__(self, message: object = "", *args: object):
        if isinstance(message, str) and len(message) > self.MAX_MESSAGE:
            message = message[: self.MAX_MESSAGE] + f" ... (message cut at {self.MAX_MESSAGE} characters)"
        super().__init__(message, *args)


MAX_VALUE = 200
"""Most characters ``show`` gives a value in a message."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8


def show(value: Any, limit: int = MAX_VALUE) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, built without walking all of a large or deeply
    nested value (``reprlib``: the first items of each container, three levels deep)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # e.g. an int past sys.get_int_max_str_digits()
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


MIN_TEMPERATURE = 1e-4
"""Smallest sampling temperature a config accepts: ``logits / temperature`` must stay finite in float32
(at 1e-38 it overflows and sampling yields NaN); below 1e-4 sampling is greedy in all but name."""

MAX_ROWS = 2**20
"""Most rows (prompts, responses, samples) a size field may ask for per step or batch: no run needs more,
and a larger value fails deep in an allocation (or is killed by the kernel) instead of here."""
MAX_TOKENS = 2**20
"""Most tokens a length field (``max_new_tokens``, ``max_episode_tokens``, ...) may ask for."""


# Float fields that are coefficients or rates: negative values make no sense in any loop.
NON_NEGATIVE = frozenset({
    "weight_decay", "kl_coef", "kl_loss_coef", "entropy_coef", "vf_coef", "critic_learning_rate", "cql_scale",
    "awac_scale", "dataset_temperature",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Fields every loop shares: what to train, where to write, how long, validation and checkpoints."""

    # Field -> the largest value ``check`` accepts: sizes that allocate (rows, tokens, threads, adapter
    # rank). Loops add theirs in their own ``SIZE_LIMITS``; ``size_limits(cls)`` merges them.
    SIZE_LIMITS: ClassVar[dict[str, int]] = {
        "num_prompts_per_step": MAX_ROWS, "num_generations_per_prompt": MAX_ROWS, "microbatch_size": MAX_ROWS,
        "max_val_samples": MAX_ROWS, "log_samples": MAX_ROWS, "max_new_tokens": MAX_TOKENS,
        "max_episode_tokens": MAX_TOKENS, "max_env_workers": 1024, "lora_rank": 2**16,
    }  # fmt: skip

    loop: str = "ppo"
    """Which loop runs this config: ``ppo``, ``reinforce``, ``ilql`` or ``reward_model``."""
    task: str = "sentiment"
    """Built-in task giving prompts, reward and base model: ``sentiment``, ``arithmetic``, ``calculator``, ``guess_number`` (these two played in an env: ``make_env``), ``imdb`` or ``math`` (the last two need the ``real`` extra)."""
    policy: str | None = None
    """Initial policy (and reference): a local HF folder or a zoo model name (``smollm2-135m``: fetched and converted on first use, docs/real_models.md); None = the task's base model (built or fetched if missing)."""
    chat_template: bool | None = None
    """Format every prompt (train and validation) as one user turn with the tokenizer's chat template (``apply_chat_template(..., add_generation_prompt=True)``) before tokenizing; None = what the task asks for (its ``CHAT`` flag: ``math`` yes, the others no)."""
    run_dir: str = "runs/default"
    """Where the run is written: config.yaml, metrics.jsonl, samples.jsonl, TensorBoard events, checkpoints/, final/. It must be new, empty or a run rlbits started (it holds ``.rlbits-run``); ``rlbits train --force`` reuses another folder."""
    seed: int = 0
    """Seeds data order, sampling and initialisation; the same seed reproduces a run exactly on one process."""
    max_num_steps: int = 100
    """Training steps (one rollout batch and its updates each)."""
    max_num_epochs: int = 1000
    """Passes over the training prompts; training stops at whichever limit comes first."""
    num_prompts_per_step: int = 16
    """Prompts sampled per step (each generates ``num_generations_per_prompt`` responses)."""
    num_generations_per_prompt: int = 1
    """Responses per prompt; groups of one prompt are contiguous (RLOO/GRPO need >= 2)."""
    max_new_tokens: int = 24
    """Longest response in tokens."""
    temperature: float = 1.0
    """Sampling temperature of rollouts, at least 1e-4 (``MIN_TEMPERATURE``: far smaller ones overflow ``logits / temperature`` in float32 and sampling breaks); behaviour logprobs are computed at it."""
    learning_rate: float = 1e-5
    """Adam learning rate of the policy."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (<= 0 disables it)."""
    microbatch_size: int = 16
    """Rows per forward/backward pass; gradients accumulate over microbatches."""
    val_period: int = 10
    """Validate every this many steps (0 disables periodic validation)."""
    val_at_start: bool = True
    """Validate before the first step (the base model's score)."""
    val_at_end: bool = True
    """Validate after the last step."""
    max_val_samples: int = 64
    """Prompts used by validation: the first this many of the test split (or of ``val_prompts``)."""
    val_greedy: bool = False
    """Validate with greedy decoding (True) or sampling at ``temperature`` (False)."""
    reward_model: str | None = None
    """Local folder of a reward model (an HF ``AutoModelForSequenceClassification`` with one label, such as the ``RUN_DIR/final`` of a ``reward_model`` run) that scores ``prompt + response`` instead of the task's reward (online loops; ILQL scores the offline set it builds with it). A ``reward`` given to ``rlbits.train``/``train()`` may not be combined with it. Recorded in ``provenance.json``."""
    val_prompts: str | None = None
    """Held-out validation prompts instead of the task's test split: ``split:NAME`` for another split of the task (``split:ood``: imdb's Rotten Tomatoes openings), or a path to a text file with one prompt per line, or to a ``.jsonl`` file of ``{"prompt": ...}`` objects (``rlbits.train(val_prompts=[...])`` and a loop's ``train(cfg, val_prompts=...)`` take a list and win over this key). Checked before any model is loaded; recorded in ``provenance.json``."""
    allow_changed_inputs: bool = False
    """Resume even when the reward, prompts, validation prompts or offline samples differ from those the run was started with (recorded in ``RUN_DIR/provenance.json``); without it such a resume is refused (``ResumeMismatchError``)."""
    save_period: int = 50
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep on disk (older ones are deleted)."""
    log_samples: int = 4
    """Decoded rollouts written to samples.jsonl per step."""
    tensorboard: bool = True
    """Write TensorBoard event files under run_dir."""
    wandb: bool = False
    """Also log to Weights & Biases (``wandb`` must be installed; set WANDB_MODE=offline to run without network)."""
    wandb_project: str = "rlbits"
    """W&B project name."""
    progress: bool = True
    """Show a tqdm progress bar with step, reward and KL."""
    device: str = "auto"
    """``auto`` (CUDA if available), ``cpu`` or ``cuda``."""
    cpu_threads: int = 1
    """torch intra-op threads on CPU (``torch.set_num_threads``), at most this machine's CPU count (``os.cpu_count()``); 0 keeps torch's default. Small models are fastest on 1 (PPO on the sentiment base: 1.0 s/step with 1 thread, 10.9 with 2 on a loaded 2-core machine)."""
    cpu_reuse_memory: bool = True
    """On CPU with glibc (Linux): keep freed memory in the process heap for reuse (``rlbits.loops.runtime.reuse_freed_memory``) instead of mapping fresh, zero-filled pages for every large tensor; each [B, R, V] logits tensor otherwise pays its page faults anew (at the standard benchmark's size about 8% of an RLOO step). The process then keeps its peak memory until it exits."""

    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16``: bfloat16 matmuls with fp32 master weights and optimizer states (``torch.autocast`` on one process; FSDP2 ``MixedPrecisionPolicy``, bf16 parameters and fp32 gradient reduction, under torchrun). Works on CPU and GPU."""
    compile: bool = False
    """``torch.compile`` the loss and advantage kernels (dynamic shapes: one compilation per kernel, not one per response length) and, on GPU, each transformer block. Compiled code is cached under ``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``), so later runs start faster."""
    compile_generate: bool = False
    """``torch.compile`` the rollout's decode step (``generate(compile=True)``: static KV cache, gpt-fast style) for GPT-2/Llama/Mistral/Qwen models (with ``precision: bf16`` it compiles the bfloat16 decoding copy); on a GPU the step is captured as a CUDA graph and replayed per token. The first rollout of each batch size compiles (about 30 s for SmolLM2-135M on an H100, a minute on 2 CPU cores; less with a warm inductor cache). Turn it on for GPU runs: decoding is launch-bound there (SmolLM2-135M GRPO on an H100: rollout 0.82 -> 0.15 s, step 0.92 -> 0.31 s; ``benchmarks/RESULTS.md``); on CPU the default eager decode with packed weights (``pack_decode_weights``) is faster than the compiled step, which keeps MKL's ``F.linear`` (SmolLM2-135M, 16 rows: 2.07 vs 2.81 s)."""
    pack_decode_weights: bool = True
    """On CPU, the rollout's eager decode runs its linear layers through oneDNN on a copy of the weights reordered once per rollout (``generate(pack_weights=...)``, ``rlbits.models.packed.packed_linears``): the same samples to float rounding, several times faster matmuls at decode batch sizes (SmolLM2-135M, 16 rows on 2 cores: decoding 3.2 -> 2.1 s; ``benchmarks/RESULTS.md`` 1c), one extra copy of the weights in memory during the rollout. ``false``: PyTorch's default ``F.linear``. Ignored on GPU and with ``compile_generate``."""
    logprob_head: Literal["auto", "fused", "unfused"] = "auto"
    """How the training and reference forwards apply the output layer (``rlbits.models.forward.policy_logprobs``): ``fused`` never holds a microbatch's [b, R, V] logits (chunked, one more matmul), ``unfused`` uses ``F.linear`` (faster where the logits fit), ``auto`` picks ``unfused`` when 3 copies of a microbatch's float32 logits fit ``head_memory_budget_mb``."""
    head_memory_budget_mb: float = 1024.0
    """MiB the unfused output layer may use per microbatch under ``logprob_head: auto``."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf reward, loss or gradient: ``stop`` raises (naming step, phase and samples; the last checkpoint stays the newest); ``skip`` drops the rest of that step's update (logging ``skipped_step``) and goes on. Rewards that raise or come back with the wrong count always stop."""
    checkpoint_checksums: Literal["small", "all"] = "small"
    """What a checkpoint's manifest checksums: ``small`` (sha256 of files under 1 MiB: state, RNG states, metadata, tokenizer; sizes of all files: a flipped byte in the weights is caught only if it makes a weight NaN/inf or breaks a zip structure) or ``all`` (sha256 of every file, the weights in 16 MiB chunks hashed in parallel threads: a flipped byte anywhere is caught on resume, which falls back to the previous checkpoint; it adds 13-33% to loading a checkpoint on 2 cores, docs/reliability.md)."""
    checkpoint_hf_folders: bool = False
    """Also write each model as an HF folder (``from_pretrained``) inside every checkpoint, for inspection (one process only). Training state always lives in ``dcp/``; ``final/`` is always an HF folder."""
    collective_timeout_s: float = 600.0
    """Under torchrun: seconds a collective (all-reduce, FSDP all-gather, barrier) may wait for the other ranks before the run fails with ``CollectiveError`` naming the step and phase (ranks that disagree about a collective, or a rank that died). Passed to ``init_process_group``; on gloo the waiting call raises, on NCCL the process-group watchdog aborts the process. Make it longer than the slowest phase one rank may spend alone (a validation of many prompts, a checkpoint save to a slow disk)."""
    stop_grace_s: float = 10.0
    """Under torchrun: after SIGTERM or SIGINT, seconds the current step (or the next, if the signal came between steps) has to end and save its checkpoint; past it (a rank blocked in a collective, or a step longer than this) the process exits at once with a message naming the step and phase and without a checkpoint (the newest one stays). 0: no bound, wait for the step as on one process. torchrun itself sends SIGKILL about 30 s after its SIGTERM, so a step that needs longer is lost either way."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of storing them (less memory, ~1/3 more compute)."""

    lora_rank: int = 0
    """LoRA rank r (``rlbits.models.lora``, peft): > 0 trains low-rank adapters on the policy (and on the PPO critic's backbone; the value and ILQL heads stay fully trained) with every other weight frozen; the reference policy is the policy with its adapters disabled, so it costs no second model; ``final/`` has the adapters merged (a plain HF folder). 0 = full fine-tuning."""
    lora_alpha: float | None = None
    """LoRA scale numerator: adapters add ``(lora_alpha / lora_rank) B A x``. None = ``2 * lora_rank``, a scale of 2 at every rank (the common r = 8 / alpha = 16 pair), so changing the rank does not also change the adapters' effective learning rate."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input during the update, in [0, 1) (sampling runs without it, so > 0 makes the first ratio differ from 1)."""
    lora_target_modules: list[str] | str | None = None
    """Layers that get adapters: a list of module names (``[q_proj, v_proj]``; GPT-2: ``c_attn``, ``c_proj``, ``c_fc``, its ``Conv1D`` layers handled with peft's ``fan_in_fan_out``), a regex over module paths, or None = ``all-linear`` (every linear layer of the attention and MLP blocks, not the output layer)."""

    env_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Multi-turn tasks (a task module with ``make_env``): keyword options passed to ``make_env(prompt, **env_options)`` for every episode (e.g. ``{max_turns: 4}``). Ignored by single-turn tasks."""
    sandbox: Literal["bwrap", "unsafe_local"] = "bwrap"
    """Multi-turn tasks whose ``make_env`` takes a ``sandbox`` keyword (tools that run code, e.g. ``rlbits.envs.python_tool``): where that code runs, passed as ``make_env(prompt, sandbox=...)``. ``bwrap``: isolated by the operating system through bubblewrap (docs/reliability.md); without a working ``bwrap`` the run stops with an error saying how to install it (``apt-get install bubblewrap``). ``unsafe_local``: a plain subprocess under rlimits and an audit hook, not a security boundary (trusted code only)."""
    max_episode_tokens: int | None = None
    """Multi-turn tasks: most tokens an episode (prompt + every turn and observation) may hold; an episode that would exceed it ends with ``stop_reason`` ``context``. None = the model's context length."""
    turn_reward: Literal["token", "sequence"] = "token"
    """Multi-turn tasks, PPO: ``token`` puts each turn's reward on the last action token of that turn (``turn_rewards``; GAE credits turns separately), ``sequence`` puts the episode's summed reward on its last action token. REINFORCE/GRPO/RLOO always use the sum."""
    max_env_workers: int = 8
    """Multi-turn tasks: most env steps (tool calls) running at once in a rollout."""
    env_timeout_s: float = 60.0
    """Multi-turn tasks: wall-clock seconds one env step may take; a step past it ends its episode with ``stop_reason`` ``env_timeout`` (the rest of the batch goes on)."""

    def check(self) -> None:
        """Range checks shared by all loops; loops extend this. Raises ConfigError.

        (In rlbits "validate" means one thing: the reward on held-out prompts, a loop's ``validate`` phase.)"""
        positive = ("max_num_steps", "max_num_epochs", "num_prompts_per_step", "num_generations_per_prompt",
                    "max_new_tokens", "microbatch_size", "max_val_samples", "keep_checkpoints")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {show(getattr(self, name))} ({field_docs(type(self))[name]})")
        for name in ("val_period", "save_period", "log_samples", "cpu_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {show(getattr(self, name))}")
        self._check_run_dir()
        self._check_sizes()
        if not 0 <= self.seed < 2**53:
            raise ConfigError(f"seed must be in [0, 2**53), got {self.seed} (seeds torch generators, which take 64 bits)")
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # a Literal field holds one of its values, also when built directly
            if typing.get_origin(hints[f.name]) is Literal and getattr(self, f.name) not in typing.get_args(hints[f.name]):
                allowed = ", ".join(map(repr, typing.get_args(hints[f.name])))
                raise ConfigError(f"{f.name} must be one of {allowed}; got {show(getattr(self, f.name))}")
        for f in dataclasses.fields(self):  # no float field may be NaN; only max_grad_norm may be inf
            value = getattr(self, f.name)
            if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and f.name != "max_grad_norm")):
                raise ConfigError(f"{f.name} must be a finite number, got {value} ({field_docs(type(self)).get(f.name, '')})")
            if isinstance(value, float) and value < 0 and f.name in NON_NEGATIVE:
                raise ConfigError(f"{f.name} must be >= 0, got {value}")
        if not self.temperature >= MIN_TEMPERATURE:
            raise ConfigError(
                f"temperature must be >= {MIN_TEMPERATURE:g}, got {self.temperature:g} "
                f"({field_docs(type(self))['temperature']})"
            )
        if not isinstance(self.env_options, dict) or not all(isinstance(k, str) for k in self.env_options):
            raise ConfigError(f"env_options must be a mapping of option names to values, got {show(self.env_options)}")
        if "sandbox" in self.env_options:
            raise ConfigError("env_options must not set sandbox: use the top-level sandbox field (bwrap or unsafe_local)")
        if self.max_episode_tokens is not None and self.max_episode_tokens < 2:
            raise ConfigError(f"max_episode_tokens must be >= 2 or null, got {self.max_episode_tokens} ({field_docs(type(self))['max_episode_tokens']})")
        if self.max_env_workers < 1:
            raise ConfigError(f"max_env_workers must be >= 1, got {self.max_env_workers} ({field_docs(type(self))['max_env_workers']})")
        if not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s} ({field_docs(type(self))['collective_timeout_s']})")
        if not self.stop_grace_s >= 0:
            raise ConfigError(f"stop_grace_s must be >= 0, got {self.stop_grace_s} ({field_docs(type(self))['stop_grace_s']})")
        if not self.env_timeout_s > 0:
            raise ConfigError(f"env_timeout_s must be > 0, got {self.env_timeout_s} ({field_docs(type(self))['env_timeout_s']})")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.loop not in ("ppo", "reinforce", "ilql", "reward_model"):
            raise ConfigError(f"loop must be one of ppo, reinforce, ilql, reward_model; got {show(self.loop)}")
        self._check_lora()
        if self.reward_model is not None and not Path(self.reward_model).expanduser().is_dir():
            raise ConfigError(
                f"reward_model must be a folder holding an HF sequence-classification model, got {show(self.reward_model)} "
                f"({field_docs(type(self))['reward_model']})"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {show(self.device)}")

    def _check_sizes(self) -> None:
        """Sizes that allocate stay within ``size_limits`` and ``cpu_threads`` within this machine's CPUs."""
        docs = field_docs(type(self))
        for name, limit in size_limits(type(self)).items():
            value = getattr(self, name)
            if value is not None and value > limit:
                raise ConfigError(f"{name} must be <= {limit}, got {show(value)} ({docs.get(name, '')})")
        if self.rollout_batch_size > MAX_ROWS:
            raise ConfigError(
                f"num_prompts_per_step * num_generations_per_prompt must be <= {MAX_ROWS} responses per step, "
                f"got {self.num_prompts_per_step} * {self.num_generations_per_prompt} = {self.rollout_batch_size}"
            )
        cpus = os.cpu_count() or 1
        if self.cpu_threads > cpus:
            raise ConfigError(
                f"cpu_threads must be <= {cpus} (this machine's CPU count), got {show(self.cpu_threads)}; "
                "0 keeps torch's default"
            )

    def _check_run_dir(self) -> None:
        """``run_dir`` names a folder: not empty (that would be the current folder) and not the root. Whether
        the folder may hold the run is decided when it starts (``rlbits.loops.rundir.check_run_dir``)."""
        run_dir = self.run_dir
        if not isinstance(run_dir, str) or not run_dir.strip() or "\0" in run_dir:
            raise ConfigError(
                f"run_dir must name a folder for the run (e.g. runs/NAME), got {run_dir!r}; an empty run_dir "
                "would write the run into the current folder"
            )
        resolved = Path(run_dir).resolve()
        if resolved == Path(resolved.anchor):
            raise ConfigError(f"run_dir must not be the file-system root, got {run_dir!r}; e.g. run_dir=runs/NAME")

    def _check_lora(self) -> None:
        docs = field_docs(type(self))
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(f"lora_alpha must be > 0 or null (2 * lora_rank), got {self.lora_alpha} ({docs['lora_alpha']})")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        targets = self.lora_target_modules
        if isinstance(targets, str):
            if not targets.strip():
                raise ConfigError("lora_target_modules must be a module name, a list of names, a regex or null; got ''")
        elif targets is not None:
            if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t.strip() for t in targets):
                raise ConfigError(
                    f"lora_target_modules must be a non-empty list of module names (strings), a regex or null; "
                    f"got {show(targets)} ({docs['lora_target_modules']})"
                )

    @property
    def lora(self) -> bool:
        """Whether the run trains LoRA adapters (``lora_rank > 0``) instead of every weight."""
        return self.lora_rank > 0

    def validate(self) -> None:
        """Deprecated name of ``check``."""
        import warnings

        warnings.warn("RunConfig.validate() is renamed check()", DeprecationWarning, stacklevel=2)
        self.check()

    def resolve_reward(self, reward: Any) -> Any:
        """The reward a loop scores with: ``reward`` (the argument of ``train``), else ``reward_model`` (a
        folder; ``rlbits.score`` loads it), else None (the task's reward).

        Raises:
            ConfigError: both ``reward`` and the ``reward_model`` key are given.
        """
        if self.reward_model is None:
            return reward
        if reward is not None:
            raise ConfigError(
                f"a reward was passed to train() and the config sets reward_model={show(self.reward_model)}; give one of them"
            )
        return str(Path(self.reward_model).expanduser())

    @property
    def rollout_batch_size(self) -> int:
        """Responses per step: ``num_prompts_per_step * num_generations_per_prompt``."""
        return self.num_prompts_per_step * self.num_generations_per_prompt


def size_limits(cls: type) -> dict[str, int]:
    """Field -> the largest value ``check`` accepts, for ``cls`` and its bases (``SIZE_LIMITS``)."""
    out: dict[str, int] = {}
    for klass in reversed(cls.__mro__):
        out.update(getattr(klass, "SIZE_LIMITS", {}))
    return out


def check_ranges(
    cfg: RunConfig,
    *,
    at_least_one: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
    positive: tuple[str, ...] = (),
    positive_or_none: tuple[str, ...] = (),
    unit_interval: tuple[str, ...] = (),
) -> None:
    """Range checks of a config's fields by name, for the loops' ``check``: ``at_least_one`` (ints >= 1),
    ``non_negative`` (>= 0), ``positive`` (> 0), ``positive_or_none`` (> 0 or None), ``unit_interval`` (in
    [0, 1], None allowed). Raises ConfigError naming the first bad field, its value and its docstring."""
    docs = field_docs(type(cfg))
    rules = (
        (at_least_one, lambda v: v >= 1, ">= 1"),
        (non_negative, lambda v: v >= 0, ">= 0"),
        (positive, lambda v: v > 0, "> 0"),
        (positive_or_none, lambda v: v is None or v > 0, "> 0 or null"),
        (unit_interval, lambda v: v is None or 0 <= v <= 1, "in [0, 1]"),
    )
    for names, ok, what in rules:
        for name in names:
            value = getattr(cfg, name)
            if not ok(value):
                doc = docs.get(name, "")
                raise ConfigError(f"{name} must be {what}, got {show(value)}" + (f" ({doc})" if doc else ""))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it, for ``cls`` and its dataclass bases (read from the
    source once per class; do not modify the dict returned)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(cls: type, name: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (int, float, bool, str, X | None, Literal[...])."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(cls, name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {show(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {show(value)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{name} must be a float; {show(value)} is too large for one") from None
        if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    else:
        return value
    doc = field_docs(cls).get(name, "")
    raise ConfigError(
        f"{name} must be {_type_name(tp)}, got {show(value)} ({type(value).__name__})" + (f": {doc}" if doc else "")
    )


def renamed_keys(cls: type) -> dict[str, str]:
    """Old config key -> new field name, for ``cls`` and its bases (``RENAMED`` class attributes)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update(getattr(klass, "RENAMED", {}))
    return out


def config_from_dict(cls: type[C], values: dict[str, Any]) -> C:
    """Build and validate a ``cls`` from a dict, rejecting unknown keys and ill-typed values. A key a
    release renamed (``RENAMED``) is read as its new name, with a DeprecationWarning."""
    import warnings

    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    renamed = renamed_keys(cls)
    kwargs = {}
    for key, value in list(values.items()):
        if isinstance(key, str) and key in renamed and key not in fields:
            new = renamed[key]
            if new in values:
                raise ConfigError(f"config key {show(key)} is the old name of {new!r}; give only {new!r}")
            warnings.warn(f"config key {key!r} is renamed {new!r}", DeprecationWarning, stacklevel=2)
            values = {**{k: v for k, v in values.items() if k != key}, new: value}
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"config key {show(key)} is a {type(key).__name__}; keys are field names (valid keys: {', '.join(fields)})")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {show(key)} for {cls.__name__}{hint} (valid keys: {', '.join(fields)})")
        kwargs[key] = _coerce(cls, key, value, hints[key])
    cfg = cls(**kwargs)
    cfg.check()
    return cfg


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict, each value parsed as YAML (``lr=1e-5``, ``wandb=true``,
    ``policy=null``) by the loader of config files (``load_yaml``: merge keys, bounded aliases, no duplicate
    keys)."""
    out = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {show(item)} is not of the form key=value")
        try:
            out[key.strip()] = load_yaml(raw) if raw.strip() else ""
        except ConfigError as e:
            raise ConfigError(f"override {show(key.strip())}: {e}") from None
        except Exception as e:  # PyYAML also raises RecursionError, ValueError, ... on odd input
            why = f"{type(e).__name__}: {str(e)[:_MAX_YAML_ERROR]}"
            raise ConfigError(f"override {show(item)}: value is not valid YAML ({why})") from e
    return out


MAX_ALIAS_NODES = 10_000
"""Most YAML nodes that aliases (``*name``) may add to a config when expanded: anchors reused a few times
fit easily, while nine levels of nine aliases each (a 400-byte "billion laughs") would stand for 10^9."""
_MAX_YAML_ERROR = 600  # characters of PyYAML's own message (it quotes the offending line)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` for config files and overrides: it rejects a key given twice in one mapping (YAML
    keeps the last one silently), an alias that refers to a node containing it, and aliases that expand to
    more than ``MAX_ALIAS_NODES`` nodes; merge keys (``<<: *base``) work as in ``SafeLoader``.

    Aliases are counted while the document is composed, before anything is built: each node counts 1 and
    each alias the expanded size of the node it names."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._expanded = 0  # nodes composed so far, with every alias counted at its expanded size
        self._alias_nodes = 0  # of those, the nodes that aliases stand for
        self._anchor_sizes: dict[str, int] = {}  # anchor -> expanded size of its node, once composed

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self.anchors:  # an undefined one is left to SafeLoader's own error
                line = event.start_mark.line + 1
                size = self._anchor_sizes.get(event.anchor)
                if size is None:
                    raise ConfigError(
                        f"alias *{event.anchor[:40]} on line {line} is inside the node it names (a recursive "
                        "structure); a config holds plain values"
                    )
                self._expanded += size
                self._alias_nodes += size
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise ConfigError(
                        f"aliases expand to more than {MAX_ALIAS_NODES} YAML nodes (at *{event.anchor[:40]}, "
                        f"line {line}); write the values out instead of nesting aliases"
                    )
            return super().compose_node(parent, index)
        anchor = self.peek_event().anchor
        start = self._expanded
        self._expanded += 1
        node = super().compose_node(parent, index)
        if anchor is not None:
            self._anchor_sizes[anchor] = self._expanded - start
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen = set()
        for key_node, _ in node.value:
            # Merged keys may repeat the mapping's own (those win); only plain scalar keys are compared.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            if duplicate:
                raise ConfigError(f"key {show(key)} is given twice (line {key_node.start_mark.line + 1})")
        return node


def load_yaml(text: str) -> Any:
    """Parse one YAML document of a config (a file's text or an override's value) with plain values only
    (``yaml.SafeLoader``; merge keys allowed; a key given twice, a recursive alias or aliases expanding to
    more than ``MAX_ALIAS_NODES`` nodes refused).

    Raises:
        ConfigError: a key given twice, a recursive alias, too many aliased nodes.
        yaml.YAMLError (and RecursionError, ValueError on odd input): text that is not valid YAML.
    """
    return yaml.load(text, Loader=_ConfigLoader)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config YAML file into a dict (empty file -> {}) with ``load_yaml``. Raises ConfigError naming
    the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = load_yaml(path.read_text()) or {}
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except Exception as e:  # PyYAML also raises RecursionError, ValueError, ... on odd input
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {type(e).__name__}: {str(e)[:_MAX_YAML_ERROR]}"
        ) from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of key: value, got {type(data).__name__}")
    return data


def load_config(cls: type[C], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """YAML file (optional) + ``key=value`` overrides -> a validated, frozen ``cls``."""
    values = read_yaml(path) if path is not None else {}
    values.update(parse_overrides(list(overrides)))
    return config_from_dict(cls, values)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write ``cfg`` as YAML (every field, defaults included, so the file alone reproduces the run)."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
