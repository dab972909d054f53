"""ReasonerGrammarObject: free until the end-of-think marker (a token sequence), then the wrapped
grammar; the mask row of a thinking request allows everything; copies are independent. CPU, fast."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")

from sglang.srt.constrained.reasoner_grammar_backend import ReasonerGrammarObject, maybe_reasoner  # noqa: E402
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(builtin_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path("tiny-glm-moe-dsa"))


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = XGrammarGrammarBackend(tokenizer, len(tokenizer), eos_token_ids=[tokenizer.eos_token_id],
                               any_whitespace=False)
    yield b
    b.shutdown()


def allowed(g, vocab: int) -> set[int]:
    mask = g.allocate_vocab_mask(vocab, 1, "cpu")
    g.fill_vocab_mask(mask, 0)
    logits = torch.zeros(1, vocab)
    g.apply_vocab_mask(logits, mask)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_free_until_marker_then_grammar(tokenizer, backend):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    end = enc("</think>")
    assert len(end) > 1  # the tiny vocabulary spells the marker in several tokens: the sequence is matched
    g = ReasonerGrammarObject(backend._init_value_dispatch(("regex", "yes|no")), end)
    vocab = backend.vocab_size
    assert allowed(g, vocab) == set(range(vocab))
    for t in enc("I think </thi") + end[:2] + enc("k maybe") + end:  # a partial marker is not the end
        assert g.accept_token(t)
        assert not g.is_terminated()
    assert not g.in_reasoning
    assert allowed(g, vocab) < set(range(vocab))
    copy = g.copy()
    for t in enc("yes"):
        assert g.accept_token(t)
    assert not g.accept_token(enc("no")[0]) and g.accept_token(tokenizer.eos_token_id) and g.is_terminated()
    assert not copy.is_terminated() and copy.accept_token(enc("no")[0])  # its own matcher


def test_maybe_reasoner_and_batch_mask(tokenizer, backend):
    sp = SamplingParams(regex="a")
    plain = backend._init_value_dispatch(("regex", "a"))
    assert maybe_reasoner(plain, sp) is plain and maybe_reasoner(None, sp) is None
    sp.think_end_ids = tokenizer.encode("</think>", add_special_tokens=False)
    thinking = maybe_reasoner(plain.copy(), sp)
    assert isinstance(thinking, ReasonerGrammarObject)
    assert "think_end_ids" not in sp.to_dict()  # never a client's field
    # In a batch: the thinking row (listed first, so its wrapper allocates the mask) allows every
    # token, the plain row only its grammar's.
    info = SamplingBatchInfo.from_params([SamplingParams(), SamplingParams()], backend.vocab_size, "cpu",
                                         grammars=[thinking, plain.copy()])
    logits = info.apply_logits_bias(torch.zeros(2, backend.vocab_size))
    assert bool((logits[0] == 0).all())
    assert set(torch.nonzero(logits[1] == 0).flatten().tolist()) == set(tokenizer.encode("a", add_special_tokens=False))
