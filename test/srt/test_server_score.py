"""POST /v1/score (upstream's scoring API) through the server, over HTTP (the openai client has
no method for it): shapes, the probabilities against an independent path (the top logprobs of
/generate's first output token), apply_softmax, item_first, text vs token ids, the prefix cache
shared by the items of one query, and 400s naming the field."""

from __future__ import annotations

import math

import pytest
import requests

from sglang.srt.managers.tokenizer_utils import load_tokenizer
from sglang.srt.testing.server import ServerProcess

MODEL = "builtin:tiny-deepseek-v32"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(MODEL, "--max-total-tokens", "8192", "--random-seed", "0") as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODEL)


def score(server, **body):
    return requests.post(server.base_url + "/v1/score", json={"model": "default", **body}, timeout=120)


def next_token_top(server, ids: list[int], k: int = 20) -> dict[int, float]:
    """The first output token's top-k logprobs from /generate: the reference distribution."""
    r = requests.post(server.base_url + "/generate", json={
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": k,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=120).json()
    return {tid: lp for lp, tid, *_ in r["meta_info"]["output_top_logprobs"][0]}


def test_scores_match_the_next_token_distribution(server, tok):
    query = tok.encode("Is the sky blue? Answer:", add_special_tokens=False)
    items = [tok.encode(" yes or no", add_special_tokens=False), tok.encode(" maybe", add_special_tokens=False),
             tok.encode(" the sky is", add_special_tokens=False)]
    ref = [next_token_top(server, query + it) for it in items]
    labels = sorted(ref[0], key=ref[0].get, reverse=True)[:3]  # ids ranked in item 0's top 20
    r = score(server, query=query, items=items, label_token_ids=labels)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and len(body["scores"]) == 3 and all(len(s) == 3 for s in body["scores"])
    for j, t in enumerate(labels):
        assert body["scores"][0][j] == pytest.approx(math.exp(ref[0][t]), rel=1e-3, abs=1e-6)
    for i in (1, 2):
        for j, t in enumerate(labels):
            if t in ref[i]:
                assert body["scores"][i][j] == pytest.approx(math.exp(ref[i][t]), rel=1e-3, abs=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(len(query) + len(it) for it in items)
    # the items of one query share its prefix in the cache
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * len(query)

    soft = score(server, query=query, items=items, label_token_ids=labels, apply_softmax=True).json()["scores"]
    for row, raw in zip(soft, body["scores"]):
        assert sum(row) == pytest.approx(1.0, abs=1e-6)
        assert row == pytest.approx([p / sum(raw) for p in raw], rel=1e-4)


def test_text_item_first_and_single_item(server, tok):
    labels = tok.encode(" yes no", add_special_tokens=False)[:2]
    text = score(server, query=" Answer:", items=["Is it so?", "Is it not?"], label_token_ids=labels,
                 item_first=True).json()
    ids = [tok.encode(s + " Answer:", add_special_tokens=False) for s in ("Is it so?", "Is it not?")]
    by_ids = score(server, query=[], items=ids, label_token_ids=labels).json()
    for a, b in zip(text["scores"], by_ids["scores"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    one = score(server, query="Is it so?", items=" Answer:", label_token_ids=labels).json()
    assert len(one["scores"]) == 1
    assert one["scores"][0] == pytest.approx(text["scores"][0], rel=1e-4)
    repeated = score(server, query=[5, 6], items=[[7]], label_token_ids=[9, 9, 10]).json()["scores"][0]
    assert repeated[0] == repeated[1]


@pytest.mark.parametrize("body,param", [
    ({"query": "q", "items": [], "label_token_ids": [1]}, "items"),
    ({"query": "q", "label_token_ids": [1]}, "items"),
    ({"items": ["a"], "label_token_ids": [1]}, "query"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "q", "items": ["a"]}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [10**7]}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [-1]}, "label_token_ids"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items"),
    ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "items"),
    ({"query": [1, 2], "items": [[10**7]], "label_token_ids": [1]}, "items"),
    ({"query": {"a": 1}, "items": ["a"], "label_token_ids": [1]}, "query"),
    ({"query": "word " * 5000, "items": ["a"], "label_token_ids": [1]}, "items"),
    ({"query": "q", "items": ["a"], "label_token_ids": [1], "model": "nope"}, "model"),
])
def test_bad_input_is_a_4xx_naming_the_field(server, body, param):
    r = score(server, **body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    assert score(server, query="q", items=["a"], label_token_ids=[1]).status_code == 200
