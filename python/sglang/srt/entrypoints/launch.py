"""Start the server: scheduler process per TP rank + detokenizer process + HTTP in this process.

Children die with the server (PR_SET_PDEATHSIG); if any child dies, the server logs which one
and exits non-zero instead of hanging. Ctrl-C / SIGTERM stop accepting requests, let those in
flight finish for --graceful-shutdown-timeout seconds, abort the rest (each client gets an abort
finish, not a cut connection), then stop the children (SIGTERM: each leaves its loop and exits 0;
SIGKILL after CHILD_STOP_TIMEOUT_S) and exit 0 (130 for Ctrl-C); a second Ctrl-C exits at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time

from sglang.version import __version__
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.utils.common import configure_logger
from sglang.srt.utils.ipc import PortArgs

logger = logging.getLogger("sglang.launch_server")

STARTUP_TIMEOUT_S = 600
CHILD_STOP_TIMEOUT_S = 10.0  # a scheduler leaves its loop within one idle poll (1 s)


class LaunchError(RuntimeError):
    pass


def _check_model(sa: ServerArgs):
    """Fail fast, in the launcher, on a bad model path / config / architecture / combination."""
    from sglang.srt.configs.model_config import model_config_from_server_args

    return model_config_from_server_args(sa)


def _start_children(sa: ServerArgs, port_args: PortArgs) -> tuple[list, dict]:
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
    from sglang.srt.managers.scheduler_process import run_scheduler_process

    from sglang.srt.distributed.parallel_state import node_ranks

    ctx = mp.get_context("spawn")
    procs, readers = [], []
    for rank in node_ranks(sa.tp_size, sa.nnodes, sa.node_rank):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=run_scheduler_process, args=(sa, port_args, rank, writer), daemon=True,
                        name=f"scheduler-TP{rank}")
        p.start()
        procs.append(p)
        readers.append(reader)
    if sa.node_rank == 0:  # other nodes run scheduler ranks only; node 0 serves HTTP
        detok = ctx.Process(target=run_detokenizer_process, args=(sa, port_args), daemon=True, name="detokenizer")
        detok.start()
        procs.append(detok)

    infos: list[dict | None] = [None] * len(readers)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while any(i is None for i in infos):
        for rank, reader in enumerate(readers):
            if infos[rank] is None and reader.poll(0.2):
                msg = reader.recv()
                if msg.get("status") != "ready":
                    raise LaunchError(f"scheduler TP{rank} failed to start: {msg.get('message')}")
                infos[rank] = msg
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            raise LaunchError(f"{dead[0].name} exited with code {dead[0].exitcode} during start-up")
        if time.monotonic() > deadline:
            raise LaunchError(f"scheduler not ready after {STARTUP_TIMEOUT_S}s")
    return procs, infos[0]


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _stop_children(procs: list, stopping: threading.Event) -> None:
    """SIGTERM each child (they leave their loops and exit 0), wait, then SIGKILL what is left."""
    stopping.set()  # the watchdog must not read these exits as crashes
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0))
        if p.is_alive():
            logger.warning("%s did not stop within %.0fs; killing it", p.name, CHILD_STOP_TIMEOUT_S)
        else:
            logger.log(logging.INFO if p.exitcode == 0 else logging.WARNING, "%s exited with code %s", p.name,
                       p.exitcode)
    _kill(procs)


def _watchdog(procs: list, stopping: threading.Event | None = None) -> None:
    """A dead child means the server cannot serve: exit non-zero instead of hanging."""
    while stopping is None or not stopping.is_set():
        for p in procs:
            if not p.is_alive() and not (stopping is not None and stopping.is_set()):
                logger.error("%s died (exit code %s); shutting the server down", p.name, p.exitcode)
                _kill(procs)
                os._exit(1)
        time.sleep(0.5)


def _draining_server(config, tm, grace_s: float):
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn already waits for open requests on a signal; this bounds the wait: after
        `grace_s` the requests still running are aborted so their connections close."""

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal it caught once it has shut down; SIGTERM's default action
            # then kills this process before launch_server stops the children and returns 0. SIGINT
            # is still re-raised (KeyboardInterrupt: exit 130).
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals[:] = [s for s in self._captured_signals if s != signal.SIGTERM]

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                loop = asyncio.get_running_loop()  # the signal arrives on the loop's (main) thread
                loop.call_soon_threadsafe(self._drain)

        def _drain(self) -> None:
            tm.shutting_down = True
            logger.info("shutting down: draining %d request(s) for up to %.0fs", len(tm.states), grace_s)
            asyncio.get_running_loop().call_later(grace_s, self._abort_rest)

        def _abort_rest(self) -> None:
            n = tm.abort_all("the server is shutting down", 503)
            if n:
                logger.warning("aborted %d request(s) still running after the %.0fs grace period", n, grace_s)

    return DrainingServer(config)


def launch_server(server_args: ServerArgs) -> int:
    import uvicorn

    from sglang.srt.entrypoints.http_server import create_app
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.metrics.collector import MetricsCollector

    sa = server_args.resolve()
    configure_logger(sa.log_level)
    mc = _check_model(sa)
    shown = {k: v for k, v in dataclasses.asdict(sa).items() if k != "api_key"}
    logger.info("sglang %s, %s (%s); server_args=%s", __version__, mc.architecture, mc.dtype, shown)
    port_args = PortArgs.init_new()
    procs: list = []
    stopping = threading.Event()
    try:
        procs, info = _start_children(sa, port_args)
        if sa.node_rank > 0:
            logger.info("node %d of %d: scheduler ranks ready; serving continues on node 0", sa.node_rank, sa.nnodes)
            _watchdog(procs)  # returns only by exiting (a rank died, or node 0 stopped)
        info["architecture"] = mc.architecture
        logger.info("KV cache capacity: %d tokens (page size %d), max running requests %d, context length %d",
                    info["max_total_num_tokens"], info["page_size"], info["max_running_requests"],
                    info["context_len"])
        metrics = MetricsCollector(sa.served_model_name) if sa.enable_metrics else None
        tm = TokenizerManager(sa, port_args, info, metrics)
        app = create_app(tm, sa, metrics, __version__)
        threading.Thread(target=_watchdog, args=(procs, stopping), daemon=True).start()
        logger.info("serving on http://%s:%d", sa.host, sa.port)
        # uvicorn's own bound cuts connections that outlive our abort (e.g. a client not reading).
        config = uvicorn.Config(app, host=sa.host, port=sa.port, log_level=sa.log_level if sa.log_level != "debug"
                                else "debug", timeout_keep_alive=5, access_log=sa.log_requests,
                                timeout_graceful_shutdown=int(sa.graceful_shutdown_timeout) + 5)
        server = _draining_server(config, tm, sa.graceful_shutdown_timeout)
        try:
            server.run()
        finally:  # Ctrl-C (KeyboardInterrupt out of run) stops them the same way
            _stop_children(procs, stopping)
        return 0 if server.started else 1
    finally:
        _kill(procs)


def main(argv: list[str] | None = None) -> int:
    from sglang.srt.server_args import prepare_server_args

    argv = sys.argv[1:] if argv is None else argv
    try:
        sa = prepare_server_args(argv)
        return launch_server(sa)
    except (ServerArgsError, LaunchError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ServerArgsError) else 1
    except KeyboardInterrupt:
        return 130
