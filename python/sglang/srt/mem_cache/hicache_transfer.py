"""What HiRadixCache asks of the HiCache transfer controller (`managers/cache_controller.py`,
HiCacheController): the queued transfer (`TransferOp`) and the controller's face (`HostTransfers`);
and of its backup policy (`managers/hicache_backup.py`, AsyncBackup): `NullBackup` when there is
none. The cache is handed both and codes against these faces, so mem_cache/ imports no manager."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

_op_ids = itertools.count(1)


@dataclass
class TransferOp:
    """One queued transfer of whole pages (host slots and device slots, page-aligned, same order)."""

    kind: str  # "load" | "backup" | "store" (host -> L3)
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    page_keys: list | None = None  # per-page content keys (prefix hashes) for trace / L3
    id: int = field(default_factory=lambda: next(_op_ids))
    # per pair: layers copied (load: enqueued on the copy stream), guarded by the controller's lock
    progress: list[int] = field(default_factory=list)
    events: list[list[Any]] = field(default_factory=list)  # per pair, per layer: CUDA event or None
    done: bool = False
    error: BaseException | None = None
    on_done: Callable[["TransferOp"], None] | None = None
    nodes: list = field(default_factory=list)  # radix nodes the op pins (owned by the cache)
    # perf_counter stamps of the op's phases (submitted, started on the copy thread, planned there,
    # copies queued, synced, finished): where an op's time goes beyond the copies (bench_hicache.py)
    timeline: dict[str, float] = field(default_factory=dict)


OnDone = Callable[[TransferOp], None]


class HostTransfers(Protocol):
    """Queues page transfers between device pools and their host mirrors (and the L3 tier); acks come
    back through `poll()` on the scheduler's thread, which runs each op's `on_done`."""

    cp_size: int
    pairs: list  # (device pool, host mirror) per pool: target, then draft
    trace: Any  # the KV trace's recorder, or None
    storage: Any  # the L3 tier (mem_cache/storage/tier.py), or None

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, page_keys: list | None = None,
             on_done: OnDone | None = None) -> TransferOp: ...

    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor, page_keys: list | None = None,
               on_done: OnDone | None = None) -> TransferOp: ...

    def backup_layer(self, pair: int, layer_id: int, device_indices: torch.Tensor, host_indices: torch.Tensor,
                     page_keys: list | None, done: Callable[[BaseException | None], None],
                     runs: Any = None) -> None: ...

    def store(self, host_indices: torch.Tensor, page_keys: list[str], on_done: OnDone | None = None) -> TransferOp: ...

    def poll(self) -> list[TransferOp]: ...

    def wait_idle(self, timeout: float = 60.0) -> None: ...

    def unacked_ops(self) -> int: ...


class NullBackup:
    """No backup during the forward (write_back, write_through_selective, a threaded launcher): the
    cache calls the same hooks as on AsyncBackup, and nothing happens."""

    def reset(self) -> None:
        pass

    def covers(self, node) -> int:
        """Tokens of `node` a backup in flight already copies (none)."""
        return 0

    def on_insert(self, req) -> None:
        pass

    def check_events(self) -> None:
        pass

    def has_attached(self) -> bool:
        return False

    def prepare_batch(self, batch) -> None:
        pass

    def on_batch_done(self, batch) -> None:
        pass

    def reserved_size(self) -> int:
        return 0
