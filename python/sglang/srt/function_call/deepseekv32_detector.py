"""DeepSeek-V3.2 tool calls in DSML (what `encoding_dsv32.py` renders and parses):

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="location" string="true">Hangzhou</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

`string="true"`: the value is the raw string; `string="false"`: the value is JSON (numbers,
booleans, arrays, objects; kept as a string if it does not parse). An invoke body that is a
JSON object instead of parameter tags is accepted too, and so are the tags without `｜DSML｜`
(`<function_calls>`, `<invoke name=..>`, `<parameter ..>`, mixed with DSML ones), as upstream
accepts them. Arguments stream after each complete parameter. The V3.1 special-token format is
a different parser (`deepseekv31`), as upstream.

Source: DeepSeek-V3.2 `encoding/encoding_dsv32.py` (templates + `parse_tool_calls`), as adapted
in upstream SGLang `entrypoints/openai/encoding_dsv32.py`; upstream `deepseekv32_detector.py`.
"""

from __future__ import annotations

import json
import re

from sglang.srt.function_call.base_format_detector import WAIT, BaseFormatDetector
from sglang.srt.function_call.core_types import ToolCallItem

DSML = "｜DSML｜"
CALLS_BEGIN = f"<{DSML}function_calls>"
CALLS_END = f"</{DSML}function_calls>"
INVOKE_BEGIN = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAM_BEGIN = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"


def _both(tag: str) -> tuple[str, str]:
    """The DSML spelling and the plain one (`<invoke`, ...) that upstream also accepts, mixed."""
    return tag, tag.replace(DSML, "")

_NAME_ATTR = re.compile(r'^\s*name="([^"]*)"\s*$')
_PARAM_ATTRS = re.compile(r'^\s*name="([^"]*)"\s+string="(true|false)"\s*$')


class DeepSeekV32Detector(BaseFormatDetector):
    bot_token = CALLS_BEGIN
    alt_bot_tokens = (_both(CALLS_BEGIN)[1],)
    initial_state = "between"

    def _parse_section(self, out: list[ToolCallItem]) -> None:
        while True:
            state = self._state
            if state == "between":
                tag = self._match([*_both(INVOKE_BEGIN), *_both(CALLS_END)])
                if tag is WAIT:
                    return
                if tag not in _both(INVOKE_BEGIN):
                    self._in_section = False
                    return
                self._state = "invoke_head"
            elif state == "invoke_head":
                attrs = self._take_until(">")
                if attrs is None:
                    return
                m = _NAME_ATTR.match(attrs)
                self._start_call(m.group(1) if m else attrs.strip(), out)
                self._state = "body"
            elif state == "body":
                opts = [*_both(PARAM_BEGIN), *_both(INVOKE_END)] + ([] if self._call.args else ["{"])
                tag = self._match(opts)
                if tag is WAIT:
                    return
                if tag in _both(PARAM_BEGIN):
                    self._state = "param_head"
                elif tag in _both(INVOKE_END):
                    self._close_pairs(out)
                    self._state = "between"
                elif tag == "{":
                    self._buffer = "{" + self._buffer
                    self._state = "json_body"
                else:  # stray character inside the invoke: skip it
                    self._buffer = self._buffer[1:]
            elif state == "param_head":
                attrs = self._take_until(">")
                if attrs is None:
                    return
                m = _PARAM_ATTRS.match(attrs)
                self._param = (m.group(1), m.group(2) == "true") if m else (attrs.strip(), True)
                self._state = "param_value"
            elif state == "param_value":
                value = self._take_until(_both(PARAM_END))
                if value is None:
                    return
                key, is_string = self._param
                self._emit_pair(key, value if is_string else _json_or_string(value), out)
                self._state = "body"
            elif state == "json_body":
                if not self._stream_json_args(_both(INVOKE_END), out):
                    return
                self._state = "between"


def _json_or_string(value: str):
    try:
        return json.loads(value, strict=False)
    except ValueError:
        return value
