"""Validation of the parallelism flags (TP, attention CP, EP, nodes): a mixin of ServerArgs (reads its fields)."""

from __future__ import annotations

from sglang.srt.errors import ServerArgsError
from sglang.srt.server_args_checks.common import FlagChecks


class ParallelChecks(FlagChecks):
    def _check_parallel(self) -> None:
        for name in ("attn_cp_size", "ep_size", "nnodes", "dist_timeout"):
            self._positive(name, allow_none=False)
        self._choice("nsa_prefill_cp_mode")
        self._choice("moe_a2a_backend")
        tp = self.tp_size
        if self.enable_nsa_prefill_context_parallel:
            if self.attn_cp_size != tp:
                raise ServerArgsError("attn_cp_size", f"must equal --tp-size ({tp}) with context parallel "
                                      f"(attention runs CP over all ranks), got {self.attn_cp_size}")
            if self.enable_two_batch_overlap:
                raise ServerArgsError("enable_two_batch_overlap", "is not supported with context parallel")
            if self.hicache_storage_backend is not None and tp > 1:  # each rank's host tier holds its own pages
                raise ServerArgsError("hicache_storage_backend", "is not supported with context parallel yet")
        elif self.attn_cp_size != 1:
            raise ServerArgsError("attn_cp_size", "needs --enable-nsa-prefill-context-parallel")
        if self.ep_size not in (1, tp):
            raise ServerArgsError("ep_size", f"must be 1 or --tp-size ({tp}), got {self.ep_size}")
        if self.moe_a2a_backend == "deepep":
            if self.ep_size == 1 or not self.enable_nsa_prefill_context_parallel:
                raise ServerArgsError("moe_a2a_backend", "deepep dispatches tokens between expert-parallel ranks: "
                                      "it needs --ep-size > 1 and --enable-nsa-prefill-context-parallel")
            import importlib.util

            if importlib.util.find_spec("deep_ep") is None:
                raise ServerArgsError("moe_a2a_backend", "deepep needs the 'deep_ep' package, which is not installed "
                                      "(build it from github.com/deepseek-ai/DeepEP, or use --moe-a2a-backend none)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ServerArgsError("node_rank", f"must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if tp % self.nnodes:
            raise ServerArgsError("nnodes", f"--tp-size {tp} must be a multiple of --nnodes {self.nnodes}")
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ServerArgsError("dist_init_addr",
                                      f"needs host:port with --nnodes > 1, got {self.dist_init_addr!r}")
