"""Incremental detokenization (per request state); the detokenizer process wraps it.

Text is emitted only once it is final: bytes of an incomplete UTF-8 character are held back
(the tokenizer decodes them as U+FFFD), and so is any tail that could be the start of a stop
string. On finish, a matched stop string (and text after it) or a matched stop token is
trimmed unless `no_stop_trim`.
"""

from __future__ import annotations


def _stop_holdback(text: str, stop_strs: list[str]) -> int:
    """Chars at the end of `text` that could begin a stop string."""
    hold = 0
    for s in stop_strs:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class DecodeState:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop_strs: list[str] | None = None, no_stop_trim: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop_strs = [s for s in (stop_strs or []) if s]
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.surr_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def push(self, new_ids: list[int], finished_reason: dict | None = None) -> str:
        """Add tokens; returns the newly final text."""
        finished = finished_reason is not None
        ids = list(new_ids)
        if finished and not self.no_stop_trim and isinstance((finished_reason or {}).get("matched"), int) and ids:
            ids = ids[:-1]  # the matched stop token is not part of the text
        self.ids.extend(ids)
        new = self._decode(self.ids[self.surr_offset :])
        if finished or not new.endswith("\ufffd"):
            surr = self._decode(self.ids[self.surr_offset : self.read_offset])
            self.text += new[len(surr) :]
            self.surr_offset, self.read_offset = self.read_offset, len(self.ids)
        end = len(self.text)
        if finished:
            matched = (finished_reason or {}).get("matched")
            if isinstance(matched, str) and matched and not self.no_stop_trim:
                cut = self.text.find(matched, max(self.sent - len(matched), 0))
                if cut < 0:
                    cut = self.text.find(matched)
                if cut >= 0:
                    self.text = self.text[: max(cut, self.sent)]
                    end = len(self.text)
        else:
            end -= _stop_holdback(self.text[self.sent :], self.stop_strs)
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta
