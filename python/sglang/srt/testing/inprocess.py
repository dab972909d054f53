"""A server whose scheduler, detokenizer and HTTP app run as threads of the test process.

The same parts `launch_server` starts as processes (Scheduler + SchedulerProcess loop, DetokenizerManager,
TokenizerManager + the FastAPI app under uvicorn), wired over the same ZMQ sockets. PD tests use it for
the `fake` transfer backend, which copies within one address space: several prefill and decode
servers (and a combined one) in this process, a real router process in front, start-up in seconds.
Single rank only; the threads share the GIL, so it is for correctness, not timing.
"""

from __future__ import annotations

import logging
import threading
import traceback

import uvicorn

from sglang.srt.managers.scheduler_process import scheduler_class
from sglang.srt.server_args import prepare_server_args
from sglang.srt.testing.server import ServerClient, wait_healthy
from sglang.srt.utils.ipc import PortArgs, free_port

logger = logging.getLogger(__name__)


class InProcessServer(ServerClient):
    def __init__(self, model: str, *args: str, timeout: float = 120.0) -> None:
        from sglang.srt.managers.scheduler_process import SchedulerProcess
        from sglang.srt.managers.tokenizer_utils import load_tokenizer

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        sa = prepare_server_args(["--model-path", model, "--port", str(self.port), "--log-level", "warning",
                                  *args]).resolve()
        if sa.tp_size * sa.nnodes != 1:
            raise ValueError("InProcessServer runs one rank: use ServerProcess for --tp-size > 1")
        self.server_args, port_args = sa, PortArgs.init_new()
        self.scheduler = scheduler_class(sa)(sa, tokenizer=load_tokenizer(sa.tokenizer_path, sa.trust_remote_code))
        self._proc = SchedulerProcess(self.scheduler, port_args, 0)  # binds the scheduler's sockets here
        self._stop = threading.Event()
        self.error: str | None = None  # a crashed thread's traceback
        self._http: uvicorn.Server | None = None
        self._detok = self._tm = None
        self._threads = [self._thread("scheduler", lambda: self._proc.event_loop(self._stop.is_set)),
                         self._thread("detokenizer", lambda: self._detokenizer(sa, port_args)),
                         self._thread("http", lambda: self._serve_http(sa, port_args))]
        try:
            wait_healthy(self.base_url, timeout,
                         lambda: self.error and f"in-process server failed to start:\n{self.error}")
        except BaseException as e:
            self.stop()
            if isinstance(e, TimeoutError):
                raise RuntimeError(f"in-process server {e}") from None
            raise

    def _thread(self, name: str, fn) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except BaseException:
                self.error = traceback.format_exc()
                logger.error("in-process server %d: %s thread crashed:\n%s", self.port, name, self.error)

        t = threading.Thread(target=run, name=f"{name}-{self.port}", daemon=True)
        t.start()
        return t

    def _detokenizer(self, sa, port_args) -> None:
        from sglang.srt.managers.detokenizer_manager import DetokenizerManager

        self._detok = DetokenizerManager(sa, port_args)
        self._detok.event_loop(self._stop.is_set)

    def _serve_http(self, sa, port_args) -> None:
        from sglang.version import __version__
        from sglang.srt.entrypoints.http_server import create_app
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        s = self.scheduler
        info = {"max_total_num_tokens": s.max_total_num_tokens, "max_running_requests": s.max_running_requests,
                "context_len": s.context_len, "page_size": s.page_size, "vocab_size": s.vocab_size,
                "tokens_per_step": s.tp_worker.num_tokens_per_req,
                "architecture": s.model_config.architecture}
        from sglang.srt.metrics.collector import MetricsCollector

        metrics = MetricsCollector(sa.served_model_name) if sa.enable_metrics else None  # as launch_server
        self._tm = tm = TokenizerManager(sa, port_args, info, metrics)  # its asyncio sockets belong to this thread's loop
        app = create_app(tm, sa, metrics, version=__version__)
        self._http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                   timeout_keep_alive=5))
        if not self._stop.is_set():  # stop() may have come while this was built
            self._http.run()

    def stop(self) -> None:
        """Stop serving (the port closes, as when a server process dies), end the threads and close
        what they used: a ZMQ context left to the cyclic garbage collector hangs in its term() (the
        sockets' weakrefs are cleared first), and a fake-backend peer that is gone must refuse writes."""
        if self._stop.is_set():
            return
        self._stop.set()  # first: the http thread checks it after publishing its server
        if self._http is not None:
            self._http.should_exit = True
        for t in self._threads:
            t.join(timeout=30)
        if any(t.is_alive() for t in self._threads):
            logger.error("in-process server %d: threads still running after stop", self.port)
            return
        tree = self.scheduler.tree_cache
        if hasattr(tree, "controller"):  # HiCache copy threads must not be mid-copy at interpreter exit
            tree.controller.wait_idle()
        pd = getattr(self.scheduler, "pd", None)
        if pd is not None:
            pd.backend.close()
        contexts = [self._proc.recv_from_tokenizer.context, getattr(self.scheduler, "ctx", None),  # PD sockets
                    self._detok and self._detok.recv_from_scheduler.context,
                    self._tm and self._tm.recv_from_workers.context]
        for ctx in contexts:
            if ctx is not None:
                ctx.destroy(linger=0)
        if self._tm is not None:
            self._tm._pool.shutdown(wait=False)

    def __enter__(self) -> "InProcessServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
