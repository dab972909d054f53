"""Base class of the tool-call detectors: one state machine serves streaming and non-stream.

Text outside a tool-call section is normal text (`.strip()`-ed as a whole, streamed through
`StripStream`). At `bot_token` the subclass's `_parse_section` takes over until it leaves the
section. `detect_and_parse` feeds the whole text into a fresh detector and flushes it, so the
streamed normal text and the concatenated argument pieces of each call equal the non-stream
result for ANY chunking, provided subclasses decide only on text they have fully seen (the
buffer helpers below wait on a possible marker prefix instead of guessing).

Unknown tool names are dropped with a warning (upstream's default). Calls cut off by the end of
the text are dropped from the non-stream result (streaming has already shown their start).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from typing import Any

from sglang.srt.function_call.core_types import StreamingParseResult, ToolCallItem
from sglang.srt.function_call.utils import JsonCanonicalStream, dumps_args, tools_by_name
from sglang.srt.parser.stream_utils import StripStream, partial_suffix_len

logger = logging.getLogger(__name__)

WAIT = None  # _match: the buffer may still become one of the options


def _find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """Earliest occurrence of any marker (longest wins a tie): (index, marker) or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        idx = text.find(marker)
        if idx != -1 and (best == -1 or idx < best or (idx == best and len(marker) > len(found))):
            best, found = idx, marker
    return best, found


class _Call:
    def __init__(self, index: int | None, name: str) -> None:
        self.index = index  # None: unknown tool, parsed but not emitted
        self.name = name
        self.args = ""


class BaseFormatDetector(ABC):
    bot_token: str = ""  # opens a tool-call section
    alt_bot_tokens: tuple[str, ...] = ()  # other spellings that open one too
    initial_state: str = ""  # subclass state on entering a section

    @property
    def bot_tokens(self) -> tuple[str, ...]:
        return (self.bot_token,) + self.alt_bot_tokens

    def __init__(self) -> None:
        self._buffer = ""
        self._in_section = False
        self._state = ""
        self._normal = StripStream()
        self._tools: dict[str, dict] = {}
        self._call: _Call | None = None
        self._next_index = 0
        self._completed: set[int] = set()
        self._json: JsonCanonicalStream | None = None
        # Upstream-compatible bookkeeping read by serving code at stream end.
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.streamed_args_for_tool: list[str] = []

    # -- public API ---------------------------------------------------------------------
    def has_tool_call(self, text: str) -> bool:
        return any(token in text for token in self.bot_tokens)

    def parse_streaming_increment(self, new_text: str, tools: list[Any]) -> StreamingParseResult:
        self._tools = tools_by_name(tools)
        self._buffer += new_text
        return self._run(final=False)

    def finish(self, tools: list[Any]) -> StreamingParseResult:
        """End of stream: held-back partial markers are normal text; an open call is dropped."""
        self._tools = tools_by_name(tools)
        return self._run(final=True)

    def detect_and_parse(self, text: str, tools: list[Any]) -> StreamingParseResult:
        fresh = type(self)()
        first = fresh.parse_streaming_increment(text, tools)
        last = fresh.finish(tools)
        merged: dict[int, ToolCallItem] = {}
        for item in first.calls + last.calls:
            if item.tool_index not in fresh._completed:
                continue
            call = merged.setdefault(item.tool_index, ToolCallItem(item.tool_index, item.name, ""))
            call.parameters += item.parameters
        return StreamingParseResult(
            normal_text=first.normal_text + last.normal_text,
            calls=[merged[i] for i in sorted(merged)],
        )

    # -- driver -------------------------------------------------------------------------
    def _run(self, final: bool) -> StreamingParseResult:
        normal: list[str] = []
        calls: list[ToolCallItem] = []
        while True:
            if not self._in_section:
                idx, token = _find_first(self._buffer, self.bot_tokens)
                if idx == -1:
                    keep = 0 if final else partial_suffix_len(self._buffer, self.bot_tokens)
                    cut = len(self._buffer) - keep
                    normal.append(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    break
                normal.append(self._buffer[:idx])
                self._buffer = self._buffer[idx + len(token):]
                self._in_section = True
                self._state = self.initial_state
            self._parse_section(calls)
            if self._in_section:
                if final:  # truncated inside a call: nothing more will come
                    if self._call is not None:
                        logger.warning("Dropping unterminated tool call %r", self._call.name)
                    self._call = None
                    self._json = None
                    self._buffer = ""
                    self._in_section = False
                break
        return StreamingParseResult(normal_text=self._normal.feed("".join(normal)), calls=calls)

    @abstractmethod
    def _parse_section(self, out: list[ToolCallItem]) -> None:
        """Consume the buffer inside a section; return when more input is needed (still in the
        section) or after leaving it (`self._in_section = False`)."""

    # -- helpers for subclasses ---------------------------------------------------------
    def _match(self, options: list[str]) -> str | None:
        """After skipping whitespace: the option the buffer starts with, WAIT if it may still
        become one, "" if it cannot."""
        self._buffer = self._buffer.lstrip()
        buf = self._buffer
        for opt in options:
            if buf.startswith(opt):
                self._buffer = buf[len(opt):]
                return opt
        if any(opt.startswith(buf) for opt in options):
            return WAIT
        return ""

    def _take_until(self, marker: str | tuple[str, ...]) -> str | None:
        """Text before the first `marker` (consumed through it), or None if none has arrived."""
        markers = (marker,) if isinstance(marker, str) else marker
        idx, found = _find_first(self._buffer, markers)
        if idx == -1:
            return None
        text = self._buffer[:idx]
        self._buffer = self._buffer[idx + len(found):]
        return text

    def _take_partial(self, marker: str | tuple[str, ...]) -> tuple[str, bool]:
        """Text up to `marker` as far as known; True once the marker was consumed."""
        text = self._take_until(marker)
        if text is not None:
            return text, True
        markers = (marker,) if isinstance(marker, str) else marker
        cut = len(self._buffer) - partial_suffix_len(self._buffer, markers)
        text, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return text, False

    def _start_call(self, name: str, out: list[ToolCallItem]) -> None:
        if name not in self._tools:
            logger.warning("Model attempted to call undefined function: %s", name)
            self._call = _Call(None, name)
            return
        index = self._next_index
        self._next_index += 1
        self._call = _Call(index, name)
        self.prev_tool_call_arr.append({"name": name, "arguments": {}})
        self.streamed_args_for_tool.append("")
        out.append(ToolCallItem(tool_index=index, name=name, parameters=""))

    def _emit_args(self, piece: str, out: list[ToolCallItem]) -> None:
        call = self._call
        if call is None or not piece:
            return
        call.args += piece
        if call.index is not None:
            self.streamed_args_for_tool[call.index] += piece
            out.append(ToolCallItem(tool_index=call.index, name=None, parameters=piece))

    def _end_call(self, valid: bool = True) -> None:
        call, self._call = self._call, None
        if call is None or call.index is None:
            return
        if not valid:
            logger.warning("Dropping tool call %r with malformed arguments", call.name)
            return
        self._completed.add(call.index)
        try:
            self.prev_tool_call_arr[call.index]["arguments"] = json.loads(call.args)
        except ValueError:
            pass

    def _schema_type(self, key: str) -> Any:
        """JSON-schema `type` of argument `key` of the current call (None if undeclared)."""
        params = self._tools.get(self._call.name if self._call else "", {})
        prop = (params.get("properties") or {}).get(key)
        return prop.get("type") if isinstance(prop, dict) else None

    def _emit_pair(self, key: str, value: Any, out: list[ToolCallItem]) -> None:
        """Key/value formats stream `{"k": v`, `, "k": v`, then `}` (see _close_pairs): the
        concatenation is `dumps_args(dict)` with keys in arrival order."""
        prefix = ", " if self._call and self._call.args else "{"
        self._emit_args(prefix + dumps_args(key) + ": " + dumps_args(value), out)

    def _close_pairs(self, out: list[ToolCallItem]) -> None:
        self._emit_args("}" if self._call and self._call.args else "{}", out)
        self._end_call()

    def _stream_json_args(self, end_marker: str | tuple[str, ...], out: list[ToolCallItem]) -> bool:
        """JSON formats: stream the arguments up to `end_marker`, re-serialised canonically as
        they grow; True once the call has ended."""
        if self._json is None:
            self._json = JsonCanonicalStream()
        text, done = self._take_partial(end_marker)
        self._emit_args(self._json.feed(text), out)
        if not done:
            return False
        stream, self._json = self._json, None
        self._emit_args(stream.finish(), out)
        if not stream.emitted and not stream.error:
            self._emit_args("{}", out)  # `name<sep><end>`: no arguments
            self._end_call()
        else:
            self._end_call(stream.done and not stream.error and stream.emitted.startswith("{"))
        return True
