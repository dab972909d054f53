"""/v1/responses (OpenAI's Responses API) on top of the chat handler.

A Responses request becomes a chat request (instructions -> system message, input items ->
messages, function tools -> tools, text.format -> response_format, reasoning.effort -> thinking),
so templates, reasoning / tool-call parsing and grammars are the chat path's. Output items are
`reasoning`, `message` (output_text) and `function_call`; streams use the typed events
(`response.created` ... `response.completed`). Stored responses (store=true, the default) can be
retrieved, listed for their input items, deleted, continued with `previous_response_id`, and -- when
created with background=true -- cancelled while they run. The store is in memory and bounded.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.chat_output import ParsedOutput
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, make_id, now_s, usage_of
from sglang.srt.entrypoints.openai.responses_stream import ResponseStream, call_item, message_item, reasoning_item
from sglang.srt.entrypoints.openai.serving_chat import ChatHandler
from sglang.srt.entrypoints.openai.utils import SSE_DONE, abort_error, request_error_response
from sglang.srt.entrypoints.request_io import SafeJSONResponse
from sglang.srt.managers.tokenizer_manager import RequestError

MAX_STORED = 1024


class ResponsesRequest(BaseModel):
    # Unknown fields are refused (400 naming them), never silently dropped.
    model_config = ConfigDict(extra="forbid")
    model: str = "default"
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    include: list[str] | None = None
    # Routing / caching hints with no effect on one server's output.
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # SGLang extensions (as on the chat route)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for part in content:
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise RequestError(f"{where}: content part type {part.get('type')!r} is not supported (text only)",
                               param="input")
        out.append(part.get("text", ""))
    return "".join(out)


def input_to_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (function calls join the assistant turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role {role!r} is not one of user, system, developer, assistant",
                                   param="input")
            msgs.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            elif msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"] = [call]
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not replayed to the model (as the chat templates drop it)
        else:
            raise RequestError(f"{where}.type {kind!r} is not supported (message, function_call, "
                               "function_call_output, reasoning)", param="input")
    return msgs


def output_items_to_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items = []
    for it in output:
        if it["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": it["content"]})
        elif it["type"] == "function_call":
            items.append(it)
    return input_to_messages(items)


class ResponsesHandler:
    def __init__(self, chat: ChatHandler) -> None:
        self.chat, self.tm = chat, chat.tm
        self.store: OrderedDict[str, dict[str, Any]] = OrderedDict()  # id -> {response, messages, task}
        self._created: dict[str, int] = {}

    # -- request -> chat request --------------------------------------------------------------------
    def to_chat(self, req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        if req.include:
            raise RequestError(f"include {req.include} is not supported", param="include")
        messages: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            # OpenAI and upstream: a 400 with a code, malformed or unknown (not a 404: the route exists).
            pid = req.previous_response_id
            if not isinstance(pid, str) or not pid.startswith("resp"):
                raise RequestError(f"Invalid 'previous_response_id': {pid!r}. Expected an ID that begins with "
                                   "'resp'.", param="previous_response_id", code="invalid_value")
            prev = self.store.get(pid)
            if prev is None:
                raise RequestError(f"Previous response with id {pid!r} not found.", param="previous_response_id",
                                   code="previous_response_not_found")
            messages = copy.deepcopy(prev["messages"]) + output_items_to_messages(prev["response"]["output"])
        new = input_to_messages(req.input)
        if req.instructions:  # instructions are not carried over from a previous response (OpenAI)
            messages = [m for m in messages if m.get("_instructions") is None]
            messages.insert(0, {"role": "system", "content": req.instructions, "_instructions": True})
        messages += new
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function" or not t.get("name"):
                raise RequestError(f"tools[{i}]: only function tools with a name are supported", param="tools")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                              "strict") if t.get(k) is not None}})
        tool_choice: Any = req.tool_choice
        if isinstance(tool_choice, dict):
            name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
            if tool_choice.get("type") != "function" or not name:
                raise RequestError("tool_choice must be auto, none, required or {type: function, name}",
                                   param="tool_choice")
            tool_choice = {"type": "function", "function": {"name": name}}
        fmt = (req.text or {}).get("format") or {"type": "text"}
        response_format = None
        if fmt.get("type") == "json_schema":
            response_format = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "schema"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        elif fmt.get("type") == "json_object":
            response_format = {"type": "json_object"}
        elif fmt.get("type") != "text":
            raise RequestError(f"text.format.type {fmt.get('type')!r} is not one of text, json_object, json_schema",
                               param="text")
        body: dict[str, Any] = {
            "model": req.model, "messages": [{k: v for k, v in m.items() if not k.startswith("_")} for m in messages],
            "max_completion_tokens": req.max_output_tokens, "stream": req.stream, "tools": tools or None,
            "tool_choice": tool_choice if tools else None, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format, "top_k": req.top_k, "min_p": req.min_p,
            "repetition_penalty": req.repetition_penalty, "frequency_penalty": req.frequency_penalty,
            "presence_penalty": req.presence_penalty, "stop": req.stop, "seed": req.seed,
            "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens,
            "chat_template_kwargs": req.chat_template_kwargs, "custom_logit_processor": req.custom_logit_processor,
            "custom_params": req.custom_params,
            "reasoning_effort": (req.reasoning or {}).get("effort"),
        }
        if req.temperature is not None:
            body["temperature"] = req.temperature
        if req.top_p is not None:
            body["top_p"] = req.top_p
        try:
            chat_req = ChatCompletionRequest.model_validate(body)
        except ValueError as e:
            raise RequestError(f"invalid request: {e}", param="input") from None
        return chat_req, messages

    # -- output ----------------------------------------------------------------------------------------
    def _response(self, rid: str, req: ResponsesRequest, status: str, output: list[dict], usage: dict | None,
                  incomplete: dict | None = None, error: dict | None = None) -> dict[str, Any]:
        return {
            "id": rid, "object": "response", "created_at": self._created.get(rid, now_s()), "model": req.model,
            "status": status, "output": output, "usage": usage, "error": error, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": req.store,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice, "tools": req.tools,
            "top_p": req.top_p if req.top_p is not None else 1.0, "truncation": req.truncation,
            "metadata": req.metadata or {}, "user": req.user, "background": req.background,
        }

    @staticmethod
    def _items(parsed: ParsedOutput) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if parsed.reasoning:
            out.append(reasoning_item(make_id("rs"), parsed.reasoning, "completed"))
        if parsed.content:
            out.append(message_item(make_id("msg"), parsed.content, "completed"))
        for call in parsed.tool_calls:
            out.append(call_item(make_id("fc"), call, "completed"))
        return out

    def _usage(self, results: list[dict], reasoning: str) -> dict[str, Any]:
        u = usage_of(results)
        # input/output_tokens (OpenAI) and upstream SGLang's prompt/completion_tokens beside them
        return {"input_tokens": u.prompt_tokens, "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "input_tokens_details": {"cached_tokens": (u.prompt_tokens_details or {}).get("cached_tokens", 0)},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.chat._reasoning_tokens(reasoning)},
                "total_tokens": u.total_tokens}

    @staticmethod
    def _status(meta: dict) -> tuple[str, dict | None]:
        if (meta.get("finish_reason") or {}).get("type") == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _remember(self, rid: str, req: ResponsesRequest, messages: list, response: dict, task=None) -> None:
        if not req.store:
            self._created.pop(rid, None)
            return
        self.store[rid] = {"response": response, "messages": messages, "task": task, "request": req}
        self.store.move_to_end(rid)
        while len(self.store) > MAX_STORED:
            old, _ = self.store.popitem(last=False)
            self._created.pop(old, None)

    # -- routes ----------------------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest):
        rid = make_id("resp")
        self._created[rid] = now_s()
        try:
            if req.background and (req.stream or not req.store):
                raise RequestError("background responses need store=true and stream=false", param="background")
            chat_req, messages = self.to_chat(req)
            items = await self.chat._build(chat_req)
        except RequestError as e:
            if e.param == "max_completion_tokens":  # the chat request's name for max_output_tokens
                e.param = "max_output_tokens"
            return request_error_response(e)
        if req.stream:
            for _, (prid, _, _), _ in items:
                try:
                    self.tm.check_can_start(prid)
                except RequestError as e:
                    return request_error_response(e)
            from fastapi.responses import StreamingResponse

            return StreamingResponse(self._stream(rid, req, chat_req, messages, items[0]),
                                     media_type="text/event-stream")
        if req.background:
            resp = self._response(rid, req, "queued", [], None)
            task = asyncio.ensure_future(self._run(rid, req, chat_req, messages, items[0]))
            self._remember(rid, req, messages, resp, task)
            return SafeJSONResponse(resp)
        try:
            resp = await self._run(rid, req, chat_req, messages, items[0])
        except RequestError as e:
            return request_error_response(e)
        if isinstance(resp, SafeJSONResponse):
            return resp
        return SafeJSONResponse(resp)

    async def _run(self, rid: str, req: ResponsesRequest, chat_req, messages, item):
        base, prepared, _ = item
        if req.background:
            self.store[rid]["response"]["status"] = "in_progress"
        try:
            res = await self.tm.generate_full(base, prepared)
        except asyncio.CancelledError:
            if req.background and rid in self.store:
                self.store[rid]["response"]["status"] = "cancelled"
            raise
        except RequestError as e:
            if req.background and rid in self.store:
                self.store[rid]["response"].update(status="failed", error={"code": "server_error",
                                                                            "message": e.message})
            raise
        aborted = abort_error([res])
        if aborted is not None:
            if req.background and rid in self.store:
                msg = res["meta_info"]["finish_reason"].get("message", "aborted")
                self.store[rid]["response"].update(status="failed", error={"code": "server_error", "message": msg})
            return aborted
        parsed = self.chat.output_parser(chat_req).parse_full(res["text"])
        status, incomplete = self._status(res["meta_info"])
        resp = self._response(rid, req, status, self._items(parsed), self._usage([res], parsed.reasoning or ""),
                              incomplete)
        self._remember(rid, req, messages, resp, self.store.get(rid, {}).get("task"))
        return resp

    async def _stream(self, rid: str, req: ResponsesRequest, chat_req, messages, item):
        base, prepared, _ = item
        parser = self.chat.output_parser(chat_req)
        st = ResponseStream()
        yield st.event("response.created", response=self._response(rid, req, "in_progress", [], None))
        yield st.event("response.in_progress", response=self._response(rid, req, "in_progress", [], None))
        try:
            async for update in self.tm.generate(base, prepared):
                res = update["result"]
                meta = res["meta_info"]
                events = parser.feed(update["text_delta"]) if update["text_delta"] else []
                if meta.get("finish_reason") is not None:
                    events += parser.finish()
                for ev in events:
                    for s in st.on(ev):
                        yield s
                if meta.get("finish_reason") is None:
                    continue
                for s in st.close():
                    yield s
                if meta["finish_reason"].get("type") == "abort":
                    err = {"code": "server_error", "message": meta["finish_reason"].get("message", "aborted")}
                    resp = self._response(rid, req, "failed", st.output, None, error=err)
                    yield st.event("response.failed", response=resp)
                    break
                status, incomplete = self._status(meta)
                resp = self._response(rid, req, status, st.output, self._usage([res], st.reasoning_text), incomplete)
                self._remember(rid, req, messages, resp)
                yield st.event("response.completed" if status == "completed" else "response.incomplete", response=resp)
        except RequestError as e:
            yield st.event("error", code=e.code, message=e.message, param=e.param)
        yield SSE_DONE

    def retrieve(self, rid: str) -> dict[str, Any]:
        entry = self.store.get(rid)
        if entry is None:
            raise RequestError(f"response {rid!r} not found", 404, param="response_id")
        return entry["response"]

    def cancel(self, rid: str) -> dict[str, Any]:
        entry = self.store.get(rid)
        if entry is None:
            raise RequestError(f"response {rid!r} not found", 404, param="response_id")
        if entry["task"] is None or not entry["request"].background:
            raise RequestError("only background responses can be cancelled", param="response_id")
        if not entry["task"].done():
            entry["task"].cancel()
            entry["response"]["status"] = "cancelled"
        return entry["response"]

    def delete(self, rid: str) -> dict[str, Any]:
        entry = self.store.pop(rid, None)
        if entry is None:
            raise RequestError(f"response {rid!r} not found", 404, param="response_id")
        if entry["task"] is not None and not entry["task"].done():
            entry["task"].cancel()
        return {"id": rid, "object": "response", "deleted": True}

    def input_items(self, rid: str) -> dict[str, Any]:
        entry = self.store.get(rid)
        if entry is None:
            raise RequestError(f"response {rid!r} not found", 404, param="response_id")
        req = entry["request"]
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}] \
            if isinstance(req.input, str) else list(req.input)
        data = [{"id": it.get("id") or make_id("msg"), **it} for it in items]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": False}
