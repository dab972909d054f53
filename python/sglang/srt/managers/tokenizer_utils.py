"""Tokenizer loading (offline only)."""

from __future__ import annotations

import os


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    from sglang.srt.model_loader.builtin import resolve_model_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_model_path(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
