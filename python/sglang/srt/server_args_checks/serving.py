"""Validation of the scheduling, HTTP, OpenAI-API, logging and endpoint flags: a mixin of ServerArgs
(reads its fields)."""

from __future__ import annotations

from sglang.srt.errors import ServerArgsError
from sglang.srt.server_args_checks.common import FlagChecks


class ServingChecks(FlagChecks):
    def _check_scheduling(self) -> None:
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size <= 0:
            raise ServerArgsError("chunked_prefill_size",
                                  f"must be -1 (off) or positive, got {self.chunked_prefill_size}")
        self._positive("max_prefill_tokens", allow_none=False)
        self._choice("schedule_policy")

    def _check_http(self) -> None:
        if not 0 < self.port < 65536:
            raise ServerArgsError("port", f"must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ServerArgsError("api_key", "must not be empty")
        t = self.graceful_shutdown_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ServerArgsError("graceful_shutdown_timeout", f"must be a finite number of seconds >= 0, got {t!r}")

    def _check_api(self) -> None:
        if self.chat_template is not None:
            import os

            if not os.path.isfile(self.chat_template):
                raise ServerArgsError("chat_template", f"{self.chat_template!r} is not a file")
        if self.reasoning_parser is not None:
            from sglang.srt.parser.reasoning_parser import ReasoningParser

            if self.reasoning_parser not in ReasoningParser.DetectorMap:
                raise ServerArgsError("reasoning_parser", f"{self.reasoning_parser!r} is not one of "
                                      f"{sorted(ReasoningParser.DetectorMap)}")
        if self.tool_call_parser is not None:
            from sglang.srt.function_call.function_call_parser import FunctionCallParser

            names = FunctionCallParser.ToolCallParserEnum
            if self.tool_call_parser not in names:
                raise ServerArgsError("tool_call_parser", f"{self.tool_call_parser!r} is not one of {sorted(names)}")

    def _check_logging(self) -> None:
        self._choice("log_level")

    def _check_endpoints(self) -> None:
        self._positive("max_payload_size", allow_none=False)
        self._positive("decode_log_interval", allow_none=False)
