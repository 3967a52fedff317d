"""Stopping the HTTP server without waiting on clients that no longer read.

On SIGTERM uvicorn stops accepting, then waits up to its graceful-shutdown timeout
(`--request-timeout`) for every connection to close. A connection whose request already ended
(answered, or cut at its deadline) but whose client stopped reading keeps unsent bytes in the
transport's buffer and never closes: the server waited the whole timeout (matrix 3, H18: 20 s).
The application knows better than the transport when its work is done: `CallsInFlight` counts
the ASGI calls in progress; once none is left, `stop_when_answered` gives well-behaved clients
`FLUSH_SECONDS` to read what was sent, then tells uvicorn to stop waiting for connections.
"""

from __future__ import annotations

import threading
import time
from typing import Any

FLUSH_SECONDS = 2.0  # what a client that reads needs to take the last bytes of its answer


class CallsInFlight:
    """ASGI middleware: the number of HTTP calls of the wrapped application in progress (a
    streamed answer counts until its last event is handed to the server)."""

    def __init__(self, app: Any):
        self.app = app
        self.count = 0
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:
        """Runs the application, counting HTTP calls (lifespan and websockets pass through)."""
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        with self._lock:
            self.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            with self._lock:
                self.count -= 1


def stop_when_answered(server: Any, calls: CallsInFlight, limit_seconds: float,
                       flush_seconds: float = FLUSH_SECONDS) -> threading.Thread:
    """Starts a thread that, once no call is in flight (or `limit_seconds` passed) and
    `flush_seconds` more, sets uvicorn's `force_exit`: connections still open then belong to
    clients that stopped reading an answer that is complete or was cut at its deadline."""

    def watch() -> None:
        deadline = time.monotonic() + limit_seconds
        while calls.count and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(flush_seconds)
        server.force_exit = True

    thread = threading.Thread(target=watch, name="dtmega-stop-watch", daemon=True)
    thread.start()
    return thread
