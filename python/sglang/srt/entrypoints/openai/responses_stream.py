"""A streamed /v1/responses answer as OpenAI's typed events, and the output items both the streamed
and the full answer are made of (`reasoning`, `message` with output_text, `function_call`)."""

from __future__ import annotations

import copy
from typing import Any

from sglang.srt.entrypoints.openai.chat_output import Event, ToolCallOut
from sglang.srt.entrypoints.openai.protocol import make_id
from sglang.srt.entrypoints.openai.utils import sse


def reasoning_item(iid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": iid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(iid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": iid, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(iid: str, call: ToolCallOut, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": iid, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


class ResponseStream:
    """One streamed response's events: sequence numbers, the output items so far and the open one.
    `on(ev)` turns a chat-output event into Responses SSE events, opening and closing items in
    OpenAI's order (added, deltas, done); `close()` ends the open item."""

    def __init__(self) -> None:
        self.seq = iter(range(1 << 62))
        self.output: list[dict[str, Any]] = []
        self.reasoning_text = ""
        self.current: dict[str, Any] | None = None  # the open output item

    def event(self, kind: str, **body) -> str:
        return sse({"type": kind, "sequence_number": next(self.seq), **body})

    def close(self) -> list[str]:
        if self.current is None:
            return []
        idx, it, out = len(self.output) - 1, self.current, []
        it["status"] = "completed"
        if it["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=it["id"], output_index=idx,
                                  content_index=0, text=it["content"][0]["text"]))
        elif it["type"] == "message":
            part = it["content"][0]
            out.append(self.event("response.output_text.done", item_id=it["id"], output_index=idx,
                                  content_index=0, text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=it["id"], output_index=idx,
                                  content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=it["id"], output_index=idx,
                                  name=it["name"], arguments=it["arguments"]))
        out.append(self.event("response.output_item.done", output_index=idx, item=it))
        self.current = None
        return out

    def open_item(self, it: dict[str, Any]) -> list[str]:
        out = self.close()
        self.output.append(it)
        self.current = it
        idx = len(self.output) - 1
        added = copy.deepcopy(it)
        if it["type"] == "message":
            added["content"] = []
        out.append(self.event("response.output_item.added", output_index=idx, item=added))
        if it["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=it["id"], output_index=idx,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return out

    def on(self, ev: Event) -> list[str]:
        out: list[str] = []
        if ev.kind == "reasoning":
            self.reasoning_text += ev.text
            if self.current is None or self.current["type"] != "reasoning":
                out += self.open_item(reasoning_item(make_id("rs"), "", "in_progress"))
            self.current["content"][0]["text"] += ev.text
            out.append(self.event("response.reasoning_text.delta", item_id=self.current["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=ev.text))
        elif ev.kind == "content":
            if self.current is None or self.current["type"] != "message":
                out += self.open_item(message_item(make_id("msg"), "", "in_progress"))
            self.current["content"][0]["text"] += ev.text
            out.append(self.event("response.output_text.delta", item_id=self.current["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=ev.text, logprobs=[]))
        elif ev.kind == "tool_start":
            call = ToolCallOut(ev.call.index, ev.call.name, "", ev.call.id)
            out += self.open_item(call_item(make_id("fc"), call, "in_progress"))
        elif self.current is not None and self.current["type"] == "function_call":
            self.current["arguments"] += ev.text
            out.append(self.event("response.function_call_arguments.delta", item_id=self.current["id"],
                                  output_index=len(self.output) - 1, delta=ev.text))
        return out
