"""TpModelWorker: the only thing the scheduler calls to run a batch (upstream's name).

The worker owns the model runner(s) -- the target here; a speculative worker adds a draft runner
sharing the target's `ReqToTokenPool` + allocator -- the device token table and the launcher.
`forward_batch_generation(batch)` lowers a ScheduleBatch to a ForwardBatch (one upload), then
launches: resolve FUTURE_TOKEN input ids from the token table, forward, sample, store the sampled
ids back into the table, queue the device->host copies. It returns a `Pending` whose result has
`to_host() -> GenerationBatchResult`; nothing in the launch reads the device back, so the scheduler
prepares the next step while this one runs.

The contract every worker keeps (plain, speculative, test fakes) is `BaseTpWorker`: the scheduler,
HiCache and PD read only what it declares. Besides its members: the result's `accept_lens` says per
request how many of the step's rows to commit (None = all); after a step, the token table holds
each request's last accepted token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.managers.overlap_utils import INLINE_LAUNCHER, Launcher, LastTokenTable, Pending, make_launcher
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler_output_processor import BatchOutputCopy
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVCache

# What a worker hands the decode server of a PD pair for one request besides its KV (EAGLE: the
# first proposal and the draft's last hidden state), as (token id, raw bytes).
ReqState = tuple[int, bytes]


class BaseTpWorker(ABC):
    """The worker contract (upstream's name): what the scheduler, HiCache and PD may read of a
    worker. A worker that lacks `forward_batch_generation` fails at construction."""

    # Rows a decode request computes per step: 1 plain, N for a speculative verify.
    num_tokens_per_req: int = 1
    # Whether a step's KV lengths are known when it is launched (every row is accepted), which the
    # overlap scheduler needs to prepare the next step before processing this one.
    supports_overlap: bool = True
    # Runs the steps; inline unless a worker launches them on a thread of its own (HiCache's
    # layer-end backup then cannot run in the forward: it backs up after the step instead).
    launcher: Launcher = INLINE_LAUNCHER
    model_runner: ModelRunner  # the target's runner: its pools, config, CP group
    world_group: GroupCoordinator
    token_table: LastTokenTable  # each request slot's last token (decode input ids come from it)

    @abstractmethod
    def forward_batch_generation(self, batch: ScheduleBatch) -> Pending:
        """Launch one step of `batch`; the Pending's result has `to_host() -> GenerationBatchResult`."""

    def needs_host_state(self, req: Req) -> bool:
        """Whether `req`'s next step needs the host state of the step in flight for this worker's
        own reasons (the request's own are `Req.needs_host_sampling_state`)."""
        return False

    @property
    def avg_accept_length(self) -> float:
        """Acceptance statistics: tokens produced per request per verify step; 0.0 without verifies."""
        return 0.0

    def kv_pools(self) -> dict[str, KVCache]:
        """The device KV pools of this worker's runners by role ("target"; "draft" with EAGLE): what
        HiCache mirrors and PD moves. Target and draft share request slots, so one page list
        addresses both."""
        return {"target": self.model_runner.token_to_kv_pool}

    def export_req_state(self, slot: int) -> ReqState | None:
        """A prefilled request's state beyond its KV that a decode server needs (PD); None: none."""
        return None

    def import_req_state(self, slot: int, kv_len: int, state: ReqState | None) -> None:
        """Install what `export_req_state` gave on the prefill server, before the first decode step."""

    @property
    def req_to_token_pool(self):
        return self.model_runner.req_to_token_pool

    @property
    def token_to_kv_pool_allocator(self):
        return self.model_runner.token_to_kv_pool_allocator

    @property
    def max_total_num_tokens(self) -> int:
        return self.model_runner.max_total_num_tokens

    @property
    def max_running_requests(self) -> int:
        return self.model_runner.max_running_requests

    def shutdown(self) -> None:
        self.launcher.shutdown()


class TpModelWorker(BaseTpWorker):

    def __init__(self, server_args: ServerArgs, model_config: ModelConfig,
                 tp_group: GroupCoordinator = SINGLE_GROUP, extra_kv_bytes_per_token: int = 0,
                 graph_specs: tuple | None = None, extra_weight_bytes: int = 0, extra_reserve_bytes: int = 0) -> None:
        """`extra_kv_bytes_per_token`: KV of runners that will share this worker's request slots (a
        draft model), so one memory plan covers them all; `extra_weight_bytes` / `extra_reserve_bytes`:
        their weights and CUDA graphs, built after the plan. `graph_specs`: the forwards captured
        in CUDA graphs (default: decode)."""
        self.server_args = server_args
        self.model_runner = ModelRunner(model_config, server_args, tp_group,
                                        extra_kv_bytes_per_token=extra_kv_bytes_per_token, graph_specs=graph_specs,
                                        extra_weight_bytes=extra_weight_bytes, extra_reserve_bytes=extra_reserve_bytes)
        mr = self.model_runner
        self.device = server_args.device
        self.world_group = mr.world_group
        self.token_table = LastTokenTable(mr.req_to_token_pool.size, self.device)
        self.launcher = make_launcher(self.device, tp_group.world_size, not server_args.disable_overlap_schedule)

    # -- one step -----------------------------------------------------------------------------------
    def build_forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        """The batch's ForwardBatch, uploaded once (FUTURE_TOKEN ids are resolved at launch)."""
        return batch.build_forward_batch(self.device, batch.sampling_info)

    def resolve_input_ids(self, fb: ForwardBatch) -> None:
        """Fill FUTURE_TOKEN input ids (decode rows) from the token table, on the device."""
        if fb.forward_mode in (ForwardMode.DECODE, ForwardMode.MIXED):
            fb.input_ids = self.token_table.resolve(fb.input_ids, fb.req_pool_indices[fb.token_to_req])
            if self.model_runner.cp_group is not None:
                # CP re-lays the batch out from its host rows (eager, host-built metadata anyway)
                fb.host_rows["input_ids"] = fb.input_ids.cpu()

    @torch.inference_mode()
    def _run(self, fb: ForwardBatch, batch: ScheduleBatch) -> BatchOutputCopy:
        self.resolve_input_ids(fb)
        logits_output = self.model_runner.forward(fb)
        sample = self.model_runner.sample(logits_output, fb)
        self.token_table.store(fb.req_pool_indices, sample.next_token_ids)
        return BatchOutputCopy(batch, fb, logits_output, sample)

    def forward_batch_generation(self, batch: ScheduleBatch) -> Pending:
        fb = self.build_forward_batch(batch)
        return self.launcher.launch(lambda: self._run(fb, batch))

