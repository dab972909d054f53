"""Model output -> reasoning, content and tool calls, whole or as a stream of events.

One `OutputParser` per choice. The text first goes through the reasoning parser (if the server has
one and the request enables thinking), then the content goes through the tool-call parser
(`tool_choice: auto`) or is read as the JSON array the grammar forced (`required` / a named
function). Streamed events, concatenated, always equal the non-streamed parse of the same text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.parser.reasoning_parser import ReasoningParser, make_reasoning_parser


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallOut:
    index: int
    name: str
    arguments: str = ""
    id: str = field(default_factory=tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "index": self.index, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCallOut]


@dataclass
class Event:
    """kind: reasoning | content (text), tool_start (call), tool_args (call.index + text)."""

    kind: str
    text: str = ""
    call: ToolCallOut | None = None


class JsonArrayToolCalls:
    """Reads `[{"name": ..., "parameters": {...}}, ...]` (the schema `tool_choice` forces) as it
    streams: each element is emitted once it is complete."""

    def __init__(self) -> None:
        self.buf, self.pos, self.count = "", 0, 0
        self._dec = json.JSONDecoder()

    def feed(self, text: str) -> list[ToolCallOut]:
        self.buf += text
        calls = []
        while True:
            i = self.pos
            while i < len(self.buf) and self.buf[i] in " \t\r\n[,":
                i += 1
            if i >= len(self.buf) or self.buf[i] == "]":
                self.pos = i
                return calls
            try:
                obj, end = self._dec.raw_decode(self.buf, i)
            except json.JSONDecodeError:
                self.pos = i
                return calls  # element not complete yet
            self.pos = end
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                args = obj.get("parameters", obj.get("arguments", {}))
                calls.append(ToolCallOut(self.count, obj["name"], json.dumps(args, ensure_ascii=False)))
                self.count += 1


class OutputParser:
    def __init__(self, reasoning_parser: str | None, template_kwargs: dict[str, Any] | None,
                 stream_reasoning: bool, tools: list[dict] | None, tool_mode: str, tool_call_parser: str | None,
                 parallel_tool_calls: bool = True) -> None:
        """reasoning_parser: None = no reasoning split. tool_mode: none (plain content), parser
        (`tool_call_parser` finds calls in the text) or json_array (the grammar forced a JSON
        array of calls)."""
        self.reasoning_name, self.template_kwargs = reasoning_parser, template_kwargs
        self.stream_reasoning = stream_reasoning
        self.tools, self.tool_mode, self.tool_call_parser = tools, tool_mode, tool_call_parser
        self.parallel = parallel_tool_calls
        self._reasoning = self._new_reasoning()
        self._tools = self._new_tools()
        self._calls: dict[int, ToolCallOut] = {}

    def _new_reasoning(self) -> ReasoningParser | None:
        if self.reasoning_name is None:
            return None
        return make_reasoning_parser(self.reasoning_name, self.template_kwargs, self.stream_reasoning)

    def _new_tools(self):
        if self.tool_mode == "parser":
            return FunctionCallParser(self.tools or [], self.tool_call_parser)
        if self.tool_mode == "json_array":
            return JsonArrayToolCalls()
        return None

    # -- whole output ----------------------------------------------------------------------------
    def parse_full(self, text: str) -> ParsedOutput:
        reasoning, content = None, text
        if self.reasoning_name is not None:
            reasoning, content = self._new_reasoning().parse_non_stream(text)
            content = content or ""
        calls: list[ToolCallOut] = []
        if self.tool_mode == "parser":
            parser = self._new_tools()
            if parser.has_tool_call(content):
                content, items = parser.parse_non_stream(content)
                calls = [ToolCallOut(i, it.name, it.parameters) for i, it in enumerate(items)]
        elif self.tool_mode == "json_array":
            calls = JsonArrayToolCalls().feed(content)
            content = ""
        if not self.parallel:
            calls = calls[:1]
        return ParsedOutput(reasoning or None, content or None, calls)

    # -- streaming -------------------------------------------------------------------------------
    def feed(self, delta: str) -> list[Event]:
        if self._reasoning is None:
            return self._content(delta)
        return self._split(*self._reasoning.parse_stream_chunk(delta))

    def _split(self, reasoning: str | None, content: str | None) -> list[Event]:
        events = [Event("reasoning", reasoning)] if reasoning else []
        return events + self._content(content or "")

    def _content(self, content: str) -> list[Event]:
        if not content:
            return []
        events: list[Event] = []
        if self.tool_mode == "parser":
            normal, items = self._tools.parse_stream_chunk(content)
            if normal:
                events.append(Event("content", normal))
            for it in items:
                events.extend(self._tool_item(it.tool_index, it.name, it.parameters))
        elif self.tool_mode == "json_array":
            for call in self._tools.feed(content):
                events.extend(self._tool_item(call.index, call.name, call.arguments))
        else:
            events.append(Event("content", content))
        return events

    def _tool_item(self, index: int, name: str | None, params: str) -> list[Event]:
        if index > 0 and not self.parallel:
            return []
        out = []
        if name:
            call = self._calls[index] = ToolCallOut(index, name)
            out.append(Event("tool_start", call=call))
        call = self._calls.get(index)
        if params and call is not None:
            call.arguments += params
            out.append(Event("tool_args", params, call))
        return out

    def finish(self) -> list[Event]:
        """At the end of the output: what the parsers still hold back (a partial marker is text)."""
        events = self._split(*self._reasoning.parse_stream_end()) if self._reasoning is not None else []
        if self.tool_mode == "parser":
            normal, items = self._tools.parse_stream_end()
            if normal:
                events.append(Event("content", normal))
            for it in items:
                events.extend(self._tool_item(it.tool_index, it.name, it.parameters))
        return events

    @property
    def tool_calls(self) -> list[ToolCallOut]:
        return [self._calls[i] for i in sorted(self._calls)]
