"""Start a real server subprocess for tests and benchmarks, and stop it reliably."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Callable

import requests

from sglang.srt.utils.ipc import free_port


def wait_healthy(base_url: str, timeout: float, failed: Callable[[], str | None] | None = None) -> None:
    """Until GET {base_url}/health answers 200. `failed()` returns an error message (with the log)
    once the server's process or thread died: RuntimeError with it at once, not after the timeout.
    TimeoutError("not healthy after {timeout}s") when the time runs out; the caller stops the server."""
    deadline = time.monotonic() + timeout
    while True:
        error = failed() if failed is not None else None
        if error is not None:
            raise RuntimeError(error)
        try:
            if requests.get(base_url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout}s")
        time.sleep(0.05)


class ServerClient:
    """A running server at `base_url` (a process or in-process): what tests read from it, and stop()."""

    base_url: str

    def stop(self) -> None:
        raise NotImplementedError

    def internal_state(self) -> dict:
        return requests.get(self.base_url + "/get_server_info", timeout=30).json()["internal_states"][0]

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Until no request runs or waits; returns the scheduler stats."""
        return self.wait_state(lambda st: st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0,
                               "idle", timeout)

    def wait_state(self, pred: Callable[[dict], bool], what: str, timeout: float = 60.0) -> dict:
        """Until pred(scheduler stats) holds; returns the stats (TimeoutError naming `what`)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.internal_state()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not {what} after {timeout}s: {st}")
            time.sleep(0.05)


class ServerProcess(ServerClient):
    def __init__(self, model: str, *args: str, timeout: float = 180.0, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(self.port),
               "--log-level", "warning", *args]
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sglang-server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            wait_healthy(self.base_url, timeout, lambda: None if self.proc.poll() is None else
                         f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
        except TimeoutError as e:
            self.stop()
            raise RuntimeError(f"server {e}:\n{self.log()}") from None

    def log(self) -> str:
        if not self._log.closed:  # stop() closes it
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-8000:]

    def open_request(self, path: str, body: dict) -> socket.socket:
        """Send a POST and return the open socket without reading the answer: closing it is a
        client that went away (timed out, crashed) at a moment the test chooses."""
        data = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        return sock

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
