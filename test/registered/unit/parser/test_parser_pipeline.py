"""Reasoning parser feeding the tool-call parser, as /v1/chat/completions chains them."""

from sglang.srt.entrypoints.openai.encoding_dsv32 import render_tool_calls
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.parser.reasoning_parser import ReasoningParser, reasoning_enabled

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

# DeepSeek-V3.2 thinking + tools: the prompt ended with <think>; output as the encoder renders it.
DSV32_OUTPUT = (
    "The user wants weather.\n</think>Let me check.\n\n"
    + render_tool_calls([{"function": {"name": "get_weather", "arguments": {"city": "杭州", "days": 2}}}])
)
GLM5_OUTPUT = (
    "Need weather.</think>\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
)


def _non_stream(rp_name, tp_name, kwargs, text):
    force = reasoning_enabled(rp_name, kwargs)
    reasoning, normal = ReasoningParser(rp_name, force_reasoning=force).parse_non_stream(text)
    content, calls = FunctionCallParser(TOOLS, tp_name).parse_non_stream(normal or "")
    return reasoning, content, [(c.tool_index, c.name, c.parameters) for c in calls]


def _stream(rp_name, tp_name, kwargs, chunks):
    rp = ReasoningParser(rp_name, force_reasoning=reasoning_enabled(rp_name, kwargs))
    tp = FunctionCallParser(TOOLS, tp_name)
    reasoning, content, calls = "", "", {}

    def to_tools(normal_delta, end=False):
        nonlocal content
        for n, items in [tp.parse_stream_chunk(normal_delta or "")] + ([tp.parse_stream_end()] if end else []):
            content += n
            for it in items:
                name, params = calls.get(it.tool_index, (it.name, ""))
                calls[it.tool_index] = (name, params + it.parameters)

    for chunk in chunks:
        r, n = rp.parse_stream_chunk(chunk)
        reasoning += r or ""
        to_tools(n)
    r, n = rp.parse_stream_end()
    reasoning += r or ""
    to_tools(n, end=True)
    return reasoning or None, content, [(i, *calls[i]) for i in sorted(calls)]


def test_dsv32_thinking_with_tools_every_split():
    kwargs = {"thinking": True}
    want = _non_stream("deepseek-v3", "deepseekv32", kwargs, DSV32_OUTPUT)
    assert want == ("The user wants weather.", "Let me check.", [(0, "get_weather", '{"city": "杭州", "days": 2}')])
    for i in range(len(DSV32_OUTPUT) + 1):
        assert _stream("deepseek-v3", "deepseekv32", kwargs, [DSV32_OUTPUT[:i], DSV32_OUTPUT[i:]]) == want, i


def test_glm5_thinking_with_tools_every_split():
    want = _non_stream("glm45", "glm47", None, GLM5_OUTPUT)
    assert want == ("Need weather.", "", [(0, "get_weather", '{"city": "Paris", "days": 2}')])
    for i in range(len(GLM5_OUTPUT) + 1):
        assert _stream("glm45", "glm47", None, [GLM5_OUTPUT[:i], GLM5_OUTPUT[i:]]) == want, i
    assert _stream("glm45", "glm47", None, list(GLM5_OUTPUT)) == want
