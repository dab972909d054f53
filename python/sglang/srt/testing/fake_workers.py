"""Workers for testing the scheduler's worker seam (not used by the server).

`RandomAcceptWorker` stands where a speculative worker will: decode batches give it N rows per
request, it accepts a random 0..N of them per request and says so in `accept_lens`. The accepted
tokens are the ones plain greedy decoding produces (it runs the real target one row at a time,
writing KV only into the rows it accepts), so a scheduler that commits exactly the accepted rows,
frees the rest and appends tokens right must reproduce plain decoding: tokens, logprobs, stop
strings, max_tokens, and radix-cache hits on that KV.
"""

from __future__ import annotations

import random

import torch

from sglang.srt.managers.overlap_utils import Pending
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler_output_processor import GenerationBatchResult
from sglang.srt.managers.tp_worker import BaseTpWorker, TpModelWorker
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo


class RandomAcceptWorker(BaseTpWorker):
    supports_overlap = False  # how many rows a step keeps is known only after it ran

    def __init__(self, inner: TpModelWorker, num_tokens_per_req: int, seed: int = 0) -> None:
        self.inner, self.num_tokens_per_req = inner, num_tokens_per_req
        self.world_group, self.model_runner, self.token_table = inner.world_group, inner.model_runner, inner.token_table
        self.rng = random.Random(seed)
        self.accepted_hist: list[int] = []  # every accept length chosen (tests check both ends occur)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def forward_batch_generation(self, batch: ScheduleBatch) -> Pending:
        if batch.forward_mode != ForwardMode.DECODE:
            return self.inner.forward_batch_generation(batch)
        return Pending(value=self._decode(batch))

    @torch.inference_mode()
    def _decode(self, batch: ScheduleBatch) -> GenerationBatchResult:
        n, reqs, mr = self.num_tokens_per_req, batch.reqs, self.inner.model_runner
        device = self.inner.device
        if any(e != n for e in batch.extend_lens):
            raise AssertionError(f"decode rows per request {batch.extend_lens} != {n}")
        ks = [self.rng.randint(0, n) for _ in reqs]
        self.accepted_hist += ks
        loc = batch.out_cache_loc.view(len(reqs), n)
        slots = torch.tensor([r.req_pool_idx for r in reqs], device=device)
        cur = self.inner.token_table.table[slots].clone()  # each request's last token
        tokens: list[list[int]] = [[] for _ in reqs]
        logprobs: list[list[float]] = [[] for _ in reqs]
        tops: list[list] = [[] for _ in reqs]
        want_lp = any(r.return_logprob for r in reqs)
        for j in range(max(ks, default=0)):
            idx = [i for i, k in enumerate(ks) if k > j]
            sub = [reqs[i] for i in idx]
            info = SamplingBatchInfo.from_params(
                [r.sampling_params for r in sub], mr.model_config.vocab_size, device,
                output_ids=[r.output_ids + tokens[i] for r, i in zip(sub, idx)])
            fb = ForwardBatch.build(
                ForwardMode.DECODE, cur[idx], [r.req_pool_idx for r in sub],
                [batch.prefix_lens[i] + j for i in idx], [1] * len(idx), loc[idx, j], device=device,
                return_logprob=want_lp, top_logprobs_nums=[r.top_logprobs_num for r in sub], sampling_info=info)
            out = mr.forward(fb)
            sample = mr.sample(out, fb)
            ids = sample.next_token_ids
            cur[idx] = ids
            for pos, i in enumerate(idx):
                tokens[i].append(int(ids[pos]))
                if sample.next_token_logprobs is not None:
                    logprobs[i].append(float(sample.next_token_logprobs[pos]))
                    if sample.top_logprobs is not None:
                        v, t = sample.top_logprobs.rows()[pos]
                        tops[i].append(list(zip(v, t)))
        self.inner.token_table.store(slots, cur)
        res = GenerationBatchResult(next_token_ids=tokens, accept_lens=ks)
        if want_lp:
            res.next_token_logprobs, res.next_top_logprobs = logprobs, tops
        return res
