"""/v1/chat/completions."""

from __future__ import annotations

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, finish_reason_of, make_id, now_s, usage_of
from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
from sglang.srt.entrypoints.openai.protocol import MAX_N
from sglang.srt.entrypoints.openai.utils import SSE_DONE, check_model, merge_streams, sse, token_bytes, token_text
from sglang.srt.managers.tokenizer_manager import GenerateRequest, RequestError

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_TOP_LOGPROBS = 20


def _messages_for_template(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise RequestError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise RequestError(f"messages[{i}].role {m.role!r} is not one of {sorted(ROLES)}", param="messages")
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise RequestError(f"messages[{i}]: content part type {part.get('type')!r} is not supported "
                                       "(text only)", param="messages")
                parts.append(part.get("text", ""))
            content = "".join(parts)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


class ChatHandler(OpenAIServingBase):
    async def _build(self, req: ChatCompletionRequest) -> list[tuple[GenerateRequest, tuple, int]]:
        check_model(self.served_model_name, req.model)
        if not 1 <= req.n <= MAX_N:
            raise RequestError(f"n must be in [1, {MAX_N}]", param="n")
        if req.tools:
            raise RequestError("tools / function calling are not supported by this server", param="tools")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise RequestError("response_format other than text is not supported", param="response_format")
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise RequestError("top_logprobs requires logprobs=true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        prompt = await self.tm.run_in_pool(self._render_template, _messages_for_template(req))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        base = GenerateRequest(text=prompt, sampling_params=req.sampling_params(max_tokens),
                               return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0, stream=req.stream)
        rid, ids, sp = await self.tm.prepare(base)
        return [(base, (f"{rid}-{j}" if req.n > 1 else (req.rid or rid), ids, sp), 0) for j in range(req.n)]

    def _render_template(self, messages: list[dict]) -> str:
        try:
            return self.tm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise RequestError(f"cannot apply the chat template: {e}", param="messages") from None

    def _logprobs(self, meta: dict, start: int) -> dict:
        tok = self.tm.tokenizer
        outs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(outs)
        content = []
        for (lp, tid, _), top in zip(outs[start:], tops[start:]):
            content.append({
                "token": token_text(tok, tid), "logprob": lp, "bytes": token_bytes(tok, tid),
                "top_logprobs": [{"token": token_text(tok, i), "logprob": v, "bytes": token_bytes(tok, i)}
                                 for v, i, _ in (top or [])],
            })
        return {"content": content}

    def _render(self, req: ChatCompletionRequest, items, results: list[dict]) -> dict:
        choices = []
        for idx, res in enumerate(results):
            choice = {"index": idx, "message": {"role": "assistant", "content": res["text"]},
                      "logprobs": self._logprobs(res["meta_info"], 0) if req.logprobs else None,
                      "finish_reason": finish_reason_of(res["meta_info"])}
            fr = res["meta_info"].get("finish_reason") or {}
            if "matched" in fr:
                choice["matched_stop"] = fr["matched"]
            choices.append(choice)
        return {"id": make_id("chatcmpl"), "object": "chat.completion", "created": now_s(), "model": req.model,
                "choices": choices, "usage": usage_of(results).model_dump()}

    async def _stream(self, req: ChatCompletionRequest, items):
        cid, created = make_id("chatcmpl"), now_s()

        def chunk(choices: list[dict], **extra) -> str:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                        "choices": choices, **extra})

        sent_lp = [0] * len(items)
        finals: dict[int, dict] = {}
        for idx in range(len(items)):
            yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        try:
            async for idx, update in merge_streams([self.tm.generate(b, p) for b, p, _ in items]):
                res, text = update["result"], update["text_delta"]
                meta = res["meta_info"]
                fr = finish_reason_of(meta)
                lp = None
                if req.logprobs:
                    lp = self._logprobs(meta, sent_lp[idx])
                    sent_lp[idx] = len(meta.get("output_token_logprobs") or [])
                if fr is not None:
                    meta["prompt_index"] = 0
                    finals[idx] = res
                if text or fr is not None or (lp and lp["content"]):
                    yield chunk([{"index": idx, "delta": {"content": text} if text else {}, "logprobs": lp,
                                  "finish_reason": fr}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=usage_of(list(finals.values())).model_dump())
        except RequestError as e:
            yield sse({"error": {"message": e.message, "type": e.err_type, "param": e.param, "code": e.code}})
        yield SSE_DONE
