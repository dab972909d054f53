"""Offline engine: `sglang.Engine(model_path=...).generate(prompts, sampling_params)`, and
`await engine.async_generate(...)` for asyncio code (upstream's two entry points).

Runs the scheduler in this process (no HTTP, no IPC) -- the same Scheduler class the server's
scheduler process runs -- and detokenizes with the same DecodeState. Every live request is
registered by id, and whichever caller steps the scheduler routes each step's outputs to their
requests (a text-delta queue each): concurrent async_generate tasks share the steps, none loses
another's tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Any, AsyncIterator, Iterator

from sglang.srt.configs.model_config import model_config_from_server_args
from sglang.srt.errors import ServerArgsError
from sglang.srt.managers.detokenizer_manager import DecodeState, push_batch
from sglang.srt.managers.io_struct import ReqOutput, TokenizedGenerateReqInput
from sglang.srt.managers.request_state import RequestState
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tokenizer_utils import load_tokenizer
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import configure_logger

logger = logging.getLogger(__name__)


class _Pending(RequestState):
    """A RequestState that detokenizes locally (the server does this in its detokenizer)."""

    def __init__(self, rid: str, decode: DecodeState, input_ids: list[int], logprob_start_len: int) -> None:
        super().__init__(rid, input_ids, logprob_start_len)
        self.decode = decode
        self.deltas: list[str] = []  # text deltas not yet taken by a stream

    def push(self, out: ReqOutput) -> str:
        return push_outputs([self], [out])[0]

    @property
    def done(self) -> bool:
        return self.finished


def push_outputs(pendings: list[_Pending], outs: list[ReqOutput]) -> list[str]:
    """Detokenize one step's outputs in a batch and apply them to their requests."""
    deltas = push_batch([p.decode for p in pendings], [o.new_token_ids for o in outs],
                        [o.finished_reason for o in outs])
    for p, o, d in zip(pendings, outs, deltas):
        p.apply(o, d)
    return deltas


def _results(pendings: list[_Pending], single: bool) -> dict | list[dict]:
    results = [p.result() for p in pendings]
    return results[0] if single else results


class Engine:
    def __init__(self, log_level: str = "error", **kwargs: Any) -> None:
        configure_logger(log_level)
        self.server_args = ServerArgs.from_kwargs(log_level=log_level, **kwargs).resolve()
        sa = self.server_args
        if sa.tp_size > 1:  # upstream's Engine spawns the ranks; this one is a single in-process rank
            raise ServerArgsError("tp_size", f"the offline Engine runs one rank in this process, got {sa.tp_size}: "
                                  "serve TP / CP / EP across GPUs with `python -m sglang.launch_server --tp-size N`")
        if sa.disaggregation_mode != "null":
            raise ServerArgsError("disaggregation_mode", "prefill / decode disaggregation needs the server "
                                  "(`python -m sglang.launch_server --disaggregation-mode ...`)")
        self.model_config = model_config_from_server_args(sa)
        self.tokenizer = load_tokenizer(sa.tokenizer_path, sa.trust_remote_code)
        self.scheduler = Scheduler(sa, self.model_config, self.tokenizer)
        self._ids = itertools.count()
        self._live: dict[str, _Pending] = {}  # rid -> unfinished request, whoever waits on it

    # -- requests ---------------------------------------------------------------------------------------
    def _submit(self, prompt: str | None, input_ids: list[int] | None, params: dict | SamplingParams | None,
                return_logprob: bool, logprob_start_len: int, top_logprobs_num: int,
                return_hidden_states: bool = False,
                custom_logit_processor: str | None = None) -> _Pending:
        sp = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(dict(params or {}))
        sp.normalize(self.tokenizer)
        sp.verify(self.model_config.vocab_size)
        if input_ids is None:
            if prompt is None:
                raise ValueError("either a prompt or input_ids is required")
            input_ids = self.tokenizer.encode(prompt)
        rid = f"engine-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        decode = DecodeState(self.tokenizer, sp.skip_special_tokens, sp.spaces_between_special_tokens,
                             sp.stop_strs, sp.no_stop_trim)
        pending = _Pending(rid, decode, list(input_ids), logprob_start_len)
        self._live[rid] = pending
        for out in self.scheduler.add_request(TokenizedGenerateReqInput(
                rid, list(input_ids), sp, return_logprob, logprob_start_len, top_logprobs_num,
                return_hidden_states=return_hidden_states, custom_logit_processor=custom_logit_processor)):
            pending.deltas.append(pending.push(out))
        if pending.done:
            self._live.pop(rid, None)
        return pending

    def _step(self, waiting: list[_Pending]) -> None:
        """One scheduler step; its outputs go to their requests, whoever waits on them."""
        outs = self.scheduler.step()
        if not outs and not self.scheduler.has_work() and any(not p.done for p in waiting):
            for p in waiting:
                self._live.pop(p.rid, None)
            raise RuntimeError("scheduler idle with unfinished requests")
        mine = [(self._live[o.rid], o) for o in outs if o.rid in self._live]
        if mine:
            for (p, _), d in zip(mine, push_outputs([p for p, _ in mine], [o for _, o in mine])):
                p.deltas.append(d)
                if p.done:
                    self._live.pop(p.rid, None)
        if not self._live:
            self.scheduler.finish_idle_step()  # results of finished requests only: nothing to route

    @staticmethod
    def _take(pendings: list[_Pending]) -> list[tuple[_Pending, str]]:
        """The text deltas the steps so far left for `pendings`, in order."""
        out = [(p, d) for p in pendings for d in p.deltas]
        for p in pendings:
            p.deltas.clear()
        return out

    def _run(self, pendings: list[_Pending]) -> Iterator[tuple[_Pending, str]]:
        while True:
            yield from self._take(pendings)
            if all(p.done for p in pendings):
                return
            self._step(pendings)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        return_hidden_states: bool = False,
        custom_logit_processor: str | list[str | None] | None = None,
    ):
        """Generate for one prompt (returns a dict) or a batch (returns a list of dicts).
        `custom_logit_processor`: CustomLogitProcessor.to_str() for every prompt or one per prompt
        (needs enable_custom_logit_processor=True); a grammar in sampling_params works as on /generate.

        Each result: {"text", "output_ids", "meta_info": {prompt_tokens, completion_tokens,
        cached_tokens, finish_reason, [input|output]_token_logprobs ...}}. With stream=True
        (single prompt), yields that dict after each step, the text so far in it (upstream's, as
        /generate's stream; sglang.utils.stream_and_merge joins the chunks).
        """
        pendings, single = self._make_requests(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                               top_logprobs_num, stream, return_hidden_states, custom_logit_processor)
        if stream:
            return self._stream(pendings[0])
        for _ in self._run(pendings):
            pass
        return _results(pendings, single)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        return_hidden_states: bool = False,
        custom_logit_processor: str | list[str | None] | None = None,
    ):
        """generate() for asyncio: the same arguments and results; with stream=True an async iterator
        of the result so far after each step. Concurrent calls share the scheduler's steps (each step serves
        every request in flight), yielding to the event loop between steps."""
        pendings, single = self._make_requests(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                               top_logprobs_num, stream, return_hidden_states, custom_logit_processor)
        if stream:
            return self._async_stream(pendings[0])
        async for _ in self._async_run(pendings):
            pass
        return _results(pendings, single)

    async def _async_run(self, pendings: list[_Pending]) -> AsyncIterator[tuple[_Pending, str]]:
        while True:
            for item in self._take(pendings):
                yield item
            if all(p.done for p in pendings):
                return
            self._step(pendings)
            await asyncio.sleep(0)  # other tasks submit and take their outputs between steps

    async def _async_stream(self, pending: _Pending) -> AsyncIterator[dict]:
        try:
            async for p, _ in self._async_run([pending]):
                yield p.result()
        finally:
            self._drop(pending)

    def _make_requests(self, prompt, sampling_params, input_ids, return_logprob: bool, logprob_start_len: int,
                       top_logprobs_num: int, stream: bool, return_hidden_states: bool,
                       custom_logit_processor) -> tuple[list[_Pending], bool]:
        """Validate generate()'s arguments and submit its requests: (pendings prompt-major, single)."""
        if prompt is not None and input_ids is not None:  # as /generate (and upstream's GenerateReqInput)
            raise ValueError("exactly one of prompt or input_ids is required, got both")
        single = isinstance(prompt, str) or (input_ids is not None and input_ids and isinstance(input_ids[0], int))
        prompts = [prompt] if isinstance(prompt, str) else prompt
        ids = [input_ids] if single and input_ids is not None else input_ids
        n = len(prompts) if prompts is not None else len(ids or [])
        if n == 0:
            raise ValueError("no prompts given")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        if return_hidden_states and not self.server_args.enable_return_hidden_states:
            raise ValueError("return_hidden_states needs enable_return_hidden_states=True")
        procs = custom_logit_processor if isinstance(custom_logit_processor, list) else [custom_logit_processor] * n
        if len(procs) != n:
            raise ValueError(f"{len(procs)} custom_logit_processor entries for {n} prompts")
        # sampling_params n > 1: n choices per prompt, prompt-major, answered as a list (as /generate)
        params = [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(dict(p or {})) for p in params]
        if stream and (n != 1 or params[0].n != 1):  # checked before any request is queued
            raise ValueError("stream=True takes a single prompt with n = 1")
        pendings: list[_Pending] = []
        try:
            for i in range(n):
                for j in range(params[i].n):
                    pendings.append(self._submit(prompts[i] if prompts else None, ids[i] if ids else None,
                                                 params[i].for_choice(j), return_logprob, logprob_start_len,
                                                 top_logprobs_num, return_hidden_states, procs[i]))
        except Exception:  # a bad request in the batch: the ones already queued leave with it
            for p in pendings:
                self.scheduler.abort_request(p.rid)
                self._live.pop(p.rid, None)
            raise
        return pendings, single and len(pendings) == 1

    def _stream(self, pending: _Pending) -> Iterator[dict]:
        try:
            for p, _ in self._run([pending]):
                yield p.result()
        finally:
            self._drop(pending)

    def _drop(self, pending: _Pending) -> None:
        """A stream its caller left early: the scheduler aborts the request at its next step (and
        frees its KV); its outputs reach no one."""
        if not pending.done:
            self._live.pop(pending.rid, None)
            self.scheduler.abort_request(pending.rid)

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache().success

    def shutdown(self) -> None:
        self.scheduler = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
