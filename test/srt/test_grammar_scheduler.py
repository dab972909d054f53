"""The scheduler's grammar queue, driven step by step on the tiny model (CPU): a request whose
grammar is still compiling waits off the waiting queue and delays nobody; aborting it there
releases it; once compiled it runs and its output matches; a grammar that fails to compile in
the scheduler finishes the request with a 400 abort naming the field; nothing leaks."""

from __future__ import annotations

import re
import threading

import pytest

pytest.importorskip("xgrammar")

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.tokenizer_utils import load_tokenizer  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

MODEL = "builtin:tiny-deepseek-v32"


@pytest.fixture(scope="module")
def scheduler():
    sa = ServerArgs(model_path=MODEL, device="cpu", random_seed=0, max_total_tokens=2048).resolve()
    tok = load_tokenizer(sa.tokenizer_path, sa.trust_remote_code)
    sched = Scheduler(sa, tokenizer=tok)
    yield sched
    sched.grammar_manager.grammar_backend.shutdown()


class _Gate:
    """Holds the grammar backend's compiles until released."""

    def __init__(self, backend):
        self.backend, self.event = backend, threading.Event()
        self.inner = backend._init_value_dispatch

    def __enter__(self):
        def gated(key):
            assert self.event.wait(60), "gate never opened"
            return self.inner(key)

        self.backend._init_value_dispatch = gated
        return self

    def __exit__(self, *exc):
        self.event.set()
        self.backend._init_value_dispatch = self.inner


def submit(sched, rid, regex=None, max_new=12, **kw):
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, regex=regex, **kw)
    sp.normalize(None)
    sp.verify(sched.vocab_size)
    return sched.add_request(TokenizedGenerateReqInput(rid, [5, 6, 7, 8], sp))


def run_until(sched, pred, outs, max_steps=500):
    for _ in range(max_steps):
        if pred():
            return
        for o in sched.step():
            rec = outs.setdefault(o.rid, {"ids": [], "finish": None})
            rec["ids"] += o.new_token_ids
            rec["finish"] = o.finished_reason or rec["finish"]
    raise AssertionError("condition not reached")


def test_compiling_grammar_delays_nobody_and_abort_releases_it(scheduler):
    s, outs = scheduler, {}
    with _Gate(s.grammar_manager.grammar_backend) as gate:
        assert submit(s, "g1", regex=r"\d{2}-(yes|no)", max_new=16) == []
        assert [r.rid for r in s.grammar_manager.grammar_queue] == ["g1"] and s.has_work()
        assert (s.get_stats().num_waiting_reqs, s.get_stats().num_grammar_queue_reqs) == (1, 1)
        submit(s, "plain", max_new=6, ignore_eos=True)
        run_until(s, lambda: outs.get("plain", {}).get("finish") is not None, outs)
        assert len(outs["plain"]["ids"]) == 6 and [r.rid for r in s.grammar_manager.grammar_queue] == ["g1"]
        assert s.abort_request("g1")[0].finished_reason["type"] == "abort"
        assert not s.grammar_manager.grammar_queue and not s.has_work()
        submit(s, "g2", regex=r"\d{2}-(yes|no)", max_new=16)
        assert [r.rid for r in s.grammar_manager.grammar_queue] == ["g2"]
        gate.event.set()
        run_until(s, lambda: outs.get("g2", {}).get("finish") is not None, outs)
    tok = s.tokenizer
    text = tok.decode(outs["g2"]["ids"], skip_special_tokens=True)
    assert re.fullmatch(r"\d{2}-(yes|no)", text), text
    assert outs["g2"]["finish"] == {"type": "stop", "matched": s.grammar_manager.grammar_backend.stop_token_ids[0]}
    assert s.kv_leak_report() is None


def test_invalid_grammar_in_the_scheduler_is_a_400_abort(scheduler):
    s, outs = scheduler, {}
    assert submit(s, "bad", regex="([a") == []  # first sight: compiled in the pool
    run_until(s, lambda: outs.get("bad", {}).get("finish") is not None, outs)
    fr = outs["bad"]["finish"]
    assert fr["type"] == "abort" and fr["status_code"] == 400 and "sampling_params.regex" in fr["message"]
    again = submit(s, "bad2", regex="([a")  # cached: refused at once
    assert again and again[0].finished_reason["status_code"] == 400
    assert not s.has_work() and s.kv_leak_report() is None


def test_grammar_backend_none_refuses(scheduler):
    s = scheduler
    backend, s.grammar_manager.grammar_backend = s.grammar_manager.grammar_backend, None
    try:
        out = submit(s, "nog", regex="a")
        assert out and "structured outputs are disabled" in out[0].finished_reason["message"]
        out = s.add_request(TokenizedGenerateReqInput("clp", [5, 6], SamplingParams(max_new_tokens=2),
                                                      custom_logit_processor="{}"))
        assert out and "--enable-custom-logit-processor" in out[0].finished_reason["message"]
    finally:
        s.grammar_manager.grammar_backend = backend
    assert not s.has_work()


def test_offline_engine_grammar_and_processor():
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.testing.logit_processors import ScriptedTokensLogitProcessor

    with Engine(model_path=MODEL, device="cpu", max_total_tokens=2048, enable_custom_logit_processor=True) as e:
        res = e.generate(input_ids=[[5, 6], [7, 8]],
                         sampling_params=[{"max_new_tokens": 8, "custom_params": {"token_ids": [9, 10, 11]}},
                                          {"max_new_tokens": 20, "regex": r"\d{2}-(yes|no)", "temperature": 1.0}],
                         custom_logit_processor=[ScriptedTokensLogitProcessor.to_str(), None])
        assert res[0]["output_ids"] == [9, 10, 11, 1]
        assert re.fullmatch(r"\d{2}-(yes|no)", res[1]["text"]), res[1]["text"]
