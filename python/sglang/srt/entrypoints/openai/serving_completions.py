"""/v1/completions."""

from __future__ import annotations

import asyncio

from sglang.srt.entrypoints.openai.protocol import (
    MAX_N,
    CompletionRequest,
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
    token_text,
)
from sglang.srt.managers.tokenizer_manager import GenerateRequest, RequestError

MAX_LOGPROBS = 20


def _prompts(prompt) -> list[dict]:
    """Normalise OpenAI's prompt forms to [{'text': ...} | {'input_ids': [...]}]."""
    if isinstance(prompt, str):
        return [{"text": prompt}]
    if not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [{"input_ids": list(prompt)}]
    if all(isinstance(x, str) for x in prompt):
        return [{"text": x} for x in prompt]
    if all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in prompt):
        return [{"input_ids": list(x)} for x in prompt]
    raise RequestError("prompt must be a string, a list of strings, or token ids", param="prompt")


class CompletionHandler(OpenAIServingBase):
    async def _build(self, req: CompletionRequest) -> list[tuple[GenerateRequest, tuple, int]]:
        check_model(self.served_model_name, req.model)
        if not 1 <= req.n <= MAX_N:
            raise RequestError(f"n must be in [1, {MAX_N}]", param="n")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of other than n is not supported", param="best_of")
        if req.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        want_lp = req.logprobs is not None
        bases = [GenerateRequest(
            text=p.get("text"), input_ids=p.get("input_ids"), sampling_params=req.sampling_params(req.max_tokens),
            return_logprob=want_lp, logprob_start_len=0 if (want_lp and req.echo) else -1,
            top_logprobs_num=req.logprobs or 0, stream=req.stream, custom_logit_processor=req.custom_logit_processor,
            return_hidden_states=req.return_hidden_states, bootstrap_host=req.bootstrap_host,
            bootstrap_port=req.bootstrap_port, bootstrap_room=req.bootstrap_room) for p in _prompts(req.prompt)]
        out = []
        try:
            prepared_all = await asyncio.gather(*map(self.tm.prepare, bases))
        except RequestError as e:
            raise req.client_error(e) from None
        for pi, (base, prepared) in enumerate(zip(bases, prepared_all)):
            for j in range(req.n):
                rid = f"{prepared[0]}-{j}" if req.n > 1 else (req.rid or prepared[0])
                out.append((base, (rid, prepared[1], prepared[2].for_choice(j)), pi))
        return out

    # -- logprobs ---------------------------------------------------------------------------------
    def _logprobs(self, meta: dict, start_out: int, echo_prompt: bool, text_offset0: int) -> dict:
        tok = self.tm.tokenizer
        items = []
        if echo_prompt:
            items += list(zip(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs") or []))
        outs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(outs)
        items += list(zip(outs[start_out:], tops[start_out:]))
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = text_offset0
        for (lp, tid, _), top in items:
            t = token_text(tok, tid)
            res["tokens"].append(t)
            res["token_logprobs"].append(lp)
            res["top_logprobs"].append({token_text(tok, i): v for v, i, _ in top} if top else None)
            res["text_offset"].append(offset)
            offset += len(t)
        return res

    # -- non-streaming ----------------------------------------------------------------------------
    def _render(self, req: CompletionRequest, items, results: list[dict]) -> dict:
        choices = []
        for idx, ((base, prepared, _), res) in enumerate(zip(items, results)):
            prompt_text = (base.text if base.text is not None else self.tm.tokenizer.decode(prepared[1])) if req.echo else ""
            choice = {"index": idx, "text": prompt_text + res["text"], "logprobs": None,
                      "finish_reason": finish_reason_of(res["meta_info"])}
            if req.logprobs is not None:
                choice["logprobs"] = self._logprobs(res["meta_info"], 0, req.echo, 0)
            _attach_matched_stop(choice, res["meta_info"])
            choices.append(choice)
        return {"id": make_id("cmpl"), "object": "text_completion", "created": now_s(), "model": req.model,
                "choices": choices, "usage": usage_of(results).model_dump()}

    # -- streaming -----------------------------------------------------------------------------------
    async def _stream(self, req: CompletionRequest, items):
        cid, created = make_id("cmpl"), now_s()
        sent_lp = [0] * len(items)
        first = [True] * len(items)
        finals: dict[int, dict] = {}
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        streams = [self.tm.generate(base, prepared) for base, prepared, _ in items]
        try:
            async for idx, update in merge_streams(streams):
                base, prepared, pi = items[idx]
                res = update["result"]
                meta = res["meta_info"]
                text = update["text_delta"]
                if first[idx] and req.echo:
                    text = (base.text if base.text is not None else self.tm.tokenizer.decode(prepared[1])) + text
                choice = {"index": idx, "text": text, "logprobs": None, "finish_reason": finish_reason_of(meta)}
                if not text and choice["finish_reason"] is None:
                    continue  # logprobs of held-back tokens go out with the next text
                if req.logprobs is not None:
                    choice["logprobs"] = self._logprobs(meta, sent_lp[idx], req.echo and first[idx], 0)
                    sent_lp[idx] = len(meta.get("output_token_logprobs") or [])
                first[idx] = False
                if choice["finish_reason"] is not None:
                    meta["prompt_index"] = pi
                    finals[idx] = res
                    _attach_matched_stop(choice, meta)
                if text or choice["finish_reason"] is not None:  # a partial character waits: no empty chunk
                    body = {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                            "choices": [choice]}
                    if continuous:
                        body["usage"] = usage_of([res]).model_dump(exclude_none=True)
                    yield sse(body)
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": req.model,
                           "choices": [], "usage": usage_of([finals[i] for i in sorted(finals)]).model_dump()})
        except RequestError as e:
            yield sse(request_error_body(e))
        yield SSE_DONE


def _attach_matched_stop(choice: dict, meta: dict) -> None:
    choice["matched_stop"] = matched_stop_of(meta)
    if "hidden_states" in meta:
        choice["hidden_states"] = last_token_hidden(meta["hidden_states"])
