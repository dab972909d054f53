"""The worker contract (managers/tp_worker.BaseTpWorker) and the request flags PD sets on Req:
what a worker that declares nothing gets, and what a PD prefill request's stop rules are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.managers.overlap_utils import INLINE_LAUNCHER, InlineLauncher, ThreadLauncher
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_MATCHED_TOKEN, Req
from sglang.srt.managers.tp_worker import BaseTpWorker
from sglang.srt.sampling.sampling_params import SamplingParams


class _Plain(BaseTpWorker):
    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(token_to_kv_pool="target-pool", max_total_num_tokens=64)

    def forward_batch_generation(self, batch):
        raise NotImplementedError


def test_a_worker_without_a_forward_fails_at_construction():
    class NoForward(BaseTpWorker):
        pass

    with pytest.raises(TypeError, match="forward_batch_generation"):
        NoForward()


def test_contract_defaults_are_the_plain_worker():
    w = _Plain()
    req = Req("r", [1, 2], SamplingParams(max_new_tokens=4))
    assert w.num_tokens_per_req == 1 and w.supports_overlap
    assert not w.needs_host_state(req) and w.avg_accept_length == 0.0
    assert w.kv_pools() == {"target": "target-pool"} and w.max_total_num_tokens == 64
    assert w.export_req_state(0) is None
    w.import_req_state(0, 2, None)  # nothing to install
    assert w.launcher is INLINE_LAUNCHER and w.launcher.inline


def test_launchers_say_whether_they_run_inline():
    assert InlineLauncher.inline and not ThreadLauncher.inline


def _req(eos: int = 7) -> Req:
    req = Req("r", [1, 2], SamplingParams(max_new_tokens=2))
    req.output_ids = [eos]
    return req


def test_abort_only_stop_rules_ignore_eos_and_length_but_not_an_abort():
    plain = _req()
    plain.check_finished({7})
    assert isinstance(plain.finished_reason, FINISH_MATCHED_TOKEN)
    pd = _req()
    pd.abort_only_stop_rules = True
    pd.output_ids = [7, 7]  # EOS and max_new_tokens reached: the decode server decides
    pd.check_finished({7})
    assert pd.finished_reason is None
    pd.to_abort = "client went away"
    pd.check_finished({7})
    assert isinstance(pd.finished_reason, FINISH_ABORT) and pd.finished_reason.message == "client went away"
