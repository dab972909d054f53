"""Validation of the HiCache flags (host tier and L3 storage): a mixin of ServerArgs (reads its fields)."""

from __future__ import annotations

from sglang.srt.errors import ServerArgsError
from sglang.srt.server_args_checks.common import FlagChecks


class HiCacheChecks(FlagChecks):
    def _check_hicache_storage(self) -> None:
        from sglang.srt.mem_cache.storage.registry import StorageConfigError, validate_storage_args

        try:
            validate_storage_args(self.hicache_storage_backend, self.hicache_storage_backend_extra_config,
                                  self.hicache_storage_prefetch_policy, self.enable_hierarchical_cache)
        except StorageConfigError as e:
            raise ServerArgsError(e.flag, e.reason) from None

    def _check_hicache(self) -> None:
        for name in ("hicache_write_policy", "hicache_io_backend", "hicache_mem_layout"):
            self._choice(name)
        for name in ("hicache_ratio", "hicache_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ServerArgsError(name, f"must be a finite number >= 0, got {v!r}")
        if not self.enable_hierarchical_cache:
            return
        if self.hicache_ratio <= 0 and self.hicache_size <= 0:
            raise ServerArgsError("hicache_ratio", "must be > 0 (or give --hicache-size in GB)")
        if self.disable_radix_cache:
            raise ServerArgsError("enable_hierarchical_cache", "needs the radix cache (drop --disable-radix-cache)")
        if self.hicache_io_backend == "kernel":
            import torch

            if self.device == "cpu" or not torch.cuda.is_available():
                raise ServerArgsError("hicache_io_backend", "kernel is a GPU page-copy kernel (it reads pinned host "
                                      "memory from the device); on CPU use --hicache-io-backend direct")
