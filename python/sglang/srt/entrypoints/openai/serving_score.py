"""POST /v1/score (upstream SGLang's scoring API: reranking, reward-style scoring).

Request: `query` + `items` (text, or token ids: a list of ints and a list of such lists),
`label_token_ids`, `apply_softmax`, `item_first`. Response: `scores[i][j]` = the probability of
label j at the position right after query+item i (item+query with `item_first`): exp(logprob),
or with `apply_softmax` the softmax over the labels' logprobs (summing to 1).

How: the logprob of label j there is the prompt logprob of token j appended to query+item, so each
(item, label) pair is a prefill-only request (`max_new_tokens: 0`, input logprobs of the last
position only) through the normal scheduler path -- no scheduler change, exact logprobs whatever
their rank. Rounds share the prefix cache: the query alone first (items of one query then reuse
it), then each item with its first label, then the other labels (each recomputes only its last two
positions; logprob_start_len bounds the cache match). Text is concatenated before tokenizing, as
upstream does; ids are concatenated as given.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from sglang.srt.entrypoints.openai.utils import check_model
from sglang.srt.managers.tokenizer_manager import GenerateRequest, RequestError, TokenizerManager


class ScoringRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = "default"
    query: Any = None
    items: Any = None
    label_token_ids: Any = None
    apply_softmax: bool = False
    item_first: bool = False


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class OpenAIServingScore:
    def __init__(self, tm: TokenizerManager, served_model_name: str) -> None:
        self.tm, self.served_model_name = tm, served_model_name

    # -- validation ---------------------------------------------------------------------------------
    def _labels(self, req: ScoringRequest) -> list[int]:
        labels = req.label_token_ids
        if not _is_ids(labels) or not labels:
            raise RequestError("label_token_ids must be a non-empty list of token ids", param="label_token_ids")
        bad = [t for t in labels if not 0 <= t < self.tm.vocab_size]
        if bad:
            # "Token ID N is out of vocabulary": upstream's wording, which its API suite matches.
            raise RequestError(f"label_token_ids: Token ID {bad[0]} is out of vocabulary (ids {bad[:5]} are outside "
                               f"[0, {self.tm.vocab_size}))", param="label_token_ids")
        return labels

    def _inputs(self, req: ScoringRequest) -> tuple[bool, Any, list]:
        """(is_text, query, items) with items always a list; mixed text and ids are a 400."""
        q, items = req.query, req.items
        if q is None:
            raise RequestError("query is required (a string or a list of token ids)", param="query")
        if items is None or items == [] or items == "":
            raise RequestError("items must be a non-empty string, list of strings or list of token-id lists",
                               param="items")
        if isinstance(q, str):
            items = [items] if isinstance(items, str) else items
            if not (isinstance(items, list) and all(isinstance(x, str) for x in items)):
                raise RequestError("a text query takes text items (a string or a list of strings); do not mix "
                                   "text and token ids", param="items")
            return True, q, items
        if not _is_ids(q):
            raise RequestError("query must be a string or a list of token ids", param="query")
        if _is_ids(items):
            items = [items]
        if not (isinstance(items, list) and all(_is_ids(x) for x in items)):
            raise RequestError("a token-id query takes token-id items (a list of token-id lists); do not mix "
                               "text and token ids", param="items")
        for name, ids in [("query", q), *(("items", x) for x in items)]:
            if any(not 0 <= t < self.tm.vocab_size for t in ids):
                raise RequestError(f"{name} holds token ids outside [0, {self.tm.vocab_size})", param=name)
        return False, q, items

    def _tokenize(self, is_text: bool, query, items: list, item_first: bool) -> tuple[list[int], list[list[int]]]:
        enc = (lambda s: self.tm.tokenizer.encode(s, add_special_tokens=False)) if is_text else list
        joined = [(i + query if item_first else query + i) for i in items]
        prompts = [enc(p) for p in joined]
        if any(not p for p in prompts):
            raise RequestError("query + item is empty", param="items")
        try:
            for p in prompts:
                self.tm.check_length(len(p) + 1, 0)  # + the label token
        except RequestError as e:
            e.param = "items"
            raise
        return enc(query) if not item_first else [], prompts

    # -- scoring ------------------------------------------------------------------------------------
    async def _run(self, reqs: list[GenerateRequest]) -> list[dict]:
        prepared = await asyncio.gather(*map(self.tm.prepare, reqs))
        return await asyncio.gather(*[self.tm.generate_full(r, p) for r, p in zip(reqs, prepared)])

    @staticmethod
    def _label_req(prompt: list[int], label: int) -> GenerateRequest:
        return GenerateRequest(input_ids=prompt + [label], sampling_params={"max_new_tokens": 0},
                               return_logprob=True, logprob_start_len=len(prompt))

    async def handle(self, req: ScoringRequest) -> dict:
        check_model(self.served_model_name, req.model)
        labels = self._labels(req)
        is_text, query, items = self._inputs(req)
        query_ids, prompts = await self.tm.run_in_pool(self._tokenize, is_text, query, items, req.item_first)
        if len(query_ids) > 1 and len(prompts) > 1:  # warm the prefix cache with the shared query
            await self._run([GenerateRequest(input_ids=query_ids, sampling_params={"max_new_tokens": 0})])
        distinct = list(dict.fromkeys(labels))
        first = await self._run([self._label_req(p, distinct[0]) for p in prompts])
        rest = await self._run([self._label_req(p, t) for p in prompts for t in distinct[1:]])
        for r in first + rest:
            fr = r["meta_info"].get("finish_reason") or {}
            if fr.get("type") == "abort":
                status = fr.get("status_code", 400)
                raise RequestError(fr.get("message", "scoring aborted"), status,
                                   err_type="server_error" if status >= 500 else "invalid_request_error")
        logprob: dict[tuple[int, int], float] = {}
        for i in range(len(prompts)):
            logprob[i, distinct[0]] = _last_logprob(first[i])
            for j, t in enumerate(distinct[1:]):
                logprob[i, t] = _last_logprob(rest[i * (len(distinct) - 1) + j])
        scores = [_probabilities([logprob[i, t] for t in labels], req.apply_softmax) for i in range(len(prompts))]
        n_prompt = sum(len(p) for p in prompts)
        cached = sum(r["meta_info"].get("cached_tokens", 0) for r in first + rest)
        return {"object": "scoring", "model": req.model, "scores": scores,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt,
                          "prompt_tokens_details": {"cached_tokens": cached}}}


def _last_logprob(result: dict) -> float:
    lp = result["meta_info"]["input_token_logprobs"][-1][0]
    return -math.inf if lp is None else float(lp)


def _probabilities(logprobs: list[float], apply_softmax: bool) -> list[float]:
    if not apply_softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)
    if top == -math.inf:
        return [1.0 / len(logprobs)] * len(logprobs)
    exps = [math.exp(x - top) for x in logprobs]
    total = sum(exps)
    return [e / total for e in exps]
