"""Validation of the speculative-decoding flags: a mixin of ServerArgs (reads its fields)."""

from __future__ import annotations

import os

from sglang.srt.errors import ServerArgsError
from sglang.srt.server_args_checks.common import FlagChecks


class SpeculativeChecks(FlagChecks):
    def _check_speculative(self) -> None:
        if self.speculative_algorithm is None:
            for name in ("speculative_draft_model_path", "speculative_num_draft_tokens", "speculative_token_map"):
                if getattr(self, name) is not None:
                    raise ServerArgsError(name, "needs --speculative-algorithm")
            if self.speculative_adaptive:
                raise ServerArgsError("speculative_adaptive", "needs --speculative-algorithm")
            return
        self._choice("speculative_algorithm")
        self._positive("speculative_num_steps", allow_none=False)
        self._positive("speculative_eagle_topk", allow_none=False)
        if self.speculative_eagle_topk != 1:
            raise ServerArgsError("speculative_eagle_topk", "only 1 (a draft chain) is supported: tree drafts need a "
                                  "tree attention mask, which this server does not implement")
        n = self.speculative_num_draft_tokens
        if n is not None and n != self.speculative_num_steps + 1:
            raise ServerArgsError("speculative_num_draft_tokens", f"must be --speculative-num-steps + 1 "
                                  f"({self.speculative_num_steps + 1}) with --speculative-eagle-topk 1, got {n}")
        if self.enable_mixed_chunk:
            raise ServerArgsError("enable_mixed_chunk", "is not supported with --speculative-algorithm (a verify step "
                                  "computes several rows per decoding request)")
        if self.speculative_token_map is not None and not os.path.isfile(self.speculative_token_map):
            raise ServerArgsError("speculative_token_map", f"no such file: {self.speculative_token_map}")
