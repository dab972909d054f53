"""The request length rule, in one place: the tokenizer manager applies it before a request is
queued (and, with a lower bound on the prompt's tokens, before tokenizing), the scheduler again on
arrival (the offline Engine has no tokenizer manager)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LengthError:
    message: str
    param: str
    code: str | None = None


def max_new_tokens_limit(n_input: int, max_total_tokens: int, page_size: int, tokens_per_step: int = 1) -> int:
    """The most new tokens a request of n_input prompt tokens can be given so that, alone, it fits the
    KV pool to its last token: the prompt, its outputs, a page of partial-page slack and the rows a step
    in flight plus the next one may hold past the committed KV (`tokens_per_step` each: 1, or a verify's
    draft tokens + 1). The scheduler caps max_new_tokens to it, as upstream SGLang does: admission
    reserves a share of max_new_tokens, so a request asking for more than the pool holds would
    otherwise never be admitted and, first in line, block every request behind it."""
    return max_total_tokens - page_size - 2 * tokens_per_step - n_input


def request_length_error(n_input: int, max_new_tokens: int | None, context_len: int, max_total_tokens: int,
                         page_size: int, at_least: bool = False, tokens_per_step: int = 1) -> LengthError | None:
    """Why a prompt of n_input tokens asking for max_new_tokens cannot run, or None. `at_least`:
    n_input is only a lower bound (the pre-tokenization check). A request that fits the context but
    not the KV pool is not an error: the scheduler caps its max_new_tokens (max_new_tokens_limit)."""
    if n_input == 0 and not at_least:
        return LengthError("the prompt is empty", "prompt")
    total = n_input + (max_new_tokens or 0)
    many = "at least " if at_least else ""
    if total > context_len:
        # Upstream SGLang's words (clients match on them), with our token counts.
        if n_input >= context_len:
            return LengthError(
                f"The input ({many}{n_input} tokens) is longer than the model's context length ({context_len} "
                f"tokens). This model's maximum context length is {context_len} tokens. However, you requested "
                f"{many}{total} tokens ({many}{n_input} in the prompt, {max_new_tokens or 0} for the completion).",
                "prompt", "context_length_exceeded")
        return LengthError(
            f"max_completion_tokens is too large: {max_new_tokens}. This model's maximum context length is "
            f"{context_len} tokens. However, you requested {many}{total} tokens ({many}{n_input} in the prompt, "
            f"{max_new_tokens} for the completion); at most {context_len - n_input} completion tokens fit.",
            "max_new_tokens", "context_length_exceeded")
    if max_new_tokens_limit(n_input, max_total_tokens, page_size, tokens_per_step) < 1:
        return LengthError(f"the prompt ({many}{n_input} tokens) cannot fit in the KV cache ({max_total_tokens} "
                           "tokens) with room to generate", "prompt", "context_length_exceeded")
    return None
