"""EAGLE / NextN speculative decoding (issue 19) on the builtin models' MTP layer.

Lossless: the same tokens (and logprobs) as plain decoding -- with the random draft (which accepts
almost nothing), with a draft forced to propose the target's own tokens (accepts every draft: the
accept path runs) and with one forced wrong (accepts nothing). Sampling with per-request seeds
gives exactly plain decoding's tokens too (each verified row draws with the seed step plain
decoding uses). Chunked prefill, radix hits, stop strings, max_tokens inside an accepted run,
grammars (verified one row at a time), IndexCache-shared target layers and retraction under a
small KV pool; the pool is whole afterwards.
"""

import json
import os

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.testing.spec_drafts import forced_drafts

DEVICE = os.environ.get("SGLANG_TEST_DEVICE", "cpu")
MODEL = "builtin:tiny-deepseek-v32-mtp"


def _engine(spec: bool, model: str = MODEL, **kw) -> Engine:
    kw.setdefault("max_total_tokens", 4096)
    if spec:
        kw = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, **kw)
    return Engine(model_path=model, device=DEVICE, random_seed=0, **kw)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 900 + 5 for j in range(9 + 6 * i)] for i in range(n)]


def _key(o: dict) -> tuple:
    m = o["meta_info"]
    lps = tuple(round(t[0], 4) for t in m.get("output_token_logprobs") or [])
    return o["output_ids"], str(m["finish_reason"]), m["completion_tokens"], lps


def _whole(engine: Engine) -> None:
    s = engine.scheduler
    assert not s.has_work() and s.kv_leak_report() is None
    assert s.allocator.available_size() + s.tree_cache.total_size() == s.max_total_num_tokens


@pytest.mark.parametrize("engine_kw", [dict(), dict(chunked_prefill_size=8, page_size=4)],
                         ids=["default", "chunked_page4"])
def test_greedy_equals_plain_with_random_right_and_wrong_drafts(engine_kw):
    prompts = _prompts(5)
    params = [{"temperature": 0, "max_new_tokens": 6 + 5 * i, "ignore_eos": True} for i in range(5)]
    gen = dict(return_logprob=True, top_logprobs_num=2)
    ref = _engine(False, **engine_kw).generate(input_ids=prompts, sampling_params=params, **gen)
    spec = _engine(True, **engine_kw)
    worker = spec.scheduler.tp_worker
    assert worker.num_tokens_per_req == 4
    outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
    assert [_key(o) for o in outs] == [_key(o) for o in ref]
    m = outs[0]["meta_info"]  # upstream's fields: completion tokens per verify step
    assert m["spec_verify_ct"] > 0 and m["spec_accept_length"] == m["completion_tokens"] / m["spec_verify_ct"]
    assert spec.scheduler.get_stats().avg_spec_accept_length == worker.avg_accept_length >= 1.0
    _whole(spec)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    for mode in ("right", "wrong", "mixed"):
        assert spec.flush_cache()
        worker.draft_override = forced_drafts(targets, mode)
        worker.num_verify_steps = worker.num_accepted_drafts = 0
        outs = spec.generate(input_ids=prompts, sampling_params=params, **gen)
        assert [_key(o) for o in outs] == [_key(o) for o in ref]
        # forced right: 3 drafts + the bonus token per verify, except where max_tokens cut a run
        expect = {"right": (3.0, 4.0), "wrong": (1.0, 1.0), "mixed": (1.2, 3.0)}[mode]
        assert expect[0] <= worker.avg_accept_length <= expect[1], (mode, worker.avg_accept_length)
        _whole(spec)
    # Radix hits on KV (target and draft) that verify steps committed: a second round extends the outputs.
    worker.draft_override = None
    prompts2 = [p + r["output_ids"][:-2] for p, r in zip(prompts, ref)]
    p2 = {"temperature": 0, "max_new_tokens": 7, "ignore_eos": True}
    ours = spec.generate(input_ids=prompts2, sampling_params=p2, **gen)
    assert sum(o["meta_info"]["cached_tokens"] for o in ours) > 0
    assert [_key(o) for o in ours] == [_key(o) for o in _engine(False, **engine_kw).generate(
        input_ids=prompts2, sampling_params=p2, **gen)]
    _whole(spec)


def test_stop_strings_eos_seeds_grammar_and_indexcache():
    """GLM-5 tiny model with shared top-k layers: stop strings inside an accepted run, EOS, seeded
    sampling (exact), a regex grammar (verified one row at a time) in the same batch."""
    model = "builtin:tiny-glm-moe-dsa-mtp"
    prompts = _prompts(4)
    plain = _engine(False, model)
    probe = plain.generate(input_ids=prompts[1], sampling_params={"temperature": 0, "max_new_tokens": 16,
                                                                   "ignore_eos": True})
    stop = probe["text"][len(probe["text"]) // 2:][:3]
    params = [{"temperature": 0, "max_new_tokens": 12},
              {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop": [stop]},
              {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 3, "max_new_tokens": 12, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 12, "regex": "(yes|no)[a-d]{2,6}"}]
    ref = plain.generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, model)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    spec.scheduler.tp_worker.draft_override = forced_drafts(targets, "right")
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [_key(o) for o in outs] == [_key(o) for o in ref]
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert outs[3]["meta_info"]["finish_reason"]["type"] == "stop"
    _whole(spec)


def test_draft_decode_through_its_graph_spec():
    """The draft's decode steps as a CUDA-graph spec (hidden state in, hidden state out), replayed
    with the CPU stand-in of a graph: the same tokens as plain decoding, every draft decode step
    replayed (padded buckets included), drafts accepted as when eager."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, EagerGraphBackend
    from sglang.srt.speculative.eagle_worker import draft_decode_spec

    prompts = _prompts(3)
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    # the Triton kernels (interpreted on CPU) are the capturable backends
    kw = dict(nsa_prefill_backend="triton", nsa_decode_backend="triton", moe_runner_backend="triton")
    ref = _engine(False, **kw).generate(input_ids=prompts, sampling_params=params)
    eager = _engine(True, **kw)
    eager_out = eager.generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, cuda_graph_max_bs=4, max_running_requests=4, **kw)
    worker = spec.scheduler.tp_worker
    dr = worker.draft_runner
    runner = CudaGraphRunner(dr, EagerGraphBackend(), specs=(draft_decode_spec(worker.draft_config),))
    dr.cuda_graph_runner = runner
    replays = []
    replay = runner.replay
    runner.replay = lambda fb: (replays.append(fb.batch_size), replay(fb))[1]
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    assert worker.avg_accept_length == eager.scheduler.tp_worker.avg_accept_length
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in eager_out]
    # 2 draft decode steps per verify (num_steps 3), batch 3 -> the padded bucket 4
    assert replays and set(replays) <= {1, 2, 3} and 3 in replays
    _whole(spec)


def test_retraction_under_a_small_pool():
    prompts = _prompts(5)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    ref = _engine(False, page_size=4).generate(input_ids=prompts, sampling_params=params)
    spec = _engine(True, max_total_tokens=128, page_size=4)
    targets = {tuple(p): r["output_ids"] for p, r in zip(prompts, ref)}
    spec.scheduler.tp_worker.draft_override = forced_drafts(targets, "right")
    outs = spec.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in ref]
    _whole(spec)


@pytest.mark.parametrize("kw,flag", [
    (dict(speculative_eagle_topk=2), "speculative_eagle_topk"),
    (dict(speculative_num_draft_tokens=7), "speculative_num_draft_tokens"),
    (dict(enable_mixed_chunk=True), "enable_mixed_chunk"),
])
def test_bad_speculative_flags(kw, flag):
    with pytest.raises(ServerArgsError) as e:
        ServerArgs.from_kwargs(model_path=MODEL, speculative_algorithm="EAGLE", **kw).resolve()
    assert e.value.flag == flag
    with pytest.raises(ServerArgsError, match="needs --speculative-algorithm"):
        ServerArgs.from_kwargs(model_path=MODEL, speculative_num_draft_tokens=4).resolve()


def test_hidden_states_request_is_refused_not_wrong():
    spec = _engine(True, enable_return_hidden_states=True)
    out = spec.generate(input_ids=_prompts(1)[0], sampling_params={"max_new_tokens": 4}, return_hidden_states=True)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400 and "return_hidden_states" in reason["message"]
    _whole(spec)


def test_checkpoint_without_mtp_layer_names_the_flags():
    with pytest.raises(ServerArgsError) as e:
        _engine(True, "builtin:tiny-deepseek-v32")
    assert e.value.flag == "speculative_algorithm" and "--speculative-draft-model-path" in str(e.value)


def test_server_streams_equal_plain_and_report_accept_length():
    """Through the HTTP server (official openai client): concurrent streamed completions with
    speculation equal plain decoding; an aborted stream frees its slots; accept length is in
    meta_info, /get_server_info and /metrics (sglang:spec_accept_length)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import requests

    from sglang.srt.testing.server import ServerProcess

    prompts = [f"Request {i}: " + "alpha beta " * (i + 2) for i in range(8)]
    plain = _engine(False)
    ref = [plain.generate(p, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})["text"] for p in prompts]
    with ServerProcess(MODEL, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                       "--max-total-tokens", "4096", "--enable-metrics", "--random-seed", "0") as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")

        def stream(p: str) -> str:
            chunks = client.completions.create(model="default", prompt=p, max_tokens=12, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(stream, prompts)) == ref
        body = {"text": prompts[0], "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
        meta = requests.post(server.base_url + "/generate", json=body, timeout=120).json()["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] >= 1.0
        with client.completions.create(model="default", prompt="count:", max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}) as s:
            for i, _ in enumerate(s):
                if i == 3:
                    break  # the client goes away mid-stream
        st = server.wait_idle()
        assert st["kv_leak"] is None and st["kv_protected_tokens"] == 0
        assert st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"]
        assert st["avg_spec_accept_length"] >= 1.0
        assert "sglang:spec_accept_length" in requests.get(server.base_url + "/metrics", timeout=30).text


def test_load_64_streams_with_aborts_and_retraction():
    """64 concurrent speculative streams, every fourth dropped by its client mid-stream, over a KV
    pool too small for all of them (retraction): no errors, no leak, every completed output equal
    to plain decoding and every dropped one a prefix of it."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from sglang.srt.testing.server import ServerProcess

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randrange(8, 24))] for _ in range(64)]
    sp = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    ref = [o["output_ids"] for o in _engine(False).generate(input_ids=prompts, sampling_params=sp)]
    with ServerProcess(MODEL, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                       "--max-total-tokens", "640", "--random-seed", "0") as server:
        errors, lock = [], threading.Lock()

        def run(i: int):
            body = {"input_ids": prompts[i], "sampling_params": sp, "stream": True}
            got = []
            try:
                with requests.post(server.base_url + "/generate", json=body, stream=True, timeout=600) as r:
                    assert r.status_code == 200, r.text
                    for line in r.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        got = json.loads(line[6:])["output_ids"]
                        if i % 4 == 0 and len(got) >= 3:
                            break  # this client goes away
                if i % 4 == 0:
                    assert got == ref[i][:len(got)], i
                else:
                    assert got == ref[i], i
            except Exception as e:  # reported below
                with lock:
                    errors.append((i, repr(e)))

        with ThreadPoolExecutor(64) as pool:
            list(pool.map(run, range(64)))
        assert not errors, errors[:3]
        st = server.wait_idle(timeout=120)
        assert st["kv_leak"] is None and st["kv_protected_tokens"] == 0
        assert st["kv_free_tokens"] + st["kv_cached_tokens"] == st["kv_total_tokens"]
        assert "retracted" in server.log()  # the pool was too small: requests went back to the queue
