"""The scheduler's third phase: turn a step's results into request state and outputs.

`Scheduler.step()` = get_next_batch_to_run() -> run_batch() (launch) -> process_batch_result().
The worker queues the step's device->host copies at launch (`BatchOutputCopy`: the sampled ids,
plus logprobs / hidden states when asked); `to_host()` waits for them and builds the host lists
everything here works on. A result may carry 0..N tokens per request (a speculative verify accepts
a run of draft tokens) and says how many of the step's KV rows to commit (`accept_lens`): tokens
are appended in order, the request stops at the first finishing one, exactly the accepted rows are
committed and the pages of the rest are freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sglang.srt.managers.io_struct import ReqOutput
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.utils.common import copies_done_event, to_host_async, upload


@dataclass
class GenerationBatchResult:
    next_token_ids: list[list[int]]  # per request: the new tokens of this step, in order
    # Per request: how many of its rows this step computed are accepted (their KV is committed);
    # None: all of them (plain workers).
    accept_lens: list[int] | None = None
    next_token_logprobs: list[list[float]] | None = None
    next_top_logprobs: list[list[list[tuple[float, int]]]] | None = None
    # Input (prompt) logprobs of extend rows, per request: [logprob], [[(val, id)]]
    input_token_logprobs: list[list[float]] = field(default_factory=list)
    input_top_logprobs: list[list[list[tuple[float, int]]]] = field(default_factory=list)
    # return_hidden_states, per request: (first position, rows) or None (not asked / nothing new)
    hidden_rows: list[tuple[int, list[list[float]]] | None] | None = None

    def to_host(self) -> "GenerationBatchResult":
        return self  # already host lists (workers that build results on the host)

    def _input_logprobs(self, batch: ScheduleBatch, fb, lo) -> None:
        counts = lo.input_logprob_counts or [0] * len(batch.reqs)
        flat = lo.input_token_logprobs.tolist() if lo.input_token_logprobs is not None else []
        tops = None
        if lo.input_top_logprobs_val is not None:
            tops = list(zip(lo.input_top_logprobs_val.tolist(), lo.input_top_logprobs_idx.tolist()))
        # Chunk boundaries: a chunk's last row scores the next chunk's first prompt token.
        boundary = [i for i, r in enumerate(batch.reqs)
                    if fb.logprob_start_lens_cpu[i] >= 0 and batch.prefix_lens[i] + batch.extend_lens[i]
                    < len(r.origin_input_ids)]
        bvals: dict[int, tuple[float, list]] = {}
        if boundary:
            rows = torch.tensor(boundary, device=lo.next_token_logits.device)
            lp = torch.log_softmax(lo.next_token_logits[rows].float(), dim=-1)
            nxt = [batch.reqs[i].fill_ids()[batch.prefix_lens[i] + batch.extend_lens[i]] for i in boundary]
            vals = lp.gather(1, torch.tensor(nxt, device=lp.device)[:, None]).squeeze(1).tolist()
            kmax = max(batch.reqs[i].top_logprobs_num for i in boundary)
            tv = ti = None
            if kmax:
                tv, ti = (x.tolist() for x in lp.topk(kmax, dim=-1))
            for j, i in enumerate(boundary):
                n = batch.reqs[i].top_logprobs_num
                bvals[i] = (vals[j], list(zip(tv[j][:n], ti[j][:n])) if n else [])
        off = 0
        for i, req in enumerate(batch.reqs):
            c = counts[i] if i < len(counts) else 0
            n = req.top_logprobs_num
            tok = flat[off : off + c]
            top = [list(zip(v[:n], t[:n])) for v, t in tops[off : off + c]] if tops is not None else []
            if i in bvals:
                tok = tok + [bvals[i][0]]
                top = top + ([bvals[i][1]] if n else [])
            self.input_token_logprobs.append(tok)
            self.input_top_logprobs.append(top)
            off += c


class BatchOutputCopy:
    """A launched step's outputs on their way to the host. The constructor only queues copies
    (no host sync, so the scheduler can prepare the next step meanwhile); `to_host()` waits for
    them (`copy_done`) and builds the GenerationBatchResult. Input logprobs, asked rarely, are
    computed in to_host."""

    def __init__(self, batch: ScheduleBatch, fb, logits_output, sample) -> None:
        self.batch, self.fb, self.logits_output, self.sample = batch, fb, logits_output, sample
        self.hidden = None
        if fb.capture_hidden_mode == CaptureHiddenMode.FULL and logits_output.hidden_states is not None:
            self.hidden = _start_hidden_copy(batch, logits_output.hidden_states)
        self.ids = to_host_async(sample.next_token_ids)
        self.logprobs = None
        if sample.next_token_logprobs is not None:
            self.logprobs = to_host_async(sample.next_token_logprobs)
        self.copy_done = copies_done_event(sample.next_token_ids)

    def to_host(self) -> GenerationBatchResult:
        if self.copy_done is not None:
            self.copy_done.synchronize()
        batch, fb, sample = self.batch, self.fb, self.sample
        res = GenerationBatchResult(next_token_ids=[[i] for i in self.ids.tolist()])
        if self.hidden is not None:
            host, spans = self.hidden
            res.hidden_rows = [None if s is None else (s[0], host[s[1]:s[2]].tolist()) for s in spans]
        if self.logprobs is not None:
            res.next_token_logprobs = [[v] for v in self.logprobs.tolist()]
            if sample.top_logprobs is not None:
                res.next_top_logprobs = [[list(zip(v, t))] for v, t in sample.top_logprobs.rows()]
        if fb.return_logprob and fb.forward_mode.is_extend():
            res._input_logprobs(batch, fb, self.logits_output)
        return res


def _start_hidden_copy(batch: ScheduleBatch, hidden_states: torch.Tensor):
    """Gather the rows of requests that asked for hidden states and were not returned before (a
    retracted request recomputes positions it already returned) and start their copy to the host.
    Returns (host tensor, per request (first position, start row, end row) or None)."""
    idx, spans, off = [], [], 0
    for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        skip = min(max(req.hidden_emitted - p, 0), e)
        if req.return_hidden_states and skip < e:
            spans.append((p + skip, len(idx), len(idx) + e - skip))
            idx.extend(range(off + skip, off + e))
        else:
            spans.append(None)
        off += e
    rows = hidden_states[upload(torch.tensor(idx, dtype=torch.int64), hidden_states.device)]
    return rows.float().to("cpu", non_blocking=True), spans


class SchedulerOutputProcessorMixin:
    """Result processing of `Scheduler` (kept apart so the scheduler module stays small)."""

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> list[ReqOutput]:
        """Apply one processed step. Under overlap the next step is already in flight: a request
        that finished (or was aborted) meanwhile ran one extra row there, whose token is dropped
        and whose KV is released when that step is processed; a request retracted meanwhile has a
        stale result here (its epoch changed), which is dropped."""
        outputs: list[ReqOutput] = []
        now = time.monotonic()
        wants_input = bool(result.input_token_logprobs)
        for i, req in enumerate(batch.reqs):
            req.unprocessed_steps -= 1
            if batch.req_epochs and batch.req_epochs[i] != req.epoch:
                continue  # retracted after launch: recomputed from its tokens later
            if req.finished():  # finished while this step ran: its extra row emits nothing
                if req.unprocessed_steps == 0 and req.req_pool_idx is not None:
                    self.cache_manager.release_req(req)
                continue
            rows = batch.extend_lens[i]
            accepted = rows if result.accept_lens is None else result.accept_lens[i]
            if not 0 <= accepted <= rows:
                raise RuntimeError(f"worker accepted {accepted} of {rows} rows for request {req.rid}")
            # The step's rows start at the committed length (a speculative step launched under
            # overlap learns its start on the device: the host's prefix_lens is its allocation).
            req.kv_committed_len += accepted
            if result.hidden_rows is not None and result.hidden_rows[i] is not None:
                _take_hidden_rows(req, *result.hidden_rows[i])
            if wants_input and req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
                if req.input_token_logprobs is None:
                    req.input_token_logprobs, req.input_top_logprobs = [], []
                req.input_token_logprobs += result.input_token_logprobs[i]
                req.input_top_logprobs += result.input_top_logprobs[i]
            if req.is_chunked and len(req.fill_ids()) > req.kv_committed_len:
                if self.chunked_req is not None and self.chunked_req is not req:
                    raise RuntimeError(f"two chunked requests at once ({self.chunked_req.rid}, {req.rid})")
                self.tree_cache.cache_unfinished_req(req)
                self.chunked_req = req
                continue
            req.is_chunked = False
            is_prefill = i < batch.num_extend_reqs
            if req.sampling_params.max_new_tokens == 0:
                # Prefill only (e.g. echo + prompt logprobs): the sampled token is not an output.
                req.finished_reason = FINISH_LENGTH(0)
                self.cache_manager.release_req(req)
                outputs.append(self._make_output(req, []))
                continue
            if not is_prefill and rows > 1:
                req.spec_verify_ct += 1
            new_ids = self._append_tokens(req, i, result)
            if req.return_hidden_states and req.finished():
                _drop_hidden_rows_past_the_end(req)
            if req.first_token_time is None:
                req.first_token_time = now
            # Rows past the tokens a finished request kept hold no token of it.
            req.kv_committed_len = min(req.kv_committed_len, len(req.fill_ids()))
            if req.finished():
                if not is_prefill:
                    self.running.remove(req)
                if req.unprocessed_steps == 0:
                    self.cache_manager.release_req(req)
            else:
                if accepted < rows:
                    # A later step in flight uses the window [committed, committed + its rows): keep it.
                    keep = req.kv_committed_len + req.unprocessed_steps * self.tp_worker.num_tokens_per_req
                    self.cache_manager.free_uncommitted_kv(req, keep)
                if is_prefill:
                    self.on_prefill_finished(req)
            outputs.append(self._make_output(req, new_ids))
        return outputs

    def _append_tokens(self, req: Req, i: int, result: GenerationBatchResult) -> list[int]:
        new_ids = []
        for j, tok in enumerate(result.next_token_ids[i]):
            req.output_ids.append(tok)
            new_ids.append(tok)
            if req.grammar is not None and not req.grammar.accept_token(tok):
                # Only a custom logit processor can override the mask: say so, do not crash.
                req.finished_reason = FINISH_ABORT(
                    f"token {tok} is not allowed by the request's {req.grammar_key[0]} grammar (a custom "
                    "logit processor or a banned EOS overrode the grammar mask)", 400)
            if req.return_logprob and result.next_token_logprobs is not None:
                req.pending_logprobs.append(result.next_token_logprobs[i][j])
                if req.top_logprobs_num and result.next_top_logprobs is not None:
                    req.pending_top_logprobs.append(result.next_top_logprobs[i][j])
            req.check_finished(self.eos_token_ids, self.tokenizer)
            if req.finished():
                if req.grammar is not None:
                    req.grammar.finished = True
                break
        return new_ids

    def _make_output(self, req: Req, new_ids: list[int]) -> ReqOutput:
        sp = req.sampling_params
        out = ReqOutput(
            rid=req.rid,
            new_token_ids=new_ids,
            finished_reason=req.finished_reason.to_json() if req.finished_reason else None,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            no_stop_trim=sp.no_stop_trim,
            stop_strs=sp.stop_strs or None,
            spec_verify_ct=req.spec_verify_ct,
        )
        if req.return_hidden_states and req.pending_hidden:
            out.hidden_states, req.pending_hidden = req.pending_hidden, []
        if req.return_logprob:
            out.output_token_logprobs, req.pending_logprobs = req.pending_logprobs, []
            out.output_top_logprobs, req.pending_top_logprobs = req.pending_top_logprobs, []
            if not req.input_logprobs_sent and req.input_token_logprobs is not None and (new_ids or req.finished()):
                out.input_token_logprobs = req.input_token_logprobs
                out.input_top_logprobs = req.input_top_logprobs
                req.input_logprobs_sent = True
        return out


def _drop_hidden_rows_past_the_end(req: Req) -> None:
    """A verify that accepted rows past the token a request finished on computed positions plain
    decoding never feeds: keep the rows of positions < len(fill_ids) - 1 (the last token is never
    fed back), as plain decoding returns."""
    surplus = req.hidden_emitted - (len(req.fill_ids()) - 1)
    if surplus > 0 and len(req.pending_hidden) >= surplus:
        del req.pending_hidden[-surplus:]
        req.hidden_emitted -= surplus


def _take_hidden_rows(req: Req, first_pos: int, rows: list[list[float]]) -> None:
    """Queue hidden-state rows for the request's next output in upstream's shape: the prompt's
    rows as one block once the whole prompt is computed (chunks gather first), then one row per
    later position (each generated token fed back)."""
    n_prompt = len(req.origin_input_ids)
    for k, row in enumerate(rows):
        (req.hidden_prompt_rows if first_pos + k < n_prompt else req.pending_hidden).append(row)
    req.hidden_emitted = first_pos + len(rows)
    if req.hidden_prompt_rows and req.hidden_emitted >= n_prompt:
        req.pending_hidden.insert(0, req.hidden_prompt_rows)
        req.hidden_prompt_rows = []
