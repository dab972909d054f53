"""Overlap scheduling pieces: the device-resident token table and the batch launchers.

Overlap (upstream's default; `--disable-overlap-schedule` turns it off) prepares and launches step
n+1 while step n is still running, and processes step n's results afterwards. Two things make that
possible without a device->host round trip between steps:

- `LastTokenTable`: the last sampled token of every request slot, on the device. The scheduler
  writes `FUTURE_TOKEN` (-1) for an input id it does not know yet (a decode row's previous token);
  the worker resolves those on the device (`resolve`) right before the forward and stores the newly
  sampled ids (`store`) right after sampling. Both are stream-ordered (or, on a CPU worker thread,
  ordered by the single thread), so step n+1 reads what step n wrote.
- A launcher: `InlineLauncher` runs the forward on the caller's thread (CUDA: kernels are queued
  asynchronously and `result()` waits for the step's copy-done event; CPU: the forward simply
  runs at launch); `ThreadLauncher` runs it on one worker thread (CPU, one rank, with
  SGLANG_CPU_OVERLAP_THREAD=1: the tests use it so the overlapped loop runs really concurrently).
  Not the CPU default: the forward of a small model is Python-bound, the GIL serialises the two
  threads and OpenMP workers spinning beside the scheduler's thread made steps ~2x slower.
- `OverlapState`: the scheduler's one piece of overlap state, the step launched last whose results
  are not processed yet (`LaunchedStep`; its requests' epochs at launch are `batch.req_epochs`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Generic, Protocol, TypeVar

import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.utils.common import get_bool_env

FUTURE_TOKEN = -1  # an input id the device fills in from LastTokenTable

T = TypeVar("T")


class LastTokenTable:
    """`table[req_pool_idx]` = that request's last sampled token (device, int64)."""

    def __init__(self, num_req_slots: int, device: str) -> None:
        # +1: the padding request slot of CUDA-graph padding rows
        self.table = torch.zeros(num_req_slots + 1, dtype=torch.int64, device=device)

    def resolve(self, input_ids: torch.Tensor, token_req_slots: torch.Tensor) -> torch.Tensor:
        """input_ids with each FUTURE_TOKEN replaced by its request's last token (no host sync)."""
        return torch.where(input_ids == FUTURE_TOKEN, self.table[token_req_slots], input_ids)

    def store(self, req_pool_indices: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        self.table[req_pool_indices] = next_token_ids.to(self.table.dtype)


class Pending(Generic[T]):
    """A launched step; `result()` returns what the launched function returned."""

    def __init__(self, value: T | None = None, future: Future | None = None) -> None:
        self._value, self._future = value, future

    def result(self) -> T:
        if self._future is not None:
            self._value, self._future = self._future.result(), None
        return self._value


class Launcher(Protocol):
    """Runs a worker's steps in launch order. `inline`: on the caller's thread (so a layer-end
    hook of the forward runs on the scheduler's thread, between its other work)."""

    inline: bool

    def launch(self, fn: Callable[[], T]) -> Pending[T]: ...

    def shutdown(self) -> None: ...


class InlineLauncher:
    """Runs the step now, on this thread."""

    inline = True

    def launch(self, fn: Callable[[], T]) -> Pending[T]:
        return Pending(value=fn())

    def shutdown(self) -> None:
        pass


class ThreadLauncher:
    """Runs steps on one worker thread, in launch order (the CPU's stand-in for a CUDA stream)."""

    inline = False

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-forward")

    def launch(self, fn: Callable[[], T]) -> Pending[T]:
        return Pending(future=self._pool.submit(fn))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


INLINE_LAUNCHER = InlineLauncher()  # stateless: one serves every worker that runs steps inline


def make_launcher(device: str, world_size: int, overlap: bool) -> InlineLauncher | ThreadLauncher:
    """A worker thread only when asked and safe: one CPU rank. On CUDA the device queue gives the
    overlap; with several CPU ranks every collective must be issued from the scheduler's thread."""
    if (overlap and torch.device(device).type == "cpu" and world_size == 1
            and get_bool_env("SGLANG_CPU_OVERLAP_THREAD")):
        return ThreadLauncher()
    return InlineLauncher()


class OverlapWorker(Protocol):
    """What overlap asks of the worker (managers/tp_worker.BaseTpWorker declares both)."""

    supports_overlap: bool

    def needs_host_state(self, req: Req) -> bool: ...


@dataclass
class LaunchedStep:
    """A step launched on the worker whose results are not processed yet."""

    batch: ScheduleBatch
    pending: Pending


class OverlapState:
    """Overlap scheduling (`--disable-overlap-schedule` off, and a worker that supports it): step n+1
    is launched before step n's results are processed, so one step is `launched` between iterations.
    Without it each step is processed right after its launch and `launched` is None between them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.launched: LaunchedStep | None = None

    def active(self, worker: OverlapWorker) -> bool:
        return self.enabled and worker.supports_overlap

    @property
    def reqs(self) -> list[Req]:
        """The launched step's requests (a prefill's are in no queue until its step is processed)."""
        return self.launched.batch.reqs if self.launched is not None else []

    def num_new_running(self) -> int:
        """Requests the launched step prefills: they join `running` when it is processed."""
        return self.launched.batch.num_extend_reqs if self.launched is not None else 0

    def must_process_first(self, running: list[Req], worker: OverlapWorker) -> bool:
        """The launched step's results are applied before the next step is built unless overlap is
        active, no prefill chunk is in it (its request continues next, one chunked request at a
        time) and no request that runs next needs those results on the host to be sampled."""
        if self.launched is None:
            return False
        if not self.active(worker) or any(r.is_chunked for r in self.launched.batch.reqs):
            return True
        return any(r.needs_host_sampling_state() or worker.needs_host_state(r) for r in running)

    def take(self) -> LaunchedStep:
        step, self.launched = self.launched, None
        return step

    def after_launch(self, step: LaunchedStep | None, worker: OverlapWorker) -> list[LaunchedStep]:
        """Record the step just launched (None: none); the steps to process now, oldest first: the
        one launched before it and, when overlap is not active, this one too."""
        done = [self.take()] if self.launched is not None else []
        if step is not None and not self.active(worker):
            done.append(step)
        else:
            self.launched = step
        return done
