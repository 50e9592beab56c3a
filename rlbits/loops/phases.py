"""What the loops share: the online phases ``rollout``, ``reference``, ``rollout_correction`` and
``validate_policy``, each
``phase(state, batch, cfg) -> batch``, and the model-level building blocks beneath them (``generate_rollout``,
``run_episodes``, ``score_rollout``, ``reference_logprobs``, ``scoring_args``, ``evaluate_policy``,
``add_batch_stats``, ``policy_loss_stats``),
usable in any loop or notebook.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import einops
import torch
from tensordict import TensorDictBase

from rlbits.data.stream import prompt_batch
from rlbits.distributed.env import DistEnv
from rlbits.distributed.parallelize import is_sharded, unsharded
from rlbits.distributed.reduce import all_reduce_sum, any_rank
from rlbits.functional import ROLLOUT_CORRECTIONS, kl_penalty, masked_sum
from rlbits.loops.config import MAX_ROWS, ConfigError, RunConfig
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.run import agreed, in_phase
from rlbits.loops.runtime import autocast, generator, head_args
from rlbits.models.forward import HEAD_MEMORY_BUDGET_MB, policy_logprobs
from rlbits.models.lora import adapters_disabled, is_lora
from rlbits.rollout.generate import generate_texts
from rlbits.rollout.multiturn import STOP_REASONS, generate_episodes
from rlbits.rollout.score import score


def prompt_texts(batch: TensorDictBase | Sequence[str]) -> list[str]:
    """The prompt strings of a ``prompt_batch`` (or a list of strings, returned as a list)."""
    if isinstance(batch, TensorDictBase):
        texts = batch["prompt_text"]
        return list(texts.tolist() if hasattr(texts, "tolist") else texts)
    return list(batch)


def generation_options(cfg: RunConfig, validation: bool = False) -> dict[str, Any]:
    """The keyword options of ``generate_rollout`` from ``cfg``'s generation fields: ``max_new_tokens``,
    ``temperature``, ``top_k``, ``top_p`` (None at 1), ``repetition_penalty``, ``min_new_tokens``,
    ``stop_strings``, then for ``validation`` ``cfg.val_generation`` over them (and temperature 0 with
    ``val_greedy``)."""
    options = {
        key: getattr(cfg, key)
        for key in (
            "max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "min_new_tokens", "stop_strings"
        )
    }
    if validation:
        options.update(cfg.val_generation)
        if cfg.val_greedy:
            options["temperature"] = 0.0
    if options["top_p"] is not None and options["top_p"] >= 1:
        options["top_p"] = None
    return options


def _check_single_turn(cfg: RunConfig, validation: bool = False) -> None:
    """Refuse generation options that a multi-turn task's episodes (``run_episodes``) do not apply: they sample
    at ``temperature`` and stop by the env's ``StopConditions``.

    Raises:
        ValueError: naming the fields set.
    """
    options = generation_options(cfg, validation)
    off = {"top_k": None, "top_p": None, "repetition_penalty": 1.0, "min_new_tokens": 0, "stop_strings": []}
    bad = sorted(k for k, v in off.items() if options[k] != v)
    if bad or (getattr(cfg, "chunk_size", None) is not None and not validation):
        fields = bad + (["chunk_size"] if getattr(cfg, "chunk_size", None) is not None and not validation else [])
        raise ValueError(
            f"{', '.join(fields)} apply to single-turn rollouts only; a multi-turn task's episodes sample at "
            "temperature and stop by its env's StopConditions: leave them unset"
        )


def generate_rollout(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    logits_processor: Callable | None = None,
    compile: bool = False,
    pack_weights: bool | None = None,
    **options: Any,
) -> TensorDictBase:
    """``generate_texts`` (tokenize, sample ``num_samples`` responses each, decode) with a sharded policy
    gathered for the whole call; ``compile``: a compiled decode step (``generate(compile=True)``);
    ``pack_weights``: as ``generate`` (None: oneDNN on packed weights on CPU); ``options``: more
    ``generate_texts`` options (``top_k``, ``top_p``, ``repetition_penalty``, ``min_new_tokens``,
    ``stop_strings``, ``chunk_size``; ``generation_options`` gives a config's).

    Returns the batch of docs/batch.md (``prompts`` ... ``logprobs``, ``group``, ``prompt_text``,
    ``response_text``) with behaviour logprobs at ``temperature`` (greedy when ``temperature == 0``).
    """
    with unsharded(policy):  # a sharded policy is gathered once for the whole rollout
        return generate_texts(
            policy, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
            num_samples=num_samples, generator=generator, logits_processor=logits_processor, compile=compile,
            pack_weights=pack_weights, **options,
        )


def env_options(make_env: Callable[..., Any], cfg: RunConfig) -> dict[str, Any]:
    """The keyword options of ``make_env`` for every episode: ``cfg.env_options``, plus ``sandbox=cfg.sandbox``
    when ``make_env`` has a ``sandbox`` parameter (a task whose tools run code)."""
    options = dict(cfg.env_options)
    try:
        params = inspect.signature(make_env).parameters
    except (TypeError, ValueError):  # a callable without a signature takes no sandbox
        return options
    if "sandbox" in params:
        options["sandbox"] = cfg.sandbox
    return options


def run_episodes(
    policy: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    make_env: Callable[..., Any],
    cfg: RunConfig,
    *,
    temperature: float,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    compile: bool = False,
    pack_weights: bool | None = None,
    continuous_batching: bool = False,
    max_num_seqs: int | None = None,
) -> TensorDictBase:
    """The rollout of a multi-turn task: ``num_samples`` episodes per prompt (groups contiguous), each with its
    own env ``make_env(prompt, **env_options(make_env, cfg))``, run by ``generate_episodes`` with ``cfg``'s
    ``max_episode_tokens``, ``turn_reward``, ``max_env_workers``, ``env_timeout_s`` and ``max_rollout_turns`` (a
    sharded policy is gathered for the whole call). The envs' ``StopConditions`` bound each turn; ``cfg.max_new_tokens`` is
    not used.

    Returns the batch of ``generate_episodes``: docs/batch.md's keys with ``rewards`` (the episodes' summed
    turn rewards), ``turn_rewards``, ``turn_index``, ``num_turns``, ``stop_reason``.
    """
    rows = [p for p in prompts for _ in range(num_samples)]
    options = env_options(make_env, cfg)
    envs = [make_env(p, **options) for p in rows]
    with unsharded(policy):
        return generate_episodes(
            policy, tokenizer, envs, rows, temperature=temperature, generator=generator,
            max_episode_tokens=cfg.max_episode_tokens, reward_placement=cfg.turn_reward,
            max_env_workers=cfg.max_env_workers, env_timeout_s=cfg.env_timeout_s, compile=compile,
            group_size=num_samples, pack_weights=pack_weights, max_turns=cfg.max_rollout_turns,
            continuous_batching=continuous_batching, max_num_seqs=max_num_seqs,
        )


def bf16_copy(policy: torch.nn.Module, copy: torch.nn.Module | None = None) -> torch.nn.Module:
    """A copy of ``policy`` whose floating-point parameters are bfloat16 (buffers such as rotary
    frequencies keep their dtype), or ``copy`` with its parameters refreshed from ``policy``'s weights.

    For decoding under ``precision: bf16``: autocast casts every weight again at every token (on 2 CPU
    threads, SmolLM2-135M decoded 3-5x slower under autocast than from a bfloat16 copy); the copy costs half
    the policy's weight memory and one cast per rollout. Its logits are those of the trainer's autocast
    forward up to bf16 rounding of the activations between matmuls (tests/loops/test_loop_reinforce.py bounds the
    sampler/trainer mismatch).
    """
    import copy as copy_module

    with torch.no_grad():
        if copy is None:
            copy = copy_module.deepcopy(policy)
            for p in copy.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
            copy.eval().requires_grad_(False)
        else:
            for dst, src in zip(copy.parameters(), policy.parameters(), strict=True):
                dst.copy_(src)
    return copy


def pack_weights(cfg: RunConfig) -> bool | None:
    """``generate``'s ``pack_weights`` from ``cfg.pack_decode_weights``: None (its CPU default) or False."""
    return None if cfg.pack_decode_weights else False


@contextlib.contextmanager
def decoding(state: Any, cfg: RunConfig) -> Iterator[torch.nn.Module]:
    """The model a rollout of ``state.policy`` decodes with, inside its precision context: with
    ``precision: bf16`` on an unsharded policy, a bfloat16 copy kept in ``state.decode_copy`` and refreshed
    from the policy's current weights (``bf16_copy``), without autocast; else the policy itself under
    ``autocast`` (a no-op in fp32)."""
    policy = state.policy
    if cfg.precision == "bf16" and not is_sharded(policy):
        state.decode_copy = bf16_copy(policy, getattr(state, "decode_copy", None))
        yield state.decode_copy
        return
    with autocast(policy, cfg):
        yield policy


def score_rollout(batch: TensorDictBase, reward: Any) -> torch.Tensor:
    """Write ``rewards`` [B] from ``reward`` (callable, reward model or server URL; see ``rlbits.score``).
    An episode batch (``run_episodes``: it has ``turn_rewards``) keeps the rewards its envs gave; ``reward`` is
    not called."""
    if "turn_rewards" in batch.keys():
        return batch["rewards"]
    # ``score`` returns CPU rewards; the advantages are computed on the rollout's device.
    batch["rewards"] = score(batch, reward).to(device=batch["responses"].device, dtype=torch.float32)
    return batch["rewards"]


@contextlib.contextmanager
def reference_model(state: Any) -> Iterator[torch.nn.Module]:
    """The frozen reference policy of an online loop's state: ``state.reference`` when it holds one, else
    (a LoRA run, ``lora_rank > 0``) ``state.policy`` with its adapters disabled for the block, which is the
    initial policy without a second copy of its weights (``rlbits.models.lora.adapters_disabled``).

    Raises:
        ValueError: the state has no reference and its policy no adapters.
    """
    if getattr(state, "reference", None) is not None:
        yield state.reference
    elif is_lora(state.policy):
        with adapters_disabled(state.policy):
            yield state.policy
    else:
        raise ValueError("the state has no reference policy (state.reference is None) and its policy no LoRA adapters")


def sample(state: Any, batch: TensorDictBase, cfg: RunConfig, policy: torch.nn.Module) -> TensorDictBase:
    """``cfg.num_generations_per_prompt`` responses of ``policy`` per prompt of ``batch["prompt_text"]`` with
    ``cfg``'s generation fields (``generation_options``; groups contiguous), drawn with
    ``state.sampling_generator``: ``generate_rollout`` (``cfg.chunk_size`` prompts per call), or for a
    multi-turn task (``state.make_env``) one episode per sample at ``cfg.temperature`` (``run_episodes``).
    Returns the new batch (docs/batch.md). A ``state.decode_hook`` (partial rollouts,
    ``rlbits.loops.staleness``) goes to ``generate(on_step=...)``.

    Raises:
        ValueError: a multi-turn task with ``state.decode_hook``, or with ``top_k``, ``top_p``,
            ``repetition_penalty``, ``min_new_tokens``, ``stop_strings`` or ``chunk_size`` set."""
    common = dict(
        num_samples=cfg.num_generations_per_prompt, generator=state.sampling_generator,
        compile=cfg.compile_generate, pack_weights=pack_weights(cfg),
        continuous_batching=cfg.continuous_batching, max_num_seqs=cfg.max_num_seqs,
    )
    on_step = getattr(state, "decode_hook", None)  # partial rollouts (rlbits.loops.staleness, eager schedule)
    if state.make_env is not None:
        _check_single_turn(cfg)
        if on_step is not None:
            raise ValueError("partial_rollouts apply to single-turn rollouts only; a multi-turn task's episodes do not")
        return run_episodes(
            policy, state.tokenizer, prompt_texts(batch), state.make_env, cfg, temperature=cfg.temperature, **common
        )
    if on_step is not None:
        common["on_step"] = on_step
    return generate_rollout(
        policy, state.tokenizer, prompt_texts(batch), chunk_size=cfg.chunk_size, **generation_options(cfg), **common
    )


def rollout(state: Any, batch: TensorDictBase, cfg: RunConfig) -> TensorDictBase:
    """The rollout phase of the online loops: ``sample`` of ``state.policy`` (through ``decoding``: its
    bfloat16 copy under ``precision: bf16``) for the prompts of ``batch``. Returns the new batch with
    ``prompts``, ``prompt_mask``, ``responses``, ``action_mask``, ``response_mask``, ``input_ids``,
    ``attention_mask``, ``logprobs``, ``group``, ``truncated``, ``prompt_text``, ``response_text`` (an episode
    batch adds ``rewards``, ``turn_rewards``, ``turn_index``, ``num_turns``, ``stop_reason``)."""
    with decoding(state, cfg) as model:
        return sample(state, batch, cfg, model)


def scoring_args(cfg: RunConfig) -> dict[str, Any]:
    """The keywords of ``policy_logprobs`` / ``critic_values`` for a scoring pass without gradient (the old,
    reference and critic passes before the update), split and packed as the update is: ``pack`` =
    ``cfg.pack_sequences``; ``max_tokens`` = ``cfg.max_tokens_per_microbatch`` when set, else
    ``microbatch_size`` = ``cfg.microbatch_size`` rows a pass. The scores equal the padded row-count
    passes' to float rounding."""
    budget = cfg.max_tokens_per_microbatch
    return {
        "microbatch_size": cfg.microbatch_size if budget is None else None,
        "max_tokens": budget,
        "pack": cfg.pack_sequences,
    }


def reference(state: Any, batch: TensorDictBase, cfg: RunConfig) -> TensorDictBase:
    """The reference phase of the online loops: ``ref_logprobs`` [B, R] of the sampled tokens under the frozen
    initial policy (``reference_model``: with LoRA the policy with its adapters disabled), split and packed as
    the update (``scoring_args``). Nothing when no term uses them (``cfg.uses_ref_logprobs`` False): the
    batch then has no ``ref_logprobs``, every KL is 0 and ``init_policy_kl`` is not logged."""
    if not cfg.uses_ref_logprobs:
        return batch
    with reference_model(state) as ref, unsharded(ref), autocast(ref, cfg):
        reference_logprobs(ref, batch, temperature=cfg.temperature, **scoring_args(cfg), **head_args(cfg))
    return batch


def rollout_correction(state: Any, batch: TensorDictBase, cfg: RunConfig) -> TensorDictBase:
    """The rollout-correction phase of the online loops, before the update (docs/rollout_correction.md).
    Nothing when ``cfg.rollout_correction`` is off (mode ``none``): the batch is returned unchanged.

    Otherwise writes ``old_logprobs`` [B, R], the trainer's own log-probs of the sampled tokens under
    ``state.policy`` as it is before the update (no gradient, eval mode, split and packed as the update:
    ``scoring_args``, in the training precision), while the sampler's stay in ``logprobs``; then the correction of
    ``cfg.rollout_correction`` (``rlbits.ROLLOUT_CORRECTIONS``) of ``old_logprobs`` against ``logprobs`` over
    ``loss_mask`` (``action_mask`` when the batch has none) writes ``rollout_is_weights`` [B, R] and
    ``loss_mask`` (rejected tokens removed). The loops' objectives take ``old_logprobs`` as the old policy
    and pass the weights to the policy loss; the update counts its denominators over ``loss_mask``.

    Adds the correction's metrics as ``rollout_corr/{name}`` (verl's names): under torchrun the maxima are
    reduced exactly and every other statistic as the ranks' token-weighted mean (exact for token means).
    """
    mode = cfg.rollout_correction_mode
    if mode == "none":
        return batch
    policy, was_training = state.policy, state.policy.training
    policy.eval()
    try:
        with torch.no_grad(), autocast(policy, cfg):
            old = policy_logprobs(policy, batch, temperature=cfg.temperature, **scoring_args(cfg), **head_args(cfg))
    finally:
        policy.train(was_training)
    batch["old_logprobs"] = old.float()  # 0 off action_mask, as policy_logprobs returns it
    mask = batch["loss_mask"] if "loss_mask" in batch.keys() else batch["action_mask"]
    weights, kept, metrics = ROLLOUT_CORRECTIONS[mode](
        batch["old_logprobs"], batch["logprobs"], mask, **cfg.rollout_correction_args
    )
    batch["rollout_is_weights"] = weights.float()
    batch["loss_mask"] = kept
    tokens = mask.sum()
    for name, value in metrics.items():
        if name.endswith("_max"):
            state.metrics.max(f"rollout_corr/{name}", value)
        else:
            state.metrics.mean(f"rollout_corr/{name}", value * tokens, tokens)
    return batch


def reference_logprobs(
    ref_policy: torch.nn.Module, batch: TensorDictBase, *, temperature: float, microbatch_size: int | None,
    max_tokens: int | None = None, pack: bool | None = None, head: str = "auto",
    head_memory_budget_mb: float = HEAD_MEMORY_BUDGET_MB,
) -> torch.Tensor:
    """Write ``ref_logprobs`` [B, R]: the frozen reference policy's logprobs of the sampled tokens
    (``microbatch_size`` rows or ``max_tokens`` tokens a pass, ``pack``ed, ``head``, ``head_memory_budget_mb``:
    see ``policy_logprobs``)."""
    with torch.no_grad():
        batch["ref_logprobs"] = policy_logprobs(
            ref_policy, batch, temperature=temperature, microbatch_size=microbatch_size, max_tokens=max_tokens,
            pack=pack, head=head, head_memory_budget_mb=head_memory_budget_mb,
        )
    return batch["ref_logprobs"]


def evaluate_policy(
    policy: torch.nn.Module,
    tokenizer: Any,
    cfg: RunConfig,
    *,
    reward: Any,
    prompts: Sequence[str],
    logits_processor: Callable | None = None,
    env: DistEnv | None = None,
    metrics: StepMetrics | None = None,
    prefix: str = "val",
    make_env: Callable[..., Any] | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """Mean reward of one response to each of the first ``max_val_samples`` of ``prompts``; with ``make_env``
    (a multi-turn task) of one episode per prompt (``run_episodes``), whose reward is the sum of its turns', and
    ``{prefix}_num_turns`` (mean policy turns per episode) is added.

    Uses its own generator (``derive_seed(seed, rank, "validation")``), so validating never shifts the
    training RNG streams (a run with and without validation samples the same training rollouts) and every
    validation of a run sees the same noise. Generation fields as the rollouts' with ``cfg.val_generation``
    over them (``generation_options``), ``cfg.val_batch_size`` prompts per ``generate`` call; greedy if
    ``cfg.val_greedy``. Under torchrun each rank validates
    every ``world_size``-th prompt and the statistics are reduced over ranks (every rank must call it).

    ``{prefix}_fraction_of_samples_properly_ended`` is NeMo-Aligner's metric of that name
    (``PPOTrainer.generate_rollouts`` in ``nemo_aligner/algorithms/ppo.py``, ``is_end.float().mean()``, logged
    for validation as ``val_rollouts/fraction_of_samples_properly_ended``): the fraction of responses (episodes)
    that are not ``truncated``, i.e. stopped by EOS or a stop string (an env's end) within their length budget.

    Returns:
        ``({"{prefix}_reward", "{prefix}_reward_std", "{prefix}_response_len",
        "{prefix}_fraction_of_samples_properly_ended"}, batch)`` (this rank's batch);
        the values are also added to ``metrics`` (as ``same``: they are global already) when given.
    """
    env = env or DistEnv()
    prompts = list(prompts)[: cfg.max_val_samples]
    prompts = prompts[env.rank :: env.world_size] or prompts[:1]
    gen = generator(cfg.seed, env.rank, "validation", next(policy.parameters()).device)
    options = generation_options(cfg, validation=True)
    continuous_batching = getattr(cfg, "continuous_batching", False)  # an online loop's field
    max_num_seqs = getattr(cfg, "max_num_seqs", None)
    with autocast(policy, cfg):
        if make_env is not None:
            _check_single_turn(cfg, validation=True)
            batch = run_episodes(
                policy, tokenizer, prompts, make_env, cfg, temperature=options["temperature"], generator=gen,
                continuous_batching=continuous_batching, max_num_seqs=max_num_seqs,
            )
        else:
            batch = generate_rollout(
                policy, tokenizer, prompts, generator=gen, logits_processor=logits_processor,
                chunk_size=getattr(cfg, "val_batch_size", None), continuous_batching=continuous_batching,
                max_num_seqs=max_num_seqs, **options,
            )
    rewards = score_rollout(batch, reward).double().cpu()
    lengths = batch["action_mask"].sum(-1).double().cpu()
    turns = batch["num_turns"].double().cpu() if make_env is not None else torch.zeros_like(rewards)
    ended = (~batch["truncated"]).double().cpu()  # NeMo-Aligner's is_end: stopped before the length budget
    n, total, squares, length, num_turns, num_ended = all_reduce_sum(
        torch.stack([
            torch.tensor(float(len(rewards)), dtype=torch.float64), rewards.sum(), rewards.square().sum(),
            lengths.sum(), turns.sum(), ended.sum(),
        ]).to(env.device),
        env,
    ).tolist()
    mean = total / n
    var = (squares - n * mean * mean) / (n - 1) if n > 1 else 0.0
    values = {f"{prefix}_reward": mean, f"{prefix}_reward_std": max(var, 0.0) ** 0.5, f"{prefix}_response_len": length / n}
    values[f"{prefix}_fraction_of_samples_properly_ended"] = num_ended / n
    if make_env is not None:
        values[f"{prefix}_num_turns"] = num_turns / n
    if metrics is not None:
        metrics.update(values)
    return values, batch


def validate_policy(state: Any, batch: TensorDictBase | None, cfg: RunConfig) -> TensorDictBase:
    """The validation phase of the online loops (PPO, REINFORCE): ``evaluate_policy`` of ``state.policy`` on
    ``state.val_prompts`` with ``state.reward`` (episodes of ``state.make_env`` for a multi-turn task); adds
    ``val_reward``, ``val_reward_std``, ``val_response_len``, ``val_fraction_of_samples_properly_ended`` (and
    ``val_num_turns``) to ``state.metrics``. ``batch`` is not read. Returns this rank's validation batch."""
    _, val_batch = evaluate_policy(
        state.policy, state.tokenizer, cfg, reward=state.reward, prompts=state.val_prompts, env=state.env,
        metrics=state.metrics, make_env=getattr(state, "make_env", None),
    )
    return val_batch


def evaluate_run(run_dir: str | Path, cfg: RunConfig) -> dict[str, dict[str, float]]:
    """``rlbits eval RUN_DIR`` of an online run (PPO, REINFORCE): ``evaluate_policy`` of ``RUN_DIR/final`` and
    of the run's initial policy (``policy_path``) on the task's test prompts, with the same noise, the run's
    reward (``cfg.resolve_reward``: its ``reward_model``, else the task's) and, for a multi-turn task, episodes.

    Returns:
        ``{"base": metrics, "final": metrics}`` with ``val_reward``, ``val_reward_std``, ``val_response_len``.
    """
    from rlbits.loops.runtime import Setup, load_policy_and_tokenizer, policy_path, setup

    env, run = setup(cfg), Setup.of(cfg)
    reward = run.reward(cfg.resolve_reward(None))
    out = {}
    for name, path in (("base", policy_path(cfg)), ("final", str(Path(run_dir) / "final"))):
        policy, tokenizer = load_policy_and_tokenizer(path, env)
        out[name], _ = evaluate_policy(
            policy, tokenizer, cfg, reward=reward, prompts=run.prompts(tokenizer, None, "test"), env=env,
            make_env=run.make_env,
        )
    return out


def kl_per_sequence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """[B]: the summed k1 KL estimate of each sequence (nats); its mean over sequences is ``init_policy_kl``."""
    return masked_sum(kl_penalty(logprobs, ref_logprobs, "k1"), action_mask, dim=-1)


def add_batch_stats(metrics: StepMetrics, batch: TensorDictBase) -> None:
    """Statistics of a rollout batch, exact over ranks: ``rewards`` (mean over rows), ``response_len`` (mean,
    and ``response_len_max``), and ``init_policy_kl`` (mean summed KL per row) when the batch has
    ``ref_logprobs``; for an episode batch also ``num_turns`` (mean) and ``stop/{reason}`` (the fraction of
    episodes that ended for each of ``STOP_REASONS``)."""
    rows = batch.batch_size[0]
    lengths = batch["action_mask"].sum(-1).float()
    if "rewards" in batch.keys():
        metrics.mean("rewards", batch["rewards"].float().sum(), rows)
    metrics.mean("response_len", lengths.sum(), rows)
    metrics.max("response_len_max", lengths.max())
    if "ref_logprobs" in batch.keys():
        kl = kl_per_sequence(batch["logprobs"], batch["ref_logprobs"], batch["action_mask"])
        metrics.mean("init_policy_kl", kl.sum(), rows)
    if "num_turns" in batch.keys():
        metrics.mean("num_turns", batch["num_turns"].float().sum(), rows)
        reasons = list(batch["stop_reason"])
        for reason in STOP_REASONS:
            metrics.mean(f"stop/{reason}", float(reasons.count(reason)), rows)


def policy_loss_stats(
    metrics: dict[str, torch.Tensor], cfg: Any, always: Sequence[str] = ("clipfrac", "approx_kl")
) -> dict[str, torch.Tensor]:
    """The metrics of a policy loss (``rlbits.POLICY_LOSSES[cfg.policy_loss]``) a loop logs: ``always``
    (``clipfrac`` 0 for a loss that reports none) and, for a loss other than ``vanilla``, every other metric it
    returns; ``vanilla`` adds only ``dual_clipfrac``, when ``policy_loss_kwargs`` sets ``clip_ratio_c``."""
    out = {"clipfrac": torch.zeros_like(metrics["approx_kl"]), **metrics}
    if cfg.policy_loss != "vanilla":
        return out
    dual = ("dual_clipfrac",) if cfg.policy_loss_kwargs.get("clip_ratio_c") is not None else ()
    return {k: out[k] for k in (*always, *dual) if k in out}


# --- dynamic sampling (DAPO; NeMo-RL's use_dynamic_sampling and batch_multiplier) ---------------------------


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G] bool: True for the groups of ``rewards`` [G * group_size] (groups contiguous) whose rewards are not
    all equal, the groups whose reward std is not 0 (they carry a learning signal). Compared exactly (max >
    min), not as a float std."""
    groups = einops.rearrange(rewards, "(g k) -> g k", k=group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)


def group_reward_stats(metrics: StepMetrics, rewards: torch.Tensor, group_size: int) -> None:
    """Statistics of one generation batch's ``rewards`` [B]: ``gen_rewards`` (mean over every batch generated
    this step) and, with ``group_size >= 2``, ``zero_std_frac`` (the fraction of groups whose rewards are all
    equal)."""
    metrics.mean("gen_rewards", rewards.sum(), rewards.numel())
    if group_size >= 2:
        informative = informative_groups(rewards, group_size)
        metrics.mean("zero_std_frac", (~informative).sum(), informative.numel())


def generation_batch_size(cfg: Any) -> int:
    """Prompts per rank of one generation batch: ``num_prompts_per_step``, and with ``cfg.dynamic_sampling``
    ``int(num_prompts_per_step * batch_multiplier)`` (NeMo-RL's dataloader batch size, grpo.py)."""
    if not getattr(cfg, "dynamic_sampling", False):
        return cfg.num_prompts_per_step
    return int(cfg.num_prompts_per_step * cfg.batch_multiplier)


def check_dynamic_sampling(cfg: Any) -> None:
    """The rules across the dynamic sampling fields of a loop's config (``dynamic_sampling``,
    ``batch_multiplier``, ``num_generations_per_prompt``).

    Raises:
        ConfigError: ``dynamic_sampling`` with fewer than 2 responses per prompt, ``batch_multiplier`` != 1
            without ``dynamic_sampling`` (NeMo-RL asserts the same), or a generation batch of more than
            ``MAX_ROWS`` responses.
    """
    if cfg.dynamic_sampling and cfg.num_generations_per_prompt < 2:
        raise ConfigError("dynamic_sampling needs num_generations_per_prompt >= 2 (a reward spread per group)")
    if cfg.batch_multiplier != 1 and not cfg.dynamic_sampling:
        raise ConfigError(
            f"batch_multiplier={cfg.batch_multiplier} needs dynamic_sampling: true (it sizes the generation "
            "batches that dynamic sampling filters)"
        )
    rows = generation_batch_size(cfg) * cfg.num_generations_per_prompt
    if rows > MAX_ROWS:
        raise ConfigError(
            f"int(num_prompts_per_step * batch_multiplier) * num_generations_per_prompt must be <= {MAX_ROWS} "
            f"responses per generation batch, got {rows}"
        )


def join_rollout(state: Any, model: torch.nn.Module | None = None) -> None:
    """Enter the collectives of a rollout of ``model`` (default ``state.policy``) without generating: a rank
    that has nothing to generate while the others do (dynamic sampling) calls it where they sample. Decoding
    itself runs no collective (``rlbits.distributed.parallelize.unsharded``); gathering the sharded model
    for it is the rollout's only one. A no-op on one process."""
    with unsharded(model if model is not None else state.policy):  # ``generate_rollout`` gathers it so
        pass


def keep_informative_groups(
    state: Any,
    batch: TensorDictBase,
    cfg: Any,
    *,
    rollout: Callable[[Any, TensorDictBase, Any], TensorDictBase],
    score: Callable[[Any, TensorDictBase, Any], TensorDictBase],
    join: Callable[[Any, Any], None] | None = None,
    exhausted: Literal["train", "error"] = "train",
) -> list[TensorDictBase]:
    """Dynamic sampling (DAPO, Yu 2025; NeMo-RL's ``dynamic_sampling`` in nemo_rl/algorithms/grpo.py): the
    groups of the scored generation ``batch``, and of more batches of ``generation_batch_size(cfg)`` prompts
    from ``state.stream`` (``rollout`` then ``score``), whose ``rewards`` are not all equal
    (``informative_groups``; the raw scores, before any shaping or scaling), until ``cfg.num_prompts_per_step``
    groups are kept or ``cfg.dynamic_sampling_max_gen_batches`` batches were generated. Returns the kept rows
    of each batch that gave some, in order: exactly ``num_prompts_per_step * num_generations_per_prompt`` rows
    in all (the informative groups past those of the batch that fills the step are dropped: NeMo-RL's cache of
    kept groups, sliced).

    The kept groups live within the step (NeMo-RL empties its cache after each step), so a step is atomic
    and a resumed run draws as the uninterrupted one (the stream position and sampling RNG are saved at the
    end of each step).

    Under torchrun each rank fills its own ``num_prompts_per_step`` groups (a group's rewards are on one
    rank). The ranks agree before every round whether it is drawn (one all-reduce of "this rank still needs
    groups"), then every rank draws its prompts from the stream, so the stream stays in step across ranks. A
    rank that is already full does not generate: it enters the collectives of the round's rollout and scoring
    (``join(state, cfg)``, default ``join_rollout``: the all-gather of the sharded policy; the agreement on a
    non-finite reward)
    and keeps nothing. Joining rather than generating and discarding keeps what each rank keeps, its stream
    position and its sampling RNG the same as when it generates only what it uses.

    When the batches run out with fewer groups kept on some rank: ``exhausted="train"`` returns what each
    rank kept (a rank that kept none returns the first ``num_prompts_per_step`` groups of its last batch:
    only a KL loss can move them); ``"error"`` raises on every rank (NeMo-RL). NeMo-RL's
    ``dynamic_sampling_max_gen_batches`` counts the batches after the first (it raises when batch max + 1
    leaves the step short); rlbits' counts them all, so NeMo-RL's m is rlbits' m + 1.

    Adds to ``state.metrics``: ``gen_batches`` (the most batches a rank generated; NeMo-RL
    ``dynamic_sampling_num_gen_batches``), ``kept_groups`` (all ranks) and ``discarded_groups`` (informative
    groups dropped by the slice, all ranks; NeMo-RL ``dynamic_sampling_num_discarded_valid_samples``, which
    counts rows).

    Raises:
        RuntimeError: with ``exhausted="error"``, some rank kept fewer than ``num_prompts_per_step`` groups
            after ``dynamic_sampling_max_gen_batches`` batches (on every rank).
    """
    env, k, n = state.env, cfg.num_generations_per_prompt, cfg.num_prompts_per_step
    kept, n_kept, n_gen, discarded, last, fresh = [], 0, 1, 0, batch, batch
    for round_ in range(cfg.dynamic_sampling_max_gen_batches):
        if round_ > 0:
            if not any_rank(n_kept < n, env):  # agreed by every rank before any rank draws
                break
            prompts = state.stream.next_batch(generation_batch_size(cfg), env)  # every rank draws
            fresh = None
            if n_kept >= n:  # full: enter the collectives the other ranks' rollout and scoring run
                join(state, cfg) if join is not None else join_rollout(state)
                with agreed(env):
                    pass
            else:
                fresh = rollout(state, prompts, cfg)
                with agreed(env), in_phase(state.step + 1, "score"):
                    fresh = score(state, fresh, cfg)
                n_gen, last = n_gen + 1, fresh
        if fresh is not None:
            informative = informative_groups(fresh["rewards"], k).nonzero().flatten()
            keep = informative[: n - n_kept]  # the cache is sliced to n groups
            discarded += informative.numel() - keep.numel()
            if keep.numel():
                rows = einops.rearrange(keep[:, None] * k + torch.arange(k, device=keep.device), "g k -> (g k)")
                kept.append(fresh[rows])
                n_kept += keep.numel()
    if exhausted == "error" and any_rank(n_kept < n, env):
        raise RuntimeError(
            f"dynamic sampling: after dynamic_sampling_max_gen_batches={cfg.dynamic_sampling_max_gen_batches} "
            f"generation batches of {generation_batch_size(cfg)} prompts a rank kept fewer than the "
            f"num_prompts_per_step={n} groups whose rewards differ (this rank: {n_kept}); raise "
            "dynamic_sampling_max_gen_batches or batch_multiplier, or use prompts whose "
            f"{k} rewards differ more often"
        )
    m = state.metrics
    m.max("gen_batches", float(n_gen))
    m.sum("kept_groups", float(n_kept))
    m.sum("discarded_groups", float(discarded))
    return kept or [last[: n * k]]


__all__ = [
    "add_batch_stats",
    "bf16_copy",
    "decoding",
    "env_options",
    "evaluate_policy",
    "evaluate_run",
    "generate_rollout",
    "generation_batch_size",
    "generation_options",
    "group_reward_stats",
    "informative_groups",
    "join_rollout",
    "keep_informative_groups",
    "kl_per_sequence",
    "pack_weights",
    "policy_loss_stats",
    "prompt_batch",
    "prompt_texts",
    "reference",
    "reference_logprobs",
    "reference_model",
    "rollout",
    "rollout_correction",
    "run_episodes",
    "sample",
    "score_rollout",
    "scoring_args",
    "validate_policy",
]
