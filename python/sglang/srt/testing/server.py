"""Start a real server subprocess for tests and benchmarks, and stop it reliably."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import requests

from sglang.srt.utils.ipc import free_port


class ServerProcess:
    def __init__(self, model: str, *args: str, timeout: float = 180.0, env: dict | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(self.port),
               "--log-level", "warning", *args]
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sglang-server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if requests.get(self.base_url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log()}")
            time.sleep(0.3)

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-8000:]

    def internal_state(self) -> dict:
        return requests.get(self.base_url + "/get_server_info", timeout=30).json()["internal_states"][0]

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Until no request runs or waits; returns the scheduler stats."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.internal_state()
            if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy: {st}")
            time.sleep(0.1)

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
