"""The PPO loop's side of the remote critic: ``CriticClient`` asks an ``rlbits serve-critic`` server
(``rlbits.loops.critic_server``) for values and sends it the critic's training, as NeMo-Aligner's actor does
(``RemoteGPTRMCriticClient``: values requested as futures with the rewards, critic training sent after each
rollout). docs/critic_server.md has the protocol and what makes the remote critic give the local critic's
numbers.

The JSON forms here are shared by both sides: ``encode_tensors`` / ``decode_tensor`` (a tensor as a nested
list: float32 values print as the shortest decimal that reads back to the same float, so they travel
exactly), ``encode_generator`` / ``decode_generator`` (a CPU generator's state in base64) and
``critic_config`` (the config fields both sides must agree on).
"""

from __future__ import annotations

import base64
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from tensordict import TensorDictBase

from rlbits.loops.config import ConfigError
from rlbits.loops.run import NonFiniteError
from rlbits.rollout.reward_client import RewardClient
from rlbits.rollout.reward_errors import RewardServerError

TOKEN_ENV = "RLBITS_CRITIC_TOKEN"
"""The environment variable ``CriticClient`` reads the critic server's bearer token from."""

VALUE_KEYS = ("input_ids", "attention_mask", "responses", "action_mask")
"""The batch keys of a values request (what ``critic_values`` reads)."""

TRAIN_KEYS = (*VALUE_KEYS, "group", "values", "returns")
"""The batch keys of a training request (``loss_mask`` too when the batch has one): the critic's forward, the
groups ``split_minibatches`` keeps whole, the old values and the return targets."""

CRITIC_FIELDS = (
    "policy", "task", "critic_init", "seed", "precision", "compile", "microbatch_size", "max_grad_norm",
    "learning_rate", "critic_learning_rate", "weight_decay", "critic_weight_decay", "adam_betas", "adam_eps",
    "lr_scheduler", "lr_warmup_steps", "lr_warmup_start_factor", "critic_lr_warmup_steps",
    "critic_lr_warmup_start_factor", "lr_constant_steps", "min_lr", "lr_max_steps", "ppo_epochs", "num_minibatches",
    "vf_coef", "value_clip_eps", "loss_agg", "loss_scale_factor", "lora_rank", "lora_alpha", "lora_dropout",
    "lora_target_modules",
)
"""The ``PPOConfig`` fields that shape the critic, its optimizer and its update: the client refuses a server
whose config differs in any of them (``CriticClient.check_config``)."""

CONFLICT = 409
"""The status of a request for another critic update than the server holds."""
NONFINITE = 422
"""The status of a training request whose loss or gradient norm was not finite."""


class CriticServerError(RuntimeError):
    """The critic server could not be reached in time, refused a request or broke the protocol; the message
    names the URL. ``status`` is the HTTP status, or None when no answer came back."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def critic_config(cfg: Any) -> dict[str, Any]:
    """The ``CRITIC_FIELDS`` of ``cfg`` as JSON values (tuples as lists)."""
    return json.loads(json.dumps({name: getattr(cfg, name) for name in CRITIC_FIELDS if hasattr(cfg, name)}))


def encode_tensors(batch: TensorDictBase, keys: tuple[str, ...]) -> dict[str, list]:
    """``{key: nested list}`` of ``batch``'s ``keys`` (bool masks as true/false, ints, float32 values)."""
    return {key: batch[key].tolist() for key in keys}


def decode_tensor(value: Any, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A nested list back to a tensor of ``dtype``.

    Raises:
        ValueError: ``value`` is not a rectangular list of numbers (the message names ``name``).
    """
    if not isinstance(value, list):
        raise ValueError(f"field {name!r} must be a list (a tensor as nested lists), got {type(value).__name__}")
    try:
        return torch.tensor(value, dtype=dtype, device=device)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"field {name!r} is not a rectangular list of numbers: {str(e)[:200]}") from None


def encode_generator(generator: torch.Generator) -> str:
    """A CPU generator's state as base64 text."""
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def decode_generator(text: Any, name: str = "generator") -> torch.Tensor:
    """The state ``encode_generator`` wrote (a uint8 tensor for ``Generator.set_state``).

    Raises:
        ValueError: ``text`` is not base64 of a CPU generator's state (the message names ``name``).
    """
    expected = torch.Generator().get_state().numel()
    try:
        raw = base64.b64decode(text, validate=True)
    except (TypeError, ValueError):
        raise ValueError(f"field {name!r} must be base64 text of a generator state") from None
    if len(raw) != expected:
        raise ValueError(f"field {name!r} holds {len(raw)} bytes; a CPU generator state has {expected}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class CriticClient:
    """The client of a critic server (docs/critic_server.md).

    Args:
        url: the server's base URL, ``http(s)://host:port``.
        token: its bearer token; None reads ``$RLBITS_CRITIC_TOKEN`` (unset: no token).
        timeout: seconds one answer may take, and also how long an unreachable server (a restart) or a 5xx
            answer is retried, once a second, before ``CriticServerError`` names the URL. A retried training
            request is applied once: the server answers a repeat of its last update from memory.

    Raises:
        ValueError: ``url`` is not ``http(s)://host[:port]`` or ``timeout`` is not positive.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0):
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.http = RewardClient(url, token=token, timeout=timeout, retries=0)
        self.url = self.http.url
        self.timeout = float(timeout)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="critic-client")
        self._prefetched: tuple[TensorDictBase, int, Future] | None = None

    def __repr__(self) -> str:
        return f"CriticClient({self.url!r}, timeout={self.timeout})"

    def post(self, path: str, payload: dict) -> dict:
        """``POST path`` with the JSON ``payload``; the JSON object answered. Connection errors and 5xx answers
        are retried once a second for ``timeout`` seconds (the server may be restarting from its checkpoint).

        Raises:
            CriticServerError: a 4xx answer (the server's message quoted), no answer within ``timeout``, or an
                answer that is not a JSON object.
            NonFiniteError: the server's training met a non-finite loss or gradient norm (422).
        """
        body = json.dumps(payload, allow_nan=False).encode()
        give_up = time.monotonic() + self.timeout
        where = f"critic server {self.url} (POST {path})"
        while True:
            try:
                answer = self.http.request("POST", path, body)
                break
            except RewardServerError as e:
                if e.status == NONFINITE:
                    raise NonFiniteError(f"{where}: {_quoted(e)}") from None
                if e.status is not None and e.status < 500:
                    hint = f" (set ${TOKEN_ENV} to the server's token)" if e.status == 401 else ""
                    raise CriticServerError(f"{where}: {_quoted(e)}{hint}", e.status) from None
                if time.monotonic() >= give_up:
                    raise CriticServerError(
                        f"{where}: no answer within {self.timeout:g} s (critic_server_timeout); last error: {e}. "
                        "Is `rlbits serve-critic` running at that address?", e.status,
                    ) from e
                time.sleep(1.0)
        if not isinstance(answer, dict):
            raise CriticServerError(f"{where} answered {str(answer)[:120]}; expected a JSON object", 200)
        return answer

    def check_config(self, cfg: Any) -> int:
        """Ask the server for its config (``POST /info``) and compare ``critic_config``; returns the server's
        update counter.

        Raises:
            ConfigError: a field of ``CRITIC_FIELDS`` differs (each one named with both values).
            CriticServerError: as ``post``.
        """
        info = self.post("/info", {})
        theirs, ours = info.get("config", {}), critic_config(cfg)
        differ = [f"{k}: here {ours[k]!r}, on the server {theirs.get(k)!r}" for k in ours if theirs.get(k) != ours[k]]
        if differ:
            raise ConfigError(
                f"the critic server at {self.url} was started with another config; these fields must agree:\n  "
                + "\n  ".join(differ)
            )
        return int(info.get("update", 0))

    def prefetch_values(self, batch: TensorDictBase, update: int) -> None:
        """Start the values request of ``batch`` in a background thread (NeMo-Aligner's future): ``values``
        of the same batch then waits for it instead of asking again."""
        payload = {"update": update, **encode_tensors(batch, VALUE_KEYS)}
        self._prefetched = (batch.select(*VALUE_KEYS).clone(), update, self._pool.submit(self.post, "/values", payload))

    def values(self, batch: TensorDictBase, update: int) -> torch.Tensor:
        """``POST /values``: the critic's values of ``batch`` at critic update ``update``, [B, R] float32 on the
        batch's device (0 off ``action_mask``).

        Raises:
            CriticServerError: as ``post`` (a 409 when the server holds another update), or an answer of the
                wrong shape.
        """
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[1] == update and _same(prefetched[0], batch):
            answer = prefetched[2].result()
        else:
            answer = self.post("/values", {"update": update, **encode_tensors(batch, VALUE_KEYS)})
        shape = tuple(batch["action_mask"].shape)
        try:
            values = decode_tensor(answer.get("values"), "values", torch.float32, batch.device or "cpu")
        except ValueError as e:
            raise CriticServerError(f"critic server {self.url} answered malformed values: {e}", 200) from None
        if tuple(values.shape) != shape:
            raise CriticServerError(
                f"critic server {self.url} answered values of shape {tuple(values.shape)}; expected {shape}", 200
            )
        return values

    def train_async(self, batch: TensorDictBase, cfg: Any, state: Any, run_length: int) -> Future:
        """Send the critic's training on ``batch`` (``POST /train``) from a background thread and return its
        future. The request carries ``state.critic_updates`` (the server must hold that update), ``state.step``
        and ``run_length`` (the learning-rate schedule's position) and the state of
        ``state.minibatch_generator`` now, before the policy's update draws from it: the server shuffles the
        same minibatches."""
        keys = TRAIN_KEYS + (("loss_mask",) if "loss_mask" in batch.keys() else ())
        payload = {
            "update": state.critic_updates, "step": state.step, "run_length": run_length,
            "generator": encode_generator(state.minibatch_generator), **encode_tensors(batch, keys),
        }
        return self._pool.submit(self.post, "/train", payload)

    def finish_train(self, pending: Future, state: Any, *, policy_trained: bool) -> None:
        """Wait for ``train_async``'s answer; add the server's metrics (``critic_loss``, ``value_clipfrac``,
        ``critic_grad_norm``, ``critic_lr``) to ``state.metrics``. When the policy did not train (critic
        warm-up) the minibatch generator takes the server's final state, as if this process had shuffled.

        Raises:
            CriticServerError: as ``post``; or the server's generator ended elsewhere than this process's (it
                shuffled other minibatches).
            NonFiniteError: the server's update was not finite (it keeps the critic it had).
        """
        answer = pending.result()
        try:
            generator = decode_generator(answer.get("generator"))
            metrics = {str(k): float(v) for k, v in answer["metrics"].items()}
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise CriticServerError(f"critic server {self.url} answered a malformed training result: {e}", 200) from None
        if not policy_trained:
            state.minibatch_generator.set_state(generator)
        elif not torch.equal(generator, state.minibatch_generator.get_state()):
            raise CriticServerError(
                f"critic server {self.url} shuffled other minibatches than the policy's update (its generator "
                "ended in another state)", 200,
            )
        state.metrics.update(metrics)

    def save(self) -> dict:
        """``POST /save``: the server writes its checkpoint now; its answer (``update``, ``path``)."""
        return self.post("/save", {})


def _same(a: TensorDictBase, b: TensorDictBase) -> bool:
    return all(a[k].shape == b[k].shape and torch.equal(a[k], b[k].to(a[k].device)) for k in VALUE_KEYS)


def _quoted(e: RewardServerError) -> str:
    """The server's own message of an HTTP error, without the client's ``POST url answered`` prefix."""
    text = str(e)
    marker = "answered "
    return text.split(marker, 1)[1] if marker in text else text


__all__ = [
    "CONFLICT",
    "CRITIC_FIELDS",
    "NONFINITE",
    "TOKEN_ENV",
    "TRAIN_KEYS",
    "VALUE_KEYS",
    "CriticClient",
    "CriticServerError",
    "critic_config",
    "decode_generator",
    "decode_tensor",
    "encode_generator",
    "encode_tensors",
]
