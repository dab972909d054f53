"""Helpers shared by the streaming parsers (reasoning and tool calls).

Every parser here runs ONE state machine for both modes: non-stream parsing feeds the whole
text into a fresh machine and flushes it. Streaming output therefore equals non-stream output
for any chunking, as long as each machine decides only on content it has fully seen; the two
helpers below are what make that hold for marker prefixes and for `str.strip()`.
"""

from __future__ import annotations


def partial_suffix_len(text: str, markers: list[str] | tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker.

    That suffix must be held back: the next chunk may complete the marker.
    """
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class StripStream:
    """Streams `"".join(pieces).strip()` incrementally.

    Leading whitespace is dropped; trailing whitespace is withheld until non-whitespace follows.
    Whitespace still withheld when the stream ends is exactly what `.strip()` removes, so no
    flush is needed to stay equal to the non-stream result.
    """

    def __init__(self) -> None:
        self._started = False
        self._pending_ws = ""

    def feed(self, text: str) -> str:
        if not text:
            return ""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        tail = text[len(body):]
        if not body:
            self._pending_ws += tail
            return ""
        out = self._pending_ws + body
        self._pending_ws = tail
        return out
