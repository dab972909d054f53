"""DeepSeek-V3 / V3-0324 tool calls (type + name, arguments in a ```json fence).

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"location": "Tokyo"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Source: DeepSeek-V3 tokenizer_config chat template and upstream SGLang's
`deepseekv3_detector.py` docstring.
"""

from __future__ import annotations

from sglang.srt.function_call.core_types import ToolCallItem
from sglang.srt.function_call.deepseekv31_detector import CALL_END, SEP, DeepSeekV31Detector

FENCE_OPEN = "```json"
# The closing fence is only recognised right before the call-end token, so "```" inside a
# string argument (code) cannot end the arguments early.
FENCE_CLOSE = "```" + CALL_END


class DeepSeekV3Detector(DeepSeekV31Detector):
    _args_end = FENCE_CLOSE

    def _read_name(self, out: list[ToolCallItem]) -> bool:
        idx_sep = self._buffer.find(SEP)
        if idx_sep == -1:
            return False
        idx_fence = self._buffer.find(FENCE_OPEN, idx_sep)
        if idx_fence == -1:
            return False
        name = self._buffer[idx_sep + len(SEP):idx_fence]
        self._buffer = self._buffer[idx_fence + len(FENCE_OPEN):]
        self._start_call(name.strip(), out)
        return True
