"""OpenAI-compatible request / response models (plus SGLang's extra sampling fields)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_serializer, model_validator

from sglang.srt.managers.tokenizer_manager import RequestError


MAX_N = 128  # choices per request (OpenAI's limit); each choice is a full request to the scheduler


class _Request(BaseModel):
    # Unknown fields are ignored, as the OpenAI API does for forward compatibility.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage (so far) on every chunk


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


# Upstream SGLang request fields this server does not implement: a request that sets one (to a
# non-default value) is refused with a 400 naming it rather than silently served without it.
UNSUPPORTED_FIELDS = {
    "lora_path": None, "session_id": None, "session_params": None, "stop_regex": None,
    "return_routed_experts": False,
    "routed_dp_rank": None, "data_parallel_rank": None, "images_config": None, "input_ids": None,
    # OpenAI fields with no meaning for a text-only model without tools of its own
    "functions": None, "function_call": None, "audio": None, "prediction": None, "web_search_options": None,
}


class SamplingExtras(_Request):
    """Fields shared by completions and chat, including SGLang's extensions."""

    model: str = "default"
    temperature: float = 1.0
    # PD disaggregation: set by the router (upstream's names), the same on the prefill and decode server.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
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
    response_format: ResponseFormat | None = None
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
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    return_hidden_states: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for name, default in UNSUPPORTED_FIELDS.items():
                if values.get(name, default) not in (default, None):
                    raise ValueError(f"{name} is not supported by this server")
        return values

    def grammar_params(self) -> dict[str, str]:
        """regex / ebnf / json_schema sampling params from the request (response_format included);
        more than one constraint is a 400 naming them."""
        out: dict[str, str] = {k: v for k in ("regex", "ebnf", "json_schema") if (v := getattr(self, k))}
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                out["json_schema"] = json.dumps({"type": "object"})
            else:
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise RequestError("response_format.json_schema.schema is required for type json_schema",
                                       param="response_format")
                out["json_schema"] = json.dumps(rf.json_schema.schema_)
            if len(out) > 1:
                raise RequestError("response_format cannot be combined with regex / ebnf / json_schema",
                                   param="response_format")
        if len(out) > 1:
            raise RequestError(f"at most one of regex / ebnf / json_schema may be set, got {sorted(out)}",
                               param=sorted(out)[0])
        return out

    def grammar_param(self, param: str | None) -> str | None:
        """Name a grammar error after the field the client set (response_format compiles as json_schema)."""
        if param == "json_schema" and self.json_schema is None and self.response_format is not None:
            return "response_format"
        return param

    def max_tokens_field(self) -> str:
        """The field that set the completion's length (chat: the one the client sent)."""
        return "max_tokens"

    def client_error(self, e: RequestError) -> RequestError:
        """Name an error of the tokenizer manager (which speaks in `sampling_params` names) after
        the field this client sent: max_new_tokens -> max_tokens / max_completion_tokens, ..."""
        renames = {"max_new_tokens": self.max_tokens_field(), "min_new_tokens": "min_tokens",
                   "sampling_seed": "seed"}
        field = renames.get(e.param) or self.grammar_param(e.param)
        if e.param:
            e.message = e.message.replace(f"sampling_params.{e.param}", field)
            e.param = field
        return e

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        sp = {
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
            **self.grammar_params(),
        }
        if self.custom_params is not None:
            sp["custom_params"] = self.custom_params
        return sp


COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and upstream's /v1/completions default (chat: the context)


class CompletionRequest(SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _null_is_the_default(cls, v: int | None) -> int:
        # null is "not set" here (OpenAI documents 16 as the default); chat's null is the context.
        return COMPLETION_DEFAULT_MAX_TOKENS if v is None else v


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    index: int | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class Function(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: Function


class ToolChoiceFuncName(BaseModel):
    name: str


class ToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFuncName


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # neither set: up to the context length (OpenAI, upstream)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "required", "none"] | ToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    # SGLang extensions
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @model_validator(mode="after")
    def _tool_choice_default(self) -> "ChatCompletionRequest":
        if self.tool_choice is None:  # OpenAI: none without tools, auto with them
            self.tool_choice = "auto" if self.tools else "none"
        return self

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template sees (none with tool_choice none, as upstream)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs with reasoning_effort "none" switching thinking off (both spellings:
        deepseek-v3 reads `thinking`, GLM / Qwen read `enable_thinking`), as upstream does."""
        kw = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            on = self.reasoning_effort != "none"
            kw.setdefault("thinking", on)
            kw.setdefault("enable_thinking", on)
        return kw


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    reasoning_tokens: int | None = None  # only where a reasoning parser ran

    @model_serializer(mode="wrap")
    def _drop_unset_reasoning(self, handler):
        data = handler(self)
        if self.reasoning_tokens is None:
            data.pop("reasoning_tokens", None)
        return data


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage_of(results: list[dict]) -> UsageInfo:
    """Usage over a request's choices, given in choice order. With n > 1 a prompt is billed once
    and so are its cached tokens: both come from the prompt's first choice (upstream's usage
    processor does the same), so cached_tokens <= prompt_tokens always holds."""
    prompt = cached = 0
    seen = set()
    for r in results:
        key = r["meta_info"].get("prompt_index", id(r))
        if key not in seen:
            seen.add(key)
            prompt += r["meta_info"]["prompt_tokens"]
            cached += r["meta_info"].get("cached_tokens", 0)
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})


def finish_reason_of(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(fr.get("type"), "stop")


def matched_stop_of(meta: dict) -> int | str | None:
    """The stop token id or string that ended the output; None when it ended for another reason."""
    return (meta.get("finish_reason") or {}).get("matched")


# -- tokenize / detokenize / model cards (upstream's /v1/tokenize, /v1/detokenize, /v1/models/{id}) --
class TokenizeRequest(_Request):
    """Exactly one of `prompt` (a string or a list of strings) and `messages` (rendered with the
    chat template, as /v1/chat/completions would)."""

    model: str = "default"
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    # with messages, as on /v1/chat/completions
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "required", "none"] | ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    reasoning_effort: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=self.messages or [], tools=self.tools, tool_choice=self.tool_choice,
                                     chat_template_kwargs=self.chat_template_kwargs,
                                     continue_final_message=self.continue_final_message,
                                     reasoning_effort=self.reasoning_effort)


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
