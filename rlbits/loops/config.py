"""Loop configs: frozen dataclasses made of field groups, built from YAML and ``key=value`` overrides.

``RunConfig`` holds the fields every loop reads. Groups add the fields some loops read: ``PolicyConfig`` (a
causal-LM policy trained on a task), ``OnlineConfig`` (rollouts sampled at every step), ``LoRAConfig``
(adapters) and ``EnvConfig`` (multi-turn environments). Each loop's config (``PPOConfig`` in ``ppo.py``, ...)
inherits the groups it uses and adds its own fields, so a key that a loop does not read is refused, naming
the loop. ``LOOPS`` lists the loops.

Every field has a docstring (a string literal under it, as in cleanrl) that errors and ``rlbits train
--help-config`` quote; a numeric field declares its range with it (``ranged``; ``rlbits.loops.config_fields``).
A config is checked when it is built (``__post_init__``; ``dataclasses.replace`` checks again): types, ranges
and the rules across fields, raising ``ConfigError`` that names the field, its value and its docstring. YAML
text is read by ``rlbits.loops.config_yaml``. Field names follow NeMo-RL where one exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from rlbits.loops.config_fields import check_fields, field_docs, ranged
from rlbits.loops.config_yaml import ConfigError, parse_overrides, read_yaml, show

C = TypeVar("C", bound="RunConfig")

LOOPS: dict[str, tuple[str, str]] = {
    "ppo": ("rlbits.loops.ppo", "PPOConfig"),
    "reinforce": ("rlbits.loops.reinforce", "ReinforceConfig"),
    "ilql": ("rlbits.loops.ilql", "ILQLConfig"),
    "reward_model": ("rlbits.loops.reward_model", "RewardModelConfig"),
    "preference": ("rlbits.loops.preference", "PreferenceConfig"),
}
"""Every loop: its name (a config's ``loop``) -> (its module, its config class). ``rlbits.loops.api`` imports
a loop's module from here."""

MIN_TEMPERATURE = 1e-4
"""Smallest sampling temperature a config accepts: ``logits / temperature`` must stay finite in float32
(at 1e-38 it overflows and sampling yields NaN); below 1e-4 sampling is greedy in all but name."""

MAX_ROWS = 2**20
"""Most rows (prompts, responses, samples) a size field may ask for per step or batch: no run needs more,
and a larger value fails deep in an allocation (or is killed by the kernel) instead of here."""
MAX_TOKENS = 2**20
"""Most tokens a length field (``max_new_tokens``, ``max_episode_tokens``, ...) may ask for."""


# --------------------------------------------------------------------------------------------------------
# The shared fields and the groups
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Shared by every loop: where the run is written, how long it trains, the optimizer's shared settings,
    validation, checkpoints, logging and the process."""

    loop: str = "ppo"
    """Which loop runs this config: a key of ``LOOPS``."""
    run_dir: str = "runs/default"
    """Where the run is written: config.yaml, metrics.jsonl, samples.jsonl, TensorBoard events, checkpoints/,
    final/. It must be new, empty or a run rlbits started (it holds ``.rlbits-run``); ``rlbits train --force``
    reuses another folder."""
    seed: int = ranged(0, ge=0, lt=2**53)
    """Seeds data order, sampling and initialisation; the same seed reproduces a run exactly on one process.
    Below 2**53: torch generators take 64 bits."""
    max_num_steps: int = ranged(100, ge=1)
    """Training steps (one batch and its updates each)."""
    max_num_epochs: int = ranged(1000, ge=1)
    """Passes over the training data; training stops at whichever limit comes first."""
    learning_rate: float = ranged(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = ranged(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = ranged(1.0, finite=False)
    """Gradient clipping by global norm (<= 0 disables it)."""
    microbatch_size: int = ranged(16, ge=1, at_most=MAX_ROWS)
    """Rows per forward/backward pass; gradients accumulate over microbatches."""
    val_period: int = ranged(10, ge=0)
    """Validate every this many steps (0 disables periodic validation)."""
    val_at_start: bool = True
    """Validate before the first step (the initial model's score)."""
    val_at_end: bool = True
    """Validate after the last step."""
    max_val_samples: int = ranged(64, ge=1, at_most=MAX_ROWS)
    """Validation rows: the first this many of the validation set."""
    allow_changed_inputs: bool = False
    """Resume even when the reward, prompts, validation prompts or offline samples differ from those the run
    was started with (recorded in ``RUN_DIR/provenance.json``); without it such a resume is refused
    (``ResumeMismatchError``)."""
    save_period: int = ranged(50, ge=0)
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = ranged(2, ge=1)
    """How many step checkpoints to keep on disk (older ones are deleted)."""
    log_samples: int = ranged(4, ge=0, at_most=MAX_ROWS)
    """Decoded samples written to samples.jsonl per step (loops that generate text)."""
    tensorboard: bool = True
    """Write TensorBoard event files under run_dir."""
    wandb: bool = False
    """Also log to Weights & Biases (``wandb`` must be installed; set WANDB_MODE=offline to run without
    network)."""
    wandb_project: str = "rlbits"
    """W&B project name."""
    progress: bool = True
    """Show a tqdm progress bar with step, reward and KL."""
    device: str = "auto"
    """``auto`` (CUDA if available), ``cpu`` or ``cuda``."""
    cpu_threads: int = ranged(1, ge=0)
    """torch intra-op threads on CPU (``torch.set_num_threads``), at most this machine's CPU count
    (``os.cpu_count()``); 0 keeps torch's default. Small models are fastest on 1 (docs/benchmarks.md)."""
    cpu_reuse_memory: bool = True
    """On CPU with glibc (Linux): keep freed memory in the process heap for reuse
    (``rlbits.loops.runtime.reuse_freed_memory``) instead of mapping fresh, zero-filled pages for every large
    tensor (such as each [B, R, V] logits tensor; docs/benchmarks.md). The process then keeps its peak memory
    until it exits."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16``: bfloat16 matmuls with fp32 master weights and optimizer states (``torch.autocast`` on one
    process; FSDP2 ``MixedPrecisionPolicy``, bf16 parameters and fp32 gradient reduction, under torchrun).
    Works on CPU and GPU."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf reward, loss or gradient: ``stop`` raises (naming step, phase and samples; the last
    checkpoint stays the newest); ``skip`` drops the rest of that step's update (logging ``skipped_step``) and
    goes on. Rewards that raise or come back with the wrong count always stop."""
    checkpoint_checksums: Literal["small", "all"] = "small"
    """What a checkpoint's manifest checksums: ``small`` (sha256 of files under 1 MiB: state, RNG states,
    metadata, tokenizer; sizes of all files: a flipped byte in the weights is caught only if it makes a weight
    NaN/inf or breaks a zip structure) or ``all`` (sha256 of every file, the weights in 16 MiB chunks hashed
    in parallel threads: a flipped byte anywhere is caught on resume, which falls back to the previous
    checkpoint; loading takes longer, docs/benchmarks.md)."""
    checkpoint_hf_folders: bool = False
    """Also write each model as an HF folder (``from_pretrained``) inside every checkpoint, for inspection
    (one process only). Training state always lives in ``dcp/``; ``final/`` is always an HF folder."""
    collective_timeout_s: float = ranged(600.0, gt=0)
    """Under torchrun: seconds a collective (all-reduce, FSDP all-gather, barrier) may wait for the other
    ranks before the run fails with ``CollectiveError`` naming the step and phase (ranks that disagree about a
    collective, or a rank that died). Passed to ``init_process_group``; on gloo the waiting call raises, on
    NCCL the process-group watchdog aborts the process. Make it longer than the slowest phase one rank may
    spend alone (a validation of many prompts, a checkpoint save to a slow disk)."""
    stop_grace_s: float = ranged(10.0, ge=0)
    """Under torchrun: after SIGTERM or SIGINT, seconds the current step (or the next, if the signal came
    between steps) has to end and save its checkpoint; past it (a rank blocked in a collective, or a step
    longer than this) the process exits at once with a message naming the step and phase and without a
    checkpoint (the newest one stays). 0: no bound, wait for the step as on one process. torchrun itself sends
    SIGKILL about 30 s after its SIGTERM, so a step that needs longer is lost either way."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check every field: its type (an int given for a float field is stored as a float), its range
        (``ranged``) and the rules across fields that each group and loop adds. Run when the config is built;
        a group or loop extends it (``super().check()`` first).

        Raises:
            ConfigError: naming the first bad field, its value and what is allowed.
        """
        check_fields(self)
        if self.loop not in LOOPS:
            raise ConfigError(f"loop must be one of {', '.join(LOOPS)}; got {show(self.loop)}")
        own = loop_of(type(self))
        if own is not None and self.loop != own:
            raise ConfigError(f"loop must be {own!r} for {type(self).__name__}, got {self.loop!r}")
        self._check_run_dir()
        cpus = os.cpu_count() or 1
        if self.cpu_threads > cpus:
            raise ConfigError(
                f"cpu_threads must be <= {cpus} (this machine's CPU count), got {show(self.cpu_threads)}; "
                "0 keeps torch's default"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {show(self.device)}")

    def _check_run_dir(self) -> None:
        """``run_dir`` names a folder: not empty (that would be the current folder) and not the root. Whether
        the folder may hold the run is decided when it starts (``rlbits.loops.rundir.check_run_dir``)."""
        run_dir = self.run_dir
        if not run_dir.strip() or "\0" in run_dir:
            raise ConfigError(
                f"run_dir must name a folder for the run (e.g. runs/NAME), got {run_dir!r}; an empty run_dir "
                "would write the run into the current folder"
            )
        resolved = Path(run_dir).resolve()
        if resolved == Path(resolved.anchor):
            raise ConfigError(
                f"run_dir must not be the file-system root, got {run_dir!r}; e.g. run_dir=runs/NAME"
            )


@dataclasses.dataclass(frozen=True)
class PolicyConfig(RunConfig):
    """A causal-LM policy trained on a task: the task, the initial policy, sampling, validation prompts and
    the training forward (the ppo, reinforce and ilql loops)."""

    task: str = "sentiment"
    """Built-in task giving prompts, reward and base model: ``sentiment``, ``arithmetic``, ``calculator``,
    ``guess_number`` (these two played in an env: ``make_env``), ``imdb`` or ``math`` (the last two need the
    ``real`` extra)."""
    policy: str | None = None
    """Initial policy (and reference): a local HF folder or a zoo model name (``smollm2-135m``: fetched and
    converted on first use, docs/real_models.md); None = the task's base model (built or fetched if
    missing)."""
    chat_template: bool | None = None
    """Format every prompt (train and validation) as one user turn with the tokenizer's chat template
    (``apply_chat_template(..., add_generation_prompt=True)``) before tokenizing; None = what the task asks
    for (its ``CHAT`` flag: ``math`` yes, the others no)."""
    reward_model: str | None = None
    """Local folder of a reward model (an HF ``AutoModelForSequenceClassification`` with one label, such as
    the ``RUN_DIR/final`` of a ``reward_model`` run) that scores ``prompt + response`` instead of the task's
    reward (online loops; ILQL scores the offline set it builds with it). A ``reward`` given to
    ``rlbits.train``/``train()`` may not be combined with it. Recorded in ``provenance.json``."""
    val_prompts: str | None = None
    """Held-out validation prompts instead of the task's test split: ``split:NAME`` for another split of the
    task (``split:ood``: imdb's Rotten Tomatoes openings), or a path to a text file with one prompt per line,
    or to a ``.jsonl`` file of ``{"prompt": ...}`` objects (``rlbits.train(val_prompts=[...])`` and a loop's
    ``train(cfg, val_prompts=...)`` take a list and win over this key). Checked before any model is loaded;
    recorded in ``provenance.json``."""
    val_greedy: bool = False
    """Validate with greedy decoding (True) or sampling at ``temperature`` (False)."""
    max_new_tokens: int = ranged(24, ge=1, at_most=MAX_TOKENS)
    """Longest response in tokens."""
    temperature: float = ranged(1.0, ge=MIN_TEMPERATURE)
    """Sampling temperature of rollouts and validation, at least ``MIN_TEMPERATURE`` (1e-4: far smaller ones
    overflow ``logits / temperature`` in float32 and sampling breaks); behaviour logprobs are computed at
    it."""
    compile: bool = False
    """``torch.compile`` the loss and advantage kernels (dynamic shapes: one compilation per kernel, not one
    per response length) and, on GPU, each transformer block. Compiled code is cached under
    ``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``), so later runs start faster."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of storing them: less memory, one
    more forward pass of each block."""

    def check(self) -> None:
        super().check()
        if self.reward_model is not None and not Path(self.reward_model).expanduser().is_dir():
            raise ConfigError(
                f"reward_model must be a folder holding an HF sequence-classification model, got "
                f"{show(self.reward_model)} ({field_docs(type(self))['reward_model']})"
            )

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
                f"a reward was passed to train() and the config sets reward_model={show(self.reward_model)}; "
                "give one of them"
            )
        return str(Path(self.reward_model).expanduser())


@dataclasses.dataclass(frozen=True)
class OnlineConfig(PolicyConfig):
    """Online loops: prompts and samples per step, how rollouts decode, how the logprob forwards apply the
    output layer (the ppo and reinforce loops)."""

    num_prompts_per_step: int = ranged(16, ge=1, at_most=MAX_ROWS)
    """Prompts sampled per step (each generates ``num_generations_per_prompt`` responses)."""
    num_generations_per_prompt: int = ranged(1, ge=1, at_most=MAX_ROWS)
    """Responses per prompt; groups of one prompt are contiguous (RLOO/GRPO need >= 2)."""
    compile_generate: bool = False
    """``torch.compile`` the rollout's decode step (``generate(compile=True)``: static KV cache, gpt-fast
    style) for GPT-2/Llama/Mistral/Qwen models (with ``precision: bf16`` it compiles the bfloat16 decoding
    copy); on a GPU the step is captured as a CUDA graph and replayed per token. The first rollout of each
    batch size compiles (less with a warm inductor cache). Turn it on for GPU runs, where decoding is
    launch-bound; on CPU the default eager decode with packed weights (``pack_decode_weights``) is faster than
    the compiled step (docs/benchmarks.md)."""
    pack_decode_weights: bool = True
    """On CPU, the rollout's eager decode runs its linear layers through oneDNN on a copy of the weights
    reordered once per rollout (``generate(pack_weights=...)``, ``rlbits.models.packed.packed_linears``): the
    same samples to float rounding, faster matmuls at decode batch sizes (docs/benchmarks.md), one extra copy
    of the weights in memory during the rollout. ``false``: PyTorch's default ``F.linear``. Ignored on GPU and
    with ``compile_generate``."""
    logprob_head: Literal["auto", "fused", "unfused"] = "auto"
    """How the training and reference forwards apply the output layer
    (``rlbits.models.forward.policy_logprobs``): ``fused`` never holds a microbatch's [b, R, V] logits
    (chunked, one more matmul), ``unfused`` uses ``F.linear`` (faster where the logits fit), ``auto`` picks
    ``unfused`` when 3 copies of a microbatch's float32 logits fit ``head_memory_budget_mb``."""
    head_memory_budget_mb: float = ranged(1024.0, ge=0)
    """MiB the unfused output layer may use per microbatch under ``logprob_head: auto``."""

    def check(self) -> None:
        super().check()
        samples = self.num_prompts_per_step * self.num_generations_per_prompt
        if samples > MAX_ROWS:
            raise ConfigError(
                f"num_prompts_per_step * num_generations_per_prompt must be <= {MAX_ROWS} responses per step, "
                f"got {self.num_prompts_per_step} * {self.num_generations_per_prompt} = {samples}"
            )


@dataclasses.dataclass(frozen=True)
class LoRAConfig(PolicyConfig):
    """LoRA adapters on the policy instead of training every weight (the ppo, reinforce and ilql loops)."""

    lora_rank: int = ranged(0, ge=0, at_most=2**16)
    """LoRA rank r (``rlbits.models.lora``, peft): > 0 trains low-rank adapters on the policy (and on the PPO
    critic's backbone; the value and ILQL heads stay fully trained) with every other weight frozen; the
    reference policy is the policy with its adapters disabled, so it costs no second model; ``final/`` has the
    adapters merged (a plain HF folder). 0 = full fine-tuning."""
    lora_alpha: float | None = ranged(None, gt=0)
    """LoRA scale numerator: adapters add ``(lora_alpha / lora_rank) B A x``. None = ``2 * lora_rank``, a
    scale of 2 at every rank (the common r = 8 / alpha = 16 pair), so changing the rank does not also change
    the adapters' effective learning rate."""
    lora_dropout: float = ranged(0.0, ge=0, lt=1)
    """Dropout on the adapters' input during the update, in [0, 1) (sampling runs without it, so > 0 makes the
    first ratio differ from 1)."""
    lora_target_modules: list[str] | str | None = None
    """Layers that get adapters: a list of module names (``[q_proj, v_proj]``; GPT-2: ``c_attn``, ``c_proj``,
    ``c_fc``, its ``Conv1D`` layers handled with peft's ``fan_in_fan_out``), a regex over module paths, or
    None = ``all-linear`` (every linear layer of the attention and MLP blocks, not the output layer)."""

    def check(self) -> None:
        super().check()
        targets = self.lora_target_modules
        if isinstance(targets, str):
            if not targets.strip():
                raise ConfigError(
                    "lora_target_modules must be a module name, a list of names, a regex or null; got ''"
                )
        elif targets is not None:
            if (
                not isinstance(targets, list)
                or not targets
                or not all(isinstance(t, str) and t.strip() for t in targets)
            ):
                raise ConfigError(
                    f"lora_target_modules must be a non-empty list of module names (strings), a regex or null; "
                    f"got {show(targets)} ({field_docs(type(self))['lora_target_modules']})"
                )

    @property
    def lora(self) -> bool:
        """Whether the run trains LoRA adapters (``lora_rank > 0``) instead of every weight."""
        return self.lora_rank > 0


@dataclasses.dataclass(frozen=True)
class PolicyGradientConfig(OnlineConfig):
    """A policy-gradient update against a frozen reference policy: the clip range, the per-token KL estimate,
    the loss aggregation (the ppo and reinforce loops)."""

    learning_rate: float = 1e-5
    """AdamW learning rate of the policy."""
    num_minibatches: int = ranged(1, ge=1, at_most=MAX_ROWS)
    """Optimizer steps per pass over a rollout batch: the batch is shuffled (whole prompt groups, seeded) and
    dealt into this many minibatches (at most ``num_prompts_per_step``)."""
    clip_eps: float = ranged(0.2, ge=0)
    """Lower clip range of the importance ratio (and upper, unless ``clip_eps_high``): ratios outside
    [1 - clip_eps, 1 + clip_eps_high] get no gradient (REINFORCE: when clipping is active)."""
    clip_eps_high: float | None = ranged(None, gt=0)
    """Upper clip range (DAPO clip-higher, e.g. 0.28); None = ``clip_eps``."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become one number (``rlbits.aggregate_loss``; denominators global over the
    minibatch): ``token-mean`` (DAPO), ``seq-mean-token-mean`` (GRPO paper), ``seq-mean-token-sum``."""
    kl_estimator: Literal["k1", "abs", "k2", "k3", "k1+", "k3+"] = "k1"
    """Per-token KL estimator of ``rlbits.kl_penalty`` in the reward (PPO: also in the loss) (k1 = logp -
    ref_logp; ``k1+``/``k3+``: k1/k3's value with k2's gradient, verl's straight-through variants)."""
    kl_clamp: float | None = ranged(None, gt=0)
    """Clamp each token's KL estimate to [-kl_clamp, kl_clamp] (verl, OpenRLHF and NeMo-RL clamp at 10); None =
    no clamp."""
    monitor_init_policy_kl: bool = False
    """Run the reference forward only to log ``init_policy_kl`` when no term uses ``ref_logprobs``
    (``uses_ref_logprobs``); without it the reference model is then neither loaded nor run (as TRL's GRPO with
    ``beta=0``)."""

    def check(self) -> None:
        super().check()
        if self.num_minibatches > self.num_prompts_per_step:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must be <= num_prompts_per_step "
                f"({self.num_prompts_per_step}): minibatches hold whole prompt groups"
            )


@dataclasses.dataclass(frozen=True)
class EnvConfig(OnlineConfig):
    """Multi-turn tasks, played in an environment (a task module with ``make_env``; the ppo and reinforce
    loops)."""

    env_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Multi-turn tasks (a task module with ``make_env``): keyword options passed to ``make_env(prompt,
    **env_options)`` for every episode (e.g. ``{max_turns: 4}``). Ignored by single-turn tasks."""
    sandbox: Literal["bwrap", "unsafe_local"] = "bwrap"
    """Multi-turn tasks whose ``make_env`` takes a ``sandbox`` keyword (tools that run code, e.g.
    ``rlbits.envs.python_tool``): where that code runs, passed as ``make_env(prompt, sandbox=...)``.
    ``bwrap``: isolated by the operating system through bubblewrap (docs/reliability.md); without a working
    ``bwrap`` the run stops with an error saying how to install it (``apt-get install bubblewrap``).
    ``unsafe_local``: a plain subprocess under rlimits and an audit hook, not a security boundary (trusted
    code only)."""
    max_episode_tokens: int | None = ranged(None, ge=2, at_most=MAX_TOKENS)
    """Multi-turn tasks: most tokens an episode (prompt + every turn and observation) may hold; an episode
    that would exceed it ends with ``stop_reason`` ``context``. None = the model's context length."""
    turn_reward: Literal["token", "sequence"] = "token"
    """Multi-turn tasks, PPO: ``token`` puts each turn's reward on the last action token of that turn
    (``turn_rewards``; GAE credits turns separately), ``sequence`` puts the episode's summed reward on its
    last action token. REINFORCE/GRPO/RLOO always use the sum."""
    max_env_workers: int = ranged(8, ge=1, at_most=1024)
    """Multi-turn tasks: most env steps (tool calls) running at once in a rollout."""
    env_timeout_s: float = ranged(60.0, gt=0)
    """Multi-turn tasks: wall-clock seconds one env step may take; a step past it ends its episode with
    ``stop_reason`` ``env_timeout`` (the rest of the batch goes on)."""

    def check(self) -> None:
        super().check()
        if not all(isinstance(k, str) for k in self.env_options):
            raise ConfigError(
                f"env_options must be a mapping of option names to values, got {show(self.env_options)}"
            )
        if "sandbox" in self.env_options:
            raise ConfigError(
                "env_options must not set sandbox: use the top-level sandbox field (bwrap or unsafe_local)"
            )


GROUPS: tuple[type[RunConfig], ...] = (
    RunConfig, PolicyConfig, OnlineConfig, PolicyGradientConfig, LoRAConfig, EnvConfig
)
"""The field groups a loop's config is made of, in the order ``--help-config`` lists them."""


def loop_of(cls: type) -> str | None:
    """The loop whose config class ``cls`` is (by ``LOOPS``), or None (``RunConfig``, a group, a subclass)."""
    for name, (module, class_name) in LOOPS.items():
        if cls.__module__ == module and cls.__qualname__ == class_name:
            return name
    return None


def describe_config(cls: type) -> str:
    """``the ppo loop (PPOConfig)`` for a loop's config class, else the class name: how messages name it."""
    loop = loop_of(cls)
    return f"the {loop} loop ({cls.__name__})" if loop is not None else cls.__name__


def _unknown_key(cls: type, key: str, fields: list[str]) -> str:
    """The message refusing ``key`` for ``cls``: which group it belongs to, when it is a field of a group that
    ``cls`` does not use, else the nearest field names."""
    owner, valid = describe_config(cls), ", ".join(fields)
    for group in GROUPS:
        if key in group.__dataclass_fields__ and not issubclass(cls, group):
            summary = " ".join(inspect.getdoc(group).split()).rstrip(".")
            return (
                f"{key} is not a field of {owner}, which does not use {group.__name__} ({summary}); "
                f"valid keys: {valid}"
            )
    close = difflib.get_close_matches(key, fields, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown config key {show(key)} for {owner}{hint} (valid keys: {valid})"


def config_from_dict(cls: type[C], values: dict[str, Any]) -> C:
    """A checked ``cls`` from a dict of field values (a YAML file's, overrides').

    Raises:
        ConfigError: a key that is not a field of ``cls`` (the message names the loop, and the group the key
            belongs to or the nearest field names), or a value of the wrong type or out of range.
    """
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if not isinstance(key, str):
            what = f"config key {show(key)} is a {type(key).__name__}"
            raise ConfigError(f"{what}; keys are field names (valid keys: {', '.join(fields)})")
        if key not in fields:
            raise ConfigError(_unknown_key(cls, key, fields))
    return cls(**values)


def load_config(
    cls: type[C], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> C:
    """YAML file (optional) + ``key=value`` overrides -> a checked, frozen ``cls``."""
    values = read_yaml(path) if path is not None else {}
    values.update(parse_overrides(list(overrides)))
    return config_from_dict(cls, values)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write ``cfg`` as YAML (every field, defaults included, so the file alone reproduces the run)."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


__all__ = [
    "GROUPS",
    "LOOPS",
    "MAX_ROWS",
    "MAX_TOKENS",
    "MIN_TEMPERATURE",
    "ConfigError",
    "EnvConfig",
    "LoRAConfig",
    "OnlineConfig",
    "PolicyConfig",
    "PolicyGradientConfig",
    "RunConfig",
    "config_from_dict",
    "describe_config",
    "field_docs",
    "load_config",
    "loop_of",
    "parse_overrides",
    "read_yaml",
    "save_config",
]
