"""Start a PD setup for tests and benchmarks: prefill servers, decode servers, a router.

With the `mooncake` backend every server is a process; with `fake` (in-process memmove) they run
in this process (`InProcessServer`), which the fake backend needs. The router is always a process.
"""

from __future__ import annotations

import os
import subprocess
import sys

from sglang.srt.testing.server import ServerClient, ServerProcess, wait_healthy
from sglang.srt.utils.ipc import free_port


class RouterProcess:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout: float = 60.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sglang-router-{self.port}.log")
        self._log = open(self.log_path, "w")
        urls = [a for u in prefill_urls for a in ("--prefill", u)] + [a for u in decode_urls for a in ("--decode", u)]
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang.srt.disaggregation.router", "--pd-disaggregation",
                                      *urls, "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.base_url, timeout, lambda: None if self.proc.poll() is None else
                         f"router exited with {self.proc.returncode}: {open(self.log_path).read()[-4000:]}")
        except TimeoutError as e:
            self.stop()
            raise RuntimeError(f"router {e}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
        self._log.close()


class PDSetup:
    """`n_prefill` prefill + `n_decode` decode servers (same model and flags) and a router in front."""

    def __init__(self, model: str, *args: str, prefill_args: tuple = (), decode_args: tuple = (),
                 backend: str = "mooncake", n_prefill: int = 1, n_decode: int = 1,
                 timeout: float = 180.0) -> None:
        if backend == "fake":
            from sglang.srt.testing.inprocess import InProcessServer as server
        else:
            server = ServerProcess
        common = ("--disaggregation-transfer-backend", backend, *args)
        self.prefills: list[ServerClient] = []
        self.decodes: list[ServerClient] = []
        self.router: RouterProcess | None = None
        try:
            for _ in range(n_prefill):  # each with its own bootstrap port
                self.prefills.append(server(model, "--disaggregation-mode", "prefill",
                                            "--disaggregation-bootstrap-port", str(free_port()), *common,
                                            *prefill_args, timeout=timeout))
            for _ in range(n_decode):
                self.decodes.append(server(model, "--disaggregation-mode", "decode", *common, *decode_args,
                                           timeout=timeout))
            self.router = RouterProcess([p.base_url for p in self.prefills], [d.base_url for d in self.decodes])
        except BaseException:
            self.stop()
            raise
        self.base_url = self.router.base_url

    @property
    def prefill(self) -> ServerClient:
        return self.prefills[0]

    @property
    def decode(self) -> ServerClient:
        return self.decodes[0]

    def stop(self) -> None:
        for part in [self.router, *self.decodes, *self.prefills]:
            if part is not None:
                part.stop()

    def __enter__(self) -> "PDSetup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
