"""Typed messages between the tokenizer manager, the scheduler and the detokenizer.

One small dataclass per message; outputs carry deltas (new tokens / new text), not whole requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReqInput:
    rid: str  # the tokenizer manager's internal id, unique per request (not the client's reusable rid)
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned; -1 = none
    top_logprobs_num: int = 0
    stream: bool = False
    input_text: str | None = None
    return_hidden_states: bool = False
    custom_logit_processor: str | None = None  # CustomLogitProcessor.to_str(); needs the server flag
    # PD disaggregation (set by the router): the prefill server's bootstrap address and the room
    # (a random id) naming this request on both servers.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass
class AbortReq:
    rid: str  # internal id, as in TokenizedGenerateReqInput


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetLoadReq:
    pass


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_total_tokens: int
    kv_free_tokens: int  # in the allocator's free list
    kv_cached_tokens: int  # held by the prefix cache (evictable + protected)
    kv_protected_tokens: int  # locked by running requests
    cache_hit_rate: float
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_leak: str | None = None  # the idle-time invariant check (None = fine or busy)
    num_used_tokens: int = 0  # KV tokens held by requests (upstream's #token)
    gen_throughput: float = 0.0  # decode tokens/s over the last --decode-log-interval steps
    disaggregation: dict | None = None  # PD: transfer counters of a prefill / decode server
    avg_spec_accept_length: float = 0.0  # speculative decoding: tokens per request per verify step
    num_grammar_queue_reqs: int = 0  # of num_waiting_reqs, those waiting for their grammar to compile
    num_retracted_reqs: int = 0  # since start: requests a decode step that ran out of KV put back in the queue
    host_cached_tokens: int = 0  # HiCache: tokens whose KV has a committed host copy
    admission_stall: str | None = None  # why requests wait while nothing runs (the admission watchdog)
    # PD queues (upstream's gauges): prefill -- waiting for the decode side's preallocation, being sent;
    # decode -- waiting for KV memory, preallocated and waiting for the KV
    num_prefill_bootstrap_queue_reqs: int = 0
    num_prefill_inflight_queue_reqs: int = 0
    num_decode_prealloc_queue_reqs: int = 0
    num_decode_transfer_queue_reqs: int = 0


@dataclass
class ReqOutput:
    """What one scheduler step produced for one request (a delta)."""

    rid: str
    new_token_ids: list[int]
    finished_reason: dict | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[float] | None = None  # sent once, with the first output
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    # return_hidden_states: entries to append to meta_info["hidden_states"] (upstream's shape: the
    # prompt's rows as one [prompt_len][H] entry, then one [H] row per later token fed to the model)
    hidden_states: list | None = None
    spec_verify_ct: int = 0  # speculative decoding: verify steps the request took so far
    # Decoding settings the detokenizer needs (sent with every delta; small).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_strs: list[str] | None = None


@dataclass
class BatchTokenIDOut:
    outputs: list[ReqOutput] = field(default_factory=list)


@dataclass
class StrOutput:
    """A ReqOutput plus the text it adds (detokenized)."""

    text_delta: str
    out: ReqOutput


@dataclass
class BatchStrOut:
    outputs: list[StrOutput] = field(default_factory=list)
