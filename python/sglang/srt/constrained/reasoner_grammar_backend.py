"""Reasoning-aware grammars (upstream's ReasonerGrammarObject): a thinking request's output is
unconstrained until its end-of-think marker, then its grammar (json_schema, a forced tool call, ...)
constrains the rest. Without this the forced JSON would be generated inside the think block.

Rules:
- The marker is a token-id sequence: the reasoning parser's end token (`</think>`) as the tokenizer
  encodes it alone -- one special token in the real DeepSeek-V3.2 / GLM-5 vocabularies, several
  in the tiny builtin ones. The tokens up to and including the marker are never fed to the grammar.
- While thinking, the request's mask row is left as allocated (every token allowed) and
  `is_terminated()` is False, so only EOS or max_new_tokens can end the request there.
- The wrapper is per request, like the matcher it wraps: `copy()` copies both.
"""

from __future__ import annotations

import torch

from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject


class ReasonerGrammarObject(BaseGrammarObject):
    def __init__(self, grammar: BaseGrammarObject, think_end_ids: list[int], in_reasoning: bool = True) -> None:
        super().__init__()
        if not think_end_ids:
            raise ValueError("think_end_ids must name at least one token")
        self.grammar = grammar
        self.think_end_ids = [int(t) for t in think_end_ids]
        self.in_reasoning = in_reasoning
        self._recent: list[int] = []  # the latest len(think_end_ids) tokens

    @property
    def vocab_size(self):  # SamplingBatchInfo sizes the batch's mask by the grammar's vocabulary
        return getattr(self.grammar, "vocab_size", None)

    def accept_token(self, token: int) -> bool:
        if not self.in_reasoning:
            return self.grammar.accept_token(token)
        n = len(self.think_end_ids)
        self._recent = (self._recent + [int(token)])[-n:]
        if self._recent == self.think_end_ids:
            self.in_reasoning = False
        return True

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        return self.grammar.allocate_vocab_mask(vocab_size, batch_size, device)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        if not self.in_reasoning:
            self.grammar.fill_vocab_mask(vocab_mask, idx)

    def move_vocab_mask(self, vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return self.grammar.move_vocab_mask(vocab_mask, device)

    def apply_vocab_mask(self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        self.grammar.apply_vocab_mask(logits, vocab_mask)

    def is_terminated(self) -> bool:
        return not self.in_reasoning and self.grammar.is_terminated()

    def copy(self) -> "ReasonerGrammarObject":
        return ReasonerGrammarObject(self.grammar.copy(), self.think_end_ids, self.in_reasoning)

    @property
    def finished(self) -> bool:
        return self.grammar.finished

    @finished.setter
    def finished(self, finished: bool) -> None:
        self.grammar.finished = finished


def maybe_reasoner(grammar, sampling_params):
    """Wrap a request's fresh grammar when the request thinks first (its SamplingParams carry
    `think_end_ids`, set by the chat handler); anything else (None, an InvalidGrammar) as it is."""
    ids = getattr(sampling_params, "think_end_ids", None)
    if ids and isinstance(grammar, BaseGrammarObject):
        return ReasonerGrammarObject(grammar, ids)
    return grammar
