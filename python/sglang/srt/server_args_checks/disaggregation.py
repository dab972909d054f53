"""Validation of the PD disaggregation flags: a mixin of ServerArgs (reads its fields)."""

from __future__ import annotations

from sglang.srt.errors import ServerArgsError
from sglang.srt.server_args_checks.common import FlagChecks


class DisaggregationChecks(FlagChecks):
    def _check_disaggregation(self) -> None:
        self._choice("disaggregation_mode")
        self._choice("disaggregation_transfer_backend")
        port = self.disaggregation_bootstrap_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ServerArgsError("disaggregation_bootstrap_port", f"must be in 1..65535, got {port!r}")
        if self.disaggregation_mode == "null":
            return
        if self.disaggregation_transfer_backend == "mooncake":
            from sglang.srt.disaggregation.transfer import mooncake_import_error

            reason = mooncake_import_error()
            if reason:
                raise ServerArgsError("disaggregation_transfer_backend", reason)
        if self.disaggregation_transfer_backend == "fake":
            from sglang.srt.utils.common import resolve_device

            if resolve_device(self.device) != "cpu":  # a GPU pointer would crash the memmove (segfault)
                raise ServerArgsError("disaggregation_transfer_backend", "fake (tests only) copies host memory "
                                      "with memmove: it needs --device cpu (KV on a GPU: cuda_ipc or mooncake)")
        if self.disaggregation_transfer_backend == "cuda_ipc":
            import torch

            if self.device == "cpu" or not torch.cuda.is_available():
                raise ServerArgsError("disaggregation_transfer_backend", "cuda_ipc needs the KV pools on a CUDA GPU "
                                      "(use mooncake on CPU machines)")
