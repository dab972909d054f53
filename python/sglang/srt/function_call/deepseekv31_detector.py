"""DeepSeek-V3.1 / V3.2-Exp tool calls (JSON arguments, special-token delimiters).

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Tokyo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Source: DeepSeek-V3.1 model card (tool-call template) and upstream SGLang's
`deepseekv31_detector.py` docstring.
"""

from __future__ import annotations

from sglang.srt.function_call.base_format_detector import WAIT, BaseFormatDetector
from sglang.srt.function_call.core_types import ToolCallItem

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV31Detector(BaseFormatDetector):
    bot_token = CALLS_BEGIN
    initial_state = "between"

    def _parse_section(self, out: list[ToolCallItem]) -> None:
        while True:
            if self._state == "between":
                tag = self._match([CALL_BEGIN, CALLS_END])
                if tag is WAIT:
                    return
                if tag != CALL_BEGIN:  # section end, or stray text: back to normal text
                    self._in_section = False
                    return
                self._state = "name"
            elif self._state == "name":
                if not self._read_name(out):
                    return
                self._state = "args"
            elif self._state == "args":
                if not self._stream_json_args(self._args_end, out):
                    return
                self._state = "between"

    _args_end = CALL_END

    def _read_name(self, out: list[ToolCallItem]) -> bool:
        name = self._take_until(SEP)
        if name is None:
            return False
        self._start_call(name.strip(), out)
        return True
