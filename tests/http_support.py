"""A stand-in reward server for the client tests (tests/rollout/test_score.py, tests/functional/test_fuzz.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextlib.contextmanager
def fake_server(
    respond: Callable[[dict[str, Any]], tuple[int, bytes]], *, poll_interval: float = 0.05
) -> Iterator[tuple[str, dict[str, Any]]]:
    """A stdlib HTTP server whose POST answer is ``respond(state) -> (status, body bytes)``. Yields its URL and
    ``state``: ``count`` (requests so far) and ``release`` (an Event set when the block ends, for a handler
    that waits on it)."""
    state: dict[str, Any] = {"count": 0, "release": threading.Event()}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            state["count"] += 1
            status, body = respond(state)
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the client gave up (timeout test)
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": poll_interval})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        state["release"].set()
        server.shutdown()
        thread.join()
        server.server_close()
