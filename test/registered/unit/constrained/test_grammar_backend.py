"""The xgrammar backend on the tiny tokenizer: masks equal a brute-force reference (the set of
tokens that keep the text a prefix of some string in the grammar's finite language), padded
vocabulary ids are never allowed, compile errors name the field, the compile cache, and the mask
as SamplingBatchInfo applies it. CPU, fast."""

from __future__ import annotations

import itertools
import json
import random
import threading

import pytest
import torch

pytest.importorskip("xgrammar")

from sglang.srt.constrained.base_grammar_backend import (  # noqa: E402
    BaseGrammarBackend,
    InvalidGrammar,
    grammar_key,
)
from sglang.srt.constrained.grammar_registry import create_grammar_backend  # noqa: E402
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

# Waits on background compiles: generous, so a busy 2-core machine never times out a correct run;
# a hung compile still fails the test instead of the suite.
WAIT_S = 300

EOS = 1
PAD = 7  # model vocab = tokenizer vocab + PAD, as checkpoints pad the embedding


@pytest.fixture(scope="module")
def tokenizer(builtin_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path("tiny-deepseek-v32"))


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return len(tokenizer) + PAD


@pytest.fixture(scope="module")
def backend(tokenizer, vocab):
    b = XGrammarGrammarBackend(tokenizer, vocab, eos_token_ids=[EOS], any_whitespace=False)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def token_text(tokenizer):
    special = set(tokenizer.all_special_ids)
    return {t: tokenizer.decode([t]) for t in range(len(tokenizer)) if t not in special}


def compile_ok(backend, kind, text):
    value = backend._init_value_dispatch((kind, text))
    assert not isinstance(value, InvalidGrammar), value.error_message()
    return value


def allowed(grammar, vocab) -> set[int]:
    mask = grammar.allocate_vocab_mask(vocab, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    bits = mask[0].tolist()
    return {t for t in range(vocab) if (bits[t // 32] >> (t % 32)) & 1}


def reference(language: set[str], prefix: str, token_text: dict[int, str]) -> set[int]:
    """Tokens whose text keeps prefix a prefix of some string of the language; EOS when complete."""
    out = {t for t, s in token_text.items() if s and any(w.startswith(prefix + s) for w in language)}
    if prefix in language:
        out.add(EOS)
    return out


def walk_and_check(backend, kind, text, language, token_text, vocab, seed=0, walks=6):
    """Random walks through the grammar; at every step the mask must equal the reference."""
    rng = random.Random(seed)
    for _ in range(walks):
        g = compile_ok(backend, kind, text)
        prefix = ""
        for _step in range(200):
            got = allowed(g, vocab)
            assert got == reference(language, prefix, token_text), (kind, text, prefix)
            assert not any(t >= vocab - PAD for t in got), "padded ids must never be allowed"
            tok = rng.choice(sorted(got))
            assert g.accept_token(tok)
            if tok == EOS:
                assert g.is_terminated()
                assert prefix in language
                break
            prefix += token_text[tok]
        else:
            pytest.fail("walk did not terminate")


def test_regex_mask_matches_brute_force(backend, token_text, vocab):
    language = {f"{a}{b}-{w}" for a, b in itertools.product("0123456789", repeat=2) for w in ("yes", "no")}
    walk_and_check(backend, "regex", r"\d{2}-(yes|no)", language, token_text, vocab)


def test_ebnf_mask_matches_brute_force(backend, token_text, vocab):
    grammar = 'root ::= ("yes" | "no" | "maybe") " " digit\ndigit ::= [0-3]'
    language = {f"{w} {d}" for w in ("yes", "no", "maybe") for d in "0123"}
    walk_and_check(backend, "ebnf", grammar, language, token_text, vocab, seed=1)


def test_json_schema_mask_matches_brute_force(backend, token_text, vocab):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    # any_whitespace=False: xgrammar's compact layout, keys in schema order.
    language = {f'{{"a": "{a}", "b": {b}}}' for a in ("x", "yz") for b in ("true", "false")}
    language |= {json.dumps({"a": a, "b": b}, separators=(",", ":")) for a in ("x", "yz") for b in (True, False)}
    # Either separator style may be xgrammar's compact one; the walk pins whichever it uses.
    rng = random.Random(2)
    for _ in range(6):
        g = compile_ok(backend, "json", json.dumps(schema))
        prefix = ""
        for _step in range(100):
            got = allowed(g, vocab)
            ref = reference(language, prefix, token_text)
            assert got and got <= ref, (prefix, sorted(got - ref)[:10])
            tok = rng.choice(sorted(got))
            assert g.accept_token(tok)
            if tok == EOS:
                break
            prefix += token_text[tok]
        obj = json.loads(prefix)
        assert obj["a"] in ("x", "yz") and isinstance(obj["b"], bool) and set(obj) == {"a", "b"}


def test_rejected_token_leaves_state(backend, tokenizer, vocab):
    g = compile_ok(backend, "regex", "(yes|no)")
    bad = tokenizer.encode("zzz", add_special_tokens=False)[0]
    assert not g.accept_token(bad)
    for t in tokenizer.encode("yes", add_special_tokens=False):
        assert g.accept_token(t)
    assert not g.is_terminated() and g.accept_token(EOS) and g.is_terminated()


@pytest.mark.parametrize("kind,text,field", [
    ("regex", "([a", "regex"),
    ("json", "{not json", "json_schema"),
    ("json", '{"type": "no-such-type"}', "json_schema"),
    ("ebnf", "root ::= ", "ebnf"),
    ("structural_tag", '{"structures": [{"begin": "<f>"}]}', "structural_tag"),
])
def test_compile_errors_name_the_field(backend, kind, text, field):
    err = backend.validate((kind, text))
    assert err is not None and err.startswith(f"sampling_params.{field} is not a valid"), err
    assert "/project/" not in err and not err.startswith("[")  # native prefix stripped


def test_structural_tag_upstream_format_compiles(backend):
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    assert backend.validate(("structural_tag", json.dumps(tag))) is None


# A length-bounded string let raw U+0000-U+001F through (mlc-ai/xgrammar#286); json.loads rejects them.
_BOUNDED = {"type": "string", "minLength": 1, "maxLength": 6}
_CONTROL_TAGS = [
    ("json", {"type": "object", "properties": {"s": _BOUNDED}, "required": ["s"]}),
    ("json", {"type": "array", "items": _BOUNDED, "minItems": 1, "maxItems": 2}),
    ("json", {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "boolean"},
             "minProperties": 1, "maxProperties": 1}),
    ("structural_tag", {"structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"s": _BOUNDED},
                                                                   "required": ["s"]}, "end": "</f>"}],
                        "triggers": ["<f>"]}),
    ("structural_tag", {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": _BOUNDED}}),
]


@pytest.mark.parametrize("kind,spec", _CONTROL_TAGS)
def test_json_strings_never_hold_raw_control_characters(backend, token_text, vocab, kind, spec):
    """A walk that takes a control-character token whenever the mask allows one (the model "wants"
    them) still ends in text whose JSON parses."""
    control = {t for t, s in token_text.items() if any(ord(c) < 0x20 for c in s)}
    assert control, "the tiny tokenizer has byte tokens for U+0000-U+001F"
    rng = random.Random(3)
    for walk in range(4):
        g, text = compile_ok(backend, kind, json.dumps(spec)), ""
        if kind == "structural_tag":  # free text, then the trigger opens the constrained part
            text = "<f>" if "structures" in spec else ""
            for t in tokenizer_ids(token_text, text):
                assert g.accept_token(t)
        for step in range(120):
            got = allowed(g, vocab)
            # Later steps avoid them, so a walk through whitespace-tolerant JSON (tabs, newlines) ends.
            wanted = (sorted(got & control) if step < 40 else []) or sorted(got - control - {EOS}) or [EOS]
            tok = rng.choice(wanted)
            assert g.accept_token(tok)
            if tok == EOS or g.is_terminated():
                break
            text += token_text[tok]
            if "</f>" in text:  # the tag closed; free text follows it
                break
        else:
            pytest.fail(f"walk did not terminate: {text!r}")
        body = text.removeprefix("<f>").split("</f>")[0]
        json.loads(body)  # raw control characters inside a string would raise here


def tokenizer_ids(token_text: dict[int, str], text: str) -> list[int]:
    """Greedy longest-match ids of `text` (enough for a short ASCII trigger)."""
    by_text = {s: t for t, s in token_text.items()}
    ids, i = [], 0
    while i < len(text):
        j = max(j for j in range(i + 1, len(text) + 1) if text[i:j] in by_text)
        ids.append(by_text[text[i:j]])
        i = j
    return ids


def test_exclude_raw_control_chars_touches_string_classes_only():
    from sglang.srt.constrained.xgrammar_backend import exclude_raw_control_chars

    ebnf = r'a ::= [^\"\\\r\n] "[^\"b]" [^x] [^\0-\x1f\"\\]' + "\n"
    assert exclude_raw_control_chars(ebnf) == r'a ::= [^\0-\x1f\"\\\r\n] "[^\"b]" [^x] [^\0-\x1f\"\\]' + "\n"


def test_cache_compiles_once_and_copies_are_independent(tokenizer, vocab):
    b = XGrammarGrammarBackend(tokenizer, vocab, eos_token_ids=[EOS])
    # The compile is held until both lookups are made: without the gate a busy machine may finish it
    # between them (a cache hit, not the concurrent miss under test).
    gate = threading.Event()
    compile_ = b._init_value_dispatch
    b._init_value_dispatch = lambda key: (gate.wait(), compile_(key))[1]
    try:
        key = ("regex", "(yes|no)-[0-9]")
        first, hit1 = b.get_cached_or_future_value(key)
        second, hit2 = b.get_cached_or_future_value(key)  # concurrent miss: same compile
        assert not hit1 and not hit2 and b.num_compiles == 1
        gate.set()
        g1, g2 = first.result(WAIT_S), second.result(WAIT_S)
        assert g1 is not g2 and g1.matcher is not g2.matcher
        g3, hit3 = b.get_cached_or_future_value(key)
        assert hit3 and b.num_compiles == 1
        for t in tokenizer.encode("yes", add_special_tokens=False):
            assert g1.accept_token(t)
        assert allowed(g2, b.vocab_size) == allowed(g3, b.vocab_size) != allowed(g1, b.vocab_size)
        bad = ("regex", "(")
        assert b.validate(bad) is not None and b.validate(bad) is not None
        value, hit = b.get_cached_or_future_value(bad)
        assert hit and isinstance(value, InvalidGrammar) and b.num_compiles == 2
    finally:
        b.shutdown()


def test_compile_runs_off_the_caller_thread():
    gate = threading.Event()

    class Slow(BaseGrammarBackend):
        def dispatch_regex(self, s):
            gate.wait(WAIT_S)
            raise ValueError("slow and bad")

    b = Slow()
    try:
        fut, hit = b.get_cached_or_future_value(("regex", "x"))
        assert not hit and not fut.done()  # returned while the compile is still blocked
        gate.set()
        value = fut.result(WAIT_S)
        assert isinstance(value, InvalidGrammar) and "slow and bad" in value.error_message()
    finally:
        b.shutdown()


def test_factory(tokenizer, vocab):
    args = ServerArgs(model_path="x", grammar_backend="none")
    assert create_grammar_backend(args, tokenizer, vocab) is None
    args = ServerArgs(model_path="x")
    b = create_grammar_backend(args, tokenizer, vocab, eos_token_ids=[EOS])
    assert isinstance(b, XGrammarGrammarBackend) and EOS in b.stop_token_ids and b.vocab_size == vocab
    b.shutdown()


def test_sampling_batch_info_applies_the_mask_to_constrained_rows_only(backend, tokenizer, vocab):
    g = compile_ok(backend, "regex", "(yes|no)")
    params = [SamplingParams(), SamplingParams(regex="(yes|no)"), SamplingParams()]
    info = SamplingBatchInfo.from_params(params, vocab, "cpu", grammars=[None, g, None])
    assert info.vocab_mask is not None and info.vocab_mask.dtype == torch.int32
    logits = torch.randn(3, vocab)
    before = logits.clone()
    info.apply_logits_bias(logits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = set(torch.isfinite(logits[1]).nonzero().view(-1).tolist())
    assert finite == allowed(g, vocab) and 0 < len(finite) < vocab
    plain = SamplingBatchInfo.from_params(params, vocab, "cpu", grammars=[None, None, None])
    assert plain.vocab_mask is None and plain.apply_mask_func is None


def test_sampling_params_grammar_fields():
    p = SamplingParams.from_dict({"json_schema": {"type": "object"}})
    p.normalize(None)
    p.verify(10)
    assert p.json_schema == '{"type": "object"}' and grammar_key(p) == ("json", p.json_schema)
    assert grammar_key(SamplingParams.from_dict({"ebnf": 'root ::= "a"'})) == ("ebnf", 'root ::= "a"')
    assert grammar_key(SamplingParams()) is None
    two = SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'})
    with pytest.raises(ValueError, match="regex.*ebnf|ebnf.*regex"):
        two.verify(10)
    with pytest.raises(ValueError, match="regex"):
        SamplingParams.from_dict({"regex": 5}).verify(10)
    with pytest.raises(ValueError, match="custom_params"):
        SamplingParams.from_dict({"custom_params": [1]}).verify(10)
    with pytest.raises(ValueError, match="unknown parameter"):
        SamplingParams.from_dict({"json_schemas": "{}"})
    q = SamplingParams.from_dict({"regex": "a+", "custom_params": {"k": 1}})
    assert SamplingParams.from_dict(q.to_dict()) == q


def test_cache_is_bounded_lru(tokenizer, vocab):
    b = XGrammarGrammarBackend(tokenizer, vocab, eos_token_ids=[EOS])
    b.max_cache_entries = 2
    try:
        for pattern in ("a", "b"):
            assert b.validate(("regex", pattern)) is None
        b.get_cached_or_future_value(("regex", "a"))  # "a" is now the most recently used
        assert b.validate(("regex", "c")) is None
        assert list(b.cache) == [("regex", "a"), ("regex", "c")]
        assert b.num_compiles == 3
    finally:
        b.shutdown()


def test_mask_and_processors_make_no_host_sync(backend, vocab):
    from types import SimpleNamespace

    from sglang.srt.layers.sampler import apply_custom_logit_processor
    from sglang.srt.testing.logit_processors import ScriptedTokensLogitProcessor
    from sglang.srt.testing.sync_guard import no_host_sync

    g = compile_ok(backend, "regex", "(yes|no)")
    req = SimpleNamespace(output_ids=[], eos_token_ids=frozenset([EOS]))
    params = [SamplingParams(regex="(yes|no)"), SamplingParams()]
    info = SamplingBatchInfo.from_params(
        params, vocab, "cpu", grammars=[g, None], custom_logit_processors=[None, ScriptedTokensLogitProcessor.to_str()],
        custom_params=[None, {"token_ids": [42], "__req__": req}])
    logits = torch.randn(2, vocab)
    with no_host_sync():
        info.update_regex_vocab_mask()
        info.apply_logits_bias(logits)
        apply_custom_logit_processor(logits, info)
    assert set(torch.isfinite(logits[0]).nonzero().view(-1).tolist()) == allowed(g, vocab)
    assert torch.isfinite(logits[1]).nonzero().view(-1).tolist() == [42]


class _Group:
    """A TP group whose rank-0 broadcast is given: the ready list this rank will receive."""

    is_single = False

    def __init__(self, rank0_ready: list[int]) -> None:
        self.rank0_ready = rank0_ready

    def broadcast_object(self, obj, src: int = 0):
        return self.rank0_ready


def test_tp_ranks_queue_cache_hits_so_admission_is_rank0s(tokenizer, vocab):
    """A grammar already compiled here (cache hit) may still compile on another rank: under TP it
    must wait in the queue like a miss, and leave it only when rank 0's broadcast list says so --
    otherwise the ranks' waiting queues, and so their batches, differ (a collective mismatch)."""
    from concurrent.futures import Future

    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.managers.schedule_batch import Req

    backend = XGrammarGrammarBackend(tokenizer, vocab, eos_token_ids=[EOS])
    sp = SamplingParams(regex=r"(yes|no)")
    backend.get_cached_or_future_value(("regex", sp.regex))[0].result(WAIT_S)  # now a cache hit here

    def req(rid):
        return Req(rid, [1, 2, 3], sp)

    single = GrammarManager(backend, type("G", (), {"is_single": True})())
    assert single.process_req_with_grammar(req("a")) is False  # one rank: a hit goes straight on

    not_yet = GrammarManager(backend, _Group(rank0_ready=[]))
    r = req("b")
    assert not_yet.process_req_with_grammar(r) is True and isinstance(r.grammar, Future)
    assert not_yet.get_ready_grammar_requests() == [] and len(not_yet) == 1  # rank 0 is still compiling

    now = GrammarManager(backend, _Group(rank0_ready=[0]))
    r = req("c")
    assert now.process_req_with_grammar(r) is True
    (out,) = now.get_ready_grammar_requests()
    assert out is r and not isinstance(r.grammar, Future) and not out.finished()
    assert allowed(r.grammar, backend.vocab_size)  # a live matcher of its own
    backend.shutdown()
