"""Value types shared by the tool-call detectors (upstream SGLang's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCallItem:
    """One tool-call event.

    Streaming: the first item of a call carries `name` and `parameters=""`; the following items
    carry `name=None` and the next piece of the arguments JSON. Non-stream: one item per call
    with the whole arguments JSON. `tool_index` numbers the accepted calls of one response
    (0, 1, ...), the same in both modes.
    """

    tool_index: int
    name: str | None = None
    parameters: str = ""


@dataclass
class StreamingParseResult:
    """Normal-text delta and tool-call items of one parse step."""

    normal_text: str = ""
    calls: list[ToolCallItem] = field(default_factory=list)
