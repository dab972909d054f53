"""OpenAI-API completeness (issue 13): /v1/tokenize + /v1/detokenize, /v1/models/{id}, 400 (not 422)
validation errors, --max-payload-size, /generate's return_text_in_logprobs / return_hidden_states /
finish reasons, upstream's Prometheus names and the periodic Prefill / Decode stats log lines.

One server for the module; every wait is on a condition (the machine is a busy 2-core one)."""

import json
import os
import re
import time

import openai
import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.managers.tokenizer_utils import load_tokenizer
from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
SERVED = "acme/tiny-dsa-v32"  # an id with '/', as HF names have
PAYLOAD = 2**20
ARGS = ("--max-total-tokens", "8192", "--random-seed", "0", "--served-model-name", SERVED, "--enable-metrics",
        "--enable-return-hidden-states", "--decode-log-interval", "4", "--max-payload-size", str(PAYLOAD),
        "--log-level", "info")
PROMPTS = ["The capital of France is", "héllo wörld — ünïcode ✓ 🙂", "def f(x):\n    return x * 2\n", ""]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, *ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def _post(server, path, body, **kw):
    return requests.post(server.base_url + path, json=body, timeout=120, **kw)


def _ok(server):
    r = _post(server, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                                                         "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 2


# -- tokenize / detokenize ------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/tokenize", "/tokenize"])
def test_tokenize_matches_the_tokenizer_and_roundtrips(server, tok, path):
    max_len = _post(server, "/v1/tokenize", {"prompt": "x"}).json()["max_model_len"]
    assert max_len == requests.get(server.base_url + "/v1/models").json()["data"][0]["max_model_len"] > 0
    for prompt in PROMPTS:
        for special in (True, False):
            r = _post(server, path, {"model": SERVED, "prompt": prompt, "add_special_tokens": special})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["tokens"] == tok.encode(prompt, add_special_tokens=special)
            assert body["count"] == len(body["tokens"]) and body["max_model_len"] == max_len
            text = _post(server, path.replace("tokenize", "detokenize"), {"tokens": body["tokens"]}).json()["text"]
            assert text == tok.decode(body["tokens"], skip_special_tokens=True)
            if not special:
                assert text == prompt  # byte-level BPE: plain text survives the round trip
    batch = _post(server, path, {"prompt": PROMPTS}).json()
    assert batch["tokens"] == [tok.encode(p) for p in PROMPTS] and batch["count"] == [len(t) for t in batch["tokens"]]
    texts = _post(server, "/v1/detokenize", {"tokens": batch["tokens"]}).json()["text"]
    assert texts == [tok.decode(t, skip_special_tokens=True) for t in batch["tokens"]]
    with_specials = _post(server, "/v1/detokenize", {"tokens": batch["tokens"][0], "skip_special_tokens": False})
    assert with_specials.json()["text"] == tok.decode(batch["tokens"][0], skip_special_tokens=False)
    assert _post(server, "/v1/detokenize", {"tokens": []}).json() == {"text": ""}


def test_tokenize_counts_match_request_usage(server, client):
    prompt = "Count these tokens, please: one two three"
    usage = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == _post(server, "/v1/tokenize", {"prompt": prompt, "add_special_tokens": False}
                                        ).json()["count"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    usage = client.chat.completions.create(model="default", messages=messages, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == _post(server, "/v1/tokenize", {"messages": messages}).json()["count"]


BAD_TOKENIZE = [
    ("/v1/detokenize", {"tokens": [1, 999999]}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": [[1, 2], [3, 10**12]]}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
    ("/v1/detokenize", {"tokens": [True]}, 400, "tokens.0"),
    ("/v1/detokenize", {"tokens": "hello"}, 400, None),
    ("/v1/detokenize", {}, 400, "tokens"),
    ("/v1/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ("/v1/tokenize", {}, 400, "prompt"),
    ("/v1/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/v1/tokenize", {"prompt": 5}, 400, None),
    ("/v1/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/tokenize", {"prompt": "x", "add_special_tokens": "yes please"}, 400, "add_special_tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_TOKENIZE)
def test_bad_tokenize_requests_are_openai_errors(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    _ok(server)


# -- models/{id} ------------------------------------------------------------------------------------
def test_retrieve_model(server, client):
    card = client.models.retrieve(SERVED)
    assert card.id == SERVED and card.object == "model" and card.owned_by == "sglang"
    assert card.model_dump()["max_model_len"] > 0
    assert [m.id for m in client.models.list().data] == [SERVED]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("acme/other-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = requests.get(server.base_url + "/v1/models/acme/other-model")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_get_load_has_upstream_shape_and_counts_a_running_request(server):
    """/get_load (what upstream's routers poll): a list per DP rank of num_reqs / num_waiting_reqs /
    num_tokens; a long request in flight shows as one request holding KV."""
    import threading

    idle = requests.get(server.base_url + "/get_load").json()
    assert isinstance(idle, list) and set(idle[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    t = threading.Thread(target=lambda: requests.post(server.base_url + "/generate", json=body, timeout=300))
    t.start()
    seen = None
    while t.is_alive() and seen is None:  # wait on the condition, not a fixed sleep
        load = requests.get(server.base_url + "/get_load").json()[0]
        seen = load if load["num_reqs"] >= 1 and load["num_tokens"] > 0 else None
    t.join()
    assert seen is not None and seen["dp_rank"] == 0


def test_abort_request_ends_the_request(server):
    """/abort_request {"rid"} (upstream's): the waiting client is answered at once with the abort (a
    400 naming it, as for any aborted single request) instead of its 3000 tokens; an unknown rid is a
    no-op, a body without rid / abort_all a 400; the server keeps serving."""
    import threading

    body = {"input_ids": [5, 6, 7, 9], "rid": "to-abort", "sampling_params": {"max_new_tokens": 3000,
                                                                             "ignore_eos": True}}
    got = {}
    t = threading.Thread(target=lambda: got.update(r=requests.post(server.base_url + "/generate", json=body,
                                                                   timeout=300)))
    t.start()
    while t.is_alive() and requests.get(server.base_url + "/get_load").json()[0]["num_tokens"] == 0:
        pass  # until the request holds KV (it runs)
    assert requests.post(server.base_url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
    t.join()
    r = got["r"]  # a single aborted request answers as an error, as the scheduler's own aborts do
    assert r.status_code == 400 and "abort" in r.json()["error"]["message"], r.text
    assert requests.post(server.base_url + "/abort_request", json={"rid": "nobody"}).status_code == 200
    bad = requests.post(server.base_url + "/abort_request", json={"abort_all": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
    _ok(server)


# -- validation status, payload limit ------------------------------------------------------------------
def test_validation_errors_are_400_naming_the_field(server):
    for path, body, param in [("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
                              ("/v1/completions", {"model": "default"}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role")]:
        r = _post(server, path, body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and param.split(".")[0] in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt": "word " * 5000, "max_tokens": 1})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]


def test_payload_limit_is_413_and_server_keeps_serving(server):
    big = json.dumps({"text": "x" * PAYLOAD}).encode()
    r = requests.post(server.base_url + "/generate", data=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-payload-size" in r.json()["error"]["message"], r.text

    def chunks():  # no Content-Length: the limit is enforced as the body arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = requests.post(server.base_url + "/generate", data=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    small = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode()
    r = requests.post(server.base_url + "/generate", data=iter([small[:5], small[5:]]),
                      headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text  # a chunked body under the limit is served
    _ok(server)


# -- /generate fields ------------------------------------------------------------------------------------
def test_return_text_in_logprobs(server, tok):
    body = {"text": "The capital of France is", "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    meta = _post(server, "/generate", body).json()["meta_info"]
    plain = _post(server, "/generate", {**body, "return_text_in_logprobs": False}).json()["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [(lp, i) for lp, i, _ in meta[key]] == [(lp, i) for lp, i, _ in plain[key]]
        assert all(t == tok.decode([i]) for _, i, t in meta[key]) and all(t is None for *_, t in plain[key])
    for key in ("input_top_logprobs", "output_top_logprobs"):
        rows = [row for row in meta[key] if row is not None]
        assert rows and all(len(row) == 3 and all(t == tok.decode([i]) for _, i, t in row) for row in rows)
    with requests.post(server.base_url + "/generate", json={**body, "stream": True}, stream=True, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    assert events[-1]["meta_info"]["output_token_logprobs"] == [list(x) for x in meta["output_token_logprobs"]]
    r = _post(server, "/generate", {**body, "return_text_in_logprobs": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_text_in_logprobs"


def test_finish_reasons_have_upstream_shape(server, tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    r = _post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                          "ignore_eos": True}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    stop_id = r["output_ids"][1]
    r = _post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                          "stop_token_ids": [stop_id]}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def _hidden_size() -> int:
    from sglang.srt.model_loader.builtin import resolve_model_path

    with open(f"{resolve_model_path(MODEL)}/config.json") as f:
        return json.load(f)["hidden_size"]


def test_return_hidden_states_shape_and_engine_equality(server, tok):
    h = _hidden_size()
    prompts = [tok.encode("The capital of France is", add_special_tokens=False), [5, 6, 7]]
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    res = _post(server, "/generate", {"input_ids": prompts, "sampling_params": sp, "return_hidden_states": True}).json()
    for ids, r in zip(prompts, res):
        hs = r["meta_info"]["hidden_states"]
        # upstream's shape: the prompt's rows as one block, then one row per generated token fed back
        assert len(hs) == r["meta_info"]["completion_tokens"] == 5
        assert len(hs[0]) == len(ids) and all(len(row) == h for row in hs[0])
        assert all(len(row) == h and isinstance(row[0], float) for row in hs[1:])
    assert "hidden_states" not in _post(server, "/generate", {"input_ids": prompts[0], "sampling_params": sp}
                                        ).json()["meta_info"]
    engine = Engine(model_path=MODEL, max_total_tokens=8192, random_seed=0, enable_return_hidden_states=True)
    expect = engine.generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True)
    for ids, r, e in zip(prompts, res, expect):
        assert r["output_ids"] == e["output_ids"]
        ours = torch.tensor(r["meta_info"]["hidden_states"][0] + r["meta_info"]["hidden_states"][1:])
        ref = torch.tensor(e["meta_info"]["hidden_states"][0] + e["meta_info"]["hidden_states"][1:])
        assert ours.shape == (len(ids) + len(r["output_ids"]) - 1, h)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    r = _post(server, "/generate", {"text": "x", "return_hidden_states": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"


@pytest.mark.parametrize("n", [1, 2])
def test_hidden_states_in_streams(client, n):
    """Upstream's client test: a streamed chat carries the hidden states in `delta.hidden_states`,
    one chunk per choice after its finish (the last generated token's row); a streamed completion
    on the finishing choice; none without return_hidden_states."""
    h = _hidden_size()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    for want in (False, True):
        found = []
        for ch in client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=6, temperature=0, n=n,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_hidden_states": want, "ignore_eos": True}):
            for c in ch.choices:
                if hasattr(c.delta, "hidden_states"):
                    assert c.delta.hidden_states is not None and c.finish_reason is None
                    found.append((c.index, c.delta.hidden_states))
        if not want:
            assert found == []
            continue
        assert sorted(i for i, _ in found) == list(range(n))
        assert all(len(hs) == h and isinstance(hs[0], float) for _, hs in found)
        done = client.chat.completions.create(model=SERVED, messages=msgs, max_tokens=6, temperature=0,
                                              extra_body={"return_hidden_states": True, "ignore_eos": True})
        # non-streamed, upstream's shape too: the last generated token's row (1-D), not every row
        assert found[0][1] == pytest.approx(done.choices[0].model_extra["hidden_states"], abs=1e-5)
    found = [c.hidden_states for ch in client.completions.create(
        model=SERVED, prompt=["The capital of France is", "x"], max_tokens=4, temperature=0, n=n, stream=True,
        extra_body={"return_hidden_states": True}) for c in ch.choices if hasattr(c, "hidden_states")]
    assert len(found) == 2 * n and all(hs for hs in found)


# -- metrics + stats logs ------------------------------------------------------------------------------
def _metrics(server) -> dict[str, dict]:
    """{sample name: {'value': v, 'labels': ...}} for every sample of every sglang: family."""
    text = requests.get(server.base_url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("sglang:") and not s.labels.get("le"):
                out[s.name] = {"value": s.value, "labels": s.labels}
    return out


def test_metrics_have_upstream_names_and_sane_values(server, client):
    server.wait_idle()
    before = _metrics(server)
    results = [client.completions.create(model=SERVED, prompt=f"Request number {i} says", max_tokens=6 + i,
                                         temperature=0, extra_body={"ignore_eos": True}) for i in range(3)]
    after = _metrics(server)

    def delta(name):
        return after[name]["value"] - before.get(name, {"value": 0})["value"]

    assert delta("sglang:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in results)
    assert delta("sglang:generation_tokens_total") == sum(r.usage.completion_tokens for r in results) == 6 + 7 + 8
    assert delta("sglang:num_requests_total") == 3
    assert delta("sglang:e2e_request_latency_seconds_count") == 3
    assert delta("sglang:time_to_first_token_seconds_count") == 3
    assert delta("sglang:inter_token_latency_seconds_count") >= 3  # at least one gap per request
    assert delta("sglang:inter_token_latency_seconds_sum") > 0
    assert after["sglang:num_aborted_requests_total"]["value"] >= 0
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:token_usage",
                 "sglang:gen_throughput", "sglang:cache_hit_rate", "sglang:max_total_num_tokens",
                 "sglang:cached_tokens_total", "sglang:time_per_output_token_seconds_count"):
        assert name in after, name
    assert all(m["labels"] == {"model_name": SERVED} for m in after.values())
    idle = _metrics(server)  # every request finished: nothing runs, waits or holds KV
    assert idle["sglang:num_running_reqs"]["value"] == idle["sglang:num_queue_reqs"]["value"] == 0
    assert idle["sglang:num_used_tokens"]["value"] == 0 and idle["sglang:token_usage"]["value"] == 0
    assert idle["sglang:max_total_num_tokens"]["value"] == 8192
    assert idle["sglang:gen_throughput"]["value"] > 0  # >= 4 decode steps ran (--decode-log-interval 4)
    assert 0 <= idle["sglang:cache_hit_rate"]["value"] <= 1
    assert idle["sglang:spec_accept_length"]["value"] == 0  # no speculative decoding on this server


DECODE_LINE = re.compile(r"Decode batch\. #running-req: (\d+), #token: (\d+), token usage: (\d\.\d\d), "
                         r"cuda graph: (True|False), gen throughput \(token/s\): (\d+\.\d\d), #queue-req: (\d+), ")
PREFILL_LINE = re.compile(r"Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), "
                          r"token usage: (\d\.\d\d), #running-req: (\d+), #queue-req: (\d+), ")


def _full_log(server) -> str:
    server._log.flush()
    with open(server.log_path) as f:
        return f.read()


def test_prefill_and_decode_stats_lines(server, tok):
    prompt = "A long enough prompt for a stats line " * 3
    n_prompt = len(tok.encode(prompt, add_special_tokens=False))
    _post(server, "/flush_cache", {})
    start = len(_full_log(server))
    _post(server, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 9, "temperature": 0,
                                                                    "ignore_eos": True}})
    deadline = time.monotonic() + 60
    while True:  # the scheduler's log lines reach the file asynchronously
        log = _full_log(server)[start:]
        prefills, decodes = PREFILL_LINE.findall(log), DECODE_LINE.findall(log)
        if (prefills and len(decodes) >= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert prefills and len(decodes) >= 2, log[-3000:]  # 8 decode steps, a line every 4
    new_seq, new_tok, cached, usage, _, _ = prefills[0]
    assert (int(new_seq), int(new_tok), int(cached)) == (1, n_prompt, 0)
    assert 0 <= float(usage) <= 1
    running, tokens, usage, graph, thr, queue = decodes[0]
    assert int(running) == 1 and int(tokens) >= n_prompt and float(thr) > 0 and int(queue) == 0
    on_gpu = requests.get(server.base_url + "/get_server_info").json()["device"] == "cuda"
    assert graph == str(on_gpu)  # decode replays CUDA graphs on GPUs; none on CPU


def test_hidden_states_match_transformers(builtin_path):
    """The oracle: transformers' hidden_states[-1] (after the final norm) at every position of
    prompt + outputs[:-1], across chunked prefill, a batch, and a prefix the cache already holds."""
    from sglang.srt.testing.reference import load_hf_reference

    path = builtin_path("tiny-deepseek-v32")
    hf = load_hf_reference(path)
    # page 1 so that 16-token chunks are allowed on GPUs too (SGLANG_TEST_DEVICE=cuda: ours on the GPU)
    engine = Engine(model_path=path, dtype="float32", max_total_tokens=4096, nsa_index_k_dtype="float32",
                    device=os.environ.get("SGLANG_TEST_DEVICE", "cpu"), page_size=1, random_seed=0,
                    enable_return_hidden_states=True, chunked_prefill_size=16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (5, 40)]
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    engine.generate(input_ids=prompts[1], sampling_params=sp)  # its prompt is now cached: must not be skipped
    for p, r in zip(prompts, engine.generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True)):
        hs = r["meta_info"]["hidden_states"]
        ours = torch.tensor(hs[0] + hs[1:])
        with torch.no_grad():
            ref = hf(torch.tensor([p + r["output_ids"][:-1]]), output_hidden_states=True).hidden_states[-1][0]
        assert ours.shape == ref.shape == (len(p) + 5, hf.config.hidden_size)
        torch.testing.assert_close(ours, ref.float(), rtol=0, atol=1e-4)


def test_engine_generate_argument_errors_name_the_argument():
    """Engine.generate refuses what /generate refuses (exactly one of prompt / input_ids, lists of matching
    length, known sampling parameters) with a ValueError, and keeps serving after each."""
    engine = Engine(model_path=MODEL, max_total_tokens=2048, random_seed=0)
    sp = {"max_new_tokens": 2}
    for kwargs, match in ((dict(prompt="hi", input_ids=[1, 2]), "exactly one of prompt or input_ids"),
                          (dict(prompt=[]), "no prompts"),
                          (dict(prompt=["a", "b"], sampling_params=[sp]), "1 sampling_params for 2 prompts"),
                          (dict(prompt="hi", sampling_params={"bogus": 1}), "bogus"),
                          (dict(prompt=["a", "b"], stream=True), "single prompt")):
        with pytest.raises(ValueError, match=match):
            engine.generate(**{"sampling_params": sp, **kwargs})
        assert not engine.scheduler.has_work() and not engine._live, kwargs  # nothing was queued
    assert engine.generate(prompt="ok", sampling_params=sp)["meta_info"]["completion_tokens"] == 2
    assert engine.scheduler.kv_leak_report() is None
    engine.shutdown()


def test_engine_async_generate_concurrent_tasks_equal_generate(tok):
    """async_generate (upstream's asyncio entry point): concurrent tasks share the scheduler's steps and
    each gets exactly its own tokens -- equal to the synchronous generate of the same prompts -- and a
    streamed task's deltas join to its text; a bad batch queues nothing."""
    import asyncio

    engine = Engine(model_path=MODEL, max_total_tokens=4096, random_seed=0)
    prompts = [[5 + i, 17, 30 + 3 * i, 8] for i in range(6)]
    sp = [{"max_new_tokens": 3 + 2 * i, "temperature": 0, "ignore_eos": True} for i in range(6)]
    ref = engine.generate(input_ids=prompts, sampling_params=sp)

    async def main():
        async def streamed():  # each chunk: the result so far (upstream's), the last one whole
            chunks = [c async for c in await engine.async_generate(input_ids=prompts[0], sampling_params=sp[0],
                                                                   stream=True)]
            assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
            return chunks[-1]["text"], chunks[-1]["meta_info"]["completion_tokens"]

        tasks = [engine.async_generate(input_ids=p, sampling_params=s) for p, s in zip(prompts, sp)]
        return await asyncio.gather(streamed(), engine.async_generate(input_ids=prompts, sampling_params=sp), *tasks)

    (text0, n0), batch, *single = asyncio.run(main())
    assert [o["output_ids"] for o in single] == [o["output_ids"] for o in batch] == [o["output_ids"] for o in ref]
    assert text0 == ref[0]["text"] and n0 == 3
    # upstream's doc helpers over the same streams (sglang.utils)
    from sglang.utils import async_stream_and_merge, stream_and_merge

    text = tok.decode(prompts[1])
    want = engine.generate(text, sp[1])["text"]
    assert stream_and_merge(engine, text, sp[1]) == want

    async def merged():
        return "".join([piece async for piece in async_stream_and_merge(engine, text, sp[1])])

    assert asyncio.run(merged()) == want
    # a stream left early: its request is aborted at the next step, its KV freed
    stream = engine.generate(input_ids=prompts[2], sampling_params={"max_new_tokens": 200, "ignore_eos": True},
                             stream=True)
    next(stream), next(stream)
    stream.close()
    assert engine.generate(input_ids=prompts[3], sampling_params=sp[3])["output_ids"] == ref[3]["output_ids"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(input_ids=prompts[:2], sampling_params=[sp[0], {"max_new_tokens": -1}])
    assert not engine._live and not engine.scheduler.has_work() and engine.scheduler.kv_leak_report() is None
    engine.shutdown()


@pytest.mark.parametrize("kwargs,flag", [(dict(tp_size=2), "--tp-size"),
                                         (dict(disaggregation_mode="prefill"), "--disaggregation-mode")])
def test_engine_refuses_what_needs_the_server(kwargs, flag):
    """The offline Engine is one in-process rank: tp_size 2 used to run silently as one rank."""
    with pytest.raises(ValueError, match=flag):
        Engine(model_path=MODEL, max_total_tokens=1024, **kwargs)
