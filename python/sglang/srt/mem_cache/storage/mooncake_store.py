"""`--hicache-storage-backend mooncake`: pages in Mooncake Store (the distributed store upstream uses).

Config (upstream's names): extra config keys, else env, else default --
    master_server_address  MOONCAKE_MASTER                (required) host:rpc_port of mooncake_master
    metadata_server        MOONCAKE_TE_META_DATA_SERVER   P2PHANDSHAKE, or http://host:port/metadata
    local_hostname         MOONCAKE_LOCAL_HOSTNAME        localhost
    protocol               MOONCAKE_PROTOCOL              tcp (rdma where the NICs allow)
    device_name            MOONCAKE_DEVICE                "" (RDMA device list)
    global_segment_size    MOONCAKE_GLOBAL_SEGMENT_SIZE   4gb: memory this process lends the store
    local_buffer_size      MOONCAKE_LOCAL_BUFFER_SIZE     16mb
    staging_pages          -                              64: pages per registered staging slab
A namespace becomes a key prefix. Transfers are zero-copy between Mooncake and a registered
staging slab per direction: pages are encoded straight into one for `batch_put_from` and read into the other by
`batch_get_into` (one copy out, so returned pages never alias the slab).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Sequence

import torch

from sglang.srt.mem_cache.memory_pool import KVPoolLayout
from sglang.srt.mem_cache.storage.hicache_storage import HiCacheStorage, PageData

logger = logging.getLogger(__name__)

MOONCAKE_PIP = "mooncake-transfer-engine-non-cuda"
_OBJECT_NOT_FOUND = -704
_BUFFER_TOO_SMALL = -600
_GET_SLACK = 4096  # a slot holds a little more than a blob, so a longer foreign header is still read


def import_mooncake_store() -> type:
    """MooncakeDistributedStore, or an ImportError naming the package to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise ImportError(
            f"--hicache-storage-backend mooncake needs Mooncake Store: `pip install {MOONCAKE_PIP}` (CPU/TCP build; "
            "`mooncake-transfer-engine` on CUDA hosts) and, on Debian/Ubuntu, `apt-get install libibverbs1 "
            f"librdmacm1 libnuma1` ({e})"
        ) from e
    return MooncakeDistributedStore


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as '4gb', '512MB', '1048576'."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(value).lower())
    if not m:
        raise ValueError(f"not a size: {value!r} (use bytes or e.g. '4gb')")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def mooncake_config(extra_config: dict | None) -> dict:
    cfg = dict(extra_config or {})
    env = os.environ.get
    master = cfg.get("master_server_address") or env("MOONCAKE_MASTER")
    if not master:
        raise ValueError("mooncake storage needs the master's address: extra config 'master_server_address' "
                         "or env MOONCAKE_MASTER (host:port of mooncake_master)")
    return {
        "master_server_address": master,
        "metadata_server": cfg.get("metadata_server") or env("MOONCAKE_TE_META_DATA_SERVER") or "P2PHANDSHAKE",
        "local_hostname": cfg.get("local_hostname") or env("MOONCAKE_LOCAL_HOSTNAME") or "localhost",
        "protocol": cfg.get("protocol") or env("MOONCAKE_PROTOCOL") or "tcp",
        "device_name": cfg.get("device_name") or env("MOONCAKE_DEVICE") or "",
        "global_segment_size": parse_size(cfg.get("global_segment_size") or env("MOONCAKE_GLOBAL_SEGMENT_SIZE")
                                          or "4gb"),
        "local_buffer_size": parse_size(cfg.get("local_buffer_size") or env("MOONCAKE_LOCAL_BUFFER_SIZE") or "16mb"),
        "staging_pages": int(cfg.get("staging_pages", 64)),
    }


class MooncakeStore(HiCacheStorage):
    """Mooncake backend: synchronous puts and gets (Mooncake replicates and evicts on its side)."""

    def __init__(self, layout: KVPoolLayout, extra_config: dict | None = None, namespace: str = "",
                 fingerprint: str = "") -> None:
        super().__init__(layout, namespace, fingerprint)
        store_cls = import_mooncake_store()
        self.config = mooncake_config(extra_config)
        c = self.config
        self.store = store_cls()
        rc = self.store.setup(c["local_hostname"], c["metadata_server"], c["global_segment_size"],
                              c["local_buffer_size"], c["protocol"], c["device_name"], c["master_server_address"])
        if rc != 0:
            raise RuntimeError(f"Mooncake Store setup failed (rc {rc}) with {c}: is mooncake_master running at "
                               f"{c['master_server_address']} and the metadata server reachable?")
        self._prefix = f"{namespace}/" if namespace else ""
        self._slot = self.codec.blob_size + _GET_SLACK
        self._chunk = max(1, c["staging_pages"])
        # one registered slab per direction, so a backup thread and a prefetch thread never share one
        self._slabs: dict[str, torch.Tensor] = {}
        self._locks = {"put": threading.Lock(), "get": threading.Lock()}
        for direction in self._locks:
            self._register(direction)

    def _register(self, direction: str) -> torch.Tensor:
        slab = self._slabs.get(direction)
        if slab is None:
            slab = torch.empty(self._chunk * self._slot, dtype=torch.uint8)
            rc = self.store.register_buffer(slab.data_ptr(), slab.numel())
            if rc != 0:
                raise RuntimeError(f"Mooncake register_buffer of {slab.numel()} bytes failed (rc {rc})")
            self._slabs[direction] = slab
        return slab

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _chunks(self, idx: list[int]) -> list[list[int]]:
        return [idx[i : i + self._chunk] for i in range(0, len(idx), self._chunk)]

    def _put(self, keys: list[str], values: Sequence[PageData]) -> list[bool]:
        present = self.store.batch_is_exist([self._k(k) for k in keys])
        ok = [rc == 1 for rc in present]  # content-addressed: a stored key is this page
        with self._locks["put"]:
            slab = self._slabs["put"]
            base, view = slab.data_ptr(), memoryview(slab.numpy())
            for chunk in self._chunks([i for i, done in enumerate(ok) if not done]):
                ptrs, sizes = [], []
                for j, i in enumerate(chunk):
                    blob = self.encode(keys[i], values[i], view[j * self._slot : (j + 1) * self._slot])
                    ptrs.append(base + j * self._slot)
                    sizes.append(len(blob))
                rcs = self.store.batch_put_from([self._k(keys[i]) for i in chunk], ptrs, sizes)
                for i, rc in zip(chunk, rcs):
                    ok[i] = rc == 0
                    if rc != 0:
                        logger.warning("Mooncake put of page %s failed (rc %s): the page stays uncached",
                                       keys[i][:16], rc)
        return ok

    def _get(self, keys: list[str]) -> list[bytearray | None]:
        out: list[bytearray | None] = [None] * len(keys)
        with self._locks["get"]:
            slab = self._slabs["get"]
            base, view = slab.data_ptr(), memoryview(slab.numpy())
            for chunk in self._chunks(list(range(len(keys)))):
                ptrs = [base + j * self._slot for j in range(len(chunk))]
                rcs = self.store.batch_get_into([self._k(keys[i]) for i in chunk], ptrs, [self._slot] * len(chunk))
                for j, (i, rc) in enumerate(zip(chunk, rcs)):
                    if rc >= 0:  # copied out: the slab is reused by the next chunk / call
                        out[i] = bytearray(view[j * self._slot : j * self._slot + rc])
                    elif rc == _BUFFER_TOO_SMALL:  # larger than any page of our layout: fetch it so decode says why
                        out[i] = bytearray(self.store.get(self._k(keys[i])))
                    elif rc != _OBJECT_NOT_FOUND:
                        logger.warning("Mooncake get of page %s failed (rc %s): a miss", keys[i][:16], rc)
        return out

    def _exists_prefix(self, keys: list[str]) -> int:
        n = 0
        for rc in self.store.batch_is_exist([self._k(k) for k in keys]):
            if rc != 1:
                break
            n += 1
        return n

    def _drop_invalid(self, key: str) -> None:
        self.store.remove(self._k(key), True)

    def clear(self) -> None:
        """Remove this namespace's pages (every object of the store when no namespace is set)."""
        if self._prefix:
            self.store.remove_by_regex("^" + re.escape(self._prefix), True)
        else:
            self.store.remove_all(True)

    def close(self) -> None:
        if self.store is not None:
            for slab in self._slabs.values():
                self.store.unregister_buffer(slab.data_ptr())
            self._slabs.clear()
            self.store.close()
            self.store = None
