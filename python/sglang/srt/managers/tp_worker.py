"""TpModelWorker: the only thing the scheduler calls to run a batch (upstream's name).

The worker owns the model runner(s) -- the target here; a speculative worker adds a draft runner
sharing the target's `ReqToTokenPool` + allocator -- the device token table and the launcher.
`forward_batch_generation(batch)` lowers a ScheduleBatch to a ForwardBatch (one upload), then
launches: resolve FUTURE_TOKEN input ids from the token table, forward, sample, store the sampled
ids back into the table, queue the device->host copies. It returns a `Pending` whose result has
`to_host() -> GenerationBatchResult`; nothing in the launch reads the device back, so the scheduler
prepares the next step while this one runs.

Contract for workers (plain, speculative, test fakes):
- `num_tokens_per_req`: rows a decode request computes per step (1 plain, N for a verify);
- `supports_overlap`: whether a step's KV lengths are known when it is launched (every row is
  accepted), which the overlap scheduler needs to prepare the next step before processing this one;
- the result's `accept_lens` says per request how many of the step's rows to commit (None = all);
- after a step, the token table holds each request's last accepted token.
"""

from __future__ import annotations

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import SINGLE_GROUP, GroupCoordinator
from sglang.srt.managers.overlap_utils import LastTokenTable, Pending, make_launcher
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler_output_processor import BatchOutputCopy
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs


class TpModelWorker:
    num_tokens_per_req = 1
    supports_overlap = True

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

    # -- what the scheduler reads -------------------------------------------------------------------
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

    def shutdown(self) -> None:
        self.launcher.shutdown()


def create_worker(server_args: ServerArgs, model_config: ModelConfig, tp_group: GroupCoordinator = SINGLE_GROUP):
    """The worker the server's flags ask for: plain, or speculative (EAGLE / NEXTN)."""
    if server_args.speculative_algorithm is not None:
        from sglang.srt.speculative.eagle_worker import EAGLEWorker

        return EAGLEWorker(server_args, model_config, tp_group)
    return TpModelWorker(server_args, model_config, tp_group)
