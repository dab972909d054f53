"""Reasoning-aware grammars through the server (issue 22, 0b): with a reasoning parser and thinking
on, `tool_choice` required / a named function and `response_format` json_schema / json_object leave
the think block free and constrain only what follows `</think>` (upstream's reasoner grammar), so
the forced JSON lands in `tool_calls` / `content`, streamed or not.

The scripted logit processor makes the model emit reasoning, the end marker, then JSON: every
scripted token after the marker must pass the grammar (a token the mask refuses aborts the request
with a 400), and the reasoning tokens must not be fed to it. GLM-5 (glm45, thinking by default,
the prompt opens <think>) and DeepSeek-V3.2 (deepseek-v3, `thinking: true`)."""

from __future__ import annotations

import json

import openai
import pytest

from sglang.srt.managers.tokenizer_utils import load_tokenizer
from sglang.srt.testing.logit_processors import ScriptedTokensLogitProcessor
from sglang.srt.testing.server import ServerProcess

V32 = "builtin:tiny-deepseek-v32"
GLM = "builtin:tiny-glm-moe-dsa"
COMMON = ("--max-total-tokens", "8192", "--random-seed", "0", "--enable-custom-logit-processor")
GLM_LIKE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|>"
                     "{% if enable_thinking is defined and not enable_thinking %}</think>{% else %}<think>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
REASONING = "The user wants the weather."


@pytest.fixture(scope="module", params=["glm5", "v32"])
def served(request, tmp_path_factory):
    if request.param == "glm5":
        template = tmp_path_factory.mktemp("tpl") / "glm_like.jinja"
        template.write_text(GLM_LIKE_TEMPLATE)
        args, model, kwargs = ("--reasoning-parser", "glm45", "--chat-template", str(template)), GLM, {}
    else:
        args, model, kwargs = ("--reasoning-parser", "deepseek-v3"), V32, {"thinking": True}
    with ServerProcess(model, *COMMON, *args, "--tool-call-parser", "glm47" if model == GLM else "deepseekv32") as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused")
        yield client, load_tokenizer(model), kwargs


def ask(served, answer: str, stream: bool, **kw):
    """A chat request whose output is REASONING, `</think>`, `answer`, EOS (each part encoded
    alone, so the marker is the tokenizer's own spelling of it)."""
    client, tok, kwargs = served
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    ids = enc(REASONING) + enc("</think>") + enc(answer)
    extra = {"custom_logit_processor": ScriptedTokensLogitProcessor.to_str(), "custom_params": {"token_ids": ids},
             "chat_template_kwargs": kwargs}
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       max_tokens=200, temperature=0, stream=stream, extra_body=extra, **kw)
    if not stream:
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return m.model_extra.get("reasoning_content"), m.content, calls, r.choices[0].finish_reason
    reasoning, content, calls, finish = "", "", {}, None
    for ch in r:
        if not ch.choices:
            continue
        d = ch.choices[0].delta.model_dump(exclude_none=True)
        reasoning += d.get("reasoning_content") or ""
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], ["", ""])
            slot[0] += tc.get("function", {}).get("name") or ""
            slot[1] += tc.get("function", {}).get("arguments") or ""
        finish = ch.choices[0].finish_reason or finish
    return reasoning, content or None, [(n, json.loads(a)) for n, a in calls.values()], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_after_reasoning(served, stream, choice):
    answer = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}}])
    reasoning, content, calls, finish = ask(served, answer, stream, tools=[WEATHER], tool_choice=choice)
    assert reasoning == REASONING
    assert calls == [("get_weather", {"city": "Oslo"})] and finish == "tool_calls"
    assert not content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
                                 {"type": "json_object"}])
def test_response_format_after_reasoning(served, stream, fmt):
    reasoning, content, calls, finish = ask(served, '{"city": "Oslo"}', stream, response_format=fmt)
    assert (reasoning, json.loads(content), calls, finish) == (REASONING, {"city": "Oslo"}, [], "stop")


def test_grammar_still_applies_after_reasoning(served):
    """JSON that breaks the schema after </think> is still refused (the mask is on there)."""
    with pytest.raises(openai.BadRequestError) as e:
        ask(served, '{"town": "Oslo"}', False, response_format={"type": "json_schema", "json_schema": {
            "name": "w", "schema": SCHEMA}})
    assert "grammar" in str(e.value)
