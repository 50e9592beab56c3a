"""Reward server and client: score (prompt, response) pairs over HTTP with JSON, standard library only.

Protocol (also in ``docs/reward_server.md``):

- ``POST /score`` with body ``{"prompts": [str, ...], "responses": [str, ...], "columns": {name: [...]}}``
  (``columns`` optional; each column holds one JSON value per sample) answers ``200`` with
  ``{"rewards": [number, ...]}``, one finite number per sample, in order.
- ``GET /health`` answers ``200`` with ``{"status": "ok"}`` (no token needed).
- When the server has a token, ``/score`` requires the header ``Authorization: Bearer <token>``.
- Errors are JSON ``{"error": "<message>"}``: ``400`` malformed request (bad JSON, nesting too deep, text
  that is not valid Unicode, a bad Content-Length), ``401`` missing or wrong token (checked before the body
  is read), ``404`` unknown path, ``405`` wrong method, ``408`` the body did not arrive in time, ``411`` no
  Content-Length, ``413`` body over the size cap, ``500`` the reward function raised or returned an invalid
  value (the message names the sample). Every request gets one of these answers, never a dropped connection
  with a traceback (a bug of the server itself is a ``500`` naming the exception's type).

``RewardServer``/``serve`` run any reward that ``score_texts`` accepts (a callable ``(prompts, responses,
**columns)``, a ``RewardModel``) behind that protocol with ``http.server.ThreadingHTTPServer``; they bind
127.0.0.1 unless another host is named. ``RewardClient`` is the client ``score`` uses for ``http(s)://``
rewards: ``urllib.request``, retries with exponential backoff on connection errors and 5xx answers, no retry
on 4xx or on a timeout (a deadline for the whole attempt), no redirect followed, and a ``RewardServerError``
for any malformed answer. It is defined in
``rlbits.rollout.reward_client`` (below ``score``, which builds one for a URL, while this module wraps
``score_texts``: no import cycle) and re-exported here.

    with RewardServer(my_reward, port=0) as server:      # port 0: any free port
        rewards = score(batch, server.url)
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import re
import socket
import threading
import urllib.parse
import warnings
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlbits.models.reward import RewardModel
from rlbits.rollout.reward_client import RewardClient, _is_loopback
from rlbits.rollout.reward_errors import RewardError
from rlbits.rollout.score import _resolve, score_texts

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # 16 MiB of JSON: tens of thousands of typical samples
# A refused body (401, 413) up to this size is read and dropped, so the answer reaches the client.
_MAX_DRAIN_BYTES = 64 * 2**20
_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")  # int() would also take "+5", " 5 " and "1_0"


# ------------------------------------------------------------------------------------------------ server


class RequestError(Exception):
    """Raised by a route of a ``JSONServer`` to answer ``status`` with ``{"error": message}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class _Handler(BaseHTTPRequestHandler):
    server: JSONServer
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads to wait for
    server_version = "rlbits-json"

    def setup(self) -> None:
        self.timeout = self.server.request_timeout  # StreamRequestHandler applies it to the socket
        self.server_version = f"rlbits-{self.server.kind}"
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (name from the base class)
        if self.server.log_requests:
            super().log_message(format, *args)

    def _send(self, status: int, obj: dict, headers: dict | None = None) -> None:
        body = json.dumps(obj, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Errors found by http.server itself (bad request line, unsupported method) in the protocol's JSON.
        self.close_connection = True
        self._send(code, {"error": message or HTTPStatus(code).phrase})

    def _path(self) -> str:
        return urllib.parse.urlsplit(self.path).path.rstrip("/") or "/"

    def _unknown(self, path: str) -> None:
        has = ", ".join(f"POST {p}" for p in self.server.post_routes) + " and GET /health"
        self._send(404, {"error": f"unknown path {path!r}; the server has {has}"})

    def do_GET(self) -> None:
        path = self._path()
        if path == "/health":
            self._send(200, {"status": "ok"})
        elif path in self.server.post_routes:
            self._send(405, {"error": f"use POST {path}"}, {"Allow": "POST"})
        else:
            self._unknown(path)

    def do_POST(self) -> None:
        try:
            self._post()
        except Exception as e:  # a bug of the server itself: still one JSON answer, no dropped connection
            self.log_error("POST %s failed: %s: %s", self.path, type(e).__name__, e)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self._send(500, {"error": f"the {self.server.kind} server failed: {type(e).__name__}"})

    def _post(self) -> None:
        path = self._path()
        route = self.server.post_routes.get(path)
        if route is None:
            if path == "/health":
                self._send(405, {"error": "use GET /health"}, {"Allow": "GET"})
            else:
                self._unknown(path)
            return
        length, refusal = _content_length(self.headers.get_all("Content-Length"))
        token = self.server.token
        if token is not None:  # before reading the body: an unauthenticated client gets nothing parsed
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._drain(length or 0)
                self._send(
                    401, {"error": "missing or wrong bearer token"},
                    {"WWW-Authenticate": "Bearer", "Connection": "close"},
                )
                return
        if refusal is not None:  # the body's end is unknown: answer and close without reading it
            self.close_connection = True
            self._send(refusal[0], {"error": refusal[1]})
            return
        cap = self.server.max_request_bytes
        if length > cap:
            self._drain(length)
            self._send(
                413, {"error": f"request body of {length} bytes is over the server's cap of {cap} bytes"}
            )
            return
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            self._send(408, {"error": f"the request body did not arrive within {self.timeout:g} s"})
            return
        if len(raw) < length:
            self.close_connection = True
            self._send(
                400, {"error": f"request body ended after {len(raw)} of {length} bytes (Content-Length)"}
            )
            return
        try:
            request = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            self._send(400, {"error": f"request body is not valid JSON: {str(e)[:200]}"})
            return
        except RecursionError:
            self._send(400, {"error": "request body is not valid JSON: it nests too deeply"})
            return
        try:
            answer = route(request)
        except RequestError as e:
            self._send(e.status, {"error": e.message})
            return
        self._send(200, answer)

    def _drain(self, length: int) -> None:
        # Read (and drop) a refused body, up to a bound, so the client gets the answer instead of a reset.
        self.close_connection = True
        left = min(length, max(4 * self.server.max_request_bytes, _MAX_DRAIN_BYTES))
        with contextlib.suppress(OSError):
            while left > 0:
                chunk = self.rfile.read(min(left, 2**16))
                if not chunk:
                    break
                left -= len(chunk)


def _content_length(values: list[str] | None) -> tuple[int, None] | tuple[None, tuple[int, str]]:
    """``(length, None)`` for a well-formed Content-Length, else ``(None, (status, message))``."""
    if not values:
        return None, (411, "the request needs a Content-Length header")
    if len(set(values)) > 1:
        return None, (400, f"{len(values)} different Content-Length headers")
    if not _CONTENT_LENGTH.fullmatch(values[0]):
        return None, (400, f"bad Content-Length {values[0][:40]!r}; expected a number of bytes")
    return int(values[0]), None


def _check_request(request: Any) -> str | None:
    """Why a decoded /score body is malformed, or None if it is well formed."""
    if not isinstance(request, dict):
        return f"request body must be a JSON object, got {type(request).__name__}"
    unknown = sorted(set(request) - {"prompts", "responses", "columns"})
    if unknown:
        return f"unknown field(s) {', '.join(map(repr, unknown))}; expected 'prompts', 'responses', 'columns'"
    for key in ("prompts", "responses"):
        if key not in request:
            return f"missing field {key!r} (a list of strings)"
        texts = request[key]
        if not isinstance(texts, list):
            return f"field {key!r} must be a list of strings, got {type(texts).__name__}"
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                return f"{key}[{i}] must be a string, got {type(t).__name__}"
            try:
                t.encode()
            except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to lone surrogates
                return f"{key}[{i}] is not valid Unicode: {e.reason} at character {e.start}"
    n = len(request["prompts"])
    if len(request["responses"]) != n:
        return f"got {n} prompts but {len(request['responses'])} responses; they must pair up"
    columns = request.get("columns", {})
    if not isinstance(columns, dict):
        return f"field 'columns' must be an object of name -> list, got {type(columns).__name__}"
    for name, values in columns.items():
        if not isinstance(values, list) or len(values) != n:
            return f"column {name!r} must be a list of {n} values, one per sample"
    return None


class JSONServer(ThreadingHTTPServer):
    """An HTTP server of JSON routes with the protocol's rules (module docstring): bearer token checked before
    the body is read, a size cap, every request answered with JSON, ``GET /health``. A subclass names its
    ``POST`` routes in ``post_routes`` (path -> ``route(request) -> answer``, the decoded JSON body in, a JSON
    object out); a route raises ``RequestError(status, message)`` to answer an error. ``RewardServer`` (``POST
    /score``) and the critic server (``rlbits.loops.critic_server``) are its two kinds.

    Args:
        host: address to bind; ``127.0.0.1`` by default. Binding every interface needs an explicit
            ``"0.0.0.0"`` (or ``"::"``); a non-loopback host without a token gives a warning.
        port: TCP port; 0 picks a free one (read it back from ``server.port`` or ``server.url``).
        token: if set, every ``POST`` route needs ``Authorization: Bearer <token>``.
        max_request_bytes: larger request bodies get 413.
        request_timeout: seconds a connection may sit idle while the request is read.
        log_requests: log each request to stderr (as ``http.server`` does).

    ``start()`` serves from a daemon thread and returns the server; ``stop()`` shuts it down and waits for
    the threads; as a context manager it starts on entry (if not started) and stops on exit.

    Raises:
        ValueError: empty ``host``, a port outside [0, 65535], bad ``max_request_bytes``.
        OSError: the address cannot be bound (port in use, a host this machine does not have).
    """

    daemon_threads = True
    kind = "json"
    """The server's name in messages and the ``Server`` header (``rlbits-<kind>``)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        token: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        request_timeout: float = 60.0,
        log_requests: bool = False,
    ):
        if not isinstance(host, str) or not host:
            raise ValueError(
                f"host must name an address, got {host!r}; use '127.0.0.1' (default) or, to listen on every "
                "interface, '0.0.0.0' explicitly"
            )
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}")
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive int, got {max_request_bytes!r}")
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty str or None")
        if not _is_loopback(host) and token is None:
            warnings.warn(
                f"{self.kind} server on {host} accepts requests from other machines without a token; pass token=",
                stacklevel=3,
            )
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.request_timeout = request_timeout
        self.log_requests = log_requests
        self._thread: threading.Thread | None = None

    @property
    def post_routes(self) -> dict[str, Callable[[Any], dict]]:
        """``POST`` path -> ``route(request) -> answer``."""
        return {}

    @property
    def host(self) -> str:
        return self.server_address[0]

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> JSONServer:
        """Serve from a daemon thread; returns ``self``."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"{self.kind}-server:{self.port}",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the socket and wait for the request threads. Safe to call twice."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()

    def __enter__(self) -> JSONServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class RewardServer(JSONServer):
    """An HTTP server that scores with ``reward`` (protocol in the module docstring): ``POST /score``.

    Args:
        reward: a callable ``(prompts, responses, **columns) -> rewards``, a ``RewardModel`` or a reward-model
            folder (anything ``score_texts`` takes). Its output is validated as in ``score``.
        host, port, token, max_request_bytes, request_timeout, log_requests: as ``JSONServer``.
        batch_size: at most this many samples per call of ``reward`` (None: one call per request).
        concurrent: allow concurrent calls of ``reward`` from the request threads; by default calls are
            serialised (one model on one device; a function need not be thread-safe).

    Raises:
        ValueError: empty ``host``, a port outside [0, 65535], bad ``max_request_bytes``.
        OSError: the address cannot be bound (port in use, a host this machine does not have).
        TypeError: ``reward`` is of no supported kind.
    """

    kind = "reward"

    def __init__(
        self,
        reward: Any,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        token: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        batch_size: int | None = None,
        concurrent: bool = False,
        request_timeout: float = 60.0,
        log_requests: bool = False,
    ):
        self.reward, _ = _resolve(reward)
        super().__init__(
            host, port, token=token, max_request_bytes=max_request_bytes, request_timeout=request_timeout,
            log_requests=log_requests,
        )
        self.batch_size = batch_size
        self.lock = contextlib.nullcontext() if concurrent else threading.Lock()

    @property
    def post_routes(self) -> dict[str, Callable[[Any], dict]]:
        return {"/score": self._score}

    def _score(self, request: Any) -> dict:
        error = _check_request(request)
        if error:
            raise RequestError(400, error)
        try:
            with self.lock:
                rewards = score_texts(
                    request["prompts"],
                    request["responses"],
                    self.reward,
                    columns=request.get("columns"),
                    batch_size=self.batch_size,
                )
        except RewardError as e:  # the reward raised or returned an invalid value
            raise RequestError(500, str(e)) from e
        except (ValueError, TypeError) as e:  # the request's columns do not fit (e.g. a reserved name)
            raise RequestError(400, str(e)) from e
        return {"rewards": rewards.tolist()}

    def __enter__(self) -> RewardServer:
        return self.start()


def serve(
    reward: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    token: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    block: bool = True,
    **kwargs: Any,
) -> RewardServer:
    """Serve ``reward`` over HTTP (see ``RewardServer`` for the arguments).

    ``block=True`` serves in this thread until KeyboardInterrupt, then closes the server and returns it;
    ``block=False`` returns a server already serving from a background thread (call ``stop()``).
    """
    server = RewardServer(reward, host, port, token=token, max_request_bytes=max_request_bytes, **kwargs)
    if not block:
        return server.start()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return server


def load_reward(target: str) -> Callable:
    """A task's ``reward`` for a task name (``rlbits.tasks.TASKS``), else a ``RewardModel`` from a folder.

    Raises:
        ValueError: ``target`` is neither a task name nor a folder (the message lists the tasks).
    """
    from rlbits.tasks import TASKS, get_task

    if target in TASKS:
        return get_task(target).reward
    if os.path.isdir(target):
        return RewardModel.from_pretrained(target)
    raise ValueError(
        f"{target!r} is neither a task ({', '.join(sorted(TASKS))}) nor a folder holding a reward model"
    )


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "JSONServer",
    "RequestError",
    "RewardClient",
    "RewardServer",
    "load_reward",
    "serve",
]
