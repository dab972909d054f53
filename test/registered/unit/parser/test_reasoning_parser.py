"""ReasoningParser: exact outputs on documented shapes, and stream == non-stream for any split."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.parser.reasoning_parser import ReasoningParser, reasoning_enabled

# (parser, force_reasoning, model output, expected (reasoning, normal))
CASES = [
    # DeepSeek-R1-0528 echoes <think>; R1 is always forced.
    ("deepseek-r1", None, "<think>\nLet me add.\n</think>\n\nThe answer is 42.",
     ("Let me add.", "The answer is 42.")),
    # DeepSeek-R1 (original) omits the start tag.
    ("deepseek-r1", None, "Let me add.</think>The answer is 42.", ("Let me add.", "The answer is 42.")),
    # DeepSeek-V3.2 thinking mode: the prompt ended with <think>, output starts inside it.
    ("deepseek-v3", True, "The user greets me.</think>Hello! How can I help?",
     ("The user greets me.", "Hello! How can I help?")),
    # DeepSeek-V3.2 chat mode: no reasoning at all.
    ("deepseek-v3", False, "Hello! How can I help?", (None, "Hello! How can I help?")),
    # ... even if the text mentions tags later on.
    ("deepseek-v3", False, "Use <think> tags like </think> this.", (None, "Use <think> tags like </think> this.")),
    # Truncated reasoning (max_tokens): all reasoning.
    ("deepseek-v3", True, "Still thinking about it", ("Still thinking about it", None)),
    # Forced block where the model echoes <think> anyway.
    ("deepseek-v3", True, "<think>a</think>b", ("a", "b")),
    # GLM-4.5 emits <think> itself (generation prompt is just <|assistant|>).
    ("glm45", None, "\n<think>Check weather.</think>\nIt is sunny.", ("Check weather.", "It is sunny.")),
    # GLM-4.7 / GLM-5: the prompt ended with <think>.
    ("glm45", True, "Need a tool.</think><tool_call>get_weather<arg_key>city</arg_key>"
     "<arg_value>Paris</arg_value></tool_call>",
     ("Need a tool.", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>")),
    # GLM: a tool call opened inside reasoning closes it (kept for the tool parser).
    ("glm45", True, "Need a tool.\n<tool_call>f</tool_call>", ("Need a tool.", "<tool_call>f</tool_call>")),
    ("qwen3", None, "<think>\n\n</think>\n\nHi", (None, "Hi")),
    ("kimi", None, "◁think▷hmm◁/think▷ok", ("hmm", "ok")),
    ("deepseek-r1", None, "", (None, None)),
]


def run_stream(name, force, chunks, stream_reasoning=True):
    parser = ReasoningParser(name, stream_reasoning=stream_reasoning, force_reasoning=force)
    reasoning, normal = [], []
    for chunk in chunks:
        r, n = parser.parse_stream_chunk(chunk)
        reasoning.append(r or "")
        normal.append(n or "")
    r, n = parser.parse_stream_end()
    reasoning.append(r or "")
    normal.append(n or "")
    return "".join(reasoning) or None, "".join(normal) or None


@pytest.mark.parametrize("name,force,text,expected", CASES)
def test_non_stream_exact(name, force, text, expected):
    assert ReasoningParser(name, force_reasoning=force).parse_non_stream(text) == expected


@pytest.mark.parametrize("name,force,text,expected", CASES)
def test_every_split_point(name, force, text, expected):
    for i in range(len(text) + 1):
        assert run_stream(name, force, [text[:i], text[i:]]) == expected, i
    # one character at a time, also without streaming reasoning
    assert run_stream(name, force, list(text)) == expected
    assert run_stream(name, force, list(text), stream_reasoning=False) == expected


def test_stream_needs_no_end_call_for_complete_blocks():
    parser = ReasoningParser("deepseek-v3", force_reasoning=True)
    text = "a b</think> c d"
    out = [parser.parse_stream_chunk(ch) for ch in text]
    assert "".join(r or "" for r, _ in out) == "a b"
    assert "".join(n or "" for _, n in out) == "c d"


def test_stream_reasoning_false_emits_block_at_once():
    parser = ReasoningParser("deepseek-r1", stream_reasoning=False)
    assert parser.parse_stream_chunk("<think>abc") == (None, None)
    assert parser.parse_stream_chunk(" def</thi") == (None, None)
    assert parser.parse_stream_chunk("nk>x") == ("abc def", "x")


def test_unknown_parser_lists_valid_names():
    with pytest.raises(ValueError, match="deepseek-v3.*glm45"):
        ReasoningParser("nope")
    with pytest.raises(ValueError, match="valid names"):
        reasoning_enabled("nope", {})


def test_reasoning_enabled_semantics():
    assert reasoning_enabled("deepseek-v3", None) is False
    assert reasoning_enabled("deepseek-v3", {"thinking": True}) is True
    assert reasoning_enabled("deepseek-v3", {"enable_thinking": True}) is False
    assert reasoning_enabled("glm45", None) is True
    assert reasoning_enabled("glm45", {"enable_thinking": False}) is False
    assert reasoning_enabled("qwen3", {"enable_thinking": False}) is False
    assert reasoning_enabled("deepseek-r1", {"thinking": False}) is True


_ALPHABET = st.sampled_from(["<think>", "</think>", "<tool_call>", "<", "/", "t", "h", "k", ">", " ", "\n", "a", "é"])


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_ALPHABET, max_size=25),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
    name=st.sampled_from(sorted(ReasoningParser.DetectorMap)),
    force=st.sampled_from([None, True, False]),
    stream_reasoning=st.booleans(),
)
def test_random_multi_splits(pieces, cuts, name, force, stream_reasoning):
    text = "".join(pieces)
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    expected = ReasoningParser(name, force_reasoning=force).parse_non_stream(text)
    assert run_stream(name, force, chunks, stream_reasoning) == expected


def test_make_reasoning_parser_forces_only_where_the_prompt_opened_the_block():
    from sglang.srt.parser.reasoning_parser import make_reasoning_parser

    out = "Thinking.</think>Answer."
    assert make_reasoning_parser("deepseek-v3", {"thinking": True}).parse_non_stream(out) == ("Thinking.", "Answer.")
    assert make_reasoning_parser("deepseek-v3", {}).parse_non_stream("Answer.") == (None, "Answer.")
    assert make_reasoning_parser("glm45", None).parse_non_stream(out) == ("Thinking.", "Answer.")
    assert make_reasoning_parser("glm45", {"enable_thinking": False}).parse_non_stream("Answer.") == (None, "Answer.")
    # Qwen3 / Kimi emit their start token themselves: never forced.
    assert make_reasoning_parser("qwen3", None).parse_non_stream("Answer.") == (None, "Answer.")
    assert make_reasoning_parser("kimi", None).parse_non_stream("Answer.") == (None, "Answer.")
    assert make_reasoning_parser("deepseek-r1", None).detector.force_reasoning is True
