"""GLM-4.7 / GLM-5 tool calls: GLM-4.5's tags without the newlines,

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value></tool_call>

and a call without arguments is `<tool_call>name</tool_call>`. `Glm4MoeDetector` already ends
the name at the first tag and skips whitespace between tags, so it parses both spellings; this
class exists for upstream's `glm47` name.

Source: upstream SGLang `glm47_moe_detector.py` docstring; GLM-5 chat_template.jinja.
"""

from sglang.srt.function_call.glm4_moe_detector import Glm4MoeDetector


class Glm47MoeDetector(Glm4MoeDetector):
    pass
