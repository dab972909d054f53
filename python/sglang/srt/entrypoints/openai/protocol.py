"""OpenAI-compatible request / response models (plus SGLang's extra sampling fields)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict


MAX_N = 128  # choices per request (OpenAI's limit); each choice is a full request to the scheduler


class _Request(BaseModel):
    # Unknown fields are ignored, as the OpenAI API does for forward compatibility.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingExtras(_Request):
    """Fields shared by completions and chat, including SGLang's extensions."""

    model: str = "default"
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias,
            "sampling_seed": self.seed,
        }


class CompletionRequest(SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage_of(results: list[dict]) -> UsageInfo:
    """Usage over a request's choices; with n > 1 the prompt is billed once per distinct prompt."""
    prompt = 0
    seen = set()
    for r in results:
        key = r["meta_info"].get("prompt_index", id(r))
        if key not in seen:
            seen.add(key)
            prompt += r["meta_info"]["prompt_tokens"]
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    cached = sum(r["meta_info"].get("cached_tokens", 0) for r in results)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})


def finish_reason_of(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(fr.get("type"), "stop")


# -- tokenize / detokenize / model cards (upstream's /v1/tokenize, /v1/detokenize, /v1/models/{id}) --
from pydantic import StrictInt  # noqa: E402  (this section is appended; the imports above belong to others)


class TokenizeRequest(_Request):
    """Exactly one of `prompt` (a string or a list of strings) and `messages` (rendered with the
    chat template, as /v1/chat/completions would)."""

    model: str = "default"
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(_Request):
    model: str = "default"
    tokens: list[StrictInt] | list[list[StrictInt]]  # "1" / true / 1.0 are not token ids
    skip_special_tokens: bool = True


class DetokenizeResponse(BaseModel):
    text: str | list[str]


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "sglang"
    root: str | None = None
    max_model_len: int | None = None
