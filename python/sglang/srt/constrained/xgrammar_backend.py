r"""Constrained decoding with xgrammar (PyPI `xgrammar`): packed int32 bitmasks, one bit per token.

Vocabulary: the mask covers the model's vocabulary (`vocab_size`, usually padded past the
tokenizer's real size); ids the tokenizer does not have are never allowed. Stop tokens are the
model's EOS ids (config + tokenizer), so a grammar ends on a token that also ends the request.

JSON strings: xgrammar's schema converter lets a length-bounded string (minLength / maxLength,
propertyNames) hold raw U+0000-U+001F (its class is `[^\"\\\r\n]`, mlc-ai/xgrammar#286), which
`json.loads` rejects. Grammars built from a JSON schema or a structural tag are therefore converted
to EBNF and every string-character class (a negated class that excludes `"`) loses the control
characters too, as xgrammar's own unbounded `basic_string` already does.
"""

from __future__ import annotations

import json
import re

import torch
import xgrammar

from sglang.srt.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject

# An EBNF string literal (skipped: an enum value may read "[^a]") or a negated class's body.
_LITERAL_OR_NEGATED_CLASS = re.compile(r'("(?:\\.|[^"\\])*")|\[\^((?:\\.|[^\]\\])*)\]')
_CONTROL_RANGE = r"\0-\x1f"


def exclude_raw_control_chars(ebnf: str) -> str:
    """Make every JSON-string character class of xgrammar's printed EBNF exclude U+0000-U+001F."""

    def fix(m: re.Match) -> str:
        body = m.group(2)
        if body is None or '\\"' not in body or _CONTROL_RANGE in body:
            return m.group(0)  # a literal, a class that is not a string's characters, or already right
        return f"[^{_CONTROL_RANGE}{body}]"

    return _LITERAL_OR_NEGATED_CLASS.sub(fix, ebnf)


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int, ctx: xgrammar.CompiledGrammar) -> None:
        super().__init__()
        self.matcher, self.vocab_size, self.ctx = matcher, vocab_size, ctx

    def accept_token(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        # All ones (-1) = every token allowed: rows of unconstrained requests stay that way.
        mask = xgrammar.allocate_token_bitmask(batch_size, vocab_size)
        if torch.device(device).type == "cuda":
            mask = mask.pin_memory()  # so the one upload per step is truly asynchronous
        return mask

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device, non_blocking=True))

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def copy(self) -> "XGrammarGrammar":
        matcher = xgrammar.GrammarMatcher(self.ctx)
        return XGrammarGrammar(matcher, self.vocab_size, self.ctx)


class XGrammarGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int] | None = None,
                 any_whitespace: bool = True, max_workers: int = 2) -> None:
        super().__init__(max_workers)
        stop = sorted(set(eos_token_ids or ()) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None
                                                     else set()))
        # The mask has to cover both the model's rows of logits and every id the tokenizer knows.
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop or None)
        self.grammar_compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=max_workers)
        self.any_whitespace = any_whitespace

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer_info.stop_token_ids)

    def _from_context(self, ctx: xgrammar.CompiledGrammar) -> XGrammarGrammar:
        return XGrammarGrammar(xgrammar.GrammarMatcher(ctx),
                               self.vocab_size, ctx)

    def dispatch_json(self, key_string: str) -> XGrammarGrammar:
        if key_string == "$$ANY$$":  # upstream's key for "any JSON" (response_format json_object)
            return self._from_context(self.grammar_compiler.compile_builtin_json_grammar())
        json.loads(key_string)  # a clear "not JSON" error before the schema compiler's
        grammar = xgrammar.Grammar.from_json_schema(key_string, any_whitespace=self.any_whitespace)
        return self._compile_json_grammar(grammar)

    def _compile_json_grammar(self, grammar: xgrammar.Grammar) -> XGrammarGrammar:
        return self._from_context(self.grammar_compiler.compile_grammar(exclude_raw_control_chars(str(grammar))))

    def dispatch_regex(self, key_string: str) -> XGrammarGrammar:
        return self._from_context(self.grammar_compiler.compile_regex(key_string))

    def dispatch_ebnf(self, key_string: str) -> XGrammarGrammar:
        return self._from_context(self.grammar_compiler.compile_grammar(key_string))

    def dispatch_structural_tag(self, key_string: str) -> XGrammarGrammar:
        tag = json.loads(key_string)
        if isinstance(tag, dict) and "structures" in tag:
            # Upstream's format: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}.
            items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            grammar = xgrammar.Grammar.from_structural_tag(items, tag["triggers"])
        else:  # xgrammar's own structural tag format ({"type": "structural_tag", "format": ...})
            grammar = xgrammar.Grammar.from_structural_tag(key_string)
        return self._compile_json_grammar(grammar)

    def reset(self) -> None:
        super().reset()
        self.grammar_compiler.clear_cache()
