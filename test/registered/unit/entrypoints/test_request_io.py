"""The one request-parsing / JSON-writing path (entrypoints/request_io.py) and the tokenizer's
bytes-per-token bound, without a server: CPU, fast."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import BaseModel

from sglang.srt.entrypoints.openai.utils import sse
from sglang.srt.entrypoints.request_io import SafeJSONResponse, dumps, parse_json_body, validate_model
from sglang.srt.managers.tokenizer_manager import RequestError
from sglang.srt.managers.tokenizer_utils import load_tokenizer, max_input_bytes_per_token


@pytest.mark.parametrize("body,message,param", [
    (b"\xff\xfe{}", "not valid UTF-8", None),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply", None),
    (b'{"a": ', "not valid JSON", None),
    (b'{"prompt": "ok \\ud800"}', "lone UTF-16 surrogate", "prompt"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"content": "\\udfff"}]}', "surrogate", "messages[1].content"),
    (b'{"sampling_params": {"stop": ["a", "\\ud83d"]}}', "surrogate", "sampling_params.stop[1]"),
    (b'{"logit_bias": {"\\ud800": 1}}', "surrogate", "logit_bias.\ud800"),
])
def test_bad_bodies_are_request_errors_naming_the_field(body, message, param):
    with pytest.raises(RequestError) as e:
        parse_json_body(body)
    assert e.value.status_code == 400 and message in e.value.message and e.value.param == param


def test_valid_bodies_parse_including_surrogate_pairs():
    assert parse_json_body(b'{"t": "\\ud83d\\ude00 \\u00e9"}') == {"t": "\U0001F600 \u00e9"}
    assert parse_json_body(b"") == {} and parse_json_body(b'  "\\\\ud800"') == "\\ud800"  # an escaped backslash


def test_model_errors_are_400_naming_the_field():
    class M(BaseModel):
        n: int
        xs: list[float] = []

    with pytest.raises(RequestError) as e:
        validate_model(M, {"n": 1, "xs": [1.0, "x"]})
    assert e.value.status_code == 400 and e.value.param == "xs.1"
    assert validate_model(M, {"n": 2}).n == 2


def test_non_finite_floats_never_reach_json():
    value = {"lp": [float("-inf"), -1.5, (float("nan"), 3)], "x": float("inf")}
    for text in (dumps(value), sse(value)[len("data: "):], SafeJSONResponse(value).body.decode()):
        assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
            "lp": [-9999.0, -1.5, [None, 3]], "x": 9999.0}
    assert dumps({"a": 1.0}) == '{"a": 1.0}'


@pytest.mark.parametrize("name", ["tiny-deepseek-v32", "tiny-glm-moe-dsa"])
def test_bytes_per_token_bound_is_a_true_bound(name):
    """tokens >= ceil(bytes / bound) on adversarial text: long vocabulary entries, special tokens
    (one token for many bytes), multi-byte characters."""
    tok = load_tokenizer(f"builtin:{name}")
    bound = max_input_bytes_per_token(tok)
    assert bound is not None and bound >= max(len(t.encode()) for t in tok.get_added_vocab())
    longest = max(tok.get_vocab(), key=len)
    pieces = [tok.decode([tok.get_vocab()[longest]]), "<|end_of_text|>", "a", " the", "é", "\U0001F600", "\n\n",
              "ﬁ", "  "]
    rng = random.Random(0)
    worst = 0.0
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 200)))
        n = len(tok.encode(text, add_special_tokens=False))
        worst = max(worst, len(text.encode()) / n)
        assert n >= -(-len(text.encode()) // bound), text
    assert worst > bound / 4  # the bound is not vacuously loose either


def test_bytes_per_token_bound_accounts_for_normalizers():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(normalizer):
        t = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if normalizer is not None:
            t.normalizer = normalizer
        return PreTrainedTokenizerFast(tokenizer_object=t)

    assert max_input_bytes_per_token(fast(None)) == 1
    nfkc = fast(normalizers.NFKC())
    bound = max_input_bytes_per_token(nfkc)
    text = "\U0001D400" * 50  # MATHEMATICAL BOLD CAPITAL A: 4 bytes, NFKC -> "A", one byte / one token
    assert len(nfkc.encode(text, add_special_tokens=False)) == 50 >= -(-len(text.encode()) // bound)
    assert max_input_bytes_per_token(fast(normalizers.Strip())) is None  # can delete text: no bound
