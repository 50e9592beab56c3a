"""The reward server's client: ``RewardClient``, what ``score`` sends ``http(s)://`` rewards through.

Standard library only (``urllib.request``): retries with exponential backoff on connection errors and 5xx
answers, no retry on 4xx or on a timeout, and a ``RewardServerError`` for any malformed answer. Redirects
are refused, never followed (they would carry the bearer token to another address), and ``timeout`` bounds
the whole exchange, not each read: a watchdog shuts the socket down at the deadline. The protocol
is in ``rlbits.rollout.reward_server`` (which also re-exports ``RewardClient``) and ``docs/reward_server.md``.

It sits below ``rlbits.rollout.score`` (which builds a client for a URL) and imports nothing from it, so
``score`` and the server module do not import each other.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http import HTTPStatus
from typing import Any

from rlbits.rollout.reward_errors import RewardServerError, describe_sample

_MAX_RESPONSE_BYTES = 64 * 2**20  # a longer answer is refused (RewardServerError)
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RewardClient:
    """Client of a reward server, called like a reward function: ``client(prompts, responses, **columns)``.

    Args:
        url: the server's base URL, ``http(s)://host:port`` (a trailing ``/score`` is accepted and dropped).
        token: bearer token sent as ``Authorization: Bearer <token>``; never shown in messages or ``repr``.
        timeout: seconds one attempt may take in all: connecting, sending the request and reading the whole
            answer (a server that trickles its answer byte by byte is cut off at this deadline).
        retries: extra attempts after the first on a connection error or a 5xx answer (0: no retry).
        backoff: the wait before retry k (k = 0, 1, ...) is ``backoff * 2**k`` seconds.

    Proxies from the environment are used except for loopback hosts. Redirects are not followed: a 3xx
    answer raises ``RewardServerError`` naming its target, so the token never reaches another address.

    Raises:
        ValueError: ``url`` is not ``http(s)://host[:port]``, or a bad ``timeout``/``retries``/``backoff``.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
    ):
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {type(url).__name__}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must look like http://host:port or https://host:port, got {url!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if not (isinstance(backoff, (int, float)) and backoff >= 0):
            raise ValueError(f"backoff must be a number of seconds >= 0, got {backoff!r}")
        path = parts.path.rstrip("/")
        path = path[: -len("/score")] if path.endswith("/score") else path
        self.url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        self.token = token
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self._proxies = [urllib.request.ProxyHandler({})] if _is_loopback(parts.hostname) else []

    def __repr__(self) -> str:
        token = ", token=***" if self.token else ""
        return f"RewardClient({self.url!r}{token}, timeout={self.timeout}, retries={self.retries})"

    def health(self) -> dict:
        """``GET /health``; the server's JSON answer (``{"status": "ok"}``)."""
        return self.request("GET", "/health", None)

    def __call__(self, prompts: list[str], responses: list[str], **columns: Any) -> list[float]:
        """``POST /score``: one reward per sample, as floats (NaN/inf pass through for ``score`` to name).

        Raises:
            TypeError: a column is not JSON-serialisable.
            RewardServerError: unreachable after the retries, timeout, an HTTP error (the server's message
                included), a redirect, or an answer that is not JSON, lacks ``rewards``, has the wrong length
                or holds non-numbers.
        """
        cols = {}
        for name, values in columns.items():
            values = values.tolist() if hasattr(values, "tolist") else list(values)
            try:
                json.dumps(values)
            except (TypeError, ValueError) as e:
                raise TypeError(f"column {name!r} cannot be sent to the reward server as JSON: {e}") from e
            cols[name] = values
        payload = {"prompts": list(prompts), "responses": list(responses)}
        if cols:
            payload["columns"] = cols
        body = json.dumps(payload).encode()
        answer = self.request("POST", "/score", body)
        where = f"POST {self.url}/score"
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardServerError(
                f"{where} answered {_show(answer)}; expected a JSON object with 'rewards'", 200
            )
        rewards = answer["rewards"]
        if not isinstance(rewards, list):
            raise RewardServerError(
                f"{where} answered 'rewards' of type {type(rewards).__name__}; expected a list", 200
            )
        if len(rewards) != len(prompts):
            raise RewardServerError(
                f"{where} answered {len(rewards)} rewards for {len(prompts)} samples; expected {len(prompts)}",
                200,
            )
        for i, r in enumerate(rewards):
            if isinstance(r, bool) or not isinstance(r, (int, float)):
                raise RewardServerError(
                    f"{where} answered reward {_show(r)} for {describe_sample(i, prompts[i], responses[i])}; "
                    "expected a number",
                    200,
                )
        # An int beyond float64 becomes +-inf, which ``score`` then rejects naming the sample.
        return [_to_float(r) for r in rewards]

    def request(self, method: str, path: str, body: bytes | None) -> Any:
        """One exchange with the server, ``method`` on ``url + path`` with the JSON ``body``, with this
        client's token, deadline, retries and backoff (class docstring): the decoded JSON answer.

        Raises:
            RewardServerError: unreachable after the retries, a timeout, an HTTP error (the server's message
                quoted, ``.status`` set), a redirect, or an answer that is not JSON.
        """
        url = self.url + path
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        where = f"{method} {url}"
        last, status = "", None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, headers=headers, method=method)
            deadline = _Deadline(self.timeout)
            opener = urllib.request.build_opener(
                *self._proxies, _NoRedirects(), _WatchedHTTPHandler(deadline), _WatchedHTTPSHandler(deadline)
            )
            timed_out = RewardServerError(f"{where} timed out: no answer within {self.timeout:g} s", None)
            try:
                with deadline, opener.open(request, timeout=self.timeout) as response:
                    code = response.status
                    raw = response.read(_MAX_RESPONSE_BYTES + 1)
                    deadline.finish()
            except urllib.error.HTTPError as e:
                if deadline.expired:
                    raise timed_out from None
                if 300 <= e.code < 400:
                    target = _show(e.headers.get("Location", "(no Location header)"))
                    raise RewardServerError(
                        f"{where} answered {e.code} {e.reason}, a redirect to {target}; redirects are not "
                        "followed (the token would go with them): give the reward server's own URL",
                        e.code,
                    ) from None
                message = _error_message(e)
                if e.code == HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
                    raise RewardServerError(
                        f"{where} answered 413 (request of {len(body or b'')} bytes too large for the server: "
                        f"{message}); send fewer samples per request, e.g. score(..., batch_size=...)",
                        e.code,
                    ) from None
                last = f"HTTP {e.code} {e.reason}: {message}"
                if e.code < 500:
                    raise RewardServerError(f"{where} answered {last}", e.code) from None
                status = e.code
                continue
            except TimeoutError as e:
                raise timed_out from e
            except urllib.error.URLError as e:
                if deadline.expired:
                    raise timed_out from e
                if isinstance(e.reason, TimeoutError):
                    raise RewardServerError(f"{where} timed out connecting ({self.timeout:g} s)", None) from e
                last, status = f"connection failed: {e.reason}", None
                continue
            except (OSError, http.client.HTTPException) as e:  # a reset mid-exchange, a bad status line
                if deadline.expired:
                    raise timed_out from e
                last, status = f"connection failed: {type(e).__name__}: {e}", None
                continue
            if deadline.expired:  # the watchdog cut the answer short
                raise timed_out
            if len(raw) > _MAX_RESPONSE_BYTES:
                raise RewardServerError(f"{where} answered more than {_MAX_RESPONSE_BYTES} bytes", code)
            try:
                return json.loads(raw)
            except (UnicodeDecodeError, ValueError, RecursionError):
                raise RewardServerError(
                    f"{where} answered a body that is not JSON: {_show(raw)}", code
                ) from None
        attempts = "1 attempt" if self.retries == 0 else f"{self.retries + 1} attempts"
        hint = ""
        if status is None and body is not None and len(body) > 2**20:
            # A server that refuses a large body may close the connection before reading it.
            hint = (
                f" (the request was {len(body)} bytes: if the server caps request size, send fewer samples "
                "per request, e.g. score(..., batch_size=...))"
            )
        raise RewardServerError(f"{where} failed after {attempts}; last error: {last}{hint}", status)


class _Deadline:
    """A watchdog for one attempt: ``seconds`` after entering, it shuts down every socket it watches, so a
    read blocked in ``http.client`` returns at once. ``finish()`` (the answer is read) disarms it; after
    that ``expired`` stays False."""

    def __init__(self, seconds: float):
        self._seconds = seconds
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._done = False
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._timer.cancel()
        self.finish()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def finish(self) -> None:
        with self._lock:
            self._done = True

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    # The plain socket's shutdown, also under TLS: the reader sees end of stream, the TLS state is untouched.
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class _Watched:
    """Mixin for an ``http.client`` connection: once connected, its socket is watched by the attempt's
    ``_Deadline``."""

    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        self._deadline.watch(self.sock)


class _WatchedHTTPConnection(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPSConnection(_Watched, http.client.HTTPSConnection):
    pass


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    """urllib's HTTP handler with connections that the attempt's ``_Deadline`` watches."""

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPConnection, req, deadline=self._deadline)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    """urllib's HTTPS handler (default TLS context: certificates and host names verified), watched."""

    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPSConnection, req, context=self._context, deadline=self._deadline)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Follow no redirect: urllib then raises the 3xx answer as an ``HTTPError``."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's signature)
        return None


def _to_float(r: int | float) -> float:
    try:
        return float(r)
    except OverflowError:
        return math.inf if r > 0 else -math.inf


def _show(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_message(e: urllib.error.HTTPError) -> str:
    """The ``error`` field of an error answer, else its raw body (cut)."""
    try:
        raw = e.read(65536)
    except OSError:
        return "(no body)"
    try:
        data = json.loads(raw)
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return data["error"]
    except ValueError:
        pass
    return _show(raw)


__all__ = ["RewardClient"]
