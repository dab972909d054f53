"""Overlap scheduling (issue 18 item 3) against the synchronous loop on the same inputs.

Overlap prepares and launches step n+1 before step n's results are processed (on CPU the forward
runs on a worker thread here, SGLANG_CPU_OVERLAP_THREAD=1, so this really runs concurrently); decode input ids come from the device
token table. Equivalence: identical output ids, finish reasons, usage and logprobs with overlap on
and off, for batched, EOS / stop-string / max_tokens finishes, chunked + mixed prefill, grammars,
seeded sampling, penalties (which wait for the previous step), hidden states and retraction; a
finished or aborted request never emits the extra token computed for it; nothing leaks.
"""

import json
import os
import random

import pytest

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.managers import scheduler as scheduler_module
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.overlap_utils import ThreadLauncher
from sglang.srt.sampling.sampling_params import SamplingParams

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
MODEL = "builtin:tiny-deepseek-v32"


@pytest.fixture(autouse=True)
def forward_thread(monkeypatch):
    """On CPU the overlapped loop runs the forward on a worker thread here (opt-in for users: it is
    slower for small models), so these tests exercise real concurrency."""
    monkeypatch.setenv("SGLANG_CPU_OVERLAP_THREAD", "1")


def _engine(overlap: bool, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    return Engine(model_path=MODEL, device=DEVICE, random_seed=0, disable_overlap_schedule=not overlap, **kw)


def _prompts(n: int) -> list[list[int]]:
    return [[(11 * i + 17 * j) % 900 + 5 for j in range(6 + 7 * i)] for i in range(n)]


def _key(out: dict) -> tuple:
    m = out["meta_info"]
    lps = tuple(round(t[0], 4) for t in m.get("output_token_logprobs") or [])
    return out["output_ids"], json.dumps(m["finish_reason"]), m["completion_tokens"], m["prompt_tokens"], lps


def _both(engine_kw: dict, prompts, params, **gen_kw) -> tuple[list, list]:
    outs = []
    for overlap in (True, False):
        eng = _engine(overlap, **engine_kw)
        if overlap:
            assert isinstance(eng.scheduler.tp_worker.launcher, ThreadLauncher) == (DEVICE == "cpu")
        outs.append(eng.generate(input_ids=prompts, sampling_params=params, **gen_kw))
        s = eng.scheduler
        assert not s.has_work() and s.kv_leak_report() is None
        assert s.allocator.available_size() + s.tree_cache.total_size() == s.max_total_num_tokens
    return outs[0], outs[1]


def _stop_params(n: int) -> list[dict]:
    probe = _engine(False).generate(input_ids=_prompts(n)[1], sampling_params={"temperature": 0,
                                                                             "max_new_tokens": 20, "ignore_eos": True})
    stop = probe["text"][len(probe["text"]) // 2:][:3]
    assert stop.strip()
    params = [{"temperature": 0, "max_new_tokens": 4 + 5 * i, "ignore_eos": i % 2 == 0} for i in range(n)]
    params[1].update(max_new_tokens=20, ignore_eos=True, stop=[stop])  # fires mid-decode
    return params


CASES = {
    "batched_logprobs_stops": (dict(), None, dict(return_logprob=True, top_logprobs_num=2)),
    "chunked_mixed_pages": (dict(chunked_prefill_size=8, enable_mixed_chunk=True, page_size=4), None,
                            dict(return_logprob=True)),
    "retraction": (dict(max_total_tokens=96, page_size=4),
                   {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}, {}),
    "seeded_sampling": (dict(), [{"temperature": 0.9, "top_p": 0.9, "sampling_seed": 5 + i, "max_new_tokens": 12,
                                  "ignore_eos": True} for i in range(5)], {}),
    "penalties_wait_for_host_state": (dict(), [{"temperature": 0, "frequency_penalty": 0.5 * (i % 2),
                                                "min_new_tokens": 3 * (i % 3), "max_new_tokens": 10}
                                               for i in range(5)], {}),
    "hidden_states": (dict(enable_return_hidden_states=True),
                      {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}, dict(return_hidden_states=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_equals_sync(case):
    engine_kw, params, gen_kw = CASES[case]
    prompts = _prompts(5)
    params = params if params is not None else _stop_params(5)
    ov, sync = _both(engine_kw, prompts, params, **gen_kw)
    assert [_key(o) for o in ov] == [_key(o) for o in sync]
    if case == "batched_logprobs_stops":  # the stop string ended a request while its next step ran
        assert ov[1]["meta_info"]["finish_reason"]["type"] == "stop"
    if gen_kw.get("return_hidden_states"):
        for a, b in zip(ov, sync):
            ha, hb = a["meta_info"]["hidden_states"], b["meta_info"]["hidden_states"]
            assert len(ha) == len(hb) and all(
                abs(x - y) < 1e-5 for ra, rb in zip(ha[1:], hb[1:]) for x, y in zip(ra, rb))


def test_chunked_prompts_under_memory_pressure():
    """Several prompts longer than a chunk, little KV: only one request may be chunked at a time
    (a second chunk started while the first one's chunk was in flight used to overwrite it, and
    that request was never finished)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1024) for _ in range(rng.randrange(3, 120))] for _ in range(8)]
    ov, sync = _both(dict(chunked_prefill_size=16, max_total_tokens=256, page_size=4), prompts,
                     {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert [_key(o) for o in ov] == [_key(o) for o in sync]


def test_grammar_requests_equal_sync():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [{"temperature": 0, "max_new_tokens": 24, "json_schema": json.dumps(schema)},
              {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 16, "regex": "(yes|no)[a-c]{2,5}"}]
    ov, sync = _both({}, _prompts(3), params)
    assert [_key(o) for o in ov] == [_key(o) for o in sync]
    assert ov[2]["meta_info"]["finish_reason"]["type"] == "stop"  # the grammar ended it


def _submit(sched, rid: str, ids: list[int], max_new: int) -> None:  # greedy, no EOS
    sp = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    sp.verify(sched.vocab_size)
    assert sched.add_request(TokenizedGenerateReqInput(rid, ids, sp)) == []


def test_launches_next_step_before_processing_the_previous():
    """Order of events: with overlap, decode step n+1 is launched before step n is processed (the
    prefill's result is needed first: its request joins the decode batch then); a request whose
    sampling needs host state (a penalty) runs synchronously, as does --disable-overlap-schedule."""
    def pattern(overlap: bool, **sp) -> str:
        sched = _engine(overlap).scheduler
        events = []
        launch, process = sched.tp_worker.forward_batch_generation, sched.process_batch_result
        sched.tp_worker.forward_batch_generation = lambda b: (events.append("L"), launch(b))[1]
        sched.process_batch_result = lambda b, r: (events.append("P"), process(b, r))[1]
        params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, **sp)
        params.verify(sched.vocab_size)
        sched.add_request(TokenizedGenerateReqInput("a", _prompts(1)[0], params))
        while sched.has_work():
            sched.step()
        return "".join(events)

    # prefill, then 5 decodes; the last decode is not followed by a 7th step (max_tokens is known)
    assert pattern(True) == "LP" + "L" + "LP" * 4 + "P"
    assert pattern(False) == "LP" * 6
    assert pattern(True, frequency_penalty=0.5) == "LP" * 6


def test_abort_in_flight_emits_nothing_more_and_frees_kv():
    """Aborting a request whose prefill, or a decode step, is in flight: the abort is the last
    output (no token after it), and its KV is released once that step is processed."""
    sched = _engine(True).scheduler
    free0 = sched.allocator.available_size()
    _submit(sched, "pre", _prompts(2)[1], 30)
    _submit(sched, "dec", _prompts(2)[0], 30)
    outs = sched.step()  # launches the prefill of both
    assert sched.overlap.launched is not None and not sched.running
    sched.abort_request("pre")  # in no queue: only in the step in flight
    seen: dict[str, list] = {}
    steps = 0
    while sched.has_work():
        for o in outs:
            seen.setdefault(o.rid, []).append(o)
        if steps == 4:
            assert any(r.rid == "dec" for r in sched.overlap.reqs)
            sched.abort_request("dec")
        outs = sched.step()
        steps += 1
    for o in outs:
        seen.setdefault(o.rid, []).append(o)
    for rid in ("pre", "dec"):
        fin = [o for o in seen[rid] if o.finished_reason]
        assert len(fin) == 1 and fin[0].finished_reason["type"] == "abort" and seen[rid][-1] is fin[0]
    assert sum(len(o.new_token_ids) for o in seen["dec"]) < 30
    assert sched.kv_leak_report() is None
    assert sched.allocator.available_size() + sched.tree_cache.total_size() == free0


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_mid_chunked_prefill_stops_it(overlap):
    """A client abort while a prompt is prefilled in chunks -- under overlap its chunk is in flight
    then, the request in no queue -- ends it in the next step: no further chunk is launched, its KV
    and its radix-cache lock are released (it used to run every remaining chunk first)."""
    sched = _engine(overlap, chunked_prefill_size=64).scheduler  # a multiple of CUDA's default page (64)
    _submit(sched, "long", [(7 * j) % 900 + 5 for j in range(400)], 8)  # 7 chunks
    sched.step()
    sched.step()
    assert sched.overlap.reqs[0].is_chunked if overlap else sched.chunked_req is not None
    assert sched.get_stats().num_running_reqs == 1  # counted while its chunk is in flight (in no list)
    assert sched.tree_cache.protected_size() > 0  # its first chunk(s), locked in the radix cache
    assert sched.abort_request("long") == []
    launched = sched.forward_ct
    outs = sched.step()
    assert sched.forward_ct == launched, "another chunk of the aborted prompt was launched"
    assert [(o.rid, o.finished_reason["type"]) for o in outs if o.finished_reason] == [("long", "abort")]
    assert not sched.has_work() and sched.tree_cache.protected_size() == 0 and sched.kv_leak_report() is None


def test_prefix_cache_lifecycle_hooks():
    """check_events once per scheduler iteration, prepare_batch once per launch (before the worker
    runs it), on_batch_done once per batch after its results are applied, in launch order."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    for overlap in (True, False):
        log, keep = [], []

        class Recording(RadixCache):
            def check_events(self):
                log.append(("events",))

            def prepare_batch(self, batch):
                keep.append(batch)  # ids stay unique
                log.append(("prepare", id(batch)))

            def on_batch_done(self, batch):
                assert all(r.unprocessed_steps >= 0 for r in batch.reqs)
                log.append(("done", id(batch)))

        with pytest.MonkeyPatch.context() as mp:  # the scheduler's managers share the cache it builds
            mp.setattr(scheduler_module, "create_tree_cache",
                       lambda sa, w, ps: Recording(w.req_to_token_pool, w.token_to_kv_pool_allocator, ps))
            sched = _engine(overlap).scheduler
        launch = sched.tp_worker.forward_batch_generation
        sched.tp_worker.forward_batch_generation = lambda b: (log.append(("launch", id(b))), launch(b))[1]
        _submit(sched, "a", _prompts(2)[0], 5)
        _submit(sched, "b", _prompts(2)[1], 3)
        iterations = 0
        while sched.has_work():
            sched.step()
            iterations += 1
        assert sum(e == ("events",) for e in log) == iterations
        prepared = [e[1] for e in log if e[0] == "prepare"]
        launched = [e[1] for e in log if e[0] == "launch"]
        done = [e[1] for e in log if e[0] == "done"]
        assert prepared == launched == done and len(set(done)) == len(done)
        for b in launched:  # prepare right before its launch, done after it
            assert log.index(("prepare", b)) + 1 == log.index(("launch", b)) < log.index(("done", b))
        overlapped = any(log.index(("launch", b2)) < log.index(("done", b1)) for b1, b2 in zip(launched, launched[1:]))
        assert overlapped == overlap
        assert sched.kv_leak_report() is None
