"""Chat output parsing: streamed events always add up to the non-streamed parse, at every split."""

import json

import pytest

from sglang.srt.entrypoints.openai.chat_output import JsonArrayToolCalls, OutputParser
from sglang.srt.entrypoints.openai.serving_responses import input_to_messages
from sglang.srt.managers.tokenizer_manager import RequestError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

ARRAY = '[{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" ]", "days": 3}}, ' \
        '{"name": "add", "parameters": {"a": [1, {"b": "}"}]}}]'


def _stream(parser: OutputParser, text: str, cuts: list[int]) -> dict:
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    reasoning, content, calls = "", "", {}
    events = [ev for p in pieces for ev in parser.feed(p)] + parser.finish()
    for ev in events:
        if ev.kind == "reasoning":
            reasoning += ev.text
        elif ev.kind == "content":
            content += ev.text
        elif ev.kind == "tool_start":
            calls[ev.call.index] = [ev.call.name, ""]
        else:
            calls[ev.call.index][1] += ev.text
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


def _full(parser: OutputParser, text: str) -> dict:
    p = parser.parse_full(text)
    return {"reasoning": p.reasoning, "content": p.content, "calls": [(c.name, c.arguments) for c in p.tool_calls]}


def test_json_array_calls_complete_elements_only():
    j = JsonArrayToolCalls()
    assert j.feed(ARRAY[:40]) == []
    calls = j.feed(ARRAY[40:])
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (0, "get_weather", {"city": 'Paris, "FR" ]', "days": 3}), (1, "add", {"a": [1, {"b": "}"}]})]


@pytest.mark.parametrize("parallel", [True, False])
def test_json_array_stream_equals_full_at_every_split(parallel):
    make = lambda: OutputParser(None, None, True, TOOLS, "json_array", None, parallel)  # noqa: E731
    full = _full(make(), ARRAY)
    assert len(full["calls"]) == (2 if parallel else 1)
    for cut in range(len(ARRAY) + 1):
        assert _stream(make(), ARRAY, [cut]) == full, cut


def test_plain_content_passes_through():
    p = OutputParser(None, None, True, None, "none", None)
    assert _stream(p, "hello <think>x</think>", [3, 9]) == {"reasoning": None, "content": "hello <think>x</think>",
                                                          "calls": []}


def test_responses_input_items_to_messages():
    msgs = input_to_messages([
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
    ])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "user"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert msgs[3]["content"] == "thanks"
    with pytest.raises(RequestError):
        input_to_messages([{"type": "web_search_call"}])


DSML = ('Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '</｜DSML｜function_calls>')
GLM = "Sure.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" \
      "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"


@pytest.mark.parametrize("reasoning,kwargs,tool_parser,text", [
    ("deepseek-v3", {"thinking": True}, "deepseekv32", "<think>Need weather.</think>" + DSML),
    ("deepseek-v3", {"thinking": True}, "deepseekv32", "Need weather, no tags: forced.</think>" + DSML),
    ("glm45", {}, "glm47", "<think>Hmm.</think>" + GLM),
    (None, None, "glm47", GLM),
])
@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_reasoning_then_tool_calls_stream_equals_full(reasoning, kwargs, tool_parser, text, stream_reasoning):
    make = lambda: OutputParser(reasoning, kwargs, stream_reasoning, TOOLS, "parser", tool_parser)  # noqa: E731
    full = _full(make(), text)
    assert [(n, json.loads(a)) for n, a in full["calls"]] == [("get_weather", {"city": "Paris", "days": 3})]
    assert full["content"] in ("Let me check.", "Sure.")
    assert (full["reasoning"] is None) == (reasoning is None)
    for cut in range(0, len(text) + 1, 3):
        assert _stream(make(), text, [cut]) == full, cut
    assert _stream(make(), text, list(range(1, len(text)))) == full  # one character at a time


def test_reasoning_held_back_until_done_when_not_streamed():
    p = OutputParser("deepseek-v3", {"thinking": True}, False, None, "none", None)
    assert p.feed("<think>abc") == []
    evs = p.feed(" def</think>x")
    assert [(e.kind, e.text) for e in evs] == [("reasoning", "abc def"), ("content", "x")]
