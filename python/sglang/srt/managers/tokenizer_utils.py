"""Tokenizer loading, and what the server derives from a tokenizer once."""

from __future__ import annotations

import functools
import json
import os

# Unicode normalisers shrink text by at most 4x in UTF-8 bytes: the largest case is a 4-byte
# compatibility character becoming one ASCII byte (NFKC U+1D400 -> "A"); compositions merge at
# most 3x (Hangul L+V+T jamo, 9 -> 3 bytes). They never delete a character. Normalisers that can
# delete text (Strip, Replace, BertNormalizer, ...) give no bound at all.
_BOUNDED_NORMALIZERS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    from sglang.srt.model_loader.builtin import resolve_model_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_model_path(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (printable stand-ins for the 256 byte values)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _normalizer_shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    if spec.get("type") == "Sequence":
        parts = [_normalizer_shrink(p) for p in spec.get("normalizers", [])]
        # One pass cannot take a character below one byte, so a sequence is bounded by its worst part.
        return None if None in parts else max(parts, default=1)
    return _BOUNDED_NORMALIZERS.get(spec.get("type"))


def _is_byte_level(spec: dict | None) -> bool:
    if not spec:
        return False
    if spec.get("type") == "ByteLevel":
        return True
    return any(_is_byte_level(p) for p in spec.get("pretokenizers", []) or [])


def max_input_bytes_per_token(tokenizer) -> int | None:
    """The most UTF-8 bytes of input text one token can stand for, or None where no bound is
    known. A prompt of B bytes then has at least ceil(B / bound) tokens, so one that cannot fit
    the context is rejected before it is tokenized.

    Byte-level BPE: a token covers exactly the bytes it spells, so the bound is the longest
    vocabulary entry (added / special tokens count by their text, which can match in the input),
    times the normaliser's worst shrink (see _BOUNDED_NORMALIZERS)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if spec.get("model", {}).get("type") != "BPE" or not _is_byte_level(spec.get("pre_tokenizer")):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    dec = byte_level_decoder()
    added = set(tokenizer.get_added_vocab())
    # Vocabulary entries spell bytes in the byte alphabet (one char per byte); added tokens are
    # matched as plain text, so they count by their UTF-8 length.
    longest = max((len(t.encode("utf-8")) if t in added else sum(1 if ch in dec else len(ch.encode("utf-8"))
                                                                 for ch in t)
                   for t in tokenizer.get_vocab()), default=1)
    return max(longest, 1) * shrink
