"""EAGLEWorker: speculative decoding with the checkpoint's NextN / MTP layer as the draft.

Behind the scheduler's worker seam (managers/tp_worker.py). Target and draft share the request ->
token slot map and the allocator (one memory plan); each has its own KV pool, the draft's with its
own NSA index-K buffer. A chain of `num_steps` drafts (topk 1) is verified in one target forward.

Positions: at a decode step the target has KV for positions [0, c) of a request and its last token
x (fill[c]) is on the device (the token table); the draft has KV for [0, c) too, and its proposal
d1 for position c + 1 plus its last hidden state are kept per request slot. The scheduler
allocates N = num_steps + 1 rows, positions [c, c + N).
1. draft: d2..dS from S - 1 one-layer decode steps at positions c .. c + S - 2 (its own pool;
   replayed from CUDA graphs of `draft_decode_spec` on GPUs);
2. verify: the target computes [x, d1..dS] at positions c .. c + S -- decode-shaped, a row per
   token over the request's slot (`target_verify_spec`) -- and picks a token per row (the
   request's own sampler: greedy argmax, or a draw with the seed step plain decoding would use);
   a = leading rows whose draft equals the target's pick; the step produces those a + 1 picks
   and commits a + 1 rows (`accept_lens`); the scheduler frees the pages of the rest;
3. draft extend: the draft recomputes positions c .. c + S from the target's hidden states and
   its picks, and takes the next step's d1 from row a (rows past a are rewritten by the next
   step before anything reads them). c lives on the device (`kv_len`), so nothing of a step is
   read back before `to_host` and the overlap scheduler launches the next step meanwhile.
   Under prefill CP the step is host-synchronous instead (`_decode_cp`).
Every produced token is the target's own pick given exactly the tokens before it, so greedy
output equals plain decoding, and sampling keeps the target's distribution: accepting the draft d
exactly when it equals the target's draw is rejection sampling for a deterministic (argmax) draft
-- accepted with probability p(d), else a draw from p without d -- so the acceptance rate is the
same as upstream's target-only verify. Requests whose sampling needs host state of each step
(grammars, penalties, custom processors, min_new_tokens) make their batch verify one row per
request (no drafts).

IndexCache: with sharing on, the target's last layer hands its top-k of the rows the draft extends
(`LogitsProcessorOutput.topk_indices`); the draft layer reuses it and only stores its own index K
(its decode steps score for themselves over that index K).

Prefill CP: the target's prefill returns its hidden states / top-k in the rank's own layout
(CaptureHiddenMode.FULL_LOCAL) and the draft extends the same batch, split the same way, from
them: no rank materialises the full hidden states (unless a request of the batch returns them:
then they are gathered and the draft extend follows the pages' owners), and the draft writes only the rank's pages of
its own pool (SGLANG_CP_DRAFT_SHARED_KV_DEBUG=1 logs it). Forwards over rows a verify allocated
(draft steps, the accepted rows) follow those rows' pages (`cp.split_by_slot_owner`). A draft
cache-hit extend is computed like any extend over the full cached context (this backend has no
partial current-KV reuse to disable), and nothing is prefetched for a next layer.
"""

from __future__ import annotations

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.errors import ServerArgsError
from sglang.srt.layers.sampler import Sampler
from sglang.srt.managers.overlap_utils import FUTURE_TOKEN, Pending
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler_output_processor import BatchOutputCopy, GenerationBatchResult
from sglang.srt.managers.tp_worker import BaseTpWorker, ReqState, TpModelWorker
from sglang.srt.mem_cache.memory_pool import KVCache
from sglang.srt.model_executor.cuda_graph_runner import GraphSpec, StaticInput
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    CPBatchInfo,
    ForwardBatch,
    ForwardMode,
    SpecInput,
)
from sglang.srt.model_executor.memory_plan import draft_memory_needs
from sglang.srt.model_executor.model_runner import ModelRunner, kv_bytes_per_token
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.adaptive import AdaptiveDrafting
from sglang.srt.speculative.token_map import HotTokenHead, draft_token_ids, load_token_map
from sglang.srt.utils.common import copies_done_event, to_host_async, upload


def draft_model_config(server_args: ServerArgs) -> ModelConfig:
    """The draft's config: the MTP layer of --speculative-draft-model-path (default: the target)."""
    sa = server_args
    path = sa.speculative_draft_model_path or sa.model_path
    mc = ModelConfig(path, sa.dtype, sa.context_length, sa.json_model_override_args, sa.trust_remote_code,
                     is_draft_model=True)
    if int(getattr(mc.hf_config, "num_nextn_predict_layers", 0) or 0) < 1:
        flag = "speculative_draft_model_path" if sa.speculative_draft_model_path else "speculative_algorithm"
        raise ServerArgsError(flag, f"--speculative-algorithm {sa.speculative_algorithm} drafts with the checkpoint's "
                              f"MTP (NextN) layer, but {path} has none (num_nextn_predict_layers = 0); give "
                              "--speculative-draft-model-path a checkpoint that has one")
    return mc


def target_verify_spec(model_config: ModelConfig, num_tokens_per_req: int) -> GraphSpec:
    """The target's verify as a CUDA-graph spec. A verify of n rows per request runs decode-shaped:
    row j of a request is a one-token "request" at position c + j over the same request slot, so
    every row stores its KV (and index K) before any row attends, and row j sees exactly
    positions <= c + j -- the decode kernels and their graphs, keyed by rows (= bs * n). Outputs:
    every row's logits, hidden states and (IndexCache sharing on) the top-k for the draft."""
    sched = model_config.index_layer_schedule
    topk = ("topk_indices",) if sched is not None and sched.shares else ()
    return GraphSpec("target_verify", ForwardMode.DECODE, 1, extra_outputs=("hidden_states", *topk),
                     capture_hidden_mode=CaptureHiddenMode.FULL, batch_scale=num_tokens_per_req)


def draft_decode_spec(draft_config: ModelConfig) -> GraphSpec:
    """The draft's decode step as a CUDA-graph spec: one token per request, the previous step's
    hidden state as a static input, its own last hidden state as an extra output."""
    hidden = draft_config.hf_config.hidden_size
    return GraphSpec("draft_decode", ForwardMode.DECODE, 1,
                     extra_inputs=(StaticInput("spec.hidden_states", (hidden,), draft_config.dtype),),
                     extra_outputs=("hidden_states",), capture_hidden_mode=CaptureHiddenMode.LAST)


class EAGLEWorker(BaseTpWorker):

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig,
                 tp_group: GroupCoordinator = SINGLE_GROUP) -> None:
        sa = server_args
        self.num_steps = sa.speculative_num_steps
        self.num_tokens_per_req = self.num_steps + 1
        self.draft_config = draft_model_config(sa)
        # The target's decode steps are all verifies (or one-row steps with hidden capture): its
        # graphs are the verify spec's.
        # The draft is built after the target planned the memory they share: its weights and
        # graphs are in the target's plan.
        draft_weights, draft_graphs = (draft_memory_needs(self.draft_config, sa, tp_group) if sa.device == "cuda"
                                       else (0, 0))
        self.target = TpModelWorker(sa, model_config, tp_group,
                                    extra_kv_bytes_per_token=kv_bytes_per_token(self.draft_config, sa),
                                    graph_specs=(target_verify_spec(model_config, self.num_tokens_per_req),),
                                    extra_weight_bytes=draft_weights, extra_reserve_bytes=draft_graphs)
        t = self.target.model_runner
        self.device = sa.device
        # FR-Spec: the draft projects onto the hot tokens only (swapped in before graph capture).
        self.hot_token_id = None
        hook = None
        if sa.speculative_token_map is not None:
            self.hot_token_id = load_token_map(sa.speculative_token_map, model_config.vocab_size).to(self.device)

            def hook(model) -> None:
                model.lm_head = HotTokenHead.from_lm_head(model.lm_head, self.hot_token_id)
        # The draft's decode steps replay CUDA graphs of their own spec (hidden states in and out).
        self.draft_runner = ModelRunner(self.draft_config, sa, tp_group,
                                        req_to_token_pool=t.req_to_token_pool,
                                        token_to_kv_pool_allocator=t.token_to_kv_pool_allocator,
                                        max_total_num_tokens=t.max_total_num_tokens,
                                        graph_specs=(draft_decode_spec(self.draft_config),), model_hook=hook)
        self.cp = t.cp_group is not None
        # Overlap: a step's positions come from the device (kv_len), except under CP, whose split
        # and views are planned on the host from exact lengths.
        self.supports_overlap = not self.cp
        slots = t.req_to_token_pool.size + 1
        self.kv_len = torch.zeros(slots, dtype=torch.int64, device=self.device)  # committed KV per slot
        self.next_draft = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.draft_hidden = torch.zeros(slots, self.draft_config.hf_config.hidden_size, dtype=model_config.dtype,
                                        device=self.device)
        self.sampler = Sampler()
        self.vocab_size = model_config.vocab_size
        # Test hook: fn(reqs, drafts [B, S], committed KV lengths) -> drafts to verify instead
        # (forcing right / wrong drafts; testing/spec_drafts.py).
        self.draft_override = None
        self.num_verify_steps = 0
        self.num_accepted_drafts = 0
        self.adaptive = AdaptiveDrafting() if sa.speculative_adaptive else None

    # -- what the scheduler reads (the target's) ----------------------------------------------------
    model_runner = property(lambda self: self.target.model_runner)
    world_group = property(lambda self: self.target.world_group)
    token_table = property(lambda self: self.target.token_table)
    req_to_token_pool = property(lambda self: self.target.req_to_token_pool)
    token_to_kv_pool_allocator = property(lambda self: self.target.token_to_kv_pool_allocator)
    max_total_num_tokens = property(lambda self: self.target.max_total_num_tokens)
    max_running_requests = property(lambda self: self.target.max_running_requests)

    @property
    def avg_accept_length(self) -> float:
        """Tokens produced per request per verify step (upstream's spec_accept_length)."""
        return 1.0 + self.num_accepted_drafts / self.num_verify_steps if self.num_verify_steps else 0.0

    def shutdown(self) -> None:
        self.target.shutdown()

    def kv_pools(self) -> dict[str, KVCache]:
        return {"target": self.model_runner.token_to_kv_pool, "draft": self.draft_runner.token_to_kv_pool}

    def export_req_state(self, slot: int) -> ReqState:
        """PD: the first proposal d1 and the draft's last hidden state of a prefilled request."""
        hidden = self.draft_hidden[slot].detach().to("cpu").contiguous()
        return int(self.next_draft[slot]), hidden.view(torch.uint8).numpy().tobytes()

    def import_req_state(self, slot: int, kv_len: int, state: ReqState | None) -> None:
        if state is None:
            raise RuntimeError("the prefill server sent no draft state: --speculative-algorithm must match on both")
        draft, raw = state
        hidden = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.draft_hidden.dtype)
        self.kv_len[slot] = kv_len
        self.next_draft[slot] = draft
        self.draft_hidden[slot] = hidden.to(self.draft_hidden.device)

    def needs_host_state(self, req: Req) -> bool:
        """Besides what any request's sampling needs: a seeded draw's step counts the tokens the
        step in flight accepts, known on the host only after it. (An adaptive step without drafts
        is device-resident like a speculative one: it overlaps.)"""
        sp = req.sampling_params
        return sp.sampling_seed is not None and sp.temperature > 0

    def forward_batch_generation(self, batch: ScheduleBatch) -> Pending:
        if batch.forward_mode == ForwardMode.DECODE:
            drafts = self.adaptive is None or self.adaptive.on_step()
            if any(r.needs_host_sampling_state() for r in batch.reqs) or (self.cp and not drafts):
                return Pending(value=self._decode_without_drafts(batch))
            return Pending(value=self._decode_cp(batch) if self.cp else self._decode(batch, drafts))
        return Pending(value=self._extend(batch))

    # -- prefill --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _extend(self, batch: ScheduleBatch) -> BatchOutputCopy:
        t = self.target
        fb = t.build_forward_batch(batch)
        # Under prefill CP the draft extends from the rank's own rows (FULL_LOCAL: no gather),
        # unless a request returns its prompt's hidden states: then every row is gathered (the
        # requests' order) and the draft follows the pages' owners instead.
        gather = self.cp and _wants_hidden(batch.reqs)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL if gather else CaptureHiddenMode.FULL_LOCAL
        lo = t.model_runner.forward(fb)
        sample = t.model_runner.sample(lo, fb)
        t.token_table.store(fb.req_pool_indices, sample.next_token_ids)
        self.kv_len[fb.req_pool_indices] = fb.seq_lens
        # Draft row j pairs the target's hidden state at j with the token at j + 1: the next prompt
        # token, or for a request's last row the token just sampled (read from the token table).
        ids = []
        for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            ids += req.fill_slice(p + 1, p + e)
            ids.append(FUTURE_TOKEN if p + e >= len(req.fill_ids()) else req.fill_ids()[p + e])
        # The same batch split the same way: under CP each rank's target rows feed its draft rows.
        self._draft_extend(batch.reqs, batch.prefix_lens, batch.extend_lens, ids, lo.hidden_states,
                           lo.topk_indices, batch.out_cache_loc, rows_local=not gather)
        if _wants_hidden(batch.reqs):
            fb.capture_hidden_mode = CaptureHiddenMode.FULL  # every prompt row to return, as plain prefill
        return BatchOutputCopy(batch, fb, lo, sample)

    def _set_host_ids(self, fb: ForwardBatch) -> None:
        """CP re-lays a batch out from its host rows: give it the ids resolved on the device."""
        if self.cp:
            fb.host_rows["input_ids"] = fb.input_ids.cpu()

    def _draft_extend(self, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int], ids,
                      hidden: torch.Tensor, topk: torch.Tensor | None, out_cache_loc: torch.Tensor,
                      rows_local: bool = False) -> None:
        """`topk`: the target's last-layer top-k of these rows (IndexCache sharing on), which the
        draft layer reuses. `rows_local`: hidden / top-k are in this rank's CP layout, from the
        target's forward of this very batch (so the same split); otherwise the rows are part of
        a verify's and follow its pages (cp.split_by_slot_owner)."""
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [r.req_pool_idx for r in reqs], prefix_lens, extend_lens,
                                out_cache_loc, device=self.device, capture_hidden_mode=CaptureHiddenMode.LAST,
                                spec=SpecInput(hidden, topk, rows_local),
                                cp=CPBatchInfo(split_by_slot_owner=not rows_local))
        fb.input_ids = self.token_table.resolve(fb.input_ids, fb.req_pool_indices[fb.token_to_req])
        self._set_host_ids(fb)
        self._keep_draft_state(fb.req_pool_indices, self.draft_runner.forward(fb))

    def _keep_draft_state(self, slots: torch.Tensor, lo) -> None:
        """The next step's first draft and the draft's hidden state, from its forward's last rows."""
        self.next_draft[slots] = draft_token_ids(lo.next_token_logits, self.hot_token_id)
        self.draft_hidden[slots] = lo.hidden_states.to(self.draft_hidden.dtype)

    def _draft_decode_row(self, fb: ForwardBatch, next_ids: torch.Tensor, lo) -> None:
        """The draft's catch-up on a step without drafts: row r pairs the target's hidden state at
        position c (fb's decode row) with the token just sampled there, as a draft extend of one
        row would, but decode-shaped (the draft_decode graph; with IndexCache sharing the target's
        top-k rides along and the row runs eagerly, as the verify's draft extend does)."""
        dfb = ForwardBatch.build_decode_rows(next_ids.to(torch.int64), fb.req_pool_indices, fb.positions,
                                             fb.out_cache_loc, list(fb.seq_lens_cpu),
                                             capture_hidden_mode=CaptureHiddenMode.LAST,
                                             spec=SpecInput(lo.hidden_states, lo.topk_indices))
        self._keep_draft_state(fb.req_pool_indices, self.draft_runner.forward(dfb))

    # -- decode ---------------------------------------------------------------------------------------
    def _row_sampling_info(self, reqs: list[Req], n: int) -> SamplingBatchInfo:
        """One row per verified position: row j of a request draws with the seed step plain
        decoding would use for that token (exact when the request's output is known on the host:
        seeded requests keep the scheduler from overlapping, `needs_host_state`)."""
        return SamplingBatchInfo.from_params(
            [r.sampling_params for r in reqs for _ in range(n)], self.vocab_size, self.device,
            output_ids=[r.output_ids for r in reqs for _ in range(n)],
            seeds_step=[len(r.output_ids) + j for r in reqs for j in range(n)])

    def _draft_chain(self, reqs: list[Req], slots: torch.Tensor, chain_batch, kv_lens) -> torch.Tensor:
        """[B, S] drafts: d1 from the last draft extend, d2..dS from S - 1 one-row draft steps;
        `chain_batch(k, ids, hidden)` builds step k's batch, `kv_lens` ([b] on the device) are the
        committed KV lengths the draft_override test hook reads (on the device: no host sync)."""
        drafts, hidden = [self.next_draft[slots]], self.draft_hidden[slots]
        for k in range(1, self.num_steps):
            lo = self.draft_runner.forward(chain_batch(k, drafts[-1], hidden))
            drafts.append(draft_token_ids(lo.next_token_logits, self.hot_token_id))
            hidden = lo.hidden_states
        drafts = torch.stack(drafts, dim=1)
        if self.draft_override is not None:
            drafts = self.draft_override(reqs, drafts, kv_lens).to(drafts)
        return drafts

    def _sample_verify(self, reqs: list[Req], logits: torch.Tensor, drafts: torch.Tensor, slots: torch.Tensor):
        """Each verified row's pick (the request's own sampler), the accepted draft count per request
        (leading drafts equal to the target's picks) and the last accepted token into the table.
        `drafts` [b, n - 1]: n rows per request (n = 1: a step without drafts)."""
        n = drafts.shape[1] + 1
        want_lp = any(r.return_logprob for r in reqs)
        nums = [r.top_logprobs_num for r in reqs for _ in range(n)]
        sample = self.sampler(logits, self._row_sampling_info(reqs, n), want_lp, nums if want_lp else None)
        picks = sample.next_token_ids.view(len(reqs), n)
        accepted = (drafts == picks[:, : n - 1]).int().cumprod(dim=1).sum(dim=1)
        self.token_table.store(slots, picks.gather(1, accepted[:, None]).squeeze(1))
        return sample, picks, accepted

    @torch.inference_mode()
    def _decode(self, batch: ScheduleBatch, drafting: bool = True) -> "SpecDecodeOutput":
        """One speculative step, static-shaped and device-resident: positions come from the
        request's committed KV length on the device (`kv_len`), so the step can be launched before
        the previous step's acceptance reaches the host (overlap). Every forward is decode-shaped
        (one row per token over the request's slot); nothing is read back until `to_host`.
        `drafting` False (--speculative-adaptive off): no draft chain, one verified row per
        request (the target's own decode row) and the draft's row over it -- the same graphs."""
        reqs, b = batch.reqs, len(batch.reqs)
        n_alloc = self.num_tokens_per_req  # KV slots the scheduler allocated per request
        n = n_alloc if drafting else 1
        dev = self.device
        slots = upload(torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64), dev)
        r2t = self.req_to_token_pool
        r2t.flush_writes()  # this step's rows, before the device gathers them
        base = self.kv_len[slots]  # [b] committed KV length c: row j sits at position c + j
        pos = base[:, None] + torch.arange(n, device=dev)[None, :]  # [b, n]
        loc = r2t.req_to_token[slots[:, None], pos].long()  # [b, n] KV slots the scheduler allocated
        bound = [p + n_alloc for p in batch.prefix_lens]  # host: allocation start >= c, so c + n <= bound

        # 1. draft chain (step k at position c + k - 1)
        def chain_batch(k: int, ids: torch.Tensor, hidden: torch.Tensor) -> ForwardBatch:
            return ForwardBatch.build_decode_rows(ids, slots, pos[:, k - 1], loc[:, k - 1],
                                                  [x - n_alloc + k for x in bound],
                                                  capture_hidden_mode=CaptureHiddenMode.LAST, spec=SpecInput(hidden))

        drafts = (self._draft_chain(reqs, slots, chain_batch, base) if drafting
                  else torch.empty((b, 0), dtype=torch.int64, device=dev))
        # 2. verify [x, d1..dS] (target_verify_spec: CUDA graphs)
        ids = torch.cat([self.token_table.table[slots][:, None], drafts], dim=1).reshape(-1)
        rows = slots.repeat_interleave(n)
        row_bounds = [x - n_alloc + j + 1 for x in bound for j in range(n)]
        fb = ForwardBatch.build_decode_rows(ids, rows, pos.reshape(-1), loc.reshape(-1), row_bounds,
                                            capture_hidden_mode=CaptureHiddenMode.FULL)
        lo = self.target.model_runner.forward(fb)
        sample, picks, accepted = self._sample_verify(reqs, lo.next_token_logits, drafts, slots)
        # 3. draft extend over all n rows (row j: the target's hidden at c + j with its pick, the
        # token at c + j + 1); only rows <= accepted matter -- the rest are rewritten by the next
        # step before anything reads them -- and the next d1 / hidden come from row `accepted`.
        fb = ForwardBatch.build_decode_rows(picks.reshape(-1), rows, pos.reshape(-1), loc.reshape(-1), row_bounds,
                                            capture_hidden_mode=CaptureHiddenMode.LAST,
                                            spec=SpecInput(lo.hidden_states, lo.topk_indices))
        if n > 1:  # (one row per request: every row is the last, and the draft's decode graph runs it)
            fb.logits_row_indices = torch.arange(b, device=dev) * n + accepted
        self._keep_draft_state(slots, self.draft_runner.forward(fb))
        self.kv_len[slots] = base + accepted + 1
        return SpecDecodeOutput(self, batch, n, picks, accepted, sample, lo.hidden_states)

    @torch.inference_mode()
    def _decode_cp(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """The step under prefill CP (no overlap): the verify is one extend per request (a
        decode-shaped verify would all-gather each request's context once per row) and the draft
        extends the accepted rows only, so the host reads the acceptance mid-step."""
        reqs, n, b = batch.reqs, self.num_tokens_per_req, len(batch.reqs)
        slots = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=self.device)
        loc = batch.out_cache_loc.view(b, n)
        rows = [r.req_pool_idx for r in reqs]

        def chain_batch(k: int, ids: torch.Tensor, hidden: torch.Tensor) -> ForwardBatch:
            fb = ForwardBatch.build(ForwardMode.DECODE, ids, rows, [c + k - 1 for c in batch.prefix_lens], [1] * b,
                                    loc[:, k - 1], device=self.device, capture_hidden_mode=CaptureHiddenMode.LAST,
                                    spec=SpecInput(hidden), cp=CPBatchInfo(split_by_slot_owner=True))
            self._set_host_ids(fb)
            return fb

        drafts = self._draft_chain(reqs, slots, chain_batch,
                                   upload(torch.tensor(batch.prefix_lens, dtype=torch.int64), self.device))
        ids = torch.cat([self.token_table.table[slots][:, None], drafts], dim=1).reshape(-1)
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, rows, batch.prefix_lens, [n] * b, batch.out_cache_loc,
                                device=self.device, return_all_logits=True, capture_hidden_mode=CaptureHiddenMode.FULL)
        self._set_host_ids(fb)
        lo = self.target.model_runner.forward(fb)
        sample, picks, accepted = self._sample_verify(reqs, lo.full_logits, drafts, slots)
        acc = accepted.tolist()  # the next draft extend's shape depends on it
        keep_host = torch.tensor([i * n + j for i, a in enumerate(acc) for j in range(a + 1)], dtype=torch.int64)
        keep = upload(keep_host, self.device)
        topk = lo.topk_indices[keep] if lo.topk_indices is not None else None
        self._draft_extend(reqs, batch.prefix_lens, [a + 1 for a in acc], picks.reshape(-1)[keep],
                           lo.hidden_states[keep], topk, batch.out_cache_loc[keep_host])  # KV slots: host
        self.kv_len[slots] = torch.tensor(batch.prefix_lens, device=self.device) + accepted + 1
        return SpecDecodeOutput(self, batch, n, picks, accepted, sample, lo.hidden_states).to_host()

    @torch.inference_mode()
    def _decode_without_drafts(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """One row per request through the scheduler's own sampling info (grammar masks, penalties,
        custom processors), then the draft catches up on that row."""
        reqs, n, b, t = batch.reqs, self.num_tokens_per_req, len(batch.reqs), self.target
        one = ScheduleBatch(reqs, ForwardMode.DECODE)
        one.prefix_lens, one.extend_lens = batch.prefix_lens, [1] * b
        one.out_cache_loc = batch.out_cache_loc.view(b, n)[:, 0].contiguous()
        one.input_ids, one.sampling_info = [FUTURE_TOKEN] * b, batch.sampling_info
        fb = t.build_forward_batch(one)
        fb.cp.split_by_slot_owner = True  # row 0 of each request's verify allocation
        t.resolve_input_ids(fb)
        fb.capture_hidden_mode = CaptureHiddenMode.FULL
        lo = t.model_runner.forward(fb)
        sample = t.model_runner.sample(lo, fb)
        t.token_table.store(fb.req_pool_indices, sample.next_token_ids)
        if self.cp:  # the draft's rows follow the pages' owners: an extend planned on the host
            self._draft_extend(reqs, one.prefix_lens, one.extend_lens, [FUTURE_TOKEN] * b, lo.hidden_states,
                               lo.topk_indices, one.out_cache_loc)
        else:  # one decode row per request: the draft's decode graph replays it
            self._draft_decode_row(fb, sample.next_token_ids, lo)
        self.kv_len[fb.req_pool_indices] = fb.seq_lens
        self.num_verify_steps += b
        if not _wants_hidden(reqs):
            fb.capture_hidden_mode = CaptureHiddenMode.NULL  # hidden states were for the draft only
        res = BatchOutputCopy(one, fb, lo, sample).to_host()
        res.accept_lens = [1] * b
        return res


def _wants_hidden(reqs: list[Req]) -> bool:
    return any(r.return_hidden_states for r in reqs)


class SpecDecodeOutput:
    """A speculative step's outputs on their way to the host: the constructor only queues the copies
    (picks, acceptance, logprobs, the verify's hidden states of requests that asked); `to_host()`
    waits for them and builds the result: per request the accepted drafts plus the target's own
    next token, accept_lens = accepted + 1, and the target's hidden state of each accepted row
    (row j was fed the request's token at position c + j: what plain decoding computes there)."""

    def __init__(self, worker: EAGLEWorker, batch: ScheduleBatch, n: int, picks: torch.Tensor, accepted: torch.Tensor,
                 sample, hidden_states: torch.Tensor | None = None) -> None:
        self.worker, self.batch, self.b, self.n = worker, batch, len(batch.reqs), n
        self.picks, self.accepted = to_host_async(picks), to_host_async(accepted)
        self.logprobs = to_host_async(sample.next_token_logprobs) if sample.next_token_logprobs is not None else None
        self.top_logprobs = sample.top_logprobs
        self.hidden_reqs = [i for i, r in enumerate(batch.reqs) if r.return_hidden_states]
        self.hidden = None
        if self.hidden_reqs and hidden_states is not None:
            want = torch.tensor(self.hidden_reqs, dtype=torch.int64).to(hidden_states.device, non_blocking=True)
            rows = hidden_states[: self.b * n].view(self.b, n, -1)  # (graph replays may pad the batch)
            self.hidden = to_host_async(rows[want].float())
        self.copy_done = copies_done_event(picks)

    def to_host(self) -> GenerationBatchResult:
        if self.copy_done is not None:
            self.copy_done.synchronize()
        acc, rows, n = self.accepted.tolist(), self.picks.tolist(), self.n
        # Acceptance statistics count the rows whose results apply: not a step launched (under
        # overlap) for a request that the step before it finished, nor one of a retracted request.
        batch = self.batch
        live = [i for i, r in enumerate(batch.reqs)
                if not r.finished() and not (batch.req_epochs and batch.req_epochs[i] != r.epoch)]
        accepted = sum(acc[i] for i in live)
        self.worker.num_verify_steps += len(live)
        self.worker.num_accepted_drafts += accepted
        if self.worker.adaptive is not None and self.n > 1:  # a step without drafts (one row) says nothing of them
            self.worker.adaptive.observe(accepted, len(live))
        res = GenerationBatchResult(next_token_ids=[rows[i][: a + 1] for i, a in enumerate(acc)],
                                    accept_lens=[a + 1 for a in acc])
        if self.hidden is not None:
            # The step's rows start at the committed length, which the host knows by now: the step
            # before this one was processed before this to_host (overlap or not).
            res.hidden_rows = [None] * self.b
            for k, i in enumerate(self.hidden_reqs):
                req = batch.reqs[i]
                res.hidden_rows[i] = (req.kv_committed_len, self.hidden[k, : acc[i] + 1].tolist())
        if self.logprobs is not None:
            lps = self.logprobs.view(self.b, n).tolist()
            res.next_token_logprobs = [lps[i][: a + 1] for i, a in enumerate(acc)]
            if self.top_logprobs is not None:
                tops = self.top_logprobs.rows()
                res.next_top_logprobs = [[list(zip(*tops[i * n + j])) for j in range(a + 1)]
                                         for i, a in enumerate(acc)]
        return res
