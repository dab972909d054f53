"""Per-request output accumulation, shared by the offline Engine and the TokenizerManager.

Results use upstream SGLang's shape: {"text", "output_ids", "meta_info"} with logprobs as
(logprob, token_id, None) tuples (the third slot is upstream's optional token text).
"""

from __future__ import annotations

import time
from typing import Any

from sglang.srt.managers.io_struct import ReqOutput


def _tuples(logprobs: list[float], ids: list[int]) -> list[tuple]:
    return [(lp, tid, None) for lp, tid in zip(logprobs, ids)]


def _top_tuples(tops: list[list[tuple[float, int]]]) -> list[list[tuple]]:
    return [[(lp, tid, None) for lp, tid in row] for row in tops]


class RequestState:
    def __init__(self, rid: str, input_ids: list[int], logprob_start_len: int = -1) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.logprob_start_len = logprob_start_len
        self.text = ""
        self.output_ids: list[int] = []
        self.created = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None  # when the latest output tokens arrived
        self.prev_token_time: float | None = None  # when the ones before them arrived
        self.finished = False
        self.meta: dict[str, Any] = {"id": rid, "finish_reason": None, "prompt_tokens": len(input_ids),
                                     "completion_tokens": 0, "cached_tokens": 0}

    def apply(self, out: ReqOutput, text_delta: str) -> None:
        if out.new_token_ids:
            now = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = now
            self.prev_token_time, self.last_token_time = self.last_token_time, now
        self.output_ids += out.new_token_ids
        self.text += text_delta
        self.meta.update(prompt_tokens=out.prompt_tokens or self.meta["prompt_tokens"],
                         completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens)
        if out.output_token_logprobs is not None:
            self.meta.setdefault("output_token_logprobs", []).extend(
                _tuples(out.output_token_logprobs, out.new_token_ids))
            if out.output_top_logprobs:
                self.meta.setdefault("output_top_logprobs", []).extend(_top_tuples(out.output_top_logprobs))
        if out.input_token_logprobs is not None:
            self._set_input_logprobs(out)
        if out.spec_verify_ct:  # upstream's meta_info fields
            self.meta["spec_verify_ct"] = out.spec_verify_ct
            self.meta["spec_accept_length"] = out.completion_tokens / out.spec_verify_ct
        if out.hidden_states:
            self.meta.setdefault("hidden_states", []).extend(out.hidden_states)
        if out.finished_reason is not None:
            self.meta["finish_reason"] = out.finished_reason
            self.meta["e2e_latency"] = time.monotonic() - self.created
            self.finished = True

    def _set_input_logprobs(self, out: ReqOutput) -> None:
        start = max(self.logprob_start_len, 0)
        first = max(start, 1)  # token p is scored by position p - 1, so token 0 has no logprob
        ids = self.input_ids[first:]
        lps = _tuples(out.input_token_logprobs, ids)
        tops = _top_tuples(out.input_top_logprobs or [[] for _ in ids])
        if start == 0 and self.input_ids:
            lps = [(None, self.input_ids[0], None)] + lps
            tops = [None] + tops
        self.meta["input_token_logprobs"] = lps
        self.meta["input_top_logprobs"] = tops

    def result(self) -> dict:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": dict(self.meta)}
