"""The OpenAI-compatible server, driven with the official `openai` client, against the offline
Engine on the same builtin model (greedy outputs must be identical)."""

import openai
import pytest
import requests

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"
ARGS = ("--max-total-tokens", "16384", "--random-seed", "0")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Question: 3 + 4 = ?\nAnswer:",
           "Once upon a time, in a land far away, there lived a wizard who"]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module", params=["overlap", "sync"])
def server(request):
    """Every case runs against the overlap scheduler (the default) and --disable-overlap-schedule."""
    extra = ["--disable-overlap-schedule"] if request.param == "sync" else []
    env = {"SGLANG_CPU_OVERLAP_THREAD": "1"}  # overlap with the forward on a worker thread (CPU)
    with ServerProcess(MODEL, *ARGS, *extra, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def engine():
    return Engine(model_path=MODEL, max_total_tokens=16384, random_seed=0)


def _chat_prompt(engine, content: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)


def test_completions_match_engine(client, engine):
    expect = engine.generate(PROMPTS, GREEDY)
    r = client.completions.create(model="default", prompt=PROMPTS, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [e["text"] for e in expect]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24 * len(PROMPTS)
    assert r.usage.prompt_tokens == sum(e["meta_info"]["prompt_tokens"] for e in expect)


def test_completions_stream_matches_engine(client, engine):
    expect = engine.generate(PROMPTS[3], GREEDY)
    stream = client.completions.create(model="default", prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == expect["text"] and finish == "length"
    assert usage.completion_tokens == 24 and usage.total_tokens == usage.prompt_tokens + 24


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_engine(client, engine, stream):
    content = "Tell me about the sea."
    expect = engine.generate(_chat_prompt(engine, content), GREEDY)
    kw = dict(model="default", messages=[{"role": "user", "content": content}], max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.content == expect["text"]
        assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == expect["meta_info"]["prompt_tokens"]
        return
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expect["text"]
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_n_choices_and_seed(client, engine):
    r = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=12, temperature=0, n=3)
    assert len(r.choices) == 3 and len({c.text for c in r.choices}) == 1  # greedy: identical
    n_prompt = len(engine.tokenizer.encode(PROMPTS[0]))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 36  # prompt billed once
    a = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=7)
    b = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=7)
    c = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=8)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    # a seeded n > 1 request: its choices differ from each other (as OpenAI's and vLLM's), choice 0 is
    # the n = 1 request, and the whole set repeats
    kw = dict(model="default", prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=7, n=3)
    m1, m2 = client.completions.create(**kw), client.completions.create(**kw)
    texts = [ch.text for ch in sorted(m1.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) == 3 and texts[0] == a.choices[0].text
    assert texts == [ch.text for ch in sorted(m2.choices, key=lambda ch: ch.index)]
    chat = dict(model="default", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=16,
                temperature=1.0, seed=7, n=2)
    assert len({ch.message.content for ch in client.chat.completions.create(**chat).choices}) == 2


def test_native_generate_n_choices(server, engine):
    url = server.base_url + "/generate"
    one = requests.post(url, json={"text": PROMPTS[0], "sampling_params": {"n": 3, **GREEDY}}).json()
    assert isinstance(one, list) and len(one) == 3  # a single prompt with n > 1 answers a list
    assert {o["text"] for o in one} == {engine.generate(PROMPTS[0], GREEDY)["text"]}
    two = requests.post(url, json={"text": PROMPTS[:2], "sampling_params": {"n": 2, **GREEDY}}).json()
    expect = [e["text"] for e in engine.generate(PROMPTS[:2], GREEDY)]
    assert [o["text"] for o in two] == [expect[0], expect[0], expect[1], expect[1]]  # prompt-major
    seeded = {"n": 3, "temperature": 1.0, "max_new_tokens": 16, "seed": 5}
    r = requests.post(url, json={"text": PROMPTS[1], "sampling_params": seeded}).json()
    assert len({o["text"] for o in r}) == 3
    assert [o["text"] for o in engine.generate(PROMPTS[1], seeded)] == [o["text"] for o in r]
    bad = requests.post(url, json={"text": PROMPTS[0], "stream": True, "sampling_params": {"n": 2}})
    assert bad.status_code == 400 and bad.json()["param"] == "stream"


def test_stop_strings_trimmed(client, engine):
    full = engine.generate(PROMPTS[3], GREEDY)["text"]
    stop = full[5:8]
    r = client.completions.create(model="default", prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.find(stop)]
    s = client.completions.create(model="default", prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=stop,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == full[: full.find(stop)]


def test_logprobs(client, engine):
    r = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(val, abs=1e-5)  # greedy: chosen == most likely
    e = client.completions.create(model="default", prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=1,
                                  echo=True)
    assert e.choices[0].text.startswith(PROMPTS[0])
    assert e.choices[0].logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    c = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.bytes for t in content)


def test_models_and_native_routes(server, client):
    models = client.models.list()
    assert models.data[0].id == MODEL
    url = server.base_url
    assert requests.get(url + "/health").status_code == 200
    assert requests.get(url + "/health_generate").status_code == 200
    info = requests.get(url + "/get_model_info").json()
    assert info["model_path"] == MODEL and info["is_generation"]
    si = requests.get(url + "/get_server_info").json()
    assert si["max_total_num_tokens"] == 16384 and si["internal_states"][0]["kv_total_tokens"] == 16384
    # newer upstream's names for the same two routes
    assert requests.get(url + "/model_info").json() == info
    assert requests.get(url + "/server_info").json()["max_total_num_tokens"] == 16384
    g = requests.post(url + "/generate", json={"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4,
                                                                                       "temperature": 0}}).json()
    assert len(g["output_ids"]) == 4 and g["meta_info"]["finish_reason"]["type"] == "length"
    batch = requests.post(url + "/generate", json={"text": PROMPTS[:2], "sampling_params": {"max_new_tokens": 3}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    with requests.post(url + "/generate", json={"text": PROMPTS[0], "stream": True,
                                                "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
                       stream=True) as resp:
        lines = [l for l in resp.iter_lines() if l]
    assert lines[-1] == b"data: [DONE]"
    import json

    last = json.loads(lines[-2][len(b"data: "):])
    assert last["text"] == requests.post(url + "/generate", json={
        "text": PROMPTS[0], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()["text"]
