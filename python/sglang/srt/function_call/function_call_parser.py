"""Tool-call parsing for /v1/chat/completions, selected by `--tool-call-parser` name.

Contract (tested at every split point of the documented examples):
* streaming yields, per call, first `ToolCallItem(i, name, "")` and then pieces of the
  arguments JSON (`name=None`); their concatenation equals the `parameters` of call i from
  `parse_non_stream` on the full text, i.e. `json.dumps(args, ensure_ascii=False)`;
* the streamed normal text equals the non-stream normal text (all non-call text, `.strip()`-ed);
* call `parse_stream_end()` once when the stream ends (only matters for text cut inside a marker).
"""

from __future__ import annotations

from typing import Any

from sglang.srt.function_call.base_format_detector import BaseFormatDetector
from sglang.srt.function_call.core_types import ToolCallItem
from sglang.srt.function_call.deepseekv3_detector import DeepSeekV3Detector
from sglang.srt.function_call.deepseekv31_detector import DeepSeekV31Detector
from sglang.srt.function_call.deepseekv32_detector import DeepSeekV32Detector
from sglang.srt.function_call.glm4_moe_detector import Glm4MoeDetector
from sglang.srt.function_call.glm47_moe_detector import Glm47MoeDetector
from sglang.srt.function_call.utils import get_json_schema_constraint

__all__ = ["FunctionCallParser", "ToolCallItem", "get_json_schema_constraint"]


class FunctionCallParser:
    """Wraps one detector; `tools` are OpenAI tool dicts
    `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    ToolCallParserEnum: dict[str, type[BaseFormatDetector]] = {
        "deepseekv3": DeepSeekV3Detector,
        "deepseekv31": DeepSeekV31Detector,
        "deepseekv32": DeepSeekV32Detector,
        "glm": Glm4MoeDetector,
        "glm45": Glm4MoeDetector,
        "glm47": Glm47MoeDetector,
    }

    def __init__(self, tools: list[dict[str, Any]], tool_call_parser: str) -> None:
        detector_class = self.ToolCallParserEnum.get(tool_call_parser)
        if detector_class is None:
            raise ValueError(
                f"Unsupported tool_call_parser {tool_call_parser!r}; "
                f"valid names: {', '.join(sorted(self.ToolCallParserEnum))}"
            )
        self.detector = detector_class()
        self.tools = tools or []

    def has_tool_call(self, text: str) -> bool:
        return bool(self.tools) and self.detector.has_tool_call(text)

    def parse_non_stream(self, full_text: str) -> tuple[str, list[ToolCallItem]]:
        """Returns (normal_text, calls); without tools the text passes through untouched."""
        if not self.tools:
            return full_text, []
        result = self.detector.detect_and_parse(full_text, self.tools)
        return result.normal_text, result.calls

    def parse_stream_chunk(self, chunk_text: str) -> tuple[str, list[ToolCallItem]]:
        """Returns (normal-text delta, call items) for one chunk."""
        if not self.tools:
            return chunk_text, []
        result = self.detector.parse_streaming_increment(chunk_text, self.tools)
        return result.normal_text, result.calls

    def parse_stream_end(self) -> tuple[str, list[ToolCallItem]]:
        """Flush at end of stream: a held-back partial marker is normal text after all."""
        if not self.tools:
            return "", []
        result = self.detector.finish(self.tools)
        return result.normal_text, result.calls

    def get_json_schema_constraint(self, tool_choice: Any, parallel_tool_calls: bool = True) -> dict | None:
        return get_json_schema_constraint(self.tools, tool_choice, parallel_tool_calls)
