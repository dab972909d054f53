"""Helpers of upstream's offline-engine docs: join an Engine stream's chunks into the final text.

Each stream chunk carries the whole text so far (as /generate's stream does), so a chunk's new part
is what follows the text already joined; `trim_overlap` keeps these helpers right for chunks that
overlap the joined text by any amount, which is how upstream's docs use them.
"""

from __future__ import annotations

from typing import Any


def trim_overlap(existing_text: str, new_chunk: str) -> str:
    """`new_chunk` without its longest prefix that is also a suffix of `existing_text`."""
    for i in range(min(len(existing_text), len(new_chunk)), 0, -1):
        if existing_text.endswith(new_chunk[:i]):
            return new_chunk[i:]
    return new_chunk


def stream_and_merge(llm: Any, prompt: str, sampling_params: dict | None) -> str:
    """The final text of `llm.generate(prompt, sampling_params, stream=True)`."""
    final_text = ""
    for chunk in llm.generate(prompt, sampling_params, stream=True):
        final_text += trim_overlap(final_text, chunk["text"])
    return final_text


async def async_stream_and_merge(llm: Any, prompt: str, sampling_params: dict | None):
    """Async generator of each chunk's new text from `await llm.async_generate(..., stream=True)`."""
    final_text = ""
    generator = await llm.async_generate(prompt, sampling_params, stream=True)
    async for chunk in generator:
        cleaned = trim_overlap(final_text, chunk["text"])
        final_text += cleaned
        yield cleaned
