"""``rlbits serve-critic``: PPO's critic and its optimizer behind HTTP, as NeMo-Aligner serves it
(``serve_ppo_critic.py``, ``CriticServerTrainer``: infer, train and save endpoints, one request at a time).

The critic is built as PPO's local critic is (``rlbits.loops.ppo``: ``load_critic`` from the config's initial
policy, ``critic_with_optimizer``), answers values with ``critic_estimates`` and trains with ``optimize`` on
``critic_objective`` and ``critic_trained``: the functions the local critic runs, so a run with
``critic_server`` gives the local critic's numbers. The routes (``JSONServer``: bearer token, size cap, JSON
errors; docs/critic_server.md):

- ``POST /info`` ``{}`` -> ``{"update": n, "config": {...}}`` (``critic_config``: the client compares it);
- ``POST /values`` ``{"update", "input_ids", "attention_mask", "responses", "action_mask"}`` ->
  ``{"values": [[...]]}`` [B, R];
- ``POST /train`` ``{"update", "step", "run_length", "generator", ...TRAIN_KEYS, "loss_mask"?}`` ->
  ``{"update", "metrics", "generator"}``: ``ppo_epochs x num_minibatches`` optimizer steps; the checkpoint is
  written before the answer (every ``save_every`` updates);
- ``POST /save`` ``{}`` -> ``{"update": n, "path": "..."}``.

``update`` counts the training requests applied: a request for another update than the server holds gets
409 (a run and a server that disagree), except a repeat of the last training request, answered from memory
(a client retrying after a lost answer). The checkpoint (``DIR/critic.pt``: weights, optimizer state, update
counter and last answer, written to a temporary file and renamed) is loaded on start when present.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from rlbits.distributed.env import DistEnv
from rlbits.loops.critic_client import (
    CONFLICT,
    NONFINITE,
    TRAIN_KEYS,
    VALUE_KEYS,
    critic_config,
    decode_generator,
    decode_tensor,
    encode_generator,
)
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.online import initial_policy
from rlbits.loops.ppo import (
    PPOConfig,
    critic_estimates,
    critic_objective,
    critic_trained,
    critic_with_optimizer,
    update_mask,
)
from rlbits.loops.run import NonFiniteError
from rlbits.loops.runtime import Setup, load_critic
from rlbits.loops.update import optimize
from rlbits.rollout.reward_server import JSONServer, RequestError

CHECKPOINT = "critic.pt"
"""The checkpoint's file name in the server's folder."""
DEFAULT_MAX_REQUEST_BYTES = 1 << 30
"""A training request holds the whole rollout batch as JSON (tens of bytes per token and key)."""

_DTYPES = {
    "input_ids": torch.long, "responses": torch.long, "group": torch.long, "attention_mask": torch.bool,
    "action_mask": torch.bool, "loss_mask": torch.bool, "values": torch.float32, "returns": torch.float32,
}


@dataclasses.dataclass
class _Trainee:
    """What ``optimize`` and ``critic_objective`` read from a loop state."""

    value_model: torch.nn.Module
    env: DistEnv
    step: int
    metrics: StepMetrics = dataclasses.field(default_factory=StepMetrics)


class CriticServer(JSONServer):
    """The critic of ``cfg`` and its optimizer behind the routes of the module docstring.

    Args:
        cfg: the run's ``PPOConfig`` (``critic_config`` fields must equal the client's).
        directory: the checkpoint folder; its ``critic.pt`` is loaded when present, else the fresh critic is
            saved there at once.
        env: the process (device); default one CPU process.
        save_every: write the checkpoint after every this-many training requests (1: after each, before the
            answer, so a server killed at any time restarts at the update the run expects).
        host, port, token, max_request_bytes, request_timeout, log_requests: as ``JSONServer``.

    Raises:
        ValueError: ``save_every < 1``; the ``JSONServer`` errors.
        ConfigError: ``critic_init`` is neither ``policy`` nor a folder.
    """

    kind = "critic"

    def __init__(
        self,
        cfg: PPOConfig,
        directory: str | os.PathLike,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        env: DistEnv | None = None,
        token: str | None = None,
        save_every: int = 1,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        request_timeout: float = 600.0,
        log_requests: bool = False,
    ):
        if not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"save_every must be an int >= 1, got {save_every!r}")
        self.cfg, self.env, self.save_every = cfg, env if env is not None else DistEnv(), save_every
        self.directory = Path(directory)
        _, policy, _, _ = initial_policy(cfg, self.env, Setup.of(cfg), reference=False)
        self.value_model, self.optimizer = critic_with_optimizer(load_critic(cfg, policy, self.env), cfg, self.env)
        del policy
        self.update, self.last_answer = 0, None
        self.lock = threading.Lock()  # one request at a time (NeMo-Aligner's lock_method)
        if (self.directory / CHECKPOINT).is_file():
            self._load()
        else:
            self.save()
        super().__init__(
            host, port, token=token, max_request_bytes=max_request_bytes, request_timeout=request_timeout,
            log_requests=log_requests,
        )

    @property
    def post_routes(self) -> dict:
        return {"/info": self._info, "/values": self._values, "/train": self._train, "/save": self._save}

    # --- checkpoint

    def save(self) -> Path:
        """Write ``DIR/critic.pt`` (weights, optimizer, update counter, last answer) atomically; its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path, tmp = self.directory / CHECKPOINT, self.directory / f"{CHECKPOINT}.tmp"
        torch.save(
            {"model": self.value_model.state_dict(), "optimizer": self.optimizer.state_dict(),
             "update": self.update, "last_answer": self.last_answer, "config": critic_config(self.cfg)},
            tmp,
        )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def _load(self) -> None:
        saved = torch.load(self.directory / CHECKPOINT, map_location=self.env.device, weights_only=True)
        if saved.get("config") != critic_config(self.cfg):
            raise ValueError(
                f"{self.directory / CHECKPOINT} was written by a critic server of another config; start this "
                "one with the same config or another folder"
            )
        self.value_model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.update, self.last_answer = saved["update"], saved["last_answer"]

    # --- routes

    def _info(self, request: Any) -> dict:
        _object(request)
        with self.lock:
            return {"update": self.update, "config": critic_config(self.cfg)}

    def _save(self, request: Any) -> dict:
        _object(request)
        with self.lock:
            return {"update": self.update, "path": str(self.save())}

    def _values(self, request: Any) -> dict:
        batch = self._batch(request, VALUE_KEYS)
        with self.lock:
            self._expect(request, "values")
            return {"values": critic_estimates(self.value_model, batch, self.cfg).tolist()}

    def _train(self, request: Any) -> dict:
        keys = TRAIN_KEYS + (("loss_mask",) if isinstance(request, dict) and "loss_mask" in request else ())
        batch = self._batch(request, keys)
        step, run_length = _int(request, "step", 0), _int(request, "run_length", 1)
        try:
            generator = torch.Generator().set_state(decode_generator(request.get("generator")))
        except (ValueError, RuntimeError) as e:
            raise RequestError(400, str(e)) from None
        with self.lock:
            last = self.last_answer
            if last is not None and request["update"] == last["update"]:  # a retry of the last request
                return last
            self._expect(request, "train")
            trainee = _Trainee(self.value_model, self.env, step)
            trained = critic_trained(self.value_model, self.optimizer, self.cfg, step, run_length)
            try:
                optimize(
                    trainee, batch, self.cfg, critic_objective, trained=[trained], epochs=self.cfg.ppo_epochs,
                    num_minibatches=self.cfg.num_minibatches, shuffle=generator, mask=update_mask(batch),
                )
            except NonFiniteError as e:  # back to the critic before this request, as saved
                self._load()
                raise RequestError(NONFINITE, f"{e}; the critic is back at update {self.update}") from None
            except ValueError as e:  # e.g. more minibatches than groups
                self._load()
                raise RequestError(400, str(e)) from None
            answer = {
                "update": self.update, "metrics": trainee.metrics.reduce(self.env),
                "generator": encode_generator(generator),
            }
            self.update, self.last_answer = self.update + 1, answer
            if self.update % self.save_every == 0:  # before the answer: a restart resumes at this update
                self.save()
            return answer

    def _expect(self, request: dict, what: str) -> None:
        if request["update"] != self.update:
            raise RequestError(
                CONFLICT,
                f"{what} request for critic update {request['update']}, but this server holds update "
                f"{self.update} (checkpoint {self.directory / CHECKPOINT}): the run and the server disagree; "
                "restart the server from the checkpoint of the run's update, or the run from the server's",
            )

    def _batch(self, request: Any, keys: tuple[str, ...]) -> TensorDict:
        _object(request)
        _int(request, "update", 0)
        fields = {}
        for key in keys:
            if key not in request:
                raise RequestError(400, f"missing field {key!r} (a tensor as nested lists)")
            try:
                fields[key] = decode_tensor(request[key], key, _DTYPES[key], self.env.device)
            except ValueError as e:
                raise RequestError(400, str(e)) from None
        rows = fields["input_ids"].shape[0] if fields["input_ids"].dim() == 2 else -1
        if rows < 1:
            raise RequestError(400, "field 'input_ids' must be [B, P + R] with B >= 1")
        width = fields["responses"].shape[-1] if fields["responses"].dim() == 2 else -1
        for key, value in fields.items():
            if key == "group":
                shape = (rows,)
            elif key in ("input_ids", "attention_mask"):
                shape = tuple(fields["input_ids"].shape)
            else:
                shape = (rows, width)
            if tuple(value.shape) != shape:
                raise RequestError(400, f"field {key!r} has shape {list(value.shape)}; expected {list(shape)}")
        return TensorDict(fields, batch_size=[rows], device=self.env.device)


def _object(request: Any) -> None:
    if not isinstance(request, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(request).__name__}")


def _int(request: dict, key: str, least: int) -> int:
    value = request.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise RequestError(400, f"field {key!r} must be an int >= {least}, got {str(value)[:40]}")
    return value


__all__ = ["CHECKPOINT", "DEFAULT_MAX_REQUEST_BYTES", "CriticServer"]
