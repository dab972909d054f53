"""Reasoning, tool calls, structured outputs and /v1/responses end to end, through the official
`openai` client, on random-weight models: a custom logit processor forces a scripted output in
the model family's real format, so parsing (streamed and not) is tested through the server."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
import requests

from sglang.srt.managers.tokenizer_utils import load_tokenizer
from sglang.srt.model_loader.builtin import resolve_model_path
from sglang.srt.testing.logit_processors import ScriptedTokensLogitProcessor
from sglang.srt.testing.server import ServerProcess

V32 = "builtin:tiny-deepseek-v32"
GLM = "builtin:tiny-glm-moe-dsa"
COMMON = ("--max-total-tokens", "8192", "--random-seed", "0", "--enable-custom-logit-processor")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "number"}, "b": {"type": "number"}}}}}
DSML_CALL = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
GLM_CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" \
           "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"


@pytest.fixture(scope="module")
def v32():
    with ServerProcess(V32, *COMMON, "--reasoning-parser", "deepseek-v3", "--tool-call-parser", "deepseekv32") as s:
        yield s


@pytest.fixture(scope="module")
def client(v32):
    return openai.OpenAI(base_url=v32.base_url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(V32)


def script(tok, text: str, **extra) -> dict:
    """extra_body forcing `text` (then EOS) as the model's output."""
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    return {"custom_logit_processor": ScriptedTokensLogitProcessor.to_str(), "custom_params": {"token_ids": ids},
            **extra}


def chat(client, tok, text: str, stream: bool = False, **kw):
    extra = script(tok, text, **kw.pop("extra", {}))
    return client.chat.completions.create(model="default", messages=kw.pop("messages", [
        {"role": "user", "content": "What is 2 + 2? And the weather in Paris?"}]), max_tokens=400, temperature=0,
        stream=stream, extra_body=extra, **kw)


def collect(stream) -> dict:
    """Concatenate a chat stream; checks no mid-stream chunk has an empty delta."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "matched_stop": "unset"}
    chunks = list(stream)
    for i, ch in enumerate(chunks):
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta.model_dump(exclude_none=True)
        if c.finish_reason is None and i > 0:
            assert d and d != {"role": "assistant"}, f"empty delta mid-stream: {ch}"
        out["reasoning"] += d.get("reasoning_content", "") or ""
        out["content"] += d.get("content", "") or ""
        for tc in d.get("tool_calls", []):
            slot = out["calls"].setdefault(tc["index"], {"name": None, "arguments": "", "id": None})
            fn = tc.get("function", {})
            if fn.get("name"):
                assert slot["name"] is None, "a tool call's name is sent once"
                slot["name"], slot["id"] = fn["name"], tc.get("id")
            slot["arguments"] += fn.get("arguments", "") or ""
        if c.finish_reason is not None:
            out["finish"] = c.finish_reason
            out["matched_stop"] = (c.model_extra or {}).get("matched_stop")
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_split_with_thinking(client, tok, stream):
    text = "<think>Two plus two is four.</think>The answer is 4."
    r = chat(client, tok, text, stream, extra={"chat_template_kwargs": {"thinking": True}},
             **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(r)
        got = collect(chunks)
        assert (got["reasoning"], got["content"], got["finish"]) == ("Two plus two is four.", "The answer is 4.",
                                                                    "stop")
        assert chunks[-1].usage.model_extra["reasoning_tokens"] == len(
            tok.encode("Two plus two is four.", add_special_tokens=False))
        assert got["matched_stop"] == tok.eos_token_id
        return
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content) == ("Two plus two is four.", "The answer is 4.")
    assert r.usage.model_extra["reasoning_tokens"] == len(tok.encode("Two plus two is four.", add_special_tokens=False))
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["matched_stop"] == tok.eos_token_id


def test_reasoning_off_by_default_and_when_not_separated(client, tok):
    text = "<think>hidden</think>shown"
    r = chat(client, tok, text)  # deepseek-v3: thinking defaults to off, so nothing is split
    assert r.choices[0].message.content == text and r.choices[0].message.model_extra.get("reasoning_content") is None
    r = chat(client, tok, text, extra={"chat_template_kwargs": {"thinking": True}, "separate_reasoning": False})
    assert r.choices[0].message.content == text


def test_length_finish_has_null_matched_stop(client):
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and "matched_stop" in r.choices[0].model_extra
    assert r.choices[0].model_extra["matched_stop"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_dsml_auto(client, tok, stream):
    text = "<think>Need the weather.</think>Let me check." + "\n\n" + DSML_CALL
    r = chat(client, tok, text, stream, tools=[WEATHER, ADD], extra={"chat_template_kwargs": {"thinking": True}})
    if stream:
        got = collect(r)
        assert got["finish"] == "tool_calls" and got["reasoning"] == "Need the weather."
        assert got["content"].strip() == "Let me check."
        assert [c["name"] for c in got["calls"].values()] == ["get_weather"]
        assert json.loads(got["calls"][0]["arguments"]) == {"city": "Paris", "days": 3}
        assert got["calls"][0]["id"]
        return
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content.strip() == "Let me check."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert call.id and call.type == "function"


def test_stream_arguments_equal_non_stream(client, tok):
    text = DSML_CALL.replace("</｜DSML｜function_calls>", "") + \
        '<｜DSML｜invoke name="add">\n<｜DSML｜parameter name="a" string="false">1.5</｜DSML｜parameter>\n' \
        '<｜DSML｜parameter name="b" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'
    full = chat(client, tok, text, tools=[WEATHER, ADD]).choices[0].message.tool_calls
    got = collect(chat(client, tok, text, True, tools=[WEATHER, ADD]))
    assert [(c.function.name, c.function.arguments) for c in full] == \
        [(got["calls"][i]["name"], got["calls"][i]["arguments"]) for i in sorted(got["calls"])]
    assert len(full) == 2 and json.loads(full[1].function.arguments) == {"a": 1.5, "b": 2}
    single = chat(client, tok, text, tools=[WEATHER, ADD], parallel_tool_calls=False).choices[0].message.tool_calls
    assert [c.function.name for c in single] == ["get_weather"]


def test_tool_choice_none_keeps_text_and_multi_turn(client, tok):
    r = chat(client, tok, DSML_CALL, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == DSML_CALL and not r.choices[0].message.tool_calls
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = chat(client, tok, "It is sunny.", messages=msgs, tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    short = chat(client, tok, "x", messages=msgs[:1], tools=[WEATHER])
    assert r.usage.prompt_tokens > short.usage.prompt_tokens  # the tool turn reached the template


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_choice_forced_by_grammar(client, tok, choice):
    name = "add" if isinstance(choice, dict) else "get_weather"
    args = {"a": 1, "b": 2} if name == "add" else {"city": "Oslo"}
    text = json.dumps([{"name": name, "parameters": args}])
    r = chat(client, tok, text, tools=[WEATHER, ADD], tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (name, args)
    assert r.choices[0].finish_reason == "tool_calls"
    got = collect(chat(client, tok, text, True, tools=[WEATHER, ADD], tool_choice=choice))
    assert got["calls"][0]["name"] == name and json.loads(got["calls"][0]["arguments"]) == args


def test_tool_errors(client):
    kw = dict(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}},
                                       **kw)
    assert "nope" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(tool_choice="required", **kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(extra_body={"lora_path": "x"}, **kw)
    assert "lora_path" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "no-such-type"}}}, **kw)
    assert e.value.body["param"] == "response_format"
    assert client.chat.completions.create(**kw).choices[0].message.content is not None  # still serving


def test_response_format_json_schema_random_weights(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "color": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    for stream in (False, True):
        kw = dict(model="default", messages=[{"role": "user", "content": "Pick a color."}], max_tokens=200,
                  temperature=1.0, seed=3, response_format={"type": "json_schema", "json_schema": {
                      "name": "pick", "schema": schema}})
        if stream:
            text = collect(client.chat.completions.create(stream=True, **kw))["content"]
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        value = json.loads(text)
        assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in schema[
            "properties"]["color"]["enum"]


def test_continuous_usage_stats(client, tok):
    chunks = list(chat(client, tok, "one two three", True, stream_options={"include_usage": True,
                                                                          "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices and c.usage is not None]
    assert with_choices and with_choices[-1].usage.completion_tokens >= with_choices[0].usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == with_choices[-1].usage.completion_tokens


def test_continue_final_message(client, tok):
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}]
    r = chat(client, tok, "ere!", messages=msgs, extra={"continue_final_message": True})
    assert r.choices[0].message.content == "ere!"


# -- /v1/responses -------------------------------------------------------------------------------------
def test_responses_create_retrieve_and_continue(client, tok):
    r = client.responses.create(model="default", input="What is 2 + 2?", instructions="Be brief.",
                                max_output_tokens=300, temperature=0,
                                extra_body=script(tok, "<think>2+2=4</think>4.", chat_template_kwargs={"thinking": True}))
    assert r.status == "completed" and r.output_text == "4."
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == "2+2=4"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == "4."
    follow = client.responses.create(model="default", input="And 3 + 3?", previous_response_id=r.id,
                                     max_output_tokens=50, temperature=0, extra_body=script(tok, "6."))
    assert follow.output_text == "6." and follow.usage.input_tokens > r.usage.input_tokens
    items = client.responses.input_items.list(r.id)
    assert items.data and items.data[0].type == "message"
    u = r.usage.model_dump()  # upstream's names beside OpenAI's
    assert (u["prompt_tokens"], u["completion_tokens"]) == (u["input_tokens"], u["output_tokens"])
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    # a previous_response_id that is unknown (deleted) or malformed: 400 with a code (OpenAI, upstream)
    for pid, code in [(r.id, "previous_response_not_found"), ("not-an-id", "invalid_value")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="default", input="x", previous_response_id=pid, max_output_tokens=2)
        assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", code), e.value.body


def test_responses_function_call_and_stream(client, tok):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    kw = dict(model="default", input="Weather in Paris?", tools=tools, max_output_tokens=400, temperature=0,
              extra_body=script(tok, "Checking." + DSML_CALL))
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments)["city"] == "Paris"
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Checking."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    # the call's result continues the conversation
    follow = client.responses.create(model="default", previous_response_id=final.id, input=[
        {"type": "function_call_output", "call_id": final.output[1].call_id, "output": "sunny"}],
        max_output_tokens=20, temperature=0, extra_body=script(tok, "Sunny."))
    assert follow.output_text == "Sunny."


def test_responses_incomplete_background_and_cancel(client, v32):
    r = client.responses.create(model="default", input="hi", max_output_tokens=2, temperature=0,
                                extra_body={"top_k": 1})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    bg = client.responses.create(model="default", input="count", max_output_tokens=2000, background=True,
                                 extra_body={"ignore_eos": True})
    assert bg.status in ("queued", "in_progress")
    cancelled = client.responses.cancel(bg.id)
    assert cancelled.status == "cancelled"
    v32.wait_idle(timeout=120)
    assert client.responses.retrieve(bg.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)  # not a background response
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="default", input=[{"type": "web_search_call"}])


# -- GLM-5 ------------------------------------------------------------------------------------------
# GLM-4.7 / GLM-5's template ends the generation prompt with <think> (thinking) or </think> (not).
GLM_LIKE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|>"
                     "{% if enable_thinking is defined and not enable_thinking %}</think>{% else %}<think>{% endif %}")


def test_glm5_reasoning_and_tool_calls(tmp_path):
    tok = load_tokenizer(GLM)
    template = tmp_path / "glm_like.jinja"
    template.write_text(GLM_LIKE_TEMPLATE)
    with ServerProcess(GLM, *COMMON, "--reasoning-parser", "glm45", "--tool-call-parser", "glm47",
                       "--chat-template", str(template)) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused")
        text = "<think>The user wants weather.</think>" + GLM_CALL
        for stream in (False, True):
            r = chat(client, tok, text, stream, tools=[WEATHER])
            if stream:
                got = collect(r)
                assert got["reasoning"] == "The user wants weather." and got["finish"] == "tool_calls"
                assert json.loads(got["calls"][0]["arguments"]) == {"city": "Paris", "days": 3}
            else:
                m = r.choices[0].message
                assert m.model_extra["reasoning_content"] == "The user wants weather."
                assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
        # the prompt opened the think block, so output without <think> starts inside it
        forced = chat(client, tok, "Still thinking.</think>Answer.")
        assert (forced.choices[0].message.model_extra["reasoning_content"], forced.choices[0].message.content) == \
            ("Still thinking.", "Answer.")
        off = chat(client, tok, "plain</think>", extra={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.choices[0].message.content == "plain</think>"
        n_on = requests.post(s.base_url + "/v1/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
        n_off = requests.post(s.base_url + "/v1/tokenize", json={"messages": [{"role": "user", "content": "x"}],
                                                                 "chat_template_kwargs": {"enable_thinking": False}})
        assert tok.decode(n_on["tokens"]).endswith("<think>") and tok.decode(n_off.json()["tokens"]).endswith("</think>")
        s.wait_idle()


# -- DeepSeek-V3.2 checkpoints ship no Jinja template: its Python encoder renders the prompt ----------
def test_dsv32_encoder_when_no_chat_template(tmp_path):
    from sglang.srt.entrypoints.openai.encoding_dsv32 import encode_messages

    src = resolve_model_path(V32)
    dst = tmp_path / "v32-no-template"
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for name in os.listdir(dst):
        if name.startswith("chat_template"):
            os.remove(dst / name)
    assert load_tokenizer(str(dst)).chat_template is None
    msgs = [{"role": "user", "content": "Hello"}]
    with ServerProcess(str(dst), "--max-total-tokens", "8192", "--random-seed", "0") as s:
        body = {"model": "default", "messages": msgs, "max_tokens": 6, "temperature": 0}
        r = requests.post(s.base_url + "/v1/chat/completions", json=body).json()
        prompt = encode_messages(msgs, thinking_mode="chat")
        g = requests.post(s.base_url + "/generate", json={"text": prompt, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0}}).json()
        assert r["choices"][0]["message"]["content"] == g["text"]
        assert r["usage"]["prompt_tokens"] == g["meta_info"]["prompt_tokens"]
