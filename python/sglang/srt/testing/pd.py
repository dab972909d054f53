"""Start a PD setup for tests and benchmarks: prefill server, decode server, router (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import requests

from sglang.srt.testing.server import ServerProcess
from sglang.srt.utils.ipc import free_port


class RouterProcess:
    def __init__(self, prefill_url: str, decode_url: str, timeout: float = 60.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sglang-router-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang.srt.disaggregation.router", "--pd-disaggregation",
                                      "--prefill", prefill_url, "--decode", decode_url, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}: {open(self.log_path).read()[-4000:]}")
            try:
                if requests.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("router not healthy")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
        self._log.close()


class PDSetup:
    """prefill + decode servers (same model and flags) and a router in front of them."""

    def __init__(self, model: str, *args: str, prefill_args: tuple = (), decode_args: tuple = (),
                 backend: str = "mooncake", timeout: float = 180.0) -> None:
        common = ("--disaggregation-transfer-backend", backend, *args)
        self.prefill = ServerProcess(model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                     str(free_port()), *common, *prefill_args, timeout=timeout)
        try:
            self.decode = ServerProcess(model, "--disaggregation-mode", "decode", *common, *decode_args,
                                        timeout=timeout)
            self.router = RouterProcess(self.prefill.base_url, self.decode.base_url)
        except BaseException:
            self.stop()
            raise
        self.base_url = self.router.base_url

    def stop(self) -> None:
        for name in ("router", "decode", "prefill"):
            part = getattr(self, name, None)
            if part is not None:
                part.stop()

    def __enter__(self) -> "PDSetup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
