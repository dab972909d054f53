"""/v1/chat/completions: templates, reasoning and tool calls, structured outputs, streaming."""

from __future__ import annotations

import functools
import json
from typing import Any

from sglang.srt.entrypoints.openai.chat_output import Event, OutputParser
from sglang.srt.entrypoints.openai.chat_prompt import render_prompt
from sglang.srt.entrypoints.openai.protocol import (
    MAX_N,
    ChatCompletionRequest,
    ToolChoice,
    finish_reason_of,
    make_id,
    matched_stop_of,
    now_s,
    usage_of,
)
from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
from sglang.srt.entrypoints.openai.utils import (
    SSE_DONE,
    check_model,
    last_token_hidden,
    merge_streams,
    request_error_body,
    sse,
    token_bytes,
    token_text,
)
from sglang.srt.function_call.utils import get_json_schema_constraint
from sglang.srt.managers.tokenizer_manager import GenerateRequest, RequestError
from sglang.srt.constrained.base_grammar_backend import grammar_key
from sglang.srt.parser.reasoning_parser import reasoning_enabled, think_end_token

MAX_TOP_LOGPROBS = 20


class ChatHandler(OpenAIServingBase):
    def __init__(self, tm, served_model_name: str, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None) -> None:
        super().__init__(tm, served_model_name)
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser

    # -- request -> generate requests ---------------------------------------------------------------
    async def _build(self, req: ChatCompletionRequest) -> list[tuple[GenerateRequest, tuple, int]]:
        check_model(self.served_model_name, req.model)
        if not 1 <= req.n <= MAX_N:
            raise RequestError(f"n must be in [1, {MAX_N}]", param="n")
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        mode = self.tool_mode(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp = req.sampling_params(max_tokens)
        if mode == "json_array":
            if any(k in sp for k in ("regex", "ebnf", "json_schema")):
                raise RequestError("tool_choice required / a named function cannot be combined with "
                                   "response_format, regex, ebnf or json_schema", param="tool_choice")
            schema = get_json_schema_constraint(req.template_tools(), self._tool_choice_dict(req),
                                                req.parallel_tool_calls)
            sp["json_schema"] = json.dumps(schema)
        arch = self.tm.scheduler_info.get("architecture")
        prompt = await self.tm.run_in_pool(render_prompt, self.tm.tokenizer, arch, req.messages,
                                           req.template_tools(), req.template_kwargs(), req.continue_final_message)
        base = GenerateRequest(text=prompt, sampling_params=sp, return_logprob=req.logprobs,
                               top_logprobs_num=req.top_logprobs or 0, stream=req.stream,
                               custom_logit_processor=req.custom_logit_processor,
                               return_hidden_states=req.return_hidden_states, bootstrap_host=req.bootstrap_host,
                               bootstrap_port=req.bootstrap_port, bootstrap_room=req.bootstrap_room)
        try:
            rid, ids, sp_obj = await self.tm.prepare(base)
        except RequestError as e:
            if mode == "json_array" and e.param == "json_schema":
                e.param = "tool_choice"
                raise
            raise req.client_error(e) from None
        if grammar_key(sp_obj) is not None and self.thinks(req):
            # Upstream's reasoner grammar: free until the think block ends, then the grammar.
            sp_obj.think_end_ids = self.think_end_ids
        return [(base, (f"{rid}-{j}" if req.n > 1 else (req.rid or rid), ids, sp_obj.for_choice(j)), 0)
                for j in range(req.n)]

    def thinks(self, req: ChatCompletionRequest) -> bool:
        """The model thinks before answering (whether or not the reasoning is separated)."""
        return bool(self.reasoning_parser) and reasoning_enabled(self.reasoning_parser, req.template_kwargs())

    @functools.cached_property
    def think_end_ids(self) -> list[int]:
        return self.tm.tokenizer.encode(think_end_token(self.reasoning_parser), add_special_tokens=False)

    @staticmethod
    def _tool_choice_dict(req: ChatCompletionRequest) -> Any:
        tc = req.tool_choice
        return tc.model_dump() if isinstance(tc, ToolChoice) else tc

    def tool_mode(self, req: ChatCompletionRequest) -> str:
        """none | parser (find calls in free text) | json_array (the grammar forces the calls)."""
        if not req.tools or req.tool_choice == "none":
            if isinstance(req.tool_choice, ToolChoice) or req.tool_choice == "required":
                raise RequestError("tool_choice requires tools", param="tool_choice")
            return "none"
        if isinstance(req.tool_choice, ToolChoice):
            names = {t.function.name for t in req.tools}
            if req.tool_choice.function.name not in names:
                raise RequestError(f"tool_choice names function {req.tool_choice.function.name!r}, which is not "
                                   f"in tools ({sorted(names)})", param="tool_choice")
            return "json_array"
        if req.tool_choice == "required":
            return "json_array"
        if self.tool_call_parser is None:
            raise RequestError("tools with tool_choice auto need a tool-call parser: start the server with "
                               "--tool-call-parser (e.g. deepseekv32, deepseekv31, glm47)", param="tools")
        return "parser"

    def output_parser(self, req: ChatCompletionRequest) -> OutputParser:
        reasoning = None
        if (self.reasoning_parser and req.separate_reasoning
                and reasoning_enabled(self.reasoning_parser, req.template_kwargs())):
            reasoning = self.reasoning_parser
        return OutputParser(reasoning, req.template_kwargs(), req.stream_reasoning, req.template_tools(),
                            self.tool_mode(req), self.tool_call_parser, req.parallel_tool_calls)

    # -- logprobs ---------------------------------------------------------------------------------
    def _logprobs(self, meta: dict, start: int) -> dict:
        tok = self.tm.tokenizer
        outs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(outs)
        content = []
        for (lp, tid, _), top in zip(outs[start:], tops[start:]):
            content.append({
                "token": token_text(tok, tid), "logprob": lp, "bytes": token_bytes(tok, tid),
                "top_logprobs": [{"token": token_text(tok, i), "logprob": v, "bytes": token_bytes(tok, i)}
                                 for v, i, *_ in (top or [])],
            })
        return {"content": content}

    def _reasoning_tokens(self, text: str | None) -> int:
        return len(self.tm.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    # -- non-streaming ----------------------------------------------------------------------------
    def _render(self, req: ChatCompletionRequest, items, results: list[dict]) -> dict:
        choices, reasoning_tokens = [], 0
        for idx, ((base, _, _), res) in enumerate(zip(items, results)):
            parsed = self.output_parser(req).parse_full(res["text"])
            meta = res["meta_info"]
            fr = finish_reason_of(meta)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content,
                                       "reasoning_content": parsed.reasoning, "tool_calls": None}
            if parsed.tool_calls:
                message["tool_calls"] = [{k: v for k, v in c.to_openai().items() if k != "index"}
                                         for c in parsed.tool_calls]
                fr = "tool_calls" if fr == "stop" else fr
            elif message["content"] is None:
                message["content"] = ""
            reasoning_tokens += self._reasoning_tokens(parsed.reasoning)
            choice = {"index": idx, "message": message,
                      "logprobs": self._logprobs(meta, 0) if req.logprobs else None,
                      "finish_reason": fr, "matched_stop": matched_stop_of(meta)}
            if "hidden_states" in meta:
                choice["hidden_states"] = last_token_hidden(meta["hidden_states"])
            choices.append(choice)
        usage = usage_of(results)
        if self.reasoning_parser:
            usage.reasoning_tokens = reasoning_tokens
        return {"id": make_id("chatcmpl"), "object": "chat.completion", "created": now_s(), "model": req.model,
                "choices": choices, "usage": usage.model_dump(exclude_none=True)}

    # -- streaming ---------------------------------------------------------------------------------
    @staticmethod
    def _delta(ev: Event) -> dict:
        if ev.kind == "reasoning":
            return {"reasoning_content": ev.text}
        if ev.kind == "content":
            return {"content": ev.text}
        if ev.kind == "tool_start":
            return {"tool_calls": [{"index": ev.call.index, "id": ev.call.id, "type": "function",
                                    "function": {"name": ev.call.name, "arguments": ""}}]}
        return {"tool_calls": [{"index": ev.call.index, "function": {"arguments": ev.text}}]}

    async def _stream(self, req: ChatCompletionRequest, items):
        cid, created = make_id("chatcmpl"), now_s()
        opts = req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)

        def chunk(choices: list[dict], usage_meta: list[dict] | None = None, **extra) -> str:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": choices, **extra}
            if continuous and usage_meta is not None:
                body["usage"] = usage_of([{"meta_info": m} for m in usage_meta]).model_dump(exclude_none=True)
            return sse(body)

        parsers = [self.output_parser(req) for base, _, _ in items]
        sent_lp = [0] * len(items)
        finals: dict[int, dict] = {}
        reasoning_text = [""] * len(items)
        for idx in range(len(items)):
            yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        try:
            async for idx, update in merge_streams([self.tm.generate(b, p) for b, p, _ in items]):
                res, text = update["result"], update["text_delta"]
                meta = res["meta_info"]
                meta["prompt_index"] = 0
                fr = finish_reason_of(meta)
                events = parsers[idx].feed(text) if text else []
                if fr is not None:
                    events += parsers[idx].finish()
                    finals[idx] = res
                    if parsers[idx].tool_calls and fr == "stop":
                        fr = "tool_calls"
                if not events and fr is None:
                    continue  # nothing to show yet (a partial character, a held-back tag): no empty delta
                lp = None
                if req.logprobs:
                    lp = self._logprobs(meta, sent_lp[idx])
                    sent_lp[idx] = len(meta.get("output_token_logprobs") or [])
                reasoning_text[idx] += "".join(ev.text for ev in events if ev.kind == "reasoning")
                deltas = [self._delta(ev) for ev in events] or [{}]
                for j, delta in enumerate(deltas):
                    last = j == len(deltas) - 1
                    choice = {"index": idx, "delta": delta, "logprobs": lp if j == 0 else None,
                              "finish_reason": fr if last else None}
                    if last and fr is not None:
                        choice["matched_stop"] = matched_stop_of(meta)
                    yield chunk([choice], [meta])
            for idx in sorted(finals):  # upstream: one more chunk per choice, after its finish
                hidden = finals[idx]["meta_info"].get("hidden_states")
                if hidden is not None:
                    yield chunk([{"index": idx, "delta": {"hidden_states": last_token_hidden(hidden)},
                                  "logprobs": None, "finish_reason": None}])
            if opts and opts.include_usage:
                usage = usage_of([finals[i] for i in sorted(finals)])
                if self.reasoning_parser:
                    usage.reasoning_tokens = sum(map(self._reasoning_tokens, reasoning_text))
                yield chunk([], usage=usage.model_dump(exclude_none=True))
        except RequestError as e:
            yield sse(request_error_body(e))
        yield SSE_DONE
