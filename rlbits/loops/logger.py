"""What a run writes: ``metrics.jsonl``, ``samples.jsonl``, TensorBoard events, W&B, a progress bar, callbacks.

``RunLogger`` is the writing half of a run (``rlbits.loops.run.Run`` owns one). Only rank 0 writes
(``RunLogger(..., env)`` with ``env.is_main`` False makes every method a no-op except the stop flag). Callbacks (e.g. a notebook dashboard) are objects with any of ``on_metrics(step, metrics)``,
``on_samples(step, samples)`` and ``should_stop() -> bool``; the core never imports them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlbits.distributed.env import DistEnv
from rlbits.distributed.reduce import any_rank
from rlbits.loops.config import RunConfig, save_config
from rlbits.loops.rundir import RunDirClaim, claim_run_dir

ELASTIC_MARKER = ".torchelastic_run_id"
STALE_TEMPORARIES = re.compile(
    r"\.(final|offline_dataset)\.tmp-\d+-[0-9a-f]{8}"  # rlbits._io.atomic_folder's folder being written
    r"|\.(final|offline_dataset)\.old-[a-z0-9_]{8}"  # ... and the previous folder it moves aside
    r"|\.tmp_step_\d+(\.discarded)?"  # save_checkpoint's folder being written, _discard's folder being deleted
)
"""The temporary folders a killed save leaves in a run directory, which the next start deletes."""


def elastic_restart(run_dir: str | Path) -> bool:
    """True when this process is a ``torchrun --max-restarts`` restart of the job that wrote ``run_dir``
    (``TORCHELASTIC_RESTART_COUNT > 0`` and ``run_dir`` carries this job's ``TORCHELASTIC_RUN_ID``)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    marker = Path(run_dir) / ELASTIC_MARKER
    return marker.is_file() and marker.read_text().strip() == run_id


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except (json.JSONDecodeError, AttributeError):
        return math.inf  # a torn or foreign line: dropped by truncation


def _to_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().cpu().item())
    return float(value)


class RunLogger:
    """The run directory of one training run and everything written into it.

    A ``Run`` passes the ``claim`` it took on the folder (``rlbits.loops.rundir.claim_run_dir``); used on its
    own, a ``RunLogger`` claims the folder itself (``RunDirError`` if it is refused, ``RunDirLockedError``
    if a live run holds it) and releases it on ``close()``."""

    def __init__(
        self,
        cfg: RunConfig,
        env: DistEnv | None = None,
        *,
        callbacks: Sequence[Any] = (),
        resume: bool = False,
        total_steps: int | None = None,
        start_step: int = 0,
        claim: RunDirClaim | None = None,
    ) -> None:
        self.cfg = cfg
        self.env = env or DistEnv()
        self.dir = Path(cfg.run_dir)
        self.callbacks = list(callbacks)
        self._stop_requested = False
        self._writer = None
        self._wandb = None
        self._bar = None
        self._t0 = time.perf_counter()
        self._old_handlers: dict[int, Any] = {}
        self._watchdog: StopWatchdog | None = None
        self._own_claim: RunDirClaim | None = None
        if not self.env.is_main:
            return
        restarted = elastic_restart(self.dir)  # restarted by torchrun before any checkpoint: start over
        if claim is None:  # used on its own (not by a Run): check and lock the folder here
            claim = claim_run_dir(self.dir, loop=cfg.loop, resume=resume, restarted=restarted)
            self._own_claim = claim
        restarted = restarted or claim.started_over
        try:
            self._open(cfg, resume=resume, restarted=restarted, total=total_steps, start_step=start_step)
        except BaseException:
            self.close()
            raise

    def _open(
        self, cfg: RunConfig, *, resume: bool, restarted: bool, total: int | None, start_step: int
    ) -> None:
        save_config(cfg, self.dir / "config.yaml")
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # lets a torchrun restart of this job find its run
            (self.dir / ELASTIC_MARKER).write_text(os.environ["TORCHELASTIC_RUN_ID"] + "\n")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = start_step if resume else (0 if restarted else None)
            self._writer = SummaryWriter(log_dir=str(self.dir / "tensorboard"), purge_step=purge)
        if cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise ImportError('wandb=true needs the wandb package: pip install "rlbits[wandb]"') from e
            # WANDB_MODE=offline logs to run_dir/wandb without a network (`wandb sync` uploads it later).
            self._wandb = wandb.init(project=cfg.wandb_project, dir=str(self.dir), config=dataclasses.asdict(cfg), resume="allow")
        if cfg.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total or cfg.max_num_steps, initial=start_step, desc=cfg.loop, dynamic_ncols=True)
        self._remove_stale_temporaries()
        if resume:  # a run resumed at step 0 (no checkpoint yet) starts over: it logs step 0 again
            self._truncate_after(start_step if start_step > 0 else -1)
        elif restarted:
            self._truncate_after(-1)

    # --- signals: SIGINT/SIGTERM finish the current step, then checkpoint and exit ---------------------

    def install_signal_handlers(self, where: Callable[[], str] | None = None) -> None:
        """On SIGINT/SIGTERM set the stop flag instead of dying mid-step (a second SIGINT interrupts).

        Under torchrun (world size > 1) also start a ``StopWatchdog`` with ``cfg.stop_grace_s`` (unless 0): a
        rank blocked in a collective never runs a Python signal handler, so the watchdog ends the process if
        the step does not reach the stop within the grace period. ``where()`` says where the run is, for its
        message (``Run.where``)."""

        def handler(signum, frame):
            if self._stop_requested and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_requested = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. some notebook set-ups): rely on callbacks
                pass
        if self.env.world_size > 1 and self.cfg.stop_grace_s > 0 and self._old_handlers:
            self._watchdog = StopWatchdog(self.cfg.stop_grace_s, where=where)
            self._watchdog.start()

    def request_stop(self) -> None:
        self._stop_requested = True

    def honor_stop(self) -> None:
        """The run has reached the point where it saves and ends: a pending or later stop signal no longer
        starts the watchdog's countdown."""
        if self._watchdog is not None:
            self._watchdog.honor()

    @property
    def should_stop(self) -> bool:
        """True once a signal or a callback asked the run to end after the current step. Under torchrun a
        stop asked on any rank stops every rank (a collective: every rank reads it at the same points)."""
        for cb in self.callbacks:
            if hasattr(cb, "should_stop") and cb.should_stop():
                self._stop_requested = True
        self._stop_requested = any_rank(self._stop_requested, self.env)
        if self._stop_requested:
            self.honor_stop()  # every rank reached the stop: it saves and ends now
        return self._stop_requested

    # --- writing ------------------------------------------------------------------------------------

    def _truncate_after(self, step: int) -> None:
        """On resume drop lines logged after the checkpoint's step, so the files read as one run. A line
        torn by a kill mid-write (not valid JSON) is dropped too."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.dir / name
            if path.exists():
                lines = [ln for ln in path.read_text().splitlines() if ln.strip() and _step_of(ln) <= step]
                path.write_text("".join(ln + "\n" for ln in lines))

    def _remove_stale_temporaries(self) -> None:
        """Delete the temporary folders a process killed while saving left behind: they were never renamed
        into place, so nothing reads them. Only names rlbits makes are touched (``STALE_TEMPORARIES``: e.g.
        ``.final.tmp-<pid>-<hex8>``, ``checkpoints/.tmp_step_<N>``); a user's ``.cache.tmp-x`` stays."""
        for path in [*self.dir.iterdir(), *((self.dir / "checkpoints").glob(".tmp_step_*"))]:
            if STALE_TEMPORARIES.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Write one line of ``metrics.jsonl`` (with ``step`` and ``time_s``), TensorBoard and W&B scalars."""
        values = {k: _to_float(v) for k, v in metrics.items()}
        if not self.env.is_main:
            return values
        row = {"step": step, "time_s": round(time.perf_counter() - self._t0, 3), **values}
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}) + "\n")
        if self._writer is not None:
            for k, v in values.items():
                self._writer.add_scalar(k, v, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        for cb in self.callbacks:
            if hasattr(cb, "on_metrics"):
                cb.on_metrics(step, values)
        return values

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Append decoded rollouts (dicts of prompt, response, reward, ...) to ``samples.jsonl``."""
        if not self.env.is_main or not samples:
            return
        with open(self.dir / "samples.jsonl", "a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **{k: (_to_float(v) if isinstance(v, torch.Tensor) else v) for k, v in s.items()}}) + "\n")
        for cb in self.callbacks:
            if hasattr(cb, "on_samples"):
                cb.on_samples(step, list(samples))

    def progress(self, step: int, **shown: float) -> None:
        """Advance the progress bar to ``step`` and show a few numbers (reward, KL)."""
        if self._bar is None:
            return
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items()}, refresh=False)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._own_claim is not None:
            self._own_claim.release()


class StopWatchdog:
    """Ends this process when a stop signal (SIGTERM, SIGINT) is not honoured within ``grace_s`` seconds.

    A rank blocked in a collective (another rank never entered it, or died) is inside C++ code: Python runs
    no signal handler there, so the stop flag is never read and SIGTERM alone cannot end the job. The
    watchdog does not need the main thread: ``signal.set_wakeup_fd`` makes the interpreter's C-level handler
    write each signal's number to a pipe, which a daemon thread reads. On SIGTERM or SIGINT it waits
    ``grace_s`` seconds for ``honor()`` (the run reached its stop: it saves and ends); if that does not come,
    it writes one line to stderr naming the signal and ``where()`` and exits with ``os._exit(128 + signal)``,
    without a checkpoint (the state mid-step is not one; the newest checkpoint stays). ``close()`` restores
    the previous wakeup fd and stops the thread. Start it from the main thread, after the Python handlers.
    """

    def __init__(self, grace_s: float, where: Callable[[], str] | None = None) -> None:
        self.grace_s = grace_s
        self.where = where or (lambda: "")
        self._honored = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._old_fd: int | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True, name="rlbits-stop-watchdog")

    def start(self) -> None:
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()

    def honor(self) -> None:
        self._honored.set()

    def _watch(self) -> None:
        stops = {int(signal.SIGTERM), int(signal.SIGINT)}
        try:
            while True:
                data = os.read(self._read, 64)
                if not data:  # closed
                    return
                signum = next((b for b in data if b in stops), None)
                if signum is None or self._honored.is_set():
                    continue
                if self._honored.wait(self.grace_s):
                    continue
                where = self.where()
                sys.stderr.write(
                    f"rlbits: {signal.Signals(signum).name} received; {where or 'the step'} did not end within "
                    f"stop_grace_s={self.grace_s:g} s (a rank may be blocked in a collective): exiting without a "
                    "checkpoint\n"
                )
                sys.stderr.flush()
                os._exit(128 + signum)
        finally:
            os.close(self._read)

    def close(self) -> None:
        if self._old_fd is not None:
            try:
                signal.set_wakeup_fd(self._old_fd)
            except ValueError:  # not the main thread
                pass
            self._old_fd = None
        os.close(self._write)  # the thread reads EOF and ends


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl``. Raises FileNotFoundError if it is not a run directory."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is {str(run_dir)!r} a run directory?")
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
