"""FunctionCallParser: exact results on documented formats, stream == non-stream at every split."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.function_call.core_types import ToolCallItem
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.function_call.utils import JsonCanonicalStream, get_json_schema_constraint


def _tool(name, properties):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": properties},
        },
    }


TOOLS = [
    _tool("get_current_weather", {"location": {"type": "string"}, "unit": {"type": "string"}}),
    _tool("get_weather", {"city": {"type": "string"}, "date": {"type": "string"}, "days": {"type": "integer"}}),
    _tool(
        "search",
        {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "exact": {"type": "boolean"},
            "filters": {"type": "object"},
            "tags": {"type": "array"},
            "code": {"type": "string"},
        },
    ),
]

TC_BEGIN, TC_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
C_BEGIN, C_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _dsml_invoke(name, params):
    body = "\n".join(
        f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in params
    )
    return f'<｜DSML｜invoke name="{name}">\n{body}\n</｜DSML｜invoke>'


def _dsml(*invokes):
    return "<｜DSML｜function_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜function_calls>"


# (parser, model output, expected normal text, expected [(name, arguments dict)])
CASES = [
    # Upstream deepseekv31 docstring example: two parallel calls.
    (
        "deepseekv31",
        f'{TC_BEGIN}{C_BEGIN}get_current_weather{SEP}{{"location": "Tokyo"}}{C_END}'
        f'{C_BEGIN}get_current_weather{SEP}{{"location": "Paris"}}{C_END}{TC_END}',
        "",
        [("get_current_weather", {"location": "Tokyo"}), ("get_current_weather", {"location": "Paris"})],
    ),
    # Text before the calls, compact model JSON, unicode, escapes, nested objects, numbers.
    (
        "deepseekv31",
        f'I will search.\n\n{TC_BEGIN}{C_BEGIN}search{SEP}{{"query":"東京 \\"天気\\" \\ud83d\\ude00",'
        f'"limit":10,"exact":false,"filters":{{"year":[2024,2025],"score":1.50,"x":null}},'
        f'"code":"a\\nb\\\\c"}}{C_END}{TC_END}',
        "I will search.",
        [("search", {"query": '東京 "天気" 😀', "limit": 10, "exact": False,
                     "filters": {"year": [2024, 2025], "score": 1.5, "x": None}, "code": "a\nb\\c"})],
    ),
    # DeepSeek-V3 (0324) fenced format.
    (
        "deepseekv3",
        f"{TC_BEGIN}{C_BEGIN}function{SEP}get_current_weather\n```json\n"
        f'{{"location": "Tokyo", "unit": "celsius"}}\n```{C_END}\n'
        f"{C_BEGIN}function{SEP}search\n```json\n{{\"code\": \"```py\\nx=1\\n```\"}}\n```{C_END}{TC_END}",
        "",
        [("get_current_weather", {"location": "Tokyo", "unit": "celsius"}),
         ("search", {"code": "```py\nx=1\n```"})],
    ),
    # DeepSeek-V3.2 DSML as encoding_dsv32 renders it (text, then "\n\n" + block), typed params.
    (
        "deepseekv32",
        "Let me check both.\n\n"
        + _dsml(
            _dsml_invoke("get_weather", [("city", "true", "杭州"), ("date", "true", "2024-01-16")]),
            _dsml_invoke(
                "search",
                [("query", "true", 'say "hi" & <b>'), ("limit", "false", "5"), ("exact", "false", "true"),
                 ("filters", "false", '{"lang": "zh", "n": [1, 2]}'), ("tags", "false", '["a", "b"]'),
                 ("code", "true", "line1\nline2")],
            ),
        ),
        "Let me check both.",
        [("get_weather", {"city": "杭州", "date": "2024-01-16"}),
         ("search", {"query": 'say "hi" & <b>', "limit": 5, "exact": True,
                     "filters": {"lang": "zh", "n": [1, 2]}, "tags": ["a", "b"], "code": "line1\nline2"})],
    ),
    # DSML invoke with a JSON body (upstream accepts it) and one without parameters.
    (
        "deepseekv32",
        _dsml('<｜DSML｜invoke name="search">\n{"query": "x", "limit": 2}\n</｜DSML｜invoke>',
              '<｜DSML｜invoke name="get_weather">\n</｜DSML｜invoke>'),
        "",
        [("search", {"query": "x", "limit": 2}), ("get_weather", {})],
    ),
    # Upstream's simplified spelling without ｜DSML｜ (examples in its deepseekv32 docstring), mixed.
    (
        "deepseekv32",
        'Ok.\n\n<function_calls>\n    <invoke name="get_weather">\n    { "city": "San Francisco" }\n    </invoke>\n'
        '<｜DSML｜invoke name="search">\n<parameter name="limit" string="false">3</｜DSML｜parameter>\n'
        '<parameter name="query" string="true">q</parameter>\n</invoke>\n</function_calls>',
        "Ok.",
        [("get_weather", {"city": "San Francisco"}), ("search", {"limit": 3, "query": "q"})],
    ),
    # GLM-4.5 / 4.6: newline after the name and between tags; schema decides string vs JSON.
    (
        "glm45",
        "I'll look it up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n"
        "<arg_key>date</arg_key>\n<arg_value>2024</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>3</arg_value>\n</tool_call>\n<tool_call>search\n<arg_key>filters</arg_key>\n"
        '<arg_value>{"a": {"b": [1, true]}}</arg_value>\n<arg_key>exact</arg_key>\n<arg_value>false</arg_value>\n'
        "<arg_key>undeclared</arg_key>\n<arg_value>plain words</arg_value>\n</tool_call>",
        "I'll look it up.",
        [("get_weather", {"city": "北京", "date": "2024", "days": 3}),
         ("search", {"filters": {"a": {"b": [1, True]}}, "exact": False, "undeclared": "plain words"})],
    ),
    # GLM-4.7 / GLM-5 spelling (upstream glm47 docstring): no newlines; no-argument call.
    (
        "glm47",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value><arg_key>date</arg_key>"
        "<arg_value>2024-06-27</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>上海</arg_value><arg_key>date</arg_key><arg_value>2024-06-27</arg_value></tool_call>"
        "<tool_call>get_current_weather</tool_call>",
        "",
        [("get_weather", {"city": "北京", "date": "2024-06-27"}),
         ("get_weather", {"city": "上海", "date": "2024-06-27"}),
         ("get_current_weather", {})],
    ),
    # Unknown tools are dropped (upstream default); indices count accepted calls only.
    (
        "glm",
        "a<tool_call>rm_rf<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>b"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
        "ab",
        [("get_weather", {"city": "Paris"})],
    ),
    # No tool call at all.
    ("deepseekv32", "  Just an answer with <b>html</b> and ｜DSML｜ text.  ", "Just an answer with <b>html</b> and ｜DSML｜ text.", []),
]


def run_stream(parser_name, chunks):
    parser = FunctionCallParser(TOOLS, parser_name)
    normal, items = [], []
    for chunk in chunks:
        n, calls = parser.parse_stream_chunk(chunk)
        normal.append(n)
        items.extend(calls)
    n, calls = parser.parse_stream_end()
    normal.append(n)
    items.extend(calls)
    return "".join(normal), items


def collect(items):
    """Stream items -> [ToolCallItem] per index, checking the name-first protocol."""
    calls = {}
    for item in items:
        if item.tool_index not in calls:
            assert item.name is not None and item.parameters == "", item
            calls[item.tool_index] = ToolCallItem(item.tool_index, item.name, "")
        else:
            assert item.name is None, item
            calls[item.tool_index].parameters += item.parameters
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name,text,normal,expected", CASES)
def test_non_stream_exact(name, text, normal, expected):
    got_normal, calls = FunctionCallParser(TOOLS, name).parse_non_stream(text)
    assert got_normal == normal
    assert [(c.tool_index, c.name) for c in calls] == [(i, n) for i, (n, _) in enumerate(expected)]
    for call, (_, args) in zip(calls, expected):
        assert call.parameters == json.dumps(args, ensure_ascii=False)


@pytest.mark.parametrize("name,text,normal,expected", CASES)
def test_every_split_point(name, text, normal, expected):
    want = FunctionCallParser(TOOLS, name).parse_non_stream(text)
    for i in range(len(text) + 1):
        got_normal, items = run_stream(name, [text[:i], text[i:]])
        assert (got_normal, collect(items)) == want, i
    got_normal, items = run_stream(name, list(text))
    assert (got_normal, collect(items)) == want


@settings(max_examples=60, deadline=None)
@given(data=st.data(), case=st.sampled_from(CASES))
def test_random_multi_splits(data, case):
    name, text = case[0], case[1]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got_normal, items = run_stream(name, chunks)
    assert (got_normal, collect(items)) == FunctionCallParser(TOOLS, name).parse_non_stream(text)


def test_json_arguments_stream_before_the_call_ends():
    parser = FunctionCallParser(TOOLS, "deepseekv31")
    _, calls = parser.parse_stream_chunk(f'{TC_BEGIN}{C_BEGIN}search{SEP}{{"query": "long te')
    assert [(c.name, c.parameters) for c in calls] == [("search", ""), (None, '{"query": "long te')]
    _, calls = parser.parse_stream_chunk('xt", "limit": 1')
    assert [c.parameters for c in calls] == ['xt", "limit": ']  # 1 may still become 10
    _, calls = parser.parse_stream_chunk("0}" + C_END)
    assert [c.parameters for c in calls] == ["10}"]


def test_dsml_streams_after_each_parameter():
    parser = FunctionCallParser(TOOLS, "deepseekv32")
    text = _dsml(_dsml_invoke("get_weather", [("city", "true", "Paris"), ("days", "false", "2")]))
    cut = text.index("<｜DSML｜parameter name=\"days\"")
    _, calls = parser.parse_stream_chunk(text[:cut])
    assert [c.parameters for c in calls] == ["", '{"city": "Paris"']
    _, calls = parser.parse_stream_chunk(text[cut:])
    assert [c.parameters for c in calls] == [', "days": 2', "}"]


def test_truncated_call_is_dropped_from_non_stream():
    text = f'ok {TC_BEGIN}{C_BEGIN}search{SEP}{{"query": "x'
    assert FunctionCallParser(TOOLS, "deepseekv31").parse_non_stream(text) == ("ok", [])


def test_partial_marker_at_end_is_normal_text():
    text = "answer <tool_ca"
    assert FunctionCallParser(TOOLS, "glm45").parse_non_stream(text) == ("answer <tool_ca", [])
    assert run_stream("glm45", list(text))[0] == "answer <tool_ca"


def test_has_tool_call_and_no_tools_passthrough():
    parser = FunctionCallParser(TOOLS, "deepseekv32")
    assert parser.has_tool_call("x <｜DSML｜function_calls>")
    assert parser.has_tool_call("x <function_calls>")  # plain spelling, accepted as upstream
    assert not parser.has_tool_call("x <function_call>")
    bare = FunctionCallParser([], "glm47")
    assert not bare.has_tool_call("<tool_call>x</tool_call>")
    assert bare.parse_non_stream(" <tool_call>x</tool_call> ") == (" <tool_call>x</tool_call> ", [])
    assert bare.parse_stream_chunk(" a ") == (" a ", [])


def test_parser_names_and_unknown_name():
    assert {"deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45", "glm47"} <= set(
        FunctionCallParser.ToolCallParserEnum
    )
    with pytest.raises(ValueError, match="valid names: .*deepseekv32.*glm47"):
        FunctionCallParser(TOOLS, "hermes-nope")


def test_json_canonical_stream_waits_on_unfinished_escapes():
    s = JsonCanonicalStream()
    assert s.feed('{"k": "a\\u00') == '{"k": "a'
    assert s.feed("e9\\ud83d") == "é"  # high surrogate held until its pair arrives
    assert s.feed('\\ude00"}') == '😀"}'
    assert s.done and not s.error


def test_json_schema_constraint_required_and_named():
    tools = [_tool("a", {"x": {"type": "integer"}}), {"type": "function", "function": {"name": "b"}}]
    a_params = tools[0]["function"]["parameters"]
    item_a = {"properties": {"name": {"type": "string", "enum": ["a"]}, "parameters": a_params},
              "required": ["name", "parameters"]}
    item_b = {"properties": {"name": {"type": "string", "enum": ["b"]},
                             "parameters": {"type": "object", "properties": {}}},
              "required": ["name", "parameters"]}
    assert get_json_schema_constraint(tools, "required") == {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [item_a, item_b]}}
    named = {"type": "function", "function": {"name": "a"}}
    assert get_json_schema_constraint(tools, named) == {"type": "array", "minItems": 1, "items": item_a}
    assert get_json_schema_constraint(tools, named, parallel_tool_calls=False)["maxItems"] == 1
    assert get_json_schema_constraint(tools, {"type": "function", "function": {"name": "zz"}}) is None
    assert get_json_schema_constraint(tools, "auto") is None
    assert get_json_schema_constraint(tools, "none") is None
    defs = {"$defs": {"P": {"type": "string"}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}
    lifted = get_json_schema_constraint([{"type": "function", "function": {"name": "c", "parameters": defs}}], "required")
    assert lifted["$defs"] == {"P": {"type": "string"}}


_DSML_PARTS = ["<｜DSML｜function_calls>", "</｜DSML｜function_calls>", '<｜DSML｜invoke name="get_weather">',
               '<｜DSML｜invoke name="nope">', "</｜DSML｜invoke>", '<｜DSML｜parameter name="city" string="true">',
               '<｜DSML｜parameter name="days" string="false">', "</｜DSML｜parameter>", "<｜DSML｜", "{", '"',
               "<function_calls>", '<invoke name="search">', "</invoke>", '<parameter name="limit" string="false">',
               "</parameter>", "</function_calls>"]
_FRAGMENTS = {
    "deepseekv31": [TC_BEGIN, TC_END, C_BEGIN, C_END, SEP, "get_weather", "nope", '{"city": "x"}', '{"a":',
                    "1", "}", "]", "[", '"', "\\", "\\u00e9", ",", " ", "\n", "txt", "<｜tool", "▁call"],
    "deepseekv3": [TC_BEGIN, TC_END, C_BEGIN, C_END, SEP, "function", "get_weather", "\n```json\n", "```",
                   '{"city": "x"}', "1", "}", '"', " ", "\n", "txt"],
    "deepseekv32": _DSML_PARTS + ["杭州", "3", "[1, 2]", " ", "\n", "txt", "<"],
    "glm45": ["<tool_call>", "</tool_call>", "get_weather", "search", "nope", "<arg_key>", "</arg_key>",
              "<arg_value>", "</arg_value>", "city", "days", "3", '{"a": 1}', "北京", " ", "\n", "<", "txt"],
}
_FRAGMENTS["glm47"] = _FRAGMENTS["glm45"]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(_FRAGMENTS)))
def test_random_markup_is_chunking_invariant(data, name):
    """Arbitrary (mostly malformed) markup: streaming never disagrees with non-stream on the
    normal text or on any call the non-stream result keeps."""
    text = "".join(data.draw(st.lists(st.sampled_from(_FRAGMENTS[name]), max_size=30)))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    got_normal, items = run_stream(name, chunks)
    want_normal, want_calls = FunctionCallParser(TOOLS, name).parse_non_stream(text)
    assert got_normal == want_normal
    streamed = {c.tool_index: c for c in collect(items)}
    for call in want_calls:
        assert streamed[call.tool_index] == call
