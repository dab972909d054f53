"""Requests and batches as the scheduler sees them, and their lowering to a ForwardBatch.

KV bookkeeping of a request:
- `prefix_indices`: slots of the cached prefix owned by the prefix cache (locked via `last_node`);
- `kv_committed_len`: how many of `kv_token_ids()` have KV in `req_to_token[req_pool_idx]` that a
  processed step accepted. Positions [len(prefix_indices), kv_committed_len) are slots the request
  allocated itself.
- `kv_allocated_len`: positions with a slot in `req_to_token` (>= kv_committed_len): steps in flight
  (overlap) and rows a step computed but did not accept (speculative verify) lie in between. Pages
  wholly past kv_committed_len are freed once no step that writes them is in flight.
- `unprocessed_steps`: launched steps containing the request whose results are not processed yet; `epoch`
  counts retractions, so a result computed before a retraction is recognised as stale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams


class BaseFinishReason:
    def to_json(self) -> dict:
        raise NotImplementedError


@dataclass
class FINISH_MATCHED_TOKEN(BaseFinishReason):
    matched: int

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISH_MATCHED_STR(BaseFinishReason):
    matched: str

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


@dataclass
class FINISH_LENGTH(BaseFinishReason):
    length: int

    def to_json(self) -> dict:
        return {"type": "length", "length": self.length}


@dataclass
class FINISH_ABORT(BaseFinishReason):
    message: str = "aborted"
    status_code: int = 400

    def to_json(self) -> dict:
        return {"type": "abort", "message": self.message, "status_code": self.status_code}


class Req:
    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params: SamplingParams,
                 return_logprob: bool = False, logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 stream: bool = False, return_hidden_states: bool = False,
                 custom_logit_processor: str | None = None) -> None:
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.stream = stream
        # Structured outputs: the grammar key (kind, text), and the matcher (a Future while it
        # compiles in the grammar backend's pool; the request waits in the grammar queue then).
        self.grammar_key: tuple[str, str] | None = None
        self.grammar = None
        self.grammar_wait_start = 0.0
        self.custom_logit_processor = custom_logit_processor
        # The model's EOS ids (set by the scheduler): custom logit processors may read them.
        self.eos_token_ids: frozenset[int] = frozenset()

        self.req_pool_idx: int | None = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.unprocessed_steps = 0
        self.epoch = 0
        self.spec_verify_ct = 0  # decode steps that verified draft tokens (speculative decoding)
        self.extend_input_len = 0  # tokens in the current extend step
        self.is_chunked = False  # prefill not finished (more chunks to come)
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.finished_reason: BaseFinishReason | None = None
        self.to_abort: str | None = None

        self.input_token_logprobs: list[float] | None = None
        self.input_top_logprobs: list | None = None
        self.input_logprobs_sent = False
        self.pending_logprobs: list[float] = []
        self.pending_top_logprobs: list = []
        # return_hidden_states: positions whose hidden state was already returned, and the prompt
        # rows gathered over prefill chunks until the prompt is complete (sent as one block).
        self.return_hidden_states = return_hidden_states
        self.hidden_emitted = 0
        self.hidden_prompt_rows: list[list[float]] = []
        self.pending_hidden: list = []
        self.created_time = time.monotonic()
        self.first_token_time: float | None = None
        self.admitted = False
        # HiCache: prompt tokens already counted in its write-selective hit statistics.
        self.hicache_counted_len = 0
        # PD disaggregation (disaggregation/prefill.py, decode.py): the room naming the request on
        # both servers; prefill: its transfer registered by the decode server; decode: the prefill
        # server's bootstrap address, and its KV + first token arrived.
        self.bootstrap_room: int | None = None
        self.pd_registered = False
        self.pd_prefill_addr: str | None = None
        self.pd_done = False
        # A PD prefill server only computes the prompt's KV and first token: only an abort finishes
        # the request there, the decode server applies EOS / stop / length (check_finished).
        self.abort_only_stop_rules = False

    # The tokens whose KV this request can hold: the prompt, then outputs (the last output
    # token gets KV only when it is fed back in the next decode step).
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids()[start:end] without building the whole list."""
        n = len(self.origin_input_ids)
        if end <= n:
            return self.origin_input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.origin_input_ids[start:] + self.output_ids[: end - n]

    def kv_token_ids(self) -> list[int]:
        return self.fill_ids()

    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def max_prefix_len(self) -> int:
        """Longest cache hit allowed: one token must be computed to get logits; input logprobs
        must be computed from their start position on."""
        n = len(self.fill_ids()) - 1
        if self.return_hidden_states:
            return 0  # every prompt position's hidden state is computed, not read from the cache
        if self.return_logprob and self.logprob_start_len >= 0:
            # The logprob of token p comes from the logits at p - 1, which must be computed.
            n = min(n, max(self.logprob_start_len - 1, 0))
        return max(n, 0)

    def needs_host_sampling_state(self) -> bool:
        """Sampling this request needs host state of every earlier step (the grammar's matcher, the
        output ids for penalties and custom processors, the output count for min_new_tokens), so
        its next step cannot be prepared while the previous one is in flight."""
        sp = self.sampling_params
        return bool(self.grammar is not None or self.custom_logit_processor or sp.frequency_penalty
                    or sp.presence_penalty or sp.repetition_penalty != 1.0 or sp.min_new_tokens)

    def set_finish_with_abort(self, error_msg: str, status_code: int = 400) -> None:
        """Finish as an abort (upstream's name): what the grammar queue calls, so constrained/
        needs no finish-reason types."""
        self.finished_reason = FINISH_ABORT(error_msg, status_code)

    def reset_for_retract(self) -> None:
        self.req_pool_idx = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.is_chunked = False
        self.epoch += 1  # a result still in flight for the old KV is stale

    def check_finished(self, eos_token_ids: set[int], tokenizer=None) -> None:
        if self.finished():
            return
        if self.to_abort is not None:
            self.finished_reason = FINISH_ABORT(self.to_abort)
            return
        if self.abort_only_stop_rules:
            return
        sp = self.sampling_params
        if not self.output_ids:
            return
        last = self.output_ids[-1]
        n_out = len(self.output_ids)
        if self.grammar is not None and self.grammar.is_terminated():
            # The grammar accepted a stop token (upstream: matched = that token, an EOS).
            self.finished_reason = FINISH_MATCHED_TOKEN(last)
            return
        if n_out >= sp.min_new_tokens:
            if sp.stop_token_ids and last in sp.stop_token_ids:
                self.finished_reason = FINISH_MATCHED_TOKEN(last)
                return
            if not sp.ignore_eos and last in eos_token_ids:
                self.finished_reason = FINISH_MATCHED_TOKEN(last)
                return
            if sp.stop_strs and tokenizer is not None:
                window = getattr(sp, "stop_str_max_len", 0) or 0
                tail = tokenizer.decode(self.output_ids[-(window + 1):] if window else self.output_ids)
                for s in sp.stop_strs:
                    if s and s in tail:
                        self.finished_reason = FINISH_MATCHED_STR(s)
                        return
        if n_out >= sp.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(sp.max_new_tokens)


class ScheduleBatch:
    """A list of requests plus how to lower them to one forward.

    Rows: request i computes `extend_lens[i]` tokens on top of `prefix_lens[i]` cached ones. The
    first `num_extend_reqs` requests extend a prompt (prefill or a chunk of it); the rest decode,
    `extend_lens[i]` tokens each (1, or N when a speculative worker verifies N tokens). A decode
    row's input id is FUTURE_TOKEN: the worker reads it from the device token table.
    """

    def __init__(self, reqs: list[Req], forward_mode: ForwardMode, num_extend_reqs: int | None = None) -> None:
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.num_extend_reqs = (0 if forward_mode.is_decode() else len(reqs)) if num_extend_reqs is None \
            else num_extend_reqs
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.input_ids: list[int] = []
        self.out_cache_loc: torch.Tensor | None = None
        self.sampling_info = None
        self.req_epochs: list[int] = []  # each request's epoch at launch (see Req.epoch)

    def is_empty(self) -> bool:
        return not self.reqs

    def build_forward_batch(self, device: str, sampling_info=None) -> ForwardBatch:
        return_logprob = any(r.return_logprob for r in self.reqs)
        start_lens = []
        for r, pl in zip(self.reqs, self.prefix_lens):
            # First row (within this extend) whose logits score an input token: token p is
            # scored by row p - 1. Earlier chunks already covered rows before this chunk.
            if r.return_logprob and r.logprob_start_len >= 0 and not r.output_ids:
                start_lens.append(max(max(r.logprob_start_len, 1) - 1 - pl, 0))
            else:
                start_lens.append(-1)
        return ForwardBatch.build(
            self.forward_mode,
            self.input_ids,
            [r.req_pool_idx for r in self.reqs],
            self.prefix_lens,
            self.extend_lens,
            self.out_cache_loc,
            device=device,
            return_logprob=return_logprob,
            logprob_start_lens_cpu=start_lens,
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            sampling_info=sampling_info,
            capture_hidden_mode=(CaptureHiddenMode.FULL if any(r.return_hidden_states for r in self.reqs)
                                 else CaptureHiddenMode.NULL),
        )
