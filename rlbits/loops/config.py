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
VAL_GENERATION_KEYS = (
    "max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "min_new_tokens", "stop_strings"
)
"""The generation fields ``val_generation`` may override for validation."""


# --------------------------------------------------------------------------------------------------------
# The shared fields and the groups
# --------------------------------------------------------------------------------------------------------


def max_time_seconds(max_time: str) -> int:
    """Seconds in a ``DD:HH:MM:SS`` budget (``RunConfig.max_time``; NeMo-RL's ``convert_to_seconds``).

    Raises:
        ConfigError: not four ``:``-separated whole numbers >= 0, or a budget of 0 seconds.
    """
    parts = max_time.split(":") if isinstance(max_time, str) else []
    if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"max_time must be 'DD:HH:MM:SS' (e.g. '00:03:45:00'); got {show(max_time)}")
    days, hours, minutes, seconds = (int(p) for p in parts)
    total = days * 86400 + hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ConfigError(f"max_time must be more than 0 seconds; got {show(max_time)}")
    return total


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
    max_time: str | None = None
    """Wall-clock budget of this process's run, ``DD:HH:MM:SS`` (NeMo-Aligner ``exp_manager.max_time_per_run``,
    read by ``Timer`` in ``nemo_aligner/utils/distributed.py`` and checked after each step in
    ``algorithms/ppo.py``; NeMo-RL ``checkpointing.checkpoint_must_save_by``, ``TimeoutChecker`` in
    ``nemo_rl/utils/timer.py``): after the step that ends past it, the run validates (``val_at_end``), saves
    a checkpoint, exports ``final/`` and ends, as at its last step; a resume gets the budget afresh. Counted
    from the first step (``Run.steps``). None: no time limit."""
    learning_rate: float = ranged(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = ranged(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2), each in [0, 1), for every optimizer of the run (NeMo-Aligner
    ``model.optim.betas``, trlx ``optimizer.kwargs.betas``, NeMo-RL ``policy.optimizer.kwargs.betas`` and
    ``policy.megatron_cfg.optimizer.adam_beta1/2``); torch's default."""
    adam_eps: float = ranged(1e-8, gt=0)
    """AdamW's eps added to the denominator, for every optimizer of the run (NeMo-Aligner ``model.optim.eps``,
    trlx ``optimizer.kwargs.eps``, NeMo-RL ``policy.optimizer.kwargs.eps`` and
    ``policy.megatron_cfg.optimizer.adam_eps``); torch's default."""
    max_grad_norm: float = ranged(1.0, finite=False)
    """Gradient clipping by global norm (<= 0 disables it)."""
    microbatch_size: int = ranged(16, ge=1, at_most=MAX_ROWS)
    """Rows per forward/backward pass; gradients accumulate over microbatches."""
    max_tokens_per_microbatch: int | None = ranged(None, ge=1)
    """Form the update's microbatches by a token budget instead of ``microbatch_size`` rows (verl
    ``actor.ppo_max_token_len_per_gpu`` with ``use_dynamic_bsz``): rows are balanced by length into the
    fewest microbatches within the budget (``rlbits.batch.split_microbatches_by_tokens``). A row's tokens are
    its prompt plus response (``attention_mask``); with ``pack_sequences`` a microbatch holds at most this
    many real tokens (Karmarkar-Karp partitions of about equal tokens), without it at most this many of
    rows x longest row. Must be at least the longest row. The losses' denominators are the minibatch's
    global counts either way, so the loss and gradients equal the row-count split's to float rounding. The
    no-gradient scoring passes before the update (reference, old logprobs, critic values) split by the same
    budget (``rlbits.loops.phases.scoring_args``; verl's ``log_prob_max_token_len_per_gpu`` defaults to it).
    None: ``microbatch_size`` rows, in the update and the scoring passes. docs/packing.md."""
    pack_sequences: bool = True
    """Packed updates: each microbatch's rows [b, T] are packed without padding into bins as long as its
    longest row (first-fit decreasing, ``rlbits.functional.pack_index``), position ids restarting per row and
    attention confined to each row (transformers reads the rows off the position ids: a block-diagonal causal
    mask under sdpa/eager, variable-length kernels under flash_attention_2), and the logprobs, entropies and
    values are scattered back to [b, R] (``rlbits.models.forward.policy_logprobs(pack=True)``). The loss and
    gradients equal the padded update's to float rounding; uniform lengths give the padded layout itself (one
    row a bin). The scoring passes before the update (reference, old logprobs, critic values) pack too. A
    model whose attention crosses packed rows is refused at its first packed pass (a ValueError naming it).
    For PPO, REINFORCE and the preference loop (their objectives' ``policy_logprobs`` / ``critic_values``);
    off by default in ILQL and the reward model, whose objectives run their own forward passes and refuse it
    (a ValueError at the first update). docs/packing.md."""
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
    """How many step checkpoints to keep on disk (older ones are deleted, except the best: ``keep_top_k``)."""
    keep_top_k: int | None = ranged(None, ge=1)
    """Also keep the this-many best checkpoints by ``metric_name`` (NeMo-RL ``checkpointing.keep_top_k``,
    ``nemo_rl/utils/checkpoint.py``; NeMo-Aligner ``checkpoint_callback_params.save_top_k`` on ``val_rewards``;
    trlx ``train.save_best``, one ``best_checkpoint`` by mean reward): a validation whose metric enters the top
    k saves a checkpoint at its step, and a checkpoint stays while it is in the top k, besides the newest
    ``keep_checkpoints`` that resume uses. ``RUN_DIR/checkpoints/best.json`` lists them, best first
    (``rlbits.loops.run.BEST_FILE``). None: no best checkpoints are kept."""
    metric_name: str = "val_reward"
    """With ``keep_top_k``: the metric logged at validation that ranks the checkpoints (NeMo-RL
    ``checkpointing.metric_name``, there ``val:NAME``), e.g. ``val_reward``, or the reward_model loop's
    ``val_accuracy``."""
    higher_is_better: bool = True
    """With ``keep_top_k``: whether a larger ``metric_name`` is better (NeMo-RL
    ``checkpointing.higher_is_better``); of equal values the later checkpoint ranks first, as in NeMo-RL."""
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
        if self.max_time is not None:
            max_time_seconds(self.max_time)
        self._check_adam_betas()

    def _check_adam_betas(self) -> None:
        """``adam_betas``: two numbers in [0, 1) (a YAML list is stored as a tuple of floats)."""
        betas = self.adam_betas
        ok = isinstance(betas, (list, tuple)) and len(betas) == 2
        ok = ok and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
        if not ok:
            raise ConfigError(f"adam_betas must be two numbers in [0, 1), e.g. [0.9, 0.999]; got {show(betas)}")
        object.__setattr__(self, "adam_betas", (float(betas[0]), float(betas[1])))

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
    top_k: int | None = ranged(None, ge=1)
    """Sample among the k most likely tokens only (``generate(top_k=...)``; HF/trlx ``gen_kwargs.top_k``,
    NeMo-RL ``policy.generation.top_k``, NeMo-Aligner ``model.ppo.sampling_params.top_k``); None: off (their 0 /
    null). Changes which tokens are sampled, not the behaviour logprobs (docs/generation.md)."""
    top_p: float = ranged(1.0, gt=0, le=1)
    """Nucleus sampling as HF's ``TopPLogitsWarper`` (``generate(top_p=...)``; trlx ``gen_kwargs.top_p``,
    NeMo-RL ``policy.generation.top_p``, NeMo-Aligner ``model.ppo.sampling_params.top_p``); 1: off."""
    repetition_penalty: float = ranged(1.0, gt=0)
    """HF's ``RepetitionPenaltyLogitsProcessor`` over the prompt and response so far (trlx
    ``gen_kwargs.repetition_penalty``; trlx's NeMo PPO trainer fixes 1.2 in ``modeling_nemo_ppo.py``,
    NeMo-Aligner ``model.ppo.sampling_params.repetition_penalty``); 1: off."""
    min_new_tokens: int = ranged(0, ge=0, at_most=MAX_TOKENS)
    """EOS (and every stop token) cannot be sampled, and ``stop_strings`` do not end a response, before this
    many response tokens (HF ``MinNewTokensLengthLogitsProcessor``; trlx ``gen_kwargs.min_new_tokens``,
    NeMo-Aligner ``model.ppo.length_params.min_length``); 0: off. At most ``max_new_tokens``."""
    stop_strings: list[str] = dataclasses.field(default_factory=list)
    """A response ends after the token that completes one of these strings in its decoded text; that token
    is its last action, the string stays in ``response_text`` (NeMo-RL ``policy.generation.stop_strings``,
    NeMo-Aligner ``model.ppo.sampling_params.end_strings``; trlx ``stop_sequences`` cuts the text before the
    string and re-tokenizes instead). Empty: off. Costs one host sync per decode step."""
    val_generation: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Overrides of the generation fields for validation only: any of ``max_new_tokens``, ``temperature``,
    ``top_k``, ``top_p``, ``repetition_penalty``, ``min_new_tokens``, ``stop_strings`` (e.g. ``{top_p: 0.9}``).
    The top-level fields are the rollouts', as NeMo-RL's ``policy.generation`` with its ``val_temperature``,
    ``val_top_p``, ``val_top_k`` (here ``val_generation: {temperature, top_p, top_k}``). trlx's
    ``method.gen_kwargs`` are validation's (and the rollouts' unless ``method.gen_experience_kwargs`` overrides
    them), so trlx's ``gen_experience_kwargs`` map to the top-level fields and its ``gen_kwargs`` to these.
    ``val_greedy`` still decodes greedily."""
    val_batch_size: int | None = ranged(None, ge=1, at_most=MAX_ROWS)
    """Validation prompts per ``generate`` call (NeMo-RL ``grpo.val_batch_size``, NeMo-Aligner
    ``model.ppo.val_rollout_micro_batch_size``); None: all of this rank's validation prompts in one call.
    Each call draws its own noise, so a set value changes the validation samples."""
    compile: bool = False
    """``torch.compile`` the loss and advantage kernels (dynamic shapes: one compilation per kernel, not one
    per response length) and, on GPU, each transformer block. Compiled code is cached under
    ``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``), so later runs start faster."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of storing them: less memory, one
    more forward pass of each block."""
    lr_scheduler: Literal["constant", "linear_warmup", "cosine", "cosine_annealing"] = "constant"
    """Learning-rate schedule over the run's optimizer steps (PPO: the policy's and the critic's, each from its
    own rate; ``rlbits.loops.optim``), the rate set before each optimizer step and logged as ``lr`` (PPO: and
    ``critic_lr``) when not ``constant``: ``constant`` (``learning_rate`` throughout); ``linear_warmup``
    (NeMo-RL ``policy.scheduler``, ``LinearLR`` then ``ConstantLR`` at milestone ``lr_warmup_steps``:
    from ``lr_warmup_start_factor * learning_rate`` up to ``learning_rate``); ``cosine`` (NeMo-Aligner
    ``optim.sched.name: CosineAnnealing``: warm-up over ``lr_warmup_steps``, cosine decay to ``min_lr``, held
    for the last ``lr_constant_steps``); ``cosine_annealing`` (trlx ``scheduler.name: cosine_annealing``, torch
    ``CosineAnnealingLR(T_max=lr_max_steps, eta_min=min_lr)``, no warm-up)."""
    lr_warmup_steps: int = ranged(0, ge=0)
    """``linear_warmup`` and ``cosine``: optimizer steps of warm-up (NeMo-Aligner ``optim.sched.warmup_steps``;
    NeMo-RL ``LinearLR``'s ``total_iters`` and the milestone)."""
    lr_warmup_start_factor: float = ranged(0.1, ge=0, le=1)
    """``linear_warmup``: the first step's rate as a fraction of ``learning_rate`` (NeMo-RL ``LinearLR``'s
    ``start_factor``; its example configs use 0.1)."""
    lr_constant_steps: int = ranged(0, ge=0)
    """``cosine``: the last this-many optimizer steps hold ``min_lr`` (NeMo-Aligner
    ``optim.sched.constant_steps``; > 0 also switches the warm-up to Megatron's ``lr * step / warmup``, as
    NeMo's ``CosineAnnealing`` does)."""
    min_lr: float = ranged(0.0, ge=0)
    """``cosine`` and ``cosine_annealing``: the rate the cosine decays to (NeMo-Aligner ``optim.sched.min_lr``,
    trlx ``scheduler.kwargs.eta_min``), at most ``learning_rate`` (and PPO's ``critic_learning_rate``)."""
    lr_max_steps: int | None = ranged(None, ge=1)
    """``cosine`` and ``cosine_annealing``: optimizer steps the schedule spans (NeMo-Aligner
    ``optim.sched.max_steps``, trlx ``T_max``); None = the run's own: its training steps times the optimizer
    steps per training step (PPO ``ppo_epochs * num_minibatches``, REINFORCE ``num_iterations *
    num_minibatches``, ILQL 1; the policy's from ``policy_training_start_step`` on), so resuming a run with
    another ``max_num_steps`` stretches the schedule from the start; set this to keep it."""

    def check(self) -> None:
        super().check()
        self._check_lr_scheduler()
        self._check_generation()
        if self.reward_model is not None and not Path(self.reward_model).expanduser().is_dir():
            raise ConfigError(
                f"reward_model must be a folder holding an HF sequence-classification model, got "
                f"{show(self.reward_model)} ({field_docs(type(self))['reward_model']})"
            )

    def _check_generation(self) -> None:
        """``stop_strings`` are non-empty strings, ``min_new_tokens <= max_new_tokens``, and ``val_generation``
        names generation fields only, with values those fields accept (checked on a copy with them set)."""
        stops = self.stop_strings
        if not isinstance(stops, list) or any(not isinstance(x, str) or not x for x in stops):
            raise ConfigError(
                f"stop_strings must be a list of non-empty strings, got {show(stops)} "
                f"({field_docs(type(self))['stop_strings']})"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        unknown = sorted(set(self.val_generation) - set(VAL_GENERATION_KEYS))
        if unknown:
            raise ConfigError(
                f"val_generation may set {', '.join(VAL_GENERATION_KEYS)}; got unknown key(s) {', '.join(unknown)}"
            )
        if self.val_generation:
            try:
                dataclasses.replace(self, val_generation={}, **self.val_generation)
            except ConfigError as e:
                raise ConfigError(f"val_generation: {e}") from None

    def _check_lr_scheduler(self) -> None:
        """``min_lr`` is at most the rate a cosine schedule decays from; a ``cosine`` schedule of
        ``lr_max_steps`` leaves steps to decay over after its warm-up and hold."""
        if self.lr_scheduler not in ("cosine", "cosine_annealing"):
            return
        if self.min_lr > self.learning_rate:
            raise ConfigError(
                f"min_lr ({self.min_lr}) must be <= learning_rate ({self.learning_rate}): the {self.lr_scheduler} "
                "schedule decays from it to min_lr"
            )
        steps = self.lr_warmup_steps + self.lr_constant_steps
        if self.lr_scheduler == "cosine" and self.lr_max_steps is not None and self.lr_max_steps <= steps:
            raise ConfigError(
                f"lr_max_steps ({self.lr_max_steps}) must be > lr_warmup_steps + lr_constant_steps ({steps}): "
                "the cosine schedule needs steps to decay over"
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
    chunk_size: int | None = ranged(None, ge=1, at_most=MAX_ROWS)
    """Prompts per ``generate`` call of a rollout (trlx ``method.chunk_size``; NeMo-Aligner
    ``model.ppo.rollout_micro_batch_size``): the step's prompts are generated this many at a time, bounding the KV
    cache's memory. None: all in one call. Each call draws its own noise, so a set value changes the samples
    (not their distribution)."""
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
    continuous_batching: bool = True
    """Finished rows leave the rollout's decode batch (``generate(continuous_batching=...)``): the rows still
    decoding are compacted, with their KV cache rows, to the next power of two, so a batch of uneven response
    lengths pays for its generated tokens rather than its longest row's. The same samples and logprobs as
    without it (float rounding of the logits at another batch size aside), so it is on by default (the
    golden pins hold either way); ``false`` decodes every row to the end, as HF ``generate`` does. Every
    ``generate`` call of the loops: rollouts, multi-turn episodes, validation, ReMax's greedy baseline and
    the preference loop's offline pairs. A ``logits_processor`` sees only the rows still decoding.
    docs/packing.md."""
    max_num_seqs: int | None = ranged(None, ge=1, at_most=MAX_ROWS)
    """Decode with this many slots (vLLM's and verl's name: the most rows decoded at once;
    ``generate(max_num_seqs=...)``): a rollout's samples wait in order and take a slot as a sample finishes,
    so a few long responses no longer hold the whole batch (``continuous_batching`` has no effect with it).
    The sampling noise is laid out per sample (one ``torch.rand(samples, max_new_tokens)`` table per
    ``generate`` call), so the samples, and every number after them, differ from None's for the same seed;
    they do not depend on the slot count. Rollouts, validation, ReMax's greedy baseline and the preference
    loop's offline pairs; not multi-turn episodes (refused). Needs a model with a static KV cache. None: one
    batch of all the samples (today's numbers). docs/generation.md."""
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
    num_layers_unfrozen: int = ranged(-1, ge=-1)
    """Train only the top this-many decoder blocks of the policy (trlx ``model.num_layers_unfrozen``,
    ``trlx/data/configs.py``, applied by ``freeze_bottom_causal_layers`` in ``trlx/utils/modeling.py``):
    the blocks below them and the input embeddings are frozen
    (``rlbits.models.frozen_layers.freeze_bottom_layers``; 0 freezes every block and the output layer too),
    and the optimizer holds only what trains. The reference
    stays a separate copy (trlx's hydra head shares the frozen trunk with it: a memory saving only, the same
    numbers). Not with LoRA (``lora_rank``), which freezes the whole base. -1 = every layer trains."""

    def check(self) -> None:
        super().check()
        if self.num_layers_unfrozen != -1 and self.lora_rank:
            raise ConfigError(
                f"num_layers_unfrozen ({self.num_layers_unfrozen}) needs full fine-tuning; lora_rank is "
                f"{self.lora_rank}, whose base is frozen whole"
            )
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
    balance_batch: bool = False
    """Balance each minibatch's tokens over the data-parallel ranks before the update (verl
    ``trainer.balance_batch``, ``RayPPOTrainer._balance_batch``): the ranks gather the minibatch's rows and
    each keeps a set of equal row count and about equal tokens (Karmarkar-Karp,
    ``rlbits.distributed.balance.balance_rows``), so no rank waits at the update's collectives for one that
    drew the long responses. The minibatch's rows over all ranks are unchanged, so the loss and gradients
    equal the unbalanced update's to float rounding (tested at 2 ranks), except under
    ``seq-mean-token-sum-norm`` without ``loss_scale_factor``, whose divisor is each rank's padded response
    width. Costs one all-gather of the minibatch per optimizer step. No effect on one process.
    docs/packing.md."""
    clip_eps: float = ranged(0.2, ge=0)
    """Lower clip range of the importance ratio (and upper, unless ``clip_eps_high``), verl's
    ``actor.clip_ratio_low``: for ``vanilla``, ratios outside [1 - clip_eps, 1 + clip_eps_high] get no gradient
    (REINFORCE: when clipping is active). ``dppo_tv`` / ``dppo_kl`` read it as a divergence bound; losses
    without a clip range (``sapo``, ``gpg``, ``dro``, ``kl_cov``) ignore it."""
    clip_eps_high: float | None = ranged(None, gt=0)
    """Upper clip range (DAPO clip-higher, e.g. 0.28), verl's ``actor.clip_ratio_high``; None = ``clip_eps``."""
    loss_agg: Literal[
        "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number, verl's ``actor.loss_agg_mode`` (``rlbits.aggregate_loss``;
    denominators global over the minibatch): ``token-mean`` (DAPO), ``token-sum`` (no denominator),
    ``seq-mean-token-mean`` (GRPO paper), ``seq-mean-token-sum``, ``seq-mean-token-sum-norm`` (the row sums'
    mean over ``loss_scale_factor``: Dr. GRPO)."""
    loss_scale_factor: float | None = ranged(None, gt=0)
    """verl's ``actor.loss_scale_factor``: the constant divisor of ``loss_agg: seq-mean-token-sum-norm`` (only
    with that mode). None = verl's default, the width R of the loss tensors: in rlbits the longest response of
    the step's batch, which varies; verl pads every response to its ``response_length``, so
    ``max_new_tokens`` here gives verl's constant."""
    policy_loss: str = "vanilla"
    """The policy-gradient loss, verl's ``actor.policy_loss.loss_mode``: a key of ``rlbits.POLICY_LOSSES``
    (``vanilla`` PPO clip, ``gspo``, ``cispo``, ``geo_mean``, ``sapo``, ``gpg``, ``dppo_tv``, ``dppo_kl``,
    ``dro``, ``clip_cov``, ``kl_cov``), called with ``clip_eps`` / ``clip_eps_high`` where it has a clip range,
    ``loss_agg`` and ``policy_loss_kwargs``."""
    policy_loss_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The loss's own hyperparameters by verl's names (``actor.policy_loss.*`` / ``actor.clip_ratio_c``), the
    keyword-only parameters of its function: e.g. ``{clip_ratio_c: 3.0}`` (``vanilla``'s dual clip; without it
    the loops run ``vanilla`` with none, where verl's default is 3.0), ``{clip_cov_ratio: 0.0002}``,
    ``{dro_beta: 0.1}``. The clip range and aggregation are config fields and not set here."""
    kl_estimator: Literal["k1", "abs", "k2", "k3", "k1+", "k3+"] = "k1"
    """Per-token KL estimator of ``rlbits.kl_penalty`` in the reward (PPO: also in the loss) (k1 = logp -
    ref_logp; ``k1+``/``k3+``: k1/k3's value with k2's gradient, verl's straight-through variants)."""
    kl_clamp: float | None = ranged(None, gt=0)
    """Clamp each token's KL estimate to [-kl_clamp, kl_clamp] (verl, OpenRLHF and NeMo-RL clamp at 10); None =
    no clamp."""
    positive_example_nll_weight: float = ranged(0.0, ge=0)
    """NeMo-RL ``loss_fn.positive_example_nll_weight`` (nemo_rl/algorithms/loss/loss_functions.py; VAPO): mu of
    ``mu * positive_example_nll_loss`` added to the policy loss: the token mean of ``-log pi`` over the rows
    whose score (``rewards``, before the KL) is > 0, over each microbatch's such tokens as NeMo-RL does (so it
    depends on ``microbatch_size`` as NeMo-RL's on its micro batch). 0 = off; metric ``positive_nll_loss``."""
    kl_input_clamp: float | None = ranged(None, gt=0)
    """Clamp each token's log-ratio ``logp - ref_logp`` to [-kl_input_clamp, kl_input_clamp] before the KL
    estimator is computed (``rlbits.kl_penalty(input_clamp=...)``; NeMo-RL's ``kl_input_clamp_value``,
    ``nemo_rl/algorithms/loss/loss_functions.py``, default 20 there, whose ``kl_output_clamp_value`` is
    ``kl_clamp``); None = no clamp."""
    monitor_init_policy_kl: bool = False
    """Run the reference forward only to log ``init_policy_kl`` when no term uses ``ref_logprobs``
    (``uses_ref_logprobs``); without it the reference model is then neither loaded nor run (as TRL's GRPO with
    ``beta=0``)."""
    rollout_correction: dict[str, Any] = dataclasses.field(default_factory=lambda: {"mode": "none"})
    """Correction of the sampler/trainer mismatch (docs/rollout_correction.md): ``{mode, level, threshold,
    threshold_low}``. ``mode``: ``none`` (off), or a key of ``rlbits.ROLLOUT_CORRECTIONS``: ``tis`` (truncated
    IS), ``icepop``, ``mis`` (masked IS), ``geo_rs`` (geometric-mean rejection), ``rs`` (verl's rejection
    sampling; ``level`` one of its options, e.g. ``seq_mean_k3``), ``seq_mask_tis`` (NeMo-RL), ``decoupled``
    (AReaL's behaviour weight, ``threshold`` = ``behav_imp_weight_cap``). ``level`` (``token`` /
    ``sequence``), ``threshold`` and ``threshold_low`` default to the mode's. When on, the trainer's policy
    recomputes ``old_logprobs`` before the update, the loss takes them as its old policy and multiplies by
    the correction's weights, and rejected tokens leave ``loss_mask``."""
    async_mode: Literal["off", "simulated", "ranks"] = "off"
    """Asynchronous RL (docs/async.md): ``off``, the synchronous loop (each step trains on rows its own policy
    sampled); ``simulated``, one process trains step t on the rows the policy of version max(0, t -
    max_staleness) sampled, exactly as rollout workers generating ahead through a queue of ``max_staleness``
    batches would (``rlbits.loops.staleness``); ``ranks``, under ``torchrun`` the last ``rollout_ranks`` ranks
    generate while the others train together (FSDP2 over the trainer ranks), the same schedule for real (the
    ``reinforce`` and ``ppo`` loops)."""
    max_staleness: int = ranged(0, ge=0, at_most=1024)
    """The most policy versions (steps) a row may lag the policy it trains when it is trained on (verl's
    ``staleness_threshold``, AReaL's ``max_head_offpolicyness``); 0 is the synchronous loop. Needs
    ``async_mode: simulated`` or ``ranks`` when > 0."""
    rollout_ranks: int = ranged(0, ge=0, at_most=1024)
    """With ``async_mode: ranks``: how many of torchrun's ranks (the last ones, R) only generate, beside T =
    world size - R trainer ranks that train as a colocated run at world size T does, each on the rows a
    rollout rank produced as that run's rank would (rollout rank j produces trainer ranks r with r % R == j;
    1 <= R <= T, checked at launch). 0 otherwise."""
    async_schedule: Literal["deterministic", "eager"] = "deterministic"
    """How ``async_mode: ranks`` schedules the rollout ranks (docs/async.md): ``deterministic``, batch t + k is
    produced only with the weights of version t, the schedule of ``simulated`` (same rows, versions and
    weights); ``eager``, the rollout rank produces batches back to back with the newest weights it holds,
    taking each new version as soon as it has arrived, and with version v in hand produces batches up to
    index v + ``max_staleness`` (AReaL's ``max_head_offpolicyness``, verl fully-async's
    ``staleness_threshold``, prime-rl's ``max_off_policy_steps``): which version samples which batch depends on
    timing. One rollout rank only."""
    partial_rollouts: bool = False
    """With ``async_schedule: eager``: a weight update that arrives while a batch is being decoded is loaded at
    once, between two decode steps, and the batch goes on with it (the KV cache recomputed with the new weights
    over the tokens so far); each token records its version in ``token_version`` and a row's
    ``policy_version`` is its oldest token's (AReaL's partial rollout, verl fully-async's ``partial_rollout``;
    docs/async.md). Single-turn tasks only."""

    def check(self) -> None:
        super().check()
        if self.max_staleness > 0 and self.async_mode == "off":
            raise ConfigError(
                f"max_staleness={self.max_staleness} needs async_mode: simulated or ranks (with async_mode: off "
                "every row is trained on by the policy that sampled it)"
            )
        if (self.async_mode == "ranks") != (self.rollout_ranks > 0):
            raise ConfigError(
                f"rollout_ranks={self.rollout_ranks} with async_mode: {self.async_mode}: async_mode: ranks needs "
                "rollout_ranks >= 1 (the ranks that only generate; at most the trainer ranks), and rollout_ranks is 0 "
                "otherwise"
            )
        if self.async_schedule == "eager" and self.async_mode != "ranks":
            raise ConfigError(
                f"async_schedule: eager schedules the rollout ranks of async_mode: ranks, got async_mode: "
                f"{self.async_mode} (async_mode: simulated runs the deterministic schedule)"
            )
        if self.async_schedule == "eager" and self.rollout_ranks > 1:
            raise ConfigError(
                f"async_schedule: eager runs one rollout rank, got rollout_ranks: {self.rollout_ranks}"
            )
        if self.partial_rollouts and self.async_schedule != "eager":
            raise ConfigError(
                "partial_rollouts: true continues a rollout with the weights that arrive during it, which only "
                f"async_schedule: eager does (with async_mode: ranks); got async_schedule: {self.async_schedule}"
            )
        if self.partial_rollouts and self.max_num_seqs is not None:
            raise ConfigError(
                "partial_rollouts: true recomputes the whole decode batch's cache when weights arrive, which "
                f"max_num_seqs: {self.max_num_seqs} (slots at different steps) cannot; set max_num_seqs: null"
            )
        if self.async_mode == "ranks" and self.loop not in ("reinforce", "ppo"):
            raise ConfigError(
                f"async_mode: ranks runs the reinforce and ppo loops, not loop={self.loop!r}; use async_mode: simulated"
            )
        if self.num_minibatches > self.num_prompts_per_step:
            raise ConfigError(
                f"num_minibatches ({self.num_minibatches}) must be <= num_prompts_per_step "
                f"({self.num_prompts_per_step}): minibatches hold whole prompt groups"
            )
        if self.loss_scale_factor is not None and self.loss_agg != "seq-mean-token-sum-norm":
            raise ConfigError(
                f"loss_scale_factor={self.loss_scale_factor} has no effect with loss_agg={self.loss_agg!r}; it is "
                "the divisor of loss_agg: seq-mean-token-sum-norm"
            )
        self._check_policy_loss()
        self._check_rollout_correction()

    def _check_policy_loss(self) -> None:
        """``policy_loss`` is registered, ``policy_loss_kwargs`` names only its hyperparameters, and the loss
        accepts their values (it is called once on one token)."""
        import torch

        losses = _policy_losses()
        if self.policy_loss not in losses:
            raise ConfigError(
                f"policy_loss must be one of {', '.join(losses)} (rlbits.POLICY_LOSSES, verl's loss_mode "
                f"names); got {show(self.policy_loss)}"
            )
        kwargs, name = self.policy_loss_kwargs, self.policy_loss
        if not all(isinstance(k, str) for k in kwargs):
            raise ConfigError(
                f"policy_loss_kwargs must map hyperparameter names to values, got {show(kwargs)}"
            )
        accepted = policy_loss_hyperparameters(name)
        for key in kwargs:
            if key in LOOP_SET_LOSS_ARGS:
                raise ConfigError(f"policy_loss_kwargs must not set {key}: {LOOP_SET_LOSS_ARGS[key]}")
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=2)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(
                    f"policy_loss_kwargs: {show(key)} is not a hyperparameter of policy_loss {name!r} "
                    f"({losses[name].__name__}){hint}; it takes {', '.join(accepted) or 'none'}"
                )
        one = torch.zeros(1, 1)
        params = inspect.signature(losses[name]).parameters
        rng = {"generator": torch.Generator()} if "generator" in params else {}
        try:  # a private generator: checking a config draws nothing from the global one
            losses[name](one, one, one, one > -1, agg=self.loss_agg, **rng, **self.policy_loss_args)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"policy_loss {name!r} with policy_loss_kwargs={show(kwargs)}: {e}") from None

    @property
    def policy_loss_args(self) -> dict[str, Any]:
        """The keywords the loops pass to ``rlbits.POLICY_LOSSES[policy_loss]`` besides the aggregation:
        ``clip_eps`` / ``clip_eps_high`` where the loss has a clip range, ``clip_ratio_c=None`` for ``vanilla``
        (no dual clip unless asked), then ``policy_loss_kwargs``."""
        params = inspect.signature(_policy_losses()[self.policy_loss]).parameters
        args: dict[str, Any] = {}
        if "clip_eps" in params:
            args |= {"clip_eps": self.clip_eps, "clip_eps_high": self.clip_eps_high}
        if self.policy_loss == "vanilla":
            args["clip_ratio_c"] = None
        return args | self.policy_loss_kwargs

    def _check_rollout_correction(self) -> None:
        corr = self.rollout_correction
        keys = ("mode", "level", "threshold", "threshold_low")
        if not all(isinstance(k, str) for k in corr):
            raise ConfigError(f"rollout_correction must be a mapping with keys {', '.join(keys)}; got {show(corr)}")
        unknown = sorted(set(corr) - set(keys))
        if unknown:
            raise ConfigError(
                f"rollout_correction has unknown key(s) {', '.join(unknown)}; its keys are {', '.join(keys)}"
            )
        mode = corr.get("mode", "none")
        if mode == "none":
            if set(corr) - {"mode"}:
                raise ConfigError(
                    f"rollout_correction: {', '.join(sorted(set(corr) - {'mode'}))} set with mode none (off); "
                    "set a mode (tis, icepop, mis, geo_rs, rs, seq_mask_tis, decoupled) or drop them"
                )
            return
        import torch  # the kernels' own checks judge the arguments; only a config with a correction loads torch

        from rlbits.functional.rollout_correction import ROLLOUT_CORRECTIONS

        if mode not in ROLLOUT_CORRECTIONS:
            raise ConfigError(
                f"rollout_correction mode must be none or one of {', '.join(ROLLOUT_CORRECTIONS)}; got {show(mode)}"
            )
        try:
            zero = torch.zeros(1, 1)
            ROLLOUT_CORRECTIONS[mode](zero, zero, torch.ones(1, 1, dtype=torch.bool), **self.rollout_correction_args)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"rollout_correction {show(corr)}: {e}") from None

    @property
    def rollout_correction_mode(self) -> str:
        """``rollout_correction``'s mode (``none``: off)."""
        return self.rollout_correction.get("mode", "none")

    @property
    def rollout_correction_args(self) -> dict[str, Any]:
        """The keyword arguments of the mode's function: ``rollout_correction`` without ``mode`` and its nulls."""
        return {k: v for k, v in self.rollout_correction.items() if k != "mode" and v is not None}


@dataclasses.dataclass(frozen=True)
class RewardShapingConfig(OnlineConfig):
    """The seeds' transforms of the sequence reward and the truncation mask (the ppo and reinforce loops).

    Order, as the seeds apply them (``rlbits.loops.reward_shaping.shape_rewards``): NeMo-Aligner's
    standardisation (inside its reward model), NeMo-RL's linear scaling, then NeMo-RL's shaping (the
    stop-properly coefficient, or DAPO's overlong penalty); each loop's own scaling comes after (docs/ppo.md,
    docs/reinforce.md). All off by default."""

    reward_standardization_mean: float | None = None
    """NeMo-Aligner ``model.reward_standardization.mean`` (megatron_gpt_reward_model.py): with
    ``reward_standardization_std``, every reward becomes ``(r - mean) / std`` first; None = off."""
    reward_standardization_std: float | None = ranged(None, gt=0)
    """NeMo-Aligner ``model.reward_standardization.std``: the fixed divisor of the standardisation."""
    reward_scaling: bool = False
    """NeMo-RL ``grpo.reward_scaling.enabled`` (``RewardScalingConfig``, nemo_rl/algorithms/grpo.py): clamp each
    reward to [reward_scaling_source_min, reward_scaling_source_max], map it linearly onto
    [reward_scaling_target_min, reward_scaling_target_max]."""
    reward_scaling_source_min: float = 0.0
    """NeMo-RL ``reward_scaling.source_min``."""
    reward_scaling_source_max: float = 1.0
    """NeMo-RL ``reward_scaling.source_max`` (> ``reward_scaling_source_min``)."""
    reward_scaling_target_min: float = 0.0
    """NeMo-RL ``reward_scaling.target_min``."""
    reward_scaling_target_max: float = 1.0
    """NeMo-RL ``reward_scaling.target_max``."""
    overlong_buffer_length: int | None = ranged(None, ge=1)
    """NeMo-RL ``reward_shaping.overlong_buffer_length`` (nemo_rl/algorithms/reward_functions.py, DAPO's soft
    overlong punishment): set, with ``overlong_buffer_penalty``, it turns the shaping on: ``r += min(-(len -
    (max_response_length - overlong_buffer_length)) / overlong_buffer_length * overlong_buffer_penalty, 0)``
    with ``len`` a response's action-token count."""
    overlong_buffer_penalty: float | None = ranged(None, ge=0)
    """NeMo-RL ``reward_shaping.overlong_buffer_penalty``: the penalty at ``max_response_length`` tokens."""
    max_response_length: int | None = ranged(None, ge=1)
    """NeMo-RL ``reward_shaping.max_response_length``; None = ``max_new_tokens``."""
    stop_properly_penalty_coef: float | None = ranged(None, ge=0, le=1)
    """NeMo-RL ``reward_shaping.stop_properly_penalty_coef``: a truncated response's reward times this factor
    (0: no reward); it takes precedence over the overlong fields (they are then ignored); None = off."""
    overlong_filtering: bool = False
    """Mask truncated responses (the token limit reached without an end) out of the loss: ``loss_mask`` is
    ``action_mask`` without their rows, and the update counts its denominators over ``loss_mask`` (DAPO overlong
    filtering; NeMo-RL ``grpo.overlong_filtering`` / ``ppo.overlong_filtering``: ``loss_multiplier = 0``; PPO's
    value loss too; NeMo-Aligner's actor averages over ``mask * is_end``, megatron_gpt_ppo_actor.py)."""

    def check(self) -> None:
        super().check()
        std, mean = self.reward_standardization_std, self.reward_standardization_mean
        if (std is None) != (mean is None):
            raise ConfigError(
                "reward_standardization_mean and reward_standardization_std go together (NeMo-Aligner's "
                f"reward_standardization); got mean={mean}, std={std}"
            )
        if self.reward_scaling and not self.reward_scaling_source_max > self.reward_scaling_source_min:
            raise ConfigError(
                f"reward_scaling_source_max ({self.reward_scaling_source_max}) must be > reward_scaling_source_min "
                f"({self.reward_scaling_source_min})"
            )
        if self.stop_properly_penalty_coef is None and (self.overlong_buffer_length is None) != (
            self.overlong_buffer_penalty is None
        ):
            raise ConfigError(
                "overlong_buffer_length and overlong_buffer_penalty go together (DAPO overlong shaping); got "
                f"overlong_buffer_length={self.overlong_buffer_length}, "
                f"overlong_buffer_penalty={self.overlong_buffer_penalty}"
            )
        if self.overlong_shaping and self.overlong_buffer_length > self.response_length_limit:
            raise ConfigError(
                f"overlong_buffer_length ({self.overlong_buffer_length}) must be <= max_response_length "
                f"({self.response_length_limit}): the penalty starts at their difference"
            )

    @property
    def response_length_limit(self) -> int:
        """``max_response_length``, or ``max_new_tokens`` when it is None."""
        return self.max_response_length if self.max_response_length is not None else self.max_new_tokens

    @property
    def overlong_shaping(self) -> bool:
        """Whether DAPO's overlong penalty applies (its fields set, no ``stop_properly_penalty_coef``)."""
        return self.stop_properly_penalty_coef is None and self.overlong_buffer_length is not None

    @property
    def reward_shaped(self) -> bool:
        """Whether any transform of this group changes the rewards."""
        return (
            self.reward_standardization_std is not None
            or self.reward_scaling
            or self.overlong_shaping
            or self.stop_properly_penalty_coef is not None
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
    max_rollout_turns: int | None = ranged(None, ge=1)
    """Multi-turn tasks: at most this many policy turns an episode, over every task's own limit (its env's
    ``stop.max_turns``, ``env_options`` ``max_turns``); an episode cut here ends with ``stop_reason``
    ``max_turns``, training and validation alike (NeMo-RL ``grpo.max_rollout_turns``,
    ``nemo_rl/algorithms/grpo.py``, the turn loop of ``run_multi_turn_rollout`` in
    ``nemo_rl/experience/rollouts.py``). None: the envs' own limits."""
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


LOOP_SET_LOSS_ARGS = {
    "clip_eps": "it is the config field clip_eps",
    "clip_eps_high": "it is the config field clip_eps_high",
    "agg": "the config field loss_agg sets it",
    "num_tokens": "the loop sets it (the minibatch's token count)",
    "num_seqs": "the loop sets it (the minibatch's row count)",
    "generator": "a random generator is no config value (clip_cov draws from torch's global one)",
    "rollout_is_weights": "the config field rollout_correction sets it",
}
"""Keywords of the policy losses that ``policy_loss_kwargs`` may not set, and why."""


def _policy_losses() -> dict[str, Any]:
    from rlbits.functional.policy_losses import POLICY_LOSSES  # torch: imported when a config is checked

    return POLICY_LOSSES


def policy_loss_hyperparameters(name: str) -> list[str]:
    """The keywords ``policy_loss_kwargs`` may set for the policy loss ``name`` (a key of
    ``rlbits.POLICY_LOSSES``): its function's keyword-only parameters without ``LOOP_SET_LOSS_ARGS``."""
    params = inspect.signature(_policy_losses()[name]).parameters.values()
    return [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in LOOP_SET_LOSS_ARGS]


GROUPS: tuple[type[RunConfig], ...] = (
    RunConfig, PolicyConfig, OnlineConfig, PolicyGradientConfig, LoRAConfig, RewardShapingConfig, EnvConfig
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
    "LOOP_SET_LOSS_ARGS",
    "MAX_ROWS",
    "MAX_TOKENS",
    "MIN_TEMPERATURE",
    "VAL_GENERATION_KEYS",
    "ConfigError",
    "EnvConfig",
    "LoRAConfig",
    "OnlineConfig",
    "PolicyConfig",
    "PolicyGradientConfig",
    "RewardShapingConfig",
    "RunConfig",
    "config_from_dict",
    "describe_config",
    "field_docs",
    "load_config",
    "loop_of",
    "parse_overrides",
    "policy_loss_hyperparameters",
    "read_yaml",
    "save_config",
]
