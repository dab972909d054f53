"""Structured outputs and custom logit processors end to end through a real server (random
weights, so every guarantee comes from the grammar / the processor, not from the model):

- regex / json_schema / ebnf outputs ALWAYS match, sampled or greedy, batched with unconstrained
  requests, streamed or not, and end on EOS (the grammar terminated);
- a grammar that does not compile is a 400 naming the field, before any stream starts, and the
  server keeps serving; --grammar-backend none refuses grammars with a 400;
- ScriptedTokensLogitProcessor forces an exact token sequence, in batches, through chunked
  prefill and through retraction (KV cache too small for the running batch);
- without --enable-custom-logit-processor a processor is a 400 naming the flag;
- after every test the server is idle with no KV or request-slot leak.
"""

from __future__ import annotations

import json
import random
import re
import threading

import pytest
import requests

pytest.importorskip("xgrammar")
pytest.importorskip("dill")

from sglang.srt.testing.logit_processors import ScriptedTokensLogitProcessor, scripted_request  # noqa: E402
from sglang.srt.testing.server import ServerProcess  # noqa: E402
from sglang.srt.model_loader.tiny_models import EOS_TOKEN_ID  # noqa: E402

try:
    import jsonschema
except ImportError:  # pragma: no cover
    jsonschema = None

MODEL = "builtin:tiny-deepseek-v32"
KV_TOKENS = 704  # 11 pages of 64 on GPUs
CHUNK = 64  # a multiple of the GPU page size
TIMEOUT = 300

REGEX = r"\d{2}-(yes|no)"
REGEX2 = r"(red|green|blue)=[0-9]{1,3}"
EBNF = 'root ::= ("yes" | "no" | "maybe") " " digit\ndigit ::= [0-3]'
SCHEMA = {"type": "object",
          "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"},
                         "c": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a", "b", "c", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, "--max-total-tokens", str(KV_TOKENS), "--chunked-prefill-size", str(CHUNK),
                       "--enable-custom-logit-processor", "--constrained-json-disable-any-whitespace",
                       timeout=TIMEOUT) as s:
        yield s


@pytest.fixture(autouse=True)
def no_leak(request):
    yield
    for name in ("server", "server_none"):
        if name in request.fixturenames:
            st = request.getfixturevalue(name).wait_idle(timeout=120)
            assert st["kv_leak"] is None, st


def generate(server, body, status=200):
    r = requests.post(server.base_url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    return r.json()


def check_json(text):
    obj = json.loads(text)
    if jsonschema is not None:
        jsonschema.validate(obj, SCHEMA)
    assert set(obj) == {"a", "b", "c", "n"} and obj["a"] in ("x", "yz") and isinstance(obj["b"], bool)
    assert len(obj["c"]) <= 3 and all(v in (1, 2) for v in obj["c"]) and 0 <= obj["n"] <= 99


def check_constrained(result, kind, pattern=None):
    fr = result["meta_info"]["finish_reason"]
    assert fr["type"] == "stop" and fr["matched"] == EOS_TOKEN_ID, (fr, result["text"])
    assert result["output_ids"][-1] == EOS_TOKEN_ID
    text = result["text"]
    if kind == "regex":
        assert re.fullmatch(pattern, text), text
    elif kind == "ebnf":
        assert re.fullmatch(r"(yes|no|maybe) [0-3]", text), text
    else:
        check_json(text)


def test_mixed_batch_constraints_always_hold(server):
    kinds = [("regex", REGEX), (None, None), ("json", None), ("ebnf", None), (None, None), ("regex", REGEX2),
             ("json", None), ("ebnf", None)]
    for round_ in range(2):
        sps = []
        for i, (kind, pattern) in enumerate(kinds):
            sp = {"max_new_tokens": 64 if kind else 12, "temperature": 0 if i >= 6 else 1.0,
                  "sampling_seed": 100 * round_ + i}
            if kind == "regex":
                sp["regex"] = pattern
            elif kind == "json":
                sp["json_schema"] = json.dumps(SCHEMA)
            elif kind == "ebnf":
                sp["ebnf"] = EBNF
            sps.append(sp)
        results = generate(server, {"text": [f"prompt {round_} {i}" for i in range(len(kinds))],
                                    "sampling_params": sps})
        for (kind, pattern), res in zip(kinds, results):
            if kind is None:
                assert res["meta_info"]["finish_reason"] is not None and res["output_ids"]
            else:
                check_constrained(res, kind, pattern)


def test_concurrent_requests_with_the_same_and_different_grammars(server):
    results, errors = {}, []

    def run(i):
        try:
            kind = ("regex", "json", "ebnf")[i % 3]
            sp = {"max_new_tokens": 64, "temperature": 0.8, "sampling_seed": i}
            sp.update({"regex": {"regex": REGEX}, "json": {"json_schema": SCHEMA}, "ebnf": {"ebnf": EBNF}}[kind])
            results[i] = (kind, generate(server, {"text": f"concurrent {i}", "sampling_params": sp}))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    assert len(results) == 9
    for kind, res in results.values():
        check_constrained(res, kind, REGEX)


def _stream(server, body):
    texts = []
    with requests.post(server.base_url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, event
            texts.append(event)
    assert texts
    return texts


def test_streaming_outputs_match(server):
    for sp in ({"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "sampling_seed": 7},
               {"regex": REGEX2, "temperature": 1.0, "sampling_seed": 8}):
        events = _stream(server, {"text": "stream me", "sampling_params": {"max_new_tokens": 64, **sp}})
        final = events[-1]
        for ev in events:
            assert final["text"].startswith(ev["text"])
        if "regex" in sp:
            check_constrained(final, "regex", REGEX2)
        else:
            check_constrained(final, "json")


@pytest.mark.parametrize("sp,param", [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": json.dumps({"type": "no-such-type"})}, "json_schema"),
    ({"regex": "([a-"}, "regex"),
    ({"ebnf": "root ::= "}, "ebnf"),
    ({"structural_tag": json.dumps({"structures": [{"begin": "<f>"}]})}, "structural_tag"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex"),
    ({"regex": 5}, "regex"),
])
def test_bad_grammar_is_a_400_naming_the_field(server, sp, param):
    for stream in (False, True):
        r = requests.post(server.base_url + "/generate", timeout=TIMEOUT,
                          json={"text": "x", "stream": stream, "sampling_params": {"max_new_tokens": 4, **sp}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], err
    ok = generate(server, {"text": "still serving", "sampling_params": {"max_new_tokens": 16, "regex": REGEX,
                                                                       "temperature": 0}})
    check_constrained(ok, "regex", REGEX)


def test_structural_tag_accepted(server):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    res = generate(server, {"text": "tag", "sampling_params": {"max_new_tokens": 8, "structural_tag": json.dumps(tag),
                                                              "temperature": 0}})
    assert res["meta_info"]["finish_reason"] is not None


def _script(rng, n):
    return [rng.randrange(5, 1024) for _ in range(n)]


def test_scripted_processor_exact_in_batches_and_chunked_prefill(server):
    rng = random.Random(0)
    scripts = [_script(rng, 12), _script(rng, 3), _script(rng, 20)]
    proc = ScriptedTokensLogitProcessor.to_str()
    long_prompt = [rng.randrange(5, 1024) for _ in range(3 * CHUNK + 5)]  # several prefill chunks
    prompts = [long_prompt, [7, 8, 9], [rng.randrange(5, 1024) for _ in range(CHUNK + 1)], [10, 11]]
    sps = [{"max_new_tokens": len(s) + 5, "temperature": t, "top_p": 0.7, "custom_params": {"token_ids": s}}
           for s, t in zip(scripts, (1.0, 0.0, 1.5))]
    sps.append({"max_new_tokens": 6, "temperature": 1.0})  # an unconstrained batch mate
    results = generate(server, {"input_ids": prompts, "sampling_params": sps,
                                "custom_logit_processor": [proc, proc, proc, None]})
    for script, res in zip(scripts, results):
        assert res["output_ids"] == script + [EOS_TOKEN_ID]
        assert res["meta_info"]["finish_reason"]["matched"] == EOS_TOKEN_ID
    assert len(results[3]["output_ids"]) >= 1
    # Streaming, and the helper's own body.
    script = _script(rng, 9)
    events = _stream(server, {"input_ids": long_prompt, **scripted_request(script, temperature=1.0)})
    assert events[-1]["output_ids"] == script + [EOS_TOKEN_ID]


def test_scripted_processor_survives_retraction(server):
    rng = random.Random(1)
    n_req, prompt_len, script_len = 8, 40, 80
    assert n_req * (prompt_len + script_len) > KV_TOKENS  # the running batch cannot fit: retraction
    scripts = [_script(rng, script_len) for _ in range(n_req)]
    prompts = [[rng.randrange(5, 1024) for _ in range(prompt_len)] for _ in range(n_req)]
    results, errors = {}, []

    def run(i):
        try:
            if i < n_req:
                results[i] = generate(server, {"input_ids": prompts[i], **scripted_request(scripts[i],
                                                                                            temperature=1.0)})
            else:  # grammar requests in the same crowd: their state must survive retraction too
                results[i] = generate(server, {"input_ids": [5 + i] * prompt_len, "sampling_params": {
                    "max_new_tokens": 64, "regex": REGEX2, "temperature": 1.0, "sampling_seed": i}})
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_req + 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    for i in range(n_req):
        assert results[i]["output_ids"] == scripts[i] + [EOS_TOKEN_ID], i
    for i in (n_req, n_req + 1):
        check_constrained(results[i], "regex", REGEX2)
    assert "retracted" in server.log(), "the test needs the KV cache to overflow"


def test_processor_with_a_grammar_that_it_violates_is_an_abort_not_a_crash(server):
    # Forcing a token the grammar does not allow: the request ends with a 400 abort naming the grammar.
    body = {"text": "x", **scripted_request([900, 901])}
    body["sampling_params"]["regex"] = "(yes|no)"
    r = requests.post(server.base_url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and "grammar" in r.json()["error"]["message"], r.text
    generate(server, {"text": "still serving", "sampling_params": {"max_new_tokens": 2}})


CLIENT_MODULE = """
import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

FORCED = 7  # a module-level global the method reads


def helper_offset():
    return 1


class ForceFromParams(CustomLogitProcessor):
    def __init__(self):
        super().__init__()  # the __class__ cell refers to the class sent by value

    def __call__(self, logits, custom_param_list=None):
        logits[:] = float("-inf")
        for row, params in enumerate(custom_param_list or []):
            logits[row, params.get("token", FORCED) + self.offset()] = 0.0
        return logits

    @staticmethod
    def offset():
        return 0
"""


def test_processor_from_a_module_the_server_cannot_import(server, tmp_path, monkeypatch):
    """Issue 22 item 5: a class from a client-only module (a test file, a notebook's package) is
    sent by value, so the server runs it instead of answering "No module named ..."."""
    import importlib
    import sys

    (tmp_path / "client_only_procs_22.py").write_text(CLIENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # this process only: the server cannot import it
    mod = importlib.import_module("client_only_procs_22")
    try:
        proc = mod.ForceFromParams.to_str()
    finally:
        sys.modules.pop("client_only_procs_22", None)
    for token in (None, 11):
        params = {} if token is None else {"token": token}
        r = requests.post(server.base_url + "/generate", timeout=TIMEOUT, json={
            "text": "x", "custom_logit_processor": proc,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "custom_params": params}})
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == [token or mod.FORCED] * 3


def test_bad_processor_is_a_400(server):
    for bad in ("not a processor", json.dumps({"callable": "00"})):
        r = requests.post(server.base_url + "/generate", timeout=TIMEOUT,
                          json={"text": "x", "custom_logit_processor": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "custom_logit_processor", r.text
    r = requests.post(server.base_url + "/generate", timeout=TIMEOUT,
                      json={"text": ["x", "y"], "custom_logit_processor": ["a"]})  # wrong list length
    assert r.status_code == 400 and r.json()["error"]["param"] == "custom_logit_processor", r.text


def test_missing_xgrammar_is_a_warning_then_400s(tmp_path):
    """Issue 22 item 7: on a machine without the xgrammar package the server starts (a warning),
    serves plain requests, and refuses each grammar request with a 400 naming its field."""
    import os

    import openai

    fake = tmp_path / "no_xgrammar" / "xgrammar"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('xgrammar is not installed (simulated)')\n")
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    with ServerProcess(MODEL, "--max-total-tokens", "2048", "--log-level", "warning", env={"PYTHONPATH": path},
                       timeout=TIMEOUT) as s:
        assert "needs the xgrammar package" in s.log()
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused")
        msgs = [{"role": "user", "content": "hi"}]
        assert client.chat.completions.create(model="default", messages=msgs, max_tokens=3).choices[0].message
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        for kw, param in [({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"extra_body": {"regex": "a+"}}, "regex"),
                          ({"tools": [tool], "tool_choice": "required"}, "tool_choice")]:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="default", messages=msgs, max_tokens=3, **kw)
            assert e.value.body["param"] == param and "xgrammar" in e.value.body["message"], e.value.body
        r = requests.post(s.base_url + "/generate", timeout=TIMEOUT,
                          json={"text": "x", "sampling_params": {"max_new_tokens": 2, "ebnf": 'root ::= "a"'}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ebnf", r.text
        assert requests.post(s.base_url + "/generate", timeout=TIMEOUT, json={
            "text": "x", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


@pytest.fixture(scope="module")
def server_none():
    with ServerProcess(MODEL, "--max-total-tokens", "2048", "--grammar-backend", "none", timeout=TIMEOUT) as s:
        yield s


def test_disabled_features_are_400s(server_none):
    for field, value in (("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("ebnf", EBNF)):
        r = requests.post(server_none.base_url + "/generate", timeout=TIMEOUT,
                          json={"text": "x", "sampling_params": {field: value}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "structured outputs are disabled" in err["message"], err
    r = requests.post(server_none.base_url + "/generate", timeout=TIMEOUT,
                      json={"text": "x", **scripted_request([5, 6])})
    assert r.status_code == 400 and "--enable-custom-logit-processor" in r.json()["error"]["message"], r.text
    res = generate(server_none, {"text": "plain", "sampling_params": {"max_new_tokens": 3}})
    assert res["output_ids"]


@pytest.fixture(scope="module")
def server_tp2():
    with ServerProcess(MODEL, "--tp-size", "2", "--max-total-tokens", "2048", "--enable-custom-logit-processor",
                       "--constrained-json-disable-any-whitespace", timeout=TIMEOUT) as s:
        yield s


def test_tp2_ranks_agree_on_grammar_admission(server_tp2):
    # Rank 0 decides which compiled grammars are admitted and broadcasts it: with concurrent
    # first-sight grammars the ranks must still run the same batches (a mismatch hangs or fails).
    results, errors = {}, []

    def run(i):
        try:
            sp = {"max_new_tokens": 64, "temperature": 1.0, "sampling_seed": i}
            kind = ("regex", "json", "ebnf")[i % 3]
            sp.update({"regex": {"regex": REGEX}, "json": {"json_schema": SCHEMA}, "ebnf": {"ebnf": EBNF}}[kind])
            results[i] = (kind, generate(server_tp2, {"text": f"tp {i}", "sampling_params": sp}))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    for kind, res in results.values():
        check_constrained(res, kind, REGEX)
    script = [11, 12, 13, 14]
    assert generate(server_tp2, {"text": "tp", **scripted_request(script)})["output_ids"] == script + [EOS_TOKEN_ID]
    assert server_tp2.wait_idle(timeout=120)["kv_leak"] is None
