"""`--hicache-storage-backend file`: pages as files in a directory, written behind a bounded queue.

Directory: extra config `file_path`, else env `SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR` (upstream's
name), else /tmp/hicache; a namespace (model, rank) is a subdirectory. A page is
`<dir>/<key[:2]>/<key>.page` (the two-character fan-out keeps directories small at millions of
pages). Writes go to a temporary file that is renamed over the final name, so a reader or a
restarted server sees a whole page or none; a torn or corrupted file fails the blob's CRC and is a
miss (removed). Pages survive restarts: a new instance on the same directory reads them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Sequence

import numpy

from sglang.srt.mem_cache.memory_pool import KVPoolLayout
from sglang.srt.mem_cache.storage.hicache_storage import HiCacheStorage, PageData

logger = logging.getLogger(__name__)

FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_FILE_DIR = "/tmp/hicache"

_SUFFIX = ".page"


class HiCacheFile(HiCacheStorage):
    """File backend. `batch_set` encodes on the caller's thread (so the caller may reuse its
    buffers at once) and queues the blobs; one writer thread writes them. The queue is bounded
    (`write_queue_size` batches, default 64): a full queue blocks `batch_set`, which bounds the
    memory held by pending pages. Pending pages are readable (`batch_get` / `batch_exists`) before
    they reach the disk. `flush()` waits for the queue; `close()` flushes and stops the thread."""

    def __init__(self, layout: KVPoolLayout, extra_config: dict | None = None, namespace: str = "",
                 fingerprint: str = "") -> None:
        super().__init__(layout, namespace, fingerprint)
        cfg = dict(extra_config or {})
        root = cfg.get("file_path") or os.environ.get(FILE_DIR_ENV) or DEFAULT_FILE_DIR
        self.root = root
        self.dir = os.path.join(root, namespace) if namespace else root
        os.makedirs(self.dir, exist_ok=True)
        self.fsync = bool(cfg.get("fsync", False))  # off: a crash loses pages, never corrupts a load (CRC)
        self._queue: queue.Queue = queue.Queue(maxsize=int(cfg.get("write_queue_size", 64)))
        self._pending: dict[str, memoryview] = {}
        self._lock = threading.Lock()
        self._epoch = 0  # bumped by clear(): queued writes of an older epoch are dropped
        self.write_errors = 0
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="hicache-file-writer", daemon=True)
        self._writer.start()

    # -- paths ---------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + _SUFFIX)

    def _where(self, key: str) -> str:
        return self.path(key)

    def namespaces_like(self, prefix: str) -> list[str]:
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return sorted(n for n in names if n.startswith(prefix) and n != self.namespace
                      and os.path.isdir(os.path.join(self.root, n)))

    # -- writes --------------------------------------------------------------------------------
    def _put(self, keys: list[str], values: Sequence[PageData]) -> list[bool]:
        if self._closed:
            raise RuntimeError("HiCacheFile is closed")
        todo = []
        for k, v in zip(keys, values):
            if k in self._pending or os.path.exists(self.path(k)):
                continue  # content-addressed: the stored page is this page
            todo.append((k, self.encode(k, v)))
        if todo:
            with self._lock:
                for k, blob in todo:
                    self._pending[k] = blob
                epoch = self._epoch
            self._queue.put((epoch, todo))
        return [True] * len(keys)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                epoch, todo = item
                for k, blob in todo:
                    if epoch == self._epoch:
                        self._write_file(k, blob)
                    with self._lock:
                        if self._pending.get(k) is blob:
                            del self._pending[k]
            finally:
                self._queue.task_done()

    def _write_file(self, key: str, blob: memoryview) -> None:
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: readers see the old state or the whole page
        except OSError as e:
            self.write_errors += 1
            logger.warning("HiCache file storage: could not write %s (%s); the page stays uncached", path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._writer.join()

    # -- reads ---------------------------------------------------------------------------------
    def _get(self, keys: list[str]) -> list[bytearray | memoryview | None]:
        out: list[bytearray | memoryview | None] = []
        for k in keys:
            with self._lock:
                blob = self._pending.get(k)
            if blob is not None:
                out.append(bytearray(blob))  # a copy: the decoded page must not alias the write buffer
                continue
            try:
                with open(self.path(k), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    buf = memoryview(numpy.empty(size, dtype=numpy.uint8))  # not zeroed: readinto fills it
                    n = f.readinto(buf)
                out.append(buf if n == size else buf[:n])
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                logger.warning("HiCache file storage: could not read %s (%s): a miss", self.path(k), e)
                out.append(None)
        return out

    def _exists_prefix(self, keys: list[str]) -> int:
        n = 0
        for k in keys:
            with self._lock:
                pending = k in self._pending
            if not pending and not os.path.exists(self.path(k)):
                break
            n += 1
        return n

    def _drop_invalid(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def clear(self) -> None:
        with self._lock:
            self._epoch += 1
            self._pending.clear()
        self.flush()  # queued writes of the old epoch are skipped
        for sub in os.listdir(self.dir):
            d = os.path.join(self.dir, sub)
            if len(sub) != 2 or not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                if name.endswith(_SUFFIX) or name.endswith(".tmp"):
                    try:
                        os.unlink(os.path.join(d, name))
                    except OSError:
                        pass

    def num_pages(self) -> int:
        """Pages on disk (tests, stats)."""
        return sum(name.endswith(_SUFFIX) for _, _, files in os.walk(self.dir) for name in files)
