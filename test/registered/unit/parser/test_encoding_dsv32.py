"""DeepSeek-V3.2 prompt encoding against the official README example and the documented templates."""

import json

import pytest

from sglang.srt.entrypoints.openai.encoding_dsv32 import (
    DS32EncodingError,
    encode_messages,
    render_tool_calls,
)
from sglang.srt.function_call.function_call_parser import FunctionCallParser

README_MESSAGES = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
    {"role": "user", "content": "1+1=?"},
]


def test_readme_example_thinking():
    # Verbatim from the DeepSeek-V3.2 model card (HF README), thinking_mode="thinking".
    assert encode_messages(README_MESSAGES, thinking_mode="thinking") == (
        "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek."
        "<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>"
    )
    # The README notes drop_thinking=False renders the same for this conversation.
    assert encode_messages(README_MESSAGES, "thinking", drop_thinking=False) == encode_messages(
        README_MESSAGES, "thinking"
    )


def test_chat_mode_closes_the_think_block():
    assert encode_messages(README_MESSAGES) == (
        "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek."
        "<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜></think>"
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

TOOLS_PROMPT = (
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    'You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:\n'
    "<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="$FUNCTION_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$FUNCTION_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects "
    'should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" '
    "for other types (numbers, booleans, arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking "
    "block. Here is an example:\n"
    "<｜DSML｜function_calls>\n"
    "...\n"
    "</｜DSML｜function_calls>\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n"
    "<think>...thinking about results</think>\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    '{"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}\n'
    "</functions>\n"
)

TOOL_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What's the weather in Hangzhou?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the weather tool.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "杭州", "days": 2}'}}
        ],
    },
    {"role": "tool", "content": "Sunny, 25°C"},
]

DSML_BLOCK = (
    "<｜DSML｜function_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>"
)


def test_tool_conversation_thinking():
    expected = (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.\n\n" + TOOLS_PROMPT
        + "<｜User｜>What's the weather in Hangzhou?<｜Assistant｜><think>"
        + "Need the weather tool.</think>\n\n" + DSML_BLOCK + "<｜end▁of▁sentence｜>"
        + "\n\n<function_results>\n<result>Sunny, 25°C</result>\n</function_results>\n\n<think>"
    )
    assert encode_messages(TOOL_CONVERSATION, "thinking", tools=TOOLS) == expected


def test_tool_conversation_chat_and_inserted_system():
    msgs = TOOL_CONVERSATION[1:]
    expected = (
        "<｜begin▁of▁sentence｜>\n\n" + TOOLS_PROMPT
        + "<｜User｜>What's the weather in Hangzhou?<｜Assistant｜></think>"
        + "\n\n" + DSML_BLOCK + "<｜end▁of▁sentence｜>"
        + "\n\n<function_results>\n<result>Sunny, 25°C</result>\n</function_results>\n\n</think>"
    )
    assert encode_messages(msgs, "chat", tools=TOOLS) == expected


def test_parallel_tool_results_are_one_block():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {"x": [1]}}}]},
        {"role": "tool", "content": "r1"},
        {"role": "tool", "content": "r2"},
    ]
    assert encode_messages(msgs, add_default_bos_token=False).endswith(
        '<｜DSML｜invoke name="a">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name="b">\n'
        '<｜DSML｜parameter name="x" string="false">[1]</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls><｜end▁of▁sentence｜>"
        "\n\n<function_results>\n<result>r1</result>\n<result>r2</result>\n</function_results>\n\n</think>"
    )


def test_context_is_not_emitted():
    prompt = encode_messages(README_MESSAGES[2:], "thinking", context=README_MESSAGES[:2])
    assert prompt == "<｜User｜>1+1=?<｜Assistant｜><think>"


def test_rendered_calls_parse_back_with_deepseekv32():
    args = {"city": "杭州", "days": 3, "opts": {"a": [1, 2.5], "b": None}, "flag": False}
    text = "Checking.\n\n" + render_tool_calls([{"function": {"name": "get_weather", "arguments": args}}])
    normal, calls = FunctionCallParser(TOOLS, "deepseekv32").parse_non_stream(text)
    assert normal == "Checking."
    assert [(c.name, c.parameters) for c in calls] == [("get_weather", json.dumps(args, ensure_ascii=False))]


@pytest.mark.parametrize(
    "messages,mode",
    [
        (README_MESSAGES, "reasoning"),
        ([{"role": "tool", "content": "x"}], "chat"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "thinking"),
        ([{"role": "wizard", "content": "x"}], "chat"),
    ],
)
def test_invalid_conversations_raise_value_error(messages, mode):
    with pytest.raises(DS32EncodingError):
        encode_messages(messages, mode)
    assert issubclass(DS32EncodingError, ValueError)
