"""GLM-4.5 / GLM-4.6 tool calls (one block per call, key/value tags):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>北京</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The template writes strings raw and every other type as JSON, so a value is kept as the raw
string when the tool's schema says `string`, else parsed as JSON (raw string if that fails,
e.g. an undeclared key holding text). Text between blocks is normal text. Arguments stream
after each complete key/value pair.

Source: GLM-4.5 chat_template.jinja (`<arg_key>`/`<arg_value>` rendering, `tojson` for
non-strings) and upstream SGLang `glm4_moe_detector.py` / `glm47_moe_detector.py`.
"""

from __future__ import annotations

import json

from sglang.srt.function_call.base_format_detector import WAIT, BaseFormatDetector
from sglang.srt.function_call.core_types import ToolCallItem

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
KEY_BEGIN, KEY_END = "<arg_key>", "</arg_key>"
VALUE_BEGIN, VALUE_END = "<arg_value>", "</arg_value>"


class Glm4MoeDetector(BaseFormatDetector):
    bot_token = CALL_BEGIN
    initial_state = "name"

    def _parse_section(self, out: list[ToolCallItem]) -> None:
        while True:
            state = self._state
            if state == "name":
                # The name ends at the newline (GLM-4.5) or at the first tag (GLM-4.7 / GLM-5).
                idx = self._buffer.find("<")
                if idx == -1:
                    return
                self._start_call(self._buffer[:idx].strip(), out)
                self._buffer = self._buffer[idx:]
                self._state = "body"
            elif state == "body":
                tag = self._match([KEY_BEGIN, CALL_END])
                if tag is WAIT:
                    return
                if tag == KEY_BEGIN:
                    self._state = "key"
                elif tag == CALL_END:
                    self._close_pairs(out)
                    self._in_section = False  # one block per call
                    return
                else:
                    self._buffer = self._buffer[1:]  # stray character: skip it
            elif state == "key":
                key = self._take_until(KEY_END)
                if key is None:
                    return
                self._key = key.strip()
                self._state = "after_key"
            elif state == "after_key":
                tag = self._match([VALUE_BEGIN])
                if tag is WAIT:
                    return
                if tag != VALUE_BEGIN:  # key without value: drop the key
                    self._state = "body"
                    continue
                self._state = "value"
            elif state == "value":
                value = self._take_until(VALUE_END)
                if value is None:
                    return
                self._emit_pair(self._key, self._convert(self._key, value), out)
                self._state = "body"

    def _convert(self, key: str, value: str):
        declared = self._schema_type(key)
        is_string = declared == "string" or (
            isinstance(declared, list) and declared and set(declared) <= {"string", "null"}
        )
        if is_string:
            return value
        try:
            return json.loads(value.strip(), strict=False)
        except ValueError:
            return value
