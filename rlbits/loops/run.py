"""The lifecycle every loop shares: set-up, fresh start or exact resume, the step bookkeeping, saving, export.

A loop's ``train()`` keeps its algorithm visible and hands the rest to a ``Run``::

    with Run(cfg, callbacks=callbacks, resume=resume) as run:    # process group, seeds, resume checkpoint
        prompts, val_prompts = run.check_inputs(reward=reward, prompts=prompts, val_prompts=val_prompts)
        state = init_state(cfg, run.env, setup=run.setup, ...)    # models, optimizers, generators, data
        run.start(state, validate=validate)                       # restore a checkpoint; open the logs
        for step in run.steps(state):                             # validates at step 0; stops on signal etc.
            with run.step(state):                                 # times phases; on_nonfinite="skip"
                batch = rollout(state, state.stream.next_batch(n, run.env), cfg)
                with run.phase("score"):
                    batch = score(state, batch, cfg)
                ...
                run.end_step(state, batch)                        # log, validate, save when due
        run.finish(state)                                         # last checkpoint, RUN_DIR/final/

The run reads the state through the contract of ``rlbits.loops.state.LoopState``: ``trained_model``,
``num_samples``, ``samples_per_step(cfg)``, ``epoch``, ``count_tokens(batch)`` and the counters. Every phase
is ``phase(state, batch, cfg) -> batch``.

What the run decides, identically for every loop (docs/design.md, "Run lifecycle"):

- seeds: every random stream is ``rlbits.loops.runtime.generator(seed, rank, name)``, seeded by
  ``derive_seed(seed, rank, name)``;
- total steps: ``max_num_steps``, or fewer when ``max_num_epochs`` passes over the data end first
  (``total_steps``);
- validation at step 0 (``val_at_start``), every ``val_period`` steps and after the last step (``val_at_end``);
- a checkpoint every ``save_period`` steps, after the last step and when a stop is requested (SIGINT/SIGTERM,
  a callback's ``should_stop()``, or the step that spends ``max_time``, which also validates); ``final/`` (an HF folder of ``state.trained_model``) at the end of every
  run, stopped or not;
- a NaN/inf reward, loss or gradient (``FloatingPointError``, ``InvalidRewardError``): ``on_nonfinite="stop"``
  re-raises it (the last checkpoint stays the newest), ``"skip"`` logs ``skipped_step`` and goes on. Every
  rank takes the same decision;
- under torchrun, every collective is entered by every rank: a branch on rank-local data first agrees over
  ranks, then branches (docs/reliability.md, "Distributed runs"). A collective that fails anyway (timed out
  after ``collective_timeout_s``, or a rank died) raises ``CollectiveError`` naming the step and phase; after
  SIGTERM/SIGINT a rank whose step does not end within ``stop_grace_s`` exits (``RunLogger``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from rlbits.distributed.checkpoint import export_model, restore_checkpoint, resume_checkpoint, save_checkpoint
from rlbits.distributed.env import DistEnv, is_collective_failure
from rlbits.distributed.reduce import all_reduce_sum, any_rank
from rlbits.loops.config import RunConfig, max_time_seconds
from rlbits.loops.logger import RunLogger, elastic_restart, read_metrics
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.provenance import (
    check_lengths,
    check_resume,
    describe_inputs,
    user_prompts,
    write_provenance,
)
from rlbits.loops.rundir import (
    DiskFullError,
    RunDirClaim,
    RunDirError,
    claim_run_dir,
    disk_full,
    disk_full_error,
)
from rlbits.loops.runtime import Setup, setup
from rlbits.loops.state import LoopState
from rlbits.rollout.multiturn import episode_turns
from rlbits.rollout.score import InvalidRewardError

SKIPPABLE = (FloatingPointError, InvalidRewardError)
"""What ``on_nonfinite="skip"`` skips: non-finite losses and gradients, and invalid (e.g. NaN) rewards."""


class NonFiniteError(FloatingPointError):
    """A loss or gradient became NaN/inf; the message names the step and phase. Every loop raises it."""


class CollectiveError(RuntimeError):
    """Under torchrun, a collective failed: it timed out (``collective_timeout_s``) because the ranks disagree
    about which collectives to run or one is stuck, or another rank died. The message names the step and
    phase; the exception it was raised from is the backend's own."""


@contextlib.contextmanager
def collective_errors(step: int, phase: str, timeout_s: float | None = None) -> Iterator[None]:
    """Re-raise a failed collective inside the block (``is_collective_failure``) as ``CollectiveError``:
    ``step N, phase P: a collective timed out after T s; ...`` (or ``... failed; ...`` when a peer died),
    with the backend's first line in parentheses."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        if not is_collective_failure(e):
            raise
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        prefix = f"step {step}, phase {phase}: "
        text = text.split(": ", 2)[-1] if text.startswith("step ") else text  # drop in_phase's prefix
        if "timed out" in text.lower() or "timeout" in text.lower():
            after = f" after {timeout_s:g} s (collective_timeout_s)" if timeout_s is not None else ""
            what = (
                f"a collective timed out{after}; the ranks disagree about which collectives to run, "
                "or a rank died or is stuck"
            )
        else:
            what = "a collective failed; another rank died, or the ranks disagree about which collectives run"
        raise CollectiveError(f"{prefix}{what} ({text[:300]})") from e


class PhaseTimer:
    """Wall-clock seconds per phase: ``with timer("rollout"): ...``; ``timer.metrics()`` -> ``time/rollout``.

    Each phase is also a ``torch.profiler.record_function`` range named ``rlbits/<phase>``, so a profiler
    trace of a run shows which phase every kernel belongs to (nearly free when no profiler is running)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[str] = []

    @property
    def current(self) -> str | None:
        """The innermost phase running now (None between phases)."""
        return self._open[-1] if self._open else None

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        self._open.append(phase)
        try:
            with torch.profiler.record_function(f"rlbits/{phase}"):
                yield
        finally:
            self._open.pop()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = sum(v for k, v in self.seconds.items() if k not in ("validate", "save"))
        return out


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


@contextlib.contextmanager
def agreed(env: DistEnv, enabled: bool = True) -> Iterator[None]:
    """Under torchrun, make a skippable error inside the block raise on every rank (one all-reduce), so
    ranks skip (or stop) together instead of one waiting in the next collective for a rank that left.
    The block must run the same collectives on every rank up to where it may raise."""
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


def total_steps(cfg: RunConfig, num_samples: int | None, samples_per_step: int) -> int:
    """Steps a run takes: ``max_num_steps``, or fewer if ``max_num_epochs`` passes over ``num_samples``
    (drawn ``samples_per_step`` per step, all ranks together) end first, the last step rounded up (every
    sample is seen ``max_num_epochs`` times; that step may reach into the next pass); at least 1.
    ``num_samples`` None: no epochs, ``max_num_steps``.

    Raises:
        ValueError: ``samples_per_step`` < 1.
    """
    if num_samples is None:
        return cfg.max_num_steps
    if samples_per_step < 1:
        raise ValueError(f"samples_per_step must be >= 1, got {samples_per_step}")
    return max(1, min(cfg.max_num_steps, -(-cfg.max_num_epochs * num_samples // samples_per_step)))


class Run:
    """One training run: the process set-up, its directory and logs, and the step bookkeeping of every loop.

    Args:
        cfg: the loop's config (validated here).
        callbacks: objects with ``on_metrics(step, metrics)``, ``on_samples(step, rows)``, ``should_stop()``.
        resume: continue ``cfg.run_dir`` from its latest checkpoint (bit-exact at the same world size).
        force: also accept a ``run_dir`` that is not empty and not an rlbits run, a run of an rlbits without
            the ``.rlbits-run`` marker, or (without ``resume``) an existing run, started over
            (``rlbits.loops.rundir.check_run_dir``).

    The run directory is checked and locked first (``rlbits.loops.rundir.claim_run_dir``), before anything
    is read from or written to it; the lock is held until ``close()``.

    Raises:
        ConfigError: ``cfg`` is invalid.
        RunDirError: ``run_dir`` cannot hold this run (a file, other files, an existing run without
            ``resume`` or ``force``); RunDirLockedError: a live run holds it.
        FileNotFoundError: ``resume`` and the run has no checkpoint (a run that stopped before its first
            save starts over, with a warning).
        DiskFullError: (on leaving the ``with`` block) a write failed on a full disk.
    """

    def __init__(
        self, cfg: RunConfig, *, callbacks: Sequence[Any] = (), resume: bool = False, force: bool = False
    ) -> None:
        cfg.check()
        self.cfg = cfg
        self.dir = Path(cfg.run_dir)
        self.resume = resume
        self.logger: RunLogger | None = None
        self.env = setup(cfg)
        self.claim = self._claim_run_dir(force)
        try:
            self.checkpoint: Path | None = resume_checkpoint(cfg.run_dir, missing_ok=True) if resume else None
        except BaseException:
            self.close()
            raise
        self.callbacks = list(callbacks)
        self.timer = PhaseTimer()
        self.total = cfg.max_num_steps
        """The run's length in steps, set by ``start`` (``total_steps``)."""
        self._validate: Callable | None = None
        self._saved_step = -1
        self._stopped = False
        self._deadline: float | None = None  # time.monotonic() past which the run ends (max_time)
        self._timed_out = False
        self._step_number = 0
        self._phase_name: str | None = None
        self._prompts: tuple[list[str] | None, list[str] | None] | None = None
        self._lengths_checked = False
        self.provenance: dict[str, Any] | None = None
        """What the run is started with (``record_provenance``); ``start`` writes it to
        ``RUN_DIR/provenance.json`` on a fresh run (rank 0)."""
        self.best: list[dict[str, Any]] = []
        """With ``keep_top_k``: the best checkpoints, ``{"step", "value"}`` best first (``rank_best``); saved in
        every checkpoint's ``state.json`` (``best_checkpoints``) and restored with it."""

    # --- set-up -------------------------------------------------------------------------------------

    @functools.cached_property
    def setup(self) -> Setup:
        """The run's resolved task and prompt format (``Setup.of(cfg)``, resolved on first use)."""
        return Setup.of(self.cfg)

    def _claim_run_dir(self, force: bool) -> RunDirClaim | None:
        """The main process checks and locks the run directory (``claim_run_dir``) before anything is read
        from or written to it; under torchrun every rank raises if it refused (one all-reduce)."""
        error: BaseException | None = None
        claim = None
        if self.env.is_main:
            try:
                claim = claim_run_dir(
                    self.dir, loop=self.cfg.loop, resume=self.resume, force=force, restarted=elastic_restart(self.dir)
                )
            except (OSError, ValueError) as e:
                error = e
        if any_rank(error is not None, self.env):
            raise error if error is not None else RunDirError(f"rank 0 refused run_dir {str(self.dir)!r}")
        return claim

    def check_inputs(
        self, *, reward: Any, prompts: Sequence[str] | None, val_prompts: Sequence[str] | None,
        samples: Sequence[Any] | None = None, optional: Sequence[str] = (),
    ) -> tuple[list[str] | None, list[str] | None]:
        """The user's inputs, checked before any model is loaded: the prompts and validation prompts (the
        ``val_prompts`` argument, else the config's file; ``check_prompts`` names a bad one) and, on a resumed
        run, that the reward, prompts (and ILQL's samples) are the ones it was started with
        (``provenance.json``; ``optional``: inputs a resume may leave out). Returns ``(prompts, val_prompts)``
        as lists, or None for the task's.

        Raises:
            PromptError: a bad prompt. ResumeMismatchError: a resume with other inputs.
        """
        prompts, val_prompts = user_prompts(self.cfg, prompts, val_prompts)
        given = {"prompts": prompts, "samples": samples}
        record = describe_inputs(
            self.cfg, reward=reward, prompts=prompts, val_prompts=val_prompts, samples=samples, task=self.setup.task
        )
        self.record_provenance(record, not_given=[k for k in optional if given.get(k) is None])
        self._prompts = (prompts, val_prompts)
        return prompts, val_prompts

    def record_provenance(self, record: dict[str, Any], *, not_given: Sequence[str] = ()) -> None:
        """Record what the run is started with (``record``: JSON values, e.g. ``describe_inputs``); ``start``
        writes it to ``RUN_DIR/provenance.json`` on a fresh run. On a resumed run, first compare it with the
        recorded one (``check_resume``; ``not_given``: entries this call left out, which are not compared).

        Raises:
            ResumeMismatchError: a resumed run given other inputs (unless ``allow_changed_inputs``).
        """
        if self.checkpoint is not None:
            check = {k: v for k, v in record.items() if k not in not_given}
            allow = getattr(self.cfg, "allow_changed_inputs", False)
            check_resume(self.cfg.run_dir, check, allow_changed=allow, optional=not_given)
        self.provenance = record

    def check_lengths(self, state: LoopState) -> None:
        """Every user prompt plus ``max_new_tokens`` fits the context of ``state.trained_model``, once it is
        loaded and before the first step (``start`` calls it if the loop has not)."""
        if self._prompts is not None and not self._lengths_checked:
            check_lengths(state.trained_model, state.tokenizer, self.cfg, *self._prompts, task=self.setup.task)
        self._lengths_checked = True

    def start(self, state: LoopState, *, validate: Callable) -> None:
        """Restore ``state`` from the resume checkpoint (if any; ``restore_checkpoint``: a checkpoint that does
        not load, for any reason, is skipped with a warning and the previous one loaded), open the run
        directory's logs at its step and install the SIGINT/SIGTERM handlers.

        Args:
            state: the loop's freshly built state.
            validate: the loop's validation phase ``validate(state, batch, cfg) -> batch``.

        The run's length is ``total_steps(cfg, state.num_samples, state.samples_per_step(cfg))`` (``self.total``).

        Raises:
            CheckpointError: resuming, and no checkpoint of the run loads.
        """
        self.check_lengths(state)
        self._validate = validate
        self.total = total_steps(self.cfg, state.num_samples, state.samples_per_step(self.cfg))
        if self.checkpoint is not None:  # the newest that loads; each one that does not is skipped, warned
            self.checkpoint, saved = restore_checkpoint(
                self.cfg.run_dir, newest=self.checkpoint, models=state.models, optimizers=state.optimizers,
                generators=state.generators, env=self.env, check_state=functools.partial(_check_saved, state),
            )
            state.load_counters(saved)
            if self.cfg.keep_top_k is not None:
                self.best = check_best(saved.get("best_checkpoints", []), state.step)[: self.cfg.keep_top_k]
            self._saved_step = state.step
        self.logger = RunLogger(
            self.cfg, self.env, callbacks=self.callbacks, resume=self.resume, total_steps=self.total,
            start_step=state.step, claim=self.claim,
        )
        self.logger.install_signal_handlers(where=self.where)
        if self.provenance is not None and self.checkpoint is None and self.env.is_main:
            write_provenance(self.dir, self.provenance)  # a fresh run: what it was started with

    # --- the step loop --------------------------------------------------------------------------------

    def where(self) -> str:
        """Where the run is, for messages: ``step N, phase P`` (``between phases`` outside one)."""
        return f"step {self._step_number}, phase {self.timer.current or 'between phases'}"

    def _collectives(self, step: int, name: str) -> contextlib.AbstractContextManager:
        """A failed collective inside becomes a ``CollectiveError`` naming ``step`` and ``name``."""
        return collective_errors(step, name, self.cfg.collective_timeout_s)

    def _section(self, name: str) -> contextlib.AbstractContextManager:
        """Time ``name`` and turn a failed collective inside into a ``CollectiveError`` naming it."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.timer(name))
        stack.enter_context(self._collectives(self._step_number, name))
        return stack

    def timed(self, name: str) -> contextlib.AbstractContextManager:
        """Time the block as ``name`` without the phase's error handling (set-up work before the first step,
        such as ILQL's offline set); its seconds are ``elapsed(name)``."""
        return self.timer(name)

    def elapsed(self, name: str) -> float:
        """Seconds spent in ``name`` (a ``phase`` or ``timed`` block) since this step began (before the first
        step: since the run began); 0.0 if it did not run."""
        return self.timer.seconds.get(name, 0.0)

    @property
    def should_stop(self) -> bool:
        """True once a signal or a callback asked the run to end (agreed over ranks)."""
        return self.logger is not None and self.logger.should_stop

    def done(self, state: LoopState) -> bool:
        """The run has taken its last step: ``total_steps`` reached or ``max_num_epochs`` passes consumed."""
        return state.step >= self.total or (state.epoch or 0) >= self.cfg.max_num_epochs

    def steps(self, state: LoopState) -> Iterator[int]:
        """Log step 0 (the validation before training when ``val_at_start``, and any statistics the loop
        added to ``state.metrics`` before its first step), unless resumed past it; then yield the number of
        each step to take until the run is done or a stop is requested."""
        if state.step == 0:  # step 0: the validation before training, and what the loop measured before it
            with self._collectives(0, "validate"):
                val_batch = self._validate(state, None, self.cfg) if self.cfg.val_at_start else None
                values = state.metrics.reduce(self.env)
            if self.cfg.val_at_start and self.cfg.keep_top_k is not None:
                self._metric(values)  # a metric validation does not log fails before the first step
            if values:
                state.val_reward = values.get("val_reward", state.val_reward)
                self.logger.log(0, values)
                rows = sample_rows(val_batch, self.cfg.log_samples, split="test", tokenizer=state.tokenizer)
                self.logger.log_samples(0, rows)
        if self.cfg.max_time is not None:
            self._deadline = time.monotonic() + max_time_seconds(self.cfg.max_time)
        stop = self.should_stop
        while not self.done(state) and not stop:
            yield state.step + 1
            stop = self._stopped

    @contextlib.contextmanager
    def step(self, state: LoopState) -> Iterator[None]:
        """One training step: fresh metrics and timer; with ``on_nonfinite="skip"`` a skippable error (agreed
        over ranks) ends the step early, logged as ``skipped_step``, and the run goes on."""
        state.metrics = StepMetrics()
        self.timer = PhaseTimer()
        self._step_number = state.step + 1
        try:
            yield
        except SKIPPABLE as e:
            if self.cfg.on_nonfinite != "skip":
                raise
            state.step += 1
            warnings.warn(f"skipping step {state.step}: {e}", stacklevel=3)
            self.logger.log(state.step, {"skipped_step": 1.0})
            self._stopped = self.should_stop

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time phase ``name`` and name the step and phase in any error raised inside (a failed collective:
        ``CollectiveError``). Under torchrun a skippable error on one rank raises on every rank at the end of
        the phase (one all-reduce), so all ranks skip (``on_nonfinite="skip"``) or stop together."""
        with self._section(name), agreed(self.env), in_phase(self._step_number, name):
            yield

    def end_step(self, state: LoopState, batch: TensorDictBase) -> dict[str, float]:
        """Close a step: advance the counters, reduce and log its metrics (once, over all ranks), validate
        and save when due. Returns the logged values."""
        state.step += 1
        with self._collectives(state.step, "log"):
            count = torch.as_tensor(state.count_tokens(batch), dtype=torch.float32, device=self.env.device)
            num_tokens = int(all_reduce_sum(count, self.env).item())
            state.total_valid_tokens += num_tokens
            if state.epoch is not None:
                state.metrics.same("epoch", float(state.epoch))
            logged = state.metrics.reduce(self.env)
            if self._deadline is not None:  # rank 0's clock decides, as NeMo-Aligner's Timer broadcasts it
                self._timed_out = any_rank(self.env.is_main and time.monotonic() >= self._deadline, self.env)
            last = self.done(state) or self.should_stop or self._timed_out  # a stop asked during the step too
        val_batch, best = None, False
        if (self.cfg.val_period and state.step % self.cfg.val_period == 0) or (self.cfg.val_at_end and last):
            state.metrics = StepMetrics()
            with self._section("validate"):
                val_batch = self._validate(state, None, self.cfg)
                val = state.metrics.reduce(self.env)
            state.val_reward = val.get("val_reward", state.val_reward)
            logged.update(val)
            best = self._rank(state.step, val)
        logged.update(self.timer.metrics())
        logged["tokens_per_s"] = num_tokens / max(logged["time/step"], 1e-9)
        self.logger.log(state.step, logged)
        rows = sample_rows(batch, self.cfg.log_samples, tokenizer=state.tokenizer)
        rows += sample_rows(val_batch, self.cfg.log_samples, split="test", tokenizer=state.tokenizer)
        self.logger.log_samples(state.step, rows)
        self.logger.progress(
            state.step, **{k: logged[k] for k in ("rewards", "init_policy_kl", "loss") if k in logged}
        )
        with self._collectives(state.step, "save"):
            # a stop asked while logging (a dashboard's button) saves too; so does a spent max_time
            self._stopped = self.should_stop or self._timed_out
            due = self.cfg.save_period and state.step % self.cfg.save_period == 0
            if due or last or self._stopped or best:  # a checkpoint in the top k is saved at its step
                self.save(state)
        return logged

    # --- checkpoints and export -------------------------------------------------------------------------

    def _rank(self, step: int, val: dict[str, float]) -> bool:
        """With ``keep_top_k``: rank this step's validation by ``metric_name`` among the best checkpoints
        (``self.best``, ``rank_best``); whether it entered the top k (its checkpoint is then saved).

        Raises:
            ValueError: the validation did not log ``metric_name`` (naming what it logged).
        """
        cfg = self.cfg
        if cfg.keep_top_k is None:
            return False
        value = self._metric(val)
        if value is None or not math.isfinite(value):  # a NaN ranks nowhere
            return False
        self.best = rank_best(self.best, step, value, cfg.keep_top_k, cfg.higher_is_better)
        return any(e["step"] == step for e in self.best)

    def _metric(self, val: dict[str, float]) -> float | None:
        """``metric_name``'s value in a validation's logged values.

        Raises:
            ValueError: the validation did not log it (naming what it logged).
        """
        if self.cfg.metric_name not in val:
            raise ValueError(
                f"metric_name {self.cfg.metric_name!r} (keep_top_k) was not logged by validation; it logged "
                f"{', '.join(sorted(val)) or 'nothing'}"
            )
        return val[self.cfg.metric_name]

    def save(self, state: LoopState) -> Path:
        """Checkpoint ``state`` as a whole to ``RUN_DIR/checkpoints/step_N`` (every rank calls it), keeping the
        newest ``keep_checkpoints`` and the best (``self.best``); with ``keep_top_k`` the main process then
        writes ``RUN_DIR/checkpoints/best.json`` (``BEST_FILE``)."""
        extra = {"best_checkpoints": self.best} if self.cfg.keep_top_k is not None else {}
        path = save_checkpoint(
            self.cfg.run_dir, state.step, models=state.models, optimizers=state.optimizers,
            state={**state.counters(), "total_steps": self.total, **extra}, generators=state.generators,
            tokenizer=state.tokenizer, keep=self.cfg.keep_checkpoints, env=self.env,
            checksums=self.cfg.checkpoint_checksums, hf_folders=self.cfg.checkpoint_hf_folders,
            protect=[e["step"] for e in self.best],
        )
        if extra and self.env.is_main:
            write_best(self.dir, self.best, self.cfg)
        self._saved_step = state.step
        return path

    def finish(
        self, state: LoopState, *, model: torch.nn.Module | None = None, build: Callable | None = None
    ) -> Path:
        """End the run: checkpoint the last step if it is not saved yet, then export ``model`` (default
        ``state.trained_model``) with the tokenizer to ``RUN_DIR/final/`` (``build`` makes an unsharded
        replica, for FSDP2; default ``state.export_replica(cfg)``). Returns the run directory."""
        if self.logger is not None:
            self.logger.honor_stop()  # the run ends here: a stop signal now lets it save and export
        with self._collectives(state.step, "save"):
            if self._saved_step != state.step:
                self.save(state)
            export_model(
                model if model is not None else state.trained_model, self.dir / "final", tokenizer=state.tokenizer,
                env=self.env, build=build if build is not None else functools.partial(state.export_replica, self.cfg),
            )
        return self.dir

    def close(self) -> None:
        """Close the logs and release the run directory's lock (every exit, normal or not)."""
        try:
            if self.logger is not None:
                self.logger.close()
        finally:
            if self.claim is not None:
                self.claim.release()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """Close the run; a full disk (``ENOSPC``, however deeply wrapped) raised inside becomes one
        ``DiskFullError`` naming the run directory (the checkpoints already saved are intact)."""
        self.close()
        full = disk_full(exc) if exc is not None and not isinstance(exc, DiskFullError) else None
        if full is not None:
            raise disk_full_error(self.dir, full) from exc


BEST_FILE = "checkpoints/best.json"
"""Under the run directory, with ``keep_top_k``: ``{"metric_name", "higher_is_better", "keep_top_k",
"best": [{"step", "value", "checkpoint"}]}``, the best checkpoints best first (``checkpoint``: the folder,
relative to the run directory), rewritten at every save."""


def rank_best(
    best: list[dict[str, Any]], step: int, value: float, k: int, higher_is_better: bool
) -> list[dict[str, Any]]:
    """``best`` (``{"step", "value"}`` entries, best first) with ``step``'s ``value`` added, sorted and cut to
    the top ``k``, as NeMo-RL's ``CheckpointManager.remove_old_checkpoints`` ranks them: by value (larger first
    when ``higher_is_better``), equal values by step, the later first. A new entry for a step already listed
    (a redone step) replaces it."""
    entries = [e for e in best if e["step"] != step] + [{"step": step, "value": value}]
    sign = -1.0 if higher_is_better else 1.0
    return sorted(entries, key=lambda e: (sign * e["value"], -e["step"]))[:k]


def check_best(saved: Any, step: int) -> list[dict[str, Any]]:
    """The ``best_checkpoints`` of a restored checkpoint of ``step``: a list of ``{"step": int <= step,
    "value": finite float}``.

    Raises:
        ValueError: another shape (naming what it is).
    """
    ok = isinstance(saved, list) and all(
        isinstance(e, dict) and set(e) == {"step", "value"} and type(e["step"]) is int and 0 < e["step"] <= step
        and isinstance(e["value"], (int, float)) and not isinstance(e["value"], bool) and math.isfinite(e["value"])
        for e in saved
    )
    if not ok:
        raise ValueError(f"best_checkpoints must be a list of {{step, value}} up to step {step}, got {saved!r:.200}")
    return [{"step": e["step"], "value": float(e["value"])} for e in saved]


def _check_saved(state: LoopState, saved: dict[str, Any]) -> None:
    """What ``restore_checkpoint`` checks of a ``state.json`` before loading it: the state's counters and the
    best checkpoints (a checkpoint failing either is skipped for the previous one)."""
    state.check_counters(saved)
    check_best(saved.get("best_checkpoints", []), saved.get("step", 0))


def write_best(run_dir: Path, best: list[dict[str, Any]], cfg: RunConfig) -> None:
    """Write ``BEST_FILE`` (atomically: a temporary file renamed into place)."""
    path = run_dir / BEST_FILE
    rows = [{**e, "checkpoint": f"checkpoints/step_{e['step']}"} for e in best]
    text = json.dumps({
        "metric_name": cfg.metric_name, "higher_is_better": cfg.higher_is_better, "keep_top_k": cfg.keep_top_k,
        "best": rows,
    }, indent=1)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def sample_rows(
    batch: TensorDictBase | None, n: int, split: str | None = None, tokenizer: Any = None
) -> list[dict[str, Any]]:
    """The first ``n`` rows of a batch as dicts (prompt, response, reward, policy_version) for ``samples.jsonl``,
    each tagged ``split`` when given (``"test"``: a validation batch).

    An episode batch (``generate_episodes``: it has ``turn_index``) adds ``num_turns``, ``stop_reason`` and,
    given the ``tokenizer``, ``turns``: ``episode_turns`` of the row (each turn's action and observation text
    and reward), which the rollout browser draws turn by turn."""
    if batch is None or "prompt_text" not in batch.keys() or "response_text" not in batch.keys():
        return []
    episodes = "turn_index" in batch.keys()
    rows = []
    for i in range(min(n, batch.batch_size[0])):
        row = {"split": split} if split is not None else {}
        row.update(prompt=batch["prompt_text"][i], response=batch["response_text"][i])
        if "rewards" in batch.keys():
            row["reward"] = float(batch["rewards"][i])
        if "policy_version" in batch.keys():
            row["policy_version"] = int(batch["policy_version"][i])
        if episodes:
            row["num_turns"] = int(batch["num_turns"][i])
            row["stop_reason"] = str(batch["stop_reason"][i])
            if tokenizer is not None:
                row["turns"] = episode_turns(batch, i, tokenizer)
        rows.append(row)
    return rows


__all__ = [
    "BEST_FILE",
    "SKIPPABLE",
    "CollectiveError",
    "NonFiniteError",
    "PhaseTimer",
    "Run",
    "RunLogger",
    "agreed",
    "check_best",
    "collective_errors",
    "elastic_restart",
    "in_phase",
    "rank_best",
    "read_metrics",
    "sample_rows",
    "total_steps",
    "write_best",
]
