"""A `dtmega serve` process driven from Python (scripts, notebooks, the tests and
benchmarks/serve.py): started on a free port, waited for, talked to over HTTP, stopped with
SIGTERM.

    server = ServerProcess(["--load", "runs/demo/checkpoints"])
    status, body = server.api({"prompts": ["And God said"], "tokens_to_generate": 16})
    server.stop()
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVING = re.compile(r"on (http://[0-9.]+:\d+)")


class ServerProcess:
    """`dtmega serve ARGS --port 0` (or a torchrun launch of it); `.url` once it listens."""

    def __init__(self, args: list[str], ranks: int = 1, timeout: float = 120.0, threads: int | None = 1,
                 cwd: str | Path | None = None):
        """`threads`: OMP_NUM_THREADS of each rank (None: torch's default, every core)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        if ranks > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                       "--local-ranks-filter=0", "-m", "dtmega", "serve", *args, "--port", "0"]
        else:
            command = [sys.executable, "-m", "dtmega", "serve", *args, "--port", "0"]
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
        self.lines: list[str] = []
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                self.lines.append(line)
                if not self.url and (match := SERVING.search(line)):
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or not self.url:
            self.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines)[-4000:])

    def request(self, method: str, path: str, body: bytes | dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
        """(HTTP status, JSON body) of one request."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json; charset=UTF-8"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def api(self, body: dict | bytes, timeout: float = 60.0) -> tuple[int, dict]:
        """Megatron's PUT /api."""
        return self.request("PUT", "/api", body, timeout)

    def health(self) -> dict:
        """GET /v1/health."""
        return self.request("GET", "/v1/health")[1]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (rank 0 drains, then every rank ends); the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL to the whole process group (torchrun and its ranks)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def wait_until(condition, timeout: float = 10.0, every: float = 0.05) -> bool:
    """Polls `condition()` until true or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()
