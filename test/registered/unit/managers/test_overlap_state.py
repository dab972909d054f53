"""OverlapState (managers/overlap_utils.py): which launched steps the scheduler processes when, with
overlap on and off, and when the launched step must be processed before the next is built. CPU,
no model: the state sees only batches, requests and the worker's two declarations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.managers.overlap_utils import LaunchedStep, OverlapState, Pending
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams


def _req(rid: str, **sp) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=4, **sp))


def _step(reqs: list[Req], mode: ForwardMode = ForwardMode.DECODE, n_extend: int = 0) -> LaunchedStep:
    return LaunchedStep(ScheduleBatch(reqs, mode, num_extend_reqs=n_extend), Pending(value=None))


def _worker(overlap: bool = True, host_state: bool = False) -> SimpleNamespace:
    return SimpleNamespace(supports_overlap=overlap, needs_host_state=lambda req: host_state)


@pytest.mark.parametrize("enabled,supports", [(True, True), (True, False), (False, True)])
def test_each_step_is_processed_once_in_launch_order(enabled, supports):
    state, worker = OverlapState(enabled), _worker(supports)
    steps = [_step([_req(str(i))]) for i in range(3)]
    processed = []
    for s in steps:
        processed += state.after_launch(s, worker)
    processed += state.after_launch(None, worker)  # nothing launched: the last step comes back
    assert processed == steps and state.launched is None
    if enabled and supports:  # overlap: each step waits one iteration, until the next is launched
        assert state.after_launch(steps[0], worker) == [] and state.launched is steps[0]
    else:
        assert state.after_launch(steps[0], worker) == [steps[0]] and state.launched is None


def test_requests_of_the_launched_step():
    state, worker = OverlapState(True), _worker()
    assert state.reqs == [] and state.num_new_running() == 0
    a, b = _req("a"), _req("b")
    state.after_launch(_step([a, b], ForwardMode.EXTEND, n_extend=1), worker)
    assert state.reqs == [a, b] and state.num_new_running() == 1
    assert state.take().batch.reqs == [a, b] and state.launched is None


def test_the_launched_step_is_processed_first_when_the_next_needs_its_results():
    worker = _worker()
    plain, penalised = _req("plain"), _req("pen", frequency_penalty=0.5)
    state = OverlapState(True)
    assert not state.must_process_first([plain], worker)  # nothing launched
    state.after_launch(_step([plain]), worker)
    assert not state.must_process_first([plain], worker)
    assert state.must_process_first([plain, penalised], worker)  # sampling reads host token counts
    assert state.must_process_first([plain], _worker(host_state=True))  # the worker asks for them
    assert OverlapState(False).must_process_first([], worker) is False
    chunked = _req("chunk")
    chunked.is_chunked = True
    state.take()
    state.after_launch(_step([chunked], ForwardMode.EXTEND, n_extend=1), worker)
    assert state.must_process_first([], worker)  # its request continues in the next batch
    off = OverlapState(True)
    off.launched = _step([plain])
    assert off.must_process_first([plain], _worker(overlap=False))
